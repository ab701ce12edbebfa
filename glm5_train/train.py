"""The training job: ``torchrun --nproc-per-node N -m glm5_train.train model=glm5_tiny ...``.

``glm5_train.assembly.assemble`` builds the run (its docstring gives the order and why); this
module loads a checkpoint if asked, trains with megatron-core's pipeline schedules, logs one
record per step and saves.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from typing import NoReturn

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException

from glm5_train.assembly import Runtime, assemble, iterators, validate_job
from glm5_train.checkpoint import TrainState, load_checkpoint, save_checkpoint
from glm5_train.job_config import CONFIG_ERRORS, JobConfig, one_line
from glm5_train.metrics import MetricsLogger, gather_memory, gather_saved_bytes
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
    if rt.activations is not None:
        rt.activations.begin_step()
    reports = run_step(rt.chunks, iterators, num_micro, t.seq_length, t.micro_batch_size,
                       rt.groups, activations=rt.activations)
    if rt.activations is not None:  # this step's saved-for-backward figures
        rt.activations.end_step()
    if rt.param_grad_norms is not None:  # the reduced gradients the step clips and applies
        rt.param_grad_norms.measure()
    ok, grad_norm, _ = rt.optimizer.step()
    if not ok:
        raise FloatingPointError("optimizer step skipped: non-finite gradients")
    rt.scheduler.step(increment=1)
    return float(grad_norm), reports


def train(job: JobConfig, run_dir: str, validated: bool = False) -> list[dict]:
    """Run the whole job in this (already torchrun-launched) process; returns step records.
    ``validated``: ``validate_job`` has just run (the Hydra entry point runs it first, to report
    a config error in one line)."""
    rt = assemble(job, validated)
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
            if rt.activations is not None:
                record.update(gather_saved_bytes(rt.activations.figures))
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
    record = {
        "step": state.iteration,
        **stats,
        "grad_norm": grad_norm,
        "lr": rt.optimizer.param_groups[0]["lr"],
        "tokens_per_s": tokens_per_s,
        "consumed_tokens": state.consumed_tokens,
        "consumed_samples": state.consumed_samples,
    }
    if rt.param_grad_norms is not None:  # gathered here, outside the step's comm meter
        record["param_grad_norms"] = rt.param_grad_norms.gather()
    return record


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


CONFIG_ERROR_STATUS = 2  # as launch.local's (and argparse's) usage errors
# How long ranks other than 0 wait, after a config error, for the launcher to stop them.
PEER_EXIT_WAIT_S = 60.0


def main() -> None:
    register_resolvers()
    quiet_megatron()
    # Without this Hydra's run_and_report prints every error itself, traceback and all, on
    # every rank; with it errors propagate, and composition errors reach the handler below.
    os.environ["HYDRA_FULL_ERROR"] = "1"

    @hydra.main(version_base=None, config_path=_config_dir(), config_name="config")
    def _run(tree) -> None:
        quiet_megatron()  # Hydra has just (re)configured logging
        try:  # everything that can refuse the config, before any process group exists
            job = JobConfig.from_hydra(tree)
            validate_job(job)
        except CONFIG_ERRORS as err:
            exit_on_config_error(err)
        run_dir = HydraConfig.get().runtime.output_dir
        train(job, run_dir, validated=True)
        # Only on success: after a failure the other ranks may never reach a barrier, and
        # torchrun tears the job down anyway.
        _shutdown()

    try:
        _run()
    except CompactHydraException as err:  # raised while composing, before _run's body
        exit_on_config_error(err)


def exit_on_config_error(err: BaseException) -> NoReturn:
    """Print ``glm5_train: error: <message>`` on rank 0 only and exit with status 2.

    The other ranks print nothing and wait for the launcher to stop them: torchrun stops
    every worker as soon as the first one exits, so their exiting first could cut rank 0 off
    before it reports. The exit is immediate (``os._exit``, after flushing): no process group
    exists yet, so no peer can hang on this rank and there is nothing to tear down, while the
    interpreter's teardown of torch and megatron-core alone takes 1-3 s; and nothing (Hydra's
    error reporting included) can print after the one line."""
    if int(os.environ.get("RANK", "0")) != 0:
        time.sleep(PEER_EXIT_WAIT_S)  # normally ended by torchrun's SIGTERM
    else:
        message = one_line(err)
        _record_for_torchrun(message)
        print(f"glm5_train: error: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(CONFIG_ERROR_STATUS)


def _record_for_torchrun(message: str) -> None:
    """Leave the message where torchrun's agent reads a worker's failure (the file
    TORCHELASTIC_ERROR_FILE names, in the JSON layout of torch.distributed.elastic's
    ErrorHandler), so torchrun's failure summary gives it as the root cause, not a pointer
    to its traceback docs. Not under torchrun: nothing to do."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": message, "extraInfo": {
        "py_callstack": message, "timestamp": str(int(time.time()))}}}
    with open(path, "w") as out:
        json.dump(record, out)


def _config_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def _shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
