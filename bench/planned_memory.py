"""The planner's prediction for a training job, and the measured figures to set beside it
(shared by bench/long_context.py and bench/activation_memory.py).

The prediction is ``glm5_train.plan.plan_report`` on the job's own config (composed
from the same overrides the run gets) and the stages it runs: its resolved pipeline layout
(given, or balanced for the MTP placement), else megatron-core's even split. On CPU SDPA runs
its math path: ``inputs_from_job`` plans it there (``fused_attention`` from the device).
"""

from __future__ import annotations

import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from job import run_training

from glm5_train.job_config import compose_job
from glm5_train.plan import PlanReport, inputs_from_job, job_pipeline, plan_report


def planned(overrides: list[str], world: int) -> PlanReport:
    """The planner's report (per pipeline rank: ``peak_activation_bytes``, ``offloaded_bytes``,
    ``static_bytes``) for the job ``overrides`` describe on ``world`` processes."""
    job = compose_job(list(overrides))
    par = job.parallel
    dp = world // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size
                   * par.context_parallel_size)
    layout = job_pipeline(job, dp)
    return plan_report(job.model, layout, inputs_from_job(job, dp), job.activations)


def measured_field(record: dict, name: str, label: str) -> list[int]:
    """A per-rank list from a metrics.jsonl record, or a one-line exit naming what is missing."""
    if name not in record:
        raise SystemExit(f"{label}: metrics.jsonl has no {name!r} (fields: {sorted(record)}); "
                         "the tree lacks the feature that writes it (glm5_train/metrics.py)")
    return record[name]


def step_seconds(records: list[dict], tokens_per_step: int) -> float:
    """Mean step time from the metrics' tokens/s, step 1 (warm-up) left out when there are more."""
    timed = records[1:] if len(records) > 1 else records
    return sum(tokens_per_step / r["tokens_per_s"] for r in timed) / len(timed)


def run_job(nproc: int, overrides: list[str], run_dir: str, label: str) -> tuple[list[dict], float]:
    """``bench/job.py``'s run_training, timed (wall seconds of the whole torchrun)."""
    started = time.monotonic()
    records = run_training(nproc, overrides, run_dir, label)
    if not records:
        raise SystemExit(f"{label} run wrote no metrics.jsonl records ({run_dir})")
    return records, time.monotonic() - started


def relative_error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}" if measured else "n/a"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
