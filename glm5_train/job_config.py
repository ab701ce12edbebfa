"""The whole job's configuration as typed dataclasses, built from the Hydra config tree.

Hydra composes ``configs/`` into a tree; ``JobConfig.from_hydra`` turns it into dataclasses,
refusing unknown keys (a typo such as ``train.train_iter`` must not be silently ignored).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.errors import CompactHydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from glm5_train.activation_config import ActivationsConfig
from glm5_train.checkpoint import CheckpointConfig
from glm5_train.data import DataConfig
from glm5_train.model.config import GLM5Config
from glm5_train.model.dsa_loss import DSATrainingConfig
from glm5_train.run_dir import register_resolvers
from parallel.layout import ParallelConfig

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Config errors are the user's to fix: the job and the launcher report them in one line, with
# no traceback. Hydra's compact exceptions are its composition errors (unknown key, missing
# group option, bad override syntax); OmegaConf's are interpolation errors.
CONFIG_ERRORS = (ValueError, FileNotFoundError, CompactHydraException, OmegaConfBaseException)


def one_line(err: BaseException) -> str:
    """A config error's message on one line; for a Hydra error with the OmegaConf error behind
    it (e.g. "Key 'train_iter' is not in struct"), that error's first line too. A missing group
    option's message lists the options, then Hydra's config search path: that part goes."""
    message = " ".join(str(err).split("\nConfig search path:")[0].split())
    cause = err.__cause__
    if isinstance(err, CompactHydraException) and isinstance(cause, OmegaConfBaseException):
        message += f" ({str(cause).strip().splitlines()[0]})"
    return message


@dataclass
class TrainConfig:
    train_iters: int = 20
    global_batch_size: int = 8
    micro_batch_size: int = 1
    seq_length: int = 128
    seed: int = 1234
    params_dtype: str = "fp32"
    log_interval: int = 1
    # AdamW with linear warm-up and cosine decay, in optimizer steps.
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_iters: int = 5
    lr_decay_iters: int | None = None
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # "adamw", or "muon": Muon on weight matrices + AdamW on embedding/head/norms/biases/router.
    optimizer: str = "adamw"
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_split_mla: bool = True  # Muon Split: per-head W_UQ / W_UK / W_UV (GLM-5 default)
    # With parallel.use_distributed_optimizer: one owner rank per matrix (true), or the naive
    # reference where every rank gathers every Muon gradient (false; for bench/muon_comm.py).
    muon_zero_redundant: bool = True
    # Log every parameter's reduced, pre-clipping gradient L2 norm per step in metrics.jsonl
    # (``param_grad_norms``: {global tensor name: norm}, the same names in every layout; see
    # parallel/grad_norms.py). For parity checks and debugging: one all_gather_object per step.
    log_param_grad_norms: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.params_dtype]

    def validate(self) -> None:
        for name in ("train_iters", "global_batch_size", "micro_batch_size", "seq_length",
                     "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
        _check_adam(self)
        if self.params_dtype not in _DTYPES:
            raise ValueError(f"train.params_dtype={self.params_dtype!r}: use one of "
                             f"{sorted(_DTYPES)}")
        if not 0.0 <= self.min_lr <= self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} must lie in [0, train.lr={self.lr}]")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"train.optimizer={self.optimizer!r}: use 'adamw' or 'muon'")
        if self.warmup_iters < 0 or self.warmup_iters > self.train_iters:
            raise ValueError(f"train.warmup_iters={self.warmup_iters} must lie in "
                             f"[0, train.train_iters={self.train_iters}]")


@dataclass
class JobConfig:
    model: GLM5Config = field(default_factory=GLM5Config)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dsa: DSATrainingConfig = field(default_factory=DSATrainingConfig)
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)

    @classmethod
    def from_hydra(cls, tree: Any) -> "JobConfig":
        plain = OmegaConf.to_container(tree, resolve=True)
        plain.pop("hydra", None)
        job = cls(
            model=GLM5Config.from_dict(plain.pop("model", {})),
            parallel=_build(ParallelConfig, "parallel", plain.pop("parallel", {})),
            train=_build(TrainConfig, "train", plain.pop("train", {})),
            data=_build(DataConfig, "data", plain.pop("data", {})),
            checkpoint=_build(CheckpointConfig, "checkpoint", plain.pop("checkpoint", {})),
            dsa=_build(DSATrainingConfig, "dsa", plain.pop("dsa", {})),
            activations=_build(ActivationsConfig, "activations", plain.pop("activations", {})),
        )
        if plain:
            raise ValueError(f"unknown config group(s) {sorted(plain)}: known groups are model, "
                             "parallel, train, data, checkpoint, dsa, activations")
        job.validate()
        return job

    def validate(self) -> None:
        self.model.validate()
        self.train.validate()
        self.data.validate()
        self.dsa.validate()
        self.activations.validate()
        self.activations.check_recompute_for(
            self.model.mtp_num_steps if self.model.mtp_sets else 0, self.dsa.stage)
        self.activations.check_offload_for(self.model.num_hidden_layers, self.model.mtp_sets)
        _check_checkpoint(self.checkpoint)
        if (self.train.optimizer == "muon" and self.parallel.use_distributed_optimizer
                and (self.checkpoint.save or self.checkpoint.load)):
            raise ValueError(
                "train.optimizer=muon with parallel.use_distributed_optimizer=true and "
                "checkpoint.save/load: distributed Muon keeps each matrix's momentum on its owner "
                "rank, which megatron-core's distributed-optimizer checkpoint format cannot hold "
                "(not implemented yet). Set parallel.use_distributed_optimizer=false (Muon "
                "checkpoints then work), or checkpoint.save=null and checkpoint.load=null")
        _check_distributed_optimizer_checkpoint(self.parallel, self.checkpoint)


def _check_adam(t: TrainConfig) -> None:
    """torch's AdamW (built by megatron-core's get_megatron_optimizer) and megatron-core's
    weight-decay schedule (optimizer_param_scheduler.py:165) refuse these only once the model
    is built."""
    default = TrainConfig()
    for name, low, high in (("adam_beta1", 0.0, 1.0), ("adam_beta2", 0.0, 1.0),
                            ("adam_eps", 0.0, float("inf")), ("weight_decay", 0.0, float("inf"))):
        value = getattr(t, name)
        if not low <= value < high:
            bounds = f"lie in [{low}, {high})" if high < float("inf") else f"be >= {low}"
            raise ValueError(f"train.{name}={value} must {bounds} (AdamW): use e.g. the "
                             f"default {getattr(default, name)}")


def _build(kind: type, group: str, values: dict[str, Any]):
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{group}: unknown field(s) {unknown}; known: {sorted(known)}")
    return kind(**values)


def _check_checkpoint(ckpt: CheckpointConfig) -> None:
    if ckpt.save_interval is not None and ckpt.save_interval < 1:
        raise ValueError(f"checkpoint.save_interval={ckpt.save_interval} must be >= 1 or null")
    if ckpt.save_interval is not None and not ckpt.save:
        raise ValueError("checkpoint.save_interval is set but checkpoint.save is not: give "
                         "checkpoint.save=<directory>")


def fused_adam_available() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("transformer_engine", "apex"))


def _check_distributed_optimizer_checkpoint(par: ParallelConfig, ckpt: CheckpointConfig) -> None:
    # megatron-core 0.16.1's distributed-optimizer checkpoint path with torch's Adam (no TE or
    # Apex fused Adam) cannot be restored exactly: a resumed run diverges from the uninterrupted
    # one after the first step. Refuse rather than write checkpoints that do not resume.
    if par.use_distributed_optimizer and (ckpt.save or ckpt.load) and not fused_adam_available():
        raise ValueError(
            "parallel.use_distributed_optimizer=true with checkpoint.save/load needs Transformer "
            "Engine or Apex (fused Adam); with torch's Adam megatron-core 0.16.1 does not resume "
            "it exactly. Set parallel.use_distributed_optimizer=false, or checkpoint.save=null "
            "and checkpoint.load=null")


def compose_job(overrides: list[str]):
    """The JobConfig the training job would build from these Hydra overrides (saving off:
    ``checkpoint.save`` interpolates Hydra's run directory, unset outside a Hydra run)."""
    register_resolvers()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        tree = compose("config", overrides=[*overrides, "checkpoint.save=null"])
    return JobConfig.from_hydra(tree)


def compose_model_config(overrides: list[str]) -> GLM5Config:
    """Compose ``configs/`` with Hydra and return the ``model`` node as a GLM5Config."""
    register_resolvers()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        tree = compose(config_name="config", overrides=overrides)
    # Only the model node: checkpoint.save interpolates ${hydra:...}, unset outside a Hydra run.
    cfg = GLM5Config.from_dict(OmegaConf.to_container(tree.model, resolve=True))
    cfg.validate()  # includes the field-type check
    return cfg
