"""The warning registry (glm5_train/known_warnings.py on parallel/quiet.py): the main job's
console carries no library warning, a listed warning is hidden, a conditional entry shows its
warning when its condition is false, and a warning not listed still shows, once across ranks."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import subprocess
import sys
import warnings
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.distributed._shard._utils import DEPRECATE_MSG as SHARDED_TENSOR_DEPRECATED

from glm5_train import known_warnings
from parallel import mcore_compat, quiet
from parallel.quiet import Known, OncePerRun
from tests.spawn import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A library warning on the console: Python's format (``file:line: UserWarning: text`` and the
# ``warnings.warn(`` source line under it), torch's C++ ``Warning:``, a logging WARNING record.
WARNING_LINE = re.compile(r"Warning:|UserWarning|FutureWarning|DeprecationWarning|warnings\.warn"
                          r"|WARNING:|\[WARNING\]|not repeated for other ranks")

TORCH = quiet.installed_version("torch")
LIB = "somelib.layers"  # a library module no entry of the job's registry names
LIB_FILE = "/site-packages/somelib/layers.py"
KNOWN_TEXT = "the knob only matters on a device"
UNKNOWN_TEXT = "something a user must read"


def entry(**changes) -> Known:
    """A registry entry for ``LIB``'s ``KNOWN_TEXT`` that applies to the installed torch."""
    return replace(Known(r"the knob only matters", LIB, "torch", (TORCH,), why="a test"),
                   **changes)


@contextlib.contextmanager
def fresh_warnings():
    """Only what ``quiet.install`` adds decides (no pytest or interpreter filters), the shown
    warnings are recorded, and the registry's process state is restored afterwards."""
    saved = replace(quiet._STATE)
    with warnings.catch_warnings(record=True) as shown:
        warnings.resetwarnings()
        try:
            yield shown
        finally:
            quiet._STATE.__dict__.update(saved.__dict__)


def emit(text: str, module: str = LIB, filename: str = LIB_FILE, line: int = 7,
         category: type[Warning] = UserWarning) -> None:
    """As the library's own ``warnings.warn`` would arrive (attributed to its module)."""
    warnings.warn_explicit(text, category, filename, line, module=module)


# ----------------------------------------------------------------------------- the registry


def test_a_known_warning_is_hidden_and_an_unknown_one_shows():
    with fresh_warnings() as shown:
        quiet.install([entry()])
        emit(KNOWN_TEXT)
        emit(UNKNOWN_TEXT)
        emit(KNOWN_TEXT, module="otherlib.layers", filename="/x/otherlib/layers.py")
    assert [(str(w.message), w.filename) for w in shown] == [
        (UNKNOWN_TEXT, LIB_FILE), (KNOWN_TEXT, "/x/otherlib/layers.py")]


def test_a_conditional_entry_hides_only_while_its_condition_holds():
    on_cpu = [True]
    with fresh_warnings() as shown:
        quiet.install([entry(when=lambda: on_cpu[0])])
        emit(KNOWN_TEXT, line=1)
        on_cpu[0] = False  # checked when the warning is emitted, not at install
        emit(KNOWN_TEXT, line=2)
    assert [w.lineno for w in shown] == [2]


def test_an_entry_for_another_release_is_not_applied():
    with fresh_warnings() as shown:
        assert quiet.install([entry(versions=("0.0.1",))]) == []
        emit(KNOWN_TEXT)
    assert len(shown) == 1


def test_a_logger_entry_drops_only_its_records():
    logger = logging.getLogger("somelib.test_quiet")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with fresh_warnings():
            quiet.install([entry(logger=True, module=logger.name)])
            logger.warning("the knob only matters on a device")
            logger.warning(UNKNOWN_TEXT)
    finally:
        logger.removeHandler(handler)
        logger.filters.clear()
    assert out.getvalue() == f"{UNKNOWN_TEXT}\n"


def test_the_cuda_connections_hint_shows_on_a_gpu(monkeypatch):
    """The CPU-only reason is a condition: with a CUDA device the hint is real advice."""
    layers = "megatron.core.tensor_parallel.layers"
    hint = ("When using sequence parallelism it is recommended to set the environment variable "
            "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
    filename = "/site-packages/megatron/core/tensor_parallel/layers.py"
    with fresh_warnings() as shown:
        known_warnings.install()
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
        emit(hint, module=layers, filename=filename, line=1)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        emit(hint, module=layers, filename=filename, line=2)
    assert [w.lineno for w in shown] == [2]


def test_megatron_cores_own_default_warns_and_the_registry_hides_it():
    """megatron-core 0.16.1's TransformerConfig warns about its own cuda_graph_scope default."""
    if quiet.installed_version("megatron-core") != "0.16.1":
        pytest.skip("the default that warns is 0.16.1's")
    config = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 1}
    with fresh_warnings() as shown:
        TransformerConfig(**config)
    assert any("full scope is deprecated" in str(w.message) for w in shown)
    with fresh_warnings() as shown:
        known_warnings.install()
        TransformerConfig(**config)
    assert not [str(w.message) for w in shown if "full scope" in str(w.message)]


def test_a_resumes_checkpoint_deprecations_are_hidden():
    """The texts torch itself emits (read from it), attributed as on a resume: megatron-core's
    torch_dist loader calls DCP's load_state_dict, DCP reads torch ShardedTensors."""
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        with contextlib.suppress(Exception):  # it warns before it looks at its arguments
            dcp.load_state_dict({}, None)
    renamed = next(str(w.message) for w in raised if w.category is FutureWarning)
    loader = "megatron.core.dist_checkpointing.strategies.torch"
    loader_file = "/m/megatron/core/dist_checkpointing/strategies/torch.py"
    with fresh_warnings() as shown:
        known_warnings.install()
        emit(renamed, module=loader, filename=loader_file, category=FutureWarning)
        emit(SHARDED_TENSOR_DEPRECATED, module="torch.distributed.checkpoint.default_planner",
             filename="/t/torch/distributed/checkpoint/default_planner.py",
             category=FutureWarning)
        emit(SHARDED_TENSOR_DEPRECATED, module="glm5_train.checkpoint",  # ours: shown
             filename="/r/glm5_train/checkpoint.py", category=FutureWarning)
    # 0.19.2 calls DCP's load: the entry is 0.16.1's only, elsewhere the warning would show
    calls_the_old_name = quiet.installed_version("megatron-core") != "0.16.1"
    assert [w.filename for w in shown] == (
        [loader_file] if calls_the_old_name else []) + ["/r/glm5_train/checkpoint.py"]


def test_every_entry_says_why_and_where():
    for known in known_warnings.KNOWN:
        assert len(known.why) > 40, known.message
        assert known.versions and all(re.fullmatch(r"\d+\.\d+\.\d+", v) for v in known.versions)
        assert issubclass(known.category, Warning)
        re.compile(known.message)


def test_the_run_key_is_shared_by_one_runs_ranks_only():
    env = {"GLM5_RUN_ID": "2026-01-01_00-00-00_1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500", "WORLD_SIZE": "8"}
    ranks = [known_warnings.once_per_run({**env, "RANK": str(r)}) for r in range(8)]
    assert len({r.directory for r in ranks}) == 1 and [r.rank for r in ranks] == list(range(8))
    other = known_warnings.once_per_run({**env, "MASTER_PORT": "29501", "RANK": "0"})
    assert other.directory != ranks[0].directory
    assert known_warnings.once_per_run({**env, "WORLD_SIZE": "1", "RANK": "0"}) is None
    assert known_warnings.once_per_run({"RANK": "0", "WORLD_SIZE": "2"}) is None
    for restart in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):  # a new attempt
        again = known_warnings.once_per_run({**env, restart: "1", "RANK": "0"})
        assert again.directory != ranks[0].directory, restart


def test_importing_the_package_needs_no_torch():
    """The registry installs when glm5_train is imported; tools that need no torch
    (tools/verify_checkpoint.py) import glm5_train modules and must stay torch-free."""
    code = ("import sys; import glm5_train.checkpoint_store; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["[]"]


def test_the_megatron_core_releases_are_mcore_compats():
    """The registry's megatron-core releases are the ones parallel/mcore_compat.py was
    written against (copied, not imported: mcore_compat imports megatron-core)."""
    assert known_warnings.MCORE_RELEASES == mcore_compat.WRITTEN_AGAINST


# ---------------------------------------------------------------------- once across ranks


def emit_on_rank(rank: int, world_size: int, directory: str) -> tuple[str, str]:
    """Every rank emits the same unknown and known warnings, and logs the same WARNING: what
    its stderr and its console handler show."""
    quiet.install([entry()], OncePerRun(directory, rank))
    console, log = io.StringIO(), io.StringIO()
    logger = logging.getLogger("somelib.on_every_rank")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(logging.StreamHandler(log))
    quiet.once_on_console(logger)
    with contextlib.redirect_stderr(console):
        emit(UNKNOWN_TEXT)
        emit(KNOWN_TEXT)
        emit(f"only rank {rank} says this", line=8)
        logger.warning("a library's logged warning")
        logger.warning("a library's logged warning")  # again: still shown, on the same rank
        logger.info("info is not de-duplicated")
    return console.getvalue(), log.getvalue()


def test_an_unknown_warning_shows_once_across_ranks(tmp_path):
    shown = run_ranks(4, emit_on_rank, str(tmp_path / "claims"))
    consoles = "".join(console for console, _ in shown)
    assert consoles.count(UNKNOWN_TEXT) == 1, consoles
    tagged = r"^\[rank \d; not repeated for other ranks\] .*UserWarning: "
    assert re.search(tagged + UNKNOWN_TEXT, consoles, re.MULTILINE), consoles
    assert KNOWN_TEXT not in consoles
    for rank in range(4):  # a warning of one rank's own is never hidden
        assert f"only rank {rank} says this" in shown[rank][0]
    logs = "".join(log for _, log in shown)
    assert [log.count("a library's logged warning") for _, log in shown].count(2) == 1, logs
    assert logs.count("a library's logged warning") == 2
    assert logs.count("info is not de-duplicated") == 4


def test_an_unwritable_claim_directory_shows_the_warning(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    once = OncePerRun(str(blocker / "claims"), 0)  # a directory under a file: OSError
    assert once.shows("text") and once.shows("text")


# ------------------------------------------------------------------- the job as users run it


def test_the_main_jobs_console_has_no_library_warnings(tmp_path):
    """``python -m launch.local`` (8 ranks: TP2+SP x PP2 x VPP2 x DP2 x EP2), 2 steps: every
    line of its console that looks like a library warning is listed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    run = subprocess.run(
        [sys.executable, "-m", "launch.local", "train.train_iters=2", "train.warmup_iters=0",
         f"hydra.run.dir={tmp_path}/run"],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    console = run.stdout + run.stderr
    assert run.returncode == 0, console[-4000:]
    assert "step 2/2" in console, console[-4000:]
    found = [line for line in console.splitlines() if WARNING_LINE.search(line)]
    assert not found, "library warnings on the job's console:\n" + "\n".join(found)
