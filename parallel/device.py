"""Run megatron-core on CPU + gloo when CUDA is absent; do nothing when it is present.

megatron-core 0.16.1 assumes a CUDA device. On a CPU build of torch it reaches a small, known set
of CUDA entry points (see ``../shared/mcore_cpu_notes.md`` for how they were found). Every symbol
this module replaces is listed in ``REDIRECTS`` below, with the reason; nothing else is touched.
``tests/test_device.py`` fails when a megatron-core upgrade makes an entry stale (the target
vanished) or when a CUDA-only call appears on the paths we use (a tiny model trained under
``torch.cuda`` poisoning must not reach it).

Design: targeted attribute redirects, installed once per process, instead of a global
``TorchFunctionMode``. A function mode runs Python on every torch op (measured 1.3-1.4x
the step time of the tiny model, see ``bench/device_overhead.py``); the redirects cost nothing
on ops that do not call them (about 1% of a CPU step in all).
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# Replacements. Each is the CPU meaning of the CUDA call it stands in for.
# ----------------------------------------------------------------------------------------------


def _current_device() -> torch.device:
    # Must be a torch.device, not an int: an int is read as cuda:N by torch factories.
    return CPU


def _lazy_call(callback: Callable, **_: Any) -> None:
    # CUDA queues RNG-state setters until CUDA is initialised; on CPU that never happens.
    callback()


class _CpuGenerators:
    """Stands in for ``torch.cuda.default_generators``: every index is the CPU generator."""

    def __getitem__(self, index: Any) -> torch.Generator:
        return torch.default_generator

    def __len__(self) -> int:
        return 1


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.set_rng_state(new_state)


def _manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _manual_seed_all(seed: int) -> None:
    # torch.manual_seed already seeded the CPU generator and calls this afterwards.
    return None


def _noop(*_: Any, **__: Any) -> None:
    return None


class _CpuStream:
    """A stream on a device that executes in order: waiting and syncing are no-ops."""

    def __init__(self, *_: Any, **__: Any) -> None:
        self.device = CPU

    def wait_stream(self, _: Any) -> None:
        return None

    def wait_event(self, _: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> "_CpuEvent":
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _CpuEvent:
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


_DEFAULT_STREAM = _CpuStream()


def _current_stream(*_: Any, **__: Any) -> _CpuStream:
    return _DEFAULT_STREAM


def _stream_context(_: Any = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _tensor_cuda(self: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    # Literal `.cuda()` calls in megatron-core (optimizer buffers, loss trackers) stay on CPU.
    return self


_TORCH_TENSOR_TYPE = torch.Tensor.type


def _tensor_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kw: Any):
    # megatron-core's optimizer whitelists parameters by type strings such as
    # 'torch.cuda.FloatTensor'; report CPU tensors under their CUDA names so the same checks pass.
    if dtype is None:
        # Idempotent: under a TorchFunctionMode torch dispatches the call back to the current
        # Tensor.type, i.e. to this function again, with the name already renamed.
        name = _TORCH_TENSOR_TYPE(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
    return _TORCH_TENSOR_TYPE(self, dtype, non_blocking, **kw)


def _cpu_device_kwargs(fn: Callable) -> Callable:
    """Wrap a torch factory so that ``device='cuda'`` (or a cuda torch.device) becomes CPU."""

    def wrapper(*args: Any, **kwargs: Any):
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs["device"] = CPU
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)  # an int device means cuda:N to torch factories


class _CpuTorch:
    """A view of the ``torch`` module for megatron-core files with literal ``device='cuda'``.

    Installed as the module-level name ``torch`` in those files only (listed in
    ``CUDA_LITERAL_MODULES``), so their factory calls land on CPU and every other module, ours
    included, keeps the real ``torch``.
    """

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like",
                  "ones_like", "empty_like", "full_like", "rand", "randn", "randint")

    def __init__(self) -> None:
        self._wrapped = {name: _cpu_device_kwargs(getattr(torch, name)) for name in self._FACTORIES}

    def __getattr__(self, name: str) -> Any:
        # Only reached on the first lookup of a name: the value is then cached on the instance,
        # so hot paths (megatron.core.utils reads torch.distributed ~400 times a step) pay a
        # plain attribute read afterwards.
        wrapped = self.__dict__.get("_wrapped", {})
        if name in wrapped:
            value = wrapped[name]
        elif name == "distributed":
            value = _GLOO_DISTRIBUTED
        else:
            value = getattr(torch, name)
        self.__dict__[name] = value
        return value


def _as_list(sizes: Any) -> Any:
    return sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes


class _GlooDistributed:
    """``torch.distributed`` as the MoE all-to-all needs it on gloo: gloo's binding wants the
    split sizes as Python lists, megatron-core passes CPU tensors."""

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        return torch.distributed.all_to_all_single(
            output, input, _as_list(output_split_sizes), _as_list(input_split_sizes),
            group=group, async_op=async_op)

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch.distributed, name)
        self.__dict__[name] = value  # cache: see _CpuTorch.__getattr__
        return value


_GLOO_DISTRIBUTED = _GlooDistributed()


# Shape messages travel under their own tag, so a shape is never matched with a tensor message.
_SHAPE_TAG = 7


def _communicate_sends_first(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next,
                             tensor_shape, wait_on_reqs=True):
    """megatron-core's unbatched pipeline p2p (``P2PCommunicator._communicate``) with every send
    posted before any wait. Its own version first exchanges the shapes of variable-size tensors
    (a standalone MTP stage sends (1 + steps) x the sequence) and waits for them before posting
    the tensors. On gloo the two ends of a pipeline pair do not pair their calls one to one
    (rank A's recv is served by rank B's next call), so that wait deadlocks. Posting the sends
    first keeps the schedule's own guarantee: nothing waits on a message its peer has not been
    able to send. Same communicators as megatron's ``_p2p_ops`` (at PP=2 one direction uses the
    global group)."""
    from megatron.core.pipeline_parallel.p2p_communication import _p2p_ops

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


def _receive_shape(self, peer: int) -> list[int]:
    shape = torch.empty(3, dtype=torch.int64)
    torch.distributed.irecv(shape, peer, group=self.pp_group, tag=_SHAPE_TAG).wait()
    return shape.tolist()


def _recv_buffer(self, shape) -> torch.Tensor:
    return torch.empty(shape, requires_grad=True, dtype=self.config.pipeline_dtype)


class Uncompiled:
    """Replacement marker: the function's own eager body, without its ``torch.compile`` wrapper.

    megatron-core decorates some hot functions with ``torch.compile`` at import time; on CPU each
    one costs seconds of Inductor compilation (and a C++ toolchain) for no gain at these sizes.
    """


# ----------------------------------------------------------------------------------------------
# The list. Everything this module changes, in one place.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Redirect:
    """Replace the attribute ``module.attr`` with ``replacement`` when CUDA is absent."""

    module: str
    attr: str
    replacement: Any
    why: str
    binds_missing: bool = False  # True: upstream forgot to bind the name; we bind it


    @property
    def target(self) -> str:
        return f"{self.module}.{self.attr}"


REDIRECTS: tuple[Redirect, ...] = (
    Redirect("torch.cuda", "current_device", _current_device,
             "called ~6k times per run; must return a CPU torch.device"),
    Redirect("torch.cuda", "_lazy_call", _lazy_call, "RNG setters queue forever without CUDA"),
    Redirect("megatron.core.tensor_parallel.random", "_lazy_call", _lazy_call,
             "imported by name from torch.cuda"),
    Redirect("torch.cuda", "default_generators", _CpuGenerators(), "RNG tracker indexes it"),
    Redirect("torch.cuda", "get_rng_state", _get_rng_state, "RNG tracker saves states"),
    Redirect("torch.cuda.random", "get_rng_state", _get_rng_state, "RNG tracker saves states"),
    Redirect("torch.cuda", "set_rng_state", _set_rng_state, "checkpoint RNG restore"),
    Redirect("torch.cuda", "manual_seed", _manual_seed, "model_parallel_cuda_manual_seed"),
    Redirect("torch.cuda", "manual_seed_all", _manual_seed_all, "torch.manual_seed recurses"),
    Redirect("torch.cuda", "synchronize", _noop, "timers, optimizer, schedules"),
    Redirect("torch.cuda", "empty_cache", _noop, "called between phases"),
    Redirect("torch.cuda", "current_stream", _current_stream, "MoE dispatcher, p2p"),
    Redirect("torch.cuda", "default_stream", _current_stream, "p2p"),
    Redirect("torch.cuda", "Stream", _CpuStream, "MoE dispatcher, overlapped grad reduce"),
    Redirect("torch.cuda", "Event", _CpuEvent, "timers, overlapped grad reduce"),
    Redirect("torch.cuda", "stream", _stream_context, "`with torch.cuda.stream(s):`"),
    Redirect("torch.Tensor", "cuda", _tensor_cuda, "literal .cuda() in optimizer / trackers"),
    Redirect("torch.Tensor", "type", _tensor_type, "optimizer whitelists 'torch.cuda.*Tensor'"),
    Redirect("megatron.core.transformer.moe.router.TopKRouter", "_apply_expert_bias",
             Uncompiled(), "torch.compile'd; Inductor compile on every CPU process start"),
    Redirect("megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator",
             "_communicate", _communicate_sends_first,
             "variable-shape p2p (standalone MTP stage) deadlocks on gloo"),
    Redirect("megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator",
             "_receive_shape", _receive_shape, "helper of the p2p above", binds_missing=True),
    Redirect("megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator",
             "_recv_buffer", _recv_buffer, "helper of the p2p above", binds_missing=True),
)

# megatron-core files that create tensors with a literal device="cuda" (or
# device=torch.cuda.current_device() which is CPU after the redirect, so those need nothing).
CUDA_LITERAL_MODULES: tuple[str, ...] = (
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.mappings",  # all_to_all_single split sizes (gloo)
)


def cuda_is_available() -> bool:
    return torch.cuda.is_available()


def all_redirects() -> list[Redirect]:
    """REDIRECTS plus the per-module ``torch`` views, as one list (for tests and reports)."""
    views = [Redirect(m, "torch", _CPU_TORCH, "literal device='cuda' factories")
             for m in CUDA_LITERAL_MODULES]
    return list(REDIRECTS) + views + list(_megatron_fixes())


_CPU_TORCH = _CpuTorch()
_INSTALLED: dict[str, Any] = {}


def _megatron_fixes() -> tuple[Redirect, ...]:
    """Bugs megatron-core 0.16.1 has whenever Transformer Engine is absent (CPU or GPU)."""
    from parallel import mcore_fixes

    return mcore_fixes.FIXES


def install(force_cpu: bool | None = None) -> list[str]:
    """Install the CPU redirects once per process. Returns the targets now redirected.

    With CUDA present (and ``force_cpu`` not set) only the TE-absence fixes are applied, and only
    when Transformer Engine is missing.
    """
    on_cpu = (not cuda_is_available()) if force_cpu is None else force_cpu
    todo = list(_megatron_fixes())
    if on_cpu:
        todo = list(REDIRECTS) + [Redirect(m, "torch", _CPU_TORCH, "literal device='cuda'")
                                  for m in CUDA_LITERAL_MODULES] + todo
    for redirect in todo:
        _apply(redirect)
    return sorted(_INSTALLED)


def _apply(redirect: Redirect) -> None:
    if redirect.target in _INSTALLED:
        return
    owner = resolve_owner(redirect.module)
    problem = stale_reason(redirect, owner)
    if problem:
        raise RuntimeError(f"device layer: {problem}; update parallel/device.py for this version")
    original = getattr(owner, redirect.attr, None)
    replacement = redirect.replacement
    if isinstance(replacement, Uncompiled):
        replacement = getattr(original, "_torchdynamo_orig_callable", original)
    _INSTALLED[redirect.target] = original
    setattr(owner, redirect.attr, replacement)


def stale_reason(redirect: Redirect, owner: Any = None) -> str | None:
    """Why ``redirect`` no longer fits the installed torch / megatron-core, or None if it fits."""
    owner = resolve_owner(redirect.module) if owner is None else owner
    present = hasattr(owner, redirect.attr)
    if redirect.target in _INSTALLED:
        return None
    if redirect.binds_missing and present:
        return f"{redirect.target} is now bound upstream ({redirect.why}): drop the fix"
    if not redirect.binds_missing and not present:
        return f"{redirect.target} no longer exists ({redirect.why}): the redirect is stale"
    return None


def resolve_owner(dotted: str) -> Any:
    """Import a module by dotted path, or fetch a class such as ``torch.Tensor``."""
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError:
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)


def installed() -> list[str]:
    return sorted(_INSTALLED)
