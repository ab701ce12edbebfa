"""Optimizer state in host memory: keys and rules (the technique: parallel/host_optimizer.py)."""

from __future__ import annotations

from dataclasses import dataclass

from parallel.layout_error import LayoutError


@dataclass
class HostOptimizerOptions:
    """``parallel.*`` keys of optimizer state in host memory (part of ParallelConfig)."""

    # The first optimizer_offload_fraction of the parameter elements step on the host (fp32
    # copies, AdamW moments there; gradients copied over, updated values back), the rest on
    # the device; overlap_cpu_optimizer_d2h_h2d: the copies on side streams, per parameter
    # (CUDA). With Muon: its AdamW part's state on the host, whole (parallel/muon.py; its
    # matrices' momentum stays on the device).
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    overlap_cpu_optimizer_d2h_h2d: bool = False


def check_host_optimizer(par: HostOptimizerOptions) -> None:
    if not par.optimizer_cpu_offload:
        return
    fraction = par.optimizer_offload_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
            or not 0.0 <= fraction <= 1.0:
        raise LayoutError(f"parallel.optimizer_offload_fraction={fraction!r}: the share of the "
                          "parameter elements whose optimizer state lives in host memory must "
                          "lie in [0, 1] (1.0: all of it)")
