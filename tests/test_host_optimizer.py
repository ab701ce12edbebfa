"""Optimizer state in host memory (``parallel.optimizer_cpu_offload``, parallel/host_optimizer.py):
the same training as with the state on the device, the bytes really held on the host, and its
checkpoints resumed by a run that keeps the state on the device.

On this CPU-only machine the "host" copies are separate tensors: every step copies each
offloaded gradient over, steps AdamW (torch's fused CPU kernel) there and copies the updated
parameters back, as on a GPU. Offloaded and device-resident runs differ only in the AdamW
kernel (torch's fused one against its single-tensor one): measured 2.4e-8 relative on the
step-3 loss, inside the parity tolerances (FP32).
"""

from __future__ import annotations

import pytest

from glm5_train.assembly import validate_job
from glm5_train.job_config import compose_job
from parallel.layout import LayoutError, validate_layout
from tests.parity import (
    BASE_OVERRIDES,
    BF16,
    FP32,
    assert_layout_ran,
    compare,
    one_process,
    run_job,
)

OFFLOAD = "parallel.optimizer_cpu_offload=true"
DISTRIBUTED = "parallel.use_distributed_optimizer=true"
PP2_VPP2_DP2 = ["parallel=pp2_vpp2", "parallel.data_parallel_size=2", DISTRIBUTED]
# Host bytes per parameter element: its fp32 copy, its gradient there, exp_avg, exp_avg_sq.
HOST_BYTES_PER_ELEMENT = 16


def _elements(record: dict, rank: int) -> int:
    return record["param_bytes"][rank] // 4  # fp32 parameters


def test_one_process_offloaded_matches_device_state_and_holds_it_on_the_host(tmp_path):
    reference = one_process(["parallel=single"]).records
    result = run_job(1, ["parallel=single", OFFLOAD], str(tmp_path / "offloaded"))
    problems = compare(reference, result.records, FP32)
    assert not problems, "\n".join(problems)
    assert_layout_ran(result, 1, ["parallel=single", OFFLOAD])
    record = result.records[-1]
    host, device = record["optimizer_host_bytes"][0], record["optimizer_state_bytes"][0]
    # Everything on the host: 16 bytes per element plus a 4-byte step counter per tensor.
    assert device == 0
    assert 0 <= host - HOST_BYTES_PER_ELEMENT * _elements(record, 0) < 4096


def test_half_offloaded_splits_the_state(tmp_path):
    """optimizer_offload_fraction=0.5: the first parameters (half of the elements, rounded up
    to a whole parameter) step on the host, the others keep 8 bytes per element on the
    device."""
    run = run_job(1, ["parallel=single", OFFLOAD, "parallel.optimizer_offload_fraction=0.5",
                      "train.train_iters=1"], str(tmp_path / "half"))
    record = run.records[-1]
    elements = _elements(record, 0)
    on_host = (record["optimizer_host_bytes"][0] // HOST_BYTES_PER_ELEMENT)
    on_device = record["optimizer_state_bytes"][0] // 8
    assert elements // 2 <= on_host < elements
    assert abs(on_host + on_device - elements) < 2048  # step counters aside


@pytest.fixture(scope="module")
def offloaded_pp2_vpp2_dp2(tmp_path_factory):
    """PP2 x VPP2 x DP2 with the distributed optimizer and its state on the host: 5 steps,
    saving at step 2 (and 4)."""
    root = tmp_path_factory.mktemp("offloaded")
    overrides = [*PP2_VPP2_DP2, OFFLOAD, "checkpoint.save_interval=2",
                 "checkpoint.keep_last=null", f"checkpoint.save={root / 'ckpt'}"]
    return run_job(4, overrides, str(root / "run")), overrides, root / "ckpt"


def test_pp2_vpp2_dp2_distributed_offloaded_matches_one_process(offloaded_pp2_vpp2_dp2):
    result, overrides, _ = offloaded_pp2_vpp2_dp2
    problems = compare(one_process(["parallel=single"]).records, result.records, FP32)
    assert not problems, "\n".join(problems)
    assert_layout_ran(result, 4, overrides)  # incl. the planner's device and host bytes
    record = result.records[-1]
    assert record["optimizer_state_bytes"] == [0] * 4
    assert all(b > 0 for b in record["optimizer_host_bytes"])


def test_offloaded_checkpoint_resumes_resharded_with_the_state_on_the_device(
        offloaded_pp2_vpp2_dp2, tmp_path):
    """The PP2 x VPP2 x DP2 offloaded checkpoint into one process, state on the device."""
    result, _, ckpt = offloaded_pp2_vpp2_dp2
    (ckpt / "latest_iteration.txt").write_text("2\n")
    resume = ["parallel=single", DISTRIBUTED, f"checkpoint.load={ckpt}"]
    resumed = run_job(1, resume, str(tmp_path / "resumed"))
    assert [r["step"] for r in resumed.records] == [3, 4, 5]
    problems = compare(result.records[2:], resumed.records, FP32)
    assert not problems, "\n".join(problems)
    assert "optimizer_host_bytes" not in resumed.records[-1]
    assert all(b > 0 for b in resumed.records[-1]["optimizer_state_bytes"])


@pytest.mark.parametrize("overrides,message", [
    ([OFFLOAD, "parallel.optimizer_offload_fraction=1.5"], "must lie in [0, 1]"),
    ([OFFLOAD, "parallel.optimizer_offload_fraction=-0.1"], "must lie in [0, 1]"),
])
def test_bad_offload_settings_are_refused_by_the_layout_check(overrides, message):
    job = compose_job([*BASE_OVERRIDES, "parallel=single", *overrides])
    with pytest.raises(LayoutError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_layout(job.parallel, job.model, 1, job.train.global_batch_size,
                        job.train.micro_batch_size, job.train.seq_length)


@pytest.mark.parametrize("settings,message", [
    (["train.params_dtype=bf16"],
     "parallel.optimizer_cpu_offload=true with train.params_dtype=bf16 needs"),
    (["train.optimizer=muon", "parallel.optimizer_offload_fraction=0.5"],
     "parallel.optimizer_offload_fraction=0.5 with train.optimizer=muon"),
    (["train.optimizer=muon", "parallel.overlap_cpu_optimizer_d2h_h2d=true"],
     "parallel.overlap_cpu_optimizer_d2h_h2d=true with train.optimizer=muon"),
])
def test_unsupported_offload_combinations_are_refused_in_one_line(settings, message):
    """bf16 AdamW without the distributed optimizer (megatron-core's fp32 masters would stay
    on the device, and its non-distributed bf16 optimizer breaks the hybrid one); Muon with a
    partial offload or megatron-core's side-stream copies."""
    job = compose_job([*BASE_OVERRIDES, "parallel=single", OFFLOAD, *settings])
    with pytest.raises(ValueError) as failed:
        validate_job(job)  # the check a launch runs before any work (one line on rank 0)
    assert message in str(failed.value)


BF16_DISTRIBUTED = ["parallel=single", DISTRIBUTED, "train.params_dtype=bf16"]


def test_bf16_offloaded_keeps_masters_on_the_host_and_resumes_on_the_device(tmp_path):
    """bf16 parameters (megatron-core's precision-aware path): no fp32 master on the device,
    16 bytes per element on the host (master, gradient, moments); the same training as with
    the state on the device (BF16 tolerances: the host's fused AdamW and the device's
    single-tensor one differ in the masters' last bits, which flip some bf16 roundings;
    measured 2.7e-4 on the step-4 loss, 3.2e-3 on its gradient norm); its step-2 checkpoint
    resumed with the state on the device."""
    reference = run_job(1, BF16_DISTRIBUTED, str(tmp_path / "reference")).records
    ckpt = tmp_path / "ckpt"
    overrides = [*BF16_DISTRIBUTED, OFFLOAD, "checkpoint.save_interval=2",
                 "checkpoint.keep_last=null", f"checkpoint.save={ckpt}"]
    result = run_job(1, overrides, str(tmp_path / "offloaded"))
    offloaded = result.records
    problems = compare(reference, offloaded, BF16)
    assert not problems, "\n".join(problems)
    assert_layout_ran(result, 1, overrides)  # incl. the planner's host bytes for bf16
    record, elements = offloaded[-1], offloaded[-1]["param_bytes"][0] // 2  # bf16
    assert reference[-1]["optimizer_state_bytes"][0] >= 12 * elements  # master + moments
    assert record["optimizer_state_bytes"] == [0]
    assert 0 <= record["optimizer_host_bytes"][0] - HOST_BYTES_PER_ELEMENT * elements < 4096
    (ckpt / "latest_iteration.txt").write_text("2\n")
    resumed = run_job(1, [*BF16_DISTRIBUTED, f"checkpoint.load={ckpt}"],
                      str(tmp_path / "resumed")).records
    assert [r["step"] for r in resumed] == [3, 4, 5]
    problems = compare(offloaded[2:], resumed, BF16)
    assert not problems, "\n".join(problems)


def test_overlapped_copies_match_device_state(tmp_path):
    """parallel.overlap_cpu_optimizer_d2h_h2d: one CPU optimizer per parameter, each waiting
    only for its own gradient copy (side streams on CUDA, in-order stand-ins here)."""
    overrides = ["parallel=single", OFFLOAD, "parallel.overlap_cpu_optimizer_d2h_h2d=true"]
    result = run_job(1, overrides, str(tmp_path / "overlapped"))
    problems = compare(one_process(["parallel=single"]).records, result.records, FP32)
    assert not problems, "\n".join(problems)
    assert_layout_ran(result, 1, overrides)
    assert result.records[-1]["optimizer_state_bytes"] == [0]


def test_bf16_pipeline_zero2_offloaded_matches_one_process(tmp_path):
    """Pipeline ZeRO2 hands the host optimizer its gradient slices (as ``decoupled_grad`` on
    the bf16 slices of megatron-core's precision-aware path): PP2 x VPP2 x DP2, bf16, all the
    state on the host, against one process on the device (BF16 tolerances)."""
    overrides = [*PP2_VPP2_DP2, "parallel.pipeline_zero2=true", OFFLOAD, "train.params_dtype=bf16"]
    result = run_job(4, overrides, str(tmp_path / "zero2"))
    reference = one_process(["parallel=single", "train.params_dtype=bf16"]).records
    problems = compare(reference, result.records, BF16)
    assert not problems, "\n".join(problems)
    assert_layout_ran(result, 4, overrides)  # ZeRO2's slices, the planner's host bytes
    record = result.records[-1]
    assert record["optimizer_state_bytes"] == [0] * 4
    assert all(b > 0 for b in record["zero2_slice_bytes"])


MUON = ["train.optimizer=muon"]


def test_muon_adamw_part_offloaded_matches_and_holds_its_moments_on_the_host(tmp_path):
    """Muon's AdamW part in host memory, 1 process: the same arithmetic on host copies, so the
    training is identical (FP32); the device keeps only Muon's momentum."""
    reference = run_job(1, ["parallel=single", *MUON], str(tmp_path / "device")).records
    result = run_job(1, ["parallel=single", *MUON, OFFLOAD], str(tmp_path / "host"))
    offloaded = result.records
    problems = compare(reference, offloaded, FP32)
    assert not problems, "\n".join(problems)
    assert_layout_ran(result, 1, ["parallel=single", *MUON, OFFLOAD])
    assert [r["loss"] for r in reference] == [r["loss"] for r in offloaded]
    moved = reference[-1]["optimizer_state_bytes"][0] - offloaded[-1]["optimizer_state_bytes"][0]
    host = offloaded[-1]["optimizer_host_bytes"][0]
    assert moved > 0 and moved % 8 == 0  # both moments of every AdamW element
    assert host == 2 * moved  # plus the value and gradient copies, 4 bytes each


def test_distributed_muon_offloaded_checkpoint_resumes_on_the_device(tmp_path):
    """Distributed Muon at DP2 with its AdamW part on the host, saving at step 2; resumed with
    everything on the device it continues the offloaded run (FP32)."""
    ckpt = tmp_path / "ckpt"
    layout = ["parallel=single", DISTRIBUTED, *MUON]
    overrides = [*layout, OFFLOAD, "checkpoint.save_interval=2", "checkpoint.keep_last=null",
                 f"checkpoint.save={ckpt}"]
    result = run_job(2, overrides, str(tmp_path / "offloaded"))
    offloaded = result.records
    problems = compare(one_process(["parallel=single", *MUON]).records, offloaded, FP32)
    assert not problems, "\n".join(problems)
    assert_layout_ran(result, 2, overrides)  # DP2: distributed Muon's group sizes
    assert all(b > 0 for b in offloaded[-1]["optimizer_host_bytes"])
    (ckpt / "latest_iteration.txt").write_text("2\n")
    resumed = run_job(2, [*layout, f"checkpoint.load={ckpt}"], str(tmp_path / "resumed")).records
    assert [r["step"] for r in resumed] == [3, 4, 5]
    problems = compare(offloaded[2:], resumed, FP32)
    assert not problems, "\n".join(problems)
    assert "optimizer_host_bytes" not in resumed[-1]
