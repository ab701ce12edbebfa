"""INT4 QAT: how much of INT4's loss it wins back against quantising after training (PTQ), and
what it costs per step, against the same fine-tune without QAT, in the same script.

What QAT is for: a model served with INT4 routed experts loses quality when its weights are
rounded after training; training through the rounding (the forward on INT4 weights, the update
on the full-precision ones) lets it adapt. Here, in one process: glm5_tiny at ``--width`` x its
widths is pretrained for ``--pretrain`` steps, then fine-tuned on for ``--finetune`` steps
twice from that checkpoint, without and with ``train.int4_qat``. Then, on held-out text
(``bench/int4_held_out.txt``: the first 2,056 bytes of this repository's README as it stood
when the figures in docs/benchmarks.md were measured, kept fixed so a rerun scores the same
text; byte tokens, not in the training corpus), tools/logits.py gives the
mean next-token loss of:

- ``fp``: the plain fine-tune in full precision (the reference);
- ``ptq``: the plain fine-tune with its routed experts rounded to INT4 (QAT's forward on its
  weights: what serving it as INT4 does);
- ``qat``: the QAT fine-tune as INT4 (what its INT4 export serves, bit for bit).

Prints the three losses, the INT4 gaps ``ptq - fp`` and ``qat - fp``, the fraction of PTQ's gap
that QAT removes, the QAT run's rounding error (its own ``int4_qat_error_ppm``) and the step
time ratio QAT / plain (median over the fine-tune's steps after the first two).

    python bench/int4_qat.py [--width 2] [--pretrain 150] [--finetune 60] [--seq 256] [--group 32]

Last line: ``ours=<qat gap> baseline=<ptq gap> ratio=<qat gap / ptq gap>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import torch
from job import REPO, run_training

from glm5_train.tokenizer import ByteTokenizer


def model_overrides(width: int) -> list[str]:
    return ["model=glm5_tiny", f"model.hidden_size={128 * width}",
            f"model.intermediate_size={256 * width}",
            f"model.moe_intermediate_size={64 * width}", "parallel=single"]


def train(args, steps: int, run_dir: str, load: str | None, qat: bool) -> list[dict]:
    return run_training(1, [
        *model_overrides(args.width), f"train.train_iters={steps}",
        f"train.seq_length={args.seq}", "train.global_batch_size=8",
        "train.warmup_iters=10", "train.lr=3e-3", f"checkpoint.save={run_dir}/ckpt",
        f"checkpoint.load={load or 'null'}", f"train.int4_qat={str(qat).lower()}",
        f"train.int4_group_size={args.group}"],
        run_dir, "qat" if qat else "plain")


HELD_OUT = os.path.join(REPO, "bench", "int4_held_out.txt")


def held_out_tokens(seq: int, rows: int) -> torch.Tensor:
    with open(HELD_OUT, encoding="utf-8") as handle:
        ids = ByteTokenizer().tokenize(handle.read())
    need = rows * (seq + 1)
    if len(ids) < need:
        raise SystemExit(f"{HELD_OUT} has {len(ids)} byte tokens; {need} needed (lower "
                         "--seq or the rows scored)")
    return torch.tensor(ids[:need]).view(rows, seq + 1)


def mean_loss(args, ckpt: str, tokens: torch.Tensor, int4: bool, work: str, label: str) -> float:
    """Mean next-token cross-entropy of ``tokens`` [rows, seq + 1] under ``ckpt``."""
    inputs = os.path.join(work, "tokens.pt")
    out = os.path.join(work, f"logits_{label}.pt")
    torch.save(tokens[:, :-1].contiguous(), inputs)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "tools/logits.py", "--load", ckpt, "--tokens", inputs, "--out", out,
           *model_overrides(args.width), f"train.int4_qat={str(int4).lower()}",
           f"train.int4_group_size={args.group}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"logits ({label}) failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    logits = torch.load(out)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             tokens[:, 1:].reshape(-1)).item()


def median_step_seconds(records: list[dict], tokens: int) -> float:
    return statistics.median(tokens / r["tokens_per_s"] for r in records[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2)
    parser.add_argument("--pretrain", type=int, default=150)
    parser.add_argument("--finetune", type=int, default=60)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--group", type=int, default=32, help="train.int4_group_size")
    args = parser.parse_args()
    total = args.pretrain + args.finetune
    with tempfile.TemporaryDirectory(prefix="bench_int4_") as work:
        base = os.path.join(work, "base")
        train(args, args.pretrain, base, None, qat=False)
        runs = {}
        for name, qat in (("plain", False), ("qat", True)):
            run_dir = os.path.join(work, name)
            runs[name] = train(args, total, run_dir, f"{base}/ckpt", qat)
        tokens = held_out_tokens(args.seq, args.rows)
        fp = mean_loss(args, f"{work}/plain/ckpt", tokens, False, work, "fp")
        ptq = mean_loss(args, f"{work}/plain/ckpt", tokens, True, work, "ptq")
        qat = mean_loss(args, f"{work}/qat/ckpt", tokens, True, work, "qat")
    step_tokens = 8 * args.seq
    plain_s = median_step_seconds(runs["plain"], step_tokens)
    qat_s = median_step_seconds(runs["qat"], step_tokens)
    error = runs["qat"][-1]["int4_qat_error_ppm"][0] / 1e6
    print(f"glm5_tiny x{args.width}, {args.pretrain} steps pretrained, {args.finetune} "
          f"fine-tuned, INT4 groups of {args.group}, held-out loss over {tokens.numel()} README tokens")
    print(f"fp (plain fine-tune, full precision)  {fp:.4f}")
    print(f"ptq (plain fine-tune, experts INT4)   {ptq:.4f}  gap {ptq - fp:+.4f}")
    print(f"qat (QAT fine-tune, experts INT4)     {qat:.4f}  gap {qat - fp:+.4f}")
    if ptq > fp:
        print(f"QAT removes {(ptq - qat) / (ptq - fp):.1%} of PTQ's INT4 gap")
    print(f"QAT rounding error ||q(W) - W|| / ||W|| over the experts: {error:.2%}")
    print(f"step time: plain {plain_s:.3f} s, QAT {qat_s:.3f} s, ratio {qat_s / plain_s:.3f}")
    print(f"ours={qat - fp:.5f} baseline={ptq - fp:.5f} ratio={(qat - fp) / (ptq - fp):.3f}")


if __name__ == "__main__":
    main()
