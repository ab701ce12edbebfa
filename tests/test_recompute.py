"""Activation recompute (parallel/recompute.py, activations.recompute_*): config rules, what
reaches megatron-core's config, and job-level parity: the real job with full or selective
recompute against the same job without, in one process and in the pp2_vpp2 layout (MTP split
onto the stage before the loss): losses (LM, per-step MTP), the indexer KL (counted once per
micro-batch: zero or twice would show as a 100% difference), global and per-parameter grad norms.
The run's own saved-bytes figures show the recompute happened. The planner's recompute bytes
are checked against a measured forward in tests/test_pipeline_plan.py
(test_recompute_estimate_matches_a_measured_forward).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)

from glm5_train.job_config import compose_job
from glm5_train.model.config import to_mcore_config
from parallel.layout import ParallelSizes
from parallel.recompute import (
    ActivationRecomputeSequentialMLP,
    ActivationRecomputeSharedExpertMLP,
    Recompute,
    with_expert_activation_recompute,
)
from tests.parity import FP32, Tolerances, assert_layout_ran, compare, one_process, run_job

FULL = ["activations.recompute_granularity=full", "activations.recompute_method=uniform",
        "activations.recompute_num_layers=1"]
BLOCK = ["activations.recompute_granularity=full", "activations.recompute_method=block",
         "activations.recompute_num_layers=2"]
# core_attn needs DSACoreAttention.recompute_core (its own checkpoint of the DSA forward).
SELECTIVE_MODULES = ["core_attn", "mla_up_proj", "moe_act"]
SELECTIVE = ["activations.recompute_granularity=selective",
             f"activations.recompute_modules=[{','.join(SELECTIVE_MODULES)}]"]

# Recompute against no recompute, same layout: the recomputed forward is bit-identical on CPU;
# what differs is the order in which reentrant backward passes accumulate gradients (shared
# MTP layer, embedding copies). Measured over 5 steps, 1 process (full uniform, selective
# mla_up_proj + moe_act): losses 4.0e-8, grad norm 1.8e-7 (4.2e-6 seen at step 3 of full
# uniform in a later run), indexer KL 8.6e-6 (a tiny sum of cancelling terms), per-parameter
# grad norms 9.0e-6 (floor 1e-4 of the global norm; step 1: 6.1e-8). Tolerances ~10x those.
RECOMPUTE = Tolerances(loss=5e-7, grad_norm=5e-5, indexer_kl=1e-4, param=1e-4)


# ---------------------------------------------------------------------------------- config

BAD = [  # (overrides, words the message must hold)
    (["activations.recompute_granularity=partial"], ["'partial'", "'full' or 'selective'"]),
    (["activations.recompute_granularity=full"], ["recompute_method=None", "'uniform' or"]),
    (["activations.recompute_granularity=full", "activations.recompute_method=uniform"],
     ["recompute_num_layers=None", ">= 1"]),
    (["activations.recompute_granularity=full", "activations.recompute_method=block",
      "activations.recompute_num_layers=0"], ["recompute_num_layers=0"]),
    ([*FULL[:2], "activations.recompute_num_layers=2"], ["MTP", "recompute_num_layers=1"]),
    ([*FULL, "dsa=dense_warmup"], ["dense_warmup", "unnecessary", "recompute_granularity=null"]),
    ([*FULL, "activations.recompute_modules=[moe_act]"], ["selective only"]),
    (["activations.recompute_method=block"], ["full only"]),
    (["activations.recompute_granularity=selective"], ["non-empty"]),
    (["activations.recompute_granularity=selective", "activations.recompute_modules=[mlp]"],
     ["['mlp']", "core_attn"]),
    (["activations.recompute_granularity=selective",
      "activations.recompute_num_layers=1", "activations.recompute_modules=[moe_act]"],
     ["full only"]),
]


@pytest.mark.parametrize("overrides, words", BAD)
def test_bad_recompute_config_is_refused_with_the_rule(overrides, words):
    with pytest.raises(ValueError) as err:
        compose_job(["model=glm5_tiny", *overrides])
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_block_recompute_with_mtp_and_uniform_without_are_accepted():
    compose_job(["model=glm5_tiny", *BLOCK[:2], "activations.recompute_num_layers=3"])
    compose_job(["model=glm5_tiny", "model.mtp_num_steps=0", *FULL[:2],
                 "activations.recompute_num_layers=2"])


def test_megatron_gets_only_what_it_recomputes_itself(tiny_model):
    """core_attn never reaches megatron-core (its checkpoint_core_attention drops DSA's x/qr),
    moe_act neither (megatron refuses it without grouped GEMM): ours recompute those."""
    every = Recompute("selective", modules=("core_attn", "mla_up_proj", "moe_act"))
    config = to_mcore_config(tiny_model, ParallelSizes(), torch.float32, recompute=every)
    assert (config.recompute_granularity, config.recompute_modules) == ("selective",
                                                                       ["mla_up_proj"])
    ours = Recompute("selective", modules=("core_attn", "moe_act"))
    config = to_mcore_config(tiny_model, ParallelSizes(), torch.float32, recompute=ours)
    assert config.recompute_granularity is None and config.recompute_modules == []
    plain = to_mcore_config(tiny_model, ParallelSizes(), torch.float32)
    assert plain.recompute_granularity is None and plain.recompute_modules == []
    full = to_mcore_config(tiny_model, ParallelSizes(), torch.float32,
                           recompute=Recompute("full", "block", 2))
    assert (full.recompute_granularity, full.recompute_method,
            full.recompute_num_layers) == ("full", "block", 2)


def _moe_layer_spec(as_builders: bool) -> ModuleSpec:
    """A decoder layer's spec with an MoE MLP, written the way megatron-core 0.16 writes it
    (``ModuleSpec``s) or the way 0.17+ do (builders: ``functools.partial``)."""
    mlp = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    if as_builders:
        moe = partial(MoELayer, submodules=MoESubmodules(
            experts=partial(SequentialMLP, submodules=mlp),
            shared_experts=partial(SharedExpertMLP, submodules=mlp)))
    else:
        moe = ModuleSpec(module=MoELayer, submodules=MoESubmodules(
            experts=ModuleSpec(module=SequentialMLP, submodules=mlp),
            shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=mlp)))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(mlp=moe))


def _built_by(builder):
    return builder.module if isinstance(builder, ModuleSpec) else builder.func


@pytest.mark.parametrize("as_builders", [False, True], ids=["module_specs", "builders"])
def test_expert_activation_recompute_reads_both_spec_forms(as_builders):
    """moe_act swaps the experts' classes in either spec form (0.19 writes builders: reading
    only ModuleSpecs left its experts silently unrecomputed); the input spec is untouched."""
    layer = _moe_layer_spec(as_builders)
    swapped = with_expert_activation_recompute(layer)
    moe = swapped.submodules.mlp
    moe = moe.submodules if isinstance(moe, ModuleSpec) else moe.keywords["submodules"]
    assert _built_by(moe.experts) is ActivationRecomputeSequentialMLP
    assert _built_by(moe.shared_experts) is ActivationRecomputeSharedExpertMLP
    original = layer.submodules.mlp
    original = original.submodules if isinstance(original, ModuleSpec) else original.keywords[
        "submodules"]
    assert _built_by(original.experts) is SequentialMLP


def test_expert_activation_recompute_refuses_what_it_cannot_read():
    layer = _moe_layer_spec(as_builders=True)
    layer.submodules.mlp.keywords["submodules"].experts = partial(TransformerLayer)
    with pytest.raises(ValueError, match=r"moe_act\] needs SequentialMLP experts"):
        with_expert_activation_recompute(layer)
    layer.submodules.mlp = object()
    with pytest.raises(ValueError, match="cannot read this layer's MLP spec"):
        with_expert_activation_recompute(layer)


@pytest.fixture(scope="module")
def tiny_model():
    return compose_job(["model=glm5_tiny"]).model


# ---------------------------------------------------------------------------------- parity


@pytest.fixture(scope="module")
def reference():
    return one_process(["parallel=single"]).records


def _saved_bytes(records: list[dict]) -> list[int]:
    """Every step's saved-for-backward bytes (metrics.jsonl saved_bytes_total), summed over
    ranks."""
    return [sum(r["saved_bytes_total"]) for r in records]


CASES = {
    # name: (processes, overrides, tolerances against the 1-process run without recompute)
    "full_uniform": (1, ["parallel=single", *FULL], RECOMPUTE),
    "full_block_2": (1, ["parallel=single", *BLOCK], RECOMPUTE),
    "selective": (1, ["parallel=single", *SELECTIVE], RECOMPUTE),
    # Another layout against one process: the layout's own reduction-order noise dominates.
    "pp2_vpp2_full_uniform": (2, ["parallel=pp2_vpp2", *FULL], FP32),
    "pp2_vpp2_selective": (2, ["parallel=pp2_vpp2", *SELECTIVE], FP32),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_recompute_matches_no_recompute(name, reference, tmp_path):
    nprocs, overrides, tolerances = CASES[name]
    result = run_job(nprocs, overrides, str(tmp_path / name))
    assert_layout_ran(result, nprocs, overrides)
    problems = compare(reference, result.records, tolerances)
    assert not problems, f"{name} diverges from no recompute:\n" + "\n".join(problems)
    for record, ref in zip(result.records, reference):  # the KL and MTP losses are logged
        assert record["indexer_kl"] > 0 and ref["indexer_kl"] > 0
        assert [k for k in record if k.startswith("mtp_loss")] == [
            k for k in ref if k.startswith("mtp_loss")]
    # The run's own accounting shows the recompute: fewer bytes saved for backward per step.
    saved, saved_ref = _saved_bytes(result.records), _saved_bytes(reference)
    assert all(s < 0.9 * r for s, r in zip(saved, saved_ref)), (saved, saved_ref)
