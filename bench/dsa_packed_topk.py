"""The DSA indexer's top-k selection on packed conversations: each query block scanning keys
from its rows' earliest document start (``causal_topk`` now) against scanning from key 0, as
it did before (documents then skipped only whole 16,384-key blocks before every row; it also
scored keys past the diagonal up to index 2,048, which neither side does here).

    python bench/dsa_packed_topk.py [--seq 8192] [--conversation 600] [--repeats 2]

GLM-5's indexer widths (32 heads of 128, top-k 2,048; query blocks of 64 rows, as
``select_blockwise`` sizes them), batch 1, fp32, no gradient: the selection pass of a
sparse-stage forward over one packed SFT sequence of ``--seq`` tokens cut into conversations
of ``--conversation`` tokens. Both ways must select the same keys (checked). Prints the
(query row, key) pairs each scores (counted exactly) and the median time of ``--repeats``
calls after a first; last line ``ours=<seconds now> baseline=<from key 0> ratio=...``.
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

from glm5_train.model import dsa  # noqa: E402
from glm5_train.model.dsa import DSAIndexer  # noqa: E402
from glm5_train.model.key_masks import DocumentStarts  # noqa: E402

HIDDEN, Q_LORA = 512, 256


class _Cfg:  # the few TransformerConfig fields DSAIndexer reads
    params_dtype, hidden_size, q_lora_rank = torch.float32, HIDDEN, Q_LORA


def document_starts(seq: int, conversation: int) -> DocumentStarts:
    starts = torch.arange(seq) // conversation * conversation
    return DocumentStarts(starts[None])


def measure(indexer, x, qr, starts, repeats: int) -> tuple[float, int, tuple]:
    """(median seconds, scored pairs, the selection) of ``select_blockwise``."""
    scored = [0]
    original = indexer._block_scores

    def counting(q_rows, k_BSD, w_BSH):
        rows = original(q_rows, k_BSD, w_BSH)

        def block(t0, t1):
            against = rows(t0, t1)

            def scores(s0, s1):
                scored[0] += (t1 - t0) * (s1 - s0)
                return against(s0, s1)
            return scores
        return block

    indexer._block_scores = counting
    with torch.no_grad():
        selection = indexer.select_blockwise(x, qr, starts)
        pairs = scored[0]
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            indexer.select_blockwise(x, qr, starts)
            times.append(time.perf_counter() - start)
    indexer._block_scores = original
    return statistics.median(times), pairs, selection


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--conversation", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    indexer = DSAIndexer(_Cfg(), 32, 128, 2048, 64, 1e6)
    x = torch.randn(1, args.seq, HIDDEN, generator=gen)
    qr = torch.randn(1, args.seq, Q_LORA, generator=gen)
    starts = document_starts(args.seq, args.conversation)
    ours_s, ours_pairs, ours = measure(indexer, x, qr, starts, args.repeats)
    earliest = dsa.earliest_starts
    dsa.earliest_starts = lambda allowed, rows, block: [0] * len(range(0, rows, block))
    try:  # every query block scanning from key 0, as before
        base_s, base_pairs, base = measure(indexer, x, qr, starts, args.repeats)
    finally:
        dsa.earliest_starts = earliest
    same = all(torch.equal(a, b) for a, b in zip(ours, base))
    conversations = -(-args.seq // args.conversation)
    print(f"{args.seq} tokens in {conversations} conversations of {args.conversation}: scored "
          f"pairs {ours_pairs:,} from the earliest document start, {base_pairs:,} from key 0 "
          f"({base_pairs / ours_pairs:.1f}x); same selection: {same}", flush=True)
    if not same:
        raise SystemExit("the two scans selected different keys")
    print(f"ours={ours_s:.3f} baseline={base_s:.3f} ratio={ours_s / base_s:.3f}")


if __name__ == "__main__":
    main()
