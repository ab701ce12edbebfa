"""The absorbed sparse MLA attention (glm5_train/model/sparse_mla.py) against a straightforward
reference: the non-absorbed MLA (keys and values up-projected per head from the same weights)
under a dense top-k mask, in fp64 — outputs, log-sum-exp-derived probabilities and gradients of
the queries, the latent, the RoPE key and the up-projection weight; invalid picks, chunk
boundaries, the bytes saved for backward; and the core attention's recompute option."""

from __future__ import annotations

import pytest
import torch

from glm5_train.model import sparse_mla
from glm5_train.model.dsa import DSACoreAttention
from glm5_train.model.sparse_mla import SparseLatentAttention, absorbed_sparse_attention
from parallel import mcore_compat
from tests.parity import Tolerances, assert_layout_ran, compare, run_job

F64 = torch.float64
S, B, N, DN, R, C, DV, K = 13, 2, 3, 5, 4, 6, 7, 4
SCALE = 0.3


def _picks(gen, seq: int, batch: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random picks per query among its first max(t + 1, k) keys; picks past the
    query are invalid (the first k - 1 queries have fewer than k causal keys), as top-k
    returns them."""
    idx = torch.stack([torch.stack([torch.randperm(max(t + 1, k), generator=gen)[:k]
                                    for t in range(seq)]) for _ in range(batch)])
    return idx, idx <= torch.arange(seq)[None, :, None]


def _inputs(seed: int = 0, dtype: torch.dtype = F64):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()

    leaves = dict(query=rand(S, B, N, DN + R), latent=rand(S, B, C), k_pe=rand(S, B, R),
                  weight=rand(N * (DN + DV), C))
    return leaves, *_picks(gen, S, B, K)


def _absorbed(leaves, idx, valid, rows):
    w = leaves["weight"].view(N, DN + DV, C)
    key = torch.cat([leaves["latent"], leaves["k_pe"]], dim=-1).unsqueeze(2)
    return absorbed_sparse_attention(leaves["query"], key, w[:, :DN], w[:, DN:], idx, valid,
                                     SCALE, need_probs=True, rows=rows)


def _reference(leaves, idx, valid):
    """Non-absorbed MLA from the same weights: per-head keys and values, dense logits,
    every unselected key masked."""
    query, latent, k_pe = leaves["query"], leaves["latent"], leaves["k_pe"]
    w = leaves["weight"].view(N, DN + DV, C)
    k_nope = torch.einsum("sbc,ndc->sbnd", latent, w[:, :DN])
    value = torch.einsum("sbc,ndc->sbnd", latent, w[:, DN:])
    key = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, N, -1)], dim=-1)
    logits = torch.einsum("tbnd,sbnd->bnts", query, key) * SCALE
    cols = torch.where(valid, idx, torch.full_like(idx, S))
    selected = torch.zeros(B, S, S + 1, dtype=torch.bool).scatter(-1, cols, True)[..., :S]
    probs = logits.masked_fill(~selected[:, None], float("-inf")).softmax(-1)
    out = torch.einsum("bnts,sbnd->tbnd", probs, value).reshape(S, B, N * DV)
    return out, probs.sum(1).gather(-1, idx).masked_fill(~valid, 0.0)


def _run(fn, leaves, grad_out):
    for t in leaves.values():
        t.grad = None
    out, probs = fn()
    (out * grad_out).sum().backward()
    return out.detach(), probs, {name: t.grad.clone() for name, t in leaves.items()}


@pytest.mark.parametrize("rows", [1, 4, 5, S, 64])  # chunks of 1, dividing S or not, > S
def test_absorbed_equals_non_absorbed_masked_reference_fp64(rows):
    leaves, idx, valid = _inputs()
    assert (~valid).any(), "the test must include invalid picks"
    grad_out = torch.randn(S, B, N * DV, generator=torch.Generator().manual_seed(9), dtype=F64)
    out, probs, grads = _run(lambda: _absorbed(leaves, idx, valid, rows), leaves, grad_out)
    ref_out, ref_probs, ref_grads = _run(lambda: _reference(leaves, idx, valid), leaves,
                                         grad_out)
    assert torch.allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    assert torch.allclose(probs, ref_probs, rtol=1e-12, atol=1e-12)
    assert torch.allclose(probs.sum(-1), torch.full((B, S), float(N), dtype=F64))
    assert probs[~valid].eq(0).all()
    for name, ref in ref_grads.items():
        assert ref.abs().max() > 0, name
        assert torch.allclose(grads[name], ref, rtol=1e-10, atol=1e-12), name


def test_latent_function_passes_gradcheck_with_repeated_picks():
    """The hand-written backward on its own, repeated picks of one key included (their
    gradients must add), contiguous [B, S, D] keys (the other layout of ``_KeyTable``)."""
    gen = torch.Generator().manual_seed(3)
    batch, seq, heads, width, k = 2, 7, 2, 5, 3
    idx = torch.randint(0, seq, (batch, seq, k), generator=gen)
    valid = torch.rand(batch, seq, k, generator=gen) > 0.2
    valid[..., 0] = True
    q = torch.randn(batch, seq, heads, width, generator=gen, dtype=F64, requires_grad=True)
    kv = torch.randn(batch, seq, width, generator=gen, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, kv: SparseLatentAttention.apply(q, kv, idx, valid, 0.7, 3, 3, False)[0],
        (q, kv))


class _SavedBytes:
    """Bytes and shapes autograd saves (unique storages), parameters excluded."""

    def __init__(self, exclude) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}
        self.shapes: list[tuple[int, ...]] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.exclude:
            self.storages.setdefault(ptr, t.untyped_storage().nbytes())
            self.shapes.append(tuple(t.shape))
        return t


def test_saved_for_backward_is_linear_in_the_picks_and_holds_no_s_by_s_or_s_k_n_tensor():
    """Long enough that [S, S] or [S, K, N] tensors would dominate: S = 256, K = 16, N = 4."""
    gen = torch.Generator().manual_seed(4)
    seq, batch, heads, k = 256, 1, 4, 16
    query = torch.randn(seq, batch, heads, DN + R, generator=gen, requires_grad=True)
    key = torch.randn(seq, batch, 1, C + R, generator=gen, requires_grad=True)
    weight = torch.randn(heads, DN + DV, C, generator=gen, requires_grad=True)
    idx, valid = _picks(gen, seq, batch, k)
    saved = _SavedBytes([weight])
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        out, _ = absorbed_sparse_attention(query, key, weight[:, :DN], weight[:, DN:], idx,
                                           valid, SCALE, need_probs=True, rows=7)
    out.sum().backward()
    assert weight.grad.abs().max() > 0
    for shape in saved.shapes:
        numel = torch.Size(shape).numel()
        assert numel < seq * seq // 2, shape
        assert numel < seq * k * heads, shape
    n = seq * batch
    # Query (the absorption's input: backward recomputes the absorbed query from it), latent
    # key, latent output, fp32 lse and the int32 picks; nothing else.
    expected = (4 * n * heads * (DN + R) + 4 * n * (C + R) + 4 * n * heads * C
                + 4 * n * heads + 4 * n * k)
    assert sum(saved.storages.values()) == expected, (sum(saved.storages.values()), expected)


# ------------------------------------------------------------------ core attention recompute


class _Cfg:
    """The TransformerConfig fields DSACoreAttention (and its indexer) read. fp32: the
    indexer computes its head weights in fp32."""
    params_dtype, hidden_size, q_lora_rank, qk_pos_emb_head_dim = torch.float32, 16, 8, R
    context_parallel_size, sequence_parallel = 1, False


def _core() -> DSACoreAttention:
    """A DSACoreAttention on one process, built without megatron's MegatronModule init
    (which needs parallel state): only what forward reads."""
    core = DSACoreAttention.__new__(DSACoreAttention)
    torch.nn.Module.__init__(core)
    from glm5_train.model.dsa import DSAIndexer, KLMeter
    from glm5_train.model.dsa_loss import DSATrainingConfig

    core.config = _Cfg()
    core.indexer = DSAIndexer(_Cfg(), n_heads=2, head_dim=8, topk=K, rope_dim=R,
                              rope_theta=1e4)
    core.training_cfg, core.kl_meter = DSATrainingConfig(indexer_loss_coeff=0.5), KLMeter()
    core.softmax_scale, core.tp_group, core.cp_group, core.recompute_core = SCALE, None, None, False
    return core


@pytest.mark.parametrize("absorbed", [True, False])
def test_recompute_core_gives_the_same_gradients_and_kl(absorbed):
    """recompute_core=True (megatron-core's tensor_parallel.checkpoint around selection,
    attention and KL) against False: bit-identical output, gradients (attention inputs, the
    up-projection weight, the indexer via the KL) and one KL record per forward."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    mcore_compat.install()  # megatron's checkpoint saves the (CUDA) RNG state: CPU redirects
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    leaves, _, _ = _inputs(seed=1, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    x, qr = torch.randn(S, B, 16, generator=gen), torch.randn(S, B, 8, generator=gen)
    core = _core()
    w = leaves["weight"].view(N, DN + DV, C)
    core.latent_up_weights = lambda: (w[:, :DN], w[:, DN:])

    def step(recompute: bool):
        core.recompute_core = recompute
        core.indexer.zero_grad()
        for t in leaves.values():
            t.grad = None
        w = leaves["weight"].view(N, DN + DV, C)
        core.latent_up_weights = lambda: (w[:, :DN], w[:, DN:])
        key = torch.cat([leaves["latent"], leaves["k_pe"]], dim=-1).unsqueeze(2)
        if absorbed:
            out = core(leaves["query"], key, None, None, x=x, qr=qr)
        else:  # the masked-dense path on up-projected keys and values
            k_nope = torch.einsum("sbc,ndc->sbnd", leaves["latent"], w[:, :DN])
            value = torch.einsum("sbc,ndc->sbnd", leaves["latent"], w[:, DN:])
            full_key = torch.cat([k_nope, leaves["k_pe"][:, :, None].expand(-1, -1, N, -1)], -1)
            out = core(leaves["query"], full_key, value, None, x=x, qr=qr)
        out.pow(2).sum().backward()
        kl = core.kl_meter.take()
        grads = {n: t.grad.clone() for n, t in leaves.items()}
        grads.update({n: p.grad.clone() for n, p in core.indexer.named_parameters()})
        return out.detach(), grads, kl

    core.train()
    plain, recomputed = step(False), step(True)
    assert torch.equal(plain[0], recomputed[0])
    assert plain[2] == recomputed[2] and plain[2][1] == B * S  # counted once, same value
    for name, grad in plain[1].items():
        assert grad.abs().max() > 0, name
        assert torch.equal(grad, recomputed[1][name]), name


def test_absorbed_core_attention_matches_masked_dense_core_attention():
    """The same DSACoreAttention forward and backward with the latent key (value None) and
    with up-projected keys and values: the two sparse paths agree to fp32 round-off (the
    same selection; the KL from either path's probabilities)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    leaves, _, _ = _inputs(seed=5, dtype=torch.float32)
    gen = torch.Generator().manual_seed(6)
    x, qr = torch.randn(S, B, 16, generator=gen), torch.randn(S, B, 8, generator=gen)
    core = _core().train()
    results = []
    for absorbed in (True, False):
        for t in [*leaves.values(), *core.indexer.parameters()]:
            t.grad = None
        w = leaves["weight"].view(N, DN + DV, C)
        core.latent_up_weights = lambda: (w[:, :DN], w[:, DN:])
        if absorbed:
            key = torch.cat([leaves["latent"], leaves["k_pe"]], dim=-1).unsqueeze(2)
            out = core(leaves["query"], key, None, None, x=x, qr=qr)
        else:
            k_nope = torch.einsum("sbc,ndc->sbnd", leaves["latent"], w[:, :DN])
            value = torch.einsum("sbc,ndc->sbnd", leaves["latent"], w[:, DN:])
            key = torch.cat([k_nope, leaves["k_pe"][:, :, None].expand(-1, -1, N, -1)], -1)
            out = core(leaves["query"], key, value, None, x=x, qr=qr)
        out.pow(2).sum().backward()
        grads = [t.grad.clone() for t in [*leaves.values(), *core.indexer.parameters()]]
        results.append((out.detach(), grads, core.kl_meter.take()))
    (out_a, grads_a, kl_a), (out_m, grads_m, kl_m) = results
    assert torch.allclose(out_a, out_m, rtol=1e-5, atol=1e-5)
    assert kl_a[0] == pytest.approx(kl_m[0], rel=1e-5)
    for a, m in zip(grads_a, grads_m):
        assert a.abs().max() > 0
        assert torch.allclose(a, m, rtol=1e-4, atol=1e-5 * m.abs().max())


def test_chunk_rows_follow_the_budget():
    assert sparse_mla.latent_chunk_rows(1, 2048, 576) == 3  # GLM-5: 16 MiB of fp32 keys
    assert sparse_mla.latent_chunk_rows(4, 1 << 30, 576) == 1


# ------------------------------------------------------------------------ job-level parity

# dsa.sparse_attention=absorbed against masked_dense: the same math (the same selection; the
# logits summed in another order: q_nope . W_UK c against the up-projected key), so fp32
# round-off only. Measured over the 5 steps (1 process / pp2_vpp2 with MTP split placement):
# losses 4.3e-8 / 4.9e-8, global grad norm 1.0e-6 / 9.5e-7, indexer KL 9.9e-6 / 1.8e-5,
# per-parameter grad norms 1.2e-5 / 1.2e-5 (floor 1e-4). Tolerances ~10x those maxima.
ABSORBED_VS_MASKED = Tolerances(loss=5e-7, grad_norm=1e-5, indexer_kl=2e-4, param=2e-4)


@pytest.mark.parametrize("nprocs,layout", [(1, "single"), (2, "pp2_vpp2")])
def test_job_absorbed_matches_masked_dense(tmp_path, nprocs, layout):
    overrides = [f"parallel={layout}"]
    masked = run_job(nprocs, [*overrides, "dsa.sparse_attention=masked_dense"],
                     str(tmp_path / "masked")).records
    absorbed = run_job(nprocs, [*overrides, "dsa.sparse_attention=absorbed"],
                       str(tmp_path / "absorbed"))
    assert_layout_ran(absorbed, nprocs, overrides)
    problems = compare(masked, absorbed.records, ABSORBED_VS_MASKED)
    assert not problems, "\n".join(problems)
    assert all(r["indexer_kl"] > 0 for r in absorbed.records)  # the sparse-stage KL ran


def test_bf16_activations_with_fp32_up_projection_weights_run_backward():
    """The absorbed op casts the up-projection weights to the activations' dtype in forward
    and backward alike (a bf16 query with fp32 weights)."""
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(S, B, N, DN + R, generator=gen).bfloat16().requires_grad_()
    key = torch.randn(S, B, 1, C + R, generator=gen).bfloat16().requires_grad_()
    weight = torch.randn(N, DN + DV, C, generator=gen, requires_grad=True)
    idx, valid = _picks(gen, S, B, K)
    out, _ = absorbed_sparse_attention(query, key, weight[:, :DN], weight[:, DN:], idx, valid,
                                       SCALE)
    out.float().square().sum().backward()
    assert query.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32
    assert weight.grad.abs().max() > 0


def test_triton_kernels_refused_under_deterministic_algorithms(monkeypatch):
    """dsa.sparse_kernel=triton where the kernels could run, but deterministic algorithms are
    requested: refused in one line naming the fix (their key gradients are atomic adds)."""
    from glm5_train.model import sparse_mla, triton_sparse_mla

    monkeypatch.setattr(triton_sparse_mla, "interpreted", lambda: True)
    q = torch.zeros(1, 2, 1, 4)
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError, match="use dsa.sparse_kernel=auto or torch"):
            sparse_mla.runs_kernel("triton", q, q[:, :, 0])
    finally:
        torch.use_deterministic_algorithms(False)
    assert sparse_mla.runs_kernel("triton", q, q[:, :, 0])
