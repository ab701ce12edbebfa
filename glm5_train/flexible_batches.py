"""The micro-batches of a run with flexible context-parallel groups
(``parallel.cp_groups=flexible``, planning in ``parallel/flexible_cp.py``).

A global batch is the conversations of ``train.global_batch_size`` consecutive samples of the
chat SFT dataset (the packs it was written with, at ``train.seq_length``: the longest sequence
the run trains). Every rank reads their lengths from the dataset's index (they decide the plan:
the same on every rank and on a resumed run, which starts from its consumed samples), reads the
tokens of the samples its own bins hold, plans the batch over its
data-parallel ranks, and builds its own micro-batch of each slot: its bin's conversations packed
into units x L tokens (L = seq_length / parallel.flexible_cp_max_size), padding after them
(and, where the plan moved some there to even out a group's zigzag shares, before), the
bin's CP group attached (``cp_group``); ``glm5_train.step.forward_step`` keeps this rank's zigzag
share and points the model at that group for the micro-batch's forward and backward.

With ``parallel.flexible_cp_refit`` each planned micro-batch also carries a ``CellClock``
(``cpu_clock``) that ``forward_step`` runs over its forward and backward; after the step,
``observe_step`` hands the times to the online fit (``parallel/flexible_cp_refit.py``), whose
model plans the next batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy
import torch
import torch.distributed as dist

from glm5_train.chat_data import ChatSFTDataset, batch_cu_seqlens, build_sample
from glm5_train.model.head_parallel_cp import (
    AttentionWork,
    ExchangeCost,
    HeadParallelCP,
    Links,
    attention_work,
    choose_exchange,
    costs_text,
    exchange_cost,
)
from parallel.flexible_cp import FlexiblePlan, GroupPool, Workload, plan_batch
from parallel.flexible_cp_refit import CellClock, OnlineWorkloadFit


@dataclass(frozen=True)
class Conversation:
    """Tokens [begin, end) of dataset sample ``sample`` (a packed sequence)."""

    sample: int
    begin: int
    end: int

    def __len__(self) -> int:
        return self.end - self.begin


@dataclass
class FlexibleStep:
    """One global batch as this rank runs it: one iterator per model chunk over its
    micro-batches (the same list for every chunk), their number, and the plan."""

    iterators: list
    num_microbatches: int
    plan: FlexiblePlan


class FlexibleBatches:
    """Global batches, planned and cut into this rank's micro-batches, from ``consumed``."""

    def __init__(self, dataset: ChatSFTDataset, pool: GroupPool, global_batch: int,
                 max_units: int, workload: Workload, num_chunks: int, consumed: int,
                 slot_multiple: int = 1, plan_ranks: int | None = None,
                 refit: OnlineWorkloadFit | None = None,
                 exchanges: dict[tuple[int, int], BlockExchange] | None = None) -> None:
        self.dataset, self.pool, self.global_batch = dataset, pool, global_batch
        self.max_units, self.workload, self.num_chunks = max_units, workload, num_chunks
        self.rank_tokens = dataset.seq_length // max_units
        self.consumed = consumed
        self.slot_multiple = slot_multiple  # the interleaved schedule's micro-batch multiple
        # Replay (parallel.flexible_cp_plan_ranks, one process): plan as for that many ranks
        # and run every bin of the plan whole, here.
        self.plan_ranks = plan_ranks or len(pool.ranks)
        if self.plan_ranks != len(pool.ranks) and len(pool.ranks) != 1:
            raise ValueError(f"parallel.flexible_cp_plan_ranks={plan_ranks} replays a plan on "
                             f"one process, but this run has {len(pool.ranks)} data-parallel "
                             "ranks: set it to null")
        self.refit = refit  # None: every batch planned with ``workload``
        self.clocks: list[CellClock] = []  # the latest step's planned micro-batches
        # Each block's exchange (parallel.cp_comm; None: all-gather everywhere).
        self.exchanges = exchanges or {}

    def next_step(self) -> FlexibleStep:
        conversations = self._conversations(self.consumed)
        self.consumed += self.global_batch
        workload = self.refit.current if self.refit is not None else self.workload
        plan = plan_batch([len(c) for c in conversations], self.plan_ranks,
                          self.rank_tokens, self.max_units, workload)
        packs: dict[int, tuple] = {}  # the samples this rank's bins read, each read once
        if self.plan_ranks == len(self.pool.ranks):
            cells = [plan.slots[slot][self.pool.index] for slot in range(plan.num_microbatches)]
            micro = [self._bin_batch(plan, c.bin, conversations, packs) for c in cells]
            self.clocks = [CellClock() for _ in micro] if self.refit is not None else []
            for batch, clock in zip(micro, self.clocks):
                batch["cpu_clock"] = clock
        else:  # replay: each bin once, whole, in slot order
            bins = sorted(range(len(plan.bins)), key=lambda i: (plan.bins[i].slot,
                                                                 plan.bins[i].first))
            micro = [self._bin_batch(plan, i, conversations, packs, whole=True) for i in bins]
        while len(micro) % self.slot_multiple:
            micro.append(self._padding_micro_batch(self.rank_tokens))
        return FlexibleStep([iter(micro) for _ in range(self.num_chunks)], len(micro), plan)

    def observe_step(self, plan: FlexiblePlan) -> None:
        """Feed the online fit this rank's measured micro-batches of ``plan`` (the step just
        run); collective over the fit's group. No-op without a refit."""
        if self.refit is not None:
            self.refit.observe(plan, self.pool.index, [c.seconds for c in self.clocks])

    def measured_rank_work(self) -> list[float] | None:
        """The last observed step's CPU seconds of each rank's micro-batches, in the order of
        the online fit's group (the world's ranks), as the fit measured them; None without a
        refit."""
        if self.refit is None or not self.refit.rank_seconds:
            return None
        return list(self.refit.rank_seconds)

    def _conversations(self, first: int) -> list[Conversation]:
        """The global batch's conversations, from the dataset's index (no token read: every
        rank plans from the lengths, and reads only the samples its own bins hold)."""
        out = []
        for index in range(first, first + self.global_batch):
            sample = index % len(self.dataset)
            ends = numpy.cumsum(self.dataset.conversation_lengths(sample))
            out += [Conversation(sample, int(b), int(e))
                    for b, e in zip(numpy.concatenate([[0], ends[:-1]]), ends)]
        return out

    def _bin_batch(self, plan: FlexiblePlan, index: int, conversations: list[Conversation],
                   packs: dict[int, tuple], whole: bool = False) -> dict:
        """Bin ``index`` of the plan, with its group (``whole``: on this rank alone);
        ``packs``: the samples read so far this step (tokens, mask), by sample."""
        b = plan.bins[index]
        width = 1 if whole else plan.group_size(b)
        capacity = b.units * self.rank_tokens
        docs = [conversations[d] for d in b.documents]
        if docs:
            for c in docs:
                if c.sample not in packs:
                    packs[c.sample] = self.dataset.sequence(c.sample)[:2]
            # the plan's lead padding (a document of its own, loss mask 0), then the documents
            lead = [numpy.full(b.lead, self.dataset.pad, dtype=packs[docs[0].sample][0].dtype)]
            sample = build_sample(
                numpy.concatenate(lead + [packs[c.sample][0][c.begin:c.end] for c in docs]),
                numpy.concatenate([numpy.zeros(b.lead, dtype=packs[docs[0].sample][1].dtype)]
                                  + [packs[c.sample][1][c.begin:c.end] for c in docs]),
                numpy.array(([b.lead] if b.lead else []) + [len(c) for c in docs]), capacity,
                self.dataset.pad, self.dataset.reset_position_ids)
            batch = _collate(sample, capacity)
        else:
            batch = self._padding_micro_batch(capacity)
        batch["cp_group"] = self.pool.group(b.first, width)
        chosen = self.exchanges.get((b.first, width))
        if chosen is not None and chosen.mode == "head_parallel":
            batch["cp_exchange"] = HeadParallelCP(self.pool.exchange(b.first, width))
        return batch

    def _padding_micro_batch(self, capacity: int) -> dict:
        """A micro-batch of padding only (loss mask 0) for a cell no conversation reached."""
        pad = torch.full((1, capacity), self.dataset.pad, dtype=torch.long)
        return {"tokens": pad, "labels": pad.clone(),
                "loss_mask": torch.zeros(1, capacity),
                "position_ids": torch.arange(capacity).unsqueeze(0),
                **batch_cu_seqlens([torch.tensor([0, capacity], dtype=torch.int32)], capacity),
                "cp_group": self.pool.single}


def online_refit(par, configured: Workload) -> OnlineWorkloadFit | None:
    """parallel.flexible_cp_refit: the online fit, agreed over every rank of the job
    (pipeline stages plan alike too); None when off."""
    if not par.flexible_cp_refit:
        return None
    return OnlineWorkloadFit(configured, par.flexible_cp_refit_window, dist.group.WORLD)


def _collate(sample: dict, capacity: int) -> dict:
    cu = sample.pop("cu_seqlens")
    batch = {key: value.unsqueeze(0) for key, value in sample.items()}
    batch.update(batch_cu_seqlens([cu], capacity))
    return batch


def plan_record(plan: FlexiblePlan,
                exchanges: dict[tuple[int, int], BlockExchange] | None = None,
                measured: list[float] | None = None) -> dict:
    """metrics.jsonl's account of a step's plan: micro-batches, the CP group of every cell
    (slot by slot, sizes in data-parallel rank order), modelled work imbalance, padding; with
    ``measured`` (the online refit's: ``FlexibleBatches.measured_rank_work``), every rank's
    measured CPU seconds of its micro-batches beside the modelled work (measured per global
    rank, modelled per data-parallel index: the same lists when TP = PP = 1); with
    ``exchanges``,
    each cell's exchange ("-": a rank alone) and every rank's CP bytes per level (inside its
    node, across nodes) per DSA layer application, summed over its cells."""
    record = {"micro_batches": plan.num_microbatches,
              "group_sizes": [[plan.group_size(plan.bins[c.bin]) for c in slot]
                              for slot in plan.slots],
              "work_imbalance": plan.imbalance(),
              "modelled_rank_work": list(plan.rank_work),
              "padding_tokens": plan.padding_tokens(),
              "workload": plan.workload.coefficients()}
    if measured is not None:
        record["measured_rank_work"] = [round(s, 6) for s in measured]
    if exchanges is None:
        return record
    cells = [[_cell_cost(plan, c.bin, exchanges) for c in slot] for slot in plan.slots]
    record["exchanges"] = [[cost.mode if cost else "-" for cost in slot] for slot in cells]
    ranks = range(len(plan.slots[0])) if plan.slots else range(0)
    record["cp_bytes_per_layer"] = {
        level: [sum(getattr(slot[r], level) for slot in cells if slot[r]) for r in ranks]
        for level in ("intra", "inter")}
    return record


def _cell_cost(plan: FlexiblePlan, index: int, exchanges) -> ExchangeCost | None:
    """The exchange cost per layer application of bin ``index`` (None: a rank alone)."""
    b = plan.bins[index]
    chosen = exchanges.get((b.first, plan.group_size(b)))
    return chosen.cost_at(b.units * plan.rank_tokens) if chosen else None


@dataclass
class BlockExchange:
    """The exchange a flexible group runs (``parallel.cp_comm``), fixed for the run, and what
    it costs per DSA layer application at a bin's length (``cost_at``); ``costs``: every mode
    considered at the block's longest bin (auto's choice)."""

    mode: str
    costs: dict
    work: AttentionWork
    ranks: list[int]
    node_size: int | None
    links: Links
    _at: dict = field(default_factory=dict, repr=False)

    def cost_at(self, seq: int) -> ExchangeCost:
        if seq not in self._at:
            self._at[seq] = exchange_cost(self.work, self.mode, seq, self.ranks,
                                          self.node_size, self.links)
        return self._at[seq]


def block_length(size: int, dp: int, max_units: int, rank_tokens: int) -> int:
    """The longest bin a block of ``size`` data-parallel ranks runs: size x L, or, for the
    whole data-parallel group when groups may be larger (flexible_cp_max_size > dp), bins of
    up to max_units x L on it."""
    return (max_units if size == dp and max_units > dp else size) * rank_tokens


def exchange_chooser(job, dp: int):
    """(global ranks of a block) -> (mode, costs at its longest bin): ``parallel.cp_comm``, or
    auto's choice (``choose_exchange``: by bytes per link level at the configured rates). The
    same on every rank for the same block: GroupPool builds the all-to-alls it needs alone."""
    par = job.parallel
    work, links = attention_work(job, documents=True), Links.of(par)
    rank_tokens = job.train.seq_length // par.flexible_cp_max_size

    def choose(ranks: list[int]) -> tuple[str, dict]:
        seq = block_length(len(ranks), dp, par.flexible_cp_max_size, rank_tokens)
        best, costs = choose_exchange(work, seq, ranks, par.cp_node_size, links)
        return (best if par.cp_comm == "auto" else par.cp_comm), costs

    return choose


def block_exchanges(job, pool: GroupPool) -> dict[tuple[int, int], BlockExchange]:
    """Every block of this rank's data-parallel group: its exchange (``exchange_chooser``)."""
    par, dp = job.parallel, len(pool.ranks)
    choose, work = exchange_chooser(job, dp), attention_work(job, documents=True)
    out = {}
    size = 2
    while size <= min(par.flexible_cp_max_size, dp):
        for first in range(0, dp, size):
            ranks = pool.ranks[first:first + size]
            mode, costs = choose(ranks)
            out[(first, size)] = BlockExchange(mode, costs, work, ranks, par.cp_node_size,
                                               Links.of(par))
        size *= 2
    return out


def exchanges_line(exchanges: dict[tuple[int, int], BlockExchange]) -> str:
    """The console's account of the groups' exchanges: per group size, the mode and the
    modelled MB per layer application inside / across nodes of each mode."""
    parts = []
    for size in sorted({s for _, s in exchanges}):
        chosen = next(e for (_, s), e in sorted(exchanges.items()) if s == size)
        parts.append(f"groups of {size}: {chosen.mode} ({costs_text(chosen.costs)})")
    return "flexible CP exchanges (per layer, inside/across nodes): " + "; ".join(parts)
