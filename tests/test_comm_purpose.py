"""What a traced collective is for (parallel/comm_purpose.py): the innermost registered function
on the stack names it, an autograd backward before any gives ``<op>_backward``, nothing gives
the op kind; the group's family prefixes it, except where a registration fixes the family (the
pipeline's messages). Every megatron-core function registered exists in the installed release.
The names in real traces are checked by tests/test_profiling.py."""

from __future__ import annotations

import torch

from parallel import comm_purpose
from parallel.comm_purpose import collective_purpose, group_family, parse_range, purpose_of


def test_every_registered_megatron_function_exists():
    assert comm_purpose.register_megatron() == []


@collective_purpose("grad_{op}")
def _reduce_gradients(op: str, group: str | None) -> str:
    return purpose_of(op, group, skip=0)


@collective_purpose("outer")
def _outer(op: str, group: str) -> str:
    return _reduce_gradients(op, group)


@collective_purpose("{op}", family="pp")
def _pipeline_message(op: str, group: str) -> str:
    return purpose_of(op, group, skip=0)


def _unregistered(op: str, group: str) -> str:
    return purpose_of(op, group, skip=0)


def test_the_innermost_registered_function_names_the_purpose():
    assert _reduce_gradients("reduce_scatter", "dp_cp") == "dp_grad_reduce_scatter"
    assert _outer("all_reduce", "expt_dp") == "dp_grad_all_reduce"  # the inner one wins
    assert _reduce_gradients("all_reduce", None) == "grad_all_reduce"  # no group name known
    assert _unregistered("all_gather", "tp") == "tp_all_gather"
    # at PP=2 megatron-core sends one direction on the global group: still the pipeline's
    assert _pipeline_message("send", "world") == "pp_send"


class _Exchange(torch.autograd.Function):
    seen: list[str] = []

    @staticmethod
    def forward(ctx, x):
        _Exchange.seen.append(_unregistered("all_to_all", "ep"))
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _Exchange.seen.append(_unregistered("all_to_all", "ep"))
        return grad * 2


def test_an_autograd_backward_names_its_calls_backward_whatever_started_the_pass():
    _Exchange.seen.clear()
    y = _Exchange.apply(torch.ones(2, requires_grad=True))
    _start_backward(y)  # a registered function starts the backward pass: not the purpose
    assert _Exchange.seen == ["ep_all_to_all", "ep_all_to_all_backward"]


@collective_purpose("loss")
def _start_backward(y: torch.Tensor) -> None:
    y.sum().backward()


def test_group_families():
    assert [group_family(g) for g in ("dp_cp", "expt_dp", "tp_dp_cp", "intra_dp_cp", "tp",
                                      "expt_tp", "tp_ep", "ep", "cp", "pp", "mp", "world",
                                      "size4")] == [
        "dp", "dp", "dp", "dp", "tp", "tp", "tp", "ep", "cp", "pp", "mp", "world", "size4"]


def test_trace_ranges_parse_with_and_without_a_purpose():
    named = parse_range("dp_grad_reduce_scatter dp_cp.reduce_scatter_tensor:4")
    assert (named["purpose"], named["group"], named["function"], named["size"]) == (
        "dp_grad_reduce_scatter", "dp_cp", "reduce_scatter_tensor", "4")
    older = parse_range("pp.isend:2")  # traces written before purposes were named
    assert (older["purpose"], older["group"], older["function"]) == (None, "pp", "isend")
    assert parse_range("isend:2")["function"] == "isend"
    for other in ("forward chunk 0 micro-batch 1", "phase optimizer", "aten::mm",
                  "ProfilerStep#2"):
        assert parse_range(other) is None
