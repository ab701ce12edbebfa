"""DeepSeek Sparse Attention as GLM-5 uses it: lightning indexer + attention over top-k keys.

Per query t and earlier key s (``docs/glm5_reference.md`` sec. 3, and HF transformers'
``GlmMoeDsaIndexer``, whose conventions we follow so weights import unchanged):

    q[t,h] = wq_b(qr[t])                       indexer query from the normed MLA query latent
    k[s]   = LayerNorm(wk(x[s]))               one key shared by all indexer heads
    RoPE on the first ``qk_rope_head_dim`` dims of q and k, interleaved pairs (GLM-5)
    w[t,h] = weights_proj(x[t])[h] * H^-0.5
    I[t,s] = sum_h w[t,h] * ReLU(q[t,h] . k[s] * D^-0.5),   causal, then top-k (deterministic)

The main MLA attention then attends only to the selected keys. megatron-core's experimental
``dsa.py`` is not used: no spec builder reaches it without Transformer Engine, its reference
attention materialises dense [b, h, s, s] scores, and its Hadamard rotation needs CUDA.

Tensor parallelism: indexer weights are replicated on every TP rank and each rank computes the
same selection on the full sequence (gathered under sequence parallelism), so the selection is
identical across ranks and each rank attends with its own heads. The indexer's gradient comes
from the indexer KL loss (a later stage); top-k itself passes no gradient.

Shape legend: B batch, S sequence, T query chunk, K top-k, N attention heads (this rank),
Hi / Di indexer heads / head width, D head widths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.transformer_config import TransformerConfig

from glm5_train.model.dsa_loss import (
    DSATrainingConfig,
    KLMeter,
    dense_indexer_kl,
    sparse_indexer_kl,
)
from glm5_train.model.layers import MLACoreAttention
from parallel.device import param_device

# Working-set budget (elements) for one query chunk: bounds the indexer's [B, T, Hi, S] scores
# and the sparse attention's gathered [B, T, K, N, D] keys and values instead of materialising
# them for the whole sequence (at 202K tokens either would be hundreds of GB).
CHUNK_ELEMENTS = 1 << 25


def query_chunk(per_row_elements: int) -> int:
    """Query rows per chunk so that a chunk holds about CHUNK_ELEMENTS elements."""
    return max(1, CHUNK_ELEMENTS // max(1, per_row_elements))


def interleaved_rope(x_BSHD: torch.Tensor, positions_S: torch.Tensor, rope_dim: int,
                     theta: float) -> torch.Tensor:
    """RoPE on the first ``rope_dim`` dims of the last axis, pairs (x0,x1),(x2,x3) rotated
    together; rotated dims come out de-interleaved (evens then odds), as in HF's GLM-5 code —
    dot products are unaffected because q and k get the same layout."""
    rot, rest = x_BSHD[..., :rope_dim], x_BSHD[..., rope_dim:]
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32, device=x_BSHD.device)
    inv_freq = 1.0 / (theta ** (exponents / rope_dim))
    angles_SF = positions_S.float()[:, None] * inv_freq[None, :]
    cos = angles_SF.cos()[None, :, None, :].to(x_BSHD.dtype)
    sin = angles_SF.sin()[None, :, None, :].to(x_BSHD.dtype)
    even, odd = rot[..., 0::2], rot[..., 1::2]
    rotated = torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return torch.cat([rotated, rest], dim=-1)


class DSAIndexer(torch.nn.Module):
    """The lightning indexer. Parameter names match HF's ``self_attn.indexer.*``."""

    def __init__(self, config: TransformerConfig, n_heads: int, head_dim: int, topk: int,
                 rope_dim: int, rope_theta: float) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.rope_dim, self.rope_theta = rope_dim, rope_theta
        kw = dict(dtype=config.params_dtype, device=param_device(config))
        self.wq_b = torch.nn.Linear(config.q_lora_rank, n_heads * head_dim, bias=False, **kw)
        self.wk = torch.nn.Linear(config.hidden_size, head_dim, bias=False, **kw)
        self.k_norm = torch.nn.LayerNorm(head_dim, eps=1e-6, **kw)
        self.weights_proj = torch.nn.Linear(config.hidden_size, n_heads, bias=False, **kw)

    def scores(self, x_BSH: torch.Tensor, qr_BSQ: torch.Tensor,
               allowed_BSS: torch.Tensor | None = None) -> torch.Tensor:
        """Index scores I [B, S, S] in fp32, -inf where causality or ``allowed`` forbids."""
        batch, seq, _ = x_BSH.shape
        positions = torch.arange(seq, device=x_BSH.device)
        q_BSHD = self.wq_b(qr_BSQ).view(batch, seq, self.n_heads, self.head_dim)
        q_BSHD = interleaved_rope(q_BSHD, positions, self.rope_dim, self.rope_theta)
        k_BSD = self.k_norm(self.wk(x_BSH)).unsqueeze(2)
        k_BSD = interleaved_rope(k_BSD, positions, self.rope_dim, self.rope_theta).squeeze(2)
        w_BSH = self.weights_proj(x_BSH).float() * self.n_heads ** -0.5
        scale = self.head_dim ** -0.5
        rows = query_chunk(batch * self.n_heads * seq)
        chunks = []
        for start in range(0, seq, rows):
            q_BTHD = q_BSHD[:, start:start + rows].float()
            logits_BTHS = torch.einsum("bthd,bsd->bths", q_BTHD, k_BSD.float()) * scale
            chunks.append(torch.einsum("bth,bths->bts", w_BSH[:, start:start + rows],
                                       F.relu(logits_BTHS)))
        index_BSS = torch.cat(chunks, dim=1)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x_BSH.device).tril()
        allowed = causal if allowed_BSS is None else allowed_BSS & causal
        return index_BSS.masked_fill(~allowed, float("-inf"))

    def select(self, index_BSS: torch.Tensor) -> torch.Tensor:
        """Deterministic top-k key indices [B, S, K], K = min(index_topk, S)."""
        return index_BSS.topk(min(self.topk, index_BSS.shape[-1]), dim=-1).indices


class DSACoreAttention(MLACoreAttention):
    """MLA core attention restricted to the indexer's top-k keys per query, plus the indexer's
    KL loss for the DSA training stages (see ``glm5_train/model/dsa_loss.py``)."""

    def __init__(self, config: TransformerConfig, *args, dsa_n_heads: int, dsa_head_dim: int,
                 dsa_topk: int, rope_theta: float, dsa_training: DSATrainingConfig | None = None,
                 **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.indexer = DSAIndexer(config, dsa_n_heads, dsa_head_dim, dsa_topk,
                                  config.qk_pos_emb_head_dim, rope_theta)
        self.training_cfg = dsa_training or DSATrainingConfig()
        self.kl_meter = KLMeter()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None,
                packed_seq_params=None, x: torch.Tensor | None = None,
                qr: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("THD packed sequences need Transformer Engine attention")
        cfg = self.training_cfg
        with_loss = self.training and torch.is_grad_enabled() and cfg.trains_indexer
        allowed_BSS = None if attention_mask is None else ~attention_mask[:, 0]
        if cfg.stage == "dense_warmup":
            out = super().forward(query, key, value, attention_mask)
            if with_loss:
                out = self._attach(out, dense_indexer_kl(self, query, key, x, qr, allowed_BSS))
            return out
        if self.indexer.topk >= query.shape[0]:
            # Every causal key is selected: sparse attention is exactly dense causal attention.
            return super().forward(query, key, value, attention_mask)
        with torch.no_grad():
            index_BSS = self.indexer.scores(*self._indexer_inputs(x, qr), allowed_BSS)
            topk_BSK = self.indexer.select(index_BSS)
            valid_BSK = index_BSS.gather(-1, topk_BSK) > float("-inf")
        out, probs_BSK = sparse_attention(query, key, value, topk_BSK, valid_BSK,
                                          self.softmax_scale, need_probs=with_loss)
        if with_loss:
            out = self._attach(out, sparse_indexer_kl(self, x, qr, allowed_BSS, topk_BSK,
                                                      valid_BSK, probs_BSK))
        return out

    def _attach(self, out: torch.Tensor, kl: tuple[torch.Tensor, int]) -> torch.Tensor:
        """Add coeff x (sum of per-query KL) to the backward pass; megatron-core divides all
        gradients by the global loss-token count, which turns the sum into a mean."""
        kl_sum, queries = kl
        self.kl_meter.add(kl_sum.detach(), queries)
        return MoEAuxLossAutoScaler.apply(out, kl_sum * self.training_cfg.indexer_loss_coeff)

    def _indexer_inputs(self, x: torch.Tensor, qr: torch.Tensor):
        """[S(/TP), B, *] inputs -> full-sequence [B, S, *] on every TP rank."""
        if self.config.sequence_parallel:
            # Replicated computation: the backward must split, not sum, the gradient.
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
            qr = gather_from_sequence_parallel_region(qr, tensor_parallel_output_grad=False)
        return x.transpose(0, 1), qr.transpose(0, 1)


def sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     topk_BSK: torch.Tensor, valid_BSK: torch.Tensor, softmax_scale: float,
                     need_probs: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of each query over its own top-k keys only.

    ``query``/``key`` [S, B, N, Dqk], ``value`` [S, B, N, Dv]; returns the output
    [S, B, N * Dv] and the attention probabilities summed over this rank's heads [B, S, K]
    (detached: the indexer loss's target; None unless ``need_probs``).

    Computed as dense attention with every unselected key masked, one query chunk at a time,
    on SDPA's fused kernels (memory: one chunk's mask, no [B, N, S, S] logits). That is the same
    math as gathering the K keys per query but runs on dense matmul kernels: a gather moves
    S x K x N x D elements per pass and measured ~200x slower on CPU at 4K tokens. The O(S K)
    compute saving of DSA needs a sparse MLA kernel (FlashMLA-style, on the compressed latent);
    ``bench/dsa_attention.py`` reports both the measured cost and that kernel's FLOP ratio.
    """
    seq, batch, heads, _ = query.shape
    rows = query_chunk(batch * heads * seq)
    q_BNSD, k_BNSD, v_BNSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    outs, probs = [], []
    for start in range(0, seq, rows):
        q_BNTD = q_BNSD[:, :, start:start + rows]
        idx_BTK, valid_BTK = topk_BSK[:, start:start + rows], valid_BSK[:, start:start + rows]
        selected_BTS = _selection_mask(idx_BTK, valid_BTK, seq)
        # SDPA's fused CPU/GPU kernels take the mask and keep memory to one chunk.
        outs.append(F.scaled_dot_product_attention(q_BNTD, k_BNSD, v_BNSD,
                                                   attn_mask=selected_BTS[:, None],
                                                   scale=softmax_scale))
        if need_probs:
            with torch.no_grad():
                probs.append(_picked_probs(q_BNTD, k_BNSD, idx_BTK, valid_BTK, selected_BTS,
                                           softmax_scale))
    out_BNSD = torch.cat(outs, dim=2)
    picked = torch.cat(probs, dim=1) if need_probs else None
    return out_BNSD.permute(2, 0, 1, 3).reshape(seq, batch, -1), picked


def _selection_mask(idx_BTK: torch.Tensor, valid_BTK: torch.Tensor, seq: int) -> torch.Tensor:
    """Boolean [B, T, S], True at each query's selected keys. Invalid picks (top-k ran past
    the causal keys) go to a dummy column that is dropped."""
    batch, tokens = idx_BTK.shape[:2]
    cols_BTK = torch.where(valid_BTK, idx_BTK, torch.full_like(idx_BTK, seq))
    mask = torch.zeros(batch, tokens, seq + 1, dtype=torch.bool, device=idx_BTK.device)
    return mask.scatter(-1, cols_BTK, True)[..., :seq]


def _picked_probs(q_BNTD: torch.Tensor, k_BNSD: torch.Tensor, idx_BTK: torch.Tensor,
                  valid_BTK: torch.Tensor, selected_BTS: torch.Tensor,
                  softmax_scale: float) -> torch.Tensor:
    """Attention probabilities of the selected keys summed over heads, [B, T, K]."""
    logits_BNTS = torch.matmul(q_BNTD.float(), k_BNSD.float().transpose(-1, -2)) * softmax_scale
    probs_BNTS = logits_BNTS.masked_fill(~selected_BTS[:, None], float("-inf")).softmax(-1)
    return probs_BNTS.sum(1).gather(-1, idx_BTK).masked_fill(~valid_BTK, 0.0)
