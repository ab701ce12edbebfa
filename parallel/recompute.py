"""Activation recompute: keep fewer tensors for backward and recompute them there.

Two granularities (``Recompute``; the job sets it from ``activations.recompute_*``):

- **full**: whole decoder layers are recomputed, each recompute unit keeping only its input.
  megatron-core's own ``TransformerBlock`` / ``MultiTokenPredictionLayer`` checkpointing
  (``tensor_parallel.checkpoint``: reentrant, RNG states restored through the device layer's
  redirects on CPU). ``uniform``: every chunk's layers in groups of ``num_layers``; ``block``:
  only the first ``num_layers`` layers of each chunk, one unit each. Each MTP step is one unit
  under ``uniform`` (megatron-core allows only ``num_layers=1`` there) and is not recomputed
  under ``block`` (megatron-core 0.16.1 has no block recompute for MTP).
- **selective**: parts of every layer (MTP layers included), by name:
  ``mla_up_proj``: megatron-core's MLA up-projection + RoPE recompute (``recompute_up_proj``);
  ``core_attn``: the DSA core attention checkpoints its own forward (its ``recompute_core``),
  because megatron-core's ``checkpoint_core_attention`` drops DSA's ``x`` / ``qr`` arguments:
  megatron's ``core_attn`` stays off (``mcore_fields``);
  ``moe_act``: the SwiGLU of the routed and shared experts (``ActivationRecomputeMLP``):
  megatron-core 0.16.1 recomputes ``moe_act`` only for grouped-GEMM experts, we run
  ``SequentialMLP``. The experts' fc1 output stays saved; the activation's intermediates and
  fc2's input are freed after fc2 and recomputed when fc2's output gradient arrives (megatron's
  ``CheckpointWithoutOutput``, as its grouped experts do). A spec-level swap of the experts'
  module classes (``with_expert_activation_recompute``): no megatron-core code is changed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core.tensor_parallel import CheckpointWithoutOutput
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")
MODULES = ("core_attn", "mla_up_proj", "moe_act")
# Selective modules megatron-core recomputes itself, under the same name.
MEGATRON_MODULES = ("mla_up_proj",)


@dataclass(frozen=True)
class Recompute:
    """What is recomputed (checked by the job's config, ``glm5_train/activation_config.py``)."""

    granularity: str | None = None  # None, "full" or "selective"
    method: str | None = None  # full: "uniform" or "block"
    num_layers: int | None = None  # full: layers per unit (uniform) / per chunk (block)
    modules: tuple[str, ...] = ()  # selective: names from MODULES

    @property
    def full(self) -> bool:
        return self.granularity == "full"

    def selects(self, module: str) -> bool:
        return self.granularity == "selective" and module in self.modules

    def mcore_fields(self) -> dict:
        """megatron-core TransformerConfig fields. ``recompute_modules`` is always given
        explicitly: megatron defaults None to ["core_attn"] (its checkpoint_core_attention)."""
        if self.full:
            return dict(recompute_granularity="full", recompute_method=self.method,
                        recompute_num_layers=self.num_layers, recompute_modules=[])
        theirs = [m for m in self.modules if m in MEGATRON_MODULES]
        return dict(recompute_granularity="selective" if theirs else None,
                    recompute_method=None, recompute_num_layers=None, recompute_modules=theirs)

    def recomputed_layers(self, count: int) -> int:
        """Full recompute: how many of a chunk's ``count`` decoder layers are recomputed."""
        if not self.full:
            return 0
        return count if self.method == "uniform" else min(count, self.num_layers)

    def units(self, count: int) -> int:
        """Full recompute: checkpoint units (each keeps its input) over ``count`` layers."""
        if not self.full:
            return 0
        if self.method == "uniform":
            return -(-count // self.num_layers)
        return min(count, self.num_layers)

    @property
    def mtp_steps_recomputed(self) -> bool:
        """megatron-core recomputes MTP layers under full-uniform only (block: skipped)."""
        return self.full and self.method == "uniform"


# ------------------------------------------------------------------ expert activation recompute


def _expert_activation(config, fc1_output: torch.Tensor,
                       scale: torch.Tensor | None) -> torch.Tensor:
    """The experts' activation as megatron-core's unfused MLP computes it (same operations in
    the same order, hence the same bits): GLU, then the routing probability per token."""
    if config.gated_linear_unit:
        gate, up = torch.chunk(fc1_output, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate, up = gate.clamp(min=None, max=clamp), up.clamp(min=-clamp, max=clamp)
        out = config.activation_func(gate) * (up + config.glu_linear_offset)
    else:
        out = config.activation_func(fc1_output)
    if scale is None:
        return out
    return (out * scale.unsqueeze(-1)).to(out.dtype)


def _check_unfused(config) -> None:
    if config.add_bias_linear or config.use_te_activation_func or config.bias_activation_fusion:
        raise ValueError(
            "activations.recompute_modules=[moe_act] recomputes the unfused, bias-free "
            "SwiGLU (add_bias_linear, use_te_activation_func and bias_activation_fusion "
            "must be off, as GLM-5 builds them): drop moe_act from recompute_modules")


class ActivationRecomputeMLP(MLP):
    """megatron-core's MLP whose activation (and routing-probability scale) is recomputed in
    backward: fc1's output is the only tensor kept between fc1 and fc2; fc2's input is freed
    once fc2 has run and rebuilt when fc2's output gradient arrives, before fc2's backward.
    It adds no state to MLP: a built expert becomes one by its class
    (``ActivationRecomputeSequentialMLP``)."""

    def __init__(self, config, *args, **kwargs) -> None:
        _check_unfused(config)
        super().__init__(config, *args, **kwargs)

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None,
                **_: object):
        fc1_output, _bias = self.linear_fc1(hidden_states)
        # megatron reads fp8 as "a recipe or None" (fp8=False would mean fp8 on, needing TE).
        checkpoint = CheckpointWithoutOutput(fp8=self.config.fp8)
        activated = checkpoint.checkpoint(partial(_expert_activation, self.config), fc1_output,
                                          per_token_scale)
        output, output_bias = self.linear_fc2(activated)
        checkpoint.discard_output_and_register_recompute(output)
        return output, output_bias


class ActivationRecomputeSequentialMLP(SequentialMLP):
    """megatron-core's SequentialMLP, built as megatron builds it (same parameters, names and
    sharded state, whatever arguments the release passes its experts), whose experts are
    ``ActivationRecomputeMLP``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _check_unfused(self.config)
        for expert in self.local_experts:
            if type(expert) is not MLP:
                raise ValueError(
                    f"activations.recompute_modules=[moe_act]: this megatron-core's "
                    f"SequentialMLP builds {type(expert).__name__} experts, not MLP: drop "
                    "moe_act from recompute_modules")
            expert.__class__ = ActivationRecomputeMLP


class ActivationRecomputeSharedExpertMLP(SharedExpertMLP, ActivationRecomputeMLP):
    """megatron-core's shared expert; its ``super().forward`` resolves to
    ``ActivationRecomputeMLP.forward`` (method resolution order: this, SharedExpertMLP,
    ActivationRecomputeMLP, MLP)."""

    def __init__(self, *args, **kwargs) -> None:
        config = kwargs.get("config", args[0] if args else None)
        if getattr(config, "use_grouped_gemm_for_shared_expert", False):
            raise ValueError(
                "activations.recompute_modules=[moe_act] recomputes the unfused shared expert; "
                "use_grouped_gemm_for_shared_expert builds a fused one: drop moe_act from "
                "recompute_modules")
        super().__init__(*args, **kwargs)


def _build_shared_experts(*, submodules, **kwargs) -> ActivationRecomputeSharedExpertMLP:
    """megatron-core 0.17+'s shared-expert builder (keyword arguments), recomputing."""
    return ActivationRecomputeSharedExpertMLP(submodules=submodules, **kwargs)


_EXPERT_SWAPS = {SequentialMLP: ActivationRecomputeSequentialMLP,
                 SharedExpertMLP: ActivationRecomputeSharedExpertMLP}
# megatron-core 0.17+ writes specs as builders (functools.partial), the shared expert's through a
# module-level function that picks the fused or unfused class from the config.
_BUILDER_SWAPS = {"SequentialMLP": ActivationRecomputeSequentialMLP,
                  "SharedExpertMLP": ActivationRecomputeSharedExpertMLP,
                  "_build_shared_experts": _build_shared_experts}


def with_expert_activation_recompute(layer: ModuleSpec) -> ModuleSpec:
    """A copy of a decoder-layer spec whose routed and shared experts recompute their
    activation; a dense-MLP layer is returned unchanged. Both ways megatron-core writes an
    MLP spec are read: ``ModuleSpec(module, submodules=...)`` (0.16) and a builder
    ``partial(module, submodules=...)`` (0.17+); anything else is refused, never skipped."""
    layer = copy.deepcopy(layer)
    mlp = layer.submodules.mlp
    submodules = _submodules_of(mlp)
    if not hasattr(submodules, "experts"):
        if not isinstance(submodules, MLPSubmodules):
            raise ValueError(
                f"activations.recompute_modules=[moe_act]: cannot read this layer's MLP spec "
                f"({mlp!r}): drop moe_act from recompute_modules")
        return layer  # a dense MLP: no experts
    for field in ("experts", "shared_experts"):
        builder = getattr(submodules, field, None)
        if builder is not None:
            setattr(submodules, field, _recomputing(builder, field))
    return layer


def _submodules_of(mlp):
    if isinstance(mlp, ModuleSpec):
        return mlp.submodules
    if isinstance(mlp, partial):
        return mlp.keywords.get("submodules")
    return None


def _recomputing(builder, field: str):
    """The experts' (or shared experts') spec or builder, building the recomputing class."""
    if isinstance(builder, ModuleSpec) and builder.module in _EXPERT_SWAPS:
        builder.module = _EXPERT_SWAPS[builder.module]
        return builder
    target = getattr(builder, "func", None)
    if isinstance(builder, partial) and getattr(target, "__name__", None) in _BUILDER_SWAPS:
        return partial(_BUILDER_SWAPS[target.__name__], *builder.args, **builder.keywords)
    raise ValueError(
        f"activations.recompute_modules=[moe_act] needs SequentialMLP experts and "
        f"megatron's SharedExpertMLP; this layer's {field} are built by {builder!r}: "
        "drop moe_act from recompute_modules")


def set_core_attention_recompute(modules, enabled: bool) -> None:
    """Set ``recompute_core`` (checkpoint its own forward) on each core-attention module given
    (the DSA core attention of every decoder and MTP layer)."""
    for module in modules:
        if not hasattr(module, "recompute_core"):
            raise ValueError(
                f"activations.recompute_modules=[core_attn]: {type(module).__name__} cannot "
                "recompute itself (no recompute_core): drop core_attn from recompute_modules")
        module.recompute_core = enabled
