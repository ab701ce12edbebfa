"""One layer's DSA attention (absorbed sparse MLA) against the best dense attention, on this
machine: time and memory of forward + backward at long sequences.

    python bench/dsa_attention.py [--seq 8192 16384 32768] [--heads 16] [--index-heads 8]

GLM-5's per-head shapes: latent 512 + 64 RoPE (the 576-wide latent key), q/k nope 192, value
256, indexer heads of 128, top-k 2048; heads scaled down in GLM-5's 2:1 ratio (64 : 32) so a
CPU finishes (default 16 attention : 8 indexer heads). Batch 1, fp32.

- ``dsa``: what ``DSACoreAttention`` runs in the sparse stage: the indexer's blockwise top-k
  (no gradient), the absorbed attention over the selected latent keys
  (``sparse_mla.absorbed_sparse_attention``: q_nope absorbed by W_UK, MQA over the latent, W_UV
  up-projection) and the sparse-stage indexer KL with its backward.
- ``dense``: the dense path of the model from the same inputs: MLA's key/value up-projection
  of the latent (``linear_kv_up_proj``: k_nope and v per head, the shared RoPE key broadcast
  to every head), then causal attention on SDPA's flash kernel over q/k/v (256 wide,
  ``layers.equal_width_attention``). Both sides start from the query and the latent key
  (leaves, not counted), so the saved bytes compare like with like: the dense side keeps its
  up-projected k and v, the DSA side its latent output, picks and the indexer KL's tensors.

The DSA side selects once and hands the same int32 picks to the attention and the KL, as
``DSACoreAttention`` does (``absorbed_sparse_mla``, ``DSAIndexer.selected_kl``).

Per length and variant: wall time of one forward + backward (after a short warm-up call),
the bytes autograd saves for backward (exact: unique storages through saved_tensors_hooks,
parameters and inputs excluded) and the peak resident-memory growth during the call (Linux
VmHWM, reset through /proc/self/clear_refs), and the multiply-adds each path does
(``dense_macs`` / ``dsa_macs``, counted from the kernels' matmuls) with the rate it reached:
the MAC ratio is the speed-up DSA would show if it ran its matmuls as fast as the flash kernel
runs dense attention, so the gap between it and the measured ratio is the cost of gathering
each query's own keys (and of the small per-query matmuls that follows from it). Last lines:
``saved for backward at <S>: ours=<DSA bytes> baseline=<dense bytes> ratio=...`` and
``ours=<DSA seconds at the longest S> baseline=<dense seconds there> ratio=<ours/baseline>``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm5_train.model.dsa import DSAIndexer  # noqa: E402
from glm5_train.model.dsa_loss import selected_indexer_kl  # noqa: E402
from glm5_train.model.layers import equal_width_attention  # noqa: E402
from glm5_train.model.sparse_mla import absorbed_sparse_mla  # noqa: E402
from glm5_train.model.triton_sparse_mla import picks_from  # noqa: E402
from parallel.context_parallel import context_shard  # noqa: E402

LATENT, ROPE, NOPE, V, INDEX_DIM, TOPK = 512, 64, 192, 256, 128, 2048
HIDDEN, Q_LORA = 1024, 512  # the indexer's inputs (x, qr); their widths only set its cost
SCALE = (NOPE + ROPE) ** -0.5


class _Cfg:  # the TransformerConfig fields DSAIndexer reads
    params_dtype, hidden_size, q_lora_rank = torch.float32, HIDDEN, Q_LORA


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field))
    return int(line.split()[1])


class Measured:
    """Saved-for-backward bytes (unique storages, ``exclude`` left out) and peak RSS growth."""

    def __init__(self, exclude) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.saved: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.exclude:
            self.saved.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    def run(self, step) -> tuple[float, int, int]:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # VmHWM := VmRSS
        before = _status_kib("VmRSS")
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            loss = step()
        loss.backward()
        seconds = time.perf_counter() - start
        return seconds, sum(self.saved.values()), (_status_kib("VmHWM") - before) * 1024


def dense_macs(seq: int, heads: int) -> int:
    """Multiply-adds of the dense side: the key/value up-projection of the latent (C x
    (NOPE + V) per token and head), forward and backward (3x), and causal flash attention at
    width W = NOPE + ROPE (= V here) per query-key pair and head: forward q.k and p.v (2W),
    backward the recomputed q.k, dp = dO.v, dv, dq and dk (5W)."""
    pairs = seq * (seq + 1) // 2
    return pairs * heads * 7 * (NOPE + ROPE) + 3 * seq * heads * LATENT * (NOPE + V)


def dsa_macs(seq: int, heads: int, index_heads: int) -> int:
    """Multiply-adds of the DSA step ``dsa_case`` times, from its kernels:
    - the indexer's scores over every causal pair (Hi x Di each; no gradient), its query and
      key projections left out (small);
    - absorbed attention per query over its K picks (every query computes all K, invalid
      ones masked) and head: forward logits (D) and latent output (C); backward the logits and
      dp in one matmul (2D), dq (D) and the key gradients (2D);
    - the absorption q_nope W_UK and the up-projection by W_UV, forward and backward (3x);
    - the sparse KL: the indexer's scores at the picks and their head sum, forward and
      backward (3x)."""
    latent_width = LATENT + ROPE
    select = seq * (seq + 1) // 2 * index_heads * INDEX_DIM
    attention = seq * TOPK * heads * (latent_width + LATENT + 5 * latent_width)
    absorb = 3 * seq * heads * LATENT * (NOPE + V)
    kl = 3 * seq * TOPK * index_heads * (INDEX_DIM + 1)
    return select + attention + absorb + kl


def dense_case(seq: int, heads: int, gen: torch.Generator):
    query = torch.randn(seq, 1, heads, NOPE + ROPE, generator=gen).requires_grad_()
    latent_key = torch.randn(seq, 1, 1, LATENT + ROPE, generator=gen).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(heads * (NOPE + V), LATENT, generator=gen) * 0.04)

    def step():
        latent, k_pe = latent_key.squeeze(2).split([LATENT, ROPE], dim=-1)
        kv = torch.nn.functional.linear(latent, weight).view(seq, 1, heads, NOPE + V)
        k_nope, value = kv.split([NOPE, V], dim=-1)
        key = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, heads, -1)], dim=-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, N, S, D]
        return equal_width_attention(q, k, v, None, SCALE).sum()

    return step, (query, latent_key, weight)


def dsa_case(seq: int, heads: int, index_heads: int, gen: torch.Generator):
    query = torch.randn(seq, 1, heads, NOPE + ROPE, generator=gen).requires_grad_()
    latent_key = torch.randn(seq, 1, 1, LATENT + ROPE, generator=gen).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(heads, NOPE + V, LATENT, generator=gen) * 0.04)
    x = torch.randn(seq, 1, HIDDEN, generator=gen)
    qr = torch.randn(seq, 1, Q_LORA, generator=gen)
    indexer = DSAIndexer(_Cfg(), index_heads, INDEX_DIM, TOPK, ROPE, 1e6)
    module = types.SimpleNamespace(indexer=indexer, tp_group=None)
    shard = context_shard(None, seq, x.device)

    def step():
        with torch.no_grad():  # the blockwise selection DSACoreAttention runs
            topk, picked = indexer.select_blockwise(x.transpose(0, 1), qr.transpose(0, 1))
            picks = picks_from(topk, picked > float("-inf"))  # int32, shared as in the model
        out, probs = absorbed_sparse_mla(query, latent_key, weight[:, :NOPE], weight[:, NOPE:],
                                         picks, SCALE, need_probs=True)
        x_in, qr_in = x.transpose(0, 1), qr.transpose(0, 1)
        kl, _ = selected_indexer_kl(module, x_in, qr_in, picks, probs, shard,
                                    indexer.sequence_keys(x_in, shard))
        return out.sum() + 1e-3 * kl

    return step, (query, latent_key, weight, x, qr, *indexer.parameters())


def measure(case) -> tuple[float, int, int]:
    step, leaves = case
    return Measured(leaves).run(step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--index-heads", type=int, default=8)
    args = parser.parse_args()
    print(f"dsa_attention: {args.heads} heads, {args.index_heads} indexer heads, top-k {TOPK}, "
          f"torch threads {torch.get_num_threads()} (one forward + backward each)", flush=True)
    gen = torch.Generator().manual_seed(0)
    # Warm-up: kernels and allocator pools of both paths, at a length that does not count.
    measure(dense_case(2 * TOPK, args.heads, gen))
    measure(dsa_case(2 * TOPK, args.heads, args.index_heads, gen))
    results, saved = {}, {}
    macs = {"dense": lambda seq: dense_macs(seq, args.heads),
            "dsa": lambda seq: dsa_macs(seq, args.heads, args.index_heads)}
    for seq in args.seq:
        for name, case in (("dense", lambda: dense_case(seq, args.heads, gen)),
                           ("dsa", lambda: dsa_case(seq, args.heads, args.index_heads, gen))):
            seconds, saved[name, seq], peak = measure(case())
            results[name, seq] = seconds
            print(f"seq {seq:6d} {name:5s}: {seconds:8.2f} s   saved for backward "
                  f"{saved[name, seq] / 2**20:9.1f} MiB   "
                  f"peak RSS growth {peak / 2**20:9.1f} MiB   "
                  f"{macs[name](seq) / seconds / 1e9:6.1f} GMAC/s", flush=True)
        print(f"seq {seq:6d} dense/dsa time: {results['dense', seq] / results['dsa', seq]:.2f}x"
              f"   dense/dsa MACs: {macs['dense'](seq) / macs['dsa'](seq):.2f}x", flush=True)
    longest = args.seq[-1]
    ours, baseline = saved["dsa", longest], saved["dense", longest]
    print(f"saved for backward at {longest}: ours={ours} baseline={baseline} "
          f"ratio={ours / baseline:.3f}")
    ours, baseline = results["dsa", longest], results["dense", longest]
    print(f"ours={ours:.3f} baseline={baseline:.3f} ratio={ours / baseline:.3f}")


if __name__ == "__main__":
    main()
