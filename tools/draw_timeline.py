"""Draw a traced pipeline step as it ran, beside the planner's replay of the same schedule:

    torchrun --nproc-per-node 2 -m glm5_train.train parallel=pp2_vpp2 train.train_iters=2 \\
        train.profile_steps=[2,2] hydra.run.dir=outputs/pp2_vpp2_trace
    python tools/draw_timeline.py outputs/pp2_vpp2_trace [--output timeline.png]

Top: per pipeline rank (the first data-parallel replica's), the measured forward (blue) and
backward (orange) of every (model chunk, micro-batch), labelled ``<chunk>.<micro-batch>``,
from the run's ``profile/rank<N>.json`` (``train.profile_steps``, glm5_train/profiling.py);
its point-to-point and collective calls as ticks below each row; idle time shaded (the
bubbles). Bottom: megatron-core's order for the same layout replayed in time
(``parallel.pipeline_layout.replay_times``) from the planner's FLOPs per stage, at the rate the
measured forwards ran (their total time over their total planned FLOPs), backward = the
measured backward / forward time ratio. Prints each picture's bubble share.

``--memory`` (a run traced with ``train.profile_memory=true``) also draws ``memory.png``: per
pipeline rank, the bytes allocated over the step (the profiler's allocator events: CPU tensors
on CPU, the CUDA caching allocator's on GPUs; net of what was allocated when tracing began),
with each forward and backward marked as a band. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from glm5_train.job_config import compose_job
from glm5_train.plan import inputs_from_job, job_pipeline, plan_report
from glm5_train.run_dir import run_overrides
from parallel.pipeline_layout import (
    PipelineSchedule,
    TimedOp,
    bubble_fraction,
    replay_times,
)

SPAN = re.compile(r"(forward|backward) chunk (\d+) micro-batch (\d+)$")
COMM = re.compile(r"([a-z0-9_]+\.)?[a-z_]+:\d+$")


# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  # trace step 2 of a PP2 x VPP2 run, then draw it beside the planner's replay
  torchrun --nproc-per-node 2 -m glm5_train.train parallel=pp2_vpp2 train.train_iters=2 \
      train.profile_steps=[2,2] hydra.run.dir=outputs/pp2_vpp2_trace
  python tools/draw_timeline.py outputs/pp2_vpp2_trace
  python tools/draw_timeline.py outputs/pp2_vpp2_trace --memory   # traced with train.profile_memory=true
"""


def trace_events(run_dir: str, rank: int) -> list[dict]:
    with open(os.path.join(run_dir, "profile", f"rank{rank:05d}.json"), encoding="utf-8") as f:
        return json.load(f)["traceEvents"]


def memory_curve(events: list[dict], origin: float) -> tuple[list[float], list[float]]:
    """(seconds from ``origin``, bytes allocated) from the allocator's events of the rank's
    compute device (CUDA where there are any, else CPU)."""
    memory = [e for e in events if e.get("name") == "[memory]"]
    cuda = [e for e in memory if e["args"].get("Device Type") == 1]
    chosen = sorted(cuda or [e for e in memory if e["args"].get("Device Type") == 0],
                    key=lambda e: e["ts"])
    return ([e["ts"] / 1e6 - origin for e in chosen],
            [float(e["args"]["Total Allocated"]) for e in chosen])


def measured(run_dir: str, rank: int) -> tuple[list[TimedOp], list[tuple[float, float]]]:
    """(forward/backward spans, collective spans) of ``rank``'s trace, seconds from its first
    forward."""
    events = [e for e in trace_events(run_dir, rank) if e.get("ph") == "X"]
    spans, comms = [], []
    for e in events:
        match = SPAN.match(str(e.get("name", "")))
        start, end = e["ts"] / 1e6, (e["ts"] + e.get("dur", 0)) / 1e6
        if match:
            spans.append(TimedOp("F" if match.group(1) == "forward" else "B",
                                 int(match.group(2)), int(match.group(3)), start, end))
        elif COMM.match(str(e.get("name", ""))):
            comms.append((start, end))
    if not spans:
        raise SystemExit(f"{run_dir}: rank {rank}'s trace has no forward/backward ranges")
    origin = min(s.start for s in spans)
    spans = sorted((TimedOp(s.op, s.chunk, s.micro_batch, s.start - origin, s.end - origin)
                    for s in spans), key=lambda s: s.start)
    return spans, [(a - origin, b - origin) for a, b in comms]


def pipeline_ranks(world: int, pp: int) -> list[int]:
    """The global rank of each pipeline stage's first data-parallel replica (megatron-core's
    default order puts PP outermost: pipeline rank p holds ranks p x world/pp ...)."""
    return [p * (world // pp) for p in range(pp)]


def planned(job, dp: int, measured_ops: dict[int, list[TimedOp]]) -> dict[int, list[TimedOp]]:
    """The planner's replay of this layout, at the measured forward rate."""
    par = job.parallel
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    inputs = inputs_from_job(job, dp)
    report = plan_report(job.model, job_pipeline(job, dp), inputs)
    flops = [s.costs.flops_per_microbatch for s in report.stages]
    fwd = [(op, p * 1 + op.chunk * pp) for p, ops in measured_ops.items() for op in ops
           if op.op == "F"]
    seconds_per_flop = (sum(o.end - o.start for o, _ in fwd)
                        / max(1, sum(flops[stage] for _, stage in fwd)))
    ratio = (sum(o.end - o.start for ops in measured_ops.values() for o in ops if o.op == "B")
             / max(1e-12, sum(o.end - o.start for o, _ in fwd)))
    schedule = PipelineSchedule(pp, vpp, inputs.num_microbatches, inputs.microbatch_group)
    return replay_times(schedule, [f * seconds_per_flop for f in flops], ratio)


def draw(axis, timed: dict[int, list[TimedOp]], comms: dict[int, list] | None, title: str):
    colors = {"F": "#4c72b0", "B": "#dd8452"}
    end = max(o.end for ops in timed.values() for o in ops)
    for row, (rank, ops) in enumerate(sorted(timed.items())):
        y = len(timed) - 1 - row
        axis.broken_barh([(0, end)], (y - 0.4, 0.8), color="#e8e8e8")  # idle = the bubbles
        for o in ops:
            axis.broken_barh([(o.start, o.end - o.start)], (y - 0.4, 0.8), color=colors[o.op],
                             edgecolor="white", linewidth=0.5)
            axis.text((o.start + o.end) / 2, y, f"{o.chunk}.{o.micro_batch}", ha="center",
                      va="center", fontsize=6, color="white")
        for start, stop in (comms or {}).get(rank, []):
            axis.broken_barh([(start, max(stop - start, end / 2000))], (y - 0.5, 0.08),
                             color="black")
    axis.set_yticks(range(len(timed)))
    axis.set_yticklabels([f"pipeline rank {p}" for p in reversed(range(len(timed)))])
    axis.set_xlim(0, end * 1.01)
    axis.set_xlabel("seconds from the step's first forward")
    axis.set_title(title, fontsize=9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--output", help="default: <run dir>/profile/timeline.png")
    parser.add_argument("--memory", action="store_true",
                        help="also draw memory.png (trace made with train.profile_memory=true)")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("tools/draw_timeline.py needs matplotlib: pip install matplotlib") from None
    job = compose_job(run_overrides(args.run_dir))
    world = len([f for f in os.listdir(os.path.join(args.run_dir, "profile"))
                 if re.match(r"rank\d+\.json$", f)])
    par = job.parallel
    pp = par.pipeline_model_parallel_size
    dp = world // par.model_parallel_size
    real, comms = {}, {}
    for p, rank in enumerate(pipeline_ranks(world, pp)):
        real[p], comms[p] = measured(args.run_dir, rank)
    plan = planned(job, dp, real)
    shares = bubble_fraction(real), bubble_fraction(plan)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(12, 1.2 + 1.1 * pp * 2))
    draw(top, real, comms, f"measured (traced step): bubbles {shares[0]:.1%} of rank time")
    draw(bottom, plan, None, f"planner's replay of the same order at the measured rate: "
                             f"bubbles {shares[1]:.1%}")
    figure.tight_layout()
    out = args.output or os.path.join(args.run_dir, "profile", "timeline.png")
    figure.savefig(out, dpi=110)
    print(f"bubbles: measured {shares[0]:.3f}, planned {shares[1]:.3f}")
    print(f"wrote {out}")
    if args.memory:
        draw_memory(plt, args.run_dir, pipeline_ranks(world, pp), real,
                    os.path.join(os.path.dirname(out), "memory.png"))
    return 0


def draw_memory(plt, run_dir: str, ranks: list[int], spans: dict[int, list[TimedOp]],
                out: str) -> None:
    """Bytes allocated over the step per pipeline rank, forwards and backwards as bands."""
    figure, axes = plt.subplots(len(ranks), 1, figsize=(12, 2.4 * len(ranks)), squeeze=False)
    colors = {"F": "#4c72b0", "B": "#dd8452"}
    for p, rank in enumerate(ranks):
        events = trace_events(run_dir, rank)
        starts = [e["ts"] / 1e6 for e in events if e.get("ph") == "X"
                  and SPAN.match(str(e.get("name", "")))]
        times, allocated = memory_curve(events, min(starts))
        if not times:
            raise SystemExit(f"{run_dir}: rank {rank}'s trace has no allocator events: trace "
                             "with train.profile_memory=true")
        axis = axes[p][0]
        for o in spans[p]:
            axis.axvspan(o.start, o.end, color=colors[o.op], alpha=0.18, linewidth=0)
            axis.text((o.start + o.end) / 2, 0.98, f"{o.op}{o.chunk}.{o.micro_batch}",
                      transform=axis.get_xaxis_transform(), ha="center", va="top", fontsize=5)
        axis.plot(times, [b / 2**20 for b in allocated], color="black", linewidth=0.8)
        axis.set_ylabel(f"pipeline rank {p}\nMiB allocated")
        axis.set_xlim(0, max(o.end for o in spans[p]) * 1.01)
        peak = max(allocated) / 2**20
        axis.set_title(f"pipeline rank {p}: peak {peak:.1f} MiB above the trace's start "
                       "(blue: forward, orange: backward, chunk.micro-batch)", fontsize=9)
        print(f"pipeline rank {p}: peak {peak:.1f} MiB allocated during the step")
    axes[-1][0].set_xlabel("seconds from the step's first forward")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
