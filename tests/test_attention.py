"""Dense MLA attention (glm5_train.model.layers): q, k, v zero-padded to one head width so SDPA
runs its flash kernel, exact against SDPA's math kernel on the unpadded widths.

Widths: the tiny model's (q/k 48 = 32 + 16 RoPE, v 32: v is padded), q/k 192 with v 256 (q and
k padded; the long-context issue's case) and GLM-5's (q/k 192 + 64 RoPE = 256 = v: no padding,
SDPA as before). Tolerance: fp32, the kernels differ only in summation order
(flash's blockwise online softmax); measured max relative differences 4e-7 .. 3e-6 on outputs
and gradients at 256 tokens, so 2e-5 leaves margin while a wrong scale or a leaked padded
column moves outputs by > 1e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn.attention import SDPBackend, sdpa_kernel

from glm5_train.model.layers import MLACoreAttention, equal_width_attention
from parallel import mcore_compat
from parallel.process_groups import single_process_group

WIDTHS = [(48, 32), (192, 256), (256, 256)]  # (Dqk, Dv): glm5_tiny, q/k padded, GLM-5
RTOL = 2e-5
BATCH, HEADS, SEQ = 2, 4, 256


def _inputs(dqk: int, dv: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(BATCH, HEADS, SEQ, dqk)] * 2 + [(BATCH, HEADS, SEQ, dv)]
    return [torch.randn(*shape, generator=gen) for shape in shapes]


def _document_allowed(seed: int) -> torch.Tensor:
    """[B, 1, S, S], True = may attend: causal within each of up to 3 packed documents."""
    gen = torch.Generator().manual_seed(seed)
    doc_BS = torch.randint(0, 3, (BATCH, SEQ), generator=gen).sort(-1).values
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return ((doc_BS[:, :, None] == doc_BS[:, None, :]) & causal)[:, None]


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _flash_node(out: torch.Tensor) -> str:
    """Name of the SDPA node under ``out`` (a slice of the padded output)."""
    node = out.grad_fn
    while node is not None and "Attention" not in node.name():
        node = node.next_functions[0][0]
    return node.name() if node is not None else "none"


@pytest.mark.parametrize("dqk,dv", WIDTHS)
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "documents"])
def test_padded_flash_matches_unpadded_math(dqk, dv, masked):
    padded = [t.requires_grad_() for t in _inputs(dqk, dv, seed=dqk)]
    plain = [t.detach().clone().requires_grad_() for t in padded]
    allowed = _document_allowed(seed=dv) if masked else None
    scale = 1.3 * dqk ** -0.5  # not SDPA's default for either width
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if padding left a width unequal
        out = equal_width_attention(*padded, allowed, scale)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(*plain, attn_mask=allowed,
                                             is_causal=allowed is None, scale=scale)
    assert "FlashAttention" in _flash_node(out), _flash_node(out)
    assert out.shape == ref.shape == (BATCH, HEADS, SEQ, dv)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7))
    out.backward(grad)
    ref.backward(grad)
    assert _max_rel(out, ref) < RTOL
    for name, a, b in zip("qkv", padded, plain):
        assert _max_rel(a.grad, b.grad) < RTOL, name


def test_unequal_widths_have_no_flash_kernel_on_cpu():
    """Why the padding exists: forced onto flash, SDPA refuses unequal widths either way."""
    for dqk, dv in WIDTHS[:2]:
        q, k, v = _inputs(dqk, dv, seed=0)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), pytest.raises(RuntimeError):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_padded_path_saves_no_score_matrix():
    """Linear memory: nothing of [B, N, S, S] is kept for backward, only q, k, v, the output
    (all D = 256 wide) and the fp32 log-sum-exp [B, N, S]."""
    q, k, v = (t.requires_grad_() for t in _inputs(192, 256, seed=1))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                  lambda t: t):
        equal_width_attention(q, k, v, None, 0.1)
    assert max(saved) == BATCH * HEADS * SEQ * 256
    assert sum(saved) == 4 * BATCH * HEADS * SEQ * 256 + BATCH * HEADS * SEQ


def _core(softmax_scale: float | None) -> MLACoreAttention:
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=HEADS)
    return MLACoreAttention(cfg, 1, AttnMaskType.causal, "self", softmax_scale=softmax_scale)


@pytest.mark.parametrize("dqk,dv", WIDTHS)
def test_core_attention_keeps_the_unpadded_default_scale(dqk, dv):
    """MLACoreAttention's [S, B, N, D] interface: without a given scale it uses 1/sqrt(Dqk),
    as SDPA would on the unpadded inputs, not 1/sqrt of the padded width; the megatron mask
    (True = masked out) restricts attention."""
    q, k, v = (t.permute(2, 0, 1, 3) for t in _inputs(dqk, dv, seed=3))
    allowed = _document_allowed(seed=4)
    mcore_compat.install()  # CPU meanings of the CUDA calls the process group setup makes
    with single_process_group():
        default, given = _core(None), _core(0.7)
        out = default(q, k, v, None)
        masked = given(q, k, v, ~allowed)
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                             is_causal=True)
        ref_masked = F.scaled_dot_product_attention(
            *(t.permute(1, 2, 0, 3) for t in (q, k, v)), attn_mask=allowed, scale=0.7)
    for got, want in ((out, ref), (masked, ref_masked)):
        assert got.shape == (SEQ, BATCH, HEADS * dv)
        assert _max_rel(got, want.permute(2, 0, 1, 3).reshape(SEQ, BATCH, -1)) < RTOL
