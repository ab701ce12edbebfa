"""Publish a model's weights as a numbered version for rollout engines, as RL training does.

    torchrun --nproc-per-node N tools/publish_weights.py --out DIR --version STEP \\
        [--load CKPT] [--dtype bf16|fp32|fp8] [--keep 3] [--no-mtp] [model=... parallel=...]

Builds the model in the job's layout as training builds it (initial weights of train.seed,
chunks wrapped in megatron-core's DDP), loads ``--load`` if given, and runs
``glm5_train.rl.publisher.WeightPublisher``: ``DIR/v<STEP>/`` (HF safetensors, config.json,
tokenizer files, version.json) with ``DIR/latest`` pointing at it. The command line only; the
publication is glm5_train/rl/publisher.py (see its docstring).
"""

from __future__ import annotations

import argparse
import os
import sys

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import torch.distributed as dist

from glm5_train import known_warnings
from glm5_train.assembly import build_model
from glm5_train.checkpoint import load_checkpoint
from glm5_train.hf_checkpoint import _rank, compose, ensure_distributed
from glm5_train.optim import wrap_ddp
from glm5_train.rl.publisher import DTYPES, WeightPublisher, publication_problem
from parallel import process_groups

# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  # a training run's checkpoint as version 200 in bf16, for SGLang / vLLM to load from
  # /tmp/published/latest (4 processes, the layout the run trained in)
  torchrun --nproc-per-node 4 tools/publish_weights.py --load outputs/<run>/checkpoints \
      --out /tmp/published --version 200 model=glm5_tiny parallel=tp2_pp2_vpp2_ep2
  # the initial weights of train.seed as version 0, in the fp8 block format
  torchrun --nproc-per-node 1 tools/publish_weights.py --out /tmp/published --version 0 \
      --dtype fp8 model=glm5_tiny parallel=single
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tools/publish_weights.py",
        description="Publish a model's weights as DIR/v<STEP>/ (Hugging Face safetensors,\n"
                    "config.json, tokenizer files, version.json) and point DIR/latest at it,\n"
                    "as RL training publishes them for rollout engines; older versions beyond\n"
                    "--keep are pruned. Runs under torchrun in any layout; Hydra overrides after\n"
                    "the options name the model and layout (python -m launch.local --help).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the directory of versions (created if "
                        "missing); engines follow its 'latest' symlink")
    parser.add_argument("--version", required=True, type=int, help="the version number: the "
                        "optimizer step the weights come from")
    parser.add_argument("--load", help="checkpoint directory (checkpoint.save of a training "
                        "run, or an import); without it, the initial weights of train.seed")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="bf16 "
                        "(default), fp32, or fp8 (e4m3 linear weights, one scale per 128x128 "
                        "block, as GLM-5-FP8)")
    parser.add_argument("--keep", type=int, default=3, help="complete versions kept (the one "
                        "latest names always among them; default 3)")
    parser.add_argument("--no-mtp", dest="mtp", action="store_false", help="leave the MTP "
                        "layer's tensors out (num_nextn_predict_layers becomes 0)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=glm5_tiny "
                        "parallel=tp2_pp2_vpp2_ep2")
    return parser.parse_args(argv)


def build_live_chunks(job) -> list:
    """This rank's chunks as training holds them: built and initialised from train.seed
    (glm5_train.assembly.build_model), wrapped in megatron-core's DDP with the job's
    distributed-optimizer setting (parameters then live in DDP's contiguous buffers)."""
    config, chunks = build_model(job, process_groups.groups())
    return wrap_ddp(chunks, config, job.parallel.use_distributed_optimizer,
                    job.parallel.overlap_grad_reduce)


def publish(args: argparse.Namespace) -> dict:
    job = compose(args.overrides)
    problem = publication_problem(job, args.out, args.keep, args.dtype)
    if problem is not None:  # on every rank alike, before any process group exists
        raise ValueError(problem)
    if args.version < 0:
        raise ValueError(f"--version={args.version}: a version is an optimizer step, >= 0")
    ensure_distributed(job)
    chunks = build_live_chunks(job)
    if args.load:
        load_checkpoint(args.load, chunks, None, None, job.model)
    publisher = WeightPublisher(job, chunks, args.out, keep=args.keep, dtype=args.dtype,
                                mtp=args.mtp)
    return publisher.publish(args.version)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    known_warnings.install()
    try:
        publish(args)
    except (ValueError, TypeError, FileNotFoundError) as err:
        if _rank() == 0:
            print(f"publish_weights: error: {err}", file=sys.stderr, flush=True)
        return 1
    if dist.is_initialized():
        dist.barrier()
    process_groups.destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
