"""Parallel layout: the config users write, its validation, and process-group creation.

Field names are megatron-core's. The data-parallel size is derived from the world size. Every
rule is checked by ``validate_layout`` before any process group exists, and each error names the
value, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import typing
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from parallel.context_parallel import check_shardable
from parallel.hierarchical_all_to_all import node_split


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
    """The parallel sizes megatron-core's TransformerConfig needs (subset of ParallelConfig)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    pipeline_model_parallel_layout: str | None = None
    moe_token_dispatcher_type: str = "alltoall"
    extra: dict[str, Any] = field(default_factory=dict)



@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    pipeline_model_parallel_layout: str | None = None
    moe_token_dispatcher_type: str = "alltoall"
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    backend: str | None = None  # None: nccl with CUDA, gloo without
    # Optional: the launcher starts TP x PP x CP x this many processes; when set, the job checks
    # the world size agrees. Null: derived from the world size.
    data_parallel_size: int | None = None
    # Where the MTP layer goes when no layout is given and PP > 1 (the layout is then balanced
    # by glm5_train.pipeline_plan): "split" (GLM-5: MTP transformer on the stage before the
    # loss stage, its output head with the main one) or "with_loss" (megatron-core's).
    mtp_placement: str = "split"
    # The balancer evens out compute per stage among layouts whose ranks fit this many GiB
    # (estimated); null: no limit, memory only breaks ties.
    stage_memory_limit_gib: float | None = None
    # Pipeline ZeRO2 (parallel/pipeline_zero2.py): keep 1/dp of each chunk's gradients plus two
    # shared full-size accumulation buffers, instead of every chunk's full gradient buffer.
    # Needs use_distributed_optimizer=true (it steps those slices).
    pipeline_zero2: bool = False
    # Interleaved schedule: consecutive micro-batches a virtual stage runs before the next
    # (megatron-core's microbatch_group_size_per_vp_stage; null: PP). Larger groups keep more
    # activations in flight but cut Pipeline ZeRO2's reduce-scatters to one per group.
    microbatch_group_size_per_vp_stage: int | None = None
    # Context parallelism's exchange (context_parallel_size > 1): "all_gather" (queries stay on
    # their sequence shard, the latent and indexer keys are all-gathered) or "head_parallel"
    # (Ulysses: queries go to head shards over the whole sequence by all-to-all, outputs come
    # back; glm5_train/model/head_parallel_cp.py). head_parallel's all-to-all runs in two levels
    # with cp_node_size (global ranks per node: inside each node, then across nodes;
    # parallel/hierarchical_all_to_all.py); null: one flat all-to-all over the CP group.
    cp_comm: str = "all_gather"
    cp_node_size: int | None = None
    # Context-parallel groups (parallel/flexible_cp.py): "fixed" (every sequence over
    # context_parallel_size ranks) or "flexible" (per global batch, the data-parallel ranks form
    # CP groups of 1 .. flexible_cp_max_size ranks, powers of two, sized to each chat SFT
    # conversation and filled by the workload model below; context_parallel_size stays 1).
    cp_groups: str = "fixed"
    flexible_cp_max_size: int = 1
    # The workload model: seconds per causal token pair of a document (the DSA indexer), per
    # selected key (sparse attention and its KL), per token (the rest). Measured with
    # tools/calibrate_cp_workload.py; the defaults are glm5_tiny's on a 2-core CPU (measured at
    # 512-4096 tokens, fit within 3%; past the top-k the selected-key term folds into token).
    flexible_cp_cost_pair: float = 1.03e-7
    flexible_cp_cost_selected: float = 0.0
    flexible_cp_cost_token: float = 3.30e-4
    # Replay: plan each global batch as for this many data-parallel ranks and run every bin of
    # the plan whole on this one process (null: plan for the run's own ranks). Reproduces a
    # larger run's micro-batches in one process, e.g. to check its numerics.
    flexible_cp_plan_ranks: int | None = None
    # Optimizer state in host memory (parallel/host_optimizer.py, megatron-core's hybrid
    # optimizer): the first optimizer_offload_fraction of the parameter elements step on the
    # host (fp32 copies, AdamW moments there; gradients copied over, updated values back), the
    # rest on the device; overlap_cpu_optimizer_d2h_h2d: the copies on side streams, per
    # parameter (CUDA). With Muon: its AdamW part's state on the host, whole (parallel/muon.py;
    # its matrices' momentum stays on the device).
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    # Deferred weight gradients (parallel/deferred_wgrad.py, ZB-H1 style): linear layers'
    # weight-gradient GEMMs leave the backward and run inside the pipeline p2p waits, so a
    # stage's input gradient reaches the stage before it sooner. Needs PP > 1.
    defer_weight_grads: bool = False

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

    def sizes(self) -> ParallelSizes:
        return ParallelSizes(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tp,
            context_parallel_size=self.context_parallel_size,
            sequence_parallel=self.sequence_parallel,
            pipeline_model_parallel_layout=self.pipeline_model_parallel_layout,
            moe_token_dispatcher_type=self.moe_token_dispatcher_type,
            extra={"batch_p2p_comm": not self.uses_gloo,
                   **({"microbatch_group_size_per_vp_stage":
                       self.microbatch_group_size_per_vp_stage}
                      if self.microbatch_group_size_per_vp_stage else {})},
        )

    @property
    def uses_gloo(self) -> bool:
        # With gloo at PP=2 the interleaved schedule's batched p2p matches two same-shape
        # messages between the same pair of ranks out of order (wrong losses from micro-batch
        # 2 on); unbatched send/recv is exact.
        return (self.backend or ("nccl" if torch.cuda.is_available() else "gloo")) == "gloo"


class LayoutError(ValueError):
    """An impossible parallel layout, found before any process group is created."""


def validate_layout(par: ParallelConfig, model: ModelShape, world_size: int,
                    global_batch_size: int, micro_batch_size: int, seq_length: int) -> int:
    """Check every layout rule; return the data-parallel size. Raises LayoutError.

    These are the rules megatron-core (and torch.distributed) would otherwise enforce only
    after the process groups exist, mostly deep in model construction or the first step;
    each check names the megatron-core code it mirrors."""
    _check_types(par)
    _check_positive(par)
    dp = _check_world(par, world_size)
    _check_backend(par)
    _check_tensor(par, model)
    _check_widths(par, model)
    _check_pipeline(par, model)
    _check_zero2(par)
    _check_deferred_wgrad(par)
    _check_optimizer_offload(par)
    _check_experts(par, model, dp)
    _check_dispatcher(par)
    _check_sequence(par, model, seq_length)
    if par.cp_groups != "flexible":  # flexible: the plan sets the micro-batches per step
        _check_batch(global_batch_size, micro_batch_size, dp)
        _check_interleaving(par, global_batch_size // max(1, micro_batch_size * dp))
    _check_context_comm(par, model, world_size)
    _check_context_groups(par, dp, seq_length)
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
                 "microbatch_group_size_per_vp_stage"):
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


MTP_PLACEMENTS = ("split", "with_loss")


def _check_pipeline(par: ParallelConfig, model: ModelShape) -> None:
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    if par.mtp_placement not in MTP_PLACEMENTS:
        raise LayoutError(f"parallel.mtp_placement={par.mtp_placement!r}: use one of "
                          f"{list(MTP_PLACEMENTS)}")
    # parallel_state.py:746: any VPP size (even 1) needs PP > 1.
    if vpp is not None and (vpp < 1 or pp == 1):
        raise LayoutError(
            f"parallel.virtual_pipeline_model_parallel_size={vpp} needs "
            f"pipeline_model_parallel_size > 1 (got {pp}) and a value >= 1: set it to null or "
            "raise PP")
    embedding_copies = pp > 1 and (model.mtp_sets or model.tie_word_embeddings)
    if embedding_copies and par.overlap_grad_reduce:
        raise LayoutError(
            "parallel.overlap_grad_reduce=true with pipeline_model_parallel_size > 1 and MTP "
            "(or tied embeddings): the word embedding then has copies on two stages whose "
            "gradients are summed before the data-parallel reduction, which overlapping would "
            "race with; set parallel.overlap_grad_reduce=false (or model.mtp_num_steps=0)")
    if par.pipeline_model_parallel_layout or (model.mtp_sets and pp > 1):
        return  # glm5_train.pipeline_plan checks a given layout, or balances one
    stages = pp * (vpp or 1)
    layers = model.num_hidden_layers
    if layers % stages:
        raise LayoutError(
            f"model.num_hidden_layers={layers} cannot be placed evenly on pipeline x virtual "
            f"stages = {pp} x {vpp or 1} = {stages}: choose PP x VPP dividing {layers}, or give "
            "parallel.pipeline_model_parallel_layout (e.g. 'Et|tt|t|tL') for an uneven split")


def _check_optimizer_offload(par: ParallelConfig) -> None:
    if not par.optimizer_cpu_offload:
        return
    fraction = par.optimizer_offload_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
            or not 0.0 <= fraction <= 1.0:
        raise LayoutError(f"parallel.optimizer_offload_fraction={fraction!r}: the share of the "
                          "parameter elements whose optimizer state lives in host memory must "
                          "lie in [0, 1] (1.0: all of it)")


def _check_zero2(par: ParallelConfig) -> None:
    if not par.pipeline_zero2:
        return
    if not par.use_distributed_optimizer:
        raise LayoutError(
            "parallel.pipeline_zero2=true with parallel.use_distributed_optimizer=false: ZeRO2 "
            "keeps only each rank's gradient slice, which only the distributed optimizer "
            "steps; set parallel.use_distributed_optimizer=true")
    if par.overlap_grad_reduce:
        raise LayoutError(
            "parallel.pipeline_zero2=true with parallel.overlap_grad_reduce=true: ZeRO2 runs "
            "its own reduce-scatters, overlapped with the next chunk's backward; set "
            "parallel.overlap_grad_reduce=false")


def _check_deferred_wgrad(par: ParallelConfig) -> None:
    if not par.defer_weight_grads:
        return
    if par.pipeline_model_parallel_size == 1:
        raise LayoutError(
            "parallel.defer_weight_grads=true with pipeline_model_parallel_size=1: deferred "
            "weight gradients fill pipeline waits, and without a pipeline there are none; set "
            "pipeline_model_parallel_size > 1 or parallel.defer_weight_grads=false")
    if par.overlap_grad_reduce:
        raise LayoutError(
            "parallel.defer_weight_grads=true with parallel.overlap_grad_reduce=true: "
            "megatron-core's overlapped reduction starts a bucket when autograd hands it every "
            "weight gradient, and deferred ones arrive later, outside autograd; set "
            "parallel.overlap_grad_reduce=false")


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


def _check_interleaving(par: ParallelConfig, num_microbatches: int) -> None:
    """megatron-core's interleaved schedule (schedules.py:995 and :1007) runs micro-batches in
    groups of microbatch_group_size_per_vp_stage (PP when null, model_parallel_config.py:448):
    a group size in [PP, micro-batches per step], and a last group empty or >= PP."""
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    group = par.microbatch_group_size_per_vp_stage
    interleaved = vpp is not None and vpp > 1
    name = (f"parallel.microbatch_group_size_per_vp_stage={group}" if group is not None
            else f"the interleaved schedule's micro-batch group (PP={pp}, as "
            "microbatch_group_size_per_vp_stage=null)")
    if group is not None and not interleaved:
        raise LayoutError(f"{name} needs the interleaved schedule "
                          "(virtual_pipeline_model_parallel_size >= 2): set it to null")
    if not interleaved:
        return
    size = group or pp
    micro = ("micro-batches per step = global_batch_size / (micro_batch_size x data-parallel "
             f"size) = {num_microbatches}")
    or_group = " (or change the group size)" if group else ""
    if not pp <= size <= num_microbatches:
        raise LayoutError(f"{name} must lie in [PP={pp}, {micro}] (megatron-core's interleaved "
                          "schedule): raise train.global_batch_size or lower "
                          f"train.micro_batch_size{or_group}")
    if 0 < num_microbatches % size < pp:
        raise LayoutError(
            f"{name}: the last group would hold {num_microbatches % size} < PP={pp} "
            f"micro-batches ({micro}): make the micro-batches per step a multiple of {size}, "
            f"or leave a remainder >= {pp}{or_group}")


CP_COMMS = ("all_gather", "head_parallel")


CP_GROUPS = ("fixed", "flexible")


def _check_context_groups(par: ParallelConfig, dp: int, seq_length: int) -> None:
    """parallel.cp_groups=flexible (parallel/flexible_cp.py): groups of power-of-two sizes cut
    from the data-parallel ranks, each rank holding seq_length / flexible_cp_max_size tokens
    per micro-batch."""
    largest = par.flexible_cp_max_size
    if par.cp_groups not in CP_GROUPS:
        raise LayoutError(f"parallel.cp_groups={par.cp_groups!r}: use one of {list(CP_GROUPS)}")
    if par.cp_groups == "fixed":
        if largest != 1:
            raise LayoutError(f"parallel.flexible_cp_max_size={largest} sizes flexible CP "
                              "groups, but parallel.cp_groups='fixed': set "
                              "parallel.cp_groups=flexible or parallel.flexible_cp_max_size=1")
        return
    fix = "launch the ranks as data parallel (the groups are cut from them)"
    if par.context_parallel_size != 1:
        raise LayoutError(f"parallel.cp_groups=flexible with context_parallel_size="
                          f"{par.context_parallel_size}: flexible groups replace the fixed one; "
                          f"set context_parallel_size=1 and {fix}")
    if par.cp_comm != "all_gather":
        raise LayoutError(f"parallel.cp_groups=flexible runs the all_gather exchange only: set "
                          f"parallel.cp_comm=all_gather (not {par.cp_comm!r})")
    for name, value in (("flexible_cp_max_size", largest), ("data-parallel size", dp)):
        if value < 1 or value & (value - 1):
            raise LayoutError(f"parallel.cp_groups=flexible needs a power-of-two {name}, got "
                              f"{value}: groups are aligned power-of-two blocks of the data-"
                              "parallel ranks")
    if par.pipeline_model_parallel_size > 1 and largest > dp:
        raise LayoutError(f"parallel.flexible_cp_max_size={largest} > the data-parallel size "
                          f"{dp} under pipeline parallelism (every rank's micro-batches must "
                          f"hold the same tokens): lower it to <= {dp} or {fix}")
    split = par.tensor_model_parallel_size if par.sequence_parallel else 1
    unit = 2 * largest * split
    if seq_length % unit:
        raise LayoutError(f"train.seq_length={seq_length} is not divisible by 2 x "
                          f"parallel.flexible_cp_max_size{' x TP' if split > 1 else ''} = {unit}"
                          ": each rank holds seq_length / flexible_cp_max_size tokens, zigzag-"
                          "sharded in 2 chunks per rank; pick a multiple of it")
    replay, processes = par.flexible_cp_plan_ranks, dp * par.model_parallel_size
    if replay is not None and processes != 1:
        raise LayoutError(f"parallel.flexible_cp_plan_ranks={replay} replays a plan on one "
                          f"process, but the layout has {processes}: set it to null")
    if replay is not None and (replay < 1 or replay & (replay - 1)):
        raise LayoutError(f"parallel.flexible_cp_plan_ranks={replay} must be a power of two "
                          "(the data-parallel size of the run whose plans it replays)")
    for name in ("flexible_cp_cost_pair", "flexible_cp_cost_selected", "flexible_cp_cost_token"):
        if getattr(par, name) < 0:
            raise LayoutError(f"parallel.{name}={getattr(par, name)} must be >= 0 (measure it "
                              "with tools/calibrate_cp_workload.py)")


def _check_context_comm(par: ParallelConfig, model: ModelShape, world_size: int) -> None:
    """parallel.cp_comm / cp_node_size (glm5_train/model/head_parallel_cp.py): the head split
    and the node split the head-parallel all-to-all needs (checked again on the real groups
    when they are built, parallel/hierarchical_all_to_all.node_split)."""
    if par.cp_comm not in CP_COMMS:
        raise LayoutError(f"parallel.cp_comm={par.cp_comm!r}: use one of {list(CP_COMMS)}")
    node = par.cp_node_size
    if node is not None and par.cp_comm != "head_parallel":
        raise LayoutError(f"parallel.cp_node_size={node} sets the nodes of the head-parallel "
                          "all-to-all, but parallel.cp_comm='all_gather' has none: set "
                          "parallel.cp_comm=head_parallel or parallel.cp_node_size=null")
    if par.cp_comm != "head_parallel":
        return
    tp, cp = par.tensor_model_parallel_size, par.context_parallel_size
    heads = model.num_attention_heads // tp
    if heads % cp:
        raise LayoutError(
            f"parallel.cp_comm=head_parallel splits the {heads} attention heads of each "
            f"tensor-parallel rank (model.num_attention_heads={model.num_attention_heads} / "
            f"TP {tp}) over context_parallel_size={cp} ranks: pick a CP size dividing {heads} "
            "or parallel.cp_comm=all_gather")
    if node is None:
        return
    if node < 1 or world_size % node:
        raise LayoutError(f"parallel.cp_node_size={node} must be a positive divisor of the "
                          f"world size {world_size} (global ranks per node, e.g. GPUs per "
                          "node), or null (one flat all-to-all)")
    for ranks in context_parallel_rank_lists(tp, cp, world_size):
        try:
            node_split(ranks, node)
        except ValueError as err:
            raise LayoutError(f"parallel.cp_node_size={node}: {err}") from None


def context_parallel_rank_lists(tp: int, cp: int, world_size: int) -> list[list[int]]:
    """Global ranks of every CP group under megatron-core's default order "tp-cp-ep-dp-pp"
    (TP innermost, then CP): ranks base + TP x j, j < CP."""
    block = tp * cp
    return [[outer * block + t + tp * j for j in range(cp)]
            for outer in range(world_size // block) for t in range(tp)]
