"""Expert load: the tokens each MoE layer's router sent to each expert in a step, summed over
every rank, and the expert biases that balance them (docs/expert_load.md).

``ExpertLoad(chunks, group)`` puts a forward hook on every MoE router of this rank's model
chunks. The hook adds the router's ``routing_map`` (``[tokens, experts]`` bool, the top-k
choices after any token dropping) summed over tokens to an int64 counter per layer, under the
rule megatron-core's own count follows (``TopKRouter._apply_expert_bias``): only in training
mode with autograd on, so a forward without gradients (evaluation, RL's pi_old pass) and the
no-grad first pass of a recomputed layer are not counted, the recompute is, once. It does not
read megatron-core's ``local_tokens_per_expert``: that float32 buffer exists only with the expert
bias on and is zeroed inside ``finalize_model_grads``; the hook counts the same tokens either
way and changes nothing the step computes (it reads the router's output).

``gather()`` is one all-reduce over ``group`` (the whole job: layers live on different pipeline
stages, and each token is routed on exactly one rank of its stage, its sequence shard under TP +
SP or CP, its micro-batch under DP, whatever EP) of one float64 row per MoE layer of the model:
the counts (integers, exact below 2**53), the expert bias, and how many ranks hold the layer
(every rank of a stage holds the same bias; the sum over n holders divided by n is that float32
value exactly, logged as the shortest decimal that reads back as it). It returns metrics.jsonl's
fields, the same on every rank (``load_fields``). A layer the step did not route through (none
in training) logs zeros.

Layers are named by global number as in the checkpoints' and Hugging Face's tensor names,
``layer_<i>`` (0-based: GLM-5's first MoE layer is ``layer_3``), and the MTP layers
``mtp_<k>``; the same names in every layout. An MTP layer run for several prediction steps
(sharing its parameters) counts the tokens of all of them, as its bias update does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import Router
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

from parallel.comm_purpose import collective_purpose
from parallel.device import comm_device


class ExpertLoad:
    """Tokens per expert of every MoE layer in a step, counted on this rank by router hooks
    and summed over ``group`` (None: the default group, which must be every rank of the job)
    by ``gather``. ``begin_step`` starts a step's count; ``close`` removes the hooks."""

    @collective_purpose("expert_load_setup")
    def __init__(self, chunks: list, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.routers = local_routers(chunks)
        self.counts: dict[str, torch.Tensor] = {}
        self.handles = [router.register_forward_hook(self._hook(name), with_kwargs=True)
                        for name, router in self.routers.items()]
        # The model's MoE layers, their expert count and whether they have an expert bias, on
        # every rank (each rank holds its own stages' layers, rank 0 possibly none): one
        # gather, once per run.
        mine = (sorted(self.routers), {r.config.num_moe_experts for r in self.routers.values()},
                any(r.expert_bias is not None for r in self.routers.values()))
        held: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(held, mine, group=group)
        self.names = sorted({name for names, _, _ in held for name in names}, key=layer_order)
        experts = set().union(*(e for _, e, _ in held))
        if len(experts) > 1:
            raise ValueError(f"expert load: MoE layers with different expert counts {experts}")
        self.num_experts = experts.pop() if experts else 0
        self.with_bias = any(bias for _, _, bias in held)

    def _hook(self, name: str):
        def count(router: Router, args: tuple, kwargs: dict, output) -> None:
            if not (router.training and torch.is_grad_enabled()):
                return
            routing_map = output[1]
            padding_mask = args[1] if len(args) > 1 else kwargs.get("padding_mask")
            with torch.no_grad():
                if padding_mask is not None:  # as _apply_expert_bias leaves padding out
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                tokens = routing_map.sum(dim=0, dtype=torch.int64)
                if name in self.counts:
                    self.counts[name] += tokens
                else:
                    self.counts[name] = tokens
        return count

    def begin_step(self) -> None:
        self.counts = {}

    @collective_purpose("expert_load")
    def gather(self) -> dict[str, Any]:
        """The step's fields for metrics.jsonl, on every rank (one all-reduce)."""
        if not self.names:
            return {}
        experts = self.num_experts
        rows = torch.zeros(len(self.names), 2 * experts + 1, dtype=torch.float64,
                           device=comm_device())
        for name, router in self.routers.items():
            row = rows[self.names.index(name)]
            if name in self.counts:
                row[:experts] = self.counts[name].to(rows.device, torch.float64)
            if router.expert_bias is not None:
                row[experts:2 * experts] = router.expert_bias.detach().to(rows.device,
                                                                          torch.float64)
            row[2 * experts] = 1.0
        dist.all_reduce(rows, group=self.group)
        rows = rows.cpu()
        counts = {name: [int(v) for v in rows[i, :experts].tolist()]
                  for i, name in enumerate(self.names)}
        biases = None
        if self.with_bias:  # every layer has one when any has (one model config)
            biases = {name: shortest_float32(rows[i, experts:2 * experts] / rows[i, 2 * experts])
                      for i, name in enumerate(self.names)}
        return load_fields(counts, biases)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def shortest_float32(values: torch.Tensor) -> list[float]:
    """float32 ``values`` as the shortest decimals that read back as the same float32 (0.001,
    not 0.0010000000474974513): half the bytes in metrics.jsonl, every bit kept."""
    return [float(str(v)) for v in values.to(torch.float32).numpy()]


def local_routers(chunks: list) -> dict[str, Router]:
    """This rank's MoE routers by layer name (``layer_<i>``, ``mtp_<k>``, global numbers)."""
    found: dict[str, Router] = {}
    for chunk in chunks:
        in_mtp = {}
        for module in chunk.modules():
            if isinstance(module, MultiTokenPredictionLayer):
                for inner in module.modules():
                    in_mtp[id(inner)] = module.layer_number - 1
        for module in chunk.modules():
            if not isinstance(module, Router):
                continue
            name = (f"mtp_{in_mtp[id(module)]}" if id(module) in in_mtp
                    else f"layer_{module.layer_number - 1}")
            if name in found:
                raise ValueError(f"expert load: two routers named {name}")
            found[name] = module
    return found


def layer_order(name: str) -> tuple[int, int]:
    """Decoder layers by number, then the MTP layers by number."""
    kind, number = name.rsplit("_", 1)
    return (kind == "mtp", int(number))


def load_summary(counts: list[int]) -> tuple[float | None, float | None]:
    """(max / mean, coefficient of variation = population std / mean) of one layer's tokens per
    expert; (None, None) when it received no token."""
    total = sum(counts)
    if total == 0:
        return None, None
    mean = total / len(counts)
    variance = sum((c - mean) ** 2 for c in counts) / len(counts)
    return max(counts) / mean, math.sqrt(variance) / mean


def load_fields(counts: dict[str, list[int]],
                biases: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """metrics.jsonl's expert-load fields from the summed counts (and the biases, when the
    router has them): per layer ``expert_load`` (the counts), ``expert_load_max_over_mean``,
    ``expert_load_cv``, ``expert_bias``; over layers ``expert_load_worst_max_over_mean`` and
    ``expert_load_worst_cv`` (their largest) and ``expert_load_worst_layer`` (the layer with the
    largest max / mean)."""
    summaries = {name: load_summary(c) for name, c in counts.items()}
    ratio = {name: s[0] for name, s in summaries.items()}
    cv = {name: s[1] for name, s in summaries.items()}
    fields: dict[str, Any] = {"expert_load": counts, "expert_load_max_over_mean": ratio,
                              "expert_load_cv": cv}
    if biases is not None:
        fields["expert_bias"] = biases
    measured = [name for name in counts if ratio[name] is not None]
    if measured:
        worst = max(measured, key=lambda name: ratio[name])
        fields.update(expert_load_worst_max_over_mean=ratio[worst],
                      expert_load_worst_cv=max(cv[name] for name in measured),
                      expert_load_worst_layer=worst)
    return fields
