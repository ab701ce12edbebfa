"""Collectives timed by purpose (``CommMeter(time_purposes=...)``, metrics.jsonl's
``comm_by_purpose``): on two gloo ranks whose peer arrives late by a known delay, the time a
purpose held the waiting rank covers that delay, whether the call blocks, is asynchronous and
waited on later (in another block: the wait counts where it happens), or runs coalesced at a
``_coalescing_manager``'s exit as megatron-core's bucketed gradient sync does (or, overlapped,
at the wait on the manager's handle); calls and bytes
by purpose add up to the meter's totals; a meter without ``time_purposes`` walks no frames and
keeps no purposes (and never looks for one)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from parallel import comm_meter as cm
from parallel.comm_purpose import collective_purpose
from tests.spawn import run_ranks

LATE_S = 0.3  # how late rank 1 arrives at each collective
N = 1000  # floats in the test tensors


@collective_purpose("probe_sum")
def _blocking_sum(x: torch.Tensor) -> None:
    dist.all_reduce(x)


@collective_purpose("probe_{op}")
def _issue_receive(buffer: torch.Tensor):
    return dist.irecv(buffer, src=1)


@collective_purpose("probe_coalesced_{op}")
def _coalesced_reduce_scatter(out: torch.Tensor, x: torch.Tensor) -> None:
    with dist._coalescing_manager(None):
        dist.reduce_scatter_tensor(out, x)


@collective_purpose("probe_overlapped_{op}")
def _coalesced_all_reduce_async(x: torch.Tensor):
    """As megatron-core's overlapped gradient sync: issued coalesced and asynchronous, its
    handle (the coalescing manager) waited on later."""
    with dist._coalescing_manager(None, async_ops=True) as handle:
        dist.all_reduce(x, async_op=True)
    return handle


def _no_frame_walk(*_, **__):
    raise AssertionError("a meter without time_purposes walked the calling frames")


def _late(rank: int) -> None:
    if rank == 1:
        time.sleep(LATE_S)


def _timed_ranks(rank: int, world_size: int) -> dict:
    out: dict = {}
    x = torch.ones(N)

    meter = cm.CommMeter(time_purposes="cpu")
    with meter.measure():
        _late(rank)
        _blocking_sum(x)
    out["blocking"] = meter.summary()

    # Rank 0 issues a receive in one block and waits on it in the next: the wait holds it.
    issued, waited = cm.CommMeter(time_purposes="cpu"), cm.CommMeter(time_purposes="cpu")
    buffer = torch.empty(N)
    with issued.measure():
        work = _issue_receive(buffer) if rank == 0 else None
    if rank == 1:
        time.sleep(LATE_S)
        dist.send(torch.ones(N), dst=0)
    with waited.measure():
        if work is not None:
            work.wait()
    out["issued"], out["waited"] = issued.summary(), waited.summary()

    meter = cm.CommMeter(time_purposes="cpu")
    with meter.measure():
        _late(rank)
        _coalesced_reduce_scatter(torch.empty(N // 2), x)
    out["coalesced"] = meter.summary()

    # Issued coalesced and asynchronous in one block (rank 1 late to issue), waited on in
    # the next.
    issued, waited = cm.CommMeter(time_purposes="cpu"), cm.CommMeter(time_purposes="cpu")
    _late(rank)
    with issued.measure():
        handle = _coalesced_all_reduce_async(torch.ones(N))
    with waited.measure():
        handle.wait()
    out["overlapped_issued"], out["overlapped_waited"] = issued.summary(), waited.summary()

    untimed = cm.CommMeter()
    walk, cm.purpose_of = cm.purpose_of, _no_frame_walk
    try:
        with untimed.measure():
            _blocking_sum(x)
    finally:
        cm.purpose_of = walk
    out["untimed"] = untimed.summary()
    return out


def test_the_time_a_purpose_held_the_rank_covers_its_late_peer():
    ranks = run_ranks(2, _timed_ranks, mcore=False)
    early = ranks[0]
    # blocking: rank 0 waited for rank 1's delay inside the all-reduce
    assert early["blocking"]["by_purpose"].keys() == {"probe_sum"}
    held = early["blocking"]["by_purpose"]["probe_sum"]
    assert held["calls"] == 1
    assert held["bytes"] == early["blocking"]["bytes"] == 2 * (2 - 1) * N * 4 // 2
    assert held["ms"] >= 0.8 * 1000 * LATE_S, held
    assert ranks[1]["blocking"]["by_purpose"]["probe_sum"]["ms"] < 0.5 * 1000 * LATE_S
    # asynchronous: issuing is quick, the wait (in the later block) holds the rank
    issued = early["issued"]["by_purpose"]["probe_recv"]
    assert issued["calls"] == 1 and issued["ms"] < 0.5 * 1000 * LATE_S, issued
    assert early["waited"]["calls"] == 0  # nothing issued in the waiting block ...
    waited = early["waited"]["by_purpose"]["probe_recv"]
    assert waited["calls"] == 0 and waited["ms"] >= 0.8 * 1000 * LATE_S, waited  # ... held there
    # coalesced: the batch runs at the manager's exit, timed under its calls' purpose
    coalesced = early["coalesced"]["by_purpose"]["probe_coalesced_reduce_scatter"]
    assert coalesced["calls"] == 1 and coalesced["bytes"] == N * 4 // 2
    assert 0.8 * 1000 * LATE_S <= coalesced["ms"] < 1.5 * 1000 * LATE_S, coalesced  # once
    # coalesced and asynchronous (megatron-core's overlapped sync): the wait holds the rank
    issued = early["overlapped_issued"]["by_purpose"]["probe_overlapped_all_reduce"]
    assert issued["calls"] == 1 and issued["ms"] < 0.5 * 1000 * LATE_S, issued
    waited = early["overlapped_waited"]["by_purpose"]["probe_overlapped_all_reduce"]
    assert waited["calls"] == 0 and waited["ms"] >= 0.8 * 1000 * LATE_S, waited
    for rank in ranks:
        for block in ("blocking", "issued", "coalesced"):
            summary = rank[block]
            assert sum(p["calls"] for p in summary["by_purpose"].values()) == summary["calls"]
            assert sum(p["bytes"] for p in summary["by_purpose"].values()) == summary["bytes"]
        assert rank["untimed"]["calls"] == 1 and rank["untimed"]["by_purpose"] == {}
