"""Saved-for-backward bytes, peak memory and time of the DSA dense warm-up indexer KL: the
full-row implementation against the chunked one (``dsa_loss._DenseKL``).

    python bench/dense_kl.py [--seq 2048 4096] [--repeats 3]

``baseline``: the KL as it was before ``_DenseKL`` ([B, N, S, S] target logits under no_grad,
``DSAIndexer.scores`` with autograd, ``_kl`` over [B, S, S]), reproduced here. ``ours``:
``dense_indexer_kl``. Widths of the tiny GLM-5 (hidden 128, q latent 64, 4 main heads of 64,
indexer 4 heads of 32), batch 1, fp32, forward + backward of the KL alone.

Saved bytes: every distinct storage autograd keeps for backward (saved-tensor hooks, forward
only). Each (variant, length) runs in a fresh child process; its peak is the rise of peak
resident memory (VmHWM, reset through /proc/self/clear_refs) over one forward + backward. Time:
median of ``--repeats`` further forward + backward calls. Ends with
``dense_kl: seq=<S> ... saved_mib ours=... baseline=... ratio=...`` for the longest length.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from glm5_train.model.dsa import DSAIndexer, query_chunk
from glm5_train.model.dsa_loss import _kl, dense_indexer_kl

HIDDEN, Q_LORA, HEADS, WIDTH, INDEX_HEADS, INDEX_WIDTH = 128, 64, 4, 64, 4, 32


class _Cfg:  # the few TransformerConfig fields DSAIndexer reads
    params_dtype, hidden_size, q_lora_rank = torch.float32, HIDDEN, Q_LORA


def baseline_kl(module, query, key, x, qr):
    """The dense warm-up KL before query chunking (no attention mask)."""
    seq = query.shape[0]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    with torch.no_grad():
        logits_BNSS = torch.einsum("sbnd,tbnd->bnst", query.float(), key.float())
        logits_BNSS = (logits_BNSS * module.softmax_scale).masked_fill(~causal, float("-inf"))
        target_BSS = logits_BNSS.softmax(-1).sum(1)
        del logits_BNSS
    index_BSS = module.indexer.scores(x.transpose(0, 1), qr.transpose(0, 1))
    return _kl(target_BSS, index_BSS)


def ours_kl(module, query, key, x, qr):
    return dense_indexer_kl(module, query, key, x, qr, None, query_chunk)[0]


VARIANTS = {"baseline": baseline_kl, "ours": ours_kl}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1])


def _saved_bytes(fn) -> int:
    storages = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kl = fn()
    kl.backward()
    return sum(storages.values())


def child(variant: str, seq: int, repeats: int) -> dict:
    torch.manual_seed(0)
    indexer = DSAIndexer(_Cfg(), INDEX_HEADS, INDEX_WIDTH, 2048, 16, 1e6)
    module = types.SimpleNamespace(indexer=indexer, tp_group=None, softmax_scale=WIDTH ** -0.5,
                                   _indexer_inputs=lambda x, qr: (x.transpose(0, 1),
                                                                  qr.transpose(0, 1)))
    gen = torch.Generator().manual_seed(seq)
    x, qr = torch.randn(seq, 1, HIDDEN, generator=gen), torch.randn(seq, 1, Q_LORA, generator=gen)
    query, key = (torch.randn(seq, 1, HEADS, WIDTH, generator=gen) for _ in range(2))

    def step():
        return VARIANTS[variant](module, query, key, x, qr)

    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM to the current resident size
    before = _status_kib("VmRSS")
    step().backward()
    peak = _status_kib("VmHWM") - before
    saved = _saved_bytes(step)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step().backward()
        times.append(time.perf_counter() - start)
    return {"saved_mib": saved / 2 ** 20, "peak_mib": peak / 1024,
            "seconds": statistics.median(times)}


def run_child(variant: str, seq: int, repeats: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--seq", str(seq),
           "--repeats", str(repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=sorted(VARIANTS), default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.seq[0], args.repeats)))
        return
    print(f"dense_kl: heads={HEADS}x{WIDTH} indexer={INDEX_HEADS}x{INDEX_WIDTH} batch=1 fp32, "
          f"torch threads={torch.get_num_threads()} (forward + backward; time: median of "
          f"{args.repeats})")
    for seq in args.seq:
        ours, base = run_child("ours", seq, args.repeats), run_child("baseline", seq, args.repeats)
        saved_ratio = ours["saved_mib"] / base["saved_mib"]
        time_ratio = ours["seconds"] / base["seconds"]
        print(f"seq {seq:6d}: saved ours {ours['saved_mib']:8.2f} MiB baseline "
              f"{base['saved_mib']:8.2f} MiB ({saved_ratio:.4f})   peak ours "
              f"{ours['peak_mib']:8.1f} MiB baseline {base['peak_mib']:8.1f} MiB   time ours "
              f"{ours['seconds'] * 1e3:8.1f} ms baseline {base['seconds'] * 1e3:8.1f} ms "
              f"({time_ratio:.2f})")
    print(f"dense_kl: seq={args.seq[-1]} time_ratio={time_ratio:.3f} "
          f"peak_mib ours={ours['peak_mib']:.1f} baseline={base['peak_mib']:.1f} "
          f"saved_mib ours={ours['saved_mib']:.2f} baseline={base['saved_mib']:.2f} "
          f"ratio={saved_ratio:.4f}")


if __name__ == "__main__":
    main()
