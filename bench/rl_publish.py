"""Weight publication for rollout engines against ``export_hf`` of the same model: seconds, and
the bytes each dtype writes.

    python bench/rl_publish.py [--rounds 3] [Hydra overrides, default model=glm5_tiny]

One process (gloo). The model is built as training holds it (initial weights of train.seed,
chunks DDP-wrapped) and saved once as a weights-only checkpoint. Baseline: ``export_hf`` of
that checkpoint, what publishing meant before (build the chunks, load the checkpoint, stream
the shards). Ours: ``WeightPublisher.publish`` on the live chunks in the same dtype (fp32, the
model's), version.json, fsyncs, rename, ``latest`` and pruning included. Median of ``--rounds``
each, alternating. Then each dtype's bytes: the tensors' (exact) and the files' on disk.

Prints the bytes per dtype, then last: ``ours=<s per publication> baseline=<s per export>
ratio=<ours/baseline>``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from glm5_train import known_warnings
from glm5_train.assembly import build_model
from glm5_train.checkpoint import TrainState, save_checkpoint
from glm5_train.hf_checkpoint import compose, ensure_distributed, export_hf
from glm5_train.optim import wrap_ddp
from glm5_train.rl.publisher import WeightPublisher
from parallel import process_groups

DEFAULT_MODEL = ["model=glm5_tiny", "data.tokenizer=tests/data/glm_tiny_tokenizer",
                 "parallel=single"]


def one_process_group() -> None:
    """torchrun's environment for a single rank, on a free port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def timed(run) -> float:
    """Seconds of ``run()``, its console lines swallowed."""
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        run()
    return time.perf_counter() - start


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="publications and exports each")
    args, overrides = parser.parse_known_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds={args.rounds}: must be >= 1; e.g. --rounds 3")
    known_warnings.install()
    os.chdir(REPO)  # the default tokenizer path is relative to the repository
    one_process_group()
    job = compose([*DEFAULT_MODEL, *overrides])
    ensure_distributed(job)
    config, chunks = build_model(job, process_groups.groups())
    chunks = wrap_ddp(chunks, config, job.parallel.use_distributed_optimizer,
                      job.parallel.overlap_grad_reduce)
    root = tempfile.mkdtemp(prefix="glm5_publish_bench_")
    try:
        ckpt = os.path.join(root, "ckpt")
        with contextlib.redirect_stderr(io.StringIO()):
            save_checkpoint(ckpt, chunks, None, None, TrainState(), job.model)
        publisher = WeightPublisher(job, chunks, os.path.join(root, "fp32"), dtype="fp32")
        ours, baseline = [], []
        for version in range(args.rounds):
            ours.append(timed(lambda v=version: publisher.publish(v)))
            out = os.path.join(root, f"export{version}")
            baseline.append(timed(lambda o=out: export_hf(job, ckpt, o)))
        for dtype in ("fp32", "bf16", "fp8"):
            directory = os.path.join(root, f"bytes_{dtype}")
            with contextlib.redirect_stdout(io.StringIO()):
                report = WeightPublisher(job, chunks, directory, dtype=dtype).publish(1)
            print(f"{dtype}: {report['bytes']} tensor bytes, {disk_bytes(report['path'])} bytes "
                  f"on disk ({report['hf_tensors']} tensors, {len(report['files'])} shards)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        process_groups.destroy_distributed()
    print(f"seconds: publication {[round(s, 3) for s in ours]}, export_hf "
          f"{[round(s, 3) for s in baseline]}")
    mine, theirs = statistics.median(ours), statistics.median(baseline)
    print(f"ours={mine:.3f} baseline={theirs:.3f} ratio={mine / theirs:.3f}")


if __name__ == "__main__":
    main()
