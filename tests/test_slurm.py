"""launch/slurm.sbatch: the plan, the run directory, and the README's sbatch command on a real
two-node slurm cluster.

The cluster (tests/slurm/cluster.sh) is Debian's slurm-wlm + munge on this machine: two nodes in
network namespaces, each with its own hostname and address, 2 CPUs each, slurm's default
KillWait (30 s). The cluster tests skip only where slurm cannot be installed or run (not root,
no apt-get); .ci/run installs it.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time

import pytest

from glm5_train.run_dir import (
    OWNER_FILE,
    RunDirTaken,
    claim_run_dir,
    find_claimed_run_dir,
    numbered_run_ids,
)
from launch.slurm import rank_overrides, rendezvous_port, thread_count
from launch.slurm_plan import Allocation, LaunchError, expand_counts, gpus_on_node, plan_processes
from parallel.layout import ParallelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = os.path.join(REPO, "tests", "slurm", "cluster.sh")
CANNOT_RUN_SLURM = 3  # cluster.sh's exit status when slurm cannot be installed or run here
README_SECTION = "## Multi-node training under slurm"
# Upper bound of each wait on the job (it takes seconds on an idle machine; far longer on a
# machine shared with other work).
WAIT_S = 600


# --- the plan: processes per node, threads (no cluster needed) -----------------------------

def layout(tp=1, pp=1, dp=None) -> ParallelConfig:
    return ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          data_parallel_size=dp)


def test_processes_per_node_come_from_the_gpus_slurm_granted():
    plan = plan_processes(layout(tp=2, pp=2), Allocation(nodes=4, gpus_per_node=8,
                                                         cpus_per_node=96))
    assert (plan.procs_per_node, plan.world_size, plan.cpus_per_proc, plan.uses_gpus) == (
        8, 32, 12, True)


def test_without_gpus_the_layout_sets_the_process_count():
    plan = plan_processes(layout(pp=2, dp=2), Allocation(nodes=2, gpus_per_node=0,
                                                         cpus_per_node=64))
    assert (plan.procs_per_node, plan.world_size, plan.cpus_per_proc, plan.uses_gpus) == (
        2, 4, 32, False)
    threads, why = thread_count(plan, {})
    assert threads == 32 and "CPUs slurm granted" in why
    assert thread_count(plan, {"OMP_NUM_THREADS": "4"})[0] == 4  # the user's choice wins


@pytest.mark.parametrize("par, alloc, expected", [
    # 12 ranks, 6 per node, on 2-CPU nodes
    (layout(pp=2, dp=6), Allocation(2, 0, 2), (r"6 on each of the 2 nodes.*2 CPUs per node.*"
                                               r"--nodes=6 \(or \[12\]\)")),
    # 6 ranks do not split over 4 nodes
    (layout(tp=2, dp=3), Allocation(4, 0, 8), (r"6 processes, which do not split evenly over "
                                               r"the 4 nodes.*--nodes=1 \(or \[2, 3, 6\]\)")),
    # 2 x 8 GPUs, TP2 x PP2 x DP2 needs 8
    (layout(tp=2, pp=2, dp=2), Allocation(2, 8, 64), (r"2 node\(s\) x 8 GPU\(s\) = 16 processes, "
                                                      r"but the layout .* needs 8.*"
                                                      r"parallel.data_parallel_size=4")),
    # 2 x 3 GPUs for TP4
    (layout(tp=4), Allocation(2, 3, 64), (r"= 6 processes, not a multiple of the layout's "
                                          r"TP x PP x CP = 4")),
])
def test_a_layout_that_does_not_fit_the_allocation_is_one_clear_error(par, alloc, expected):
    with pytest.raises(LaunchError, match=expected):
        plan_processes(par, alloc)


def test_slurm_count_lists_and_gpu_grants_are_read_as_slurm_writes_them():
    assert expand_counts("72,36(x2)") == [72, 36, 36]
    assert expand_counts("2(x2)") == [2, 2]
    assert Allocation.from_env({"SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_CPUS_PER_NODE":
                                "72,36(x2)"}) == Allocation(3, 0, 36)
    assert gpus_on_node({"SLURM_GPUS_ON_NODE": "8"}) == 8
    assert gpus_on_node({"SLURM_JOB_GPUS": "0,1,2,3"}) == 4
    assert gpus_on_node({}) == 0


def test_the_plan_is_made_without_importing_megatron_core():
    """The batch step checks the layout against the allocation in about a second: none of what
    it imports or runs loads megatron-core (which the ranks import, after the check)."""
    code = ("import sys, os; from launch import slurm; from launch.slurm_plan import *; "
            "from omegaconf import OmegaConf; "
            "tree = slurm.compose_tree(['parallel=pp2', 'parallel.data_parallel_size=2']); "
            "par = slurm.parallel_config(OmegaConf.to_container(tree.parallel, resolve=True)); "
            "plan = plan_processes(par, Allocation(2, 0, 2)); "
            "print(plan.procs_per_node, slurm.run_dir_for(tree, 'slurm_1'), "
            "sorted(m for m in sys.modules if m.startswith('megatron')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["2", os.path.join(REPO, "outputs", "slurm_1"), "[]"]


def test_rendezvous_port_is_the_job_ids_or_the_next_free_one():
    port = rendezvous_port(7, can_check=False)
    assert port == 15007
    with socket.socket() as holder:  # another job listening there
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("", port))
        holder.listen()
        assert rendezvous_port(7, can_check=True) == 15008


def test_hydra_logs_to_the_console_which_the_launcher_writes_to_train_log():
    assert rank_overrides(["train.train_iters=3"]) == ["train.train_iters=3",
                                                       "hydra/job_logging=stdout"]
    assert rank_overrides(["hydra/job_logging=none"]) == ["hydra/job_logging=none"]


# --- run directories: one per job attempt set --------------------------------------------

def test_a_run_directory_is_claimed_once_and_found_again_by_the_same_job(tmp_path):
    candidates = [str(tmp_path / i) for i in numbered_run_ids("slurm_7", 3)]
    (tmp_path / "slurm_7").mkdir()  # a run of an earlier job 7 (before a controller reset)
    (tmp_path / "slurm_7" / "metrics.jsonl").write_text('{"step": 1}\n')
    job = {"slurm_cluster": "c", "slurm_job_id": 7}
    first = claim_run_dir(candidates, job)
    assert first == str(tmp_path / "slurm_7.2")
    assert json.loads((tmp_path / "slurm_7.2" / OWNER_FILE).read_text())["slurm_job_id"] == 7
    assert find_claimed_run_dir(candidates, job) == first  # the requeued attempt
    assert find_claimed_run_dir(candidates, {**job, "slurm_job_id": 8}) is None
    # the same id on the controller's next life claims the next one, and is found there
    second = claim_run_dir(candidates, job)
    assert second == str(tmp_path / "slurm_7.3")
    assert find_claimed_run_dir(candidates, job) == second
    with pytest.raises(RunDirTaken, match="already holds another run"):
        claim_run_dir(candidates, job)
    fixed = str(tmp_path / "fixed")  # an explicit hydra.run.dir: every candidate is the same
    assert claim_run_dir([fixed] * 3, job) == fixed
    with pytest.raises(RunDirTaken, match=r"run directory .*/fixed already holds"):
        claim_run_dir([fixed] * 3, job)


# --- the real cluster ----------------------------------------------------------------------

class Cluster:
    """Client commands on the test cluster's login host."""

    def run(self, *args: str, cwd: str = REPO, env: dict | None = None) -> str:
        done = subprocess.run(["bash", CLUSTER, "run", *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, f"{args}: {done.stderr}"
        return done.stdout

    def submit(self, args: list[str], cwd: str = REPO, env: dict | None = None) -> int:
        out = self.run("sbatch", *args, cwd=cwd, env=env)
        return int(re.search(r"Submitted batch job (\d+)", out).group(1))

    def job(self, job_id: int) -> dict[str, str]:
        line = self.run("scontrol", "show", "job", "--oneliner", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", line))

    def wait_for_end(self, job_id: int, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                return info
            time.sleep(1)
        raise AssertionError(f"job {job_id} still {info['JobState']} after {timeout} s")


@pytest.fixture(scope="module")
def cluster():
    up = subprocess.run(["bash", CLUSTER, "up"], capture_output=True, text=True, timeout=900,
                        check=False)
    if up.returncode == CANNOT_RUN_SLURM:
        pytest.skip(f"slurm cannot run on this machine: {up.stderr.strip()}")
    assert up.returncode == 0, up.stderr
    yield Cluster()
    subprocess.run(["bash", CLUSTER, "down"], capture_output=True, timeout=120, check=False)


def wait_until(predicate, timeout: float, what: str, log: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}\n{tail(log)}")


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as handle:
            return handle.read()
    except FileNotFoundError:
        return ""


def tail(path: str, lines: int = 60) -> str:
    return "\n".join(read(path).splitlines()[-lines:]) if path else ""


def env_without_omp() -> dict[str, str]:
    """The submitting shell's environment without OMP_NUM_THREADS, so that the launcher derives
    the thread count from the CPUs slurm grants."""
    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


def test_a_layout_that_does_not_fit_stops_the_job_before_any_rank_starts(cluster, tmp_path):
    """Submitted from another directory: the checkout's code runs (its path is the job's first
    line), the layout (12 ranks on two 2-CPU nodes) is refused in one line, nothing is
    written to outputs/, no rank starts."""
    script = os.path.join(REPO, "launch", "slurm.sbatch")
    job = cluster.submit(["--nodes=2", script, "parallel=pp2", "parallel.data_parallel_size=6"],
                         cwd=str(tmp_path), env=env_without_omp())
    info = cluster.wait_for_end(job, timeout=WAIT_S)
    out = read(str(tmp_path / f"slurm-{job}.out"))
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", out
    assert out.splitlines()[0] == f"launch: slurm job {job}, attempt 1, code from {REPO}"
    errors = [line for line in out.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("launch: error: the layout TP1 x PP2 x CP1 "
                                                     "x DP6 runs 12 processes, 6 on each of the "
                                                     "2 nodes, but slurm granted 2 CPUs"), out
    assert "srun" not in out
    assert not os.path.exists(os.path.join(REPO, "outputs", f"slurm_{job}"))
    assert sorted(os.listdir(tmp_path)) == [f"slurm-{job}.out"]


def readme_sbatch_command() -> list[str]:
    """The first sbatch command of the README's slurm section, as a shell would split it."""
    with open(os.path.join(REPO, "README.md")) as handle:
        text = handle.read()
    section = text.split(README_SECTION, 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    joined = block.replace("\\\n", " ")
    command = next(line for line in joined.splitlines() if line.startswith("sbatch "))
    return shlex.split(command)


def start_uninterrupted(overrides: list[str], run_dir: str) -> subprocess.Popen:
    """The same job in one go, 4 ranks on this machine under torchrun (in the background: it
    overlaps the slurm job's scheduling and requeue waits)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "-m", "glm5_train.train", *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finished_records(proc: subprocess.Popen, run_dir: str) -> list[dict]:
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err[-4000:]
    return metrics(run_dir)


def metrics(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in read(os.path.join(run_dir, "metrics.jsonl")).splitlines()]


def steps_logged(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"^step (\d+)/", text, flags=re.MULTILINE)]


def stop_after_two_more_steps(cluster: Cluster, stop: tuple[str, ...], attempt: int,
                              run_dir: str, out_path: str) -> int:
    """Once the running attempt logged two steps, run ``stop``; wait for attempt ``attempt`` to
    start and return the newest checkpoint's step then (what it must resume from)."""
    done = len(metrics(run_dir))
    wait_until(lambda: len(metrics(run_dir)) >= done + 2, WAIT_S, "two more steps", out_path)
    cluster.run(*stop)
    wait_until(lambda: f"attempt {attempt}," in read(out_path), WAIT_S, f"attempt {attempt}",
               out_path)
    return int(read(os.path.join(run_dir, "checkpoints", "latest_iteration.txt")))


def test_readme_sbatch_trains_on_two_nodes_and_resumes_after_each_stop(cluster, tmp_path):
    """The README's command, unchanged, from the checkout: 4 ranks, 2 on each node. Stopped
    twice during the run: by the time-limit warning `--signal=B:USR1@300` delivers (to the batch
    step: the ranks save at the next step boundary and exit, the job requeues itself), then by
    `scontrol requeue` (slurm's SIGTERM to every rank, as on a preemption). Each attempt
    resumes from the newest checkpoint, the one saved on the signal, in the same run directory;
    metrics hold each step once, with the losses of an uninterrupted run, bit for bit."""
    command = readme_sbatch_command()
    assert command[:3] == ["sbatch", "--nodes=2", "launch/slurm.sbatch"], command
    overrides = command[3:]
    iters = int(next(o for o in overrides if o.startswith("train.train_iters=")).split("=")[1])
    reference_dir = str(tmp_path / "reference")
    reference = start_uninterrupted(overrides, reference_dir)
    # An earlier job with the id the next job gets (slurm reuses ids once its state is reset)
    # left its run there: the new job must not append to it.
    probe = cluster.submit(["--wrap=true", "--output=/dev/null"])
    cluster.wait_for_end(probe, timeout=WAIT_S)
    foreign = os.path.join(REPO, "outputs", f"slurm_{probe + 1}")
    os.makedirs(foreign, exist_ok=True)
    foreign_metrics = '{"step": 1, "loss": 0.0, "note": "another run"}\n'
    with open(os.path.join(foreign, "metrics.jsonl"), "a") as handle:
        handle.write(foreign_metrics)
    job = cluster.submit(command[1:], env=env_without_omp())
    out_path = os.path.join(REPO, f"slurm-{job}.out")
    stops = [("scancel", "--batch", "--signal=USR1", str(job)),
             ("scontrol", "requeue", str(job))]
    run_dir = None
    try:
        assert job == probe + 1
        banner = wait_until(lambda: re.search(r"run directory (\S+) \(new\)", read(out_path)),
                            WAIT_S, "the run directory line", out_path)
        run_dir = banner.group(1)
        assert run_dir != foreign and os.path.dirname(run_dir) == os.path.join(REPO, "outputs")
        newest_at_restart = [stop_after_two_more_steps(cluster, stop, attempt, run_dir, out_path)
                             for attempt, stop in enumerate(stops, start=2)]
        info = cluster.wait_for_end(job, timeout=WAIT_S)
        out = read(out_path)
        assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", tail(out_path)

        attempts = re.split(rf"^launch: slurm job {job}, attempt \d+,", out, flags=re.MULTILINE)[1:]
        assert len(attempts) == 3  # appended: no attempt truncated the log before it
        for text in attempts:
            assert "2 node(s) x 2 processes = 4 ranks" in text
            assert "1 CPU(s) and 1 OpenMP thread(s) per rank (the CPUs slurm granted" in text
            assert "launch: node node1: ranks 0-1 of 4" in text
            assert "launch: node node2: ranks 2-3 of 4" in text
        assert "launch: SIGUSR1" in attempts[0] and f"requeueing job {job}" in attempts[0]
        assert "launch: SIGTERM" in attempts[1]
        for text in attempts[1:]:
            assert f"run directory {run_dir} (this job's, from its earlier attempt)" in text
        # each attempt resumed from the newest checkpoint: the one saved on the signal, at the
        # last step the attempt before it ran
        steps = [steps_logged(text) for text in attempts]
        for before, after, newest in zip(steps, steps[1:], newest_at_restart):
            assert before[-1] == newest and after[0] == newest + 1, out
        all_steps = list(itertools.chain(*steps))
        assert all_steps == list(range(1, iters + 1))

        records = metrics(run_dir)
        assert [r["step"] for r in records] == list(range(1, iters + 1))
        for got, want in zip(records, finished_records(reference, reference_dir), strict=True):
            assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), got["step"]
        # train.log holds the console of every attempt
        log = read(os.path.join(run_dir, "train.log"))
        assert steps_logged(log) == all_steps
        assert log.count(f"launch: slurm job {job}, attempt") == 3
        assert read(os.path.join(foreign, "metrics.jsonl")) == foreign_metrics
    finally:
        if reference.poll() is None:  # torchrun passes SIGTERM on to its workers
            reference.terminate()
            reference.wait(timeout=60)
        for path in (run_dir, foreign):
            if path:
                shutil.rmtree(path, ignore_errors=True)
        if os.path.exists(out_path):
            os.remove(out_path)
