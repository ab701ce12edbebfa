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
MTP stage then holds a copy of the word embedding; ``parallel.embedding_tie.EmbeddingTie`` keeps
the copies equal by summing their gradients.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.nn.functional as F
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
    mtp_on_this_rank,
)
from megatron.core.transformer.spec_utils import ModuleSpec

# The names megatron-core gives the decoder layer inside an MTP layer: ``transformer_layer`` up
# to 0.16, ``mtp_model_layer`` from 0.17 (spec field and submodule alike). The project's
# tensor names (checkpoints, initial weights by name, the Hugging Face mapping) keep 0.16's.
LAYER_NAME = "transformer_layer"
_SPEC_FIELD = next(f.name for f in dataclasses.fields(MultiTokenPredictionLayerSubmodules)
                   if f.name in ("transformer_layer", "mtp_model_layer"))
# 0.16 passes the config; 0.18 and later the pipeline layout and the MTP layer count.
_PLACEMENT_TAKES_LAYOUT = "layout" in inspect.signature(mtp_on_this_rank).parameters


def chunk_hosts_mtp(config, vp_stage: int | None) -> bool:
    """Whether the model chunk of this rank at ``vp_stage`` builds the MTP layers."""
    if not config.mtp_num_layers:
        return False
    if _PLACEMENT_TAKES_LAYOUT:
        return mtp_on_this_rank(config.pipeline_model_parallel_layout, config.mtp_num_layers,
                                ignore_virtual=False, vp_stage=vp_stage)
    return mtp_on_this_rank(config, ignore_virtual=False, vp_stage=vp_stage)


class GLM5MTPLayer(MultiTokenPredictionLayer):
    """megatron-core's MTP layer, its decoder layer registered as ``transformer_layer`` on every
    release (0.17+ name it ``mtp_model_layer``; the property keeps their forward working), so
    that parameter names, checkpoints and the HF mapping are the same whichever runs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "mtp_model_layer" in self._modules:  # renamed in place: the parameter order stays
            self._modules = {(LAYER_NAME if k == "mtp_model_layer" else k): v
                             for k, v in self._modules.items()}

    @property
    def mtp_model_layer(self):
        return self._modules.get(LAYER_NAME) or self._modules["mtp_model_layer"]


def mtp_block_spec(layer_spec: ModuleSpec, norm: type, eh_proj: type,
                   num_sets: int) -> MultiTokenPredictionBlockSubmodules:
    """``num_sets`` MTP layers around ``layer_spec`` (a full MoE decoder layer, as released)."""
    layer = ModuleSpec(module=GLM5MTPLayer,
                       submodules=MultiTokenPredictionLayerSubmodules(
                           enorm=norm, hnorm=norm, eh_proj=eh_proj, layer_norm=norm,
                           **{_SPEC_FIELD: layer_spec}))
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * num_sets)


def shifted_targets(labels: torch.Tensor, loss_mask: torch.Tensor | None,
                    input_ids: torch.Tensor, step: int, eod_token_id: int | None,
                    doc_start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets and loss mask [B, S] of MTP step ``step`` (1-based).

    Position i predicts ``labels[i + step]`` (token i + step + 1). It counts only when that
    target is inside the sequence, its own loss mask is set, no end-of-document token lies
    in ``input_ids[i .. i + step]`` and, given packed documents' starts ``doc_start`` [B, S],
    position i + step is in i's document: the prediction never crosses a document boundary.
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
    if doc_start is not None:
        keep = keep * (doc_start[:, step:] == doc_start[:, :n]).float()
    mask[:, :n] = keep
    return targets, mask
