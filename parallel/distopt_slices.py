"""Views of megatron-core's distributed optimizer (ZeRO-1): which slice of which parameter this
rank steps.

megatron-core's ``DistributedOptimizer`` cuts every gradient bucket into one contiguous slice per
data-parallel rank, regardless of parameter boundaries; per sub-optimizer it keeps, for each
parameter with elements in this rank's slice, the model parameter and the "main" parameter the
inner torch optimizer steps (an fp32 copy of the slice for bf16 models, a view of the parameter
for fp32 ones). Pipeline ZeRO2 and distributed Muon both work on those pairs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer


def distributed_optimizers(optimizer) -> Iterator[DistributedOptimizer]:
    """The non-empty megatron-core DistributedOptimizers inside ``optimizer`` (chained: dense and
    expert parameters have one each)."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(sub, DistributedOptimizer) and not sub.is_stub_optimizer:
            yield sub


def main_param_pairs(sub: DistributedOptimizer) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model parameter, the main-parameter slice the inner optimizer steps) for each parameter
    with a slice on this rank, in a megatron-core DistributedOptimizer ``sub`` (bf16 models:
    fp32 copies; fp32 models: views of the parameters). Under megatron-core's precision-aware
    path (bf16 with the state in host memory) no fp32 slice exists on the device: the inner
    optimizer steps the bf16 slice and keeps its fp32 master itself."""
    for models, mains, slices in ((sub.model_float16_groups, sub.shard_fp32_from_float16_groups,
                                   sub.shard_float16_groups),
                                  (sub.model_fp32_groups, sub.shard_fp32_groups,
                                   sub.shard_fp32_groups)):
        for model_group, main_group, slice_group in zip(models, mains, slices):
            for model, main, piece in zip(model_group, main_group, slice_group):
                yield model, piece if main is None else main


def slice_bounds(bucket, dp: int) -> list[tuple[int, int]]:
    """The [start, end) buffer range of each DP rank's slice of ``bucket`` (megatron's rule:
    the padded bucket cut into dp equal contiguous parts)."""
    size = bucket.grad_data.numel() // dp
    return [(bucket.offset + r * size, bucket.offset + (r + 1) * size) for r in range(dp)]


def pieces_in_slices(start: int, end: int,
                     bounds: list[tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """DP rank -> the part of buffer range [start, end) (one parameter) inside its slice, for
    the ranks whose slice holds some of it (``bounds``: ``slice_bounds`` of its bucket)."""
    return {rank: (max(start, lo), min(end, hi)) for rank, (lo, hi) in enumerate(bounds)
            if min(end, hi) > max(start, lo)}


def slice_range(sub: DistributedOptimizer, model_param: torch.nn.Parameter) -> range:
    """The elements of ``model_param``'s grad-buffer range that this rank's slice holds, as
    offsets in the buffer ("gbuf_world" in megatron-core's range map)."""
    world = sub._get_model_param_range_map(model_param)["gbuf_world"]
    return range(world.start, world.end)


# ------------------------------------------------ the parameter gather left to the forward


def mark_gathers(chunk) -> None:
    """Under megatron-core's ``overlap_param_gather`` a module's forward pre-hook waits for the
    all-gather of its own parameters. Code that reads another module's weight directly (the
    chunked output head, the absorbed MLA's up projection) calls ``gathered`` on it; this
    gives each of ``chunk``'s parameters what that call waits for (its bucket group's gather,
    dispatched first where it is not yet)."""
    if not chunk.ddp_config.overlap_param_gather:
        return
    skip_next = chunk.ddp_config.align_param_gather  # the schedule dispatches the next ones
    for param, group in chunk.param_to_bucket_group.items():
        param.wait_for_gather = partial(group.finish_param_sync,
                                        skip_next_bucket_dispatch=skip_next)


def gathered(param: torch.Tensor) -> torch.Tensor:
    """``param``, its overlapped all-gather finished (``mark_gathers``; a no-op otherwise)."""
    wait = getattr(param, "wait_for_gather", None)
    if wait is not None:
        wait()
    return param


def drain_gathers(chunks: list) -> None:
    """Finish every parameter gather still in flight before the gradients are finalised: a
    gather dispatched (as the next in megatron-core's chain) but never waited for this step
    must not reach the next step, where megatron-core would dispatch it again and fail. With
    ``gathered`` at every direct weight read none is known to remain; this is the safeguard.
    (Every rank dispatches the gathers in the same order: the chain follows module order,
    and megatron-core's SequentialMLP runs every local expert, tokens or none.)"""
    for chunk in chunks:
        if not chunk.ddp_config.overlap_param_gather:
            continue
        for group in [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups]:
            if group.param_gather_handle is not None:
                group.param_gather_handle.wait()
                group.param_gather_handle = None


@contextmanager
def parameters_gathered(chunks: list):
    """Every parameter whole on this rank inside the block, for reading them outside a
    forward (a checkpoint, a weight version). Under ``parallel.overlap_param_gather`` the
    optimizer step leaves the gather to the next forward's hooks: here megatron-core's hooks
    are taken off, which gathers every bucket now, and put back after (they then run after
    any forward pre-hook registered later; none of those reads weights)."""
    overlapped = [c for c in chunks if getattr(c, "ddp_config", None) is not None
                  and c.ddp_config.overlap_param_gather]
    for chunk in overlapped:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in overlapped:
            chunk.enable_forward_pre_hook()
