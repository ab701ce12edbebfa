"""Pipeline ZeRO2's keys and rules (the technique: parallel/pipeline_zero2.py)."""

from __future__ import annotations

from dataclasses import dataclass

from parallel.layout_error import LayoutError


@dataclass
class PipelineZero2Options:
    """``parallel.*`` keys of Pipeline ZeRO2 (part of ``parallel.layout.ParallelConfig``)."""

    # Keep 1/dp of each chunk's gradients plus two shared full-size accumulation buffers,
    # instead of every chunk's full gradient buffer. Needs use_distributed_optimizer=true (it
    # steps those slices).
    pipeline_zero2: bool = False


def check_pipeline_zero2(par) -> None:
    """ZeRO2 against the data-parallel options of ``par`` (a ParallelConfig)."""
    if not par.pipeline_zero2:
        return
    if not par.use_distributed_optimizer:
        raise LayoutError(
            "parallel.pipeline_zero2=true with parallel.use_distributed_optimizer=false: ZeRO2 "
            "keeps only each rank's gradient slice, which only the distributed optimizer "
            "steps; set parallel.use_distributed_optimizer=true")
    if par.overlap_grad_reduce:
        raise LayoutError(
            "parallel.pipeline_zero2=true with parallel.overlap_grad_reduce=true: ZeRO2 runs "
            "its own reduce-scatters, overlapped with the next chunk's backward; set "
            "parallel.overlap_grad_reduce=false")
