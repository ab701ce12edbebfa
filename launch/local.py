"""Launch the training job on this machine with as many processes as the layout needs.

    python -m launch.local [hydra overrides...]

Composes the same Hydra config the job will see, derives ``--nproc-per-node`` as
TP x PP x CP x DP (DP = ``parallel.data_parallel_size``, default 1), validates the layout and
runs the job's own data checks (tokenizer, datasets, a chat SFT dataset's tokenizer and
sequence length; ``glm5_train.assembly.check_data``), then runs ``torchrun --standalone`` on
``glm5_train.train`` with the overrides unchanged, relaying its output. All ranks get one run
directory through ``GLM5_RUN_ID``. Errors are one line, ``launch: error: <message>``: a config,
layout or data error before torchrun starts (status 2, the job's own text); a job that fails
inside torchrun ends the output with its ``glm5_train: error:`` message (torchrun's status,
128 + N where it died of signal N). A signal passed on to torchrun (Ctrl-C, SIGTERM, SIGHUP,
SIGUSR1) that stops it ends with ``launch: stopped: ...``, status 128 + N. torchrun dies with
this process, even a SIGKILLed one (Linux).
``--help`` lists the config groups (read from ``configs/``) and examples.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as `python launch/local.py` too
    sys.path.insert(0, REPO)

from glm5_train.job_config import CONFIG_ERRORS, compose_job, one_line  # noqa: E402
from glm5_train.plan import resolve_pipeline_layout  # noqa: E402
from glm5_train.preemption import parent_death_signal  # noqa: E402
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
    "python -m launch.local parallel=pp2 train.train_iters=4 "
    "hydra.run.dir=outputs/pp2",
    "# chat SFT on data made by tools/prepare_chat_sft.py (same tokenizer, same seq length)",
    "python -m launch.local parallel=single data=chat_sft data.paths=[data/sft] \\",
    "    data.tokenizer=tests/data/glm_tiny_tokenizer train.seq_length=256",
    "# resume that run from its newest checkpoint (checkpoint.load=auto, the default) to step 8;",
    "# the schedule keys continue its schedule (4 steps: warm-up 2, decay over 4)",
    "python -m launch.local hydra.run.dir=outputs/pp2 parallel=pp2 train.train_iters=8 \\",
    "    train.warmup_iters=2 train.lr_decay_iters=4",
]


def nproc_for(job) -> int:
    par = job.parallel
    return par.model_parallel_size * (par.data_parallel_size or 1)


# torchrun passes only SIGTERM, SIGINT, SIGHUP and SIGQUIT on to its workers unless told; the
# job's other stop signal, SIGUSR1 (save, then exit), would kill torchrun and orphan the ranks.
# (torch 2.13's torchrun overwrites TORCHELASTIC_SIGNALS_TO_HANDLE from this flag.)
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def torchrun_command(nproc: int, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", f"--signals-to-handle={TORCHRUN_SIGNALS}",
            "-m", "glm5_train.train", *overrides]


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
    check_job_data(job)  # the job's data and tokenizer checks: a mismatch fails here too
    cmd = torchrun_command(nproc, argv)
    env = dict(os.environ)
    env.setdefault("GLM5_RUN_ID", time.strftime("%Y-%m-%d_%H-%M-%S") + f"_{os.getpid()}")
    env.setdefault("OMP_NUM_THREADS", "1")
    print(f"launch: {nproc} processes: {shlex.join(cmd)}", flush=True)
    return run_torchrun(cmd, env)


def check_job_data(job) -> None:
    """The job's own data checks (glm5_train.assembly.check_data: the tokenizer against the
    model's vocabulary, every dataset prefix, a chat SFT dataset's tokenizer and sequence
    length), run here so a mismatch is one line before torchrun, not a rank's error inside
    its ~30-line failure summary. Imported here: --help needs none of the model code."""
    from glm5_train.assembly import check_data

    check_data(job)


# The job's one-line error (glm5_train/train.py prints it on rank 0), and, for a crash without
# one, the exception line that ends a Python traceback.
JOB_ERROR = re.compile(r"glm5_train: error: (.*)")
EXCEPTION_LINE = re.compile(r"^(?:\[[^\]]*\]:)?\s*([A-Za-z_][\w.]*(?:Error|Exception): .*)")
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


class _Relay:
    """Copies one of torchrun's streams to ours line by line, remembering the job's error."""

    def __init__(self, source, sink) -> None:
        self.source, self.sink = source, sink
        self.job_error: str | None = None
        self.exception: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for raw in iter(self.source.readline, b""):
            try:
                self.sink.write(raw)
                self.sink.flush()
            except OSError:  # our reader went away (`| head`): keep draining, or torchrun blocks
                pass
            line = raw.decode(errors="replace").rstrip()
            if match := JOB_ERROR.search(line):
                self.job_error = match.group(1)
            elif match := EXCEPTION_LINE.match(line):
                self.exception = match.group(1)


def run_torchrun(cmd: list[str], env: dict[str, str]) -> int:
    """Run torchrun, relaying its output; on failure end with the job's one-line error. The
    status is torchrun's, a shell's 128 + N where it died of signal N (as when this process
    exec'd it), and 128 + N too where this process passed on signal N (``stop_status``).

    torchrun runs in its own session: a Ctrl-C in the terminal reaches only this process,
    which passes it on once (in our process group torchrun would get the terminal's SIGINT and
    ours, and it treats a second SIGINT during its shutdown as a reason to abort it). SIGTERM,
    SIGHUP and SIGUSR1 are passed on the same way. Outside our process group nothing would stop
    torchrun when this process is SIGKILLed, so it gets SIGTERM then (a parent-death signal;
    torchrun passes SIGTERM on to its ranks and stops them)."""
    forward = _Forwarder()
    # Installed before torchrun starts: a Ctrl-C from here on reaches it.
    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    try:
        # preexec_fn runs between fork and exec, unsafe where other threads may hold locks the
        # child needs: this process is single-threaded here (the relays start after Popen).
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=parent_death_signal(signal.SIGTERM))  # noqa: PLW1509
        forward.start(proc)
        relays = [_Relay(proc.stdout, sys.stdout.buffer), _Relay(proc.stderr, sys.stderr.buffer)]
        status = proc.wait()
        for relay in relays:
            relay.thread.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if status != 0 and forward.received:  # the user stopped it: no error to explain
        names = ", ".join(dict.fromkeys(signal.Signals(s).name for s in forward.received))
        print(f"launch: stopped: {names} passed on to torchrun, which {ended(status)}",
              file=sys.stderr, flush=True)
        return stop_status(status, forward.received[0])
    if status != 0:
        print(f"launch: error: {failure_line(status, relays)}", file=sys.stderr, flush=True)
    return shell_status(status)


class _Forwarder:
    """The launcher's handler for FORWARDED_SIGNALS: passes each signal on to torchrun once,
    those received before it started as soon as it has."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.received: list[int] = []
        self._pending: list[int] = []

    def __call__(self, signum: int, _frame) -> None:
        self.received.append(signum)
        self._pending.append(signum)
        self._send_pending()

    def start(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self._send_pending()

    def _send_pending(self) -> None:
        # The handler can interrupt this loop (in start()) between any two bytecodes; pop(0) is
        # one call, so each signal is taken, and sent, exactly once.
        while self.proc is not None:
            try:
                signum = self._pending.pop(0)
            except IndexError:
                return
            self.proc.send_signal(signum)


def shell_status(status: int) -> int:
    """Popen's status as a shell reports it: -N (killed by signal N) is 128 + N."""
    return 128 - status if status < 0 else status


def stop_status(status: int, passed_on: int) -> int:
    """The status after this process passed signal ``passed_on`` on and torchrun failed: the
    shell's 128 + N for a process stopped by signal N (130 for Ctrl-C, 143 for SIGTERM), what
    scripts and schedulers test for. Not torchrun's own status: it ends with 1 for any signal
    it handles (its SignalException), which reads as a failed job; and where it died of a
    signal itself (e.g. a SIGKILL after the SIGTERM), that signal, the truer one. Of several
    signals passed on, the first: it started the stop. (A torchrun that exits 0 after one, the
    job having finished, ends with 0: nothing failed.)"""
    return shell_status(status) if status < 0 else 128 + passed_on


def ended(status: int) -> str:
    """How torchrun ended, in words: 'exited with status 1', 'was killed by SIGKILL'."""
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:  # a real-time signal has no name
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


def failure_line(status: int, relays: list[_Relay]) -> str:
    """The job's own error when a rank printed one; else the last exception a rank raised."""
    job_error = next((r.job_error for r in relays if r.job_error), None)
    if job_error:
        return job_error
    exception = next((r.exception for r in reversed(relays) if r.exception), None)
    why = f": {exception}" if exception else ""
    return (f"the job failed (torchrun {ended(status)}){why}; the ranks' output above has the "
            "details")


def _main_or_error(argv: list[str]) -> int:
    """Config and layout errors are the user's to fix: one line, no traceback."""
    try:
        return main(argv)
    except CONFIG_ERRORS as err:  # LayoutError is a ValueError; Hydra's composition errors
        print(f"launch: error: {one_line(err)}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    raise SystemExit(_main_or_error(sys.argv[1:]))
