"""Pipeline ZeRO2 matches plain DDP, and reduces gradients the way it claims.

16 sequences over DP2 at PP2 x VPP2 give 8 micro-batches per rank: the interleaved backward
runs each chunk in 4 groups of 2 consecutive micro-batches, so both accumulation buffers are
reused and every chunk is reduce-scattered 4 times per step. MTP is on (the tiny model's
default), so the word embedding has two copies on pipeline rank 0 (pinned gradients).
Tolerances: tests/parity.py (fp32; only summation order differs). ZeRO2 under TP2 (+SP), where
the sequence-parallel norms' TP all-reduce runs on the slices, and in bf16 is tested with Muon in
tests/test_muon.py."""

from __future__ import annotations

import pytest

from glm5_train.job_config import compose_job
from glm5_train.plan import check as plan_check
from tests.parity import BASE_OVERRIDES, assert_layout_ran, compare, one_process, run_job

BATCH = ["train.global_batch_size=16"]
ZERO2 = ["parallel.use_distributed_optimizer=true", "parallel.pipeline_zero2=true"]


@pytest.fixture(scope="module")
def plain_ddp(tmp_path_factory):
    overrides = ["parallel=pp2_vpp2", *BATCH]
    result = run_job(4, overrides, str(tmp_path_factory.mktemp("ddp")))
    assert_layout_ran(result, 4, overrides)
    return result.records


def test_zero2_matches_plain_ddp_and_reduces_once_per_group(plain_ddp, tmp_path):
    overrides = ["parallel=pp2_vpp2", *BATCH, *ZERO2]
    result = run_job(4, overrides, str(tmp_path / "zero2"))
    assert_layout_ran(result, 4, overrides)
    zero2 = result.records
    problems = compare(plain_ddp, zero2)
    assert not problems, "\n".join(problems)
    ddp, ours = plain_ddp[-1], zero2[-1]
    micro, pp, dp = 16 // 2, 2, 2
    groups = micro // pp  # backward groups per chunk
    # Each group reduce-scatters the chunk's (padded) buffer: (dp-1) slices leave the rank.
    scattered = ours["comm_by_op"]["reduce_scatter:2"]["bytes"]
    assert scattered == [groups * s * (dp - 1) for s in ours["zero2_slice_bytes"]]
    assert "reduce_scatter:2" not in ddp["comm_by_op"]  # plain DDP all-reduces once instead
    # The planner's model of that traffic (4 reduce-scatters per chunk, the pinned embedding
    # copies' all-reduce): assert_layout_ran compared it; here that it really did.
    job = compose_job([*BASE_OVERRIDES, *overrides])
    rows = [r for r in plan_check.traffic_rows(job, ours) if r.field == "grad_reduction"]
    assert len(rows) == 4 and all(r.rel < plan_check.STATE_RTOL for r in rows), rows
    # The slices are 1/dp of the (padded) full buffers plain DDP keeps.
    for full, slices in zip(ddp["grad_buffer_bytes"], ours["zero2_slice_bytes"]):
        assert full <= slices * dp < full + 4096
    # The planner's model of it (tools/plan_pipeline.py) agrees (it leaves out the pinned
    # embedding copies and megatron-core's bucket padding).
    planned = planned_zero2_grad_bytes()
    for rank, expected in enumerate(planned):
        measured = ours["zero2_slice_bytes"][rank * dp] + ours["zero2_accum_bytes"][rank * dp]
        assert abs(measured - expected) < 0.005 * expected, (rank, measured, expected)


def test_larger_microbatch_groups_reduce_scatter_once(plain_ddp, tmp_path):
    """parallel.microbatch_group_size_per_vp_stage=8: each chunk runs all 8 micro-batches in one
    group, so ZeRO2 reduce-scatters it once per step; training is unchanged."""
    overrides = ["parallel=pp2_vpp2", *BATCH, *ZERO2,
                 "parallel.microbatch_group_size_per_vp_stage=8"]
    result = run_job(4, overrides, str(tmp_path / "grouped"))
    assert_layout_ran(result, 4, overrides)
    grouped = result.records
    problems = compare(plain_ddp, grouped)
    assert not problems, "\n".join(problems)
    last = grouped[-1]
    assert last["comm_by_op"]["reduce_scatter:2"]["bytes"] == last["zero2_slice_bytes"]  # dp-1=1


def test_one_chunk_per_rank_holds_one_accumulation_buffer(tmp_path):
    """PP2 without virtual stages: each rank holds one chunk, reduce-scattered once, after its
    last backward, so nothing needs a second buffer while it runs. One accumulation buffer,
    the chunk's whole (padded) gradients, beside the slices; the same training as one process."""
    overrides = ["parallel=pp2", "parallel.data_parallel_size=2", *BATCH, *ZERO2]
    result = run_job(4, overrides, str(tmp_path / "zero2_pp2"))
    problems = compare(one_process(["parallel=single", *BATCH]).records, result.records)
    assert not problems, "\n".join(problems)
    assert_layout_ran(result, 4, overrides)  # incl. the planner's gradient bytes (one buffer)
    last, dp = result.records[-1], 2
    assert last["zero2_accum_bytes"] == [dp * s for s in last["zero2_slice_bytes"]]
    scattered = last["comm_by_op"]["reduce_scatter:2"]["bytes"]
    assert scattered == [s * (dp - 1) for s in last["zero2_slice_bytes"]]  # once per step


def test_gradients_without_data_parallel_peers_accumulate_in_place(tmp_path):
    """EP2 over DP2: each expert has one data-parallel rank (expert-data-parallel size 1), so
    its gradients accumulate straight into their persistent copy: the accumulation buffer
    holds the dense gradients only (D), the slices half of them plus every expert gradient
    (D/2 + E, against the distributed optimizer's D + E, padded alike); the same training as
    one process."""
    overrides = ["parallel=ep2", *BATCH, *ZERO2]
    result = run_job(2, overrides, str(tmp_path / "zero2_ep2"))
    problems = compare(one_process(["parallel=single", *BATCH]).records, result.records)
    assert not problems, "\n".join(problems)
    assert_layout_ran(result, 2, overrides)  # incl. the planner's (dense-only) buffer
    zero1 = run_job(2, ["parallel=ep2", *BATCH, "parallel.use_distributed_optimizer=true",
                        "train.train_iters=1"], str(tmp_path / "zero1"))
    full = zero1.records[-1]["grad_buffer_bytes"]  # D + E
    last = result.records[-1]
    for rank, total in enumerate(full):
        dense = last["zero2_accum_bytes"][rank]
        assert 0 < dense < total
        assert last["zero2_slice_bytes"][rank] == total - dense // 2


def planned_zero2_grad_bytes() -> list[int]:
    """Per pipeline rank: the planner's ZeRO2 gradient bytes for the balanced PP2 x VPP2 split
    layout of the tiny model (its slices plus two accumulation buffers)."""
    from glm5_train.plan import inputs_from_job, parse_layout, plan_report

    job = compose_job([*BASE_OVERRIDES, "parallel=pp2_vpp2", *BATCH, *ZERO2])
    layout = parse_layout("Et|ttt|m|L", 2, 2, job.model.num_hidden_layers, job.model.mtp_sets)
    inputs = inputs_from_job(job, 2, weight_bytes=4, grad_bytes=4, optimizer_bytes=8)
    stages = plan_report(job.model, layout, inputs).stages
    # Two accumulation buffers each: every rank holds two chunks (VPP2).
    return [sum(s.costs.grad_bytes for s in stages if s.rank == r)
            + 2 * max(s.costs.accum_grad_bytes for s in stages if s.rank == r)
            for r in range(2)]
