"""The planner beside a finished run: per rank, planned and measured parameter, gradient,
optimizer-state and saved-activation bytes (and context-parallel bytes sent), from the run's
own ``metrics.jsonl`` and the job its ``hydra/overrides.yaml`` composes:

    python tools/plan_vs_measured.py outputs/<run> [--step N]

Measured: ``param_bytes``, ``grad_buffer_bytes``, ``optimizer_state_bytes``,
``saved_bytes_peak`` (the peak of bytes saved for backward, from saved-tensor hooks) and the
bytes sent on context-parallel groups (``comm_by_op``), of step N (default: the last logged).
Planned: ``glm5_train.pipeline_plan`` for the same layout (pipeline rank = global rank //
(world / PP), megatron-core's default order); Pipeline ZeRO2's gradients as its slices plus
two accumulation buffers; with frozen parameters (dense warm-up) parameters and activations
only. The last line gives the largest relative difference per field:
``max_rel param=<x> grad=<x> optimizer=<x> activations=<x>``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from glm5_train.job_config import compose_job
from glm5_train.pipeline_plan import inputs_from_job, job_pipeline, plan_report
from glm5_train.run_dir import run_overrides

FIELDS = (("param", "param_bytes", "param_bytes"), ("grad", "grad_buffer_bytes", "grad_bytes"),
          ("optimizer", "optimizer_state_bytes", "optimizer_bytes"))


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
    world = len(record["param_bytes"])
    par = job.parallel
    pp = par.pipeline_model_parallel_size
    dp = world // par.model_parallel_size
    report = plan_report(job.model, job_pipeline(job, dp), inputs_from_job(job, dp),
                         job.activations)

    def stage_sum(rank: int, field: str) -> int:
        return sum(getattr(s.costs, field) for s in report.stages if s.rank == rank)

    lines = [f"{'rank':>4} {'field':>12} {'planned':>14} {'measured':>14} {'rel':>9}"]
    # Frozen parameters (the dense warm-up trains the indexer only) have no gradient or
    # optimizer state; the planner counts the whole model's: compared where nothing is frozen.
    frozen = job.dsa.stage == "dense_warmup" or job.dsa.freeze_indexer
    fields = FIELDS[:1] if frozen else FIELDS
    worst = {name: 0.0 for name, *_ in fields} | {"activations": 0.0}
    for g in range(world):
        p = g // (world // pp)
        rows = [(name, stage_sum(p, planned), record[measured][g])
                for name, measured, planned in fields]
        if par.pipeline_zero2 and not frozen:  # its slices + two accumulation buffers
            accum = 2 * max(s.costs.accum_grad_bytes for s in report.stages if s.rank == p)
            rows[1] = ("grad", stage_sum(p, "grad_bytes") + accum,
                       record["zero2_slice_bytes"][g] + record["zero2_accum_bytes"][g])
        rows.append(("activations", report.ranks[p].peak_activation_bytes,
                     record["saved_bytes_peak"][g]))
        for name, planned, measured in rows:
            rel = abs(measured - planned) / planned if planned else float(measured != 0)
            worst[name] = max(worst[name], rel)
            lines.append(f"{g:>4} {name:>12} {planned:>14,} {measured:>14,} {rel:>9.2%}")
    return lines, worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--step", type=int)
    args = parser.parse_args(argv)
    lines, worst = compare(args.run_dir, args.step)
    print("\n".join(lines))
    print("max_rel " + " ".join(f"{k}={v:.4f}" for k, v in worst.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
