"""Check checkpoints against their manifests: every file present, with its size and its sha256
digest (every byte read), as a resume would before loading.

    python tools/verify_checkpoint.py PATH [PATH ...]

PATH is a save directory (``checkpoint.save``: each committed ``iter_*`` checked, newest first,
then the one a resume would load) or one checkpoint directory (holding
``glm5_manifest.json``). One line per checkpoint: ``ok``, or ``REFUSED`` with the reason naming
the file. A manifest from before digests (format 1) is checked by size, with a notice. Exit
status 0 when every checkpoint checked verifies, 1 when one does not, 2 for a PATH that is
neither kind of directory. No torch: it starts at once, on any machine that sees the files.
"""

from __future__ import annotations

import argparse
import os
import sys

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from glm5_train import checkpoint_store as store


# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  python tools/verify_checkpoint.py outputs/<run>/checkpoints
  python tools/verify_checkpoint.py outputs/<run>/checkpoints/iter_0000004
"""


def describe(directory: str, problem: str | None) -> str:
    """The line for one checkpoint directory, given ``store.verify``'s answer for it."""
    name = os.path.basename(os.path.normpath(directory))
    if problem is not None:
        return f"{name}: REFUSED: {problem}"
    manifest, _ = store.read_manifest(directory)
    size = sum(manifest.sizes.values())
    what = (f"{manifest.algorithm} of every file" if manifest.digests
            else "sizes only: its manifest predates digests (format 1)")
    return f"{name}: ok ({len(manifest.sizes)} files, {size / 1e6:.1f} MB; {what})"


def check_save_dir(root: str) -> tuple[bool, list[str]]:
    """Every committed checkpoint under ``root``, newest first, then the one a resume loads
    (found as the job finds it: by sizes, then its content; each directory hashed once)."""
    verdicts: dict[str, str | None] = {}

    def verdict(directory: str, iteration: int | None = None) -> str | None:
        if directory not in verdicts:
            verdicts[directory] = store.verify(directory, iteration)
        return verdicts[directory]

    iterations = list(reversed(store.committed_iterations(root)))
    lines = [describe(store.iteration_dir(root, i), verdict(store.iteration_dir(root, i), i))
             for i in iterations]
    while True:  # each pass refuses one more directory, or stops
        refused = {d: problem for d, problem in verdicts.items() if problem is not None}
        choice = store.choose(root, content=False, rejected=refused)
        if choice.path is None or verdict(choice.path) is None:
            break
    if choice.path is None:
        lines.append(f"a resume would find no complete checkpoint in {root} "
                     f"({choice.describe()})")
    else:
        why = f" ({choice.describe()})" if choice.notes else ""
        lines.append(f"a resume would load {choice.path}{why}")
    return all(verdicts[store.iteration_dir(root, i)] is None for i in iterations), lines


def check_path(path: str) -> tuple[bool, list[str]]:
    """(all verify, lines) for a checkpoint directory or a save directory; ValueError for a
    path that is neither."""
    if os.path.isfile(os.path.join(path, store.MANIFEST)):
        problem = store.verify(path)
        return problem is None, [describe(path, problem)]
    if store.committed_iterations(path):
        return check_save_dir(path)
    raise ValueError(f"{path!r} is neither a checkpoint directory (holding {store.MANIFEST}) "
                     "nor a save directory holding iter_NNNNNNN checkpoints: pass "
                     "checkpoint.save's directory or one of its iter_* directories")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/verify_checkpoint.py",
                                     description=__doc__.split("\n\n")[0],
                                     epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="a save directory or one checkpoint directory")
    args = parser.parse_args(argv)
    all_ok = True
    for path in args.paths:
        try:
            ok, lines = check_path(path)
        except ValueError as err:
            print(f"verify_checkpoint: error: {err}", file=sys.stderr)
            return 2
        all_ok &= ok
        for line in lines:
            print(line)
        notice = store.sizes_only_notice(path)
        if notice:
            print(notice)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
