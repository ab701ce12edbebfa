"""The planner's step-time model (glm5_train/plan/step_time.py): each collective priced at the
links it crosses, the parts of every rank's step adding up to the step, overlap hiding only
what it can, MFU from the model's FLOPs, and tools/plan_step_time.py's output and errors."""

from __future__ import annotations

import dataclasses

import pytest

from glm5_train.job_config import compose_job
from glm5_train.phase_times import ModelRate
from glm5_train.plan import inputs_from_job, job_plan
from glm5_train.plan.elementwise import sparse_attention_bytes
from glm5_train.plan.step_time import (
    ClusterSpec,
    Link,
    Overlaps,
    collective_seconds,
    device_peak_tflops,
    load_cluster,
    model_flops_per_step,
    newton_schulz_flops,
    predict_step_time,
)
from tests.parity import run_script
from tools import plan_step_time

# A cluster whose figures make hand arithmetic easy: 1 TFLOP/s, 100 GB/s inside a node,
# 10 GB/s between nodes, no latency.
EASY = ClusterSpec("easy", "test device", peak_tflops=2.0, compute_tflops=1.0, memory_gbs=1000.0,
                   gpus_per_node=4, intra_node=Link(100.0, 0.0), inter_node=Link(10.0, 0.0))


def test_a_collective_inside_one_node_runs_at_the_intra_node_rate():
    assert collective_seconds("all_gather", 1e9, 4, 1, EASY) == pytest.approx(0.01)


def test_a_group_with_one_rank_per_node_runs_at_the_inter_node_rate():
    # stride 4 = gpus_per_node: every member on its own node
    assert collective_seconds("reduce_scatter", 1e9, 4, 4, EASY) == pytest.approx(0.1)


def test_a_reduce_scatter_and_an_all_reduce_go_at_their_own_rates_where_the_spec_gives_them():
    """gloo runs a reduce-scatter as an all-reduce of the whole input: a measured spec gives
    each op its rate; the others, and a spec without them, go at the all-gather's."""
    own = dataclasses.replace(EASY, intra_node=Link(100.0, 0.0, reduce_scatter_gbs=50.0,
                                                    all_reduce_gbs=200.0))
    assert collective_seconds("reduce_scatter", 1e9, 4, 1, own) == pytest.approx(0.02)
    assert collective_seconds("all_reduce", 1e9, 4, 1, own) == pytest.approx(0.005)
    assert collective_seconds("all_gather", 1e9, 4, 1, own) == pytest.approx(0.01)
    assert collective_seconds("all_to_all", 3e9, 4, 1, own) == pytest.approx(0.03)
    assert collective_seconds("reduce_scatter", 1e9, 4, 1, EASY) == pytest.approx(0.01)


def test_an_all_to_all_over_two_nodes_sends_the_other_nodes_rows_across():
    # 8 ranks, 4 per node: of the 7 rows a rank sends, 3 stay inside and 4 cross.
    seconds = collective_seconds("all_to_all", 7e9, 8, 1, EASY)
    assert seconds == pytest.approx(3e9 / 100e9 + 4e9 / 10e9)


def test_a_ring_over_two_nodes_crosses_on_its_share_of_links():
    # 8 ranks in a ring over 2 nodes: 2 of its 8 links cross (level_bytes' per-rank average).
    seconds = collective_seconds("all_gather", 8e9, 8, 1, EASY)
    assert seconds == pytest.approx(6e9 / 100e9 + 2e9 / 10e9)


def test_newton_schulz_flops_follow_the_smaller_side():
    assert newton_schulz_flops(2, 8) == newton_schulz_flops(8, 2) == 5 * (4 * 4 * 8 + 2 * 8)


def _tiny(*overrides: str):
    return compose_job(["model=glm5_tiny", "train=tiny", *overrides])


def test_one_process_step_is_its_compute_comm_and_optimizer():
    """One rank, no pipeline: no bubble, and compute is the planner's FLOPs at the rate, and
    its memory work at the memory rate."""
    job = _tiny("parallel=single")
    result = predict_step_time(job, 1, EASY)
    (rank,) = result.ranks
    assert rank.bubble == pytest.approx(0.0, abs=1e-12)
    assert sum(rank.comm.values()) == 0.0
    assert rank.total == pytest.approx(result.step_seconds)
    inputs = inputs_from_job(job, 1)
    from_plan = result.model_flops  # without recompute (tiny runs none): the executed FLOPs
    # and, on this CPU plan, the sparse attention's and the element-wise bytes at the memory
    # rate (the batched matmuls at the compute rate: EASY has no batched rate of its own)
    assert rank.compute == pytest.approx(from_plan / 1e12 + _memory_bytes(job) / 1e12)
    assert result.tflops_per_gpu == pytest.approx(from_plan / result.step_seconds / 1e12)
    assert result.mfu == pytest.approx(result.tflops_per_gpu / EASY.peak_tflops)
    assert inputs.num_microbatches >= 1


@pytest.mark.parametrize("parallel", ["pp2_vpp2", "tp2_pp2_vpp2_ep2_dp2"])
def test_every_ranks_parts_add_up_to_the_step(parallel):
    job = _tiny(f"parallel={parallel}")
    dp = job.parallel.data_parallel_size or (2 if parallel.endswith("dp2") else 1)
    result = predict_step_time(job, dp, EASY)
    assert len(result.ranks) == 2
    for rank in result.ranks:
        assert rank.total == pytest.approx(result.step_seconds)
        assert rank.bubble >= -1e-12
        assert rank.compute > 0
    busiest = result.busiest()
    assert busiest.bubble == min(r.bubble for r in result.ranks)
    if "tp2" in parallel:
        assert busiest.comm["tensor_parallel"] > 0 and busiest.comm["expert_all_to_all"] > 0
    assert busiest.comm["pipeline"] > 0


def _streamed(job, dp: int = 1, **changes) -> tuple[int, int]:
    """(bytes, FLOPs) of the memory-bound kernels in one micro-batch, over every stage."""
    stages = job_plan(job, dp, **changes).stages
    return (sum(s.costs.streamed_bytes_per_microbatch for s in stages),
            sum(s.costs.streamed_flops_per_microbatch for s in stages))


def _memory_bytes(job, dp: int = 1) -> int:
    """Bytes per step the step-time model prices at the memory rate during the micro-batches
    (the sparse attention's torch path and the element-wise work), over every stage."""
    stages = job_plan(job, dp).stages
    return inputs_from_job(job, dp).num_microbatches * sum(
        s.costs.streamed_bytes_per_microbatch + s.costs.elementwise_bytes_per_microbatch
        for s in stages)


def test_the_sparse_attentions_torch_path_is_priced_at_the_batched_matmul_and_memory_rates():
    """Its matmuls are one small product per query (on this CPU about a third of a square
    matmul's rate), its gathers and element-wise work bound by memory: the step prices them
    on top of the other FLOPs, each at its rate."""
    job = _tiny("parallel=single", "train.seq_length=256")
    cfg, inputs = job.model, inputs_from_job(job, 1)
    assert cfg.index_topk < 256  # the sparse stage runs the absorbed path
    applications = cfg.num_hidden_layers + job.model.mtp_num_steps
    forward, backward = sparse_attention_bytes(cfg, inputs)
    streamed, flops = _streamed(job)
    assert streamed == applications * (forward + backward) and flops > 0
    # The picked rows are shared by every head and the indexer is replicated: TP splits only
    # the per-head work. All-gather CP splits the queries: everything halves.
    tp2 = _streamed(_tiny("parallel=tp2", "train.seq_length=256"))[0]
    assert streamed / 2 < tp2 < streamed
    cp2 = _streamed(_tiny("parallel=single", "parallel.context_parallel_size=2",
                          "train.seq_length=256"))[0]
    assert cp2 == pytest.approx(streamed / 2, rel=1e-3)
    # A GPU plan runs the Triton kernels, priced by their FLOPs until they are measured.
    assert _streamed(job, fused_attention=True) == (0, 0)
    mb = inputs.num_microbatches
    fast = predict_step_time(job, 1, EASY).ranks[0].compute
    slow_memory = predict_step_time(job, 1, dataclasses.replace(EASY, memory_gbs=1.0))
    assert slow_memory.ranks[0].compute - fast == pytest.approx(
        _memory_bytes(job) * (1 / 1e9 - 1 / 1e12))
    slow_batched = predict_step_time(job, 1, dataclasses.replace(EASY,
                                                                 batched_matmul_tflops=0.1))
    assert slow_batched.ranks[0].compute - fast == pytest.approx(mb * flops * (1 / 1e11 - 1 / 1e12))


@pytest.mark.parametrize("extra, applications", [
    ((), lambda layers, steps, f, b: (f + b) * (layers + steps)),
    # the core attention's forward once more, in its backward, in every layer
    (("activations.recompute_granularity=selective", "activations.recompute_modules=[core_attn]"),
     lambda layers, steps, f, b: (2 * f + b) * (layers + steps)),
    # full uniform: every decoder layer and MTP step forward once more
    (("activations.recompute_granularity=full", "activations.recompute_method=uniform",
      "activations.recompute_num_layers=1"), lambda layers, steps, f, b: (2 * f + b) * (
        layers + steps)),
    # full block of 1 layer: that layer only (megatron-core skips the MTP steps)
    (("activations.recompute_granularity=full", "activations.recompute_method=block",
      "activations.recompute_num_layers=1"), lambda layers, steps, f, b: (f + b) * (
        layers + steps) + f),
    # no MTP loss: the steps do not run
    (("model.mtp_loss_weight=0",), lambda layers, steps, f, b: (f + b) * layers),
])
def test_the_sparse_attentions_bytes_follow_recompute_and_the_mtp_steps(extra, applications):
    job = _tiny("parallel=single", "train.seq_length=256", *extra)
    cfg = job.model
    forward, backward = sparse_attention_bytes(cfg, inputs_from_job(job, 1))
    streamed, flops = _streamed(job)
    assert streamed == applications(cfg.num_hidden_layers, cfg.mtp_num_steps, forward, backward)
    assert flops > 0


def test_recompute_costs_compute_but_not_model_flops():
    plain = predict_step_time(_tiny("parallel=single"), 1, EASY)
    redone = predict_step_time(_tiny("parallel=single", "activations.recompute_granularity=full",
                                     "activations.recompute_method=uniform",
                                     "activations.recompute_num_layers=1"), 1, EASY)
    assert redone.model_flops == pytest.approx(plain.model_flops)
    assert redone.ranks[0].compute > plain.ranks[0].compute


def test_overlapped_gradient_reduction_hides_behind_the_last_backward():
    """DP2 over two nodes with a slow link: the reduction is exposed whole without overlap.
    With it, one bucket still waits for the backward's end (megatron-core sends a bucket
    once all its gradients exist); with 4 buckets (parallel.ddp_bucket_size) the first 3
    leave during the backward."""
    slow = dataclasses.replace(EASY, gpus_per_node=1, inter_node=Link(0.05, 0.0))
    job = _tiny("parallel=single", "parallel.data_parallel_size=2")
    off = predict_step_time(job, 2, slow, Overlaps())
    exposed_off = off.ranks[0].comm["grad_reduction"]
    one_bucket = predict_step_time(job, 2, slow, Overlaps(grad_reduce=True))
    assert exposed_off > 0
    assert one_bucket.ranks[0].comm["grad_reduction"] == pytest.approx(exposed_off)
    params = sum(s.costs.dense_params for s in plan_stages(job))
    job = _tiny("parallel=single", "parallel.data_parallel_size=2",
                f"parallel.ddp_bucket_size={-(-params // 4)}")
    on = predict_step_time(job, 2, slow, Overlaps(grad_reduce=True))
    exposed_on = on.ranks[0].comm["grad_reduction"]
    assert exposed_off / 4 <= exposed_on < exposed_off
    assert on.hidden["grad_reduction"] == pytest.approx(exposed_off - exposed_on)
    assert on.step_seconds < off.step_seconds


def test_overlapped_parameter_gather_exposes_the_first_bucket_only_when_compute_covers_the_rest():
    """The distributed optimizer over DP2 on a slow link, 4 buckets: without overlap the whole
    gather follows the optimizer; with it, the first forward waits for the first bucket, and
    for the rest as far as its compute does not cover them."""
    slow = dataclasses.replace(EASY, gpus_per_node=1, inter_node=Link(0.05, 0.0))
    base = ["parallel=single", "parallel.data_parallel_size=2",
            "parallel.use_distributed_optimizer=true"]
    params = sum(s.costs.dense_params for s in plan_stages(_tiny(*base)))
    job = _tiny(*base, f"parallel.ddp_bucket_size={-(-params // 4)}")
    off = predict_step_time(job, 2, slow, Overlaps())
    on = predict_step_time(job, 2, slow, Overlaps(grad_reduce=True, param_gather=True))
    whole = off.ranks[0].comm["param_gather"]
    exposed = on.ranks[0].comm["param_gather"]
    assert whole > 0 and whole / 4 <= exposed < whole
    assert on.hidden["param_gather"] == pytest.approx(whole - exposed)


def plan_stages(job):
    return job_plan(job, 2).stages


def test_expert_overlap_hides_the_all_to_all_up_to_the_compute():
    job = _tiny("parallel=ep2")
    off = predict_step_time(job, 2, EASY, Overlaps())
    on = predict_step_time(job, 2, EASY, Overlaps(expert_all_to_all=True))
    assert off.ranks[0].comm["expert_all_to_all"] > 0
    assert on.ranks[0].comm["expert_all_to_all"] == pytest.approx(max(
        0.0, off.ranks[0].comm["expert_all_to_all"] - off.ranks[0].compute), abs=1e-12)


def test_the_presets_load_and_a_bad_cluster_is_named():
    h100 = load_cluster("h100")
    assert (h100.gpus_per_node, h100.peak_tflops) == (8, 989.4)
    assert load_cluster("h200").memory_gbs > h100.memory_gbs
    with pytest.raises(ValueError, match="presets: .*h100"):
        load_cluster("tpu9")


def test_the_tool_prints_the_breakdown_and_its_last_line(capsys):
    assert plan_step_time.main(["+experiment=glm5_sft_202k"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    fields = dict(item.split("=") for item in lines[-1].split())
    assert set(fields) == {"step_s", "tflops_per_gpu", "mfu", "gpus", "overlap"}
    assert fields["gpus"] == "256" and fields["overlap"] == "none"
    assert float(fields["step_s"]) > 0 and 0 < float(fields["mfu"]) < 1
    assert any(line.startswith("busiest rank") for line in lines)


@pytest.mark.parametrize("argv, message", [
    (["--overlap", "grad_reduce,nccl_magic"], "nccl_magic: unknown; choose from"),
    (["--cluster", "tpu9"], "cluster 'tpu9': no such preset"),
])
def test_the_tool_refuses_bad_input_in_one_line(capsys, argv, message):
    assert plan_step_time.main(["+experiment=glm5_sft_202k", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_throughput_per_step_scales_with_the_ramp_and_gives_mfu_where_the_peak_is_known():
    rate = ModelRate(flops_per_step=8e15, global_batch=8, devices=4, peak_tflops=1000.0)
    assert rate.fields(2.0) == {"tflops_per_gpu": 1000.0, "mfu": 1.0}
    assert rate.fields(2.0, global_batch_now=4) == {"tflops_per_gpu": 500.0, "mfu": 0.5}
    assert ModelRate(8e15, 8, 4, None).fields(2.0) == {"tflops_per_gpu": 1000.0}
    assert device_peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert device_peak_tflops("NVIDIA H200") == 989.4
    assert device_peak_tflops("NVIDIA H100 PCIe") is None  # a lower peak: no MFU, not a wrong one
    assert device_peak_tflops("NVIDIA A10G") is None


def test_model_flops_per_step_count_every_rank_without_recompute():
    """The same global batch on one process and on TP2 x PP2: the same model FLOPs (the TP
    split and the stages add up), and recompute adds none."""
    one = model_flops_per_step(_tiny("parallel=single"))
    assert model_flops_per_step(_tiny("parallel=tp2_pp2")) == pytest.approx(one, rel=1e-3)
    redone = _tiny("parallel=single", "activations.recompute_granularity=full",
                   "activations.recompute_method=uniform", "activations.recompute_num_layers=1")
    assert model_flops_per_step(redone) == one


def test_a_measured_cluster_spec_loads_and_prices_a_plan(tmp_path):
    """tools/calibrate_cluster.py on 2 gloo ranks of this machine (small sizes): rank 0 writes
    a spec with every key the step-time model reads, positive rates, one node's link for both
    levels, timed as a synchronized job (the CPU default), and the model prices a plan on
    it."""
    out = tmp_path / "cpu.yaml"
    proc = run_script(2, "tools/calibrate_cluster.py", ["--out", str(out), "--matmul-size",
                                                        "128", "--message-mib", "1",
                                                        "--repeats", "3", "--seconds", "0.3"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    spec = load_cluster(str(out))
    assert spec.gpus_per_node == 2 and spec.device == "CPU"
    assert spec.compute_tflops > 0 and spec.memory_gbs > 0
    link = spec.intra_node
    assert link.gbs > 0 and link.latency_us > 0
    assert link.reduce_scatter_gbs > 0 and link.all_reduce_gbs > 0  # each op measured
    assert spec.inter_node == spec.intra_node and "one node" in spec.note
    assert "synchronized job: 50 ms chunks" in spec.note
    assert predict_step_time(_tiny("parallel=pp2"), 1, spec).step_seconds > 0


def test_the_calibration_times_each_ranks_median_call_when_asked(tmp_path):
    """``--sync-ms 0`` (the GPU default): each rank's median call averaged over the ranks,
    said in the spec's note."""
    out = tmp_path / "median.yaml"
    proc = run_script(2, "tools/calibrate_cluster.py", ["--out", str(out), "--matmul-size",
                                                        "128", "--message-mib", "1",
                                                        "--repeats", "3", "--seconds", "0.2",
                                                        "--sync-ms", "0"])
    assert proc.returncode == 0, proc.stdout[-3000:]
    spec = load_cluster(str(out))
    assert spec.compute_tflops > 0 and spec.memory_gbs > 0 and spec.batched_matmul_tflops > 0
    assert "each rank's median call, averaged over the ranks" in spec.note
