"""The planner: GLM-5's memory, compute and communication per pipeline stage and per rank, in
closed form, for a job as it would run, and checks of it against measured runs.

The public front for the job, launchers, tools, benchmarks and tests; the modules behind it:

- ``inputs``: ``MemoryInputs`` (parallel sizes, batch shape, bytes per value, training options)
  and ``inputs_from_job``, which builds them from a ``JobConfig``;
- ``param_count``: GLM-5's parameters in closed form, and grouped from a built model;
- ``activations``: the bytes each layer saves for backward (recompute and the DSA dense
  warm-up included);
- ``context_parallel_comm``, ``tensor_parallel_comm``: the bytes a rank sends per micro-batch
  on its context-parallel, tensor-parallel and expert-parallel groups;
- ``stage_model``: ``Part`` and ``GLM5StageModel``, a stage's costs (weights, gradients,
  optimizer state, activations, flops, bytes sent) for ``parallel.pipeline_layout``;
- ``pipeline``: plans of a layout or a job, the balanced layout, the layout the job runs;
- ``traffic``: the bytes a rank sends per step by kind;
- ``check``: the plan beside a finished run's measured bytes (``check.problems``);
- ``activation_tracker``: the running job's activation meter and offloader over the layers
  the plan offloads.

Layering (tests/test_layering.py): the planner belongs to the ``glm5_train`` layer and may use
``glm5_train.model``, ``glm5_train.job_config`` and ``parallel``; none of those import it. Its
modules import one another directly, never this front (no cycles).
"""

from glm5_train.plan.activation_tracker import build_activation_tracker, layer_modules
from glm5_train.plan.inputs import MemoryInputs, inputs_from_job, mtp_sets, mtp_steps
from glm5_train.plan.pipeline import (
    balance_layout,
    job_pipeline,
    job_plan,
    plan_report,
    recompute_working_set_bytes,
    resolve_pipeline_layout,
)
from glm5_train.plan.traffic import (
    context_parallel_sent,
    frozen_parameters,
    planned_traffic,
    routed_over_expert_ranks,
    tensor_parallel_unmodelled,
    traffic_modelled,
)
from parallel.pipeline_layout import (
    NO_MEMORY_LIMIT,
    PipelineLayout,
    PipelineSchedule,
    PlanReport,
    layout_from_counts,
    parse_layout,
)

__all__ = [
    "NO_MEMORY_LIMIT",
    "MemoryInputs",
    "PipelineLayout",
    "PipelineSchedule",
    "PlanReport",
    "balance_layout",
    "build_activation_tracker",
    "context_parallel_sent",
    "frozen_parameters",
    "inputs_from_job",
    "job_pipeline",
    "job_plan",
    "layer_modules",
    "layout_from_counts",
    "mtp_sets",
    "mtp_steps",
    "parse_layout",
    "plan_report",
    "planned_traffic",
    "recompute_working_set_bytes",
    "resolve_pipeline_layout",
    "routed_over_expert_ranks",
    "tensor_parallel_unmodelled",
    "traffic_modelled",
]
