"""Head-parallel (Ulysses-style) context parallelism for DSA + MLA: ``parallel.cp_comm=
head_parallel``.

The all-gather mode (``DSACoreAttention._attend``) keeps each rank's queries on its zigzag
sequence shard and gathers the keys. Here the queries change hands instead: an all-to-all over
the CP group of c ranks takes the query [T, B, N, Dn + R] (T = S / c rows, every head) to
[S, B, N / c, Dn + R] (every row, this rank's N / c heads), attention runs over the whole
sequence for those heads, and the inverse all-to-all brings the output [S, B, N / c x Dv] back
to [T, B, N x Dv] (``parallel/hierarchical_all_to_all.py``: flat, or in two levels with
``parallel.cp_node_size``). Both cross before absorption / after the up-projection, at
Dn + R and Dv values per head (256 and 256 in GLM-5; the absorbed forms would be 576 and 512).

What is not per head still crosses by all-gather, as in the all-gather mode: MLA's latent key
(C + R values per token, shared by all heads: MQA) and the indexer key (Di). The indexer
selects top-k for this rank's own rows (its cost is quadratic: each rank scores its S / c
rows); the selection [T, B, K] is then all-gathered (int32, -1 marking a pick past the causal
keys) because every rank now attends for all S rows. For the indexer KL, the attention
probabilities of the picks, summed over this rank's heads for all S rows, are reduce-scattered
back to the rows' owners (sum over all heads), where the KL runs as in the all-gather mode.
Dense attention, trained (dsa.stage=dense, or top-k covering the sequence): nothing is
gathered; each rank up-projects its own rows' latent for every head (as one process does)
and query, key and value [T, B, N, 2 (Dn + R) + Dv] go to head shards in one all-to-all (the
classic Ulysses exchange). The dense warm-up, whose KL needs every head's attention of a
row, gathers the latent instead, up-projects it for this rank's heads, and runs the KL on
the sequence shard with the whole latent up-projected for every head (detached), as in the
all-gather mode. Packed documents (document starts [B, T]) work in every path: the starts of
all S rows are gathered (int64) for the attention over the whole sequence; the indexer and
the KL run on this rank's rows with its own starts.

Bytes per layer and rank (``bench/cp_comm_modes.py`` checks these against the meter): the
all-gather mode's (c - 1) x T x (C + R + Di) each way, plus the query and output all-to-alls
((c - 1) / c x T x N x (Dn + R) and x Dv, each way), the selection ((c - 1) x T x K int32) and
the KL's probabilities ((c - 1) x T x K fp32); dense: (c - 1) / c x T x N x (2 (Dn + R) + 2 Dv)
each way. MLA's latent is shared by every head, so at GLM-5's shapes gathering it always
sends fewer bytes than the per-head exchange (at least 1.6x fewer, in every level, for any
group that can split the heads): ``parallel.cp_comm=auto`` (``choose_exchange``) prices both
per group and keeps the all-gather there; head-parallel pays where a model's shared key is
wide against its heads.

``install`` (start-up, every rank) builds the exchange's process groups once and sets a
``HeadParallelCP`` on every ``DSACoreAttention`` of the model chunks (``cp_exchange``);
flexible CP groups bring theirs with each micro-batch (``glm5_train/flexible_batches.py``).
``DSACoreAttention._attend`` calls ``HeadParallelCP.attend`` when it is set and the sequence is
split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from glm5_train.model.dsa import DSACoreAttention, query_chunk, sparse_attention
from glm5_train.model.dsa_loss import dense_indexer_kl, selected_indexer_kl
from glm5_train.model.key_masks import DocumentStarts, key_mask
from glm5_train.model.layers import MLACoreAttention
from glm5_train.model.sparse_mla import absorbed_sparse_mla
from glm5_train.model.triton_sparse_mla import picks_from
from parallel.comm_purpose import collective_purpose
from parallel.config.context_parallel import CP_COMMS
from parallel.context_parallel import (
    ContextShard,
    gather_sequence,
    gather_sequence_no_grad,
    group_size,
    natural_order,
    zigzag_positions,
)
from parallel.hierarchical_all_to_all import (
    Exchange,
    build_exchange,
    heads_to_sequence,
    level_bytes,
    node_split,
    sequence_to_heads,
)


def install(chunks: list, cp_comm: str, node_size: int | None, cp_group) -> Exchange | None:
    """With ``cp_comm="head_parallel"`` and a split sequence: build the CP exchange (collective
    over every rank: call it on all of them, once, before training) and set it on every
    ``DSACoreAttention`` in ``chunks``. Returns the exchange (None: all-gather mode)."""
    if cp_comm not in CP_COMMS:
        raise ValueError(f"parallel.cp_comm={cp_comm!r}: use one of {list(CP_COMMS)}")
    if cp_comm != "head_parallel" or group_size(cp_group) == 1:
        return None
    exchange = build_exchange(cp_group, node_size)
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, DSACoreAttention):
                module.cp_exchange = HeadParallelCP(exchange)
    return exchange


@dataclass(frozen=True)
class HeadParallelCP:
    """The head-parallel path of one CP group (see the module docstring)."""

    exchange: Exchange

    def attend(self, module: DSACoreAttention, query, key, value, attention_mask, x, qr,
               with_loss: bool, record_kl: bool, shard: ContextShard) -> torch.Tensor:
        """``DSACoreAttention._attend`` under head-parallel CP: ``query`` [T, B, N, Dn + R],
        ``key`` MLA's latent [T, B, 1, C + R] (value None), ``x`` / ``qr`` the indexer's inputs
        of this rank's rows, ``attention_mask`` None or packed documents' starts [B, T];
        returns [T, B, N x Dv]."""
        _check_inputs(module, value, attention_mask)
        exchange = self.exchange
        if exchange.size != shard.size:
            raise RuntimeError(f"head-parallel exchange over {exchange.size} ranks, but the "
                               f"attention's CP group has {shard.size}: switch both together "
                               "(parallel.flexible_cp.switch_context_group)")
        allowed = key_mask(attention_mask)  # this rank's rows: DocumentStarts or None
        step = _Step(module, shard, _RowOrder(shard, query.device),
                     _my_heads(query.shape[2], shard), with_loss, record_kl, allowed)
        cfg = module.training_cfg
        if cfg.stage != "dense_warmup" and (cfg.attends_densely
                                            or module.indexer.topk >= shard.seq):
            # Dense attention, every parameter trained: queries, keys and values of this
            # rank's rows go to head shards in one all-to-all (no latent crosses).
            return self._back(step.dense_from_rows(query, key, exchange), step.rows)
        q_hp = step.rows.natural(sequence_to_heads(query, exchange))  # [S, B, N/c, Dq]
        latent = gather_sequence(key, shard)  # [S, B, 1, C + R], natural order
        if cfg.attends_densely or module.indexer.topk >= shard.seq:  # the dense warm-up
            out = self._back(step.dense(q_hp, *up_project(latent, *step.weights())), step.rows)
            if with_loss:
                out = step.warmup_kl(out, query, latent, x, qr, allowed)
            return out
        # The indexer on this rank's rows, as in the all-gather mode (detached inputs).
        x_in, qr_in = module._indexer_inputs(x.detach(), qr.detach())
        with torch.set_grad_enabled(torch.is_grad_enabled() and with_loss):
            keys = module.indexer.sequence_keys(x_in, shard)
        with torch.no_grad():
            topk_BTK, picked_BTK = module.indexer.select_blockwise(
                x_in, qr_in, allowed, shard=shard, keys=tuple(k.detach() for k in keys))
            picks_BTK = picks_from(topk_BTK, picked_BTK > float("-inf"))  # int32, -1: none
            del topk_BTK, picked_BTK
        # Every row's picks (natural order) for this rank's heads: one all-gather of int32.
        all_picks = gather_sequence_no_grad(picks_BTK, shard, dim=1)
        out_hp, probs_BSK = step.sparse(q_hp, latent, all_picks)
        out = self._back(out_hp, step.rows)
        if not with_loss:
            return out
        probs_BTK = sum_over_context_heads(probs_BSK, shard, step.rows)
        kl = selected_indexer_kl(module, x_in, qr_in, picks_BTK, probs_BTK, shard, keys)
        return module._attach(out, record_kl, kl)

    def _back(self, out_SBF: torch.Tensor, rows: _RowOrder) -> torch.Tensor:
        """[S, B, N / c x Dv] in natural order -> this rank's rows, every head [T, B, N x Dv]."""
        seq, batch = out_SBF.shape[:2]
        # One "head" of N / c x Dv values per rank: head group j comes from rank j.
        out_SB1F = rows.rank_major(out_SBF).view(seq, batch, 1, -1)
        out_TBcF = heads_to_sequence(out_SB1F, self.exchange)  # [T, B, c, N / c x Dv]
        return out_TBcF.reshape(seq // self.exchange.size, batch, -1)


@dataclass(frozen=True)
class _Step:
    """One layer application's attention on this rank's heads over the whole sequence."""

    module: DSACoreAttention
    shard: ContextShard
    rows: _RowOrder
    heads: slice  # this rank's heads among the N of its tensor-parallel rank
    with_loss: bool
    record_kl: bool
    allowed: DocumentStarts | None  # packed documents' starts of this rank's rows

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [N / c, Dn, C] and W_UV [N / c, Dv, C] of this rank's heads (views)."""
        w_uk, w_uv = self.module.latent_up_weights()
        return w_uk[self.heads], w_uv[self.heads]

    def dense(self, q_hp: torch.Tensor, k_hp: torch.Tensor, v_hp: torch.Tensor) -> torch.Tensor:
        """Causal attention of every row (natural order) for this rank's heads (within each
        packed document: every row's starts gathered here, the sparse path needs none, its
        picks hold the documents): the one-process dense path."""
        documents = _all_rows_documents(self.allowed, self.shard)
        if documents is not None:
            return self.module._dense_by_document(q_hp, k_hp, v_hp, documents)
        return MLACoreAttention.forward(self.module, q_hp, k_hp, v_hp, None)

    def dense_from_rows(self, query: torch.Tensor, latent: torch.Tensor,
                        exchange: Exchange) -> torch.Tensor:
        """Dense attention from this rank's rows: their latent up-projected for every head
        (as one process does), then query, key and value [T, B, N, Dq + Dq + Dv] to head
        shards in one all-to-all, [S, B, N / c, *] in natural order."""
        key, value = up_project(latent, *self.module.latent_up_weights())
        widths = [query.shape[-1], key.shape[-1], value.shape[-1]]
        qkv = torch.cat([query, key, value], dim=-1)
        q_hp, k_hp, v_hp = self.rows.natural(sequence_to_heads(qkv, exchange)).split(widths, -1)
        return self.dense(q_hp, k_hp, v_hp)

    def sparse(self, q_hp: torch.Tensor, latent: torch.Tensor,
               picks_BSK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of every row over its selected keys (int32 picks, -1: none) for this
        rank's heads: output [S, B, N / c x Dv] and the pick probabilities summed over these
        heads (with_loss)."""
        scale = self.module.softmax_scale
        training_cfg = self.module.training_cfg
        if training_cfg.sparse_attention == "absorbed":
            return absorbed_sparse_mla(q_hp, latent, *self.weights(), picks_BSK, scale,
                                       need_probs=self.with_loss,
                                       kernel=training_cfg.sparse_kernel)
        k_hp, v_hp = up_project(latent, *self.weights())  # masked_dense: the reference
        return sparse_attention(q_hp, k_hp, v_hp, picks_BSK.clamp_min(0).long(),
                                picks_BSK >= 0, scale, need_probs=self.with_loss)

    def warmup_kl(self, out: torch.Tensor, query: torch.Tensor, latent: torch.Tensor, x,
                  qr, allowed: DocumentStarts | None) -> torch.Tensor:
        """The dense warm-up's KL on this rank's rows (a row's target is every head's
        attention), every head's keys up-projected from the gathered latent (detached: the KL
        trains the indexer only), as ``DSACoreAttention._attend`` runs it."""
        module = self.module
        w_uk, _ = module.latent_up_weights()
        key, _ = up_project(latent.detach(), w_uk.detach())
        if module.kl_backward_in_forward:
            module._kl_backward_now(query, key, x, qr, allowed, self.shard)
            return out
        kl = dense_indexer_kl(module, query, key, x, qr, allowed, query_chunk, self.shard)
        return module._attach(out, self.record_kl, kl)


def _check_inputs(module: DSACoreAttention, value, attention_mask) -> None:
    if value is not None or module.latent_up_weights is None:
        raise NotImplementedError(
            "parallel.cp_comm=head_parallel needs MLA's latent key at the core attention "
            "(GLM5MLASelfAttention); up-projected keys and values run under "
            "parallel.cp_comm=all_gather")
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        raise NotImplementedError(
            "a bool attention mask under parallel.cp_comm=head_parallel is not supported: "
            "packed documents go as document starts (glm5_train.step.packed_documents), or "
            "use parallel.cp_comm=all_gather")


def _all_rows_documents(allowed, shard: ContextShard) -> DocumentStarts | None:
    """Packed documents' starts of every row of the sequence (natural order), from each
    rank's own rows: one all-gather of int64 [B, T] (None: one causal document)."""
    if allowed is None:
        return None
    return DocumentStarts(gather_sequence_no_grad(allowed.start_BT, shard, dim=1))


def _my_heads(heads: int, shard: ContextShard) -> slice:
    """The heads this rank attends for: head group = CP rank (``sequence_to_heads``)."""
    if heads % shard.size:
        raise ValueError(f"{heads} attention heads per tensor-parallel rank cannot be split "
                         f"over context_parallel_size={shard.size} ranks "
                         "(parallel.cp_comm=head_parallel)")
    per_rank = heads // shard.size
    return slice(shard.rank * per_rank, (shard.rank + 1) * per_rank)


class _RowOrder:
    """Rows of the whole sequence: rank-major (every rank's zigzag rows, rank 0's first: what
    the all-to-all delivers) <-> natural (global position order: what the gathered keys and
    the selection use)."""

    def __init__(self, shard: ContextShard, device: torch.device) -> None:
        self.to_natural = natural_order(shard.seq, shard.size, device)
        self.to_rank_major = torch.cat([zigzag_positions(shard.seq, shard.size, r, device)
                                        for r in range(shard.size)])

    def natural(self, rank_major: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return rank_major.index_select(dim, self.to_natural)

    def rank_major(self, natural: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return natural.index_select(dim, self.to_rank_major)


def up_project(latent: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor | None = None):
    """MLA's per-head keys [S, B, n, Dn + R] (k = W_UK c ‖ k_pe) and values [S, B, n, Dv]
    (W_UV c; None without ``w_uv``) of the gathered latent [S, B, 1, C + R] for the n heads of
    ``w_uk`` [n, Dn, C] / ``w_uv`` [n, Dv, C]."""
    c, k_pe = latent.squeeze(2).split([w_uk.shape[-1], latent.shape[-1] - w_uk.shape[-1]],
                                      dim=-1)
    k_nope = torch.einsum("sbc,ndc->sbnd", c, w_uk)
    key = torch.cat([k_nope, k_pe[:, :, None].expand(-1, -1, w_uk.shape[0], -1)], dim=-1)
    value = None if w_uv is None else torch.einsum("sbc,nvc->sbnv", c, w_uv)
    return key, value


@collective_purpose("head_sum")
def sum_over_context_heads(probs_BSK: torch.Tensor, shard: ContextShard,
                           rows: _RowOrder) -> torch.Tensor:
    """This rank's rows [B, T, K] of the pick probabilities summed over every CP rank's heads,
    from each rank's head sum for all rows [B, S, K] (natural order): one reduce-scatter."""
    batch, seq, picks = probs_BSK.shape
    send_SBK = rows.rank_major(probs_BSK, dim=1).transpose(0, 1).contiguous()
    out_TBK = send_SBK.new_empty(seq // shard.size, batch, picks)
    dist.reduce_scatter_tensor(out_TBK, send_SBK, group=shard.group)
    return out_TBK.transpose(0, 1)


# ------------------------------------------------------------------ bytes per layer (formula)


@dataclass(frozen=True)
class AttentionShape:
    """Per-token widths of what crosses context-parallel ranks in one DSA + MLA layer."""

    heads: int  # N: attention heads of one tensor-parallel rank
    query: int  # Dn + R: a head's query, as the all-to-all moves it (before absorption)
    value: int  # Dv: a head's output (after the up-projection)
    latent: int  # C + R: MLA's latent key, shared by all heads
    index_key: int  # Di: the indexer's key, shared by its heads
    topk: int  # K: keys each query selects

    @classmethod
    def of(cls, model, tp: int = 1) -> AttentionShape:
        """From a ``GLM5Config`` (HF names)."""
        return cls(model.num_attention_heads // tp,
                   model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim,
                   model.kv_lora_rank + model.qk_rope_head_dim, model.index_head_dim,
                   model.index_topk)


@dataclass(frozen=True)
class Transfer:
    """One collective a CP rank calls per layer application: ``payload`` bytes handed to it
    (``parallel/comm_meter.py``'s payload: all_gather's local input, the whole input of
    all_to_all and reduce_scatter); ``level_bytes`` turns it into bytes sent per level."""

    what: str
    op: str
    payload: int


def layer_transfers(shape: AttentionShape, seq: int, cp: int, mode: str,
                    stage: str = "sparse", trains_indexer: bool = True, act_bytes: int = 2,
                    batch: int = 1, documents: bool = False) -> list[Transfer]:
    """The collectives on the CP group (c = ``cp`` ranks, T = seq / c rows each) of one DSA
    layer application in training, forward and backward, for ``batch`` sequences of ``seq``
    tokens: ``mode`` "all_gather" (``DSACoreAttention._attend``) or "head_parallel" (this
    module). ``stage``: "sparse" (trained end to end; selects top-k when K < seq),
    "dense_warmup" (the model frozen but the indexer: nothing of the main attention has a
    backward) or "dense" (trained end to end, no indexer: as "sparse" with K >= seq).
    ``act_bytes``: bytes per activation value (bf16 2, fp32 4); the selection is int32 and the
    pick probabilities fp32. ``documents``: packed documents, whose starts (int64) the
    head-parallel mode's dense attention gathers for every row."""
    rows = seq // cp * batch
    trained = stage != "dense_warmup"
    selects = stage == "sparse" and shape.topk < seq
    if mode == "head_parallel" and trained and not selects:
        return _dense_head_parallel(shape, rows, act_bytes, documents)
    latent = rows * shape.latent * act_bytes
    out = [Transfer("latent key", "all_gather", latent)]
    if trained:
        out.append(Transfer("latent key gradient", "reduce_scatter", cp * latent))
    index_key = rows * shape.index_key * act_bytes
    kl = trains_indexer and (selects or stage == "dense_warmup")
    if selects or stage == "dense_warmup":
        out.append(Transfer("indexer key", "all_gather", index_key))
    if kl:
        out.append(Transfer("indexer key gradient", "reduce_scatter", cp * index_key))
    if mode != "head_parallel":
        return out
    if documents and not selects:  # the warm-up's dense attention over every row
        out.append(Transfer("document starts (int64)", "all_gather", rows * 8))
    query = rows * shape.heads * shape.query * act_bytes
    value = rows * shape.heads * shape.value * act_bytes
    out += [Transfer("query to head shards", "all_to_all", query),
            Transfer("output to sequence shards", "all_to_all", value)]
    if trained:
        out += [Transfer("output gradient to head shards", "all_to_all", value),
                Transfer("query gradient to sequence shards", "all_to_all", query)]
    if selects:
        out.append(Transfer("selection (int32)", "all_gather", rows * shape.topk * 4))
        if trains_indexer:
            out.append(Transfer("pick probabilities (fp32)", "reduce_scatter",
                                cp * rows * shape.topk * 4))
    return out


def _dense_head_parallel(shape: AttentionShape, rows: int, act_bytes: int,
                         documents: bool) -> list[Transfer]:
    """Head-parallel dense attention, trained (``_Step.dense_from_rows``): each rank's rows'
    query, key and value cross in one all-to-all and the output comes back; nothing is
    gathered but the document starts."""
    qkv = rows * shape.heads * (2 * shape.query + shape.value) * act_bytes
    value = rows * shape.heads * shape.value * act_bytes
    out = [Transfer("document starts (int64)", "all_gather", rows * 8)] if documents else []
    return out + [Transfer("query, key and value to head shards", "all_to_all", qkv),
                  Transfer("output to sequence shards", "all_to_all", value),
                  Transfer("output gradient to head shards", "all_to_all", value),
                  Transfer("query, key and value gradients to sequence shards", "all_to_all",
                           qkv)]


def meter_bytes(transfers: list[Transfer], cp: int, node_size: int | None) -> dict[str, int]:
    """What ``parallel/comm_meter.py`` counts for one rank for ``transfers`` ({"<op>:<group
    size>": bytes}): all-gathers and reduce-scatters on the CP group; the all-to-alls on it too,
    or on the node (``node_size`` ranks of it per node) and local-index groups when the
    exchange has two levels (``parallel/hierarchical_all_to_all.build_exchange``)."""
    per_node = node_size or cp
    counted: dict[str, int] = {}

    def add(key: str, value: float) -> None:
        counted[key] = counted.get(key, 0) + round(value)

    for t in transfers:
        two, levels = transfer_levels(t, cp, per_node)
        if two:
            add(f"all_to_all:{per_node}", levels["intra"])
            add(f"all_to_all:{cp // per_node}", levels["inter"])
        else:
            add(f"{t.op}:{cp}", levels["intra"] + levels["inter"])
    return counted


def transfer_levels(t: Transfer, cp: int, per_node: int) -> tuple[bool, dict[str, float]]:
    """Whether ``t`` runs in two levels (an all-to-all over a group spanning several nodes
    with several of its ranks on each: ``build_exchange``) and its bytes per level."""
    two = t.op == "all_to_all" and per_node not in (1, cp)
    return two, level_bytes(t.op, t.payload, cp, per_node, two)


# ------------------------------------------------ choosing the exchange of a group (auto)


@dataclass(frozen=True)
class Links:
    """What one rank's links carry, in bytes per second: inside its node (NVLink) and to
    other nodes (its NIC)."""

    intra: float
    inter: float

    @classmethod
    def of(cls, par) -> Links:
        """From ``parallel.cp_intra_node_gbs`` / ``cp_inter_node_gbs`` (GB/s)."""
        return cls(par.cp_intra_node_gbs * 1e9, par.cp_inter_node_gbs * 1e9)


@dataclass(frozen=True)
class ExchangeCost:
    """One layer application's CP traffic of one rank in one mode: bytes sent per level and
    the time they take at the links' rates (the levels one after the other: an upper
    bound where they overlap)."""

    mode: str
    intra: int
    inter: int
    seconds: float


@dataclass(frozen=True)
class AttentionWork:
    """What a group's exchange moves per token: the attention's shape and training."""

    shape: AttentionShape
    stage: str
    trains_indexer: bool
    act_bytes: int
    documents: bool


def exchange_cost(work: AttentionWork, mode: str, seq: int, ranks: list[int],
                  node_size: int | None, links: Links) -> ExchangeCost:
    """Bytes per level and seconds of one layer application of ``mode`` on the CP group of
    global ``ranks`` (by group rank) holding a sequence of ``seq`` tokens, on nodes of
    ``node_size`` consecutive ranks (None: one node); head-parallel's all-to-all runs in two
    levels where the group spans several nodes with several ranks on each
    (``build_exchange``)."""
    cp = len(ranks)
    per_node = len(node_split(ranks, node_size)[0][0]) if node_size else cp
    transfers = layer_transfers(work.shape, seq, cp, mode, work.stage, work.trains_indexer,
                                work.act_bytes, documents=work.documents)
    intra = inter = 0.0
    for t in transfers:
        levels = transfer_levels(t, cp, per_node)[1]
        intra, inter = intra + levels["intra"], inter + levels["inter"]
    return ExchangeCost(mode, round(intra), round(inter), intra / links.intra + inter / links.inter)


def choose_exchange(work: AttentionWork, seq: int, ranks: list[int], node_size: int | None,
                    links: Links) -> tuple[str, dict[str, ExchangeCost]]:
    """``parallel.cp_comm=auto`` for one group: the mode whose bytes per level take less time
    at the links' rates (all-gather on a tie, and where the group cannot split the heads),
    and both modes' costs."""
    costs = {"all_gather": exchange_cost(work, "all_gather", seq, ranks, node_size, links)}
    if work.shape.heads % len(ranks) == 0:
        costs["head_parallel"] = exchange_cost(work, "head_parallel", seq, ranks, node_size,
                                               links)
    best = min(costs.values(), key=lambda c: (c.seconds, c.mode != "all_gather"))
    return best.mode, costs


def attention_work(job, documents: bool | None = None) -> AttentionWork:
    """What the job's CP exchange moves per token (``documents`` None: packed documents when
    the data packs them: chat SFT, or ``data.reset_attention_mask``)."""
    if documents is None:
        documents = job.data.format == "chat_sft" or job.data.reset_attention_mask
    return AttentionWork(AttentionShape.of(job.model, job.parallel.tensor_model_parallel_size),
                         job.dsa.stage, job.dsa.trains_indexer,
                         torch.finfo(job.train.torch_dtype).bits // 8, documents)


def costs_text(costs: dict[str, ExchangeCost]) -> str:
    """Each mode's modelled MB per layer application, inside / across nodes."""
    return ", ".join(f"{c.mode} {c.intra / 1e6:.3g}/{c.inter / 1e6:.3g} MB"
                     for c in costs.values())


def job_cp_choice(job) -> tuple[str, dict[str, ExchangeCost]]:
    """``parallel.cp_comm=auto`` for the job's fixed CP groups: one choice for the whole job,
    made on its first CP group (global ranks 0, TP, 2 TP, ...: megatron-core's order), so every
    rank takes the same one (a per-group choice could split the ranks between the exchange's
    collective set-up and none; the layout check makes every group fill its nodes alike)."""
    par = job.parallel
    tp, cp = par.tensor_model_parallel_size, par.context_parallel_size
    return choose_exchange(attention_work(job), job.train.seq_length,
                           [tp * j for j in range(cp)], par.cp_node_size, Links.of(par))


def fixed_cp_comm(job, cp_group) -> str:
    """The exchange of the job's fixed CP groups: ``parallel.cp_comm``, or auto's choice
    (``job_cp_choice``; rank 0 prints it)."""
    par = job.parallel
    if par.cp_comm != "auto":
        return par.cp_comm
    if group_size(cp_group) == 1:
        return "all_gather"
    mode, costs = job_cp_choice(job)
    if dist.get_rank() == 0:
        print(f"context parallel: parallel.cp_comm=auto chose {mode} for the CP group of "
              f"{group_size(cp_group)} (per layer, inside/across nodes: {costs_text(costs)})",
              flush=True)
    return mode
