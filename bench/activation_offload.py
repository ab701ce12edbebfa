"""Activation offloading on the real job: saved bytes per rank with and without, and the time.

    python bench/activation_offload.py [--steps 6] [--seq 256] [--micro-batches 8]

Runs the tiny GLM-5 on PP2 x VPP2 (2 CPU processes, MTP split) with 8 micro-batches per step
three times: no offloading, the pipeline warm-up offloaded (``offload_micro_batches`` = rank
0's warm-up count, 2 x (PP - 1) + (VPP - 1) x PP = 4), and every candidate forward offloaded
(``--micro-batches``). Reads the measured ``saved_bytes_peak`` / ``offloaded_bytes`` per rank
from ``metrics.jsonl`` and the planner's prediction for each (``glm5_train.plan.plan_report``).
Time is the ratio of median tokens/s (2 shared cores, CPU copies: noisy, and on CPU host
memory is device memory, so only the bytes are meaningful here).
Last line: ``ours=<rank-0 peak, all offloaded> baseline=<rank-0 peak, none> theory=<planned>
ratio=<ours/baseline>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from planned_memory import planned, run_job


def overrides(steps: int, seq: int, offload: int) -> list[str]:
    return ["model=glm5_tiny", "parallel=pp2_vpp2", f"train.train_iters={steps}",
            "train.warmup_iters=1", "train.global_batch_size=8", f"train.seq_length={seq}",
            "checkpoint.save=null", f"activations.offload_micro_batches={offload}"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=16)
    opts = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, count in (("none", 0), ("warm-up", 4), ("all", opts.micro_batches)):
            args = overrides(opts.steps, opts.seq, count)
            records, _ = run_job(2, args, os.path.join(tmp, name), name)
            last = records[-1]
            speed = statistics.median(r["tokens_per_s"] for r in records[1:])
            plan = planned(args, world=2).ranks
            results[name] = (last, speed, plan)
            print(f"{name:8s} saved_bytes_peak {last['saved_bytes_peak']} planned "
                  f"{[r.peak_activation_bytes for r in plan]} | offloaded_bytes "
                  f"{last['offloaded_bytes']} planned {[r.offloaded_bytes for r in plan]} | "
                  f"reloaded_bytes {last['reloaded_bytes']} | tokens/s {speed:.0f}")
    base, ours = results["none"], results["all"]
    print(f"step time ratio (all offloaded / none): {base[1] / ours[1]:.3f}; "
          f"warm-up / none: {base[1] / results['warm-up'][1]:.3f}")
    ours_peak, base_peak = ours[0]["saved_bytes_peak"][0], base[0]["saved_bytes_peak"][0]
    print(f"ours={ours_peak} baseline={base_peak} theory={ours[2][0].peak_activation_bytes} "
          f"ratio={ours_peak / base_peak:.3f}")


if __name__ == "__main__":
    main()
