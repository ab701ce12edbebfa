"""The bytes GLM-5's layers save for backward per micro-batch, per rank, in closed form: the
activation terms of the planner (a decoder layer's attention and MLP, the DSA dense warm-up's
KL graph, what recompute keeps and frees, an output head, an MTP step).

``glm5_train.plan.stage_model`` sums them per pipeline stage; the schedule replay in
``parallel.pipeline_layout`` turns them into each rank's peak.
"""

from __future__ import annotations

from glm5_train.model.config import GLM5Config
from glm5_train.plan.inputs import MemoryInputs, dense_warmup, dsa_sparse, takes_latent

# Bytes each tensor saved for backward holds, per rank, as our implementation saves them
# (glm5_train/model/layers.py, dsa.py, dsa_loss.py; megatron-core's MLA, MoE and output layer).
# ``a`` is the activation dtype's size; fp32 internals are 4 bytes, int64 indices 8, masks 1.
# Checked: an fp32 CPU forward of the tiny model, MTP on and off, DSA sparse and dense (the
# latter with and without document masks) (tests), and the fused sparse-SDPA terms in bf16 on an
# H200. Recompute is modelled (``stage_model.chunk_layers_part``,
# ``selective_recompute_savings``; checked on the tiny forward too, and per rank against the
# job's measured peaks: tests/test_activation_offload.py), as the job's meter counts it: what
# forward saves, an output-discarding checkpoint's emptied output at 0 bytes until backward
# refills it; not the tensors a recomputed unit saves again while its backward runs
# (backward-time saves, transient).
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
    """One decoder layer not under full recompute (``stage_model.chunk_layers_part``
    applies that)."""
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
