"""The planner beside a finished run: per rank, planned and measured parameter, gradient,
optimizer-state and saved-activation bytes, from the run's own ``metrics.jsonl`` and the job
its ``hydra/overrides.yaml`` composes:

    python tools/plan_vs_measured.py outputs/<run> [--step N] [--cluster h100|<spec.yaml>]

Measured and planned as ``glm5_train.plan.check`` pairs them (the parity harness checks
the same pairs on every layout it runs), of step N (default: the last logged): parameters,
gradients (Pipeline ZeRO2: its slices plus its accumulation buffers), optimizer state (AdamW)
and the peak of bytes saved for backward; with frozen parameters (dense warm-up) parameters
and activations only; then the bytes sent per step where the planner models them (gradient
reduction, parameter all-gather, pipeline sends, tensor- and expert-tensor-parallel
exchanges, the expert all-to-all and the bytes handed to it). The last line gives the largest relative difference per field:
``max_rel param=<x> grad=<x> optimizer=<x> activations=<x> ...``.

With ``--cluster`` (a preset of configs/cluster/ or a spec file, e.g. one
tools/calibrate_cluster.py measured on the run's machines) also the step-time model
(glm5_train/plan/step_time.py) beside the step: the busiest rank's milliseconds by part,
measured (metrics.jsonl's ``comm_by_purpose``: the time each collective held the rank) and
predicted, then ``step_time measured=<s> predicted=<s> ratio=<predicted / measured>``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from glm5_train.job_config import JobConfig, compose_job
from glm5_train.plan import check as plan_check
from glm5_train.plan.step_time import (
    ClusterSpec,
    load_cluster,
    measured_split,
    predict_step_time,
    predicted_split,
    split_text,
)
from glm5_train.run_dir import run_overrides


# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  python tools/plan_vs_measured.py outputs/<run>
  python tools/plan_vs_measured.py outputs/<run> --step 4
  python tools/plan_vs_measured.py outputs/<run> --cluster h100
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


def step_time_lines(job: JobConfig, record: dict, cluster: ClusterSpec) -> list[str]:
    """The step-time model beside the logged step: its parts, then the summary line."""
    if "comm_by_purpose" not in record:
        raise SystemExit("metrics.jsonl has no comm_by_purpose at this step: rerun with "
                         "train.log_comm_by_purpose=true to compare step times")
    world = len(record["step_time_ms"])
    predicted = predict_step_time(job, world // job.parallel.world_size_needed(1), cluster)
    measured_s = record["step_time_s"]
    return [f"step {record['step']}, busiest rank, ms measured/predicted on {cluster.name}: "
            + split_text(measured_split(record), predicted_split(predicted)),
            f"step_time measured={measured_s:.4f} predicted={predicted.step_seconds:.4f} "
            f"ratio={predicted.step_seconds / measured_s:.4f}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--step", type=int)
    parser.add_argument("--cluster", help="also the step-time model on this cluster spec (a "
                        "configs/cluster/ preset or a spec file)")
    args = parser.parse_args(argv)
    try:
        cluster = load_cluster(args.cluster) if args.cluster else None
    except ValueError as err:  # an unknown preset or a bad spec file: its message, one line
        raise SystemExit(f"plan_vs_measured: --cluster {args.cluster}: {err}") from None
    lines, worst = compare(args.run_dir, args.step)
    if cluster is not None:
        lines += step_time_lines(compose_job(run_overrides(args.run_dir)),
                                 step_record(args.run_dir, args.step), cluster)
    print("\n".join(lines))
    print("max_rel " + " ".join(f"{k}={v:.4f}" for k, v in worst.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
