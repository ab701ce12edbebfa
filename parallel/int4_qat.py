"""INT4 quantisation-aware training (GLM-5 report sec. 2.4, item 9): weight-only, symmetric,
group-wise INT4 fake quantisation of chosen linear layers, with one quantiser shared by
training and offline export, so the INT4 weights a server loads are bit for bit the ones the
training forward multiplied with.

The format (that of compressed-tensors' ``pack-quantized`` W4A16, which vLLM and SGLang load):
a weight ``[out, in]`` is cut along ``in`` into groups of ``group_size``; each (row, group) has
one scale, ``amax / 7`` rounded to bfloat16 (the stored dtype); its values are
``round(w / scale)`` (half to even) clamped to [-8, 7]; the dequantised weight is ``q * scale``.
``pack`` stores eight values per int32 (value + 8 in four bits, first value lowest), along
``in``. A group whose values are all zero gets scale 1 (its values are 0 either way).

Training: the forward multiplies with the dequantised weight, the backward hands the gradient
straight to the full-precision weight (straight-through estimator), so the optimizer keeps
updating full-precision weights while the loss sees their INT4 rounding. The dequantised
weights are computed once per step per layer (``Int4QAT.begin_step`` marks them stale; the
first forward of the step recomputes them after the optimizer's update and any parameter
all-gather) into a non-persistent buffer of the layer: one extra copy of the quantised
layers' weights per rank in the weights' dtype, shared by every micro-batch and recompute,
saved for backward by reference (no per-micro-batch copy) and not in checkpoints.

Tensor parallelism: a group never straddles two ranks' shards (the caller checks that each
shard's input width is a multiple of ``group_size``), so the quantised shard is the shard of
the quantised whole weight: every layout trains on the same INT4 weights as one process.

Covered: megatron-core's local ``ColumnParallelLinear`` / ``RowParallelLinear`` (per-instance
``_forward_impl`` overrides, through the compatibility registry). A layer's
``weight_transform`` attribute tells other techniques replacing its GEMM (deferred weight
gradients) to multiply with the quantised weight too. Not covered: Transformer Engine layers
(``install`` refuses them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from parallel import mcore_compat

QMIN, QMAX = -8, 7
SCALE_DTYPE = torch.bfloat16
VALUES_PER_INT32 = 8
BUFFER_NAME = "int4_qat_weight"


# ---- the quantiser (shared by training and export) ------------------------------------------


def check_group_size(group_size: int, name: str = "INT4 group size") -> None:
    if group_size < VALUES_PER_INT32 or group_size % VALUES_PER_INT32:
        raise ValueError(f"{name}={group_size}: it must be a positive multiple of "
                         f"{VALUES_PER_INT32} (eight values pack into one int32), e.g. 32")


def quantize(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values int8 [out, in] in [-8, 7], scales bfloat16 [out, in / group_size]) of a 2-D
    weight; deterministic, elementwise after the per-group absolute maximum."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"INT4 quantisation of a [{out_features}, {in_features}] weight: its "
                         f"input width is not a multiple of the group size {group_size}")
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    scale = (groups.abs().amax(dim=-1) / QMAX).to(SCALE_DTYPE)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    values = torch.round(groups / scale.float().unsqueeze(-1)).clamp_(QMIN, QMAX)
    return values.to(torch.int8).reshape(out_features, in_features), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values * scale`` per group, in ``dtype`` (the product is exact in fp32: 4 x 8 bits)."""
    out_features, in_features = values.shape
    group_size = in_features // scale.shape[1]
    groups = values.float().reshape(out_features, scale.shape[1], group_size)
    return (groups * scale.float().unsqueeze(-1)).reshape(out_features, in_features).to(dtype)


def fake_quantize(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """The weight training multiplies with: dequantised INT4, in the weight's dtype."""
    return dequantize(*quantize(weight, group_size), weight.dtype)


def pack(values: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [out, in] -> int32 [out, in / 8], eight 4-bit values each
    (value + 8), the first in the lowest bits."""
    out_features, in_features = values.shape
    if in_features % VALUES_PER_INT32:
        raise ValueError(f"packing [{out_features}, {in_features}] INT4 values: the width is "
                         f"not a multiple of {VALUES_PER_INT32}")
    nibbles = (values.to(torch.int32) - QMIN).reshape(out_features, -1, VALUES_PER_INT32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    # int32 arithmetic wraps on the top nibble as the packed bit pattern requires
    return (nibbles << shifts).sum(dim=-1, dtype=torch.int32)


def unpack(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The inverse of ``pack``: int8 values [out, in_features]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.reshape(packed.shape[0], -1)[:, :in_features] + QMIN).to(torch.int8)


# ---- training -------------------------------------------------------------------------------


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantised weight; backward: its gradient goes to the full-precision one."""

    @staticmethod
    def forward(ctx, weight, quantized):
        return quantized.view_as(quantized)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@dataclass
class Int4QAT:
    """The quantised layers of this rank and the step's figures."""

    group_size: int
    layers: list = field(default_factory=list)
    step: int = 0
    _fresh: dict = field(default_factory=dict)  # id(layer) -> step its buffer was computed
    refreshed: int = 0  # layers requantised this step
    # this step's sums of squared (quantised - weight) and of squared weights, kept on the
    # device (no host sync per layer) until ``figures`` reads them
    error_sq: list = field(default_factory=list)
    norm_sq: list = field(default_factory=list)

    def begin_step(self) -> None:
        """The weights may have changed: every layer requantises at its next forward."""
        self.step += 1
        self.refreshed, self.error_sq, self.norm_sq = 0, [], []

    def quantized_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """The layer's dequantised INT4 weight for this step (computed at its first use)."""
        buffer = getattr(layer, BUFFER_NAME)
        if self._fresh.get(id(layer)) != self.step:
            with torch.no_grad():
                weight = layer.weight.detach().float()  # once, for the quantiser and the error
                buffer.copy_(dequantize(*quantize(weight, self.group_size), buffer.dtype))
                self.error_sq.append((buffer.float() - weight).square().sum())
                self.norm_sq.append(weight.square().sum())
            self._fresh[id(layer)] = self.step
            self.refreshed += 1
        return buffer

    def buffer_bytes(self) -> int:
        buffers = (getattr(layer, BUFFER_NAME) for layer in self.layers)
        return sum(b.numel() * b.element_size() for b in buffers)

    def figures(self) -> list[int]:
        """This step's per-rank figures in ``FIGURE_NAMES`` order (integers, for gathering):
        layers requantised, the buffers' bytes, and the relative quantisation error
        ||q(W) - W|| / ||W|| over them in parts per million."""
        norm_sq = float(sum(self.norm_sq)) if self.norm_sq else 0.0
        error = (float(sum(self.error_sq)) / norm_sq) ** 0.5 if norm_sq else 0.0
        return [self.refreshed, self.buffer_bytes(), round(error * 1e6)]


FIGURE_NAMES = ("int4_qat_layers", "int4_qat_buffer_bytes", "int4_qat_error_ppm")


def _quantized_impl(qat: Int4QAT, layer, original, input, weight, bias=None,
                    gradient_accumulation_fusion=False, **kwargs):
    """``_forward_impl`` of a quantised layer: megatron-core's GEMM on the INT4 weight. The
    gradient reaches the parameter through autograd (megatron-core's fused accumulation
    writes into the GEMM weight's ``main_grad``, which the quantised copy has not)."""
    if weight is layer.weight:
        weight = _StraightThrough.apply(weight, qat.quantized_weight(layer))
        gradient_accumulation_fusion = False
    return original(input=input, weight=weight, bias=bias,
                    gradient_accumulation_fusion=gradient_accumulation_fusion, **kwargs)


def install(layers: list[torch.nn.Module], group_size: int) -> Int4QAT:
    """Fake-quantise ``layers`` (megatron-core local linear layers) in every forward from now
    on. Raises ValueError before any step on a layer it cannot quantise."""
    check_group_size(group_size)
    qat = Int4QAT(group_size)
    for layer in layers:
        if mcore_compat.is_transformer_engine(layer):
            raise ValueError(
                f"INT4 QAT covers megatron-core's local linear layers, not Transformer Engine's "
                f"({type(layer).__name__}), whose forward reads its weight itself: build the "
                "model without Transformer Engine, or turn INT4 QAT off")
        if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            raise TypeError(f"INT4 QAT: {type(layer).__name__} is not a megatron-core "
                             "ColumnParallelLinear / RowParallelLinear")
        if layer.weight.shape[1] % group_size:
            raise ValueError(
                f"INT4 QAT with group size {group_size}: a [{layer.weight.shape[0]}, "
                f"{layer.weight.shape[1]}] weight shard's input width is not a multiple of it "
                "(groups would straddle tensor-parallel shards); pick a group size dividing "
                "every quantised layer's per-rank input width")
        layer.register_buffer(BUFFER_NAME, torch.empty_like(layer.weight, requires_grad=False),
                              persistent=False)
        layer.weight_transform = partial(qat.quantized_weight, layer)
        mcore_compat.override_method(layer, "_forward_impl", partial(
            _quantized_impl, qat, layer, layer._forward_impl))
        qat.layers.append(layer)
    return qat
