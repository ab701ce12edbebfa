"""The planner beside a finished run: per rank, planned and measured parameter, gradient,
optimizer-state and saved-activation bytes, from the run's own ``metrics.jsonl`` and the job
its ``hydra/overrides.yaml`` composes:

    python tools/plan_vs_measured.py outputs/<run> [--step N]

Measured and planned as ``glm5_train.plan.check`` pairs them (the parity harness checks
the same pairs on every layout it runs), of step N (default: the last logged): parameters,
gradients (Pipeline ZeRO2: its slices plus its accumulation buffers), optimizer state (AdamW)
and the peak of bytes saved for backward; with frozen parameters (dense warm-up) parameters
and activations only; then the bytes sent per step where the planner models them (gradient
reduction, parameter all-gather, pipeline sends, tensor- and expert-tensor-parallel
exchanges, the expert all-to-all and the bytes handed to it). The last line gives the largest relative difference per field:
``max_rel param=<x> grad=<x> optimizer=<x> activations=<x> ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from glm5_train.job_config import compose_job
from glm5_train.plan import check as plan_check
from glm5_train.run_dir import run_overrides


# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  python tools/plan_vs_measured.py outputs/<run>
  python tools/plan_vs_measured.py outputs/<run> --step 4
"""


def step_record(run_dir: str, step: int | None) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    logged = [r for r in records if "param_bytes" in r and (step is None or r["step"] == step)]
    if not logged:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no logged step {step or ''}")
    return logged[-1]


def compare(run_dir: str, step: int | None = None) -> tuple[list[str], dict[str, float]]:
    """(table lines, largest relative difference per field)."""
    job = compose_job(run_overrides(run_dir))
    record = step_record(run_dir, step)
    rows = plan_check.comparison_rows(job, record)
    lines = [f"{'rank':>4} {'field':>25} {'planned':>14} {'measured':>14} {'rel':>9}"]
    lines += [f"{r.rank:>4} {r.field:>25} {r.planned:>14,} {r.measured:>14,} {r.rel:>9.2%}"
              for r in rows]
    return lines, plan_check.worst_by_field(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--step", type=int)
    args = parser.parse_args(argv)
    lines, worst = compare(args.run_dir, args.step)
    print("\n".join(lines))
    print("max_rel " + " ".join(f"{k}={v:.4f}" for k, v in worst.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
