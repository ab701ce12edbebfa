"""The RL step computed directly, for tests/test_rl_train.py (run as one torchrun process).

    torchrun --nproc-per-node 1 tests/rl_reference.py --load CKPT --template IN.jsonl \
        --planted OUT.jsonl --expected OUT.json --step S [overrides...]

Loads the checkpoint's weights into one process's model and takes step ``S``'s rollouts
(0-based; the job packs them into samples [S * GBS, (S + 1) * GBS)). Each rollout runs through
the model on its own (no packing, positions from 0, a plain causal mask) and log pi of its
response tokens comes from log_softmax of the full logits in fp64. Then:

1. plants the rollout log-probs: log pi_rollout = log pi - log K with K cycling through
   ``PLANTED_K`` token by token (some outside IcePop's band), and writes every record with
   them to ``--planted`` (the records of other steps unchanged);
2. computes the GRPO + IcePop loss from its formulas (group advantages by hand, the staleness
   filter, the mean over kept loss tokens), backpropagates it, and writes the loss, the count,
   the IcePop-masked tokens, the dropped rollouts and every parameter's gradient norm by global
   tensor name to ``--expected``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict
from dataclasses import replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import numpy  # noqa: E402
import torch  # noqa: E402

from glm5_train import known_warnings  # noqa: E402
from glm5_train.assembly import build_model  # noqa: E402
from glm5_train.checkpoint import load_checkpoint  # noqa: E402
from glm5_train.job_config import compose_job  # noqa: E402
from glm5_train.model.glm5 import apply_dsa_freezing  # noqa: E402
from glm5_train.rl.records import read_rollouts, write_rollouts  # noqa: E402
from glm5_train.rl.rollout_data import RolloutDataset, freeze_mtp  # noqa: E402
from parallel import mcore_compat, process_groups  # noqa: E402
from parallel.grad_norms import global_names  # noqa: E402

PLANTED_K = (1.0, 0.3, 1.2, 2.6, 0.9, 0.45, 1.9, 5.0, 1.05)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--load", "--template", "--planted", "--expected"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--step", type=int, required=True)
    args, overrides = parser.parse_known_args(argv)
    known_warnings.install()
    job = compose_job(overrides)
    mcore_compat.install()
    process_groups.init_distributed(job.parallel, job.train.seed)
    _, chunks = build_model(job, process_groups.groups())
    apply_dsa_freezing(chunks, job.dsa)
    freeze_mtp(chunks)
    load_checkpoint(args.load, chunks, None, None, job.model)
    model = chunks[0]
    model.train()

    rollouts = read_rollouts([args.template], vocab_size=job.model.vocab_size)
    t = job.train
    dataset = RolloutDataset(rollouts, t.seq_length, 0, t.objective, job.rl)
    step_rollouts = dataset.rollouts_of(args.step * t.global_batch_size, t.global_batch_size)
    scored = {i: response_logp(model, rollouts[i]) for i in step_rollouts}
    logps = {i: logp for i, (logp, _) in scored.items()}
    entropies = {i: entropy for i, (_, entropy) in scored.items()}
    planted = plant(rollouts, logps)
    write_rollouts(args.planted, planted)
    expected = direct_grpo(planted, step_rollouts, logps, job.rl, learner_version=args.step)
    expected["entropy"] = mean_entropy(planted, step_rollouts, entropies, job.rl, args.step)
    expected["param_grad_norms"] = grad_norms(model)
    with open(args.expected, "w") as handle:
        json.dump(expected, handle)


def response_logp(model, rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi of each response token with the graph, the predictive entropy at each of their
    positions), fp64 from the full logits."""
    ids = torch.cat([torch.as_tensor(rollout.prompt_ids), torch.as_tensor(rollout.response_ids)])
    tokens = ids.view(1, -1)
    positions = torch.arange(tokens.shape[1]).view(1, -1)
    logits = model(tokens, positions, None)  # [1, L, V]
    logp = torch.log_softmax(logits.double(), dim=-1)[0]
    prompt = len(rollout.prompt_ids)
    targets = ids[prompt:]
    at = logp[prompt - 1:-1]
    entropy = -(at.exp() * at).sum(-1).detach()
    return at.gather(-1, targets.view(-1, 1)).squeeze(-1), entropy


def plant(rollouts: list, logps: dict) -> list:
    """Every rollout, step S's with log pi_rollout = log pi - log K (K cycling)."""
    out = []
    for index, rollout in enumerate(rollouts):
        if index not in logps:
            out.append(rollout)
            continue
        n = len(rollout.response_ids)
        k = numpy.array([PLANTED_K[(index + j) % len(PLANTED_K)] for j in range(n)])
        lp = logps[index].detach().numpy() - numpy.log(k)
        out.append(replace(rollout, rollout_logprobs=numpy.minimum(lp, 0.0).astype(
            numpy.float32)))
    return out


def group_advantage(rollouts: list, index: int, eps: float) -> float:
    """(reward - group mean) / (unbiased group std + eps), over every record of the group."""
    rewards = [r.reward for r in rollouts if r.group_id == rollouts[index].group_id]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / (len(rewards) - 1))
    return (rollouts[index].reward - mean) / (std + eps)


def direct_grpo(rollouts: list, indices: list[int], logps: dict, cfg,
                learner_version: int) -> dict:
    """GRPO + IcePop written out, one update per batch (pi_old = pi_theta, detached)."""
    loss_sum = torch.zeros((), dtype=torch.float64)
    tokens = masked = dropped = 0
    for index in indices:
        r = rollouts[index]
        if cfg.max_policy_lag is not None and learner_version - r.policy_version > \
                cfg.max_policy_lag:
            dropped += 1
            continue
        logp = logps[index]
        old = logp.detach()
        rollout_lp = torch.as_tensor(r.rollout_logprobs, dtype=torch.float64)
        mask = torch.as_tensor(r.loss_mask, dtype=torch.float64)
        advantage = group_advantage(rollouts, index, cfg.advantage_eps)
        ratio = torch.exp(logp - old)
        surrogate = torch.minimum(ratio * advantage, ratio.clamp(
            1 - cfg.eps_low, 1 + cfg.eps_high) * advantage)
        k = torch.exp(old - rollout_lp)
        keep = ((k >= cfg.icepop_low) & (k <= cfg.icepop_high)).double()
        loss_sum = loss_sum - (surrogate * keep * mask).sum()
        tokens += int(mask.sum())
        masked += int(((1 - keep) * mask).sum())
    loss = loss_sum / tokens
    loss.backward()
    return {"loss": loss.item(), "tokens": tokens, "masked": masked, "dropped": dropped}


def mean_entropy(rollouts: list, indices: list[int], entropies: dict, cfg,
                 learner_version: int) -> float:
    """The policy's entropy averaged over the kept rollouts' loss tokens."""
    total = count = 0.0
    for index in indices:
        r = rollouts[index]
        if cfg.max_policy_lag is not None and learner_version - r.policy_version > \
                cfg.max_policy_lag:
            continue
        mask = torch.as_tensor(r.loss_mask, dtype=torch.float64)
        total += float((entropies[index] * mask).sum())
        count += float(mask.sum())
    return total / count


def grad_norms(model) -> dict[str, float]:
    squares: dict[str, float] = defaultdict(float)
    for param, name in global_names(model).items():
        if param.grad is not None:
            squares[name.name] += float(param.grad.double().pow(2).sum())
        elif param.requires_grad:
            squares[name.name] += 0.0
    return {name: math.sqrt(value) for name, value in squares.items()}


if __name__ == "__main__":
    main(sys.argv[1:])
