"""Exact bytes saved for backward, per rank and per step, from autograd's saved-tensor hooks.

``SavedTensorMeter.hooks()`` is a ``torch.autograd.graph.saved_tensors_hooks`` context: every
tensor autograd saves inside it is packed into a ``Packed`` handle that autograd owns until the
node's backward has run (or the graph is dropped). What is counted:

- unique storages: tensors sharing a storage (views, the same tensor saved by several nodes)
  count once, by the storage's bytes; a storage is found again by its data pointer while it is
  alive (a weak reference to the storage tells a live storage from a new one at a reused
  address);
- storages megatron-core's output-discarding recompute empties (``CheckpointWithoutOutput``:
  the output of a checkpointed function, saved by the op that consumes it, is resized to 0
  bytes after that op's forward and refilled in backward just before that op's backward
  runs) count what they hold: the tensors saved from such an output are found by their
  autograd node at pack time; their storage's size is read again before any new peak is
  taken (the emptying: same layer, soon after) and when autograd unpacks them (the refill);
- parameters (and anything registered with ``exclude``) apart: ``saved_param_bytes`` is the
  unique bytes of excluded storages referenced by saved tensors; they are never "live" bytes,
  they exist anyway;
- live bytes over time: a storage counts from its first pack until its last ``Packed`` handle
  is released by autograd (``Packed.__del__``, run when the node frees its saved variables:
  exact, no polling). Bytes moved to host memory (``parallel.activation_offload``) leave the
  live device bytes when the device original is really freed (a finalizer on the storage) and
  come back when they are copied back;
- per step: ``total_bytes`` (every unique storage packed in the step), ``peak_bytes`` (the
  largest live device bytes at any moment of the step), ``offloaded_bytes`` /
  ``reloaded_bytes`` (bytes whose device original was freed after their copy to host / bytes
  copied back).

Nothing here knows the model: ``scope`` (any object) tags what is packed while it is set, so a
caller can group records (by layer and micro-batch, for offloading).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel.random import CheckpointWithoutOutputFunction

# The autograd node of a CheckpointWithoutOutput output (the class torch makes for the Function).
_DISCARDED_OUTPUT_NODE = CheckpointWithoutOutputFunction._backward_cls


def _may_be_discarded(tensor: torch.Tensor) -> bool:
    """The tensor is (a view of) an output megatron-core's output-discarding checkpoint will
    empty after its consumer's forward."""
    base = tensor._base if tensor._base is not None else tensor
    return isinstance(base.grad_fn, _DISCARDED_OUTPUT_NODE) or isinstance(
        tensor.grad_fn, _DISCARDED_OUTPUT_NODE)


class StorageRecord:
    """One storage saved for backward: its bytes (as it holds them now), the handles autograd
    holds on it, and where its data is: the device original (``original``), a host copy
    (``host``), a device copy made from it (``reloaded``). ``resizable``: an output-discarding
    checkpoint's output (emptied in forward, refilled in backward). ``offload_state`` belongs to
    ``parallel.activation_offload``."""

    __slots__ = (
        "__weakref__",
        "host",
        "nbytes",
        "offload_state",
        "original",
        "packs",
        "ptr",
        "refs",
        "released",
        "reloaded",
        "resident",
        "resizable",
        "scope",
    )

    def __init__(self, storage: torch.UntypedStorage, scope) -> None:
        self.nbytes = storage.nbytes()
        self.ptr = storage.data_ptr()
        self.refs = 0
        self.packs: list[weakref.ref] = []  # the handles, for dropping their device tensors
        self.scope = scope
        self.original: weakref.ref | None = weakref.ref(storage)
        self.host: torch.Tensor | None = None  # flat uint8 copy in host memory
        self.reloaded: torch.Tensor | None = None  # flat uint8 device copy of ``host``
        self.resident = True  # counted in the meter's live device bytes
        self.released = False
        self.resizable = False
        self.offload_state = None

    def storage(self) -> torch.UntypedStorage | None:
        """The device storage the saved tensors are views of (None while only on host)."""
        if self.reloaded is not None:
            return self.reloaded.untyped_storage()
        return self.original() if self.original is not None else None


class Packed:
    """What autograd keeps for one saved tensor: the tensor itself while its storage stays on
    the device as it was, else the view's geometry to rebuild it from the record's storage."""

    __slots__ = (
        "__weakref__",
        "dtype",
        "meter",
        "offset",
        "record",
        "shape",
        "stride",
        "tensor",
    )

    def __init__(self, record: StorageRecord, tensor: torch.Tensor, meter: SavedTensorMeter):
        self.record, self.tensor, self.meter = record, tensor, meter
        self.dtype, self.shape = tensor.dtype, tensor.shape
        self.stride, self.offset = tensor.stride(), tensor.storage_offset()

    def unpack(self) -> torch.Tensor:
        if self.record.resizable:  # refilled by its recompute just before this backward
            self.meter.resized(self.record)
        if self.tensor is not None:
            return self.tensor
        storage = self.meter.device_storage(self.record)
        return torch.empty(0, dtype=self.dtype, device=storage.device).set_(
            storage, self.offset, self.shape, self.stride)

    def __del__(self) -> None:
        record = self.record
        record.refs -= 1
        if record.refs == 0:
            self.meter._release(record)


@dataclass(frozen=True)
class StepFigures:
    """One step's saved-for-backward figures of this rank, in bytes."""

    peak_bytes: int  # the most saved bytes resident on the device at any moment
    total_bytes: int  # unique storages packed during the step (parameters apart)
    param_bytes: int  # unique excluded (parameter) storages saved tensors referenced
    offloaded_bytes: int  # device originals freed after their copy to host
    reloaded_bytes: int  # host copies brought back to the device


class SavedTensorMeter:
    """Counts what autograd saves inside ``hooks()``; see the module docstring."""

    def __init__(self) -> None:
        self._by_ptr: dict[int, StorageRecord] = {}
        self._excluded: dict[int, int] = {}  # storage data pointer -> bytes
        self._excluded_seen: set[int] = set()
        self.scope = None  # tags new records (set by whoever groups them)
        self.on_pack = None  # callable(record, is_new) -> None, e.g. an offloader's collector
        self.on_unpack = None  # callable(record): its device copy is ready when it returns
        self.live_bytes = 0
        self.host_bytes = 0
        # Resizable records not yet seen emptied: read again before each new peak.
        self._to_be_emptied: list[StorageRecord] = []
        self._reset_step()

    # ------------------------------------------------------------------------ set-up, step

    def exclude(self, tensors) -> None:
        """Storages that are not activations (parameters, buffers): reported apart."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            self._excluded[storage.data_ptr()] = storage.nbytes()

    def _reset_step(self) -> None:
        self.peak_bytes = self.live_bytes
        self.total_bytes = 0
        self.offloaded_bytes = 0
        self.reloaded_bytes = 0
        self._excluded_seen = set()

    def begin_step(self) -> None:
        self._reset_step()

    def end_step(self) -> StepFigures:
        param = sum(self._excluded[p] for p in self._excluded_seen)
        return StepFigures(self.peak_bytes, self.total_bytes, param, self.offloaded_bytes,
                           self.reloaded_bytes)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    # ------------------------------------------------------------------------ pack, unpack

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._excluded:
            self._excluded_seen.add(ptr)
            return tensor
        record = self._by_ptr.get(ptr)
        is_new = record is None or record.original is None or record.original() is not storage
        if is_new:
            record = StorageRecord(storage, self.scope)
            self._by_ptr[ptr] = record
            self.total_bytes += record.nbytes
            self._grow(record.nbytes)
        if not record.resizable and _may_be_discarded(tensor):
            record.resizable = True
            self._to_be_emptied.append(record)
        packed = Packed(record, tensor, self)
        record.refs += 1
        record.packs.append(weakref.ref(packed))
        if self.on_pack is not None:
            self.on_pack(record, is_new)
        return packed

    def device_storage(self, record: StorageRecord) -> torch.UntypedStorage:
        """The device storage of a record whose handles no longer hold it: the mover makes
        sure it is there (copied back, or the copy finished) first."""
        if self.on_unpack is not None:
            self.on_unpack(record)
        return record.storage()

    def _release(self, record: StorageRecord) -> None:
        """Autograd dropped the last handle: the bytes are no longer saved for backward."""
        record.released = True
        if record.resident:
            self.live_bytes -= record.nbytes
            record.resident = False
        if record.host is not None:
            self.host_bytes -= record.nbytes
        record.host = record.reloaded = None
        if self._by_ptr.get(record.ptr) is record:
            del self._by_ptr[record.ptr]

    def _grow(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self._settle_emptied()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _settle_emptied(self) -> None:
        """Count the resizable storages emptied since they were packed at what they hold now
        (0 bytes); those not emptied yet are read again before the next new peak."""
        waiting = []
        for record in self._to_be_emptied:
            if record.released or record.original is None:
                continue
            self.resized(record)
            if record.nbytes:
                waiting.append(record)
        self._to_be_emptied = waiting

    # ------------------------------------------------- moves (parallel.activation_offload)

    def drop_device_refs(self, record: StorageRecord) -> None:
        """The handles stop holding the device original (it is copied to ``record.host``):
        once nothing else holds it either, its finalizer calls ``_original_freed``."""
        for ref in record.packs:
            packed = ref()
            if packed is not None:
                packed.tensor = None
        record.packs = [ref for ref in record.packs if ref() is not None]
        storage = record.original()
        weakref.finalize(storage, self._original_freed, weakref.ref(record))

    def _original_freed(self, record_ref: weakref.ref) -> None:
        record = record_ref()
        if record is None or record.released:
            return
        if self._by_ptr.get(record.ptr) is record:
            del self._by_ptr[record.ptr]  # the address may now be reused by a new storage
        record.original = None
        if record.reloaded is None and record.resident:  # the bytes really left the device
            record.resident = False
            self.live_bytes -= record.nbytes
            self.offloaded_bytes += record.nbytes

    def host_copy_made(self, record: StorageRecord, host: torch.Tensor) -> None:
        record.host = host
        self.host_bytes += record.nbytes

    def reloaded(self, record: StorageRecord, device_copy: torch.Tensor) -> None:
        """``device_copy`` (flat uint8) holds the record's bytes again on the device."""
        record.reloaded = device_copy
        self.host_bytes -= record.nbytes
        record.host = None
        record.resident = True
        self.reloaded_bytes += record.nbytes
        self._grow(record.nbytes)

    def resized(self, record: StorageRecord) -> None:
        """The device original may have changed size under us (megatron-core's output-
        discarding recompute shrinks a storage to 0 bytes and refills it in backward): count
        what it holds now (a refill may make a new peak)."""
        storage = record.original() if record.original is not None else None
        if storage is None or not record.resident or record.released:
            return
        now = storage.nbytes()
        if now == record.nbytes:
            return
        self.live_bytes += now - record.nbytes
        record.nbytes = now
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)


def _unpack(packed):
    return packed.unpack() if isinstance(packed, Packed) else packed
