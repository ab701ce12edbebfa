"""``bench/dsa_attention.py`` on a GPU: dense causal vs DSA attention time, GLM-5 head counts.

``bench/dsa_attention.py`` builds its tensors on the CPU and times without synchronising, so
this script reuses its pieces (``dense_causal``, ``dsa``, ``kernel_flop_ratio``, ``_Cfg``) and
only supplies the device, the dtype and a synchronised timer:

    python bench/gpu/dsa_cuda.py [--device cuda] [--seq 4096 8192 16384] [--heads 64]
        [--index-heads 32] [--topk 2048] [--dtypes fp32 bf16] [--budget-s 120]

Before timing it probes whether ``DSAIndexer.scores`` runs with CUDA inputs as written (it
builds its RoPE frequencies with ``torch.arange`` and no device). If the probe raises, the
error is printed and the timings run under ``with torch.device(device):`` (tensors created
without a device land there); the NOTE line says so.

One line per (dtype, length), then ``dsa_cuda: ...`` lines; ``--json`` writes all results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

from dsa_attention import _Cfg, dense_causal, dsa, kernel_flop_ratio  # noqa: E402

from glm5_train.model.dsa import DSAIndexer  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, tensors, repeats: int, device: torch.device) -> float:
    """Median forward+backward seconds over ``repeats`` runs after one warm-up run."""
    times = []
    for i in range(repeats + 1):
        for t in tensors:
            t.grad = None
        sync(device)
        start = time.perf_counter()
        fn().float().sum().backward()
        sync(device)
        if i > 0:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_inputs(seq: int, heads: int, index_heads: int, topk: int, dtype: torch.dtype,
                device: torch.device):
    gen = torch.Generator(device=device).manual_seed(seq)
    hidden, q_lora = 512, 256

    def rand(*shape, grad=False):
        t = torch.randn(*shape, generator=gen, device=device, dtype=dtype)
        return t.requires_grad_() if grad else t

    q, k, v = (rand(seq, 1, heads, 256, grad=True) for _ in range(3))
    x, qr = rand(1, seq, hidden), rand(1, seq, q_lora)
    cfg = _Cfg(hidden, q_lora)
    cfg.params_dtype = dtype
    indexer = DSAIndexer(cfg, index_heads, 128, topk, 64, 1e6).to(device)
    return q, k, v, x, qr, indexer


def probe_indexer(device: torch.device) -> str | None:
    """None if ``DSAIndexer.scores`` runs with inputs on ``device`` as written, else the error."""
    if device.type == "cpu":
        return None
    try:
        _, _, _, x, qr, indexer = make_inputs(64, 2, 2, 8, torch.float32, device)
        with torch.no_grad():
            indexer.select(indexer.scores(x, qr))
            indexer.select_blockwise(x, qr)  # what ``dsa`` runs
        sync(device)
        return None
    except Exception as exc:  # noqa: BLE001 - reported, then worked around
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--index-heads", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    parser.add_argument("--budget-s", type=float, default=120.0,
                        help="skip the remaining (dtype, length) pairs once this is spent")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # set_device and friends want an index
            device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({torch.get_num_threads()} threads)"
    print(f"dsa_cuda: device={name} heads={args.heads} index_heads={args.index_heads} "
          f"topk={args.topk} (forward+backward, 1 warm-up, median of {args.repeats})",
          flush=True)

    problem = probe_indexer(device)
    if problem:
        print(f"dsa_cuda: NOTE DSAIndexer.scores fails with {device.type} inputs as written: "
              f"{problem}\ndsa_cuda: NOTE timing under `with torch.device({str(device)!r})` "
              "(default device for tensors created without one)", flush=True)
    context = (lambda: torch.device(device)) if problem else contextlib.nullcontext

    results = {"device": name, "heads": args.heads, "index_heads": args.index_heads,
               "topk": args.topk, "indexer_probe_error": problem, "runs": []}
    started = time.perf_counter()
    for dtype_name in args.dtypes:
        for seq in args.seq:
            if time.perf_counter() - started > args.budget_s:
                print(f"dsa_cuda: SKIP {dtype_name} seq {seq}: budget {args.budget_s:.0f}s spent",
                      flush=True)
                continue
            run = {"dtype": dtype_name, "seq": seq}
            try:
                with context():
                    q, k, v, x, qr, indexer = make_inputs(seq, args.heads, args.index_heads,
                                                          args.topk, DTYPES[dtype_name], device)
                    scale = 256 ** -0.5
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    dense_s = timed(lambda: dense_causal(q, k, v, scale), (q, k, v),
                                    args.repeats, device)
                    sparse_s = timed(lambda: dsa(q, k, v, scale, indexer, x, qr), (q, k, v),
                                     args.repeats, device)
                peak = (torch.cuda.max_memory_allocated(device) / 2**30
                        if device.type == "cuda" else float("nan"))
                ratio = dense_s / sparse_s
                flops = kernel_flop_ratio(seq, args.topk, args.heads, args.index_heads)
                run.update(dense_ms=dense_s * 1e3, dsa_ms=sparse_s * 1e3, ratio=ratio,
                           kernel_flop_ratio=flops, peak_gib=peak)
                print(f"{dtype_name} seq {seq:6d}: dense {dense_s * 1e3:9.1f} ms   "
                      f"dsa {sparse_s * 1e3:9.1f} ms   measured dense/dsa {ratio:6.3f}   "
                      f"sparse-kernel FLOP ratio {flops:5.2f}   peak {peak:6.1f} GiB", flush=True)
            except Exception as exc:  # noqa: BLE001 - one failed length must not end the rest
                run["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                print(f"{dtype_name} seq {seq:6d}: FAIL {run['error']}", flush=True)
                traceback.print_exc(limit=4)
            finally:
                q = k = v = x = qr = indexer = None  # noqa: F841 - free before the next size
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            results["runs"].append(run)

    for run in results["runs"]:
        if "ratio" in run:
            print(f"dsa_cuda: dtype={run['dtype']} seq={run['seq']} topk={args.topk} "
                  f"heads={args.heads}/{args.index_heads} dense_ms={run['dense_ms']:.1f} "
                  f"dsa_ms={run['dsa_ms']:.1f} ratio={run['ratio']:.3f} "
                  f"kernel_flop_ratio={run['kernel_flop_ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    ok = any("ratio" in run for run in results["runs"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
