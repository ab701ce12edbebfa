"""The bytes the element-wise operators of a step move on CPUs, per rank: norms, SwiGLU,
MoE routing, attention's rotary and concatenations, residual adds, the weight gradients'
accumulation and torch's AdamW. The step-time model prices them at the memory rate.

Why only on CPUs: there each is a torch operator of its own (fp32, no fusion), and together
they are the part of a compute-bound step that no FLOPs term holds (about a seventh of one
process's step at the bench's ``compute_bound`` widths). On GPUs Transformer Engine fuses
norms and activations and the optimizer is a fused kernel: those bytes are unmeasured here
and left to the compute rate, as before.

The constants are bytes per element, what each operator reads and writes (its tensor inputs
and outputs; an operator that only writes its destination, such as ``copy_``, is not counted
as reading it), counted from a dispatch-level trace of one training step (every aten
operator but matmuls, views and collectives, keyed by the module whose forward ran it or
made its autograd node: ``tests/elementwise_count.py``), at the bench's ``compute_bound``
widths in fp32 (hidden 1,024, 8 heads, 512 tokens, top-k 128, vocabulary 320). The sparse
attention's picked rows were counted directly; its three other terms were fitted (non-negative
least squares) to four counts: 512 or 256 tokens, top-k 128 or 64, one process or TP2, each
within 5%. ``tests/test_elementwise.py`` re-counts a step at those widths (one process) and
at the tiny model's (TP2 + SP, EP2) against these formulas.
"""

from __future__ import annotations

from glm5_train.model.config import GLM5Config
from glm5_train.plan.inputs import MemoryInputs

# The widths the constants were counted at, as overrides of model=glm5_tiny (its depth):
# bench/step_time_vs_measured.py's --width compute_bound, and tests/test_elementwise.py's
# regression count.
COUNTED_WIDTHS = ("model.hidden_size=1024", "model.intermediate_size=2048",
                  "model.moe_intermediate_size=512", "model.q_lora_rank=512",
                  "model.kv_lora_rank=256", "model.num_attention_heads=8",
                  "model.num_key_value_heads=8", "model.qk_nope_head_dim=64",
                  "model.qk_rope_head_dim=32", "model.v_head_dim=64", "model.index_n_heads=8",
                  "model.index_head_dim=64", "model.index_topk=128")

# (forward, backward) bytes per element, fp32, counted (module docstring):
# RMSNorm in fp32 (pow, mean, the rsqrt scale, the weight), hidden and latent norms alike; its
# backward is autograd's over the same operators.
NORM = (28, 103)
# SwiGLU per [tokens, ffn] element (the gate's SiLU, the product, fc1's split): dense MLPs,
# shared and routed experts alike.
SWIGLU = (32, 65)
# MoE routing per [tokens x top-k, hidden] element a rank's experts receive: the router, the
# permutation's gather, the combine's weighting and scatter-add, and their backward.
ROUTING = (54, 58)
# MLA outside its core attention per [tokens, heads x (qk + v head width)] element: rotary,
# the nope/rope concatenations and splits, the down projections' summed input gradients.
ATTENTION = (21, 50)
# A decoder layer's two residual adds per [tokens, hidden] element (their backward passes the
# gradient through).
RESIDUAL = (24, 0)
# Per output head (the main one and each MTP step's) and [tokens, hidden] element: the
# embedding lookup, MTP's concatenation and roll.
HEAD = (28, 44)
# Per output head and [tokens, vocabulary / TP] element: the vocabulary-parallel cross
# entropy's max, exponent, sums and gathers, and its gradient.
LOSS = (28, 44)
# The weight gradients' accumulation into the fp32 main gradients (no gradient-accumulation
# fusion): bytes per trained parameter and micro-batch (counted 16.6).
GRAD_ACCUMULATION = 17
# The absorbed sparse attention's torch path (glm5_train/model/sparse_mla.py) and its indexer:
# - its gathers and scatters per picked latent element [queries, K, C + R]: the forward's row
#   gather writes them (5.1 counted), the backward gathers again and index_add reads their
#   gradients (10.4);
# - per [queries, K, heads on the rank]: the logits' mask and softmax gradients (the forward's
#   share fitted at 0);
# - per [queries, K, index heads] (replicated over TP): the indexer's scores at the picks and
#   its KL, the picks' softmax;
# - per [queries, heads on the rank, C + R]: the absorbed queries' copies and casts, the
#   backward's concatenations.
SPARSE_ROWS = (5, 10)
SPARSE_PICK_HEADS = (0, 57)
SPARSE_PICK_INDEX_HEADS = (170, 99)
SPARSE_QUERY = (49, 95)
# torch's AdamW, one tensor at a time (megatron-core's choice without apex or Transformer
# Engine), with gradient clipping's norm and scale and the gradient buffer's zeroing: bytes
# per parameter element and step (the first step's state allocation is not counted).
TORCH_ADAMW_STEP_BYTES = 120


def runs_unfused(inp: MemoryInputs) -> bool:
    """Whether the plan's element-wise work runs as separate torch operators (a CPU plan)."""
    return not inp.fused_attention


def _total(parts: list[tuple[tuple[int, int], int]]) -> tuple[int, int]:
    """(forward, backward) bytes of (bytes per element, elements) pairs."""
    return (sum(f * count for (f, _), count in parts),
            sum(b * count for (_, b), count in parts))


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
    return _total([(SPARSE_ROWS, rows * width),
                   (SPARSE_PICK_HEADS, queries * picks * cfg.num_attention_heads // split),
                   (SPARSE_PICK_INDEX_HEADS, queries * picks * cfg.index_n_heads // inp.cp),
                   (SPARSE_QUERY, queries * cfg.num_attention_heads * width // split)])


def _layer_parts(cfg: GLM5Config, moe: bool, inp: MemoryInputs) -> dict[str, tuple]:
    """A decoder layer's element-wise terms by kind: (bytes per element, elements)."""
    H, n, n_sp = cfg.hidden_size, inp.tokens, inp.sp_tokens
    heads = cfg.num_attention_heads // inp.tp
    head_width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    latents = (cfg.q_lora_rank or 0) + cfg.kv_lora_rank
    parts = {"norm": (NORM, n_sp * (2 * H + latents)),
             "attention": (ATTENTION, n * heads * head_width),
             "residual": (RESIDUAL, n_sp * H)}
    if not moe:
        parts["swiglu"] = (SWIGLU, n * cfg.intermediate_size // inp.tp)
        return parts
    # Each rank routes its own tokens (under SP, its expert-TP group's gathered ones); its
    # experts receive as many rows on average, whatever the EP size.
    routed = cfg.num_experts_per_tok * (n_sp * inp.expert_tp if inp.sequence_parallel else n)
    parts["expert_swiglu"] = (SWIGLU, routed * cfg.moe_intermediate_size // inp.expert_tp)
    parts["shared_swiglu"] = (SWIGLU, n * cfg.moe_intermediate_size * cfg.n_shared_experts
                              // inp.tp)
    parts["routing"] = (ROUTING, routed * H)
    return parts


# What selective recompute runs again (parallel.recompute's modules), by kind.
RECOMPUTED = {"moe_act": ("expert_swiglu",), "mla_up_proj": ("attention",)}


def layer_elementwise(cfg: GLM5Config, moe: bool, inp: MemoryInputs) -> tuple[int, int]:
    """(forward, backward) element-wise bytes of one decoder layer per micro-batch and rank,
    outside the sparse attention's torch path (``stage_model.attention_streamed``); the
    backward's include the forward bytes selective recompute runs again."""
    if not runs_unfused(inp):
        return 0, 0
    parts = _layer_parts(cfg, moe, inp)
    forward, backward = _total(list(parts.values()))
    again = {kind for module, kinds in RECOMPUTED.items() if inp.recompute.selects(module)
             for kind in kinds if kind in parts}
    return forward, backward + _total([parts[kind] for kind in again])[0]


def mtp_step_elementwise(cfg: GLM5Config, inp: MemoryInputs) -> tuple[int, int]:
    """An MTP step's own element-wise bytes besides its decoder layer: its three norms (the
    embedding's, the hidden state's, its final one)."""
    if not runs_unfused(inp):
        return 0, 0
    return _total([(NORM, 3 * inp.sp_tokens * cfg.hidden_size)])


def head_elementwise(cfg: GLM5Config, inp: MemoryInputs, heads: int) -> tuple[int, int]:
    """The last stage's: the final norm, and per output head (``heads``: the main one and
    each MTP step's) its embedding, concatenation and loss work. (The main embedding's lookup
    runs on the first stage; counted here with the heads, a small share.)"""
    if not runs_unfused(inp):
        return 0, 0
    return _total([(NORM, inp.sp_tokens * cfg.hidden_size),
                   (HEAD, heads * inp.tokens * cfg.hidden_size),
                   (LOSS, heads * inp.tokens * cfg.vocab_size // inp.tp)])


def grad_accumulation_bytes(trained_params: int, inp: MemoryInputs) -> int:
    """Bytes the weight gradients' accumulation moves per micro-batch on a rank holding
    ``trained_params``."""
    return GRAD_ACCUMULATION * trained_params if runs_unfused(inp) else 0
