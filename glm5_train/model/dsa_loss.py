"""The DSA indexer's training signal: KL(main attention || indexer), per training stage.

DeepSeek-V3.2's recipe (GLM-5 does not state its loss; ``docs/glm5_reference.md`` sec. 4):
the target is the main attention's probabilities summed over all heads and L1-normalised; the
indexer's distribution is the softmax of its index scores; loss = KL(target || indexer).

- ``dense``: dense causal MLA attention, the indexer neither run nor trained (its weights kept,
  frozen, for a later warm-up): GLM-5's pre- and mid-training, before DSA is introduced.
- ``dense_warmup``: attention stays dense, everything but the indexer is frozen, KL over all
  causal keys.
- ``sparse``: attention over the top-k keys, KL over the selected set only, with the indexer's
  inputs detached so the KL trains the indexer and nothing else.
- ``freeze_indexer``: no indexer loss and no indexer updates (GLM-5's RL setting).

Memory: the sparse-stage loss scores the indexer at the selected keys only, O(B S K) saved
for backward (``DSAIndexer.selected_scores``). The dense warm-up loss runs by chunks of T query
rows (``_DenseKL``): a chunk's target logits [B, N, T, S] and index logits [B, T, Hi, S] exist
only while that chunk is computed, forward and again in backward; saved for backward are the
inputs (indexer q, k, w; the main attention's query and key; the mask), nothing quadratic.
T follows from the working-set budget ``dsa.CHUNK_ELEMENTS``. The backward recomputes each
chunk's target (all-reduced over TP again) and index logits: one more pass of each than a
backward from saved [S, S] tensors, the price of O(T x S) memory at 202K tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from glm5_train.model import triton_sparse_mla
from glm5_train.model.key_masks import DocumentStarts, KeyMask, allowed_block, earliest_starts
from glm5_train.model.picked_rows import compute_dtype, fp32_at_least
from parallel.comm_purpose import collective_purpose
from parallel.context_parallel import ContextShard, context_shard

STAGES = ("sparse", "dense_warmup", "dense")
# The stages whose main attention is dense causal MLA over every key (no top-k selection).
DENSE_ATTENTION_STAGES = ("dense_warmup", "dense")
# Sparse-stage attention: MLA absorbed over the selected latent keys (glm5_train.model.
# sparse_mla, O(S K)), or the reference: dense attention under a top-k mask (O(S^2) compute).
SPARSE_ATTENTION = ("absorbed", "masked_dense")
# Who runs the absorbed sparse attention: the Triton kernels where they can (CUDA), the torch
# path otherwise ("auto"); always the kernels ("triton": on CPU under Triton's interpreter,
# TRITON_INTERPRET=1, the CUDA call sites emulated); always the torch path ("torch").
SPARSE_KERNELS = ("auto", "triton", "torch")


@dataclass
class DSATrainingConfig:
    stage: str = "sparse"
    indexer_loss_coeff: float = 0.001
    freeze_indexer: bool = False
    sparse_attention: str = "absorbed"
    sparse_kernel: str = "auto"

    @property
    def trains_indexer(self) -> bool:
        return not self.freeze_indexer and self.indexer_loss_coeff > 0

    @property
    def attends_densely(self) -> bool:
        """Dense causal attention over every key whatever index_topk (no selection)."""
        return self.stage in DENSE_ATTENTION_STAGES

    def validate(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"dsa.stage={self.stage!r}: use one of {STAGES}")
        if self.sparse_attention not in SPARSE_ATTENTION:
            raise ValueError(f"dsa.sparse_attention={self.sparse_attention!r}: use one of "
                             f"{SPARSE_ATTENTION}")
        if self.sparse_kernel not in SPARSE_KERNELS:
            raise ValueError(f"dsa.sparse_kernel={self.sparse_kernel!r}: use one of "
                             f"{SPARSE_KERNELS}")
        if self.sparse_kernel == "triton":
            _check_triton_kernel_runs(self.sparse_attention)
        if self.indexer_loss_coeff < 0:
            raise ValueError(f"dsa.indexer_loss_coeff={self.indexer_loss_coeff} must be >= 0")
        if self.stage == "dense_warmup" and not self.trains_indexer:
            raise ValueError(
                "dsa.stage=dense_warmup trains only the indexer, but dsa.freeze_indexer=true or "
                "dsa.indexer_loss_coeff=0 leaves nothing to train: set dsa.freeze_indexer=false "
                "and a positive dsa.indexer_loss_coeff, or use dsa.stage=sparse")
        if self.stage == "dense":
            _check_dense_stage(self.freeze_indexer, self.indexer_loss_coeff)


def _check_dense_stage(freeze_indexer: bool, indexer_loss_coeff: float) -> None:
    """dsa.stage=dense never runs the indexer, so nothing could train it: a KL coefficient or
    an unfrozen indexer would be silently ignored (and an unfrozen one would carry gradient
    buffers and optimizer state that are never used). Refused rather than overridden, so
    the config says what runs."""
    if not freeze_indexer or indexer_loss_coeff > 0:
        raise ValueError(
            f"dsa.stage=dense runs no indexer, but dsa.freeze_indexer={str(freeze_indexer).lower()}"
            f" and dsa.indexer_loss_coeff={indexer_loss_coeff} ask to train it: use dsa=dense "
            "(or set dsa.freeze_indexer=true dsa.indexer_loss_coeff=0)")


def _check_triton_kernel_runs(sparse_attention: str) -> None:
    """``dsa.sparse_kernel=triton`` needs triton, and off CUDA its interpreter, chosen by the
    environment before triton is imported (it decides then how kernels are built)."""
    if sparse_attention != "absorbed":
        raise ValueError(f"dsa.sparse_kernel=triton runs the absorbed sparse path, but "
                         f"dsa.sparse_attention={sparse_attention!r}: set "
                         "dsa.sparse_attention=absorbed or dsa.sparse_kernel=auto")
    if not triton_sparse_mla.available():
        raise ValueError("dsa.sparse_kernel=triton needs triton, which is not installed: "
                         "pip install -e '.[dev]' (or use dsa.sparse_kernel=auto)")
    if not torch.cuda.is_available() and not triton_sparse_mla.interpreted():
        raise ValueError("dsa.sparse_kernel=triton without a GPU runs the kernels under "
                         "Triton's CPU interpreter: start the job with TRITON_INTERPRET=1 in "
                         "its environment (or use dsa.sparse_kernel=auto)")
    if triton_sparse_mla.interpreted() and not triton_sparse_mla.interpreter_runs_kernels():
        raise ValueError(f"dsa.sparse_kernel=triton on CPU: the interpreter of triton "
                         f"{triton_sparse_mla.triton.__version__} cannot run the kernels (3.6 "
                         "fails with NumPy 2 on their loops); pip install 'triton>=3.7' or use "
                         "dsa.sparse_kernel=auto")


class KLMeter:
    """Accumulates one layer's KL sum and query count across a step's micro-batches."""

    def __init__(self) -> None:
        self.kl_sum, self.queries = 0.0, 0

    def add(self, kl_sum: torch.Tensor, queries: int) -> None:
        self.kl_sum += float(kl_sum)
        self.queries += queries

    def take(self) -> tuple[float, int]:
        taken = (self.kl_sum, self.queries)
        self.kl_sum, self.queries = 0.0, 0
        return taken


@collective_purpose("kl_head_sum")
def _sum_over_tp_heads(heads_sum: torch.Tensor, tp_group) -> torch.Tensor:
    """Heads are split over TP ranks: add the other ranks' head sums (no gradient needed)."""
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(heads_sum, group=tp_group)
    return heads_sum


def _kl(target: torch.Tensor, index_scores: torch.Tensor) -> torch.Tensor:
    """Sum over queries of KL(target || softmax(index_scores)); -inf scores are excluded."""
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    logp = torch.log_softmax(index_scores, dim=-1)
    present = target > 0
    terms = torch.where(present, target * (target.clamp_min(1e-30).log() - logp),
                        torch.zeros_like(target))
    return terms.sum()


def _detached_inputs(module, x: torch.Tensor, qr: torch.Tensor):
    return module._indexer_inputs(x.detach(), qr.detach())


def dense_indexer_kl(module, query: torch.Tensor, key: torch.Tensor, x: torch.Tensor,
                     qr: torch.Tensor, allowed_BSS: torch.Tensor | None,
                     query_chunk: Callable[[int], int],
                     shard: ContextShard | None = None) -> tuple:
    """Warm-up KL over all causal keys. ``query`` [T, B, N, D] / ``key`` [S, B, N, D] (this
    rank's heads; T = S but for a context-parallel ``shard``: its rows, keys the whole
    sequence); ``query_chunk``: rows per chunk for a per-row element count (``dsa.query_chunk``,
    passed in because dsa.py, which owns the budget, imports this module)."""
    rows, batch, heads = query.shape[:3]
    indexer = module.indexer
    x_in, qr_in = _detached_inputs(module, x, qr)
    shard = shard or context_shard(None, rows, query.device)
    k_BSD, w_BTH = indexer.sequence_keys(x_in, shard)
    q_BTHD = indexer.project_queries(qr_in, shard.positions)
    plan = _DenseKLPlan(softmax_scale=module.softmax_scale, index_scale=indexer.head_dim ** -0.5,
                        tp_group=module.tp_group,
                        rows=query_chunk(batch * key.shape[0] * (heads + indexer.n_heads)),
                        positions=shard.positions)
    kl_sum = _DenseKL.apply(q_BTHD, k_BSD, w_BTH, query.detach(), key.detach(), allowed_BSS,
                            plan)
    return kl_sum, batch * rows


@dataclass(frozen=True)
class _DenseKLPlan:
    softmax_scale: float  # the main attention's
    index_scale: float  # Di^-0.5, inside the indexer's ReLU
    tp_group: object  # the main attention's heads are split over it
    rows: int  # query rows per chunk
    positions: torch.Tensor  # the query rows' global positions (increasing)

    def chunks(self, rows: int, allowed_BSS: KeyMask):
        """(t0, t1, s0, s1): query rows t0..t1-1 and the keys s0..s1-1 they may see: none
        past the last row, none before the rows' earliest document start (packed documents:
        most of the causal triangle is skipped, as the indexer's top-k skips it)."""
        last_key = (self.positions + 1).tolist()
        earliest = earliest_starts(allowed_BSS, rows, self.rows)
        for block, t0 in enumerate(range(0, rows, self.rows)):
            t1 = min(rows, t0 + self.rows)
            yield t0, t1, earliest[block], last_key[t1 - 1]


class _DenseKL(torch.autograd.Function):
    """Sum over queries of KL(target || softmax(I)) over all causal (and allowed) keys, by
    chunks of query rows, equal to ``_kl(target, DSAIndexer.scores(...))`` with the [B, S, S]
    target the main attention's head-summed probabilities.

    Inputs: the indexer's q [B, S, Hi, Di], k [B, S, Di], fp32 w [B, S, Hi] (``project``), the
    detached main-attention query and key [S, B, N, D], the allowed mask [B, S, S] or None.
    Only these are saved. Chunk rows t0..t1-1 are scored against keys from their earliest
    document start to the last row's position (the rest are masked for every row).
    Backward recomputes each chunk: dKL/dI = softmax(I) x (target mass) - target, zero on
    rows without any allowed key, then through the ReLU and the two contractions. Every TP
    rank runs the same chunks (same documents), so the per-chunk all-reduces pair up.
    """

    @staticmethod
    def forward(ctx, q_BSHD, k_BSD, w_BSH, query, key, allowed_BSS, plan: _DenseKLPlan):
        documents = isinstance(allowed_BSS, DocumentStarts)
        ctx.save_for_backward(q_BSHD, k_BSD, w_BSH, query, key,
                              allowed_BSS.start_BT if documents else allowed_BSS)
        ctx.plan, ctx.documents = plan, documents
        # the chunks' key ranges, read from the device once for forward and backward
        ctx.chunks = list(plan.chunks(q_BSHD.shape[1], allowed_BSS))
        total = torch.zeros((), dtype=compute_dtype(q_BSHD), device=q_BSHD.device)
        for t0, t1, s0, s1 in ctx.chunks:
            forbidden_BTS = _forbidden(allowed_BSS, plan.positions, t0, t1, s0, s1)
            heads_sum_BTS = _target_rows(query, key, forbidden_BTS, t0, t1, s0, s1, plan)
            relu_BTHS = _index_logits(q_BSHD, k_BSD, t0, t1, s0, s1,
                                      plan.index_scale).relu_()
            index_BTS = _index_scores(w_BSH[:, t0:t1], relu_BTHS, forbidden_BTS)
            total += _kl(heads_sum_BTS, index_BTS)
        return total

    @staticmethod
    def backward(ctx, grad_kl):
        q_BSHD, k_BSD, w_BSH, query, key, allowed_BSS = ctx.saved_tensors
        plan = ctx.plan
        if ctx.documents:
            allowed_BSS = DocumentStarts(allowed_BSS)
        dq, dk, dw = (torch.zeros_like(t, dtype=compute_dtype(t)) for t in (q_BSHD, k_BSD, w_BSH))
        for t0, t1, s0, s1 in ctx.chunks:
            forbidden_BTS = _forbidden(allowed_BSS, plan.positions, t0, t1, s0, s1)
            heads_sum_BTS = _target_rows(query, key, forbidden_BTS, t0, t1, s0, s1, plan)
            logits_BTHS = _index_logits(q_BSHD, k_BSD, t0, t1, s0, s1, plan.index_scale)
            positive_BTHS = logits_BTHS > 0
            relu_BTHS = logits_BTHS.relu_()
            w_BTH = w_BSH[:, t0:t1].to(relu_BTHS.dtype)
            index_BTS = _index_scores(w_BTH, relu_BTHS, forbidden_BTS)
            dindex_BTS = _kl_grad(heads_sum_BTS, index_BTS).mul_(grad_kl)
            dw[:, t0:t1] = torch.einsum("bts,bths->bth", dindex_BTS, relu_BTHS)
            del relu_BTHS, logits_BTHS  # the [B, T, Hi, S] gradient below takes their place
            dlogits_BTHS = (dindex_BTS[:, :, None, :] * w_BTH[..., None]).mul_(positive_BTHS)
            dlogits_BTHS.mul_(plan.index_scale)
            dq[:, t0:t1] = torch.einsum("bths,bsd->bthd", dlogits_BTHS,
                                        fp32_at_least(k_BSD[:, s0:s1]))
            dk[:, s0:s1] += torch.einsum("bths,bthd->bsd", dlogits_BTHS,
                                         fp32_at_least(q_BSHD[:, t0:t1]))
        return (dq.to(q_BSHD.dtype), dk.to(k_BSD.dtype), dw.to(w_BSH.dtype),
                None, None, None, None)


def _forbidden(allowed_BSS: KeyMask, positions: torch.Tensor, t0: int, t1: int, s0: int,
               s1: int) -> torch.Tensor:
    """True at keys s0..s1-1 that query rows t0..t1-1 may not see: [1 or B, T, s1 - s0]."""
    future_TS = (torch.arange(s0, s1, device=positions.device)[None, :]
                 > positions[t0:t1, None])
    allowed = allowed_block(allowed_BSS, t0, t1, s0, s1)
    if allowed is None:
        return future_TS[None]
    return future_TS[None] | ~allowed


def _target_rows(query: torch.Tensor, key: torch.Tensor, forbidden_BTS: torch.Tensor,
                 t0: int, t1: int, s0: int, s1: int, plan: _DenseKLPlan) -> torch.Tensor:
    """The main attention's probabilities of query rows t0..t1-1 over keys s0..s1-1 summed
    over every TP rank's heads, [B, T, s1 - s0], not normalised; zero on rows without any
    allowed key."""
    logits_BNTS = torch.einsum("tbnd,sbnd->bnts", fp32_at_least(query[t0:t1]),
                               fp32_at_least(key[s0:s1]))
    logits_BNTS = logits_BNTS.mul_(plan.softmax_scale).masked_fill_(forbidden_BTS[:, None],
                                                                    float("-inf"))
    heads_sum_BTS = logits_BNTS.softmax(-1).sum(1)
    # A row with every key forbidden is NaN after the softmax; it has no target.
    heads_sum_BTS = heads_sum_BTS.masked_fill_(forbidden_BTS.all(-1, keepdim=True), 0.0)
    return _sum_over_tp_heads(heads_sum_BTS, plan.tp_group)


def _index_logits(q_BSHD: torch.Tensor, k_BSD: torch.Tensor, t0: int, t1: int, s0: int,
                  s1: int, scale: float) -> torch.Tensor:
    """scale x q[t, h] . k[s] for query rows t0..t1-1 and keys s0..s1-1, [B, T, Hi, s1 - s0]."""
    logits_BTHS = torch.einsum("bthd,bsd->bths", fp32_at_least(q_BSHD[:, t0:t1]),
                               fp32_at_least(k_BSD[:, s0:s1]))
    return logits_BTHS.mul_(scale)


def _index_scores(w_BTH: torch.Tensor, relu_BTHS: torch.Tensor,
                  forbidden_BTS: torch.Tensor) -> torch.Tensor:
    """I = sum_h w ReLU(...), -inf where forbidden, [B, T, keys of the chunk]."""
    index_BTS = torch.einsum("bth,bths->bts", w_BTH.to(relu_BTHS.dtype), relu_BTHS)
    return index_BTS.masked_fill_(forbidden_BTS, float("-inf"))


def _kl_grad(heads_sum_BTS: torch.Tensor, index_BTS: torch.Tensor) -> torch.Tensor:
    """d ``_kl``(heads_sum, index) / d index: softmax(I) x (the row's target mass, 1 up to
    rounding) - target; zero on rows with no target (also where I is -inf everywhere)."""
    target_BTS = heads_sum_BTS / heads_sum_BTS.sum(-1, keepdim=True).clamp_min(1e-30)
    mass_BT1 = target_BTS.sum(-1, keepdim=True)
    grad_BTS = index_BTS.softmax(-1).mul_(mass_BT1).sub_(target_BTS)
    return grad_BTS.masked_fill_(mass_BT1 == 0, 0.0)


def sparse_indexer_kl(module, x: torch.Tensor, qr: torch.Tensor, topk_BSK: torch.Tensor,
                      valid_BSK: torch.Tensor, probs_BSK: torch.Tensor) -> tuple:
    """Sparse-stage KL over each query's selected keys from the layer's [S, B, *] inputs
    (whole sequences): ``selected_indexer_kl`` after projecting the indexer's keys."""
    x_in, qr_in = _detached_inputs(module, x, qr)
    shard = context_shard(None, x_in.shape[1], x_in.device)
    picks = triton_sparse_mla.picks_from(topk_BSK, valid_BSK)
    return selected_indexer_kl(module, x_in, qr_in, picks, probs_BSK, shard,
                               module.indexer.sequence_keys(x_in, shard))


def selected_indexer_kl(module, x_in: torch.Tensor, qr_in: torch.Tensor,
                        picks_BSK: torch.Tensor, probs_BSK: torch.Tensor,
                        shard: ContextShard, keys: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """Sparse-stage KL over each query's selected keys; ``picks_BSK`` int32 (-1: none),
    ``probs_BSK`` this rank's head-summed attention over them, ``x_in``/``qr_in`` the
    indexer's detached [B, T, *] inputs of the ``shard``'s rows and ``keys`` their
    ``DSAIndexer.sequence_keys``. The indexer is scored at the selected keys only (O(B T K)
    memory, ``DSAIndexer.selected_kl``); no mask is needed there: a valid pick is an allowed
    key, the rest are dropped."""
    target_BSK = _sum_over_tp_heads(probs_BSK.clone(), module.tp_group)
    kl_sum = module.indexer.selected_kl(x_in, qr_in, picks_BSK, target_BSK, shard, keys)
    return kl_sum, picks_BSK.shape[0] * picks_BSK.shape[1]
