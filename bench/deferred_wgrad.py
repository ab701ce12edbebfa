"""Deferred weight gradients: step time and the bytes the deferred GEMMs hold, against the
same job without deferral, in the same script.

What deferral is for: a pipeline stage sends its input gradient upstream before its weight-
gradient GEMMs (W) run, and W fills the wait for the next message, so the 1F1B cool-down's
backward chain costs F + B per stage instead of F + B + W (ZB-H1). The gain is largest with
few micro-batches per step: ideally (PP - 1) x W out of (M + PP - 1) x (F + B + W) for M
micro-batches per rank.

Runs PP2 on 2 processes (one core each on a 2-core machine: a waiting rank really idles), the
MTP layer with the loss so both stages hold decoder layers, glm5_tiny at 4x its hidden and MLP
widths (so that GEMMs, not the tiny model's elementwise work, make most of a step), alternating baseline / deferred
``--rounds`` times; prints each run's median step time (steps after the first two), the ratio
deferred / baseline (the median over rounds), and, from the deferred run's own metrics, the
weight-gradient GEMMs each rank deferred, how many ran inside a p2p exchange, the most bytes
the queue held at once (exact: inputs + output gradients of the queued GEMMs) beside the peak
of the step's saved activations, the time the W GEMMs took, and each rank's process peak
memory with and without deferral.

    python bench/deferred_wgrad.py [--rounds 3] [--steps 12] [--seq 512] [--micro 2] [--width 4]

Last line: ``ours=<deferred median s> baseline=<median s> ratio=<deferred/baseline>``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

from job import run_training


def overrides(args, deferred: bool) -> list[str]:
    widths = [f"model.hidden_size={128 * args.width}",
              f"model.intermediate_size={256 * args.width}",
              f"model.moe_intermediate_size={64 * args.width}"]
    return ["model=glm5_tiny", *widths, "parallel=pp2", "parallel.mtp_placement=with_loss",
            f"train.train_iters={args.steps}", f"train.seq_length={args.seq}",
            f"train.global_batch_size={args.micro}", "train.micro_batch_size=1",
            "train.log_interval=1", "checkpoint.save=null",
            f"parallel.defer_weight_grads={str(deferred).lower()}"]


def median_step_seconds(records: list[dict], tokens: int) -> float:
    return statistics.median(tokens / r["tokens_per_s"] for r in records[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--width", type=int, default=4,
                        help="glm5_tiny's hidden and MLP widths times this (GEMMs dominate)")
    args = parser.parse_args()
    tokens = args.seq * args.micro
    times: dict[bool, list[float]] = {False: [], True: []}
    last, peaks = None, {}
    for round_index in range(args.rounds):
        for deferred in (False, True):
            label = "deferred" if deferred else "baseline"
            records = run_training(2, overrides(args, deferred), tempfile.mkdtemp(), label)
            times[deferred].append(median_step_seconds(records, tokens))
            print(f"round {round_index + 1} {label}: median step {times[deferred][-1]:.4f} s",
                  flush=True)
            peaks[deferred] = records[-1]["mem_peak_bytes"]
            if deferred:
                last = records[-1]
    ratios = [d / b for d, b in zip(times[True], times[False])]
    print(f"per-round ratios deferred/baseline: {' '.join(f'{r:.3f}' for r in ratios)}")
    for name in ("wgrad_deferred", "wgrad_run_in_p2p", "wgrad_queue_peak_bytes", "wgrad_us",
                 "saved_bytes_peak"):
        print(f"{name} per rank (last step): {last[name]}")
    print(f"process peak memory per rank (last round): deferred {peaks[True]}, baseline "
          f"{peaks[False]}, ratio "
          f"{' '.join(f'{d / b:.3f}' for d, b in zip(peaks[True], peaks[False]))}")
    ours, base = statistics.median(times[True]), statistics.median(times[False])
    print(f"ours={ours:.4f} baseline={base:.4f} ratio={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    sys.exit(main())
