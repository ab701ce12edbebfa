"""The README is the front door and docs/ holds the depth: check that they stay true to the tree.

Fast, no processes. Checked here:
  (a) every source file of glm5_train/, parallel/, launch/, tools/ and bench/ is named in the
      README's repository map, (b) every file the map names exists,
  (c) every relative link in README.md and docs/*.md resolves (file, and #anchor to a heading by
      GitHub's slug rules), (d) the README is at most 200 lines, (e) the README links every page
      of docs/ directly, (f) every row of the README's feature table links a doc that exists,
  (g) every repository file path the README and docs write out (`parallel/x.py`,
      `python tools/x.py`, ...) exists, so a moved or renamed file shows where docs still name it,
  and the lines CI and users rely on stay in the README.

The map's convention (stated at its top in the README): inside the map's code block an
unindented line whose first word ends in "/" opens that folder's block (a repo-relative folder);
each indented line below it names files of that folder, comma-separated, before two or more
spaces and the purpose.
"""

from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MAP_HEADING = "## Repository map"
FEATURES_HEADING = "## Features"
README_MAX_LINES = 200
# Folders whose source files the map must name; which files count as source.
MAPPED_FOLDERS = ("glm5_train", "parallel", "launch", "tools", "bench")
SCRIPT_FOLDERS = ("tools", "launch", "bench")  # .sh / .sbatch count here too

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
NAME = re.compile(r"^[\w.+-]+\.\w+$")
# A repository file path written out in prose or code: a top folder, then a name with one of
# these extensions (module references such as `glm5_train/model/dsa.DSAIndexer` do not match).
FILE_PATH = re.compile(r"(?<![\w/.-])((?:glm5_train|parallel|launch|tools|bench|tests|configs|docs)"
                       r"/[\w/.-]*\w\.(?:py|sh|sbatch|yaml|md|png|jsonl?))(?![\w/])")


# --- the checkers (each takes a repository root, so the tests below can plant faults) -------


def source_files(root: str) -> set[str]:
    """Repo-relative paths of every file the map must name."""
    found = set()
    for top in MAPPED_FOLDERS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in filenames:
                scripts = top in SCRIPT_FOLDERS and name.endswith((".sh", ".sbatch"))
                if (name.endswith(".py") and name != "__init__.py") or scripts:
                    found.add(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return found


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a "## " line) up to the next "## " heading."""
    lines = text.splitlines()
    if heading not in lines:
        raise AssertionError(f"README.md has no {heading!r} section")
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end])


def map_block(readme: str) -> list[str]:
    """The lines of the first code block of the README's repository map."""
    body = section(readme, MAP_HEADING).splitlines()
    fences = [i for i, line in enumerate(body) if line.startswith("```")]
    if len(fences) < 2:
        raise AssertionError(f"the README's {MAP_HEADING!r} section has no code block")
    return body[fences[0] + 1:fences[1]]


def parse_map(lines: list[str]) -> tuple[set[str], list[str]]:
    """(repo-relative paths the map names, lines it could not read)."""
    named, bad = set(), []
    folder = None
    for line in lines:
        if not line.strip():
            continue
        if not line[0].isspace():
            first = line.split()[0]
            folder = first.rstrip("/") if first.endswith("/") else None
            if folder is None:
                bad.append(f"{line!r}: an unindented line must open a folder block ('folder/ ...')")
            continue
        if folder is None:
            bad.append(f"{line!r}: a file line outside any folder block")
            continue
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        for name in (n.strip() for n in names.split(",")):
            if NAME.match(name):
                named.add(f"{folder}/{name}")
            else:
                bad.append(f"{line!r}: {name!r} is not a file name")
    return named, bad


def missing_from_map(expected: set[str], named: set[str]) -> str | None:
    """The failure message for source files the map does not name, or None."""
    missing = sorted(expected - named)
    if not missing:
        return None
    return ("add it to the README's repository map (a line under its folder's block, with a "
            "one-line purpose): " + ", ".join(missing))


def named_but_absent(root: str, named: set[str]) -> str | None:
    gone = sorted(path for path in named if not os.path.isfile(os.path.join(root, path)))
    if not gone:
        return None
    return ("the README's repository map names files that do not exist (moved or removed? "
            "update the map): " + ", ".join(gone))


def strip_code(text: str) -> str:
    """Markdown without fenced code blocks and inline code spans (links there are not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but '-' and '_'
    removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    """Every heading anchor of a markdown file (duplicates numbered as GitHub does)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            match = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if not match:
                continue
            slug = github_slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def links(path: str) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return LINK.findall(strip_code(handle.read()))


def is_relative(target: str) -> bool:
    return not re.match(r"^[a-zA-Z][\w+.-]*:", target) and not target.startswith("//")


def broken_links(root: str, path: str) -> list[str]:
    """Relative links of the markdown file ``path`` whose file or anchor does not exist."""
    rel = os.path.relpath(path, root).replace(os.sep, "/")
    bad = []
    for target in links(path):
        if not is_relative(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        dest_rel = os.path.relpath(dest, root).replace(os.sep, "/")
        if dest_rel.startswith("../"):
            bad.append(f"{rel}: {target} points outside the repository")
            continue
        if not os.path.exists(dest):
            bad.append(f"{rel}: {target} (no file {dest_rel})")
            continue
        if anchor and dest.endswith(".md") and anchor not in anchors(dest):
            bad.append(f"{rel}: {target} (no heading with anchor #{anchor} in {dest_rel})")
    return bad


def linked_files(root: str, path: str) -> set[str]:
    """Repo-relative files the markdown file links (relative links only, anchors dropped)."""
    out = set()
    for target in links(path):
        file_part = target.partition("#")[0]
        if is_relative(target) and file_part:
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part))
            out.add(os.path.relpath(dest, root).replace(os.sep, "/"))
    return out


def absent_paths(root: str, rel: str) -> list[str]:
    """Repository file paths the markdown file ``rel`` writes out that do not exist."""
    found = FILE_PATH.findall(read(root, rel))
    return sorted({f"{rel}: {path}" for path in found
                   if not os.path.exists(os.path.join(root, path))})


def feature_rows(readme: str) -> list[str]:
    rows = [line for line in section(readme, FEATURES_HEADING).splitlines()
            if line.startswith("|")]
    return rows[2:]  # header and separator


def doc_pages(root: str) -> list[str]:
    docs = os.path.join(root, "docs")
    return sorted(f"docs/{name}" for name in os.listdir(docs) if name.endswith(".md"))


def read(root: str, rel: str) -> str:
    with open(os.path.join(root, rel), encoding="utf-8") as handle:
        return handle.read()


# --- the checks on this repository ----------------------------------------------------------


def test_every_source_file_is_in_the_readme_map():
    named, bad = parse_map(map_block(read(REPO, "README.md")))
    assert not bad, "unreadable lines in the README's repository map:\n" + "\n".join(bad)
    message = missing_from_map(source_files(REPO), named)
    assert message is None, message


def test_every_file_the_map_names_exists():
    named, _ = parse_map(map_block(read(REPO, "README.md")))
    message = named_but_absent(REPO, named)
    assert message is None, message


def test_every_relative_link_in_the_readme_and_docs_resolves():
    bad = []
    for rel in ["README.md", *doc_pages(REPO)]:
        bad += broken_links(REPO, os.path.join(REPO, rel))
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_every_file_path_the_readme_and_docs_name_exists():
    bad = []
    for rel in ["README.md", *doc_pages(REPO)]:
        bad += absent_paths(REPO, rel)
    assert not bad, ("files named in the README or docs that do not exist (moved or renamed? "
                     "update the text, or name the tool command instead):\n" + "\n".join(bad))


def test_readme_is_at_most_200_lines():
    lines = read(REPO, "README.md").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move depth into docs/")


def test_readme_links_every_doc():
    linked = linked_files(REPO, os.path.join(REPO, "README.md"))
    unlinked = [page for page in doc_pages(REPO) if page not in linked]
    assert not unlinked, "link these from README.md (feature table or text): " + ", ".join(unlinked)


def test_every_feature_row_links_a_doc_that_exists():
    rows = feature_rows(read(REPO, "README.md"))
    assert len(rows) >= 10, "the README's feature table is missing or nearly empty"
    bad = []
    for row in rows:
        doc_cell = row.strip().strip("|").split("|")[-1]
        targets = [t.partition("#")[0] for t in LINK.findall(doc_cell)]
        docs = [t for t in targets if t.startswith("docs/") and t.endswith(".md")]
        if not docs or not all(os.path.isfile(os.path.join(REPO, t)) for t in docs):
            bad.append(row)
    assert not bad, "feature rows without a doc link that resolves:\n" + "\n".join(bad)


def test_readme_keeps_the_lines_ci_and_users_rely_on():
    readme = read(REPO, "README.md")
    lines = readme.splitlines()
    # .ci/run installs and tests with these; users copy them.
    assert 'pip install torch==2.13.0 && pip install -e ".[dev]"' in lines
    assert "python -m launch.local" in lines
    assert "python -m pytest -q tests" in lines
    assert "starts 8 CPU processes" in readme
    # tests/test_slurm.py runs the first sbatch command of this section, unchanged.
    slurm = section(readme, "## Multi-node training under slurm")
    block = slurm.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    first = next(line for line in block.splitlines() if line.startswith("sbatch "))
    assert first.split()[:3] == ["sbatch", "--nodes=2", "launch/slurm.sbatch"], first


def test_each_doc_starts_with_what_a_user_does_with_it():
    late = []
    for page in doc_pages(REPO):
        paragraphs = [p for p in read(REPO, page).split("\n\n") if p.strip()]
        if len(paragraphs) < 2 or "Use this" not in " ".join(paragraphs[1:3]):
            late.append(page)
    assert not late, "start these with 'Use this to ...' after the title: " + ", ".join(late)


# --- the checkers catch what they are for ---------------------------------------------------


def write(root, rel: str, text: str = "") -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def test_checker_catches_a_source_file_missing_from_the_map(tmp_path):
    root = str(tmp_path)
    for rel in ("glm5_train/train.py", "glm5_train/model/glm5.py", "glm5_train/__init__.py",
                "glm5_train/__pycache__/train.cpython-311.pyc", "bench/gpu/check.sh",
                "parallel/layout.py", "launch/slurm.sbatch", "tools/new_tool.py"):
        write(root, rel)
    readme = ("## Repository map\n\n```\nglm5_train/   the job\n  train.py   entry point\n"
              "glm5_train/model/\n  glm5.py   the model\nparallel/\n  layout.py  rules\n"
              "launch/\n  slurm.sbatch   batch script\n```\n")
    named, bad = parse_map(map_block(readme))
    assert not bad
    message = missing_from_map(source_files(root), named)
    assert message is not None and "add it to the README's repository map" in message
    assert "tools/new_tool.py" in message and "bench/gpu/check.sh" in message
    assert "__init__" not in message and ".pyc" not in message and "train.py" not in message
    # named, all present: nothing to report
    assert missing_from_map({"glm5_train/train.py"}, named) is None


def test_checker_catches_a_map_entry_whose_file_is_gone(tmp_path):
    root = str(tmp_path)
    write(root, "tools/a.py")
    named, _ = parse_map(["tools/", "  a.py, b.py   two tools"])
    assert named == {"tools/a.py", "tools/b.py"}
    message = named_but_absent(root, named)
    assert message is not None and "tools/b.py" in message and "tools/a.py" not in message


def test_checker_catches_unreadable_map_lines():
    _, bad = parse_map(["  orphan.py   before any folder", "tools/", "  not a file   purpose"])
    assert len(bad) == 2


def test_checker_catches_broken_links_and_anchors(tmp_path):
    root = str(tmp_path)
    write(root, "docs/a.md", "# Title\n\n## 1. The registry (`parallel/x.py`)\n\n## Same\n\n## Same\n")
    write(root, "README.md",
          "[ok](docs/a.md) [ok](docs/a.md#1-the-registry-parallelxpy) [ok](docs/a.md#same-1)\n"
          "[bad](docs/b.md) [bad](docs/a.md#nowhere) [out](../elsewhere.md)\n"
          "[web](https://example.com) `[code](docs/c.md)`\n"
          "```\n[fenced](docs/d.md)\n```\n")
    bad = broken_links(root, os.path.join(root, "README.md"))
    assert len(bad) == 3, bad
    assert any("docs/b.md" in b for b in bad) and any("#nowhere" in b for b in bad)
    assert any("outside the repository" in b for b in bad)
    assert linked_files(root, os.path.join(root, "README.md")) >= {"docs/a.md", "docs/b.md"}


def test_checker_catches_a_named_path_that_is_gone(tmp_path):
    root = str(tmp_path)
    write(root, "tools/plan_fit.py")
    write(root, "docs/a.md", "Run `python tools/plan_fit.py`; the costs are in\n"
          "`glm5_train/model/stage_costs.py` (`glm5_train/model/dsa.DSAIndexer` is a name).\n")
    assert absent_paths(root, "docs/a.md") == ["docs/a.md: glm5_train/model/stage_costs.py"]


def test_github_slug_rules():
    assert github_slug("1. The registry (`parallel/mcore_compat.py`)") == \
        "1-the-registry-parallelmcore_compatpy"
    assert github_slug("How 0.19.2 is checked") == "how-0192-is-checked"
    assert github_slug("What the job refuses before it starts") == \
        "what-the-job-refuses-before-it-starts"
