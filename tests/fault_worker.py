"""The training job's worker with faults planted from the environment, for tests/test_durable.py:

    torchrun ... -m tests.fault_worker <hydra overrides>

runs ``glm5_train.train.main()`` unchanged, after wrapping a few of its functions so that, on
global rank ``GLM5_FAULT_RANK`` (default 0) and only in torchrun restart attempt
``GLM5_FAULT_ATTEMPT`` (default 0):

- ``GLM5_FAULT_KILL_STEP=<k>``: the process SIGKILLs itself as step k starts;
- ``GLM5_FAULT_SIGNAL="<k>:<SIGNAME>:<self|agent>"``: as step k starts, sends the signal to
  itself or to its torchrun agent (what slurm signals; the step starts once the agent's
  forwarded signal has arrived, so the job stops after step k, not later);
- ``GLM5_FAULT_SAVE_KILL="<op>:<text>"``: during a checkpoint save, the rank is SIGKILLed just
  before the first file-system operation whose label contains ``text``, also when megatron-core's
  forked writer processes make it (labels:
  ``fsync:<path>``, ``rename:<src>><dst>``, ``replace:<src>><dst>``, ``rmtree:<path>``,
  ``makedirs:<path>``); ``GLM5_FAULT_TRACE=<file>`` appends every label seen in saves;
- ``GLM5_FAULT_NAN_GRAD="<k>[,<k>...]:<global parameter name>"``: after step k's backward
  (gradients reduced), one element of that parameter's gradient becomes NaN.

Nothing here changes how the job computes; the faults are what a crash, a scheduler or a bad
kernel would do to it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time

import torch.distributed as dist

from glm5_train import train as job
from parallel.grad_norms import global_names


def _acting() -> bool:
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return (rank == int(os.environ.get("GLM5_FAULT_RANK", "0"))
            and attempt == int(os.environ.get("GLM5_FAULT_ATTEMPT", "0")))


def _at_step_start(step: int, requests: list) -> None:
    if os.environ.get("GLM5_FAULT_KILL_STEP") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    spec = os.environ.get("GLM5_FAULT_SIGNAL")
    if spec:
        at, name, target = spec.split(":")
        if int(at) == step:
            os.kill(os.getpid() if target == "self" else os.getppid(), getattr(signal, name))
            deadline = time.monotonic() + 60.0
            while not requests[-1].received and time.monotonic() < deadline:
                time.sleep(0.01)  # the agent forwards it to every worker, this one included


def _plant_step_faults() -> None:
    requests = []

    class WatchedStopRequest(job.StopRequest):
        def __enter__(self):
            requests.append(self)
            return super().__enter__()

    job.StopRequest = WatchedStopRequest
    original = job.train_step

    def train_step(rt, iterators, meter=None, boundary=None, step_index=0):
        _at_step_start(step_index + 1, requests)
        return original(rt, iterators, meter, boundary, step_index)

    job.train_step = train_step


def _plant_nan_gradient(spec: str) -> None:
    steps, name = spec.split(":", 1)
    wanted = {int(s) for s in steps.split(",")}
    original = job._forward_backward
    calls = [0]

    def forward_backward(rt, iterators):
        reports = original(rt, iterators)
        calls[0] += 1
        if calls[0] in wanted:
            _poison(rt.chunks, name)
        return reports

    job._forward_backward = forward_backward


def _poison(chunks, name: str) -> None:
    for chunk in chunks:
        for param, global_name in global_names(chunk).items():
            if global_name.name == name:
                param.main_grad.view(-1)[0] = float("nan")
                return
    raise LookupError(f"rank {dist.get_rank()} holds no parameter {name!r}")


def _label_fd(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/self/fd/{fd}")
    return f"fd{fd}"


def _plant_save_kill(spec: str | None, trace: str | None) -> None:
    """Wrap the file-system calls a save makes, only while ``save_checkpoint`` runs."""
    text = spec.split(":", 1)[1] if spec else None
    op = spec.split(":", 1)[0] if spec else None
    rank_process = os.getpid()  # megatron-core's writers are forked: kill the rank, not them
    originals = {"fsync": os.fsync, "rename": os.rename, "replace": os.replace,
                 "rmtree": shutil.rmtree, "makedirs": os.makedirs}
    labels = {"fsync": lambda fd: _label_fd(fd),
              "rename": lambda src, dst, *a, **k: f"{src}>{dst}",
              "replace": lambda src, dst, *a, **k: f"{src}>{dst}",
              "rmtree": lambda path, *a, **k: str(path),
              "makedirs": lambda path, *a, **k: str(path)}

    def wrapped(kind):
        def call(*args, **kwargs):
            label = f"{kind}:{labels[kind](*args, **kwargs)}"
            if trace:
                with open(trace, "a") as out:
                    out.write(label + "\n")
            if kind == op and text in label:
                os.kill(rank_process, signal.SIGKILL)
            return originals[kind](*args, **kwargs)
        return call

    original_save = job.save_checkpoint

    def save_checkpoint(*args, **kwargs):
        os.fsync, os.rename, os.replace = wrapped("fsync"), wrapped("rename"), wrapped("replace")
        shutil.rmtree, os.makedirs = wrapped("rmtree"), wrapped("makedirs")
        try:
            return original_save(*args, **kwargs)
        finally:
            os.fsync, os.rename, os.replace = (originals["fsync"], originals["rename"],
                                               originals["replace"])
            shutil.rmtree, os.makedirs = originals["rmtree"], originals["makedirs"]

    job.save_checkpoint = save_checkpoint


def main() -> None:
    if _acting():
        _plant_step_faults()
        if os.environ.get("GLM5_FAULT_NAN_GRAD"):
            _plant_nan_gradient(os.environ["GLM5_FAULT_NAN_GRAD"])
        if os.environ.get("GLM5_FAULT_SAVE_KILL") or os.environ.get("GLM5_FAULT_TRACE"):
            _plant_save_kill(os.environ.get("GLM5_FAULT_SAVE_KILL"),
                             os.environ.get("GLM5_FAULT_TRACE"))
    job.main()


if __name__ == "__main__":
    main()
