"""GLM-5's pipeline plans: a given layout checked, a balanced one for an MTP placement, and the
per-stage / per-rank memory report, from GLM-5's closed-form stage costs
(``glm5_train.model.stage_costs``) and the model-agnostic layouts, schedule replay and balancer
of ``parallel.pipeline_layout``.

The memory model is closed-form: parameters from ``glm5_train.model.param_count``'s formula,
sharded as our model shards them; activations per micro-batch tensor by tensor as our
implementation saves them for backward (checked against a measured forward in
``tests/test_pipeline_plan.py``); and the activations in flight from a replay of megatron-core's
(interleaved) 1F1B order per rank. Each rank's report also carries the bytes it sends per step
on its CP group, its tensor-parallel groups and its EP group (``RankReport.comm_bytes``; tests/
test_context_parallel_plan.py and glm5_train.plan_check check them against measured runs;
``context_parallel_sent`` is the CP part). ``job_plan`` plans a composed
job as it would run; ``recompute_working_set_bytes`` is what recompute re-creates for one layer
on top of a rank's peak.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from glm5_train.activation_config import ActivationsConfig
from glm5_train.model import tensor_parallel_comm
from glm5_train.model.config import GLM5Config
from glm5_train.model.stage_costs import (
    GLM5StageModel,
    MemoryInputs,
    checkpoint_leaf_bytes,
    decoder_layer_activation_bytes,
    final_norm_stage,
    inputs_from_job,
    mtp_sets,
    mtp_step_activation_bytes,
    mtp_steps,
    selective_recompute_savings,
)
from parallel.pipeline_layout import (
    NO_MEMORY_LIMIT,
    OffloadSpec,
    PipelineLayout,
    PipelineSchedule,
    PlanReport,
    balance,
    comm_of,
    comm_sum,
    comm_times,
    layout_from_counts,
    mtp_stage_for,
    parse_layout,
    plan_for,
)
from parallel.recompute import Recompute

__all__ = [
    "NO_MEMORY_LIMIT",
    "MemoryInputs",
    "PipelineLayout",
    "PipelineSchedule",
    "PlanReport",
    "balance_layout",
    "context_parallel_sent",
    "frozen_parameters",
    "inputs_from_job",
    "job_pipeline",
    "job_plan",
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
    if stage == layout.mtp_stage:
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


def resolve_pipeline_layout(job, dp: int, **changes) -> str | None:
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


def job_pipeline(job, dp: int, **changes) -> PipelineLayout:
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



def job_plan(job, dp: int, **changes) -> PlanReport:
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
        if rc.mtp_steps_recomputed and mtp_steps(model_cfg):
            sizes.append(mtp_step_activation_bytes(model_cfg, raw))
        return max(sizes)
    if rc.granularity == "selective":
        return max(selective_recompute_savings(model_cfg, moe, inputs) for moe in kinds)
    return 0


# finalize_model_grads all-reduces the step's token count (int32); a variable-shape p2p
# tensor's [s, b, h] travels first as three int64.
TOKEN_COUNT_BYTES = 4
SHAPE_MESSAGE_BYTES = 3 * 8


def frozen_parameters(job) -> bool:
    """The dense warm-up trains the indexer only: the rest has no gradient or optimizer state
    (the planner counts the whole model's)."""
    return job.dsa.stage == "dense_warmup" or job.dsa.freeze_indexer


def traffic_modelled(job) -> tuple[str, ...]:
    """The kinds of ``planned_traffic`` that hold for ``job``: the gradient reduction and the
    parameter all-gather not under distributed Muon (its pieces travel to their owners; plain
    Muon reduces its gradients as AdamW does), flexible CP groups or frozen parameters; the
    pipeline's sends with PP > 1; the tensor-parallel, expert-tensor-parallel and expert
    all-to-all exchanges where ``tensor_parallel_unmodelled`` gives no reason."""
    par = job.parallel
    fields = []
    distributed_muon = job.train.optimizer == "muon" and par.use_distributed_optimizer
    if not (frozen_parameters(job) or distributed_muon or par.cp_groups == "flexible"):
        fields.append("grad_reduction")
        if par.use_distributed_optimizer:
            fields.append("param_gather")
    if par.pipeline_model_parallel_size > 1:
        fields.append("p2p")
    if tensor_parallel_unmodelled(job) is None:
        if par.tensor_model_parallel_size > 1:
            fields.append("tensor_parallel")
        moe = any(job.model.moe_layer_pattern)
        if par.expert_tp * par.expert_model_parallel_size > 1 and moe:
            fields.append("expert_tensor_parallel")
        if par.expert_model_parallel_size > 1 and moe:
            fields += ["expert_all_to_all", "expert_all_to_all_payload"]
    return tuple(fields)


def tensor_parallel_unmodelled(job) -> str | None:
    """Why the planner does not model this job's tensor-parallel traffic (None: it does)."""
    par, dsa = job.parallel, job.dsa
    if par.cp_groups == "flexible":
        return "flexible context-parallel groups re-form per batch"
    return tensor_parallel_comm.unmodelled(
        job.model, dsa.stage, dsa.sparse_attention == "absorbed", job.train.seq_length,
        par.context_parallel_size, job.activations.recompute().granularity is not None)


def context_parallel_sent(rank) -> int:
    """Of a RankReport's planned bytes per step, context parallelism's (its exchange and the
    MTP rolls): all but the tensor-parallel and expert-parallel groups'."""
    others = (tensor_parallel_comm.TP_KEYS + tensor_parallel_comm.EXPERT_TP_KEYS
              + tensor_parallel_comm.EXPERT_PARALLEL_KEYS)
    return sum(sent for key, sent in rank.comm_bytes if key not in others)


def routed_over_expert_ranks(job) -> bool:
    """Routed experts split over several expert-parallel ranks (tokens per rank data-driven)."""
    return any(job.model.moe_layer_pattern) and job.parallel.expert_model_parallel_size > 1


def planned_traffic(job, inputs: MemoryInputs, layout: PipelineLayout, stages: list,
                    pipeline_rank: int) -> dict[str, int]:
    """Bytes one rank of ``pipeline_rank`` sends per step (its ``stages``: the report's
    StageReports of that rank), by kind: ``grad_reduction`` (the gradients' reduction over the
    data-parallel and expert-data-parallel groups, plus the step's token count),
    ``param_gather`` (the distributed optimizer's all-gather of the updated parameters),
    ``p2p`` (the pipeline's sends), ``tensor_parallel`` (the ``tp`` group's exchanges, per
    micro-batch from the stages' costs, plus finalize's all-reduce of the replicated gradients),
    ``expert_tensor_parallel`` (the ``expt_tp`` and ``tp_ep`` groups'), ``expert_all_to_all``
    (the token dispatcher's all-to-alls over ``ep``, the router spreading rows evenly) and
    ``expert_all_to_all_payload`` (the bytes handed to them, a rank's own rows included: not
    sent, but their mean over the EP group is fixed by the tokens). ``traffic_modelled``
    says which of them hold for a job; glm5_train.plan_check checks them against measured
    runs."""
    dense = sum(s.costs.dense_params for s in stages)
    expert = sum(s.costs.expert_params for s in stages)
    groups = ((inputs.dp * inputs.cp, dense), (inputs.expert_dp, expert))
    distributed = job.parallel.use_distributed_optimizer
    if job.parallel.pipeline_zero2:
        reduction = _zero2_reduction_bytes(job, inputs, layout, stages, pipeline_rank)
    else:
        reduction = sum(_reduction_bytes(n, inputs.grad_bytes * count, distributed)
                        for n, count in groups)
    reduction += 2 * (inputs.dp * inputs.cp - 1) * TOKEN_COUNT_BYTES // (inputs.dp * inputs.cp)
    # megatron-core chains a second distributed optimizer for expert-parallel parameters, and
    # each one's step all-gathers every bucket of the model chunks (dense and expert).
    optimizers = 2 if routed_over_expert_ranks(job) else 1
    gather = optimizers * sum((n - 1) * inputs.weight_bytes * count // n for n, count in groups)
    per_step = comm_sum(comm_times(comm_sum(*(s.costs.comm_bytes_per_microbatch for s in stages)),
                                   inputs.num_microbatches),
                        _tensor_parallel_step_comm(job, inputs, layout, pipeline_rank))
    tensor = sum(comm_of(per_step, key) for key in tensor_parallel_comm.TP_KEYS)
    all_to_all = comm_of(per_step, tensor_parallel_comm.EP_ALL_TO_ALL)
    return {"grad_reduction": reduction, "param_gather": gather,
            "p2p": _pipeline_send_bytes(job, inputs, layout, pipeline_rank),
            "tensor_parallel": tensor,
            "expert_tensor_parallel": sum(comm_of(per_step, key)
                                          for key in tensor_parallel_comm.EXPERT_TP_KEYS),
            "expert_all_to_all": all_to_all,
            # What the rank hands over, its own experts' rows included: sent x EP / (EP - 1).
            "expert_all_to_all_payload": (all_to_all * inputs.ep // (inputs.ep - 1)
                                          if inputs.ep > 1 else 0)}


def _tensor_parallel_step_comm(job, inputs: MemoryInputs, layout: PipelineLayout,
                               pipeline_rank: int):
    """What this pipeline rank sends on its TP groups once per step for the parameters it
    holds: finalize's all-reduce of the replicated gradients
    (``tensor_parallel_comm.grad_sync_bytes``) and Muon's gathers of its TP-split matrices
    (``tensor_parallel_comm.muon_gather_comm``)."""
    cfg = job.model
    final_norm = final_norm_stage(list(layout.layers_per_stage), layout.mtp_stage)
    moe_flags, mtp, holds_norm, layer = [], False, False, 0
    for stage, kinds in enumerate(layout.stages):
        mine = layout.rank_of(stage) == pipeline_rank
        for kind in kinds:
            if kind == "t":
                if mine:
                    moe_flags.append(layer >= cfg.first_k_dense_replace)
                layer += 1
        mtp |= mine and "m" in kinds
        holds_norm |= mine and stage == final_norm
    sync = tensor_parallel_comm.grad_sync_bytes(cfg, inputs, moe_flags, mtp, holds_norm)
    return comm_sum(((tensor_parallel_comm.TP_REDUCE, sync),),
                    tensor_parallel_comm.muon_gather_comm(cfg, inputs, moe_flags, mtp,
                                                          job.train.muon_split_mla))


def _zero2_reduction_bytes(job, inputs: MemoryInputs, layout: PipelineLayout, stages: list,
                           pipeline_rank: int) -> int:
    """Pipeline ZeRO2's gradient traffic on one rank (parallel/pipeline_zero2.py): each chunk
    is reduce-scattered once per group of consecutive micro-batches its backward runs (M / g
    groups with several chunks, g = microbatch_group_size_per_vp_stage or PP; once with one
    chunk), its gradients without data-parallel peers not at all; then every pinned embedding
    copy (several stages hold the word embedding: MTP on a stage of its own, a tied head) is
    all-reduced over the data-parallel group."""
    flushes = 1
    if len(stages) > 1:
        flushes = inputs.num_microbatches // (inputs.microbatch_group
                                              or job.parallel.pipeline_model_parallel_size)
    dense_ranks, sent = inputs.dp * inputs.cp, 0
    for stage in stages:
        for n, count in ((dense_ranks, stage.costs.dense_params),
                         (inputs.expert_dp, stage.costs.expert_params)):
            sent += flushes * _reduction_bytes(n, inputs.grad_bytes * count, True)
    last = len(layout.stages) - 1
    holders = {0} | ({layout.mtp_stage} if layout.mtp_stage is not None else set())
    holders |= {last} if job.model.tie_word_embeddings else set()
    if len(holders) > 1:
        copies = sum(1 for stage in holders if layout.rank_of(stage) == pipeline_rank)
        embedding = job.model.vocab_size * job.model.hidden_size // inputs.tp
        sent += copies * _reduction_bytes(dense_ranks, inputs.grad_bytes * embedding, False)
    return sent


def _reduction_bytes(n: int, grad_bytes: int, reduce_scatter: bool) -> int:
    if reduce_scatter:
        return (n - 1) * grad_bytes // n
    return 2 * (n - 1) * grad_bytes // n


def _pipeline_send_bytes(job, inputs, layout, pipeline_rank: int) -> int:
    """Bytes this pipeline rank sends per step: for each of its virtual stages and each
    micro-batch, the stage's output forward and its input's gradient backward."""
    unit = inputs.activation_bytes * inputs.sp_tokens * job.model.hidden_size
    last, mtp = len(layout.stages) - 1, layout.mtp_stage
    own_mtp_stage = mtp is not None and mtp != last
    widen = 1 + (job.model.mtp_num_steps if own_mtp_stage else 0)

    def out_units(stage: int) -> int:  # the MTP stage and after carry every MTP step too
        return widen if own_mtp_stage and stage >= mtp else 1

    sends = 0
    for stage in range(len(layout.stages)):
        if layout.rank_of(stage) != pipeline_rank:
            continue
        per_micro = []
        if stage < last:
            per_micro.append(out_units(stage) * unit)
        if stage > 0:
            per_micro.append(out_units(stage - 1) * unit)
        shapes = SHAPE_MESSAGE_BYTES * len(per_micro) if own_mtp_stage else 0
        sends += inputs.num_microbatches * (sum(per_micro) + shapes)
    return sends
