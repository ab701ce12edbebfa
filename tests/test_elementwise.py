"""The planner's element-wise bytes on CPUs (glm5_train/plan/elementwise.py) against the bytes
a training step's operators move, counted by tests/elementwise_count.py; and where the
step-time model takes them (CPU plans only, recompute, torch's AdamW)."""

from __future__ import annotations

import json

import pytest

from glm5_train.job_config import compose_job
from glm5_train.plan import inputs_from_job, job_plan
from glm5_train.plan.elementwise import (
    COUNTED_WIDTHS,
    SWIGLU,
    TORCH_ADAMW_STEP_BYTES,
    layer_elementwise,
    mtp_step_elementwise,
    sparse_attention_bytes,
)
from glm5_train.plan.step_time import ADAMW_STEP_BYTES, ClusterSpec, Link, optimizer_seconds
from tests.parity import run_script

BASE = ["model=glm5_tiny", "train.warmup_iters=0", "train.global_batch_size=4",
        "train.micro_batch_size=1", "checkpoint.save=null", "train.train_iters=1"]
MEMORY = ClusterSpec("memory", "test", peak_tflops=1.0, compute_tflops=1.0, memory_gbs=1.0,
                     gpus_per_node=2, intra_node=Link(1.0, 0.0), inter_node=Link(1.0, 0.0))


def _planned(overrides: list[str], ranks: int, **changes) -> tuple[int, int]:
    """(element-wise, sparse attention) bytes per step the planner counts, over the stages of
    one rank of each pipeline stage (one rank, without a pipeline); a CPU plan unless
    ``changes`` say otherwise (whatever device runs the test)."""
    changes.setdefault("fused_attention", False)
    job = compose_job(overrides)
    dp = ranks // job.parallel.world_size_needed(1)
    stages = job_plan(job, dp, **changes).stages
    micro = inputs_from_job(job, dp, **changes).num_microbatches
    return (micro * sum(s.costs.elementwise_bytes_per_microbatch for s in stages),
            micro * sum(s.costs.streamed_bytes_per_microbatch for s in stages))


def _counted(path) -> tuple[int, int, int]:
    """(element-wise outside the sparse attention and the optimizer, the sparse attention's)
    bytes of rank 0's step and its matmul FLOPs, from the worker's counts."""
    counts = json.loads(path.read_text())
    flops = sum(b for key, (b, _) in counts.items() if key.startswith("matmul_flops:"))
    counts = {key: b for key, (b, _) in counts.items()
              if not key.startswith(("optimizer:", "matmul_flops:"))}
    sparse = sum(b for key, b in counts.items() if ":DSACoreAttention:" in key)
    return sum(counts.values()) - sparse, sparse, flops


# planned / counted bytes, (element-wise, sparse attention): the range each must fall in
@pytest.mark.parametrize("name, ranks, overrides, within", [
    # the widths the constants were counted at (a regression guard: 0.99 / 0.99 when written)
    ("compute_bound", 1, [*COUNTED_WIDTHS, "train.seq_length=256", "parallel=single"],
     ((0.95, 1.05), (0.93, 1.05))),
    # other widths, TP2 + SP and EP2: 0.95 / 0.63 and 1.00 / 0.66 when written (the sparse
    # attention's shortfall at these widths is not explained yet)
    ("tiny_tp2", 2, ["train.seq_length=128", "parallel=tp2"], ((0.85, 1.05), (0.55, 1.05))),
    ("tiny_ep2", 2, ["train.seq_length=128", "parallel=ep2"], ((0.9, 1.05), (0.55, 1.05))),
])
def test_the_planned_elementwise_bytes_match_a_counted_step(name, ranks, overrides, within,
                                                             tmp_path):
    out = tmp_path / "counts.json"
    job_overrides = [*BASE, *overrides]
    proc = run_script(ranks, "tests/elementwise_count.py",
                      [str(out), str(tmp_path / "run"), *job_overrides])
    assert proc.returncode == 0, proc.stdout[-3000:]
    *counted, flops = _counted(out)
    for what, plan, count, (low, high) in zip(("element-wise", "sparse attention"),
                                              _planned(job_overrides, ranks), counted, within):
        assert count > 0 and low <= plan / count <= high, (name, what, plan, count)
    # The planner's FLOPs, which the step-time model prices at the compute rate, against the
    # step's matmuls (compute-bound widths: 1.001 one process, 0.999 CP2, 0.967 TP2, whose
    # replicated indexer the planner splits).
    job = compose_job(job_overrides)
    dp = ranks // job.parallel.world_size_needed(1)
    planned_flops = inputs_from_job(job, dp).num_microbatches * sum(
        s.costs.flops_per_microbatch for s in job_plan(job, dp).stages)
    assert 0.9 <= planned_flops / flops <= 1.05, (name, planned_flops, flops)


def test_gpu_plans_leave_elementwise_work_to_the_compute_rate():
    """Transformer Engine fuses it there (unmeasured): no element-wise bytes, and the fused
    AdamW's bytes per element."""
    job = compose_job(["model=glm5_tiny", "train=tiny", "parallel=single"])
    cpu, gpu = inputs_from_job(job, 1, fused_attention=False), inputs_from_job(
        job, 1, fused_attention=True)
    assert layer_elementwise(job.model, True, cpu)[0] > 0
    assert layer_elementwise(job.model, True, gpu) == (0, 0)
    assert _planned(["model=glm5_tiny", "train=tiny", "parallel=single"], 1,
                    fused_attention=True) == (0, 0)
    plan = job_plan(job, 1, fused_attention=False)
    params = sum(s.costs.dense_params + s.costs.expert_params for s in plan.stages)
    layout = plan.layout  # (the optimizer's count differs from the stages' by a few norms)
    assert optimizer_seconds(job.model, cpu, layout, 0, MEMORY) == pytest.approx(
        TORCH_ADAMW_STEP_BYTES * params / 1e9, rel=1e-3)
    assert optimizer_seconds(job.model, gpu, layout, 0, MEMORY) == pytest.approx(
        ADAMW_STEP_BYTES * params / 1e9, rel=1e-3)


def test_recompute_moves_the_forward_bytes_again():
    """Full recompute of every layer: each layer's and MTP step's forward element-wise bytes
    once more (the MTP steps recompute with the layers); selective recompute of the experts'
    activation: their SwiGLU's forward bytes once more."""
    base = ["model=glm5_tiny", "train=tiny", "parallel=single", "train.seq_length=256"]
    full = ["activations.recompute_granularity=full", "activations.recompute_method=uniform",
            "activations.recompute_num_layers=1"]
    job = compose_job(base)
    cfg, inputs = job.model, inputs_from_job(job, 1, fused_attention=False)
    plain = _planned(base, 1)
    redone = _planned([*base, *full], 1)
    dense = layer_elementwise(cfg, False, inputs)[0]
    moe = layer_elementwise(cfg, True, inputs)[0]
    layers = cfg.first_k_dense_replace * dense + (
        cfg.num_hidden_layers - cfg.first_k_dense_replace) * moe
    mtp_step = moe + mtp_step_elementwise(cfg, inputs)[0]
    assert redone[0] - plain[0] == inputs.num_microbatches * (
        layers + cfg.mtp_num_steps * mtp_step)
    # the sparse attention's forward bytes once more per layer and MTP step
    forward = sparse_attention_bytes(cfg, inputs)[0]
    steps = cfg.num_hidden_layers + cfg.mtp_num_steps
    assert redone[1] - plain[1] == inputs.num_microbatches * steps * forward
    moe_act = inputs_from_job(compose_job([*base, "activations.recompute_granularity=selective",
                                           "activations.recompute_modules=[moe_act]"]), 1,
                              fused_attention=False)
    routed_ffn = cfg.num_experts_per_tok * inputs.tokens * cfg.moe_intermediate_size
    assert layer_elementwise(cfg, True, moe_act)[1] - layer_elementwise(cfg, True, inputs)[1] == (
        SWIGLU[0] * routed_ffn)
    assert layer_elementwise(cfg, False, moe_act) == layer_elementwise(cfg, False, inputs)
