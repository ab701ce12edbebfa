"""Deferred weight gradients (parallel/deferred_wgrad.py): the GEMM itself against megatron-core's
and torch's, the queue's timing, the layout rules, and parity of whole pipeline runs against
one process, with the runs' own metrics showing that the weight-gradient GEMMs were deferred
and ran inside the p2p exchanges."""

from __future__ import annotations

import pytest
import torch

from glm5_train.job_config import compose_job
from parallel.deferred_wgrad import FIGURE_NAMES, WeightGradQueue, install
from parallel.layout import LayoutError
from tests.parity import BASE_OVERRIDES, assert_layout_ran, compare, one_process, run_job

BATCH = ["train.global_batch_size=16"]


# ---- the GEMM, in one process ----------------------------------------------------------------


def _linear_pair(kind: str):
    """(reference, deferred) copies of one layer with the same weights; the deferred one
    switched over to ``queue``."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               use_cpu_initialization=True, perform_initialization=True)
    def build():
        torch.manual_seed(0)
        if kind == "column":
            return ColumnParallelLinear(16, 24, config=config, init_method=torch.nn.init.normal_,
                                        bias=True, gather_output=False)
        if kind == "row":
            return RowParallelLinear(24, 16, config=config, init_method=torch.nn.init.normal_,
                                     bias=False, input_is_parallel=True, skip_bias_add=False)
        return torch.nn.Linear(16, 24, bias=True)
    return build(), build()


def _out(module, x):
    out = module(x)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("kind", ["column", "row", "torch"])
def test_deferred_gemm_gives_the_same_gradients_once_the_queue_runs(kind, single_group):
    reference, deferred = _linear_pair(kind)
    queue = WeightGradQueue()
    assert install([deferred], queue) == 1
    width = reference.weight.shape[1]
    x = torch.randn(5, 3, width, generator=torch.Generator().manual_seed(1))
    x_ref, x_def = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(_out(reference, x).shape, generator=torch.Generator().manual_seed(2))
    _out(reference, x_ref).backward(grad)
    _out(deferred, x_def).backward(grad)
    # B ran: the input (and bias) gradients are there, bit for bit; W waits in the queue.
    assert torch.equal(x_def.grad, x_ref.grad)
    if reference.bias is not None:
        assert torch.equal(deferred.bias.grad, reference.bias.grad)
    assert deferred.weight.grad is None and len(queue.pending) == 1 and queue.deferred == 1
    assert queue.held_bytes == x.numel() * 4 + grad.numel() * 4  # input + output gradient
    queue.run()
    assert torch.equal(deferred.weight.grad, reference.weight.grad)
    assert queue.held_bytes == 0 and queue.peak_bytes == x.numel() * 4 + grad.numel() * 4


def test_queue_refuses_a_new_step_with_gemms_left_over(single_group):
    _, layer = _linear_pair("torch")
    queue = WeightGradQueue()
    install([layer], queue)
    layer(torch.randn(2, 16)).sum().backward()
    with pytest.raises(RuntimeError, match="never ran"):
        queue.begin_step()


@pytest.fixture
def single_group():
    from parallel import mcore_compat, process_groups

    mcore_compat.install()
    with process_groups.single_process_group():
        yield


# ---- the rules -------------------------------------------------------------------------------


def _validate(overrides: list[str], world: int, monkeypatch):
    from glm5_train.assembly import validate_job

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    return validate_job(compose_job([*BASE_OVERRIDES, *overrides]))


def test_without_a_pipeline_deferral_is_refused(monkeypatch):
    with pytest.raises(LayoutError, match=r"pipeline_model_parallel_size=1.*set "
                                          r"pipeline_model_parallel_size > 1"):
        _validate(["parallel=single", "parallel.defer_weight_grads=true"], 1, monkeypatch)


def test_with_overlapped_gradient_reduction_deferral_is_refused(monkeypatch):
    with pytest.raises(LayoutError, match="overlap_grad_reduce=false"):
        _validate(["parallel=pp2", "parallel.defer_weight_grads=true",
                   "parallel.overlap_grad_reduce=true"], 2, monkeypatch)


def test_with_transformer_engine_deferral_is_refused(monkeypatch):
    from glm5_train import assembly

    monkeypatch.setattr(assembly, "transformer_engine_available", lambda: True)
    with pytest.raises(ValueError, match="Transformer Engine"):
        _validate(["parallel=pp2", "parallel.defer_weight_grads=true"], 2, monkeypatch)


# ---- whole runs ------------------------------------------------------------------------------


def _assert_deferred_in_p2p(record: dict, ranks: int) -> None:
    """Every rank deferred weight-gradient GEMMs, ran some inside p2p exchanges, and held
    bytes for them (the run's own figures)."""
    assert set(FIGURE_NAMES) <= set(record)
    deferred, in_p2p, peak = (record[n] for n in FIGURE_NAMES[:3])
    assert len(deferred) == ranks and all(d > 0 for d in deferred), deferred
    assert all(0 < p <= d for p, d in zip(in_p2p, deferred)), (in_p2p, deferred)
    assert all(b > 0 for b in peak), peak


def _matches_one_process(nprocs: int, overrides: list[str], run_dir: str):
    """Run the layout, compare it with one process, prove from its metrics that the layout
    ran with deferral on every rank; the run's result."""
    result = run_job(nprocs, overrides, run_dir)
    problems = compare(one_process(["parallel=single", *BATCH]).records, result.records)
    assert not problems, "\n".join(problems)
    assert_layout_ran(result, nprocs, overrides)
    for record in result.records:
        _assert_deferred_in_p2p(record, nprocs)
    return result


def test_pipeline_with_deferred_weight_gradients_matches_one_process(tmp_path):
    """PP2, MTP with the loss (both stages hold decoder layers)."""
    overrides = ["parallel=pp2", "parallel.mtp_placement=with_loss", *BATCH,
                 "parallel.defer_weight_grads=true"]
    result = _matches_one_process(2, overrides, str(tmp_path / "pp2"))
    # The last stage's backward ends in a send each time: all its W GEMMs fill p2p waits.
    assert all(r["wgrad_run_in_p2p"][1] == r["wgrad_deferred"][1] for r in result.records)


def test_interleaved_zero2_with_sequence_parallel_and_deferral_matches_one_process(tmp_path):
    """TP2 + SP x PP2 x VPP2 x EP2 x DP2, distributed optimizer and Pipeline ZeRO2: W under
    sequence parallelism gathers its input itself, and each chunk's reduce-scatter waits for
    its W GEMMs."""
    overrides = ["parallel=tp2_pp2_vpp2_ep2_dp2", *BATCH,
                 "parallel.use_distributed_optimizer=true", "parallel.pipeline_zero2=true",
                 "parallel.defer_weight_grads=true"]
    _matches_one_process(8, overrides, str(tmp_path / "zero2"))
