"""Compare the per-step records of two training runs (``metrics.jsonl``): CUDA vs CPU.

    python bench/gpu/compare_runs.py CUDA_RUN_DIR CPU_RUN_DIR

Either run may be missing or partial (a failed run): what is there is printed. Prints a per-step
table of loss and grad norm, the max abs / rel differences over common steps, and the median
tokens/s of each run over steps 3.. (steps 1-2 carry start-up work); lines meant for the summary
start with ``SUMMARY``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys


def read(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if line:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return records


def throughput(records: list[dict]) -> str:
    rates = [r["tokens_per_s"] for r in records if r.get("step", 0) >= 3 and "tokens_per_s" in r]
    if not rates:
        rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    if not rates:
        return "n/a"
    peak = max((max(r.get("mem_peak_bytes") or [0]) for r in records), default=0) / 2**20
    return (f"median {statistics.median(rates):.0f} tokens/s (min {min(rates):.0f}, "
            f"max {max(rates):.0f}, over {len(rates)} steps), peak mem {peak:.0f} MiB")


def main() -> None:
    names = ("cuda", "cpu")
    runs = {name: read(path) for name, path in zip(names, sys.argv[1:3])}
    for name in names:
        print(f"SUMMARY {name} run: {len(runs[name])} steps in metrics.jsonl; "
              f"{throughput(runs[name])}")
    by_step = {name: {r["step"]: r for r in runs[name]} for name in names}
    steps = sorted(set(by_step["cuda"]) | set(by_step["cpu"]))
    keys = [k for k in ("loss", "mtp_loss", "grad_norm", "indexer_kl")
            if any(k in r for name in names for r in runs[name])]
    header = "step " + " ".join(f"{k + '_' + n:>18s}" for k in keys for n in names)
    print(header)
    diffs: dict[str, list[tuple[float, float]]] = {k: [] for k in keys}
    for step in steps:
        cells = []
        for key in keys:
            values = [by_step[n].get(step, {}).get(key) for n in names]
            cells += [f"{v:18.8f}" if isinstance(v, (int, float)) else f"{'-':>18s}"
                      for v in values]
            if all(isinstance(v, (int, float)) for v in values):
                a, b = values
                diffs[key].append((abs(a - b), abs(a - b) / max(abs(b), 1e-30)))
        print(f"{step:4d} " + " ".join(cells))
    for key in keys:
        if diffs[key]:
            abs_max = max(d[0] for d in diffs[key])
            rel_max = max(d[1] for d in diffs[key])
            first = diffs[key][0][0]
            print(f"SUMMARY cuda vs cpu {key}: max abs diff {abs_max:.3e}, max rel diff "
                  f"{rel_max:.3e} over {len(diffs[key])} common steps (step 1 abs diff "
                  f"{first:.3e})")
        else:
            print(f"SUMMARY cuda vs cpu {key}: no common steps to compare")
    losses = {n: " ".join(f"{r['loss']:.6f}" for r in runs[n] if "loss" in r) for n in names}
    for name in names:
        print(f"SUMMARY {name} losses: {losses[name] or '-'}")


if __name__ == "__main__":
    main()
