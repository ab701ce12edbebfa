"""Flexible vs fixed context-parallel groups on a long-tailed batch of chat conversations: the
tiny GLM-5 (DSA sparse stage with its KL, MTP 3 steps) on 8 ranks.

    python bench/flexible_cp.py [--ranks 8] [--rank-tokens 2048] [--short 48] [--steps 8]
                                [--measured 5] [--no-calibrate] [--keep DIR]

``--keep DIR``: the data and each mode's run (its metrics.jsonl: every step's plan) stay in
DIR instead of a temporary directory.

Length distribution (``tools/synthetic_chat.py --long-tail``), scaled to what this CPU trains in
minutes, in the same proportions as GLM-5's SFT mix (most conversations under 8K tokens, a few
at 64K-202K of a 202,752-token window): ``--short`` conversations log-uniform in [128, L / 4]
tokens and three long ones at about 0.4, 0.7 and 1.0 x the window, for a window of 4 x L
tokens (L = ``--rank-tokens``: 8,192 at the default). One global batch = every packed
sequence (an even number of them: the last is dropped if odd); every step trains it again.

Three modes, ``--steps`` steps each:
- fixed: megatron-style CP4 x DP(ranks / 4): the conversations packed into 4L-token sequences
  (``tools/prepare_chat_sft.py``), each sequence over one CP group of 4 (zigzag), the batch's
  sequences split in order between the data-parallel groups;
- flexible: ``parallel.cp_groups=flexible`` with groups of up to 4, planned with the workload
  model measured first on this machine (``tools/calibrate_cp_workload.py``; ``--no-calibrate``:
  the config's defaults);
- flexible + refit: the same, with ``parallel.flexible_cp_refit=true``: from the fourth step
  the plans use the model refitted from the run's own micro-batch CPU times.

Each rank's CPU seconds are summed over the last ``--measured`` steps (the refit's plans; the
same steps in every mode): on 2 cores the ranks share the CPU, so wall time is the sum of the
work and the busiest rank's CPU time is what a cluster's step would wait for. Prints per mode
the mean step time (wall clock), CPU per rank, the measured imbalance (busiest / mean CPU),
for the refit its micro-batches' CPU per rank (its clocks) and the rest of each rank's CPU
beside the plans' modelled work per rank (both averaged over the measured steps), and for the flexible modes the last plan's
modelled imbalance and workload model. All modes
train on the same conversations: their losses agree. Then
``wall: ours=<flexible + refit step s> baseline=<fixed step s> ratio=...``, and last
``ours=<flexible + refit imbalance> baseline=<fixed CP imbalance> ratio=<ours/baseline>``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from job import REPO, run_training

sys.path.insert(0, os.path.join(REPO, "tools"))
from calibrate_cp_workload import calibrate
from megatron.core.datasets.indexed_dataset import IndexedDataset

TOKENIZER = os.path.join(REPO, "tests", "data", "glm_tiny_tokenizer")


def make_dataset(workdir: str, window: int, short: int, seed: int) -> tuple[str, int]:
    """The long-tailed chat dataset packed at ``window`` tokens; (prefix, packed sequences)."""
    source, prefix = os.path.join(workdir, "chats.jsonl"), os.path.join(workdir, "sft")
    longs = ",".join(str(int(window * f) - 64) for f in (0.4, 0.7, 1.0))
    for tool in (["tools/synthetic_chat.py", "--output", source, "--tokenizer", TOKENIZER,
                  "--long-tail", str(short), "--short-max", str(window // 16), "--long", longs,
                  "--seed", str(seed)],
                 ["tools/prepare_chat_sft.py", "--input", source, "--output-prefix", prefix,
                  "--tokenizer", TOKENIZER, "--seq-length", str(window), "--overlong",
                  "truncate"]):
        out = subprocess.run([sys.executable, *tool], cwd=REPO, check=True, capture_output=True,
                             text=True).stdout
        print(out.strip().splitlines()[-1], flush=True)
    index = IndexedDataset(prefix).index
    lengths = sorted((int(n) for n in index.sequence_lengths), reverse=True)
    print(f"conversation lengths (tokens): longest {lengths[:3]}, median "
          f"{lengths[len(lengths) // 2]}, {len(lengths)} in all, {sum(lengths)} tokens")
    return prefix, len(index.document_indices) - 1


def common(prefix: str, window: int, packs: int, steps: int) -> list[str]:
    return ["model=glm5_tiny", f"model.max_position_embeddings={window}", "parallel=single",
            "data=chat_sft", f"data.paths=[{prefix}]", f"data.tokenizer={TOKENIZER}",
            "data.reset_position_ids=true", f"train.seq_length={window}",
            f"train.train_iters={steps}", "train.warmup_iters=0",
            f"train.global_batch_size={packs}", "train.micro_batch_size=1",
            "checkpoint.save=null", "checkpoint.load=null", "train.log_interval=1"]


def _mean_per_rank(lists: list[list[float]]) -> list[float]:
    """Per-rank lists, one per step, averaged over the steps."""
    return [sum(values) / len(lists) for values in zip(*lists)]


def _seconds(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"


def report(label: str, records: list[dict], measured: int, packs: int,
           window: int) -> tuple[float, float]:
    """Print the mode's line; (mean step seconds, measured imbalance) over the last
    ``measured`` steps."""
    steps = records[-measured:]
    step_s = sum(packs * window / r["tokens_per_s"] for r in steps) / len(steps)
    cpu = [ms / 1000 for ms in _mean_per_rank([r["step_cpu_ms"] for r in steps])]
    imbalance = max(cpu) / (sum(cpu) / len(cpu))
    line = (f"{label}: step {step_s:.1f} s wall, CPU per rank per step "
            f"[{', '.join(f'{c:.2f}' for c in cpu)}] s, measured imbalance (busiest / mean CPU) "
            f"{imbalance:.3f}, loss {steps[-1]['loss']:.4f}, peak RSS per rank max "
            f"{max(steps[-1]['mem_peak_bytes']) / 2**30:.2f} GiB")
    plan = steps[-1].get("flexible_cp")
    if plan and "measured_rank_work" in plan:  # the refit's clocks: the micro-batches' CPU
        # each averaged over the measured steps (the refit's plans change from step to step)
        cells = _mean_per_rank([r["flexible_cp"]["measured_rank_work"] for r in steps])
        modelled = _mean_per_rank([r["flexible_cp"]["modelled_rank_work"] for r in steps])
        line += (f"; micro-batches' CPU per rank {_seconds(cells)} s, outside them "
                 f"{_seconds([a - c for a, c in zip(cpu, cells)])} s, modelled work per rank "
                 f"{_seconds(modelled)} s")
    if plan:
        model = ", ".join(f"{k} {v:.3g}" for k, v in plan["workload"].items())
        line += (f"; last plan: {plan['micro_batches']} micro-batches, groups per slot "
                 f"{plan['group_sizes']}, modelled imbalance {plan['work_imbalance']:.3f}, "
                 f"padding {plan['padding_tokens']} tokens, model ({model})")
    print(line, flush=True)
    return step_s, imbalance


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rank-tokens", type=int, default=2048)
    parser.add_argument("--short", type=int, default=48)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--measured", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-calibrate", action="store_true")
    parser.add_argument("--keep", default=None, help="keep the data and runs in this directory")
    args = parser.parse_args()
    if not 1 <= args.measured <= args.steps - 3:
        raise SystemExit(f"--measured {args.measured}: measure 1 .. steps - 3 = "
                         f"{args.steps - 3} steps (the refit plans from the fourth step on)")
    window = 4 * args.rank_tokens
    if args.keep:  # absolute: the tools and the runs start in the repository
        args.keep = os.path.abspath(args.keep)
        if os.path.isdir(args.keep) and os.listdir(args.keep):
            raise SystemExit(f"--keep {args.keep}: the directory is not empty (the runs would "
                             "append to its metrics.jsonl files); name a new or empty one")
        os.makedirs(args.keep, exist_ok=True)
    with (contextlib.nullcontext(args.keep) if args.keep
          else tempfile.TemporaryDirectory()) as workdir:
        prefix, packs = make_dataset(workdir, window, args.short, args.seed)
        packs -= packs % (args.ranks // 4)  # whole samples per fixed data-parallel group
        costs = []
        if not args.no_calibrate:
            lengths = [args.rank_tokens // 4, args.rank_tokens // 2, args.rank_tokens,
                       2 * args.rank_tokens]
            w = calibrate(lengths, ["model=glm5_tiny",
                                    f"model.max_position_embeddings={window}"], 2)
            costs = [f"parallel.flexible_cp_cost_pair={w.pair:.4e}",
                     f"parallel.flexible_cp_cost_selected={w.selected:.4e}",
                     f"parallel.flexible_cp_cost_token={w.token:.4e}"]
        base = common(prefix, window, packs, args.steps)
        flexible = [*base, "parallel.cp_groups=flexible", "parallel.flexible_cp_max_size=4",
                    *costs]
        modes = [(f"fixed CP4 x DP{args.ranks // 4} ({packs} packed sequences of {window})",
                  [*base, "parallel.context_parallel_size=4"], "fixed"),
                 ("flexible groups of 1-4, calibrated model", flexible, "flexible"),
                 ("flexible groups of 1-4, online refit", [*flexible,
                  "parallel.flexible_cp_refit=true"], "refit")]
        results = []
        for label, overrides, name in modes:
            records = run_training(args.ranks, overrides, os.path.join(workdir, name), name)
            results.append(report(label, records, args.measured, packs, window))
    (base_s, base_imb), _, (ours_s, ours_imb) = results
    print(f"wall: ours={ours_s:.3f} baseline={base_s:.3f} ratio={ours_s / base_s:.3f}")
    print(f"ours={ours_imb:.3f} baseline={base_imb:.3f} ratio={ours_imb / base_imb:.3f}")


if __name__ == "__main__":
    main()
