"""How a run trades activation memory for compute and host traffic (config group
``activations``, ``configs/activations/``): the sequence-chunked output projection and loss,
activation offloading to host memory, and recompute. Each field says which code reads it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ActivationsConfig:
    # --- sequence-chunked output projection + cross-entropy (main head and every MTP step)
    # Tokens (sequence positions x micro-batch) per chunk; 0 computes the whole sequence at once.
    loss_chunk_tokens: int = 2048

    # --- activation offloading to host memory (parallel/activation_offload.py)
    offload_micro_batches: int = 0
    offload_layers: list[int] | None = None

    # --- recompute
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if self.loss_chunk_tokens < 0:
            raise ValueError(f"activations.loss_chunk_tokens={self.loss_chunk_tokens} must be "
                             ">= 0 (0: the whole sequence in one piece)")
