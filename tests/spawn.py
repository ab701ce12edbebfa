"""In-process multi-rank checks: ``run_ranks(world_size, fn, *args)`` runs ``fn(rank,
world_size, *args)`` on that many gloo ranks started from the test process and returns each
rank's result, so a small distributed check needs no torchrun job, and a failing rank's
traceback shows in the test's own failure.

Workers are started by torch.multiprocessing from a clean interpreter, never forked from the
test process (which may hold threads, an initialised process group or megatron-core's patched
state from earlier tests). The default start method is ``forkserver``: one clean server process
imports torch and megatron-core once per test session and forks each worker from there, so a
call costs a fraction of a second instead of the ~3 s (x ranks, on 2 cores) a ``spawn`` worker
spends importing them (the server starts when pytest imports this module, so its imports
overlap test collection); ``start_method="spawn"`` gives a fresh interpreter per worker.

The ranks meet through a FileStore in a temporary directory (no port to race for). ``fn`` must be
a module-level function of an importable module (it is pickled by name), its arguments and
return value picklable (tensors travel by value).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from parallel import mcore_compat
from parallel.process_groups import first_stage_only

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Imported once by the fork server, so forked workers start with them loaded.
# The training job too: tests/parity.py forks its ranks from the same server.
PRELOAD = ("torch", "torch.distributed", "megatron.core.parallel_state",
           "megatron.core.distributed", "megatron.core.transformer.transformer_config",
           "parallel.mcore_compat", "parallel.comm_meter", "tests.spawn", "glm5_train.train",
           "tests.parity")

# megatron-core's import-time notices, printed once per worker otherwise (PYTHONWARNINGS form).
QUIET = ("ignore:Transformer Engine and Apex are not installed", "ignore:Apex is not installed")

DEFAULT_TIMEOUT = 120.0  # seconds for the whole call; a 4-rank check on 2 busy cores takes ~5
_WORKER_FLAG = "RUN_RANKS_WORKER"  # set in the fork server's and workers' environment
_KILL_GRACE = 5.0  # seconds a terminated worker gets before SIGKILL
_STACK_WAIT = 0.5  # seconds a hung worker gets to write its stack after SIGUSR1


class RankFailed(RuntimeError):
    """A worker raised (the message carries its formatted traceback) or died."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class RanksTimedOut(TimeoutError):
    """Some workers did not finish in time (``ranks``); the message has their stacks."""

    def __init__(self, ranks: list[int], message: str) -> None:
        super().__init__(message)
        self.ranks = ranks


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT,
              mcore: bool = True, start_method: str = "forkserver") -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each run on
    its own gloo rank of a ``world_size`` default group.

    ``mcore``: the workers call ``parallel.mcore_compat.install()`` before ``fn`` (megatron-core
    on CPU); create its parallel state inside ``fn`` with ``model_parallel``. The first worker
    exception raises ``RankFailed`` with that rank's traceback and kills the other ranks; a
    call over ``timeout`` seconds raises ``RanksTimedOut`` naming the unfinished ranks."""
    __tracebackhide__ = True  # pytest: the failure is the worker's traceback, not ours
    if world_size < 1:
        raise ValueError(f"run_ranks: world_size={world_size} must be >= 1")
    if "<" in getattr(fn, "__qualname__", "<?>"):  # <lambda>, <locals>: not importable by name
        raise ValueError(f"run_ranks: fn={_name(fn)} is not a module-level function; the "
                         "workers import it by name: define it at the top level of its module")
    ctx = mp.get_context(start_method)
    root = tempfile.mkdtemp(prefix="run_ranks_")
    procs, readers = [], []
    try:
        with _worker_environment(start_method):
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker, name=f"rank{rank}", daemon=True,
                                   args=(rank, world_size, root, writer, mcore, fn, args))
                proc.start()
                writer.close()  # the parent's copy: EOF on the reader once the worker exits
                procs.append(proc)
                readers.append(reader)
        return _collect(procs, readers, root, _name(fn), timeout)
    finally:
        stop_processes(procs)
        for reader in readers:
            reader.close()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def model_parallel(seed: int = 1, **sizes: int) -> Iterator[None]:
    """megatron-core's parallel state on the running ranks (inside ``fn``), with the project's
    embedding group (``first_stage_only``) and tensor-parallel RNG seeding; ``sizes`` are
    ``initialize_model_parallel`` keywords (``pipeline_model_parallel_size=2``, ...)."""
    parallel_state.initialize_model_parallel(get_embedding_ranks=first_stage_only, **sizes)
    try:
        model_parallel_cuda_manual_seed(seed)
        yield
    finally:
        parallel_state.destroy_model_parallel()


# ---------------------------------------------------------------------------- in the workers


def _worker(rank: int, world_size: int, root: str, writer, mcore: bool, fn: Callable,
            args: tuple) -> None:
    # A hung rank's stack, on request (SIGUSR1 from the parent at the timeout).
    with open(_stack_path(root, rank), "w") as stack_file:
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        _run_and_report(rank, world_size, root, writer, mcore, fn, args)


def _run_and_report(rank: int, world_size: int, root: str, writer, mcore: bool, fn: Callable,
                    args: tuple) -> None:
    torch.set_num_threads(1)  # ranks share the cores: one thread each, as torchrun runs use
    try:
        if mcore:
            mcore_compat.install()
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(root, 'store')}",
                                rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        payload = pickle.dumps(result)
    except BaseException:  # noqa: BLE001 - everything goes back to the test, with its stack
        writer.send(("error", traceback.format_exc()))
        writer.close()
        return  # no destroy_process_group: the other ranks may be stuck in a collective
    writer.send(("ok", payload))
    writer.close()
    dist.destroy_process_group()


def _stack_path(root: str, rank: int) -> str:
    return os.path.join(root, f"stack{rank}.txt")


# ------------------------------------------------------------------------- in the test process


@contextlib.contextmanager
def _worker_environment(start_method: str) -> Iterator[None]:
    """Workers (and the fork server, started on first use) inherit os.environ at start: one
    OpenMP thread, the repository importable (the test module is imported there by name)."""
    saved = dict(os.environ)
    os.environ[_WORKER_FLAG] = "1"  # the server and workers import this module: no new server
    paths = [REPO, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    quiet = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w] + list(QUIET)
    os.environ.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)),
                      PYTHONWARNINGS=",".join(quiet))
    try:
        if start_method == "forkserver":
            multiprocessing.forkserver.set_forkserver_preload(list(PRELOAD))
            multiprocessing.forkserver.ensure_running()
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def start_fork_server() -> None:
    """Start the fork server without waiting for it: it imports ``PRELOAD`` in the background
    while the caller goes on (at collection, under pytest, below), and the first ``run_ranks``
    waits only for what is left of that."""
    with _worker_environment("forkserver"):
        pass


def fork_server() -> multiprocessing.context.BaseContext:
    """The ``forkserver`` context, its server running (started here if it is not, with the
    workers' environment): processes it starts fork from a server that has imported
    ``PRELOAD``."""
    start_fork_server()
    return multiprocessing.get_context("forkserver")


def _collect(procs: list, readers: list, root: str, what: str, timeout: float) -> list[Any]:
    """Every rank's result in rank order; raises on the first failure or at the deadline."""
    __tracebackhide__ = True
    n = len(procs)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < n:
        pending = [r for r in range(n) if r not in results]
        left = deadline - time.monotonic()
        if left <= 0:
            raise RanksTimedOut(pending, _timeout_message(procs, pending, root, what, n, timeout))
        ready = multiprocessing.connection.wait(
            [readers[r] for r in pending] + [procs[r].sentinel for r in pending], left)
        for rank in pending:
            if readers[rank] in ready or procs[rank].sentinel in ready:
                if readers[rank].poll():  # a message, or EOF from a worker gone without one
                    results[rank] = _receive(readers[rank], procs[rank], rank, n, what)
                elif not procs[rank].is_alive():
                    raise _died(procs[rank], rank, n, what)
    return [results[r] for r in range(n)]


def _receive(reader, proc, rank: int, n: int, what: str) -> Any:
    __tracebackhide__ = True
    try:
        status, body = reader.recv()
    except EOFError:
        raise _died(proc, rank, n, what) from None
    if status == "error":
        raise RankFailed(rank, f"rank {rank} of {n} raised in {what}:\n{body}")
    return pickle.loads(body)


def _died(proc, rank: int, n: int, what: str) -> RankFailed:
    proc.join(_KILL_GRACE)
    return RankFailed(rank, f"rank {rank} of {n} died in {what} with exit code {proc.exitcode} "
                            "before returning a result (a crash or os._exit; its stderr is in "
                            "the test's captured output)")


def _timeout_message(procs: list, pending: list[int], root: str, what: str, n: int,
                     timeout: float) -> str:
    for rank in pending:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(_STACK_WAIT)
    stacks = []
    for rank in pending:
        try:
            with open(_stack_path(root, rank)) as handle:
                stack = handle.read().strip()
        except FileNotFoundError:  # it had not started running the worker function
            stack = ""
        stacks.append(f"--- rank {rank}:\n{stack or '(no stack written: still starting)'}")
    return (f"ranks {pending} of {n} did not finish {what} within timeout={timeout} s "
            "(a hang, e.g. a collective some rank never joined, or a check too slow for the "
            "timeout: raise it); their stacks:\n" + "\n".join(stacks))


def stop_processes(procs: list, grace: float = _KILL_GRACE) -> None:
    """Terminate the processes still alive; SIGKILL those still there after ``grace`` s."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


# Under pytest, the fork server's imports (~3 s of one core) overlap the collection of the other
# test modules instead of delaying the first multi-rank test.
if "pytest" in sys.modules and _WORKER_FLAG not in os.environ:
    start_fork_server()
