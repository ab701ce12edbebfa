"""GLM-5's costs per pipeline stage, per rank and micro-batch, in closed form: ``Part`` (one
piece of a stage: parameters, activations, flops, memory-bound kernels' bytes, transient
bytes, bytes sent), the parts of a decoder layer, an MTP step, the embedding and the output
heads, full recompute over a chunk of layers, and ``stage_costs``: a part's bytes for weights,
gradients and optimizer state (AdamW, Muon, host offload, Pipeline ZeRO2, INT4 QAT's copies).

Parameters come from ``glm5_train.plan.param_count``'s formula, sharded as our model shards them
(TP-split projections, replicated down projections / norms / DSA indexer / router, routed
experts over EP x expert-TP); bytes per parameter follow the training precision and optimizer.
Activations: ``glm5_train.plan.activations``; compute is forward + backward FLOPs;
communication: ``glm5_train.plan.context_parallel_comm`` and
``glm5_train.plan.tensor_parallel_comm``, both checked against the communication meter of
measured runs. ``GLM5StageModel`` gives a whole stage's costs for ``parallel.pipeline_layout``,
which places them on stages and replays the pipeline schedule to find each rank's peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate

from glm5_train.model.config import GLM5Config
from glm5_train.plan.activations import (
    decoder_layer_activation_bytes,
    dense_indexer_kl_bytes,
    head_keeps_input,
    loss_head_activation_bytes,
    mtp_step_activation_bytes,
    recompute_unit_input_bytes,
    rms_norm_bytes,
)
from glm5_train.plan.context_parallel_comm import (
    dsa_context_parallel_comm,
    mtp_roll_comm,
    mtp_targets_comm,
    recomputed_forward_comm,
)
from glm5_train.plan.elementwise import (
    grad_accumulation_bytes,
    head_elementwise,
    layer_elementwise,
    mtp_step_elementwise,
    sparse_attention_bytes,
)
from glm5_train.plan.inputs import MemoryInputs, dense_warmup, dsa_sparse, mtp_sets, mtp_steps
from glm5_train.plan.param_count import Term, layer_terms, top_terms
from glm5_train.plan.tensor_parallel_comm import (
    embedding_comm,
    head_comm,
    layer_comm,
    mtp_projection_comm,
)
from parallel.pipeline_layout import Comm, StageCosts, comm_sum, comm_times

# Components split over TP ranks; the rest of a layer (down projections, norms, indexer,
# router) is replicated in our model, and routed experts split over EP x expert-TP.
TP_SPLIT = frozenset({"q_up", "kv_up", "o_proj", "dense_mlp", "shared_expert"})


@dataclass(frozen=True)
class Streamed:
    """Work bound by memory rather than by FLOPs: the bytes it moves per micro-batch (forward
    + backward, of which the forward's) and its FLOPs (also counted in ``Part.flops``). For
    the sparse attention's torch path (``Part.streamed``) the FLOPs are its small batched
    matmuls, which the step-time model prices at the spec's batched-matmul rate, and the
    bytes its gathers and scatters; element-wise work (``Part.elementwise``) has no FLOPs."""

    bytes: int = 0
    flops: int = 0
    forward_bytes: int = 0  # of ``bytes``, what one forward moves

    def __add__(self, other: Streamed) -> Streamed:
        return Streamed(self.bytes + other.bytes, self.flops + other.flops,
                        self.forward_bytes + other.forward_bytes)

    def times(self, k: int) -> Streamed:
        return Streamed(k * self.bytes, k * self.flops, k * self.forward_bytes)

    def forward_again(self) -> Streamed:
        """What recompute's second forward adds: its bytes and a third of the FLOPs (as
        ``Part.flops`` counts a recomputed forward), all in the backward."""
        return Streamed(self.forward_bytes, self.flops // 3, 0)


@dataclass(frozen=True)
class Part:
    """One piece of a stage per rank: dense and expert parameters (they shard over different
    data-parallel groups), activation bytes and flops (forward + backward) per micro-batch,
    transient bytes (held only while one of its pieces runs: a stage's is its largest), and
    the bytes it sends per micro-batch that the model counts (``dsa_context_parallel_comm``,
    ``glm5_train.plan.tensor_parallel_comm``) and of those what one more forward sends again
    (``forward_comm``: full recompute's). ``adamw_params``: the trained dense parameters Muon
    leaves to AdamW (``adamw_elements``). ``frozen_params``: dense parameters held (counted in
    ``dense_params``) with no gradient or optimizer state (a frozen indexer). ``streamed``:
    the sparse attention's torch path; ``elementwise``: the element-wise operators' bytes on
    CPUs (``glm5_train.plan.elementwise``; no FLOPs)."""

    dense_params: int = 0
    expert_params: int = 0
    activation_bytes: int = 0
    flops: int = 0
    transient_bytes: int = 0
    comm: Comm = ()
    adamw_params: int = 0
    forward_comm: Comm = ()
    frozen_params: int = 0
    streamed: Streamed = field(default_factory=Streamed)
    elementwise: Streamed = field(default_factory=Streamed)

    def __add__(self, other: Part) -> Part:
        return Part(self.dense_params + other.dense_params,
                    self.expert_params + other.expert_params,
                    self.activation_bytes + other.activation_bytes, self.flops + other.flops,
                    max(self.transient_bytes, other.transient_bytes),
                    comm_sum(self.comm, other.comm), self.adamw_params + other.adamw_params,
                    comm_sum(self.forward_comm, other.forward_comm),
                    self.frozen_params + other.frozen_params, self.streamed + other.streamed,
                    self.elementwise + other.elementwise)

    def times(self, k: int) -> Part:
        return Part(k * self.dense_params, k * self.expert_params, k * self.activation_bytes,
                    k * self.flops, self.transient_bytes if k else 0, comm_times(self.comm, k),
                    k * self.adamw_params, comm_times(self.forward_comm, k),
                    k * self.frozen_params, self.streamed.times(k), self.elementwise.times(k))

    @property
    def trained_dense_params(self) -> int:
        return self.dense_params - self.frozen_params


# What Muon leaves to AdamW (parallel/muon.py): every tensor that is not a matrix (norms,
# biases), and the embedding, output head and router matrices.
ADAMW_MATRICES = frozenset({"embedding", "output_head", "router"})


def adamw_elements(term: Term) -> int:
    """Elements of ``term`` that Muon's optimizer steps with AdamW (whole, before TP)."""
    if term.key in ADAMW_MATRICES:
        return term.count
    return term.repeat * sum(math.prod(s) for s in term.shapes if len(s) != 2)


def absorbed_core_flops(cfg: GLM5Config, inp: MemoryInputs) -> int:
    """The absorbed sparse attention's FLOPs per micro-batch and rank (forward + backward):
    K picks per query over the D = C + R latent; multiply-adds per pick and head: forward D
    (logits) + C (output), backward D (recomputed logits) + C (dp) + D (dq) + 2D (key/value
    gradients, one matmul over 2N). The absorption and the W_UV up-projection cost what the
    key/value up-projection did (counted with the weights)."""
    width, latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    picks = inp.micro_batch_size * inp.seq_length * min(cfg.index_topk, inp.seq_length)
    return 2 * picks * cfg.num_attention_heads * (5 * width + 2 * latent) // (inp.tp * inp.cp)


def runs_torch_sparse_attention(inp: MemoryInputs) -> bool:
    """Whether the plan's absorbed sparse attention is the torch path: ``dsa.sparse_kernel``
    torch, or auto on a plan without CUDA (``fused_attention``: the device the plan is for;
    a CUDA machine without Triton also falls back to it, which the plan cannot see)."""
    return inp.sparse_kernel == "torch" or (inp.sparse_kernel == "auto"
                                            and not inp.fused_attention)


def attention_streamed(cfg: GLM5Config, inp: MemoryInputs) -> Streamed:
    """The absorbed sparse attention's torch path: its element-wise bytes
    (``elementwise.sparse_attention_bytes``) and its matmuls' FLOPs, one small [heads, C + R] x
    [C + R, K] product per query, which the step-time model prices at the spec's batched-matmul
    rate; its forward again where ``core_attn`` is recomputed. Nothing for the other paths,
    priced by their FLOPs; nor for the Triton kernels (CUDA): they read each picked row in
    place, neighbouring queries share many picks through the L2 cache, and how much reaches HBM
    is not measured yet. The bound, every pick from HBM (8,064 bytes per pick at GLM-5's
    576-wide latent: two bf16 reads forward with the KL's probabilities, one backward, an fp32
    atomic add), would be about 23x their FLOPs' time with 8 heads per rank on the H100
    preset."""
    if not (dsa_sparse(cfg, inp) and inp.absorbed_attention and runs_torch_sparse_attention(inp)):
        return Streamed()
    forward, backward = sparse_attention_bytes(cfg, inp)
    once = Streamed(forward + backward, absorbed_core_flops(cfg, inp), forward)
    return once + once.forward_again() if inp.recompute.selects("core_attn") else once


def _attention_flops(cfg: GLM5Config, inp: MemoryInputs) -> int:
    b, s, sparse = inp.micro_batch_size, inp.seq_length, dsa_sparse(cfg, inp)
    # The masked-dense sparse path runs dense SDPA under a top-k mask: every pair costs.
    pairs = b * s * s if sparse else b * s * (s + 1) // 2
    dims = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    core = 6 * pairs * cfg.num_attention_heads * dims // (inp.tp * inp.cp)
    if sparse and inp.absorbed_attention:
        core = absorbed_core_flops(cfg, inp)
    if not sparse:
        return core
    # The indexer (replicated over TP) scores the causal pairs for the blockwise selection;
    # the KL scores the K selected keys per query, and its backward recomputes them and takes
    # the q and k gradients: four passes over s x K pairs.
    index_pairs = b * s * (s + 1) // 2 + (4 * b * s * min(cfg.index_topk, s) if inp.dsa_kl else 0)
    return core + 2 * index_pairs * cfg.index_n_heads * cfg.index_head_dim // inp.cp


def layer_part(cfg: GLM5Config, moe: bool, inp: MemoryInputs) -> Part:
    dense = expert = active = adamw = frozen = 0
    for term in layer_terms(cfg, moe):
        if term.key == "routed_experts":
            expert += term.count // (inp.ep * inp.expert_tp)
            active += term.count * cfg.num_experts_per_tok // cfg.n_routed_experts
        elif term.key == "indexer" and inp.frozen_indexer:  # held (replicated), not trained
            dense += term.count
            frozen += term.count
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
                comm_sum(recomputed_forward_comm(cp), tp_again), frozen,
                attention_streamed(cfg, inp), as_streamed(*layer_elementwise(cfg, moe, inp)))


def as_streamed(forward: int, backward: int) -> Streamed:
    """Element-wise bytes (forward, backward) as a ``Streamed`` with no FLOPs."""
    return Streamed(forward + backward, 0, forward)


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
                  adamw_params=layer.adamw_params + 3 * H,  # + its 3 norms
                  frozen_params=layer.frozen_params).times(sets)
    flops = layer.flops + 6 * 2 * H * H * inp.tokens // inp.tp
    projection = mtp_projection_comm(cfg, inp)  # its embedding lookup is not recomputed
    comm = comm_sum(layer.comm, mtp_roll_comm(inp), *projection,
                    embedding_comm(cfg, inp, trains=not dense_warmup(inp)))
    streamed = layer.streamed
    elementwise = layer.elementwise + as_streamed(*mtp_step_elementwise(cfg, inp))
    if inp.recompute.mtp_steps_recomputed:  # each step's forward once more in backward
        flops += flops // 3
        comm = comm_sum(comm, layer.forward_comm, projection[0])
        streamed += streamed.forward_again()
        elementwise += elementwise.forward_again()
    if not inp.mtp_runs:  # a zero loss weight: the steps do not run (zeros sent instead)
        return params
    return params + Part(activation_bytes=mtp_step_activation_bytes(cfg, inp), flops=flops,
                         transient_bytes=layer.transient_bytes, comm=comm,
                         streamed=streamed, elementwise=elementwise).times(steps)


def head_part(cfg: GLM5Config, inp: MemoryInputs, heads: int) -> Part:
    """Output head(s) on the last stage: the main loss plus one per MTP step. The chunked
    head's backward recomputes the logits GEMM: 4 GEMMs of 2 V H n flops instead of 3."""
    gemms = 4 if inp.loss_chunk_tokens > 0 else 3
    flops = 2 * gemms * cfg.vocab_size * cfg.hidden_size * inp.tokens // inp.tp
    head = Part(activation_bytes=loss_head_activation_bytes(cfg, inp), flops=flops)
    main = head + Part(comm=head_comm(cfg, inp, entropy=inp.head_entropy),
                       elementwise=as_streamed(*head_elementwise(cfg, inp, heads)))
    return vocab_part(cfg, inp, "output_head") + main + (
        head + Part(comm=head_comm(cfg, inp))).times(heads - 1) + Part(
        comm=mtp_targets_comm(inp) if heads > 1 else ())


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
                       comm=comm_sum(*(p.forward_comm for p in redone)),
                       streamed=sum((p.streamed.forward_again() for p in redone), Streamed()),
                       elementwise=sum((p.elementwise.forward_again() for p in redone),
                                       Streamed()))


# Host-resident optimizer state per parameter element (parallel/host_optimizer.py): the fp32
# copy it steps, its gradient copied over, AdamW's exp_avg and exp_avg_sq.
HOST_OPTIMIZER_BYTES = 16


def stage_costs(part: Part, inp: MemoryInputs) -> StageCosts:
    """Weights of every parameter held; gradients, optimizer state and what the data-parallel
    reduction moves (``dense_params``) of the trained ones only."""
    d, e = part.trained_dense_params, part.expert_params
    sharded = -(-d // (inp.dp * inp.cp)) - (-e // inp.expert_dp)  # per rank, rounded up
    grads = sharded if inp.shard_grads else d + e
    if inp.muon:
        device, host = muon_state_bytes(part, inp)
    else:
        states = sharded if inp.distributed_optimizer else d + e
        on_host = round(states * inp.optimizer_offload_fraction)
        device = inp.optimizer_bytes * (states - on_host)
        host = HOST_OPTIMIZER_BYTES * on_host
    held = part.dense_params + e
    return StageCosts(inp.weight_bytes * held, inp.grad_bytes * grads, device,
                      part.activation_bytes, part.flops, zero2_accumulated_bytes(d, e, inp),
                      part.transient_bytes, part.comm, dense_params=d, expert_params=e,
                      host_bytes=host,
                      # train.int4_qat: each routed expert weight's dequantised INT4 copy
                      buffer_bytes=inp.weight_bytes * e if inp.int4_qat else 0,
                      streamed_bytes_per_microbatch=part.streamed.bytes,
                      streamed_forward_bytes_per_microbatch=part.streamed.forward_bytes,
                      streamed_flops_per_microbatch=part.streamed.flops,
                      elementwise_bytes_per_microbatch=part.elementwise.bytes
                      + grad_accumulation_bytes(d + e, inp),
                      elementwise_forward_bytes_per_microbatch=part.elementwise.forward_bytes)


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
    d, e, a = part.trained_dense_params, part.expert_params, part.adamw_params
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
        self.head = head_part(cfg, inp, 1 + (steps if inp.mtp_runs else 0))
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
        if self.mtp_stage is not None and stage > self.mtp_stage:  # the heads that run
            heads = self.concat_input if inp.mtp_runs else self.stage_input
            return heads.activation_bytes if head_keeps_input(inp) else 0
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