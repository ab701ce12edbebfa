"""Parallel layouts reproduce the single-process run: same losses and grad norms per step.

Each case launches the real job (torchrun, Hydra overrides) for 5 optimizer steps. Tolerances
and why: see tests/parity.py. The single-process reference runs once per session.
"""

from __future__ import annotations

import pytest

from tests.parity import compare, run_job

# The tiny GLM-5 trains its MTP layer for 3 steps (model.mtp_num_steps): every layout below
# compares the main and the per-step MTP losses. With PP > 1 and no layout given, the layout is
# balanced for parallel.mtp_placement (default "split": MTP on the stage before the loss stage,
# where at PP=2 it shares pipeline rank 0 with the embedding stage).
LAYOUTS = {
    # name: (processes, overrides)
    "tp2": (2, ["parallel=tp2"]),
    "pp2": (2, ["parallel=pp2"]),
    "pp2_vpp2": (2, ["parallel=pp2_vpp2"]),  # split: Et|ttt|m|L
    "pp2_vpp2_mtp_with_loss": (2, ["parallel=pp2_vpp2", "parallel.mtp_placement=with_loss"]),
    "pp2_vpp2_mtp_split_given": (2, ["parallel=pp2_vpp2",
                                     "parallel.pipeline_model_parallel_layout='Et|t|ttm|L'"]),
    "ep2": (2, ["parallel=ep2"]),
    "dp2": (2, ["parallel=single"]),
    "tp2_pp2": (4, ["parallel=tp2_pp2"]),
    "pp2_ep2_dp2": (4, ["parallel=pp2_ep2_dp2"]),
    # Everything 4 ranks allow: TP2 (+SP) x PP2 x VPP2, EP2 across the TP ranks, with the
    # distributed optimizer (ZeRO-1) on.
    "tp2_pp2_vpp2_ep2_distopt": (4, ["parallel=tp2_pp2_vpp2_ep2",
                                     "parallel.use_distributed_optimizer=true"]),
}


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    return run_job(1, ["parallel=single"], str(tmp_path_factory.mktemp("ref"))).records


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_single_process(name, reference, tmp_path):
    nprocs, overrides = LAYOUTS[name]
    result = run_job(nprocs, overrides, str(tmp_path / name))
    assert len(reference) == 5
    problems = compare(reference, result.records)
    assert not problems, f"{name} diverges from 1 process:\n" + "\n".join(problems)


def test_loss_falls(reference):
    # A sanity floor for the harness itself: training must make progress in 5 steps.
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.5
    # MTP trains too, and its three steps are distinct predictions (not one loss copied).
    assert reference[-1]["mtp_loss"] < reference[0]["mtp_loss"] - 0.5
    steps = [reference[-1][f"mtp_loss_{k}"] for k in (1, 2, 3)]
    assert len(set(steps)) == 3, steps


@pytest.fixture(scope="session")
def warmup_reference(tmp_path_factory):
    return run_job(1, ["parallel=single", "dsa=dense_warmup"],
                   str(tmp_path_factory.mktemp("warmup_ref"))).records


def test_dsa_dense_warmup_matches_single_process(warmup_reference, tmp_path):
    """DSA warm-up (only the indexer trains, KL over all keys) in TP2 (+SP) x PP2 x VPP2 x EP2:
    losses, grad norms and indexer KL per step match one process."""
    result = run_job(4, ["parallel=tp2_pp2_vpp2_ep2", "dsa=dense_warmup"], str(tmp_path / "w"))
    problems = compare(warmup_reference, result.records)
    assert not problems, "\n".join(problems)
    kl = [r["indexer_kl"] for r in warmup_reference]
    assert kl[-1] < kl[0], f"the indexer KL must fall during warm-up: {kl}"
