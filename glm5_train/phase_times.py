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
Nothing here changes what a step computes."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

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
        self._wait()
        started = time.perf_counter()
        try:
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
