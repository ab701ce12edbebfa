"""Pipeline layouts: megatron-core's layout strings checked rule by rule, the interleaved 1F1B
order replayed per rank, and a balancer of layers over stages for any stage-cost model.

A layout is megatron-core's string (``E`` embedding, ``t`` decoder layer, ``m`` MTP layer, ``L``
loss/output head, ``|`` between stages); global stage s runs on pipeline rank s % PP as virtual
chunk s // PP. Two MTP placements are named: ``with_loss`` (megatron-core's: ``m`` with ``L`` on
the last stage, ``Et|tt|tt|tmL``) and ``split`` (GLM-5's: ``m`` on the stage before, the last
stage holds only ``L``, ``Ett|tt|tm|L``).

What a stage costs (bytes of parameters, gradients, optimizer state, activations per micro-batch,
FLOPs) is the model's business: the balancer and the report take a ``StageCostModel``. Each
rank's memory is its stages' static bytes plus the peak of the activations in flight, from a
replay of megatron-core's (interleaved) 1F1B order.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from operator import mul
from typing import Protocol

from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from parallel.layout_error import LayoutError
from parallel.pipeline_zero2 import accumulation_buffers

LAYOUT_FIELD = "parallel.pipeline_model_parallel_layout"


# ---------------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class PipelineLayout:
    """Stages of 'E', 't', 'm', 'L'; stage s on pipeline rank s % pp, virtual stage s // pp."""

    stages: tuple[tuple[str, ...], ...]
    pp: int
    vpp: int | None = None

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    @property
    def mtp_stage(self) -> int | None:
        return next((i for i, stage in enumerate(self.stages) if "m" in stage), None)

    @property
    def placement(self) -> str:
        last, m = len(self.stages) - 1, self.mtp_stage
        return {None: "none", last: "with_loss", last - 1: "split"}.get(m, "custom")

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(stage.count("t") for stage in self.stages)

    def to_string(self) -> str:
        return "|".join("".join(stage) for stage in self.stages)


def parse_layout(layout: str, pp: int, vpp: int | None, num_layers: int,
                 mtp_sets: int) -> PipelineLayout:
    """Parse and check a layout string against every megatron-core rule; raise LayoutError."""
    def fail(rule: str) -> LayoutError:
        return LayoutError(f"{LAYOUT_FIELD}={layout!r} {rule}")

    chars = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    try:
        parsed = PipelineParallelLayerLayout.parse_str_to_list(layout)
    except AssertionError as err:
        raise fail(f"has an unknown character ({err}): use only E, t, m, L, '|' and the "
                   "repeats '(...)*n' / 'x*n'") from None
    result = PipelineLayout(tuple(tuple(chars[k.name] for k in stage) for stage in parsed),
                            pp, vpp)
    _check_shape(result, fail, num_layers)
    _check_mtp(result, fail, mtp_sets)
    return result


def _check_shape(lay: PipelineLayout, fail, num_layers: int) -> None:
    """Stage count, one 'E' opening stage 0, one 'L' closing the last stage, one 't' a layer."""
    want, flat = lay.pp * (lay.vpp or 1), [c for stage in lay.stages for c in stage]
    first, last = "".join(lay.stages[0]), "".join(lay.stages[-1])
    if len(lay.stages) != want:
        raise fail(f"has {len(lay.stages)} stages but pipeline x virtual stages = {lay.pp} x "
                   f"{lay.vpp or 1} = {want}: give {want} '|'-separated stages or change "
                   "parallel.pipeline_model_parallel_size / virtual_pipeline_model_parallel_size")
    if flat.count("E") != 1 or not first.startswith("E"):
        raise fail(f"has {flat.count('E')} 'E' and stage 0 is {first!r}: the embedding 'E' "
                   "must appear exactly once, first in stage 0")
    if flat.count("L") != 1 or not last.endswith("L"):
        raise fail(f"has {flat.count('L')} 'L' and the last stage is {last!r}: the loss 'L' "
                   "must appear exactly once, last in the last stage")
    if flat.count("t") != num_layers:
        raise fail(f"has {flat.count('t')} 't' but model.num_hidden_layers={num_layers}: write "
                   f"one 't' per decoder layer ({num_layers - flat.count('t'):+d})")


def _check_mtp(lay: PipelineLayout, fail, mtp_sets: int) -> None:
    flat = [c for stage in lay.stages for c in stage]
    holders = [i for i, stage in enumerate(lay.stages) if "m" in stage]
    if flat.count("m") != mtp_sets:
        raise fail(f"has {flat.count('m')} 'm' but the model trains {mtp_sets} MTP layer(s) "
                   "(model.num_nextn_predict_layers; 0 when model.mtp_num_steps=0): write "
                   f"{mtp_sets} 'm'")
    if len(holders) > 1:
        raise fail(f"spreads 'm' over stages {holders}: all MTP layers go in one stage")
    if holders and "t" in flat[flat.index("m"):]:
        raise fail("has a 't' after an 'm': every decoder layer must come before the MTP layer")
    if holders and holders[0] // lay.pp != (lay.vpp or 1) - 1:
        m = holders[0]
        raise fail(f"puts 'm' in stage {m}, virtual stage {m // lay.pp} of pipeline rank "
                   f"{m % lay.pp}: megatron-core needs it in its rank's last virtual stage "
                   f"({(lay.vpp or 1) - 1}), i.e. one of the last {lay.pp} stages")




# ----------------------------------------------------------------------------- stage costs

# Bytes a rank sends, by "<op>:<group>" (op as parallel.comm_meter names it, group a name the
# cost model chooses, e.g. "all_gather:cp"): sorted pairs, no zero entries, so that equal
# traffic compares equal and costs stay hashable.
Comm = tuple[tuple[str, int], ...]


def comm_sum(*parts: Comm) -> Comm:
    total: dict[str, int] = {}
    for comm in parts:
        for key, sent in comm:
            total[key] = total.get(key, 0) + sent
    return tuple(sorted((key, sent) for key, sent in total.items() if sent))


def comm_times(comm: Comm, k: int) -> Comm:
    return comm_sum(tuple((key, k * sent) for key, sent in comm))


def comm_of(comm: Comm, key: str) -> int:
    return dict(comm).get(key, 0)


@dataclass(frozen=True)
class StageCosts:
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes_per_microbatch: int
    flops_per_microbatch: int
    # Pipeline ZeRO2: this stage's gradients that go through its accumulation buffers
    accum_grad_bytes: int = 0
    # Held only while one forward of this stage runs, on top of the micro-batches in flight
    # before it (e.g. a graph that forward builds and runs its backward on at once).
    transient_activation_bytes: int = 0
    comm_bytes_per_microbatch: Comm = ()  # what the cost model counts of the stage's traffic
    # Parameters this stage holds per rank, replicated over the data-parallel group (dense) and
    # over the expert-data-parallel group (experts): what each group's gradient reduction moves.
    dense_params: int = 0
    expert_params: int = 0
    host_bytes: int = 0  # held in host memory (e.g. optimizer state there): not on the device
    # Device buffers held for the whole run besides parameters, gradients and optimizer state
    # (e.g. quantised copies of weights).
    buffer_bytes: int = 0
    # Kernels bound by memory rather than by their FLOPs, per micro-batch: the bytes they move
    # (of which the forward's), and their FLOPs (counted in flops_per_microbatch too).
    streamed_bytes_per_microbatch: int = 0
    streamed_forward_bytes_per_microbatch: int = 0
    streamed_flops_per_microbatch: int = 0
    # Element-wise operators' bytes per micro-batch (no FLOPs), of which the forward's: the
    # step-time model prices them at the memory rate.
    elementwise_bytes_per_microbatch: int = 0
    elementwise_forward_bytes_per_microbatch: int = 0

    @cached_property  # read in the balancer's inner loop
    def static_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes


def zero2_accum_bytes(mine: list[StageCosts]) -> int:
    """Pipeline ZeRO2's accumulation buffers on a rank holding the stages ``mine``: two as
    large as its largest stage (one for a single stage), parallel.pipeline_zero2."""
    return accumulation_buffers(len(mine)) * max(c.accum_grad_bytes for c in mine)


class StageCostModel(Protocol):
    """Per-stage costs of a layout shape (stage count, MTP stage) for any layer counts."""

    last: int  # index of the last stage
    dense_prefix: int  # decoder layers before the first whose cost differs (e.g. dense MLPs)

    def final_norm_stage(self, counts: list[int]) -> int: ...

    def dense_layers(self, start: int, count: int) -> int: ...

    def stage(self, stage: int, dense: int, count: int, final_norm: bool) -> StageCosts: ...

    def costs(self, counts: list[int]) -> list[StageCosts]: ...


# ------------------------------------------------------------------- 1F1B activation peak


class PipelineSchedule:
    """megatron-core's 1F1B order per pipeline rank: interleaved whenever ``vpp`` is set
    (pipeline_parallel.schedules), plain 1F1B otherwise. Tracks which chunks' micro-batches
    are forwarded and not yet backwarded, i.e. hold their activations."""

    def __init__(self, pp: int, vpp: int | None, num_microbatches: int,
                 group: int | None = None) -> None:
        self.pp, self.vpp, self.num_microbatches = pp, vpp, num_microbatches
        self.group = group or pp  # megatron-core's microbatch_group_size_per_vp_stage
        self.chunks = vpp or 1
        self._vectors: dict[int, list[tuple[int, ...]]] = {}

    def chunk_table(self) -> list[int]:
        """Model chunk of each forward in order: groups of ``group`` (default PP) micro-batches
        run chunk by chunk (the last group takes the remainder), as megatron-core's
        get_schedule_table."""
        table, n, group = [], self.num_microbatches, self.group
        for first in range(0, n, group):
            size = n - first if first + group >= n else group
            table += [chunk for chunk in range(self.chunks) for _ in range(size)]
        return table

    def warmup(self, rank: int) -> int:
        total = self.num_microbatches * self.chunks
        if self.pp == 1:
            return 0
        if self.vpp is None:
            return min(self.pp - rank - 1, total)
        return min((self.pp - rank - 1) * 2 + (self.chunks - 1) * self.group, total)

    def order(self, rank: int) -> list[tuple[str, int]]:
        """('F' | 'B', chunk) in execution order: warm-up forwards, 1F1B, cool-down."""
        table, warm = self.chunk_table(), self.warmup(rank)
        backward = [("B", self.chunks - 1 - chunk) for chunk in table]
        ops = [("F", chunk) for chunk in table[:warm]]
        for k in range(len(table) - warm):
            ops += [("F", table[warm + k]), backward[k]]
        return ops + backward[len(table) - warm:]

    def in_flight_vectors(self, rank: int) -> list[tuple[int, ...]]:
        """Micro-batches in flight per chunk after each forward. The peak of a weighted sum
        (non-negative weights) is reached at a vector that no other vector dominates and that
        is not the midpoint of two others (an extreme point): only those are kept."""
        if rank not in self._vectors:
            live, seen = [0] * self.chunks, set()
            for op, chunk in self.order(rank):
                live[chunk] += 1 if op == "F" else -1
                if op == "F":
                    seen.add(tuple(live))
            extreme = [v for v in seen if not any(
                tuple(2 * x - y for x, y in zip(v, u)) in seen for u in seen if u != v)]
            self._vectors[rank] = sorted(v for v in extreme if not any(
                w != v and all(x <= y for x, y in zip(v, w)) for w in extreme))
        return self._vectors[rank]

    def peak_activation_bytes(self, rank: int, chunk_bytes: list[int]) -> int:
        return max(sum(n * b for n, b in zip(v, chunk_bytes))
                   for v in self.in_flight_vectors(rank))

    def peak_in_flight(self, rank: int) -> int:
        return self.peak_activation_bytes(rank, [1] * self.chunks)

    def rank_bytes(self, rank: int, costs: list[StageCosts]) -> tuple[int, int]:
        """(static, peak activation) bytes of ``rank`` given every stage's costs. Pipeline
        ZeRO2's accumulation buffers are per rank: each as large as its largest stage."""
        mine = costs[rank::self.pp]
        accum = zero2_accum_bytes(mine)
        peak = self.peak_activation_bytes(rank, [c.activation_bytes_per_microbatch for c in mine])
        if any(c.transient_activation_bytes for c in mine):
            peak = max(peak, self.peak_during_forwards(rank, mine))
        return sum(c.static_bytes for c in mine) + accum, peak

    def peak_during_forwards(self, rank: int, mine: list[StageCosts]) -> int:
        """The most bytes held while a forward runs: the micro-batches in flight before it
        plus that stage's transient bytes (each op of the schedule, in order)."""
        live, peak = [0] * self.chunks, 0
        held = [c.activation_bytes_per_microbatch for c in mine]
        for op, chunk in self.order(rank):
            if op == "F":
                before = sum(n * b for n, b in zip(live, held))
                peak = max(peak, before + mine[chunk].transient_activation_bytes)
            live[chunk] += 1 if op == "F" else -1
        return peak

    def ops(self, rank: int) -> list[tuple[str, int, int]]:
        """('F' | 'B', chunk, micro-batch) in execution order. Each chunk forwards its
        micro-batches in order and megatron-core backwards them first in, first out."""
        done = {"F": [0] * self.chunks, "B": [0] * self.chunks}
        ops = []
        for op, chunk in self.order(rank):
            ops.append((op, chunk, done[op][chunk]))
            done[op][chunk] += 1
        return ops


# ------------------------------------------------------------------ activation offloading


@dataclass(frozen=True)
class OffloadPlan:
    """Which forward passes of one rank move their layers' saved tensors to host memory, and
    when each comes back (``parallel.activation_offload`` runs it; the planner models it).

    A forward (chunk, micro-batch) is a candidate when its backward is not the rank's next op
    (otherwise it would come straight back: one process, or the last pipeline rank without
    interleaving, never offloads); the rank's first ``micro_batches`` forwards in schedule
    order offload if they are candidates (the warm-up's forwards at least: the GLM-5 report
    offloads during the pipeline warm-up). An offloaded
    micro-batch starts coming back, its last offloaded layer first, when the op just before its
    backward starts (``reload_at``); during its backward, layer L's backward starts layer L-1's
    reload."""

    ops: tuple[tuple[str, int, int], ...]
    offloaded: frozenset[tuple[int, int]]
    reload_at: dict[tuple[str, int, int], tuple[int, int]]  # op -> micro-batch it reloads


def offload_plan(schedule: PipelineSchedule, rank: int, micro_batches: int) -> OffloadPlan:
    ops = schedule.ops(rank)
    offloaded, reload_at, forwards = set(), {}, 0
    for i, (op, chunk, micro) in enumerate(ops):
        if op != "F":
            continue
        forwards += 1
        if forwards <= micro_batches and ops[i + 1] != ("B", chunk, micro):
            offloaded.add((chunk, micro))
            before = ops[ops.index(("B", chunk, micro)) - 1]
            reload_at[before] = (chunk, micro)
    return OffloadPlan(tuple(ops), frozenset(offloaded), reload_at)


@dataclass(frozen=True)
class ChunkActivations:
    """Saved bytes of one micro-batch on one chunk, and the part its offloaded layers hold."""

    total: int
    offloadable: int = 0  # leaves the device when the micro-batch offloads
    top_unit: int = 0  # the last offloaded layer: back by the end of the op before backward
    largest_unit: int = 0  # resident while it computes, before it moves out


def offload_peak(plan: OffloadPlan, chunks: list[ChunkActivations]) -> tuple[int, int]:
    """(peak resident saved bytes, bytes offloaded per step) of one rank, replaying ``plan``.
    Candidates for the peak: the end of each forward (an offloaded one's largest layer while
    it computes, on top of its resident part) and the start of each backward (an offloaded
    micro-batch's next layer reloads while its top layer is consumed)."""
    resident: dict[tuple[int, int], int] = {}
    peak = moved = 0
    for op, chunk, micro in plan.ops:
        cost, key = chunks[chunk], (chunk, micro)
        if (op, chunk, micro) in plan.reload_at:
            back = plan.reload_at[(op, chunk, micro)]
            c = chunks[back[0]]
            resident[back] = c.total - c.offloadable + c.top_unit
        others = sum(resident.values())
        if op == "F" and key in plan.offloaded and cost.offloadable:
            kept = cost.total - cost.offloadable
            peak = max(peak, others + kept + cost.largest_unit, others + kept)
            resident[key] = kept
            moved += cost.offloadable
        elif op == "F":
            resident[key] = cost.total
            peak = max(peak, others + cost.total)
        else:
            mine = resident.pop(key)
            second = cost.largest_unit if cost.offloadable > cost.top_unit else 0
            if key in plan.offloaded:
                peak = max(peak, others - mine + min(cost.total, mine + second))
    return peak, moved


# ------------------------------------------------------------------------ report, balance


@dataclass(frozen=True)
class StageReport:
    stage: int
    rank: int
    layers: str
    costs: StageCosts


@dataclass(frozen=True)
class RankReport:
    rank: int
    static_bytes: int
    peak_activation_bytes: int  # saved bytes resident on the device at the peak
    offloaded_bytes: int = 0  # moved to host (and back) per step by activation offloading
    comm_bytes: Comm = ()  # sent per step: its stages' traffic x micro-batches

    @property
    def comm_total(self) -> int:
        return sum(sent for _, sent in self.comm_bytes)

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + self.peak_activation_bytes


@dataclass(frozen=True)
class PlanReport:
    layout: PipelineLayout
    stages: tuple[StageReport, ...]
    ranks: tuple[RankReport, ...]

    @property
    def max_rank_bytes(self) -> int:
        return max(r.total_bytes for r in self.ranks)

    @property
    def min_rank_bytes(self) -> int:
        return min(r.total_bytes for r in self.ranks)

    def summary_line(self) -> str:
        return (f"placement={self.layout.placement} layout={self.layout.to_string()} "
                f"max_rank_bytes={self.max_rank_bytes} min_rank_bytes={self.min_rank_bytes} "
                f"spread_bytes={self.max_rank_bytes - self.min_rank_bytes}")


@dataclass(frozen=True)
class OffloadSpec:
    """Activation offloading for the planner: ``micro_batches`` as ``offload_plan`` takes it,
    and ``units(stage)``: the saved bytes per micro-batch of each offloaded layer call of a
    stage, in forward order (an MTP layer applied k times is k calls)."""

    micro_batches: int
    units: object  # Callable[[int], list[int]]


def plan_for(model: StageCostModel, layout: PipelineLayout, schedule: PipelineSchedule,
             offload: OffloadSpec | None = None) -> PlanReport:
    """Per-stage costs and per-rank memory (static + peak in-flight activations; with
    ``offload``, the peak of what stays on the device and the bytes moved per step)."""
    costs = model.costs(list(layout.layers_per_stage))
    stages = tuple(StageReport(s, layout.rank_of(s), "".join(layout.stages[s]), c)
                   for s, c in enumerate(costs))
    ranks = tuple(RankReport(r, *schedule.rank_bytes(r, costs), comm_bytes=_rank_comm(
        costs[r::layout.pp], schedule.num_microbatches)) for r in range(layout.pp))
    if offload is not None and offload.micro_batches:
        ranks = tuple(_with_offload(rank, schedule, costs, offload) for rank in ranks)
    return PlanReport(layout, stages, ranks)


def _rank_comm(mine: list[StageCosts], num_microbatches: int) -> Comm:
    """Bytes one rank sends per step: every micro-batch passes through each of its stages."""
    return comm_times(comm_sum(*(c.comm_bytes_per_microbatch for c in mine)), num_microbatches)


def _with_offload(rank: RankReport, schedule: PipelineSchedule, costs: list[StageCosts],
                  offload: OffloadSpec) -> RankReport:
    stages = range(rank.rank, len(costs), schedule.pp)
    if not any(offload.units(stage) for stage in stages):  # nothing to move: the plain plan
        return rank
    chunks = []
    for stage in stages:
        units = list(offload.units(stage))
        chunks.append(ChunkActivations(costs[stage].activation_bytes_per_microbatch, sum(units),
                                       units[-1] if units else 0, max(units, default=0)))
    plan = offload_plan(schedule, rank.rank, offload.micro_batches)
    peak, moved = offload_peak(plan, chunks)
    return RankReport(rank.rank, rank.static_bytes, peak, moved, rank.comm_bytes)


def layout_from_counts(counts: list[int], pp: int, vpp: int | None, mtp_stage: int | None,
                       sets: int) -> PipelineLayout:
    stages = []
    for s, count in enumerate(counts):
        stage = ("E",) * (s == 0) + ("t",) * count + ("m",) * (sets if s == mtp_stage else 0)
        stages.append(stage + ("L",) * (s == len(counts) - 1))
    return PipelineLayout(tuple(stages), pp, vpp)


def mtp_stage_for(placement: str, pp: int, vpp: int | None, sets: int) -> int | None:
    """The stage index of the MTP layer for a placement ('with_loss' or 'split'); None without
    MTP. megatron-core needs it in its rank's last virtual stage."""
    num_stages = pp * (vpp or 1)
    if not sets:
        return None
    stage = {"with_loss": num_stages - 1, "split": num_stages - 2}.get(placement, -1)
    if stage < 0 or stage // pp != (vpp or 1) - 1:
        raise LayoutError(f"MTP placement {placement!r} at PP={pp}: use 'with_loss', or "
                          "'split' (needs pipeline_model_parallel_size >= 2)")
    return stage


def balance(model: StageCostModel, schedule: PipelineSchedule, placement: str, sets: int,
            layers: int, memory_limit_bytes: int | None = None) -> PipelineLayout:
    """Decoder layers per stage minimising the largest rank's memory, then the largest
    stage's compute, then the sums of squares of both. With ``memory_limit_bytes``: the largest
    stage's compute among layouts whose ranks fit the limit (memory first; only the excess
    over the limit counts). Layers never go after the MTP stage. Deterministic."""
    pp, vpp = schedule.pp, schedule.vpp
    num_stages = pp * (vpp or 1)
    mtp_stage = mtp_stage_for(placement, pp, vpp, sets)
    open_stages = num_stages - 1 if placement == "split" and sets else num_stages
    search = balanced_counts(model, schedule, open_stages, layers, None)
    if memory_limit_bytes is not None:  # from the memory-first layout, and from scratch
        fits = _Search(model, schedule, open_stages, list(search.counts), memory_limit_bytes)
        fits.improve()
        fast = balanced_counts(model, schedule, open_stages, layers, memory_limit_bytes)
        search = min((fits, fast), key=lambda candidate: candidate.key)
    return layout_from_counts(search.counts, pp, vpp, mtp_stage, sets)


def balanced_counts(model: StageCostModel, schedule: PipelineSchedule, open_stages: int, layers: int,
              limit: int | None) -> _Search:
    """Greedy fill, then local search. (An even split as the start fell into worse local
    minima in every configuration tried, up to 25% more memory, and took 2-4x longer: the
    cheap slots, late ranks' last chunks with few micro-batches in flight, are far from it.)"""
    search = _Search(model, schedule, open_stages, [0] * (model.last + 1), limit)
    search.fill(layers)
    search.improve()
    return search


class _Search:
    """Layer counts per stage with their costs; moves re-cost only the stages whose contents
    change and re-simulate only those stages' ranks. Layers stay before 'm': none enters a
    stage at or past ``open_stages``."""

    def __init__(self, model: StageCostModel, schedule: PipelineSchedule, open_stages: int,
                 counts: list[int], limit: int | None) -> None:
        self.model, self.schedule, self.open_stages = model, schedule, open_stages
        self.limit, self.counts, self.costs = limit, counts, model.costs(counts)
        self._rank_totals: dict[tuple[int, ...], int] = {}
        self.totals = [self._rank_total(r, self.costs) for r in range(schedule.pp)]
        self.key = self._key(self.costs, self.totals)

    def _rank_total(self, rank: int, costs: list[StageCosts]) -> int:
        # Stage costs are shared objects (the cost model caches them): their ids name a rank's
        # contents, and moves keep revisiting the same few.
        key = (rank, *map(id, costs[rank::self.schedule.pp]))
        if key not in self._rank_totals:
            self._rank_totals[key] = sum(self.schedule.rank_bytes(rank, costs))
        return self._rank_totals[key]

    def _key(self, costs: list[StageCosts], totals: list[int]) -> tuple[int, ...]:
        flops = [c.flops_per_microbatch for c in costs]
        top, slowest = max(totals), max(flops)
        squares = sum(map(mul, totals, totals)), sum(map(mul, flops, flops))
        if self.limit is None:
            return top, slowest, *squares
        return max(0, top - self.limit), slowest, top, squares[1], squares[0]

    def _try(self, new: list[int], changed: tuple[int, ...]):
        model, costs, totals = self.model, list(self.costs), list(self.totals)
        starts, norm = [0, *accumulate(new)], model.final_norm_stage(new)
        # A stage's costs change with its count, its share of the leading dense layers, or
        # the final norm moving in or out (a move shifts starts by at most one: only stages
        # starting at or before the first MoE layer can change their dense share).
        dense = range(min(len(new), bisect_right(starts, model.dense_prefix)))
        stages = {*changed, model.final_norm_stage(self.counts), norm}
        stages |= {s for s in dense if new[s] or self.counts[s]}
        for s in stages:
            costs[s] = model.stage(s, model.dense_layers(starts[s], new[s]), new[s], s == norm)
        for rank in {s % self.schedule.pp for s in stages if costs[s] is not self.costs[s]}:
            totals[rank] = self._rank_total(rank, costs)
        return self._key(costs, totals), new, costs, totals

    def _take(self, candidates: list, even_if_worse: bool = False) -> bool:
        """Move to the best candidate if it beats the current counts (or regardless)."""
        best = min((self._try(*c) for c in candidates), key=lambda m: m[0])
        if best[0] >= self.key and not even_if_worse:
            return False
        self.key, self.counts, self.costs, self.totals = best
        return True

    def _moved(self, src: int | None, dst: int) -> tuple[list[int], tuple[int, ...]]:
        new = list(self.counts)
        new[dst] += 1
        if src is None:
            return new, (dst,)
        new[src] -= 1
        return new, (src, dst)

    def fill(self, layers: int) -> None:
        """Greedy: add the layers one by one, each where the key grows least."""
        for _ in range(layers - sum(self.counts)):
            self._take([self._moved(None, s) for s in range(self.open_stages)], True)

    def improve(self) -> tuple[int, ...]:
        """Best-improvement local search over single-layer moves: across each stage boundary,
        and from the slowest stage or a stage of the fullest rank to any stage (a layer behind
        ranks that cannot take it would otherwise never reach a light one). Returns the key."""
        stages = range(self.open_stages)
        while True:
            fullest = self.totals.index(max(self.totals))
            flops = [c.flops_per_microbatch for c in self.costs[:self.open_stages]]
            sources = {*stages[fullest::self.schedule.pp], flops.index(max(flops))}
            pairs = {(i, i + d) for i in stages for d in (-1, 1) if i + d in stages}
            pairs |= {(i, j) for i in sources for j in stages if i != j}
            moves = [self._moved(i, j) for i, j in sorted(pairs) if self.counts[i]]
            if not moves or not self._take(moves):
                return self.key


# The training job balances compute under this "limit" when the user sets none: every layout
# fits, so stage compute decides and memory only breaks ties.
NO_MEMORY_LIMIT = 1 << 62


# ------------------------------------------------------------------ timeline replay


@dataclass(frozen=True)
class TimedOp:
    """One forward ('F') or backward ('B') of a model chunk's micro-batch on a pipeline rank,
    from ``start`` to ``end`` (seconds from the step's first op)."""

    op: str
    chunk: int
    micro_batch: int
    start: float
    end: float


def replay_times(schedule: PipelineSchedule, forward_seconds: list[float],
                 backward_factor: float = 2.0,
                 backward_seconds: list[float] | None = None) -> dict[int, list[TimedOp]]:
    """The schedule played out in time: every rank runs its ops in megatron-core's order
    (``PipelineSchedule.ops``), each as soon as the rank is free and its input exists (the
    forward of the same micro-batch on the stage before, the backward on the stage after;
    a backward also after its own forward). ``forward_seconds[s]``: one micro-batch's forward
    on global stage s (chunk c of rank r is stage c x PP + r); a backward takes
    ``backward_seconds[s]``, or else ``backward_factor`` times the forward. What an op
    sends is part of its seconds; the message itself arrives at once. Returns each rank's
    ops in its order, with times."""
    if backward_seconds is None:
        backward_seconds = [f * backward_factor for f in forward_seconds]
    pp, stages = schedule.pp, schedule.chunks * schedule.pp
    done: dict[tuple[str, int, int], float] = {}
    pending = {rank: schedule.ops(rank) for rank in range(pp)}
    free = [0.0] * pp
    timed: dict[int, list[TimedOp]] = {rank: [] for rank in range(pp)}
    while any(pending.values()):
        progressed = False
        for rank in range(pp):
            while pending[rank]:
                op, chunk, mb = pending[rank][0]
                stage = chunk * pp + rank
                needs = ([("F", stage - 1, mb)] if op == "F" and stage > 0 else
                         [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < stages - 1
                                               else []) if op == "B" else [])
                if any(n not in done for n in needs):
                    break
                start = max([free[rank], *(done[n] for n in needs)])
                length = (backward_seconds if op == "B" else forward_seconds)[stage]
                done[(op, stage, mb)] = free[rank] = start + length
                timed[rank].append(TimedOp(op, chunk, mb, start, start + length))
                pending[rank].pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule deadlocks: no rank can run its next op")
    return timed


def bubble_fraction(timed: dict[int, list[TimedOp]]) -> float:
    """Idle share of the ranks' time between the step's first start and last end."""
    ops = [t for ranks in timed.values() for t in ranks]
    span = max(t.end for t in ops) - min(t.start for t in ops)
    busy = sum(t.end - t.start for t in ops)
    return 1.0 - busy / (span * len(timed)) if span > 0 else 0.0
