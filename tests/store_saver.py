"""A checkpoint save as the job makes it, reduced to what it does to the save directory (fresh
staging directory, each rank's payload file, hash and fsync, commit), without torch: tests/test_durable.py
runs it in child processes it SIGKILLs, so it must start fast.

    python -m tests.store_saver ROOT ITERATION KILL_AT

SIGKILLs itself just before its KILL_AT-th file-system call (0: never) and prints how many it
made.
"""

from __future__ import annotations

import builtins
import os
import shutil
import signal
import sys

from glm5_train import checkpoint_store as store

SIZES = {"__0_0.distcp": 3000, "__1_0.distcp": 5000}


def payload(iteration: int) -> dict[str, bytes]:
    return {name: bytes([iteration % 256]) * size for name, size in SIZES.items()}


def save(root: str, iteration: int, keep_last: int = 2) -> None:
    staging = store.prepare_staging(root, iteration)
    for name, data in payload(iteration).items():
        with open(os.path.join(staging, name), "wb") as out:
            out.write(data)
    sealed = store.seal_files(staging)
    store.commit(root, iteration, keep_last, sealed)


def _kill_before_call(kill_at: int, calls: list) -> None:
    def counted(function):
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return function(*args, **kwargs)
        return call

    for name in ("rename", "replace", "fsync", "makedirs", "remove", "unlink", "rmdir", "open"):
        setattr(os, name, counted(getattr(os, name)))
    shutil.rmtree, builtins.open = counted(shutil.rmtree), counted(builtins.open)


if __name__ == "__main__":
    calls = [0]
    _kill_before_call(int(sys.argv[3]), calls)
    save(sys.argv[1], int(sys.argv[2]))
    print(calls[0])
