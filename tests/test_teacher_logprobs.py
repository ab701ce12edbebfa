"""tools/teacher_logprobs.py: teacher log-probs from a checkpoint, in any layout.

A 1-step LM run of the tiny GLM-5 saves the teacher. Its log-probs of rollout records of mixed
lengths (several rollouts packed per sequence, some longer than DSA's top-k so the sparse path
selects keys, one with tool-output tokens masked, one with stale teacher log-probs to replace)
equal a direct computation: each rollout alone through one process's model, as the trainer
runs it (training mode, with autograd), log_softmax of the full logits in fp64. A parallel
layout gives the one-process values; the output trains under train.objective=distill (a
student resumed from the teacher's own weights has advantages ~0: the written log-probs are
the trainer's own for those weights); bad input is refused in one line before any work.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy
import pytest
import torch

from glm5_train.assembly import build_model
from glm5_train.checkpoint import load_checkpoint
from glm5_train.job_config import compose_job
from glm5_train.rl.records import Rollout, read_rollouts, write_rollouts
from glm5_train.rl.rollout_data import PAD_ID, RolloutDataset
from parallel import mcore_compat, process_groups
from tests.parity import run_job, run_script

VOCAB, SEQ, GBS = 320, 64, 4
TOOL = "tools/teacher_logprobs.py"
TEACHER = ["model=glm5_tiny", f"train.seq_length={SEQ}", f"train.global_batch_size={GBS}",
           "train.micro_batch_size=1"]
# fp32 model (fp32 logits, fp32 log-sum-exp in the chunked head) against log_softmax of its
# fp32 logits in fp64, packed against alone, layouts against one process: reduction order
# only. Measured <= 9.5e-7 (log-probs ~ -6); 1e-5 absolute is ~10x that.
ATOL = 1e-5


def _records() -> list[Rollout]:
    """14 rollouts of 12 to 60 tokens (packing into 9 sequences of 64), policy version 0."""
    rng = numpy.random.default_rng(11)
    rollouts = []
    for i in range(14):
        prompt, response = int(rng.integers(4, 17)), int(rng.integers(8, 45))
        mask = numpy.ones(response, dtype=numpy.float32)
        if i == 3:  # tool output inside the response: still scored by the teacher
            mask[2:6] = 0.0
        logprobs = numpy.full(response, -math.log(VOCAB), dtype=numpy.float32)
        stale = numpy.zeros(response, dtype=numpy.float32) if i == 5 else None
        rollouts.append(Rollout(rng.integers(0, VOCAB, prompt), rng.integers(0, VOCAB, response),
                                mask, logprobs, float(rng.uniform()), f"p{i}", 0, stale))
    return rollouts


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """(records path, teacher checkpoint, one-process output path, direct log-probs)."""
    root = tmp_path_factory.mktemp("teacher")
    records, ckpt, out = root / "in.jsonl", root / "ckpt", root / "one.jsonl"
    rollouts = _records()
    write_rollouts(str(records), rollouts)
    assert len(RolloutDataset(rollouts, SEQ, PAD_ID, None, None)) >= 2 * GBS  # two steps' worth
    run_job(1, ["parallel=single", "train.train_iters=1", f"checkpoint.save={ckpt}"],
            str(root / "run"))
    proc = run_script(1, TOOL, ["--load", str(ckpt), "--records", str(records), "--out",
                                str(out), *TEACHER, "parallel=single"])
    assert proc.returncode == 0, proc.stdout[-5000:]
    return str(records), str(ckpt), str(out), direct_logprobs(str(ckpt), rollouts)


def direct_logprobs(ckpt: str, rollouts: list[Rollout]) -> list[numpy.ndarray]:
    """log pi of each rollout's response tokens: the rollout alone (positions from 0, plain
    causal mask) through one process's model in training mode with autograd, as the trainer
    computes log-probs; log_softmax of the full [tokens, vocab] logits in fp64."""
    job = compose_job(["model=glm5_tiny", "parallel=single", "checkpoint.save=null"])
    mcore_compat.install()  # CPU meanings of the CUDA calls the process group setup makes
    with process_groups.single_process_group():
        _, chunks = build_model(job, process_groups.groups())
        load_checkpoint(ckpt, chunks, None, None, job.model)
        model = chunks[0]
        model.train()
        out = []
        for rollout in rollouts:
            ids = torch.cat([torch.as_tensor(rollout.prompt_ids),
                             torch.as_tensor(rollout.response_ids)])
            logits = model(ids.view(1, -1), torch.arange(len(ids)).view(1, -1), None)
            logp = torch.log_softmax(logits.detach().double()[0], dim=-1)
            prompt = len(rollout.prompt_ids)
            picked = logp[prompt - 1:-1].gather(-1, ids[prompt:].view(-1, 1)).squeeze(-1)
            out.append(picked.numpy())
    return out


def _largest_difference(a: list[Rollout], b: list[Rollout]) -> float:
    return max(float(numpy.abs(x.teacher_logprobs.astype(numpy.float64)
                               - y.teacher_logprobs).max()) for x, y in zip(a, b))


def test_one_process_equals_the_direct_computation(teacher):
    records, _, out, expected = teacher
    given, scored = read_rollouts([records]), read_rollouts([out], vocab_size=VOCAB)
    assert len(scored) == len(given) == len(expected)
    for before, after, direct in zip(given, scored, expected):
        assert after.teacher_logprobs is not None
        assert after.teacher_logprobs.shape == after.response_ids.shape
        numpy.testing.assert_allclose(after.teacher_logprobs, direct, rtol=0, atol=ATOL,
                                      err_msg=before.where)
        for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs"):
            assert numpy.array_equal(getattr(after, name), getattr(before, name)), name
        assert (after.reward, after.group_id, after.policy_version) == (
            before.reward, before.group_id, before.policy_version)
    # the stale teacher log-probs (zeros) were replaced
    assert given[5].teacher_logprobs is not None and scored[5].teacher_logprobs.max() < -1


# Every layout technique the scoring meets, each against one process (4 ranks each).
LAYOUTS = {
    # TP2 + SP x PP2 x VPP2 (split MTP placement: loaded, never run) x EP2 over the TP ranks
    "tp2_pp2_vpp2_ep2": ["parallel=tp2_pp2_vpp2_ep2"],
    # PP2 x DP2, EP2 over the data-parallel ranks: each DP rank scores its share, in
    # micro-batches of two sequences
    "pp2_ep2_dp2_mbs2": ["parallel=pp2_ep2_dp2", "train.micro_batch_size=2"],
    # CP2 (zigzag shards gathered back) x DP2, EP2
    "cp2_dp2_ep2": ["parallel=single", "parallel.context_parallel_size=2",
                    "parallel.data_parallel_size=2", "parallel.expert_model_parallel_size=2"],
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_parallel_layout_equals_one_process(teacher, tmp_path, name):
    """The one-process values in another layout; parquet written from jsonl records."""
    records, ckpt, one, _ = teacher
    out = str(tmp_path / f"{name}.parquet")
    proc = run_script(4, TOOL, ["--load", ckpt, "--records", records, "--out", out, *TEACHER,
                                *LAYOUTS[name]])
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert _largest_difference(read_rollouts([one]), read_rollouts([out])) <= ATOL


def test_output_trains_under_distill(teacher, tmp_path):
    """The student resumed from the teacher's checkpoint: teacher - pi_old ~ 0 per token, so
    the distillation loss (-mean of the advantages at ratio 1) is ~0 over every loss token."""
    _, ckpt, out, _ = teacher
    result = run_job(1, ["data=rollouts", "train.objective=distill", "dsa=frozen_indexer",
                         "parallel=single", f"data.paths=[{out}]", f"train.seq_length={SEQ}",
                         f"train.global_batch_size={GBS}", "train.train_iters=2",
                         f"checkpoint.load={ckpt}", "checkpoint.load_optimizer=false"],
                     str(tmp_path / "run"))
    (record,) = result.records
    assert record["step"] == 2 and math.isfinite(record["loss"])
    assert abs(record["loss"]) < ATOL
    assert record["grad_norm"] < 1e-3  # a student from scratch: 0.25
    dataset = RolloutDataset(read_rollouts([out]), SEQ, PAD_ID, None, None)
    step_rollouts = [dataset.rollouts[i] for i in dataset.rollouts_of(GBS, GBS)]
    assert record["rl_tokens"] == sum(int(r.loss_mask.sum()) for r in step_rollouts)


@pytest.mark.parametrize("case", ["out_is_in", "no_checkpoint", "too_long", "vocabulary"])
def test_bad_input_is_refused_in_one_line(teacher, tmp_path, case):
    records, ckpt, _, _ = teacher
    args = {"out": str(tmp_path / "out.jsonl"), "load": ckpt, "records": records,
            "overrides": ["parallel=single"]}
    if case == "out_is_in":
        args["out"] = records
    elif case == "no_checkpoint":
        args["load"] = str(tmp_path / "missing")
    elif case == "too_long":
        args["overrides"] = ["parallel=single", "train.seq_length=32"]
    else:
        bad = replace(read_rollouts([records])[0], prompt_ids=numpy.array([VOCAB]))
        args["records"] = str(tmp_path / "bad.jsonl")
        write_rollouts(args["records"], [bad])
    proc = run_script(1, TOOL, ["--load", args["load"], "--records", args["records"], "--out",
                                args["out"], *TEACHER, *args["overrides"]])
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert len(lines) == 1 and lines[0].startswith("teacher_logprobs: error: "), proc.stdout
    want = {"out_is_in": "is --records", "no_checkpoint": "no such directory",
            "too_long": "train.seq_length=32", "vocabulary": "outside [0, 320)"}[case]
    assert want in lines[0]
    assert not (tmp_path / "out.jsonl").exists()
