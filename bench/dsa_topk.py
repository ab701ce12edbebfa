"""Peak memory and time of the DSA indexer's top-k selection: full rows against blockwise.

    python bench/dsa_topk.py [--seq 4096 8192] [--topk 2048] [--index-heads 32] [--repeats 3]

``full``: the selection as it was before ``causal_topk`` (``DSAIndexer.scores`` building the
[B, S, S] fp32 scores by query chunks, the [S, S] causal mask, ``torch.topk`` over each full
row, a gather for validity), kept here as the baseline. ``blockwise``:
``DSAIndexer.select_blockwise`` (running top-k over key blocks, nothing [S, S]). GLM-5's indexer
widths (32 heads of 128, top-k 2048), batch 1, fp32, no gradient: the selection pass of a
sparse-stage forward.

Each (variant, length) runs in a fresh child process: the peak is the rise of the process's
peak resident memory (Linux VmHWM, reset through /proc/self/clear_refs) over its resident
memory just before the first call, so allocator caches of an earlier run cannot hide it. Time is
the median of ``--repeats`` calls after that first one. Prints one line per length and ends
with ``dsa_topk: seq=<S> full_peak_mib=... blockwise_peak_mib=... time_ratio=...`` for the
longest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from glm5_train.model.dsa import DSAIndexer, query_chunk  # noqa: E402

HIDDEN, Q_LORA = 512, 256


class _Cfg:  # the few TransformerConfig fields DSAIndexer reads
    params_dtype, hidden_size, q_lora_rank = torch.float32, HIDDEN, Q_LORA


def full_row_selection(indexer: DSAIndexer, x: torch.Tensor, qr: torch.Tensor):
    """The selection before blockwise top-k, as DSACoreAttention ran it."""
    batch, seq, _ = x.shape
    q_BSHD, k_BSD, w_BSH = indexer.project(x, qr)
    scale = indexer.head_dim ** -0.5
    rows = query_chunk(batch * indexer.n_heads * seq)
    chunks = []
    for start in range(0, seq, rows):
        logits = torch.einsum("bthd,bsd->bths", q_BSHD[:, start:start + rows].float(),
                              k_BSD.float()) * scale
        chunks.append(torch.einsum("bth,bths->bts", w_BSH[:, start:start + rows],
                                   F.relu(logits)))
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    index_BSS = torch.cat(chunks, dim=1).masked_fill(~causal, float("-inf"))
    topk_BSK = index_BSS.topk(min(indexer.topk, seq), dim=-1).indices
    return topk_BSK, index_BSS.gather(-1, topk_BSK) > float("-inf")


def blockwise_selection(indexer: DSAIndexer, x: torch.Tensor, qr: torch.Tensor):
    topk_BSK, picked_BSK = indexer.select_blockwise(x, qr)
    return topk_BSK, picked_BSK > float("-inf")


VARIANTS = {"full": full_row_selection, "blockwise": blockwise_selection}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def child(variant: str, seq: int, topk: int, index_heads: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(seq)
    indexer = DSAIndexer(_Cfg(), index_heads, 128, topk, 64, 1e6)
    x = torch.randn(1, seq, HIDDEN, generator=gen)
    qr = torch.randn(1, seq, Q_LORA, generator=gen)
    select = VARIANTS[variant]
    with torch.no_grad():
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # reset VmHWM to the current resident size
        before = _status_kib("VmRSS")
        start = time.perf_counter()
        topk_BSK, valid_BSK = select(indexer, x, qr)
        first_s = time.perf_counter() - start
        peak = _status_kib("VmHWM") - before
        del topk_BSK, valid_BSK
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            select(indexer, x, qr)
            times.append(time.perf_counter() - start)
    return {"peak_mib": peak / 1024, "seconds": statistics.median(times or [first_s])}


def run_child(variant: str, seq: int, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--seq", str(seq),
           "--topk", str(args.topk), "--index-heads", str(args.index_heads),
           "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--index-heads", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=sorted(VARIANTS), default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.seq[0], args.topk, args.index_heads,
                               args.repeats)))
        return
    print(f"dsa_topk: index_heads={args.index_heads} head_dim=128 topk={args.topk} batch=1 "
          f"fp32, torch threads={torch.get_num_threads()} (peak: first call; time: median of "
          f"{args.repeats} more)")
    for seq in args.seq:
        full, block = run_child("full", seq, args), run_child("blockwise", seq, args)
        ratio = block["seconds"] / full["seconds"]
        scores_mib = 4 * seq * seq / 2 ** 20
        print(f"seq {seq:6d}: full rows peak {full['peak_mib']:8.1f} MiB "
              f"{full['seconds'] * 1e3:8.1f} ms   blockwise peak {block['peak_mib']:8.1f} MiB "
              f"{block['seconds'] * 1e3:8.1f} ms   time blockwise/full {ratio:5.2f}   "
              f"([S, S] fp32 alone: {scores_mib:.0f} MiB)")
    print(f"dsa_topk: seq={args.seq[-1]} full_peak_mib={full['peak_mib']:.1f} "
          f"blockwise_peak_mib={block['peak_mib']:.1f} time_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
