"""The planner's tensor-parallel traffic (glm5_train/plan/tensor_parallel_comm.py) against the
training job's measured bytes, per rank, from the run's own ``comm_by_group``.

Every parity run with TP > 1 already checks it (tests/parity.py ``assert_layout_ran`` ->
``glm5_train.plan.check.problems``: TP2, TP2 x PP2, TP2 x PP2 x VPP2 x EP2, expert TP, TP2 without
sequence parallelism, CP2 x TP2, ZeRO2, the main job's layout). The runs here cover what those
do not: bf16 (the experts' combine stays fp32), two sequences per micro-batch, megatron-core's
whole-logits head, selective and full recompute (what each repeats), TP4, megatron-core's MLA
path (masked-dense, dense fallback), Muon's gathers without Muon Split; and a planted extra
collective must be caught. The dense warm-up: tests/test_parity.py's TP2 x PP2 x VPP2 x EP2
run (one KL chunk per layer at 64 tokens; 32 chunks of 2 rows, measured once with
dsa.CHUNK_ELEMENTS patched to 2000, were exact too). (Distributed Muon's
owner-only gathers: tests/test_muon.py's TP2 x DP2 parity layouts.) Exact for the tensor-parallel group: the measured maximum difference
over these runs is 0 bytes. The expert all-to-all (EP2 in bf16 here; every EP parity run
checks it too): the bytes handed over exactly as a stage's mean, each rank's within the
router's spread.
"""

from __future__ import annotations

import pytest

from glm5_train.job_config import compose_job, compose_model_config
from glm5_train.plan import MemoryInputs
from glm5_train.plan import check as plan_check
from glm5_train.plan.tensor_parallel_comm import layer_comm
from parallel.recompute import Recompute
from tests.parity import BASE_OVERRIDES, assert_layout_ran, run_job

ONE_STEP = ["checkpoint.load=null", "train.train_iters=1"]
SELECTIVE = ["activations.recompute_granularity=selective",
             "activations.recompute_modules=[core_attn,mla_up_proj,moe_act]"]
FULL = ["activations.recompute_granularity=full", "activations.recompute_method=uniform",
        "activations.recompute_num_layers=1"]

CASES = [  # (name, processes, overrides)
    # Muon gathers every TP-split matrix's fp32 update; without Muon Split the MLA up
    # projections too
    ("tp2_bf16_mb2_whole_head_selective_muon", 2,
     ["parallel=tp2", "train.params_dtype=bf16", "train.micro_batch_size=2",
      "activations.loss_chunk_tokens=0", *SELECTIVE, "train.optimizer=muon",
      "train.muon_split_mla=false"]),
    ("tp2_full_recompute", 2, ["parallel=tp2", *FULL]),
    # megatron-core's MLA (the dense fallback, no indexer or KL; the masked-dense reference):
    # its column-parallel key-value up projection gathers the latent again in backward
    ("tp4_chunked_dense_fallback", 4, ["parallel=tp2", "parallel.tensor_model_parallel_size=4",
                                       "activations.loss_chunk_tokens=16",
                                       "model.index_topk=64"]),
    ("tp2_masked_dense", 2, ["parallel=tp2", "dsa.sparse_attention=masked_dense"]),
]


def _tp_rows(job, record) -> list[plan_check.RankBytes]:
    return [r for r in plan_check.traffic_rows(job, record)
            if r.field in ("tensor_parallel", "expert_tensor_parallel")]


@pytest.mark.parametrize("name,world,overrides", CASES, ids=[c[0] for c in CASES])
def test_planner_gives_each_ranks_tensor_parallel_bytes_exactly(tmp_path, name, world, overrides):
    overrides = [*overrides, *ONE_STEP]
    result = run_job(world, overrides, str(tmp_path))
    assert_layout_ran(result, world, overrides)  # plan_check.problems included
    job, record = compose_job([*BASE_OVERRIDES, *overrides]), result.records[-1]
    rows = _tp_rows(job, record)
    assert {r.field for r in rows} == {"tensor_parallel", "expert_tensor_parallel"}
    assert len(rows) == 2 * world
    for row in rows:
        print(f"rank {row.rank} {row.field}: planned {row.planned:,} measured {row.measured:,}")
    assert all(r.measured == r.planned > 0 for r in rows), rows


def test_a_collective_the_plan_does_not_have_is_caught(tmp_path):
    """One more all-gather of a rank's hidden states on one rank (a layer gathering twice) is
    reported, naming the rank and the field."""
    overrides = ["parallel=tp2", *ONE_STEP]
    job = compose_job([*BASE_OVERRIDES, *overrides])
    record = run_job(2, overrides, str(tmp_path)).records[-1]
    assert not plan_check.problems(job, record)
    hidden = (2 - 1) * 32 * job.model.hidden_size * 4  # 32 tokens per rank, fp32
    groups = dict(record["comm_by_group"])
    gathered = dict(groups["all_gather:tp"])
    gathered["bytes"] = [gathered["bytes"][0] + hidden, gathered["bytes"][1]]
    wrong = dict(record, comm_by_group={**groups, "all_gather:tp": gathered})
    found = plan_check.problems(job, wrong)
    assert len(found) == 1 and found[0].startswith("rank 0 tensor_parallel:"), found


def test_tensor_parallel_bytes_grow_linearly_with_the_sequence_744b():
    """Long context: a GLM-5 MoE layer's TP bytes per micro-batch (forward + backward, with
    and without recompute) grow exactly linearly with the sequence (the KL's K picks per query
    are fixed; nothing is s x s), on top of a fixed term: the dispatcher's per-expert token
    counts (int64), gathered over the TP x EP group once per forward."""
    cfg = compose_model_config(["model=glm5_744b"])
    counts = (8 - 1) * cfg.n_routed_experts * 8
    for recompute, forwards in ((Recompute(), 1), (Recompute("full", "uniform", 1), 2),
                                (Recompute("selective", modules=("core_attn", "mla_up_proj")),
                                 1)):
        sent = []
        for s in (32768, 65536, 131072):
            inp = MemoryInputs(tp=8, sequence_parallel=True, seq_length=s, recompute=recompute)
            total, again = layer_comm(cfg, True, inp)
            sent.append(sum(b for _, b in total) + forwards // 2 * sum(b for _, b in again))
        fixed = 2 * sent[0] - sent[1]
        assert sent[2] - fixed == 4 * (sent[0] - fixed), (recompute, sent)
        assert fixed == forwards * counts, (recompute, fixed)


# ------------------------------------------------------------------ the expert all-to-all

EP2_BF16 = ["parallel=ep2", "train.params_dtype=bf16", *ONE_STEP]


@pytest.fixture(scope="module")
def ep2_bf16_run(tmp_path_factory):
    job = compose_job([*BASE_OVERRIDES, *EP2_BF16])
    return job, run_job(2, EP2_BF16, str(tmp_path_factory.mktemp("ep2_bf16"))).records[-1]


def _all_to_all_rows(job, record) -> list[plan_check.RankBytes]:
    return [r for r in plan_check.traffic_rows(job, record)
            if r.field in ("expert_all_to_all", "expert_all_to_all_payload")]


def test_planner_gives_the_expert_all_to_all(ep2_bf16_run):
    """EP2, bf16 (the rows travel as bf16, their probabilities fp32): the bytes the ranks hand
    to the dispatcher's all-to-alls average exactly the planned over the EP group, each rank's
    at least its own dispatched half; the bytes sent (less the rows a rank's own experts take)
    close to the planned even split. Every EP parity run checks the same
    (plan_check.problems)."""
    job, record = ep2_bf16_run
    assert not plan_check.problems(job, record)
    rows = _all_to_all_rows(job, record)
    for row in rows:
        print(f"rank {row.rank} {row.field}: planned {row.planned:,} measured {row.measured:,}")
    payload = [r for r in rows if r.field == "expert_all_to_all_payload"]
    sent = [r for r in rows if r.field == "expert_all_to_all"]
    assert len(payload) == len(sent) == 2
    assert sum(r.measured for r in payload) == sum(r.planned for r in payload) > 0
    assert all(r.rel > 0 and r.measured >= r.planned // 2 for r in payload), payload  # routed
    assert all(r.planned > 0 and r.rel <= 0.02 for r in sent), sent  # measured 0.91%
    # EP2: whatever a rank keeps, what it sends is what the other returns: the same bytes.
    assert sent[0].measured == sent[1].measured < payload[0].measured


def test_an_all_to_all_the_plan_does_not_have_is_caught(ep2_bf16_run):
    """One MoE block's dispatch handed over twice on one rank (a block dispatching again)
    looks like routing on that rank alone, but the EP group's mean shows it; a rank handing
    over less than its own rows is caught on that rank."""
    job, record = ep2_bf16_run
    groups = dict(record["comm_by_group"])
    entry = dict(groups["all_to_all:ep"])
    tokens, topk = 64, job.model.num_experts_per_tok
    dispatch = tokens * topk * (job.model.hidden_size * 2 + 4)  # bf16 rows, fp32 probabilities
    entry["payload_bytes"] = [entry["payload_bytes"][0] + dispatch, entry["payload_bytes"][1]]
    wrong = dict(record, comm_by_group={**groups, "all_to_all:ep": entry})
    found = plan_check.problems(job, wrong)
    assert len(found) == 1 and "expert_all_to_all_payload, mean over its 2 ranks" in found[0], \
        found
    handed = groups["all_to_all:ep"]["payload_bytes"]
    lost = dict(groups["all_to_all:ep"], payload_bytes=[handed[0] // 3, handed[1]])
    found = plan_check.problems(job, dict(record, comm_by_group={**groups, "all_to_all:ep": lost}))
    assert any(f.startswith("rank 0 expert_all_to_all_payload: measured") and "its own" in f
               for f in found), found


def test_expert_all_to_all_grows_linearly_with_the_sequence_744b():
    """Long context: a GLM-5 MoE block's all-to-all bytes per micro-batch are the rank's
    tokens x top-k rows, nothing fixed and nothing s x s: exactly proportional to the
    sequence (EP 32 as the published recipes, sequence split over TP 2)."""
    cfg = compose_model_config(["model=glm5_744b"])
    sent = []
    for s in (32768, 65536, 131072):
        inp = MemoryInputs(tp=2, ep=32, sequence_parallel=True, seq_length=s)
        total, _again = layer_comm(cfg, True, inp)
        sent.append(dict(total)["all_to_all:ep"])
    assert sent[1] == 2 * sent[0] and sent[2] == 4 * sent[0], sent
    rows = 32768 // 2 * cfg.num_experts_per_tok  # bf16 rows and combine, fp32 probabilities
    assert sent[0] == 2 * (31 * rows * (2 * cfg.hidden_size * 2 + 4) // 32)  # fwd + bwd
