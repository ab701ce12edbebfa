"""Packed documents: per-token document starts (glm5_train/model/key_masks.py) instead of a
[B, 1, S, S] mask, in the DSA indexer's selection, the sparse and dense attention, both KL
stages and MTP; equal to megatron's document-causal bool mask wherever both exist, and the
same under context and pipeline parallelism as in one process. Packed pretraining samples
(data.reset_attention_mask) carry their documents' boundaries, never an [S, S] mask: the same
starts as megatron's mask on the same samples, and no tensor of S x S elements anywhere in a
16K-token step."""

from __future__ import annotations

import json

import pytest
import torch

from glm5_train.model.dsa import DSAIndexer, causal_topk
from glm5_train.model.key_masks import (
    DocumentStarts,
    document_starts_from_boundaries,
    document_starts_from_eod,
)
from glm5_train.model.mtp import shifted_targets
from glm5_train.step import packed_documents
from tests.parity import FP32, assert_layout_ran, compare, run_job, run_script
from tests.test_sparse_mla import B, C, DN, DV, N, S, _core, _inputs

ENDS = [[3, 9], [5]]  # document ends (exclusive) per sample of S = 13 tokens


def _bool_mask(starts_BS: torch.Tensor) -> torch.Tensor:
    """megatron's document-causal attention mask [B, 1, S, S], True = masked out."""
    keys = torch.arange(starts_BS.shape[1])
    allowed = (keys[None, None, :] >= starts_BS[..., None]) & (keys[None, :] <= keys[:, None])
    return ~allowed[:, None]


def test_document_starts_from_boundaries_eod_cu_seqlens_and_bool_masks_agree():
    starts = document_starts_from_boundaries(ENDS, S)
    assert starts[0].tolist() == [0] * 3 + [3] * 6 + [9] * 4
    assert starts[1].tolist() == [0] * 5 + [5] * 8
    eod = 7
    tokens = torch.ones(B, S, dtype=torch.long)
    for b, ends in enumerate(ENDS):
        for end in ends:
            tokens[b, end - 1] = eod  # each document ends with its end-of-document token
    assert torch.equal(document_starts_from_eod(tokens, eod), starts)
    flat_bounds = torch.tensor([0, 3, 9, 13, 13 + 5, 26], dtype=torch.int32)
    for batch in ({"tokens": tokens, "cu_seqlens": flat_bounds, "max_seqlen": 6},
                  {"tokens": tokens, "attention_mask": _bool_mask(starts)}):
        out = packed_documents(dict(batch))
        assert torch.equal(out["attention_mask"], starts) and "cu_seqlens" not in out
    with pytest.raises(ValueError, match="not document-causal"):
        packed_documents({"tokens": tokens, "attention_mask": torch.zeros(B, 1, S, S,
                                                                          dtype=torch.bool)})


def test_a_bool_mask_is_read_a_block_of_rows_at_a_time(monkeypatch):
    """A batch bringing megatron's mask: its starts read 2 rows at a time (no second [S, S]
    tensor) equal the whole mask's; a row breaking document causality in a later block is
    still refused."""
    from glm5_train import step

    starts = document_starts_from_boundaries(ENDS, S)
    monkeypatch.setattr(step, "_MASK_CHECK_ELEMENTS", 2 * B * S)
    assert torch.equal(step.starts_from_document_mask(_bool_mask(starts)), starts)
    broken = _bool_mask(starts)
    broken[1, 0, S - 1, 2] = False  # the last row sees a key of the previous document
    with pytest.raises(ValueError, match="not document-causal"):
        step.starts_from_document_mask(broken)


def test_blockwise_topk_with_document_starts_equals_the_bool_mask_path():
    """Ties and fillers included: the same indices and scores as the [B, S, S] mask."""
    starts = document_starts_from_boundaries(ENDS, S)
    allowed = ~_bool_mask(starts)[:, 0]
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (B, S, S), generator=gen).float()  # many ties

    def rows(t0, t1):
        return lambda s0, s1: scores[:, t0:t1, s0:s1].clone()

    for k, qb, kb in ((4, 5, 3), (6, 13, 13), (2, 1, 4)):
        want = causal_topk(rows, B, S, k, allowed, qb, kb)
        got = causal_topk(rows, B, S, k, DocumentStarts(starts), qb, kb)
        assert all(torch.equal(w, g) for w, g in zip(want, got))


def test_the_indexer_scans_each_query_block_from_its_earliest_document():
    """With document starts a query block scores keys from its rows' earliest document start
    (rounded down to ``KEY_ALIGN``), not from key 0: on 1,024 tokens of 150-token documents
    in query blocks of 64 rows, far fewer scored pairs, and the same keys (and here the same
    score bits) as the scan from key 0 (a real indexer's projections, fillers included:
    top-k 32 exceeds some rows' documents)."""
    from glm5_train.model import dsa

    class Cfg:
        params_dtype, hidden_size, q_lora_rank = torch.float32, 64, 32

    gen = torch.Generator().manual_seed(0)
    indexer = DSAIndexer(Cfg(), 4, 16, 32, 8, 1e4)
    seq = 1024
    x, qr = torch.randn(1, seq, 64, generator=gen), torch.randn(1, seq, 32, generator=gen)
    starts = DocumentStarts((torch.arange(seq) // 150 * 150)[None])

    def scan(monkeypatch_zero: bool):
        scored = [0]
        rows_of = indexer._block_scores

        def counting(q_rows, k_BSD, w_BSH):
            rows = rows_of(q_rows, k_BSD, w_BSH)

            def block(t0, t1):
                against = rows(t0, t1)

                def scores(s0, s1):
                    scored[0] += (t1 - t0) * (s1 - s0)
                    return against(s0, s1)
                return scores
            return block

        indexer._block_scores, earliest = counting, dsa.earliest_starts
        if monkeypatch_zero:
            dsa.earliest_starts = lambda allowed, rows, block: [0] * len(range(0, rows, block))
        try:
            with torch.no_grad():
                return indexer.select_blockwise(x, qr, starts, query_block=64), scored[0]
        finally:
            indexer._block_scores, dsa.earliest_starts = rows_of, earliest

    (index, score), pairs = scan(False)
    (index0, score0), pairs0 = scan(True)
    assert torch.equal(index, index0) and torch.equal(score, score0)
    assert (score == float("-inf")).any()  # rows with fewer than 32 keys in their document
    assert pairs < 0.45 * pairs0, (pairs, pairs0)


@pytest.mark.parametrize("align", [1, 4, 128])
def test_scans_from_each_blocks_earliest_document_equal_the_full_row(monkeypatch, align):
    """Exact synthetic scores with many ties, 2 samples with different documents, top-k
    larger than some blocks' first scanned key and than the first rows' keys, several key
    blocks, whole sequences and a zigzag context-parallel share: the document-starts scan
    (from each query block's earliest start, ``KEY_ALIGN`` = ``align``) selects the same
    indices and scores as the bool mask's scan from key 0."""
    from glm5_train.model import dsa

    monkeypatch.setattr(dsa, "KEY_ALIGN", align)
    seq = 40
    starts = document_starts_from_boundaries([[7, 19, 23, 33], [12, 30]], seq)
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 3, (2, seq, seq), generator=gen).float()
    zigzag = torch.cat([torch.arange(0, 10), torch.arange(30, 40)])  # rank 0 of CP2
    for positions in (None, zigzag):
        rows_at = torch.arange(seq) if positions is None else positions
        local = starts[:, rows_at]
        allowed = ~_bool_mask(starts)[:, 0][:, rows_at]

        def rows(t0, t1):
            return lambda s0, s1: scores[:, rows_at[t0:t1]][:, :, s0:s1].clone()

        for k, qb, kb in ((4, 5, 3), (9, 8, 7), (16, 6, 16), (2, 40, 40)):
            want = causal_topk(rows, 2, seq, k, allowed, qb, kb, positions_T=positions)
            got = causal_topk(rows, 2, seq, k, DocumentStarts(local), qb, kb,
                              positions_T=positions)
            assert all(torch.equal(w, g) for w, g in zip(want, got)), (align, k, qb, kb)


@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_core_attention_with_document_starts_equals_the_bool_mask(stage):
    """DSACoreAttention forward + backward (output, query/latent/weight gradients, the indexer
    via its KL) with document starts and with megatron's bool mask: equal to fp32
    round-off; and different from no mask (the documents really were separated)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    leaves, _, _ = _inputs(seed=3, dtype=torch.float32)
    gen = torch.Generator().manual_seed(4)
    x, qr = torch.randn(S, B, 16, generator=gen), torch.randn(S, B, 8, generator=gen)
    core = _core().train()
    core.training_cfg.stage, core.kl_backward_in_forward = stage, False
    starts = document_starts_from_boundaries(ENDS, S)
    results = []
    for mask in (starts, _bool_mask(starts), None):
        for t in [*leaves.values(), *core.indexer.parameters()]:
            t.grad = None
        w = leaves["weight"].view(N, DN + DV, C)
        core.latent_up_weights = lambda: (w[:, :DN], w[:, DN:])
        key = torch.cat([leaves["latent"], leaves["k_pe"]], dim=-1).unsqueeze(2)
        if stage == "dense_warmup":  # the dense path gets up-projected keys and values
            k_nope = torch.einsum("sbc,ndc->sbnd", leaves["latent"], w[:, :DN])
            value = torch.einsum("sbc,ndc->sbnd", leaves["latent"], w[:, DN:])
            key = torch.cat([k_nope, leaves["k_pe"][:, :, None].expand(-1, -1, N, -1)], -1)
            out = core(leaves["query"], key, value, mask, x=x, qr=qr)
        else:
            out = core(leaves["query"], key, None, mask, x=x, qr=qr)
        out.pow(2).sum().backward()
        grads = {n: t.grad.clone() for n, t in leaves.items() if t.grad is not None}
        grads.update({n: p.grad.clone() for n, p in core.indexer.named_parameters()})
        results.append((out.detach(), grads, core.kl_meter.take()))
    (doc_out, doc_grads, doc_kl), (bool_out, bool_grads, bool_kl), (free_out, _, _) = results
    assert torch.allclose(doc_out, bool_out, rtol=1e-5, atol=1e-6)
    assert abs(doc_kl[0] - bool_kl[0]) <= 1e-5 * abs(bool_kl[0]) + 1e-9
    for name, grad in bool_grads.items():  # atol: fp32 round-off of the largest gradient
        # (the dense path runs document by document there: other summation order)
        atol = 1e-6 * float(grad.abs().max())
        assert torch.allclose(doc_grads[name], grad, rtol=1e-4, atol=atol), name
    assert not torch.allclose(doc_out, free_out, rtol=1e-3)


def test_mtp_targets_never_cross_a_document():
    starts = document_starts_from_boundaries(ENDS, S)
    labels = torch.arange(B * S).view(B, S)
    _, mask = shifted_targets(labels, None, labels, 2, None, starts)
    assert mask[0].tolist() == [1, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0]
    assert mask[1].tolist() == [1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> str:
    """``_short_documents_corpus``, made once for this module's tests."""
    return _short_documents_corpus(tmp_path_factory.mktemp("short_documents"))


def _short_documents_corpus(tmp_path) -> str:
    """A jsonl corpus of short documents (6-40 bytes), so that 64-token sequences pack
    several documents, tokenized with the byte tokenizer (as tools/preprocess_data.py does)."""
    from glm5_train.data import build_indexed_dataset
    from glm5_train.tokenizer import ByteTokenizer

    gen = torch.Generator().manual_seed(7)
    words = ["alpha", "beta", "gamma", "delta", "sparse", "latent", "index", "mtp"]
    docs = [" ".join(words[i] for i in torch.randint(0, len(words), (int(n),), generator=gen))
            for n in torch.randint(1, 7, (400,), generator=gen)]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prefix = str(tmp_path / "short_docs")
    build_indexed_dataset([str(source)], prefix, ByteTokenizer())
    return prefix


@pytest.mark.parametrize("reset_position_ids, eod_mask_loss", [(False, False), (True, True)])
def test_packed_gpt_samples_carry_the_boundaries_of_megatrons_mask(tmp_path, short_documents,
                                                                 reset_position_ids,
                                                                 eod_mask_loss):
    """The same samples read the new way (data.PackedGPTDataset: no mask, the documents'
    boundaries) and the old way (megatron's GPTDataset asked for its document-causal mask):
    the same tokens, labels, loss mask and position ids, and, batched, the same per-token
    document starts from the boundaries as from the mask."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from glm5_train import data as D
    from glm5_train.tokenizer import ByteTokenizer
    from parallel import mcore_compat

    seq, samples, tok = 64, 24, ByteTokenizer()
    cfg = D.DataConfig(paths=[short_documents], split="100,0,0",
                       cache_dir=str(tmp_path / "cache"), reset_attention_mask=True,
                       reset_position_ids=reset_position_ids, eod_mask_loss=eod_mask_loss)
    new = D.build_train_valid_test_datasets(cfg, tok, seq, 5, (samples, 0, 0))[0]
    old_cfg = D._gpt_dataset_config(cfg, tok, cfg.paths, seq, 5)
    old_cfg.create_attention_mask = True  # the dataset as the job asked for it before
    with mcore_compat.single_process_rank_zero():
        old = BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True,
                                            old_cfg).build()[0]
    assert isinstance(new, D.PackedGPTDataset) and len(new) == len(old)
    documents = 0
    for first in range(0, samples, 4):
        new_batch = D.collate_samples([new[i] for i in range(first, first + 4)])
        old_batch = D.collate_samples([old[i] for i in range(first, first + 4)])
        assert "attention_mask" not in new_batch
        assert old_batch["attention_mask"].shape == (4, 1, seq, seq)
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(new_batch[key], old_batch[key]), key
        starts = packed_documents(new_batch)["attention_mask"]
        assert torch.equal(starts, packed_documents(old_batch)["attention_mask"])
        documents += int((starts == torch.arange(seq)).sum())
    assert documents > 2 * samples  # several documents per sample: the test saw packing


def test_no_tensor_of_s_by_s_elements_in_a_packed_step_at_16k_tokens(tmp_path):
    """One forward + backward of the tiny model over 16,384 tokens of packed documents, on the
    job's own path (bench/packed_documents_memory.py: config, assemble, the data iterator over
    megatron's GPTDataset, step.run_step): no operation makes a tensor of S x S elements or
    more (a TorchDispatchMode sees every output, the backward's included) and none is saved
    for backward (the saved-tensor hooks). The probe is shown to see one: the batch with
    megatron's [1, S, S] mask at 4,096 tokens is caught."""
    out = tmp_path / "figures.json"
    seq, control = 16384, 4096
    result = run_script(1, "bench/packed_documents_memory.py",
                        ["--seq", str(seq), "--mask-seq", str(control), "--json", str(out)])
    assert result.returncode == 0, result.stdout[-4000:]
    ours, masked = json.loads(out.read_text())
    assert ours["route"] == "boundaries" and ours["seq"] == seq
    assert ours["documents"] > 1 and ours["loss"] > 0
    assert ours["at_least_SS"] == [] and ours["largest"] < seq * seq, ours["largest_op"]
    assert ours["largest_saved"] < seq * seq
    assert masked["route"] == "megatron_mask" and masked["at_least_SS"], masked


def test_packed_documents_under_context_and_pipeline_parallelism_match_one_process(
        tmp_path, short_documents):
    """Sequences of several documents (data.reset_attention_mask: the samples' boundaries
    turned into document starts), 5 steps: CP2 (both exchanges: the head-parallel one gathers
    every row's document starts) and PP2 equal one process; and the documents changed the run
    (losses differ from the same data without document masks)."""
    data = ["checkpoint.load=null", f"data.paths=[{short_documents}]",
            "data.reset_attention_mask=true"]
    reference = run_job(1, ["parallel=single", *data], str(tmp_path / "one")).records
    cp2 = ["parallel=single", "parallel.context_parallel_size=2"]
    for name, layout in (("cp2", cp2), ("cp2_head_parallel", [*cp2, "parallel.cp_comm=head_parallel"]),
                         ("pp2", ["parallel=pp2"])):
        overrides = [*layout, *data]
        result = run_job(2, overrides, str(tmp_path / name))
        problems = compare(reference, result.records, FP32)
        assert not problems, name + ":\n" + "\n".join(problems)
        assert_layout_ran(result, 2, overrides)
    unmasked = run_job(1, ["parallel=single", *data[:-1]], str(tmp_path / "free")).records
    assert all(abs(a["loss"] - b["loss"]) > 1e-4 for a, b in zip(reference[1:], unmasked[1:]))


def test_dense_attention_runs_document_by_document_without_a_t_by_s_mask():
    """The dense path (warm-up, top-k >= S) on packed documents of whole sequences: one causal
    call per document gives the outputs and gradients of the [B, T, S] mask path, and no
    tensor of T x S elements (or more) is created, forward or backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from glm5_train.model.key_masks import DocumentStarts, document_starts_from_boundaries
    from parallel.context_parallel import context_shard

    seq, batch, heads, dqk, dv = 256, 2, 2, 12, 8
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(seq, batch, heads, d, generator=gen, requires_grad=True)
               for d in (dqk, dqk, dv))
    starts = DocumentStarts(document_starts_from_boundaries([[40, 41, 200], [256]], seq))
    core, shard = _core(), context_shard(None, seq, q.device)

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    with Largest():
        out = core._dense(q, k, v, starts, shard)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert Largest.numel < seq * seq, Largest.numel
    masked = core._dense(q, k, v, starts.block(0, seq, 0, seq), shard)  # the [B, T, S] path
    ref_grads = torch.autograd.grad(masked.square().sum(), (q, k, v))
    # fp32 summation order only (a one-token document's query gradient is 0 one way, ~1e-6
    # the other)
    torch.testing.assert_close(out, masked, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_document_bounds_read_contiguous_documents_and_refuse_malformed_starts():
    from glm5_train.model.key_masks import document_bounds, document_starts_from_boundaries

    starts = document_starts_from_boundaries([[3, 5], [6]], 8)
    assert document_bounds(starts) == [[(0, 3), (3, 5), (5, 8)], [(0, 6), (6, 8)]]
    for bad in ([[1, 1, 2]], [[0, 0, 5]], [[0, 2, 2]], [[0, -1, 0]]):
        with pytest.raises(ValueError, match="document starts must give every token"):
            document_bounds(torch.tensor(bad))
