"""The ShardedTensors of a module's distributed-checkpoint view, factories expanded.

megatron-core's ``sharded_state_dict`` names every local shard by its global tensor (global layer
numbers across pipeline and virtual stages, global expert index along a prepended axis, the
tensor-parallel slice as an offset) and marks its replicas. That view is the one place that
knows a parameter's global identity, so everything that must agree across layouts reads it:
weight initialisation by global name, per-parameter gradient norms, Hugging Face conversion.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories


def local_sharded_tensors(module: torch.nn.Module) -> Iterator[ShardedTensor]:
    """Every ShardedTensor of ``module.sharded_state_dict()``, in order; a factory (e.g. the
    SwiGLU fc1, stored as its gate and up halves) is replaced by the tensors it builds, which
    are views of the parameter (writing them writes the weight)."""
    tensors, _ = extract_sharded_tensors_and_factories(module.sharded_state_dict())
    yield from _expanded(tensors)


def _expanded(tree: Any) -> Iterator[ShardedTensor]:
    for item in _leaves(tree):
        if isinstance(item, ShardedTensorFactory):
            yield from _expanded(item.build())
        elif isinstance(item, ShardedTensor):
            yield item


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _leaves(value)
    else:
        yield tree
