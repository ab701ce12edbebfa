"""Data pipeline: indexed-dataset writing, the built-in corpus, GPT datasets and the train iterator.

Flow: text (jsonl / plain files) -> ``build_indexed_dataset`` -> ``<prefix>.bin/.idx`` (megatron's
IndexedDataset format) -> ``build_train_valid_test_datasets`` (megatron's GPTDataset / blend) ->
``build_train_iterator`` (deterministic micro-batches per data-parallel rank).

``data.format=chat_sft`` trains on packed chat data instead (``glm5_train/chat_data.py``, made by
``tools/prepare_chat_sft.py``): the same iterator over ``ChatSFTDataset`` samples, whose loss
mask covers the assistant tokens only and whose batches carry the packed documents' boundaries
(``cu_seqlens``, ``max_seqlen``). Packed pretraining documents (``data.reset_attention_mask``)
travel the same way (``PackedGPTDataset``): no [s, s] attention mask is ever built.

With no dataset paths configured, ``ensure_builtin_corpus`` tokenizes the Python standard library's
own ``.py`` files, so a run works on any machine without downloads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import struct
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from glm5_train import chat_data
from glm5_train.rl.objective import ROLLOUT_FIELDS
from glm5_train.schedules import BatchSchedule
from glm5_train.tokenizer import tokenizer_name
from parallel import mcore_compat
from parallel.comm_purpose import collective_purpose

_PREPROCESS_HINT = ("python tools/preprocess_data.py --input <docs.jsonl> --output-prefix {prefix} "
                    "--tokenizer <byte|tokenizer-dir>")
_CHAT_SFT_HINT = chat_data.PREPARE_HINT
# data.format: megatron's GPTDataset, packed chat SFT, or RL rollout records
# (glm5_train/rl/records.py: jsonl or parquet files, trained with train.objective=grpo|dis|distill)
FORMATS = ("gpt", "chat_sft", "rollouts")
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------

@dataclass
class DataConfig:
    """Where training text comes from and how it is turned into samples."""

    paths: list[str] = field(default_factory=list)
    weights: list[float] | None = None
    tokenizer: str = "byte"
    split: str = "98,1,1"
    builtin_corpus_dir: str = "data/stdlib_corpus"
    builtin_max_files: int = 400
    num_workers: int = 0
    cache_dir: str | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    format: str = "gpt"

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "DataConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"data config: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    def validate(self) -> None:
        """Raise ValueError naming the field, the rule and the fix for an impossible config."""
        _check_paths_and_weights(self)
        parse_split(self.split)
        if self.format not in FORMATS:
            raise ValueError(f"data.format={self.format!r}: use one of {list(FORMATS)}")
        if self.format == "chat_sft":
            _check_chat_sft_config(self)
        if self.format == "rollouts":
            _check_rollouts_config(self)
        if not self.tokenizer:
            raise ValueError("data.tokenizer is empty: use 'byte' or a local HF tokenizer dir")
        if self.builtin_max_files < 1:
            raise ValueError(f"data.builtin_max_files={self.builtin_max_files} must be >= 1")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers={self.num_workers} must be >= 0 (0 = main process)")


def _check_rollouts_config(cfg: DataConfig) -> None:
    if not cfg.paths:
        raise ValueError("data.format=rollouts needs data.paths=[<records.jsonl|.parquet>, ...]: "
                         "rollout records (docs/rl.md; tools/rollout_records.py checks them)")
    # Each rollout is its own document with its own loss mask, positions restarting at 0 as
    # the engine that generated it had them.
    for name, fine in (("weights", None), ("eod_mask_loss", False),
                       ("reset_attention_mask", False), ("reset_position_ids", True)):
        value = getattr(cfg, name)
        if value != fine:
            raise ValueError(f"data.{name}={value} with data.format=rollouts: each rollout is "
                             "its own document (its own loss mask, positions from 0 as the "
                             f"engine had them); set data.{name}="
                             f"{'null' if fine is None else str(fine).lower()}")


def _check_chat_sft_config(cfg: DataConfig) -> None:
    hint = _CHAT_SFT_HINT.format(prefix="<prefix>")
    if not cfg.paths:
        raise ValueError("data.format=chat_sft needs data.paths=[<prefix>, ...]: datasets made "
                         f"by {hint}")
    if cfg.weights is not None:
        raise ValueError(f"data.weights={cfg.weights}: chat SFT datasets are concatenated, not "
                         "blended; set data.weights=null (or pack the files into one dataset)")
    if not cfg.tokenizer or cfg.tokenizer == "byte":
        raise ValueError(f"data.format=chat_sft with data.tokenizer={cfg.tokenizer}: set "
                         "data.tokenizer to the Hugging Face tokenizer directory the dataset was "
                         "made with")
    if cfg.eod_mask_loss:
        raise ValueError("data.eod_mask_loss=true with data.format=chat_sft: the loss mask comes "
                         "from the dataset (assistant tokens only); set data.eod_mask_loss=false")
    if cfg.reset_attention_mask:
        raise ValueError("data.reset_attention_mask=true with data.format=chat_sft: its batches "
                         "carry the conversations' boundaries (cu_seqlens), which already keep "
                         "each conversation's attention to itself, without a dense [s, s] mask; "
                         "set data.reset_attention_mask=false")
    for prefix in cfg.paths:  # the cheap part of check_datasets, so the hint is the right one
        if not chat_data.is_chat_sft_dataset(prefix):
            raise ValueError(f"data.format=chat_sft but {prefix} is not a chat SFT dataset (no "
                             f"{chat_data.metadata_path(prefix)}); create it with: "
                             f"{_CHAT_SFT_HINT.format(prefix=prefix)}")


def _check_paths_and_weights(cfg: DataConfig) -> None:
    if any(not isinstance(p, str) or not p for p in cfg.paths):
        raise ValueError(f"data.paths={cfg.paths!r}: every entry must be a non-empty dataset "
                         "prefix (the path without .bin/.idx)")
    if cfg.weights is None:
        return
    if len(cfg.weights) != len(cfg.paths):
        raise ValueError(f"data.weights has {len(cfg.weights)} entries but data.paths has "
                         f"{len(cfg.paths)}: give one weight per path, or weights: null")
    if any(not w > 0 for w in cfg.weights):
        raise ValueError(f"data.weights={cfg.weights}: blend weights must be > 0; drop a path "
                         "instead of giving it weight 0")


def parse_split(split: str) -> list[float]:
    """Parse ``"train,valid,test"`` weights (1 to 3 numbers, missing ones are 0)."""
    try:
        parts = [float(x) for x in split.split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"data.split={split!r} must be 1-3 comma-separated non-negative numbers "
                         "with a positive sum, e.g. '98,1,1'")
    if parts[0] <= 0:
        raise ValueError(f"data.split={split!r} gives the train split no data: make the first "
                         "number positive")
    return parts + [0.0] * (3 - len(parts))


# --------------------------------------------------------------------------------------------
# Writing indexed datasets
# --------------------------------------------------------------------------------------------

def expand_inputs(inputs: list[str]) -> list[str]:
    """Expand globs; every plain path must exist and every glob must match. Order is kept."""
    if not inputs:
        raise ValueError("no input files given: pass --input FILE [FILE ...] (globs allowed)")
    files: list[str] = []
    for spec in inputs:
        if glob.has_magic(spec):
            matches = sorted(glob.glob(spec, recursive=True))
            if not matches:
                raise FileNotFoundError(f"input glob {spec!r} matches no file: check the pattern")
            files.extend(matches)
        elif os.path.isfile(spec):
            files.append(spec)
        else:
            raise FileNotFoundError(f"input file {spec!r} does not exist: check the path")
    return files


def _iter_jsonl(path: str, json_key: str, encoding_errors: str) -> Iterator[str]:
    """Yield the ``json_key`` string of each non-blank line; errors name file, line and fix."""
    with open(path, "rb") as f:  # bytes, so a decode error gets its exact line number
        for lineno, raw in enumerate(f, start=1):
            line = _decode(raw, f"{path}:{lineno}", encoding_errors)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg}): each line must be "
                                 "one JSON object; fix or delete the line") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(json_key), str):
                raise ValueError(f"{path}:{lineno}: no string under key {json_key!r}: add the key "
                                 "or pass --json-key with the key that holds the text")
            yield obj[json_key]


def _read_text(path: str, encoding_errors: str) -> str:
    # Bytes in, so the document is exactly the file (no newline translation).
    with open(path, "rb") as f:
        return _decode(f.read(), path, encoding_errors)


def _decode(raw: bytes, where: str, encoding_errors: str) -> str:
    """UTF-8 decode (a leading BOM is dropped); ``where`` names the file/line in errors."""
    try:
        return raw.decode("utf-8-sig", errors=encoding_errors)
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not UTF-8 at byte {err.start} ({err.reason}): re-encode the "
                         "file as UTF-8") from None


def iter_documents(files: list[str], json_key: str = "text",
                   encoding_errors: str = "strict") -> Iterator[str]:
    """Yield document texts: one per jsonl line (``.jsonl``/``.json``), one per other file."""
    for path in files:
        if path.endswith((".jsonl", ".json")):
            yield from _iter_jsonl(path, json_key, encoding_errors)
        else:
            yield _read_text(path, encoding_errors)


def build_indexed_dataset(inputs: list[str], output_prefix: str, tokenizer, json_key: str = "text",
                          append_eod: bool = True,
                          encoding_errors: str = "strict") -> tuple[int, int]:
    """Tokenize ``inputs`` into ``<output_prefix>.bin/.idx``; return (documents, tokens).

    One document = one IndexedDataset sequence. Documents that tokenize to nothing are skipped.
    Output is written under temporary names and renamed at the end, so an error (missing file,
    bad jsonl line) leaves no ``.bin``/``.idx`` behind and an existing dataset untouched.
    """
    files = expand_inputs(inputs)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    tmp_prefix = f"{output_prefix}.tmp-{os.getpid()}"
    tmp_bin, tmp_idx = tmp_prefix + ".bin", tmp_prefix + ".idx"
    builder = IndexedDatasetBuilder(tmp_bin, dtype=DType.optimal_dtype(tokenizer.vocab_size))
    try:
        n_docs, n_tokens = _write_documents(builder, iter_documents(files, json_key,
                                                                    encoding_errors),
                                            tokenizer, append_eod)
        if n_docs == 0:
            raise ValueError(f"inputs {inputs} hold no non-empty document: nothing to train on")
        builder.finalize(tmp_idx)
        # .idx last: a reader that sees the .idx sees a complete .bin.
        os.replace(tmp_bin, output_prefix + ".bin")
        os.replace(tmp_idx, output_prefix + ".idx")
    except BaseException:
        builder.data_file.close()
        for tmp in (tmp_bin, tmp_idx):
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
        raise
    return n_docs, n_tokens


def _write_documents(builder, docs: Iterator[str], tokenizer, append_eod: bool) -> tuple[int, int]:
    n_docs = n_tokens = 0
    for text in docs:
        ids = tokenizer.tokenize(text)
        if not ids:
            continue
        if append_eod:
            ids = ids + [tokenizer.eod]
        # numpy converts a long Python list ~3x faster than torch.tensor does.
        builder.add_item(torch.from_numpy(numpy.array(ids, dtype=numpy.int64)))
        builder.end_document()
        n_docs += 1
        n_tokens += len(ids)
    return n_docs, n_tokens


# --------------------------------------------------------------------------------------------
# Checking indexed datasets
# --------------------------------------------------------------------------------------------

def check_dataset_prefix(prefix: str, hint: str = _PREPROCESS_HINT) -> None:
    """Raise FileNotFoundError / ValueError naming the file and the fix if ``prefix`` is unusable.

    Checks that ``<prefix>.bin`` and ``<prefix>.idx`` exist, that the index parses, holds at least
    one document, and that the ``.bin`` size matches what the index describes. ``hint``: the
    command that makes such a dataset (``{prefix}`` filled in).
    """
    hint = hint.format(prefix=prefix)
    for suffix in (".idx", ".bin"):
        if not os.path.isfile(prefix + suffix):
            raise FileNotFoundError(f"dataset file {prefix + suffix} not found; create the "
                                    f"dataset with: {hint}")
    try:
        _check_idx_layout(prefix + ".idx")
        ds = IndexedDataset(prefix, multimodal=False, mmap=False)
        lengths, pointers = ds.index.sequence_lengths, ds.index.sequence_pointers
        itemsize = ds.index.dtype_size
        n_seqs = len(lengths)
    except Exception as err:  # megatron reports corruption via assert / numpy errors
        raise ValueError(f"dataset index {prefix}.idx is corrupt ({type(err).__name__}: {err}); "
                         f"delete {prefix}.bin/.idx and re-create them with: {hint}") from err
    if n_seqs == 0:
        raise ValueError(f"dataset {prefix} holds no documents; re-create it from non-empty "
                         f"input with: {hint}")
    expected = int(pointers[-1]) + int(lengths[-1]) * itemsize
    actual = os.path.getsize(prefix + ".bin")
    if actual != expected:
        raise ValueError(f"dataset data file {prefix}.bin has {actual} bytes but its index "
                         f"describes {expected} (truncated or mismatched copy); re-create both "
                         f"with: {hint}")


# megatron's .idx layout (indexed_dataset._IndexWriter): magic, <Q version, <B dtype code,
# <Q sequence count, <Q document count, then int32 lengths, int64 pointers, int64 doc indices.
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_FIXED = struct.Struct("<9sQBQQ")


def _check_idx_layout(idx_path: str) -> None:
    """Validate the .idx header and size before megatron parses it.

    megatron's IndexedDataset fails on a bad header with an assert *and* then raises again from
    ``__del__`` on the half-built object, so catch the common corruptions here first.
    """
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_IDX_FIXED.size)
    if len(head) < _IDX_FIXED.size:
        raise ValueError(f"{size}-byte file is shorter than the {_IDX_FIXED.size}-byte header")
    magic, version, _, n_seqs, n_docs = _IDX_FIXED.unpack(head)
    if magic != _IDX_MAGIC or version != 1:
        raise ValueError("not a megatron indexed-dataset index (bad magic or version)")
    expected = _IDX_FIXED.size + n_seqs * (4 + 8) + n_docs * 8
    if size < expected:
        raise ValueError(f"index is {size} bytes, its header announces at least {expected}")


_SCAN_TOKENS = 1 << 24  # tokens read at a time by check_token_ids


def check_token_ids(prefix: str, vocab_size: int, cache_dir: str | None = None) -> None:
    """Refuse a dataset holding a token id at or past ``vocab_size`` (it would index past the
    embedding: a crash on the GPU, garbage on a CPU), naming the file, the document and the
    position of the first such token.

    Reads the ``.bin`` once; the largest id is then cached beside megatron's index cache
    (``<cache_dir or <dataset dir>/index-cache>/<name>.max_token_id.json``, keyed by the file's
    size and modification time), so later opens cost a ``stat``. A token type that cannot hold
    ``vocab_size`` (uint16 under a larger vocabulary) needs no reading at all."""
    index = IndexedDataset(prefix, multimodal=False, mmap=False).index
    dtype = numpy.dtype(index.dtype)
    if numpy.iinfo(dtype).max < vocab_size:
        return
    largest = _max_token_id(prefix, dtype, cache_dir)
    if largest < vocab_size:
        return
    document, position, token = _first_token_at_or_past(prefix, dtype, index, vocab_size)
    raise ValueError(
        f"dataset {prefix}.bin: document {document} (token {position} of it) holds token id "
        f"{token}, at or past the vocabulary's {vocab_size} ids (largest id in the file: "
        f"{largest}): it was made with another tokenizer; re-create it with this one "
        f"({_PREPROCESS_HINT.format(prefix=prefix)}), or set data.tokenizer to the one it was "
        "made with")


def _max_token_id(prefix: str, dtype: numpy.dtype, cache_dir: str | None) -> int:
    stat = os.stat(prefix + ".bin")
    key = {"bin_bytes": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns}
    cache = os.path.join(cache_dir or os.path.join(os.path.dirname(os.path.abspath(prefix)),
                                                   "index-cache"),
                         os.path.basename(prefix) + ".max_token_id.json")
    with contextlib.suppress(OSError, ValueError, KeyError):
        with open(cache) as handle:
            cached = json.load(handle)
        if {k: cached[k] for k in key} == key:
            return int(cached["max_token_id"])
    tokens = numpy.memmap(prefix + ".bin", dtype=dtype, mode="r")
    largest = max((int(tokens[i:i + _SCAN_TOKENS].max())
                   for i in range(0, len(tokens), _SCAN_TOKENS)), default=-1)
    with contextlib.suppress(OSError):  # a read-only dataset directory: no cache, no harm
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = f"{cache}.tmp{os.getpid()}"
        with open(tmp, "w") as handle:
            json.dump({**key, "max_token_id": largest}, handle)
        os.replace(tmp, cache)
    return largest


def _first_token_at_or_past(prefix: str, dtype: numpy.dtype, index,
                            vocab_size: int) -> tuple[int, int, int]:
    """(document, position in it, id) of the file's first token id >= ``vocab_size``."""
    tokens = numpy.memmap(prefix + ".bin", dtype=dtype, mode="r")
    for start in range(0, len(tokens), _SCAN_TOKENS):
        hits = numpy.flatnonzero(tokens[start:start + _SCAN_TOKENS] >= vocab_size)
        if len(hits):
            offset = start + int(hits[0])
            starts = numpy.asarray(index.sequence_pointers) // dtype.itemsize
            document = int(numpy.searchsorted(starts, offset, side="right")) - 1
            return document, offset - int(starts[document]), int(tokens[offset])
    raise AssertionError("a token at or past the vocabulary was counted but not found")


# --------------------------------------------------------------------------------------------
# Built-in corpus (Python standard library sources)
# --------------------------------------------------------------------------------------------

def builtin_corpus_prefix(cfg: DataConfig) -> str:
    """Prefix of the built-in corpus for ``cfg``: named after tokenizer, Python and file count,
    so byte and HF corpora (or different stdlib versions) never collide."""
    return _corpus_prefix(cfg, tokenizer_name(cfg.tokenizer))


def _corpus_prefix(cfg: DataConfig, tok_name: str) -> str:
    py = f"py{sys.version_info.major}.{sys.version_info.minor}"
    return os.path.join(cfg.builtin_corpus_dir, f"stdlib-{py}-{tok_name}-{cfg.builtin_max_files}")


def stdlib_source_files(max_files: int) -> list[str]:
    """First ``max_files`` stdlib ``.py`` files by sorted relative path (no tests/site-packages)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    found.sort(key=lambda rel: rel.replace(os.sep, "/"))
    return [os.path.join(root, rel) for rel in found[:max_files]]


def ensure_builtin_corpus(cfg: DataConfig, tokenizer) -> str:
    """Build the stdlib corpus once (global rank 0, atomically) and return its prefix.

    Must be called by every rank when torch.distributed is initialised (it contains a barrier).
    A corpus that already exists and passes ``check_dataset_prefix`` is reused as is.
    """
    # Name after the tokenizer actually used (it may have been built from another spec).
    name = getattr(tokenizer, "name", None)
    prefix = _corpus_prefix(cfg, name) if name else builtin_corpus_prefix(cfg)
    error: BaseException | None = None
    if _global_rank() == 0 and not _prefix_is_valid(prefix):
        try:
            # errors="replace": the corpus must build on any interpreter, odd bytes or not.
            build_indexed_dataset(stdlib_source_files(cfg.builtin_max_files), prefix, tokenizer,
                                  encoding_errors="replace")
        except Exception as err:  # re-raised after the barrier so other ranks don't hang
            error = err
    _barrier()
    if error is not None:
        raise error
    check_dataset_prefix(prefix)  # other ranks: clear error if rank 0's files aren't visible
    return prefix


def _prefix_is_valid(prefix: str) -> bool:
    try:
        check_dataset_prefix(prefix)
    except (FileNotFoundError, ValueError):
        return False
    return True


def _global_rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@collective_purpose("data_barrier")
def _barrier() -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# --------------------------------------------------------------------------------------------
# GPT datasets
# --------------------------------------------------------------------------------------------

def build_train_valid_test_datasets(cfg: DataConfig, tokenizer, seq_length: int, seed: int,
                                    num_samples: tuple[int, int, int]) -> tuple:
    """Build (train, valid, test) megatron GPT datasets (a split may be None if its weight is 0).

    ``num_samples`` is the minimum number of samples per split; each sample is a dict of
    ``tokens``/``labels``/``loss_mask``/``position_ids`` of length ``seq_length`` (labels are
    tokens shifted left by one). Call on every rank: megatron builds index caches on global
    rank 0 first, then barriers, then the other ranks load them. ``data.format=chat_sft``:
    ``ChatSFTDataset`` splits instead (no index caches).
    """

    cfg.validate()
    if cfg.format == "chat_sft":
        return build_chat_sft_datasets(cfg, tokenizer, seq_length, seed, num_samples)
    paths = [ensure_builtin_corpus(cfg, tokenizer)] if not cfg.paths else list(cfg.paths)
    check_datasets(paths, cfg.split, data_format=cfg.format)
    for prefix in paths:
        check_token_ids(prefix, tokenizer.vocab_size, cfg.cache_dir)
    gpt_cfg = _gpt_dataset_config(cfg, tokenizer, paths, seq_length, seed)
    dataset_class = PackedGPTDataset if cfg.reset_attention_mask else GPTDataset
    builder = BlendedMegatronDatasetBuilder(dataset_class, list(num_samples), lambda: True,
                                            gpt_cfg)
    with mcore_compat.single_process_rank_zero():
        return tuple(builder.build())


def check_datasets(paths: list[str], split: str, data_format: str | None = None,
                   seq_length: int | None = None, tokenizer=None) -> list[dict | None]:
    """Every dataset prefix exists, is readable and gives each split with weight > 0 at least
    one document (checked before any process group exists when the paths are given).

    A chat SFT dataset (``tools/prepare_chat_sft.py``) is checked as such: its tokens, its loss
    mask and their agreement, and its split over packed sequences. Given ``data_format``, every
    prefix must be of that format; given ``seq_length`` / ``tokenizer``, a chat SFT dataset must
    have been packed for that length with that tokenizer. Returns each prefix's chat SFT
    metadata (None for a GPT dataset)."""
    metadata = []
    for prefix in paths:
        if chat_data.is_chat_sft_dataset(prefix):
            metadata.append(_check_chat_sft_dataset(prefix, split, data_format, seq_length,
                                                    tokenizer))
            continue
        if data_format == "chat_sft":
            raise ValueError(f"data.format=chat_sft but {prefix} is not a chat SFT dataset (no "
                             f"{chat_data.metadata_path(prefix)}); create it with: "
                             f"{_CHAT_SFT_HINT.format(prefix=prefix)}")
        check_dataset_prefix(prefix)
        _check_split_nonempty(prefix, split)
        metadata.append(None)
    return metadata


def _check_chat_sft_dataset(prefix: str, split: str, data_format: str | None,
                            seq_length: int | None, tokenizer) -> dict:
    if data_format == "gpt":
        raise ValueError(f"{prefix} is a chat SFT dataset but data.format=gpt would train on "
                         "all of its tokens, ignoring its loss mask: use data=chat_sft (or "
                         "data.format=chat_sft)")
    check_dataset_prefix(prefix, _CHAT_SFT_HINT)
    check_dataset_prefix(chat_data.loss_mask_prefix(prefix), _CHAT_SFT_HINT.replace(
        "{prefix}", prefix))
    meta = chat_data.check_chat_sft_layout(prefix)
    for name, bookends in zip(("train", "valid", "test"), split_ranges(meta["sequences"], split)):
        if bookends is not None and bookends[0] == bookends[1]:
            raise ValueError(f"data.split={split!r} gives the {name} split 0 of the "
                             f"{meta['sequences']} packed sequences in {prefix}: add data, or "
                             "set that split's weight to 0 (e.g. '100,0,0')")
    if seq_length is not None and tokenizer is not None:
        chat_data.check_compatible(prefix, meta, seq_length, tokenizer)
    return meta


def split_ranges(count: int, split: str) -> list[tuple[int, int] | None]:
    """[first, stop) of each of the train / valid / test splits of ``count`` items (None for a
    split of weight 0), rounded as megatron-core's dataset builder rounds them."""
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    # Same rounding as BlendedMegatronDatasetBuilder._build_megatron_dataset_splits.
    return [None if bookends is None else (int(round(bookends[0] * float(count))),
                                           int(round(bookends[1] * float(count))))
            for bookends in matrix]


def build_chat_sft_datasets(cfg: DataConfig, tokenizer, seq_length: int, seed: int,
                            num_samples: tuple[int, int, int]) -> tuple:
    """(train, valid, test) ``ChatSFTDataset`` of the chat SFT datasets ``cfg.paths``
    (concatenated; each split separately; None for a split of weight 0)."""
    metadata = check_datasets(list(cfg.paths), cfg.split, "chat_sft", seq_length, tokenizer)
    per_path = [split_ranges(meta["sequences"], cfg.split) for meta in metadata]
    splits = []
    for which, samples in enumerate(num_samples):
        if per_path[0][which] is None:
            splits.append(None)
            continue
        sources = [chat_data.PackSource(prefix, *ranges[which])
                   for prefix, ranges in zip(cfg.paths, per_path)]
        splits.append(chat_data.ChatSFTDataset(sources, seq_length, seed, samples,
                                               metadata[0]["pad"], cfg.reset_position_ids))
    return tuple(splits)


def _gpt_dataset_config(cfg: DataConfig, tokenizer, paths: list[str], seq_length: int, seed: int):
    # A single weighted path would only add a pointless BlendedDataset wrapper.
    weights = list(cfg.weights) if cfg.weights is not None and len(paths) > 1 else None
    cache_dir = cfg.cache_dir or os.path.join(os.path.dirname(os.path.abspath(paths[0])),
                                              "index-cache")
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(paths, weights),
        split=cfg.split,
        path_to_cache=cache_dir,
        mmap_bin_files=True,
        tokenizer=tokenizer,
        reset_position_ids=cfg.reset_position_ids,
        reset_attention_mask=cfg.reset_attention_mask,
        eod_mask_loss=cfg.eod_mask_loss,
        # Never megatron's dense [1, s, s] mask (41 GB at 202,752 tokens): without packed
        # documents the attention is causal by itself; with them (reset_attention_mask) each
        # sample carries its documents' boundaries instead (PackedGPTDataset).
        create_attention_mask=False,
    )


class PackedGPTDataset(GPTDataset):
    """megatron's GPTDataset for packed documents (``data.reset_attention_mask``): each sample
    also holds its documents' boundaries, ``cu_seqlens`` int32 ``[0, end_1, ..., seq_length]``,
    as chat SFT samples do (``chat_data.build_sample``), in place of megatron's document-causal
    [1, s, s] mask. The step turns them into per-token document starts [b, s]
    (``step.packed_documents``), which the attention reads without any [s, s] tensor.

    The boundaries follow megatron's mask exactly: a document ends with (and includes) its
    end-of-document token. (Being another class, its index cache is kept apart from plain
    GPTDataset's; the samples' tokens are the same.)"""

    def __getitem__(self, idx: int | None) -> dict[str, torch.Tensor]:
        sample = super().__getitem__(idx)
        # Read the sample's tokens again as megatron's mask function saw them: the sample's own
        # tokens had padding mapped to id 0, which may be the end-of-document id.
        text, _ = self._query_document_sample_shuffle_indices(0 if idx is None else idx)
        tokens = text[:self.config.sequence_length]
        sample["cu_seqlens"] = eod_boundaries(tokens, self.config.tokenizer.eod)
        return sample


def eod_boundaries(tokens: numpy.ndarray, eod: int) -> torch.Tensor:
    """int32 ``[0, end_1, ..., len(tokens)]``: each document ends just after an ``eod`` token
    (one on the last token closes the sample's last document, which ends there anyway)."""
    seq = len(tokens)
    ends = numpy.flatnonzero(numpy.asarray(tokens) == eod) + 1
    bounds = numpy.concatenate([[0], ends[ends < seq], [seq]])
    return torch.from_numpy(bounds.astype(numpy.int32))


def _check_split_nonempty(prefix: str, split: str) -> None:
    """Fail fast where megatron would hang: a split with weight > 0 but zero documents.

    GPTDataset keeps adding epochs until it has enough tokens; with 0 documents per epoch that
    loop never ends. Uses megatron's own rounding of split fractions to document counts.
    """

    n_docs = len(IndexedDataset(prefix, multimodal=False, mmap=False).index.sequence_lengths)
    for name, bookends in zip(("train", "valid", "test"), split_ranges(n_docs, split)):
        if bookends is not None and bookends[0] == bookends[1]:
            raise ValueError(f"data.split={split!r} gives the {name} split 0 of the {n_docs} "
                             f"documents in {prefix}: add data, or set that split's weight to 0 "
                             "(e.g. '100,0,0')")


# --------------------------------------------------------------------------------------------
# Train iterator
# --------------------------------------------------------------------------------------------

class MicroBatchSampler:
    """Yields the dataset indices of each micro-batch of one data-parallel rank, in order.

    Global batch ``g`` is samples ``[g*GBS, (g+1)*GBS)``; rank ``r`` owns the contiguous slice
    starting at ``g*GBS + r*(GBS//dp)``, cut into micro-batches of ``MBS``. Iteration starts at
    global batch ``consumed_samples // GBS`` and stops before a global batch the dataset can't
    fill, so a DP-n run sees exactly the global batches of a 1-process run.

    With a batch-size ramp (``rampup``, ``glm5_train.schedules``) each global batch starts
    where the previous one ended and holds the ramp's size at that point: the same layout, batch
    by batch.
    """

    def __init__(self, total_samples: int, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, consumed_samples: int,
                 rampup: list[int] | None = None) -> None:
        self.schedule = BatchSchedule(global_batch_size, micro_batch_size, dp_size, rampup)
        _check_batch_layout(micro_batch_size, global_batch_size, dp_rank, dp_size,
                            consumed_samples, self.schedule)
        self.total = total_samples
        self.mbs, self.gbs = micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed = consumed_samples

    def batches(self) -> Iterator[tuple[int, int]]:
        """(first sample, size) of each global batch from ``consumed`` on that fits."""
        start = self.consumed
        while True:
            size = self.schedule.size_at(start)
            if start + size > self.total:
                return
            yield start, size
            start += size

    def __iter__(self) -> Iterator[list[int]]:
        for start, size in self.batches():
            per_rank = size // self.dp_size
            first = start + self.dp_rank * per_rank
            for j in range(per_rank // self.mbs):
                yield list(range(first + j * self.mbs, first + (j + 1) * self.mbs))

    def __len__(self) -> int:
        if not self.schedule.ramps:
            left = max(0, self.total // self.gbs - self.consumed // self.gbs)
            return left * (self.gbs // self.dp_size // self.mbs)
        return sum(size // self.dp_size // self.mbs for _, size in self.batches())


def _check_batch_layout(mbs: int, gbs: int, dp_rank: int, dp_size: int, consumed: int,
                        schedule: BatchSchedule) -> None:
    if mbs < 1 or dp_size < 1 or gbs % (mbs * dp_size):
        raise ValueError(f"global_batch_size={gbs} must be a positive multiple of "
                         f"micro_batch_size*dp_size={mbs}*{dp_size}: adjust the batch sizes")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    if consumed < 0 or (consumed % gbs if not schedule.ramps
                        else schedule.steps_at(consumed) is None):
        raise ValueError(f"consumed_samples={consumed} must be a non-negative multiple of "
                         f"global_batch_size={gbs} (steps_done * global_batch_size)"
                         if not schedule.ramps else
                         f"consumed_samples={consumed} is not where a step of the batch-size "
                         "ramp ends (train.rampup_batch_size)")


# and rollout micro-batches' per-token fields (glm5_train/rl/objective.py)
_BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask",
               *ROLLOUT_FIELDS)


def collate_samples(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack per-sample tensors: tokens/labels/position_ids int64 [mbs, seq], loss_mask float
    [mbs, seq], attention_mask bool [mbs, 1, seq, seq] (True = masked out) when a dataset of
    another source brings one (ours never do). Packed samples (chat SFT, ``PackedGPTDataset``)
    also give their documents' boundaries, laid end to end over the micro-batch:
    ``cu_seqlens`` int32 [segments + 1] and ``max_seqlen`` (``chat_data``)."""
    keys = [k for k in _BATCH_KEYS if k in samples[0] and samples[0][k] is not None]
    batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in keys}
    if "cu_seqlens" in samples[0]:
        batch.update(chat_data.batch_cu_seqlens([s["cu_seqlens"] for s in samples],
                                                batch["tokens"].shape[1]))
    return batch


def build_train_iterator(dataset, micro_batch_size: int, global_batch_size: int, dp_rank: int,
                         dp_size: int, consumed_samples: int, num_workers: int = 0,
                         rampup: list[int] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Iterator over this rank's micro-batches (see ``MicroBatchSampler`` for the layout).

    Yields dicts from ``collate_samples``; ends when the dataset can't fill the next global
    batch. Worker processes (``num_workers``) don't change the order.
    """
    sampler = MicroBatchSampler(len(dataset), micro_batch_size, global_batch_size, dp_rank,
                                dp_size, consumed_samples, rampup)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                         collate_fn=collate_samples,
                                         persistent_workers=num_workers > 0)
    return iter(loader)
