"""Tests for the data pipeline (CPU only): tokenizer, preprocessing, corpus, datasets, iterator."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import warnings

import numpy
import pytest
import torch

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from glm5_train import data as D  # noqa: E402
from glm5_train.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 64
GBS, MBS = 8, 2


# ------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def corpus_cfg(tmp_path_factory) -> D.DataConfig:
    """Config for a small built-in corpus (100 stdlib files: enough for a 98,1,1 split)."""
    root = tmp_path_factory.mktemp("corpus")
    return D.DataConfig(builtin_corpus_dir=str(root / "corpus"), builtin_max_files=100,
                        cache_dir=str(root / "cache"))


@pytest.fixture(scope="module")
def datasets(corpus_cfg):
    return D.build_train_valid_test_datasets(corpus_cfg, ByteTokenizer(), SEQ, 1234,
                                             (20 * GBS, 16, 16))


def _write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")


def _read_back(prefix) -> list[list[int]]:
    ds = IndexedDataset(prefix, mmap=False)
    return [ds[i].tolist() for i in range(len(ds))]


def _take(it, n):
    return [next(it) for _ in range(n)]


def _cat(batches, key):
    return torch.cat([b[key] for b in batches])


# ------------------------------------------------------------------------------------ tokenizer

def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ☃'\n"
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.detokenize(ids + [tok.eod, tok.pad]) == text
    assert (tok.eod, tok.pad, tok.vocab_size) == (256, 257, 258)
    assert tok.detokenize([0xE2, 0x98]) == "\ufffd"  # truncated UTF-8 is replaced, not raised


def test_build_tokenizer_errors(tmp_path):
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        build_tokenizer(str(tmp_path / "no-such-dir"))
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install transformers"):
            HFTokenizer(str(tmp_path))


def test_hf_tokenizer_wrapper_with_stub(tmp_path, monkeypatch):
    """The HF wrapper's interface, against a stand-in for transformers.AutoTokenizer."""
    import types

    class StubTok:
        eos_token_id, pad_token_id = 2, None

        def encode(self, text, add_special_tokens=True):
            return [10 + len(w) for w in text.split()]

        def decode(self, ids, skip_special_tokens=False):
            return " ".join("x" * (i - 10) for i in ids if i != self.eos_token_id)

        def __len__(self):
            return 100

    stub = types.SimpleNamespace(AutoTokenizer=types.SimpleNamespace(
        from_pretrained=lambda path, local_files_only: StubTok()))
    monkeypatch.setitem(sys.modules, "transformers", stub)
    tok = build_tokenizer(str(tmp_path))
    assert tok.tokenize("ab cde") == [12, 13] and tok.detokenize([12, 2, 13]) == "xx xxx"
    assert (tok.eod, tok.pad, tok.vocab_size) == (2, 2, 100)
    assert tok.name.startswith(f"hf-{tmp_path.name}-")
    json.dumps(tok.unique_identifiers)  # megatron hashes it into cache names


# ------------------------------------------------------------------------------------ preprocess

def test_preprocess_tool_jsonl_and_text(tmp_path):
    tok = ByteTokenizer()
    texts = ["hello world", "second document é", "third"]
    _write_jsonl(tmp_path / "a.jsonl", texts[:2])
    with open(tmp_path / "a.jsonl", "a") as f:
        f.write("\n")  # blank lines are skipped
    _write_jsonl(tmp_path / "b.jsonl", texts[2:])
    (tmp_path / "c.txt").write_text("a whole file\nis one doc\n", encoding="utf-8")
    prefix = str(tmp_path / "out" / "ds")
    result = subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", str(tmp_path / "*.jsonl"),
         str(tmp_path / "c.txt"), "--output-prefix", prefix],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    expected = [tok.tokenize(t) + [tok.eod] for t in texts + ["a whole file\nis one doc\n"]]
    n_tokens = sum(map(len, expected))
    assert result.stdout.strip().splitlines()[-1] == (
        f"documents=4 tokens={n_tokens} prefix={prefix}")
    assert _read_back(prefix) == expected
    assert IndexedDataset(prefix).index.dtype == numpy.uint16  # DType.optimal_dtype(258)


def test_preprocess_no_eod_and_json_key(tmp_path):
    tok = ByteTokenizer()
    _write_jsonl(tmp_path / "a.jsonl", ["abc", "", "de"], key="content")
    prefix = str(tmp_path / "ds")
    n_docs, n_tokens = D.build_indexed_dataset([str(tmp_path / "a.jsonl")], prefix, tok,
                                               json_key="content", append_eod=False)
    assert (n_docs, n_tokens) == (2, 5)  # the empty document is skipped
    assert _read_back(prefix) == [tok.tokenize("abc"), tok.tokenize("de")]


@pytest.mark.parametrize("bad_line, match", [
    ('{"text": "fine"}\n{"txt": "wrong key"}\n', r"bad\.jsonl:2: no string under key 'text'"),
    ('{"text": "fine"}\n\n{not json\n', r"bad\.jsonl:3: not valid JSON"),
])
def test_bad_jsonl_leaves_no_output(tmp_path, bad_line, match):
    (tmp_path / "bad.jsonl").write_text(bad_line, encoding="utf-8")
    prefix = str(tmp_path / "out" / "ds")
    with pytest.raises(ValueError, match=match):
        D.build_indexed_dataset([str(tmp_path / "bad.jsonl")], prefix, ByteTokenizer())
    assert os.listdir(tmp_path / "out") == []


def test_missing_or_empty_inputs(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        D.build_indexed_dataset([str(tmp_path / "missing.jsonl")], str(tmp_path / "x"), tok)
    with pytest.raises(FileNotFoundError, match="matches no file"):
        D.build_indexed_dataset([str(tmp_path / "*.jsonl")], str(tmp_path / "x"), tok)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt: not UTF-8 at byte 3"):
        D.build_indexed_dataset([str(tmp_path / "latin1.txt")], str(tmp_path / "x"), tok)
    with pytest.raises(ValueError, match="no input files"):
        D.build_indexed_dataset([], str(tmp_path / "x"), tok)
    assert not glob.glob(str(tmp_path / "x*"))


def test_check_dataset_prefix(tmp_path):
    prefix = str(tmp_path / "ds")
    with pytest.raises(FileNotFoundError, match=r"ds\.idx.*preprocess_data\.py"):
        D.check_dataset_prefix(prefix)
    _write_jsonl(tmp_path / "a.jsonl", ["some text", "more text"])
    D.build_indexed_dataset([str(tmp_path / "a.jsonl")], prefix, ByteTokenizer())
    D.check_dataset_prefix(prefix)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(5)
    with pytest.raises(ValueError, match="truncated"):
        D.check_dataset_prefix(prefix)
    with open(prefix + ".idx", "wb") as f:
        f.write(b"garbage!" * 4)
    with pytest.raises(ValueError, match=r"ds\.idx is corrupt"):
        D.check_dataset_prefix(prefix)


# ------------------------------------------------------------------------------------ config

@pytest.mark.parametrize("kwargs, match", [
    (dict(paths=["a", "b"], weights=[1.0]), "data.weights has 1 entries"),
    (dict(paths=["a"], weights=[-1.0]), "must be > 0"),
    (dict(split="98;1;1"), "data.split"),
    (dict(split="0,1,1"), "train split"),
    (dict(num_workers=-1), "num_workers"),
])
def test_config_validate(kwargs, match):
    with pytest.raises(ValueError, match=match):
        D.DataConfig(**kwargs).validate()


# ------------------------------------------------------------------------------------ corpus

def test_builtin_corpus_built_once(corpus_cfg):
    tok = ByteTokenizer()
    prefix = D.ensure_builtin_corpus(corpus_cfg, tok)
    assert prefix == D.builtin_corpus_prefix(corpus_cfg) and "byte" in os.path.basename(prefix)
    mtimes = [os.stat(prefix + s).st_mtime_ns for s in (".bin", ".idx")]
    assert D.ensure_builtin_corpus(corpus_cfg, tok) == prefix
    assert [os.stat(prefix + s).st_mtime_ns for s in (".bin", ".idx")] == mtimes
    docs = IndexedDataset(prefix, mmap=False)
    assert len(docs) == 100
    first = tok.detokenize(docs[0].tolist())
    src = D.stdlib_source_files(1)[0]
    with open(src, "rb") as f:
        assert first == f.read().decode("utf-8-sig", errors="replace")


def test_split_too_small_is_an_error_not_a_hang(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", ["one doc", "two doc"])
    prefix = str(tmp_path / "ds")
    D.build_indexed_dataset([str(tmp_path / "a.jsonl")], prefix, ByteTokenizer())
    cfg = D.DataConfig(paths=[prefix], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="gives the valid split 0 of the 2 documents"):
        D.build_train_valid_test_datasets(cfg, ByteTokenizer(), 8, 0, (4, 1, 1))


# ------------------------------------------------------------------------------------ datasets

def test_gpt_samples_are_shifted(datasets):
    train, valid, test = datasets
    assert len(train) >= 20 * GBS and len(valid) >= 16 and len(test) >= 16
    for i in (0, 1, len(train) - 1):
        s = train[i]
        assert set(s) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert s["tokens"].shape == s["labels"].shape == (SEQ,)
        assert torch.equal(s["labels"][:-1], s["tokens"][1:])
        assert torch.equal(s["position_ids"], torch.arange(SEQ))
        assert s["loss_mask"].dtype == torch.float32


def test_blend_of_two_prefixes_single_process(tmp_path, corpus_cfg):
    tok = ByteTokenizer()
    _write_jsonl(tmp_path / "a.jsonl", [f"document number {i} " * 20 for i in range(50)])
    other = str(tmp_path / "other")
    D.build_indexed_dataset([str(tmp_path / "a.jsonl")], other, tok)
    cfg = D.DataConfig(paths=[D.ensure_builtin_corpus(corpus_cfg, tok), other],
                       weights=[0.5, 0.5], split="100,0,0", cache_dir=str(tmp_path / "cache"),
                       reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)
    train, valid, test = D.build_train_valid_test_datasets(cfg, tok, SEQ, 7, (64, 0, 0))
    assert valid is None and test is None and len(train) == 64
    assert {int(train[i]["dataset_id"]) for i in range(64)} == {0, 1}
    batch = next(D.build_train_iterator(train, 4, 8, 0, 1, 0))
    # Packed documents: their boundaries (a document ends after its eod), never an [s, s] mask.
    assert "attention_mask" not in batch and batch["cu_seqlens"].dtype == torch.int32
    eod = batch["tokens"] == tok.eod
    ends = set(batch["cu_seqlens"].tolist())
    assert all(i + 1 in ends for i in torch.nonzero(eod.view(-1)).view(-1).tolist())
    assert (batch["loss_mask"][eod] == 0).all()


# ------------------------------------------------------------------------------------ iterator

def test_iterator_layout_and_dp_equivalence(datasets):
    train = datasets[0]
    n_global = 4
    single = _take(D.build_train_iterator(train, MBS, GBS, 0, 1, 0), n_global * GBS // MBS)
    ranks = [_take(D.build_train_iterator(train, MBS, GBS, r, 2, 0), n_global * GBS // MBS // 2)
             for r in range(2)]
    per_rank = GBS // MBS // 2
    for g in range(n_global):
        ref = single[g * 2 * per_rank:(g + 1) * 2 * per_rank]
        dp = ranks[0][g * per_rank:(g + 1) * per_rank] + ranks[1][g * per_rank:(g + 1) * per_rank]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(_cat(ref, key), _cat(dp, key))
        # global batch g is dataset samples [g*GBS, (g+1)*GBS) in order
        expected = torch.stack([train[i]["tokens"] for i in range(g * GBS, (g + 1) * GBS)])
        assert torch.equal(_cat(ref, "tokens"), expected)
    assert single[0]["tokens"].shape == (MBS, SEQ) and single[0]["tokens"].dtype == torch.int64


@pytest.mark.parametrize("dp_rank, dp_size", [(0, 1), (1, 2)])
def test_iterator_resume(datasets, dp_rank, dp_size):
    train = datasets[0]
    per_global = GBS // (MBS * dp_size)
    full = _take(D.build_train_iterator(train, MBS, GBS, dp_rank, dp_size, 0), 5 * per_global)
    resumed = _take(D.build_train_iterator(train, MBS, GBS, dp_rank, dp_size, 2 * GBS),
                    3 * per_global)
    for a, b in zip(full[2 * per_global:], resumed):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["labels"], b["labels"])


def test_iterator_workers_and_end(datasets):
    train = datasets[0]
    with_workers = _take(D.build_train_iterator(train, MBS, GBS, 0, 1, 0, num_workers=2), 8)
    plain = _take(D.build_train_iterator(train, MBS, GBS, 0, 1, 0), 8)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(with_workers, plain))
    n_full = len(train) // GBS
    tail = list(D.build_train_iterator(train, MBS, GBS, 0, 1, (n_full - 1) * GBS))
    assert len(tail) == GBS // MBS  # only the last full global batch; a partial one is dropped


def test_iterator_rejects_bad_layout(datasets):
    train = datasets[0]
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        D.build_train_iterator(train, 3, GBS, 0, 1, 0)
    with pytest.raises(ValueError, match="consumed_samples"):
        D.build_train_iterator(train, MBS, GBS, 0, 1, GBS + 1)
    with pytest.raises(ValueError, match="dp_rank"):
        D.build_train_iterator(train, MBS, GBS, 2, 2, 0)


# ------------------------------------------------------------------------------------ multi-rank

def _two_rank_worker(rank, root, init_file, out_file):
    torch.set_num_threads(1)  # forked child: don't touch the parent's OpenMP pool
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=2)
    try:
        cfg = D.DataConfig(builtin_corpus_dir=os.path.join(root, "corpus"), builtin_max_files=60,
                           split="100,0,0", cache_dir=os.path.join(root, "cache"))
        train, _, _ = D.build_train_valid_test_datasets(cfg, ByteTokenizer(), SEQ, 5, (32, 0, 0))
        batch = next(D.build_train_iterator(train, MBS, GBS, rank, 2, 0))
        torch.save({"tokens": batch["tokens"], "first": train[0]["tokens"]}, f"{out_file}{rank}")
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_build_corpus_and_indices_concurrently(tmp_path):
    """Both ranks call the builders at once on empty dirs: rank 0 builds, rank 1 waits; each
    rank then gets its slice of the same global batch a single process sees."""
    # fork: children inherit the imported modules (spawn would re-import megatron, ~10 s).
    torch.multiprocessing.start_processes(
        _two_rank_worker, args=(str(tmp_path), str(tmp_path / "init"), str(tmp_path / "out")),
        nprocs=2, join=True, start_method="fork")
    cfg = D.DataConfig(builtin_corpus_dir=str(tmp_path / "corpus"), builtin_max_files=60,
                       split="100,0,0", cache_dir=str(tmp_path / "cache"))
    train, _, _ = D.build_train_valid_test_datasets(cfg, ByteTokenizer(), SEQ, 5, (32, 0, 0))
    for rank in range(2):
        got = torch.load(tmp_path / f"out{rank}")
        assert torch.equal(got["first"], train[0]["tokens"])
        start = rank * GBS // 2
        expected = torch.stack([train[i]["tokens"] for i in range(start, start + MBS)])
        assert torch.equal(got["tokens"], expected)
    assert not glob.glob(str(tmp_path / "corpus" / "*.tmp-*"))
