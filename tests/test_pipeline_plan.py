"""Tests for the planner (glm5_train/plan/) and tools/plan_pipeline.py.

Layout rules (each violation a LayoutError naming the value and the rule), placement detection,
the balancer on the tiny and the 744B model, the schedule replay against megatron-core's own
warm-up formula and schedule table, parameter bytes against glm5_train/plan/param_count.py's
formula, the activation estimate against a measured forward of the tiny model, and the CLI.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
import types
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from glm5_train import plan
from glm5_train.plan import activations, context_parallel_comm, param_count, stage_model
from glm5_train.model.config import GLM5Config
from parallel.layout import LayoutError
from glm5_train.job_config import compose_model_config
from parallel.activation_accounting import SavedTensorMeter
from parallel.process_groups import single_process_group
from parallel.recompute import Recompute

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "plan_pipeline.py")
SUMMARY = re.compile(r"^placement=(\S+) layout=(\S+) max_rank_bytes=(\d+) min_rank_bytes=(\d+) "
                     r"spread_bytes=(\d+)$", re.MULTILINE)

# The 744B example of tools/plan_pipeline.py's docstring: TP2+SP, EP32, DP32, 4K tokens.
BIG_INPUTS = plan.MemoryInputs(tp=2, ep=32, dp=32, sequence_parallel=True, seq_length=4096,
                               num_microbatches=64, distributed_optimizer=True)
TINY_INPUTS = plan.MemoryInputs(seq_length=128, num_microbatches=8, weight_bytes=4,
                                optimizer_bytes=8, activation_bytes=4)


@pytest.fixture(scope="module")
def tiny() -> GLM5Config:
    return compose_model_config(["model=glm5_tiny"])


@pytest.fixture(scope="module")
def big() -> GLM5Config:
    return compose_model_config(["model=glm5_744b"])


# ------------------------------------------------------------------------------------ parsing

BAD_LAYOUTS = [  # (layout, pp, vpp, mtp sets, words the message must hold)
    ("Et|t|tm|L", 2, 1, 1, ["4 stages", "2 x 1 = 2"]),
    ("tE|t|t|tmL", 2, 2, 1, ["1 'E'", "first in stage 0"]),
    ("Et|t|Et|tmL", 2, 2, 1, ["2 'E'", "exactly once"]),
    ("Et|t|t|tLm", 2, 2, 1, ["'L'", "last in the last stage"]),
    ("Et|t|tm|L", 2, 2, 1, ["3 't'", "model.num_hidden_layers=4"]),
    ("Et|t|t|tL", 2, 2, 1, ["0 'm'", "1 MTP layer"]),
    ("Et|tm|t|tmL", 2, 2, 2, ["stages [1, 3]", "one stage"]),
    ("Et|t|tmt|L", 2, 2, 1, ["'t' after an 'm'"]),
    ("Ettttm|||L", 2, 2, 1, ["virtual stage 0", "last virtual stage"]),
    ("Et|tx|t|tmL", 2, 2, 1, ["unknown character"]),
]


@pytest.mark.parametrize("layout,pp,vpp,sets,words", BAD_LAYOUTS)
def test_each_rule_raises_a_layout_error_naming_value_and_rule(layout, pp, vpp, sets, words):
    with pytest.raises(LayoutError) as err:
        plan.parse_layout(layout, pp, vpp, 4, sets)
    message = str(err.value)
    assert f"parallel.pipeline_model_parallel_layout={layout!r}" in message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("layout,pp,vpp,sets,placement", [
    ("Et|t|t|tmL", 2, 2, 1, "with_loss"),
    ("Ett|t|tm|L", 2, 2, 1, "split"),
    ("Et|t|t|tL", 2, 2, 0, "none"),
    ("Ett|ttm||L", 4, None, 1, "custom"),
    ("Et|(t|)*2tmL", 2, 2, 1, "with_loss"),
])
def test_placement_is_detected(layout, pp, vpp, sets, placement):
    parsed = plan.parse_layout(layout, pp, vpp, 4, sets)
    assert parsed.placement == placement
    assert plan.parse_layout(parsed.to_string(), pp, vpp, 4, sets) == parsed  # canonical


# ----------------------------------------------------------------------------------- balancer


def _check_balanced(cfg: GLM5Config, layout: plan.PipelineLayout, placement: str) -> None:
    again = plan.parse_layout(layout.to_string(), layout.pp, layout.vpp, cfg.num_hidden_layers,
                              plan.mtp_sets(cfg))
    assert again.placement == placement, layout.to_string()
    assert sum(layout.layers_per_stage) == cfg.num_hidden_layers


@pytest.mark.parametrize("placement", ["with_loss", "split"])
def test_balancer_gives_valid_layouts_for_the_tiny_model(tiny, placement):
    layout = plan.balance_layout(tiny, 2, 2, placement, TINY_INPUTS)
    _check_balanced(tiny, layout, placement)
    assert layout.to_string().count("m") == 1


@pytest.mark.parametrize("placement", ["with_loss", "split"])
def test_balancer_gives_valid_layouts_for_744b_at_pp8_vpp2(big, placement):
    start = time.perf_counter()
    layout = plan.balance_layout(big, 8, 2, placement, BIG_INPUTS)
    assert time.perf_counter() - start < 5
    _check_balanced(big, layout, placement)
    assert layout.to_string().count("t") == 78 and layout.to_string().count("m") == 1
    # At least as good as the even split.
    best = plan.plan_report(big, layout, BIG_INPUTS).max_rank_bytes
    open_stages = 16 if placement == "with_loss" else 15
    counts = [78 // open_stages + (s < 78 % open_stages) for s in range(open_stages)]
    even = plan.layout_from_counts(counts + [0] * (16 - open_stages), 8, 2, layout.mtp_stage, 1)
    assert best <= plan.plan_report(big, even, BIG_INPUTS).max_rank_bytes


def test_balancer_respects_a_memory_limit_and_mtp_off(big):
    inputs = dataclasses.replace(BIG_INPUTS, dsa_kl=False)
    limit = 130 * 2**30
    layout = plan.balance_layout(big, 8, 2, "with_loss", inputs, memory_limit_bytes=limit)
    report = plan.plan_report(big, layout, inputs)
    assert report.max_rank_bytes <= limit
    slowest = max(s.costs.flops_per_microbatch for s in report.stages)
    free = plan.plan_report(big, plan.balance_layout(big, 8, 2, "with_loss", inputs), inputs)
    assert slowest < max(s.costs.flops_per_microbatch for s in free.stages)
    off = dataclasses.replace(big, mtp_num_steps=0) if hasattr(big, "mtp_num_steps") else \
        dataclasses.replace(big, num_nextn_predict_layers=0)
    layout = plan.balance_layout(off, 8, 2, "split", inputs)
    assert layout.placement == "none" and "m" not in layout.to_string()


def test_balancer_is_fast_at_pp16_vpp4(big):
    start = time.perf_counter()
    layout = plan.balance_layout(big, 16, 4, "with_loss", BIG_INPUTS)
    assert time.perf_counter() - start < 5  # about 0.3 s measured; generous for slow CI
    _check_balanced(big, layout, "with_loss")


# ----------------------------------------------------------------------------------- schedule


def _megatron_warmup(pp: int, vpp: int | None, rank: int, microbatches: int,
                     group: int | None = None) -> int:
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    pp_group = types.SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    comm = types.SimpleNamespace(pp_group=pp_group, virtual_pipeline_model_parallel_size=vpp)
    return get_pp_rank_microbatches(microbatches, vpp or 1, group or pp,
                                    p2p_communicator=comm)[2]


@pytest.mark.parametrize("pp,vpp,microbatches,group", [
    (2, None, 4, None), (4, None, 8, None), (4, None, 2, None), (2, 2, 4, None),
    (4, 2, 8, None), (4, 2, 6, None), (8, 2, 64, None), (4, 4, 4, None), (16, 4, 64, None),
    (3, 2, 7, None), (2, 2, 8, 4), (2, 8, 8, 8), (4, 2, 12, 6), (2, 4, 10, 4)])
def test_uniform_peak_is_megatron_warmup_plus_one(pp, vpp, microbatches, group):
    """Also with megatron-core's microbatch_group_size_per_vp_stage (``group``)."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    schedule = plan.PipelineSchedule(pp, vpp, microbatches, group)
    total = microbatches * (vpp or 1)
    if vpp:
        table = get_schedule_table(microbatches, vpp, group or pp)
        assert schedule.chunk_table() == [chunk for _, chunk in table]
    for rank in range(pp):
        warmup = _megatron_warmup(pp, vpp, rank, microbatches, group)
        assert schedule.warmup(rank) == warmup
        assert schedule.peak_in_flight(rank) == min(warmup + 1, total)
        order = schedule.order(rank)
        assert [op for op, _ in order].count("F") == total == len(order) // 2


# ------------------------------------------------------------------------------- param bytes


def test_parameter_bytes_sum_to_the_count_params_formula(tiny, big):
    for cfg in (tiny, big):
        sets = plan.mtp_sets(cfg)
        mtp = stage_model.mtp_layer_params(cfg)
        assert sets * mtp == param_count.mtp_params(cfg) - sets * \
            param_count.expert_bias_params(cfg)  # HF's count holds the bias buffer
        total = param_count.formula_totals(cfg).total + sets * mtp
        inputs = plan.MemoryInputs(weight_bytes=2)
        one = plan.parse_layout(f"Et*{cfg.num_hidden_layers}mL", 1, None,
                                cfg.num_hidden_layers, sets)
        stages = plan.plan_report(cfg, one, inputs).stages
        assert sum(s.costs.param_bytes for s in stages) == 2 * total
        # Split over stages, the MTP stage (not stage 0) re-embeds: one embedding copy more.
        embedding = cfg.vocab_size * cfg.hidden_size
        for placement in ("with_loss", "split"):
            layout = plan.balance_layout(cfg, 2, 2, placement, inputs)
            stages = plan.plan_report(cfg, layout, inputs).stages
            assert sum(s.costs.param_bytes for s in stages) == 2 * (total + embedding)


def test_sharding_divides_by_tp_ep_and_data_parallel(big):
    layout = plan.parse_layout("Et*78mL", 1, None, 78, 1)
    whole = plan.plan_report(big, layout, plan.MemoryInputs()).stages[0].costs
    inputs = plan.MemoryInputs(tp=2, ep=8, dp=8)
    split = plan.plan_report(big, layout, inputs).stages[0].costs
    assert whole.param_bytes / 16 < split.param_bytes < whole.param_bytes / 2
    assert split.grad_bytes == 2 * split.param_bytes  # fp32 grads stay whole (ZeRO-1)
    assert split.optimizer_bytes == 6 * split.param_bytes  # 12 bytes a parameter, unsharded
    inputs = dataclasses.replace(inputs, distributed_optimizer=True)
    sharded = plan.plan_report(big, layout, inputs).stages[0].costs
    # Dense state over DP = 8, expert state over expert-DP = TP x DP / EP = 2.
    assert sharded.optimizer_bytes <= split.optimizer_bytes // 2


# -------------------------------------------------------------------------- activation bytes


def _measured_forward_bytes(cfg: GLM5Config, seq: int, batch: int,
                            attention_mask: torch.Tensor | None = None,
                            loss_chunk_tokens: int = 0, recompute: Recompute | None = None,
                            dsa_stage: str = "sparse", peak: bool = False) -> int:
    """Unique storage bytes autograd saves in one fp32 forward of the 1-process model, the
    parameters left out, as they stand after the forward (selective recompute frees some saved
    outputs at once). ``attention_mask``: [batch, 1, seq, seq], True = masked out.
    ``loss_chunk_tokens``: the model's chunked head + loss (0: megatron's). ``dsa_stage``:
    dense_warmup freezes all but the indexer, as the job does. ``peak``: instead, the most
    bytes saved at once during the forward and the output's backward, by the job's meter
    (parallel.activation_accounting.SavedTensorMeter)."""
    from glm5_train.model.config import to_mcore_config
    from parallel.layout import ParallelSizes
    from glm5_train.model.dsa_loss import DSATrainingConfig
    from glm5_train.model.glm5 import apply_dsa_freezing, build_model_chunks
    from parallel import mcore_compat

    mcore_compat.install()
    with single_process_group():
        mcore = to_mcore_config(cfg, ParallelSizes(), torch.float32, recompute=recompute)
        dsa = DSATrainingConfig(stage=dsa_stage)
        chunks = build_model_chunks(cfg, mcore, loss_chunk_tokens=loss_chunk_tokens,
                                    recompute=recompute, dsa_training=dsa)
        apply_dsa_freezing(chunks, dsa)
        model = chunks[0].train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, torch.UntypedStorage] = {}  # by storage identity: a freed storage's
        # address may be reused by a later one

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved.setdefault(storage._cdata, storage)
            return t

        tokens = torch.randint(0, 258, (batch, seq), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(seq)[None].expand(batch, seq)
        if peak:
            meter = SavedTensorMeter()
            meter.exclude(model.parameters())
            meter.begin_step()
            with meter.hooks():
                model(tokens, positions, attention_mask, labels=tokens).sum().backward()
            return meter.end_step().peak_bytes
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens, positions, attention_mask, labels=tokens)
    return sum(storage.nbytes() for storage in saved.values())


def _estimated_forward_bytes(cfg: GLM5Config, inputs: plan.MemoryInputs) -> int:
    """The planner's terms for what _measured_forward_bytes measures: embedding ids, the
    decoder layers, final norm, the MTP steps, and a head + loss per prediction."""
    steps = cfg.mtp_num_steps
    layer = {moe: stage_model.layer_part(cfg, moe, inputs) for moe in (False, True)}
    layers = stage_model.chunk_layers_part(cfg, layer, [bool(m) for m in cfg.moe_layer_pattern],
                                      inputs, input_counted=False).activation_bytes
    return (8 * inputs.tokens + layers
            + activations.rms_norm_bytes(inputs.tokens, cfg.hidden_size, inputs)  # final norm
            + steps * activations.mtp_step_activation_bytes(cfg, inputs)
            + (1 + steps) * activations.loss_head_activation_bytes(cfg, inputs))


def _document_mask(batch: int, seq: int) -> torch.Tensor:
    """Packed documents as data.reset_attention_mask hands them to the model: each token's
    document start, int64 [batch, seq] (``key_masks.DocumentStarts``; no [s, s] mask)."""
    doc_BS = torch.randint(0, 3, (batch, seq), generator=torch.Generator().manual_seed(1))
    doc_BS = doc_BS.sort(-1).values
    first = torch.searchsorted(doc_BS, doc_BS)  # each row's first token of the same document
    return first.long()


@pytest.mark.parametrize("mtp_steps, loss_chunk_tokens", [(0, 0), (3, 0), (3, 100)])
def test_activation_estimate_matches_a_measured_forward(tiny, mtp_steps, loss_chunk_tokens):
    """The whole tiny model on CPU in fp32: embedding ids, 4 decoder layers (DSA sparse with the
    indexer KL: 128 tokens > index_topk 32), final norm, the MTP steps, and a head + loss per
    prediction (megatron's, or chunked: 256 tokens in 3 chunks). CPU runs SDPA's math path,
    hence fused_attention=False. Tolerance 5% (measured: within 0.1%)."""
    if not hasattr(tiny, "mtp_num_steps"):
        pytest.skip("this model config has no model.mtp_num_steps")
    cfg = dataclasses.replace(tiny, mtp_num_steps=mtp_steps)
    seq, batch = 128, 2
    inputs = plan.MemoryInputs(seq_length=seq, micro_batch_size=batch, activation_bytes=4,
                               fused_attention=False, loss_chunk_tokens=loss_chunk_tokens)
    estimate = _estimated_forward_bytes(cfg, inputs)
    measured = _measured_forward_bytes(cfg, seq, batch, loss_chunk_tokens=loss_chunk_tokens)
    print(f"tiny forward activations, {mtp_steps} MTP steps, loss chunk {loss_chunk_tokens}: "
          f"estimate {estimate} B, measured {measured} B")
    assert abs(estimate - measured) <= 0.05 * measured


@pytest.mark.parametrize("document_mask", [False, True])
def test_dense_attention_estimate_matches_a_measured_forward(tiny, document_mask):
    """index_topk >= seq: every layer (MTP's included) runs dense attention, q/k/v padded to
    one width on SDPA's flash kernel (layers.equal_width_attention); packed documents run
    document by document (``DSACoreAttention._dense_by_document``) and keep no mask: the same
    bytes as without documents."""
    seq, batch = 128, 2
    cfg = dataclasses.replace(tiny, index_topk=seq)
    inputs = plan.MemoryInputs(seq_length=seq, micro_batch_size=batch, activation_bytes=4,
                               document_mask=document_mask)
    estimate = _estimated_forward_bytes(cfg, inputs)
    mask = _document_mask(batch, seq) if document_mask else None
    measured = _measured_forward_bytes(cfg, seq, batch, mask)
    print(f"tiny dense forward activations, document mask {document_mask}: estimate "
          f"{estimate} B, measured {measured} B")
    assert abs(estimate - measured) <= 0.01 * measured
    layers = cfg.num_hidden_layers + plan.mtp_steps(cfg)
    if document_mask:  # no [b, 1, s, s] mask kept (it would add 4 b s^2 bytes a layer)
        unmasked = _estimated_forward_bytes(cfg, dataclasses.replace(inputs, document_mask=False))
        assert estimate == unmasked
        assert abs(measured - unmasked) < 0.01 * layers * 4 * batch * seq * seq


@pytest.mark.parametrize("mtp_steps, loss_chunk_tokens, document_mask",
                         [(0, 0, False), (3, 0, False), (3, 100, False), (3, 0, True)])
def test_dense_warmup_estimate_matches_a_measured_forward(tiny, mtp_steps, loss_chunk_tokens,
                                                          document_mask):
    """dsa.stage=dense_warmup, every weight frozen but the indexer's, run as the job runs it
    (training mode, grad enabled: GLM5Model.forward goes grad-free itself and each DSA layer
    runs its KL's backward at once): nothing is kept for the output's backward, and the peak
    is one layer's KL graph while it runs (activations.dense_indexer_kl_bytes, the stage's
    transient). Priced by the one-stage GLM5StageModel (the job's planner path). Measured:
    see the printed figures; tolerance 1%."""
    cfg = dataclasses.replace(tiny, mtp_num_steps=mtp_steps)
    seq, batch = 128, 2
    inputs = plan.MemoryInputs(seq_length=seq, micro_batch_size=batch, activation_bytes=4,
                               fused_attention=False, loss_chunk_tokens=loss_chunk_tokens,
                               document_mask=document_mask, dsa_stage="dense_warmup")
    stages = stage_model.GLM5StageModel(cfg, inputs, 1, 0 if plan.mtp_steps(cfg) else None)
    part = stages.part(0, cfg.first_k_dense_replace, cfg.num_hidden_layers, True)
    assert part.activation_bytes == 0  # nothing held between the forward and the backward
    mask = _document_mask(batch, seq) if document_mask else None
    measured = _measured_forward_bytes(cfg, seq, batch, mask, loss_chunk_tokens=loss_chunk_tokens,
                                       dsa_stage="dense_warmup", peak=True)
    sparse = _estimated_forward_bytes(cfg, dataclasses.replace(inputs, dsa_stage="sparse"))
    print(f"tiny dense warm-up forward, {mtp_steps} MTP steps, loss chunk {loss_chunk_tokens}, "
          f"document mask {document_mask}: estimate {part.transient_bytes} B, measured peak "
          f"{measured} B ({part.transient_bytes / measured - 1:+.2%}); as the sparse stage "
          f"{sparse} B")
    assert abs(part.transient_bytes - measured) <= 0.01 * measured


RECOMPUTES = {
    "full_uniform": Recompute("full", "uniform", 1),
    "full_block_2": Recompute("full", "block", 2),
    "selective_mla_up_proj": Recompute("selective", modules=("mla_up_proj",)),
    "selective_moe_act": Recompute("selective", modules=("moe_act",)),
    "selective_mla_up_proj_moe_act": Recompute("selective", modules=("mla_up_proj", "moe_act")),
    "selective_core_attn": Recompute("selective", modules=("core_attn",)),
    "selective_all": Recompute("selective", modules=("core_attn", "mla_up_proj", "moe_act")),
}


@pytest.mark.parametrize("mtp_steps", [0, 3])
@pytest.mark.parametrize("name", sorted(RECOMPUTES))
def test_recompute_estimate_matches_a_measured_forward(tiny, name, mtp_steps):
    """Recompute (parallel/recompute.py) in the tiny fp32 forward: full keeps each unit's input
    (block 2: layers 0-1 recomputed, 2-3 not; MTP steps recomputed under uniform only),
    selective frees the recomputed parts' saved tensors (the experts' SwiGLU, the MLA
    up-projection outputs and RoPE, the DSA core attention and its indexer KL). Tolerance 5% of the measured bytes; the saving itself
    within 5% too (measured: see the printed figures)."""
    cfg = dataclasses.replace(tiny, mtp_num_steps=mtp_steps)
    seq, batch, recompute = 128, 2, RECOMPUTES[name]
    inputs = plan.MemoryInputs(seq_length=seq, micro_batch_size=batch, activation_bytes=4,
                               fused_attention=False)
    with_recompute = dataclasses.replace(inputs, recompute=recompute)
    estimate = _estimated_forward_bytes(cfg, with_recompute)
    measured = _measured_forward_bytes(cfg, seq, batch, recompute=recompute)
    saving = _estimated_forward_bytes(cfg, inputs) - estimate
    measured_saving = _measured_forward_bytes(cfg, seq, batch) - measured
    print(f"tiny forward, {name}, {mtp_steps} MTP steps: estimate {estimate} B, measured "
          f"{measured} B; saving estimate {saving} B, measured {measured_saving} B")
    assert abs(estimate - measured) <= 0.05 * measured
    assert measured_saving > 0 and abs(saving - measured_saving) <= 0.05 * measured_saving


def _indexer_kl_bytes_744b(big, seq: int) -> int:
    inputs = dataclasses.replace(BIG_INPUTS, seq_length=seq)
    with_kl = activations.decoder_layer_activation_bytes(big, True, inputs)
    return with_kl - activations.decoder_layer_activation_bytes(
        big, True, dataclasses.replace(inputs, dsa_kl=False))


def test_indexer_kl_bytes_grow_linearly_in_the_sequence_744b(big):
    """The sparse-stage KL scores only the K selected keys per query: its saved bytes double
    with the sequence at a fixed top-k (no s x s term) and stay far below the 2 GiB per layer
    that the [b, s, Hi, s] fp32 ReLU scores of a full-row KL would keep at 4K tokens."""
    at_4k, at_8k = _indexer_kl_bytes_744b(big, 4096), _indexer_kl_bytes_744b(big, 8192)
    assert at_8k == 2 * at_4k
    assert 0 < at_4k < 4 * 4096 * 32 * 4096 // 4


# ------------------------------------------------------------------- context parallelism


def test_context_parallel_bytes_per_layer_follow_the_gathers_744b(big):
    """Per DSA layer application and micro-batch at 202,752 tokens, CP16, bf16: each rank
    all-gathers its 12,672 tokens' 576-wide latent key and 128-wide indexer key and
    reduce-scatters the gradients of what trains (measured byte for byte on the tiny model:
    tests/test_context_parallel_plan.py). A recomputed core attention gathers again; the dense
    warm-up returns only the indexer key's gradient; a frozen indexer's key gets none."""
    inputs = dataclasses.replace(BIG_INPUTS, cp=16, dp=1, seq_length=202_752)
    per_way = 15 * 12_672 * 2
    latent, index = big.kv_lora_rank + big.qk_rope_head_dim, big.index_head_dim
    assert (latent, index) == (576, 128)

    def sent(**changes) -> dict[str, int]:
        return dict(context_parallel_comm.dsa_context_parallel_comm(
            big, dataclasses.replace(inputs, **changes),
            2 if changes.get("recompute") else 1))

    both = {"all_gather:cp": per_way * (latent + index), "reduce_scatter:cp": per_way * (latent + index)}
    assert sent() == both
    assert sent(recompute=Recompute("selective", modules=("core_attn",))) == {
        "all_gather:cp": 2 * per_way * (latent + index), "reduce_scatter:cp": per_way * (latent + index)}
    assert sent(dsa_stage="dense_warmup") == {"all_gather:cp": per_way * (latent + index),
                                             "reduce_scatter:cp": per_way * index}
    assert sent(dsa_kl=False) == {"all_gather:cp": per_way * (latent + index),
                                  "reduce_scatter:cp": per_way * latent}
    assert context_parallel_comm.dsa_context_parallel_comm(big, dataclasses.replace(inputs, cp=1)) == ()


def test_context_parallel_ranks_keep_the_whole_sequence_keys_744b(big):
    """Each CP rank keeps its own tokens' activations but the whole sequence's latent and
    indexer keys (the absorbed attention and the indexer KL save the gathered tensors): a
    layer's bytes at CP16 exceed a 16th of CP1's by about those 202,752 x (576 + 128) bf16
    values, less their local share."""
    one = dataclasses.replace(BIG_INPUTS, tp=1, sequence_parallel=False, dp=1, seq_length=202_752)
    split = dataclasses.replace(one, cp=16)
    whole = activations.decoder_layer_activation_bytes(big, True, one)
    sharded = activations.decoder_layer_activation_bytes(big, True, split)
    gathered = 2 * 202_752 * (576 + 128)
    extra = sharded - whole // 16
    assert abs(extra - gathered * 15 / 16) <= 0.01 * gathered, (extra, gathered)


# -------------------------------------------------------------------------------------- CLI


def test_tool_prints_both_placements_for_the_tiny_model():
    proc = subprocess.run([sys.executable, TOOL, "model=glm5_tiny", "parallel=pp2_vpp2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summaries = SUMMARY.findall(proc.stdout)
    assert [s[0] for s in summaries] == ["with_loss", "split"], proc.stdout
    for placement, layout, top, bottom, spread in summaries:
        assert plan.parse_layout(layout, 2, 2, 4, 1).placement == placement
        assert int(spread) == int(top) - int(bottom) >= 0
    assert proc.stdout.rstrip().split("\n")[-1].startswith("placement=split ")


def test_tool_reports_a_bad_layout_and_exits_2(capsys):
    from tools import plan_pipeline

    code = plan_pipeline.main(["model=glm5_tiny", "parallel=pp2_vpp2",
                               "parallel.pipeline_model_parallel_layout='Et|t|t|tL'"])
    err = capsys.readouterr().err
    assert code == 2 and "plan_pipeline: error" in err and "0 'm'" in err, err


def test_tool_shows_a_given_layout_next_to_the_other_placement(capsys):
    from tools import plan_pipeline

    code = plan_pipeline.main(["model=glm5_tiny", "parallel=pp2_vpp2",
                               "parallel.pipeline_model_parallel_layout='Ett|t|tm|L'"])
    summaries = SUMMARY.findall(capsys.readouterr().out)
    assert code == 0 and next(s[:2] for s in summaries) == ("split", "Ett|t|tm|L")
    assert [s[0] for s in summaries] == ["split", "with_loss"]


FIT_SUMMARY = re.compile(r"^fits_h100=(True|False) fits_h200=(True|False) gpus=(\d+) "
                         r"max_rank_bytes=(\d+) working_set_bytes=(\d+) "
                         r"cp_bytes_per_step=(\d+)$", re.MULTILINE)


FIT_TOOL = os.path.join(REPO, "tools", "plan_fit.py")


def _fit_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, FIT_TOOL, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)


def test_fit_tool_reports_memory_traffic_and_each_technique():
    """tools/plan_fit.py on the tiny model at CP2 x PP2 x VPP2 with full recompute: the
    summary line, the per-rank CP traffic, the Megatron-Bridge line and one row per technique
    turned off (or on), each technique's saving counted where the plan uses it."""
    proc = _fit_tool("model=glm5_tiny", "parallel=pp2_vpp2", "parallel.context_parallel_size=2",
                     "train.global_batch_size=8", "activations.recompute_granularity=full",
                     "activations.recompute_method=uniform", "activations.recompute_num_layers=1")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    fits_h100, fits_h200, gpus, top, working_set, cp_sent = FIT_SUMMARY.findall(out)[-1]
    assert (fits_h100, fits_h200, int(gpus)) == ("True", "True", 4)
    assert int(top) > 0 and int(working_set) > 0 and int(cp_sent) > 0
    assert "608 H100" in out and "context parallelism CP2 -> CP1 (DP2)" in out
    assert "full recompute -> none" in out and "saved on the largest rank" in out
    assert out.rstrip().split("\n")[-1].startswith("fits_h100=")


RECIPE_SUMMARY = re.compile(r"^recipe=(\S+) gpus=(\d+) peak_bytes=(\d+) fits_h100=(True|False)$",
                            re.MULTILINE)


def test_fit_tool_plans_the_published_recipes_and_ours_on_fewer_gpus():
    """--recipes: slime's, Megatron-Bridge's 128K and 200K recipes as published and the same
    jobs with ours. The figures are the planner's: slime's layout does not fit 80 GB with its
    Adam state on the GPU, and does with it in host memory (slime's way), as does ours with
    the state on the GPU;
    Bridge's jobs fit ours on 256 GPUs where Bridge takes 416 and 608."""
    proc = _fit_tool("--recipes")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {name: (int(gpus), int(peak), fits == "True")
            for name, gpus, peak, fits in RECIPE_SUMMARY.findall(proc.stdout)}
    assert set(rows) == {"slime_256", "slime_256_host_adam", "slime_job_ours_256", "bridge_416",
                         "bridge_416_job_ours_256", "bridge_608", "bridge_608_job_ours_256"}
    assert [rows[n][0] for n in ("slime_256", "bridge_416", "bridge_608")] == [256, 416, 608]
    assert not rows["slime_256"][2] and rows["bridge_608"][2]
    assert rows["slime_256_host_adam"][2]  # slime's own answer: Adam state in host memory
    for published, ours in (("slime_256", "slime_job_ours_256"),
                            ("bridge_416", "bridge_416_job_ours_256"),
                            ("bridge_608", "bridge_608_job_ours_256")):
        assert rows[ours][2] and rows[ours][0] <= rows[published][0], (published, rows)
    assert proc.stdout.rstrip().split("\n")[-1].startswith("recipe=bridge_608_job_ours_256")


def test_fit_tool_reports_a_bad_override_and_exits_2():
    proc = _fit_tool("model=glm5_tiny", "train.global_batch_size=3", "--dp", "2")
    assert proc.returncode == 2 and "plan_fit: error" in proc.stderr, proc.stderr


RANK_ROW = re.compile(r"^\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\S+)\s+(\S+)\s+(\S+)"
                      r"\s+(\S+)$", re.MULTILINE)


def test_fit_tool_gives_each_ranks_data_pipeline_tensor_and_expert_parallel_bytes():
    """The per-rank table's DP, PP, TP and EP columns are the planner's bytes sent per step
    (plan.planned_traffic: the gradient reduction + parameter all-gather, the
    pipeline's sends, the tensor- and expert-tensor-parallel exchanges, the expert
    all-to-all; checked against measured runs by glm5_train.plan.check), n/a where it does not model them
    (distributed Muon's gradients travel to their owners; its gathers of TP-split matrices are
    planned)."""
    from glm5_train.job_config import compose_job

    overrides = ["+experiment=glm5_sft_202k"]
    proc = _fit_tool(*overrides)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = compose_job(overrides)
    gpu = {"fused_attention": True}
    inputs, report = plan.inputs_from_job(job, 1, **gpu), plan.job_plan(job, 1, **gpu)
    rows = RANK_ROW.findall(proc.stdout)
    assert len(rows) == job.parallel.pipeline_model_parallel_size
    for rank, dp_sent, pp_sent, tp_sent, ep_sent in rows:
        stages = [s for s in report.stages if s.rank == int(rank)]
        sent = plan.planned_traffic(job, inputs, report.layout, stages, int(rank))
        assert dp_sent == f"{(sent['grad_reduction'] + sent['param_gather']) / 1e9:.1f}"
        assert pp_sent == f"{sent['p2p'] / 1e9:.1f}" and sent["p2p"] > 0
        tensor = sent["tensor_parallel"] + sent["expert_tensor_parallel"]
        assert tp_sent == f"{tensor / 1e9:.1f}" and sent["tensor_parallel"] > 0
        assert ep_sent == f"{sent['expert_all_to_all'] / 1e9:.1f}"
        assert sent["expert_all_to_all"] > sent["tensor_parallel"]  # EP32: the largest kind
    muon = RANK_ROW.findall(_fit_tool(*overrides, "train.optimizer=muon").stdout)
    assert {dp for _, dp, _, _, _ in muon} == {"n/a"}
    assert all("n/a" not in (pp, tp, ep) for _, _, pp, tp, ep in muon)
