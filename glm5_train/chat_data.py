"""Chat SFT data: chat jsonl -> packed indexed dataset with an assistant-only loss mask, and its
reader for training.

Input: one conversation per line, OpenAI style ``{"messages": [{"role": ..., "content": ...},
...], "tools": [...]}`` (roles system / user / assistant / tool; assistant messages may carry
``tool_calls``). Each conversation is rendered with the chat template of a local Hugging Face
tokenizer directory and tokenized; its loss mask is 1 exactly on what the assistant generates:
its content (tool calls included) and the token that ends its turn, never the template's role
headers, the other roles or the template's preamble.

How the assistant spans are found (any template that renders a conversation's prefixes as
prefixes of the whole): the rendered text of ``messages[:i]``, of ``messages[:i]`` plus the
generation prompt (the assistant header) and of ``messages[:i + 1]`` give each message's
header and content as character ranges of the whole rendering; each range is tokenized on its
own, so token and mask boundaries coincide by construction (and the prompt tokens are the ones
the model is given at inference, where the prompt is tokenized up to the generation prompt).
The turn's end is the last end-of-turn token inside its content (ChatML's ``<|im_end|>``);
templates without a closing token (GLM: the next role token ends the turn) get the token that
follows it, which must be an end-of-turn token (the tokenizer's eos and the eos ids of
``generation_config.json``), or at the end of the conversation the end-of-document token that
closes every conversation. Templates with ``{% generation %}`` markers are checked against them.

Output (``write_chat_sft_dataset``), for a prefix P:

- ``P.bin`` / ``P.idx``: megatron-core's indexed dataset of the tokens, written with its
  ``IndexedDatasetBuilder``: one item (megatron's "sequence") per conversation, one megatron
  "document" per packed training sequence (``index.document_indices``), so the per-conversation
  lengths and the packing are both in the index;
- ``P_loss_mask.bin`` / ``.idx``: the same layout holding the uint8 loss mask of every token;
- ``P.chat_sft.json``: format, sequence length, tokenizer identity and counts (written last).

Packing: conversations are never split; each goes into the first of a bounded set of open
sequences it fits (first fit, deterministic), a conversation longer than the sequence is refused
or truncated (by flag), padding is added by the reader at the end of a sequence with loss mask 0.

``ChatSFTDataset`` reads it back for training: tokens, labels (next tokens), the loss mask on
labels, position ids and the document boundaries (``cu_seqlens``), from which the job makes
attention document-aware (``glm5_train.step.packed_documents``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

ROLES = ("system", "user", "assistant", "tool")
FORMAT_NAME = "glm5_train.chat_sft"
FORMAT_VERSION = 1
METADATA_SUFFIX = ".chat_sft.json"
LOSS_MASK_SUFFIX = "_loss_mask"
OVERLONG_CHOICES = ("refuse", "truncate")
PREPARE_HINT = ("python tools/prepare_chat_sft.py --input <chat.jsonl> --output-prefix {prefix} "
                "--tokenizer <hf-tokenizer-dir> --seq-length <tokens>")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
_JINJA_COMMENT = re.compile(r"{#.*?#}", re.DOTALL)


class ChatDataError(ValueError):
    """Bad chat input or template: the message names the file, line and the fix."""


# --------------------------------------------------------------------------------------------
# Reading and checking conversations
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    tools: list[dict] | None
    where: str  # "file:line", for errors


def read_conversations(files: list[str]) -> Iterator[Conversation]:
    """Yield every conversation of ``files`` (jsonl), checked; blank lines are skipped."""
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"chat file {path!r} does not exist: check the path")
        with open(path, "rb") as f:  # bytes, so a decode error gets its exact line number
            for lineno, raw in enumerate(f, start=1):
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8-sig")
                except UnicodeDecodeError as err:
                    raise ChatDataError(f"{where}: not UTF-8 at byte {err.start} ({err.reason}): "
                                        "re-encode the file as UTF-8") from None
                if line.strip():
                    yield parse_conversation(line, where)


def parse_conversation(line: str, where: str) -> Conversation:
    """One jsonl line -> a checked ``Conversation`` (None-valued keys dropped, as transformers'
    ``apply_chat_template`` does)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise ChatDataError(f"{where}: not valid JSON ({err.msg}): each line must be one JSON "
                            "object {\"messages\": [...]}; fix or delete the line") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj[
            "messages"]:
        raise ChatDataError(f"{where}: no non-empty 'messages' list: each line must be "
                            "{\"messages\": [{\"role\": ..., \"content\": ...}, ...]}")
    tools = obj.get("tools")
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, dict) for t in tools)):
        raise ChatDataError(f"{where}: 'tools' must be a list of tool definitions (objects)")
    messages = [_checked_message(m, i, where) for i, m in enumerate(obj["messages"])]
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatDataError(f"{where}: no assistant turn, so nothing to learn from: add the "
                            "assistant's reply or drop the line")
    return Conversation(messages, tools or None, where)


def _checked_message(message: Any, index: int, where: str) -> dict:
    at = f"{where}: message {index}"
    if not isinstance(message, dict):
        raise ChatDataError(f"{at} is not an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ROLES:
        raise ChatDataError(f"{at} has unknown role {role!r}: roles are {', '.join(ROLES)}")
    message = {k: v for k, v in message.items() if v is not None}
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise ChatDataError(f"{at} ({role}) has 'tool_calls': only assistant messages call "
                                "tools")
        _check_tool_calls(calls, at)
    content = message.get("content")
    if content is None and not calls:
        raise ChatDataError(f"{at} ({role}) has no 'content' (only an assistant message with "
                            "'tool_calls' may omit it)")
    if content is not None and not isinstance(content, str):
        raise ChatDataError(f"{at} ({role}): 'content' must be a string, got "
                            f"{type(content).__name__} (join multi-part content into one text)")
    return message


def _check_tool_calls(calls: Any, at: str) -> None:
    if not isinstance(calls, list) or not calls:
        raise ChatDataError(f"{at}: 'tool_calls' must be a non-empty list")
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ChatDataError(f"{at}: every tool call needs {{\"function\": {{\"name\": ..., "
                                "\"arguments\": ...}}} (OpenAI form)")
        if not isinstance(function.get("arguments", {}), (dict, str)):
            raise ChatDataError(f"{at}: tool call {function['name']!r}: 'arguments' must be an "
                                "object or a JSON string")


# --------------------------------------------------------------------------------------------
# Rendering with the chat template: token ids and the assistant loss mask
# --------------------------------------------------------------------------------------------

@dataclass(eq=False)  # compared by identity (numpy arrays have no single truth value)
class EncodedConversation:
    ids: numpy.ndarray   # int64 [n]; ends with the end-of-document token unless truncated
    mask: numpy.ndarray  # uint8 [n]; 1 on assistant tokens (content and end of turn)
    where: str

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class _Segment:
    start: int  # character range in the rendered conversation
    end: int
    message: int  # index of the message it belongs to
    assistant_content: bool


class ChatTemplateEncoder:
    """A local HF tokenizer directory's chat template, turning conversations into token ids and
    assistant loss masks (the module docstring says how)."""

    def __init__(self, tokenizer_dir: str, end_of_turn_tokens: Iterable[str] = ()) -> None:
        self.tokenizer = load_hf_tokenizer(tokenizer_dir)
        self.path = os.path.abspath(tokenizer_dir)
        tok = self.tokenizer
        template = tok.chat_template
        if not template:
            raise ChatDataError(
                f"tokenizer {tokenizer_dir!r} has no chat template (neither chat_template.jinja "
                "nor 'chat_template' in tokenizer_config.json): use the model's own tokenizer "
                "directory, or add its chat template there")
        if not isinstance(template, str):
            raise ChatDataError(f"tokenizer {tokenizer_dir!r} has several named chat templates "
                                f"({sorted(template)}): keep the one to train with")
        self.template = template
        self.has_generation_markers = bool(_GENERATION_TAG.search(_JINJA_COMMENT.sub("",
                                                                                template)))
        if tok.eos_token_id is None:
            raise ChatDataError(f"tokenizer {tokenizer_dir!r} defines no eos_token: every "
                                "conversation ends with it; set eos_token in "
                                "tokenizer_config.json")
        self.eod = int(tok.eos_token_id)
        self.pad = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eod
        self.vocab_size = len(tok)
        self.end_of_turn = _end_of_turn_ids(tok, self.path, end_of_turn_tokens)

    # ---- rendering

    def render(self, messages: list[dict], tools: list | None, where: str,
               add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as err:  # jinja's TemplateError, raise_exception(), a template bug
            raise ChatDataError(f"{where}: the chat template of {self.path} fails on the first "
                                f"{len(messages)} message(s) ({type(err).__name__}: {err}): "
                                "fix the conversation or the template") from None

    def _segments(self, conv: Conversation) -> tuple[str, list[_Segment]]:
        """The whole rendering and its character ranges: per message, and per assistant
        message its header and its content."""
        full = self.render(conv.messages, conv.tools, conv.where)
        segments: list[_Segment] = []
        done = 0  # characters of ``full`` covered so far
        last = len(conv.messages) - 1
        for i, message in enumerate(conv.messages):
            if message["role"] == "assistant":
                header = self.render(conv.messages[:i], conv.tools, conv.where,
                                     add_generation_prompt=True)
                header_end = self._prefix_end(header, full, done, conv.where, i,
                                              "with the generation prompt")
                if header_end == done:
                    raise ChatDataError(
                        f"{conv.where}: message {i}: the chat template of {self.path} adds "
                        "nothing for add_generation_prompt=True, so the assistant's role header "
                        "cannot be told from its content: use a template with a generation "
                        "prompt")
                segments.append(_Segment(done, header_end, i, False))
                done = header_end
            text = full if i == last else self.render(conv.messages[:i + 1], conv.tools,
                                                      conv.where)
            end = self._prefix_end(text, full, done, conv.where, i, "")
            segments.append(_Segment(done, end, i, message["role"] == "assistant"))
            done = end
            if message.get("tool_calls"):
                self._require_tool_calls_rendered(conv, i, text)
        return full, segments

    def _prefix_end(self, text: str, full: str, done: int, where: str, index: int,
                    what: str) -> int:
        if not full.startswith(text) or len(text) < done:
            raise ChatDataError(
                f"{where}: the chat template of {self.path} renders the conversation up to "
                f"message {index} {what} differently from the start of the whole conversation "
                "(it rewrites earlier turns, e.g. drops past reasoning): the assistant spans "
                "need a template whose renderings of a conversation's prefixes are prefixes "
                "of it")
        return len(text)

    def _require_tool_calls_rendered(self, conv: Conversation, index: int, text: str) -> None:
        without = dict(conv.messages[index])
        without.pop("tool_calls")
        plain = self.render(conv.messages[:index] + [without], conv.tools, conv.where)
        if plain == text:
            raise ChatDataError(f"{conv.where}: message {index} has tool_calls, but the chat "
                                f"template of {self.path} does not render tool calls: use a "
                                "template that supports them, or drop the line")

    # ---- tokens and mask

    def encode(self, conv: Conversation) -> EncodedConversation:
        """Token ids and loss mask of one conversation, closed by the end-of-document token."""
        full, segments = self._segments(conv)
        if self.has_generation_markers:
            self._check_generation_markers(conv, full, segments)
        pieces = [self._tokenize(full[s.start:s.end]) for s in segments]
        ids = numpy.concatenate([numpy.asarray(p, dtype=numpy.int64) for p in pieces]
                                + [numpy.zeros(0, dtype=numpy.int64)])
        if not len(ids) or ids[-1] != self.eod:
            ids = numpy.append(ids, self.eod)
        mask = numpy.zeros(len(ids), dtype=numpy.uint8)
        start = 0
        for segment, piece in zip(segments, pieces):
            if segment.assistant_content:
                mask[start:self._turn_end(ids, start, start + len(piece), conv, segment) + 1] = 1
            start += len(piece)
        return EncodedConversation(ids, mask, conv.where)

    def _tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _turn_end(self, ids: numpy.ndarray, start: int, end: int, conv: Conversation,
                  segment: _Segment) -> int:
        """Index of the token that ends the assistant turn whose content is ids[start:end]."""
        inside = [j for j in range(start, end) if int(ids[j]) in self.end_of_turn]
        if inside:
            return inside[-1]
        if end < len(ids) and int(ids[end]) in self.end_of_turn:
            return end
        following = self.tokenizer.convert_ids_to_tokens(int(ids[end])) if end < len(ids) else None
        names = self.tokenizer.convert_ids_to_tokens(sorted(self.end_of_turn))
        raise ChatDataError(
            f"{conv.where}: message {segment.message} (assistant): no end-of-turn token ends it "
            f"(it is followed by {following!r}; end-of-turn tokens: {names}): list the template's "
            "end-of-turn tokens in generation_config.json's eos_token_id or pass "
            "--end-of-turn-token")

    def _check_generation_markers(self, conv: Conversation, full: str,
                                  segments: list[_Segment]) -> None:
        """The template's ``{% generation %}`` text must be our assistant content, up to
        whitespace and end-of-turn tokens at either end."""
        spans = generation_spans(self.tokenizer, self.template, conv.messages, conv.tools)
        content = [s for s in segments if s.assistant_content]
        for start, end in spans:
            if end > start and not any(s.start <= start and end <= s.end for s in content):
                raise ChatDataError(
                    f"{conv.where}: the template's {{% generation %}} text {full[start:end]!r} "
                    "is not inside an assistant message's content as found from the rendered "
                    "prefixes: the template and the prefix rendering disagree on the role header")
        stops = self.tokenizer.convert_ids_to_tokens(sorted(self.end_of_turn))
        for s in content:
            marked = "".join(full[max(a, s.start):min(b, s.end)] for a, b in spans)
            ours = full[s.start:s.end]
            if _trim(marked, stops) != _trim(ours, stops):
                raise ChatDataError(
                    f"{conv.where}: message {s.message}: the template's {{% generation %}} text "
                    f"{marked!r} differs from the assistant content found from the rendered "
                    f"prefixes {ours!r}: fix the template's generation markers")


def _trim(text: str, stops: list[str]) -> str:
    """``text`` without leading/trailing whitespace and end-of-turn token strings."""
    while True:
        before = text
        text = text.strip()
        for stop in stops:
            text = text.removeprefix(stop).removesuffix(stop)
        if text == before:
            return text


def generation_spans(tokenizer, template: str, messages: list[dict],
                     tools: list | None) -> list[tuple[int, int]]:
    """Character ranges the template's ``{% generation %}`` blocks cover (transformers' own
    tracker, as ``apply_chat_template(return_assistant_tokens_mask=True)`` uses it)."""
    from transformers.utils.chat_template_utils import render_jinja_template  # optional dep

    _, [spans] = render_jinja_template(conversations=[messages], tools=tools,
                                       chat_template=template, return_assistant_tokens_mask=True,
                                       **tokenizer.special_tokens_map)
    return [(int(a), int(b)) for a, b in spans]


def load_hf_tokenizer(path: str):
    """``AutoTokenizer`` of a local directory (no downloads), with clear errors."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory {path!r} does not exist: pass the local "
                                "Hugging Face tokenizer directory of the model to train")
    try:
        from transformers import AutoTokenizer  # optional dependency, import lazily
    except ImportError as err:
        raise ImportError("chat SFT data needs the 'transformers' package: run "
                          "`pip install transformers`") from err
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as err:  # transformers raises OSError / ValueError for unusable dirs
        raise ChatDataError(f"tokenizer directory {path!r} cannot be loaded "
                            f"({type(err).__name__}: {err}): it needs tokenizer.json or the "
                            "model's tokenizer files and tokenizer_config.json") from None


def _end_of_turn_ids(tok, path: str, extra: Iterable[str]) -> frozenset[int]:
    """eos, the eos ids of ``generation_config.json`` (GLM lists its role tokens there) and
    ``extra`` token strings."""
    ids = {int(tok.eos_token_id)}
    config = os.path.join(path, "generation_config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None)
    for token in extra:
        token_id = tok.convert_tokens_to_ids(token)
        if token_id is None or token_id == tok.unk_token_id or tok.convert_ids_to_tokens(
                token_id) != token:
            raise ChatDataError(f"end-of-turn token {token!r} is not a token of {path}")
        ids.add(int(token_id))
    return frozenset(ids)


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------

@dataclass(eq=False)
class _OpenSequence:
    conversations: list[EncodedConversation] = field(default_factory=list)
    used: int = 0


def pack_conversations(conversations: Iterable[EncodedConversation], seq_length: int,
                       open_sequences: int) -> Iterator[list[EncodedConversation]]:
    """Group conversations (each at most ``seq_length`` tokens) into sequences: each goes into
    the first open sequence with room (first fit); when none has room and ``open_sequences``
    are open, the oldest is emitted. A full sequence is emitted at once. Deterministic."""
    open_: list[_OpenSequence] = []
    for conv in conversations:
        if len(conv) > seq_length:
            raise ValueError(f"{conv.where}: {len(conv)} tokens > seq_length {seq_length}")
        target = next((s for s in open_ if s.used + len(conv) <= seq_length), None)
        if target is None:
            if len(open_) == open_sequences:
                yield open_.pop(0).conversations
            target = _OpenSequence()
            open_.append(target)
        target.conversations.append(conv)
        target.used += len(conv)
        if target.used == seq_length:
            open_.remove(target)
            yield target.conversations
    for sequence in open_:
        yield sequence.conversations


def fit_to_length(conversations: Iterable[EncodedConversation], seq_length: int,
                  overlong: str, counts: dict,
                  dropped: list[str] | None = None) -> Iterator[EncodedConversation]:
    """Conversations longer than ``seq_length``: refused (``overlong='refuse'``) or cut to
    their first ``seq_length`` tokens (``'truncate'``; dropped if no assistant token is left).
    ``counts`` receives 'truncated' and 'dropped'; ``dropped``, when given, one line per
    dropped conversation: where it is (file:line) and why."""
    for conv in conversations:
        if len(conv) <= seq_length:
            yield conv
            continue
        if overlong == "refuse":
            raise ChatDataError(f"{conv.where}: the conversation is {len(conv)} tokens, longer "
                                f"than --seq-length {seq_length}: raise --seq-length, drop the "
                                "line, or pass --overlong truncate")
        cut = EncodedConversation(conv.ids[:seq_length], conv.mask[:seq_length], conv.where)
        if cut.mask.any():
            counts["truncated"] += 1
            yield cut
        else:
            counts["dropped"] += 1
            if dropped is not None:
                dropped.append(f"{conv.where}: {len(conv)} tokens, and its first {seq_length} "
                               "(--seq-length) hold no assistant token")


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------

def loss_mask_prefix(prefix: str) -> str:
    return prefix + LOSS_MASK_SUFFIX


def metadata_path(prefix: str) -> str:
    return prefix + METADATA_SUFFIX


def is_chat_sft_dataset(prefix: str) -> bool:
    """Whether ``prefix`` was written by ``write_chat_sft_dataset`` (its metadata exists)."""
    return os.path.isfile(metadata_path(prefix))


@dataclass
class _Writer:
    """The token and loss-mask builders of one output, under temporary names."""

    prefix: str
    vocab_size: int

    def __post_init__(self) -> None:
        self.tmp = f"{self.prefix}.tmp-{os.getpid()}"
        self.tokens = IndexedDatasetBuilder(self.tmp + ".bin",
                                            dtype=DType.optimal_dtype(self.vocab_size))
        self.masks = IndexedDatasetBuilder(loss_mask_prefix(self.tmp) + ".bin", dtype=numpy.uint8)

    def add_sequence(self, conversations: list[EncodedConversation]) -> None:
        """One packed sequence: one megatron document of one item per conversation."""
        lengths = [len(c) for c in conversations]
        self.tokens.add_document(numpy.concatenate([c.ids for c in conversations]), lengths)
        self.masks.add_document(numpy.concatenate([c.mask for c in conversations]), lengths)

    def commit(self, metadata: dict) -> None:
        """Finalize, then rename into place; the metadata last (a reader that finds it finds
        complete files)."""
        self.tokens.finalize(self.tmp + ".idx")
        self.masks.finalize(loss_mask_prefix(self.tmp) + ".idx")
        for src, dst in ((self.tmp, self.prefix),
                         (loss_mask_prefix(self.tmp), loss_mask_prefix(self.prefix))):
            for suffix in (".bin", ".idx"):
                os.replace(src + suffix, dst + suffix)
        with open(metadata_path(self.tmp), "w", encoding="utf-8") as f:
            json.dump(metadata, f, indent=2)
            f.write("\n")
        os.replace(metadata_path(self.tmp), metadata_path(self.prefix))

    def discard(self) -> None:
        self.tokens.data_file.close()
        self.masks.data_file.close()
        for path in (self.tmp + ".bin", self.tmp + ".idx", loss_mask_prefix(self.tmp) + ".bin",
                     loss_mask_prefix(self.tmp) + ".idx", metadata_path(self.tmp)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def write_chat_sft_dataset(files: list[str], output_prefix: str, tokenizer_dir: str,
                           seq_length: int, overlong: str = "refuse", open_sequences: int = 64,
                           end_of_turn_tokens: Iterable[str] = (),
                           dropped: list[str] | None = None) -> dict:
    """Render, mask, pack and write ``files`` (chat jsonl) as the chat SFT dataset
    ``output_prefix``; returns its metadata (counts included). Nothing is written on error.
    ``dropped``, when given, receives where and why each dropped conversation was dropped."""
    _check_write_args(files, seq_length, overlong, open_sequences)
    encoder = ChatTemplateEncoder(tokenizer_dir, end_of_turn_tokens)
    counts = {"conversations": 0, "sequences": 0, "tokens": 0, "loss_tokens": 0,
              "truncated": 0, "dropped": 0, "longest_conversation": 0}
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    writer = _Writer(output_prefix, encoder.vocab_size)
    try:
        encoded = (encoder.encode(conv) for conv in read_conversations(files))
        fitted = fit_to_length(encoded, seq_length, overlong, counts, dropped)
        for sequence in pack_conversations(fitted, seq_length, open_sequences):
            writer.add_sequence(sequence)
            _count(counts, sequence)
        if counts["sequences"] == 0:
            raise ChatDataError(f"inputs {files} hold no conversation to train on")
        metadata = _metadata(encoder, seq_length, counts)
        writer.commit(metadata)
    except BaseException:
        writer.discard()
        raise
    return metadata


def _check_write_args(files: list[str], seq_length: int, overlong: str,
                      open_sequences: int) -> None:
    if not files:
        raise ChatDataError("no input files given: pass --input FILE [FILE ...]")
    if seq_length < 2:
        raise ChatDataError(f"--seq-length {seq_length} must be >= 2 tokens")
    if overlong not in OVERLONG_CHOICES:
        raise ChatDataError(f"--overlong {overlong!r}: use one of {OVERLONG_CHOICES}")
    if open_sequences < 1:
        raise ChatDataError(f"--open-sequences {open_sequences} must be >= 1 (1 = next fit)")


def _count(counts: dict, sequence: list[EncodedConversation]) -> None:
    counts["sequences"] += 1
    for conv in sequence:
        counts["conversations"] += 1
        counts["tokens"] += len(conv)
        counts["loss_tokens"] += int(conv.mask.sum())
        counts["longest_conversation"] = max(counts["longest_conversation"], len(conv))


def _metadata(encoder: ChatTemplateEncoder, seq_length: int, counts: dict) -> dict:
    return {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "seq_length": seq_length,
        "tokenizer": encoder.path, "vocab_size": encoder.vocab_size, "eod": encoder.eod,
        "pad": encoder.pad, "end_of_turn_ids": sorted(encoder.end_of_turn),
        **counts, "fill": counts["tokens"] / (counts["sequences"] * seq_length),
    }


# --------------------------------------------------------------------------------------------
# Checking a written dataset
# --------------------------------------------------------------------------------------------

def read_metadata(prefix: str) -> dict:
    """The dataset's metadata, checked for format and version."""
    hint = PREPARE_HINT.format(prefix=prefix)
    path = metadata_path(prefix)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: {prefix} is not a chat SFT dataset; create "
                                f"it with: {hint}")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is unreadable ({err}); re-create the dataset with: "
                         f"{hint}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME or meta.get(
            "version") != FORMAT_VERSION:
        raise ValueError(f"{path} is not version {FORMAT_VERSION} of the {FORMAT_NAME} format; "
                         f"re-create the dataset with: {hint}")
    return meta


def check_chat_sft_layout(prefix: str) -> dict:
    """Tokens and loss mask describe the same conversations and sequences, every sequence
    fits the recorded length and the counts match the metadata; returns the metadata. (The
    .bin/.idx files themselves are checked by ``glm5_train.data.check_dataset_prefix``.)"""
    meta = read_metadata(prefix)
    fix = f"re-create the dataset with: {PREPARE_HINT.format(prefix=prefix)}"
    tokens = IndexedDataset(prefix, mmap=False).index
    masks = IndexedDataset(loss_mask_prefix(prefix), mmap=False).index
    if not (numpy.array_equal(tokens.sequence_lengths, masks.sequence_lengths)
            and numpy.array_equal(tokens.document_indices, masks.document_indices)):
        raise ValueError(f"{loss_mask_prefix(prefix)} does not match {prefix} (different "
                         f"conversations or sequences): {fix}")
    lengths = sequence_lengths(tokens)
    if len(lengths) != meta["sequences"] or len(tokens.sequence_lengths) != meta["conversations"]:
        raise ValueError(f"{prefix} holds {len(lengths)} sequences of "
                         f"{len(tokens.sequence_lengths)} conversations, its metadata says "
                         f"{meta['sequences']} of {meta['conversations']}: {fix}")
    if len(lengths) and int(lengths.max()) > meta["seq_length"]:
        raise ValueError(f"{prefix}: a sequence holds {int(lengths.max())} tokens, more than "
                         f"its seq_length {meta['seq_length']}: {fix}")
    return meta


def sequence_lengths(index) -> numpy.ndarray:
    """Tokens in each packed sequence (megatron document) of an index."""
    per_conversation = numpy.concatenate([[0], numpy.cumsum(index.sequence_lengths,
                                                            dtype=numpy.int64)])
    return numpy.diff(per_conversation[index.document_indices])


def check_compatible(prefix: str, meta: dict, seq_length: int, tokenizer) -> None:
    """The run's ``train.seq_length`` and tokenizer are the ones the dataset was made with."""
    if seq_length != meta["seq_length"]:
        raise ValueError(f"train.seq_length={seq_length} but the chat SFT dataset {prefix} is "
                         f"packed into sequences of {meta['seq_length']} tokens: set "
                         f"train.seq_length={meta['seq_length']}, or re-pack the data with "
                         f"--seq-length {seq_length}")
    if tokenizer.vocab_size != meta["vocab_size"] or tokenizer.eod != meta["eod"]:
        raise ValueError(f"data.tokenizer has {tokenizer.vocab_size} tokens and end-of-document "
                         f"id {tokenizer.eod}, but {prefix} was made with {meta['tokenizer']} "
                         f"({meta['vocab_size']} tokens, end-of-document {meta['eod']}): set "
                         f"data.tokenizer={meta['tokenizer']}")


# --------------------------------------------------------------------------------------------
# Reading for training
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PackSource:
    """Packed sequences ``[first, stop)`` of one chat SFT dataset (a split of it)."""

    prefix: str
    first: int
    stop: int


class ChatSFTDataset(torch.utils.data.Dataset):
    """Training samples from packed chat SFT sequences.

    Sample ``i`` is sequence ``order[i]``: each epoch visits every sequence of ``sources``
    once, in a permutation drawn from (``seed``, epoch) alone, so the order depends only on the
    sample index (the same on every rank and on a resumed run); epochs repeat until
    ``num_samples``. A sample holds, for ``seq_length`` positions (a sequence of n tokens is
    padded at the end): ``tokens``, ``labels`` (the next token), ``loss_mask`` (float, on the
    label: 1 where the label is an assistant token of the same conversation), ``position_ids``
    (restarting at each conversation with ``reset_position_ids``), ``cu_seqlens`` (int32
    document boundaries ``[0, len_1, len_1 + len_2, ..., n, seq_length]``: each conversation,
    then the padding as one last segment when n < seq_length).
    """

    def __init__(self, sources: list[PackSource], seq_length: int, seed: int, num_samples: int,
                 pad: int, reset_position_ids: bool = False) -> None:
        self.sources = [s for s in sources if s.stop > s.first]
        self.seq_length, self.pad = seq_length, pad
        self.reset_position_ids = reset_position_ids
        self.tokens = [IndexedDataset(s.prefix, mmap=True) for s in self.sources]
        self.masks = [IndexedDataset(loss_mask_prefix(s.prefix), mmap=True) for s in self.sources]
        self.packs = numpy.array([(d, p) for d, s in enumerate(self.sources)
                                  for p in range(s.first, s.stop)], dtype=numpy.int64)
        self.order = epoch_order(len(self.packs), num_samples, seed)

    def __len__(self) -> int:
        return len(self.order)

    def _pack(self, index: int) -> tuple[int, int, numpy.ndarray]:
        """(dataset, first conversation, conversation lengths) of sample ``index``."""
        d, p = (int(x) for x in self.packs[self.order[index]])
        index_ = self.tokens[d].index
        first, stop = int(index_.document_indices[p]), int(index_.document_indices[p + 1])
        return d, first, numpy.asarray(index_.sequence_lengths[first:stop], dtype=numpy.int64)

    def conversation_lengths(self, index: int) -> numpy.ndarray:
        """Tokens of each conversation of sample ``index``, from the index alone."""
        return self._pack(index)[2]

    def sequence(self, index: int) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        """(tokens, per-token loss mask, conversation lengths) of sample ``index``, unpadded."""
        d, first, lengths = self._pack(index)
        total = int(lengths.sum())
        # add_document wrote the sequence's conversations back to back: one contiguous read.
        tokens = self.tokens[d].get(first, 0, total).astype(numpy.int64)
        mask = self.masks[d].get(first, 0, total)
        return tokens, mask, lengths

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens, mask, lengths = self.sequence(index)
        return build_sample(tokens, mask, lengths, self.seq_length, self.pad,
                            self.reset_position_ids)


def epoch_order(num_packs: int, num_samples: int, seed: int) -> numpy.ndarray:
    """Pack index of every sample: whole epochs, each a permutation seeded by (seed, epoch)."""
    epochs = max(1, -(-num_samples // num_packs)) if num_packs else 0
    return numpy.concatenate([numpy.random.default_rng([seed, e]).permutation(num_packs)
                              for e in range(epochs)] + [numpy.zeros(0, dtype=numpy.int64)])


def build_sample(tokens: numpy.ndarray, mask: numpy.ndarray, lengths: numpy.ndarray,
                 seq_length: int, pad: int, reset_position_ids: bool) -> dict[str, torch.Tensor]:
    """One training sample from a packed sequence (see ``ChatSFTDataset``)."""
    n = len(tokens)
    ids = numpy.full(seq_length + 1, pad, dtype=numpy.int64)
    ids[:n] = tokens
    shifted = numpy.zeros(seq_length, dtype=numpy.float32)
    shifted[:n - 1] = mask[1:n]  # position i is trained on label i + 1
    ends = numpy.cumsum(lengths)
    shifted[ends - 1] = 0.0  # a conversation's last position would predict the next one's first
    bounds = numpy.concatenate([[0], ends] + ([[seq_length]] if n < seq_length else []))
    return {
        "tokens": torch.from_numpy(ids[:seq_length].copy()),
        "labels": torch.from_numpy(ids[1:].copy()),
        "loss_mask": torch.from_numpy(shifted),
        "position_ids": torch.from_numpy(_positions(bounds, seq_length, reset_position_ids)),
        "cu_seqlens": torch.from_numpy(bounds.astype(numpy.int32)),
    }


def _positions(bounds: numpy.ndarray, seq_length: int, reset: bool) -> numpy.ndarray:
    positions = numpy.arange(seq_length, dtype=numpy.int64)
    if reset:
        positions -= numpy.repeat(bounds[:-1], numpy.diff(bounds))
    return positions


def batch_cu_seqlens(per_sample: list[torch.Tensor], seq_length: int) -> dict[str, torch.Tensor]:
    """A micro-batch's document boundaries in megatron-core's packed (THD) convention: the
    samples' ``cu_seqlens`` laid end to end over the flattened [b * s] tokens, and the longest
    segment (``max_seqlen``), as ``PackedSeqParams(cu_seqlens_q=..., max_seqlen_q=...)`` takes
    them."""
    parts = [cu[:-1] + j * seq_length for j, cu in enumerate(per_sample)]
    flat = torch.cat(parts + [torch.tensor([len(per_sample) * seq_length], dtype=torch.int32)])
    return {"cu_seqlens": flat.to(torch.int32),
            "max_seqlen": torch.diff(flat).max().to(torch.int32)}
