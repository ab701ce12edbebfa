"""Checkpoint digests: every file's sha256 in the manifest, hashed by the rank that wrote it.

- Store level (no torch, < 1 s): one byte of a shard flipped, its size unchanged: ``verify`` and
  tools/verify_checkpoint.py refuse the checkpoint naming the file, ``choose`` passes over it
  for the older one with the reason; a save (pruning included) reads no older checkpoint; a
  manifest of format 1 (sizes only) still loads, with its notice; hashing a rank's files in
  threads gives what hashing them in turn gives.
- The real job (PP2 on 2 ranks, ~15 s): every file of its checkpoints carries a digest from its
  writer; the newest checkpoint corrupted the same way, a resumed job loads the one before,
  saying why (the share of the rank that found the mismatch is not rank 0's), and repeats the
  lost step with the same loss; a format-1 manifest loads with its notice.
"""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys

from glm5_train import checkpoint_store as store
from tests import store_saver
from tests.parity import run_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISMATCH = "file __1_0.distcp does not match its sha256 digest"


def flip_one_byte(path: str, offset: int = 1000) -> None:
    """Corrupt ``path`` as a bad disk or a stray write would: one byte inverted, same size."""
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))
    assert os.path.getsize(path) == size


def to_format_1(directory: str) -> None:
    """Rewrite a checkpoint's manifest as saves wrote it before digests: sizes only."""
    path = os.path.join(directory, store.MANIFEST)
    with open(path) as handle:
        record = json.load(handle)
    old = {"format": 1, "iteration": record["iteration"],
           "files": {name: entry["size"] for name, entry in record["files"].items()}}
    with open(path, "w") as handle:
        json.dump(old, handle, indent=1)


def verify_tool(*paths) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/verify_checkpoint.py", *map(str, paths)],
                          cwd=REPO, capture_output=True, text=True, check=False)


# ------------------------------------------------------------------------------- the store

def test_a_flipped_byte_is_refused_naming_the_file_and_the_older_checkpoint_chosen(tmp_path):
    for iteration in (1, 2):
        store_saver.save(str(tmp_path), iteration)
    newest = store.iteration_dir(str(tmp_path), 2)
    flip_one_byte(os.path.join(newest, "__1_0.distcp"))
    assert store.verify(newest, 2, content=False) is None  # sizes alone would load it
    assert store.verify(newest, 2).startswith(MISMATCH)
    choice = store.choose(str(tmp_path))
    assert choice.iteration == 1 and choice.notice is None
    assert choice.describe().startswith(f"iter_0000002 is not a complete checkpoint: {MISMATCH}")
    tool = verify_tool(tmp_path)
    assert tool.returncode == 1, tool.stderr
    assert f"iter_0000002: REFUSED: {MISMATCH}" in tool.stdout
    assert "iter_0000001: ok (2 files, 0.0 MB; sha256 of every file)" in tool.stdout
    assert f"a resume would load {store.iteration_dir(str(tmp_path), 1)} (" in tool.stdout
    assert verify_tool(store.iteration_dir(str(tmp_path), 1)).returncode == 0
    absent = verify_tool(tmp_path / "absent")
    assert absent.returncode == 2 and "is neither a checkpoint directory" in absent.stderr


def test_sealing_in_threads_gives_the_entries_of_sealing_in_turn(tmp_path, monkeypatch):
    """Large files are hashed in threads (a rank's two shard files); small ones in turn."""
    store_saver.save(str(tmp_path), 1)
    directory = store.iteration_dir(str(tmp_path), 1)
    with open(os.path.join(directory, store.MANIFEST)) as handle:
        written = json.load(handle)["files"]
    monkeypatch.setattr(store, "_THREADED_BYTES", 0)
    assert store.seal_files(directory, lambda name: name != store.MANIFEST) == written


def test_a_save_reads_no_older_checkpoint(tmp_path, monkeypatch):
    """Pruning checks sizes: committing step 3 (keep_last=2, so step 1 goes) reads the older
    checkpoints' manifests only, none of their files, and keeps the corrupted step 2."""
    for iteration in (1, 2):
        store_saver.save(str(tmp_path), iteration)
    flip_one_byte(os.path.join(store.iteration_dir(str(tmp_path), 2), "__0_0.distcp"))
    opened = []
    real_open = builtins.open

    def recording_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", recording_open)
    store_saver.save(str(tmp_path), 3)
    monkeypatch.undo()
    old = [p for p in opened if "iter_0000001" in p or "iter_0000002" in p]
    assert old and all(p.endswith(store.MANIFEST) for p in old), old
    assert any(p.endswith("iter_0000003.partial/__1_0.distcp") for p in opened)
    assert store.committed_iterations(str(tmp_path)) == [2, 3]


def test_a_manifest_without_digests_still_loads_with_a_notice(tmp_path):
    store_saver.save(str(tmp_path), 1)
    directory = store.iteration_dir(str(tmp_path), 1)
    to_format_1(directory)
    choice = store.choose(str(tmp_path))
    assert choice.iteration == 1 and choice.notes == []
    assert choice.notice == ("checkpoint: iter_0000001's glm5_manifest.json predates digests "
                             "(format 1): its files' sizes were checked, their content cannot be")
    tool = verify_tool(directory)
    assert tool.returncode == 0, tool.stdout + tool.stderr
    assert "sizes only: its manifest predates digests (format 1)" in tool.stdout
    assert choice.notice in tool.stdout
    with open(os.path.join(directory, "__0_0.distcp"), "ab") as handle:
        handle.write(b"x")  # its sizes are still checked
    assert store.choose(str(tmp_path)).path is None


# --------------------------------------------------------------------------------- the job

JOB = ["parallel=pp2", "train.seq_length=64", "checkpoint.save_interval=1"]


def test_a_resumed_job_passes_over_a_corrupted_checkpoint_saying_why(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run_job(2, [*JOB, "train.train_iters=2", f"checkpoint.save={ckpt}"],
                    str(tmp_path / "first")).records
    newest = store.iteration_dir(str(ckpt), 2)
    with open(os.path.join(newest, store.MANIFEST)) as handle:
        manifest = json.load(handle)
    files = sorted(os.listdir(newest))
    assert manifest["format"] == 2 and manifest["hash"] == "sha256"
    assert sorted(manifest["files"]) == [f for f in files if f != store.MANIFEST]
    assert {"__0_0.distcp", "__1_0.distcp", "common.pt"} <= set(files)  # both ranks' files
    # Rank 1 wrote it and hashes it at load too: the mismatch reaches rank 0, which chooses.
    sizes = {name: entry["size"] for name, entry in manifest["files"].items()}
    assert "__1_0.distcp" in store._share(sizes, 1, 2)
    flip_one_byte(os.path.join(newest, "__1_0.distcp"))
    to_format_1(store.iteration_dir(str(ckpt), 1))
    resumed = run_job(2, [*JOB, "train.train_iters=2", f"checkpoint.save={ckpt}"],
                      str(tmp_path / "resumed"))
    assert (f"checkpoint: loading {ckpt}/iter_0000001 (iter_0000002 is not a complete "
            f"checkpoint: {MISMATCH}") in resumed.log, resumed.log[-3000:]
    assert "iter_0000001's glm5_manifest.json predates digests (format 1)" in resumed.log
    assert [r["step"] for r in resumed.records] == [2]
    assert resumed.records[0]["loss"] == first[1]["loss"]
    assert store.verify(newest, 2) is None  # saved again, whole
