"""RL in the real job, against a direct computation and across layouts.

The planted step: a records file whose rollouts at step 2 have known rewards, versions behind
the learner and rollout log-probs planted at known ratios to the model's own (some outside
IcePop's band). The job, resumed from a checkpoint saved after step 1 (so the learner is at
version 1 and rollouts of version 0 are one step stale), trains step 2 in one process and in
the main job's layout (8 processes: TP2 + SP x PP2 x VPP2 x DP2, EP2, split MTP placement); its
loss, loss tokens, IcePop-masked tokens, dropped rollouts and every parameter's gradient norm
equal a direct computation (tests/rl_reference.py: each rollout through the model on its own,
log_softmax of the full logits in fp64, GRPO + IcePop from its formulas).

Parity: the RL objectives train for several steps in parallel layouts (every technique the
objective meets: TP + SP, PP x VPP with split MTP, EP, CP, DP with distributed Muon and
Pipeline ZeRO2, several updates per batch of rollouts) with the losses and per-parameter
gradients of one process (tests/parity.py's FP32 tolerances).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy
import pytest
from safetensors.torch import load_file

from glm5_train.job_config import compose_job
from glm5_train.rl.records import Rollout, read_rollouts, write_rollouts
from tests.parity import (
    FP32,
    assert_layout_ran,
    compare,
    one_process,
    param_problems,
    run_job,
    run_script,
)

VOCAB, SEQ, GBS = 320, 64, 4
# The objective's inputs (records, dsa frozen as GLM-5's RL has it), the tiny model.
RL = ["data=rollouts", "train.objective=grpo", "dsa=frozen_indexer", f"train.seq_length={SEQ}",
      f"train.global_batch_size={GBS}"]
MAIN_LAYOUT = (8, ["parallel=tp2_pp2_vpp2_ep2_dp2"])


def _rollout(rng, prompt: int, response: int, group: str, version: int,
             masked: slice | None = None) -> Rollout:
    mask = numpy.ones(response, dtype=numpy.float32)
    if masked is not None:  # tool output inside the response: not the policy's tokens
        mask[masked] = 0.0
    logprobs = numpy.full(response, -math.log(VOCAB), dtype=numpy.float32)
    return Rollout(rng.integers(0, VOCAB, prompt), rng.integers(0, VOCAB, response), mask,
                   logprobs, float(rng.uniform()), group, version)


def planted_template(path: str) -> None:
    """Step 1: four 64-token rollouts (one per sequence), version 0. Step 2: four sequences of
    three 20-token rollouts (packed), groups of three, versions 1 or 0 (stale at lag 1)."""
    rng = numpy.random.default_rng(5)
    records = [_rollout(rng, 16, 48, f"f{i // 2}", 0) for i in range(4)]
    versions = {"g0": (1, 1, 0), "g1": (1, 1, 1), "g2": (0, 1, 1), "g3": (1, 1, 1)}
    for group, group_versions in versions.items():
        for j, version in enumerate(group_versions):
            masked = slice(4, 8) if (group, j) == ("g1", 2) else None
            records.append(_rollout(rng, 8, 12, group, version, masked))
    write_rollouts(path, records)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """(planted records, checkpoint after step 1, the direct computation of step 2)."""
    root = tmp_path_factory.mktemp("rl_planted")
    template, records = str(root / "template.jsonl"), str(root / "planted.jsonl")
    planted_template(template)
    run_job(1, [*RL, "parallel=single", f"data.paths=[{template}]", "train.train_iters=1",
                f"checkpoint.save={root / 'ckpt'}"], str(root / "run0"))
    proc = run_script(1, "tests/rl_reference.py", [
        "--load", str(root / "ckpt"), "--template", template, "--planted", records,
        "--expected", str(root / "expected.json"), "--step", "1", "model=glm5_tiny",
        "parallel=single", *RL, "rl.max_policy_lag=0", f"data.paths=[{template}]",
        "checkpoint.save=null"])
    assert proc.returncode == 0, proc.stdout[-5000:]
    with open(root / "expected.json") as handle:
        expected = json.load(handle)
    return records, str(root / "ckpt"), expected


def _planted_step(planted, nprocs: int, layout: list[str], run_dir: str) -> dict:
    records, ckpt, _ = planted
    overrides = [*RL, *layout, f"data.paths=[{records}]", "train.train_iters=2",
                 "rl.max_policy_lag=0", f"checkpoint.load={ckpt}",
                 "checkpoint.load_optimizer=false"]
    result = run_job(nprocs, overrides, run_dir)
    assert [r["step"] for r in result.records] == [2]
    assert_layout_ran(result, nprocs, overrides)  # the run's own metrics show its layout
    return result.records[0]


@pytest.mark.parametrize("nprocs,layout", [(1, ["parallel=single"]), MAIN_LAYOUT],
                         ids=["one_process", "main_layout"])
def test_planted_step_equals_the_direct_computation(planted, tmp_path, nprocs, layout):
    expected = planted[2]
    record = _planted_step(planted, nprocs, layout, str(tmp_path))
    # The plant: 3 stale rollouts (version 0 at learner version 1, lag limit 0), IcePop masks
    # the tokens planted outside [0.5, 2] among the kept ones.
    assert expected["dropped"] == 2 and expected["masked"] > 0
    assert record["rl_dropped_rollouts"] == expected["dropped"]
    assert record["rl_tokens"] == record["loss_tokens"] == expected["tokens"]
    masked = round(record["rl_masked_fraction"] * record["rl_tokens"])
    assert masked == expected["masked"]
    assert record["rl_rollouts"] == 10
    assert record["rl_policy_lag"][:2] == [10, 2] and sum(record["rl_policy_lag"]) == 12
    # fp32 model against log_softmax of its fp32 logits in fp64: reduction order only.
    assert record["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6)
    assert record["rl_entropy"] == pytest.approx(expected["entropy"], rel=1e-5)
    reference = {"step": record["step"], "grad_norm": record["grad_norm"],
                 "param_grad_norms": expected["param_grad_norms"]}
    problems = param_problems(reference, record, FP32)
    assert not problems, "\n".join(problems[:20])
    total = math.sqrt(sum(v * v for v in expected["param_grad_norms"].values()))
    assert record["grad_norm"] == pytest.approx(total, rel=FP32.grad_norm)


def test_planted_records_hold_the_planted_ratios(planted):
    """The plant really has tokens outside IcePop's band among step 2's rollouts."""
    records, _, _ = planted
    rollouts = read_rollouts([records])
    assert len(rollouts) == 16
    assert all(float(r.rollout_logprobs.max()) <= 0 for r in rollouts)


# ------------------------------------------------------------------------------------ parity

PARITY_STEPS = 4  # two batches of rollouts under rl.updates_per_batch=2
# The GRPO loss sums terms -A (|A| ~ 1, group-normalised) of either sign into ~1e-3: its fp32
# noise (measured up to 1.6e-6 of the terms' scale) is compared against that scale, 1.
RL_FP32 = replace(FP32, loss_floor=1.0)


@pytest.fixture(scope="module")
def parity_records(tmp_path_factory):
    """Synthetic GRPO records: 4 steps of 4 sequences of 3 rollouts, responses of 8-16 tokens
    (the loss is not 0: a group's advantages sum to 0, its token counts differ), rollout
    log-probs spread so that IcePop masks some tokens."""
    path = str(tmp_path_factory.mktemp("rl_parity") / "rollouts.jsonl")
    rng = numpy.random.default_rng(7)
    records = []
    for i in range(3 * GBS * PARITY_STEPS):
        rollout = _rollout(rng, 8, int(rng.integers(8, 17)), f"g{i // 3}", 0)
        n = len(rollout.response_ids)
        spread = rng.uniform(-1.2, 1.2, n).astype(numpy.float32)
        teacher = rng.uniform(-1.0, 1.0, n).astype(numpy.float32)  # for distill
        records.append(replace(
            rollout, rollout_logprobs=numpy.minimum(rollout.rollout_logprobs + spread, 0.0),
            teacher_logprobs=numpy.minimum(rollout.rollout_logprobs + teacher, 0.0)))
    write_rollouts(path, records)
    return path


def _rl_overrides(records: str, *extra: str) -> list[str]:
    """RL's overrides with ``extra``'s taking the place of a key they set (one value per key:
    ``one_process`` sorts its overrides, so a repeated key would take whichever sorts last)."""
    keys = {e.split("=", 1)[0] for e in extra}
    base = [o for o in RL if o.split("=", 1)[0] not in keys]
    return [*base, f"data.paths=[{records}]", f"train.train_iters={PARITY_STEPS}", *extra]


# Every technique an RL step meets, and each objective, over three runs (each compared with
# one process running the same objective).
RL_LAYOUTS = {
    # TP2 + SP x PP2 x VPP2 (split MTP placement: Et|ttt|m|L), EP2 over the TP ranks;
    # on-policy distillation (the teacher's log-probs in the records)
    "tp2_pp2_vpp2_ep2_distill": (4, ["parallel=tp2_pp2_vpp2_ep2"],
                                 ("train.objective=distill",)),
    # PP2 x DP2 with EP2, distributed Muon, Pipeline ZeRO2; GRPO + IcePop with two updates
    # per rollout batch (pi_old from the grad-free pass, through the pipeline)
    "pp2_ep2_dp2_muon_zero2_grpo_updates2": (
        4, ["parallel=pp2_ep2_dp2", "parallel.use_distributed_optimizer=true",
            "parallel.pipeline_zero2=true"],
        ("train.optimizer=muon", "rl.updates_per_batch=2")),
    # the main job's layout (8 processes: TP2 + SP x PP2 x VPP2 x DP2, EP2), GRPO + IcePop
    "main_layout_grpo": MAIN_LAYOUT + ((),),
    # context parallelism, each rollout split over two ranks (zigzag): direct double-sided
    # IS, each rollout's mean first (a rollout's tokens, and its count, on both ranks)
    "cp2_dis_sequence_mean": (2, ["parallel=single", "parallel.context_parallel_size=2"],
                              ("train.objective=dis", "rl.loss_average=sequence")),
}


@pytest.mark.parametrize("name", sorted(RL_LAYOUTS))
def test_rl_layouts_match_one_process(parity_records, tmp_path, name):
    nprocs, layout, shared = RL_LAYOUTS[name]
    reference = one_process(_rl_overrides(parity_records, "parallel=single", *shared))
    overrides = _rl_overrides(parity_records, *layout, *shared)
    result = run_job(nprocs, overrides, str(tmp_path))
    problems = compare(reference.records, result.records, RL_FP32)
    assert not problems, "\n".join(problems[:20])
    assert_layout_ran(result, nprocs, overrides)
    for ours, ref in zip(result.records, reference.records):
        for key in ("rl_tokens", "rl_rollouts", "rl_policy_lag"):
            assert ours[key] == ref[key], (key, ours[key], ref[key])
        assert ours["rl_masked_fraction"] == pytest.approx(ref["rl_masked_fraction"], abs=1e-9)
    assert all(r["rl_masked_fraction"] > 0 for r in result.records)  # IcePop took part
    updates = 2 if "rl.updates_per_batch=2" in shared else 1
    for record in result.records:  # pi_old is the batch's first policy: later updates drift
        first_update = (record["step"] - 1) % updates == 0
        assert (record["rl_policy_drift"] == 0) == first_update, record["rl_policy_drift"]


# ------------------------------------------------------------------------- weight versions


def test_training_publishes_versions_the_engines_can_load(parity_records, tmp_path):
    """rl.publish_dir: the starting weights as v0, then every rl.publish_interval steps;
    rl.publish_keep versions kept, latest at the newest; the newest holds exactly the weights
    the run saved at that step (fp32: export_hf of the final checkpoint, bit for bit)."""
    published, ckpt = tmp_path / "published", tmp_path / "ckpt"
    overrides = _rl_overrides(parity_records, "parallel=tp2", f"rl.publish_dir={published}",
                              "rl.publish_interval=2", "rl.publish_keep=2",
                              "rl.publish_dtype=fp32", f"checkpoint.save={ckpt}")
    result = run_job(2, overrides, str(tmp_path / "run"))
    assert result.log.count("publish: published v") == 3  # v0, v2, v4
    assert sorted(p.name for p in published.iterdir()) == ["latest", "v2", "v4"]
    assert (published / "latest").resolve() == (published / "v4").resolve()
    assert json.loads((published / "v4" / "version.json").read_text())["version"] == 4
    exported = tmp_path / "exported"
    proc = run_script(1, "tools/hf_checkpoint.py", [
        "export", "--load", str(ckpt), "--hf-dir", str(exported), "model=glm5_tiny",
        "parallel=single"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    ours = {}
    for shard in (published / "v4").glob("*.safetensors"):
        ours.update(load_file(str(shard)))
    theirs = {}
    for shard in exported.glob("*.safetensors"):
        theirs.update(load_file(str(shard)))
    assert sorted(ours) == sorted(theirs)
    assert all(ours[name].equal(theirs[name]) for name in theirs)


# ------------------------------------------------------------------- resume, stages, refusals


def test_resume_inside_a_batch_of_rollouts_recomputes_pi_old(parity_records, tmp_path):
    """rl.updates_per_batch=2, stopped after step 1 (inside a batch): the resumed run records
    pi_old for the batch's remaining update from the resumed weights (a notice says so) and
    trains on; its drift is 0 there, as on a batch's first update."""
    ckpt = tmp_path / "ckpt"
    common = ["parallel=single", "rl.updates_per_batch=2", f"checkpoint.save={ckpt}"]
    run_job(1, _rl_overrides(parity_records, *common, "train.train_iters=2",
                             "checkpoint.save_interval=1"), str(tmp_path / "a"))
    (ckpt / "latest_iteration.txt").write_text("1")  # as if stopped after step 1
    result = run_job(1, _rl_overrides(parity_records, *common, "train.train_iters=4"),
                     str(tmp_path / "b"))
    assert "rl: resumed at update 2 of 2 of a batch of rollouts" in result.log
    assert [r["step"] for r in result.records] == [2, 3, 4]
    assert [r["rl_policy_drift"] == 0 for r in result.records] == [True, True, False]


def test_a_new_stage_starts_from_pretrained_weights(parity_records, tmp_path):
    """checkpoint.pretrained: an RL stage from an LM run's checkpoint starts at step 0 (its
    records from the first), while loading that checkpoint to resume is refused in one line
    (its data position is not the RL run's)."""
    lm = tmp_path / "lm_ckpt"
    run_job(1, ["parallel=single", "train.train_iters=2", f"checkpoint.save={lm}"],
            str(tmp_path / "lm"))
    result = run_job(1, _rl_overrides(parity_records, "parallel=single", "train.train_iters=2",
                                      f"checkpoint.pretrained={lm}"), str(tmp_path / "rl"))
    # RL freezes the MTP layers the LM run trained: their Adam state is not this run's
    assert (f"checkpoint: starting from the weights of {lm} with a fresh optimizer state (it "
            "is the state of other trained parameters" in result.log)
    assert [r["step"] for r in result.records] == [1, 2]
    with pytest.raises(RuntimeError) as err:
        run_job(1, _rl_overrides(parity_records, "parallel=single", "train.train_iters=3",
                                 "train.global_batch_size=2", f"checkpoint.load={lm}"),
                str(tmp_path / "refused"))
    line = next(x for x in str(err.value).splitlines() if "glm5_train: error:" in x)
    assert "consumed 8 samples, not step x train.global_batch_size=2 = 4" in line
    assert "checkpoint.pretrained=" in line


def test_a_resumed_run_withdraws_versions_past_its_checkpoint(parity_records, tmp_path):
    """Published v0, v2, v4 but checkpointed at step 2 (a crash in between): the resumed run
    removes v4 (weights it no longer has), points latest at v2, and publishes on."""
    published, ckpt = tmp_path / "published", tmp_path / "ckpt"
    common = ["parallel=single", f"rl.publish_dir={published}", "rl.publish_interval=2",
              "rl.publish_dtype=fp32", f"checkpoint.save={ckpt}", "checkpoint.keep_last=null"]
    run_job(1, _rl_overrides(parity_records, *common, "checkpoint.save_interval=2"),
            str(tmp_path / "a"))
    assert sorted(p.name for p in published.iterdir()) == ["latest", "v0", "v2", "v4"]
    (ckpt / "latest_iteration.txt").write_text("2")  # as if it died after publishing v4
    result = run_job(1, _rl_overrides(parity_records, *common, "train.train_iters=3"),
                     str(tmp_path / "b"))
    assert "removed v4: newer than the run's step 2" in result.log
    assert sorted(p.name for p in published.iterdir()) == ["latest", "v0", "v2"]
    assert (published / "latest").resolve().name == "v2"


@pytest.mark.parametrize("extra,needle", [
    (["activations.loss_chunk_tokens=0"], "activations.loss_chunk_tokens=0"),
    (["dsa=dense_warmup"], "dsa.stage=dense_warmup"),
    (["rl.train_mtp=true", "rl.loss_average=sequence"], "rl.train_mtp=true"),
    (["rl.updates_per_batch=2", "train.objective=dis"], "rl.updates_per_batch=2"),
    (["data=stdlib"], "train.objective=grpo with data.format=gpt"),
    (["checkpoint.pretrained=''"], "checkpoint.pretrained"),
])
def test_rl_configs_that_cannot_run_are_refused_in_one_line(parity_records, extra, needle):
    with pytest.raises(ValueError) as err:
        compose_job(["model=glm5_tiny", *_rl_overrides(parity_records, *extra)])
    assert needle in str(err.value) and "\n" not in str(err.value)
