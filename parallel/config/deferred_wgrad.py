"""Deferred weight gradients' key and rules (the technique: parallel/deferred_wgrad.py)."""

from __future__ import annotations

from dataclasses import dataclass

from parallel.layout_error import LayoutError


@dataclass
class DeferredWgradOptions:
    """``parallel.*`` key of deferred weight gradients (part of ParallelConfig)."""

    # Linear layers' weight-gradient GEMMs leave the backward and run inside the pipeline p2p
    # waits, so a stage's input gradient reaches the stage before it sooner. Needs PP > 1.
    defer_weight_grads: bool = False


def check_deferred_wgrad(par) -> None:
    """Deferred weight gradients against the pipeline and DDP options of ``par``."""
    if not par.defer_weight_grads:
        return
    if par.pipeline_model_parallel_size == 1:
        raise LayoutError(
            "parallel.defer_weight_grads=true with pipeline_model_parallel_size=1: deferred "
            "weight gradients fill pipeline waits, and without a pipeline there are none; set "
            "pipeline_model_parallel_size > 1 or parallel.defer_weight_grads=false")
    if par.overlap_grad_reduce:
        raise LayoutError(
            "parallel.defer_weight_grads=true with parallel.overlap_grad_reduce=true: "
            "megatron-core's overlapped reduction starts a bucket when autograd hands it every "
            "weight gradient, and deferred ones arrive later, outside autograd; set "
            "parallel.overlap_grad_reduce=false")
