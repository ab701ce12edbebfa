"""Deferred weight gradients (GLM-5 report sec. 2.4, in the style of Zero Bubble's ZB-H1) for
megatron-core's pipeline schedules.

A linear layer's backward is two GEMMs: B, the input gradient, which the previous pipeline
stage waits for, and W, the weight gradient, which nothing reads before the step ends. Here B
runs in the backward as usual and W is queued (``WeightGradQueue``). The queue runs:

- inside every pipeline p2p exchange, after this rank's sends are posted and before it waits
  for its receives (``WgradFillingP2P``): the gradient a stage sends upstream no longer waits
  for that stage's W GEMMs, and the W GEMMs fill the time the rank would spend waiting;
- before anything reads gradients: megatron-core's gradient finalisation (``drain_first``) and
  Pipeline ZeRO2's reduce-scatter of a finished chunk (its ``before_launch``).

In the 1F1B cool-down the backward chain from the last stage to the first then costs F + B per
stage instead of F + B + W, which is ZB-H1's bubble reduction, with megatron-core's own
(interleaved) 1F1B order of forwards and backwards left as it is.

Gradients: the same GEMMs on the same tensors, accumulated into ``main_grad`` as megatron-core's
DDP hook does, so a weight used once per micro-batch gets bit-identical gradients. A weight used
several times in one backward (MTP's shared layer) is accumulated term by term instead of
summed by autograd first: equal up to fp32 rounding order.

Memory: a queued W holds its layer's input (this rank's sequence shard under sequence
parallelism: the all-gather moves into W) and its output gradient until it runs, at most one
backward step's worth (one micro-batch of one chunk) between two p2p exchanges.
``WeightGradQueue.peak_bytes`` counts those bytes exactly.

Covered: megatron-core's ``ColumnParallelLinear`` / ``RowParallelLinear`` (attention
projections, dense, shared and routed expert MLPs with megatron-core's SequentialMLP) and any
module taking its GEMM from ``linear_impl`` or a ``torch.nn.Linear`` (the DSA indexer, MLA's
replicated down projections). A megatron-core layer's ``weight_transform`` (INT4 QAT's
quantised weight, parallel/int4_qat.py; installed first) is what both GEMMs multiply with; W
still accumulates into the parameter's gradient (straight through). Not covered: Transformer
Engine layers (``install`` refuses them), the output head under the chunked loss, the MoE
router and the word embedding.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from parallel import mcore_compat
from parallel.comm_purpose import collective_purpose


@dataclass
class WeightGradQueue:
    """The W GEMMs of this rank's backward passes not run yet, first in first out, with the
    step's counts: queued, run inside a p2p exchange, and the most bytes held at once."""

    pending: deque = field(default_factory=deque)
    held_bytes: int = 0
    peak_bytes: int = 0
    deferred: int = 0  # W GEMMs queued this step
    run_in_p2p: int = 0  # of them, run while a p2p exchange was in flight
    seconds: float = 0.0  # time spent running W GEMMs this step

    def push(self, work: Callable[[], None], tensors: tuple[torch.Tensor, ...]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors)
        self.pending.append((work, size))
        self.held_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self.deferred += 1

    def run(self, in_p2p: bool = False) -> None:
        """Run every queued W GEMM, oldest first."""
        started = time.perf_counter()
        while self.pending:
            work, size = self.pending.popleft()
            work()
            self.held_bytes -= size
            self.run_in_p2p += int(in_p2p)
        self.seconds += time.perf_counter() - started

    def begin_step(self) -> None:
        if self.pending:
            raise RuntimeError(f"{len(self.pending)} weight-gradient GEMMs of the previous step "
                               "never ran: a schedule ended without finalising gradients")
        self.held_bytes = self.peak_bytes = self.deferred = self.run_in_p2p = 0
        self.seconds = 0.0

    def figures(self) -> list[int]:
        """This step's per-rank figures, in ``FIGURE_NAMES`` order (integers, for gathering)."""
        return [self.deferred, self.run_in_p2p, self.peak_bytes, round(self.seconds * 1e6)]


FIGURE_NAMES = ("wgrad_deferred", "wgrad_run_in_p2p", "wgrad_queue_peak_bytes", "wgrad_us")


# ---- the deferred GEMM ----------------------------------------------------------------------


def _gather_sequence(shard: torch.Tensor, group) -> torch.Tensor:
    """The sequence-parallel shards of ``group``, concatenated along dim 0."""
    out = torch.empty((shard.shape[0] * dist.get_world_size(group), *shard.shape[1:]),
                      dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(out, shard.contiguous(), group=group)
    return out


@torch.no_grad()  # it runs outside autograd's backward, where grad mode is on
@collective_purpose("wgrad_input_all_gather")
def _accumulate_weight_grad(weight: torch.Tensor, inputs: torch.Tensor,
                            grad_output: torch.Tensor, sequence_group) -> None:
    """W: the weight gradient of ``out = inputs @ weight.T``, added where megatron-core's DDP
    hook adds it (``main_grad``; ``.grad`` for a weight outside DDP)."""
    total = inputs if sequence_group is None else _gather_sequence(inputs, sequence_group)
    grad_2d = grad_output.contiguous().view(-1, grad_output.shape[-1])
    grad = grad_2d.t().matmul(total.reshape(-1, total.shape[-1]))
    if hasattr(weight, "main_grad"):
        weight.main_grad.add_(grad)
    elif weight.grad is None:
        weight.grad = grad
    else:
        weight.grad.add_(grad)


class DeferredLinear(torch.autograd.Function):
    """``inputs @ weight.T (+ bias)`` with megatron-core's tensor-parallel variants: input
    gathered over ``tp_group`` along the sequence (``sequence_parallel``; its gradient reduce-
    scattered back) or its gradient all-reduced (``allreduce_dgrad``). Backward computes B and
    the bias gradient, and queues W."""

    @staticmethod
    def forward(ctx, inputs, weight, bias, allreduce_dgrad: bool, sequence_parallel: bool,
                tp_group, queue: WeightGradQueue, transform: Callable | None = None):
        ctx.save_for_backward(inputs)
        # The parameter itself, not a saved copy: saved tensors come back through the
        # saved-tensor hooks (accounting, offloading) as other objects, without ``main_grad``.
        ctx.weight, ctx.transform = weight, transform
        ctx.use_bias, ctx.queue, ctx.tp_group = bias is not None, queue, tp_group
        ctx.allreduce_dgrad, ctx.sequence_parallel = allreduce_dgrad, sequence_parallel
        total = _gather_sequence(inputs, tp_group) if sequence_parallel else inputs
        out = torch.matmul(total, _gemm_weight(weight, transform).t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_output):
        (inputs,), weight = ctx.saved_tensors, ctx.weight
        grad_input, handle = grad_output.matmul(_gemm_weight(weight, ctx.transform)), None
        if ctx.sequence_parallel:
            shard = torch.empty(inputs.shape, dtype=grad_input.dtype, device=grad_input.device)
            handle = dist.reduce_scatter_tensor(shard, grad_input.contiguous(),
                                                group=ctx.tp_group, async_op=True)
            grad_input = shard
        elif ctx.allreduce_dgrad:
            handle = dist.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        grad_bias = (grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
                     if ctx.use_bias else None)
        ctx.queue.push(partial(_accumulate_weight_grad, weight, inputs, grad_output,
                               ctx.tp_group if ctx.sequence_parallel else None),
                       (inputs, grad_output))
        if handle is not None:
            handle.wait()
        return grad_input, None, grad_bias, None, None, None, None, None


def _gemm_weight(weight: torch.Tensor, transform: Callable | None) -> torch.Tensor:
    """The weight the GEMMs multiply with: the layer's ``weight_transform`` of the parameter
    (INT4 QAT's quantised copy; its gradient goes straight to the parameter) or itself."""
    return weight if transform is None else transform()


def _megatron_linear_impl(queue: WeightGradQueue, original, transform, input, weight,
                          bias=None,
                          gradient_accumulation_fusion=False, allreduce_dgrad=False,
                          sequence_parallel=False, grad_output_buffer=None,
                          wgrad_deferral_limit=None, tp_group=None, **newer):
    """A replacement for ``ColumnParallelLinear._forward_impl`` / ``RowParallelLinear``'s
    (megatron-core's ``linear_with_grad_accumulation_and_async_allreduce`` arguments; ``newer``:
    those later releases add, 0.19's ``gtp_remat_size``, 1 unless its weight sharding is on)."""
    if not weight.requires_grad or grad_output_buffer is not None:
        # frozen weights, and megatron's own deferred embedding wgrad: megatron-core's path
        return original(input=input, weight=weight, bias=bias,
                        gradient_accumulation_fusion=gradient_accumulation_fusion,
                        allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                        grad_output_buffer=grad_output_buffer,
                        wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group, **newer)
    unsupported = {k: v for k, v in newer.items() if not (k == "gtp_remat_size" and v == 1)}
    if unsupported:
        raise ValueError(f"parallel.defer_weight_grads=true: megatron-core passes {unsupported} "
                         "to this layer's GEMM, which the deferred GEMM does not implement "
                         "(GTP weight sharding): set parallel.defer_weight_grads=false")
    return DeferredLinear.apply(input, weight, bias, allreduce_dgrad, sequence_parallel,
                                tp_group, queue, transform)


def _plain_linear(queue: WeightGradQueue, inputs: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` with W deferred (replicated weights: no TP exchange)."""
    if not weight.requires_grad or not torch.is_grad_enabled():
        return torch.nn.functional.linear(inputs, weight, bias)
    return DeferredLinear.apply(inputs, weight, bias, False, False, None, queue)


def _nn_linear_forward(module: torch.nn.Linear, queue: WeightGradQueue,
                       inputs: torch.Tensor) -> torch.Tensor:
    return _plain_linear(queue, inputs, module.weight, module.bias)


# ---- installation ---------------------------------------------------------------------------


def install(modules: list[torch.nn.Module], queue: WeightGradQueue) -> int:
    """Defer W for every covered linear layer under ``modules`` (per-instance overrides, no
    global patch); returns how many layers were switched. Raises ValueError, before any step,
    on Transformer Engine layers (their GEMMs are TE's own)."""
    switched, refused = 0, []
    for root in modules:
        for name, module in root.named_modules():
            if mcore_compat.is_transformer_engine(module) and any(
                    p.requires_grad for p in module.parameters(recurse=False)):
                refused.append(f"{name} ({type(module).__name__})")
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                mcore_compat.override_method(module, "_forward_impl", partial(
                    _megatron_linear_impl, queue, module._forward_impl,
                    getattr(module, "weight_transform", None)))
                switched += 1
            elif hasattr(module, "linear_impl"):
                module.linear_impl = partial(_plain_linear, queue)
                switched += 1
            elif isinstance(module, torch.nn.Linear):
                module.forward = partial(_nn_linear_forward, module, queue)
                switched += 1
    if refused:
        raise ValueError(
            "parallel.defer_weight_grads=true covers megatron-core's local linear layers, and "
            f"this model has {len(refused)} Transformer Engine layers with trainable weights "
            f"(first: {refused[0]}), whose weight gradients Transformer Engine computes itself: "
            "set parallel.defer_weight_grads=false, or build the model without Transformer "
            "Engine")
    return switched


# ---- where the queue runs -------------------------------------------------------------------


class WgradFillingP2P(P2PCommunicator):
    """megatron-core's pipeline p2p with the queued W GEMMs run inside each exchange: after
    this rank's sends are posted, before it waits on its receives (an exchange without sends:
    before it posts its receives). Unbatched p2p (megatron-core's batched form waits inside)."""

    def __init__(self, pp_group, config, queue: WeightGradQueue) -> None:
        config = copy.copy(config)  # this communicator's own: the model's stays as it is
        config.batch_p2p_comm = False
        super().__init__(pp_group=pp_group, config=config)
        self.queue = queue

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next,
                     tensor_shape, wait_on_reqs=True):
        exchange = partial(super()._communicate, tensor_send_next=tensor_send_next,
                           tensor_send_prev=tensor_send_prev, recv_prev=recv_prev,
                           recv_next=recv_next, tensor_shape=tensor_shape)
        if not self.queue.pending:
            return exchange(wait_on_reqs=wait_on_reqs)
        if tensor_send_next is None and tensor_send_prev is None:
            self.queue.run(in_p2p=True)
            return exchange(wait_on_reqs=wait_on_reqs)
        recv_prev_tensor, recv_next_tensor, reqs = exchange(wait_on_reqs=False)
        self.queue.run(in_p2p=True)
        if wait_on_reqs and reqs:
            for req in reqs.values() if isinstance(reqs, dict) else reqs:
                req.wait()
            reqs = None
        return recv_prev_tensor, recv_next_tensor, reqs


def drain_first(queue: WeightGradQueue, finalize: Callable) -> Callable:
    """``finalize`` (megatron-core's ``finalize_model_grads_func`` contract) after the queue's
    last W GEMMs have run."""

    def finalize_after_drain(*args, **kwargs):
        queue.run()
        return finalize(*args, **kwargs)

    return finalize_after_drain
