"""Teacher log-probs for on-policy distillation: rollout records scored by a checkpoint.

    torchrun --nproc-per-node N tools/teacher_logprobs.py --load TEACHER_CKPT \\
        --records IN.jsonl --out OUT.jsonl [model=... parallel=... train.seq_length=...]

``train.objective=distill`` needs ``teacher_logprobs`` (log pi_teacher of each response token)
in every record. This tool computes them from the teacher's checkpoint (``checkpoint.save`` of
a run, or ``tools/hf_checkpoint.py import``) in any layout (TP + SP, PP, VPP, EP, CP, DP) and
writes the records to OUT with that field set; every other field is as in IN (OUT's format
follows its extension, as ``write_rollouts`` does; records' free-form ``metadata`` is not kept,
as the record reader ignores it). The Hydra overrides are the teacher's job config: model,
layout, ``train.seq_length`` (each rollout must fit one sequence), ``train.micro_batch_size``
and ``train.global_batch_size`` (the sequences scored per schedule run), ``dsa``,
``train.params_dtype``.

The records are packed exactly as the trainer packs them (``RolloutDataset``: rollouts end to
end into ``train.seq_length`` sequences, each its own document, positions from 0), each
data-parallel rank scores its share of the sequences through megatron-core's forward-only
schedule, and the log-probs are the model's own chunked head (-cross-entropy per label,
``activations.loss_chunk_tokens`` tokens at a time: no [tokens, vocab] tensor). Last-stage
ranks (context-parallel shards gathered) cut each rollout's response positions out of its
sequence via the packing's placements; rank 0 gathers them and writes OUT atomically.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from functools import partial

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # runnable as `torchrun tools/teacher_logprobs.py` from anywhere
    sys.path.insert(0, REPO)

import numpy
import torch
import torch.distributed as dist
from hydra.errors import HydraException
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.utils import is_pp_last_stage

from glm5_train import checkpoint_store, known_warnings
from glm5_train.assembly import build_model, install_int4_qat
from glm5_train.checkpoint import check_model_config, load_checkpoint
from glm5_train.data import build_train_iterator
from glm5_train.job_config import compose_job
from glm5_train.plan import resolve_pipeline_layout
from glm5_train.rl.records import EXTENSIONS, Rollout, read_rollouts, write_rollouts
from glm5_train.rl.rollout_data import PAD_ID, RolloutDataset
from glm5_train.step import forward_step
from parallel import mcore_compat, process_groups
from parallel.context_parallel import context_shard, gather_sequence_no_grad
from parallel.layout import validate_layout

# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  # the tiny model's checkpoint as the teacher of rollouts.jsonl, on 4 processes
  torchrun --nproc-per-node 4 tools/teacher_logprobs.py --load outputs/<run>/checkpoints \
      --records rollouts.jsonl --out distill.jsonl model=glm5_tiny \
      parallel=tp2_pp2_vpp2_ep2 train.seq_length=64 train.global_batch_size=4
  # then train on them
  python -m launch.local +experiment=glm5_rl_tiny train.objective=distill \
      data.paths=[distill.jsonl]
"""

# What a scoring micro-batch carries: the forward's inputs (loss_mask only feeds MTP, which
# does not run here; forward_step reads it).
SCORING_KEYS = ("tokens", "labels", "position_ids", "cu_seqlens", "loss_mask")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tools/teacher_logprobs.py",
        description="Score rollout records with a teacher checkpoint: write them to --out with\n"
                    "teacher_logprobs (log pi_teacher of each response token) set, for\n"
                    "train.objective=distill. Runs under torchrun in any layout; Hydra\n"
                    "overrides after the options are the teacher's job config.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="the teacher's checkpoint directory")
    parser.add_argument("--records", required=True, help="rollout records (.jsonl / .parquet)")
    parser.add_argument("--out", required=True, help="where the scored records go (.jsonl / "
                        ".parquet, not --records)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=glm5_tiny "
                        "parallel=tp2_pp2_vpp2_ep2 train.seq_length=4096")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------- checks before work


def path_problem(records: str, out: str) -> str | None:
    """What is wrong with the input and output paths (None: nothing)."""
    if not out.endswith(EXTENSIONS):
        return f"--out {out}: name it .jsonl or .parquet (its format follows the extension)"
    if os.path.realpath(out) == os.path.realpath(records):
        return (f"--out {out} is --records: the input would be overwritten; write the scored "
                "records to another file")
    directory = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        return f"--out {out}: {directory} is not a writable directory; create it first"
    return None


def job_problem(job) -> str | None:
    """Settings this tool cannot score with (None: none)."""
    if job.activations.loss_chunk_tokens <= 0:
        return ("activations.loss_chunk_tokens=0 computes whole [tokens, vocab] logits; the "
                "teacher's log-probs come from the chunked head: set it > 0 (default 2048)")
    if job.parallel.cp_groups == "flexible":
        return ("parallel.cp_groups=flexible plans chat SFT conversations; rollouts are scored "
                "in fixed CP groups: set parallel.cp_groups=fixed")
    return None


def check_teacher_checkpoint(root: str, job) -> None:
    """``root`` holds a complete checkpoint of the job's model: the one ``load_checkpoint``
    will choose (sizes only here; every rank hashes its share of it when loading)."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"--load {root}: no such directory; give the teacher's "
                                "checkpoint.save directory (or a tools/hf_checkpoint.py import)")
    choice = checkpoint_store.choose(root, content=False)
    if choice.path is None:
        why = f" ({choice.describe()})" if choice.notes else ""
        raise FileNotFoundError(f"--load {root} holds no complete checkpoint{why}; give the "
                                "teacher's checkpoint.save directory")
    check_model_config(choice.path, job.model)  # another architecture: refused here, in a line


def check_layout(job) -> None:
    """Every layout rule checked against this world, as the training job checks it (the batch
    sizes included: each schedule run scores one train.global_batch_size of sequences); the
    pipeline layout fixed (given, or balanced as training balances it)."""
    _, world, _ = process_groups.world_from_env()
    t = job.train
    dp = validate_layout(job.parallel, job.model, world, t.global_batch_size,
                         t.micro_batch_size, t.seq_length)
    job.parallel.pipeline_model_parallel_layout = resolve_pipeline_layout(job, dp)


# ------------------------------------------------------------------------------------ scoring


class ScoringSequences(torch.utils.data.Dataset):
    """The packed sequences, then empty ones (padding only, a document of its own) up to a
    whole number of global batches, so every rank runs the same schedule; each sample holds
    only what the forward reads."""

    def __init__(self, packed: RolloutDataset, global_batch_size: int) -> None:
        self.packed, self.seq_length = packed, packed.seq_length
        batches = -(-len(packed) // global_batch_size)
        self.total = batches * global_batch_size

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, sample: int) -> dict[str, torch.Tensor]:
        if sample < len(self.packed):
            full = self.packed[sample]
            return {key: full[key] for key in SCORING_KEYS}
        s = self.seq_length
        return {"tokens": torch.full((s,), PAD_ID, dtype=torch.int64),
                "labels": torch.full((s,), PAD_ID, dtype=torch.int64),
                "position_ids": torch.arange(s, dtype=torch.int64),
                "cu_seqlens": torch.tensor([0, s], dtype=torch.int32),
                "loss_mask": torch.zeros(s, dtype=torch.float32)}


class LogprobCollector:
    """megatron-core's loss function on the last stage: keeps log pi(label) [B, S] of each
    micro-batch, in schedule order (a forward-only schedule runs micro-batch i's loss
    function before i + 1's), context-parallel shards gathered back into sequence order."""

    def __init__(self, cp_group) -> None:
        self.cp_group = cp_group
        self.rows: list[numpy.ndarray] = []

    def keep(self, output_BS: torch.Tensor):
        logp = -output_BS.detach().float()  # the model's per-token cross-entropy, negated
        shard = context_shard(self.cp_group, logp.shape[1], logp.device)
        whole = gather_sequence_no_grad(logp, shard, dim=1)
        self.rows.extend(whole.cpu().numpy())
        device = output_BS.device
        return (torch.zeros((), device=device), torch.ones((), dtype=torch.int, device=device),
                {})

    def take(self) -> list[numpy.ndarray]:
        rows, self.rows = self.rows, []
        return rows


def scoring_step(collector: LogprobCollector, cp_group, data_iterator, model):
    """The trainer's forward (``glm5_train.step.forward_step``: batch to the device, packed
    documents as document starts, this rank's context-parallel share, the model with labels),
    its per-token output kept instead of summed into a loss."""
    output, _ = forward_step(data_iterator, model, cp_group=cp_group)
    return output, collector.keep


def response_logprobs(dataset: RolloutDataset, sample: int,
                      logp_S: numpy.ndarray) -> dict[int, numpy.ndarray]:
    """Each rollout of packed sequence ``sample``: log pi of its response tokens (at the
    positions the trainer trains them, ``RolloutDataset.response_positions``). Capped at 0:
    log-sum-exp minus the label's logit can round below 0 in fp32 when the label takes all
    the mass, and the record schema holds log-probs <= 0."""
    out = {}
    for index in dataset.members[sample]:
        values = logp_S[dataset.response_positions(index)]
        out[index] = numpy.minimum(values, 0.0).astype(numpy.float32)
    return out


def load_teacher(job, checkpoint_root: str, groups) -> list[torch.nn.Module]:
    """This rank's model chunks with the teacher's weights, in eval mode.

    eval(): the values of the trainer's training-mode forward for these weights (DSA's
    training mode only attaches the indexer KL, which leaves the output's value unchanged; the
    MoE router's training-mode extras, aux / z-losses and expert-bias token counts, change
    neither routing nor outputs; GLM-5 has no dropout), without their side effects (router
    token counts, MTP reports) and deterministic whatever dropout a config sets."""
    _, chunks = build_model(job, groups)
    if job.train.int4_qat:  # the log-probs the INT4 QAT forward computes
        install_int4_qat(chunks, job.train.int4_group_size)
    load_checkpoint(checkpoint_root, chunks, None, None, job.model)
    for chunk in chunks:
        chunk.eval()
    return chunks


def score(job, checkpoint_root: str, dataset: RolloutDataset) -> dict[int, numpy.ndarray] | None:
    """Teacher log-probs of every rollout's response, by record index, on rank 0 (None on the
    other ranks): one forward-only schedule run per global batch of sequences. Collective
    over the whole world."""
    mcore_compat.install()
    process_groups.init_distributed(job.parallel, job.train.seed)
    groups = process_groups.groups()
    chunks = load_teacher(job, checkpoint_root, groups)
    t = job.train
    sequences = ScoringSequences(dataset, t.global_batch_size)
    dp_rank, dp_size = groups.dp.rank(), groups.dp.size()
    iterators = [build_train_iterator(sequences, t.micro_batch_size, t.global_batch_size,
                                      dp_rank, dp_size, 0) for _ in chunks]
    collector = LogprobCollector(groups.cp)
    schedule = get_forward_backward_func(pp_size=groups.pp.size(),
                                         vp_size=len(chunks) if len(chunks) > 1 else None)
    # One rank per sequence share reports: the last stage, TP rank 0 (TP ranks hold the same
    # values), CP rank 0 (the shards are gathered).
    reports = (is_pp_last_stage(groups.pp) and groups.tp.rank() == 0
               and groups.cp.rank() == 0)
    per_rank = t.global_batch_size // dp_size
    scored: dict[int, numpy.ndarray] = {}
    for batch in range(len(sequences) // t.global_batch_size):
        with torch.no_grad():
            schedule(forward_step_func=partial(scoring_step, collector, groups.cp),
                     data_iterator=iterators if len(chunks) > 1 else iterators[0],
                     model=chunks if len(chunks) > 1 else chunks[0],
                     num_microbatches=per_rank // t.micro_batch_size,
                     seq_length=t.seq_length, micro_batch_size=t.micro_batch_size,
                     forward_only=True)
        rows = collector.take()
        first = batch * t.global_batch_size + dp_rank * per_rank  # as MicroBatchSampler
        mine = this_ranks_rollouts(dataset, first, rows, per_rank) if reports else {}
        scored.update(gather_to_first(mine))
    return scored if dist.get_rank() == 0 else None


def this_ranks_rollouts(dataset: RolloutDataset, first: int, rows: list[numpy.ndarray],
                        per_rank: int) -> dict[int, numpy.ndarray]:
    """The response log-probs of the rollouts in this rank's sequences ``first``, ``first +
    1``, ... (``rows``: their log-probs in that order; padding sequences hold none)."""
    if len(rows) != per_rank:
        raise RuntimeError(f"the schedule gave {len(rows)} sequences' log-probs, expected "
                           f"{per_rank}")
    mine: dict[int, numpy.ndarray] = {}
    for sample, logp_S in enumerate(rows, start=first):
        if sample < len(dataset):
            mine.update(response_logprobs(dataset, sample, logp_S))
    return mine


def gather_to_first(mine: dict[int, numpy.ndarray]) -> dict[int, numpy.ndarray]:
    """Every rank's share merged on rank 0 (one global batch at a time: bounded messages);
    an empty dict elsewhere."""
    shares = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, shares, dst=0)
    return {k: v for share in shares or [] for k, v in share.items()}


def with_teacher(rollouts: list[Rollout], scored: dict[int, numpy.ndarray]) -> list[Rollout]:
    """The records with ``teacher_logprobs`` set, everything else as read."""
    out = []
    for index, rollout in enumerate(rollouts):
        values = scored.get(index)
        if values is None:
            raise RuntimeError(f"{rollout.where}: no teacher log-probs came back for this "
                               "record (a scoring rank missed its sequence)")
        if not numpy.isfinite(values).all():
            raise ValueError(f"{rollout.where}: the teacher's log-probs are not finite: its "
                             "weights (or train.params_dtype) overflow; check the checkpoint")
        out.append(dataclasses.replace(rollout, teacher_logprobs=values))
    return out


# ------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> str | None:
    """Checks (one line each, on every rank alike, before any process group), scoring, and
    rank 0's write. Returns rank 0's summary line (None on other ranks)."""
    problem = path_problem(args.records, args.out)
    if problem is not None:
        raise ValueError(problem)
    job = compose_job(list(args.overrides))
    problem = job_problem(job)
    if problem is not None:
        raise ValueError(problem)
    # The MTP layers are loaded (the checkpoint holds them) but never run: the teacher's
    # log-probs are the main head's.
    job.model = dataclasses.replace(job.model, mtp_loss_weight=0.0)
    check_teacher_checkpoint(args.load, job)
    check_layout(job)
    rollouts = read_rollouts([args.records], vocab_size=job.model.vocab_size)
    if not rollouts:
        raise ValueError(f"--records {args.records} holds no records: nothing to score")
    dataset = RolloutDataset(rollouts, job.train.seq_length, PAD_ID, None, None)
    scored = score(job, args.load, dataset)
    if scored is None:
        return None
    write_rollouts(args.out, with_teacher(rollouts, scored))
    tokens = sum(len(r.response_ids) for r in rollouts)
    return (f"wrote {args.out}: {len(rollouts)} records, {tokens} response tokens scored in "
            f"{len(dataset)} sequences of {job.train.seq_length}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    known_warnings.install()
    try:
        summary = run(args)
    except (ValueError, TypeError, FileNotFoundError, HydraException) as err:
        if _rank() == 0:
            print(f"teacher_logprobs: error: {' '.join(str(err).splitlines())}",
                  file=sys.stderr, flush=True)
        return 1
    if summary is not None:
        print(f"teacher_logprobs: {summary}", flush=True)
    if dist.is_initialized():
        dist.barrier()
    process_groups.destroy_distributed()
    return 0


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
