"""Measure the workload model of flexible context-parallel groups (parallel/flexible_cp.py):
time one-process training steps on single conversations of several lengths and fit

    step seconds = pair x n(n+1)/2 + selected x sum_t min(k, t+1) + token x n + constant

(non-negative least squares; the constant is the per-step work no micro-batch adds: the
optimizer, the gradient all-reduce). Prints the fit, each length's measured and fitted time,
and the overrides that put the coefficients into a run:

    python tools/calibrate_cp_workload.py model=glm5_tiny [--lengths 1024,2048,4096,8192]

Extra arguments are Hydra overrides of the job (model, dsa stage, recompute...): measure the
configuration you will train. Each length runs ``--steps`` steps (the fastest after the first
counts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from glm5_train.job_config import compose_model_config
from parallel.flexible_cp import Workload, fit_workload

# Any tokenizer within the model's vocabulary times the same (the text is random words).
TOKENIZER = os.path.join(REPO, "tests", "data", "glm_tiny_tokenizer")


# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  # fit the flexible-CP workload model of the tiny GLM-5 (four lengths, 3 steps each)
  python tools/calibrate_cp_workload.py model=glm5_tiny
  # shorter lengths and the frozen-indexer stage, the configuration you will train
  python tools/calibrate_cp_workload.py model=glm5_tiny dsa=frozen_indexer --lengths 256,512 --steps 2
"""


def run_job(overrides: list[str], run_dir: str) -> list[dict]:
    """One-process training job; its metrics.jsonl records (exits with its log on failure)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "glm5_train.train", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"calibration run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def measure(lengths: list[int], overrides: list[str], steps: int, workdir: str) -> list[float]:
    seconds = []
    for n in lengths:
        prefix = _one_conversation_dataset(n, workdir)
        records = run_job([
            "parallel=single", "data=chat_sft", f"data.paths=[{prefix}]",
            f"data.tokenizer={TOKENIZER}", f"train.seq_length={n}",
            f"model.max_position_embeddings={max(n, 2048)}", f"train.train_iters={steps}",
            "train.warmup_iters=0", "train.global_batch_size=1", "train.micro_batch_size=1",
            "checkpoint.save=null", "checkpoint.load=null", *overrides],
            os.path.join(workdir, f"run{n}"))
        times = [n / r["tokens_per_s"] for r in records[1:]] or [n / records[0]["tokens_per_s"]]
        seconds.append(min(times))
        print(f"{n:>7} tokens: {seconds[-1]:.3f} s per step", flush=True)
    return seconds


def _one_conversation_dataset(n: int, workdir: str) -> str:
    """A chat SFT dataset of one conversation that fills an n-token sequence (a few short)."""
    source, prefix = os.path.join(workdir, f"c{n}.jsonl"), os.path.join(workdir, f"sft{n}")
    for tool in (["tools/synthetic_chat.py", "--output", source, "--tokenizer", TOKENIZER,
                  "--lengths", str(n - 16)],
                 ["tools/prepare_chat_sft.py", "--input", source, "--output-prefix", prefix,
                  "--tokenizer", TOKENIZER, "--seq-length", str(n), "--overlong", "truncate"]):
        subprocess.run([sys.executable, *tool], cwd=REPO, check=True, capture_output=True)
    return prefix


def topk_of(overrides: list[str]) -> int:
    return compose_model_config(overrides).index_topk


def calibrate(lengths: list[int], overrides: list[str], steps: int) -> Workload:
    with tempfile.TemporaryDirectory() as workdir:
        seconds = measure(lengths, overrides, steps, workdir)
    workload, constant = fit_workload(lengths, seconds, topk_of(overrides))
    print(f"fit: pair {workload.pair:.3e} s, selected {workload.selected:.3e} s, token "
          f"{workload.token:.3e} s, per step {constant:.3f} s")
    for n, s in zip(lengths, seconds):
        print(f"{n:>7} tokens: measured {s:.3f} s, fitted {workload.document(n) + constant:.3f} s")
    print(f"parallel.flexible_cp_cost_pair={workload.pair:.4e} "
          f"parallel.flexible_cp_cost_selected={workload.selected:.4e} "
          f"parallel.flexible_cp_cost_token={workload.token:.4e}")
    return workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--steps", type=int, default=3)
    args, overrides = parser.parse_known_args()
    calibrate([int(x) for x in args.lengths.split(",")], overrides or ["model=glm5_tiny"],
              args.steps)


if __name__ == "__main__":
    main()
