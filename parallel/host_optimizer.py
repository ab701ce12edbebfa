"""Optimizer state in host memory: megatron-core's ``HybridDeviceOptimizer`` on any device.

megatron-core's hybrid optimizer (``OptimizerConfig.optimizer_cpu_offload``) steps the first
``offload_fraction`` of the parameters' elements (in parameter order) on the host: each such
parameter gets an fp32 host copy and a host gradient buffer, a CPU AdamW keeps its exp_avg and
exp_avg_sq there, the gradient is copied device -> host before the step and the updated value
host -> device after it (on side streams when ``overlap_cpu_optimizer_d2h_h2d``: one CPU
optimizer per parameter, each waiting only for its own copy). The rest steps on the device.

It tells device parameters by ``param.is_cuda``. Without CUDA it finds none, puts every
parameter in the host group without a host copy, and fails in its own bookkeeping at the first
step. ``HostOffloadedOptimizer`` is the same optimizer with "on the device" meaning "on the
compute device": on CUDA it is megatron-core's unchanged; on a CPU machine the host copies are
separate tensors (not pinned: pinning needs CUDA), so the same bytes move as on a GPU and the
meter counts them. ``mcore_compat`` installs it under megatron-core's name in
``megatron.core.optimizer`` and ``megatron.core.optimizer.distrib_optimizer`` (which builds and
type-checks the class by that name).

With the distributed optimizer and fp32 parameters megatron-core hands the hybrid optimizer
its shards as views of the model's parameters (``model_param.view(-1)[a:b]``), which autograd
counts as non-leaf tensors; torch's ``Optimizer`` refuses those when the hybrid optimizer builds
its groups ("can't optimize a non-leaf Tensor"; megatron's own path for torch's AdamW assigns
``param_groups`` directly and never meets the check). ``leaf_fp32_shards`` makes those shards
detached views of the same storage when offloading is on, as megatron-core already does for
bf16 parameters: the same elements, updated in place, gradients assigned the same way.

``host_tensors`` lists what it holds in host memory (``comm_meter.buffer_bytes`` counts it as
``optimizer_host_bytes``; the rest of its state is on the device).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

_BUILD_GROUPS = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"].__func__


_CLASS_KEYS = ("cpu_optimizer_cls", "gpu_optimizer_cls")


def _on_cuda() -> bool:
    return torch.cuda.is_available()


class HostOffloadedOptimizer(HybridDeviceOptimizer):
    """megatron-core's hybrid device/host optimizer, also on a CPU compute device."""

    state_on_host = True  # ``comm_meter`` reports ``optimizer_host_bytes``

    def _get_sub_optimizer_param_groups(self, offload_fraction: float):
        if _on_cuda():
            return super()._get_sub_optimizer_param_groups(offload_fraction)
        return self._cpu_sub_optimizer_param_groups(offload_fraction)

    def _cpu_sub_optimizer_param_groups(self, offload_fraction: float):
        """The parameter split of the CUDA path with every parameter on the compute device:
        the first ``offload_fraction`` of all elements get host copies (fp32), the others stay
        in the device groups (fp32 masters where ``param_update_in_fp32``)."""
        total = sum(p.numel() for group in self.param_groups for p in group["params"])
        budget = total * offload_fraction
        moved = 0
        host_groups, device_groups = [], []
        device_to_host, host_to_device, to_fp32 = {}, {}, {}
        for group in self.param_groups:
            host_group, device_group = dict(group, params=[]), dict(group, params=[])
            for param in group["params"]:
                if moved < budget:
                    copy = param.detach().to(torch.float32, copy=True)
                    moved += param.numel()
                    if param.dtype != torch.float32 and self.param_update_in_fp32:
                        to_fp32[param] = copy
                    device_to_host[param], host_to_device[copy] = copy, param
                    host_group["params"].append(copy)
                    continue
                inner = param
                if self.param_update_in_fp32 and param.dtype != torch.float32:
                    inner = to_fp32[param] = param.detach().to(torch.float32, copy=True)
                device_group["params"].append(inner)
            host_groups += [host_group] if host_group["params"] else []
            device_groups += [device_group] if device_group["params"] else []
        return host_groups, device_groups, device_to_host, host_to_device, to_fp32

    def adopt_loaded_state(self) -> None:
        """After a checkpoint loader wrote AdamW state into ``state`` (keyed by the device
        parameters, as ``parallel.distopt_checkpoint`` does) and the model's parameters were
        loaded: the host copies refreshed from those parameters and the state handed to the
        sub-optimizers that step them (``state`` is only their mirror; megatron-core's own
        ``load_state_dict`` path does both in its post-load hook)."""
        for param, copy in self.gpu_params_map_cpu_copy.items():
            if param not in self.param_to_fp32_param:  # fp32: the parameter is the master
                copy.data.copy_(param.data)
        self._sync_hdo_state_to_sub_optimizers()

    def _update_fp32_params_by_new_state(self):
        """The loaded fp32 masters into the copies the sub-optimizers step. megatron-core's
        looks every parameter up among the fp32 copies of low-precision ones, which fp32
        parameters do not have (KeyError); their host copies were just made from the loaded
        parameters themselves."""
        if not self.param_update_in_fp32:
            return
        for param, state in self.state.items():
            master = state.get("master_param")
            copy = self.param_to_fp32_param.get(param, self.gpu_params_map_cpu_copy.get(param))
            if master is not None and copy is not None and copy is not master:
                copy.data.copy_(master)

    def _move_new_state_to_right_device(self):
        if _on_cuda():
            return super()._move_new_state_to_right_device()
        return None  # one device: nothing to move (megatron-core's would call .to("cuda"))

    # ------------------------------------------------------------------ checkpoints

    def init_state(self) -> None:
        """Zero AdamW state for every parameter that has none, on the device its sub-optimizer
        steps it, so that a checkpoint can load into it (megatron-core's ``init_state_fn``,
        which it leaves None for this optimizer). Unlike ``dummy_step`` it moves no
        parameter."""
        for optimizer in self.sub_optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if optimizer.state.get(param):
                        continue
                    optimizer.state[param] = {
                        "step": torch.zeros((), dtype=torch.float32, device=param.device),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param,
                                                       memory_format=torch.preserve_format)}
        self._sync_sub_optimizers_state_to_hdo()

    def state_dict(self):
        """torch's state dict without the sub-optimizer classes megatron-core keeps in every
        group's defaults (a class does not load under ``torch.load(weights_only=True)``, and a
        checkpoint should not name the kernel that wrote it: a non-offloaded run resumes it),
        and without ``master_param`` where it only repeats an fp32 parameter's own value."""
        state = super().state_dict()
        for group in state["param_groups"]:
            for key in _CLASS_KEYS:
                group.pop(key, None)
        for index, param in enumerate(p for g in self.param_groups for p in g["params"]):
            if param.dtype == torch.float32:
                state["state"].get(index, {}).pop("master_param", None)
        return state

    def load_state_dict(self, state_dict):
        for group in state_dict["param_groups"]:
            for key in _CLASS_KEYS:
                group.setdefault(key, self.defaults[key])
        super().load_state_dict(state_dict)

    # ------------------------------------------------------------------ accounting

    def _host_tensors(self) -> Iterator[torch.Tensor]:
        for optimizer in self.cpu_optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    yield param
                    grad = self.cpu_copy_map_grad.get(param)
                    if grad is not None and grad.numel():
                        yield grad
                    yield from _tensors(optimizer.state.get(param, {}))

    def host_tensors(self) -> list[torch.Tensor]:
        return list(self._host_tensors())


def _tensors(state: dict) -> Iterator[torch.Tensor]:
    for value in state.values():
        if isinstance(value, torch.Tensor):
            yield value


def _leaf_view(shard: torch.Tensor) -> torch.Tensor:
    """A detached view carrying every attribute megatron-core set on the shard (its tensor-
    parallel attributes, ``shared``; 0.19 adds ``allreduce`` and grad-norm groups): copied
    whole, so whatever a release tags its shards with survives."""
    leaf = shard.detach()
    leaf.__dict__.update(shard.__dict__)
    return leaf


def _build_groups_with_leaf_fp32_shards(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges,
                                        config):
    """megatron-core's ``DistributedOptimizer._build_model_and_main_param_groups``; with
    ``optimizer_cpu_offload`` its fp32 shards (and the optimizer groups holding them) become
    detached views (module docstring)."""
    groups = _BUILD_GROUPS(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
    if not config.optimizer_cpu_offload:
        return groups
    shard_fp32_groups = groups[3]
    for group_range, shards in zip(opt_group_ranges, shard_fp32_groups):
        leaves = {id(s): _leaf_view(s) for s in shards if not s.is_leaf}
        shards[:] = [leaves.get(id(s), s) for s in shards]
        params = group_range["orig_group"]["params"]
        group_range["orig_group"]["params"] = [leaves.get(id(p), p) for p in params]
    return groups


leaf_fp32_shards = classmethod(_build_groups_with_leaf_fp32_shards)


def init_state_fn(optimizer: HostOffloadedOptimizer, config=None) -> None:
    """megatron-core's ``init_state_fn`` contract for ``HostOffloadedOptimizer``."""
    optimizer.init_state()


def provide_init_state(megatron_optimizer) -> None:
    """Give each of megatron-core's optimizer wrappers around a ``HostOffloadedOptimizer`` the
    state initialiser its checkpoint loading calls (megatron-core leaves it None)."""
    for sub in getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer]):
        if isinstance(getattr(sub, "optimizer", None), HostOffloadedOptimizer) \
                and getattr(sub, "init_state_fn", None) is None:
            sub.init_state_fn = init_state_fn
