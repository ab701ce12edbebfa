"""How long will a GLM-5 training step take on a cluster, and where does the time go? The
planner's step-time model (``glm5_train/plan/step_time.py``), before any GPU is spent.

Example (the 744B SFT at 202,752 tokens on 256 H100)::

    python tools/plan_step_time.py +experiment=glm5_sft_202k
    python tools/plan_step_time.py +experiment=glm5_sft_202k --overlap grad_reduce,param_gather
    python tools/plan_step_time.py --table        # the docs' table: presets x overlaps, Bridge

The job is composed as the training job composes it (any Hydra override works) and planned on
GPU kernels. Per pipeline rank it prints the seconds of compute, of each kind of exposed
communication, of the optimizer and of waiting (the bubble), which add up to the step; then
the busiest rank's shares, the predicted step, TFLOP/s per GPU (model FLOPs, no recompute) and
MFU. ``--cluster`` picks the spec (``configs/cluster/<name>.yaml`` or a path): its rates are
assumptions written in the file. ``--overlap`` (comma-separated, or ``none``) replaces the
job's own overlap with what-ifs: ``grad_reduce`` and ``param_gather``
(``parallel.overlap_grad_reduce``, ``parallel.overlap_param_gather``) and ``expert_all_to_all``
(not offered by this backend yet: the model shows what it would hide). Last line::

    step_s=<float> tflops_per_gpu=<float> mfu=<float> gpus=<int> overlap=<names>

Exit status 0; 2 for a bad command line, config or cluster spec.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from glm5_train.job_config import compose_job
from glm5_train.plan.step_time import Overlaps, breakdown_lines, load_cluster, predict_step_time
from glm5_train.published_recipes import recipe

# Runnable as a script from anywhere: make the repo root importable.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="Apex is not installed")

# GPU plans run SDPA's fused kernels (what the planner prices for attention on CUDA).
ON_GPU = {"fused_attention": True}
OVERLAP_NAMES = tuple(f.name for f in dataclasses.fields(Overlaps))
# Megatron-Bridge's published GLM-5.2 200K SFT run (608 H100, TP1 PP19 CP32 EP32, full recompute).
BRIDGE_STEP_S, BRIDGE_TFLOPS = 36.6, 39.6
# The docs' table: each preset on 256 H100 (pre-training's 512-GPU preset at half its DP).
TABLE_JOBS = (
    ("SFT 202K (glm5_sft_202k)", ["+experiment=glm5_sft_202k"], 1),
    ("pre-training 4K (glm5_pretrain_4k at DP16 EP32)",
     ["+experiment=glm5_pretrain_4k", "parallel.data_parallel_size=16",
      "parallel.expert_model_parallel_size=32"], 16),
)
TABLE_OVERLAPS = (Overlaps(), Overlaps(grad_reduce=True), Overlaps(param_gather=True),
                  Overlaps(expert_all_to_all=True), Overlaps(True, True, True))

# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  python tools/plan_step_time.py +experiment=glm5_sft_202k
  python tools/plan_step_time.py +experiment=glm5_sft_202k --cluster h200
  python tools/plan_step_time.py +experiment=glm5_sft_202k --overlap grad_reduce,expert_all_to_all
  python tools/plan_step_time.py --table   # SFT and pre-training on 256 H100, Bridge's 608
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=glm5_sft_202k")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel size (default: parallel.data_parallel_size, else 1)")
    p.add_argument("--cluster", default="h100",
                   help="cluster spec: a preset of configs/cluster/ or a YAML path (default h100)")
    p.add_argument("--overlap", default=None,
                   help=f"what-if overlaps, comma-separated from {', '.join(OVERLAP_NAMES)}, "
                        "or 'none' (default: the job's own)")
    p.add_argument("--table", action="store_true",
                   help="the docs' table: presets on 256 H100 with each overlap, and Bridge's "
                        "published layout beside its measurement")
    return p.parse_intermixed_args(argv)


def parse_overlaps(text: str | None) -> Overlaps | None:
    """``--overlap``'s value; ValueError naming the known names."""
    if text is None:
        return None
    names = [] if text == "none" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in OVERLAP_NAMES]
    if unknown:
        raise ValueError(f"--overlap {','.join(unknown)}: unknown; choose from "
                         f"{', '.join(OVERLAP_NAMES)} (comma-separated) or none")
    return Overlaps(**{n: True for n in names})


def predict(overrides: list[str], dp: int | None, cluster, overlaps: Overlaps | None):
    job = compose_job(overrides)
    dp = dp or job.parallel.data_parallel_size or 1
    return job, predict_step_time(job, dp, cluster, overlaps, **ON_GPU)


def table_lines(cluster) -> list[str]:
    """One row per preset and overlap set, the busiest rank's seconds by part; then Bridge's
    layout predicted beside its published step."""
    head = (f"| job | overlap | step s | TFLOP/s/GPU | MFU | compute | TP | CP | EP a2a | "
            f"PP send | DP grads | DP params | optimizer | bubble |")
    rows = [head, "|" + "---|" * 14]
    for label, overrides, dp in TABLE_JOBS:
        for overlaps in TABLE_OVERLAPS:
            rows.append(_table_row(label, *predict(overrides, dp, cluster, overlaps)))
    bridge = recipe("bridge_608")
    for overlaps in (Overlaps(), Overlaps(True, True, True)):
        job, result = predict(bridge.overrides, bridge.dp, cluster, overlaps)
        rows.append(_table_row("Megatron-Bridge 200K SFT layout (608 GPUs, 32 sequences "
                               "assumed)", job, result))
    per_sequence = result.model_flops / job.train.global_batch_size
    implied = BRIDGE_TFLOPS * 1e12 * result.gpus * BRIDGE_STEP_S / per_sequence
    rows += ["", (f"Megatron-Bridge published: {BRIDGE_STEP_S} s per step, {BRIDGE_TFLOPS} "
                  f"TFLOP/s per GPU on 608 H100. By this model's FLOPs per sequence "
                  f"({per_sequence / 1e15:.1f} PFLOP), that rate over that step is "
                  f"{implied:.1f} sequences of 202,752 tokens per step.")]
    return rows


def _table_row(label: str, job, result) -> str:
    r = result.busiest()
    parts = [r.compute, *(r.comm[k] for k in ("tensor_parallel", "context_parallel",
                                              "expert_all_to_all", "pipeline",
                                              "grad_reduction", "param_gather")),
             r.optimizer, r.bubble]
    return (f"| {label} | {result.overlaps.label()} | {result.step_seconds:.1f} | "
            f"{result.tflops_per_gpu:.0f} | {result.mfu:.1%} | "
            + " | ".join(f"{p:.1f}" for p in parts) + " |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cluster = load_cluster(args.cluster)
        if args.table:
            print("\n".join(table_lines(cluster)), flush=True)
            return 0
        overlaps = parse_overlaps(args.overlap)
        job, result = predict(args.overrides, args.dp, cluster, overlaps)
    except (HydraException, OmegaConfBaseException, ValueError) as err:  # all a user can fix
        print(f"plan_step_time: error: {err}", file=sys.stderr)
        return 2
    par = job.parallel
    lines = [
        (f"GLM-5 step-time plan: model={job.model.name}, TP{par.tensor_model_parallel_size} "
         f"PP{par.pipeline_model_parallel_size} VPP{par.virtual_pipeline_model_parallel_size or '-'} "
         f"CP{par.context_parallel_size} EP{par.expert_model_parallel_size} = {result.gpus} x "
         f"{cluster.device}; {job.train.global_batch_size} x {job.train.seq_length} tokens per "
         f"step"),
        f"cluster {cluster.name}: {cluster.compute_tflops:g} of {cluster.peak_tflops:g} TFLOP/s, "
        f"intra-node {cluster.intra_node.rates_text()}, inter-node "
        f"{cluster.inter_node.rates_text()} "
        f"per GPU ({cluster.note})" if cluster.note else f"cluster {cluster.name}",
        f"layout: {result.layout.to_string()}", "",
        "seconds per step, by pipeline rank (exposed communication only):",
        *breakdown_lines(result), "",
        (f"step_s={result.step_seconds:.3f} tflops_per_gpu={result.tflops_per_gpu:.1f} "
         f"mfu={result.mfu:.4f} gpus={result.gpus} overlap={result.overlaps.label()}"),
    ]
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
