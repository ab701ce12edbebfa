"""Parity harness: run the real training job in a layout and compare it with one process.

``run_job`` launches ``torchrun -m glm5_train.train`` exactly as a user would (same Hydra
overrides, same entry point), reads the run's ``metrics.jsonl`` and returns its step records.
``compare`` checks per-step loss and grad norm against a reference run.

Initial weights depend only on (seed, global tensor name), see ``glm5_train/model/init_weights.py``,
and the data order depends only on the global batch index, so any layout must reproduce the
single-process run up to floating-point reduction order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small and fast: 5 optimizer steps of 4 sequences of 64 tokens on the tiny GLM-5.
BASE_OVERRIDES = (
    "model=glm5_tiny",
    "train.train_iters=5",
    "train.warmup_iters=1",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.seq_length=64",
    "checkpoint.save=null",
)

# fp32 on CPU: layouts differ only in summation order (TP partial sums, DP/EP gradient
# reductions, the loss-token all-reduce). Over 5 AdamW steps that drifts by ~1e-6 relative;
# 1e-4 relative on the loss leaves margin while any real bug (a wrong shard, a dropped layer,
# a missing gradient reduction) moves the loss by >1e-2 within 2 steps.
LOSS_RTOL = 1e-4
GRAD_NORM_RTOL = 1e-3


def MTP_KEYS(rtol: float, record: dict) -> list[tuple[str, float]]:
    """The per-step MTP losses a record carries (mtp_loss, mtp_loss_1, ...)."""
    return [(key, rtol) for key in sorted(record) if key.startswith("mtp_loss")]


@dataclass
class JobResult:
    records: list[dict]
    log: str


def run_job(nprocs: int, overrides: list[str], run_dir: str, timeout: int = 600) -> JobResult:
    """Launch the training job with torchrun; return its metrics.jsonl records."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nprocs}", "-m", "glm5_train.train",
           *BASE_OVERRIDES, *overrides, f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"job failed ({proc.returncode}): {' '.join(cmd)}\n{log[-6000:]}")
    return JobResult(read_metrics(run_dir), log)


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def compare(reference: list[dict], candidate: list[dict], loss_rtol: float = LOSS_RTOL,
            grad_rtol: float = GRAD_NORM_RTOL) -> list[str]:
    """Per-step differences beyond tolerance, as readable lines (empty: parity holds)."""
    problems = []
    if len(reference) != len(candidate):
        problems.append(f"step count {len(candidate)} != reference {len(reference)}")
    for ref, got in zip(reference, candidate):
        for key, rtol in (("loss", loss_rtol), ("grad_norm", grad_rtol),
                          ("indexer_kl", grad_rtol), *MTP_KEYS(loss_rtol, ref)):
            if key not in ref and key not in got:
                continue
            if key not in got or key not in ref:
                problems.append(f"step {ref['step']}: {key} reported by only one run")
            elif abs(got[key] - ref[key]) > rtol * abs(ref[key]):
                problems.append(f"step {ref['step']} {key}: {got[key]!r} vs {ref[key]!r} "
                                f"(rel {abs(got[key] - ref[key]) / abs(ref[key]):.2e} > {rtol})")
    return problems
