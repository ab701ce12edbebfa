"""The batch step of ``launch/slurm.sbatch``: plan the job, claim its run directory, run all ranks.

    python -m launch.slurm [hydra overrides...]      (inside a slurm allocation)

1. Plans processes per node from the layout and the allocation (``launch/slurm_plan.py``) and
   refuses a layout that does not fit, in one line, before any rank starts.
2. Picks the run directory: the first attempt of a job claims ``outputs/slurm_<jobid>`` (or
   ``slurm_<jobid>.2``, ... when a run of an earlier job with that id is there; slurm reuses
   ids once its state is reset); a requeued attempt finds the one its job claimed, so it resumes
   from that run's checkpoints (``checkpoint.load=auto``) and appends to its own metrics only.
3. Starts one srun step with one task per rank (``launch/slurm_rank.py``): node-major ranks, an
   equal share of each node's CPUs per rank, rendezvous on the first node's slurm address at a
   port derived from the job id (checked free there). The step's console goes to this job's
   output file and to ``<run dir>/train.log``, both appended to.
4. Signals. SIGTERM (``scontrol requeue``, preemption, ``scancel``, the time limit) reaches every
   rank from slurm itself; the ranks save at the next step boundary and exit, and this step only
   keeps logging until they are done. SIGUSR1 is ``--signal=B:USR1@<s>``'s warning before the
   time limit, sent to this batch step only: it is passed on to the ranks (they save and exit)
   and the job then requeues itself, to go on from that checkpoint.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from hydra import compose, initialize_config_dir
from hydra.errors import CompactHydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from glm5_train.run_dir import (
    RunDirTaken,
    claim_run_dir,
    find_claimed_run_dir,
    numbered_run_ids,
    register_resolvers,
)
from launch.slurm_plan import Allocation, LaunchError, Plan, parallel_config, plan_processes
from launch.usage import launcher_help, wants_help

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(REPO, "configs")
# Rendezvous ports: derived from the job id, below Linux's ephemeral range (32768-60999) so no
# outgoing connection takes the port between the check and the first rank's bind.
PORT_BASE = 15000
PORT_SPAN = 17000
# A job's errors the user fixes: one line, no traceback (hydra's composition errors included).
USER_ERRORS = (LaunchError, RunDirTaken, FileNotFoundError, CompactHydraException,
               OmegaConfBaseException)
USAGE_ERROR_STATUS = 2
HELP_WHAT = """The batch step of launch/slurm.sbatch (submit that script; this module runs inside
the allocation): plans processes per node from the layout and the allocation (one per GPU, or
world size / nodes without GPUs), refuses a layout that does not fit in one line, claims the run
directory outputs/slurm_<jobid> (a requeued attempt resumes there from its newest checkpoint) and
starts one srun step with one rank per task. The arguments are the job's Hydra overrides,
unchanged. SIGUSR1 (--signal=B:USR1@300) makes the ranks save and the job requeue itself."""
HELP_EXAMPLES = [
    "# two CPU nodes: the tiny GLM-5 on 4 ranks (PP2 x DP2), 8 steps, a checkpoint every 4",
    "sbatch --nodes=2 launch/slurm.sbatch parallel=pp2 parallel.data_parallel_size=2 \\",
    "    train.train_iters=8 checkpoint.save_interval=4",
    "# GPU nodes: ask slurm for the GPUs; one rank per GPU (here 256)",
    "sbatch --nodes=32 --gpus-per-node=8 launch/slurm.sbatch model=glm5_744b \\",
    "    parallel=glm5_slime_256gpu train=glm5_pretrain \\",
    "    data.paths=[/lustre/corpus/glm_text_document] data.tokenizer=/models/GLM-5",
]


@dataclass(frozen=True)
class SlurmJob:
    job_id: int
    attempt: int  # 0 on the first run; slurm's restart count after each requeue
    cluster: str
    nodelist: str
    this_node: str  # the batch host, where this step runs

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SlurmJob:
        if "SLURM_JOB_ID" not in env:
            raise LaunchError("SLURM_JOB_ID is not set: launch/slurm.sbatch runs under slurm "
                              "(sbatch --nodes=N launch/slurm.sbatch ...)")
        return cls(job_id=int(env["SLURM_JOB_ID"]),
                   attempt=int(env.get("SLURM_RESTART_COUNT") or 0),
                   cluster=env.get("SLURM_CLUSTER_NAME", ""),
                   nodelist=env["SLURM_JOB_NODELIST"],
                   this_node=env.get("SLURMD_NODENAME", socket.gethostname()))

    @property
    def owner(self) -> dict:
        """What marks a run directory as this job's, across its requeued attempts."""
        return {"slurm_cluster": self.cluster, "slurm_job_id": self.job_id}


def say(line: str, banner: list[str]) -> None:
    """A line of the launcher's own, on the console now and in train.log once it is open."""
    print(f"launch: {line}", flush=True)
    banner.append(f"launch: {line}\n")


# --- config -------------------------------------------------------------------------------

def compose_tree(overrides: list[str]):
    """The job's config tree with Hydra's own node (for hydra.run.dir), unresolved."""
    register_resolvers()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose("config", overrides=overrides, return_hydra_config=True)


@contextlib.contextmanager
def _run_id(run_id: str) -> Iterator[None]:
    saved = os.environ.get("GLM5_RUN_ID")
    os.environ["GLM5_RUN_ID"] = run_id  # what ${glm5_run_id:} resolves to in the ranks
    try:
        yield
    finally:
        if saved is None:
            del os.environ["GLM5_RUN_ID"]
        else:
            os.environ["GLM5_RUN_ID"] = saved


def run_dir_for(tree, run_id: str) -> str:
    """hydra.run.dir as the ranks will resolve it with GLM5_RUN_ID=run_id (from the checkout)."""
    with _run_id(run_id):
        return os.path.abspath(os.path.join(REPO, str(tree.hydra.run.dir)))


def choose_run_dir(tree, job: SlurmJob) -> tuple[str, str, str]:
    """(run id, run directory, how it was chosen) for this attempt of the job."""
    id_of: dict[str, str] = {}  # directory -> the first run id giving it (a fixed dir: one)
    for run_id in numbered_run_ids(f"slurm_{job.job_id}"):
        id_of.setdefault(run_dir_for(tree, run_id), run_id)
    if job.attempt > 0:
        found = find_claimed_run_dir(id_of, job.owner)
        if found is not None:
            return id_of[found], found, "this job's, from its earlier attempt"
    path = claim_run_dir(id_of, job.owner)
    how = "new" if job.attempt == 0 else "new: no earlier attempt of this job claimed one"
    return id_of[path], path, how


def rank_overrides(overrides: list[str]) -> list[str]:
    """The user's overrides, plus Hydra logging to the console only: this step writes the
    console (all ranks) into train.log, which Hydra's file logger would otherwise also write."""
    if any(o.lstrip("+~").startswith("hydra/job_logging") for o in overrides):
        return list(overrides)
    return [*overrides, "hydra/job_logging=stdout"]


# --- nodes, threads, rendezvous -----------------------------------------------------------

def scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], check=True, capture_output=True,
                          text=True).stdout


def head_node(job: SlurmJob) -> str:
    """The job's first node: rank 0 and the rendezvous run there."""
    return scontrol("show", "hostnames", job.nodelist).split()[0]


def node_address(node: str) -> str:
    """The address slurm itself reaches the node at (its NodeAddr): routable from every node,
    unlike what the node's own hostname may resolve to there (127.0.1.1 on Debian)."""
    match = re.search(r"\bNodeAddr=(\S+)", scontrol("show", "node", "--oneliner", node))
    return match.group(1) if match else node


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def rendezvous_port(job_id: int, can_check: bool) -> int:
    """The job's port: PORT_BASE + job id mod PORT_SPAN, or the next free one when this step
    runs on the head node and can check (on a shared node another job may hold it)."""
    for step in range(PORT_SPAN if can_check else 1):
        port = PORT_BASE + (job_id + step) % PORT_SPAN
        if not can_check or port_is_free(port):
            return port
    raise LaunchError(f"no free port in {PORT_BASE}-{PORT_BASE + PORT_SPAN - 1} on the head node")


def thread_count(plan: Plan, env: Mapping[str, str]) -> tuple[int, str]:
    """OpenMP threads per rank: the user's OMP_NUM_THREADS, else the rank's share of CPUs."""
    given = env.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given), "OMP_NUM_THREADS from the environment"
    return plan.cpus_per_proc, "the CPUs slurm granted per node / processes per node"


def checkout_of_job_code() -> str:
    """The directory glm5_train is imported from here, as in the ranks (same cwd, same path);
    a different installed copy is refused."""
    spec = importlib.util.find_spec("glm5_train")
    where = os.path.dirname(os.path.dirname(os.path.abspath(spec.origin))) if spec else None
    if where != REPO:
        raise LaunchError(f"glm5_train would be imported from {where}, not from this checkout "
                          f"{REPO}: run from the checkout (launch/slurm.sbatch does)")
    return where


def srun_command(plan: Plan, overrides: list[str]) -> list[str]:
    return ["srun", f"--nodes={plan.nodes}", f"--ntasks={plan.world_size}",
            f"--ntasks-per-node={plan.procs_per_node}", f"--cpus-per-task={plan.cpus_per_proc}",
            "--distribution=block", "--kill-on-bad-exit=1", f"--chdir={REPO}",
            sys.executable, "-m", "launch.slurm_rank", *rank_overrides(overrides)]


# --- the step -----------------------------------------------------------------------------

class Console:
    """This step's console (the job's output file) and train.log, written together. Unbuffered
    writes: the signal handlers write too, possibly while a write of the main loop is under way
    (a buffered stream refuses such a reentrant call)."""

    def __init__(self, log_fd: int) -> None:
        self.fds = (sys.stdout.fileno(), log_fd)

    def write(self, data: bytes) -> None:
        for fd in self.fds:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]

    def line(self, text: str) -> None:
        self.write(f"launch: {text}\n".encode())


class Step:
    """Runs the srun step, copying its output to the console, and handles the signals slurm
    sends the batch step (see the module docstring)."""

    def __init__(self, cmd: list[str], env: dict[str, str], console: Console) -> None:
        self.cmd, self.env, self.console = cmd, env, console
        self.proc: subprocess.Popen | None = None
        self.warned_of_time_limit = False

    def _on_usr1(self, signum, frame) -> None:
        self.warned_of_time_limit = True
        self.console.line("SIGUSR1 (slurm's warning before the time limit): the ranks save and "
                          "stop; the job then requeues itself")
        if self.proc is not None:
            self.proc.send_signal(signal.SIGUSR1)  # srun passes it on to every rank

    def _on_term(self, signum, frame) -> None:
        # slurm signals every rank itself; srun, which got it too, passes it on once more
        self.console.line("SIGTERM (slurm is stopping the job: requeue, preemption, scancel or "
                          "time limit): the ranks save and stop")

    def run(self) -> int:
        previous = {s: signal.signal(s, h) for s, h in
                    ((signal.SIGUSR1, self._on_usr1), (signal.SIGTERM, self._on_term))}
        try:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            while chunk := os.read(self.proc.stdout.fileno(), 1 << 16):
                self.console.write(chunk)
            status = self.proc.wait()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        self.console.line(f"srun exited with status {status}")
        return status


def requeue_self(job: SlurmJob, console: Console) -> None:
    """Put the job back in the queue; its next attempt resumes from the checkpoint just saved.
    slurm then ends this attempt with a SIGTERM, which has nothing left to stop."""
    console.line(f"requeueing job {job.job_id} to go on from its newest checkpoint")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.run(["scontrol", "requeue", str(job.job_id)], check=True)


def main(argv: list[str]) -> int:
    if wants_help(argv):  # before the slurm checks: answers outside an allocation too
        print(launcher_help("sbatch --nodes=N [--gpus-per-node=G] launch/slurm.sbatch "
                            "[hydra overrides...]   (runs python -m launch.slurm [-h] ...)",
                            HELP_WHAT, HELP_EXAMPLES))
        return 0
    banner: list[str] = []
    job = SlurmJob.from_env(os.environ)
    say(f"slurm job {job.job_id}, attempt {job.attempt + 1}, code from {checkout_of_job_code()}",
        banner)
    tree = compose_tree(argv)
    par = parallel_config(OmegaConf.to_container(tree.parallel, resolve=True))
    plan = plan_processes(par, Allocation.from_env(os.environ))
    threads, why_threads = thread_count(plan, os.environ)
    run_id, run_dir, how = choose_run_dir(tree, job)
    head = head_node(job)
    address, port = node_address(head), rendezvous_port(job.job_id, job.this_node == head)
    say(f"{plan.nodes} node(s) x {plan.procs_per_node} processes = {plan.world_size} ranks "
        f"({plan.why}); {plan.cpus_per_proc} CPU(s) and {threads} OpenMP thread(s) per rank "
        f"({why_threads})", banner)
    say(f"rendezvous {address}:{port} on {head}; run directory {run_dir} ({how})", banner)
    env = {**os.environ, "GLM5_RUN_ID": run_id, "OMP_NUM_THREADS": str(threads),
           "MASTER_ADDR": address, "MASTER_PORT": str(port),
           "LOCAL_WORLD_SIZE": str(plan.procs_per_node), "PYTHONUNBUFFERED": "1"}
    cmd = srun_command(plan, argv)
    say(shlex.join(cmd), banner)
    with open(os.path.join(run_dir, "train.log"), "ab", buffering=0) as log:
        log.write("".join(banner).encode())  # already on the console
        console = Console(log.fileno())
        step = Step(cmd, env, console)
        status = step.run()
        if step.warned_of_time_limit:
            requeue_self(job, console)
            return 0
    return status


def _main_or_error(argv: list[str]) -> int:
    try:
        return main(argv)
    except USER_ERRORS as err:
        print(f"launch: error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        return USAGE_ERROR_STATUS


if __name__ == "__main__":
    raise SystemExit(_main_or_error(sys.argv[1:]))
