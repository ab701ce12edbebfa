"""The bytes the element-wise operators of a step move on CPUs, per rank: norms, SwiGLU,
MoE routing, attention's rotary and concatenations, residual adds, the weight gradients'
accumulation and torch's AdamW. The step-time model prices them at the memory rate.

Why only on CPUs: there each is a torch operator of its own (fp32, no fusion), and together
they are the part of a compute-bound step that no FLOPs term holds (about a seventh of one
process's step at the bench's ``compute_bound`` widths). On GPUs Transformer Engine fuses
norms and activations and the optimizer is a fused kernel: those bytes are unmeasured here
and left to the compute rate, as before.

The constants are bytes per element, each operator's tensor inputs and outputs (what it reads
and writes), counted from a dispatch-level trace of one training step (every aten operator
but matmuls, views and collectives, keyed by the module whose forward ran it or made its
autograd node: ``tests/elementwise_count.py``), at the bench's ``compute_bound`` widths in
fp32 (hidden 1,024, 8 heads, 512 tokens, top-k 128). The sparse attention's own element-wise
work has four terms, solved from four counts (512 or 256 tokens, top-k 128 or 64, one
process or TP2). ``tests/test_elementwise.py`` re-counts the tiny model (other widths, one
process and TP2 + SP) against these formulas.
"""

from __future__ import annotations

from glm5_train.model.config import GLM5Config
from glm5_train.plan.inputs import MemoryInputs

# (forward, backward) bytes per element, fp32, counted (module docstring):
# RMSNorm in fp32 (pow, mean, the rsqrt scale, the weight), hidden and latent norms alike; its
# backward is autograd's over the same operators.
NORM = (28, 103)
# SwiGLU per [tokens, ffn] element (the gate's SiLU, the product, fc1's split): dense MLPs,
# shared and routed experts alike.
SWIGLU = (32, 65)
# MoE routing per [tokens x top-k, hidden] element: the router, the permutation's gather, the
# combine's weighting and scatter-add, and their backward.
ROUTING = (54, 58)
# MLA outside its core attention per [tokens, heads x (qk + v head width)] element: rotary,
# the nope/rope concatenations and splits, the down projections' summed input gradients.
ATTENTION = (21, 50)
# A decoder layer's two residual adds per [tokens, hidden] element (their backward passes the
# gradient through).
RESIDUAL = (24, 0)
# Per output head (the main one and each MTP step's) and [tokens, hidden] element: the
# embedding lookup, MTP's concatenation and roll, the loss's element-wise work.
HEAD = (36, 68)
# The weight gradients' accumulation into the fp32 main gradients (no gradient-accumulation
# fusion): bytes per trained parameter and micro-batch (counted 16.6).
GRAD_ACCUMULATION = 17
# The absorbed sparse attention's torch path (glm5_train/model/sparse_mla.py) and its indexer:
# - its gathers and scatters per picked latent element [queries, K, C + R]: the forward's row
#   gather writes them (5.1 counted), the backward gathers again and index_add reads their
#   gradients (10.4);
# - per [queries, K, heads on the rank]: the logits' mask, softmax and their gradients;
# - per [queries, K, index heads] (replicated over TP): the indexer's scores at the picks and
#   its KL;
# - per [queries, heads on the rank, C + R]: the absorbed queries' copies, casts and the
#   backward's concatenations;
# - per [queries, index heads, index head width] (replicated): the indexer's rotary and
#   scaling.
SPARSE_ROWS = (5, 10)
SPARSE_PICK_HEADS = (7, 70)
SPARSE_PICK_INDEX_HEADS = (146, 87)
SPARSE_QUERY = (41, 93)
SPARSE_INDEX_QUERY = (78, 29)
# torch's AdamW, one tensor at a time (megatron-core's choice without apex or Transformer
# Engine), with gradient clipping's norm and scale and the gradient buffer's zeroing: bytes
# per parameter element and step (the first step's state allocation is not counted).
TORCH_ADAMW_STEP_BYTES = 128


def runs_unfused(inp: MemoryInputs) -> bool:
    """Whether the plan's element-wise work runs as separate torch operators (a CPU plan)."""
    return not inp.fused_attention


def sparse_attention_bytes(cfg: GLM5Config, inp: MemoryInputs) -> tuple[int, int]:
    """(forward, backward) bytes of the absorbed sparse attention's torch path and its
    indexer per micro-batch and rank, besides their matmuls. The picked latent rows are
    shared by every head, so neither TP nor head-parallel CP shrinks them (a rank runs its
    heads over every query); all-gather CP splits the queries. Per-head work splits over TP
    and CP either way; the indexer's over CP only (replicated over TP)."""
    width, picks = cfg.kv_lora_rank + cfg.qk_rope_head_dim, min(cfg.index_topk, inp.seq_length)
    queries = inp.micro_batch_size * inp.seq_length
    rows = queries * picks // (1 if inp.cp_comm == "head_parallel" else inp.cp)
    split = inp.tp * inp.cp  # of queries x heads
    parts = [(SPARSE_ROWS, rows * width),
             (SPARSE_PICK_HEADS, queries * picks * cfg.num_attention_heads // split),
             (SPARSE_PICK_INDEX_HEADS, queries * picks * cfg.index_n_heads // inp.cp),
             (SPARSE_QUERY, queries * cfg.num_attention_heads * width // split),
             (SPARSE_INDEX_QUERY, queries * cfg.index_n_heads * cfg.index_head_dim // inp.cp)]
    return (sum(f * count for (f, _), count in parts),
            sum(b * count for (_, b), count in parts))


def layer_elementwise(cfg: GLM5Config, moe: bool, inp: MemoryInputs) -> tuple[int, int]:
    """(forward, backward) element-wise bytes of one decoder layer per micro-batch and rank,
    outside the sparse attention's torch path (``stage_model.attention_streamed``)."""
    if not runs_unfused(inp):
        return 0, 0
    H, n, n_sp = cfg.hidden_size, inp.tokens, inp.sp_tokens
    heads = cfg.num_attention_heads // inp.tp
    head_width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    latents = (cfg.q_lora_rank or 0) + cfg.kv_lora_rank
    parts = [(NORM, n_sp * (2 * H + latents)), (ATTENTION, n * heads * head_width),
             (RESIDUAL, n_sp * H)]
    if moe:
        k = cfg.num_experts_per_tok
        routed = n * k // inp.ep  # evenly routed tokens, the rank's experts' share
        shared = n * cfg.moe_intermediate_size * cfg.n_shared_experts // inp.tp
        parts += [(SWIGLU, routed * cfg.moe_intermediate_size // inp.expert_tp + shared),
                  (ROUTING, n * k * H // inp.ep)]
    else:
        parts.append((SWIGLU, n * cfg.intermediate_size // inp.tp))
    return (sum(f * count for (f, _), count in parts),
            sum(b * count for (_, b), count in parts))


def mtp_step_elementwise(cfg: GLM5Config, inp: MemoryInputs) -> tuple[int, int]:
    """An MTP step's own element-wise bytes besides its decoder layer: its three norms (the
    embedding's, the hidden state's, its final one)."""
    if not runs_unfused(inp):
        return 0, 0
    normed = 3 * inp.sp_tokens * cfg.hidden_size
    return NORM[0] * normed, NORM[1] * normed


def head_elementwise(cfg: GLM5Config, inp: MemoryInputs, heads: int) -> tuple[int, int]:
    """The last stage's: the final norm, and per output head (``heads``: the main one and
    each MTP step's) its embedding, concatenation and loss work."""
    if not runs_unfused(inp):
        return 0, 0
    normed, per_head = inp.sp_tokens * cfg.hidden_size, heads * inp.tokens * cfg.hidden_size
    return (NORM[0] * normed + HEAD[0] * per_head, NORM[1] * normed + HEAD[1] * per_head)


def grad_accumulation_bytes(trained_params: int, inp: MemoryInputs) -> int:
    """Bytes the weight gradients' accumulation moves per micro-batch on a rank holding
    ``trained_params``."""
    return GRAD_ACCUMULATION * trained_params if runs_unfused(inp) else 0
