"""gpu_check part ``cuda_job``: the training job and the logits tool themselves on the device,
each one process (rank 0 of 1, as torchrun would start it). On a GPU that is CUDA + NCCL:
process_groups picks nccl and sets the device, parameters are created on the device, batches
are copied with non_blocking, megatron-core runs its own CUDA code (mcore_compat installs no
CPU redirects there).

Runs, most valuable first, glm5_tiny, parallel=single, the optimizer state in host memory:

1. ``adamw_host``: megatron-core's hybrid optimizer through get_megatron_optimizer with pinned
   host buffers (glm5_train/optim.py); step 2 profiled (torch.profiler with CUDA activity and
   the allocator's events, the schedule's ranges pushed to NVTX too: glm5_train/profiling.py);
   checkpoints at steps 2, 4.
2. ``muon_host``: Muon with its AdamW part on the host (pinned copies, a stream sync before the
   host step: parallel/muon.py), the gradient reduction overlapped (asynchronous); checkpoints
   at steps 2, 4.
3. ``adamw_resume`` / 4. ``muon_resume``: each run resumed from its step-2 checkpoint (the
   optimizer state loaded back to where it lives: host_optimizer's and muon's CUDA branches);
   steps 3-4 must repeat the uninterrupted run's losses.
5. ``logits``: tools/logits.py on the AdamW checkpoint (glm5_train/inference.py's forward-only
   schedule, tokens moved to the device).

Per run: exit status, losses, ``mem_peak_bytes`` (metrics.rank_memory_bytes: the CUDA
allocator's peak on a GPU, the process's peak RSS on CPU), optimizer bytes on the device and on
the host, and glm5_train.plan.check's comparison of the planner's bytes (parameters, gradients,
optimizer state, host bytes, activations: on CUDA the planner assumes fused attention) with
the measured ones; for the profiled run the trace's event counts by category ("kernel": CUDA
kernels recorded; "user_annotation": the labelled ranges), its allocator events by device
type (1: CUDA, what tools/draw_timeline.py plots) and its collectives by purpose
(parallel/comm_purpose.py: the gradient all-reduce must be named ``dp_grad_all_reduce``);
per run the step's collectives by purpose from metrics.jsonl (``comm_by_purpose``: on CUDA
timed by CUDA events, which must read back finite, adding up to ``comm_calls``, inside the
step). Dry run: ``adamw_host`` alone, one
step at 64 tokens, no checkpoint (each job start costs ~15 s of this CPU).
"""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
import tempfile

import h200_perf
import torch

from glm5_train.job_config import compose_job
from glm5_train.plan import check as plan_check
from glm5_train.plan.step_time import device_peak_tflops
from parallel.comm_purpose import host_range, parse_range

RESUME_RTOL = 1e-4  # fp32 losses of resumed steps (CUDA atomics reorder sums; a bad resume: 1e-2)
TINY = ["model=glm5_tiny", "parallel=single"]
# One step traced: CPU + CUDA activity and the allocator's events (tools/draw_timeline.py plots
# the CUDA ones where there are any).
PROFILED = "train.profile_steps=[{step},{step}] train.profile_memory=true"
OPTIMIZERS = {"adamw": ["parallel.optimizer_cpu_offload=true"],
              # the gradient all-reduce overlapped: megatron-core's asynchronous coalesced
              # sync, whose wait comm_by_purpose times (row 41)
              "muon": ["train.optimizer=muon", "parallel.optimizer_cpu_offload=true",
                       "parallel.overlap_grad_reduce=true"]}


def train_overrides(name: str, root: str, dry_run: bool) -> list[str]:
    """The job's overrides for run ``name`` (<optimizer>_host or <optimizer>_resume)."""
    optimizer, kind = name.split("_")
    run_dir = os.path.join(root, name)
    ckpt = os.path.join(root, f"ckpt_{optimizer}")
    if dry_run:
        steps = ["train.train_iters=1", "train.warmup_iters=0", "train.global_batch_size=2",
                 "train.seq_length=64", "checkpoint.save=null", *PROFILED.format(step=1).split()]
    elif kind == "host":
        steps = ["train.train_iters=4", "train.warmup_iters=1", f"checkpoint.save={ckpt}",
                 "checkpoint.save_interval=2", "checkpoint.keep_last=null"]
        steps += PROFILED.format(step=2).split() if optimizer == "adamw" else []
    else:
        steps = ["train.train_iters=4", "train.warmup_iters=1", "checkpoint.save=null",
                 f"checkpoint.load={ckpt}"]
    return [*TINY, *steps, *OPTIMIZERS[optimizer], f"hydra.run.dir={run_dir}"]


def child_env() -> dict:
    """One process without torchrun (the job reads rank 0 of 1 then; torchrun's agent would
    only add a process start), on a free port of its own."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the job as it runs: the kernel compiled, or not at all
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(h200_perf._free_port()),
               PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (h200_perf.REPO, env.get("PYTHONPATH"))
                                        if p)
    return env


def launch(args: list[str], log_path: str, ctx) -> object:
    """Exit status of ``python args`` in the repository root (a string on a timeout)."""
    limit = max(10.0, min(90.0, ctx.budget.left() - 5))
    with open(log_path, "w") as log:
        try:
            return subprocess.run([sys.executable, *args], cwd=h200_perf.REPO, env=child_env(),
                                  stdout=log, stderr=subprocess.STDOUT, timeout=limit,
                                  check=False).returncode
        except subprocess.TimeoutExpired:
            return f"timeout after {limit:.0f} s"


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def trace_counts(run_dir: str) -> dict | None:
    """The profiled step's events by category, and its allocator events by device type
    (0 CPU, 1 CUDA: the key draw_timeline.memory_curve chooses by)."""
    path = os.path.join(run_dir, "profile", "rank00000.json")
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        events = json.load(handle).get("traceEvents", [])
    memory = [e for e in events if e.get("name") == "[memory]"]
    collectives = [parse_range(str(e.get("name", ""))) for e in events if host_range(e)]
    return {"by_category": dict(collections.Counter(str(e.get("cat")) for e in events)),
            "memory_by_device_type": dict(collections.Counter(
                str(e.get("args", {}).get("Device Type")) for e in memory)),
            # what each traced collective was for (parallel/comm_purpose.py)
            "collective_purposes": dict(collections.Counter(
                c["purpose"] or "unnamed" for c in collectives if c))}


def log_tail(path: str) -> str:
    with open(path) as handle:
        return handle.read()[-3000:]


def train_run(name: str, ctx, root: str) -> dict:
    overrides = train_overrides(name, root, ctx.dry_run)
    run_dir = os.path.join(root, name)
    rc = launch(["-m", "glm5_train.train", *overrides], os.path.join(root, f"{name}.log"), ctx)
    records = read_metrics(run_dir)
    last = records[-1] if records else {}
    run = {"rc": rc, "steps": [r.get("step") for r in records],
           "losses": [r.get("loss") for r in records],
           "mem_peak_bytes": last.get("mem_peak_bytes"),
           "optimizer_state_bytes": last.get("optimizer_state_bytes"),
           "optimizer_host_bytes": last.get("optimizer_host_bytes"),
           "phase_ms": last.get("phase_ms"), "step_time_ms": last.get("step_time_ms"),
           "comm_calls": last.get("comm_calls"), "comm_by_purpose": last.get("comm_by_purpose"),
           "tflops_per_gpu": last.get("tflops_per_gpu"), "mfu": last.get("mfu"),
           "params_dtype": compose_job(overrides).train.params_dtype}
    if any(o.startswith("train.profile_steps") for o in overrides):
        run["trace_event_counts"] = trace_counts(run_dir)
        snapshot = os.path.join(run_dir, "profile", "rank00000_memory_snapshot.pickle")
        run["memory_snapshot_bytes"] = (os.path.getsize(snapshot) if os.path.exists(snapshot)
                                        else 0)
    if records:  # the planner's bytes against these (activations: fused attention on CUDA)
        run["plan_problems"] = plan_check.problems(compose_job(overrides), last)
    if rc != 0 or not records:
        run["log_tail"] = log_tail(os.path.join(root, f"{name}.log"))
    return run


def check_train(name: str, run: dict, ctx, runs: dict) -> None:
    problems = ctx.problems
    want = [1] if ctx.dry_run else ([1, 2, 3, 4] if name.endswith("_host") else [3, 4])
    if run["rc"] != 0 or run["steps"] != want:
        problems.append(f"{name}: rc {run['rc']}, steps {run['steps']} (want {want})")
        return
    if not all(isinstance(x, float) and math.isfinite(x) for x in run["losses"]):
        problems.append(f"{name}: non-finite loss {run['losses']}")
    if not (run["optimizer_host_bytes"] or [0])[0]:
        problems.append(f"{name}: no optimizer bytes in host memory")
    if name.startswith("adamw") and (run["optimizer_state_bytes"] or [1])[0]:
        problems.append(f"{name}: AdamW state left on the device: {run['optimizer_state_bytes']}")
    problems += [f"{name}: planner: {p}" for p in run.get("plan_problems", [])]
    problems += [f"{name}: {p}" for p in phase_problems(run)]
    problems += [f"{name}: {p}" for p in rate_problems(run, ctx.device)]
    problems += [f"{name}: {p}" for p in purpose_problems(run)]
    if "trace_event_counts" in run:
        counts = run["trace_event_counts"] or {"by_category": {}, "memory_by_device_type": {}}
        if not counts["by_category"].get("user_annotation"):
            problems.append(f"{name}: profile trace missing or without labelled ranges")
        elif ctx.device.type == "cuda" and not counts["by_category"].get("kernel"):
            problems.append(f"{name}: the profile recorded no CUDA kernel")
        elif ctx.device.type == "cuda" and not counts["memory_by_device_type"].get("1"):
            problems.append(f"{name}: the profile recorded no CUDA allocator event")
        elif not counts["memory_by_device_type"]:
            problems.append(f"{name}: the profile recorded no allocator event")
        elif ctx.device.type == "cuda" and not run.get("memory_snapshot_bytes"):
            problems.append(f"{name}: no CUDA memory snapshot beside the trace")
        elif not counts.get("collective_purposes", {}).get("dp_grad_all_reduce"):
            problems.append(f"{name}: no gradient all-reduce named in the trace (ranges by "
                            f"purpose: {counts.get('collective_purposes')})")
    if name.endswith("_resume"):
        uninterrupted = runs.get(name.replace("_resume", "_host"), {}).get("losses", [])[2:]
        worst = max((abs(a - b) / abs(a) for a, b in zip(uninterrupted, run["losses"])),
                    default=math.inf)
        run["loss_max_rel_diff_vs_uninterrupted"] = worst
        if not worst <= RESUME_RTOL:
            problems.append(f"{name}: steps 3-4 differ from the uninterrupted run by {worst:.3e}")


def phase_problems(run: dict) -> list[str]:
    """The step's phases (glm5_train/phase_times.py, the device synchronised at each
    boundary on CUDA): every phase took time, grad sync inside forward-backward, both phases
    inside the step."""
    phases, steps = run.get("phase_ms") or {}, run.get("step_time_ms") or []
    if set(phases) != {"forward_backward", "grad_sync", "optimizer"} or not steps:
        return [f"phase_ms {phases} / step_time_ms {steps}: missing"]
    fb, sync, opt = (phases[p][0] for p in ("forward_backward", "grad_sync", "optimizer"))
    if not (0 < sync < fb and opt > 0 and fb + opt <= steps[0]):
        return [f"phases out of order: forward_backward {fb}, grad_sync {sync}, optimizer "
                f"{opt}, step {steps[0]} ms"]
    return []


def purpose_problems(run: dict) -> list[str]:
    """The step's collectives by purpose (parallel/comm_meter.py; on CUDA timed by events on
    the current stream, read at the step's end): the gradient all-reduce named, the calls
    adding up to ``comm_calls``, every time finite and not negative, their sum above 0 (one
    process: every group has one rank, so a single call may round to 0.000 ms, but not all
    of them) and inside the step."""
    purposes, steps = run.get("comm_by_purpose") or {}, run.get("step_time_ms") or []
    if "dp_grad_all_reduce" not in purposes or not steps:
        return [f"comm_by_purpose without dp_grad_all_reduce: {sorted(purposes)}"]
    calls = sum(p["calls"][0] for p in purposes.values())
    held = [p["ms"][0] for p in purposes.values()]
    if calls != (run.get("comm_calls") or [None])[0]:
        return [f"comm_by_purpose calls {calls} != comm_calls {run.get('comm_calls')}"]
    if not all(math.isfinite(ms) and ms >= 0 for ms in held) or not 0 < sum(held) <= steps[0]:
        return [f"comm_by_purpose ms {held} not in [0, step {steps[0]} ms]"]
    return []


def rate_problems(run: dict, device: torch.device) -> list[str]:
    """The step's throughput (glm5_train/phase_times.py ModelRate): TFLOP/s per GPU on every
    run; MFU in (0, 1) on a bf16 run where the device's peak is known (an H100 SXM or H200 SXM
    by its exact CUDA name: device_peak_tflops), and none elsewhere."""
    tflops, mfu = run.get("tflops_per_gpu"), run.get("mfu")
    if not (isinstance(tflops, float) and tflops > 0):
        return [f"tflops_per_gpu {tflops}: missing or not positive"]
    known = (device.type == "cuda" and run.get("params_dtype") == "bf16"
             and device_peak_tflops(torch.cuda.get_device_name()) is not None)
    if known and not (isinstance(mfu, float) and 0 < mfu < 1):
        return [f"mfu {mfu} on {torch.cuda.get_device_name()}: want a share in (0, 1)"]
    if not known and mfu is not None:
        return [f"mfu {mfu} without a known device peak"]
    return []


def resume_from_step_2(root: str, optimizer: str) -> None:
    """The uninterrupted run saved steps 2 and 4; the resume starts after step 2."""
    with open(os.path.join(root, f"ckpt_{optimizer}", "latest_iteration.txt"), "w") as handle:
        handle.write("2\n")


def logits_run(ctx, root: str) -> dict:
    """tools/logits.py on the AdamW run's step-2 checkpoint: fp32 logits [1, 64, vocab]."""
    tokens = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(3))
    torch.save(tokens, os.path.join(root, "tokens.pt"))
    out = os.path.join(root, "logits.pt")
    rc = launch(["tools/logits.py", "--load", os.path.join(root, "ckpt_adamw"), "--tokens",
                 os.path.join(root, "tokens.pt"), "--out", out, *TINY],
                os.path.join(root, "logits.log"), ctx)
    run = {"rc": rc}
    if rc == 0 and os.path.exists(out):
        logits = torch.load(out)
        run.update(shape=list(logits.shape), finite=bool(torch.isfinite(logits).all()))
    else:
        run["log_tail"] = log_tail(os.path.join(root, "logits.log"))
    if run.get("shape", [None])[:2] != [1, 64] or not run.get("finite"):
        ctx.problems.append(f"logits: rc {rc}, {run.get('shape')}, finite {run.get('finite')}")
    return run


def run(ctx) -> dict:
    runs: dict = {}
    order = ["adamw_host"] if ctx.dry_run else ["adamw_host", "muon_host", "adamw_resume",
                                                "muon_resume", "logits"]
    with tempfile.TemporaryDirectory(prefix="gpu_check_job_") as root:
        for name in order:
            if ctx.budget.left() < 20:
                ctx.not_measured[name] = "not run: the part's time cap was spent"
                continue
            if name == "logits":
                runs[name] = logits_run(ctx, root)
                continue
            if name.endswith("_resume"):
                resume_from_step_2(root, name.split("_")[0])
            runs[name] = train_run(name, ctx, root)
            check_train(name, runs[name], ctx, runs)
    if ctx.dry_run:
        for name in ("muon_host", "adamw_resume", "muon_resume", "logits"):
            ctx.not_measured[name] = "run on the GPU only (each job start: ~15 s of this CPU)"
        ctx.not_measured["mem_peak_bytes"] = "CPU: the process's peak RSS, not a CUDA figure"
        ctx.not_measured["trace kernel events"] = "CUDA only: not measured in a CPU dry run"
    return {"runs": runs, "mem_peak_source": "torch.cuda.max_memory_allocated"
            if ctx.device.type == "cuda" else "peak RSS (CPU)"}
