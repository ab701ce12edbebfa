"""Muon for GLM-5's weight matrices, AdamW for everything else, with Muon Split for MLA.

Muon (Keller Jordan et al.; the Moonlight recipe for LLMs): momentum on the gradient, then the
update is orthogonalised by a quintic Newton-Schulz iteration and scaled to AdamW's update RMS
(0.2 * sqrt(max(rows, cols))) so AdamW's learning rate carries over; decoupled weight decay.
AdamW keeps the embedding, the output head, norms, biases and the router (the GLM-5 report's
split; the expert-score bias is a buffer and never optimised).

Muon Split (GLM-5 report, sec. 2.4): the MLA up-projections W_UQ (``linear_q_up_proj``) and
W_UK / W_UV (``linear_kv_up_proj``) are orthogonalised per attention head, each head's block on
its own. Heads are split over TP ranks whole, so the split needs no communication.

Tensor parallelism: a TP-sharded matrix that is orthogonalised as a whole is all-gathered over
its TP group (the expert-TP group for expert weights), orthogonalised, and each rank keeps its
own shard; Newton-Schulz commutes with row/column permutations, so the shard-interleaved
layout of a gathered SwiGLU fc1 ([g0; u0; g1; u1]) gives the same result as [gate; up].
Without the distributed optimizer every data-parallel rank computes every update; with it,
``parallel/distributed_muon.py`` gives each matrix one owner rank (zero-redundant Muon).
Which parameters get Muon, and the per-head blocks of Muon Split, follow megatron-core's GPT and
MLA parameter names and its MLATransformerConfig head widths, not a particular model.

This optimizer replaces the torch optimizer inside megatron-core's FP32 optimizer wrappers, so
megatron-core still does gradient gathering from DDP buffers, norm, clipping and checkpointing.

The AdamW part in host memory (``MuonConfig.adamw_on_host``, ``parallel.optimizer_cpu_offload``
with Muon): each AdamW parameter's exp_avg / exp_avg_sq live on the host beside a host copy of
the parameter and of its gradient; a step copies the value and the gradient over, runs the same
AdamW arithmetic there and copies the value back. The value is copied over every step (4 bytes
per element more than megatron-core's hybrid optimizer, which keeps its host copy between
steps) so that nothing (a checkpoint load, a change of the device value) can leave the host copy
stale; the AdamW part is the embedding, output head, norms and router, a small share of GLM-5.
Muon's momentum stays on the device: Newton-Schulz runs there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel import mcore_compat
from parallel.comm_purpose import collective_purpose

# Quintic Newton-Schulz coefficients tuned for fast convergence of singular values towards 1.
NS_COEFFS = (3.4445, -4.7750, 2.0315)
ADAMW_FOR = ("embedding.word_embeddings.weight", "output_layer.weight", "router.weight")


@dataclass
class MuonConfig:
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    split_mla: bool = True  # Muon Split: per-head W_UQ, W_UK, W_UV (GLM-5 default)
    adamw_on_host: bool = False  # the AdamW part's state in host memory (module docstring)


@dataclass
class MatrixLayout:
    """How one parameter is orthogonalised."""

    name: str
    muon: bool
    tp_group: object = None  # group to gather over (None: the local tensor is the whole matrix)
    tp_dim: int = 0  # axis the TP shards split
    head_blocks: tuple[int, ...] = ()  # Muon Split: per-head row blocks, repeated for each head


def newton_schulz(grad: torch.Tensor, steps: int) -> torch.Tensor:
    """Approximately orthogonalise a 2-D matrix (the U V^T of its SVD), in fp32."""
    x = grad.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (x.norm() + 1e-7)
    a, b, c = NS_COEFFS
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def _orthogonalise_blocks(update: torch.Tensor, blocks: tuple[int, ...], steps: int):
    """Muon Split: orthogonalise consecutive row blocks (per head, per sub-projection)."""
    out, start = torch.empty_like(update, dtype=torch.float32), 0
    while start < update.shape[0]:
        for size in blocks:
            out[start:start + size] = _scaled(newton_schulz(update[start:start + size], steps))
            start += size
    return out


def _scaled(ortho: torch.Tensor) -> torch.Tensor:
    # Match AdamW's update RMS (~0.2) so one learning rate serves both (Moonlight).
    return ortho * (0.2 * math.sqrt(max(ortho.shape)))


@collective_purpose("muon_matrix_all_gather")
def _gather(shard: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def orthogonal_update(update: torch.Tensor, layout: MatrixLayout, steps: int) -> torch.Tensor:
    """The scaled, orthogonalised update for this rank's shard of one matrix."""
    if layout.head_blocks:
        return _orthogonalise_blocks(update, layout.head_blocks, steps)
    if layout.tp_group is None:
        return _scaled(newton_schulz(update, steps))
    full = _gather(update, layout.tp_group, layout.tp_dim)
    ortho = _scaled(newton_schulz(full, steps))
    rank = dist.get_rank(layout.tp_group)
    return ortho.narrow(layout.tp_dim, rank * update.shape[layout.tp_dim],
                        update.shape[layout.tp_dim])


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the parameters whose layout says so, AdamW on the others.

    Takes megatron-core's existing param groups (their lr / weight_decay / betas / eps, which its
    scheduler keeps updating) and a layout per parameter.
    """

    def __init__(self, param_groups: list[dict], layouts: dict[int, MatrixLayout],
                 cfg: MuonConfig) -> None:
        super().__init__(param_groups, defaults={})
        self.layouts, self.cfg = layouts, cfg
        # adamw_on_host: parameter -> (its host value copy, its host gradient copy)
        self.host_copies: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def state_on_host(self) -> bool:
        """Whether part of the state lives in host memory (``comm_meter`` reports it)."""
        return self.cfg.adamw_on_host

    def init_state(self, *_: object) -> None:
        """Allocate every parameter's state (megatron-core calls this before loading a
        checkpoint into a fresh optimizer, as its ``init_state_fn``)."""
        for group in self.param_groups:
            for param in group["params"]:
                if self.state[param]:
                    continue
                if self.layouts[id(param)].muon:
                    self.state[param]["momentum_buffer"] = torch.zeros_like(param,
                                                                           dtype=torch.float32)
                else:
                    self._adamw_state(param)

    def _adamw_state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = self._adamw_zeros(param)
            state["exp_avg_sq"] = self._adamw_zeros(param)
        return state

    def _adamw_zeros(self, param: torch.Tensor) -> torch.Tensor:
        if not self.cfg.adamw_on_host:
            return torch.zeros_like(param, dtype=torch.float32)
        return _host_zeros(param)

    def _host_copies(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if param not in self.host_copies:
            self.host_copies[param] = (_host_zeros(param), _host_zeros(param))
        return self.host_copies[param]

    def host_tensors(self) -> list[torch.Tensor]:
        """What the AdamW part holds in host memory: value and gradient copies, moments."""
        if not self.cfg.adamw_on_host:
            return []
        out = [t for pair in self.host_copies.values() for t in pair]
        for group in self.param_groups:
            for param in group["params"]:
                if not self.layouts[id(param)].muon:
                    out += [v for v in self.state.get(param, {}).values()
                            if isinstance(v, torch.Tensor) and v.dim() > 0]
        return out

    def load_state_dict(self, state_dict) -> None:
        """torch's, then the AdamW moments back in host memory (torch's loader puts every
        state tensor on its parameter's device)."""
        super().load_state_dict(state_dict)
        if not self.cfg.adamw_on_host:
            return
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param, {})
                if not self.layouts[id(param)].muon:
                    for name in ("exp_avg", "exp_avg_sq"):
                        if name in state and state[name].device.type != "cpu":
                            state[name] = _host_zeros(param).copy_(state[name])

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                layout = self.layouts[id(param)]
                if layout.muon:
                    self._muon(param, group)
                else:
                    self._adamw(param, group)

    def _muon(self, param: torch.Tensor, group: dict) -> None:
        state = self.state[param]
        buf = state.setdefault("momentum_buffer", torch.zeros_like(param, dtype=torch.float32))
        grad = param.grad.float()
        buf.mul_(self.cfg.momentum).add_(grad)
        update = grad.add(buf, alpha=self.cfg.momentum) if self.cfg.nesterov else buf
        ortho = orthogonal_update(update, self.layouts[id(param)], self.cfg.ns_steps)
        param.mul_(1 - group["lr"] * group["weight_decay"])
        param.add_(ortho.to(param.dtype), alpha=-group["lr"])

    def _adamw(self, param: torch.Tensor, group: dict) -> None:
        state = self._adamw_state(param)
        if not self.cfg.adamw_on_host:
            _adamw_update(param, param.grad.float(), state, group)
            return
        value, grad = self._host_copies(param)
        value.copy_(param, non_blocking=True)
        grad.copy_(param.grad, non_blocking=True)
        if param.is_cuda:
            torch.cuda.current_stream().synchronize()  # the copies have landed
        _adamw_update(value, grad, state, group)
        param.copy_(value, non_blocking=True)


def _adamw_update(value: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    """One decoupled-weight-decay AdamW step of ``value`` in place (fp32 ``grad``)."""
    beta1, beta2 = group["betas"]
    state["step"] += 1
    step = float(state["step"])
    state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt().add_(group["eps"])
    value.mul_(1 - group["lr"] * group["weight_decay"])
    value.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** step))


def _host_zeros(param: torch.Tensor) -> torch.Tensor:
    """An fp32 host tensor of ``param``'s shape (pinned where CUDA copies from it); on a CPU
    compute device a separate tensor all the same, so the bytes really move."""
    return torch.zeros(param.shape, dtype=torch.float32, device="cpu",
                       pin_memory=torch.cuda.is_available())


def matrix_layouts(chunks: list[torch.nn.Module], cfg: MuonConfig, config,
                   groups) -> dict[int, MatrixLayout]:
    """Decide, for every parameter of this rank, Muon or AdamW and how to orthogonalise.
    ``config``: megatron-core's MLATransformerConfig (head widths for Muon Split); ``groups``:
    megatron-core's ProcessGroupCollection (the TP and expert-TP groups to gather over)."""
    layouts = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            layouts[id(param)] = _layout(name, param, cfg, config, groups)
    return layouts


def _layout(name: str, param: torch.Tensor, cfg: MuonConfig, config, groups) -> MatrixLayout:
    if param.dim() != 2 or name.endswith(ADAMW_FOR):
        return MatrixLayout(name, muon=False)
    # megatron-core's MLA: linear_q_up_proj rows are per head [nope + rope], linear_kv_up_proj
    # rows per head [K nope; V] (qk_head_dim is the no-RoPE part of a query/key head).
    if cfg.split_mla and name.endswith("linear_q_up_proj.weight"):
        return MatrixLayout(name, muon=True,
                            head_blocks=(config.qk_head_dim + config.qk_pos_emb_head_dim,))
    if cfg.split_mla and name.endswith("linear_kv_up_proj.weight"):
        return MatrixLayout(name, muon=True, head_blocks=(config.qk_head_dim, config.v_head_dim))
    if not getattr(param, "tensor_model_parallel", False):
        return MatrixLayout(name, muon=True)
    expert = getattr(param, "allreduce", True) is False
    group = groups.expt_tp if expert else groups.tp
    if dist.get_world_size(group) == 1:
        return MatrixLayout(name, muon=True)
    return MatrixLayout(name, muon=True, tp_group=group, tp_dim=param.partition_dim)


def install_on_fp32_optimizer(sub, layouts: dict[int, MatrixLayout], cfg: MuonConfig) -> None:
    """Swap the torch optimizer inside one of megatron-core's (non-distributed) optimizer
    wrappers for MuonAdamW; megatron keeps gathering, clipping and checkpointing around it."""
    inner = MuonAdamW(sub.optimizer.param_groups, _with_main_params(sub, layouts), cfg)
    mcore_compat.replace_attribute(sub, "optimizer", inner)
    mcore_compat.replace_attribute(sub, "init_state_fn", inner.init_state)
def _with_main_params(sub, layouts: dict[int, MatrixLayout]) -> dict[int, MatrixLayout]:
    """bf16/fp16 models: megatron-core steps fp32 copies of the parameters (its
    ``fp32_from_float16_groups``); they take their model parameter's layout."""
    out = dict(layouts)
    for models, mains in zip(getattr(sub, "float16_groups", []),
                             getattr(sub, "fp32_from_float16_groups", [])):
        for model, main in zip(models, mains):
            out[id(main)] = layouts[id(model)]
    return out
