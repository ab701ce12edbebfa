"""Sparse (DSA, top-k) vs dense causal MLA attention cost at long sequences, on this machine.

Two figures per length: the measured time ratio of our implementation (indexer + top-k + masked
attention on dense kernels, see ``glm5_train.model.dsa.sparse_attention``) against dense causal
attention, and the FLOP ratio a sparse MLA kernel would get (attention over K keys per query
plus the indexer's own S^2 scoring at its smaller width), which is where GLM-5's 1.5-2x claim
lives. On a CPU without such a kernel DSA costs more than dense attention, and this says so.

    python bench/dsa_attention.py [--seq 4096 8192 16384] [--topk 2048]

For each sequence length, times forward + backward of the core attention alone, in the same
process: dense causal softmax attention (the MLA core without DSA) against DSA (lightning indexer
scores + top-k + attention over the selected keys only). Head shapes are GLM-5's per-head widths
(q/k 256 = 192 + 64 RoPE, v 256; indexer 128-dim heads, key 128) with fewer heads so that a CPU
finishes; the ratio depends on heads only through both sides alike. Prints the ratio
dense/sparse per length and ends with one line ``dsa_attention: seq=<S> topk=<K> ratio=<x>``
for the longest sequence.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm5_train.model.dsa import DSAIndexer, sparse_attention  # noqa: E402


class _Cfg:  # the few TransformerConfig fields DSAIndexer reads
    def __init__(self, hidden: int, q_lora: int) -> None:
        self.params_dtype, self.hidden_size, self.q_lora_rank = torch.float32, hidden, q_lora


def dense_causal(q, k, v, scale):
    out = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True,
        scale=scale)
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def dsa(q, k, v, scale, indexer, x, qr):
    with torch.no_grad():  # the blockwise selection DSACoreAttention runs
        topk, picked = indexer.select_blockwise(x, qr)
        valid = picked > float("-inf")
    return sparse_attention(q, k, v, topk, valid, scale)[0]


def kernel_flop_ratio(seq: int, topk: int, heads: int, index_heads: int) -> float:
    """Dense causal attention FLOPs / (sparse attention over top-k + indexer) FLOPs, fwd."""
    pairs_dense = seq * (seq + 1) / 2
    pairs_sparse = sum(min(t + 1, topk) for t in range(seq))
    attention_width = 256 + 256  # QK over 256 dims, PV over 256 dims
    dense = 2 * pairs_dense * heads * attention_width
    sparse = 2 * pairs_sparse * heads * attention_width + 2 * pairs_dense * index_heads * 128
    return dense / sparse


def timed(fn, tensors, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        for t in tensors:
            t.grad = None
        start = time.perf_counter()
        fn().float().sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(seq: int, topk: int, heads: int, index_heads: int, repeats: int) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(seq)
    hidden, q_lora = 512, 256

    def rand(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    q, k, v = rand(seq, 1, heads, 256), rand(seq, 1, heads, 256), rand(seq, 1, heads, 256)
    x, qr = torch.randn(1, seq, hidden, generator=gen), torch.randn(1, seq, q_lora, generator=gen)
    indexer = DSAIndexer(_Cfg(hidden, q_lora), index_heads, 128, topk, 64, 1e6)
    scale = 256 ** -0.5
    dense_s = timed(lambda: dense_causal(q, k, v, scale), (q, k, v), repeats)
    sparse_s = timed(lambda: dsa(q, k, v, scale, indexer, x, qr), (q, k, v), repeats)
    return dense_s, sparse_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--index-heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"dsa_attention: heads={args.heads} index_heads={args.index_heads} topk={args.topk} "
          f"torch threads={torch.get_num_threads()} (forward+backward, median of {args.repeats})")
    ratio = None
    for seq in args.seq:
        dense_s, sparse_s = run(seq, args.topk, args.heads, args.index_heads, args.repeats)
        ratio = dense_s / sparse_s
        flops = kernel_flop_ratio(seq, args.topk, args.heads, args.index_heads)
        glm5 = kernel_flop_ratio(seq, args.topk, 64, 32)
        print(f"seq {seq:6d}: dense {dense_s * 1e3:9.1f} ms   dsa {sparse_s * 1e3:9.1f} ms   "
              f"measured dense/dsa {ratio:5.2f}   sparse-kernel FLOP ratio {flops:5.2f} "
              f"(GLM-5 heads 64/32: {glm5:5.2f})")
    print(f"dsa_attention: seq={args.seq[-1]} topk={args.topk} ratio={ratio:.3f} "
          f"kernel_flop_ratio={flops:.3f}")


if __name__ == "__main__":
    main()
