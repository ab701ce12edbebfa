"""Crash-safe checkpoint directories: staging, durable commit, the ``latest`` pointer, retention,
and the choice of the checkpoint to load. Pure file-system mechanics (no torch): which rank
does what, and when, is ``glm5_train.checkpoint``'s business.

A save directory::

    iter_0000010/            a committed checkpoint: its files + MANIFEST (every file's size
                             and sha256 digest)
    iter_0000012.partial/    a save in progress, or one a crash cut short: never loaded
    iter_*.old, iter_*.deleted  the previous iter_N while a re-save of N commits; a deletion
    latest_iteration.txt     the iteration of the newest committed checkpoint: the commit point

A save writes into a fresh ``iter_N.partial`` (removed first if a crash left one); every rank
hashes and fsyncs the files it wrote (``seal_files``: one read of each, from the page cache);
then ``commit`` (one process, given every rank's digests):

1. writes MANIFEST (each file's size and digest) into the staging directory and fsyncs it and
   the directory;
2. moves an existing ``iter_N`` aside to ``iter_N.old`` (re-saving an iteration after resuming
   from an earlier checkpoint), renames the staging directory to ``iter_N``, fsyncs the root;
3. replaces ``latest_iteration.txt`` atomically (temporary file, fsync, rename, fsync root);
4. only then deletes ``iter_N.old``, the leftovers of crashed saves and the checkpoints beyond
   the newest ``keep_last``: the previous good checkpoint is never touched before the new one
   is complete and ``latest`` names it.

Whatever instant a process is killed at, ``latest`` names a complete checkpoint (the old one or
the new one) or does not exist yet. ``choose`` goes by ``latest``, verifies the checkpoint
against its MANIFEST (a missing or truncated file: a torn copy, a disk that lost unsynced data;
a file whose content no longer matches its digest: a flipped bit, a file overwritten in place)
and falls back, with a note saying why, to the newest older one that verifies. Pruning checks
sizes only: a save never re-reads older checkpoints. A MANIFEST of format 1 (sizes only, written
before digests were recorded) still loads, its sizes checked and a notice given. Directories
newer than ``latest`` are a commit that did not reach step 3 and are ignored (their iteration is
re-saved by the resumed run, through step 2's move aside).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

LATEST = "latest_iteration.txt"
MANIFEST = "glm5_manifest.json"
MANIFEST_FORMAT = 2  # 2: every file's size and digest; 1 (still read): sizes only
# The digest of every checkpoint file. sha256 is the fastest of hashlib's digests where the CPU
# has SHA instructions, which OpenSSL uses (x86 SHA-NI: AMD since Zen, Intel Xeons since Ice
# Lake, so the GPU servers' CPUs; ARMv8 crypto extensions). One core of the dev machine's Xeon
# (sha_ni), Python 3.11.7 + OpenSSL 3.0, 256 MiB in memory: sha256 1.25 GB/s, sha1 1.22 (and
# broken), blake2b 1.01, sha512 0.88, md5 0.80, blake2s 0.64, sha3_256 0.57.
# zlib.crc32 (2.4 GB/s) is no digest: 32 bits, chosen for transmission errors, not files of GBs.
# The manifest names the algorithm, so a later change keeps older checkpoints verifiable.
HASH = "sha256"
_READ_BYTES = 8 << 20  # per read while hashing: big enough that the hash, not syscalls, costs
_SEAL_THREADS = 4  # files of one rank hashed at once, at most
_THREADED_BYTES = 64 << 20  # below this a rank's files are hashed in turn: threads gain nothing
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


def hash_file(path: str, algorithm: str = HASH, sync: bool = False) -> dict:
    """``{"size": bytes read, algorithm: hex digest}`` of the file; ``sync``: fsync it too (on
    the descriptor just read, so a save reads each file once). hashlib releases the GIL while
    it hashes, so other threads of the rank keep running."""
    digest = hashlib.new(algorithm)
    buffer = bytearray(_READ_BYTES)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
            size += count
        if sync:
            os.fsync(handle.fileno())
    return {"size": size, algorithm: digest.hexdigest()}


def seal_files(directory: str, wanted=lambda name: True) -> dict[str, dict]:
    """Hash and fsync every file under ``directory`` whose name ``wanted`` accepts (the files
    this process wrote, just written: read back from the page cache, not the disk); returns
    their MANIFEST entries by path relative to ``directory``, for ``commit``. Several large
    files are hashed in threads (megatron-core's writer gives each rank two by default):
    hashlib and the reads release the GIL, and a rank has idle cores while it saves."""
    paths = [os.path.join(dirpath, name) for dirpath, _, filenames in os.walk(directory)
             for name in sorted(filenames) if wanted(name)]
    threads = min(len(paths), _SEAL_THREADS)
    if threads < 2 or sum(map(os.path.getsize, paths)) < _THREADED_BYTES:
        entries = [hash_file(path, sync=True) for path in paths]
    else:
        with ThreadPoolExecutor(threads) as pool:
            entries = list(pool.map(lambda path: hash_file(path, sync=True), paths))
    return {os.path.relpath(path, directory): entry for path, entry in zip(paths, entries)}


# ------------------------------------------------------------------------------------ saving

def prepare_staging(root: str, iteration: int) -> str:
    """A fresh, empty staging directory for ``iteration`` (what a crashed save of the same
    iteration left there is removed: it was never committed)."""
    os.makedirs(root, exist_ok=True)
    staging = staging_dir(root, iteration)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging


def commit(root: str, iteration: int, keep_last: int | None,
           sealed: dict[str, dict] | None = None) -> str:
    """Turn ``iter_N.partial`` (every rank's files written and fsynced) into the checkpoint
    ``latest`` names, in the order the module docstring gives; returns its directory.
    ``sealed``: every rank's ``seal_files`` entries merged (None: one process wrote the files
    and they are hashed here)."""
    staging = staging_dir(root, iteration)
    final = iteration_dir(root, iteration)
    write_manifest(staging, iteration, sealed)
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


def write_manifest(directory: str, iteration: int, sealed: dict[str, dict] | None = None) -> None:
    """Name, size and digest of every file of the checkpoint, written (and fsynced) last inside
    it. ``sealed``: the entries the writers computed, which must cover exactly the files there
    with their sizes (None: hash them here)."""
    sizes = {}
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            path = os.path.join(dirpath, name)
            sizes[os.path.relpath(path, directory)] = os.path.getsize(path)
    sizes.pop(MANIFEST, None)
    if sealed is None:
        sealed = {name: hash_file(os.path.join(directory, name)) for name in sizes}
    _check_sealed(directory, sizes, sealed)
    record = {"format": MANIFEST_FORMAT, "iteration": iteration, "hash": HASH,
              "files": dict(sorted(sealed.items()))}
    path = os.path.join(directory, MANIFEST)
    with open(path, "w") as handle:
        json.dump(record, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def _check_sealed(directory: str, sizes: dict[str, int], sealed: dict[str, dict]) -> None:
    """The writers' entries describe the files on disk: none left out (a file written by a
    process that did not hash it), none extra, none changed in size since it was hashed."""
    for name in sorted(sizes.keys() ^ sealed.keys()):
        where = "no writer hashed it" if name in sizes else "it is not there"
        raise OSError(f"{directory}: file {name} cannot go into {MANIFEST}: {where} (each rank "
                      "must seal exactly the files it wrote)")
    for name, size in sizes.items():
        if sealed[name]["size"] != size:
            raise OSError(f"{directory}: file {name} has {size} bytes, {sealed[name]['size']} "
                          "when its writer hashed it: it changed after the save wrote it")


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
        # Sizes only: a save must not re-read the checkpoints it keeps (GBs each).
        if kept < keep_last and verify(iteration_dir(root, iteration), iteration,
                                       content=False) is None:
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


@dataclass
class Manifest:
    """A checkpoint's MANIFEST, read: each file's size and, from format 2 on, its digest."""

    iteration: int | None
    sizes: dict[str, int]
    digests: dict[str, str]  # empty for a format-1 manifest (sizes only)
    algorithm: str | None = None


def read_manifest(directory: str) -> tuple[Manifest | None, str | None]:
    """(the manifest, None) or (None, why there is no usable one)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        return None, "missing"
    if not os.path.exists(path):
        return None, f"no {MANIFEST} (the save that wrote it did not finish)"
    try:
        with open(path) as handle:
            record = json.load(handle)
        return _parse_manifest(record), None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return None, f"unreadable {MANIFEST} ({type(err).__name__}: {err})"


def _parse_manifest(record: dict) -> Manifest:
    files = record["files"]
    if record.get("format", 1) == 1:  # before digests: {name: size}
        return Manifest(record.get("iteration"), {n: int(v) for n, v in files.items()}, {})
    algorithm = record["hash"]
    if algorithm not in hashlib.algorithms_available:
        raise ValueError(f"hash {algorithm!r} is not one this Python's hashlib has")
    return Manifest(record.get("iteration"), {n: int(e["size"]) for n, e in files.items()},
                    {n: e[algorithm] for n, e in files.items()}, algorithm)


def verify(directory: str, iteration: int | None = None, content: bool = True) -> str | None:
    """None when ``directory`` is a complete checkpoint (every file of its MANIFEST present with
    its size and, with ``content``, its digest: every byte read); otherwise the reason it is
    not. A format-1 manifest (no digests) is checked by size only."""
    manifest, problem = read_manifest(directory)
    if problem is None:
        problem = _check_sizes(directory, manifest, iteration)
    if problem is None and content:
        problem = check_content(directory, manifest)
    return problem


def _check_sizes(directory: str, manifest: Manifest, iteration: int | None) -> str | None:
    if iteration is not None and manifest.iteration != iteration:
        return f"{MANIFEST} is for iteration {manifest.iteration}, not {iteration}"
    for name, size in manifest.sizes.items():
        file_path = os.path.join(directory, name)
        if not os.path.isfile(file_path):
            return f"file {name} is missing"
        actual = os.path.getsize(file_path)
        if actual != size:
            return f"file {name} has {actual} bytes, {size} were written"
    return None


def check_content(directory: str, manifest: Manifest, part: int = 0, parts: int = 1) -> str | None:
    """Hash the files of share ``part`` of ``parts`` (all of them by default; ``parts``
    processes each taking one share read the checkpoint once between them) against their
    digests; the first mismatch by name, or None. Sizes are assumed checked already."""
    for name in sorted(_share(manifest.sizes, part, parts)):
        if name not in manifest.digests:
            continue  # a format-1 manifest: sizes only
        try:
            actual = hash_file(os.path.join(directory, name), manifest.algorithm)
        except OSError as err:  # a reason like any other: in a job, every rank must hear it
            return f"file {name} cannot be read ({type(err).__name__}: {err})"
        if actual[manifest.algorithm] != manifest.digests[name]:
            return (f"file {name} does not match its {manifest.algorithm} digest (read "
                    f"{actual[manifest.algorithm][:16]}..., written "
                    f"{manifest.digests[name][:16]}...): its content changed after the save")
    return None


def _share(sizes: dict[str, int], part: int, parts: int) -> list[str]:
    """The files of share ``part``: the largest first, each to the share with the fewest bytes
    so far (every process computes the same split from the same manifest)."""
    loads = [0] * parts
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        lightest = loads.index(min(loads))
        loads[lightest] += sizes[name] + 1  # + 1: empty files spread too
        if lightest == part:
            mine.append(name)
    return mine


def sizes_only_notice(directory: str) -> str | None:
    """The one-line notice for a checkpoint whose manifest has no digests (format 1), else
    None."""
    manifest, _ = read_manifest(directory)
    if manifest is None or manifest.digests or not manifest.sizes:
        return None
    return (f"checkpoint: {os.path.basename(directory)}'s {MANIFEST} predates digests (format "
            "1): its files' sizes were checked, their content cannot be")


@dataclass
class Choice:
    """What ``choose`` found under a save directory."""

    root: str
    iteration: int | None = None  # None: no complete checkpoint
    path: str | None = None
    notes: list[str] = field(default_factory=list)  # why newer candidates were passed over
    present: bool = False  # the directory holds any checkpoint, complete or not
    notice: str | None = None  # the chosen one's manifest has no digests (sizes_only_notice)

    def describe(self) -> str:
        return "; ".join(self.notes)


def choose(root: str, content: bool = True, rejected: dict[str, str] | None = None) -> Choice:
    """The checkpoint to load from ``root``: the one ``latest`` names if it verifies, else the
    newest older one that does (without ``latest``: the newest that verifies). ``content``:
    verify digests too (False: sizes only, the caller hashes the chosen one, e.g. spread over
    ranks); ``rejected``: directories the caller's content check refused, by reason."""
    choice = Choice(root)
    rejected = rejected or {}
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
            problem = rejected.get(directory) or verify(directory, iteration, content)
            if problem is None:
                choice.iteration, choice.path = iteration, directory
                choice.notice = sizes_only_notice(directory)
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
