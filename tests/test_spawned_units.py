"""Small multi-rank checks of parallel/ techniques, on in-process gloo ranks (tests/spawn.py):
each runs in seconds and a failing rank's traceback shows in the test. The full training jobs
that check the same techniques end to end (parity with one process) stay in test_parity.py,
test_zero2.py and test_muon.py.

- EmbeddingTie (parallel/embedding_tie.py): every copy of the word embedding ends up with the
  sum of all copies' gradients, for copies on two pipeline ranks, two copies on one rank, and
  pipeline groups that must not mix under data parallelism.
- Pipeline ZeRO2 (parallel/pipeline_zero2.py) on megatron-core DDP chunks: the slices it keeps
  after reduce-scattering interleaved backward groups equal a plain all-reduce of the same
  gradients, for several buckets, several buffers (dense + expert), and a pinned copy.
- Distributed Muon (parallel/distributed_muon.py): owners agree on every rank, the parameter
  all-gather plans cover each bucket exactly once, and ``all_gather_uneven`` delivers every
  rank's payload, sending no padding.
- The MoE token all-to-all on gloo (megatron-core's ``mappings.all_to_all`` with tensor split
  sizes, through the device layer's view): rows and gradients reach the right ranks.
- MLA's replicated key-value down projection without sequence parallelism
  (parallel/mla_down_projection.py): the RoPE key's weight rows get the sum of every TP rank's
  gradient, the latent rows only the rank's own (its up projection already summed them).

Workers build the data and return it; the assertions run here, in the test process.
"""

from __future__ import annotations

import copy
import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from parallel import mcore_compat
from parallel.comm_meter import CommMeter
from parallel.distopt_slices import drain_gathers, gathered, mark_gathers
from parallel.distributed_muon import all_gather_uneven, assign_owners, gather_plans, matrix_slots
from parallel.embedding_tie import EmbeddingTie, check_tie_buckets
from parallel.mla_down_projection import MLADownProjection
from parallel.muon import MatrixLayout
from parallel.pipeline_zero2 import PipelineZero2
from tests.spawn import model_parallel, run_ranks

ATOL = 1e-6  # fp32; the compared sums differ only in reduction order

# ------------------------------------------------------------------------------ EmbeddingTie


def _buffer(*members: tuple[torch.nn.Parameter, int, int]) -> SimpleNamespace:
    """A megatron-core grad buffer as ``check_tie_buckets`` reads it: (param, start, bucket)."""
    buckets = {}
    for param, start, bucket in members:
        buckets.setdefault(bucket, SimpleNamespace(params=set(), offset=start)).params.add(param)
        buckets[bucket].offset = min(buckets[bucket].offset, start)
    return SimpleNamespace(params=[p for p, _, _ in members],
                           param_index_map={p: (start, start + p.numel(), b)
                                            for p, start, b in members},
                           buckets=[buckets[b] for b in sorted(buckets)])


def test_a_weight_read_outside_its_module_waits_for_its_gather():
    """Under overlap_param_gather, ``gathered`` finishes the weight's bucket-group gather
    (what ``mark_gathers`` gave it: megatron-core's finish_param_sync) before the read; other
    parameters pass through. ``drain_gathers`` finishes a gather no module waited for."""
    calls = []
    group = SimpleNamespace(finish_param_sync=lambda skip_next_bucket_dispatch: calls.append(
        skip_next_bucket_dispatch), param_gather_handle=None)
    weight, plain = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    chunk = SimpleNamespace(ddp_config=SimpleNamespace(overlap_param_gather=True,
                                                       align_param_gather=False),
                            param_to_bucket_group={weight: group}, bucket_groups=[group],
                            expert_parallel_bucket_groups=[])
    mark_gathers(chunk)
    assert gathered(weight) is weight and calls == [False]
    assert gathered(plain) is plain and calls == [False]
    pending = SimpleNamespace(waited=False)
    pending.wait = lambda: setattr(pending, "waited", True)
    group.param_gather_handle = pending
    drain_gathers([chunk])
    assert pending.waited and group.param_gather_handle is None


def test_summing_copies_after_the_reduce_scatter_needs_each_copy_alone_in_its_bucket():
    """Under overlap + the distributed optimizer the copies are summed after the
    reduce-scatter: a copy sharing its bucket is refused at start-up, one alone passes."""
    copy, other = torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(4))
    tie = SimpleNamespace(holders=lambda chunks: [copy], needs_sync=lambda chunks: True)
    alone = SimpleNamespace(buffers=[_buffer((other, 0, 0), (copy, 64, 1))],
                            expert_parallel_buffers=[])
    check_tie_buckets(tie, [alone])
    shared = SimpleNamespace(buffers=[_buffer((other, 0, 0), (copy, 64, 0))],
                             expert_parallel_buffers=[])
    with pytest.raises(RuntimeError, match=r"copy \(3, 2\) shares its gradient bucket"):
        check_tie_buckets(tie, [shared])


class _Holder(torch.nn.Module):
    """What EmbeddingTie reads of a model chunk: its stage flags and its copy of the word
    embedding (``shared_embedding_or_output_weight``)."""

    def __init__(self, copy_id: tuple, pre=False, post=False, mtp=False, main_grad=True):
        super().__init__()
        self.pre_process, self.post_process, self.mtp_process = pre, post, mtp
        self.weight = torch.nn.Parameter(torch.zeros(3, 2))
        grad = _copy_grad(copy_id)
        if main_grad:  # megatron-core DDP's fp32 gradient; a bare module's is .grad
            self.weight.main_grad = grad
        else:
            self.weight.grad = grad

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter:
        return self.weight


def _copy_grad(copy_id: tuple) -> torch.Tensor:
    """A distinct gradient per copy, (global rank, chunk), the same wherever it is computed."""
    gen = torch.Generator().manual_seed(1000 * copy_id[0] + copy_id[1])
    return torch.randn(3, 2, generator=gen)


# Per layout: pipeline rank -> its chunks' (pre, post, mtp) flags.
TIE_LAYOUTS = {
    # PP2, MTP with the loss stage (no layout given: megatron puts MTP on the last stage).
    "pp2_mtp_last": (None, {0: [(True, False, False)], 1: [(False, True, True)]}),
    # PP2 x VPP2, GLM-5's split placement: the embedding and MTP chunks both on rank 0.
    "pp2_vpp2_split": ("Et|ttt|m|L", {0: [(True, False, False), (False, False, True)],
                                      1: [(False, False, False), (False, True, False)]}),
}


def _tie_rank(rank: int, world_size: int, layout: str | None, tied: bool) -> dict:
    name = next(k for k, (given, _) in TIE_LAYOUTS.items() if given == layout)
    with model_parallel(pipeline_model_parallel_size=2):
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        config = SimpleNamespace(
            mtp_num_layers=1,
            pipeline_model_parallel_layout=(PipelineParallelLayerLayout(layout, 2)
                                            if layout else None))
        chunks = [_Holder((rank, i), pre, post, mtp, main_grad=i % 2 == 0)
                  for i, (pre, post, mtp) in enumerate(TIE_LAYOUTS[name][1][pp_rank])]
        tie = EmbeddingTie(config, tied, parallel_state.get_pipeline_model_parallel_group())
        needs = tie.needs_sync(chunks)
        tie.sync(chunks)
        pipeline = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
        grads = [c.weight.main_grad if i % 2 == 0 else c.weight.grad
                 for i, c in enumerate(chunks)]
        return {"pp_rank": pp_rank, "pipeline": pipeline, "needs_sync": needs, "grads": grads}


def _holds_copy(flags: tuple, tied: bool) -> bool:
    pre, post, mtp = flags
    return pre or mtp or (post and tied)


@pytest.mark.parametrize("world,name,tied", [
    (2, "pp2_mtp_last", False),     # one copy on each pipeline rank
    (2, "pp2_vpp2_split", False),   # two copies on rank 0, none on rank 1: no group needed
    (2, "pp2_vpp2_split", True),    # + a tied head on rank 1: three copies, two ranks
    (4, "pp2_mtp_last", True),      # DP2 x PP2: two pipelines, each summed on its own
], ids=["pp2_mtp_last", "pp2_vpp2_split", "pp2_vpp2_split_tied", "dp2_pp2_tied"])
def test_embedding_copies_get_the_sum_of_their_gradients(world, name, tied):
    layout, stages = TIE_LAYOUTS[name]
    results = run_ranks(world, _tie_rank, layout, tied)
    for rank, got in enumerate(results):
        flags = stages[got["pp_rank"]]
        # Every copy of this rank's pipeline, wherever it lives (ranks of the same pipeline).
        pipeline_copies = [(r, i) for r in got["pipeline"]
                           for i, f in enumerate(stages[results[r]["pp_rank"]])
                           if _holds_copy(f, tied)]
        expected = sum(_copy_grad(c) for c in pipeline_copies)
        mine = [i for i, f in enumerate(flags) if _holds_copy(f, tied)]
        assert got["needs_sync"] == (len(pipeline_copies) > 1 and bool(mine)), (rank, got)
        for i, grad in enumerate(got["grads"]):
            if i in mine:
                torch.testing.assert_close(grad, expected, atol=ATOL, rtol=0,
                                           msg=f"rank {rank} chunk {i}: not the sum of "
                                               f"{pipeline_copies}")
            else:  # not a copy (or an untied head): its gradient is its own
                torch.testing.assert_close(grad, _copy_grad((rank, i)), atol=0, rtol=0)
    if world == 4:  # data-parallel peers sit in different pipelines, summed apart (above)
        assert results[0]["pipeline"] != results[1]["pipeline"], results[0]["pipeline"]


# ------------------------------------------------------------------------- Pipeline ZeRO2


class _Stage(MegatronModule):
    """A tiny pipeline chunk: dense layers and, optionally, an 'expert' matrix
    (``allreduce=False``, megatron-core's marker for expert parameters, which get a buffer of
    their own)."""

    def __init__(self, config, widths: list[int], expert: bool):
        super().__init__(config)
        self.dense = torch.nn.ModuleList(
            torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.expert = None
        if expert:
            self.expert = torch.nn.Parameter(torch.randn(widths[-1], widths[-1]) / 3)
            self.expert.allreduce = False

    def forward(self, x):
        for layer in self.dense:
            x = torch.tanh(layer(x))
        return x @ self.expert if self.expert is not None else x


# The interleaved backward order of PP2 x VPP2 with 4 micro-batches per rank in groups of 2:
# (chunk, micro-batch). Each chunk is flushed twice, both accumulation buffers are reused.
ZERO2_ORDER = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
WIDTHS = ([5, 9, 7], [7, 7])  # chunk 0: several buckets; chunk 1: dense + expert buffers


def _zero2_rank(rank: int, world_size: int, per_token: bool) -> dict:
    with model_parallel():  # DP = world_size
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                   calculate_per_token_loss=per_token)
        torch.manual_seed(0)  # the same weights on every rank
        modules = [_Stage(config, WIDTHS[0], False), _Stage(config, WIDTHS[1], True)]
        reference = copy.deepcopy(modules)
        # Chunk 0 is cut into buckets of >= 60 elements (bucketing needs overlap_grad_reduce;
        # its reductions stay off under no_sync, so ZeRO2's are the only ones). The first dense
        # weight is pinned, as a word-embedding copy would be (ZeRO2 uses per-token loss).
        pinned = [modules[0].dense[0].weight] if per_token else []
        zero2, chunks = PipelineZero2(), []
        for index, module in enumerate(modules):
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                overlap_grad_reduce=index == 0, bucket_size=60 if index == 0 else None)
            chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config,
                                                  module=module, disable_bucketing=index > 0))
            zero2.adopt(chunks[-1], [p for p in pinned if any(p is q for q in module.parameters())])

        zero2.begin_step()
        with chunks[0].no_sync(), chunks[1].no_sync():
            for index, micro in ZERO2_ORDER:
                x = torch.randn(2, WIDTHS[index][0],
                                generator=torch.Generator().manual_seed(100 * rank + micro))
                chunks[index](x).square().sum().backward()
                reference[index](x).square().sum().backward()
        zero2.finish()
        zero2.reduce_pinned()
        return {"flushes": zero2.flushes, "layout": _zero2_layout(zero2, world_size),
                "accum_zero": all(not a.any() for a in zero2.accum),
                "params": _zero2_params(zero2, modules, reference, per_token, world_size)}


def _zero2_layout(zero2, dp: int) -> list[dict]:
    return [{"buffers": len(chunk.buffers),
             "buckets": [len(s.buckets) for s in chunk.buffers],
             "slices_cover": all(s.shard.numel() * dp == s.numel for s in chunk.buffers)}
            for chunk in zero2.chunks]


def _zero2_params(zero2, modules, reference, per_token: bool, dp: int) -> dict:
    """Per parameter: its buffer range, this rank's pieces of it, and the gradient ZeRO2 holds
    there against a plain all-reduce of the reference gradient (averaged without per-token
    loss, as megatron-core's DDP does)."""
    out = {}
    for index, (module, ref) in enumerate(zip(modules, reference)):
        for (name, param), (_, ref_param) in zip(module.named_parameters(),
                                                 ref.named_parameters()):
            want = ref_param.grad.reshape(-1).clone()
            dist.all_reduce(want)
            if not per_token:
                want /= dp
            shard, start = zero2.where[param]
            pieces = zero2.slice_pieces(param)
            out[f"{index}.{name}"] = {
                "start": start, "numel": param.numel(), "pinned": param in zero2.pinned,
                "pieces": [(lo, hi) for lo, hi, _ in pieces],
                "got": [shard.shard[at:at + hi - lo].clone() for lo, hi, at in pieces],
                "slice_of": [zero2.slice_of(param, lo, hi).clone() for lo, hi, _ in pieces],
                "want": [want[lo - start:hi - start] for lo, hi, _ in pieces]}
    return out


@pytest.mark.parametrize("per_token", [True, False], ids=["per_token_loss", "averaged"])
def test_zero2_slices_equal_a_plain_all_reduce(per_token):
    dp = 2
    results = run_ranks(dp, _zero2_rank, per_token)
    for rank, got in enumerate(results):
        # Two chunks alternating twice: each group's end and the step's end reduce-scatter.
        assert got["flushes"] == 4, got["flushes"]
        assert got["accum_zero"], "accumulation buffers must be zeroed after their reduction"
        assert got["layout"][0]["buffers"] == 1 and got["layout"][0]["buckets"][0] > 1
        assert got["layout"][1]["buffers"] == 2  # dense + expert
        assert all(chunk["slices_cover"] for chunk in got["layout"])
        for name, param in got["params"].items():
            for lo_hi, mine, via_slice_of, want in zip(param["pieces"], param["got"],
                                                       param["slice_of"], param["want"]):
                torch.testing.assert_close(mine, want, atol=ATOL, rtol=1e-6,
                                           msg=f"rank {rank} {name} {lo_hi}")
                assert torch.equal(via_slice_of, mine), (rank, name, lo_hi)
    assert any(p["pinned"] for p in results[0]["params"].values()) == per_token
    # The ranks' slices partition every parameter: each element on exactly one rank.
    for name, param in results[0]["params"].items():
        pieces = sorted(piece for got in results for piece in got["params"][name]["pieces"])
        cursor = param["start"]
        for lo, hi in pieces:
            assert lo == cursor, (name, pieces)
            cursor = hi
        assert cursor == param["start"] + param["numel"], (name, pieces)


# ------------------------------------------------------------------------ distributed Muon

MUON_WIDTHS = [24, 30, 18, 24]  # three matrices and their biases, crossing the DP slices
UNEVEN = [3, 0, 5, 1]  # all_gather_uneven payload sizes by rank (one rank sends nothing)


def _muon_rank(rank: int, world_size: int) -> dict:
    with model_parallel():  # DP = world_size
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                   calculate_per_token_loss=True)
        torch.manual_seed(0)
        ddp = DistributedDataParallel(
            config=config, module=_Stage(config, MUON_WIDTHS, False),
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                     use_distributed_optimizer=True))
        layouts = {id(p): MatrixLayout(name, p.dim() == 2)
                   for name, p in ddp.module.named_parameters()}
        slots = matrix_slots(ddp.buffers, layouts, world_size)
        assign_owners(slots, world_size)
        plans = gather_plans(ddp.buffers, slots, world_size)

        # The parameter all-gather of distributed Muon (``redistribute``): each rank holds only
        # its plan's segments of the buffer (the rest NaN) and gathers the others' by the plan.
        truth = torch.arange(ddp.buffers[0].numel, dtype=torch.float32) + 1
        data = torch.full_like(truth, float("nan"))
        meter = CommMeter()
        for plan in plans:
            mine = [truth[lo:hi] for lo, hi in plan.segments[rank]]
            data[torch.cat([torch.arange(lo, hi) for lo, hi in plan.segments[rank]])] = \
                torch.cat(mine)
            sizes = [plan.numel(r) for r in range(world_size)]
            with meter.measure():
                parts = all_gather_uneven(torch.cat(mine), sizes, dist.group.WORLD)
            for source, part in enumerate(parts):
                for lo, hi in plan.segments[source]:
                    data[lo:hi] = part[:hi - lo]
                    part = part[hi - lo:]

        sizes = UNEVEN[:world_size]
        payload = torch.full((sizes[rank],), float(rank))
        return {
            "slots": [(s.start, s.end, s.owner, s.cost, sorted(s.pieces.items())) for s in slots],
            "buckets": [(b.offset, b.grad_data.numel()) for b in ddp.buffers[0].buckets],
            "segments": [plan.segments for plan in plans],
            "gathered": data, "truth": truth,
            "gather_bytes": meter.bytes,
            "own_plan_numel": sum(plan.numel(rank) for plan in plans),
            "uneven": all_gather_uneven(payload, sizes, dist.group.WORLD)}


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_distributed_muon_owners_plans_and_uneven_all_gather(dp):
    results = run_ranks(dp, _muon_rank)
    first = results[0]
    # Owners are decided on every rank independently: they must agree.
    assert all(got["slots"] == first["slots"] for got in results)
    assert len(first["slots"]) == 3 and any(len(pieces) > 1 for *_, pieces in first["slots"])
    loads = [0.0] * dp
    for start, end, owner, cost, pieces in first["slots"]:
        assert 0 <= owner < dp
        loads[owner] += cost
        # The slice pieces tile the matrix.
        assert pieces[0][1][0] == start and pieces[-1][1][1] == end
        assert all(a[1][1] == b[1][0] for a, b in itertools.pairwise(pieces)), pieces
    costs = [cost for *_, cost, _ in first["slots"]]
    assert max(loads) <= sum(costs) / dp + max(costs)  # longest-processing-time bound
    # Per bucket the ranks' segments cover it exactly once (no element twice, none lost).
    for (offset, numel), segments in zip(first["buckets"], first["segments"]):
        covered = sorted(seg for rank_segments in segments for seg in rank_segments)
        cursor = offset
        for lo, hi in covered:
            assert lo == cursor, covered
            cursor = hi
        assert cursor == offset + numel
    for rank, got in enumerate(results):
        assert torch.equal(got["gathered"], got["truth"]), f"rank {rank}: gather by plan"
        # No padding: a rank sends its own part to each of the dp - 1 others (fp32).
        assert got["gather_bytes"] == (dp - 1) * got["own_plan_numel"] * 4, (
            f"rank {rank}: all_gather_uneven sent {got['gather_bytes']} bytes, not (dp - 1) x "
            f"its {got['own_plan_numel']} fp32 elements")
        assert [part.tolist() for part in got["uneven"]] == [
            [float(r)] * n for r, n in enumerate(UNEVEN[:dp])]


# ------------------------------------------------------ the MoE all-to-all on gloo (EP ranks)

# Rows each rank sends to each rank (SPLITS[src][dst]); one pair sends nothing.
SPLITS = [[1, 3], [2, 0]]


def _moe_all_to_all_rank(rank: int, world_size: int) -> dict:
    """megatron-core's MoE token all-to-all (``mappings.all_to_all``, as its alltoall dispatcher
    calls it: CPU tensors as split sizes), forward and backward, through the device layer's
    view of ``torch`` in that file (gloo's binding takes the sizes only as lists)."""
    view = mcore_compat.VIEWS["megatron.core.tensor_parallel.mappings"]
    before = view.redirected
    send = SPLITS[rank]
    receive = [SPLITS[src][rank] for src in range(world_size)]
    rows = torch.cat([torch.full((n, 2), 10.0 * rank + dst) for dst, n in enumerate(send)])
    rows.requires_grad_(True)
    out = mappings.all_to_all(dist.group.WORLD, rows, torch.tensor(receive), torch.tensor(send))
    (out * (rank + 1)).sum().backward()  # each row's gradient: its receiver's rank + 1
    try:  # what the view exists for: the binding itself refuses tensor split sizes
        dist.all_to_all_single(torch.empty(sum(receive), 2), rows.detach(),
                               torch.tensor(receive), torch.tensor(send))
        refused = False
    except TypeError:
        refused = True
    return {"out": out.detach(), "grad": rows.grad, "converted": view.redirected - before,
            "plain_binding_refuses_tensors": refused}


def test_moe_all_to_all_with_tensor_split_sizes_on_gloo():
    results = run_ranks(2, _moe_all_to_all_rank)
    for rank, got in enumerate(results):
        expected = torch.cat([torch.full((SPLITS[src][rank], 2), 10.0 * src + rank)
                              for src in range(2)])
        assert torch.equal(got["out"], expected), (rank, got["out"])
        grad = torch.cat([torch.full((n, 2), dst + 1.0) for dst, n in enumerate(SPLITS[rank])])
        assert torch.equal(got["grad"], grad), (rank, got["grad"])
        assert got["converted"] == 2  # forward and backward each went through the view
        assert got["plain_binding_refuses_tensors"], (
            "torch's all_to_all_single now takes tensor split sizes on gloo: the mappings view "
            "in parallel/mcore_compat.py may be stale")


# ------------------------------------------- MLA's replicated down projection, TP2 without SP

LATENT, ROPE, HIDDEN, TOKENS = 4, 2, 3, 5


def _mla_rope_grad_rank(rank: int, world_size: int) -> torch.Tensor:
    """The key-value down projection's weight gradient on this TP rank, for the same input and
    weight everywhere and a rank-dependent output gradient (``_mla_out_grad``)."""
    with model_parallel(tensor_model_parallel_size=world_size):
        config = MLATransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=world_size,
            kv_lora_rank=LATENT, qk_pos_emb_head_dim=ROPE,
            tensor_model_parallel_size=world_size, sequence_parallel=False,
            use_cpu_initialization=True)
        proj = MLADownProjection(HIDDEN, LATENT + ROPE, config=config,
                                 init_method=torch.nn.init.zeros_,
                                 tp_comm_buffer_name="kv_down_proj",
                                 tp_group=parallel_state.get_tensor_model_parallel_group())
        with torch.no_grad():
            proj.weight.copy_(_mla_weight())
        out, _ = proj(_mla_input())
        (out * _mla_out_grad(rank)).sum().backward()
        return proj.weight.grad


def _mla_input() -> torch.Tensor:
    return torch.arange(TOKENS * HIDDEN, dtype=torch.float32).reshape(TOKENS, HIDDEN) / 7


def _mla_weight() -> torch.Tensor:
    return torch.ones(LATENT + ROPE, HIDDEN)


def _mla_out_grad(rank: int) -> torch.Tensor:
    return torch.full((TOKENS, LATENT + ROPE), rank + 1.0)


def test_mla_down_projection_sums_the_rope_key_gradient_over_tp():
    # torch.cat's backward hands the RoPE slice a non-contiguous gradient: megatron-core's
    # copy_to_tensor_model_parallel_region returned it unreduced (the TP2-without-SP bug).
    world = 2
    results = run_ranks(world, _mla_rope_grad_rank)
    x = _mla_input()
    rope_total = sum(_mla_out_grad(r)[:, LATENT:] for r in range(world)).T @ x
    for rank, grad in enumerate(results):
        own_latent = _mla_out_grad(rank)[:, :LATENT].T @ x
        torch.testing.assert_close(grad[:LATENT], own_latent, atol=ATOL, rtol=0)
        torch.testing.assert_close(grad[LATENT:], rope_total, atol=ATOL, rtol=0)
