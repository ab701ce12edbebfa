"""Every change this project makes to megatron-core (and to ``torch.cuda``), in one list.

megatron-core 0.16.1 is used as released. Where it cannot run as is (no CUDA, no Transformer
Engine, gloo) or where a technique of ours needs one of its methods to behave differently, the
change is a ``Patch`` in ``PATCHES`` below, with its reason and a staleness check that tests
*behaviour*, not only existence:

- ``redirect``: a module attribute replaced at install, on CPU only (``torch.cuda.*`` entry
  points megatron-core calls, its pipeline p2p on gloo). Check: a megatron-core module on the
  training path still calls it (its source references the attribute).
- ``torch_view``: the module-level name ``torch`` of one megatron-core file replaced by a view
  whose factories move ``device="cuda"`` to the CPU. Check: the file still has such a literal;
  and ``tests/test_device.py`` trains a PP x EP x distributed-optimizer x Muon x ZeRO2 step and
  fails for a view that moved nothing (``hits``).
- ``fix``: a megatron-core bug whenever Transformer Engine is absent (CPU or GPU).
  Check: the bug is still there (the name is still unbound, the flag still lies). The
  distributed optimizer's checkpoint bugs with torch's Adam (``DISTOPT_CHECKPOINT_BUGS``) are
  avoided rather than patched: ``parallel/distopt_checkpoint.py`` never calls those methods.
- ``override``: a method of a megatron-core *object* replaced by one of our techniques at run
  time (``override_method``), or an attribute of it swapped (``replace_attribute``). Check: the
  original's signature and source fingerprint are the ones the replacement was written against.
- ``scoped``: a module attribute replaced for the duration of one call or one measured step
  (the communication meter's wrappers), or set once when unset. Check: the code that needed it
  is the one it was written against.

``install()`` applies the ``redirect``/``torch_view``/``fix`` entries once per process;
``install_host_optimizer()`` the ``HOST_OPTIMIZER_PATCHES`` (redirects applied on any device,
only when a job sets ``parallel.optimizer_cpu_offload``);
``override_method`` and ``replace_attribute`` refuse any target not listed here, and the scoped
changes are made by the functions at the end of this module (the meter's from its own list,
``comm_meter.BOUND_NAMES``, which ``METER_BINDINGS`` lists), so no change to megatron-core
exists outside this list. ``stale_reasons()`` runs every check.
The pitfalls behind the entries are explained in ``docs/megatron_core_notes.md``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import queue
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from parallel import comm_meter, device, host_optimizer
from parallel.mla_down_projection import MLADownProjection

REDIRECT, TORCH_VIEW, FIX, OVERRIDE, SCOPED = "redirect", "torch_view", "fix", "override", "scoped"

# The megatron-core releases the entries were written against and checked on (``Patch.
# written_against``; an entry written for another release says so itself): 0.16.1, and 0.19.2,
# the release GPU images carry (Python >= 3.12). 0.17 and 0.18 were never checked:
# ``entries_not_written_for`` lists what was not checked on a release.
WRITTEN_AGAINST: tuple[str, ...] = ("0.16.1", "0.19.2")
V0_19_2 = "0.19.2"


@dataclass(frozen=True)
class Patch:
    """One change to megatron-core or torch: ``module.attr`` (``attr`` of a class for methods)."""

    module: str
    attr: str
    kind: str
    why: str
    replacement: Any = None
    # redirect: megatron-core modules that must still reference the attribute (``uses``, regex).
    callers: tuple[str, ...] = ()
    uses: str = ""
    # override / scoped: what the original looked like when the replacement was written.
    fingerprint: str = ""
    signature: str = ""
    binds_missing: bool = False  # fix: upstream forgot to bind the name; we bind it
    on_instances: bool = False  # override: an attribute megatron-core sets per object
    written_against: tuple[str, ...] = WRITTEN_AGAINST  # megatron-core releases checked on
    # (release, fingerprint, signature) of the original on another release, re-read there and
    # found to fit the same replacement (``fingerprint`` / ``signature`` are 0.16.1's).
    other_fits: tuple[tuple[str, str, str], ...] = ()
    # Releases where megatron-core itself no longer needs the entry (the bug fixed, the call
    # gone): there it is neither applied nor checked.
    not_needed_on: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attr}"


def is_needed(patch: Patch, version: str | None = None) -> bool:
    """Whether ``patch`` applies on megatron-core ``version`` (default: the installed one)."""
    return (version or megatron_core_version()) not in patch.not_needed_on


def fingerprint_of(fn: Callable) -> tuple[str, str]:
    """(sha256 prefix of the source, signature) of a function or method."""
    fn = getattr(fn, "_torchdynamo_orig_callable", fn)
    source = inspect.getsource(fn)
    return hashlib.sha256(source.encode()).hexdigest()[:16], str(inspect.signature(fn))


# ---------------------------------------------------------------------------------- the list

_MC = "megatron.core"
_P2P = f"{_MC}.pipeline_parallel.p2p_communication"
_TRAINING_PATH = tuple(f"{_MC}.{m}" for m in (
    "tensor_parallel.random", "pipeline_parallel.schedules", "pipeline_parallel.p2p_communication",
    "distributed.param_and_grad_buffer", "distributed.distributed_data_parallel",
    "optimizer.optimizer", "optimizer.distrib_optimizer", "optimizer.clip_grads",
    "transformer.moe.token_dispatcher", "transformer.moe.moe_utils", "transformer.moe.router",
    "timers", "utils", "dist_checkpointing.strategies.torch", "parallel_state"))


def _cuda(attr: str, replacement: Any, why: str, uses: str | None = None,
          **fields: Any) -> Patch:
    return Patch("torch.cuda", attr, REDIRECT, why, replacement, _TRAINING_PATH,
                 uses or rf"cuda\.{attr}\b", **fields)


CPU_REDIRECTS: tuple[Patch, ...] = (
    _cuda("current_device", device.current_device,
          "called thousands of times per run; must return a CPU torch.device"),
    _cuda("_lazy_call", device.lazy_call, "RNG setters queue forever without CUDA",
          r"_lazy_call\("),
    Patch(f"{_MC}.tensor_parallel.random", "_lazy_call", REDIRECT,
          "imported by name from torch.cuda", device.lazy_call,
          (f"{_MC}.tensor_parallel.random",), r"from torch\.cuda import _lazy_call"),
    _cuda("default_generators", device.CpuGenerators(), "the RNG tracker indexes it"),
    _cuda("get_rng_state", device.get_rng_state, "the RNG tracker saves states"),
    Patch("torch.cuda.random", "get_rng_state", REDIRECT, "the RNG tracker saves states",
          device.get_rng_state, _TRAINING_PATH, r"cuda\.get_rng_state\b"),
    _cuda("set_rng_state", device.set_rng_state, "checkpoint RNG restore, RNG tracker",
          r"(cuda\.set_rng_state|_set_cuda_rng_state)\b"),
    _cuda("manual_seed", device.manual_seed, "model_parallel_cuda_manual_seed"),
    Patch("torch.cuda", "manual_seed_all", REDIRECT,
          "torch.manual_seed calls it after seeding the CPU generator", device.manual_seed_all,
          ("torch.random",), r"cuda\.manual_seed_all\("),
    _cuda("synchronize", device.no_op, "timers, optimizer, schedules"),
    _cuda("empty_cache", device.no_op, "called between phases"),
    _cuda("current_stream", device.current_stream, "MoE dispatcher, p2p"),
    _cuda("default_stream", device.current_stream, "pipeline p2p and DDP streams",
          r"default_stream\(", not_needed_on=(V0_19_2,)),  # 0.19: not called on our path
    _cuda("Stream", device.CpuStream, "MoE dispatcher, overlapped grad reduce"),
    _cuda("Event", device.CpuEvent, "timers, overlapped grad reduce"),
    _cuda("stream", device.stream_context, "`with torch.cuda.stream(s):`",
          r"torch\.cuda\.stream\("),
    Patch("torch.Tensor", "cuda", REDIRECT, "literal .cuda() in optimizer / loss trackers",
          device.tensor_cuda, _TRAINING_PATH, r"\.cuda\(\)"),
    Patch("torch.Tensor", "type", REDIRECT,
          "the optimizer whitelists parameters by 'torch.cuda.*Tensor' type names",
          device.tensor_type, (f"{_MC}.optimizer.optimizer", f"{_MC}.optimizer.distrib_optimizer"),
          r"torch\.cuda\.\w+Tensor"),
    Patch(f"{_MC}.transformer.moe.router.TopKRouter", "_apply_expert_bias", REDIRECT,
          "torch.compile'd: an Inductor compile on every CPU process start", device.Uncompiled(),
          fingerprint="f82dbc793f06d124",
          signature="(self, routing_map: torch.Tensor, padding_mask: Optional[torch.Tensor] = None)"),
    Patch(f"{_P2P}.P2PCommunicator", "_communicate", REDIRECT,
          "variable-shape p2p (a standalone MTP stage) deadlocks on gloo: post sends first",
          device.communicate_sends_first, fingerprint="a902480caa75a260",
          signature=("(self, *, tensor_send_next: Optional[torch.Tensor], tensor_send_prev: "
                     "Optional[torch.Tensor], recv_prev: bool, recv_next: bool, tensor_shape: "
                     "Union[List[int], torch.Size], wait_on_reqs: bool = True) -> "
                     "Tuple[torch.Tensor, torch.Tensor]")),
    Patch(f"{_P2P}.P2PCommunicator", "_receive_shape", REDIRECT, "helper of the p2p above",
          device.receive_shape, binds_missing=True),
    Patch(f"{_P2P}.P2PCommunicator", "_recv_buffer", REDIRECT, "helper of the p2p above",
          device.recv_buffer, binds_missing=True),
)

# megatron-core files that create tensors with a literal CUDA device on the training path
# (``device=torch.cuda.current_device()`` is CPU after the redirect and needs nothing). The
# tensor_parallel.mappings view converts the MoE all-to-all's tensor split sizes for gloo, and
# does the uneven all-gather / list reduce-scatter of the expert-TP token dispatch on gloo.
_CUDA_LITERAL = r"""device\s*=\s*["']cuda|torch\.device\(\s*["']cuda"""
TORCH_VIEWS: tuple[Patch, ...] = tuple(
    Patch(f"{_MC}.{module}", "torch", TORCH_VIEW, why, uses=uses) for module, why, uses in (
        ("optimizer.clip_grads", "grad-norm and zero-count buffers", _CUDA_LITERAL),
        ("optimizer.optimizer", "found_inf / loss-scale buffers", _CUDA_LITERAL),
        ("pipeline_parallel.schedules", "the token count of a step", _CUDA_LITERAL),
        ("utils", "the grad-norm all-reduce buffer", _CUDA_LITERAL),
        ("tensor_parallel.mappings", "MoE token dispatch on gloo: all_to_all_single split "
         "sizes as lists, uneven all_gather and list reduce_scatter",
         r"torch\.distributed\.all_to_all_single\("),
    ))

_MLA = f"{_MC}.transformer.multi_latent_attention"
FIXES_WITHOUT_TE: tuple[Patch, ...] = (
    # moe_utils imports te_general_gemm inside a try block and never binds it on ImportError;
    # every router forward then raises NameError. None selects its torch fallback.
    Patch(f"{_MC}.transformer.moe.moe_utils", "te_general_gemm", FIX,
          "unbound without TE: the router forward raises NameError", None, binds_missing=True,
          not_needed_on=(V0_19_2,)),  # 0.19 binds it (None) without TE
    # The TE extension module imports with MagicMock stand-ins, so MLA believes TE exists and
    # an isinstance(..., TELinear) check against a MagicMock raises TypeError.
    Patch(_MLA, "HAVE_TE", FIX, "a MagicMock TELinear breaks isinstance in MLA.__init__", False,
          uses=r"HAVE_TE\s+and isinstance\(self\.linear_proj, TELinear\)"),
    # The local MLA spec's ColumnParallelLinear down projections drop other TP ranks' gradient of
    # the shared RoPE key. MLA accepts only `Linear` (modelopt's, None without TE), TELinear or
    # ColumnParallelLinear there.
    Patch(_MLA, "Linear", FIX, "replicated down projections: correct RoPE-key gradients under TP",
          MLADownProjection, uses=r"\[\s*Linear,"),
)

_BUILD_GROUPS_SIGNATURE = ("(gbuf_ranges: List[Dict], param_gbuf_map: Dict[torch.nn.parameter."
                           "Parameter, Tuple], opt_group_ranges: List, config: megatron.core."
                           "optimizer.optimizer_config.OptimizerConfig)")

# parallel.optimizer_cpu_offload, on any device, applied when a job asks for it
# (``install_host_optimizer``, before the optimizer is built): megatron-core's hybrid optimizer
# under its two names replaced by ours, and the distributed optimizer's fp32 shards made leaves.
HOST_OPTIMIZER_PATCHES: tuple[Patch, ...] = (
    Patch(f"{_MC}.optimizer", "HybridDeviceOptimizer", REDIRECT,
          "parallel.optimizer_cpu_offload: tells device parameters by param.is_cuda, so without "
          "CUDA it fails at its first step", host_optimizer.HostOffloadedOptimizer,
          (f"{_MC}.optimizer",),
          r"HybridDeviceOptimizer\("),
    Patch(f"{_MC}.optimizer.distrib_optimizer", "HybridDeviceOptimizer", REDIRECT,
          "the distributed optimizer rebuilds and type-checks it by this name",
          host_optimizer.HostOffloadedOptimizer, (f"{_MC}.optimizer.distrib_optimizer",),
          r"HybridDeviceOptimizer\("),
    Patch(f"{_MC}.optimizer.distrib_optimizer.DistributedOptimizer",
          "_build_model_and_main_param_groups", REDIRECT,
          "parallel.optimizer_cpu_offload with fp32 parameters: its shards are non-leaf views, "
          "which the hybrid optimizer's torch groups refuse", host_optimizer.leaf_fp32_shards,
          fingerprint="1b9f0ec06718f817", signature=_BUILD_GROUPS_SIGNATURE,
          # 0.19: the shards get more of the parameter's attributes (copy_gtp_attributes,
          # copy_optimizer_param_metadata), which the leaf views copy whole.
          other_fits=((V0_19_2, "3fce9be2b6d1d143", _BUILD_GROUPS_SIGNATURE),)),
)

_OPT = f"{_MC}.optimizer"
_DISTOPT = f"{_OPT}.distrib_optimizer.DistributedOptimizer"


def _avoided(attr: str, why: str, fingerprint: str, signature: str, uses: str,
             fingerprint_0_19: str) -> Patch:
    """``fingerprint_0_19``: the method on 0.19.2, re-read there: the bug (or limit) remains."""
    return Patch(_DISTOPT, attr, FIX, why, callers=(f"{_DISTOPT}.{attr}",), uses=uses,
                 fingerprint=fingerprint, signature=signature,
                 other_fits=((V0_19_2, fingerprint_0_19, signature),))


# The distributed optimizer's checkpoint path with torch's Adam (no Transformer Engine or
# Apex: megatron-core's HAVE_APEX_OR_TE is False). Not patched but avoided: the distributed
# optimizer's state is saved and loaded by parallel/distopt_checkpoint.py, which calls none
# of these. Checks: the method is the one read (fingerprint) and the bug still in it (uses).
DISTOPT_CHECKPOINT_BUGS: tuple[Patch, ...] = (
    _avoided("state_dict", "torch's Adam: asserts that the parameters' states hold exactly one "
             "step; a fresh optimizer has no state yet, so sharded_state_dict(is_loading=True) "
             "fails before any load", "fe621ae6a622b587", "(self)",
             r'steps = list\(set\(\[s\["step"\]\.item\(\) for s in inner_state_dict\["state"\]'
             r'\.values\(\)\]\)\)\s*assert len\(steps\) == 1', "fe621ae6a622b587"),
    _avoided("load_state_dict", "torch's Adam: gives every parameter's state the same step "
             "tensor, which torch's Adam then advances in place once per parameter per step: "
             "after a resume the bias correction counts n_params steps per step",
             "15f257b4c4f9a7ef", "(self, state_dict)",
             r'step = torch\.tensor\(steps\[0\], dtype=torch\.float\)\s*for s in '
             r'state_dict_state\.values\(\):\s*#[^\n]*\s*s\["step"\] = step', "7e5f988b86b48501"),
    _avoided("_set_main_param_and_optimizer_states", "copies every state key of the optimizer, "
             "torch Adam's step included, which the fully_reshardable and model-space loads "
             "leave out of the tensors: KeyError 'step'; and it lacks no_grad, which the "
             "dp_reshardable load does not add (in-place copy into a parameter view raises)",
             "93c254228283b2df", "(self, model_param, tensors)",
             # 0.19 skips non-tensor values, but still indexes tensors[key] for every state key
             r'for key in dst_tensors:\s*(if not isinstance\(tensors\[key\], torch\.Tensor\):'
             r'\s*continue\s*)?dst_tensors\[key\]\.copy_\(tensors\[key\]\)', "40cab784659711a8"),
    _avoided("sharded_param_state_fs_model_space", "the default sharding type (model space) "
             "builds ShardedTensors with flattened_range, which this dist_checkpointing refuses "
             "(ShardedTensor.flattened_range is not supported)", "561fb1277ddb7492",
             "(self, model_sharded_state_dict: Dict[str, Any], is_loading: bool = False, "
             "metadata: Optional[dict] = None)", r"flattened_range=item_slice",
             "561fb1277ddb7492"),
    _avoided("get_parameter_state_dp_zero", "not a bug, a limit: every format but model space "
             "gathers the state through this, whose keys are param / exp_avg / exp_avg_sq only "
             "(0.19: the config's optimizer's keys, Adam's for ours): no place for distributed "
             "Muon's momentum", "812c52ea4568b0ff",
             "(self, use_gloo_comm: bool = True, empty_data: bool = False, "
             "return_on_all_ranks: bool = False)",
             r'for key in \("param", "exp_avg", "exp_avg_sq"\)'
             r'|for key in \("param",\) \+ self\.optimizer_state_keys', "14d11a75ad9ccd8b"),
)

OVERRIDES: tuple[Patch, ...] = (
    Patch(f"{_OPT}.distrib_optimizer.DistributedOptimizer", "_copy_model_grads_to_main_grads",
          OVERRIDE, "Pipeline ZeRO2: the optimizer reads its gradient slices from ZeRO2's "
          "persistent slices (parallel/pipeline_zero2.py), not from full main_grad views",
          fingerprint="ffcdecd38d14405a", signature="(self)",
          other_fits=((V0_19_2, "b14b52f057fb4a96", "(self)"),)),  # 0.19: a comment added
    Patch(f"{_OPT}.distrib_optimizer.DistributedOptimizer", "step_with_ready_grads", OVERRIDE,
          "distributed Muon: megatron's mixed-precision step without its parameter all-gather, "
          "which distributed Muon's owner-aware all-gather replaces (parallel/distributed_muon.py)",
          fingerprint="4883dadbf822eab8", signature="(self) -> bool",
          # 0.19 changed only what the replacement leaves out: which buckets it all-gathers.
          other_fits=((V0_19_2, "2350cce9dd8822dd", "(self) -> bool"),)),
    Patch(f"{_OPT}.optimizer.MegatronOptimizer", "optimizer", OVERRIDE,
          "Muon: the torch optimizer inside megatron's wrappers becomes MuonAdamW / distributed "
          "Muon (parallel/muon.py); megatron calls self.optimizer.step() in its step",
          uses=r"self\.optimizer\.step\(\)", callers=(f"{_OPT}.optimizer",), on_instances=True),
    Patch(f"{_OPT}.optimizer.MegatronOptimizer", "init_state_fn", OVERRIDE,
          "Muon: megatron allocates a fresh optimizer's state through init_state_fn before "
          "loading a checkpoint into it", uses=r"self\.init_state_fn\(",
          callers=(f"{_OPT}.optimizer", f"{_OPT}.distrib_optimizer"), on_instances=True),
    *(Patch(f"{_MC}.tensor_parallel.layers.{cls}", "_forward_impl", OVERRIDE,
            "deferred weight gradients: the layer's GEMM becomes one whose backward queues its "
            "weight-gradient GEMM (parallel/deferred_wgrad.py); forward passes megatron's "
            "linear_with_grad_accumulation_and_async_allreduce arguments by keyword",
            fingerprint="6042a461a2e654e9", signature="(self, input, weight, *args, **kwargs)")
      for cls in ("ColumnParallelLinear", "RowParallelLinear")),
)

_DATA = f"{_MC}.datasets"
SCOPED_PATCHES: tuple[Patch, ...] = (
    Patch("torch.distributed", "get_rank", SCOPED,
          "BlendedDataset._build_indices calls torch.distributed.get_rank() on a cache miss "
          "without checking is_initialized(); a single process without a group is rank 0",
          fingerprint="5823c03a5159d9eb", signature="(self) -> Tuple[numpy.ndarray, numpy.ndarray]",
          callers=(f"{_DATA}.blended_dataset.BlendedDataset._build_indices",),
          uses=r"torch\.distributed\.get_rank\(\)",
          not_needed_on=(V0_19_2,)),  # 0.19 checks is_initialized() first
    Patch(f"{_MC}.dist_checkpointing.strategies.filesystem_async", "_results_queue", SCOPED,
          "the torch_dist writer creates its results queue with a spawned Manager process "
          "(10-15 s per rank, and a __main__ guard); we save synchronously, so a plain queue of "
          "this process carries the results",
          callers=(  # 0.19 renamed the function (the Manager stays)
              f"{_MC}.dist_checkpointing.strategies.filesystem_async._get_write_results_queue",
              f"{_MC}.dist_checkpointing.strategies.filesystem_async.get_write_results_queue"),
          uses=r"_results_queue = ctx\.Manager\(\)\.Queue\(\)"),
)

# The communication meter (parallel/comm_meter.py) wraps, only while it measures, the names to
# which megatron-core binds a torch.distributed collective at import, so that calls through
# them are counted; it restores them when the block ends. Its list is the single source.
METER_BINDINGS: tuple[Patch, ...] = tuple(
    Patch(module, attr, SCOPED, "the communication meter counts the bytes of calls through this "
          "import-time binding of a torch.distributed collective while it measures a step",
          uses=rf"\b{attr}\b") for module, attr in comm_meter.BOUND_NAMES)

PATCHES: tuple[Patch, ...] = (CPU_REDIRECTS + TORCH_VIEWS + FIXES_WITHOUT_TE
                              + HOST_OPTIMIZER_PATCHES + DISTOPT_CHECKPOINT_BUGS + OVERRIDES
                              + SCOPED_PATCHES + METER_BINDINGS)


# ------------------------------------------------------------------------------- staleness


def resolve_owner(dotted: str) -> Any:
    """Import a module by dotted path, or fetch a class (or a function) inside one."""
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError:
        module, _, name = dotted.rpartition(".")
        return getattr(resolve_owner(module), name)


def _source(dotted: str) -> str:
    try:
        return inspect.getsource(resolve_owner(dotted))
    except (TypeError, OSError, AttributeError, ModuleNotFoundError):
        return ""


def stale_reason(patch: Patch) -> str | None:
    """Why ``patch`` no longer fits the installed torch / megatron-core, or None if it fits.
    Installed or not: an installed entry is checked against the original it replaced."""
    try:
        owner = resolve_owner(patch.module)
    except (ModuleNotFoundError, AttributeError) as err:
        return f"{patch.target}: {patch.module} does not resolve ({err})"
    if not is_needed(patch):
        return None
    installed = patch.target in _INSTALLED
    if patch.binds_missing:
        if not installed and hasattr(owner, patch.attr):
            return f"{patch.target} is now bound upstream ({patch.why}): drop the fix"
        return None
    if not installed and not patch.on_instances and not hasattr(owner, patch.attr):
        return f"{patch.target} no longer exists ({patch.why})"
    if patch.fingerprint:
        if patch.callers:
            original = resolve_owner(patch.callers[0])
        else:
            original = _INSTALLED[patch.target] if installed else getattr(owner, patch.attr)
        got = fingerprint_of(original)
        fits = {(patch.fingerprint, patch.signature)} | {(f, s) for _, f, s in patch.other_fits}
        if got not in fits:
            return (f"{patch.target}: the code it was written against changed (fingerprint, "
                    f"signature {got} != {(patch.fingerprint, patch.signature)}); re-read it, "
                    f"check the replacement still fits, then update the entry ({patch.why})")
    if patch.uses:
        where = patch.callers or (patch.module,)
        if not any(re.search(patch.uses, _source(m)) for m in where):
            return (f"{patch.target}: no longer needed? none of {list(where)} matches "
                    f"{patch.uses!r} any more ({patch.why})")
    return None


def stale_reasons(patches: tuple[Patch, ...] = PATCHES) -> list[str]:
    return [reason for p in patches if (reason := stale_reason(p))]


@functools.cache
def megatron_core_version() -> str:
    """The installed megatron-core release (its package metadata; read once per process:
    every entry's check asks)."""
    return importlib.metadata.version("megatron-core")


def entries_not_written_for(version: str | None = None,
                            patches: tuple[Patch, ...] = PATCHES) -> list[Patch]:
    """The entries never checked on megatron-core ``version`` (default: the installed one)."""
    version = version or megatron_core_version()
    return [p for p in patches if version not in p.written_against]


def version_report(version: str | None = None) -> list[str]:
    """One line per entry not written for ``version`` (default: the installed release): its
    target, the releases it was written against and what its staleness check says here."""
    version = version or megatron_core_version()
    return [f"{p.target} ({p.kind}): written against {', '.join(p.written_against)}, "
            f"megatron-core {version} here: {stale_reason(p) or 'staleness check passes'}"
            for p in entries_not_written_for(version)]


def not_needed_report(version: str | None = None) -> list[str]:
    """The entries megatron-core ``version`` no longer needs (neither applied nor checked)."""
    version = version or megatron_core_version()
    return [f"{p.target} ({p.kind}): not needed on megatron-core {version}"
            for p in PATCHES if not is_needed(p, version)]


# --------------------------------------------------------------------------------- install

_INSTALLED: dict[str, Any] = {}  # target -> original value (this process)
VIEWS: dict[str, device.CpuTorch] = {}  # module -> its installed torch view


def transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def install(force_cpu: bool | None = None) -> list[str]:
    """Apply the install-time entries once per process; returns the targets now patched.

    On CPU (no CUDA, or ``force_cpu``): the redirects and torch views; without Transformer Engine
    (CPU or GPU): the fixes. With CUDA and TE nothing is changed at install."""
    on_cpu = (not torch.cuda.is_available()) if force_cpu is None else force_cpu
    todo = [] if transformer_engine_installed() else list(FIXES_WITHOUT_TE)
    if on_cpu:
        todo = list(CPU_REDIRECTS) + list(TORCH_VIEWS) + todo
    for patch in todo:
        _apply(patch)
    return installed()


def installed_patches(force_cpu: bool | None = None) -> list[Patch]:
    """The entries ``install`` applies in this process (for tests and reports)."""
    on_cpu = (not torch.cuda.is_available()) if force_cpu is None else force_cpu
    fixes = [] if transformer_engine_installed() else list(FIXES_WITHOUT_TE)
    return [p for p in (list(CPU_REDIRECTS) + list(TORCH_VIEWS) if on_cpu else []) + fixes
            if is_needed(p)]


def _apply(patch: Patch) -> None:
    if patch.target in _INSTALLED or not is_needed(patch):
        return
    problem = stale_reason(patch)
    if problem:
        raise RuntimeError(f"mcore_compat: {problem}; update parallel/mcore_compat.py")
    owner = resolve_owner(patch.module)
    original = getattr(owner, patch.attr, None)
    replacement = patch.replacement
    if patch.kind == TORCH_VIEW:
        replacement = VIEWS.setdefault(patch.module, device.CpuTorch(
            gloo_all_to_all="all_to_all" in patch.uses))
    elif isinstance(replacement, device.Uncompiled):
        replacement = getattr(original, "_torchdynamo_orig_callable", original)
    _INSTALLED[patch.target] = original
    setattr(owner, patch.attr, replacement)


def install_host_optimizer() -> None:
    """``parallel.optimizer_cpu_offload``: the ``HOST_OPTIMIZER_PATCHES``, on CPU and GPU alike
    (the fp32 and checkpoint fixes they carry are not CPU-specific), once per process."""
    for patch in HOST_OPTIMIZER_PATCHES:
        _apply(patch)


def installed() -> list[str]:
    return sorted(_INSTALLED)


def view_hits() -> dict[str, int]:
    """Calls each installed torch view moved to the CPU so far in this process."""
    return {module: view.redirected for module, view in VIEWS.items()}


# ------------------------------------------------------------- run-time changes, all listed

_BY_TARGET = {p.target: p for p in PATCHES}
OVERRIDE_CALLS: dict[str, int] = {}  # target -> calls of the replacement (this process)


def _listed(cls: type, attr: str, kind: str) -> Patch:
    for klass in cls.__mro__:
        patch = _BY_TARGET.get(f"{klass.__module__}.{klass.__qualname__}.{attr}")
        if patch is not None and patch.kind == kind:
            return patch
    raise RuntimeError(f"{cls.__qualname__}.{attr} is changed without an entry in "
                       "parallel/mcore_compat.py PATCHES: add one (reason, staleness check)")


def is_transformer_engine(module: Any) -> bool:
    """A Transformer Engine layer, or megatron-core's wrapper of one (its GEMMs are TE's)."""
    path = type(module).__module__
    return path.startswith("transformer_engine") or ".extensions.transformer_engine" in path


def override_method(obj: Any, name: str, replacement: Callable) -> None:
    """Replace the bound method ``obj.name`` with ``replacement`` (already bound to ``obj``),
    checking that the original is the one the listed entry was written against."""
    patch = _listed(type(obj), name, OVERRIDE)
    problem = stale_reason(patch)
    if problem:
        raise RuntimeError(f"mcore_compat: {problem}")

    def counted(*args: Any, **kwargs: Any) -> Any:
        OVERRIDE_CALLS[patch.target] = OVERRIDE_CALLS.get(patch.target, 0) + 1
        return replacement(*args, **kwargs)

    setattr(obj, name, counted)


def replace_attribute(obj: Any, name: str, value: Any) -> None:
    """Swap a listed attribute of a megatron-core object (e.g. its inner torch optimizer)."""
    patch = _listed(type(obj), name, OVERRIDE)
    problem = stale_reason(patch)
    if problem:
        raise RuntimeError(f"mcore_compat: {problem}")
    OVERRIDE_CALLS[patch.target] = OVERRIDE_CALLS.get(patch.target, 0) + 1
    setattr(obj, name, value)


@contextlib.contextmanager
def single_process_rank_zero() -> Iterator[None]:
    """``torch.distributed.get_rank`` answers 0 while no process group exists (megatron-core's
    BlendedDataset index build asks without checking); with a group nothing changes."""
    patch = _BY_TARGET["torch.distributed.get_rank"]
    dist = torch.distributed
    if not is_needed(patch) or (dist.is_available() and dist.is_initialized()):
        yield
        return
    problem = stale_reason(patch)
    if problem:
        raise RuntimeError(f"mcore_compat: {problem}")
    original = dist.get_rank
    dist.get_rank = lambda *args, **kwargs: 0
    try:
        yield
    finally:
        dist.get_rank = original


def in_process_checkpoint_results_queue() -> None:
    """Give megatron-core's torch_dist writer a plain in-process results queue (we save
    synchronously) before it spawns a Manager process for one."""
    patch = _BY_TARGET[f"{_MC}.dist_checkpointing.strategies.filesystem_async._results_queue"]
    owner = resolve_owner(patch.module)
    if owner._results_queue is None:
        problem = stale_reason(patch)
        if problem:
            raise RuntimeError(f"mcore_compat: {problem}")
        owner._results_queue = queue.Queue()
