"""The rollout side of asynchronous RL: the HF engine, the rollout worker and the evaluator
(glm5_train/rl/engine.py, rollout_worker.py, evaluate.py).

A tiny random HF GLM-5 (tests/hf_tiny.py) is published as the publisher does it
(``<versions>/v<N>/`` + version.json + the ``latest`` symlink). Its ``index_topk`` is 4, below
the 19 tokens of an 8-digit prompt and its answer, so DSA's sparse selection (and the engine's
tie rule) matter in every test. Against it:

- generate's recorded log-probs equal a teacher-forced forward's on the same tokens (SCORE_ATOL,
  measured), sampling stops at EOD and is reproducible from its seed;
- the worker writes well-formed groups (``read_rollouts`` accepts them) with the spool's names,
  prompts and versions; it resumes without loss or duplication, picks up new versions, holds
  groups back by their latency, and in sync mode writes its share of a step, then waits;
- the evaluator writes one line per version and resumes; the worker CLI exits 0 on SIGTERM
  and leaves no partial file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.24")

from glm5_train.rl import publisher as pub
from glm5_train.rl.digit_task import EOD, DigitTask
from glm5_train.rl.engine import HfEngine, load_latest
from glm5_train.rl.evaluate import EvalOptions, evaluate_version, run_evaluator
from glm5_train.rl.records import read_rollouts
from glm5_train.rl.rollout_worker import (
    RolloutWorker,
    WorkerOptions,
    generate_group,
    group_latency_s,
    group_path,
    write_group,
    written_slots,
)
from tests.hf_tiny import build_tiny_hf
from tests.parity import REPO

VOCAB = 320
INDEX_TOPK = 4
TASK = DigitTask("copy", 8, 0)
G = 4
# generate vs a teacher-forced forward, fp32: max |difference| measured 1.9e-06 over 3,400
# tokens (batched KV-cached decode vs one full forward: summation order only; without the
# engine's DSA tie rule it is 0.97); 1e-5 leaves room for other CPUs and BLAS builds.
SCORE_ATOL = 1e-5
WAIT_S = 30.0  # a background worker's deadline to produce a file (it takes ~0.05 s per group)


# ---------------------------------------------------------------------------------- helpers


def publish(versions: str, version: int, seed: int = 0) -> str:
    """A tiny random model published as ``version``: v<N>/, version.json, ``latest``."""
    path = os.path.join(versions, f"v{version}")
    build_tiny_hf(path, seed, index_topk=INDEX_TOPK)
    pub.write_version_file(path, version, "fp32")
    pub.point_latest(versions, f"v{version}")
    return path


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> str:
    directory = str(tmp_path_factory.mktemp("versions"))
    publish(directory, 0)
    return directory


@pytest.fixture(scope="module")
def engine(versions) -> HfEngine:
    return load_latest(versions, wait_s=0)


def options(versions: str, spool: str, **overrides) -> WorkerOptions:
    fields = {"versions": versions, "spool": spool, "worker": 0, "workers": 2,
              "group_size": G, "task": TASK, "poll_s": 0.02}
    return WorkerOptions(**{**fields, **overrides})


def spool_files(spool: str) -> list[str]:
    """The spool's files but the workers' claims (``.lock-w<K>``, kept: a lock file is never
    removed, or two processes could each lock a different file of the same name)."""
    return [n for n in os.listdir(spool) if not n.startswith(".lock-")]


def spool_versions(spool: str, worker: int) -> dict[int, int]:
    """slot -> policy_version of every group file of ``worker``."""
    return {slot: read_rollouts([group_path(spool, worker, slot)])[0].policy_version
            for slot in sorted(written_slots(spool, worker))}


def wait_until(condition, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


@contextlib.contextmanager
def running_in_background(worker_options: WorkerOptions):
    """A worker loop in a thread (yielded), stopped and joined on exit."""
    stop = threading.Event()
    worker = RolloutWorker(worker_options, stop, io.StringIO())
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        stop.set()
        thread.join(timeout=WAIT_S)
    assert not thread.is_alive(), "the worker did not stop within WAIT_S"


def file_bytes(path: str) -> bytes:
    return pathlib.Path(path).read_bytes()


# ----------------------------------------------------------------------------------- engine


def test_generate_logprobs_equal_teacher_forced_scores(engine):
    prompts = [TASK.prompt(i) for i in range(4)]
    samples = engine.generate(prompts, 8, TASK.max_new_tokens, seed=3)
    assert [s.prompt_ids for s in samples] == [p for p in prompts for _ in range(8)]
    worst = 0.0
    for sample in samples:
        assert len(sample.logprobs) == len(sample.response_ids) >= 1
        scored = engine.score(sample.prompt_ids, sample.response_ids)
        worst = max(worst, max(abs(a - b) for a, b in zip(sample.logprobs, scored)))
    assert worst <= SCORE_ATOL, f"max |generate - score| = {worst:.2e}"
    print(f"max |generate logprob - score logprob| = {worst:.2e}")


class _EodBias(torch.nn.Module):
    """The LM head plus a constant on EOD's logit: a random model then ends some rows early."""

    def __init__(self, head: torch.nn.Module, bias: float) -> None:
        super().__init__()
        self.head, self.bias = head, bias

    def forward(self, hidden):
        logits = self.head(hidden)
        logits[..., EOD] += self.bias
        return logits


def test_generation_stops_at_eod(versions):
    biased = HfEngine.load(os.path.join(versions, "v0"))
    biased.model.lm_head = _EodBias(biased.model.lm_head, 6.0)  # p(EOD) ~ 0.5 a token
    samples = biased.generate([TASK.prompt(i) for i in range(4)], 8, TASK.max_new_tokens, seed=0)
    lengths = {len(s.response_ids) for s in samples}
    assert len(lengths) > 1, f"every row had the same length {lengths}: EOD never ended one"
    for sample in samples:
        response = sample.response_ids
        assert EOD not in response[:-1], f"tokens after EOD kept: {response}"
        assert response[-1] == EOD or len(response) == TASK.max_new_tokens
        scored = biased.score(sample.prompt_ids, response)
        assert max(abs(a - b) for a, b in zip(sample.logprobs, scored)) <= SCORE_ATOL


def test_sampling_is_reproducible_from_its_seed(engine):
    prompts = [TASK.prompt(i) for i in range(3)]
    first = engine.generate(prompts, G, TASK.max_new_tokens, seed=7)
    again = engine.generate(prompts, G, TASK.max_new_tokens, seed=7)
    other = engine.generate(prompts, G, TASK.max_new_tokens, seed=8)
    assert first == again
    assert [s.response_ids for s in first] != [s.response_ids for s in other]


def test_load_latest_follows_a_version_pruned_while_read(tmp_path, monkeypatch):
    versions = str(tmp_path)
    publish(versions, 0)
    publish(versions, 1, seed=1)
    real_load = HfEngine.load
    tries = []

    def load_during_a_prune(path, *args, **kwargs):
        if not tries:  # the publisher writes v2 and prunes v1 while we read it
            publish(versions, 2, seed=2)
            pub.prune(versions, keep=1)
        tries.append(os.path.basename(path))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(HfEngine, "load", staticmethod(load_during_a_prune))
    loaded = load_latest(versions, wait_s=5)
    assert tries == ["v1", "v2"] and loaded.version == 2


def test_load_latest_waits_for_a_newer_version(versions):
    with pytest.raises(TimeoutError, match="newer than v0"):
        load_latest(versions, newer_than=0, wait_s=0.2)


# ----------------------------------------------------------------------------------- worker


def test_worker_writes_well_formed_groups(versions, engine, tmp_path):
    spool = str(tmp_path / "spool")
    out = io.StringIO()
    wrote = RolloutWorker(options(versions, spool, worker=1, workers=2, max_groups=3),
                          out=out).run()
    assert wrote == 3 and sorted(spool_files(spool)) == [
        f"w001-000000{slot}.jsonl" for slot in range(3)]
    for slot in range(3):
        rollouts = read_rollouts([group_path(spool, 1, slot)], vocab_size=VOCAB)
        prompt = TASK.prompt(slot * 2 + 1, "train")
        assert len(rollouts) == G
        for r in rollouts:
            assert r.group_id == f"w001-{slot:07d}" and r.policy_version == 0
            assert r.prompt_ids.tolist() == prompt
            assert r.loss_mask.tolist() == [1.0] * len(r.response_ids)
            assert r.reward == TASK.reward(prompt, r.response_ids.tolist())
            scored = engine.score(prompt, r.response_ids.tolist())
            assert abs(r.rollout_logprobs - scored).max() <= SCORE_ATOL
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[0].startswith("worker 1: wrote w001-0000000 version=0 reward=")
    assert lines[0].endswith(" latency=0.0s")


def test_worker_resumes_without_loss_or_duplication(versions, tmp_path):
    spool = str(tmp_path / "spool")
    worker_options = options(versions, spool, max_groups=2)
    os.makedirs(spool)
    engine = load_latest(versions, wait_s=0)
    for slot in (0, 2):  # a killed run: slots 0 and 2 written, 1 lost with its .tmp
        write_group(spool, 0, slot, generate_group(engine, worker_options, slot))
    before = {slot: file_bytes(group_path(spool, 0, slot)) for slot in (0, 2)}
    leftover = os.path.join(spool, ".w000-0000001.jsonl.tmp")
    others = os.path.join(spool, ".w001-0000001.jsonl.tmp")  # another worker's, in progress
    for path in (leftover, others):
        with open(path, "w") as handle:
            handle.write('{"cut')
    assert RolloutWorker(worker_options, out=io.StringIO()).run() == 2
    assert written_slots(spool, 0) == {0, 1, 2, 3}
    assert all(file_bytes(group_path(spool, 0, s)) == before[s] for s in (0, 2))
    assert not os.path.exists(leftover) and os.path.exists(others)
    assert read_rollouts([group_path(spool, 0, 1)], vocab_size=VOCAB)[0].group_id == "w000-0000001"


def test_latency_holds_groups_back_by_their_own_delay(versions, tmp_path):
    spool = str(tmp_path / "spool")
    worker_options = options(versions, spool, max_groups=6, latency="longtail",
                             latency_median_s=0.05, latency_sigma=1.0, max_pending=3)
    out = io.StringIO()
    assert RolloutWorker(worker_options, out=out).run() == 6
    assert written_slots(spool, 0) == set(range(6))
    delays = {slot: group_latency_s(worker_options, slot) for slot in range(6)}
    again = options(versions, spool, latency="longtail", latency_median_s=0.05)
    assert delays == {slot: group_latency_s(again, slot) for slot in range(6)}  # any run
    other = options(versions, spool, worker=1, latency="longtail", latency_median_s=0.05)
    assert delays != {slot: group_latency_s(other, slot) for slot in range(6)}
    assert len(set(delays.values())) == 6  # a draw per slot
    for line in out.getvalue().splitlines():  # each line reports its slot's own delay
        slot = int(line.split()[3].split("-")[1])
        assert line.endswith(f"latency={delays[slot]:.1f}s")
    assert not [n for n in spool_files(spool) if n.startswith(".")]


def test_worker_picks_up_a_newly_published_version(tmp_path):
    versions, spool = str(tmp_path / "versions"), str(tmp_path / "spool")
    publish(versions, 0)
    with running_in_background(options(versions, spool)) as worker:
        wait_until(lambda: written_slots(spool, 0), "a first group")
        publish(versions, 1, seed=1)
        wait_until(lambda: 1 in spool_versions(spool, 0).values(), "a group of v1")
    by_slot = spool_versions(spool, 0)
    assert by_slot[0] == 0
    order = [by_slot[slot] for slot in sorted(by_slot)]
    assert order == sorted(order), f"versions went back: {order}"
    assert worker.engine.version == 1


def test_groups_of_withdrawn_versions_are_dropped_before_they_are_written(tmp_path):
    """The trainer resumed from a checkpoint before v1 and withdrew it: groups v1 made that
    latency still holds back are dropped, their slots free for the resumed run's weights."""
    versions, spool = str(tmp_path / "versions"), str(tmp_path / "spool")
    publish(versions, 0)
    publish(versions, 1, seed=1)
    worker = RolloutWorker(options(versions, spool, latency="longtail", latency_median_s=60.0),
                           out=io.StringIO())
    assert worker._pick_up_latest() and worker.engine.version == 1
    worker._generate(worker._lowest_free_slot())
    worker._generate(worker._lowest_free_slot())
    assert sorted(p.slot for p in worker.pending) == [0, 1]
    pub.point_latest(versions, "v0")  # the resumed trainer's start version
    shutil.rmtree(os.path.join(versions, "v1"))
    assert worker._pick_up_latest() and worker.engine.version == 0
    assert worker.pending == [] and worker._lowest_free_slot() == 0
    assert not written_slots(spool, 0)


def test_a_second_process_as_the_same_worker_is_refused(versions, tmp_path):
    spool = str(tmp_path / "spool")
    first = RolloutWorker(options(versions, spool, max_groups=1), out=io.StringIO())
    with pytest.raises(ValueError, match="worker 0 is already running on"):
        RolloutWorker(options(versions, spool), out=io.StringIO())
    RolloutWorker(options(versions, spool, worker=1), out=io.StringIO())  # another worker
    assert first.run() == 1  # done: the claim goes with it
    assert RolloutWorker(options(versions, spool, max_groups=1), out=io.StringIO()).run() == 1
    assert written_slots(spool, 0) == {0, 1}


def test_sync_mode_writes_its_share_then_waits(tmp_path):
    versions, spool = str(tmp_path / "versions"), str(tmp_path / "spool")
    publish(versions, 0)
    # 3 groups a step over 2 workers: per_worker 2; worker 0 takes j = 0, 1; worker 1 j = 0
    sync = options(versions, spool, sync_groups=3, latency="longtail", latency_median_s=0.05)
    assert sync.step_slots(0) == [0, 1] and sync.step_slots(1) == [2, 3]
    assert options(versions, spool, worker=1, sync_groups=3).step_slots(1) == [2]
    with running_in_background(sync):
        wait_until(lambda: len(written_slots(spool, 0)) == 2, "step 0's two groups")
        time.sleep(0.5)  # nothing more until the trainer publishes v1
        assert spool_versions(spool, 0) == {0: 0, 1: 0}
        publish(versions, 1, seed=1)
        wait_until(lambda: len(written_slots(spool, 0)) == 4, "step 1's two groups")
        time.sleep(0.3)
    assert spool_versions(spool, 0) == {0: 0, 1: 0, 2: 1, 3: 1}


def test_worker_options_refuse_in_one_line(versions, tmp_path):
    with pytest.raises(ValueError, match=r"--worker 2 must be in \[0, --workers=2\)"):
        options(versions, str(tmp_path), worker=2)
    with pytest.raises(ValueError, match="run at most --sync-groups workers"):
        options(versions, str(tmp_path), worker=1, sync_groups=1)


def test_worker_cli_stops_on_sigterm_leaving_whole_files(versions, tmp_path):
    spool = str(tmp_path / "spool")
    command = [sys.executable, "-m", "glm5_train.rl.rollout_worker", "--versions", versions,
               "--spool", spool, "--worker", "0", "--workers", "1", "--group-size", str(G),
               "--kind", "copy", "--digits", "8", "--task-seed", "0", "--latency", "longtail",
               "--latency-median-s", "0.2"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        first = process.stdout.readline()
        assert first.startswith("worker 0: wrote w000-"), first
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
    names = spool_files(spool)
    assert names and not [n for n in names if n.startswith(".")]
    read_rollouts([os.path.join(spool, n) for n in names], vocab_size=VOCAB)


# -------------------------------------------------------------------------------- evaluator


def test_evaluate_version_is_the_same_draw_every_time(engine):
    first = evaluate_version(engine, TASK, 16, seed=0)
    again = evaluate_version(engine, TASK, 16, seed=0)
    assert (first["version"], first["reward"], first["exact"]) == (0, again["reward"],
                                                                   again["exact"])
    assert 0.0 <= first["reward"] <= 1.0 and first["written_at"]


def test_evaluator_writes_a_line_per_version_and_resumes(tmp_path):
    versions, out = str(tmp_path / "versions"), str(tmp_path / "eval.jsonl")
    publish(versions, 0)
    eval_options = EvalOptions(versions=versions, out=out, task=TASK, prompts=8,
                               until_version=0, poll_s=0.02)
    printed = io.StringIO()
    assert [r["version"] for r in run_evaluator(eval_options, out=printed)] == [0]
    assert printed.getvalue().startswith("eval: version=0 heldout_reward=")
    assert run_evaluator(eval_options, out=io.StringIO()) == []  # resumed: v0 is there
    publish(versions, 1, seed=1)
    later = EvalOptions(versions=versions, out=out, task=TASK, prompts=8, until_version=1,
                        poll_s=0.02)
    assert [r["version"] for r in run_evaluator(later, out=io.StringIO())] == [1]
    records = [json.loads(line) for line in file_bytes(out).splitlines()]
    assert [r["version"] for r in records] == [0, 1]
    assert set(records[0]) == {"version", "written_at", "reward", "exact", "evaluated_at"}
    stop_file = tmp_path / "stop"
    stop_file.touch()
    forever = EvalOptions(versions=versions, out=out, task=TASK, prompts=8,
                          stop_file=str(stop_file), poll_s=0.02)
    assert run_evaluator(forever, out=io.StringIO()) == []
