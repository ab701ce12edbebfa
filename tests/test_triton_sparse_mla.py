"""The Triton sparse-MLA kernels (glm5_train/model/triton_sparse_mla.py) against the torch path
(sparse_mla.SparseLatentAttention), on CPU under Triton's interpreter: forward output, the
log-sum-exp, the head-summed probabilities, dq and dkv; ties (repeated picks, equal logits),
invalid (-1) picks, causal edges (a pick at / past its query), a query without any valid pick,
several head and pick blocks, GLM-5's 512 + 64 widths, [S, B] views, the 16-bit path, and the
wiring through ``absorbed_sparse_attention``.

Triton's interpreter must be chosen (``TRITON_INTERPRET=1``) before triton is first imported:
its standard library (``tl.sum``, ``tl.max``) is decorated then, and other test modules import
it through sparse_mla. So the checks (``check_*``) run in one fresh Python process started with
the variable set (the ``interpreted`` fixture, once per session: ~10 s of imports), which
reports each check's outcome; each becomes one test here. The interpreter cannot show that a
GPU compiles the kernels: ``test_default_launch_shapes_compile_for_hopper`` compiles them for
sm_90 with Triton's bundled ptxas (no GPU needed).
The interpreter's own bf16 ``tl.dot`` multiplies raw bits (triton 3.9); the module widens
bf16 operands to fp32 under the interpreter (``_exact_bf16_dot_in_interpreter``), so bf16, the
dtype GLM-5 trains in, is checked like fp16. Tolerances, relative to the largest reference
value of each tensor: fp32 differences (summation order) measured <= 9e-7 over 4 seeds of
these shapes, checked at 1e-5; fp16 ones (the kernels round probabilities and logit gradients
to fp16 for their matmuls, the torch path does not) measured <= 9.1e-4, checked at 5e-3.
Against an fp64 reference on the same 16-bit inputs (``check_sixteen_bit_numerics_...``), at
context-parallel rows: bf16 measured <= 7.4e-3 (the torch path in bf16: <= 6.0e-3), fp16
<= 5.8e-4, over 4 seeds; checked at 2e-2 and 2e-3.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch

from glm5_train.model import sparse_mla, triton_sparse_mla
from glm5_train.model.sparse_mla import SparseLatentAttention, absorbed_sparse_attention
from tests import interpreted as tests_interpreted

SCALE = 0.3
# Largest difference allowed, relative to the largest reference value (see the docstring).
F32_REL, F16_REL = 1e-5, 5e-3
# Against fp64 on the same 16-bit inputs (the docstring's measured noise x ~3).
FP64_REF_REL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}
_RESULTS = "TRITON_SPARSE_MLA_RESULTS "  # the child's report line


def _causal_picks(gen, batch: int, seq: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random picks among each query's first max(t + 1, k) keys, as the indexer's
    top-k returns them: the first k - 1 queries get picks past themselves (invalid)."""
    idx = torch.stack([torch.stack([torch.randperm(max(t + 1, k), generator=gen)[:k]
                                    for t in range(seq)]) for _ in range(batch)])
    return idx, idx <= torch.arange(seq)[None, :, None]


def _leaves(gen, batch, seq, heads, width, dtype=torch.float32):
    q = torch.randn(batch, seq, heads, width, generator=gen).to(dtype).requires_grad_()
    kv = torch.randn(batch, seq, width, generator=gen).to(dtype).requires_grad_()
    return q, kv


def _torch_path(q, kv, idx, valid, value_width, grad_out):
    out, probs = SparseLatentAttention.apply(q, kv, idx, valid, SCALE, value_width, 5, True)
    dq, dkv = torch.autograd.grad(out, (q, kv), grad_out)
    return out, probs, dq, dkv


def _kernel_path(q, kv, picks, value_width, grad_out, configs=None, causal=True):
    out, lse, probs = triton_sparse_mla.sparse_mla(q, kv, picks, SCALE, value_width,
                                                   need_probs=True, configs=configs,
                                                   causal=causal)
    dq, dkv = torch.autograd.grad(out, (q, kv), grad_out)
    return out, lse, probs, dq, dkv


def _reference_lse(q, kv, idx, valid) -> torch.Tensor:
    """log-sum-exp of the scaled logits over the valid picks, [B, S, N] (-inf: none valid)."""
    rows = torch.stack([kv[b][idx[b]] for b in range(kv.shape[0])])  # [B, S, K, D]
    logits = torch.einsum("bsnd,bskd->bsnk", q.detach().double(), rows.detach().double())
    logits = (logits * SCALE).masked_fill(~valid[:, :, None, :], float("-inf"))
    return torch.logsumexp(logits, dim=-1).float()


def _assert_close(got: torch.Tensor, ref: torch.Tensor, rel: float = F32_REL,
                  what: str = "") -> None:
    worst = (got.double() - ref.double()).abs().max().item()
    assert worst <= rel * ref.abs().max().item(), (what, worst, ref.abs().max().item())


def _assert_matches(q, kv, idx, valid, value_width, configs=None, rel=F32_REL, picks=None,
                    causal=True):
    """The kernels against the torch path; ``causal=False`` for query rows that are not the
    key rows (a CP rank's): the -1 picks carry the causality then, as in the model."""
    gen = torch.Generator().manual_seed(99)
    grad_out = torch.randn(*q.shape[:-1], value_width, generator=gen).to(q.dtype)
    picks = triton_sparse_mla.picks_from(idx, valid) if picks is None else picks
    out, lse, probs, dq, dkv = _kernel_path(q, kv, picks, value_width, grad_out,
                                            configs, causal)
    ref_out, ref_probs, ref_dq, ref_dkv = _torch_path(q, kv, idx, valid, value_width, grad_out)
    for name, got, ref in (("out", out, ref_out), ("probs", probs, ref_probs),
                           ("dq", dq, ref_dq), ("dkv", dkv, ref_dkv)):
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        assert ref.abs().max() > 0, name
        _assert_close(got, ref, rel, name)
    ref_lse = _reference_lse(q, kv, idx, valid)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    return out, lse, probs, dq, dkv


def check_forward_and_backward_match_the_torch_path():
    gen = torch.Generator().manual_seed(0)
    q, kv = _leaves(gen, 2, 24, 3, 24 + 8)  # value width 24, RoPE 8: both blocks masked
    idx, valid = _causal_picks(gen, 2, 24, 6)
    assert (~valid).any()
    _assert_matches(q, kv, idx, valid, 24)


def check_glm5_latent_widths():
    """512 value columns + 64 RoPE columns, as GLM-5's 576-wide latent."""
    gen = torch.Generator().manual_seed(1)
    q, kv = _leaves(gen, 1, 10, 4, 576)
    idx, valid = _causal_picks(gen, 1, 10, 4)
    _assert_matches(q, kv, idx, valid, 512)


def check_several_head_and_pick_blocks():
    """20 heads in blocks of 16 (the head-summed probabilities become atomic adds) and 37
    picks in blocks of 16 (a partial last block)."""
    gen = torch.Generator().manual_seed(2)
    q, kv = _leaves(gen, 1, 48, 20, 16 + 16)
    idx, valid = _causal_picks(gen, 1, 48, 37)
    cfg = triton_sparse_mla.BlockConfig(block_h=16, block_k=16, num_warps=4)
    _assert_matches(q, kv, idx, valid, 16, configs=(cfg, cfg))


def check_ties_repeated_picks_and_equal_logits():
    """A key picked twice counts twice (its gradients add up), and keys with equal rows get
    equal probabilities, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    batch, seq, k = 1, 16, 5
    q, kv = _leaves(gen, batch, seq, 2, 32)
    with torch.no_grad():
        kv[0, 3] = kv[0, 7]  # equal latent rows: equal logits for every query
    idx, valid = _causal_picks(gen, batch, seq, k)
    idx[0, 12] = torch.tensor([3, 7, 3, 11, 12])  # a repeat and the tied pair
    valid[0, 12] = True
    _, _, probs, _, dkv = _assert_matches(q, kv, idx, valid, 24)
    assert probs[0, 12, 0] == probs[0, 12, 1] == probs[0, 12, 2] > 0
    assert dkv[0, 3].abs().max() > 0


def check_invalid_picks_and_causal_edges():
    """-1 picks and picks past their query get no weight, no gradient, and whatever their key
    rows hold changes nothing; a pick at the query's own position (the diagonal) counts."""
    gen = torch.Generator().manual_seed(4)
    batch, seq, k = 1, 12, 4
    q, kv = _leaves(gen, batch, seq, 2, 32)
    idx = torch.stack([torch.arange(t - k + 1, t + 1).clamp(min=-1) for t in range(seq)])[None]
    idx[0, 5] = torch.tensor([5, 6, 11, -1])  # the diagonal, then two future keys and a -1
    picks = idx.to(torch.int32)  # raw, as a caller of the kernel passes them: -1 and future
    valid = (idx >= 0) & (idx <= torch.arange(seq)[None, :, None])
    out, _, probs, _, _ = _assert_matches(q, kv, idx.clamp(min=0), valid, 24, picks=picks)
    assert probs[0, 5, 0] == 2.0 and probs[0, 5, 1:].eq(0).all()  # all weight on the diagonal
    assert probs[0, 0, :-1].eq(0).all() and probs[0, 0, -1] == 2.0  # t=0: only key 0
    # Key 11 is only ever picked as a future key (by t=5) or by t=11 itself.
    with torch.no_grad():
        moved = kv.clone()
        moved[0, 11] += 100.0
    out_moved, _, _ = triton_sparse_mla.sparse_mla(q, moved, picks, SCALE, 24)
    assert torch.equal(out_moved[0, :11], out[0, :11])


def check_query_without_any_valid_pick():
    """Output 0, log-sum-exp -inf, probabilities 0, gradients 0, nothing NaN, other queries
    unaffected (as the torch path: masks may forbid every pick of a query)."""
    gen = torch.Generator().manual_seed(5)
    q, kv = _leaves(gen, 2, 14, 3, 32)
    idx, valid = _causal_picks(gen, 2, 14, 4)
    valid[1, 9] = False
    out, lse, probs, dq, dkv = _assert_matches(q, kv, idx, valid, 24)
    for t in (out, probs, dq, dkv):
        assert torch.isfinite(t).all()
    assert out[1, 9].eq(0).all() and probs[1, 9].eq(0).all() and dq[1, 9].eq(0).all()
    assert torch.isinf(lse[1, 9]).all() and (lse[1, 9] < 0).all()


def check_unbatched_call_and_megatron_s_b_layout():
    """[S, N, D] / [S, D] / int32 [S, K] without a batch axis; and kv as the [B, S, D] view of
    megatron's [S, B, D] (strides passed through, no copy) giving the same results."""
    gen = torch.Generator().manual_seed(6)
    seq, batch, heads, width, value_width = 11, 2, 2, 32, 16
    q, _ = _leaves(gen, batch, seq, heads, width)
    kv_SBD = torch.randn(seq, batch, width, generator=gen).requires_grad_()
    idx, valid = _causal_picks(gen, batch, seq, 3)
    picks = triton_sparse_mla.picks_from(idx, valid)
    out, lse, _ = triton_sparse_mla.sparse_mla(q, kv_SBD.transpose(0, 1), picks, SCALE,
                                               value_width, need_probs=True)
    out.sum().backward()
    grad_view = kv_SBD.grad.clone()
    kv_BSD = kv_SBD.detach().transpose(0, 1).contiguous().requires_grad_()
    _assert_matches(q, kv_BSD, idx, valid, value_width)
    alone, alone_lse, alone_probs = triton_sparse_mla.sparse_mla(
        q[1], kv_BSD[1], picks[1], SCALE, value_width, need_probs=True)
    assert alone.shape == (seq, heads, value_width) and alone_probs.shape == (seq, 3)
    _assert_close(alone, out[1])
    _assert_close(alone_lse, lse[1])
    kv_BSD.grad = None
    triton_sparse_mla.sparse_mla(q, kv_BSD, picks, SCALE, value_width)[0].sum().backward()
    _assert_close(grad_view.transpose(0, 1), kv_BSD.grad)


def check_sixteen_bit_path():
    gen = torch.Generator().manual_seed(7)
    q, kv = _leaves(gen, 1, 20, 4, 48, dtype=torch.float16)
    idx, valid = _causal_picks(gen, 1, 20, 6)
    _assert_matches(q, kv, idx, valid, 32, rel=F16_REL)


def check_absorbed_attention_runs_the_kernels_where_supported():
    """``absorbed_sparse_attention`` (what DSACoreAttention calls) goes through
    ``sparse_latent_attention``'s dispatch: with the kernels answering ``supports`` (CUDA
    tensors in a real run) they run and give the torch path's results; on CPU tensors the real
    ``supports`` answers False."""
    assert not triton_sparse_mla.supports(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 4))
    gen = torch.Generator().manual_seed(8)
    seq, batch, heads, dn, r, c, dv = 13, 2, 3, 5, 4, 6, 7
    query = torch.randn(seq, batch, heads, dn + r, generator=gen, requires_grad=True)
    key = torch.randn(seq, batch, 1, c + r, generator=gen, requires_grad=True)
    weight = torch.randn(heads, dn + dv, c, generator=gen, requires_grad=True)
    idx, valid = _causal_picks(gen, batch, seq, 4)

    def run():
        out, probs = absorbed_sparse_attention(query, key, weight[:, :dn], weight[:, dn:], idx,
                                               valid, SCALE, need_probs=True)
        grads = torch.autograd.grad(out.square().sum(), (query, key, weight))
        return out, probs, grads

    ref_out, ref_probs, ref_grads = run()
    calls = []

    def supported(q_lat, kv):
        calls.append((q_lat.shape, kv.shape))
        return True

    assert sparse_mla.triton_sparse_mla is triton_sparse_mla
    real = triton_sparse_mla.supports
    triton_sparse_mla.supports = supported
    try:
        out, probs, grads = run()
    finally:
        triton_sparse_mla.supports = real
    assert calls, "sparse_latent_attention did not ask the kernels"
    _assert_close(out, ref_out)
    _assert_close(probs, ref_probs)
    for got, ref in zip(grads, ref_grads):
        _assert_close(got, ref)


# ------------------------------------- context-parallel rows: T queries against S key rows


def _rank_picks(gen, batch: int, positions: torch.Tensor, k: int):
    """Distinct random picks among each query's first max(p + 1, k) keys, p its global
    position (as the indexer selects for a CP rank's rows), with their causal validity."""
    idx = torch.stack([torch.stack([torch.randperm(max(int(p) + 1, k), generator=gen)[:k]
                                    for p in positions]) for _ in range(batch)])
    return idx, idx <= positions[None, :, None]


def check_cp_rank_rows_against_every_key_row_at_zigzag_positions():
    """A context-parallel rank's T query rows (zigzag: two chunks per rank) against all S key
    rows, T != S, on every rank of CP4: the model's call (valid picks only, not causal in the
    kernel) matches the torch path, and so does the kernel's own causal mask when given the
    rows' global positions with the raw picks (future keys included)."""
    from parallel.context_parallel import zigzag_positions

    seq, cp = 32, 4
    future_picks = 0
    for rank in range(cp):
        gen = torch.Generator().manual_seed(20 + rank)
        positions = zigzag_positions(seq, cp, rank, torch.device("cpu"))
        q, _ = _leaves(gen, 2, positions.numel(), 3, 32)
        kv = torch.randn(2, seq, 32, generator=gen).requires_grad_()
        idx, valid = _rank_picks(gen, 2, positions, 6)
        assert positions.numel() != seq and valid.any()
        future_picks += int((~valid).sum())
        _assert_matches(q, kv, idx, valid, 24, causal=False)
        grad_out = torch.randn(*q.shape[:-1], 24, generator=gen)
        ref = _kernel_path(q, kv, triton_sparse_mla.picks_from(idx, valid), 24, grad_out,
                           causal=False)
        out, lse, probs = triton_sparse_mla.sparse_mla(
            q, kv, idx.to(torch.int32), SCALE, 24, need_probs=True, causal=True,
            query_positions=positions)
        dq, dkv = torch.autograd.grad(out, (q, kv), grad_out)
        for got, want in zip((out, lse, probs, dq, dkv), ref):
            assert torch.equal(got, want)
    assert future_picks > 0  # rows before position K (ranks 0 and 1) pick past themselves


def check_issue_probe_four_query_rows_eight_key_rows():
    """The failing call of a CP2 rank: 4 query rows, 8 latent key rows, through
    ``absorbed_sparse_attention`` with the kernels answering ``supports``."""
    gen = torch.Generator().manual_seed(30)
    q_lat = torch.randn(1, 4, 2, 20, generator=gen, requires_grad=True)
    kv = torch.randn(1, 8, 20, generator=gen, requires_grad=True)
    positions = torch.tensor([2, 3, 4, 5])  # CP2 rank 1 of 8 tokens: chunks 1 and 2
    idx, valid = _rank_picks(gen, 1, positions, 3)
    real = triton_sparse_mla.supports
    triton_sparse_mla.supports = lambda q, k=None: True
    try:
        out, probs = sparse_mla.sparse_latent_attention(q_lat, kv, idx, valid, SCALE, 16, True)
    finally:
        triton_sparse_mla.supports = real
    ref_out, ref_probs = SparseLatentAttention.apply(q_lat, kv, idx, valid, SCALE, 16, 2, True)
    _assert_close(out, ref_out)
    _assert_close(probs, ref_probs)


def check_packed_document_boundaries():
    """Packed documents: picks across a document start are invalid (-1 from the selection);
    a query's output depends on its own document's keys only, and the kernel matches the
    torch path there."""
    gen = torch.Generator().manual_seed(31)
    seq, starts = 24, (0, 7, 15)
    doc_start = torch.tensor([max(s for s in starts if s <= t) for t in range(seq)])
    q, kv = _leaves(gen, 1, seq, 2, 32)
    idx, valid = _causal_picks(gen, 1, seq, 5)
    valid &= idx >= doc_start[None, :, None]
    assert (~valid[:, 7:]).any()
    out = _assert_matches(q, kv, idx, valid, 24)[0]
    with torch.no_grad():
        moved = kv.clone()
        moved[0, :15] += 50.0  # the first two documents' keys
    picks = triton_sparse_mla.picks_from(idx, valid)
    out_moved = triton_sparse_mla.sparse_mla(q, moved, picks, SCALE, 24, causal=False)[0]
    assert torch.equal(out_moved[0, 15:], out[0, 15:])


def check_picks_past_the_key_rows_get_no_weight():
    """A pick at or past S_kv (the last key row) is dropped like a -1, never read."""
    gen = torch.Generator().manual_seed(32)
    q = torch.randn(1, 3, 2, 32, generator=gen)
    kv = torch.randn(1, 5, 32, generator=gen)
    picks = torch.tensor([[[0, 5, 99], [1, -1, 4], [2, 3, 1000]]], dtype=torch.int32)
    out, _, probs = triton_sparse_mla.sparse_mla(q, kv, picks, SCALE, 24, need_probs=True,
                                                 causal=False)
    assert probs[0, 0, 1:].eq(0).all() and probs[0, 2, 2] == 0 and probs[0, 0, 0] == 2.0
    ref = triton_sparse_mla.sparse_mla(q, kv, picks.clamp(max=4).masked_fill(picks > 4, -1),
                                       SCALE, 24, causal=False)[0]
    assert torch.equal(out, ref)


def check_sixteen_bit_numerics_against_fp64_at_cp_rows():
    """bf16 (GLM-5's training dtype) and fp16 at a CP rank's rows (T != S, zigzag), 20 heads
    (two head blocks: atomic probabilities), against the torch path in fp64 on the same
    16-bit inputs; tolerances from the measured noise (module docstring)."""
    from parallel.context_parallel import zigzag_positions

    seq, heads, width, value_width, k = 64, 20, 80, 64, 12
    for dtype, seed in ((torch.bfloat16, 40), (torch.float16, 41)):
        gen = torch.Generator().manual_seed(seed)
        positions = zigzag_positions(seq, 4, 2, torch.device("cpu"))
        q = torch.randn(2, positions.numel(), heads, width, generator=gen).to(dtype)
        kv = torch.randn(2, seq, width, generator=gen).to(dtype)
        q.requires_grad_(), kv.requires_grad_()
        idx, valid = _rank_picks(gen, 2, positions, k)
        grad_out = torch.randn(*q.shape[:-1], value_width, generator=gen).to(dtype)
        out, _, probs, dq, dkv = _kernel_path(q, kv, triton_sparse_mla.picks_from(idx, valid),
                                              value_width, grad_out, causal=False)
        q64, kv64 = (t.detach().double().requires_grad_() for t in (q, kv))
        ref_out, ref_probs, ref_dq, ref_dkv = _torch_path(q64, kv64, idx, valid, value_width,
                                                          grad_out.double())
        assert out.dtype == dq.dtype == dkv.dtype == dtype
        for name, got, ref in (("out", out, ref_out), ("dq", dq, ref_dq),
                               ("dkv", dkv, ref_dkv), ("probs", probs, ref_probs)):
            _assert_close(got, ref, FP64_REF_REL[dtype], f"{dtype} {name}")



# ------------------------------------------------- the kernels as a GPU runs them, compiled

HOPPER_SHARED_BYTES = 227 * 1024  # the most shared memory one block may use on sm_90


def _compile_for_sm90(kernel, pointers: dict[str, str], constexprs: dict, config):
    """Triton's compiler down to a cubin for sm_90 (its bundled ptxas: no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget

    floats = ("scale", "scale_log2")
    signature = {name: "constexpr" if name in constexprs else pointers.get(name)
                 or ("fp32" if name in floats else "i32") for name in kernel.arg_names}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": config.num_warps,
                                   "num_stages": config.num_stages})


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,value_width,rope_width", [("bf16", 512, 64), ("fp32", 32, 16)])
def test_default_launch_shapes_compile_for_hopper(dtype, value_width, rope_width, causal):
    """The interpreter runs numpy programs; this compiles the real kernels (default launch
    shapes, probabilities by atomic adds) for sm_90 and checks each fits one block's shared
    memory there, so a GPU run does not fail at its first launch: bf16 at GLM-5's 512 + 64
    widths, fp32 at glm5_tiny's 32 + 16 (what the fp32 GPU check trains); not causal (what the
    model runs: its picks are causal already) and causal at given query positions."""
    import triton

    if not isinstance(triton_sparse_mla._sparse_mla_fwd, triton.runtime.JITFunction):
        pytest.skip("this process runs Triton's interpreter (TRITON_INTERPRET=1)")
    fwd, bwd = triton_sparse_mla.default_configs(64)
    blocks = {"BLOCK_C": value_width, "BLOCK_R": rope_width, "CAUSAL": causal,
              "PRECISION": "ieee" if dtype == "fp32" else "tf32"}
    tensor = f"*{dtype}"
    kernels = [
        (triton_sparse_mla._sparse_mla_fwd, fwd,
         {"Q": tensor, "KV": tensor, "PICKS": "*i32", "POS": "*i32", "OUT": tensor,
          "LSE": "*fp32", "PROBS": "*fp32"},
         {**blocks, "BLOCK_H": fwd.block_h, "BLOCK_K": fwd.block_k, "NEED_PROBS": True,
          "PROBS_ATOMIC": True}),
        (triton_sparse_mla._sparse_mla_bwd, bwd,
         {"Q": tensor, "KV": tensor, "PICKS": "*i32", "POS": "*i32", "DO": tensor,
          "LSE": "*fp32", "DELTA": "*fp32", "DQ": tensor, "DKV": "*fp32"},
         {**blocks, "BLOCK_H": bwd.block_h, "BLOCK_K": bwd.block_k})]
    for kernel, config, pointers, constexprs in kernels:
        compiled = _compile_for_sm90(kernel, pointers, constexprs, config)
        assert compiled.asm["cubin"], kernel.__name__
        assert 0 < compiled.metadata.shared <= HOPPER_SHARED_BYTES, (kernel.__name__,
                                                                     compiled.metadata.shared)


# ------------------------------------------------------------ running the checks, reporting

CHECKS = sorted(name for name in list(globals()) if name.startswith("check_"))


def _run_checks() -> None:
    """The child process: every check under the interpreter; one JSON report line."""
    import triton  # noqa: F401 - the dev extra installs it

    assert os.environ.get("TRITON_INTERPRET") == "1"
    outcome = {}
    for name in CHECKS:
        try:
            globals()[name]()
            outcome[name] = None
        except Exception:  # noqa: BLE001 - reported to the parent, which fails that test
            outcome[name] = traceback.format_exc()
    tests_interpreted.report(_RESULTS, outcome)


@pytest.fixture(scope="session")
def interpreted() -> dict[str, str | None]:
    """{check: None if it passed, else its traceback}, from one interpreter-mode process."""
    return tests_interpreted.run(
        "from tests.test_triton_sparse_mla import _run_checks; _run_checks()", [], _RESULTS,
        timeout=600)


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_under_triton_interpreter(interpreted, check):
    assert check in interpreted, f"{check} did not run"
    assert interpreted[check] is None, interpreted[check]
