"""Reinforcement learning on the training backend (GLM-5's post-training objective).

- ``records``: the rollout-record schema (jsonl / parquet), read and checked before any step;
- ``config``: the ``rl`` config group (the objective's constants, staleness, publication);
- ``objective``: GRPO + IcePop, direct double-sided importance sampling and on-policy
  distillation as per-token losses over the model's own log-probs (the LM loss's seam);
- ``rollout_data``: rollouts packed into the fixed-length micro-batches the pipeline expects;
- ``publisher``: versioned Hugging Face weights for rollout engines.

See docs/rl.md.
"""
