"""Rollouts packed into fixed-length sequences against padding each to its micro-batch's longest.

    python bench/rl_packing.py [--rollouts 1024] [--seq-length 65536] [--micro-batch 4]
                               [--prompt 2048] [--median 6000] [--max 63488] [--seed 0]

A reasoning-RL step's rollouts (GLM-5: 32 prompts x 32 samples), long-tailed responses: most
a few thousand tokens, a few near the length limit (log-normal around ``--median``, cut at
``--max``), each after a ``--prompt``-token prompt. Counted exactly, no model run:

- ours (``glm5_train/rl/rollout_data.py``): rollouts in record order, end to end into
  ``--seq-length`` sequences, each a document of its own (``cu_seqlens``); a sequence is
  computed whole, its unused tail included;
- baseline: micro-batches of ``--micro-batch`` rollouts, each padded to the micro-batch's
  longest (what a trainer without packed documents does).

Prints the tokens each computes per step (linear costs: every GEMM, the MoE, the head) and the
attention pairs (the quadratic cost of dense causal attention: L (L + 1) / 2 per document; DSA
caps each query at 2048 keys, which the last figure counts). Last line:
``ours=<tokens> baseline=<tokens> ratio=<ours/baseline>``.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from glm5_train.rl.records import Rollout  # noqa: E402
from glm5_train.rl.rollout_data import pack_rollouts  # noqa: E402

TOPK = 2048  # GLM-5's DSA: keys each query attends to at most


def main() -> None:
    args = _parse()
    lengths = response_lengths(args)
    rollouts = [_rollout(args.prompt, int(n)) for n in lengths]
    total = args.prompt + lengths
    places = pack_rollouts(rollouts, args.seq_length)
    sequences = places[-1].sequence + 1
    ours_tokens = sequences * args.seq_length
    padded = [len(batch) * int(batch.max()) for batch in _micro_batches(total, args.micro_batch)]
    base_tokens = sum(padded)
    print(f"rollouts {len(total)}: {int(total.sum()):,} real tokens; response median "
          f"{int(numpy.median(lengths)):,}, max {int(lengths.max()):,}")
    print(f"packed: {sequences} sequences of {args.seq_length:,} = {ours_tokens:,} tokens "
          f"({total.sum() / ours_tokens:.1%} real)")
    print(f"padded: {len(padded)} micro-batches of {args.micro_batch} = {base_tokens:,} tokens "
          f"({total.sum() / base_tokens:.1%} real)")
    ours_pairs = int(sum(_pairs(n) for n in total)) + _tail_pairs(places, total, args)
    base_pairs = int(sum(len(b) * _pairs(int(b.max())) for b in _micro_batches(
        total, args.micro_batch)))
    print(f"dense attention pairs: packed {ours_pairs:,} padded {base_pairs:,} "
          f"ratio {ours_pairs / base_pairs:.3f}")
    print(f"DSA attention pairs (<= {TOPK} keys per query): packed "
          f"{_dsa_pairs(total, ours_tokens):,} padded "
          f"{sum(len(b) * _dsa(int(b.max())) for b in _micro_batches(total, args.micro_batch)):,}")
    print(f"ours={ours_tokens} baseline={base_tokens} ratio={ours_tokens / base_tokens:.3f}")


def response_lengths(args) -> numpy.ndarray:
    rng = numpy.random.default_rng(args.seed)
    lengths = rng.lognormal(numpy.log(args.median), 0.9, args.rollouts)
    return numpy.clip(lengths, 16, args.max).astype(numpy.int64)


def _rollout(prompt: int, response: int) -> Rollout:
    ids = numpy.zeros(prompt, dtype=numpy.int64)
    out = numpy.zeros(response, dtype=numpy.int64)
    zeros = numpy.zeros(response, dtype=numpy.float32)
    return Rollout(ids, out, zeros + 1, zeros, 0.0, "g", 0)


def _micro_batches(total: numpy.ndarray, size: int):
    return [total[i:i + size] for i in range(0, len(total), size)]


def _pairs(n: int) -> int:
    return n * (n + 1) // 2


def _dsa(n: int) -> int:
    """Query-key pairs with at most TOPK keys per query."""
    full = min(n, TOPK)
    return _pairs(full) + (n - full) * TOPK


def _dsa_pairs(total: numpy.ndarray, computed: int) -> int:
    real = int(sum(_dsa(int(n)) for n in total))
    return real + (computed - int(total.sum()))  # a sequence's unused tail: one pair each


def _tail_pairs(places, total, args) -> int:
    """Each packed sequence's unused tail is one padding document: its pairs."""
    used: dict[int, int] = {}
    for place, n in zip(places, total):
        used[place.sequence] = used.get(place.sequence, 0) + int(n)
    return sum(_pairs(args.seq_length - u) for u in used.values())


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=1024)
    parser.add_argument("--seq-length", type=int, default=65536)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--median", type=float, default=6000)
    parser.add_argument("--max", type=int, default=63488)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


if __name__ == "__main__":
    main()
