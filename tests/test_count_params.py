"""Tests for tools/count_params.py: the CLI as a user runs it (subprocess), and its formula.

The tool builds the real megatron-core model (meta device), MTP layer included, and counts it;
these tests check the count against the released GLM-5 checkpoint and, for the tiny model, against
a model built for real on CPU in a separate process by the training code path.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import warnings

import pytest

from glm5_train.plan import param_count

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "count_params.py")
LAST_LINE = re.compile(r"total_params=(\d+) active_params=(\d+)")
MAIN_MTP_LINE = re.compile(r"main_params=(\d+) mtp_params=(\d+)")
MISSING = re.compile(r"^missing vs HF layout: indexer=(\d+) expert_bias=(\d+) mtp=(\d+)$",
                     re.MULTILINE)

HF_MAIN = 743_911_218_432
HF_MTP = 9_952_920_576
BUILT_MAIN = 743_911_199_232   # HF main less 75 x 256 expert-bias buffers
BUILT_MTP = 9_952_920_320      # HF MTP less its 256 expert-bias buffer
HF_TOTAL = 753_864_139_008
HF_ACTIVE = 41_784_728_832
HF_ACTIVE_NO_EMBED = 39_881_563_392


def _load_tool():
    spec = importlib.util.spec_from_file_location("count_params", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TOOL, *args], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def last_line(proc: subprocess.CompletedProcess) -> tuple[int, int]:
    line = proc.stdout.rstrip("\n").split("\n")[-1]
    match = LAST_LINE.fullmatch(line)
    assert match, f"last line {line!r} is not 'total_params=<N> active_params=<M>'"
    return int(match.group(1)), int(match.group(2))


def main_and_mtp(proc: subprocess.CompletedProcess) -> tuple[int, int]:
    """The line before the last: ``main_params=<N> mtp_params=<M>``."""
    line = proc.stdout.rstrip("\n").split("\n")[-2]
    match = MAIN_MTP_LINE.fullmatch(line)
    assert match, f"line {line!r} is not 'main_params=<N> mtp_params=<M>'"
    return int(match.group(1)), int(match.group(2))


def missing(proc: subprocess.CompletedProcess) -> dict[str, int]:
    match = MISSING.search(proc.stdout)
    assert match, proc.stdout
    return dict(zip(("indexer", "expert_bias", "mtp"), map(int, match.groups())))


@pytest.fixture(scope="module")
def tool():
    return _load_tool()


@pytest.fixture(scope="module")
def big() -> subprocess.CompletedProcess:
    proc = run_tool("model=glm5_744b")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def tiny() -> subprocess.CompletedProcess:
    proc = run_tool("model=glm5_tiny")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


# ------------------------------------------------------------------------------ the CLI output


@pytest.mark.parametrize("flavour", ["tiny", "big"])
def test_last_line_format_and_formula_match(flavour, request):
    proc = request.getfixturevalue(flavour)
    total, active = last_line(proc)
    main, mtp = main_and_mtp(proc)
    assert total == main + mtp  # total_params counts the MTP layer ...
    assert 0 < mtp < main
    assert 0 < active < main    # ... active_params is the main model's
    assert "built model matches the formula: yes" in proc.stdout
    assert "MISMATCH" not in proc.stdout


def test_744b_reconciles_with_released_checkpoint(big):
    total, active = last_line(big)
    main, mtp = main_and_mtp(big)
    extra = missing(big)
    assert (main, mtp) == (BUILT_MAIN, BUILT_MTP)
    assert main + extra["indexer"] + extra["expert_bias"] == HF_MAIN
    assert extra["mtp"] == 256  # the built MTP layer lacks only its expert bias (a buffer)
    assert mtp + extra["mtp"] == HF_MTP
    assert total + sum(extra.values()) == HF_TOTAL
    assert active + extra["indexer"] + extra["expert_bias"] == HF_ACTIVE
    assert "reconciliation with the released GLM-5 checkpoint" in big.stdout
    assert re.search(r"= HF MTP layer \(model\.layers\.78\) +9,952,920,576 +released +"
                     r"9,952,920,576 +ok", big.stdout)
    assert re.search(r"= HF total \(main \+ MTP\) +753,864,139,008 +released +753,864,139,008 +ok",
                     big.stdout)
    assert "built on meta device" in big.stdout


def test_744b_component_breakdown(big):
    """Spot-check rows against shapes of the HF checkpoint (docs/glm5_reference.md, sec. 2)."""
    rows = {line.split()[0]: line for line in big.stdout.splitlines() if line.strip()}
    assert "[16384, 2048]" in rows["q_up"] and "78" in rows["q_up"].split()
    assert "[28672, 512]" in rows["kv_up"]
    assert "256 x ([4096, 6144] + [6144, 2048])" in rows["routed_experts"]
    assert "[4096, 2048] + [128, 6144] + [128] + [128] + [32, 6144]" in rows["indexer"]
    assert "expert_bias: 75 x 256 = 19,200" in big.stdout
    # The MTP layer (HF model.layers.78): its own modules, its MoE layer, its expert bias.
    assert "[6144, 12288]" in rows["eh_proj"] and "75,497,472" in rows["eh_proj"]
    for key in ("enorm", "hnorm", "mtp_final_norm"):
        assert "[6144]" in rows[key] and rows[key].endswith("ok")
    assert "9,877,404,416" in rows["moe_layer"] and rows["moe_layer"].endswith("ok")
    assert re.search(r"MTP +sets +0 +1 x +9,952,920,320 = built +9,952,920,320 +formula +"
                     r"9,952,920,320 +ok", big.stdout)
    assert "transformer_layer.mlp.router.expert_bias: 1 x 256 = 256" in big.stdout
    assert "MTP expert bias: built buffers 256, formula 1 set x 256 = 256  ok" in big.stdout


def test_tiny_has_no_reconciliation_but_reports_missing(tiny, tool):
    assert "reconciliation" not in tiny.stdout
    cfg = param_count.GLM5Config.from_dict(_tiny_dict())
    assert missing(tiny)["mtp"] == param_count.expert_bias_params(cfg) == 8  # MTP built, less its bias
    assert missing(tiny)["expert_bias"] == 3 * 8
    main, mtp = main_and_mtp(tiny)
    assert main == param_count.formula_totals(cfg).total
    assert mtp == param_count.mtp_formula_totals(cfg).total == param_count.mtp_params(cfg) - 8
    assert last_line(tiny)[1] == param_count.formula_totals(cfg).active  # main model only


# ------------------------------------------------- meta count == a model really built on CPU

REAL_BUILD = r"""
import os, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[1])
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from parallel import mcore_compat
mcore_compat.install()
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from glm5_train.model.config import GLM5Config, to_mcore_config
from parallel.layout import ParallelSizes
from glm5_train.model.glm5 import build_model_chunks, count_parameters

dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, 1)
model_parallel_cuda_manual_seed(1)
cfg = GLM5Config.from_dict(OmegaConf.to_container(OmegaConf.load(sys.argv[2])))
chunks = build_model_chunks(cfg, to_mcore_config(cfg, ParallelSizes()))
params = [p for c in chunks for p in c.parameters()]
assert all(p.device.type == "cpu" and p.abs().sum() > 0 for p in params[:4])
print(count_parameters(chunks))
"""


def test_tiny_meta_count_equals_real_cpu_model(tiny, tmp_path):
    yaml = os.path.join(REPO, "configs", "model", "glm5_tiny.yaml")
    proc = subprocess.run([sys.executable, "-c", REAL_BUILD, REPO, yaml, str(tmp_path / "pg")],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    real = int(proc.stdout.split()[-1])
    assert last_line(tiny)[0] == real


def test_tiny_materialize_matches_meta(tiny):
    proc = run_tool("model=glm5_tiny", "--materialize")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "built on CPU (materialized)" in proc.stdout
    assert last_line(proc) == last_line(tiny)


# --------------------------------------------------------------------- overrides and errors


def test_overrides_change_the_model(tool):
    """Also model.mtp_num_steps=0: no MTP layer is built, all of HF's is reported missing."""
    proc = run_tool("model=glm5_tiny", "model.num_hidden_layers=6",
                    "model.first_k_dense_replace=2", "model.topk_method=greedy",
                    "model.mtp_num_steps=0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cfg = param_count.GLM5Config.from_dict({**_tiny_dict(), "num_hidden_layers": 6,
                                     "first_k_dense_replace": 2, "topk_method": "greedy",
                                     "mtp_num_steps": 0})
    expected = param_count.formula_totals(cfg)
    assert last_line(proc) == (expected.total, expected.active)
    assert main_and_mtp(proc) == (expected.total, 0)
    assert missing(proc)["expert_bias"] == 0
    assert missing(proc)["mtp"] == param_count.mtp_params(cfg) > 0
    assert "MTP: not built (model.mtp_num_steps=0)" in proc.stdout


# Usage errors return before any model is built or the device layer is installed: run in-process.


def test_materialize_refuses_large_models(tool, capsys):
    assert tool.main(["model=glm5_744b", "--materialize"]) == 2
    assert "drop --materialize" in capsys.readouterr().err


def test_unknown_field_is_a_usage_error(tool, capsys):
    assert tool.main(["model=glm5_tiny", "model.no_such_field=1"]) == 2
    assert capsys.readouterr().err.startswith("count_params: error:")


def test_mistyped_override_is_a_usage_error(tool, capsys):
    assert tool.main(["model=glm5_tiny", "model.hidden_size=abc"]) == 2
    assert "model.hidden_size='abc'" in capsys.readouterr().err


# --------------------------------------------------------------------------- the formula alone


def _tiny_dict() -> dict:
    from omegaconf import OmegaConf

    path = os.path.join(REPO, "configs", "model", "glm5_tiny.yaml")
    return OmegaConf.to_container(OmegaConf.load(path))


def test_formula_reproduces_released_numbers(tool):
    cfg = param_count.GLM5Config()  # the dataclass defaults are GLM-5 744B
    assert tool.matches_reference_shapes(cfg)
    main = param_count.hf_main_totals(cfg)
    assert main.total == HF_MAIN
    assert main.active == HF_ACTIVE
    assert main.active_no_embed == HF_ACTIVE_NO_EMBED
    assert param_count.mtp_params(cfg) == HF_MTP
    assert main.total + param_count.missing_vs_hf(cfg)["mtp"] == HF_TOTAL
    # The MTP layer megatron builds: HF's less its expert bias (a buffer).
    assert cfg.mtp_sets == 1
    assert param_count.mtp_formula_totals(cfg).total == BUILT_MTP
    assert param_count.formula_totals(cfg).total == BUILT_MAIN
    assert param_count.missing_vs_hf(cfg, mtp_sets=1)["mtp"] == 256
    assert param_count.mtp_formula_totals(param_count.GLM5Config(mtp_num_steps=0)).total == 0


def test_reference_shapes_detects_a_changed_shape(tool):
    cfg = param_count.GLM5Config(num_hidden_layers=77)
    assert not tool.matches_reference_shapes(cfg)
    assert tool.matches_reference_shapes(param_count.GLM5Config(rope_theta=10_000.0))


def test_unknown_parameter_name_is_reported(tool):
    with pytest.raises(ValueError, match="fits no component"):
        param_count._classify("self_attention.core_attention.new_module.weight", param_count.LAYER_RULES)
    with pytest.raises(ValueError, match="fits no component"):
        param_count._classify("mtp.layers.0.eh_proj.weight", param_count.TOP_RULES)
    assert param_count._classify("self_attention.core_attention.indexer.wk.weight",
                          param_count.LAYER_RULES) == "indexer"


def test_mtp_parameter_names_are_classified(tool):
    """After ``mtp.layers.<j>.``: its own modules, and its decoder layer by LAYER_RULES."""
    for name, key in (("enorm.weight", "enorm"), ("hnorm.weight", "hnorm"),
                      ("eh_proj.weight", "eh_proj"), ("final_layernorm.weight", "mtp_final_norm"),
                      ("transformer_layer.self_attention.linear_q_down_proj.weight", "q_down"),
                      ("transformer_layer.self_attention.core_attention.indexer.k_norm.bias",
                       "indexer"),
                      ("transformer_layer.mlp.experts.local_experts.3.linear_fc2.weight",
                       "routed_experts"),
                      ("transformer_layer.pre_mlp_layernorm.weight", "pre_mlp_norm")):
        assert param_count.classify_mtp(name) == key, name
    with pytest.raises(ValueError, match="fits no component"):
        param_count.classify_mtp("embedding.word_embeddings.weight")
    with pytest.raises(ValueError, match="fits no component"):
        param_count.classify_mtp("transformer_layer.new_module.weight")


# ----------------------------------------------- the report on synthetic counts (no model build)


def _synthetic_built(tool, cfg, absent=frozenset(), drop_layer=None, mtp_drop=None):
    """Counts as a model matching the formula would give, less ``absent`` components (and the
    ``mtp_drop`` component of the MTP sets); MTP sets as ``cfg.mtp_sets`` says."""
    built = param_count.Built(top={t.key: t.count for t in param_count.top_terms(cfg)})
    for i, moe in enumerate(cfg.moe_layer_pattern):
        if i != drop_layer:
            built.layers[i] = {t.key: t.count for t in param_count.layer_terms(cfg, bool(moe), absent)}
    n_moe = sum(cfg.moe_layer_pattern)
    built.buffers["decoder.layers.<i>.mlp.router.expert_bias"] = (n_moe,
                                                                  n_moe * cfg.n_routed_experts)
    for j in range(cfg.mtp_sets):
        built.mtp[j] = {t.key: t.count for t in param_count.mtp_layer_terms(cfg, absent)
                        if t.key != mtp_drop}
    if cfg.mtp_sets:
        built.buffers["mtp.layers.<i>.transformer_layer.mlp.router.expert_bias"] = (
            cfg.mtp_sets, cfg.mtp_sets * cfg.n_routed_experts)
    return built


@pytest.mark.parametrize("steps", [3, 0], ids=["mtp", "no_mtp"])
@pytest.mark.parametrize("absent", [frozenset(), frozenset({"indexer"})],
                         ids=["indexer", "no_indexer"])
def test_report_reconciles_with_or_without_the_indexer_and_mtp(tool, absent, steps):
    """The DSA indexer may or may not be built yet, the MTP layer is built unless
    mtp_num_steps=0: every case must reconcile with the release."""
    cfg = param_count.GLM5Config(mtp_num_steps=steps)
    rep = tool.build_report(cfg, _synthetic_built(tool, cfg, absent), ["header"])
    text = "\n".join(rep.lines)
    assert rep.ok, text
    total, active = map(int, LAST_LINE.fullmatch(rep.lines[-1]).groups())
    main, mtp = map(int, MAIN_MTP_LINE.fullmatch(rep.lines[-2]).groups())
    extra = missing(subprocess.CompletedProcess([], 0, stdout=text))
    indexer = 9_371_904
    assert extra["indexer"] == (78 * indexer if absent else 0)
    assert total == main + mtp
    assert mtp == (BUILT_MTP - (indexer if absent else 0) if steps else 0)
    assert extra["mtp"] == (256 + (indexer if absent else 0) if steps else HF_MTP)
    assert main + extra["indexer"] + extra["expert_bias"] == HF_MAIN
    assert mtp + extra["mtp"] == HF_MTP
    assert total + sum(extra.values()) == HF_TOTAL
    assert active + extra["indexer"] + extra["expert_bias"] == HF_ACTIVE
    assert ("not built: missing vs HF" in text) == bool(absent)
    assert ("MTP layer, not built (formula)" in text) == (not steps)


def test_report_flags_a_missing_layer(tool):
    cfg = param_count.GLM5Config.from_dict(_tiny_dict())
    rep = tool.build_report(cfg, _synthetic_built(tool, cfg, drop_layer=2), ["header"])
    assert not rep.ok
    assert "MISMATCH in layers [2]" in "\n".join(rep.lines)


def test_report_flags_a_wrong_mtp_layer(tool):
    cfg = param_count.GLM5Config.from_dict(_tiny_dict())
    rep = tool.build_report(cfg, _synthetic_built(tool, cfg, mtp_drop="eh_proj"), ["header"])
    text = "\n".join(rep.lines)
    assert not rep.ok
    assert "MISMATCH in sets [0]" in text
    assert "set 0: built - formula per component: eh_proj -32,768" in text
    # An MTP layer built although mtp_num_steps=0 says none should be.
    off = param_count.GLM5Config.from_dict({**_tiny_dict(), "mtp_num_steps": 0})
    built = _synthetic_built(tool, off)
    built.mtp[0] = {t.key: t.count for t in param_count.mtp_layer_terms(off)}
    rep = tool.build_report(off, built, ["header"])
    assert not rep.ok
    assert "MISMATCH: built MTP sets [0] beyond the 0 expected" in "\n".join(rep.lines)
