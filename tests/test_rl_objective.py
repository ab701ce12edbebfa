"""The RL objectives on planted values, against direct fp64 computations of their formulas
(docs/rl.md): losses, the counts megatron divides by, gradients, IcePop's and the importance
sampling's masks, the staleness filter, and the report's metrics."""

from __future__ import annotations

import math

import pytest
import torch

from glm5_train.rl.config import RLConfig
from glm5_train.rl.objective import (
    MAX_SIZE,
    RATIO_BIN,
    Sums,
    _stats_from,
    ratio_quantile,
    token_terms,
)
from parallel.chunked_cross_entropy import chunked_vocab_parallel_cross_entropy

# Planted ratios pi_old / pi_rollout around IcePop's band [0.5, 2], 1e-5 either side of its
# bounds (exp(log(x)) need not give x back to the last bit).
K = torch.tensor([0.3, 0.49999, 0.50001, 1.0, 1.9, 1.99999, 2.00001, 5.0], dtype=torch.float64)
OUTSIDE_ICEPOP = torch.tensor([1, 1, 0, 0, 0, 0, 1, 1], dtype=torch.bool)


def _fields(logp_old: torch.Tensor, rollout: torch.Tensor, advantages: torch.Tensor,
            **extra) -> dict[str, torch.Tensor]:
    shape = logp_old.shape
    fields = {"rollout_logprobs": rollout, "advantages": advantages,
              "teacher_logprobs": torch.zeros(shape, dtype=torch.float64),
              "policy_version": torch.zeros(shape, dtype=torch.long),
              "rollout_start": torch.zeros(shape, dtype=torch.float64),
              "token_weight": torch.ones(shape, dtype=torch.float64)}
    fields["rollout_start"].view(-1)[0] = 1.0
    fields.update(extra)
    return fields


def _planted(n: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(1, n, generator=g, dtype=torch.float64) * 3 - 0.1
    advantages = torch.randn(1, n, generator=g, dtype=torch.float64)
    return logp, advantages


def test_icepop_masks_exactly_the_tokens_outside_its_band():
    logp, advantages = _planted()
    rollout = logp - torch.log(K).view(1, -1)  # k = pi_old / pi_rollout = K (pi_old = pi_theta)
    mask = torch.ones_like(logp)
    leaf = logp.clone().requires_grad_(True)
    terms = token_terms(leaf, mask, _fields(logp, rollout, advantages), "grpo", RLConfig(), 0)
    terms.loss_sum.backward()
    kept = ~OUTSIDE_ICEPOP
    # One update per batch: r = 1, no clip; loss = -sum A over kept tokens, d/dlogp = -A.
    assert terms.loss_sum.item() == pytest.approx(-advantages[0, kept].sum().item(), rel=1e-12)
    assert torch.allclose(leaf.grad[0], torch.where(kept, -advantages[0], 0.0), atol=1e-12)
    assert terms.sums[Sums.MASKED].item() == OUTSIDE_ICEPOP.sum().item()
    assert terms.sums[Sums.TOKENS].item() == 8 and int(terms.count) == 8  # masked ones count
    assert terms.sums[Sums.CLIPPED].item() == 0


def test_icepop_off_and_a_custom_band():
    logp, advantages = _planted()
    rollout = logp - torch.log(K).view(1, -1)
    mask = torch.ones_like(logp)
    off = token_terms(logp, mask, _fields(logp, rollout, advantages), "grpo",
                      RLConfig(icepop_low=None, icepop_high=None), 0)
    assert off.sums[Sums.MASKED].item() == 0
    wide = token_terms(logp, mask, _fields(logp, rollout, advantages), "grpo",
                       RLConfig(icepop_low=0.25, icepop_high=4.0), 0)
    assert wide.sums[Sums.MASKED].item() == 1  # only k = 5


def _direct_grpo(logp, old, rollout, advantages, mask, cfg: RLConfig):
    """The formula, written out: -min(r A, clip(r) A) where IcePop keeps the token."""
    r = torch.exp(logp - old)
    surrogate = torch.minimum(r * advantages,
                              r.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * advantages)
    k = torch.exp(old - rollout)
    keep = ((k >= cfg.icepop_low) & (k <= cfg.icepop_high)).double()
    return -(surrogate * keep * mask).sum()


def test_grpo_with_a_recomputed_old_policy_clips_as_ppo():
    """Several updates per batch: r = pi_theta / pi_old away from 1, the clip active on the
    side the advantage's sign picks. Loss and gradient equal the written-out formula."""
    cfg = RLConfig()
    ratios = torch.tensor([[0.5, 0.7, 0.9, 1.0, 1.1, 1.2, 1.4, 2.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0]],
                              dtype=torch.float64)
    old = -torch.linspace(0.2, 3.0, 8, dtype=torch.float64).view(1, -1)
    logp = old + torch.log(ratios)
    k = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 5.0]], dtype=torch.float64)
    rollout = old - torch.log(k)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 1]], dtype=torch.float64)
    ours = logp.clone().requires_grad_(True)
    terms = token_terms(ours, mask, _fields(old, rollout, advantages), "grpo", cfg, 0,
                        old_logp=old)
    terms.loss_sum.backward()
    direct = logp.clone().requires_grad_(True)
    expected = _direct_grpo(direct, old, rollout, advantages, mask, cfg)
    expected.backward()
    assert terms.loss_sum.item() == pytest.approx(expected.item(), rel=1e-12)
    assert torch.allclose(ours.grad, direct.grad, atol=1e-12)
    # The clip binds at r = 0.7 with A < 0 and at r = 1.4 with A > 0 (left out by the loss
    # mask); r = 2.0 with A < 0 is unclipped but IcePop drops it (k = 5). Counted over the
    # kept loss tokens only.
    assert terms.sums[Sums.CLIPPED].item() == 1
    assert terms.sums[Sums.MASKED].item() == 1
    assert ours.grad[0, 1] == 0 and ours.grad[0, 7] == 0 and ours.grad[0, 6] == 0
    assert ours.grad[0, 0] == pytest.approx(-0.5)  # unclipped: -r A


def test_direct_importance_sampling_masks_outside_its_band():
    cfg = RLConfig()
    logp, advantages = _planted()
    r = torch.tensor([[0.5, 0.79, 0.80001, 1.0, 1.2, 1.27999, 1.3, 3.0]], dtype=torch.float64)
    rollout = logp - torch.log(r)
    mask = torch.ones_like(logp)
    ours = logp.clone().requires_grad_(True)
    terms = token_terms(ours, mask, _fields(logp, rollout, advantages), "dis", cfg, 0)
    terms.loss_sum.backward()
    keep = ((r >= 0.8) & (r <= 1.28)).double()
    assert keep.sum() == 4
    assert terms.loss_sum.item() == pytest.approx(-(r * advantages * keep).sum().item(),
                                                  rel=1e-10)
    assert torch.allclose(ours.grad, -(r * advantages * keep), atol=1e-10)
    assert terms.sums[Sums.MASKED].item() == 4


def test_distillation_advantage_is_teacher_minus_student():
    logp, _ = _planted()
    teacher = logp + torch.linspace(-1, 1, 8, dtype=torch.float64).view(1, -1)
    fields = _fields(logp, logp.clone(), torch.zeros_like(logp), teacher_logprobs=teacher)
    ours = logp.clone().requires_grad_(True)
    terms = token_terms(ours, torch.ones_like(logp), fields, "distill", RLConfig(), 0)
    terms.loss_sum.backward()
    assert torch.allclose(ours.grad, -(teacher - logp), atol=1e-12)


def test_stale_rollouts_are_dropped_whole():
    """Learner at version 5, rl.max_policy_lag=2: the rollouts of versions 2 and 1 go (both of
    their tokens), the ones of 5 and 3 stay; counts and the lag histogram follow."""
    logp, advantages = _planted()
    versions = torch.tensor([[5, 5, 3, 3, 2, 2, 1, 1]])
    starts = torch.tensor([[1, 0, 1, 0, 1, 0, 1, 0]], dtype=torch.float64)
    fields = _fields(logp, logp.clone(), advantages, policy_version=versions,
                     rollout_start=starts)
    ours = logp.clone().requires_grad_(True)
    terms = token_terms(ours, torch.ones_like(logp), fields, "grpo",
                        RLConfig(max_policy_lag=2), learner_version=5)
    terms.loss_sum.backward()
    fresh = (versions >= 3).double()
    assert torch.allclose(ours.grad, -advantages * fresh, atol=1e-12)
    assert int(terms.count) == 4 and terms.sums[Sums.TOKENS].item() == 4
    assert terms.sums[Sums.KEPT_ROLLOUTS].item() == 2
    assert terms.sums[Sums.DROPPED_ROLLOUTS].item() == 2
    lags = terms.sums[Sums.LAGS:Sums.RATIOS].tolist()
    assert lags[0] == 1 and lags[2] == 1 and lags[3] == 1 and lags[4] == 1 and sum(lags) == 4


def test_sequence_averaging_counts_rollouts():
    """loss_average=sequence: each rollout's tokens weigh 1 / its loss tokens, and megatron
    divides by the rollouts: the mean of per-rollout means."""
    logp, advantages = _planted()
    starts = torch.tensor([[1, 0, 0, 1, 0, 0, 0, 0]], dtype=torch.float64)
    weights = torch.tensor([[1 / 3] * 3 + [1 / 5] * 5], dtype=torch.float64)
    fields = _fields(logp, logp.clone(), advantages, rollout_start=starts,
                     token_weight=weights)
    terms = token_terms(logp, torch.ones_like(logp), fields, "grpo",
                        RLConfig(loss_average="sequence"), 0)
    per_rollout = [-advantages[0, :3].mean(), -advantages[0, 3:].mean()]
    assert int(terms.count) == 2
    assert terms.loss_sum.item() / 2 == pytest.approx(float(sum(per_rollout)) / 2, rel=1e-12)


def test_ratio_quantiles_and_extremes_from_the_report():
    g = torch.Generator().manual_seed(1)
    log_ratio = torch.randn(1, 4000, generator=g, dtype=torch.float64) * 0.3
    logp = -torch.rand(1, 4000, generator=g, dtype=torch.float64) - 0.1
    rollout = logp - log_ratio
    terms = token_terms(logp, torch.ones_like(logp), _fields(logp, rollout,
                        torch.zeros_like(logp)), "grpo", RLConfig(), 0)
    stats = _stats_from(terms.sums.tolist(), terms.maxima.tolist())
    for q in (0.05, 0.5, 0.95):
        exact = math.exp(torch.quantile(log_ratio, q).item())
        ours = stats[f"rl_ratio_p{round(100 * q):02d}"]
        assert abs(math.log(ours) - math.log(exact)) <= RATIO_BIN, (q, ours, exact)
    assert stats["rl_ratio_max"] == pytest.approx(math.exp(log_ratio.max().item()), rel=1e-9)
    assert stats["rl_ratio_min"] == pytest.approx(math.exp(log_ratio.min().item()), rel=1e-9)
    assert stats["rl_logp_diff_max"] == pytest.approx(log_ratio.abs().max().item(), rel=1e-9)
    assert stats["rl_logp_diff_mean"] == pytest.approx(log_ratio.abs().mean().item(), rel=1e-9)
    outside = ((torch.exp(log_ratio) < 0.5) | (torch.exp(log_ratio) > 2)).sum().item()
    assert stats["rl_masked_fraction"] == pytest.approx(outside / 4000)
    assert len(terms.maxima) == MAX_SIZE


def test_ratio_quantile_of_an_empty_histogram_is_nan():
    assert math.isnan(ratio_quantile([0.0] * 10, 0.5))


def test_model_log_probs_equal_log_softmax_of_full_logits_in_fp64():
    """The objective's log pi_theta is minus the chunked head's per-token cross-entropy: on a
    small case it equals log_softmax of the full logits at the label, computed directly."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(12, 2, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 50, (12, 2), generator=g)
    logp = -chunked_vocab_parallel_cross_entropy(hidden, weight, labels, chunk_tokens=5)
    direct = torch.log_softmax(hidden @ weight.t(), dim=-1).gather(
        -1, labels.unsqueeze(-1)).squeeze(-1)
    assert logp.dtype == torch.float64
    assert torch.allclose(logp, direct, atol=1e-12, rtol=0)


@pytest.mark.parametrize("changes,needle", [
    ({"eps_low": 1.0}, "rl.eps_low=1.0"),
    ({"eps_high": -0.1}, "rl.eps_high=-0.1"),
    ({"icepop_low": 0.5, "icepop_high": None}, "set both"),
    ({"icepop_low": 1.5, "icepop_high": 2.0}, "0 < low <= 1 <= high"),
    ({"max_policy_lag": -1}, "rl.max_policy_lag=-1"),
    ({"loss_average": "rollout"}, "rl.loss_average='rollout'"),
    ({"updates_per_batch": 0}, "rl.updates_per_batch=0"),
    ({"publish_dtype": "fp16"}, "rl.publish_dtype='fp16'"),
])
def test_bad_rl_config_is_refused_in_one_line(changes, needle):
    with pytest.raises(ValueError) as err:
        RLConfig(**changes).validate("grpo")
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("objective", ["dis", "grpo"])
def test_a_sentinel_log_prob_where_nothing_trains_stays_harmless(objective):
    """An engine may store any value where the loss mask is 0 (e.g. -1e4 for tool output): its
    ratio would overflow to inf, and inf x 0 is NaN. Loss and gradient stay finite and equal
    those of the same batch with a plain value there."""
    logp, advantages = _planted()
    mask = torch.ones_like(logp)
    mask[0, 3] = 0.0
    results = []
    for stored in (-1e4, -1.0):
        rollout = logp.clone()
        rollout[0, 3] = stored
        ours = logp.clone().float().requires_grad_(True)  # fp32, as the job runs
        fields = {k: v.float() if v.is_floating_point() else v
                  for k, v in _fields(logp, rollout, advantages).items()}
        terms = token_terms(ours, mask.float(), fields, objective, RLConfig(), 0)
        terms.loss_sum.backward()
        assert torch.isfinite(terms.loss_sum) and torch.isfinite(ours.grad).all()
        results.append((terms.loss_sum.item(), ours.grad.clone(), terms.sums.clone()))
    assert results[0][0] == results[1][0]
    assert torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[0][2], results[1][2])
