"""How a run trades activation memory for compute and host traffic (config group
``activations``, ``configs/activations/``): the sequence-chunked output projection and loss,
activation offloading to host memory, and recompute. Each field says which code reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel.recompute import GRANULARITIES, METHODS, MODULES, Recompute


@dataclass
class ActivationsConfig:
    # --- sequence-chunked output projection + cross-entropy (main head and every MTP step)
    # Tokens (sequence positions x micro-batch) per chunk; 0 computes the whole sequence at once.
    loss_chunk_tokens: int = 2048

    # --- activation offloading to host memory (parallel/activation_offload.py)
    # On each pipeline rank, of the rank's first offload_micro_batches forward passes in the
    # order megatron-core runs them (each (chunk, micro-batch) forward counts one), those whose
    # backward is not the rank's very next op move their offloaded layers' saved tensors to
    # host memory after each layer's forward, and bring them back ahead of their backward
    # (parallel.pipeline_layout.offload_plan). 0: off. At least the rank's warm-up count
    # covers the whole pipeline warm-up (GLM-5's report); larger values reach into 1F1B. One
    # process: every backward follows its own forward, so nothing moves.
    offload_micro_batches: int = 0
    # Which layers offload, by global index: decoder layers 0 .. num_hidden_layers - 1, the
    # MTP layer(s) num_hidden_layers + k (HF numbering: model.layers.78 of GLM-5); each MTP
    # step is one layer call. null: every decoder and MTP layer.
    offload_layers: list[int] | None = None

    # --- recompute (parallel/recompute.py; megatron-core's names and meanings where it has them)
    # null: nothing recomputed. "full": whole decoder layers, each recompute unit keeping only
    # its input (megatron-core's TransformerBlock / MTP checkpointing). "selective": the parts
    # named in recompute_modules, in every decoder and MTP layer.
    recompute_granularity: str | None = None
    # full only: "uniform" recomputes all layers of each pipeline chunk, in units of
    # recompute_num_layers consecutive layers (each MTP step is one unit: needs num_layers=1 with
    # MTP); "block" recomputes the first recompute_num_layers layers of each chunk, one unit
    # each, and no MTP step (megatron-core has no block recompute for MTP).
    recompute_method: str | None = None
    recompute_num_layers: int | None = None  # full only, >= 1
    # selective only, any of: "core_attn" (DSA core attention, its own checkpoint),
    # "mla_up_proj" (MLA q/kv up projections + RoPE, megatron-core's), "moe_act" (SwiGLU of the
    # routed and shared experts, ours).
    recompute_modules: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if self.loss_chunk_tokens < 0:
            raise ValueError(f"activations.loss_chunk_tokens={self.loss_chunk_tokens} must be "
                             ">= 0 (0: the whole sequence in one piece)")
        self._check_recompute()
        self._check_offload()

    # ----------------------------------------------------------------------------- offloading

    def _check_offload(self) -> None:
        count, layers = self.offload_micro_batches, self.offload_layers
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"activations.offload_micro_batches={count!r} must be an integer "
                             ">= 0 (0: no offloading)")
        if count and self.recompute_granularity == "full":
            # Whole-layer recompute saves only each unit's input, outside the layer: nothing of
            # a layer's own is left to move (and the order check does not see its backward).
            raise ValueError(
                f"activations.offload_micro_batches={count} with recompute_granularity=full: "
                "full recompute leaves no layer activations to offload; use "
                "offload_micro_batches=0, or recompute_granularity=selective / null")
        if layers is None:
            return
        if count == 0:
            raise ValueError(f"activations.offload_layers={layers} has no effect with "
                             "offload_micro_batches=0: set offload_micro_batches > 0 or "
                             "offload_layers=null")
        if (not layers or len(set(layers)) != len(layers)
                or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in layers)):
            raise ValueError(f"activations.offload_layers={layers} must be null (every layer) "
                             "or a non-empty list of distinct layer indices >= 0")

    def check_offload_for(self, num_hidden_layers: int, mtp_sets: int) -> None:
        """offload_layers name layers the model has (decoder, then MTP)."""
        if self.offload_layers is None:
            return
        top = num_hidden_layers + mtp_sets
        beyond = [i for i in self.offload_layers if i >= top]
        if beyond:
            raise ValueError(
                f"activations.offload_layers={self.offload_layers}: {beyond} beyond the model's "
                f"layers 0..{top - 1} ({num_hidden_layers} decoder layers, then {mtp_sets} MTP "
                f"layer(s)): use indices below {top}")

    def offloads_layer(self, index: int) -> bool:
        return self.offload_micro_batches > 0 and (
            self.offload_layers is None or index in self.offload_layers)

    # ------------------------------------------------------------------------------ recompute

    def recompute(self) -> Recompute:
        """The recompute settings as parallel/recompute.py takes them."""
        return Recompute(self.recompute_granularity, self.recompute_method,
                         self.recompute_num_layers, tuple(self.recompute_modules or ()))

    def _check_recompute(self) -> None:
        granularity, method, layers = (self.recompute_granularity, self.recompute_method,
                                       self.recompute_num_layers)
        modules = list(self.recompute_modules or ())
        if granularity not in (None, *GRANULARITIES):
            raise ValueError(f"activations.recompute_granularity={granularity!r} must be null, "
                             "'full' or 'selective'")
        if granularity != "full" and (method is not None or layers is not None):
            raise ValueError(
                f"activations.recompute_method={method!r} / recompute_num_layers={layers!r} "
                f"apply to recompute_granularity=full only (it is {granularity!r}): set them to "
                "null or recompute_granularity=full")
        if granularity != "selective" and modules:
            raise ValueError(
                f"activations.recompute_modules={modules} apply to recompute_granularity="
                f"selective only (it is {granularity!r}): set recompute_modules=[] or "
                "recompute_granularity=selective")
        if granularity == "full":
            if method not in METHODS:
                raise ValueError(f"activations.recompute_method={method!r}: full recompute "
                                 "needs 'uniform' or 'block'")
            if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
                raise ValueError(f"activations.recompute_num_layers={layers!r}: full recompute "
                                 "needs an integer >= 1 (layers per unit, or per chunk for block)")
        if granularity == "selective":
            unknown = sorted(set(modules) - set(MODULES))
            if unknown or not modules or len(set(modules)) != len(modules):
                raise ValueError(
                    f"activations.recompute_modules={modules}: selective recompute needs a "
                    f"non-empty list without repeats of {list(MODULES)}")

    def check_recompute_for(self, mtp_steps: int, dsa_stage: str) -> None:
        """Rules that need the model and the DSA stage: megatron-core's MTP recompute takes one
        layer per unit; the DSA dense warm-up keeps nothing for backward (its forward runs
        without autograd, each indexer KL's backward at once), so recomputing is pointless."""
        if self.recompute_granularity != "full":
            return
        if mtp_steps and self.recompute_method == "uniform" and self.recompute_num_layers != 1:
            raise ValueError(
                f"activations.recompute_num_layers={self.recompute_num_layers} with "
                f"recompute_method=uniform and MTP ({mtp_steps} steps): megatron-core recomputes "
                "an MTP layer only as a unit of 1; set recompute_num_layers=1, or "
                "recompute_method=block (MTP steps then not recomputed)")
        if dsa_stage == "dense_warmup":
            raise ValueError(
                "activations.recompute_granularity=full with dsa.stage=dense_warmup: recompute "
                "is unnecessary in this stage, whose forward keeps nothing for backward (the "
                "frozen model runs without autograd, each indexer's KL runs its backward at "
                "once); set activations.recompute_granularity=null, or use dsa.stage=sparse")
