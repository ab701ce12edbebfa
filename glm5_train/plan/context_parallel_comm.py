"""The bytes a rank sends per micro-batch on its context-parallel group (the DSA layers'
gathers and reduce-scatters) and for MTP under context parallelism (its targets' gathers, its
rolls' sends), in closed form. The tensor-parallel and expert-parallel groups' traffic is
``glm5_train.plan.tensor_parallel_comm``'s.
"""

from __future__ import annotations

from glm5_train.model.config import GLM5Config
from glm5_train.plan.inputs import MemoryInputs, dense_warmup, dsa_sparse
from parallel.pipeline_layout import Comm, comm_of, comm_sum

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
    back. Dense stage, or dense fallback (every key selected): the latent alone, no indexer.
    The head-parallel mode's all-to-alls are not modelled (nothing counted)."""
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
