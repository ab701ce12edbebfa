"""The output projection and cross-entropy computed in chunks of tokens: per-token losses of a
vocab-parallel head without ever holding the [tokens, vocab] logits.

megatron-core's head materialises the logits [S, B, V/TP] (``ColumnParallelLinear``) and its
``vocab_parallel_cross_entropy`` keeps their fp32 softmax for backward: at GLM-5's scale
(~200K tokens x 154,880 vocabulary) that is ~125 GB per head. ``_ChunkedVocabParallelCE``
instead computes each chunk's logits, reduces them over the tensor-parallel group to a per-token
log-sum-exp and target logit (as megatron does: max, sum of exponentials, target logit
all-reduced; a label outside this rank's vocabulary slice contributes 0 here) and drops them.
It saves only the head's input (under sequence parallelism this rank's shard: the sequence is
all-gathered in forward and again in backward, as megatron's ColumnParallelLinear does), the
labels and the per-token log-sum-exp; backward recomputes
each chunk's logits, forms (softmax - one-hot) x the upstream per-token gradient (zero for
masked tokens: the loss mask rides on that gradient) and accumulates the input's and the
weight's gradients. The price is one more logits GEMM per chunk (the backward's recompute).

Precision follows megatron-core: logits come out of the GEMM in the input dtype and are raised
to fp32 for the reductions and the softmax; the logits' gradient goes back to the input dtype
for the two backward GEMMs (as autograd casts it before megatron's linear backward). The
weight's gradient is summed over chunks in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from parallel.comm_purpose import collective_purpose


def chunked_vocab_parallel_cross_entropy(hidden_SBH: torch.Tensor, weight_VH: torch.Tensor,
                                         labels_SB: torch.Tensor, chunk_tokens: int,
                                         tp_group: dist.ProcessGroup | None = None,
                                         sequence_parallel: bool = False,
                                         entropy_SB: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token cross-entropy [S, B] (fp32; fp64 for fp64 inputs) of ``hidden_SBH`` through
    the vocab-parallel head ``weight_VH`` [V/TP, H] against ``labels_SB``, ``chunk_tokens``
    tokens (positions x batch) at a time. ``hidden_SBH`` is as ColumnParallelLinear receives
    it: [S/TP, B, H] under sequence parallelism (all-gathered over ``tp_group`` in forward and
    again in backward, only the shard kept; gradient reduce-scattered), else [S, B, H]
    (gradient all-reduced over ``tp_group``). ``tp_group`` None: the whole vocabulary on this
    rank. ``entropy_SB``: a [S, B] tensor (the loss's shape and dtype) that receives each
    token's predictive entropy from the same chunks' logits (a metric, no gradient: one more
    [c, V/TP] temporary per chunk and one more sum in its all-reduce)."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be > 0 (tokens per chunk)")
    sequence_parallel = sequence_parallel and tp_group is not None
    split = dist.get_world_size(tp_group) if sequence_parallel else 1
    s, b, h = hidden_SBH.shape[0] * split, hidden_SBH.shape[1], hidden_SBH.shape[2]
    if labels_SB.shape != (s, b):
        raise ValueError(f"labels of shape {tuple(labels_SB.shape)} must be [S, B] = {(s, b)}, "
                         "the head input's first two dimensions (gathered over SP)")
    # [S/TP, B, H] flattened is a contiguous run of the gathered [S * B] tokens (s-major), so
    # gathering the flattened shards along the first dimension gathers the sequence.
    entropy_T = None if entropy_SB is None else entropy_SB.view(s * b)
    loss_T = _ChunkedVocabParallelCE.apply(hidden_SBH.reshape(-1, h), weight_VH,
                                           labels_SB.reshape(s * b), chunk_tokens, tp_group,
                                           sequence_parallel, entropy_T)
    return loss_T.view(s, b)


class _ChunkedVocabParallelCE(torch.autograd.Function):
    """loss[t] = log sum_v exp(hidden[t] . W[v]) - hidden[t] . W[label[t]], W split over TP.

    Forward keeps per token only the log-sum-exp (fp32), and of the hidden states only what it
    was given (this rank's sequence shard under SP: the full-sequence input is all-gathered in
    forward and again in backward, as ColumnParallelLinear does); nothing of size [T, V]
    survives a chunk. The hidden gradient is this rank's partial (its vocabulary slice), summed
    over TP here: reduce-scattered back to the shard under SP, all-reduced without (the
    backward of megatron's gather / copy-to-region). Every rank runs the same collectives in
    the same order: the gather, two all-reduces per chunk; in backward the gather and the
    gradient's reduction."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, labels_T, chunk_tokens, tp_group, sequence_parallel,
                entropy_T=None):
        vocab_start = _vocab_start(weight_VH.shape[0], tp_group)
        full_TH = _gather_tokens(hidden_TH, tp_group, sequence_parallel)
        loss_T = torch.empty(full_TH.shape[0], dtype=_compute_dtype(full_TH),
                             device=full_TH.device)
        lse_T = torch.empty_like(loss_T)
        for start, end in _chunk_bounds(full_TH.shape[0], chunk_tokens):
            loss_T[start:end], lse_T[start:end], entropy = _chunk_loss(
                full_TH[start:end], weight_VH, labels_T[start:end], vocab_start, tp_group,
                entropy_T is not None)
            if entropy_T is not None:
                entropy_T[start:end] = entropy
        ctx.save_for_backward(hidden_TH, weight_VH, labels_T, lse_T)
        ctx.chunk_tokens, ctx.tp_group, ctx.sequence_parallel = (chunk_tokens, tp_group,
                                                                 sequence_parallel)
        return loss_T

    @staticmethod
    def backward(ctx, grad_loss_T):
        hidden_TH, weight_VH, labels_T, lse_T = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        tp_group, sequence_parallel = ctx.tp_group, ctx.sequence_parallel
        # The gathered copy lives only inside _chunked_grads: freed before the reduction
        # allocates the shard's gradient.
        grad_hidden, grad_weight = _chunked_grads(
            _gather_tokens(hidden_TH, tp_group, sequence_parallel), weight_VH, labels_T, lse_T,
            grad_loss_T.to(lse_T.dtype), ctx.chunk_tokens, tp_group, want_hidden, want_weight)
        if want_hidden:
            grad_hidden = _sum_over_ranks(grad_hidden, tp_group, sequence_parallel)
        if want_weight:
            grad_weight = grad_weight.to(weight_VH.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _chunked_grads(full_TH, weight_VH, labels_T, lse_T, grad_loss_T, chunk_tokens, tp_group,
                   want_hidden: bool, want_weight: bool):
    """(this rank's partial hidden gradient [T, H], its weight slice's gradient in fp32), each
    chunk's logits recomputed; None for what is not wanted."""
    vocab_start = _vocab_start(weight_VH.shape[0], tp_group)
    grad_hidden = torch.empty_like(full_TH) if want_hidden else None
    grad_weight = (torch.zeros(weight_VH.shape, dtype=lse_T.dtype, device=weight_VH.device)
                   if want_weight else None)
    for start, end in _chunk_bounds(full_TH.shape[0], chunk_tokens):
        hidden = full_TH[start:end]
        grad_logits = _chunk_logit_grads(hidden, weight_VH, labels_T[start:end],
                                         lse_T[start:end], grad_loss_T[start:end],
                                         vocab_start).to(hidden.dtype)
        if want_hidden:
            torch.mm(grad_logits, weight_VH, out=grad_hidden[start:end])
        if want_weight:
            _accumulate(grad_weight, grad_logits.t(), hidden)
    return grad_hidden, grad_weight


def _gather_tokens(hidden_TH: torch.Tensor, tp_group: dist.ProcessGroup | None,
                   sequence_parallel: bool) -> torch.Tensor:
    """The full sequence's tokens: all-gathered shards under SP, else the input itself.
    (Inside forward / backward autograd records nothing: megatron's gather just runs.)"""
    if not sequence_parallel:
        return hidden_TH
    return gather_from_sequence_parallel_region(hidden_TH, group=tp_group)


def _sum_over_ranks(grad_TH: torch.Tensor, tp_group: dist.ProcessGroup | None,
                    sequence_parallel: bool) -> torch.Tensor:
    """The hidden gradient summed over the TP ranks' vocabulary slices: reduce-scattered to
    this rank's shard under SP, all-reduced without."""
    if tp_group is None:
        return grad_TH
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(grad_TH, group=tp_group)
    return reduce_from_tensor_model_parallel_region(grad_TH, group=tp_group)


def _chunk_bounds(total: int, chunk: int):
    return ((start, min(start + chunk, total)) for start in range(0, total, chunk))


def _vocab_start(local_vocab: int, tp_group: dist.ProcessGroup | None) -> int:
    """First vocabulary id of this rank's slice (megatron's even split over TP ranks)."""
    return 0 if tp_group is None else dist.get_rank(tp_group) * local_vocab


@collective_purpose("vocab_{op}")
def _all_reduce(tensor: torch.Tensor, op, tp_group: dist.ProcessGroup | None) -> None:
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(tensor, op=op, group=tp_group)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """fp32 for the reductions and softmax (megatron's ``.float()``); fp64 inputs (tests) stay
    fp64."""
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _chunk_logits(hidden: torch.Tensor, weight_VH: torch.Tensor) -> torch.Tensor:
    """[c, V/TP]: the GEMM in the input dtype, then raised to the compute dtype."""
    return torch.mm(hidden, weight_VH.t()).to(_compute_dtype(hidden))


def _local_targets(labels: torch.Tensor, vocab_start: int,
                   local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into this rank's slice, 0 where outside it; whether the label is inside)."""
    local = labels - vocab_start
    inside = (local >= 0) & (local < local_vocab)
    return torch.where(inside, local, torch.zeros_like(local)), inside


def _chunk_loss(hidden, weight_VH, labels, vocab_start, tp_group, with_entropy: bool = False):
    """(loss, log-sum-exp, entropy or None) per token of one chunk, reduced over the
    vocab-parallel group. Entropy = log Z - sum_v p_v z_v, z the max-shifted logits."""
    logits = _chunk_logits(hidden, weight_VH)
    row_max = logits.max(dim=-1).values
    _all_reduce(row_max, dist.ReduceOp.MAX, tp_group)
    logits -= row_max.unsqueeze(-1)
    local, inside = _local_targets(labels, vocab_start, logits.shape[-1])
    target = torch.where(inside, logits.gather(1, local.unsqueeze(-1)).squeeze(-1), 0.0)
    weighted = [(logits * logits.exp()).sum(dim=-1)] if with_entropy else []
    # One all-reduce for all the sums (megatron makes two).
    sums = torch.stack([logits.exp_().sum(dim=-1), target, *weighted])
    _all_reduce(sums, dist.ReduceOp.SUM, tp_group)
    log_sum_exp = sums[0].log()
    entropy = log_sum_exp - sums[2] / sums[0] if with_entropy else None
    return log_sum_exp - sums[1], log_sum_exp + row_max, entropy


def _chunk_logit_grads(hidden, weight_VH, labels, lse, grad_loss, vocab_start):
    """d loss / d logits of one chunk, fp32 [c, V/TP]: (softmax - one-hot) x upstream grad."""
    grad = (_chunk_logits(hidden, weight_VH) - lse.unsqueeze(-1)).exp_()
    local, inside = _local_targets(labels, vocab_start, grad.shape[-1])
    rows = torch.arange(grad.shape[0], device=grad.device)
    grad[rows, local] -= inside.to(grad.dtype)
    return grad.mul_(grad_loss.unsqueeze(-1))


def _accumulate(total_VH: torch.Tensor, grad_logits_VT: torch.Tensor,
                hidden_TH: torch.Tensor) -> None:
    """total += grad_logits^T @ hidden, the sum kept in fp32 (the GEMM in the input dtype)."""
    if hidden_TH.dtype == total_VH.dtype:
        total_VH.addmm_(grad_logits_VT, hidden_TH)
    else:
        total_VH += torch.mm(grad_logits_VT, hidden_TH)
