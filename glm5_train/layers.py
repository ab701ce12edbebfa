"""Small megatron-core-compatible modules for running GLM-5 without Transformer Engine.

megatron-core's local (non-TE) spec cannot build MLA as-is: its ``DotProductAttention`` rejects
the ``k_channels``/``v_channels`` arguments MLA passes and assumes one head width for Q, K and V,
and its ``WrappedTorchNorm`` refuses sequence parallelism. These two modules fill those gaps;
with Transformer Engine installed the TE spec is used instead.

Shape legend: S sequence, B micro-batch, N heads on this rank, Dqk / Dv head widths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def param_device(config: TransformerConfig):
    """Where this project's modules create their parameters, as megatron-core's own layers do:
    no device (the CPU, or an enclosing ``with torch.device(...)``, e.g. meta) under
    ``use_cpu_initialization``, else the current CUDA device. A duck-typed config without
    the field (unit-test stubs) counts as CPU initialisation."""
    if getattr(config, "use_cpu_initialization", True):
        return None
    return torch.cuda.current_device()


class RMSNorm(torch.nn.Module):
    """RMSNorm whose weight is marked for sequence-parallel gradient all-reduce.

    Under sequence parallelism each TP rank normalises a different slice of the sequence, so the
    weight's gradient is partial and megatron-core all-reduces every parameter flagged
    ``sequence_parallel`` across the TP group.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                 sequence_parallel: bool | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype,
                                                    device=param_device(config)))
        split = config.sequence_parallel if sequence_parallel is None else sequence_parallel
        setattr(self.weight, "sequence_parallel", split)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as GLM-5's reference does, then cast back.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class LatentRMSNorm(RMSNorm):
    """RMSNorm of MLA's query / key-value latents: GLM-5 uses eps 1e-6 there, while megatron-core
    passes every norm the model-wide ``rms_norm_eps`` (1e-5)."""

    EPS = 1e-6

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(config, hidden_size, eps=self.EPS)


class MLACoreAttention(MegatronModule):
    """Causal softmax attention for MLA, where keys/queries and values have different widths.

    Input ``query`` [S, B, N, Dqk], ``key`` [S, B, N, Dqk], ``value`` [S, B, N, Dv]; returns
    [S, B, N * Dv]. ``attention_mask`` (megatron convention: True = masked out) restricts the
    causal mask further, e.g. at packed-document boundaries. Extra keyword arguments (``x``,
    ``qr`` for DeepSeek Sparse Attention) are the seam where DSA plugs in.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, **_: object) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size}: the local MLA attention "
                "runs on one context-parallel rank; install Transformer Engine for CP attention "
                "or set parallel.context_parallel_size=1")
        self.softmax_scale = softmax_scale
        self.v_channels = v_channels
        self.layer_number = layer_number

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None,
                packed_seq_params=None, **_: object) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("THD packed sequences need Transformer Engine attention")
        q_BNSD, k_BNSD, v_BNSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None if attention_mask is None else ~attention_mask
        out_BNSD = F.scaled_dot_product_attention(
            q_BNSD, k_BNSD, v_BNSD, attn_mask=mask, is_causal=mask is None,
            scale=self.softmax_scale)
        seq, batch = query.shape[0], query.shape[1]
        return out_BNSD.permute(2, 0, 1, 3).reshape(seq, batch, -1)


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

    Installed as ``multi_latent_attention.Linear`` (see ``parallel/mcore_fixes.py``) because MLA
    only accepts that class, TELinear or ColumnParallelLinear for these projections.
    """

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
        out = F.linear(x, self.weight)
        if self.rope_dims and not self.config.sequence_parallel and _world(self.tp_group) > 1:
            from megatron.core.tensor_parallel.mappings import (
                copy_to_tensor_model_parallel_region)

            latent, rope = out.split([out.shape[-1] - self.rope_dims, self.rope_dims], dim=-1)
            out = torch.cat([latent, copy_to_tensor_model_parallel_region(rope, self.tp_group)],
                            dim=-1)
        return out, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        from megatron.core import parallel_state

        state = self.state_dict(prefix="", keep_vars=True)
        # Replicated over TP and DP: both groups set the replica id, so exactly one rank writes.
        dp_cp = (metadata or {}).get("dp_cp_group") or parallel_state.get_data_parallel_group(
            with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=dp_cp)


def _world(group) -> int:
    import torch.distributed as dist

    return 1 if group is None else dist.get_world_size(group)
