"""The asynchronous RL loop end to end (python -m launch.rl), killed on both sides.

One short loop (2 rollout workers, a trainer on 2 ranks, 6 steps): a worker is SIGKILLed once
it has written groups (the launcher restarts it; it resumes from the spool), then the trainer's
rank is SIGKILLed after its third step (the loop stops), and the same command resumes the loop
to its end. What must hold whatever the timing (nothing here depends on the reward or on how
fast anything runs):

- records flow: every step trained groups the workers wrote, each group file holding its own
  group id, of versions the learner had published, at most rl.max_policy_lag behind;
- versions advance: the trainer published every step's version; groups of later versions than
  0 were trained;
- no group is trained twice and none is lost: the ledger's steps 1-6 consume distinct groups,
  and every group file a worker wrote is either consumed or still waiting in the spool; no
  slot was written twice (a restarted worker only fills slots nobody wrote);
- the held-out evaluator ran on the first and last versions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from glm5_train.checkpoint import latest_iteration
from glm5_train.rl.records import read_rollouts
from glm5_train.rl.stream import read_ledger

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, GROUPS_PER_STEP, LAG = 6, 2, 4


def loop_command(run_dir: str) -> list[str]:
    return [sys.executable, "-m", "launch.rl", "--run-dir", run_dir, "--sft-steps", "2",
            "--steps", str(STEPS), "--workers", "2", "--group-size", "4",
            "--groups-per-step", str(GROUPS_PER_STEP), "--max-policy-lag", str(LAG),
            "--eval-every", "3", "--eval-prompts", "8", "--trainer-procs", "2", "--",
            "train.global_batch_size=2", "checkpoint.save_interval=1", "train.log_interval=1"]


def processes_running(*needles: str) -> list[int]:
    """Pids whose command line holds every needle."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(n in cmdline for n in needles):
            pids.append(int(entry))
    return pids


def wait_for(condition, what: str, loop: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if loop.poll() is not None:
            raise AssertionError(f"the loop ended (status {loop.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def worker_files(spool: str, worker: int) -> list[str]:
    return [n for n in os.listdir(spool) if n.startswith(f"w{worker:03d}-")] \
        if os.path.isdir(spool) else []


def ledger(run_dir: str) -> dict[int, dict]:
    return {step: vars(entry)
            for step, entry in read_ledger(os.path.join(run_dir, "rl")).items()}


@pytest.mark.timeout(900)
def test_the_loop_survives_killing_a_worker_and_the_trainer(tmp_path):
    run_dir = str(tmp_path / "loop")
    spool = os.path.join(run_dir, "spool")
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115
    first = subprocess.Popen(loop_command(run_dir), cwd=REPO, stdout=log,
                             stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: len(worker_files(spool, 0)) >= 2, "worker 0's first groups", first)
        killed = processes_running("glm5_train.rl.rollout_worker", spool, "--worker 0")
        assert len(killed) == 1, killed
        os.kill(killed[0], signal.SIGKILL)
        wait_for(lambda: os.path.exists(os.path.join(run_dir, "rl", "iter_0000003")),
                 "the trainer's step-3 checkpoint", first)
        ranks = processes_running("glm5_train.train", f"data.paths=[{spool}]")
        ranks = [p for p in ranks if "torch.distributed.run" not in _cmdline(p)
                 and "launch.local" not in _cmdline(p)]
        assert ranks, "no trainer rank found"
        os.kill(ranks[0], signal.SIGKILL)
        assert first.wait(timeout=240) != 0  # the trainer failed: the loop stopped
    finally:
        if first.poll() is None:
            first.kill()
        log.close()
    checkpoint = latest_iteration(os.path.join(run_dir, "rl"))
    beyond = {step: entry for step, entry in ledger(run_dir).items() if step > checkpoint}
    first_log = (tmp_path / "first.log").read_text()
    assert "worker0 exited with status -9: restarting it" in first_log, first_log[-3000:]

    second = subprocess.run(loop_command(run_dir), check=False, cwd=REPO, capture_output=True,
                            text=True,
                            timeout=600)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    assert "warm start" not in second.stdout  # its checkpoint was complete: not redone
    check_records_flowed(run_dir)
    # The groups the killed attempt took after its checkpoint are trained again (or, made by
    # its withdrawn versions, set aside and made again): none lost.
    final = ledger(run_dir)
    consumed = {n for e in final.values()
                for n in e["trained"] + e["dropped_stale"] + e["dropped_future"]}
    for entry in beyond.values():
        for name in entry["trained"]:
            assert name in consumed or os.path.exists(os.path.join(spool, f".withdrawn-{name}"))
    # No slot written twice, but a slot whose group was set aside (made by withdrawn weights).
    for k in (0, 1):
        with open(os.path.join(run_dir, "logs", f"worker{k}.log")) as handle:
            wrote = [line.split()[3] for line in handle if line.split()[2:3] == ["wrote"]]
        twice = {g for g in wrote if wrote.count(g) > 1}
        assert all(os.path.exists(os.path.join(spool, f".withdrawn-{g}.jsonl")) for g in twice)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def check_records_flowed(run_dir: str) -> None:
    spool = os.path.join(run_dir, "spool")
    entries = ledger(run_dir)
    assert sorted(entries) == list(range(1, STEPS + 1))
    consumed = [name for step in sorted(entries)
                for name in (entries[step]["trained"] + entries[step]["dropped_stale"]
                             + entries[step]["dropped_future"])]
    assert len(consumed) == len(set(consumed)), "a group consumed twice"
    files = sorted(n for n in os.listdir(spool) if not n.startswith("."))
    assert set(consumed) <= set(files)  # nothing consumed that was not written: none lost
    versions_trained = set()
    for step, entry in entries.items():
        assert len(entry["trained"]) == GROUPS_PER_STEP
        for name in entry["trained"]:
            rollouts = read_rollouts([os.path.join(spool, name)], vocab_size=320)
            assert {r.group_id for r in rollouts} == {name.removesuffix(".jsonl")}
            version = rollouts[0].policy_version
            assert step - 1 - LAG <= version <= step - 1, (step, name, version)
            versions_trained.add(version)
    assert max(versions_trained) > 0  # the workers moved on to the trainer's new versions
    published = sorted(os.listdir(os.path.join(run_dir, "versions")))
    assert f"v{STEPS}" in published and os.path.islink(os.path.join(run_dir, "versions",
                                                                     "latest"))
    with open(os.path.join(run_dir, "eval.jsonl")) as handle:
        evaluated = [json.loads(line)["version"] for line in handle if line.strip()]
    assert evaluated[0] == 0 and evaluated[-1] == STEPS
    assert len(evaluated) == len(set(evaluated))
    with open(os.path.join(run_dir, "rl_run", "metrics.jsonl")) as handle:
        steps = [json.loads(line)["step"] for line in handle if line.strip()]
    assert steps == list(range(1, STEPS + 1))  # each step once in the surviving history


@pytest.mark.parametrize("args, needle", [
    (["--group-size", "16"], "need 16 sequences of train.seq_length=128"),
    (["--", "train.bogus=1"], "the trainer's config: Could not override 'train.bogus'"),
    (["--mode", "sync", "--workers", "8", "--groups-per-step", "6"], "worker 6: --worker 6"),
    (["--digits", "2"], "--digits=2 must be >= 3"),
])
def test_loops_that_cannot_run_are_refused_before_anything_starts(tmp_path, capsys, args,
                                                                   needle):
    from launch.rl import main

    run_dir = tmp_path / "loop"
    assert main(["--run-dir", str(run_dir), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("launch.rl: error: ") and needle in err[0], err
    assert not run_dir.exists()  # nothing written, no warm start
