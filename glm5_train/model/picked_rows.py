"""Gathering each query's picked keys, shared by DSA's two sparse kernels (the absorbed
attention in ``sparse_mla.py`` over the latent keys, the indexer's ``_SelectedScores`` in
``dsa.py`` over its keys): a [B, S, D] key tensor seen as a table of rows, the picks of a chunk
of queries gathered with one row ``index_select`` into reused scratch buffers (fresh pages for
every chunk cost more than the copy itself on CPU), gradients added back with ``index_add_``.
"""

from __future__ import annotations

import torch


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """DSA's compute dtype: fp32 at least (bf16 promoted, fp64 kept for gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def fp32_at_least(t: torch.Tensor) -> torch.Tensor:
    """``t`` in DSA's compute dtype (``compute_dtype``)."""
    return t.to(compute_dtype(t))


class Scratch:
    """Named scratch tensors on one device, grown once and then reused across chunks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._held: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        numel = int(torch.Size(shape).numel())
        held = self._held.get(name)
        if held is None or held.numel() < numel or held.dtype != dtype:
            held = self._held[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return held[:numel].view(shape)


class RowTable:
    """Keys [B, S, D] as a table of rows [B*S, D] without copying: the [S, B] layout megatron
    produces (a transposed view) and a contiguous [B, S, D] both work.
    Row of (b, s) = b * b_step + s * s_step."""

    def __init__(self, keys_BSD: torch.Tensor) -> None:
        batch, seq, width = keys_BSD.shape
        if keys_BSD.is_contiguous():
            self.rows, self.b_step, self.s_step = keys_BSD.view(batch * seq, width), seq, 1
        elif keys_BSD.transpose(0, 1).is_contiguous():
            self.rows = keys_BSD.transpose(0, 1).view(seq * batch, width)
            self.b_step, self.s_step = 1, batch
        else:
            self.rows, self.b_step, self.s_step = keys_BSD.reshape(batch * seq, width), seq, 1
        self.batch, self.seq, self.width = batch, seq, width

    def row_index(self, idx_BTK: torch.Tensor) -> torch.Tensor:
        """Flat table rows [B*T*K] of the picks (each batch's picks index its own keys)."""
        batch_base = torch.arange(self.batch, device=idx_BTK.device) * self.b_step
        return (idx_BTK * self.s_step + batch_base[:, None, None]).flatten()

    def pick_rows(self, picks_BTK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat table rows [B*T*K] and validity [B, T, K] of picks that may be invalid: a pick
        is valid in 0..S-1 (-1: none); an invalid one reads row 0 of its batch (to be masked)."""
        valid = (picks_BTK >= 0) & (picks_BTK < self.seq)
        return self.row_index(torch.where(valid, picks_BTK, 0).long()), valid

    def gather(self, rows: torch.Tensor, tokens: int, scratch: Scratch) -> torch.Tensor:
        """[B*T, K, D] picked keys in the compute dtype (gathered first: only the chunk's rows
        are cast), written into ``scratch``."""
        picked = scratch.get("picked", (rows.numel(), self.width), self.rows.dtype)
        torch.index_select(self.rows, 0, rows, out=picked)
        compute = compute_dtype(picked)
        if picked.dtype != compute:
            picked = scratch.get("picked_compute", picked.shape, compute).copy_(picked)
        return picked.view(self.batch * tokens, -1, self.width)

    def as_input_layout(self, grad_rows: torch.Tensor) -> torch.Tensor:
        """A gradient table [B*S, D] viewed as the [B, S, D] input it belongs to."""
        if self.b_step == 1:
            return grad_rows.view(self.seq, self.batch, self.width).transpose(0, 1)
        return grad_rows.view(self.batch, self.seq, self.width)
