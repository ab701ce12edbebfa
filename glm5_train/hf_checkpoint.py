"""Hugging Face GLM-5 checkpoints <-> this project's distributed checkpoints, in any layout.

The engine behind ``tools/hf_checkpoint.py`` (its command line)::

    torchrun --nproc-per-node N tools/hf_checkpoint.py import --hf-dir DIR --save OUT \\
        [model=glm5_tiny parallel=tp2_pp2_vpp2_ep2 ...]
    torchrun --nproc-per-node N tools/hf_checkpoint.py export --load CKPT --hf-dir OUT \\
        [model=glm5_tiny parallel=single ...]

Both run under torchrun in any TP/PP/VPP/EP/DP layout (Hydra overrides of the training job's
config groups after the flags). Names and config fields map through ``glm5_train.hf_mapping``.

Import reads ``DIR/config.json``, refuses an architecture other than the job's (naming the
field), builds this rank's model chunks and, for every local ``ShardedTensor``, reads only the
slice it holds from the safetensors files (``safe_open(...).get_slice(name)[...]``): a rank's
memory is its shard plus one tensor slice. Every HF tensor must be used exactly once across
all ranks (checked collectively), the MTP layer's (``model.layers.<num_hidden_layers>.*``)
included; a job that trains without MTP (``model.mtp_num_steps=0``) skips and reports them, and
a job that trains MTP refuses a checkpoint without it. The result is a weights-only checkpoint (``save_checkpoint(..., optimizer=None)``) that
training loads with ``checkpoint.load=OUT`` in any layout.

Export loads a checkpoint (weights-only or a training checkpoint; the optimizer state is not
read) and streams one safetensors shard per decoder layer (MTP layers included) plus one for the
embedding, final norm and output head: for each shard, the ranks holding main replicas of its pieces send them to
global rank 0, which assembles and writes the shard before moving on, so rank 0 holds at most
one layer. That streaming is ``stream_hf``, which works on any model chunks: the RL weight
publisher (``glm5_train/rl/publisher.py``) runs it on the training job's live chunks. It
writes ``model.safetensors.index.json`` and ``config.json`` (HF ``GlmMoeDsaConfig`` fields,
``num_nextn_predict_layers`` = the MTP layers written). Tensors keep the model's dtype: a round
trip HF -> here -> HF is bit-exact when the dtypes agree.

So that transformers can use the export as it is, it also carries the tokenizer the job names
(``data.tokenizer``: its tokenizer files are copied; the byte tokenizer has none) and
``generation_config.json`` with its end-of-text id first, then the end-of-turn ids of the
tokenizer directory's own generation_config (``generate`` stops at any of them), bos and pad
where known; config.json gets the same ids (transformers' defaults, eos 1 and bos 0, are not
GLM-5's). A tokenizer that does not fit the model is refused on every rank before anything is
loaded or written (``tokenizer_problem``): more ids than ``model.vocab_size``, the byte
tokenizer for a model that is not byte-level (the default ``data.tokenizer=byte`` for GLM-5's
154880 ids), a directory without tokenizer files, special ids past the vocabulary. Files get
the mode a plain ``open()`` gives under the user's umask (0644 under 022; safetensors writes
0600). transformers' ``GlmMoeDsaForCausalLM`` has no MTP layer: it lists the
MTP tensors as unexpected on load (except at GLM-5's own layer 78); export prints a one-line
note, and ``mtp=False`` (``--no-mtp``) leaves them out. ``make_random_hf`` writes a random HF
GLM-5 of the config's shapes to try all this on (tools/hf_checkpoint.py make-random).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import (
    is_main_replica,
)
from safetensors import safe_open
from safetensors.torch import save_file

from glm5_train import int4_checkpoint
from glm5_train.checkpoint import TrainState, load_checkpoint, save_checkpoint
from glm5_train.hf_mapping import (
    check_config_matches,
    check_exportable,
    glm5_to_hf_config,
    hf_config_to_glm5,
    hf_layer_index,
    is_mtp_name,
    mcore_to_hf,
)
from glm5_train.job_config import compose_job
from glm5_train.model.config import to_mcore_config
from glm5_train.model.glm5 import build_model_chunks
from glm5_train.plan import resolve_pipeline_layout
from glm5_train.tokenizer import (
    check_export_tokenizer,
    copy_tokenizer_files,
    generation_config,
    special_token_ids,
)
from parallel import mcore_compat
from parallel.comm_purpose import collective_purpose
from parallel.layout import validate_layout
from parallel.process_groups import init_distributed, world_from_env
from parallel.sharded_tensors import local_sharded_tensors

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# ----------------------------------------------------------------------------------------------
# The model's local shards as megatron-core's distributed checkpoint sees them
# ----------------------------------------------------------------------------------------------


@dataclass
class LocalTensor:
    """One local ShardedTensor: ``data`` is the slice at ``offset`` of global tensor ``key``
    (index ``index`` along the prepended axes, e.g. the expert), whose shape is ``shape``."""

    key: str
    index: tuple[int, ...]
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    data: torch.Tensor
    main_replica: bool

    @property
    def label(self) -> str:
        return self.key + (f"[{','.join(map(str, self.index))}]" if self.index else "")


@dataclass
class Piece:
    """The part of a LocalTensor that lies in one HF tensor: ``local`` (a view of the model's
    weight) is ``hf_tensor[hf_index]`` of HF tensor ``hf_name`` of shape ``hf_shape``."""

    hf_name: str
    hf_shape: tuple[int, ...]
    hf_index: tuple[slice, ...]
    local: torch.Tensor
    owner: str


def local_tensors(chunks: list[torch.nn.Module]) -> list[LocalTensor]:
    """Every ShardedTensor of this rank's chunks, factories (SwiGLU fc1) expanded, each a view
    of the parameter or buffer it checkpoints (writing it writes the model)."""

    out: list[LocalTensor] = []
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)
        owned = {t.untyped_storage().data_ptr()
                 for t in list(chunk.parameters()) + list(chunk.buffers())}
        for item in local_sharded_tensors(chunk):
            if item.flattened_range is not None:
                raise RuntimeError(f"{item.key}: flattened sharded tensors are not supported")
            if item.data.untyped_storage().data_ptr() not in owned:
                raise RuntimeError(f"{item.key}: its sharded tensor is a copy, not a view of a "
                                   "model parameter or buffer; cannot write it in place")
            lead = item.prepend_axis_num
            out.append(LocalTensor(
                key=item.key, index=tuple(item.global_offset[:lead]),
                shape=tuple(item.global_shape[lead:]), offset=tuple(item.global_offset[lead:]),
                data=item.data, main_replica=is_main_replica(item.replica_id)))
    return out


def _leaves(tree: Any) -> list:
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    if isinstance(tree, (list, tuple)):
        return [leaf for value in tree for leaf in _leaves(value)]
    return [tree]


def pieces_of(tensor: LocalTensor, num_hidden_layers: int) -> list[Piece]:
    """Split a local shard into the HF tensors it overlaps (the SwiGLU fc1 stacks gate; up)."""
    names = mcore_to_hf(tensor.key, tensor.index, num_hidden_layers)
    if names is None:
        raise KeyError(f"megatron-core tensor {tensor.label} has no Hugging Face name")
    if tensor.data.dim() == 0 or tensor.shape[0] % len(names):
        raise ValueError(f"{tensor.label}: shape {tensor.shape} does not split into {names}")
    rows = tensor.shape[0] // len(names)
    hf_shape = (rows, *tensor.shape[1:])
    first, last = tensor.offset[0], tensor.offset[0] + tensor.data.shape[0]
    rest = tuple(slice(o, o + n) for o, n in zip(tensor.offset[1:], tensor.data.shape[1:]))
    pieces = []
    for part, name in enumerate(names):
        start, stop = max(first, part * rows), min(last, (part + 1) * rows)
        if start < stop:
            pieces.append(Piece(name, hf_shape,
                                (slice(start - part * rows, stop - part * rows), *rest),
                                tensor.data[start - first:stop - first], tensor.label))
    return pieces


# ----------------------------------------------------------------------------------------------
# Job set-up shared by import and export
# ----------------------------------------------------------------------------------------------


def compose(overrides: list[str]):
    """The JobConfig of these Hydra overrides (model, parallel, train groups as in training)."""
    return compose_job(list(overrides))


def ensure_distributed(job) -> None:
    """The default group and megatron-core's groups for ``job``'s layout, unless they exist
    (import, export and tools/publish_weights.py run no batches: the batch checks are moot)."""
    if not parallel_state.model_parallel_is_initialized():
        _, world, _ = world_from_env()
        par = job.parallel
        # Conversion runs no batches: only the model-placement rules matter.
        split = par.tensor_model_parallel_size * 2 * par.context_parallel_size
        dp = validate_layout(par, job.model, world, global_batch_size=world,
                             micro_batch_size=1, seq_length=split)
        # The training job's layout (given, or balanced for the MTP placement): any layout
        # converts the same weights, this one keeps the ranks' shares as in training.

        par.pipeline_model_parallel_layout = resolve_pipeline_layout(job, dp)
        mcore_compat.install()
        init_distributed(par, job.train.seed)


def _build_chunks(job) -> list[torch.nn.Module]:
    """This rank's chunks, uninitialised (every weight is overwritten by import or load)."""
    config = to_mcore_config(job.model, job.parallel, job.train.torch_dtype,
                             perform_initialization=False)
    return build_model_chunks(job.model, config)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _log(message: str) -> None:
    if _rank() == 0:
        print(f"hf_checkpoint: {message}", flush=True)


_NOTED: set[str] = set()


def _note_once(message: str) -> None:
    """A note about the job's setup, said once per process (a training job publishing weight
    versions writes many exports of the same setup)."""
    if message not in _NOTED:
        _NOTED.add(message)
        _log(message)


# ----------------------------------------------------------------------------------------------
# Import
# ----------------------------------------------------------------------------------------------


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: --hf-dir must be a Hugging Face model "
                                "directory (config.json + safetensors)")
    with open(path) as handle:
        return json.load(handle)


def hf_weight_files(hf_dir: str) -> dict[str, str]:
    """HF tensor name -> safetensors file name, from the index or the single-file checkpoint."""
    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as handle:
            return dict(json.load(handle)["weight_map"])
    single = os.path.join(hf_dir, SINGLE_FILE)
    if os.path.exists(single):
        with safe_open(single, framework="pt") as handle:
            return {name: SINGLE_FILE for name in handle.keys()}  # noqa: SIM118 (no __iter__)
    raise FileNotFoundError(f"{hf_dir} holds neither {INDEX_FILE} nor {SINGLE_FILE}")


class _SliceReader:
    """Open safetensors files lazily and read slices of tensors (memory-mapped: only the bytes
    of the requested slice are read)."""

    def __init__(self, hf_dir: str, files: dict[str, str]) -> None:
        self.hf_dir, self.files = hf_dir, files
        self._stack = contextlib.ExitStack()
        self._open: dict[str, Any] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _slice(self, name: str):
        fname = self.files[name]
        if fname not in self._open:
            path = os.path.join(self.hf_dir, fname)
            self._open[fname] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._open[fname].get_slice(name)

    def _stored(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._slice(name)[index]

    def shape(self, name: str) -> tuple[int, ...]:
        if int4_checkpoint.is_packed(name, self.files):
            return int4_checkpoint.packed_shape(self._stored, name)
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """A slice of tensor ``name``; an INT4 weight's dequantised (its packed triple)."""
        if int4_checkpoint.is_packed(name, self.files):
            return int4_checkpoint.read_packed(self._stored, name, index)
        return self._stored(name, index)


def import_hf(job, hf_dir: str, save_dir: str) -> dict[str, Any]:
    """Convert the HF checkpoint in ``hf_dir`` into a weights-only checkpoint under
    ``save_dir`` for ``job``'s model, in the current torchrun layout. Collective: call on every
    rank. Returns a report (the same on every rank)."""
    started = time.perf_counter()
    hf_dict = read_hf_config(hf_dir)
    hf_cfg = hf_config_to_glm5(hf_dict)
    check_config_matches(hf_cfg, job.model)
    stored = hf_weight_files(hf_dir)
    files = int4_checkpoint.logical_names(stored)  # INT4 weights under their own names
    layers, nextn = hf_cfg.num_hidden_layers, hf_cfg.num_nextn_predict_layers
    # A job training without MTP skips the checkpoint's MTP layers (and says so).
    mtp = [] if job.model.mtp_sets else sorted(n for n in files if is_mtp_name(n, layers, nextn))
    expected = set(files) - set(mtp)

    ensure_distributed(job)
    chunks = _build_chunks(job)
    # hf name -> [megatron owner, elements written by main replicas, elements of the tensor]
    used: dict[str, list] = {}
    errors: list[str] = []
    casts: Counter = Counter()
    with _SliceReader(hf_dir, stored) as reader, torch.no_grad():
        for tensor in local_tensors(chunks):
            try:
                pieces = pieces_of(tensor, layers)
            except (KeyError, ValueError) as err:
                errors.append(str(err).strip("'\""))
                continue
            written, errors_before = 0, len(errors)
            for piece in pieces:
                name = piece.hf_name
                if name not in files:
                    errors.append(f"{name} (for {piece.owner}) is not in {hf_dir}")
                    continue
                shape = reader.shape(name)
                if shape != piece.hf_shape:
                    errors.append(f"{name} has shape {list(shape)}, the model expects "
                                  f"{list(piece.hf_shape)} (for {piece.owner})")
                    continue
                source = reader.read(name, piece.hf_index)
                if source.dtype != piece.local.dtype:
                    casts[f"{source.dtype} -> {piece.local.dtype}"] += 1
                piece.local.copy_(source)
                written += piece.local.numel()
                entry = used.setdefault(name, [piece.owner, 0, math.prod(shape)])
                if entry[0] != piece.owner:
                    errors.append(f"{name} maps to both {entry[0]} and {piece.owner}")
                if tensor.main_replica:
                    entry[1] += piece.local.numel()
            if written != tensor.data.numel() and len(errors) == errors_before:
                errors.append(f"{tensor.label}: only {written} of {tensor.data.numel()} local "
                              "elements found in the HF checkpoint")

    problems, casts = _check_import(_all_gather((used, errors, casts)), expected)
    if problems:
        raise ValueError(f"import from {hf_dir} failed:\n  " + "\n  ".join(problems))
    path = save_checkpoint(save_dir, chunks, None, None, TrainState(), job.model)
    report = {"checkpoint": path, "hf_tensors": len(expected), "skipped_mtp": mtp,
              "casts": dict(casts), "seconds": time.perf_counter() - started}
    _log(f"imported {len(expected)} tensors from {hf_dir} into {path} "
         f"in {report['seconds']:.1f} s")
    if mtp:
        _log(f"skipped {len(mtp)} MTP tensors (model.layers.{layers}"
             f"{'..' + str(layers + nextn - 1) if nextn > 1 else ''}.*, "
             f"num_nextn_predict_layers={nextn}): the job trains no MTP "
             "(model.mtp_num_steps=0). Skipped: "
             + ", ".join(mtp[:8]) + (" ..." if len(mtp) > 8 else ""))
    if casts:
        _log(f"converted dtypes to the model's (train.params_dtype): {dict(casts)}")
    return report


@collective_purpose("hf_checkpoint")
def _all_gather(obj: Any, group=None) -> list:
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def _global_rank(group, rank: int) -> int:
    """The global rank of ``rank`` in ``group`` (None: the default group)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _check_import(gathered: list, expected: set[str]) -> tuple[list[str], Counter]:
    """Every rank sees the same gathered data, so every rank raises the same error."""
    problems: list[str] = []
    owners: dict[str, set] = {}
    covered: Counter = Counter()
    sizes: dict[str, int] = {}
    casts: Counter = Counter()
    for used, errors, rank_casts in gathered:
        problems += [e for e in errors if e not in problems]
        casts.update(rank_casts)
        for name, (owner, elements, size) in used.items():
            owners.setdefault(name, set()).add(owner)
            covered[name] += elements
            sizes[name] = size
    for name in sorted(owners):
        if len(owners[name]) > 1:
            problems.append(f"{name} is used by several model tensors: {sorted(owners[name])}")
        elif covered[name] != sizes[name]:
            problems.append(f"{name}: the model's shards cover {covered[name]} of its "
                            f"{sizes[name]} elements (each must be used exactly once)")
    unused = sorted(expected - set(owners))
    if unused:
        problems.append(f"{len(unused)} HF tensor(s) unknown to or unused by the model: "
                        + ", ".join(unused[:20]) + (" ..." if len(unused) > 20 else ""))
    return problems, casts


# ----------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------


def shard_file(shard: int, shards: int) -> str:
    return f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"


def _shard_of(name: str, layers: int) -> int:
    """Shard 0: embedding, final norm, output head; shard 1 + i: decoder layer i (an MTP layer
    numbered after the decoder layers, as HF numbers it)."""
    layer = hf_layer_index(name)
    if layer is None:
        return 0
    if not 0 <= layer < layers:
        raise ValueError(f"{name}: layer {layer} outside the model's {layers} layers")
    return 1 + layer


@dataclass(frozen=True)
class HfFormat:
    """How ``stream_hf`` writes the tensors it assembles: ``convert`` maps one shard's tensors
    (full HF tensors in the model's dtype) to the tensors written (a cast, a quantisation; None:
    as they are); ``dtype`` is config.json's ``dtype`` (None: the model's, train.params_dtype);
    ``quantization_config`` goes into config.json when given."""

    convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    dtype: torch.dtype | None = None
    quantization_config: dict[str, Any] | None = None


@collective_purpose("hf_checkpoint")
def export_hf(job, load_dir: str, out_dir: str, int4: bool = False,
              mtp: bool = True) -> dict[str, Any]:
    """Write the checkpoint under ``load_dir`` (newest iteration) as an HF GLM-5 checkpoint in
    ``out_dir``; ``int4``: the routed experts as INT4 at ``train.int4_group_size``
    (glm5_train/int4_checkpoint.py); ``mtp=False``: without the MTP layer's tensors
    (``num_nextn_predict_layers`` 0). Also writes the tokenizer files of ``data.tokenizer`` and
    ``generation_config.json`` (see ``write_hf_extras``). Collective: call on every rank.
    Returns a report (complete on rank 0)."""
    started = time.perf_counter()
    check_exportable(job.model)
    problem = tokenizer_problem(job)  # on every rank, before any collective
    ensure_distributed(job)
    # Every rank learns of a problem any rank saw (a node that does not see the tokenizer
    # directory included) and refuses with the same line: none waits at a barrier.
    problems = [p for p in _all_gather(problem) if p]
    if problems:
        raise ValueError(problems[0])
    chunks = _build_chunks(job)
    load_checkpoint(load_dir, chunks, None, None, job.model)

    fmt = HfFormat()
    if int4:
        group_size = job.train.int4_group_size
        fmt = HfFormat(convert=lambda tensors: int4_checkpoint.quantize_tensors(tensors,
                                                                                group_size),
                       quantization_config=int4_checkpoint.quantization_config(group_size))
    report = stream_hf(job, chunks, out_dir, mtp=mtp, fmt=fmt)
    if report.get("mtp_tensors"):
        _log(mtp_note(report["mtp_tensors"], job.model.num_hidden_layers))
    dist.barrier()
    report["seconds"] = time.perf_counter() - started
    _log(f"exported {report['hf_tensors']} tensors in {len(report['files'])} shards "
         f"({report['bytes'] / 2**20:.1f} MiB) to {out_dir} in {report['seconds']:.1f} s")
    return report


@collective_purpose("hf_checkpoint")
def stream_hf(job, chunks: list[torch.nn.Module], out_dir: str, mtp: bool = True,
              fmt: HfFormat = HfFormat(), group=None) -> dict[str, Any]:
    """Write the weights of ``chunks`` (this rank's model chunks, DDP-wrapped or not, in any
    layout) as an HF GLM-5 checkpoint in ``out_dir``: one safetensors shard per decoder layer
    (MTP layers included unless ``mtp=False``) plus one for the embedding, final norm and
    output head, the index, config.json, generation_config.json and the tokenizer files of
    ``data.tokenizer``. For each shard, the ranks holding main replicas of its pieces send them
    to the first rank of ``group`` (None: the default group, every rank of the job), which
    assembles it, converts it (``fmt``) and writes it before moving on: that rank holds at most
    one layer. The weights are read, never written.

    Collective over ``group``. No barrier at the end (the caller says when the output is
    complete: export at once, the weight publisher after renaming it). Returns a report:
    ``out_dir``, ``files``, ``hf_tensors`` and ``bytes`` (counted by the writing rank, 0
    elsewhere); the writing rank adds ``tokenizer_files`` and ``mtp_tensors`` (MTP tensors
    written)."""
    layers = job.model.num_hidden_layers
    mtp_sets = job.model.mtp_sets if mtp else 0
    shards = layers + mtp_sets + 1
    mine = _pieces_by_shard(chunks, job.model, mtp, shards)
    counts = _all_gather([len(s) for s in mine], group)
    rank, writer = dist.get_rank(group), _global_rank(group, 0)
    if rank == 0:
        _prepare_out_dir(out_dir)
    dist.barrier(group)

    weight_map: dict[str, str] = {}
    problems: list[str] = []
    total_bytes = 0
    for shard in range(shards):
        if rank != 0:
            if mine[shard]:
                dist.send_object_list([_wire(mine[shard])], dst=writer, group=group)
            continue
        assembler = _Assembler()
        assembler.add(_wire(mine[shard]))
        for src in range(1, dist.get_world_size(group)):
            if counts[src][shard]:
                box: list = [None]
                dist.recv_object_list(box, src=_global_rank(group, src), group=group)
                assembler.add(box[0])
                box = None
        problems += assembler.problems()
        fname = shard_file(shard, shards)
        tensors = assembler.tensors if fmt.convert is None else fmt.convert(assembler.tensors)
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = fname
            total_bytes += tensor.numel() * tensor.element_size()
        del assembler, tensors

    problems = _broadcast(problems, group)
    if problems:
        raise ValueError(f"export to {out_dir} failed:\n  " + "\n  ".join(problems))
    report = {"out_dir": out_dir, "files": [shard_file(s, shards) for s in range(shards)],
              "hf_tensors": len(weight_map), "bytes": total_bytes}
    if rank == 0:
        _write_json(os.path.join(out_dir, INDEX_FILE),
                    {"metadata": {"total_size": total_bytes},
                     "weight_map": dict(sorted(weight_map.items()))})
        hf_config = glm5_to_hf_config(job.model, fmt.dtype or job.train.torch_dtype)
        hf_config["num_nextn_predict_layers"] = mtp_sets
        if fmt.quantization_config is not None:
            hf_config["quantization_config"] = fmt.quantization_config
        report["tokenizer_files"] = write_hf_extras(out_dir, hf_config, job.data.tokenizer)
        open_up_modes(out_dir, [*report["files"], INDEX_FILE, "config.json",
                                GENERATION_CONFIG_FILE, *report["tokenizer_files"]])
        report["mtp_tensors"] = sum(1 for name in weight_map
                                    if is_mtp_name(name, layers, mtp_sets))
    return report


def _pieces_by_shard(chunks: list[torch.nn.Module], model, mtp: bool,
                     shards: int) -> list[list[Piece]]:
    """This rank's pieces of every shard: main replicas only, so replicas (TP, DP, expert-DP,
    embedding copies) go once; the MTP layer's left out with ``mtp=False``."""
    layers = model.num_hidden_layers
    mine: list[list[Piece]] = [[] for _ in range(shards)]
    for tensor in local_tensors(chunks):
        if tensor.main_replica:
            for piece in pieces_of(tensor, layers):
                if not mtp and is_mtp_name(piece.hf_name, layers, model.mtp_sets):
                    continue
                mine[_shard_of(piece.hf_name, shards - 1)].append(piece)
    return mine


GENERATION_CONFIG_FILE = "generation_config.json"
# transformers' GlmMoeDsaForCausalLM has no MTP layer; it skips GLM-5's own (layer 78) by
# name and lists any other model.layers.<num_hidden_layers>.* tensors as UNEXPECTED on load.
HF_SKIPPED_MTP_LAYER = 78


def mtp_note(count: int, layers: int) -> str:
    """The one line export prints about the MTP tensors it wrote."""
    listed = ("" if layers == HF_SKIPPED_MTP_LAYER else
              "; its load report lists them as UNEXPECTED, which is expected")
    return (f"note: transformers' GlmMoeDsaForCausalLM has no MTP layer: it ignores the MTP "
            f"layer's {count} tensors (model.layers.{layers}.*; inference does not use "
            f"them){listed}; export --no-mtp leaves them out")


# A mismatched tokenizer is refused, not exported around (no --no-tokenizer): a weights-only
# export would leave transformers' GlmMoeDsaConfig defaults (eos 1, bos 0), which are as wrong
# for GLM-5 as the byte tokenizer's 256, so ``generate`` would still stop at an ordinary token
# and ``AutoTokenizer`` would find nothing. The fix is always at hand: the tokenizer directory
# the model was trained with, or the HF model directory it was imported from (/models/GLM-5).
def tokenizer_problem(job) -> str | None:
    """Why ``job.data.tokenizer`` must not go into an export of ``job.model`` (one line, see
    ``glm5_train.tokenizer.check_export_tokenizer``), or None. No process groups."""
    try:
        check_export_tokenizer(job.data.tokenizer, job.model.vocab_size)
    except (ValueError, OSError) as err:
        return str(err)
    return None


def write_hf_extras(out_dir: str, hf_config: dict, tokenizer: str) -> list[str]:
    """config.json and generation_config.json with the tokenizer's end-of-text (eos), bos and
    pad ids (transformers' GlmMoeDsaConfig defaults, eos 1 and bos 0, are not GLM-5's: with
    them ``generate`` would never stop at end of text), plus the tokenizer's files so
    ``AutoTokenizer.from_pretrained(out_dir)`` works; the names of the files copied."""
    _write_json(os.path.join(out_dir, "config.json"),
                {**hf_config, **special_token_ids(tokenizer)})
    _write_json(os.path.join(out_dir, GENERATION_CONFIG_FILE), generation_config(tokenizer))
    copied = copy_tokenizer_files(tokenizer, out_dir)
    if not copied:
        _note_once(f"note: data.tokenizer={tokenizer} has no Hugging Face tokenizer files: the "
                   "export carries none (set data.tokenizer=<the HF tokenizer directory> to "
                   "include them)")
    return copied


def open_up_modes(out_dir: str, names: list[str]) -> None:
    """Give the written files the mode a plain ``open()`` gives under the user's umask (0644
    under the usual 022): safetensors writes its files 0600, which other users (a serving
    job, a shared model directory) cannot read. A umask of 077 keeps them private. The
    directory keeps the mode it was created with (``os.makedirs``: 0777 & ~umask)."""
    umask = os.umask(0)
    os.umask(umask)
    for name in names:
        os.chmod(os.path.join(out_dir, name), 0o666 & ~umask)


def make_random_hf(job, hf_dir: str, seed: int = 0) -> dict[str, Any]:
    """A randomly initialised HF GLM-5 with the composed model's shapes (transformers' own
    init), as transformers saves it, plus the job's tokenizer files and generation_config:
    something to try import / train / export on without downloading a checkpoint. Small
    configs only (the whole model is built in memory). transformers builds no MTP layer:
    ``num_nextn_predict_layers`` is 0, so import and train it with ``model.mtp_num_steps=0``."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    check_exportable(job.model)
    problem = tokenizer_problem(job)
    if problem:
        raise ValueError(problem)
    fields = glm5_to_hf_config(job.model, job.train.torch_dtype)
    fields["num_nextn_predict_layers"] = 0
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**fields,
                                                 **special_token_ids(job.data.tokenizer)))
    os.makedirs(hf_dir, exist_ok=True)
    model.save_pretrained(hf_dir, safe_serialization=True)
    files = sorted(n for n in os.listdir(hf_dir) if n.startswith("model"))
    copied = write_hf_extras(hf_dir, read_hf_config(hf_dir), job.data.tokenizer)
    open_up_modes(hf_dir, [*files, "config.json", GENERATION_CONFIG_FILE, *copied])
    params = sum(p.numel() for p in model.parameters())
    _log(f"wrote a random GLM-5 of {params} parameters to {hf_dir} (no MTP layer: import and "
         "train it with model.mtp_num_steps=0)")
    return {"hf_dir": hf_dir, "params": params, "tokenizer_files": copied}


def _wire(pieces: list[Piece]) -> list[tuple]:
    """Pieces as picklable tuples, copied to host memory: only the slice travels (not its
    storage) and rank 0 receives CPU tensors whatever device the sender computes on."""
    return [(p.hf_name, p.hf_shape, p.hf_index, p.local.detach().to("cpu", copy=True))
            for p in pieces]


class _Assembler:
    """Rank 0's buffer for one shard: full HF tensors filled piece by piece."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.filled: Counter = Counter()

    def add(self, pieces: list[tuple]) -> None:
        for name, shape, index, data in pieces:
            if name not in self.tensors:
                self.tensors[name] = torch.empty(shape, dtype=data.dtype)
            self.tensors[name][index] = data
            self.filled[name] += data.numel()

    def problems(self) -> list[str]:
        return [f"{name}: {self.filled[name]} of {t.numel()} elements received"
                for name, t in self.tensors.items() if self.filled[name] != t.numel()]


@collective_purpose("hf_checkpoint")
def _broadcast(obj: Any, group=None) -> Any:
    """``obj`` of the first rank of ``group`` (None: the default group), on all its ranks."""
    box = [obj]
    dist.broadcast_object_list(box, src=_global_rank(group, 0), group=group)
    return box[0]


def _prepare_out_dir(out_dir: str) -> None:
    """Create ``out_dir``; drop weight files of an earlier export so none are left over."""
    os.makedirs(out_dir, exist_ok=True)
    for fname in os.listdir(out_dir):
        if fname in (INDEX_FILE, SINGLE_FILE) or (fname.startswith("model-")
                                                  and fname.endswith(".safetensors")):
            os.remove(os.path.join(out_dir, fname))


def _write_json(path: str, value: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(value, handle, indent=2)
        handle.write("\n")
    os.replace(tmp, path)


