"""Long sequences: bytes saved for backward per token of one tiny GLM-5 training step, ours
(absorbed sparse MLA + sequence-chunked loss) against today's path (masked dense attention +
whole-logits loss), 4K to 32K tokens.

    python bench/long_context.py [--seq 4096 8192 16384 32768] [--baseline-fit-seq 1024 2048]
                                 [--budget-gib 16] [--steps 1]

Each run is the real job (``bench/job.py``, torchrun, 1 process, ``parallel=single``): the
tiny GLM-5 (``model=glm5_tiny``, fp32) in the DSA sparse stage with the indexer KL
(``dsa=sparse``), MTP for 3 steps, global batch 1 of one micro-batch of ``train.seq_length``
tokens (``model.max_position_embeddings`` raised to the length). Measured, from metrics.jsonl:
``saved_bytes_peak`` (most bytes saved for backward resident at once, parameters apart:
``parallel/activation_accounting.py``) per token, and the process's peak RSS
(``mem_peak_bytes``); beside each, the planner's prediction (``glm5_train/plan/``,
closed-form: saved bytes; static + saved bytes beside the RSS, which also holds the
interpreter, libraries and transient workspace the planner does not model).

- ours: the defaults, ``dsa.sparse_attention=absorbed`` and ``activations.loss_chunk_tokens``
  as configured (2048); runs at every ``--seq``. Its bytes per token must be flat (within 10%)
  over the lengths: the spread (max - min) / min is printed.
- baseline (today's path): ``dsa.sparse_attention=masked_dense activations.loss_chunk_tokens=0``
  at ``--baseline-fit-seq`` and the ``--seq`` lengths, ascending, as far as it fits: a length
  is skipped when its peak RSS extrapolated from the lengths already run exceeds
  ``--budget-gib`` (the machine has 24 GB): the saved bytes from the fit below, and the RSS
  growing with them as it did between the last two lengths (with one length run: saved
  bytes scaled as S^2, RSS growing by twice that). Its saved bytes per token are fitted as
  a + b * S (least squares over the lengths that ran: masked dense attention keeps [S, S]
  scores, so bytes grow as S^2, per token as S) and extrapolated to the lengths it skipped;
  with fewer than two lengths run, the planner's figure stands in (said so).

Last line: ``ours=<bytes/token at the longest --seq> baseline=<today's bytes/token there,
measured or extrapolated> ratio=<ours/baseline>``.

Expected time on 2 CPU cores with the defaults: about 8-10 minutes (ours ~50 s a run up to
16K, ~2 min at 32K; the baseline at 1K, 2K, 4K and 8K, ~2 min at 8K, where it is predicted at
~9 GiB of RSS; 16K and 32K extrapolated).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass

from planned_memory import gib, measured_field, planned, relative_error, run_job, step_seconds

BASE = ["model=glm5_tiny", "parallel=single", "dsa=sparse", "model.mtp_num_steps=3",
        "train.global_batch_size=1", "train.micro_batch_size=1", "train.params_dtype=fp32",
        "train.warmup_iters=1", "checkpoint.save=null"]
PATHS = {"ours": ["dsa.sparse_attention=absorbed"],  # loss_chunk_tokens: the default
         "baseline": ["dsa.sparse_attention=masked_dense", "activations.loss_chunk_tokens=0"]}
FLAT_LIMIT = 0.10
HOW = {"measured": "measured",
       "extrapolated": "extrapolated from the a + b*S fit of the lengths that ran",
       "planned": "the planner's prediction (fewer than two baseline lengths ran: no fit)"}


@dataclass
class Point:
    """One run at one length: measured and planned figures."""
    seq: int
    saved_peak: int
    rss_peak: int
    step_s: float
    wall_s: float
    planned_saved: int
    planned_total: int

    @property
    def per_token(self) -> float:
        return self.saved_peak / self.seq


def overrides(path: str, seq: int, steps: int) -> list[str]:
    return [*BASE, *PATHS[path], f"train.seq_length={seq}",
            f"model.max_position_embeddings={seq}", f"train.train_iters={steps}"]


def run_point(path: str, seq: int, steps: int, tmp: str) -> Point:
    args = overrides(path, seq, steps)
    label = f"{path} at {seq} tokens"
    records, wall = run_job(1, args, os.path.join(tmp, f"{path}_{seq}"), label)
    last = records[-1]
    plan = planned(args, 1).ranks[0]
    point = Point(seq, measured_field(last, "saved_bytes_peak", label)[0],
                  measured_field(last, "mem_peak_bytes", label)[0],
                  step_seconds(records, seq), wall, plan.peak_activation_bytes,
                  plan.total_bytes)
    error = relative_error(plan.peak_activation_bytes, point.saved_peak)
    print(f"  {label:26s} saved {point.per_token:10.0f} B/token (planned "
          f"{plan.peak_activation_bytes / seq:.0f}, {error}) | peak RSS {gib(point.rss_peak)} "
          f"(plan static+saved {gib(plan.total_bytes)}) | "
          f"step {point.step_s:.1f} s | run {wall:.0f} s", flush=True)
    return point


def fit_per_token(seqs: list[int], values: list[float]) -> tuple[float, float]:
    """Least squares of value / S = a + b * S over the points; (a, b)."""
    ys = [v / s for s, v in zip(seqs, values)]
    n = len(seqs)
    mean_s, mean_y = sum(seqs) / n, sum(ys) / n
    var = sum((s - mean_s) ** 2 for s in seqs)
    b = sum((s - mean_s) * (y - mean_y) for s, y in zip(seqs, ys)) / var
    return mean_y - b * mean_s, b


def extrapolated_rss(points: list[Point], seq: int) -> float | None:
    """The baseline's peak RSS at ``seq`` from the lengths already run (None: none ran). With
    two or more: its saved bytes from the a + b*S fit, and the RSS growing from the last
    length as it grew per saved byte between the last two (at least 1:1: saved bytes are
    resident, the backward's transients scale with them). With one: the saved bytes scaled
    as S^2 and the RSS growing by twice as much (saved bytes plus as much transient)."""
    if not points:
        return None
    last = points[-1]
    if len(points) == 1:
        return last.rss_peak + 2 * last.saved_peak * ((seq / last.seq) ** 2 - 1)
    a, b = fit_per_token([p.seq for p in points], [p.saved_peak for p in points])
    before = points[-2]
    growth = (last.rss_peak - before.rss_peak) / max(1, last.saved_peak - before.saved_peak)
    return last.rss_peak + max(1.0, growth) * ((a + b * seq) * seq - last.saved_peak)


def run_baseline(lengths: list[int], steps: int, budget: float, tmp: str) -> list[Point]:
    """Today's path, ascending, until a length would not fit (or a run fails)."""
    points: list[Point] = []
    for seq in lengths:
        guess = extrapolated_rss(points, seq)
        if guess is None:  # nothing measured yet: the planner's static + saved bytes
            guess = planned(overrides("baseline", seq, steps), 1).ranks[0].total_bytes
        if guess > budget:
            print(f"  baseline at {seq} tokens skipped: extrapolated peak {gib(guess)} > "
                  f"budget {gib(budget)} (and every longer length)")
            break
        try:
            points.append(run_point("baseline", seq, steps, tmp))
        except SystemExit as failure:  # out of memory, or a failure inside the old path
            print(f"  baseline at {seq} tokens failed; extrapolating from the shorter lengths. "
                  f"{str(failure)[-1500:]}")
            break
    return points


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384, 32768],
                   help="sequence lengths (ours at each; the last one is the headline)")
    p.add_argument("--baseline-fit-seq", type=int, nargs="*", default=[1024, 2048],
                   help="extra shorter lengths the baseline runs for its growth fit")
    p.add_argument("--budget-gib", type=float, default=16.0,
                   help="skip baseline lengths whose extrapolated peak RSS exceeds this")
    p.add_argument("--steps", type=int, default=1,
                   help="training steps per run (2+: step time leaves out the warm-up step)")
    args = p.parse_args()
    seqs = sorted(set(args.seq))
    budget = args.budget_gib * 2**30
    with tempfile.TemporaryDirectory() as tmp:
        print(f"ours ({' '.join(PATHS['ours'])}, loss chunked as configured):")
        ours = [run_point("ours", s, args.steps, tmp) for s in seqs]
        print(f"baseline ({' '.join(PATHS['baseline'])}):")
        base = run_baseline(sorted(set(args.baseline_fit_seq) | set(seqs)), args.steps,
                            budget, tmp)
    report(ours, base, seqs, args.steps)


def report(ours: list[Point], base: list[Point], seqs: list[int], steps: int) -> None:
    measured = {p.seq: p for p in base}
    fit = None
    if len(base) >= 2:
        fit = fit_per_token([p.seq for p in base], [p.saved_peak for p in base])
        print(f"baseline fit over the lengths that ran {[p.seq for p in base]}: saved bytes per "
              f"token = {fit[0]:.0f} + {fit[1]:.3f} * S")
    print(f"{'seq':>6s} | {'ours B/token':>12s} | {'baseline B/token':>26s} | {'ratio':>7s} | "
          f"{'ours RSS':>10s} | {'base RSS':>10s} | ours/base step time")
    base_at: dict[int, tuple[float, str]] = {}
    for point in ours:
        seq = point.seq
        plan_base = planned(overrides("baseline", seq, steps), 1).ranks[0].peak_activation_bytes
        if seq in measured:
            value, how = measured[seq].per_token, "measured"
        elif fit is not None:
            value, how = fit[0] + fit[1] * seq, "extrapolated"
        else:  # fewer than two lengths ran: nothing to fit, the planner's figure stands in
            value, how = plan_base / seq, "planned"
        base_at[seq] = value, how
        rss = gib(measured[seq].rss_peak) if seq in measured else "-"
        time_ratio = (f"{point.step_s / measured[seq].step_s:.2f}" if seq in measured else "-")
        print(f"{seq:>6d} | {point.per_token:>12.0f} | {value:>12.0f} {how:>13s} | "
              f"{point.per_token / value:>7.4f} | {gib(point.rss_peak):>10s} | {rss:>10s} | "
              f"{time_ratio}   (baseline planned {plan_base / seq:.0f} B/token)")
    per_token = [p.per_token for p in ours]
    spread = (max(per_token) - min(per_token)) / min(per_token)
    verdict = "flat" if spread <= FLAT_LIMIT else "NOT flat"
    print(f"ours bytes/token spread over {seqs[0]}..{seqs[-1]}: {spread:.2%} ({verdict}: limit "
          f"{FLAT_LIMIT:.0%})")
    longest = seqs[-1]
    baseline, how = base_at[longest]
    print(f"baseline at {longest}: {HOW[how]}")
    last = ours[-1].per_token
    print(f"ours={last:.0f} baseline={baseline:.0f} ratio={last / baseline:.4f}")


if __name__ == "__main__":
    main()
