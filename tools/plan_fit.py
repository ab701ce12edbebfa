"""Does a GLM-5 job fit its GPUs, and what does each memory technique save? The planner's answer.

Example (the 744B SFT at 202,752 tokens on 256 H100)::

    python tools/plan_fit.py +experiment=glm5_sft_202k
    python tools/plan_fit.py +experiment=glm5_sft_202k parallel.context_parallel_size=8 --dp 1

The job is composed as the training job composes it (any Hydra override works) and planned for
GPUs (SDPA's fused kernels) by ``glm5_train.plan``: per rank the weights, gradients and
optimizer state of its stages, the activations its pipeline schedule keeps in flight at its peak
(context parallelism: every rank holds seq_length / CP tokens, and the whole sequence's gathered
latent and indexer keys where the attention keeps them), plus the working set that recompute
re-creates for one layer in backward; and the bytes each rank sends per step on its
context-parallel group (the latent and indexer keys gathered, their gradients reduce-scattered;
checked byte for byte against measured runs in tests/test_context_parallel_plan.py), on its
data-parallel groups (the gradient reduction and the distributed optimizer's parameter
all-gather, Pipeline ZeRO2's reduce-scatters; n/a under Muon or frozen parameters, which the
planner does not model) and to its pipeline neighbours (checked against measured runs by glm5_train.plan.check,
without context parallelism).

It prints the per-rank table, the largest rank against an 80 GB H100 and a 141 GB H200 (counted
as 80e9 and 141e9 bytes, below the devices' 85.5e9 and 150.8e9: the difference is left to the
CUDA context, communication buffers, allocator fragmentation and the transient workspace the
planner does not count), the GPUs the layout needs beside Megatron-Bridge's 608-H100 GLM-5.2
200K SFT recipe, and the plan again with each memory technique turned off (or, for those the
plan does not use, on) in turn: what each one saves on the largest rank. The last line::

    fits_h100=<bool> fits_h200=<bool> gpus=<int> max_rank_bytes=<int> working_set_bytes=<int> cp_bytes_per_step=<int>

``--recipes`` plans the published GLM-5 recipes instead, each as published and then the same
job (model, sequence length, tokens per step) on fewer GPUs with this project's techniques, one
row each (largest rank + working set against an 80 GB H100), and ends with one line per row::

    recipe=<name> gpus=<int> peak_bytes=<int> fits_h100=<bool>

Exit status 0; 2 for a bad command line or config.
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
from glm5_train.published_recipes import RECIPES
from glm5_train.plan import (
    PlanReport,
    context_parallel_sent,
    inputs_from_job,
    job_plan,
    planned_traffic,
    recompute_working_set_bytes,
    tensor_parallel_unmodelled,
    traffic_modelled,
)

# Runnable as a script from anywhere: make the repo root importable.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="Apex is not installed")

GB, GIB = 10**9, 2**30


@dataclasses.dataclass(frozen=True)
class Unit:
    """A unit the tables print bytes in: the largest that keeps the largest figure >= 1, so
    the tiny model's kilobytes read as such rather than 0.0 GB."""

    name: str
    size: int

    @classmethod
    def of(cls, largest: float, binary: bool) -> Unit:
        base, names = (1024, ("B", "KiB", "MiB", "GiB")) if binary else (1000, ("B", "kB", "MB",
                                                                               "GB"))
        power = 3
        while power and largest < base ** power:
            power -= 1
        return cls(names[power], base ** power)
DEVICES = (("H100 80 GB", 80 * GB), ("H200 141 GB", 141 * GB))
BRIDGE = ("Megatron-Bridge GLM-5.2 200K SFT: 608 H100 (TP1 PP19 CP32 EP32, full recompute), "
          "peak 81,005 MiB, 36.6 s per step, 39.6 TFLOP/s per GPU")
BRIDGE_GPUS = 608
# GPU plans run SDPA's fused kernels (what the planner prices for attention on CUDA).
ON_GPU = {"fused_attention": True}
SELECTIVE_ALL = ["activations.recompute_granularity=selective",
                 "activations.recompute_method=null", "activations.recompute_num_layers=null",
                 "activations.recompute_modules=[core_attn,mla_up_proj,moe_act]"]
NO_RECOMPUTE = ["activations.recompute_granularity=null", "activations.recompute_method=null",
                "activations.recompute_num_layers=null", "activations.recompute_modules=[]"]


# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  # the 744B SFT at 202,752 tokens on 256 H100
  python tools/plan_fit.py +experiment=glm5_sft_202k
  python tools/plan_fit.py +experiment=glm5_sft_202k parallel.context_parallel_size=8 --dp 1
  python tools/plan_fit.py --recipes   # the published GLM-5 recipes, then on fewer GPUs
"""


@dataclasses.dataclass(frozen=True)
class Variant:
    """The plan with one technique changed: ``removes`` names a technique the plan uses that
    this variant turns off (its extra bytes are what that technique saves), else None."""

    label: str
    overrides: list[str]
    dp: int
    removes: str | None = None


@dataclasses.dataclass(frozen=True)
class Fit:
    """One plan's figures: the largest rank (static + in-flight activations), the working set
    recompute adds on it, its context-parallel bytes per step, the GPUs it takes."""

    label: str
    max_rank_bytes: int
    working_set_bytes: int
    cp_bytes: int
    gpus: int
    report: PlanReport
    # Per pipeline rank: bytes sent per step by kind (glm5_train.plan.planned_traffic), only
    # the kinds the planner models for this job.
    traffic: tuple[dict[str, int], ...] = ()

    @property
    def peak_bytes(self) -> int:
        return self.max_rank_bytes + self.working_set_bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=glm5_sft_202k")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel size (default: parallel.data_parallel_size, else 1)")
    p.add_argument("--recipes", action="store_true",
                   help="plan the published GLM-5 recipes and the same jobs on fewer GPUs")
    return p.parse_intermixed_args(argv)


def plan_fit(overrides: list[str], dp: int | None, label: str = "plan") -> Fit:
    job = compose_job(overrides)
    dp = dp or job.parallel.data_parallel_size or 1
    inputs = inputs_from_job(job, dp, **ON_GPU)
    report = job_plan(job, dp, **ON_GPU)
    worst = max(report.ranks, key=lambda rank: rank.total_bytes)
    cp_sent = max(context_parallel_sent(rank) for rank in report.ranks)
    gpus = job.parallel.world_size_needed(dp)
    return Fit(label, worst.total_bytes, recompute_working_set_bytes(job.model, inputs),
               cp_sent, gpus, report, rank_traffic(job, inputs, report))


def rank_traffic(job, inputs, report: PlanReport) -> tuple[dict[str, int], ...]:
    """Per pipeline rank, the data-parallel, pipeline, tensor-parallel and expert-parallel
    bytes it sends per step, where the planner models them (``traffic_modelled``; the tensor-parallel kinds at 0
    without TP)."""
    kinds = set(traffic_modelled(job))
    if tensor_parallel_unmodelled(job) is None:
        kinds |= {"tensor_parallel", "expert_tensor_parallel", "expert_all_to_all"}
    out = []
    for rank in report.ranks:
        stages = [s for s in report.stages if s.rank == rank.rank]
        sent = planned_traffic(job, inputs, report.layout, stages, rank.rank)
        out.append({kind: sent[kind] for kind in kinds})
    return tuple(out)


def variants(job, dp: int) -> list[Variant]:
    """Each technique the plan uses turned off, and those it does not use turned on (or the
    alternative to what it uses); the same GPUs and global batch throughout."""
    par, act = job.parallel, job.activations
    cp = par.context_parallel_size
    out = []
    if cp > 1:
        out.append(Variant(f"context parallelism CP{cp} -> CP1 (DP{dp * cp})",
                           ["parallel.context_parallel_size=1"], dp * cp, "context parallelism"))
    if act.recompute_granularity == "full":
        out += [Variant("full recompute -> none", NO_RECOMPUTE, dp, "full recompute"),
                Variant("full recompute -> selective (core_attn, mla_up_proj, moe_act)",
                        SELECTIVE_ALL, dp),
                Variant("  ... + offloading every forward (none with full recompute: refused)",
                        [*SELECTIVE_ALL, f"activations.offload_micro_batches={1 << 20}"], dp)]
    elif act.offload_micro_batches:
        out.append(Variant("activation offloading -> off", [
            "activations.offload_micro_batches=0", "activations.offload_layers=null"], dp,
            "activation offloading"))
    if act.loss_chunk_tokens and job.train.objective == "lm":  # RL needs the chunked head
        out.append(Variant(f"chunked loss ({act.loss_chunk_tokens} tokens) -> whole-sequence "
                           "logits", ["activations.loss_chunk_tokens=0"], dp, "chunked loss"))
    if par.use_distributed_optimizer:
        out.append(Variant("distributed optimizer -> off", [
            "parallel.use_distributed_optimizer=false", "parallel.pipeline_zero2=false"], dp,
            "distributed optimizer"))
        if par.pipeline_zero2:
            out.append(Variant("Pipeline ZeRO2 -> off", ["parallel.pipeline_zero2=false"], dp,
                               "Pipeline ZeRO2"))
        else:
            out.append(Variant("Pipeline ZeRO2 off -> on", ["parallel.pipeline_zero2=true"], dp))
    if par.pipeline_model_parallel_size > 1 and not par.pipeline_model_parallel_layout:
        other = "with_loss" if par.mtp_placement == "split" else "split"
        out.append(Variant(f"MTP placement {par.mtp_placement} -> {other}",
                           [f"parallel.mtp_placement={other}"], dp))
    return out


def rank_lines(fit: Fit) -> list[str]:
    """The per-rank table. Sent per step: context parallelism's exchange, the data-parallel
    gradient reduction + parameter all-gather, the pipeline's sends, the tensor-parallel and
    expert-tensor-parallel exchanges, the expert all-to-alls (the router spreading tokens
    evenly); n/a where the planner does not model them (distributed Muon's
    data-parallel gradient traffic, frozen parameters,
    ``tensor_parallel_unmodelled``). Memory in the binary unit of the largest rank, traffic in
    the decimal unit of the largest figure."""
    mem = Unit.of(max(rank.total_bytes for rank in fit.report.ranks), binary=True)
    sent_all = [context_parallel_sent(rank) for rank in fit.report.ranks]
    sent_all += [v for sent in fit.traffic for v in sent.values()]
    net = Unit.of(max(sent_all, default=0), binary=False)
    head = (f"{'rank':>4} {'static ' + mem.name:>11} {'peak act ' + mem.name:>13} "
            f"{'total ' + mem.name:>10} "
            + " ".join(f"{kind + ' sent ' + net.name + '/step':>16}"
                       for kind in ("CP", "DP", "PP", "TP", "EP")))
    rows = [head, "-" * len(head)]
    for rank, sent in zip(fit.report.ranks, fit.traffic):
        rows.append(f"{rank.rank:>4} {rank.static_bytes / mem.size:>11.2f} "
                    f"{rank.peak_activation_bytes / mem.size:>13.2f} "
                    f"{rank.total_bytes / mem.size:>10.2f} "
                    f"{context_parallel_sent(rank) / net.size:>16.1f} "
                    f"{_sent(sent, net, 'grad_reduction', 'param_gather'):>16} "
                    f"{_sent(sent, net, 'p2p'):>16} "
                    f"{_sent(sent, net, 'tensor_parallel', 'expert_tensor_parallel'):>16} "
                    f"{_sent(sent, net, 'expert_all_to_all'):>16}")
    return rows


def _sent(sent: dict[str, int], unit: Unit, *kinds: str) -> str:
    if not all(kind in sent for kind in kinds):
        return "n/a"
    return f"{sum(sent[kind] for kind in kinds) / unit.size:.1f}"


def _in(nbytes: int, binary: bool) -> str:
    """``nbytes`` in its own unit, e.g. '64.4 GiB', '29.9 MB'."""
    unit = Unit.of(nbytes, binary)
    return f"{nbytes / unit.size:.1f} {unit.name}"


def device_lines(fit: Fit) -> list[str]:
    lines = []
    for name, capacity in DEVICES:
        verdict = "fits" if fit.peak_bytes <= capacity else "does NOT fit"
        lines.append(f"{name}: {verdict} ({fit.peak_bytes / GB:.1f} of {capacity / GB:.0f} GB, "
                     f"{(capacity - fit.peak_bytes) / GB:+.1f} GB to spare), {fit.gpus} GPUs")
    return lines


def technique_lines(base: Fit, tried: list[tuple[Variant, Fit]]) -> list[str]:
    """Each variant's largest rank against the plan's, and each used technique's share of what
    the used techniques save together (each turned off alone)."""
    h100 = DEVICES[0][1]
    u = Unit.of(base.peak_bytes, binary=False)
    head = (f"{'technique':<72} {'largest rank + ws ' + u.name:>21} {'change ' + u.name:>10} "
            f"{'H100':>5}")
    plan = (f"{'the plan':<72} {base.peak_bytes / u.size:>21.1f} {'':>10} "
            f"{'fits' if base.peak_bytes <= h100 else 'no':>5}")
    rows = [head, "-" * len(head), plan]
    savings = {}
    for variant, fit in tried:
        change = fit.peak_bytes - base.peak_bytes
        rows.append(f"{variant.label:<72} {fit.peak_bytes / u.size:>21.1f} "
                    f"{change / u.size:>+10.1f} "
                    f"{'fits' if fit.peak_bytes <= h100 else 'no':>5}")
        if variant.removes and change > 0:
            savings[variant.removes] = change
    total = sum(savings.values())
    if total:
        shares = ", ".join(f"{name} {_in(saved, False)} ({saved / total:.0%})"
                           for name, saved in sorted(savings.items(), key=lambda kv: -kv[1]))
        rows.append(f"saved on the largest rank by each technique the plan uses (turned off "
                    f"alone; sum {_in(total, False)}): {shares}")
    return rows


def recipe_lines() -> list[str]:
    """One row per published recipe and per fewer-GPU plan of the same job, then the summary
    lines."""
    h100 = DEVICES[0][1]
    fits = [(r, plan_fit(r.overrides, r.dp, r.name)) for r in RECIPES]
    head = (f"{'recipe':<98} {'GPUs':>5} {'largest rank GiB':>17} {'+ ws GiB':>9} "
            f"{'total GB':>9} {'H100':>5} {'host GiB/GPU':>13}")
    rows = [head, "-" * len(head)]
    for recipe, fit in fits:
        host = max(sum(s.costs.host_bytes for s in fit.report.stages if s.rank == r.rank)
                   for r in fit.report.ranks)
        rows.append(f"{recipe.label:<98} {fit.gpus:>5} {fit.max_rank_bytes / GIB:>17.1f} "
                    f"{fit.working_set_bytes / GIB:>9.1f} {fit.peak_bytes / GB:>9.1f} "
                    f"{'fits' if fit.peak_bytes <= h100 else 'no':>5} {host / GIB:>13.1f}")
    rows.append("")
    rows += [f"recipe={r.name} gpus={fit.gpus} peak_bytes={fit.peak_bytes} "
             f"fits_h100={fit.peak_bytes <= h100}" for r, fit in fits]
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.recipes:
        try:
            print("\n".join(recipe_lines()), flush=True)
        except (HydraException, OmegaConfBaseException, ValueError) as err:
            print(f"plan_fit: error: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        job = compose_job(args.overrides)
        dp = args.dp or job.parallel.data_parallel_size or 1
        base = plan_fit(args.overrides, dp)
        tried = [(v, plan_fit([*args.overrides, *v.overrides], v.dp, v.label))
                 for v in variants(job, dp)]
    except (HydraException, OmegaConfBaseException, ValueError) as err:  # all a user can fix
        print(f"plan_fit: error: {err}", file=sys.stderr)
        return 2
    par, inputs = job.parallel, inputs_from_job(job, dp, **ON_GPU)
    lines = [
        (f"GLM-5 plan: model={job.model.name}, TP{par.tensor_model_parallel_size} "
         f"PP{par.pipeline_model_parallel_size} VPP{par.virtual_pipeline_model_parallel_size or '-'} "
         f"CP{par.context_parallel_size} EP{par.expert_model_parallel_size} DP{dp} = {base.gpus} "
         f"GPUs; {job.train.global_batch_size} x {job.train.seq_length} tokens per step "
         f"({inputs.seq} per CP rank), {inputs.num_microbatches} micro-batches per rank"),
        f"layout: {base.report.layout.to_string()}", "", *rank_lines(base), "",
        (f"largest rank {_in(base.max_rank_bytes, True)} + recompute working set "
         f"{_in(base.working_set_bytes, True)} = {_in(base.peak_bytes, False)}; "
         f"context-parallel traffic {_in(base.cp_bytes, False)} sent per rank and step"),
        *device_lines(base), "",
        BRIDGE,
        (f"this plan: {base.gpus} GPUs, {BRIDGE_GPUS / base.gpus:.1f}x fewer"
         if base.gpus < BRIDGE_GPUS else f"this plan: {base.gpus} GPUs"), "",
        *technique_lines(base, tried), "",
        (f"fits_h100={base.peak_bytes <= DEVICES[0][1]} fits_h200={base.peak_bytes <= DEVICES[1][1]} "
         f"gpus={base.gpus} max_rank_bytes={base.max_rank_bytes} "
         f"working_set_bytes={base.working_set_bytes} cp_bytes_per_step={base.cp_bytes}"),
    ]
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
