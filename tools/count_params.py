"""Count GLM-5's parameters on the real megatron-core model, built on the meta device.

Examples::

    python tools/count_params.py model=glm5_744b
    python tools/count_params.py model=glm5_tiny model.num_hidden_layers=6
    python tools/count_params.py model=glm5_tiny --materialize   # allocate on CPU (small configs)

The model is built in this one process exactly as training builds it (``to_mcore_config`` +
``build_model_chunks``, world size 1, no parallelism) but under ``torch.device("meta")`` with
``perform_initialization=False``, so GLM-5 744B costs no memory. Parameters are counted from the
built modules and grouped per component; the same numbers come from a closed-form formula over
the ``GLM5Config`` fields and the two must agree. Then the count is reconciled with the released
Hugging Face checkpoint, which also holds the router's ``e_score_correction_bias`` (a buffer in
megatron-core).

The multi-token-prediction (MTP) layer is counted as its own part: with ``model.mtp_num_steps``
> 0 the model builds ``num_nextn_predict_layers`` MTP parameter sets ``mtp.layers.<j>`` (HF
``model.layers.<num_hidden_layers + j>``): ``enorm``, ``hnorm``, ``eh_proj``, a full MoE decoder
layer ``transformer_layer`` (DSA indexer included) and ``final_layernorm`` (HF
``shared_head.norm``); embedding and output head are shared with the main model. Its built count
is checked against the formula component by component, and with its expert-bias buffer against
HF's MTP tensors (``mtp_params``). With ``model.mtp_num_steps=0`` nothing is built and the MTP
layer is reported as not built, its HF count taken from the formula.

The last two lines of output are always::

    main_params=<N_main> mtp_params=<N_mtp>
    total_params=<N> active_params=<M>

``total_params`` is every parameter of the built model, MTP included (N = N_main + N_mtp;
N_mtp = 0 without MTP). ``active_params`` is the main model's per-token active count (routed
experts counted num_experts_per_tok / n_routed_experts of them) including embedding and output
head; the MTP layer is not part of it (it runs only for the training-time extra predictions).
Exit status 0 when the built model matches the formula (and, for GLM-5 744B's shapes, the
released counts), 1 otherwise, 2 for a bad command line or config.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field

# Runnable as a script from anywhere: make the repo root importable.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

# megatron-core warns at import about optional GPU libraries that counting never uses.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="Apex is not installed")
warnings.filterwarnings("ignore", message="full scope is deprecated")

from glm5_train.config import GLM5Config  # noqa: E402

CONFIG_DIR = os.path.join(_REPO_ROOT, "configs")
REFERENCE_FLAVOUR = "glm5_744b"

# The released zai-org/GLM-5 safetensors (see shared/glm5_reference.md).
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

# --materialize allocates every weight: refuse beyond this many bytes (bf16).
MATERIALIZE_LIMIT_BYTES = 2 << 30
PARAMS_DTYPE_NAME = "bf16"


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
    raise ValueError(f"parameter {name!r} fits no component of tools/count_params.py: a module "
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


# ----------------------------------------------------------------------------------------------
# Building the model: one process, world size 1, meta device.
# ----------------------------------------------------------------------------------------------


def compose_model_config(overrides: list[str]) -> GLM5Config:
    """Compose ``configs/`` with Hydra and return the ``model`` node as a GLM5Config."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from glm5_train.run_dir import register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        tree = compose(config_name="config", overrides=overrides)
    # Only the model node: checkpoint.save interpolates ${hydra:...}, unset outside a Hydra run.
    cfg = GLM5Config.from_dict(OmegaConf.to_container(tree.model, resolve=True))
    cfg.validate()  # includes the field-type check
    return cfg


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def single_process_group():
    """A world-size-1 gloo group plus megatron-core's parallel state (all sizes 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    port = _free_port()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def build_chunks(cfg: GLM5Config, materialize: bool):
    """Build the model as training does. On meta (default) nothing is allocated: megatron's
    ``use_cpu_initialization`` path creates its weights with ``torch.empty`` and no device,
    which the meta default device captures; initialization is skipped."""
    import torch

    from glm5_train.config import ParallelSizes, to_mcore_config
    from glm5_train.model import build_model_chunks

    mcore = to_mcore_config(cfg, ParallelSizes(), torch.bfloat16,
                            perform_initialization=materialize)
    where = contextlib.nullcontext() if materialize else torch.device("meta")
    with where:
        return build_model_chunks(cfg, mcore)


def check_materialize_size(cfg: GLM5Config) -> None:
    n = formula_totals(cfg).total + mtp_formula_totals(cfg).total
    if 2 * n > MATERIALIZE_LIMIT_BYTES:
        raise ValueError(
            f"--materialize would allocate {n:,} parameters ({2 * n / 2**30:.1f} GiB in bf16), "
            f"over the {MATERIALIZE_LIMIT_BYTES / 2**30:.0f} GiB limit for this check: drop "
            "--materialize to count on the meta device")


# ----------------------------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------------------------

ATTENTION_KEYS = ("q_down", "q_norm", "q_up", "kv_down", "kv_norm", "kv_up", "o_proj")
NORM_KEYS = ("input_norm", "pre_mlp_norm")
MLP_KEYS = ("dense_mlp", "router", "routed_experts", "shared_expert")
SECTIONS = (("attention (MLA)", ATTENTION_KEYS), ("DSA", ("indexer",)), ("layer norms", NORM_KEYS),
            ("MLP / MoE", MLP_KEYS))
MTP_KEYS = tuple(key for _, key in MTP_RULES)  # an MTP set's own modules
ROW = "{:<17}{:<30}{:<%d}{:>16}{:>7}{:>19}{:>19}  {}"  # %d: the widest shape text + 2


def _n(value: int) -> str:
    return f"{value:,}"


def _ok(a: int, b: int) -> str:
    return "ok" if a == b else f"MISMATCH ({a - b:+,})"


class Report:
    """Collects output lines and whether every check passed."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.ok = True

    def add(self, line: str = "") -> None:
        self.lines.append(line)

    def check(self, a: int, b: int) -> str:
        self.ok &= a == b
        return _ok(a, b)


def _mtp_hf_index(cfg: GLM5Config) -> str:
    """HF's layer index of MTP set 0 (``model.layers.<num_hidden_layers>``), or of all sets."""
    first = cfg.num_hidden_layers
    last = first + cfg.num_nextn_predict_layers - 1
    return f"model.layers.{first}" + (f"-{last}" if last > first else "")


def _sets(n: int) -> str:
    return f"{n} set" + ("" if n == 1 else "s")


def _component_rows(cfg: GLM5Config, built: Built, absent: frozenset[str], rep: Report) -> None:
    pattern = cfg.moe_layer_pattern
    per_kind = {moe: {t.key: t for t in layer_terms(cfg, bool(moe))} for moe in (0, 1)}
    terms = (top_terms(cfg) + mtp_wrapper_terms(cfg)
             + [t for kind in per_kind.values() for t in kind.values()])
    row = ROW % (max(len(t.shape_text) for t in terms) + 2)
    rep.add(row.format("component", "megatron module", "shape (megatron layout)", "per layer",
                       "layers", "built", "formula", "match"))
    for term in top_terms(cfg):
        b = built.top.get(term.key, 0)
        rep.add(row.format(term.key, term.module, term.shape_text or "(tied)", "", "", _n(b),
                           _n(term.count), rep.check(b, term.count)))
    for title, keys in SECTIONS:
        rep.add(f"-- {title}")
        for key in keys:
            layers = [i for i, moe in enumerate(pattern) if key in per_kind[moe]]
            if not layers:
                continue
            term = per_kind[pattern[layers[0]]][key]
            b = sum(built.layers.get(i, {}).get(key, 0) for i in layers)
            f = sum(per_kind[pattern[i]][key].count for i in layers)
            status = "not built: missing vs HF" if key in absent else rep.check(b, f)
            rep.add(row.format("  " + key, term.module, term.shape_text, _n(term.count),
                               len(layers), _n(b), _n(f), status))
    _mtp_component_rows(cfg, built, absent, rep, row)


def _mtp_component_rows(cfg: GLM5Config, built: Built, absent: frozenset[str], rep: Report,
                        row: str) -> None:
    """The MTP sets (``mtp.layers.<j>``): their own modules, then their decoder layer as one
    row (its components are checked one by one in the per-layer-kind lines)."""
    sets = cfg.mtp_sets
    if not sets and not built.mtp:
        rep.add(f"-- MTP: not built (model.mtp_num_steps=0); HF's {_mtp_hf_index(cfg)} is "
                "counted from the formula below")
        return
    rep.add(f"-- MTP (mtp.layers.<j>, {_sets(sets)} = HF {_mtp_hf_index(cfg)}, applied for "
            f"{cfg.mtp_num_steps} steps sharing the parameters)")
    for term in mtp_wrapper_terms(cfg):
        b = sum(layer.get(term.key, 0) for layer in built.mtp.values())
        f = sets * term.count
        rep.add(row.format("  " + term.key, term.module, term.shape_text, _n(term.count), sets,
                           _n(b), _n(f), rep.check(b, f)))
    layer = sum(t.count for t in layer_terms(cfg, True, absent))
    b = sum(n for mtp in built.mtp.values() for k, n in mtp.items() if k not in MTP_KEYS)
    rep.add(row.format("  moe_layer", "transformer_layer.*", "an MoE layer (rows above)",
                       _n(layer), sets, _n(b), _n(sets * layer), rep.check(b, sets * layer)))


def _layer_rows(cfg: GLM5Config, built: Built, absent: frozenset[str], rep: Report) -> None:
    pattern = cfg.moe_layer_pattern
    rep.add()
    rep.add("per layer kind (built = formula checked for every layer, component by component):")
    for moe, kind in ((0, "dense"), (1, "MoE")):
        idx = [i for i, m in enumerate(pattern) if m == moe]
        if not idx:
            continue
        expected = {t.key: t.count for t in layer_terms(cfg, bool(moe), absent)}
        _kind_row(f"{kind:<6} layers", idx, built.layers, expected, rep)
    extra = sorted(set(built.layers) - set(range(len(pattern))))
    if extra:
        rep.ok = False
        rep.add(f"  MISMATCH: built decoder layers {extra} beyond num_hidden_layers={len(pattern)}")
    if cfg.mtp_sets:
        expected = {t.key: t.count for t in mtp_layer_terms(cfg, absent)}
        _kind_row("MTP    sets  ", list(range(cfg.mtp_sets)), built.mtp, expected, rep)
    extra = sorted(set(built.mtp) - set(range(cfg.mtp_sets)))
    if extra:
        rep.ok = False
        rep.add(f"  MISMATCH: built MTP sets {extra} beyond the {cfg.mtp_sets} expected "
                f"(num_nextn_predict_layers={cfg.num_nextn_predict_layers}, "
                f"mtp_num_steps={cfg.mtp_num_steps})")


def _kind_row(label: str, idx: list[int], layers: dict[int, dict[str, int]],
              expected: dict[str, int], rep: Report) -> None:
    bad = [i for i in idx if layers.get(i, {}) != expected]
    b = sum(sum(layers.get(i, {}).values()) for i in idx)
    f = len(idx) * sum(expected.values())
    status = rep.check(b, f) if not bad else f"MISMATCH in {label.split()[-1]} {bad}"
    rep.ok &= not bad
    each = _n(sum(expected.values()))
    rep.add(f"  {label} {_span(idx):<9} {len(idx):>3} x {each:>17}"
            f" = built {_n(b):>19}  formula {_n(f):>19}  {status}")
    for i in bad:
        got = layers.get(i, {})
        diff = {k: got.get(k, 0) - expected.get(k, 0) for k in sorted(set(got) | set(expected))}
        rep.add(f"    {label.split()[-1][:-1]} {i}: built - formula per component: "
                + ", ".join(f"{k} {v:+,}" for k, v in diff.items() if v))


def _span(idx: list[int]) -> str:
    return f"{idx[0]}-{idx[-1]}" if len(idx) > 1 else str(idx[0])


def _total_rows(cfg: GLM5Config, built: Built, absent: frozenset[str], rep: Report) -> None:
    b, f = built_totals(cfg, built), formula_totals(cfg, absent)
    bm, fm = built_mtp_totals(cfg, built), mtp_formula_totals(cfg, absent)
    rep.add()
    frac = f"{cfg.num_experts_per_tok}/{cfg.n_routed_experts} routed experts"
    without = f"; formula without {', '.join(sorted(absent))}" if absent else ""
    rep.add(f"totals (megatron model as built; active = {frac} per token{without}):")
    mtp = f"MTP, {_sets(cfg.mtp_sets)}" if cfg.mtp_sets else "MTP (not built)"
    for label, bv, fv in (("main model", b.total, f.total),
                          ("main without embedding+head", b.total_no_embed, f.total_no_embed),
                          ("main active", b.active, f.active),
                          ("main active without embed+head", b.active_no_embed,
                           f.active_no_embed),
                          (mtp, bm.total, fm.total),
                          ("MTP active per token and step", bm.active, fm.active),
                          ("total = main + MTP", b.total + bm.total, f.total + fm.total)):
        rep.add(f"  {label:<31} built {_n(bv):>19}  formula {_n(fv):>19}  {rep.check(bv, fv)}")
    rep.add("  total_params (last line) = main model + MTP; active_params = main model active "
            "(the MTP layer only runs for the training-time extra predictions)")


def _hf_differences(cfg: GLM5Config, built: Built, absent: frozenset[str], rep: Report) -> None:
    missing = missing_vs_hf(cfg, absent, len(built.mtp))
    n_moe = sum(cfg.moe_layer_pattern)
    rep.add()
    rep.add("megatron-core modules vs the HF checkpoint's tensors:")
    rep.add("  same counts, other names (megatron = HF):")
    rep.add("    linear_q_down_proj = q_a_proj, q_layernorm = q_a_layernorm, linear_q_up_proj = "
            "q_b_proj, linear_kv_down_proj = kv_a_proj_with_mqa (latent + rope key), "
            "kv_layernorm = kv_a_layernorm,")
    rep.add("    linear_kv_up_proj = kv_b_proj, linear_proj = o_proj, pre_mlp_layernorm = "
            "post_attention_layernorm, mlp.router = mlp.gate, mlp.experts.local_experts.<j> = "
            "mlp.experts.<j>,")
    rep.add("    linear_fc1 = [gate_proj; up_proj] fused in one tensor (dense MLP, routed and "
            "shared experts), linear_fc2 = down_proj")
    rep.add("  the router weight is allocated in fp32, then cast to params_dtype like every "
            "other weight")
    for name, (n, numel) in sorted(built.buffers.items()):
        rep.add(f"  buffer, not a parameter: {name}: {n} x {numel // max(n, 1)} = {_n(numel)}"
                + ("  (HF: mlp.gate.e_score_correction_bias, a tensor in the safetensors)"
                   if name.endswith("router.expert_bias") else ""))
    main_bias, mtp_bias = expert_bias_buffers(built)
    rep.add(f"  expert bias: built buffers {_n(main_bias)}, formula {n_moe} MoE layers x "
            f"{expert_bias_params(cfg)} = {_n(missing['expert_bias'])}  "
            f"{rep.check(main_bias, missing['expert_bias'])}")
    sets, mtp_bias_formula = cfg.mtp_sets, cfg.mtp_sets * expert_bias_params(cfg)
    if sets or mtp_bias:
        rep.add(f"  MTP expert bias: built buffers {_n(mtp_bias)}, formula {_sets(sets)} x "
                f"{expert_bias_params(cfg)} = {_n(mtp_bias_formula)}  "
                f"{rep.check(mtp_bias, mtp_bias_formula)}")
    indexer = (f"DSA lightning indexer ({cfg.num_hidden_layers} layers x "
               f"{_n(indexer_params(cfg))}: wq_b, wk, k_norm weight+bias, weights_proj = "
               f"{indexer_term(cfg).shape_text})")
    if "indexer" in absent:
        rep.add(f"  not built yet: {indexer}")
    else:
        rep.add(f"  built: {indexer}; self_attention.core_attention.indexer.* = HF "
                "self_attn.indexer.*, same names and shapes")
    H = cfg.hidden_size
    hf_mtp = (f"{cfg.num_nextn_predict_layers} x (MoE layer with indexer and expert bias "
              f"{_n(hf_moe_layer_params(cfg))} + eh_proj [{H}, {2 * H}] + enorm, hnorm, "
              f"shared_head.norm 3 x [{H}])")
    if sets:
        rep.add(f"  built: MTP, HF {_mtp_hf_index(cfg)}: {hf_mtp}; mtp.layers.<j>.X = HF "
                f"model.layers.<{cfg.num_hidden_layers} + j>.X for enorm, hnorm, eh_proj;")
        rep.add("    mtp.layers.<j>.transformer_layer.* = the decoder layer's tensors above "
                "(HF self_attn.*, input_layernorm, post_attention_layernorm, mlp.*), "
                "final_layernorm = shared_head.norm;")
        rep.add("    the MTP layer has no embedding or output head of its own in either "
                "(both shared with the main model; PP=1 builds no embedding copy)")
    else:
        rep.add(f"  not built (model.mtp_num_steps=0): MTP, HF {_mtp_hf_index(cfg)}: {hf_mtp}")
    rep.add("missing vs HF layout: " + " ".join(f"{k}={v}" for k, v in missing.items()))


def matches_reference_shapes(cfg: GLM5Config) -> bool:
    """True when ``cfg`` has the tensor shapes of configs/model/glm5_744b.yaml."""
    from omegaconf import OmegaConf

    path = os.path.join(CONFIG_DIR, "model", f"{REFERENCE_FLAVOUR}.yaml")
    ref = GLM5Config.from_dict(OmegaConf.to_container(OmegaConf.load(path), resolve=True))
    return all(getattr(cfg, f) == getattr(ref, f) for f in SHAPE_FIELDS)


def _reconciliation(cfg: GLM5Config, built: Built, absent: frozenset[str], rep: Report) -> None:
    b, m, sets = built_totals(cfg, built), built_mtp_totals(cfg, built), len(built.mtp)
    missing = missing_vs_hf(cfg, absent, sets)
    main = b.total + missing["indexer"] + missing["expert_bias"]
    hf_mtp = m.total + missing["mtp"]
    active = b.active + missing["indexer"] + missing["expert_bias"]
    rep.add()
    rep.add(f"reconciliation with the released GLM-5 checkpoint ({REFERENCE_FLAVOUR} shapes):")
    indexer = "indexer" in absent
    rows = [("built main model (megatron)", b.total, None)]
    if indexer:
        rows.append(("+ indexer, not built (formula)", missing["indexer"], None))
    rows += [("+ e_score_correction_bias (buffers)", missing["expert_bias"], None),
             ("= HF main model", main, HF_MAIN_PARAMS)]
    if sets:
        mtp_indexer = sets * indexer_params(cfg) if indexer else 0
        rows.append((f"built MTP layer (megatron, {_sets(sets)})", m.total, None))
        if indexer:
            rows.append(("+ its indexer, not built (formula)", mtp_indexer, None))
        rows.append(("+ its e_score_correction_bias (buffer)", missing["mtp"] - mtp_indexer,
                     None))
    else:
        rows.append(("MTP layer, not built (formula)", missing["mtp"], None))
    rows += [(f"= HF MTP layer ({_mtp_hf_index(cfg)})", hf_mtp, HF_MTP_PARAMS),
             ("= HF total (main + MTP)", main + hf_mtp, HF_TOTAL_PARAMS),
             ("HF active (main)", active, HF_ACTIVE_PARAMS),
             ("HF active without embedding+head", active - b.embed_head,
              HF_ACTIVE_NO_EMBED_PARAMS)]
    for label, value, released in rows:
        tail = ("" if released is None
                else f"  released {_n(released):>19}  {rep.check(value, released)}")
        rep.add(f"  {label:<41}{_n(value):>19}{tail}")
    extra = sum(missing.values())
    rep.add(f"  built total_params {_n(b.total + m.total)} + {_n(extra)} not held as parameters "
            f"= {_n(b.total + m.total + extra)} = HF total")
    lacking = (["the DSA indexer in every layer"] if indexer else []) + [
        "the expert bias as a parameter (it is a buffer)"] + (
        [] if sets else ["the MTP layer (model.mtp_num_steps=0)"])
    rep.add("  missing from the built model: " + ", ".join(lacking))


def build_report(cfg: GLM5Config, built: Built, header: list[str]) -> Report:
    rep = Report()
    for line in header:
        rep.add(line)
    rep.add()
    absent = absent_components(built)
    _component_rows(cfg, built, absent, rep)
    _layer_rows(cfg, built, absent, rep)
    _total_rows(cfg, built, absent, rep)
    rep.add(f"built model matches the formula: {'yes' if rep.ok else 'NO'}")
    _hf_differences(cfg, built, absent, rep)
    if matches_reference_shapes(cfg):
        _reconciliation(cfg, built, absent, rep)
    b, m = built_totals(cfg, built), built_mtp_totals(cfg, built)
    rep.add(f"main_params={b.total} mtp_params={m.total}")
    rep.add(f"total_params={b.total + m.total} active_params={b.active}")
    return rep


def _header(cfg: GLM5Config, materialize: bool, seconds: float, built: Built) -> list[str]:
    import megatron.core

    from glm5_train.model import transformer_engine_available

    spec = "Transformer Engine spec" if transformer_engine_available() else "local spec (no TE)"
    where = "CPU (materialized)" if materialize else "meta device (no memory)"
    n_dense = cfg.first_k_dense_replace
    mtp = (f"MTP: {_sets(cfg.mtp_sets)} applied for {cfg.mtp_num_steps} steps" if cfg.mtp_sets
           else "MTP: not built (model.mtp_num_steps=0)")
    return [
        (f"GLM-5 parameter count: model={cfg.name}, megatron-core {megatron.core.__version__}, "
         f"{spec}, TP1 PP1 EP1, built on {where} in {seconds:.1f} s "
         f"(parameter devices: {','.join(sorted(built.devices))}; {PARAMS_DTYPE_NAME})"),
        (f"{cfg.num_hidden_layers} layers = {n_dense} dense + {cfg.num_hidden_layers - n_dense} "
         f"MoE; {cfg.n_routed_experts} routed experts ({cfg.num_experts_per_tok} per token) + "
         f"{cfg.n_shared_experts} shared; vocab {cfg.vocab_size}, hidden {cfg.hidden_size}; "
         f"{mtp}"),
    ]


# ----------------------------------------------------------------------------------------------
# Entry point.
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*",
                   help="Hydra overrides, e.g. model=glm5_744b model.num_hidden_layers=4")
    p.add_argument("--materialize", action="store_true",
                   help="build on CPU with real (initialized) weights instead of meta; small "
                        "configs only")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    args = parse_args(argv)
    try:
        cfg = compose_model_config(args.overrides)
        if args.materialize:
            check_materialize_size(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as err:  # all a user can fix
        print(f"count_params: error: {err}", file=sys.stderr)
        return 2
    from parallel import device

    device.install()
    start = time.perf_counter()
    with single_process_group():
        chunks = build_chunks(cfg, args.materialize)
        seconds = time.perf_counter() - start
        built = count_built(chunks)
    rep = build_report(cfg, built, _header(cfg, args.materialize, seconds, built))
    print("\n".join(rep.lines), flush=True)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
