"""The sequence-chunked output projection + cross-entropy (parallel/chunked_cross_entropy.py).

- fp64 against whole logits + F.cross_entropy: per-token losses and the gradients of the head's
  input and weight, masked tokens included (their upstream gradient is 0), for chunk sizes that
  do not divide the token count, 1 and at least the token count.
- Vocab-parallel on 2 gloo ranks (with and without sequence parallelism) against the one-rank
  result, and in bf16 against megatron-core's own head (matmul + vocab_parallel_cross_entropy).
- What autograd saves: nothing of size [tokens, vocab].
- The training job (tests/parity.py): activations.loss_chunk_tokens=16 (4 chunks per head at 64
  tokens) against 0 (megatron's head), in one process, in pp2_vpp2 (MTP on the stage before the
  loss) and in tp2 (sequence parallel).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)

from glm5_train.plan import MemoryInputs
from glm5_train.plan.activations import loss_head_activation_bytes
from parallel.chunked_cross_entropy import chunked_vocab_parallel_cross_entropy
from tests.parity import FP32, Tolerances, assert_layout_ran, compare, run_job
from tests.spawn import model_parallel, run_ranks

S, B, H, V = 14, 3, 8, 12  # 42 tokens; S and V split over 2 ranks


def _problem(dtype: torch.dtype, seed: int = 0):
    """hidden [S, B, H], weight [V, H], labels [S, B], upstream per-token gradient [S, B]
    (a loss mask times a scale: about a third of the tokens masked out)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) / H ** 0.5
    labels = torch.randint(0, V, (S, B), generator=gen)
    grad = torch.rand(S, B, generator=gen, dtype=torch.float64)
    grad = grad * (torch.rand(S, B, generator=gen) > 0.33)
    return hidden.to(dtype), weight.to(dtype), labels, grad


def _reference(hidden, weight, labels, grad):
    """(losses, hidden grad, weight grad) from whole logits and F.cross_entropy."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = (hidden @ weight.t()).reshape(-1, weight.shape[0])
    loss = F.cross_entropy(logits, labels.reshape(-1), reduction="none").view(labels.shape)
    (loss * grad).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


def _chunked(hidden, weight, labels, grad, chunk, saved: dict | None = None, **parallel):
    """(losses, hidden grad, weight grad); ``saved``: filled with the storages autograd keeps
    for backward (by address), the weight's left out."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with _recording(saved) if saved is not None else contextlib.nullcontext():
        loss = chunked_vocab_parallel_cross_entropy(hidden, weight, labels, chunk, **parallel)
    if saved is not None:
        saved.pop(weight.untyped_storage().data_ptr(), None)
    (loss * grad.to(loss.dtype)).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


def _recording(saved: dict):
    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _storage_bytes(saved: dict) -> int:
    return sum(t.untyped_storage().nbytes() for t in saved.values())


@pytest.mark.parametrize("chunk", [1, 5, 16, 42, 1000])
def test_matches_whole_logits_in_fp64(chunk):
    """Exact math: agreement to fp64 rounding (measured <= 4e-15 absolute)."""
    problem = _problem(torch.float64)
    want = _reference(*problem)
    got = _chunked(*problem, chunk)
    for name, w, g in zip(("loss", "hidden grad", "weight grad"), want, got):
        assert torch.allclose(g, w, rtol=0, atol=1e-13), f"{name}: {(g - w).abs().max()}"
    masked = problem[3] == 0
    assert masked.any() and (got[1][masked] == 0).all(), "masked tokens must get no gradient"


def test_frozen_weight_gets_no_gradient_and_bad_arguments_are_refused():
    hidden, weight, labels, _ = _problem(torch.float64)
    hidden.requires_grad_()
    chunked_vocab_parallel_cross_entropy(hidden, weight, labels, 7).sum().backward()
    assert weight.grad is None and hidden.grad is not None
    with pytest.raises(ValueError, match="chunk_tokens=0 must be > 0"):
        chunked_vocab_parallel_cross_entropy(hidden, weight, labels, 0)
    with pytest.raises(ValueError, match=r"must be \[S, B\]"):
        chunked_vocab_parallel_cross_entropy(hidden, weight, labels.t(), 7)


def test_saves_nothing_of_tokens_by_vocab():
    """Saved for backward: the head's input, the weight, the labels and an fp32 log-sum-exp
    per token; whole logits would add 4 x T x V bytes (megatron's fp32 softmax)."""
    tokens, vocab, width = 64, 1000, 8
    hidden = torch.randn(tokens, 1, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens, 1))
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_vocab_parallel_cross_entropy(hidden, weight, labels, 16)
    loss.sum().backward()
    assert all(t.numel() < tokens * vocab for t in saved.values())
    storage = {p: t.untyped_storage().nbytes() for p, t in saved.items()}
    weight_ptr = weight.untyped_storage().data_ptr()
    activations = sum(n for p, n in storage.items() if p != weight_ptr)
    assert activations == tokens * (4 * width + 8 + 4), storage
    # The planner's term for one chunked head (glm5_train/plan/activations.py), exactly.
    cfg = SimpleNamespace(hidden_size=width, vocab_size=vocab)
    inputs = MemoryInputs(seq_length=tokens, activation_bytes=4, loss_chunk_tokens=16)
    assert loss_head_activation_bytes(cfg, inputs) == activations


# ------------------------------------------------------------------ vocab-parallel, 2 ranks


def _two_ranks(rank: int, world: int) -> dict:
    """On each TP rank: its vocabulary slice of the head, the sequence split (SP) or not; fp64
    chunked results, and bf16 chunked and megatron-core's head on the same bf16 inputs."""
    out = {}
    with model_parallel(tensor_model_parallel_size=world):
        group = parallel_state.get_tensor_model_parallel_group()
        for sp in (True, False):
            hidden, weight, labels, grad = _problem(torch.float64)
            local_h = hidden.chunk(world)[rank] if sp else hidden
            local_w = weight.chunk(world)[rank]
            saved: dict = {}
            out["fp64", sp] = _chunked(local_h, local_w, labels, grad, 7, saved, tp_group=group,
                                       sequence_parallel=sp)
            out["saved fp64", sp] = _storage_bytes(saved)
            entropy = torch.empty(S, B, dtype=torch.float64)
            chunked_vocab_parallel_cross_entropy(local_h, local_w, labels, 7, tp_group=group,
                                                 sequence_parallel=sp, entropy_SB=entropy)
            out["entropy", sp] = entropy
        hidden, weight, labels, grad = _problem(torch.bfloat16)
        local_h, local_w = hidden.chunk(world)[rank], weight.chunk(world)[rank]
        saved = {}
        out["bf16"] = _chunked(local_h, local_w, labels, grad, 7, saved, tp_group=group,
                               sequence_parallel=True)
        out["saved bf16"] = _storage_bytes(saved)
        out["megatron bf16"] = _megatron_head(local_h, local_w, labels, grad, group)
    return out


def _megatron_head(hidden, weight, labels, grad, group):
    """megatron-core's head under SP: gather, the linear's matmul, vocab_parallel_cross_entropy."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    gathered = gather_from_sequence_parallel_region(hidden, True, group=group)
    loss = vocab_parallel_cross_entropy(torch.matmul(gathered, weight.t()), labels)
    (loss * grad.to(loss.dtype)).sum().backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(2, _two_ranks)


def test_vocab_parallel_matches_one_rank(two_ranks):
    """Loss on every rank, each rank's slices of the gradients (the hidden one reduce-scattered
    under SP, all-reduced without), to fp64 rounding."""
    loss, grad_h, grad_w = _reference(*_problem(torch.float64))
    for rank, out in enumerate(two_ranks):
        for sp in (True, False):
            got_loss, got_h, got_w = out["fp64", sp]
            want_h = grad_h.chunk(2)[rank] if sp else grad_h
            for name, w, g in (("loss", loss, got_loss), ("hidden grad", want_h, got_h),
                               ("weight grad", grad_w.chunk(2)[rank], got_w)):
                assert torch.allclose(g, w, rtol=0, atol=1e-13), (rank, sp, name)


def _direct_entropy(hidden, weight) -> torch.Tensor:
    log_p = torch.log_softmax(hidden @ weight.t(), dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def test_entropy_per_token_on_one_rank():
    """The predictive entropy the chunked head measures beside the loss (RL's metric) equals
    -sum p log p of the whole logits, with the loss unchanged."""
    hidden, weight, labels, _ = _problem(torch.float64)
    entropy = torch.empty(S, B, dtype=torch.float64)
    loss = chunked_vocab_parallel_cross_entropy(hidden, weight, labels, 5, entropy_SB=entropy)
    assert torch.allclose(entropy, _direct_entropy(hidden, weight), rtol=0, atol=1e-13)
    assert torch.equal(loss, chunked_vocab_parallel_cross_entropy(hidden, weight, labels, 5))


def test_entropy_vocab_parallel(two_ranks):
    """Over two vocabulary slices (one more sum in the chunk's all-reduce), SP or not."""
    hidden, weight, _, _ = _problem(torch.float64)
    expected = _direct_entropy(hidden, weight)
    for out in two_ranks:
        for sp in (True, False):
            assert torch.allclose(out["entropy", sp], expected, rtol=0, atol=1e-13), sp


def test_sequence_parallel_saves_only_the_input_shard(two_ranks):
    """Under SP the head's input is saved as this rank's sequence shard [S/TP, B, H] (gathered
    again in backward, as ColumnParallelLinear does), not gathered: the shard, the labels
    (int64) and a log-sum-exp per token (fp64 here, fp32 for bf16). Without SP the whole input.
    The bf16 figure is the planner's term (tp 2, SP) exactly."""
    tokens = S * B
    for out in two_ranks:
        assert out["saved fp64", True] == 8 * (tokens // 2) * H + 16 * tokens
        assert out["saved fp64", False] == 8 * tokens * H + 16 * tokens
        assert out["saved bf16"] == 2 * (tokens // 2) * H + 12 * tokens
        cfg = SimpleNamespace(hidden_size=H, vocab_size=V)
        inputs = MemoryInputs(tp=2, sequence_parallel=True, seq_length=S, micro_batch_size=B,
                              activation_bytes=2, loss_chunk_tokens=7)
        assert loss_head_activation_bytes(cfg, inputs) == out["saved bf16"]


def test_bf16_matches_megatron_head(two_ranks):
    """bf16 inputs: logits from the bf16 GEMM raised to fp32 (megatron's ``.float()``), the
    logits' gradient in bf16 for the backward GEMMs. Against megatron's head: losses and the
    hidden gradient measured bitwise equal on CPU (bounds: 1e-6 relative, one bf16 ulp). The
    weight gradient is summed over chunks in fp32 from per-chunk bf16 GEMM outputs, megatron's
    is one bf16 GEMM: against the fp64 gradient of the same bf16 inputs ours was off by 1.3x
    and 1.6x megatron's own error (ranks 1, 0; 5.3e-3 of the largest element at most);
    bound 2.5x."""
    hidden, weight, labels, grad = _problem(torch.bfloat16)
    _, _, exact_w = _reference(hidden.double(), weight.double(), labels, grad)
    for rank, out in enumerate(two_ranks):
        (mloss, mgrad_h, mgrad_w), (loss, grad_h, grad_w) = out["megatron bf16"], out["bf16"]
        assert torch.allclose(loss, mloss, rtol=1e-6, atol=0)
        assert torch.allclose(grad_h.double(), mgrad_h.double(), rtol=2 ** -8, atol=0)
        want = exact_w.chunk(2)[rank]
        ours, theirs = ((g.double() - want).abs().max() for g in (grad_w, mgrad_w))
        assert grad_w.dtype == torch.bfloat16 and ours <= 2.5 * theirs, (rank, ours, theirs)


# ------------------------------------------------------------------------- the training job

CHUNKED = ["activations.loss_chunk_tokens=16"]  # 4 chunks per head of 64 tokens x batch 1

# Chunked against megatron's head in one process: the same math in another fp32 summation order
# (the weight gradient summed over chunks; log-sum-exp formed once). Measured over the 5 steps:
# step 1 losses and grad norm bitwise equal, per-parameter norms 4e-8; by step 5 (the weights
# have moved apart by ~1e-7, a routing decision amplifies it) losses 4.9e-8, grad norm 4.5e-6,
# indexer KL 1.7e-5, per-parameter norms 1.6e-5. Tolerances ~10x those. Layouts (pp2_vpp2 with
# the MTP split, tp2 with SP) add their own reduction order: compared with tests/parity.py's
# FP32 (measured there: losses 7.4e-8, grad norm 1.2e-5, indexer KL 2.9e-5, per-parameter
# 4.1e-5; tp2 with megatron's head alone gives 1.1e-5 in grad norm).
ONE_PROCESS = Tolerances(loss=5e-7, grad_norm=5e-5, indexer_kl=2e-4, param=2e-4)


@pytest.fixture(scope="module")
def megatron_head_reference(tmp_path_factory):
    overrides = ["parallel=single", "activations.loss_chunk_tokens=0"]
    return run_job(1, overrides, str(tmp_path_factory.mktemp("unchunked"))).records


@pytest.mark.parametrize("nprocs, layout, tol", [
    (1, "single", ONE_PROCESS), (2, "pp2_vpp2", FP32), (2, "tp2", FP32)])
def test_job_with_chunked_loss_matches_megatron_head(megatron_head_reference, tmp_path,
                                                     nprocs, layout, tol):
    overrides = [f"parallel={layout}", *CHUNKED]
    result = run_job(nprocs, overrides, str(tmp_path / layout))
    assert_layout_ran(result, nprocs, overrides)
    problems = compare(megatron_head_reference, result.records, tol)
    assert not problems, f"{layout} with a chunked loss diverges:\n" + "\n".join(problems)
