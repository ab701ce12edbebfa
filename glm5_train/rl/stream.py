"""Rollouts read as they arrive: the learner side of asynchronous RL.

``data.paths=[<spool directory>]`` (one directory instead of record files) makes the trainer
read rollout groups from a spool that rollout engines fill while it trains
(``glm5_train.rl.rollout_worker``, or any engine that keeps the contract):

- one file per group, ``<name>.jsonl`` (records of schema v1, ``records.py``), made visible
  complete by a rename; names starting with ``.`` (files being written) are not read;
- files are never changed once visible; arrival order is the order of their modification
  times (ties: by name).

Before each step, rank 0 decides the step's groups and every rank receives the decision
(one broadcast), then reads those files and packs them as ``RolloutDataset`` does:

1. groups not consumed yet are taken in arrival order, whatever policy version made them: the
   step never waits for a full batch of one version;
2. a group more than ``rl.max_policy_lag`` versions behind the learner is dropped whole
   (consumed, never trained: it will only get staler); a group from a version newer than the
   learner (made from weights that a resumed run withdrew: they are not in its history) is
   dropped the same way;
3. groups are taken while they fit the step's ``train.global_batch_size`` sequences of
   ``train.seq_length`` tokens (and at most ``rl.stream_max_groups``), stopping at the first
   that does not (it starts the next step: order is kept);
4. the step starts once at least ``rl.stream_min_groups`` groups are taken or the step is
   full; meanwhile rank 0 polls every ``rl.stream_poll_s``, and gives up with a one-line error
   after ``rl.stream_wait_s`` without one. A stop signal while waiting stops the run like a
   stop after a step (save, exit 0).

Sequences of the step the groups do not fill are padding: they train no token.

The ledger: with ``checkpoint.save`` set, each decision is written (atomically, before the
step runs) to ``<checkpoint.save>/rollout_ledger/step_<N>.json`` ({"step", "learner_version",
"trained": [files], "dropped_stale": [...], "dropped_future": [...], "wait_s"}). A resumed
run's consumed groups are those of the ledger's steps up to its checkpoint; the entries of
later steps (trained by the stopped attempt, but not in any checkpoint) are removed, so their
groups are read again: across kills and resumes, every group the engines wrote is trained
once in the run's surviving history or dropped as stale, never twice, none lost.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from glm5_train.rl.records import Rollout, read_rollouts
from glm5_train.rl.rollout_data import PAD_ID, RolloutDataError, RolloutDataset, pack_rollouts
from parallel.comm_purpose import collective_purpose
from parallel.device import comm_device

LEDGER_DIR = "rollout_ledger"
WITHDRAWN = ".withdrawn-"  # prefix of a group set aside at resume (made by withdrawn weights)
_LEDGER_FILE = re.compile(r"^step_(\d+)\.json$")


class RolloutStreamError(RuntimeError):
    """The stream cannot feed the step (one line: what, why, the fix); raised on every rank."""


def is_spool(paths: list[str]) -> bool:
    """``data.paths`` names a spool directory (streamed RL), not record files."""
    return len(paths) == 1 and os.path.isdir(paths[0])


def check_spool_config(job) -> None:
    """What streaming needs of the job (ValueError: the value, the rule, the fix)."""
    paths, rl = list(job.data.paths), job.rl
    if any(os.path.isdir(p) for p in paths) and len(paths) > 1:
        raise ValueError(f"data.paths={paths}: a spool directory is read alone (streamed "
                         "rollouts); give one directory, or record files only")
    if job.train.objective == "lm":
        raise ValueError(f"data.paths=[{paths[0]}] is a spool directory, read as rollouts "
                         "arrive, with train.objective=lm: supervised training reads record "
                         "files; give .jsonl/.parquet files, or set train.objective=grpo")
    ckpt = job.checkpoint
    if not ckpt.save:
        raise ValueError(f"data.paths=[{paths[0]}] is a spool directory and checkpoint.save is "
                         "null: the ledger of the groups each step consumed lives beside the "
                         "checkpoints (a resumed run must not train a group twice); set "
                         "checkpoint.save=<directory>")
    if ckpt.load not in ("auto", ckpt.save):
        raise ValueError(f"checkpoint.load={ckpt.load} with a spool directory: the rollout "
                         f"ledger is the one in checkpoint.save={ckpt.save}, so the run must "
                         "resume from there; set checkpoint.load=auto (a new stage from other "
                         "weights: checkpoint.pretrained=<directory>)")
    if job.data.num_workers:
        raise ValueError(f"data.num_workers={job.data.num_workers} with a spool directory: the "
                         "step's groups are decided as it starts, in this process; set "
                         "data.num_workers=0")
    if rl.updates_per_batch != 1:
        raise ValueError(f"rl.updates_per_batch={rl.updates_per_batch} with a spool directory: "
                         "each streamed step trains the groups ready then, once; set "
                         "rl.updates_per_batch=1")
    if rl.stream_min_groups < 1:
        raise ValueError(f"rl.stream_min_groups={rl.stream_min_groups} must be >= 1")
    if rl.stream_max_groups is not None and rl.stream_max_groups < rl.stream_min_groups:
        raise ValueError(f"rl.stream_max_groups={rl.stream_max_groups} must be >= "
                         f"rl.stream_min_groups={rl.stream_min_groups}, or null")
    if not rl.stream_wait_s > 0 or not rl.stream_poll_s > 0:
        raise ValueError(f"rl.stream_wait_s={rl.stream_wait_s} and rl.stream_poll_s="
                         f"{rl.stream_poll_s} must be > 0")


@dataclass
class StepGroups:
    """Rank 0's decision for one step, as every rank receives it."""

    step: int  # 1-based, as the metrics' "step"
    learner_version: int
    trained: list[str] = field(default_factory=list)
    dropped_stale: list[str] = field(default_factory=list)
    dropped_future: list[str] = field(default_factory=list)
    wait_s: float = 0.0
    stop: bool = False  # a stop signal came while waiting: save and exit
    error: str | None = None

    def consumed(self) -> list[str]:
        return [*self.trained, *self.dropped_stale, *self.dropped_future]


class StreamedRollouts(torch.utils.data.Dataset):
    """The run's samples, step by step from the spool (see the module docstring). Global
    sample ``step * global_batch_size + i`` is sequence ``i`` of ``step``'s packing: the
    iterators and ``step_summary`` index it as they index ``RolloutDataset``."""

    def __init__(self, job) -> None:
        t = job.train
        self.spool = job.data.paths[0]
        self.rl, self.objective = job.rl, t.objective
        self.seq_length, self.batch = t.seq_length, t.global_batch_size
        self.train_iters, self.vocab_size = t.train_iters, job.model.vocab_size
        self.ledger = (os.path.join(job.checkpoint.save, LEDGER_DIR) if job.checkpoint.save
                       else None)
        self.consumed: set[str] = set()
        self._groups: dict[str, list[Rollout]] = {}  # read once: files never change
        self.current = RolloutDataset([], self.seq_length, PAD_ID, self.objective, self.rl)
        self.current_step = -1

    # -- the dataset seen by the iterators ------------------------------------------------

    def __len__(self) -> int:
        return self.train_iters * self.batch

    def __getitem__(self, sample: int) -> dict[str, torch.Tensor]:
        return self.current[self._local(sample)]

    @property
    def rollouts(self) -> list[Rollout]:
        return self.current.rollouts

    def rollouts_of(self, first_sample: int, count: int) -> list[int]:
        return self.current.rollouts_of(self._local(first_sample), count)

    def _local(self, sample: int) -> int:
        step, local = divmod(sample, self.batch)
        if step != self.current_step:
            raise RuntimeError(f"sample {sample} is of step {step + 1}, and the stream holds "
                               f"step {self.current_step + 1}: prepare_step first")
        return local

    # -- resuming -------------------------------------------------------------------------

    @collective_purpose("rollout_stream")
    def resume(self, iteration: int, group) -> None:
        """Before the first step (and before the run publishes its first version): the
        groups consumed by the steps up to ``iteration`` (the checkpoint's) are those of the
        ledger's entries up to it; later entries are removed so their groups are read again;
        groups not consumed yet that were made by a version above ``iteration`` (weights of
        the stopped attempt, which this run withdraws) are set aside, renamed
        ``.withdrawn-<name>``: a worker makes their slots again from this run's weights.
        Collective; a failure on rank 0 is raised on every rank."""
        outcome = [None, []]
        if dist.get_rank(group) == 0:
            try:
                outcome[1] = self._read_ledger(iteration)
                withdrawn = self._set_aside_withdrawn(iteration, set(outcome[1]))
                if withdrawn:
                    print(f"rl: set aside {len(withdrawn)} rollout groups made by versions "
                          f"above {iteration} (weights the stopped attempt had and this run "
                          f"withdraws): {self.spool}/.withdrawn-*", flush=True)
            except Exception as err:  # noqa: BLE001 (one agreed error, not a hang)
                outcome[0] = f"reading the rollout ledger {self.ledger}: {one_line(err)}"
        dist.broadcast_object_list(outcome, src=_global_rank0(group), group=group)
        if outcome[0] is not None:
            raise RolloutStreamError(outcome[0])
        self.consumed = set(outcome[1])

    def _read_ledger(self, iteration: int) -> list[str]:
        consumed: set[str] = set()
        if not self.ledger:
            return []
        os.makedirs(self.ledger, exist_ok=True)
        for name in sorted(os.listdir(self.ledger)):
            match = _LEDGER_FILE.match(name)
            if not match:
                continue
            path = os.path.join(self.ledger, name)
            if int(match.group(1)) > iteration:
                os.remove(path)
            else:
                with open(path) as handle:
                    consumed.update(StepGroups(**json.load(handle)).consumed())
        return sorted(consumed)

    def _set_aside_withdrawn(self, iteration: int, consumed: set[str]) -> list[str]:
        self.consumed = consumed
        withdrawn = [name for name in self._ready()
                     if max(r.policy_version for r in self._read(name)) > iteration]
        for name in withdrawn:
            os.replace(os.path.join(self.spool, name),
                       os.path.join(self.spool, f"{WITHDRAWN}{name}"))
            self._groups.pop(name, None)
        return withdrawn

    # -- one step -------------------------------------------------------------------------

    @collective_purpose("rollout_stream")
    def prepare_step(self, step_index: int, group, stop=None) -> StepGroups:
        """Decide (rank 0), share and pack step ``step_index``'s groups (0-based: the
        learner's version). Collective over ``group``: while rank 0 waits for groups, every
        rank takes part in one small all-reduce per poll (ready, a stop signal on any rank),
        so no rank sits in one collective for minutes (NCCL's watchdog would abort it) and a
        stop signal reaching any rank is seen. ``stop``: a StopRequest."""
        started, decision = time.monotonic(), [None]
        while True:
            if dist.get_rank(group) == 0:
                decision[0] = self._try_decide(step_index, started)
            flags = torch.tensor([float(decision[0] is not None),
                                  float(bool(stop is not None and stop.received))],
                                 device=comm_device())
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            if flags[0] > 0:
                break
            if flags[1] > 0:
                return StepGroups(step_index + 1, step_index, stop=True)
            time.sleep(self.rl.stream_poll_s)
        dist.broadcast_object_list(decision, src=_global_rank0(group), group=group)
        groups: StepGroups = decision[0]
        if groups.error is not None:
            raise RolloutStreamError(groups.error)
        self.consumed.update(groups.consumed())
        self._pack(step_index, groups)
        return groups

    def _pack(self, step_index: int, groups: StepGroups) -> None:
        """Every rank packs the same groups: a refusal (a group GRPO cannot use, a missing
        teacher log-prob) is raised by all of them alike, one agreed error."""
        rollouts = [r for name in groups.trained for r in self._read(name)]
        try:
            dataset = RolloutDataset(rollouts, self.seq_length, PAD_ID, self.objective, self.rl)
        except RolloutDataError as err:
            raise RolloutStreamError(f"step {groups.step}: {err}") from None
        dataset.members += [[] for _ in range(self.batch - len(dataset.members))]
        self.current, self.current_step = dataset, step_index
        for name in groups.consumed():  # never read again
            self._groups.pop(name, None)

    def _try_decide(self, step_index: int, started: float) -> StepGroups | None:
        """Rank 0: the step's groups if it can start now (written to the ledger), an error
        decision past rl.stream_wait_s or on any failure, else None (poll again)."""
        try:
            groups, full = self._select(step_index)
            if len(groups.trained) >= self.rl.stream_min_groups or full:
                groups.wait_s = time.monotonic() - started
                self._write_ledger(groups)
                return groups
            if time.monotonic() - started > self.rl.stream_wait_s:
                raise RolloutStreamError(
                    f"step {step_index + 1} waited rl.stream_wait_s={self.rl.stream_wait_s} s "
                    f"for rl.stream_min_groups={self.rl.stream_min_groups} fresh groups in "
                    f"{self.spool} and has {len(groups.trained)}: are the rollout engines "
                    "running and writing there? (python -m launch.rl starts them)")
            return None
        except Exception as err:  # noqa: BLE001 (one agreed error on every rank, not a hang)
            return StepGroups(step_index + 1, step_index, error=one_line(err))

    def _select(self, step_index: int) -> tuple[StepGroups, bool]:
        """One pass over the ready groups (rules 1-3 of the module docstring); True with it:
        the step is full (the cap reached, or a ready group left for the next step)."""
        groups = StepGroups(step_index + 1, step_index)
        lag, cap = self.rl.max_policy_lag, self.rl.stream_max_groups
        taken: list[Rollout] = []
        for name in self._ready():
            if cap is not None and len(groups.trained) >= cap:
                return groups, True  # later groups are judged by later steps
            rollouts = self._read(name)
            if max(r.policy_version for r in rollouts) > step_index:
                groups.dropped_future.append(name)
            elif lag is not None and step_index - min(r.policy_version for r in rollouts) > lag:
                groups.dropped_stale.append(name)
            elif self._fits(taken + rollouts):
                groups.trained.append(name)
                taken += rollouts
            else:
                return groups, True
        return groups, cap is not None and len(groups.trained) >= cap

    def _fits(self, rollouts: list[Rollout]) -> bool:
        placements = pack_rollouts(rollouts, self.seq_length)
        return not placements or placements[-1].sequence < self.batch

    def _ready(self) -> list[str]:
        """Visible group files not consumed yet, in arrival order."""
        entries = []
        with os.scandir(self.spool) as scan:
            for entry in scan:
                if (entry.name.startswith(".") or not entry.name.endswith((".jsonl", ".parquet"))
                        or entry.name in self.consumed):
                    continue
                entries.append((entry.stat().st_mtime_ns, entry.name))
        return [name for _, name in sorted(entries)]

    def _read(self, name: str) -> list[Rollout]:
        if name not in self._groups:
            rollouts = read_rollouts([os.path.join(self.spool, name)],
                                     vocab_size=self.vocab_size)
            if not rollouts:
                raise RolloutStreamError(f"{os.path.join(self.spool, name)} holds no record: "
                                         "a spool file is one group of rollouts")
            if not self._fits(rollouts):
                raise RolloutStreamError(
                    f"{os.path.join(self.spool, name)}: its group does not fit one step "
                    f"(train.global_batch_size={self.batch} sequences of train.seq_length="
                    f"{self.seq_length}); raise them, or write smaller groups")
            self._groups[name] = rollouts
        return self._groups[name]

    def _write_ledger(self, groups: StepGroups) -> None:
        if not self.ledger:
            return
        os.makedirs(self.ledger, exist_ok=True)
        path = os.path.join(self.ledger, f"step_{groups.step:07d}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w") as handle:
            json.dump(groups.__dict__, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)

    def step_record(self, groups: StepGroups) -> dict:
        """The step's stream figures for its metrics record."""
        lags: dict[str, int] = {}
        for r in self.current.rollouts:
            key = str(groups.learner_version - r.policy_version)
            lags[key] = lags.get(key, 0) + 1
        return {"stream_groups": len(groups.trained),
                "stream_dropped_stale": len(groups.dropped_stale),
                "stream_dropped_future": len(groups.dropped_future),
                "stream_wait_s": round(groups.wait_s, 3),
                "stream_lag_hist": dict(sorted(lags.items(), key=lambda kv: int(kv[0])))}


def read_ledger(checkpoint_root: str) -> dict[int, StepGroups]:
    """The rollout ledger beside a run's checkpoints, by step (for tools and tests)."""
    root, entries = os.path.join(checkpoint_root, LEDGER_DIR), {}
    for name in os.listdir(root):
        if _LEDGER_FILE.match(name):
            with open(os.path.join(root, name)) as handle:
                entry = StepGroups(**json.load(handle))
            entries[entry.step] = entry
    return entries


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _global_rank0(group) -> int:
    return dist.get_global_rank(group, 0) if group is not None else 0
