"""Versioned Hugging Face weights for rollout engines (SGLang, vLLM) in asynchronous RL.

Every N optimizer steps the trainer calls ``WeightPublisher.publish(step)`` on every rank; the
engines load ``<directory>/latest`` whenever it moves. Layout of ``directory``::

    v120/            a complete version: safetensors shards, index, config.json,
                     generation_config.json, tokenizer files, version.json
    v125/
    latest -> v125   relative symlink, swapped atomically
    v130.partial/    a publication in progress (or left by a crash)

One publication, in order (rank 0 writes; the other ranks send their pieces):

1. leftovers of earlier crashed publications go: ``v<M>.partial`` for M up to the version
   being written (never a newer one: it may be another job's live publication), and
   ``*.trash`` (versions whose removal was interrupted);
2. the live weights stream into ``v<N>.partial/`` exactly as ``export_hf`` writes a checkpoint
   (``glm5_train.hf_checkpoint.stream_hf``: one shard per decoder layer, assembled one at a
   time on rank 0), cast or quantised per ``dtype``;
3. ``version.json`` ({"version", "dtype", "written_at"}) is written last, every file is
   fsynced, then the directory is renamed to ``v<N>/``;
4. ``latest`` is pointed at ``v<N>``: a new symlink under a temporary name is moved over it
   with ``os.replace`` (rename(2), atomic), so a reader that follows ``latest`` finds either
   the previous complete version or this one, never a partial one;
5. old versions are pruned: the newest ``keep`` complete ones stay, the one ``latest`` names
   always among them; a pruned version is renamed to ``v<M>.trash`` before it is deleted, so
   a ``v<M>/`` directory is always complete. A reader that resolved ``latest`` to a version
   has ``keep - 1`` publications' time to finish reading it;
6. one collective at the end (rank 0's outcome broadcast: the barrier, carrying a failure of
   steps 3-5 to every rank), so on return every rank knows the version is complete.

A version that exists already (a resumed run publishing a step again) is replaced: the old
directory moves to ``v<N>.trash`` and the new one takes its name; between those two renames
(microseconds) ``v<N>`` does not exist, which a reader following ``latest`` to that very
version would notice. Normal operation (increasing steps) never replaces a version.

dtypes: ``fp32`` (floating tensors as float32), ``bf16`` (as bfloat16), ``fp8`` (the DeepSeek-V3
/ GLM-5-FP8 block format, see ``quantize_fp8_blocks``). In every dtype the router's
``e_score_correction_bias`` stays float32, as Z.ai's FP8 checkpoint stores it (see the FP8
source below) and transformers keeps it (``_keep_in_fp32_modules_strict``): the trainer moves
it in steps of model.moe_router_bias_update_rate (1e-3), which bf16's 8 significant bits would
round away at biases above 0.25, changing which experts tokens go to.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import re
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist

from glm5_train.hf_checkpoint import HfFormat, open_up_modes, stream_hf, tokenizer_problem
from glm5_train.hf_mapping import check_exportable
from parallel.comm_purpose import collective_purpose
from parallel.distopt_slices import parameters_gathered

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
LATEST = "latest"
VERSION_FILE = "version.json"
PARTIAL = ".partial"
TRASH = ".trash"

_VERSION_DIR = re.compile(r"^v(\d+)$")
_PARTIAL_DIR = re.compile(r"^v(\d+)\.partial$")

# Kept float32 in every dtype (see the module docstring).
FP32_TENSORS = ("mlp.gate.e_score_correction_bias",)

# ----------------------------------------------------------------------------------------------
# FP8 block format
# ----------------------------------------------------------------------------------------------

FP8_BLOCK = 128
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
# config.json's quantization_config, as DeepSeek-V3 and GLM-5-FP8 declare it (transformers'
# FineGrainedFP8Config, SGLang's and vLLM's Fp8Config read these fields).
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
# The linear weights GLM-5-FP8 stores in e4m3, in every decoder layer and the MTP layer: MLA's
# projections, the DSA indexer's wq_b and wk, and every MLP matrix (dense, shared expert, routed
# experts). Everything else stays bf16 there: embeddings, lm_head, norms (the indexer's k_norm
# and its bias too), the router's gate.weight, the indexer's weights_proj, the MTP layer's
# eh_proj; e_score_correction_bias float32. Source: the tensor list of Z.ai's GLM-5.3 FP8
# checkpoint as huggingface.co/butler-compute/GLM-5.3-FP8-NVFP4 documents it (which tensors it
# copied as F8_E4M3 + <name>_scale_inv of ceil(rows/128) x ceil(cols/128), which stay BF16);
# it agrees with transformers 5.24, which converts every nn.Linear of GlmMoeDsa except lm_head
# and indexer.weights_proj (_keep_in_fp32_modules) and keeps gate.weight and
# e_score_correction_bias in fp32 (_keep_in_fp32_modules_strict).
_FP8_WEIGHT = re.compile(
    r"^model\.layers\.\d+\."
    r"(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.wq_b|indexer\.wk)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj))\.weight$")
SCALE_SUFFIX = "_scale_inv"


def is_fp8_weight(name: str) -> bool:
    """Whether HF tensor ``name`` is stored in e4m3 with block scales in the fp8 format."""
    return _FP8_WEIGHT.match(name) is not None


def quantize_fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight in float8_e4m3fn, float32 ``scale_inv`` [ceil(rows/128), ceil(cols/128)]) of a
    matrix, one scale per 128 x 128 block (the last ones partial where a dimension is not a
    multiple of 128): each block is divided by its absolute maximum / 448, so its largest
    element becomes +-448, e4m3's largest; ``weight_fp8.float() * scale_inv`` (per block)
    gives the weight back within e4m3's rounding. An all-zero block gets scale 1."""
    if weight.dim() != 2:
        raise ValueError(f"fp8 block quantisation takes matrices, got shape {list(weight.shape)}")
    blocks = _as_blocks(weight.float())
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    scaled = (blocks / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    rows, cols = weight.shape
    quantized = _from_blocks(scaled)[:rows, :cols].to(torch.float8_e4m3fn)
    return quantized.contiguous(), scale_inv.contiguous()


def dequantize_fp8_blocks(quantized: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The float32 matrix a reader computes with: each 128 x 128 block times its scale."""
    rows, cols = quantized.shape
    per_element = scale_inv.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return quantized.float() * per_element[:rows, :cols]


def _as_blocks(matrix: torch.Tensor) -> torch.Tensor:
    """[row blocks, 128, column blocks, 128], zero-padded (zeros never raise a block's max)."""
    rows, cols = matrix.shape
    row_blocks, col_blocks = math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)
    padded = matrix.new_zeros(row_blocks * FP8_BLOCK, col_blocks * FP8_BLOCK)
    padded[:rows, :cols] = matrix
    return padded.view(row_blocks, FP8_BLOCK, col_blocks, FP8_BLOCK)


def _from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    row_blocks, _, col_blocks, _ = blocks.shape
    return blocks.reshape(row_blocks * FP8_BLOCK, col_blocks * FP8_BLOCK)


# ----------------------------------------------------------------------------------------------
# What each dtype writes
# ----------------------------------------------------------------------------------------------


def _stored_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(FP32_TENSORS) else dtype


def _cast_shard(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: t.to(_stored_dtype(name, dtype)) if t.is_floating_point() else t
            for name, t in tensors.items()}


def _fp8_shard(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if is_fp8_weight(name):
            out[name], out[name + SCALE_SUFFIX] = quantize_fp8_blocks(tensor)
        elif tensor.is_floating_point():
            out[name] = tensor.to(_stored_dtype(name, torch.bfloat16))
        else:
            out[name] = tensor
    return out


def hf_format(dtype: str) -> HfFormat:
    """How ``stream_hf`` writes a publication of ``dtype`` (one of DTYPES)."""
    if dtype == "fp8":
        # Unquantised tensors are bf16: config.json says so, as GLM-5-FP8's does.
        return HfFormat(convert=_fp8_shard, dtype=torch.bfloat16,
                        quantization_config=dict(FP8_QUANTIZATION_CONFIG))
    target = DTYPES[dtype]
    return HfFormat(convert=lambda tensors: _cast_shard(tensors, target), dtype=target)


# ----------------------------------------------------------------------------------------------
# Refusals (before any collective: every rank decides alone, from the same inputs)
# ----------------------------------------------------------------------------------------------


def directory_problem(directory: str) -> str | None:
    """Why ``directory`` cannot hold published versions (one line: value, rule, fix), or None.
    It may not exist yet (rank 0 creates it); its nearest existing ancestor must then be a
    directory this user can write."""
    if not directory:
        return ("publish directory '' is empty: weights are published into a directory of "
                "versions; pass one, e.g. /checkpoints/run1/published")
    if os.path.lexists(directory) and not os.path.isdir(directory):
        return (f"publish directory {directory!r} exists and is not a directory: versions "
                "(v<N>/ and the latest symlink) go into a directory; pass a directory path "
                "(a missing one is created), not a file")
    existing = _nearest_existing(directory)
    if not os.path.isdir(existing):
        return (f"publish directory {directory!r} cannot be created: {existing!r} on its path "
                "is a file, not a directory; pass a path under a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "it" if existing == os.path.abspath(directory) else f"its parent {existing!r}"
        return (f"publish directory {directory!r} is not writable ({where} does not let this "
                "user create files): rank 0 writes every version there; pass a directory you "
                "can write, or fix its permissions")
    return None


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def publication_problem(job, directory: str, keep: int, dtype: str) -> str | None:
    """The first reason a publisher of ``job``'s model cannot be made (one line), or None. No
    process groups: ``tools/publish_weights.py`` asks before it creates them."""
    if dtype not in DTYPES:
        return (f"publish dtype={dtype!r} is not one of {sorted(DTYPES)}: pass bf16 (what the "
                "engines compute in), fp32, or fp8 (e4m3, 128x128 block scales)")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        return (f"publish keep={keep!r}: the newest versions kept must be an integer >= 1 "
                "(the one latest points to is always kept); pass e.g. keep=3")
    problem = directory_problem(directory)
    if problem is None:
        problem = tokenizer_problem(job)  # the engines need the tokenizer's files and ids
    if problem is None:
        try:
            check_exportable(job.model)
        except ValueError as err:
            problem = str(err)
    return problem


# ----------------------------------------------------------------------------------------------
# The publisher
# ----------------------------------------------------------------------------------------------


class WeightPublisher:
    """Publishes this job's live weights as numbered HF versions under ``directory``.

    ``chunks``: this rank's model chunks as training holds them (megatron-core modules,
    DDP-wrapped or not, any TP/SP, PP x VPP, EP, DP layout, distributed optimizer or not);
    they are read, never changed. ``keep``: complete versions kept. ``dtype``: "bf16", "fp32"
    or "fp8". ``mtp``: include the MTP layer's tensors (SGLang's speculative decoding uses them;
    transformers ignores them). ``group``: the ranks holding the model (None: every rank of the
    job); its first rank writes. A bad argument raises ValueError here, on every rank alike,
    before any collective."""

    def __init__(self, job, chunks: list[torch.nn.Module], directory: str, keep: int = 3,
                 dtype: str = "bf16", mtp: bool = True, group=None) -> None:
        problem = publication_problem(job, directory, keep, dtype)
        if problem is not None:
            raise ValueError(problem)
        self.job, self.chunks, self.directory = job, chunks, directory
        self.keep, self.dtype, self.mtp, self.group = keep, dtype, mtp, group
        self.format = hf_format(dtype)

    def publish(self, version: int) -> dict[str, Any]:
        """Write the weights as version ``version`` (the optimizer step they come from) and
        point ``latest`` at it. Collective: call on every rank of the group. Returns a report:
        ``version``, ``path``, ``dtype``, ``pruned``, ``seconds`` everywhere; ``bytes``,
        ``hf_tensors`` (0 elsewhere) and ``removed`` (leftovers) from the writing rank."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"publish version={version!r}: a version is the optimizer step "
                             "the weights come from, an integer >= 0; pass the step")
        started = time.perf_counter()
        writer = dist.get_rank(self.group) == 0
        final = os.path.join(self.directory, f"v{version}")
        partial = final + PARTIAL
        removed = remove_leftovers(self.directory, version) if writer else []
        with parameters_gathered(self.chunks):  # the step's weights (overlap_param_gather)
            report = stream_hf(self.job, self.chunks, partial, mtp=self.mtp, fmt=self.format,
                               group=self.group)
        outcome: dict[str, Any] = {}
        if writer:
            outcome = self._complete(version, partial, final)
        outcome = _broadcast_outcome(outcome, self.group)
        if "error" in outcome:
            raise OSError(outcome["error"])
        report.update(version=version, path=final, dtype=self.dtype, removed=removed,
                      pruned=outcome["pruned"], seconds=time.perf_counter() - started)
        report.pop("out_dir", None)
        if writer:
            _say(_summary(report))
        return report

    def start_at(self, version: int) -> dict[str, Any] | None:
        """A run starting (or resuming) at ``version``: what the engines may load is that
        version. Versions above it (published by an earlier attempt that went further than
        its last checkpoint: weights the learner no longer has) are removed; ``latest`` is
        pointed at ``v<version>`` if it exists, else it is published. Collective. Returns the
        publication's report, or None when ``v<version>`` was there."""
        outcome: dict[str, Any] = {}
        if dist.get_rank(self.group) == 0:
            try:
                outcome = {"removed": remove_versions_above(self.directory, version),
                           "exists": os.path.isdir(self.directory)
                           and version in complete_versions(self.directory)}
                if outcome["exists"]:
                    point_latest(self.directory, f"v{version}")
            except OSError as err:
                outcome = {"error": f"resuming the versions of {self.directory} at "
                                    f"v{version} failed: {err}"}
        outcome = _broadcast_outcome(outcome, self.group)
        if "error" in outcome:
            raise OSError(outcome["error"])
        if dist.get_rank(self.group) == 0 and outcome["removed"]:
            _say(f"removed {', '.join(outcome['removed'])}: newer than the run's step "
                 f"{version} (an earlier attempt's, past its last checkpoint)")
        if outcome["exists"]:
            return None
        return self.publish(version)

    def _complete(self, version: int, partial: str, final: str) -> dict[str, Any]:
        """Rank 0 after the shards: version.json, rename, latest, prune. An OSError becomes the
        outcome every rank raises (none is left waiting)."""
        try:
            write_version_file(partial, version, self.dtype)
            sync_files(partial)
            move_into_place(partial, final)
            point_latest(self.directory, os.path.basename(final))
            sync_files(self.directory, files=False)
            return {"pruned": prune(self.directory, self.keep)}
        except OSError as err:
            return {"error": f"publishing v{version} to {self.directory} failed: {err}"}


@collective_purpose("weight_publish")
def _broadcast_outcome(outcome: dict[str, Any], group) -> dict[str, Any]:
    """The writing rank's outcome on every rank: the publication's one closing collective."""
    box = [outcome]
    first = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=first, group=group)
    return box[0]


def _summary(report: dict[str, Any]) -> str:
    """The writing rank's one line about a publication."""
    pruned = f"; pruned {', '.join(report['pruned'])}" if report["pruned"] else ""
    return (f"published v{report['version']} ({report['dtype']}, {report['hf_tensors']} tensors, "
            f"{report['bytes'] / 2**20:.1f} MiB) to {report['path']} in "
            f"{report['seconds']:.1f} s; {LATEST} -> v{report['version']}{pruned}")


def _say(message: str) -> None:
    print(f"publish: {message}", flush=True)


# ----------------------------------------------------------------------------------------------
# The directory of versions (rank 0 only)
# ----------------------------------------------------------------------------------------------


def write_version_file(path: str, version: int, dtype: str) -> None:
    """``version.json``: the last file of a version, so a directory holding it is complete."""
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
    target = os.path.join(path, VERSION_FILE)
    with open(target + ".tmp", "w") as handle:
        json.dump({"version": version, "dtype": dtype, "written_at": stamp}, handle, indent=2)
        handle.write("\n")
    os.replace(target + ".tmp", target)
    open_up_modes(path, [VERSION_FILE])


def written_at_seconds(stamp: str) -> float:
    """A version.json ``written_at`` (ISO 8601, UTC) as seconds since the epoch."""
    return datetime.datetime.fromisoformat(stamp).timestamp()


def sync_files(path: str, files: bool = True) -> None:
    """fsync the files of directory ``path`` (``files``), then the directory itself: durable
    before visible, so a version ``latest`` names survives a crash of the machine holding it
    (a rename can reach the disk before the data it names), and a network file system's
    other clients see whole files."""
    names = os.listdir(path) if files else []
    for name in names:
        _fsync(os.path.join(path, name), os.O_RDONLY)
    _fsync(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def _fsync(path: str, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def move_into_place(partial: str, final: str) -> None:
    """Rename the finished ``v<N>.partial`` to ``v<N>``; an existing ``v<N>`` (a step
    published again after a resume) is moved to the trash first and deleted after."""
    if not os.path.lexists(final):
        os.rename(partial, final)
        return
    trash = final + TRASH
    _remove(trash)
    os.rename(final, trash)
    os.rename(partial, final)
    _remove(trash)


def point_latest(directory: str, target: str) -> None:
    """``latest`` -> ``target`` (relative), atomically: a new link under a temporary name,
    moved over the old one (rename(2) replaces the link itself, never what it points to)."""
    temporary = os.path.join(directory, f".{LATEST}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.remove(temporary)
    os.symlink(target, temporary)
    os.replace(temporary, os.path.join(directory, LATEST))


def latest_version(directory: str) -> int | None:
    """The version ``latest`` points to (None: no link, or not to a version)."""
    try:
        match = _VERSION_DIR.match(os.readlink(os.path.join(directory, LATEST)))
    except OSError:
        return None
    return int(match.group(1)) if match else None


def complete_versions(directory: str) -> list[int]:
    """The complete versions under ``directory`` (``v<N>`` directories), newest first."""
    found = []
    for name in os.listdir(directory):
        match = _VERSION_DIR.match(name)
        if match and os.path.isdir(os.path.join(directory, name)):
            found.append(int(match.group(1)))
    return sorted(found, reverse=True)


def prune(directory: str, keep: int) -> list[str]:
    """Remove all but ``keep`` complete versions: the one ``latest`` names, then the newest.
    Each goes to the trash (a rename) before it is deleted, so no ``v<N>/`` is ever half
    gone. The names removed, oldest first."""
    latest = latest_version(directory)
    order = ([latest] if latest is not None else []) + [
        v for v in complete_versions(directory) if v != latest]
    return [_withdraw(directory, version) for version in sorted(order[keep:])]


def _withdraw(directory: str, version: int) -> str:
    """Remove complete version ``version``, renamed to the trash first so that no ``v<N>/`` is
    ever half gone; its name."""
    trash = os.path.join(directory, f"v{version}{TRASH}")
    _remove(trash)
    os.rename(os.path.join(directory, f"v{version}"), trash)
    _remove(trash)
    return f"v{version}"


def remove_versions_above(directory: str, version: int) -> list[str]:
    """Remove the complete versions newer than ``version`` (each renamed to the trash first),
    pointing ``latest`` away from them first if it names one. The names removed."""
    if not os.path.isdir(directory):
        return []
    newer = sorted(v for v in complete_versions(directory) if v > version)
    if not newer:
        return []
    current = latest_version(directory)
    if current is not None and current > version:
        kept = [v for v in complete_versions(directory) if v <= version]
        if kept:
            point_latest(directory, f"v{kept[0]}")
        else:
            os.remove(os.path.join(directory, LATEST))
    return [_withdraw(directory, old) for old in newer]


def remove_leftovers(directory: str, version: int) -> list[str]:
    """Before writing ``version``: create ``directory`` if needed and remove what crashed
    publications left: ``v<M>.partial`` with M <= ``version`` (a newer one may be another
    job's publication in progress: left alone) and any ``*.trash``. The names removed."""
    os.makedirs(directory, exist_ok=True)
    removed = []
    for name in sorted(os.listdir(directory)):
        match = _PARTIAL_DIR.match(name)
        if (match and int(match.group(1)) <= version) or name.endswith(TRASH):
            try:
                _remove(os.path.join(directory, name))
            except OSError as err:  # the other ranks are on their way to the shards: go on
                _say(f"note: could not remove the leftover {name}: {err}")
                continue
            removed.append(name)
    return removed


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
