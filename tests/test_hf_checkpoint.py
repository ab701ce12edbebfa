"""Hugging Face import/export (tools/hf_checkpoint.py, glm5_train/hf_mapping.py).

A tiny random ``GlmMoeDsaForCausalLM`` (the glm5_tiny shapes) is saved with transformers, every
tensor randomised (norms, biases and ``e_score_correction_bias`` included: HF initialises those
to constants, which would hide a swapped mapping). It is imported under torchrun in one process
and in TP2 x PP2 x VPP2 x EP2, each import exported in the *other* layout, and every tensor must
come back bit-identical under the same name, the MTP layer (``model.layers.4.*``) included.
Config mismatches and unsupported HF features are refused naming the field; a job training
without MTP skips and reports the MTP tensors, a job training MTP refuses a checkpoint without.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file

from glm5_train import hf_checkpoint, hf_mapping
from tests.hf_tiny import TINY_HF_CONFIG as TINY_HF
from tests.hf_tiny import build_tiny_hf, hf_indexer_ties_by_index
from tests.parity import run_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "hf_checkpoint.py")
FOUR_RANKS = "tp2_pp2_vpp2_ep2"

# The MTP layer's own tensors; the rest of model.layers.4.* has layer 3's (MoE) shapes.
MTP_OWN = {
    "model.layers.4.eh_proj.weight": (128, 256),
    "model.layers.4.enorm.weight": (128,),
    "model.layers.4.hnorm.weight": (128,),
    "model.layers.4.shared_head.norm.weight": (128,),
}


def run_tool(nprocs: int, *args: str, expect_ok: bool = True, script: str = TOOL,
             torchrun: bool = False) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node=nprocs script *args``; its ranks are forked from the test
    session's server (tests/parity.py's ``run_script``) unless ``torchrun``, which runs the
    real launcher (one test does, so the command as users type it is covered too)."""
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nprocs}", script, *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300, check=False)
    else:
        proc = run_script(nprocs, script, list(args))
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} failed ({proc.returncode}):\n"
                             f"{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


def layout_args(nprocs: int) -> list[str]:
    return ["model=glm5_tiny", f"parallel={'single' if nprocs == 1 else FOUR_RANKS}"]


def read_hf_dir(path) -> dict:
    tensors = {}
    for fname in sorted(os.listdir(path)):
        if fname.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, fname)))
    return tensors


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The tiny random HF model (every tensor randomised), saved once per module."""
    path = tmp_path_factory.mktemp("hf") / "tiny"
    build_tiny_hf(str(path), seed=1234)
    return path


def mtp_tensors(main: dict) -> dict:
    """A random, complete GLM-5 MTP layer for the tiny model: an MoE decoder layer (shapes of
    layer 3) plus eh_proj, enorm, hnorm and shared_head.norm."""
    shapes = dict(MTP_OWN)
    shapes.update({name.replace("model.layers.3.", "model.layers.4."): tuple(t.shape)
                   for name, t in main.items() if name.startswith("model.layers.3.")})
    generator = torch.Generator().manual_seed(7)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


@pytest.fixture(scope="module")
def hf_dir_with_mtp(hf_dir, tmp_path_factory):
    """The same checkpoint plus a full MTP layer in its own file, indexed, num_nextn 1."""
    path = tmp_path_factory.mktemp("hf_mtp") / "tiny"
    shutil.copytree(hf_dir, path)
    mtp = mtp_tensors(read_hf_dir(hf_dir))
    save_file(mtp, str(path / "mtp.safetensors"))
    weight_map = {name: "model.safetensors" for name in read_hf_dir(hf_dir)}
    weight_map.update({name: "mtp.safetensors" for name in mtp})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def imports(hf_dir_with_mtp, tmp_path_factory):
    """Imported checkpoints (with the MTP layer) per process count: (checkpoint dir, tool
    output). 4 ranks: TP2 x PP2 x VPP2 x EP2, MTP on the stage before the loss stage, which
    shares pipeline rank 0 with the embedding (so rank 0 holds two embedding copies)."""
    root = tmp_path_factory.mktemp("imports")
    out = {}
    for nprocs, source in ((1, hf_dir_with_mtp), (4, hf_dir_with_mtp)):
        ckpt = root / f"ckpt{nprocs}"
        proc = run_tool(nprocs, "import", "--hf-dir", str(source), "--save", str(ckpt),
                        *layout_args(nprocs))
        out[nprocs] = (ckpt, proc.stdout + proc.stderr)
    return out


@pytest.mark.parametrize("import_procs,export_procs", [(1, 4), (4, 1)])
def test_round_trip_is_bit_exact_across_layouts(hf_dir_with_mtp, imports, tmp_path,
                                                import_procs, export_procs):
    ckpt, _ = imports[import_procs]
    out = tmp_path / "exported"
    run_tool(export_procs, "export", "--load", str(ckpt), "--hf-dir", str(out),
             *layout_args(export_procs))
    original, exported = read_hf_dir(hf_dir_with_mtp), read_hf_dir(out)
    assert set(exported) == set(original)
    cfg = hf_mapping.hf_config_to_glm5(json.loads((out / "config.json").read_text()))
    assert set(hf_mapping.hf_mtp_names_for(cfg)) == {n for n in original if ".layers.4." in n}
    differing = [name for name, tensor in original.items()
                 if exported[name].dtype != tensor.dtype or not torch.equal(exported[name], tensor)]
    assert not differing, differing
    # One shard per decoder layer and the MTP layer, one for embedding / final norm / head.
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    assert len(set(index["weight_map"].values())) == 6
    assert index["weight_map"]["model.layers.2.mlp.experts.7.up_proj.weight"] == \
        "model-00004-of-00006.safetensors"
    assert index["weight_map"]["model.layers.4.eh_proj.weight"] == \
        "model-00006-of-00006.safetensors"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert config["model_type"] == "glm_moe_dsa"
    assert config["num_nextn_predict_layers"] == 1
    assert config["indexer_types"] == ["full"] * 4
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    assert config["dtype"] == "float32"
    if import_procs == 4:
        _check_loads_in_transformers(out, original)


def _check_loads_in_transformers(out, original: dict) -> None:
    """transformers reads the export (fusing the per-expert tensors) into the same weights."""
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(out)
    config = model.config
    for name, value in TINY_HF.items():
        if name != "num_nextn_predict_layers":
            assert getattr(config, name) == value, name
    state = model.state_dict()
    assert torch.equal(state["model.layers.3.mlp.gate.e_score_correction_bias"],
                       original["model.layers.3.mlp.gate.e_score_correction_bias"])
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"][5]
    assert torch.equal(gate_up, torch.cat([original["model.layers.1.mlp.experts.5.gate_proj.weight"],
                                           original["model.layers.1.mlp.experts.5.up_proj.weight"]]))


# Run inside torchrun: load a checkpoint in one process and save the model's logits.
FORWARD_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from glm5_train.checkpoint import load_checkpoint
from glm5_train.model.config import to_mcore_config
from glm5_train.model.glm5 import build_model_chunks
from glm5_train.job_config import compose_job
from parallel import mcore_compat
from parallel.process_groups import init_distributed
job = compose_job(["model=glm5_tiny", "parallel=single"])
mcore_compat.install()
init_distributed(job.parallel, 0)
config = to_mcore_config(job.model, job.parallel, torch.float32)
chunk = build_model_chunks(job.model, config)[0].eval()
load_checkpoint(sys.argv[2], [chunk], None, None, job.model)
ids = torch.load(sys.argv[3])
with torch.no_grad():
    torch.save(chunk(ids, torch.arange(ids.shape[1])[None], None), sys.argv[4])
"""


def test_imported_model_reproduces_hf_logits(hf_dir, imports, tmp_path):
    """The mapping is right, not just reversible: the model imported (TP2 x PP2 x VPP2 x EP2)
    and run in one process gives HF's logits, over more tokens than index_topk so the DSA
    indexer (k_norm, weights_proj, ...) and the expert-bias routing decide the result."""
    from transformers import GlmMoeDsaForCausalLM

    ckpt, _ = imports[4]
    ids = torch.randint(0, TINY_HF["vocab_size"], (1, 48),
                        generator=torch.Generator().manual_seed(3))
    torch.save(ids, tmp_path / "ids.pt")
    (tmp_path / "forward.py").write_text(FORWARD_SCRIPT)
    run_tool(1, REPO, str(ckpt), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt"),
             script=str(tmp_path / "forward.py"))
    ours = torch.load(tmp_path / "logits.pt")
    model = GlmMoeDsaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad(), hf_indexer_ties_by_index():  # our top-k tie rule (see there)
        reference = model(ids).logits
    assert ours.shape == reference.shape
    # fp32, random unit-variance weights: summation order differs by ~1e-5 relative.
    scale = reference.abs().max().item()
    assert (ours - reference).abs().max().item() <= 1e-4 * scale


def test_mtp_layer_is_skipped_and_reported_without_mtp_training(hf_dir_with_mtp, tmp_path):
    proc = run_tool(1, "import", "--hf-dir", str(hf_dir_with_mtp), "--save", str(tmp_path / "c"),
                    *layout_args(1), "model.mtp_num_steps=0")
    log = proc.stdout + proc.stderr
    mtp = [n for n in read_hf_dir(hf_dir_with_mtp) if n.startswith("model.layers.4.")]
    assert f"skipped {len(mtp)} MTP tensors (model.layers.4.*" in log, log[-3000:]
    assert "model.layers.4.eh_proj.weight" in log


def test_checkpoint_without_mtp_is_refused_when_mtp_trains(hf_dir, tmp_path):
    proc = run_tool(1, "import", "--hf-dir", str(hf_dir), "--save", str(tmp_path / "c"),
                    *layout_args(1), expect_ok=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert ("HF config.json has num_nextn_predict_layers=0 MTP layer(s) but the model trains "
            "model.num_nextn_predict_layers=1") in log, log[-3000:]
    assert "model.mtp_num_steps=0" in log
    assert not (tmp_path / "c").exists()


def test_mismatching_config_is_refused(hf_dir, tmp_path):
    """Under the real torchrun: the one-line refusal is what a user's command prints."""
    ckpt = tmp_path / "ckpt"
    proc = run_tool(1, "import", "--hf-dir", str(hf_dir), "--save", str(ckpt),
                    *layout_args(1), "model.hidden_size=96", expect_ok=False, torchrun=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "HF config.json has hidden_size=128 but the model config has model.hidden_size=96" \
        in log, log[-3000:]
    assert not ckpt.exists()


# ---- In-process: config and name mapping ----------------------------------------------------


def tiny_hf_config(**changes) -> dict:
    config = dict(TINY_HF, model_type="glm_moe_dsa", architectures=["GlmMoeDsaForCausalLM"])
    config.update(changes)
    return config


def test_hf_config_maps_onto_glm5_tiny():
    from glm5_train.job_config import compose_job

    ours = compose_job(["model=glm5_tiny", "parallel=single"]).model
    ported = hf_mapping.hf_config_to_glm5(tiny_hf_config(num_nextn_predict_layers=1))
    hf_mapping.check_config_matches(ported, ours)
    assert ported.rope_theta == 1e6 and ported.num_nextn_predict_layers == 1
    # glm5_tiny trains an MTP layer: a checkpoint without one does not fit it.
    without = hf_mapping.hf_config_to_glm5(tiny_hf_config())
    assert without.num_nextn_predict_layers == 0 and without.mtp_num_steps == 0
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0 MTP layer"):
        hf_mapping.check_config_matches(without, ours)
    # Older configs: top-level rope_theta, no rope_parameters.
    old = tiny_hf_config(rope_theta=10000)
    del old["rope_parameters"]
    assert hf_mapping.hf_config_to_glm5(old).rope_theta == 10000.0
    with pytest.raises(ValueError, match="model.q_lora_rank=64"):
        hf_mapping.check_config_matches(
            hf_mapping.hf_config_to_glm5(tiny_hf_config(q_lora_rank=48)), ours)


@pytest.mark.parametrize("changes,field", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_type"),
    ({"indexer_types": ["full", "shared", "full", "shared"]}, "indexer_types"),
    ({"index_topk_freq": 2}, "indexer_types"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}, "n_group"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_layer_types": ["dense", "dense", "sparse", "sparse"]}, "mlp_layer_types"),
    ({"model_type": "deepseek_v3"}, "model_type"),
])
def test_unsupported_hf_configs_are_refused(changes, field):
    with pytest.raises(ValueError, match=field):
        hf_mapping.hf_config_to_glm5(tiny_hf_config(**changes))


def test_group_limited_routing_is_accepted_where_it_matches():
    cfg = hf_mapping.hf_config_to_glm5(tiny_hf_config(n_group=4, topk_group=1))
    assert cfg.n_group == 4


def test_name_mapping_covers_the_hf_model_both_ways(hf_dir):
    names = set(read_hf_dir(hf_dir))
    cfg = hf_mapping.hf_config_to_glm5(json.loads((hf_dir / "config.json").read_text()))
    assert set(hf_mapping.hf_names_for(cfg)) == names
    for name in names:
        where = hf_mapping.hf_to_mcore(name)
        assert where is not None, name
        assert hf_mapping.mcore_to_hf(where.key, where.index)[where.part] == name
    assert hf_mapping.hf_to_mcore("model.layers.4.eh_proj.weight") is None
    assert hf_mapping.mcore_to_hf("decoder.layers.1.mlp.experts.experts.linear_fc1.weight",
                                  (3,)) == ["model.layers.1.mlp.experts.3.gate_proj.weight",
                                            "model.layers.1.mlp.experts.3.up_proj.weight"]
    mtp = hf_mapping.hf_mtp_names_for(cfg if cfg.num_nextn_predict_layers else
                                      dataclasses.replace(cfg, num_nextn_predict_layers=1))
    for name in mtp:
        where = hf_mapping.hf_to_mcore(name, num_hidden_layers=4)
        assert where is not None and where.key.startswith("mtp.layers.0."), name
        assert hf_mapping.mcore_to_hf(where.key, where.index, 4)[where.part] == name
    assert hf_mapping.hf_to_mcore("model.layers.4.shared_head.norm.weight", 4).key == \
        "mtp.layers.0.final_layernorm.weight"
    assert hf_mapping.is_mtp_name("model.layers.4.enorm.weight", 4, 1)
    assert not hf_mapping.is_mtp_name("model.layers.4.enorm.weight", 4, 0)


def test_export_config_reads_back_as_the_same_model():
    cfg = hf_mapping.hf_config_to_glm5(tiny_hf_config())
    exported = hf_mapping.glm5_to_hf_config(cfg, torch.bfloat16)
    assert exported["dtype"] == "bfloat16"
    hf_mapping.check_config_matches(hf_mapping.hf_config_to_glm5(exported), cfg)
    from transformers import GlmMoeDsaConfig

    hf = GlmMoeDsaConfig(**{k: v for k, v in exported.items()
                            if k not in ("architectures", "model_type", "dtype")})
    assert hf.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]


def test_unknown_unused_and_doubly_used_tensors_are_errors():
    tool = hf_checkpoint
    expected = {"a", "b", "c", "model.layers.0.mystery.weight"}
    rank0 = ({"a": ["x", 6, 6], "b": ["y", 2, 4]}, [], {})
    rank1 = ({"b": ["y", 2, 4], "c": ["z", 3, 3]}, [], {})
    rank2 = ({"c": ["w", 0, 3]}, ["e1"], {})
    problems, _ = tool._check_import([rank0, rank1, rank2], expected)
    assert problems[0] == "e1"
    assert any("c is used by several model tensors" in p for p in problems)
    assert any(p.startswith("1 HF tensor(s) unknown to or unused by the model: "
                            "model.layers.0.mystery.weight") for p in problems)
    assert not any(p.startswith("b") for p in problems)  # 2 + 2 of 4 elements: exact
    problems, _ = tool._check_import([({"a": ["x", 12, 6]}, [], {})], {"a"})
    assert problems == [("a: the model's shards cover 12 of its 6 elements (each must be used "
                         "exactly once)")]


# ------------------------------------------------------------- an export transformers can use

TOKENIZER = os.path.join(REPO, "tests", "data", "glm_tiny_tokenizer")


class _EndAfter:
    """A logits processor that plants the end-of-text logit: after ``steps`` new tokens the
    eos id wins every step. Generation then stops there only if the model's
    generation_config names that id as eos (without one it runs on to max_new_tokens)."""

    def __init__(self, prompt_length: int, steps: int, eos: int) -> None:
        self.prompt_length, self.steps, self.eos = prompt_length, steps, eos

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.prompt_length >= self.steps:
            scores[:, self.eos] = scores.max() + 100.0
        return scores


@pytest.fixture(scope="module")
def exports(imports, tmp_path_factory):
    """The one-process import exported with the tiny GLM tokenizer: with its MTP layer, and
    with --no-mtp; (directory, tool output) each."""
    root = tmp_path_factory.mktemp("exports")
    ckpt, _ = imports[1]
    out = {}
    for name, extra in (("with_mtp", []), ("no_mtp", ["--no-mtp"])):
        proc = run_tool(1, "export", "--load", str(ckpt), "--hf-dir", str(root / name), *extra,
                        *layout_args(1), f"data.tokenizer={TOKENIZER}")
        out[name] = (root / name, proc.stdout + proc.stderr)
    return out


def test_export_carries_tokenizer_generation_config_and_readable_modes(exports):
    from transformers import AutoTokenizer

    out, log = exports["with_mtp"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == open(os.path.join(TOKENIZER, name), "rb").read()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token_id == 285 and tok.decode(tok.encode("a b c")) == "a b c"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [285, 289, 291]  # end of text, then end-of-turn ids
    assert generation["pad_token_id"] == 285
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == [285, 289, 291] and config["bos_token_id"] is None
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes  # 0644 under umask 022
    assert ("note: transformers' GlmMoeDsaForCausalLM has no MTP layer: it ignores the MTP "
            "layer's") in log and "export --no-mtp leaves them out" in log


def test_export_generates_and_stops_at_end_of_text(exports):
    """transformers loads the export and generate stops at the planted eos because
    generation_config.json carries the tokenizer's eos ids."""
    from transformers import AutoTokenizer, GlmMoeDsaForCausalLM, LogitsProcessorList

    out, _ = exports["no_mtp"]
    tok = AutoTokenizer.from_pretrained(out)
    model = GlmMoeDsaForCausalLM.from_pretrained(out).eval()
    assert model.generation_config.eos_token_id == [285, 289, 291]
    prompt = torch.tensor([tok.encode("def main():")])
    planted = LogitsProcessorList([_EndAfter(prompt.shape[1], 2, eos=289)])
    with torch.no_grad():
        ids = model.generate(prompt, max_new_tokens=12, do_sample=False,
                             logits_processor=planted)
    new = ids[0, prompt.shape[1]:].tolist()
    assert len(new) == 3 and new[-1] == 289, new  # two tokens, then eos, then stop


def test_no_mtp_export_loads_without_unexpected_tensors(exports):
    """--no-mtp: no model.layers.4.* tensors, num_nextn_predict_layers 0, and transformers'
    load report has nothing unexpected or missing; with MTP its 'unexpected' list is exactly
    the MTP layer (what the export's note says)."""
    from transformers import GlmMoeDsaForCausalLM

    out, log = exports["no_mtp"]
    assert not any(".layers.4." in name for name in read_hf_dir(out))
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert "has no MTP layer" not in log
    _, info = GlmMoeDsaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"], info
    _, info = GlmMoeDsaForCausalLM.from_pretrained(exports["with_mtp"][0],
                                                   output_loading_info=True)
    assert info["unexpected_keys"] and all(".layers.4." in k for k in info["unexpected_keys"])
    assert not info["missing_keys"]


# ------------------------------------------ a tokenizer that does not fit the model is refused

BYTE_REFUSAL = ("data.tokenizer=byte has 258 ids but model.vocab_size=154880: the byte "
                "tokenizer's ids (end of text 256) fit only a byte-level model "
                "(model.vocab_size 258..1024); pass data.tokenizer=<the HF tokenizer directory "
                "the model was trained with> so the export carries its tokenizer files and "
                "end-of-text id")


def _refusal_line(proc: subprocess.CompletedProcess) -> str:
    """The error lines the tool printed (rank 0 only): exactly one is expected."""
    lines = [line for line in (proc.stdout + proc.stderr).splitlines()
             if line.startswith("hf_checkpoint: error: ")]
    assert len(lines) == 1, (proc.stdout + proc.stderr)[-3000:]
    return lines[0].removeprefix("hf_checkpoint: error: ")


@pytest.mark.parametrize("nprocs", [1, 4])
def test_export_refuses_the_byte_tokenizer_for_a_real_vocabulary(tmp_path, nprocs):
    """The documented 744B export without data.tokenizer got the data group's default byte
    tokenizer, eos 256 in a 154880-id vocabulary. Refused in one line before the checkpoint is
    read (--load names nothing) or any file written, on every rank (4 ranks: none hangs)."""
    out = tmp_path / "exported"
    proc = run_tool(nprocs, "export", "--load", str(tmp_path / "no_checkpoint"), "--hf-dir",
                    str(out), *layout_args(nprocs), "model.vocab_size=154880", expect_ok=False)
    assert proc.returncode != 0
    assert _refusal_line(proc) == BYTE_REFUSAL
    assert not out.exists()


def test_export_refuses_a_tokenizer_directory_without_tokenizer_files(tmp_path):
    empty = tmp_path / "not_a_tokenizer"
    empty.mkdir()
    (empty / "config.json").write_text("{}")  # a model directory's config is no tokenizer
    out = tmp_path / "exported"
    proc = run_tool(4, "export", "--load", str(tmp_path / "no_checkpoint"), "--hf-dir",
                    str(out), *layout_args(4), f"data.tokenizer={empty}", expect_ok=False)
    assert proc.returncode != 0
    line = _refusal_line(proc)
    assert line.startswith(f"data.tokenizer={empty} holds no tokenizer files (any of "
                           "tokenizer.json, "), line
    assert line.endswith("pass data.tokenizer=<the HF tokenizer directory the model was trained "
                         "with> so the export carries its tokenizer files and end-of-text id")
    assert not out.exists()


def test_tokenizer_problems_name_value_rule_and_fix(tmp_path):
    """In process: what fits (the byte tokenizer in a padded byte-level vocabulary, the tiny
    GLM tokenizer in glm5_tiny's 320 ids) and the one-line refusals; make-random refuses too."""
    from glm5_train.job_config import compose_job

    def problem(*overrides):
        return hf_checkpoint.tokenizer_problem(
            compose_job(["model=glm5_tiny", "parallel=single", *overrides]))

    assert problem() is None  # glm5_tiny (320 ids) is byte-level
    assert problem("model.vocab_size=1024") is None
    assert problem(f"data.tokenizer={TOKENIZER}") is None
    assert problem("model.vocab_size=154880") == BYTE_REFUSAL
    assert problem("model.vocab_size=1088").startswith(
        "data.tokenizer=byte has 258 ids but model.vocab_size=1088: ")
    assert problem(f"data.tokenizer={TOKENIZER}", "model.vocab_size=256").startswith(
        f"data.tokenizer={TOKENIZER} has 300 ids but model.vocab_size=256: a tokenizer may not "
        "have more ids than the model; pass data.tokenizer=")
    assert problem(f"data.tokenizer={tmp_path / 'missing'}").startswith(
        f"data.tokenizer={tmp_path / 'missing'} is not a directory")
    # generation_config.json's end-of-turn ids must be ids of the model too
    shifted = tmp_path / "tok"
    shutil.copytree(TOKENIZER, shifted)
    (shifted / "generation_config.json").write_text(json.dumps({"eos_token_id": [285, 400]}))
    assert problem(f"data.tokenizer={shifted}").startswith(
        f"data.tokenizer={shifted} has special ids [400] outside model.vocab_size=320")
    for message in (problem("model.vocab_size=154880"),
                    problem(f"data.tokenizer={tmp_path}")):
        assert "\n" not in message
    job = compose_job(["model=glm5_tiny", "parallel=single", "model.vocab_size=2048"])
    with pytest.raises(ValueError, match="data.tokenizer=byte has 258 ids"):
        hf_checkpoint.make_random_hf(job, str(tmp_path / "random"))
    assert not (tmp_path / "random").exists()
