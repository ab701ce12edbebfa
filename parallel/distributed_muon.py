"""Zero-redundant distributed Muon on megatron-core's distributed optimizer (GLM-5 report, 2.4).

megatron-core's distributed optimizer (ZeRO-1) gives each data-parallel rank a contiguous 1/dp
slice of every gradient bucket; its slices cut weight matrices at arbitrary points, and Muon
needs whole matrices. Here each matrix has one *owner* among the DP ranks (balanced by
Newton-Schulz cost, preferring the rank that already holds most of the matrix):

1. after megatron's reduce-scatter (and clipping), every rank sends the pieces of its gradient
   slice that belong to matrices it does not own to their owners: one ``all_to_all`` over the DP
   group, about (dp-1)/dp^2 of the Muon gradients per rank;
2. each owner keeps the momentum of its own matrices only (and, for bf16 parameters, their fp32
   master copy), orthogonalises them (Muon Split per head, TP-gathered over its TP peers, who
   own the same matrices) and updates the whole matrix;
3. the parameter all-gather that the distributed optimizer does anyway carries each matrix from
   its owner instead of from the slice holders: per bucket, rank r contributes its slice's
   AdamW elements plus the matrices it owns (an all-gather of uneven parts, without padding:
   every rank still sends (dp-1) x its part, the bucket total is unchanged). No update travels
   back to the slice holders, so the Muon-specific traffic is step 1 alone: at most 1/dp of
   gathering every gradient everywhere, less where an owner already holds its matrix.

``zero_redundant=False`` is that naive reference: every rank gathers the Muon gradient pieces
of every bucket from every rank, orthogonalises every matrix and keeps its own slice
(megatron's usual parameter all-gather then runs); ``bench/muon_comm.py`` compares the two.

AdamW parameters (embedding, head, norms, biases, router) stay elementwise on the slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

from parallel import mcore_compat
from parallel.comm_purpose import collective_purpose
from parallel.device import comm_device
from parallel.distopt_slices import main_param_pairs, pieces_in_slices, slice_bounds
from parallel.muon import MatrixLayout, MuonAdamW, MuonConfig, orthogonal_update


@dataclass
class MatrixSlot:
    """One Muon matrix in a DP-sliced grad buffer (all offsets in the buffer's flat elements)."""

    param: torch.nn.Parameter
    layout: MatrixLayout
    buffer_index: int
    bucket_index: int
    start: int
    end: int
    pieces: dict[int, tuple[int, int]]  # DP rank -> the part of [start, end) in its slice
    cost: float = 0.0
    owner: int = -1
    group_index: int = -1

    def piece_numel(self, rank: int) -> int:
        lo, hi = self.pieces.get(rank, (0, 0))
        return hi - lo


@dataclass
class BucketPlan:
    """Who contributes which elements of one bucket to the parameter all-gather."""

    buffer_index: int
    segments: list[list[tuple[int, int]]] = field(default_factory=list)  # per DP rank

    def numel(self, rank: int) -> int:
        return sum(hi - lo for lo, hi in self.segments[rank])


def newton_schulz_cost(shape: tuple[int, int], layout: MatrixLayout) -> float:
    """Multiply-adds of one Newton-Schulz iteration ~ m * n * min(m, n), per orthogonalised
    block (Muon Split: per head; TP-sharded: the whole gathered matrix)."""
    rows, cols = shape
    if layout.head_blocks:
        per_round = sum(b * cols * min(b, cols) for b in layout.head_blocks)
        return per_round * rows / sum(layout.head_blocks)
    if layout.tp_group is not None:
        tp = dist.get_world_size(layout.tp_group)
        rows, cols = (rows * tp, cols) if layout.tp_dim == 0 else (rows, cols * tp)
    return float(rows * cols * min(rows, cols))


def matrix_slots(buffers: list, layouts: dict[int, MatrixLayout], dp: int) -> list[MatrixSlot]:
    """Every Muon matrix of these buffers with its slice pieces, in buffer order (the same
    order on every DP rank: the buffers are built identically)."""
    slots = []
    for buffer_index, buffer in enumerate(buffers):
        bounds = [slice_bounds(bucket, dp) for bucket in buffer.buckets]
        entries = sorted(buffer.param_index_map.items(), key=lambda item: item[1][0])
        for param, (start, end, bucket_index) in entries:
            layout = layouts.get(id(param))
            if layout is None or not layout.muon:
                continue
            pieces = pieces_in_slices(start, end, bounds[bucket_index])
            slots.append(MatrixSlot(param, layout, buffer_index, bucket_index, start, end, pieces,
                                    newton_schulz_cost(tuple(param.shape), layout)))
    return slots


def assign_owners(slots: list[MatrixSlot], dp: int) -> None:
    """Longest-processing-time-first balance of Newton-Schulz cost over the DP ranks. A matrix
    goes to the rank holding most of it when that keeps the rank within the ideal load (its
    gradient then barely travels); otherwise to the least-loaded rank."""
    loads = [0.0] * dp
    ideal = sum(s.cost for s in slots) / dp
    for slot in sorted(slots, key=lambda s: (-s.cost, s.buffer_index, s.start)):
        cap = max(ideal, slot.cost)
        fitting = [r for r in range(dp) if loads[r] + slot.cost <= cap]
        if fitting:
            owner = max(fitting, key=lambda r: (slot.piece_numel(r), -loads[r], -r))
        else:
            owner = min(range(dp), key=lambda r: (loads[r], r))
        slot.owner = owner
        loads[owner] += slot.cost


def gather_plans(buffers: list, slots: list[MatrixSlot], dp: int) -> list[BucketPlan]:
    """Per bucket: rank r's slice minus the Muon matrices, plus the matrices r owns."""
    plans = []
    for buffer_index, buffer in enumerate(buffers):
        for bucket_index, bucket in enumerate(buffer.buckets):
            inside = [s for s in slots
                      if s.buffer_index == buffer_index and s.bucket_index == bucket_index]
            plan = BucketPlan(buffer_index)
            for rank, (lo, hi) in enumerate(slice_bounds(bucket, dp)):
                segments = _subtract(lo, hi, [(s.start, s.end) for s in inside])
                segments += [(s.start, s.end) for s in inside if s.owner == rank]
                plan.segments.append(segments)
            plans.append(plan)
    return plans


def _subtract(lo: int, hi: int, holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[lo, hi) minus the (sorted, disjoint) holes."""
    out, cursor = [], lo
    for start, end in sorted(holes):
        if end <= cursor or start >= hi:
            continue
        if start > cursor:
            out.append((cursor, start))
        cursor = max(cursor, end)
    if cursor < hi:
        out.append((cursor, hi))
    return out


class DistributedMuon(MuonAdamW):
    """The inner optimizer of one megatron-core ``DistributedOptimizer`` (one DP group)."""

    def __init__(self, sub, layouts: dict[int, MatrixLayout], cfg: MuonConfig,
                 zero_redundant: bool = True) -> None:
        shard_of = dict(main_param_pairs(sub))
        shard_layouts = {id(shard): layouts[id(model)] for model, shard in shard_of.items()}
        # The slices are views (not leaves), which torch's constructor refuses; megatron-core
        # assigns its groups the same way after constructing its own inner optimizer.
        super().__init__([{"params": [torch.zeros(1, requires_grad=True)]}], shard_layouts, cfg)
        self.param_groups = sub.optimizer.param_groups
        self.group = sub.data_parallel_group
        self.rank, self.dp = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.zero_redundant = zero_redundant
        self.buffers = sub.buffers
        self.shard_of = shard_of
        self.slots = matrix_slots(self.buffers, layouts, self.dp)
        _resolve_group_indices(self.slots, sub, self.group)
        if zero_redundant:
            assign_owners(self.slots, self.dp)
            self.plans = gather_plans(self.buffers, self.slots, self.dp)
        else:
            for slot in self.slots:
                slot.owner = self.rank  # every rank updates every matrix
        self.owned = [s for s in self.slots if s.owner == self.rank]
        self.matrix_state: dict[int, dict[str, torch.Tensor]] = {}

    # ---- state -------------------------------------------------------------------------------

    def init_state(self, *_: object) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if not self.layouts[id(param)].muon:
                    self._adamw_state(param)
        for slot in self.owned:
            self._matrix_state(slot)

    def _matrix_state(self, slot: MatrixSlot) -> dict[str, torch.Tensor]:
        state = self.matrix_state.setdefault(id(slot.param), {})
        if not state:
            state["momentum_buffer"] = torch.zeros(slot.param.shape, dtype=torch.float32,
                                                   device=slot.param.device)
            if slot.param.dtype != torch.float32:  # the fp32 master lives with the owner
                state["master"] = slot.param.detach().float().clone()
        return state

    # ---- checkpoint ----------------------------------------------------------------------------

    def saver_of(self, slot: MatrixSlot) -> int:
        """The DP rank that writes this matrix's state into a checkpoint: its owner (in the
        naive reference every rank holds every matrix's state; DP rank 0 writes it)."""
        return slot.owner if self.zero_redundant else 0

    def holds(self, slot: MatrixSlot) -> bool:
        """Whether this rank keeps the matrix's momentum (and fp32 master)."""
        return slot.owner == self.rank

    def matrix_state_of(self, slot: MatrixSlot) -> dict[str, torch.Tensor]:
        """The state this rank keeps for a matrix it holds: ``momentum_buffer`` and, for
        bf16/fp16 parameters, the fp32 ``master`` (allocated if it has not stepped yet)."""
        if not self.holds(slot):
            raise ValueError(f"rank {self.rank} does not hold the state of {slot.layout.name}")
        return self._matrix_state(slot)

    # ---- step --------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        if not self.zero_redundant:
            self._step_adamw()
            grads = self._gradients_everywhere()
            for slot in self.owned:
                self._update_matrix(slot, grads[id(slot.param)])
            return
        # Overlap: the pieces travel while AdamW runs and while the owner orthogonalises the
        # matrices it already holds whole.
        exchange = self._send_pieces_to_owners()
        self._step_adamw()
        held_whole = [s for s in self.owned if set(s.pieces) == {self.rank}]
        for slot in held_whole:
            self._update_matrix(slot, self._local_piece(slot))
        received = exchange()
        for slot in self.owned:
            if set(slot.pieces) != {self.rank}:
                self._update_matrix(slot, self._assemble(slot, received))

    def _step_adamw(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None and not self.layouts[id(param)].muon:
                    self._adamw(param, group)

    def _local_piece(self, slot: MatrixSlot) -> torch.Tensor:
        grad = self.shard_of[slot.param].grad
        return grad.reshape(-1).float()

    @collective_purpose("muon_grad_to_owners")
    def _send_pieces_to_owners(self):
        """Start one all_to_all sending every slice piece of a matrix to the matrix's owner;
        returns a function that waits and gives, per source rank, the pieces it sent here (in
        ``self.owned`` order)."""
        sends = [[] for _ in range(self.dp)]
        for slot in self.slots:
            if slot.owner != self.rank and self.rank in slot.pieces:
                sends[slot.owner].append(self._local_piece(slot))
        # A rank may hold no parameters of this optimizer (a loss-only pipeline stage has no
        # experts) and still takes part in the exchange with its data-parallel peers.
        device = self.buffers[0].grad_data.device if self.buffers else comm_device()
        in_splits = [sum(t.numel() for t in parts) for parts in sends]
        out_splits = [sum(s.piece_numel(src) for s in self.owned) if src != self.rank else 0
                      for src in range(self.dp)]
        flat = [t for parts in sends for t in parts]
        send = torch.cat(flat) if flat else torch.empty(0, device=device)
        recv = torch.empty(sum(out_splits), dtype=torch.float32, device=device)
        work = (dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group,
                                       async_op=True) if self.dp > 1 else None)

        def finish() -> list[torch.Tensor]:
            if work is not None:
                work.wait()
            return list(torch.split(recv, out_splits))
        return finish

    def _assemble(self, slot: MatrixSlot, received: list[torch.Tensor]) -> torch.Tensor:
        """The whole gradient of an owned matrix from its pieces (consumes ``received``)."""
        full = torch.empty(slot.end - slot.start, dtype=torch.float32, device=slot.param.device)
        for rank, (lo, hi) in slot.pieces.items():
            if rank == self.rank:
                piece = self._local_piece(slot)
            else:
                piece, received[rank] = received[rank][:hi - lo], received[rank][hi - lo:]
            full[lo - slot.start:hi - slot.start] = piece
        return full

    @collective_purpose("muon_grad_all_gather")
    def _gradients_everywhere(self) -> dict[int, torch.Tensor]:
        """The naive reference: per bucket, every rank's Muon gradient pieces to every rank."""
        grads = {id(s.param): torch.empty(s.end - s.start, dtype=torch.float32,
                                          device=s.param.device) for s in self.slots}
        by_bucket: dict[tuple[int, int], list[MatrixSlot]] = {}
        for slot in self.slots:
            by_bucket.setdefault((slot.buffer_index, slot.bucket_index), []).append(slot)
        for inside in by_bucket.values():
            mine = [self._local_piece(s) for s in inside if self.rank in s.pieces]
            sizes = [sum(s.piece_numel(r) for s in inside) for r in range(self.dp)]
            payload = torch.cat(mine) if mine else torch.empty(0, device=inside[0].param.device)
            for rank, part in enumerate(all_gather_uneven(payload, sizes, self.group)):
                for slot in inside:
                    if rank in slot.pieces:
                        lo, hi = slot.pieces[rank]
                        grads[id(slot.param)][lo - slot.start:hi - slot.start] = part[:hi - lo]
                        part = part[hi - lo:]
        return grads

    def _update_matrix(self, slot: MatrixSlot, grad: torch.Tensor) -> None:
        state, cfg = self._matrix_state(slot), self.cfg
        group = self.param_groups[slot.group_index]
        grad = grad.view(slot.param.shape)
        buf = state["momentum_buffer"]
        buf.mul_(cfg.momentum).add_(grad)
        update = grad.add(buf, alpha=cfg.momentum) if cfg.nesterov else buf
        ortho = orthogonal_update(update, slot.layout, cfg.ns_steps)
        master = state.get("master", slot.param.data)
        master.mul_(1 - group["lr"] * group["weight_decay"])
        master.add_(ortho, alpha=-group["lr"])
        if master is not slot.param.data:
            slot.param.data.copy_(master)
        self._refresh_local_slice(slot, master)

    def _refresh_local_slice(self, slot: MatrixSlot, master: torch.Tensor) -> None:
        """Keep megatron's main-parameter slice of this matrix current: it copies it into the
        parameter buffer after the step (bf16: a separate fp32 tensor; fp32: a view)."""
        shard = self.shard_of.get(slot.param)
        if shard is None or self.rank not in slot.pieces:
            return
        lo, hi = slot.pieces[self.rank]
        shard.data.copy_(master.reshape(-1)[lo - slot.start:hi - slot.start])

    # ---- parameter redistribution --------------------------------------------------------------

    @torch.no_grad()
    @collective_purpose("param_all_gather")
    def redistribute(self) -> None:
        """The distributed optimizer's parameter all-gather, with each Muon matrix taken from
        its owner (zero-redundant mode; replaces megatron-core's own all-gather)."""
        for slot in self.owned:
            if "master" in self.matrix_state.get(id(slot.param), {}):
                slot.param.data.copy_(self.matrix_state[id(slot.param)]["master"])
        for plan in self.plans:
            data = self.buffers[plan.buffer_index].param_data
            sizes = [plan.numel(r) for r in range(self.dp)]
            mine = [data[lo:hi] for lo, hi in plan.segments[self.rank]]
            payload = torch.cat(mine) if mine else data[:0]
            for rank, part in enumerate(all_gather_uneven(payload, sizes, self.group)):
                if rank == self.rank:
                    continue
                for lo, hi in plan.segments[rank]:
                    data[lo:hi].copy_(part[:hi - lo])
                    part = part[hi - lo:]


def all_gather_uneven(payload: torch.Tensor, sizes: list[int], group) -> list[torch.Tensor]:
    """All-gather of per-rank payloads of different sizes (``sizes``, known everywhere) without
    padding: one all_to_all sending this rank's payload to each other rank, so each rank sends
    (dp-1) x its own payload, as a ring all-gather would. Entry ``rank`` of the result is
    that rank's payload (this rank's own: ``payload`` itself)."""
    rank, dp = dist.get_rank(group), dist.get_world_size(group)
    if dp == 1:
        return [payload]
    in_splits = [0 if r == rank else payload.numel() for r in range(dp)]
    out_splits = [0 if r == rank else sizes[r] for r in range(dp)]
    send = payload.repeat(dp - 1)
    recv = torch.empty(sum(out_splits), dtype=payload.dtype, device=payload.device)
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    parts = list(torch.split(recv, out_splits))
    parts[rank] = payload
    return parts


def install_distributed_muon(sub, layouts: dict[int, MatrixLayout], cfg: MuonConfig,
                             zero_redundant: bool) -> DistributedMuon:
    """Make ``sub`` (a megatron-core DistributedOptimizer) step with distributed Muon. In the
    zero-redundant mode its parameter all-gather is ours (matrices from their owners)."""
    inner = DistributedMuon(sub, layouts, cfg, zero_redundant)
    mcore_compat.replace_attribute(sub, "optimizer", inner)
    mcore_compat.replace_attribute(sub, "init_state_fn", inner.init_state)
    if zero_redundant:
        mcore_compat.override_method(sub, "step_with_ready_grads",
                                     partial(_step_and_redistribute, sub, inner))
    return inner


def _step_and_redistribute(sub, inner: DistributedMuon) -> bool:
    # megatron-core's mixed-precision step (inner step, main -> model copy) without the
    # distributed optimizer's own parameter all-gather, which ``redistribute`` replaces.
    ok = MixedPrecisionOptimizer.step_with_ready_grads(sub)
    inner.redistribute()
    return ok


@collective_purpose("muon_setup")
def _resolve_group_indices(slots: list[MatrixSlot], sub, group) -> None:
    """Each matrix's optimizer param group (its lr and weight decay). megatron-core records it
    only on ranks holding a slice of the matrix, so the DP ranks pool what they know."""
    known = torch.zeros(len(slots), dtype=torch.int64,
                        device=sub.buffers[0].grad_data.device if sub.buffers else None)
    for index, slot in enumerate(slots):
        entry = sub.model_param_group_index_map.get(slot.param)
        if entry is not None:
            known[index] = entry[0] + 1
    if dist.get_world_size(group) > 1:
        dist.all_reduce(known, op=dist.ReduceOp.MAX, group=group)
    for index, slot in enumerate(slots):
        slot.group_index = int(known[index]) - 1
