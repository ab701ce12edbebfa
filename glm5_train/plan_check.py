"""The planner beside a finished step: per global rank, the planned and the measured
parameter, gradient, optimizer-state and saved-activation bytes, and whether they agree.

Measured (a ``metrics.jsonl`` record): ``param_bytes``, ``grad_buffer_bytes`` (Pipeline ZeRO2:
``zero2_slice_bytes`` + ``zero2_accum_bytes``), ``optimizer_state_bytes`` and
``saved_bytes_peak`` (the peak of bytes saved for backward, from saved-tensor hooks).
Planned: ``pipeline_plan.plan_report`` for the job's layout; a global rank's pipeline rank is
rank // (world / PP), megatron-core's default order "tp-cp-ep-dp-pp".

How close each must be (``problems``):
- parameters: exactly;
- gradients and optimizer state (AdamW, nothing frozen): within STATE_RTOL; the planner leaves
  out megatron-core's padding (distributed optimizer: buckets to a multiple of lcm(DP, 128)
  elements, parameter starts 64-aligned), the 4-byte Adam step counter per tensor and
  ZeRO2's pinned embedding-gradient copies. Muon's state (momentum on its matrices, AdamW on
  the rest, owned per matrix under the zero-redundant variant) is not modelled;
- activations: within ACTIVATION_RTOL per rank. Where experts are split over expert-parallel
  ranks, the tokens a rank's experts receive depend on the router and the data (the planner
  assumes even routing; the group's total is exact), so there the mean over each pipeline
  stage's ranks must be within ACTIVATION_RTOL and each rank within ROUTED_RTOL.
"""

from __future__ import annotations

from dataclasses import dataclass

from glm5_train.pipeline_plan import inputs_from_job, job_pipeline, plan_report

STATE_RTOL = 5e-3
ACTIVATION_RTOL = 0.05
ROUTED_RTOL = 0.25

FIELDS = ("param", "grad", "optimizer", "activations")


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


def frozen_parameters(job) -> bool:
    """The dense warm-up trains the indexer only: the rest has no gradient or optimizer state
    (the planner counts the whole model's)."""
    return job.dsa.stage == "dense_warmup" or job.dsa.freeze_indexer


def compared_fields(job) -> tuple[str, ...]:
    if frozen_parameters(job):
        return ("param", "activations")
    if job.train.optimizer == "muon":
        return ("param", "grad", "activations")
    return FIELDS


def rank_bytes(job, record: dict) -> list[RankBytes]:
    """Planned and measured bytes per global rank for the fields ``compared_fields`` names."""
    world = len(record["param_bytes"])
    par = job.parallel
    pp = par.pipeline_model_parallel_size
    dp = world // par.model_parallel_size
    report = plan_report(job.model, job_pipeline(job, dp), inputs_from_job(job, dp),
                         job.activations)

    def stage_sum(p: int, field: str) -> int:
        return sum(getattr(s.costs, field) for s in report.stages if s.rank == p)

    zero2 = par.pipeline_zero2 and not frozen_parameters(job)
    rows = []
    for g in range(world):
        p = g // (world // pp)
        planned_grad, measured_grad = stage_sum(p, "grad_bytes"), record["grad_buffer_bytes"][g]
        if zero2:  # its slices plus two accumulation buffers
            planned_grad += 2 * max(s.costs.accum_grad_bytes for s in report.stages
                                    if s.rank == p)
            measured_grad = record["zero2_slice_bytes"][g] + record["zero2_accum_bytes"][g]
        values = {
            "param": (stage_sum(p, "param_bytes"), record["param_bytes"][g]),
            "grad": (planned_grad, measured_grad),
            "optimizer": (stage_sum(p, "optimizer_bytes"), record["optimizer_state_bytes"][g]),
            "activations": (report.ranks[p].peak_activation_bytes,
                            record["saved_bytes_peak"][g]),
        }
        rows += [RankBytes(g, p, name, *values[name]) for name in compared_fields(job)]
    return rows


def routed_over_expert_ranks(job) -> bool:
    """Routed experts split over several expert-parallel ranks (tokens per rank data-driven)."""
    return any(job.model.moe_layer_pattern) and job.parallel.expert_model_parallel_size > 1


def problems(job, record: dict) -> list[str]:
    """What disagrees beyond the tolerances of the module docstring, one line each."""
    rows = rank_bytes(job, record)
    tolerance = {"param": 0.0, "grad": STATE_RTOL, "optimizer": STATE_RTOL,
                 "activations": ROUTED_RTOL if routed_over_expert_ranks(job) else ACTIVATION_RTOL}
    found = [f"rank {r.rank} {r.field}: measured {r.measured:,} vs planned {r.planned:,} "
             f"({r.rel:.2%}, beyond {tolerance[r.field]:.2%})"
             for r in rows if r.rel > tolerance[r.field]]
    if routed_over_expert_ranks(job):
        found += _stage_mean_problems([r for r in rows if r.field == "activations"])
    return found


def _stage_mean_problems(rows: list[RankBytes]) -> list[str]:
    found = []
    for p in sorted({r.pipeline_rank for r in rows}):
        stage = [r for r in rows if r.pipeline_rank == p]
        planned = sum(r.planned for r in stage) / len(stage)
        measured = sum(r.measured for r in stage) / len(stage)
        rel = abs(measured - planned) / planned if planned else float(measured != 0)
        if rel > ACTIVATION_RTOL:
            found.append(f"pipeline rank {p} activations, mean over its {len(stage)} ranks: "
                         f"measured {measured:,.0f} vs planned {planned:,.0f} ({rel:.2%}, "
                         f"beyond {ACTIVATION_RTOL:.0%})")
    return found


def worst_by_field(rows: list[RankBytes]) -> dict[str, float]:
    """The largest relative difference per field over the ranks."""
    worst: dict[str, float] = {}
    for r in rows:
        worst[r.field] = max(worst.get(r.field, 0.0), r.rel)
    return worst
