"""A rollout worker: samples groups with the newest published weights and spools them.

    python -m glm5_train.rl.rollout_worker --versions DIR --spool DIR --worker K --workers W \\
        --group-size G --kind copy --digits 8 --task-seed 0 [--latency none|longtail] \\
        [--latency-median-s 1.0] [--latency-sigma 1.0] [--sync-groups N] [--max-groups M] \\
        [--threads 1] [--seed 0]

The spool (the trainer reads it; this contract is what it relies on):

- one file per group, ``<spool>/w{K:03d}-{slot:07d}.jsonl``: the G rollouts of one prompt in
  the ``glm5_train.rl.records`` schema. It is staged under a name starting with '.' (which
  readers ignore) and ``os.replace``d into place, so a reader only ever sees whole files;
- group_id = the file's stem; policy_version = the version that generated it; loss_mask all
  ones; rollout_logprobs = the engine's fp32 log-probs; reward = the task's reward;
- slot ``s`` of worker ``K`` answers train prompt ``s * W + K`` (prompts unique across
  workers); its sampling seed and its latency come from (seed, K, s) alone, so a slot
  regenerated after a restart draws the same delay.

Resume: on start a worker deletes its own hidden leftovers and never rewrites a slot it has
written; it fills the lowest unwritten slots first (latency writes slots out of order, so a
kill can leave gaps).

Latency (``--latency longtail``) stands for tool calls and builds: a group is generated at
once, then held in a pending queue (at most MAX_PENDING groups) until its lognormal delay has
passed, while the worker generates the next groups, as a server with many requests in flight
would. Pending groups are dropped by a stop or a kill; their slots are regenerated later.

Asynchronous mode (default): before each group, the worker loads the newest version if
``latest`` moved. Synchronous mode (``--sync-groups N``, the synchronous RL baseline): for
version v the worker writes its share of the step's N groups, all with v, waits until every
one is written (the step waits for its slowest group), then waits for a version newer than v.
Slots: with ``per_worker = ceil(N / W)``, step v's groups are slots ``v * per_worker + j`` of
each worker, for the j with ``j * W + K < N``.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import heapq
import math
import os
import random
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TextIO

import numpy

from glm5_train.rl.digit_task import DigitTask, add_task_arguments, task_from_args
from glm5_train.rl.engine import POLL_S, HfEngine, load_latest, set_threads
from glm5_train.rl.publisher import complete_versions, latest_version
from glm5_train.rl.records import Rollout, write_rollouts

LATENCIES = ("none", "longtail")
MAX_PENDING = 64  # groups held back by latency at once: bounds memory
MAX_WORKERS = 1000  # the three digits of w{K:03d}


# ----------------------------------------------------------------------------------------------
# Options
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerOptions:
    """What one worker does (the CLI's flags). ``max_groups``: stop after writing that many
    groups in this run (None: never). ``sync_groups``: None for asynchronous mode."""

    versions: str
    spool: str
    worker: int
    workers: int
    group_size: int
    task: DigitTask
    latency: str = "none"
    latency_median_s: float = 1.0
    latency_sigma: float = 1.0
    sync_groups: int | None = None
    groups_per_version: int | None = None  # async: at most this many groups per version
    max_groups: int | None = None
    seed: int = 0
    max_pending: int = MAX_PENDING
    poll_s: float = POLL_S

    def __post_init__(self) -> None:
        problem = options_problem(self)
        if problem is not None:
            raise ValueError(problem)

    @property
    def per_worker(self) -> int:
        """Sync mode: slots each worker reserves per version, ceil(N / W)."""
        return math.ceil(self.sync_groups / self.workers)

    def step_slots(self, version: int) -> list[int]:
        """Sync mode: this worker's slots for version ``version``'s step."""
        return [version * self.per_worker + j for j in range(self.per_worker)
                if j * self.workers + self.worker < self.sync_groups]


def options_problem(options: WorkerOptions) -> str | None:
    """The first bad option as one line (value, rule, fix), or None."""
    def positive_int(value) -> bool:
        return not isinstance(value, bool) and isinstance(value, int) and value >= 1

    if not positive_int(options.workers) or options.workers > MAX_WORKERS:
        return (f"--workers {options.workers!r} must be an integer in [1, {MAX_WORKERS}] "
                "(file names carry the worker in 3 digits); pass the number of workers")
    if (isinstance(options.worker, bool) or not isinstance(options.worker, int)
            or not 0 <= options.worker < options.workers):
        return (f"--worker {options.worker!r} must be in [0, --workers={options.workers}); "
                "number the workers 0..W-1")
    if not positive_int(options.group_size):
        return f"--group-size {options.group_size!r} must be an integer >= 1 (rollouts per prompt)"
    if options.latency not in LATENCIES:
        return f"--latency {options.latency!r} is not one of {list(LATENCIES)}"
    if not options.latency_median_s > 0 or not options.latency_sigma >= 0:
        return (f"--latency-median-s {options.latency_median_s!r} must be > 0 and "
                f"--latency-sigma {options.latency_sigma!r} >= 0 (a lognormal's median, spread)")
    for name, value in (("--max-groups", options.max_groups),
                        ("--sync-groups", options.sync_groups),
                        ("--groups-per-version", options.groups_per_version)):
        if value is not None and not positive_int(value):
            return f"{name} {value!r} must be an integer >= 1 (or left out)"
    if options.sync_groups is not None and options.worker >= options.sync_groups:
        return (f"--worker {options.worker} would get no group of a step: --sync-groups "
                f"{options.sync_groups} groups go to workers 0..{options.sync_groups - 1}; "
                "run at most --sync-groups workers")
    if not positive_int(options.max_pending):
        return f"max_pending={options.max_pending!r} must be an integer >= 1"
    return None


# ----------------------------------------------------------------------------------------------
# The spool: names, what is written, leftovers
# ----------------------------------------------------------------------------------------------


def group_id(worker: int, slot: int) -> str:
    """``w{K:03d}-{slot:07d}``: the group's id and its file's stem."""
    return f"w{worker:03d}-{slot:07d}"


def group_path(spool: str, worker: int, slot: int) -> str:
    return os.path.join(spool, group_id(worker, slot) + ".jsonl")


def written_slots(spool: str, worker: int) -> set[int]:
    """The slots worker ``worker`` has in the spool already."""
    pattern = re.compile(rf"^w{worker:03d}-(\d{{7}})\.jsonl$")
    if not os.path.isdir(spool):
        return set()
    return {int(m.group(1)) for m in map(pattern.match, os.listdir(spool)) if m}


def claim_worker(spool: str, worker: int):
    """Hold ``<spool>/.lock-w{K:03d}`` (an exclusive flock, released when the process ends or
    the handle closes): two processes started as the same worker would overwrite each other's
    groups and delete each other's staged files. ValueError when another holds it."""
    path = os.path.join(spool, f".lock-w{worker:03d}")
    handle = open(path, "a")  # noqa: SIM115 (held for the worker's life)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ValueError(f"worker {worker} is already running on {spool} (another process "
                         f"holds {path}): give each worker its own --worker number") from None
    return handle


def remove_own_leftovers(spool: str, worker: int) -> list[str]:
    """Delete this worker's staged files (names starting ``.w{K:03d}-``) that a kill left
    behind; never another worker's. The names removed."""
    if not os.path.isdir(spool):
        return []
    prefix = f".w{worker:03d}-"
    removed = sorted(name for name in os.listdir(spool) if name.startswith(prefix))
    for name in removed:
        os.remove(os.path.join(spool, name))
    return removed


def write_group(spool: str, worker: int, slot: int, rollouts: list[Rollout]) -> str:
    """Write one group's file atomically; its path. Staged as ``.w{K:03d}-{slot:07d}.jsonl``
    (``write_rollouts`` needs a .jsonl name; it writes that atomically itself through
    ``<name>.tmp.<pid>``, also hidden), then moved into place."""
    final = group_path(spool, worker, slot)
    if os.path.exists(final):
        raise FileExistsError(f"{final} exists already: a slot is written once; is a second "
                              f"process running as --worker {worker}? give each worker its "
                              "own number")
    staged = os.path.join(spool, "." + os.path.basename(final))
    write_rollouts(staged, rollouts)
    os.replace(staged, final)
    return final


# ----------------------------------------------------------------------------------------------
# One group
# ----------------------------------------------------------------------------------------------


def prompt_index(slot: int, worker: int, workers: int) -> int:
    """The train prompt slot ``slot`` of worker ``worker`` answers: unique across workers."""
    return slot * workers + worker


def _stable_int(*parts) -> int:
    """A 63-bit integer from ``parts``, the same in every process (``hash`` is salted)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def group_seed(seed: int, worker: int, slot: int) -> int:
    """The sampling seed of one slot: a regenerated slot draws the same way (same weights)."""
    return _stable_int("sample", seed, worker, slot)


def group_latency_s(options: WorkerOptions, slot: int) -> float:
    """Seconds the slot's group is held back: 0 without latency, else a lognormal draw of
    median ``latency_median_s`` and sigma ``latency_sigma`` seeded by (seed, K, slot)."""
    if options.latency == "none":
        return 0.0
    normal = random.Random(_stable_int("latency", options.seed, options.worker, slot)).gauss(0, 1)
    return options.latency_median_s * math.exp(options.latency_sigma * normal)


def generate_group(engine: HfEngine, options: WorkerOptions, slot: int) -> list[Rollout]:
    """The G rollouts of slot ``slot``'s prompt, sampled and rewarded."""
    task = options.task
    prompt = task.prompt(prompt_index(slot, options.worker, options.workers), "train")
    samples = engine.generate([prompt], options.group_size, task.max_new_tokens,
                              seed=group_seed(options.seed, options.worker, slot))
    name = group_id(options.worker, slot)
    return [Rollout(prompt_ids=numpy.asarray(s.prompt_ids, dtype=numpy.int64),
                    response_ids=numpy.asarray(s.response_ids, dtype=numpy.int64),
                    loss_mask=numpy.ones(len(s.response_ids), dtype=numpy.float32),
                    rollout_logprobs=numpy.asarray(s.logprobs, dtype=numpy.float32),
                    reward=task.reward(s.prompt_ids, s.response_ids),
                    group_id=name, policy_version=engine.version)
            for s in samples]


# ----------------------------------------------------------------------------------------------
# The worker
# ----------------------------------------------------------------------------------------------


@dataclass(order=True)
class _Pending:
    """A generated group waiting for its latency to pass (ordered by due time)."""

    due: float
    slot: int
    latency_s: float = field(compare=False)
    rollouts: list[Rollout] = field(compare=False)


class RolloutWorker:
    """The loop of one worker. ``stop`` (set by a signal handler, or a test) ends it between
    groups: nothing partial is written, pending groups are dropped. ``out``: where the one
    line per written group goes."""

    def __init__(self, options: WorkerOptions, stop: threading.Event | None = None,
                 out: TextIO | None = None) -> None:
        self.options = options
        self.stop = stop or threading.Event()
        self.out = out or sys.stdout
        self.engine: HfEngine | None = None
        os.makedirs(options.spool, exist_ok=True)
        self._claim = claim_worker(options.spool, options.worker)
        self.removed = remove_own_leftovers(options.spool, options.worker)
        self.written = written_slots(options.spool, options.worker)
        self.pending: list[_Pending] = []
        self.written_this_run = 0
        self._cursor = 0  # every slot below it is written or pending
        self.made_by_version: dict[int, int] = {}  # groups generated with each version

    def run(self) -> int:
        """Generate and write groups until ``max_groups`` or ``stop``; the number written."""
        if self.options.sync_groups is None:
            self._run_async()
        else:
            self._run_sync()
        self.pending.clear()  # dropped: their slots are not written, a restart regenerates them
        self._claim.close()  # another process may be this worker now
        return self.written_this_run

    # -- the two modes --------------------------------------------------------------------

    def _run_async(self) -> None:
        while not self._finished():
            if not self._room_for_another():
                self._wait_for_pending()
                continue
            if not self._pick_up_latest():
                return  # stopped while waiting for a first version
            if self._version_spent():  # write what is due, else nap, then look for a version
                self._wait_for_pending() if self.pending else self.stop.wait(self.options.poll_s)
                continue
            self._generate(self._lowest_free_slot())
            self.made_by_version[self.engine.version] = (
                self.made_by_version.get(self.engine.version, 0) + 1)
            self._write_due()

    def _version_spent(self) -> bool:
        """--groups-per-version: this version has made its share; the next must come first
        (the learner consumes about that many per step: more would only go stale)."""
        cap = self.options.groups_per_version
        return cap is not None and self.made_by_version.get(self.engine.version, 0) >= cap

    def _run_sync(self) -> None:
        done_version = None
        while not self._finished():
            self._say_if_waiting(done_version)
            engine = load_latest(self.options.versions, newer_than=done_version, stop=self.stop,
                                 poll_s=self.options.poll_s)
            if engine is None:
                return
            self.engine = engine
            self._write_step(engine.version)
            done_version = engine.version  # the loop ends here if stopped or at max_groups

    def _write_step(self, version: int) -> None:
        """Sync mode: this worker's groups of ``version``'s step, all written before return
        (unless stopped or at max_groups)."""
        for slot in self.options.step_slots(version):
            while not self._room_for_another() and not self._finished():
                self._wait_for_pending()
            if self._finished():
                return
            if slot not in self.written:
                self._generate(slot)
                self._write_due()
        while self.pending and not self._finished():
            self._wait_for_pending()

    # -- pieces ---------------------------------------------------------------------------

    def _finished(self) -> bool:
        if self.stop.is_set():
            return True
        limit = self.options.max_groups
        return limit is not None and self.written_this_run >= limit

    def _room_for_another(self) -> bool:
        """Below the pending cap, and not more groups in flight than max_groups still wants."""
        limit = self.options.max_groups
        in_flight = self.written_this_run + len(self.pending)
        return (len(self.pending) < self.options.max_pending
                and (limit is None or in_flight < limit))

    def _pick_up_latest(self) -> bool:
        """Load ``latest`` if it moved (one readlink when it did not); wait for a first
        version. False when stopped while waiting."""
        if self.engine is not None:
            current = latest_version(self.options.versions)
            if current is None or current == self.engine.version:
                return True
        self._say_if_waiting(None)
        engine = load_latest(self.options.versions, stop=self.stop, poll_s=self.options.poll_s)
        if engine is None:
            return False
        self._drop_withdrawn(engine.version)
        self.engine = engine
        return True

    def _drop_withdrawn(self, newest: int) -> None:
        """``latest`` went back (the trainer resumed from a checkpoint before versions it had
        published, and withdrew them): groups held back by latency that those weights made
        are dropped, their slots made again."""
        kept = [p for p in self.pending if p.rollouts[0].policy_version <= newest]
        if len(kept) < len(self.pending):
            self._say(f"dropped {len(self.pending) - len(kept)} pending groups of versions "
                      f"above v{newest} (withdrawn by the trainer)")
            self.pending = kept
            heapq.heapify(self.pending)
            self._cursor = 0  # their slots are free again

    def _say_if_waiting(self, done_version: int | None) -> None:
        current = latest_version(self.options.versions)
        if current is None or (done_version is not None and current <= done_version):
            newer = "" if done_version is None else f" newer than v{done_version}"
            versions = (complete_versions(self.options.versions)
                        if os.path.isdir(self.options.versions) else [])
            self._say(f"waiting for a version{newer} in {self.options.versions} "
                      f"(latest: {current}, complete: {versions})")

    def _lowest_free_slot(self) -> int:
        pending = {p.slot for p in self.pending}
        while self._cursor in self.written or self._cursor in pending:
            self._cursor += 1
        return self._cursor

    def _generate(self, slot: int) -> None:
        rollouts = generate_group(self.engine, self.options, slot)
        latency = group_latency_s(self.options, slot)
        heapq.heappush(self.pending, _Pending(time.monotonic() + latency, slot, latency,
                                              rollouts))

    def _write_due(self) -> None:
        """Write every pending group whose latency has passed (soonest first)."""
        while self.pending and self.pending[0].due <= time.monotonic() and not self._finished():
            group = heapq.heappop(self.pending)
            write_group(self.options.spool, self.options.worker, group.slot, group.rollouts)
            self.written.add(group.slot)
            self.written_this_run += 1
            reward = sum(r.reward for r in group.rollouts) / len(group.rollouts)
            self._say(f"wrote {group_id(self.options.worker, group.slot)} "
                      f"version={group.rollouts[0].policy_version} reward={reward:.2f} "
                      f"latency={group.latency_s:.1f}s")

    def _wait_for_pending(self) -> None:
        """Sleep until the soonest pending group is due (in short naps, so a stop is seen),
        then write what is due."""
        if self.pending:
            delay = self.pending[0].due - time.monotonic()
            if delay > 0:
                self.stop.wait(min(delay, self.options.poll_s))
        self._write_due()

    def _say(self, message: str) -> None:
        print(f"worker {self.options.worker}: {message}", file=self.out, flush=True)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m glm5_train.rl.rollout_worker",
        description="Sample rollout groups with the newest published weights into a spool.")
    parser.add_argument("--versions", required=True, help="the publisher's directory of versions")
    parser.add_argument("--spool", required=True, help="where group files go")
    parser.add_argument("--worker", type=int, required=True, help="this worker's number K")
    parser.add_argument("--workers", type=int, required=True, help="how many workers W")
    parser.add_argument("--group-size", type=int, required=True, help="rollouts per prompt G")
    add_task_arguments(parser)
    parser.add_argument("--latency", choices=LATENCIES, default="none")
    parser.add_argument("--latency-median-s", type=float, default=1.0)
    parser.add_argument("--latency-sigma", type=float, default=1.0)
    parser.add_argument("--sync-groups", type=int, default=None,
                        help="synchronous RL: groups per step (all workers together)")
    parser.add_argument("--groups-per-version", type=int, default=None,
                        help="asynchronous RL: at most this many groups from one version, "
                             "then wait for the next (more would only go stale)")
    parser.add_argument("--max-groups", type=int, default=None,
                        help="stop after writing this many groups")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="sampling and latency seed")
    return parser


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop``: the loop ends between groups and exits 0."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())


def options_from_args(args: argparse.Namespace) -> WorkerOptions:
    """The options of a parsed command line (ValueError: the first bad one, in one line)."""
    return WorkerOptions(
        versions=args.versions, spool=args.spool, worker=args.worker, workers=args.workers,
        group_size=args.group_size, task=task_from_args(args),
        latency=args.latency, latency_median_s=args.latency_median_s,
        latency_sigma=args.latency_sigma, sync_groups=args.sync_groups,
        groups_per_version=args.groups_per_version, max_groups=args.max_groups,
        seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = options_from_args(args)
        set_threads(args.threads)
        stop = threading.Event()
        worker = RolloutWorker(options, stop)
    except ValueError as err:
        print(f"rollout_worker: {err}", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # a bar per loaded version would bury the group lines
    # Not the load report of every version: the MTP layer (model.layers.<N>) is in the
    # published weights for engines that decode speculatively; transformers' model has none.
    hf_logging.set_verbosity_error()
    stop_on_signals(stop)
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
