"""Launch the training job on this machine with as many processes as the layout needs.

    python -m launch.local [hydra overrides...]

Composes the same Hydra config the job will see, derives ``--nproc-per-node`` as
TP x PP x CP x DP (DP = ``parallel.data_parallel_size``, default 1), validates the layout, then
runs ``torchrun --standalone`` on ``glm5_train.train`` with the overrides unchanged. All ranks
get one run directory through ``GLM5_RUN_ID``.
"""

from __future__ import annotations

import os
import shlex
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as `python launch/local.py` too
    sys.path.insert(0, REPO)

from glm5_train.job_config import CONFIG_ERRORS, compose_job, one_line  # noqa: E402
from glm5_train.pipeline_plan import resolve_pipeline_layout  # noqa: E402
from parallel.layout import validate_layout  # noqa: E402
from launch.usage import launcher_help, wants_help  # noqa: E402

HELP_WHAT = """Train GLM-5 on this machine: compose the Hydra config the job will see (the arguments
are Hydra overrides, passed to the job unchanged), check the layout, the data and the tokenizer,
then start torchrun --standalone with TP x PP x CP x DP processes (DP = parallel.data_parallel_size,
default 1) on glm5_train.train. A config, layout or data error stops it before torchrun, in one
line. With no arguments: the tiny GLM-5 on 8 CPU processes (TP2 x PP2 x VPP2 x DP2, EP2), 30
steps, on a corpus built from this Python's standard library."""
HELP_EXAMPLES = [
    "# the main job: 8 processes, 30 steps, a checkpoint at the end in outputs/<run id>/",
    "python -m launch.local",
    "# 2 processes (PP2), 4 steps, in a run directory of your choice",
    "python -m launch.local parallel=pp2 train.train_iters=4 train.warmup_iters=1 "
    "hydra.run.dir=outputs/pp2",
    "# chat SFT on data made by tools/prepare_chat_sft.py (same tokenizer, same seq length)",
    "python -m launch.local parallel=single data=chat_sft data.paths=[data/sft] \\",
    "    data.tokenizer=tests/data/glm_tiny_tokenizer train.seq_length=256",
    "# resume a run from its newest checkpoint (checkpoint.load=auto is the default)",
    "python -m launch.local hydra.run.dir=outputs/pp2 parallel=pp2 train.train_iters=8",
]


def nproc_for(job) -> int:
    par = job.parallel
    return par.model_parallel_size * (par.data_parallel_size or 1)


def torchrun_command(nproc: int, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "glm5_train.train", *overrides]


def main(argv: list[str]) -> int:
    if wants_help(argv):  # before Hydra, which would read --help as a malformed override
        print(launcher_help("python -m launch.local [-h] [hydra overrides...]", HELP_WHAT,
                            HELP_EXAMPLES))
        return 0
    job = compose_job(argv)
    nproc = nproc_for(job)
    t = job.train
    dp = validate_layout(job.parallel, job.model, nproc, t.global_batch_size, t.micro_batch_size,
                         t.seq_length)
    resolve_pipeline_layout(job, dp)  # a bad layout fails here, before any process starts
    cmd = torchrun_command(nproc, argv)
    env = dict(os.environ)
    env.setdefault("GLM5_RUN_ID", time.strftime("%Y-%m-%d_%H-%M-%S") + f"_{os.getpid()}")
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"launch: {nproc} processes: {shlex.join(cmd)}", flush=True)
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


def _main_or_error(argv: list[str]) -> int:
    """Config and layout errors are the user's to fix: one line, no traceback."""
    try:
        return main(argv)
    except CONFIG_ERRORS as err:  # LayoutError is a ValueError; Hydra's composition errors
        print(f"launch: error: {one_line(err)}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(_main_or_error(sys.argv[1:]))
