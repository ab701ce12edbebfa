"""Head-parallel (Ulysses-style) context parallelism, ``parallel.cp_comm=head_parallel``, and the
two-level all-to-all under it (``parallel/hierarchical_all_to_all.py``).

- The exchange, on in-process gloo ranks: the two-level all-to-all equals one flat
  ``all_to_all_single`` (nodes of 3 and of 2 ranks on 6 ranks, where the two levels' groups have
  different sizes, so the meter's per-group-size counts are the per-level bytes; a group
  spread one rank per node, which stays flat), its backward is the inverse exchange, the bytes
  per level are ``level_bytes``' exactly, and the sequence <-> head re-sharding round-trips.
- Validation: a bad ``parallel.cp_comm`` / ``cp_node_size`` stops the job before any group.
- Parity vs one process over 5 steps (losses, MTP losses, indexer KL, grad norm and every
  parameter's gradient), tolerance ``FP32`` (the repo's: head-parallel CP changes only fp32
  reduction order: each head's attention is the same arithmetic on the same rows; the pick
  probabilities are summed over heads across ranks by a reduce-scatter; key gradients are
  summed over ranks; DDP averages over DP x CP): CP2 (flat all-to-all) in both DSA stages and
  CP4 on nodes of 2 ranks (two levels of 2 x 2). The CP2 sparse run uses the masked-dense
  reference kernel against the one-process absorbed run: the two compute the same attention
  over the same picks, in a different order. Measured largest relative differences (losses,
  grad norm, indexer KL, per-parameter grad norm): CP2 masked-dense 6.1e-8, 2.1e-6, 1.7e-5,
  1.6e-5; CP2 warm-up 4.2e-8, 2.1e-6, 3.4e-5, 1.9e-4; CP4 on nodes of 2 4.7e-8, 4.6e-7,
  1.4e-5, 1.0e-5: each >= 10x inside FP32 (1e-6, 1e-4, 1e-3, 2e-3). Each run's own metrics
  prove the layout ran (``assert_layout_ran``'s checks plus the all-to-all group sizes of the
  mode) and that every collective on the CP groups moved exactly the bytes of
  ``head_parallel_cp.layer_transfers``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from glm5_train.job_config import compose_job
from glm5_train.model.head_parallel_cp import AttentionShape, layer_transfers, meter_bytes
from parallel.comm_meter import CommMeter
from parallel.hierarchical_all_to_all import (
    AllToAll,
    build_exchange,
    heads_to_sequence,
    level_bytes,
    node_split,
    sequence_to_heads,
)
from parallel.layout import LayoutError, validate_layout
from tests.parity import (
    BASE_OVERRIDES,
    FP32,
    compare,
    expected_group_sizes,
    layout_of,
    memory_problems,
    one_process,
    pipeline_log_problems,
    run_job,
)
from tests.spawn import run_ranks

# ------------------------------------------------------------------------- the exchange


def _payload(rank: int, size: int) -> torch.Tensor:
    """Row j of rank ``rank``: values that name (source, destination, element)."""
    src = torch.full((size, 3, 5), float(rank))
    dst = torch.arange(size, dtype=torch.float32)[:, None, None].expand(size, 3, 5)
    return 1000 * src + 10 * dst + torch.arange(15, dtype=torch.float32).view(1, 3, 5)


def _exchange_rank(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    return [_exchange_case(rank, *case) for case in cases]


def _exchange_case(rank: int, groups: list[list[int]], node_size: int | None,
                   pieces: int) -> dict:
    made = [dist.new_group(members) for members in groups]
    group = next(g for g, members in zip(made, groups) if rank in members)
    exchange = build_exchange(group, node_size, pieces)
    size, me = exchange.size, dist.get_rank(group)
    x = _payload(me, size).requires_grad_()
    meter = CommMeter()
    with meter.measure():
        y = AllToAll.apply(x, exchange)
    flat = torch.empty_like(x)
    dist.all_to_all_single(flat, x.detach().contiguous(), group=group)
    weight = torch.randn(y.shape, generator=torch.Generator().manual_seed(rank))
    (y * weight).sum().backward()
    # d(sum y * w)/dx, flat: row j of x went to rank j's row me, so it gets w[me] of rank j.
    want_grad = torch.empty_like(weight)
    dist.all_to_all_single(want_grad, weight, group=group)
    tokens = torch.randn(4, 2, 2 * size, 3, generator=torch.Generator().manual_seed(7 + me))
    heads = sequence_to_heads(tokens, exchange)
    return {"y": y.detach(), "flat": flat, "grad": x.grad, "want_grad": want_grad,
            "by_op": meter.by_op(), "two_level": exchange.two_level, "pieces": pieces,
            "per_node": exchange.per_node, "nodes": exchange.nodes, "tokens": tokens,
            "heads": heads.detach(), "round_trip": heads_to_sequence(heads, exchange).detach(),
            "me": me, "size": size}


# Per world size, the cases one set of ranks runs in turn: (groups, node size, pieces).
EXCHANGES = {
    4: [([[0, 2], [1, 3]], 2, 2),        # one member per node: flat over the group
        ([[0, 1, 2, 3]], None, 2)],      # no node size: flat
    6: [([[0, 1, 2, 3, 4, 5]], 3, 2),    # 3 per node x 2 nodes
        ([[0, 1, 2, 3, 4, 5]], 2, 3)],   # 2 per node x 3 nodes, 3 pieces
}


@pytest.mark.parametrize("world", sorted(EXCHANGES), ids=["4_ranks_strided_and_flat",
                                                          "6_ranks_nodes_of_3_and_2"])
def test_two_level_all_to_all_equals_the_flat_one(world):
    per_rank = run_ranks(world, _exchange_rank, EXCHANGES[world])
    for case in range(len(EXCHANGES[world])):
        results = [cases[case] for cases in per_rank]
        for got in results:
            _check_exchange(got)
        _check_head_shards(results)


def _check_exchange(got: dict) -> None:
    size, me = got["size"], got["me"]
    assert torch.equal(got["y"], got["flat"])
    assert torch.equal(got["y"][:, 0, 0], 1000 * torch.arange(size) + 10.0 * me)
    assert torch.equal(got["grad"], got["want_grad"])  # backward = the inverse exchange
    payload = 4 * size * 15
    levels = level_bytes("all_to_all", payload, size, got["per_node"], got["two_level"])
    if got["two_level"]:
        per_node, nodes = got["per_node"], got["nodes"]
        assert per_node * nodes == size and per_node > 1 and nodes > 1
        assert got["by_op"][f"all_to_all:{per_node}"]["bytes"] == levels["intra"]
        assert got["by_op"][f"all_to_all:{nodes}"]["bytes"] == levels["inter"]
        assert got["by_op"][f"all_to_all:{per_node}"]["calls"] == got["pieces"]
        assert levels["inter"] == payload * (size - per_node) // size  # = flat's inter
    else:
        assert set(got["by_op"]) == {f"all_to_all:{size}"}
        assert got["by_op"][f"all_to_all:{size}"]["bytes"] == payload * (size - 1) // size
    assert torch.equal(got["round_trip"], got["tokens"])


def _check_head_shards(results: list[dict]) -> None:
    """Rank r's head shard holds every rank's rows (rank-major) of head group r."""
    by_rank = {got["me"]: got for got in results}
    for got in results:
        size, me = got["size"], got["me"]
        per = got["tokens"].shape[2] // size
        want = torch.cat([by_rank[r]["tokens"][:, :, me * per:(me + 1) * per]
                          for r in range(size)])
        assert torch.equal(got["heads"], want)


def test_node_split_refuses_groups_that_fill_nodes_unevenly():
    intra, inter = node_split([0, 1, 2, 3, 4, 5, 6, 7], 4)
    assert intra == [[0, 1, 2, 3], [4, 5, 6, 7]] and inter == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert node_split([1, 3, 5, 7], 4) == ([[1, 3], [5, 7]], [[1, 5], [3, 7]])  # TP2 stride
    with pytest.raises(ValueError, match="same number of them on every node"):
        node_split([0, 2, 4], 3)  # node 0 holds 0 and 2, node 1 holds 4


# ---------------------------------------------------------------------------- validation


def _validate(*overrides: str, world: int) -> None:
    job = compose_job([*BASE_OVERRIDES, "parallel=single", *overrides])
    validate_layout(job.parallel, job.model, world, job.train.global_batch_size,
                    job.train.micro_batch_size, job.train.seq_length)


@pytest.mark.parametrize("overrides,world,message", [
    (["parallel.cp_comm=ulysses"], 1, "parallel.cp_comm='ulysses': use one of"),
    (["parallel.context_parallel_size=2", "parallel.cp_node_size=2"], 2,
     "cp_node_size=2 sets the nodes of the head-parallel all-to-all"),
    (["parallel.context_parallel_size=8", "parallel.cp_comm=head_parallel",
      "train.seq_length=64"], 8, "splits the 4 attention heads"),
    (["parallel.context_parallel_size=2", "parallel.cp_comm=head_parallel",
      "parallel.cp_node_size=3"], 2, "must be a positive divisor of the world size 2"),
    (["parallel.context_parallel_size=4", "parallel.cp_comm=head_parallel",
      "parallel.cp_node_size=3", "train.global_batch_size=12"], 12,
     "same number of them on every node"),
], ids=["unknown_mode", "node_size_without_head_parallel", "heads", "node_size_divides_world",
        "uneven_nodes"])
def test_bad_head_parallel_settings_are_refused(overrides, world, message):
    with pytest.raises(LayoutError, match=message):
        _validate(*overrides, world=world)


def test_good_head_parallel_settings_pass():
    _validate("parallel.context_parallel_size=4", "parallel.cp_comm=head_parallel",
              "parallel.cp_node_size=2", world=4)
    _validate("parallel=tp2", "parallel.context_parallel_size=2",
              "parallel.cp_comm=head_parallel", "parallel.cp_node_size=2", world=8)


# ---------------------------------------------------------------- parity with one process

SPARSE = ["checkpoint.load=null"]
WARMUP = ["checkpoint.load=null", "dsa=dense_warmup"]
DENSE = ["checkpoint.load=null", "dsa=dense"]  # no indexer: the hook's dense path alone
HEAD_PARALLEL = ["parallel=single", "parallel.cp_comm=head_parallel"]

LAYOUTS = [
    # The exchange and the attention kernel are independent: the flat exchange runs the
    # masked-dense reference kernel here, the two-level one the absorbed kernel (CP4).
    ("cp2_masked_dense_sparse", 2, None, [*HEAD_PARALLEL, "parallel.context_parallel_size=2",
                                          "dsa.sparse_attention=masked_dense", *SPARSE]),
    ("cp2_warmup", 2, None, [*HEAD_PARALLEL, "parallel.context_parallel_size=2", *WARMUP]),
    ("cp2_dense", 2, None, [*HEAD_PARALLEL, "parallel.context_parallel_size=2", *DENSE]),
    ("cp4_nodes_of_2_sparse", 4, 2, [*HEAD_PARALLEL, "parallel.context_parallel_size=4",
                                     "parallel.cp_node_size=2", *SPARSE]),
]


@pytest.fixture(scope="module")
def references():
    return {name: one_process(["parallel=single", *stage]).records
            for name, stage in (("sparse", SPARSE), ("warmup", WARMUP), ("dense", DENSE))}


@pytest.mark.parametrize("name,nprocs,node_size,overrides", LAYOUTS,
                         ids=[n for n, *_ in LAYOUTS])
def test_head_parallel_context_parallel_matches_one_process(tmp_path, references, name, nprocs,
                                                            node_size, overrides):
    result = run_job(nprocs, overrides, str(tmp_path))
    problems = compare(references[name.rsplit("_", 1)[-1]], result.records, FP32)
    assert not problems, "\n".join(problems)
    job = compose_job([*BASE_OVERRIDES, *overrides])
    layout = layout_of(job, nprocs)
    levels = _a2a_group_sizes(nprocs, node_size)
    problems = pipeline_log_problems(result.log, layout)
    problems += memory_problems(result.records[-1], job)
    for record in result.records:
        problems += _comm_problems(record, layout, levels)
        problems += _byte_problems(record, job, nprocs, node_size)
    assert not problems, "\n".join(problems)


def _a2a_group_sizes(cp: int, node_size: int | None) -> set[int]:
    if node_size is None or node_size in (1, cp):
        return {cp}
    return {node_size, cp // node_size}


def _comm_problems(record: dict, layout, a2a_sizes: set[int]) -> list[str]:
    """``tests/parity.comm_problems`` with the mode's all-to-alls added: collectives ran on
    exactly the group sizes the layout implies."""
    want = expected_group_sizes(layout)
    want["all_to_all"] = set(want.get("all_to_all", set())) | a2a_sizes
    seen: dict[str, set[int]] = {}
    for key, counts in record["comm_by_op"].items():
        op, size = key.rsplit(":", 1)
        if int(size) > 1 and any(counts["calls"]):
            seen.setdefault(op, set()).add(int(size))
    return [f"step {record['step']} {op}: ran on group sizes {sorted(seen.get(op, set()))}, "
            f"the layout implies {sorted(want.get(op, set()))}"
            for op in sorted(set(seen) | set(want)) if seen.get(op, set()) != want.get(op, set())]


def _byte_problems(record: dict, job, cp: int, node_size: int | None) -> list[str]:
    """Every rank's bytes on the CP groups per step = the formula: per layer application
    (4 decoder layers + 3 MTP steps) and micro-batch (4 of one sequence), plus the MTP
    targets' gathered token ids, loss mask and labels (int64, fp32, int64 per token)."""
    model, seq = job.model, job.train.seq_length
    transfers = layer_transfers(AttentionShape.of(model), seq, cp, "head_parallel",
                                job.dsa.stage, act_bytes=4)
    times = (model.num_hidden_layers + model.mtp_num_steps) * job.train.global_batch_size
    want = {key: value * times for key, value in meter_bytes(transfers, cp, node_size).items()}
    want[f"all_gather:{cp}"] += (cp - 1) * (seq // cp) * (8 + 4 + 8) * job.train.global_batch_size
    problems = []
    for key, total in want.items():
        got = record["comm_by_op"].get(key, {}).get("bytes")
        if got != [total] * cp:
            problems.append(f"step {record['step']} {key}: {got} bytes per rank, the formula "
                            f"gives {total}")
    return problems
