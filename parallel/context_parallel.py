"""Context parallelism by sequence sharding with causal load balancing, without Transformer
Engine: which tokens a context-parallel (CP) rank holds, and the collectives that give each
rank the whole sequence's keys.

Zigzag sharding (megatron-core's convention, so that its rotary and MTP-roll helpers agree):
a sequence of S tokens is cut into 2c chunks of S / 2c for a CP group of c ranks, and rank r
holds chunks r and 2c - 1 - r, in that order. Under causal attention the early chunk sees few
keys and the late one many, so every rank does the same attention work. The global positions
a rank holds increase along its local rows (``zigzag_positions``).

Keys cross ranks by all-gather: each rank keeps its own queries and gathers what every query
may attend to (for MLA + DSA the 576-wide latent and the 128-wide indexer key per token).
``gather_sequence`` returns the gathered tensor in natural (global position) order; its
backward reduce-scatters the gradient, so each rank receives the sum over all ranks' queries
of the gradient of its own keys. Bytes per call for a local [S/c, ...] tensor of E bytes:
all-gather (c - 1) x E sent by each rank, and the same again in backward.

``ContextShard`` describes one rank's share for code that needs positions (masks, RoPE,
top-k windows); it knows nothing of any model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.comm_purpose import collective_purpose


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def check_shardable(seq_length: int, cp_size: int, split: int = 1) -> None:
    """Zigzag needs 2 x CP chunks, each divisible by the sequence-parallel split."""
    unit = 2 * cp_size * split
    if cp_size > 1 and seq_length % unit:
        raise ValueError(
            f"train.seq_length={seq_length} is not divisible by 2 x context_parallel_size"
            f"{' x TP (sequence parallel)' if split > 1 else ''} = {unit}: context parallelism "
            f"cuts each sequence into {2 * cp_size} equal chunks; pad the sequence to a "
            f"multiple of {unit} or change parallel.context_parallel_size")


def zigzag_positions(seq: int, cp_size: int, cp_rank: int,
                     device: torch.device | None = None) -> torch.Tensor:
    """Global positions [seq / cp_size] held by ``cp_rank``, increasing."""
    check_shardable(seq, cp_size)
    chunk = seq // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = 2 * cp_size - 1 - cp_rank
    second = torch.arange(last * chunk, (last + 1) * chunk, device=device)
    return torch.cat([first, second])


def natural_order(seq: int, cp_size: int, device: torch.device | None = None) -> torch.Tensor:
    """For rank-major gathered rows (rank 0's local rows, then rank 1's, ...), the row that
    holds each global position 0..seq-1."""
    rank_major = torch.cat([zigzag_positions(seq, cp_size, r, device) for r in range(cp_size)])
    return torch.argsort(rank_major)


def shard_sequence(t: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's zigzag share of ``t`` along ``dim`` (a full sequence)."""
    if cp_size == 1:
        return t
    index = zigzag_positions(t.shape[dim], cp_size, cp_rank, t.device)
    return t.index_select(dim, index)


@dataclass(frozen=True)
class ContextShard:
    """One rank's share of a sequence: ``positions`` [local] of the ``seq`` global tokens."""

    group: object
    size: int
    rank: int
    seq: int
    positions: torch.Tensor

    @property
    def local(self) -> int:
        return self.positions.numel()

    @property
    def is_split(self) -> bool:
        return self.size > 1


def context_shard(group, local: int, device: torch.device) -> ContextShard:
    """The shard of a rank of ``group`` holding ``local`` tokens of each sequence (a group of
    size 1 or None: the whole sequence, positions 0..local-1)."""
    size, rank = group_size(group), group_rank(group)
    seq = local * size
    positions = (zigzag_positions(seq, size, rank, device) if size > 1
                 else torch.arange(local, device=device))
    return ContextShard(group, size, rank, seq, positions)


def _all_gather_rows(local: torch.Tensor, group) -> torch.Tensor:
    """[size x local rows, ...] rank-major, along dim 0."""
    size = group_size(group)
    local = local.contiguous()
    out = torch.empty((size * local.shape[0], *local.shape[1:]), dtype=local.dtype,
                      device=local.device)
    dist.all_gather_into_tensor(out, local, group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 into natural order; backward: reduce-scatter back."""

    @staticmethod
    @collective_purpose("key_all_gather")
    def forward(ctx, local: torch.Tensor, group, order: torch.Tensor):
        ctx.group, ctx.order = group, order
        return _all_gather_rows(local, group).index_select(0, order)

    @staticmethod
    @collective_purpose("key_grad_reduce_scatter")
    def backward(ctx, grad: torch.Tensor):
        size = group_size(ctx.group)
        rank_major = torch.empty_like(grad).index_copy_(0, ctx.order, grad)
        out = torch.empty((grad.shape[0] // size, *grad.shape[1:]), dtype=grad.dtype,
                          device=grad.device)
        dist.reduce_scatter_tensor(out, rank_major.contiguous(), group=ctx.group)
        return out, None, None


def gather_sequence(local: torch.Tensor, shard: ContextShard, dim: int = 0) -> torch.Tensor:
    """The whole sequence of ``local`` (this rank's zigzag share along ``dim``) in natural
    order, differentiable (backward: reduce-scatter). Identity without a split."""
    if not shard.is_split:
        return local
    order = natural_order(shard.seq, shard.size, local.device)
    moved = local.movedim(dim, 0)
    return _GatherSequence.apply(moved, shard.group, order).movedim(0, dim)


@collective_purpose("sequence_all_gather")
def gather_sequence_no_grad(local: torch.Tensor, shard: ContextShard,
                            dim: int = 0) -> torch.Tensor:
    """``gather_sequence`` for tensors without gradient (token ids, masks)."""
    if not shard.is_split:
        return local
    order = natural_order(shard.seq, shard.size, local.device)
    with torch.no_grad():
        return _all_gather_rows(local.movedim(dim, 0), shard.group).index_select(
            0, order).movedim(0, dim)
