"""GLM-5 on megatron-core: layer specs and model construction for every pipeline chunk.

Layers: MLA attention everywhere, the first ``first_k_dense_replace`` layers with a dense SwiGLU
MLP and the rest MoE (sigmoid routing, expert-bias selection, one shared expert, top-k).
With Transformer Engine installed megatron-core's TE spec is used as is; without it the local
spec gets the two modules from ``glm5_train.layers`` it lacks.
"""

from __future__ import annotations

import copy
import importlib.util

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig

from glm5_train.config import GLM5Config
from glm5_train.dsa import DSACoreAttention
from glm5_train.dsa_loss import DSATrainingConfig
from glm5_train.layers import LatentRMSNorm, MLADownProjection, RMSNorm


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def decoder_block_spec(model_cfg: GLM5Config, config: MLATransformerConfig,
                       vp_stage: int | None, pp_rank: int | None = None,
                       use_te: bool | None = None,
                       dsa_training: DSATrainingConfig | None = None) -> TransformerBlockSubmodules:
    """The layer specs of the decoder layers one pipeline chunk builds."""
    use_te = transformer_engine_available() if use_te is None else use_te
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                       normalization="RMSNorm", vp_stage=vp_stage,
                                       pp_rank=pp_rank)
    layers = block.layer_specs if use_te else [_localize_layer(s) for s in block.layer_specs]
    return TransformerBlockSubmodules(
        layer_specs=[_with_dsa(spec, model_cfg, dsa_training) for spec in layers],
        layer_norm=block.layer_norm if use_te else RMSNorm)


def _with_dsa(layer: ModuleSpec, model_cfg: GLM5Config,
              dsa_training: DSATrainingConfig | None) -> ModuleSpec:
    """GLM-5 runs DeepSeek Sparse Attention in every layer (TE and local specs alike)."""
    layer = copy.deepcopy(layer)
    layer.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=DSACoreAttention,
        params=dict(dsa_n_heads=model_cfg.index_n_heads, dsa_head_dim=model_cfg.index_head_dim,
                    dsa_topk=model_cfg.index_topk, rope_theta=model_cfg.rope_theta,
                    dsa_training=dsa_training))
    return layer


def _localize_layer(layer: ModuleSpec) -> ModuleSpec:
    """Swap the local spec's MLA core attention and norms for ones that work without TE."""
    layer = copy.deepcopy(layer)
    sub = layer.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    attn = sub.self_attention.submodules
    attn.linear_q_down_proj = MLADownProjection
    attn.linear_kv_down_proj = MLADownProjection
    attn.q_layernorm = LatentRMSNorm
    attn.kv_layernorm = LatentRMSNorm
    return layer


def build_model_chunks(model_cfg: GLM5Config, config: MLATransformerConfig,
                       use_te: bool | None = None,
                       dsa_training: DSATrainingConfig | None = None) -> list[GPTModel]:
    """Build this rank's model chunks: one per virtual pipeline stage (one without VPP)."""
    vpp = config.virtual_pipeline_model_parallel_size
    stages = range(vpp) if vpp else [None]
    return [_build_chunk(model_cfg, config, vp, use_te, dsa_training) for vp in stages]


def _build_chunk(model_cfg: GLM5Config, config: MLATransformerConfig, vp_stage: int | None,
                 use_te: bool | None, dsa_training: DSATrainingConfig | None) -> GPTModel:
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return GPTModel(
        config=config,
        transformer_layer_spec=decoder_block_spec(model_cfg, config, vp_stage, use_te=use_te,
                                                  dsa_training=dsa_training),
        vocab_size=model_cfg.vocab_size,
        max_sequence_length=model_cfg.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=model_cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model_cfg.rope_theta),
        vp_stage=vp_stage,
    )


def apply_dsa_freezing(chunks: list[torch.nn.Module], dsa_training: DSATrainingConfig) -> None:
    """Dense warm-up trains only the indexer; freeze_indexer keeps the indexer fixed.
    Call before wrapping in DDP: DDP and the optimizer only take parameters that need grads."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            in_indexer = ".indexer." in name
            if dsa_training.stage == "dense_warmup" and not in_indexer:
                param.requires_grad_(False)
            if dsa_training.freeze_indexer and in_indexer:
                param.requires_grad_(False)


def indexer_kl(chunks: list[torch.nn.Module]) -> tuple[float, int]:
    """This rank's indexer KL sum and query count since the last call, over all DSA layers."""
    total, queries = 0.0, 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, DSACoreAttention):
                kl_sum, count = module.kl_meter.take()
                total, queries = total + kl_sum, queries + count
    return total, queries


def count_parameters(chunks: list[torch.nn.Module]) -> int:
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())
