"""Flexible context-parallel groups: for each global batch, the data-parallel ranks are cut into
context-parallel (CP) groups of varying size, one partition per micro-batch slot, so a 200K-token
sequence gets the ranks its memory needs while short sequences run whole on single ranks, and
sequences go to groups by their modelled work so every rank does about the same.

Units. A rank holds ``rank_tokens`` (L) tokens per micro-batch, always: a *bin* of ``units`` c
(a power of two) holds c x L tokens (documents packed, padding after them and, in a group,
possibly some before: step 5 below) and runs on an
aligned group of c ranks, each keeping its zigzag share (``parallel.context_parallel``). Every
micro-batch of every rank has the same shape, so pipeline stages exchange fixed-size tensors.

Groups. ``GroupPool`` builds, once at start-up, every aligned power-of-two block of every
data-parallel group (ranks [i c, (i + 1) c) in data-parallel order): no ``new_group`` per step.
log2(R) sizes x R / c blocks: R - 1 groups for R ranks.

Work. ``Workload`` models what one rank does in one micro-batch (a *cell*: its zigzag share
of a bin) as ``pair`` x its queries' causal key pairs (the DSA indexer scores every causal pair
of its document) + ``selected`` x its queries' selected keys, sum min(k, t + 1) (sparse
attention and its KL over the top-k) + ``token`` x its tokens (everything linear: projections,
MoE, loss) + ``gathered`` x the key tokens it receives from the rest of its group (the CP
all-gathers) + ``grouped`` once for a cell in a group of 2 or more (what a CP group costs
whatever its tokens: every layer's collective calls, the zigzag reorders, MTP's shifted labels
across the shards; measured online, 0 for a rank alone). The terms are exact for the cell's
own positions (``member_terms``): zigzag
splits one causal document evenly, but not a bin of packed documents, whose pairs depend on
where each document lies. A bin's padding (its tail) runs as one more document, so it costs
pairs too. The coefficients are measured (``tools/calibrate_cp_workload.py`` from one-process
steps; ``parallel/flexible_cp_refit.py`` refits them online from the run's own micro-batch
times), not guessed.

Plan (``plan_batch``, deterministic: a pure function of the batch's document lengths and the
workload model, so every rank gets the same one; it is the report's workload-aware reordering:
sequences go to data-parallel ranks by predicted work, not in dataset order):
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
   failing that M grows by one and the plan restarts from step 2;
5. each group's bin is laid out so its busiest member is least loaded (``_even_members``):
   documents in the order placed or reversed, part of the padding moved before them.
Slots are then ordered by decreasing work of their busiest rank. A cell no document reached
runs a padding-only micro-batch (loss mask 0).

This module knows nothing of any model: it plans and switches groups; the job builds the
micro-batches (``glm5_train/flexible_batches.py``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.comm_purpose import collective_purpose
from parallel.config.flexible_cp import is_power_of_two
from parallel.hierarchical_all_to_all import Exchange, node_split


def units_needed(length: int, rank_tokens: int) -> int:
    """Ranks of ``rank_tokens`` a document of ``length`` tokens needs: a power of two."""
    return 1 << max(0, math.ceil(length / rank_tokens) - 1).bit_length()


@dataclass(frozen=True)
class Workload:
    """Cost coefficients (see the module docstring), in seconds: per causal key pair, per
    selected key, per token, per key token gathered from the group, per cell in a group."""

    pair: float
    selected: float
    token: float
    topk: int
    gathered: float = 0.0
    grouped: float = 0.0

    def document(self, n: int) -> float:
        """Work of a whole document of n tokens on one rank."""
        pairs, selected = span_terms(0, n, self.topk)
        return self.pair * pairs + self.selected * selected + self.token * n

    def cost(self, terms: list[float]) -> float:
        """Work of a cell with these ``member_terms`` (pairs, selected, tokens, gathered,
        grouped)."""
        pairs, selected, tokens, gathered, grouped = terms
        return (self.pair * pairs + self.selected * selected + self.token * tokens
                + self.gathered * gathered + self.grouped * grouped)

    def coefficients(self) -> dict[str, float]:
        return {"pair": self.pair, "selected": self.selected, "token": self.token,
                "gathered": self.gathered, "grouped": self.grouped}


def _triangle(n: int) -> int:
    return n * (n + 1) // 2 if n > 0 else 0


def span_terms(first: int, last: int, topk: int) -> tuple[int, int]:
    """(causal key pairs, selected keys) of the queries that see first + 1 .. last keys each
    (positions first .. last - 1 of a document): sum of j, and of min(k, j), over those j."""
    if last <= first:
        return 0, 0
    pairs = _triangle(last) - _triangle(first)
    below = _triangle(min(last, topk)) - _triangle(min(first, topk))
    return pairs, below + topk * (max(last, topk) - max(first, topk))


def member_terms(lengths: list[int], capacity: int, width: int, topk: int,
                 lead: int = 0) -> list[list[float]]:
    """Per member of a bin's group of ``width`` ranks: [causal pairs, selected keys, tokens,
    gathered key tokens, grouped (1 in a group of 2 or more, else 0)] of its zigzag share
    (chunks m and 2 width - 1 - m of 2 width) of ``capacity`` tokens holding ``lead`` padding
    tokens, then documents of ``lengths`` in order, then the rest of the padding (each padding
    run one more document)."""
    grouped = 1.0 if width > 1 else 0.0
    terms = [[0.0, 0.0, capacity / width, capacity - capacity / width, grouped]
             for _ in range(width)]
    start = 0
    for n in [lead, *lengths, capacity - lead - sum(lengths)]:
        _add_document(terms, start, start + n, capacity, topk)
        start += n
    return terms


def _add_document(terms, begin: int, end: int, capacity: int, topk: int,
                  sign: float = 1.0) -> None:
    """Add (``sign`` -1: take away) the pairs and selected keys of the document at positions
    [begin, end) of a bin to each member's ``terms``."""
    width = len(terms)
    chunk = capacity // (2 * width)
    for m in range(width):
        for c in (m, 2 * width - 1 - m):
            lo, hi = max(begin, c * chunk), min(end, (c + 1) * chunk)
            if hi > lo:
                pairs, selected = span_terms(lo - begin, hi - begin, topk)
                terms[m][0] += sign * pairs
                terms[m][1] += sign * selected


def workload_terms(n: int, topk: int) -> list[float]:
    """The model's terms for one document of n tokens: causal pairs, selected keys, tokens."""
    return [*map(float, span_terms(0, n, topk)), float(n)]


def fit_workload(lengths: list[int], seconds: list[float], topk: int) -> tuple[Workload, float]:
    """Coefficients (and a per-step constant) from measured step times of single documents
    (``nonnegative_fit``). Past the top-k the selected keys grow linearly (k n - k(k-1)/2):
    with every length above ``topk`` that term is the token term's and the constant's, so it
    is left out (0)."""
    a = torch.tensor([[*workload_terms(n, topk), 1.0] for n in lengths], dtype=torch.float64)
    if min(lengths) > topk:
        a[:, 1] = 0.0
    x = nonnegative_fit(a, torch.tensor(seconds, dtype=torch.float64))
    pair, selected, token, constant = x.tolist()
    return Workload(pair, selected, token, topk), constant


def nonnegative_fit(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """argmin ||a x - b|| over x >= 0 (float64 [rows, terms], [rows]), exact for so few
    unknowns: every subset of the non-empty columns is solved unconstrained and the best
    non-negative solution wins (first found on ties); an all-zero column gets 0.

    Bitwise deterministic: the sums are correctly rounded (``math.fsum``) and the small
    systems solved in Python, because LAPACK's least squares gave different last bits for
    the same rows at different addresses (so ranks holding equal observations could plan
    differently)."""
    rows, target = a.tolist(), b.tolist()
    width = a.shape[1]
    scale = [max(abs(r[c]) for r in rows) for c in range(width)]  # terms span 1 .. n^2
    scaled = [[r[c] / scale[c] if scale[c] else 0.0 for c in range(width)] for r in rows]
    gram = [[math.fsum(r[i] * r[j] for r in scaled) for j in range(width)]
            for i in range(width)]
    rhs = [math.fsum(r[i] * t for r, t in zip(scaled, target)) for i in range(width)]
    terms = [c for c in range(width) if scale[c] > 0]
    best, best_err = [0.0] * width, math.inf
    for k in range(1, len(terms) + 1):
        for cols in itertools.combinations(terms, k):
            y = _solve([[gram[i][j] for j in cols] for i in cols], [rhs[i] for i in cols])
            if y is None or min(y) < 0:
                continue
            err = math.fsum((math.fsum(r[c] * v for c, v in zip(cols, y)) - t) ** 2
                            for r, t in zip(scaled, target))
            if err < best_err:
                best, best_err = [0.0] * width, err
                for c, v in zip(cols, y):
                    best[c] = v / scale[c]
    return torch.tensor(best, dtype=torch.float64)


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """m y = v by Gaussian elimination with partial pivoting; None when m is singular (a
    pivot below 1e-12 of the largest diagonal entry: dependent columns, which a smaller
    subset fits as well)."""
    n, tiny = len(v), 1e-12 * max(abs(m[i][i]) for i in range(len(v)))
    m, v = [row[:] for row in m], v[:]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: (abs(m[r][col]), -r))
        if abs(m[pivot][col]) <= tiny:
            return None
        m[col], m[pivot], v[col], v[pivot] = m[pivot], m[col], v[pivot], v[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            m[r] = [x - f * y for x, y in zip(m[r], m[col])]
            v[r] -= f * v[col]
    y = [0.0] * n
    for r in reversed(range(n)):
        y[r] = (v[r] - math.fsum(m[r][c] * y[c] for c in range(r + 1, n))) / m[r][r]
    return y


@dataclass
class Bin:
    """``units`` ranks' worth of tokens (units x rank_tokens), the documents it holds (indices
    into the batch, in order) and the aligned group that runs it (``first`` rank, ``slot``)."""

    units: int
    slot: int
    first: int
    documents: list[int] = field(default_factory=list)
    used: int = 0
    lead: int = 0  # padding tokens before the documents (``_even_members``); the rest follow


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
    workload: Workload  # the model it was planned with

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

    def cell_terms(self, slot: int, rank: int) -> list[float]:
        """``member_terms`` of what ``rank`` runs in ``slot``."""
        cell = self.slots[slot][rank]
        b = self.bins[cell.bin]
        return member_terms([self.lengths[d] for d in b.documents], b.units * self.rank_tokens,
                            self.group_size(b), self.workload.topk, b.lead)[cell.member]


class PlanError(ValueError):
    pass


def plan_batch(lengths: list[int], ranks: int, rank_tokens: int, max_units: int,
               workload: Workload, even_members: bool = True) -> FlexiblePlan:
    """The slots of a global batch of documents with these ``lengths`` (module docstring).
    ``ranks`` need not reach ``max_units``: a bin of more units than ranks runs on all ranks,
    each holding units x rank_tokens / ranks tokens (no pipeline parallelism then).
    ``even_members=False`` skips step 5 (documents first in every bin: the bench's
    baseline)."""
    _check_plan_args(lengths, ranks, rank_tokens, max_units)
    need = [units_needed(n, rank_tokens) for n in lengths]
    slots = _fewest_slots(lengths, need, ranks, rank_tokens)
    while True:
        for balance in (True, False):
            plan = _try_plan(lengths, need, ranks, rank_tokens, slots, workload, balance,
                             even_members)
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
    if rank_tokens % 2:
        raise PlanError(f"flexible CP needs an even number of tokens per rank, got "
                        f"{rank_tokens}: each rank keeps two zigzag chunks of its bin")
    longest = max(lengths, default=0)
    if longest > max_units * rank_tokens:
        raise PlanError(f"a {longest}-token sequence exceeds the largest CP group's "
                        f"{max_units} x {rank_tokens} tokens: raise train.seq_length (the "
                        f"longest sequence) or parallel.flexible_cp_max_size")


def _try_plan(lengths, need, ranks, rank_tokens, num_slots, workload, balance,
              even_members=True):
    """One attempt with ``num_slots`` slots; None when some document finds no room. A bin's
    ranks start loaded with its cells' work as padding (``member_terms``); a document adds
    to each member what it changes there. ``balance``: short documents go where the busiest
    rank they touch ends lowest; otherwise to the bin they fill best (best fit: packs
    tighter, the fallback before adding a slot)."""
    load = [0.0] * ranks
    free = [[True] * ranks for _ in range(num_slots)]
    bins: list[Bin] = []
    terms: list[list[list[float]]] = []  # terms[i][m]: member m of bin i (member_terms)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))

    def open_bin(units: int, slot: int, first: int) -> None:
        b = Bin(units, slot, first)
        for r in range(first, first + _width(b, ranks)):
            free[slot][r] = False
        bins.append(b)
        terms.append(member_terms([], units * rank_tokens, _width(b, ranks), workload.topk))
        for m, t in enumerate(terms[-1]):
            load[first + m] += workload.cost(t)

    def add(i: int, doc: int) -> None:
        b, after = bins[i], _with_document(bins[i], terms[i], lengths[doc], rank_tokens, workload)
        for m, (old, new) in enumerate(zip(terms[i], after)):
            load[b.first + m] += workload.cost(new) - workload.cost(old)
        terms[i] = after
        b.documents.append(doc)
        b.used += lengths[doc]

    for doc in (i for i in order if need[i] > 1):
        spot = _least_loaded_block(free, load, min(need[doc], ranks))
        if spot is None:
            return None
        open_bin(need[doc], *spot)
        add(len(bins) - 1, doc)
    for slot in range(num_slots):
        for r in range(ranks):
            if free[slot][r]:
                open_bin(1, slot, r)
    alone = _AloneBins(bins, ranks, rank_tokens, workload)
    grouped = [i for i, b in enumerate(bins) if _width(b, ranks) > 1]
    for doc in (i for i in order if need[i] == 1):
        if balance:
            best = alone.best(lengths[doc], load)
            key = _best_bin(bins, grouped, terms, load, lengths[doc], rank_tokens, workload,
                            best)
            keys = [k for k in (best, key) if k is not None]
            target = min(keys)[2] if keys else None
        else:
            target = _tightest_bin(bins, lengths[doc], rank_tokens)
        if target is None:
            return None
        add(target, doc)
        alone.added(target, lengths[doc])
    if even_members:
        _even_members(bins, terms, load, lengths, ranks, rank_tokens, workload)
    work = [[workload.cost(t) for t in member] for member in terms]
    return _finish(lengths, ranks, rank_tokens, bins, work, num_slots, workload)


LEAD_STEPS = 8  # padding splits tried per layout: lead = k / LEAD_STEPS of the padding
EVEN_PASSES = 4  # sweeps over the groups' bins; each stops early when nothing improves


def _even_members(bins, terms, load, lengths, ranks, rank_tokens, workload) -> None:
    """Lay out each group's bin so the busiest of its ranks (their work over the whole batch)
    ends least loaded: its documents in the order placed or reversed, with k / LEAD_STEPS of
    its padding before them (k = 0 .. LEAD_STEPS) and the rest after. Zigzag evens out one causal document that fills its bin,
    not a bin of packed documents and padding: a document at the front of the bin puts its
    heavy (late) queries in the middle chunks, so the members holding those chunks do up to
    several times the pairs of the others; moving part of the padding in front shifts the
    document's late queries into the chunks of the lightly loaded members. Changes ``bins``
    (documents' order, ``lead``), ``terms`` and ``load`` in place; a layout is taken only
    when it lowers the busiest member's load, so the plan's busiest rank never rises."""
    grouped = [i for i, b in enumerate(bins) if _width(b, ranks) > 1]
    for _ in range(EVEN_PASSES):
        improved = False
        for i in grouped:
            b, width = bins[i], _width(bins[i], ranks)
            capacity, padding = b.units * rank_tokens, b.units * rank_tokens - b.used
            others = [load[b.first + m] - workload.cost(t) for m, t in enumerate(terms[i])]
            best = max(load[b.first:b.first + width])
            choice = None
            for order in (b.documents, b.documents[::-1]):
                sizes = [lengths[d] for d in order]
                for k in range(LEAD_STEPS + 1):
                    after = member_terms(sizes, capacity, width, workload.topk,
                                         padding * k // LEAD_STEPS)
                    busiest = max(o + workload.cost(t) for o, t in zip(others, after))
                    if busiest < best * (1 - 1e-12):
                        best, choice = busiest, (list(order), padding * k // LEAD_STEPS, after)
            if choice is not None:
                b.documents, b.lead, terms[i] = choice
                for m, t in enumerate(terms[i]):
                    load[b.first + m] = others[m] + workload.cost(t)
                improved = True
        if not improved:
            return


def _with_document(b: Bin, terms, n: int, rank_tokens: int, workload: Workload):
    """The bin's member terms once an n-token document follows its documents (it takes the
    front of the padding, which shrinks)."""
    capacity = b.units * rank_tokens
    if len(terms) == 1:  # a rank alone: no zigzag split, the same counts in closed form
        return [_alone_with_document(terms[0], capacity - b.used, n, workload.topk)]
    after = [list(t) for t in terms]
    _add_document(after, b.used, capacity, capacity, workload.topk, sign=-1.0)
    _add_document(after, b.used, b.used + n, capacity, workload.topk)
    _add_document(after, b.used + n, capacity, capacity, workload.topk)
    return after


def _alone_with_document(terms: list[float], padding: int, n: int, topk: int) -> list[float]:
    """A rank alone's terms once an n-token document takes the front of its ``padding``
    tokens. Integer counts (exact in float64), so equal to ``_add_document``'s piece by
    piece."""
    pairs, selected = _padding_taken(padding, n, topk)
    return [terms[0] + pairs, terms[1] + selected, *terms[2:]]


def _padding_taken(padding: int, n: int, topk: int) -> tuple[int, int]:
    """How a bin's (causal pairs, selected keys) change, summed over its members, when an
    n-token document takes the front of its ``padding`` tokens: the document's counts
    added, the padding's recounted."""
    pairs, selected = span_terms(0, n, topk)
    rest_pairs, rest_selected = span_terms(0, padding - n, topk)
    old_pairs, old_selected = span_terms(0, padding, topk)
    return pairs + rest_pairs - old_pairs, selected + rest_selected - old_selected


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


def _best_bin(bins, candidates, terms, load, n, rank_tokens, workload, bound=None):
    """Of the bins ``candidates`` (indices) with room for ``n`` tokens, the key (busiest
    member's load after it, -used, index) of the one after which its busiest member is least
    loaded; ties: the fullest bin (packs tightly), then the lowest index. None: no room, or
    none can beat ``bound`` (a key found elsewhere): a bin is skipped when even its members'
    mean after the document (the busiest is at least that) lies above ``bound``'s load."""
    best_key = None
    for i in candidates:
        b = bins[i]
        if b.used + n > b.units * rank_tokens:
            continue
        if bound is not None:
            width = len(terms[i])
            pairs, selected = _padding_taken(b.units * rank_tokens - b.used, n, workload.topk)
            change = workload.pair * pairs + workload.selected * selected
            mean = (sum(load[b.first:b.first + width]) + change) / width
            if mean > bound[0] * (1 + 1e-9) + 1e-12:
                continue
        after = _with_document(b, terms[i], n, rank_tokens, workload)
        busiest = max(load[b.first + m] + workload.cost(new) - workload.cost(old)
                      for m, (old, new) in enumerate(zip(terms[i], after)))
        key = (float(busiest), -b.used, i)
        if best_key is None or key < best_key:
            best_key = key
    return best_key


class _AloneBins:
    """The bins of a plan attempt that run on one rank, as tensors, so a short document's best
    among them (``_best_bin``'s key) is one vectorised pass instead of a Python loop over
    every cell of every slot (thousands at hundreds of ranks). A document of n tokens taking
    the front of p padding tokens changes a rank alone's counts by closed forms
    (``_alone_with_document``): pairs T(n) + T(p - n) - T(p), T(k) = k (k + 1) / 2, and
    selected keys likewise; integers, exact in int64; element-wise float64 after that, so
    every rank computes the same bits."""

    def __init__(self, bins: list[Bin], ranks: int, rank_tokens: int, workload: Workload):
        chosen = [i for i, b in enumerate(bins) if _width(b, ranks) == 1]
        self.workload = workload
        self.index = torch.tensor(chosen, dtype=torch.int64)
        self.rank = torch.tensor([bins[i].first for i in chosen], dtype=torch.int64)
        self.capacity = torch.tensor([bins[i].units * rank_tokens for i in chosen],
                                     dtype=torch.int64)
        self.used = torch.tensor([bins[i].used for i in chosen], dtype=torch.int64)
        self.position = {i: p for p, i in enumerate(chosen)}

    def best(self, n: int, load) -> tuple[float, int, int] | None:
        padding = self.capacity - self.used
        room = torch.nonzero(padding >= n).flatten()
        if len(room) == 0:
            return None
        p, topk = padding[room], self.workload.topk
        pairs = _triangles(n) + _triangles(p - n) - _triangles(p)
        selected = _selected_of(n, topk) + _selected_of(p - n, topk) - _selected_of(p, topk)
        change = (self.workload.pair * pairs.to(torch.float64)
                  + self.workload.selected * selected.to(torch.float64))
        busiest = torch.tensor(load, dtype=torch.float64)[self.rank[room]] + change
        lowest = busiest.min()
        ties = room[busiest == lowest]
        fullest = ties[self.used[ties] == self.used[ties].max()]
        pick = fullest[torch.argmin(self.index[fullest])]
        return float(lowest), -int(self.used[pick]), int(self.index[pick])

    def added(self, i: int, n: int) -> None:
        if i in self.position:
            self.used[self.position[i]] += n


def _triangles(k):
    return k * (k + 1) // 2


def _selected_of(k, topk: int) -> torch.Tensor:
    """Selected keys of the first k queries of a document, sum of min(topk, j) for j = 1..k,
    for each element of ``k`` (an int64 tensor, or an int)."""
    k = torch.as_tensor(k, dtype=torch.int64)
    return _triangles(torch.clamp(k, max=topk)) + topk * torch.clamp(k - topk, min=0)


def _tightest_bin(bins, n, rank_tokens):
    """Index of the bin with the least room left that still fits ``n`` tokens."""
    fits = [(b.units * rank_tokens - b.used - n, i) for i, b in enumerate(bins)
            if b.used + n <= b.units * rank_tokens]
    return min(fits)[1] if fits else None


def _finish(lengths, ranks, rank_tokens, bins, bin_work, num_slots, workload) -> FlexiblePlan:
    """Cells per slot, slots ordered by decreasing work of their busiest rank.
    ``bin_work[i][m]``: the work of member m of bin i."""
    cells: list[list[Cell | None]] = [[None] * ranks for _ in range(num_slots)]
    work = [[0.0] * ranks for _ in range(num_slots)]
    for i, b in enumerate(bins):
        for m, w in enumerate(bin_work[i]):
            cells[b.slot][b.first + m] = Cell(i, m)
            work[b.slot][b.first + m] += w
    order = sorted(range(num_slots), key=lambda s: (-max(work[s]), s))
    renumber = {old: new for new, old in enumerate(order)}
    for b in bins:
        b.slot = renumber[b.slot]
    slots = tuple(tuple(cells[s]) for s in order)
    rank_work = tuple(sum(work[s][r] for s in range(num_slots)) for r in range(ranks))
    return FlexiblePlan(ranks, rank_tokens, tuple(lengths), tuple(bins), slots, rank_work,
                        workload)


class GroupPool:
    """Every aligned power-of-two block (sizes 2..``max_size``) of every data-parallel group,
    created once on every rank (``new_group`` is collective over the world); ``group(first,
    size)`` is this rank's group for block [first, first + size) of its data-parallel ranks.
    Size 1 is ``single`` (a group of this rank alone, as the model's fixed CP group).

    Each block for which ``needs_exchange(its global ranks)`` holds (the same answer on every
    rank) also gets its head-parallel all-to-all (``exchange(first, size)``): flat, or in two
    levels on nodes of ``node_size`` consecutive global ranks
    (``parallel/hierarchical_all_to_all.py``). A level's group that is already a block (the
    intra-node level of a block spanning two nodes of the size-2 blocks, say) is reused: at
    most 2 x (log2(max_size) x world) groups in all."""

    @collective_purpose("flexible_cp_setup")
    def __init__(self, dp_group, max_size: int, single, node_size: int | None = None,
                 needs_exchange: Callable[[list[int]], bool] | None = None) -> None:
        self.single = single
        self.ranks = dist.get_process_group_ranks(dp_group)
        self.index = self.ranks.index(dist.get_rank())
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.ranks)
        self._mine: dict[tuple[int, int], object] = {}
        self._exchanges: dict[tuple[int, int], Exchange] = {}
        made: dict[tuple[int, ...], object] = {}  # every group created, by its members

        def new_group(members: list[int]):
            key = tuple(members)
            if key not in made:
                made[key] = dist.new_group(members)
            return made[key]

        blocks = []  # (first, members) of every block of every data-parallel group
        for ranks in sorted({tuple(r) for r in everyone}):
            size = 2
            while size <= min(max_size, len(ranks)):
                blocks += [(first, list(ranks[first:first + size]))
                           for first in range(0, len(ranks), size)]
                size *= 2
        for first, members in blocks:
            group = new_group(members)
            if dist.get_rank() in members:
                self._mine[(first, len(members))] = group
        for first, members in blocks:
            if needs_exchange is not None and needs_exchange(members):
                exchange = self._exchange_of(members, node_size, new_group)
                if dist.get_rank() in members:
                    self._exchanges[(first, len(members))] = exchange

    def _exchange_of(self, members: list[int], node_size: int | None, new_group) -> Exchange:
        """The all-to-all over the block of global ``members``; its level groups are created
        on every rank (collective), in the blocks' order."""
        group = new_group(members)
        intra, inter = node_split(members, node_size) if node_size else ([members], [])
        if len(intra) == 1 or len(inter) == 1:  # on one node, or one rank per node
            return Exchange(group, len(members), len(members), 1)
        levels = [new_group(m) for m in intra + inter]
        me = dist.get_rank()
        node = next((i for i, m in enumerate(intra) if me in m), 0)
        local = next((i for i, m in enumerate(inter) if me in m), 0)
        return Exchange(group, len(members), len(intra[0]), len(intra), levels[node],
                        levels[len(intra) + local])

    def group(self, first: int, size: int):
        if size == 1:
            return self.single
        return self._mine[(first, size)]

    def exchange(self, first: int, size: int) -> Exchange:
        """The head-parallel all-to-all of block [first, first + size) (one that
        ``needs_exchange``)."""
        return self._exchanges[(first, size)]


def switch_context_group(module: torch.nn.Module, group, exchange=None) -> None:
    """Point every submodule's context-parallel group (``cp_group`` attributes and the
    ``pg_collection.cp`` of their process-group collections) at ``group``, and their
    ``cp_exchange`` attributes at ``exchange`` (the model's head-parallel path over the
    group's all-to-all, opaque here; None: the all-gather exchange): a micro-batch's forward,
    and its backward (where recomputation reruns forwards), see its own group."""
    collections = {}
    for sub in module.modules():
        if hasattr(sub, "cp_group"):
            sub.cp_group = group
        if hasattr(sub, "cp_exchange"):
            sub.cp_exchange = exchange
        pgc = getattr(sub, "pg_collection", None)
        if pgc is not None and hasattr(pgc, "cp"):
            collections[id(pgc)] = pgc
    for pgc in collections.values():
        pgc.cp = group


def in_group_for_backward(output: torch.Tensor, module: torch.nn.Module, group,
                          exchange=None) -> torch.Tensor:
    """``output`` whose backward first switches ``module`` to ``group`` and ``exchange`` (the
    pipeline schedule runs other micro-batches' forwards, with their groups, before this
    one's backward)."""
    if output.requires_grad:
        output.register_hook(
            lambda grad: (switch_context_group(module, group, exchange), grad)[1])
    return output
