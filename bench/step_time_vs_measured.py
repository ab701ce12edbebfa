"""The step-time model (glm5_train/plan/step_time.py) against measured steps, on the CPU layouts
of the parity matrix: how far the prediction is from this machine's step, and why.

    python bench/step_time_vs_measured.py [--steps 6] [--repeats 2] [--layouts single,tp2,...]
        [--width tiny|compute_bound] [--seq-length 64]

1. A cluster spec for this machine, measured by ``tools/calibrate_cluster.py`` before each
   layout's first run and after each of its runs (micro-benchmarks: a matmul rate, a
   batched small matmul's at the sparse attention's shape, copy bandwidth, an all-gather's,
   a reduce-scatter's and an all-reduce's bandwidth and a small all-reduce's latency; never
   the layouts below). It runs as many gloo ranks as the layout keeps cores busy (its
   ranks, at most the machine's cores), each figure timed as a synchronized job runs (its
   ``--sync-ms`` default). This machine's speed
   drifts by up to 2x over tens of minutes, so each run is predicted on the average of the
   two specs measured right around it.
2. Each layout (the tiny GLM-5, 4 sequences of 64 tokens per step, as tests/parity.py runs
   it; ``--width compute_bound`` widens it to hidden 1024, enough at ``--seq-length 512`` for
   a CPU step to be bound by its matmuls rather than by operator dispatch) trained
   ``--steps`` steps, ``--repeats`` times; its step time is the median of each run's steps
   after the first two (warm-up), and the spread is the range over the runs.
3. The model's prediction for the same job on each run's spec; where the layout has more
   ranks than the machine has cores, each rank at its share of the core (``shared_cores``).

Prints per layout the measured step (the median of the runs, and their spread), the
predicted step (the median of the runs' predictions), the layout's ratio predicted /
measured (the median of the runs' ratios) and each run's ratio, the last run's phase split
(forward-backward, grad sync, optimizer: the busiest rank's, medians over the steps after
the warm-up) and its collective calls per step (the busiest rank's); then, per layout, where
the time went on the busiest rank (the one its collectives held least) against the model's
busiest rank (the one that waits least), in ms: communication by the model's kinds
(measured: the time each collective held the rank, metrics.jsonl's ``comm_by_purpose``; the
pipeline's waits are its bubble, so the model's bubble is added to its pipeline sends
there), the rest (compute and the optimizer; the model's own compute, optimizer and any
bubble of a layout without a pipeline); then ``ours=<the ratio farthest from 1>
baseline=1.0 ratio=<same>`` (the target: 0.85-1.15 on every layout).

What it shows on this 2-core machine (docs/step_time.md): the tiny model's step is bound by
operator dispatch and by gloo's per-call cost between compute, neither of which a FLOPs and
bytes model holds, so the prediction is one to two orders of magnitude short; at
``--width compute_bound --seq-length 512 --repeats 3`` six of the eight layouts come within
15% and TP2 and CP2, the layouts with the most collective calls, at 0.72-0.76 (0.64 and
0.74 in a later ``--repeats 1`` run, each op at its own rate); at
``--seq-length 1024`` (about 18 minutes at ``--repeats 1``) all eight came within 0.81-1.09
in one run, six of them within 15%, and a layout's ratio moved by up to 0.18 between runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from job import REPO, run_training

from glm5_train.job_config import compose_job
from glm5_train.plan import inputs_from_job
from glm5_train.plan.elementwise import COUNTED_WIDTHS
from glm5_train.plan.step_time import (
    ClusterSpec,
    load_cluster,
    measured_split,
    predict_step_time,
    predicted_split,
    split_text,
)

BASE = ["model=glm5_tiny", "train.warmup_iters=0", "train.global_batch_size=4",
        "train.micro_batch_size=1", "checkpoint.save=null"]
# A GLM-5 of the tiny one's depth at widths where a CPU step is bound by its matmuls (about
# 0.8 TFLOP per step at 512 tokens), not by operator dispatch: the regime the model prices,
# and the widths its element-wise constants were counted at.
WIDTHS = {"tiny": [], "compute_bound": COUNTED_WIDTHS}
CORES = len(os.sched_getaffinity(0))
DISTRIBUTED = "parallel.use_distributed_optimizer=true"
# name -> (ranks, overrides): the parity matrix's layouts and the README's main-job layout
LAYOUTS = {
    "single": (1, ["parallel=single"]),
    "tp2": (2, ["parallel=tp2"]),
    "pp2": (2, ["parallel=pp2"]),
    "pp2_vpp2": (2, ["parallel=pp2_vpp2"]),
    "ep2": (2, ["parallel=ep2"]),
    "cp2": (2, ["parallel=single", "parallel.context_parallel_size=2"]),
    "dp2_distributed": (2, ["parallel=single", DISTRIBUTED]),
    "main_tp2_pp2_vpp2_ep2": (4, ["parallel=tp2_pp2_vpp2_ep2", DISTRIBUTED]),
}
WARMUP_STEPS = 2


def calibrated_spec(workdir: str, name: str, job, ranks: int) -> str:
    """A spec measured now on as many ranks as the layout keeps cores busy, its batched
    matmul at the shape of the layout's sparse attention on one rank (queries per
    micro-batch on the rank, heads on the rank, latent width, picks)."""
    cfg, inputs = job.model, inputs_from_job(job, ranks // job.parallel.world_size_needed(1))
    head_parallel = inputs.cp_comm == "head_parallel"
    queries = inputs.micro_batch_size * inputs.seq_length // (1 if head_parallel else inputs.cp)
    heads = cfg.num_attention_heads // (inputs.tp * (inputs.cp if head_parallel else 1))
    shape = (queries, heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
             min(cfg.index_topk, inputs.seq_length))
    out = os.path.join(workdir, f"{name}_{len(os.listdir(workdir))}.yaml")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(min(ranks, CORES)),
           os.path.join(REPO, "tools", "calibrate_cluster.py"), "--out", out,
           "--bmm-shape", ",".join(map(str, shape))]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"calibration failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return out


def averaged(first: ClusterSpec, second: ClusterSpec) -> ClusterSpec:
    """The two specs' rates averaged (links included), the first's other fields."""
    def mean(a: float, b: float) -> float:
        return (a + b) / 2

    def link(a, b):  # every rate and the latency
        return dataclasses.replace(a, **{f.name: mean(getattr(a, f.name), getattr(b, f.name))
                                         for f in dataclasses.fields(a)})

    return dataclasses.replace(
        first, compute_tflops=mean(first.compute_tflops, second.compute_tflops),
        batched_matmul_tflops=mean(first.batched_matmul_tflops, second.batched_matmul_tflops),
        memory_gbs=mean(first.memory_gbs, second.memory_gbs),
        intra_node=link(first.intra_node, second.intra_node),
        inter_node=link(first.inter_node, second.inter_node))


def spec_text(cluster: ClusterSpec) -> str:
    intra = cluster.intra_node
    link = (f"{intra.rates_text('.2f')} at {intra.latency_us:.0f} us" if intra.latency_us
            else "no link (one process)")
    return (f"{cluster.compute_tflops:.3f}/{cluster.batched_matmul_tflops:.3f} TFLOP/s, "
            f"{cluster.memory_gbs:.1f} GB/s, {link}")


def shared_cores(cluster: ClusterSpec, ranks: int) -> ClusterSpec:
    """The spec as each of ``ranks`` processes sees it when they outnumber the cores: the
    calibration measured one rank per core, so k ranks per core each get 1/k of its compute
    and memory rates (the main job's 4 ranks on this machine's 2 cores)."""
    shared = max(1.0, ranks / CORES)
    return dataclasses.replace(cluster, compute_tflops=cluster.compute_tflops / shared,
                               batched_matmul_tflops=cluster.batched_matmul_tflops / shared,
                               memory_gbs=cluster.memory_gbs / shared)


def measured_step(records: list[dict]) -> float:
    steps = [r["step_time_s"] for r in records if "step_time_s" in r]
    return statistics.median(steps[WARMUP_STEPS:] or steps)


def phase_ms(records: list[dict]) -> str:
    """The busiest rank's forward-backward / grad sync / optimizer milliseconds, each the
    median over the steps after the warm-up."""
    steps = [r["phase_ms"] for r in records if "phase_ms" in r]
    steps = steps[WARMUP_STEPS:] or steps
    return "/".join(f"{statistics.median(max(s[p]) for s in steps):.0f}"
                    for p in ("forward_backward", "grad_sync", "optimizer"))


def calls_per_step(record: dict) -> int:
    """The busiest rank's collective calls in the step (the meter's counts)."""
    by_group = record.get("comm_by_group", {})
    ranks = max((len(e["calls"]) for e in by_group.values()), default=0)
    return max((sum(e["calls"][g] for e in by_group.values()) for g in range(ranks)), default=0)


def measured_median_split(records: list[dict]) -> dict[str, float]:
    """``measured_split`` of each step after the warm-up, part by part the median."""
    timed = [r for r in records if "comm_by_purpose" in r]
    per_step = [measured_split(r) for r in (timed[WARMUP_STEPS:] or timed)]
    if not per_step:
        raise SystemExit("no step recorded comm_by_purpose: train.log_comm_by_purpose is off")
    return {k: statistics.median(s[k] for s in per_step) for k in per_step[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--width", choices=sorted(WIDTHS), default="tiny")
    parser.add_argument("--seq-length", type=int, default=64)
    args = parser.parse_args()
    if args.repeats < 1 or args.steps < 1:
        raise SystemExit(f"--repeats {args.repeats} --steps {args.steps}: each must be at "
                         "least 1 (e.g. --repeats 2 --steps 6)")
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    with tempfile.TemporaryDirectory(prefix="glm5_step_time_") as workdir:
        print(f"{'layout':>22} {'measured s':>10} {'spread':>7} {'predicted s':>11} "
              f"{'ratio':>7} {'run ratios':>14} {'fwd-bwd/sync/opt ms':>22} {'calls':>6}  "
              "spec (around the last run)")
        worst = 1.0  # the ratio farthest from 1, either way
        splits = []
        for name in names:
            ranks, overrides = LAYOUTS[name]
            job_overrides = [*BASE, f"train.seq_length={args.seq_length}", *WIDTHS[args.width],
                             f"train.train_iters={args.steps}", *overrides]
            job = compose_job(job_overrides)
            specs = [load_cluster(calibrated_spec(workdir, name, job, ranks))]
            runs = []
            for i in range(args.repeats):  # each run between two calibrations
                runs.append(run_training(ranks, job_overrides,
                                         os.path.join(workdir, f"{name}_{i}"), name))
                specs.append(load_cluster(calibrated_spec(workdir, name, job, ranks)))
            steps = [measured_step(r) for r in runs]
            measured = statistics.median(steps)
            spread = (max(steps) - min(steps)) / measured
            dp = ranks // job.parallel.world_size_needed(1)
            around = [shared_cores(averaged(a, b), ranks) for a, b in itertools.pairwise(specs)]
            predictions = [predict_step_time(job, dp, cluster) for cluster in around]
            ratios = [p.step_seconds / m for p, m in zip(predictions, steps)]
            ratio = statistics.median(ratios)
            predicted = statistics.median(p.step_seconds for p in predictions)
            splits.append(f"{name:>22}  " + split_text(measured_median_split(runs[-1]),
                                                       predicted_split(predictions[-1])))
            if abs(math.log(ratio)) > abs(math.log(worst)):
                worst = ratio
            metered = [r for r in runs[-1] if "comm_by_group" in r][-1]
            print(f"{name:>22} {measured:>10.3f} {spread:>7.1%} {predicted:>11.4f} "
                  f"{ratio:>7.3f} {'/'.join(f'{r:.2f}' for r in ratios):>14} "
                  f"{phase_ms(runs[-1]):>22} {calls_per_step(metered):>6}  "
                  f"{spec_text(averaged(specs[-2], specs[-1]))}", flush=True)
        print("where the busiest rank's step went, ms measured/predicted (last run):")
        for line in splits:
            print(line)
    print(f"ours={worst:.4f} baseline=1.0 ratio={worst:.4f}")


if __name__ == "__main__":
    main()
