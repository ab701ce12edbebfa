"""Hugging Face GLM-5 (``GlmMoeDsaForCausalLM``) <-> this project: config and tensor names.

Config: ``hf_config_to_glm5`` reads an HF ``config.json`` dict into a ``GLM5Config`` and refuses
what the model here does not implement, naming the field; ``glm5_to_hf_config`` writes one back;
``check_config_matches`` compares an imported config with the job's, naming the first field
that differs.

Names: megatron-core names a weight by the global key of its ``ShardedTensor`` (layout
independent) plus the indices along its prepended axes. Observed in megatron-core 0.16.1:

- decoder layers keep their *global* layer number in the key (``decoder.layers.<i>.…``), with
  no prepended layer axis, whatever the PP/VPP layout;
- routed experts are one key per layer, ``decoder.layers.<i>.mlp.experts.experts.linear_fc1
  .weight``, with one prepended axis = the *global* expert index (not ``local_experts.<j>``);
- the SwiGLU ``linear_fc1`` (dense, shared and routed experts) is one global tensor whose rows
  are all gate rows then all up rows (HF ``gate_proj`` then ``up_proj``), however TP splits it;
- the router's ``expert_bias`` buffer is in the sharded state dict (fp32), HF's
  ``mlp.gate.e_score_correction_bias``.

``mcore_to_hf(key, index)`` gives the HF tensor(s) of one megatron global tensor: one name, or
several names stacked in equal parts along axis 0 (gate; up). ``hf_to_mcore(name)`` is the
inverse. With Transformer Engine the q/kv latent norms and the dense layers' pre-MLP norm are
fused into the following linear (``…layer_norm_weight``); those names map too.

MTP: HF's ``model.layers.<num_hidden_layers + k>.*`` is megatron-core's ``mtp.layers.<k>.*``:
the decoder-layer names under ``transformer_layer.``, plus ``eh_proj``, ``enorm``, ``hnorm`` and
``final_layernorm`` (HF ``shared_head.norm``). Numbering them needs ``num_hidden_layers``, so
both mapping functions take it; without it MTP names map to nothing. ``is_mtp_name`` tells the
importer which tensors to skip when the job trains without MTP (``model.mtp_num_steps=0``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from glm5_train.model.config import TRAINING_FIELDS, GLM5Config

HF_ARCHITECTURE = "GlmMoeDsaForCausalLM"
HF_MODEL_TYPE = "glm_moe_dsa"

# Compared only when the job builds the MTP layers (a job with model.mtp_num_steps=0 imports
# a checkpoint with MTP layers by skipping them).
MTP_FIELD = "num_nextn_predict_layers"

# GLM5Config fields HF's GlmMoeDsaConfig does not define: what HF's modelling code does
# regardless (sigmoid scores, e_score_correction_bias always added, interleaved RoPE in MLA and
# indexer), used when a config.json leaves them out.
_HF_IMPLIED = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_interleave": True,
               "indexer_rope_interleave": True, "num_nextn_predict_layers": 0}

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


def hf_config_to_glm5(hf_config: dict[str, Any]) -> GLM5Config:
    """The ``GLM5Config`` of an HF GLM-5 ``config.json``; ValueError naming any field whose
    value this project does not implement."""
    model_type = hf_config.get("model_type", HF_MODEL_TYPE)
    if model_type != HF_MODEL_TYPE:
        raise ValueError(f"config.json model_type={model_type!r}: only {HF_MODEL_TYPE!r} "
                         "(GLM-5) checkpoints are supported")
    _refuse_unsupported(hf_config)
    values: dict[str, Any] = {}
    types = {f.name: f.type for f in dataclasses.fields(GLM5Config)}
    for name in types:
        if name in TRAINING_FIELDS or name == "rope_theta":
            continue
        if name in hf_config and hf_config[name] is not None:
            values[name] = _coerce(name, hf_config[name], GLM5Config.__dataclass_fields__[name])
        elif name in _HF_IMPLIED:
            values[name] = _HF_IMPLIED[name]
    values["rope_theta"] = _rope_theta(hf_config)
    values["name"] = "hf"
    if not values.get("num_nextn_predict_layers"):
        values["mtp_num_steps"] = 0  # nothing to train MTP steps with
    cfg = GLM5Config(**values)
    _check_layer_types(hf_config, cfg)
    cfg.validate()
    check_exportable(cfg)
    return cfg


def _coerce(name: str, value: Any, fld: dataclasses.Field) -> Any:
    default = fld.default
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise TypeError(f"config.json {name}={value!r}: expected true or false")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise TypeError(f"config.json {name}={value!r}: expected an integer")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"config.json {name}={value!r}: expected a number")
        return float(value)
    return value


def _rope_theta(hf_config: dict[str, Any]) -> float:
    params = hf_config.get("rope_parameters")
    if params is not None:
        if "rope_theta" not in params:
            raise ValueError("config.json rope_parameters has no rope_theta")
        return float(params["rope_theta"])
    if hf_config.get("rope_theta") is not None:
        return float(hf_config["rope_theta"])
    raise ValueError("config.json has neither rope_parameters.rope_theta (transformers 5) nor "
                     "rope_theta: cannot tell the RoPE base")


def _refuse_unsupported(hf: dict[str, Any]) -> None:
    for key in ("rope_parameters", "rope_scaling"):
        params = hf.get(key)
        if params is None:
            continue
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config.json {key}.rope_type={rope_type!r}: only 'default' RoPE "
                             "(GLM-5: no YaRN or other scaling) is implemented here")
        factor = params.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            raise ValueError(f"config.json {key}.partial_rotary_factor={factor!r}: not "
                             "implemented (MLA applies RoPE to qk_rope_head_dim dims)")
    indexer_types = _indexer_types(hf)
    if any(t != "full" for t in indexer_types):
        shared = [i for i, t in enumerate(indexer_types) if t != "full"]
        raise ValueError(f"config.json indexer_types has {sorted(set(indexer_types) - {'full'})} "
                         f"layers {shared}: only 'full' (every layer runs its own DSA indexer) "
                         "is implemented here")
    if hf.get("tie_word_embeddings", False):
        raise ValueError("config.json tie_word_embeddings=true: GLM-5 unties the output head and "
                         "this importer maps lm_head.weight on its own; tied heads are not "
                         "supported")
    for name, ok in (("attention_bias", False), ("mlp_bias", False)):
        if hf.get(name, ok) != ok:
            raise ValueError(f"config.json {name}={hf[name]!r}: biases on the attention / MLP "
                             "linears are not implemented (GLM-5 has none)")
    if hf.get("q_lora_rank", 1) is None:
        raise ValueError("config.json q_lora_rank=null: MLA without a query down-projection is "
                         "not implemented (GLM-5 uses q_lora_rank=2048)")
    freq = hf.get("moe_layer_freq", 1)
    if freq != 1:
        raise ValueError(f"config.json moe_layer_freq={freq!r}: only 1 (every layer after "
                         "first_k_dense_replace is MoE) is implemented")


def _indexer_types(hf: dict[str, Any]) -> list[str]:
    """Per-layer indexer mode as transformers' GlmMoeDsaConfig derives it."""
    if hf.get("indexer_types") is not None:
        return list(hf["indexer_types"])
    layers = int(hf.get("num_hidden_layers", 0))
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return ([{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
                if isinstance(pattern, str) else list(pattern))
    freq = max(int(hf.get("index_topk_freq", 1)), 1)
    offset = int(hf.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


def _check_layer_types(hf: dict[str, Any], cfg: GLM5Config) -> None:
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is not None:
        expected = ["dense" if m == 0 else "sparse" for m in cfg.moe_layer_pattern]
        if list(mlp_types) != expected:
            raise ValueError(
                f"config.json mlp_layer_types={list(mlp_types)} is not first_k_dense_replace="
                f"{cfg.first_k_dense_replace} dense layers then MoE: other patterns are not "
                "implemented")
    if len(_indexer_types(hf)) not in (0, cfg.num_hidden_layers):
        raise ValueError(f"config.json indexer_types has {len(_indexer_types(hf))} entries for "
                         f"num_hidden_layers={cfg.num_hidden_layers}")


def check_exportable(cfg: GLM5Config) -> None:
    """Refuse a GLM5Config that HF's GlmMoeDsa model cannot express, naming the field."""
    if cfg.tie_word_embeddings:
        raise ValueError("model.tie_word_embeddings=true: HF GLM-5 checkpoints keep lm_head "
                         "separate; tied output heads are not supported by this converter")
    if cfg.topk_method != "noaux_tc":
        raise ValueError(f"model.topk_method={cfg.topk_method!r}: HF's GlmMoeDsa router always "
                         "adds e_score_correction_bias (noaux_tc); 'greedy' has no such tensor")
    if cfg.scoring_func != "sigmoid":
        raise ValueError(f"model.scoring_func={cfg.scoring_func!r}: HF's GlmMoeDsa routes with "
                         "sigmoid scores")
    # HF ranks an expert group by the sum of its top-2 biased scores; megatron-core by the sum of
    # its top (num_experts_per_tok // topk_group): the same only when that is 2.
    if cfg.n_group > 1 and (cfg.topk_group < 1 or cfg.num_experts_per_tok // cfg.topk_group != 2):
        raise ValueError(
            f"model.n_group={cfg.n_group} with topk_group={cfg.topk_group} and "
            f"num_experts_per_tok={cfg.num_experts_per_tok}: group-limited routing is only "
            "supported when num_experts_per_tok // topk_group == 2 (HF scores a group by its "
            "top-2 experts, megatron-core by its top num_experts_per_tok // topk_group)")


def check_config_matches(hf: GLM5Config, ours: GLM5Config) -> None:
    """ValueError naming the first architecture field where the checkpoint's config and the
    job's differ (training knobs in TRAINING_FIELDS are ignored, the MTP depth too when the job
    trains no MTP)."""
    ours_d = dataclasses.asdict(ours)
    for name, value in dataclasses.asdict(hf).items():
        if name in TRAINING_FIELDS or (name == MTP_FIELD and not ours.mtp_sets):
            continue
        if name == MTP_FIELD and value != ours_d[name]:
            raise ValueError(
                f"HF config.json has {name}={value} MTP layer(s) but the model trains "
                f"model.{name}={ours_d[name]}: pass model.{name}={value}"
                + (" (or model.mtp_num_steps=0 to train without MTP)" if not value else ""))
        if value != ours_d[name]:
            raise ValueError(
                f"HF config.json has {name}={value!r} but the model config has "
                f"model.{name}={ours_d[name]!r}: pass model.{name}={value!r} (or a model= preset "
                "matching the checkpoint)")


def glm5_to_hf_config(cfg: GLM5Config, dtype: torch.dtype) -> dict[str, Any]:
    """HF ``GlmMoeDsaConfig`` fields (config.json) for a model with ``cfg`` and weights of
    ``dtype``. ``num_nextn_predict_layers`` counts the MTP layers exported (0 when the model
    trains none)."""
    check_exportable(cfg)
    layers = cfg.num_hidden_layers
    out: dict[str, Any] = {"architectures": [HF_ARCHITECTURE], "model_type": HF_MODEL_TYPE}
    for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                 "num_hidden_layers", "first_k_dense_replace", "n_routed_experts",
                 "n_shared_experts", "num_experts_per_tok", "scoring_func", "topk_method",
                 "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
                 "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
                 "index_head_dim", "index_topk", "rope_interleave", "indexer_rope_interleave",
                 "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps", "hidden_act",
                 "attention_bias", "attention_dropout", "initializer_range"):
        out[name] = getattr(cfg, name)
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    out["indexer_types"] = ["full"] * layers
    out["mlp_layer_types"] = ["dense" if m == 0 else "sparse" for m in cfg.moe_layer_pattern]
    out["num_nextn_predict_layers"] = cfg.mtp_sets
    out["dtype"] = _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))
    return out


# ----------------------------------------------------------------------------------------------
# Tensor names
# ----------------------------------------------------------------------------------------------

# (megatron key suffix inside decoder.layers.<i>., HF suffix(es) inside model.layers.<i>.).
# Several HF names: stacked in equal parts along axis 0, in this order.
_ATTENTION_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("input_layernorm.weight", ("input_layernorm.weight",)),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
    ("self_attention.linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",)),
    ("self_attention.q_layernorm.weight", ("self_attn.q_a_layernorm.weight",)),
    ("self_attention.linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",)),
    ("self_attention.linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",)),
    ("self_attention.kv_layernorm.weight", ("self_attn.kv_a_layernorm.weight",)),
    ("self_attention.linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",)),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",)),
    ("self_attention.core_attention.indexer.wq_b.weight", ("self_attn.indexer.wq_b.weight",)),
    ("self_attention.core_attention.indexer.wk.weight", ("self_attn.indexer.wk.weight",)),
    ("self_attention.core_attention.indexer.k_norm.weight", ("self_attn.indexer.k_norm.weight",)),
    ("self_attention.core_attention.indexer.k_norm.bias", ("self_attn.indexer.k_norm.bias",)),
    ("self_attention.core_attention.indexer.weights_proj.weight",
     ("self_attn.indexer.weights_proj.weight",)),
)
_DENSE_MLP_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",)),
)
_ROUTER_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mlp.router.weight", ("mlp.gate.weight",)),
    ("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",)),
)
_SHARED_EXPERT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mlp.shared_experts.linear_fc1.weight",
     ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight")),
    ("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_experts.down_proj.weight",)),
)
# Transformer Engine spec: norms fused into the linear that follows them.
_TE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("self_attention.linear_q_up_proj.layer_norm_weight", ("self_attn.q_a_layernorm.weight",)),
    ("self_attention.linear_kv_up_proj.layer_norm_weight", ("self_attn.kv_a_layernorm.weight",)),
    ("mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",)),
)
# Routed experts: one megatron key per layer, prepended axis = global expert index.
_EXPERT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mlp.experts.experts.linear_fc1.weight",
     ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
    ("mlp.experts.experts.linear_fc2.weight", ("mlp.experts.{e}.down_proj.weight",)),
)
_GLOBAL_RULES: tuple[tuple[str, str], ...] = (
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    ("decoder.final_layernorm.weight", "model.norm.weight"),
    ("output_layer.weight", "lm_head.weight"),
)

# MTP layers: the decoder-layer rules under transformer_layer., plus these.
_MTP_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("eh_proj.weight", ("eh_proj.weight",)),
    ("enorm.weight", ("enorm.weight",)),
    ("hnorm.weight", ("hnorm.weight",)),
    ("final_layernorm.weight", ("shared_head.norm.weight",)),
)
_MTP_LAYER_PREFIX = "transformer_layer."

_MCORE_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MCORE_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(.+)$")

_LAYER_RULES = (_ATTENTION_RULES + _DENSE_MLP_RULES + _ROUTER_RULES + _SHARED_EXPERT_RULES
                + _TE_RULES)
_LAYER_TO_HF = {m: h for m, h in _LAYER_RULES}
_EXPERT_TO_HF = {m: h for m, h in _EXPERT_RULES}
_GLOBAL_TO_HF = {m: h for m, h in _GLOBAL_RULES}
# Inverse maps use the local (non-TE) spec's names, the first rule for each HF name.
_HF_TO_LAYER: dict[str, tuple[str, int, int]] = {}
for _m, _hs in _LAYER_RULES:
    for _part, _h in enumerate(_hs):
        _HF_TO_LAYER.setdefault(_h, (_m, _part, len(_hs)))
_HF_TO_EXPERT: dict[str, tuple[str, int, int]] = {}
for _m, _hs in _EXPERT_RULES:
    for _part, _h in enumerate(_hs):
        _HF_TO_EXPERT[_h.replace("mlp.experts.{e}.", "")] = (_m, _part, len(_hs))
_HF_TO_GLOBAL = {h: m for m, h in _GLOBAL_RULES}
_MTP_TO_HF = {m: h for m, h in _MTP_RULES}
_HF_TO_MTP = {h[0]: m for m, h in _MTP_RULES}


@dataclass(frozen=True)
class McoreName:
    """Where an HF tensor lives in megatron-core: global tensor ``key`` at prepended ``index``,
    part ``part`` of ``parts`` equal blocks of rows (gate = 0, up = 1 of the SwiGLU fc1)."""

    key: str
    index: tuple[int, ...]
    part: int = 0
    parts: int = 1


def mcore_to_hf(key: str, index: tuple[int, ...] = (),
                num_hidden_layers: int | None = None) -> list[str] | None:
    """HF tensor names making up megatron global tensor ``key`` at prepended ``index``, stacked
    in equal parts along axis 0; None for a key with no HF counterpart (MTP keys need
    ``num_hidden_layers``)."""
    if key in _GLOBAL_TO_HF and not index:
        return [_GLOBAL_TO_HF[key]]
    match = _MCORE_LAYER.match(key)
    if match:
        return _layer_to_hf(match.group(2), index, f"model.layers.{int(match.group(1))}.")
    match = _MCORE_MTP.match(key)
    if match is None or num_hidden_layers is None:
        return None
    prefix, rest = f"model.layers.{num_hidden_layers + int(match.group(1))}.", match.group(2)
    if rest in _MTP_TO_HF and not index:
        return [prefix + h for h in _MTP_TO_HF[rest]]
    if rest.startswith(_MTP_LAYER_PREFIX):
        return _layer_to_hf(rest[len(_MTP_LAYER_PREFIX):], index, prefix)
    return None


def _layer_to_hf(rest: str, index: tuple[int, ...], prefix: str) -> list[str] | None:
    if rest in _LAYER_TO_HF and not index:
        return [prefix + h for h in _LAYER_TO_HF[rest]]
    if rest in _EXPERT_TO_HF and len(index) == 1:
        return [prefix + h.format(e=index[0]) for h in _EXPERT_TO_HF[rest]]
    return None


def hf_to_mcore(name: str, num_hidden_layers: int | None = None) -> McoreName | None:
    """The megatron-core global tensor (local spec names) holding HF tensor ``name``; None for
    a name the model does not have (a typo, or an MTP layer's when ``num_hidden_layers`` is
    not given)."""
    if name in _HF_TO_GLOBAL:
        return McoreName(_HF_TO_GLOBAL[name], ())
    match = _HF_LAYER.match(name)
    if not match:
        return None
    layer, rest = int(match.group(1)), match.group(2)
    if num_hidden_layers is None or layer < num_hidden_layers:
        return _hf_layer_to_mcore(rest, f"decoder.layers.{layer}.")
    prefix = f"mtp.layers.{layer - num_hidden_layers}."
    if rest in _HF_TO_MTP:
        return McoreName(prefix + _HF_TO_MTP[rest], ())
    return _hf_layer_to_mcore(rest, prefix + _MTP_LAYER_PREFIX)


def _hf_layer_to_mcore(rest: str, prefix: str) -> McoreName | None:
    if rest in _HF_TO_LAYER:
        key, part, parts = _HF_TO_LAYER[rest]
        return McoreName(prefix + key, (), part, parts)
    expert = _HF_EXPERT.match(rest)
    if expert and expert.group(2) in _HF_TO_EXPERT:
        key, part, parts = _HF_TO_EXPERT[expert.group(2)]
        return McoreName(prefix + key, (int(expert.group(1)),), part, parts)
    return None


def hf_layer_index(name: str) -> int | None:
    """Decoder layer number of an HF tensor name, None for embedding / final norm / head."""
    match = _HF_LAYER.match(name)
    return int(match.group(1)) if match else None


def is_mtp_name(name: str, num_hidden_layers: int, num_nextn_predict_layers: int) -> bool:
    """Whether HF tensor ``name`` belongs to an MTP layer (``model.layers.<L + k>.*``)."""
    layer = hf_layer_index(name)
    return (layer is not None
            and num_hidden_layers <= layer < num_hidden_layers + num_nextn_predict_layers)


def hf_names_for(cfg: GLM5Config) -> list[str]:
    """Every HF tensor name of the main model (no MTP) of a GLM-5 with ``cfg``."""
    names = [h for _, h in _GLOBAL_RULES]
    for layer, is_moe in enumerate(cfg.moe_layer_pattern):
        names += [f"model.layers.{layer}.{h}" for h in _layer_hf_suffixes(cfg, bool(is_moe))]
    return names


def hf_mtp_names_for(cfg: GLM5Config) -> list[str]:
    """The HF tensor names of ``cfg``'s MTP layers (``num_nextn_predict_layers`` MoE layers
    plus eh_proj and three norms each)."""
    names = []
    for k in range(cfg.num_nextn_predict_layers):
        prefix = f"model.layers.{cfg.num_hidden_layers + k}."
        names += [prefix + hs[0] for _, hs in _MTP_RULES]
        names += [prefix + h for h in _layer_hf_suffixes(cfg, moe=True)]
    return names


def _layer_hf_suffixes(cfg: GLM5Config, moe: bool) -> list[str]:
    rules = _ATTENTION_RULES
    if not moe:
        rules += _DENSE_MLP_RULES
    else:
        rules += _ROUTER_RULES[:1] if cfg.topk_method != "noaux_tc" else _ROUTER_RULES
        rules += _SHARED_EXPERT_RULES if cfg.n_shared_experts else ()
        rules += tuple((m, tuple(h.format(e=e) for h in hs))
                       for e in range(cfg.n_routed_experts) for m, hs in _EXPERT_RULES)
    return [h for _, hs in rules for h in hs]
