"""A two-level all-to-all (inside each node, then across nodes) equal to one flat
``all_to_all_single`` over a process group, its process groups, and the sequence <-> head
re-sharding that head-parallel (Ulysses-style) context parallelism builds on it.

The flat exchange: each of the c ranks of ``group`` holds x [c, ...]; row j goes to group rank
j, and rank i's output row j is what rank j sent to i (equal splits). Every byte bound for
another node crosses the network once either way; the two-level form sends it in fewer, larger
messages: with the c ranks on M nodes of L ranks each (group rank g = a x L + b: node a, local
index b, the group's ranks in increasing global order),

1. intra-node: rank (a, b) sends its node peer (a, b') every row bound for local index b' on any
   node (all_to_all over the node's L ranks), so (a, b') holds the rows of its whole node bound
   for (*, b');
2. inter-node: (a, b') sends node a'' the rows bound for (a'', b') (all_to_all over the M ranks
   with local index b'), which delivers every row to its destination.

Bytes each rank sends for an input of E bytes: flat (c - 1) / c x E, of which (c - L) / c x E
leaves the node; two-level (L - 1) / L x E inside the node and (M - 1) / M x E = (c - L) / c x E
across nodes: the same inter-node bytes in M - 1 messages of L x E / c instead of c - L messages
of E / c, for (L - 1) / L - (L - 1) / c x E more intra-node bytes. The payload is cut into
``pieces`` column slices: the inter-node exchange of one piece is in flight while the next
piece's intra-node exchange and the local re-ordering run (asynchronous ops on two groups;
NCCL runs them on separate communicators, gloo on separate worker threads).

Groups are built once, at start-up, by every rank of the default group (``build_exchange``):
each node's share of every group of the same kind (e.g. every context-parallel group) becomes
an intra-node group, each local index's share an inter-node group. A node is ``node_size``
consecutive global ranks (torchrun / slurm place ranks so). ``node_split`` refuses a group whose
ranks do not fill every node it touches equally.

``AllToAll`` is the autograd Function (the all-to-all with equal splits is its own inverse, so
the backward is the same exchange of the gradient); ``sequence_to_heads`` / ``heads_to_sequence``
re-shard [T, B, N, D] (T = S / c rows of every head) <-> [c x T, B, N / c, D] (every rank's rows,
rank-major, of N / c heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.comm_purpose import collective_purpose

# Column slices the two-level exchange pipelines (inter-node exchange of slice p overlapped
# with the intra-node exchange of slice p + 1): 2 already overlaps half of each level with the
# other; more slices add per-message latency for little more overlap.
DEFAULT_PIECES = 2


def group_ranks(group) -> list[int]:
    """Global ranks of ``group``, by group rank."""
    return [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]


def node_split(ranks: list[int], node_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(intra-node rank lists, inter-node rank lists) of the group with global ``ranks`` (by
    group rank) on nodes of ``node_size`` consecutive global ranks: one list per node (its
    ranks, by group rank) and one per local index (that index's rank on every node)."""
    if node_size < 1:
        raise ValueError(f"node size {node_size} must be >= 1 (ranks per node)")
    nodes: dict[int, list[int]] = {}
    for rank in ranks:
        nodes.setdefault(rank // node_size, []).append(rank)
    per_node = {len(members) for members in nodes.values()}
    node_major = [r for members in nodes.values() for r in members] == list(ranks)
    if len(per_node) != 1 or not node_major:
        raise ValueError(
            f"a group of global ranks {list(ranks)} on nodes of {node_size} ranks holds "
            f"{[len(m) for m in nodes.values()]} ranks on its nodes {sorted(nodes)}: the "
            "two-level all-to-all needs the same number of them on every node, in node order; "
            "choose a node size that is a multiple or a divisor of the group's rank stride x "
            "size (e.g. the GPUs per node), or no node size (one flat all-to-all)")
    intra = list(nodes.values())
    local = len(intra[0])
    inter = [[members[b] for members in intra] for b in range(local)]
    return intra, inter


@dataclass(frozen=True)
class Exchange:
    """This rank's all-to-all over ``group``: flat, or in two levels (``intra`` over its node's
    ``per_node`` ranks, then ``inter`` over the ``nodes`` ranks with its local index)."""

    group: object
    size: int
    per_node: int  # L; size when flat
    nodes: int  # M; 1 when flat
    intra: object | None = None
    inter: object | None = None
    pieces: int = DEFAULT_PIECES

    @property
    def two_level(self) -> bool:
        return self.intra is not None and self.inter is not None

    @collective_purpose("head_all_to_all")
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The flat all-to-all of ``x`` [size, ...] (row j to group rank j): [size, ...], row i
        from group rank i. Not differentiable (``AllToAll`` is)."""
        if x.shape[0] != self.size:
            raise ValueError(f"all-to-all input has {x.shape[0]} rows, the group {self.size} "
                             "ranks: one row per destination rank")
        x = x.contiguous()
        if not self.two_level:
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x, group=self.group)
            return out
        return self._two_level(x.view(self.nodes, self.per_node, -1)).view(x.shape)

    @collective_purpose("head_all_to_all")
    def _two_level(self, x_MLE: torch.Tensor) -> torch.Tensor:
        """Rows [destination node a', destination local index b', E] -> [source node a, source
        local index b, E], piece by piece, inter-node exchange of piece p in flight while piece
        p + 1 goes through its node."""
        out_MLE = torch.empty_like(x_MLE)
        width = x_MLE.shape[-1]
        step = max(1, -(-width // max(1, self.pieces)))
        in_flight = None
        for e0 in range(0, width, step):
            e1 = min(width, e0 + step)
            # Level 1: to node peer b' everything bound for local index b' (any node).
            send_LME = x_MLE[:, :, e0:e1].transpose(0, 1).contiguous()
            recv_LME = torch.empty_like(send_LME)
            dist.all_to_all_single(recv_LME, send_LME, group=self.intra, async_op=True).wait()
            # Level 2: to node a'' what this node's ranks bound for (a'', my local index).
            send_MLE = recv_LME.transpose(0, 1).contiguous()
            recv_MLE = torch.empty_like(send_MLE)
            work = dist.all_to_all_single(recv_MLE, send_MLE, group=self.inter, async_op=True)
            if in_flight is not None:
                _land(out_MLE, *in_flight)
            in_flight = (work, recv_MLE, e0, e1)
        if in_flight is not None:
            _land(out_MLE, *in_flight)
        return out_MLE


def _land(out_MLE: torch.Tensor, work, recv_MLE: torch.Tensor, e0: int, e1: int) -> None:
    work.wait()
    out_MLE[:, :, e0:e1] = recv_MLE


def flat_exchange(group) -> Exchange:
    size = dist.get_world_size(group)
    return Exchange(group, size, per_node=size, nodes=1)


@collective_purpose("head_all_to_all_setup")
def build_exchange(group, node_size: int | None, pieces: int = DEFAULT_PIECES) -> Exchange:
    """This rank's ``Exchange`` over ``group``; with a ``node_size``, the two-level groups of
    every group like it. Collective over the default group: every rank calls it once, at
    start-up, with its own group of the same kind (all ranks learn all such groups and create
    their node and local-index groups in one order, as ``torch.distributed.new_group``
    requires). Without a node size, or when the group sits on one node or one rank per node,
    the exchange is the flat all-to-all over ``group`` (no new group)."""
    if node_size is None:
        return flat_exchange(group)
    mine = group_ranks(group)
    everyone: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    intra_group = inter_group = None
    split = None
    for ranks in sorted({tuple(r) for r in everyone}):
        intra, inter = node_split(list(ranks), node_size)
        if len(intra) == 1 or len(inter) == 1:
            continue  # one level only: the group itself
        for members in [*intra, *inter]:
            created = dist.new_group(members)
            if dist.get_rank() in members:
                if members in intra:
                    intra_group, split = created, (len(intra[0]), len(intra))
                else:
                    inter_group = created
    if split is None:
        return flat_exchange(group)
    per_node, nodes = split
    return Exchange(group, len(mine), per_node, nodes, intra_group, inter_group, pieces)


def level_bytes(op: str, payload: int, size: int, per_node: int,
                two_level: bool = False) -> dict[str, float]:
    """Bytes one rank sends inside its node ("intra") and to other nodes ("inter") in one
    collective over ``size`` ranks, ``per_node`` per node (node-major), for ``payload`` bytes
    handed to the call (``parallel/comm_meter.py``'s payload: all_gather's local input, the
    whole input of all_to_all and reduce_scatter). intra + inter is what the meter counts.

    - ``all_to_all`` flat: direct sends, row j (payload / size) to rank j: L - 1 rows stay on
      the node, size - L leave it; ``two_level`` (this module): (L - 1) / L x payload inside,
      (M - 1) / M x payload across (exact, integers).
    - ``all_gather`` / ``reduce_scatter`` (run flat over the group): the ring algorithm's
      bytes, (size - 1) x payload / (size - 1) / size x payload, of which the ring's links that
      cross nodes (M of its size links, none on one node) carry their share: the per-rank
      average (a model; NCCL rotates rings so that every NIC carries about that much)."""
    nodes = size // per_node
    if op == "all_to_all":
        row = payload // size
        if two_level:
            return {"intra": row * nodes * (per_node - 1), "inter": row * per_node * (nodes - 1)}
        return {"intra": row * (per_node - 1), "inter": row * (size - per_node)}
    if op == "all_gather":
        total = (size - 1) * payload
    elif op == "reduce_scatter":
        total = payload - payload // size
    else:
        raise ValueError(f"level_bytes: no model for {op!r}")
    crossing = nodes / size if nodes > 1 else 0.0
    return {"intra": total * (1 - crossing), "inter": total * crossing}


class AllToAll(torch.autograd.Function):
    """``exchange(x)``, differentiable: the gradient goes back by the same exchange (the
    equal-split all-to-all is its own inverse: row j of rank i <-> row i of rank j)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, exchange: Exchange) -> torch.Tensor:
        ctx.exchange = exchange
        return exchange(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.exchange(grad), None


def sequence_to_heads(x_TBND: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """[T, B, N, D] (this rank's rows, every head) -> [c x T, B, N / c, D]: every rank's rows,
    rank-major, of this rank's N / c heads (head group = group rank). Differentiable."""
    rows, batch, heads, width = x_TBND.shape
    c = exchange.size
    if heads % c:
        raise ValueError(f"{heads} heads cannot be split over {c} ranks")
    send = x_TBND.reshape(rows, batch, c, heads // c, width).permute(2, 0, 1, 3, 4)
    out = AllToAll.apply(send.contiguous(), exchange)  # [source rank, T, B, N / c, D]
    return out.reshape(c * rows, batch, heads // c, width)


def heads_to_sequence(x_SBnD: torch.Tensor, exchange: Exchange) -> torch.Tensor:
    """Inverse of ``sequence_to_heads``: [c x T, B, N / c, D] (rank-major rows) -> [T, B, N, D]
    (this rank's rows, every head). Differentiable."""
    seq, batch, heads, width = x_SBnD.shape
    c = exchange.size
    send = x_SBnD.reshape(c, seq // c, batch, heads, width)
    out = AllToAll.apply(send.contiguous(), exchange)  # [head group, T, B, N / c, D]
    return out.permute(1, 2, 0, 3, 4).reshape(seq // c, batch, c * heads, width)
