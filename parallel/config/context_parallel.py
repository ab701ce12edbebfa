"""Context parallelism's exchange: keys and rules (the technique: parallel/context_parallel.py,
glm5_train/model/head_parallel_cp.py and parallel/hierarchical_all_to_all.py)."""

from __future__ import annotations

from dataclasses import dataclass

from parallel.hierarchical_all_to_all import node_split
from parallel.layout_error import LayoutError

CP_COMMS = ("all_gather", "head_parallel", "auto")


@dataclass
class ContextCommOptions:
    """``parallel.*`` keys of context parallelism's exchange (part of ParallelConfig)."""

    # With context_parallel_size > 1: "all_gather" (queries stay on their sequence shard, the
    # latent and indexer keys are all-gathered) or "head_parallel" (Ulysses: queries go to
    # head shards over the whole sequence by all-to-all, outputs come back;
    # glm5_train/model/head_parallel_cp.py). head_parallel's all-to-all runs in two levels with
    # cp_node_size (global ranks per node: inside each node, then across nodes;
    # parallel/hierarchical_all_to_all.py); null: one flat all-to-all over the CP group.
    # "auto": per CP group (the fixed one, or each flexible group), the mode whose bytes per
    # link level take less time at the rates below (glm5_train/model/head_parallel_cp.
    # choose_exchange); groups that cannot split the heads run all_gather.
    cp_comm: str = "all_gather"
    cp_node_size: int | None = None
    # What one rank's links carry per direction, GB/s, for cp_comm=auto: inside a node
    # (H100 NVLink 4: 450) and across nodes (one 400 Gb/s NIC per GPU: 50).
    cp_intra_node_gbs: float = 450.0
    cp_inter_node_gbs: float = 50.0


def check_context_comm(par, heads: int, world_size: int, dp: int = 1) -> None:
    """parallel.cp_comm / cp_node_size / the link rates against the layout ``par`` (a
    ParallelConfig, ``dp`` data-parallel ranks) and the model's ``heads`` attention heads: the
    head split and the node split the head-parallel all-to-all needs, on the fixed CP groups or
    on every flexible group (checked again on the real groups when they are built)."""
    if par.cp_comm not in CP_COMMS:
        raise LayoutError(f"parallel.cp_comm={par.cp_comm!r}: use one of {list(CP_COMMS)}")
    for name in ("cp_intra_node_gbs", "cp_inter_node_gbs"):
        if not getattr(par, name) > 0:
            raise LayoutError(f"parallel.{name}={getattr(par, name)} must be > 0 (GB/s a "
                              "rank's link carries per direction)")
    node = par.cp_node_size
    if node is not None and par.cp_comm == "all_gather":
        raise LayoutError(f"parallel.cp_node_size={node} sets the nodes of the head-parallel "
                          "all-to-all, but parallel.cp_comm='all_gather' has none: set "
                          "parallel.cp_comm=head_parallel (or auto) or parallel.cp_node_size=null")
    if par.cp_comm == "all_gather":
        return
    tp = par.tensor_model_parallel_size
    flexible = par.cp_groups == "flexible"
    cp = par.flexible_cp_max_size if flexible else par.context_parallel_size
    where = ("parallel.flexible_cp_max_size" if flexible else "context_parallel_size")
    if par.cp_comm == "head_parallel" and (heads // tp) % cp:
        raise LayoutError(
            f"parallel.cp_comm=head_parallel splits the {heads // tp} attention heads of each "
            f"tensor-parallel rank (model.num_attention_heads={heads} / TP {tp}) over "
            f"{where}={cp} ranks: pick a CP size dividing {heads // tp}, or "
            "parallel.cp_comm=all_gather (or auto: all-gather where the heads do not split)")
    if node is not None:
        groups = (flexible_group_rank_lists(par, dp, world_size) if flexible
                  else context_parallel_rank_lists(tp, par.context_parallel_size, world_size))
        _check_node_size(node, groups, world_size)


def _check_node_size(node: int, groups: list[list[int]], world_size: int) -> None:
    if node < 1 or world_size % node:
        raise LayoutError(f"parallel.cp_node_size={node} must be a positive divisor of the "
                          f"world size {world_size} (global ranks per node, e.g. GPUs per "
                          "node), or null (one flat all-to-all)")
    for ranks in groups:
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


def flexible_group_rank_lists(par, dp: int, world_size: int) -> list[list[int]]:
    """Global ranks of every flexible CP group (aligned power-of-two blocks, sizes 2 ..
    flexible_cp_max_size, of every data-parallel group) under megatron-core's default order
    with context_parallel_size 1: data-parallel ranks base + TP x j, j < dp."""
    tp = par.tensor_model_parallel_size
    dp_groups = [[outer * tp * dp + t + tp * j for j in range(dp)]
                 for outer in range(world_size // (tp * dp)) for t in range(tp)]
    out, size = [], 2
    while size <= min(par.flexible_cp_max_size, dp):
        out += [ranks[first:first + size] for ranks in dp_groups
                for first in range(0, dp, size)]
        size *= 2
    return out
