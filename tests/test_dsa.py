"""DSA unit checks: selection semantics (full row and blockwise), the sparse attention's and the
sparse-stage KL's equivalence to references, and the selection's memory bound."""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from glm5_train.model import dsa
from glm5_train.model.dsa import DSAIndexer, causal_topk, sparse_attention
from glm5_train.model.dsa_loss import _kl, sparse_indexer_kl


class _Cfg:
    params_dtype, hidden_size, q_lora_rank = torch.float32, 32, 16


def _reference(query, key, value, topk, valid, scale):
    """Per-query loop: softmax over exactly the selected keys."""
    seq, batch, heads, _ = query.shape
    out = torch.zeros(seq, batch, heads, value.shape[-1])
    for b in range(batch):
        for t in range(seq):
            keys = topk[b, t][valid[b, t]]
            logits = torch.einsum("nd,knd->nk", query[t, b], key[keys, b]) * scale
            out[t, b] = torch.einsum("nk,knd->nd", logits.softmax(-1), value[keys, b])
    return out.reshape(seq, batch, -1)


def test_sparse_attention_equals_per_query_reference():
    gen = torch.Generator().manual_seed(0)
    seq, batch, heads = 12, 2, 3
    q, k = torch.randn(seq, batch, heads, 8, generator=gen), torch.randn(seq, batch, heads, 8,
                                                                           generator=gen)
    v = torch.randn(seq, batch, heads, 5, generator=gen)
    indexer = DSAIndexer(_Cfg(), n_heads=2, head_dim=8, topk=4, rope_dim=4, rope_theta=1e4)
    x, qr = torch.randn(batch, seq, 32, generator=gen), torch.randn(batch, seq, 16, generator=gen)
    with torch.no_grad():
        index = indexer.scores(x, qr)
        topk = indexer.select(index)
        valid = index.gather(-1, topk) > float("-inf")
    out, probs = sparse_attention(q, k, v, topk, valid, 0.3)
    assert torch.allclose(out, _reference(q, k, v, topk, valid, 0.3), atol=1e-5)
    # Each query's probabilities over its selected keys sum to the number of heads.
    assert torch.allclose(probs.sum(-1), torch.full((batch, seq), float(heads)), atol=1e-5)


def test_selection_is_causal_and_includes_early_tokens_fully():
    gen = torch.Generator().manual_seed(1)
    indexer = DSAIndexer(_Cfg(), n_heads=2, head_dim=8, topk=4, rope_dim=4, rope_theta=1e4)
    x, qr = torch.randn(1, 10, 32, generator=gen), torch.randn(1, 10, 16, generator=gen)
    with torch.no_grad():
        index = indexer.scores(x, qr)
        topk = indexer.select(index)
        valid = index.gather(-1, topk) > float("-inf")
    for t in range(10):
        chosen = set(topk[0, t][valid[0, t]].tolist())
        assert all(s <= t for s in chosen)
        assert len(chosen) == min(4, t + 1)  # min(k, t+1) keys, as torch.topk(min(k, t+1))


# ------------------------------------------------------------- blockwise top-k and sparse KL


def _masked_full_rows(scores_BSS: torch.Tensor, allowed_BSS: torch.Tensor | None):
    seq = scores_BSS.shape[-1]
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    allowed = allowed if allowed_BSS is None else allowed & allowed_BSS
    return scores_BSS.masked_fill(~allowed, float("-inf"))


def _rule_reference(full_BSS: torch.Tensor, k: int) -> torch.Tensor:
    """The selection rule written independently: a stable descending sort keeps equal scores
    in index order (smaller index first), -0.0 and +0.0 equal, -inf keys last."""
    return full_BSS.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def _tied_scores(gen, batch: int, seq: int) -> torch.Tensor:
    """Scores drawn from five values (-0.0 and +0.0 among them): nearly every pick is a tie."""
    levels = torch.tensor([-1.0, -0.0, 0.0, 0.5, 2.0])
    return levels[torch.randint(0, 5, (batch, seq, seq), generator=gen)]


def test_blockwise_topk_fast_path_and_tied_rows_agree_with_the_full_row():
    """Distinct scores (the float top-k path) with a few rows whose K-th and (K+1)-th largest
    in a block are equal (those rows are ranked exactly): the full-row rule either way."""
    gen = torch.Generator().manual_seed(11)
    batch, seq, k = 2, 64, 5
    scores = torch.rand(batch, seq, seq, generator=gen)
    scores[:, ::7, :] = torch.round(scores[:, ::7, :] * 4) / 4  # heavy ties in every 7th row
    full = _masked_full_rows(scores, None)
    indexer = DSAIndexer(_Cfg(), n_heads=2, head_dim=8, topk=k, rope_dim=4, rope_theta=1e4)

    def rows(t0: int, t1: int):
        return lambda s0, s1: scores[:, t0:t1, s0:s1].clone()

    for query_block, key_block in ((16, 16), (64, 9), (5, 64)):
        idx, picked = causal_topk(rows, batch, seq, k, None, query_block, key_block)
        assert torch.equal(idx, indexer.select(full))
        assert torch.equal(picked, full.topk(k, dim=-1).values)


@pytest.mark.parametrize("blocks", [(1, 1), (3, 5), (7, 4), (8, 8), (23, 23), (64, 2)])
@pytest.mark.parametrize("masked", [False, True])
def test_blockwise_topk_equals_full_row_selection_ties_included(blocks, masked):
    """causal_topk (block sizes dividing S or not, larger than S) against the full masked row:
    same indices in the same order (the rule: larger score, then smaller index), including the
    -inf fillers of queries with fewer than K allowed keys, and the same values torch.topk
    gives the full row."""
    gen = torch.Generator().manual_seed(7)
    batch, seq, k = 2, 23, 6
    scores = _tied_scores(gen, batch, seq)
    allowed = torch.rand(batch, seq, seq, generator=gen) > 0.6 if masked else None
    full = _masked_full_rows(scores, allowed)
    indexer = DSAIndexer(_Cfg(), n_heads=2, head_dim=8, topk=k, rope_dim=4, rope_theta=1e4)
    reference = indexer.select(full)
    query_block, key_block = blocks

    def rows(t0: int, t1: int):
        return lambda s0, s1: scores[:, t0:t1, s0:s1].clone()

    idx, picked = causal_topk(rows, batch, seq, k, allowed, query_block, key_block)
    assert torch.equal(reference, _rule_reference(full, k))
    assert torch.equal(idx, reference)
    assert torch.equal(picked, full.gather(-1, reference))
    assert torch.equal(picked, full.topk(k, dim=-1).values)  # what the old torch.topk picked
    short = (picked == float("-inf")).any(-1)  # rows with -inf fillers
    assert short[:, :k - 1].all()  # fewer than K causal keys
    assert short[:, k - 1:].any() == masked  # later rows short of keys only through the mask


def test_blockwise_selection_of_the_indexer_matches_select_of_full_scores():
    gen = torch.Generator().manual_seed(3)
    batch, seq = 2, 41
    indexer = DSAIndexer(_Cfg(), n_heads=3, head_dim=8, topk=9, rope_dim=4, rope_theta=1e4)
    x, qr = torch.randn(batch, seq, 32, generator=gen), torch.randn(batch, seq, 16, generator=gen)
    for allowed in (None, torch.rand(batch, seq, seq, generator=gen) > 0.3):
        with torch.no_grad():
            full = indexer.scores(x, qr, allowed)
            idx, picked = indexer.select_blockwise(x, qr, allowed, query_block=6, key_block=7)
        # The blocks' matmuls round differently from the full rows' (1 ulp): equal picks
        # here (no near-ties in random data), values to fp32 round-off, equal validity.
        assert torch.equal(idx, indexer.select(full))
        reference = full.gather(-1, idx)
        assert torch.equal(picked > float("-inf"), reference > float("-inf"))
        finite = reference > float("-inf")
        assert torch.allclose(picked[finite], reference[finite], rtol=1e-6, atol=1e-6)


def _kl_module(indexer):
    """What sparse_indexer_kl reads of DSACoreAttention: the indexer, its TP group, and the
    [S, B, *] -> [B, S, *] input transform (no sequence parallelism here)."""
    return types.SimpleNamespace(indexer=indexer, tp_group=None,
                                 _indexer_inputs=lambda x, qr: (x.transpose(0, 1),
                                                                qr.transpose(0, 1)))


def test_sparse_kl_at_selected_keys_equals_the_full_row_kl(monkeypatch):
    """New: the indexer scored at the K selected keys only (query chunks of 5, not dividing S).
    Old: full [B, S, S] scores gathered at the picks. Same KL and indexer gradients."""
    monkeypatch.setattr(dsa, "CHUNK_ELEMENTS", 2 * 6 * (3 + 8) * 5)
    gen = torch.Generator().manual_seed(5)
    batch, seq, k = 2, 29, 6
    indexer = DSAIndexer(_Cfg(), n_heads=3, head_dim=8, topk=k, rope_dim=4, rope_theta=1e4)
    x, qr = torch.randn(seq, batch, 32, generator=gen), torch.randn(seq, batch, 16, generator=gen)
    allowed = torch.rand(batch, seq, seq, generator=gen) > 0.4
    with torch.no_grad():
        idx, picked = indexer.select_blockwise(x.transpose(0, 1), qr.transpose(0, 1), allowed)
    valid = picked > float("-inf")
    probs = torch.rand(batch, seq, k, generator=gen)

    def kl_and_grads(new: bool):
        indexer.zero_grad()
        if new:
            kl, queries = sparse_indexer_kl(_kl_module(indexer), x, qr, idx, valid, probs)
        else:
            index = indexer.scores(x.transpose(0, 1), qr.transpose(0, 1), allowed)
            index = index.gather(-1, idx).masked_fill(~valid, float("-inf"))
            kl, queries = _kl(probs.masked_fill(~valid, 0.0), index), batch * seq
        kl.backward()
        return kl.detach(), queries, [p.grad.clone() for p in indexer.parameters()]

    old_kl, old_queries, old_grads = kl_and_grads(new=False)
    new_kl, new_queries, new_grads = kl_and_grads(new=True)
    assert new_queries == old_queries == batch * seq
    assert torch.allclose(new_kl, old_kl, rtol=1e-6)
    for new, old in zip(new_grads, old_grads):
        assert old.abs().max() > 0
        assert torch.allclose(new, old, rtol=1e-5, atol=1e-6 * old.abs().max())


def test_selected_scores_backward_passes_gradcheck():
    """The hand-written backward (recomputed gathers, scatter-added key gradients) in fp64,
    with repeated picks of the same key and chunks of 4 queries."""
    gen = torch.Generator().manual_seed(2)
    batch, seq, heads, width, k = 2, 9, 3, 5, 4
    idx = torch.randint(0, seq, (batch, seq, k), generator=gen)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    inputs = (rand(batch, seq, heads, width), rand(batch, seq, width), rand(batch, seq, heads))
    assert torch.autograd.gradcheck(
        lambda q, key, w: dsa._SelectedScores.apply(q, key, w, idx, 0.4, 4), inputs)


def test_fused_selected_kl_equals_the_kl_of_the_selected_scores_and_passes_gradcheck():
    """``_SelectedKL`` (scores and KL in one op, keeping q, k, w, the int32 picks, the target
    and a log-sum-exp per query) against the unfused KL over ``_SelectedScores`` (invalid
    picks -inf, target 0 there): the same sum and gradients; and its hand-written backward in
    fp64 under gradcheck, with -1 picks, repeated picks and chunks of 4 queries."""
    from glm5_train.model.dsa_loss import _kl

    gen = torch.Generator().manual_seed(3)
    batch, seq, heads, width, k = 2, 9, 3, 5, 4
    idx = torch.randint(0, seq, (batch, seq, k), generator=gen)
    valid = torch.rand(batch, seq, k, generator=gen) > 0.25
    valid[:, :, 0] = True  # every query keeps a pick (its own key, in the model)
    picks = torch.where(valid, idx, -1).to(torch.int32)
    target = torch.rand(batch, seq, k, generator=gen, dtype=torch.float64)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    inputs = (rand(batch, seq, heads, width), rand(batch, seq, width), rand(batch, seq, heads))
    fused = dsa._SelectedKL.apply(*inputs, picks, target, 0.4, 4)
    scores = dsa._SelectedScores.apply(*inputs, idx, 0.4, 4).masked_fill(~valid, float("-inf"))
    unfused = _kl(target.masked_fill(~valid, 0.0), scores)
    assert torch.allclose(fused, unfused, rtol=1e-12)
    for got, ref in zip(torch.autograd.grad(fused, inputs), torch.autograd.grad(unfused, inputs)):
        assert torch.allclose(got, ref, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda q, key, w: dsa._SelectedKL.apply(q, key, w, picks, target, 0.4, 4), inputs)


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any aten op returns (backward included: CPU autograd runs
    on the calling thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_selection_and_sparse_kl_create_no_seq_by_seq_tensor(monkeypatch):
    """At S = 512 (B = 1) no tensor of the blockwise selection or of the sparse KL's forward
    and backward reaches S x S / 2 elements, while the full-row path makes S x S ones."""
    monkeypatch.setattr(dsa, "CHUNK_ELEMENTS", 4096)  # query blocks of 32
    monkeypatch.setattr(dsa, "SELECTED_CHUNK_ELEMENTS", 4096)  # KL chunks of 32 queries
    monkeypatch.setattr(dsa, "INDEXER_KEY_BLOCK", 64)
    gen = torch.Generator().manual_seed(4)
    batch, seq, k = 1, 512, 16
    indexer = DSAIndexer(_Cfg(), n_heads=2, head_dim=8, topk=k, rope_dim=4, rope_theta=1e4)
    x, qr = torch.randn(seq, batch, 32, generator=gen), torch.randn(seq, batch, 16, generator=gen)
    probs = torch.rand(batch, seq, k, generator=gen)
    with _LargestOutput() as blockwise:
        with torch.no_grad():
            idx, picked = indexer.select_blockwise(x.transpose(0, 1), qr.transpose(0, 1))
        valid = picked > float("-inf")
        kl, _ = sparse_indexer_kl(_kl_module(indexer), x, qr, idx, valid, probs)
        kl.backward()
    assert indexer.wk.weight.grad.abs().max() > 0  # the backward ran under the recorder
    assert blockwise.largest < seq * seq // 2, blockwise.largest
    with _LargestOutput() as full_row, torch.no_grad():
        indexer.select(indexer.scores(x.transpose(0, 1), qr.transpose(0, 1)))
    assert full_row.largest >= seq * seq
