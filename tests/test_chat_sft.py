"""Chat SFT data (``tools/prepare_chat_sft.py``, ``glm5_train/chat_data.py``) on the shipped
chat file and tiny GLM-style tokenizer: the tool's output, the assistant-only loss mask
(checked by decoding and against transformers' own generation mask), packing and document
boundaries, bad input, and a short training run whose loss is the cross-entropy over the
assistant tokens only."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import warnings

import numpy
import pytest
import torch

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from glm5_train import chat_data as C  # noqa: E402
from glm5_train import data as D  # noqa: E402
from glm5_train.assembly import build_model  # noqa: E402
from glm5_train.inference import compute_logits  # noqa: E402
from glm5_train.job_config import compose_job  # noqa: E402
from glm5_train.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer  # noqa: E402
from launch import local as launch_local  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from parallel import process_groups  # noqa: E402
from tests.parity import run_job  # noqa: E402
from tests.spawn import run_ranks  # noqa: E402

pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data")
CHAT = os.path.join(DATA, "chat_small.jsonl")
TOKENIZER = os.path.join(DATA, "glm_tiny_tokenizer")
SEQ = 1024
# What ends an assistant turn in the shipped GLM-style template: the role token that follows
# it (user / tool), or the end-of-document token after the last turn.
END_OF_TURN = {"user": "<|user|>", "tool": "<|observation|>", None: "<|endoftext|>"}


# ------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """The shipped chat file through the command-line tool: (prefix, last output line)."""
    prefix = str(tmp_path_factory.mktemp("sft") / "chat")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "prepare_chat_sft.py"), "--input", CHAT,
         "--output-prefix", prefix, "--tokenizer", TOKENIZER, "--seq-length", str(SEQ)],
        capture_output=True, text=True, cwd=REPO, check=False,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr
    return prefix, proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def encoder():
    return C.ChatTemplateEncoder(TOKENIZER)


@pytest.fixture(scope="module")
def conversations():
    return list(C.read_conversations([CHAT]))


def _runs(ids, mask) -> list[list[int]]:
    """The maximal runs of consecutive masked tokens."""
    runs, current = [], []
    for token, keep in zip(ids, mask):
        if keep:
            current.append(int(token))
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _expected_assistant_texts(messages: list[dict]) -> list[str]:
    """What the model must learn to generate per assistant turn, written out from the jsonl
    alone: the template's "\\n", the content, the tool calls in GLM form, the end-of-turn token."""
    texts = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        text = "\n" + (m.get("content") or "")
        for call in m.get("tool_calls", []):
            f = call["function"]
            text += f"<tool_call>{f['name']}" + "".join(
                f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>"
                for k, v in f["arguments"].items()) + "</tool_call>"
        following = messages[i + 1]["role"] if i + 1 < len(messages) else None
        texts.append(text + END_OF_TURN[following])
    return texts


def _tokenizer_variant(tmp_path, template: str | None) -> str:
    """A copy of the shipped tokenizer directory with another chat template (None: none)."""
    out = tmp_path / "tok"
    shutil.copytree(TOKENIZER, out)
    os.remove(out / "chat_template.jinja")
    if template is not None:
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return str(out)


def _shipped_template() -> str:
    with open(os.path.join(TOKENIZER, "chat_template.jinja"), encoding="utf-8") as f:
        return f.read()


# ------------------------------------------------------------------------------- the tool

def test_tool_writes_the_packed_dataset(sft, conversations):
    prefix, line = sft
    meta = C.read_metadata(prefix)
    fields = dict(item.split("=", 1) for item in line.split())
    assert int(fields["conversations"]) == meta["conversations"] == len(conversations) == 36
    assert int(fields["sequences"]) == meta["sequences"] and meta["sequences"] >= 4
    assert (meta["seq_length"], meta["vocab_size"], meta["truncated"]) == (SEQ, 300, 0)
    assert 0 < meta["loss_tokens"] < meta["tokens"]
    tokens = IndexedDataset(prefix, mmap=False)
    masks = IndexedDataset(C.loss_mask_prefix(prefix), mmap=False)
    assert len(tokens) == len(masks) == 36  # one item per conversation, in both
    assert len(tokens.document_indices) - 1 == meta["sequences"]  # one document per sequence
    assert sum(len(tokens[i]) for i in range(36)) == meta["tokens"]
    assert sum(int(masks[i].sum()) for i in range(36)) == meta["loss_tokens"]
    # The run's own checks accept it for this length and tokenizer.
    D.check_datasets([prefix], "100,0,0", "chat_sft", SEQ, HFTokenizer(TOKENIZER))


# ----------------------------------------------------------------------------- the loss mask

def test_mask_is_exactly_the_assistant_tokens(encoder, conversations):
    """Decoded, the masked runs are exactly each assistant turn's text and end-of-turn token;
    every conversation ends with the end-of-document token."""
    tok = encoder.tokenizer
    turns = 0
    for conv in conversations:
        enc = encoder.encode(conv)
        decoded = [tok.decode(run) for run in _runs(enc.ids, enc.mask)]
        assert decoded == _expected_assistant_texts(conv.messages), conv.where
        assert enc.ids[-1] == encoder.eod
        turns += len(decoded)
    with open(CHAT, encoding="utf-8") as f:  # every assistant message of the file, once
        assert turns == sum(m["role"] == "assistant" for line in f
                            for m in json.loads(line)["messages"]) == 58


def test_tokens_and_mask_agree_with_transformers(encoder, conversations):
    """The tokens are apply_chat_template's (plus the end-of-document token); the mask is its
    {% generation %} mask plus exactly one end-of-turn token after every assistant turn."""
    tok = encoder.tokenizer
    for conv in conversations:
        enc = encoder.encode(conv)
        out = tok.apply_chat_template(conv.messages, tools=conv.tools, tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True)
        assert enc.ids.tolist() == list(out["input_ids"]) + [encoder.eod], conv.where
        theirs = numpy.array(list(out["assistant_masks"]) + [0], dtype=numpy.uint8)
        extra = numpy.nonzero(enc.mask != theirs)[0]
        assert (enc.mask[extra] == 1).all() and all(int(enc.ids[j]) in encoder.end_of_turn
                                                    for j in extra)
        assert len(extra) == len(_runs(enc.ids, enc.mask)), conv.where


def test_prefix_rendering_needs_no_generation_markers(tmp_path, encoder, conversations):
    """Without {% generation %} the same masks come from the prefix renderings alone."""
    # An always-true block in their place keeps their whitespace control (same text).
    plain = _shipped_template().replace("{%- generation -%}", "{%- if true -%}").replace(
        "{%- endgeneration -%}", "{%- endif -%}")
    other = C.ChatTemplateEncoder(_tokenizer_variant(tmp_path, plain))
    assert encoder.has_generation_markers and not other.has_generation_markers
    for conv in conversations:
        ours, theirs = encoder.encode(conv), other.encode(conv)
        assert numpy.array_equal(ours.ids, theirs.ids) and numpy.array_equal(ours.mask,
                                                                               theirs.mask)


def test_generation_markers_that_disagree_are_refused(tmp_path, conversations):
    # The markers moved to include the role header: the prefix renderings say otherwise.
    wrong = _shipped_template().replace("<|assistant|>\n{%- generation -%}",
                                        "{%- generation -%}<|assistant|>\n")
    encoder = C.ChatTemplateEncoder(_tokenizer_variant(tmp_path, wrong))
    with pytest.raises(C.ChatDataError, match=r"chat_small.jsonl:1: .*generation.*role header"):
        encoder.encode(conversations[0])


# ------------------------------------------------------------------------------------ packing

def test_first_fit_packing_keeps_conversations_whole():
    def conv(n):
        return C.EncodedConversation(numpy.arange(n), numpy.zeros(n, numpy.uint8), f"len{n}")

    lengths = [6, 5, 4, 3, 2]
    first_fit = C.pack_conversations([conv(n) for n in lengths], 10, open_sequences=64)
    assert [[len(c) for c in s] for s in first_fit] == [[6, 4], [5, 3, 2]]
    next_fit = C.pack_conversations([conv(n) for n in lengths], 10, open_sequences=1)
    assert [[len(c) for c in s] for s in next_fit] == [[6], [5, 4], [3, 2]]


def test_samples_hold_whole_conversations_and_their_boundaries(sft, encoder, conversations):
    prefix, _ = sft
    cfg = D.DataConfig(format="chat_sft", paths=[prefix], tokenizer=TOKENIZER, split="100,0,0")
    train, valid, test = D.build_train_valid_test_datasets(cfg, HFTokenizer(TOKENIZER), SEQ, 7,
                                                           (8, 0, 0))
    assert valid is None and test is None
    meta = C.read_metadata(prefix)
    assert len(train) == meta["sequences"] * math.ceil(8 / meta["sequences"])
    expected = {tuple(encoder.encode(c).ids.tolist()) for c in conversations}
    seen = set()
    for i in range(meta["sequences"]):  # the first epoch: every sequence once
        tokens, mask, lengths = train.sequence(i)
        n = int(lengths.sum())
        assert n <= SEQ
        starts = numpy.concatenate([[0], numpy.cumsum(lengths)])
        for a, b in zip(starts[:-1], starts[1:]):
            seen.add(tuple(tokens[a:b].tolist()))  # each piece is one whole conversation
        sample = train[i]
        assert sample["tokens"][:n].tolist() == tokens.tolist()
        assert (sample["tokens"][n:] == meta["pad"]).all()  # padding at the end only
        assert sample["labels"][:n - 1].tolist() == tokens[1:].tolist()
        bounds = starts.tolist() + ([SEQ] if n < SEQ else [])
        assert sample["cu_seqlens"].tolist() == bounds
        # The mask on labels: the next token's assistant mask, never across a boundary.
        want = numpy.zeros(SEQ, numpy.float32)
        want[:n - 1] = mask[1:]
        want[starts[1:] - 1] = 0
        assert numpy.array_equal(sample["loss_mask"].numpy(), want)
        assert sample["loss_mask"][n - 1:].sum() == 0
    assert seen == expected and len(seen) == 36
    batch = D.collate_samples([train[0], train[1]])
    first, second = train[0]["cu_seqlens"], train[1]["cu_seqlens"]
    assert batch["cu_seqlens"].tolist() == first[:-1].tolist() + (second + SEQ).tolist()
    assert int(batch["max_seqlen"]) == int(torch.diff(batch["cu_seqlens"]).max())
    assert batch["tokens"].shape == (2, SEQ) and batch["cu_seqlens"].dtype == torch.int32


def test_positions_restart_per_conversation(sft):
    prefix, _ = sft
    cfg = D.DataConfig(format="chat_sft", paths=[prefix], tokenizer=TOKENIZER, split="100,0,0",
                       reset_position_ids=True)
    train, _, _ = D.build_train_valid_test_datasets(cfg, HFTokenizer(TOKENIZER), SEQ, 7,
                                                    (1, 0, 0))
    sample = train[0]
    bounds = sample["cu_seqlens"].tolist()
    assert len(bounds) >= 3  # two segments at least
    segment = numpy.repeat(numpy.arange(len(bounds) - 1), numpy.diff(bounds))
    positions = numpy.arange(SEQ) - numpy.array(bounds)[segment]
    assert sample["position_ids"].tolist() == positions.tolist()


def test_overlong_conversations_refused_or_truncated(tmp_path):
    with pytest.raises(C.ChatDataError, match=r"chat_small.jsonl:22: the conversation is 602 "
                                              r"tokens, longer than --seq-length 512.*truncate"):
        C.write_chat_sft_dataset([CHAT], str(tmp_path / "refused"), TOKENIZER, 512)
    assert os.listdir(tmp_path) == []  # nothing written
    meta = C.write_chat_sft_dataset([CHAT], str(tmp_path / "cut"), TOKENIZER, 512,
                                    overlong="truncate")
    assert meta["truncated"] >= 1 and meta["conversations"] + meta["dropped"] == 36
    assert meta["longest_conversation"] == 512
    C.check_chat_sft_layout(str(tmp_path / "cut"))


# ---------------------------------------------------------------------------------- bad input

_GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


@pytest.mark.parametrize("lines, message", [
    ([_GOOD, "{not json"], r"bad.jsonl:2: not valid JSON"),
    ([_GOOD, {"messages": [{"role": "robot", "content": "x"}]}],
     r"bad.jsonl:2: message 0 has unknown role 'robot': roles are system, user, assistant, "
     r"tool"),
    ([{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}],
     r"bad.jsonl:1: no assistant turn"),
    ([{"text": "plain"}], r"bad.jsonl:1: no non-empty 'messages' list"),
    ([{"messages": [{"role": "user", "content": ["a", "b"]}, _GOOD["messages"][1]]}],
     r"bad.jsonl:1: message 0 \(user\): 'content' must be a string"),
])
def test_bad_lines_are_refused_with_their_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    with pytest.raises(C.ChatDataError, match=message):
        C.write_chat_sft_dataset([str(path)], str(tmp_path / "out"), TOKENIZER, SEQ)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_missing_inputs_and_templates_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="chat file .*nope.jsonl.* does not exist"):
        C.write_chat_sft_dataset([str(tmp_path / "nope.jsonl")], str(tmp_path / "o"), TOKENIZER,
                                 SEQ)
    with pytest.raises(FileNotFoundError, match="tokenizer directory .*no-dir.* does not exist"):
        C.write_chat_sft_dataset([CHAT], str(tmp_path / "o"), str(tmp_path / "no-dir"), SEQ)
    with pytest.raises(C.ChatDataError, match="has no chat template"):
        C.ChatTemplateEncoder(_tokenizer_variant(tmp_path, None))


@pytest.mark.parametrize("change, message", [
    # drops tool calls from the rendering
    (lambda t: t.replace("{%- for tc in m.tool_calls or [] -%}", "{%- for tc in [] -%}"),
     r"chat_small.jsonl:4: message 2 has tool_calls, but the chat template .* does not render "
     r"tool calls"),
    # renders every prefix differently (a message count up front)
    (lambda t: t.replace("[gMASK]<sop>", "[gMASK]<sop>{{ messages | length }}"),
     r"chat_small.jsonl:1: .*renders the conversation up to message 0 .*differently"),
    # no generation prompt: header and content cannot be told apart
    (lambda t: t.replace("{%- if add_generation_prompt -%}\n<|assistant|>",
                         "{%- if add_generation_prompt -%}\n"),
     r"chat_small.jsonl:1: message 2: .*adds nothing for add_generation_prompt"),
])
def test_unsuitable_templates_are_refused(tmp_path, conversations, change, message):
    encoder = C.ChatTemplateEncoder(_tokenizer_variant(tmp_path, change(_shipped_template())))
    with pytest.raises(C.ChatDataError, match=message):
        for conv in conversations:
            encoder.encode(conv)


def test_training_config_and_dataset_mismatches_are_refused(sft, tmp_path):
    prefix, _ = sft
    tok = HFTokenizer(TOKENIZER)
    for fields, message in [
            (dict(paths=[]), "data.format=chat_sft needs data.paths"),
            (dict(paths=[prefix], weights=[1.0]), "concatenated, not blended"),
            (dict(paths=[prefix], tokenizer="byte"), "data.tokenizer=byte"),
            (dict(paths=[prefix], eod_mask_loss=True), "eod_mask_loss"),
            (dict(paths=[prefix], reset_attention_mask=True), "carry the conversations' "),
            (dict(paths=[prefix], format="sft"), "data.format='sft'")]:
        cfg = {"format": "chat_sft", "tokenizer": TOKENIZER, **fields}
        with pytest.raises(ValueError, match=message):
            D.DataConfig(**cfg).validate()
    with pytest.raises(ValueError, match=r"train.seq_length=512 .* sequences of 1024 tokens"):
        D.check_datasets([prefix], "100,0,0", "chat_sft", 512, tok)
    with pytest.raises(ValueError, match="data.tokenizer has 258 tokens"):
        D.check_datasets([prefix], "100,0,0", "chat_sft", SEQ, ByteTokenizer())
    with pytest.raises(ValueError, match="data.format=gpt would train on all of its tokens"):
        D.check_datasets([prefix], "100,0,0", "gpt")
    gpt = tmp_path / "docs.jsonl"
    gpt.write_text(json.dumps({"text": "some text"}) + "\n")
    D.build_indexed_dataset([str(gpt)], str(tmp_path / "docs"), ByteTokenizer())
    with pytest.raises(ValueError, match="not a chat SFT dataset.*prepare_chat_sft"):
        D.check_datasets([str(tmp_path / "docs")], "100,0,0", "chat_sft")
    broken = str(tmp_path / "broken")
    for suffix in (".bin", ".idx", "_loss_mask.bin", "_loss_mask.idx", ".chat_sft.json"):
        shutil.copy(prefix + suffix, broken + suffix)
    with open(broken + "_loss_mask.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="broken_loss_mask.bin has 100 bytes.*prepare_chat_sft"):
        D.check_datasets([broken], "100,0,0")


# ------------------------------------------------------------------------------ training on it

TRAIN_OVERRIDES = ["model=glm5_tiny", "parallel=single", "data=chat_sft",
                   f"data.tokenizer={TOKENIZER}", f"train.seq_length={SEQ}",
                   "train.global_batch_size=2", "train.micro_batch_size=1",
                   "train.train_iters=2", "train.warmup_iters=0", "checkpoint.save=null",
                   "checkpoint.load=null"]


def reference_first_step(rank: int, world: int, overrides: list[str]) -> dict:
    """The first step's LM loss recomputed from the initial weights (a function of the seed)
    and the run's first global batch, each packed conversation run through the model alone (a
    packed document computes what it computes alone): cross-entropy over the assistant tokens
    only, and, for contrast, over every next token."""
    job = compose_job(overrides)
    process_groups.init_distributed(job.parallel, job.train.seed)
    groups = process_groups.groups()
    _, chunks = build_model(job, groups)
    tokenizer = build_tokenizer(job.data.tokenizer)
    train, _, _ = D.build_train_valid_test_datasets(
        job.data, tokenizer, job.train.seq_length, job.train.seed,
        (job.train.train_iters * job.train.global_batch_size, 0, 0))
    masked = everything = unshifted = 0.0
    masked_tokens = all_tokens = 0
    for sample in range(job.train.global_batch_size):
        tokens, mask, lengths = train.sequence(sample)
        starts = numpy.concatenate([[0], numpy.cumsum(lengths)])
        for a, b in zip(starts[:-1], starts[1:]):
            ids = torch.from_numpy(tokens[a:b]).unsqueeze(0)
            logits = compute_logits(chunks, ids, groups)[0, :-1].double()
            losses = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
            weight = torch.from_numpy(mask[a + 1:b]).double()  # the next token's mask
            masked += float((losses * weight).sum())
            # the classic bug: the mask of the input token instead of the predicted one
            unshifted += float((losses * torch.from_numpy(mask[a:b - 1]).double()).sum())
            masked_tokens += int(weight.sum())
            everything += float(losses.sum())
            all_tokens += len(losses)
    process_groups.destroy_distributed()
    return {"masked": masked / masked_tokens, "all": everything / all_tokens,
            "unshifted": unshifted / masked_tokens, "loss_tokens": masked_tokens}


def test_training_loss_is_over_assistant_tokens_only(sft, tmp_path):
    prefix, _ = sft
    overrides = [*TRAIN_OVERRIDES, f"data.paths=[{prefix}]"]
    records = run_job(1, overrides, str(tmp_path / "run")).records
    assert [r["step"] for r in records] == [1, 2]
    [ref] = run_ranks(1, reference_first_step, overrides, timeout=300)
    first = records[0]
    assert first["loss_tokens"] == ref["loss_tokens"] < 2 * SEQ  # the assistant labels
    # The step-1 loss is the reference: same initial weights and conversations in fp32, the
    # paths differ only in summation order (the packed sequence with document-aware attention
    # and the job's chunked head, against each conversation alone with full logits here):
    # measured relative difference 3.2e-8; 1e-6 is the parity harness's fp32 loss tolerance.
    # The loss over every next token (measured 2.6e-4 away) and over the unshifted mask (1.2e-2)
    # are both far outside it.
    assert abs(first["loss"] - ref["masked"]) <= 1e-6 * ref["masked"], (first["loss"], ref)
    for wrong in ("all", "unshifted"):
        assert abs(ref[wrong] - ref["masked"]) > 1e-4 * ref["masked"], ref
    assert records[1]["loss"] < first["loss"]


# ------------------------------------------------------------ the launcher checks before torchrun

LAUNCH_SFT = ["parallel=single", "data=chat_sft", f"data.tokenizer={TOKENIZER}",
              "train.train_iters=1", "train.warmup_iters=0"]


def test_launcher_refuses_a_sequence_length_mismatch_before_torchrun(sft, capsys, monkeypatch):
    """Data packed at 1024 tokens, a job at 512: the launcher's one line, the job's text."""
    started = []
    monkeypatch.setattr(launch_local, "run_torchrun", lambda *args: started.append(args) or 0)
    prefix, _ = sft
    assert launch_local._main_or_error([*LAUNCH_SFT, f"data.paths=[{prefix}]",
                             "train.seq_length=512"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"launch: error: train.seq_length=512 but the chat SFT dataset "
                           f"{prefix} is packed into sequences of 1024 tokens")
    assert "set train.seq_length=1024" in last  # value, rule and fix in the one line
    assert started == []


def test_launcher_refuses_data_made_with_another_tokenizer_before_torchrun(tmp_path):
    """A corpus tokenized with the tiny GLM tokenizer (ids up to 319) trained with the byte
    tokenizer (258 ids): refused by the launcher itself, torchrun never started (its line
    'launch: N processes' never printed, no rank output), in the time of a config compose."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"line {i} of text"}) + "\n" for i in range(8)))
    D.build_indexed_dataset([str(docs)], str(tmp_path / "docs"), HFTokenizer(TOKENIZER))
    proc = subprocess.run(
        [sys.executable, "-m", "launch.local", "parallel=single", f"data.paths=[{tmp_path}/docs]",
         "data.tokenizer=byte", f"hydra.run.dir={tmp_path}/run"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"launch: error: dataset {tmp_path}/docs.bin: document 0")
    assert "past the vocabulary's 258 ids" in last and "set data.tokenizer" in last
    assert "processes:" not in proc.stdout and "glm5_train" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_launcher_ends_with_the_jobs_error_when_the_job_fails_in_torchrun(tmp_path):
    """An error only the running job finds (no checkpoint where checkpoint.load points): the
    launcher's last line is the job's one-line error, after torchrun's failure summary."""
    empty = tmp_path / "no_checkpoints"
    empty.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "launch.local", "parallel=single", "train.train_iters=1",
         "train.warmup_iters=0", f"checkpoint.load={empty}", "checkpoint.save=null",
         f"hydra.run.dir={tmp_path}/run"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    job_line = next(line for line in lines if "glm5_train: error: " in line)
    message = job_line.split("glm5_train: error: ", 1)[1]
    assert str(empty) in message
    assert lines[-1] == f"launch: error: {message}", proc.stderr[-3000:]


def test_prepare_names_the_conversations_it_drops(tmp_path):
    """--overlong truncate: each dropped conversation by file:line and why, the first 10, then
    a count; the summary line (which scripts parse) stays last and unchanged in form."""
    chat = tmp_path / "long_prompts.jsonl"
    long_user = {"messages": [{"role": "user", "content": "word " * 200},
                              {"role": "assistant", "content": "ok"}]}
    short = {"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}]}
    chat.write_text("".join(json.dumps(c) + "\n" for c in [short] + [long_user] * 12))
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "prepare_chat_sft.py"), "--input",
         str(chat), "--output-prefix", str(tmp_path / "sft"), "--tokenizer", TOKENIZER,
         "--seq-length", "64", "--overlong", "truncate"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    named = [line for line in lines if line.startswith(f"dropped {chat}:")]
    assert [line.split(":")[1] for line in named] == [str(n) for n in range(2, 12)]
    assert "hold no assistant token" in named[0] and "--seq-length" in named[0]
    assert lines[-2] == "dropped ... and 2 more"
    assert lines[-1].startswith("conversations=1 ") and " dropped=12 " in lines[-1]
