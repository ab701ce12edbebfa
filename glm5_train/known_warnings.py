"""The library warnings this project's runs hide, each with the reason it does not apply to them.

One registry (``KNOWN``; the mechanism, and why the remaining warnings show once per run
instead of once per rank, is ``parallel/quiet.py``'s docstring). Without it the tiny GLM-5's
8-rank job printed 40 warnings (5 kinds x 8 ranks) around its progress lines. An entry is here
only with a reason it cannot matter to the run that hides it; a reason that holds only on CPU
is a condition (``when``), so a GPU run still shows the warning. An entry applies only on the
library releases it was checked on (``versions``): on another release its warning shows again,
and whoever upgrades judges it anew (the same warning may then apply, or be gone).

``install()`` runs when the ``glm5_train`` package is imported, before any megatron-core import
(its import-time warnings), and again in the job's ``main()`` once the process knows it is a
rank of a run (and once Hydra has configured logging). Warnings not listed here are never
hidden: on a multi-rank run each distinct one shows on the first rank to emit it only.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from collections.abc import Mapping

from parallel import quiet
from parallel.quiet import Known, OncePerRun

MCORE = "megatron-core"
# As parallel/mcore_compat.WRITTEN_AGAINST; not imported from there: mcore_compat imports
# megatron-core, and this module must run before megatron-core's first import.
MCORE_RELEASES = ("0.16.1", "0.19.2")


def no_cuda_device() -> bool:
    """The run is on CPU: the job uses CUDA whenever a device is present (parallel/device.py,
    mcore_compat.install). ``device_count`` asks NVML before the CUDA driver: checking it in a
    process that forks ranks afterwards (tests' fork server) does not spoil CUDA in the forks
    (torch's note on it: it does not "poison fork" when NVML answers). torch is looked up,
    not imported: whatever emits a CUDA hint has imported it (megatron-core does, first), and
    importing ``glm5_train`` stays torch-free for the tools that need no torch
    (tools/verify_checkpoint.py)."""
    torch = sys.modules.get("torch")
    return torch is None or torch.cuda.device_count() == 0


KNOWN: tuple[Known, ...] = (
    Known(
        r"Transformer Engine and Apex are not installed", "megatron.core", MCORE, MCORE_RELEASES,
        why="megatron-core falls back to torch's optimizers, grad clipping and tensor kernels "
            "when neither Transformer Engine nor Apex is installed (at import). Both are CUDA "
            "libraries: a CPU run cannot use them, the fallback is its only path. On a GPU the "
            "warning shows: there the fallback is slower and installing TE (the gpu extra) "
            "is the fix.",
        when=no_cuda_device),
    Known(
        r"Apex is not installed", "megatron.core", MCORE, MCORE_RELEASES,
        why="megatron-core's layer specs fall back to torch's norms without Apex (at import); "
            "on CPU there is no Apex to use. Shown on a GPU (Apex's fused norms are faster).",
        when=no_cuda_device),
    Known(
        r"absl\.logging is not installed", "megatron.core.hyper_comm_grid", MCORE,
        MCORE_RELEASES,
        why="megatron-core's HyperCommGrid logs through the logging module instead of absl's "
            "when absl-py is absent (at import); only the format of its own debug logs "
            "changes, nothing this job reads or does."),
    Known(
        r"full scope is deprecated", "megatron.core.transformer.transformer_config", MCORE,
        ("0.16.1",),
        why="megatron-core 0.16.1's own default cuda_graph_scope='full' triggers its own "
            "deprecation in every TransformerConfig (0.19.2's default is None: no warning). "
            "This project neither sets cuda_graph_scope nor uses CUDA graphs "
            "(cuda_graph_impl stays 'none'), so there is nothing to migrate."),
    Known(
        r"`sequence_parallel` is set to `True`, but tensor model parallel size is 1",
        "megatron.core.tensor_parallel.layers", MCORE, MCORE_RELEASES,
        why="parallel/layout.py refuses sequence_parallel with tensor_model_parallel_size 1, "
            "so in a validated job the only linear layers on a size-1 tensor-parallel group "
            "are the routed experts with parallel.expert_tp=1: megatron-core builds them on "
            "the expert-TP group and turns SP off there, as it should (their tokens arrive "
            "through the expert-parallel all-to-all, not SP's gathers)."),
    Known(
        r"When using (sequence parallelism|async grad allreduce) it is recommended to set the "
        r"environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1",
        "megatron.core.tensor_parallel.layers", MCORE, MCORE_RELEASES,
        why="CUDA_DEVICE_MAX_CONNECTIONS=1 makes a GPU run its kernels in issue order, so that "
            "tensor-parallel communication is scheduled ahead of the compute it overlaps; "
            "on CPU there is no device queue to order. Shown on a GPU, where it is real "
            "speed advice.",
        when=no_cuda_device),
    Known(
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        "torch.distributed.c10d_logger", "torch", ("2.13.0",), category=FutureWarning,
        why="torch 2.13 renamed these collectives (*_single) without changing them. "
            "megatron-core 0.16.1 and 0.19.2 call the old names (sequence-parallel regions, "
            "distributed optimizer), as this project's parallel/ modules and "
            "glm5_train/model/head_parallel_cp.py still do (moving those to *_single is the "
            "developers' to-do, not the user's): a run's user has nothing to change. Bound to "
            "torch 2.13.0, the pinned release: a torch that removes the old names shows it "
            "again."),
    # On resume (checkpoint.load), megatron-core's torch_dist format read through torch's
    # distributed checkpoint (DCP):
    Known(
        r"`load_state_dict` is deprecated and will be removed in future versions",
        "megatron.core.dist_checkpointing.strategies.torch", MCORE, ("0.16.1",),
        category=FutureWarning,
        why="megatron-core 0.16.1's torch_dist loader calls DCP's load_state_dict, which "
            "torch renamed load (0.19.2 calls load: no warning). The checkpoint reads the same "
            "either way; the call is megatron-core's, not the user's."),
    Known(
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        "torch.distributed.checkpoint", "torch", ("2.13.0",), category=FutureWarning,
        why="megatron-core's torch_dist format hands DCP torch ShardedTensors (its "
            "mcore_to_pyt_state_dict), which torch plans to replace by DTensor; DCP warns when "
            "it reads them back. The format is megatron-core's choice, the checkpoint loads "
            "as written (tests/test_checkpoint*), and the user has nothing to change. Bound to "
            "torch 2.13.0: a torch that drops ShardedTensor shows it again."),
)

# Logger levels set by ``install``, with why. Not warning filters: every WARNING still passes.
LOGGER_LEVELS: dict[str, tuple[int, str]] = {
    "megatron": (logging.WARNING,
                 "megatron-core logs every parameter's name at INFO, on every rank"),
}


def run_key(env: Mapping[str, str]) -> str | None:
    """What every local rank of one run attempt (one torchrun, one slurm job, one test's job)
    shares, and no other does: our launchers' run id or torchrun's, the rendezvous address,
    and the attempt (a slurm requeue or a torchrun restart keeps the run id and address, and
    must show its warnings again)."""
    parts = [env.get(name, "") for name in ("GLM5_RUN_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                                             "MASTER_PORT", "SLURM_RESTART_COUNT",
                                             "TORCHELASTIC_RESTART_COUNT")]
    if not any(parts):
        return None
    return re.sub(r"[^A-Za-z0-9._-]", "_", "_".join(parts))


def once_per_run(env: Mapping[str, str] = os.environ) -> OncePerRun | None:
    """The de-duplication of a rank of a multi-rank run (None: one process, or not a run)."""
    key = run_key(env)
    if int(env.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in env or key is None:
        return None
    return OncePerRun(os.path.join(tempfile.gettempdir(), f"glm5_warnings_{key}"),
                      int(env["RANK"]))


def install() -> list[Known]:
    """Apply ``KNOWN`` and ``LOGGER_LEVELS`` in this process, and, on a rank of a run, show the
    remaining warnings (and console log warnings) once per run. Idempotent; returns the
    entries applied (those whose library release is one they were checked on)."""
    for name, (level, _why) in LOGGER_LEVELS.items():
        logging.getLogger(name).setLevel(level)
    applied = quiet.install(KNOWN, once_per_run())
    quiet.once_on_console()
    return applied
