"""Draw a traced pipeline step as it ran, beside the planner's replay of the same schedule:

    torchrun --nproc-per-node 2 -m glm5_train.train parallel=pp2_vpp2 train.train_iters=2 \\
        train.profile_steps=[2,2] hydra.run.dir=outputs/pp2_vpp2_trace
    python tools/draw_timeline.py outputs/pp2_vpp2_trace [--output timeline.png]

Top: every traced rank (``train.profile_ranks`` picks them; all by default), one row each,
on one time scale (the ranks of one machine share its clock): the measured forward (blue) and
backward (orange) of every (model chunk, micro-batch), labelled ``<chunk>.<micro-batch>``,
from the run's ``profile/rank<N>.json`` (``train.profile_steps``, glm5_train/profiling.py);
the gradient sync (finalize) and the optimizer step as bands (``phase <name>`` ranges,
glm5_train/phase_times.py); its collectives as ticks below each row, coloured by
megatron-core group (pp, dp, tp, ep, cp, mp); idle time grey (the bubbles); a legend. Bottom, on
the same time axis: megatron-core's order for the same layout replayed in time
(``parallel.pipeline_layout.replay_times``) from the planner's FLOPs per stage, at the rate
the measured forwards ran (their total time over their total planned FLOPs), backward = the
measured backward / forward time ratio. Prints each picture's bubble share and how many ranks
it drew.

``--memory`` (a run traced with ``train.profile_memory=true``) also draws ``memory.png``: per
traced rank, the bytes allocated over the step (the profiler's allocator events: CPU tensors
on CPU, the CUDA caching allocator's on GPUs; net of what was allocated when tracing began),
with each forward and backward marked as a band. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from glm5_train.job_config import compose_job
from glm5_train.plan import inputs_from_job, job_pipeline, plan_report
from glm5_train.run_dir import run_overrides
from parallel.comm_purpose import group_family, host_range, parse_range
from parallel.pipeline_layout import (
    PipelineSchedule,
    TimedOp,
    bubble_fraction,
    replay_times,
)

SPAN = re.compile(r"(forward|backward) chunk (\d+) micro-batch (\d+)$")


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


PHASE = re.compile(r"phase (grad_sync|optimizer)$")
# Collective ticks by megatron-core group (the trace range's prefix, parallel/comm_meter.py).
GROUP_COLORS = {"pp": "#222222", "dp": "#2ca02c", "tp": "#9467bd", "ep": "#d62728",
                "cp": "#17becf", "mp": "#8c564b", "other": "#8c8c8c"}
OP_COLORS = {"F": "#4c72b0", "B": "#dd8452"}
PHASE_COLORS = {"grad_sync": "#c5b0d5", "optimizer": "#98df8a"}


@dataclass(frozen=True)
class RankTrace:
    """One rank's traced step, seconds from the step's first forward on any rank: its
    forwards and backwards, its collectives (start, end, group kind) and its grad-sync and
    optimizer phases (name, start, end)."""

    rank: int
    pipeline_rank: int
    spans: list[TimedOp]
    comms: list[tuple[float, float, str]]
    phases: list[tuple[str, float, float]]


def group_kind(name: str) -> str:
    """A collective range's group family as drawn: pp, dp (dp, dp_cp, expert dp), tp (tp,
    expt_tp, tp_ep), ep, cp, mp (model-parallel: the loss, the gradient norm), or other
    (world, unnamed groups). The purpose's family where the range names one (the pipeline's
    messages on the global group are pp), else the group's."""
    parsed = parse_range(name)
    if not parsed:
        return "other"
    if parsed["purpose"] and parsed["group"]:
        family = parsed["purpose"].split("_")[0]
    else:
        family = group_family(parsed["group"]) if parsed["group"] else ""
    return family if family in GROUP_COLORS else "other"


def first_forward(run_dir: str, rank: int) -> float:
    """Seconds (the machine's clock) of ``rank``'s first traced forward."""
    starts = [e["ts"] / 1e6 for e in trace_events(run_dir, rank) if host_range(e)
              and SPAN.match(str(e.get("name", "")))]
    if not starts:
        raise SystemExit(f"{run_dir}: rank {rank}'s trace has no forward/backward ranges")
    return min(starts)


def measured(run_dir: str, rank: int, pipeline_rank: int, origin: float) -> RankTrace:
    """``rank``'s traced step, seconds from ``origin`` (the ranks of one machine share its
    clock, so all ranks are drawn on one scale)."""
    spans, comms, phases = [], [], []
    for e in trace_events(run_dir, rank):
        if not host_range(e):
            continue
        name = str(e.get("name", ""))
        start, end = e["ts"] / 1e6 - origin, (e["ts"] + e.get("dur", 0)) / 1e6 - origin
        if match := SPAN.match(name):
            spans.append(TimedOp("F" if match.group(1) == "forward" else "B",
                                 int(match.group(2)), int(match.group(3)), start, end))
        elif parse_range(name):
            comms.append((start, end, group_kind(name)))
        elif match := PHASE.match(name):
            phases.append((match.group(1), start, end))
    return RankTrace(rank, pipeline_rank, sorted(spans, key=lambda s: s.start), comms, phases)


def pipeline_rank_of(rank: int, world: int, pp: int) -> int:
    """megatron-core's default order puts PP outermost: ranks p x world/pp ... hold stage p."""
    return rank // (world // pp)


def planned(job, dp: int, traces: list[RankTrace]) -> dict[int, list[TimedOp]]:
    """The planner's replay of this layout, at the measured forward rate (every traced rank's
    forwards over their planned FLOPs), backward = the measured backward / forward ratio."""
    par = job.parallel
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    inputs = inputs_from_job(job, dp)
    report = plan_report(job.model, job_pipeline(job, dp), inputs)
    flops = [s.costs.flops_per_microbatch for s in report.stages]
    fwd = [(op, t.pipeline_rank + op.chunk * pp) for t in traces for op in t.spans
           if op.op == "F"]
    seconds_per_flop = (sum(o.end - o.start for o, _ in fwd)
                        / max(1, sum(flops[stage] for _, stage in fwd)))
    ratio = (sum(o.end - o.start for t in traces for o in t.spans if o.op == "B")
             / max(1e-12, sum(o.end - o.start for o, _ in fwd)))
    schedule = PipelineSchedule(pp, vpp, inputs.num_microbatches, inputs.microbatch_group)
    return replay_times(schedule, [f * seconds_per_flop for f in flops], ratio)


def draw_rows(axis, rows: list[tuple[str, list[TimedOp], list, list]], end: float,
              title: str) -> None:
    """One row per entry (label, forwards/backwards, collectives, phases), top to bottom, on
    the time axis 0 .. ``end``; idle time grey (the bubbles)."""
    for row, (_, ops, comms, phases) in enumerate(rows):
        y = len(rows) - 1 - row
        axis.broken_barh([(0, end)], (y - 0.4, 0.8), color="#e8e8e8")
        for name, start, stop in phases:
            axis.broken_barh([(start, stop - start)], (y - 0.4, 0.8), color=PHASE_COLORS[name])
        for o in ops:
            axis.broken_barh([(o.start, o.end - o.start)], (y - 0.4, 0.8), color=OP_COLORS[o.op],
                             edgecolor="white", linewidth=0.5)
            axis.text((o.start + o.end) / 2, y, f"{o.chunk}.{o.micro_batch}", ha="center",
                      va="center", fontsize=6, color="white")
        for start, stop, kind in comms:
            axis.broken_barh([(start, max(stop - start, end / 2000))], (y - 0.5, 0.1),
                             color=GROUP_COLORS[kind])
    axis.set_yticks(range(len(rows)))
    axis.set_yticklabels([label for label, *_ in reversed(rows)], fontsize=7)
    axis.set_xlim(0, end * 1.01)
    axis.set_title(title, fontsize=9)


def legend_handles(patch) -> list:
    return ([patch(color=OP_COLORS["F"], label="forward (chunk.micro-batch)"),
             patch(color=OP_COLORS["B"], label="backward"),
             patch(color=PHASE_COLORS["grad_sync"], label="gradient sync (finalize)"),
             patch(color=PHASE_COLORS["optimizer"], label="optimizer step"),
             patch(color="#e8e8e8", label="idle (bubble)")]
            + [patch(color=c, label=f"{kind} collective") for kind, c in GROUP_COLORS.items()])


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
        from matplotlib.patches import Patch
    except ImportError:
        raise SystemExit("tools/draw_timeline.py needs matplotlib: pip install matplotlib") from None
    job = compose_job(run_overrides(args.run_dir))
    ranks = sorted(int(m.group(1)) for f in os.listdir(os.path.join(args.run_dir, "profile"))
                   if (m := re.match(r"rank(\d+)\.json$", f)))
    par = job.parallel
    pp = par.pipeline_model_parallel_size
    world = int(job_world(args.run_dir, ranks))
    dp = world // par.model_parallel_size
    origin = min(first_forward(args.run_dir, r) for r in ranks)
    traces = [measured(args.run_dir, r, pipeline_rank_of(r, world, pp), origin) for r in ranks]
    traces.sort(key=lambda t: (t.pipeline_rank, t.rank))
    plan = planned(job, dp, traces)
    real = {t.rank: t.spans for t in traces}
    shares = bubble_fraction(real), bubble_fraction(plan)
    end = max([o.end for t in traces for o in t.spans] + [s for t in traces for _, _, s in t.phases]
              + [o.end for ops in plan.values() for o in ops])
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(12, 2.2 + 0.45 * (
        len(traces) + pp)), gridspec_kw={"height_ratios": [max(1, len(traces)), max(1, pp)]})
    draw_rows(top, [(f"rank {t.rank} (pipeline {t.pipeline_rank})", t.spans, t.comms, t.phases)
                    for t in traces], end,
              f"measured (traced step, every traced rank): bubbles {shares[0]:.1%} of rank time")
    draw_rows(bottom, [(f"pipeline rank {p}", ops, [], []) for p, ops in sorted(plan.items())],
              end, f"planner's replay of the same order at the measured rate, same time scale: "
                   f"bubbles {shares[1]:.1%}")
    bottom.set_xlabel("seconds from the step's first forward")
    figure.legend(handles=legend_handles(Patch), loc="upper center", ncol=6, fontsize=7,
                  frameon=False)
    figure.tight_layout(rect=(0, 0, 1, 0.93))
    out = args.output or os.path.join(args.run_dir, "profile", "timeline.png")
    figure.savefig(out, dpi=110)
    optimizer = sum(1 for t in traces if any(n == "optimizer" for n, _, _ in t.phases))
    print(f"bubbles: measured {shares[0]:.3f}, planned {shares[1]:.3f}")
    print(f"drew {len(traces)} traced ranks on one time scale ({optimizer} with their optimizer "
          f"step), the planner's {pp} pipeline ranks below")
    print(f"wrote {out}")
    if args.memory:
        draw_memory(plt, args.run_dir, [t.rank for t in traces],
                    {t.rank: t.spans for t in traces}, origin,
                    os.path.join(os.path.dirname(out), "memory.png"))
    return 0


def job_world(run_dir: str, traced: list[int]) -> int:
    """The run's world size: from its metrics (one entry per rank), else the traced ranks."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            first = handle.readline()
        if first.strip():
            sizes = json.loads(first).get("mem_peak_bytes")
            if isinstance(sizes, list) and sizes:
                return len(sizes)
    return max(traced) + 1


def draw_memory(plt, run_dir: str, ranks: list[int], spans: dict[int, list[TimedOp]],
                origin: float, out: str) -> None:
    """Bytes allocated over the step per traced rank, forwards and backwards as bands, on the
    timeline's scale (seconds from ``origin``)."""
    figure, axes = plt.subplots(len(ranks), 1, figsize=(12, 2.4 * len(ranks)), squeeze=False)
    colors = OP_COLORS
    for p, rank in enumerate(ranks):
        events = trace_events(run_dir, rank)
        times, allocated = memory_curve(events, origin)
        if not times:
            raise SystemExit(f"{run_dir}: rank {rank}'s trace has no allocator events: trace "
                             "with train.profile_memory=true")
        axis = axes[p][0]
        for o in spans[rank]:
            axis.axvspan(o.start, o.end, color=colors[o.op], alpha=0.18, linewidth=0)
            axis.text((o.start + o.end) / 2, 0.98, f"{o.op}{o.chunk}.{o.micro_batch}",
                      transform=axis.get_xaxis_transform(), ha="center", va="top", fontsize=5)
        axis.plot(times, [b / 2**20 for b in allocated], color="black", linewidth=0.8)
        axis.set_ylabel(f"rank {rank}\nMiB allocated")
        axis.set_xlim(0, max(o.end for o in spans[rank]) * 1.01)
        peak = max(allocated) / 2**20
        axis.set_title(f"rank {rank}: peak {peak:.1f} MiB above the trace's start "
                       "(blue: forward, orange: backward, chunk.micro-batch)", fontsize=9)
        print(f"rank {rank}: peak {peak:.1f} MiB allocated during the step")
    axes[-1][0].set_xlabel("seconds from the step's first forward")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
