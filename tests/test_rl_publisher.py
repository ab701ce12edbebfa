"""Versioned weight publication for rollout engines (glm5_train/rl/publisher.py).

One process builds the tiny GLM-5 as training does (initial weights of the seed, DDP-wrapped),
publishes it in fp32, bf16 and fp8, saves a checkpoint of it and computes its logits. Against
that:

- 4 ranks (TP2 + SP x PP2 x VPP2 x EP2, MTP on the embedding's stage) publish the same
  weights (initial weights depend only on seed and global tensor name) bit for bit, and so
  does ``export_hf`` of the saved checkpoint (same files, same config.json);
- transformers loads the fp32 version and gives our logits within the HF parity tolerance
  (1e-4, tests/test_hf_logits.py); the bf16 version gives exactly the logits of our model with
  its weights rounded to bf16 (1e-4 again), and the rounding's own effect is bounded below;
- fp8: dequantised weights within e4m3's rounding of the trainer's, scales of ceil blocks,
  the rest bf16 (the expert-score bias fp32), the quantization_config;
- a reader following ``latest`` while versions are written and pruned never sees a partial
  version or a mix of versions, and versions only increase; pruning keeps exactly ``keep``,
  the one ``latest`` names always among them; crash leftovers go, a newer publication's stay;
- a directory that is a file or not writable is refused in one line, alike on every rank.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import warnings

import pytest

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.24")

from safetensors import safe_open

from glm5_train.assembly import build_model
from glm5_train.checkpoint import TrainState, save_checkpoint
from glm5_train.hf_checkpoint import INDEX_FILE, ensure_distributed
from glm5_train.inference import compute_logits
from glm5_train.job_config import compose_job
from glm5_train.optim import wrap_ddp
from glm5_train.rl import publisher as pub
from parallel import process_groups
from tests.hf_tiny import hf_indexer_ties_by_index
from tests.parity import REPO, run_script
from tests.spawn import run_ranks
from tests.test_hf_checkpoint import read_hf_dir

SEQ, TOPK = 32, 8
ATOL = 1e-4  # tests/test_hf_logits.py's fp32 parity tolerance
# tests/test_hf_logits.py's model (index_topk 8 < 32 tokens: the sparse selection matters),
# with its MTP layer (published, ignored by transformers) and the tiny GLM tokenizer (its files
# go into every version, as engines need them).
MODEL = ["model=glm5_tiny", f"model.index_topk={TOPK}",
         "data.tokenizer=tests/data/glm_tiny_tokenizer", "train.micro_batch_size=1",
         "train.global_batch_size=2", f"train.seq_length={SEQ}"]
FOUR_RANKS = "parallel=tp2_pp2_vpp2_ep2"
TOOL = "tools/publish_weights.py"


# ---------------------------------------------------------------------------------- helpers


def live_chunks(overrides: list[str]):
    """(job, chunks) as training holds them: process groups, initial weights, DDP."""
    job = compose_job(overrides)
    ensure_distributed(job)
    config, chunks = build_model(job, process_groups.groups())
    return job, wrap_ddp(chunks, config, job.parallel.use_distributed_optimizer,
                         job.parallel.overlap_grad_reduce)


def round_parameters_to_bf16(chunks) -> None:
    """What a bf16 publication does to the weights (buffers, the expert-score bias, stay)."""
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                param.copy_(param.to(torch.bfloat16))


def same_bits(a, b) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def files_of(directory) -> set[str]:
    return set(os.listdir(directory))


def run_tool(nprocs: int, script: str, *args: str, expect_ok: bool = True):
    proc = run_script(nprocs, script, list(args))
    if expect_ok and proc.returncode:
        raise AssertionError(f"{' '.join(proc.args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-6000:]}")
    return proc


# ------------------------------------------------------------------ the one-process reference


def publish_reference(root: str) -> None:
    """Run as a script (``run_script``: a rank of its own, not a daemon, since saving a
    checkpoint starts writer processes): the one-process model published in each dtype, a
    checkpoint of it, its logits before and after rounding its weights to bf16 (reference.pt)."""
    tokens = torch.randint(0, 320, (2, SEQ), generator=torch.Generator().manual_seed(3))
    job, chunks = live_chunks([*MODEL, "parallel=single"])
    out: dict = {"reports": {}, "tokens": tokens}
    for dtype in ("fp32", "bf16", "fp8"):
        publisher = pub.WeightPublisher(job, chunks, os.path.join(root, dtype), dtype=dtype)
        out["reports"][dtype] = publisher.publish(0)
    save_checkpoint(os.path.join(root, "ckpt"), chunks, None, None, TrainState(), job.model)
    groups = process_groups.groups()
    out["logits"] = compute_logits(chunks, tokens, groups)
    round_parameters_to_bf16(chunks)
    out["logits_bf16_weights"] = compute_logits(chunks, tokens, groups)
    torch.save(out, os.path.join(root, "reference.pt"))
    process_groups.destroy_distributed()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("publish")
    run_tool(1, os.path.relpath(__file__, REPO), "reference", str(root))
    out = torch.load(root / "reference.pt")
    out["root"] = root
    return out


def assert_same_checkpoint(one, other) -> None:
    """Every tensor bit for bit under the same name, the same files (a version adds
    version.json), the same config.json, index and generation_config.json."""
    mine, theirs = read_hf_dir(one), read_hf_dir(other)
    assert set(theirs) == set(mine), other
    differing = [n for n, t in mine.items() if not same_bits(t, theirs[n])]
    assert not differing, f"{other}: {differing[:5]}"
    assert files_of(one) - {pub.VERSION_FILE} == files_of(other) - {pub.VERSION_FILE}
    for name in ("config.json", INDEX_FILE, "generation_config.json"):
        assert json.loads((one / name).read_text()) == json.loads((other / name).read_text())


# 4 ranks: TP2 + SP x PP2 x VPP2 x EP2 (MTP on the embedding's stage); PP2 x DP2 x EP2 with the
# distributed optimizer (parameters in DDP's contiguous buffers, replicas over DP).
LAYOUTS = {"tp2_pp2_vpp2_ep2": [FOUR_RANKS],
           "pp2_ep2_dp2_distopt": ["parallel=pp2_ep2_dp2",
                                   "parallel.use_distributed_optimizer=true"]}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_publish_the_same_tensors_bit_for_bit(reference, layout):
    root = reference["root"]
    run_tool(4, TOOL, "--out", str(root / layout), "--version", "0", "--dtype", "fp32",
             *MODEL, *LAYOUTS[layout])
    one = root / "fp32" / "v0"
    assert any(".layers.4." in n for n in read_hf_dir(one))  # the MTP layer is published
    assert_same_checkpoint(one, root / layout / "v0")
    assert json.loads((root / layout / "v0" / pub.VERSION_FILE).read_text())["version"] == 0


def test_export_of_a_checkpoint_of_the_model_is_the_same(reference):
    root = reference["root"]
    run_tool(1, "tools/hf_checkpoint.py", "export", "--load", str(root / "ckpt"), "--hf-dir",
             str(root / "export"), *MODEL, "parallel=single")
    assert_same_checkpoint(root / "fp32" / "v0", root / "export")


def hf_logits(path, tokens, **config) -> torch.Tensor:
    """transformers' logits of the version at ``path``, computed in fp32 (what is compared is
    the published weights, not an engine's arithmetic); ``config``: overrides (index_topk)."""
    from transformers import GlmMoeDsaForCausalLM

    model, info = GlmMoeDsaForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True, **config)
    assert not info["missing_keys"], info["missing_keys"]
    assert all(".layers.4." in k for k in info["unexpected_keys"])  # only the MTP layer's
    with torch.no_grad(), hf_indexer_ties_by_index():  # our top-k tie rule (see there)
        return model.eval()(tokens).logits.float()


def test_versions_load_in_transformers_with_our_logits(reference):
    import transformers

    transformers.logging.set_verbosity_error()  # the MTP layer's UNEXPECTED report
    root, tokens, ours = reference["root"], reference["tokens"], reference["logits"]
    fp32, bf16 = (hf_logits(root / d / pub.LATEST, tokens) for d in ("fp32", "bf16"))
    scale = ours.abs().max().item()
    fp32_diff = (fp32 - ours).abs().max().item()
    rounded_diff = (bf16 - reference["logits_bf16_weights"]).abs().max().item()
    per_position = (bf16 - ours).abs().amax(dim=-1).flatten()
    # The same without DSA's top-8 selection (index_topk = the sequence): no discrete choice
    # can flip, so what remains is the rounding's smooth effect.
    dense = [hf_logits(root / d / pub.LATEST, tokens, index_topk=SEQ) for d in ("fp32", "bf16")]
    smooth = (dense[1] - dense[0]).abs().max().item()
    print(f"publish logits (largest {scale:.3f}): fp32 version vs ours {fp32_diff:.2e}; bf16 "
          f"version vs ours with bf16-rounded weights {rounded_diff:.2e}; bf16 vs fp32 weights: "
          f"median position {per_position.median():.2e}, max {per_position.max():.2e}, "
          f"{(per_position > 2 ** -7 * scale).sum()} of {per_position.numel()} positions over "
          f"2^-7 of the scale; dense attention max {smooth:.2e}")
    assert fp32_diff < ATOL
    # The bf16 version is exactly our weights rounded to bf16: the logits of our own model
    # with its parameters rounded in place, within the parity tolerance.
    assert rounded_diff < ATOL
    # The rounding's own effect. bf16 keeps 8 significant bits: round to nearest moves each
    # weight by at most 2^-9 of itself, and the logits (a product of ~10 matrices per path,
    # independent signs) by about that relative to their scale: measured 3.1e-3 of 0.98 on the
    # dense model (1.6 x 2^-9). 2^-7 = 4 x 2^-9 bounds it. With the top-8 selection, a few
    # positions whose 8th and 9th key scores were within rounding of each other pick another
    # key (measured: 9 of 64 positions above 2^-7, up to 0.12): a discrete flip, not a
    # rounding error; the median position stays at the smooth level (2.0e-3). A wrong tensor
    # moves every position by ~the scale.
    assert smooth < 2 ** -7 * scale
    assert per_position.median().item() < 2 ** -7 * scale


def test_bf16_and_fp8_versions_hold_the_weights_within_their_rounding(reference):
    root = reference["root"]
    exact = read_hf_dir(root / "fp32" / "v0")
    bf16 = read_hf_dir(root / "bf16" / "v0")
    assert set(bf16) == set(exact)
    for name, weight in exact.items():
        kept = name.endswith(pub.FP32_TENSORS)
        assert same_bits(bf16[name], weight if kept else weight.to(torch.bfloat16)), name

    fp8 = read_hf_dir(root / "fp8" / "v0")
    quantized = sorted(n for n in exact if pub.is_fp8_weight(n))
    assert set(fp8) == set(exact) | {n + pub.SCALE_SUFFIX for n in quantized}
    assert {n.split(".")[-2] for n in quantized} >= {
        "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "wq_b", "wk",
        "gate_proj", "up_proj", "down_proj"}
    # ... and what GLM-5-FP8 keeps in bf16 stays unquantised (matrices included)
    for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.self_attn.indexer.weights_proj.weight",
                 "model.layers.4.eh_proj.weight", "model.layers.0.self_attn.indexer.k_norm.bias",
                 "model.layers.0.self_attn.q_a_layernorm.weight"):
        assert kept in exact and kept not in quantized and fp8[kept].dtype == torch.bfloat16
    partial_blocks = 0
    worst, errors = 0.0, []
    for name in quantized:
        weight, stored, scale = exact[name], fp8[name], fp8[name + pub.SCALE_SUFFIX]
        rows, cols = weight.shape
        assert stored.dtype == torch.float8_e4m3fn and stored.shape == weight.shape
        assert scale.dtype == torch.float32
        assert tuple(scale.shape) == (math.ceil(rows / 128), math.ceil(cols / 128)), name
        partial_blocks += rows % 128 != 0 or cols % 128 != 0
        back = pub.dequantize_fp8_blocks(stored, scale)
        per_element = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
        error = (back - weight).abs()
        # e4m3 keeps 4 significant bits: round to nearest moves a normal value by at most
        # 2^-4 of itself; below e4m3's smallest normal (2^-6 after scaling) the step is the
        # subnormal one, 2^-9, so the error is at most 2^-10 of the block's scale.
        assert (error <= 2 ** -4 * weight.abs() + 2 ** -10 * per_element).all(), name
        normal = weight.abs() >= 2 ** -6 * per_element
        worst = max(worst, (error[normal] / weight.abs()[normal]).max().item())
        errors.append((error[normal] / weight.abs()[normal]).flatten())
    typical = torch.cat(errors).mean().item()
    print(f"publish fp8: {len(quantized)} matrices ({partial_blocks} with partial blocks), "
          f"relative error of normal elements: max {worst:.4f} (bound 2^-4 = 0.0625), "
          f"mean {typical:.4f}")
    assert partial_blocks and worst <= 2 ** -3
    # round to nearest with 3 stored mantissa bits: a quarter step (2^-5 of the binade's
    # start) on average, over values spread across the binade: ~0.7 x 2^-5 = 0.022
    assert 2 ** -7 < typical < 2 ** -4
    for name, weight in exact.items():  # the rest: bf16, the expert-score bias fp32
        if name not in quantized:
            kept = name.endswith(pub.FP32_TENSORS)
            assert same_bits(fp8[name], weight if kept else weight.to(torch.bfloat16)), name
    config = json.loads((root / "fp8" / "v0" / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3",
                                             "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    assert config["dtype"] == "bfloat16"
    assert "quantization_config" not in json.loads((root / "bf16" / "v0" / "config.json")
                                                   .read_text())


def test_bytes_written_per_dtype(reference):
    """bf16 halves fp32; fp8 is one byte per quantised weight plus 4 per 128x128 block."""
    reports, root = reference["reports"], reference["root"]
    on_disk = {d: sum(os.path.getsize(root / d / "v0" / f) for f in os.listdir(root / d / "v0"))
               for d in reports}
    line = ", ".join(f"{d} {reports[d]['bytes']} tensor bytes ({on_disk[d]} on disk)"
                     for d in ("fp32", "bf16", "fp8"))
    print(f"publish bytes: {line}; bf16/fp32 {reports['bf16']['bytes'] / reports['fp32']['bytes']:.3f}"
          f", fp8/fp32 {reports['fp8']['bytes'] / reports['fp32']['bytes']:.3f}")
    assert reports["bf16"]["bytes"] < 0.51 * reports["fp32"]["bytes"]
    assert reports["fp8"]["bytes"] < 0.7 * reports["bf16"]["bytes"]
    assert all(r["path"].endswith("v0") and r["version"] == 0 for r in reports.values())


def test_fp8_blocks_of_a_planted_matrix():
    """Partial blocks at both edges, blocks of very different magnitude, an all-zero block."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 200, generator=generator)
    weight[:128, :128] *= 1e-3
    weight[128:256, 128:] = 0.0
    weight[256:, :128] *= 50.0
    stored, scale = pub.quantize_fp8_blocks(weight)
    assert stored.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (3, 2)
    assert scale[1, 1].item() == 1.0 and (stored[128:256, 128:].float() == 0).all()
    for r in range(3):
        for c in range(2):
            block = weight[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128]
            if block.abs().max() > 0:
                assert scale[r, c].item() == pytest.approx(block.abs().max().item() / 448, rel=1e-6)
    back = pub.dequantize_fp8_blocks(stored, scale)
    assert ((back - weight).abs() <= 2 ** -4 * weight.abs() + 2 ** -10 * scale.max()).all()
    assert stored.float().abs().max().item() == 448.0  # each block's largest element: +-448


# --------------------------------------------------------------- a reader while versions land


class Reader(threading.Thread):
    """Follows ``latest`` as an engine would, reading each version whole: version.json, the
    index, every shard the index names (each tensor of it there), and the final norm, which
    the publisher below fills with the version number (so a mix of versions would show)."""

    def __init__(self, directory: str, keep: int, versions: list[int]) -> None:
        super().__init__(daemon=True)
        self.directory, self.keep, self.last = directory, keep, versions[-1]
        self.in_progress = {f"v{v}{pub.PARTIAL}" for v in versions}
        self.seen: list[int] = []
        self.problems: list[str] = []
        self.lapped = 0  # reads overtaken by `keep` newer versions (the documented limit)
        self.partial_seen = False
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and not (self.seen and self.seen[-1] == self.last):
            self.partial_seen |= bool(self.in_progress & set(os.listdir(self.directory)))
            try:
                target = os.readlink(os.path.join(self.directory, pub.LATEST))
            except FileNotFoundError:
                if self.seen:
                    self.problems.append("latest disappeared")
                time.sleep(0.001)
                continue
            version = int(target[1:])
            if self.seen and version < self.seen[-1]:
                self.problems.append(f"version went back from {self.seen[-1]} to {version}")
            try:
                self.read(os.path.join(self.directory, target), version)
            except Exception as err:  # noqa: BLE001 - every failure is a finding
                if self.overtaken(version):
                    self.lapped += 1
                else:
                    self.problems.append(f"reading {target}: {type(err).__name__}: {err}")
            self.seen.append(version)

    def overtaken(self, version: int) -> bool:
        newest = pub.latest_version(self.directory)
        return (not os.path.exists(os.path.join(self.directory, f"v{version}"))
                and newest is not None and newest >= version + self.keep)

    def read(self, path: str, version: int) -> None:
        with open(os.path.join(path, pub.VERSION_FILE)) as handle:
            assert json.load(handle)["version"] == version
        with open(os.path.join(path, INDEX_FILE)) as handle:
            weight_map = json.load(handle)["weight_map"]
        by_file: dict[str, set[str]] = {}
        for name, fname in weight_map.items():
            by_file.setdefault(fname, set()).add(name)
        for fname, names in by_file.items():
            with safe_open(os.path.join(path, fname), framework="pt") as handle:
                assert names <= set(handle.keys()), f"{fname} lacks tensors"
                if "model.norm.weight" in names:
                    norm = handle.get_tensor("model.norm.weight")
                    assert (norm == version).all(), f"{fname} holds another version's norm"
        with open(os.path.join(path, "config.json")) as handle:
            json.load(handle)


def _series_rank(rank: int, world: int, directory: str, versions: list[int], keep: int) -> list:
    job, chunks = live_chunks([*MODEL, "parallel=single"])
    publisher = pub.WeightPublisher(job, chunks, directory, keep=keep, dtype="fp32")
    reports = []
    for version in versions:
        with torch.no_grad():
            for chunk in chunks:
                for name, param in chunk.named_parameters():
                    if name.endswith("decoder.final_layernorm.weight"):
                        param.fill_(float(version))
        report = publisher.publish(version)
        reports.append((report["removed"], report["pruned"]))
        time.sleep(0.2)  # the reader reads each version at least once, however busy the CPU
    return reports


def test_a_reader_never_sees_a_partial_version(tmp_path):
    directory, keep, versions = tmp_path / "published", 3, list(range(1, 7))
    # a crashed publication's leftovers (older: removed) and a newer one's (left alone)
    for leftover in ("v0.partial", "v99.partial", "v2.trash"):
        (directory / leftover).mkdir(parents=True)
        (directory / leftover / "model-00001-of-00006.safetensors").write_bytes(b"torn")
    reader = Reader(str(directory), keep, versions)
    reader.start()
    try:
        [reports] = run_ranks(1, _series_rank, str(directory), versions, keep, timeout=300)
    finally:
        reader.join(timeout=30)
        reader.stop.set()
    print(f"publish reader: {len(reader.seen)} reads of versions {sorted(set(reader.seen))}, "
          f"a partial version on disk during reads: {reader.partial_seen}, "
          f"overtaken reads: {reader.lapped}")
    assert not reader.problems, reader.problems
    assert reader.seen == sorted(reader.seen) and reader.seen[-1] == versions[-1]
    # It read while versions landed (whether it also caught a .partial directory on disk
    # depends on the scheduler: printed above, not required).
    assert len(set(reader.seen)) >= 2
    assert reports[0][0] == ["v0.partial", "v2.trash"]
    assert [pruned for _, pruned in reports] == [[], [], [], ["v1"], ["v2"], ["v3"]]
    assert sorted(os.listdir(directory)) == ["latest", "v4", "v5", "v6", "v99.partial"]
    assert os.readlink(directory / "latest") == "v6"


def test_pruning_keeps_keep_versions_and_always_the_latest(tmp_path):
    """After a resume the link may name an older version than the newest on disk."""
    for version in (1, 2, 3, 5, 8):
        (tmp_path / f"v{version}").mkdir()
    (tmp_path / "v4.partial").mkdir()  # a crashed publication
    (tmp_path / "v9.partial").mkdir()  # a newer publication in progress
    pub.point_latest(str(tmp_path), "v2")
    assert pub.prune(str(tmp_path), 2) == ["v1", "v3", "v5"]
    assert pub.complete_versions(str(tmp_path)) == [8, 2]
    assert pub.latest_version(str(tmp_path)) == 2
    assert pub.remove_leftovers(str(tmp_path), 6) == ["v4.partial"]
    assert sorted(os.listdir(tmp_path)) == ["latest", "v2", "v8", "v9.partial"]
    pub.point_latest(str(tmp_path), "v8")
    assert pub.prune(str(tmp_path), 1) == ["v2"]
    assert os.readlink(tmp_path / "latest") == "v8"
    # a step published again (a resumed run): the new directory replaces the old one
    (tmp_path / "v8" / "old").write_text("old")
    (tmp_path / "v8.partial").mkdir()
    (tmp_path / "v8.partial" / "new").write_text("new")
    pub.move_into_place(str(tmp_path / "v8.partial"), str(tmp_path / "v8"))
    assert sorted(os.listdir(tmp_path)) == ["latest", "v8", "v9.partial"]
    assert os.listdir(tmp_path / "v8") == ["new"]


# --------------------------------------------------------------------------------- refusals


def _refusal_rank(rank: int, world: int, directory: str) -> str:
    job = compose_job(list(MODEL))
    try:
        pub.WeightPublisher(job, [], directory)  # before any collective: chunks unused
    except ValueError as err:
        return str(err)
    return "no error"


def unwritable_directory(tmp_path) -> str:
    """A directory this user cannot write: a read-only one (root writes those anyway, so then
    one of the kernel's read-only trees)."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if not os.access(locked, os.W_OK):
        return str(locked / "published")
    for candidate in ("/proc/sys", "/sys/kernel"):
        if os.path.isdir(candidate) and not os.access(candidate, os.W_OK):
            return os.path.join(candidate, "published")
    pytest.skip("no directory here is unwritable for this user")


def test_a_bad_directory_is_refused_alike_on_every_rank(tmp_path):
    a_file = tmp_path / "weights.txt"
    a_file.write_text("not a directory")
    unwritable = unwritable_directory(tmp_path)
    for bad, words in ((str(a_file), "exists and is not a directory"),
                       (str(a_file / "sub"), "is a file, not a directory"),
                       (unwritable, "is not writable")):
        messages = run_ranks(2, _refusal_rank, bad, mcore=False)
        assert messages[0] == messages[1], messages
        assert words in messages[0] and repr(bad) in messages[0] and "\n" not in messages[0]
        assert "pass" in messages[0]  # the fix
    # the tool refuses before it builds anything, with the same line, and writes nothing
    proc = run_tool(2, TOOL, "--out", str(a_file), "--version", "1", *MODEL, "parallel=tp2",
                    expect_ok=False)
    assert proc.returncode == 1
    assert proc.stdout.count("publish_weights: error: publish directory") == 1, proc.stdout
    assert a_file.read_text() == "not a directory"


@pytest.mark.parametrize("keep,dtype,words", [(0, "bf16", "keep=0"), (2, "fp16", "fp16")])
def test_bad_keep_or_dtype_is_refused(tmp_path, keep, dtype, words):
    job = compose_job(list(MODEL))
    with pytest.raises(ValueError, match=words):
        pub.WeightPublisher(job, [], str(tmp_path), keep=keep, dtype=dtype)
    assert os.listdir(tmp_path) == []


if __name__ == "__main__":  # the reference fixture's rank (see publish_reference)
    if sys.argv[1:2] == ["reference"]:
        publish_reference(sys.argv[2])
