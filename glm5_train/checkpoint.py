"""Checkpoints with megatron-core's dist_checkpointing (``torch_dist`` format).

Layout of ``checkpoint.save``::

    <save>/iter_0000010/          one distributed checkpoint per saved step
    <save>/latest_iteration.txt   the newest complete one, written last

A checkpoint is written under ``iter_*.partial`` and renamed when every rank has finished, so a
run that dies while saving never replaces or corrupts the previous checkpoint. Model chunks are
stored under global tensor keys, so a checkpoint loads into any TP/PP/VPP/EP layout.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from glm5_train.model.config import TRAINING_FIELDS, GLM5Config
from parallel import mcore_compat

LATEST = "latest_iteration.txt"


@dataclass
class CheckpointConfig:
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    # false: take weights, step count, data position and LR schedule but start the optimizer
    # state fresh (needed when the optimizer's structure changed, e.g. EP=1 <-> EP>1).
    load_optimizer: bool = True


@dataclass
class TrainState:
    """What a resumed run needs besides weights and optimizer state."""

    iteration: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> int | None:
    path = os.path.join(root, LATEST)
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return int(handle.read().strip())


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


def _model_sharded(chunks: list) -> dict[str, Any]:
    return {f"chunk{i}": _unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


def _sharded_state(chunks, optimizer, scheduler, state: TrainState, model_cfg: GLM5Config,
                   is_loading: bool) -> dict[str, Any]:
    model_sd = _model_sharded(chunks)
    sharded = {"model": model_sd, "train_state": dataclasses.asdict(state),
               "model_config": dataclasses.asdict(model_cfg)}
    if scheduler is None:  # weights only (e.g. imported from Hugging Face)
        return {**sharded, "weights_only": True}
    sharded["scheduler"] = scheduler.state_dict()
    if optimizer is not None:
        # The optimizer maps its params to sharded tensors by walking the nested model dict.
        sharded["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        sharded["optimizer_parts"] = _optimizer_parts(optimizer)
    return sharded


def _optimizer_parts(optimizer) -> int:
    """megatron-core splits dense and expert-parallel parameters into separate optimizers
    (only when EP > 1); their state keys differ, so the count must match to restore it."""
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


def save_checkpoint(root: str, chunks, optimizer, scheduler, state: TrainState,
                    model_cfg: GLM5Config) -> str:
    """Write a complete checkpoint for ``state.iteration``; returns its directory.

    With ``optimizer=None`` only the weights are written (a starting point, such as an HF
    import): loading it starts training at step 0 with a fresh optimizer."""
    final = iteration_dir(root, state.iteration)
    partial = final + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    sharded = _sharded_state(chunks, optimizer, scheduler, state, model_cfg, is_loading=False)
    mcore_compat.in_process_checkpoint_results_queue()
    dist_checkpointing.save(sharded, partial)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        _write_atomic(os.path.join(root, LATEST), f"{state.iteration}\n")
    dist.barrier()
    return final


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def load_checkpoint(root: str, chunks, optimizer, scheduler, model_cfg: GLM5Config,
                    load_optimizer: bool = True) -> TrainState:
    """Load the newest complete checkpoint under ``root`` into this layout."""
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(
            f"checkpoint.load={root!r} holds no {LATEST}: point it at a directory written by "
            "checkpoint.save, or drop checkpoint.load to start from scratch")
    path = iteration_dir(root, iteration)
    check_model_config(path, model_cfg)
    if is_weights_only(path):
        optimizer = scheduler = None
    elif not load_optimizer:
        optimizer = None
    elif optimizer is not None:
        _check_optimizer_parts(path, optimizer)
    sharded = _sharded_state(chunks, optimizer, scheduler, TrainState(), model_cfg,
                             is_loading=True)
    loaded = dist_checkpointing.load(sharded, path)
    for i, chunk in enumerate(chunks):
        _unwrap(chunk).load_state_dict(loaded["model"][f"chunk{i}"])
    if scheduler is None:
        return TrainState()
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    return TrainState(**loaded["train_state"])


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
