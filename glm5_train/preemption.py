"""How the job's processes stop: stop requests (SIGTERM or SIGUSR1 make the job save at the
next step boundary and exit 0), and forked children that die with their parent.

Who sends them: slurm sends SIGTERM at preemption, ``scontrol requeue``, ``scancel`` and the
time limit, and with ``sbatch --signal=USR1@<seconds>`` SIGUSR1 that long before it. torchrun's
agent forwards SIGTERM (SIGINT, SIGHUP, SIGQUIT) to its workers, and any signal listed in its
``--signals-to-handle`` flag (``launch.local`` passes ``SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1``;
torch 2.13 overwrites ``TORCHELASTIC_SIGNALS_TO_HANDLE`` from that flag), then
SIGKILLs workers still running after ``--shutdown-timeout`` seconds (default 30): give it the
time of one step plus one save. A signal reaching only some ranks is enough: the training loop
takes the largest request over all ranks at each step boundary, so every rank stops after the
same step. A second signal of the same kind gets its previous disposition (SIGTERM: terminate
at once).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

from typing_extensions import Self

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Records the first stop signal this process receives while installed (a context
    manager; only the main thread can install signal handlers, elsewhere it records nothing)."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: int = 0  # signal number, 0: none
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only note it: the step in flight finishes, and the loop saves and exits at its end.
        if not self.received:
            self.received = signum
        previous = self._previous.get(signum)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)


def signal_name(number: int) -> str:
    return signal.Signals(number).name


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def forked_children_die_with_this_process() -> None:
    """Every process forked from this one from now on gets SIGKILL when its parent dies.

    megatron-core's checkpoint writer forks one process per bucket and waits on queues for
    them; when a rank is killed in the middle of a save, those writers block forever on a queue
    to the dead rank, each holding a copy-on-write image of its memory and the job's output
    pipes (so ``torchrun --max-restarts`` starts the next attempt beside them, and a caller
    reading the job's output never sees it end). Linux only (prctl); elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = [0]

    def before_fork() -> None:
        parent[0] = os.getpid()

    def in_child() -> None:
        _die_with_parent(prctl, signal.SIGKILL, parent[0])

    os.register_at_fork(before=before_fork, after_in_child=in_child)


def parent_death_signal(signum: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``signum`` when this process
    dies, even by SIGKILL (a launcher killed by a test's timeout or a CI job manager must not
    leave its job running). The kernel sends it when the *thread* that started the child ends:
    start the child from the main thread. Linux only (prctl); elsewhere None: no preexec_fn."""
    if not sys.platform.startswith("linux"):
        return None
    # Looked up here, in the parent: between fork and exec the child only makes two syscalls.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()
    return lambda: _die_with_parent(prctl, signum, parent)


def _die_with_parent(prctl, signum: int, parent: int) -> None:
    """In a freshly forked child: get ``signum`` when ``parent`` dies."""
    prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect: no signal will come
        os._exit(1)
