"""Parity harness: run the real training job in a layout and compare it with one process.

``run_job`` runs ``glm5_train.train`` on local ranks as torchrun would (same Hydra overrides,
same entry point, torchrun's worker environment), reads the run's ``metrics.jsonl`` and returns
its step records.
``compare`` checks per-step losses, the global grad norm and every parameter's grad norm
(``param_grad_norms``, by global tensor name: parallel/grad_norms.py) against a reference run.
``assert_layout_ran`` checks, from the run's own metrics, that the layout it names really ran:
per-rank parameter (and optimizer / gradient) bytes equal the pipeline planner's prediction for
that layout, and the collectives ran on exactly the group sizes the layout implies.

Initial weights depend only on (seed, global tensor name), see ``glm5_train/model/init_weights.py``,
and the data order depends only on the global batch index, so any layout must reproduce the
single-process run up to floating-point reduction order.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass

from glm5_train.job_config import compose_job
from glm5_train.plan import PipelineLayout, job_pipeline
from glm5_train.plan import check as plan_check
from parallel.process_groups import _free_port as free_port
from tests import spawn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small and fast: 5 optimizer steps of 4 sequences of 64 tokens on the tiny GLM-5.
BASE_OVERRIDES = (
    "model=glm5_tiny",
    "train.train_iters=5",
    # No warm-up: megatron-core's OptimizerParamScheduler gives max_lr at step 0 when
    # lr_warmup_steps=0 (with 1 it gives init_lr=0 to the first update), so every step after
    # the first follows a real update (tests/test_parity.py checks the schedule).
    "train.warmup_iters=0",
    "train.log_param_grad_norms=true",
    "train.global_batch_size=4",
    "train.micro_batch_size=1",
    "train.seq_length=64",
    "checkpoint.save=null",
)


@dataclass(frozen=True)
class Tolerances:
    """Relative tolerances of ``compare``.

    ``param``: every parameter's grad norm, relative to max(|reference|, ``param_floor`` x the
    step's reference global grad norm). The floor is there because many tensors' gradients are
    ~0 (experts that got no token this step: exactly 0; the DSA indexer, trained with a 1e-3
    coefficient: ~1e-8): fp32 reduction order perturbs a gradient by ~1e-7 of the magnitudes it
    is summed from, not of its own, so a near-zero norm's relative difference is noise. A tensor
    below the floor holds < 1e-8 of the squared global norm; a wrong scale on a tensor above it
    (a 2x, a missing 1/dp) moves its norm by > 0.3 relative.
    ``param_steps``: compare per-parameter norms on the first N steps only (None: all).
    """

    loss: float
    grad_norm: float
    indexer_kl: float
    param: float
    param_floor: float = 1e-4
    param_steps: int | None = None
    # ``loss`` relative to max(|reference loss|, loss_floor): an RL objective's loss is a sum of
    # terms of either sign (advantages ~1) that nearly cancel, whose reduction noise scales with
    # the terms, not with their sum (0: plain relative).
    loss_floor: float = 0.0


# fp32 on CPU: layouts differ only in summation order (TP partial sums, DP/EP gradient
# reductions, ZeRO2's per-group reduce-scatters, the loss-token all-reduce). Measured over 5
# steps (warm-up 0) on every layout of tests/test_parity.py, test_muon.py and test_zero2.py, the
# largest relative differences from their references were: losses (LM and MTP) 9.0e-8, global
# grad norm 8.6e-6, indexer KL 7.3e-5, per-parameter grad norm 1.7e-4 (floor 1e-4; these three
# maxima all from ZeRO2 at global batch 16 against one process, step 5; plain DDP there drifts
# to 1.3e-6 in grad norm too: a routing / top-k decision flipping amplifies the ~1e-7 rounding;
# elsewhere <= 3.3e-6, 3.7e-5 and 5.0e-5). Each tolerance is ~10x (11 to 14x) its measured maximum.
# A planted 1% scale on one TP shard or one expert's gradient is caught by the per-parameter
# check alone (rel 4e-3 and 1e-2; losses moved < 4e-7, grad norm < 9e-5); a real bug (a wrong
# shard, a dropped layer, a missing or doubled reduction) moves the tensors it touches by > 1e-1.
FP32 = Tolerances(loss=1e-6, grad_norm=1e-4, indexer_kl=1e-3, param=2e-3)

# bf16 parameters (Muon on ZeRO2 vs one process): bf16 rounding of the updated weights differs
# by layout. Measured: losses 1.7e-4, grad norm 4.4e-4, indexer KL 1.4e-3; per-parameter norms
# 3.0e-5 at step 1 (same bf16 weights, only reduction order) but up to 5.6e-2 by step 5 (the
# weights have drifted apart by bf16 rounding): per-parameter norms are compared at step 1 only,
# where a wrong scale still shows. Tolerances ~10x (12, 11, 14 and 17x) the measured maxima.
BF16 = Tolerances(loss=2e-3, grad_norm=5e-3, indexer_kl=2e-2, param=5e-4, param_steps=1)

# sqrt(sum of every parameter's squared norm) against megatron-core's global grad norm of the
# same run (fp32 with per-tensor sums, ours in float64): measured <= 1.6e-6 relative in every
# run, bf16 included. 2e-5 (~13x) catches a tensor counted twice or not at all (> 1e-4 of the
# squared norm for all but the near-zero tensors the floor above also leaves out).
NORM_SUM_RTOL = 2e-5


def MTP_KEYS(rtol: float, record: dict) -> list[tuple[str, float]]:
    """The per-step MTP losses a record carries (mtp_loss, mtp_loss_1, ...)."""
    return [(key, rtol) for key in sorted(record) if key.startswith("mtp_loss")]


@dataclass
class JobResult:
    records: list[dict]
    log: str


# One-process reference runs of this test session, by their overrides (several test modules
# compare against the same reference: it runs once).
_ONE_PROCESS_RUNS: dict[tuple[str, ...], JobResult] = {}


def one_process(overrides: list[str]) -> JobResult:
    """``run_job(1, overrides)``, run once per test session for the same overrides (in any
    order; ``checkpoint.load=null`` is the default's behaviour here: the harness saves none).
    Its run directory goes when the test session ends (the records are read by then)."""
    key = tuple(sorted(o for o in overrides if o != "checkpoint.load=null"))
    if key not in _ONE_PROCESS_RUNS:
        run_dir = tempfile.mkdtemp(prefix="glm5_reference_")
        atexit.register(shutil.rmtree, run_dir, ignore_errors=True)
        _ONE_PROCESS_RUNS[key] = run_job(1, list(key), run_dir)
    return _ONE_PROCESS_RUNS[key]


def run_job(nprocs: int, overrides: list[str], run_dir: str, timeout: int = 600) -> JobResult:
    """Run the training job on ``nprocs`` local ranks; return its metrics.jsonl records.

    Each rank runs ``glm5_train.train``'s ``main()`` with the arguments ``python -m
    glm5_train.train`` would get and the environment torchrun gives its workers (rank, world
    size, a free rendezvous port on rank 0); one rank's failure stops the others, as torchrun
    does. The ranks are forked from a server that imported torch and megatron-core once per
    test session (tests/spawn.py's): importing them is ~6 s of CPU per process, half of a short
    8-rank job on 2 cores, and the suite runs hundreds of jobs. What needs a real interpreter
    start or torchrun's agent (restarts, signal handling, the launchers) is tested with
    torchrun itself (test_durable, test_slurm, test_spawn, launch tests)."""
    argv = [os.path.join(REPO, "glm5_train", "train.py"), *BASE_OVERRIDES, *overrides,
            f"hydra.run.dir={run_dir}"]
    failed, log = _run_logged(argv, nprocs, timeout, as_script=False)
    if failed:
        raise RuntimeError(f"job failed ({failed}) on {nprocs} ranks: python -m glm5_train.train "
                           f"{' '.join(argv[1:])}\n{log[-6000:]}")
    return JobResult(read_metrics(run_dir), log)


def run_script(nprocs: int, script: str, args: list[str],
               timeout: int = 300) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node=nprocs script *args`` as its ranks see it:
    each rank runs ``script`` as ``__main__`` (``python script`` would) with torchrun's worker
    environment, forked from the test session's server like ``run_job``'s ranks (a tool's
    torchrun is ~12 s of CPU per interpreter, agent included, for a conversion of ~1 s).
    ``returncode`` is the first failed rank's exit code (0 when all succeed), ``stdout`` all
    ranks' output and stderr; a timeout gives 124. What torchrun itself adds (its agent, its
    failure summary) is tested by the tests that run it."""
    argv = [os.path.join(REPO, script), *args]
    failed, log = _run_logged(argv, nprocs, timeout, as_script=True)
    return subprocess.CompletedProcess(["torchrun", f"--nproc-per-node={nprocs}", *argv],
                                       failed, stdout=log, stderr="")


def _run_logged(argv: list[str], nprocs: int, timeout: int, as_script: bool) -> tuple[int, str]:
    """``_run_ranks`` into a log file: the first failed rank's exit code (0: none), the log."""
    with tempfile.NamedTemporaryFile("w+", prefix="glm5_ranks_", suffix=".log") as out:
        codes = _run_ranks(argv, nprocs, out.name, timeout, as_script)
        return next((c for c in codes if c != 0), 0), out.read()


def _run_ranks(argv: list[str], nprocs: int, log_path: str, timeout: int,
               as_script: bool = False) -> list[int]:
    """Start ``nprocs`` ranks of the job (of the script ``argv[0]`` with ``as_script``)
    writing to ``log_path``; their exit codes. A rank that fails (or the timeout) terminates
    the rest, which would otherwise wait on it; its own code then comes first, so that a
    slower rank stopped by SIGTERM (-15) does not hide the code the run failed with (every
    rank refusing bad input with 1, the second stopped before its own exit)."""
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WORLD_SIZE=str(nprocs),
                LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()))
    # Forked from the test session's server (tests/spawn.py), which has imported the training
    # job (torch, megatron-core) and started no threads; everything from main() on (config,
    # process groups, training) runs fresh in each rank.
    server = spawn.fork_server()
    ranks = [server.Process(target=_rank_main, name=f"rank{r}",
                            args=(argv, dict(base, RANK=str(r), LOCAL_RANK=str(r)), log_path,
                                  as_script))
             for r in range(nprocs)]
    for rank in ranks:
        rank.start()
    deadline = time.monotonic() + timeout
    while any(rank.is_alive() for rank in ranks):
        if time.monotonic() > deadline:
            spawn.stop_processes(ranks, grace=RANK_STOP_GRACE)
            return [124]  # timeout(1)'s code
        failed = next((rank for rank in ranks if rank.exitcode not in (None, 0)), None)
        if failed is not None:
            spawn.stop_processes(ranks, grace=RANK_STOP_GRACE)
            return [failed.exitcode] + [rank.exitcode for rank in ranks if rank is not failed]
        time.sleep(0.1)
    for rank in ranks:
        rank.join()
    return [rank.exitcode for rank in ranks]


RANK_STOP_GRACE = 10.0  # seconds a terminated rank gets to exit before SIGKILL


def _rank_main(argv: list[str], env: dict[str, str], log_path: str, as_script: bool) -> None:
    """One rank, as ``python -m glm5_train.train`` (``python argv[0]`` with ``as_script``)
    would run it with ``env`` and its output in ``log_path``. A ``SystemExit`` gives the
    process its code, an uncaught exception prints its traceback and gives 1, as an
    interpreter's exit would."""
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(REPO)
    warnings.simplefilter("ignore")  # PYTHONWARNINGS=ignore, read only at interpreter start
    import torch
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # the server's OpenMP read it at import
    sys.argv = argv
    try:
        if as_script:
            sys.path.insert(0, os.path.dirname(argv[0]))  # what `python script` puts first
            runpy.run_path(argv[0], run_name="__main__")
        else:
            from glm5_train import train
            train.main()
    finally:  # an interpreter's exit would run these; a forked process's os._exit does not
        atexit._run_exitfuncs()


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle if line.strip()]


# ------------------------------------------------------------------------------ comparison


def compare(reference: list[dict], candidate: list[dict], tol: Tolerances = FP32) -> list[str]:
    """Per-step differences beyond tolerance, as readable lines (empty: parity holds)."""
    problems = []
    if len(reference) != len(candidate):
        problems.append(f"step count {len(candidate)} != reference {len(reference)}")
    for which, records in (("reference", reference), ("candidate", candidate)):
        problems += norm_sum_problems(records, which)
    for index, (ref, got) in enumerate(zip(reference, candidate)):
        for key, rtol in (("loss", tol.loss), ("grad_norm", tol.grad_norm),
                          ("indexer_kl", tol.indexer_kl), *MTP_KEYS(tol.loss, ref)):
            floor = tol.loss_floor if key == "loss" else 0.0
            problems += _scalar_problems(ref, got, key, rtol, floor)
        if tol.param_steps is None or index < tol.param_steps:
            problems += param_problems(ref, got, tol)
    return problems


def _scalar_problems(ref: dict, got: dict, key: str, rtol: float,
                     floor: float = 0.0) -> list[str]:
    if key not in ref and key not in got:
        return []
    if key not in got or key not in ref:
        return [f"step {ref['step']}: {key} reported by only one run"]
    scale = max(abs(ref[key]), floor)
    if abs(got[key] - ref[key]) > rtol * scale:
        return [(f"step {ref['step']} {key}: {got[key]!r} vs {ref[key]!r} "
                 f"(rel {abs(got[key] - ref[key]) / scale:.2e} > {rtol})")]
    return []


def param_problems(ref: dict, got: dict, tol: Tolerances) -> list[str]:
    """Every parameter's grad norm of one step against the reference's (same global names)."""
    step = ref["step"]
    if "param_grad_norms" not in ref or "param_grad_norms" not in got:
        return [(f"step {step}: param_grad_norms missing (run with "
                 "train.log_param_grad_norms=true, as BASE_OVERRIDES does)")]
    want, have = ref["param_grad_norms"], got["param_grad_norms"]
    if set(want) != set(have):
        return [(f"step {step}: parameter names differ: only in the reference "
                 f"{sorted(set(want) - set(have))[:5]}, only in the candidate "
                 f"{sorted(set(have) - set(want))[:5]}")]
    floor = tol.param_floor * ref["grad_norm"]
    problems = []
    for name in sorted(want):
        scale = max(abs(want[name]), floor)
        if abs(have[name] - want[name]) > tol.param * scale:
            problems.append(f"step {step} grad norm of {name}: {have[name]:.6e} vs "
                            f"{want[name]:.6e} (rel {abs(have[name] - want[name]) / scale:.2e} "
                            f"> {tol.param})")
    return problems


def norm_sum_problems(records: list[dict], which: str) -> list[str]:
    """The per-parameter norms must make up the run's own global grad norm: each gradient
    element counted once, whatever the layout."""
    problems = []
    for record in records:
        norms = record.get("param_grad_norms")
        if not norms:
            continue
        total = math.sqrt(sum(v * v for v in norms.values()))
        if abs(total - record["grad_norm"]) > NORM_SUM_RTOL * record["grad_norm"]:
            problems.append(f"{which} step {record['step']}: the per-parameter norms give "
                            f"{total:.8e}, the run's grad norm is {record['grad_norm']:.8e} "
                            f"(rel > {NORM_SUM_RTOL}): a tensor counted twice or not at all")
    return problems


# ------------------------------------------------------------------ the layout really ran


@dataclass(frozen=True)
class Layout:
    """The parallel sizes a job's config implies for ``world`` processes."""

    world: int
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int
    etp: int
    sequence_parallel: bool
    distributed_optimizer: bool
    zero2: bool
    pipeline: PipelineLayout
    moe: bool  # the model has routed experts (the MTP layer is of the last decoder layer's kind)
    expert_bias: bool  # the router's expert bias is updated (an all-reduce over TP x CP x DP)
    muon: str | None  # None (AdamW), "plain", "owners" or "naive" (distributed Muon)
    tied: bool
    mtp: bool = False  # the model runs MTP steps (their inputs roll across CP ranks)
    cp_all_to_all: bool = False  # head-parallel CP's flat all-to-all over the CP group

    @property
    def expert_dp(self) -> int:
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    def pipeline_rank(self, rank: int) -> int:
        # megatron-core's default rank order "tp-cp-ep-dp-pp": pipeline outermost.
        return rank // (self.world // self.pp)

    @property
    def embedding_holders(self) -> int:
        """Pipeline ranks holding a word-embedding copy (EmbeddingTie's all-reduce group)."""
        holders = {0}
        if self.pipeline.mtp_stage is not None:
            holders.add(self.pipeline.rank_of(self.pipeline.mtp_stage))
        if self.tied:
            holders.add(self.pp - 1)
        return len(holders)


def layout_of(job, world: int) -> Layout:
    par, model = job.parallel, job.model
    tp, pp, cp = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                  par.context_parallel_size)
    dp = world // (tp * pp * cp)
    muon = None
    if job.train.optimizer == "muon":
        muon = ("plain" if not par.use_distributed_optimizer
                else "owners" if job.train.muon_zero_redundant else "naive")
    return Layout(world, tp, pp, cp, dp, par.expert_model_parallel_size, par.expert_tp,
                  par.sequence_parallel, par.use_distributed_optimizer, par.pipeline_zero2,
                  job_pipeline(job, dp), any(model.moe_layer_pattern),
                  model.topk_method == "noaux_tc", muon, model.tie_word_embeddings,
                  bool(job.runs_mtp and model.mtp_num_steps),
                  par.cp_comm == "head_parallel" and par.cp_node_size is None)


def assert_layout_ran(result: JobResult, nprocs: int, overrides: list[str]) -> None:
    """The run's own metrics show the layout ``overrides`` names: the planner's bytes per rank
    and exactly the collective group sizes that layout implies (every step)."""
    job = compose_job([*BASE_OVERRIDES, *overrides])
    layout = layout_of(job, nprocs)
    problems = pipeline_log_problems(result.log, layout)
    problems += memory_problems(result.records[-1], job)
    for record in result.records:
        problems += comm_problems(record, layout)
    assert not problems, (f"the run does not show the layout {overrides} on {nprocs} "
                          "processes:\n" + "\n".join(problems))


def pipeline_log_problems(log: str, layout: Layout) -> list[str]:
    """A balanced layout is printed by the job: it must be the one the planner gives."""
    printed = re.findall(r"^pipeline layout: (\S+)", log, flags=re.MULTILINE)
    want = layout.pipeline.to_string()
    return [f"the job printed pipeline layout {p!r}, the planner gives {want!r}"
            for p in printed if p != want]


def memory_problems(record: dict, job) -> list[str]:
    """Per global rank, the planner's parameter, gradient, optimizer-state and activation
    bytes against the run's (``glm5_train.plan.check``: which fields, and how close)."""
    return plan_check.problems(job, record)


COMM_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send", "recv",
            "broadcast")


def expected_group_sizes(layout: Layout) -> dict[str, set[int]]:
    """Group sizes (> 1) each collective must run on in one step of this layout, and no other:
    the communication each parallel dimension implies."""
    ops: dict[str, set[int]] = defaultdict(set)
    ops["all_reduce"].add(layout.world)  # the step's losses, summed over the world
    if layout.pp > 1:  # activations and their gradients; the token count from the last stage
        ops["send"].add(layout.pp)
        ops["recv"].add(layout.pp)
        ops["broadcast"].add(layout.pp)
        if layout.pp == 2:  # megatron-core's _p2p_ops sends one direction on WORLD at PP=2
            ops["send"].add(layout.world)
            ops["recv"].add(layout.world)
    if layout.tp > 1:  # vocab-parallel cross-entropy; row-parallel outputs or SP norms' grads
        ops["all_reduce"].add(layout.tp)
        if layout.sequence_parallel:  # the sequence gathered before, scattered after TP regions
            ops["all_gather"].add(layout.tp)
            ops["reduce_scatter"].add(layout.tp)
        if layout.muon:  # Muon orthogonalises TP-split matrices whole: gathered over TP
            ops["all_gather"].add(layout.tp)
    if layout.moe and layout.ep > 1:  # token dispatch, and its tokens-per-expert counts
        ops["all_to_all"].add(layout.ep)
        # megatron-core's alltoall dispatcher gathers the counts over its TP x EP group,
        # expert-TP x EP ranks (just EP with expert-TP 1)
        ops["all_gather"].add(layout.ep * layout.etp)
    if layout.moe and layout.etp > 1:  # tokens gathered over the expert-TP group
        ops["all_gather"].add(layout.etp)
        ops["reduce_scatter"].add(layout.etp)
    if layout.moe and layout.expert_bias:  # tokens per expert for the expert-bias update
        ops["all_reduce"].add(layout.tp * layout.cp * layout.dp)
    if layout.cp > 1:  # latent and indexer keys gathered, their gradients reduce-scattered
        ops["all_gather"].add(layout.cp)
        ops["reduce_scatter"].add(layout.cp)
        if layout.cp_all_to_all:
            ops["all_to_all"].add(layout.cp)
        if layout.mtp:  # MTP's inputs shifted across shard boundaries: megatron's roll
            ops["send"].add(layout.world)  # sends to global ranks on the default group
            ops["recv"].add(layout.world)
    ops["all_reduce"].add(layout.dp * layout.cp)  # finalize's token count over DP x CP
    ops["all_reduce"].add(layout.embedding_holders)  # EmbeddingTie's sum over stages
    for size in (layout.dp * layout.cp, *((layout.expert_dp,) if layout.moe else ())):
        _gradient_reduction(ops, size, layout)
    return {op: {n for n in sizes if n > 1} for op, sizes in ops.items()}


def _gradient_reduction(ops: dict[str, set[int]], size: int, layout: Layout) -> None:
    """Dense gradients over DP, expert gradients over expert-DP: plain DDP all-reduces; the
    distributed optimizer (and ZeRO2) reduce-scatters, then all-gathers the updated parameters
    (distributed Muon moves gradient pieces to the matrix owners with an all-to-all; its
    owners' variant replaces that all-gather by all-to-alls too)."""
    if not layout.distributed_optimizer:
        ops["all_reduce"].add(size)
        return
    ops["reduce_scatter"].add(size)
    if layout.muon in ("owners", "naive"):
        ops["all_to_all"].add(size)
    if layout.muon != "owners":
        ops["all_gather"].add(size)


def comm_problems(record: dict, layout: Layout) -> list[str]:
    """The step's collectives ran on exactly the expected group sizes (> 1), on some rank."""
    seen: dict[str, set[int]] = defaultdict(set)
    for key, counts in record["comm_by_op"].items():
        op, size = key.rsplit(":", 1)
        if int(size) > 1 and any(counts["calls"]):
            seen[op].add(int(size))
    want = expected_group_sizes(layout)
    problems = []
    for op in sorted(set(seen) | set(want)):
        if seen.get(op, set()) != want.get(op, set()):
            problems.append(f"step {record['step']} {op}: ran on group sizes "
                            f"{sorted(seen.get(op, set()))}, the layout implies "
                            f"{sorted(want.get(op, set()))}")
    return problems
