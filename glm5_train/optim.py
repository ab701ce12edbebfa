"""megatron-core DDP, optimizer (AdamW) and learning-rate schedule (``glm5_train.schedules``)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.transformer_config import TransformerConfig

from glm5_train.schedules import build_lr_scheduler
from parallel import mcore_compat
from parallel.deferred_wgrad import drain_first
from parallel.distopt_slices import drain_gathers, mark_gathers
from parallel.host_optimizer import provide_init_state
from parallel.pipeline_zero2 import finalize_zero2_grads

if TYPE_CHECKING:
    from glm5_train.job_config import TrainConfig
    from parallel.layout import ParallelConfig


def wrap_ddp(chunks: list[torch.nn.Module], config: TransformerConfig,
             use_distributed_optimizer: bool, overlap_grad_reduce: bool, zero2=None,
             pinned: list | None = None, bucket_size: int | None = None,
             overlap_param_gather: bool = False) -> list:
    """Wrap each chunk in megatron-core's DDP (contiguous fp32 grad buffers). With Pipeline
    ZeRO2 (``zero2``) each chunk's full buffer is handed over right after its wrapping, so at
    most one exists at a time; ``pinned`` parameters keep a full gradient of their own.
    ``bucket_size``: parameters per bucket under overlap (None: megatron-core's default,
    max(40M, 1M x DP)). ``overlap_param_gather``: the optimizer step leaves the parameter
    all-gather to the next forward's hooks (each chunk's, in the schedule's order when there
    are several: ``attach_schedule_hooks``)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=bucket_size if overlap_grad_reduce else None,
        overlap_param_gather=overlap_param_gather,
        align_param_gather=overlap_param_gather and len(chunks) > 1,
    )
    wrapped = []
    for index, chunk in enumerate(chunks):
        # Only the first chunk may skip bucketing; megatron's rule for overlapped grad reduce.
        wrapped.append(DistributedDataParallel(config=config, ddp_config=ddp_config,
                                               module=chunk, disable_bucketing=index > 0))
        if zero2 is not None:
            mine = {id(p) for p in chunk.parameters()}
            zero2.adopt(wrapped[-1], [p for p in pinned or [] if id(p) in mine])
        mark_gathers(wrapped[-1])
    return wrapped


def attach_schedule_hooks(chunks: list, config: TransformerConfig, optimizer, groups,
                          embedding_tie=None, zero2=None, wgrad=None) -> None:
    """Tell the pipeline schedules how to sync and finalise grads (megatron-core's contract).
    ``groups``: this rank's ProcessGroupCollection, handed to megatron-core's finalize.
    ``wgrad``: a ``WeightGradQueue`` whose deferred GEMMs must run before gradients are
    finalised."""
    config.grad_scale_func = optimizer.scale_loss
    if zero2 is not None:
        config.finalize_model_grads_func = partial(finalize_zero2_grads, zero2=zero2,
                                                   groups=groups, embedding_tie=embedding_tie)
    else:
        config.finalize_model_grads_func = partial(finalize_grads, groups=groups,
                                                   embedding_tie=embedding_tie)
    if wgrad is not None:
        config.finalize_model_grads_func = drain_first(wgrad, config.finalize_model_grads_func)
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    if chunks[0].ddp_config.overlap_grad_reduce:
        config.grad_sync_func = ([c.start_grad_sync for c in chunks] if len(chunks) > 1
                                 else chunks[0].start_grad_sync)
    if chunks[0].ddp_config.align_param_gather:  # the schedule starts each chunk's gather
        config.param_sync_func = [c.start_param_sync for c in chunks]


def finalize_grads(model: list, num_tokens, pg_collection=None, force_all_reduce=False, *,
                   groups, embedding_tie):
    """megatron-core's ``finalize_model_grads``, with the word-embedding copies summed by our
    ``EmbeddingTie`` (megatron's own embedding group holds the first stage only, see
    ``parallel.process_groups.first_stage_only``).

    Without overlap the copies are summed first, on whole local gradients. With
    ``overlap_grad_reduce`` a copy's bucket may already be reducing while the last backward
    runs, so the sum waits until finalize has reduced and scaled every gradient: both steps
    are linear and the same for every copy, so the order does not change the result. Under the
    distributed optimizer only this rank's shard of each bucket is reduced then; each copy
    sits alone in its bucket (``check_tie_buckets``), so the shards of all copies cover the same
    elements and the sum is right where the optimizer reads it."""
    drain_gathers(model)
    tie_after = embedding_tie is not None and model[0].ddp_config.overlap_grad_reduce
    if embedding_tie is not None and not tie_after:
        embedding_tie.sync(model)
    finalize_model_grads(model, num_tokens, pg_collection=pg_collection or groups,
                         force_all_reduce=force_all_reduce)
    if tie_after:
        embedding_tie.sync(model)


def build_optimizer(chunks: list, cfg: "TrainConfig", use_distributed_optimizer: bool,
                    params_dtype: torch.dtype, offload: ParallelConfig | None = None):
    """AdamW over all chunks (megatron-core splits dense and expert parameters itself).
    ``offload`` with ``optimizer_cpu_offload``: megatron-core's hybrid optimizer keeps that
    share of the state in host memory (``parallel.host_optimizer``); its CPU AdamW is torch's
    fused one (``fused=True``, megatron-core's default there)."""
    host = offload is not None and offload.optimizer_cpu_offload
    if host:
        mcore_compat.install_host_optimizer()
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        bf16=params_dtype == torch.bfloat16,
        params_dtype=params_dtype,
        use_distributed_optimizer=use_distributed_optimizer,
        # megatron-core's step skips its own gather when the DDP config says so; the two agree
        overlap_param_gather=chunks[0].ddp_config.overlap_param_gather,
        optimizer_cpu_offload=host,
        optimizer_offload_fraction=offload.optimizer_offload_fraction if host else 0.0,
        overlap_cpu_optimizer_d2h_h2d=host and offload.overlap_cpu_optimizer_d2h_h2d,
        # Pinned host buffers need CUDA.
        pin_cpu_grads=torch.cuda.is_available(), pin_cpu_params=torch.cuda.is_available(),
    )
    if host and params_dtype != torch.float32:
        precision_aware(opt_config)
    optimizer = get_megatron_optimizer(opt_config, chunks)
    if host:
        provide_init_state(optimizer)
    return optimizer


def precision_aware(opt_config: OptimizerConfig) -> None:
    """megatron-core's precision-aware path, as its ``--optimizer-cpu-offload`` runs bf16: the
    distributed optimizer hands the hybrid optimizer its bf16 slices and makes no fp32 master
    slices on the device; the hybrid optimizer keeps each slice's fp32 master beside its moments
    (in host memory when offloaded). Set after construction: ``OptimizerConfig.__post_init__``
    compares Transformer Engine's version for this flag and raises TypeError when TE is absent,
    though the hybrid optimizer needs none of TE (the same ``__post_init__`` skips its TE checks
    under ``optimizer_cpu_offload``); it would then derive the two fields set here (no fp8, so
    the flag holds as given; param remainders are a TE FusedAdam feature)."""
    opt_config.use_precision_aware_optimizer = True
    opt_config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    opt_config.store_param_remainders = False


def build_scheduler(optimizer, cfg: "TrainConfig", train_iters: int) -> OptimizerParamScheduler:
    """``train.lr_decay_style`` after the warm-up (``glm5_train.schedules``), counted in
    optimizer steps; the decay ends at ``train.lr_decay_iters`` or the run's last step."""
    return build_lr_scheduler(
        optimizer, lr=cfg.lr, min_lr=cfg.min_lr, init_lr=cfg.lr_warmup_init,
        warmup_steps=cfg.warmup_steps, decay_steps=cfg.lr_decay_iters or train_iters,
        style=cfg.lr_decay_style, weight_decay=cfg.weight_decay,
        wsd_decay_steps=cfg.lr_wsd_decay_iters, wsd_decay_style=cfg.lr_wsd_decay_style)
