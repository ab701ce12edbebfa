"""Copies of the word embedding across pipeline stages, kept equal by summing their gradients.

With multi-token prediction placed on its own stage (GLM-5's split placement), or a tied output
head, the word embedding exists on several stages, and at PP=2 possibly twice on one rank (two
virtual chunks). megatron-core's embedding group cannot tie those: it deadlocks at construction
when two copies share a rank, and it reduces one chunk per rank. So its embedding group is cut to
the first stage (``parallel.process_groups.first_stage_only``) and ``EmbeddingTie`` sums every
copy's gradient instead, whatever ranks and chunks hold them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.multi_token_prediction import get_mtp_ranks
from megatron.core.utils import unwrap_model

from parallel.comm_purpose import collective_purpose


class EmbeddingTie:
    """Sum the gradients of every copy of the word embedding (first stage, MTP stage, and a tied
    output head) so the copies stay equal, whatever ranks and chunks hold them.

    Runs before megatron-core's data-parallel reduction (``finalize``): the gradient buffers then
    hold whole local gradients, so the sum is right with the distributed optimizer too, whose
    reduce-scatter leaves each buffer valid only on its own shard. Under overlapped reduction
    it runs after it instead (``glm5_train.optim.finalize_grads``, ``check_tie_buckets``).
    """

    def __init__(self, config, tie_word_embeddings: bool, pp_group):
        self.tie_word_embeddings = tie_word_embeddings
        self.group = _holder_group(config, tie_word_embeddings, pp_group)

    def holders(self, chunks: list) -> list[torch.nn.Parameter]:
        """This rank's copies: one per chunk that holds the embedding (or a tied head)."""
        copies = []
        for chunk in chunks:
            model = unwrap_model(chunk)
            mtp = getattr(model, "mtp_process", False)
            if model.pre_process or mtp or (model.post_process and self.tie_word_embeddings):
                copies.append(model.shared_embedding_or_output_weight())
        return [p for p in copies if p is not None and p.requires_grad]

    def needs_sync(self, chunks: list) -> bool:
        """Whether this rank has copies to sum (several, or one shared with other ranks)."""
        return self._needs_sync(self.holders(chunks))

    def _needs_sync(self, copies: list) -> bool:
        return bool(copies) and (len(copies) > 1 or self._group_size() > 1)

    def _group_size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else 1

    @collective_purpose("embedding_tie_{op}")
    def sync(self, chunks: list) -> None:
        copies = self.holders(chunks)
        if not self._needs_sync(copies):
            return
        group_size = self._group_size()
        grads = [_grad_of(p) for p in copies]
        total = torch.stack(grads).sum(dim=0) if len(grads) > 1 else grads[0].clone()
        if group_size > 1:
            dist.all_reduce(total, group=self.group)
        for grad in grads:
            grad.copy_(total)


def check_tie_buckets(tie: EmbeddingTie, chunks: list) -> None:
    """Under the distributed optimizer with overlapped reduction the copies are summed after
    the reduce-scatter (``glm5_train.optim.finalize_grads``), which is right only where each
    copy's valid shard covers the same elements: every copy alone in a bucket of its own,
    from the bucket's start (megatron-core gives parameters marked ``shared_embedding`` such a
    bucket under the distributed optimizer). RuntimeError naming the copy otherwise."""
    if not tie.needs_sync(chunks):
        return
    copies = {id(p): p for p in tie.holders(chunks)}
    for chunk in chunks:
        for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            for param in buffer.params:
                if id(param) not in copies:
                    continue
                start, _, bucket_id = buffer.param_index_map[param]
                bucket = buffer.buckets[bucket_id]
                if len(bucket.params) != 1 or start != bucket.offset:
                    raise RuntimeError(
                        "parallel.overlap_grad_reduce=true with the distributed optimizer: a "
                        f"word-embedding copy {tuple(param.shape)} shares its gradient bucket "
                        f"({len(bucket.params)} parameters, starting at {bucket.offset}, the "
                        f"copy at {start}), so summing the copies after the reduce-scatter "
                        "would mix shards; set parallel.overlap_grad_reduce=false")


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


@collective_purpose("embedding_tie_setup")
def _holder_group(config, tie_word_embeddings: bool, pp_group):
    """A process group over the pipeline ranks holding an embedding copy (this rank's), None
    when its copies all sit on this rank (or there is one copy).

    Every rank must create every group in the same order: gather all pipeline groups first.
    Only groups of two or more ranks are created (``new_group`` is a collective on NCCL)."""
    if dist.get_world_size(pp_group) == 1:
        return None
    if not config.mtp_num_layers and not tie_word_embeddings:
        return None  # one copy: the first stage's
    own = dist.get_process_group_ranks(pp_group)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, own)
    mine = None
    for pp_ranks in sorted({tuple(r) for r in everyone}):
        holders = {pp_ranks[0], *get_mtp_ranks(list(pp_ranks), config)}
        if tie_word_embeddings:
            holders.add(pp_ranks[-1])
        if len(holders) < 2:
            continue
        group = dist.new_group(sorted(holders))
        if dist.get_rank() in holders:
            mine = group
    return mine
