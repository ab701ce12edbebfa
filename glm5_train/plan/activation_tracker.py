"""The running job's side of the activation plan: which modules of a chunk are the layers that
``activations.offload_layers`` names, and the tracker the Runtime owns, which meters saved
bytes and offloads the selected layers on the schedule ``parallel.pipeline_layout.offload_plan``
plans (``parallel.activation_accounting``, ``parallel.activation_offload``). The planner prices
the same offloading (``glm5_train.plan.pipeline.plan_report``); this module applies it."""

from __future__ import annotations

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import unwrap_model

from glm5_train.job_config import JobConfig
from parallel.activation_accounting import SavedTensorMeter
from parallel.activation_offload import ActivationOffloader, ActivationTracker
from parallel.device import comm_device
from parallel.pipeline_layout import PipelineSchedule, offload_plan


def layer_modules(chunk: torch.nn.Module,
                  num_hidden_layers: int) -> list[tuple[int, torch.nn.Module]]:
    """(global layer index, module) of a chunk's decoder layers and MTP layers, the indices
    as ``activations.offload_layers`` names them (MTP layer k: num_hidden_layers + k)."""
    inner = unwrap_model(chunk)
    decoder, mtp = getattr(inner, "decoder", None), getattr(inner, "mtp", None)
    layers = [(layer.layer_number - 1, layer) for layer in decoder.layers] if decoder else []
    if mtp is not None:  # megatron-core numbers MTP layers from 1
        layers += [(num_hidden_layers + layer.layer_number - 1, layer) for layer in mtp.layers]
    return layers


def build_activation_tracker(job: JobConfig, chunks: list, groups: ProcessGroupCollection,
                             num_microbatches: int) -> ActivationTracker:
    """The meter always (metrics: saved bytes per rank); the offloader when
    ``activations.offload_micro_batches`` > 0, on this rank's selected layers."""
    meter = SavedTensorMeter()
    acts, par = job.activations, job.parallel
    if not acts.offload_micro_batches:
        return ActivationTracker(chunks, meter)
    schedule = PipelineSchedule(groups.pp.size(), par.virtual_pipeline_model_parallel_size,
                                num_microbatches, par.microbatch_group_size_per_vp_stage)
    plan = offload_plan(schedule, groups.pp.rank(), acts.offload_micro_batches)
    offloader = ActivationOffloader(meter, plan, comm_device())
    for chunk in chunks:
        for index, module in layer_modules(chunk, job.model.num_hidden_layers):
            if acts.offloads_layer(index):
                offloader.attach(module)
    return ActivationTracker(chunks, meter, offloader)
