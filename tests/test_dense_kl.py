"""The dense warm-up indexer KL by query chunks (``dsa_loss._DenseKL``) against the full-row
implementation it replaced: same KL and indexer gradients for any chunk size, with and without
an attention mask, under TP2 as on one rank, and nothing [S, S]-sized saved for backward."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from glm5_train.model import dsa_loss
from glm5_train.model.dsa import DSAIndexer
from glm5_train.model.dsa_loss import _DenseKL, _DenseKLPlan, _kl, dense_indexer_kl
from glm5_train.model.key_masks import (
    DocumentStarts,
    document_starts_from_boundaries,
    earliest_starts,
)
from tests.spawn import run_ranks

BATCH, HEADS, WIDTH = 2, 4, 8  # main attention: batch, heads, query/key width
SOFTMAX_SCALE = 0.35


class _Cfg:
    params_dtype, hidden_size, q_lora_rank = torch.float32, 32, 16


def _indexer(dtype=torch.float32) -> DSAIndexer:
    torch.manual_seed(0)
    return DSAIndexer(_Cfg(), n_heads=3, head_dim=8, topk=4, rope_dim=4, rope_theta=1e4).to(dtype)


def _module(indexer: DSAIndexer, tp_group=None):
    """What dense_indexer_kl reads of DSACoreAttention (no sequence parallelism here)."""
    return types.SimpleNamespace(indexer=indexer, tp_group=tp_group, softmax_scale=SOFTMAX_SCALE,
                                 _indexer_inputs=lambda x, qr: (x.transpose(0, 1),
                                                                qr.transpose(0, 1)))


def _inputs(seq: int, dtype=torch.float32, batch: int = BATCH, heads: int = HEADS, seed: int = 1):
    """x [S, B, 32], qr [S, B, 16], main-attention query and key [S, B, N, D]."""
    gen = torch.Generator().manual_seed(seed)
    x, qr = (torch.randn(seq, batch, w, generator=gen, dtype=dtype) for w in (32, 16))
    query, key = (torch.randn(seq, batch, heads, WIDTH, generator=gen, dtype=dtype)
                  for _ in range(2))
    return x, qr, query, key


def _allowed(seq: int, seed: int = 2) -> torch.Tensor:
    """A random [B, S, S] mask that always allows the diagonal (the old full-row code gives
    NaN gradients to a query with no allowed key)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(BATCH, seq, seq, generator=gen) > 0.4) | torch.eye(seq, dtype=torch.bool)


def _old_dense_kl(module, query, key, x, qr, allowed_BSS):
    """The full-row implementation the chunked one replaced ([B, N, S, S] target, [B, S, S]
    index scores with autograd), kept as the reference."""
    seq, batch = query.shape[:2]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    allowed = causal if allowed_BSS is None else allowed_BSS & causal
    with torch.no_grad():
        logits_BNSS = torch.einsum("sbnd,tbnd->bnst", query.float(), key.float())
        forbidden = ~allowed if allowed.dim() == 2 else ~allowed[:, None]
        logits_BNSS = (logits_BNSS * module.softmax_scale).masked_fill(forbidden, float("-inf"))
        target_BSS = logits_BNSS.softmax(-1).sum(1)
    index_BSS = module.indexer.scores(x.detach().transpose(0, 1), qr.detach().transpose(0, 1),
                                      allowed_BSS)
    return _kl(target_BSS, index_BSS), batch * seq


def _kl_and_grads(indexer, fn, *args):
    indexer.zero_grad()
    kl, queries = fn(*args)
    kl.backward()
    return kl.detach(), queries, [p.grad.clone() for p in indexer.parameters()]


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_dense_kl_equals_the_full_row_kl(rows, masked):
    """fp32, the whole path (indexer projections included): the KL and every indexer
    parameter's gradient, chunks of 1, 3 and S = 17 rows."""
    seq = 17
    indexer = _indexer()
    x, qr, query, key = _inputs(seq)
    allowed = _allowed(seq) if masked else None
    module = _module(indexer)
    old_kl, old_queries, old_grads = _kl_and_grads(indexer, _old_dense_kl, module, query, key,
                                                   x, qr, allowed)
    new_kl, new_queries, new_grads = _kl_and_grads(indexer, dense_indexer_kl, module, query, key,
                                                   x, qr, allowed, lambda per_row: rows)
    assert new_queries == old_queries == BATCH * seq
    # fp32 summation order only (chunked sums, shorter softmax rows): measured <= 2.8e-7
    # relative on the KL, <= 5.3e-7 of each gradient's largest entry; tolerances ~10x.
    assert torch.allclose(new_kl, old_kl, rtol=3e-6), (new_kl, old_kl)
    for new, old in zip(new_grads, old_grads):
        assert old.abs().max() > 0
        assert torch.allclose(new, old, rtol=5e-6, atol=5e-6 * old.abs().max())


def _fp64_reference(q_BSHD, k_BSD, w_BSH, query, key, allowed_BSS, index_scale):
    """The full-row math of ``DSAIndexer.scores`` and the old target, in fp64, through ``_kl``
    with autograd (``scores`` itself computes in fp32)."""
    seq = q_BSHD.shape[1]
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    allowed = allowed if allowed_BSS is None else allowed & allowed_BSS
    forbidden = ~allowed if allowed.dim() == 2 else ~allowed[:, None]
    logits = torch.einsum("sbnd,tbnd->bnst", query, key) * SOFTMAX_SCALE
    target = logits.masked_fill(forbidden, float("-inf")).softmax(-1).sum(1)
    relu = (torch.einsum("bthd,bsd->bths", q_BSHD, k_BSD) * index_scale).relu()
    index = torch.einsum("bth,bths->bts", w_BSH, relu).masked_fill(~allowed, float("-inf"))
    return _kl(target, index)


def _value_and_grads(fn, *tensors):
    """fn's value and its gradients with respect to copies of ``tensors``."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    value = fn(*leaves)
    value.backward()
    return value.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("rows", [1, 3, 13])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_dense_kl_equals_the_full_row_kl_in_fp64(rows, masked):
    """The autograd Function alone in fp64: value and gradients wrt q, k, w to 1e-12."""
    seq, hi, di, scale = 13, 3, 5, 5 ** -0.5
    gen = torch.Generator().manual_seed(3)
    q, k, w = (torch.randn(*shape, generator=gen, dtype=torch.float64)
               for shape in ((BATCH, seq, hi, di), (BATCH, seq, di), (BATCH, seq, hi)))
    _, _, query, key = _inputs(seq, torch.float64)
    allowed = _allowed(seq) if masked else None
    plan = _DenseKLPlan(SOFTMAX_SCALE, scale, None, rows, torch.arange(seq))
    results = []
    for fn in (lambda *t: _DenseKL.apply(*t, query, key, allowed, plan),
               lambda *t: _fp64_reference(*t, query, key, allowed, scale)):
        results.append(_value_and_grads(fn, q, k, w))
    (new_kl, new_grads), (old_kl, old_grads) = results
    assert torch.allclose(new_kl, old_kl, rtol=1e-12)
    for new, old in zip(new_grads, old_grads):
        assert torch.allclose(new, old, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rows", [1, 3, 13])
def test_packed_documents_score_each_chunk_from_its_earliest_document(rows, monkeypatch):
    """With document starts a chunk of query rows is scored from its rows' earliest document
    start, not from key 0: fewer pairs, and in fp64 the same KL and gradients (to 1e-12) as
    the full-row math under the same documents as a bool mask."""
    seq, hi, di, scale = 13, 3, 5, 5 ** -0.5
    gen = torch.Generator().manual_seed(5)
    q, k, w = (torch.randn(*shape, generator=gen, dtype=torch.float64)
               for shape in ((BATCH, seq, hi, di), (BATCH, seq, di), (BATCH, seq, hi)))
    _, _, query, key = _inputs(seq, torch.float64)
    starts = DocumentStarts(document_starts_from_boundaries([[4, 9], [2, 8]], seq))
    plan = _DenseKLPlan(SOFTMAX_SCALE, scale, None, rows, torch.arange(seq))
    scored = []  # (query rows, keys) of every chunk the forward and backward score
    logits = dsa_loss._index_logits

    def counted(q_BSHD, k_BSD, t0, t1, s0, s1, index_scale):
        scored.append((t1 - t0) * (s1 - s0))
        return logits(q_BSHD, k_BSD, t0, t1, s0, s1, index_scale)

    monkeypatch.setattr(dsa_loss, "_index_logits", counted)
    results = []
    for fn in (lambda *t: _DenseKL.apply(*t, query, key, starts, plan),
               lambda *t: _fp64_reference(*t, query, key, starts.block(0, seq, 0, seq),
                                          scale)):
        results.append(_value_and_grads(fn, q, k, w))
    (new_kl, new_grads), (old_kl, old_grads) = results
    assert torch.allclose(new_kl, old_kl, rtol=1e-12)
    for new, old in zip(new_grads, old_grads):
        assert old.abs().max() > 0
        assert torch.allclose(new, old, rtol=1e-10, atol=1e-12)
    from_key_0 = 2 * sum((min(seq, t0 + rows) - t0) * min(seq, t0 + rows)
                         for t0 in range(0, seq, rows))  # forward + backward
    if rows < seq:  # one chunk of every row starts at key 0 anyway
        assert sum(scored) < from_key_0
    assert sum(scored) <= from_key_0
    if rows == 1:  # each row from its own document's start (the earlier one of the batch)
        firsts = [0, 0, 0, 0, 2, 2, 2, 2, 4, 8, 8, 8, 8]
        assert sum(scored) == 2 * sum(t + 1 - first for t, first in enumerate(firsts))


def test_earliest_starts_are_per_block_minima_of_global_starts():
    """Global starts past the local row count (a CP shard) and a last block shorter than the
    others; no document starts: every block from key 0."""
    starts = torch.tensor([[12, 12, 12, 14, 14], [10, 13, 13, 13, 13]])
    assert earliest_starts(DocumentStarts(starts), 5, 2) == [10, 12, 13]
    assert earliest_starts(None, 5, 2) == [0, 0, 0]
    assert earliest_starts(torch.ones(2, 5, 5, dtype=torch.bool), 5, 2) == [0, 0, 0]


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_a_zigzag_shard_with_document_starts_equals_its_bool_mask(rows):
    """A CP rank's zigzag rows (global positions 0-3 and 12-15 of 16, documents' starts
    global): chunks scored from their earliest start give, in fp64, the KL and gradients of
    the same rows under the equivalent bool mask, which scans from key 0."""
    seq, hi, di, scale = 16, 3, 5, 5 ** -0.5
    positions = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])
    local = len(positions)
    full = document_starts_from_boundaries([[3, 10, 13], [6, 14]], seq)
    starts = DocumentStarts(full[:, positions])
    gen = torch.Generator().manual_seed(6)
    q, k, w = (torch.randn(*shape, generator=gen, dtype=torch.float64)
               for shape in ((BATCH, local, hi, di), (BATCH, seq, di), (BATCH, local, hi)))
    query = torch.randn(local, BATCH, HEADS, WIDTH, generator=gen, dtype=torch.float64)
    key = torch.randn(seq, BATCH, HEADS, WIDTH, generator=gen, dtype=torch.float64)
    plan = _DenseKLPlan(SOFTMAX_SCALE, scale, None, rows, positions)
    results = []
    for mask in (starts, starts.block(0, local, 0, seq)):
        results.append(_value_and_grads(
            lambda *t, mask=mask: _DenseKL.apply(*t, query, key, mask, plan), q, k, w))
    (doc_kl, doc_grads), (bool_kl, bool_grads) = results
    assert torch.allclose(doc_kl, bool_kl, rtol=1e-12)
    for doc, full_scan in zip(doc_grads, bool_grads):
        assert full_scan.abs().max() > 0
        assert torch.allclose(doc, full_scan, rtol=1e-10, atol=1e-12)


def test_dense_kl_backward_passes_gradcheck_and_skips_queries_without_keys():
    """The hand-written backward in fp64 (chunks of 3 over S = 8), with a mask under which
    query 5 may see no key: that query contributes nothing to the KL or to any gradient."""
    seq, hi, di = 8, 2, 3
    gen = torch.Generator().manual_seed(4)
    q, k, w = (torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
               for shape in ((BATCH, seq, hi, di), (BATCH, seq, di), (BATCH, seq, hi)))
    _, _, query, key = _inputs(seq, torch.float64)
    allowed = _allowed(seq)
    allowed[:, 5] = False
    plan = _DenseKLPlan(SOFTMAX_SCALE, 0.6, None, 3, torch.arange(seq))

    def kl(*t):
        return _DenseKL.apply(*t, query, key, allowed, plan)

    assert torch.autograd.gradcheck(kl, (q, k, w))
    kl(q, k, w).backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert q.grad[:, 5].abs().max() == 0 and w.grad[:, 5].abs().max() == 0
    # The same as letting query 5 see only itself: a one-key row's KL is exactly zero.
    itself = allowed.clone()
    itself[:, 5, 5] = True
    assert torch.equal(kl(q, k, w), _DenseKL.apply(q, k, w, query, key, itself, plan))


def _saved_elements(fn) -> list[int]:
    """Element counts of every tensor autograd saves while ``fn`` runs its forward."""
    sizes = []

    def pack(t: torch.Tensor):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_dense_kl_saves_nothing_seq_by_seq():
    """At S = 256 (B = 1): the chunked KL's forward saves no tensor of S x S / 4 elements or
    more (the largest are the inputs, S x 16); the full-row code saves several of S x S."""
    seq = 256
    indexer = _indexer()
    x, qr, query, key = _inputs(seq, batch=1, heads=2)
    module = _module(indexer)
    new = _saved_elements(lambda: dense_indexer_kl(module, query, key, x, qr, None,
                                                   lambda per_row: 32))
    old = _saved_elements(lambda: _old_dense_kl(module, query, key, x, qr, None))
    assert max(new) < seq * seq // 4, max(new)
    assert sum(s >= seq * seq for s in old) >= 2, sorted(old)[-4:]
    assert sum(new) * 10 < sum(old), (sum(new), sum(old))


def _tp_rank(rank: int, world_size: int, seq: int, rows: int, masked: bool):
    """One TP rank: its half of the main attention's heads; the indexer replicated."""
    indexer = _indexer()
    x, qr, query, key = _inputs(seq)
    share = HEADS // world_size
    heads = slice(rank * share, (rank + 1) * share)
    module = _module(indexer, tp_group=dist.group.WORLD)
    allowed = _allowed(seq) if masked else None
    kl, _, grads = _kl_and_grads(indexer, dense_indexer_kl, module, query[:, :, heads],
                                 key[:, :, heads], x, qr, allowed, lambda per_row: rows)
    return kl, grads


@pytest.mark.parametrize("masked", [False, True])
def test_tp2_dense_kl_matches_one_rank(masked):
    """Two gloo ranks, each with half the heads, chunks of 4 over S = 11: the target's head
    sum is all-reduced in forward and backward, so both ranks get one rank's KL and gradients."""
    seq, rows = 11, 4
    indexer = _indexer()
    x, qr, query, key = _inputs(seq)
    allowed = _allowed(seq) if masked else None
    kl, _, grads = _kl_and_grads(indexer, dense_indexer_kl, _module(indexer), query, key, x, qr,
                                 allowed, lambda per_row: rows)
    for rank_kl, rank_grads in run_ranks(2, _tp_rank, seq, rows, masked, mcore=False):
        assert torch.allclose(rank_kl, kl, rtol=1e-6)
        for got, want in zip(rank_grads, grads):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * want.abs().max())
