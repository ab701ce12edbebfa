"""GLM-5's curriculum (glm5_train/curriculum.py, printed by tools/curriculum.py): every stage preset composes, passes the layout rules
on its cluster, reaches the report's token budget and fits its device by the planner; the
learning rate runs on from stage to stage as the report's does."""

from __future__ import annotations

import pytest

from glm5_train.job_config import compose_job
from glm5_train import curriculum
from parallel.layout import validate_layout

# The report's budgets, in tokens, by preset.
BUDGETS = {"glm5_pretrain_4k": 28.5e12, "glm5_midtrain_32k": 1e12, "glm5_midtrain_128k": 5e11,
           "glm5_midtrain_200k": 5e10, "glm5_dsa_sparse": 2e10}


@pytest.fixture(scope="module")
def rows() -> dict[str, curriculum.Row]:
    return {row.stage.experiment: row for row in map(curriculum.stage_row, curriculum.STAGES)}


def test_every_stage_composes_and_fits_its_cluster_by_the_planner(rows):
    for stage in curriculum.STAGES:
        job = compose_job(stage.overrides)
        dp = validate_layout(job.parallel, job.model, stage.gpus, job.train.global_batch_size,
                             job.train.micro_batch_size, job.train.seq_length)
        row = rows[stage.experiment]
        assert row.dp == dp and row.fit.gpus == stage.gpus
        # Every stage leaves the stated margin of its device for what the planner leaves out.
        assert row.free_fraction >= 0.2, (stage.name, row.fit.peak_bytes)
        if stage.experiment.startswith(("glm5_pretrain", "glm5_midtrain")):
            assert job.dsa.stage == "dense" and job.train.optimizer == "muon"


def test_token_budgets_become_the_stages_steps(rows):
    for experiment, budget in BUDGETS.items():
        row = rows[experiment]
        job = compose_job([f"+experiment={experiment}"])
        last_step = job.train.global_batch_size * job.train.seq_length
        assert budget <= row.tokens < budget + last_step, experiment
    pretrain = compose_job(["+experiment=glm5_pretrain_4k"]).train
    assert pretrain.rampup_batch_size == [3072, 1536, 114501953]  # over the first 469B tokens
    assert rows["glm5_dsa_warmup"].steps == 1000


def test_the_learning_rate_runs_on_from_stage_to_stage():
    """Pre-training 0 -> 2e-4 -> 4e-5 (cosine); mid-training 4e-5 -> 1e-5 on one line over its
    1.55T tokens, each stage starting where the one before ended; DSA warm-up 5e-3 -> 2e-4;
    sparse adaptation a constant 1e-5."""
    train = {e: compose_job([f"+experiment={e}"]).train for e in
             ("glm5_pretrain_4k", "glm5_midtrain_32k", "glm5_midtrain_128k",
              "glm5_midtrain_200k", "glm5_dsa_warmup", "glm5_dsa_sparse")}
    pre = train["glm5_pretrain_4k"]
    assert (pre.lr_warmup_init, pre.lr, pre.min_lr, pre.lr_decay_style) == (0.0, 2e-4, 4e-5,
                                                                             "cosine")
    previous_end, tokens = pre.min_lr, 0.0
    for name in ("glm5_midtrain_32k", "glm5_midtrain_128k", "glm5_midtrain_200k"):
        t = train[name]
        tokens += BUDGETS[name]
        assert t.lr == pytest.approx(previous_end, rel=1e-5) and t.lr_decay_style == "linear"
        assert t.min_lr == pytest.approx(4e-5 - 3e-5 * tokens / 1.55e12, rel=1e-5)
        previous_end = t.min_lr
    assert previous_end == pytest.approx(1e-5)
    assert (train["glm5_dsa_warmup"].lr, train["glm5_dsa_warmup"].min_lr) == (5e-3, 2e-4)
    sparse = train["glm5_dsa_sparse"]
    assert (sparse.lr, sparse.lr_decay_style) == (1e-5, "constant")


def test_the_table_names_every_stage(rows):
    out = "\n".join(curriculum.table([rows[s.experiment] for s in curriculum.STAGES], 0.2))
    for stage in curriculum.STAGES:
        assert f"stage={stage.experiment} steps=" in out
    assert "462,585" in out  # pre-training's steps, the batch ramp's included


def test_the_202k_sft_fits_128_h100_with_the_optimizer_state_in_host_memory():
    """tools/curriculum.py --smallest-sft's answer as a preset: 128 H100 fit with a margin;
    on 64 the weights, gradients and what is left of the state on the device pass 80 GB."""
    fit = curriculum.stage_plan(["+experiment=glm5_sft_202k", "parallel=glm5_sft_202k_128gpu"], 1)
    assert fit.gpus == 128 and fit.peak_bytes <= 0.8 * curriculum.DEVICES["H100"]
    smaller = curriculum.stage_plan(curriculum.sft_overrides(8, 4, 2, host_optimizer=True), 1)
    assert smaller.gpus == 64 and smaller.static_bytes > curriculum.DEVICES["H100"]
