"""The device layer: what megatron-core's CUDA calls mean on a CPU + gloo process.

megatron-core 0.16.1 assumes a CUDA device. On a CPU build of torch it reaches a small, known set
of CUDA entry points (found by training the tiny model with every ``torch.cuda`` entry point
poisoned, ``tests/test_device.py``). This module holds the CPU meaning of each; which megatron-core
attribute each replaces, and why, is listed in one place, ``parallel/mcore_compat.py``, which
installs them when CUDA is absent. ``comm_device`` and ``param_device`` tell our own code where
its tensors live, on CPU and GPU alike.

Design: targeted attribute redirects, installed once per process, instead of a global
``TorchFunctionMode``. A function mode runs Python on every torch op (measured 1.3-1.4x
the step time of the tiny model, see ``bench/device_overhead.py``); the redirects cost nothing
on ops that do not call them (about 1% of a CPU step in all).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from megatron.core.pipeline_parallel.p2p_communication import _p2p_ops

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# Replacements. Each is the CPU meaning of the CUDA call it stands in for.
# ----------------------------------------------------------------------------------------------


def current_device() -> torch.device:
    # Must be a torch.device, not an int: an int is read as cuda:N by torch factories.
    return CPU


def lazy_call(callback: Callable, **_: Any) -> None:
    # CUDA queues RNG-state setters until CUDA is initialised; on CPU that never happens.
    callback()


class CpuGenerators:
    """Stands in for ``torch.cuda.default_generators``: every index is the CPU generator."""

    def __getitem__(self, index: Any) -> torch.Generator:
        return torch.default_generator

    def __len__(self) -> int:
        return 1


def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    # torch.manual_seed already seeded the CPU generator and calls this afterwards.
    return None


def no_op(*_: Any, **__: Any) -> None:
    return None


class CpuStream:
    """A stream on a device that executes in order: waiting and syncing are no-ops."""

    def __init__(self, *_: Any, **__: Any) -> None:
        self.device = CPU

    def wait_stream(self, _: Any) -> None:
        return None

    def wait_event(self, _: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> "CpuEvent":
        return event if event is not None else CpuEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CpuEvent:
    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def record(self, _: Any = None) -> None:
        return None

    def wait(self, _: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = CpuStream()


def current_stream(*_: Any, **__: Any) -> CpuStream:
    return _DEFAULT_STREAM


def stream_context(_: Any = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def tensor_cuda(self: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    # Literal `.cuda()` calls in megatron-core (optimizer buffers, loss trackers) stay on CPU.
    return self


_TORCH_TENSOR_TYPE = torch.Tensor.type


def tensor_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kw: Any):
    # megatron-core's optimizer whitelists parameters by type strings such as
    # 'torch.cuda.FloatTensor'; report CPU tensors under their CUDA names so the same checks pass.
    if dtype is None:
        # Idempotent: under a TorchFunctionMode torch dispatches the call back to the current
        # Tensor.type, i.e. to this function again, with the name already renamed.
        name = _TORCH_TENSOR_TYPE(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
    return _TORCH_TENSOR_TYPE(self, dtype, non_blocking, **kw)


def _cpu_device_kwargs(fn: Callable, view: Any) -> Callable:
    """Wrap a torch factory so that ``device='cuda'`` (or a cuda torch.device) becomes CPU;
    each such call is counted on ``view``."""

    def wrapper(*args: Any, **kwargs: Any):
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs["device"] = CPU
            view.__dict__["redirected"] += 1
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # an int device means cuda:N to torch factories


class CpuTorch:
    """A view of the ``torch`` module for one megatron-core file with literal ``device='cuda'``.

    Installed as the module-level name ``torch`` in that file only (the list is in
    ``parallel/mcore_compat.py``), so its factory calls land on CPU and every other module, ours
    included, keeps the real ``torch``. ``redirected`` counts the calls it moved to CPU: a view
    that never moves one on the training path is stale (``tests/test_device.py``).
    """

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like",
                  "ones_like", "empty_like", "full_like", "rand", "randn", "randint")

    def __init__(self, gloo_all_to_all: bool = False) -> None:
        self.__dict__["redirected"] = 0
        self._wrapped = {name: _cpu_device_kwargs(getattr(torch, name), self)
                         for name in self._FACTORIES}
        self._gloo = gloo_all_to_all

    def __getattr__(self, name: str) -> Any:
        # Only reached on the first lookup of a name: the value is then cached on the instance,
        # so hot paths (megatron.core.utils reads torch.distributed ~400 times a step) pay a
        # plain attribute read afterwards.
        wrapped = self.__dict__.get("_wrapped", {})
        if name in wrapped:
            value = wrapped[name]
        elif name == "distributed" and self.__dict__.get("_gloo"):
            value = GlooDistributed(self)
        else:
            value = getattr(torch, name)
        self.__dict__[name] = value
        return value


def _padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor.contiguous()
    out = tensor.new_zeros((rows, *tensor.shape[1:]))
    out[:tensor.shape[0]] = tensor
    return out


class _DoneWork:
    """The handle of a collective that has already completed (gloo runs these synchronously)."""

    def wait(self, *_: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_DONE = _DoneWork()


def _as_list(sizes: Any) -> Any:
    return sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes


class GlooDistributed:
    """``torch.distributed`` as megatron-core's MoE token dispatch needs it on gloo: gloo's
    all-to-all wants the split sizes as Python lists (megatron-core passes CPU tensors), and
    gloo has no uneven all-gather / list reduce-scatter (used over the expert-TP group).
    Conversions are counted on the owning view."""

    def __init__(self, view: Any) -> None:
        self._view = view

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        if isinstance(output_split_sizes, torch.Tensor) or isinstance(input_split_sizes,
                                                                       torch.Tensor):
            self._view.__dict__["redirected"] += 1
        return torch.distributed.all_to_all_single(
            output, input, _as_list(output_split_sizes), _as_list(input_split_sizes),
            group=group, async_op=async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        """megatron-core all-gathers uneven parts along dim 0 (the expert-TP token gather);
        gloo takes equal parts only: pad to the largest, gather, keep each part's rows."""
        if len({t.shape for t in tensor_list}) <= 1:
            return torch.distributed.all_gather(tensor_list, tensor, group=group,
                                                async_op=async_op)
        self._view.__dict__["redirected"] += 1
        rows = max(t.shape[0] for t in tensor_list)
        parts = [tensor.new_empty((rows, *tensor.shape[1:])) for _ in tensor_list]
        torch.distributed.all_gather(parts, _padded(tensor, rows), group=group)
        for out, part in zip(tensor_list, parts):
            out.copy_(part[:out.shape[0]])
        return _DONE if async_op else None

    def reduce_scatter(self, output, input_list, op=None, group=None, async_op=False):
        """megatron-core reduce-scatters uneven parts along dim 0 (the backward of the gather
        above); gloo has no list reduce-scatter: pad every part to the largest, reduce-scatter
        the stacked tensor, keep this rank's rows."""
        self._view.__dict__["redirected"] += 1
        rows = max(t.shape[0] for t in input_list)
        stacked = torch.cat([_padded(t, rows) for t in input_list])
        mine = stacked.new_empty((rows, *stacked.shape[1:]))
        kwargs = {} if op is None else {"op": op}
        torch.distributed.reduce_scatter_tensor(mine, stacked, group=group, **kwargs)
        output.copy_(mine[:output.shape[0]])
        return _DONE if async_op else None

    def __getattr__(self, name: str) -> Any:
        # Looked up afresh on every access (not cached): the communication meter wraps the
        # torch.distributed functions while it measures, and calls made through this view must
        # reach the wrappers. Only tensor_parallel.mappings sees this view (a few hundred
        # lookups a step).
        return getattr(torch.distributed, name)



# Shape messages travel under their own tag, so a shape is never matched with a tensor message.
_SHAPE_TAG = 7


def communicate_sends_first(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next,
                             tensor_shape, wait_on_reqs=True):
    """megatron-core's unbatched pipeline p2p (``P2PCommunicator._communicate``) with every send
    posted before any wait. Its own version first exchanges the shapes of variable-size tensors
    (a standalone MTP stage sends (1 + steps) x the sequence) and waits for them before posting
    the tensors. On gloo the two ends of a pipeline pair do not pair their calls one to one
    (rank A's recv is served by rank B's next call), so that wait deadlocks. Posting the sends
    first keeps the schedule's own guarantee: nothing waits on a message its peer has not been
    able to send. Same communicators as megatron's ``_p2p_ops`` (at PP=2 one direction uses the
    global group)."""
    variable = self.config.variable_seq_lengths or self.config.mtp_standalone
    keep, shape_reqs = [], []
    if variable:
        for tensor, peer in ((tensor_send_next, self.next_rank), (tensor_send_prev, self.prev_rank)):
            if tensor is not None:
                keep.append(torch.tensor(tensor.size(), dtype=torch.int64))
                shape_reqs.append(torch.distributed.isend(keep[-1], peer, group=self.pp_group,
                                                          tag=_SHAPE_TAG))
    reqs = _p2p_ops(tensor_send_prev=tensor_send_prev, tensor_recv_prev=None,
                    tensor_send_next=tensor_send_next, tensor_recv_next=None,
                    group=self.pp_group, prev_pipeline_rank=self.prev_rank,
                    next_pipeline_rank=self.next_rank)
    shape_prev = self._receive_shape(self.prev_rank) if recv_prev and variable else tensor_shape
    shape_next = self._receive_shape(self.next_rank) if recv_next and variable else tensor_shape
    recv_prev_tensor = self._recv_buffer(shape_prev) if recv_prev else None
    recv_next_tensor = self._recv_buffer(shape_next) if recv_next else None
    reqs.update(_p2p_ops(tensor_send_prev=None, tensor_recv_prev=recv_prev_tensor,
                         tensor_send_next=None, tensor_recv_next=recv_next_tensor,
                         group=self.pp_group, prev_pipeline_rank=self.prev_rank,
                         next_pipeline_rank=self.next_rank))
    for req in shape_reqs:
        req.wait()
    if wait_on_reqs:
        for req in reqs.values():
            req.wait()
        reqs = None
    return recv_prev_tensor, recv_next_tensor, reqs


def receive_shape(self, peer: int) -> list[int]:
    shape = torch.empty(3, dtype=torch.int64)
    torch.distributed.irecv(shape, peer, group=self.pp_group, tag=_SHAPE_TAG).wait()
    return shape.tolist()


def recv_buffer(self, shape) -> torch.Tensor:
    return torch.empty(shape, requires_grad=True, dtype=self.config.pipeline_dtype)


class Uncompiled:
    """Replacement marker: the function's own eager body, without its ``torch.compile`` wrapper.

    megatron-core decorates some hot functions with ``torch.compile`` at import time; on CPU each
    one costs seconds of Inductor compilation (and a C++ toolchain) for no gain at these sizes.
    """


def comm_device() -> torch.device:
    """The device of this process's tensors: batches, scalar reductions, model parameters.

    With CUDA: ``cuda:<local rank>``, the device ``init_distributed`` made current (NCCL
    collectives need tensors there). Without: the CPU (gloo). Stateless: asks torch each call.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def param_device(config) -> torch.device | int | None:
    """Where our modules create their parameters, as megatron-core's own layers do: no device
    (the CPU, or an enclosing ``with torch.device(...)``, e.g. meta) under
    ``use_cpu_initialization``, else the current CUDA device. A duck-typed config without the
    field (unit-test stubs) counts as CPU initialisation."""
    if getattr(config, "use_cpu_initialization", True):
        return None
    return torch.cuda.current_device()
