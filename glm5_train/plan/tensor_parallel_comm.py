"""The bytes one rank sends on its tensor-parallel groups, per micro-batch, in closed form.

Every collective below is one our model or megatron-core makes (counted with
``parallel.comm_meter``'s rules: an all-gather sends (n-1) x its input, a reduce-scatter
(n-1)/n of its input, an all-reduce floor(2 (n-1) S / n)). Under sequence parallelism each
exchange moves a [tokens, width] tensor between the sequence-split and the whole-sequence form,
so an all-gather of a rank's [t, w] shard and a reduce-scatter back to it cost the same,
(n-1) t w a bytes (t = tokens / TP, a = bytes per activation value): ``_sp``.

One decoder layer (absorbed sparse DSA, ``attention_comm`` + ``mlp_comm``), sequence parallel:
- MLA: forward gathers the query latent for the column-parallel query up projection, the RoPE key
  and the key-value latent (the replicated down projections' outputs every head reads), and the
  indexer's two inputs (hidden states and query latent; detached: no backward); the output
  projection reduce-scatters. Backward: the query up projection gathers its input again and
  reduce-scatters its input's gradient, the RoPE key's and the latent's gradients are
  reduce-scattered, the output projection's gradient gathered. The KL all-reduces the
  attention summed over each rank's heads at the selected keys ([b, s, K] fp32).
- The dense MLP or shared expert: fc1 gathers (forward and again in backward) and
  reduce-scatters its input's gradient; fc2 reduce-scatters, its gradient is gathered.
- Routed experts split over E = expert-TP ranks (megatron-core's all-to-all dispatcher): each
  rank's dispatched rows (its t tokens x top-k, where experts are not split over EP ranks) and
  their fp32 probabilities are gathered over the expert-TP group and the experts' output
  reduce-scattered back, the reverse in backward; the per-expert token counts (int64) are
  gathered over the TP x EP group once per forward.
- Routed experts split over EP ranks (the same dispatcher's all-to-alls over ``ep``): each
  rank hands the all-to-all its dispatched rows (t tokens x top-k, activations) and their fp32
  probabilities, then the experts' output rows (activations) to combine; backward the
  gradients travel the reverse way, the same bytes. A rank sends all of it but the rows its own
  experts take: (EP-1)/EP where the router spreads them evenly. Its dispatched rows are fixed,
  the rows its experts receive follow the router (their mean over the EP group is the rows
  dispatched): planned as the mean.
On megatron-core's MLA path (the masked-dense reference, the dense stage and the dense
fallback when every key fits the top-k: no indexer, no KL there) the key-value up projection
is column-parallel and gathers the latent again in backward. The dense warm-up runs all of it
forward only, its KL all-reducing per chunk of query rows (``dense_kl_comm``).
Without sequence parallelism the row-parallel outputs and the column-parallel inputs'
gradients are all-reduced instead ([T, w], T the whole sequence's tokens), the latent's and the
RoPE key's gradients too (parallel/mla_down_projection.py).
Embedding lookups (the main one and one per MTP step): forward reduce-scatters (all-reduces
without SP) the looked-up rows; backward gathers the gradient. An MTP step also runs
``eh_proj`` (column-parallel over [hidden, embedding], 2H wide) and gathers its output along
the hidden dimension before scattering it to the sequence shards. The output heads (the main
one and one per MTP step): the chunked head gathers the tokens in forward and again in backward
and reduce-scatters the hidden gradient, and all-reduces per chunk of c tokens the row max (c
fp32) and two sums (2c fp32); megatron-core's whole-logits head gathers the same way (its
column-parallel output layer) and all-reduces three [T] fp32 vectors.

Once per step (``grad_sync_bytes``): megatron-core's finalize all-reduces, over TP, the
gradients of the replicated parameters that saw only a rank's tokens (sequence parallel: the
norms, MLA's down projections, the routers, MTP's norms; summed), or without SP the latent
norms' (averaged: every rank holds the whole gradient). The DSA indexer (replicated, fed the
gathered whole sequence) needs none. Pipeline ZeRO2 all-reduces only the slice of them its
data-parallel rank owns (parallel/pipeline_zero2.py): planned as an even 1/(DP x CP) share
(where megatron-core's slices cut decides each rank's; the group's total is exact). Under
Muon (``muon_gather_comm``) the TP-split matrices' fp32 updates are all-gathered whole for
Newton-Schulz, except those Muon Split orthogonalises per head.

Checked per rank against the meter's counts of the training job's runs (glm5_train.plan.check:
exact for the TP group; the expert-TP group's rows follow the routing where experts are split
over EP ranks, and so do the all-to-alls' bytes, whose payload's mean over a stage's ranks is
exact). What ``unmodelled`` names is not modelled.
"""

from __future__ import annotations

from glm5_train.model.config import GLM5Config
from glm5_train.model.dsa import query_chunk
from glm5_train.plan.inputs import MemoryInputs, dense_warmup, dsa_sparse
from glm5_train.plan.param_count import layer_terms, mtp_layer_terms
from parallel.pipeline_layout import Comm, comm_sum

TP_GATHER, TP_SCATTER, TP_REDUCE = "all_gather:tp", "reduce_scatter:tp", "all_reduce:tp"
ETP_GATHER, ETP_SCATTER, TP_EP_GATHER = ("all_gather:expt_tp", "reduce_scatter:expt_tp",
                                         "all_gather:tp_ep")
EP_ALL_TO_ALL = "all_to_all:ep"
TP_KEYS = (TP_GATHER, TP_SCATTER, TP_REDUCE)
EXPERT_TP_KEYS = (ETP_GATHER, ETP_SCATTER, TP_EP_GATHER)
EXPERT_PARALLEL_KEYS = (EP_ALL_TO_ALL,)

FP32, INT64 = 4, 8
# Replicated parameters whose gradients finalize sums over TP under sequence parallelism
# (megatron-core's ``sequence_parallel`` attribute; ours on the MLA down projections), and the
# latent norms it averages without (``average_gradients_across_tp_domain``, layers.py).
SP_SYNCED = frozenset({"q_down", "q_norm", "kv_down", "kv_norm", "input_norm", "pre_mlp_norm",
                       "router", "enorm", "hnorm", "mtp_final_norm", "final_norm"})
AVERAGED = frozenset({"q_norm", "kv_norm"})


def unmodelled(cfg: GLM5Config, dsa_stage: str, absorbed: bool, seq_length: int, cp: int,
               recompute: bool) -> str | None:
    """Why this module does not model a job's tensor-parallel traffic (None: it does); the
    arguments are the job's dsa.stage, whether dsa.sparse_attention is absorbed,
    train.seq_length, parallel.context_parallel_size and whether anything is recomputed.
    (Either context-parallel exchange leaves the TP traffic as it is: the head-parallel one
    measured byte for byte as planned on CP2 x TP2.)"""
    if dsa_stage == "dense_warmup":
        if cp > 1:
            return "the dense warm-up's KL chunks follow the CP shards' positions"
        if recompute:
            return "recompute in the dense warm-up is not modelled"
    elif recompute and not (absorbed and cfg.index_topk < seq_length and dsa_stage == "sparse"):
        return "recompute on megatron-core's MLA path (masked-dense, dense stage or fallback)"
    if cfg.q_lora_rank is None:
        return "MLA without a query latent is not modelled"
    return None


def _sp(inp: MemoryInputs, width: int) -> int:
    """One sequence-parallel exchange of a [tokens, width] activation (module docstring)."""
    return (inp.tp - 1) * inp.sp_tokens * width * inp.activation_bytes


def _all_reduce(n: int, nbytes: int) -> int:
    return 2 * (n - 1) * nbytes // n


def _reduced(inp: MemoryInputs, width: int) -> int:
    """All-reduce of a whole-sequence [T, width] activation (no sequence parallelism)."""
    return _all_reduce(inp.tp, inp.tokens * width * inp.activation_bytes)


def _absorbed(cfg: GLM5Config, inp: MemoryInputs) -> bool:
    """Our absorbed sparse MLA shares the latent; elsewhere megatron-core's MLA up-projects it
    with a column-parallel linear, whose backward gathers its input again. (``dsa_sparse``: the
    sparse stage selects keys, falling back to dense attention, no indexer, no KL, when every
    key fits the top-k, as the dense stage always does; ``dense_warmup`` runs the model forward
    only.)"""
    return dsa_sparse(cfg, inp) and inp.absorbed_attention


def dense_kl_comm(cfg: GLM5Config, inp: MemoryInputs) -> Comm:
    """The dense warm-up's KL (dsa_loss._DenseKL): per chunk of r query rows (dsa.query_chunk
    of b x S x (heads per rank + indexer heads) elements per row) the head-summed attention
    [b, rows, keys up to the chunk's last row] fp32 all-reduced over TP, in its forward and again
    in its backward, which runs at once (without CP: the rows are positions 0..S-1)."""
    if inp.tp == 1 or not inp.dsa_kl:
        return ()
    b, s = inp.micro_batch_size, inp.seq_length
    rows = query_chunk(b * s * (cfg.num_attention_heads // inp.tp + cfg.index_n_heads))
    sent = sum(_all_reduce(inp.tp, FP32 * b * (min(s, t0 + rows) - t0) * min(s, t0 + rows))
               for t0 in range(0, s, rows))
    return ((TP_REDUCE, 2 * sent),)


def kl_comm(cfg: GLM5Config, inp: MemoryInputs) -> Comm:
    """The sparse KL's all-reduce of the attention summed over each rank's heads at the
    selected keys ([b, s, K] fp32), once per core-attention forward (the dense warm-up's:
    ``dense_kl_comm``)."""
    if dense_warmup(inp):
        return dense_kl_comm(cfg, inp)
    if inp.tp == 1 or not inp.dsa_kl or not dsa_sparse(cfg, inp):
        return ()
    picks = inp.micro_batch_size * inp.seq * min(cfg.index_topk, inp.seq_length)
    return ((TP_REDUCE, _all_reduce(inp.tp, FP32 * picks)),)


def attention_comm(cfg: GLM5Config, inp: MemoryInputs) -> tuple[Comm, Comm]:
    """(forward, backward) of one MLA + DSA application (absorbed sparse stage), the KL's
    all-reduce aside (``kl_comm``)."""
    if inp.tp == 1:
        return (), ()
    q, latent, rope, H = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.hidden_size
    if inp.sequence_parallel:
        forward = ((TP_GATHER, _sp(inp, q + rope + latent)), (TP_SCATTER, _sp(inp, H)),
                   *indexer_inputs_comm(cfg, inp))
        regathered = q + H + (0 if _absorbed(cfg, inp) else latent)
        backward = ((TP_GATHER, _sp(inp, regathered)), (TP_SCATTER, _sp(inp, q + rope + latent)))
    else:
        forward = ((TP_REDUCE, _reduced(inp, H)),)
        backward = ((TP_REDUCE, _reduced(inp, q) + _reduced(inp, latent) + _reduced(inp, rope)),)
    return forward, backward


def indexer_inputs_comm(cfg: GLM5Config, inp: MemoryInputs) -> Comm:
    """The indexer's inputs (hidden states and query latent) gathered to the whole sequence
    under SP, inside the core attention (detached: no backward); no indexer runs in the
    dense stage or the dense fallback."""
    if inp.tp == 1 or not inp.sequence_parallel or not (dsa_sparse(cfg, inp) or dense_warmup(inp)):
        return ()
    return ((TP_GATHER, _sp(inp, cfg.hidden_size + cfg.q_lora_rank)),)


def up_projection_forward_comm(cfg: GLM5Config, inp: MemoryInputs) -> Comm:
    """What selective ``mla_up_proj`` recompute sends again: the query up projection's input
    gather and the latent's (both inside its checkpoint)."""
    if inp.tp == 1 or not inp.sequence_parallel:
        return ()
    return ((TP_GATHER, _sp(inp, cfg.q_lora_rank + cfg.kv_lora_rank)),)


def mlp_comm(cfg: GLM5Config, moe: bool, inp: MemoryInputs) -> tuple[Comm, Comm]:
    """(forward, backward) of one dense MLP, or one MoE block (shared expert + routed
    experts)."""
    H = cfg.hidden_size
    forward = backward = ()
    column_row = not moe or cfg.n_shared_experts
    if column_row and inp.tp > 1:
        if inp.sequence_parallel:
            forward = ((TP_GATHER, _sp(inp, H)), (TP_SCATTER, _sp(inp, H)))
            backward = ((TP_GATHER, _sp(inp, 2 * H)), (TP_SCATTER, _sp(inp, H)))
        else:
            forward, backward = ((TP_REDUCE, _reduced(inp, H)),), ((TP_REDUCE, _reduced(inp, H)),)
    if moe:
        expert_forward, expert_backward = routed_experts_comm(cfg, inp)
        a2a_forward, a2a_backward = expert_all_to_all_comm(cfg, inp)
        forward = comm_sum(forward, expert_forward, a2a_forward)
        backward = comm_sum(backward, expert_backward, a2a_backward)
    return forward, backward


def expert_all_to_all_payload(cfg: GLM5Config, inp: MemoryInputs) -> int:
    """Bytes one rank hands to the expert-parallel all-to-alls of one MoE block, forward or
    backward (module docstring): its dispatched rows with their fp32 probabilities, and as many
    rows of expert output combined back (the mean a rank's experts receive)."""
    if inp.ep == 1:
        return 0
    rows = inp.sp_tokens * cfg.num_experts_per_tok
    return rows * (2 * cfg.hidden_size * inp.activation_bytes + FP32)


def expert_all_to_all_comm(cfg: GLM5Config, inp: MemoryInputs) -> tuple[Comm, Comm]:
    """(forward, backward) bytes sent by the expert-parallel all-to-alls of one MoE block: the
    payload less what stays on the rank, (EP-1)/EP of it where the router spreads the rows
    evenly over the EP ranks."""
    sent = (inp.ep - 1) * expert_all_to_all_payload(cfg, inp) // max(inp.ep, 1)
    comm = ((EP_ALL_TO_ALL, sent),) if sent else ()
    return comm, comm


def routed_experts_comm(cfg: GLM5Config, inp: MemoryInputs) -> tuple[Comm, Comm]:
    """(forward, backward) of the routed experts' token exchange over expert-TP (module
    docstring); the rows are the mean a rank receives."""
    e, forward = inp.expert_tp, ()
    if e * inp.ep > 1:
        forward = ((TP_EP_GATHER, (e * inp.ep - 1) * cfg.n_routed_experts * INT64),)
    if e == 1:
        return forward, ()
    rows = inp.sp_tokens * cfg.num_experts_per_tok
    hidden = (e - 1) * rows * cfg.hidden_size * inp.activation_bytes
    # The experts' output is scaled by the fp32 probabilities before it is combined: fp32.
    combined = (e - 1) * rows * cfg.hidden_size * FP32
    probs = (e - 1) * rows * FP32
    forward = comm_sum(forward, ((ETP_GATHER, hidden + probs), (ETP_SCATTER, combined)))
    return forward, ((ETP_GATHER, combined), (ETP_SCATTER, hidden + probs))


def layer_comm(cfg: GLM5Config, moe: bool, inp: MemoryInputs) -> tuple[Comm, Comm]:
    """One decoder layer (or MTP step's layer) application: (forward + backward + what its
    selective recompute sends again, what a full recompute's second forward sends: the
    forward's exchanges, the KL's all-reduce not, which runs once)."""
    attention, mlp = attention_comm(cfg, inp), mlp_comm(cfg, moe, inp)
    if dense_warmup(inp):  # forward only
        return comm_sum(attention[0], mlp[0], kl_comm(cfg, inp)), comm_sum(attention[0], mlp[0])
    rc, again = inp.recompute, []
    if rc.selects("mla_up_proj"):
        again.append(up_projection_forward_comm(cfg, inp))
    if rc.selects("core_attn"):
        again += [indexer_inputs_comm(cfg, inp), kl_comm(cfg, inp)]
    return (comm_sum(*attention, *mlp, kl_comm(cfg, inp), *again),
            comm_sum(attention[0], mlp[0]))


def embedding_comm(cfg: GLM5Config, inp: MemoryInputs, trains: bool = True) -> Comm:
    """One embedding lookup: forward + (when the embedding trains) backward."""
    if inp.tp == 1:
        return ()
    if not inp.sequence_parallel:
        return ((TP_REDUCE, _reduced(inp, cfg.hidden_size)),)
    rows = _sp(inp, cfg.hidden_size)
    return ((TP_SCATTER, rows), (TP_GATHER, rows if trains else 0))


def mtp_projection_comm(cfg: GLM5Config, inp: MemoryInputs) -> tuple[Comm, Comm]:
    """One MTP step's eh_proj over [embedding, hidden] and its output's gather over the hidden
    dimension: (forward, backward); sequence parallel (MTP's layer is MoE, which needs it)."""
    if inp.tp == 1:
        return (), ()
    H = cfg.hidden_size
    forward = ((TP_GATHER, _sp(inp, 2 * H) + _sp(inp, H)),)
    if dense_warmup(inp):
        return forward, ()
    return forward, ((TP_GATHER, _sp(inp, H) + _sp(inp, 2 * H)), (TP_SCATTER, _sp(inp, 2 * H)))


def head_comm(cfg: GLM5Config, inp: MemoryInputs, entropy: bool = False) -> Comm:
    """One output head + loss: forward + backward (the dense warm-up: forward only).
    ``entropy``: the chunked head also sums each token's entropy in its chunk all-reduce."""
    if inp.tp == 1:
        return ()
    H, T = cfg.hidden_size, inp.tokens
    backward = 0 if dense_warmup(inp) else 1
    if inp.loss_chunk_tokens > 0:
        c = inp.loss_chunk_tokens
        chunks = [min(c, T - start) for start in range(0, T, c)]
        sums = 3 if entropy else 2
        reductions = sum(_all_reduce(inp.tp, FP32 * n) + _all_reduce(inp.tp, sums * FP32 * n)
                         for n in chunks)
    else:
        reductions = 3 * _all_reduce(inp.tp, FP32 * T)
    if inp.sequence_parallel:
        return ((TP_GATHER, (1 + backward) * _sp(inp, H)), (TP_SCATTER, backward * _sp(inp, H)),
                (TP_REDUCE, reductions))
    return ((TP_REDUCE, backward * _reduced(inp, H) + reductions),)


def _held_terms(cfg: GLM5Config, moe_flags: list[bool], mtp: bool) -> list:
    """The parameter terms of a rank holding decoder layers of ``moe_flags`` and, with
    ``mtp``, every MTP parameter set."""
    terms = [t for moe in moe_flags for t in layer_terms(cfg, moe)]
    if mtp:
        terms += [t for _ in range(cfg.mtp_sets) for t in mtp_layer_terms(cfg)]
    return terms


def grad_sync_bytes(cfg: GLM5Config, inp: MemoryInputs, moe_flags: list[bool], mtp: bool,
                    final_norm: bool) -> int:
    """Once per step: finalize's all-reduce of the replicated gradients over TP for a rank
    holding decoder layers of ``moe_flags``, the MTP parameters (``mtp``) and the final norm;
    under Pipeline ZeRO2 (``inp.shard_grads``) this rank's even share of them."""
    if inp.tp == 1 or dense_warmup(inp):  # the warm-up trains the indexer alone: none
        return 0
    keys = SP_SYNCED if inp.sequence_parallel else AVERAGED
    params = sum(t.count for t in _held_terms(cfg, moe_flags, mtp) if t.key in keys)
    params += cfg.hidden_size if final_norm and "final_norm" in keys else 0
    shards = inp.dp * inp.cp if inp.shard_grads else 1
    return 2 * (inp.tp - 1) * inp.grad_bytes * params // (inp.tp * shards)



# Muon's TP-split matrices (parallel/muon.py): the dense ones it gathers over TP, whole, to
# orthogonalise (Muon Split orthogonalises the MLA up projections per head, locally).
MUON_GATHERED = frozenset({"o_proj", "dense_mlp", "shared_expert", "eh_proj"})
MUON_SPLIT = frozenset({"q_up", "kv_up"})


def muon_gather_comm(cfg: GLM5Config, inp: MemoryInputs, moe_flags: list[bool], mtp: bool,
                     split_mla: bool) -> Comm:
    """Once per step under Muon (``inp.muon``): the fp32 updates of this rank's TP-split
    matrices all-gathered to whole matrices for Newton-Schulz, over TP (dense) and over
    expert-TP (routed experts; megatron-core marks them so only with EP > 1, below that the
    expert-TP ranks are the TP ranks and the TP group is used). Distributed Muon
    (``owners``) gathers a matrix on its owner's TP ranks only: planned as an even
    1/(DP x CP) share (the owners are balanced by Newton-Schulz cost, not bytes)."""
    if not inp.muon:
        return ()
    gathered = MUON_GATHERED | (frozenset() if split_mla else MUON_SPLIT)
    terms = _held_terms(cfg, moe_flags, mtp)
    dense = sum(t.count for t in terms if t.key in gathered)
    experts = sum(t.count for t in terms if t.key == "routed_experts") // inp.ep
    e = inp.expert_tp
    shares = inp.dp * inp.cp if inp.muon == "owners" else 1
    expert_key = ETP_GATHER if inp.ep > 1 else TP_GATHER
    return comm_sum(((TP_GATHER, (inp.tp - 1) * FP32 * dense // (inp.tp * shares)),),
                    ((expert_key, (e - 1) * FP32 * experts // (e * shares)),))
