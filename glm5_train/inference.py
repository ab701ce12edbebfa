"""Forward-only logits through megatron-core's pipeline schedules, in any layout.

Used to check the model against outside implementations (HF transformers) and by tools.
The returned logits are the full vocabulary (gathered over TP) in fp32; ``compute_head_logits``
adds the MTP steps' logits (the drafts of speculative decoding).
"""

from __future__ import annotations

from contextlib import contextmanager
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


def compute_logits(chunks: list, tokens_BS: torch.Tensor, groups: ProcessGroupCollection,
                   micro_batch_size: int = 1) -> torch.Tensor | None:
    """Logits [B, S, V] on the CPU for ``tokens_BS`` (any device) on last-stage ranks, else
    None.

    Micro-batches of ``micro_batch_size`` sequences (the interleaved schedule needs at least PP
    of them; B a multiple of it)."""
    for chunk in chunks:
        chunk.eval()
    samples = list(tokens_BS.split(micro_batch_size))
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
            micro_batch_size=micro_batch_size,
            forward_only=True,
        )
    if not is_pp_last_stage(groups.pp):
        return None
    return torch.cat([item["logits"] for item in stored]).cpu()


def compute_head_logits(chunks: list, tokens_BS: torch.Tensor, groups: ProcessGroupCollection,
                        micro_batch_size: int = 1) -> torch.Tensor | None:
    """Logits [B, 1 + K, S, V] on the CPU on last-stage ranks (else None): head 0 is the main
    model (position i predicts token i + 1), head k the k-th of the model's K MTP steps
    (position i predicts token i + k + 1 from step k - 1's hidden state at i and the embedding
    of token i + k, as in training)."""
    with _mtp_logits_emitted(chunks):
        return compute_logits(chunks, tokens_BS, groups, micro_batch_size)


@contextmanager
def _mtp_logits_emitted(chunks: list):
    for chunk in chunks:
        chunk.emit_mtp_logits = True
    try:
        yield
    finally:
        for chunk in chunks:
            chunk.emit_mtp_logits = False
