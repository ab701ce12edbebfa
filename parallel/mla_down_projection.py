"""MLA's down projections replicated on every tensor-parallel rank, with correct RoPE-key
gradients: a fix to megatron-core's local (non-Transformer-Engine) MLA under TP.

megatron-core's local spec builds MLA's query / key-value down projections as
ColumnParallelLinear and gathers their output. The backward of that gather keeps only each
rank's slice of the gradient, so the RoPE key, which is shared by the heads of every TP rank,
loses the other ranks' contributions. The fix replicates the (small) projections.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from parallel.comm_purpose import collective_purpose
from parallel.device import param_device


class MLADownProjection(MegatronModule):
    """MLA's query / key-value down projection, replicated on every TP rank.

    megatron-core's local spec makes these ColumnParallelLinear and gathers the output; the
    backward of that gather keeps only each rank's slice of the gradient, so the shared RoPE key
    (used by the heads of every TP rank) loses the gradient contributions of the other ranks'
    heads. Replicating the (small) down projections fixes that and drops two collectives:
    with sequence parallelism megatron-core gathers the RoPE key with a collective whose backward
    reduce-scatters (sums) its gradient, and the weight is marked ``sequence_parallel`` so its
    token-partial gradient is all-reduced over TP; without it we all-reduce the RoPE key's
    gradient here.

    Installed as ``multi_latent_attention.Linear`` (see ``parallel/mcore_compat.py``) because MLA
    only accepts that class, TELinear or ColumnParallelLinear for these projections.

    ``linear_impl``: the GEMM (``F.linear``), swappable per instance (deferred weight
    gradients, ``parallel/deferred_wgrad.py``).
    """

    linear_impl = staticmethod(F.linear)

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 init_method, bias: bool = False, skip_bias_add: bool = False,
                 tp_comm_buffer_name: str | None = None, tp_group=None, **_: object) -> None:
        super().__init__(config=config)
        if bias:
            raise ValueError("GLM-5's MLA down projections have no bias (attention_bias=false)")
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype,
                        device=param_device(config)))
        if config.perform_initialization:
            init_method(self.weight)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)
        self.tp_group = tp_group
        self.rope_dims = config.qk_pos_emb_head_dim if tp_comm_buffer_name == "kv_down_proj" else 0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = self.linear_impl(x, self.weight)
        if self.rope_dims and not self.config.sequence_parallel and _world(self.tp_group) > 1:
            latent, rope = out.split([out.shape[-1] - self.rope_dims, self.rope_dims], dim=-1)
            out = torch.cat([latent, _SumGradOverTP.apply(rope, self.tp_group)], dim=-1)
        return out, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None):
        state = self.state_dict(prefix="", keep_vars=True)
        # Replicated over TP and DP: both groups set the replica id, so exactly one rank writes.
        dp_cp = (metadata or {}).get("dp_cp_group") or parallel_state.get_data_parallel_group(
            with_context_parallel=True)  # megatron-core's own layers fall back the same way
        return make_sharded_tensors_for_checkpoint(state, prefix, {}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=dp_cp)


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the TP group.

    Not megatron-core's ``copy_to_tensor_model_parallel_region``: its ``_reduce`` all-reduces
    ``grad.contiguous()`` and returns the original tensor, so a non-contiguous gradient comes
    back unreduced. The RoPE key's gradient is one: ``torch.cat``'s backward hands each input a
    narrow of the output gradient along the last dimension."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    @collective_purpose("latent_grad_{op}")
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # A contiguous copy: never all-reduce autograd's own buffer in place (it may be shared).
        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=ctx.group)
        return total, None
