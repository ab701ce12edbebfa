"""TensorBoard scalars (glm5_train/metrics.py): the run directory's event files, read back
with TensorBoard's own reader, hold exactly metrics.jsonl's values per step, per-rank figures,
the step's wall time by phase and its collectives' time by purpose included; and neither
writing them nor timing collectives by purpose changes anything in the run."""

from __future__ import annotations

import os

import pytest

from glm5_train.job_config import compose_job
from glm5_train.plan.step_time import model_flops_per_step
from tests.parity import BASE_OVERRIDES, run_job

pytest.importorskip("tensorboard")


def _scalars(log_dir: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir)
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)}
            for tag in events.Tags()["scalars"]}


def test_tensorboard_events_equal_the_metrics_and_change_nothing(tmp_path, monkeypatch):
    overrides = ["parallel=single", "train.train_iters=3", "checkpoint.load=null"]
    result = run_job(1, overrides, str(tmp_path / "with"))
    scalars = _scalars(os.path.join(tmp_path / "with", "tensorboard"))
    for record in result.records:
        step = record["step"]
        for name in ("loss", "mtp_loss", "indexer_kl", "grad_norm", "lr", "tokens_per_s",
                     "step_time_s", "tflops_per_gpu"):
            assert scalars[f"train/{name}"][step] == pytest.approx(record[name], rel=1e-6)
        for rank in range(len(record["mem_peak_bytes"])):
            for name in ("mem_peak_bytes", "comm_bytes", "step_time_ms"):
                got = scalars[f"ranks/{name}/rank{rank}"][step]
                assert got == pytest.approx(record[name][rank], rel=1e-6)
            for phase, ranks in record["phase_ms"].items():
                got = scalars[f"phases/{phase}_ms/rank{rank}"][step]
                assert got == pytest.approx(ranks[rank], rel=1e-6)
        for purpose, parts in record["comm_by_purpose"].items():
            got = scalars[f"comm_ms/{purpose}/max"][step]
            assert got == pytest.approx(max(parts["ms"]), rel=1e-6, abs=1e-6)
            got = scalars[f"comm_ms/{purpose}/mean"][step]
            mean = sum(parts["ms"]) / len(parts["ms"])
            assert got == pytest.approx(mean, rel=1e-6, abs=1e-6)
        _check_phases(record)
        # the planner's model FLOPs per global batch over the step's wall time, one device;
        # no MFU on a CPU (no peak to divide by)
        flops = model_flops_per_step(compose_job([*BASE_OVERRIDES, *overrides]))
        assert record["tflops_per_gpu"] == pytest.approx(flops / record["step_time_s"] / 1e12,
                                                         rel=1e-4)
        assert "mfu" not in record
    monkeypatch.setenv("GLM5_TENSORBOARD", "0")
    without = run_job(1, [*overrides, "train.log_comm_by_purpose=false"],
                      str(tmp_path / "without"))
    assert not os.path.exists(tmp_path / "without" / "tensorboard")
    assert [r["loss"] for r in without.records] == [r["loss"] for r in result.records]
    assert all("comm_by_purpose" not in r for r in without.records)
    assert all(r["comm_calls"] == w["comm_calls"] for r, w in zip(result.records,
                                                                   without.records))


def _check_phases(record: dict) -> None:
    """The step's wall time by phase (glm5_train/phase_times.py): every phase ran; the
    gradient sync inside the schedule; the schedule and the optimizer step inside the step."""
    phases = record["phase_ms"]
    assert set(phases) == {"forward_backward", "grad_sync", "optimizer"}
    for rank, step_ms in enumerate(record["step_time_ms"]):
        fb, sync, opt = (phases[p][rank] for p in ("forward_backward", "grad_sync", "optimizer"))
        assert 0 < sync < fb and opt > 0, phases
        assert fb + opt <= step_ms, (phases, step_ms)
    assert record["step_time_ms"][0] == pytest.approx(1000 * record["step_time_s"], abs=1e-3)
