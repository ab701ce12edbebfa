"""Parallel layouts reproduce the single-process run: same losses, global grad norm and every
parameter's grad norm per step, and each run's own metrics show the layout it names ran.

Each case launches the real job (torchrun, Hydra overrides) for 5 optimizer steps. Tolerances
and why: see tests/parity.py. The single-process reference runs once per session.
"""

from __future__ import annotations

import pytest
import torch

from glm5_train.job_config import compose_job
from glm5_train.optim import build_scheduler
from tests.parity import BASE_OVERRIDES, assert_layout_ran, compare, one_process, run_job

DISTRIBUTED = "parallel.use_distributed_optimizer=true"

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
    # EP2 over DP2, the distributed optimizer's reduce-scatter overlapped with the backward
    # (parallel.overlap_grad_reduce: allowed at PP=1, where no embedding copy needs summing
    # across stages first).
    "ep2_overlap_distributed": (2, ["parallel=ep2", "parallel.overlap_grad_reduce=true",
                                    DISTRIBUTED]),
    "dp2": (2, ["parallel=single"]),
    # Overlapped gradient reduction with the word embedding on two stages (MTP split: rank 0
    # holds the embedding chunk and the MTP chunk): the copies are summed after the reduction.
    # Buckets of 20K parameters, so reductions start inside the backward; plain DDP, and the
    # distributed optimizer (each copy alone in its bucket: its shards line up).
    "pp2_vpp2_dp2_overlap": (4, ["parallel=pp2_vpp2", "parallel.overlap_grad_reduce=true",
                                 "parallel.ddp_bucket_size=20000"]),
    "pp2_vpp2_dp2_overlap_distributed": (4, ["parallel=pp2_vpp2",
                                             "parallel.overlap_grad_reduce=true",
                                             "parallel.ddp_bucket_size=20000", DISTRIBUTED]),
    # The distributed optimizer's parameter gather left to the next forward, bucket by bucket
    # (with the reduction overlapped, whose buckets it gathers): DP2, and PP2 x VPP2 x DP2,
    # where the interleaved schedule starts each chunk's gather.
    "dp2_param_gather": (2, ["parallel=single", DISTRIBUTED, "parallel.overlap_grad_reduce=true",
                             "parallel.overlap_param_gather=true",
                             "parallel.ddp_bucket_size=20000"]),
    "pp2_vpp2_dp2_param_gather": (4, ["parallel=pp2_vpp2", DISTRIBUTED,
                                      "parallel.overlap_grad_reduce=true",
                                      "parallel.overlap_param_gather=true",
                                      "parallel.ddp_bucket_size=20000"]),
    "tp2_pp2": (4, ["parallel=tp2_pp2"]),
    "pp2_ep2_dp2": (4, ["parallel=pp2_ep2_dp2"]),
    # TP2 (+SP) x PP2 x VPP2, EP2 across the TP ranks, with the distributed optimizer on (at
    # DP=1 it shards nothing: the same bytes and collectives as plain DDP).
    "tp2_pp2_vpp2_ep2_distopt": (4, ["parallel=tp2_pp2_vpp2_ep2", DISTRIBUTED]),
}


# The layout check is not fooled by a silent fallback: these runs must be refused as the layout
# named here (two data-parallel replicas are not TP2, with or without SP, nor EP2; plain DDP is
# not the distributed optimizer; 1F1B is not the interleaved schedule).
IMPOSTORS = {
    "dp2": [["parallel=tp2"], ["parallel=tp2", "parallel.sequence_parallel=false"],
            ["parallel=ep2"], ["parallel=single", DISTRIBUTED]],
    "pp2": [["parallel=pp2_vpp2"]],
}


@pytest.fixture(scope="session")
def reference():
    overrides = ["parallel=single"]
    result = one_process(overrides)
    assert_layout_ran(result, 1, overrides)
    return result.records


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_single_process(name, reference, tmp_path):
    nprocs, overrides = LAYOUTS[name]
    result = run_job(nprocs, overrides, str(tmp_path / name))
    assert_layout_ran(result, nprocs, overrides)
    for claimed in IMPOSTORS.get(name, []):
        with pytest.raises(AssertionError, match="does not show the layout"):
            assert_layout_ran(result, nprocs, claimed)
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


def test_first_update_uses_the_full_learning_rate():
    """BASE_OVERRIDES' train.warmup_iters=0: megatron-core's OptimizerParamScheduler sets max_lr
    before the first optimizer step (with warm-up 1 it would set init_lr=0, and step 2 would
    compare the initial weights again)."""
    train = compose_job(list(BASE_OVERRIDES)).train
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    build_scheduler(optimizer, train, train.train_iters)
    assert train.warmup_iters == 0
    assert optimizer.param_groups[0]["lr"] == train.lr


@pytest.fixture(scope="session")
def warmup_reference():
    return one_process(["parallel=single", "dsa=dense_warmup"]).records


def test_dsa_dense_warmup_matches_single_process(warmup_reference, tmp_path):
    """DSA warm-up (only the indexer trains, KL over all keys) in TP2 (+SP) x PP2 x VPP2 x EP2:
    losses, grad norms and indexer KL per step match one process."""
    overrides = ["parallel=tp2_pp2_vpp2_ep2", "dsa=dense_warmup"]
    result = run_job(4, overrides, str(tmp_path / "w"))
    assert_layout_ran(result, 4, overrides)
    problems = compare(warmup_reference, result.records)
    assert not problems, "\n".join(problems)
    kl = [r["indexer_kl"] for r in warmup_reference]
    assert kl[-1] < kl[0], f"the indexer KL must fall during warm-up: {kl}"


# megatron-core refuses MoE with TP > 1 and no sequence parallelism in training (MoELayer.forward
# raises "...MoE and tensor parallelism are enabled without also enabling sequence parallelism",
# whatever EP), so TP2 without SP runs only on a GLM-5 without MoE layers and without MTP
# (whose layer is MoE).
DENSE = ["model.first_k_dense_replace=4", "model.mtp_num_steps=0"]


def test_tp2_without_sequence_parallel_matches_single_process(tmp_path):
    reference = run_job(1, ["parallel=single", *DENSE], str(tmp_path / "ref")).records
    overrides = ["parallel=tp2", "parallel.sequence_parallel=false", *DENSE]
    result = run_job(2, overrides, str(tmp_path / "tp2"))
    assert_layout_ran(result, 2, overrides)
    problems = compare(reference, result.records)
    assert not problems, "\n".join(problems)


def test_expert_tensor_parallel_matches_single_process(reference, tmp_path):
    """TP2 (+SP) x EP2 x expert-TP2 with the distributed optimizer over DP2 (expert-DP 1)."""
    overrides = ["parallel=tp2", "parallel.expert_model_parallel_size=2",
                 "parallel.expert_tensor_parallel_size=2", DISTRIBUTED]
    result = run_job(4, overrides, str(tmp_path / "etp"))
    assert_layout_ran(result, 4, overrides)
    problems = compare(reference, result.records)
    assert not problems, "\n".join(problems)
