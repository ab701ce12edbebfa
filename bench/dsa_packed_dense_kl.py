"""The dense warm-up's indexer KL on packed conversations: each chunk of query rows scored from
its rows' earliest document start (``dsa_loss._DenseKL`` now) against scoring from key 0, as it
did before.

    python bench/dsa_packed_dense_kl.py [--seq 4096] [--conversation 600] [--repeats 2]

GLM-5's indexer widths (32 heads of 128) and one TP8 rank's share of the main attention
(8 heads of 192, whose head-summed probabilities are the KL's target), batch 1, fp32: the KL's
forward and backward over one packed sequence of ``--seq`` tokens cut into conversations of
``--conversation`` tokens, in chunks of query rows sized as the model sizes them. Both ways
must give the same KL and gradients (checked, to fp32 summation order). Prints the (query
row, key) pairs the indexer's logits are computed for (counted exactly, forward and backward)
and the median time of ``--repeats`` calls after a first; last line
``ours=<seconds now> baseline=<from key 0> ratio=...``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from glm5_train.model import dsa_loss  # noqa: E402
from glm5_train.model.dsa import query_chunk  # noqa: E402
from glm5_train.model.key_masks import DocumentStarts  # noqa: E402

INDEX_HEADS, INDEX_WIDTH = 32, 128
HEADS, WIDTH = 8, 192  # a TP8 rank's main-attention heads, q/k width (nope 128 + RoPE 64)


def inputs(seq: int) -> list[torch.Tensor]:
    """The indexer's q [1, S, Hi, Di], k [1, S, Di], w [1, S, Hi] and the main attention's
    query and key [S, 1, N, D]."""
    gen = torch.Generator().manual_seed(0)
    shapes = ((1, seq, INDEX_HEADS, INDEX_WIDTH), (1, seq, INDEX_WIDTH), (1, seq, INDEX_HEADS),
              (seq, 1, HEADS, WIDTH), (seq, 1, HEADS, WIDTH))
    return [torch.randn(*shape, generator=gen) * 0.3 for shape in shapes]


def measure(tensors, starts: DocumentStarts, repeats: int) -> tuple[float, int, list]:
    """(median seconds of forward + backward, pairs scored, [KL, dq, dk, dw])."""
    seq = tensors[0].shape[1]
    plan = dsa_loss._DenseKLPlan(softmax_scale=WIDTH ** -0.5, index_scale=INDEX_WIDTH ** -0.5,
                                 tp_group=None,
                                 rows=query_chunk(seq * (HEADS + INDEX_HEADS)),
                                 positions=torch.arange(seq))
    scored = [0]
    logits = dsa_loss._index_logits

    def counted(q_BSHD, k_BSD, t0, t1, s0, s1, scale):
        scored[0] += (t1 - t0) * (s1 - s0)
        return logits(q_BSHD, k_BSD, t0, t1, s0, s1, scale)

    def once() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in tensors[:3]]
        kl = dsa_loss._DenseKL.apply(*leaves, *tensors[3:], starts, plan)
        kl.backward()
        return [kl.detach(), *(t.grad for t in leaves)]

    dsa_loss._index_logits = counted
    try:
        results = once()
    finally:
        dsa_loss._index_logits = logits
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        once()
        times.append(time.perf_counter() - began)
    return statistics.median(times), scored[0], results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--conversation", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    tensors = inputs(args.seq)
    starts = DocumentStarts((torch.arange(args.seq) // args.conversation
                             * args.conversation)[None])
    ours_s, ours_pairs, ours = measure(tensors, starts, args.repeats)
    earliest = dsa_loss.earliest_starts
    dsa_loss.earliest_starts = lambda mask, rows, block: [0] * len(range(0, rows, block))
    try:  # every chunk scored from key 0, as before
        base_s, base_pairs, base = measure(tensors, starts, args.repeats)
    finally:
        dsa_loss.earliest_starts = earliest
    # fp32 summation order only (shorter softmax rows): the KL and each gradient's largest
    # entry to 1e-5 relative
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
               for a, b in zip(ours, base))
    conversations = -(-args.seq // args.conversation)
    print(f"{args.seq} tokens in {conversations} conversations of {args.conversation}: indexer "
          f"pairs {ours_pairs:,} from the earliest document start, {base_pairs:,} from key 0 "
          f"({base_pairs / ours_pairs:.1f}x); same KL and gradients: {same}", flush=True)
    if not same:
        raise SystemExit("the two ways gave different KLs or gradients")
    print(f"ours={ours_s:.3f} baseline={base_s:.3f} ratio={ours_s / base_s:.3f}")


if __name__ == "__main__":
    main()
