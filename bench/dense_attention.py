"""Dense causal MLA attention: SDPA on the unpadded widths (its math kernel) vs q/k/v zero-padded
to one width (its flash kernel, ``glm5_train.model.layers.equal_width_attention``), on this CPU.

    python bench/dense_attention.py [--seq 2048 4096 8192] [--widths 192 256] [--heads 4]
                                    [--repeats 3]

Head widths q/k 192, v 256 by default (the long-context issue's case; glm5_tiny has 48 / 32,
GLM-5 itself 192 + 64 RoPE = 256 for both, which needs no padding and has always run flash),
fp32, batch 1, 4 heads so that the math kernel's [B, N, S, S] tensors fit a laptop (both sides
scale with heads alike). Per sequence length and path: forward + backward time (median of ``--repeats``
after a warm-up) and the peak resident memory above the inputs during those passes (Linux
VmHWM, reset before each path through /proc/self/clear_refs; the bench re-executes itself with
glibc's mmap threshold fixed, so that freed tensors leave the RSS instead of staying in malloc's
heap for the next path to reuse unseen). Prints the math path, the
baseline, next to the padded path with the ratios baseline / padded, and ends with one line
``dense_attention: seq=<S> time_ratio=<x> rss_ratio=<y>`` for the longest sequence.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm5_train.model.layers import equal_width_attention

# glibc raises its mmap threshold (up to 32 MiB) after each large free; fixed, every tensor
# above 128 KiB is its own mapping and goes back to the OS when freed.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def unpadded(q, k, v, scale):  # what MLACoreAttention ran before the padding
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def padded(q, k, v, scale):
    return equal_width_attention(q, k, v, None, scale)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}: this bench needs Linux /proc")


def _reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS; returns the current RSS in KiB."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError as err:
        raise RuntimeError(f"cannot reset the peak RSS through /proc/self/clear_refs ({err}): "
                           "this bench needs Linux >= 4.0 with /proc writable") from err
    return _status_kib("VmRSS")


def measure(fn, seq: int, widths: tuple[int, int], heads: int,
            repeats: int) -> tuple[float, float]:
    """Median forward + backward seconds, and peak RSS above the inputs in GiB."""
    gen = torch.Generator().manual_seed(seq)
    dqk, dv = widths
    shapes = [(1, heads, seq, dqk)] * 2 + [(1, heads, seq, dv)]
    tensors = [torch.randn(*shape, generator=gen).requires_grad_() for shape in shapes]
    scale = dqk ** -0.5
    fn(*tensors, scale).sum().backward()  # warm-up: kernels chosen, thread pool up
    base_kib = _reset_peak_rss()
    times = []
    for _ in range(repeats):
        for t in tensors:
            t.grad = None
        start = time.perf_counter()
        fn(*tensors, scale).sum().backward()
        times.append(time.perf_counter() - start)
    peak_gib = (_status_kib("VmHWM") - base_kib) / 2**20
    return statistics.median(times), peak_gib


def main() -> None:
    if any(os.environ.get(key) != value for key, value in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--widths", type=int, nargs=2, default=[192, 256],
                        metavar=("DQK", "DV"))
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    widths = tuple(args.widths)
    if widths[0] == widths[1]:
        parser.error(f"--widths {widths[0]} {widths[1]}: equal widths need no padding and both "
                     "sides would run flash; give unequal q/k and v widths")
    print(f"dense_attention: heads={args.heads} q/k {widths[0]} v {widths[1]} fp32 batch 1, torch threads="
          f"{torch.get_num_threads()} (forward+backward, median of {args.repeats}; peak RSS "
          "above the inputs)")
    for seq in args.seq:
        math_s, math_gib = measure(unpadded, seq, widths, args.heads, args.repeats)
        flash_s, flash_gib = measure(padded, seq, widths, args.heads, args.repeats)
        time_ratio, rss_ratio = math_s / flash_s, math_gib / max(flash_gib, 1e-3)
        print(f"seq {seq:6d}: math (unpadded) {math_s * 1e3:8.1f} ms {math_gib:6.2f} GiB   "
              f"padded flash {flash_s * 1e3:8.1f} ms {flash_gib:6.2f} GiB   "
              f"math/padded time {time_ratio:5.2f}x  peak RSS {rss_ratio:6.1f}x")
    print(f"dense_attention: seq={args.seq[-1]} time_ratio={time_ratio:.3f} "
          f"rss_ratio={rss_ratio:.3f}")


if __name__ == "__main__":
    main()
