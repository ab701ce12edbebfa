"""GLM-5's RL objectives as per-token losses over the model's own log-probs.

The model's forward with labels returns each token's cross-entropy, -log pi_theta(token), in
any layout (``GLM5Model._token_losses``: chunked over tokens, vocab-parallel, this rank's
context-parallel share). The LM loss sums it over the loss mask; the objectives here replace
that sum in the same seam (``glm5_train/step.py``: megatron-core's ``loss_func`` returns a sum
and a count, and megatron divides the gradients by the global count), so every parallel
layout, the pipeline schedules and the optimizers run RL unchanged.

Per loss token t of a rollout with advantage A (docs/rl.md gives the formulas and keys):

- ``grpo``: r = pi_theta / pi_old, loss_t = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A),
  kept only where IcePop's k = pi_old / pi_rollout lies in [icepop_low, icepop_high] (a token
  outside is excluded, not clipped). pi_old is the policy at the start of the rollout batch:
  with one update per batch it is pi_theta itself, detached; otherwise a forward pass before
  the batch's first update computes it (``OldPolicy``).
- ``dis``: r = pi_theta / pi_rollout from the stored log-probs (no old policy), loss_t = -r A,
  kept only where r lies in [1 - eps_low, 1 + eps_high].
- ``distill``: ``grpo`` with A_t = log pi_teacher(t) - log pi_old(t) per token.

A rollout whose weights are more than ``max_policy_lag`` steps older than the learner's is
dropped whole. The loss is averaged over the batch's kept rollouts' loss tokens (IcePop-masked
ones included: they are part of the batch, they only give no gradient), or per rollout first
(``loss_average=sequence``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from glm5_train.rl.config import RLConfig
from parallel.comm_purpose import collective_purpose

# Per-token fields a rollout micro-batch carries beside tokens / labels / loss_mask, all
# [B, S] and aligned with the labels (position i describes the token predicted there):
ROLLOUT_FIELDS = ("rollout_logprobs", "advantages", "teacher_logprobs", "policy_version",
                  "rollout_start", "token_weight")

# Histogram of log(pi_train / pi_rollout) over loss tokens, for the ratio quantiles: bins of
# width RATIO_BIN in [-RATIO_SPAN, RATIO_SPAN], and one bin each for what falls outside.
RATIO_BIN, RATIO_SPAN = 0.01, 3.0
RATIO_BINS = round(2 * RATIO_SPAN / RATIO_BIN) + 2
LAG_BINS = 10  # policy lag 0..8 steps, and 9 or more


class Sums:
    """Positions in the per-micro-batch report vector (summed over micro-batches and ranks)."""

    LOSS, COUNT, TOKENS, MASKED, CLIPPED, ABS_DIFF, KEPT_ROLLOUTS, DROPPED_ROLLOUTS = range(8)
    ENTROPY, ENTROPY_TOKENS = 8, 9
    DRIFT = 10  # |log pi_theta - log pi_old| summed: how far the updates moved from pi_old
    LAGS = 11
    RATIOS = LAGS + LAG_BINS
    SIZE = RATIOS + RATIO_BINS


# The "rl max" report: maxima over tokens (reduced with MAX): |log pi_train - log pi_rollout|,
# log ratio, -log ratio (its minimum).
MAX_SIZE = 3


@dataclass
class TokenTerms:
    """One micro-batch's objective on this rank: the loss sum to backpropagate, the count
    megatron divides by, and the detached report sums."""

    loss_sum: torch.Tensor
    count: torch.Tensor
    sums: torch.Tensor  # float64 [Sums.SIZE]
    maxima: torch.Tensor  # float64 [MAX_SIZE]


def kept_rollouts(fields: dict[str, torch.Tensor], learner_version: int,
                  max_policy_lag: int | None) -> torch.Tensor:
    """1.0 where the token's rollout is recent enough (policy lag <= max_policy_lag)."""
    if max_policy_lag is None:
        return torch.ones_like(fields["rollout_logprobs"])
    lag = learner_version - fields["policy_version"]
    return (lag <= max_policy_lag).to(fields["rollout_logprobs"].dtype)


def token_terms(logp: torch.Tensor, loss_mask: torch.Tensor, fields: dict[str, torch.Tensor],
                objective: str, cfg: RLConfig, learner_version: int,
                old_logp: torch.Tensor | None = None,
                entropy: torch.Tensor | None = None) -> TokenTerms:
    """The objective over one micro-batch. ``logp`` [B, S]: log pi_theta of each label (with
    its gradient); ``old_logp``: pi_old's (None: pi_theta detached, one update per batch);
    ``entropy``: the policy's entropy per position (detached; None: not measured)."""
    # fp32 at least (fp64 inputs, in tests, stay fp64), as the cross-entropy's own sums.
    dtype = torch.promote_types(logp.dtype, torch.float32)
    logp = logp.to(dtype)
    field = {name: value.to(dtype) for name, value in fields.items()
             if name != "policy_version"}
    loss_mask = loss_mask.to(dtype)
    keep_rollout = kept_rollouts(fields, learner_version, cfg.max_policy_lag).to(dtype)
    tokens = loss_mask * keep_rollout
    old = logp.detach() if old_logp is None else old_logp.to(dtype)
    # The stored log-probs count only where a token trains: elsewhere (tool output, padding, a
    # dropped rollout) any value may stand, e.g. an engine's sentinel -1e4, whose ratio would
    # overflow to inf and make inf x 0 = NaN. There they read as pi_old's: ratio 1.
    rollout = torch.where(tokens > 0, field["rollout_logprobs"], old)
    if objective == "dis":
        per_token, keep, clipped = _direct_is(logp, rollout, field["advantages"], cfg)
    else:
        advantage = (field["teacher_logprobs"] - old if objective == "distill"
                     else field["advantages"])
        per_token, keep, clipped = _clipped_surrogate(logp, old, rollout, advantage, cfg)
    weight = tokens if cfg.loss_average == "token" else tokens * field["token_weight"]
    loss_sum = torch.sum(per_token * keep * weight)
    starts = field["rollout_start"] * loss_mask
    count = (tokens.sum() if cfg.loss_average == "token"
             else (starts * keep_rollout).sum()).round().to(torch.int)
    sums, maxima = _report(loss_sum, count, tokens, keep, clipped, old - rollout, starts,
                           keep_rollout, learner_version - fields["policy_version"], entropy)
    sums[Sums.DRIFT] = (tokens * (logp.detach() - old).abs()).sum()
    return TokenTerms(loss_sum, count, sums, maxima)


def _clipped_surrogate(logp, old, rollout, advantage, cfg: RLConfig):
    """GRPO / distillation: the PPO-clipped surrogate on r = pi_theta / pi_old, IcePop's mask
    on k = pi_old / pi_rollout. Returns (per-token loss, kept 0/1, clip active 0/1)."""
    ratio = torch.exp(logp - old)
    clipped_ratio = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    unclipped, clipped = ratio * advantage, clipped_ratio * advantage
    per_token = -torch.minimum(unclipped, clipped)
    clip_active = (clipped.detach() < unclipped.detach()).to(rollout.dtype)
    keep = torch.ones_like(rollout)
    if cfg.icepop_low is not None:
        k = torch.exp(old - rollout)
        keep = ((k >= cfg.icepop_low) & (k <= cfg.icepop_high)).to(rollout.dtype)
    return per_token, keep, clip_active


def _direct_is(logp, rollout, advantage, cfg: RLConfig):
    """Direct double-sided importance sampling: r = pi_theta / pi_rollout, a token outside
    [1 - eps_low, 1 + eps_high] masked. Returns (per-token loss, kept 0/1, clip active 0/1)."""
    ratio = torch.exp(logp - rollout)
    r = ratio.detach()
    keep = ((r >= 1.0 - cfg.eps_low) & (r <= 1.0 + cfg.eps_high)).to(r.dtype)
    return -ratio * advantage, keep, 1.0 - keep


def _report(loss_sum, count, tokens, keep, clipped, log_ratio, starts, keep_rollout, lag,
            entropy):
    """(sums [Sums.SIZE], maxima [MAX_SIZE]) of one micro-batch, float64, detached."""
    sums = torch.zeros(Sums.SIZE, dtype=torch.float64, device=tokens.device)
    sums[Sums.LOSS] = loss_sum.detach()
    sums[Sums.COUNT] = count
    sums[Sums.TOKENS] = tokens.sum()
    sums[Sums.MASKED] = (tokens * (1.0 - keep)).sum()
    sums[Sums.CLIPPED] = (tokens * keep * clipped).sum()
    log_ratio = log_ratio.detach()
    sums[Sums.ABS_DIFF] = (tokens * log_ratio.abs()).sum()
    sums[Sums.KEPT_ROLLOUTS] = (starts * keep_rollout).sum()
    sums[Sums.DROPPED_ROLLOUTS] = (starts * (1.0 - keep_rollout)).sum()
    if entropy is not None:
        sums[Sums.ENTROPY] = (tokens * entropy.to(tokens.dtype)).sum()
        sums[Sums.ENTROPY_TOKENS] = tokens.sum()
    lag_bin = lag.clamp(0, LAG_BINS - 1).long().reshape(-1)
    sums[Sums.LAGS:Sums.RATIOS] = torch.bincount(lag_bin, weights=starts.reshape(-1).double(),
                                                 minlength=LAG_BINS)[:LAG_BINS]
    ratio_bin = _ratio_bins(log_ratio).reshape(-1)
    sums[Sums.RATIOS:] = torch.bincount(ratio_bin, weights=tokens.reshape(-1).double(),
                                        minlength=RATIO_BINS)
    # Maxima over the loss tokens without a host sync (no token: -inf, which the job-wide MAX
    # reduction passes over).
    on = tokens.reshape(-1) > 0
    chosen = log_ratio.reshape(-1).double()
    none = torch.full_like(chosen, -math.inf)
    maxima = torch.stack([torch.where(on, chosen.abs(), none).max(),
                          torch.where(on, chosen, none).max(),
                          torch.where(on, -chosen, none).max()])
    return sums, maxima


def _ratio_bins(log_ratio: torch.Tensor) -> torch.Tensor:
    """Bin index of each log ratio: 0 below -RATIO_SPAN, RATIO_BINS - 1 above RATIO_SPAN."""
    inner = torch.floor((log_ratio + RATIO_SPAN) / RATIO_BIN).long() + 1
    return inner.clamp(0, RATIO_BINS - 1)


def ratio_quantile(histogram: list[float], q: float) -> float:
    """The q-quantile of pi_train / pi_rollout from the log-ratio histogram (bin centres:
    within RATIO_BIN / 2 in log space, i.e. 0.5 %)."""
    total = sum(histogram)
    if total <= 0:
        return math.nan
    running = 0.0
    for index, count in enumerate(histogram):
        running += count
        if running >= q * total:
            return math.exp(_bin_centre(index))
    return math.exp(_bin_centre(len(histogram) - 1))


def _bin_centre(index: int) -> float:
    if index == 0:
        return -RATIO_SPAN
    if index == RATIO_BINS - 1:
        return RATIO_SPAN
    return -RATIO_SPAN + (index - 0.5) * RATIO_BIN


class OldPolicy:
    """pi_old per micro-batch when a batch of rollouts feeds several updates: a forward-only
    pass before the batch's first update records each micro-batch's log-probs (on the last
    pipeline stage, in the schedule's micro-batch order, which every pass repeats); the
    training passes then take them in the same order."""

    def __init__(self) -> None:
        self.recording = False
        self.recorded_through = 0  # the first step whose pi_old is not recorded yet
        self._queue: deque[torch.Tensor] = deque()

    def record(self, logp: torch.Tensor) -> None:
        self._queue.append(logp.detach().float().clone())

    def take(self) -> torch.Tensor:
        if not self._queue:
            raise RuntimeError("no recorded old-policy log-probs left for this micro-batch: "
                               "the forward-only pass and the updates saw different batches")
        return self._queue.popleft()

    def pending(self) -> int:
        return len(self._queue)


class RLObjective:
    """The objective a training step's ``loss_func`` applies (``glm5_train/step.py``)."""

    def __init__(self, objective: str, cfg: RLConfig) -> None:
        self.objective, self.cfg = objective, cfg
        self.learner_version = 0  # the optimizer steps behind the weights this step starts from
        self.old_policy = OldPolicy() if cfg.updates_per_batch > 1 else None

    def loss_func(self, loss_mask: torch.Tensor, fields: dict[str, torch.Tensor],
                  take_mtp_report, take_entropy, output_tensor: torch.Tensor):
        """megatron-core's loss_func: ``output_tensor`` [B, S] is -log pi_theta per label."""
        logp = -output_tensor
        entropy = take_entropy() if take_entropy is not None else None
        if self.old_policy is not None and self.old_policy.recording:
            self.old_policy.record(logp)
            if take_mtp_report is not None:  # rl.train_mtp: that pass's MTP report is nobody's
                take_mtp_report()
            zero = output_tensor.sum() * 0.0
            return zero, torch.zeros((), dtype=torch.int), {}
        old = self.old_policy.take() if self.old_policy is not None else None
        terms = token_terms(logp, loss_mask, fields, self.objective, self.cfg,
                            self.learner_version, old, entropy)
        reports = {"rl": terms.sums, "rl max": terms.maxima,
                   "lm loss": torch.stack([terms.loss_sum.detach().float(),
                                           terms.count.float()])}
        mtp = take_mtp_report() if take_mtp_report is not None else None
        if mtp is not None:
            reports["mtp loss"] = mtp
        return terms.loss_sum, terms.count, reports


RATIO_QUANTILES = (0.05, 0.5, 0.95)


@collective_purpose("rl_stats")
def global_rl_stats(reports: list[dict[str, torch.Tensor]], groups,
                    device: torch.device) -> dict:
    """The step's RL metrics over the whole job, identical on every rank (collective).

    Only last-stage ranks hold reports; each tensor-parallel rank of a stage computed the same
    per-token values, so the sums count them ``tp_size`` times (context-parallel ranks hold
    disjoint tokens: their sums add up). ``groups``: megatron-core's ProcessGroupCollection."""
    last_stage = groups.pp.rank() == groups.pp.size() - 1
    sums = torch.zeros(Sums.SIZE, dtype=torch.float64, device=device)
    maxima = torch.full((MAX_SIZE,), -math.inf, dtype=torch.float64, device=device)
    for report in reports if last_stage else []:
        if "rl" in report:
            sums += report["rl"].to(device, torch.float64)
            maxima = torch.maximum(maxima, report["rl max"].to(device, torch.float64))
    torch.distributed.all_reduce(sums)
    torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX)
    s = (sums / groups.tp.size()).tolist()
    return _stats_from(s, maxima.tolist())


def _stats_from(s: list[float], maxima: list[float]) -> dict:
    tokens = s[Sums.TOKENS]
    per_token = (lambda x: x / tokens) if tokens > 0 else (lambda x: math.nan)
    histogram = s[Sums.RATIOS:]
    stats = {
        "rl_tokens": round(tokens),
        "rl_masked_fraction": per_token(s[Sums.MASKED]),
        "rl_clipped_fraction": (s[Sums.CLIPPED] / (tokens - s[Sums.MASKED])
                                if tokens - s[Sums.MASKED] > 0 else math.nan),
        "rl_logp_diff_mean": per_token(s[Sums.ABS_DIFF]),
        "rl_logp_diff_max": maxima[0] if tokens > 0 else math.nan,  # -inf: no token anywhere
        "rl_ratio_min": math.exp(-maxima[2]) if tokens > 0 else math.nan,
        "rl_ratio_max": math.exp(maxima[1]) if tokens > 0 else math.nan,
        "rl_policy_drift": per_token(s[Sums.DRIFT]),
        "rl_rollouts": round(s[Sums.KEPT_ROLLOUTS]),
        "rl_dropped_rollouts": round(s[Sums.DROPPED_ROLLOUTS]),
        "rl_policy_lag": [round(x) for x in s[Sums.LAGS:Sums.RATIOS]],
    }
    for q in RATIO_QUANTILES:
        stats[f"rl_ratio_p{round(100 * q):02d}"] = ratio_quantile(histogram, q)
    if s[Sums.ENTROPY_TOKENS] > 0:
        stats["rl_entropy"] = s[Sums.ENTROPY] / s[Sums.ENTROPY_TOKENS]
    return stats
