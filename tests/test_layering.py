"""The layering of the source tree, enforced over its AST.

Layers, bottom to top (a module may import its own layer and the ones below):

    parallel          techniques; only the standard library, torch, megatron-core, parallel.*
    glm5_train.model  the GLM-5 model; + parallel.*
    glm5_train        the training job (data, loss, optimizer set-up, assembly, checkpoints, HF)
                      and, within it, the planner, glm5_train.plan (PLANNER_MAY_IMPORT):
                      + glm5_train.model, glm5_train.job_config with its config sections,
                      parallel.*; nothing in glm5_train.model, parallel or glm5_train.job_config
                      imports it (the job and everything above reach it through its front)
    launch            launchers
    tools, bench      command-line front ends and benchmarks
    tests             (may import anything listed in TEST_IMPORTS_OF_TOOLS from tools/)

Also: no import cycles between the project's modules (function-local imports count), and
imports sit at the top of modules; a function-local import is allowed only for an optional
dependency (OPTIONAL) or with a reason in LOCAL_IMPORT_REASONS. ``test_checker_catches_*``
plant violations in a scratch tree to show the checks fail when they should.
"""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("parallel", "glm5_train", "launch", "tools", "bench", "tests")
THIRD_PARTY_BELOW_MODEL = ("torch", "megatron")

# Optional dependencies: imported where used so that the project runs without them.
OPTIONAL = ("transformers", "transformer_engine", "tensorboard", "apex", "triton", "deepspeed",
            "matplotlib")

# (module, function) -> why the import cannot sit at the top of the module.
LOCAL_IMPORT_REASONS: dict[tuple[str, str], str] = {
    ("glm5_train.model.glm5", "_mtp_spec"):
        "megatron-core's Transformer Engine extension imports transformer_engine (optional); "
        "only reached when TE is installed",
    ("glm5_train.metrics", "write"):
        "torch.utils.tensorboard imports the tensorboard package (optional); only reached "
        "when it is installed",
    ("launch.local", "check_job_data"):
        "the job's data checks import the model code (glm5_train.assembly), which the "
        "launcher's --help must not wait for",
}

# tests that import a tools/ module in-process, and why (everything else runs tools as users do,
# in a subprocess).
TEST_IMPORTS_OF_TOOLS: dict[tuple[str, str], str] = {
    ("tests.test_pipeline_plan", "tools.plan_pipeline"):
        "calls the CLI's main() in-process to check its exit status and output cheaply",
    ("tests.test_step_time", "tools.plan_step_time"):
        "calls the CLI's main() in-process to check its output and one-line errors cheaply",
}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    imported: str  # dotted module (or module.attribute) name
    line: int
    function: str | None  # enclosing function for a function-local import


def module_name(root: str, path: str) -> str:
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def source_files(root: str) -> list[str]:
    files = []
    for package in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, package)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            files += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files)


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.module, self.is_package, self.found, self._functions = module, is_package, [], []
        self._type_checking = 0

    def visit_FunctionDef(self, node) -> None:
        self._functions.append(node.name)
        self.generic_visit(node)
        self._functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        # `if TYPE_CHECKING:` imports are still dependencies of the design: count them.
        self.generic_visit(node)

    def _add(self, name: str, line: int) -> None:
        function = self._functions[-1] if self._functions else None
        self.found.append(Import(self.module, name, line, function))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.module.split(".")
            keep = len(parts) - node.level + (1 if self.is_package else 0)
            base = ".".join(parts[:keep] + ([base] if base else []))
        if base == "__future__":
            return
        for alias in node.names:
            self._add(f"{base}.{alias.name}" if alias.name != "*" else base, node.lineno)


def collect(root: str) -> tuple[list[Import], set[str]]:
    imports, modules = [], set()
    for path in source_files(root):
        name = module_name(root, path)
        modules.add(name)
        with open(path) as handle:
            tree = ast.parse(handle.read(), path)
        collector = _Collector(name, path.endswith("__init__.py"))
        collector.visit(tree)
        imports += collector.found
    return imports, modules


def resolve(imported: str, modules: set[str]) -> str | None:
    """The project module ``imported`` names (``pkg.mod.attr`` -> ``pkg.mod``), else None."""
    name = imported
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def layer_of(module: str) -> str:
    top = module.split(".")[0]
    if module == "glm5_train.model" or module.startswith("glm5_train.model."):
        return "glm5_train.model"
    return top


# The planner (glm5_train/plan/) is a unit of the glm5_train layer: it reads the job's config
# and the model's shapes and prices them, so it may import only these; and what it prices must
# not depend on it (PLANNER_FORBIDDEN_IN: the model, the techniques, the job config).
PLANNER = "glm5_train.plan"
PLANNER_MAY_IMPORT = (PLANNER, "glm5_train.model", "glm5_train.job_config",
                      "glm5_train.activation_config", "parallel")
PLANNER_FORBIDDEN_IN = ("glm5_train.model", "parallel", "glm5_train.job_config")


def _within(module: str, units: tuple[str, ...]) -> bool:
    return any(module == unit or module.startswith(unit + ".") for unit in units)


def planner_violations(imports: list[Import], modules: set[str]) -> list[str]:
    """Project imports that break the planner's place (PLANNER_MAY_IMPORT, PLANNER_FORBIDDEN_IN)."""
    problems = []
    for imp in imports:
        target = resolve(imp.imported, modules)
        if target is None:
            continue
        if _within(imp.importer, (PLANNER,)) and not _within(target, PLANNER_MAY_IMPORT):
            problems.append(f"{imp.importer}:{imp.line} imports {target}: the planner may import "
                            f"only {list(PLANNER_MAY_IMPORT)}")
        if _within(target, (PLANNER,)) and _within(imp.importer, PLANNER_FORBIDDEN_IN):
            problems.append(f"{imp.importer}:{imp.line} imports {target}: nothing in "
                            f"{list(PLANNER_FORBIDDEN_IN)} may import the planner")
    return problems


ALLOWED = {
    "parallel": {"parallel"},
    "glm5_train.model": {"parallel", "glm5_train.model"},
    "glm5_train": {"parallel", "glm5_train.model", "glm5_train"},
    "launch": {"parallel", "glm5_train.model", "glm5_train", "launch"},
    "tools": {"parallel", "glm5_train.model", "glm5_train"},
    "bench": {"parallel", "glm5_train.model", "glm5_train", "launch", "bench"},
    "tests": {"parallel", "glm5_train.model", "glm5_train", "launch", "tests"},
}


def layering_violations(imports: list[Import], modules: set[str]) -> list[str]:
    problems = []
    for imp in imports:
        target = resolve(imp.imported, modules)
        here = layer_of(imp.importer)
        if target is None:
            top = imp.imported.split(".")[0]
            below_model = here == "parallel"
            if below_model and top not in THIRD_PARTY_BELOW_MODEL and top not in (
                    sys.stdlib_module_names):
                problems.append(f"{imp.importer}:{imp.line} imports {imp.imported}: parallel/ "
                                "may import only the standard library, torch and megatron-core")
            continue
        there = layer_of(target)
        if there in ALLOWED[here]:
            continue
        if (imp.importer, target) in TEST_IMPORTS_OF_TOOLS:
            continue
        problems.append(f"{imp.importer}:{imp.line} imports {target} (layer {there}) from layer "
                        f"{here}: only {sorted(ALLOWED[here])} may be imported there")
    return problems


def import_cycles(imports: list[Import], modules: set[str]) -> list[list[str]]:
    """Every strongly connected group of two or more project modules (plus self-imports)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        target = resolve(imp.imported, modules)
        if target is not None and target != imp.importer:
            # `from pkg import mod` inside pkg/__init__ would also land here; a package
            # importing its own submodule is not a cycle of the design, the reverse is.
            if not imp.importer.startswith(target + ".") or target not in _packages(modules):
                graph[imp.importer].add(target)
    return [c for c in _strongly_connected(graph) if len(c) > 1]


def _packages(modules: set[str]) -> set[str]:
    return {m.rpartition(".")[0] for m in modules if "." in m}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            out.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def local_import_violations(imports: list[Import], modules: set[str]) -> list[str]:
    problems = []
    for imp in imports:
        if imp.function is None or imp.importer.startswith(("tests.", "bench.")):
            continue  # tests and benchmarks run code in subprocess scripts and fixtures
        if imp.imported.split(".")[0] in OPTIONAL:
            continue
        if (imp.importer, imp.function) in LOCAL_IMPORT_REASONS:
            continue
        problems.append(f"{imp.importer}:{imp.line} imports {imp.imported} inside "
                        f"{imp.function}(): move it to the top of the module (or list an "
                        "optional dependency / a reason in tests/test_layering.py)")
    return problems


# ---------------------------------------------------------------------------------- the tree


def _tree():
    return collect(REPO)


def test_no_upward_imports():
    imports, modules = _tree()
    problems = layering_violations(imports, modules)
    assert not problems, "upward imports:\n  " + "\n  ".join(problems)


def test_no_import_cycles():
    imports, modules = _tree()
    cycles = import_cycles(imports, modules)
    assert not cycles, "import cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in cycles)


def test_imports_at_module_top():
    imports, modules = _tree()
    problems = local_import_violations(imports, modules)
    assert not problems, "function-local imports:\n  " + "\n  ".join(problems)


def test_allow_lists_are_used():
    """Every exception still corresponds to an import in the tree (stale entries go)."""
    imports, modules = _tree()
    local = {(i.importer, i.function) for i in imports if i.function}
    assert set(LOCAL_IMPORT_REASONS) <= local, set(LOCAL_IMPORT_REASONS) - local
    edges = {(i.importer, resolve(i.imported, modules)) for i in imports}
    assert set(TEST_IMPORTS_OF_TOOLS) <= edges, set(TEST_IMPORTS_OF_TOOLS) - edges


def test_planner_stays_in_its_place():
    """The planner imports only the model, the job config and parallel/; none of them imports
    it."""
    imports, modules = _tree()
    problems = planner_violations(imports, modules)
    assert not problems, "planner imports:\n  " + "\n  ".join(problems)


def test_parallel_knows_nothing_of_the_model():
    """No module of parallel/ imports glm5_train or tools (the rule the issue states)."""
    imports, modules = _tree()
    bad = [f"{i.importer}:{i.line} {i.imported}" for i in imports
           if i.importer.startswith("parallel") and i.imported.split(".")[0] in (
               "glm5_train", "tools", "launch")]
    assert not bad, bad


# ------------------------------------------------------------- planted violations (scratch)


def _scratch(tmp_path, files: dict[str, str]) -> tuple[list[Import], set[str]]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return collect(str(tmp_path))


def test_checker_catches_an_upward_import(tmp_path):
    imports, modules = _scratch(tmp_path, {
        "parallel/__init__.py": "",
        "parallel/layout.py": "from glm5_train.model.config import GLM5Config\n",
        "glm5_train/__init__.py": "",
        "glm5_train/model/__init__.py": "",
        "glm5_train/model/config.py": "import dataclasses\n",
    })
    problems = layering_violations(imports, modules)
    assert len(problems) == 1 and "parallel.layout:1 imports glm5_train.model.config" in (
        problems[0]), problems


def test_checker_catches_a_cycle_hidden_in_a_function(tmp_path):
    imports, modules = _scratch(tmp_path, {
        "parallel/__init__.py": "",
        "parallel/muon.py": "def install():\n    from parallel.distributed_muon import x\n",
        "parallel/distributed_muon.py": "from parallel.muon import install\nx = 1\n",
    })
    assert import_cycles(imports, modules) == [["parallel.distributed_muon", "parallel.muon"]]
    local = local_import_violations(imports, modules)
    assert len(local) == 1 and "inside install()" in local[0], local


def test_checker_catches_a_library_importing_tools(tmp_path):
    imports, modules = _scratch(tmp_path, {
        "glm5_train/__init__.py": "",
        "glm5_train/plan/stage_model.py": "from tools.count_params import layer_terms\n",
        "tools/count_params.py": "def layer_terms():\n    return []\n",
    })
    problems = layering_violations(imports, modules)
    assert problems and "imports tools.count_params" in problems[0], problems


def test_checker_catches_the_model_or_the_job_config_importing_the_planner(tmp_path):
    imports, modules = _scratch(tmp_path, {
        "glm5_train/__init__.py": "",
        "glm5_train/plan/__init__.py": "",
        "glm5_train/plan/inputs.py": "from glm5_train.job_config import JobConfig\n",
        "glm5_train/job_config.py": "from glm5_train.plan.inputs import MemoryInputs\n",
        "glm5_train/model/__init__.py": "",
        "glm5_train/model/glm5.py": "from glm5_train.plan import param_count\n",
    })
    problems = planner_violations(imports, modules)
    assert len(problems) == 2, problems
    assert "glm5_train.job_config:1 imports glm5_train.plan.inputs" in problems[0], problems
    assert "glm5_train.model.glm5:1 imports glm5_train.plan" in problems[1], problems
    assert import_cycles(imports, modules) == [["glm5_train.job_config", "glm5_train.plan.inputs"]]


def test_checker_catches_the_planner_importing_the_job(tmp_path):
    imports, modules = _scratch(tmp_path, {
        "glm5_train/__init__.py": "",
        "glm5_train/assembly.py": "import torch\n",
        "glm5_train/plan/__init__.py": "",
        "glm5_train/plan/pipeline.py": "from glm5_train.assembly import build\n"
                                       "from glm5_train.model.config import GLM5Config\n",
        "glm5_train/model/__init__.py": "",
        "glm5_train/model/config.py": "import dataclasses\n",
    })
    problems = planner_violations(imports, modules)
    assert len(problems) == 1 and "glm5_train.plan.pipeline:1 imports glm5_train.assembly" in (
        problems[0]), problems
    assert not layering_violations(imports, modules)  # one layer: only the planner's rule sees it
