"""Activation memory techniques on the real job: peak bytes saved for backward per rank, step
time, and the planner's prediction beside each measured figure.

    python bench/activation_memory.py [--loss-seq 8192] [--loss-vocab 154880]
        [--loss-mtp-steps N] [--loss-steps 2] [--chunk 2048] [--pp-seq 256]
        [--micro-batches 8] [--offload-micro-batches N] [--steps 3] [--budget-gib 16]

Every run is the tiny GLM-5 (``model=glm5_tiny``, fp32, DSA sparse stage with the indexer KL,
absorbed sparse attention) through ``bench/job.py`` (torchrun). Measured, from metrics.jsonl:
``saved_bytes_peak`` (the most bytes saved for backward resident at once on a rank,
parameters apart: ``parallel/activation_accounting.py``), ``offloaded_bytes`` /
``reloaded_bytes``; step time from the metrics' tokens/s (step 1, the warm-up, left out when
more steps ran). Predicted: ``glm5_train.plan.plan_report`` on the same job
config (per pipeline rank ``peak_activation_bytes`` and ``offloaded_bytes``), with the
relative error (predicted - measured) / measured. The planner does not model the working set
of a recompute unit re-run in backward, nor transient workspace.

Two groups, each timed against its own baseline (``activations.loss_chunk_tokens=0``, no
offloading, no recompute):

- loss (1 process, ``parallel=single``): ``--loss-seq`` tokens, ``model.vocab_size=
  --loss-vocab`` (GLM-5's 154,880: the [tokens, vocab] logits dominate); baseline against
  ``activations.loss_chunk_tokens=--chunk``. MTP runs as many steps (3, the model's, or
  ``--loss-mtp-steps``) as fit: the largest count whose baseline is predicted within
  ``--budget-gib`` (planner's static + saved bytes, one [tokens, vocab] fp32 logits
  transient of the backward, 0.5 GiB for the process itself); the output says when it is
  reduced.
- pipeline (2 processes, ``parallel=pp2_vpp2``, GLM-5's split MTP placement, global batch
  ``--micro-batches`` of micro-batch 1, ``--pp-seq`` tokens): baseline; offloading
  (``activations.offload_micro_batches``, default every forward of a rank: VPP x
  micro-batches); selective recompute of every module (core_attn, mla_up_proj, moe_act);
  full recompute (uniform, 1 layer per unit); all combined: chunked loss + offloading +
  selective recompute (full recompute leaves nothing to offload: the job refuses the pair).
  The headline figure is the first pipeline rank's (it holds the most micro-batches in
  flight); every rank's list is printed too.

Last line: ``ours=<all combined, first pipeline rank's peak saved bytes> baseline=<pipeline
baseline's> ratio=<ours/baseline>``.

Expected time on 2 CPU cores with the defaults: about 6-8 minutes (the loss group's two
8K-token runs with the 154,880-entry head, MTP reduced to 1 step, ~2 min each; the five
pipeline runs ~20 s each). ``--groups loss`` or ``--groups pipeline`` runs one group.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass

from planned_memory import gib, measured_field, planned, relative_error, run_job, step_seconds

MODEL = ["model=glm5_tiny", "dsa=sparse", "dsa.sparse_attention=absorbed",
         "train.params_dtype=fp32", "train.micro_batch_size=1", "train.warmup_iters=1",
         "checkpoint.save=null"]
PLAIN = ["activations.loss_chunk_tokens=0"]
SELECTIVE = ["activations.recompute_granularity=selective",
             "activations.recompute_modules=[core_attn,mla_up_proj,moe_act]"]
FULL = ["activations.recompute_granularity=full", "activations.recompute_method=uniform",
        "activations.recompute_num_layers=1"]
PROCESS_BYTES = 2**29  # interpreter, torch and the job's own buffers: ~0.5 GiB measured


@dataclass
class Result:
    group: str
    name: str
    nproc: int
    records: list[dict]
    overrides: list[str]
    tokens_per_step: int

    @property
    def last(self) -> dict:
        return self.records[-1]

    @property
    def label(self) -> str:
        return f"{self.group}/{self.name}"

    def field(self, name: str) -> list[int]:
        return measured_field(self.last, name, self.label)

    @property
    def step_s(self) -> float:
        return step_seconds(self.records, self.tokens_per_step)


# ---------------------------------------------------------------------------------- groups


def loss_group_base(args, mtp_steps: int) -> list[str]:
    return [*MODEL, "parallel=single", f"model.vocab_size={args.loss_vocab}",
            f"model.mtp_num_steps={mtp_steps}", f"train.seq_length={args.loss_seq}",
            f"model.max_position_embeddings={max(args.loss_seq, 2048)}",
            "train.global_batch_size=1", f"train.train_iters={args.loss_steps}"]


def predicted_baseline_peak(args, mtp_steps: int) -> int:
    """Peak memory the loss group's baseline is expected to need: static + saved bytes, one
    fp32 logits tensor of the backward (the softmax gradient), the process itself."""
    plan = planned([*loss_group_base(args, mtp_steps), *PLAIN], 1).ranks[0]
    return plan.total_bytes + 4 * args.loss_seq * args.loss_vocab + PROCESS_BYTES


def loss_mtp_steps(args) -> int:
    """The most MTP steps (from the requested count down) whose baseline fits the budget."""
    budget = args.budget_gib * 2**30
    for steps in range(args.loss_mtp_steps, -1, -1):
        need = predicted_baseline_peak(args, steps)
        if need <= budget:
            if steps < args.loss_mtp_steps:
                print(f"loss group: MTP steps reduced from {args.loss_mtp_steps} to {steps}: "
                      f"the baseline at {steps + 1} would need about "
                      f"{gib(predicted_baseline_peak(args, steps + 1))} > budget "
                      f"{args.budget_gib:g} GiB (predicted at {steps}: {gib(need)})")
            return steps
    raise SystemExit(f"loss group: even without MTP the baseline needs about "
                     f"{gib(predicted_baseline_peak(args, 0))} > --budget-gib "
                     f"{args.budget_gib:g}: lower --loss-seq or --loss-vocab")


def loss_group(args, tmp: str) -> list[Result]:
    steps = loss_mtp_steps(args)
    base = loss_group_base(args, steps)
    print(f"loss group: 1 process, {args.loss_seq} tokens, vocab {args.loss_vocab}, "
          f"MTP {steps} steps, {args.loss_steps} training steps", flush=True)
    configs = {"baseline": PLAIN, "chunked loss": [f"activations.loss_chunk_tokens={args.chunk}"]}
    return [run_config("loss", name, 1, [*base, *extra], args.loss_seq, tmp)
            for name, extra in configs.items()]


def pipeline_group(args, tmp: str) -> list[Result]:
    offload = args.offload_micro_batches or 2 * args.micro_batches  # VPP2: every forward
    base = [*MODEL, "parallel=pp2_vpp2", f"train.global_batch_size={args.micro_batches}",
            f"train.seq_length={args.pp_seq}", f"train.train_iters={args.steps}"]
    offloading = [f"activations.offload_micro_batches={offload}"]
    configs = {
        "baseline": PLAIN,
        "offloading": [*PLAIN, *offloading],
        "selective recompute": [*PLAIN, *SELECTIVE],
        "full recompute": [*PLAIN, *FULL],
        "all combined": [f"activations.loss_chunk_tokens={args.chunk}", *offloading,
                         *SELECTIVE],
    }
    print(f"pipeline group: 2 processes PP2 x VPP2 (MTP split), {args.micro_batches} "
          f"micro-batches of {args.pp_seq} tokens, offloading {offload} forwards per rank, "
          f"{args.steps} training steps", flush=True)
    return [run_config("pipeline", name, 2, [*base, *extra],
                       args.micro_batches * args.pp_seq, tmp) for name, extra in configs.items()]


def run_config(group: str, name: str, nproc: int, overrides: list[str], tokens: int,
               tmp: str) -> Result:
    run_dir = os.path.join(tmp, f"{group}_{name.replace(' ', '_')}")
    records, wall = run_job(nproc, overrides, run_dir, f"{group}/{name}")
    result = Result(group, name, nproc, records, overrides, tokens)
    print(f"  {result.label:30s} done in {wall:.0f} s", flush=True)
    return result


# ---------------------------------------------------------------------------------- report


def describe(result: Result, baseline: Result) -> str:
    plan = planned(result.overrides, result.nproc).ranks
    peaks = result.field("saved_bytes_peak")
    want = [r.peak_activation_bytes for r in plan]
    errors = ", ".join(relative_error(p, m) for p, m in zip(want, peaks))
    line = (f"{result.label:30s} saved_bytes_peak rank 0 {peaks[0]:>11d} ({gib(peaks[0])}) "
            f"planned {want[0]:>11d} ({relative_error(want[0], peaks[0])})")
    if result.nproc > 1:
        line += f" | per rank {peaks} planned {want} ({errors})"
    offloaded = result.field("offloaded_bytes")
    if any(offloaded):
        line += (f" | offloaded {offloaded} planned {[r.offloaded_bytes for r in plan]} "
                 f"reloaded {result.field('reloaded_bytes')}")
    ratio = result.step_s / baseline.step_s
    return line + f" | step {result.step_s:.2f} s, x{ratio:.2f} of {baseline.label}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loss-seq", type=int, default=8192, help="loss group: tokens")
    p.add_argument("--loss-vocab", type=int, default=154880, help="loss group: vocabulary")
    p.add_argument("--loss-mtp-steps", type=int, default=3,
                   help="loss group: MTP steps to try first (reduced to fit --budget-gib)")
    p.add_argument("--loss-steps", type=int, default=2, help="loss group: training steps")
    p.add_argument("--chunk", type=int, default=2048, help="activations.loss_chunk_tokens")
    p.add_argument("--pp-seq", type=int, default=256, help="pipeline group: tokens")
    p.add_argument("--micro-batches", type=int, default=8, help="pipeline group: per step")
    p.add_argument("--offload-micro-batches", type=int, default=None,
                   help="activations.offload_micro_batches (default: every forward, 2 x "
                        "micro-batches)")
    p.add_argument("--steps", type=int, default=3, help="pipeline group: training steps")
    p.add_argument("--budget-gib", type=float, default=16.0,
                   help="memory the loss group's baseline may need (machine: 24 GB)")
    p.add_argument("--groups", nargs="+", choices=("loss", "pipeline"),
                   default=["loss", "pipeline"])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        groups = {}
        if "loss" in args.groups:
            groups["loss"] = loss_group(args, tmp)
        if "pipeline" in args.groups:
            groups["pipeline"] = pipeline_group(args, tmp)
    print("measured (planned, relative error of the plan):")
    for results in groups.values():
        for result in results:
            print(describe(result, results[0]))
    headline = groups.get("pipeline") or groups["loss"]
    ours, base = headline[-1].field("saved_bytes_peak")[0], headline[0].field(
        "saved_bytes_peak")[0]
    print(f"ours={ours} baseline={base} ratio={ours / base:.4f}")


if __name__ == "__main__":
    main()
