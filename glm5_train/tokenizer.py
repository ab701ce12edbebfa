"""Tokenizers for the data pipeline.

Both classes expose the small interface the pipeline and megatron-core's ``GPTDataset`` use:
``tokenize(text) -> list[int]``, ``detokenize(ids) -> str`` and the properties ``eod``, ``pad``,
``vocab_size`` and ``unique_identifiers``.

``unique_identifiers`` is not optional: megatron-core's ``MegatronDataset`` serialises its config
(tokenizer included) with ``json.dumps(..., default=lambda obj: obj.unique_identifiers)`` to
derive the cache-file hash, so a tokenizer without it makes dataset construction fail. It must
also differ between tokenizers so their cached indices never collide.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import OrderedDict
from typing import Iterable

_BYTE_EOD = 256
_BYTE_PAD = 257


class ByteTokenizer:
    """UTF-8 byte tokenizer: ids 0..255 are bytes, 256 is end-of-document, 257 is padding."""

    def tokenize(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as token ids (no special tokens added)."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Decode token ids back to text, dropping special ids; invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @property
    def eod(self) -> int:
        return _BYTE_EOD

    @property
    def pad(self) -> int:
        return _BYTE_PAD

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Identity used by megatron-core to hash dataset caches."""
        return OrderedDict([("class", "glm5_train.tokenizer.ByteTokenizer"), ("vocab_size", 258)])

    @property
    def name(self) -> str:
        """Short filesystem-safe name, used to name per-tokenizer artefacts."""
        return "byte"


class HFTokenizer:
    """Wrapper around a local Hugging Face tokenizer directory (``transformers`` required)."""

    def __init__(self, path: str) -> None:
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"tokenizer directory {path!r} does not exist: pass a local directory holding "
                "tokenizer files (tokenizer.json / tokenizer_config.json), or use 'byte'")
        try:
            from transformers import AutoTokenizer  # optional dependency, import lazily
        except ImportError as err:
            raise ImportError(
                f"tokenizer {path!r} needs the 'transformers' package, which is not installed: "
                "run `pip install transformers`, or use the 'byte' tokenizer") from err
        self.path = os.path.abspath(path)
        self._tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer {path!r} defines no eos_token: documents need an "
                             "end-of-document id; set eos_token in tokenizer_config.json")

    def tokenize(self, text: str) -> list[int]:
        """Return token ids for ``text`` without BOS/EOS (the pipeline appends eod itself)."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Decode token ids, skipping special tokens."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def eod(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def pad(self) -> int:
        # Falls back to eod; megatron-core then notices the collision and pads with -1 instead.
        pad = self._tok.pad_token_id
        return int(pad) if pad is not None else self.eod

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens, unlike the HF ``vocab_size`` attribute.
        return len(self._tok)

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Identity used by megatron-core to hash dataset caches."""
        return OrderedDict([("class", "glm5_train.tokenizer.HFTokenizer"), ("path", self.path),
                            ("vocab_size", self.vocab_size)])

    @property
    def name(self) -> str:
        """Short filesystem-safe name, used to name per-tokenizer artefacts."""
        return tokenizer_name(self.path)


def tokenizer_name(spec: str) -> str:
    """Filesystem-safe name for a tokenizer spec, without loading it: ``byte`` or
    ``hf-<dirname>-<hash of absolute path>`` (the hash keeps same-named directories apart)."""
    if spec == "byte":
        return "byte"
    path = os.path.abspath(spec)
    base = os.path.basename(path.rstrip(os.sep)) or "hf"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in base)
    digest = hashlib.sha1(path.encode("utf-8")).hexdigest()[:8]
    return f"hf-{safe}-{digest}"


def build_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` -> ByteTokenizer; anything else is a local HF tokenizer directory."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


# ----------------------------------------------------------------------------------------------
# The tokenizer's files and special ids in a Hugging Face export
# ----------------------------------------------------------------------------------------------

# What a tokenizer directory holds for transformers' AutoTokenizer (any of these), never a
# model's weights or config.json: a tokenizer directory may be a whole model directory.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "added_tokens.json", "chat_template.jinja", "chat_template.json",
                      "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model")


# The byte tokenizer's 258 ids mean something only in a byte-level model: its vocabulary is
# those ids plus padding so the embedding splits over tensor-parallel ranks (glm5_tiny: 320,
# divisible by TP sizes up to 64). 1024 covers Megatron's usual padding to a multiple of
# 128 x TP for TP up to 8; anything larger is a model trained with a real tokenizer (GLM-5:
# 154880), in which id 256 is an ordinary token, not end of text.
BYTE_MODEL_MAX_VOCAB = 1024


def tokenizer_files(spec: str) -> list[str]:
    """The tokenizer files (HF_TOKENIZER_FILES, ``*.tiktoken``) of directory ``spec``."""
    return [n for n in sorted(os.listdir(spec))
            if n in HF_TOKENIZER_FILES or n.endswith(".tiktoken")]


def check_export_tokenizer(spec: str, model_vocab_size: int) -> None:
    """Refuse, in one line naming the value, the rule and the fix, a ``data.tokenizer`` whose
    ids an export of a model with ``model_vocab_size`` ids must not carry: one larger than the
    model (the training launcher's rule, glm5_train.assembly.check_data), the byte tokenizer
    for a model that is not byte-level (BYTE_MODEL_MAX_VOCAB), a directory without tokenizer
    files, or special ids at or past the model's vocabulary. No process groups: every rank
    runs it before any collective, file or weight is touched."""
    fix = ("pass data.tokenizer=<the HF tokenizer directory the model was trained with> so the "
           "export carries its tokenizer files and end-of-text id")
    if spec == "byte":
        size = ByteTokenizer().vocab_size
        if not size <= model_vocab_size <= BYTE_MODEL_MAX_VOCAB:
            raise ValueError(
                f"data.tokenizer=byte has {size} ids but model.vocab_size={model_vocab_size}: "
                f"the byte tokenizer's ids (end of text {_BYTE_EOD}) fit only a byte-level model "
                f"(model.vocab_size {size}..{BYTE_MODEL_MAX_VOCAB}); {fix}")
        return
    if not os.path.isdir(spec):
        raise FileNotFoundError(f"data.tokenizer={spec} is not a directory (an HF tokenizer "
                                f"directory or 'byte'): {fix}")
    if not tokenizer_files(spec):
        raise FileNotFoundError(
            f"data.tokenizer={spec} holds no tokenizer files (any of "
            f"{', '.join(HF_TOKENIZER_FILES)}): {fix}")
    try:
        tok = HFTokenizer(spec)
    except (OSError, ValueError, ImportError) as err:  # FileNotFoundError is an OSError
        raise ValueError(f"data.tokenizer={spec} cannot be loaded: "
                         f"{' '.join(str(err).split())}") from err
    if tok.vocab_size > model_vocab_size:
        raise ValueError(
            f"data.tokenizer={spec} has {tok.vocab_size} ids but model.vocab_size="
            f"{model_vocab_size}: a tokenizer may not have more ids than the model; {fix}")
    ids = special_token_ids(spec)
    past = [i for v in ids.values() for i in (v if isinstance(v, list) else [v])
            if i is not None and not 0 <= i < model_vocab_size]
    if past:
        raise ValueError(
            f"data.tokenizer={spec} has special ids {past} outside model.vocab_size="
            f"{model_vocab_size} (eos/bos/pad and generation_config.json's eos_token_id must "
            f"be ids of the model); {fix}")


def copy_tokenizer_files(spec: str, out_dir: str) -> list[str]:
    """Copy the HF tokenizer directory ``spec``'s tokenizer files into ``out_dir``; their
    names. The byte tokenizer has no files: nothing is copied."""
    if spec == "byte":
        return []
    names = tokenizer_files(spec)
    if not names:
        raise FileNotFoundError(f"tokenizer directory {spec!r} holds none of "
                                f"{', '.join(HF_TOKENIZER_FILES)}: pass the directory the "
                                "data was tokenized with as data.tokenizer")
    for name in names:
        shutil.copyfile(os.path.join(spec, name), os.path.join(out_dir, name))
    return names


def special_token_ids(spec: str) -> dict[str, int | list[int] | None]:
    """``eos_token_id`` (the end-of-document id first, then the end-of-turn ids of the
    directory's generation_config.json: generation stops at any of them; an int when there is
    one), ``bos_token_id`` and ``pad_token_id`` (None where the tokenizer has none)."""
    if spec == "byte":
        return {"eos_token_id": _BYTE_EOD, "bos_token_id": None, "pad_token_id": _BYTE_PAD}
    tok = HFTokenizer(spec)
    eos = [tok.eod]
    generation = os.path.join(spec, "generation_config.json")
    if os.path.exists(generation):
        with open(generation) as f:
            given = json.load(f).get("eos_token_id")
        eos += [int(i) for i in (given if isinstance(given, list) else [given])
                if i is not None and int(i) not in eos]
    return {"eos_token_id": eos[0] if len(eos) == 1 else eos,
            "bos_token_id": tok._tok.bos_token_id, "pad_token_id": tok._tok.pad_token_id}


def generation_config(spec: str) -> dict:
    """generation_config.json for an export: the tokenizer directory's own (sampling settings
    kept) with the special ids above, so transformers' ``generate`` stops at end of text."""
    config: dict = {}
    path = os.path.join(spec, "generation_config.json") if spec != "byte" else ""
    if path and os.path.exists(path):
        with open(path) as f:
            config = json.load(f)
    config.update({k: v for k, v in special_token_ids(spec).items() if v is not None})
    return config
