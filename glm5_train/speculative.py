"""MTP acceptance length: greedy speculative decoding with the MTP steps as the draft.

What is measured (GLM-5's report, DeepSeek-V3 and EAGLE count it so): each decoding round one
main-model forward verifies the draft; the round produces the main model's greedy token
(always) plus the longest prefix of the k draft tokens that equal what the main model greedily
produces after it. Accept length = tokens produced per verification, averaged over rounds:
1 <= accept length <= 1 + k.

The draft of a round whose verified text ends at position t (the main model's next token
x[t+1] known from the last verification) is the MTP chain as trained
(glm5_train/model/mtp.py): step 1 at t reads the main hidden state at t and the embedding of
x[t+1]; step j reads step j-1's hidden state at t and the embedding of token t + j, which is
step j-1's own draft; draft j = argmax of the shared head on step j's output at t (a guess at
token t + j + 1). Each step is a transformer layer, so step j at t also attends to step j's
states at every earlier position i, built the same way from tokens up to i + j.

Exact from one teacher-forced forward. Greedy speculative decoding emits exactly the main
model's greedy continuation y (verification makes it lossless). Draft j only counts when drafts
1..j-1 were accepted, i.e. equal y[t+2 .. t+j]; every token the chain has read by step j is
then y's (step j at a position i <= t reads tokens <= i + j <= t + j), so draft j is the
argmax of MTP head j at t in one forward of the model over y. With n(t) = the number of leading
heads j whose argmax at t equals y[t+j+1], a run with k draft steps goes through rounds
t_0 = P - 1 (the prompt's last position), t_{r+1} = t_r + 1 + min(n(t_r), k), round r
producing 1 + min(n(t_r), k) tokens. This is what a decoder computes that rebuilds the draft
chain each round (or caches a step's states only where their input tokens are verified); here
it costs one greedy generation and one forward for every k at once.

Counted are the rounds whose whole window (tokens t+1 .. t+k+1) lies in the generated text;
generation ends at the first end-of-document token (a decoder stops there).
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.utils import is_pp_last_stage
from megatron.core.process_groups_config import ProcessGroupCollection

from glm5_train.data import stdlib_source_files
from glm5_train.inference import compute_head_logits, compute_logits
from parallel.comm_purpose import collective_purpose
from parallel.device import comm_device


@dataclasses.dataclass
class AcceptLength:
    """Rounds of greedy speculative decoding with ``draft_steps`` drafts per round."""

    draft_steps: int
    rounds: int
    tokens: int  # produced by those rounds: one main-model token each plus accepted drafts

    @property
    def accept_length(self) -> float:
        return self.tokens / self.rounds if self.rounds else float("nan")


# ------------------------------------------------------------------ counting (no processes)


def leading_matches(drafts_KS: torch.Tensor, text_S: torch.Tensor) -> torch.Tensor:
    """n(t) [S]: how many of the K heads at position t, in order, guessed the text's token
    (head j at t guesses token t + j + 1; a head whose target lies past the text never
    matches). ``drafts_KS``: each MTP head's argmax; ``text_S``: the greedy text."""
    k_max, s = drafts_KS.shape
    n_S = torch.zeros(s, dtype=torch.long)
    alive_S = torch.ones(s, dtype=torch.bool)
    for j in range(1, k_max + 1):
        match_S = torch.zeros(s, dtype=torch.bool)
        reach = max(0, s - j - 1)  # positions whose head-j target is inside the text
        match_S[:reach] = drafts_KS[j - 1, :reach] == text_S[j + 1:j + 1 + reach]
        alive_S &= match_S
        n_S += alive_S.long()
    return n_S


def tokens_per_round(n_S: torch.Tensor, first: int, last: int, k: int) -> list[int]:
    """Tokens produced by each round with ``k`` drafts, from the round at position ``first``
    while the round's window ends at or before position ``last`` (the text's last token)."""
    produced, t = [], first
    while t + k + 1 <= last:
        step = 1 + min(int(n_S[t]), k)
        produced.append(step)
        t += step
    return produced


def accept_lengths(drafts_BKS: torch.Tensor, text_BS: torch.Tensor, prompt_tokens: int,
                   ends_B: list[int], max_draft_steps: int) -> list[AcceptLength]:
    """Accept length at 1..``max_draft_steps`` drafts over every sample's rounds (rounds
    pooled). ``ends_B``: each sample's last usable position (see ``text_end``)."""
    results = []
    for k in range(1, max_draft_steps + 1):
        rounds = tokens = 0
        for drafts_KS, text_S, last in zip(drafts_BKS, text_BS, ends_B):
            produced = tokens_per_round(leading_matches(drafts_KS, text_S),
                                        prompt_tokens - 1, last, k)
            rounds, tokens = rounds + len(produced), tokens + sum(produced)
        results.append(AcceptLength(k, rounds, tokens))
    return results


def text_end(text_S: torch.Tensor, prompt_tokens: int, eod: int) -> int:
    """The last position a decoder reaches: the first generated end-of-document token, else
    the end of the text."""
    generated = (text_S[prompt_tokens:] == eod).nonzero()
    return prompt_tokens + int(generated[0]) if len(generated) else len(text_S) - 1


# ---------------------------------------------------------------------------- held-out text


def held_out_stdlib_files(corpus_files: int) -> list[str]:
    """The standard-library files after the built-in corpus's first ``corpus_files`` (the
    corpus is the first files by sorted path, glm5_train.data.stdlib_source_files): never
    trained on."""
    return stdlib_source_files(10 ** 6)[corpus_files:]


def held_out_windows(files: list[str], tokenizer, samples: int, prompt_tokens: int,
                     new_tokens: int) -> torch.Tensor:
    """[samples, prompt_tokens + new_tokens] int64: from each file (in order) long enough, the
    prompt = the ``prompt_tokens`` tokens ending at its middle (inside the code, past license
    headers and module docstrings), then the file's own next ``new_tokens``. Raises
    ValueError when fewer files are long enough."""
    windows, needed = [], 2 * max(prompt_tokens, new_tokens)
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as handle:
            ids = tokenizer.tokenize(handle.read())
        if len(ids) >= needed:
            middle = len(ids) // 2
            windows.append(ids[middle - prompt_tokens:middle + new_tokens])
        if len(windows) == samples:
            return torch.tensor(windows, dtype=torch.int64)
    names = ", ".join(os.path.basename(f) for f in files[:3]) + (", ..." if len(files) > 3
                                                                  else "")
    raise ValueError(f"{len(windows)} of the {len(files)} held-out files ({names}) hold "
                     f">= {needed} tokens (2 x the larger of --prompt-tokens and --new-tokens), "
                     f"{samples} needed (--samples): give fewer samples, fewer tokens or more "
                     "text")


def head_accuracy(guesses_BHS: torch.Tensor, text_BS: torch.Tensor,
                  prompt_tokens: int) -> list[float]:
    """Per head h (0 main, j MTP step j): the share of positions t >= prompt_tokens - 1 whose
    guess equals the text's token t + h + 1 (each head graded on its own, teacher-forced)."""
    shares = []
    for h in range(guesses_BHS.shape[1]):
        first, stop = prompt_tokens - 1, text_BS.shape[1] - h - 1
        right = guesses_BHS[:, h, first:stop] == text_BS[:, first + h + 1:]
        shares.append(float(right.float().mean()) if right.numel() else float("nan"))
    return shares


# ------------------------------------------------------------------- decoding (collective)


def this_ranks_rows(samples: int, groups: ProcessGroupCollection) -> slice:
    """The samples this data-parallel rank decodes (the tool checks that DP divides them)."""
    share = samples // groups.dp.size()
    return slice(groups.dp.rank() * share, (groups.dp.rank() + 1) * share)


def _reports(groups: ProcessGroupCollection) -> bool:
    """One rank per data-parallel rank holds its rows' results: the last stage's TP rank 0."""
    return is_pp_last_stage(groups.pp) and groups.tp.rank() == 0


@collective_purpose("accept_length")
def _share(mine: torch.Tensor | None, rows: slice, shape: tuple,
           groups: ProcessGroupCollection) -> torch.Tensor:
    """Every data-parallel rank's rows (``mine`` on reporting ranks) on every rank: one sum
    over the world, to which only reporting ranks add their rows."""
    whole = torch.zeros(shape, dtype=torch.int64, device=comm_device())
    if _reports(groups):
        whole[rows] = mine.to(whole.device)
    dist.all_reduce(whole)
    return whole.cpu()


def greedy_continuation(chunks: list, prompts_BP: torch.Tensor, new_tokens: int, filler: int,
                        groups: ProcessGroupCollection, micro_batch_size: int) -> torch.Tensor:
    """[B, P + new_tokens]: the prompts and the main model's greedy continuation, the same on
    every rank. Collective. Each step runs the whole length (``filler`` past the text: causal
    attention makes it invisible), so every forward has the layout's checked sequence length."""
    b, p = prompts_BP.shape
    text_BS = torch.full((b, p + new_tokens), filler, dtype=torch.int64)
    text_BS[:, :p] = prompts_BP
    rows = this_ranks_rows(b, groups)
    for position in range(p, p + new_tokens):
        logits_BSV = compute_logits(chunks, text_BS[rows], groups, micro_batch_size)
        mine = None if logits_BSV is None else logits_BSV[:, position - 1].argmax(-1)
        text_BS[:, position] = _share(mine, rows, (b,), groups)
    return text_BS


def head_guesses(chunks: list, text_BS: torch.Tensor, groups: ProcessGroupCollection,
                 micro_batch_size: int) -> torch.Tensor:
    """[B, 1 + K, S]: every head's argmax over the text (head 0 the main model's, head j the
    j-th MTP step's), the same on every rank. Collective."""
    rows = this_ranks_rows(text_BS.shape[0], groups)
    logits_BHSV = compute_head_logits(chunks, text_BS[rows], groups, micro_batch_size)
    mine = None if logits_BHSV is None else logits_BHSV.argmax(-1)
    heads = 1 + chunks[0].mtp_num_steps
    return _share(mine, rows, (text_BS.shape[0], heads, text_BS.shape[1]), groups)


def measure(chunks: list, prompts_BP: torch.Tensor, new_tokens: int, eod: int,
            groups: ProcessGroupCollection,
            micro_batch_size: int = 1) -> tuple[list[AcceptLength], torch.Tensor, int]:
    """(accept length at 1..K drafts, the greedy text [B, S], the number of generated
    positions where the teacher-forced main head's argmax differs from the text: reduction
    order between the step-by-step and the whole-text forwards, near-ties only; expect 0).
    K = the model's ``mtp_num_steps``; each data-parallel rank runs its share of the B
    sequences in micro-batches of ``micro_batch_size``. Collective."""
    prompt_tokens = prompts_BP.shape[1]
    text_BS = greedy_continuation(chunks, prompts_BP, new_tokens, eod, groups,
                                  micro_batch_size)
    guesses_BHS = head_guesses(chunks, text_BS, groups, micro_batch_size)
    ends_B = [text_end(text_S, prompt_tokens, eod) for text_S in text_BS]
    main_BS, drafts_BKS = guesses_BHS[:, 0], guesses_BHS[:, 1:]
    differs = sum(int((main_S[prompt_tokens - 1:last] != text_S[prompt_tokens:last + 1]).sum())
                  for main_S, text_S, last in zip(main_BS, text_BS, ends_B))
    results = accept_lengths(drafts_BKS, text_BS, prompt_tokens, ends_B,
                             drafts_BKS.shape[1])
    return results, text_BS, differs


def held_out_head_accuracy(chunks: list, held_out_BS: torch.Tensor, prompt_tokens: int,
                           groups: ProcessGroupCollection,
                           micro_batch_size: int = 1) -> list[float]:
    """``head_accuracy`` of every head on the held-out text itself (not the model's greedy
    text): how well each head predicts real text past the prompt. Collective."""
    guesses_BHS = head_guesses(chunks, held_out_BS, groups, micro_batch_size)
    return head_accuracy(guesses_BHS, held_out_BS, prompt_tokens)
