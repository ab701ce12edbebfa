"""MTP placement: GLM-5's split against megatron-core's with-the-loss, measured on the real job.

    python bench/mtp_placement.py [--steps 6] [--seq 256]

Runs the tiny GLM-5 (MTP: 1 layer x 3 steps) on PP2 x VPP2 (2 CPU processes) twice, once per
placement, each with the layout the job balances for it, and reads from ``metrics.jsonl`` the
exact per-rank bytes of parameters, gradient buffers and optimizer state (counted from the
tensors, ``parallel/comm_meter.py``) and the bytes each rank sent. The same layouts are then costed
by the planner (``glm5_train/plan/``) to show its parameter model agrees with the
measured bytes. Time is a ratio of the two runs' median tokens/s (2 shared cores: noisy).
Last line: ``ours=<bytes> baseline=<bytes> theory=<bytes> ratio=<ours/baseline>`` for the
largest rank's static bytes (params + grads + optimizer), split (ours) vs with_loss, theory =
the planner's figure for the split.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

STATIC = ("param_bytes", "grad_buffer_bytes", "optimizer_state_bytes")


def run(placement: str, steps: int, seq: int, run_dir: str) -> tuple[list[dict], str]:
    overrides = ["model=glm5_tiny", "parallel=pp2_vpp2", f"parallel.mtp_placement={placement}",
                 f"train.train_iters={steps}", "train.warmup_iters=1",
                 "train.global_batch_size=8", f"train.seq_length={seq}", "checkpoint.save=null",
                 f"hydra.run.dir={run_dir}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "glm5_train.train", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{placement} run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    layout = next(line.split()[2] for line in proc.stdout.splitlines()
                  if line.startswith("pipeline layout:"))
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle if line.strip()], layout


def planned_static(layout: str, steps: int, seq: int) -> list[int]:
    """The planner's static bytes per pipeline rank for ``layout`` in the same job."""
    from glm5_train.plan import inputs_from_job, parse_layout, plan_report
    from glm5_train.job_config import compose_job

    job = compose_job(["model=glm5_tiny", "parallel=pp2_vpp2", "train.global_batch_size=8",
                       f"train.seq_length={seq}", f"train.train_iters={steps}"])
    par = job.parallel
    lay = parse_layout(layout, par.pipeline_model_parallel_size,
                       par.virtual_pipeline_model_parallel_size, job.model.num_hidden_layers,
                       job.model.mtp_sets)
    # fp32 training: weights 4, main grads 4, Adam m + v 8 (no separate master copy).
    inputs = inputs_from_job(job, 1, weight_bytes=4, grad_bytes=4, optimizer_bytes=8)
    return [rank.static_bytes for rank in plan_report(job.model, lay, inputs).ranks]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for placement in ("with_loss", "split"):
            records, layout = run(placement, args.steps, args.seq, os.path.join(tmp, placement))
            last = records[-1]
            static = [sum(last[k][r] for k in STATIC) for r in range(len(last["param_bytes"]))]
            speed = statistics.median(r["tokens_per_s"] for r in records[1:])
            results[placement] = (layout, static, speed, last)
    for placement, (layout, static, speed, last) in results.items():
        planned = planned_static(layout, args.steps, args.seq)
        print(f"{placement:9s} layout={layout:14s} static bytes per rank={static} "
              f"planner={planned} sent per rank={last['comm_bytes']} "
              f"median tokens/s={speed:.0f}")
    split, with_loss = results["split"], results["with_loss"]
    print(f"time ratio (split / with_loss tokens per s): {split[2] / with_loss[2]:.2f}")
    ours, baseline = max(split[1]), max(with_loss[1])
    theory = max(planned_static(split[0], args.steps, args.seq))
    print(f"ours={ours} baseline={baseline} theory={theory} ratio={ours / baseline:.4f}")


if __name__ == "__main__":
    main()
