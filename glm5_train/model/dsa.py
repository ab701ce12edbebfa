"""DeepSeek Sparse Attention as GLM-5 uses it: lightning indexer + attention over top-k keys.

Per query t and earlier key s (``docs/glm5_reference.md`` sec. 3, and HF transformers'
``GlmMoeDsaIndexer``, whose conventions we follow so weights import unchanged):

    q[t,h] = wq_b(qr[t])                       indexer query from the normed MLA query latent
    k[s]   = LayerNorm(wk(x[s]))               one key shared by all indexer heads
    RoPE on the first ``qk_rope_head_dim`` dims of q and k, interleaved pairs (GLM-5)
    w[t,h] = weights_proj(x[t])[h] * H^-0.5
    I[t,s] = sum_h w[t,h] * ReLU(q[t,h] . k[s] * D^-0.5),   causal, then top-k

Top-k is deterministic: larger score first, then smaller key index (``rank_keys``), computed
block by block over queries and keys with a running top-k (``causal_topk``), never [S, S].

The main MLA attention then attends only to the selected keys: by default in MLA's absorbed
form over the selected latent keys, O(S x K) compute and memory (``glm5_train/model/
sparse_mla.py``; ``dsa.sparse_attention=absorbed``), or, as the reference, dense attention on
the up-projected keys under a top-k mask (``sparse_attention``; ``masked_dense``, O(S^2)
compute). megatron-core's experimental
``dsa.py`` is not used: no spec builder reaches it without Transformer Engine, its reference
attention materialises dense [b, h, s, s] scores, and its Hadamard rotation needs CUDA.

Tensor parallelism: indexer weights are replicated on every TP rank and each rank computes the
same selection on the full sequence (gathered under sequence parallelism), so the selection is
identical across ranks and each rank attends with its own heads. The indexer's gradient comes
from the indexer KL loss (a later stage); top-k itself passes no gradient. In ``dsa.stage=dense``
(pre- and mid-training, before DSA) the indexer is not run: every layer attends densely.

Shape legend: B batch, S sequence, T query chunk, K top-k, N attention heads (this rank),
Hi / Di indexer heads / head width, D head widths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.transformer_config import TransformerConfig

from glm5_train.model.dsa_loss import (
    DSATrainingConfig,
    KLMeter,
    dense_indexer_kl,
    selected_indexer_kl,
)
from glm5_train.model.key_masks import (
    DocumentStarts,
    KeyMask,
    allowed_block,
    document_bounds,
    earliest_starts,
    key_mask,
)
from glm5_train.model.layers import MLACoreAttention, attention_at_positions
from glm5_train.model.picked_rows import RowTable, Scratch, compute_dtype, fp32_at_least
from glm5_train.model.sparse_mla import absorbed_sparse_mla
from glm5_train.model.triton_sparse_mla import picks_from
from parallel.context_parallel import ContextShard, context_shard, gather_sequence, group_size
from parallel.device import param_device

# Working-set budget (elements) for one query chunk: bounds the indexer's [B, T, Hi, S] scores
# and the sparse attention's gathered [B, T, K, N, D] keys and values instead of materialising
# them for the whole sequence (at 202K tokens either would be hundreds of GB).
CHUNK_ELEMENTS = 1 << 25


# Keys per block of the indexer's blockwise top-k (``causal_topk``); its query block follows
# from CHUNK_ELEMENTS so that one block's [B, T, Hi, key block] fp32 logits stay bounded.
# Each key block costs a merge (concatenate, top-k over K + block keys): at 16K tokens,
# 8 indexer heads, K = 2048, blocks of 16384 keys selected ~1.5x faster than blocks of 2048.
INDEXER_KEY_BLOCK = 16384

# Selection rule, everywhere (full row and blockwise): larger score first, then smaller key
# index. Scores are packed with their key index into one int64 that orders exactly so, which
# makes every key distinct and torch.topk's result unique (its own tie order is unspecified).
_LOW = 1 << 32
_SIGN_FLIP = 0x7FFFFFFF


def query_chunk(per_row_elements: int) -> int:
    """Query rows per chunk so that a chunk holds about CHUNK_ELEMENTS elements."""
    return max(1, CHUNK_ELEMENTS // max(1, per_row_elements))


def rank_keys(scores: torch.Tensor, key_index: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering (score, key index) by the selection rule: the fp32 score's bits made
    order-preserving (negative floats' magnitude bits flipped; -0.0 folded into +0.0 so that the
    two tie as they compare equal) in the high half, 2^32 - 1 - index in the low half."""
    bits = (scores.float() + 0.0).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ _SIGN_FLIP, bits).long()
    return ordered.mul_(_LOW).add_(_LOW - 1 - key_index)  # in place: no fresh int64 pages


def unrank_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``rank_keys``: (key index int64, fp32 score), bit-exact."""
    ordered = torch.div(keys, _LOW, rounding_mode="floor")
    index = _LOW - 1 - (keys - ordered * _LOW)
    bits = ordered.int()
    return index, torch.where(bits < 0, bits ^ _SIGN_FLIP, bits).view(torch.float32)


def causal_topk(block_scores, batch: int, seq: int, topk: int,
                allowed_BSS: torch.Tensor | None = None, query_block: int = 512,
                key_block: int = INDEXER_KEY_BLOCK, device: torch.device | None = None,
                positions_T: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``topk`` keys per query under causality (and ``allowed_BSS``: a [B, T, S] bool
    mask or ``key_masks.DocumentStarts``), block by block.

    ``block_scores(t0, t1)`` prepares query rows t0..t1-1 and returns a function of (s0, s1)
    giving their unmasked fp32 scores [B, t1 - t0, s1 - s0] against keys s0..s1-1. Each query
    block keeps a running top-k of ranked keys and merges one key block at a time, so nothing
    [S, S]-sized exists: memory is O(B x query_block x (topk + key_block)) plus the [B, T, K]
    results. Returns the key indices [B, T, K] and their scores (-inf where a query has fewer
    than K allowed keys), equal to ``DSAIndexer.select`` over the full masked row, ties and
    -inf fillers included (the lowest-index forbidden keys the full row ranks first). Each
    query block scores only keys from its rows' earliest document start (with
    packed documents, ``DocumentStarts``; else 0) to its last row's diagonal; the forbidden
    keys outside that range that a full row would take as fillers join unscored
    (``_fillers``). So the work follows each document's causal pairs, at the granularity of
    query blocks, not positions in the sequence.
    ``positions_T``: the global positions of the query rows, increasing (a context-
    parallel rank's share of the ``seq`` keys); default 0..seq-1.
    """
    k = min(topk, seq)
    if positions_T is None:
        positions_T = torch.arange(seq, device=device)
    rows = positions_T.numel()
    last_key = (positions_T + 1).tolist()  # keys 0..last_key[t]-1 are causal for row t
    index_BTK = torch.empty(batch, rows, k, dtype=torch.long, device=device)
    score_BTK = torch.empty(batch, rows, k, dtype=torch.float32, device=device)
    earliest = earliest_starts(allowed_BSS, rows, query_block)
    for block, t0 in enumerate(range(0, rows, query_block)):
        t1 = min(rows, t0 + query_block)
        against = block_scores(t0, t1)
        first = earliest[block] // KEY_ALIGN * KEY_ALIGN  # no row sees a key before it
        visible = last_key[t1 - 1]  # nor one from here on
        best = _fillers(batch, t1 - t0, 0, min(k, first), device)
        for s0 in range(first, visible, key_block):
            s1 = min(visible, s0 + key_block)
            scores = _masked_block(against, batch, positions_T[t0:t1], (t0, t1), (s0, s1),
                                   allowed_BSS, device, unseen=earliest[block] >= s1)
            best = _merge(best, _block_candidates(scores, s0, k), k)
        if visible < k:  # too few keys: the first future ones fill, forbidden to every row
            best = _merge(best, _fillers(batch, t1 - t0, visible, k, device), k)
        index_BTK[:, t0:t1], score_BTK[:, t0:t1] = unrank_keys(best)
    return index_BTK, score_BTK


def _merge(best: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    merged = torch.cat([best, candidates], dim=-1)
    return merged.topk(min(k, merged.shape[-1]), dim=-1).values


# A scan that skips keys starts at a multiple of this, so its slices line up as a scan from
# key 0 would: the scores of a key slice can differ in the last bits with where it starts
# (measured on this CPU at offsets not a multiple of 16) and with its width (at small head
# widths). The selected keys are the same either way (a score near a tie could flip, as a
# different key block size always could).
KEY_ALIGN = 128


def _fillers(batch: int, rows: int, start: int, stop: int, device) -> torch.Tensor:
    """Ranked keys start..stop-1 at -inf for every row: what keys forbidden to every row of a
    query block contribute to a full row's top-k, whose -inf fillers are its lowest-index
    forbidden keys (the keys before the block's earliest document start, and with fewer than
    k keys the first future ones)."""
    scores = torch.full((batch, rows, max(0, stop - start)), float("-inf"), device=device)
    return rank_keys(scores, torch.arange(start, max(start, stop), device=device))


def _block_candidates(scores_BTS: torch.Tensor, s0: int, k: int) -> torch.Tensor:
    """Ranked keys (``rank_keys``) of each row's top-``k`` in one block of keys s0.., by the
    selection rule. A float top-k (one partial-selection pass) finds them wherever the k-th
    largest score is not tied with a score it left out; only the rows where it is (scores
    equal at the boundary, -inf fillers) rank the whole block, so the int64 ranking touches
    O(k) values per row instead of the block's width."""
    width = scores_BTS.shape[-1]
    keys = torch.arange(s0, s0 + width, device=scores_BTS.device)
    if width <= k + 1:
        return rank_keys(scores_BTS, keys)
    # k + 1 largest, sorted: the (k+1)-th equal to the k-th means the boundary value occurs
    # outside the k found (the float top-k's choice among ties is unspecified).
    values, index = scores_BTS.topk(k + 1, dim=-1, sorted=True)
    tied = values[..., k] == values[..., k - 1]
    candidates = rank_keys(values[..., :k], index[..., :k] + s0)
    if bool(tied.any()):
        candidates[tied] = rank_keys(scores_BTS[tied], keys).topk(k, dim=-1).values
    return candidates


def _masked_block(against, batch: int, positions_T: torch.Tensor, rows: tuple[int, int],
                  cols: tuple[int, int], allowed_BSS: torch.Tensor | None,
                  device, unseen: bool = False) -> torch.Tensor:
    """One block's scores, -inf at keys after the query (by its position) or not allowed;
    blocks wholly past every query's diagonal, or (``unseen``) wholly before every query's
    document, are not scored."""
    (t0, t1), (s0, s1) = rows, cols
    first, last = int(positions_T[0]), int(positions_T[-1])
    if s0 > last or unseen:
        return torch.full((batch, t1 - t0, s1 - s0), float("-inf"), device=device)
    scores = against(s0, s1)
    if s1 - 1 > first:  # the block reaches past some query's diagonal
        future = torch.arange(s0, s1, device=device)[None, :] > positions_T[:, None]
        scores = scores.masked_fill_(future, float("-inf"))
    allowed = allowed_block(allowed_BSS, t0, t1, s0, s1)
    if allowed is not None:
        scores = scores.masked_fill_(~allowed, float("-inf"))
    return scores


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

    def project(self, x_BSH: torch.Tensor, qr_BSQ: torch.Tensor):
        """Indexer queries [B, S, Hi, Di], the shared key [B, S, Di] (both RoPE'd) and the fp32
        head weights [B, S, Hi], already scaled by Hi^-0.5."""
        positions = torch.arange(x_BSH.shape[1], device=x_BSH.device)
        return (self.project_queries(qr_BSQ, positions), *self.project_keys(x_BSH, positions))

    def project_queries(self, qr_BTQ: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        """Queries [B, T, Hi, Di] of the tokens at global ``positions_T``."""
        batch, tokens, _ = qr_BTQ.shape
        q_BTHD = self.wq_b(qr_BTQ).view(batch, tokens, self.n_heads, self.head_dim)
        return interleaved_rope(q_BTHD, positions_T, self.rope_dim, self.rope_theta)

    def project_keys(self, x_BSH: torch.Tensor,
                     positions_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared key [B, S, Di] and the fp32 head weights [B, S, Hi] of the tokens at
        global ``positions_S``."""
        k_BSD = self.k_norm(self.wk(x_BSH)).unsqueeze(2)
        k_BSD = interleaved_rope(k_BSD, positions_S, self.rope_dim, self.rope_theta).squeeze(2)
        return k_BSD, self.weights_proj(x_BSH).float() * self.n_heads ** -0.5

    def sequence_keys(self, x_BTH: torch.Tensor,
                      shard: ContextShard) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole sequence's shared keys [B, S, Di] (this rank's share projected, then
        gathered over the context-parallel group: Di values per token; backward reduce-
        scatters) and this rank's head weights [B, T, Hi]."""
        k_BTD, w_BTH = self.project_keys(x_BTH, shard.positions)
        return gather_sequence(k_BTD, shard, dim=1), w_BTH

    def _block_scores(self, q_rows, k_BSD, w_BSH):
        """``block_scores`` for ``causal_topk``: I of a block of queries against a block of
        keys, fp32. ``q_rows(t0, t1)`` gives the block's queries [B, T, Hi, Di]."""
        scale = self.head_dim ** -0.5

        def rows(t0: int, t1: int):
            q_BTHD, w_BTH = q_rows(t0, t1).float(), w_BSH[:, t0:t1]

            def against(s0: int, s1: int) -> torch.Tensor:
                logits_BTHS = torch.einsum("bthd,bsd->bths", q_BTHD, k_BSD[:, s0:s1].float())
                # In place: the block is the largest tensor here (autograd saves only the
                # ReLU's output), and fresh pages for more copies cost more than arithmetic.
                relu_BTHS = logits_BTHS.mul_(scale).relu_()
                return torch.einsum("bth,bths->bts", w_BTH, relu_BTHS)

            return against

        return rows

    def scores(self, x_BSH: torch.Tensor, qr_BSQ: torch.Tensor,
               allowed_BSS: torch.Tensor | None = None) -> torch.Tensor:
        """Index scores I [B, S, S] in fp32, -inf where causality or ``allowed`` forbids.
        Quadratic memory: tests and benchmarks use it as the reference. Training does not: the
        sparse stage selects with ``select_blockwise`` and scores only the selected keys, the
        dense warm-up KL scores by query chunks (``dsa_loss._DenseKL``)."""
        batch, seq, _ = x_BSH.shape
        q_BSHD, k_BSD, w_BSH = self.project(x_BSH, qr_BSQ)
        block = self._block_scores(lambda t0, t1: q_BSHD[:, t0:t1], k_BSD, w_BSH)
        rows = query_chunk(batch * self.n_heads * seq)
        index_BSS = torch.cat([block(start, min(seq, start + rows))(0, seq)
                               for start in range(0, seq, rows)], dim=1)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x_BSH.device).tril()
        allowed = causal if allowed_BSS is None else allowed_BSS & causal
        return index_BSS.masked_fill(~allowed, float("-inf"))

    def select(self, index_BSS: torch.Tensor) -> torch.Tensor:
        """Top-k key indices [B, S, K], K = min(index_topk, S), over full rows of ``scores``:
        larger score first, then smaller key index. The reference ``causal_topk`` (what
        training runs) must equal; [B, S, S] int64 keys, so for tests and benchmarks only."""
        seq = index_BSS.shape[-1]
        keys = rank_keys(index_BSS, torch.arange(seq, device=index_BSS.device))
        return unrank_keys(keys.topk(min(self.topk, seq), dim=-1).values)[0]

    def select_blockwise(self, x_BSH: torch.Tensor, qr_BSQ: torch.Tensor,
                         allowed_BSS: torch.Tensor | None = None, query_block: int | None = None,
                         key_block: int | None = None, shard: ContextShard | None = None,
                         keys: tuple[torch.Tensor, torch.Tensor] | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``select(scores(...))`` and the selected scores [B, T, K], without [S, S] memory
        (``causal_topk``). Default blocks: INDEXER_KEY_BLOCK keys, and queries so that a block's
        [B, T, Hi, key block] logits hold about CHUNK_ELEMENTS values. ``shard``: the rows are
        this context-parallel rank's share (``x``/``qr`` [B, T, *]); ``keys``: the
        ``sequence_keys`` already computed for it."""
        batch, rows, _ = x_BSH.shape
        shard = shard or context_shard(None, rows, x_BSH.device)
        k_BSD, w_BTH = keys if keys is not None else self.sequence_keys(x_BSH, shard)
        key_block = key_block or INDEXER_KEY_BLOCK
        query_block = query_block or query_chunk(batch * self.n_heads * key_block)
        # Queries are projected block by block too: [B, T, Hi, Di] is T x Hi x Di values.
        block = self._block_scores(
            lambda t0, t1: self.project_queries(qr_BSQ[:, t0:t1], shard.positions[t0:t1]),
            k_BSD, w_BTH)
        return causal_topk(block, batch, shard.seq, self.topk, allowed_BSS, query_block,
                           key_block, x_BSH.device, shard.positions)

    def selected_scores(self, x_BSH: torch.Tensor, qr_BSQ: torch.Tensor,
                        topk_BSK: torch.Tensor, shard: ContextShard | None = None,
                        keys: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Differentiable I at each query's selected keys only, [B, T, K] fp32:
        ``scores(...).gather(-1, topk_BSK)`` at O(B T K) memory (``_SelectedScores``; -inf,
        and no gradient, at a pick outside 0..S-1). ``shard`` / ``keys`` as in
        ``select_blockwise``. The model's KL runs ``selected_kl`` (fused) instead."""
        shard = shard or context_shard(None, x_BSH.shape[1], x_BSH.device)
        k_BSD, w_BTH = keys if keys is not None else self.sequence_keys(x_BSH, shard)
        q_BTHD = self.project_queries(qr_BSQ, shard.positions)
        return _SelectedScores.apply(q_BTHD, k_BSD, w_BTH, topk_BSK, self.head_dim ** -0.5,
                                     selected_chunk_rows(*topk_BSK.shape[::2], self.head_dim))

    def selected_kl(self, x_BSH: torch.Tensor, qr_BSQ: torch.Tensor, picks_BTK: torch.Tensor,
                    target_BTK: torch.Tensor, shard: ContextShard | None = None,
                    keys: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Sum over queries of KL(target || softmax(I at the picks)) (``_SelectedKL``): int32
        ``picks_BTK`` (-1: none), ``target_BTK`` the main attention's head-summed
        probabilities of the picks. ``shard`` / ``keys`` as in ``select_blockwise``."""
        shard = shard or context_shard(None, x_BSH.shape[1], x_BSH.device)
        k_BSD, w_BTH = keys if keys is not None else self.sequence_keys(x_BSH, shard)
        q_BTHD = self.project_queries(qr_BSQ, shard.positions)
        return _SelectedKL.apply(q_BTHD, k_BSD, w_BTH, picks_BTK, target_BTK,
                                 self.head_dim ** -0.5,
                                 selected_chunk_rows(*picks_BTK.shape[::2], self.head_dim))


# Budget (elements) of one query chunk's gathered indexer keys [B, T, K, Di] in
# ``_SelectedScores``: 4 MiB fp32 (T = 4 at K = 2048, Di = 128), near the core's L2, so the
# gathered keys stay cached between the matmuls that read them (forward: logits; backward:
# logits, dq and the key gradient). Measured at 4K tokens, 8 heads (bench/dsa_attention.py
# shapes): T = 4..8 fastest; T = 1..2 pay per-chunk overhead, T = 16 ran ~1.7x slower and
# T = 120 (chunks of CHUNK_ELEMENTS) ~6x.
SELECTED_CHUNK_ELEMENTS = 1 << 20


def selected_chunk_rows(batch: int, picks: int, width: int) -> int:
    """Query rows per ``_SelectedScores`` chunk: gathered keys of ~SELECTED_CHUNK_ELEMENTS."""
    return max(1, SELECTED_CHUNK_ELEMENTS // max(1, batch * picks * width))


class _SelectedScores(torch.autograd.Function):
    """I[b,t,j] = sum_h w[b,t,h] ReLU(scale q[b,t,h] . k[b, idx[b,t,j]]) by query chunks.

    Autograd over a gather would save each chunk's gathered keys [B, T, K, Di] and logits
    [B, T, K, Hi] (GB per layer at 4K tokens); this saves only q, k, w and the indices and
    recomputes a chunk's gathered keys and logits in backward. Per chunk: one row gather of
    the picked keys into a reused buffer, then batched matmuls over the B*T queries (G below):
    logits [G, Hi, K] = q [G, Hi, Di] x keys^T, the head sum [G, 1, K] = w [G, 1, Hi] x ReLU.
    The model's KL runs the same chunks fused with the KL (``_SelectedKL``).
    """

    @staticmethod
    def forward(ctx, q_BSHD, k_BSD, w_BSH, topk_BSK, scale: float, rows: int):
        ctx.save_for_backward(q_BSHD, k_BSD, w_BSH, topk_BSK)
        ctx.scale, ctx.rows = scale, rows
        batch, seq, picks = topk_BSK.shape
        keys, scratch = RowTable(fp32_at_least(k_BSD)), Scratch(k_BSD.device)
        out = torch.empty(batch, seq, picks, dtype=keys.rows.dtype, device=k_BSD.device)
        for start in range(0, seq, rows):
            chunk = slice(start, min(seq, start + rows))
            index_GK = _chunk_scores(q_BSHD, k_BSD, w_BSH, topk_BSK, keys, scratch, chunk,
                                     scale)[0]
            out[:, chunk] = index_GK.view(batch, -1, picks)
        return out

    @staticmethod
    def backward(ctx, grad_BSK):
        q_BSHD, k_BSD, w_BSH, topk_BSK = ctx.saved_tensors
        keys, scratch = RowTable(fp32_at_least(k_BSD)), Scratch(k_BSD.device)
        dq, dw = (torch.empty(t.shape, dtype=compute_dtype(t), device=t.device)
                  for t in (q_BSHD, w_BSH))
        dk_rows = torch.zeros_like(keys.rows)
        for start in range(0, topk_BSK.shape[1], ctx.rows):
            chunk = slice(start, min(topk_BSK.shape[1], start + ctx.rows))
            _, parts, valid_GK = _chunk_scores(q_BSHD, k_BSD, w_BSH, topk_BSK, keys, scratch,
                                               chunk, ctx.scale)
            g_GK = _chunk_rows(grad_BSK, chunk).masked_fill(~valid_GK, 0.0)
            _scores_backward(g_GK, parts, ctx.scale, keys, chunk, dq, dw, dk_rows, scratch)
        return (dq.to(q_BSHD.dtype), keys.as_input_layout(dk_rows).to(k_BSD.dtype),
                dw.to(w_BSH.dtype), None, None, None)


class _SelectedKL(torch.autograd.Function):
    """Sum over queries of KL(target || softmax(I at the picks)), I as ``_SelectedScores``
    computes it, in one op by query chunks: ``target_BTK`` [B, T, K] the main attention's
    head-summed probabilities of the picks (no gradient; normalised per query here), int32
    ``picks_BTK`` (-1: none, excluded from the softmax; ``-inf`` scores).

    Kept for backward: the indexer's q, k, w, the picks and the target (4 bytes per pick
    each), and the per-query log-sum-exp of I; each chunk's gathered keys, logits and I are
    recomputed. Unfused, autograd kept I, its log-softmax and masks besides (18 bytes per
    pick with int64 picks and their validity)."""

    @staticmethod
    def forward(ctx, q_BTHD, k_BSD, w_BTH, picks_BTK, target_BTK, scale: float, rows: int):
        batch, seq = picks_BTK.shape[:2]
        keys, scratch = RowTable(fp32_at_least(k_BSD)), Scratch(k_BSD.device)
        lse_BT = torch.empty(batch, seq, dtype=keys.rows.dtype, device=k_BSD.device)
        total = torch.zeros((), dtype=keys.rows.dtype, device=k_BSD.device)
        for start in range(0, seq, rows):
            chunk = slice(start, min(seq, start + rows))
            index_GK, _, valid_GK = _chunk_scores(q_BTHD, k_BSD, w_BTH, picks_BTK, keys,
                                                  scratch, chunk, scale)
            lse_G1 = torch.logsumexp(index_GK, dim=-1, keepdim=True)
            lse_BT[:, chunk] = lse_G1.view(batch, -1)
            logp_GK = index_GK - lse_G1
            target_GK = _normalised_target(_chunk_rows(target_BTK, chunk), valid_GK)
            present = target_GK > 0
            total += torch.where(present, target_GK * (target_GK.clamp_min(1e-30).log()
                                                       - logp_GK), 0.0).sum()
        ctx.save_for_backward(q_BTHD, k_BSD, w_BTH, picks_BTK, target_BTK, lse_BT)
        ctx.scale, ctx.rows = scale, rows
        return total

    @staticmethod
    def backward(ctx, grad):
        q_BTHD, k_BSD, w_BTH, picks_BTK, target_BTK, lse_BT = ctx.saved_tensors
        seq = picks_BTK.shape[1]
        keys, scratch = RowTable(fp32_at_least(k_BSD)), Scratch(k_BSD.device)
        dq, dw = (torch.empty(t.shape, dtype=compute_dtype(t), device=t.device)
                  for t in (q_BTHD, w_BTH))
        dk_rows = torch.zeros_like(keys.rows)
        for start in range(0, seq, ctx.rows):
            chunk = slice(start, min(seq, start + ctx.rows))
            index_GK, parts, valid_GK = _chunk_scores(q_BTHD, k_BSD, w_BTH, picks_BTK, keys,
                                                      scratch, chunk, ctx.scale)
            # d KL / d I = softmax(I) x (the query's target mass: 1, or 0 without a target)
            # - target; softmax from the saved log-sum-exp (-inf I at invalid picks: 0).
            target_GK = _normalised_target(_chunk_rows(target_BTK, chunk), valid_GK)
            lse_G1 = lse_BT[:, chunk].reshape(-1, 1).to(index_GK.dtype)
            lse_G1 = torch.where(torch.isfinite(lse_G1), lse_G1, 0.0)  # no valid pick
            mass_G1 = target_GK.sum(-1, keepdim=True)
            g_GK = index_GK.sub_(lse_G1).exp_().mul_(mass_G1).sub_(target_GK).mul_(grad)
            _scores_backward(g_GK, parts, ctx.scale, keys, chunk, dq, dw, dk_rows, scratch)
        return (dq.to(q_BTHD.dtype), keys.as_input_layout(dk_rows).to(k_BSD.dtype),
                dw.to(w_BTH.dtype), None, None, None, None)


def _normalised_target(target_GK: torch.Tensor, valid_GK: torch.Tensor) -> torch.Tensor:
    """The KL's target per query: the valid picks' probabilities, summing to 1 (0 if none)."""
    target_GK = target_GK.masked_fill(~valid_GK, 0.0)
    return target_GK / target_GK.sum(-1, keepdim=True).clamp_min(1e-30)


def _chunk_scores(q_BTHD, k_BSD, w_BTH, picks_BTK, keys: RowTable, scratch: Scratch,
                  chunk: slice, scale: float):
    """One chunk's index scores I [G, K] (-inf at invalid picks), what their backward needs
    (flat rows, gathered keys, q, w, the ReLU'd logits) and the validity [G, K]."""
    flat, valid_BTK = keys.pick_rows(picks_BTK[:, chunk])
    valid_GK = valid_BTK.flatten(0, 1)
    k_GKD = keys.gather(flat, chunk.stop - chunk.start, scratch)
    q_GHD, w_GH = _chunk_rows(q_BTHD, chunk), _chunk_rows(w_BTH, chunk)
    relu_GHK = torch.bmm(q_GHD, k_GKD.transpose(1, 2)).mul_(scale).relu_()
    index_GK = torch.bmm(w_GH.unsqueeze(1), relu_GHK).squeeze(1)
    index_GK = index_GK.masked_fill_(~valid_GK, float("-inf"))
    return index_GK, (flat, k_GKD, q_GHD, w_GH, relu_GHK), valid_GK


def _scores_backward(g_GK, parts, scale: float, keys: RowTable, chunk: slice, dq, dw,
                     dk_rows, scratch: Scratch) -> None:
    """Gradients of I = sum_h w ReLU(scale q . k) at one chunk's picks, given dI [G, K]
    (0 at invalid picks): written into dq / dw, added into the key rows."""
    flat, k_GKD, q_GHD, w_GH, relu_GHK = parts
    batch = dq.shape[0]
    dw[:, chunk] = torch.bmm(relu_GHK, g_GK.unsqueeze(2)).view(batch, -1, w_GH.shape[1])
    # dI/dlogit = g x w x scale where the ReLU passes (its output > 0), else 0: built in the
    # ReLU's buffer (sign() is that 0/1 mask there).
    dlogits_GHK = relu_GHK.sign_().mul_(g_GK.unsqueeze(1)).mul_(w_GH.unsqueeze(2) * scale)
    dq[:, chunk] = torch.bmm(dlogits_GHK, k_GKD).view(batch, -1, *dq.shape[2:])
    dk_rows.index_add_(0, flat, torch.bmm(dlogits_GHK.transpose(1, 2), q_GHD,
                                          out=scratch.get("dkeys", k_GKD.shape,
                                                          k_GKD.dtype)).flatten(0, 1))


def _chunk_rows(t_BS: torch.Tensor, chunk: slice) -> torch.Tensor:
    """A chunk of queries of a [B, S, ...] tensor as [B*T, ...] in the compute dtype."""
    return fp32_at_least(t_BS[:, chunk]).flatten(0, 1)


class DSACoreAttention(MLACoreAttention):
    """MLA core attention restricted to the indexer's top-k keys per query, plus the indexer's
    KL loss for the DSA training stages (see ``glm5_train/model/dsa_loss.py``).

    Sparse stage with index_topk < S and ``dsa.sparse_attention=absorbed``: ``key`` is MLA's
    latent key [S, B, 1, C + R] and ``value`` None (``runs_absorbed``, fed by
    ``sparse_mla.GLM5MLASelfAttention``), attended in the absorbed form. Otherwise the usual
    up-projected q / k / v: dense flash attention (``dsa.stage=dense``, which never runs the
    indexer; the warm-up; every key selected) or the masked-dense reference."""

    supports_context_parallel = True  # queries stay local, keys gathered (_attend)
    # megatron-core 0.19's MLA hands the core attention the hidden states and the query latent
    # (``x``, ``qr``) when it says so; 0.16's when the config's attention variant is "dsa".
    requires_dsa_inputs = True
    # The head-parallel path of this attention's CP group (head_parallel_cp.HeadParallelCP,
    # its all-to-all inside); None: the all-gather mode. Switched with the group (flexible).
    cp_exchange = None

    def __init__(self, config: TransformerConfig, *args, dsa_n_heads: int, dsa_head_dim: int,
                 dsa_topk: int, rope_theta: float, dsa_training: DSATrainingConfig | None = None,
                 **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.indexer = DSAIndexer(config, dsa_n_heads, dsa_head_dim, dsa_topk,
                                  config.qk_pos_emb_head_dim, rope_theta)
        self.training_cfg = dsa_training or DSATrainingConfig()
        self.kl_meter = KLMeter()
        # Training forward under megatron-core's tensor_parallel.checkpoint: only the inputs
        # are kept, selection + attention + KL are recomputed in backward (recompute module
        # "core_attn"; megatron's own checkpoint_core_attention path drops x and qr).
        self.recompute_core = False
        # Set by GLM5MLASelfAttention (glm5_train.model.sparse_mla): W_UK / W_UV views of its
        # linear_kv_up_proj weight for the absorbed path (a function: no second registration).
        self.latent_up_weights = None
        # Set by GLM5Model around the dense warm-up's grad-free forward (``local_kl_backward``):
        # the KL then runs its backward here, at once, instead of riding on the layer output.
        self.kl_backward_in_forward = False

    def runs_absorbed(self, seq: int) -> bool:
        """Whether a forward over ``seq`` tokens (the whole sequence, over every context-
        parallel rank) takes the absorbed sparse path."""
        cfg = self.training_cfg
        return (cfg.sparse_attention == "absorbed" and cfg.stage == "sparse"
                and self.indexer.topk < seq and self.latent_up_weights is not None)

    def takes_latent(self, seq: int) -> bool:
        """Whether the self-attention hands over MLA's latent key [S, B, 1, C + R] and value
        None instead of up-projected keys and values: on the absorbed sparse path, and always
        under context parallelism, where the latent (C + R values per token) is what crosses
        ranks and each rank up-projects the gathered latent for its dense paths."""
        split = group_size(self.cp_group) > 1 and self.latent_up_weights is not None
        return split or self.runs_absorbed(seq)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                attention_mask: torch.Tensor | None, attn_mask_type=None,
                packed_seq_params=None, x: torch.Tensor | None = None,
                qr: torch.Tensor | None = None, **_: object) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("THD packed sequences need Transformer Engine attention")
        if (attention_mask is not None and attention_mask.dtype == torch.bool
                and group_size(self.cp_group) > 1):
            raise NotImplementedError("a [B, 1, S, S] attention mask under context parallelism: "
                                      "packed documents go as document starts "
                                      "(glm5_train/model/key_masks.py)")
        with_loss = (self.training and self.training_cfg.trains_indexer
                     and (torch.is_grad_enabled() or self.kl_backward_in_forward))
        if self.recompute_core and self.training and torch.is_grad_enabled():
            def attend(query, key, value, attention_mask, x, qr):
                # First call: checkpoint's no-grad forward; second: the recompute in backward
                # (grad enabled), whose KL must not be counted again.
                return self._attend(query, key, value, attention_mask, x, qr, with_loss,
                                    record_kl=not torch.is_grad_enabled())
            return tensor_parallel.checkpoint(attend, False, query, key, value, attention_mask,
                                              x, qr)
        return self._attend(query, key, value, attention_mask, x, qr, with_loss)

    def _attend(self, query, key, value, attention_mask, x, qr, with_loss: bool,
                record_kl: bool = True) -> torch.Tensor:
        """Selection, attention and the KL's attachment (see ``forward``)."""
        cfg = self.training_cfg
        allowed_BSS = key_mask(attention_mask)  # bool [B, T, S], DocumentStarts or None
        shard = context_shard(self.cp_group, query.shape[0], query.device)
        # --- head-parallel CP hook (parallel.cp_comm=head_parallel or auto): the exchange is
        # set at start-up by glm5_train/model/head_parallel_cp.install (fixed CP) or per
        # micro-batch with its group (flexible CP); queries go to head shards by all-to-all.
        if self.cp_exchange is not None and shard.is_split:
            return self.cp_exchange.attend(self, query, key, value, attention_mask, x, qr,
                                           with_loss, record_kl, shard)
        # --- end of the head-parallel CP hook
        if cfg.attends_densely or self.indexer.topk >= shard.seq:
            # Dense stage (no indexer at all), warm-up (dense attention, the indexer's KL
            # below), or every causal key selected (sparse attention is then exactly dense).
            query, key, value = self._dense_inputs(query, key, value, shard)
            out = self._dense(query, key, value, allowed_BSS, shard)
            if cfg.stage != "dense_warmup":
                return out
            if with_loss and self.kl_backward_in_forward:
                self._kl_backward_now(query, key, x, qr, allowed_BSS, shard)
            elif with_loss:
                kl = dense_indexer_kl(self, query, key, x, qr, allowed_BSS, query_chunk, shard)
                out = self._attach(out, record_kl, kl)
            return out
        # The indexer reads detached inputs: the KL trains the indexer only, selection needs
        # no gradient. Its keys are projected and gathered once, for both.
        x_in, qr_in = self._indexer_inputs(x.detach(), qr.detach())
        with torch.set_grad_enabled(torch.is_grad_enabled() and with_loss):
            keys = self.indexer.sequence_keys(x_in, shard)
        with torch.no_grad():  # blockwise: no [B, S, S] scores (see causal_topk)
            topk_BSK, picked_BSK = self.indexer.select_blockwise(
                x_in, qr_in, allowed_BSS, shard=shard, keys=tuple(k.detach() for k in keys))
            # int32 key rows, -1 where nothing was selectable: 4 bytes a pick kept for
            # backward (attention and KL share it), not an int64 and a bool.
            picks_BSK = picks_from(topk_BSK, picked_BSK > float("-inf"))
            del topk_BSK, picked_BSK
        if value is None and cfg.sparse_attention == "absorbed":  # MLA absorbed, O(S K)
            w_uk, w_uv = self.latent_up_weights()
            out, probs_BSK = absorbed_sparse_mla(query, gather_sequence(key, shard), w_uk, w_uv,
                                                 picks_BSK, self.softmax_scale,
                                                 need_probs=with_loss, kernel=cfg.sparse_kernel)
        else:  # dsa.sparse_attention=masked_dense, or a path megatron-core up-projected
            query, key, value = self._dense_inputs(query, key, value, shard)
            out, probs_BSK = sparse_attention(query, key, value, picks_BSK.clamp_min(0).long(),
                                              picks_BSK >= 0, self.softmax_scale,
                                              need_probs=with_loss)
        if with_loss:
            kl = selected_indexer_kl(self, x_in, qr_in, picks_BSK, probs_BSK, shard, keys)
            out = self._attach(out, record_kl, kl)
        return out

    def _dense_inputs(self, query, key, value, shard: ContextShard):
        """Up-projected keys and values for dense attention. Given MLA's latent key (value
        None: context parallelism), the whole sequence's latent is gathered and up-projected
        here, k = W_UK c ‖ k_pe and v = W_UV c per head; otherwise they arrive up-projected."""
        if value is not None:
            return query, key, value
        latent = gather_sequence(key, shard)  # [S, B, 1, C + R]
        w_uk, w_uv = self.latent_up_weights()
        c, k_pe = latent.squeeze(2).split([w_uk.shape[-1], latent.shape[-1] - w_uk.shape[-1]],
                                          dim=-1)
        k_nope = torch.einsum("sbc,ndc->sbnd", c, w_uk)
        key = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, w_uk.shape[0], -1)], dim=-1)
        return query, key, torch.einsum("sbc,nvc->sbnv", c, w_uv)

    def _dense(self, query, key, value, allowed: KeyMask, shard: ContextShard) -> torch.Tensor:
        """Dense causal attention of this rank's queries over the whole sequence's keys.
        Packed documents (``DocumentStarts``) on whole sequences: causal attention within each
        document (``_dense_by_document``), no mask; under context parallelism, or with
        megatron's bool mask, a [B, 1, T, S] mask."""
        if not shard.is_split and allowed is None:
            return super().forward(query, key, value, None)
        if not shard.is_split and isinstance(allowed, DocumentStarts):
            return self._dense_by_document(query, key, value, allowed)
        q_BNTD, k_BNSD, v_BNSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        extra = allowed_block(allowed, 0, query.shape[0], 0, key.shape[0])
        out_BNTD = attention_at_positions(q_BNTD, k_BNSD, v_BNSD, shard.positions,
                                          self.softmax_scale,
                                          None if extra is None else extra[:, None])
        return out_BNTD.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _dense_by_document(self, query, key, value, starts: DocumentStarts) -> torch.Tensor:
        """Packed documents of whole sequences: one causal SDPA call per document and batch
        row (a document attends to itself only, so this is exact), nothing [T, S] built or
        kept: at 202,752 tokens a [B, T, S] mask would be 41 GB per layer."""
        rows = []
        for b, bounds in enumerate(document_bounds(starts.start_BT)):
            pieces = [super(DSACoreAttention, self).forward(
                query[d0:d1, b:b + 1], key[d0:d1, b:b + 1], value[d0:d1, b:b + 1], None)
                for d0, d1 in bounds]
            rows.append(torch.cat(pieces, dim=0))
        return torch.cat(rows, dim=1)

    def _attach(self, out: torch.Tensor, record_kl: bool,
                kl: tuple[torch.Tensor, int]) -> torch.Tensor:
        """Add coeff x (sum of per-query KL) to the backward pass; megatron-core divides all
        gradients by the global loss-token count, which turns the sum into a mean."""
        kl_sum, queries = kl
        if record_kl:
            self.kl_meter.add(kl_sum.detach(), queries)
        return MoEAuxLossAutoScaler.apply(out, kl_sum * self.training_cfg.indexer_loss_coeff)

    def _kl_backward_now(self, query, key, x, qr, allowed_BSS,
                         shard: ContextShard | None = None) -> None:
        """Dense warm-up under the grad-free forward: the KL's gradient reaches only the
        indexer's parameters (its inputs are detached), so its backward runs here, scaled
        exactly as MoEAuxLossAutoScaler's backward would scale it; the indexer's grads then
        reach megatron's DDP through their usual accumulation hooks."""
        with torch.enable_grad():
            kl_sum, queries = dense_indexer_kl(self, query, key, x, qr, allowed_BSS, query_chunk,
                                               shard)
            self.kl_meter.add(kl_sum.detach(), queries)
            aux_loss = kl_sum * self.training_cfg.indexer_loss_coeff
            torch.autograd.backward(aux_loss, aux_loss_gradient(self.config, aux_loss))

    def _indexer_inputs(self, x: torch.Tensor, qr: torch.Tensor):
        """[S(/TP), B, *] inputs -> full-sequence [B, S, *] on every TP rank."""
        if self.config.sequence_parallel:
            # Replicated computation: the backward must split, not sum, the gradient.
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
            qr = gather_from_sequence_parallel_region(qr, tensor_parallel_output_grad=False)
        return x.transpose(0, 1), qr.transpose(0, 1)


def aux_loss_gradient(config: TransformerConfig, aux_loss: torch.Tensor) -> torch.Tensor:
    """The gradient MoEAuxLossAutoScaler's backward gives ``aux_loss``: ones x the scale
    megatron-core's forward_step_calc_loss sets under calculate_per_token_loss (the grad scale
    function at 1, else 1), computed here because the local backward runs before megatron sets
    it for the first micro-batch."""
    if not config.calculate_per_token_loss:
        raise ValueError("the dense warm-up's local KL backward needs calculate_per_token_loss="
                         "True (megatron's per-micro-batch aux-loss scale is not known here): "
                         "build the model config with glm5_train.model.config.to_mcore_config")
    one = torch.ones(1, device=aux_loss.device)
    scale = config.grad_scale_func(one) if config.grad_scale_func is not None else one
    return (torch.ones_like(aux_loss) * scale).sum_to_size(aux_loss.shape)


def sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     topk_BSK: torch.Tensor, valid_BSK: torch.Tensor, softmax_scale: float,
                     need_probs: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of each query over its own top-k keys only.

    ``query``/``key`` [S, B, N, Dqk], ``value`` [S, B, N, Dv]; returns the output
    [S, B, N * Dv] and the attention probabilities summed over this rank's heads [B, S, K]
    (detached: the indexer loss's target; None unless ``need_probs``).

    The reference sparse path (``dsa.sparse_attention=masked_dense``): dense attention with
    every unselected key masked, one query chunk at a time, on SDPA's fused kernels (memory:
    one chunk's mask, no [B, N, S, S] logits), quadratic compute. Gathering per-head keys
    would move S x K x N x D elements per pass; training runs the absorbed form instead
    (``sparse_mla.absorbed_sparse_attention``), which gathers the K latent rows once for all
    heads. ``bench/dsa_attention.py`` measures it against dense attention.
    """
    seq, batch, heads, _ = query.shape
    keys = key.shape[0]  # the whole sequence (more than ``seq`` under context parallelism)
    rows = query_chunk(batch * heads * keys)
    q_BNSD, k_BNSD, v_BNSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    outs, probs = [], []
    for start in range(0, seq, rows):
        q_BNTD = q_BNSD[:, :, start:start + rows]
        idx_BTK, valid_BTK = topk_BSK[:, start:start + rows], valid_BSK[:, start:start + rows]
        selected_BTS = _selection_mask(idx_BTK, valid_BTK, keys)
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
