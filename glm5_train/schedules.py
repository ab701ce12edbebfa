"""Learning-rate and batch-size schedules, and what a token budget comes to in steps.

The learning rate follows megatron-core's ``OptimizerParamScheduler`` (``train.lr_decay_style``:
constant, linear, cosine, inverse-square-root or WSD), counted in optimizer steps; the global
batch ramps up by Megatron-LM's ``--rampup-batch-size`` rule (``train.rampup_batch_size=[start,
increment, samples]``; megatron-core 0.16's ``RampupBatchsizeNumMicroBatchesCalculator``, gone in
0.19: ``BatchRamp.size_at``), counted in consumed samples: the batch is ``start`` at first, grows by ``increment`` every
``samples / ((global_batch_size - start) / increment)`` samples, and is ``global_batch_size``
once ``samples`` samples have been consumed.

A stage of a curriculum counts its own steps, samples and tokens from 0 (it starts from another
run's weights by ``checkpoint.pretrained``). ``steps_for_tokens`` turns a stage's token budget
into the steps that reach it, ramp included; ``final_lr`` reads the learning rate a saved
schedule ended at, where the next stage may start its own (``train.lr_from_pretrained``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

# megatron-core's names (OptimizerParamScheduler.get_lr), as Megatron-LM's --lr-decay-style.
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclass(frozen=True)
class BatchRamp:
    """``train.rampup_batch_size`` read: the global batch starts at ``start``, grows by
    ``increment`` in equal shares of ``samples`` consumed samples, up to ``target``."""

    start: int
    increment: int
    samples: int
    target: int

    @classmethod
    def from_config(cls, rampup: list[int] | None, global_batch_size: int) -> BatchRamp | None:
        if not rampup:
            return None
        start, increment, samples = (int(v) for v in rampup)
        return cls(start, increment, samples, global_batch_size)

    def size_at(self, consumed_samples: int) -> int:
        """The global batch after ``consumed_samples`` samples: Megatron-LM's
        ``--rampup-batch-size`` rule (megatron-core 0.16's ``RampupBatchsizeNumMicroBatches
        Calculator``, which 0.19 replaced by step schedules), written out so that every
        release ramps alike (tests/test_schedules.py compares it with 0.16's class)."""
        if consumed_samples > self.samples:
            return self.target
        increments = (self.target - self.start) // self.increment
        per_increment = self.samples / increments
        return self.start + int(consumed_samples / per_increment) * self.increment

    def sizes(self) -> list[int]:
        """Every global batch size the ramp passes through, ``target`` last."""
        return list(range(self.start, self.target + 1, self.increment))


def check_rampup(rampup: list[int] | None, global_batch_size: int, micro_batch_size: int) -> None:
    """``train.rampup_batch_size`` is [start, increment, samples] with start < global batch,
    the difference a multiple of increment, and every size a multiple of the micro-batch
    (the data-parallel size is checked with the layout: ``check_rampup_layout``)."""
    if rampup is None:
        return
    fix = ("set train.rampup_batch_size=[start, increment, samples], e.g. "
           f"[{max(micro_batch_size, global_batch_size // 4)}, "
           f"{max(micro_batch_size, global_batch_size // 4)}, 1000], or null for no ramp")
    if len(rampup) != 3 or any(not isinstance(v, int) for v in rampup):
        raise ValueError(f"train.rampup_batch_size={rampup}: three integers [start, increment, "
                         f"samples]; {fix}")
    start, increment, samples = rampup
    if not (0 < start < global_batch_size and increment > 0 and samples > 0):
        raise ValueError(f"train.rampup_batch_size={rampup}: need 0 < start < "
                         f"train.global_batch_size={global_batch_size}, increment > 0 and "
                         f"samples > 0; {fix}")
    if (global_batch_size - start) % increment:
        raise ValueError(f"train.rampup_batch_size={rampup}: global_batch_size - start = "
                         f"{global_batch_size - start} is not a multiple of the increment "
                         f"{increment}; {fix}")
    check_rampup_layout(rampup, global_batch_size, micro_batch_size, 1)


def check_rampup_layout(rampup: list[int] | None, global_batch_size: int, micro_batch_size: int,
                        dp_size: int) -> None:
    """Every batch size of the ramp splits into whole micro-batches on every data-parallel
    rank (megatron-core's own calculators assert it at the step it is reached: refuse up
    front)."""
    ramp = BatchRamp.from_config(rampup, global_batch_size)
    if ramp is None:
        return
    unit = micro_batch_size * dp_size
    bad = [size for size in ramp.sizes() if size % unit]
    if bad:
        raise ValueError(f"train.rampup_batch_size={rampup}: the ramp's global batch of "
                         f"{bad[0]} is not a multiple of micro_batch_size x data-parallel size "
                         f"= {micro_batch_size} x {dp_size}: choose start and increment that "
                         f"are multiples of {unit}")


class BatchSchedule:
    """The global batch of each step, from the samples consumed before it: constant, or
    megatron-core's ramp. The same answer on every rank (a pure function of consumed)."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, dp_size: int,
                 rampup: list[int] | None = None) -> None:
        self.global_batch_size = global_batch_size
        self._ramp = BatchRamp.from_config(rampup, global_batch_size)
        check_rampup_layout(rampup, global_batch_size, micro_batch_size, dp_size)

    @property
    def ramps(self) -> bool:
        return self._ramp is not None

    def size_at(self, consumed_samples: int) -> int:
        return self._ramp.size_at(consumed_samples) if self._ramp else self.global_batch_size

    def consumed_after(self, steps: int) -> int:
        """Samples consumed by the first ``steps`` steps."""
        consumed = 0
        for done in range(steps):
            size = self.size_at(consumed)
            if size == self.global_batch_size:  # the ramp is over: the rest in one go
                return consumed + (steps - done) * size
            consumed += size
        return consumed

    def steps_at(self, consumed_samples: int) -> int | None:
        """Steps that consume exactly ``consumed_samples`` (None: not a step boundary)."""
        steps = consumed = 0
        while consumed < consumed_samples:
            size = self.size_at(consumed)
            if size == self.global_batch_size:
                rest = consumed_samples - consumed
                return None if rest % size else steps + rest // size
            consumed += size
            steps += 1
        return steps if consumed == consumed_samples else None


def steps_for_tokens(tokens: float, seq_length: int, global_batch_size: int,
                     rampup: list[int] | None = None, micro_batch_size: int = 1) -> int:
    """The fewest steps whose batches hold at least ``tokens`` tokens (the ramp's smaller
    batches first)."""
    schedule = BatchSchedule(global_batch_size, micro_batch_size, 1, rampup)
    needed = math.ceil(tokens / seq_length)  # samples
    steps = consumed = 0
    while consumed < needed:
        size = schedule.size_at(consumed)
        if size == global_batch_size:
            return steps + math.ceil((needed - consumed) / size)
        consumed += size
        steps += 1
    return steps


def tokens_in_steps(steps: int, seq_length: int, global_batch_size: int,
                    rampup: list[int] | None = None, micro_batch_size: int = 1) -> int:
    schedule = BatchSchedule(global_batch_size, micro_batch_size, 1, rampup)
    return schedule.consumed_after(steps) * seq_length


def build_lr_scheduler(optimizer, *, lr: float, min_lr: float, init_lr: float,
                       warmup_steps: int, decay_steps: int, style: str, weight_decay: float,
                       wsd_decay_steps: int | None = None,
                       wsd_decay_style: str = "linear") -> OptimizerParamScheduler:
    """megatron-core's scheduler: linear warm-up from ``init_lr`` to ``lr`` over
    ``warmup_steps``, then ``style`` down to ``min_lr`` at ``decay_steps`` (WSD: constant, then
    ``wsd_decay_style`` over the last ``wsd_decay_steps``), ``min_lr`` after; constant weight
    decay."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=init_lr,
        max_lr=lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=max(decay_steps, warmup_steps + 1),
        lr_decay_style=style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=max(decay_steps, 1),
        wd_incr_style="constant",
        wsd_decay_steps=wsd_decay_steps,
        lr_wsd_decay_style=wsd_decay_style if style == "WSD" else None,
    )


class _SavedSchedule(OptimizerParamScheduler):
    """A saved scheduler state, asked for its learning rate by megatron-core's own formula
    (no optimizer: ``get_lr`` reads only these fields)."""

    def __init__(self, saved: dict) -> None:  # pylint: disable=super-init-not-called
        self.init_lr = saved.get("init_lr", 0.0)
        self.max_lr, self.min_lr = saved["max_lr"], saved["min_lr"]
        self.lr_warmup_steps = saved["lr_warmup_steps"]
        self.lr_decay_steps = saved["lr_decay_steps"]
        self.lr_decay_style = saved["lr_decay_style"]
        self.num_steps = saved["num_steps"]
        self.wsd_decay_steps = saved.get("wsd_decay_steps")
        self.lr_wsd_decay_style = saved.get("lr_wsd_decay_style")


def final_lr(saved_scheduler: dict) -> float:
    """The learning rate of a saved schedule's last step (what megatron-core set last)."""
    return _SavedSchedule(saved_scheduler).get_lr({})


def lr_shape(style: str, lr: float, min_lr: float, init_lr: float, warmup_steps: int,
             wsd_decay_steps: int | None = None, wsd_decay_style: str = "linear") -> str:
    """One line for a table: e.g. ``0 -> 2e-4 (2000 warm-up) -> 4e-5 cosine``."""
    head = f"{init_lr:.3g} -> {lr:.3g} ({warmup_steps} warm-up) -> " if warmup_steps else f"{lr:.3g} -> "
    if style == "constant":
        return f"{head.removesuffix(' -> ') if warmup_steps else f'{lr:.3g}'} constant"
    if style == "WSD":
        return f"{head}{min_lr:.3g} WSD ({wsd_decay_style} over the last {wsd_decay_steps})"
    return f"{head}{min_lr:.3g} {style}"
