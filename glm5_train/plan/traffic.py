"""The bytes one rank sends per training step by kind, as the planner models them: the
gradients' reduction and the distributed optimizer's parameter gather over the data-parallel
groups (Pipeline ZeRO2's included), the pipeline's sends, and the per-micro-batch exchanges of
the stage costs (context-parallel, tensor-parallel, expert-parallel) summed over a step; which
kinds hold for a job (``traffic_modelled``), and why tensor-parallel traffic is not modelled
where it is not (``tensor_parallel_unmodelled``). ``glm5_train.plan.check`` compares them with
measured runs.
"""

from __future__ import annotations

from glm5_train.job_config import JobConfig
from glm5_train.plan import tensor_parallel_comm
from glm5_train.plan.inputs import MemoryInputs
from glm5_train.plan.stage_model import final_norm_stage
from parallel.pipeline_layout import PipelineLayout, comm_of, comm_sum, comm_times

# finalize_model_grads all-reduces the step's token count (int32); a variable-shape p2p
# tensor's [s, b, h] travels first as three int64.
TOKEN_COUNT_BYTES = 4
SHAPE_MESSAGE_BYTES = 3 * 8


def frozen_parameters(job: JobConfig) -> bool:
    """Frozen parameters the planner does not model: the dense warm-up trains the indexer
    only, (RL) frozen MTP layers train without their part; those have no gradient or
    optimizer state, but the planner counts the whole model's. A frozen indexer
    (dsa.freeze_indexer, dsa.stage=dense) is modelled (``MemoryInputs.frozen_indexer``)."""
    frozen_mtp = bool(job.model.mtp_sets) and not job.runs_mtp
    return job.dsa.stage == "dense_warmup" or frozen_mtp


def traffic_modelled(job: JobConfig) -> tuple[str, ...]:
    """The kinds of ``planned_traffic`` that hold for ``job``: the gradient reduction and the
    parameter all-gather not under distributed Muon (its pieces travel to their owners; plain
    Muon reduces its gradients as AdamW does), flexible CP groups or frozen parameters; the
    pipeline's sends with PP > 1; the tensor-parallel, expert-tensor-parallel and expert
    all-to-all exchanges where ``tensor_parallel_unmodelled`` gives no reason (the
    tensor-parallel ones not where ``dense_kl_follows_documents``)."""
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
        if par.tensor_model_parallel_size > 1 and not dense_kl_follows_documents(job):
            fields.append("tensor_parallel")
        moe = any(job.model.moe_layer_pattern)
        if par.expert_tp * par.expert_model_parallel_size > 1 and moe:
            fields.append("expert_tensor_parallel")
        if par.expert_model_parallel_size > 1 and moe:
            fields += ["expert_all_to_all", "expert_all_to_all_payload"]
    return tuple(fields)


def dense_kl_follows_documents(job: JobConfig) -> bool:
    """The dense warm-up on packed documents: its KL's chunks start at their rows' earliest
    document, so its TP all-reduces are smaller than the planner's one-document figure (an
    upper bound, not checked exactly)."""
    packed = job.data.reset_attention_mask or job.data.format == "chat_sft"
    return job.dsa.stage == "dense_warmup" and packed


def tensor_parallel_unmodelled(job: JobConfig) -> str | None:
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


def routed_over_expert_ranks(job: JobConfig) -> bool:
    """Routed experts split over several expert-parallel ranks (tokens per rank data-driven)."""
    return any(job.model.moe_layer_pattern) and job.parallel.expert_model_parallel_size > 1


def planned_traffic(job: JobConfig, inputs: MemoryInputs, layout: PipelineLayout,
                    stages: list, pipeline_rank: int) -> dict[str, int]:
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
    says which of them hold for a job; glm5_train.plan.check checks them against measured
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
    optimizers = gathers_per_bucket(job, job.parallel.overlap_param_gather)
    gather = optimizers * sum((n - 1) * inputs.weight_bytes * count // n for n, count in groups)
    per_step = comm_sum(comm_times(comm_sum(*(s.costs.comm_bytes_per_microbatch for s in stages)),
                                   inputs.num_microbatches),
                        tensor_parallel_step_comm(job, inputs, layout, pipeline_rank))
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


def gathers_per_bucket(job: JobConfig, overlapped: bool) -> int:
    """How often a step all-gathers each parameter bucket: megatron-core chains a second
    distributed optimizer for expert-parallel parameters, and each one's step gathers every
    bucket of the model chunks (dense and expert); under ``overlap_param_gather`` the steps
    gather nothing and the next forward's hooks gather each bucket once."""
    return 2 if routed_over_expert_ranks(job) and not overlapped else 1


def tensor_parallel_step_comm(job: JobConfig, inputs: MemoryInputs, layout: PipelineLayout,
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
        mtp |= mine and "m" in kinds and job.runs_mtp  # frozen (RL): no gradient to sync
        holds_norm |= mine and stage == final_norm
    sync = tensor_parallel_comm.grad_sync_bytes(cfg, inputs, moe_flags, mtp, holds_norm)
    return comm_sum(((tensor_parallel_comm.TP_REDUCE, sync),),
                    tensor_parallel_comm.muon_gather_comm(cfg, inputs, moe_flags, mtp,
                                                          job.train.muon_split_mla))


def _zero2_reduction_bytes(job: JobConfig, inputs: MemoryInputs, layout: PipelineLayout,
                           stages: list, pipeline_rank: int) -> int:
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


def _pipeline_send_bytes(job: JobConfig, inputs: MemoryInputs, layout: PipelineLayout,
                         pipeline_rank: int) -> int:
    """Bytes this pipeline rank sends per step: for each of its virtual stages and each
    micro-batch, the stage's output forward and its input's gradient backward."""
    own_mtp_stage = layout.mtp_stage is not None and layout.mtp_stage != len(layout.stages) - 1
    sends = 0
    for stage in range(len(layout.stages)):
        if layout.rank_of(stage) != pipeline_rank:
            continue
        per_micro = [sent for sent in stage_sends(job, inputs, layout, stage) if sent]
        shapes = SHAPE_MESSAGE_BYTES * len(per_micro) if own_mtp_stage else 0
        sends += inputs.num_microbatches * (sum(per_micro) + shapes)
    return sends


def stage_sends(job: JobConfig, inputs: MemoryInputs, layout: PipelineLayout,
                stage: int) -> tuple[int, int]:
    """Bytes one micro-batch of ``stage`` sends to the next stage after its forward and to
    the previous one after its backward (0 where there is none). The MTP stage's output and
    every stage's after it carry each MTP step too (MTP on a stage of its own)."""
    unit = inputs.activation_bytes * inputs.sp_tokens * job.model.hidden_size
    last, mtp = len(layout.stages) - 1, layout.mtp_stage
    own_mtp_stage = mtp is not None and mtp != last
    widen = 1 + (job.model.mtp_num_steps if own_mtp_stage else 0)

    def out_units(s: int) -> int:
        return widen if own_mtp_stage and s >= mtp else 1

    forward = out_units(stage) * unit if stage < last else 0
    backward = out_units(stage - 1) * unit if stage > 0 else 0
    return forward, backward
