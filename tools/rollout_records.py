"""Check rollout-record files against the schema (glm5_train/rl/records.py), or write a
synthetic one for tests and demos.

    python tools/rollout_records.py check rollouts.jsonl more.parquet --vocab-size 154880
    python tools/rollout_records.py synthetic --out demo.parquet --groups 4 --group-size 8 \\
        --prompt-len 32 --response-len 64 --vocab-size 1024 --versions 0,1 --teacher

``check`` prints one summary line and exits 0, or prints the first bad record's one-line error
and exits 2. ``synthetic`` is deterministic for a seed: random ids in [0, V), one prompt per
group, rewards uniform in [0, 1) (so every group has spread), rollout log-probs near a fresh
model's (-log V, |noise| < 0.05), policy versions cycling through ``--versions`` group by group.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm5_train.rl.records import (
    Rollout,
    RolloutRecordError,
    check_groups,
    read_rollouts,
    write_rollouts,
)

# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  python tools/rollout_records.py synthetic --out demo.jsonl --groups 2 --group-size 4 \
      --prompt-len 8 --response-len 16 --vocab-size 1000
  python tools/rollout_records.py check demo.jsonl --vocab-size 1000 --min-group-size 2
"""

# Synthetic log-probs: -log(V) plus noise below this in magnitude (what a freshly initialised
# model gives every token, give or take).
LOGPROB_NOISE = 0.04


def summary(rollouts: list[Rollout]) -> str:
    """One line: records, groups, tokens, policy versions, mean reward."""
    if not rollouts:
        return "records=0"
    prompt = sum(len(r.prompt_ids) for r in rollouts)
    response = sum(len(r.response_ids) for r in rollouts)
    versions = [r.policy_version for r in rollouts]
    reward_mean = sum(r.reward for r in rollouts) / len(rollouts)
    return (f"records={len(rollouts)} groups={len({r.group_id for r in rollouts})} "
            f"tokens={prompt + response} response_tokens={response} "
            f"versions={min(versions)}..{max(versions)} reward_mean={reward_mean:.4f}")


def check(args: argparse.Namespace) -> int:
    try:
        rollouts = read_rollouts(args.files, vocab_size=args.vocab_size)
        if args.min_group_size is not None:
            check_groups(rollouts, args.min_group_size)
    except (RolloutRecordError, FileNotFoundError) as err:
        print(f"rollout_records: error: {err}", file=sys.stderr)
        return 2
    print(summary(rollouts))
    return 0


def noisy_logprobs(rng: numpy.random.Generator, length: int, vocab_size: int) -> numpy.ndarray:
    noise = rng.uniform(-LOGPROB_NOISE, LOGPROB_NOISE, length)
    return numpy.minimum(-math.log(vocab_size) + noise, 0.0).astype(numpy.float32)


def synthetic_rollouts(args: argparse.Namespace) -> list[Rollout]:
    rng = numpy.random.default_rng(args.seed)
    rollouts = []
    for group in range(args.groups):
        prompt = rng.integers(0, args.vocab_size, args.prompt_len)
        version = args.versions[group % len(args.versions)]
        for reward in rng.uniform(0.0, 1.0, args.group_size):
            rollouts.append(Rollout(
                prompt_ids=prompt,
                response_ids=rng.integers(0, args.vocab_size, args.response_len),
                loss_mask=numpy.ones(args.response_len, dtype=numpy.float32),
                rollout_logprobs=noisy_logprobs(rng, args.response_len, args.vocab_size),
                reward=float(reward), group_id=f"group-{group}", policy_version=version,
                teacher_logprobs=(noisy_logprobs(rng, args.response_len, args.vocab_size)
                                  if args.teacher else None)))
    return rollouts


def synthetic(args: argparse.Namespace) -> int:
    rollouts = synthetic_rollouts(args)
    try:
        write_rollouts(args.out, rollouts)
    except RolloutRecordError as err:  # an unknown extension
        print(f"rollout_records: error: {err}", file=sys.stderr)
        return 2
    print(f"{args.out}: {summary(rollouts)}")
    return 0


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def versions(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers >= 0, comma-separated")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    checker = commands.add_parser("check", help="check files, print a summary line")
    checker.add_argument("files", nargs="+", metavar="FILE", help=".jsonl or .parquet")
    checker.add_argument("--vocab-size", type=positive_int, metavar="N",
                         help="token ids must be below it")
    checker.add_argument("--min-group-size", type=positive_int, metavar="N",
                         help="refuse smaller groups (GRPO needs 2)")
    maker = commands.add_parser("synthetic", help="write a deterministic synthetic file")
    maker.add_argument("--out", required=True, metavar="FILE", help=".jsonl or .parquet")
    for flag, metavar, meaning in (("--groups", "G", "prompts"),
                                   ("--group-size", "K", "rollouts per prompt"),
                                   ("--prompt-len", "P", "tokens per prompt"),
                                   ("--response-len", "R", "tokens per response"),
                                   ("--vocab-size", "V", "token ids in [0, V)")):
        maker.add_argument(flag, type=positive_int, required=True, metavar=metavar, help=meaning)
    maker.add_argument("--versions", type=versions, default=[0], metavar="v0,v1,...",
                       help="policy versions, cycled group by group (default 0)")
    maker.add_argument("--seed", type=int, default=0, metavar="S")
    maker.add_argument("--teacher", action="store_true", help="also write teacher log-probs")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return check(args) if args.command == "check" else synthetic(args)


if __name__ == "__main__":
    sys.exit(main())
