"""One run directory name that every rank of a job agrees on, with no communication.

Hydra creates its run directory before any process group exists, and its default timestamp can
differ between ranks that start a second apart. ``${glm5_run_id:}`` resolves, in order, to:
``GLM5_RUN_ID`` (set by our launchers, identical on all nodes), torchrun's rendezvous id when the
user gave one, and otherwise a stamp of the torchrun agent process (its start time and pid, which
every local rank shares) or of this process when run without torchrun.

A launcher whose run ids can repeat (slurm job ids do, once the controller's state is reset)
claims its directory instead: ``claim_run_dir`` takes the first of the candidate directories no
run has used and records in it the job that owns it, and a later attempt of the same job (a
requeued slurm job) finds it again with ``find_claimed_run_dir``. So a run never appends to
another run's metrics.jsonl, and all attempts of one job share one directory (and checkpoints).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable

import psutil
from omegaconf import OmegaConf


def run_id() -> str:
    explicit = os.environ.get("GLM5_RUN_ID")
    if explicit:
        return explicit
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if rdzv and rdzv != "none" and "LOCAL_RANK" in os.environ and not _looks_random(rdzv):
        return rdzv
    pid = os.getppid() if "LOCAL_RANK" in os.environ else os.getpid()
    started = psutil.Process(pid).create_time()
    return time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(started)) + f"_{pid}"


def _looks_random(rdzv: str) -> bool:
    # torchrun --standalone invents a uuid; a timestamped name reads better in outputs/.
    return len(rdzv) >= 32 and all(c in "0123456789abcdef-" for c in rdzv)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("glm5_run_id"):
        OmegaConf.register_new_resolver("glm5_run_id", run_id)


# Written into a claimed run directory: which job owns it, and when it was claimed.
OWNER_FILE = "run_owner.json"


class RunDirTaken(ValueError):
    """Every candidate run directory already holds another run."""


def numbered_run_ids(base: str, count: int = 100) -> list[str]:
    """``base``, then ``base.2`` ... ``base.<count>``: the run ids a launcher tries in order."""
    return [base] + [f"{base}.{n}" for n in range(2, count + 1)]


def is_unused(path: str) -> bool:
    """A run directory is free when it does not exist or is an empty directory."""
    if not os.path.lexists(path):
        return True
    return os.path.isdir(path) and not os.listdir(path)


def claim_run_dir(candidates: Iterable[str], owner: dict) -> str:
    """Create the first unused candidate directory and record ``owner`` in it; returns it.

    The owner file is created exclusively, so of two jobs racing for one directory exactly one
    gets it and the other moves on to the next candidate."""
    tried = []
    for path in dict.fromkeys(candidates):  # an explicit directory repeats: try it once
        tried.append(path)
        if not is_unused(path):
            continue
        os.makedirs(path, exist_ok=True)
        try:
            fd = os.open(os.path.join(path, OWNER_FILE), os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                         0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as handle:
            json.dump({**owner, "claimed_at": time.time()}, handle)
            handle.write("\n")
        return path
    shown = tried[0] if len(tried) == 1 else f"{tried[0]} ... {tried[-1]}"
    raise RunDirTaken(
        f"run directory {shown} already holds another run (exists and is not empty): remove "
        "it, or give a new directory with hydra.run.dir=<dir> (keep ${glm5_run_id:} in it for "
        "one directory per job)")


def find_claimed_run_dir(candidates: Iterable[str], owner: dict) -> str | None:
    """The most recently claimed candidate whose owner record matches every key of ``owner``,
    or None. Most recently: a job id that repeats after a controller reset may also own an
    older directory, claimed before the reset."""
    best, best_time = None, float("-inf")
    for path in dict.fromkeys(candidates):
        record = read_owner(path)
        if record is None or any(record.get(k) != v for k, v in owner.items()):
            continue
        claimed = float(record.get("claimed_at", 0.0))
        if claimed > best_time:
            best, best_time = path, claimed
    return best


def read_owner(path: str) -> dict | None:
    """The owner record of a claimed run directory (None when it has none or it is unreadable)."""
    try:
        with open(os.path.join(path, OWNER_FILE)) as handle:
            record = json.load(handle)
    except (OSError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def run_overrides(run_dir: str) -> list[str]:
    """The Hydra overrides a finished run was launched with (its ``hydra/overrides.yaml``),
    the ``hydra.*`` ones left out: ``compose_job`` of them is the run's job."""
    path = os.path.join(run_dir, "hydra", "overrides.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: {run_dir} is not the directory of a run of "
                                "glm5_train.train (hydra.run.dir)")
    overrides = OmegaConf.load(path)
    return [str(o) for o in overrides if not str(o).startswith("hydra.")]
