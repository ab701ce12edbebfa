"""What a collective is for, for profiler traces and metrics.jsonl's ``comm_by_purpose``:
``dp_grad_reduce_scatter``, ``pp_send``, ``ep_dispatch``, ``cp_all_gather``.

A traced collective's range (``parallel.comm_meter``) is named
``<purpose> <group>.<function>:<group size>``, e.g.
``dp_grad_reduce_scatter dp_cp.reduce_scatter_tensor:2``. The purpose is
``<family>_<what>``:

- ``<family>``: the group's kind (``group_family``): dp (dp, dp_cp, the expert-data-parallel
  groups), tp (tp, expt_tp, tp_ep), ep, cp, pp, mp (model-parallel: the loss, the gradient
  norm), world, or ``size<n>`` for a group megatron-core does not name; the pipeline's
  messages are pp and MTP's label shift across context-parallel shards cp, whatever their
  group (megatron-core sends them on the global group: at PP=2 one pipeline direction);
- ``<what>``: the function that made the call, found by walking the calling frames from the
  innermost out to the first function registered here (``purpose_of``). Registered:
  megatron-core's gradient and parameter synchronisation, finalize's all-reduces, the MoE
  token dispatcher's dispatch and combine, the gradient norm; and every function of this
  repository that issues its own collectives, at its definition (``@collective_purpose``:
  registration only, the function itself is not wrapped). ``{op}`` in a registered name is
  the call's op kind (``grad_{op}``: ``grad_reduce_scatter`` or ``grad_all_reduce``).
  An autograd function's ``backward`` met before any registered function gives
  ``<op>_backward`` (e.g. the reverse all-to-all of the expert tokens' gradients,
  ``ep_all_to_all_backward``: the frames outside a backward are whatever started the backward
  pass); no registered function at all gives the op kind (``tp_all_gather``: a
  sequence-parallel gather).

The frames are walked only while torch.profiler records (a traced step) or a meter times
collectives by purpose (``CommMeter(time_purposes=...)``; the training loop's, on by default:
``train.log_comm_by_purpose``): about 44 µs a call on this repository's 2-core CPU machine.
Registration is by code object, so two functions of the same name never mix.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

# A traced collective's range, this module's form and the one before purposes were named
# (``<group>.<function>:<size>``, ``<function>:<size>``).
RANGE = re.compile(r"(?:(?P<purpose>[a-z0-9_]+) )?(?:(?P<group>[a-z0-9_]+)\.)?"
                   r"(?P<function>[a-z_]+):(?P<size>\d+)$")

_BY_CODE: dict[object, tuple[str, str | None]] = {}  # code -> (what, family it fixes)
_MEGATRON_REGISTERED = False
_MISSING: list[str] = []  # MEGATRON_PURPOSES names this release lacks
_DEEPEST = 80  # frames walked at most: a collective is never this far below its purpose

# megatron-core's functions that issue collectives for one purpose: (module, qualified name,
# what[, the family it fixes whatever the group]). A name a release lacks is skipped
# (``VERSION_SPECIFIC``; tests/test_comm_purpose.py checks the rest resolve).
MEGATRON_PURPOSES: tuple[tuple[str, ...], ...] = (
    # the pipeline's messages: at PP=2 one direction travels on the global group (megatron-
    # core's deadlock guard), so the family is fixed to pp
    ("megatron.core.pipeline_parallel.p2p_communication", "_p2p_ops", "{op}", "pp"),
    ("megatron.core.pipeline_parallel.p2p_communication", "_batched_p2p_ops", "{op}", "pp"),
    ("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup.start_grad_sync",
     "grad_{op}"),
    ("megatron.core.distributed.param_and_grad_buffer",
     "_ParamAndGradBucketGroup.start_param_sync", "param_all_gather"),
    ("megatron.core.distributed.finalize_model_grads", "finalize_model_grads", "token_count"),
    # what finalize_model_grads calls besides, in releases that have it (0.19)
    ("megatron.core.distributed.finalize_model_grads", "_allreduce_router_grads",
     "router_grad_all_reduce"),
    ("megatron.core.distributed.finalize_model_grads", "_update_router_qb_beta",
     "router_balance"),
    ("megatron.core.distributed.finalize_model_grads",
     "_allreduce_replicated_grads_over_gtp_remat_group", "replicated_grad_all_reduce"),
    ("megatron.core.distributed.finalize_model_grads",
     "_allreduce_non_tensor_model_parallel_grads", "replicated_grad_all_reduce"),
    ("megatron.core.distributed.finalize_model_grads", "_allreduce_layernorm_grads",
     "replicated_grad_all_reduce"),
    ("megatron.core.distributed.finalize_model_grads", "_allreduce_word_embedding_grads",
     "embedding_grad_all_reduce"),
    ("megatron.core.distributed.finalize_model_grads", "_allreduce_embedding_grad",
     "embedding_grad_all_reduce"),
    ("megatron.core.distributed.finalize_model_grads", "_allreduce_position_embedding_grads",
     "embedding_grad_all_reduce"),
    ("megatron.core.distributed.finalize_model_grads", "_allreduce_conditional_embedding_grads",
     "embedding_grad_all_reduce"),
    ("megatron.core.transformer.moe.moe_utils", "get_updated_expert_bias", "expert_bias_tokens"),
    # MTP's label shift across context-parallel shards (on the global group: the family is
    # fixed to cp)
    ("megatron.core.transformer.multi_token_prediction", "roll_tensor", "mtp_roll_{op}", "cp"),
    ("megatron.core.transformer.multi_token_prediction", "_roll_tensor_packed_seq",
     "mtp_roll_{op}", "cp"),
    ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32", "grad_norm"),
    # recompute: a checkpointed forward run again inside the backward pass
    ("megatron.core.tensor_parallel.random", "CheckpointFunction.backward", "{op}_recompute"),
    ("megatron.core.tensor_parallel.random", "CheckpointWithoutOutputFunction.backward",
     "{op}_recompute"),
    ("megatron.core.optimizer.clip_grads", "count_zeros_fp32", "count_zeros"),
    ("megatron.core.optimizer.optimizer",
     "MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan", "found_inf"),
    ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher.preprocess",
     "dispatch_counts"),
    ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher.token_dispatch",
     "dispatch"),
    ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher.token_combine",
     "combine"),
    ("megatron.core.transformer.moe.token_dispatcher",
     "MoEAllGatherTokenDispatcher.token_dispatch", "dispatch"),
    ("megatron.core.transformer.moe.token_dispatcher",
     "MoEAllGatherTokenDispatcher.token_combine", "combine"),
)


# Registered names some supported megatron-core release lacks (``register_megatron`` skips them).
VERSION_SPECIFIC = frozenset({
    "megatron.core.distributed.finalize_model_grads._allreduce_router_grads",
    "megatron.core.distributed.finalize_model_grads._update_router_qb_beta",
    "megatron.core.distributed.finalize_model_grads._allreduce_replicated_grads_over_gtp_remat_group",
})


def collective_purpose(what: str, family: str | None = None) -> Callable[[F], F]:
    """Register the decorated function's collectives as ``what`` (``{op}``: the op kind), of
    ``family`` whatever their group (None: the group's). The function is returned
    unchanged."""
    def register(fn: F) -> F:
        _BY_CODE[_code_of(fn)] = (what, family)
        return fn
    return register


def _code_of(fn) -> object:
    inner = getattr(fn, "__func__", fn)  # a bound or static method's function
    while hasattr(inner, "__wrapped__"):
        inner = inner.__wrapped__
    return inner.__code__


def _resolve(module: str, qualified: str):
    try:
        target = importlib.import_module(module)
    except Exception:  # noqa: BLE001 -- a module that fails to import names nothing here
        return None
    for part in qualified.split("."):
        target = getattr(target, part, None)
        if target is None:
            return None
    return target


def register_megatron() -> list[str]:
    """Register ``MEGATRON_PURPOSES`` (once); the qualified names this release lacks."""
    global _MEGATRON_REGISTERED
    if _MEGATRON_REGISTERED:
        return list(_MISSING)
    missing = []
    for module, qualified, what, *family in MEGATRON_PURPOSES:
        fn = _resolve(module, qualified)
        if fn is None:
            missing.append(f"{module}.{qualified}")
            continue
        _BY_CODE[_code_of(fn)] = (what, family[0] if family else None)
    _MEGATRON_REGISTERED = True
    _MISSING[:] = missing
    return missing


def parse_range(name: str) -> re.Match | None:
    """A trace range's name parsed as a collective's (groups ``purpose``, ``group``,
    ``function``, ``size``; the first two may be None), or None for any other range."""
    return RANGE.match(name)


def host_range(event: dict) -> bool:
    """A trace event that is a complete range recorded on the host. A CUDA trace repeats each
    labelled range on the device's timeline (category ``gpu_user_annotation``): counted or
    drawn once, from the host's."""
    return event.get("ph") == "X" and event.get("cat") != "gpu_user_annotation"


# megatron-core's group names (``comm_meter.GROUP_FIELDS``) -> family, where the name is not
# the family itself
FAMILY_OF_GROUP = {
    "dp": "dp", "dp_cp": "dp", "expt_dp": "dp", "intra_dp_cp": "dp", "intra_expt_dp": "dp",
    "inter_dist_opt": "dp", "tp_dp_cp": "dp", "tp_dp": "dp",
    "tp": "tp", "expt_tp": "tp", "tp_ep": "tp", "tp_cp": "tp",
    "mp": "mp", "tp_ep_pp": "mp", "tp_pp": "mp",  # model-parallel: the loss, the grad norm
    "embd": "pp", "pos_embd": "pp",  # the embedding copies over pipeline stages
}


def group_family(group_name: str) -> str:
    """The kind of one of megatron-core's groups, by its name: dp, tp, mp, pp, ep, cp (the
    head-parallel CP groups too), world, or the name itself (``size<n>``)."""
    if group_name in FAMILY_OF_GROUP:
        return FAMILY_OF_GROUP[group_name]
    if group_name.startswith(("dp", "expt_dp", "intra_dp", "intra_expt_dp")):
        return "dp"
    if group_name.startswith(("hcp", "cp")):
        return "cp"
    return group_name


def purpose_of(op: str, group_name: str | None, skip: int = 1) -> str:
    """``<family>_<what>`` of a collective of kind ``op`` on ``group_name`` (None: no name
    known, ``<what>`` alone), from the calling frames (``skip``: frames of the caller's own to
    pass over)."""
    if not _MEGATRON_REGISTERED:
        register_megatron()
    what, family = _what(op, sys._getframe(skip + 1))
    family = family or (group_family(group_name) if group_name else None)
    return f"{family}_{what}" if family else what


def _what(op: str, frame) -> tuple[str, str | None]:
    for _ in range(_DEEPEST):
        if frame is None:
            break
        registered = _BY_CODE.get(frame.f_code)
        if registered is not None:
            return registered[0].format(op=op), registered[1]
        # An autograd function's backward (its first argument is the context): the frames
        # outside it are whatever started the backward pass, not this call's purpose.
        # (A forward's, and a recomputed forward's, frames are walked on: recompute is named
        # by megatron-core's checkpoint backward, registered.)
        if frame.f_code.co_name == "backward" and frame.f_code.co_varnames[:1] == ("ctx",):
            return f"{op}_backward", None
        frame = frame.f_back
    return op, None
