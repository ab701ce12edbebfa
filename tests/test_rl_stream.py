"""Streamed rollouts (data.paths=[<spool directory>], glm5_train/rl/stream.py).

- A spool read as it is equals the same records read from a file: the losses and every
  parameter's gradients of the streamed run on 2 ranks (DP2) are those of one process reading
  the groups, in arrival order, from one records file.
- Groups too stale for rl.max_policy_lag, and groups from versions the learner has not reached
  (weights a resumed run withdrew), are consumed without being trained.
- A trainer stopped with steps past its checkpoint resumes without losing or repeating a group:
  the ledger's entries after the checkpoint go, and their groups are read again.
- Nothing arriving within rl.stream_wait_s stops the run with one line.
"""

from __future__ import annotations

import math
import os

import numpy
import pytest

from glm5_train.rl.records import Rollout, read_rollouts, write_rollouts
from glm5_train.rl.stream import read_ledger
from tests.parity import FP32, assert_layout_ran, compare, one_process, run_job

VOCAB, SEQ, GBS = 320, 64, 4
GROUP = 3  # rollouts per group; 3 x 21 tokens: one group per 64-token sequence
STREAM = ["data=rollouts", "train.objective=grpo", "dsa=frozen_indexer", f"train.seq_length={SEQ}",
          f"train.global_batch_size={GBS}", f"rl.stream_min_groups={GBS}",
          f"rl.stream_max_groups={GBS}", "rl.stream_poll_s=0.05",
          "rl.stream_wait_s=30"]  # a test that finds no group fails in 30 s, not 10 min


def _group(rng, name: str, version: int) -> list[Rollout]:
    rollouts = []
    for _ in range(GROUP):
        response = 13
        logprobs = numpy.full(response, -math.log(VOCAB), dtype=numpy.float32)
        logprobs += rng.uniform(-0.5, 0.5, response).astype(numpy.float32)
        rollouts.append(Rollout(rng.integers(0, VOCAB, 8), rng.integers(0, VOCAB, response),
                                numpy.ones(response, dtype=numpy.float32),
                                numpy.minimum(logprobs, 0.0), float(rng.uniform()), name,
                                version))
    return rollouts


def write_groups(spool: str, versions: list[int], first: int = 0, seed: int = 0) -> list[str]:
    """Groups g<first>.. of the given versions, arriving in this order (increasing mtimes, as
    an engine renaming each complete file into place); returns their file names."""
    os.makedirs(spool, exist_ok=True)
    rng = numpy.random.default_rng(seed + first)
    names = []
    for i, version in enumerate(versions, start=first):
        name = f"g{i:04d}.jsonl"
        tmp = os.path.join(spool, f".{name}.tmp.jsonl")
        write_rollouts(tmp, _group(rng, name, version))
        os.replace(tmp, os.path.join(spool, name))
        stamp = 1_700_000_000 + i
        os.utime(os.path.join(spool, name), (stamp, stamp))
        names.append(name)
    return names


def ledger(checkpoints: str) -> dict[int, dict]:
    return {step: vars(entry) for step, entry in read_ledger(checkpoints).items()}


def test_a_streamed_spool_trains_as_the_same_records_from_a_file(tmp_path):
    spool = str(tmp_path / "spool")
    names = write_groups(spool, [0] * (3 * GBS))
    records = str(tmp_path / "records.jsonl")  # the groups in arrival order, in one file
    write_rollouts(records, read_rollouts([os.path.join(spool, n) for n in names]))
    reference = one_process([*STREAM, "parallel=single", f"data.paths=[{records}]",
                             "train.train_iters=3"])
    overrides = [*STREAM, "parallel=single", "parallel.data_parallel_size=2",
                 f"data.paths=[{spool}]", "train.train_iters=3",
                 f"checkpoint.save={tmp_path / 'ckpt'}"]
    result = run_job(2, overrides, str(tmp_path / "run"))
    problems = compare(reference.records, result.records, FP32)
    assert not problems, "\n".join(problems[:20])
    assert_layout_ran(result, 2, overrides)
    entries = ledger(str(tmp_path / "ckpt"))
    assert [entries[s]["trained"] for s in (1, 2, 3)] == [names[0:4], names[4:8], names[8:12]]
    for record in result.records:
        assert record["stream_groups"] == GBS and record["rollouts"] == GBS * GROUP
        assert record["stream_lag_hist"] == {str(record["step"] - 1): GBS * GROUP}


def stream_of(spool: str, tmp_path, *extra: str):
    """The trainer's stream over ``spool``, outside a job (its rank-0 decisions)."""
    from glm5_train.job_config import compose_job
    from glm5_train.rl.stream import StreamedRollouts

    return StreamedRollouts(compose_job([*STREAM, "model=glm5_tiny", f"data.paths=[{spool}]",
                                         f"checkpoint.save={tmp_path / 'ckpt'}", *extra]))


def test_stale_groups_are_consumed_untrained(tmp_path):
    # Step 1 (learner 0): g0-g3. Step 2 (learner 1): g4-g7 (g6 of version 0: lag 1, kept).
    # Step 3 (learner 2, lag 1): g8, g9 of version 0 are stale; g10-g13 trained.
    spool = str(tmp_path / "spool")
    names = write_groups(spool, [0, 0, 0, 0, 1, 1, 0, 1, 0, 0, 2, 2, 1, 2])
    stream = stream_of(spool, tmp_path, "rl.max_policy_lag=1")
    decided = []
    for step in range(3):
        groups, full = stream._select(step)
        assert full
        stream.consumed.update(groups.consumed())
        decided.append(groups)
    assert [g.trained for g in decided] == [names[0:4], names[4:8], names[10:14]]
    assert [g.dropped_stale for g in decided] == [[], [], names[8:10]]


def test_groups_made_by_withdrawn_weights_are_set_aside(tmp_path):
    """A run starting at step 0 finds a group of version 5 in the spool (an earlier attempt's
    weights, withdrawn): it is renamed aside, never trained, and the run trains the rest."""
    spool, ckpt = str(tmp_path / "spool"), str(tmp_path / "ckpt")
    names = write_groups(spool, [5, 0, 0, 0, 0, 0, 0, 0, 0])
    result = run_job(1, [*STREAM, "parallel=single", f"data.paths=[{spool}]",
                         "train.train_iters=2", f"checkpoint.save={ckpt}"],
                     str(tmp_path / "run"))
    assert os.path.exists(os.path.join(spool, f".withdrawn-{names[0]}"))
    assert "rl: set aside 1 rollout groups made by versions above 0" in result.log
    entries = ledger(ckpt)
    assert entries[1]["trained"] == names[1:5] and entries[2]["trained"] == names[5:9]


def test_a_group_from_a_version_the_learner_has_not_reached_is_dropped(tmp_path):
    """A group arriving during the run from weights newer than the learner's (an engine
    still holding a withdrawn version) is consumed, never trained."""
    spool = str(tmp_path / "spool")
    names = write_groups(spool, [0, 3, 0, 0, 0])
    groups, full = stream_of(spool, tmp_path)._select(step_index=1)
    assert groups.dropped_future == [names[1]] and full  # 4 taken: the cap
    assert groups.trained == [names[0], *names[2:]]


def test_a_resumed_trainer_neither_loses_nor_repeats_a_group(tmp_path):
    spool, ckpt = str(tmp_path / "spool"), str(tmp_path / "ckpt")
    first = write_groups(spool, [0] * (3 * GBS))
    run = [*STREAM[:-1], "rl.stream_wait_s=2", "parallel=single", f"data.paths=[{spool}]", "train.train_iters=4",
           f"checkpoint.save={ckpt}", "checkpoint.save_interval=2"]
    # Steps 1-3 train, the checkpoint is step 2's, step 4 finds no groups: the run stops.
    with pytest.raises(RuntimeError) as stopped:
        run_job(1, run, str(tmp_path / "run"))
    errors = [line for line in str(stopped.value).splitlines()
              if line.startswith("glm5_train: error:")]
    assert len(errors) == 1 and "step 4 waited rl.stream_wait_s=2" in errors[0], errors
    assert sorted(ledger(ckpt)) == [1, 2, 3]
    more = write_groups(spool, [2] * GBS, first=3 * GBS)
    result = run_job(1, run, str(tmp_path / "run"))
    # Resumed at the step-2 checkpoint: the stopped attempt's step 3 is redone, once.
    assert [r["step"] for r in result.records] == [1, 2, 3, 4]
    entries = ledger(ckpt)
    trained = [name for step in sorted(entries) for name in entries[step]["trained"]]
    assert trained == first + more  # each group once, in arrival order
    assert entries[3]["trained"] == first[8:12] and entries[4]["trained"] == more


@pytest.mark.parametrize("extra, needle", [
    (["rl.updates_per_batch=2"], "rl.updates_per_batch=2 with a spool directory"),
    (["train.objective=lm"], "is a spool directory, read as rollouts arrive, with train.objective=lm"),
    (["rl.stream_min_groups=0"], "rl.stream_min_groups=0 must be >= 1"),
    (["rl.stream_max_groups=1", "rl.stream_min_groups=2"], "rl.stream_max_groups=1 must be >="),
    (["rl.stream_wait_s=0"], "rl.stream_wait_s=0"),
    (["checkpoint.save=null"], "checkpoint.save is null: the ledger"),
    (["checkpoint.load=/elsewhere"], "checkpoint.load=/elsewhere with a spool directory"),
    (["data.num_workers=2"], "data.num_workers=2 with a spool directory"),
])
def test_streaming_configs_that_cannot_run_are_refused_in_one_line(tmp_path, extra, needle):
    from glm5_train.job_config import compose_job

    spool = tmp_path / "spool"
    spool.mkdir()
    overrides = [*STREAM, "model=glm5_tiny", f"data.paths=[{spool}]",
                 f"checkpoint.save={tmp_path / 'ckpt'}", *extra]
    keys = {e.split("=", 1)[0] for e in extra}
    overrides = [o for o in overrides if o.split("=", 1)[0] not in keys or o in extra]
    with pytest.raises(ValueError) as refused:
        compose_job(overrides).validate()
    assert needle in str(refused.value) and "\n" not in str(refused.value)


def test_lm_on_records_trains_the_responses_only(tmp_path):
    """train.objective=lm on rollout records: the supervised warm start. The loss counts the
    response tokens (their loss masks), not the prompts."""
    spool = str(tmp_path / "spool")
    names = write_groups(spool, [0] * GBS)
    records = str(tmp_path / "records.jsonl")
    rollouts = read_rollouts([os.path.join(spool, n) for n in names])
    write_rollouts(records, rollouts)
    result = run_job(1, ["data=rollouts", "train.objective=lm", "parallel=single",
                         f"data.paths=[{records}]", "train.train_iters=1",
                         "model.mtp_loss_weight=0"], str(tmp_path / "run"))
    assert result.records[0]["loss_tokens"] == sum(len(r.response_ids) for r in rollouts)


def test_a_bad_group_file_stops_the_run_in_one_line(tmp_path):
    spool = str(tmp_path / "spool")
    write_groups(spool, [0] * GBS)
    with open(os.path.join(spool, "broken.jsonl"), "w") as handle:
        handle.write('{"prompt_ids": [1], "response_ids": [2, 3], "rollout_logprobs": [0.5]}\n')
    os.utime(os.path.join(spool, "broken.jsonl"), (1_600_000_000, 1_600_000_000))  # first
    with pytest.raises(RuntimeError) as stopped:
        run_job(2, [*STREAM, "parallel=single", "parallel.data_parallel_size=2",
                    f"data.paths=[{spool}]", "train.train_iters=1",
                    f"checkpoint.save={tmp_path / 'ckpt'}"], str(tmp_path / "run"))
    errors = [line for line in str(stopped.value).splitlines()
              if line.startswith("glm5_train: error:")]
    assert len(errors) == 1 and "broken.jsonl" in errors[0], str(stopped.value)[-3000:]
