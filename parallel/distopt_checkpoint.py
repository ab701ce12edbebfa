"""megatron-core's distributed optimizer (ZeRO-1, distributed Muon, Pipeline ZeRO2) in a
distributed checkpoint, in model space: every parameter's optimizer tensors are saved whole,
under the parameter's own global key and sharding metadata, so they load into any TP / PP / VPP /
EP / DP layout (and across EP = 1 <-> EP > 1: nothing depends on how megatron-core splits its
optimizers).

Why not megatron-core's own format: with torch's Adam (no Transformer Engine or Apex) its
distributed-optimizer checkpoint path does not resume (four bugs, recorded with staleness checks
in ``parallel/mcore_compat.py`` ``DISTOPT_CHECKPOINT_BUGS``), and its formats hold only
``param`` / ``exp_avg`` / ``exp_avg_sq``: distributed Muon's owner-held momentum has no place.

Saved, per parameter of the optimizer's buffers (dist_checkpointing keys
``optimizer.state.<name>.<parameter key>``, the names megatron-core's other optimizers use):

- ``exp_avg``, ``exp_avg_sq``: the AdamW moments (torch's AdamW inside megatron-core, or the
  AdamW part of distributed Muon: embedding, head, norms, router);
- ``momentum_buffer``: a Muon matrix's momentum, as distributed Muon's owner keeps it;
- ``fp32_param``: bf16 / fp16 parameters' fp32 master (megatron-core's slices; a Muon matrix's
  owner-held master);
- ``adam_step`` (one number, in the common state): the AdamW step count, the same for every
  parameter.

Saving: the distributed optimizer cuts parameters at arbitrary points of its DP slices, and
dist_checkpointing 0.16.1 refuses flattened pieces (``flattened_range``), so each parameter has
one *saver* in its data-parallel group: a Muon matrix's owner (it holds the state whole), for
other parameters the rank holding most of it, to which the other holders send their pieces in
one ``all_to_all`` per group (a rank sends at most its own slice of the state). The saver writes
the tensors as ShardedTensors (or factories: SwiGLU halves, experts) of the model parameter's
metadata with the data-parallel coordinate of ``replica_id`` set to 0, so exactly one copy of
each is written. Loading: every rank reads the whole tensors of the parameters it holds a
slice of (Muon owners: of the matrices they own) and keeps its part.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensor
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

from parallel.comm_purpose import collective_purpose
from parallel.device import comm_device
from parallel.distopt_slices import (
    distributed_optimizers,
    main_param_pairs,
    pieces_in_slices,
    slice_bounds,
)
from parallel.distributed_muon import DistributedMuon, MatrixSlot
from parallel.host_optimizer import HostOffloadedOptimizer

PREFIX = "optimizer.state"
MOMENTS = ("exp_avg", "exp_avg_sq")
MASTER = "fp32_param"
MOMENTUM = "momentum_buffer"
# replica_id of megatron-core's model ShardedTensors: (pipeline, tensor, data-parallel).
_DP_COORDINATE = 2


@dataclass
class _Param:
    """One parameter of a distributed optimizer's buffers."""

    param: torch.nn.Parameter
    sharded: ShardedBase | None  # the model's ShardedTensor or factory for it
    start: int  # buffer coordinates
    end: int
    pieces: dict[int, tuple[int, int]]  # DP rank -> its part of [start, end)
    saver: int  # the DP rank that writes its optimizer state
    slot: MatrixSlot | None = None  # distributed Muon's matrix (None: an AdamW parameter)

    @property
    def has_master(self) -> bool:
        return self.param.dtype != torch.float32

    @property
    def adamw_names(self) -> tuple[str, ...]:
        return MOMENTS + ((MASTER,) if self.has_master else ())

    def piece_numel(self, rank: int) -> int:
        lo, hi = self.pieces.get(rank, (0, 0))
        return hi - lo

    def local(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s part of a whole flattened state tensor of this parameter."""
        lo, hi = self.pieces[rank]
        return flat[lo - self.start:hi - self.start]


class _OptimizerView:
    """One megatron-core DistributedOptimizer: its parameters in buffer order (the same on
    every rank of its data-parallel group), who holds and who saves what."""

    def __init__(self, sub, sharded_of: dict | None) -> None:
        self.inner = sub.optimizer
        self.group = sub.data_parallel_group
        self.rank, self.dp = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.main = dict(main_param_pairs(sub))  # model parameter -> the slice it steps
        self.muon = self.inner if isinstance(self.inner, DistributedMuon) else None
        slots = {id(s.param): s for s in self.muon.slots} if self.muon else {}
        self.params: list[_Param] = []
        for buffer in sub.buffers:
            bounds = [slice_bounds(bucket, self.dp) for bucket in buffer.buckets]
            entries = sorted(buffer.param_index_map.items(), key=lambda item: item[1][0])
            for param, (start, end, bucket_index) in entries:
                pieces = pieces_in_slices(start, end, bounds[bucket_index])
                slot = slots.get(id(param))
                saver = (self.muon.saver_of(slot) if slot is not None
                         else max(pieces, key=lambda r: (pieces[r][1] - pieces[r][0], -r)))
                sharded = None if sharded_of is None else _sharded_for(param, sharded_of)
                self.params.append(_Param(param, sharded, start, end, pieces, saver, slot))

    @property
    def adamw_params(self) -> list[_Param]:
        return [p for p in self.params if p.slot is None]

    def local_adamw(self, p: _Param, name: str) -> torch.Tensor:
        """This rank's slice of an AdamW parameter's state ``name`` (zeros before its first
        step: what AdamW starts from)."""
        main = self.main[p.param]
        if name == MASTER:
            return self.master_of(main).detach()
        state = self.inner.state.get(main, {})
        return state[name] if name in state else _fp32_zeros(main)

    def master_of(self, main: torch.Tensor) -> torch.Tensor:
        """The fp32 values a main slice steps: itself, or (a bf16 slice under the
        precision-aware path) the host optimizer's fp32 copy of it."""
        if main.dtype == torch.float32:
            return main
        return self.inner.param_to_fp32_param[main]

    def matrix_names(self, p: _Param) -> tuple[str, ...]:
        """State names this rank loads for a Muon matrix: the holder its momentum (and
        master); a bf16 slice holder the master too (for megatron-core's main slice)."""
        names = (MOMENTUM,) if self.muon.holds(p.slot) else ()
        if p.has_master and (self.muon.holds(p.slot) or self.rank in p.pieces):
            names += (MASTER,)
        return names


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` (megatron-core's, chained or not) holds a distributed optimizer
    whose state this module saves."""
    return next(distributed_optimizers(optimizer), None) is not None


def _views(optimizer, model_sharded: dict | None = None) -> list[_OptimizerView]:
    """One view per distributed optimizer; with the model's sharded state dict, each
    parameter knows its ShardedTensor (to build the checkpoint's)."""
    sharded_of = None
    if model_sharded is not None:
        tensors, _ = extract_sharded_tensors_and_factories(model_sharded)
        sharded_of = {id(sh.data): sh for sh in nested_values(tensors)}
    return [_OptimizerView(sub, sharded_of) for sub in distributed_optimizers(optimizer)]


def _sharded_for(param: torch.nn.Parameter, sharded_of: dict) -> ShardedBase:
    sharded = sharded_of.get(id(param))
    if sharded is None:
        raise ValueError(f"a parameter of shape {tuple(param.shape)} in the distributed "
                         "optimizer's buffers has no entry in the model's sharded_state_dict "
                         "(built with keep_vars=True, as megatron-core's modules do)")
    replica = sharded.replica_id
    if not (isinstance(replica, tuple) and len(replica) == 3):
        raise ValueError(f"{sharded.key}: replica_id {replica!r} is not megatron-core's "
                         "(pipeline, tensor, data-parallel) triple")
    return sharded


def _state_tensor(p: _Param, name: str, data: torch.Tensor, rank: int) -> ShardedBase:
    """The optimizer tensor ``name`` of ``p`` as a ShardedTensor (or factory) of the model
    parameter's layout, on data-parallel rank ``rank``: the main replica on the parameter's
    saver (data-parallel coordinate 0), another replica elsewhere. dist_checkpointing wants
    exactly one main replica of every piece when saving and when loading."""
    sharded = p.sharded
    dp_coordinate = 0 if rank == p.saver else 1
    replica = tuple(dp_coordinate if i == _DP_COORDINATE else r
                    for i, r in enumerate(sharded.replica_id))
    changes = {"key": f"{PREFIX}.{name}.{sharded.key}", "data": data.view(p.param.shape),
               "replica_id": replica}
    if isinstance(sharded, ShardedTensor):
        changes["dtype"] = data.dtype
    return replace(sharded, **changes)


# ------------------------------------------------------------------------------------ save


def sharded_state(optimizer, model_sharded: dict, is_loading: bool) -> dict:
    """The optimizer's part of a distributed checkpoint. Saving (``is_loading=False``) is
    collective over every rank of the job: the pieces travel to their savers."""
    views = _views(optimizer, model_sharded)
    tensors = {}
    for index, view in enumerate(views):
        found = _to_load(view) if is_loading else _to_save(view)
        tensors.update({f"{index}.{i}": named for i, named in found.items()})
    step = 0 if is_loading else _adam_step(views)
    return {"format": "model_space", "adam_step": step, "params": tensors}


def _to_save(view: _OptimizerView) -> dict[int, dict[str, ShardedBase]]:
    """Per parameter this rank saves: its state tensors, whole."""
    out = {}
    gathered = _gather_to_savers(view)
    for index, p in enumerate(view.params):
        if p.saver != view.rank:
            continue
        if p.slot is None:
            whole = gathered[index]
        else:
            state = view.muon.matrix_state_of(p.slot)
            whole = {MOMENTUM: state["momentum_buffer"]}
            if p.has_master:
                whole[MASTER] = state["master"]
        out[index] = {name: _state_tensor(p, name, t, view.rank) for name, t in whole.items()}
    return out


@collective_purpose("checkpoint")
def _gather_to_savers(view: _OptimizerView) -> dict[int, dict[str, torch.Tensor]]:
    """The whole flat AdamW state tensors of the parameters this rank saves, from every
    holder's slice: one all_to_all over the data-parallel group."""
    rank, params = view.rank, view.adamw_params
    sends: list[list[torch.Tensor]] = [[] for _ in range(view.dp)]
    for p in params:
        if rank in p.pieces and p.saver != rank:
            sends[p.saver] += [view.local_adamw(p, n).reshape(-1) for n in p.adamw_names]
    out_splits = [0] * view.dp
    for p in params:
        if p.saver == rank:
            for src in p.pieces:
                if src != rank:
                    out_splits[src] += p.piece_numel(src) * len(p.adamw_names)
    device = comm_device()
    flat = [t.float().to(device) for parts in sends for t in parts]
    send = torch.cat(flat) if flat else torch.empty(0, device=device)
    recv = torch.empty(sum(out_splits), dtype=torch.float32, device=device)
    if view.dp > 1:
        dist.all_to_all_single(recv, send, out_splits, [sum(t.numel() for t in s) for s in sends],
                               group=view.group)
    received = list(torch.split(recv, out_splits))
    whole = {}
    for index, p in enumerate(view.params):
        if p.slot is not None or p.saver != rank:
            continue
        whole[index] = {}
        for name in p.adamw_names:
            full = torch.empty(p.end - p.start, dtype=torch.float32, device=p.param.device)
            whole[index][name] = full
            if rank in p.pieces:
                p.local(full, rank).copy_(view.local_adamw(p, name).reshape(-1))
        for src in sorted(p.pieces):  # in the order the sources sent them
            if src == rank:
                continue
            for name in p.adamw_names:
                size = p.piece_numel(src)
                p.local(whole[index][name], src).copy_(received[src][:size])
                received[src] = received[src][size:]
    return whole


@collective_purpose("checkpoint")
def _adam_step(views: list[_OptimizerView]) -> int:
    """AdamW's step count (every AdamW parameter takes the same steps); the largest over all
    ranks of the job, so that rank 0, which writes the common state, has it whatever its own
    slices hold."""
    local = 0.0
    for view in views:
        for group in view.inner.param_groups:
            local = max(local, float(group.get("step", 0)))  # fused Adams count per group
            for main in group["params"]:
                state = view.inner.state.get(main, {})
                if "step" in state:
                    local = max(local, float(state["step"]))
    step = torch.tensor([local], dtype=torch.float64, device=comm_device())
    if dist.get_world_size() > 1:
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
    return int(step.item())


# ------------------------------------------------------------------------------------ load


def _to_load(view: _OptimizerView) -> dict[int, dict[str, ShardedBase]]:
    """Per parameter this rank needs state of: empty whole tensors to read into."""
    out = {}
    for index, p in enumerate(view.params):
        if p.slot is None:
            names = p.adamw_names if view.rank in p.pieces else ()
        else:
            names = view.matrix_names(p)
        if names:
            out[index] = {name: _state_tensor(p, name, torch.empty(
                p.param.shape, dtype=torch.float32, device=p.param.device), view.rank)
                for name in names}
    return out


@torch.no_grad()
def load_state(optimizer, loaded: dict) -> None:
    """Put the state ``dist_checkpointing.load`` read into ``sharded_state(...,
    is_loading=True)`` into the optimizer (its states allocated first if fresh)."""
    if loaded.get("format") != "model_space":
        raise ValueError("the checkpoint's optimizer state is not in the model-space format of "
                         "parallel/distopt_checkpoint.py (it was written by plain DDP, or by "
                         "megatron-core's own distributed-optimizer checkpoint): load it with "
                         "checkpoint.load_optimizer=false to take its weights, step and "
                         "schedule with a fresh optimizer state")
    tensors = loaded["params"]
    for index, view in enumerate(_views(optimizer)):
        _allocate(view)
        for i, p in enumerate(view.params):
            found = tensors.get(f"{index}.{i}")
            if found:
                _put(view, p, found)
        _set_adam_step(view, int(loaded["adam_step"]))
        if isinstance(view.inner, HostOffloadedOptimizer):  # state in host memory
            view.inner.adopt_loaded_state()


def _allocate(view: _OptimizerView) -> None:
    """Every state tensor a step would create, so the loaded values have a place."""
    if view.muon is not None:
        view.muon.init_state()
        return
    for group in view.inner.param_groups:
        for main in group["params"]:
            state = view.inner.state[main]
            if not state:
                state["exp_avg"], state["exp_avg_sq"] = _fp32_zeros(main), _fp32_zeros(main)


def _fp32_zeros(main: torch.Tensor) -> torch.Tensor:
    """AdamW's moments start at zero, in fp32 (a bf16 main slice's too)."""
    return torch.zeros_like(main, dtype=torch.float32, memory_format=torch.preserve_format)


def _put(view: _OptimizerView, p: _Param, found: dict[str, torch.Tensor]) -> None:
    if p.slot is not None and view.muon.holds(p.slot):
        state = view.muon.matrix_state_of(p.slot)
        state["momentum_buffer"].copy_(found[MOMENTUM].view(p.param.shape))
        if p.has_master:
            state["master"].copy_(found[MASTER].view(p.param.shape))
    if view.rank not in p.pieces:
        return
    main = view.main[p.param]
    for name, whole in found.items():
        if name == MOMENTUM:
            continue
        part = p.local(whole.reshape(-1), view.rank)
        target = view.master_of(main) if name == MASTER else view.inner.state[main][name]
        target.copy_(part.view(target.shape))


def _set_adam_step(view: _OptimizerView, step: int) -> None:
    """One step tensor per parameter, as torch's Adam creates it (megatron-core's own load
    shares one tensor between all parameters, which Adam then advances once per parameter)."""
    for group in view.inner.param_groups:
        if _counts_per_group(view.inner):  # fused Adams (Transformer Engine, Apex)
            group["step"] = step
            continue
        on_device = group.get("capturable", False) or group.get("fused", False)
        for main in group["params"]:
            state = view.inner.state.get(main)
            if state and "exp_avg" in state:
                state["step"] = torch.tensor(float(step), dtype=torch.float32,
                                             device=main.device if on_device else "cpu")


def _counts_per_group(inner) -> bool:
    """Fused Adams keep the step in the param group; torch's Adam, ours and the host-offloaded
    one (torch's AdamW inside) per parameter."""
    return not isinstance(inner, (torch.optim.Adam, DistributedMuon, HostOffloadedOptimizer))
