"""The rollout-record schema (glm5_train/rl/records.py) and its tool (tools/rollout_records.py):
round trips through jsonl and parquet, every refusal naming file, record and field, GRPO's group
advantages against a hand computation. Fast: no distributed runs, four small subprocesses."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from glm5_train.rl.records import (
    SCHEMA_VERSION,
    Rollout,
    RolloutRecordError,
    check_groups,
    check_versions,
    group_advantages,
    read_rollouts,
    write_rollouts,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "rollout_records.py")
VOCAB = 100
ARRAY_FIELDS = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs")
SCALAR_FIELDS = ("reward", "group_id", "policy_version")
MISSING = object()  # good_record(field=MISSING) leaves the field out; None writes null


def good_record(**changes) -> dict:
    """A valid jsonl record (3 response tokens), with ``changes`` applied."""
    record = {"prompt_ids": [1, 2], "response_ids": [3, 4, 5],
              "rollout_logprobs": [-0.5, -1.25, 0.0], "reward": 1.0, "group_id": "a",
              "policy_version": 0}
    record.update(changes)
    return {k: v for k, v in record.items() if v is not MISSING}


def write_lines(path, records: list[dict]) -> str:
    """One record per line, a blank line after the first (blank lines are skipped but counted):
    the second record is line 3."""
    lines = [json.dumps(records[0]), ""] + [json.dumps(r) for r in records[1:]]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def rollout(group_id: str, reward: float, version: int = 0, teacher: bool = False,
            mask_zeros: bool = False, seed: int = 0) -> Rollout:
    rng = numpy.random.default_rng(seed)
    length = 5
    mask = numpy.ones(length, dtype=numpy.float32)
    if mask_zeros:
        mask[1:3] = 0  # a tool's output inside the response
    return Rollout(
        prompt_ids=rng.integers(0, VOCAB, 4), response_ids=rng.integers(0, VOCAB, length),
        loss_mask=mask, rollout_logprobs=-rng.random(length).astype(numpy.float32) * 3,
        reward=reward, group_id=group_id, policy_version=version,
        teacher_logprobs=-rng.random(length).astype(numpy.float32) if teacher else None)


def assert_same(expected: Rollout, got: Rollout) -> None:
    for name in ARRAY_FIELDS:
        want, have = getattr(expected, name), getattr(got, name)
        assert have.dtype == want.dtype and numpy.array_equal(have, want), name
    for name in SCALAR_FIELDS:
        assert getattr(got, name) == getattr(expected, name), name
    if expected.teacher_logprobs is None:
        assert got.teacher_logprobs is None
    else:
        assert numpy.array_equal(got.teacher_logprobs, expected.teacher_logprobs)
        assert got.teacher_logprobs.dtype == numpy.float32


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("extension", ["jsonl", "parquet"])
def test_round_trip(tmp_path, extension):
    rollouts = [rollout("a", 1.0, seed=1), rollout("a", 0.1 + 0.2, teacher=True, seed=2),
                rollout("b", -3.5, version=7, mask_zeros=True, seed=3),
                rollout("b", 0.0, teacher=True, mask_zeros=True, seed=4)]
    path = str(tmp_path / f"r.{extension}")
    write_rollouts(path, rollouts)
    back = read_rollouts([path], vocab_size=VOCAB)
    assert len(back) == len(rollouts)
    for i, (expected, got) in enumerate(zip(rollouts, back), start=1):
        assert_same(expected, got)
        assert got.where == f"{path}:{'line' if extension == 'jsonl' else 'row'} {i}"
    assert os.listdir(tmp_path) == [f"r.{extension}"]  # no temporary file left


def test_jsonl_defaults_and_int_group_ids(tmp_path):
    """loss_mask absent -> all 1, teacher_logprobs absent or null -> None, int group id -> str,
    metadata ignored, schema_version 1 accepted."""
    path = write_lines(tmp_path / "r.jsonl", [
        good_record(group_id=7, metadata={"engine": "sglang", "seconds": 1.5}),
        good_record(teacher_logprobs=None, schema_version=SCHEMA_VERSION, loss_mask=[1, 0, 1])])
    first, second = read_rollouts([path])
    assert first.loss_mask.dtype == numpy.float32 and first.loss_mask.tolist() == [1, 1, 1]
    assert first.group_id == "7" and first.teacher_logprobs is None
    assert second.loss_mask.tolist() == [1, 0, 1] and second.where == f"{path}:line 3"


def test_parquet_from_another_writer(tmp_path):
    """A parquet file without the version key, loss_mask or teacher columns, with int32 ids and
    int group ids, as another engine may write it."""
    table = pa.table({"prompt_ids": pa.array([[1, 2]], pa.list_(pa.int32())),
                      "response_ids": pa.array([[3, 4]], pa.list_(pa.int32())),
                      "rollout_logprobs": pa.array([[-0.5, -0.25]], pa.list_(pa.float64())),
                      "reward": [2], "group_id": [11], "policy_version": [3]})
    path = str(tmp_path / "other.parquet")
    pq.write_table(table, path)
    (got,) = read_rollouts([path], vocab_size=VOCAB)
    assert got.response_ids.dtype == numpy.int64 and got.response_ids.tolist() == [3, 4]
    assert got.rollout_logprobs.dtype == numpy.float32 and got.loss_mask.tolist() == [1, 1]
    assert (got.reward, got.group_id, got.policy_version) == (2.0, "11", 3)
    assert got.teacher_logprobs is None


# ------------------------------------------------------------------------------- refusals

# (field changes of the second record, vocab_size, the field named, a phrase of the rule)
REFUSALS = {
    "lengths disagree": ({"rollout_logprobs": [-1.0, -1.0]}, None, "rollout_logprobs",
                         "has 2 values but response_ids has 3"),
    "mask length": ({"loss_mask": [1, 1, 1, 1]}, None, "loss_mask", "has 4 values"),
    "teacher length": ({"teacher_logprobs": [-1.0]}, None, "teacher_logprobs", "has 1 values"),
    "log-prob > 0": ({"rollout_logprobs": [-1.0, 0.25, -1.0]}, None, "rollout_logprobs",
                     "rollout_logprobs[1] = 0.25 is > 0"),
    "NaN log-prob": ({"rollout_logprobs": [-1.0, -2.0, math.nan]}, None, "rollout_logprobs",
                     "rollout_logprobs[2] = nan is NaN"),
    "teacher log-prob > 0": ({"teacher_logprobs": [1e-3, -1.0, -1.0]}, None, "teacher_logprobs",
                             "teacher_logprobs[0] = 0.001 is > 0"),
    "null log-prob": ({"rollout_logprobs": [None, -1.0, -1.0]}, None, "rollout_logprobs",
                      "rollout_logprobs[0] = None is not numbers"),
    "token id out of range": ({"response_ids": [3, VOCAB, 5]}, VOCAB, "response_ids",
                              f"response_ids[1] = {VOCAB} is outside [0, {VOCAB})"),
    "negative token id": ({"prompt_ids": [-1, 2]}, None, "prompt_ids", "is outside >= 0"),
    "float token id": ({"prompt_ids": [1, 2.0]}, None, "prompt_ids", "is not integers"),
    "empty response": ({"response_ids": [], "rollout_logprobs": []}, None, "response_ids",
                       "is empty"),
    "mask value": ({"loss_mask": [1, 2, 0]}, None, "loss_mask", "loss_mask[1] = 2.0 is not 0"),
    "negative version": ({"policy_version": -1}, None, "policy_version", "not an integer >= 0"),
    "float version": ({"policy_version": 1.0}, None, "policy_version", "not an integer >= 0"),
    "infinite reward": ({"reward": math.inf}, None, "reward", "not a finite number"),
    "bool group id": ({"group_id": True}, None, "group_id", "not a non-empty string"),
    "missing field": ({"reward": MISSING}, None, "reward", "missing"),
    "null field": ({"group_id": None}, None, "group_id", "is null"),
    "unknown field": ({"rewards": 1.0}, None, "rewards", "unknown field"),
    "schema version": ({"schema_version": 2}, None, "schema_version",
                       "this reader reads schema version 1"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_jsonl_refusal_names_file_record_field(tmp_path, case):
    changes, vocab_size, field, rule = REFUSALS[case]
    path = write_lines(tmp_path / "r.jsonl", [good_record(), good_record(**changes)])
    with pytest.raises(RolloutRecordError) as err:
        read_rollouts([path], vocab_size=vocab_size)
    message = str(err.value)
    assert message.startswith(f"{path}:line 3: field {field!r}: "), message
    assert rule in message and "fix: " in message and "\n" not in message, message


def test_parquet_refusal_names_row(tmp_path):
    path = str(tmp_path / "r.parquet")
    write_rollouts(path, [rollout("a", 1.0), rollout("a", 0.0)])
    table = pq.read_table(path)
    logprobs = table.column("rollout_logprobs").to_pylist()
    logprobs[1][3] = 0.5
    table = table.set_column(3, "rollout_logprobs",
                             pa.array(logprobs, pa.list_(pa.float32())))
    pq.write_table(table, path)
    with pytest.raises(RolloutRecordError, match=r"r\.parquet:row 2: field 'rollout_logprobs'"
                                                 r": rollout_logprobs\[3\] = 0.5 is > 0"):
        read_rollouts([path])


def test_parquet_schema_version(tmp_path):
    path = str(tmp_path / "r.parquet")
    write_rollouts(path, [rollout("a", 1.0)])
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({"glm5_rollout_schema_version": "2"}), path)
    with pytest.raises(RolloutRecordError, match=r"r\.parquet \(file metadata\): field "
                                                 r"'glm5_rollout_schema_version': is '2'"):
        read_rollouts([path])


def test_unknown_extension_and_missing_file(tmp_path):
    with pytest.raises(RolloutRecordError, match=r"r\.json: unknown .* \.jsonl, \.parquet"):
        read_rollouts([str(tmp_path / "r.json")])
    missing = str(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_rollouts([missing])


def test_not_json(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(good_record()) + "\n[1, 2]\n")
    with pytest.raises(RolloutRecordError, match=r"r\.jsonl:line 2: field 'record': is a JSON "
                                                 "list, not an object"):
        read_rollouts([str(path)])


def test_write_refuses_what_read_would(tmp_path):
    path = str(tmp_path / "r.jsonl")
    bad = rollout("a", math.nan)
    with pytest.raises(RolloutRecordError, match=r"r\.jsonl:line 1 \(being written\): field "
                                                 "'reward'"):
        write_rollouts(path, [bad])
    assert not os.listdir(tmp_path)  # nothing written, no temporary left


def test_check_groups_names_the_group(tmp_path):
    path = write_lines(tmp_path / "r.jsonl", [
        good_record(group_id="a"), good_record(group_id="lonely"), good_record(group_id="a")])
    rollouts = read_rollouts([path])
    check_groups(rollouts, 1)
    with pytest.raises(RolloutRecordError) as err:
        check_groups(rollouts, 2)
    message = str(err.value)
    assert message.startswith(f"{path}:line 3: field 'group_id': group 'lonely'"), message
    assert "has 1 rollout(s)" in message and "min_size=2" in message
    assert "train.objective=distill" in message


def test_check_versions_refuses_the_future(tmp_path):
    path = write_lines(tmp_path / "r.jsonl", [good_record(policy_version=3),
                                              good_record(policy_version=5)])
    rollouts = read_rollouts([path])
    check_versions(rollouts, 5)
    with pytest.raises(RolloutRecordError) as err:
        check_versions(rollouts, 4)
    message = str(err.value)
    assert message.startswith(f"{path}:line 3: field 'policy_version': is 5, from the future")
    assert "learner is at step 4" in message


# ------------------------------------------------------------------------------ advantages


def test_group_advantages_by_hand():
    # group a: rewards 1, 0, 0.5: mean 0.5, unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5;
    # group b: rewards 2, 4: mean 3, unbiased std sqrt((1 + 1) / 1) = sqrt(2). Interleaved.
    rollouts = [rollout("a", 1.0), rollout("b", 2.0), rollout("a", 0.0), rollout("b", 4.0),
                rollout("a", 0.5)]
    eps = 1e-6
    expected = [0.5 / (0.5 + eps), -1 / (math.sqrt(2) + eps), -0.5 / (0.5 + eps),
                1 / (math.sqrt(2) + eps), 0.0]
    got = group_advantages(rollouts, eps=eps)
    assert got.dtype == numpy.float64
    numpy.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)
    numpy.testing.assert_allclose(group_advantages(rollouts, divide_by_std=False),
                                  [0.5, -1.0, -0.5, 1.0, 0.0], rtol=1e-12)
    # equal rewards: zero advantage, not a division by zero
    numpy.testing.assert_array_equal(
        group_advantages([rollout("c", 1.0), rollout("c", 1.0)]), [0.0, 0.0])


def test_group_advantages_one_member_group():
    rollouts = [rollout("a", 1.0), rollout("a", 0.0), rollout("alone", 3.0)]
    numpy.testing.assert_array_equal(group_advantages(rollouts, divide_by_std=False),
                                     [0.5, -0.5, 0.0])
    with pytest.raises(RolloutRecordError, match="group 'alone'"):
        group_advantages(rollouts)  # the unbiased std of one reward is undefined


# ------------------------------------------------------------------------------------- tool


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True,
                          cwd=REPO, check=False, timeout=60)


def test_tool_synthetic(tmp_path):
    path, again = str(tmp_path / "s.parquet"), str(tmp_path / "again.jsonl")
    args = ["--groups", "3", "--group-size", "4", "--prompt-len", "6", "--response-len", "9",
            "--vocab-size", "50", "--versions", "0,2", "--teacher"]
    for out in (path, again):
        done = run_tool("synthetic", "--out", out, *args)
        assert done.returncode == 0, done.stderr
        assert "records=12 groups=3" in done.stdout
    rollouts = read_rollouts([path], vocab_size=50)
    check_groups(rollouts, 4)
    assert len(rollouts) == 12 and {r.policy_version for r in rollouts} == {0, 2}
    assert all(r.teacher_logprobs is not None for r in rollouts)
    logprobs = numpy.concatenate([r.rollout_logprobs for r in rollouts])
    assert numpy.abs(logprobs + math.log(50)).max() < 0.05
    assert (group_advantages(rollouts, divide_by_std=False) != 0).all()  # groups have spread
    for first, second in zip(rollouts, read_rollouts([again])):
        assert_same(first, second)  # deterministic for a seed, whatever the format


def test_tool_check(tmp_path):
    good = str(tmp_path / "good.jsonl")
    write_rollouts(good, [rollout("a", 1.0, version=1), rollout("a", 0.0, version=3)])
    done = run_tool("check", good, "--vocab-size", str(VOCAB), "--min-group-size", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ("records=2 groups=1 tokens=18 response_tokens=10 versions=1..3 "
                           "reward_mean=0.5000\n")
    bad = write_lines(tmp_path / "bad.jsonl", [good_record(), good_record(reward="high")])
    done = run_tool("check", good, bad)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"rollout_records: error: {bad}:line 3: field 'reward'")
