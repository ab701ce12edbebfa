"""What logging expert load (glm5_train/expert_load.py) costs a training step.

    python bench/expert_load.py                                   # one process (parallel=single)
    torchrun --nproc-per-node 8 bench/expert_load.py              # the main job's layout

Builds the tiny GLM-5 runtime (train=tiny: 8 sequences x 128 tokens per step) and trains
steps with the expert-load hooks attached, timing from inside: the hooks' own time (the
routing map summed per router call and added to the step's counter), counted per step, and
the one all-reduce of ``gather`` (what rank 0 logs; timed after a barrier, so it is not the
wait for the slowest rank's step), beside the step's time and, as the baseline, the memory
all-gather every logged step already makes (glm5_train/metrics.py gather_memory). Every figure is
the median over the timed steps, the costs on the slowest rank. The last line reads
``expert_load: cost_fraction=<(hooks + gather) / step> hooks_ms=<x> gather_ms=<y>
step_ms=<z>``. The step time on a shared 2-core machine is noisy; the costs are measured
directly, not as a difference of step times.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

warnings.filterwarnings("ignore")

import torch
import torch.distributed as dist

from glm5_train.expert_load import ExpertLoad
from glm5_train.metrics import gather_memory

WARMUP_STEPS = 2
TIMED_STEPS = 8


class TimedExpertLoad(ExpertLoad):
    """ExpertLoad whose hooks add their own wall time to ``hook_s`` (and count their calls)."""

    hook_s = 0.0
    calls = 0

    def _hook(self, name: str):
        count = super()._hook(name)

        def timed(*args) -> None:
            started = time.perf_counter()
            count(*args)
            self.hook_s += time.perf_counter() - started
            self.calls += 1
        return timed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def build(total_steps: int):
    from glm5_train.assembly import assemble, iterators
    from glm5_train.job_config import compose_job

    if "WORLD_SIZE" not in os.environ:  # python bench/expert_load.py: one process
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                           ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                           ("MASTER_PORT", str(_free_port()))):
            os.environ[key] = value
    single = ["parallel=single"] if os.environ["WORLD_SIZE"] == "1" else []
    job = compose_job(["model=glm5_tiny", *single, f"train.train_iters={total_steps}",
                       "checkpoint.save=null"])
    rt = assemble(job)
    return rt, iterators(rt, 0)


def _slowest(value: float) -> float:
    """The largest value over the ranks."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main() -> None:
    from glm5_train.train import train_step

    rt, data = build(WARMUP_STEPS + TIMED_STEPS)
    load = TimedExpertLoad(rt.chunks, dist.group.WORLD)
    steps, hooks, gathers, memory, calls = [], [], [], [], 0
    for index in range(WARMUP_STEPS + TIMED_STEPS):
        load.begin_step()
        load.hook_s, load.calls = 0.0, 0
        dist.barrier()
        started = time.perf_counter()
        train_step(rt, data, step_index=index)
        step_s = time.perf_counter() - started
        dist.barrier()  # the gather's own time, not the wait for the slowest rank's step
        started = time.perf_counter()
        fields = load.gather()
        gather_s = time.perf_counter() - started
        dist.barrier()
        started = time.perf_counter()
        gather_memory()  # a gather every logged step already makes: the baseline
        memory_s = time.perf_counter() - started
        if index >= WARMUP_STEPS:
            steps.append(_slowest(step_s))
            hooks.append(_slowest(load.hook_s))
            gathers.append(_slowest(gather_s))
            memory.append(_slowest(memory_s))
            calls = load.calls
    step, hook, gather, baseline = (statistics.median(v)
                                    for v in (steps, hooks, gathers, memory))
    if dist.get_rank() == 0:
        layers, experts = len(load.names), load.num_experts
        print(f"\nexpert_load: tiny GLM-5, {dist.get_world_size()} rank(s), "
              f"{rt.job.train.global_batch_size} x {rt.job.train.seq_length} tokens per step, "
              f"{layers} MoE layers x {experts} experts; {calls} router calls counted on "
              f"rank 0 per step; gather: one all-reduce of {layers * (2 * experts + 1) * 8} "
              f"bytes")
        print(f"worst max/mean at the last step {fields['expert_load_worst_max_over_mean']:.2f}"
              f" ({fields['expert_load_worst_layer']})")
        print(f"medians over {TIMED_STEPS} steps (slowest rank): step {step * 1e3:.1f} ms, "
              f"hooks {hook * 1e3:.3f} ms, gather {gather * 1e3:.3f} ms; the log's memory "
              f"gather (baseline) {baseline * 1e3:.3f} ms: gather / baseline "
              f"{gather / baseline:.2f}")
        print(f"expert_load: cost_fraction={(hook + gather) / step:.5f} "
              f"hooks_ms={hook * 1e3:.3f} gather_ms={gather * 1e3:.3f} step_ms={step * 1e3:.1f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
