"""The GPU check (bench/gpu/gpu_check.py) as a CPU dry run: every part's code at tiny shapes
(Triton's interpreter for the kernel, gloo for the job), its JSON's schema, and what each part
found; the figures only a GPU has are listed as not measured, never made up.

One dry run per session (a fresh process: ``TRITON_INTERPRET=1`` must be set before triton is
first imported), ~40-55 s on this 2-core machine, most of it the job's start-up; the budget
logic (a part that does not fit is skipped and says so) runs in-process.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "gpu", "gpu_check.py")
PARTS = ["env", "kernel_parity", "activation_offload", "host_optimizer", "cuda_job",
         "dsa_vs_dense", "stack_mfu", "calibrate"]
PART_KEYS = {"status", "seconds", "covers", "result", "not_measured", "problems", "cap_s"}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    done = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--budget-s", "900", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    return report, done


def test_every_part_ran_ok_in_priority_order_with_the_schema(dry_run):
    report, done = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["schema"] == "gpu_check/1" and report["dry_run"] is True
    assert report["order"] == PARTS == list(report["parts"])
    assert report["summary"] == {"ok": len(PARTS), "failed": 0, "skipped": 0}
    for name, part in report["parts"].items():
        assert PART_KEYS <= set(part), name
        assert part["status"] == "ok" and part["problems"] == [], (name, part)
        assert part["covers"] and isinstance(part["result"], dict), name
    # Nothing CUDA-only is reported as if it had been measured on CPU.
    assert report["parts"]["env"]["result"]["cuda_available"] is False
    assert "device_name" in report["parts"]["env"]["not_measured"]
    assert report["parts"]["env"]["result"]["te_specs"].startswith("unverified")


def test_kernel_parity_at_context_parallel_rows_in_bf16(dry_run):
    part = dry_run[0]["parts"]["kernel_parity"]
    result = part["result"]
    assert result["dtype"] == "bfloat16" and result["interpreted"] is True
    assert result["skipped"] == [] and len(result["cases"]) == 4
    for case in result["cases"]:
        assert case["T"] < case["S"]  # a CP rank's rows against every key row
        for form in ("errors_masked", "errors_positions"):
            assert set(case[form]) == {"out", "probs", "dq", "dkv"}
            assert max(case[form].values()) <= result["tolerance"], (case["case"], form)
    assert any(case["rows_short_of_k"] for case in result["cases"])  # rows before position K
    assert "timings" in part["not_measured"]
    assert "kernel_fwd_s" not in result["cases"][0]


def test_offload_and_host_optimizer_move_bytes_and_keep_the_losses(dry_run):
    parts = dry_run[0]["parts"]
    offload = parts["activation_offload"]["result"]
    moved = offload["runs"]["with"]
    assert moved["offloaded_bytes"] == moved["reloaded_bytes"] > 0
    assert offload["runs"]["without"]["offloaded_bytes"] == 0
    assert offload["loss_max_rel_diff"] == 0.0 and offload["grad_norm_max_rel_diff"] == 0.0
    assert offload["saved_peak_ratio"] < 0.5  # 4 micro-batches in flight, 1 resident
    assert "device_peak_ratio" in parts["activation_offload"]["not_measured"]
    host = parts["host_optimizer"]["result"]
    assert host["runs"]["host"]["host_bytes"] >= 16 * host["parameters"]
    assert host["loss_max_rel_diff"] <= 1e-5 and host["overlap_loss_max_rel_diff"] <= 1e-5
    assert host["runs"]["host_overlap"]["host_bytes"] >= 16 * host["parameters"]
    assert "device_peak_ratio" in parts["host_optimizer"]["not_measured"]


def test_the_job_ran_profiled_with_its_optimizer_state_on_the_host(dry_run):
    part = dry_run[0]["parts"]["cuda_job"]
    run = part["result"]["runs"]["adamw_host"]
    assert run["rc"] == 0 and run["steps"] == [1]
    assert run["optimizer_state_bytes"] == [0] and run["optimizer_host_bytes"][0] > 0
    counts = run["trace_event_counts"]
    assert counts["by_category"]["user_annotation"] > 0
    assert counts["memory_by_device_type"].get("0")  # CPU allocator events (1: CUDA)
    assert run["plan_problems"] == []  # the planner's bytes match the measured ones
    assert "muon_host" in part["not_measured"]


def test_attention_and_stack_parts_measured_what_they_could(dry_run):
    parts = dry_run[0]["parts"]
    attention = parts["dsa_vs_dense"]["result"]["attention"]
    assert [run["seq"] for run in attention] == [128] and attention[0]["dsa_layer_has_kl"]
    stack = parts["stack_mfu"]["result"]["stack"]
    assert stack[0]["tokens_per_s"] > 0 and stack[0]["mfu"] is None  # no GPU peak on CPU
    assert "mfu" in parts["stack_mfu"]["not_measured"]


def test_a_part_that_does_not_fit_the_budget_is_skipped_and_says_so(tmp_path, monkeypatch):
    """In-process, env then stack_mfu with a 3 s budget: env runs, stack_mfu (needs 40 s)
    is recorded as skipped with the reason, and the exit status stays 0."""
    monkeypatch.syspath_prepend(os.path.dirname(SCRIPT))
    gpu_check = importlib.import_module("gpu_check")
    out = tmp_path / "check.json"
    rc = gpu_check.main(["--dry-run", "--parts", "env", "stack_mfu", "--budget-s", "3",
                         "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["order"] == ["env", "stack_mfu"]
    assert report["parts"]["env"]["status"] == "ok"
    skipped = report["parts"]["stack_mfu"]
    assert skipped["status"] == "skipped" and "needs at least 40 s" in skipped["reason"]
    assert report["summary"] == {"ok": 1, "failed": 0, "skipped": 1}


def test_the_calibration_wrote_a_spec_on_the_device(dry_run):
    """tools/calibrate_cluster.py in one process (fp32 on this CPU; bf16 and cuda_names on a
    GPU): positive rates, the bf16 figure left unmeasured on CPU."""
    part = dry_run[0]["parts"]["calibrate"]
    assert part["result"]["compute_tflops"] > 0 and part["result"]["memory_gbs"] > 0
    assert part["result"]["batched_matmul_tflops"] > 0
    assert part["result"]["compute_tflops_synchronized"] > 0  # the --sync-ms path ran
    assert part["result"]["device"] == "CPU" and "compute_tflops (bf16)" in part["not_measured"]
    # the step-time model's compute term priced for the stack stack_mfu measured (its planner
    # FLOPs at the spec's rate), one row per measured length; CPU figures, so not GPU ones
    stack = dry_run[0]["parts"]["stack_mfu"]["result"]["stack"]
    rows = part["result"]["stack_vs_model"]
    assert [r["seq"] for r in rows] == [r["seq"] for r in stack] and rows
    for row, run in zip(rows, stack):
        assert row["measured_s"] == run["step_s"] and row["model_flops"] > 0
        assert row["ratio"] == row["predicted_s"] / row["measured_s"] > 0
    assert "stack_vs_model (GPU figures)" in part["not_measured"]
    assert "step-time model vs stack seq" in dry_run[1].stdout
