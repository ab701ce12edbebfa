"""Every entry point a user runs answers ``--help`` / ``-h``: usage, examples, exit 0, nothing
started.

Tools are found from ``tools/`` itself, so a new tool without a ``--help`` fails here. Each
command runs in an empty temporary directory: a started job would make ``outputs/`` (Hydra's
run directory) or other files there, and would take far longer than an import of torch.
The launchers and shell tools run as real subprocesses; the Python tools run as ``python tool``
would, each forked from the test session's server (tests/spawn.py), which has imported torch
and megatron-core once: 28 interpreters importing them cost minutes on a busy 2-core machine.
"""

from __future__ import annotations

import glob
import os
import runpy
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import spawn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A help that has not answered by then is killed and fails (importing torch + megatron-core
# takes seconds). No time is asserted (a busy machine is slow): what proves nothing started is
# the empty working directory and the absence of torchrun's output.
KILL_AFTER_SECONDS = 180
# launch/ modules a user (or slurm) runs; slurm_plan and usage are libraries
LAUNCHERS = ("launch.local", "launch.slurm", "launch.slurm_rank")


def entry_points() -> list[tuple[str, list[str]]]:
    """(name, command without the help flag) for every launcher and every tool."""
    points = [(m, [sys.executable, "-m", m]) for m in LAUNCHERS]
    for path in sorted(glob.glob(os.path.join(REPO, "tools", "*.py"))):
        points.append((os.path.relpath(path, REPO), [sys.executable, path]))
    for path in sorted(glob.glob(os.path.join(REPO, "tools", "*.sh"))):
        points.append((os.path.relpath(path, REPO), ["bash", path]))
    return points


def run_help(command: list[str], flag: str, cwd: str) -> tuple[subprocess.CompletedProcess, float]:
    if command[0] == sys.executable and command[1].endswith(".py"):
        return fork_help(command[1], flag, cwd)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("SLURM_JOB_ID", None)  # --help must not need an allocation
    start = time.monotonic()
    done = subprocess.run([*command, flag], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=KILL_AFTER_SECONDS, stdin=subprocess.DEVNULL, check=False)
    return done, time.monotonic() - start


def _tool_main(path: str, flag: str, cwd: str, log_path: str) -> None:
    """In the forked process: ``python path flag`` in ``cwd``, its output into ``log_path``."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.pop("SLURM_JOB_ID", None)
    os.chdir(cwd)
    sys.argv = [path, flag]
    sys.path.insert(0, os.path.dirname(path))  # what `python tool` puts first
    runpy.run_path(path, run_name="__main__")


def fork_help(path: str, flag: str, cwd: str) -> tuple[subprocess.CompletedProcess, float]:
    log_path = os.path.join(os.path.dirname(cwd), os.path.basename(cwd) + ".log")
    open(log_path, "w").close()
    start = time.monotonic()
    proc = spawn.fork_server().Process(target=_tool_main, args=(path, flag, cwd, log_path))
    proc.start()
    proc.join(KILL_AFTER_SECONDS)
    if proc.is_alive():
        proc.kill()
        proc.join()
    seconds = time.monotonic() - start
    with open(log_path) as f:
        out = f.read()
    return subprocess.CompletedProcess([path, flag], proc.exitcode, out, out), seconds


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """Every entry point's --help and -h, run in parallel (each mostly waits on imports)."""
    jobs = []
    for name, command in entry_points():
        for flag in ("--help", "-h"):
            cwd = tmp_path_factory.mktemp("help")
            jobs.append((name, flag, command, str(cwd)))
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda j: run_help(j[2], j[1], j[3]), jobs))
    return {(name, flag): (done, seconds, cwd)
            for (name, flag, _, cwd), (done, seconds) in zip(jobs, results)}


def test_discovers_every_tool():
    names = [name for name, _ in entry_points()]
    assert "tools/prepare_chat_sft.py" in names and "tools/hf_checkpoint.py" in names
    assert len([n for n in names if n.startswith("tools/")]) >= 14


@pytest.mark.parametrize("name", [name for name, _ in entry_points()])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help(answers, name, flag):
    done, _, cwd = answers[(name, flag)]
    text = done.stdout
    assert done.returncode == 0, f"{name} {flag}: status {done.returncode}\n{done.stderr[-2000:]}"
    assert "usage" in text.lower(), f"{name} {flag}: no usage line\n{text}"
    assert "Examples:" in text, f"{name} {flag}: no examples\n{text}"
    assert os.listdir(cwd) == [], f"{name} {flag} wrote {os.listdir(cwd)} in its directory"
    assert "torch.distributed.run" not in text + done.stderr  # no torchrun started


@pytest.mark.parametrize("name", ["launch.local", "launch.slurm"])
def test_launcher_help_lists_config_groups_from_configs(answers, name):
    """Every group directory and every option file in configs/ is in the launcher's help."""
    text = answers[(name, "--help")][0].stdout
    configs = os.path.join(REPO, "configs")
    for group in sorted(os.listdir(configs)):
        if not os.path.isdir(os.path.join(configs, group)):
            continue
        assert f"{group}=" in text, f"{name} --help: group {group} missing"
        for option in glob.glob(os.path.join(configs, group, "*.yaml")):
            stem = os.path.basename(option)[:-5]
            assert stem in text, f"{name} --help: {group}={stem} missing"
    assert "train.train_iters" in text and "parallel.data_parallel_size" in text
