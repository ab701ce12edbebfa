"""The training job: ``torchrun --nproc-per-node N -m glm5_train.train model=glm5_tiny ...``.

``glm5_train.assembly.assemble`` builds the run (its docstring gives the order and why); this
module loads a checkpoint if asked, trains with megatron-core's pipeline schedules, logs one
record per step and saves.
"""

from __future__ import annotations

import logging
import os
import time
import warnings

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig

from glm5_train.assembly import Runtime, assemble, iterators
from glm5_train.checkpoint import TrainState, load_checkpoint, save_checkpoint
from glm5_train.job_config import JobConfig
from glm5_train.metrics import MetricsLogger, gather_memory
from glm5_train.model.glm5 import indexer_kl
from glm5_train.run_dir import register_resolvers
from glm5_train.step import global_loss, global_mtp_losses, run_step
from parallel.comm_meter import CommMeter, buffer_bytes, gather_fields
from parallel.device import comm_device


def train_step(rt: Runtime, iterators: list) -> tuple[float, list]:
    """One optimizer step over a global batch: (grad norm, last-stage loss reports)."""
    t = rt.job.train
    for chunk in rt.chunks:
        chunk.zero_grad_buffer()
    if rt.zero2 is not None:
        rt.zero2.begin_step()
    rt.optimizer.zero_grad()
    num_micro = t.global_batch_size // (t.micro_batch_size * rt.dp_size)
    reports = run_step(rt.chunks, iterators, num_micro, t.seq_length, t.micro_batch_size,
                       rt.groups)
    ok, grad_norm, _ = rt.optimizer.step()
    if not ok:
        raise FloatingPointError("optimizer step skipped: non-finite gradients")
    rt.scheduler.step(increment=1)
    return float(grad_norm), reports


def train(job: JobConfig, run_dir: str) -> list[dict]:
    """Run the whole job in this (already torchrun-launched) process; returns step records."""
    rt = assemble(job)
    state = TrainState()
    if job.checkpoint.load:
        state = load_checkpoint(job.checkpoint.load, rt.chunks, rt.optimizer, rt.scheduler,
                                job.model, job.checkpoint.load_optimizer)
    logger = MetricsLogger(run_dir, job.train.train_iters)
    data = iterators(rt, state.consumed_samples)
    records = []
    while state.iteration < job.train.train_iters:
        started = time.perf_counter()
        meter = CommMeter()  # this step's collectives on this rank (the loss's included)
        with meter.measure():
            grad_norm, reports = train_step(rt, data)
            elapsed = time.perf_counter() - started
            stats = step_statistics(rt, reports)
        state.iteration += 1
        state.consumed_samples += job.train.global_batch_size
        batch_tokens = job.train.global_batch_size * job.train.seq_length
        state.consumed_tokens += batch_tokens
        record = _record(rt, state, stats, grad_norm, batch_tokens / elapsed)
        if state.iteration % job.train.log_interval == 0 or state.iteration == 1:
            record["mem_rss_bytes"], record["mem_peak_bytes"] = gather_memory()
            record.update(gather_fields(meter, buffer_bytes(rt.chunks, rt.optimizer, rt.zero2)))
            logger.log(record)
        records.append(record)
        if _should_save(job, state.iteration):
            save_checkpoint(job.checkpoint.save, rt.chunks, rt.optimizer, rt.scheduler, state,
                            job.model)
    return records


def step_statistics(rt: Runtime, reports: list) -> dict:
    """The step's global LM loss and loss tokens, and the mean indexer KL (when trained)."""
    loss, tokens = global_loss(reports, rt.groups)
    stats = {"loss": loss, "loss_tokens": tokens}
    if rt.job.model.mtp_sets:
        per_step = global_mtp_losses(reports, rt.job.model.mtp_num_steps, rt.groups)
        stats["mtp_loss"] = sum(per_step) / len(per_step)
        stats.update({f"mtp_loss_{k}": v for k, v in enumerate(per_step, start=1)})
    if rt.job.dsa.trains_indexer:
        stats["indexer_kl"] = global_indexer_kl(*indexer_kl(rt.chunks))
    return stats


def global_indexer_kl(kl_sum: float, queries: int) -> float:
    """Mean KL per (layer, query) over the job. Every TP rank computes the same KL (the
    indexer is replicated), so the TP replicas cancel in the ratio."""
    totals = torch.tensor([kl_sum, float(queries)], dtype=torch.float64, device=comm_device())
    dist.all_reduce(totals)
    return float(totals[0] / totals[1]) if totals[1] > 0 else 0.0


def _record(rt: Runtime, state, stats: dict, grad_norm: float, tokens_per_s: float) -> dict:
    return {
        "step": state.iteration,
        **stats,
        "grad_norm": grad_norm,
        "lr": rt.optimizer.param_groups[0]["lr"],
        "tokens_per_s": tokens_per_s,
        "consumed_tokens": state.consumed_tokens,
        "consumed_samples": state.consumed_samples,
    }


def _should_save(job: JobConfig, iteration: int) -> bool:
    ckpt = job.checkpoint
    if not ckpt.save:
        return False
    at_interval = ckpt.save_interval is not None and iteration % ckpt.save_interval == 0
    return at_interval or iteration == job.train.train_iters


def quiet_megatron() -> None:
    """megatron-core logs every parameter name at INFO and warns at import that TE/Apex are
    absent (expected on CPU); keep the console to our progress lines and real problems."""
    for pattern in ("Transformer Engine and Apex are not installed", "Apex is not installed"):
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("megatron").setLevel(logging.WARNING)


def main() -> None:
    register_resolvers()
    quiet_megatron()

    @hydra.main(version_base=None, config_path=_config_dir(), config_name="config")
    def _run(tree) -> None:
        quiet_megatron()  # Hydra has just (re)configured logging
        job = JobConfig.from_hydra(tree)
        run_dir = HydraConfig.get().runtime.output_dir
        train(job, run_dir)
        # Only on success: after a failure the other ranks may never reach a barrier, and
        # torchrun tears the job down anyway.
        _shutdown()

    _run()


def _config_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def _shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
