"""Parallel layout: the config users write, its validation, and process-group creation.

Field names are megatron-core's. The data-parallel size is derived from the world size. Every
rule is checked by ``validate_layout`` before any process group exists, and each error names the
value, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import typing
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from parallel.config.context_parallel import (
    CP_COMMS,
    ContextCommOptions,
    check_context_comm,
    context_parallel_rank_lists,
)
from parallel.config.deferred_wgrad import DeferredWgradOptions, check_deferred_wgrad
from parallel.config.flexible_cp import CP_GROUPS, FlexibleCPOptions, check_flexible_cp
from parallel.config.host_optimizer import HostOptimizerOptions, check_host_optimizer
from parallel.config.pipeline import (
    MTP_PLACEMENTS,
    PipelineScheduleOptions,
    check_interleaving,
    check_mtp_placement,
)
from parallel.config.pipeline_zero2 import PipelineZero2Options, check_pipeline_zero2
from parallel.context_parallel import check_shardable
from parallel.layout_error import LayoutError

# Re-exported: the names code and tests import from this module.
__all__ = ["CP_COMMS", "CP_GROUPS", "MTP_PLACEMENTS", "LayoutError", "ParallelConfig",
           "ParallelSizes", "context_parallel_rank_lists", "validate_layout"]


class ModelShape(Protocol):
    """What the layout rules read of a model config (GLM-5's ``GLM5Config`` is one)."""

    vocab_size: int
    num_attention_heads: int
    index_n_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_hidden_layers: int
    first_k_dense_replace: int  # the first k layers are dense, the rest MoE
    intermediate_size: int  # dense MLP width
    moe_intermediate_size: int  # one (routed or shared) expert's width
    tie_word_embeddings: bool

    @property
    def mtp_sets(self) -> int: ...


@dataclass
class ParallelSizes:
    """The parallel sizes, in megatron-core's names: the one place they are declared and mapped
    to megatron-core's keywords (``mcore_kwargs``), for its TransformerConfig and its process
    groups. ``ParallelConfig`` is these plus each technique's options."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    pipeline_model_parallel_layout: str | None = None
    moe_token_dispatcher_type: str = "alltoall"

    @property
    def model_parallel_size(self) -> int:
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.context_parallel_size)

    def world_size_needed(self, data_parallel_size: int = 1) -> int:
        return self.model_parallel_size * data_parallel_size

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size; unset means 1 with expert parallelism (as GLM-5 runs),
        and TP without it: megatron-core treats expert weights as dense parameters when EP=1,
        so their TP split must then match the dense one."""
        if self.expert_tensor_parallel_size is not None:
            return self.expert_tensor_parallel_size
        return 1 if self.expert_model_parallel_size > 1 else self.tensor_model_parallel_size

    def mcore_kwargs(self) -> dict[str, Any]:
        """megatron-core's TransformerConfig keywords for this layout (the expert TP size
        resolved); ``parallel.process_groups`` takes its group sizes from the same map."""
        kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(ParallelSizes)}
        kwargs["expert_tensor_parallel_size"] = self.expert_tp
        return kwargs


@dataclass
class DataParallelOptions:
    """``parallel.*`` keys of data parallelism and the process groups' backend."""

    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    # Parameters per bucket under overlap_grad_reduce (Megatron-LM's --ddp-bucket-size); null:
    # megatron-core's default, max(40M, 1M x DP). Smaller buckets start reducing (and, with
    # overlap_param_gather, gathering) earlier.
    ddp_bucket_size: int | None = None
    # The distributed optimizer's parameter all-gather left to the next forward: each bucket
    # is gathered when its first module runs, behind the compute of the modules before it
    # (megatron-core's overlap_param_gather; needs use_distributed_optimizer and
    # overlap_grad_reduce, whose buckets it gathers).
    overlap_param_gather: bool = False
    # megatron-core's EP all-to-all overlap (Megatron-LM's --overlap-moe-expert-parallel-comm):
    # refused with its reason (_check_expert_overlap); the planner prices what it would hide.
    overlap_moe_expert_parallel_comm: bool = False
    backend: str | None = None  # None: nccl with CUDA, gloo without
    # Optional: the launcher starts TP x PP x CP x this many processes; when set, the job checks
    # the world size agrees. Null: derived from the world size.
    data_parallel_size: int | None = None

    @property
    def uses_gloo(self) -> bool:
        # With gloo at PP=2 the interleaved schedule's batched p2p matches two same-shape
        # messages between the same pair of ranks out of order (wrong losses from micro-batch
        # 2 on); unbatched send/recv is exact.
        return (self.backend or ("nccl" if torch.cuda.is_available() else "gloo")) == "gloo"


@dataclass
class ParallelConfig(DeferredWgradOptions, HostOptimizerOptions, FlexibleCPOptions,
                     ContextCommOptions, PipelineZero2Options, PipelineScheduleOptions,
                     DataParallelOptions, ParallelSizes):
    """The ``parallel`` config group: megatron-core's sizes, then data parallelism, then each
    technique's options, declared and checked in the technique's own module (the keys stay
    flat: ``parallel.pipeline_zero2``, ``parallel.cp_comm``, ...)."""

    def mcore_kwargs(self) -> dict[str, Any]:
        kwargs = super().mcore_kwargs()
        kwargs["batch_p2p_comm"] = not self.uses_gloo
        if self.microbatch_group_size_per_vp_stage:
            kwargs["microbatch_group_size_per_vp_stage"] = self.microbatch_group_size_per_vp_stage
        return kwargs


def validate_layout(par: ParallelConfig, model: ModelShape, world_size: int,
                    global_batch_size: int, micro_batch_size: int, seq_length: int) -> int:
    """Check every layout rule; return the data-parallel size. Raises LayoutError.

    These are the rules megatron-core (and torch.distributed) would otherwise enforce only
    after the process groups exist, mostly deep in model construction or the first step;
    each check names the megatron-core code it mirrors. A technique's own rules live beside
    it (``check_*`` from its module)."""
    _check_types(par)
    _check_positive(par)
    dp = _check_world(par, world_size)
    _check_backend(par)
    _check_tensor(par, model)
    _check_widths(par, model)
    check_mtp_placement(par)
    _check_pipeline(par, model)
    check_pipeline_zero2(par)
    check_deferred_wgrad(par)
    check_host_optimizer(par)
    _check_experts(par, model, dp)
    _check_param_gather(par)
    _check_expert_overlap(par)
    _check_dispatcher(par)
    _check_sequence(par, model, seq_length)
    if par.cp_groups != "flexible":  # flexible: the plan sets the micro-batches per step
        _check_batch(global_batch_size, micro_batch_size, dp)
        check_interleaving(par, global_batch_size // max(1, micro_batch_size * dp))
    check_flexible_cp(par, dp, seq_length)
    check_context_comm(par, model.num_attention_heads, world_size, dp)
    return dp


def has_moe_layers(model: ModelShape) -> bool:
    # The MTP layer copies the last decoder layer's kind, so it adds no MoE layer of its own.
    return model.first_k_dense_replace < model.num_hidden_layers


def _check_types(par: ParallelConfig) -> None:
    """Hydra passes a mistyped override through as a string (parallel.sequence_parallel=ture
    would be truthy): check every field against its annotation."""
    hints = typing.get_type_hints(ParallelConfig)
    for f in dataclasses.fields(par):
        value, kinds = getattr(par, f.name), typing.get_args(hints[f.name]) or (hints[f.name],)
        if not any(_is_a(value, kind) for kind in kinds):
            names = " or ".join("null" if kind is type(None) else kind.__name__ for kind in kinds)
            raise LayoutError(f"parallel.{f.name}={value!r}: expected {names}, like the default "
                              f"{f.default!r}")


def _is_a(value: Any, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if kind is float else kind)


def _check_positive(par: ParallelConfig) -> None:
    # parallel_state.initialize_model_parallel builds rank grids from these sizes (a 0 would
    # divide by zero there, parallel_state.py:791).
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "expert_model_parallel_size", "context_parallel_size"):
        if getattr(par, name) < 1:
            raise LayoutError(f"parallel.{name}={getattr(par, name)} must be a positive integer")
    for name in ("expert_tensor_parallel_size", "data_parallel_size",
                 "microbatch_group_size_per_vp_stage", "ddp_bucket_size"):
        value = getattr(par, name)
        if value is not None and value < 1:
            raise LayoutError(f"parallel.{name}={value} must be a positive integer or null")


BACKENDS = ("gloo", "nccl")


def _check_backend(par: ParallelConfig) -> None:
    # torch.distributed.init_process_group is the first collective call; fail before it.
    if par.backend is not None and par.backend not in BACKENDS:
        raise LayoutError(f"parallel.backend={par.backend!r}: use one of {list(BACKENDS)}, or "
                          "null (nccl with CUDA, gloo without)")
    if par.backend == "nccl" and not torch.cuda.is_available():
        raise LayoutError("parallel.backend='nccl' needs CUDA GPUs, and torch.cuda.is_available() "
                          "is false here: set parallel.backend=null (gloo on CPU)")


def _check_world(par: ParallelConfig, world_size: int) -> int:
    mp = par.model_parallel_size
    if par.data_parallel_size is not None and world_size != mp * par.data_parallel_size:
        raise LayoutError(
            f"world size {world_size} != TP x PP x CP x parallel.data_parallel_size = {mp} x "
            f"{par.data_parallel_size}: launch {mp * par.data_parallel_size} processes (the "
            "launcher in launch/ does) or set parallel.data_parallel_size=null")
    if world_size % mp:
        raise LayoutError(
            f"world size {world_size} is not divisible by tensor x pipeline x context parallel "
            f"= {par.tensor_model_parallel_size} x {par.pipeline_model_parallel_size} x "
            f"{par.context_parallel_size} = {mp}: launch a multiple of {mp} processes "
            f"(e.g. --nproc-per-node {mp}) or shrink the layout")
    return world_size // mp


def _check_tensor(par: ParallelConfig, model: ModelShape) -> None:
    # transformer_config.py:924 (heads); model_parallel_config.py:410 (SP without TP).
    tp = par.tensor_model_parallel_size
    for name in ("num_attention_heads", "index_n_heads"):
        value = getattr(model, name)
        if value % tp:
            raise LayoutError(
                f"model.{name}={value} is not divisible by parallel.tensor_model_parallel_size="
                f"{tp}: pick a TP size that divides {value}")
    if par.sequence_parallel and tp == 1:
        raise LayoutError("parallel.sequence_parallel=true needs tensor_model_parallel_size > 1 "
                          "(it splits the sequence across TP ranks): set it to false or raise TP")
    # moe_layer.py:379: MoELayer.forward refuses to train with TP > 1 and no SP.
    if tp > 1 and not par.sequence_parallel and has_moe_layers(model):
        raise LayoutError(
            f"parallel.tensor_model_parallel_size={tp} with parallel.sequence_parallel=false: "
            "megatron-core's MoE layer does not train with tensor parallelism unless sequence "
            f"parallelism is on (the model has MoE layers from layer "
            f"{model.first_k_dense_replace}); set parallel.sequence_parallel=true")


def _check_widths(par: ParallelConfig, model: ModelShape) -> None:
    """Every tensor-parallel linear splits its width evenly over its ranks (megatron-core's
    divide(): tensor_parallel/utils.py:118 for the vocabulary, layers.py:842 and :1166 for
    column- and row-parallel linears)."""
    tp = ("tensor_model_parallel_size", par.tensor_model_parallel_size)
    widths = [("vocab_size", model.vocab_size, tp)]
    if model.first_k_dense_replace:
        widths.append(("intermediate_size", model.intermediate_size, tp))
    if has_moe_layers(model):
        # Routed experts split over the expert TP group (experts.py:858); the shared expert
        # is a dense MLP over TP (shared_experts.py:50).
        etp = ("expert_tensor_parallel_size", par.expert_tp)
        widths.append(("moe_intermediate_size", model.moe_intermediate_size, etp))
        if model.n_shared_experts:
            widths.append(("n_shared_experts x moe_intermediate_size",
                           model.n_shared_experts * model.moe_intermediate_size, tp))
    for name, width, (size_name, size) in widths:
        if width % size:
            raise LayoutError(
                f"model.{name}={width} is not divisible by parallel.{size_name}={size} "
                f"(megatron-core splits this width evenly over those ranks): pick a size "
                f"dividing {width}, or change the model")


def _check_pipeline(par: ParallelConfig, model: ModelShape) -> None:
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    # parallel_state.py:746: any VPP size (even 1) needs PP > 1.
    if vpp is not None and (vpp < 1 or pp == 1):
        raise LayoutError(
            f"parallel.virtual_pipeline_model_parallel_size={vpp} needs "
            f"pipeline_model_parallel_size > 1 (got {pp}) and a value >= 1: set it to null or "
            "raise PP")
    if par.pipeline_model_parallel_layout or (model.mtp_sets and pp > 1):
        return  # the planner (glm5_train.plan) checks a given layout, or balances one
    stages = pp * (vpp or 1)
    layers = model.num_hidden_layers
    if layers % stages:
        raise LayoutError(
            f"model.num_hidden_layers={layers} cannot be placed evenly on pipeline x virtual "
            f"stages = {pp} x {vpp or 1} = {stages}: choose PP x VPP dividing {layers}, or give "
            "parallel.pipeline_model_parallel_layout (e.g. 'Et|tt|t|tL') for an uneven split")


def _check_experts(par: ParallelConfig, model: ModelShape, dp: int) -> None:
    # moe_layer.py:101 (experts per EP rank); parallel_state.py:792 (expert grid).
    ep = par.expert_model_parallel_size
    if model.n_routed_experts % ep:
        raise LayoutError(
            f"model.n_routed_experts={model.n_routed_experts} is not divisible by "
            f"parallel.expert_model_parallel_size={ep}: pick an EP size dividing it")
    etp = par.expert_tp
    if ep == 1 and etp != par.tensor_model_parallel_size:
        raise LayoutError(
            f"parallel.expert_tensor_parallel_size={etp} differs from tensor_model_parallel_size="
            f"{par.tensor_model_parallel_size} with expert_model_parallel_size=1: megatron-core "
            "then reduces expert gradients as dense ones and they come out wrong; leave it null "
            "or set expert_model_parallel_size > 1")
    expert_dp_world = par.tensor_model_parallel_size * par.context_parallel_size * dp
    if expert_dp_world % (ep * etp):
        raise LayoutError(
            f"expert_model_parallel_size x expert_tensor_parallel_size = {ep} x {etp} must divide "
            f"tensor x context x data parallel = {expert_dp_world} (the ranks of one pipeline "
            "stage): lower EP or launch more data-parallel ranks")


def _check_param_gather(par: ParallelConfig) -> None:
    if not par.overlap_param_gather:
        return
    if par.defer_weight_grads:
        raise LayoutError(
            "parallel.overlap_param_gather=true with parallel.defer_weight_grads=true: the "
            "overlapped gather needs overlap_grad_reduce, which deferred weight gradients "
            "cannot run with (their gradients arrive outside autograd); set one of them to false")
    if not par.use_distributed_optimizer:  # param_and_grad_buffer.py:262
        raise LayoutError(
            "parallel.overlap_param_gather=true needs parallel.use_distributed_optimizer=true: "
            "without it every rank updates whole parameters and nothing is gathered; set both")
    if not par.overlap_grad_reduce:  # distributed_data_parallel.py:67: no buckets without it
        raise LayoutError(
            "parallel.overlap_param_gather=true needs parallel.overlap_grad_reduce=true: "
            "megatron-core splits the parameters into buckets only then, and one bucket would "
            "be gathered whole at the first forward, behind nothing; set both (as Megatron-LM "
            "requires)")
    for other, why in (("pipeline_zero2", "Pipeline ZeRO2 hands the gradient buffers over per "
                        "micro-batch group"),
                       ("optimizer_cpu_offload", "the host optimizer copies the parameters back "
                        "itself")):
        if getattr(par, other):
            raise LayoutError(
                f"parallel.overlap_param_gather=true with parallel.{other}=true: {why}, and the "
                f"overlapped gather is not built for it; set one of them to false")


def _check_expert_overlap(par: ParallelConfig) -> None:
    if par.overlap_moe_expert_parallel_comm:
        raise LayoutError(
            "parallel.overlap_moe_expert_parallel_comm=true: not offered. megatron-core's EP "
            "overlap (combined 1F1B) runs each model chunk as its own per-layer plan (attention, "
            "dispatch, MLP, combine; gpt_model.build_schedule_plan) in place of GLM-5's forward, "
            "which would skip its shared MTP layer applied once per MTP step (the plan takes one "
            "MTP layer), its chunked loss head and the DSA indexer's KL; it also needs CUDA side "
            "streams, bf16 and no full recompute (the long-context presets recompute every "
            "layer). What it would hide: python tools/plan_step_time.py --overlap "
            "expert_all_to_all. Set it to false")


DISPATCHERS = ("alltoall", "allgather", "flex")


def _check_dispatcher(par: ParallelConfig) -> None:
    kind = par.moe_token_dispatcher_type
    if kind not in DISPATCHERS:  # moe_layer.py:218
        raise LayoutError(f"parallel.moe_token_dispatcher_type={kind!r}: use one of "
                          f"{list(DISPATCHERS)}")
    if kind != "flex":
        return
    tp_ep = par.tensor_model_parallel_size * par.expert_model_parallel_size
    if tp_ep == 1:  # token_dispatcher.py:1346
        raise LayoutError("parallel.moe_token_dispatcher_type='flex' needs tensor x expert "
                          "parallel > 1 (got 1 x 1): use 'alltoall', or raise EP")
    if importlib.util.find_spec("deep_ep") is None:  # token_dispatcher.py:1148
        raise LayoutError("parallel.moe_token_dispatcher_type='flex' needs the DeepEP package "
                          "(CUDA), which is not installed: use 'alltoall' (the default)")


def _check_sequence(par: ParallelConfig, model: ModelShape, seq_length: int) -> None:
    split = par.tensor_model_parallel_size if par.sequence_parallel else 1
    cp = par.context_parallel_size
    if cp > 1:  # zigzag: 2 x CP equal chunks, each split again by sequence parallelism
        try:
            check_shardable(seq_length, cp, split)
        except ValueError as err:
            raise LayoutError(str(err)) from None
    if seq_length % split:
        raise LayoutError(
            f"train.seq_length={seq_length} must be divisible by {split} (sequence parallel "
            "splits the sequence over TP ranks): pad or change seq_length")


def _check_batch(global_batch_size: int, micro_batch_size: int, dp: int) -> None:
    unit = max(1, micro_batch_size) * dp
    if micro_batch_size < 1 or global_batch_size % unit:
        nearest = unit * max(1, round(global_batch_size / unit))
        raise LayoutError(
            f"train.global_batch_size={global_batch_size} must be a multiple of "
            f"train.micro_batch_size x data-parallel size = {micro_batch_size} x {dp}: "
            f"use e.g. train.global_batch_size={nearest}")
