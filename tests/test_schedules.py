"""Learning-rate and batch-size schedules (glm5_train/schedules.py) and a stage continuing from
another: megatron-core's scheduler and ramp driven by the train.* keys, token budgets turned
into steps, a ramped run on 2 data-parallel ranks equal to one process, and a new stage that
takes the previous one's weights, optimizer state and final learning rate."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core import num_microbatches_calculator

from glm5_train.data import MicroBatchSampler
from glm5_train.job_config import TrainConfig, compose_job
from glm5_train.optim import build_scheduler
from glm5_train.schedules import (
    BatchRamp,
    BatchSchedule,
    check_rampup_layout,
    steps_for_tokens,
    tokens_in_steps,
)
from tests.parity import FP32, assert_layout_ran, compare, one_process, run_job


def _lrs(overrides: dict, steps: int) -> list[float]:
    """The learning rate of each of ``steps`` steps under train.* ``overrides``."""
    cfg = TrainConfig(train_iters=steps, lr=1.0, min_lr=0.1, **overrides)
    cfg.validate()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = build_scheduler(optimizer, cfg, cfg.train_iters)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    return out


def test_each_decay_style_drives_megatrons_scheduler():
    linear = _lrs({"lr_decay_style": "linear", "warmup_iters": 2}, 12)
    assert linear[:3] == pytest.approx([0.0, 0.5, 1.0])
    assert linear[7] == pytest.approx(1.0 - 0.9 * 5 / 10) and linear[-1] > 0.1
    assert _lrs({"lr_decay_style": "constant", "warmup_iters": 0}, 5) == [1.0] * 5
    cosine = _lrs({"lr_decay_style": "cosine", "warmup_iters": 0}, 11)
    assert cosine[5] == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 5 / 11) + 1))
    # WSD: stable at lr until the last 4 steps of the decay, then linear down to min_lr.
    wsd = _lrs({"lr_decay_style": "WSD", "warmup_iters": 1, "lr_wsd_decay_iters": 4,
                "lr_warmup_init": 0.2}, 12)
    assert wsd[0] == 0.2 and wsd[1:9] == [1.0] * 8
    assert wsd[9:] == pytest.approx([1.0 - 0.9 * 1 / 4, 1.0 - 0.9 * 2 / 4, 1.0 - 0.9 * 3 / 4])
    rsqrt = _lrs({"lr_decay_style": "inverse-square-root", "warmup_iters": 4}, 10)
    assert rsqrt[9] == pytest.approx(max(0.1, 2 / 3))


@pytest.mark.parametrize("overrides, message", [
    ({"lr_decay_style": "Cosine"}, r"train.lr_decay_style='Cosine': use one of constant"),
    ({"lr_decay_style": "WSD"}, r"train.lr_wsd_decay_iters=None: WSD decays over the last"),
    ({"lr_decay_style": "WSD", "lr_wsd_decay_iters": 4, "lr_wsd_decay_style": "step"},
     r"train.lr_wsd_decay_style='step': use one of linear"),
    ({"rampup_batch_size": [2, 4, 100]}, (r"global_batch_size - start = 6 is not a multiple "
                                         r"of the increment 4")),
    ({"rampup_batch_size": [8, 2, 100]}, r"need 0 < start < train.global_batch_size=8"),
    ({"rampup_batch_size": [2, 2]}, r"three integers \[start, increment, samples\]"),
    ({"train_tokens": 0}, r"train.train_tokens=0 must be >= 1"),
])
def test_bad_schedules_are_refused_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as err:
        TrainConfig(train_iters=20, global_batch_size=8, warmup_iters=0, **overrides).validate()
    assert "\n" not in str(err.value)


def test_ramp_is_megatrons_and_every_batch_splits_over_the_data_parallel_ranks():
    """Batch sizes by Megatron-LM's ramp rule (consumed samples in, batch out), equal to
    megatron-core 0.16's calculator where it exists; a ramp whose sizes do not split over the
    data-parallel ranks is refused before the run."""
    ramp = BatchSchedule(16, 1, 2, [4, 4, 40])
    calculator = getattr(num_microbatches_calculator,
                         "RampupBatchsizeNumMicroBatchesCalculator", None)  # gone in 0.19
    if calculator is not None:
        theirs = calculator(3072 + 8 * 1536, 1, 32, False, 1, 3072, 1536, 114501953)
        ours = BatchRamp.from_config([3072, 1536, 114501953], 3072 + 8 * 1536)
        for consumed in range(0, 120_000_000, 99_991):
            theirs.update(consumed, consistency_check=True)
            assert ours.size_at(consumed) == theirs.get_current_global_batch_size()
    # 40 samples over 3 increments: 13.3 samples each
    assert [ramp.size_at(c) for c in (0, 13, 14, 26, 27, 39, 41)] == [4, 4, 8, 8, 12, 12, 16]
    assert ramp.consumed_after(3) == 12 and ramp.steps_at(12) == 3 and ramp.steps_at(5) is None
    with pytest.raises(ValueError, match=r"the ramp's global batch of 6 is not a multiple of "
                                         r"micro_batch_size x data-parallel size = 1 x 4"):
        check_rampup_layout([4, 2, 40], 14, 1, 4)


def test_token_budgets_become_steps_ramp_included():
    # GLM-5's 1T tokens at 32K with 512 sequences per step
    assert steps_for_tokens(1e12, 32768, 512) == math.ceil(1e12 / (32768 * 512)) == 59605
    ramp = [4, 4, 40]
    steps = steps_for_tokens(100 * 8, 8, 16, ramp)  # 100 samples of 8 tokens
    assert tokens_in_steps(steps, 8, 16, ramp) >= 800 > tokens_in_steps(steps - 1, 8, 16, ramp)
    cfg = TrainConfig(train_iters=1, train_tokens=800, seq_length=8, global_batch_size=16,
                      rampup_batch_size=ramp, warmup_iters=0)
    cfg.validate()
    assert cfg.train_iters == steps


def test_sampler_follows_the_ramp_across_ranks_and_resumes_mid_ramp():
    """The ramped global batches, split between 2 data-parallel ranks, are exactly one
    process's; a sampler started at a step boundary inside the ramp continues the same."""
    ramp = [2, 2, 12]
    single = [i for mb in MicroBatchSampler(60, 1, 8, 0, 1, 0, ramp) for i in mb]
    ranks = [list(MicroBatchSampler(60, 1, 8, r, 2, 0, ramp)) for r in (0, 1)]
    schedule = BatchSchedule(8, 1, 2, ramp)
    merged, cursor, start = [], [0, 0], 0
    while start + schedule.size_at(start) <= 60:
        size = schedule.size_at(start)
        for r in (0, 1):  # each rank's share of this global batch, rank 0's first
            merged += [i for mb in ranks[r][cursor[r]:cursor[r] + size // 2] for i in mb]
            cursor[r] += size // 2
        start += size
    assert merged == single == list(range(len(single)))
    after_two = schedule.consumed_after(2)
    resumed = [i for mb in MicroBatchSampler(60, 1, 8, 0, 1, after_two, ramp) for i in mb]
    assert resumed == single[after_two:]
    with pytest.raises(ValueError, match="is not where a step of the batch-size ramp ends"):
        MicroBatchSampler(60, 1, 8, 0, 1, 3, ramp)


RAMP = ["parallel=single", "train.train_iters=4", "train.global_batch_size=8", "train.rampup_batch_size=[2,2,10]",
        "train.lr_decay_style=linear"]


def test_ramped_run_on_two_data_parallel_ranks_equals_one_process(tmp_path):
    """Same losses and per-parameter gradients, batch by batch, as one process; the records
    say which global batch each step took."""
    reference = one_process(RAMP)
    overrides = [*RAMP, "parallel.data_parallel_size=2"]
    dp2 = run_job(2, overrides, str(tmp_path / "dp2"))
    assert [r["global_batch_size"] for r in reference.records] == [2, 2, 4, 6]
    assert [r["consumed_samples"] for r in dp2.records] == [2, 4, 8, 14]
    assert not compare(reference.records, dp2.records, FP32)
    assert_layout_ran(dp2, 2, overrides)


def test_ramp_is_refused_where_batches_are_not_the_configs():
    with pytest.raises(ValueError, match="RL steps read their rollouts by step"):
        compose_job(["data=rollouts", "data.paths=[x.jsonl]", "train.objective=grpo",
                     "train.rampup_batch_size=[2,2,10]"])


def test_a_new_stage_takes_the_previous_ones_weights_optimizer_state_and_last_lr(tmp_path):
    """Stage B starts from stage A's checkpoint (checkpoint.pretrained): A's weights and Adam
    state, at step 0, its own constant schedule at the learning rate A's linear decay ended
    at (train.lr_from_pretrained), not B's train.lr. A fresh Adam state on the same weights
    gives the same first loss and a different second step."""
    stage_a = ["parallel=single", "train.train_iters=3", "train.lr=1e-3", "train.min_lr=2e-4",
               "train.lr_decay_style=linear", f"checkpoint.save={tmp_path / 'a'}"]
    run_job(1, stage_a, str(tmp_path / "run_a"))
    stage_b = ["parallel=single", "train.train_iters=2", "train.lr=5e-3", "train.min_lr=1e-4",
               "train.lr_decay_style=constant", f"checkpoint.pretrained={tmp_path / 'a'}",
               "train.lr_from_pretrained=true"]
    took = run_job(1, [*stage_b, f"checkpoint.save={tmp_path / 'b'}"], str(tmp_path / "run_b"))
    fresh = run_job(1, [*stage_b, "checkpoint.pretrained_optimizer=false", "checkpoint.load=null"],
                    str(tmp_path / "run_fresh"))
    assert "and its optimizer state, at step 0" in took.log
    assert "a fresh optimizer state, at step 0" in fresh.log
    assert "schedule starts at learning rate 0.0002, where" in took.log
    assert [r["step"] for r in took.records] == [1, 2]
    assert [r["lr"] for r in took.records] == pytest.approx([2e-4, 2e-4])
    assert took.records[0]["consumed_samples"] == 4  # the stage counts its own samples
    assert took.records[0]["loss"] == fresh.records[0]["loss"]  # the same weights and data
    assert took.records[1]["loss"] != fresh.records[1]["loss"]  # Adam's moments differ
    # Stage B extended and restarted: it resumes its own checkpoint and the peak it started
    # at, with no notice that the saved schedule differs from train.lr.
    again = run_job(1, [*stage_b, "train.train_iters=3", f"checkpoint.save={tmp_path / 'b'}"],
                    str(tmp_path / "run_b"))
    assert [r["step"] for r in again.records] == [1, 2, 3]
    assert again.records[-1]["lr"] == pytest.approx(2e-4)
    assert "starting from the weights" not in again.log.split("checkpoint: loading")[-1]
    assert "continuing the saved learning-rate schedule (max_lr" not in again.log
