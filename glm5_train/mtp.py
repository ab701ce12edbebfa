"""Multi-token prediction as GLM-5 trains it: shared-parameter steps, loss masks, placement.

GLM-5 has one MTP layer (HF ``model.layers.78``: ``eh_proj``, ``enorm``, ``hnorm``, a full
attention + DSA + MoE decoder layer and ``shared_head.norm``) and trains it for 3 prediction steps
that share its parameters. megatron-core's ``MultiTokenPredictionLayer`` is one such step; we
build ``num_nextn_predict_layers`` of them (``config.mtp_num_layers``) and apply them cyclically
for ``mtp_num_steps`` steps (``GLM5Model`` in glm5_train.model). Step k (1-based) at position i
predicts token i + k + 1 from the step k - 1 output at i and the embedding of token i + k.

Placement under pipeline parallelism is megatron-core's layout string: ``m`` (one MTP parameter
set) with the loss ``...tmL`` or on the stage before it ``...tm|L`` (GLM-5's split: MTP embedding
and transformer on the preceding stage; its output head and loss stay with the main head). The
MTP stage then holds a copy of the word embedding; ``EmbeddingTie`` keeps the copies equal by
summing their gradients, also when both live on one rank (split at PP=2), which megatron-core's
own embedding group cannot do (it deadlocks at construction and reduces one chunk per rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules, MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules, get_mtp_ranks, mtp_on_this_rank)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import unwrap_model


def chunk_hosts_mtp(config, vp_stage: int | None) -> bool:
    """Whether the model chunk of this rank at ``vp_stage`` builds the MTP layers."""
    if not config.mtp_num_layers:
        return False
    return mtp_on_this_rank(config, ignore_virtual=False, vp_stage=vp_stage)


def mtp_block_spec(layer_spec: ModuleSpec, norm: type, eh_proj: type,
                   num_sets: int) -> MultiTokenPredictionBlockSubmodules:
    """``num_sets`` MTP layers around ``layer_spec`` (a full MoE decoder layer, as released)."""
    layer = ModuleSpec(module=MultiTokenPredictionLayer,
                       submodules=MultiTokenPredictionLayerSubmodules(
                           enorm=norm, hnorm=norm, eh_proj=eh_proj,
                           transformer_layer=layer_spec, layer_norm=norm))
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * num_sets)


def shifted_targets(labels: torch.Tensor, loss_mask: torch.Tensor | None,
                    input_ids: torch.Tensor, step: int,
                    eod_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets and loss mask [B, S] of MTP step ``step`` (1-based).

    Position i predicts ``labels[i + step]`` (token i + step + 1). It counts only when that
    target is inside the sequence, its own loss mask is set, and no end-of-document token lies
    in ``input_ids[i .. i + step]``: the prediction never crosses a packed document boundary.
    """
    b, s = labels.shape
    n = max(0, s - step)
    targets = torch.zeros_like(labels)
    mask = torch.zeros(b, s, dtype=torch.float32, device=labels.device)
    if n == 0:
        return targets, mask
    targets[:, :n] = labels[:, step:]
    keep = torch.ones(b, n, dtype=torch.float32, device=labels.device)
    if loss_mask is not None:
        keep = keep * loss_mask[:, step:].float()
    if eod_token_id is not None:
        # eods_before[j] = end-of-document tokens among input_ids[0 .. j-1].
        is_eod = (input_ids == eod_token_id).to(torch.int32)
        eods_before = F.pad(torch.cumsum(is_eod, dim=1), (1, 0))
        crossing = eods_before[:, step + 1:step + 1 + n] - eods_before[:, :n]
        keep = keep * (crossing == 0).float()
    mask[:, :n] = keep
    return targets, mask


class EmbeddingTie:
    """Sum the gradients of every copy of the word embedding (first stage, MTP stage, and a tied
    output head) so the copies stay equal, whatever ranks and chunks hold them.

    Runs before megatron-core's data-parallel reduction (``finalize``): the gradient buffers then
    hold whole local gradients, so the sum is right with the distributed optimizer too, whose
    reduce-scatter leaves each buffer valid only on its own shard.
    """

    def __init__(self, config, tie_word_embeddings: bool):
        self.tie_word_embeddings = tie_word_embeddings
        self.group = _holder_group(config, tie_word_embeddings)

    def holders(self, chunks: list) -> list[torch.nn.Parameter]:
        """This rank's copies: one per chunk that holds the embedding (or a tied head)."""
        copies = []
        for chunk in chunks:
            model = unwrap_model(chunk)
            mtp = getattr(model, "mtp_process", False)
            if model.pre_process or mtp or (model.post_process and self.tie_word_embeddings):
                copies.append(model.shared_embedding_or_output_weight())
        return [p for p in copies if p is not None and p.requires_grad]

    def needs_sync(self, chunks: list) -> bool:
        """Whether this rank has copies to sum (several, or one shared with other ranks)."""
        return self._needs_sync(self.holders(chunks))

    def _needs_sync(self, copies: list) -> bool:
        return bool(copies) and (len(copies) > 1 or self._group_size() > 1)

    def _group_size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    def sync(self, chunks: list) -> None:
        copies = self.holders(chunks)
        if not self._needs_sync(copies):
            return
        group_size = self._group_size()
        grads = [_grad_of(p) for p in copies]
        total = torch.stack(grads).sum(dim=0) if len(grads) > 1 else grads[0].clone()
        if group_size > 1:
            dist.all_reduce(total, group=self.group)
        for grad in grads:
            grad.copy_(total)


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


def _holder_group(config, tie_word_embeddings: bool):
    """A process group over the pipeline ranks holding an embedding copy (this rank's), None
    when its copies all sit on this rank (or there is one copy).

    Every rank must create every group in the same order: gather all pipeline groups first.
    Only groups of two or more ranks are created (``new_group`` is a collective on NCCL)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return None
    if not config.mtp_num_layers and not tie_word_embeddings:
        return None  # one copy: the first stage's
    own = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, own)
    mine = None
    for pp_ranks in sorted({tuple(r) for r in everyone}):
        holders = {pp_ranks[0], *get_mtp_ranks(list(pp_ranks), config)}
        if tie_word_embeddings:
            holders.add(pp_ranks[-1])
        if len(holders) < 2:
            continue
        group = dist.new_group(sorted(holders))
        if dist.get_rank() in holders:
            mine = group
    return mine
