"""One forward/backward step through megatron-core's pipeline schedules, and its loss.

The loss is a per-token sum: each micro-batch returns (sum of token losses, token count) and
megatron-core divides gradients by the global token count in ``finalize_model_grads``. That makes
the loss and gradients of a global batch independent of how it is split over data-parallel ranks
and micro-batches (a per-micro-batch mean would weigh micro-batches with fewer loss tokens more).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config, unwrap_model

from glm5_train.profiling import ScheduleLabels, backward_range, labelled_forward, profiling_now
from glm5_train.rl.objective import ROLLOUT_FIELDS, RLObjective
from parallel.activation_offload import ActivationTracker
from parallel.comm_purpose import collective_purpose
from parallel.context_parallel import group_size, shard_sequence
from parallel.deferred_wgrad import WeightGradQueue, WgradFillingP2P
from parallel.device import comm_device
from parallel.flexible_cp import in_group_for_backward, switch_context_group


def loss_func(loss_mask: torch.Tensor, take_mtp_report, output_tensor: torch.Tensor):
    """Per-token loss sum over unmasked tokens. ``output_tensor`` [B, S] token losses.
    The MTP losses (already in the backward graph) are only reported: [steps, 2] sums."""
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(output_tensor.reshape(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    reports = {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}
    mtp = take_mtp_report() if take_mtp_report is not None else None
    if mtp is not None:
        reports["mtp loss"] = mtp
    return loss_sum, num_tokens, reports


def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module,
                 activations: ActivationTracker | None = None, cp_group=None,
                 labels: ScheduleLabels | None = None, objective: RLObjective | None = None):
    """megatron-core forward_step_func: every chunk reads its own aligned iterator. Batches
    come from the data loader on the CPU and move to this rank's device here (a no-op on CPU).
    ``activations``: the model's forward runs inside its saved-tensor meter (and offloader).
    ``cp_group``: every rank of a context-parallel group reads the same whole sequences and
    keeps its zigzag share of them (``parallel.context_parallel``). A micro-batch that brings
    its own ``cp_group`` (flexible CP groups, ``glm5_train/flexible_batches.py``) runs on that
    group, with its ``cp_exchange`` (head-parallel; absent: all-gather): the model is pointed
    at them for this forward and again when its backward starts;
    its ``cpu_clock`` (the online refit of the plan's workload model) times both.
    ``labels``: while torch.profiler records, name the forward and backward ranges by chunk
    and micro-batch (``glm5_train/profiling.py``). ``objective``: an RL objective replaces the
    LM loss over the model's per-token losses (-log-probs; ``glm5_train/rl/objective.py``)."""
    batch = next(data_iterator)
    # Flexible CP refit: this micro-batch's CPU seconds, over every chunk that reads it.
    clock = batch.get("cpu_clock")
    if clock is not None:
        clock.start()
    batch = packed_documents(to_device(batch))
    batch.pop("cpu_clock", None)
    flexible = "cp_group" in batch
    if flexible:
        cp_group, exchange = batch.pop("cp_group"), batch.pop("cp_exchange", None)
        switch_context_group(model, cp_group, exchange)
    batch = context_parallel_share(batch, cp_group)
    with (labelled_forward(model, labels) as label,
          activations.forward(model) if activations else nullcontext(lambda out: out) as watch):
        output = watch(model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                             labels=batch["labels"], loss_mask=batch["loss_mask"]))
    output = backward_range(output, labels, label)
    if flexible:
        output = in_group_for_backward(output, model, cp_group, exchange)
    if clock is not None:  # the backward is timed from its first gradient to its end
        clock.stop()
        output = clock.time_backward(output)
    inner = unwrap_model(model)
    take_mtp = getattr(inner, "take_mtp_report", None)
    if objective is not None:
        fields = {name: batch[name] for name in ROLLOUT_FIELDS}
        return output, partial(objective.loss_func, batch["loss_mask"], fields, take_mtp,
                               getattr(inner, "take_entropy", None))
    return output, partial(loss_func, batch["loss_mask"], take_mtp)


def packed_documents(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Packed documents as per-token document starts [B, S] in the attention-mask slot
    (``glm5_train/model/key_masks.py``: linear in S, shardable over context-parallel ranks),
    from the batch's ``cu_seqlens`` (megatron's THD convention over the flattened [B * S]
    tokens), which both packed sources carry: chat SFT data and packed pretraining documents
    (``data.reset_attention_mask``, ``data.PackedGPTDataset``). A document-causal bool
    [B, 1, S, S] mask that a batch of another source brings is turned into starts as well."""
    bounds = batch.pop("cu_seqlens", None)
    batch.pop("max_seqlen", None)
    mask = batch.get("attention_mask")
    if bounds is not None:
        batch["attention_mask"] = starts_from_cu_seqlens(bounds, *batch["tokens"].shape)
    elif mask is not None and mask.dtype == torch.bool:
        batch["attention_mask"] = starts_from_document_mask(mask)
    return batch


def starts_from_cu_seqlens(bounds: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """[B, S] document starts from boundaries over the flattened tokens (sample ends among
    them, so no document spans two samples)."""
    bounds = bounds.to(torch.long)
    flat = torch.arange(batch * seq, device=bounds.device)
    start = bounds[torch.searchsorted(bounds, flat, right=True) - 1]
    return (start - flat // seq * seq).view(batch, seq)


_MASK_CHECK_ELEMENTS = 1 << 24  # mask elements examined at a time by starts_from_document_mask


def starts_from_document_mask(mask_B1SS: torch.Tensor) -> torch.Tensor:
    """[B, S] document starts of megatron's attention mask (True = masked out), which must be
    document-causal: row t sees exactly the keys from its document start to t. Read a block of
    rows at a time, so that nothing of the mask's size is made beside it."""
    batch, seq = mask_B1SS.shape[0], mask_B1SS.shape[-1]
    keys = torch.arange(seq, device=mask_B1SS.device)
    rows = max(1, _MASK_CHECK_ELEMENTS // max(1, batch * seq))
    starts = []
    for t0 in range(0, seq, rows):
        allowed = ~mask_B1SS[:, 0, t0:t0 + rows]  # [B, rows, S]
        start = allowed.int().argmax(-1)  # first allowed key per row
        query = keys[t0:t0 + rows]
        rebuilt = (keys[None, None, :] >= start[..., None]) & (keys[None, :] <= query[:, None])
        if not torch.equal(rebuilt, allowed):
            raise ValueError("the batch's attention mask is not document-causal (each token "
                             "sees its own document's earlier tokens): only packed-document "
                             "masks are supported; packed documents need no mask: give the "
                             "batch their boundaries (cu_seqlens) instead")
        starts.append(start)
    return torch.cat(starts, dim=1).long()


def context_parallel_share(batch: dict[str, torch.Tensor], cp_group) -> dict[str, torch.Tensor]:
    """This context-parallel rank's zigzag share of every [B, S] tensor of a micro-batch."""
    size = group_size(cp_group)
    if size == 1:
        return batch
    rank = dist.get_rank(cp_group)  # document starts [B, S] shard like the tokens
    return {key: shard_sequence(value, 1, size, rank) if isinstance(value, torch.Tensor)
            else value for key, value in batch.items()}


def to_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of a micro-batch on ``comm_device()`` (the same tensors on CPU)."""
    device = comm_device()
    return {key: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor)
            else value for key, value in batch.items()}


def run_step(chunks: list[torch.nn.Module], iterators: list[Iterator], num_microbatches: int,
             seq_length: int, micro_batch_size: int, groups: ProcessGroupCollection,
             forward_only: bool = False,
             activations: ActivationTracker | None = None,
             wgrad: WeightGradQueue | None = None,
             objective: RLObjective | None = None) -> list[Any]:
    """Run the pipeline schedule for one global batch; returns the last stage's loss reports.
    ``activations``: meter (and offload) every micro-batch's forward (training steps only).
    ``wgrad``: deferred weight gradients, run inside the schedule's p2p exchanges.
    ``objective``: the RL objective each micro-batch's loss applies (None: the LM loss)."""
    schedule = get_forward_backward_func(pp_size=groups.pp.size(),
                                         vp_size=len(chunks) if len(chunks) > 1 else None)
    step = partial(forward_step, cp_group=groups.cp,
                   activations=None if forward_only else activations,
                   labels=ScheduleLabels(chunks) if profiling_now() else None,
                   objective=objective)
    extra = {}
    if wgrad is not None and groups.pp.size() > 1:
        extra = {"p2p_communicator": WgradFillingP2P(groups.pp, get_model_config(chunks[0]),
                                                     wgrad),
                 "pg_collection": groups}
    return schedule(
        forward_step_func=step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        **extra,
    )


def _is_last_stage(groups: ProcessGroupCollection) -> bool:
    return groups.pp.rank() == groups.pp.size() - 1


@collective_purpose("mtp_loss")
def global_mtp_losses(reports: list[dict[str, torch.Tensor]], steps: int,
                      groups: ProcessGroupCollection) -> list[float]:
    """Per-step MTP loss of the global batch (token-weighted, as ``global_loss``)."""
    totals = torch.zeros(steps, 2, dtype=torch.float64, device=comm_device())
    for report in reports:
        if "mtp loss" in report:
            totals += report["mtp loss"].double()
    if not _is_last_stage(groups):
        totals.zero_()
    dist.all_reduce(totals)
    return [float(s / n) if n > 0 else 0.0 for s, n in totals.tolist()]


@collective_purpose("loss")
def global_loss(reports: list[dict[str, torch.Tensor]],
                groups: ProcessGroupCollection) -> tuple[float, int]:
    """Token-weighted loss of the global batch, identical on every rank.

    Only last-stage ranks hold reports. Summing (loss_sum, tokens) over the whole world counts
    each data-parallel partial once per TP replica (context-parallel ranks hold disjoint
    tokens); the ratio is unaffected.
    """
    totals = torch.zeros(2, dtype=torch.float64, device=comm_device())
    for report in reports:
        totals += report["lm loss"].double()
    if not _is_last_stage(groups):
        totals.zero_()
    dist.all_reduce(totals)
    replicas = groups.tp.size()
    return float(totals[0] / totals[1]), int(round(float(totals[1]) / replicas))
