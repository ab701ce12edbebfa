"""DSA unit checks: selection semantics and the sparse attention's equivalence to a reference."""

from __future__ import annotations

import torch

from glm5_train.model.dsa import DSAIndexer, sparse_attention


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
