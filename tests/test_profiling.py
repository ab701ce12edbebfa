"""Traces on demand (``train.profile_steps``, glm5_train/profiling.py), their merge
(tools/merge_traces.py) and pictures (tools/draw_timeline.py): a PP2 x VPP2 run traced for one
step writes one trace per rank, each with a forward and a backward range per (model chunk,
micro-batch) the schedule ran and its collectives by purpose and group; the merged trace holds every
rank in its own lane; the timeline and memory pictures are drawn from it. Tracing does not
change the run. The planner's replay has the textbook pipeline bubble."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from glm5_train.job_config import compose_job
from parallel.comm_purpose import parse_range
from parallel.pipeline_layout import PipelineSchedule, bubble_fraction, replay_times
from tests.parity import REPO, run_job

PP2_VPP2 = ["parallel=pp2_vpp2", "train.train_iters=2"]  # 4 micro-batches per step, 2 chunks


def test_a_traced_step_has_every_forward_backward_and_collective(tmp_path):
    traced = run_job(2, [*PP2_VPP2, "train.profile_steps=[2,2]", "train.profile_memory=true"],
                     str(tmp_path / "traced"))
    plain = run_job(2, PP2_VPP2, str(tmp_path / "plain"))
    assert [r["loss"] for r in traced.records] == [r["loss"] for r in plain.records]
    profile = tmp_path / "traced" / "profile"
    names = {}
    for rank in (0, 1):
        with open(profile / f"rank{rank:05d}.json") as handle:
            events = json.load(handle)["traceEvents"]
        names[rank] = [e["name"] for e in events if e.get("ph") == "X"]
        for kind in ("forward", "backward"):
            ranges = {n for n in names[rank] if n.startswith(f"{kind} chunk")}
            assert ranges == {f"{kind} chunk {c} micro-batch {m}" for c in (0, 1)
                              for m in range(4)}, (rank, kind, sorted(ranges))
    # ranges named by purpose and megatron-core's group (parallel/comm_purpose.py): the
    # pipeline's messages (pp, and at PP=2 one direction on the global group: still pp), the
    # token count broadcast from the last stage and all-reduced over DP x CP, the gradient
    # all-reduce of each chunk (dp_cp, 1 rank here), the gradient norm (mp: at PP2 on 2 ranks
    # the model-parallel group is the pipeline's two ranks), the step's loss
    collectives = {n for n in names[0] if parse_range(n)}
    assert {"pp_send pp.isend:2", "pp_recv pp.irecv:2", "pp_recv world.irecv:2",
            "pp_token_count pp.broadcast:2", "dp_token_count dp_cp.all_reduce:1",
            "dp_grad_all_reduce dp_cp.all_reduce:1", "mp_grad_norm mp.all_reduce:2",
            "world_loss world.all_reduce:2"} <= collectives, sorted(collectives)
    # metrics.jsonl's collectives by purpose (timed every step) name what the trace names
    step2 = traced.records[1]["comm_by_purpose"]
    assert {p for p, parts in step2.items() if parts["calls"][0]} == {
        parse_range(n)["purpose"] for n in collectives}, sorted(step2)
    # the pipeline's waits for the other stage are timed (measured: 28-31% of the step on the
    # waiting rank), not only the receives' issue
    step_ms = traced.records[1]["step_time_ms"]
    assert max(step2["pp_recv"]["ms"]) > 0.05 * max(step_ms), (step2["pp_recv"], step_ms)
    out = subprocess.run([sys.executable, "tools/merge_traces.py", str(profile)], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert "rank 0: 8 forward, 8 backward" in out and "merged 2 ranks" in out
    assert re.search(r"collectives by purpose: .*pp_send [\d.]+ ms x24", out), out
    with open(profile / "merged.json") as handle:
        merged = json.load(handle)["traceEvents"]
    lanes = {e["args"]["name"] for e in merged if e.get("name") == "process_name"}
    assert lanes == {"rank 0", "rank 1"}
    assert {e["pid"] for e in merged} == {0, 1}
    planned = subprocess.run([sys.executable, "tools/plan_vs_measured.py",
                              str(tmp_path / "plain"), "--cluster", "h100"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
    # the step-time model beside the run's last step, by part (the pipeline's sends and
    # waits measured from comm_by_purpose), and its summary line
    assert re.search(r"step 2, busiest rank, ms measured/predicted on \S+: .*pp\+wait \d+/",
                     planned), planned
    summary = re.search(r"step_time measured=([\d.]+) predicted=([\d.]+) ratio=", planned)
    assert summary, planned
    assert float(summary[1]) == pytest.approx(plain.records[-1]["step_time_s"], abs=1e-4)
    assert float(summary[2]) > 0
    worst = dict(kv.split("=") for kv in planned.strip().splitlines()[-1].split()[1:])
    assert float(worst["param"]) == 0 and float(worst["activations"]) < 0.05, planned
    assert float(worst["p2p"]) == 0, planned  # the pipeline's sends, byte for byte
    pytest.importorskip("matplotlib")
    out = subprocess.run([sys.executable, "tools/draw_timeline.py", str(tmp_path / "traced"),
                          "--memory"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    assert re.search(r"bubbles: measured 0\.\d+, planned 0\.\d+", out), out
    assert "drew 2 traced ranks on one time scale (2 with their optimizer step)" in out, out
    peaks = [float(p) for p in re.findall(r"peak ([\d.]+) MiB allocated during the step", out)]
    assert len(peaks) == 2 and all(p > 1 for p in peaks), out  # activations held, per rank
    for picture in ("timeline.png", "memory.png"):
        assert (profile / picture).stat().st_size > 10_000


@pytest.mark.parametrize("pp,vpp,micro", [(2, None, 4), (4, None, 8), (2, 2, 4), (4, 2, 8)])
def test_replayed_schedule_has_the_textbook_bubble(pp, vpp, micro):
    """Equal stages, backward 2 x forward: makespan (m + (p - 1) / v) (F + B) and bubble share
    (p - 1) / (v m + p - 1), megatron-core's 1F1B and interleaved 1F1B."""
    timed = replay_times(PipelineSchedule(pp, vpp, micro), [1.0] * (pp * (vpp or 1)))
    v = vpp or 1
    assert max(t.end for ops in timed.values() for t in ops) == pytest.approx(
        (v * micro + pp - 1) * 3.0)
    assert bubble_fraction(timed) == pytest.approx((pp - 1) / (v * micro + pp - 1))
    for ops in timed.values():  # every (chunk, micro-batch) forwarded and backwarded once
        assert sorted((t.op, t.chunk, t.micro_batch) for t in ops) == sorted(
            (op, c, m) for op in "BF" for c in range(v) for m in range(micro))


@pytest.mark.parametrize("steps", ["[0,1]", "[2,1]", "[1,9]", "[3]"])
def test_bad_profile_steps_are_refused(steps):
    with pytest.raises(ValueError, match="train.profile_steps="):
        compose_job(["model=glm5_tiny", "parallel=single", "train.train_iters=4",
                     "train.warmup_iters=0",
                     f"train.profile_steps={steps}"])


def test_merging_an_empty_directory_says_how_to_make_traces(tmp_path):
    os.makedirs(tmp_path / "profile")
    proc = subprocess.run([sys.executable, "tools/merge_traces.py", str(tmp_path / "profile")],
                          cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "train.profile_steps=[first,last]" in proc.stderr


def test_profile_ranks_and_warmup_trace_only_the_chosen_ranks_and_steps(tmp_path):
    """train.profile_ranks=[1]: rank 1 alone writes a trace; train.profile_warmup=1: step 1
    runs under the profiler and is discarded, so the trace holds step 2's micro-batches only
    (PP2 x VPP2: 4 micro-batches of 2 chunks a step)."""
    run_job(2, [*PP2_VPP2, "train.profile_steps=[2,2]", "train.profile_ranks=[1]",
                "train.profile_warmup=1"], str(tmp_path))
    profile = tmp_path / "profile"
    assert sorted(os.listdir(profile)) == ["rank00001.json"]
    with open(profile / "rank00001.json") as handle:
        names = [e["name"] for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]
    forwards = [n for n in names if n.startswith("forward chunk")]
    assert sorted(forwards) == sorted(f"forward chunk {c} micro-batch {m}" for c in (0, 1)
                                      for m in range(4)), forwards


@pytest.mark.parametrize("overrides,message", [
    (["train.profile_steps=[1,2]", "train.profile_warmup=1"], "must lie in \\[0, 0\\]"),
    (["train.profile_steps=[2,2]", "train.profile_ranks=[]"], "give a list of global ranks"),
])
def test_bad_profile_options_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        compose_job(["train.train_iters=2", *overrides])


def _spans_and_calls(profile, rank: int, spans: str, calls: str) -> tuple[list[dict], list[dict]]:
    """The traced step's ranges named ``<spans> chunk ...`` (forward, backward) and its
    collective ranges matching ``calls``, each in time order."""
    with open(profile / f"rank{rank:05d}.json") as handle:
        events = [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]
    def in_time_order(kept):
        return sorted(kept, key=lambda e: e["ts"])

    return (in_time_order(e for e in events if e["name"].startswith(f"{spans} chunk")),
            in_time_order(e for e in events if re.match(calls, e["name"])))


def _backward_and_dp_ranges(profile, rank: int) -> tuple[list[dict], list[dict]]:
    """Backward ranges and the gradient reductions over megatron-core's ``dp_cp`` group."""
    return _spans_and_calls(profile, rank, "backward", r"dp_grad_(all_reduce|reduce_scatter) "
                            r"dp_cp\.(all_reduce|reduce_scatter_tensor):2$")


def _forward_and_gather_ranges(profile, rank: int) -> tuple[list[dict], list[dict]]:
    """Forward ranges and the distributed optimizer's parameter all-gathers (``dp_cp``)."""
    return _spans_and_calls(profile, rank, "forward",
                            r"dp_param_all_gather dp_cp\.all_gather_into_tensor:2$")


def test_overlapped_reduction_and_gather_run_inside_compute(tmp_path):
    """The distributed optimizer over DP2 with 20K-parameter buckets, traced at step 2. With
    parallel.overlap_grad_reduce, gradient reductions are issued while the step's last backward
    still runs (megatron-core starts a bucket when autograd has filled it); with
    parallel.overlap_param_gather, the parameter all-gathers are issued inside the step's first
    forward, bucket after bucket as the modules needing them run. Without either, every
    reduction starts after the last backward and no gather runs inside any forward (all in the
    optimizer step)."""
    base = ["parallel=single", "train.train_iters=2", "train.profile_steps=[2,2]",
            "parallel.use_distributed_optimizer=true", "parallel.ddp_bucket_size=20000"]
    run_job(2, [*base, "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"],
            str(tmp_path / "overlap"))
    run_job(2, base, str(tmp_path / "plain"))
    backward, dp = _backward_and_dp_ranges(tmp_path / "overlap" / "profile", 0)
    last = backward[-1]
    assert len(dp) > 1 and [e for e in dp if last["ts"] <= e["ts"] < last["ts"] + last["dur"]]
    forward, gathers = _forward_and_gather_ranges(tmp_path / "overlap" / "profile", 0)
    first = forward[0]
    assert len([e for e in gathers if first["ts"] <= e["ts"] < first["ts"] + first["dur"]]) > 1
    backward, dp = _backward_and_dp_ranges(tmp_path / "plain" / "profile", 0)
    last = backward[-1]
    assert dp and all(e["ts"] >= last["ts"] + last["dur"] for e in dp), (last, dp)
    forward, gathers = _forward_and_gather_ranges(tmp_path / "plain" / "profile", 0)
    assert gathers  # one bucket without the overlapped reduction
    assert not [e for e in gathers for f in forward if f["ts"] <= e["ts"] < f["ts"] + f["dur"]]
