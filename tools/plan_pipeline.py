"""Plan GLM-5's pipeline layout: per-stage and per-rank memory for both MTP placements.

Examples::

    python tools/plan_pipeline.py model=glm5_tiny parallel=pp2_vpp2
    python tools/plan_pipeline.py model=glm5_744b train=glm5_pretrain \\
        parallel=glm5_slime_256gpu parallel.pipeline_model_parallel_layout=null \\
        parallel.pipeline_model_parallel_size=8 parallel.virtual_pipeline_model_parallel_size=2 \\
        parallel.tensor_model_parallel_size=2 parallel.expert_model_parallel_size=32 \\
        parallel.sequence_parallel=true --dp 32

The job config is composed exactly as ``launch/local.py`` composes it (any Hydra override works,
e.g. ``train.seq_length=32768`` or ``dsa=frozen_indexer``). Both MTP placements are planned side by
side: ``with_loss`` (the MTP layer with the loss on the last stage, megatron-core's) and
``split`` (the MTP layer on the stage before, GLM-5's), each balanced by
``glm5_train.plan.balance_layout`` as the training job balances it (compute per stage
first, ``--balance memory`` for the least memory instead). A layout given as
``parallel.pipeline_model_parallel_layout`` is checked and shown as given, next to the other
placement balanced. With MTP off (``model.mtp_num_steps=0``) there is one plan, placement ``none``.

The memory is a closed-form estimate (see ``glm5_train/plan/``): weights, gradients and
optimizer state of each rank's stages, plus the activations its pipeline schedule keeps in flight
at its peak. The config's memory options count: ``parallel.use_distributed_optimizer`` (state
sharded), ``parallel.pipeline_zero2`` (gradient slices plus two accumulation buffers per rank,
one with a single chunk), ``parallel.microbatch_group_size_per_vp_stage`` (the interleaved schedule's group size),
``parallel.context_parallel_size`` (seq_length / CP tokens per rank; the rank table then adds the
bytes each rank sends per step for context parallelism). ``tools/plan_fit.py`` checks a job
against H100 / H200 memory and shows what each memory technique saves. The last lines are one summary per plan::

    placement=<p> layout=<str> max_rank_bytes=<int> min_rank_bytes=<int> spread_bytes=<int>

Exit status 0; 2 for a bad command line, config or layout.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from glm5_train.job_config import compose_job
from glm5_train.plan import (
    NO_MEMORY_LIMIT,
    balance_layout,
    context_parallel_sent,
    inputs_from_job,
    mtp_sets,
    mtp_steps,
    parse_layout,
    plan_report,
)

# Runnable as a script from anywhere: make the repo root importable.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="Apex is not installed")

GIB, MIB = 2**30, 2**20
PLACEMENTS = ("with_loss", "split")


# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  python tools/plan_pipeline.py model=glm5_tiny parallel=pp2_vpp2
  python tools/plan_pipeline.py model=glm5_tiny parallel=pp2_vpp2 --balance memory
  python tools/plan_pipeline.py model=glm5_744b train=glm5_pretrain parallel=glm5_slime_256gpu --dp 32
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=glm5_744b "
                   "parallel.pipeline_model_parallel_size=8")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel size (default: parallel.data_parallel_size, else 1); "
                        "it sets the micro-batch count and the optimizer-state sharding")
    p.add_argument("--balance", choices=("compute", "memory"), default="compute",
                   help="compute (default, as the training job balances): even out the "
                        "slowest stage, memory breaking ties or under --memory-limit-gib; "
                        "memory: the least memory on the fullest rank")
    p.add_argument("--memory-limit-gib", type=float, default=None,
                   help="per-rank memory the compute balance must respect (default: "
                        "parallel.stage_memory_limit_gib, else none)")
    return p.parse_intermixed_args(argv)  # overrides may follow the options


def balance_limit(args: argparse.Namespace, job) -> int | None:
    """balance_layout's memory limit: None balances memory first; a number balances compute
    among the layouts that fit (NO_MEMORY_LIMIT: all fit, as the training job does)."""
    gib = args.memory_limit_gib
    if gib is None:
        gib = job.parallel.stage_memory_limit_gib
    if gib is not None:
        return int(gib * GIB)
    return None if args.balance == "memory" else NO_MEMORY_LIMIT


def compact(chars: str) -> str:
    """'Etttt' -> 'Et*4': megatron-core's own repeat syntax, to keep tables narrow."""
    return re.sub(r"(.)\1+", lambda m: f"{m.group(1)}*{len(m.group(0))}", chars) or "-"


def build_plans(job, inputs, limit: int | None = None) -> list:
    """PlanReports: the given layout (if any) first, then the balanced placements."""
    par, model = job.parallel, job.model
    pp, vpp, sets = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size, \
        mtp_sets(model)
    layouts = []
    if par.pipeline_model_parallel_layout:
        layouts.append(parse_layout(par.pipeline_model_parallel_layout, pp, vpp,
                                    model.num_hidden_layers, sets))
    placements = PLACEMENTS if sets else ("none",)
    for placement in placements:
        if placement == "split" and pp < 2:
            print("note: the split placement needs pipeline_model_parallel_size >= 2; skipped")
        elif placement not in {lay.placement for lay in layouts}:
            layouts.append(balance_layout(model, pp, vpp, placement, inputs, limit))
    return [plan_report(model, lay, inputs) for lay in layouts]


def header(job, inputs) -> list[str]:
    par, model = job.parallel, job.model
    return [
        (f"GLM-5 pipeline plan: model={model.name}, {model.num_hidden_layers} layers "
         f"({model.first_k_dense_replace} dense), MTP {mtp_steps(model)} step(s)"),
        (f"TP{inputs.tp} PP{par.pipeline_model_parallel_size} "
         f"VPP{par.virtual_pipeline_model_parallel_size or '-'} EP{inputs.ep} "
         f"expert-TP{inputs.expert_tp} CP{inputs.cp} DP{inputs.dp}, sequence parallel "
         f"{inputs.sequence_parallel}; seq {inputs.seq_length} x micro-batch "
         f"{inputs.micro_batch_size}, {inputs.num_microbatches} micro-batches per step"),
        (f"bytes per parameter: weights {inputs.weight_bytes}, grads {inputs.grad_bytes}, "
         f"optimizer {inputs.optimizer_bytes} (sharded over DP: "
         f"{inputs.distributed_optimizer}); activations {inputs.activation_bytes} bytes; "
         f"indexer KL activations {'on' if inputs.dsa_kl else 'off'}"),
    ]


def unit(plans) -> tuple[int, str]:
    """GiB, or MiB for plans too small to read in GiB (the tiny model)."""
    return (GIB, "GiB") if max(p.max_rank_bytes for p in plans) >= GIB else (MIB, "MiB")


def flop_unit(plans) -> tuple[float, str]:
    """TFLOP, or GFLOP for stages too small to read in TFLOP (the tiny model)."""
    most = max(s.costs.flops_per_microbatch for p in plans for s in p.stages)
    return (1e12, "TFLOP") if most >= 1e11 else (1e9, "GFLOP")


def stage_table(plans) -> list[str]:
    size, name = unit(plans)
    flops, flop_name = flop_unit(plans)
    head = f"{'stage':>5} {'rank':>4}" + "".join(
        f" | {p.layout.placement + ' layers':<17} {'params ' + name:>10} {'act ' + name:>9}"
        f" {flop_name:>6}" for p in plans)
    rows = [head, "-" * len(head)]
    for s, stage in enumerate(plans[0].stages):
        row = f"{s:>5} {stage.rank:>4}"
        for plan in plans:
            c = plan.stages[s].costs
            row += (f" | {compact(plan.stages[s].layers):<17} {c.param_bytes / size:>10.2f} "
                    f"{c.activation_bytes_per_microbatch / size:>9.2f} "
                    f"{c.flops_per_microbatch / flops:>6.1f}")
        rows.append(row)
    return rows + [(f"(act: activations of one micro-batch; {flop_name}: forward + backward of "
                    "one micro-batch on one rank)")]


def rank_table(plans) -> list[str]:
    size, name = unit(plans)
    sends = any(context_parallel_sent(rank) for plan in plans for rank in plan.ranks)
    head = f"{'rank':>4}" + "".join(
        f" | {p.layout.placement + ' static ' + name:>20} {'peak act ' + name:>12} "
        f"{'total ' + name:>9}" + (f" {'CP sent ' + name:>11}" if sends else "") for p in plans)
    rows = [head, "-" * len(head)]
    for r in range(len(plans[0].ranks)):
        row = f"{r:>4}"
        for plan in plans:
            rank = plan.ranks[r]
            row += (f" | {rank.static_bytes / size:>20.2f} "
                    f"{rank.peak_activation_bytes / size:>12.2f} {rank.total_bytes / size:>9.2f}")
            row += f" {context_parallel_sent(rank) / size:>11.2f}" if sends else ""
        rows.append(row)
    note = ("(static: weights + grads + optimizer state; peak act: the most activations its "
            "pipeline schedule holds at once")
    if sends:
        note += ("; CP sent: bytes the rank sends per step for context parallelism, the latent "
                 "and indexer keys gathered and their gradients reduce-scattered")
    return rows + [note + ")"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        job = compose_job(args.overrides)
        inputs = inputs_from_job(job, args.dp)
        limit = balance_limit(args, job)
        plans = build_plans(job, inputs, limit)
    except (HydraException, OmegaConfBaseException, ValueError) as err:  # all a user can fix
        print(f"plan_pipeline: error: {err}", file=sys.stderr)
        return 2
    lines = [*header(job, inputs), "", *stage_table(plans), "", *rank_table(plans), ""]
    lines += [plan.summary_line() for plan in plans]
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
