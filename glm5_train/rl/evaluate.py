"""Held-out evaluation of published weight versions, as the trainer publishes them.

    python -m glm5_train.rl.evaluate --versions DIR --out eval.jsonl --kind copy --digits 8 \\
        --task-seed 0 [--prompts 128] [--every 1] [--until-version N] [--stop-file PATH] \\
        [--threads 1] [--seed 0]

Whenever ``latest`` moves to a version that is a multiple of ``--every`` (also the first
version this file gets, whatever its number, and any version >= ``--until-version``, the last
one wanted), the evaluator loads it and samples one temperature-1 response to each held-out
prompt 0..P-1 at one fixed seed, the same for every version (the versions differ by their
weights only, not by the draw). One json line per version is appended to ``--out``:
``{"version", "written_at" (version.json's), "reward" (mean per-position reward), "exact"
(fraction of exact answers), "evaluated_at"}``. A restarted evaluator skips the versions the
file holds. Only the version ``latest`` names is evaluated: versions published faster than
they are evaluated are skipped.

Stops when a version >= ``--until-version`` has been evaluated, when the stop file exists, or
on SIGTERM / SIGINT (between versions).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
from dataclasses import dataclass
from typing import TextIO

from glm5_train.rl.digit_task import DigitTask, add_task_arguments, task_from_args
from glm5_train.rl.engine import POLL_S, HfEngine, load_latest, set_threads
from glm5_train.rl.publisher import latest_version
from glm5_train.rl.rollout_worker import stop_on_signals


def evaluate_version(engine: HfEngine, task: DigitTask, prompts: int, seed: int) -> dict:
    """One temperature-1 sample for each of held-out prompts 0..prompts-1 (one batch, drawn
    with ``seed``); the engine's version, its ``written_at``, the mean per-position reward,
    the fraction exact and the time of evaluation (UTC)."""
    if isinstance(prompts, bool) or not isinstance(prompts, int) or prompts < 1:
        raise ValueError(f"evaluate: prompts={prompts!r} must be an integer >= 1 (held-out "
                         "prompts 0..P-1); pass e.g. 128")
    prompt_ids = [task.prompt(i, "heldout") for i in range(prompts)]
    samples = engine.generate(prompt_ids, 1, task.max_new_tokens, seed=seed)
    rewards = [task.reward(s.prompt_ids, s.response_ids) for s in samples]
    exact = [task.exact(s.prompt_ids, s.response_ids) for s in samples]
    return {"version": engine.version, "written_at": engine.written_at,
            "reward": sum(rewards) / len(rewards), "exact": sum(exact) / len(exact),
            "evaluated_at": _now()}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def evaluated_versions(out: str) -> set[int]:
    """The versions ``out`` holds a line for (none if it does not exist). A last line cut by a
    kill is ignored (that version is evaluated again)."""
    if not os.path.exists(out):
        return set()
    versions = set()
    with open(out, encoding="utf-8") as handle:
        for line in handle:
            try:
                versions.add(int(json.loads(line)["version"]))
            except (ValueError, KeyError, TypeError):
                continue
    return versions


def append_record(out: str, record: dict) -> None:
    """One json line, appended and flushed to disk (a reader tails the file)."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    with open(out, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


@dataclass(frozen=True)
class EvalOptions:
    """The CLI's flags. ``until_version`` None: until stopped."""

    versions: str
    out: str
    task: DigitTask
    prompts: int = 128
    every: int = 1
    until_version: int | None = None
    stop_file: str | None = None
    seed: int = 0
    poll_s: float = POLL_S

    def __post_init__(self) -> None:
        for name in ("prompts", "every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} {value!r} must be an integer >= 1")
        if self.until_version is not None and self.until_version < 0:
            raise ValueError(f"--until-version {self.until_version!r} must be >= 0 (a version "
                             "is an optimizer step)")

    def wanted(self, version: int, done: set[int]) -> bool:
        """Whether ``version`` is evaluated: a multiple of ``every``, the file's first, or at
        or past ``until_version`` (so the run ends on it)."""
        if version in done:
            return False
        last = self.until_version is not None and version >= self.until_version
        return version % self.every == 0 or not done or last

    def reached_end(self, done: set[int]) -> bool:
        return self.until_version is not None and any(v >= self.until_version for v in done)


def run_evaluator(options: EvalOptions, stop: threading.Event | None = None,
                  out: TextIO | None = None) -> list[dict]:
    """Evaluate versions as ``latest`` moves until the end (see the module docstring); the
    records appended by this run."""
    stop = stop or threading.Event()
    out = out or sys.stdout
    done = evaluated_versions(options.out)
    appended: list[dict] = []
    seen = None  # the last version latest named: each is looked at once
    while not (stop.is_set() or options.reached_end(done) or _stop_file_exists(options)):
        current = latest_version(options.versions)
        if current is None or current == seen or not options.wanted(current, done):
            seen = current if current is not None else seen
            stop.wait(options.poll_s)
            continue
        engine = load_latest(options.versions, stop=stop, poll_s=options.poll_s)
        if engine is None:
            break
        seen = engine.version  # latest may have moved on while we resolved it
        if not options.wanted(engine.version, done):
            continue
        record = evaluate_version(engine, options.task, options.prompts, options.seed)
        append_record(options.out, record)
        done.add(engine.version)
        appended.append(record)
        print(f"eval: version={record['version']} heldout_reward={record['reward']:.3f} "
              f"exact={record['exact']:.2f}", file=out, flush=True)
    return appended


def _stop_file_exists(options: EvalOptions) -> bool:
    return options.stop_file is not None and os.path.exists(options.stop_file)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m glm5_train.rl.evaluate",
        description="Evaluate each published version on held-out prompts.")
    parser.add_argument("--versions", required=True, help="the publisher's directory of versions")
    parser.add_argument("--out", required=True, help="jsonl file the records are appended to")
    add_task_arguments(parser)
    parser.add_argument("--prompts", type=int, default=128, help="held-out prompts 0..P-1")
    parser.add_argument("--every", type=int, default=1, help="evaluate versions divisible by this")
    parser.add_argument("--until-version", type=int, default=None,
                        help="stop once a version >= this is evaluated")
    parser.add_argument("--stop-file", default=None, help="stop once this file exists")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed of every version")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        options = EvalOptions(versions=args.versions, out=args.out,
                              task=task_from_args(args),
                              prompts=args.prompts, every=args.every,
                              until_version=args.until_version, stop_file=args.stop_file,
                              seed=args.seed)
        set_threads(args.threads)
    except ValueError as err:
        print(f"evaluate: {err}", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # a bar per loaded version would bury the result lines
    hf_logging.set_verbosity_error()  # no load report per version (the MTP layer's weights)
    stop = threading.Event()
    stop_on_signals(stop)
    run_evaluator(options, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
