"""The whole job's configuration as typed dataclasses, built from the Hydra config tree.

Hydra composes ``configs/`` into a tree; ``JobConfig.from_hydra`` turns it into dataclasses,
refusing unknown keys (a typo such as ``train.train_iter`` must not be silently ignored).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from hydra.errors import CompactHydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from glm5_train.activation_config import ActivationsConfig
from glm5_train.bad_steps import NonfiniteOptions, check_nonfinite_options
from glm5_train.checkpoint import CheckpointConfig
from glm5_train.data import DataConfig
from glm5_train.model.config import GLM5Config
from glm5_train.model.dsa_loss import DSATrainingConfig
from glm5_train.profiling import ProfileOptions, check_profile_options
from glm5_train.rl.config import RLConfig
from glm5_train.rl.stream import check_spool_config
from glm5_train.run_dir import register_resolvers, run_id
from glm5_train.schedules import LR_DECAY_STYLES, WSD_DECAY_STYLES, check_rampup, steps_for_tokens
from parallel.config.int4_qat import Int4QATOptions
from parallel.config.muon import MuonOptions, check_muon_options
from parallel.int4_qat import check_group_size
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


# train.warmup_iters=null: this many warm-up steps, but at most half the run (a run of 4 steps
# or fewer would otherwise spend every step warming up, the first at learning rate 0).
DEFAULT_WARMUP_STEPS = 5


@dataclass
class TrainConfig(ProfileOptions, NonfiniteOptions, Int4QATOptions, MuonOptions):
    """The ``train`` config group: steps, batch, precision, AdamW and its schedule here; each
    technique's ``train.*`` keys in its own module (``*Options`` above, checked there)."""

    train_iters: int = 20
    global_batch_size: int = 8
    micro_batch_size: int = 1
    seq_length: int = 128
    seed: int = 1234
    params_dtype: str = "fp32"
    log_interval: int = 1
    # Learning rate, in optimizer steps (megatron-core's OptimizerParamScheduler): linear
    # warm-up from lr_warmup_init to lr over warmup_iters, then lr_decay_style down to min_lr
    # at lr_decay_iters (null: the run's end), min_lr after. glm5_train/schedules.py.
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_iters: int | None = None  # null: DEFAULT_WARMUP_STEPS, at most half the run
    lr_decay_iters: int | None = None
    lr_decay_style: str = "cosine"  # constant, linear, cosine, inverse-square-root, WSD
    lr_warmup_init: float = 0.0
    # WSD (warm-up, stable, decay): lr until the last lr_wsd_decay_iters steps of the decay,
    # then lr_wsd_decay_style (linear, cosine, exponential, minus_sqrt) down to min_lr.
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_style: str = "linear"
    # A new stage (checkpoint.pretrained) starts its schedule at the learning rate the
    # pretrained run's schedule ended at, in place of lr (the peak after any warm-up).
    lr_from_pretrained: bool = False
    # Batch-size warm-up, megatron-core's: [start, increment, samples]: the global batch is
    # start at first, grows by increment in equal shares of samples consumed samples, and is
    # global_batch_size after. null: global_batch_size from the first step.
    rampup_batch_size: list[int] | None = None
    # A token budget in place of train_iters: the steps whose batches (ramp included) first
    # hold this many tokens. null: train_iters as given.
    train_tokens: int | None = None
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # "adamw", or "muon": Muon on weight matrices + AdamW on embedding/head/norms/biases/router.
    optimizer: str = "adamw"
    # Log every parameter's reduced, pre-clipping gradient L2 norm per step in metrics.jsonl
    # (``param_grad_norms``: {global tensor name: norm}, the same names in every layout; see
    # parallel/grad_norms.py). For parity checks and debugging: one all_gather_object per step.
    log_param_grad_norms: bool = False
    # Tokens per expert of every MoE layer and the expert biases in metrics.jsonl (expert_load,
    # expert_load_max_over_mean, expert_load_cv, expert_bias; glm5_train/expert_load.py): one
    # all-reduce of layers x (2E+1) float64 per logged step (744B: 312 KB, ~0.35 MB a record).
    log_expert_load: bool = True
    # Each step's collectives by purpose (comm_by_purpose: calls, bytes and the milliseconds each
    # purpose held the rank: a blocking call's duration, an asynchronous one's wait; pp_recv is
    # the pipeline's waiting) in metrics.jsonl and TensorBoard. Costs one walk of the calling
    # frames per collective: ~44 us on this repo's 2-core CPU machine, 2.5% of a TP2 tiny step.
    log_comm_by_purpose: bool = True
    # What the step minimises: lm (next-token cross-entropy), or an RL objective over rollout
    # records (grpo, dis, distill: data.format=rollouts; the rl group holds their keys).
    objective: str = "lm"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.params_dtype]

    @property
    def warmup_steps(self) -> int:
        """The learning-rate warm-up's length in optimizer steps (warmup_iters resolved)."""
        if self.warmup_iters is not None:
            return self.warmup_iters
        return min(DEFAULT_WARMUP_STEPS, self.train_iters // 2)

    def validate(self) -> None:
        _resolve_token_budget(self)
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
        _check_warmup(self)
        _check_lr_schedule(self)
        check_rampup(self.rampup_batch_size, self.global_batch_size, self.micro_batch_size)
        check_muon_options(self)
        check_nonfinite_options(self)
        check_profile_options(self, self.train_iters)


def _resolve_token_budget(t: TrainConfig) -> None:
    """train.train_tokens: train_iters becomes the steps that reach the budget."""
    if t.train_tokens is None:
        return
    if t.train_tokens < 1 or t.seq_length < 1 or t.global_batch_size < 1:
        raise ValueError(f"train.train_tokens={t.train_tokens} must be >= 1 (with positive "
                         "train.seq_length and train.global_batch_size), or null to run "
                         "train.train_iters steps")
    check_rampup(t.rampup_batch_size, t.global_batch_size, t.micro_batch_size)
    t.train_iters = steps_for_tokens(t.train_tokens, t.seq_length, t.global_batch_size,
                                     t.rampup_batch_size, t.micro_batch_size)


def _check_lr_schedule(t: TrainConfig) -> None:
    if t.lr_decay_style not in LR_DECAY_STYLES:
        raise ValueError(f"train.lr_decay_style={t.lr_decay_style!r}: use one of "
                         f"{', '.join(LR_DECAY_STYLES)} (megatron-core's names)")
    if not 0.0 <= t.lr_warmup_init <= t.lr:
        raise ValueError(f"train.lr_warmup_init={t.lr_warmup_init} must lie in [0, "
                         f"train.lr={t.lr}]")
    if t.lr_decay_style != "WSD":
        return
    decay = t.lr_decay_iters or t.train_iters
    wsd = t.lr_wsd_decay_iters
    if wsd is None or not 1 <= wsd <= decay - t.warmup_steps:
        raise ValueError(f"train.lr_wsd_decay_iters={wsd}: WSD decays over the last "
                         f"lr_wsd_decay_iters steps of its {decay}-step schedule, after the "
                         f"{t.warmup_steps} warm-up steps: set it in [1, "
                         f"{decay - t.warmup_steps}], e.g. {max(1, (decay - t.warmup_steps) // 10)}")
    if t.lr_wsd_decay_style not in WSD_DECAY_STYLES:
        raise ValueError(f"train.lr_wsd_decay_style={t.lr_wsd_decay_style!r}: use one of "
                         f"{', '.join(WSD_DECAY_STYLES)}")


def _check_warmup(t: TrainConfig) -> None:
    warmup, steps = t.warmup_iters, t.train_iters
    if warmup is not None and not 0 <= warmup <= steps:
        raise ValueError(f"train.warmup_iters={warmup} must lie in [0, train.train_iters="
                         f"{steps}]: set e.g. train.warmup_iters={steps // 2}, or "
                         f"train.warmup_iters=null ({DEFAULT_WARMUP_STEPS} steps, at most half "
                         "the run)")


@dataclass
class JobConfig:
    model: GLM5Config = field(default_factory=GLM5Config)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dsa: DSATrainingConfig = field(default_factory=DSATrainingConfig)
    activations: ActivationsConfig = field(default_factory=ActivationsConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    @property
    def trains_mtp(self) -> bool:
        """Whether the MTP layers train (their loss heads run): always under the LM loss; under
        an RL objective only with rl.train_mtp (GLM-5 trains no MTP loss in RL)."""
        return self.train.objective == "lm" or self.rl.train_mtp

    @property
    def runs_mtp(self) -> bool:
        """Whether the MTP steps and their loss heads run: trained, with a non-zero weight
        (GLM5Model skips them otherwise)."""
        return bool(self.model.mtp_sets) and self.trains_mtp and self.model.mtp_loss_weight > 0

    @classmethod
    def from_hydra(cls, tree: Any) -> JobConfig:
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
            rl=_build(RLConfig, "rl", plain.pop("rl", {})),
        )
        if plain:
            raise ValueError(f"unknown config group(s) {sorted(plain)}: known groups are model, "
                             "parallel, train, data, checkpoint, dsa, activations, rl")
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
        _check_rampup_use(self)
        if self.train.lr_from_pretrained and not self.checkpoint.pretrained:
            raise ValueError("train.lr_from_pretrained=true needs checkpoint.pretrained=<the "
                             "previous stage's checkpoint directory> (its schedule's last "
                             "learning rate starts this one); set it, or "
                             "train.lr_from_pretrained=false")
        _check_flexible_cp(self)
        _check_int4_qat(self)
        _check_objective(self)


def _check_rampup_use(job: JobConfig) -> None:
    """A batch-size ramp is for next-token training on indexed data: RL reads its records by
    step x global batch, and flexible CP plans fixed global batches."""
    t = job.train
    if t.rampup_batch_size is None:
        return
    if t.objective != "lm" or job.data.format == "rollouts":
        raise ValueError(f"train.rampup_batch_size={t.rampup_batch_size} with train.objective="
                         f"{t.objective} data.format={job.data.format}: RL steps read their "
                         "rollouts by step x global batch; set train.rampup_batch_size=null")
    if job.activations.offload_micro_batches:
        raise ValueError(f"train.rampup_batch_size={t.rampup_batch_size} with activations."
                         f"offload_micro_batches={job.activations.offload_micro_batches}: the "
                         "offload plan is made for the full batch's micro-batches; set "
                         "activations.offload_micro_batches=0 or train.rampup_batch_size=null")
    if job.parallel.cp_groups == "flexible":
        raise ValueError(f"train.rampup_batch_size={t.rampup_batch_size} with parallel."
                         "cp_groups=flexible: flexible CP plans every global batch at "
                         "train.global_batch_size; set train.rampup_batch_size=null or "
                         "parallel.cp_groups=fixed")


def _check_objective(job: JobConfig) -> None:
    """An RL objective trains on rollout records, and rollout records need one."""
    objective = job.train.objective
    job.rl.validate(objective)
    rl = objective != "lm"
    if rl and job.data.format != "rollouts":
        raise ValueError(f"train.objective={objective} with data.format={job.data.format}: "
                         "the RL objectives train on rollout records; set data=rollouts "
                         "data.paths=[<records.jsonl>] (or a spool directory)")
    if job.data.format == "rollouts" and any(os.path.isdir(p) for p in job.data.paths):
        check_spool_config(job)
    if not rl:  # LM on rollout records: supervised on their responses (the loss mask)
        return
    if job.parallel.cp_groups == "flexible":
        raise ValueError(f"train.objective={objective} with parallel.cp_groups=flexible: "
                         "flexible CP groups plan chat SFT conversations; set "
                         "parallel.cp_groups=fixed")
    _check_rl_paths(job)
    if job.rl.updates_per_batch > 1 and job.train.train_iters % job.rl.updates_per_batch:
        raise ValueError(f"train.train_iters={job.train.train_iters} is not a multiple of "
                         f"rl.updates_per_batch={job.rl.updates_per_batch}: every batch of "
                         "rollouts feeds that many updates; make train_iters a multiple")


def _check_rl_paths(job: JobConfig) -> None:
    """What an RL objective needs of the model's paths."""
    objective = job.train.objective
    if job.activations.loss_chunk_tokens <= 0:
        raise ValueError(f"train.objective={objective} with activations.loss_chunk_tokens="
                         f"{job.activations.loss_chunk_tokens}: the policy's log-probs and "
                         "entropy come from the chunked output head (no [tokens, vocab] "
                         "logits); set activations.loss_chunk_tokens=2048")
    if job.dsa.stage == "dense_warmup":
        raise ValueError(f"train.objective={objective} with dsa.stage=dense_warmup: the "
                         "warm-up trains the indexer alone, not the policy; use dsa=frozen_"
                         "indexer (GLM-5's RL) or dsa=sparse")
    if job.rl.train_mtp and job.rl.loss_average == "sequence":
        raise ValueError("rl.train_mtp=true with rl.loss_average=sequence: the MTP losses are "
                         "sums over tokens, which megatron-core would divide by the rollout "
                         "count; use rl.loss_average=token, or rl.train_mtp=false")


def _check_int4_qat(job: JobConfig) -> None:
    """INT4 QAT quantises the routed experts: they must exist, and their weights' groups must
    not straddle tensor-parallel shards."""
    if not job.train.int4_qat:
        return
    g, model = job.train.int4_group_size, job.model
    check_group_size(g, "train.int4_group_size")
    if not any(model.moe_layer_pattern) or not model.n_routed_experts:
        raise ValueError("train.int4_qat=true quantises the routed experts, and this model has "
                         "none (no MoE layer): set train.int4_qat=false")
    etp = job.parallel.expert_tp
    widths = {"model.hidden_size (the experts' fc1 input)": model.hidden_size,
              f"model.moe_intermediate_size / expert TP {etp} (fc2's input per rank)":
                  model.moe_intermediate_size // etp}
    for name, width in widths.items():
        if width % g:
            raise ValueError(f"train.int4_group_size={g} does not divide {name} = {width}: "
                             "a group would straddle shards; pick a group size dividing it "
                             "(e.g. 32)")


def _check_flexible_cp(job: JobConfig) -> None:
    """parallel.cp_groups=flexible plans chat SFT conversations one global batch at a time
    (glm5_train/flexible_batches.py): what that rules out."""
    if job.parallel.cp_groups != "flexible":
        return
    if job.data.format != "chat_sft":
        raise ValueError(f"parallel.cp_groups=flexible with data.format={job.data.format}: "
                         "flexible CP groups are sized to each chat SFT conversation; use "
                         "data=chat_sft or parallel.cp_groups=fixed")
    if job.train.micro_batch_size != 1:
        raise ValueError(f"parallel.cp_groups=flexible with train.micro_batch_size="
                         f"{job.train.micro_batch_size}: a micro-batch is one packed bin per "
                         "rank; set train.micro_batch_size=1")
    if job.activations.offload_micro_batches:
        raise ValueError("parallel.cp_groups=flexible with activations.offload_micro_batches="
                         f"{job.activations.offload_micro_batches}: offloading plans a fixed "
                         "micro-batch count, flexible groups vary it per batch; set "
                         "activations.offload_micro_batches=0")


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
    if ckpt.save_interval_minutes is not None and not ckpt.save_interval_minutes > 0:
        raise ValueError(f"checkpoint.save_interval_minutes={ckpt.save_interval_minutes} must "
                         "be > 0, or null to save by steps only")
    if ckpt.keep_last is not None and ckpt.keep_last < 1:
        raise ValueError(f"checkpoint.keep_last={ckpt.keep_last} must be >= 1 (the checkpoint "
                         "just written is always kept), or null to keep every checkpoint")
    if ckpt.pretrained is not None and (not isinstance(ckpt.pretrained, str)
                                        or not ckpt.pretrained.strip()):
        raise ValueError(f"checkpoint.pretrained={ckpt.pretrained!r}: use a checkpoint "
                         "directory (its weights start a new stage at step 0), or null")
    if ckpt.pretrained_optimizer not in (True, False, "auto"):
        raise ValueError(f"checkpoint.pretrained_optimizer={ckpt.pretrained_optimizer!r}: use "
                         "auto (the pretrained run's optimizer state when it is of this run's "
                         "kind), true (required) or false (a fresh state)")
    if ckpt.load is not None and (not isinstance(ckpt.load, str) or not ckpt.load.strip()):
        raise ValueError(f"checkpoint.load={ckpt.load!r}: use 'auto' (resume from "
                         "checkpoint.save), a checkpoint directory, or null (start at step 0)")


def compose_job(overrides: list[str]):
    """The JobConfig the training job would build from these Hydra overrides. The default
    ``checkpoint.save`` interpolates Hydra's run directory, unset outside a Hydra run: it
    becomes ``<hydra.run.dir>/checkpoints`` (the given run directory, else ``outputs/<run id>``
    with this process's run id), so the job is validated as it will save."""
    register_resolvers()
    default_save = [] if _override_value(overrides, "checkpoint.save") is not None else [
        "checkpoint.save=" + os.path.join(_override_value(overrides, "hydra.run.dir")
                                          or os.path.join("outputs", run_id()), "checkpoints")]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        tree = compose("config", overrides=[*overrides, *default_save])
    return JobConfig.from_hydra(tree)


def _override_value(overrides: list[str], key: str) -> str | None:
    """The value the last Hydra override of ``key`` gives it (``key=v``, ``+key=v``,
    ``++key=v``), None if none does."""
    found = None
    for override in overrides:
        name, sep, value = override.partition("=")
        if sep and name.lstrip("+") == key:
            found = value
    return found


def compose_model_config(overrides: list[str]) -> GLM5Config:
    """Compose ``configs/`` with Hydra and return the ``model`` node as a GLM5Config."""
    register_resolvers()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        tree = compose(config_name="config", overrides=overrides)
    # Only the model node: checkpoint.save interpolates ${hydra:...}, unset outside a Hydra run.
    cfg = GLM5Config.from_dict(OmegaConf.to_container(tree.model, resolve=True))
    cfg.validate()  # includes the field-type check
    return cfg
