"""Context parallelism's exchange: keys and rules (the technique: parallel/context_parallel.py,
glm5_train/model/head_parallel_cp.py and parallel/hierarchical_all_to_all.py)."""

from __future__ import annotations

from dataclasses import dataclass

from parallel.hierarchical_all_to_all import node_split
from parallel.layout_error import LayoutError

CP_COMMS = ("all_gather", "head_parallel")


@dataclass
class ContextCommOptions:
    """``parallel.*`` keys of context parallelism's exchange (part of ParallelConfig)."""

    # With context_parallel_size > 1: "all_gather" (queries stay on their sequence shard, the
    # latent and indexer keys are all-gathered) or "head_parallel" (Ulysses: queries go to
    # head shards over the whole sequence by all-to-all, outputs come back;
    # glm5_train/model/head_parallel_cp.py). head_parallel's all-to-all runs in two levels with
    # cp_node_size (global ranks per node: inside each node, then across nodes;
    # parallel/hierarchical_all_to_all.py); null: one flat all-to-all over the CP group.
    cp_comm: str = "all_gather"
    cp_node_size: int | None = None


def check_context_comm(par, heads: int, world_size: int) -> None:
    """parallel.cp_comm / cp_node_size against the layout ``par`` (a ParallelConfig) and the
    model's ``heads`` attention heads: the head split and the node split the head-parallel
    all-to-all needs (checked again on the real groups when they are built, ``node_split``)."""
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
    if (heads // tp) % cp:
        raise LayoutError(
            f"parallel.cp_comm=head_parallel splits the {heads // tp} attention heads of each "
            f"tensor-parallel rank (model.num_attention_heads={heads} / TP {tp}) over "
            f"context_parallel_size={cp} ranks: pick a CP size dividing {heads // tp} or "
            "parallel.cp_comm=all_gather")
    if node is not None:
        _check_node_size(node, tp, cp, world_size)


def _check_node_size(node: int, tp: int, cp: int, world_size: int) -> None:
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
