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


def nproc_for(job) -> int:
    par = job.parallel
    return par.model_parallel_size * (par.data_parallel_size or 1)


def torchrun_command(nproc: int, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", "-m", "glm5_train.train", *overrides]


def main(argv: list[str]) -> int:
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
