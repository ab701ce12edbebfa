"""How long a training step takes and where the time goes, per rank, before a run: the
planner's step-time model.

What goes in:
- the planner's FLOPs per stage and micro-batch (forward, backward, recompute);
- its bytes per collective (context-, tensor-, expert-parallel per micro-batch; the pipeline's
  sends; the data-parallel gradient reduction and parameter gather per step);
- a ``ClusterSpec``: one compute rate, HBM bandwidth, GPUs per node, and the bandwidth and
  latency of the links inside a node and between nodes (``configs/cluster/*.yaml``).

How the parts combine:
- Compute: FLOPs at the spec's rate; the sparse attention's torch path (the planner's
  ``Streamed`` parts) its matmuls at the spec's batched-matmul rate and its gathers and
  scatters at the memory rate (``streamed_seconds``); on CPU plans, the element-wise operators'
  bytes (``glm5_train.plan.elementwise``) at the memory rate.
- A collective: its bytes at the rate of the links it crosses (a reduce-scatter's and an
  all-reduce's at their own rates where the spec gives them: ``Link``). The group's ranks
  are placed as megatron-core places them (order tp-cp-ep-dp-pp; experts etp-ep-edp-pp), on
  nodes of ``gpus_per_node`` consecutive ranks. Bytes inside a node go at the intra-node rate, bytes
  between nodes at the inter-node rate (``parallel.hierarchical_all_to_all.level_bytes``'s
  split), the two levels one after the other.
- Each micro-batch's forward and backward take their compute plus their exposed collectives.
  The pipeline schedule is replayed with those times (``parallel.pipeline_layout.replay_times``):
  the bubble is what is left of the step on each rank.
- Per step: finalize's gradient reduction (and TP all-reduce of replicated gradients), the
  optimizer (HBM-bound element updates, Muon's Newton-Schulz FLOPs) and the distributed
  optimizer's parameter all-gather.
- ``Overlaps`` says which communication runs behind compute:
  - ``grad_reduce``: megatron-core's bucketed reduction starts in each chunk's last backward.
  - ``param_gather``: the next step's forward waits for each chunk's parameters.
  - ``expert_all_to_all``: an ideal EP overlap (each all-to-all behind the compute of another
    micro-batch).
  - Pipeline ZeRO2's reduce-scatter is asynchronous: only its last flush is exposed.

MFU counts the model's FLOPs (no recompute) against the spec's peak, as Megatron-LM reports
its TFLOP/s per GPU.

A logged step beside the prediction (``measured_split``, ``predicted_split``: the busiest
rank's milliseconds by the same parts, measured from metrics.jsonl's ``comm_by_purpose``):
``tools/plan_vs_measured.py --cluster`` and ``bench/step_time_vs_measured.py``.

Not modelled: expert load imbalance (the router spreads tokens evenly), kernel launch and
Python overhead, element-wise work on GPUs (fused there; left to the compute rate), the cost
of each collective call, and congestion between collectives that run at once.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from glm5_train.job_config import JobConfig
from glm5_train.model.config import GLM5Config
from glm5_train.plan.elementwise import TORCH_ADAMW_STEP_BYTES, runs_unfused
from glm5_train.plan.inputs import MemoryInputs, inputs_from_job, mtp_sets
from glm5_train.plan.param_count import Term, layer_terms, mtp_layer_terms
from glm5_train.plan.pipeline import job_pipeline, plan_report
from glm5_train.plan.stage_model import ADAMW_MATRICES, TP_SPLIT
from glm5_train.plan.traffic import gathers_per_bucket, stage_sends, tensor_parallel_step_comm
from parallel.hierarchical_all_to_all import level_bytes
from parallel.pipeline_layout import (
    Comm,
    PipelineLayout,
    PipelineSchedule,
    layout_from_counts,
    replay_times,
)
from parallel.recompute import Recompute

CLUSTER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs", "cluster")

# Bytes an optimizer step reads and writes per element it updates (HBM-bound): AdamW with
# bf16 weights reads the fp32 gradient, master, m and v and writes master, m, v and the bf16
# weight; Muon reads the gradient and momentum, writes the momentum, and updates master and
# weight the same way.
ADAMW_STEP_BYTES = 4 * 4 + 3 * 4 + 2
MUON_STEP_BYTES = 2 * 4 + 4 + 2 * 4 + 2
NEWTON_SCHULZ_ITERATIONS = 5
# megatron-core's DDP bucket: at least 40M parameters (bucket_size default; see bucket_elements).
DDP_BUCKET_ELEMENTS = 40_000_000
# The kinds of communication the breakdown reports, in its order.
COMM_KINDS = ("tensor_parallel", "context_parallel", "expert_all_to_all", "pipeline",
              "grad_reduction", "param_gather")
# A planned collective's group (``parallel.pipeline_layout.Comm`` keys "<op>:<group>") -> kind.
GROUP_KINDS = {"tp": "tensor_parallel", "expt_tp": "tensor_parallel",
               "tp_ep": "tensor_parallel", "cp": "context_parallel",
               "world": "context_parallel", "ep": "expert_all_to_all"}


# ------------------------------------------------------------------------- cluster spec


@dataclass(frozen=True)
class Link:
    """One level of the network as one rank sees it: bytes per second it sends (per
    direction, what collectives reach) in an all-gather, and the time one message takes to
    start. A reduce-scatter or an all-reduce may send its bytes at another rate: gloo runs a
    tensor reduce-scatter as an all-reduce of the whole input (1.3-2.1x an all-gather's time
    for the bytes counted at 0.75-4 MiB pieces on 2 ranks, about the same at 8-16 MiB), and
    its big all-reduce goes 2.5-3x faster per counted byte than its all-gather
    (``tools/calibrate_cluster.py`` measures each); 0 means at
    ``gbs`` (NCCL's rings run all three at one bus bandwidth: the GPU presets)."""

    gbs: float
    latency_us: float
    reduce_scatter_gbs: float = 0.0
    all_reduce_gbs: float = 0.0

    def rate(self, op: str) -> float:
        """Bytes per second ``op``'s counted bytes go at."""
        own = {"reduce_scatter": self.reduce_scatter_gbs, "all_reduce": self.all_reduce_gbs}
        return (own.get(op) or self.gbs) * 1e9

    def seconds(self, sent: float, messages: int = 0, op: str = "all_gather") -> float:
        return sent / self.rate(op) + messages * self.latency_us * 1e-6

    def rates_text(self, fmt: str = "g") -> str:
        """The all-gather's GB/s, and the reduce-scatter's and all-reduce's beside it where
        any differs (a measured gloo spec)."""
        rates = [self.rate(op) / 1e9 for op in ("all_gather", "reduce_scatter", "all_reduce")]
        if len(set(rates)) == 1:
            return f"{rates[0]:{fmt}} GB/s"
        return "/".join(f"{r:{fmt}}" for r in rates) + " GB/s (gather/scatter/reduce)"


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster as the step-time model sees it (``configs/cluster/<name>.yaml``)."""

    name: str
    device: str
    peak_tflops: float  # the device's dense peak at the training precision: MFU's denominator
    compute_tflops: float  # the rate the model's FLOPs run at
    memory_gbs: float  # device memory bandwidth: the optimizer's element updates
    gpus_per_node: int
    intra_node: Link
    inter_node: Link
    note: str = ""
    # torch.cuda.get_device_name() of the devices this spec describes (MFU per step)
    cuda_names: tuple[str, ...] = ()
    # many small matmuls in one batched call (the sparse attention's torch path: one
    # [heads, D] x [D, K] product per query); 0: at compute_tflops
    batched_matmul_tflops: float = 0.0

    def link(self, inter: bool) -> Link:
        return self.inter_node if inter else self.intra_node

    @property
    def batched_rate(self) -> float:
        """FLOP/s of the sparse attention's per-query matmuls."""
        return (self.batched_matmul_tflops or self.compute_tflops) * 1e12


def load_cluster(name: str) -> ClusterSpec:
    """A spec by preset name (``configs/cluster/<name>.yaml``) or by path to a YAML file of
    the same keys. ValueError naming the presets when there is neither."""
    path = name if os.path.isfile(name) else os.path.join(CLUSTER_DIR, f"{name}.yaml")
    if not os.path.isfile(path):
        presets = sorted(f[:-5] for f in os.listdir(CLUSTER_DIR) if f.endswith(".yaml"))
        raise ValueError(f"cluster {name!r}: no such preset or file; presets: "
                         f"{', '.join(presets)} (configs/cluster/), or a path to a YAML spec")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    try:
        links = {key: Link(**raw.pop(key)) for key in ("intra_node", "inter_node")}
        return ClusterSpec(**{**raw, "cuda_names": tuple(raw.get("cuda_names", ()))}, **links)
    except TypeError as err:
        raise ValueError(f"cluster spec {path}: {err}; see configs/cluster/h100.yaml for the "
                         "keys") from None


# ------------------------------------------------------------------ where a group's ranks sit


def group_geometry(group: str, inp: MemoryInputs, pp: int) -> tuple[int, int]:
    """(size, stride in global ranks) of one of megatron-core's groups: decoder ranks in the
    order tp-cp-dp-pp, expert ranks etp-ep-edp-pp (``parallel.process_groups``)."""
    tp, cp, dp, etp, ep = inp.tp, inp.cp, inp.dp, inp.expert_tp, inp.ep
    geometry = {"tp": (tp, 1), "cp": (cp, tp), "world": (cp, tp), "dp_cp": (dp * cp, tp),
                "pp": (pp, tp * cp * dp), "expt_tp": (etp, 1), "ep": (ep, etp),
                "tp_ep": (etp * ep, 1), "expert_dp": (inp.expert_dp, etp * ep)}
    if group not in geometry:
        raise ValueError(f"step-time model: no placement for group {group!r}")
    return geometry[group]


def per_node(size: int, stride: int, gpus_per_node: int) -> int:
    """Members of a group (``size`` ranks ``stride`` apart, starting on a node boundary) that
    share a node."""
    if stride >= gpus_per_node:
        return 1
    return max(1, min(size, gpus_per_node // stride))


def collective_seconds(op: str, sent: float, size: int, stride: int,
                       cluster: ClusterSpec) -> float:
    """Seconds one rank takes to send ``sent`` bytes in collectives ``op`` over a group: the
    bytes split inside / across nodes as ``level_bytes`` splits them, each level at its rate,
    one after the other."""
    if size <= 1 or sent <= 0:
        return 0.0
    local = per_node(size, stride, cluster.gpus_per_node)
    split_as = "all_gather" if op in ("all_reduce", "reduce_scatter", "send") else op
    shares = level_bytes(split_as, size * (size - 1), size, local)
    whole = shares["intra"] + shares["inter"]
    inter = sent * shares["inter"] / whole
    return (cluster.intra_node.seconds(sent - inter, op=op)
            + cluster.inter_node.seconds(inter, op=op))


def comm_seconds(comm: Comm, inp: MemoryInputs, pp: int, cluster: ClusterSpec,
                 skip: frozenset[str] = frozenset()) -> dict[str, float]:
    """Seconds per kind (``GROUP_KINDS``) of a plan's bytes by "<op>:<group>"."""
    out: dict[str, float] = {}
    for key, sent in comm:
        op, group = key.split(":")
        kind = GROUP_KINDS[group]
        if kind in skip:
            continue
        size, stride = group_geometry(group, inp, pp)
        out[kind] = out.get(kind, 0.0) + collective_seconds(op, sent, size, stride, cluster)
    return out


def send_seconds(sent: int, sender: int, receiver: int, inp: MemoryInputs, pp: int,
                 cluster: ClusterSpec) -> float:
    """One pipeline message from pipeline rank ``sender`` to ``receiver`` (first replica)."""
    if not sent:
        return 0.0
    stride = group_geometry("pp", inp, pp)[1]
    nodes = {(rank * stride) // cluster.gpus_per_node for rank in (sender, receiver)}
    return cluster.link(len(nodes) > 1).seconds(sent, messages=1)


# -------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Overlaps:
    """Which communication the model hides behind compute (see the module doc)."""

    grad_reduce: bool = False
    param_gather: bool = False
    expert_all_to_all: bool = False

    @classmethod
    def of_job(cls, job: JobConfig) -> Overlaps:
        """What the job runs with (``parallel.overlap_grad_reduce``,
        ``parallel.overlap_param_gather``); the expert all-to-all's overlap is a what-if:
        this backend does not offer it."""
        return cls(grad_reduce=job.parallel.overlap_grad_reduce,
                   param_gather=job.parallel.overlap_param_gather)

    def label(self) -> str:
        on = [f.name for f in dataclasses.fields(self) if getattr(self, f.name)]
        return "+".join(on) if on else "none"


@dataclass(frozen=True)
class RankTime:
    """One pipeline rank's step, in seconds, by where it goes: the parts sum to the step."""

    rank: int
    compute: float
    comm: dict[str, float]  # exposed, by kind (COMM_KINDS)
    optimizer: float
    bubble: float  # waiting: pipeline fill and drain, and for slower ranks

    @property
    def total(self) -> float:
        return self.compute + sum(self.comm.values()) + self.optimizer + self.bubble


@dataclass(frozen=True)
class StepTime:
    cluster: ClusterSpec
    overlaps: Overlaps
    step_seconds: float
    ranks: tuple[RankTime, ...]
    gpus: int
    layout: PipelineLayout
    model_flops: float  # the whole job's per step (``model_flops_per_step``)
    # seconds the overlaps hid, by kind, summed over the pipeline ranks
    hidden: dict[str, float] = field(default_factory=dict)

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_seconds / self.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu / self.cluster.peak_tflops

    def busiest(self) -> RankTime:
        """The rank that waits least: the step's critical path runs through it."""
        return min(self.ranks, key=lambda r: r.bubble)


@dataclass(frozen=True)
class _StageTimes:
    forward: float
    backward: float
    compute: float  # forward + backward compute per micro-batch
    comm: dict[str, float]  # exposed per micro-batch, by kind


def predict_step_time(job: JobConfig, dp: int, cluster: ClusterSpec,
                      overlaps: Overlaps | None = None, **changes) -> StepTime:
    """The step time of ``job`` at data-parallel size ``dp`` on ``cluster``, per rank, under
    ``overlaps`` (default: the job's own). ``changes``: to ``inputs_from_job`` (e.g.
    fused_attention=True for a GPU plan)."""
    overlaps = overlaps or Overlaps.of_job(job)
    inputs = inputs_from_job(job, dp, **changes)
    layout = job_pipeline(job, dp, **changes)
    report = plan_report(job.model, layout, inputs, job.activations)
    plain = plan_report(job.model, layout, dataclasses.replace(inputs, recompute=Recompute()))
    pp, mb = layout.pp, inputs.num_microbatches
    stages = [_stage_times(job, inputs, layout, s, report.stages[s].costs,
                           plain.stages[s].costs, cluster, overlaps)
              for s in range(len(layout.stages))]
    schedule = PipelineSchedule(pp, layout.vpp, mb, inputs.microbatch_group)
    timed = replay_times(schedule, [s.forward for s in stages], backward_seconds=[
        s.backward for s in stages])
    ends, tails, hidden = {}, {}, {}
    owned = {rank: [s for s in range(len(layout.stages)) if layout.rank_of(s) == rank]
             for rank in range(pp)}
    for rank, mine in owned.items():
        ends[rank] = max(op.end for op in timed[rank])
        tails[rank] = _step_tail(job, inputs, layout, rank, mine, timed[rank], report, cluster,
                                 overlaps, hidden)
    pipeline_end = max(ends[r] + tails[r]["after_pipeline"] for r in range(pp))
    optimizer = max(tails[r]["optimizer"] for r in range(pp))
    gather = max(tails[r]["param_gather"] for r in range(pp))
    step = pipeline_end + optimizer + gather
    ranks = []
    for rank, mine in owned.items():
        comm = {kind: 0.0 for kind in COMM_KINDS}
        compute = 0.0
        for s in mine:
            compute += mb * stages[s].compute
            for kind, seconds in stages[s].comm.items():
                comm[kind] += mb * seconds
        comm["grad_reduction"] += tails[rank]["grad_reduction"]
        comm["tensor_parallel"] += tails[rank]["tp_step"]
        comm["param_gather"] += tails[rank]["param_gather"]
        busy = compute + sum(comm.values()) + tails[rank]["optimizer"]
        ranks.append(RankTime(rank, compute, comm, tails[rank]["optimizer"], step - busy))
    gpus = job.parallel.world_size_needed(dp)
    return StepTime(cluster, overlaps, step, tuple(ranks), gpus, layout,
                    model_flops_per_step(job, **changes), hidden)


def streamed_seconds(streamed: float, flops: float, cluster: ClusterSpec) -> float:
    """What the sparse attention's torch path takes beyond its FLOPs at the compute rate (they
    are in the stage's FLOPs): its ``streamed`` gather and scatter bytes at the memory rate,
    and its ``flops`` at the batched-matmul rate instead of the compute rate."""
    return (streamed / (cluster.memory_gbs * 1e9)
            + flops / cluster.batched_rate - flops / (cluster.compute_tflops * 1e12))


def _stage_times(job: JobConfig, inputs: MemoryInputs, layout: PipelineLayout, stage: int,
                 costs, plain, cluster: ClusterSpec, overlaps: Overlaps) -> _StageTimes:
    """One micro-batch's forward and backward on ``stage``: compute at the cluster's rate
    (the forward a third of the model's FLOPs, the backward the rest, recompute included)
    plus the exposed collectives (the forward sends half of what a step without recompute
    sends, the backward the rest) and the pipeline message each one sends."""
    pp, rate, memory = layout.pp, cluster.compute_tflops * 1e12, cluster.memory_gbs * 1e9
    forward_compute = (plain.flops_per_microbatch / 3 / rate
                       + streamed_seconds(plain.streamed_forward_bytes_per_microbatch,
                                          plain.streamed_flops_per_microbatch / 3, cluster)
                       + plain.elementwise_forward_bytes_per_microbatch / memory)
    compute = (costs.flops_per_microbatch / rate
               + streamed_seconds(costs.streamed_bytes_per_microbatch,
                                  costs.streamed_flops_per_microbatch, cluster)
               + costs.elementwise_bytes_per_microbatch / memory)
    total = comm_seconds(costs.comm_bytes_per_microbatch, inputs, pp, cluster)
    once = comm_seconds(plain.comm_bytes_per_microbatch, inputs, pp, cluster)
    in_forward = {kind: once.get(kind, 0.0) / 2 / seconds for kind, seconds in total.items()
                  if seconds}
    if overlaps.expert_all_to_all and "expert_all_to_all" in total:
        # behind the compute of another micro-batch, as far as that compute lasts
        total["expert_all_to_all"] = max(0.0, total["expert_all_to_all"] - compute)
    forward_comm = sum(in_forward[kind] * seconds for kind, seconds in total.items() if seconds)
    to_next, to_previous = stage_sends(job, inputs, layout, stage)
    rank = layout.rank_of(stage)
    ahead = send_seconds(to_next, rank, (rank + 1) % pp, inputs, pp, cluster) if pp > 1 else 0
    back = send_seconds(to_previous, rank, (rank - 1) % pp, inputs, pp, cluster) if pp > 1 else 0
    comm = dict(total)
    comm["pipeline"] = ahead + back
    return _StageTimes(forward_compute + forward_comm + ahead,
                       compute - forward_compute + sum(total.values()) - forward_comm + back,
                       compute, comm)


def _step_tail(job: JobConfig, inputs: MemoryInputs, layout: PipelineLayout, rank: int,
               mine: list[int], ops, report, cluster: ClusterSpec, overlaps: Overlaps,
               hidden: dict[str, float]) -> dict[str, float]:
    """The per-step parts of one rank: exposed gradient reduction, the TP all-reduce of
    replicated gradients (and Muon's gathers), the optimizer, the exposed parameter gather."""
    pp = layout.pp
    costs = [report.stages[s].costs for s in mine]
    dense = [c.dense_params for c in costs]
    expert = [c.expert_params for c in costs]
    reduce_chunks = [_dp_seconds(inputs, pp, cluster, d, e, inputs.grad_bytes,
                                 "reduce_scatter" if inputs.distributed_optimizer else "all_reduce")
                     for d, e in zip(dense, expert)]
    gathers = gathers_per_bucket(job, overlaps.param_gather)
    gather_chunks = [gathers * _dp_seconds(inputs, pp, cluster, d, e, inputs.weight_bytes,
                                           "all_gather")
                     if inputs.distributed_optimizer else 0.0 for d, e in zip(dense, expert)]
    bucket = bucket_elements(job, inputs)
    buckets = [max(1, math.ceil((d + e) / bucket)) for d, e in zip(dense, expert)]
    if job.parallel.pipeline_zero2:
        # Each flush reduce-scatters asynchronously behind the next micro-batches; the last
        # one waits at the step's end.
        groups = inputs.num_microbatches // (inputs.microbatch_group or pp)
        exposed_reduce = sum(reduce_chunks) / max(1, groups if len(mine) > 1 else 1)
    elif overlaps.grad_reduce:
        exposed_reduce = _overlapped_reduction(ops, reduce_chunks, buckets)
    else:
        exposed_reduce = sum(reduce_chunks)
    hidden["grad_reduction"] = (hidden.get("grad_reduction", 0.0) + sum(reduce_chunks)
                                - exposed_reduce)
    tp_step = comm_seconds(tensor_parallel_step_comm(job, inputs, layout, rank), inputs, pp,
                           cluster).get("tensor_parallel", 0.0)
    exposed_gather = (_overlapped_gather(ops, gather_chunks, buckets) if overlaps.param_gather
                      else sum(gather_chunks))
    hidden["param_gather"] = hidden.get("param_gather", 0.0) + sum(gather_chunks) - exposed_gather
    return {"grad_reduction": exposed_reduce, "tp_step": tp_step,
            "after_pipeline": exposed_reduce + tp_step,
            "optimizer": optimizer_seconds(job.model, inputs, layout, rank, cluster),
            "param_gather": exposed_gather}


def _dp_seconds(inputs: MemoryInputs, pp: int, cluster: ClusterSpec, dense: int, expert: int,
                value_bytes: int, op: str) -> float:
    """One chunk's dense parameters over the dense data-parallel group (DP x CP) and its expert
    parameters over the expert data-parallel group: a ring's bytes per rank, at the links' rates."""
    seconds = 0.0
    for group, count in (("dp_cp", dense), ("expert_dp", expert)):
        size, stride = group_geometry(group, inputs, pp)
        factor = 2 if op == "all_reduce" else 1
        sent = factor * (size - 1) * value_bytes * count / size
        seconds += collective_seconds(op, sent, size, stride, cluster)
    return seconds


def bucket_elements(job: JobConfig, inputs: MemoryInputs) -> int:
    """Parameters per DDP bucket: ``parallel.ddp_bucket_size``, else megatron-core's default,
    max(40M, 1M x the data-parallel group)."""
    return job.parallel.ddp_bucket_size or max(DDP_BUCKET_ELEMENTS,
                                               1_000_000 * inputs.dp * inputs.cp)


def _overlapped_reduction(ops, chunk_seconds: list[float], buckets: list[int]) -> float:
    """megatron-core's overlapped reduction on one rank: each chunk's ``buckets`` go out
    during its last backward (one channel, in turn); the last bucket of each can leave only
    when the backward ends. Returns the seconds past the rank's last op."""
    end = max(op.end for op in ops)
    last_backward = {}
    for op in ops:
        if op.op == "B":
            last_backward[op.chunk] = op
    channel = 0.0
    for chunk in sorted(last_backward, key=lambda c: last_backward[c].start):
        op, seconds = last_backward[chunk], chunk_seconds[chunk]
        channel = max(max(channel, op.start) + seconds, op.end + seconds / buckets[chunk])
    return max(0.0, channel - end)


def _overlapped_gather(ops, chunk_seconds: list[float], buckets: list[int]) -> float:
    """megatron-core's overlapped parameter gather on one rank: each chunk's first forward
    waits for its first bucket, and the other buckets arrive while its modules run (one
    channel, the chunks in the order their first forwards start, from the step's start). The
    step is late by the most a first forward waits, at its start or for its later buckets
    past its end."""
    first = {}
    for op in ops:
        if op.op == "F" and op.chunk not in first:
            first[op.chunk] = op
    channel, late = 0.0, 0.0
    for chunk in sorted(first, key=lambda c: first[c].start):
        op, seconds = first[chunk], chunk_seconds[chunk]
        head = seconds / buckets[chunk]
        channel += head
        late = max(late, channel - op.start)
        channel = max(channel, op.start) + seconds - head
        late = max(late, channel - op.end)
    return late


# ----------------------------------------------------------------------------- optimizer


def optimizer_seconds(cfg: GLM5Config, inputs: MemoryInputs, layout: PipelineLayout, rank: int,
                      cluster: ClusterSpec) -> float:
    """One optimizer step on one rank: the elements it updates at HBM speed, and under Muon
    the Newton-Schulz iterations of the matrices it owns at the compute rate. AdamW on a CPU
    plan is torch's, one operator per update term (``TORCH_ADAMW_STEP_BYTES``)."""
    matrices, others, flops = _rank_parameters(cfg, inputs, layout, rank)
    adamw = TORCH_ADAMW_STEP_BYTES if runs_unfused(inputs) else ADAMW_STEP_BYTES
    if inputs.muon is None:
        moved = adamw * (matrices + others)
    else:  # Muon's own update on CPUs is not counted: its fused-kernel bytes
        moved = MUON_STEP_BYTES * matrices + adamw * others
    on_device = 1.0 - inputs.optimizer_offload_fraction  # host state steps on the host
    return (moved * on_device / (cluster.memory_gbs * 1e9)
            + (flops / (cluster.compute_tflops * 1e12) if inputs.muon else 0.0))


def _rank_parameters(cfg: GLM5Config, inputs: MemoryInputs, layout: PipelineLayout,
                     rank: int) -> tuple[float, float, float]:
    """(Muon matrix elements, other elements, Newton-Schulz FLOPs) one rank steps: its
    stages' decoder layers and MTP layers; the distributed optimizer's share of them
    (1 / (DP x CP) dense, 1 / expert-DP experts). Embedding and head are AdamW elements."""
    dense_ranks = inputs.dp * inputs.cp if inputs.distributed_optimizer else 1
    expert_ranks = inputs.expert_dp if inputs.distributed_optimizer else 1
    layer, terms = 0, []
    for stage, kinds in enumerate(layout.stages):
        for kind in kinds:
            mine = layout.rank_of(stage) == rank
            if kind == "t":
                if mine:
                    terms += layer_terms(cfg, layer >= cfg.first_k_dense_replace)
                layer += 1
            elif kind == "m" and mine:
                terms += mtp_layer_terms(cfg)
            elif kind in "EL" and mine:
                terms += [Term("embedding", "", ((cfg.vocab_size, cfg.hidden_size),))]
    matrices = others = flops = 0.0
    for term in terms:
        experts = term.key == "routed_experts"
        ranks = expert_ranks if experts else dense_ranks
        split = (inputs.ep * inputs.expert_tp if experts  # vocabulary-parallel: embedding, head
                 else inputs.tp if term.key in TP_SPLIT or term.key == "embedding" else 1)
        for shape in term.shapes:
            elements = term.repeat * math.prod(shape) / split / ranks
            if len(shape) == 2 and term.key not in ADAMW_MATRICES:
                matrices += elements
                # Newton-Schulz runs on the whole matrix (TP pieces gathered), by its owner.
                copies = term.repeat / (inputs.ep * inputs.expert_tp if experts else 1)
                flops += copies * newton_schulz_flops(*shape) / ranks
            else:
                others += elements
    return matrices, others, flops


def newton_schulz_flops(rows: int, cols: int) -> float:
    """Muon's orthogonalisation of one [rows, cols] matrix: each iteration forms X X^T
    (2 m^2 n), its square (2 m^3) and the update times X (2 m^2 n), m the smaller side."""
    m, n = min(rows, cols), max(rows, cols)
    return NEWTON_SCHULZ_ITERATIONS * (4 * m * m * n + 2 * m ** 3)


# ------------------------------------------------------------------- per-step throughput


def model_flops_per_step(job: JobConfig, **changes) -> float:
    """The job's model FLOPs per global batch (forward + backward, no recompute), as the
    planner counts them for the whole model on one device: the same for every layout of the
    job (work a layout repeats, such as the DSA indexer on every TP rank, is not model work).
    Every sequence counts as ``train.seq_length`` tokens (packed data and flexible CP bins
    fill it)."""
    whole = inputs_from_job(job, 1, **{**changes, "tp": 1, "cp": 1, "ep": 1, "etp": None,
                                       "sequence_parallel": False, "recompute": Recompute()})
    sets = mtp_sets(job.model)
    layout = layout_from_counts([job.model.num_hidden_layers], 1, None, 0 if sets else None,
                                sets)
    (stage,) = plan_report(job.model, layout, whole).stages
    sequences = job.train.global_batch_size // job.train.micro_batch_size
    return float(stage.costs.flops_per_microbatch * sequences)


def device_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its exact CUDA name (``torch.cuda.get_device_name``),
    from the cluster preset listing it in ``cuda_names`` (H100 SXM, H200 SXM); None for any
    other (an H100 PCIe or NVL has a lower peak: no MFU rather than a wrong one)."""
    for file in sorted(os.listdir(CLUSTER_DIR)):
        if file.endswith(".yaml"):
            spec = load_cluster(file[:-5])
            if device_name in spec.cuda_names:
                return spec.peak_tflops
    return None


# ------------------------------------------------------------------------------ report


def breakdown_lines(result: StepTime) -> list[str]:
    """Per pipeline rank: compute, exposed communication by kind, optimizer, bubble (seconds
    and share of the step), then the step, TFLOP/s per GPU and MFU."""
    names = {"tensor_parallel": "TP", "context_parallel": "CP", "expert_all_to_all": "EP a2a",
             "pipeline": "PP send", "grad_reduction": "DP grads", "param_gather": "DP params"}
    head = (f"{'rank':>4} {'compute':>9} " + " ".join(f"{names[k]:>9}" for k in COMM_KINDS)
            + f" {'optimizer':>9} {'bubble':>9}")
    rows = [head, "-" * len(head)]
    for r in result.ranks:
        rows.append(f"{r.rank:>4} {r.compute:>9.2f} "
                    + " ".join(f"{r.comm[k]:>9.2f}" for k in COMM_KINDS)
                    + f" {r.optimizer:>9.2f} {r.bubble:>9.2f}")
    busiest = result.busiest()
    shares = ", ".join(f"{name} {seconds / result.step_seconds:.0%}" for name, seconds in [
        ("compute", busiest.compute), *((names[k], busiest.comm[k]) for k in COMM_KINDS),
        ("optimizer", busiest.optimizer), ("bubble", busiest.bubble)] if seconds > 0)
    rows += ["", f"busiest rank {busiest.rank}: {shares}",
             (f"predicted step {result.step_seconds:.2f} s on {result.gpus} x "
              f"{result.cluster.device}, {result.tflops_per_gpu:.1f} TFLOP/s per GPU, "
              f"MFU {result.mfu:.1%} (overlap: {result.overlaps.label()})")]
    return rows


# ----------------------------------------------------------------------------------------------
# A measured step beside the prediction, by the same parts.
# ----------------------------------------------------------------------------------------------

# metrics.jsonl's collective purposes (parallel/comm_purpose.py) -> the model's kinds: by family,
# then by name (the pipeline's messages only, not the pp group's token count or embedding sum)
KIND_OF_FAMILY = {"tp": "tensor_parallel", "cp": "context_parallel", "ep": "expert_all_to_all"}
KIND_OF_PURPOSE = {"dp_grad_reduce_scatter": "grad_reduction",
                   "dp_grad_all_reduce": "grad_reduction", "dp_param_all_gather": "param_gather",
                   "pp_send": "pipeline", "pp_recv": "pipeline", "pp_send_recv": "pipeline"}
SPLIT_PARTS = (*COMM_KINDS, "other", "rest")  # other: collectives the model does not price
SPLIT_NAMES = {"tensor_parallel": "tp", "context_parallel": "cp", "expert_all_to_all": "ep",
               "pipeline": "pp+wait", "grad_reduction": "grad", "param_gather": "gather",
               "other": "other", "rest": "rest"}


def measured_split(record: dict) -> dict[str, float]:
    """One logged step's busiest rank, ms by ``SPLIT_PARTS``, from metrics.jsonl's
    ``comm_by_purpose`` (the time each collective held the rank) and ``step_time_ms``. The
    busiest rank is the one its collectives held least (every rank's step ends together, at
    the loss's all-reduce), as the model's is the one that waits least. ``rest``: compute, the
    optimizer and whatever no collective holds."""
    times, purposes = record["step_time_ms"], record["comm_by_purpose"].values()
    rank = min(range(len(times)), key=lambda r: sum(p["ms"][r] for p in purposes))
    split = dict.fromkeys(SPLIT_PARTS, 0.0)
    for purpose, parts in record["comm_by_purpose"].items():
        kind = KIND_OF_PURPOSE.get(purpose) or KIND_OF_FAMILY.get(purpose.split("_")[0], "other")
        split[kind] += parts["ms"][rank]
    split["rest"] = times[rank] - sum(split.values())
    return split


def predicted_split(step: StepTime) -> dict[str, float]:
    """The model's busiest rank (least bubble) in ``measured_split``'s parts, ms: the
    pipeline's waits are its bubble, so under pipeline parallelism the bubble joins its sends;
    without a pipeline any bubble (waiting for slower ranks) joins ``rest``."""
    rank = step.busiest()
    split = {kind: 1000 * rank.comm.get(kind, 0.0) for kind in COMM_KINDS}
    split["other"] = 0.0
    bubble = 1000 * rank.bubble
    if step.layout.pp > 1:
        split["pipeline"] += bubble
        bubble = 0.0
    split["rest"] = 1000 * (rank.compute + rank.optimizer) + bubble
    return split


def split_text(measured: dict[str, float], predicted: dict[str, float]) -> str:
    """``<part> <measured>/<predicted>`` ms, for the parts either side has."""
    return ", ".join(f"{SPLIT_NAMES[k]} {measured[k]:.0f}/{predicted[k]:.3g}"
                     for k in SPLIT_PARTS if measured[k] >= 0.5 or predicted[k] >= 0.05)
