"""The GLM-5 experiment recipes (configs/experiment/) compose, pass every layout rule at the
world size their parallel preset names, and fit a 141 GB H200 by the planner's estimate."""

from __future__ import annotations

import pytest

from glm5_train.job_config import compose_job
from glm5_train.pipeline_plan import (
    inputs_from_job,
    job_pipeline,
    plan_report,
    resolve_pipeline_layout,
)
from parallel.layout import validate_layout

H200_BYTES = 141 * 10**9
WORLD = 256  # configs/parallel/glm5_200k_256gpu.yaml: TP8 x PP8 x DP4


@pytest.mark.parametrize("experiment", ["glm5_dsa_sparse", "glm5_dsa_warmup"])
def test_experiment_composes_and_passes_the_layout_rules(experiment):
    job = compose_job([f"+experiment={experiment}"])
    assert job.train.seq_length == 202_752 == job.model.max_position_embeddings
    dp = validate_layout(job.parallel, job.model, WORLD, job.train.global_batch_size,
                         job.train.micro_batch_size, job.train.seq_length)
    assert dp == 4
    assert resolve_pipeline_layout(job, dp)  # a balanced MTP-split layout exists


def _planned_bytes(overrides: list[str], working_set_overrides: list[str]) -> tuple[int, int]:
    """(largest rank's static + in-flight bytes, one decoder layer's working set): the first
    from the recipe, the second from the same layout planned with ``working_set_overrides``
    (every intermediate a layer's forward keeps when it trains)."""
    job = compose_job(overrides)
    dp = validate_layout(job.parallel, job.model, WORLD, job.train.global_batch_size,
                         job.train.micro_batch_size, job.train.seq_length)
    layout = job_pipeline(job, dp)
    report = plan_report(job.model, layout, inputs_from_job(job, dp), job.activations)
    trained = compose_job([*overrides, *working_set_overrides])
    full = plan_report(trained.model, layout, inputs_from_job(trained, dp), trained.activations)
    working_set = max(stage.costs.activation_bytes_per_microbatch / stage.layers.count("t")
                      for stage in full.stages if "t" in stage.layers)
    return report.max_rank_bytes, int(working_set)


def test_sparse_stage_at_202752_tokens_fits_an_h200_by_the_planner():
    """Full recompute keeps each layer's input; the largest rank's static + in-flight bytes
    plus one layer's recompute working set (the layer's activations without recompute) stay
    under 141 GB."""
    rank, working_set = _planned_bytes(
        ["+experiment=glm5_dsa_sparse"],
        ["activations.recompute_granularity=null", "activations.recompute_method=null",
         "activations.recompute_num_layers=null"])
    print(f"sparse stage at 202,752 tokens: max rank {rank / 2**30:.1f} GiB "
          f"+ one layer's working set {working_set / 2**30:.1f} GiB")
    assert rank + working_set < H200_BYTES


def test_warmup_stage_at_202752_tokens_fits_an_h200_by_the_planner():
    """The dense warm-up's forward runs without autograd (each layer's KL backward runs at
    once): the largest rank's static + in-flight bytes (received inputs, one layer's KL graph)
    plus one layer's working set, bounded by what the same layer saves when it trains (the
    sparse stage without recompute: every intermediate of its forward), stay under 141 GB."""
    rank, working_set = _planned_bytes(["+experiment=glm5_dsa_warmup"], ["dsa.stage=sparse"])
    print(f"dense warm-up at 202,752 tokens: max rank {rank / 2**30:.1f} GiB "
          f"+ one layer's working set {working_set / 2**30:.1f} GiB")
    assert rank + working_set < H200_BYTES
