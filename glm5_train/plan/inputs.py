"""What the planner is given: the job's parallel sizes, batch shape and training options as
``MemoryInputs``, built from a ``JobConfig`` (``inputs_from_job``), and what they decide about
the model's paths (MTP steps, the DSA attention path) that every cost term asks.

``inputs_from_job`` reads the job's fields by name, with no fallback defaults: a field renamed in
``glm5_train.job_config`` (or ``parallel.layout``) fails here loudly instead of planning the
default (tests/test_plan_inputs.py changes each field it reads and checks the inputs follow).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from glm5_train.job_config import JobConfig
from glm5_train.model.config import GLM5Config
from glm5_train.model.head_parallel_cp import job_cp_choice
from parallel.layout import LayoutError
from parallel.recompute import Recompute

# ------------------------------------------------------------------------------ model shape


def mtp_steps(cfg: GLM5Config) -> int:
    """MTP prediction steps trained (0 without MTP)."""
    return cfg.mtp_num_steps if cfg.mtp_sets else 0


def mtp_sets(cfg: GLM5Config) -> int:
    """MTP parameter sets built (megatron-core's mtp_num_layers): none when MTP is off."""
    return cfg.mtp_sets


# ------------------------------------------------------------------------------ model inputs


@dataclass(frozen=True)
class MemoryInputs:
    """Parallel sizes, batch shape, and bytes per value: all the estimate needs besides the
    model and the layout. Defaults: bf16 weights, fp32 main grads, fp32 master + Adam m, v."""

    tp: int = 1
    ep: int = 1
    etp: int | None = None  # None: 1 with EP > 1, else TP (parallel.layout.ParallelConfig)
    cp: int = 1
    dp: int = 1
    # parallel.cp_comm: "all_gather" (modelled: queries local, latent and indexer keys
    # gathered); "head_parallel" is planned as if it were all_gather, its traffic left out;
    # "auto" is planned as the mode it chooses for the job's CP group (planned_cp_comm).
    cp_comm: str = "all_gather"
    sequence_parallel: bool = False
    seq_length: int = 4096
    micro_batch_size: int = 1
    num_microbatches: int = 1
    microbatch_group: int | None = None  # interleaved: consecutive micro-batches per chunk (PP)
    weight_bytes: int = 2
    grad_bytes: int = 4
    optimizer_bytes: int = 12
    activation_bytes: int = 2
    distributed_optimizer: bool = False  # optimizer state sharded over data-parallel ranks
    # train.optimizer=muon (parallel/muon.py): None (AdamW), "plain" (every rank steps its
    # whole parameters), "owners" (distributed Muon: each matrix's state on one DP rank) or
    # "naive" (distributed Muon's reference: every matrix's state on every DP rank).
    muon: str | None = None
    # parallel.optimizer_cpu_offload: this share of the optimizer's parameter elements keeps
    # its state in host memory (0: none). There each element holds HOST_OPTIMIZER_BYTES.
    optimizer_offload_fraction: float = 0.0
    # Pipeline ZeRO2 (parallel.pipeline_zero2): 1/dp of each stage's gradients, plus two
    # accumulation buffers per rank the size of its largest stage's gradients; without it
    # megatron-core keeps every gradient whole.
    shard_grads: bool = False
    int4_qat: bool = False  # train.int4_qat: an INT4 copy of every routed expert weight
    dsa_kl: bool = True  # the indexer trains with the KL
    # dsa.freeze_indexer (required by dsa.stage=dense): the indexers' weights are held but get
    # no gradient and no optimizer state (DDP and the optimizer take trained parameters only).
    frozen_indexer: bool = False
    # dsa.stage: "dense_warmup" freezes all but the indexer, attends densely and runs the
    # model without autograd (``dense_indexer_kl_bytes``); "sparse": everything trains;
    # "dense": dense attention, the indexer never runs (planned as the sparse stage's dense
    # fallback, no indexer, no KL; its weights frozen: ``frozen_indexer``).
    dsa_stage: str = "sparse"
    # DSA's sparse attention on SDPA's fused kernels (CUDA); False: its math path (CPU, where
    # q/k and v widths differ). Dense attention pads to one width and is fused on both.
    fused_attention: bool = True
    document_mask: bool = False  # data.reset_attention_mask: packed documents' starts [b, s]
    # dsa.sparse_attention=absorbed: the sparse stage attends over the selected latent keys
    # (glm5_train.model.sparse_mla); False: masked dense SDPA (the reference path).
    absorbed_attention: bool = True
    # dsa.sparse_kernel: which absorbed sparse attention runs ("torch": its torch path;
    # "triton": the Triton kernels; "auto": the kernels on a CUDA plan, the torch path else)
    sparse_kernel: str = "auto"
    # activations.loss_chunk_tokens: > 0 runs each head + loss chunked over tokens
    # (parallel.chunked_cross_entropy, no [n, V] logits kept); 0: megatron's whole-logits head.
    loss_chunk_tokens: int = 0
    # The MTP steps and their loss heads run: not with a zero MTP loss weight (an RL objective
    # freezes the MTP layers unless rl.train_mtp): GLM5Model then sends zeros in their place.
    mtp_runs: bool = True
    # The main head also measures each token's entropy (an RL objective's metric; chunked
    # head only): one more sum per token in its chunk all-reduce.
    head_entropy: bool = False
    # activations.recompute_*: full (whole layers, each unit keeping its input) or selective
    # (parts of every layer), parallel.recompute; the default recomputes nothing.
    recompute: Recompute = Recompute()

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else (1 if self.ep > 1 else self.tp)

    @property
    def expert_dp(self) -> int:
        return max(1, self.tp * self.cp * self.dp // (self.ep * self.expert_tp))

    @property
    def seq(self) -> int:  # queries per context-parallel rank
        return self.seq_length // self.cp

    @property
    def tokens(self) -> int:  # per micro-batch in tensor-parallel regions (whole local sequence)
        return self.micro_batch_size * self.seq

    @property
    def gathered_tokens(self) -> int:
        """Rows per micro-batch of a tensor all-gathered over the context-parallel group: the
        whole sequence (parallel.context_parallel.gather_sequence); ``tokens`` without CP."""
        return self.micro_batch_size * self.seq_length

    @property
    def sp_tokens(self) -> int:  # per micro-batch where sequence parallelism splits over TP
        return self.tokens // self.tp if self.sequence_parallel else self.tokens


def muon_mode(job: JobConfig) -> str | None:
    """``MemoryInputs.muon`` of a job."""
    if job.train.optimizer != "muon":
        return None
    if not job.parallel.use_distributed_optimizer:
        return "plain"
    return "owners" if job.train.muon_zero_redundant else "naive"


def inputs_from_job(job: JobConfig, dp: int | None = None, **changes) -> MemoryInputs:
    """MemoryInputs of a JobConfig; ``dp`` defaults to parallel.data_parallel_size or 1. The
    job runs where it is planned (the training job balances its own layout with this): SDPA's
    fused kernels with CUDA, its math path on the CPU (``fused_attention``; a plan for another
    machine passes it in ``changes``)."""
    par, train = job.parallel, job.train
    dp = dp or par.data_parallel_size or 1
    micro = train.micro_batch_size * dp
    if train.global_batch_size % micro:
        raise LayoutError(f"train.global_batch_size={train.global_batch_size} is not a multiple "
                          f"of train.micro_batch_size x data-parallel size = {micro}")
    inputs = MemoryInputs(
        tp=par.tensor_model_parallel_size, ep=par.expert_model_parallel_size,
        etp=par.expert_tensor_parallel_size, cp=par.context_parallel_size, dp=dp,
        cp_comm=planned_cp_comm(job), sequence_parallel=par.sequence_parallel,
        seq_length=train.seq_length, micro_batch_size=train.micro_batch_size,
        num_microbatches=train.global_batch_size // micro,
        microbatch_group=par.microbatch_group_size_per_vp_stage,
        **_precision_bytes(job), **_optimizer_inputs(job), **_model_path_inputs(job))
    inputs = dataclasses.replace(inputs, **changes)
    if (inputs.tp * inputs.cp * dp) % (inputs.ep * inputs.expert_tp):
        raise LayoutError(
            f"expert x expert-tensor parallel = {inputs.ep} x {inputs.expert_tp} must divide "
            f"TP x CP x DP = {inputs.tp} x {inputs.cp} x {dp}: raise the data-parallel size")
    return inputs


def planned_cp_comm(job: JobConfig) -> str:
    """parallel.cp_comm, auto resolved as the job resolves it for its fixed CP groups
    (``head_parallel_cp.job_cp_choice``)."""
    par = job.parallel
    if par.cp_comm != "auto":
        return par.cp_comm
    return job_cp_choice(job)[0] if par.context_parallel_size > 1 else "all_gather"


def _precision_bytes(job: JobConfig) -> dict:
    """Bytes per weight, optimizer-state element and activation value for train.params_dtype
    (gradients stay fp32: the MemoryInputs default)."""
    bf16 = job.train.params_dtype == "bf16"
    # fp32 training has no separate master copy: Adam's m and v only.
    return {"weight_bytes": 2 if bf16 else 4, "optimizer_bytes": 12 if bf16 else 8,
            "activation_bytes": 2 if bf16 else 4}


def _optimizer_inputs(job: JobConfig) -> dict:
    """Where the optimizer keeps its state and the gradients: sharding, Muon, host offload,
    Pipeline ZeRO2, and INT4 QAT's expert copies."""
    par = job.parallel
    return {"distributed_optimizer": par.use_distributed_optimizer, "muon": muon_mode(job),
            "optimizer_offload_fraction": (par.optimizer_offload_fraction
                                           if par.optimizer_cpu_offload else 0.0),
            "shard_grads": par.pipeline_zero2, "int4_qat": job.train.int4_qat}


def _model_path_inputs(job: JobConfig) -> dict:
    """Which paths the model runs: the DSA stage and attention, document masks, the loss
    head's chunking, recompute, and SDPA's fused kernels (with CUDA only)."""
    dsa = job.dsa
    return {"dsa_kl": bool(dsa.trains_indexer), "dsa_stage": dsa.stage,
            "frozen_indexer": dsa.freeze_indexer,
            "fused_attention": torch.cuda.is_available(),
            "absorbed_attention": dsa.sparse_attention == "absorbed",
            "sparse_kernel": dsa.sparse_kernel,
            "document_mask": bool(job.data.reset_attention_mask),
            "loss_chunk_tokens": job.activations.loss_chunk_tokens,
            "mtp_runs": job.runs_mtp,
            "head_entropy": job.train.objective != "lm",
            "recompute": job.activations.recompute()}


# ----------------------------------------------------------- what the inputs decide per path


def dsa_sparse(cfg: GLM5Config, inp: MemoryInputs) -> bool:
    """DSACoreAttention falls back to dense causal attention (and no KL) when every key of the
    whole sequence (all context-parallel ranks' tokens) fits; the dense stage (no indexer) and
    the dense warm-up attend densely whatever the sequence."""
    return cfg.index_topk < inp.seq_length and inp.dsa_stage == "sparse"


def takes_latent(cfg: GLM5Config, inp: MemoryInputs) -> bool:
    """MLA hands the core attention its latent key [n, C + R] instead of up-projected keys
    and values (DSACoreAttention.takes_latent): on the absorbed sparse path, and on every path
    under context parallelism (the latent is what crosses CP ranks)."""
    return (dsa_sparse(cfg, inp) and inp.absorbed_attention) or inp.cp > 1


def dense_warmup(inp: MemoryInputs) -> bool:
    """dsa.stage=dense_warmup: every parameter frozen but the indexer's."""
    return inp.dsa_stage == "dense_warmup"
