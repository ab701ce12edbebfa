"""How a training run is assembled, in order, in one function: ``assemble``.

The order is forced by what each step needs from the ones before it:

1. **Validate** the whole config and the layout against the world size (``validate_job``),
   before any process group exists, so a bad config costs nothing and prints one message.
2. **Install the megatron-core compatibility patches** (``parallel/mcore_compat.py``): on CPU the
   device layer must be in place before megatron-core creates its first tensor or generator.
3. **Process groups**, then megatron-core's RNG tracker seeded from them.
4. **Dataset** (no model needed), then the **model** chunks, built on this rank's device with
   their initial weights a function of (seed, global tensor name) only.
5. **Freeze** what the DSA stage does not train, *before* DDP: megatron's DDP sizes its gradient
   buffers from ``requires_grad`` at wrap time.
6. **Embedding copies** (MTP stage, tied head) are found before wrapping, because Pipeline ZeRO2
   must pin their gradients while it adopts each chunk's buffer.
7. **DDP wrap**, and ZeRO2 adopts each chunk's gradient buffer right after its wrap (so at most
   one full buffer exists at a time).
8. **Optimizer** over the wrapped chunks (megatron-core reads DDP's buffers); then ZeRO2 points
   the distributed optimizer at its slices, then **Muon** replaces the torch optimizer inside
   megatron's wrappers (after ZeRO2: distributed Muon reads the slices ZeRO2 provides).
9. **Scheduler**, then the **schedule hooks** (grad scaling, finalize, no-sync, grad sync) that
   megatron-core's pipeline schedules call, which need the optimizer and ZeRO2; last, the
   per-parameter gradient norms (``train.log_param_grad_norms``), which read where the
   optimizer finds each gradient slice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.experts import SequentialMLP

from glm5_train.data import (
    build_train_iterator,
    build_train_valid_test_datasets,
    check_datasets,
    check_token_ids,
    ensure_builtin_corpus,
)
from glm5_train.flexible_batches import (
    FlexibleBatches,
    block_exchanges,
    exchange_chooser,
    exchanges_line,
    online_refit,
)
from glm5_train.job_config import JobConfig
from glm5_train.model.config import to_mcore_config
from glm5_train.model.glm5 import (
    apply_dsa_freezing,
    build_model_chunks,
    transformer_engine_available,
)
from glm5_train.model.head_parallel_cp import fixed_cp_comm
from glm5_train.model.head_parallel_cp import install as install_head_parallel_cp
from glm5_train.model.init_weights import initialize_weights
from glm5_train.optim import attach_schedule_hooks, build_optimizer, build_scheduler, wrap_ddp
from glm5_train.phase_times import ModelRate, PhaseTimes
from glm5_train.plan import build_activation_tracker, resolve_pipeline_layout
from glm5_train.plan.step_time import device_peak_tflops, model_flops_per_step
from glm5_train.profiling import check_profile_ranks
from glm5_train.rl.objective import RLObjective
from glm5_train.rl.publisher import publication_problem
from glm5_train.rl.rollout_data import build_rollout_dataset, freeze_mtp
from glm5_train.rl.stream import StreamedRollouts, is_spool
from glm5_train.schedules import BatchRamp, check_rampup_layout
from glm5_train.tokenizer import build_tokenizer
from parallel import deferred_wgrad, int4_qat, mcore_compat, process_groups
from parallel.activation_offload import ActivationTracker
from parallel.config.pipeline import check_interleaving
from parallel.deferred_wgrad import WeightGradQueue
from parallel.device import comm_device
from parallel.distributed_muon import install_distributed_muon
from parallel.embedding_tie import EmbeddingTie, check_tie_buckets
from parallel.flexible_cp import FlexiblePlan, GroupPool, Workload
from parallel.grad_norms import ParamGradNorms
from parallel.int4_qat import Int4QAT
from parallel.layout import validate_layout
from parallel.muon import MuonConfig, install_on_fp32_optimizer, matrix_layouts
from parallel.pipeline_zero2 import PipelineZero2, attach_to_optimizer


@dataclass
class Runtime:
    """Everything a training step needs, built once by ``assemble``."""

    job: JobConfig
    config: object  # megatron-core MLATransformerConfig
    groups: ProcessGroupCollection
    chunks: list
    optimizer: object
    scheduler: object
    dataset: object
    zero2: PipelineZero2 | None = None
    param_grad_norms: ParamGradNorms | None = None  # train.log_param_grad_norms
    # saved-for-backward bytes per step (always) and activation offloading (when configured)
    activations: ActivationTracker | None = None
    # parallel.cp_groups=flexible: the CP groups every global batch is planned over
    cp_pool: GroupPool | None = None
    last_plan: FlexiblePlan | None = None  # the plan of the latest step's global batch
    # each rank's measured CPU seconds of that plan's micro-batches (with the online refit)
    last_cell_seconds: list[float] | None = None
    # parallel.cp_comm != all_gather with flexible groups: each block's exchange
    cp_exchanges: dict | None = None
    # the step's wall time by phase on this rank (glm5_train/phase_times.py)
    phases: PhaseTimes | None = None
    # parallel.defer_weight_grads: the queued weight-gradient GEMMs (parallel/deferred_wgrad.py)
    wgrad: WeightGradQueue | None = None
    # train.int4_qat: the fake-quantised routed experts (parallel/int4_qat.py)
    qat: Int4QAT | None = None
    # train.objective=grpo|dis|distill: what each micro-batch's loss applies (glm5_train/rl)
    objective: RLObjective | None = None
    # model FLOPs per global batch, devices and their peak: TFLOP/s per GPU and MFU per step
    rate: ModelRate | None = None
    # The global batch of the step under way (train.rampup_batch_size); None: the config's
    global_batch_now: int | None = None
    batch_start: int | None = None  # the samples consumed before it

    @property
    def dp_rank(self) -> int:
        return self.groups.dp.rank()

    @property
    def dp_size(self) -> int:
        return self.groups.dp.size()


def assemble(job: JobConfig, validated: bool = False) -> Runtime:
    """Validate (unless the caller just did, ``validated``), create process groups, and build
    data, model, optimizer and hooks, in the order the module docstring explains."""
    if not validated:
        validate_job(job)
    mcore_compat.install()
    process_groups.init_distributed(job.parallel, job.train.seed)
    groups = process_groups.groups()
    if torch.distributed.get_rank() == 0:  # which releases ran, in the run's own log
        print(f"glm5_train: megatron-core {mcore_compat.megatron_core_version()}, torch "
              f"{torch.__version__}", flush=True)
    tokenizer = build_tokenizer(job.data.tokenizer)
    dataset = build_dataset(job, tokenizer)
    config, chunks = build_model(job, groups, tokenizer.eod)
    apply_dsa_freezing(chunks, job.dsa)
    if job.model.mtp_sets and not job.runs_mtp:  # RL, or a zero MTP loss weight: nothing
        freeze_mtp(chunks)                        # trains them (no weight decay either)
    if job.train.objective != "lm":  # the RL metrics' policy entropy (chunked head)
        for chunk in chunks:
            chunk.measure_entropy = True
    embedding_tie = EmbeddingTie(config, job.model.tie_word_embeddings, groups.pp)
    zero2, pinned = None, []
    if job.parallel.pipeline_zero2:
        zero2 = PipelineZero2()
        pinned = embedding_tie.holders(chunks) if embedding_tie.needs_sync(chunks) else []
    chunks = wrap_ddp(chunks, config, job.parallel.use_distributed_optimizer,
                      job.parallel.overlap_grad_reduce, zero2=zero2, pinned=pinned,
                      bucket_size=job.parallel.ddp_bucket_size,
                      overlap_param_gather=job.parallel.overlap_param_gather)
    if job.parallel.overlap_grad_reduce and job.parallel.use_distributed_optimizer:
        check_tie_buckets(embedding_tie, chunks)
    # INT4 QAT first: deferred W GEMMs then multiply with its quantised weights too.
    qat = install_int4_qat(chunks, job.train.int4_group_size) if job.train.int4_qat else None
    wgrad = WeightGradQueue() if job.parallel.defer_weight_grads else None
    if wgrad is not None:
        deferred_wgrad.install(chunks, wgrad)
        if zero2 is not None:  # a chunk's reduce-scatter must see its last W GEMMs
            zero2.before_launch = wgrad.run
    # Muon offloads its own AdamW part (install_muon): megatron-core's optimizer stays whole.
    optimizer = build_optimizer(chunks, job.train, job.parallel.use_distributed_optimizer,
                                job.train.torch_dtype,
                                offload=job.parallel if job.train.optimizer == "adamw" else None)
    if zero2 is not None:
        attach_to_optimizer(optimizer, zero2)
    if job.train.optimizer == "muon":
        install_muon(optimizer, chunks, job, config, groups)
    scheduler = build_scheduler(optimizer, job.train, job.train.train_iters)
    attach_schedule_hooks(chunks, config, optimizer, groups, embedding_tie, zero2, wgrad)
    phases = PhaseTimes(comm_device())  # megatron-core's gradient sync: the grad_sync phase
    config.finalize_model_grads_func = phases.timed(config.finalize_model_grads_func, "grad_sync")
    norms = ParamGradNorms(chunks, optimizer, zero2) if job.train.log_param_grad_norms else None
    # After DDP: its buffers hold the parameters the meter must leave out.
    activations = build_activation_tracker(job, chunks, groups, num_microbatches(job, groups))
    pool = cp_exchanges = None
    if job.parallel.cp_groups == "flexible":  # collective: every rank
        par = job.parallel
        choose = (exchange_chooser(job, groups.dp.size()) if par.cp_comm != "all_gather"
                  else None)
        pool = GroupPool(groups.dp, par.flexible_cp_max_size, groups.cp, par.cp_node_size,
                         needs_exchange=None if choose is None else
                         (lambda ranks: choose(ranks)[0] == "head_parallel"))
        if par.cp_comm != "all_gather":
            cp_exchanges = block_exchanges(job, pool)
            if torch.distributed.get_rank() == 0:
                print(exchanges_line(cp_exchanges), flush=True)
    objective = (RLObjective(job.train.objective, job.rl) if job.train.objective != "lm"
                 else None)
    return Runtime(job, config, groups, chunks, optimizer, scheduler, dataset, zero2, norms,
                   activations, pool, wgrad=wgrad, qat=qat, objective=objective,
                   cp_exchanges=cp_exchanges, phases=phases, rate=model_rate(job))


def model_rate(job: JobConfig) -> ModelRate | None:
    """The planner's model FLOPs per global batch of this job, its devices and their peak;
    None, with a notice on rank 0, for a job the planner cannot price (training goes on)."""
    bf16 = job.train.params_dtype == "bf16"  # the presets' peak is the bf16 one
    peak = (device_peak_tflops(torch.cuda.get_device_name())
            if torch.cuda.is_available() and bf16 else None)
    try:
        flops = model_flops_per_step(job)
    except ValueError as err:
        if torch.distributed.get_rank() == 0:
            print(f"glm5_train: no tflops_per_gpu / mfu in the metrics: the planner cannot "
                  f"count this job's FLOPs ({err})", flush=True)
        return None
    return ModelRate(flops, job.train.global_batch_size, torch.distributed.get_world_size(),
                     peak)


def routed_expert_linears(chunks: list) -> list:
    """The routed experts' linear layers (megatron-core's SequentialMLP experts, the MTP
    layer's included) of this rank's chunks."""
    return [linear for chunk in chunks for module in chunk.modules()
            if isinstance(module, SequentialMLP)
            for expert in module.local_experts
            for linear in (expert.linear_fc1, expert.linear_fc2)]


def install_int4_qat(chunks: list, group_size: int) -> Int4QAT:
    """train.int4_qat: fake-quantise the routed experts (parallel/int4_qat.py)."""
    linears = routed_expert_linears(chunks)
    if not linears and any(module.__class__.__name__.endswith("GroupedMLP")
                           for chunk in chunks for module in chunk.modules()):
        raise ValueError("train.int4_qat=true covers experts built as megatron-core's "
                         "SequentialMLP; this model's experts are grouped GEMMs (Transformer "
                         "Engine or moe_grouped_gemm): build it without them, or set "
                         "train.int4_qat=false")
    return int4_qat.install(linears, group_size)


def validate_job(job: JobConfig) -> int:
    """All checks that need no process group; returns the data-parallel size. Fixes the
    pipeline layout (a given one checked, or one balanced for the MTP placement)."""
    rank, world, _ = process_groups.world_from_env()
    dp = validate_layout(job.parallel, job.model, world, job.train.global_batch_size,
                         job.train.micro_batch_size, job.train.seq_length)
    _check_muon_offload(job)
    if job.parallel.overlap_param_gather and job.train.optimizer == "muon":
        raise ValueError("parallel.overlap_param_gather=true with train.optimizer=muon: "
                         "distributed Muon gathers each matrix from its owner after its own "
                         "step, and overlapping that gather with the forward is not built; set "
                         "parallel.overlap_param_gather=false")
    check_profile_ranks(job.train.profile_ranks, world)
    if job.parallel.defer_weight_grads and transformer_engine_available():
        raise ValueError("parallel.defer_weight_grads=true with Transformer Engine installed: "
                         "the model is then built from Transformer Engine layers, whose weight "
                         "gradients Transformer Engine computes itself, and deferral covers "
                         "megatron-core's local layers only; set parallel.defer_weight_grads="
                         "false, or run where transformer_engine is not installed")
    if (job.parallel.optimizer_cpu_offload and job.train.params_dtype != "fp32"
            and job.train.optimizer == "adamw" and not job.parallel.use_distributed_optimizer):
        raise ValueError(f"parallel.optimizer_cpu_offload=true with train.params_dtype="
                         f"{job.train.params_dtype} needs parallel.use_distributed_optimizer="
                         "true: megatron-core keeps low-precision models' fp32 masters with the "
                         "host-resident state only there (its precision-aware path); set it, or "
                         "train.params_dtype=fp32")
    _check_rampup_for(job, dp)
    check_data(job)
    if job.rl.publish_dir:  # the engines' weight versions: writable, with a usable tokenizer
        problem = publication_problem(job, job.rl.publish_dir, job.rl.publish_keep,
                                      job.rl.publish_dtype)
        if problem is not None:
            raise ValueError(f"rl.publish_dir: {problem}")
    given = job.parallel.pipeline_model_parallel_layout
    layout = resolve_pipeline_layout(job, dp)
    if layout and not given and rank == 0:
        print(f"pipeline layout: {layout} (balanced, parallel.mtp_placement="
              f"{job.parallel.mtp_placement})", flush=True)
    job.parallel.pipeline_model_parallel_layout = layout
    return dp


def _check_rampup_for(job: JobConfig, dp: int) -> None:
    """Every batch size of a ramp splits into whole micro-batches on every data-parallel rank,
    and each one's micro-batches suit the interleaved schedule."""
    t = job.train
    if t.rampup_batch_size is None:
        return
    check_rampup_layout(t.rampup_batch_size, t.global_batch_size, t.micro_batch_size, dp)
    for size in BatchRamp.from_config(t.rampup_batch_size, t.global_batch_size).sizes():
        try:
            check_interleaving(job.parallel, size // (t.micro_batch_size * dp))
        except ValueError as err:
            raise ValueError(f"train.rampup_batch_size={t.rampup_batch_size}: at its global "
                             f"batch of {size}: {err}") from None


def _check_muon_offload(job: JobConfig) -> None:
    """Muon offloads its AdamW part whole, on its own copies (``parallel/muon.py``)."""
    par = job.parallel
    if not (par.optimizer_cpu_offload and job.train.optimizer == "muon"):
        return
    if par.optimizer_offload_fraction != 1.0:
        raise ValueError(f"parallel.optimizer_offload_fraction={par.optimizer_offload_fraction}"
                         " with train.optimizer=muon: Muon keeps its whole AdamW part in host "
                         "memory and its momentum on the device; set the fraction to 1.0")
    if par.overlap_cpu_optimizer_d2h_h2d:
        raise ValueError("parallel.overlap_cpu_optimizer_d2h_h2d=true with train.optimizer=muon:"
                         " the side-stream copies are megatron-core's hybrid optimizer's "
                         "(AdamW runs); set it to false")


def check_data(job: JobConfig) -> None:
    """The tokenizer fits the model's vocabulary and the given datasets are usable (the
    built-in corpus is built, and so checked, with the dataset)."""
    tokenizer = build_tokenizer(job.data.tokenizer)
    if tokenizer.vocab_size > job.model.vocab_size:
        raise ValueError(
            f"tokenizer {job.data.tokenizer!r} has {tokenizer.vocab_size} tokens but "
            f"model.vocab_size={job.model.vocab_size}: raise model.vocab_size or use a smaller "
            "tokenizer")
    if job.data.format == "rollouts":  # read, checked and packed as the run will
        if not is_spool(list(job.data.paths)):  # a spool is read as rollouts arrive
            build_rollout_dataset(job)
        return
    if job.data.paths:
        check_datasets(list(job.data.paths), job.data.split, job.data.format,
                       job.train.seq_length, tokenizer)
        if job.data.format == "gpt":  # chat SFT data is checked against its metadata
            for prefix in job.data.paths:
                check_token_ids(prefix, tokenizer.vocab_size, job.data.cache_dir)


def build_model(job: JobConfig, groups: ProcessGroupCollection,
                eod_token_id: int | None = None) -> tuple[object, list]:
    """(megatron-core config, this rank's initialised model chunks), process groups existing.
    ``eod_token_id``: the tokenizer's end-of-document token (None: the job's tokenizer's).

    On CUDA megatron-core builds the parameters on this rank's GPU (no CPU copy of the model);
    the few it leaves on the host (the MoE router's weight) follow with ``.to``, as
    megatron's own ``get_model`` moves every chunk. On CPU nothing moves."""
    where = comm_device()
    recompute = job.activations.recompute()
    model = job.model if job.trains_mtp else dataclasses.replace(job.model, mtp_loss_weight=0.0)
    config = to_mcore_config(model, job.parallel, job.train.torch_dtype,
                             use_cpu_initialization=where.type == "cpu", recompute=recompute)
    eod = build_tokenizer(job.data.tokenizer).eod if eod_token_id is None else eod_token_id
    chunks = build_model_chunks(job.model, config, dsa_training=job.dsa, eod_token_id=eod,
                                groups=groups,
                                loss_chunk_tokens=job.activations.loss_chunk_tokens,
                                recompute=recompute)
    # parallel.cp_comm=head_parallel (or auto's choice): its all-to-all groups, once, on every
    # rank (collective). Flexible groups bring theirs with each micro-batch.
    if job.parallel.cp_groups == "fixed":
        install_head_parallel_cp(chunks, fixed_cp_comm(job, groups.cp), job.parallel.cp_node_size,
                                 groups.cp)
    if where.type != "cpu":
        for chunk in chunks:
            chunk.to(where)
    initialize_weights(chunks, job.train.seed, job.model.initializer_range,
                       job.model.num_hidden_layers)
    return config, chunks


def install_muon(optimizer, chunks: list, job: JobConfig, config,
                 groups: ProcessGroupCollection) -> None:
    """Swap the torch optimizer inside each of megatron-core's optimizer wrappers: MuonAdamW in
    its FP32 optimizers, distributed Muon in its distributed optimizers
    (``train.muon_zero_redundant``: one owner per matrix; otherwise the naive reference)."""
    t = job.train
    cfg = MuonConfig(t.muon_momentum, t.muon_nesterov, t.muon_ns_steps, t.muon_split_mla,
                     adamw_on_host=job.parallel.optimizer_cpu_offload)
    layouts = matrix_layouts(chunks, cfg, config, groups)
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(sub, DistributedOptimizer):
            if not sub.is_stub_optimizer:
                install_distributed_muon(sub, layouts, cfg, t.muon_zero_redundant)
        else:
            install_on_fp32_optimizer(sub, layouts, cfg)


def build_dataset(job: JobConfig, tokenizer):
    if job.data.format == "rollouts":
        if is_spool(list(job.data.paths)):
            return StreamedRollouts(job)
        return build_rollout_dataset(job)
    if not job.data.paths:
        job.data.paths = [ensure_builtin_corpus(job.data, tokenizer)]
    samples = job.train.train_iters * job.train.global_batch_size
    train, _, _ = build_train_valid_test_datasets(
        job.data, tokenizer, job.train.seq_length, job.train.seed, (samples, 0, 0))
    return train


def flexible_workload(job: JobConfig) -> Workload:
    par = job.parallel
    return Workload(par.flexible_cp_cost_pair, par.flexible_cp_cost_selected,
                    par.flexible_cp_cost_token, job.model.index_topk,
                    par.flexible_cp_cost_gathered, par.flexible_cp_cost_grouped)


def num_microbatches(job: JobConfig, groups: ProcessGroupCollection) -> int:
    """Micro-batches per step on each data-parallel rank."""
    return job.train.global_batch_size // (job.train.micro_batch_size * groups.dp.size())


def iterators(rt: Runtime, consumed_samples: int) -> list | FlexibleBatches:
    """One aligned iterator per model chunk: each chunk reads the same micro-batch sequence.
    Flexible CP groups: the global batches, planned one at a time (``FlexibleBatches``)."""
    t = rt.job.train
    if rt.cp_pool is not None:
        par = rt.job.parallel
        interleaved = (par.virtual_pipeline_model_parallel_size or 1) > 1
        return FlexibleBatches(rt.dataset, rt.cp_pool, t.global_batch_size,
                               par.flexible_cp_max_size, flexible_workload(rt.job),
                               len(rt.chunks), consumed_samples,
                               slot_multiple=par.pipeline_model_parallel_size if interleaved
                               else 1, plan_ranks=par.flexible_cp_plan_ranks,
                               refit=online_refit(par, flexible_workload(rt.job)),
                               exchanges=rt.cp_exchanges)
    make = partial(build_train_iterator, rt.dataset, t.micro_batch_size, t.global_batch_size,
                   rt.dp_rank, rt.dp_size, consumed_samples, num_workers=rt.job.data.num_workers,
                   rampup=t.rampup_batch_size)
    return [make() for _ in rt.chunks]
