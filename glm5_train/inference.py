"""Forward-only logits through megatron-core's pipeline schedules, in any layout.

Used to check the model against outside implementations (HF transformers) and by tools.
The returned logits are the full vocabulary (gathered over TP) in fp32.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.utils import is_pp_last_stage
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from parallel.device import comm_device


def _store_logits(tp_group, output_BSV: torch.Tensor):
    # Logits come out [B, S, V/TP] with the vocab split over TP ranks.
    full = gather_from_tensor_model_parallel_region(output_BSV, group=tp_group).float()
    device = output_BSV.device
    return (torch.zeros((), device=device), torch.ones((), dtype=torch.int, device=device),
            {"logits": full.detach()})


def _forward_step(tp_group, data_iterator, model):
    tokens = next(data_iterator).to(comm_device())
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    output = model(tokens, positions, None)
    return output, partial(_store_logits, tp_group)


def compute_logits(chunks: list, tokens_BS: torch.Tensor,
                   groups: ProcessGroupCollection) -> torch.Tensor | None:
    """Logits [B, S, V] on the CPU for ``tokens_BS`` (any device) on last-stage ranks, else
    None.

    Each sequence is one micro-batch (the interleaved schedule needs at least PP of them)."""
    for chunk in chunks:
        chunk.eval()
    samples = list(tokens_BS.split(1))
    iterators = [iter(samples) for _ in chunks]
    schedule = get_forward_backward_func(pp_size=groups.pp.size(),
                                         vp_size=len(chunks) if len(chunks) > 1 else None)
    with torch.no_grad():
        stored = schedule(
            forward_step_func=partial(_forward_step, groups.tp),
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(samples),
            seq_length=tokens_BS.shape[1],
            micro_batch_size=1,
            forward_only=True,
        )
    if not is_pp_last_stage(groups.pp):
        return None
    return torch.cat([item["logits"] for item in stored]).cpu()
