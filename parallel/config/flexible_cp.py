"""Flexible context-parallel groups: keys and rules (the technique: parallel/flexible_cp.py)."""

from __future__ import annotations

from dataclasses import dataclass

from parallel.layout_error import LayoutError

CP_GROUPS = ("fixed", "flexible")


@dataclass
class FlexibleCPOptions:
    """``parallel.*`` keys of context-parallel groups (part of ParallelConfig)."""

    # "fixed" (every sequence over context_parallel_size ranks) or "flexible" (per global
    # batch, the data-parallel ranks form CP groups of 1 .. flexible_cp_max_size ranks, powers
    # of two, sized to each chat SFT conversation and filled by the workload model below;
    # context_parallel_size stays 1).
    cp_groups: str = "fixed"
    flexible_cp_max_size: int = 1
    # The workload model: seconds per causal token pair of a document (the DSA indexer), per
    # selected key (sparse attention and its KL), per token (the rest). Measured with
    # tools/calibrate_cp_workload.py; the defaults are glm5_tiny's on a 2-core CPU (measured at
    # 512-4096 tokens, fit within 3%; past the top-k the selected-key term folds into token).
    flexible_cp_cost_pair: float = 1.03e-7
    flexible_cp_cost_selected: float = 0.0
    flexible_cp_cost_token: float = 3.30e-4
    # Seconds per key token a rank receives from its CP group (the all-gathers): not measurable
    # on one process, so 0 unless set (e.g. to what the online refit logged: metrics.jsonl's
    # flexible_cp.workload).
    flexible_cp_cost_gathered: float = 0.0
    # Seconds per micro-batch a rank runs in a CP group of 2 or more, whatever its tokens (the
    # group's per-layer calls and reorders): not measurable on one process, so 0 unless set.
    flexible_cp_cost_grouped: float = 0.0
    # Online refit (parallel/flexible_cp_refit.py): every rank times each of its micro-batches
    # (process CPU seconds of its forward and backward), the ranks all-gather the times with
    # their cells' terms and fit the coefficients above over the last flexible_cp_refit_window
    # observed steps; the next plans use that fit (the configured model until 2 steps are
    # observed, and again after a resume: the fit is not checkpointed).
    flexible_cp_refit: bool = False
    flexible_cp_refit_window: int = 8
    # Replay: plan each global batch as for this many data-parallel ranks and run every bin of
    # the plan whole on this one process (null: plan for the run's own ranks). Reproduces a
    # larger run's micro-batches in one process, e.g. to check its numerics.
    flexible_cp_plan_ranks: int | None = None


def check_flexible_cp(par, dp: int, seq_length: int) -> None:
    """parallel.cp_groups=flexible: groups of power-of-two sizes cut from the data-parallel
    ranks, each rank holding seq_length / flexible_cp_max_size tokens per micro-batch.
    ``par`` is the whole ParallelConfig (the groups replace fixed CP and its exchange)."""
    largest = par.flexible_cp_max_size
    if par.cp_groups not in CP_GROUPS:
        raise LayoutError(f"parallel.cp_groups={par.cp_groups!r}: use one of {list(CP_GROUPS)}")
    if par.cp_groups == "fixed":
        if par.flexible_cp_refit:
            raise LayoutError("parallel.flexible_cp_refit=true refits the workload model of "
                              "flexible CP groups, but parallel.cp_groups='fixed': set "
                              "parallel.cp_groups=flexible or parallel.flexible_cp_refit=false")
        if largest != 1:
            raise LayoutError(f"parallel.flexible_cp_max_size={largest} sizes flexible CP "
                              "groups, but parallel.cp_groups='fixed': set "
                              "parallel.cp_groups=flexible or parallel.flexible_cp_max_size=1")
        return
    fix = "launch the ranks as data parallel (the groups are cut from them)"
    if par.context_parallel_size != 1:
        raise LayoutError(f"parallel.cp_groups=flexible with context_parallel_size="
                          f"{par.context_parallel_size}: flexible groups replace the fixed one; "
                          f"set context_parallel_size=1 and {fix}")
    for name, value in (("flexible_cp_max_size", largest), ("data-parallel size", dp)):
        if not is_power_of_two(value):
            raise LayoutError(f"parallel.cp_groups=flexible needs a power-of-two {name}, got "
                              f"{value}: groups are aligned power-of-two blocks of the data-"
                              "parallel ranks")
    if par.pipeline_model_parallel_size > 1 and largest > dp:
        raise LayoutError(f"parallel.flexible_cp_max_size={largest} > the data-parallel size "
                          f"{dp} under pipeline parallelism (every rank's micro-batches must "
                          f"hold the same tokens): lower it to <= {dp} or {fix}")
    _check_flexible_sequence(par, seq_length)
    _check_replay(par, dp * par.model_parallel_size)
    _check_refit(par)
    for name in ("flexible_cp_cost_pair", "flexible_cp_cost_selected", "flexible_cp_cost_token",
                 "flexible_cp_cost_gathered", "flexible_cp_cost_grouped"):
        if getattr(par, name) < 0:
            raise LayoutError(f"parallel.{name}={getattr(par, name)} must be >= 0 (measure it "
                              "with tools/calibrate_cp_workload.py)")


def _check_flexible_sequence(par, seq_length: int) -> None:
    split = par.tensor_model_parallel_size if par.sequence_parallel else 1
    unit = 2 * par.flexible_cp_max_size * split
    if seq_length % unit:
        raise LayoutError(f"train.seq_length={seq_length} is not divisible by 2 x "
                          f"parallel.flexible_cp_max_size{' x TP' if split > 1 else ''} = {unit}"
                          ": each rank holds seq_length / flexible_cp_max_size tokens, zigzag-"
                          "sharded in 2 chunks per rank; pick a multiple of it")


def _check_replay(par, processes: int) -> None:
    replay = par.flexible_cp_plan_ranks
    if replay is not None and processes != 1:
        raise LayoutError(f"parallel.flexible_cp_plan_ranks={replay} replays a plan on one "
                          f"process, but the layout has {processes}: set it to null")
    if replay is not None and not is_power_of_two(replay):
        raise LayoutError(f"parallel.flexible_cp_plan_ranks={replay} must be a power of two "
                          "(the data-parallel size of the run whose plans it replays)")


def _check_refit(par) -> None:
    if not par.flexible_cp_refit:
        return
    window = par.flexible_cp_refit_window
    if window < 2:
        raise LayoutError(f"parallel.flexible_cp_refit_window={window}: the refit needs at "
                          "least 2 observed steps in its window; set it to >= 2 (default 8)")
    if par.flexible_cp_plan_ranks is not None:
        raise LayoutError(f"parallel.flexible_cp_refit=true with parallel.flexible_cp_plan_"
                          f"ranks={par.flexible_cp_plan_ranks}: a replay cannot reproduce "
                          "plans made from another run's measured times; set "
                          "parallel.flexible_cp_refit=false")


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0
