"""One GPU check of every CUDA-only branch of the repository (docs/cuda_branches.md), within
5 minutes on one H100 or H200, results as one JSON rewritten after every part.

    python bench/gpu/gpu_check.py --out $OUT/gpu_check.json                 # one GPU, 270 s
    python bench/gpu/gpu_check.py --dry-run --out /tmp/gpu_check.json       # CPU, tiny shapes

On the lent machine (no internet): bench/gpu/README.md (wheels carried, the exact command).

Parts, most valuable first (``--parts`` picks some); each runs in its own try/except under its
own time cap, and one that would not fit in what is left of ``--budget-s`` is skipped and says
so:

- ``env``: device, torch / CUDA / NCCL / triton / megatron-core versions, whether Transformer
  Engine and Apex import (the TE layer specs stay unverified unless TE imports here).
- ``kernel_parity``: the Triton sparse-MLA kernel against the torch path
  (``SparseLatentAttention``) in context-parallel-shaped calls: T query rows at zigzag
  positions over S keys, bf16 at GLM-5's widths, forward output, head-summed probabilities,
  dq and dkv against an fp32 reference; timings (bench/gpu/kernel_parity.py).
- ``activation_offload``: parallel/activation_offload.py on CUDA (pinned host memory, its side
  stream, events) over a GLM-5 layer stack in one process, 1F1B order of a pipeline's first
  rank: device peak (``torch.cuda.max_memory_allocated``) with vs without, ratio, equal
  gradients and losses (bench/gpu/memory_checks.py).
- ``host_optimizer``: parallel/host_optimizer.py on CUDA (megatron-core's hybrid optimizer,
  pinned host copies) against AdamW on the device: device peak with vs without, ratio, equal
  losses (bench/gpu/memory_checks.py).
- ``cuda_job``: the training job itself on CUDA + NCCL (one process, rank 0 of 1): AdamW state on
  the host with a profiled step (CUDA activity, NVTX ranges, allocator events), Muon with its
  AdamW part on the host, both resumed from a checkpoint, tools/logits.py; losses, device
  peak, host bytes and the planner's bytes per run (bench/gpu/job_check.py).
- ``dsa_vs_dense``: one layer's DSA against dense flash attention at 16K / 32K tokens
  (``h200_perf.attention_part``).
- ``stack_mfu``: a 744B-width GLM-5 layer stack's tokens/s and MFU (``h200_perf.stack_part``;
  TE specs where TE imports).
- ``calibrate``: tools/calibrate_cluster.py's spec of this device, and the step-time model's
  compute term checked against the stack measured above (``stack_vs_model``: the planner's
  FLOPs of that stack at the measured rate, predicted / measured seconds per step); then a
  brief second calibration timed as a synchronized job (``compute_tflops_synchronized``).

JSON (``--out``): ``schema`` ("gpu_check/1"), ``dry_run``, ``device``, ``budget_s``, ``order``
(the parts in run order), ``parts``: per part ``status`` (pending / ok / failed / skipped),
``seconds``, ``covers`` (the docs/cuda_branches.md rows it checks), ``result`` (figures),
``not_measured`` (figure -> why, e.g. CUDA-only in a dry run), ``problems`` (checks that did
not hold), ``error`` (exception text); ``wall_s`` and ``summary`` at the end. Exit status 0
when every part that ran is ok.

``--dry-run``: CPU, Triton's interpreter for the kernel, tiny shapes, the same code; CUDA-only
figures are listed under ``not_measured``. tests/test_gpu_check.py runs it.
"""

from __future__ import annotations

import os
import sys

DRY_RUN = "--dry-run" in sys.argv
if DRY_RUN:  # before triton is first imported: it decorates its language module then
    os.environ["TRITON_INTERPRET"] = "1"

import argparse
import gc
import importlib
import importlib.metadata
import json
import math
import platform
import signal
import subprocess
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# h200_perf first: importing it puts the repository root on sys.path for the rest.
import h200_perf
import job_check
import kernel_parity
import memory_checks

from glm5_train.job_config import compose_job
from glm5_train.plan.step_time import load_cluster, model_flops_per_step
from parallel import mcore_compat

REPO = os.path.dirname(os.path.dirname(HERE))
# torchrun's variables: the calibration runs as one process of its own
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

SCHEMA = "gpu_check/1"


class PartTimeout(Exception):
    """A part ran past its time cap (raised from SIGALRM between Python operations)."""


@dataclass
class Context:
    """What every part gets: where it runs, how long it may take, the shared results."""

    device: torch.device
    dry_run: bool
    seconds: float  # this part's cap
    args: argparse.Namespace
    budget: h200_perf.Budget = None
    not_measured: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)
    earlier: dict = field(default_factory=dict)  # the results of the parts run before, by name

    def cuda_only(self, name: str) -> None:
        """``name`` is a CUDA figure: not measured on this (CPU) run."""
        self.not_measured[name] = "CUDA only: not measured in a CPU dry run"


# ---------------------------------------------------------------------------------- parts


def part_env(ctx: Context) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "megatron_core": _version("megatron-core"), "triton": _version("triton"),
            "hydra_core": _version("hydra-core"),
            "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"}
    info.update(_importable("transformer_engine", "transformer_engine.pytorch"))
    info.update(_importable("apex", "apex"))
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        info.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1),
                    sms=props.multi_processor_count,
                    nccl=_nccl_version(),
                    flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled())
    else:
        for name in ("device_name", "capability", "memory_gib", "nccl"):
            ctx.cuda_only(name)
    info["te_specs"] = ("importable: exercised by stack_mfu (use_te=True)"
                        if info["transformer_engine_importable"]
                        else "unverified: transformer_engine does not import here")
    info["mcore_registry_not_written_for"] = mcore_compat.version_report()
    return info


def _nccl_version() -> str:
    """torch reports a tuple (major, minor, patch[, suffix]) or, on older builds, an int."""
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _importable(key: str, module: str) -> dict:
    """{key_importable: bool, key_error: why not}: an import attempt, not a metadata look-up
    (a TE wheel whose CUDA libraries do not load is installed but unusable)."""
    try:
        importlib.import_module(module)
        return {f"{key}_importable": True}
    except Exception as exc:  # noqa: BLE001 - ImportError, OSError of a missing .so, ...
        return {f"{key}_importable": False,
                f"{key}_error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}


def part_dsa_vs_dense(ctx: Context) -> dict:
    """h200_perf's attention measurement at 16K / 32K (dry run: 128 tokens)."""
    args = h200_perf_args(ctx, seq=[128] if ctx.dry_run else [16384, 32768])
    results = {"attention": [], "stack": []}
    dtype = torch.float32 if ctx.dry_run else torch.bfloat16  # interpreter: bf16 dot is wrong
    h200_perf.attention_part(args, ctx.device, dtype, ctx.budget, results)
    for run in results["attention"]:
        if "dsa_layer_s" not in run:
            ctx.problems.append(f"seq {run['seq']}: {run.get('error') or run.get('skipped')}")
    if ctx.dry_run:
        ctx.not_measured["timings"] = "dry run: CPU and Triton's interpreter, not GPU figures"
    return {"attention": results["attention"], "dtype": str(dtype).replace("torch.", "")}


def part_stack_mfu(ctx: Context) -> dict:
    """h200_perf's 744B-width stack (dry run: glm5_tiny at 128 tokens)."""
    args = h200_perf_args(ctx, stack_seq=[128] if ctx.dry_run else [4096])
    results = {"attention": [], "stack": []}
    h200_perf.stack_part(args, ctx.device, torch.bfloat16, ctx.budget, results)
    if not results["stack"]:
        ctx.problems.append("no stack measurement: " + "; ".join(results["stack_errors"]))
    if ctx.device.type != "cuda":
        ctx.cuda_only("mfu")
    return {"stack": results["stack"], "errors": results["stack_errors"],
            "te_importable": _importable("te", "transformer_engine.pytorch")["te_importable"]}


def part_calibrate(ctx: Context) -> dict:
    """tools/calibrate_cluster.py in one process on the device: the step-time model's spec
    measured (bf16 matmul at 8192, a 4 GiB copy; dry run: fp32 at 128, 16 MiB); the spec
    loads, its rates are positive, and on CUDA it names the device for MFU. Then once more,
    briefly, timed as a synchronized job (``--sync-ms 20``: an all-reduce closes each chunk,
    the device synchronized around the timed loop), whose matmul rate is recorded beside
    the first. The two share the part's time: the second gets what the first left; when it
    fails, the first's figures stand and the failure is a problem."""
    sizes = (["--matmul-size", "128", "--message-mib", "1", "--seconds", "0.2"] if ctx.dry_run
             else [])
    deadline = time.monotonic() + ctx.seconds - 5
    spec = _calibrated(ctx, sizes, deadline)
    if spec is None:
        return {}
    synced = _calibrated(ctx, [*sizes, "--sync-ms", "20", "--seconds", "0.2"], deadline)
    for measured in (spec, synced):
        if measured is not None and not (measured.compute_tflops > 0
                                         and measured.memory_gbs > 0
                                         and measured.batched_matmul_tflops > 0):
            ctx.problems.append(f"calibrate_cluster: rates not positive: {measured}")
    if ctx.device.type == "cuda" and torch.cuda.get_device_name() not in spec.cuda_names:
        ctx.problems.append(f"calibrate_cluster: cuda_names {spec.cuda_names} miss the device")
    if ctx.device.type != "cuda":
        ctx.cuda_only("compute_tflops (bf16)")
        ctx.cuda_only("stack_vs_model (GPU figures)")
    return {"compute_tflops": spec.compute_tflops, "memory_gbs": spec.memory_gbs,
            "batched_matmul_tflops": spec.batched_matmul_tflops,
            "compute_tflops_synchronized": synced.compute_tflops if synced else None,
            "device": spec.device, "stack_vs_model": stack_vs_model(ctx, spec)}


def _calibrated(ctx: Context, args: list[str], deadline: float):
    """The spec tools/calibrate_cluster.py measures with ``args`` in one process before
    ``deadline`` (time.monotonic), or None (the failure in ``ctx.problems``)."""
    out = os.path.join(tempfile.mkdtemp(prefix="calibrate_"), "measured.yaml")
    left = deadline - time.monotonic()
    if left < 5:
        ctx.problems.append(f"calibrate_cluster {' '.join(args)}: {left:.0f} s left of the part")
        return None
    try:
        proc = subprocess.run(
            [sys.executable, os.path.join(REPO, "tools", "calibrate_cluster.py"), "--out", out,
             "--repeats", "3", *args], capture_output=True, text=True, timeout=left,
            check=False, env={k: v for k, v in os.environ.items() if k not in DIST_ENV})
    except subprocess.TimeoutExpired:
        ctx.problems.append(f"calibrate_cluster {' '.join(args)}: past the part's {left:.0f} s")
        return None
    if proc.returncode != 0:
        ctx.problems.append(f"calibrate_cluster exit {proc.returncode}: {proc.stderr[-1500:]}")
        return None
    return load_cluster(out)


def stack_vs_model(ctx: Context, spec) -> list[dict]:
    """The step-time model's compute term (glm5_train/plan/step_time.py: the planner's FLOPs
    at the spec's measured matmul rate) against ``stack_mfu``'s measured forward + backward of
    the same layer stack, one sequence per step: per measured length, predicted and measured
    seconds and their ratio (#39's check of the model against a GPU, on its largest term).
    The stack has no optimizer step and no MTP, so neither has the job it is priced as."""
    stack = (ctx.earlier.get("stack_mfu") or {}).get("stack", [])
    if not stack:
        ctx.not_measured["stack_vs_model"] = "stack_mfu did not run or measured nothing"
        return []
    path = os.path.abspath(h200_perf_args(ctx).stack_model)
    if os.path.dirname(path) != os.path.join(REPO, "configs", "model"):
        ctx.not_measured["stack_vs_model"] = (f"the stack's model {path} is not a config of "
                                              "configs/model, which the planner composes")
        return []
    model = os.path.splitext(os.path.basename(path))[0]
    rows = []
    for run in stack:
        job = compose_job([f"model={model}", f"model.num_hidden_layers={run['layers']}",
                           f"model.first_k_dense_replace={run['dense_layers']}",
                           "model.mtp_num_steps=0",
                           f"model.n_routed_experts={run['experts']}",
                           f"train.seq_length={run['seq']}", "train.global_batch_size=1",
                           "train.micro_batch_size=1", "parallel=single"])
        flops = model_flops_per_step(job)
        predicted = flops / (spec.compute_tflops * 1e12)
        rows.append({"seq": run["seq"], "model_flops": flops, "predicted_s": predicted,
                     "measured_s": run["step_s"], "ratio": predicted / run["step_s"]})
        print(f"gpu_check: step-time model vs stack seq {run['seq']}: ours={predicted:.4g} "
              f"baseline={run['step_s']:.4g} ratio={predicted / run['step_s']:.3f}", flush=True)
    return rows


def h200_perf_args(ctx: Context, **changes) -> argparse.Namespace:
    """h200_perf's command-line defaults (its dry-run shapes under --dry-run), no sweep."""
    saved = sys.argv
    sys.argv = ["h200_perf.py", "--no-sweep"] + (["--dry-run"] if ctx.dry_run else [])
    try:
        args = h200_perf.parse_args()
    finally:
        sys.argv = saved
    args.repeats = 0 if ctx.dry_run else 2
    for name, value in changes.items():
        setattr(args, name, value)
    return args


@dataclass(frozen=True)
class Part:
    name: str
    run: object  # Context -> dict of figures
    min_s: float  # skipped when less than this is left
    cap_s: float  # its own time cap on the GPU
    covers: tuple[str, ...]  # rows of docs/cuda_branches.md


PARTS: tuple[Part, ...] = (
    Part("env", part_env, 1, 30, ("TE specs (importable?)", "apex (importable?)")),
    Part("kernel_parity", kernel_parity.run, 45, 100,
         ("triton_sparse_mla kernels", "sparse_mla dispatch (supports)")),
    Part("activation_offload", memory_checks.run_activation_offload, 25, 60,
         ("activation_offload side stream + pinned host copies", "activation_offload events",
          "metrics.rank_memory_bytes (CUDA allocator figures)")),
    Part("host_optimizer", memory_checks.run_host_optimizer, 20, 45,
         ("host_optimizer on CUDA (megatron-core's hybrid optimizer)",)),
    Part("cuda_job", job_check.run, 40, 110,
         ("process_groups NCCL + set_device", "comm_device / param_device",
          "step.to_device non_blocking", "optim pinned host buffers", "muon host AdamW",
          "profiling CUDA activity + NVTX", "metrics.rank_memory_bytes",
          "phase_times CUDA synchronize", "assembly.model_rate (MFU by CUDA name)",
          "profiling CUDA memory snapshot", "comm_meter CUDA events by purpose",
          "mcore_compat: CPU redirects not installed on CUDA")),
    Part("dsa_vs_dense", part_dsa_vs_dense, 30, 70,
         ("dense attention: SDPA flash on CUDA", "sparse_mla dispatch (supports)")),
    Part("stack_mfu", part_stack_mfu, 40, 100,
         ("TE specs (importable?)", "h200_perf one-process NCCL group")),
    Part("calibrate", part_calibrate, 20, 50,
         ("calibrate_cluster NCCL + bf16 matmul + cuda_names",
          "calibrate_cluster --sync-ms: all-reduce per chunk, synchronize around")),
)


# ---------------------------------------------------------------------------------- runner


def run_part(part: Part, args, device: torch.device, left: float,
             earlier: dict | None = None) -> dict:
    """One part under its cap: its record for the JSON. ``earlier``: the results of the
    parts run before it, by name."""
    cap = max(1.0, min(part.cap_s, left))
    ctx = Context(device, args.dry_run, cap, args, budget=h200_perf.Budget(cap),
                  earlier=earlier or {})
    record = {"status": "failed", "covers": list(part.covers), "cap_s": round(cap, 1)}
    start = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(math.ceil(cap) + 5)  # a part's own guards come first; this is the backstop
    try:
        record["result"] = part.run(ctx)
        record["status"] = "ok" if not ctx.problems else "failed"
    except Exception as exc:  # noqa: BLE001 - one failed part must not end the others
        record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        record["traceback"] = traceback.format_exc(limit=12)[-4000:]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        record["seconds"] = round(time.perf_counter() - start, 2)
        record["not_measured"] = ctx.not_measured
        record["problems"] = ctx.problems
        _release(device)
    return record


def _alarm(signum, frame):
    raise PartTimeout("the part ran past its time cap")


def _release(device: torch.device) -> None:
    """What a part left behind freed before the next one measures device memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def write_json(path: str, report: dict) -> None:
    """Atomically (a killed run leaves the previous complete file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        json.dump(_finite(report), handle, indent=1, default=str)
    os.replace(tmp, path)


def _finite(value):
    """NaN / inf as strings: JSON has no such numbers, and a NaN error must still show."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None,
                        help="the JSON (default $OUT/gpu_check.json, else ./gpu_check.json)")
    # 270 s of parts + install and imports: within 5 minutes, so that a rerun fits a lease.
    parser.add_argument("--budget-s", type=float, default=270.0)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--parts", nargs="+", default=[p.name for p in PARTS],
                        choices=[p.name for p in PARTS])
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(os.environ.get("OUT", "."), "gpu_check.json")
    return args


def pick_device(dry_run: bool) -> torch.device | None:
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        return None
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = pick_device(args.dry_run)
    if device is None:
        print("gpu_check: no CUDA device; --dry-run runs the same code on CPU", flush=True)
        return 2
    try:
        mcore_compat.install()  # CPU: megatron-core's CUDA calls redirected; CUDA: fixes only
    except RuntimeError as exc:  # a stale entry on another megatron-core: recorded, go on
        print(f"gpu_check: mcore_compat.install() refused: {exc}"[:400], flush=True)
    chosen = [p for p in PARTS if p.name in args.parts]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    report = {"schema": SCHEMA, "dry_run": args.dry_run, "device": name,
              "budget_s": args.budget_s, "order": [p.name for p in chosen],
              "started_unix": time.time(),
              "parts": {p.name: {"status": "pending", "covers": list(p.covers)} for p in chosen}}
    write_json(args.out, report)
    start = time.perf_counter()
    for part in chosen:
        left = args.budget_s - (time.perf_counter() - start)
        if left < part.min_s:
            report["parts"][part.name].update(
                status="skipped", reason=f"{left:.0f} s of the budget left, the part needs "
                f"at least {part.min_s:.0f} s")
        else:
            print(f"gpu_check: {part.name} (cap {min(part.cap_s, left):.0f} s)", flush=True)
            earlier = {name: r.get("result") for name, r in report["parts"].items()}
            report["parts"][part.name] = run_part(part, args, device, left, earlier)
            print(f"gpu_check: {part.name} {report['parts'][part.name]['status']} in "
                  f"{report['parts'][part.name]['seconds']:.1f} s", flush=True)
        report["wall_s"] = round(time.perf_counter() - start, 1)
        write_json(args.out, report)
    statuses = [r["status"] for r in report["parts"].values()]
    report["summary"] = {s: statuses.count(s) for s in ("ok", "failed", "skipped")}
    write_json(args.out, report)
    print(f"gpu_check: {report['summary']} in {report['wall_s']} s -> {args.out}", flush=True)
    return 0 if "failed" not in statuses else 1


if __name__ == "__main__":
    sys.exit(main())
