"""The planner beside a finished step: per global rank, the planned and the measured
parameter, gradient, optimizer-state and saved-activation bytes, and whether they agree.

Measured (a ``metrics.jsonl`` record): ``param_bytes``, ``grad_buffer_bytes`` (Pipeline ZeRO2:
``zero2_slice_bytes`` + ``zero2_accum_bytes``), ``optimizer_state_bytes`` and
``saved_bytes_peak`` (the peak of bytes saved for backward, from saved-tensor hooks).
Planned: ``glm5_train.plan.pipeline.plan_report`` for the job's layout; a global rank's
pipeline rank is rank // (world / PP), megatron-core's default order "tp-cp-ep-dp-pp".

How close each must be (``problems``):
- parameters: exactly; likewise INT4 QAT's quantised expert copies (``int4_qat_buffer_bytes``);
- gradients and optimizer state (AdamW; not where ``traffic.frozen_parameters``: a frozen
  indexer is modelled, the dense warm-up's and RL's frozen MTP are not; with
  ``parallel.optimizer_cpu_offload`` at fraction 0 or 1 also the host-resident state,
  ``optimizer_host_bytes``): within
  STATE_RTOL; the planner leaves out megatron-core's padding (distributed optimizer: buckets
  to a multiple of lcm(DP, 128) elements, parameter starts 64-aligned), the 4-byte Adam step
  counter per tensor and ZeRO2's pinned embedding-gradient copies. Muon's state likewise
  (momentum on its matrices, AdamW's moments on the rest, fp32 masters with bf16), except
  with distributed Muon over DP > 1 ranks: AdamW's share of a rank's slice depends on where
  megatron-core's slices cut the buffers (the planner gives each rank an even share of both
  kinds), and under its owners (``train.muon_zero_redundant``) a matrix's state is on one
  rank, balanced by Newton-Schulz cost, not bytes. There the total over each pipeline
  stage's ranks must be within STATE_RTOL and each rank within UNEVEN_STATE_RTOL (measured
  up to 16% on the parity layouts);
- activations: within ACTIVATION_RTOL per rank. Where experts are split over expert-parallel
  ranks, the tokens a rank's experts receive depend on the router and the data (the planner
  assumes even routing; the group's total is exact), so there the mean over each pipeline
  stage's ranks must be within ACTIVATION_RTOL and each rank within ROUTED_RTOL. Not under
  head-parallel context parallelism, whose exchange the planner does not model.

Bytes sent per step (``comm_by_group``: the meter's counts by megatron-core group name), where
the planner models them (``traffic_fields``):
- ``grad_reduction``: the gradients' reduction over the data-parallel group (dense) and the
  expert-data-parallel group (experts): all-reduce, 2 (n-1)/n of the gradient bytes, or with
  the distributed optimizer reduce-scatter, (n-1)/n; plus the step's token count (an int32
  all-reduced over DP x CP). Exact for plain DDP; within STATE_RTOL with the distributed
  optimizer (its buckets are padded). Pipeline ZeRO2 reduce-scatters each chunk once per
  group of consecutive micro-batches (once with one chunk per rank), its gradients without
  data-parallel peers not at all, and all-reduces its pinned embedding copies
  (``glm5_train.plan.traffic._zero2_reduction_bytes``): within STATE_RTOL (measured <= 0.08%);
- ``param_gather``: the distributed optimizer's all-gather of the updated parameters, (n-1)/n
  of the parameter bytes; twice with experts split over expert-parallel ranks (megatron-core
  chains an expert optimizer, and each optimizer's step gathers every bucket); within
  STATE_RTOL;
- ``p2p``: the pipeline's sends, exactly: per micro-batch a virtual stage's output forward
  (unless it is the last) and its input's gradient backward (unless it is the first), each
  the hidden states of this rank's tokens, (1 + MTP steps) times as many from the MTP stage
  on when the MTP layer has a stage of its own (whose shapes then travel first: three int64).
- ``tensor_parallel``: every op on the ``tp`` group (glm5_train/plan/tensor_parallel_comm.py:
  the layers' sequence-parallel gathers and reduce-scatters, the KL's and the loss chunks'
  all-reduces, finalize's all-reduce of the replicated gradients, Muon's gathers of its
  TP-split matrices), exactly; under Pipeline ZeRO2, which all-reduces only a data-parallel
  rank's slice of those gradients, each rank within ZERO2_SLICE_RTOL of an even share, and
  under distributed Muon, whose owners alone gather a matrix, within MUON_OWNER_RTOL; there
  each pipeline stage's mean exactly;
- ``expert_tensor_parallel``: every op on ``expt_tp`` and ``tp_ep`` (the routed experts'
  rows, probabilities and combine, the per-expert token counts), exactly, except where experts
  are split over EP and expert-TP ranks (``padded_expert_gathers``): within ROUTED_RTOL;
- ``expert_all_to_all``: the token dispatcher's all-to-alls over ``ep`` (tokens to their
  experts and back, and the gradients the reverse way), planned as if the router spread every
  rank's rows evenly over the EP ranks: a rank's bytes follow the router (measured up to 28%
  off on a trained tiny model), so the mean over each pipeline stage's ranks is checked,
  within ROUTED_RTOL;
- ``expert_all_to_all_payload``: the bytes handed to those all-to-alls, a rank's own experts'
  rows included (the meter's ``payload_bytes``): their mean over each pipeline stage's ranks
  exactly (every row dispatched is received once), and each rank at least the half that is
  its own dispatched rows (the other half, what its experts receive, follows the router).
Not modelled: distributed Muon's gradient traffic (its pieces travel to their owners),
tensor-parallel traffic where ``traffic.tensor_parallel_unmodelled`` says why, and the pipeline's
sends under context parallelism (the MTP inputs' roll shares their group).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from glm5_train.job_config import JobConfig
from glm5_train.plan.inputs import inputs_from_job, planned_cp_comm
from glm5_train.plan.pipeline import job_pipeline, plan_report
from glm5_train.plan.traffic import (
    frozen_parameters,
    planned_traffic,
    routed_over_expert_ranks,
    traffic_modelled,
)
from parallel.pipeline_layout import zero2_accum_bytes

STATE_RTOL = 5e-3
ACTIVATION_RTOL = 0.05
ROUTED_RTOL = 0.25
UNEVEN_STATE_RTOL = 0.25
# Pipeline ZeRO2 all-reduces over TP only the replicated gradients' slice a data-parallel rank
# owns, cut where megatron-core's buffers cut (measured 0.7% of a rank's TP bytes off the even
# share on TP2 x DP2); the stage's total is exact up to the all-reduce's integer rounding.
ZERO2_SLICE_RTOL = 0.02
# Distributed Muon gathers a TP-split matrix on its owner's TP ranks only; the owners are
# balanced by Newton-Schulz cost, so a rank's share of the gathers is uneven (planned even).
MUON_OWNER_RTOL = 0.05
EXACT_MEAN_RTOL = 1e-6

FIELDS = ("param", "grad", "optimizer", "activations")
TRAFFIC = ("grad_reduction", "param_gather", "p2p", "tensor_parallel", "expert_tensor_parallel",
           "expert_all_to_all", "expert_all_to_all_payload")
# megatron-core's names of the groups the gradients reduce over (dense, experts).
DATA_PARALLEL_GROUPS = ("dp_cp", "intra_dp_cp", "dp", "expt_dp", "intra_expt_dp")
# Every op on these groups (parallel.comm_meter names): the tensor-parallel group, and the
# expert-tensor-parallel group with the TP x EP group the dispatcher gathers its counts over.
TENSOR_GROUPS = ("tp",)
EXPERT_TENSOR_GROUPS = ("expt_tp", "tp_ep")
EXPERT_PARALLEL_GROUP = "ep"  # the token dispatcher's all-to-alls


@dataclass(frozen=True)
class RankBytes:
    """One field of one global rank: planned beside measured."""

    rank: int
    pipeline_rank: int
    field: str
    planned: int
    measured: int

    @property
    def rel(self) -> float:
        if not self.planned:
            return float(self.measured != 0)
        return abs(self.measured - self.planned) / self.planned


def compared_fields(job: JobConfig) -> tuple[str, ...]:
    fields = _state_fields(job)
    if job.train.int4_qat:
        fields = (*fields, "int4_qat_buffer")
    par = job.parallel
    # The planner prices context parallelism's all-gather exchange; head-parallel CP's
    # all-to-all buffers saved for backward are not modelled (measured 7-9% off).
    if par.context_parallel_size > 1 and planned_cp_comm(job) == "head_parallel":
        return tuple(f for f in fields if f != "activations")
    return fields


def _state_fields(job: JobConfig) -> tuple[str, ...]:
    if frozen_parameters(job):
        return ("param", "activations")
    par = job.parallel
    if par.optimizer_cpu_offload:
        # The offloaded share is whole parameters (the first ones until the fraction is
        # reached), so the split is exact only at the ends.
        if par.optimizer_offload_fraction not in (0.0, 1.0):
            return ("param", "grad", "activations")
        return (*FIELDS, "optimizer_host")
    return FIELDS


@dataclass(frozen=True)
class _Plan:
    """The planner's view of a finished run: its inputs, pipeline layout and report."""

    world: int
    inputs: object
    layout: object
    report: object


def _plan(job: JobConfig, record: dict) -> _Plan:
    world = len(record["param_bytes"])
    dp = world // job.parallel.model_parallel_size
    inputs, layout = inputs_from_job(job, dp), job_pipeline(job, dp)
    return _Plan(world, inputs, layout, plan_report(job.model, layout, inputs, job.activations))


def rank_bytes(job: JobConfig, record: dict, plan: _Plan | None = None) -> list[RankBytes]:
    """Planned and measured bytes per global rank for the fields ``compared_fields`` names
    (``plan``: ``_plan(job, record)``, made here when not given)."""
    plan = plan or _plan(job, record)
    world, report = plan.world, plan.report
    par = job.parallel
    pp = par.pipeline_model_parallel_size

    def stage_sum(p: int, field: str) -> int:
        return sum(getattr(s.costs, field) for s in report.stages if s.rank == p)

    zero2 = par.pipeline_zero2 and not frozen_parameters(job)
    rows = []
    for g in range(world):
        p = g // (world // pp)
        planned_grad, measured_grad = stage_sum(p, "grad_bytes"), record["grad_buffer_bytes"][g]
        if zero2:  # its slices plus its accumulation buffers
            planned_grad += zero2_accum_bytes(
                [s.costs for s in report.stages if s.rank == p])
            measured_grad = record["zero2_slice_bytes"][g] + record["zero2_accum_bytes"][g]
        values = {
            "param": (stage_sum(p, "param_bytes"), record["param_bytes"][g]),
            "grad": (planned_grad, measured_grad),
            "optimizer": (stage_sum(p, "optimizer_bytes"), record["optimizer_state_bytes"][g]),
            "activations": (report.ranks[p].peak_activation_bytes,
                            record["saved_bytes_peak"][g]),
            "optimizer_host": (stage_sum(p, "host_bytes"),
                               record.get("optimizer_host_bytes", [0] * world)[g]),
            "int4_qat_buffer": (stage_sum(p, "buffer_bytes"),
                                record.get("int4_qat_buffer_bytes", [0] * world)[g]),
        }
        rows += [RankBytes(g, p, name, *values[name]) for name in compared_fields(job)]
    return rows


def traffic_fields(job: JobConfig) -> tuple[str, ...]:
    """The per-step traffic compared: what the planner models (``traffic.
    traffic_modelled``) less the pipeline's sends under context parallelism, whose group the
    MTP inputs' roll shares (the meter's counts cannot tell them apart)."""
    par = job.parallel
    shared = par.context_parallel_size > 1 or par.cp_groups == "flexible"
    return tuple(f for f in traffic_modelled(job) if not (f == "p2p" and shared))


def traffic_rows(job: JobConfig, record: dict, plan: _Plan | None = None) -> list[RankBytes]:
    """Planned and measured bytes sent per step, per global rank, for ``traffic_fields``."""
    fields = traffic_fields(job)
    if not fields:
        return []
    plan = plan or _plan(job, record)
    world, inputs, layout, report = plan.world, plan.inputs, plan.layout, plan.report
    pp = job.parallel.pipeline_model_parallel_size
    by_group = record.get("comm_by_group", {})

    def sent(op: str, groups: tuple[str, ...], g: int) -> int:
        return sum(by_group.get(f"{op}:{name}", {}).get("bytes", [0] * world)[g]
                   for name in groups)

    def handed(op: str, group: str, g: int) -> int:
        return by_group.get(f"{op}:{group}", {}).get("payload_bytes", [0] * world)[g]

    def sent_on(groups: tuple[str, ...], g: int) -> int:
        return sum(entry["bytes"][g] for key, entry in by_group.items()
                   if key.split(":", 1)[1] in groups)

    rows = []
    for g in range(world):
        p = g // (world // pp)
        stages = [s for s in report.stages if s.rank == p]
        planned = planned_traffic(job, inputs, layout, stages, p)
        measured = {
            "grad_reduction": (sent("reduce_scatter", DATA_PARALLEL_GROUPS, g)
                               + sent("all_reduce", DATA_PARALLEL_GROUPS, g)),
            "param_gather": sent("all_gather", DATA_PARALLEL_GROUPS, g),
            "p2p": sent("send", ("pp", "world"), g),
            "tensor_parallel": sent_on(TENSOR_GROUPS, g),
            "expert_tensor_parallel": sent_on(EXPERT_TENSOR_GROUPS, g),
            "expert_all_to_all": sent("all_to_all", (EXPERT_PARALLEL_GROUP,), g),
            "expert_all_to_all_payload": handed("all_to_all", EXPERT_PARALLEL_GROUP, g),
        }
        rows += [RankBytes(g, p, name, planned[name], measured[name]) for name in fields]
    return rows


def comparison_rows(job: JobConfig, record: dict) -> list[RankBytes]:
    """``rank_bytes`` and ``traffic_rows`` from one plan of the run."""
    plan = _plan(job, record)
    return rank_bytes(job, record, plan) + traffic_rows(job, record, plan)


def problems(job: JobConfig, record: dict) -> list[str]:
    """What disagrees beyond the tolerances of the module docstring, one line each."""
    plan = _plan(job, record)
    rows = rank_bytes(job, record, plan) + traffic_rows(job, record, plan)
    padded = STATE_RTOL if job.parallel.use_distributed_optimizer else 0.0
    tolerance = {"param": 0.0, "int4_qat_buffer": 0.0, "grad": STATE_RTOL, "optimizer": STATE_RTOL,
                 "optimizer_host": STATE_RTOL,
                 "activations": ROUTED_RTOL if routed_over_expert_ranks(job) else ACTIVATION_RTOL,
                 "grad_reduction": padded, "param_gather": STATE_RTOL, "p2p": 0.0,
                 "tensor_parallel": tensor_parallel_rtol(plan.inputs),
                 "expert_tensor_parallel": ROUTED_RTOL if padded_expert_gathers(plan.inputs, job)
                 else 0.0,
                 # per rank, these follow the router: bounded below, checked as stage means
                 "expert_all_to_all": math.inf, "expert_all_to_all_payload": math.inf}
    uneven = muon_state_uneven(plan.inputs)
    if uneven:
        tolerance["optimizer"] = UNEVEN_STATE_RTOL
    found = [f"rank {r.rank} {r.field}: measured {r.measured:,} vs planned {r.planned:,} "
             f"({r.rel:.2%}, beyond {tolerance[r.field]:.2%})"
             for r in rows if r.rel > tolerance[r.field]]
    if routed_over_expert_ranks(job):
        found += _stage_mean_problems(rows, "activations", ACTIVATION_RTOL)
    if uneven:
        found += _stage_mean_problems(rows, "optimizer", STATE_RTOL)
    if tensor_parallel_rtol(plan.inputs):
        found += _stage_mean_problems(rows, "tensor_parallel", EXACT_MEAN_RTOL)
    found += _stage_mean_problems(rows, "expert_all_to_all_payload", EXACT_MEAN_RTOL)
    found += _stage_mean_problems(rows, "expert_all_to_all", ROUTED_RTOL)
    found += _dispatch_floor_problems(rows)
    return found


def _dispatch_floor_problems(rows: list[RankBytes]) -> list[str]:
    """Half of a rank's planned all-to-all payload is its own: the rows it dispatches (and
    their gradients, which come back); what its experts receive, the other half under even
    routing, may be anything from none to the whole EP group's. A rank handing over less than
    its own half has lost a dispatch."""
    return [f"rank {r.rank} expert_all_to_all_payload: measured {r.measured:,}, less than the "
            f"{r.planned // 2:,} its own dispatched rows take"
            for r in rows if r.field == "expert_all_to_all_payload" and r.measured < r.planned // 2]


def tensor_parallel_rtol(inputs) -> float:
    """Per rank: exact, except where a data-parallel rank's share is uneven (module
    docstring: Pipeline ZeRO2's replicated-gradient slices, distributed Muon's owners)."""
    if inputs.muon == "owners" and inputs.dp * inputs.cp > 1:
        return MUON_OWNER_RTOL
    return ZERO2_SLICE_RTOL if inputs.shard_grads else 0.0


def padded_expert_gathers(inputs, job: JobConfig) -> bool:
    """Experts split over EP and expert-TP ranks: each rank's dispatched rows follow the
    routing, and on gloo the device layer pads the expert-TP group's uneven all-gathers and
    reduce-scatters to its largest part (parallel/device.py), which the meter counts."""
    return routed_over_expert_ranks(job) and inputs.expert_tp > 1


def muon_state_uneven(inputs) -> bool:
    """Distributed Muon over several data-parallel ranks (the plan's ``MemoryInputs``): its
    state per rank is uneven where the planner's is even (module docstring)."""
    return inputs.muon in ("owners", "naive") and inputs.dp * inputs.cp > 1


def _stage_mean_problems(rows: list[RankBytes], field: str, rtol: float) -> list[str]:
    """``field``'s mean over each pipeline stage's ranks against the planned mean."""
    rows = [r for r in rows if r.field == field]
    found = []
    for p in sorted({r.pipeline_rank for r in rows}):
        stage = [r for r in rows if r.pipeline_rank == p]
        planned = sum(r.planned for r in stage) / len(stage)
        measured = sum(r.measured for r in stage) / len(stage)
        rel = abs(measured - planned) / planned if planned else float(measured != 0)
        if rel > rtol:
            found.append(f"pipeline rank {p} {field}, mean over its {len(stage)} ranks: "
                         f"measured {measured:,.0f} vs planned {planned:,.0f} ({rel:.2%}, "
                         f"beyond {rtol:.2%})")
    return found


def worst_by_field(rows: list[RankBytes]) -> dict[str, float]:
    """The largest relative difference per field over the ranks."""
    worst: dict[str, float] = {}
    for r in rows:
        worst[r.field] = max(worst.get(r.field, 0.0), r.rel)
    return worst
