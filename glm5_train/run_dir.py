"""One run directory name that every rank of a job agrees on, with no communication.

Hydra creates its run directory before any process group exists, and its default timestamp can
differ between ranks that start a second apart. ``${glm5_run_id:}`` resolves, in order, to:
``GLM5_RUN_ID`` (set by our launchers, identical on all nodes), torchrun's rendezvous id when the
user gave one, and otherwise a stamp of the torchrun agent process (its start time and pid, which
every local rank shares) or of this process when run without torchrun.
"""

from __future__ import annotations

import os
import time

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
