"""Per-rank communication and buffer accounting: exact counts from the calls the code makes.

``CommMeter`` counts, for this rank, every ``torch.distributed`` collective and point-to-point
call made by anyone (megatron-core's DDP, distributed optimizer, pipeline schedules and MoE
token dispatch, our own code) while a ``with meter.measure():`` block is open::

    meter = CommMeter()
    with meter.measure():
        train_step(...)
    meter.calls, meter.bytes, meter.payload_bytes, meter.by_op()

How: for the duration of the block the collective functions are replaced by counting wrappers
in every place they are looked up, and put back afterwards (``TARGETS``):

- the attributes of the ``torch.distributed`` module (megatron-core and our code call
  ``torch.distributed.X`` / ``dist.X``, looked up at call time);
- the names megatron-core binds at import (``dist_all_gather_func = torch.distributed.
  all_gather_into_tensor`` and ``dist_reduce_scatter_func = ...reduce_scatter_tensor``), listed
  in ``BOUND_NAMES``; ``tests/test_comm_meter.py`` fails when a module on the training path binds
  a collective under a name this list does not hold;
- (on CPU, the device layer's ``torch.distributed`` view for megatron-core's
  ``tensor_parallel.mappings``, ``parallel.device.GlooDistributed``, looks every function up
  afresh in ``torch.distributed``, so it needs nothing here);
- ``torch.distributed.P2POp``, by a subclass that unwraps the op it is given, because torch
  checks the op of a ``P2POp`` by identity against its own ``isend`` / ``irecv``.

Calls nested inside a counted call (an object collective's own tensor collectives, a batched
p2p's sends) are not counted again. Asynchronous calls count when they are issued. Blocks of
different meters may nest (each counts what happens while it is open); the same meter may not
re-enter its own block. Outside every block nothing is replaced.

Counting rules, per call, for this rank (n = the process group's size, r = this rank's index in
the group, S = bytes of the tensor argument; bytes = numel x element size):

``bytes`` (sent on the wire by this rank, ring/chain algorithm model):
  all_reduce (+ _coalesced)       floor(2 (n-1) S / n)          (reduce-scatter + all-gather ring)
  reduce_scatter (all variants)   input bytes - this rank's output share = (n-1)/n x input
  all_gather (all variants)       (n-1) x this rank's input bytes      = (n-1)/n x output
  all_to_all(_single)             input bytes not destined to this rank itself
  broadcast                       S, except the rank before the source in the ring (sends 0)
  reduce                          S, except the destination (chain ending at the destination)
  gather                          S, except the destination
  scatter                         source: the chunks for the other ranks; others 0
  send / isend                    S              recv / irecv   0
  batch_isend_irecv               each op as its send / recv
  barrier                         0
  object collectives              the rule of their tensor form, on the pickled bytes of this
                                  rank's object(s) (torch's padding to the largest rank's object
                                  and its int64 size exchange are not counted)
``payload_bytes``: the size of the tensor(s) this rank hands to the call: the tensor of
  all_reduce / broadcast / reduce / gather / send / recv, the whole input of reduce_scatter and
  all_to_all, the local input of all_gather, scatter's list on the source (its output tensor
  elsewhere); pickled bytes for object collectives.
``calls``: one per call; a ``batch_isend_irecv`` counts one call per op in it.
A call whose arguments a rule cannot read still runs and is counted, with no bytes, as op
``unmetered`` (so that it shows instead of vanishing).

Op kinds (``OP_KINDS``): all_reduce, reduce_scatter (``reduce_scatter``,
``reduce_scatter_tensor``, ``reduce_scatter_single``, ``_reduce_scatter_base``), all_gather
(``all_gather``, ``all_gather_into_tensor``, ``all_gather_single``, ``_all_gather_base``,
``all_gather_coalesced``), all_to_all
(``all_to_all``, ``all_to_all_single``), broadcast, reduce, gather, scatter, send (``send``,
``isend``), recv (``recv``, ``irecv``), barrier (``barrier``, ``monitored_barrier``) and the
object collectives under their own names.

Groups by name: a meter made with ``group_names`` ({id(process group): name}, e.g. from
``names_of_groups`` over megatron-core's ProcessGroupCollection) also keys its counts by
(op kind, group name) in ``by_group()``: the default group is "world", a group the mapping does
not name is "size<n>". Sizes alone cannot tell data-parallel from tensor-parallel traffic when
both groups have the same size.

By purpose: a meter made with ``time_purposes`` ("cpu" or "cuda") also keys calls and bytes by
what each call is for (``parallel.comm_purpose``: ``dp_grad_reduce_scatter``, ``pp_recv``,
...) in ``by_purpose()``, with the seconds the purpose held this rank: a blocking call's
duration; an asynchronous call's issue and its ``wait()`` (its handle is returned wrapped, and
the wait counts in the meters open when it happens); a ``_coalescing_manager`` block's exit,
where megatron-core's bucketed sync runs its batch (``COALESCING_NAMES``). On CPU wall time
around the call; on CUDA a pair of events on the current stream, which a blocking collective
and a wait make wait for the communication (read by ``by_purpose``). Finding the purpose walks
the calling frames (about 44 µs a call on a 2-core CPU machine): only when a meter times or
the profiler records. Not seen: waits that bypass the handle (a stream's ``wait_stream`` on a
communication stream, ``torch.cuda.synchronize``), which count to whatever runs around them.

``buffer_bytes`` reports the bytes this rank holds in gradient buffers, optimizer state and
parameters (see there).
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parallel.comm_purpose import collective_purpose, purpose_of, register_megatron

# ----------------------------------------------------------------------------------------------
# Where collectives are looked up: patched for the duration of a block.
# ----------------------------------------------------------------------------------------------

# megatron-core modules that bind a torch.distributed collective to a module-level name at
# import (grep site-packages/megatron/core for "= torch.distributed." and "from torch.distributed
# import"; the only by-name import there, `_coalescing_manager`, is not a collective).
BOUND_NAMES: tuple[tuple[str, str], ...] = (
    ("megatron.core.distributed.param_and_grad_buffer", "dist_all_gather_func"),
    ("megatron.core.distributed.param_and_grad_buffer", "dist_reduce_scatter_func"),
    ("megatron.core.tensor_parallel.mappings", "dist_all_gather_func"),
    ("megatron.core.tensor_parallel.mappings", "dist_reduce_scatter_func"),
    ("megatron.core.tensor_parallel.layers", "dist_all_gather_func"),
    ("megatron.core.tensor_parallel.layers", "dist_reduce_scatter_func"),
    ("megatron.core.tensor_parallel.utils", "dist_all_gather_func"),
    ("megatron.core.transformer.multi_token_prediction", "dist_all_gather_func"),
    ("megatron.core.timers", "dist_all_gather_func"),
    ("megatron.core.utils", "dist_all_gather_func"),
)

# Where torch.distributed's coalescing manager is looked up (megatron-core binds it at import):
# patched so that the batch it runs at its exit counts to its calls' purpose (``by_purpose``).
COALESCING_NAMES: tuple[tuple[str, str], ...] = (
    ("torch.distributed", "_coalescing_manager"),
    ("megatron.core.distributed.param_and_grad_buffer", "_coalescing_manager"),
)

# The device layer's torch.distributed stand-in (CPU only) caches what it hands out.
CACHING_VIEWS: tuple[tuple[str, str], ...] = ()  # objects that cache torch.distributed functions


# ----------------------------------------------------------------------------------------------
# Counting rules: one function per torch.distributed function, with its signature, returning
# [(op kind, group, wire bytes, payload bytes)].
# ----------------------------------------------------------------------------------------------


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _sum_bytes(tensors: Iterable[torch.Tensor] | None) -> int:
    return sum(_nbytes(t) for t in tensors or ())


def _size(group) -> int:
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group)


def _group_rank(group, global_rank: int | None, group_rank: int | None) -> int:
    """A root given as a global rank (``src`` / ``dst``) or a group rank (``group_src`` ...)."""
    if group_rank is not None:
        return group_rank
    if group is None or group is dist.GroupMember.WORLD:
        return int(global_rank)
    return dist.get_group_rank(group, int(global_rank))


def _pickled(obj: Any) -> int:
    # torch serialises with pickle.Pickler(f).dump(obj), byte for byte pickle.dumps(obj).
    return len(pickle.dumps(obj))


def _all_reduce(tensor, op=None, group=None, async_op=False):
    n, s = _size(group), _nbytes(tensor)
    return [("all_reduce", group, 2 * (n - 1) * s // n, s)]


def _all_reduce_coalesced(tensors, op=None, group=None, async_op=False):
    n, s = _size(group), _sum_bytes(tensors)
    return [("all_reduce", group, 2 * (n - 1) * s // n, s)]


def _reduce(tensor, dst=None, op=None, group=None, async_op=False, group_dst=None):
    s = _nbytes(tensor)
    root = _group_rank(group, dst, group_dst)
    return [("reduce", group, 0 if _rank(group) == root else s, s)]


def _reduce_scatter(output, input_list, op=None, group=None, async_op=False):
    total = _sum_bytes(input_list)
    return [("reduce_scatter", group, total - _nbytes(input_list[_rank(group)]), total)]


def _reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
    return [("reduce_scatter", group, _nbytes(input) - _nbytes(output), _nbytes(input))]


def _all_gather(tensor_list, tensor, group=None, async_op=False):
    s = _nbytes(tensor)
    return [("all_gather", group, (_size(group) - 1) * s, s)]


def _all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    s = _nbytes(input_tensor)
    return [("all_gather", group, (_size(group) - 1) * s, s)]


def _all_gather_coalesced(output_tensor_lists, input_tensor_list, group=None, async_op=False):
    s = _sum_bytes(input_tensor_list)
    return [("all_gather", group, (_size(group) - 1) * s, s)]


def _all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    total = _sum_bytes(input_tensor_list)
    return [("all_to_all", group, total - _nbytes(input_tensor_list[_rank(group)]), total)]


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                       group=None, async_op=False):
    total = _nbytes(input)
    n, me = _size(group), _rank(group)
    if input_split_sizes is not None and len(input_split_sizes) > 0:
        splits = [int(s) for s in input_split_sizes]
        rows = input.shape[0] if input.dim() > 0 else 1
        own = (total // rows) * splits[me] if rows else 0
    else:
        own = total // n  # equal split along dim 0
    return [("all_to_all", group, total - own, total)]


def _broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    n, s = _size(group), _nbytes(tensor)
    root = _group_rank(group, src, group_src)
    last = (root - 1) % n  # the ring from the source ends at the rank before it
    return [("broadcast", group, s if n > 1 and _rank(group) != last else 0, s)]


def _gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    s = _nbytes(tensor)
    root = _group_rank(group, dst, group_dst)
    return [("gather", group, 0 if _rank(group) == root else s, s)]


def _scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    root = _group_rank(group, src, group_src)
    me = _rank(group)
    if me != root:
        return [("scatter", group, 0, _nbytes(tensor))]
    total = _sum_bytes(scatter_list)
    return [("scatter", group, total - _nbytes(scatter_list[me]), total)]


def _send(tensor, dst=None, group=None, tag=0, group_dst=None):
    s = _nbytes(tensor)
    return [("send", group, s, s)]


def _recv(tensor, src=None, group=None, tag=0, group_src=None):
    return [("recv", group, 0, _nbytes(tensor))]


def _batch_isend_irecv(p2p_op_list):
    out = []
    for op in p2p_op_list:
        s = _nbytes(op.tensor)
        sends = _unwrap(op.op) is _ORIGINALS.get("isend") or "send" in getattr(op.op, "__name__", "")
        out.append(("send", op.group, s, s) if sends else ("recv", op.group, 0, s))
    return out


def _barrier(group=None, *_, **__):
    return [("barrier", group, 0, 0)]


def _all_gather_object(object_list, obj, group=None):
    p = _pickled(obj)
    return [("all_gather_object", group, (_size(group) - 1) * p, p)]


def _gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
    p = _pickled(obj)
    root = _group_rank(group, dst, group_dst)
    return [("gather_object", group, 0 if _rank(group) == root else p, p)]


def _scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=None,
                         group=None, group_src=None):
    root = _group_rank(group, src, group_src)
    me = _rank(group)
    if me != root:
        return [("scatter_object_list", group, 0, 0)]
    sizes = [_pickled(o) for o in scatter_object_input_list]
    return [("scatter_object_list", group, sum(sizes) - sizes[me], sum(sizes))]


def _send_object_list(object_list, dst=None, group=None, device=None, group_dst=None,
                      use_batch=False):
    p = sum(_pickled(o) for o in object_list)
    return [("send_object_list", group, p, p)]


def _recv_object_list(object_list, src=None, group=None, device=None, group_src=None,
                      use_batch=False):
    return [("recv_object_list", group, 0, 0)]


def _broadcast_object_list_after(object_list, src=None, group=None, device=None, group_src=None):
    # Counted after the call: only then does every rank hold the objects (and their size).
    p = sum(_pickled(o) for o in object_list)
    n = _size(group)
    root = _group_rank(group, src, group_src)
    last = (root - 1) % n
    return [("broadcast_object_list", group, p if n > 1 and _rank(group) != last else 0, p)]


# torch.distributed function -> (rule, counted after the call instead of at it)
RULES: dict[str, tuple[Callable, bool]] = {
    "all_reduce": (_all_reduce, False),
    "all_reduce_coalesced": (_all_reduce_coalesced, False),
    "reduce": (_reduce, False),
    "reduce_scatter": (_reduce_scatter, False),
    "reduce_scatter_tensor": (_reduce_scatter_tensor, False),
    "_reduce_scatter_base": (_reduce_scatter_tensor, False),
    "reduce_scatter_single": (_reduce_scatter_tensor, False),  # torch >= 2.13
    "all_gather": (_all_gather, False),
    "all_gather_into_tensor": (_all_gather_into_tensor, False),
    "_all_gather_base": (_all_gather_into_tensor, False),
    "all_gather_single": (_all_gather_into_tensor, False),  # torch >= 2.13
    "all_gather_coalesced": (_all_gather_coalesced, False),
    "all_to_all": (_all_to_all, False),
    "all_to_all_single": (_all_to_all_single, False),
    "broadcast": (_broadcast, False),
    "gather": (_gather, False),
    "scatter": (_scatter, False),
    "send": (_send, False),
    "isend": (_send, False),
    "recv": (_recv, False),
    "irecv": (_recv, False),
    "batch_isend_irecv": (_batch_isend_irecv, False),
    "barrier": (_barrier, False),
    "monitored_barrier": (_barrier, False),
    "all_gather_object": (_all_gather_object, False),
    "broadcast_object_list": (_broadcast_object_list_after, True),
    "gather_object": (_gather_object, False),
    "scatter_object_list": (_scatter_object_list, False),
    "send_object_list": (_send_object_list, False),
    "recv_object_list": (_recv_object_list, False),
}

OP_KINDS: tuple[str, ...] = (
    "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce", "gather",
    "scatter", "send", "recv", "barrier", "all_gather_object", "broadcast_object_list",
    "gather_object", "scatter_object_list", "send_object_list", "recv_object_list",
    "unmetered")

# The real functions, by name (only those this torch has).
_ORIGINALS: dict[str, Callable] = {name: getattr(dist, name) for name in RULES
                                   if hasattr(dist, name)}
_NAME_OF: dict[int, str] = {id(fn): name for name, fn in _ORIGINALS.items()}


# ----------------------------------------------------------------------------------------------
# The meter.
# ----------------------------------------------------------------------------------------------


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0
    payload_bytes: int = 0


@dataclass
class PurposeStats:
    """One purpose's calls and bytes (as ``OpStats``) and the seconds this rank was held by
    them: each blocking call's duration, each asynchronous call's issue and its ``wait()``."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    pending: list = field(default_factory=list)  # CUDA: (start, end) events not yet read


@dataclass
class CommEvent:
    """One counted call (kept only when the meter is created with ``keep_events=True``)."""

    function: str  # the torch.distributed function called
    op: str  # its kind (OP_KINDS)
    group_size: int
    bytes: int
    payload_bytes: int


@dataclass(eq=False)  # identity: blocks are tracked per meter object
class CommMeter:
    """Counts this rank's collectives and p2p calls inside ``measure()`` blocks (cumulative
    over blocks). ``stats`` is keyed by (op kind, process-group size)."""

    keep_events: bool = False
    group_names: dict[int, str] = field(default_factory=dict)
    # Time each call by purpose (``by_purpose``) on this device's clock: "cpu" (wall time
    # around the call), "cuda" (events on the current stream, read by ``by_purpose``), None: off
    time_purposes: str | None = None
    stats: dict[tuple[str, int], OpStats] = field(default_factory=dict)
    group_stats: dict[tuple[str, str], OpStats] = field(default_factory=dict)
    purpose_stats: dict[str, PurposeStats] = field(default_factory=dict)
    events: list[CommEvent] = field(default_factory=list)
    _open: bool = field(default=False, init=False, repr=False)

    @contextlib.contextmanager
    def measure(self) -> Iterator[CommMeter]:
        if self._open:
            raise RuntimeError("CommMeter.measure() is already open for this meter")
        self._open = True
        _activate(self)
        try:
            yield self
        finally:
            _deactivate(self)
            self._open = False

    def _count(self, function: str, op: str, group, group_size: int, wire: int,
               payload: int) -> None:
        keyed = [(self.stats, (op, group_size))]
        if self.group_names:
            keyed.append((self.group_stats, (op, self._name_of(group, group_size))))
        for table, key in keyed:
            entry = table.get(key)
            if entry is None:
                entry = table[key] = OpStats()
            entry.calls += 1
            entry.bytes += wire
            entry.payload_bytes += payload
        if self.keep_events:
            self.events.append(CommEvent(function, op, group_size, wire, payload))

    def _purpose(self, purpose: str) -> PurposeStats:
        entry = self.purpose_stats.get(purpose)
        if entry is None:
            entry = self.purpose_stats[purpose] = PurposeStats()
        return entry

    def _name_of(self, group, group_size: int) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        return self.group_names.get(id(group), f"size{group_size}")

    @property
    def calls(self) -> int:
        return sum(s.calls for s in self.stats.values())

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.stats.values())

    @property
    def payload_bytes(self) -> int:
        return sum(s.payload_bytes for s in self.stats.values())

    def by_op(self) -> dict[str, dict[str, int]]:
        """{"<op>:<group size>": {"calls", "bytes", "payload_bytes"}}, sorted by key."""
        return {f"{op}:{n}": {"calls": s.calls, "bytes": s.bytes,
                              "payload_bytes": s.payload_bytes}
                for (op, n), s in sorted(self.stats.items())}

    def by_group(self) -> dict[str, dict[str, int]]:
        """{"<op>:<group name>": {"calls", "bytes", "payload_bytes"}}, sorted by key (empty
        unless the meter was given ``group_names``)."""
        return {f"{op}:{name}": {"calls": s.calls, "bytes": s.bytes,
                                 "payload_bytes": s.payload_bytes}
                for (op, name), s in sorted(self.group_stats.items())}

    def by_purpose(self) -> dict[str, dict[str, float]]:
        """{purpose: {"calls", "bytes", "ms"}}, sorted by purpose (empty unless the meter was
        made with ``time_purposes``). ``ms``: how long the calls held this rank (3 decimals);
        on CUDA this reads the events, waiting for them to complete."""
        for entry in self.purpose_stats.values():
            for start, end in entry.pending:
                end.synchronize()
                entry.seconds += start.elapsed_time(end) / 1000
            entry.pending.clear()
        return {purpose: {"calls": s.calls, "bytes": s.bytes, "ms": round(1000 * s.seconds, 3)}
                for purpose, s in sorted(self.purpose_stats.items())}

    def summary(self) -> dict[str, Any]:
        return {"calls": self.calls, "bytes": self.bytes, "payload_bytes": self.payload_bytes,
                "by_op": self.by_op(), "by_group": self.by_group(),
                "by_purpose": self.by_purpose()}


# Names for megatron-core's ProcessGroupCollection fields, most specific first: where several
# fields hold the same group object (e.g. the data-parallel group with and without CP at CP=1,
# or the distributed optimizer's intra-instance group), the first one here names it.
GROUP_FIELDS = ("tp", "pp", "cp", "ep", "expt_tp", "dp_cp", "intra_dp_cp", "dp", "expt_dp",
                "intra_expt_dp", "tp_cp", "tp_ep", "mp", "tp_dp_cp", "tp_ep_pp", "embd",
                "pos_embd")


def names_of_groups(collection) -> dict[int, str]:
    """{id(group): field name} of a ProcessGroupCollection's groups (``GROUP_FIELDS`` order)."""
    names: dict[int, str] = {}
    for name in GROUP_FIELDS:
        group = getattr(collection, name, None)
        if isinstance(group, dist.ProcessGroup):
            names.setdefault(id(group), name)
    return names


# ----------------------------------------------------------------------------------------------
# Installing and removing the wrappers.
# ----------------------------------------------------------------------------------------------

_LOCK = threading.RLock()
_ACTIVE: list[CommMeter] = []
_SAVED: list[tuple[Any, str, Any]] = []  # (owner, attribute, old value); "": a view marker
_MODULES_BEFORE: set[str] = set()
_LOCAL = threading.local()  # .depth: counted calls in progress on this thread


def _unwrap(fn: Any) -> Any:
    return getattr(fn, "__comm_meter_original__", fn)


def _is_wrapper(fn: Any) -> bool:
    try:
        return hasattr(fn, "__comm_meter_original__")
    except Exception:  # noqa: BLE001 -- a lazy module (tensorboard's) may fail to load on lookup
        return False


def _make_wrapper(name: str, original: Callable) -> Callable:
    rule, after = RULES[name]

    def counted(*args, **kwargs):
        depth = getattr(_LOCAL, "depth", 0)
        if depth or not _ACTIVE:
            return original(*args, **kwargs)
        records = None if after else _apply_rule(rule, name, args, kwargs)
        timers = _timing_meters()
        label = _label(name, records, kwargs, timers)
        purpose = label.purpose if label else None
        _LOCAL.depth = depth + 1
        try:
            with _profiler_range(label), _held(timers, purpose):
                result = original(*args, **kwargs)
        finally:
            _LOCAL.depth = depth
        if after:
            records = _apply_rule(rule, name, args, kwargs)
        _record(name, records, purpose)
        return _timed_works(result, purpose) if timers else result

    counted.__name__ = getattr(original, "__name__", name)
    counted.__qualname__ = counted.__name__
    counted.__doc__ = getattr(original, "__doc__", None)
    counted.__wrapped__ = original  # type: ignore[attr-defined]
    counted.__comm_meter_original__ = original  # type: ignore[attr-defined]
    return counted


@dataclass(frozen=True)
class _Label:
    purpose: str
    range_name: str


def _label(name: str, records: list | None, kwargs: dict, timers: list) -> _Label | None:
    """What the call is for (``parallel.comm_purpose``), when a meter times purposes or
    torch.profiler records (the frame walk, about 44 µs a call on a 2-core CPU machine, is
    skipped otherwise).

    The profiler's range is ``<purpose> <group>.<function>:<group size>`` (``<group>``: its
    name, ``world``, or ``size<n>`` for a group megatron-core does not name, e.g. a flexible
    CP group; ``<purpose> <function>:<size>`` when no active meter has group names)."""
    if not timers and not torch.autograd.profiler._is_profiler_enabled:
        return None
    group = records[0][1] if records else kwargs.get("group")
    size = _size(group)
    named = next((m._name_of(group, size) for m in list(_ACTIVE) if m.group_names), None)
    kinds = sorted({r[0] for r in records or ()})
    # a batch of point-to-point ops (megatron-core's send_forward_recv_backward): send_recv
    op = (kinds[0] if len(kinds) == 1 else "_".join(reversed(kinds))) if kinds else name
    # frames to pass over: this function and the counting wrapper
    purpose = purpose_of(op, named, skip=2)
    _LOCAL.last_purpose = purpose
    return _Label(purpose, f"{purpose} {named}.{name}:{size}" if named else
                  f"{purpose} {name}:{size}")


def _profiler_range(label: _Label | None):
    """While torch.profiler records (``train.profile_steps``): a range named by ``_label``
    around the call, so traces show what each collective is for and on which group it ran."""
    if label is None or not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    return torch.profiler.record_function(label.range_name)


def _timing_meters() -> list[CommMeter]:
    return [m for m in list(_ACTIVE) if m.time_purposes]


@contextlib.contextmanager
def _held(timers: list[CommMeter], purpose: str | None) -> Iterator[None]:
    """Add how long the block holds this rank to ``purpose`` in each of ``timers``:
    wall seconds on CPU (gloo blocks the caller until the collective is done); on CUDA a pair
    of events on the current stream, which a blocking collective (and a ``wait()``) makes
    wait for the communication, read later by ``CommMeter.by_purpose``."""
    if not timers or purpose is None:
        yield
        return
    cuda = [m for m in timers if m.time_purposes == "cuda"]
    if cuda:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - started
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        for meter in timers:
            entry = meter._purpose(purpose)
            if meter.time_purposes == "cuda":
                entry.pending.append((start, end))
            else:
                entry.seconds += seconds


class _TimedWork:
    """An asynchronous call's handle whose ``wait()`` counts to the call's purpose in the
    meters that time purposes when it is waited on (the step that waits, which may be a later
    one than the step that issued it); everything else is the handle's own."""

    __slots__ = ("_work", "_purpose")

    def __init__(self, work, purpose: str) -> None:
        self._work = work
        self._purpose = purpose

    def wait(self, *args, **kwargs):
        with _held(_timing_meters(), self._purpose):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _timed_works(result, purpose: str):
    """``result`` with its asynchronous handles (a ``Work``, or a list of them from a batch
    of point-to-point ops) timed at their ``wait()``."""
    if isinstance(result, dist.Work):
        return _TimedWork(result, purpose)
    if isinstance(result, list) and result and all(isinstance(w, dist.Work) for w in result):
        return [_TimedWork(w, purpose) for w in result]
    return result


def _coalescing_wrapper(original: Callable) -> Callable:
    """``torch.distributed._coalescing_manager`` whose communication (run when the block
    exits, or by its handle's ``wait()`` for asynchronous ops) counts to the purpose of the
    calls issued inside it (megatron-core's bucketed gradient and parameter sync)."""

    @contextlib.contextmanager
    def coalescing(*args, **kwargs):
        _LOCAL.last_purpose = None
        with contextlib.ExitStack() as stack:
            manager = original(*args, **kwargs)
            cm = stack.enter_context(_ExitTimed(manager))
            yield cm
        purpose = getattr(_LOCAL, "last_purpose", None)
        if purpose is not None and _timing_meters():
            cm.works[:] = [_TimedWork(w, purpose) for w in cm.works]

    coalescing.__wrapped__ = original  # type: ignore[attr-defined]
    coalescing.__comm_meter_original__ = original  # type: ignore[attr-defined]
    return coalescing


class _ExitTimed:
    """A context manager whose exit (where a coalesced batch of collectives runs) is timed
    under the purpose of the last call issued inside it."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __enter__(self):
        return self.inner.__enter__()

    def __exit__(self, *exc):
        with _held(_timing_meters(), getattr(_LOCAL, "last_purpose", None)):
            return self.inner.__exit__(*exc)


def _apply_rule(rule: Callable, name: str, args: tuple, kwargs: dict) -> list:
    # The meter only observes: a call its rule cannot read still runs, and is counted (with no
    # bytes) under "unmetered" so that it shows in the metrics instead of vanishing.
    try:
        return rule(*args, **kwargs)
    except Exception:  # noqa: BLE001
        return [("unmetered", None, 0, 0)]


def _record(name: str, records: list, purpose: str | None) -> None:
    with _LOCK:
        for op, group, wire, payload in records:
            n = _size(group)
            for meter in _ACTIVE:
                meter._count(name, op, group, n, wire, payload)
                if meter.time_purposes and purpose is not None:
                    entry = meter._purpose(purpose)
                    entry.calls += 1
                    entry.bytes += wire


_P2POP = dist.P2POp


class _UnwrappingP2POp(_P2POP):
    """``torch.distributed.P2POp`` while a block is open: torch checks ``op`` by identity
    against its own isend / irecv, so the counting wrappers are unwrapped here (the batch is
    counted by the ``batch_isend_irecv`` wrapper)."""

    def __new__(cls, op, tensor, *args, **kwargs):
        return super().__new__(cls, _unwrap(op), tensor, *args, **kwargs)

    def __init__(self, op, tensor, *args, **kwargs):
        super().__init__(_unwrap(op), tensor, *args, **kwargs)


_P2POP_KEY = "P2POp"


def _replacement(name: str, current: Any, wrappers: dict[str, Callable]) -> Any:
    """What to put in place of ``current`` (the value found under ``name``), or None."""
    if name == _P2POP_KEY:
        return _UnwrappingP2POp if current is _P2POP else None
    if _is_wrapper(current):
        return None
    original_name = _NAME_OF.get(id(current))
    if original_name is None:
        return None  # not a torch.distributed collective (e.g. megatron's own reduce-scatter)
    if original_name not in wrappers:
        wrappers[original_name] = _make_wrapper(original_name, current)
    return wrappers[original_name]


def _patch(owner: Any, attr: str, wrappers: dict[str, Callable], cache: bool = False) -> None:
    present = attr in owner.__dict__ if cache else hasattr(owner, attr)
    if not present:
        return
    current = owner.__dict__[attr] if cache else getattr(owner, attr)
    new = _replacement(attr, current, wrappers)
    if new is None:
        return
    _SAVED.append((owner, attr, current))
    setattr(owner, attr, new)


def _install() -> None:
    wrappers: dict[str, Callable] = {}
    for name in [*_ORIGINALS, _P2POP_KEY]:
        _patch(dist, name, wrappers)
    for module_name, attr in BOUND_NAMES:
        module = sys.modules.get(module_name)
        if module is not None:
            _patch(module, attr, wrappers)
    coalescing: dict[int, Callable] = {}  # id(original) -> its wrapper
    for module_name, attr in COALESCING_NAMES:
        module = sys.modules.get(module_name)
        current = getattr(module, attr, None) if module is not None else None
        if current is not None and not _is_wrapper(current):
            wrapper = coalescing.setdefault(id(current), _coalescing_wrapper(current))
            _SAVED.append((module, attr, current))
            setattr(module, attr, wrapper)
    for module_name, attr in CACHING_VIEWS:
        module = sys.modules.get(module_name)
        view = getattr(module, attr, None) if module is not None else None
        if view is not None:
            # Names it has not cached yet are fetched from torch.distributed (wrapped) during
            # the block; the marker, undone last, drops those entries again.
            _SAVED.append((view, "", None))
            for name in [*_ORIGINALS, _P2POP_KEY]:
                _patch(view, name, wrappers, cache=True)
    _MODULES_BEFORE.clear()
    _MODULES_BEFORE.update(sys.modules)


def _uninstall() -> None:
    while _SAVED:
        owner, attr, old = _SAVED.pop()
        if not attr:  # a caching view: drop wrappers it picked up during the block
            for name, value in list(owner.__dict__.items()):
                if _is_wrapper(value) or value is _UnwrappingP2POp:
                    del owner.__dict__[name]
            continue
        current = getattr(owner, attr, None)
        # Someone may have rebound the name during the block (megatron-core rebinds
        # dist_reduce_scatter_func for its fp32-accumulating reduce-scatter): keep theirs.
        if _is_wrapper(current) or current is _UnwrappingP2POp:
            setattr(owner, attr, old)
    # Modules imported during the block may have bound a wrapper at import: unbind it.
    for module_name in set(sys.modules) - _MODULES_BEFORE:
        module = sys.modules.get(module_name)
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if _is_wrapper(value):
                setattr(module, attr, _unwrap(value))
            elif value is _UnwrappingP2POp:
                setattr(module, attr, _P2POP)
    _MODULES_BEFORE.clear()


def _activate(meter: CommMeter) -> None:
    if meter.time_purposes:
        register_megatron()  # its imports happen here, not inside the block's first call
    with _LOCK:
        if not _ACTIVE:
            _install()
        _ACTIVE.append(meter)


def _deactivate(meter: CommMeter) -> None:
    with _LOCK:
        _ACTIVE.remove(meter)
        if not _ACTIVE:
            _uninstall()


def unlisted_bindings(prefixes: tuple[str, ...] = ("megatron.core", "glm5_train", "parallel")
                      ) -> list[str]:
    """Module-level names, in loaded modules under ``prefixes``, bound to a torch.distributed
    collective that no block would replace (not in ``BOUND_NAMES``). Empty when the lists are
    complete; ``tests/test_comm_meter.py`` checks it on the training path."""
    listed = set(BOUND_NAMES)
    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(prefixes):
            continue
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if id(value) in _NAME_OF and (module_name, attr) not in listed:
                found.append(f"{module_name}.{attr} = torch.distributed.{_NAME_OF[id(value)]}")
    return sorted(found)


def bound_names_present() -> list[str]:
    """The ``BOUND_NAMES`` entries that hold a torch.distributed collective now (a stale entry,
    whose module no longer binds the name, is missing from this list)."""
    present = []
    for module_name, attr in BOUND_NAMES:
        module = importlib.import_module(module_name)
        if id(getattr(module, attr, None)) in _NAME_OF:
            present.append(f"{module_name}.{attr}")
    return present


# ----------------------------------------------------------------------------------------------
# Bytes held: gradient buffers, optimizer state, parameters.
# ----------------------------------------------------------------------------------------------


def _unique_bytes(tensors: Iterable[torch.Tensor], exclude_storages: set[int] = frozenset()
                  ) -> int:
    """Bytes covered by ``tensors``, each storage byte counted once (views and shared storage
    deduplicated by merging byte ranges per storage); storages in ``exclude_storages`` skipped."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in exclude_storages or storage.nbytes() == 0:
            continue
        start = t.storage_offset() * t.element_size()
        if t.is_contiguous():
            end = start + t.numel() * t.element_size()
        else:  # a strided view spans up to its last element
            end = start + (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
                           ) * t.element_size()
        ranges.setdefault(key, []).append((start, min(end, storage.nbytes())))
    total = 0
    for spans in ranges.values():
        spans.sort()
        cur_start, cur_end = spans[0]
        for s, e in spans[1:]:
            if s > cur_end:
                total += cur_end - cur_start
                cur_start, cur_end = s, e
            else:
                cur_end = max(cur_end, e)
        total += cur_end - cur_start
    return total


def grad_buffers(chunks: list) -> list[torch.Tensor]:
    """Every megatron-core DDP gradient buffer of this rank: ``grad_data`` of each dense and
    expert-parallel ``_ParamAndGradBuffer`` of each model chunk."""
    out = []
    for chunk in chunks:
        for buffer in [*getattr(chunk, "buffers", []),
                       *getattr(chunk, "expert_parallel_buffers", [])]:
            if getattr(buffer, "grad_data", None) is not None:
                out.append(buffer.grad_data)
    return out


def _state_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _state_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _state_tensors(v)


def optimizer_tensors(optimizer, model_storages: set[int]) -> list[torch.Tensor]:
    """The tensors the optimizer holds beyond the model: every tensor in each torch optimizer's
    ``state`` (AdamW exp_avg, exp_avg_sq and its step counter; Muon's momentum_buffer) and the
    main parameters it steps when they are separate copies (fp32 main params of a bf16 model;
    with fp32 parameters the main params are the model's own, or views of them, and add nothing).
    """
    out = []
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", sub)
        for state in inner.state.values():
            out.extend(_state_tensors(state))
        # Distributed Muon keeps whole-matrix state (momentum, bf16 masters) outside ``state``.
        for state in getattr(inner, "matrix_state", {}).values():
            out.extend(_state_tensors(state))
        for group in inner.param_groups:
            for param in group["params"]:
                if param.untyped_storage().data_ptr() not in model_storages:
                    out.append(param)
    return out


def _inner_optimizers(optimizer) -> list:
    return [getattr(sub, "optimizer", sub)
            for sub in getattr(optimizer, "chained_optimizers", [optimizer])]


def host_optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """What a host-offloaded optimizer (``parallel.host_optimizer``; Muon's AdamW part with
    ``adamw_on_host``) holds in host memory: its parameter copies, gradient buffers and state
    there."""
    return [t for inner in _inner_optimizers(optimizer)
            for t in getattr(inner, "host_tensors", list)()]


def buffer_bytes(chunks: list, optimizer, zero2=None) -> dict[str, int]:
    """This rank's bytes held in gradient buffers, optimizer state and parameters.

    ``grad_buffer_bytes``: megatron-core DDP's contiguous grad buffers (fp32 here,
    ``grad_reduce_in_fp32``). The distributed optimizer does not shrink them: every rank keeps
    the full buffer and reduce-scatters into its own shard of it, so this equals plain DDP's.
    With Pipeline ZeRO2 (``zero2``): its slices, its accumulation buffers (which the DDP buffers
    now view) and pinned embedding gradients; also each part on its own
    (``zero2_slice_bytes``, ``zero2_accum_bytes``, ``zero2_pinned_bytes``).
    ``optimizer_state_bytes``: ``optimizer_tensors`` (state is created by the first step) on
    the device; with host-resident optimizer state (``parallel.optimizer_cpu_offload``) what
    it holds in host memory is ``optimizer_host_bytes`` instead (``host_optimizer_tensors``).
    ``param_bytes``: the model parameters of this rank's chunks (shared storage counted once).
    """
    params = [p for chunk in chunks for p in chunk.parameters()]
    model_storages = {p.untyped_storage().data_ptr() for p in params}
    host = host_optimizer_tensors(optimizer)
    host_storages = {t.untyped_storage().data_ptr() for t in host}
    held = {
        "grad_buffer_bytes": _unique_bytes(
            grad_buffers(chunks) + (zero2.held_tensors() if zero2 is not None else [])),
        "optimizer_state_bytes": _unique_bytes(optimizer_tensors(optimizer, model_storages),
                                               exclude_storages=model_storages | host_storages),
        "param_bytes": _unique_bytes(params),
    }
    if any(getattr(inner, "state_on_host", False) for inner in _inner_optimizers(optimizer)):
        held["optimizer_host_bytes"] = _unique_bytes(host)
    if zero2 is not None:  # its parts: slices, the accumulation buffers, pinned copies
        held.update({f"zero2_{name}_bytes": _unique_bytes(tensors)
                     for name, tensors in zero2.held_by_kind().items()})
    return held


# ----------------------------------------------------------------------------------------------
# metrics.jsonl fields.
# ----------------------------------------------------------------------------------------------


@collective_purpose("metrics")
def gather_fields(meter: CommMeter, held: dict[str, int]) -> dict[str, Any]:
    """The per-rank metrics fields, gathered from every rank (collective: every rank calls it,
    outside any ``measure()`` block so the gathering itself is not counted). Lists are indexed
    by global rank; a rank without an op has 0 there."""
    mine = {"summary": meter.summary(), "held": held}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    summaries = [e["summary"] for e in everyone]
    fields: dict[str, Any] = {
        "comm_bytes": [s["bytes"] for s in summaries],
        "comm_payload_bytes": [s["payload_bytes"] for s in summaries],
        "comm_calls": [s["calls"] for s in summaries],
        "comm_by_op": _per_rank(summaries, "by_op"),
    }
    if any(s["by_group"] for s in summaries):
        fields["comm_by_group"] = _per_rank(summaries, "by_group")
    if any(s["by_purpose"] for s in summaries):
        fields["comm_by_purpose"] = _per_rank(summaries, "by_purpose", ("calls", "bytes", "ms"))
    for name in everyone[0]["held"]:
        fields[name] = [e["held"][name] for e in everyone]
    return fields


def _per_rank(summaries: list[dict], table: str,
              parts: tuple[str, ...] = ("calls", "bytes", "payload_bytes")
              ) -> dict[str, dict[str, list]]:
    """{key: {part: [per global rank]}} of one summary table."""
    keys = sorted({key for s in summaries for key in s[table]})
    return {key: {part: [s[table].get(key, {}).get(part, 0) for s in summaries]
                  for part in parts}
            for key in keys}
