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
import os
import sys
import time
import warnings

# Runnable as a script from anywhere: make the repo root importable.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

# megatron-core warns at import about optional GPU libraries that counting never uses.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="Apex is not installed")
warnings.filterwarnings("ignore", message="full scope is deprecated")

import megatron.core  # noqa: E402
import torch  # noqa: E402
from hydra.errors import HydraException  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from glm5_train.job_config import compose_model_config  # noqa: E402
from glm5_train.model.config import (  # noqa: E402
    GLM5Config,
    to_mcore_config,
)
from glm5_train.model.glm5 import (  # noqa: E402
    build_model_chunks,
    transformer_engine_available,
)
from glm5_train.plan.param_count import (  # noqa: E402
    HF_ACTIVE_NO_EMBED_PARAMS,
    HF_ACTIVE_PARAMS,
    HF_MAIN_PARAMS,
    HF_MTP_PARAMS,
    HF_TOTAL_PARAMS,
    MTP_RULES,
    SHAPE_FIELDS,
    Built,
    absent_components,
    built_mtp_totals,
    built_totals,
    count_built,
    expert_bias_buffers,
    expert_bias_params,
    formula_totals,
    hf_moe_layer_params,
    indexer_params,
    indexer_term,
    layer_terms,
    missing_vs_hf,
    mtp_formula_totals,
    mtp_layer_terms,
    mtp_wrapper_terms,
    top_terms,
)
from parallel import mcore_compat  # noqa: E402
from parallel.layout import ParallelSizes  # noqa: E402
from parallel.process_groups import single_process_group  # noqa: E402

CONFIG_DIR = os.path.join(_REPO_ROOT, "configs")
REFERENCE_FLAVOUR = "glm5_744b"

# --materialize allocates every weight: refuse beyond this many bytes (bf16).
MATERIALIZE_LIMIT_BYTES = 2 << 30
PARAMS_DTYPE_NAME = "bf16"


# ----------------------------------------------------------------------------------------------
# Building the model: one process, world size 1, meta device.
# ----------------------------------------------------------------------------------------------


# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  python tools/count_params.py model=glm5_744b
  python tools/count_params.py model=glm5_tiny model.num_hidden_layers=6
  python tools/count_params.py model=glm5_tiny --materialize   # allocate on CPU (small configs)
"""


def build_chunks(cfg: GLM5Config, materialize: bool):
    """Build the model as training does. On meta (default) nothing is allocated: megatron's
    ``use_cpu_initialization`` path creates its weights with ``torch.empty`` and no device,
    which the meta default device captures; initialization is skipped."""
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*",
                   help="Hydra overrides, e.g. model=glm5_744b model.num_hidden_layers=4")
    p.add_argument("--materialize", action="store_true",
                   help="build on CPU with real (initialized) weights instead of meta; small "
                        "configs only")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = compose_model_config(args.overrides)
        if args.materialize:
            check_materialize_size(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as err:  # all a user can fix
        print(f"count_params: error: {err}", file=sys.stderr)
        return 2

    mcore_compat.install()
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
