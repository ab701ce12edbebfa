"""Compute this project's logits for given tokens from a checkpoint, in any parallel layout.

    torchrun --nproc-per-node N tools/logits.py --load CKPT --tokens tokens.pt --out logits.pt \
        model=glm5_tiny parallel=tp2_pp2

``tokens.pt`` holds an int64 tensor [B, S]; ``logits.pt`` receives fp32 [B, S, vocab], written by
one rank. Used by the Hugging Face logit-parity test and for spot checks after conversions.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # runnable as `torchrun tools/logits.py` from anywhere
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from glm5_train import known_warnings  # noqa: E402
from glm5_train.assembly import build_model, install_int4_qat  # noqa: E402
from glm5_train.checkpoint import load_checkpoint  # noqa: E402
from glm5_train.inference import compute_logits  # noqa: E402
from glm5_train.job_config import compose_job  # noqa: E402
from parallel import mcore_compat, process_groups  # noqa: E402

# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  # logits of a 2-process (TP2) checkpoint for tokens.pt (int64 [B, S])
  torchrun --nproc-per-node 2 tools/logits.py --load outputs/run/checkpoints \
      --tokens tokens.pt --out logits.pt model=glm5_tiny parallel=tp2
"""


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="checkpoint.save directory")
    parser.add_argument("--tokens", required=True, help="torch file with int64 tokens [B, S]")
    parser.add_argument("--out", required=True, help="where to write fp32 logits [B, S, V]")
    args, overrides = parser.parse_known_args(argv)

    known_warnings.install()
    tokens = torch.load(args.tokens)
    job = compose_job([*overrides, "train.micro_batch_size=1",
                       f"train.global_batch_size={tokens.shape[0]}",
                       f"train.seq_length={tokens.shape[1]}"])
    mcore_compat.install()
    process_groups.init_distributed(job.parallel, job.train.seed)
    groups = process_groups.groups()
    _, chunks = build_model(job, groups)
    if job.train.int4_qat:  # the logits the INT4 QAT forward computes
        install_int4_qat(chunks, job.train.int4_group_size)
    load_checkpoint(args.load, chunks, None, None, job.model)
    logits = compute_logits(chunks, tokens, groups)
    writer = logits is not None and groups.tp.rank() == 0 and groups.dp.rank() == 0
    if writer:
        torch.save(logits, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
