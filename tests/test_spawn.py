"""tests/spawn.py itself: results come back in rank order over a real gloo group, a failing
rank's traceback (file, line, source) reaches the test, a hung rank is named with its stack;
and tests/parity.py's run_script reports the code its failing rank exited with."""

from __future__ import annotations

import inspect
import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.spawn import RankFailed, RanksTimedOut, run_ranks


def _rank_sum(rank: int, world_size: int, scale: float) -> tuple:
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)  # a real collective over the group run_ranks made
    return rank, world_size, scale * value, torch.get_num_threads()


def test_results_come_back_in_rank_order():
    results = run_ranks(3, _rank_sum, 2.0, mcore=False)
    total = 2.0 * (1 + 2 + 3)
    assert [(r, w, float(t)) for r, w, t, _ in results] == [(0, 3, total), (1, 3, total),
                                                             (2, 3, total)]
    assert all(threads == 1 for *_, threads in results)  # OMP_NUM_THREADS=1 per rank


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one's own failure")
    dist.barrier()  # rank 0 waits in a collective rank 1 never joins: it must be killed


def test_a_failing_rank_shows_its_traceback_and_the_others_are_stopped():
    started = time.monotonic()
    with pytest.raises(RankFailed) as caught:
        run_ranks(2, _fail_on_rank_one, mcore=False, timeout=60)
    message = str(caught.value)
    source, first = inspect.getsourcelines(_fail_on_rank_one)
    line = first + next(i for i, text in enumerate(source) if "raise ValueError" in text)
    assert caught.value.rank == 1
    assert "rank 1 of 2 raised in tests.test_spawn._fail_on_rank_one" in message
    assert f'test_spawn.py", line {line}, in _fail_on_rank_one' in message
    assert 'raise ValueError("rank one\'s own failure")' in message
    assert "ValueError: rank one's own failure" in message
    assert time.monotonic() - started < 30  # not the 60 s timeout: rank 0 was killed


def _hang_on_rank_zero(rank: int, world_size: int) -> int:
    if rank == 0:
        time.sleep(600)
    return rank


def test_a_hung_rank_times_out_naming_it_with_its_stack():
    with pytest.raises(RanksTimedOut) as caught:
        run_ranks(2, _hang_on_rank_zero, mcore=False, timeout=1.5)
    assert caught.value.ranks == [0]
    message = str(caught.value)
    assert "ranks [0] of 2 did not finish tests.test_spawn._hang_on_rank_zero" in message
    assert "in _hang_on_rank_zero" in message  # the faulthandler stack of the hung rank


def _exit_without_result(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)


def test_a_rank_dying_without_an_exception_is_reported():
    with pytest.raises(RankFailed, match="rank 1 of 2 died .* exit code 3"):
        run_ranks(2, _exit_without_result, mcore=False)


def test_arguments_the_workers_cannot_use_are_refused():
    with pytest.raises(ValueError, match="world_size=0 must be >= 1"):
        run_ranks(0, _rank_sum, 1.0)
    with pytest.raises(ValueError, match="<lambda> is not a module-level function"):
        run_ranks(2, lambda rank, world_size: rank)


def test_a_script_run_reports_the_code_its_failing_rank_exited_with(tmp_path):
    """tests/parity.py's run_script: rank 1 refuses at once with 1 while rank 0 is still
    busy; rank 0 is stopped (SIGTERM), and the run reports 1, not rank 0's -15 (under load a
    second rank refusing the same input can be stopped before its own exit)."""
    from tests.parity import run_script

    script = tmp_path / "refuse.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    print('refused: bad input', flush=True)\n"
                      "    sys.exit(1)\n"
                      "time.sleep(60)\n")
    started = time.monotonic()
    proc = run_script(2, str(script), [], timeout=120)
    assert proc.returncode == 1, proc.stdout
    assert "refused: bad input" in proc.stdout
    assert time.monotonic() - started < 40  # stopped, not waited for
