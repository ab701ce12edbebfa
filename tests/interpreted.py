"""Running checks under Triton's CPU interpreter from a test session that imported triton
without it: the interpreter is chosen when triton is first imported (``TRITON_INTERPRET=1``),
and this session's modules (and its fork server, tests/spawn.py) already hold triton. So the
checks run in one fresh Python process started with the variable set, which prints their
outcomes as one JSON line after a marker; ``run`` returns that dict."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def report(marker: str, outcome: dict) -> None:
    """The child's side: one report line (the parent reads the last one)."""
    print(marker + json.dumps(outcome), flush=True)


def run(code: str, args: list[str], marker: str, timeout: int) -> dict:
    """Run ``python -c code *args`` in the repository under Triton's interpreter; the outcome
    dict of its last ``marker`` line (the process must exit 0 and print one)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(marker)]
    assert proc.returncode == 0 and lines, (
        f"the interpreter-mode process failed (status {proc.returncode}):\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(marker):])
