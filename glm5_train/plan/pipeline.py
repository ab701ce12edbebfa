"""GLM-5's pipeline plans: a given layout checked, a balanced one for an MTP placement, and the
per-stage / per-rank memory report, from GLM-5's closed-form stage costs
(``glm5_train.plan.stage_model``) and the model-agnostic layouts, schedule replay and balancer
of ``parallel.pipeline_layout``.

The memory model is closed-form: parameters from ``glm5_train.plan.param_count``'s formula,
sharded as our model shards them; activations per micro-batch tensor by tensor as our
implementation saves them for backward (``glm5_train.plan.activations``, checked against a
measured forward in ``tests/test_pipeline_plan.py``); and the activations in flight from a
replay of megatron-core's (interleaved) 1F1B order per rank. Each rank's report also carries the
bytes it sends per micro-batch on its CP group, its tensor-parallel groups and its EP group
(``RankReport.comm_bytes``; the per-step traffic by kind: ``glm5_train.plan.traffic``).
``job_plan`` plans a composed job as it would run; ``resolve_pipeline_layout`` is the layout
the training job runs with; ``recompute_working_set_bytes`` is what recompute re-creates for one
layer on top of a rank's peak.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from glm5_train.activation_config import ActivationsConfig
from glm5_train.job_config import JobConfig
from glm5_train.model.config import GLM5Config
from glm5_train.plan.activations import (
    checkpoint_leaf_bytes,
    decoder_layer_activation_bytes,
    mtp_step_activation_bytes,
    selective_recompute_savings,
)
from glm5_train.plan.inputs import MemoryInputs, inputs_from_job, mtp_sets, mtp_steps
from glm5_train.plan.stage_model import GLM5StageModel
from parallel.pipeline_layout import (
    NO_MEMORY_LIMIT,
    OffloadSpec,
    PipelineLayout,
    PipelineSchedule,
    PlanReport,
    balance,
    layout_from_counts,
    mtp_stage_for,
    parse_layout,
    plan_for,
)
from parallel.recompute import Recompute


def plan_report(model_cfg: GLM5Config, layout: PipelineLayout, inputs: MemoryInputs,
                activations: ActivationsConfig | None = None) -> PlanReport:
    """Per-stage costs and per-rank memory (static + peak in-flight activations). With
    ``activations`` offloading (``offload_micro_batches`` > 0) the peak is what stays on the
    device and each rank reports the bytes it moves per step."""
    model = GLM5StageModel(model_cfg, inputs, len(layout.stages), layout.mtp_stage)
    schedule = PipelineSchedule(layout.pp, layout.vpp, inputs.num_microbatches,
                                inputs.microbatch_group)
    offload = None
    if activations is not None and activations.offload_micro_batches:
        offload = OffloadSpec(activations.offload_micro_batches, partial(
            offloaded_unit_bytes, model_cfg, layout, inputs, activations))
    return plan_for(model, layout, schedule, offload)


def offloaded_unit_bytes(cfg: GLM5Config, layout: PipelineLayout, inputs: MemoryInputs,
                         activations: ActivationsConfig, stage: int) -> list[int]:
    """Saved bytes per micro-batch that each offloaded layer call of ``stage`` moves to host,
    in forward order: a decoder layer's, an MTP step's (each of the MTP layer's calls). What
    something else keeps alive does not move: in fp32 a non-first stage's first layer (and
    its first MTP step) saves the received input itself, which megatron-core holds; under
    selective recompute autograd holds the output-discarding checkpoints' inputs
    (``checkpoint_leaf_bytes``)."""
    if inputs.dsa_stage == "dense_warmup":  # the grad-free forward keeps nothing to move
        return []
    first = sum(s.count("t") for s in layout.stages[:stage])
    held = inputs.activation_bytes * inputs.sp_tokens * cfg.hidden_size \
        if inputs.activation_bytes == 4 and stage > 0 else 0
    units = []
    for index in range(first, first + layout.stages[stage].count("t")):
        if activations.offloads_layer(index):
            moe = bool(cfg.moe_layer_pattern[index])
            units.append(decoder_layer_activation_bytes(cfg, moe, inputs)
                         - checkpoint_leaf_bytes(cfg, moe, inputs) - (held if index == first else 0))
    if stage == layout.mtp_stage and inputs.mtp_runs:
        for step in range(mtp_steps(cfg)):
            if activations.offloads_layer(cfg.num_hidden_layers + step % mtp_sets(cfg)):
                received = step == 0 and not layout.stages[stage].count("t")
                units.append(mtp_step_activation_bytes(cfg, inputs)
                             - checkpoint_leaf_bytes(cfg, True, inputs) - (held if received else 0))
    return units


def balance_layout(model_cfg: GLM5Config, pp: int, vpp: int | None, placement: str,
                   inputs: MemoryInputs, memory_limit_bytes: int | None = None) -> PipelineLayout:
    """GLM-5's layers balanced over PP x VPP stages for an MTP placement ('with_loss' or
    'split'; ignored without MTP): see ``parallel.pipeline_layout.balance``."""
    sets = mtp_sets(model_cfg)
    mtp_stage = mtp_stage_for(placement, pp, vpp, sets)
    model = GLM5StageModel(model_cfg, inputs, pp * (vpp or 1), mtp_stage)
    schedule = PipelineSchedule(pp, vpp, inputs.num_microbatches, inputs.microbatch_group)
    return balance(model, schedule, placement, sets, model_cfg.num_hidden_layers,
                   memory_limit_bytes)


def resolve_pipeline_layout(job: JobConfig, dp: int, **changes) -> str | None:
    """The layout string the job runs with: a given ``parallel.pipeline_model_parallel_layout``
    checked (LayoutError naming the rule), else with MTP and PP > 1 a balanced layout for
    ``parallel.mtp_placement``, else None (megatron-core's even split). ``changes``: to
    ``inputs_from_job`` (a plan for another machine, e.g. fused_attention=True)."""
    par, model = job.parallel, job.model
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    if par.pipeline_model_parallel_layout:
        return parse_layout(par.pipeline_model_parallel_layout, pp, vpp,
                            model.num_hidden_layers, mtp_sets(model)).to_string()
    if pp == 1 or not mtp_sets(model):
        return None
    limit = par.stage_memory_limit_gib
    limit_bytes = int(limit * 2**30) if limit is not None else NO_MEMORY_LIMIT
    return balance_layout(model, pp, vpp, par.mtp_placement, inputs_from_job(job, dp, **changes),
                          limit_bytes).to_string()


def job_pipeline(job: JobConfig, dp: int, **changes) -> PipelineLayout:
    """The stages the job runs: its resolved layout (given, or balanced for the MTP placement),
    else megatron-core's even split (PP=1: one stage holding everything)."""
    par, model = job.parallel, job.model
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    layers, sets = model.num_hidden_layers, mtp_sets(model)
    resolved = resolve_pipeline_layout(job, dp, **changes)
    if resolved:
        return parse_layout(resolved, pp, vpp, layers, sets)
    stages = pp * (vpp or 1)
    return layout_from_counts([layers // stages] * stages, pp, vpp,
                              stages - 1 if sets else None, sets)


def job_plan(job: JobConfig, dp: int, **changes) -> PlanReport:
    """The plan of the job as it would run: its stages (``job_pipeline``), its memory inputs
    and its activations settings (offloading included). ``changes`` as in
    ``resolve_pipeline_layout``."""
    inputs = inputs_from_job(job, dp, **changes)
    return plan_report(job.model, job_pipeline(job, dp, **changes), inputs, job.activations)


def recompute_working_set_bytes(model_cfg: GLM5Config, inputs: MemoryInputs) -> int:
    """What recompute re-creates for one layer at a time in backward, on top of the plan's
    resident bytes: under full recompute a whole layer's saved activations (the largest decoder
    layer's, or an MTP step's where those are recomputed), under selective recompute the
    largest layer's recomputed parts; 0 without recompute. Transient workspace inside a layer
    (one query chunk's gathered keys, one loss chunk's logits) is not counted."""
    rc = inputs.recompute
    kinds = sorted({bool(m) for m in model_cfg.moe_layer_pattern})
    if rc.full:
        raw = dataclasses.replace(inputs, recompute=Recompute())
        sizes = [decoder_layer_activation_bytes(model_cfg, moe, raw) for moe in kinds]
        if rc.mtp_steps_recomputed and mtp_steps(model_cfg) and inputs.mtp_runs:
            sizes.append(mtp_step_activation_bytes(model_cfg, raw))
        return max(sizes)
    if rc.granularity == "selective":
        return max(selective_recompute_savings(model_cfg, moe, inputs) for moe in kinds)
    return 0

