"""Traces on demand: ``train.profile_steps=[first, last]`` records a torch.profiler trace of
those training steps on every rank (CPU activities, and CUDA ones on GPUs; shapes and memory
with ``train.profile_shapes`` / ``train.profile_memory``), written as Chrome trace JSON to
``<run dir>/profile/rank<NNNNN>.json`` when the last one ends. ``tools/merge_traces.py`` lays
the ranks' files side by side, one lane per rank, for chrome://tracing or ui.perfetto.dev.

Annotated ranges (profiler ranges; NVTX ranges too on CUDA, for Nsight Systems):
``forward chunk <c> micro-batch <m>`` around each forward of a model chunk (virtual pipeline
stage c), ``backward chunk <c> micro-batch <m>`` from the moment that forward's output receives
its gradient to the moment the gradient reaches the chunk's input (the embedding's output on
the first stage: the embedding's own small backward falls after it), and each collective the
communication meter counts as ``<purpose> <group>.<function>:<group size>``
(``parallel/comm_meter.py``; ``<purpose>``: what it is for, ``parallel/comm_purpose.py``, e.g.
``dp_grad_reduce_scatter``; ``<group>``: megatron-core's name for it, e.g. ``pp``, ``dp_cp``,
``ep``, ``cp``).
``train.profile_ranks`` picks the ranks that trace; ``train.profile_warmup`` runs that many
steps under the profiler before the first traced one and discards them.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class ProfileOptions:
    """``train.profile_*`` keys (part of the job's TrainConfig)."""

    # torch.profiler traces of steps [first, last]; None: none.
    profile_steps: list[int] | None = None
    profile_shapes: bool = False
    profile_memory: bool = False
    # The ranks that trace (global ranks; None: every rank), as Megatron-LM's --profile-ranks.
    profile_ranks: list[int] | None = None
    # Steps before the first traced one that run under the profiler and are discarded
    # (torch.profiler's warm-up: its start-up cost stays out of the traced steps).
    profile_warmup: int = 0


def check_profile_options(opts: ProfileOptions, train_iters: int) -> None:
    ranks = opts.profile_ranks
    if ranks is not None and (not isinstance(ranks, list) or not ranks or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)):
        raise ValueError(f"train.profile_ranks={ranks}: give a list of global ranks, e.g. "
                         "train.profile_ranks=[0,3], or null for every rank")
    steps = opts.profile_steps
    if steps is None:
        return
    if (not isinstance(steps, list) or len(steps) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
            or not 1 <= steps[0] <= steps[1] <= train_iters):
        raise ValueError(f"train.profile_steps={steps}: give [first, last] step numbers with "
                         f"1 <= first <= last <= train.train_iters={train_iters}, e.g. "
                         "train.profile_steps=[2,3], or null for no trace")
    warmup = opts.profile_warmup
    if not isinstance(warmup, int) or not 0 <= warmup < steps[0]:
        raise ValueError(f"train.profile_warmup={warmup}: the warm-up steps run before the "
                         f"first traced step {steps[0]}, so it must lie in [0, {steps[0] - 1}]; "
                         "lower it or trace later steps")


def check_profile_ranks(ranks: list[int] | None, world_size: int) -> None:
    """At start-up, once the world size is known."""
    if ranks is not None and max(ranks) >= world_size:
        raise ValueError(f"train.profile_ranks={ranks}: the job has {world_size} ranks "
                         f"(0 .. {world_size - 1}); name ranks among them")


def profiling_now() -> bool:
    return bool(torch.autograd.profiler._is_profiler_enabled)


# Allocator events a CUDA memory snapshot keeps (torch's default is 100,000 too).
SNAPSHOT_ENTRIES = 100_000


class StepProfiler:
    """Starts torch.profiler before step ``first`` (``warmup`` steps earlier, whose events it
    discards) and writes the trace after step ``last``, on the ``ranks`` named (None: all)."""

    def __init__(self, run_dir: str, steps: list[int] | None, shapes: bool = False,
                 memory: bool = False, ranks: list[int] | None = None,
                 warmup: int = 0) -> None:
        traces = steps is not None and (ranks is None or dist.get_rank() in ranks)
        self.first, self.last = (steps[0], steps[-1]) if traces else (None, None)
        self.warmup = warmup
        self.path = os.path.join(run_dir, "profile", f"rank{dist.get_rank():05d}.json")
        self.shapes, self.memory = shapes, memory
        self._profile = None

    def step_begins(self, step: int) -> None:
        """``step``: the 1-based number of the step about to run. The profiler starts
        ``warmup`` steps before the first traced one, or at the first step a resumed run
        runs, if that falls inside the warm-up (a shorter one, then)."""
        if (self.first is None or self._profile is not None
                or not self.first - self.warmup <= step <= self.first):
            return
        self.warmup = self.first - step
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = None
        if self.warmup:  # discard the warm-up steps, record the rest, save once
            schedule = torch.profiler.schedule(wait=0, warmup=self.warmup,
                                               active=self.last - self.first + 1, repeat=1)
        self._profile = torch.profiler.profile(activities=activities, schedule=schedule,
                                               on_trace_ready=self._save if schedule else None,
                                               record_shapes=self.shapes,
                                               profile_memory=self.memory, with_stack=False)
        if self.memory and torch.cuda.is_available():  # the allocator's own history
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
        self._profile.__enter__()

    def step_ends(self, step: int) -> None:
        if self._profile is None:
            return
        if self.warmup:
            self._profile.step()  # the schedule saves after the last active step
        if step != self.last:
            return
        self._profile.__exit__(None, None, None)
        if not self.warmup:
            self._save(self._profile)
        self._profile = None

    def _save(self, profile) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        profile.export_chrome_trace(self.path)
        if self.memory and torch.cuda.is_available():
            torch.cuda.memory._dump_snapshot(self.snapshot_path)
            torch.cuda.memory._record_memory_history(enabled=None)

    @property
    def snapshot_path(self) -> str:
        """With ``train.profile_memory`` on CUDA: the caching allocator's snapshot of the traced
        steps (every allocation with its stack; drag it onto https://pytorch.org/memory_viz),
        as torchtitan's memory snapshots."""
        return self.path.replace(".json", "_memory_snapshot.pickle")


class ScheduleLabels:
    """Names each forward (and its backward) by model chunk and micro-batch, in the order the
    pipeline schedule runs a chunk's micro-batches (megatron-core runs them in order)."""

    def __init__(self, chunks: list) -> None:
        self.chunks = chunks
        self.counts = [0] * len(chunks)
        self.open: dict[str, object] = {}  # backward ranges opened, until their input's hook

    def next(self, model) -> str:
        index = next((i for i, c in enumerate(self.chunks) if c is model), 0)
        label = f"chunk {index} micro-batch {self.counts[index]}"
        self.counts[index] += 1
        return label


@contextmanager
def labelled_forward(model, labels: ScheduleLabels | None):
    """A profiler range around the forward, and the hook that ends its backward's range
    (``backward_range`` opens it when the output gets its gradient)."""
    if labels is None or not profiling_now():
        yield None
        return
    label = labels.next(model)
    with _range(f"forward {label}"):
        ends = _close_at_chunk_input(model, labels, f"backward {label}")
        try:
            yield label
        finally:
            ends.remove()


def backward_range(output: torch.Tensor, labels: ScheduleLabels | None,
                   label: str | None) -> torch.Tensor:
    """``output`` whose gradient opens the range ``backward <label>`` (closed by the hook
    ``labelled_forward`` put on the decoder's input)."""
    if label is None or not output.requires_grad:
        return output
    output.register_hook(lambda grad: (_open(labels, f"backward {label}"), grad)[1])
    return output


def _open(labels: ScheduleLabels, name: str) -> None:
    labels.open[name] = torch.ops.profiler._record_function_enter_new(name, None)
    if torch.cuda.is_available():
        torch.cuda.nvtx.range_push(name)


def _close(labels: ScheduleLabels, name: str) -> None:
    handle = labels.open.pop(name, None)
    if handle is not None:
        torch.ops.profiler._record_function_exit._RecordFunction(handle)
        if torch.cuda.is_available():
            torch.cuda.nvtx.range_pop()


class _Removable:
    def __init__(self, handle) -> None:
        self.handle = handle

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()


def _close_at_chunk_input(model, labels: ScheduleLabels, name: str) -> _Removable:
    """The gradient reaching the chunk's input closes ``name``: the embedding's output on the
    first pipeline stage, else the activation received from the previous stage (megatron-
    core's ``set_input_tensor`` left it on the decoder before this forward)."""
    inner = model
    while hasattr(inner, "module"):
        inner = inner.module

    def close_on_grad(tensor) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(lambda grad: (_close(labels, name), grad)[1])

    embedding = getattr(inner, "embedding", None) if getattr(inner, "pre_process", False) else None
    if embedding is not None:
        return _Removable(embedding.register_forward_hook(lambda m, a, out: close_on_grad(out)))
    close_on_grad(getattr(getattr(inner, "decoder", None), "input_tensor", None))
    return _Removable(None)


def _range(name: str):
    if torch.cuda.is_available():
        return _nvtx_and_profiler(name)
    return torch.profiler.record_function(name)


@contextmanager
def _nvtx_and_profiler(name: str):
    with torch.profiler.record_function(name), torch.cuda.nvtx.range(name):
        yield
