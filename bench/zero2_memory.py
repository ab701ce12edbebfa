"""Pipeline ZeRO2: persistent gradient bytes per rank against plain megatron-core DDP.

    python bench/zero2_memory.py [--micro 2 8] [--dp 4 --pp 2 --vpp 8 --layers 16] [--ep 4]

Runs the real training job (tiny GLM-5 with ``--layers`` layers, MTP off, fp32, 8 CPU processes
by default: PP2 x VPP8 x DP4, one layer per virtual stage) three ways: plain DDP, megatron-core's
distributed optimizer (ZeRO-1) and Pipeline ZeRO2 (``parallel.pipeline_zero2=true``), and reads
from ``metrics.jsonl`` the exact per-rank bytes counted from the tensors
(``parallel/comm_meter.py``): gradient storage held between steps and gradient bytes sent per
step. Bytes are counted, not timed, so 8 processes on 2 cores are fine.

Theory for a rank holding gradients G over v virtual stages: G/dp (its slices) + 2G/v (two
accumulation buffers, each one chunk). Uneven chunks (the embedding and head share a chunk with
a layer) make the real buffers 2 x the largest chunk: printed as the layout's bound. With
``--ep`` equal to ``--dp`` every expert has one data-parallel rank: its gradients accumulate in
place, whole, and the accumulation buffers hold the dense gradients only (the theory line then
counts G as the dense gradients and adds the experts' whole).

Cost: the interleaved backward runs a chunk for a group of PP consecutive micro-batches, so with
M micro-batches per rank each chunk is reduce-scattered M/PP times per step instead of once:
the first ``--micro`` value is the cheapest (M = PP), the others show the cost growing, and
what ``parallel.microbatch_group_size_per_vp_stage=M`` (one group per chunk, at the price of
more activations in flight) brings it back to.
Last line: ``ours=<bytes> baseline=<bytes> theory=<bytes> ratio=<ours/baseline>`` with the
largest rank's gradient bytes, ZeRO2 (ours) against plain DDP (baseline).
"""

from __future__ import annotations

import argparse
import os
import tempfile

from job import run_training

MODES = {
    "ddp": ["parallel.use_distributed_optimizer=false"],
    "zero1": ["parallel.use_distributed_optimizer=true"],
    "zero2": ["parallel.use_distributed_optimizer=true", "parallel.pipeline_zero2=true"],
}


def run(mode: str, args, micro: int, run_dir: str, group: int | None = None) -> dict:
    """The last step's metrics record of one job (``group``: micro-batches per virtual stage
    group, megatron-core's microbatch_group_size_per_vp_stage; None: PP)."""
    overrides = job_overrides(mode, args, micro, group)
    return run_training(args.pp * args.dp, overrides, run_dir, mode)[-1]


def job_overrides(mode: str, args, micro: int, group: int | None = None) -> list[str]:
    return [
        "model=glm5_tiny", "model.mtp_num_steps=0", f"model.num_hidden_layers={args.layers}",
        "parallel=single", f"parallel.pipeline_model_parallel_size={args.pp}",
        f"parallel.expert_model_parallel_size={args.ep}",
        f"parallel.virtual_pipeline_model_parallel_size={args.vpp}",
        f"train.train_iters={args.steps}", "train.warmup_iters=1", "train.micro_batch_size=1",
        f"train.global_batch_size={micro * args.dp}", f"train.seq_length={args.seq}",
        "checkpoint.save=null", *MODES[mode],
        *([f"parallel.microbatch_group_size_per_vp_stage={group}"] if group else [])]


def in_place_expert_bytes(args, pipeline_rank: int) -> int:
    """The planner's fp32 expert gradient bytes on one rank of ``pipeline_rank`` when they
    accumulate in place (every expert has one data-parallel rank: ``--ep`` = ``--dp``), else 0."""
    if args.ep != args.dp:
        return 0
    from glm5_train.job_config import compose_job
    from glm5_train.plan import job_plan

    report = job_plan(compose_job(job_overrides("zero2", args, args.micro[0])), args.dp)
    return 4 * sum(s.costs.expert_params for s in report.stages if s.rank == pipeline_rank)


def grad_sent(record: dict) -> list[int]:
    """Per rank: bytes sent by gradient reductions over the data-parallel group (the
    all-reduce of plain DDP, the reduce-scatters of ZeRO-1/2; loss and token-count scalars,
    a few hundred bytes, excluded by taking only ops with >= 1 KiB)."""
    ranks = len(record["grad_buffer_bytes"])
    out = [0] * ranks
    for key, entry in record["comm_by_op"].items():
        op, size = key.split(":")
        if op in ("all_reduce", "reduce_scatter") and int(size) > 1:
            for r in range(ranks):
                if entry["bytes"][r] >= 1024:
                    out[r] += entry["bytes"][r]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--vpp", type=int, default=8)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size (= --dp: the experts' gradients accumulate in place)")
    p.add_argument("--micro", type=int, nargs="+", default=[2, 8],
                   help="micro-batches per rank per step (first: the memory comparison)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        first = args.micro[0]
        rec = {mode: run(mode, args, first, os.path.join(tmp, f"{mode}_{first}"))
               for mode in MODES}
        extra = {m: {**{mode: run(mode, args, m, os.path.join(tmp, f"{mode}_{m}"))
                        for mode in ("zero1", "zero2")},
                     "zero2_grouped": run("zero2", args, m, os.path.join(tmp, f"grouped_{m}"),
                                          group=m)}
                 for m in args.micro[1:]}
    ranks = args.pp * args.dp
    print(f"layout: PP{args.pp} x VPP{args.vpp} x DP{args.dp} ({ranks} processes), "
          f"{args.layers} layers (tiny GLM-5, MTP off), fp32 gradients")
    print("persistent gradient bytes per rank:")
    for mode, label in (("ddp", "plain DDP"), ("zero1", "distributed optimizer (ZeRO-1)"),
                        ("zero2", "Pipeline ZeRO2")):
        print(f"  {label:32s} {rec[mode]['grad_buffer_bytes']}")
    z = rec["zero2"]
    for part in ("slice", "accum", "pinned"):
        print(f"  ZeRO2 {part:26s} {z[f'zero2_{part}_bytes']}")
    worst = max(range(ranks), key=lambda r: rec["ddp"]["grad_buffer_bytes"][r])
    full = rec["ddp"]["grad_buffer_bytes"][worst]
    ours = max(z["grad_buffer_bytes"])
    experts = in_place_expert_bytes(args, worst // args.dp)
    dense = full - experts
    theory = dense // args.dp + 2 * dense // args.vpp + experts
    bound = dense // args.dp + z["zero2_accum_bytes"][worst] + experts
    if experts:
        print(f"largest rank {worst}: G={full}, of it experts E={experts} (in place)  theory "
              f"(G-E)/dp + 2(G-E)/v + E = {theory}  layout bound (G-E)/dp + 2 x largest "
              f"chunk's dense + E = {bound}")
    else:
        print(f"largest rank {worst}: G={full}  theory G/dp + 2G/v = {theory}  layout bound "
              f"G/dp + 2 x largest chunk = {bound}")
    print(f"gradient bytes sent per step per rank (M={first} micro-batches per rank):")
    for mode in MODES:
        print(f"  {mode:6s} {grad_sent(rec[mode])}")
    for m, runs in extra.items():
        zero1, zero2 = grad_sent(runs["zero1"]), grad_sent(runs["zero2"])
        grouped = grad_sent(runs["zero2_grouped"])
        print(f"gradient bytes sent per step per rank (M={m}): zero1 {zero1} zero2 {zero2} "
              f"(x{zero2[worst] / zero1[worst]:.2f}, expected M/PP = {m / args.pp:g})")
        print(f"  zero2 with parallel.microbatch_group_size_per_vp_stage={m} (one group per "
              f"chunk, more activations in flight): {grouped} "
              f"(x{grouped[worst] / zero1[worst]:.2f})")
        losses = {name: record["loss"] for name, record in runs.items()}
        spread = max(losses.values()) - min(losses.values())
        print(f"  last-step loss {losses} (largest relative difference "
              f"{spread / losses['zero1']:.1e}: same training)")
    baseline = max(rec["ddp"]["grad_buffer_bytes"])
    print(f"ours={ours} baseline={baseline} theory={theory} ratio={ours / baseline:.4f}")


if __name__ == "__main__":
    main()
