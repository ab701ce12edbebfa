"""GLM-5's training curriculum, stage by stage: one table of what each stage preset runs and
whether its layout fits its cluster by the planner.

    python tools/curriculum.py                 # the table
    python tools/curriculum.py --smallest-sft  # + the fewest H100 that fit the 202K SFT

Each stage is a preset (``configs/experiment/``), composed as the training job composes it and
planned as ``tools/plan_fit.py`` plans it (GPU kernels): tokens (the report's budget, turned into
steps by ``train.train_tokens``, a batch-size ramp included), steps, the learning-rate shape,
the layout, the GPUs, and the planned bytes per GPU (largest rank + one layer's recompute
working set) against the stage's device. A stage continues from the one before it with
``checkpoint.pretrained=<its checkpoints>`` (weights, and the optimizer state where the
optimizer is the same; ``train.lr_from_pretrained=true`` starts at the learning rate it ended at).

Margin: the planner counts weights, gradients, optimizer state and activations, not
communication buffers, workspaces or the allocator's fragmentation. Megatron-Bridge's 608-H100
GLM-5.2 200K SFT layout plans at 41.6 GB here against its published peak of 84.9 GB, so a real
peak can be twice the plan. A stage is marked ``margin`` when its plan leaves at least
``--margin`` of the device free (default 20%), ``tight`` when it fits only without it.

``--smallest-sft`` plans the 202K SFT (``+experiment=glm5_sft_202k``, its batch and techniques)
on 64, 128 and 256 H100 over the (TP, PP, CP) shapes of each count, with the largest expert
parallelism the shape allows, with the optimizer state on the device and in host memory, and
prints the best plan of each count and the bytes that stop the smaller counts. Last line::

    smallest_sft_h100=<int> peak_bytes=<int> layout=<TPxPPxCPxEP> host_optimizer=<bool>

Exit status 0; 2 for a bad command line or a preset that does not compose.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

# Runnable as a script from anywhere: make the repo root importable.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from glm5_train.job_config import compose_job  # noqa: E402
from glm5_train.schedules import lr_shape, tokens_in_steps  # noqa: E402
from tools.plan_fit import Fit, plan_fit  # noqa: E402

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="Apex is not installed")

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
    fit: Fit

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
    fit = plan_fit(stage.overrides, dp, stage.name)
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
    fit: Fit

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
                fit = plan_fit(sft_overrides(*shape, host), 1)
            except ValueError as err:  # a shape the layout rules refuse
                progress(f"  {gpus} GPUs {shape} host_optimizer={host}: refused ({err})")
                continue
            plan = SFTPlan(gpus, shape, host, fit)
            progress(f"  {gpus} GPUs {plan.name} host_optimizer={host}: "
                     f"{fit.peak_bytes / GB:.1f} GB (static {_static(fit) / GB:.1f} GB)")
            if best is None or fit.peak_bytes < best.fit.peak_bytes:
                best = plan
    return best


def _static(fit: Fit) -> int:
    return max(rank.static_bytes for rank in fit.report.ranks)


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
    return [*lines, f"smallest_sft_h100={best.gpus} peak_bytes={best.fit.peak_bytes} "
                    f"layout={best.name} host_optimizer={best.host_optimizer}"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--margin", type=float, default=0.2,
                   help="share of the device a plan must leave free to be marked 'margin'")
    p.add_argument("--smallest-sft", action="store_true",
                   help="also plan the 202K SFT on 64, 128 and 256 H100 (about a minute)")
    args = p.parse_args(argv)
    if not 0.0 <= args.margin < 1.0:
        p.error(f"--margin={args.margin} must lie in [0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        lines = table([stage_row(stage) for stage in STAGES], args.margin)
        if args.smallest_sft:
            lines += smallest_sft_lines()
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        print(f"curriculum: error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
