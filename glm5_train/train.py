"""The training job: ``torchrun --nproc-per-node N -m glm5_train.train model=glm5_tiny ...``.

Order of work: validate the whole config and the layout against the world size (before any
process group exists), install the device layer, create process groups, build data, model,
optimizer; load a checkpoint if asked; train with megatron-core's pipeline schedules; save.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from glm5_train.job_config import JobConfig
from glm5_train.run_dir import register_resolvers
from parallel import device
from parallel.layout import comm_device, init_distributed, validate_layout, world_from_env


@dataclass
class Runtime:
    """Everything a training step needs, built once."""

    job: JobConfig
    config: object  # megatron-core MLATransformerConfig
    chunks: list
    optimizer: object
    scheduler: object
    dataset: object
    dp_rank: int
    dp_size: int
    zero2: object = None  # parallel.pipeline_zero2.PipelineZero2 when enabled


def validate_job(job: JobConfig) -> int:
    """All checks that need no process group; returns the data-parallel size. Fixes the
    pipeline layout (a given one checked, or one balanced for the MTP placement)."""
    from glm5_train.pipeline_plan import resolve_pipeline_layout

    rank, world, _ = world_from_env()
    dp = validate_layout(job.parallel, job.model, world, job.train.global_batch_size,
                         job.train.micro_batch_size, job.train.seq_length)
    layout = resolve_pipeline_layout(job, dp)
    if layout and layout != job.parallel.pipeline_model_parallel_layout and rank == 0:
        print(f"pipeline layout: {layout} (balanced, parallel.mtp_placement="
              f"{job.parallel.mtp_placement})", flush=True)
    job.parallel.pipeline_model_parallel_layout = layout
    return dp


def build_model(job: JobConfig) -> tuple[object, list]:
    """(megatron-core config, this rank's initialised model chunks), process groups existing.

    On CUDA megatron-core builds the parameters on this rank's GPU (no CPU copy of the model);
    the few it leaves on the host (the MoE router's weight) follow with ``.to``, as
    megatron's own ``get_model`` moves every chunk. On CPU nothing moves."""
    from glm5_train.config import to_mcore_config
    from glm5_train.init_weights import initialize_weights
    from glm5_train.model import build_model_chunks

    from glm5_train.tokenizer import build_tokenizer

    where = comm_device()
    config = to_mcore_config(job.model, job.parallel.sizes(), job.train.torch_dtype,
                             use_cpu_initialization=where.type == "cpu")
    eod = build_tokenizer(job.data.tokenizer).eod
    chunks = build_model_chunks(job.model, config, dsa_training=job.dsa, eod_token_id=eod)
    if where.type != "cpu":
        for chunk in chunks:
            chunk.to(where)
    initialize_weights(chunks, job.train.seed, job.model.initializer_range,
                       job.model.num_hidden_layers)
    return config, chunks


def build_runtime(job: JobConfig) -> Runtime:
    from megatron.core import parallel_state

    from glm5_train.optim import (attach_schedule_hooks, build_optimizer, build_scheduler,
                                  wrap_ddp)

    from glm5_train.model import apply_dsa_freezing
    from glm5_train.mtp import EmbeddingTie

    dataset = _build_dataset(job)
    config, chunks = build_model(job)
    apply_dsa_freezing(chunks, job.dsa)
    embedding_tie = EmbeddingTie(config, job.model.tie_word_embeddings)
    zero2, pinned = None, []
    if job.parallel.pipeline_zero2:
        from parallel.pipeline_zero2 import PipelineZero2

        zero2 = PipelineZero2()
        pinned = embedding_tie.holders(chunks) if embedding_tie.needs_sync(chunks) else []
    chunks = wrap_ddp(chunks, config, job.parallel.use_distributed_optimizer,
                      job.parallel.overlap_grad_reduce, zero2=zero2, pinned=pinned)
    optimizer = build_optimizer(chunks, job.train, job.parallel.use_distributed_optimizer,
                                job.train.torch_dtype)
    if zero2 is not None:
        from parallel.pipeline_zero2 import attach_to_optimizer

        attach_to_optimizer(optimizer, zero2)
    if job.train.optimizer == "muon":
        from glm5_train.muon import MuonConfig, install_muon

        t = job.train
        install_muon(optimizer, chunks, MuonConfig(t.muon_momentum, t.muon_nesterov,
                                                   t.muon_ns_steps, t.muon_split_mla), job.model,
                     zero_redundant=t.muon_zero_redundant)
    scheduler = build_scheduler(optimizer, job.train, job.train.train_iters)
    attach_schedule_hooks(chunks, config, optimizer, embedding_tie, zero2)
    return Runtime(job, config, chunks, optimizer, scheduler, dataset,
                   parallel_state.get_data_parallel_rank(),
                   parallel_state.get_data_parallel_world_size(), zero2)


def _build_dataset(job: JobConfig):
    from glm5_train.data import build_train_valid_test_datasets, ensure_builtin_corpus
    from glm5_train.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(job.data.tokenizer)
    if tokenizer.vocab_size > job.model.vocab_size:
        raise ValueError(
            f"tokenizer {job.data.tokenizer!r} has {tokenizer.vocab_size} tokens but "
            f"model.vocab_size={job.model.vocab_size}: raise model.vocab_size or use a smaller "
            "tokenizer")
    if not job.data.paths:
        job.data.paths = [ensure_builtin_corpus(job.data, tokenizer)]
    samples = job.train.train_iters * job.train.global_batch_size
    train, _, _ = build_train_valid_test_datasets(
        job.data, tokenizer, job.train.seq_length, job.train.seed, (samples, 0, 0))
    return train


def _iterators(rt: Runtime, consumed_samples: int) -> list:
    """One aligned iterator per model chunk: each chunk reads the same micro-batch sequence."""
    from glm5_train.data import build_train_iterator

    t = rt.job.train
    return [build_train_iterator(rt.dataset, t.micro_batch_size, t.global_batch_size,
                                 rt.dp_rank, rt.dp_size, consumed_samples,
                                 num_workers=rt.job.data.num_workers)
            for _ in rt.chunks]


def train_step(rt: Runtime, iterators: list) -> tuple[float, list]:
    """One optimizer step over a global batch: (grad norm, last-stage loss reports)."""
    from glm5_train.step import run_step

    t = rt.job.train
    for chunk in rt.chunks:
        chunk.zero_grad_buffer()
    if rt.zero2 is not None:
        rt.zero2.begin_step()
    rt.optimizer.zero_grad()
    num_micro = t.global_batch_size // (t.micro_batch_size * rt.dp_size)
    reports = run_step(rt.chunks, iterators, num_micro, t.seq_length, t.micro_batch_size)
    ok, grad_norm, _ = rt.optimizer.step()
    if not ok:
        raise FloatingPointError("optimizer step skipped: non-finite gradients")
    rt.scheduler.step(increment=1)
    return float(grad_norm), reports


def train(job: JobConfig, run_dir: str) -> list[dict]:
    """Run the whole job in this (already torchrun-launched) process; returns step records."""
    from glm5_train.checkpoint import TrainState, load_checkpoint, save_checkpoint
    from glm5_train.metrics import MetricsLogger, gather_memory
    from parallel.comm_meter import CommMeter, buffer_bytes, gather_fields

    validate_job(job)
    device.install()
    init_distributed(job.parallel, job.train.seed)
    rt = build_runtime(job)
    state = TrainState()
    if job.checkpoint.load:
        state = load_checkpoint(job.checkpoint.load, rt.chunks, rt.optimizer, rt.scheduler,
                                job.model, job.checkpoint.load_optimizer)
    logger = MetricsLogger(run_dir, job.train.train_iters)
    iterators = _iterators(rt, state.consumed_samples)
    records = []
    while state.iteration < job.train.train_iters:
        started = time.perf_counter()
        meter = CommMeter()  # this step's collectives on this rank (the loss's included)
        with meter.measure():
            grad_norm, reports = train_step(rt, iterators)
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
    from glm5_train.model import indexer_kl
    from glm5_train.step import global_loss

    loss, tokens = global_loss(reports)
    stats = {"loss": loss, "loss_tokens": tokens}
    if rt.job.model.mtp_sets:
        from glm5_train.step import global_mtp_losses

        per_step = global_mtp_losses(reports, rt.job.model.mtp_num_steps)
        stats["mtp_loss"] = sum(per_step) / len(per_step)
        stats.update({f"mtp_loss_{k}": v for k, v in enumerate(per_step, start=1)})
    if rt.job.dsa.trains_indexer:
        stats["indexer_kl"] = global_indexer_kl(*indexer_kl(rt.chunks))
    return stats


def global_indexer_kl(kl_sum: float, queries: int) -> float:
    """Mean KL per (layer, query) over the job. Every TP rank computes the same KL (the
    indexer is replicated), so the TP replicas cancel in the ratio."""
    import torch.distributed as dist

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
    import logging
    import warnings

    for pattern in ("Transformer Engine and Apex are not installed", "Apex is not installed"):
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("megatron").setLevel(logging.WARNING)


def main() -> None:
    import hydra

    register_resolvers()
    quiet_megatron()

    @hydra.main(version_base=None, config_path=_config_dir(), config_name="config")
    def _run(tree) -> None:
        from hydra.core.hydra_config import HydraConfig

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
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
