"""The GLM-5 experiment recipes (configs/experiment/) compose, pass every layout rule at the
world size their parallel preset names, and fit a 141 GB H200 by the planner's estimate (the
202,752-token SFT recipe: an 80 GB H100, on 256 GPUs)."""

from __future__ import annotations

import pytest

from glm5_train.job_config import compose_job
from glm5_train.plan import (
    context_parallel_sent,
    inputs_from_job,
    job_pipeline,
    job_plan,
    plan_report,
    recompute_working_set_bytes,
    resolve_pipeline_layout,
)
from parallel.layout import validate_layout

H200_BYTES = 141 * 10**9
H100_BYTES = 80 * 10**9  # below the device's 85.5e9: CUDA context, NCCL buffers, fragmentation
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


def test_sft_recipe_at_202752_tokens_fits_256_h100_by_the_planner():
    """+experiment=glm5_sft_202k (TP2+SP, PP8 x VPP2, CP16, EP32, DP1; full recompute): the
    layout rules pass on 256 GPUs (608 in Megatron-Bridge's GLM-5.2 200K SFT recipe), the job
    balances a layout under its stage memory limit, and the largest rank's static + in-flight
    bytes plus one layer's recompute working set stay under 80 GB. Planned on GPU kernels, as
    tools/plan_fit.py does (the absorbed sparse path is the same on both)."""
    job = compose_job(["+experiment=glm5_sft_202k"])
    assert job.train.seq_length == 202_752 == job.model.max_position_embeddings
    assert job.dsa.stage == "sparse" and job.activations.recompute_granularity == "full"
    world = 256
    dp = validate_layout(job.parallel, job.model, world, job.train.global_batch_size,
                         job.train.micro_batch_size, job.train.seq_length)
    assert dp == 1 and job.parallel.world_size_needed(dp) == world
    report = job_plan(job, dp, fused_attention=True)
    working_set = recompute_working_set_bytes(job.model, inputs_from_job(job, dp))
    peak = report.max_rank_bytes + working_set
    limit = job.parallel.stage_memory_limit_gib * 2**30
    print(f"SFT at 202,752 tokens, 256 GPUs: max rank {report.max_rank_bytes / 2**30:.1f} GiB "
          f"+ working set {working_set / 2**30:.1f} GiB = {peak / 1e9:.1f} GB; layout "
          f"{report.layout.to_string()}")
    assert report.max_rank_bytes <= limit  # the balancer met the preset's limit
    assert peak < H100_BYTES
    assert all(context_parallel_sent(rank) for rank in report.ranks)  # it gathers its CP keys
