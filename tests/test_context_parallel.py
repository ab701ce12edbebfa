"""Context parallelism (zigzag sequence sharding, all-gathered latent and indexer keys) against
one process: losses, MTP losses, indexer KL, grad norm and every parameter's gradient over 5
steps, in both DSA stages, on CP alone and combined with TP + SP, PP x VPP (MTP split
placement) and EP. Each run's own metrics show that the CP layout ran (collectives on the CP
group, the planner's bytes per rank: ``assert_layout_ran``) and that the latent and indexer
keys crossed ranks in exactly the bytes the formula gives.

Tolerance: ``FP32`` (the repo's parity tolerances). CP changes only fp32 reduction order: the
gathered keys are the same values, the gradient of each key is a sum over ranks (reduce-scatter)
instead of one rank's sum, and DDP averages over DP x CP.
"""

from __future__ import annotations

import pytest
import torch

from glm5_train.job_config import compose_job
from parallel.context_parallel import (
    natural_order,
    shard_sequence,
    zigzag_positions,
)
from tests.parity import FP32, assert_layout_ran, compare, one_process, run_job

# 64 tokens (the parity runs' length), tiny GLM-5: index_topk 32 < 64, so the sparse stage
# selects; latent 32 + RoPE 16 = 48 values and indexer keys of 32 per token cross CP ranks.
SPARSE = ["checkpoint.load=null"]
WARMUP = ["checkpoint.load=null", "dsa=dense_warmup"]


def test_zigzag_shards_cover_the_sequence_once_and_balance_causal_work():
    seq, cp = 64, 4
    shares = [zigzag_positions(seq, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(shares)).values, torch.arange(seq))
    assert all(torch.all(s[1:] > s[:-1]) for s in shares)  # increasing within a rank
    causal_pairs = [int((s + 1).sum()) for s in shares]  # keys each rank's queries see
    assert len(set(causal_pairs)) == 1  # zigzag: equal causal work on every rank
    tokens = torch.arange(2 * seq).view(2, seq)
    rank_major = torch.cat([shard_sequence(tokens, 1, cp, r) for r in range(cp)], dim=1)
    assert torch.equal(rank_major[:, natural_order(seq, cp)], tokens)


@pytest.fixture(scope="module")
def references():
    return {name: one_process(["parallel=single", *stage]).records
            for name, stage in (("sparse", SPARSE), ("warmup", WARMUP))}


LAYOUTS = [
    ("cp2_sparse", 2, ["parallel=single", "parallel.context_parallel_size=2", *SPARSE]),
    ("cp2_warmup", 2, ["parallel=single", "parallel.context_parallel_size=2", *WARMUP]),
    ("cp4_sparse", 4, ["parallel=single", "parallel.context_parallel_size=4", *SPARSE]),
    ("cp2_tp2_sp_sparse", 4, ["parallel=tp2", "parallel.context_parallel_size=2", *SPARSE]),
    ("cp2_pp2_vpp2_sparse", 4, ["parallel=pp2_vpp2", "parallel.context_parallel_size=2",
                                "train.global_batch_size=8", *SPARSE]),
    ("cp2_ep2_sparse", 2, ["parallel=ep2", "parallel.context_parallel_size=2", *SPARSE]),
]


@pytest.mark.parametrize("name,nprocs,overrides", LAYOUTS, ids=[n for n, _, _ in LAYOUTS])
def test_context_parallel_matches_one_process(tmp_path, references, name, nprocs, overrides):
    result = run_job(nprocs, overrides, str(tmp_path))
    reference = references["warmup" if "warmup" in name else "sparse"]
    if "pp2" in name:  # 8 sequences per step there (PP2 x VPP2 needs >= 4 micro-batches)
        reference = one_process(["parallel=single", "train.global_batch_size=8",
                                 *SPARSE]).records
    problems = compare(reference, result.records, FP32)
    assert not problems, "\n".join(problems)
    assert_layout_ran(result, nprocs, overrides)


def test_context_parallel_sends_the_latent_and_indexer_keys_once_per_layer(tmp_path):
    """Bytes on the CP group per step = the formula: per DSA layer application and micro-
    batch, each rank all-gathers its S/c tokens' latent key (C + R values) and indexer key
    (Di values) and reduce-scatters their gradients back: (c - 1) x S/c x (C + R + Di) x 4
    bytes each way, fp32. MTP's 3 steps each run the MTP layer's attention once."""
    job = compose_job(["model=glm5_tiny"])
    model = job.model
    seq, cp, mbs, micro_batches = 64, 2, 1, 4
    applications = model.num_hidden_layers + model.mtp_num_steps
    per_token = model.kv_lora_rank + model.qk_rope_head_dim + model.index_head_dim
    each_way = (cp - 1) * (seq // cp) * mbs * per_token * 4 * applications * micro_batches
    result = run_job(cp, ["parallel=single", "parallel.context_parallel_size=2",
                          "train.train_iters=1", *SPARSE], str(tmp_path))
    record = result.records[0]
    gathered = record["comm_by_op"][f"all_gather:{cp}"]["bytes"]
    scattered = record["comm_by_op"][f"reduce_scatter:{cp}"]["bytes"]
    # The MTP targets' token ids, loss mask and labels are gathered too: int64/fp32 per token.
    ids = (cp - 1) * (seq // cp) * mbs * (8 + 4 + 8) * micro_batches
    assert scattered == [each_way] * cp
    assert gathered == [each_way + ids] * cp
