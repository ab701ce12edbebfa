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

import dataclasses

import pytest
import torch
import torch.distributed as dist

from glm5_train.job_config import compose_job
from glm5_train.model.head_parallel_cp import (
    AttentionShape,
    AttentionWork,
    Links,
    choose_exchange,
    layer_transfers,
    meter_bytes,
)
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
    (["parallel.cp_comm=auto", "parallel.context_parallel_size=2",
      "parallel.cp_inter_node_gbs=0"], 2, "parallel.cp_inter_node_gbs=0 must be > 0"),
], ids=["unknown_mode", "node_size_without_head_parallel", "heads", "node_size_divides_world",
        "uneven_nodes", "link_rate"])
def test_bad_head_parallel_settings_are_refused(overrides, world, message):
    with pytest.raises(LayoutError, match=message):
        _validate(*overrides, world=world)


def test_a_node_size_must_suit_the_flexible_groups():
    """Flexible groups (the heads' split: tests/test_flexible_cp.py): a node size is checked
    against the world, and every group, as fixed CP's."""
    job = compose_job([*BASE_OVERRIDES, "parallel=single", "train.seq_length=64",
                       "train.micro_batch_size=1"])
    par = dataclasses.replace(job.parallel, cp_groups="flexible", flexible_cp_max_size=4,
                              cp_comm="auto", cp_node_size=3)
    with pytest.raises(LayoutError, match="must be a positive divisor of the world size 4"):
        validate_layout(par, job.model, 4, job.train.global_batch_size, 1, 64)


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
    problems = pipeline_log_problems(result.log, layout)
    problems += memory_problems(result.records[-1], job)
    for record in result.records:
        problems += _comm_problems(record, layout, _cp_group_sizes(job, nprocs, node_size))
        problems += _byte_problems(record, job, nprocs, node_size)
    assert not problems, "\n".join(problems)


CP_OPS = ("all_gather", "reduce_scatter", "all_to_all")  # the layouts here: TP, EP and DP 1


def _cp_group_sizes(job, cp: int, node_size: int | None) -> dict[str, set[int]]:
    """{op: group sizes} of the CP collectives the formula gives the job's stage (the MTP
    targets' token ids are always gathered over the CP group)."""
    transfers = layer_transfers(AttentionShape.of(job.model), job.train.seq_length, cp,
                                "head_parallel", job.dsa.stage)
    sizes: dict[str, set[int]] = {"all_gather": {cp}}
    for key in meter_bytes(transfers, cp, node_size):
        op, size = key.rsplit(":", 1)
        sizes.setdefault(op, set()).add(int(size))
    return sizes


def _comm_problems(record: dict, layout, cp_sizes: dict[str, set[int]]) -> list[str]:
    """``tests/parity.comm_problems`` with the CP collectives the mode runs: collectives ran
    on exactly the group sizes the layout and the formula imply."""
    want = {op: set(sizes) - ({layout.cp} if op in CP_OPS else set())
            for op, sizes in expected_group_sizes(layout).items()}
    for op, sizes in cp_sizes.items():
        want[op] = want.get(op, set()) | sizes
    want = {op: sizes for op, sizes in want.items() if sizes}
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
    want[f"all_gather:{cp}"] = want.get(f"all_gather:{cp}", 0) + (cp - 1) * (seq // cp) * (8 + 4 + 8) * job.train.global_batch_size
    problems = []
    for key, total in want.items():
        got = record["comm_by_op"].get(key, {}).get("bytes")
        if got != [total] * cp:
            problems.append(f"step {record['step']} {key}: {got} bytes per rank, the formula "
                            f"gives {total}")
    return problems


# ------------------------------------------------- parallel.cp_comm=auto: the group's choice

GLM5_SHAPE = AttentionShape.of(compose_job(["model=glm5_744b"]).model)  # TP1
H100 = Links(intra=450e9, inter=50e9)


@pytest.mark.parametrize("tp", [1, 8])
def test_auto_keeps_the_all_gather_at_glm5s_shapes(tp):
    """MLA's latent (576 values a token, shared by every head) is cheaper to gather than the
    per-head queries, keys, values and outputs are to exchange: at GLM-5's shapes no group
    size, length, stage or TP makes head-parallel CP send fewer bytes per level, so auto
    keeps the all-gather (head-parallel costs >= 1.6x its time: bench/cp_comm_modes.py)."""
    shape = dataclasses.replace(GLM5_SHAPE, heads=64 // tp)
    for stage in ("sparse", "dense_warmup", "dense"):
        work = AttentionWork(shape, stage, True, 2, documents=True)
        for cp in (2, 4, 8, 16, 32, 64):
            for seq in (32768, 202752):
                mode, costs = choose_exchange(work, seq, list(range(cp)), 8, H100)
                assert mode == "all_gather", (tp, stage, cp, seq, costs)
                if shape.heads % cp == 0:
                    assert costs["head_parallel"].seconds > 1.5 * costs["all_gather"].seconds
                else:  # heads that do not split: all-gather, head-parallel not priced
                    assert set(costs) == {"all_gather"}


def test_auto_picks_head_parallel_where_its_bytes_per_level_take_less_time():
    """A planted attention whose shared key is wide (512) and whose heads are narrow (8 + 8):
    in a group of 2 the gather sends less, in a group of 8 head-parallel does and auto takes
    it; spanning nodes of 8, each level's bytes at its own rate decide: with a narrower key
    (160), head-parallel sends fewer bytes in all but more across nodes, so H100's slow NIC
    keeps the all-gather and a cross-node link as fast as NVLink takes head-parallel."""
    shape = AttentionShape(heads=64, query=8, value=8, latent=512, index_key=128, topk=2048)
    work = AttentionWork(shape, "dense", True, 2, documents=False)
    assert choose_exchange(work, 65536, [0, 1], None, H100)[0] == "all_gather"
    mode, costs = choose_exchange(work, 65536, list(range(8)), None, H100)
    assert mode == "head_parallel" and costs["head_parallel"].inter == 0, costs
    assert costs["head_parallel"].intra < costs["all_gather"].intra
    narrow = AttentionWork(dataclasses.replace(shape, latent=160), "dense", True, 2, False)
    mode_slow, c = choose_exchange(narrow, 65536, list(range(32)), 8, H100)
    hp, ag = c["head_parallel"], c["all_gather"]
    assert hp.intra + hp.inter < ag.intra + ag.inter and hp.inter > ag.inter, c
    assert hp.seconds == pytest.approx(hp.intra / H100.intra + hp.inter / H100.inter)
    mode_fast, _ = choose_exchange(narrow, 65536, list(range(32)), 8,
                                   Links(intra=450e9, inter=450e9))
    assert (mode_slow, mode_fast) == ("all_gather", "head_parallel")


def _fixed_auto_rank(rank: int, world: int, overrides: list[str]) -> tuple[str, str]:
    import contextlib
    import io

    from glm5_train.model.head_parallel_cp import fixed_cp_comm

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        mode = fixed_cp_comm(compose_job([*BASE_OVERRIDES, *overrides]), dist.group.WORLD)
    return mode, printed.getvalue()


def test_auto_on_the_fixed_cp_group_chooses_once_for_the_job():
    """Fixed CP, parallel.cp_comm=auto: every rank resolves the same mode for its CP group
    (the tiny model's latent is gathered more cheaply, as GLM-5's) and rank 0 says which,
    with both modes' modelled bytes per level."""
    overrides = ["parallel=single", "parallel.context_parallel_size=2", "parallel.cp_comm=auto",
                 "dsa=dense"]
    (mode0, out0), (mode1, out1) = run_ranks(2, _fixed_auto_rank, overrides)
    assert mode0 == mode1 == "all_gather" and out1 == ""
    assert out0.startswith("context parallel: parallel.cp_comm=auto chose all_gather for the "
                           "CP group of 2 (per layer, inside/across nodes: all_gather "), out0
    assert "head_parallel" in out0
