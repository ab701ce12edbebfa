"""Flexible context-parallel groups: for each global batch, the data-parallel ranks are cut into
context-parallel (CP) groups of varying size, one partition per micro-batch slot, so a 200K-token
sequence gets the ranks its memory needs while short sequences run whole on single ranks, and
sequences go to groups by their modelled work so every rank does about the same.

Units. A rank holds ``rank_tokens`` (L) tokens per micro-batch, always: a *bin* of ``units`` c
(a power of two) holds c x L tokens (documents packed, padding at the end) and runs on an
aligned group of c ranks, each keeping its zigzag share (``parallel.context_parallel``). Every
micro-batch of every rank has the same shape, so pipeline stages exchange fixed-size tensors.

Groups. ``GroupPool`` builds, once at start-up, every aligned power-of-two block of every
data-parallel group (ranks [i c, (i + 1) c) in data-parallel order): no ``new_group`` per step.
log2(R) sizes x R / c blocks: R - 1 groups for R ranks.

Work. ``Workload`` models a document of n tokens as ``pair`` x n(n+1)/2 (the DSA indexer scores
every causal pair of its document) + ``selected`` x sum_t min(k, t + 1) (sparse attention and its
KL over the top-k) + ``token`` x n (everything linear: projections, MoE, loss); padding costs
``token`` per token. The coefficients are measured (``tools/calibrate_cp_workload.py``), not
guessed. A bin's work is shared by its c ranks.

Plan (``plan_batch``, deterministic: a pure function of the batch's document lengths, so every
rank and a resumed run get the same one):
1. each document needs c = the next power of two >= n / L units; those of c >= 2 each open a
   bin of c units (longest first);
2. the number of slots M starts at the lower bound ceil(units / R); bins go, largest first, to
   the aligned free block (over all slots) whose busiest rank is least loaded (LPT). With
   power-of-two sizes placed in decreasing order, free space stays a union of aligned blocks,
   so a bin always fits while free cells remain;
3. every free (slot, rank) cell is a bin of 1 unit on that rank; the short documents go, most
   work first, wherever (free room in any bin of a cell or a group) the busiest affected rank
   ends least loaded;
4. if some document finds no room, step 3 is retried packing tightest-first (best fit), and
   failing that M grows by one and the plan restarts from step 2.
Slots are then ordered by decreasing work of their busiest rank. A cell no document reached
runs a padding-only micro-batch (loss mask 0).

This module knows nothing of any model: it plans and switches groups; the job builds the
micro-batches (``glm5_train/flexible_batches.py``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.config.flexible_cp import is_power_of_two


def units_needed(length: int, rank_tokens: int) -> int:
    """Ranks of ``rank_tokens`` a document of ``length`` tokens needs: a power of two."""
    return 1 << max(0, math.ceil(length / rank_tokens) - 1).bit_length()


@dataclass(frozen=True)
class Workload:
    """Cost of a document (see the module docstring); any consistent unit (seconds)."""

    pair: float
    selected: float
    token: float
    topk: int

    def document(self, n: int) -> float:
        pairs = n * (n + 1) / 2
        k = min(self.topk, n)
        selected = k * (k + 1) / 2 + (n - k) * self.topk
        return self.pair * pairs + self.selected * selected + self.token * n

    def bin(self, lengths: list[int], capacity: int) -> float:
        return sum(self.document(n) for n in lengths) + self.token * (capacity - sum(lengths))


def workload_terms(n: int, topk: int) -> list[float]:
    """The model's terms for one document of n tokens: causal pairs, selected keys, tokens."""
    return [Workload(1.0, 0.0, 0.0, topk).document(n), Workload(0.0, 1.0, 0.0, topk).document(n),
            float(n)]


def fit_workload(lengths: list[int], seconds: list[float], topk: int) -> tuple[Workload, float]:
    """Coefficients (and a per-step constant) from measured step times of single documents:
    non-negative least squares, exact for so few unknowns (every subset of active terms is
    solved unconstrained; the best whose solution is non-negative wins). Past the top-k the
    selected keys grow linearly (k n - k(k-1)/2): with every length above ``topk`` that term
    is the token term's and the constant's, so it is left out (0)."""
    a = torch.tensor([[*workload_terms(n, topk), 1.0] for n in lengths], dtype=torch.float64)
    if min(lengths) > topk:
        a[:, 1] = 0.0
    b = torch.tensor(seconds, dtype=torch.float64)
    scale = a.abs().amax(0).clamp_min(1e-30)  # columns span 1 .. n^2: condition them
    best, best_err = torch.zeros(4, dtype=torch.float64), float("inf")
    terms = [c for c in range(4) if a[:, c].abs().sum() > 0]
    for k in range(1, len(terms) + 1):
        for active in itertools.combinations(terms, k):
            cols = list(active)
            x = torch.linalg.lstsq(a[:, cols] / scale[cols], b[:, None]).solution[:, 0]
            if (x < 0).any():
                continue
            full = torch.zeros(4, dtype=torch.float64)
            full[cols] = x / scale[cols]
            err = float(((a @ full - b) ** 2).sum())
            if err < best_err:
                best, best_err = full, err
    pair, selected, token, constant = best.tolist()
    return Workload(pair, selected, token, topk), constant


@dataclass
class Bin:
    """``units`` ranks' worth of tokens (units x rank_tokens), the documents it holds (indices
    into the batch, in order) and the aligned group that runs it (``first`` rank, ``slot``)."""

    units: int
    slot: int
    first: int
    documents: list[int] = field(default_factory=list)
    used: int = 0


@dataclass(frozen=True)
class Cell:
    """What one rank runs in one slot: its share ``member`` of bin ``bin``."""

    bin: int
    member: int


@dataclass(frozen=True)
class FlexiblePlan:
    """The slots of one global batch over ``ranks`` ranks (data-parallel order)."""

    ranks: int
    rank_tokens: int
    lengths: tuple[int, ...]
    bins: tuple[Bin, ...]
    slots: tuple[tuple[Cell, ...], ...]  # slots[s][r]: rank r's micro-batch in slot s
    rank_work: tuple[float, ...]  # modelled work of each rank over the whole batch

    @property
    def num_microbatches(self) -> int:
        return len(self.slots)

    def imbalance(self) -> float:
        """Busiest rank's work over the mean (1.0: perfectly balanced)."""
        mean = sum(self.rank_work) / len(self.rank_work)
        return max(self.rank_work) / mean if mean > 0 else 1.0

    def group_size(self, b: Bin) -> int:
        """Ranks that run bin ``b``: its units, or every rank when there are fewer."""
        return _width(b, self.ranks)

    def padding_tokens(self) -> int:
        return sum(b.units * self.rank_tokens - b.used for b in self.bins)


class PlanError(ValueError):
    pass


def plan_batch(lengths: list[int], ranks: int, rank_tokens: int, max_units: int,
               workload: Workload) -> FlexiblePlan:
    """The slots of a global batch of documents with these ``lengths`` (module docstring).
    ``ranks`` need not reach ``max_units``: a bin of more units than ranks runs on all ranks,
    each holding units x rank_tokens / ranks tokens (no pipeline parallelism then)."""
    _check_plan_args(lengths, ranks, rank_tokens, max_units)
    need = [units_needed(n, rank_tokens) for n in lengths]
    slots = _fewest_slots(lengths, need, ranks, rank_tokens)
    while True:
        for balance in (True, False):
            plan = _try_plan(lengths, need, ranks, rank_tokens, slots, workload, balance)
            if plan is not None:
                return plan
        slots += 1


def _fewest_slots(lengths, need, ranks, rank_tokens) -> int:
    """A lower bound on the slots: the long documents' cells, then cells for the short
    documents' tokens that the long documents' bins have no room left for."""
    cells = sum(min(c, ranks) for c in need if c > 1)
    room = sum(c * rank_tokens - n for n, c in zip(lengths, need) if c > 1)
    short = sum(n for n, c in zip(lengths, need) if c == 1)
    cells += -(-max(0, short - room) // rank_tokens)
    return max(1, -(-cells // ranks))


def _check_plan_args(lengths: list[int], ranks: int, rank_tokens: int, max_units: int) -> None:
    if not is_power_of_two(ranks) or not is_power_of_two(max_units):
        raise PlanError(f"flexible CP needs power-of-two ranks and group sizes, got {ranks} "
                        f"ranks and a largest group of {max_units}")
    longest = max(lengths, default=0)
    if longest > max_units * rank_tokens:
        raise PlanError(f"a {longest}-token sequence exceeds the largest CP group's "
                        f"{max_units} x {rank_tokens} tokens: raise train.seq_length (the "
                        f"longest sequence) or parallel.flexible_cp_max_size")


def _try_plan(lengths, need, ranks, rank_tokens, num_slots, workload, balance):
    """One attempt with ``num_slots`` slots; None when some document finds no room. A bin's
    ranks start loaded with its capacity as padding; a document adds its work beyond that.
    ``balance``: short documents go where the load ends lowest; otherwise to the bin they
    fill best (best fit: packs tighter, the fallback before adding a slot)."""
    load = [0.0] * ranks
    free = [[True] * ranks for _ in range(num_slots)]
    bins: list[Bin] = []
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))

    def open_bin(units: int, slot: int, first: int) -> Bin:
        b = Bin(units, slot, first)
        for r in range(first, first + _width(b, ranks)):
            free[slot][r] = False
            load[r] += workload.token * units * rank_tokens / _width(b, ranks)
        bins.append(b)
        return b

    def add(b: Bin, doc: int) -> None:
        b.documents.append(doc)
        b.used += lengths[doc]
        extra = _extra_work(workload, lengths[doc]) / _width(b, ranks)
        for r in range(b.first, b.first + _width(b, ranks)):
            load[r] += extra

    for doc in (i for i in order if need[i] > 1):
        spot = _least_loaded_block(free, load, min(need[doc], ranks))
        if spot is None:
            return None
        add(open_bin(need[doc], *spot), doc)
    for slot in range(num_slots):
        for r in range(ranks):
            if free[slot][r]:
                open_bin(1, slot, r)
    for doc in (i for i in order if need[i] == 1):
        target = (_best_bin(bins, load, lengths[doc], rank_tokens, ranks, workload) if balance
                  else _tightest_bin(bins, lengths[doc], rank_tokens))
        if target is None:
            return None
        add(bins[target], doc)
    return _finish(lengths, ranks, rank_tokens, bins, num_slots, workload)


def _extra_work(workload: Workload, n: int) -> float:
    """Work of an n-token document beyond the padding it replaces."""
    return workload.document(n) - workload.token * n


def _width(b: Bin, ranks: int) -> int:
    return min(b.units, ranks)


def _least_loaded_block(free, load, width):
    """(slot, first rank) of the free aligned block of ``width`` ranks whose busiest rank is
    least loaded; ties: earliest slot, lowest rank."""
    best, best_key = None, None
    for slot, cells in enumerate(free):
        for first in range(0, len(cells), width):
            if all(cells[first:first + width]):
                key = (max(load[first:first + width]), slot, first)
                if best_key is None or key < best_key:
                    best, best_key = (slot, first), key
    return best


def _best_bin(bins, load, n, rank_tokens, ranks, workload):
    """Index of the bin with room for ``n`` tokens after which its busiest rank is least
    loaded; ties: the fullest bin (packs tightly), then the lowest index."""
    best, best_key = None, None
    cost = _extra_work(workload, n)
    for i, b in enumerate(bins):
        if b.used + n > b.units * rank_tokens:
            continue
        width = _width(b, ranks)
        after = max(load[b.first:b.first + width]) + cost / width
        key = (after, -b.used, i)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def _tightest_bin(bins, n, rank_tokens):
    """Index of the bin with the least room left that still fits ``n`` tokens."""
    fits = [(b.units * rank_tokens - b.used - n, i) for i, b in enumerate(bins)
            if b.used + n <= b.units * rank_tokens]
    return min(fits)[1] if fits else None


def _finish(lengths, ranks, rank_tokens, bins, num_slots, workload) -> FlexiblePlan:
    """Cells per slot, slots ordered by decreasing work of their busiest rank."""
    cells: list[list[Cell | None]] = [[None] * ranks for _ in range(num_slots)]
    work = [[0.0] * ranks for _ in range(num_slots)]
    for i, b in enumerate(bins):
        width = _width(b, ranks)
        share = workload.bin([lengths[d] for d in b.documents], b.units * rank_tokens) / width
        for m in range(width):
            cells[b.slot][b.first + m] = Cell(i, m)
            work[b.slot][b.first + m] += share
    order = sorted(range(num_slots), key=lambda s: (-max(work[s]), s))
    renumber = {old: new for new, old in enumerate(order)}
    for b in bins:
        b.slot = renumber[b.slot]
    slots = tuple(tuple(cells[s]) for s in order)
    rank_work = tuple(sum(work[s][r] for s in range(num_slots)) for r in range(ranks))
    return FlexiblePlan(ranks, rank_tokens, tuple(lengths), tuple(bins), slots, rank_work)


class GroupPool:
    """Every aligned power-of-two block (sizes 2..``max_size``) of every data-parallel group,
    created once on every rank (``new_group`` is collective over the world); ``group(first,
    size)`` is this rank's group for block [first, first + size) of its data-parallel ranks.
    Size 1 is ``single`` (a group of this rank alone, as the model's fixed CP group)."""

    def __init__(self, dp_group, max_size: int, single) -> None:
        self.single = single
        self.ranks = dist.get_process_group_ranks(dp_group)
        self.index = self.ranks.index(dist.get_rank())
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.ranks)
        self._mine: dict[tuple[int, int], object] = {}
        for ranks in sorted({tuple(r) for r in everyone}):
            size = 2
            while size <= min(max_size, len(ranks)):
                for first in range(0, len(ranks), size):
                    members = list(ranks[first:first + size])
                    made = dist.new_group(members)
                    if dist.get_rank() in members:
                        self._mine[(first, size)] = made
                size *= 2

    def group(self, first: int, size: int):
        if size == 1:
            return self.single
        return self._mine[(first, size)]



def switch_context_group(module: torch.nn.Module, group) -> None:
    """Point every submodule's context-parallel group (``cp_group`` attributes and the
    ``pg_collection.cp`` of their process-group collections) at ``group``: a micro-batch's
    forward, and its backward (where recomputation reruns forwards), see its own group."""
    collections = {}
    for sub in module.modules():
        if hasattr(sub, "cp_group"):
            sub.cp_group = group
        pgc = getattr(sub, "pg_collection", None)
        if pgc is not None and hasattr(pgc, "cp"):
            collections[id(pgc)] = pgc
    for pgc in collections.values():
        pgc.cp = group


def in_group_for_backward(output: torch.Tensor, module: torch.nn.Module, group) -> torch.Tensor:
    """``output`` whose backward first switches ``module`` to ``group`` (the pipeline schedule
    runs other micro-batches' forwards, with their groups, before this one's backward)."""
    if output.requires_grad:
        output.register_hook(lambda grad: (switch_context_group(module, group), grad)[1])
    return output
