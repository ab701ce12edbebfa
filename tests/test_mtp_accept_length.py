"""tools/mtp_accept_length.py on planted models whose accept length is known, and in a
parallel layout against one process.

The planted tiny GLM-5 (weights set, then saved as a checkpoint the tool loads): every attention
and MLP output projection is zero, so each residual stream carries its token's embedding
unchanged. Embeddings are orthonormal: token x is the unit vector of dimension d(x) (the 96
printable characters 32..127 each their own dimension, every other token one of 32 shared
ones). The output head maps dimension d to the token after it on the cycle 32 -> 33 -> ...
-> 127 -> 32, so the main model's greedy text from any printable prompt walks the cycle
(never an end-of-document token). The MTP layer's eh_proj takes +-1 times the embedding of the
token it reads (dimension d(x) kept or flipped per token) plus 0.5 times the normalised hidden
state. Step j at position t reads token t + j: kept, the head's argmax is the token after it,
which is what the main model produces (draft right); flipped, the embedding part scores that
token negative and the hidden state's part (the previous step's token, or the main model's at
t) wins instead: a token the cycle reaches only later (draft wrong). So draft j at t is right
exactly when token t + j is a kept token, and speculative decoding's rounds follow by hand:
``rounds_by_hand`` runs them literally (draft until the first wrong one, the main model's token
always, next round after the last accepted token).

Planted cases: every token kept (accept length 1 + k at every k), none kept (1), tokens not
divisible by 3 kept (a k-dependent figure between). The parallel check: the 3-in-1 checkpoint
on PP2 (GLM-5's split MTP placement: the MTP layer on stage 0, its [main; steps] hidden states
sent to the loss stage) and on TP2 + SP (every head's logits gathered over sequence shards and
the vocabulary split) gives one process's lines exactly.
"""

from __future__ import annotations

import re

import pytest
import torch

from glm5_train.assembly import build_model
from glm5_train.checkpoint import TrainState, save_checkpoint
from glm5_train.job_config import compose_job
from parallel import mcore_compat, process_groups
from tests.parity import run_script

TOOL = "tools/mtp_accept_length.py"
HIDDEN, FIRST, CYCLE = 128, 32, 96  # the printable tokens 32..127, each its own embedding dimension
PROMPT, NEW, SAMPLES, DRAFTS = 16, 16, 2, 4
OPTIONS = ["--samples", str(SAMPLES), "--prompt-tokens", str(PROMPT), "--new-tokens", str(NEW),
           "--draft-steps", str(DRAFTS), "model=glm5_tiny"]
PLANTS = {"all_right": lambda x: True, "all_wrong": lambda x: False,
          "not_multiple_of_3": lambda x: x % 3 != 0}
LINE = re.compile(r"^draft_steps=(\d+) accept_length=([\d.]+) rounds=(\d+) tokens=(\d+)$")


def dimension(token: int, hidden: int) -> int:
    if FIRST <= token < FIRST + CYCLE:
        return token - FIRST
    return CYCLE + token % (hidden - CYCLE)


def next_token(dim: int) -> int:
    """The main model's greedy successor of a token on dimension ``dim``."""
    return FIRST + ((dim + 1) % CYCLE if dim < CYCLE else dim - CYCLE)


def plant(model: torch.nn.Module, kept) -> None:
    """Set the one-process model's weights as the module docstring describes."""
    hidden, vocab = model.config.hidden_size, model.vocab_size
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "linear_proj" in name or "linear_fc2" in name:
                param.zero_()  # attention and MLP outputs: the residual stream is the embedding
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
        embedding = model.embedding.word_embeddings.weight
        embedding.zero_()
        for token in range(vocab):
            embedding[token, dimension(token, hidden)] = 1.0
        head = model.output_layer.weight
        head.zero_()
        for dim in range(hidden):
            head[next_token(dim), dim] = 1.0
        eh_proj = model.mtp.layers[0].eh_proj.weight  # [H, 2H]: (embedding, hidden state) in
        eh_proj.zero_()
        for dim in range(hidden):
            sign = 1.0 if dim >= CYCLE or kept(FIRST + dim) else -1.0
            eh_proj[dim, dim] = sign
            eh_proj[dim, hidden + dim] = 0.5


def rounds_by_hand(prompt_last: int, k: int, kept) -> float:
    """Speculative decoding's accept length on the planted model, literally: the greedy text
    walks the cycle; draft j of a round at t is right iff token t + j is kept."""
    text = [prompt_last]  # position P - 1, then the NEW generated tokens
    for _ in range(NEW):
        text.append(next_token(dimension(text[-1], HIDDEN)))
    rounds = tokens = t = 0
    while t + k + 1 <= NEW:  # the window t+1 .. t+k+1 inside the text
        accepted = 0
        while accepted < k and kept(text[t + accepted + 1]):
            accepted += 1
        rounds, tokens, t = rounds + 1, tokens + 1 + accepted, t + 1 + accepted
    return tokens / rounds


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """({case: checkpoint directory}, the held-out text files: prompts of 'a's)."""
    root = tmp_path_factory.mktemp("mtp_accept")
    texts = [root / f"held_out_{i}.txt" for i in range(SAMPLES)]  # one prompt per file
    for text in texts:
        text.write_text("a" * (4 * PROMPT))
    job = compose_job(["model=glm5_tiny", "parallel=single", "checkpoint.save=null",
                       f"model.mtp_num_steps={DRAFTS}"])
    mcore_compat.install()
    checkpoints = {}
    with process_groups.single_process_group():
        _, chunks = build_model(job, process_groups.groups())
        for case, kept in PLANTS.items():
            plant(chunks[0], kept)
            checkpoints[case] = str(root / case)
            save_checkpoint(checkpoints[case], chunks, None, None, TrainState(), job.model)
    return checkpoints, [str(text) for text in texts]


@pytest.fixture(scope="module")
def one_process(planted):
    """The tool's lines for a planted case on one process (each case run once)."""
    checkpoints, texts = planted
    lines: dict[str, list[str]] = {}

    def run(case: str) -> list[str]:
        if case not in lines:
            lines[case] = run_tool(1, checkpoints[case], texts, "parallel=single")
        return lines[case]
    return run


def run_tool(nprocs: int, checkpoint: str, texts: list[str], *layout: str) -> list[str]:
    proc = run_script(nprocs, TOOL, ["--load", checkpoint, "--text", *texts, *OPTIONS, *layout])
    assert proc.returncode == 0, proc.stdout[-4000:]
    return [line for line in proc.stdout.splitlines()
            if line.startswith(("draft_steps=", "text:", "first continuation:", "held-out"))]


def accept_lengths(lines: list[str]) -> dict[int, float]:
    found = [LINE.match(line) for line in lines]
    return {int(m[1]): int(m[4]) / int(m[3]) for m in found if m}


@pytest.mark.parametrize("case", sorted(PLANTS))
def test_planted_accept_length(one_process, case):
    lines = one_process(case)
    assert "main head off the greedy text at 0 positions" in " ".join(lines)
    measured = accept_lengths(lines)
    expected = {k: rounds_by_hand(ord("a"), k, PLANTS[case]) for k in range(1, DRAFTS + 1)}
    assert measured == pytest.approx(expected, abs=1e-12), (lines, expected)
    if case == "all_right":
        assert measured == {k: 1.0 + k for k in expected}
    if case == "all_wrong":
        assert set(measured.values()) == {1.0}
    if case == "not_multiple_of_3":  # strictly between the two, and not the same at every k
        assert all(1.0 < v < 1.0 + k for k, v in measured.items())
        assert len(set(measured.values())) > 1


@pytest.mark.parametrize("layout", ["parallel=pp2", "parallel=tp2"])
def test_two_ranks_equal_one_process(planted, one_process, layout):
    checkpoints, texts = planted
    two = run_tool(2, checkpoints["not_multiple_of_3"], texts, layout)
    assert two == one_process("not_multiple_of_3")


@pytest.mark.parametrize("nprocs,args,message", [
    (1, ["--untrained", "--draft-steps", "4", "--new-tokens", "4"],
     "--new-tokens 4 < --draft-steps 4 + 1"),
    (1, ["--load", "/nonexistent/ckpt"], "--load /nonexistent/ckpt: no such directory"),
    (1, ["--untrained", "model.num_nextn_predict_layers=0", "model.mtp_num_steps=0"],
     "has no MTP layer to draft with"),
    (2, ["--untrained", "--samples", "3", "parallel.data_parallel_size=2"],
     "train.global_batch_size=--samples 3"),
])
def test_bad_input_is_refused_in_one_line(nprocs, args, message):
    proc = run_script(nprocs, TOOL, [*args, "parallel=single"])
    lines = [line for line in proc.stdout.splitlines() if "mtp_accept_length:" in line]
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert len(lines) == 1 and message in lines[0], proc.stdout[-3000:]
