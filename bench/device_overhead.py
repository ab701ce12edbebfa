"""What the device layer (``parallel/device.py``) costs on a CPU training step.

    python bench/device_overhead.py

One process (world size 1, gloo) builds the tiny GLM-5 runtime once, then times training steps
in two modes, alternating over several rounds so that drift (thermal, other load) hits both:

* ``targeted``: the device layer's redirects only (the production path);
* ``function_mode``: the same plus a global ``TorchFunctionMode`` that inspects every torch call's
  arguments for a CUDA device and rewrites it to CPU (the design ``device.py`` rejected; this one
  only scans the top level of args/kwargs, so it is a lower bound on that design's cost).

It then counts, over a few more steps, how often each redirected callable is invoked per step
(counting wrappers set on the owners for that pass only, then removed), times one representative
call of each with ``timeit``, and bounds the targeted layer's own cost per step by
sum(hits x per-call cost), as a fraction of the median targeted step.

The last line reads ``device_overhead: targeted_cost_fraction=<x> function_mode_ratio=<y>``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import sys
import time
import timeit
import warnings
from collections import Counter
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from parallel import device, mcore_compat  # noqa: E402

WARMUP_STEPS = 2
ROUNDS = 6            # each round times both modes; the order flips every round
STEPS_PER_ROUND = 4   # per mode
COUNT_STEPS = 2       # steps run with the counting wrappers
OVERRIDES = ["model=glm5_tiny", "parallel=single", "train.global_batch_size=2",
             "train.micro_batch_size=1", "train.seq_length=64", "train.warmup_iters=1",
             "checkpoint.save=null"]
MODES = ("targeted", "function_mode")


# ------------------------------------------------------------------ the rejected alternative

_ORIGINAL_TENSOR_TYPE = torch.Tensor.type  # the C method; captured before install()


def _cuda_like(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.startswith("cuda")


class GlobalCpuMode(TorchFunctionMode):
    """What a global approach does: look at every torch call for a CUDA device, rewrite it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            dev = kwargs.get("device")
            if dev is not None and (_cuda_like(dev) or (isinstance(dev, int)
                                                        and not isinstance(dev, bool))):
                kwargs = {**kwargs, "device": device.CPU}
        else:
            kwargs = {}
        if any(isinstance(a, (str, torch.device)) for a in args):
            args = tuple(device.CPU if _cuda_like(a) else a for a in args)
        if func is torch.Tensor.type and func is not _ORIGINAL_TENSOR_TYPE:
            # The redirected Tensor.type re-dispatches to a mode from inside itself; calling it
            # again renames twice ('torch.cuda.cuda.FloatTensor'). A global design would not
            # have that redirect; run the C method.
            return _ORIGINAL_TENSOR_TYPE(*args, **kwargs)
        return func(*args, **kwargs)


# ----------------------------------------------------------------------- runtime and timing


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build(total_steps: int):
    from hydra import compose, initialize_config_dir

    from glm5_train.job_config import JobConfig
    from glm5_train.run_dir import register_resolvers
    from glm5_train.assembly import assemble, iterators

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(_free_port()))):
        os.environ[key] = value
    register_resolvers()
    with initialize_config_dir(config_dir=os.path.join(REPO, "configs"), version_base=None):
        tree = compose("config", overrides=OVERRIDES + [f"train.train_iters={total_steps}"])
    job = JobConfig.from_hydra(tree)
    rt = assemble(job)  # installs mcore_compat and creates the process groups
    return rt, iterators(rt, 0)


def timed_step(step: Callable[[], Any], mode: str) -> float:
    ctx = GlobalCpuMode() if mode == "function_mode" else contextlib.nullcontext()
    started = time.perf_counter()
    with ctx:
        step()
    return time.perf_counter() - started


# ------------------------------------------------------------------------ hit counting

COUNTS: Counter = Counter()


def _counting(key: str, fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any):
        COUNTS[key] += 1
        return fn(*args, **kwargs)

    return wrapper


class _CountingGenerators:
    def __init__(self, key: str, inner: Any) -> None:
        self._key, self._inner = key, inner

    def __getitem__(self, index: Any):
        COUNTS[self._key] += 1
        return self._inner[index]

    def __len__(self) -> int:
        return len(self._inner)


class _CountingView:
    """Stands in for a module's ``torch`` view; counts every attribute lookup on it."""

    def __init__(self, module: str, inner: Any) -> None:
        self.__dict__["_cv_module"], self.__dict__["_cv_inner"] = module, inner

    def __getattr__(self, name: str) -> Any:
        if name in device.CpuTorch._FACTORIES:
            kind = "factory"
        elif name == "distributed":
            kind = "distributed"
        else:
            kind = "attr"
        COUNTS[f"{self._cv_module}.torch [{kind}]"] += 1
        return getattr(self._cv_inner, name)


_MISSING = object()


@contextlib.contextmanager
def counting_wrappers():
    """Set counting wrappers on every installed redirect's owner; restore them on exit."""
    restore: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, value: Any) -> None:
        restore.append((owner, attr, owner.__dict__.get(attr, _MISSING)
                        if isinstance(owner, type) else getattr(owner, attr)))
        setattr(owner, attr, value)

    installed = set(mcore_compat.installed())
    for redirect in mcore_compat.PATCHES:
        if redirect.target not in installed:
            continue
        owner = mcore_compat.resolve_owner(redirect.module)
        current = getattr(owner, redirect.attr)
        key = redirect.target
        if redirect.kind == mcore_compat.TORCH_VIEW:
            patch(owner, "torch", _CountingView(redirect.module, current))
        elif isinstance(current, device.CpuGenerators):
            patch(owner, redirect.attr, _CountingGenerators(key, current))
        elif isinstance(current, type):
            # Keep the class itself (isinstance checks on existing objects); count constructions.
            patch(current, "__init__", _counting(key, current.__init__))
        elif callable(current):
            patch(owner, redirect.attr, _counting(key, current))
        # else: a plain value (HAVE_TE=False, te_general_gemm=None): read, never called
    patch(device.GlooDistributed, "all_to_all_single",
          _counting("_GlooDistributed.all_to_all_single",
                    device.GlooDistributed.all_to_all_single))
    try:
        yield
    finally:
        for owner, attr, value in reversed(restore):
            if value is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, value)


# ------------------------------------------------------------------------ per-call costs

# Redirects whose replacement *is* the work (not dispatch in front of it): the eager body of a
# function megatron-core would torch.compile, and the MLA down projection layer.
NOT_OVERHEAD = {"megatron.core.transformer.moe.router.TopKRouter._apply_expert_bias",
                "megatron.core.transformer.multi_latent_attention.Linear"}


def _per_call_ns(fn: Callable[[], Any], baseline: Callable[[], Any] | None = None) -> float:
    """Best-of-3 ns per call of ``fn`` (minus ``baseline``'s, when given), never below 0.

    The minimum, as timeit advises: other load only ever adds time."""

    def ns(f: Callable[[], Any]) -> float:
        timer = timeit.Timer(f)
        number, _ = timer.autorange()
        return min(timer.repeat(3, number)) / number * 1e9

    cost = ns(fn) - (ns(baseline) if baseline is not None else 0.0)
    return max(cost, 0.0)


def probe_costs() -> dict[str, float]:
    """ns per call of a representative invocation of each redirect (as installed)."""
    from megatron.core.tensor_parallel import random as mcore_random

    view = device.CpuTorch()
    tensor = torch.ones(4)
    state = torch.get_rng_state()
    stream = torch.cuda.Stream()

    def noop() -> None:
        return None

    def stream_ctx() -> None:
        with torch.cuda.stream(stream):
            pass

    probes: dict[str, Callable[[], Any]] = {
        "torch.cuda.current_device": lambda: torch.cuda.current_device(),
        "torch.cuda._lazy_call": lambda: torch.cuda._lazy_call(noop),
        "megatron.core.tensor_parallel.random._lazy_call": lambda: mcore_random._lazy_call(noop),
        "torch.cuda.default_generators": lambda: torch.cuda.default_generators[0],
        "torch.cuda.get_rng_state": lambda: torch.cuda.get_rng_state(),
        "torch.cuda.random.get_rng_state": lambda: torch.cuda.random.get_rng_state(),
        "torch.cuda.set_rng_state": lambda: torch.cuda.set_rng_state(state),
        "torch.cuda.manual_seed": lambda: torch.cuda.manual_seed(1234),
        "torch.cuda.manual_seed_all": lambda: torch.cuda.manual_seed_all(1234),
        "torch.cuda.synchronize": lambda: torch.cuda.synchronize(),
        "torch.cuda.empty_cache": lambda: torch.cuda.empty_cache(),
        "torch.cuda.current_stream": lambda: torch.cuda.current_stream(),
        "torch.cuda.default_stream": lambda: torch.cuda.default_stream(),
        "torch.cuda.Stream": lambda: torch.cuda.Stream(),
        "torch.cuda.Event": lambda: torch.cuda.Event(),
        "torch.cuda.stream": stream_ctx,
        "torch.Tensor.cuda": lambda: tensor.cuda(),
        "torch.Tensor.type": lambda: tensor.type(),
    }
    costs = {key: _per_call_ns(fn) for key, fn in probes.items()}
    # Per-module torch views: each lookup is a Python __getattr__; a factory adds the device
    # rewrite wrapper; `torch.distributed` adds a second __getattr__ hop on the gloo shim.
    costs["[attr]"] = _per_call_ns(lambda: view.float32, lambda: torch.float32)
    costs["[factory]"] = _per_call_ns(lambda: view.zeros(4, device="cuda"),
                                      lambda: torch.zeros(4))
    costs["[distributed]"] = _per_call_ns(lambda: view.distributed.get_rank,
                                          lambda: torch.distributed.get_rank)
    torch.set_rng_state(state)
    return costs


def _cost_key(target: str) -> str:
    """'<module>.torch [attr]' -> '[attr]' (one probe per kind of view lookup); else itself."""
    return "[" + target.split(" [", 1)[1] if " [" in target else target


# ------------------------------------------------------------------------------ main


def main() -> None:
    from glm5_train.train import train_step

    total = WARMUP_STEPS + 1 + ROUNDS * STEPS_PER_ROUND * len(MODES) + COUNT_STEPS
    started = time.perf_counter()
    rt, iterators = build(total)
    setup_s = time.perf_counter() - started

    def step() -> None:
        train_step(rt, iterators)

    for _ in range(WARMUP_STEPS):
        step()
    # One untimed step under the function mode too: its first use pays one-time costs.
    timed_step(step, "function_mode")

    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    round_ratios = []
    for round_index in range(ROUNDS):
        order = MODES if round_index % 2 == 0 else tuple(reversed(MODES))
        this_round: dict[str, list[float]] = {mode: [] for mode in MODES}
        for mode in order:
            for _ in range(STEPS_PER_ROUND):
                this_round[mode].append(timed_step(step, mode))
        for mode in MODES:
            times[mode].extend(this_round[mode])
        round_ratios.append(statistics.median(this_round["function_mode"])
                            / statistics.median(this_round["targeted"]))

    with counting_wrappers():
        for _ in range(COUNT_STEPS):
            step()
    hits = {key: count / COUNT_STEPS for key, count in COUNTS.items()}

    costs = probe_costs()
    fallback = max(costs.values())

    median = {mode: statistics.median(values) for mode, values in times.items()}
    ratio = median["function_mode"] / median["targeted"]

    print(f"\ndevice_overhead: tiny GLM-5, world size 1 (gloo), global batch "
          f"{rt.job.train.global_batch_size} x seq {rt.job.train.seq_length}, "
          f"torch threads {torch.get_num_threads()}, setup {setup_s:.1f} s")
    print(f"{WARMUP_STEPS} warm-up steps (+1 under function_mode), then {ROUNDS} rounds x "
          f"{STEPS_PER_ROUND} steps per mode, order alternating\n")
    print(f"{'mode':<15}{'median ms':>11}{'min ms':>9}{'max ms':>9}{'steps':>7}")
    for mode in MODES:
        values = times[mode]
        print(f"{mode:<15}{median[mode] * 1e3:>11.1f}{min(values) * 1e3:>9.1f}"
              f"{max(values) * 1e3:>9.1f}{len(values):>7}")
    print(f"function_mode / targeted = {ratio:.3f} (medians); per-round paired median "
          f"{statistics.median(round_ratios):.3f}; best steps "
          f"{min(times['function_mode']) / min(times['targeted']):.3f}\n")

    print(f"redirect invocations per training step (mean over {COUNT_STEPS} counted steps):")
    print(f"{'target':<72}{'hits/step':>10}{'ns/call':>9}{'us/step':>9}")
    total_us = 0.0
    guessed = []
    for key, per_step in sorted(hits.items(), key=lambda item: -item[1]):
        if key in NOT_OVERHEAD:
            cost, note = 0.0, "  (is the work, not overhead)"
        elif _cost_key(key) in costs:
            cost, note = costs[_cost_key(key)], ""
        else:
            cost, note = fallback, "  (no probe: max probed cost)"
            guessed.append(key)
        us = per_step * cost / 1e3
        total_us += us
        print(f"{key:<72}{per_step:>10.1f}{cost:>9.0f}{us:>9.1f}{note}")
    never = sorted(set(mcore_compat.installed()) - {k.split(" [")[0] for k in hits}
                   - {k for k in hits})
    print(f"installed but not invoked in a step ({len(never)}): {', '.join(never) or '-'}")

    most_hit = max(hits, key=hits.get)
    most_cost = costs.get(_cost_key(most_hit), fallback)
    all_hits = sum(hits.values())
    brief_us = all_hits * most_cost / 1e3
    step_us = median["targeted"] * 1e6
    fraction = total_us / step_us
    print(f"\nmost-hit redirect: {most_hit}, {hits[most_hit]:.0f}/step at {most_cost:.0f} ns/call")
    print(f"all redirect invocations x most-hit per-call cost: {all_hits:.0f} x {most_cost:.0f} "
          f"ns = {brief_us:.1f} us/step ({brief_us / step_us:.4%} of a step)")
    print(f"sum(hits x own per-call cost): {total_us:.1f} us/step of a {step_us / 1e3:.1f} ms "
          f"targeted step = {fraction:.4%} (upper bound: the probes time whole calls, "
          "including CPU work the CUDA originals would also do)")
    if guessed:
        print(f"(costed at the max probed cost, no probe of their own: {', '.join(guessed)})")
    print(f"device_overhead: targeted_cost_fraction={fraction:.4f} function_mode_ratio={ratio:.3f}")

    from parallel.process_groups import destroy_distributed
    destroy_distributed()


if __name__ == "__main__":
    main()
