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
from megatron.core.utils import get_tensor_model_parallel_group_if_none

from parallel.device import param_device


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
        # megatron-core's finalize sums "q_layernorm"/"k_layernorm" gradients over TP, right
        # under sequence parallelism (each TP rank saw a slice of the sequence). Without it the
        # latent is replicated and the column-parallel up projection's backward all-reduces
        # its input gradient: every TP rank holds the whole gradient, so it must be averaged.
        self.weight.average_gradients_across_tp_domain = not config.sequence_parallel


def equal_width_attention(q_BNSD: torch.Tensor, k_BNSD: torch.Tensor, v_BNSD: torch.Tensor,
                          allowed: torch.Tensor | None, scale: float) -> torch.Tensor:
    """SDPA of queries/keys [B, N, S, Dqk] and values [B, N, S, Dv] on one zero-padded width.

    SDPA's flash kernel (CPU and CUDA) needs one head width for q, k and v; with Dqk != Dv
    (glm5_tiny: 48 / 32; GLM-5's 192 + 64 RoPE = 256 = Dv needs no padding) SDPA falls back to
    its math kernel on CPU, which materialises the [B, N, S, S] scores and probabilities (CUDA
    has a memory-efficient kernel for unequal widths). Zero columns change no dot product and add zero
    output columns, so padding the narrower side to max(Dqk, Dv) and slicing the output back to
    Dv is exact. ``scale`` must be explicit: SDPA's default would use the padded width.
    ``allowed`` (True = may attend, causality included) or, when None, plain causal attention.
    Returns [B, N, S, Dv], a view of the padded output.
    """
    dqk, dv = q_BNSD.shape[-1], v_BNSD.shape[-1]
    if dqk < dv:
        q_BNSD, k_BNSD = F.pad(q_BNSD, (0, dv - dqk)), F.pad(k_BNSD, (0, dv - dqk))
    elif dv < dqk:
        v_BNSD = F.pad(v_BNSD, (0, dqk - dv))
    # CPU SDPA has flash and math kernels only; flash takes a boolean mask too (converted to an
    # additive [B, 1, S, S] mask it keeps for backward: S^2 per layer, not per head).
    out_BNSD = F.scaled_dot_product_attention(q_BNSD, k_BNSD, v_BNSD, attn_mask=allowed,
                                              is_causal=allowed is None, scale=scale)
    return out_BNSD[..., :dv]


def attention_at_positions(q_BNTD: torch.Tensor, k_BNSD: torch.Tensor, v_BNSD: torch.Tensor,
                           positions_T: torch.Tensor, scale: float,
                           allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of queries at global ``positions_T`` (this context-parallel rank's
    rows) over the whole sequence's keys 0..S-1: a query sees the keys at or before its
    position (and ``allowed``, [B or 1, 1, T, S], True = may attend). The boolean mask is
    [T, S] (dense attention under context parallelism or packed documents only: the sparse
    stage never builds it)."""
    keys = torch.arange(k_BNSD.shape[2], device=positions_T.device)
    allowed_TS = keys[None, :] <= positions_T[:, None]
    mask = allowed_TS if allowed is None else allowed & allowed_TS
    return equal_width_attention(q_BNTD, k_BNSD, v_BNSD, mask, scale)


class MLACoreAttention(MegatronModule):
    """Causal softmax attention for MLA, where keys/queries and values have different widths.

    Input ``query`` [S, B, N, Dqk], ``key`` [S, B, N, Dqk], ``value`` [S, B, N, Dv]; returns
    [S, B, N * Dv]. ``attention_mask`` (megatron convention: True = masked out) restricts the
    causal mask further, e.g. at packed-document boundaries. Extra keyword arguments (``x``,
    ``qr`` for DeepSeek Sparse Attention) are the seam where DSA plugs in. Runs on SDPA's
    fused kernels through ``equal_width_attention`` (memory linear in S without a mask).
    """

    # Subclasses that shard sequences over the context-parallel group set True.
    supports_context_parallel = False

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, **_: object) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1 and not self.supports_context_parallel:
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size}: the local MLA attention "
                "without DSA runs on one context-parallel rank (GLM-5's DSACoreAttention has "
                "context parallelism); use the DSA core attention or set "
                "parallel.context_parallel_size=1")
        self.softmax_scale = softmax_scale
        self.v_channels = v_channels
        self.layer_number = layer_number
        # megatron-core's MLA hands its process groups down; the TP group sums DSA's per-head
        # attention over the heads of every TP rank (glm5_train/model/dsa_loss.py).
        self.tp_group = get_tensor_model_parallel_group_if_none(
            pg_collection.tp if pg_collection is not None else None)
        # The context-parallel group (None or size 1: every rank holds whole sequences).
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None,
                packed_seq_params=None, **_: object) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("THD packed sequences need Transformer Engine attention")
        q_BNSD, k_BNSD, v_BNSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None if attention_mask is None else ~attention_mask
        # SDPA's default scale, 1/sqrt(Dqk), taken before padding changes the width.
        scale = self.softmax_scale if self.softmax_scale is not None else query.shape[-1] ** -0.5
        out_BNSD = equal_width_attention(q_BNSD, k_BNSD, v_BNSD, mask, scale)
        seq, batch = query.shape[0], query.shape[1]
        return out_BNSD.permute(2, 0, 1, 3).reshape(seq, batch, -1)
