"""GLM-5's training curriculum, stage by stage: one table of what each stage preset runs and
whether its layout fits its cluster by the planner.

    python tools/curriculum.py                 # the table
    python tools/curriculum.py --smallest-sft  # + the fewest H100 that fit the 202K SFT

Each stage is a preset (``configs/experiment/``), composed as the training job composes it and
planned as ``tools/plan_fit.py`` plans it, on GPU kernels (``glm5_train/curriculum.py``): tokens (the report's budget, turned into
steps by ``train.train_tokens``, a batch-size ramp included), steps, the learning-rate shape,
the layout, the GPUs, and the planned bytes per GPU (largest rank + one layer's recompute
working set) against the stage's device. A stage continues from the one before it with
``checkpoint.pretrained=<its checkpoints>`` (weights, and the optimizer state where the
optimizer is the same; ``train.lr_from_pretrained=true`` starts at the learning rate it ended at).

Margin: the planner counts weights, gradients, optimizer state and activations, not
communication buffers, workspaces or the allocator's fragmentation. Megatron-Bridge's 608-H100
GLM-5.2 200K SFT layout plans at 41.6 GB here against its published peak of 84.9 GB, so a real
peak can be twice the plan. A stage is marked ``margin`` when its plan leaves at least
``--margin`` of the device free (default 20%), ``tight`` when it fits only without it.

``--smallest-sft`` plans the 202K SFT (``+experiment=glm5_sft_202k``, its batch and techniques)
on 64, 128 and 256 H100 over the (TP, PP, CP) shapes of each count, with the largest expert
parallelism the shape allows, with the optimizer state on the device and in host memory, and
prints the best plan of each count and the bytes that stop the smaller counts. Last line::

    smallest_sft_h100=<int> peak_bytes=<int> layout=<TPxPPxCPxEP> host_optimizer=<bool>

Exit status 0; 2 for a bad command line or a preset that does not compose.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from glm5_train.curriculum import STAGES, smallest_sft_lines, stage_row, table

# Runnable as a script from anywhere: make the repo root importable.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="Apex is not installed")


# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  python tools/curriculum.py                  # every stage: tokens, steps, LR, layout, GB/GPU
  python tools/curriculum.py --margin 0.3     # mark the stages that leave 30% of the device
  python tools/curriculum.py --smallest-sft   # + the fewest H100 that fit the 202K SFT
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--margin", type=float, default=0.2,
                   help="share of the device a plan must leave free to be marked 'margin'")
    p.add_argument("--smallest-sft", action="store_true",
                   help="also plan the 202K SFT on 64, 128 and 256 H100 (about a minute)")
    args = p.parse_args(argv)
    if not 0.0 <= args.margin < 1.0:
        p.error(f"--margin={args.margin} must lie in [0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        lines = table([stage_row(stage) for stage in STAGES], args.margin)
        if args.smallest_sft:
            lines += smallest_sft_lines()
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        print(f"curriculum: error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
