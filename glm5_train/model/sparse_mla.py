"""DeepSeek Sparse Attention's main attention in MLA's absorbed form, at O(S x K) memory.

MLA's keys and values are per-head up-projections of one shared latent: with the normed latent
c[s] (``kv_lora_rank`` wide) and the shared RoPE key k_pe[s],

    k[s, h] = (W_UK[h] c[s]) ‖ k_pe[s]            v[s, h] = W_UV[h] c[s]

so a query's logit against key s is  q_nope[h] . W_UK[h] c[s] + q_pe[h] . k_pe[s]
= q_lat[h] . kv[s]  with the absorbed query  q_lat[h] = (W_UK[h]^T q_nope[h]) ‖ q_pe[h]  and the
latent key  kv[s] = c[s] ‖ k_pe[s]  (576 wide in GLM-5), and the output is
W_UV[h] (sum_s p[h, s] c[s]). Attention over a query's K selected keys therefore needs only the
K latent rows, shared by all heads: multi-query attention over the latent
(``SparseLatentAttention``), then the per-head up-projection of its output by W_UV.

The torch path (``latent_attention_forward`` / ``_backward``) runs by chunks of query rows:
one row gather of the chunk's selected latent keys (shared by all heads), batched matmuls for
logits and outputs, an fp32 log-sum-exp per head and query; its backward recomputes each
chunk's gathered keys and logits. ``AbsorbedSparseMLA`` wraps absorption, attention (that path
or the Triton kernels, ``dsa.sparse_kernel``) and up-projection in one autograd op that keeps
the query, the latent keys, the int32 picks, the log-sum-exp and the latent output,
O(S x N x (Dn + R + C) + S x K) bytes; nothing [S, S], nothing [S, K, N], and not the
absorbed query (recomputed). ``docs/sparse_attention_kernel.md`` has the contract and figures.

``GLM5MLASelfAttention`` feeds it: megatron-core's ``MLASelfAttention`` whose
``get_query_key_value_tensors`` returns, when the core attention will run this path, the query
as usual and the latent key [S, B, 1, C + R] with value None instead of up-projected keys and
values (the up-projection ``linear_kv_up_proj`` is never run there; its weight reaches the core
attention as W_UK / W_UV views, so its gradient arrives through them).

Shape legend: B batch, S sequence, T query chunk, K top-k, N heads (this rank), C latent width
(kv_lora_rank), R RoPE width, D = C + R, Dn / Dv per-head nope-key / value widths.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings import apply_rotary_pos_emb
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from glm5_train.model import triton_sparse_mla
from glm5_train.model.picked_rows import RowTable, Scratch, compute_dtype, fp32_at_least
from parallel.context_parallel import group_size, zigzag_positions
from parallel.distopt_slices import gathered

# Working-set budget (fp32 elements) of one query chunk's gathered latent keys [B, T, K, D]:
# 16 MiB (T = 3 rows at GLM-5's K = 2048, D = 576). The gathered keys are read by three
# matmuls per pass; chunks that stay near the cache size measured ~2x faster per row on CPU
# than 64 MiB ones (and 4 MiB ones pay more per-chunk overhead).
LATENT_CHUNK_ELEMENTS = 1 << 22


# MLA's RoPE layout (DeepSeek's interleaved pairs): megatron-core 0.16 takes it from
# config.multi_latent_attention, 0.19 only when asked (``mla_rotary_interleaved``, default off).
MLA_ROPE = ({"mla_rotary_interleaved": True}
            if "mla_rotary_interleaved" in inspect.signature(apply_rotary_pos_emb).parameters
            else {})


def latent_chunk_rows(batch: int, picks: int, width: int) -> int:
    """Query rows per chunk so that the chunk's gathered keys hold ~LATENT_CHUNK_ELEMENTS."""
    return max(1, LATENT_CHUNK_ELEMENTS // max(1, batch * picks * width))


def latent_attention_forward(q_lat: torch.Tensor, kv: torch.Tensor, picks: torch.Tensor,
                             scale: float, value_width: int, rows: int, need_probs: bool):
    """The torch path's forward, no autograd: ``q_lat`` [B, T, N, D] (T query rows), ``kv``
    [B, S, D] (S key rows), int32 ``picks`` [B, T, K] (rows of ``kv``; -1 or >= S: none).
    Returns (out [B, T, N, value_width] in q_lat's dtype, lse [B, T, N] in the compute dtype,
    head-summed probabilities [B, T, K] or an empty tensor)."""
    batch, seq, heads, _ = q_lat.shape
    table = RowTable(kv)
    out = q_lat.new_empty(batch, seq, heads, value_width)
    compute = compute_dtype(q_lat)  # fp32, or fp64 for gradient checks
    lse_BSN = torch.empty(batch, seq, heads, dtype=compute, device=q_lat.device)
    probs = (torch.empty(batch, seq, picks.shape[-1], dtype=compute, device=q_lat.device)
             if need_probs else q_lat.new_empty(0))
    buffer = Scratch(q_lat.device)
    for t0 in range(0, seq, rows):
        chunk = slice(t0, min(seq, t0 + rows))
        flat, valid = table.pick_rows(picks[:, chunk])
        keys = table.gather(flat, chunk.stop - t0, buffer)
        q = fp32_at_least(q_lat[:, chunk]).reshape(keys.shape[0], heads, -1)
        logits = torch.bmm(keys, q.transpose(1, 2))  # [B*T, K, N]
        p, lse = _softmax_over_picks(_masked_logits(logits, valid, scale))
        lse_BSN[:, chunk] = lse.view(batch, -1, heads)
        o = torch.bmm(p.transpose(1, 2), keys[..., :value_width])  # [B*T, N, Dv]
        out[:, chunk] = o.view(batch, -1, heads, value_width).to(out.dtype)
        if need_probs:  # the head sum as a matmul: a sum over the short last axis is slow
            probs[:, chunk] = torch.bmm(p, p.new_ones(heads, 1).expand(p.shape[0], -1, -1)
                                        ).view(batch, -1, picks.shape[-1])
    return out, lse_BSN, probs


def latent_attention_backward(q_lat: torch.Tensor, kv: torch.Tensor, picks: torch.Tensor,
                              out: torch.Tensor, lse_BSN: torch.Tensor, grad_out: torch.Tensor,
                              scale: float, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path's backward from what its forward returned: (dq like ``q_lat``, dkv like
    ``kv``). Each chunk's gathered keys and logits are recomputed."""
    dv = out.shape[-1]
    batch, seq, heads, width = q_lat.shape
    table = RowTable(kv)
    dq = torch.empty(q_lat.shape, dtype=compute_dtype(q_lat), device=q_lat.device)
    dkv_rows = torch.zeros(table.rows.shape, dtype=dq.dtype, device=q_lat.device)
    buffer = Scratch(q_lat.device)
    for t0 in range(0, seq, rows):
        chunk = slice(t0, min(seq, t0 + rows))
        tokens = chunk.stop - t0
        flat, valid = table.pick_rows(picks[:, chunk])
        keys = table.gather(flat, tokens, buffer)  # [B*T, K, D]
        q = fp32_at_least(q_lat[:, chunk]).reshape(batch * tokens, heads, width)
        d_out = fp32_at_least(grad_out[:, chunk]).reshape(batch * tokens, heads, dv)
        o = fp32_at_least(out[:, chunk]).reshape(batch * tokens, heads, dv)
        # The queries and dO (zero in the RoPE columns) side by side, [B*T, 2N, D]: one
        # matmul against the gathered keys gives the logits and dp = dO . v, [B*T, K, 2N];
        # the same pair is the right factor of the key and value gradients below.
        pair = torch.cat([q, torch.nn.functional.pad(d_out, (0, width - dv))], dim=1)
        both = torch.bmm(keys, pair.transpose(1, 2))
        # Halves copied out contiguous by the first op on each: elementwise work (exp
        # above all) on a strided half of ``both`` measured ~10x slower on CPU.
        lse = lse_BSN[:, chunk].reshape(-1, 1, heads)
        p = _masked_logits(both[..., :heads].contiguous(), valid, scale)
        p = p.sub_(torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))).exp_()
        # Softmax backward: dlogit = p * (dp - sum_k p dp), where sum_k p dp = dO . O,
        # then scaled (logit = scale x q . k).
        dlogits = torch.sub(both[..., heads:], (d_out * o).sum(-1)[:, None, :])
        dlogits.mul_(p).mul_(scale)
        dq[:, chunk] = torch.bmm(dlogits.transpose(1, 2), keys).view(batch, tokens, heads,
                                                                       width)
        # Key and value gradients of the picked rows in one matmul over 2N heads: the
        # probabilities against dO (the value columns; zero in the RoPE columns), the
        # logit gradient against the queries: left factor (p, dlogits) written into
        # ``both``, right factor the pair with its halves swapped (small).
        torch.cat([p, dlogits], dim=2, out=both)
        swapped = torch.cat([pair[:, heads:], pair[:, :heads]], dim=1)
        dkeys = buffer.get("dkeys", keys.shape, keys.dtype)
        dkv_rows.index_add_(0, flat, torch.bmm(both, swapped, out=dkeys).view(-1, width))
    return dq.to(q_lat.dtype), table.as_input_layout(dkv_rows).to(kv.dtype)


class SparseLatentAttention(torch.autograd.Function):
    """Softmax attention of each query's N heads over its own K latent keys.

    ``q_lat`` [B, T, N, D] absorbed queries, ``kv`` [B, S, D] latent keys (values are their
    first ``value_width`` columns), ``idx`` [B, T, K] key positions, ``valid`` [B, T, K]
    (False: a pick past the causal keys, which gets no weight), ``scale`` the softmax scale.
    Returns the output [B, T, N, value_width] (dtype of ``q_lat``) and, when ``need_probs``,
    the attention probabilities of the picks summed over the N heads [B, T, K] fp32
    (detached: the indexer KL's target), else an empty tensor. The model runs it inside
    ``AbsorbedSparseMLA``, which keeps less for backward.
    """

    @staticmethod
    def forward(ctx, q_lat, kv, idx, valid, scale: float, value_width: int, rows: int,
                need_probs: bool):
        picks = torch.where(valid, idx, -1).to(torch.int32)
        out, lse, probs = latent_attention_forward(q_lat, kv, picks, scale, value_width, rows,
                                                   need_probs)
        ctx.save_for_backward(q_lat, kv, picks, lse, out)
        ctx.scale, ctx.rows = scale, rows
        ctx.mark_non_differentiable(probs)
        return out, probs

    @staticmethod
    def backward(ctx, grad_out, _grad_probs):
        q_lat, kv, picks, lse, out = ctx.saved_tensors
        dq, dkv = latent_attention_backward(q_lat, kv, picks, out, lse, grad_out, ctx.scale,
                                            ctx.rows)
        return dq, dkv, None, None, None, None, None, None


def _masked_logits(logits: torch.Tensor, valid_BTK: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """One chunk's unscaled logits [B*T, K, N] (keys x queries: the faster matmul
    orientation on CPU), scaled and -inf at invalid picks, in place."""
    logits = logits.mul_(scale)
    if bool(valid_BTK.all()):  # every chunk after the first K queries: skip the pass
        return logits
    return logits.masked_fill_(~valid_BTK.reshape(logits.shape[0], -1, 1), float("-inf"))


def _softmax_over_picks(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the picks (axis 1) of logits [B*T, K, N], in place, and its fp32
    log-sum-exp [B*T, N]. Reductions over axis 1 with a short contiguous last axis are slow
    on CPU (amax / logsumexp measured ~5x a pairwise-max tree; sums ~10x a matmul), hence
    the tree max and the sum as a matmul with ones. A query without any valid pick
    (impossible causally, but masks may forbid all) gets probabilities 0 and lse -inf."""
    top = _max_over_picks(logits)  # [B*T, 1, N]
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = logits.sub_(top).exp_()
    total = torch.bmm(weights.new_ones(1, weights.shape[1]).expand(weights.shape[0], -1, -1),
                      weights)  # [B*T, 1, N]; >= 1 unless no pick is valid (then 0)
    lse = (top + total.log()).squeeze(1)
    return weights.div_(total.clamp_min_(1.0)), lse


def _max_over_picks(x: torch.Tensor) -> torch.Tensor:
    """max over axis 1 of [G, K, N] as [G, 1, N], by halving (elementwise maxima)."""
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        top = torch.maximum(x[:, :half], x[:, half:2 * half])
        if x.shape[1] % 2:  # the odd row left over joins the first
            top[:, :1] = torch.maximum(top[:, :1], x[:, 2 * half:])
        x = top
    return x


def runs_kernel(kernel: str, q_lat: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether ``dsa.sparse_kernel=kernel`` runs the Triton kernels for these tensors: "auto"
    where ``triton_sparse_mla.supports`` them (CUDA), "triton" always (refused where they
    cannot run: no triton, or CPU tensors without Triton's interpreter), "torch" never."""
    if kernel == "torch":
        return False
    if kernel == "auto":
        return triton_sparse_mla.supports(q_lat, kv)
    if not (triton_sparse_mla.available()
            and (q_lat.is_cuda or triton_sparse_mla.interpreted())):
        raise RuntimeError(f"dsa.sparse_kernel=triton cannot run on {q_lat.device} tensors "
                           "here: it needs triton and, off CUDA, TRITON_INTERPRET=1 set before "
                           "Python starts (or use dsa.sparse_kernel=auto)")
    if torch.are_deterministic_algorithms_enabled():
        raise RuntimeError("dsa.sparse_kernel=triton under torch.use_deterministic_algorithms"
                           "(True): the kernels add key gradients atomically (run-to-run "
                           "differences in the last bits); use dsa.sparse_kernel=auto or torch")
    return True


def sparse_latent_attention(q_lat: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor,
                            valid: torch.Tensor, scale: float, value_width: int,
                            need_probs: bool = False, rows: int | None = None,
                            kernel: str = "auto"):
    """``SparseLatentAttention`` with the default chunk rows; probs None unless asked for.
    ``q_lat`` holds this rank's T query rows, ``kv`` every key row (S >= T under context
    parallelism). The fused kernels of ``triton_sparse_mla`` run instead where ``kernel``
    (``dsa.sparse_kernel``) says so (``runs_kernel``; same contract and results, ``rows``
    does not apply there)."""
    if runs_kernel(kernel, q_lat, kv):
        return triton_sparse_mla.sparse_latent_attention(q_lat, kv, idx, valid, scale,
                                                         value_width, need_probs)
    rows = rows or latent_chunk_rows(q_lat.shape[0], idx.shape[-1], kv.shape[-1])
    out, probs = SparseLatentAttention.apply(q_lat, kv, idx, valid, scale, value_width, rows,
                                             need_probs)
    return out, (probs if need_probs else None)


def absorbed_sparse_attention(query: torch.Tensor, latent_key: torch.Tensor,
                              w_uk: torch.Tensor, w_uv: torch.Tensor, idx_BSK: torch.Tensor,
                              valid_BSK: torch.Tensor, scale: float, need_probs: bool = False,
                              rows: int | None = None, kernel: str = "auto"):
    """``absorbed_sparse_mla`` with the picks as (``idx_BSK``, ``valid_BSK``)."""
    return absorbed_sparse_mla(query, latent_key, w_uk, w_uv,
                               triton_sparse_mla.picks_from(idx_BSK, valid_BSK), scale,
                               need_probs, rows, kernel)


def absorbed_sparse_mla(query: torch.Tensor, latent_key: torch.Tensor, w_uk: torch.Tensor,
                        w_uv: torch.Tensor, picks_BTK: torch.Tensor, scale: float,
                        need_probs: bool = False, rows: int | None = None,
                        kernel: str = "auto"):
    """MLA attention over each query's selected keys, in the absorbed form.

    ``query`` [T, B, N, Dn + R] (q_nope ‖ RoPE'd q_pe; T: this rank's rows), ``latent_key``
    [S, B, 1, C + R] (normed latent ‖ RoPE'd shared key; S: every key row), ``w_uk`` [N, Dn, C]
    and ``w_uv`` [N, Dv, C] (views of the key/value up-projection), int32 ``picks_BTK``
    [B, T, K] (key rows; -1: none). Returns [T, B, N * Dv] and the head-summed probabilities
    of the picks [B, T, K] (None unless ``need_probs``). ``kernel``: ``dsa.sparse_kernel``
    (``runs_kernel``)."""
    use_kernel = runs_kernel(kernel, query, latent_key)
    if not use_kernel:
        rows = rows or latent_chunk_rows(query.shape[1], picks_BTK.shape[-1],
                                         latent_key.shape[-1])
    out, probs = AbsorbedSparseMLA.apply(query, latent_key, w_uk, w_uv, picks_BTK, scale,
                                         need_probs, rows, use_kernel)
    return out, (probs if need_probs else None)


class AbsorbedSparseMLA(torch.autograd.Function):
    """``absorbed_sparse_mla`` as one autograd op: absorption of q_nope by W_UK, attention over
    the picked latent rows (the torch path or the Triton kernels), up-projection by W_UV.

    Kept for backward: the query (which the layer produced anyway), the latent keys, the
    int32 picks, the log-sum-exp and the latent output [B, T, N, C] (W_UV's gradient needs
    it). The absorbed query [B, T, N, C + R] is not kept: backward recomputes it from the
    query and W_UK (one [T, Dn] x [Dn, C] matmul per head, ~1% of the attention's work at
    GLM-5's K = 2048), which at GLM-5's widths is a third of what the path kept before."""

    @staticmethod
    def forward(ctx, query, latent_key, w_uk, w_uv, picks, scale: float, need_probs: bool,
                rows: int | None, use_kernel: bool):
        kv = latent_key.squeeze(2).transpose(0, 1)  # [B, S, D] view of the [S, B] layout
        q_lat = _absorbed_query(query, w_uk)
        if use_kernel:
            o_lat, lse, probs = triton_sparse_mla.forward(q_lat, kv, picks, scale,
                                                          w_uk.shape[2], need_probs, False)
            probs = probs if need_probs else q_lat.new_empty(0)
        else:
            o_lat, lse, probs = latent_attention_forward(q_lat, kv, picks, scale,
                                                         w_uk.shape[2], rows, need_probs)
        ctx.save_for_backward(query, latent_key, w_uk, w_uv, picks, lse, o_lat)
        ctx.scale, ctx.rows, ctx.use_kernel = scale, rows, use_kernel
        ctx.mark_non_differentiable(probs)
        return _up_projected(o_lat, w_uv), probs

    @staticmethod
    def backward(ctx, grad_out, _grad_probs):
        query, latent_key, w_uk, w_uv, picks, lse, o_lat = ctx.saved_tensors
        seq, batch, heads, _ = query.shape
        dn, latent = w_uk.shape[1], w_uk.shape[2]
        # Up-projection: out[h] = o_lat[h] W_UV[h]^T per head, rows (b, t).
        d_out_N = grad_out.reshape(seq, batch, heads, -1).permute(2, 1, 0, 3).reshape(
            heads, batch * seq, -1).to(o_lat.dtype)
        o_N = o_lat.reshape(batch * seq, heads, latent).transpose(0, 1)
        d_w_uv = torch.bmm(d_out_N.transpose(1, 2), o_N)
        d_o_lat = torch.bmm(d_out_N, w_uv.to(o_lat.dtype)).transpose(0, 1).view(
            batch, seq, heads, latent)
        kv = latent_key.squeeze(2).transpose(0, 1)
        q_lat = _absorbed_query(query, w_uk)
        if ctx.use_kernel:
            dq_lat, dkv = triton_sparse_mla.backward(q_lat, kv, picks, o_lat, lse, d_o_lat,
                                                     ctx.scale, False)
        else:
            dq_lat, dkv = latent_attention_backward(q_lat, kv, picks, o_lat, lse, d_o_lat,
                                                    ctx.scale, ctx.rows)
        # Absorption: q_abs[h] = q_nope[h] W_UK[h] per head, rows (t, b).
        dq_SB = dq_lat.transpose(0, 1).reshape(seq * batch, heads, -1)
        dq_abs_N = dq_SB[..., :latent].transpose(0, 1).to(query.dtype)
        q_nope_N = query.reshape(seq * batch, heads, -1)[..., :dn].transpose(0, 1)
        d_w_uk = torch.bmm(q_nope_N.transpose(1, 2), dq_abs_N)
        d_q_nope = torch.bmm(dq_abs_N, w_uk.to(dq_abs_N.dtype).transpose(1, 2)).transpose(0, 1)
        d_query = torch.cat([d_q_nope, dq_SB[..., latent:].to(query.dtype)], dim=-1)
        d_latent_key = dkv.transpose(0, 1).unsqueeze(2).to(latent_key.dtype)
        return (d_query.view(query.shape), d_latent_key, d_w_uk.to(w_uk.dtype),
                d_w_uv.to(w_uv.dtype), None, None, None, None, None)


def _absorbed_query(query: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_lat [B, T, N, C + R] (a view of a [T, B] layout): q_nope absorbed by W_UK per head,
    then the RoPE part as it is."""
    seq, batch, heads, _ = query.shape
    dn, latent = w_uk.shape[1], w_uk.shape[2]
    q_nope = query.reshape(seq * batch, heads, -1)[..., :dn].transpose(0, 1)  # [N, T*B, Dn]
    q_abs = torch.bmm(q_nope, w_uk.to(query.dtype)).transpose(0, 1).view(seq, batch, heads,
                                                                          latent)
    return torch.cat([q_abs, query[..., dn:]], dim=-1).transpose(0, 1)


def _up_projected(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The per-head up-projection of the latent output [B, T, N, C] by W_UV: [T, B, N * Dv]."""
    batch, seq, heads, latent = o_lat.shape
    o_NRV = torch.bmm(o_lat.reshape(batch * seq, heads, latent).transpose(0, 1),
                      w_uv.to(o_lat.dtype).transpose(1, 2))
    return o_NRV.view(heads, batch, seq, -1).permute(2, 1, 0, 3).reshape(seq, batch, -1)


# ------------------------------------------------------------------ feeding the latent


class _ContiguousGrad(torch.autograd.Function):
    """Identity; hands its input a contiguous gradient. megatron-core's
    ``copy_to_tensor_model_parallel_region`` all-reduces ``grad.contiguous()`` and returns the
    original gradient, so a non-contiguous one (what ``torch.cat``'s backward gives each input)
    would come back unreduced."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class GLM5MLASelfAttention(MLASelfAttention):
    """megatron-core's MLA self-attention that hands DSA's core attention the latent key
    instead of up-projected keys and values when it runs the absorbed sparse path
    (``DSACoreAttention.runs_absorbed``); every other case is megatron-core's own."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # A bound method, not a module reference: the up-projection stays registered once.
        self.core_attention.latent_up_weights = self.latent_up_weights

    def latent_up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [N, Dn, C] and W_UV [N, Dv, C]: views of ``linear_kv_up_proj.weight``
        ([N * (Dn + Dv), C] on this TP rank), so that gradients reach that parameter."""
        cfg = self.config
        weight = gathered(self.linear_kv_up_proj.weight).view(
            self.num_attention_heads_per_partition, cfg.qk_head_dim + cfg.v_head_dim,
            cfg.kv_lora_rank)
        return weight[:, :cfg.qk_head_dim], weight[:, cfg.qk_head_dim:]

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    position_ids=None, packed_seq_params=None,
                                    inference_context=None, *, inference_params=None):
        takes_latent = getattr(self.core_attention, "takes_latent", None)
        plain = (key_value_states is not None or packed_seq_params is not None
                 or inference_context is not None or inference_params is not None)
        if plain or takes_latent is None or not takes_latent(self._full_sequence(hidden_states)):
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, position_ids, packed_seq_params,
                inference_context, inference_params=inference_params)
        return self._absorbed_query_and_latent_key(hidden_states)

    def _full_sequence(self, hidden_states: torch.Tensor) -> int:
        """Tokens of the whole sequence: this rank's, times TP under sequence parallelism,
        times the context-parallel size."""
        split = self.config.sequence_parallel and group_size(self.tp_group) > 1
        local = hidden_states.shape[0] * (group_size(self.tp_group) if split else 1)
        return local * group_size(self.pg_collection.cp)

    def _rotary_of_this_rank(self, hidden_states: torch.Tensor):
        """RoPE frequencies of this rank's tokens (and YaRN's mscale): the whole sequence's,
        taken at this context-parallel rank's zigzag positions (``parallel.context_parallel``;
        megatron-core's own per-rank slice is the same but CUDA-only)."""
        full = self._full_sequence(hidden_states)
        rotary = self.rotary_pos_emb(full, packed_seq=True)  # packed_seq: no CP slicing there
        rotary, mscale = rotary if self.config.rope_type == "yarn" else (rotary, 1.0)
        cp = self.pg_collection.cp
        if group_size(cp) > 1:
            positions = zigzag_positions(full, group_size(cp), dist.get_rank(cp), rotary.device)
            rotary = rotary.index_select(0, positions)
        return rotary, mscale

    def _absorbed_query_and_latent_key(self, hidden_states: torch.Tensor):
        """(query [S, B, N, Dn + R], latent key [S, B, 1, C + R], None, q latent, kv latent),
        megatron-core's down projections, norms and RoPE, without the key/value up-projection."""
        cfg = self.config
        if cfg.apply_rope_fusion or cfg.q_lora_rank is None:
            raise ValueError("the absorbed sparse MLA path needs q_lora_rank and unfused RoPE "
                             "(apply_rope_fusion=False); or set dsa.sparse_attention=masked_dense")
        rotary, mscale = self._rotary_of_this_rank(hidden_states)
        q_compressed, _ = self.linear_q_down_proj(hidden_states)
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        if (q_compressed.shape[-1] != cfg.q_lora_rank
                or kv_combined.shape[-1] != cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim):
            raise ValueError("the absorbed sparse MLA path needs replicated (not column-"
                             "parallel) MLA down projections; or set "
                             "dsa.sparse_attention=masked_dense")
        kv_compressed, k_pos_emb = torch.split(
            kv_combined, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        if group_size(self.tp_group) > 1 and cfg.sequence_parallel:
            k_pos_emb = gather_from_sequence_parallel_region(k_pos_emb, group=self.tp_group)
        q_compressed = self.q_layernorm(q_compressed)
        kv_compressed = self._latent_norm(kv_compressed)

        def up_and_rope(q_compressed, kv_compressed, k_pos_emb, rotary):
            return self._query_and_latent_key(q_compressed, kv_compressed, k_pos_emb, rotary,
                                              mscale)

        if self.recompute_up_proj:  # megatron-core's selective "mla_up_proj", as it does it:
            # q_up and RoPE rerun from the latents in backward; query and key are freed after
            # the core attention (MultiLatentAttention.forward) and restored in place.
            self.qkv_up_checkpoint = tensor_parallel.CheckpointWithoutOutput(
                fp8=cfg.fp8 or cfg.fp4)
            query, key = self.qkv_up_checkpoint.checkpoint(up_and_rope, q_compressed,
                                                           kv_compressed, k_pos_emb, rotary)
        else:
            query, key = up_and_rope(q_compressed, kv_compressed, k_pos_emb, rotary)
        return query, key, None, q_compressed, kv_compressed

    def _query_and_latent_key(self, q_compressed, kv_compressed, k_pos_emb, rotary, mscale):
        cfg = self.config
        q, _ = self.linear_q_up_proj(q_compressed)
        q = q.view(*q.shape[:-1], self.num_attention_heads_per_partition, self.q_head_dim)
        q_no_pe, q_pos_emb = torch.split(q, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        rotary = rotary[:q.shape[0]]
        q_pos_emb = apply_rotary_pos_emb(q_pos_emb, rotary, config=cfg, mscale=mscale,
                                         cp_group=self.pg_collection.cp, **MLA_ROPE)
        k_pos_emb = apply_rotary_pos_emb(k_pos_emb.unsqueeze(-2), rotary, config=cfg,
                                         mscale=mscale, cp_group=self.pg_collection.cp,
                                         **MLA_ROPE)
        latent = self._share_latent(kv_compressed).unsqueeze(-2)
        query = torch.cat([q_no_pe, q_pos_emb], dim=-1)
        return query, torch.cat([latent, k_pos_emb], dim=-1)

    def _latent_norm(self, kv_compressed: torch.Tensor) -> torch.Tensor:
        """kv_layernorm; in the Transformer Engine spec it is fused into linear_kv_up_proj
        (kv_layernorm an IdentityOp), whose RMSNorm weight is applied here instead."""
        up = self.linear_kv_up_proj
        if not isinstance(self.kv_layernorm, IdentityOp) or not hasattr(up, "layer_norm_weight"):
            return self.kv_layernorm(kv_compressed)
        x32 = kv_compressed.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + up.eps)
        gamma = up.layer_norm_weight.float()
        gamma = gamma + 1 if getattr(up, "zero_centered_gamma", False) else gamma
        return (x32 * gamma).to(kv_compressed.dtype)

    def _share_latent(self, kv_compressed: torch.Tensor) -> torch.Tensor:
        """The latent every TP rank's heads read, with the column-parallel up-projection's
        semantics: under SP all-gathered (backward reduce-scatter), else copied (backward
        all-reduce of the heads' gradients)."""
        if group_size(self.tp_group) == 1:
            return kv_compressed
        if self.config.sequence_parallel:
            return gather_from_sequence_parallel_region(kv_compressed, group=self.tp_group)
        shared = copy_to_tensor_model_parallel_region(kv_compressed, group=self.tp_group)
        return _ContiguousGrad.apply(shared)
