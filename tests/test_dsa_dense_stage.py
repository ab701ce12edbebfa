"""dsa.stage=dense (GLM-5's pre- and mid-training, before DSA is introduced): the core
attention is dense causal MLA over every key, equal to a plain softmax reference and to the
sparse stage when the top-k covers the sequence; the indexer is never run and gets no
gradient; a DSA setting that asks to train it is refused; the planner plans the stage as the
sparse stage's dense fallback (no indexer, no KL). Parity under context parallelism (the head-
parallel hook): tests/test_head_parallel_cp.py's ``cp2_dense``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from glm5_train.job_config import compose_job
from glm5_train.model.dsa_loss import DSATrainingConfig
from glm5_train.model.glm5 import apply_dsa_freezing
from glm5_train.plan import activations
from glm5_train.plan.inputs import dsa_sparse, inputs_from_job
from glm5_train.plan.stage_model import layer_part
from tests.parity import assert_layout_ran, compare, one_process
from tests.test_sparse_mla import DN, DV, SCALE, B, C, N, S, _core, _inputs

DENSE = DSATrainingConfig(stage="dense", indexer_loss_coeff=0.0, freeze_indexer=True)
DENSE_JOB = ["checkpoint.load=null", "dsa=dense"]  # tests/test_head_parallel_cp.py's DENSE


def _up_projected(leaves: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys [S, B, N, DN + R] and values [S, B, N, DV] from the latent (what
    megatron-core's MLA hands the dense path)."""
    w = leaves["weight"].view(N, DN + DV, C)
    k_nope = torch.einsum("sbc,ndc->sbnd", leaves["latent"], w[:, :DN])
    value = torch.einsum("sbc,ndc->sbnd", leaves["latent"], w[:, DN:])
    key = torch.cat([k_nope, leaves["k_pe"][:, :, None].expand(-1, -1, N, -1)], dim=-1)
    return key, value


def _causal_reference(query, key, value) -> torch.Tensor:
    """softmax(scale q k^T, causal) v, written out: [S, B, N x DV]."""
    logits_BNTS = torch.einsum("tbnd,sbnd->bnts", query, key) * SCALE
    future = torch.ones(S, S, dtype=torch.bool).triu(1)
    probs_BNTS = logits_BNTS.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("bnts,sbnv->tbnv", probs_BNTS, value).reshape(S, B, N * DV)


def _forward_backward(core, leaves: dict, x, qr, reference: bool = False):
    """Output and the gradients of every input leaf after out.pow(2).sum().backward()."""
    for t in leaves.values():
        t.grad = None
    key, value = _up_projected(leaves)
    if reference:
        out = _causal_reference(leaves["query"], key, value)
    else:
        out = core(leaves["query"], key, value, None, x=x, qr=qr)
    out.pow(2).sum().backward()
    return out.detach(), {n: t.grad.clone() for n, t in leaves.items()}


def _indexer_calls(core) -> list[str]:
    """Records every forward of the indexer's linears and norm (the indexer has no forward of
    its own: its projections are these modules' calls)."""
    calls: list[str] = []
    for name, module in core.indexer.named_modules():
        if name:
            module.register_forward_hook(lambda m, i, o, name=name: calls.append(name))
    return calls


def test_dense_stage_is_causal_attention_without_the_indexer():
    leaves, _, _ = _inputs(seed=5, dtype=torch.float32)
    gen = torch.Generator().manual_seed(6)
    x, qr = torch.randn(S, B, 16, generator=gen), torch.randn(S, B, 8, generator=gen)
    core = _core().train()
    core.training_cfg = DENSE
    apply_dsa_freezing([torch.nn.ModuleDict({"core": core})], DENSE)  # as the job does
    calls = _indexer_calls(core)
    out, grads = _forward_backward(core, leaves, x, qr)
    assert calls == [] and core.kl_meter.take() == (0.0, 0)
    assert all(not p.requires_grad and p.grad is None for p in core.indexer.parameters())
    want, want_grads = _forward_backward(None, leaves, x, qr, reference=True)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    for name, grad in want_grads.items():
        assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-5), name
    # The sparse stage with top-k covering the sequence attends exactly so (same kernel).
    core.training_cfg, core.indexer.topk = DSATrainingConfig(indexer_loss_coeff=0.0), S
    assert torch.equal(_forward_backward(core, leaves, x, qr)[0], out) and calls == []
    # With top-k < S the sparse stage runs the indexer (the hooks see it) and attends to less.
    core.indexer.topk = 4
    sparse_out = core(leaves["query"], *_up_projected(leaves), None, x=x, qr=qr)
    assert calls and not torch.allclose(sparse_out, out, rtol=1e-3)


@pytest.mark.parametrize("freeze,coeff", [(False, 0.0), (True, 0.001), (False, 0.001)])
def test_dense_stage_refuses_to_train_an_indexer_it_never_runs(freeze, coeff):
    cfg = DSATrainingConfig(stage="dense", indexer_loss_coeff=coeff, freeze_indexer=freeze)
    with pytest.raises(ValueError, match=r"dsa.stage=dense runs no indexer.*use dsa=dense"):
        cfg.validate()


def test_planner_plans_the_dense_stage_as_dense_attention_without_indexer():
    """GLM-5 744B at 32K tokens (index_topk 2048 < S): the dense stage plans a layer exactly
    as the sparse stage's dense fallback (top-k covering the sequence), and against the
    sparse stage it trades the absorbed sparse core and the indexer KL's saved tensors for
    dense flash attention's q, k, v, output and log-sum-exp."""
    base = ["model=glm5_744b", "train.seq_length=32768", "train.global_batch_size=8"]
    dense_job = compose_job([*base, "dsa=dense"])
    dense = inputs_from_job(dense_job, fused_attention=True)
    sparse = dataclasses.replace(dense, dsa_stage="sparse", dsa_kl=True)
    cfg = dense_job.model
    covering = dataclasses.replace(cfg, index_topk=dense.seq_length)
    assert not dsa_sparse(cfg, dense) and dsa_sparse(cfg, sparse)
    for moe in (False, True):
        assert layer_part(cfg, moe, dense) == layer_part(covering, moe,
                                                         dataclasses.replace(dense,
                                                                             dsa_stage="sparse"))
    heads = cfg.num_attention_heads // dense.tp
    attention = {name: activations.attention_activation_bytes(cfg, inp)
                 for name, inp in (("dense", dense), ("sparse", sparse))}
    traded = (activations._dense_attention_bytes(cfg, dense, heads)
              - activations._absorbed_attention_bytes(cfg, sparse, heads)
              - activations._indexer_kl_bytes(cfg, sparse))
    assert attention["dense"] - attention["sparse"] == traded
    # No S x S term: dense flash attention's bytes grow linearly with the sequence.
    doubled = dataclasses.replace(dense, seq_length=2 * dense.seq_length)
    assert (activations._dense_attention_bytes(cfg, doubled, heads)
            == 2 * activations._dense_attention_bytes(cfg, dense, heads))


def test_dense_job_trains_everything_but_the_indexer_as_the_covering_top_k_does():
    """The real job, one process, 5 steps (the parity reference of ``cp2_dense``): the indexer
    (decoder and MTP layers) has no gradient and every other parameter has one; the
    indexer is still in the model (parameter bytes = the plan, which counts it; saved
    activations within the harness's tolerance of the plan); and step 1 equals the sparse
    stage with a fixed indexer and index_topk = seq_length (sparse attention then is dense)."""
    dense = one_process(["parallel=single", *DENSE_JOB])
    assert_layout_ran(dense, 1, ["parallel=single", *DENSE_JOB])
    covering = one_process(["parallel=single", "checkpoint.load=null", "dsa=frozen_indexer",
                            "model.index_topk=64", "train.train_iters=1"]).records[0]
    first = dense.records[0]
    assert "indexer_kl" not in first
    trained = set(first["param_grad_norms"])
    assert not {name for name in trained if ".indexer." in name}
    assert trained == set(covering["param_grad_norms"])
    assert any(name.startswith("mtp.") for name in trained)
    assert not compare([covering], [first])
