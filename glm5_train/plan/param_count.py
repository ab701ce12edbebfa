"""GLM-5's parameter count in closed form, and the same count grouped from a built model.

The formula gives megatron-core's parameters of one GLM-5 flavour from the config alone, tensor
by tensor (``Term``), per component; ``count_built`` groups a built model's parameters by the
same components, so the two can be compared component by component (``tools/count_params.py``
does, and reconciles both with the released Hugging Face checkpoint, which also holds the
router's ``e_score_correction_bias``, a buffer in megatron-core). The pipeline planner shards
these terms per stage (``glm5_train.plan.stage_model``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from glm5_train.model.config import GLM5Config

# The released zai-org/GLM-5 safetensors (docs/glm5_reference.md, sec. 2).
HF_MAIN_PARAMS = 743_911_218_432      # embedding, 78 layers, final norm, output head
HF_MTP_PARAMS = 9_952_920_576         # model.layers.78.*
HF_TOTAL_PARAMS = 753_864_139_008
HF_ACTIVE_PARAMS = 41_784_728_832     # main model, 8 of 256 routed experts, with embedding+head
HF_ACTIVE_NO_EMBED_PARAMS = 39_881_563_392

# The GLM5Config fields that decide a tensor shape or the active fraction.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "first_k_dense_replace",
                "intermediate_size", "moe_intermediate_size", "n_routed_experts",
                "n_shared_experts", "num_experts_per_tok", "topk_method", "num_attention_heads",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "index_n_heads", "index_head_dim", "tie_word_embeddings",
                "num_nextn_predict_layers")

# ----------------------------------------------------------------------------------------------
# The formula: megatron-core's parameters of one GLM-5 flavour, from the config alone.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    """One component: ``repeat`` copies of the tensors ``shapes`` (megatron-core layout)."""

    key: str
    module: str
    shapes: tuple[tuple[int, ...], ...]
    repeat: int = 1

    @property
    def count(self) -> int:
        return self.repeat * sum(math.prod(s) for s in self.shapes)

    @property
    def shape_text(self) -> str:
        text = " + ".join("[" + ", ".join(str(d) for d in s) + "]" for s in self.shapes)
        if self.repeat == 1:
            return text
        return f"{self.repeat} x " + (f"({text})" if len(self.shapes) > 1 else text)


def top_terms(cfg: GLM5Config) -> list[Term]:
    """Embedding, output head and final norm (an untied head; a tied one has no tensor)."""
    V, H = cfg.vocab_size, cfg.hidden_size
    head = () if cfg.tie_word_embeddings else ((V, H),)
    return [Term("embedding", "embedding.word_embeddings", ((V, H),)),
            Term("output_head", "output_layer", head),
            Term("final_norm", "decoder.final_layernorm", ((H,),))]


def attention_terms(cfg: GLM5Config) -> list[Term]:
    """MLA plus the DSA lightning indexer. No biases: GLM-5 has attention_bias=false (the down
    projections require it); the indexer's key norm is a LayerNorm with weight and bias."""
    H, N = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
        q = [Term("q_down", "linear_q_down_proj", ((cfg.q_lora_rank, H),)),
             Term("q_norm", "q_layernorm", ((cfg.q_lora_rank,),)),
             Term("q_up", "linear_q_up_proj", ((N * qk, cfg.q_lora_rank),))]
    else:
        q = [Term("q_up", "linear_q_proj", ((N * qk, H),))]
    kv_up = N * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + [
        Term("kv_down", "linear_kv_down_proj", ((cfg.kv_lora_rank + cfg.qk_rope_head_dim, H),)),
        Term("kv_norm", "kv_layernorm", ((cfg.kv_lora_rank,),)),
        Term("kv_up", "linear_kv_up_proj", ((kv_up, cfg.kv_lora_rank),)),
        Term("o_proj", "linear_proj", ((H, N * cfg.v_head_dim),)),
        indexer_term(cfg),
    ]


def indexer_term(cfg: GLM5Config) -> Term:
    """One layer's DSA lightning indexer, same layout in megatron and HF: wq_b, wk,
    k_norm (weight, bias), weights_proj."""
    Hi, Di, H = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    q_in = cfg.q_lora_rank or H
    return Term("indexer", "core_attention.indexer", ((Hi * Di, q_in), (Di, H), (Di,), (Di,),
                                                      (Hi, H)))


def _swiglu(hidden: int, ffn: int) -> tuple[tuple[int, int], tuple[int, int]]:
    # megatron fuses gate and up into one linear_fc1 [2 * ffn, hidden].
    return ((2 * ffn, hidden), (hidden, ffn))


def layer_terms(cfg: GLM5Config, moe: bool, absent: frozenset[str] = frozenset()) -> list[Term]:
    """One decoder layer: attention, its two norms, and a dense MLP or an MoE block, less the
    ``absent`` components (those of ``PENDING`` the model does not build yet)."""
    H = cfg.hidden_size
    terms = attention_terms(cfg) + [Term("input_norm", "input_layernorm", ((H,),)),
                                    Term("pre_mlp_norm", "pre_mlp_layernorm", ((H,),))]
    if not moe:
        terms.append(Term("dense_mlp", "mlp.linear_fc1 + linear_fc2",
                          _swiglu(H, cfg.intermediate_size)))
    else:
        E, F = cfg.n_routed_experts, cfg.moe_intermediate_size
        terms += [Term("router", "mlp.router", ((E, H),)),
                  Term("routed_experts", "mlp.experts", _swiglu(H, F), repeat=E)]
        if cfg.n_shared_experts:
            terms.append(Term("shared_expert", "mlp.shared_experts",
                              _swiglu(H, cfg.n_shared_experts * F)))
    return [t for t in terms if t.key not in absent]


def indexer_params(cfg: GLM5Config) -> int:
    return indexer_term(cfg).count


def expert_bias_params(cfg: GLM5Config) -> int:
    """One MoE layer's ``e_score_correction_bias`` (noaux_tc routing only)."""
    return cfg.n_routed_experts if cfg.topk_method == "noaux_tc" else 0


def hf_moe_layer_params(cfg: GLM5Config) -> int:
    """One MoE layer as HF stores it: megatron's full layer (indexer included) plus the
    expert bias."""
    return sum(t.count for t in layer_terms(cfg, moe=True)) + expert_bias_params(cfg)


def mtp_wrapper_terms(cfg: GLM5Config) -> list[Term]:
    """One MTP layer's own modules around its decoder layer (megatron = HF names)."""
    H = cfg.hidden_size
    return [Term("enorm", "enorm", ((H,),)),
            Term("hnorm", "hnorm", ((H,),)),
            Term("eh_proj", "eh_proj", ((H, 2 * H),)),
            Term("mtp_final_norm", "final_layernorm", ((H,),))]


def mtp_layer_terms(cfg: GLM5Config, absent: frozenset[str] = frozenset()) -> list[Term]:
    """One MTP parameter set as megatron-core builds it: its own modules plus a full MoE decoder
    layer (``transformer_layer``), less the ``absent`` components."""
    return mtp_wrapper_terms(cfg) + layer_terms(cfg, moe=True, absent=absent)


def mtp_params(cfg: GLM5Config) -> int:
    """HF's MTP layers: a full MoE layer each (expert bias included) plus eh_proj [H, 2H] and
    enorm, hnorm, shared_head.norm; embedding and output head are shared with the main model."""
    per_set = sum(t.count for t in mtp_layer_terms(cfg)) + expert_bias_params(cfg)
    return cfg.num_nextn_predict_layers * per_set


@dataclass(frozen=True)
class Totals:
    """Total and per-token active parameters, with and without embedding + output head."""

    total: int
    active: int
    embed_head: int

    @property
    def total_no_embed(self) -> int:
        return self.total - self.embed_head

    @property
    def active_no_embed(self) -> int:
        return self.active - self.embed_head


def active_routed(cfg: GLM5Config, routed: int) -> int:
    """The routed-expert parameters one token uses: num_experts_per_tok of n_routed_experts."""
    per_expert, rest = divmod(routed, cfg.n_routed_experts)
    if rest:
        raise ValueError(f"routed-expert parameters {routed} do not split evenly over "
                         f"n_routed_experts={cfg.n_routed_experts}")
    return per_expert * cfg.num_experts_per_tok


def formula_totals(cfg: GLM5Config, absent: frozenset[str] = frozenset()) -> Totals:
    """The megatron-core model's totals, from the config alone, without ``absent`` components."""
    pattern = cfg.moe_layer_pattern
    top = {t.key: t.count for t in top_terms(cfg)}
    total = sum(top.values())
    routed = 0
    for moe in pattern:
        terms = {t.key: t.count for t in layer_terms(cfg, bool(moe), absent)}
        total += sum(terms.values())
        routed += terms.get("routed_experts", 0)
    active = total - routed + active_routed(cfg, routed)
    return Totals(total, active, top["embedding"] + top["output_head"])


def _totals_of_layers(cfg: GLM5Config, layers: list[dict[str, int]], embed_head: int = 0,
                      other: int = 0) -> Totals:
    total = other + sum(sum(layer.values()) for layer in layers)
    routed = sum(layer.get("routed_experts", 0) for layer in layers)
    return Totals(total, total - routed + active_routed(cfg, routed), embed_head)


def mtp_formula_totals(cfg: GLM5Config, absent: frozenset[str] = frozenset()) -> Totals:
    """The MTP sets the megatron-core model builds (``cfg.mtp_sets``: none when mtp_num_steps
    is 0), from the config alone. Active: per token and prediction step."""
    one = {t.key: t.count for t in mtp_layer_terms(cfg, absent)}
    return _totals_of_layers(cfg, [one] * cfg.mtp_sets)


def hf_main_totals(cfg: GLM5Config) -> Totals:
    """HF's main model (no MTP): the full megatron model (indexer included) plus the expert
    biases, which megatron keeps as buffers."""
    meg = formula_totals(cfg)
    bias = sum(cfg.moe_layer_pattern) * expert_bias_params(cfg)
    return Totals(meg.total + bias, meg.active + bias, meg.embed_head)


def missing_vs_hf(cfg: GLM5Config, absent: frozenset[str] = frozenset(),
                  mtp_sets: int = 0) -> dict[str, int]:
    """HF checkpoint tensors the megatron model does not hold as parameters: the main model's
    indexers (if ``absent``) and expert biases, and of HF's MTP layers whatever the ``mtp_sets``
    built MTP sets do not hold (all of it when none is built; else their expert biases)."""
    n_moe = sum(cfg.moe_layer_pattern)
    indexer = cfg.num_hidden_layers * indexer_params(cfg) if "indexer" in absent else 0
    built_mtp = mtp_sets * sum(t.count for t in mtp_layer_terms(cfg, absent))
    return {"indexer": indexer, "expert_bias": n_moe * expert_bias_params(cfg),
            "mtp": mtp_params(cfg) - built_mtp}


# ----------------------------------------------------------------------------------------------
# Counting the built model.
# ----------------------------------------------------------------------------------------------

# Parameter name (after ``decoder.layers.<i>.``) -> component. First match wins. TE's fused
# layer-norm weights (``*.layer_norm_weight``) are listed so a TE build counts the same way.
LAYER_RULES: tuple[tuple[str, str], ...] = (
    (r"self_attention\.core_attention\.indexer\.", "indexer"),
    (r"self_attention\.linear_q_up_proj\.layer_norm_", "q_norm"),
    (r"self_attention\.linear_kv_up_proj\.layer_norm_", "kv_norm"),
    (r"self_attention\.linear_qkv\.layer_norm_", "input_norm"),
    (r"mlp\.linear_fc1\.layer_norm_", "pre_mlp_norm"),
    (r"self_attention\.linear_q_down_proj\.", "q_down"),
    (r"self_attention\.q_layernorm\.", "q_norm"),
    (r"self_attention\.linear_q_(up_)?proj\.", "q_up"),
    (r"self_attention\.linear_kv_down_proj\.", "kv_down"),
    (r"self_attention\.kv_layernorm\.", "kv_norm"),
    (r"self_attention\.linear_kv_up_proj\.", "kv_up"),
    (r"self_attention\.linear_proj\.", "o_proj"),
    (r"input_layernorm\.", "input_norm"),
    (r"pre_mlp_layernorm\.", "pre_mlp_norm"),
    (r"mlp\.router\.", "router"),
    (r"mlp\.experts\.", "routed_experts"),
    (r"mlp\.shared_experts\.", "shared_expert"),
    (r"mlp\.linear_fc[12]\.", "dense_mlp"),
)
TOP_RULES: tuple[tuple[str, str], ...] = (
    (r"embedding\.", "embedding"),
    (r"output_layer\.", "output_head"),
    (r"decoder\.final_layernorm\.", "final_norm"),
)
# Parameter name (after ``mtp.layers.<j>.``) -> component of one MTP set; its decoder layer,
# ``transformer_layer.<name>``, is classified by LAYER_RULES.
MTP_RULES: tuple[tuple[str, str], ...] = (
    (r"enorm\.", "enorm"),
    (r"hnorm\.", "hnorm"),
    (r"eh_proj\.", "eh_proj"),
    (r"final_layernorm\.", "mtp_final_norm"),
)
MTP_LAYER_PREFIX = "transformer_layer."
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_MTP_NAME = re.compile(r"mtp\.layers\.(\d+)\.(.+)")


@dataclass
class Built:
    """Parameter counts of a built model, per component."""

    top: dict[str, int] = field(default_factory=dict)
    layers: dict[int, dict[str, int]] = field(default_factory=dict)
    mtp: dict[int, dict[str, int]] = field(default_factory=dict)  # MTP set j -> component
    # State-dict buffers (persistent, not parameters): name with layer index as <i> -> (n, numel)
    buffers: dict[str, tuple[int, int]] = field(default_factory=dict)
    devices: set[str] = field(default_factory=set)


def _classify(name: str, rules: tuple[tuple[str, str], ...]) -> str:
    for pattern, key in rules:
        if re.match(pattern, name):
            return key
    raise ValueError(f"parameter {name!r} fits no component of glm5_train/plan/param_count.py: a module "
                     "was added to the model; add a rule and a formula term")


def classify_mtp(name: str) -> str:
    """The component of an MTP set's parameter ``name`` (after ``mtp.layers.<j>.``)."""
    if name.startswith(MTP_LAYER_PREFIX):
        return _classify(name[len(MTP_LAYER_PREFIX):], LAYER_RULES)
    return _classify(name, MTP_RULES)


def count_built(chunks) -> Built:
    """Group every parameter of the model chunks by component (and decoder layer / MTP set)."""
    built = Built()
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            built.devices.add(param.device.type)
            match = _LAYER_NAME.fullmatch(name)
            mtp = _MTP_NAME.fullmatch(name)
            if match:
                layer = built.layers.setdefault(int(match.group(1)), {})
                key = _classify(match.group(2), LAYER_RULES)
                layer[key] = layer.get(key, 0) + param.numel()
            elif mtp:
                layer = built.mtp.setdefault(int(mtp.group(1)), {})
                key = classify_mtp(mtp.group(2))
                layer[key] = layer.get(key, 0) + param.numel()
            else:
                key = _classify(name, TOP_RULES)
                built.top[key] = built.top.get(key, 0) + param.numel()
        _count_buffers(chunk, built.buffers)
    return built


def _count_buffers(chunk, into: dict[str, tuple[int, int]]) -> None:
    for module_name, module in chunk.named_modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module.named_buffers(recurse=False):
            if name in skip or buf is None:
                continue
            key = re.sub(r"\.\d+\.", ".<i>.", f"{module_name}.{name}")
            n, numel = into.get(key, (0, 0))
            into[key] = (n + 1, numel + buf.numel())


# HF components the megatron model may not build yet (an absent one is reported as missing).
PENDING = frozenset({"indexer"})


def absent_components(built: Built) -> frozenset[str]:
    """The PENDING components that no built layer has."""
    return frozenset(k for k in PENDING if not any(k in layer for layer in built.layers.values()))


def built_totals(cfg: GLM5Config, built: Built) -> Totals:
    """The built main model: embedding, decoder layers, final norm, output head (no MTP)."""
    embed_head = built.top.get("embedding", 0) + built.top.get("output_head", 0)
    return _totals_of_layers(cfg, list(built.layers.values()), embed_head,
                             other=sum(built.top.values()))


def built_mtp_totals(cfg: GLM5Config, built: Built) -> Totals:
    """The built MTP sets. Active: per token and prediction step."""
    return _totals_of_layers(cfg, list(built.mtp.values()))


def expert_bias_buffers(built: Built) -> tuple[int, int]:
    """The built expert-bias buffers: (main model's decoder layers, MTP sets)."""
    main = mtp = 0
    for name, (_, numel) in built.buffers.items():
        if name.endswith("router.expert_bias"):
            if name.startswith("mtp."):
                mtp += numel
            else:
                main += numel
    return main, mtp


