"""Layout-independent weight initialisation.

megatron-core draws initial weights from per-rank RNG streams, so the same seed gives different
weights under TP2 than under TP1, and PP ranks consume different amounts of randomness. Parity
between layouts needs the opposite: every element of every global tensor must get the same value
whatever rank holds it. We get that from the distributed-checkpoint view of the model: each
parameter's ``ShardedTensor`` names its global tensor (``key``), its global shape and the offset
of the local shard. The value of a global tensor is drawn from a generator seeded by
``(seed, key, index along prepended axes)`` and each rank copies out its own slice.

Memory: one global tensor (without its prepended layer/expert axes) at a time, i.e. bounded by
the largest single weight (the embedding), never the model.
"""

from __future__ import annotations

import hashlib
import math

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from parallel.sharded_tensors import local_sharded_tensors

# Output projections of residual branches get megatron's depth-scaled init (std / sqrt(2L)).
_RESIDUAL_OUTPUTS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight",
                     "experts.linear_fc2.weight", "shared_experts.linear_fc2.weight")


def initialize_weights(chunks: list[torch.nn.Module], seed: int, std: float,
                       num_layers: int) -> int:
    """Re-draw every matrix of ``chunks`` so its value depends only on (seed, global key).

    Vectors (norm weights, biases) keep their deterministic constructor values. Returns the
    number of local tensors written.
    """
    written = 0
    for chunk in chunks:
        for sharded in _sharded_params(chunk):
            if sharded.data.dim() < 2:
                continue
            _fill_local_shard(sharded, seed, _std_for(sharded.key, std, num_layers))
            written += 1
    return written


def _sharded_params(chunk: torch.nn.Module) -> list[ShardedTensor]:
    params = {id(p) for p in chunk.parameters()}
    return [t for t in local_sharded_tensors(chunk)
            if id(t.data) in params or _is_param_view(t, params)]


def _is_param_view(sharded: ShardedTensor, params: set[int]) -> bool:
    base = sharded.data._base if sharded.data is not None else None
    return base is not None and id(base) in params


def _std_for(key: str, std: float, num_layers: int) -> float:
    if key.endswith(_RESIDUAL_OUTPUTS):
        return std / math.sqrt(2.0 * num_layers)
    return std


def _fill_local_shard(sharded: ShardedTensor, seed: int, std: float) -> None:
    """Draw the global tensor for this shard's prepended index and copy out the local slice.

    The draw is on the CPU generator whatever the parameter's device, so CUDA runs start from
    the same weights as CPU runs; the slice is then written into the parameter where it lives."""
    lead = sharded.prepend_axis_num
    index = tuple(sharded.global_offset[:lead])
    global_shape = tuple(sharded.global_shape[lead:])
    generator = torch.Generator().manual_seed(_stable_seed(seed, sharded.key, index))
    full = torch.randn(global_shape, generator=generator, dtype=torch.float32) * std
    slices = tuple(slice(off, off + size)
                   for off, size in zip(sharded.global_offset[lead:], sharded.data.shape))
    with torch.no_grad():
        local = sharded.data
        local.copy_(full[slices].to(device=local.device, dtype=local.dtype))


def _stable_seed(seed: int, key: str, index: tuple[int, ...]) -> int:
    digest = hashlib.sha256(f"{seed}|{key}|{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
