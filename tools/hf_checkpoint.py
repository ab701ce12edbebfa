"""Hugging Face GLM-5 checkpoints <-> this project's distributed checkpoints, in any layout.

    torchrun --nproc-per-node N tools/hf_checkpoint.py import --hf-dir DIR --save OUT \\
        [model=glm5_tiny parallel=tp2_pp2_vpp2_ep2 ...]
    torchrun --nproc-per-node N tools/hf_checkpoint.py export --load CKPT --hf-dir OUT \\
        [model=glm5_tiny parallel=single ...]

The command line only; the conversion is ``glm5_train.hf_checkpoint`` (see its docstring).
"""

from __future__ import annotations

import argparse
import os
import sys

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import torch.distributed as dist  # noqa: E402

from glm5_train import known_warnings  # noqa: E402
from glm5_train.hf_checkpoint import (  # noqa: E402
    _rank,
    compose,
    export_hf,
    import_hf,
    make_random_hf,
)
from parallel.process_groups import destroy_distributed  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  # a random HF GLM-5 with the shapes of model=glm5_tiny (no MTP layer: transformers has
  # none), with the tiny GLM-style tokenizer: something to try import / train / export on
  python tools/hf_checkpoint.py make-random --hf-dir /tmp/hf_tiny model=glm5_tiny \
      data.tokenizer=tests/data/glm_tiny_tokenizer
  # HF -> a weights-only checkpoint in the PP2 layout (2 processes)
  torchrun --nproc-per-node 2 tools/hf_checkpoint.py import --hf-dir /tmp/hf_tiny \
      --save /tmp/ckpt_hf model=glm5_tiny parallel=pp2 model.mtp_num_steps=0
  # a training run's checkpoint -> HF safetensors + config.json + tokenizer +
  # generation_config.json (transformers' from_pretrained / generate load it)
  torchrun --nproc-per-node 1 tools/hf_checkpoint.py export --load outputs/<run>/checkpoints \
      --hf-dir /tmp/hf_out model=glm5_tiny parallel=single data.tokenizer=tests/data/glm_tiny_tokenizer
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tools/hf_checkpoint.py",
        description="Convert between Hugging Face GLM-5 checkpoints and this project's\n"
                    "distributed checkpoints; run under torchrun in any layout (import: every\n"
                    "rank reads only the slices it owns; export: streamed one decoder layer per\n"
                    "shard through rank 0, with the tokenizer files of data.tokenizer and a\n"
                    "generation_config.json). Hydra overrides after the options name the model\n"
                    "and layout (python -m launch.local --help lists them).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF safetensors -> weights-only distributed checkpoint")
    imp.add_argument("--hf-dir", required=True, help="HF model directory (config.json, "
                     "model.safetensors[.index.json])")
    imp.add_argument("--save", required=True, help="checkpoint directory to write "
                     "(training loads it with checkpoint.load=...)")
    exp = sub.add_parser("export", help="distributed checkpoint -> HF safetensors (pass "
                         "data.tokenizer=<the model's HF tokenizer directory>: a tokenizer that "
                         "does not fit the model is refused before anything is written)")
    exp.add_argument("--load", required=True, help="checkpoint directory (checkpoint.save of "
                     "a training run or an import)")
    exp.add_argument("--hf-dir", required=True, help="output directory")
    exp.add_argument("--int4", action="store_true", help="write the routed experts as INT4 "
                     "(compressed-tensors pack-quantized, train.int4_group_size inputs per "
                     "scale), bit for bit the weights an INT4 QAT run trained with")
    exp.add_argument("--no-mtp", dest="mtp", action="store_false", help="leave the MTP layer's "
                     "tensors out (transformers' GlmMoeDsaForCausalLM does not use them; "
                     "num_nextn_predict_layers becomes 0)")
    rnd = sub.add_parser("make-random", help="a randomly initialised HF GLM-5 with the model "
                         "config's shapes, tokenizer files included (small configs; no "
                         "torchrun needed)")
    rnd.add_argument("--hf-dir", required=True, help="output directory")
    rnd.add_argument("--seed", type=int, default=0)
    for p in (imp, exp, rnd):
        p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=glm5_tiny "
                       "parallel=tp2_pp2_vpp2_ep2")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    known_warnings.install()
    try:
        job = compose(args.overrides)
        if args.command == "import":
            import_hf(job, args.hf_dir, args.save)
        elif args.command == "make-random":
            make_random_hf(job, args.hf_dir, args.seed)
        else:
            export_hf(job, args.load, args.hf_dir, int4=args.int4, mtp=args.mtp)
    except (ValueError, TypeError, FileNotFoundError) as err:
        if _rank() == 0:
            print(f"hf_checkpoint: error: {err}", file=sys.stderr, flush=True)
        return 1
    if dist.is_initialized():
        dist.barrier()
    destroy_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
