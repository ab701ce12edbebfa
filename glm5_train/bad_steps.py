"""Steps whose loss or gradients are not finite: found before the optimizer applies them,
reported (step, rank, first offending parameter by global name, the batch's sample indices),
then skipped or the job stopped (``train.nonfinite``).

Finding costs one pass over the gradients this rank's optimizer applies (their max-abs norms,
fused per device and dtype: a NaN or inf anywhere makes its tensor's norm non-finite) and no
host synchronisation; the verdict travels in the step-boundary all-reduce the training loop
makes anyway. Only a bad step pays for the report (one ``all_gather_object``).

Which gradients each rank checks: its share of every parameter's reduced gradient, as
``parallel.grad_norms`` counts it (each global element once in the job: the main replica under
plain DDP, the rank's slice under the distributed optimizer or Pipeline ZeRO2), so the report
names the rank that holds the offending gradient's main copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.comm_purpose import collective_purpose
from parallel.grad_norms import ParamGradNorms

NONFINITE_POLICIES = ("skip", "stop")


@dataclass
class NonfiniteOptions:
    """``train.nonfinite*`` keys (part of the job's TrainConfig)."""

    # A step whose loss or gradients are not finite (reported with step, rank, first parameter
    # and samples): "stop" the job, or "skip" its update (the batch counts as consumed) up to
    # nonfinite_max_consecutive steps in a row and nonfinite_max_total in the run.
    nonfinite: str = "stop"
    nonfinite_max_consecutive: int = 3
    nonfinite_max_total: int = 20


def check_nonfinite_options(opts: NonfiniteOptions) -> None:
    if opts.nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"train.nonfinite={opts.nonfinite!r}: use 'stop' (end the job at a "
                         "non-finite step) or 'skip' (drop its update, within the caps)")
    for name in ("nonfinite_max_consecutive", "nonfinite_max_total"):
        if getattr(opts, name) < 1:
            raise ValueError(f"train.{name}={getattr(opts, name)} must be >= 1 (use "
                             "train.nonfinite=stop to allow no skipped step)")


class NonFiniteStepError(FloatingPointError):
    """The job stops at a non-finite step (train.nonfinite=stop, or skip past its caps)."""


@dataclass
class BatchPosition:
    """Where the step's global batch lies in the training split (see ``MicroBatchSampler``):
    global batch ``index`` is samples [first, first + global_batch); ``first`` is
    index * global_batch unless given (a batch-size ramp: the samples consumed before it)."""

    index: int
    global_batch: int
    micro_batch: int
    dp_rank: int
    dp_size: int
    first: int | None = None

    @property
    def samples(self) -> range:
        start = self.index * self.global_batch if self.first is None else self.first
        return range(start, start + self.global_batch)

    def micro_batch_samples(self, micro: int) -> range:
        """Sample indices of this data-parallel rank's micro-batch ``micro`` of the step."""
        start = self.samples.start + self.dp_rank * (self.global_batch // self.dp_size)
        return range(start + micro * self.micro_batch, start + (micro + 1) * self.micro_batch)


@dataclass
class Findings:
    """One rank's non-finite values in one step."""

    rank: int
    bad_gradients: int = 0  # tensors (this rank's share) holding a NaN or inf
    first_gradient: str | None = None  # global name of the first, in model order
    bad_loss_samples: list[int] = field(default_factory=list)  # micro-batches whose loss is not finite

    @property
    def any(self) -> bool:
        return bool(self.bad_gradients or self.bad_loss_samples)


class GradientWatch:
    """This rank's share of every reduced gradient, by global name, checked for non-finite
    values (call between the pipeline schedule and ``optimizer.step()``)."""

    def __init__(self, chunks: list, optimizer, zero2=None, norms: ParamGradNorms | None = None):
        # ParamGradNorms knows where each rank's share of each gradient lives in every mode.
        self.entries = (norms or ParamGradNorms(chunks, optimizer, zero2)).entries

    def count_bad(self) -> torch.Tensor:
        """Number of this rank's gradient tensors holding a non-finite value (a tensor: no sync)."""
        flags = self._nonfinite_flags()
        return flags.sum() if flags is not None else torch.zeros((), dtype=torch.int64)

    def findings(self, rank: int) -> Findings:
        """The bad tensors and the first of them (synchronises: for a bad step's report)."""
        flags = self._nonfinite_flags()
        found = Findings(rank)
        if flags is None:
            return found
        bad = [i for i, is_bad in enumerate(flags.tolist()) if is_bad]
        found.bad_gradients = len(bad)
        found.first_gradient = self._names[bad[0]] if bad else None
        return found

    def _nonfinite_flags(self) -> torch.Tensor | None:
        grads, self._names = [], []
        for entry in self.entries:
            grad = entry.grad()
            if grad is not None and grad.numel():
                grads.append(grad)
                self._names.append(entry.name)
        if not grads:
            return None
        norms = _max_abs(grads)
        return ~torch.isfinite(norms)


class ExpertBiasSnapshot:
    """The MoE routers' expert-score biases (``noaux_tc``), kept from before a step: megatron-
    core updates them from the step's token counts inside ``finalize_model_grads``, before the
    step can be judged, so a skipped step puts them back (the step then changes nothing)."""

    def __init__(self, chunks: list) -> None:
        self.biases = [buffer for chunk in chunks for name, buffer in chunk.named_buffers()
                       if name.rsplit(".", 1)[-1] == "expert_bias"]
        self.saved: list[torch.Tensor] = []

    def take(self) -> None:
        self.saved = [bias.detach().clone() for bias in self.biases]

    def restore(self) -> None:
        for bias, saved in zip(self.biases, self.saved):
            bias.copy_(saved)


def _max_abs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """max |x| of each tensor, in order, as one float32 tensor; fused per (device, dtype)."""
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out = torch.empty(len(tensors), dtype=torch.float32, device=tensors[0].device)
    for indices in groups.values():
        norms = torch._foreach_norm([tensors[i] for i in indices], math.inf)
        out[torch.tensor(indices, device=out.device)] = torch.stack(norms).float().to(out.device)
    return out


def _loss_flags(reports: list[dict[str, torch.Tensor]]) -> torch.Tensor | None:
    """Per micro-batch (in schedule order): its LM or an MTP loss sum is not finite. Only the
    last pipeline stage holds reports (None elsewhere)."""
    if not reports:
        return None
    rows = [torch.cat([r["lm loss"].reshape(-1)] + ([r["mtp loss"].reshape(-1)]
                                                      if "mtp loss" in r else []))
            for r in reports]
    return ~torch.isfinite(torch.stack(rows)).all(dim=1)


def nonfinite_loss_count(reports: list[dict[str, torch.Tensor]]) -> torch.Tensor | float:
    """How many of this rank's micro-batches have a non-finite loss (a tensor: no sync)."""
    flags = _loss_flags(reports)
    return flags.sum().double() if flags is not None else 0.0


def bad_loss_micro_batches(reports: list[dict[str, torch.Tensor]]) -> list[int]:
    """The micro-batches (indices in schedule order) whose loss is not finite."""
    flags = _loss_flags(reports)
    return [] if flags is None else [i for i, bad in enumerate(flags.tolist()) if bad]


@collective_purpose("bad_steps")
def gather_report(found: Findings, step: int, loss: float, batch: BatchPosition) -> str:
    """Every rank's findings in one line, the same on every rank (collective)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    return describe(step, loss, everyone, batch)


def describe(step: int, loss: float, everyone: list[Findings], batch: BatchPosition) -> str:
    parts = []
    grads = [f for f in everyone if f.bad_gradients]
    if grads:
        parts.append("non-finite gradients: " + ", ".join(
            f"rank {f.rank}: {f.first_gradient} first ({f.bad_gradients} tensor"
            f"{'s' if f.bad_gradients > 1 else ''})" for f in grads))
    losses = [f for f in everyone if f.bad_loss_samples]
    if losses:
        parts.append("non-finite loss: " + ", ".join(
            f"rank {f.rank}: samples {_ranges(f.bad_loss_samples)}" for f in losses))
    elif not math.isfinite(loss):
        parts.append(f"non-finite loss {loss}")
    samples = batch.samples
    return (f"step {step}: {'; '.join(parts)}; the step's batch is samples "
            f"{samples.start}-{samples.stop - 1} of the training split")


def _ranges(samples: list[int]) -> str:
    """[4, 5, 6, 9] -> '4-6, 9'."""
    spans, start = [], None
    for i, s in enumerate(samples):
        if start is None:
            start = s
        if i + 1 == len(samples) or samples[i + 1] != s + 1:
            spans.append(f"{start}-{s}" if s != start else f"{s}")
            start = None
    return ", ".join(spans)


class NonFinitePolicy:
    """``train.nonfinite``: "stop", or "skip" within the consecutive and total caps."""

    def __init__(self, mode: str, max_consecutive: int, max_total: int) -> None:
        self.mode, self.max_consecutive, self.max_total = mode, max_consecutive, max_total
        self.consecutive = self.total = 0

    def good_step(self) -> None:
        self.consecutive = 0

    def bad_step(self, report: str) -> NonFiniteStepError | None:
        """Count a bad step: None to skip it, or the error that stops the job."""
        self.consecutive += 1
        self.total += 1
        if self.mode == "stop":
            return NonFiniteStepError(f"{report} (train.nonfinite=stop; train.nonfinite=skip "
                                      "skips such steps)")
        if self.consecutive > self.max_consecutive:
            return NonFiniteStepError(
                f"{report}; {self.consecutive} non-finite steps in a row exceed "
                f"train.nonfinite_max_consecutive={self.max_consecutive}")
        if self.total > self.max_total:
            return NonFiniteStepError(
                f"{report}; {self.total} non-finite steps exceed "
                f"train.nonfinite_max_total={self.max_total}")
        return None
