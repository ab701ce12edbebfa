"""Rollouts packed into the fixed-length micro-batches the pipeline expects.

Rollouts (prompt + response token ids, exactly as the engine produced them: no re-tokenising)
are laid end to end, in record order, into sequences of ``seq_length`` tokens: a rollout goes
into the current sequence if it fits, else it starts the next one (order is kept, so policy
versions stay in the order the engine wrote them). Each rollout is its own document: the
batch carries the boundaries (``cu_seqlens``: attention never crosses them, as for chat SFT)
and positions restart at every rollout, so each token sees exactly what the engine saw.

Position i of a sequence predicts token i + 1. A rollout with prompt p_0..p_{P-1} and response
y_0..y_{R-1} is trained at positions P - 1 .. P + R - 2 (predicting y_0 .. y_{R-1}), where the
record's loss mask is 1; the per-token fields (``objective.ROLLOUT_FIELDS``) sit at the same
positions. Sample k of the dataset is packed sequence k; global batch g is samples
[g * global_batch_size, (g + 1) * global_batch_size), so the step that trains each rollout, and
the learner's version then, are known before the run starts: a record from the future is
refused up front.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy
import torch

from glm5_train.rl.config import RLConfig
from glm5_train.rl.objective import ROLLOUT_FIELDS
from glm5_train.rl.records import Rollout, check_groups, group_advantages, read_rollouts


class RolloutDataError(ValueError):
    """Rollouts that cannot make the run's batches (one line: the record, the rule, the fix)."""


@dataclass(frozen=True)
class Placement:
    """Where a rollout sits: packed sequence, first position."""

    sequence: int
    offset: int


def rollout_advantages(rollouts: list[Rollout], objective: str,
                       cfg: RLConfig) -> numpy.ndarray:
    """Per-rollout advantage: group-normalised rewards (grpo, dis); 0 for distill, whose
    advantage is per token (teacher minus old policy, formed in the objective)."""
    if objective == "distill":
        return numpy.zeros(len(rollouts))
    check_groups(rollouts, 2)
    return group_advantages(rollouts, divide_by_std=cfg.advantage_std, eps=cfg.advantage_eps)


def pack_rollouts(rollouts: list[Rollout], seq_length: int) -> list[Placement]:
    """Each rollout's place, in order: into the current sequence while it fits."""
    placements, sequence, used = [], 0, 0
    for rollout in rollouts:
        length = len(rollout.prompt_ids) + len(rollout.response_ids)
        if length > seq_length:
            raise RolloutDataError(
                f"{rollout.where}: the rollout has {length} tokens (prompt "
                f"{len(rollout.prompt_ids)} + response {len(rollout.response_ids)}), more than "
                f"train.seq_length={seq_length}: raise train.seq_length to at least {length}, "
                "or leave the record out")
        if used + length > seq_length:
            sequence, used = sequence + 1, 0
        placements.append(Placement(sequence, used))
        used += length
    return placements


class RolloutDataset(torch.utils.data.Dataset):
    """Packed rollout sequences as training samples (see the module docstring)."""

    def __init__(self, rollouts: list[Rollout], seq_length: int, pad: int, objective: str | None,
                 cfg: RLConfig | None) -> None:
        """``objective`` None: packed for scoring only (tools/teacher_logprobs.py): no
        advantages (zeros, no groups needed), no teacher log-probs needed, ``cfg`` unused."""
        if objective == "distill":
            _require_teacher(rollouts)
        self.rollouts, self.seq_length, self.pad = rollouts, seq_length, pad
        self.advantages = (numpy.zeros(len(rollouts)) if objective is None
                           else rollout_advantages(rollouts, objective, cfg))
        self.placements = pack_rollouts(rollouts, seq_length)
        self.members: list[list[int]] = [[] for _ in range(self.num_sequences())]
        for index, place in enumerate(self.placements):
            self.members[place.sequence].append(index)

    def num_sequences(self) -> int:
        return self.placements[-1].sequence + 1 if self.placements else 0

    def __len__(self) -> int:
        return self.num_sequences()

    def rollouts_of(self, first_sample: int, count: int) -> list[int]:
        """Indices of the rollouts in samples [first_sample, first_sample + count)."""
        return [i for s in range(first_sample, min(first_sample + count, len(self)))
                for i in self.members[s]]

    def response_positions(self, index: int) -> slice:
        """The positions of rollout ``index``'s sequence that predict its response tokens
        (position i predicts token i + 1: response token j at offset + prompt - 1 + j)."""
        r, start = self.rollouts[index], self.placements[index].offset
        first = start + len(r.prompt_ids) - 1
        return slice(first, first + len(r.response_ids))

    def __getitem__(self, sample: int) -> dict[str, torch.Tensor]:
        s = self.seq_length
        tokens = numpy.full(s + 1, self.pad, dtype=numpy.int64)
        fields = {name: numpy.zeros(s, dtype=numpy.float32)
                  for name in ("loss_mask", *ROLLOUT_FIELDS) if name != "policy_version"}
        version = numpy.zeros(s, dtype=numpy.int64)
        positions = numpy.arange(s, dtype=numpy.int64)
        bounds = [0]
        for index in self.members[sample]:
            start = self.placements[index].offset
            end = self._place(index, start, tokens, fields, version)
            positions[start:end] = numpy.arange(end - start)
            bounds.append(end)
        if bounds[-1] < s:  # padding: one last segment, trained on nothing
            positions[bounds[-1]:] = numpy.arange(s - bounds[-1])
            bounds.append(s)
        sample_dict = {"tokens": torch.from_numpy(tokens[:s].copy()),
                       "labels": torch.from_numpy(tokens[1:].copy()),
                       "position_ids": torch.from_numpy(positions),
                       "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
                       "policy_version": torch.from_numpy(version)}
        sample_dict.update({name: torch.from_numpy(value) for name, value in fields.items()})
        return sample_dict

    def _place(self, index: int, start: int, tokens: numpy.ndarray, fields: dict,
               version: numpy.ndarray) -> int:
        """Write rollout ``index`` at ``start``; returns its end."""
        r = self.rollouts[index]
        prompt, response = len(r.prompt_ids), len(r.response_ids)
        end = start + prompt + response
        tokens[start:start + prompt] = r.prompt_ids
        tokens[start + prompt:end] = r.response_ids
        at = self.response_positions(index)
        mask = numpy.asarray(r.loss_mask, dtype=numpy.float32)
        fields["loss_mask"][at] = mask
        fields["rollout_logprobs"][at] = r.rollout_logprobs
        fields["advantages"][at] = self.advantages[index]
        if r.teacher_logprobs is not None:
            fields["teacher_logprobs"][at] = r.teacher_logprobs
        trained = numpy.flatnonzero(mask)
        if trained.size:
            fields["rollout_start"][at.start + trained[0]] = 1.0
            fields["token_weight"][at] = 1.0 / trained.size
        version[start:end] = r.policy_version
        return end


def _require_teacher(rollouts: list[Rollout]) -> None:
    for r in rollouts:
        if r.teacher_logprobs is None:
            raise RolloutDataError(
                f"{r.where}: train.objective=distill needs teacher_logprobs in every record "
                "(log pi_teacher of each response token): add them, or use "
                "train.objective=grpo")


def check_schedule(dataset: RolloutDataset, global_batch_size: int, train_iters: int,
                   first_step: int, cfg: RLConfig | None = None) -> None:
    """The records fill every step the run takes; none comes from a later policy than pi_old
    of the step that trains it (the weights at its batch of rollouts' first update: its
    version <= that step's index rounded down to a multiple of rl.updates_per_batch); and
    every step trains some token (not all its rollouts stale, nor all masked)."""
    needed = train_iters * global_batch_size
    if len(dataset) < needed:
        steps = len(dataset) // global_batch_size
        raise RolloutDataError(
            f"the rollout records pack into {len(dataset)} sequences of train.seq_length="
            f"{dataset.seq_length}: {steps} steps of train.global_batch_size="
            f"{global_batch_size}, and train.train_iters={train_iters} needs {needed}: set "
            f"train.train_iters<={steps} or give more records")
    updates = cfg.updates_per_batch if cfg is not None else 1
    lag = cfg.max_policy_lag if cfg is not None else None
    for step in range(first_step, train_iters):
        indices = dataset.rollouts_of(step * global_batch_size, global_batch_size)
        old = step - step % updates  # pi_old's version: the batch of rollouts' first update
        for index in indices:
            r = dataset.rollouts[index]
            if r.policy_version > old:
                raise RolloutDataError(
                    f"{r.where}: policy_version={r.policy_version} is from the future: step "
                    f"{step + 1} trains it against pi_old of version {old} (the optimizer "
                    "steps taken before its batch of rollouts): a rollout's version must not "
                    "exceed it; fix the record's version or its place in the file")
        _require_trained_tokens(dataset, indices, step, lag)


def _require_trained_tokens(dataset: RolloutDataset, indices: list[int], step: int,
                            lag: int | None) -> None:
    """A step whose rollouts are all stale or all masked trains nothing: megatron-core would
    divide by no token and the optimizer still step (weight decay, momentum)."""
    kept = sum(float(dataset.rollouts[i].loss_mask.sum()) for i in indices
               if lag is None or step - dataset.rollouts[i].policy_version <= lag)
    if kept == 0:
        raise RolloutDataError(
            f"step {step + 1} would train no token: its {len(indices)} rollouts are all more "
            f"than rl.max_policy_lag={lag} steps behind the learner (version {step}) or have "
            "an all-zero loss_mask; raise rl.max_policy_lag, or give that step fresher "
            "rollouts")


def step_summary(dataset: RolloutDataset, step: int, global_batch_size: int) -> dict:
    """Rewards of step ``step``'s rollouts (0-based): mean, and mean per group."""
    indices = dataset.rollouts_of(step * global_batch_size, global_batch_size)
    groups: dict[str, list[float]] = {}
    for index in indices:
        r = dataset.rollouts[index]
        groups.setdefault(r.group_id, []).append(r.reward)
    rewards = [x for values in groups.values() for x in values]
    return {"reward_mean": float(numpy.mean(rewards)) if rewards else float("nan"),
            "reward_by_group": {g: float(numpy.mean(v)) for g, v in groups.items()},
            "rollouts": len(indices)}


def build_rollout_dataset(job) -> RolloutDataset:
    """The job's rollout records (``data.paths``) read, checked and packed; refuses, in one
    line, a bad record, a group GRPO cannot use, a rollout longer than a sequence, records
    too few for the run, a record from the future. ``job``: the JobConfig. A rank checks the
    job (``validate_job``) and then builds it: the second call of the same job on the same
    files reuses the first's dataset (reading large records is seconds per file)."""
    t = job.train
    key = (_files_key(list(job.data.paths)), job.model.vocab_size, t.seq_length, t.objective,
           repr(job.rl), t.global_batch_size, t.train_iters)
    if _LAST_BUILT.get("key") != key:
        rollouts = read_rollouts(list(job.data.paths), vocab_size=job.model.vocab_size)
        # train.objective=lm: supervised on the records' responses (their loss masks), no
        # groups, advantages or staleness.
        objective = None if t.objective == "lm" else t.objective
        dataset = RolloutDataset(rollouts, t.seq_length, PAD_ID, objective, job.rl)
        check_schedule(dataset, t.global_batch_size, t.train_iters, first_step=0,
                       cfg=job.rl if objective else None)
        _LAST_BUILT.update(key=key, dataset=dataset)
    return _LAST_BUILT["dataset"]


_LAST_BUILT: dict = {}


def _files_key(paths: list[str]) -> tuple:
    """The files as they are now: path, inode, size, modification and change times."""
    stats = [os.stat(p) if os.path.exists(p) else None for p in paths]
    return tuple((p, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) if s else (p, None)
                 for p, s in zip(paths, stats))


# The id that fills a sequence after its last rollout: never attended to by a rollout (it is a
# document of its own) nor trained on.
PAD_ID = 0


def freeze_mtp(chunks: list) -> None:
    """The MTP layers kept as they are (no gradient, no update: the engines' speculative
    decoding keeps using them). Call before wrapping in DDP, which takes only parameters that
    need gradients."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name.startswith("mtp.") or ".mtp." in name:
                param.requires_grad_(False)
