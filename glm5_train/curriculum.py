"""GLM-5's training curriculum as plans: each stage preset composed as the job composes it and
planned on its cluster (``tools/curriculum.py`` prints the table; docs/curriculum.md).

A stage's plan is ``tools/plan_fit.py``'s on GPU kernels: the largest rank's static and in-flight
bytes plus one layer's recompute working set. ``best_sft_plan`` searches the 202K SFT's shapes on
a GPU count for the lowest planned peak.
"""

from __future__ import annotations

import dataclasses

from glm5_train.job_config import compose_job
from glm5_train.plan.inputs import inputs_from_job
from glm5_train.plan.pipeline import job_plan, recompute_working_set_bytes
from glm5_train.schedules import lr_shape, tokens_in_steps
from parallel.pipeline_layout import PlanReport

# GPU plans run SDPA's fused kernels, as tools/plan_fit.py's.
ON_GPU = {"fused_attention": True}


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """A job's plan on ``gpus`` GPUs: its largest rank (static + in-flight activations), the
    working set recompute adds on it, the largest static bytes of any rank."""

    gpus: int
    max_rank_bytes: int
    working_set_bytes: int
    static_bytes: int
    report: PlanReport

    @property
    def peak_bytes(self) -> int:
        return self.max_rank_bytes + self.working_set_bytes


def stage_plan(overrides: list[str], dp: int) -> StagePlan:
    job = compose_job(overrides)
    report = job_plan(job, dp, **ON_GPU)
    working_set = recompute_working_set_bytes(job.model, inputs_from_job(job, dp, **ON_GPU))
    return StagePlan(job.parallel.world_size_needed(dp), report.max_rank_bytes, working_set,
                     max(rank.static_bytes for rank in report.ranks), report)


GB = 10**9
# Counted capacities, below the devices' 85.5e9 and 150.8e9 bytes (tools/plan_fit.py's).
DEVICES = {"H100": 80 * GB, "H200": 141 * GB}
BRIDGE_PLANNED_GB, BRIDGE_PUBLISHED_GB = 41.6, 84.9  # plan_fit --recipes; 81,005 MiB


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of the curriculum: its preset, the cluster it is planned on, the report's
    budget in its own words, and the overrides a plan needs that a run gets elsewhere."""

    name: str
    experiment: str
    gpus: int
    device: str
    budget: str
    extra: tuple[str, ...] = ()

    @property
    def overrides(self) -> list[str]:
        return [f"+experiment={self.experiment}", *self.extra]


STAGES = (
    Stage("pre-training 4K", "glm5_pretrain_4k", 512, "H100", "28.5T tokens"),
    Stage("mid-training 32K", "glm5_midtrain_32k", 512, "H100", "1T tokens"),
    Stage("mid-training 128K", "glm5_midtrain_128k", 512, "H100", "500B tokens"),
    Stage("mid-training 200K", "glm5_midtrain_200k", 512, "H100", "50B tokens"),
    Stage("DSA warm-up", "glm5_dsa_warmup", 256, "H200", "1,000 steps x 14 seq"),
    Stage("sparse adaptation", "glm5_dsa_sparse", 256, "H200", "20B tokens"),
    Stage("SFT 202K", "glm5_sft_202k", 128, "H100", "the user's data",
          ("parallel=glm5_sft_202k_128gpu",)),
    Stage("RL", "glm5_rl_744b", 256, "H100", "the user's rollouts",
          ("data.paths=[rollouts.jsonl]",)),
)


@dataclasses.dataclass(frozen=True)
class Row:
    stage: Stage
    tokens: int
    steps: int
    lr: str
    layout: str
    dp: int
    fit: StagePlan

    @property
    def free_fraction(self) -> float:
        return 1.0 - self.fit.peak_bytes / DEVICES[self.stage.device]


def layout_name(par, dp: int) -> str:
    vpp = par.virtual_pipeline_model_parallel_size
    return (f"TP{par.tensor_model_parallel_size}{'+SP' if par.sequence_parallel else ''} "
            f"PP{par.pipeline_model_parallel_size}{f'xVPP{vpp}' if vpp else ''} "
            f"CP{par.context_parallel_size} EP{par.expert_model_parallel_size} DP{dp}")


def data_parallel_size(job, gpus: int) -> int:
    par = job.parallel
    model = (par.tensor_model_parallel_size * par.pipeline_model_parallel_size
             * par.context_parallel_size)
    if gpus % model:
        raise ValueError(f"{gpus} GPUs do not split into replicas of TP x PP x CP = {model}")
    return gpus // model


def stage_row(stage: Stage) -> Row:
    job = compose_job(stage.overrides)
    t = job.train
    dp = data_parallel_size(job, stage.gpus)
    fit = stage_plan(stage.overrides, dp)
    tokens = tokens_in_steps(t.train_iters, t.seq_length, t.global_batch_size,
                             t.rampup_batch_size, t.micro_batch_size)
    lr = lr_shape(t.lr_decay_style, t.lr, t.min_lr, t.lr_warmup_init, t.warmup_steps,
                  t.lr_wsd_decay_iters, t.lr_wsd_decay_style)
    return Row(stage, tokens, t.train_iters, lr, layout_name(job.parallel, dp), dp, fit)


def _tokens(n: int) -> str:
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return str(n)


def table(rows: list[Row], margin: float) -> list[str]:
    head = (f"{'stage':<18} {'preset':<20} {'budget':<21} {'tokens':>7} {'steps':>8} "
            f"{'learning rate':<44} {'layout':<30} {'GPUs':>9} {'GB/GPU':>7} {'free':>5} "
            f"{'fit':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        verdict = ("margin" if r.free_fraction >= margin else "tight" if r.free_fraction >= 0
                   else "NO")
        lines.append(f"{r.stage.name:<18} {r.stage.experiment:<20} {r.stage.budget:<21} "
                     f"{_tokens(r.tokens):>7} {r.steps:>8,} {r.lr:<44} {r.layout:<30} "
                     f"{r.stage.gpus:>4} {r.stage.device} {r.fit.peak_bytes / GB:>7.1f} "
                     f"{r.free_fraction:>5.0%} {verdict:>6}")
    lines += ["", (f"GB/GPU: the planner's largest rank + one layer's recompute working set; free: "
                   f"the share of the device's counted {DEVICES['H100'] // GB} / "
                   f"{DEVICES['H200'] // GB} GB left; margin: at least {margin:.0%} free. The plan "
                   f"leaves out communication buffers, workspaces and fragmentation: Megatron-"
                   f"Bridge's 608-H100 200K SFT layout plans at {BRIDGE_PLANNED_GB} GB here and "
                   f"peaked at {BRIDGE_PUBLISHED_GB} GB.")]
    lines += [f"stage={r.stage.experiment} steps={r.steps} tokens={r.tokens} gpus={r.stage.gpus} "
              f"peak_bytes={r.fit.peak_bytes} fits={r.free_fraction >= 0}" for r in rows]
    return lines


# --- the fewest H100 for the 202K SFT ---------------------------------------------------------

SFT = ["+experiment=glm5_sft_202k"]


def sft_shapes(gpus: int) -> list[tuple[int, int, int]]:
    """(TP, PP, CP) with TP x PP x CP = gpus (DP1: the batch of 32 sequences runs as 32
    micro-batches), TP within a node, PP 4-16, CP at least 2 (202,752 tokens on one rank do not
    fit any layout)."""
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (4, 8, 16):
            cp, rest = divmod(gpus, tp * pp)
            if not rest and cp >= 2 and cp & (cp - 1) == 0:
                out.append((tp, pp, cp))
    return out


def sft_overrides(tp: int, pp: int, cp: int, host_optimizer: bool) -> list[str]:
    ep = min(tp * cp, 64)  # every rank of a replica's TP x CP x DP holds its own experts
    return [*SFT, f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.pipeline_model_parallel_size={pp}",
            f"parallel.context_parallel_size={cp}", f"parallel.expert_model_parallel_size={ep}",
            f"parallel.sequence_parallel={str(tp > 1).lower()}",
            f"parallel.optimizer_cpu_offload={str(host_optimizer).lower()}",
            "parallel.stage_memory_limit_gib=null"]


@dataclasses.dataclass(frozen=True)
class SFTPlan:
    gpus: int
    shape: tuple[int, int, int]
    host_optimizer: bool
    fit: StagePlan

    @property
    def name(self) -> str:
        tp, pp, cp = self.shape
        return f"TP{tp}xPP{pp}xCP{cp}xEP{min(tp * cp, 64)}"


def best_sft_plan(gpus: int, progress=print) -> SFTPlan | None:
    """The plan with the lowest peak over the shapes of ``gpus``, optimizer state on the device
    and in host memory."""
    best = None
    for shape in sft_shapes(gpus):
        for host in (False, True):
            try:
                fit = stage_plan(sft_overrides(*shape, host), 1)
            except ValueError as err:  # a shape the layout rules refuse
                progress(f"  {gpus} GPUs {shape} host_optimizer={host}: refused ({err})")
                continue
            plan = SFTPlan(gpus, shape, host, fit)
            progress(f"  {gpus} GPUs {plan.name} host_optimizer={host}: "
                     f"{fit.peak_bytes / GB:.1f} GB (static {fit.static_bytes / GB:.1f} GB)")
            if best is None or fit.peak_bytes < best.fit.peak_bytes:
                best = plan
    return best


def smallest_sft_lines(counts=(256, 128, 64)) -> list[str]:
    lines = ["", "202K SFT (+experiment=glm5_sft_202k) on fewer H100, each count's best plan:"]
    plans = [best_sft_plan(g, progress=lambda line: lines.append(line)) for g in counts]
    fitting = [p for p in plans if p is not None and p.fit.peak_bytes <= DEVICES["H100"]]
    for plan in plans:
        if plan is not None:
            lines.append(f"best on {plan.gpus}: {plan.name} host_optimizer="
                         f"{plan.host_optimizer}: {plan.fit.peak_bytes / GB:.1f} GB "
                         f"({'fits' if plan in fitting else 'does NOT fit'} 80 GB)")
    if not fitting:
        return [*lines, "smallest_sft_h100=none"]
    best = min(fitting, key=lambda p: p.gpus)
    return [*lines, (f"smallest_sft_h100={best.gpus} peak_bytes={best.fit.peak_bytes} "
                    f"layout={best.name} host_optimizer={best.host_optimizer}")]
