"""Saved-for-backward bytes and step time of one output head + cross-entropy: chunked over
tokens (parallel/chunked_cross_entropy.py) against megatron-core's head (whole logits, then
``vocab_parallel_cross_entropy``).

    python bench/chunked_loss.py [--tokens 8192] [--vocab 154880] [--hidden 128]
                                 [--chunk 2048] [--repeats 3] [--dtype fp32|bf16]

One process (a world-size-1 gloo group for megatron's loss), GLM-5's vocabulary, a narrow hidden
width so the head fits a CPU. Saved bytes: the unique storages autograd keeps for backward
(saved-tensor hooks), parameters left out. Step time: forward + backward of the summed loss,
median of ``--repeats`` after one warm-up. Ends with
``chunked_loss: tokens=... ours=<bytes> baseline=<bytes> ratio=... ours_s=... baseline_s=...
time_ratio=...``.
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

from megatron.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: E402

from parallel import mcore_compat  # noqa: E402
from parallel.chunked_cross_entropy import chunked_vocab_parallel_cross_entropy  # noqa: E402
from parallel.process_groups import single_process_group  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def megatron_head(hidden_SBH, weight_VH, labels_SB, chunk):
    """ColumnParallelLinear's matmul (no TP) and megatron's vocab-parallel cross-entropy."""
    return vocab_parallel_cross_entropy(torch.matmul(hidden_SBH, weight_VH.t()), labels_SB)


def chunked_head(hidden_SBH, weight_VH, labels_SB, chunk):
    return chunked_vocab_parallel_cross_entropy(hidden_SBH, weight_VH, labels_SB, chunk)


def saved_bytes(head, hidden, weight, labels, chunk) -> int:
    """Unique storage bytes saved for backward by one forward, the parameters left out."""
    skip = {weight.untyped_storage().data_ptr(), hidden.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            saved.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = head(hidden, weight, labels, chunk)
    loss.sum().backward()
    # The head's input is saved by both (it is the caller's tensor): counted once, here.
    return sum(saved.values()) + hidden.numel() * hidden.element_size()


def step_seconds(head, hidden, weight, labels, chunk, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        head(hidden, weight, labels, chunk).sum().backward()
        times.append(time.perf_counter() - start)
        hidden.grad = weight.grad = None
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=154880)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, 1, args.hidden, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) / args.hidden ** 0.5)
    weight = weight.to(dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens, 1), generator=gen)
    mcore_compat.install()  # megatron-core on CPU
    with single_process_group():
        results = {}
        for name, head in (("ours", chunked_head), ("baseline", megatron_head)):
            results[name] = (saved_bytes(head, hidden, weight, labels, args.chunk),
                             step_seconds(head, hidden, weight, labels, args.chunk,
                                          args.repeats))
            print(f"{name}: saved_bytes={results[name][0]} step_s={results[name][1]:.3f}",
                  flush=True)
    (ours, ours_s), (base, base_s) = results["ours"], results["baseline"]
    print(f"chunked_loss: tokens={args.tokens} vocab={args.vocab} hidden={args.hidden} "
          f"chunk={args.chunk} dtype={args.dtype} ours={ours} baseline={base} "
          f"ratio={ours / base:.5f} ours_s={ours_s:.3f} baseline_s={base_s:.3f} "
          f"time_ratio={ours_s / base_s:.3f}")


if __name__ == "__main__":
    main()
