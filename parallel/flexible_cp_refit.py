"""Online refit of the flexible-CP workload model (``parallel/flexible_cp.py``) from the run's
own micro-batch times: the "dynamic redistribution" of GLM-5's report. The calibrated model
comes from one-process steps on single conversations; what a rank pays in a run (CP gathers,
packed documents, padding, its share of MoE and MTP) is measured here, every step, and the
next plans balance that.

Measure. Each micro-batch of a plan carries a ``CellClock``: the process CPU seconds
(``time.process_time``) of its forward and of its backward (from the gradient reaching its
output to the end of that backward pass), added up. Process CPU, not wall time: with more
ranks than cores a rank's wall time is mostly other ranks' work, while its CPU time is its
own; process, not thread, CPU: the gloo threads that move this rank's CP gathers are its work.

Agree. After the step every rank all-gathers (float64) its cells' rows, [pairs, selected,
tokens, gathered, grouped, seconds] (``FlexiblePlan.cell_terms``), over the group it is given (the
world: pipeline stages must plan alike too). All ranks then hold the same rows in the same
order and solve the same non-negative least squares (``nonnegative_fit``), and the group's
first rank broadcasts its coefficients so that no difference between machines' linear algebra
can split the plans (a plan mismatch would hang the CP collectives).

Prior. The fit is held towards the configured model by ``PRIOR_CELLS`` pseudo-cells per
coefficient (``fit_cells``): what the measurement cannot tell apart (terms that move together
in a window's cells) stays near the calibration instead of dropping to 0. Only what the
configuration knows is held: the calibrated terms (pair, selected, token: measured on one
process), and gathered and grouped where set above 0; left at 0 they are unknown (one process
cannot measure a CP group), and the cells alone decide them.

Window. The rows of the last ``window`` observed steps count equally. The first step a
process runs is not observed (first-use allocations and lazy set-up inflate it). Until two
steps are observed the configured model plans. A resumed run starts again from the
configured model: the fit is not checkpointed (it is two steps of measurement away).
"""

from __future__ import annotations

import time
import zlib
from collections import deque

import torch
import torch.distributed as dist

from parallel.comm_purpose import collective_purpose
from parallel.flexible_cp import FlexiblePlan, Workload, nonnegative_fit

TERMS = ("pair", "selected", "token", "gathered", "grouped")
SECONDS = len(TERMS)  # the column of a cell's row holding its measured seconds
CALIBRATED = ("pair", "selected", "token")  # measured on one process: always a prior
MIN_STEPS = 2  # observed steps before the fit replaces the configured model
# How firmly the fit is held towards the configured (calibrated) model: as many cells' worth
# per coefficient. A window's cells of CPU-timed micro-batches are noisy (2-core runs: +-7%
# between the ranks of one CP group doing the same work) and few of them differ in their
# pair terms, so an unheld fit set the pair coefficient to 0 in 2 of 3 bench runs.
PRIOR_CELLS = 8.0


class CellClock:
    """Process CPU seconds of one micro-batch: its forward and its backward, added up."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._since: float | None = None

    def start(self) -> None:
        self._since = time.process_time()

    def stop(self) -> None:
        if self._since is not None:
            self.seconds += time.process_time() - self._since
            self._since = None

    def time_backward(self, output: torch.Tensor) -> torch.Tensor:
        """``output`` whose backward is timed: the clock starts when its gradient arrives and
        stops when that backward pass ends (an autograd engine callback)."""
        if output.requires_grad:
            output.register_hook(self._backward_starts)
        return output

    def _backward_starts(self, grad: torch.Tensor) -> torch.Tensor:
        self.start()
        torch.autograd.Variable._execution_engine.queue_callback(self.stop)
        return grad


class OnlineWorkloadFit:
    """The workload model the next plan uses: ``configured`` until ``MIN_STEPS`` steps are
    observed, then the non-negative least-squares fit of the last ``window`` steps' cells."""

    def __init__(self, configured: Workload, window: int, group,
                 prior_cells: float = PRIOR_CELLS) -> None:
        if window < MIN_STEPS:
            raise ValueError(f"the refit window of {window} steps is below the {MIN_STEPS} "
                             "observed steps a fit needs: use a window >= 2")
        self.configured, self.group, self.prior_cells = configured, group, prior_cells
        self.steps: deque[torch.Tensor] = deque(maxlen=window)  # [ranks x cells, terms + 1]
        self.skipped_first = False
        self.current = configured
        self.fitted = False
        # the last observed step's measured CPU seconds of every rank's cells (group order)
        self.rank_seconds: list[float] = []

    @collective_purpose("workload_refit")
    def observe(self, plan: FlexiblePlan, index: int, seconds: list[float]) -> None:
        """This rank's measured cells of ``plan`` (``seconds[s]``: slot s, the rank at
        ``index`` of the plan), shared with every rank of the group (collective; call it on
        every rank after every planned step), then refit."""
        stamp = float(plan_fingerprint(plan))
        rows = torch.tensor([[*plan.cell_terms(s, index), t, stamp]
                             for s, t in enumerate(seconds)], dtype=torch.float64)
        everyone = [torch.empty_like(rows) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, rows, group=self.group)
        _check_same_plan(everyone)
        everyone = [r[:, :SECONDS + 1] for r in everyone]
        self.rank_seconds = [float(r[:, SECONDS].sum()) for r in everyone]
        if not self.skipped_first:  # the process's first step: warm-up, not the model's
            self.skipped_first = True
            return
        self.steps.append(torch.cat(everyone))
        if len(self.steps) >= MIN_STEPS:
            self.current = self._agreed(fit_cells(torch.cat(list(self.steps)),
                                                  self.configured.topk, self.configured,
                                                  self.prior_cells))
            self.fitted = True

    @collective_purpose("workload_refit")
    def _agreed(self, workload: Workload) -> Workload:
        """The group's first rank's coefficients on every rank."""
        values = torch.tensor([getattr(workload, t) for t in TERMS], dtype=torch.float64)
        dist.broadcast(values, dist.get_global_rank(self.group, 0), group=self.group)
        return Workload(*values[:3].tolist(), workload.topk, *values[3:].tolist())


def plan_fingerprint(plan: FlexiblePlan) -> int:
    """A 32-bit digest of the plan's cells and bins (exact in float64)."""
    cells = [(b.units, b.slot, b.first, tuple(b.documents), b.lead) for b in plan.bins]
    return zlib.crc32(repr((plan.lengths, plan.slots, cells)).encode())


def _check_same_plan(rows: list[torch.Tensor]) -> None:
    """Every rank ran the same plan (the last column: its fingerprint), or stop here: the
    next batch's collectives would not match."""
    stamps = sorted({float(r[0, -1]) for r in rows if len(r)})
    if len(stamps) > 1 or len({len(r) for r in rows}) > 1:
        raise RuntimeError(f"flexible CP: the ranks ran different plans (fingerprints "
                           f"{stamps}, micro-batches {[len(r) for r in rows]}): their workload "
                           "models differ; this is a bug, please report it")


def fit_cells(rows: torch.Tensor, topk: int, prior: Workload | None = None,
              prior_cells: float = 0.0) -> Workload:
    """Non-negative least squares of cells' seconds (last column) over their terms
    [pairs, selected, tokens, gathered, grouped] (float64 [cells, 6]); with a ``prior``, each
    coefficient is also held towards the prior's as firmly as ``prior_cells`` cells would
    hold it (one pseudo-cell per term: that term alone, at its root-mean-square size over
    the rows, costing what the prior says); a term outside ``CALIBRATED`` that the prior
    leaves at 0 is unknown, not held."""
    a, b = rows[:, :SECONDS], rows[:, SECONDS]
    if prior is not None and prior_cells > 0:
        held = [i for i, t in enumerate(TERMS) if t in CALIBRATED or getattr(prior, t) > 0]
        size = (a.square().mean(dim=0) * prior_cells).sqrt()
        known = torch.tensor([getattr(prior, t) for t in TERMS], dtype=torch.float64)
        pseudo = torch.diag(size)[held]
        a, b = torch.cat([a, pseudo]), torch.cat([b, (size * known)[held]])
    pair, selected, token, gathered, grouped = nonnegative_fit(a, b).tolist()
    return Workload(pair, selected, token, topk, gathered, grouped)
