"""GLM-5 on megatron-core: layer specs and model construction for every pipeline chunk.

Layers: MLA attention everywhere, the first ``first_k_dense_replace`` layers with a dense SwiGLU
MLP and the rest MoE (sigmoid routing, expert-bias selection, one shared expert, top-k).
With Transformer Engine installed megatron-core's TE spec is used as is; without it the local
spec gets the two modules from ``glm5_train.model.layers`` it lacks.
"""

from __future__ import annotations

import copy
import importlib.util
from contextlib import contextmanager

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
)
from megatron.core.pipeline_parallel.utils import (
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.moe.router import Router
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from glm5_train.model.config import GLM5Config
from glm5_train.model.dsa import DSACoreAttention
from glm5_train.model.dsa_loss import DSATrainingConfig
from glm5_train.model.layers import LatentRMSNorm, RMSNorm
from glm5_train.model.mtp import chunk_hosts_mtp, mtp_block_spec, shifted_targets
from glm5_train.model.sparse_mla import GLM5MLASelfAttention
from parallel.chunked_cross_entropy import chunked_vocab_parallel_cross_entropy
from parallel.context_parallel import context_shard, gather_sequence_no_grad
from parallel.distopt_slices import gathered
from parallel.mla_down_projection import MLADownProjection
from parallel.recompute import (
    Recompute,
    set_core_attention_recompute,
    with_expert_activation_recompute,
)


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def decoder_block_spec(model_cfg: GLM5Config, config: MLATransformerConfig,
                       vp_stage: int | None, pp_rank: int | None = None,
                       use_te: bool | None = None,
                       dsa_training: DSATrainingConfig | None = None,
                       recompute: Recompute | None = None) -> TransformerBlockSubmodules:
    """The layer specs of the decoder layers one pipeline chunk builds (``recompute``: the
    selective expert-activation recompute is a spec change, parallel/recompute.py)."""
    use_te = transformer_engine_available() if use_te is None else use_te
    block = get_gpt_decoder_block_spec(_plain_attention(config), use_transformer_engine=use_te,
                                       normalization="RMSNorm", vp_stage=vp_stage,
                                       pp_rank=pp_rank)
    layers = block.layer_specs if use_te else [_localize_layer(s) for s in block.layer_specs]
    return TransformerBlockSubmodules(
        layer_specs=[_with_recompute(_with_dsa(spec, model_cfg, dsa_training), recompute)
                     for spec in layers],
        layer_norm=block.layer_norm if use_te else RMSNorm)


def _plain_attention(config: MLATransformerConfig) -> MLATransformerConfig:
    """The config as megatron-core's GPT spec builders read it: MLA without its attention
    variant. The specs are plain MLA layers whichever variant is set (``_with_dsa`` makes them
    DSA); megatron-core 0.19 refuses to build specs from a config with a variant set."""
    plain = copy.copy(config)
    plain.experimental_attention_variant = None
    return plain


def _with_dsa(layer: ModuleSpec, model_cfg: GLM5Config,
              dsa_training: DSATrainingConfig | None) -> ModuleSpec:
    """GLM-5 runs DeepSeek Sparse Attention in every layer (TE and local specs alike), its
    sparse stage on MLA's latent (GLM5MLASelfAttention hands the core attention the latent
    key instead of up-projected keys and values)."""
    layer = copy.deepcopy(layer)
    layer.submodules.self_attention.module = GLM5MLASelfAttention
    layer.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=DSACoreAttention,
        params=dict(dsa_n_heads=model_cfg.index_n_heads, dsa_head_dim=model_cfg.index_head_dim,
                    dsa_topk=model_cfg.index_topk, rope_theta=model_cfg.rope_theta,
                    dsa_training=dsa_training))
    return layer


def _with_recompute(layer: ModuleSpec, recompute: Recompute | None) -> ModuleSpec:
    """Selective "moe_act": the experts' module classes recompute their SwiGLU."""
    if recompute is not None and recompute.selects("moe_act"):
        return with_expert_activation_recompute(layer)
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
                       dsa_training: DSATrainingConfig | None = None,
                       eod_token_id: int | None = None,
                       groups: ProcessGroupCollection | None = None,
                       loss_chunk_tokens: int = 0,
                       recompute: Recompute | None = None) -> list["GLM5Model"]:
    """Build this rank's model chunks: one per virtual pipeline stage (one without VPP).
    ``eod_token_id`` marks document ends in packed sequences (MTP never predicts across).
    ``groups``: the process groups the chunks use (None: megatron-core's, as its own default).
    ``loss_chunk_tokens``: tokens per chunk of the output head + loss (0: megatron's head).
    ``recompute``: what parallel/recompute.py recomputes beyond ``config``'s megatron-core fields
    (the experts' activation, via the specs; the DSA core attention, set after the build)."""
    groups = groups or ProcessGroupCollection.use_mpu_process_groups()
    vpp = config.virtual_pipeline_model_parallel_size
    stages = range(vpp) if vpp else [None]
    chunks = [_build_chunk(model_cfg, config, vp, use_te, dsa_training, eod_token_id, groups,
                           loss_chunk_tokens, recompute)
              for vp in stages]
    if recompute is not None and recompute.selects("core_attn"):
        set_core_attention_recompute(
            [m for chunk in chunks for m in chunk.modules() if isinstance(m, DSACoreAttention)],
            True)
    return chunks


def _build_chunk(model_cfg: GLM5Config, config: MLATransformerConfig, vp_stage: int | None,
                 use_te: bool | None, dsa_training: DSATrainingConfig | None,
                 eod_token_id: int | None, groups: ProcessGroupCollection,
                 loss_chunk_tokens: int = 0,
                 recompute: Recompute | None = None) -> "GLM5Model":
    vpp = config.virtual_pipeline_model_parallel_size
    pre = is_pp_first_stage(groups.pp) and (vp_stage is None or is_vp_first_stage(vp_stage, vpp))
    post = is_pp_last_stage(groups.pp) and (vp_stage is None or is_vp_last_stage(vp_stage, vpp))
    mtp_spec = None
    if chunk_hosts_mtp(config, vp_stage):
        mtp_spec = _mtp_spec(model_cfg, config, use_te, dsa_training, recompute)
    return GLM5Model(
        config=config,
        transformer_layer_spec=decoder_block_spec(model_cfg, config, vp_stage, use_te=use_te,
                                                  dsa_training=dsa_training,
                                                  recompute=recompute),
        vocab_size=model_cfg.vocab_size,
        max_sequence_length=model_cfg.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=model_cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model_cfg.rope_theta),
        mtp_block_spec=mtp_spec,
        pg_collection=groups,
        vp_stage=vp_stage,
        mtp_num_steps=model_cfg.mtp_num_steps if model_cfg.mtp_sets else 0,
        eod_token_id=eod_token_id,
        loss_chunk_tokens=loss_chunk_tokens,
        grad_free_forward=dsa_training is not None and dsa_training.stage == "dense_warmup",
    )


def _mtp_spec(model_cfg: GLM5Config, config: MLATransformerConfig, use_te: bool | None,
              dsa_training: DSATrainingConfig | None, recompute: Recompute | None = None):
    """The MTP layers: each wraps a full MoE decoder layer (the model's last layer kind)."""
    use_te = transformer_engine_available() if use_te is None else use_te
    layer = get_gpt_decoder_layer_specs(_plain_attention(config), use_transformer_engine=use_te,
                                        normalization="RMSNorm")[-1]
    layer = _with_dsa(layer if use_te else _localize_layer(layer), model_cfg, dsa_training)
    layer = _with_recompute(layer, recompute)
    if use_te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm
        return mtp_block_spec(layer, TENorm, TEColumnParallelLinear, config.mtp_num_layers)
    return mtp_block_spec(layer, RMSNorm, ColumnParallelLinear, config.mtp_num_layers)


class GLM5Model(GPTModel):
    """megatron-core's GPTModel with GLM-5's multi-token prediction.

    The ``config.mtp_num_layers`` MTP layers are applied for ``mtp_num_steps`` steps, cycling
    (GLM-5: one layer, three steps sharing its parameters). The chunk holding them emits the
    main hidden states and every step's output concatenated along the sequence; the last stage
    computes each step's loss with the shared output head and attaches it to the main hidden
    states (megatron-core's ``MTPLossAutoScaler``: gradients flow, the returned loss stays the
    main LM loss). Per-step loss sums are kept for logging (``take_mtp_report``).

    With labels and ``loss_chunk_tokens`` > 0 every head (main and MTP) runs the output
    projection + cross-entropy ``loss_chunk_tokens`` tokens at a time
    (``parallel.chunked_cross_entropy``): the [S, B, V/TP] logits are never held whole.
    """

    def __init__(self, *args, mtp_num_steps: int = 0, eod_token_id: int | None = None,
                 loss_chunk_tokens: int = 0, grad_free_forward: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.grad_free_forward = grad_free_forward
        self._dsa_modules = [m for m in self.modules() if isinstance(m, DSACoreAttention)]
        self._routers = [m for m in self.modules() if isinstance(m, Router)]
        self.mtp_num_steps = mtp_num_steps
        self.eod_token_id = eod_token_id
        self.loss_chunk_tokens = loss_chunk_tokens
        if loss_chunk_tokens and (self.config.cross_entropy_loss_fusion
                                  or self.config.defer_embedding_wgrad_compute):
            raise ValueError(f"loss_chunk_tokens={loss_chunk_tokens} replaces megatron's output "
                             "head and loss: it cannot run with cross_entropy_loss_fusion or "
                             "defer_embedding_wgrad_compute; turn those off or set 0")
        self._mtp_reports: list[torch.Tensor] = []
        # RL: the main head also measures each token's predictive entropy (chunked head only),
        # one [B, S] tensor per micro-batch, taken by the loss function (take_entropy).
        self.measure_entropy = False
        self._entropy_reports: list[torch.Tensor] = []
        # Speculative-decoding drafts (tools/mtp_accept_length.py): a forward without labels
        # also runs the MTP steps and returns every head's logits (``_head_logits``).
        self.emit_mtp_logits = False

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None):
        # megatron-core's GPTModel reads metadata["dp_cp_group"] when an MTP chunk holds an
        # embedding copy but does not default it the way its submodules do.
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)

    def forward(self, *args, **kwargs):
        """megatron-core's forward; in the DSA dense warm-up (``grad_free_forward``: all but
        the indexers frozen, their inputs detached) without autograd: each DSA layer runs its
        KL's backward at once (``DSACoreAttention.kl_backward_in_forward``), nothing else needs
        a gradient, so nothing is kept for a backward, and the output only carries megatron's
        pipeline contract (``GradientBridge``)."""
        if not (self.grad_free_forward and self.training and torch.is_grad_enabled()):
            return super().forward(*args, **kwargs)
        with torch.no_grad(), local_kl_backward(self._dsa_modules), \
                routers_count_tokens(self._routers):
            output = super().forward(*args, **kwargs)
        received = None if self.pre_process else self.decoder.input_tensor
        if received is not None and received.requires_grad:
            return GradientBridge.apply(output, received, True)
        return GradientBridge.apply(output, _dummy_leaf(output.device), False)

    def take_entropy(self) -> torch.Tensor | None:
        """[B, S] predictive entropy of the oldest micro-batch not yet taken (None: none)."""
        return self._entropy_reports.pop(0) if self._entropy_reports else None

    def take_mtp_report(self) -> torch.Tensor | None:
        """[steps, 2] (loss sum, token count) of the oldest micro-batch not yet taken."""
        return self._mtp_reports.pop(0) if self._mtp_reports else None

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                     rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None,
                     decoder_input=None, attention_mask=None, inference_params=None,
                     packed_seq_params=None, sequence_len_offset=None,
                     runtime_gather_output=None, extra_block_kwargs=None,
                     inference_context=None, **newer):
        # ``newer``: the keywords later megatron-core releases add (0.19: padding_mask,
        # output_processor, output_processor_context), handed on to its own _postprocess; our
        # MTP and chunked-loss paths take no padding mask and no output processor.
        chunked_loss = labels is not None and self.loss_chunk_tokens > 0
        if not self.mtp_num_steps and not chunked_loss:
            return super()._postprocess(
                hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                rotary_pos_sin, mtp_in_postprocess=False, loss_mask=loss_mask,
                decoder_input=decoder_input, attention_mask=attention_mask,
                inference_params=inference_params, packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                runtime_gather_output=runtime_gather_output,
                extra_block_kwargs=extra_block_kwargs, inference_context=inference_context,
                **newer)
        if any(value is not None for value in newer.values()):
            raise NotImplementedError(f"{sorted(k for k, v in newer.items() if v is not None)}: "
                                      "not supported with MTP or the chunked loss")
        # Without labels (inference) nothing predicts beyond the next token unless the drafts
        # are asked for (emit_mtp_logits): skip MTP.
        with_mtp = (labels is not None or self.emit_mtp_logits) and self.mtp_num_steps > 0
        if mtp_in_postprocess and with_mtp:
            hidden_states = self._mtp_steps(hidden_states, input_ids, position_ids,
                                            attention_mask, rotary_pos_emb, packed_seq_params,
                                            sequence_len_offset)
        if not self.post_process:
            return hidden_states
        output_weight = (self.shared_embedding_or_output_weight()
                         if self.share_embeddings_and_output_weights else None)
        if with_mtp and labels is None:
            return self._head_logits(torch.chunk(hidden_states, 1 + self.mtp_num_steps, dim=0),
                                     output_weight, runtime_gather_output)
        if with_mtp:
            main, *steps = torch.chunk(hidden_states, 1 + self.mtp_num_steps, dim=0)
            # A zero weight (RL: the MTP layers frozen) adds nothing: no head runs for it (nor
            # did the steps: _mtp_steps).
            hidden_states = main
            if self.config.mtp_loss_scaling_factor:
                hidden_states = self._attach_mtp_losses(main, steps, input_ids, labels,
                                                        loss_mask, output_weight,
                                                        runtime_gather_output, attention_mask)
        if labels is None:
            logits, _ = self.output_layer(hidden_states, weight=output_weight,
                                          runtime_gather_output=runtime_gather_output)
            return logits.transpose(0, 1).contiguous()  # [s, b, v] -> [b, s, v]
        return self._token_losses(hidden_states, labels, output_weight, runtime_gather_output,
                                  entropy=self.measure_entropy)

    def _head_logits(self, hidden_per_head: tuple, output_weight,
                     runtime_gather_output) -> torch.Tensor:
        """Logits [B, 1 + K, S, V/TP] of the main head and each of the K MTP steps (head k at
        position i predicts token i + k + 1). Each head's hidden states go through the output
        layer separately: under sequence parallelism each rank holds a shard of every head's
        sequence, and the layer's sequence gather must not interleave heads."""
        logits = [self.output_layer(hidden_SBH, weight=output_weight,
                                    runtime_gather_output=runtime_gather_output)[0]
                  for hidden_SBH in hidden_per_head]
        return torch.stack([head_SBV.transpose(0, 1) for head_SBV in logits], dim=1)

    def _token_losses(self, hidden_SBH, labels_BS, output_weight, runtime_gather_output,
                      entropy: bool = False):
        """Per-token cross-entropy [B, S] of the output head: chunked over tokens when
        ``loss_chunk_tokens`` > 0, else megatron's head (whole logits) and loss. The weight
        (the head's own or the tied embedding) gets its gradient through param.grad either way,
        where megatron's DDP hooks take it (gradient_accumulation_fusion is off)."""
        if not self.loss_chunk_tokens:
            logits, _ = self.output_layer(hidden_SBH, weight=output_weight,
                                          runtime_gather_output=runtime_gather_output)
            return self.compute_language_model_loss(labels_BS, logits)
        head = self.output_layer
        labels_SB = labels_BS.transpose(0, 1)
        entropy_SB = (torch.empty(labels_SB.shape, dtype=torch.float64 if hidden_SBH.dtype
                                  == torch.float64 else torch.float32, device=labels_SB.device)
                      if entropy else None)
        loss_SB = chunked_vocab_parallel_cross_entropy(
            hidden_SBH, gathered(head.weight if output_weight is None else output_weight),
            labels_SB, self.loss_chunk_tokens, tp_group=head.tp_group,
            sequence_parallel=head.sequence_parallel, entropy_SB=entropy_SB)
        if entropy_SB is not None:
            self._entropy_reports.append(entropy_SB.transpose(0, 1).contiguous())
        return loss_SB.transpose(0, 1).contiguous()

    def _mtp_steps(self, hidden_states, input_ids, position_ids, attention_mask,
                   rotary_pos_emb, packed_seq_params, sequence_len_offset):
        """[main; step 1; ...; step K] hidden states, concatenated along the sequence. With a
        zero MTP loss weight (RL with the MTP layers frozen) nothing trains through the steps:
        they do not run (unless ``emit_mtp_logits`` asks for the drafts), and zeros keep the
        [main; steps] shape the pipeline sends on."""
        if not self.config.mtp_loss_scaling_factor and not self.emit_mtp_logits:
            return torch.cat([hidden_states] + [torch.zeros_like(hidden_states)]
                             * self.mtp_num_steps, dim=0)
        outputs = [hidden_states]
        ids, positions = input_ids, position_ids
        for step in range(self.mtp_num_steps):
            layer = self.mtp.layers[step % len(self.mtp.layers)]
            # 0.19 also returns the rolled padding mask (None: we pass none)
            hidden_states, ids, positions, *_ = layer(
                input_ids=ids, position_ids=positions, hidden_states=hidden_states,
                attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                embedding=self.embedding)
            outputs.append(hidden_states)
        return torch.cat(outputs, dim=0)

    def _attach_mtp_losses(self, main, steps, input_ids, labels, loss_mask, output_weight,
                           runtime_gather_output, attention_mask=None):
        """Each step's masked per-token loss sum rides on ``main``'s backward, weighted
        mtp_loss_weight / steps (per-token loss: megatron divides by the global token count)."""
        assert self.config.calculate_per_token_loss, "MTP losses are summed per token"
        weight = self.config.mtp_loss_scaling_factor / self.mtp_num_steps
        report = []
        # Step k's target at a position is the label k positions later: under context
        # parallelism on another rank, so the targets come from the whole sequence's token ids
        # (gathered, a few bytes per token) and this rank keeps its share.
        shard = context_shard(self.pg_collection.cp, labels.shape[1], labels.device)
        documents = (attention_mask if attention_mask is not None
                     and attention_mask.dtype != torch.bool else None)  # key_masks' starts
        labels_, mask_, ids_, starts_ = [None if t is None else gather_sequence_no_grad(
            t, shard, dim=1) for t in (labels, loss_mask, input_ids, documents)]
        for k, hidden in enumerate(steps, start=1):
            targets, mask = (t.index_select(1, shard.positions) if shard.is_split else t
                             for t in shifted_targets(labels_, mask_, ids_, k,
                                                      self.eod_token_id, starts_))
            token_loss = self._token_losses(hidden, targets, output_weight,
                                            runtime_gather_output) * mask
            report.append(torch.stack([token_loss.sum().detach().float(), mask.sum()]))
            main = MTPLossAutoScaler.apply(main, weight * token_loss)
        if self.training:
            self._mtp_reports.append(torch.stack(report))
        return main


@contextmanager
def local_kl_backward(dsa_modules: list[DSACoreAttention]):
    """The DSA layers of a chunk run their KL's backward inside the forward meanwhile."""
    for module in dsa_modules:
        module.kl_backward_in_forward = True
    try:
        yield
    finally:
        for module in dsa_modules:
            module.kl_backward_in_forward = False


@contextmanager
def routers_count_tokens(routers: list[Router]):
    """The MoE routers run with grad mode on inside the grad-free forward: megatron-core counts
    the tokens per expert for the expert-bias update only then (router._apply_expert_bias),
    as the dense warm-up always did. Their inputs and weights need no gradient, so autograd
    records nothing there."""
    handles = [hook for router in routers for hook in (
        router.register_forward_pre_hook(_grad_mode_on), router.register_forward_hook(
            _grad_mode_off))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _grad_mode_on(*_) -> None:  # a hook returning None leaves the module's inputs as they are
    torch.set_grad_enabled(True)


def _grad_mode_off(*_) -> None:  # back to the surrounding no_grad (its exit restores the rest)
    torch.set_grad_enabled(False)


def _dummy_leaf(device: torch.device) -> torch.Tensor:
    """The first stage's ``GradientBridge`` anchor: makes the output require grad, as
    megatron's backward step needs, and receives no gradient."""
    return torch.zeros((), device=device, requires_grad=True)


class GradientBridge(torch.autograd.Function):
    """The grad-free chunk output joined to ``anchor``: the chunk's received pipeline input
    (``received``; megatron sends its gradient back, the peer waits for it) or a dummy leaf.
    Forward returns the output unchanged; backward gives the received input zeros (nothing
    before this chunk needs a gradient: every weight there is frozen, the indexers got theirs
    in the forward) and a dummy nothing. The received input is saved for backward: megatron
    keeps it until then anyway, and the saved-bytes meter then counts it."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, anchor: torch.Tensor, received: bool):
        ctx.received = received
        ctx.save_for_backward(anchor if received else None)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (anchor,) = ctx.saved_tensors
        return None, torch.zeros_like(anchor) if ctx.received else None, None


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
