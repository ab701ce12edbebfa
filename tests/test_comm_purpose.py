"""What a traced collective is for (parallel/comm_purpose.py): the innermost registered function
on the stack names it, an autograd backward before any gives ``<op>_backward``, nothing gives
the op kind; the group's family prefixes it, except where a registration fixes the family (the
pipeline's messages). Every megatron-core function registered exists in the installed release
(or is one a supported release lacks), and every function of glm5_train/ and parallel/ that
calls torch.distributed itself is registered or is a helper whose callers are. The names in
real traces are checked by tests/test_profiling.py."""

from __future__ import annotations

import ast
import os
import re

import torch

from parallel import comm_purpose
from parallel.comm_purpose import collective_purpose, group_family, parse_range, purpose_of


def test_every_registered_megatron_function_exists():
    assert set(comm_purpose.register_megatron()) <= comm_purpose.VERSION_SPECIFIC


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIVE_CALL = re.compile(
    r"(?:torch\.distributed|\bdist)\.(all_reduce|all_gather|reduce_scatter|all_to_all|broadcast|"
    r"isend|irecv|send|recv|all_gather_into_tensor|reduce_scatter_tensor|all_to_all_single|"
    r"all_gather_object|broadcast_object_list|barrier|gather_object|scatter_object_list|gather|"
    r"scatter|batch_isend_irecv|monitored_barrier)\(")
# Functions that call torch.distributed but are named by their callers (path, function): why.
NAMED_BY_CALLERS = {
    ("parallel/deferred_wgrad.py", "_gather_sequence"): "the forward's SP gather (tp_all_gather) "
                                                        "or the deferred GEMM's (registered)",
    ("parallel/deferred_wgrad.py", "backward"): "an autograd backward: <op>_backward",
    ("parallel/context_parallel.py", "_all_gather_rows"): "its two callers are registered",
    ("parallel/distributed_muon.py", "all_gather_uneven"): "its two callers are registered",
    ("parallel/device.py", "all_to_all_single"): "gloo stand-ins for megatron-core's calls",
    ("parallel/device.py", "all_gather"): "gloo stand-ins for megatron-core's calls",
    ("parallel/device.py", "reduce_scatter"): "gloo stand-ins for megatron-core's calls",
    ("parallel/device.py", "communicate_sends_first"): "megatron-core's pipeline p2p: pp_*",
    ("parallel/device.py", "receive_shape"): "megatron-core's pipeline p2p: pp_*",
}


def _unregistered_callers() -> set[tuple[str, str]]:
    found = set()
    for package in ("glm5_train", "parallel"):
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in (f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as handle:
                    source = handle.read()
                functions = [n for n in ast.walk(ast.parse(source))
                             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                for number, line in enumerate(source.splitlines(), 1):
                    if line.lstrip().startswith("#") or not COLLECTIVE_CALL.search(line):
                        continue
                    around = [f for f in functions if f.lineno <= number <= f.end_lineno]
                    inner = min(around, key=lambda f: f.end_lineno - f.lineno, default=None)
                    if inner is None or not any(ast.unparse(d).startswith("collective_purpose")
                                                for d in inner.decorator_list):
                        found.add((os.path.relpath(path, REPO),
                                   inner.name if inner else "<module>"))
    return found


def test_every_function_calling_torch_distributed_is_named():
    assert _unregistered_callers() == set(NAMED_BY_CALLERS)


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
                                      "expt_tp", "tp_ep", "ep", "cp", "pp", "mp", "tp_ep_pp",
                                      "embd", "world", "size4")] == [
        "dp", "dp", "dp", "dp", "tp", "tp", "tp", "ep", "cp", "pp", "mp", "mp", "pp", "world",
        "size4"]


def test_a_recomputed_forward_is_named_as_recompute_not_backward(monkeypatch):
    """megatron-core's full recompute runs the forward again inside CheckpointFunction's
    backward: its collectives are the forward's, run again. (Its CUDA RNG bookkeeping is
    switched off for this test: no random op runs in it.)"""
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.tensor_parallel.random import CheckpointFunction

    monkeypatch.setattr(mcore_random, "_get_all_rng_states", lambda: ())
    monkeypatch.setattr(mcore_random, "_set_all_rng_states", lambda *states: None)

    seen = []

    def layer(x):
        seen.append(_unregistered("all_gather", "tp"))
        return x * 2

    x = torch.ones(2, requires_grad=True)
    CheckpointFunction.apply(layer, False, x).sum().backward()
    assert seen == ["tp_all_gather", "tp_all_gather_recompute"]


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
