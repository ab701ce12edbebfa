"""How many processes a slurm job starts on each node, and with how many threads.

From the layout and what slurm granted: one process per GPU when the job has GPUs, otherwise the
layout's world size (TP x PP x CP x ``parallel.data_parallel_size``, default 1) split evenly over
the nodes. Each process gets an equal share of its node's CPUs, and as many OpenMP threads. A
layout that does not fit the allocation is refused here, in the batch step, before any rank
starts; nothing here imports megatron-core, so that takes a second, not a job start-up.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass

from parallel.layout import ParallelConfig


class LaunchError(ValueError):
    """The job cannot start as submitted; the message names the value, the rule and the fix."""


@dataclass(frozen=True)
class Allocation:
    """What slurm granted the job (the batch step's view)."""

    nodes: int
    gpus_per_node: int  # 0: the job has no GPUs
    cpus_per_node: int  # the fewest CPUs any of its nodes got

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Allocation:
        try:
            nodes = int(env["SLURM_JOB_NUM_NODES"] if "SLURM_JOB_NUM_NODES" in env
                        else env["SLURM_NNODES"])
            cpus = min(expand_counts(env["SLURM_JOB_CPUS_PER_NODE"]))
        except KeyError as missing:
            raise LaunchError(f"{missing.args[0]} is not set: launch/slurm.sbatch runs under "
                              "slurm (sbatch --nodes=N launch/slurm.sbatch ...)") from None
        return cls(nodes=nodes, gpus_per_node=gpus_on_node(env), cpus_per_node=cpus)


def expand_counts(spec: str) -> list[int]:
    """slurm's per-node count lists: ``"72,36(x2)"`` -> ``[72, 36, 36]``."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise LaunchError(f"cannot read slurm's per-node count list {spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def gpus_on_node(env: Mapping[str, str]) -> int:
    """GPUs slurm granted on this node: ``SLURM_GPUS_ON_NODE``, else the ids in
    ``SLURM_JOB_GPUS``; none when the job asked for none (``--gpus-per-node`` / ``--gres``)."""
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    ids = [g for g in env.get("SLURM_JOB_GPUS", "").split(",") if g.strip()]
    return len(ids)


@dataclass(frozen=True)
class Plan:
    nodes: int
    procs_per_node: int
    cpus_per_proc: int
    uses_gpus: bool
    why: str  # how procs_per_node was chosen, for the job's first lines

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


def parallel_config(values: Mapping) -> ParallelConfig:
    """The ``parallel`` node of the composed config as a ParallelConfig."""
    known = {f.name for f in dataclasses.fields(ParallelConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise LaunchError(f"parallel: unknown field(s) {unknown}; known: {sorted(known)}")
    return ParallelConfig(**values)


def plan_processes(par: ParallelConfig, alloc: Allocation) -> Plan:
    """Processes per node and CPUs per process for this layout on this allocation."""
    return _plan_on_gpus(par, alloc) if alloc.gpus_per_node > 0 else _plan_on_cpus(par, alloc)


def _layout_text(par: ParallelConfig, dp: int | None) -> str:
    return (f"TP{par.tensor_model_parallel_size} x PP{par.pipeline_model_parallel_size} x "
            f"CP{par.context_parallel_size} x DP{dp if dp is not None else '(derived)'}")


def _plan_on_gpus(par: ParallelConfig, alloc: Allocation) -> Plan:
    per_node, mp = alloc.gpus_per_node, par.model_parallel_size
    world = per_node * alloc.nodes
    granted = f"slurm granted {alloc.nodes} node(s) x {per_node} GPU(s) = {world} processes"
    if world % mp:
        raise LaunchError(
            f"{granted}, not a multiple of the layout's TP x PP x CP = {mp} "
            f"({_layout_text(par, par.data_parallel_size)}): submit with --nodes and "
            f"--gpus-per-node giving a multiple of {mp} GPUs, or change the layout")
    dp = par.data_parallel_size
    if dp is not None and mp * dp != world:
        raise LaunchError(
            f"{granted}, but the layout {_layout_text(par, dp)} needs {mp * dp}: submit with "
            f"{mp * dp} GPUs in all, or set parallel.data_parallel_size={world // mp} (or null: "
            "derived from the world size)")
    return Plan(nodes=alloc.nodes, procs_per_node=per_node,
                cpus_per_proc=max(1, alloc.cpus_per_node // per_node), uses_gpus=True,
                why=f"one per GPU ({per_node} GPUs per node)")


def _plan_on_cpus(par: ParallelConfig, alloc: Allocation) -> Plan:
    dp = par.data_parallel_size or 1
    world = par.model_parallel_size * dp
    # Node counts this layout fits: the processes split evenly, at most one per CPU.
    fitting = [n for n in range(1, world + 1)
               if world % n == 0 and world // n <= alloc.cpus_per_node]
    fix = (f"submit with --nodes={fitting[0]}" + (f" (or {fitting[1:]})" if fitting[1:] else "")
           if fitting else "no node count fits")
    if world % alloc.nodes:
        raise LaunchError(
            f"the layout {_layout_text(par, dp)} runs {world} processes, which do not split "
            f"evenly over the {alloc.nodes} nodes slurm granted (without GPUs the layout sets the "
            f"process count): {fix}, or change parallel.data_parallel_size")
    per_node = world // alloc.nodes
    if per_node > alloc.cpus_per_node:
        raise LaunchError(
            f"the layout {_layout_text(par, dp)} runs {world} processes, {per_node} on each of "
            f"the {alloc.nodes} nodes, but slurm granted {alloc.cpus_per_node} CPUs per node (a "
            f"process needs at least one): {fix}, or shrink the layout")
    return Plan(nodes=alloc.nodes, procs_per_node=per_node,
                cpus_per_proc=alloc.cpus_per_node // per_node, uses_gpus=False,
                why=f"no GPUs: the layout's {world} processes / {alloc.nodes} nodes")
