"""GLM-5 model configuration, named after the Hugging Face ``config.json`` of ``zai-org/GLM-5``.

``GLM5Config`` holds exactly the architecture keys of the released config (same names, same
meaning) so that a ``configs/model/*.yaml`` file and an HF ``config.json`` are interchangeable.
``to_mcore_config`` maps it onto megatron-core's ``MLATransformerConfig``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import MLATransformerConfig

from parallel.layout import ParallelSizes
from parallel.recompute import Recompute

# GLM5Config fields that tune training, not the architecture: free to change on resume.
TRAINING_FIELDS = frozenset({"moe_aux_loss_coeff", "moe_router_bias_update_rate", "name",
                             "mtp_num_steps", "mtp_loss_weight"})


@dataclass
class GLM5Config:
    """Architecture of a GLM-5 flavour. Field names and meanings follow HF ``config.json``."""

    vocab_size: int = 154880
    hidden_size: int = 6144
    num_hidden_layers: int = 78
    first_k_dense_replace: int = 3
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    rope_interleave: bool = True
    indexer_rope_interleave: bool = True
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 202752
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    attention_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    num_nextn_predict_layers: int = 1
    # Training-side knobs that are not part of the HF architecture.
    moe_aux_loss_coeff: float = 0.0
    moe_router_bias_update_rate: float = 1e-3
    # Multi-token prediction: the ``num_nextn_predict_layers`` MTP parameter sets are applied
    # for this many prediction steps, cycling (GLM-5: 1 set, 3 steps); 0 trains without MTP.
    mtp_num_steps: int = 3
    # Weight of the MTP loss (mean over steps) next to the main LM loss.
    mtp_loss_weight: float = 0.3
    name: str = "glm5"

    def validate(self) -> None:
        """Raise ValueError naming the field, the rule and the fix for an impossible config."""
        for check in (_check_types, _check_dense_prefix, _check_routing, _check_attention,
                      _check_mtp):
            check(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "GLM5Config":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"model config: unknown field(s) {unknown}; known fields are the HF "
                             f"GLM-5 config.json keys: {sorted(known)}")
        return cls(**values)

    @property
    def moe_layer_pattern(self) -> list[int]:
        """1 for an MoE layer, 0 for a dense layer, per decoder layer."""
        k = self.first_k_dense_replace
        return [0] * k + [1] * (self.num_hidden_layers - k)

    @property
    def mtp_sets(self) -> int:
        """MTP parameter sets the model builds: none when MTP is not trained."""
        return self.num_nextn_predict_layers if self.mtp_num_steps > 0 else 0


# Fields that may be null (HF: a model without a query latent has q_lora_rank null).
NULLABLE_FIELDS = frozenset({"q_lora_rank"})


def _check_types(cfg: GLM5Config) -> None:
    """Hydra passes a mistyped override (model.hidden_size=abc) through as a string: stop it
    here, before it fails deep inside megatron-core."""
    defaults = GLM5Config()
    for f in dataclasses.fields(cfg):
        value, want = getattr(cfg, f.name), type(getattr(defaults, f.name))
        if value is None and f.name in NULLABLE_FIELDS:
            continue
        ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
        if want is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise ValueError(f"model.{f.name}={value!r}: expected type {want.__name__} like the "
                             f"default {getattr(defaults, f.name)!r}")


def _check_dense_prefix(cfg: GLM5Config) -> None:
    if not 0 <= cfg.first_k_dense_replace <= cfg.num_hidden_layers:
        raise ValueError(
            f"model.first_k_dense_replace={cfg.first_k_dense_replace} must lie in "
            f"[0, num_hidden_layers={cfg.num_hidden_layers}]: lower it or add layers")


def _check_routing(cfg: GLM5Config) -> None:
    if cfg.scoring_func != "sigmoid":
        raise ValueError(f"model.scoring_func={cfg.scoring_func!r}: GLM-5 routes with 'sigmoid'")
    if cfg.topk_method not in ("noaux_tc", "greedy"):
        raise ValueError(f"model.topk_method={cfg.topk_method!r}: use 'noaux_tc' (GLM-5) or "
                         "'greedy' (no expert-bias correction)")
    if not 1 <= cfg.num_experts_per_tok <= cfg.n_routed_experts:
        raise ValueError(
            f"model.num_experts_per_tok={cfg.num_experts_per_tok} must be in "
            f"[1, n_routed_experts={cfg.n_routed_experts}]")
    if not cfg.norm_topk_prob:
        raise ValueError("model.norm_topk_prob=false: megatron-core's sigmoid router always "
                         "normalises the top-k weights (GLM-5 does too); set it to true")
    if cfg.n_group < 1 or cfg.n_routed_experts % cfg.n_group:
        raise ValueError(f"model.n_group={cfg.n_group} must divide n_routed_experts="
                         f"{cfg.n_routed_experts}")
    if cfg.n_group > 1:
        _check_group_routing(cfg)
    if cfg.n_shared_experts < 0:  # transformer_config.py:1084 (shared width must be > 0)
        raise ValueError(f"model.n_shared_experts={cfg.n_shared_experts} must be >= 0")


def _check_group_routing(cfg: GLM5Config) -> None:
    """megatron-core's group-limited routing: transformer_config.py:1658 (topk_group <= n_group)
    and moe_utils.py:554 (the top-k experts come from the topk_group chosen groups)."""
    per_group = cfg.n_routed_experts // cfg.n_group
    if not 1 <= cfg.topk_group <= cfg.n_group:
        raise ValueError(f"model.topk_group={cfg.topk_group} must lie in [1, n_group="
                         f"{cfg.n_group}] (groups chosen per token)")
    if cfg.num_experts_per_tok > cfg.topk_group * per_group:
        raise ValueError(
            f"model.num_experts_per_tok={cfg.num_experts_per_tok} exceeds the experts of the "
            f"topk_group={cfg.topk_group} chosen groups ({cfg.topk_group} x {per_group} experts "
            "per group): raise model.topk_group or lower num_experts_per_tok")


def _check_attention(cfg: GLM5Config) -> None:
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        raise ValueError(
            f"model.num_key_value_heads={cfg.num_key_value_heads}: MLA has one KV head per query "
            f"head; set it to num_attention_heads={cfg.num_attention_heads}")
    if cfg.qk_rope_head_dim % 2:
        raise ValueError(f"model.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (RoPE "
                         "rotates pairs)")
    for name in ("rope_interleave", "indexer_rope_interleave"):
        if not getattr(cfg, name):
            raise ValueError(f"model.{name}=false: only GLM-5's interleaved RoPE layout is "
                             f"implemented; set model.{name}=true")
    if cfg.hidden_act != "silu":
        raise ValueError(f"model.hidden_act={cfg.hidden_act!r}: GLM-5 uses 'silu' (SwiGLU)")
    if cfg.attention_bias:
        # to_mcore_config maps it to add_bias_linear, which megatron-core's shared expert
        # refuses (shared_experts.py:47), as do our replicated MLA down projections.
        raise ValueError("model.attention_bias=true: GLM-5's linears have no bias and biased "
                         "MoE / MLA layers are not supported; set model.attention_bias=false")


def _check_mtp(cfg: GLM5Config) -> None:
    steps, sets = cfg.mtp_num_steps, cfg.num_nextn_predict_layers
    if steps < 0 or sets < 0:
        raise ValueError(f"model.mtp_num_steps={steps} and model.num_nextn_predict_layers={sets} "
                         "must be >= 0")
    if steps and not sets:
        raise ValueError(f"model.mtp_num_steps={steps} needs an MTP layer, but "
                         "model.num_nextn_predict_layers=0: set num_nextn_predict_layers=1 "
                         "(GLM-5) or model.mtp_num_steps=0 to train without MTP")
    if steps and steps < sets:
        raise ValueError(f"model.mtp_num_steps={steps} < num_nextn_predict_layers={sets}: "
                         "every MTP parameter set needs a step; raise mtp_num_steps")
    if cfg.mtp_loss_weight < 0:
        raise ValueError(f"model.mtp_loss_weight={cfg.mtp_loss_weight} must be >= 0")


def to_mcore_config(model: GLM5Config, par: ParallelSizes,
                    params_dtype: torch.dtype = torch.float32,
                    perform_initialization: bool = True,
                    use_cpu_initialization: bool = True,
                    recompute: Recompute | None = None,
                    overrides: dict | None = None) -> MLATransformerConfig:
    """Map GLM-5's HF-named architecture plus a parallel layout onto megatron-core's config.

    ``use_cpu_initialization``: True builds parameters with no device (the CPU, or whatever a
    ``with torch.device(...)`` context says: tools/count_params.py builds on meta); False builds
    them on ``torch.cuda.current_device()`` as megatron-core's GPU path does (the trainer on
    CUDA, see ``glm5_train.train.build_model``).
    ``recompute``: activation recompute; its megatron-core fields (full granularity,
    ``mla_up_proj``) go into the config, the rest is built by ``build_model_chunks``.
    ``overrides``: megatron-core fields set last (a benchmark's ``moe_grouped_gemm``)."""
    model.validate()
    bf16 = params_dtype == torch.bfloat16
    kwargs = dict(
        # Architecture.
        num_layers=model.num_hidden_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=model.attention_bias,
        hidden_dropout=0.0,
        attention_dropout=model.attention_dropout,
        init_method_std=model.initializer_range,
        # MLA.
        multi_latent_attention=True,
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_head_dim=model.qk_nope_head_dim,
        qk_pos_emb_head_dim=model.qk_rope_head_dim,
        v_head_dim=model.v_head_dim,
        qk_layernorm=True,
        rope_type="rope",
        rotary_base=model.rope_theta,
        # DSA: makes MLA hand the hidden states and query latent to the core attention.
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=model.index_n_heads,
        dsa_indexer_head_dim=model.index_head_dim,
        dsa_indexer_topk=model.index_topk,
        # MoE.
        num_moe_experts=model.n_routed_experts,
        moe_layer_freq=model.moe_layer_pattern,
        moe_ffn_hidden_size=model.moe_intermediate_size,
        moe_shared_expert_intermediate_size=model.n_shared_experts * model.moe_intermediate_size
        if model.n_shared_experts else None,
        moe_router_topk=model.num_experts_per_tok,
        moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=model.routed_scaling_factor,
        moe_router_enable_expert_bias=model.topk_method == "noaux_tc",
        moe_router_bias_update_rate=model.moe_router_bias_update_rate,
        moe_router_num_groups=model.n_group if model.n_group > 1 else None,
        moe_router_group_topk=model.topk_group if model.n_group > 1 else None,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="seq_aux_loss" if model.moe_aux_loss_coeff else "none",
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_grouped_gemm=False,
        # MTP: megatron-core builds mtp_num_layers parameter sets; our model applies them for
        # model.mtp_num_steps steps (glm5_train.model.mtp).
        mtp_num_layers=model.mtp_sets or None,
        mtp_loss_scaling_factor=model.mtp_loss_weight,
        # Parallelism: the sizes come from par.mcore_kwargs() below.
        pipeline_dtype=params_dtype,
        # Numerics and kernels: nothing fused that needs CUDA or TE.
        params_dtype=params_dtype,
        bf16=bf16,
        calculate_per_token_loss=True,
        perform_initialization=perform_initialization,
        use_cpu_initialization=use_cpu_initialization,
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        deterministic_mode=False,
    )
    kwargs.update(par.mcore_kwargs())
    kwargs.update((recompute or Recompute()).mcore_fields())
    kwargs.update(overrides or {})
    if kwargs["context_parallel_size"] == 1:
        return MLATransformerConfig(**kwargs)
    # megatron-core refuses "dsa" with CP > 1 in __post_init__ because its own DSA attention
    # has no CP. The variant only makes MLA hand the core attention x and qr; our
    # DSACoreAttention shards sequences over the CP group itself (glm5_train/model/dsa.py).
    config = MLATransformerConfig(**{**kwargs, "experimental_attention_variant": None})
    config.experimental_attention_variant = "dsa"
    return config
