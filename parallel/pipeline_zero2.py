"""Pipeline ZeRO2: data-parallel gradient sharding for interleaved pipeline stages (GLM-5
report, sec. 2.4), on megatron-core's DDP and distributed optimizer.

megatron-core's distributed optimizer (ZeRO-1) shards optimizer state but every rank keeps the
full fp32 gradient buffer of every model chunk, G bytes. Here each rank keeps, per chunk, only
its own 1/dp slice of the gradients (the slice megatron's optimizer steps) and two full-size
accumulation buffers, each as large as the largest chunk, shared by all chunks (one buffer where
the rank holds a single chunk: nothing then runs while its reduce-scatter is in flight):

- the interleaved 1F1B backward runs a chunk for a group of consecutive micro-batches, then
  another chunk. When a chunk's backward begins (a hook on the chunk's forward output fires),
  its parameters' ``main_grad`` are pointed into the accumulation buffer that is free;
- when the next chunk takes over, the finished buffer is reduce-scattered over the data-parallel
  group asynchronously (overlapping the next chunk's backward) and, once done, added into the
  chunk's persistent slice and zeroed for reuse.

Persistent gradient bytes per rank: G/dp + 2 x (largest chunk) ~ G/dp + 2G/v for v > 1 chunks,
G/dp + G for one (a pipeline without virtual stages, or none: ZeRO2 then saves nothing).
Gradients whose data-parallel group is this rank alone (routed experts at expert-data-parallel
size 1, as in GLM-5's EP32 layouts) accumulate in place in their persistent copy and take no
room in the accumulation buffers, so there ZeRO2 costs nothing over plain buffers. The
price: a chunk is reduce-scattered once per group of consecutive micro-batches instead of once
per step (M / (PP x v) times for M micro-batches per rank).

What megatron-core's ``finalize_model_grads`` does on full buffers is done here on the slices
(all linear, so order does not matter): the tensor-parallel replicas' all-reduce (sequence-
parallel norms) over the aligned slices, the 1/num_tokens scaling. Word-embedding copies that
must be summed across chunks or pipeline ranks (MTP, tied head) keep a full gradient of their
own ("pinned"), summed by ``EmbeddingTie`` and then all-reduced over data parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.distributed.finalize_model_grads import (
    _update_router_expert_bias,
    reset_model_temporary_tensors,
)
from megatron.core.pipeline_parallel.utils import get_pp_last_rank
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config

from parallel import mcore_compat
from parallel.comm_purpose import collective_purpose
from parallel.distopt_slices import distributed_optimizers, main_param_pairs, slice_range


@dataclass
class BucketSlice:
    """One bucket of a buffer and this rank's slice of it."""

    offset: int  # bucket start in the buffer
    numel: int  # padded bucket size (divisible by dp)
    size: int  # numel / dp: one rank's slice
    slice_start: int  # this rank's slice start, buffer coordinates
    shard_offset: int  # where the slice lives in the persistent shard
    scaling: float  # megatron's gradient_scaling_factor, applied before the reduction


@dataclass
class BufferShard:
    """A megatron-core ``_ParamAndGradBuffer`` of a chunk, with this rank's persistent slices.

    ``in_place``: its data-parallel group is this rank alone (experts at expert-data-parallel
    size 1, say), so its slice is the whole buffer: the backward accumulates straight into it,
    with no room in the accumulation buffers and nothing to reduce."""

    buffer: object
    group: object  # its data-parallel group (expert buffers: the expert-data-parallel group)
    offset: int  # where the buffer sits in the chunk's region of an accumulation buffer
    numel: int
    buckets: list[BucketSlice]
    shard: torch.Tensor
    in_place: bool = False


@dataclass
class ChunkGrads:
    buffers: list[BufferShard]
    numel: int


@dataclass
class _Flush:
    chunk: int
    handles: list = field(default_factory=list)


class PipelineZero2:
    """Owns every chunk's gradient storage on this rank (see the module docstring)."""

    def __init__(self) -> None:
        self.chunks: list[ChunkGrads] = []
        self.accum: list[torch.Tensor] = []  # accumulation_buffers(chunks) of them
        self.pending: list[_Flush | None] = [None, None]
        self.active: tuple[int, int] | None = None  # (chunk, accumulation buffer)
        self.pinned: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.where: dict[torch.nn.Parameter, tuple[BufferShard, int]] = {}  # param -> (buf, start)
        self.flushes = 0  # reduce-scatter rounds this step (one per chunk per group)
        # Run before a finished chunk's reduce-scatter starts: whatever still owes gradients
        # to the accumulation buffer (deferred weight gradients, parallel/deferred_wgrad.py).
        self.before_launch = None

    # ---- setup -------------------------------------------------------------------------------

    def adopt(self, chunk, pinned: list[torch.nn.Parameter]) -> None:
        """Take over a freshly wrapped DDP chunk's gradients; its full grad buffers are released
        (call right after wrapping each chunk, so only one full buffer ever exists)."""
        index = len(self.chunks)
        if pinned and not chunk.config.calculate_per_token_loss:
            # Pinned copies are all-reduced as sums (reduce_pinned); megatron's averaging
            # modes would scale every other gradient by 1/dp but not these.
            raise ValueError("Pipeline ZeRO2 with pinned embedding copies needs "
                             "calculate_per_token_loss=True (per-token loss sums, as the "
                             "training job sets)")
        buffers, offset = [], 0
        for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            buffers.append(_buffer_shard(buffer, offset))
            if not buffers[-1].in_place:
                offset += buffers[-1].numel
            for param, (start, _, _) in buffer.param_index_map.items():
                self.where[param] = (buffers[-1], start)
        self.chunks.append(ChunkGrads(buffers, offset))
        for param in pinned:
            self.pinned[param] = torch.zeros(param.shape, dtype=torch.float32,
                                             device=param.device)
            param.main_grad = self.pinned[param]
        if offset > self._accum_numel() or len(self.accum) < accumulation_buffers(index + 1):
            self._grow(max(offset, self._accum_numel()))
        self._bind(index, 0)
        chunk.register_forward_hook(partial(self._watch_output, index))

    def _accum_numel(self) -> int:
        return self.accum[0].numel() if self.accum else 0

    def _grow(self, numel: int) -> None:
        device = self.chunks[-1].buffers[0].buffer.grad_data.device
        self.accum = [torch.zeros(numel, dtype=torch.float32, device=device)
                      for _ in range(accumulation_buffers(len(self.chunks)))]
        for index in range(len(self.chunks)):
            self._bind(index, 0)

    def _bind(self, index: int, which: int) -> None:
        """Point chunk ``index``'s grad buffers and ``main_grad`` views into accumulation
        buffer ``which`` (megatron's backward hooks read ``param.main_grad`` at every call)."""
        region = self.accum[which]
        for shard in self.chunks[index].buffers:
            data = shard.shard if shard.in_place else region[shard.offset:
                                                              shard.offset + shard.numel]
            shard.buffer.grad_data = data
            for bucket, piece in zip(shard.buffer.buckets, shard.buckets):
                bucket.grad_data = data[piece.offset:piece.offset + piece.numel]
            for param, (start, end, _) in shard.buffer.param_index_map.items():
                if param not in self.pinned:
                    param.main_grad = data[start:end].view(param.shape)

    def _watch_output(self, index: int, _module, _inputs, output) -> None:
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self.begin_backward(index))

    # ---- per step ----------------------------------------------------------------------------

    def begin_step(self) -> None:
        for which in range(len(self.accum)):
            self._complete(which)
        for chunk in self.chunks:
            for shard in chunk.buffers:
                shard.shard.zero_()
        for grad in self.pinned.values():
            grad.zero_()
        for accum in self.accum:
            accum.zero_()
        self.active, self.flushes = None, 0

    def begin_backward(self, index: int) -> None:
        """Chunk ``index`` starts a backward pass: give it an accumulation buffer, flushing
        the chunk that ran before it."""
        if self.active is not None and self.active[0] == index:
            return
        which = 0
        if self.active is not None:
            self._launch(*self.active)
            which = 1 - self.active[1]
        self._complete(which)
        self._bind(index, which)
        self.active = (index, which)

    @collective_purpose("zero2_grad_reduce_scatter")
    def _launch(self, index: int, which: int) -> None:
        if self.before_launch is not None:
            self.before_launch()
        flush = _Flush(index)
        region = self.accum[which]
        for shard in self.chunks[index].buffers:
            if shard.in_place:
                continue  # the slice is the whole buffer: nothing to reduce
            for piece in shard.buckets:
                data = region[shard.offset + piece.offset:shard.offset + piece.offset + piece.numel]
                if piece.scaling != 1.0:
                    data.mul_(piece.scaling)
                start = piece.slice_start - piece.offset
                own = data[start:start + piece.size]  # in place, as megatron-core's own
                flush.handles.append(dist.reduce_scatter_tensor(own, data, group=shard.group,
                                                                async_op=True))
        self.pending[which] = flush
        self.flushes += 1

    def _complete(self, which: int) -> None:
        """Wait for buffer ``which``'s reduce-scatter, add it into its chunk's slices, zero it."""
        flush = self.pending[which]
        if flush is None:
            return
        for handle in flush.handles:
            handle.wait()
        region = self.accum[which]
        chunk = self.chunks[flush.chunk]
        for shard in chunk.buffers:
            if shard.in_place:
                continue  # accumulated there already
            for piece in shard.buckets:
                local = shard.offset + piece.slice_start
                shard.shard[piece.shard_offset:piece.shard_offset + piece.size] += \
                    region[local:local + piece.size]
        region[:chunk.numel].zero_()
        self.pending[which] = None

    def finish(self) -> None:
        """After the last backward: flush the running chunk and wait for every reduction."""
        if self.active is not None:
            self._launch(*self.active)
            self.active = None
        for which in range(len(self.accum)):
            self._complete(which)

    # ---- after the reduction (the finalize steps, on slices) ------------------------------

    @collective_purpose("zero2_embedding_grad_all_reduce")
    def reduce_pinned(self) -> None:
        """Pinned copies (already summed over copies by EmbeddingTie): all-reduce over data
        parallelism, then keep this rank's slice."""
        for param, grad in self.pinned.items():
            shard, start = self.where[param]
            if dist.get_world_size(shard.group) > 1:
                dist.all_reduce(grad, group=shard.group)
            flat = grad.view(-1)
            for lo, hi, at in self.slice_pieces(param):
                shard.shard[at:at + hi - lo] += flat[lo - start:hi - start]

    def slice_pieces(self, param) -> list[tuple[int, int, int]]:
        """(start, end, shard position) of the parts of ``param`` inside this rank's slices,
        in buffer coordinates."""
        shard, start = self.where[param]
        end, out = start + param.numel(), []
        for piece in shard.buckets:
            lo, hi = max(start, piece.slice_start), min(end, piece.slice_start + piece.size)
            if hi > lo:
                out.append((lo, hi, piece.shard_offset + lo - piece.slice_start))
        return out

    def slice_of(self, param, start: int, end: int) -> torch.Tensor:
        """The reduced gradient of buffer range [start, end) of ``param``'s buffer (a range the
        distributed optimizer assigned to this rank)."""
        shard, _ = self.where[param]
        for piece in shard.buckets:
            if piece.slice_start <= start and end <= piece.slice_start + piece.size:
                at = piece.shard_offset + start - piece.slice_start
                return shard.shard[at:at + end - start]
        raise ValueError(f"range [{start}, {end}) is not in this rank's gradient slices")

    @collective_purpose("zero2_replicated_grad_all_reduce")
    def all_reduce_replicas(self, params: list, group, divide_by: int = 1) -> None:
        """Sum (then divide) the slices of ``params`` over ``group`` (tensor-parallel replicas
        hold the same buffer layout, so their slices line up). gloo has no AVG: sum, divide."""
        views = [self.where[p][0].shard[at:at + hi - lo] for p in params
                 for lo, hi, at in self.slice_pieces(p)]
        if not views:
            return
        flat = torch.cat(views)
        dist.all_reduce(flat, group=group)
        if divide_by != 1:
            flat /= divide_by
        for view, synced in zip(views, torch.split(flat, [v.numel() for v in views])):
            view.copy_(synced)

    def scale(self, factor: float) -> None:
        for chunk in self.chunks:
            for shard in chunk.buffers:
                shard.shard.mul_(factor)

    def held_by_kind(self) -> dict[str, list[torch.Tensor]]:
        """Every gradient tensor this rank keeps between steps, by part (byte accounting)."""
        return {"slice": [s.shard for c in self.chunks for s in c.buffers],
                "accum": list(self.accum), "pinned": list(self.pinned.values())}

    def held_tensors(self) -> list[torch.Tensor]:
        return [t for tensors in self.held_by_kind().values() for t in tensors]


def accumulation_buffers(chunks: int) -> int:
    """Accumulation buffers a rank holding ``chunks`` model chunks needs: two, so that one
    chunk's backward accumulates while the previous chunk's reduce-scatter runs; one for a
    single chunk, whose reduce-scatter runs only after its last backward."""
    return min(2, chunks)


def _buffer_shard(buffer, offset: int) -> BufferShard:
    group = buffer.data_parallel_group
    dp, rank = dist.get_world_size(group), dist.get_rank(group)
    numel, in_place = buffer.grad_data.numel(), dp == 1
    buckets, shard_offset = [], 0
    for bucket in buffer.buckets:
        size = bucket.grad_data.numel() // dp
        if in_place:  # the shard is laid out as the buffer itself
            shard_offset = bucket.offset
        buckets.append(BucketSlice(bucket.offset, bucket.grad_data.numel(), size,
                                   bucket.offset + rank * size, shard_offset,
                                   float(bucket.gradient_scaling_factor)))
        shard_offset += size
    shard = torch.zeros(numel if in_place else shard_offset, dtype=torch.float32,
                        device=buffer.grad_data.device)
    return BufferShard(buffer, group, offset, numel, buckets, shard, in_place)


# ---- megatron-core glue ---------------------------------------------------------------------


@collective_purpose("token_count")
def finalize_zero2_grads(model: list, num_tokens, pg_collection=None, force_all_reduce=False, *,
                         zero2: PipelineZero2, groups: ProcessGroupCollection,
                         embedding_tie=None) -> None:
    """megatron-core's ``finalize_model_grads`` for Pipeline ZeRO2: the same steps, on the
    persistent slices instead of full buffers. ``groups``: this rank's process groups (the
    schedules pass ``pg_collection`` only in some paths; ours is always set)."""
    config = get_model_config(model[0])
    zero2.finish()
    if embedding_tie is not None:
        embedding_tie.sync(model)
    zero2.reduce_pinned()
    _reduce_tensor_parallel_replicas(model, config, zero2, groups.tp)
    if config.moe_router_enable_expert_bias:
        _update_router_expert_bias(model, config)
    reset_model_temporary_tensors(config, model)
    if num_tokens is not None:
        dist.broadcast(num_tokens, src=get_pp_last_rank(groups.pp), group=groups.pp)
        dist.all_reduce(num_tokens, group=groups.dp_cp)
        if num_tokens > 0:
            zero2.scale(1.0 / float(num_tokens))


def _reduce_tensor_parallel_replicas(model: list, config, zero2: PipelineZero2, tp_group) -> None:
    """megatron-core's all-reduce of replicated parameters' gradients over TP (sequence-
    parallel norms, qk norms: summed; ``average_gradients_across_tp_domain``: averaged)."""
    tp = dist.get_world_size(tp_group)
    if tp == 1:
        return
    summed, averaged = [], []
    for chunk in model:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if getattr(param, "average_gradients_across_tp_domain", False):
                averaged.append(param)
            elif ((config.sequence_parallel and getattr(param, "sequence_parallel", False))
                  or (config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name))):
                summed.append(param)
    zero2.all_reduce_replicas(summed, group=tp_group)
    zero2.all_reduce_replicas(averaged, group=tp_group, divide_by=tp)


def attach_to_optimizer(optimizer, zero2: PipelineZero2) -> None:
    """The distributed optimizer reads its gradient slices from ``zero2`` (megatron-core's own
    copy would read full ``main_grad`` views, which no longer hold them)."""
    for sub in distributed_optimizers(optimizer):
        mcore_compat.override_method(sub, "_copy_model_grads_to_main_grads",
                                     partial(_copy_slices_to_main_grads, sub, zero2))


def _copy_slices_to_main_grads(sub, zero2: PipelineZero2) -> None:
    # megatron-core's precision-aware path (bf16 with the state in host memory) steps bf16
    # slices; torch refuses an fp32 ``.grad`` on them, so its optimizers read ``decoupled_grad``.
    decoupled = sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
    for model_param, main_param in main_param_pairs(sub):
        world = slice_range(sub, model_param)
        piece = zero2.slice_of(model_param, world.start, world.stop)
        if decoupled:
            main_param.decoupled_grad = piece
        else:
            main_param.grad = piece
