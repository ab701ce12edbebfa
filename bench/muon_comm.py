"""Zero-redundant distributed Muon: Muon bytes communicated per step against a naive Muon that
gathers every gradient everywhere.

    python bench/muon_comm.py [--dp 4] [--steps 2]

Runs the real training job (tiny GLM-5, fp32, ``--dp`` CPU processes, pure data parallel,
megatron-core's distributed optimizer) three times with the same model and data:

- ``adamw``: AdamW on every parameter: the distributed optimizer's own traffic (gradient
  reduce-scatter, parameter all-gather, grad-norm scalars);
- ``owners``: Muon, one owner per matrix (``train.muon_zero_redundant=true``, the default);
- ``naive``: Muon where every rank gathers every matrix's gradient pieces from every rank and
  orthogonalises everything (``train.muon_zero_redundant=false``).

Muon bytes = a run's bytes sent per step (exact counts, ``parallel/comm_meter.py``, summed over
ranks) minus the AdamW run's: traffic Muon adds. Theory: the naive figure / dp (each matrix's
pieces sent to one rank instead of all); the owner choice, which prefers the rank already
holding most of a matrix, can beat it. Also printed: optimizer-state bytes per rank (momentum
only on owners). Last line: ``ours=<bytes> baseline=<bytes> theory=<bytes>
ratio=<ours/baseline>``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from job import run_training

MODES = {
    "adamw": ["train.optimizer=adamw"],
    "owners": ["train.optimizer=muon", "train.muon_zero_redundant=true"],
    "naive": ["train.optimizer=muon", "train.muon_zero_redundant=false"],
}


def run(mode: str, args, run_dir: str) -> list[dict]:
    overrides = ["model=glm5_tiny", "parallel=single", "parallel.use_distributed_optimizer=true",
                 f"train.train_iters={args.steps}", "train.warmup_iters=1",
                 f"train.global_batch_size={args.dp}", f"train.seq_length={args.seq}",
                 "checkpoint.save=null", *MODES[mode]]
    return run_training(args.dp, overrides, run_dir, mode)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {mode: run(mode, args, os.path.join(tmp, mode)) for mode in MODES}
    last = {mode: records[-1] for mode, records in runs.items()}
    sent = {mode: record["comm_bytes"] for mode, record in last.items()}
    extra = {mode: [a - b for a, b in zip(sent[mode], sent["adamw"])] for mode in ("owners",
                                                                                  "naive")}
    print(f"tiny GLM-5, DP{args.dp} ({args.dp} processes), distributed optimizer, fp32; "
          f"last of {args.steps} steps")
    print("bytes sent per step per rank:")
    for mode in MODES:
        print(f"  {mode:7s} {sent[mode]}  by op: "
              + ", ".join(f"{k} {sum(v['bytes'])}" for k, v in sorted(
                  last[mode]["comm_by_op"].items()) if sum(v["bytes"])))
    print("Muon bytes per rank (run - adamw; the owners' parameter all-gather moves the same "
          "total as megatron's but per rank its share follows ownership, so only sums compare):")
    for mode in ("owners", "naive"):
        print(f"  {mode:7s} {extra[mode]}")
    print("optimizer-state bytes per rank:")
    for mode in MODES:
        print(f"  {mode:7s} {last[mode]['optimizer_state_bytes']}")
    losses = {mode: [round(r["loss"], 6) for r in records] for mode, records in runs.items()}
    print(f"losses: owners {losses['owners']} naive {losses['naive']} (same Muon, same numbers)")
    ours, baseline = sum(extra["owners"]), sum(extra["naive"])
    theory = baseline // args.dp
    print(f"ours={ours} baseline={baseline} theory={theory} ratio={ours / baseline:.4f}")


if __name__ == "__main__":
    main()
