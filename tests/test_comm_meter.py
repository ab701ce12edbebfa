"""parallel/comm_meter.py: exact per-rank byte counts of collectives, and the training run's
communication and buffer fields in metrics.jsonl.

(a) Two in-process gloo ranks (tests/spawn.py) issue known collectives through every path the
    meter covers (torch.distributed, megatron-core's import-time bound names, the device layer's
    torch.distributed view, P2POp batches) and compare each count with its rule, computed by hand.
(b) The real job on DP2 (tests/parity.py ``run_job``, 3 steps): the gradient buffers hold the
    model's parameter count x 4 bytes (the closed-form count of glm5_train/plan/param_count.py), and
    the step's all-reduce bytes are the DDP gradient reduction, 2 (n-1) / n x the buffer, plus
    the small known all-reduces, each named below. With the distributed optimizer the
    reduction is a reduce-scatter and the parameters come back by an all-gather.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types

import pytest
import torch
import torch.distributed as dist

from glm5_train.job_config import compose_model_config
from glm5_train.plan import param_count
from parallel import comm_meter as cm
from tests.parity import run_job
from tests.spawn import run_ranks

F32 = 4
N = 1000  # floats in the test tensors


# ------------------------------------------------------------------------ (a) two ranks, by hand


def _probe(rank: int, world_size: int) -> dict:
    """Every kind of call the meter knows, on 2 ranks; returns {label: summary or value}."""
    from megatron.core.tensor_parallel import mappings

    from parallel import mcore_compat

    out: dict = {}
    peer = 1 - rank
    x = torch.ones(N)

    def meter_of(fn) -> dict:
        meter = cm.CommMeter(keep_events=True)
        with meter.measure():
            fn()
        return {"summary": meter.summary(),
                "functions": [e.function for e in meter.events]}

    out["all_reduce"] = meter_of(lambda: dist.all_reduce(x.clone()))
    out["all_reduce_async"] = meter_of(lambda: dist.all_reduce(x.clone(), async_op=True).wait())
    out["reduce_scatter_tensor"] = meter_of(
        lambda: dist.reduce_scatter_tensor(torch.empty(N // 2), x.clone()))
    out["all_gather_into_tensor"] = meter_of(
        lambda: dist.all_gather_into_tensor(torch.empty(2 * N), x.clone()))
    if hasattr(dist, "reduce_scatter_single"):  # torch >= 2.13; reduce_scatter_tensor calls it
        out["singles"] = meter_of(lambda: (
            dist.reduce_scatter_single(torch.empty(N // 2), x.clone()),
            dist.all_gather_single(torch.empty(2 * N), x.clone())))
    out["all_gather_list"] = meter_of(
        lambda: dist.all_gather([torch.empty(N), torch.empty(N)], x.clone()))
    # Uneven all-to-all: rank 0 keeps 300 rows of 2 floats and sends 700; rank 1 the reverse.
    # Output splits (what each rank receives from each) happen to equal the input splits here.
    splits = [300, 700] if rank == 0 else [700, 300]
    recv_splits = splits
    out["all_to_all_single"] = meter_of(lambda: dist.all_to_all_single(
        torch.empty(sum(recv_splits), 2), torch.ones(1000, 2), recv_splits, splits))
    out["broadcast"] = meter_of(lambda: dist.broadcast(x.clone(), src=0))

    def p2p():
        if rank == 0:
            dist.send(x.clone(), dst=1)
            dist.isend(torch.ones(10), dst=1).wait()
        else:
            dist.recv(torch.empty(N), src=0)
            dist.irecv(torch.empty(10), src=0).wait()
    out["send_recv"] = meter_of(p2p)

    def batch():
        # P2POp built inside the block, from the (wrapped) torch.distributed.isend / irecv.
        ops = [dist.P2POp(dist.isend, torch.ones(20), peer),
               dist.P2POp(dist.irecv, torch.empty(20), peer)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    out["batch_isend_irecv"] = meter_of(batch)
    out["barrier"] = meter_of(lambda: dist.barrier())
    obj = {"rank": rank, "payload": list(range(10 * (rank + 1)))}
    out["all_gather_object"] = meter_of(lambda: dist.all_gather_object([None, None], obj))
    out["pickled"] = len(__import__("pickle").dumps(obj))

    # megatron-core's import-time bound names.
    out["mcore_bound_all_gather"] = meter_of(
        lambda: mappings.dist_all_gather_func(torch.empty(2 * N), x.clone()))
    out["mcore_bound_reduce_scatter"] = meter_of(
        lambda: mappings.dist_reduce_scatter_func(torch.empty(N // 2), x.clone()))

    # The device layer's torch.distributed view (CPU), with the MoE all-to-all's tensor split
    # sizes: counted once, not once per layer of delegation.
    mcore_compat.install()
    view = mcore_compat.VIEWS["megatron.core.tensor_parallel.mappings"].distributed
    assert view.all_reduce is not None  # looked up before the block: still counted inside it
    cached_before = dict(view.__dict__)
    t_splits = torch.tensor(splits)
    out["view"] = meter_of(lambda: (view.all_reduce(x.clone()), view.broadcast(x.clone(), src=1),
                                    view.all_to_all_single(torch.empty(1000, 2),
                                                           torch.ones(1000, 2),
                                                           torch.tensor(recv_splits), t_splits)))
    out["view_restored"] = dict(view.__dict__) == cached_before

    # A group of one: nothing on the wire.
    solo = [dist.new_group([0]), dist.new_group([1])][rank]
    out["solo"] = meter_of(lambda: dist.all_reduce(x.clone(), group=solo))

    # Nesting: each meter counts what happens while it is open; re-entry is refused.
    outer, inner = cm.CommMeter(), cm.CommMeter()
    with outer.measure():
        dist.all_reduce(x.clone())
        with inner.measure():
            dist.all_reduce(torch.ones(10))
        try:
            with outer.measure():
                pass
            out["reentry_refused"] = False
        except RuntimeError:
            out["reentry_refused"] = True
    out["outer"], out["inner"] = outer.summary(), inner.summary()
    first, second = cm.CommMeter(), cm.CommMeter()  # equal contents, distinct meters
    with first.measure():
        with second.measure():
            pass
        dist.all_reduce(torch.ones(10))
    out["after_inner_closed"] = [first.calls, second.calls]

    # Outside a block: nothing replaced, nothing counted.
    after = cm.CommMeter()
    dist.all_reduce(x.clone())
    out["restored"] = {
        "all_reduce": dist.all_reduce is cm._ORIGINALS["all_reduce"],
        "isend": dist.isend is cm._ORIGINALS["isend"],
        "P2POp": dist.P2POp is cm._P2POP,
        "mappings": mappings.dist_all_gather_func is cm._ORIGINALS["all_gather_into_tensor"],
        "view": not any(cm._is_wrapper(v) for v in view.__dict__.values()),
        "uncounted": after.calls == 0,
    }
    return out


@pytest.fixture(scope="module")
def probe():
    # mcore=False: the probe installs mcore_compat itself, after its plain-torch cases.
    return run_ranks(2, _probe, mcore=False)


def _only(result: dict) -> tuple[str, dict]:
    (key, value), = result["summary"]["by_op"].items()
    return key, value


def _counts(calls: int, wire: int, payload: int) -> dict:
    return {"calls": calls, "bytes": wire, "payload_bytes": payload}


def test_all_reduce_sends_2_n_minus_1_over_n(probe):
    for rank in range(2):
        # 1000 fp32 over 2 ranks: 2 (2-1)/2 x 4000 bytes.
        assert _only(probe[rank]["all_reduce"]) == ("all_reduce:2", _counts(1, 4000, 4000))
        assert _only(probe[rank]["all_reduce_async"]) == ("all_reduce:2", _counts(1, 4000, 4000))


def test_reduce_scatter_and_all_gather(probe):
    for rank in range(2):
        # reduce-scatter of a 4000-byte input: (n-1)/n x input.
        assert _only(probe[rank]["reduce_scatter_tensor"]) == ("reduce_scatter:2",
                                                               _counts(1, 2000, 4000))
        # all-gather into 8000 bytes from 4000 each: (n-1)/n x output.
        assert _only(probe[rank]["all_gather_into_tensor"]) == ("all_gather:2",
                                                                _counts(1, 4000, 4000))
        if "singles" in probe[rank]:
            assert probe[rank]["singles"]["summary"]["by_op"] == {
                "reduce_scatter:2": _counts(1, 2000, 4000), "all_gather:2": _counts(1, 4000, 4000)}
        assert _only(probe[rank]["all_gather_list"]) == ("all_gather:2", _counts(1, 4000, 4000))
        assert _only(probe[rank]["mcore_bound_all_gather"]) == ("all_gather:2",
                                                                _counts(1, 4000, 4000))
        assert _only(probe[rank]["mcore_bound_reduce_scatter"]) == ("reduce_scatter:2",
                                                                    _counts(1, 2000, 4000))


def test_all_to_all_counts_what_leaves_the_rank(probe):
    # Rows of 2 fp32 = 8 bytes. Rank 0 keeps 300 rows, sends 700; rank 1 keeps 300, sends 700.
    for rank in range(2):
        assert _only(probe[rank]["all_to_all_single"]) == ("all_to_all:2",
                                                           _counts(1, 700 * 8, 1000 * 8))


def test_broadcast_p2p_barrier_objects(probe):
    # Ring broadcast from rank 0: rank 0 sends the 4000 bytes, rank 1 (the ring's end) nothing.
    assert _only(probe[0]["broadcast"]) == ("broadcast:2", _counts(1, 4000, 4000))
    assert _only(probe[1]["broadcast"]) == ("broadcast:2", _counts(1, 0, 4000))
    assert probe[0]["send_recv"]["summary"]["by_op"] == {"send:2": _counts(2, 4040, 4040)}
    assert probe[1]["send_recv"]["summary"]["by_op"] == {"recv:2": _counts(2, 0, 4040)}
    for rank in range(2):
        # Each op of a batch counts once, as its send / recv (not again as the inner isend).
        assert probe[rank]["batch_isend_irecv"]["summary"]["by_op"] == {
            "send:2": _counts(1, 80, 80), "recv:2": _counts(1, 0, 80)}
        assert _only(probe[rank]["barrier"]) == ("barrier:2", _counts(1, 0, 0))
        pickled = probe[rank]["pickled"]
        assert _only(probe[rank]["all_gather_object"]) == ("all_gather_object:2",
                                                           _counts(1, pickled, pickled))


def test_device_layer_view_and_small_groups(probe):
    for rank in range(2):
        view = probe[rank]["view"]
        assert view["functions"] == ["all_reduce", "broadcast", "all_to_all_single"]
        by_op = view["summary"]["by_op"]
        assert by_op["all_reduce:2"] == _counts(1, 4000, 4000)
        # Broadcast from rank 1: the ring ends at rank 0.
        assert by_op["broadcast:2"] == _counts(1, 4000 if rank == 1 else 0, 4000)
        assert by_op["all_to_all:2"] == _counts(1, 700 * 8, 1000 * 8)
        assert probe[rank]["view_restored"]
        assert _only(probe[rank]["solo"]) == ("all_reduce:1", _counts(1, 0, 4000))


def test_nesting_and_restoring(probe):
    for rank in range(2):
        assert probe[rank]["outer"]["by_op"] == {"all_reduce:2": _counts(2, 4040, 4040)}
        assert probe[rank]["inner"]["by_op"] == {"all_reduce:2": _counts(1, 40, 40)}
        assert probe[rank]["reentry_refused"]
        assert probe[rank]["after_inner_closed"] == [1, 0]
        assert all(probe[rank]["restored"].values()), probe[rank]["restored"]


def test_bound_names_cover_the_training_path():
    """Every module on the training path that binds a collective under its own name is listed
    (and every listed binding still exists): a new one would be missed by the meter."""
    for module in ("glm5_train.checkpoint", "parallel.muon", "parallel.distributed_muon",
                   "parallel.pipeline_zero2", "glm5_train.optim",
                   "glm5_train.step", "glm5_train.train", "megatron.core.optimizer.distrib_optimizer",
                   "megatron.core.pipeline_parallel.schedules", "megatron.core.timers",
                   "megatron.core.transformer.moe.token_dispatcher",
                   "megatron.core.transformer.multi_token_prediction"):
        importlib.import_module(module)

    assert cm.unlisted_bindings() == []
    assert len(cm.bound_names_present()) == len(cm.BOUND_NAMES)
    # The check itself finds a by-name import.
    fake = types.ModuleType("megatron.core._comm_meter_probe")
    fake.all_reduce = dist.all_reduce
    sys.modules[fake.__name__] = fake
    try:
        assert cm.unlisted_bindings() == [
            "megatron.core._comm_meter_probe.all_reduce = torch.distributed.all_reduce"]
    finally:
        del sys.modules[fake.__name__]


def test_every_torch_collective_has_a_rule():
    """A collective a newer torch adds (as 2.13 added reduce_scatter_single) needs a rule."""
    words = ("gather", "scatter", "reduce", "all_to_all", "broadcast", "send", "recv", "barrier")
    public = {name for name in dir(dist) if any(w in name for w in words)
              and inspect.isfunction(getattr(dist, name))
              and getattr(dist, name).__module__ == "torch.distributed.distributed_c10d"}
    assert sorted(public - set(cm.RULES)) == []


def test_unique_bytes_counts_shared_storage_once():
    base = torch.zeros(100)
    assert cm._unique_bytes([base, base[:50], base[25:75], base.view(10, 10)]) == 400
    assert cm._unique_bytes([base[:10], base[90:]]) == 80
    assert cm._unique_bytes([base, torch.zeros(3, dtype=torch.float64)]) == 424
    assert cm._unique_bytes([base], exclude_storages={base.untyped_storage().data_ptr()}) == 0


# --------------------------------------------------------------------------- (b) the real job


def _tiny_parameter_count() -> tuple[int, object]:
    """The tiny GLM-5's parameters (main model + MTP layer) from the closed-form formula
    (glm5_train/plan/param_count.py): independent of the built model and of megatron-core's
    buffers."""
    cfg = compose_model_config(["model=glm5_tiny"])
    return param_count.formula_totals(cfg).total + param_count.mtp_formula_totals(cfg).total, cfg


def _small_all_reduces(cfg) -> dict[str, int]:
    """The all-reduces over the 2 data-parallel ranks of a DP2 step besides the gradients,
    with their payloads (the tiny model trains MTP and, with dsa=sparse, the indexer)."""
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace + cfg.num_nextn_predict_layers
    return {
        # megatron-core's expert-bias update: tokens per expert of every MoE layer (fp32)
        "router tokens per expert": moe_layers * cfg.n_routed_experts * F32,
        # finalize_model_grads: the step's loss-token count (int32)
        "num_tokens": 4,
        # glm5_train.step.global_loss: (loss sum, tokens) in fp64
        "loss": 2 * 8,
        # glm5_train.step.global_mtp_losses: (sum, tokens) per MTP step in fp64
        "mtp losses": cfg.mtp_num_steps * 2 * 8,
        # glm5_train.train.global_indexer_kl: (kl sum, queries) in fp64
        "indexer kl": 2 * 8,
    }


@pytest.fixture(scope="module")
def dp2_records(tmp_path_factory):
    run = run_job(2, ["parallel=single", "train.train_iters=3"],
                  str(tmp_path_factory.mktemp("dp2")))
    return run.records


def test_dp2_buffers_and_gradient_all_reduce(dp2_records):
    params, cfg = _tiny_parameter_count()
    extras = _small_all_reduces(cfg)
    n = 2
    assert len(dp2_records) == 3
    for record in dp2_records:
        # fp32 gradients, plain DDP: one buffer element per parameter, on both ranks.
        assert record["grad_buffer_bytes"] == [params * F32] * n
        assert record["param_bytes"] == [params * F32] * n
        grad = record["grad_buffer_bytes"][0]
        all_reduce = record["comm_by_op"]["all_reduce:2"]
        assert all_reduce["calls"] == [1 + len(extras)] * n
        assert all_reduce["payload_bytes"] == [grad + sum(extras.values())] * n
        # The ring rule, 2 (n-1)/n x payload, is the payload itself at n = 2.
        assert all_reduce["bytes"] == [2 * (n - 1) * grad // n + sum(extras.values())] * n
        assert "reduce_scatter:2" not in record["comm_by_op"]
        # By megatron-core group name: the gradients and the token count on the data-parallel
        # group; the losses on the world; the rest of size 2 on groups of their own.
        by_group = record["comm_by_group"]
        assert by_group["all_reduce:dp_cp"]["bytes"] == [grad + 4] * n
        assert sum(v["bytes"][0] for k, v in by_group.items() if k.startswith("all_reduce:")) \
            == all_reduce["bytes"][0]
        # Totals are the sums over the kinds.
        for total, part in (("comm_bytes", "bytes"), ("comm_calls", "calls"),
                            ("comm_payload_bytes", "payload_bytes")):
            assert record[total] == [sum(v[part][r] for v in record["comm_by_op"].values())
                                     for r in range(n)]
        # AdamW: exp_avg and exp_avg_sq per parameter (fp32) and a 4-byte step per tensor.
        extra_state = record["optimizer_state_bytes"][0] - 2 * params * F32
        assert 0 < extra_state < 1000 and extra_state % 4 == 0


def test_dp2_distributed_optimizer_reduce_scatter_and_all_gather(tmp_path):
    params, _ = _tiny_parameter_count()
    records = run_job(2, ["parallel=single", "parallel.use_distributed_optimizer=true",
                          "train.train_iters=1"], str(tmp_path / "distopt")).records
    record = records[0]
    grad = record["grad_buffer_bytes"]
    # The full (padded) buffer stays on every rank: ZeRO-1 does not shrink it.
    assert grad[0] == grad[1] >= params * F32
    by_op = record["comm_by_op"]
    # Gradients: reduce-scatter, (n-1)/n x the buffer. Parameters: all-gather of the shards,
    # (n-1)/n x the (equally padded) parameter buffer.
    assert by_op["reduce_scatter:2"] == {"calls": [1, 1], "bytes": [grad[0] // 2] * 2,
                                         "payload_bytes": grad}
    assert by_op["all_gather:2"] == {"calls": [1, 1], "bytes": [grad[0] // 2] * 2,
                                     "payload_bytes": [grad[0] // 2] * 2}
    assert record["comm_by_group"]["reduce_scatter:dp_cp"] == by_op["reduce_scatter:2"]
    assert record["comm_by_group"]["all_gather:dp_cp"] == by_op["all_gather:2"]
    # The same calls by purpose (the bucketed sync runs coalesced: timed at the batch's run),
    # adding up to the totals; the time they held each rank fits inside its step.
    purposes = record["comm_by_purpose"]
    for purpose, op in (("dp_grad_reduce_scatter", "reduce_scatter:2"),
                        ("dp_param_all_gather", "all_gather:2")):
        assert purposes[purpose]["calls"] == [1, 1]
        assert purposes[purpose]["bytes"] == by_op[op]["bytes"]
    for rank in (0, 1):
        assert sum(p["calls"][rank] for p in purposes.values()) == record["comm_calls"][rank]
        assert sum(p["bytes"][rank] for p in purposes.values()) == record["comm_bytes"][rank]
        assert 0 < sum(p["ms"][rank] for p in purposes.values()) < record["step_time_ms"][rank]
    # Optimizer state is sharded: both ranks' Adam moments together are 2 x the parameters.
    state = sum(record["optimizer_state_bytes"])
    assert 0 < state - 2 * params * F32 < 1000
