"""Checkpoints with megatron-core's dist_checkpointing (``torch_dist`` format).

Layout of ``checkpoint.save``::

    <save>/iter_0000010/          one distributed checkpoint per saved step (+ its manifest)
    <save>/latest_iteration.txt   the newest complete one, written last

A checkpoint is written under ``iter_*.partial``, fsynced by every rank and committed by rank 0
(``glm5_train.checkpoint_store``: manifest, rename, ``latest`` last, then the old ones beyond
``checkpoint.keep_last`` removed), so a run killed at any instant of a save keeps the previous
checkpoint loadable. Each rank hashes the files it wrote as it fsyncs them; the manifest records
every file's size and sha256. A torn or corrupted checkpoint is detected at load (every rank
hashing a share of its files) and the previous one used. Model chunks are stored under global
tensor keys, so a checkpoint loads into any TP/PP/VPP/EP layout.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from glm5_train import checkpoint_store
from glm5_train.checkpoint_store import LATEST
from glm5_train.model.config import TRAINING_FIELDS, GLM5Config
from glm5_train.schedules import final_lr
from parallel import distopt_checkpoint, mcore_compat
from parallel.comm_purpose import collective_purpose
from parallel.distopt_slices import parameters_gathered
from parallel.muon import MuonAdamW

AUTO = "auto"  # checkpoint.load: resume from checkpoint.save's newest complete checkpoint


class NoCheckpointError(FileNotFoundError):
    """No complete checkpoint where one is required (raised on every rank alike)."""


class CheckpointUnfitError(NoCheckpointError):
    """A checkpoint this run cannot continue from (raised on every rank alike)."""


@dataclass
class CheckpointConfig:
    save: str | None = None
    save_interval: int | None = None  # steps; the last step is always saved
    # Also save once this many minutes have passed since the last save (or the start); rank 0's
    # clock decides, all ranks agree at a step boundary. null: by steps only.
    save_interval_minutes: float | None = 60.0
    # "auto": the newest complete checkpoint under ``save`` (none there: start at step 0);
    # a directory: its newest complete checkpoint (an error if none); null: start at step 0.
    load: str | None = AUTO
    keep_last: int | None = 2  # complete checkpoints kept in ``save``; null: all
    # false: take weights, step count, data position and LR schedule but start the optimizer
    # state fresh (needed when the optimizer's structure changed, e.g. EP=1 <-> EP>1).
    load_optimizer: bool = True
    # Weights to start from when there is no checkpoint to resume (``load`` finds none, or is
    # null): a new stage (SFT after pre-training, RL after SFT) from another run's checkpoint,
    # at step 0 with this run's own schedule, counting its own samples and tokens. A restart of
    # this run resumes from its own checkpoints instead. null: the seed's initial weights.
    pretrained: str | None = None
    # The pretrained run's optimizer state too: auto, when it is of this run's kind (same
    # train.optimizer and distributed-ness; a fresh state, with a notice, otherwise); true:
    # required; false: a fresh state.
    pretrained_optimizer: bool | str = AUTO


@dataclass
class TrainState:
    """What a resumed run needs besides weights and optimizer state."""

    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0


def iteration_dir(root: str, iteration: int) -> str:
    return checkpoint_store.iteration_dir(root, iteration)


def latest_iteration(root: str) -> int | None:
    """The iteration ``latest_iteration.txt`` names (None: none), not yet verified."""
    return checkpoint_store.read_latest(root)[0]


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


def _model_sharded(chunks: list) -> dict[str, Any]:
    return {f"chunk{i}": _unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def _sharded_state(chunks, optimizer, scheduler, state: TrainState, model_cfg: GLM5Config,
                   is_loading: bool) -> dict[str, Any]:
    model_sd = _model_sharded(chunks)
    sharded = {"model": model_sd, "train_state": dataclasses.asdict(state),
               "model_config": dataclasses.asdict(model_cfg)}
    if scheduler is None and optimizer is None:  # weights only (e.g. imported from HF)
        return {**sharded, "weights_only": True}
    if scheduler is not None:  # None: a new stage takes the optimizer state alone
        sharded["scheduler"] = scheduler.state_dict()
    if scheduler is not None and not is_loading:
        # Where the schedule stands (the learning rate of the next step): a next stage may
        # start there (train.lr_from_pretrained); megatron's state leaves out WSD's fields.
        sharded["schedule_lr"] = scheduler.get_lr({})
    if optimizer is not None:
        sharded["optimizer"] = _optimizer_sharded(optimizer, model_sd, is_loading)
        sharded["optimizer_parts"] = _optimizer_parts(optimizer)
        sharded["optimizer_kind"] = optimizer_kind(optimizer)
        if not is_loading:  # which parameters the state is of (a later stage may train others)
            sharded["trained_parameters"] = trained_parameters(chunks)
    return sharded


def _optimizer_sharded(optimizer, model_sd: dict, is_loading: bool) -> dict:
    """The optimizer's state, mapped to the model's sharded tensors (by walking the nested
    model dict). The distributed optimizer (ZeRO-1, distributed Muon, Pipeline ZeRO2): ours,
    in model space (``parallel/distopt_checkpoint.py``; megatron-core's own does not resume
    with torch's Adam and has no place for distributed Muon's state). Plain DDP (AdamW or Muon
    inside megatron-core's wrappers): megatron-core's."""
    if distopt_checkpoint.is_distributed(optimizer):
        return distopt_checkpoint.sharded_state(optimizer, model_sd, is_loading)
    return optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading,
        metadata={"distrib_optim_sharding_type": "fully_reshardable"})


def optimizer_kind(optimizer) -> dict[str, Any]:
    """What the optimizer state is the state of; a checkpoint's must match to be restored."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return {"muon": any(isinstance(getattr(s, "optimizer", None), MuonAdamW) for s in subs),
            "distributed": distopt_checkpoint.is_distributed(optimizer)}


def _optimizer_parts(optimizer) -> int:
    """megatron-core splits dense and expert-parallel parameters into separate optimizers
    (only when EP > 1); their state keys differ, so the count must match to restore it."""
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


@collective_purpose("checkpoint")
def save_checkpoint(root: str, chunks, optimizer, scheduler, state: TrainState,
                    model_cfg: GLM5Config, keep_last: int | None = 2) -> str:
    """Write a complete checkpoint for ``state.iteration`` durably; returns its directory.
    Collective: every rank calls it. ``keep_last``: complete checkpoints kept (None: all).

    With ``optimizer=None`` only the weights are written (a starting point, such as an HF
    import): loading it starts training at step 0 with a fresh optimizer."""
    rank = dist.get_rank()
    staging = checkpoint_store.staging_dir(root, state.iteration)
    if rank == 0:
        checkpoint_store.prepare_staging(root, state.iteration)
    dist.barrier()
    with parameters_gathered(chunks):  # the step's weights, not the gather it left pending
        sharded = _sharded_state(chunks, optimizer, scheduler, state, model_cfg,
                                 is_loading=False)
        mcore_compat.in_process_checkpoint_results_queue()
        dist_checkpointing.save(sharded, staging)
    # Each rank hashes and syncs what it wrote, while it is still in its page cache: on a
    # shared file system only the writer's client can flush its data, and nobody re-reads it.
    sealed = checkpoint_store.seal_files(staging, lambda name: _written_by(name, rank))
    # megatron-core's save spans every rank (the default group): so does the manifest.
    sealed = _gather_sealed(sealed, dist.group.WORLD)
    failure = [None]
    if rank == 0:
        try:
            checkpoint_store.commit(root, state.iteration, keep_last, sealed)
        except OSError as err:  # every rank must stop, not wait on rank 0 forever
            failure = [f"committing checkpoint {staging} failed: {err}"]
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise OSError(failure[0])
    return iteration_dir(root, state.iteration)


# megatron-core's torch_dist writer: rank r writes "__<r>_<i>.distcp"; rank 0 (its coordinator)
# writes everything else (.metadata, common.pt, metadata.json).
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def _written_by(name: str, rank: int) -> bool:
    match = _RANK_FILE.match(name)
    return int(match.group(1)) == rank if match else rank == 0


@collective_purpose("checkpoint")
def _gather_sealed(sealed: dict[str, dict], group) -> dict[str, dict] | None:
    """Every rank's ``seal_files`` entries, merged on the group's first rank (which commits);
    None elsewhere. Also the barrier before the commit: every file is written and synced."""
    if dist.get_world_size(group) == 1:
        return sealed
    first = dist.get_global_rank(group, 0)
    gathered = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    dist.gather_object(sealed, gathered, dst=first, group=group)
    if gathered is None:
        return None
    merged: dict[str, dict] = {}
    for entries in gathered:
        merged.update(entries)
    return merged


def choose_checkpoint(root: str, required: bool = True) -> str | None:
    """The directory of the newest complete checkpoint under ``root``, the same on every rank.
    Rank 0 picks the newest whose files have their sizes; every rank hashes a share of its
    files (the checkpoint is read once, spread over the job, not all by rank 0); a digest
    mismatch sends rank 0 to the next older one, with the reason. Rank 0 says which it loads
    and why it passed over newer ones. None when ``root`` holds no checkpoint at all and
    ``required`` is false."""
    group = dist.group.WORLD if dist.is_initialized() else None
    rejected: dict[str, str] = {}  # refused by their content, for rank 0's next choice
    while True:
        path, error, lines = _broadcast_from_first(
            lambda: _choose_on_this_rank(root, required, rejected), group)
        if error is not None:
            raise NoCheckpointError(error)
        problem = None if path is None else _check_content(path, group)
        if problem is None:
            if group is None or dist.get_rank() == 0:
                for line in lines:
                    print(line, file=sys.stderr, flush=True)
            return path
        rejected[path] = problem  # every rank adds the same: only rank 0 reads it


@collective_purpose("checkpoint")
def _broadcast_from_first(compute, group):
    """``compute()`` on the group's first rank, its value on every rank."""
    if group is None:
        return compute()
    first = dist.get_global_rank(group, 0)
    answer = [compute() if dist.get_rank() == first else None]
    if dist.get_world_size(group) > 1:
        dist.broadcast_object_list(answer, src=first, group=group)
    return answer[0]


@collective_purpose("checkpoint")
def _check_content(path: str, group) -> str | None:
    """Hash this rank's share of the checkpoint's files against the manifest's digests; the
    first mismatch any rank found (by file name), the same on every rank, or None."""
    part, parts = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    manifest, mine = checkpoint_store.read_manifest(path)
    if manifest is not None:  # None: gone since rank 0 read it; the gather must still happen
        mine = checkpoint_store.check_content(path, manifest, part, parts)
    if parts == 1:
        return mine
    found = [None] * parts
    dist.all_gather_object(found, mine, group=group)
    return min((p for p in found if p is not None), default=None)


def _choose_on_this_rank(root: str, required: bool, rejected: dict[str, str]
                         ) -> tuple[str | None, str | None, list[str]]:
    """(directory or None, error or None, the lines to print once it is loaded: the choice,
    the notes behind it, a notice for a manifest without digests). Sizes only: the content
    is checked by every rank."""
    choice = checkpoint_store.choose(root, content=False, rejected=rejected)
    if choice.path is not None:
        note = f" ({choice.describe()})" if choice.notes else ""
        lines = [f"checkpoint: loading {choice.path}{note}"]
        return choice.path, None, lines + ([choice.notice] if choice.notice else [])
    if choice.present:
        return None, (f"{root} holds no complete checkpoint ({choice.describe()}): point "
                      "checkpoint.load at another directory, or set checkpoint.load=null to "
                      "start at step 0"), []
    if required:
        return None, (f"checkpoint.load={root!r} holds no {LATEST} and no checkpoint: point it "
                      "at a directory written by checkpoint.save, or set checkpoint.load=null "
                      "to start from scratch"), []
    return None, None, [f"checkpoint: no checkpoint in {root} yet: starting at step 0"]


def load_checkpoint(root: str, chunks, optimizer, scheduler, model_cfg: GLM5Config,
                    load_optimizer: bool = True, required: bool = True,
                    chosen: str | None = None,
                    peak_from_checkpoint: bool = False) -> TrainState | None:
    """Load the newest complete checkpoint under ``root`` into this layout (a torn newest one
    is passed over). ``required=False``: None when ``root`` holds no checkpoint at all.
    ``chosen``: the checkpoint ``choose_checkpoint`` already picked under ``root``.
    ``peak_from_checkpoint``: the saved peak learning rate is expected to differ from
    ``train.lr`` (``train.lr_from_pretrained``): no notice for it."""
    path = chosen or choose_checkpoint(root, required)
    if path is None:
        return None
    bounds = (group_bounds(optimizer, scheduler)
              if optimizer is not None and scheduler is not None else None)
    check_model_config(path, model_cfg)
    weights_only = is_weights_only(path)
    restores_optimizer = optimizer is not None and load_optimizer and not weights_only
    if weights_only:
        scheduler = None
    if restores_optimizer:
        _check_optimizer_matches(path, optimizer)
    if scheduler is not None:
        _say_when_the_saved_schedule_differs(path, scheduler,
                                             ignore=("max_lr",) if peak_from_checkpoint else ())
    sharded = _sharded_state(chunks, optimizer if restores_optimizer else None, scheduler,
                             TrainState(), model_cfg, is_loading=True)
    loaded = dist_checkpointing.load(sharded, path)
    for i, chunk in enumerate(chunks):
        _unwrap(chunk).load_state_dict(loaded["model"][f"chunk{i}"])
    if restores_optimizer:
        _load_optimizer(optimizer, loaded["optimizer"])
    elif optimizer is not None:
        # A fresh optimizer state on the loaded weights: bf16 models' fp32 masters were copied
        # from the initial weights when the optimizer was built; they must follow the load.
        optimizer.reload_model_params()
    if scheduler is None:
        return TrainState()
    scheduler.load_state_dict(loaded["scheduler"])
    if bounds is not None:  # the saved bounds rule the param groups too (the distributed
        follow_scheduler(optimizer, scheduler, bounds)  # optimizer's state has none of them)
    return TrainState(**loaded["train_state"])


def _load_optimizer(optimizer, state: dict) -> None:
    if distopt_checkpoint.is_distributed(optimizer):
        distopt_checkpoint.load_state(optimizer, state)
    else:
        optimizer.load_state_dict(state)


# megatron-core's scheduler state (every field its load_state_dict compares) -> the train.* key
# that sets it. The decay's length is train.lr_decay_iters, or train.train_iters when that is
# null: wd_incr_steps holds it as given, lr_decay_steps at least warm-up + 1 (optim.py).
_SCHEDULE_KEYS = {"max_lr": "train.lr", "min_lr": "train.min_lr",
                  "lr_warmup_steps": "train.warmup_iters", "lr_decay_steps": "train.lr_decay_iters",
                  "wd_incr_steps": "train.lr_decay_iters", "start_wd": "train.weight_decay",
                  "end_wd": "train.weight_decay"}


def _say_when_the_saved_schedule_differs(path: str, scheduler, ignore: tuple = ()) -> None:
    """megatron-core's scheduler (use_checkpoint_opt_param_scheduler, its default) continues
    the schedule the checkpoint saved, whatever this run's config says: a run extended from
    100 to 200 steps with train.lr_decay_iters=null keeps decaying over 100 (then stays at
    train.min_lr). That is the intended resume, but silent; say it on rank 0, once, with the
    train.* values that make the config say what runs."""
    saved = dist_checkpointing.load_common_state_dict(path).get("scheduler") or {}
    ours = scheduler.state_dict()
    differ = [key for key in _SCHEDULE_KEYS
              if key in saved and saved[key] != ours[key] and key not in ignore]
    if not differ or (dist.is_initialized() and dist.get_rank() != 0):
        return
    listed = ", ".join(f"{key} ({_SCHEDULE_KEYS[key]}) {saved[key]} there, {ours[key]} in "
                       "this config" for key in differ)
    settings = {_SCHEDULE_KEYS[key]: _saved_setting(saved, key) for key in differ}
    print(f"checkpoint: continuing the saved learning-rate schedule ({listed}); to make the "
          "config say what runs, pass "
          + " ".join(f"{name}={value}" for name, value in settings.items()),
          file=sys.stderr, flush=True)


def _saved_setting(saved: dict, key: str):
    """The train.* value that rebuilds the saved scheduler's ``key``: the decay length as
    given is wd_incr_steps (lr_decay_steps may be clamped to warm-up + 1)."""
    if _SCHEDULE_KEYS[key] == "train.lr_decay_iters":
        return saved.get("wd_incr_steps", saved["lr_decay_steps"])
    return saved[key]


def schedule_end_lr(root: str) -> tuple[str, float]:
    """(checkpoint, learning rate) where the newest complete checkpoint's schedule stands: the
    learning rate its next step would take (its last decay step's: min_lr once it is done)."""
    path = choose_checkpoint(root, required=True)
    common = dist_checkpointing.load_common_state_dict(path)
    if "schedule_lr" in common:
        return path, float(common["schedule_lr"])
    if "scheduler" not in common:
        raise ValueError(f"train.lr_from_pretrained=true: checkpoint {path} holds weights only "
                         "(no learning-rate schedule to continue); set train.lr_from_pretrained="
                         "false and train.lr to this stage's starting learning rate")
    return path, final_lr(common["scheduler"])


@collective_purpose("checkpoint")
def trained_parameters(chunks: list) -> list[str]:
    """The names of the trained parameters, layer and expert numbers as ``*`` (the same in
    every layout), over every rank of the job (one small gather)."""
    mine = {re.sub(r"\d+", "*", name) for chunk in chunks
            for name, param in _unwrap(chunk).named_parameters() if param.requires_grad}
    if not dist.is_initialized():
        return sorted(mine)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return sorted(set().union(*every))


def optimizer_mismatch(path: str, optimizer, chunks: list) -> str | None:
    """Why the checkpoint's optimizer state cannot be this run's (None: it can): weights only,
    another optimizer kind, or the state of other trained parameters (a DSA warm-up trains
    the indexer alone)."""
    common = dist_checkpointing.load_common_state_dict(path)
    if common.get("weights_only", False) or "optimizer_kind" not in common:
        return "it holds weights only"
    try:
        _check_optimizer_matches(path, optimizer)
    except ValueError as err:
        return str(err).split(": resume with")[0]
    saved, ours = common.get("trained_parameters"), trained_parameters(chunks)
    if saved is None or saved != ours:  # older checkpoints did not record them
        differ = sorted(set(saved or []) ^ set(ours))
        return ("it is the state of other trained parameters (e.g. "
                f"{differ[0] if differ else 'unrecorded'})")
    return None


def group_bounds(optimizer, scheduler) -> list[tuple[float | None, float | None]]:
    """Each param group's learning-rate bounds relative to the scheduler's: megatron-core's
    groups carry their own ``max_lr`` / ``min_lr``, which its ``get_lr`` reads first."""
    def ratio(value, of):
        return None if value is None or not of else value / of
    return [(ratio(g.get("max_lr"), scheduler.max_lr), ratio(g.get("min_lr"), scheduler.min_lr))
            for g in optimizer.param_groups]


def follow_scheduler(optimizer, scheduler, bounds: list) -> None:
    """Put the groups' bounds back in ``bounds``' proportion to the scheduler's, and set the
    learning rates from them."""
    for group, (to_max, to_min) in zip(optimizer.param_groups, bounds, strict=True):
        if to_max is not None:
            group["max_lr"] = to_max * scheduler.max_lr
        if to_min is not None:
            group["min_lr"] = to_min * scheduler.min_lr
    scheduler.step(increment=0)


def set_peak_lr(optimizer, scheduler, lr: float) -> None:
    """The schedule's peak learning rate ``lr``, in the scheduler and in the param groups."""
    bounds = group_bounds(optimizer, scheduler)
    scheduler.max_lr = lr
    follow_scheduler(optimizer, scheduler, bounds)


def _check_optimizer_matches(path: str, optimizer) -> None:
    """The checkpoint's optimizer state is of this run's kind (and, for megatron-core's plain
    DDP state, of its optimizer parts)."""
    saved = dist_checkpointing.load_common_state_dict(path).get("optimizer_kind")
    ours = optimizer_kind(optimizer)
    if saved is not None and saved != ours:
        def describe(kind: dict) -> str:
            return (f"train.optimizer={'muon' if kind['muon'] else 'adamw'} "
                    f"parallel.use_distributed_optimizer={str(kind['distributed']).lower()}")
        raise ValueError(
            f"checkpoint {path} holds the optimizer state of {describe(saved)}, this run uses "
            f"{describe(ours)}: resume with {describe(saved)}, or set "
            "checkpoint.load_optimizer=false to take the weights, step and schedule with a "
            "fresh optimizer state")
    if not ours["distributed"]:  # the distributed optimizer's state does not depend on them
        _check_optimizer_parts(path, optimizer)


def _check_optimizer_parts(path: str, optimizer) -> None:
    saved = dist_checkpointing.load_common_state_dict(path).get("optimizer_parts")
    ours = _optimizer_parts(optimizer)
    if saved is not None and saved != ours:
        raise ValueError(
            f"checkpoint {path} holds optimizer state for {saved} optimizer part(s) and this "
            f"layout has {ours} (megatron-core keeps a separate optimizer for expert-parallel "
            "weights only when expert_model_parallel_size > 1): keep EP on the same side of 1, "
            "or set checkpoint.load_optimizer=false to take the weights, step and schedule "
            "with a fresh optimizer state")


def is_weights_only(path: str) -> bool:
    return bool(dist_checkpointing.load_common_state_dict(path).get("weights_only", False))


def check_model_config(path: str, model_cfg: GLM5Config) -> None:
    """Refuse a checkpoint of another architecture, naming the first field that differs."""
    common = dist_checkpointing.load_common_state_dict(path)
    saved = common.get("model_config")
    if saved is None:
        raise ValueError(f"{path} has no model_config: it was not written by this project")
    ours = dataclasses.asdict(model_cfg)
    for field in sorted((set(saved) | set(ours)) - TRAINING_FIELDS):
        if saved.get(field) != ours.get(field):
            raise ValueError(
                f"checkpoint {path} is for another model: model.{field}={saved.get(field)!r} "
                f"there, {ours.get(field)!r} here; load it with the model config it was trained "
                f"with (model.{field}={saved.get(field)!r}) or start a fresh run")
