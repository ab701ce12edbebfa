"""Activation offloading at layer granularity, driven by the pipeline schedule.

After an offloaded layer's forward, the storages it saved for backward (``parallel.
activation_accounting`` records them) are copied to host memory and the device originals
dropped; they come back ahead of their backward. Which micro-batches offload and when each
comes back is ``parallel.pipeline_layout.offload_plan``, a replay of the (interleaved) 1F1B
order megatron-core runs on this rank: a forward offloads when it is among the rank's first
``micro_batches`` forwards and its backward is not the next backward the rank runs; its last
offloaded layer starts reloading when the op just before its backward starts; during its
backward, layer L's backward starting starts layer L-1's reload ("layer" = one call of an
offloaded module for one micro-batch: an MTP layer applied for 3 steps is 3 calls). A tensor
whose reload was not started in time is reloaded when autograd unpacks it.

On CUDA the copies run on a stream of their own (never megatron-core's p2p or MoE all-to-all
streams) into pinned host memory (torch's caching host allocator reuses it), ordered by events:
the copy stream waits for the compute stream before each copy, the compute stream waits for a
layer's reload event before unpacking it. On CPU the same path copies synchronously into
separate host tensors, so the bytes really move and the originals are really freed.

Not offloaded: parameters (the meter excludes them), storages under ``min_bytes`` (the copy's
fixed cost outweighs them), storages megatron-core's output-discarding recompute has shrunk
(it refills them in backward), and storages something else keeps alive (a pipeline stage's
received input, held by megatron-core until its backward): their host copy is dropped at reload
and they count neither as offloaded nor as reloaded. Parity: values come back bit for bit, so
losses and gradients equal those of a run without offloading.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from parallel.activation_accounting import SavedTensorMeter, StepFigures, StorageRecord
from parallel.pipeline_layout import OffloadPlan

# Below this a storage stays: per-token scalars and index tensors of small batches; at GLM-5's
# sizes every activation a layer saves is megabytes.
MIN_OFFLOAD_BYTES = 1024


class Unit:
    """One call of an offloaded layer for one micro-batch: the records it packed first."""

    __slots__ = ("event", "key", "records", "state")

    def __init__(self, key: tuple[int, int, int]) -> None:
        self.key = key  # (chunk, micro-batch, call index within the micro-batch)
        self.records: list[StorageRecord] = []
        self.state = "collecting"  # -> "offloaded" -> "reloaded"
        self.event = None  # CUDA: the reload copy's completion


class ActivationOffloader:
    """Moves the saved tensors of selected layers to host memory and back (module docstring).
    Owns no global state: the job's Runtime owns it; hooks are on this rank's modules."""

    def __init__(self, meter: SavedTensorMeter, plan: OffloadPlan, device: torch.device,
                 min_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        self.meter, self.plan, self.device, self.min_bytes = meter, plan, device, min_bytes
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        meter.on_pack = self._collect
        meter.on_unpack = self._before_unpack
        self._units: dict[tuple[int, int], list[Unit]] = {}  # micro-batch -> calls in order
        self._current: tuple[int, int] | None = None  # the micro-batch forwarding now
        self._step_ops: list[tuple[str, int, int]] = []

    # ---------------------------------------------------------------------- set-up, step

    def attach(self, module: torch.nn.Module) -> None:
        """Offload what ``module`` saves (one of the selected layers of this rank)."""
        module.register_forward_pre_hook(self._layer_starts)
        module.register_forward_hook(self._layer_ends)

    def begin_step(self) -> None:
        self._units, self._step_ops = {}, []

    def end_step(self) -> None:
        """Check the step ran the order the plan replayed (megatron-core's schedule)."""
        if tuple(self._step_ops) != self.plan.ops:
            raise RuntimeError(
                "activation offloading: the pipeline ran the ops "
                f"{self._step_ops[:12]}... but the schedule replay (parallel.pipeline_layout) "
                f"gives {list(self.plan.ops[:12])}...: megatron-core's order changed")
        self._units = {}

    # ------------------------------------------------------------- micro-batch boundaries

    @contextmanager
    def forward(self, chunk: int, micro: int):
        """Around one micro-batch's forward on one chunk."""
        self._op_starts(("F", chunk, micro))
        self._current = (chunk, micro)
        self._units[(chunk, micro)] = []
        try:
            yield
        finally:
            self._current = None
            self.meter.scope = None

    def backward_starts(self, chunk: int, micro: int) -> None:
        """The chunk's output gradient for this micro-batch has arrived."""
        self._op_starts(("B", chunk, micro))

    def _op_starts(self, op: tuple[str, int, int]) -> None:
        self._step_ops.append(op)
        back = self.plan.reload_at.get(op)
        if back is not None and self._units.get(back):
            self._reload(self._units[back][-1])

    # ------------------------------------------------------------------ layer boundaries

    def _layer_starts(self, module, args) -> None:
        if self._current is None or self._current not in self.plan.offloaded:
            return  # not forwarding a micro-batch that offloads (e.g. recompute in backward)
        calls = self._units[self._current]
        unit = Unit((*self._current, len(calls)))
        calls.append(unit)
        self.meter.scope = unit

    def _layer_ends(self, module, args, output) -> None:
        unit = self.meter.scope
        if not isinstance(unit, Unit) or self._current is None:
            return
        self.meter.scope = None
        self._offload(unit)
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda grad, unit=unit: self._unit_backward_starts(unit))

    def _unit_backward_starts(self, unit: Unit) -> None:
        """Layer L's backward starts: it must be back, and layer L-1 starts coming back."""
        self._reload(unit)
        chunk, micro, index = unit.key
        if index > 0:
            self._reload(self._units[(chunk, micro)][index - 1])

    def _collect(self, record: StorageRecord, is_new: bool) -> None:
        unit = self.meter.scope
        if is_new and isinstance(unit, Unit):
            unit.records.append(record)

    # -------------------------------------------------------------------------- copies

    def _offload(self, unit: Unit) -> None:
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for record in unit.records:
            storage = record.original() if record.original is not None else None
            if storage is None or record.released:
                continue
            if storage.nbytes() != record.nbytes:  # shrunk by output-discarding recompute
                self.meter.resized(record)
                continue
            if record.nbytes < self.min_bytes:
                continue
            flat = _flat(storage)
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    host = torch.empty(record.nbytes, dtype=torch.uint8, pin_memory=True)
                    host.copy_(flat, non_blocking=True)
                flat.record_stream(self.stream)  # not reused before the copy has read it
            else:
                host = flat.clone()
            record.offload_state = unit
            self.meter.host_copy_made(record, host)
            self.meter.drop_device_refs(record)
        unit.state = "offloaded"

    def _reload(self, unit: Unit) -> None:
        if unit.state != "offloaded":
            return
        unit.state = "reloaded"
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for record in unit.records:
            if record.host is None or record.released:
                continue
            if record.original is not None and record.original() is not None:
                self._keep_original(record)  # never left the device: nothing to copy back
                continue
            copy = torch.empty(record.nbytes, dtype=torch.uint8, device=self.device)
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    copy.copy_(record.host, non_blocking=True)
                copy.record_stream(self.stream)
            else:
                copy.copy_(record.host)
            self.meter.reloaded(record, copy)
        if self.cuda:
            unit.event = torch.cuda.Event()
            unit.event.record(self.stream)

    def _keep_original(self, record: StorageRecord) -> None:
        """Hold the original again (the handles let go of it) and drop the host copy."""
        self.meter.host_bytes -= record.nbytes
        record.host = None
        record.reloaded = _flat(record.original())

    def _before_unpack(self, record: StorageRecord) -> None:
        """Autograd unpacks a tensor of an offloaded layer: reload it now if its reload was
        not started in time, and let the compute stream wait for the copy."""
        unit = record.offload_state
        if isinstance(unit, Unit):
            self._reload(unit)
            self.wait(unit)

    def wait(self, unit: Unit) -> None:
        if unit.event is not None:
            torch.cuda.current_stream(self.device).wait_event(unit.event)
            unit.event = None


def _flat(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class ActivationTracker:
    """Every micro-batch's forward on every chunk of this rank inside the meter (and the
    offloader, when one is given): which chunk runs is the module megatron-core passes to the
    forward step, which micro-batch is that chunk's forward count in the step (megatron-core
    forwards each chunk's micro-batches in order)."""

    def __init__(self, chunks: list[torch.nn.Module], meter: SavedTensorMeter,
                 offloader: ActivationOffloader | None = None) -> None:
        self.chunks, self.meter, self.offloader = chunks, meter, offloader
        self._index = {id(chunk): i for i, chunk in enumerate(chunks)}
        self._forwards = [0] * len(chunks)
        self.figures: StepFigures | None = None

    def begin_step(self) -> None:
        # Parameters are excluded as they are now (DDP may have moved them into its buffers).
        # (Module's own methods: megatron-core's DDP has a ``buffers`` list attribute.)
        self.meter.exclude(t for chunk in self.chunks for t in (
            *torch.nn.Module.parameters(chunk), *torch.nn.Module.buffers(chunk)))
        self.meter.begin_step()
        self._forwards = [0] * len(self.chunks)
        if self.offloader is not None:
            self.offloader.begin_step()

    def end_step(self) -> StepFigures:
        """The step's figures, also kept as ``figures`` until the next step ends."""
        if self.offloader is not None:
            self.offloader.end_step()
        self.figures = self.meter.end_step()
        return self.figures

    @contextmanager
    def forward(self, model: torch.nn.Module):
        """Around the forward of ``model`` (a chunk) for its next micro-batch; yields a
        callable to hand the chunk's output to (its gradient marks the backward's start)."""
        chunk = self._index[id(model)]
        micro = self._forwards[chunk]
        self._forwards[chunk] += 1
        offload = self.offloader.forward(chunk, micro) if self.offloader else nullcontext()
        with self.meter.hooks(), offload:
            yield lambda output: self._watch_backward(output, chunk, micro)

    def _watch_backward(self, output, chunk: int, micro: int):
        if self.offloader is not None and isinstance(output, torch.Tensor) and \
                output.requires_grad:
            output.register_hook(lambda grad: self._backward_starts(chunk, micro))
        return output

    def _backward_starts(self, chunk: int, micro: int) -> None:
        self.offloader.backward_starts(chunk, micro)

