"""Expert load (glm5_train/expert_load.py): tokens per expert per MoE layer, summed over ranks.

- The real job in PP2 x DP2 with EP2 logs, for every MoE layer of both pipeline stages and the
  MTP layer, the same integer counts as one process on the same data and seed (step 1 exactly:
  the same weights; step 2 too on this machine, but after an update routing may flip on
  reduction-order noise, so there only the totals are exact and the counts close), the same
  expert biases, and its own metrics show that EP ran (the layout check's all-to-alls on 2
  ranks). The one-process bias after step 1 is megatron-core's update from its own count:
  rate x sign(mean - count), so the logged counts order the experts as megatron's do.
- On 2 in-process gloo ranks with megatron-core routers (a layer on both ranks, as under DP / EP,
  one on a single rank, as under PP, in two chunks): the summed counts equal one routing of all
  the tokens, and megatron-core's own ``local_tokens_per_expert``; forwards without autograd or
  in eval mode are not counted; ``begin_step`` starts afresh; routers without a bias are
  counted all the same.
- The summary math (max / mean, coefficient of variation) and its TensorBoard scalars.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from glm5_train.expert_load import (
    ExpertLoad,
    layer_order,
    load_fields,
    load_summary,
    shortest_float32,
)
from glm5_train.metrics import TensorBoardScalars
from tests.parity import assert_layout_ran, one_process, run_job
from tests.spawn import model_parallel, run_ranks

# ------------------------------------------------------------------------ the job, EP2 x PP2

MOE_LAYERS = ["layer_1", "layer_2", "layer_3", "mtp_0"]  # glm5_tiny: layer 0 is dense
TOKENS = 4 * 64  # train.global_batch_size x train.seq_length of tests/parity.BASE_OVERRIDES
TOP_K, MTP_STEPS, BIAS_RATE = 2, 3, 1e-3  # glm5_tiny


@pytest.fixture(scope="module")
def reference():
    return one_process(["parallel=single"]).records  # test_parity's reference, run once


def test_pp2_ep2_dp2_counts_equal_one_process(reference, tmp_path):
    overrides = ["parallel=pp2_ep2_dp2", "train.train_iters=2"]
    result = run_job(4, overrides, str(tmp_path / "run"))
    assert_layout_ran(result, 4, overrides)  # EP2's all-to-alls, PP2, DP2 ran
    first, ours = reference[0], result.records[0]
    assert list(ours["expert_load"]) == MOE_LAYERS  # both stages' layers, on rank 0's record
    assert ours["expert_load"] == first["expert_load"]
    for layer in MOE_LAYERS:
        assert ours["expert_bias"][layer] == pytest.approx(first["expert_bias"][layer], abs=1e-9)
    for key in ("expert_load_max_over_mean", "expert_load_cv", "expert_load_worst_layer"):
        assert ours[key] == first[key]
    second, ours = reference[1], result.records[1]
    for layer in MOE_LAYERS:
        assert sum(ours["expert_load"][layer]) == sum(second["expert_load"][layer])
        moved = sum(abs(a - b) for a, b in zip(ours["expert_load"][layer],
                                               second["expert_load"][layer]))
        assert moved <= 0.02 * sum(second["expert_load"][layer]), (layer, moved)


def test_one_process_counts_match_megatron_bias_update(reference):
    for layer, counts in reference[0]["expert_load"].items():
        steps = MTP_STEPS if layer.startswith("mtp_") else 1
        assert sum(counts) == TOKENS * TOP_K * steps  # every token routed to k experts
        mean = sum(counts) / len(counts)
        # The bias starts at 0; megatron-core's update after step 1 from its own float32 count
        want = np.float32(BIAS_RATE) * np.sign(mean - np.array(counts, dtype=np.float64))
        logged = np.array(reference[0]["expert_bias"][layer], dtype=np.float32)
        assert logged.tolist() == want.astype(np.float32).tolist(), layer


# ------------------------------------------------------------- in-process routers on 2 ranks

HIDDEN, EXPERTS = 16, 8


def _router(bias: bool, layer: int, groups: ProcessGroupCollection) -> TopKRouter:
    config = TransformerConfig(
        num_layers=4, hidden_size=HIDDEN, num_attention_heads=1, num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=HIDDEN, moe_router_topk=2, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=bias, moe_router_dtype="fp32",
        use_cpu_initialization=True, add_bias_linear=False)
    router = TopKRouter(config, groups)
    router.set_layer_number(layer)  # megatron-core's 1-based global number
    return router


def _counted(router: TopKRouter, tokens: torch.Tensor) -> list[int]:
    """What one process routing all ``tokens`` ([S, B, H]) gives, counted directly."""
    with torch.no_grad():
        return router(tokens)[1].sum(dim=0).tolist()


def _route_and_gather(rank: int, world_size: int) -> dict:
    with model_parallel():
        groups = ProcessGroupCollection.use_mpu_process_groups()
        torch.manual_seed(0)  # the same router weights on every rank
        shared, staged, plain = _router(True, 2, groups), _router(True, 4, groups), \
            _router(False, 3, groups)
        with torch.no_grad():
            shared.expert_bias.copy_(torch.linspace(-0.03, 0.04, EXPERTS))
            staged.expert_bias.copy_(torch.linspace(0.02, -0.01, EXPERTS))
        # Rank 0 holds layer_1 (on both ranks: DP / EP); rank 1 also layer_3 in a second
        # chunk (one rank only: a pipeline stage of its own).
        chunks = [torch.nn.ModuleList([shared])]
        if rank == 1:
            chunks.append(torch.nn.ModuleList([staged]))
        load = ExpertLoad(chunks, dist.group.WORLD)
        torch.manual_seed(1)
        tokens = torch.randn(world_size, 6, 2, HIDDEN)  # each rank's share: tokens[rank]
        staged_tokens = torch.randn(4, 2, HIDDEN)
        want = {"layer_1": _counted(shared, tokens.reshape(-1, 2, HIDDEN)),
                "layer_3": _counted(staged, staged_tokens)}
        load.begin_step()
        for micro in tokens[rank].split(3):  # two micro-batches
            shared(micro)
        if rank == 1:
            staged(staged_tokens)
        megatron = shared.local_tokens_per_expert.clone()
        dist.all_reduce(megatron)
        with torch.no_grad():  # not counted: no autograd (megatron-core's rule)
            shared(tokens[rank])
        shared.eval()  # not counted: eval mode
        shared(tokens[rank])
        shared.train()
        fields = load.gather()
        load.begin_step()  # a new step: counted afresh
        shared(tokens[rank][:1])
        next_step = load.gather()
        load.close()
        # Routers without an expert bias (topk_method greedy) are counted the same way.
        unbiased = ExpertLoad([torch.nn.ModuleList([plain])], dist.group.WORLD)
        unbiased.begin_step()
        plain(tokens[rank])
        return {"fields": fields, "want": want, "megatron": megatron.tolist(),
                "next": next_step["expert_load"]["layer_1"],
                "next_want": _counted(shared, tokens[:, :1].reshape(-1, 2, HIDDEN).contiguous()),
                "unbiased": unbiased.gather(),
                "unbiased_want": _counted(plain, tokens.reshape(-1, 2, HIDDEN)),
                "biases": {"layer_1": shared.expert_bias.tolist(),
                           "layer_3": staged.expert_bias.tolist()}}


def test_counts_sum_over_ranks_exactly():
    got = run_ranks(2, _route_and_gather)
    zero, one = got
    assert zero["fields"] == one["fields"]  # every rank has the whole job's figures
    fields = zero["fields"]
    assert list(fields["expert_load"]) == ["layer_1", "layer_3"]
    assert fields["expert_load"] == zero["want"]
    assert fields["expert_load"]["layer_1"] == [int(c) for c in zero["megatron"]]
    for layer, bias in one["biases"].items():  # the float32 values, exactly
        assert np.array(fields["expert_bias"][layer], dtype=np.float32).tolist() == bias
    assert zero["next"] == zero["next_want"]
    assert "expert_bias" not in zero["unbiased"]
    assert zero["unbiased"]["expert_load"] == {"layer_2": zero["unbiased_want"]}


# ---------------------------------------------------------------------------- summary math


def test_max_over_mean_and_coefficient_of_variation():
    assert load_summary([5, 5, 5, 5]) == (1.0, 0.0)
    ratio, cv = load_summary([8, 0, 0, 0])  # one expert takes everything: max/mean = E
    assert ratio == 4.0 and cv == pytest.approx(math.sqrt(3))
    ratio, cv = load_summary([1, 2, 3, 6])  # mean 3, population variance 14 / 4
    assert ratio == 2.0 and cv == pytest.approx(math.sqrt(3.5) / 3)
    assert load_summary([0, 0]) == (None, None)
    fields = load_fields({"layer_3": [1, 2, 3, 6], "layer_4": [8, 0, 0, 0], "mtp_0": [0, 0]},
                         {"layer_3": [0.0] * 4, "layer_4": [0.0] * 4, "mtp_0": [0.0] * 4})
    assert fields["expert_load_worst_layer"] == "layer_4"
    assert fields["expert_load_worst_max_over_mean"] == 4.0
    assert fields["expert_load_worst_cv"] == pytest.approx(math.sqrt(3))
    assert fields["expert_load_max_over_mean"]["mtp_0"] is None
    assert sorted(["mtp_0", "layer_10", "layer_3"], key=layer_order) == [
        "layer_3", "layer_10", "mtp_0"]
    bias = torch.tensor([1e-3, -0.037, 0.0], dtype=torch.float32)
    assert shortest_float32(bias.double()) == [0.001, -0.037, 0.0]  # reads back bit for bit


def test_tensorboard_gets_one_scalar_per_layer(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    record = {"step": 1, **load_fields({"layer_3": [1, 2, 3, 6], "mtp_0": [0, 0, 0, 0]},
                                       {"layer_3": [-0.001, 0.001, 0.0, 0.002],
                                        "mtp_0": [0.0] * 4})}
    writer = TensorBoardScalars(str(tmp_path))
    writer.write(record)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = {tag: events.Scalars(tag)[0].value for tag in events.Tags()["scalars"]}
    assert scalars["expert_load/max_over_mean/layer_3"] == 2.0
    assert scalars["expert_load/cv/layer_3"] == pytest.approx(math.sqrt(3.5) / 3)
    assert scalars["expert_bias/range/layer_3"] == pytest.approx(0.003)
    assert scalars["train/expert_load_worst_max_over_mean"] == 2.0
    assert "expert_load/max_over_mean/mtp_0" not in scalars  # no token: no value
    assert os.listdir(tmp_path)
