"""The training job: ``torchrun --nproc-per-node N -m glm5_train.train model=glm5_tiny ...``.

``glm5_train.assembly.assemble`` builds the run (its docstring gives the order and why); this
module resumes from a checkpoint (``checkpoint.load``: ``auto`` = the newest complete one in
``checkpoint.save``), trains with megatron-core's pipeline schedules, logs one record per step
and saves. At each step boundary, after the backward and before the update, one all-reduce
makes every rank agree on what the step needs: a non-finite loss or gradient anywhere
(``glm5_train.bad_steps``: reported, then skipped or the job stopped), a stop signal on any rank
(``glm5_train.preemption``: save after this step and exit 0), a save due by the clock
(``checkpoint.save_interval_minutes``, rank 0's).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException

from glm5_train import known_warnings
from glm5_train.assembly import Runtime, assemble, iterators, num_microbatches, validate_job
from glm5_train.bad_steps import (
    BatchPosition,
    ExpertBiasSnapshot,
    GradientWatch,
    NonFinitePolicy,
    NonFiniteStepError,
    bad_loss_micro_batches,
    gather_report,
    nonfinite_loss_count,
)
from glm5_train.checkpoint import (
    AUTO,
    CheckpointUnfitError,
    NoCheckpointError,
    TrainState,
    choose_checkpoint,
    load_checkpoint,
    optimizer_mismatch,
    save_checkpoint,
    schedule_end_lr,
    set_peak_lr,
)
from glm5_train.data import build_train_iterator
from glm5_train.expert_load import ExpertLoad
from glm5_train.flexible_batches import FlexibleBatches, plan_record
from glm5_train.job_config import CONFIG_ERRORS, JobConfig, one_line
from glm5_train.metrics import MetricsLogger, gather_memory, gather_per_rank, gather_saved_bytes
from glm5_train.model import triton_sparse_mla
from glm5_train.model.glm5 import indexer_kl
from glm5_train.phase_times import PHASES, PhaseTimes
from glm5_train.preemption import StopRequest, forked_children_die_with_this_process, signal_name
from glm5_train.profiling import StepProfiler
from glm5_train.rl.objective import global_rl_stats
from glm5_train.rl.publisher import WeightPublisher
from glm5_train.rl.rollout_data import step_summary
from glm5_train.rl.stream import RolloutStreamError, StreamedRollouts
from glm5_train.run_dir import register_resolvers
from glm5_train.schedules import BatchSchedule
from glm5_train.step import global_loss, global_mtp_losses, run_step
from parallel.comm_meter import CommMeter, buffer_bytes, gather_fields, names_of_groups
from parallel.comm_purpose import collective_purpose
from parallel.deferred_wgrad import FIGURE_NAMES as WGRAD_FIGURES
from parallel.device import comm_device
from parallel.int4_qat import FIGURE_NAMES as QAT_FIGURES


@dataclass
class StepOutcome:
    """What one training step did, as every rank agrees."""

    stats: dict  # step_statistics: the global losses (and indexer KL)
    grad_norm: float  # nan for a step whose update was not applied
    nonfinite_report: str | None = None  # set: the update was not applied (glm5_train.bad_steps)
    stop_signal: int = 0  # a stop signal some rank received (its number), 0: none
    save_due: bool = False  # checkpoint.save_interval_minutes has passed (rank 0's clock)


class StepBoundary:
    """The one all-reduce (MAX) per step that makes every rank agree, after the backward and
    before the update, on: non-finite values anywhere, a stop signal on any rank, a save due by
    rank 0's clock. It is bookkeeping, like the metrics' gathers: the comm meter leaves it out."""

    def __init__(self, rt: Runtime, stop: StopRequest, save_every_s: float | None) -> None:
        self.rt, self.stop, self.save_every_s = rt, stop, save_every_s
        self.watch = GradientWatch(rt.chunks, rt.optimizer, rt.zero2, rt.param_grad_norms)
        self.expert_bias = ExpertBiasSnapshot(rt.chunks)
        self.last_save = time.monotonic()

    def before_step(self) -> None:
        self.expert_bias.take()

    @collective_purpose("agree")
    def agree(self, reports: list, stats: dict, step_index: int) -> StepOutcome:
        """``step_index``: the step's global batch (0 for the first step of the run)."""
        due = (self.save_every_s is not None and dist.get_rank() == 0
               and time.monotonic() - self.last_save >= self.save_every_s)
        bad = (self.watch.count_bad().to(comm_device(), torch.float64)
               + nonfinite_loss_count(reports))
        votes = torch.stack([bad.reshape(()), *torch.tensor(
            [float(self.stop.received), float(due)], dtype=torch.float64,
            device=comm_device())])
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        any_bad, stop_signal, save_due = votes.tolist()
        outcome = StepOutcome(stats, math.nan, stop_signal=int(stop_signal),
                              save_due=bool(save_due))
        if any_bad > 0:
            outcome.nonfinite_report = self._report(reports, stats, step_index)
            self.expert_bias.restore()
        return outcome

    def _report(self, reports: list, stats: dict, step_index: int) -> str:
        t, rt = self.rt.job.train, self.rt
        batch = BatchPosition(step_index, rt.global_batch_now or t.global_batch_size,
                              t.micro_batch_size, rt.dp_rank, rt.dp_size,
                              first=rt.batch_start)
        found = self.watch.findings(dist.get_rank())
        found.bad_loss_samples = [s for micro in bad_loss_micro_batches(reports)
                                  for s in batch.micro_batch_samples(micro)]
        return gather_report(found, step_index + 1, stats["loss"], batch)

    def saved(self) -> None:
        self.last_save = time.monotonic()


def train_step(rt: Runtime, iterators: list, meter: CommMeter | None = None,
               boundary: StepBoundary | None = None, step_index: int = 0) -> StepOutcome:
    """One optimizer step over a global batch. ``meter``: counts the step's collectives (not
    the boundary's); ``boundary``: checks the step before its update (None: no checks)."""
    meter = meter or CommMeter()
    phases = rt.phases or PhaseTimes(torch.device("cpu"))
    phases.begin_step()
    if boundary is not None:
        boundary.before_step()
    if rt.objective is not None:  # the learner's policy version: the steps taken so far
        rt.objective.learner_version = step_index
        if old_policy_due(rt, step_index):
            with meter.measure():
                record_old_policy(rt, step_index)
    with meter.measure():
        with phases.measure("forward_backward"):
            reports = _forward_backward(rt, iterators)
        stats = step_statistics(rt, reports)
    if rt.param_grad_norms is not None:  # the reduced gradients the step clips and applies
        rt.param_grad_norms.measure()
    outcome = (boundary.agree(reports, stats, step_index) if boundary is not None
               else StepOutcome(stats, math.nan))
    if outcome.nonfinite_report is not None:
        return outcome  # no update, no schedule step, the expert biases put back
    with meter.measure(), phases.measure("optimizer"):
        ok, grad_norm, _ = rt.optimizer.step()
    if not ok:
        raise FloatingPointError("optimizer step skipped: non-finite gradients")
    rt.scheduler.step(increment=1)
    outcome.grad_norm = float(grad_norm)
    return outcome


def _forward_backward(rt: Runtime, iterators: list) -> list:
    """The pipeline schedule over one global batch; returns the last stage's loss reports."""
    t = rt.job.train
    for chunk in rt.chunks:
        chunk.zero_grad_buffer()
    if rt.zero2 is not None:
        rt.zero2.begin_step()
    rt.optimizer.zero_grad()
    num_micro = (rt.global_batch_now or t.global_batch_size) // (t.micro_batch_size * rt.dp_size)
    seq_length = t.seq_length
    if isinstance(iterators, FlexibleBatches):  # this global batch's plan, its micro-batches
        planned = iterators.next_step()
        seq_length = iterators.rank_tokens
        iterators, num_micro = planned.iterators, planned.num_microbatches
        rt.last_plan = planned.plan
    if rt.activations is not None:
        rt.activations.begin_step()
    if rt.wgrad is not None:
        rt.wgrad.begin_step()
    if rt.qat is not None:  # the optimizer moved the weights: requantise at first use
        rt.qat.begin_step()
    reports = run_step(rt.chunks, iterators, num_micro, seq_length, t.micro_batch_size,
                       rt.groups, activations=rt.activations, wgrad=rt.wgrad,
                       objective=rt.objective)
    if rt.activations is not None:  # this step's saved-for-backward figures
        rt.activations.end_step()
    return reports


def old_policy_due(rt: Runtime, step_index: int) -> bool:
    """pi_old must be recorded before this step: a batch of rollouts feeding
    rl.updates_per_batch > 1 updates starts here, or the run resumed inside one (its pi_old
    went with the stopped process). The same answer on every rank."""
    old = rt.objective.old_policy
    return old is not None and step_index >= old.recorded_through


def record_old_policy(rt: Runtime, step_index: int) -> None:
    """pi_old of the rollout batch under way at ``step_index``: one forward pass, without
    gradients, over its global batches from this step to the batch's last (fresh iterators
    over the same samples the updates will read), each micro-batch's log-probs kept on the
    last stage. Resumed inside a batch, pi_old is the resumed weights (a rank-0 notice)."""
    t, updates = rt.job.train, rt.job.rl.updates_per_batch
    into = step_index % updates
    if into and dist.get_rank() == 0:
        print(f"rl: resumed at update {into + 1} of {updates} of a batch of rollouts: pi_old "
              "for its remaining updates is the resumed weights (the batch's first weights "
              "went with the stopped run)", flush=True)
    updates -= into
    first = step_index * t.global_batch_size
    readers = [build_train_iterator(rt.dataset, t.micro_batch_size, t.global_batch_size,
                                    rt.dp_rank, rt.dp_size, first) for _ in rt.chunks]
    if rt.qat is not None:  # the optimizer moved the weights: pi_old uses them requantised
        rt.qat.begin_step()
    old = rt.objective.old_policy
    old.recording = True
    try:
        with torch.no_grad():
            run_step(rt.chunks, readers, updates * num_microbatches(rt.job, rt.groups),
                     t.seq_length, t.micro_batch_size, rt.groups, forward_only=True,
                     objective=rt.objective)
    finally:
        old.recording = False
    old.recorded_through = step_index + updates


def train(job: JobConfig, run_dir: str, validated: bool = False) -> list[dict]:
    """Run the whole job in this (already torchrun-launched) process; returns step records.
    ``validated``: ``validate_job`` has just run (the Hydra entry point runs it first, to report
    a config error in one line)."""
    forked_children_die_with_this_process()  # no checkpoint writer outlives a killed rank
    rt = assemble(job, validated)
    state = resume(job, rt)
    forget_steps_after(run_dir, state.iteration)
    logger = MetricsLogger(run_dir, job.train.train_iters)
    data = iterators(rt, state.consumed_samples)
    t, ckpt = job.train, job.checkpoint
    batches = BatchSchedule(t.global_batch_size, t.micro_batch_size, rt.dp_size,
                            t.rampup_batch_size)
    # Tokens per expert of every MoE layer, summed over the job (its hooks only read the
    # routers' choices); train.log_expert_load.
    expert_load = ExpertLoad(rt.chunks, dist.group.WORLD) if t.log_expert_load else None
    policy = NonFinitePolicy(t.nonfinite, t.nonfinite_max_consecutive, t.nonfinite_max_total)
    minutes = ckpt.save_interval_minutes if ckpt.save else None
    records = []
    profiler = StepProfiler(run_dir, t.profile_steps, t.profile_shapes, t.profile_memory,
                            t.profile_ranks, t.profile_warmup)
    stream = rt.dataset if isinstance(rt.dataset, StreamedRollouts) else None
    if stream is not None:  # the groups consumed; before the first version is published,
        stream.resume(state.iteration, group=None)  # which engines wait for
    publisher = start_publishing(job, rt, state.iteration)
    group_names = names_of_groups(rt.groups)
    # each collective timed by purpose on the device's clock; train.log_comm_by_purpose
    purpose_clock = comm_device().type if t.log_comm_by_purpose else None
    with StopRequest() as stop:
        boundary = StepBoundary(rt, stop, minutes * 60.0 if minutes else None)
        while state.iteration < t.train_iters:
            if stream is not None:  # this step's groups, as they have arrived
                groups = stream.prepare_step(state.iteration, group=None, stop=stop)
                if groups.stop:
                    _stop_while_waiting(job, rt, state, stop.received)
                    break
            profiler.step_begins(state.iteration + 1)
            started, cpu_started = time.perf_counter(), time.process_time()
            # This step's collectives on this rank (the loss's included), by group size, by
            # megatron-core group name and by purpose (with the time each purpose held it).
            meter = CommMeter(group_names=group_names, time_purposes=purpose_clock)
            rt.batch_start = state.consumed_samples
            rt.global_batch_now = batches.size_at(state.consumed_samples)
            if expert_load is not None:
                expert_load.begin_step()
            outcome = train_step(rt, data, meter, boundary, step_index=state.iteration)
            if isinstance(data, FlexibleBatches):  # the measured micro-batches refit the model
                data.observe_step(rt.last_plan)
                rt.last_cell_seconds = data.measured_rank_work()
            if rt.objective is not None:  # the step's rewards, from the records it trained on
                outcome.stats.update(step_summary(rt.dataset, state.iteration,
                                                  t.global_batch_size))
            if stream is not None:  # groups taken and dropped, waiting, staleness
                outcome.stats.update(stream.step_record(groups))
            elapsed = time.perf_counter() - started
            cpu_ms = int(1000 * (time.process_time() - cpu_started))
            profiler.step_ends(state.iteration + 1)
            state.iteration += 1
            state.consumed_samples += rt.global_batch_now
            batch_tokens = rt.global_batch_now * t.seq_length
            state.consumed_tokens += batch_tokens
            record = _record(rt, state, outcome.stats, outcome.grad_norm, batch_tokens / elapsed)
            stop_error = _judge(policy, outcome, record)
            if state.iteration % t.log_interval == 0 or state.iteration == 1 or stop_error:
                _log(rt, logger, record, meter, cpu_ms, expert_load, elapsed)
            records.append(record)
            if stop_error is not None:
                raise stop_error
            if _save_then_stop(job, rt, state, outcome, boundary):
                break
            if publisher is not None and state.iteration % job.rl.publish_interval == 0:
                publisher.publish(state.iteration)
    return records


def start_publishing(job: JobConfig, rt: Runtime, iteration: int) -> WeightPublisher | None:
    """rl.publish_dir: the publisher of the engines' weight versions. The weights the run
    starts from are version ``iteration`` (published unless it exists; ``latest`` points at
    it, and versions an earlier attempt published past its last checkpoint go): the engines
    generate from them while the first steps train."""
    rl = job.rl
    if not rl.publish_dir:
        return None
    publisher = WeightPublisher(job, rt.chunks, rl.publish_dir, rl.publish_keep,
                                rl.publish_dtype)
    publisher.start_at(iteration)
    return publisher


def _log(rt: Runtime, logger: MetricsLogger, record: dict, meter: CommMeter,
         cpu_ms: int, expert_load: ExpertLoad | None = None, step_s: float = 0.0) -> None:
    """Add the per-rank figures (memory, communication, saved bytes, the step's CPU time: the
    work each rank did, which on an oversubscribed machine wall time cannot show; its wall
    time by phase), the step's expert load summed over the job, and log."""
    record["mem_rss_bytes"], record["mem_peak_bytes"] = gather_memory()
    # With the step's CPU time and wall time (µs) and its phases' (µs), each rank's Triton
    # sparse-MLA launches so far (forward, backward): where they ran. One gather for all.
    phases = rt.phases.seconds if rt.phases is not None else dict.fromkeys(PHASES, 0.0)
    launches = list(triton_sparse_mla.LAUNCHES.values())
    ranks = gather_per_rank([cpu_ms, round(1e6 * step_s),
                             *(round(1e6 * phases[p]) for p in PHASES), *launches])
    record["step_cpu_ms"] = [r[0] for r in ranks]
    record["step_time_s"] = round(step_s, 6)
    if rt.rate is not None:
        record.update(rt.rate.fields(step_s, rt.global_batch_now))
    record["step_time_ms"] = [r[1] / 1000 for r in ranks]
    record["phase_ms"] = {p: [r[2 + i] / 1000 for r in ranks] for i, p in enumerate(PHASES)}
    record["sparse_kernel_launches"] = [r[2 + len(PHASES):] for r in ranks]
    if rt.last_plan is not None:
        record["flexible_cp"] = plan_record(rt.last_plan, rt.cp_exchanges, rt.last_cell_seconds)
    record.update(gather_fields(meter, buffer_bytes(rt.chunks, rt.optimizer, rt.zero2)))
    if rt.activations is not None:
        record.update(gather_saved_bytes(rt.activations.figures))
    if rt.wgrad is not None:  # deferred weight gradients: queued, run in p2p, bytes held
        ranks = gather_per_rank(rt.wgrad.figures())
        record.update({name: [r[i] for r in ranks] for i, name in enumerate(WGRAD_FIGURES)})
    if rt.qat is not None:  # INT4 QAT: layers requantised, their buffers, the rounding error
        ranks = gather_per_rank(rt.qat.figures())
        record.update({name: [r[i] for r in ranks] for i, name in enumerate(QAT_FIGURES)})
    if expert_load is not None:
        record.update(expert_load.gather())
    logger.log(record)


def _save_then_stop(job: JobConfig, rt: Runtime, state: TrainState, outcome: StepOutcome,
                    boundary: StepBoundary) -> bool:
    """Save when the step interval, the clock or a stop signal asks for it; True: stop now
    (a stop signal before the last step)."""
    ckpt, saved = job.checkpoint, None
    if _should_save(job, state.iteration) or (ckpt.save and (outcome.save_due
                                                              or outcome.stop_signal)):
        saved = save_checkpoint(ckpt.save, rt.chunks, rt.optimizer, rt.scheduler, state,
                                job.model, ckpt.keep_last)
        boundary.saved()
    if outcome.stop_signal and state.iteration < job.train.train_iters:
        _say_stopped(outcome.stop_signal, state.iteration, saved)
        return True
    return False


def _stop_while_waiting(job: JobConfig, rt: Runtime, state: TrainState, signal_number: int
                        ) -> None:
    """A stop signal while the step waited for rollouts: save the steps done, say so."""
    ckpt, saved = job.checkpoint, None
    if ckpt.save and state.iteration > 0:
        saved = save_checkpoint(ckpt.save, rt.chunks, rt.optimizer, rt.scheduler, state,
                                job.model, ckpt.keep_last)
    _say_stopped(signal_number, state.iteration, saved)


def _judge(policy: NonFinitePolicy, outcome: StepOutcome, record: dict) -> BaseException | None:
    """Count a non-finite step against the policy; None: go on (skipped steps are marked in
    their record and reported on the console), else the error that stops the job."""
    if outcome.nonfinite_report is None:
        policy.good_step()
        return None
    error = policy.bad_step(outcome.nonfinite_report)
    if error is None:
        record["skipped"] = True
        if dist.get_rank() == 0:
            print(f"glm5_train: skipped the update of {outcome.nonfinite_report}",
                  file=sys.stderr, flush=True)
    return error


def _say_stopped(signal_number: int, step: int, saved: str | None) -> None:
    """The line a scheduler's log shows for a stop on a signal (rank 0)."""
    if dist.get_rank() != 0:
        return
    where = f"checkpoint {saved}" if saved else "no checkpoint (checkpoint.save is null)"
    print(f"glm5_train: stopped by {signal_name(signal_number)} after step {step}; {where}",
          flush=True)


def resume(job: JobConfig, rt: Runtime) -> TrainState:
    """The state to start from: ``checkpoint.load`` (``auto``: the newest complete checkpoint
    in ``checkpoint.save``, none there: step 0; a directory: its newest, which must exist)."""
    ckpt = job.checkpoint
    root = ckpt.save if ckpt.load == AUTO else ckpt.load
    loaded = None
    if root:  # the schedule a stage started (lr_from_pretrained) is the one it saved
        loaded = load_checkpoint(root, rt.chunks, rt.optimizer, rt.scheduler, job.model,
                                 ckpt.load_optimizer, required=ckpt.load != AUTO,
                                 peak_from_checkpoint=job.train.lr_from_pretrained)
    if loaded is None and ckpt.pretrained:  # a new stage from another run's weights
        start_stage(job, rt)
        if job.train.lr_from_pretrained:
            continue_schedule(job, rt)
    state = loaded or TrainState()
    if rt.objective is not None:
        check_rollout_position(state, job.train.global_batch_size)
    return state


def continue_schedule(job: JobConfig, rt: Runtime) -> None:
    """train.lr_from_pretrained: this stage's schedule peaks (after any warm-up) at the
    learning rate where the pretrained run's schedule stands, in place of train.lr."""
    path, lr = schedule_end_lr(job.checkpoint.pretrained)
    if lr < job.train.min_lr:
        raise ValueError(f"train.lr_from_pretrained=true: {path} ends at learning rate {lr:g}, "
                         f"below this stage's train.min_lr={job.train.min_lr:g}: lower "
                         "train.min_lr, or set train.lr_from_pretrained=false")
    if lr < job.train.lr_warmup_init:
        raise ValueError(f"train.lr_from_pretrained=true: {path} ends at learning rate {lr:g}, "
                         f"below train.lr_warmup_init={job.train.lr_warmup_init:g} (the warm-up "
                         "would fall): lower train.lr_warmup_init")
    set_peak_lr(rt.optimizer, rt.scheduler, lr)
    if dist.get_rank() == 0:
        print(f"checkpoint: this stage's schedule starts at learning rate {lr:g}, where {path} "
              f"ended (train.lr_from_pretrained; train.lr={job.train.lr:g} is not used)",
              flush=True)


def start_stage(job: JobConfig, rt: Runtime) -> None:
    """A new stage from ``checkpoint.pretrained``: its weights, and its optimizer state when
    ``checkpoint.pretrained_optimizer`` asks and it is of this run's kind; step 0 and this
    run's own schedule either way."""
    ckpt = job.checkpoint
    path = choose_checkpoint(ckpt.pretrained, required=True)
    why_not = (optimizer_mismatch(path, rt.optimizer, rt.chunks) if ckpt.pretrained_optimizer
               else "off")
    if why_not is not None and ckpt.pretrained_optimizer is True:
        raise ValueError(f"checkpoint.pretrained_optimizer=true: cannot take the optimizer "
                         f"state of {path}: {why_not}; set checkpoint.pretrained_optimizer="
                         "auto or false for a fresh optimizer state")
    # A loaded state brings the previous stage's param groups (plain DDP: torch replaces them
    # whole; learning-rate bounds, betas, eps): this stage keeps its own settings.
    settings = [{k: v for k, v in g.items() if k != "params"} for g in rt.optimizer.param_groups]
    load_checkpoint(ckpt.pretrained, rt.chunks, rt.optimizer, None, job.model,
                    load_optimizer=why_not is None, chosen=path)
    for group, own in zip(rt.optimizer.param_groups, settings, strict=True):
        group.update(own)
    rt.scheduler.step(increment=0)
    if dist.get_rank() == 0:
        reason = f" ({why_not})" if why_not not in (None, "off") else ""
        optimizer = ("and its optimizer state" if why_not is None
                     else f"with a fresh optimizer state{reason}")
        print(f"checkpoint: starting from the weights of {ckpt.pretrained} {optimizer}, at "
              "step 0 with this stage's schedule", flush=True)


def check_rollout_position(state: TrainState, global_batch_size: int) -> None:
    """RL reads its records by step (global batch g = samples [g x GBS, (g + 1) x GBS)): a
    checkpoint whose data position is not its step x train.global_batch_size cannot continue
    on them (another batch size, or another stage's checkpoint)."""
    if state.consumed_samples != state.iteration * global_batch_size:
        raise CheckpointUnfitError(
            f"the checkpoint of step {state.iteration} has consumed {state.consumed_samples} "
            f"samples, not step x train.global_batch_size={global_batch_size} = "
            f"{state.iteration * global_batch_size}: RL reads its records by step; resume with "
            "the batch size it was saved with, or start a new RL stage from its weights with "
            "checkpoint.pretrained=<its directory> (and checkpoint.load=auto in a new run "
            "directory)")


def forget_steps_after(run_dir: str, iteration: int) -> None:
    """A run resumed in the run directory of an earlier attempt (a restart, a requeued job)
    redoes the steps after its checkpoint: their earlier records go from metrics.jsonl, so it
    holds each step once (rank 0; rewritten atomically; a line torn by a kill is dropped)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if dist.get_rank() != 0 or not os.path.exists(path):
        return
    with open(path) as handle:
        lines = [line for line in handle if line.strip()]
    kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= iteration]
    if len(kept) == len(lines):
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as handle:
        handle.writelines(line if line.endswith("\n") else line + "\n" for line in kept)
    os.replace(tmp, path)


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def step_statistics(rt: Runtime, reports: list) -> dict:
    """The step's global LM loss and loss tokens, and the mean indexer KL (when trained)."""
    loss, tokens = global_loss(reports, rt.groups)
    stats = {"loss": loss, "loss_tokens": tokens}
    if rt.job.runs_mtp:
        per_step = global_mtp_losses(reports, rt.job.model.mtp_num_steps, rt.groups)
        stats["mtp_loss"] = sum(per_step) / len(per_step)
        stats.update({f"mtp_loss_{k}": v for k, v in enumerate(per_step, start=1)})
    if rt.objective is not None:
        stats.update(global_rl_stats(reports, rt.groups, comm_device()))
    if rt.job.dsa.trains_indexer:
        stats["indexer_kl"] = global_indexer_kl(*indexer_kl(rt.chunks))
    return stats


@collective_purpose("indexer_kl")
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
        "global_batch_size": rt.global_batch_now or rt.job.train.global_batch_size,
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


CONFIG_ERROR_STATUS = 2  # as launch.local's (and argparse's) usage errors
NONFINITE_STATUS = 3  # stopped at a non-finite step (train.nonfinite)
ROLLOUT_STREAM_STATUS = 4  # streamed RL: no rollouts arrived in time (glm5_train/rl/stream.py)
# How long ranks other than 0 wait, after a config error, for the launcher to stop them.
PEER_EXIT_WAIT_S = 60.0


def main() -> None:
    register_resolvers()
    # Now that this process is a rank of a run (its environment says so: also in ranks forked
    # from a process that imported glm5_train earlier), the warnings glm5_train/known_warnings
    # does not hide show once per run, not once per rank.
    known_warnings.install()
    # Without this Hydra's run_and_report prints every error itself, traceback and all, on
    # every rank; with it errors propagate, and composition errors reach the handler below.
    os.environ["HYDRA_FULL_ERROR"] = "1"

    @hydra.main(version_base=None, config_path=_config_dir(), config_name="config")
    def _run(tree) -> None:
        known_warnings.install()  # Hydra has just (re)configured logging: its console handler
        try:  # everything that can refuse the config, before any process group exists
            job = JobConfig.from_hydra(tree)
            validate_job(job)
        except CONFIG_ERRORS as err:
            exit_on_config_error(err)
        run_dir = HydraConfig.get().runtime.output_dir
        try:
            train(job, run_dir, validated=True)
        except NoCheckpointError as err:  # every rank raises it (rank 0's choice, broadcast)
            exit_on_agreed_error(err, CONFIG_ERROR_STATUS)
        except NonFiniteStepError as err:  # every rank raises it (the step's agreed verdict)
            exit_on_agreed_error(err, NONFINITE_STATUS)
        except RolloutStreamError as err:  # every rank raises it (rank 0's, broadcast)
            exit_on_agreed_error(err, ROLLOUT_STREAM_STATUS)
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
        _print_error(err)
    _flush_and_exit(CONFIG_ERROR_STATUS)


def exit_on_agreed_error(err: BaseException, status: int) -> NoReturn:
    """An error every rank raised at the same point: rank 0 prints ``glm5_train: error:
    <message>`` (and leaves it for torchrun's summary), every rank exits with ``status`` at
    once (no peer waits on another: they all stop here)."""
    if dist.is_initialized() and dist.get_rank() == 0:
        _print_error(err)
    _flush_and_exit(status)


def _print_error(err: BaseException) -> None:
    """The one ``glm5_train: error: <message>`` line, also left for torchrun's summary."""
    message = one_line(err)
    _record_for_torchrun(message)
    print(f"glm5_train: error: {message}", file=sys.stderr)


def _flush_and_exit(status: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


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


@collective_purpose("shutdown")
def _shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
