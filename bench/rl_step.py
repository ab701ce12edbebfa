"""What an RL step costs beside an LM step of the same shape: the tiny GLM-5, one process.

    python bench/rl_step.py [--steps 6] [--seq-length 512] [--batch 4]

Three runs of ``--batch`` sequences of ``--seq-length`` tokens per step: the LM loss on the
built-in corpus (its MTP steps and heads run, the indexer trains: GLM-5's pre-training), GRPO +
IcePop on synthetic rollout records (8 rollouts per sequence; indexer and MTP frozen: GLM-5's
RL), and the same with ``rl.updates_per_batch=2`` (a forward pass without gradients records
pi_old before each batch's first update). The ratio is the step a user sees in each stage, not
the objective's arithmetic alone.

Prints each run's mean step time (wall clock, steps after the first) and saved-for-backward
peak. Last line: ``ours=<GRPO step s> baseline=<LM step s> ratio=<ours/baseline>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from job import REPO, run_training

COMMON = ["model=glm5_tiny", "parallel=single", "checkpoint.save=null", "train.warmup_iters=0"]


def main() -> None:
    args = _parse()
    with tempfile.TemporaryDirectory(prefix="rl_step_") as root:
        records = os.path.join(root, "rollouts.jsonl")
        _write_records(records, args)
        shape = [f"train.seq_length={args.seq_length}", f"train.global_batch_size={args.batch}",
                 f"train.train_iters={args.steps}"]
        rl = ["data=rollouts", f"data.paths=[{records}]", "train.objective=grpo",
              "dsa=frozen_indexer"]
        runs = {
            "lm": [*COMMON, *shape],
            "grpo": [*COMMON, *shape, *rl],
            "grpo_2_updates": [*COMMON, *shape, *rl, "rl.updates_per_batch=2"],
        }
        times = {}
        for name, overrides in runs.items():
            records_ = run_training(1, overrides, os.path.join(root, name), name)
            times[name] = _step_seconds(records_, args)
            peak = max(records_[-1].get("saved_bytes_peak", [0]))
            print(f"{name}: mean step {times[name]:.3f} s, saved-for-backward peak "
                  f"{peak / 2**20:.1f} MiB")
    print(f"grpo with 2 updates per batch: {times['grpo_2_updates'] / times['grpo']:.3f}x "
          "grpo's step (a grad-free forward every 2 steps)")
    print(f"ours={times['grpo']:.3f} baseline={times['lm']:.3f} "
          f"ratio={times['grpo'] / times['lm']:.3f}")


def _step_seconds(records: list[dict], args) -> float:
    """Mean wall time of the steps after the first (a step's tokens / its tokens per s): the
    mean, so that the steps running the pi_old pass count as often as they occur."""
    tokens = args.batch * args.seq_length
    return statistics.mean(tokens / r["tokens_per_s"] for r in records[1:])


def _write_records(path: str, args) -> None:
    """Rollouts of 8 per sequence: groups of 4, prompt 1/4 of a rollout."""
    per = args.seq_length // 8
    groups = args.steps * args.batch * 8 // 4
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "rollout_records.py"),
                    "synthetic", "--out", path, "--groups", str(groups), "--group-size", "4",
                    "--prompt-len", str(per // 4), "--response-len", str(per - per // 4),
                    "--vocab-size", "320"], check=True, capture_output=True)


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    return parser.parse_args()


if __name__ == "__main__":
    main()
