"""Crash-safe checkpoint directories: staging, durable commit, the ``latest`` pointer, retention,
and the choice of the checkpoint to load. Pure file-system mechanics (no torch): which rank
does what, and when, is ``glm5_train.checkpoint``'s business.

A save directory::

    iter_0000010/            a committed checkpoint: its files + MANIFEST (every file's size)
    iter_0000012.partial/    a save in progress, or one a crash cut short: never loaded
    iter_*.old, iter_*.deleted  the previous iter_N while a re-save of N commits; a deletion
    latest_iteration.txt     the iteration of the newest committed checkpoint: the commit point

A save writes into a fresh ``iter_N.partial`` (removed first if a crash left one); every rank
fsyncs the files it wrote; then ``commit`` (one process):

1. writes MANIFEST into the staging directory and fsyncs it and the directory;
2. moves an existing ``iter_N`` aside to ``iter_N.old`` (re-saving an iteration after resuming
   from an earlier checkpoint), renames the staging directory to ``iter_N``, fsyncs the root;
3. replaces ``latest_iteration.txt`` atomically (temporary file, fsync, rename, fsync root);
4. only then deletes ``iter_N.old``, the leftovers of crashed saves and the checkpoints beyond
   the newest ``keep_last``: the previous good checkpoint is never touched before the new one
   is complete and ``latest`` names it.

Whatever instant a process is killed at, ``latest`` names a complete checkpoint (the old one or
the new one) or does not exist yet. ``choose`` goes by ``latest``, verifies the checkpoint
against its MANIFEST (a missing or truncated file: a torn copy, a disk that lost unsynced data)
and falls back, with a note saying why, to the newest older one that verifies. Directories
newer than ``latest`` are a commit that did not reach step 3 and are ignored (their iteration is
re-saved by the resumed run, through step 2's move aside).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field

LATEST = "latest_iteration.txt"
MANIFEST = "glm5_manifest.json"
MANIFEST_FORMAT = 1
PARTIAL_SUFFIX = ".partial"
ASIDE_SUFFIX = ".old"
DISCARD_SUFFIX = ".deleted"
_COMMITTED = re.compile(r"^iter_(\d{7,})$")
_LEFTOVER = re.compile(r"^(iter_\d{7,}(\.partial|\.old|\.deleted)|latest_iteration\.txt\.tmp\d+)$")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def staging_dir(root: str, iteration: int) -> str:
    return iteration_dir(root, iteration) + PARTIAL_SUFFIX


# ---------------------------------------------------------------------------------- durability

def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make the directory's entries (created, renamed files) durable: a rename is only on disk
    once its parent directory is synced."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str, text: str) -> None:
    """Replace ``path`` by ``text`` atomically and durably: a reader sees the old or the new
    content, never a mix, and after a crash the new content only if the call returned."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def fsync_tree(directory: str, wanted=lambda name: True) -> int:
    """fsync every file under ``directory`` whose name ``wanted`` accepts; returns the count."""
    count = 0
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            if wanted(name):
                fsync_file(os.path.join(dirpath, name))
                count += 1
    return count


# ------------------------------------------------------------------------------------ saving

def prepare_staging(root: str, iteration: int) -> str:
    """A fresh, empty staging directory for ``iteration`` (what a crashed save of the same
    iteration left there is removed: it was never committed)."""
    os.makedirs(root, exist_ok=True)
    staging = staging_dir(root, iteration)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging


def commit(root: str, iteration: int, keep_last: int | None) -> str:
    """Turn ``iter_N.partial`` (every rank's files written and fsynced) into the checkpoint
    ``latest`` names, in the order the module docstring gives; returns its directory."""
    staging = staging_dir(root, iteration)
    final = iteration_dir(root, iteration)
    write_manifest(staging, iteration)
    fsync_dir(staging)
    aside = final + ASIDE_SUFFIX
    if os.path.isdir(final):
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(staging, final)
    fsync_dir(root)
    write_durable(os.path.join(root, LATEST), f"{iteration}\n")
    remove_leftovers(root)
    prune(root, iteration, keep_last)
    return final


def write_manifest(directory: str, iteration: int) -> None:
    """Name and size of every file of the checkpoint, written (and fsynced) last inside it."""
    files = {}
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            path = os.path.join(dirpath, name)
            files[os.path.relpath(path, directory)] = os.path.getsize(path)
    files.pop(MANIFEST, None)
    record = {"format": MANIFEST_FORMAT, "iteration": iteration, "files": dict(sorted(files.items()))}
    path = os.path.join(directory, MANIFEST)
    with open(path, "w") as handle:
        json.dump(record, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def remove_leftovers(root: str) -> None:
    """Staging directories of crashed saves, directories moved aside by a finished commit,
    deletions and ``latest`` replacements a kill interrupted."""
    for name in os.listdir(root):
        if _LEFTOVER.match(name):
            path = os.path.join(root, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)


def prune(root: str, newest: int, keep_last: int | None) -> list[int]:
    """Keep the ``keep_last`` newest complete checkpoints up to ``newest`` (the one just
    committed) and delete the others up to it, torn ones included; returns the iterations
    deleted. Directories newer than ``newest`` are not this run's: left alone."""
    if keep_last is None:
        return []
    kept, doomed = 0, []
    for iteration in sorted((i for i in committed_iterations(root) if i <= newest), reverse=True):
        if kept < keep_last and verify(iteration_dir(root, iteration), iteration) is None:
            kept += 1
        else:
            doomed.append(iteration)
    for iteration in doomed:
        discard(iteration_dir(root, iteration))
    return doomed


def discard(directory: str) -> None:
    """Delete a checkpoint directory so that it disappears at once: renamed first (a kill in
    the middle of a long delete leaves a leftover the next commit removes, never a half-deleted
    ``iter_N``)."""
    doomed = directory + DISCARD_SUFFIX
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(directory, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


# ----------------------------------------------------------------------------------- loading

def committed_iterations(root: str) -> list[int]:
    """Iterations of the ``iter_N`` directories under ``root``, ascending (not yet verified)."""
    if not os.path.isdir(root):
        return []
    found = (_COMMITTED.match(name) for name in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


def read_latest(root: str) -> tuple[int | None, str | None]:
    """(iteration ``latest_iteration.txt`` names, None) or (None, why it names none)."""
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None, f"no {LATEST}"
    with open(path) as handle:
        text = handle.read().strip()
    if not text.isdigit():
        return None, f"{LATEST} holds {text[:40]!r}, not an iteration"
    return int(text), None


def verify(directory: str, iteration: int | None = None) -> str | None:
    """None when ``directory`` is a complete checkpoint (every file of its MANIFEST present with
    its size); otherwise the reason it is not."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        return "missing"
    if not os.path.exists(path):
        return f"no {MANIFEST} (the save that wrote it did not finish)"
    try:
        with open(path) as handle:
            manifest = json.load(handle)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable {MANIFEST} ({type(err).__name__}: {err})"
    if iteration is not None and manifest.get("iteration") != iteration:
        return f"{MANIFEST} is for iteration {manifest.get('iteration')}, not {iteration}"
    for name, size in files.items():
        file_path = os.path.join(directory, name)
        if not os.path.isfile(file_path):
            return f"file {name} is missing"
        actual = os.path.getsize(file_path)
        if actual != size:
            return f"file {name} has {actual} bytes, {size} were written"
    return None


@dataclass
class Choice:
    """What ``choose`` found under a save directory."""

    root: str
    iteration: int | None = None  # None: no complete checkpoint
    path: str | None = None
    notes: list[str] = field(default_factory=list)  # why newer candidates were passed over
    present: bool = False  # the directory holds any checkpoint, complete or not

    def describe(self) -> str:
        return "; ".join(self.notes)


def choose(root: str) -> Choice:
    """The checkpoint to load from ``root``: the one ``latest`` names if it verifies, else the
    newest older one that does (without ``latest``: the newest that verifies)."""
    choice = Choice(root)
    iterations = committed_iterations(root)
    latest, why = read_latest(root)
    choice.present = bool(iterations) or latest is not None
    if latest is None:
        if iterations and why:
            choice.notes.append(why)
        candidates = sorted(iterations, reverse=True)
    else:
        newer = [i for i in iterations if i > latest]
        if newer:
            choice.notes.append(f"iter_{newer[-1]:07d} is newer than {LATEST} ({latest}): a save "
                                "that did not finish committing, ignored")
        candidates = [latest] + sorted((i for i in iterations if i < latest), reverse=True)
    for iteration in candidates:
        for directory in _directories_of(root, iteration, latest):
            problem = verify(directory, iteration)
            if problem is None:
                choice.iteration, choice.path = iteration, directory
                return choice
            if problem != "missing" or directory == iteration_dir(root, iteration):
                choice.notes.append(f"{os.path.basename(directory)} is not a complete "
                                    f"checkpoint: {problem}")
    return choice


def _directories_of(root: str, iteration: int, latest: int | None) -> list[str]:
    """Where iteration's checkpoint can be: ``iter_N``; for the one ``latest`` names also
    ``iter_N.old`` (a re-save of that very iteration cut between its two renames)."""
    final = iteration_dir(root, iteration)
    return [final, final + ASIDE_SUFFIX] if iteration == latest else [final]
