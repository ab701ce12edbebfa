"""Per-step metrics: one console line and one JSON object in ``<run dir>/metrics.jsonl``.

Only global rank 0 writes. Per-rank memory is gathered from every rank each logged step:
on CUDA the allocator's peak, on CPU the process's resident set (RSS) and its peak.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import sys
import time
from typing import Any

import psutil
import torch
import torch.distributed as dist

from parallel.activation_accounting import StepFigures
from parallel.comm_purpose import collective_purpose
from parallel.device import comm_device


def rank_memory_bytes() -> tuple[int, int]:
    """(current, peak) memory of this rank in bytes."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    rss = psutil.Process(os.getpid()).memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return rss, peak


@collective_purpose("metrics")
def gather_per_rank(values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (integers, the same count on each), in rank order, on every
    rank: one all-gather."""
    device = comm_device()  # NCCL gathers CUDA tensors only
    local = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [[int(v) for v in t] for t in gathered]


def gather_memory() -> tuple[list[int], list[int]]:
    """Every rank's (current, peak) memory, in rank order, on every rank."""
    ranks = gather_per_rank(list(rank_memory_bytes()))
    return [r[0] for r in ranks], [r[1] for r in ranks]


# metrics.jsonl names of parallel.activation_accounting.StepFigures' fields, lists by rank.
SAVED_BYTES_FIELDS = {"saved_bytes_peak": "peak_bytes", "saved_bytes_total": "total_bytes",
                      "saved_param_bytes": "param_bytes", "offloaded_bytes": "offloaded_bytes",
                      "reloaded_bytes": "reloaded_bytes"}


def gather_saved_bytes(figures: StepFigures) -> dict[str, list[int]]:
    """Every rank's saved-for-backward figures of the step, in rank order, on every rank."""
    ranks = gather_per_rank([getattr(figures, f) for f in SAVED_BYTES_FIELDS.values()])
    return {name: [r[i] for r in ranks] for i, name in enumerate(SAVED_BYTES_FIELDS)}


class MetricsLogger:
    """Writes the console progress line and appends to metrics.jsonl (rank 0 only), and the
    same scalars to ``<run dir>/tensorboard`` when the ``tensorboard`` package is installed
    (``pip install -e ".[tensorboard]"``; ``TensorBoardScalars``)."""

    def __init__(self, run_dir: str, train_iters: int) -> None:
        self.train_iters = train_iters
        self.is_writer = dist.get_rank() == 0
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.started = time.monotonic()
        self.tensorboard = (TensorBoardScalars(os.path.join(run_dir, "tensorboard"))
                            if self.is_writer and tensorboard_installed() else None)

    def log(self, record: dict[str, Any]) -> None:
        if not self.is_writer:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.write(record)
        print(self._console_line(record), flush=True, file=sys.stdout)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()

    def _console_line(self, r: dict[str, Any]) -> str:
        step = r["step"]
        pct = 100.0 * step / max(1, self.train_iters)
        elapsed = time.monotonic() - self.started
        peak_mib = max(r.get("mem_peak_bytes", [0])) / 2**20
        kl = f" | indexer_kl {r['indexer_kl']:.3e}" if "indexer_kl" in r else ""
        mtp = f" | mtp_loss {r['mtp_loss']:.4f}" if "mtp_loss" in r else ""
        rl = (f" | reward {r['reward_mean']:.3f} | masked {r['rl_masked_fraction']:.3f}"
              f" | dropped {r['rl_dropped_rollouts']}" if "rl_masked_fraction" in r else "")
        load = (f" | expert max/mean {r['expert_load_worst_max_over_mean']:.2f}"
                if "expert_load_worst_max_over_mean" in r else "")
        comm = (f" | max rank sent {max(r['comm_bytes']) / 2**20:.1f} MiB"
                if r.get("comm_bytes") else "")
        return (f"step {step}/{self.train_iters} ({pct:5.1f}%) | loss {r['loss']:.4f}{mtp}{kl}{rl} | "
                f"grad_norm {r['grad_norm']:.3f} | lr {r['lr']:.3e} | "
                f"tokens/s {r['tokens_per_s']:.0f} | consumed_tokens {r['consumed_tokens']}{load} | "
                f"max rank peak {peak_mib:.0f} MiB{comm} | elapsed {elapsed:.0f}s")


def tensorboard_installed() -> bool:
    """Whether to write TensorBoard events: the package is installed and ``GLM5_TENSORBOARD``
    is not ``0`` (the off switch)."""
    if os.environ.get("GLM5_TENSORBOARD", "1") == "0":
        return False
    return importlib.util.find_spec("tensorboard") is not None


# metrics.jsonl fields written to TensorBoard as one scalar each; per-rank lists become one
# scalar per rank (``<name>/rank<i>``) under these names.
TENSORBOARD_SCALARS = ("loss", "mtp_loss", "mtp_loss_1", "mtp_loss_2", "mtp_loss_3",
                       "indexer_kl", "grad_norm", "lr", "tokens_per_s", "consumed_tokens",
                       "step_time_s", "tflops_per_gpu", "mfu",
                       # RL objectives (glm5_train/rl/objective.py global_rl_stats)
                       "reward_mean", "rl_masked_fraction", "rl_clipped_fraction",
                       "rl_logp_diff_mean", "rl_logp_diff_max", "rl_policy_drift", "rl_ratio_p05", "rl_ratio_p50",
                       "rl_ratio_p95", "rl_ratio_min", "rl_ratio_max", "rl_rollouts",
                       "rl_dropped_rollouts", "rl_entropy",
                       # expert load over layers (glm5_train/expert_load.py load_fields)
                       "expert_load_worst_max_over_mean", "expert_load_worst_cv")
TENSORBOARD_PER_RANK = ("mem_peak_bytes", "mem_rss_bytes", "comm_bytes", "saved_bytes_peak",
                        "offloaded_bytes", "step_time_ms")
# per-phase dicts of per-rank lists ({phase: [per rank]}, glm5_train/phase_times.py)
TENSORBOARD_PER_PHASE = {"phase_ms": "phases"}
# per-MoE-layer dicts ({layer: value}) written as one scalar per layer (``<tag>/<layer>``)
TENSORBOARD_PER_LAYER = {"expert_load_max_over_mean": "expert_load/max_over_mean",
                         "expert_load_cv": "expert_load/cv"}


class TensorBoardScalars:
    """metrics.jsonl's scalars as TensorBoard events, step = the record's step. A resumed run
    redoes the steps after its checkpoint: the writer opens with ``purge_step`` at its first
    step, so TensorBoard drops the earlier attempt's events from there on (one value per
    step, as metrics.jsonl keeps). Reads the records only: no effect on training."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self._writer = None

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.log_dir, purge_step=step)
        for name in TENSORBOARD_SCALARS:
            if isinstance(record.get(name), (int, float)):
                self._writer.add_scalar(f"train/{name}", record[name], step)
        for name in TENSORBOARD_PER_RANK:
            for rank, value in enumerate(record.get(name) or []):
                self._writer.add_scalar(f"ranks/{name}/rank{rank}", value, step)
        for name, tag in TENSORBOARD_PER_LAYER.items():
            for layer, value in (record.get(name) or {}).items():
                if value is not None:  # None: the layer received no token
                    self._writer.add_scalar(f"{tag}/{layer}", value, step)
        for name, tag in TENSORBOARD_PER_PHASE.items():
            for phase, ranks in (record.get(name) or {}).items():
                for rank, value in enumerate(ranks):
                    self._writer.add_scalar(f"{tag}/{phase}_ms/rank{rank}", value, step)
        # collectives by purpose (parallel/comm_meter.py): ms held, the busiest rank and the
        # mean over ranks (per rank: metrics.jsonl)
        for purpose, parts in (record.get("comm_by_purpose") or {}).items():
            held = parts["ms"]
            self._writer.add_scalar(f"comm_ms/{purpose}/max", max(held), step)
            self._writer.add_scalar(f"comm_ms/{purpose}/mean", sum(held) / len(held), step)
        for layer, bias in (record.get("expert_bias") or {}).items():
            self._writer.add_scalar(f"expert_bias/range/{layer}", max(bias) - min(bias), step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
