"""What checkpoint digests cost at save, per GB written, against the same save without them.

A save (``glm5_train.checkpoint.save_checkpoint``) writes the state with megatron-core's
``dist_checkpointing.save`` (torch_dist) into a staging directory, then each rank makes its
files durable. Before digests that was an fsync of each file; now it is
``checkpoint_store.seal_files``: each file read back once (from the page cache: just written)
through sha256, then fsynced. This script does exactly that on one process (gloo): ``--gb`` GB
of fp32 tensors saved, then either plain fsyncs (baseline) or ``seal_files`` (ours),
alternating, ``--rounds`` times each; the median seconds of save + sync per GB of files. Then
sha256 alone over the same files, still cached: GB/s per core.

    python bench/checkpoint_checksum.py [--gb 1.0] [--rounds 3] [--dir /tmp]

Prints the hash's throughput, then last: ``ours=<s per GB with digests> baseline=<s per GB
without> ratio=<ours/baseline>``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from glm5_train import checkpoint_store as store
from parallel import mcore_compat

TENSORS = 8  # the state's tensors: a few files' worth, like one rank's shard of a model


def state(gb: float) -> dict:
    """``gb`` GB of random fp32 (incompressible, as trained weights are) as sharded tensors."""
    numel = int(gb * 1e9 / 4 / TENSORS)
    return {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.randn(numel))
            for i in range(TENSORS)}


def fsync_files(directory: str) -> None:
    """The save's sync before digests: each file fsynced, none read."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def one_save(sharded: dict, root: str, digests: bool) -> tuple[float, int]:
    """(seconds for save + sync, bytes written) of one save into a fresh staging directory."""
    staging = store.prepare_staging(root, 1)
    start = time.perf_counter()
    dist_checkpointing.save(sharded, staging)
    if digests:
        store.seal_files(staging)
    else:
        fsync_files(staging)
    seconds = time.perf_counter() - start
    written = sum(os.path.getsize(os.path.join(staging, n)) for n in os.listdir(staging))
    return seconds, written


def hash_throughput(root: str, sharded: dict) -> float:
    """GB/s of sha256 over a just-written checkpoint's files (page cache, one core)."""
    staging = store.prepare_staging(root, 1)
    dist_checkpointing.save(sharded, staging)
    paths = [os.path.join(staging, n) for n in os.listdir(staging)]
    start = time.perf_counter()
    total = sum(store.hash_file(p)["size"] for p in paths)
    return total / 1e9 / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="GB of state saved per save")
    parser.add_argument("--rounds", type=int, default=3, help="saves of each kind, alternating")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where to write (the file system the checkpoints go to)")
    args = parser.parse_args()
    if args.gb <= 0 or args.rounds < 1:
        raise SystemExit(f"--gb={args.gb} --rounds={args.rounds}: both must be positive; "
                         "e.g. --gb 1 --rounds 3")
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    mcore_compat.install()  # as the job does: on CPU, megatron-core's CUDA calls redirected
    mcore_compat.in_process_checkpoint_results_queue()  # as save_checkpoint does
    root = tempfile.mkdtemp(prefix="glm5_checksum_bench_", dir=args.dir)
    try:
        sharded = state(args.gb)
        per_gb: dict[bool, list[float]] = {False: [], True: []}
        one_save(sharded, root, True)  # warm-up: first-save set-up, not counted
        for _ in range(args.rounds):
            for digests in (False, True):
                seconds, written = one_save(sharded, root, digests)
                per_gb[digests].append(seconds / (written / 1e9))
        rate = hash_throughput(root, sharded)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    ours, baseline = statistics.median(per_gb[True]), statistics.median(per_gb[False])
    print(f"{store.HASH} over the just-written files: {rate:.2f} GB/s (one core); per GB: "
          f"ours {[round(s, 3) for s in per_gb[True]]} baseline "
          f"{[round(s, 3) for s in per_gb[False]]}")
    print(f"ours={ours:.3f} baseline={baseline:.3f} ratio={ours / baseline:.3f}")


if __name__ == "__main__":
    main()
