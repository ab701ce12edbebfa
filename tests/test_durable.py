"""Durable runs: crash-safe saves, automatic resume, stop signals, elastic restarts, bad steps.

- Store level (no torch, ~10 s): a save is SIGKILLed before each of its file-system operations
  in turn, in three situations (a new iteration, re-saving an uncommitted newer one, re-saving
  the one ``latest`` names); every time ``latest`` names a complete checkpoint (the old one or
  the new one, byte for byte) and the next save succeeds.
- The real job (PP2 on 2 ranks, 7 steps), one chain of runs in one save directory and run
  directory, each resuming (``checkpoint.load=auto``) from what the one before left: killed
  (SIGKILL) during its save in megatron's payload write, before the rename into place, before
  ``latest`` is replaced, while pruning; then a torn checkpoint is passed over; then a SIGUSR1
  reaching one rank only, then a SIGTERM to the torchrun agent (as slurm sends them), each saving
  at the step boundary and exiting; the last run finishes. Its metrics.jsonl holds each step
  once, with the losses of an uninterrupted run, bit for bit.
- Elastic: under ``torchrun --max-restarts=1`` rank 1 is SIGKILLed as step 4 starts; the
  restarted workers resume from the newest checkpoint and the losses equal the uninterrupted
  run's.
- Bad steps: a NaN planted in one gradient on rank 1: ``train.nonfinite=stop`` stops with the
  step, rank, parameter and samples; ``skip`` skips (weights, optimizer and schedule untouched,
  byte for byte) until its consecutive cap stops the job.
- A dataset with a token id past the vocabulary is refused when opened.

Time on 2 cores, lightly loaded: ~3 min (chain 90 s, elastic 40 s, bad steps 30 s, the
reference run 10 s, store level 5 s).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy
import psutil
import pytest
import torch
import torch.distributed.checkpoint.format_utils as dcp_format
from megatron.core import dist_checkpointing
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from glm5_train import checkpoint_store as store
from glm5_train.checkpoint import CheckpointConfig
from glm5_train.data import check_token_ids
from glm5_train.job_config import compose_job
from tests import store_saver
from tests.parity import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 7
BASE = ("model=glm5_tiny", "parallel=pp2", f"train.train_iters={STEPS}", "train.warmup_iters=0",
        "train.global_batch_size=4", "train.micro_batch_size=1", "train.seq_length=64")


# ------------------------------------------------------------------------ the store, killed

def _save_in_child(root, iteration: int, kill_at: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.store_saver", str(root), str(iteration),
                           str(kill_at)], cwd=REPO, capture_output=True, text=True, check=False)


def _payload(directory: str) -> dict[str, bytes]:
    return {name: open(os.path.join(directory, name), "rb").read()
            for name in sorted(os.listdir(directory)) if name.endswith(".distcp")}


def _saved_values(directory: str) -> dict[str, object]:
    """Every value a checkpoint's shard files hold, by its flattened key, less the common state:
    megatron-core 0.19 writes it (the step count among it) into the shard files instead of
    common.pt."""
    merged = os.path.join(tempfile.mkdtemp(prefix="glm5_ckpt_"), "merged.pt")
    try:
        dcp_format.dcp_to_torch_save(directory, merged)
        state = torch.load(merged, weights_only=False)
    finally:
        shutil.rmtree(os.path.dirname(merged), ignore_errors=True)
    flat: dict[str, object] = {}

    def walk(value, key: str) -> None:
        if isinstance(value, dict):
            for name, item in value.items():
                walk(item, f"{key}/{name}")
        elif not key.startswith("/common_state"):
            flat[key] = value
    walk(state, "")
    return flat


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _committed(root, iteration: int) -> None:
    store_saver.save(str(root), iteration)


def _orphan(root, iteration: int) -> None:
    """A complete iter_N that never reached latest (a kill between rename and latest)."""
    staging = store.prepare_staging(str(root), iteration)
    for name, data in store_saver.payload(iteration).items():
        with open(os.path.join(staging, name), "wb") as out:
            out.write(data)
    store.write_manifest(staging, iteration)
    os.rename(staging, store.iteration_dir(str(root), iteration))


SITUATIONS = {
    # latest=2; a new iteration 3
    "new": ([1, 2], None, 3),
    # latest=2 and a complete iter_3 that never reached latest; 3 saved again
    "over_uncommitted": ([1, 2], 3, 3),
    # latest=3; 3 saved again (moved aside, then replaced)
    "over_latest": ([2, 3], None, 3),
}


@pytest.mark.parametrize("situation", sorted(SITUATIONS))
def test_a_save_killed_at_every_operation_keeps_a_complete_latest(tmp_path, situation):
    before, orphan, saving = SITUATIONS[situation]
    baseline = tmp_path / "baseline"
    for iteration in before:
        _committed(baseline, iteration)
    if orphan is not None:
        _orphan(baseline, orphan)
    dry = tmp_path / "dry"
    shutil.copytree(baseline, dry)
    total = int(_save_in_child(dry, saving, 0).stdout)
    assert total > 15  # every staging, payload, sync, rename, pointer and pruning call
    for kill_at in range(1, total + 1):
        root = tmp_path / f"kill{kill_at}"
        shutil.copytree(baseline, root)
        assert _save_in_child(root, saving, kill_at).returncode == -9, kill_at
        latest, why = store.read_latest(str(root))
        choice = store.choose(str(root))
        # latest names a complete checkpoint: the previous one, or already the new one
        assert latest in (before[-1], saving) and choice.iteration == latest, (kill_at, why)
        assert _payload(choice.path) == store_saver.payload(latest), kill_at
        # and the next save succeeds and cleans up after the killed one
        store_saver.save(str(root), saving)
        after = store.choose(str(root))
        assert after.iteration == saving and after.notes == [], kill_at
        assert _payload(after.path) == store_saver.payload(saving)
        assert sorted(os.listdir(root)) == sorted(
            [store.LATEST] + [f"iter_{i:07d}" for i in sorted({*before, saving})[-2:]]), kill_at


def test_torn_or_unreadable_checkpoints_are_passed_over_with_a_reason(tmp_path):
    for iteration in (1, 2, 3):
        _committed(tmp_path, iteration)  # keep_last=2: 2 and 3 remain
    newest = store.iteration_dir(str(tmp_path), 3)
    with open(os.path.join(newest, "__1_0.distcp"), "r+b") as handle:
        handle.truncate(4000)
    choice = store.choose(str(tmp_path))
    assert choice.iteration == 2
    assert choice.notes == [("iter_0000003 is not a complete checkpoint: file __1_0.distcp has "
                             "4000 bytes, 5000 were written")]
    os.remove(os.path.join(store.iteration_dir(str(tmp_path), 2), store.MANIFEST))
    none = store.choose(str(tmp_path))
    assert none.path is None and none.present
    assert "iter_0000002 is not a complete checkpoint: no glm5_manifest.json" in none.describe()
    (tmp_path / store.LATEST).write_text("garbage\n")
    assert "holds 'garbage', not an iteration" in store.choose(str(tmp_path)).describe()
    assert store.choose(str(tmp_path / "absent")).present is False


def test_pruning_keeps_the_newest_complete_checkpoints(tmp_path):
    for iteration in (1, 2):
        _committed(tmp_path, iteration)
    _orphan(tmp_path, 5)  # newer than anything this run commits: not its to delete
    with open(os.path.join(store.iteration_dir(str(tmp_path), 2), "__0_0.distcp"), "ab") as f:
        f.write(b"x")  # torn: does not count as kept, and goes
    _committed(tmp_path, 3)
    assert store.committed_iterations(str(tmp_path)) == [1, 3, 5]
    assert store.choose(str(tmp_path)).iteration == 3


# -------------------------------------------------------------------------- the real job

def _launch(run_dir, overrides, fault: dict[str, str] | None = None, torchrun=(),
            timeout: int = 600) -> tuple[int, str]:
    """Run the job (2 processes) with the faults of tests/fault_worker.py; (status, output).
    Checks that no process of it is left once torchrun has returned (megatron-core's forked
    checkpoint writers of a killed rank must die with it)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           *torchrun, "-m", "tests.fault_worker", *BASE, *overrides, f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLM5_FAULT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(fault or {}))
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT,
                              text=True, check=False, timeout=timeout)
        output.seek(0)
        log = output.read()
    assert _left_behind(f"hydra.run.dir={run_dir}") == [], log[-3000:]
    return proc.returncode, log


def _left_behind(marker: str, wait_s: float = 10.0) -> list[int]:
    """Processes whose command line holds ``marker``, after waiting ``wait_s`` for them to go."""
    deadline = time.monotonic() + wait_s
    while True:
        found = [p.pid for p in psutil.process_iter(["cmdline"])
                 if marker in " ".join(p.info["cmdline"] or [])]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def _ok(result: tuple[int, str]) -> str:
    rc, log = result
    assert rc == 0, log[-5000:]
    return log


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The uninterrupted run (no checkpoints)."""
    run = tmp_path_factory.mktemp("reference")
    _ok(_launch(run, ["checkpoint.save=null"]))
    return read_metrics(str(run))


def _assert_same_run(records: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for key in ("loss", "mtp_loss", "grad_norm", "consumed_tokens"):
        assert [r[key] for r in records] == [r[key] for r in reference], key


def _loaded(log: str, ckpt, iteration: int) -> bool:
    return f"checkpoint: loading {ckpt}/iter_{iteration:07d}" in log


def test_chain_of_kills_torn_checkpoint_and_stop_signals_resumes_exactly(tmp_path, reference):
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    saving = ["checkpoint.save_interval=1", "checkpoint.keep_last=2", f"checkpoint.save={ckpt}"]

    def killed_in_save(where: str) -> str:
        rc, log = _launch(run, saving, {"GLM5_FAULT_SAVE_KILL": where})
        assert rc != 0 and "SIGKILL" in log, log[-3000:]
        return log

    # 1. in megatron's payload write of step 2 (its fsync of rank 0's first file)
    killed_in_save("fsync:iter_0000002.partial/__0_0.distcp")
    assert store.choose(str(ckpt)).iteration == 1
    # 2. payload and manifest complete, before the rename into place
    assert _loaded(killed_in_save("rename:iter_0000002.partial>"), ckpt, 1)
    assert store.choose(str(ckpt)).iteration == 1
    # 3. renamed into place, before latest names it: ignored, latest still names step 1
    assert _loaded(killed_in_save("replace:latest_iteration.txt.tmp"), ckpt, 1)
    left = store.choose(str(ckpt))
    assert left.iteration == 1 and "iter_0000002 is newer than latest_iteration.txt" in (
        left.describe())
    # 4. step 2 saved again over that one (moved aside first), step 3 committed: killed while
    #    deleting step 1 (keep_last=2); latest already names step 3
    assert _loaded(killed_in_save("rename:" + str(ckpt / "iter_0000001>")), ckpt, 1)
    assert store.choose(str(ckpt)).iteration == 3
    # 5. step 3 torn (as a disk losing data would leave it): passed over with its reason; then
    #    SIGUSR1 reaches rank 1 only, as step 5 starts: every rank saves after step 5, exits 0
    with open(ckpt / "iter_0000003" / "__1_0.distcp", "r+b") as handle:
        handle.truncate(100)
    log = _ok(_launch(run, saving, {"GLM5_FAULT_RANK": "1", "GLM5_FAULT_SIGNAL": "5:SIGUSR1:self"}))
    assert _loaded(log, ckpt, 2) and "(iter_0000003 is not a complete checkpoint: file " \
        "__1_0.distcp has 100 bytes" in log
    assert f"glm5_train: stopped by SIGUSR1 after step 5; checkpoint {ckpt}/iter_0000005" in log
    assert store.read_latest(str(ckpt))[0] == 5
    # 6. SIGTERM to the torchrun agent as step 6 starts (slurm's preemption): it forwards it,
    #    the workers save after the step in flight and exit; torchrun reports the signal
    rc, log = _launch(run, saving, {"GLM5_FAULT_SIGNAL": "6:SIGTERM:agent"})
    assert _loaded(log, ckpt, 5)
    assert f"glm5_train: stopped by SIGTERM after step 6; checkpoint {ckpt}/iter_0000006" in log
    assert rc != 0 and "SIGTERM" in log
    # 7. the rest
    log = _ok(_launch(run, saving))
    assert _loaded(log, ckpt, 6)
    _assert_same_run(read_metrics(str(run)), reference)
    assert sorted(os.listdir(ckpt)) == ["iter_0000006", "iter_0000007", store.LATEST]


def test_a_rank_killed_under_torchrun_max_restarts_resumes_from_the_latest(tmp_path, reference):
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    log = _ok(_launch(run, ["checkpoint.save_interval=1", f"checkpoint.save={ckpt}"],
                      {"GLM5_FAULT_RANK": "1", "GLM5_FAULT_KILL_STEP": "4"},
                      torchrun=["--max-restarts=1"]))
    assert "checkpoint: no checkpoint in" in log and _loaded(log, ckpt, 3)
    _assert_same_run(read_metrics(str(run)), reference)


# ------------------------------------------------------------------------------ bad steps

NAN_PARAM = "output_layer.weight"  # on the last pipeline stage: rank 1 of PP2
REPORT_STEP2 = (f"step 2: non-finite gradients: rank 1: {NAN_PARAM} first (1 tensor); the "
                "step's batch is samples 4-7 of the training split")


def test_nonfinite_gradient_stops_the_job_naming_step_rank_parameter_and_samples(tmp_path):
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    rc, log = _launch(run, ["train.train_iters=3", "checkpoint.save_interval=1",
                            f"checkpoint.save={ckpt}"],
                      {"GLM5_FAULT_RANK": "1", "GLM5_FAULT_NAN_GRAD": f"2:{NAN_PARAM}"})
    assert rc != 0
    assert f"glm5_train: error: {REPORT_STEP2} (train.nonfinite=stop" in log, log[-3000:]
    records = read_metrics(str(run))
    assert [r["step"] for r in records] == [1, 2]
    assert records[1]["grad_norm"] != records[1]["grad_norm"]  # NaN: no update was applied
    assert store.read_latest(str(ckpt))[0] == 1  # the bad step is not saved


def test_nonfinite_gradients_are_skipped_until_the_consecutive_cap(tmp_path):
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    rc, log = _launch(run, ["train.nonfinite=skip", "train.nonfinite_max_consecutive=1",
                            "checkpoint.save_interval=1", "checkpoint.keep_last=null",
                            f"checkpoint.save={ckpt}"],
                      {"GLM5_FAULT_RANK": "1", "GLM5_FAULT_NAN_GRAD": f"2,4,5:{NAN_PARAM}"})
    assert f"glm5_train: skipped the update of {REPORT_STEP2}" in log, log[-3000:]
    assert "skipped the update of step 4: non-finite gradients: rank 1" in log
    assert rc != 0 and ("glm5_train: error: step 5: non-finite gradients: rank 1: "
                        f"{NAN_PARAM} first (1 tensor); the step's batch is samples 16-19 of "
                        "the training split; 2 non-finite steps in a row exceed "
                        "train.nonfinite_max_consecutive=1") in log
    records = read_metrics(str(run))
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r.get("skipped", False) for r in records] == [False, True, False, True, False]
    # The skipped step changed no weight, no optimizer state and not the schedule: the
    # checkpoints before and after it hold the same tensors, bit for bit.
    before, after = ckpt / "iter_0000001", ckpt / "iter_0000002"
    assert len(_payload(str(after))) >= 2  # one shard file per rank
    saved = [_saved_values(str(d)) for d in (before, after)]
    assert saved[0].keys() == saved[1].keys() and len(saved[0]) > 100
    differ = [k for k, v in saved[0].items() if not _same(v, saved[1][k])]
    assert differ == [], differ
    common = [dist_checkpointing.load_common_state_dict(str(d)) for d in (before, after)]
    assert common[0]["scheduler"] == common[1]["scheduler"]
    assert [c["train_state"]["iteration"] for c in common] == [1, 2]


# ----------------------------------------------------------------------- data, launcher

def _dataset(tmp_path, documents: list[list[int]]) -> str:
    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for ids in documents:
        builder.add_item(torch.tensor(ids, dtype=torch.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_token_ids_past_the_vocabulary_are_refused_naming_file_and_document(tmp_path):
    prefix = _dataset(tmp_path, [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 300, 11]])
    cache = tmp_path / "cache"
    check_token_ids(prefix, 301, str(cache))
    cached = json.loads((cache / "corpus.max_token_id.json").read_text())
    assert cached["max_token_id"] == 300
    with pytest.raises(ValueError) as err:
        check_token_ids(prefix, 258, str(cache))  # the cached maximum says: look
    assert (f"dataset {prefix}.bin: document 2 (token 5 of it) holds token id 300, at or past "
            "the vocabulary's 258 ids") in str(err.value)


def test_launcher_composes_the_save_directory_the_job_will_use(tmp_path):
    """``python -m launch.local checkpoint.save=DIR checkpoint.save_interval=2`` (or with the
    default directory) validates the job as it will run: the launcher used to compose it with
    checkpoint.save=null and refuse the interval."""
    job = compose_job([f"checkpoint.save={tmp_path}", "checkpoint.save_interval=2"])
    assert job.checkpoint.save == str(tmp_path) and job.checkpoint.save_interval == 2
    default = compose_job(["checkpoint.save_interval=2", f"hydra.run.dir={tmp_path}/run"])
    assert default.checkpoint.save == f"{tmp_path}/run/checkpoints"
    assert compose_job([]).checkpoint.save.startswith("outputs/")
    assert compose_job(["checkpoint.save=null"]).checkpoint.save is None
    assert CheckpointConfig().load == "auto" and compose_job([]).checkpoint.load == "auto"
