"""The planner's inputs read the job's fields by name (glm5_train/plan/inputs.py, no fallback
defaults): each field ``inputs_from_job`` reads, changed on a JobConfig, changes the
MemoryInputs it builds; the fields it reads are exactly the ones CHANGES covers (a new field read
must be added there); and a field missing from the job (renamed in its config) is an
AttributeError, not a silently planned default.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

from glm5_train.job_config import JobConfig
from glm5_train.plan import MemoryInputs, inputs_from_job
from parallel.recompute import Recompute


@dataclasses.dataclass(frozen=True)
class Change:
    """``read``: the job field the planner reads (dotted, from the JobConfig); ``given``: what is
    set on the base job (``read`` itself, or the fields a property or method reads, plus any
    field the read depends on); ``expect``: MemoryInputs fields that must then differ from the
    base job's inputs, with their values."""

    read: str
    given: dict
    expect: dict


def _set(read: str, value, **expect) -> Change:
    return Change(read, {read: value}, expect)


# The base job: the defaults, but two data-parallel ranks (expert parallelism needs them).
BASE = {"parallel.data_parallel_size": 2}
CHANGES = [
    _set("parallel.data_parallel_size", 4, dp=4, num_microbatches=2),
    _set("parallel.tensor_model_parallel_size", 2, tp=2),
    _set("parallel.expert_model_parallel_size", 2, ep=2),
    _set("parallel.expert_tensor_parallel_size", 2, etp=2),
    _set("parallel.context_parallel_size", 2, cp=2),
    _set("parallel.cp_comm", "head_parallel", cp_comm="head_parallel"),
    _set("parallel.sequence_parallel", True, sequence_parallel=True),
    _set("parallel.microbatch_group_size_per_vp_stage", 2, microbatch_group=2),
    _set("parallel.use_distributed_optimizer", True, distributed_optimizer=True),
    _set("parallel.optimizer_cpu_offload", True, optimizer_offload_fraction=1.0),
    Change("parallel.optimizer_offload_fraction",
           {"parallel.optimizer_cpu_offload": True, "parallel.optimizer_offload_fraction": 0.25},
           {"optimizer_offload_fraction": 0.25}),
    _set("parallel.pipeline_zero2", True, shard_grads=True),
    _set("train.micro_batch_size", 2, micro_batch_size=2, num_microbatches=2),
    _set("train.global_batch_size", 16, num_microbatches=8),
    _set("train.seq_length", 256, seq_length=256),
    _set("train.params_dtype", "bf16", weight_bytes=2, optimizer_bytes=12, activation_bytes=2),
    _set("train.int4_qat", True, int4_qat=True),
    _set("train.optimizer", "muon", muon="plain"),
    Change("train.muon_zero_redundant",
           {"train.optimizer": "muon", "parallel.use_distributed_optimizer": True,
            "train.muon_zero_redundant": False},
           {"muon": "naive", "distributed_optimizer": True}),
    _set("dsa.stage", "dense_warmup", dsa_stage="dense_warmup"),
    Change("dsa.trains_indexer", {"dsa.indexer_loss_coeff": 0.0}, {"dsa_kl": False}),
    _set("dsa.freeze_indexer", True, frozen_indexer=True, dsa_kl=False),
    _set("dsa.sparse_attention", "masked_dense", absorbed_attention=False),
    _set("dsa.sparse_kernel", "torch", sparse_kernel="torch"),
    _set("data.reset_attention_mask", True, document_mask=True),
    _set("activations.loss_chunk_tokens", 0, loss_chunk_tokens=0),
    # a property of the whole job: the MTP steps run only when trained with a loss weight
    Change("runs_mtp", {"model.mtp_loss_weight": 0.0}, {"mtp_runs": False}),
    # an RL objective freezes the MTP layers and measures the policy's entropy in the head
    Change("train.objective", {"train.objective": "grpo"},
           {"mtp_runs": False, "head_entropy": True}),
    Change("activations.recompute",
           {"activations.recompute_granularity": "selective",
            "activations.recompute_modules": ["core_attn"]},
           {"recompute": Recompute(granularity="selective", modules=("core_attn",))}),
]


def _job(settings: dict) -> JobConfig:
    job = copy.deepcopy(JobConfig())
    for path, value in {**BASE, **settings}.items():
        section, name = path.split(".")
        setattr(getattr(job, section), name, value)
    return job


class _Reads:
    """A JobConfig (or one of its sections) that records the dotted names read through it and
    hides ``hidden`` (as if the config had renamed it)."""

    def __init__(self, target, reads: set, hidden: str | None = None, prefix: str = "") -> None:
        self._target, self._reads, self._hidden, self._prefix = target, reads, hidden, prefix

    def __getattr__(self, name: str):
        path = self._prefix + name
        if path == self._hidden:
            raise AttributeError(f"{type(self._target).__name__} has no field {name!r}")
        value = getattr(self._target, name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return _Reads(value, self._reads, self._hidden, path + ".")
        self._reads.add(path)
        return value


def _fields_read(job: JobConfig) -> set:
    reads: set = set()
    inputs_from_job(_Reads(job, reads))
    return reads


def test_each_field_read_changes_the_inputs():
    base = inputs_from_job(_job({}))
    for change in CHANGES:
        inputs = inputs_from_job(_job(change.given))
        changed = {f.name for f in dataclasses.fields(MemoryInputs)
                   if getattr(inputs, f.name) != getattr(base, f.name)}
        assert changed == set(change.expect), (change.read, changed)
        for name, value in change.expect.items():
            assert getattr(inputs, name) == value, (change.read, name, getattr(inputs, name))


def test_the_fields_read_are_the_ones_changed():
    """Every field the inputs read, on the base job and on each changed one (some reads depend
    on others: the offload fraction on the offload, distributed Muon's mode on Muon)."""
    read = _fields_read(_job({}))
    for change in CHANGES:
        read |= _fields_read(_job(change.given))
    assert read == {change.read for change in CHANGES}


@pytest.mark.parametrize("hidden", [change.read for change in CHANGES])
def test_a_missing_field_fails_loudly(hidden):
    """A field the job no longer has under its read name is an AttributeError (no default)."""
    change = next(c for c in CHANGES if c.read == hidden)
    with pytest.raises(AttributeError, match=hidden.split(".")[-1]):
        inputs_from_job(_Reads(_job(change.given), set(), hidden))
