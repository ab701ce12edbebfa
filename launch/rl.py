"""Asynchronous RL on this machine: rollout engines and the trainer side by side.

    python -m launch.rl --run-dir runs/rl_digits [--mode async|sync] [--latency longtail]
                        [--workers 2] [--steps 200] [-- <trainer overrides>]

One run directory holds everything, and running the same command again resumes all of it:

    task.json        the task and loop settings (a rerun must agree with them)
    sft_records.jsonl, sft/        the supervised warm start's records and checkpoint
    versions/        weight versions the trainer publishes (v<step>/, latest)
    spool/           rollout groups the workers write (one file per group)
    rl/              the RL checkpoints and their rollout ledger (rl/rollout_ledger/)
    rl_run/          the trainer's run directory (metrics.jsonl)
    eval.jsonl       held-out reward per evaluated version
    logs/            the workers' and the evaluator's output

Stages: (1) the warm start, ``+experiment=glm5_rl_digits_sft`` on solved task prompts, unless
its checkpoint is complete; (2) the loop: ``--workers`` rollout workers
(``glm5_train.rl.rollout_worker``: Hugging Face transformers' GLM-5 on the newest published
version), the held-out evaluator (``glm5_train.rl.evaluate``) and the trainer
(``python -m launch.local +experiment=glm5_rl_digits`` reading the spool as groups arrive) run
together until the trainer's last step and the evaluation of its last version. A worker that
dies is restarted (it resumes from the spool: no group lost or written twice); the trainer
resumes from its checkpoint and ledger when the command is run again.

``--mode sync`` is the synchronous baseline on the same machinery: the workers generate one
step's groups from the newest version, wait for the next, and the trainer takes exactly those
(``rl.max_policy_lag=0``). ``--latency longtail`` holds each group back for a delay drawn from
a lognormal (median ``--latency-median-s``), standing for tool calls and builds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run as `python launch/rl.py` too
    sys.path.insert(0, REPO)

from glm5_train.checkpoint import latest_iteration  # noqa: E402
from glm5_train.job_config import CONFIG_ERRORS, compose_job, one_line  # noqa: E402
from glm5_train.preemption import parent_death_signal  # noqa: E402
from glm5_train.rl.digit_task import DigitTask, demonstration_records  # noqa: E402
from glm5_train.rl.publisher import (  # noqa: E402
    complete_versions,
    latest_version,
    written_at_seconds,
)
from glm5_train.rl.records import write_rollouts  # noqa: E402
from glm5_train.rl.rollout_worker import build_parser, options_from_args  # noqa: E402

SFT_EXPERIMENT = "glm5_rl_digits_sft"
RL_EXPERIMENT = "glm5_rl_digits"
WORKER_RESTARTS = 3  # per worker, then the loop stops
EVAL_GRACE_S = 300.0  # after the trainer's last step, for the last version's evaluation


@dataclass
class LoopSettings:
    """What a rerun must agree with (task.json): the task and the loop's shape."""

    kind: str = "copy"
    digits: int = 8
    task_seed: int = 0
    group_size: int = 8
    groups_per_step: int = 6
    workers: int = 2
    mode: str = "async"
    latency: str = "none"
    latency_median_s: float = 1.0
    latency_sigma: float = 1.0
    sft_steps: int = 40
    steps: int = 200
    max_policy_lag: int = 4
    trainer_procs: int = 1
    eval_every: int = 5
    eval_prompts: int = 128
    seed: int = 0


class LoopError(RuntimeError):
    """A loop that cannot start or go on (one line)."""


def parse_args(argv: list[str]) -> tuple[str, LoopSettings, list[str]]:
    """(run directory, settings, the trainer's extra Hydra overrides)."""
    if "--" in argv:
        cut = argv.index("--")
        argv, overrides = argv[:cut], argv[cut + 1:]
    else:
        overrides = []
    defaults = LoopSettings()
    p = argparse.ArgumentParser(prog="python -m launch.rl", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True, help="everything of the loop; rerun to resume")
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if name == "mode":
            p.add_argument(flag, default=value, choices=["async", "sync"])
        elif name == "latency":
            p.add_argument(flag, default=value, choices=["none", "longtail"])
        elif name == "kind":
            p.add_argument(flag, default=value, choices=["copy", "reverse", "sum"])
        else:
            p.add_argument(flag, type=type(value), default=value)
    args = vars(p.parse_args(argv))
    run_dir = os.path.abspath(args.pop("run_dir"))  # the children run in the repository
    return run_dir, LoopSettings(**args), overrides


def check_settings(s: LoopSettings) -> None:
    for name in ("digits", "group_size", "groups_per_step", "workers", "sft_steps", "steps",
                 "trainer_procs", "eval_every", "eval_prompts"):
        if getattr(s, name) < 1:
            raise LoopError(f"--{name.replace('_', '-')}={getattr(s, name)} must be >= 1")
    if s.group_size < 2:
        raise LoopError(f"--group-size={s.group_size}: GRPO compares the rollouts of a prompt, "
                        "so a group needs at least 2")
    if s.max_policy_lag < 0:
        raise LoopError(f"--max-policy-lag={s.max_policy_lag} must be >= 0")
    if s.digits < 3:
        raise LoopError(f"--digits={s.digits} must be >= 3 (a held-out split needs strings "
                        "enough: one in 8 is held out)")


def check_trainer_config(run_dir: str, s: LoopSettings, overrides: list[str]) -> None:
    """The trainer's config composes, and a step's groups fit its batch: otherwise a step
    would take fewer groups than --groups-per-step and the rest would go stale."""
    try:
        job = compose_job([f"+experiment={RL_EXPERIMENT}",
                           f"data.paths=[{os.path.join(run_dir, 'spool')}]", *overrides])
    except CONFIG_ERRORS as err:
        raise LoopError(f"the trainer's config: {one_line(err)}") from None
    task, t = DigitTask(s.kind, s.digits), job.train
    length = task.prompt_length + task.max_new_tokens
    per_sequence = t.seq_length // length
    rollouts = s.groups_per_step * s.group_size
    needed = -(-rollouts // per_sequence) if per_sequence else None
    if needed is None or needed > t.global_batch_size:
        raise LoopError(
            f"a step's {s.groups_per_step} groups x {s.group_size} rollouts of {length} tokens "
            f"need {needed or 'more'} sequences of train.seq_length={t.seq_length}, and "
            f"train.global_batch_size={t.global_batch_size}: lower --groups-per-step or "
            f"--group-size, or pass -- train.global_batch_size=<at least {needed}>")


def check_worker_options(run_dir: str, s: LoopSettings) -> None:
    """Each worker's command line as the worker will check it, before anything starts."""
    for k in range(s.workers):
        try:
            options_from_args(build_parser().parse_args(worker_command(run_dir, s, k)[3:]))
        except ValueError as err:
            raise LoopError(f"worker {k}: {err}") from None


def remember_settings(run_dir: str, s: LoopSettings) -> None:
    """Write task.json, or check a rerun agrees with it (``steps`` may grow)."""
    path = os.path.join(run_dir, "task.json")
    if os.path.exists(path):
        with open(path) as handle:
            before = json.load(handle)
        changed = {k: (before.get(k), v) for k, v in asdict(s).items()
                   if k != "steps" and before.get(k) != v}
        if changed:
            detail = ", ".join(f"--{k.replace('_', '-')} was {a}, now {b}"
                               for k, (a, b) in changed.items())
            raise LoopError(f"{run_dir} holds a loop with other settings ({detail}): rerun "
                            "with its settings to resume it, or use a new --run-dir")
    os.makedirs(run_dir, exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        json.dump(asdict(s), handle, indent=1)
    os.replace(path + ".tmp", path)


# ------------------------------------------------------------------------------------------
# The warm start
# ------------------------------------------------------------------------------------------

def warm_start(run_dir: str, s: LoopSettings, overrides: list[str]) -> str:
    """The supervised warm start's checkpoint directory, trained unless complete."""
    sft = os.path.join(run_dir, "sft")
    if _checkpoint_step(sft) == s.sft_steps:
        return sft
    records = os.path.join(run_dir, "sft_records.jsonl")
    if not os.path.exists(records):
        # One demonstration per packed slot of every step (the SFT preset: 8 x 128 tokens).
        task = DigitTask(s.kind, s.digits, s.task_seed)
        count = s.sft_steps * 8 * (128 // (task.prompt_length + task.max_new_tokens))
        write_rollouts(records + ".tmp.jsonl", demonstration_records(task, count))
        os.replace(records + ".tmp.jsonl", records)
    _say(f"warm start: {s.sft_steps} supervised steps on {records}")
    status = _run([sys.executable, "-m", "launch.local", f"+experiment={SFT_EXPERIMENT}",
                   f"data.paths=[{records}]", f"train.train_iters={s.sft_steps}",
                   f"train.warmup_iters={min(10, s.sft_steps // 2)}",
                   f"checkpoint.save={sft}", f"hydra.run.dir={os.path.join(run_dir, 'sft_run')}",
                   *_model_overrides(overrides)])
    if status != 0:
        raise LoopError(f"the warm start failed (status {status}); its output is above")
    return sft


def _model_overrides(overrides: list[str]) -> list[str]:
    """The trainer overrides the warm start must share (the model's shape)."""
    return [o for o in overrides if o.lstrip("+").startswith("model.")]


def _checkpoint_step(root: str) -> int | None:
    """The newest checkpoint's step in ``root`` (None: none)."""
    return latest_iteration(root) if os.path.isdir(root) else None


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------

class Children:
    """The loop's processes: started from the main thread, stopped together, and gone with
    this process even when it is SIGKILLed (a parent-death signal)."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, tuple[list[str], str | None]] = {}
        self.restarts: dict[str, int] = {}

    def start(self, name: str, cmd: list[str], log: str | None = None) -> None:
        self.commands[name] = (cmd, log)
        out = open(log, "a") if log else None  # noqa: SIM115 (the child holds it)
        self.procs[name] = subprocess.Popen(
            cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=out or None,
            stderr=subprocess.STDOUT if out else None, env=_child_env(),
            preexec_fn=parent_death_signal(signal.SIGTERM))  # noqa: PLW1509
        if out:
            out.close()

    def restart(self, name: str) -> None:
        self.restarts[name] = self.restarts.get(name, 0) + 1
        self.start(name, *self.commands[name])

    def stop(self, names: list[str] | None = None, grace_s: float = 30.0) -> None:
        names = list(self.procs) if names is None else names
        for name in names:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name in names:
            try:
                self.procs[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.procs[name].kill()
                self.procs[name].wait()


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def task_args(s: LoopSettings) -> list[str]:
    return ["--kind", s.kind, "--digits", str(s.digits), "--task-seed", str(s.task_seed)]


def worker_command(run_dir: str, s: LoopSettings, k: int) -> list[str]:
    cmd = [sys.executable, "-m", "glm5_train.rl.rollout_worker",
           "--versions", os.path.join(run_dir, "versions"),
           "--spool", os.path.join(run_dir, "spool"), "--worker", str(k),
           "--workers", str(s.workers), "--group-size", str(s.group_size), *task_args(s),
           "--latency", s.latency, "--latency-median-s", str(s.latency_median_s),
           "--latency-sigma", str(s.latency_sigma), "--seed", str(s.seed)]
    if s.mode == "sync":
        cmd += ["--sync-groups", str(s.groups_per_step)]
    else:  # each version makes its share of two steps' groups: the learner never starves,
        # and nothing is made that could only go stale
        cmd += ["--groups-per-version", str(-(-2 * s.groups_per_step // s.workers))]
    return cmd


def evaluator_command(run_dir: str, s: LoopSettings) -> list[str]:
    return [sys.executable, "-m", "glm5_train.rl.evaluate",
            "--versions", os.path.join(run_dir, "versions"),
            "--out", os.path.join(run_dir, "eval.jsonl"), *task_args(s),
            "--prompts", str(s.eval_prompts), "--every", str(s.eval_every),
            "--until-version", str(s.steps), "--seed", str(s.seed)]


def trainer_command(run_dir: str, s: LoopSettings, sft: str, overrides: list[str]) -> list[str]:
    lag = 0 if s.mode == "sync" else s.max_policy_lag
    return [sys.executable, "-m", "launch.local", f"+experiment={RL_EXPERIMENT}",
            f"data.paths=[{os.path.join(run_dir, 'spool')}]",
            f"checkpoint.pretrained={sft}", f"checkpoint.save={os.path.join(run_dir, 'rl')}",
            f"rl.publish_dir={os.path.join(run_dir, 'versions')}",
            f"train.train_iters={s.steps}", f"train.seed={1234 + s.seed}",
            f"rl.max_policy_lag={lag}", f"rl.stream_min_groups={s.groups_per_step}",
            f"rl.stream_max_groups={s.groups_per_step}",
            f"parallel.data_parallel_size={s.trainer_procs}",
            f"hydra.run.dir={os.path.join(run_dir, 'rl_run')}", *overrides]


def run_loop(run_dir: str, s: LoopSettings, sft: str, overrides: list[str]) -> int:
    """Workers, evaluator and trainer together; the trainer's status."""
    for name in ("spool", "versions", "logs"):
        os.makedirs(os.path.join(run_dir, name), exist_ok=True)
    children = Children()
    logs = os.path.join(run_dir, "logs")
    stop = _StopOnSignal(children)
    start = _checkpoint_step(os.path.join(run_dir, "rl")) or 0
    forget_evaluations_after(run_dir, start)
    try:
        children.start("trainer", trainer_command(run_dir, s, sft, overrides))
        # The engines start from the version the trainer publishes at its start: after a
        # resume, versions past its checkpoint are withdrawn and must not be loaded.
        if not _wait_for_version(run_dir, start, children.procs["trainer"], stop):
            return _trainer_status(children, stop)
        for k in range(s.workers):
            children.start(f"worker{k}", worker_command(run_dir, s, k),
                           os.path.join(logs, f"worker{k}.log"))
        children.start("evaluator", evaluator_command(run_dir, s),
                       os.path.join(logs, "evaluator.log"))
        status = _watch(children, s, stop)
        if status == 0 and not stop.received:
            _wait_for_evaluation(children)
        return status
    finally:
        children.stop()
        stop.restore()


def _wait_for_version(run_dir: str, version: int, trainer: subprocess.Popen,
                      stop: _StopOnSignal) -> bool:
    """Until ``latest`` names ``version`` and no newer version is left (False: the trainer
    ended or a stop signal came first)."""
    versions = os.path.join(run_dir, "versions")
    while trainer.poll() is None and not stop.received:
        if (latest_version(versions) == version
                and max(complete_versions(versions), default=-1) == version):
            return True
        time.sleep(0.2)
    return False


def _trainer_status(children: Children, stop: _StopOnSignal) -> int:
    status = children.procs["trainer"].wait()
    return 128 + stop.received if stop.received and status == 0 else status


def forget_evaluations_after(run_dir: str, version: int) -> None:
    """eval.jsonl without the versions past the trainer's checkpoint (withdrawn weights: the
    resumed run publishes those numbers again, from its own weights)."""
    path = os.path.join(run_dir, "eval.jsonl")
    if not os.path.exists(path):
        return
    with open(path) as handle:
        rows = [line for line in handle if line.strip()]
    kept = [line for line in rows if _version_of(line) is not None
            and _version_of(line) <= version]
    if len(kept) == len(rows):
        return
    with open(path + ".tmp", "w") as handle:
        handle.writelines(line if line.endswith("\n") else line + "\n" for line in kept)
    os.replace(path + ".tmp", path)


def _version_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["version"])
    except (ValueError, KeyError, TypeError):
        return None


def _watch(children: Children, s: LoopSettings, stop: _StopOnSignal) -> int:
    """Until the trainer ends: restart a worker that dies; print evaluations as they come."""
    eval_log = _Follower(children.commands["evaluator"][1])
    while True:
        eval_log.relay()
        if children.procs["trainer"].poll() is not None or stop.received:
            return _trainer_status(children, stop)
        for k in range(s.workers):
            name = f"worker{k}"
            code = children.procs[name].poll()
            if code is None:
                continue
            if children.restarts.get(name, 0) >= WORKER_RESTARTS:
                raise LoopError(f"{name} died {WORKER_RESTARTS + 1} times (last status {code}); "
                                f"see {children.commands[name][1]}")
            _say(f"{name} exited with status {code}: restarting it (it resumes from the "
                 "spool)")
            children.restart(name)
        time.sleep(0.5)


def _wait_for_evaluation(children: Children) -> None:
    """The evaluator stops after the last version; give it time to evaluate it."""
    eval_log = _Follower(children.commands["evaluator"][1])
    deadline = time.monotonic() + EVAL_GRACE_S
    while children.procs["evaluator"].poll() is None and time.monotonic() < deadline:
        eval_log.relay()
        time.sleep(0.5)
    eval_log.relay()


class _Follower:
    """Relays the ``eval:`` lines a log file gains to the console."""

    def __init__(self, path: str | None) -> None:
        self.path, self.offset = path, 0
        if path and os.path.exists(path):
            self.offset = os.path.getsize(path)

    def relay(self) -> None:
        if not self.path or not os.path.exists(self.path):
            return
        with open(self.path) as handle:
            handle.seek(self.offset)
            text = handle.read()
        complete = text[:text.rfind("\n") + 1]
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            if line.startswith("eval:"):
                print(line, flush=True)


class _StopOnSignal:
    """Ctrl-C / SIGTERM: pass SIGTERM to every child once (the trainer saves and exits)."""

    def __init__(self, children: Children) -> None:
        self.children, self.received = children, 0
        self.previous = {sig: signal.signal(sig, self._handle)
                         for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum: int, _frame) -> None:
        if not self.received:
            self.received = signum
            for proc in self.children.procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def summary(run_dir: str) -> str:
    """The held-out reward's start, best and end (eval.jsonl)."""
    path = os.path.join(run_dir, "eval.jsonl")
    if not os.path.exists(path):
        return "rl: no evaluation yet"
    with open(path) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    if not rows:
        return "rl: no evaluation yet"
    rows.sort(key=lambda r: r["version"])
    first, last = rows[0], rows[-1]
    best = max(rows, key=lambda r: r["reward"])
    span = written_at_seconds(last["written_at"]) - written_at_seconds(first["written_at"])
    return (f"rl: held-out reward {first['reward']:.3f} at version {first['version']} -> "
            f"{last['reward']:.3f} at version {last['version']} ({span:.0f} s of training), "
            f"best {best['reward']:.3f} at version {best['version']}; exact "
            f"{first['exact']:.3f} -> {last['exact']:.3f}")


def _run(cmd: list[str]) -> int:
    proc = subprocess.Popen(cmd, cwd=REPO, env=_child_env(),
                            preexec_fn=parent_death_signal(signal.SIGTERM))  # noqa: PLW1509
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGTERM)
        return proc.wait()


def _say(message: str) -> None:
    print(f"launch.rl: {message}", flush=True)


def main(argv: list[str]) -> int:
    try:
        run_dir, settings, overrides = parse_args(argv)
        check_settings(settings)
        check_worker_options(run_dir, settings)
        check_trainer_config(run_dir, settings, overrides)
        remember_settings(run_dir, settings)
        sft = warm_start(run_dir, settings, overrides)
        _say(f"loop: {settings.workers} workers ({settings.mode}, latency {settings.latency}), "
             f"trainer to step {settings.steps}; logs in {os.path.join(run_dir, 'logs')}")
        status = run_loop(run_dir, settings, sft, overrides)
    except LoopError as err:
        print(f"launch.rl: error: {err}", file=sys.stderr, flush=True)
        return 2
    print(summary(run_dir), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
