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

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from glm5_train.checkpoint import load_checkpoint
from glm5_train.inference import compute_logits
from glm5_train.job_config import compose_job
from glm5_train.train import build_model, quiet_megatron
from parallel import mcore_compat
from parallel.process_groups import init_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True, help="checkpoint.save directory")
    parser.add_argument("--tokens", required=True, help="torch file with int64 tokens [B, S]")
    parser.add_argument("--out", required=True, help="where to write fp32 logits [B, S, V]")
    args, overrides = parser.parse_known_args(argv)

    quiet_megatron()
    tokens = torch.load(args.tokens)
    job = compose_job([*overrides, "train.micro_batch_size=1",
                       f"train.global_batch_size={tokens.shape[0]}",
                       f"train.seq_length={tokens.shape[1]}"])
    mcore_compat.install()
    init_distributed(job.parallel, job.train.seed)
    _, chunks = build_model(job)
    load_checkpoint(args.load, chunks, None, None, job.model)
    logits = compute_logits(chunks, tokens)
    writer = (logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0
              and parallel_state.get_data_parallel_rank() == 0)
    if writer:
        torch.save(logits, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
