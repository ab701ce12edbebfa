"""One full training step of the tiny GLM-5 on 202,752-token sequences at context parallel 4
(zigzag shards of 50,688 tokens per rank), DSA sparse stage with its KL, MTP 3 steps, chunked
loss: proof that GLM-5's SFT window trains with CP on this machine, and what it costs.

    python bench/cp_202k.py [--seq 202752] [--cp 4] [--steps 2]

Prints per step the time and every rank's peak RSS, then for comparison the same job at
seq / cp tokens on one process (what one CP rank's share would cost without CP: the saved
activations per token should match, the indexer's work per rank is the CP share of S^2).
Last line: ``ours=<CP step s> baseline=<one-process step s at seq / cp> ratio=``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from job import run_training  # noqa: E402


def overrides(seq: int, steps: int) -> list[str]:
    # Full recompute: without it the tiny model keeps ~115 KB per token for backward
    # (bench/long_context.py), 5.8 GB per rank at 50,688 tokens: four ranks exceed this
    # machine's 24 GB. GLM-5's 200K SFT recipes recompute fully as well.
    return ["model=glm5_tiny", f"model.max_position_embeddings={seq}", f"train.seq_length={seq}",
            f"train.train_iters={steps}", "train.warmup_iters=0", "train.global_batch_size=1",
            "train.micro_batch_size=1", "checkpoint.save=null", "checkpoint.load=null",
            "activations.recompute_granularity=full", "activations.recompute_method=uniform",
            "activations.recompute_num_layers=1"]


def report(label: str, records: list[dict], seq: int) -> float:
    for r in records:
        r["step_time_s"] = seq / r["tokens_per_s"]  # one sequence per step
        peaks = ", ".join(f"{b / 2**30:.2f}" for b in r["mem_peak_bytes"])
        print(f"{label} step {r['step']}: loss {r['loss']:.4f}  {r['step_time_s']:.1f} s  "
              f"peak RSS per rank [{peaks}] GiB  saved for backward (peak, per rank) "
              f"{max(r['saved_bytes_peak']) / 2**30:.2f} GiB", flush=True)
    return records[-1]["step_time_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=202752)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cp = run_training(args.cp, [*overrides(args.seq, args.steps), "parallel=single",
                                    f"parallel.context_parallel_size={args.cp}"],
                          os.path.join(tmp, "cp"), f"CP{args.cp}")
        ours = report(f"seq {args.seq} CP{args.cp}", cp, args.seq)
        local = args.seq // args.cp
        one = run_training(1, [*overrides(local, args.steps), "parallel=single"],
                           os.path.join(tmp, "one"), "one process")
        baseline = report(f"seq {local} 1 process", one, local)
    print(f"ours={ours:.3f} baseline={baseline:.3f} ratio={ours / baseline:.3f}")


if __name__ == "__main__":
    main()
