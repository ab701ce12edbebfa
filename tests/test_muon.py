"""Muon (+ Muon Split) matches single-process Muon in parallel layouts, and its pieces do what
they claim. Tolerances: tests/parity.py (fp32; Newton-Schulz on a TP-gathered matrix is the
same computation as on the whole one, so only reduction order differs)."""

from __future__ import annotations

import pytest
import torch

from glm5_train.job_config import compose_job
from glm5_train.plan import check as plan_check
from parallel.distributed_muon import MatrixSlot, _subtract, assign_owners
from parallel.muon import MatrixLayout, newton_schulz, orthogonal_update
from tests.parity import BASE_OVERRIDES, BF16, assert_layout_ran, compare, run_job

MUON = ["train.optimizer=muon"]


def test_newton_schulz_orthogonalises():
    gen = torch.Generator().manual_seed(0)
    for shape in ((16, 48), (48, 16)):
        singular = torch.linalg.svdvals(newton_schulz(torch.randn(*shape, generator=gen), 5))
        # The quintic iteration drives singular values into roughly [0.7, 1.2], not exactly 1.
        assert singular.min() > 0.6 and singular.max() < 1.3, singular


def test_muon_split_orthogonalises_each_head_on_its_own():
    gen = torch.Generator().manual_seed(1)
    heads, nope, v, latent = 3, 4, 6, 32
    update = torch.randn(heads * (nope + v), latent, generator=gen)
    split = orthogonal_update(update, MatrixLayout("kv_up", True, head_blocks=(nope, v)), 5)
    whole = orthogonal_update(update, MatrixLayout("kv_up", True), 5)
    start = 0
    for _ in range(heads):
        for size in (nope, v):
            block = split[start:start + size] / (0.2 * latent ** 0.5)
            singular = torch.linalg.svdvals(block)
            assert singular.min() > 0.6 and singular.max() < 1.3, singular
            start += size
    assert not torch.allclose(split, whole, atol=1e-3)  # the split is a different update


def _slot(start: int, end: int, pieces: dict, cost: float) -> MatrixSlot:
    return MatrixSlot(None, MatrixLayout("w", True), 0, 0, start, end, pieces, cost)


def test_owners_balance_newton_schulz_cost_and_prefer_the_holder():
    # Four equal matrices, each held whole by one of 2 ranks (3 on rank 0): balance moves one.
    slots = [_slot(i * 10, i * 10 + 10, {0 if i < 3 else 1: (i * 10, i * 10 + 10)}, 1.0)
             for i in range(4)]
    assign_owners(slots, 2)
    owners = [s.owner for s in slots]
    assert sorted(owners) == [0, 0, 1, 1]
    assert owners[3] == 1  # rank 1's own matrix stays with it
    # One huge matrix and small ones: LPT puts the small ones elsewhere.
    slots = [_slot(0, 100, {0: (0, 50), 1: (50, 100)}, 8.0),
             *[_slot(100 + i, 101 + i, {1: (100 + i, 101 + i)}, 1.0) for i in range(4)]]
    assign_owners(slots, 2)
    assert sum(s.cost for s in slots if s.owner == slots[0].owner) == 8.0


def test_slice_minus_matrices_partitions_the_bucket():
    assert _subtract(0, 10, [(2, 4), (6, 12)]) == [(0, 2), (4, 6)]
    assert _subtract(5, 10, [(0, 6)]) == [(6, 10)]
    assert _subtract(0, 4, []) == [(0, 4)]


@pytest.fixture(scope="module")
def muon_reference(tmp_path_factory):
    return run_job(1, ["parallel=single", *MUON], str(tmp_path_factory.mktemp("muon_ref"))).records


DISTRIBUTED = "parallel.use_distributed_optimizer=true"
NO_SPLIT = [*MUON, "train.muon_split_mla=false"]


@pytest.fixture(scope="module")
def no_split_reference(tmp_path_factory):
    return run_job(1, ["parallel=single", *NO_SPLIT],
                   str(tmp_path_factory.mktemp("no_split_ref"))).records


@pytest.mark.parametrize("nprocs,overrides", [
    (2, ["parallel=single"]),                                   # DP2, every rank updates all
    (4, ["parallel=pp2_vpp2", DISTRIBUTED, "parallel.pipeline_zero2=true"]),  # owners, ZeRO2
    (4, ["parallel=tp2", DISTRIBUTED, "parallel.pipeline_zero2=true"]),  # TP2 (+SP) x DP2
    (4, ["parallel=ep2", DISTRIBUTED]),                         # DP4, EP2: expert owners in EDP2
], ids=["dp2", "dp2_pp2_vpp2_zero2", "tp2_dp2_zero2", "dp4_ep2_distributed"])
def test_muon_matches_single_process(muon_reference, nprocs, overrides, tmp_path):
    result = run_job(nprocs, [*overrides, *MUON], str(tmp_path / "run"))
    assert_layout_ran(result, nprocs, [*overrides, *MUON])
    problems = compare(muon_reference, result.records)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("nprocs,overrides", [
    (2, ["parallel=single"]),                          # DP2
    (4, ["parallel=pp2_vpp2", DISTRIBUTED]),           # DP2 x PP2 x VPP2, owners
    (4, ["parallel=tp2", DISTRIBUTED]),                # TP2 x DP2: only owners TP-gather
], ids=["dp2", "dp2_pp2_vpp2_distributed", "tp2_dp2_distributed"])
def test_muon_without_split_matches_single_process(no_split_reference, nprocs, overrides,
                                                   tmp_path):
    """Without the split the MLA up-projections are orthogonalised whole, which under TP means
    gathering them over the TP group; with distributed Muon only the owners (the same DP index
    on every TP rank) gather."""
    result = run_job(nprocs, [*overrides, *NO_SPLIT], str(tmp_path / "run"))
    assert_layout_ran(result, nprocs, [*overrides, *NO_SPLIT])
    problems = compare(no_split_reference, result.records)
    assert not problems, "\n".join(problems)


def test_distributed_muon_sends_only_pieces_to_owners(muon_reference, tmp_path):
    """DP4: zero-redundant Muon and its naive reference both match one process; the step's
    traffic is the AdamW distributed optimizer's plus one all_to_all of gradient pieces, far
    below the naive every-gradient-everywhere (exact byte counts from metrics.jsonl, summed over
    the 4 ranks, last step)."""
    records = {}
    for name, extra in (("adamw", []), ("owners", MUON),
                        ("naive", [*MUON, "train.muon_zero_redundant=false"])):
        overrides = ["parallel=single", DISTRIBUTED, *extra]
        result = run_job(4, overrides, str(tmp_path / name))
        assert_layout_ran(result, 4, overrides)
        records[name] = result.records
    assert not compare(muon_reference, records["owners"])
    assert not compare(muon_reference, records["naive"])
    runs = {name: steps[-1] for name, steps in records.items()}
    total = {name: sum(record["comm_bytes"]) for name, record in runs.items()}
    ours, naive = total["owners"] - total["adamw"], total["naive"] - total["adamw"]
    # The owner-sourced parameter all-gather moves exactly the bytes megatron's would.
    redistributed = (sum(runs["owners"]["comm_by_op"]["all_to_all:4"]["bytes"]) - ours)
    assert redistributed == sum(runs["adamw"]["comm_by_op"]["all_gather:4"]["bytes"])
    assert 0 < ours <= naive / 4
    state = {name: max(record["optimizer_state_bytes"]) for name, record in runs.items()}
    assert state["owners"] < state["adamw"] < state["naive"]


def test_bf16_distributed_muon_on_zero2_matches_one_process(tmp_path):
    """bf16 parameters: megatron-core steps fp32 copies (plain Muon maps them to their layouts);
    distributed Muon's owners keep each matrix's fp32 master. bf16 rounding differs by layout,
    so the tolerances are bf16's (tests/parity.py BF16: per-parameter norms at step 1 only)."""
    bf16 = [*MUON, "train.params_dtype=bf16"]
    reference = run_job(1, ["parallel=single", *bf16], str(tmp_path / "ref")).records
    overrides = ["parallel=pp2_vpp2", DISTRIBUTED, "parallel.pipeline_zero2=true", *bf16]
    result = run_job(4, overrides, str(tmp_path / "zero2"))
    assert_layout_ran(result, 4, overrides)
    problems = compare(reference, result.records, BF16)
    assert not problems, "\n".join(problems)


def test_the_planner_gives_muon_state_and_the_check_catches_a_wrong_one(tmp_path):
    """Muon's optimizer bytes as planned (glm5_train.plan.check): one process exactly (fp32
    momentum per matrix element, AdamW's moments on the rest); distributed Muon at DP2 as
    the DP group's total, which a state 2% larger on one rank (a matrix's momentum kept
    twice) breaks, though each rank alone stays within the uneven per-rank tolerance."""
    plain = ["parallel=single", *MUON, "train.train_iters=1"]
    record = run_job(1, plain, str(tmp_path / "plain")).records[-1]
    (row,) = [r for r in plan_check.rank_bytes(compose_job([*BASE_OVERRIDES, *plain]), record)
              if r.field == "optimizer"]
    assert row.rel < 1e-4, row  # the 4-byte step counters of the AdamW tensors only

    owners = ["parallel=single", DISTRIBUTED, *MUON, "train.train_iters=1"]
    job, record = compose_job([*BASE_OVERRIDES, *owners]), run_job(
        2, owners, str(tmp_path / "owners")).records[-1]
    assert not plan_check.problems(job, record)
    state = record["optimizer_state_bytes"]
    wrong = dict(record, optimizer_state_bytes=[state[0] * 102 // 100, state[1]])
    found = plan_check.problems(job, wrong)
    assert found and all("optimizer, mean over its 2 ranks" in line for line in found), found
