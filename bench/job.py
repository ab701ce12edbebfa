"""Run the real training job from a benchmark and read its metrics (shared by bench/ scripts)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def run_training(nproc: int, overrides: list[str], run_dir: str, label: str) -> list[dict]:
    """``torchrun -m glm5_train.train`` with ``overrides`` in ``run_dir``; its metrics.jsonl
    records. Exits with the job's log tail when it fails."""
    from launch.local import torchrun_command

    cmd = torchrun_command(nproc, [*overrides, f"hydra.run.dir={run_dir}"])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        log = proc.stdout + proc.stderr
        raise SystemExit(f"{label} run failed (exit {proc.returncode}){root_cause(log)}:\n"
                         f"{log[-4000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def root_cause(log: str) -> str:
    """The job's own error line, else the first rank's exception line: the tail of a torchrun
    log is its failure summary and the other ranks' "connection closed" errors."""
    lines = log.splitlines()
    for line in lines:
        if line.startswith("glm5_train: error:"):
            return f": {line}"
    for line in lines:
        text = re.sub(r"^\[rank\d+\]: ", "", line)
        if (re.match(r"[\w.]*(Error|Exception)\b", text) and "Connection closed" not in text
                and "ChildFailedError" not in text):
            return f": {line.strip()}"
    if "SIGKILL" in log:
        return ": a rank was killed (SIGKILL; out of memory?)"
    return ""
