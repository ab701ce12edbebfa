"""The memory and compute a pipeline stage of GLM-5 costs, per micro-batch, in closed form.

Parameters come from ``glm5_train.model.param_count``'s formula, sharded as our model shards them
(TP-split projections, replicated down projections / norms / DSA indexer / router, routed
experts over EP x expert-TP); bytes per parameter follow the training precision and optimizer.
Activations are counted tensor by tensor as our implementation saves them for backward
(checked against a measured forward in ``tests/test_pipeline_plan.py``). Compute is forward +
backward FLOPs. Communication: the bytes a rank sends per micro-batch for context parallelism
(``dsa_context_parallel_comm``) and on its tensor-parallel groups
(``glm5_train.model.tensor_parallel_comm``), both checked against the communication meter of
measured runs.
``GLM5StageModel`` gives a whole stage's costs for ``parallel.pipeline_layout``, which places
them on stages and replays the pipeline schedule to find each rank's peak.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from itertools import accumulate

import torch

from glm5_train.model.config import GLM5Config
from glm5_train.model.param_count import Term, layer_terms, top_terms
from glm5_train.model.tensor_parallel_comm import (
    embedding_comm,
    head_comm,
    layer_comm,
    mtp_projection_comm,
)
from parallel.layout import LayoutError
from parallel.recompute import Recompute
from parallel.pipeline_layout import Comm, StageCosts, comm_of, comm_sum, comm_times


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
    # gathered); "head_parallel" is planned as if it were all_gather, its traffic left out.
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
    # dsa.stage: "dense_warmup" freezes all but the indexer, attends densely and runs the
    # model without autograd (``dense_indexer_kl_bytes``); "sparse": everything trains.
    dsa_stage: str = "sparse"
    # DSA's sparse attention on SDPA's fused kernels (CUDA); False: its math path (CPU, where
    # q/k and v widths differ). Dense attention pads to one width and is fused on both.
    fused_attention: bool = True
    document_mask: bool = False  # data.reset_attention_mask: packed documents' starts [b, s]
    # dsa.sparse_attention=absorbed: the sparse stage attends over the selected latent keys
    # (glm5_train.model.sparse_mla); False: masked dense SDPA (the reference path).
    absorbed_attention: bool = True
    # activations.loss_chunk_tokens: > 0 runs each head + loss chunked over tokens
    # (parallel.chunked_cross_entropy, no [n, V] logits kept); 0: megatron's whole-logits head.
    loss_chunk_tokens: int = 0
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


def muon_mode(job) -> str | None:
    """``MemoryInputs.muon`` of a job."""
    if job.train.optimizer != "muon":
        return None
    if not job.parallel.use_distributed_optimizer:
        return "plain"
    return "owners" if job.train.muon_zero_redundant else "naive"


def inputs_from_job(job, dp: int | None = None, **changes) -> MemoryInputs:
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
    bf16 = train.params_dtype == "bf16"
    dsa = getattr(job, "dsa", None)
    inputs = MemoryInputs(
        tp=par.tensor_model_parallel_size, ep=par.expert_model_parallel_size,
        etp=par.expert_tensor_parallel_size, cp=par.context_parallel_size, dp=dp,
        cp_comm=getattr(par, "cp_comm", "all_gather"),
        sequence_parallel=par.sequence_parallel, seq_length=train.seq_length,
        micro_batch_size=train.micro_batch_size,
        num_microbatches=train.global_batch_size // micro,
        microbatch_group=getattr(par, "microbatch_group_size_per_vp_stage", None),
        # fp32 training has no separate master copy: Adam's m and v only.
        weight_bytes=2 if bf16 else 4, optimizer_bytes=12 if bf16 else 8,
        activation_bytes=2 if bf16 else 4,
        distributed_optimizer=par.use_distributed_optimizer,
        muon=muon_mode(job),
        optimizer_offload_fraction=(par.optimizer_offload_fraction
                                    if getattr(par, "optimizer_cpu_offload", False) else 0.0),
        shard_grads=getattr(par, "pipeline_zero2", False),
        int4_qat=getattr(train, "int4_qat", False),
        dsa_kl=bool(getattr(dsa, "trains_indexer", True)),
        dsa_stage=getattr(dsa, "stage", "sparse"),
        fused_attention=torch.cuda.is_available(),
        absorbed_attention=getattr(dsa, "sparse_attention", "absorbed") == "absorbed",
        document_mask=bool(getattr(getattr(job, "data", None), "reset_attention_mask", False)),
        loss_chunk_tokens=getattr(getattr(job, "activations", None), "loss_chunk_tokens", 0),
        recompute=job.activations.recompute() if hasattr(job, "activations") else Recompute())
    inputs = dataclasses.replace(inputs, **changes)
    if (inputs.tp * inputs.cp * dp) % (inputs.ep * inputs.expert_tp):
        raise LayoutError(
            f"expert x expert-tensor parallel = {inputs.ep} x {inputs.expert_tp} must divide "
            f"TP x CP x DP = {inputs.tp} x {inputs.cp} x {dp}: raise the data-parallel size")
    return inputs


# -------------------------------------------------------------- activations per micro-batch
# Bytes each tensor saved for backward holds, per rank, as our implementation saves them
# (glm5_train/model/layers.py, dsa.py, dsa_loss.py; megatron-core's MLA, MoE and output layer).
# ``a`` is the activation dtype's size; fp32 internals are 4 bytes, int64 indices 8, masks 1.
# Checked: an fp32 CPU forward of the tiny model, MTP on and off, DSA sparse and dense (the
# latter with and without document masks) (tests), and the fused sparse-SDPA terms in bf16 on an
# H200. Recompute is modelled (``chunk_layers_part``, ``selective_recompute_savings``; checked
# on the tiny forward too, and per rank against the job's measured peaks: tests/
# test_activation_offload.py), as the job's meter counts it: what forward saves, an output-
# discarding checkpoint's emptied output at 0 bytes until backward refills it; not the tensors
# a recomputed unit saves again while its backward runs (backward-time saves, transient).
# Offloading: ``parallel.pipeline_layout.offload_peak`` on these bytes. Context parallelism
# (all-gather mode): every per-token term counts a rank's seq_length / CP tokens, except the
# tensors kept whole-sequence (``MemoryInputs.gathered_tokens``: the gathered latent and
# indexer keys, the keys and values dense paths up-project from the gathered latent); checked
# per rank against the job's measured peaks, both DSA stages, PP x VPP, offloading + selective
# recompute (tests/test_context_parallel_plan.py). Not modelled: transient workspace inside a
# layer's forward or backward, allocator fragmentation.


def rms_norm_bytes(tokens: int, width: int, inp: MemoryInputs) -> int:
    # glm5_train.model.layers.RMSNorm runs in fp32: it saves the fp32 input and the normalised fp32
    # product [tokens, width], the fp32 inverse rms per token, and (non-fp32 models) the
    # weight's fp32 copy.
    return 8 * tokens * width + 4 * tokens + (4 * width if inp.activation_bytes != 4 else 0)


def _swiglu_bytes(tokens: int, ffn: int, a: int) -> int:
    # fc1's output [t, 2F] (SiLU keeps its gate half), the SiLU output, the up half plus
    # megatron's glu offset (a new tensor), and the gated product that feeds fc2: 5F per token.
    return 5 * a * tokens * ffn


def attention_activation_bytes(cfg: GLM5Config, inp: MemoryInputs) -> int:
    """MLA + DSA of one decoder layer, input norm included."""
    a, n, n_sp, s = inp.activation_bytes, inp.tokens, inp.sp_tokens, inp.seq
    heads, q_rank = cfg.num_attention_heads // inp.tp, cfg.q_lora_rank
    C, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    total = rms_norm_bytes(n_sp, cfg.hidden_size, inp)
    total += a * n_sp * cfg.hidden_size  # normed input, shared by the q and kv down projections
    if q_rank:  # q latent norm + q_up's input (kept sequence-split under SP, gathered again)
        total += rms_norm_bytes(n_sp, q_rank, inp) + a * n_sp * q_rank
    total += rms_norm_bytes(n_sp, C, inp) + a * n_sp * C  # kv latent norm + kv_up's input
    if a == 4:  # in fp32 the kv norm's input aliases the whole [latent | rope key] output
        total += 4 * n_sp * R
    total += 4 * a * s * R  # RoPE cos and sin for q and k, per position
    total += _core_attention_bytes(cfg, inp, heads)
    total += a * n * heads * cfg.v_head_dim  # o_proj's input
    if dsa_sparse(cfg, inp) and inp.dsa_kl:
        total += _indexer_kl_bytes(cfg, inp)
    return total


def dsa_sparse(cfg: GLM5Config, inp: MemoryInputs) -> bool:
    """DSACoreAttention falls back to dense causal attention (and no KL) when every key of the
    whole sequence (all context-parallel ranks' tokens) fits; the dense warm-up attends densely
    whatever the sequence."""
    return cfg.index_topk < inp.seq_length and not dense_warmup(inp)


def takes_latent(cfg: GLM5Config, inp: MemoryInputs) -> bool:
    """MLA hands the core attention its latent key [n, C + R] instead of up-projected keys
    and values (DSACoreAttention.takes_latent): on the absorbed sparse path, and on every path
    under context parallelism (the latent is what crosses CP ranks)."""
    return (dsa_sparse(cfg, inp) and inp.absorbed_attention) or inp.cp > 1


def dense_warmup(inp: MemoryInputs) -> bool:
    """dsa.stage=dense_warmup: every parameter frozen but the indexer's."""
    return inp.dsa_stage == "dense_warmup"


def _core_attention_bytes(cfg: GLM5Config, inp: MemoryInputs, heads: int) -> int:
    a, n, keys = inp.activation_bytes, inp.tokens, inp.gathered_tokens
    dqk, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    if dsa_sparse(cfg, inp) and inp.absorbed_attention:
        return _absorbed_attention_bytes(cfg, inp, heads)
    latent = _cp_latent_up_projection_bytes(cfg, inp)
    if not dsa_sparse(cfg, inp):
        return _dense_attention_bytes(cfg, inp, heads) + latent
    if not inp.fused_attention:  # SDPA's math path (CPU, where it computes in fp32): copies
        # of the scaled q, k^T and v, and the probabilities [b, heads, s, S] (k, v: S keys)
        return 4 * heads * (n * dqk + keys * (dqk + dv)) + 4 * n * heads * inp.seq_length + latent
    # Fused kernels: q, k, v and the output, an fp32 log-sum-exp per head and query, and for
    # the top-k selection the additive [b, 1, s, S] mask the kernel keeps for backward.
    return (a * heads * (n + keys) * (dqk + dv) + 4 * n * heads + a * n * inp.seq_length
            + latent)


def _cp_latent_up_projection_bytes(cfg: GLM5Config, inp: MemoryInputs) -> int:
    """Under context parallelism every path that is not the absorbed one gets MLA's latent
    key and up-projects the whole sequence's latent itself (DSACoreAttention._dense_inputs):
    the gathered latent [N, C + R] is kept (the up-projection einsums save views of it), and
    so are copies of the W_UK / W_UV slices of the up-projection weight (non-contiguous views,
    copied by einsum's reshape); kv_up never runs, so its input, which
    ``attention_activation_bytes`` counts, is not kept: subtracted. Nothing without CP."""
    if inp.cp == 1:
        return 0
    a, latent = inp.activation_bytes, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    weights = a * (cfg.num_attention_heads // inp.tp) * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return (a * inp.gathered_tokens * latent + weights * cfg.kv_lora_rank
            - a * inp.sp_tokens * cfg.kv_lora_rank)


def _absorbed_attention_bytes(cfg: GLM5Config, inp: MemoryInputs, heads: int) -> int:
    """The absorbed sparse path (glm5_train.model.sparse_mla.AbsorbedSparseMLA, the same on
    CPU and GPU, torch path or Triton kernels): the query (backward recomputes the absorbed
    query from it), the latent key of the whole sequence [N, C + R] (gathered under SP, and
    over the context-parallel group: every CP rank keeps all N = micro-batch x seq_length
    rows), the latent output [n, heads, C] (W_UV's gradient), an fp32 log-sum-exp per head
    and query, and the int32 picks (counted with the indexer KL when it runs: the same
    tensor). The key/value up-projection never runs, so the kv latent that
    ``attention_activation_bytes`` counts as kv_up's input is not kept: subtracted here."""
    a, n, n_sp = inp.activation_bytes, inp.tokens, inp.sp_tokens
    dqk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    width, latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    total = (a * n * heads * (dqk + latent) + a * inp.gathered_tokens * width
             + 4 * n * heads)
    picks = 0 if inp.dsa_kl else 4 * n * min(cfg.index_topk, inp.seq_length)
    return total + picks - a * n_sp * latent


def _dense_attention_bytes(cfg: GLM5Config, inp: MemoryInputs, heads: int) -> int:
    """MLACoreAttention (glm5_train.model.layers.equal_width_attention): q, k, v zero-padded to
    one width D = max(Dqk, Dv) run SDPA's flash kernel (CPU; CUDA flash or memory-efficient),
    which keeps q, k, v and its D-wide output, and an fp32 log-sum-exp per head and query.
    Packed documents of whole sequences run one causal SDPA call per document
    (``DSACoreAttention._dense_by_document``): the same bytes, no mask. Under context
    parallelism (layers.attention_at_positions) k and v hold the whole
    sequence's N rows and the causal mask of this rank's positions is kept as the additive
    [s, S] one (the latent they come from: ``_cp_latent_up_projection_bytes``)."""
    a, n, s = inp.activation_bytes, inp.tokens, inp.seq
    width = max(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)
    if inp.cp > 1:
        return (2 * a * (n + inp.gathered_tokens) * heads * width + 4 * n * heads
                + a * s * inp.seq_length)
    return 4 * a * n * heads * width + 4 * n * heads


def _indexer_kl_bytes(cfg: GLM5Config, inp: MemoryInputs) -> int:
    """The indexer's second, differentiable pass for the sparse-stage KL (dsa_loss.py). Its
    inputs are gathered to the full sequence under SP and it is replicated over TP; its shared
    key is gathered over the context-parallel group (``gathered_tokens`` rows kept)."""
    a, n, s = inp.activation_bytes, inp.tokens, inp.seq
    Hi, Di, topk = cfg.index_n_heads, cfg.index_head_dim, min(cfg.index_topk, inp.seq_length)
    H = cfg.hidden_size
    q_in = cfg.q_lora_rank or H
    if inp.micro_batch_size > 1:  # [s, b] -> [b, s] inputs copy in each linear: qr for wq_b,
        total = a * n * (q_in + 2 * H)  # x for wk and for weights_proj
    else:  # a view: only the all-gathered full-sequence x and qr under SP are new tensors
        total = a * n * (q_in + H) if inp.sequence_parallel and inp.tp > 1 else 0
    total += a * n * Di + 8 * n  # wk's output and the key LayerNorm's mean and rstd
    total += 2 * a * s * cfg.qk_rope_head_dim  # RoPE cos and sin for indexer q and k
    # Scored at the selected keys only, the KL fused (dsa._SelectedKL): it keeps the RoPE'd
    # q and k in the activation dtype (k: the whole sequence's, gathered over CP), the fp32
    # head weights and each query's fp32 log-sum-exp, and recomputes the gathered keys, the
    # [b, s, K, Hi] logits and the scores in backward; nothing grows with s x s.
    total += a * (n * Hi * Di + inp.gathered_tokens * Di) + 4 * n * Hi + 4 * n
    return total + 8 * n * topk  # the int32 picks and the fp32 target per pick


def mlp_activation_bytes(cfg: GLM5Config, moe: bool, inp: MemoryInputs) -> int:
    """Pre-MLP norm plus the dense SwiGLU MLP or the MoE block of one decoder layer."""
    a, n, n_sp, H = inp.activation_bytes, inp.tokens, inp.sp_tokens, cfg.hidden_size
    total = rms_norm_bytes(n_sp, H, inp) + a * n_sp * H  # norm + its output (fc1's input)
    if not moe:
        return total + _swiglu_bytes(n, cfg.intermediate_size // inp.tp, a)
    E, k, F = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    # Router: fp32 logits and probabilities and the bool routing map [n, E]; top-k ids (int64)
    # and probabilities, the sorted token ids of the permutation (int64), a score per token.
    total += 9 * n_sp * E + 20 * n_sp * k + 4 * n_sp
    if cfg.n_shared_experts:
        total += _swiglu_bytes(n, cfg.n_shared_experts * F // inp.tp, a)
    # Routed copies per rank: the all-to-all leaves each rank its SP tokens x top-k on average;
    # expert-TP gathers the TP group's tokens. Each keeps its permuted input, SwiGLU, the
    # product scaled by its routing probability (one more [t, F]) and that fp32 probability.
    routed = k * (n_sp * inp.expert_tp if inp.sequence_parallel else n)
    ffn = F // inp.expert_tp
    return total + a * routed * H + _swiglu_bytes(routed, ffn, a) + a * routed * ffn + 4 * routed


def decoder_layer_activation_bytes(cfg: GLM5Config, moe: bool, inp: MemoryInputs) -> int:
    """One decoder layer not under full recompute (``chunk_layers_part`` applies that)."""
    if dense_warmup(inp):  # the grad-free forward keeps nothing (its KL: a transient)
        return 0
    return (attention_activation_bytes(cfg, inp) + mlp_activation_bytes(cfg, moe, inp)
            - selective_recompute_savings(cfg, moe, inp))


# ------------------------------------------------------------------------- DSA dense warm-up
# Every weight is frozen but the indexers', whose inputs are detached: the model runs its
# forward without autograd (glm5.GLM5Model.forward, grad_free_forward) and each DSA layer
# (decoder and MTP) runs its indexer KL's backward at once (DSACoreAttention._kl_backward_now).
# So no layer, norm, head or embedding keeps anything for a backward: a stage holds per
# micro-batch only its received input (glm5.GradientBridge saves it; megatron holds it until
# the backward anyway), and while one layer's KL runs, that KL's graph
# (``dense_indexer_kl_bytes``): the stage's transient, on top of the micro-batches in flight
# (``parallel.pipeline_layout.StageCosts.transient_activation_bytes``). Checked: the tiny
# fp32 forward as the job runs it, 1 stage, MTP on and off, chunked head, document masks
# (tests/test_pipeline_plan.py), and the job's measured per-rank peaks, 1 process and
# PP2 x VPP2 (tests/test_activation_offload.py).


def dense_indexer_kl_bytes(cfg: GLM5Config, inp: MemoryInputs) -> int:
    """One layer's indexer projections and chunked dense KL (dsa_loss._DenseKL) while its
    local backward runs: the detached inputs its linears keep (x for wk and weights_proj, qr
    for wq_b: views, or under SP the gathered full sequence; copies with micro-batches > 1,
    where [s, b] -> [b, s] is not contiguous), wk's output and the key LayerNorm's fp32 mean
    and rstd, RoPE's cos and sin, and the KL Function's inputs: the indexer's RoPE'd q and k,
    the fp32 head weights, the main attention's query and key, and packed documents' int64
    document start per token. Under context parallelism the keys (the indexer's and the main
    attention's, up-projected from the gathered latent) are the whole sequence's: N rows."""
    a, n, s, H = inp.activation_bytes, inp.tokens, inp.seq, cfg.hidden_size
    keys = inp.gathered_tokens
    Hi, Di, q_in = cfg.index_n_heads, cfg.index_head_dim, cfg.q_lora_rank
    if inp.micro_batch_size > 1:
        total = a * n * ((q_in or H) + 2 * H)
    else:  # without a q latent, qr is x itself
        total = a * n * (q_in + H)
    total += a * n * Di + 8 * n + 2 * a * s * cfg.qk_rope_head_dim
    total += a * (n * Hi * Di + keys * Di) + 4 * n * Hi
    dqk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    total += a * (n + keys) * (cfg.num_attention_heads // inp.tp) * dqk
    return total + (8 * n if inp.document_mask else 0)


# ---------------------------------------------------------------------------------- recompute


def recompute_unit_input_bytes(cfg: GLM5Config, inp: MemoryInputs) -> int:
    """Full recompute: what a unit keeps, its input hidden states (the checkpoint's saved
    input; attention mask and RoPE tensors are shared by all layers)."""
    return inp.activation_bytes * inp.sp_tokens * cfg.hidden_size


def selective_recompute_savings(cfg: GLM5Config, moe: bool, inp: MemoryInputs) -> int:
    """Bytes selective recompute (parallel.recompute) no longer keeps in one decoder layer."""
    rc, a, n, n_sp = inp.recompute, inp.activation_bytes, inp.tokens, inp.sp_tokens
    saved = 0
    if rc.selects("moe_act") and moe:
        # SwiGLU keeps only fc1's output [t, 2F] (the checkpoint's input) of its 5F per token;
        # routed copies also drop the probability-scaled product (fc2's input, one more F).
        F = cfg.moe_intermediate_size
        if cfg.n_shared_experts:
            saved += 3 * a * n * (cfg.n_shared_experts * F // inp.tp)
        routed = cfg.num_experts_per_tok * (n_sp * inp.expert_tp if inp.sequence_parallel else n)
        saved += 4 * a * routed * (F // inp.expert_tp)
    if rc.selects("mla_up_proj"):
        # megatron recomputes q_up, kv_up and RoPE from the latents (kept: they were q_up's and
        # kv_up's inputs anyway): the RoPE cos / sin go; the fp32 frequencies [s, R] the
        # checkpoint keeps as its input are the rotary module's cached tensor, one per layer
        # for every micro-batch (not per micro-batch: left out); q, k, v are freed after the
        # core attention, which frees what it keeps of them as they are (not its own copies).
        saved += 4 * a * inp.seq * cfg.qk_rope_head_dim
        if inp.cp > 1:  # a context-parallel rank's frequencies are taken at its positions,
            # a new fp32 [s, R] tensor per layer call, kept as the checkpoint's input
            saved -= 4 * inp.seq * cfg.qk_rope_head_dim
        # With core_attn too its checkpoint keeps all of q, k, v as inputs: all are freed.
        saved += (_up_projection_output_bytes(cfg, inp) if rc.selects("core_attn")
                  else _up_projection_outputs_kept_by_core(cfg, inp))
        if takes_latent(cfg, inp):
            # The latent path runs no kv_up, so without recompute nothing keeps the normed
            # kv latent; the checkpoint keeps it as its input.
            saved -= inp.activation_bytes * inp.sp_tokens * cfg.kv_lora_rank
        # Its rope-key input holds a storage: counted already only where the kv latent
        # norm's fp32 input aliases that same [latent | rope key] output
        # (attention_activation_bytes).
        if not _rope_key_input_aliases_the_norm(inp):
            saved -= _rope_key_input_bytes(cfg, inp)
    if rc.selects("core_attn"):
        # DSACoreAttention.recompute_core: a checkpoint keeps only its inputs, q, k, v whole
        # and x, qr (kept anyway by the down / q_up projections); the attention's and the
        # indexer KL's saved tensors go (they include what the core kept of q, k, v).
        saved += _core_attention_bytes(cfg, inp, cfg.num_attention_heads // inp.tp)
        if dsa_sparse(cfg, inp) and inp.dsa_kl:
            saved += _indexer_kl_bytes(cfg, inp)
        saved -= _up_projection_output_bytes(cfg, inp)
        if takes_latent(cfg, inp):
            # The latent path's core bytes net out the kv latent nothing keeps there (see
            # _absorbed_attention_bytes): a layer property, not a saved tensor of the core.
            saved += inp.activation_bytes * inp.sp_tokens * cfg.kv_lora_rank
    return saved


def _rope_key_input_bytes(cfg: GLM5Config, inp: MemoryInputs) -> int:
    """The storage the up-projection checkpoint's rope-key input keeps: a view of the kv down
    projection's whole [latent | rope key] output, or under SP over TP > 1 the gathered rope
    key [n, R]."""
    if inp.sequence_parallel and inp.tp > 1:
        return inp.activation_bytes * inp.tokens * cfg.qk_rope_head_dim
    return inp.activation_bytes * inp.sp_tokens * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)


def _rope_key_input_aliases_the_norm(inp: MemoryInputs) -> bool:
    """In fp32 the kv latent norm saves (a view of) the down projection's output itself."""
    return inp.activation_bytes == 4 and not (inp.sequence_parallel and inp.tp > 1)


def checkpoint_leaf_bytes(cfg: GLM5Config, moe: bool, inp: MemoryInputs) -> int:
    """Saved bytes of one decoder layer that activation offloading cannot free under selective
    recompute: megatron-core's output-discarding checkpoint (``CheckpointWithoutOutput``: MLA's
    up-projection, our experts' SwiGLU) saves its inputs as detached autograd leaves, and
    autograd keeps a saved leaf itself even when saved-tensor hooks pack it. Kept: the q and kv
    latents and the rope-key input (``mla_up_proj``), each expert's fc1 output and routing
    probability (``moe_act``)."""
    rc, a, n, n_sp = inp.recompute, inp.activation_bytes, inp.tokens, inp.sp_tokens
    kept = 0
    if rc.selects("mla_up_proj"):
        q_latent = cfg.q_lora_rank or cfg.hidden_size  # without q_lora: the normed input
        kept += a * n_sp * (q_latent + cfg.kv_lora_rank) + _rope_key_input_bytes(cfg, inp)
        if inp.cp > 1:  # and this context-parallel rank's RoPE frequencies (fp32 [s, R])
            kept += 4 * inp.seq * cfg.qk_rope_head_dim
    if rc.selects("moe_act") and moe:
        F = cfg.moe_intermediate_size
        routed = cfg.num_experts_per_tok * (n_sp * inp.expert_tp if inp.sequence_parallel else n)
        kept += 2 * a * routed * (F // inp.expert_tp) + 4 * routed
        if cfg.n_shared_experts:
            kept += 2 * a * n * (cfg.n_shared_experts * F // inp.tp)
    return kept


def _up_projection_output_bytes(cfg: GLM5Config, inp: MemoryInputs) -> int:
    """MLA's q, k, v as handed to the core attention (the latent path: the query and this
    rank's latent key [n, C + R], no value)."""
    a, n, heads = inp.activation_bytes, inp.tokens, cfg.num_attention_heads // inp.tp
    q_or_k = n * heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    if takes_latent(cfg, inp):
        return a * (q_or_k + n * (cfg.kv_lora_rank + cfg.qk_rope_head_dim))
    return a * (2 * q_or_k + n * heads * cfg.v_head_dim)


def _up_projection_outputs_kept_by_core(cfg: GLM5Config, inp: MemoryInputs) -> int:
    """Bytes of MLA's q, k, v (the up projections' outputs) that the core attention saves as
    they are, views included: SDPA's fused kernels keep all three; its CPU math path (DSA
    sparse, unequal widths) copies q and k but keeps v; the dense path pads the narrower side
    to one width (a copy) and keeps the other side's tensors. Under context parallelism the
    core keeps the gathered latent and its own up-projections, never this rank's latent key:
    of the up projections' outputs only the query, where the kernel keeps it as it is."""
    a, n, heads = inp.activation_bytes, inp.tokens, cfg.num_attention_heads // inp.tp
    q_or_k, v = n * heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), n * heads * cfg.v_head_dim
    dqk, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    absorbed = dsa_sparse(cfg, inp) and inp.absorbed_attention
    if inp.cp > 1:
        keeps_query = absorbed or (dqk >= dv if not dsa_sparse(cfg, inp)
                                   else inp.fused_attention)
        return a * q_or_k if keeps_query else 0
    if absorbed:  # the query and the latent key
        return a * (q_or_k + n * (cfg.kv_lora_rank + cfg.qk_rope_head_dim))
    if not dsa_sparse(cfg, inp):
        return a * ((2 * q_or_k if dqk >= dv else 0) + (v if dv >= dqk else 0))
    return a * (2 * q_or_k + v) if inp.fused_attention else a * v


def chunk_layers_part(cfg: GLM5Config, layer: dict[bool, Part], moe_flags: list[bool],
                      inp: MemoryInputs, input_counted: bool) -> Part:
    """The decoder layers of one pipeline chunk (``layer``: a layer's Part, dense and MoE;
    ``moe_flags`` per layer, in order) under full recompute: a recomputed layer keeps nothing
    but its unit's input and costs one more forward (a third of its forward + backward flops).
    ``input_counted``: the chunk's input is already counted (a received stage input)."""
    part = Part()
    for moe in moe_flags:
        part += layer[moe]
    rc = inp.recompute
    redone = [layer[moe] for moe in moe_flags[:rc.recomputed_layers(len(moe_flags))]]
    if not redone:
        return part
    units = rc.units(len(moe_flags)) - (1 if input_counted else 0)
    dropped = sum(p.activation_bytes for p in redone)
    return part + Part(activation_bytes=units * recompute_unit_input_bytes(cfg, inp) - dropped,
                       flops=sum(p.flops for p in redone) // 3,
                       comm=comm_sum(*(p.forward_comm for p in redone)))


def loss_head_activation_bytes(cfg: GLM5Config, inp: MemoryInputs) -> int:
    """One output head + cross-entropy. Megatron's (loss_chunk_tokens 0): the head's input
    (sequence-split under SP) and its fp32 softmax [n, V/TP], plus the target mask (bool) and
    ids (int64). Chunked: the head's input (sequence-split under SP: gathered again in
    backward, as megatron's linear does), the labels (int64) and an fp32 log-sum-exp per token
    of the whole sequence; each chunk's logits live only inside the forward or backward."""
    n, head_input = inp.tokens, inp.activation_bytes * inp.sp_tokens * cfg.hidden_size
    if not head_keeps_input(inp):  # dense warm-up: the grad-free forward keeps nothing
        return 0
    if inp.loss_chunk_tokens > 0:
        return head_input + 12 * n
    return head_input + 4 * n * (cfg.vocab_size // inp.tp) + 9 * n


def head_keeps_input(inp: MemoryInputs) -> bool:
    """Every head (chunked or megatron's) keeps its input, except in the dense warm-up, whose
    forward runs without autograd."""
    return not dense_warmup(inp)


def mtp_step_activation_bytes(cfg: GLM5Config, inp: MemoryInputs) -> int:
    """One MTP step: rolled token ids, enorm, hnorm, eh_proj's input [n, 2H], the MoE layer,
    and the MTP final norm. Under full-uniform recompute megatron checkpoints all but the
    embedding: the rolled ids and the unit's two inputs (hidden states, embedding) stay."""
    if dense_warmup(inp):  # the grad-free forward keeps nothing (its KL: a transient)
        return 0
    if inp.recompute.mtp_steps_recomputed:
        return 8 * inp.tokens + 2 * recompute_unit_input_bytes(cfg, inp)
    n_sp, H = inp.sp_tokens, cfg.hidden_size
    norms = 3 * rms_norm_bytes(n_sp, H, inp)
    return (8 * inp.tokens + norms + 2 * inp.activation_bytes * n_sp * H
            + decoder_layer_activation_bytes(cfg, True, inp))


# ------------------------------------------------------------ context-parallel communication
# Bytes each rank sends per micro-batch on the context-parallel group, by parallel.comm_meter's
# rules (an all-gather of a local [n, w] tensor over c ranks sends (c - 1) x n x w values, the
# reduce-scatter of its gradient the same), as glm5_train/model/dsa.py gathers: per DSA layer
# application (decoder layer or MTP step) each rank gathers its n tokens' latent key (C + R
# values: the normed kv latent and the RoPE key) and the indexer's key (Di values), queries
# stay local, and the backward reduce-scatters the gradients of what trains. Checked against
# the meter's counts of the CP layouts' runs (tests/test_context_parallel_plan.py).

CP_GATHER, CP_SCATTER, WORLD_SEND = "all_gather:cp", "reduce_scatter:cp", "send:world"


def dsa_context_parallel_comm(cfg: GLM5Config, inp: MemoryInputs, forwards: int = 1) -> Comm:
    """One DSA layer application of one micro-batch; ``forwards``: 2 when recompute runs its
    core attention again in backward (the gathers repeat, the reduce-scatters do not: the
    first forward kept no graph). Sparse stage: latent and indexer keys gathered, the latent's
    gradient returned, the indexer key's when the KL trains it. Dense warm-up: the forward
    runs without autograd, so only the indexer key's gradient (its KL's own backward) goes
    back. Dense fallback (every key selected): the latent alone, no indexer. The head-parallel
    mode's all-to-alls are not modelled (nothing counted)."""
    if inp.cp == 1 or inp.cp_comm != "all_gather":
        return ()
    latent, index = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.index_head_dim
    trained_index = index if inp.dsa_kl else 0
    if dense_warmup(inp):
        gathered, scattered = latent + index, trained_index
    elif dsa_sparse(cfg, inp):
        gathered, scattered = latent + index, latent + trained_index
    else:
        gathered = scattered = latent
    values = (inp.cp - 1) * inp.tokens * inp.activation_bytes
    return comm_sum(((CP_GATHER, forwards * values * gathered), (CP_SCATTER, values * scattered)))


def recomputed_forward_comm(comm: Comm) -> Comm:
    """What a recomputed forward sends again: its gathers."""
    return ((CP_GATHER, comm_of(comm, CP_GATHER)),) if comm_of(comm, CP_GATHER) else ()


def mtp_targets_comm(inp: MemoryInputs) -> Comm:
    """The loss stage's MTP targets come from the whole sequence's labels (int64), loss mask
    (fp32) and token ids (int64), gathered once per micro-batch (glm5.GLM5Model)."""
    if inp.cp == 1:
        return ()
    return ((CP_GATHER, (inp.cp - 1) * inp.tokens * (8 + 4 + 8)),)


def mtp_roll_comm(inp: MemoryInputs) -> Comm:
    """One MTP step's rolls of the token ids and positions (int64) by megatron-core's CP
    roll_tensor: each rank sends one boundary element per sequence to each neighbour it has
    (the first and last CP ranks one, the others two; the most is counted), p2p on the default
    group."""
    if inp.cp == 1:
        return ()
    neighbours = 1 if inp.cp == 2 else 2
    return ((WORLD_SEND, 2 * neighbours * 8 * inp.micro_batch_size),)


# ------------------------------------------------------------- parameters, compute, stages

# Components split over TP ranks; the rest of a layer (down projections, norms, indexer,
# router) is replicated in our model, and routed experts split over EP x expert-TP.
TP_SPLIT = frozenset({"q_up", "kv_up", "o_proj", "dense_mlp", "shared_expert"})


@dataclass(frozen=True)
class Part:
    """One piece of a stage per rank: dense and expert parameters (they shard over different
    data-parallel groups), activation bytes and flops (forward + backward) per micro-batch,
    transient bytes (held only while one of its pieces runs: a stage's is its largest), and
    the bytes it sends per micro-batch that the model counts (``dsa_context_parallel_comm``,
    ``glm5_train.model.tensor_parallel_comm``) and of those what one more forward sends again
    (``forward_comm``: full recompute's). ``adamw_params``: the dense parameters Muon leaves to
    AdamW (``adamw_elements``)."""

    dense_params: int = 0
    expert_params: int = 0
    activation_bytes: int = 0
    flops: int = 0
    transient_bytes: int = 0
    comm: Comm = ()
    adamw_params: int = 0
    forward_comm: Comm = ()

    def __add__(self, other: Part) -> Part:
        return Part(self.dense_params + other.dense_params,
                    self.expert_params + other.expert_params,
                    self.activation_bytes + other.activation_bytes, self.flops + other.flops,
                    max(self.transient_bytes, other.transient_bytes),
                    comm_sum(self.comm, other.comm), self.adamw_params + other.adamw_params,
                    comm_sum(self.forward_comm, other.forward_comm))

    def times(self, k: int) -> Part:
        return Part(k * self.dense_params, k * self.expert_params, k * self.activation_bytes,
                    k * self.flops, self.transient_bytes if k else 0, comm_times(self.comm, k),
                    k * self.adamw_params, comm_times(self.forward_comm, k))


# What Muon leaves to AdamW (parallel/muon.py): every tensor that is not a matrix (norms,
# biases), and the embedding, output head and router matrices.
ADAMW_MATRICES = frozenset({"embedding", "output_head", "router"})


def adamw_elements(term: Term) -> int:
    """Elements of ``term`` that Muon's optimizer steps with AdamW (whole, before TP)."""
    if term.key in ADAMW_MATRICES:
        return term.count
    return term.repeat * sum(math.prod(s) for s in term.shapes if len(s) != 2)


def _attention_flops(cfg: GLM5Config, inp: MemoryInputs) -> int:
    b, s, sparse = inp.micro_batch_size, inp.seq_length, dsa_sparse(cfg, inp)
    # The masked-dense sparse path runs dense SDPA under a top-k mask: every pair costs.
    pairs = b * s * s if sparse else b * s * (s + 1) // 2
    dims = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    core = 6 * pairs * cfg.num_attention_heads * dims // (inp.tp * inp.cp)
    if sparse and inp.absorbed_attention:
        # Absorbed: K picks per query over the D = C + R latent; multiply-adds per pick and
        # head: forward D (logits) + C (output), backward D (recomputed logits) + C (dp) +
        # D (dq) + 2D (key/value gradients, one matmul over 2N). The absorption and the W_UV
        # up-projection cost what the key/value up-projection did (counted with the weights).
        width, latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
        picks = b * s * min(cfg.index_topk, s)
        core = 2 * picks * cfg.num_attention_heads * (5 * width + 2 * latent) // (inp.tp * inp.cp)
    if not sparse:
        return core
    # The indexer (replicated over TP) scores the causal pairs for the blockwise selection;
    # the KL scores the K selected keys per query, and its backward recomputes them and takes
    # the q and k gradients: four passes over s x K pairs.
    index_pairs = b * s * (s + 1) // 2 + (4 * b * s * min(cfg.index_topk, s) if inp.dsa_kl else 0)
    return core + 2 * index_pairs * cfg.index_n_heads * cfg.index_head_dim // inp.cp


def layer_part(cfg: GLM5Config, moe: bool, inp: MemoryInputs) -> Part:
    dense = expert = active = adamw = 0
    for term in layer_terms(cfg, moe):
        if term.key == "routed_experts":
            expert += term.count // (inp.ep * inp.expert_tp)
            active += term.count * cfg.num_experts_per_tok // cfg.n_routed_experts
        else:
            split = inp.tp if term.key in TP_SPLIT else 1
            dense += term.count // split
            adamw += adamw_elements(term) // split
            active += term.count
    flops = (6 * active * inp.tokens // inp.tp + _attention_flops(cfg, inp)
             + selective_recompute_flops(cfg, inp))
    forwards = 2 if inp.recompute.selects("core_attn") else 1  # its checkpoint gathers again
    cp = dsa_context_parallel_comm(cfg, inp, forwards)
    tp, tp_again = layer_comm(cfg, moe, inp)
    return Part(dense, expert, decoder_layer_activation_bytes(cfg, moe, inp), flops,
                local_kl_transient_bytes(cfg, inp), comm_sum(cp, tp), adamw,
                comm_sum(recomputed_forward_comm(cp), tp_again))


def local_kl_transient_bytes(cfg: GLM5Config, inp: MemoryInputs) -> int:
    """A DSA layer's transient: its KL's graph in the dense warm-up (none otherwise)."""
    return dense_indexer_kl_bytes(cfg, inp) if dense_warmup(inp) and inp.dsa_kl else 0


def selective_recompute_flops(cfg: GLM5Config, inp: MemoryInputs) -> int:
    """The extra forward selective recompute runs in backward (matmuls; the expert SwiGLU is
    elementwise): the MLA up projections, the core attention with its indexer."""
    rc, heads = inp.recompute, cfg.num_attention_heads // inp.tp
    flops = 0
    if rc.selects("mla_up_proj"):
        dqk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        widths = (cfg.q_lora_rank or cfg.hidden_size) * heads * dqk
        widths += cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        flops += 2 * inp.tokens * widths
    if rc.selects("core_attn"):
        flops += _attention_flops(cfg, inp) // 3
    return flops


def mtp_layer_params(cfg: GLM5Config) -> int:
    """One MTP parameter set as megatron-core builds it: an MoE layer, eh_proj [H, 2H] and
    enorm, hnorm, final norm (HF's count less the expert bias, a buffer in megatron)."""
    H = cfg.hidden_size
    return sum(t.count for t in layer_terms(cfg, True)) + 2 * H * H + 3 * H


def vocab_part(cfg: GLM5Config, inp: MemoryInputs, key: str) -> Part:
    count = next(t.count for t in top_terms(cfg) if t.key == key)
    return Part(dense_params=count // inp.tp, adamw_params=count // inp.tp)


def mtp_part(cfg: GLM5Config, inp: MemoryInputs) -> Part:
    H, sets, steps = cfg.hidden_size, mtp_sets(cfg), mtp_steps(cfg)
    layer = layer_part(cfg, True, inp)
    eh_proj = 2 * H * H // inp.tp
    params = Part(dense_params=layer.dense_params + eh_proj + 3 * H,
                  expert_params=layer.expert_params,
                  adamw_params=layer.adamw_params + 3 * H).times(sets)  # + its 3 norms
    flops = layer.flops + 6 * 2 * H * H * inp.tokens // inp.tp
    projection = mtp_projection_comm(cfg, inp)  # its embedding lookup is not recomputed
    comm = comm_sum(layer.comm, mtp_roll_comm(inp), *projection,
                    embedding_comm(cfg, inp, trains=not dense_warmup(inp)))
    if inp.recompute.mtp_steps_recomputed:  # each step's forward once more in backward
        flops += flops // 3
        comm = comm_sum(comm, layer.forward_comm, projection[0])
    return params + Part(activation_bytes=mtp_step_activation_bytes(cfg, inp), flops=flops,
                         transient_bytes=layer.transient_bytes, comm=comm).times(steps)


def head_part(cfg: GLM5Config, inp: MemoryInputs, heads: int) -> Part:
    """Output head(s) on the last stage: the main loss plus one per MTP step. The chunked
    head's backward recomputes the logits GEMM: 4 GEMMs of 2 V H n flops instead of 3."""
    gemms = 4 if inp.loss_chunk_tokens > 0 else 3
    flops = 2 * gemms * cfg.vocab_size * cfg.hidden_size * inp.tokens // inp.tp
    return vocab_part(cfg, inp, "output_head") + Part(
        activation_bytes=loss_head_activation_bytes(cfg, inp), flops=flops,
        comm=head_comm(cfg, inp)).times(heads) + Part(
        comm=mtp_targets_comm(inp) if heads > 1 else ())


# Host-resident optimizer state per parameter element (parallel/host_optimizer.py): the fp32
# copy it steps, its gradient copied over, AdamW's exp_avg and exp_avg_sq.
HOST_OPTIMIZER_BYTES = 16


def stage_costs(part: Part, inp: MemoryInputs) -> StageCosts:
    d, e = part.dense_params, part.expert_params
    sharded = -(-d // (inp.dp * inp.cp)) - (-e // inp.expert_dp)  # per rank, rounded up
    grads = sharded if inp.shard_grads else d + e
    if inp.muon:
        device, host = muon_state_bytes(part, inp)
    else:
        states = sharded if inp.distributed_optimizer else d + e
        on_host = round(states * inp.optimizer_offload_fraction)
        device = inp.optimizer_bytes * (states - on_host)
        host = HOST_OPTIMIZER_BYTES * on_host
    return StageCosts(inp.weight_bytes * (d + e), inp.grad_bytes * grads, device,
                      part.activation_bytes, part.flops, zero2_accumulated_bytes(d, e, inp),
                      part.transient_bytes, part.comm, dense_params=d, expert_params=e,
                      host_bytes=host,
                      # train.int4_qat: each routed expert weight's dequantised INT4 copy
                      buffer_bytes=inp.weight_bytes * e if inp.int4_qat else 0)


def zero2_accumulated_bytes(dense: int, expert: int, inp: MemoryInputs) -> int:
    """Pipeline ZeRO2: a stage's gradients that pass through the accumulation buffers, those
    of parameters with more than one data-parallel rank (the others accumulate in place)."""
    if not inp.shard_grads:
        return 0
    shared = dense * (inp.dp * inp.cp > 1) + expert * (inp.expert_dp > 1)
    return inp.grad_bytes * shared


# Muon's state per element (parallel/muon.py, parallel/distributed_muon.py): a matrix keeps an
# fp32 momentum, what AdamW steps its two fp32 moments; bf16/fp16 parameters add an fp32
# master of every element (megatron-core's, on the distributed optimizer's slices), and
# distributed Muon's owner of a matrix keeps another of the whole matrix.
MUON_MOMENTUM_BYTES = 4
ADAMW_MOMENT_BYTES = 8
MASTER_BYTES = 4


def muon_state_bytes(part: Part, inp: MemoryInputs) -> tuple[int, int]:
    """(device, host) bytes of Muon's optimizer state for one stage's part on one rank. Host:
    the AdamW part's moments with its value and gradient copies (``optimizer_cpu_offload``,
    all of it: Muon takes no other fraction). Distributed Muon's matrices are planned as an
    even 1/dp share per rank: their owners are balanced by Newton-Schulz cost, not bytes
    (the data-parallel group's total is exact)."""
    d, e, a = part.dense_params, part.expert_params, part.adamw_params
    matrices_d = d - a  # every expert parameter is a matrix
    master = MASTER_BYTES if inp.weight_bytes < 4 else 0
    dense_ranks = inp.dp * inp.cp if inp.distributed_optimizer else 1
    expert_ranks = inp.expert_dp if inp.distributed_optimizer else 1
    adamw = -(-a // dense_ranks)
    slices = -(-d // dense_ranks) - (-e // expert_ranks)  # megatron-core's masters (bf16)
    if inp.muon == "owners":
        matrices = matrices_d / dense_ranks + e / expert_ranks
    else:  # plain, or naive: every rank keeps every matrix's state
        matrices = matrices_d + e
    owner_master = master if inp.muon in ("owners", "naive") else 0
    device = (master * slices + round((MUON_MOMENTUM_BYTES + owner_master) * matrices)
              + ADAMW_MOMENT_BYTES * adamw)
    if inp.optimizer_offload_fraction:
        return device - ADAMW_MOMENT_BYTES * adamw, HOST_OPTIMIZER_BYTES * adamw
    return device, 0


def final_norm_stage(counts: list[int], mtp_stage: int | None) -> int:
    """The stage holding the final norm, for decoder layers per stage ``counts``: megatron-core
    puts it after the last decoder layer with MTP, else on the output (last) stage."""
    if mtp_stage is None:
        return len(counts) - 1
    return next((s for s in range(len(counts) - 1, -1, -1) if counts[s]), 0)


class GLM5StageModel:
    """GLM-5's per-stage costs of a layout shape (stage count, MTP stage) for any layer counts:
    a ``parallel.pipeline_layout.StageCostModel``."""

    def __init__(self, cfg: GLM5Config, inp: MemoryInputs, num_stages: int,
                 mtp_stage: int | None) -> None:
        self.cfg, self.inp, self.last, self.mtp_stage = cfg, inp, num_stages - 1, mtp_stage
        self.dense_prefix = cfg.first_k_dense_replace
        steps = mtp_steps(cfg) if mtp_stage is not None else 0
        self.layer = {moe: layer_part(cfg, moe, inp) for moe in (False, True)}
        self.embedding = vocab_part(cfg, inp, "embedding")
        # The embedding lookup's ids (int64), kept for its weight gradient: none when frozen.
        self.token_ids = Part(activation_bytes=0 if dense_warmup(inp) else 8 * inp.tokens,
                              comm=embedding_comm(cfg, inp, trains=not dense_warmup(inp)))
        hidden = Part(activation_bytes=inp.activation_bytes * inp.sp_tokens * cfg.hidden_size)
        self.stage_input = hidden  # megatron keeps each received input until its backward
        self.concat_input = hidden.times(1 + steps)  # main + MTP hidden states, concatenated
        self.mtp = mtp_part(cfg, inp) if mtp_stage is not None else Part()
        self.head = head_part(cfg, inp, 1 + steps)
        norm_bytes = 0 if dense_warmup(inp) else rms_norm_bytes(inp.sp_tokens, cfg.hidden_size,
                                                                 inp)
        self.final_norm = Part(dense_params=cfg.hidden_size, activation_bytes=norm_bytes,
                               adamw_params=cfg.hidden_size)
        self._cache: dict[tuple[int, int, int, bool], StageCosts] = {}

    def final_norm_stage(self, counts: list[int]) -> int:
        return final_norm_stage(counts, self.mtp_stage)

    def dense_layers(self, start: int, count: int) -> int:
        """Dense-MLP layers among decoder layers start .. start + count - 1."""
        return max(0, min(start + count, self.cfg.first_k_dense_replace) - start)

    def part(self, stage: int, dense: int, count: int, final_norm: bool) -> Part:
        # Dense layers come first (GLM-5's first_k_dense_replace); a stage > 0 received its
        # input, counted below, which its first full-recompute unit keeps.
        part = chunk_layers_part(self.cfg, self.layer, [False] * dense + [True] * (count - dense),
                                 self.inp, input_counted=stage > 0)
        if stage == 0:
            part += self.embedding + self.token_ids
        else:
            after_mtp = self.mtp_stage is not None and stage > self.mtp_stage
            part += self.concat_input if after_mtp else self.stage_input
            part += Part(activation_bytes=-self._received_input_saved_again(stage, count))
        if stage == self.mtp_stage:  # MTP re-embeds: a stage other than 0 holds a copy
            part += self.mtp + (self.embedding if stage else Part())
        if stage == self.last:
            tied = self.cfg.tie_word_embeddings and stage  # the tied head's copy
            part += self.head + (self.embedding if tied else Part())
        return part + self.final_norm if final_norm else part

    def _received_input_saved_again(self, stage: int, count: int) -> int:
        """Bytes of a stage's received input (counted once above) that its first consumer's
        terms count again, being that very storage: the output heads after the MTP stage
        save slices of the concatenated input (where they keep their input:
        ``head_keeps_input``); MTP step 0 on a stage without decoder layers
        saves it as its full-recompute unit's input, or in fp32 as its hidden-state norm's
        input (the norm's fp32 cast is the tensor itself), as the first decoder layer's input
        norm does in fp32 (a recomputed first layer: ``chunk_layers_part``'s input_counted).
        In the dense warm-up only glm5.GradientBridge saves it: nothing counts it again."""
        inp, hidden = self.inp, self.stage_input.activation_bytes
        if dense_warmup(inp):
            return 0
        if self.mtp_stage is not None and stage > self.mtp_stage:
            return self.concat_input.activation_bytes if head_keeps_input(inp) else 0
        if count:
            recomputed = inp.recompute.recomputed_layers(count) > 0
            return hidden if inp.activation_bytes == 4 and not recomputed else 0
        if stage == self.mtp_stage and mtp_steps(self.cfg):
            recomputed = inp.recompute.mtp_steps_recomputed
            return hidden if recomputed or inp.activation_bytes == 4 else 0
        return 0

    def costs(self, counts: list[int]) -> list[StageCosts]:
        norm, starts = self.final_norm_stage(counts), [0, *accumulate(counts)]
        return [self.stage(s, self.dense_layers(starts[s], c), c, s == norm)
                for s, c in enumerate(counts)]

    def stage(self, *key) -> StageCosts:
        """Costs of (stage, dense layers, layers, holds the final norm), cached: the search
        asks for the same few stages again and again."""
        if key not in self._cache:
            self._cache[key] = stage_costs(self.part(*key), self.inp)
        return self._cache[key]
