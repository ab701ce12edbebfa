"""A tiny random Hugging Face GLM-5 (``GlmMoeDsaForCausalLM``, transformers 5.x) for tests.

Shapes mirror ``configs/model/glm5_tiny.yaml``. Every tensor is randomised, norms and the
expert-score bias included: HF initialises those to constants, which would hide a mapping
mistake (a swapped norm, a missing bias) from any comparison.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

TINY_HF_CONFIG = dict(
    vocab_size=320, hidden_size=128, num_hidden_layers=4, first_k_dense_replace=1,
    intermediate_size=256, moe_intermediate_size=64, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
    kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4,
    index_head_dim=32, index_topk=32, max_position_embeddings=2048,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    num_nextn_predict_layers=0, tie_word_embeddings=False, routed_scaling_factor=2.5,
    n_group=1, topk_group=1, norm_topk_prob=True, rms_norm_eps=1e-5,
)


def build_tiny_hf(path: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """Create, randomise and save a tiny HF GLM-5 under ``path``; returns it in eval mode."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**{**TINY_HF_CONFIG, **overrides})).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(("norm.weight", "layernorm.weight")):
                tensor.copy_(1.0 + 0.1 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.05 * torch.randn(tensor.shape, generator=generator))
            else:
                tensor.copy_(0.05 * torch.randn(tensor.shape, generator=generator))
    model.save_pretrained(path, safe_serialization=True)
    return model


class _TopkTiesByIndex(TorchFunctionMode):
    """``Tensor.topk`` with equal scores in index order: a stable descending sort, first k."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.Tensor.topk:
            return func(*args, **kwargs)
        scores, k = args[0], args[1]
        assert kwargs.get("dim", -1) in (-1, scores.dim() - 1) and kwargs.get("largest", True)
        ordered = scores.sort(dim=-1, descending=True, stable=True)
        return torch.return_types.topk((ordered.values[..., :k], ordered.indices[..., :k]))


@contextlib.contextmanager
def hf_indexer_ties_by_index():
    """Make HF's ``GlmMoeDsaIndexer`` break top-k ties as our selection does.

    HF picks with ``torch.topk``, whose order among equal scores is unspecified (it differs
    between CPU and CUDA and with the row's length); the indexer's ReLU makes exact-zero
    scores common in these tiny models, and 1-3 of the 64 query rows per layer tie at the k-th
    value. Our selection's documented rule is larger score first, then smaller key index
    (``glm5_train.model.dsa.rank_keys``); here it is written independently, as a stable sort,
    and applied inside the indexer only (the router's top-k is left alone).
    """
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    original = hf.GlmMoeDsaIndexer.forward

    def forward(self, *args, **kwargs):
        with _TopkTiesByIndex():
            return original(self, *args, **kwargs)

    hf.GlmMoeDsaIndexer.forward = forward
    try:
        yield
    finally:
        hf.GlmMoeDsaIndexer.forward = original
