"""Per-parameter gradient norms, named by global tensor, identical in every parallel layout.

What is measured: the gradient ``optimizer.step()`` is about to clip and apply, i.e. after the
pipeline schedule's finalize (data-parallel reduction, embedding-copy sums, 1/num_tokens) and
before the step. Call ``measure()`` there; ``gather()`` later (one collective) returns
``{global name: L2 norm}`` on every rank.

Names come from megatron-core's distributed-checkpoint view of the model, the same one that
seeds the initial weights by global tensor (``sharded_state_dict``): each parameter's
``ShardedTensor`` names its global tensor with the global layer number (pipeline and virtual
stages), and expert weights carry the global expert index as the offset along their prepended
axis. A parameter is named ``key``, or ``key[i, ...]`` for the index along prepended axes (one
expert of a stacked global expert tensor). Several shards of one parameter (SwiGLU fc1: the
gate and up halves) share its name.

Which rank counts which elements, so each global element is counted exactly once:

- the ``replica_id`` of the shard (megatron-core's convention ``(pipeline copy, tensor-parallel
  replica, data-parallel replica)``, see ``transformer/utils.py``) drops pipeline copies (the
  word embedding on the MTP stage or under a tied head: only the first stage's counts) and
  tensor-parallel replicas (replicated norms, down projections, router: TP rank 0 counts);
  tensor-parallel shards all count, so their squares sum over the TP / expert-TP group;
- plain DDP: every data-parallel replica holds the whole reduced gradient in ``main_grad``;
  only the main replica (data-parallel index 0) counts;
- megatron-core's distributed optimizer: after the reduce-scatter a rank's buffer is valid only
  in its own range (the optimizer's range map); each data-parallel rank counts that slice;
- Pipeline ZeRO2 (``parallel.pipeline_zero2``): the reduced slices live in ZeRO2's shards, read
  with ``PipelineZero2.slice_of`` over the same ranges.

The sum of every squared norm is the square of megatron-core's global grad norm (the same
parameters count there: not shared, not a TP duplicate).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.utils import unwrap_model

from parallel.comm_purpose import collective_purpose
from parallel.distopt_slices import distributed_optimizers, slice_range
from parallel.sharded_tensors import local_sharded_tensors


@dataclass(frozen=True)
class GlobalName:
    """A parameter's global tensor name and the shard's replica id."""

    name: str
    replica_id: tuple[int, ...]

    @property
    def is_model_parallel_main(self) -> bool:
        """Not a pipeline copy nor a tensor-parallel replica (data-parallel index ignored)."""
        return all(r == 0 for r in self.replica_id[:-1])

    @property
    def is_main(self) -> bool:
        """The one replica of its elements in the whole job (dist-checkpointing's rule)."""
        return all(r == 0 for r in self.replica_id)


def global_names(module: torch.nn.Module) -> dict[torch.nn.Parameter, GlobalName]:
    """Every parameter of ``module`` (a model chunk, unwrapped or not) with its global tensor
    name, from megatron-core's ``sharded_state_dict``. Raises when a trainable parameter has no
    shard (a module outside the checkpoint view) or shards of two different global tensors."""
    model = unwrap_model(module)
    by_param: dict[int, list[ShardedTensor]] = {}
    for shard in _shards(model):
        base = shard.data if shard.data._base is None else shard.data._base
        by_param.setdefault(id(base), []).append(shard)
    names = {}
    for local_name, param in model.named_parameters():
        shards = by_param.get(id(param), [])
        if not shards:
            if param.requires_grad:
                raise ValueError(f"parameter {local_name!r} has no tensor in the model's "
                                 "sharded_state_dict, so it has no global name: give its module "
                                 "a sharded_state_dict (megatron-core's MegatronModule does)")
            continue
        found = {(_tensor_name(s), _replica(s.replica_id)) for s in shards}
        if len(found) != 1:
            raise ValueError(f"parameter {local_name!r} maps to several global tensors "
                             f"{sorted(found)}: per-tensor norms of one parameter split over "
                             "tensors are not supported")
        names[param] = GlobalName(*found.pop())
    return names


def _shards(model: torch.nn.Module) -> Iterator[ShardedTensor]:
    return (t for t in local_sharded_tensors(model) if t.data is not None)


def _tensor_name(shard: ShardedTensor) -> str:
    lead = shard.prepend_axis_num
    if not lead:
        return shard.key
    return f"{shard.key}[{', '.join(str(i) for i in shard.global_offset[:lead])}]"


def _replica(replica_id) -> tuple[int, ...]:
    return tuple(replica_id) if isinstance(replica_id, (tuple, list)) else (replica_id,)


@dataclass
class _Entry:
    name: str
    grad: Callable[[], torch.Tensor]  # the counted elements of this rank, read at measure time


class ParamGradNorms:
    """This rank's share of every parameter's reduced gradient, summed over ranks by name.

    ``chunks``: the DDP-wrapped model chunks; ``optimizer``: megatron-core's (chained)
    optimizer; ``zero2``: the ``PipelineZero2`` that holds the gradients, if any. Building reads
    the sharded state dict once; no communication until ``gather``."""

    def __init__(self, chunks: list, optimizer, zero2=None) -> None:
        self.entries = _entries(chunks, optimizer, zero2)
        self.squares: dict[str, float] | None = None

    def measure(self) -> None:
        """Sum this rank's squares per name (call between the schedule and optimizer.step)."""
        squares: dict[str, torch.Tensor] = {}
        for entry in self.entries:
            value = torch.linalg.vector_norm(entry.grad(), dtype=torch.float64).square()
            squares[entry.name] = squares.get(entry.name, 0.0) + value
        names = list(squares)
        values = torch.stack(list(squares.values())).tolist() if names else []
        self.squares = dict(zip(names, values))

    @collective_purpose("param_grad_norms")
    def gather(self, group=None) -> dict[str, float]:
        """{global name: L2 norm} of the last ``measure``, on every rank of ``group`` (default:
        the world; collective: every rank calls it)."""
        if self.squares is None:
            raise RuntimeError("ParamGradNorms.gather() before measure(): call measure() between "
                               "the pipeline schedule and optimizer.step()")
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, self.squares, group=group)
        total: dict[str, float] = {}
        for squares in everyone:
            for name, value in squares.items():
                total[name] = total.get(name, 0.0) + value
        return {name: total[name] ** 0.5 for name in sorted(total)}


def _entries(chunks: list, optimizer, zero2) -> list[_Entry]:
    ranges = {param: sub for sub in distributed_optimizers(optimizer)
              for param in sub.model_param_gbuf_map}
    entries = []
    for chunk in chunks:
        sharded_grads = getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer",
                                False)
        for param, name in global_names(chunk).items():
            if not param.requires_grad or not name.is_model_parallel_main:
                continue
            if not sharded_grads:
                if name.is_main:
                    entries.append(_Entry(name.name, _whole_grad(param)))
            elif param in ranges:  # a slice of this parameter is this rank's to step
                entries.append(_Entry(name.name, _slice_grad(ranges[param], param, zero2)))
    return entries


def _whole_grad(param: torch.nn.Parameter) -> Callable[[], torch.Tensor]:
    """The whole reduced gradient (megatron-core's DDP keeps it in ``main_grad``)."""
    return lambda: param.main_grad if getattr(param, "main_grad", None) is not None else param.grad


def _slice_grad(sub, param: torch.nn.Parameter, zero2) -> Callable[[], torch.Tensor]:
    """The reduced slice the distributed optimizer steps: in the grad buffer (``main_grad``) or,
    with Pipeline ZeRO2, in its persistent shard."""
    if zero2 is not None:
        world = slice_range(sub, param)
        return lambda: zero2.slice_of(param, world.start, world.stop)
    # The range map distopt_slices.slice_range reads, in the parameter's own flat coordinates.
    own = sub._get_model_param_range_map(param)["param"]
    return lambda: param.main_grad.view(-1)[own.start:own.end]
