"""gpu_check part ``kernel_parity``: the Triton sparse-MLA kernel against the torch path in the
calls a context-parallel (CP) rank makes.

A CP rank holds T = S / cp query rows at its zigzag positions and attends over all S key rows
(the gathered latent), so the kernel runs with T != S. Each case builds bf16 inputs at GLM-5's
widths (latent 512 + RoPE 64 = 576, value width 512, top-k 2048), picks made like the
indexer's (the top-k of random scores over each query's causal keys: a query before position K
has fewer than K valid ones, the rest point past it), and compares, against the torch path
(``SparseLatentAttention``) run in fp64 on the same bf16 values:

- ``masked``: the model's call: ``causal=False`` with the picks already -1 where not allowed;
- ``positions``: the kernel's own causal mask from ``query_positions`` (the zigzag positions)
  with the raw picks, future keys included.

Checked per tensor (forward output, head-summed probabilities, dq, dkv): the largest difference
relative to the largest reference value, at the bf16 tolerance of tests/test_triton_sparse_mla.py
(measured <= 7.4e-3 there at CP rows against fp64; 2e-2). Timed on CUDA (median of 2 after a
warm-up): the kernel's forward (with the probabilities) and forward + backward, the torch path's
forward + backward on the same bf16 inputs (128 query rows per chunk: its fastest on a GPU; the
model's default chunking is for CPU caches). Each case records the bytes the kernels would move
if every pick came from HBM (``pick_bytes_if_all_from_hbm``), and on CUDA those bytes over the
kernels' forward + backward time (``pick_gbs_if_all_from_hbm``): above the device's HBM
bandwidth, the L2 cache serves picks, and the step-time model's FLOPs pricing of the kernels
stands; near it, they are memory-bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import h200_perf
import torch

from glm5_train.model import triton_sparse_mla
from glm5_train.model.sparse_mla import SparseLatentAttention
from parallel.context_parallel import zigzag_positions

# Largest difference relative to the largest fp64 reference value, per input dtype (the
# measured noise of tests/test_triton_sparse_mla.py x ~3).
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}
SCALE = (192 + 64) ** -0.5  # GLM-5's softmax scale: qk head width 192 + 64


@dataclass(frozen=True)
class Case:
    seq: int  # S: key rows (the whole sequence)
    cp: int
    rank: int
    heads: int
    topk: int
    value: int  # C: value width (the latent)
    rope: int  # R: D = C + R

    @property
    def name(self) -> str:
        return f"S{self.seq}_cp{self.cp}r{self.rank}_h{self.heads}"


def cases(dry_run: bool) -> list[Case]:
    """GLM-5 at TP1 (64 heads) on CP4 ranks 1 and 2 and CP2 rank 0 (rows before position K:
    fewer valid picks than K), then 16 heads (TP4: one head block, no atomic probabilities).
    Dry run (Triton's interpreter: seconds per call): 20 heads (two head blocks), D 64 + 16,
    K 6, S 32 / 16."""
    if dry_run:
        return [Case(32, 4, 1, 20, 6, 64, 16), Case(32, 4, 2, 20, 6, 64, 16),
                Case(16, 2, 0, 20, 6, 64, 16), Case(32, 4, 2, 16, 6, 64, 16)]
    return [Case(16384, 4, 1, 64, 2048, 512, 64), Case(16384, 4, 2, 64, 2048, 512, 64),
            Case(8192, 2, 0, 64, 2048, 512, 64), Case(16384, 4, 2, 16, 2048, 512, 64)]


def indexer_like_picks(positions: torch.Tensor, seq: int, topk: int, gen) -> tuple:
    """(idx [1, T, K] int64, valid [1, T, K]): the top-k of random scores over each query's
    keys 0..position; where fewer than K exist, the rest are future keys, marked invalid."""
    scores = torch.rand(positions.numel(), seq, generator=gen, device=positions.device)
    future = torch.arange(seq, device=positions.device)[None, :] > positions[:, None]
    values, idx = scores.masked_fill_(future, float("-inf")).topk(min(topk, seq), dim=-1)
    return idx[None], (values > float("-inf"))[None]


def inputs(case: Case, device: torch.device, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    positions = zigzag_positions(case.seq, case.cp, case.rank, device)
    width = case.value + case.rope

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    idx, valid = indexer_like_picks(positions, case.seq, case.topk, gen)
    return {"q": rand(1, positions.numel(), case.heads, width), "kv": rand(1, case.seq, width),
            "grad": rand(1, positions.numel(), case.heads, case.value), "idx": idx,
            "valid": valid, "positions": positions}


def reference(x: dict, case: Case, rows: int) -> dict:
    """The torch path in fp64 on the same (16-bit) values."""
    q, kv = (x[k].detach().double().requires_grad_() for k in ("q", "kv"))
    out, probs = SparseLatentAttention.apply(q, kv, x["idx"], x["valid"], SCALE, case.value,
                                             rows, True)
    dq, dkv = torch.autograd.grad(out, (q, kv), x["grad"].double())
    return {"out": out.detach(), "probs": probs, "dq": dq, "dkv": dkv}


def kernel(x: dict, case: Case, form: str) -> dict:
    """The kernel with autograd: ``masked`` (the model's call) or ``positions``."""
    q, kv = (x[k].detach().requires_grad_() for k in ("q", "kv"))
    if form == "masked":
        picks = triton_sparse_mla.picks_from(x["idx"], x["valid"])
        out, _, probs = triton_sparse_mla.sparse_mla(q, kv, picks, SCALE, case.value,
                                                     need_probs=True, causal=False)
    else:
        out, _, probs = triton_sparse_mla.sparse_mla(
            q, kv, x["idx"].to(torch.int32), SCALE, case.value, need_probs=True, causal=True,
            query_positions=x["positions"])
    dq, dkv = torch.autograd.grad(out, (q, kv), x["grad"])
    return {"out": out.detach(), "probs": probs, "dq": dq, "dkv": dkv}


def relative_errors(got: dict, ref: dict) -> dict[str, float]:
    """max |got - ref| / max |ref| per tensor (NaN stays NaN: it fails the check)."""
    return {name: ((got[name].double() - ref[name]).abs().max()
                   / ref[name].abs().max().clamp_min(1e-30)).item() for name in ref}


def bytes_if_every_pick_from_hbm(valid_picks: int, width: int, element: int = 2) -> int:
    """What the kernels would move if no picked latent row came from cache: the forward reads
    each picked row twice (once more for the head-summed probabilities), the backward once,
    and adds the row's gradient with fp32 atomics (a 4-byte read and write per element). The
    step-time model's open question on GPUs (docs/step_time.md): the kernels' time against
    these bytes at HBM bandwidth says how much the L2 cache serves."""
    return valid_picks * width * (3 * element + 2 * 4)


def timings(x: dict, case: Case, device: torch.device, rows: int) -> dict[str, float]:
    picks = triton_sparse_mla.picks_from(x["idx"], x["valid"])
    q, kv = (x[k].detach().requires_grad_() for k in ("q", "kv"))

    def kernel_forward():
        with torch.no_grad():
            triton_sparse_mla.sparse_mla(q, kv, picks, SCALE, case.value, need_probs=True,
                                         causal=False)

    def kernel_step():
        out = triton_sparse_mla.sparse_mla(q, kv, picks, SCALE, case.value, need_probs=True,
                                           causal=False)[0]
        torch.autograd.grad(out, (q, kv), x["grad"])

    def torch_step():
        out = SparseLatentAttention.apply(q, kv, x["idx"], x["valid"], SCALE, case.value, rows,
                                          True)[0]
        torch.autograd.grad(out, (q, kv), x["grad"])

    seconds = {"kernel_fwd_s": h200_perf.timed(kernel_forward, device, 2),
               "kernel_fwd_bwd_s": h200_perf.timed(kernel_step, device, 2),
               "torch_fwd_bwd_s": h200_perf.timed(torch_step, device, 2)}
    picked = int(x["valid"].sum())
    flops = 3 * 2 * case.heads * picked * (2 * case.value + case.rope)  # h200_perf's count
    seconds["kernel_fwd_bwd_tflops"] = flops / seconds["kernel_fwd_bwd_s"] / 1e12
    seconds["torch_over_kernel"] = seconds["torch_fwd_bwd_s"] / seconds["kernel_fwd_bwd_s"]
    # above the device's HBM bandwidth: picks served from cache
    seconds["pick_gbs_if_all_from_hbm"] = (
        bytes_if_every_pick_from_hbm(picked, case.value + case.rope)
        / seconds["kernel_fwd_bwd_s"] / 1e9)
    return seconds


def run_case(case: Case, ctx, dtype: torch.dtype, seed: int) -> dict:
    rows = 4 if ctx.dry_run else 128
    x = inputs(case, ctx.device, dtype, seed)
    ref = reference(x, case, rows)
    record = {"case": case.name, "S": case.seq, "T": x["positions"].numel(), "cp": case.cp,
              "rank": case.rank, "heads": case.heads, "topk": case.topk,
              "width": case.value + case.rope, "valid_picks": int(x["valid"].sum()),
              "rows_short_of_k": int((~x["valid"]).any(-1).sum()),
              "pick_bytes_if_all_from_hbm": bytes_if_every_pick_from_hbm(
                  int(x["valid"].sum()), case.value + case.rope),
              "kernel_supported_here": triton_sparse_mla.supports(x["q"], x["kv"])}
    tolerance = TOLERANCE[dtype]
    for form in ("masked", "positions"):
        errors = relative_errors(kernel(x, case, form), ref)
        record[f"errors_{form}"] = errors
        for name, error in errors.items():
            if not error <= tolerance:  # NaN fails too
                ctx.problems.append(f"{case.name} {form} {name}: {error:.3e} > {tolerance:g}")
    if ctx.device.type == "cuda":
        record.update(timings(x, case, ctx.device, rows))
    return record


def run(ctx) -> dict:
    if not triton_sparse_mla.available():
        raise RuntimeError("triton is not installed: the kernel cannot run")
    if ctx.device.type != "cuda" and not triton_sparse_mla.interpreted():
        raise RuntimeError("CPU run without TRITON_INTERPRET=1 set before triton's import")
    dtype = torch.bfloat16
    done, skipped = [], []
    for seed, case in enumerate(cases(ctx.dry_run)):
        if ctx.budget.left() < (5 if ctx.dry_run else 15):
            skipped.append(case.name)
            continue
        done.append(run_case(case, ctx, dtype, seed))
        h200_perf.free_memory(ctx.device)
    if ctx.device.type != "cuda":
        ctx.cuda_only("timings")
    if skipped:
        ctx.problems.append(f"cases skipped for time: {skipped}")
    return {"dtype": "bfloat16", "reference": "torch path (SparseLatentAttention) in fp64",
            "tolerance": TOLERANCE[dtype], "interpreted": triton_sparse_mla.interpreted(),
            "cases": done, "skipped": skipped}
