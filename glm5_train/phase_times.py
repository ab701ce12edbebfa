"""Where each training step's wall time goes, per rank: the phases Megatron-LM's timers name,
in metrics.jsonl (``phase_ms``, one list per phase, a value per rank) and TensorBoard
(``phases/<phase>_ms/rank<i>``), beside the step's own wall time (``step_time_s``).

Phases (wall seconds, milliseconds in the record):
- ``forward_backward``: the pipeline schedule over the global batch (every micro-batch's
  forward and backward, pipeline sends and waits, and the gradient sync below, which
  megatron-core runs at its end: Megatron-LM's "forward-backward" timer);
- ``grad_sync``: inside it, megatron-core's ``finalize_model_grads`` (the data-parallel
  gradient reduction, the embedding copies' sum, the token count: "all-grads-sync"; with
  ``parallel.defer_weight_grads``, the queued weight-gradient GEMMs drained just before it);
- ``optimizer``: the optimizer step (gradient clipping, the update, the distributed
  optimizer's parameter all-gather, Muon's orthogonalisation).

On CUDA each phase boundary synchronises the device first, so a phase holds the kernels it
launched (as Megatron-LM's timers with barrier off); on CPU there is nothing to wait for.

Beside them, ``ModelRate`` turns the step time into Megatron-LM's throughput figures:
``tflops_per_gpu`` (the planner's model FLOPs per global batch, no recompute, over the step's
wall time and the devices) and, where the device's peak is known (H100, H200: the cluster
presets of ``configs/cluster/``), ``mfu``. Nothing here changes what a step computes."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

PHASES = ("forward_backward", "grad_sync", "optimizer")


class PhaseTimes:
    """Wall seconds of each phase of the current step on this rank."""

    def __init__(self, device: torch.device) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._wait = torch.cuda.synchronize if device.type == "cuda" else _nothing

    def begin_step(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        """Time ``phase``; under torch.profiler also a ``phase <name>`` range in the trace
        (tools/draw_timeline.py draws the optimizer and the gradient sync from it)."""
        self._wait()
        started = time.perf_counter()
        traced = (torch.profiler.record_function(f"phase {phase}")
                  if torch.autograd.profiler._is_profiler_enabled else nullcontext())
        try:
            with traced:
                yield
        finally:
            self._wait()
            self.seconds[phase] += time.perf_counter() - started

    def timed(self, fn: Callable, phase: str) -> Callable:
        """``fn`` whose calls count to ``phase`` (megatron-core's finalize function)."""

        @functools.wraps(fn)
        def call(*args, **kwargs):
            with self.measure(phase):
                return fn(*args, **kwargs)

        return call

    def milliseconds(self) -> list[float]:
        """This step's phases, in ``PHASES`` order, ms (3 decimals: the gather's row)."""
        return [round(1000 * self.seconds[p], 3) for p in PHASES]


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class ModelRate:
    """The job's model FLOPs per global batch (``glm5_train.plan.step_time``), its devices,
    and their dense peak (None on CPU or an unknown GPU: no MFU then)."""

    flops_per_step: float
    global_batch: int
    devices: int
    peak_tflops: float | None

    def fields(self, step_s: float, global_batch_now: int | None = None) -> dict:
        """``tflops_per_gpu`` and ``mfu`` of a step of ``step_s`` wall seconds over
        ``global_batch_now`` sequences (a batch-size ramp's; None: the config's)."""
        if step_s <= 0:
            return {}
        flops = self.flops_per_step * (global_batch_now or self.global_batch) / self.global_batch
        tflops = flops / step_s / self.devices / 1e12
        out = {"tflops_per_gpu": _figures(tflops)}
        if self.peak_tflops:
            out["mfu"] = _figures(tflops / self.peak_tflops)
        return out


def _figures(value: float) -> float:
    """``value`` to 6 significant figures (a CPU's 0.0037 TFLOP/s and an H100's 400 alike)."""
    return float(f"{value:.6g}")

