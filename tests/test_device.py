"""Tests for the megatron-core compatibility registry (``parallel/mcore_compat.py``) and the
device layer (``parallel/device.py``): megatron-core on CPU + gloo.

* every entry of the registry still fits the installed torch / megatron-core, by behaviour (its
  callers still call it, the literal is still there, the original's fingerprint matches);
  changed code makes an entry stale;
* ``install()`` is idempotent and applies exactly what ``installed_patches()`` lists; a change
  outside the list is refused;
* 2 training steps on 4 ranks (PP2 x VPP2 x DP2, EP2, distributed optimizer, distributed Muon,
  Pipeline ZeRO2, deferred weight gradients), with every CUDA entry point that is not redirected poisoned and a
  TorchFunctionMode watching for CUDA devices, reach no CUDA-only call, and exercise every torch
  view and every override (the gloo all-to-all view alone: tests/test_spawned_units.py).

Checks that depend on install state run in fresh subprocesses, so this process stays clean.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


SUBPROCESS_TIMEOUT = 300
CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="with CUDA present install() applies only the TE-absence fixes; CPU-only checks")


def _run_python(args: list[str], marker: str) -> tuple[dict | None, subprocess.CompletedProcess]:
    """Run ``python <args>`` from the repo root; parse the JSON printed after ``marker``."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT)
    report = None
    for line in proc.stdout.splitlines():
        if line.startswith(marker + " "):
            report = json.loads(line[len(marker) + 1:])
    return report, proc


def _tail(proc: subprocess.CompletedProcess, chars: int = 4000) -> str:
    return (f"rc={proc.returncode}\n--- stdout\n{proc.stdout[-chars:]}\n"
            f"--- stderr\n{proc.stderr[-chars:]}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------- the list: stale, install

_LIST_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from parallel import mcore_compat

patches = mcore_compat.PATCHES
report = {"installed_before": mcore_compat.installed(), "stale": mcore_compat.stale_reasons(),
          "targets": [p.target for p in patches], "cuda_available": torch.cuda.is_available(),
          "kinds": sorted({p.kind for p in patches}),
          "unexplained": [p.target for p in patches if len(p.why) < 15]}
if not report["stale"]:
    report["expected"] = sorted(p.target for p in mcore_compat.installed_patches())
    report["install1"] = mcore_compat.install()
    report["install2"] = mcore_compat.install()
    report["installed_after"] = mcore_compat.installed()
    not_replaced = []
    for p in mcore_compat.installed_patches():
        value = getattr(mcore_compat.resolve_owner(p.module), p.attr)
        if p.kind == mcore_compat.TORCH_VIEW:
            ok = value is mcore_compat.VIEWS[p.module]
        elif isinstance(p.replacement, mcore_compat.device.Uncompiled):
            ok = not hasattr(value, "_torchdynamo_orig_callable")
        else:
            ok = value is p.replacement
        if not ok:
            not_replaced.append(f"{p.target}: holds {value!r}, not the replacement")
    report["not_replaced"] = not_replaced
    t = torch.ones(2)
    plain = t.type()
    with torch.device("cpu"):  # torch's DeviceContext is a TorchFunctionMode
        report["tensor_type"] = [plain, t.type()]
    # An override of a target that is not listed is refused.
    class Unlisted:
        def step(self):
            return 1
    try:
        mcore_compat.override_method(Unlisted(), "step", lambda: 2)
        report["unlisted_refused"] = False
    except RuntimeError as err:
        report["unlisted_refused"] = "PATCHES" in str(err)
print("DEVICE_LIST_REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def list_report() -> dict:
    report, proc = _run_python(["-c", _LIST_SCRIPT, REPO], "DEVICE_LIST_REPORT")
    assert proc.returncode == 0 and report is not None, _tail(proc)
    return report


def test_every_patch_fits_installed_versions(list_report):
    """Before install, no entry of mcore_compat.PATCHES is stale for this torch / megatron-core
    (behavioural checks: callers still call it, literals still there, fingerprints match)."""
    assert list_report["installed_before"] == [], "a fresh process must start uninstalled"
    assert not list_report["stale"], (
        "mcore_compat entries no longer fit the installed torch / megatron-core:\n  "
        + "\n  ".join(list_report["stale"]))
    targets = list_report["targets"]
    duplicates = sorted({t for t in targets if targets.count(t) > 1})
    assert not duplicates, f"targets listed twice in PATCHES: {duplicates}"
    assert not list_report["unexplained"], "every entry states its reason"
    assert list_report["kinds"] == ["fix", "override", "redirect", "scoped", "torch_view"]


def test_install_is_idempotent_and_complete(list_report):
    if list_report["stale"]:
        pytest.skip("stale entries: see test_every_patch_fits_installed_versions")
    assert list_report["install1"] == list_report["install2"] == list_report["installed_after"]
    assert list_report["installed_after"] == list_report["expected"]
    assert not list_report["not_replaced"], "\n".join(list_report["not_replaced"])
    assert list_report["unlisted_refused"], "a change outside PATCHES must be refused"


def test_staleness_checks_fail_on_changed_code():
    """The checks test behaviour: a fingerprint that no longer matches, a caller that no
    longer calls, a literal that is gone each make an entry stale."""
    from dataclasses import replace

    from parallel import mcore_compat

    by_target = {p.target: p for p in mcore_compat.PATCHES}
    zero2 = by_target["megatron.core.optimizer.distrib_optimizer.DistributedOptimizer."
                      "_copy_model_grads_to_main_grads"]
    assert mcore_compat.stale_reason(zero2) is None
    assert "changed" in mcore_compat.stale_reason(replace(zero2, fingerprint="0" * 16,
                                                          other_fits=()))
    view = by_target["megatron.core.optimizer.clip_grads.torch"]
    assert "no longer needed" in mcore_compat.stale_reason(replace(view, uses=r"cuda_literal_x"))
    redirect = by_target["torch.cuda.synchronize"]
    assert "no longer needed" in mcore_compat.stale_reason(
        replace(redirect, callers=("megatron.core.enums",)))


# ------------------------------------------------------ no CUDA-only call on the training path

_POISON_SCRIPT = r'''
"""Train the tiny model for 2 steps with every non-redirected CUDA entry point poisoned, on
every rank of a torchrun job: PP2 x VPP2 x DP2, EP2, distributed optimizer, distributed Muon,
Pipeline ZeRO2, deferred weight gradients (the paths of every technique that changes megatron-core's behaviour)."""
import inspect, json, os, sys, traceback

REPO, RUN_DIR = sys.argv[1], sys.argv[2]
sys.path.insert(0, REPO)
RANK = int(os.environ["RANK"])

import torch
import torch.cuda.nvtx
import torch.cuda.random
from torch.overrides import TorchFunctionMode

HITS = {}
_DEPTH = [0]  # calls made by a poisoned original itself are not recorded again


def record(kind, what):
    frames = traceback.extract_stack()[:-2]  # drop record() and the poison / mode frame
    lines = [f"{f.filename}:{f.lineno} in {f.name}" for f in frames[-8:]]
    key = f"{kind}|{what}|{lines[-1] if lines else '?'}"
    entry = HITS.setdefault(key, {"kind": kind, "what": what, "count": 0, "stack": lines})
    entry["count"] += 1


# Exemption, the only one: torch.cuda.is_available() is the query that our code
# (mcore_compat.install, process_groups.init_distributed, metrics) and megatron-core use to
# pick gloo and to skip GPU-only branches; on a CPU build it answers False without touching a
# driver.
EXEMPT = {"torch.cuda.is_available"}


def poisoned(qualname, original):
    def call(*args, **kwargs):
        if _DEPTH[0] == 0:
            record("torch.cuda call", qualname)
        _DEPTH[0] += 1
        try:
            # Record, then behave exactly as a CPU build of torch would (which cannot do CUDA
            # work: the originals raise or report no device), so megatron-core takes the same
            # path as in production and every hit on the way is listed, not just the first.
            return original(*args, **kwargs)
        finally:
            _DEPTH[0] -= 1

    if isinstance(original, type):
        # A class stays a class, so isinstance / issubclass checks against it keep working.
        return type(original.__name__, (), {"__new__": lambda cls, *a, **k: call(*a, **k),
                                             "__qualname__": qualname})
    call.__name__ = getattr(original, "__name__", qualname)
    call.__qualname__ = qualname
    return call


# Poison before megatron-core is imported, so names it binds at import (`from torch.cuda import
# x`) are poisoned too; install() then replaces the redirected ones, and only those.
POISONED = {}
for module in (torch.cuda, torch.cuda.random, torch.cuda.nvtx):
    for name in dir(module):
        value = getattr(module, name)
        qualname = f"{module.__name__}.{name}"
        if name.startswith("_") or inspect.ismodule(value) or not callable(value):
            continue
        if not str(getattr(value, "__module__", "")).startswith("torch.cuda"):
            continue  # typing / functools / contextlib re-exports
        if isinstance(value, type) and issubclass(value, BaseException):
            continue  # exception types are caught (except OutOfMemoryError), never called
        if qualname in EXEMPT:
            continue
        replacement = poisoned(qualname, value)
        setattr(module, name, replacement)
        POISONED[qualname] = (module, name, replacement)


def cuda_like(device, int_is_cuda):
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return int_is_cuda and isinstance(device, int) and not isinstance(device, bool)


# The C methods, captured before install() redirects Tensor.cuda / Tensor.type. When a C Tensor
# method dispatches to a mode, torch hands it the method as looked up on torch.Tensor *now* (the
# redirect, once installed), so both are matched.
ORIGINAL = {name: getattr(torch.Tensor, name)
            for name in ("cuda", "to", "type", "pin_memory", "record_stream")}


def is_tensor_method(func, name):
    return func is ORIGINAL[name] or func is getattr(torch.Tensor, name)


class CudaDeviceRecorder(TorchFunctionMode):
    """Records torch calls aimed at a CUDA device (it changes nothing)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = self.cuda_use(func, args, kwargs)
        if what:
            record("cuda device in a torch call", what)
        if func is not ORIGINAL["type"] and func is torch.Tensor.type:
            # The redirected Tensor.type re-dispatches here from inside itself; calling it again
            # would rename twice ('torch.cuda.cuda.FloatTensor', a device.py bug under any
            # TorchFunctionMode, see test_tensor_type_under_a_torch_function_mode). Run the
            # C method so that this recorder stays transparent.
            return ORIGINAL["type"](*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def cuda_use(func, args, kwargs):
        if func is torch.device:
            # Building a device object does no CUDA work (torch.distributed maps backends by
            # torch.device("cuda"); megatron's RNG tracker builds one it only indexes the
            # redirected default_generators with). Using it in a factory or .to() is a hit below.
            return None
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        for method in ("cuda", "pin_memory", "record_stream"):
            if is_tensor_method(func, method):
                return f"Tensor.{method}()"
        if "device" in kwargs and cuda_like(kwargs["device"], int_is_cuda=True):
            return f"{name}(device={kwargs['device']!r})"
        if kwargs.get("pin_memory") is True:
            return f"{name}(pin_memory=True)"
        for arg in args:
            if cuda_like(arg, int_is_cuda=False):
                return f"{name}({arg!r})"
        if is_tensor_method(func, "to") and len(args) > 1 and cuda_like(args[1], True):
            return f"{name}({args[1]!r})"  # t.to(0) means cuda:0
        if is_tensor_method(func, "type") and len(args) > 1 and "cuda" in str(args[1]):
            return f"{name}({args[1]!r})"
        return None


report = {"hits": [], "poisoned_after_install": [], "canaries": {}, "status": "not run"}
try:
    from hydra import compose, initialize_config_dir

    from glm5_train.job_config import JobConfig
    from glm5_train.run_dir import register_resolvers
    from glm5_train.train import train
    from parallel import mcore_compat

    mcore_compat.install()  # train() installs too (idempotent); here so the canaries see it
    report["poisoned_after_install"] = sorted(
        q for q, (module, name, replacement) in POISONED.items()
        if getattr(module, name) is replacement)

    # Canaries: both detectors must fire, or an empty hit list would prove nothing.
    torch.cuda.device_count()
    report["canaries"]["poison"] = any("device_count" in h["what"] for h in HITS.values())
    with CudaDeviceRecorder():
        try:
            torch.empty(1, device="cuda")
        except Exception:
            pass
        try:
            torch.ones(1).to("cuda")
        except Exception:
            pass
    report["canaries"]["mode"] = sum(h["kind"].startswith("cuda device") for h in HITS.values())
    HITS.clear()

    register_resolvers()
    with initialize_config_dir(config_dir=os.path.join(REPO, "configs"), version_base=None):
        tree = compose("config", overrides=[
            "model=glm5_tiny", "parallel=pp2_vpp2", "parallel.expert_model_parallel_size=2",
            "parallel.use_distributed_optimizer=true", "parallel.pipeline_zero2=true",
            "parallel.defer_weight_grads=true", "train.optimizer=muon", "train.train_iters=2", "train.warmup_iters=1",
            "train.global_batch_size=4", "train.seq_length=32", "checkpoint.save=null"])
    job = JobConfig.from_hydra(tree)
    with CudaDeviceRecorder():
        records = train(job, RUN_DIR)
    report["steps"] = len(records)
    report["losses"] = [r["loss"] for r in records]
    report["view_hits"] = mcore_compat.view_hits()
    report["override_calls"] = dict(mcore_compat.OVERRIDE_CALLS)
    report["status"] = "ok"
except BaseException:
    report["status"] = "failed:\n" + traceback.format_exc()
finally:
    report["hits"] = sorted(HITS.values(), key=lambda h: -h["count"])
    with open(os.path.join(RUN_DIR, f"poison_rank{RANK}.json"), "w") as handle:
        json.dump(report, handle)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
sys.exit(0 if report["status"] == "ok" else 1)
'''


def _format_hits(hits: list[dict]) -> str:
    blocks = []
    for hit in hits:
        stack = "\n      ".join(hit["stack"])
        blocks.append(f"  {hit['what']}  x{hit['count']}  [{hit['kind']}]\n      {stack}")
    return "\n".join(blocks)


POISON_RANKS = 4


@CPU_ONLY
def test_no_unredirected_cuda_call_in_a_training_step(tmp_path):
    script = tmp_path / "poisoned_step.py"
    script.write_text(_POISON_SCRIPT)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _, proc = _run_python(["-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={POISON_RANKS}", str(script), REPO, str(run_dir)],
                          "unused")
    reports = []
    for rank in range(POISON_RANKS):
        path = run_dir / f"poison_rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no report\n" + _tail(proc)
        reports.append(json.loads(path.read_text()))
    for rank, report in enumerate(reports):
        # The detectors work: a poisoned call and a cuda-device torch call were both caught.
        assert report["canaries"] == {"poison": True, "mode": 2}, (rank, report["canaries"])
        # Poisoning covers the non-redirected CUDA API; install() replaced the redirected part.
        still = set(report["poisoned_after_install"])
        assert "torch.cuda.device_count" in still and "torch.cuda.nvtx.range_push" in still
        assert "torch.cuda.current_device" not in still and "torch.cuda.Stream" not in still
        assert not report["hits"], (
            f"CUDA-only calls on rank {rank}'s CPU training path (add a Patch to "
            "parallel/mcore_compat.py):\n" + _format_hits(report["hits"]))
        assert report["status"] == "ok", report["status"] + "\n" + _tail(proc)
        assert report["steps"] == 2 and all(math.isfinite(x) for x in report["losses"])
    # Behavioural staleness: every installed torch view moved some call to the CPU, and every
    # run-time override was exercised, on some rank of this job.
    views = {m: sum(r["view_hits"].get(m, 0) for r in reports) for m in reports[0]["view_hits"]}
    assert views and all(views.values()), f"torch views that moved nothing (stale): {views}"
    calls = {}
    for report in reports:
        for target, count in report["override_calls"].items():
            calls[target] = calls.get(target, 0) + count
    from parallel import mcore_compat

    overrides = {p.target for p in mcore_compat.OVERRIDES}
    assert set(calls) == overrides and all(calls.values()), (
        f"overrides never exercised: {sorted(overrides - set(calls))}")


# ------------------------------------------------------------ Tensor.type under a mode

@CPU_ONLY
def test_tensor_type_under_a_torch_function_mode(list_report):
    """Tensor.type() must name the same type with a TorchFunctionMode active (torch's own
    ``with torch.device(...)`` context is one)."""
    if list_report["stale"]:
        pytest.skip("stale entries: see test_every_redirect_fits_installed_versions")
    assert list_report["tensor_type"] == ["torch.cuda.FloatTensor"] * 2
