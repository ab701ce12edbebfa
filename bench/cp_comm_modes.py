"""Context parallelism's two exchanges at GLM-5's shapes: bytes per rank per DSA layer and per
level (inside a node / across nodes), all-gather mode vs head-parallel mode (flat and two-level
all-to-all), for CP 8, 16 and 32 and several sequence lengths.

    python bench/cp_comm_modes.py [--node-size 8] [--seqs 32768 131072 202752] [--no-check]

Figures come from ``glm5_train.model.head_parallel_cp.layer_transfers`` (every collective a CP
rank calls per layer application, forward and backward) and
``parallel.hierarchical_all_to_all.level_bytes`` (bytes sent per level). First, in the same run,
that formula is checked against the communication meter at small scale: the real training job
(tiny GLM-5, fp32, CP4 on 4 CPU processes, 1 step) in the all-gather mode, the head-parallel
mode with a flat all-to-all, and with a two-level one on nodes of 2 ranks; every CP-group
collective's bytes per rank must equal the formula (else the bench stops).

Shapes (``configs/model/glm5_744b.yaml``): 64 heads (TP1: what Megatron-Bridge's 200K recipe
runs), query 192 + 64 per head as the all-to-all moves it (before absorption), output 256 per
head (after W_UV), latent key 512 + 64, indexer key 128, top-k 2048; bf16 activations, int32
selection, fp32 pick probabilities; one sequence per micro-batch; nodes of ``--node-size``
ranks holding consecutive CP ranks (CP inner-most after TP1). Levels: all-to-alls are direct
sends (exact per level); the all-gathers and reduce-scatters run flat over the CP group and are
split by the ring model (``level_bytes``: the per-rank average over a ring whose M node
crossings carry M / c of its bytes). Stages: ``sparse`` (GLM-5's sparse training: the indexer
trained by its KL, everything with a backward) and ``dense_warmup`` (only the indexer trains).

Last line: ``ours=<bytes of the best mode at CP32> baseline=<all-gather mode at CP32> ratio=``
per rank per layer, sparse stage, at the longest sequence.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from job import run_training

from glm5_train.job_config import compose_job
from glm5_train.model.head_parallel_cp import (
    AttentionShape,
    AttentionWork,
    Links,
    choose_exchange,
    layer_transfers,
    meter_bytes,
)
from parallel.hierarchical_all_to_all import DEFAULT_PIECES, level_bytes

GLM5 = AttentionShape(heads=64, query=192 + 64, value=256, latent=512 + 64, index_key=128,
                      topk=2048)
CPS = (8, 16, 32)
MODES = {  # name -> (cp_comm, two-level all-to-all)
    "all_gather": ("all_gather", False),
    "head_parallel_flat": ("head_parallel", False),
    "head_parallel_2level": ("head_parallel", True),
}

# ------------------------------------------------------------- the meter check, small scale

CHECK_CP, CHECK_NODE, CHECK_SEQ, CHECK_BATCH = 4, 2, 64, 4
CHECK_RUNS = {  # name -> (overrides, cp_comm, node size)
    "all_gather": ([], "all_gather", None),
    "head_parallel_flat": (["parallel.cp_comm=head_parallel"], "head_parallel", None),
    "head_parallel_2level": (["parallel.cp_comm=head_parallel",
                              f"parallel.cp_node_size={CHECK_NODE}"], "head_parallel",
                             CHECK_NODE),
    # dsa=dense: query, key and value cross in one all-to-all, no latent gathered
    "head_parallel_dense": (["parallel.cp_comm=head_parallel",
                             f"parallel.cp_node_size={CHECK_NODE}", "dsa=dense"],
                            "head_parallel", CHECK_NODE),
}


def check_against_meter(tmp: str) -> None:
    """Run the tiny job in each mode; every CP-group collective's bytes per rank = formula."""
    for name, (extra, comm, node) in CHECK_RUNS.items():
        overrides = ["model=glm5_tiny", "parallel=single",
                     f"parallel.context_parallel_size={CHECK_CP}", "train.train_iters=1",
                     "train.warmup_iters=0", f"train.global_batch_size={CHECK_BATCH}",
                     "train.micro_batch_size=1",
                     f"train.seq_length={CHECK_SEQ}", "checkpoint.save=null",
                     "checkpoint.load=null", *extra]
        record = run_training(CHECK_CP, overrides, os.path.join(tmp, name), name)[0]
        job = compose_job(overrides)
        model = job.model
        transfers = layer_transfers(AttentionShape.of(model), CHECK_SEQ, CHECK_CP, comm,
                                    job.dsa.stage, act_bytes=4)
        times = (model.num_hidden_layers + model.mtp_num_steps) * CHECK_BATCH
        want = {k: v * times for k, v in meter_bytes(transfers, CHECK_CP, node).items()}
        # MTP's targets: token ids, loss mask, labels gathered once per micro-batch.
        want[f"all_gather:{CHECK_CP}"] = want.get(f"all_gather:{CHECK_CP}", 0) + ((CHECK_CP - 1) * (CHECK_SEQ // CHECK_CP) * (8 + 4 + 8)
                                           * CHECK_BATCH)
        for key, total in want.items():
            got = record["comm_by_op"].get(key, {}).get("bytes")
            if got != [total] * CHECK_CP:
                raise SystemExit(f"meter check failed ({name}): {key} {got} bytes per rank, "
                                 f"the formula gives {total}")
        shown = ", ".join(f"{k} {v}" for k, v in sorted(want.items()))
        print(f"meter check {name:21s} CP{CHECK_CP} nodes of {node or CHECK_CP}: per rank per "
              f"step {shown}: equal")


# --------------------------------------------------------------------- GLM-5's shapes


def per_layer(mode: str, stage: str, seq: int, cp: int, node_size: int) -> dict:
    """Bytes one rank sends per layer application: intra / inter / total, and the inter-node
    all-to-all messages (count, bytes each) of the query exchange."""
    comm, two_level = MODES[mode]
    per_node = min(node_size, cp)
    transfers = layer_transfers(GLM5, seq, cp, comm, stage, act_bytes=2)
    intra = inter = 0.0
    for t in transfers:
        levels = level_bytes(t.op, t.payload, cp, per_node,
                             two_level and t.op == "all_to_all" and per_node < cp)
        intra += levels["intra"]
        inter += levels["inter"]
    query = next((t.payload for t in transfers if t.what == "query to head shards"), 0)
    nodes = cp // per_node
    if not query:
        messages = (0, 0)
    elif two_level:  # M - 1 peers per piece, L rows of E / c each
        messages = ((nodes - 1) * DEFAULT_PIECES, query * per_node // cp // DEFAULT_PIECES)
    else:
        messages = (cp - per_node, query // cp)
    return {"intra": intra, "inter": inter, "total": intra + inter, "messages": messages}


def mib(value: float) -> str:
    return f"{value / 2 ** 20:9.1f}"


def table(stage: str, seqs: list[int], node_size: int) -> dict:
    print(f"\nstage={stage}: MiB sent per rank per layer (one sequence), nodes of {node_size}")
    print(f"{'cp':>3s} {'seq':>7s} {'mode':22s} {'intra':>9s} {'inter':>9s} {'total':>9s}  "
          "query a2a inter-node messages")
    results = {}
    for cp in CPS:
        for seq in seqs:
            for mode in MODES:
                got = per_layer(mode, stage, seq, cp, node_size)
                results[(cp, seq, mode)] = got
                count, size = got["messages"]
                note = f"{count} x {size / 2 ** 20:.2f} MiB" if count else "-"
                print(f"{cp:3d} {seq:7d} {mode:22s} {mib(got['intra'])} {mib(got['inter'])} "
                      f"{mib(got['total'])}  {note}")
    return results


def winners(results: dict, stage: str) -> None:
    """Which mode sends the fewest bytes (in total, and across nodes) at each CP and length."""
    for level in ("total", "inter"):
        best = {}
        for cp, seq in {(cp, seq) for cp, seq, _ in results}:
            least = min(results[(cp, seq, mode)][level] for mode in MODES)
            tied = [mode for mode in MODES if results[(cp, seq, mode)][level] == least]
            best[(cp, seq)] = ("all tie" if len(tied) == len(MODES) else "/".join(tied), least)
        ratios = [results[(cp, seq, "head_parallel_flat")][level]
                  / results[(cp, seq, "all_gather")][level]
                  for cp, seq in best if results[(cp, seq, "all_gather")][level] > 0]
        span = (f" (head-parallel flat / all-gather {min(ratios):.2f}..{max(ratios):.2f}x)"
                if ratios else "")
        by_cp = {cp: sorted({m for (c, _), (m, _) in best.items() if c == cp}) for cp in CPS}
        where = "; ".join(f"CP{cp} {', '.join(modes)}" for cp, modes in by_cp.items())
        print(f"stage={stage} fewest {level} bytes, every length: {where}{span}")


def breakdown(stage: str, seq: int, cp: int, node_size: int) -> None:
    """Each collective of the head-parallel mode (two-level) at one point, per level."""
    per_node = min(node_size, cp)
    print(f"\nstage={stage} CP{cp} {seq} tokens, head-parallel two-level: MiB per rank per "
          "layer by collective (intra / inter)")
    for t in layer_transfers(GLM5, seq, cp, "head_parallel", stage, act_bytes=2):
        levels = level_bytes(t.op, t.payload, cp, per_node,
                             t.op == "all_to_all" and per_node < cp)
        print(f"  {t.what:36s} {t.op:15s} {mib(levels['intra'])} / {mib(levels['inter'])}")


def auto_choices(seqs: list[int], node_size: int) -> None:
    """What parallel.cp_comm=auto picks for a group (choose_exchange: bytes per level at H100
    links, 450 GB/s in a node, 50 across), per TP (heads per rank), stage and CP size; the
    head-parallel / all-gather time ratio of the closest case."""
    links = Links(450e9, 50e9)
    print(f"\nparallel.cp_comm=auto at GLM-5's shapes (nodes of {node_size}, lengths "
          f"{', '.join(map(str, seqs))}):")
    for tp in (1, 8):
        shape = dataclasses.replace(GLM5, heads=GLM5.heads // tp)
        for stage in ("sparse", "dense_warmup", "dense"):
            work = AttentionWork(shape, stage, True, 2, documents=False)
            picks, closest = {}, float("inf")
            for cp in (2, 4, 8, 16, 32, 64):
                if shape.heads % cp:
                    picks[cp] = "all_gather (heads do not split)"
                    continue
                modes = set()
                for seq in seqs:
                    mode, costs = choose_exchange(work, seq, list(range(cp)), node_size, links)
                    modes.add(mode)
                    closest = min(closest, costs["head_parallel"].seconds
                                  / costs["all_gather"].seconds)
                picks[cp] = "/".join(sorted(modes))
            shown = ", ".join(f"CP{cp} {mode}" for cp, mode in picks.items())
            print(f"  TP{tp} ({shape.heads} heads) {stage:12s}: {shown}; head-parallel takes "
                  f">= {closest:.2f}x all-gather's time")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--node-size", type=int, default=8)
    p.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072, 202752])
    p.add_argument("--no-check", action="store_true", help="skip the meter check")
    args = p.parse_args()
    if not args.no_check:
        with tempfile.TemporaryDirectory() as tmp:
            check_against_meter(tmp)
    sparse = table("sparse", args.seqs, args.node_size)
    warmup = table("dense_warmup", args.seqs, args.node_size)
    dense = table("dense", args.seqs, args.node_size)
    breakdown("sparse", max(args.seqs), 32, args.node_size)
    breakdown("dense", max(args.seqs), 32, args.node_size)
    print()
    winners(sparse, "sparse")
    winners(warmup, "dense_warmup")
    winners(dense, "dense")
    auto_choices(args.seqs, args.node_size)
    longest = max(args.seqs)
    at32 = {mode: sparse[(32, longest, mode)]["total"] for mode in MODES}
    best = min(at32, key=at32.get)
    print(f"best at CP32, {longest} tokens, sparse stage: {best}")
    print(f"ours={round(at32[best])} baseline={round(at32['all_gather'])} "
          f"ratio={at32[best] / at32['all_gather']:.4f}")


if __name__ == "__main__":
    main()
