"""The DSA indexer's training signal: KL(main attention || indexer), per training stage.

DeepSeek-V3.2's recipe (GLM-5 does not state its loss; ``docs/glm5_reference.md`` sec. 4):
the target is the main attention's probabilities summed over all heads and L1-normalised; the
indexer's distribution is the softmax of its index scores; loss = KL(target || indexer).

- ``dense_warmup``: attention stays dense, everything but the indexer is frozen, KL over all
  causal keys.
- ``sparse``: attention over the top-k keys, KL over the selected set only, with the indexer's
  inputs detached so the KL trains the indexer and nothing else.
- ``freeze_indexer``: no indexer loss and no indexer updates (GLM-5's RL setting).

Memory: the sparse-stage loss scores the indexer at the selected keys only, O(B S K) saved
for backward (``DSAIndexer.selected_scores``). The dense warm-up loss materialises [B, S, S]
index scores with autograd and a [B, N, S, S] target: right for tests and moderate contexts, not
for 202K tokens (that needs a fused kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

STAGES = ("sparse", "dense_warmup")


@dataclass
class DSATrainingConfig:
    stage: str = "sparse"
    indexer_loss_coeff: float = 0.001
    freeze_indexer: bool = False

    @property
    def trains_indexer(self) -> bool:
        return not self.freeze_indexer and self.indexer_loss_coeff > 0

    def validate(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"dsa.stage={self.stage!r}: use one of {STAGES}")
        if self.indexer_loss_coeff < 0:
            raise ValueError(f"dsa.indexer_loss_coeff={self.indexer_loss_coeff} must be >= 0")
        if self.stage == "dense_warmup" and not self.trains_indexer:
            raise ValueError(
                "dsa.stage=dense_warmup trains only the indexer, but dsa.freeze_indexer=true or "
                "dsa.indexer_loss_coeff=0 leaves nothing to train: set dsa.freeze_indexer=false "
                "and a positive dsa.indexer_loss_coeff, or use dsa.stage=sparse")


class KLMeter:
    """Accumulates one layer's KL sum and query count across a step's micro-batches."""

    def __init__(self) -> None:
        self.kl_sum, self.queries = 0.0, 0

    def add(self, kl_sum: torch.Tensor, queries: int) -> None:
        self.kl_sum += float(kl_sum)
        self.queries += queries

    def take(self) -> tuple[float, int]:
        taken = (self.kl_sum, self.queries)
        self.kl_sum, self.queries = 0.0, 0
        return taken


def _sum_over_tp_heads(heads_sum: torch.Tensor, tp_group) -> torch.Tensor:
    """Heads are split over TP ranks: add the other ranks' head sums (no gradient needed)."""
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(heads_sum, group=tp_group)
    return heads_sum


def _kl(target: torch.Tensor, index_scores: torch.Tensor) -> torch.Tensor:
    """Sum over queries of KL(target || softmax(index_scores)); -inf scores are excluded."""
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    logp = torch.log_softmax(index_scores, dim=-1)
    present = target > 0
    terms = torch.where(present, target * (target.clamp_min(1e-30).log() - logp),
                        torch.zeros_like(target))
    return terms.sum()


def _detached_inputs(module, x: torch.Tensor, qr: torch.Tensor):
    return module._indexer_inputs(x.detach(), qr.detach())


def dense_indexer_kl(module, query: torch.Tensor, key: torch.Tensor, x: torch.Tensor,
                     qr: torch.Tensor, allowed_BSS: torch.Tensor | None) -> tuple:
    """Warm-up KL over all causal keys. ``query``/``key`` [S, B, N, D]."""
    seq, batch = query.shape[:2]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=query.device).tril()
    allowed = causal if allowed_BSS is None else allowed_BSS & causal
    with torch.no_grad():
        logits_BNSS = torch.einsum("sbnd,tbnd->bnst", query.float(), key.float())
        forbidden = ~allowed if allowed.dim() == 2 else ~allowed[:, None]
        logits_BNSS = (logits_BNSS * module.softmax_scale).masked_fill(forbidden, float("-inf"))
        target_BSS = _sum_over_tp_heads(logits_BNSS.softmax(-1).sum(1), module.tp_group)
    index_BSS = module.indexer.scores(*_detached_inputs(module, x, qr), allowed_BSS)
    return _kl(target_BSS, index_BSS), batch * seq


def sparse_indexer_kl(module, x: torch.Tensor, qr: torch.Tensor, topk_BSK: torch.Tensor,
                      valid_BSK: torch.Tensor, probs_BSK: torch.Tensor) -> tuple:
    """Sparse-stage KL over each query's selected keys; ``probs_BSK`` is this rank's
    head-summed attention over them. The indexer is scored at the selected keys only (O(B S K)
    memory); no mask is needed there: a valid pick is an allowed key, the rest are dropped."""
    target_BSK = _sum_over_tp_heads(probs_BSK.clone(), module.tp_group)
    target_BSK = target_BSK.masked_fill(~valid_BSK, 0.0)
    index_BSK = module.indexer.selected_scores(*_detached_inputs(module, x, qr), topk_BSK)
    index_BSK = index_BSK.masked_fill(~valid_BSK, float("-inf"))
    return _kl(target_BSK, index_BSK), topk_BSK.shape[0] * topk_BSK.shape[1]
