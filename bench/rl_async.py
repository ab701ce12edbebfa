"""Asynchronous against synchronous RL on the same task, latency mix and warm start.

    python bench/rl_async.py [--out outputs/bench_rl_async] [--steps 150] [--latency longtail]

Runs ``python -m launch.rl`` three times in ``--out``, from one supervised warm start:

- ``async``: the rollout workers generate from the newest version while the trainer trains,
  each step taking the groups ready (``rl.max_policy_lag`` bounds staleness);
- ``sync``: the baseline on the same machinery: a step's groups all come from the current
  version, and the trainer waits for the slowest of them (``--mode sync``);
- ``sync_trained_indexer``: ``sync`` for ``--mismatch-steps`` steps with the indexer trained
  (``dsa=sparse``) instead of frozen: the train/rollout mismatch with and without the frozen
  indexer.

Prints ``ours=<async wall s to the target> baseline=<sync wall s to the target> ratio=<ours /
baseline>``: the training wall time (from the first published version) at which the held-out
reward first reaches the target, by default the warm start's reward plus half of its gap to
the maximum (1.0). Then, per run: the masked-token fraction (IcePop), the staleness histogram
of the trained rollouts, the groups dropped as stale, and the mismatch |log pi_train -
log pi_rollout| (``rl_logp_diff_mean``: in the sync runs every trained token is of the
learner's own version, so this is the two engines' difference alone). Draws the reward
curves over wall time into ``--out``/rl_async.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as `python bench/rl_async.py`
    sys.path.insert(0, REPO)

from glm5_train.rl.publisher import written_at_seconds  # noqa: E402


def run_loop(out: str, name: str, args: argparse.Namespace, mode: str, steps: int,
             extra: list[str]) -> str:
    """One launch.rl run in ``out/name`` (the warm start copied in); its run directory."""
    run_dir = os.path.join(out, name)
    shared = os.path.join(out, "warm_start", "sft")
    if not os.path.exists(os.path.join(run_dir, "sft")) and os.path.exists(shared):
        os.makedirs(run_dir, exist_ok=True)
        shutil.copytree(shared, os.path.join(run_dir, "sft"))
    cmd = [sys.executable, "-m", "launch.rl", "--run-dir", run_dir, "--mode", mode,
           "--steps", str(steps), "--latency", args.latency,
           "--latency-median-s", str(args.latency_median_s),
           "--latency-sigma", str(args.latency_sigma), "--workers", str(args.workers),
           "--eval-every", str(args.eval_every), "--sft-steps", str(args.sft_steps)]
    cmd += ["--", "train.log_interval=1", *extra]  # every step's record: the histograms
    print(f"bench: {' '.join(cmd[1:])}", flush=True)
    status = subprocess.call(cmd, cwd=REPO)
    if status != 0:
        sys.exit(f"bench: {name} failed with status {status}")
    return run_dir


def warm_start(out: str, args: argparse.Namespace) -> None:
    """The shared warm start: launch.rl's own, run once (no RL steps taken from it)."""
    run_dir = os.path.join(out, "warm_start")
    if os.path.exists(os.path.join(run_dir, "sft", "latest_iteration.txt")):
        return
    sys.path.insert(0, REPO)
    from launch.rl import LoopSettings, remember_settings
    from launch.rl import warm_start as train_warm_start

    settings = LoopSettings(sft_steps=args.sft_steps)
    remember_settings(run_dir, settings)
    train_warm_start(run_dir, settings, [])


def evaluations(run_dir: str) -> list[dict]:
    """eval.jsonl, by version, with ``wall_s``: seconds from the first version's publication."""
    with open(os.path.join(run_dir, "eval.jsonl")) as handle:
        rows = sorted((json.loads(line) for line in handle if line.strip()),
                      key=lambda r: r["version"])
    start = written_at_seconds(rows[0]["written_at"])
    for row in rows:
        row["wall_s"] = written_at_seconds(row["written_at"]) - start
    return rows


def metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "rl_run", "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def time_to(rows: list[dict], target: float) -> float | None:
    return next((r["wall_s"] for r in rows if r["reward"] >= target), None)


def run_figures(records: list[dict]) -> dict:
    lags: dict[int, int] = {}
    for r in records:
        for lag, count in r.get("stream_lag_hist", {}).items():
            lags[int(lag)] = lags.get(int(lag), 0) + count
    mean = lambda key: sum(r[key] for r in records) / len(records)
    return {"steps": len(records), "masked_fraction": mean("rl_masked_fraction"),
            "logp_diff_mean": mean("rl_logp_diff_mean"),
            "logp_diff_max": max(r["rl_logp_diff_max"] for r in records),
            "dropped_stale_groups": sum(r.get("stream_dropped_stale", 0) for r in records),
            "wait_s_mean": mean("stream_wait_s"),
            "lag_hist": dict(sorted(lags.items()))}


def mismatch_line(runs: dict[str, str], steps: int) -> str:
    """The two engines' mismatch over the same first steps, indexer frozen against trained
    (sync runs: every trained token is of the learner's own version)."""
    parts = []
    for name, label in (("sync", "frozen indexer"), ("sync_trained_indexer", "trained indexer")):
        records = metrics(runs[name])[:steps]
        mean = sum(r["rl_logp_diff_mean"] for r in records) / len(records)
        worst = max(r["rl_logp_diff_max"] for r in records)
        masked = sum(r["rl_masked_fraction"] for r in records) / len(records)
        parts.append(f"{label}: mean={mean:.5f} max={worst:.3f} masked={masked:.2e}")
    return f"mismatch |log pi_train - log pi_rollout|, first {steps} sync steps: " + \
        "; ".join(parts)


def draw(out: str, curves: dict[str, list[dict]], target: float) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in curves.items():
        ax.plot([r["wall_s"] for r in rows], [r["reward"] for r in rows], marker=".",
                label=name)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target")
    ax.set_xlabel("training wall time (s, from the first published version)")
    ax.set_ylabel("held-out reward (per-position)")
    ax.set_title("GRPO + IcePop on the tiny GLM-5, long-tailed rollout latency")
    ax.grid(alpha=0.3)
    ax.legend()
    path = os.path.join(out, "rl_async.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="outputs/bench_rl_async")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--mismatch-steps", type=int, default=20)
    p.add_argument("--sft-steps", type=int, default=40)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--latency", default="longtail", choices=["none", "longtail"])
    p.add_argument("--latency-median-s", type=float, default=1.0)
    p.add_argument("--latency-sigma", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--target", type=float, default=None,
                   help="held-out reward to reach (default: the warm start's + half its gap)")
    args = p.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    warm_start(out, args)
    runs = {"async": run_loop(out, "async", args, "async", args.steps, []),
            "sync": run_loop(out, "sync", args, "sync", args.steps, []),
            "sync_trained_indexer": run_loop(out, "sync_trained_indexer", args, "sync",
                                             args.mismatch_steps, ["dsa=sparse"])}
    curves = {name: evaluations(runs[name]) for name in ("async", "sync")}
    start = curves["sync"][0]["reward"]
    target = args.target if args.target is not None else start + 0.5 * (1.0 - start)
    ours, baseline = time_to(curves["async"], target), time_to(curves["sync"], target)
    for name, run_dir in runs.items():
        figures = run_figures(metrics(run_dir))
        rows = evaluations(run_dir)
        figures.update(reward_start=rows[0]["reward"], reward_end=rows[-1]["reward"],
                       reward_best=max(r["reward"] for r in rows),
                       wall_s=rows[-1]["wall_s"])
        print(f"{name}: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                     for k, v in figures.items()))
    print(mismatch_line(runs, args.mismatch_steps))
    print(f"picture: {draw(out, curves, target)}")
    print(f"target held-out reward {target:.3f} (warm start {start:.3f})")
    ratio = ours / baseline if ours is not None and baseline else float("nan")
    print(f"ours={ours if ours is None else round(ours, 1)} "
          f"baseline={baseline if baseline is None else round(baseline, 1)} "
          f"ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
