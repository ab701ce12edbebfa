"""DSA's sparse attention over the selected latent keys as Triton kernels (forward, backward).

The same computation as ``sparse_mla.SparseLatentAttention`` (the torch reference, which runs
everywhere else), fused for CUDA: MLA in the absorbed form is multi-query attention of each
query's N heads over its own K picked rows of the shared latent

    q_lat [B, S, N, D]  (absorbed q_nope ‖ q_pe; D = C + R, GLM-5: 512 + 64 = 576)
    kv    [B, S, D]     latent keys shared by the heads; values are their first C columns
    picks [B, S, K]     int32 key positions, -1 for "none"

Causal: a pick past its query's position (``pick > t``) gets no weight, as a -1 does. Returns
the output [B, S, N, C] (dtype of ``q_lat``), the log-sum-exp [B, S, N] fp32 (natural log of
the scaled logits; -inf for a query without any valid pick, whose output is 0) and, when asked,
the attention probabilities of the picks summed over the N heads [B, S, K] fp32 (0 at invalid
picks), the indexer KL's target: the forward kernel recomputes each block's logits once more
after the log-sum-exp is known (exact probabilities need the final log-sum-exp; the online
softmax only has a running one): the 576-wide logit matmul again, about +50% forward matmul
work when asked, nothing otherwise.

One program per (query, block of heads, batch): the K picked rows are gathered once per program
and shared by its heads; the head blocks of one query are neighbours in the launch order, so
its gathered rows are read from L2 by all but the first (GLM-5 at TP1: 64 heads, 4 blocks of
16: larger blocks spill registers, see ``default_configs``). Forward: online softmax over
blocks of picks, fp32 accumulation. Backward: the logits and probabilities are
recomputed from the saved log-sum-exp; dq is accumulated per program in registers and written
once (deterministic); dkv is scattered with fp32 atomic adds into the picked rows, summed over
the program's heads first (run to run, dkv can differ in the last fp32 bits: the order of the
atomic adds is not fixed). Under ``torch.use_deterministic_algorithms(True)``, ``supports``
answers False and the torch path runs. With more heads than one block holds, the head-summed
probabilities are atomic adds too (one per head block; order-dependent in the same way).

Precision: logits, softmax and all accumulations in fp32; bf16/fp16 inputs enter the matmuls
as they are, and the probabilities / logit gradients are rounded to that dtype for their
matmuls (as flash attention does), where the torch path computes in fp32 throughout; fp32
inputs use IEEE fp32 matmuls (no TF32), matching the torch path to rounding.

Tests: tests/test_triton_sparse_mla.py runs these kernels on CPU under Triton's interpreter
against the torch path. Shape legend as in sparse_mla.py; BH / BK / BC / BR: block sizes of
heads, picks, value columns and RoPE columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

try:  # optional: CUDA builds of torch carry it; `pip install -e ".[dev]"` on CPU
    import triton
    import triton.language as tl
except ImportError:
    triton = None

LOG2E = math.log2(math.e)
# Kernel launches in this process (forward, backward), for the job's metrics: the proof, from
# a run's own records, that its sparse attention ran here (``sparse_kernel_launches``).
LAUNCHES = {"forward": 0, "backward": 0}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The same as a constexpr global: kernels see globals only as constexprs.
LOG2E_CONST = tl.constexpr(LOG2E) if triton is not None else LOG2E


def _jit(fn):
    """``triton.jit`` where triton is installed; without it the kernels are never launched
    (``available`` is False) and stay plain functions."""
    return triton.jit(fn) if triton is not None else fn


def available() -> bool:
    return triton is not None


def interpreted() -> bool:
    """Whether the kernels run under Triton's CPU interpreter: ``TRITON_INTERPRET=1`` was set
    when triton was first imported (it decides then how ``triton.jit`` builds kernels)."""
    return available() and not isinstance(_sparse_mla_fwd, triton.runtime.JITFunction)


def interpreter_runs_kernels() -> bool:
    """Whether this triton's interpreter runs the kernels: 3.6's fails with NumPy 2 on every
    loop bounded by a scalar argument (checked: 3.6.0 fails, 3.7.1 and 3.9.0 run them);
    compiled for a GPU, 3.6 is fine."""
    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 7)


def _exact_bf16_dot_in_interpreter() -> None:
    """Make the interpreter's ``tl.dot`` read bf16 operands as numbers. It keeps bf16 as raw
    uint16 bits and its dot multiplies those integers (triton 3.9: ~1e10 for unit inputs;
    fp16 and fp32 are right). Widened to fp32 first (exact: bf16 is fp32's upper half), the
    product is what a GPU's bf16 dot with fp32 accumulation gives up to summation order."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "widens_bf16", False):
        return
    original = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *args, **kwargs):
        return original(self, widened(a), widened(b), d, *args, **kwargs)

    create_dot.widens_bf16 = True
    builder.create_dot = create_dot


def supports(q_lat: torch.Tensor, kv: torch.Tensor | None = None) -> bool:
    """Whether ``sparse_mla.sparse_latent_attention`` runs these kernels for ``q_lat`` (and
    ``kv``): CUDA tensors of one matmul dtype, triton installed, deterministic algorithms not
    requested; anything else runs the torch path, which promotes mixed dtypes to fp32."""
    return (available() and q_lat.is_cuda and q_lat.dtype in _DTYPES
            and (kv is None or kv.dtype == q_lat.dtype)
            and not torch.are_deterministic_algorithms_enabled())


@dataclass(frozen=True)
class BlockConfig:
    """Launch shape of one kernel: heads and picks per program, warps, pipeline stages."""

    block_h: int
    block_k: int
    num_warps: int
    num_stages: int = 1


def default_configs(heads: int) -> tuple[BlockConfig, BlockConfig]:
    """(forward, backward) launch shapes: 16 heads per program (tl.dot's smallest M), the
    largest blocks that compile for sm_80 / sm_90 / sm_100 without spilling registers at
    GLM-5's widths (compiled without a GPU, bf16, triton 3.9: forward 154 registers per
    thread on sm_90, backward 215; 32 heads per program or 32-pick backward blocks spill).
    Not yet timed on a GPU: ``bench/gpu/h200_perf.py`` sweeps alternatives."""
    del heads  # the same for every head count: fewer than 16 are padded (masked)
    return BlockConfig(16, 32, 8, 2), BlockConfig(16, 16, 8, 1)


# ----------------------------------------------------------------------------- the kernels


@_jit
def _sparse_mla_fwd(Q, KV, PICKS, POS, OUT, LSE, PROBS,
                    sq_b, sq_s, sq_h, skv_b, skv_s, sp_b, sp_s, so_b, so_s, so_h,
                    sl_b, sl_s, spr_b, spr_s,
                    heads, head_blocks, picks, kv_rows, value_width, rope_width, scale_log2,
                    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                    BLOCK_R: tl.constexpr, CAUSAL: tl.constexpr, NEED_PROBS: tl.constexpr,
                    PROBS_ATOMIC: tl.constexpr, PRECISION: tl.constexpr):
    # One program per (query, head block): the head blocks of a query are neighbours in the
    # launch order, so the rows one gathers are in L2 for the next. int64: offsets pass 2^31.
    pid = tl.program_id(0).to(tl.int64)
    t = pid // head_blocks
    b = tl.program_id(1).to(tl.int64)
    offs_h = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h = offs_h < heads
    mask_c = offs_c < value_width
    mask_r = offs_r < rope_width
    q_rows = Q + b * sq_b + t * sq_s + offs_h[:, None] * sq_h
    q_c = tl.load(q_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
    q_r = tl.load(q_rows + value_width + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :],
                  other=0.0)
    kv_base = KV + b * skv_b
    pick_base = PICKS + b * sp_b + t * sp_s
    pos = t  # the query's position among the key rows (its global one under CP)
    if CAUSAL:
        pos = tl.load(POS + t).to(tl.int64)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of 2^(s - m)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for k0 in range(0, picks, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(pick_base + offs_k, mask=offs_k < picks, other=-1)
        valid = (idx >= 0) & (idx < kv_rows)
        if CAUSAL:
            valid = valid & (idx <= pos)
        rows = kv_base + tl.where(valid, idx, 0).to(tl.int64)[:, None] * skv_s
        c = tl.load(rows + offs_c[None, :], mask=valid[:, None] & mask_c[None, :], other=0.0)
        r = tl.load(rows + value_width + offs_r[None, :], mask=valid[:, None] & mask_r[None, :],
                    other=0.0)
        s = tl.dot(q_c, tl.trans(c), input_precision=PRECISION)
        s = tl.dot(q_r, tl.trans(r), acc=s, input_precision=PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid pick yet: no shift
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(c.dtype), c, acc=acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    has_pick = l_i > 0.0
    lse2 = tl.where(has_pick, m_i + tl.log2(tl.where(has_pick, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(has_pick, l_i, 1.0)[:, None]
    o_rows = OUT + b * so_b + t * so_s + offs_h[:, None] * so_h
    tl.store(o_rows + offs_c[None, :], out.to(OUT.dtype.element_ty),
             mask=mask_h[:, None] & mask_c[None, :])
    tl.store(LSE + b * sl_b + t * sl_s + offs_h, lse2 / LOG2E_CONST, mask=mask_h)

    if NEED_PROBS:  # second pass: exact probabilities against the final log-sum-exp
        lse_use = tl.where(mask_h & has_pick, lse2, float("inf"))  # -> probability 0
        prob_base = PROBS + b * spr_b + t * spr_s
        for k0 in range(0, picks, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            idx = tl.load(pick_base + offs_k, mask=offs_k < picks, other=-1)
            valid = (idx >= 0) & (idx < kv_rows)
            if CAUSAL:
                valid = valid & (idx <= pos)
            rows = kv_base + tl.where(valid, idx, 0).to(tl.int64)[:, None] * skv_s
            c = tl.load(rows + offs_c[None, :], mask=valid[:, None] & mask_c[None, :], other=0.0)
            r = tl.load(rows + value_width + offs_r[None, :],
                        mask=valid[:, None] & mask_r[None, :], other=0.0)
            s = tl.dot(q_c, tl.trans(c), input_precision=PRECISION)
            s = tl.dot(q_r, tl.trans(r), acc=s, input_precision=PRECISION) * scale_log2
            p = tl.where(valid[None, :], tl.exp2(s - lse_use[:, None]), 0.0)
            head_sum = tl.sum(p, 0)
            if PROBS_ATOMIC:
                tl.atomic_add(prob_base + offs_k, head_sum, mask=offs_k < picks)
            else:
                tl.store(prob_base + offs_k, head_sum, mask=offs_k < picks)


@_jit
def _sparse_mla_bwd(Q, KV, PICKS, POS, DO, LSE, DELTA, DQ, DKV,
                    sq_b, sq_s, sq_h, skv_b, skv_s, sp_b, sp_s, sdo_b, sdo_s, sdo_h,
                    sl_b, sl_s, sdq_b, sdq_s, sdq_h, sdkv_b, sdkv_s,
                    heads, head_blocks, picks, kv_rows, value_width, rope_width, scale,
                    scale_log2,
                    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                    BLOCK_R: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # as in the forward
    t = pid // head_blocks
    b = tl.program_id(1).to(tl.int64)
    offs_h = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h = offs_h < heads
    mask_c = offs_c < value_width
    mask_r = offs_r < rope_width
    mask_hc = mask_h[:, None] & mask_c[None, :]
    mask_hr = mask_h[:, None] & mask_r[None, :]
    q_rows = Q + b * sq_b + t * sq_s + offs_h[:, None] * sq_h
    q_c = tl.load(q_rows + offs_c[None, :], mask=mask_hc, other=0.0)
    q_r = tl.load(q_rows + value_width + offs_r[None, :], mask=mask_hr, other=0.0)
    d_o = tl.load(DO + b * sdo_b + t * sdo_s + offs_h[:, None] * sdo_h + offs_c[None, :],
                  mask=mask_hc, other=0.0)
    lse = tl.load(LSE + b * sl_b + t * sl_s + offs_h, mask=mask_h, other=float("-inf"))
    # A head without any valid pick (lse -inf) or past the last head: probabilities 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_CONST)
    delta = tl.load(DELTA + b * sl_b + t * sl_s + offs_h, mask=mask_h, other=0.0)
    kv_base = KV + b * skv_b
    dkv_base = DKV + b * sdkv_b
    pick_base = PICKS + b * sp_b + t * sp_s
    pos = t  # as in the forward
    if CAUSAL:
        pos = tl.load(POS + t).to(tl.int64)

    dq_c = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    dq_r = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for k0 in range(0, picks, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(pick_base + offs_k, mask=offs_k < picks, other=-1)
        valid = (idx >= 0) & (idx < kv_rows)
        if CAUSAL:
            valid = valid & (idx <= pos)
        row = tl.where(valid, idx, 0).to(tl.int64)[:, None]
        mask_kc = valid[:, None] & mask_c[None, :]
        mask_kr = valid[:, None] & mask_r[None, :]
        c = tl.load(kv_base + row * skv_s + offs_c[None, :], mask=mask_kc, other=0.0)
        r = tl.load(kv_base + row * skv_s + value_width + offs_r[None, :], mask=mask_kr,
                    other=0.0)
        s = tl.dot(q_c, tl.trans(c), input_precision=PRECISION)
        s = tl.dot(q_r, tl.trans(r), acc=s, input_precision=PRECISION) * scale_log2
        p = tl.where(valid[None, :], tl.exp2(s - lse2[:, None]), 0.0)
        # Softmax backward: dlogit = p (dp - sum_k p dp), sum_k p dp = dO . O = delta; times
        # the scale (logit = scale x q . k).
        dp = tl.dot(d_o, tl.trans(c), input_precision=PRECISION)
        ds = (p * (dp - delta[:, None]) * scale).to(c.dtype)
        dq_c = tl.dot(ds, c, acc=dq_c, input_precision=PRECISION)
        dq_r = tl.dot(ds, r, acc=dq_r, input_precision=PRECISION)
        # This program's heads summed before the scatter: one atomic add per picked element.
        dkv_c = tl.dot(tl.trans(ds), q_c, input_precision=PRECISION)
        dkv_c = tl.dot(tl.trans(p.to(c.dtype)), d_o, acc=dkv_c, input_precision=PRECISION)
        dkv_r = tl.dot(tl.trans(ds), q_r, input_precision=PRECISION)
        tl.atomic_add(dkv_base + row * sdkv_s + offs_c[None, :], dkv_c, mask=mask_kc)
        tl.atomic_add(dkv_base + row * sdkv_s + value_width + offs_r[None, :], dkv_r,
                      mask=mask_kr)

    dq_rows = DQ + b * sdq_b + t * sdq_s + offs_h[:, None] * sdq_h
    tl.store(dq_rows + offs_c[None, :], dq_c.to(DQ.dtype.element_ty), mask=mask_hc)
    tl.store(dq_rows + value_width + offs_r[None, :], dq_r.to(DQ.dtype.element_ty),
             mask=mask_hr)



# ------------------------------------------------------------------------ launching them


def _widths(value_width: int, width: int) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_R): power-of-two blocks (>= 16, tl.dot's minimum) of the value and
    RoPE columns; columns past the real widths are masked."""
    return (max(16, triton.next_power_of_2(value_width)),
            max(16, triton.next_power_of_2(max(1, width - value_width))))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32: ignored for 16-bit inputs


def _check_inputs(q_lat: torch.Tensor, kv: torch.Tensor, picks: torch.Tensor,
                  value_width: int) -> None:
    batch, seq, _, width = q_lat.shape
    if kv.dim() != 3 or kv.shape[0] != batch or kv.shape[2] != width:
        raise ValueError(f"sparse MLA kernel: kv {tuple(kv.shape)} must be [B, S_kv, D] = "
                         f"[{batch}, S_kv, {width}] for q_lat {tuple(q_lat.shape)} (S_kv key "
                         "rows, any number: all of them under context parallelism)")
    if picks.shape[:2] != (batch, seq) or picks.dtype != torch.int32:
        raise ValueError(f"sparse MLA kernel: picks {tuple(picks.shape)} {picks.dtype} must be "
                         f"int32 [B, T, K] = [{batch}, {seq}, K] (-1 for none)")
    if q_lat.dtype != kv.dtype or q_lat.dtype not in _DTYPES:
        raise ValueError(f"sparse MLA kernel: q_lat {q_lat.dtype} and kv {kv.dtype} must share "
                         "one of float16 / bfloat16 / float32 (other dtypes: the torch path)")
    if not 0 < value_width <= width:
        raise ValueError(f"sparse MLA kernel: value_width {value_width} must be in 1..{width}")


def query_positions_for(q_lat: torch.Tensor, causal: bool,
                        query_positions: torch.Tensor | None) -> torch.Tensor:
    """The queries' positions among the key rows as the kernels read them (int32 [T],
    contiguous): ``query_positions`` (a context-parallel rank's zigzag positions), or
    0..T-1 (queries and keys the same rows); a 1-element dummy when not causal."""
    seq = q_lat.shape[1]
    if not causal:
        return torch.zeros(1, dtype=torch.int32, device=q_lat.device)
    if query_positions is None:
        return torch.arange(seq, dtype=torch.int32, device=q_lat.device)
    if query_positions.shape != (seq,):
        raise ValueError(f"sparse MLA kernel: query_positions {tuple(query_positions.shape)} "
                         f"must be [T] = [{seq}], one position per query row")
    return query_positions.to(device=q_lat.device, dtype=torch.int32).contiguous()


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride along its last axis (the kernels address columns directly);
    other strides are passed as they are, so megatron's [S, B] views need no copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def forward(q_lat: torch.Tensor, kv: torch.Tensor, picks: torch.Tensor, scale: float,
            value_width: int, need_probs: bool = False, causal: bool = True,
            config: BlockConfig | None = None, query_positions: torch.Tensor | None = None):
    """(out [B, T, N, C], lse [B, T, N] fp32, probs [B, T, K] fp32 or None); no autograd.
    ``kv`` holds S_kv key rows (any number); ``query_positions`` as ``sparse_mla``."""
    _check_inputs(q_lat, kv, picks, value_width)
    positions = query_positions_for(q_lat, causal, query_positions)
    q_lat, kv, picks = _unit_last(q_lat), _unit_last(kv), _unit_last(picks)
    batch, seq, heads, width = q_lat.shape
    k = picks.shape[-1]
    cfg = config or default_configs(heads)[0]
    out = q_lat.new_empty(batch, seq, heads, value_width)
    lse = torch.empty(batch, seq, heads, dtype=torch.float32, device=q_lat.device)
    head_blocks = triton.cdiv(heads, cfg.block_h)
    atomic = need_probs and head_blocks > 1
    probs = (torch.zeros if atomic else torch.empty)(
        (batch, seq, k) if need_probs else (1, 1, 1), dtype=torch.float32, device=q_lat.device)
    if seq == 0 or batch == 0:
        return out, lse, probs if need_probs else None
    block_c, block_r = _widths(value_width, width)
    LAUNCHES["forward"] += 1
    _sparse_mla_fwd[(seq * head_blocks, batch)](
        q_lat, kv, picks, positions, out, lse, probs,
        q_lat.stride(0), q_lat.stride(1), q_lat.stride(2), kv.stride(0), kv.stride(1),
        picks.stride(0), picks.stride(1), out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), probs.stride(0), probs.stride(1),
        heads, head_blocks, k, kv.shape[1], value_width, width - value_width, scale * LOG2E,
        BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, BLOCK_C=block_c, BLOCK_R=block_r,
        CAUSAL=causal, NEED_PROBS=need_probs, PROBS_ATOMIC=atomic,
        PRECISION=_precision(q_lat.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, lse, probs if need_probs else None


def backward(q_lat: torch.Tensor, kv: torch.Tensor, picks: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, grad_out: torch.Tensor, scale: float, causal: bool = True,
             config: BlockConfig | None = None, query_positions: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq like ``q_lat``, dkv like ``kv``) for the output gradient ``grad_out``."""
    positions = query_positions_for(q_lat, causal, query_positions)
    q_lat, kv, picks = _unit_last(q_lat), _unit_last(kv), _unit_last(picks)
    batch, seq, heads, width = q_lat.shape
    value_width = out.shape[-1]
    cfg = config or default_configs(heads)[1]
    grad_out = _unit_last(grad_out.to(q_lat.dtype))
    # sum_k p dp = dO . O per (query, head): a [B, S, N] read of two [B, S, N, C] tensors.
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()
    lse = lse.contiguous()
    dq = torch.empty(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # atomic adds
    if seq == 0 or batch == 0:
        return dq, dkv.to(kv.dtype)
    block_c, block_r = _widths(value_width, width)
    head_blocks = triton.cdiv(heads, cfg.block_h)
    LAUNCHES["backward"] += 1
    _sparse_mla_bwd[(seq * head_blocks, batch)](
        q_lat, kv, picks, positions, grad_out, lse, delta, dq, dkv,
        q_lat.stride(0), q_lat.stride(1), q_lat.stride(2), kv.stride(0), kv.stride(1),
        picks.stride(0), picks.stride(1),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2), lse.stride(0), lse.stride(1),
        dq.stride(0), dq.stride(1), dq.stride(2), dkv.stride(0), dkv.stride(1),
        heads, head_blocks, picks.shape[-1], kv.shape[1], value_width, width - value_width,
        scale, scale * LOG2E,
        BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, BLOCK_C=block_c, BLOCK_R=block_r,
        CAUSAL=causal, PRECISION=_precision(q_lat.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return dq, dkv.to(kv.dtype)


class TritonSparseLatentAttention(torch.autograd.Function):
    """``forward`` / ``backward`` above as one autograd op: outputs (out, lse, probs); lse and
    probs are not differentiable (probs is the indexer KL's detached target). Saved for
    backward: q_lat, kv, picks, lse, out and the query positions (nothing [S, K, *] but the
    int32 picks)."""

    @staticmethod
    def forward(ctx, q_lat, kv, picks, scale: float, value_width: int, need_probs: bool,
                causal: bool, configs, query_positions):
        fwd_cfg, bwd_cfg = configs or default_configs(q_lat.shape[2])
        positions = query_positions_for(q_lat, causal, query_positions)
        out, lse, probs = forward(q_lat, kv, picks, scale, value_width, need_probs, causal,
                                  fwd_cfg, positions if causal else None)
        probs = probs if need_probs else q_lat.new_empty(0, dtype=torch.float32)
        ctx.save_for_backward(q_lat, kv, picks, lse, out, positions)
        ctx.scale, ctx.causal, ctx.bwd_cfg = scale, causal, bwd_cfg
        ctx.mark_non_differentiable(lse, probs)
        return out, lse, probs

    @staticmethod
    def backward(ctx, grad_out, _grad_lse, _grad_probs):
        q_lat, kv, picks, lse, out, positions = ctx.saved_tensors
        dq, dkv = backward(q_lat, kv, picks, out, lse, grad_out, ctx.scale, ctx.causal,
                           ctx.bwd_cfg, positions if ctx.causal else None)
        return dq, dkv, None, None, None, None, None, None, None


def picks_from(idx: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The kernels' int32 picks [B, S, K] from the torch path's (idx, valid): -1 where not
    valid."""
    return torch.where(valid, idx, -1).to(torch.int32)


def sparse_mla(q_lat: torch.Tensor, kv: torch.Tensor, picks: torch.Tensor, scale: float,
               value_width: int, need_probs: bool = False, causal: bool = True,
               configs: tuple[BlockConfig, BlockConfig] | None = None,
               query_positions: torch.Tensor | None = None):
    """The kernels with autograd: q_lat [T, N, D] or [B, T, N, D] (T query rows), kv [S, D] or
    [B, S, D] (S key rows, any number: a context-parallel rank's queries against the whole
    sequence's keys), int32 picks [T, K] or [B, T, K] (row numbers of ``kv``; -1 or >= S: none).
    ``causal``: a pick past its query's position gets no weight, the position being
    ``query_positions[t]`` (int [T]; e.g. the zigzag positions of a CP rank) or t when None;
    ``causal=False`` trusts the picks (what the model passes: its selection is causal and
    document-bounded already). Returns (out [.., T, N, value_width], lse [.., T, N] fp32,
    head-summed probabilities [.., T, K] fp32 or None)."""
    unbatched = q_lat.dim() == 3
    if unbatched:
        q_lat, kv, picks = q_lat[None], kv[None], picks[None]
    out, lse, probs = TritonSparseLatentAttention.apply(q_lat, kv, picks, scale, value_width,
                                                        need_probs, causal, configs,
                                                        query_positions)
    probs = probs if need_probs else None
    if unbatched:
        return out[0], lse[0], (probs[0] if need_probs else None)
    return out, lse, probs


def sparse_latent_attention(q_lat: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor,
                            valid: torch.Tensor, scale: float, value_width: int,
                            need_probs: bool = False,
                            configs: tuple[BlockConfig, BlockConfig] | None = None):
    """``sparse_mla.sparse_latent_attention``'s contract on the kernels: ``q_lat`` [B, T, N, D]
    (this rank's query rows), ``kv`` [B, S, D] (every key row), ``idx`` [B, T, K] (any integer
    dtype) with ``valid`` [B, T, K]; returns (out, probs or None). Not causal in the kernel:
    ``valid`` already is (the indexer never selects a key past its query, nor across a
    packed-document boundary), so an invalid pick is passed as -1 and nothing else is
    masked, whatever rows this rank's queries are."""
    out, _, probs = sparse_mla(q_lat, kv, picks_from(idx, valid), scale, value_width,
                               need_probs, False, configs)
    return out, probs


if interpreted():
    _exact_bf16_dot_in_interpreter()
