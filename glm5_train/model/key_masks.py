"""Which keys a query may see beyond causality, in the two forms the attention takes.

- megatron-core's attention mask [B, 1, T, S] bool (True = masked out), handed over as the
  ``allowed`` form [B, T, S] (True = may attend): general, quadratic in memory;
- ``DocumentStarts`` [B, T]: packed documents, each query sees the keys of its own document
  only, i.e. keys from its document's first position on. Linear in memory, so packed sequences
  of 202K tokens cost nothing extra; it travels in the attention-mask argument of megatron-
  core's modules as an int64 [B, T] tensor (a bool mask is megatron's form), which those modules
  only pass through.

Positions are global (a context-parallel rank's rows hold their own documents' starts).
Because RoPE depends only on the distance between query and key, a document attended in a
packed sequence computes what it computes alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DocumentStarts:
    """``start_BT``: the global position of each query row's document start."""

    start_BT: torch.Tensor

    def block(self, t0: int, t1: int, s0: int, s1: int) -> torch.Tensor:
        """[B, t1 - t0, s1 - s0] True where rows t0..t1-1 may see keys s0..s1-1."""
        keys = torch.arange(s0, s1, device=self.start_BT.device)
        return keys[None, None, :] >= self.start_BT[:, t0:t1, None]


KeyMask = torch.Tensor | DocumentStarts | None


def earliest_starts(mask: KeyMask, rows: int, query_block: int) -> list[int]:
    """Per block of ``query_block`` query rows, the earliest document start among its rows
    (over the batch too), in one transfer from the device; all 0 without packed documents.
    No row of the block sees a key before it, so attention-like scans of the block may start
    there: in a sequence of short documents that skips most of the causal triangle (8,192
    tokens of 600-token conversations at GLM-5's query blocks: 10x fewer pairs,
    ``bench/dsa_packed_topk.py``)."""
    if not isinstance(mask, DocumentStarts):
        return [0] * len(range(0, rows, query_block))
    starts_T = mask.start_BT.min(dim=0).values
    # the last block padded with a start past every row (global positions: not bounded by
    # ``rows`` under context parallelism), then one min per block
    past = starts_T.new_full((-rows % query_block,), torch.iinfo(starts_T.dtype).max)
    padded = torch.cat([starts_T, past])
    return padded.view(-1, query_block).min(dim=1).values.tolist()


def key_mask(attention_mask: torch.Tensor | None) -> KeyMask:
    """The form a core attention's ``attention_mask`` argument arrives in: None, document
    starts (int64 [B, T]) or megatron's bool mask [B, 1, T, S] (True = masked out)."""
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        return ~attention_mask[:, 0]
    return DocumentStarts(attention_mask.long())


def allowed_block(mask: KeyMask, t0: int, t1: int, s0: int, s1: int) -> torch.Tensor | None:
    """[B (or 1), t1 - t0, s1 - s0] allowed keys of a block, None when everything is."""
    if mask is None:
        return None
    if isinstance(mask, DocumentStarts):
        return mask.block(t0, t1, s0, s1)
    return mask[:, t0:t1, s0:s1]


def document_bounds(start_BT: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per batch row, its documents' (first, past-the-last) rows, in order, from the document
    starts of whole sequences (rows 0..T-1 at positions 0..T-1). Starts that do not describe
    contiguous documents (row 0 starting one, each row starting one or continuing the row
    before's) are refused."""
    seq = start_BT.shape[1]
    rows = torch.arange(seq, device=start_BT.device)
    continues = torch.nn.functional.pad(start_BT[:, 1:] == start_BT[:, :-1], (1, 0))
    if not bool(((start_BT == rows) | continues).all()):
        raise ValueError("document starts must give every token its own document's first "
                         "position (row 0 starts one; a token starts one or continues the "
                         "one before): build them with key_masks.document_starts_from_*")
    bounds = []
    for row in start_BT.tolist():
        firsts = sorted(set(row))
        bounds.append(list(zip(firsts, [*firsts[1:], seq])))
    return bounds


def document_starts_from_boundaries(ends_BD: list[list[int]], seq: int,
                                    device=None) -> torch.Tensor:
    """[B, seq] document starts from each sample's document end positions (exclusive)."""
    starts = torch.zeros(len(ends_BD), seq, dtype=torch.long, device=device)
    for b, ends in enumerate(ends_BD):
        begin = 0
        for end in ends:
            starts[b, begin:end] = begin
            begin = end
        starts[b, begin:] = begin
    return starts


def document_starts_from_eod(tokens_BS: torch.Tensor, eod: int) -> torch.Tensor:
    """[B, S] document starts of packed documents, each ending with its ``eod`` token (the
    end-of-document token belongs to the document it ends)."""
    seq = tokens_BS.shape[1]
    positions = torch.arange(seq, device=tokens_BS.device).expand_as(tokens_BS)
    after_eod = torch.where(tokens_BS == eod, positions + 1, torch.zeros_like(positions))
    # Start of t's document = 1 + the last eod strictly before t (0 without one).
    shifted = torch.nn.functional.pad(after_eod[:, :-1], (1, 0))
    return torch.cummax(shifted, dim=1).values
