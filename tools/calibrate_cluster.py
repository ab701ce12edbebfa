"""Measure a cluster spec for the step-time model (``glm5_train/plan/step_time.py``) on the
machines you will train on, in place of the presets' assumed rates.

    torchrun --nnodes 2 --nproc-per-node 8 ... tools/calibrate_cluster.py --out my_cluster.yaml
    python tools/plan_step_time.py +experiment=glm5_sft_202k --cluster my_cluster.yaml

What it measures (micro-benchmarks, never the layouts the model then predicts):
- ``compute_tflops``: a square matmul's rate (bf16 on GPUs, fp32 on CPUs), timed as
  ``--sync-ms`` says (below);
- ``memory_gbs``: a large tensor copy's bytes read + written per second, timed the same way;
- ``batched_matmul_tflops``: one batched call of many small matmuls (``--bmm-shape``; the
  sparse attention's torch path runs one [heads, D] x [D, K] product per query), the same;
- ``intra_node``: bytes per second one rank sends in an all-gather among the ranks of its node
  (its bus bandwidth), in a reduce-scatter and in an all-reduce (each op's own rate: gloo
  runs a reduce-scatter as an all-reduce of the whole input), and one small all-reduce's time
  as the latency;
- ``inter_node``: the same among one rank per node (with one node: the intra-node figures,
  said in the note).

``peak_tflops`` (MFU's denominator) is ``--peak-tflops`` when given, else the measured rate.
Each figure is timed for at least ``--repeats`` calls and ``--seconds`` of wall time: on a
shared or virtual machine a few calls catch the cores at one moment (five 512-wide matmuls
gave 0.06-0.11 TFLOP/s on this 2-core machine from run to run; two seconds of them,
averaged over the ranks, 0.113-0.127).

How the compute and memory figures are timed (``--sync-ms``):
- On CPUs (default 50 ms): as a training step runs them. Every rank works in chunks of about
  ``--sync-ms``, each closed by a 4-byte all-reduce over all ranks, and the figure is the
  work done per wall second of the whole run. A step that synchronizes goes at its slowest
  rank's pace and pays for every slow moment of either core; a median of each rank's calls
  drops both. On this 2-core virtual machine one pinned core's matmul rate moves by 15-20%
  between 2-second windows, and two ranks in 20-850 ms chunks closed by an all-reduce took
  1.2-1.5x their median chunk times, averaged.
- On GPUs (default 0): each rank's median call, averaged over the ranks (kernels do not
  have a core's slow moments; the rate is the device's).

Run it with as many processes as the job will have busy cores: one process measures one
core alone (a one-process job), the link figures then are a placeholder (no link).
Rank 0 prints each figure and writes the YAML; ``--out`` is required. Exit status 0; 2 for a
bad command line.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

# --help's epilog: what a first run types
EXAMPLES = r"""Examples:
  # this machine, 2 processes (one node: inter-node figures = intra-node)
  torchrun --nproc-per-node 2 tools/calibrate_cluster.py --out runs/cluster_cpu.yaml
  # two 8-GPU nodes, H100 SXM's bf16 peak for MFU
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint $HEAD:29500 \
      tools/calibrate_cluster.py --out h100_measured.yaml --peak-tflops 989.4
  python tools/plan_step_time.py +experiment=glm5_sft_202k --cluster h100_measured.yaml
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the YAML spec to write (rank 0)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's dense peak for MFU (default: the measured matmul rate)")
    p.add_argument("--matmul-size", type=int, default=None,
                   help="square matmul side (default: 8192 on GPUs, 512 on CPUs)")
    p.add_argument("--bmm-shape", default="512,8,576,128",
                   help="the batched matmul: batch,rows,inner,cols (default 512,8,576,128: "
                        "queries, heads, GLM-5's latent width, picks)")
    p.add_argument("--message-mib", type=float, default=None,
                   help="each rank's piece of the link collectives in MiB (the all-reduce runs on "
                        "the gathered tensor, world x it; default: 256 on GPUs, 8 on CPUs)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed repetitions of each, at least (default 5)")
    p.add_argument("--seconds", type=float, default=None,
                   help="wall seconds each compute and memory figure is timed for, at least "
                        "(default: 2 on CPUs, 0.5 on GPUs)")
    p.add_argument("--sync-ms", type=float, default=None,
                   help="time the compute and memory figures as a synchronized job runs them: "
                        "chunks of about this many ms closed by an all-reduce, work per wall "
                        "second (default: 50 on CPUs; 0 on GPUs: each rank's median call)")
    args = p.parse_args(argv)
    if args.sync_ms is not None and not 0 <= args.sync_ms < math.inf:
        p.error(f"--sync-ms {args.sync_ms:g}: must be 0 (each rank's median call) or a "
                "positive chunk length in ms, e.g. --sync-ms 50")
    return args


def device_wait(device: torch.device):
    """What makes a wall-clock reading hold the work launched before it: the device's
    synchronize on CUDA, nothing on CPUs."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def timed(fn, repeats: int, device: torch.device, seconds: float = 0.0) -> float:
    """The median wall seconds of ``fn`` over at least ``repeats`` calls and ``seconds`` of
    calls, after one warm-up call."""
    wait = device_wait(device)
    fn()
    wait()
    times = []
    while len(times) < repeats or sum(times) < seconds:
        started = time.perf_counter()
        fn()
        wait()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def synchronized(fn, repeats: int, seconds: float, chunk_seconds: float,
                 device: torch.device) -> float:
    """Wall seconds per call of ``fn`` when every rank runs it in chunks of about
    ``chunk_seconds``, each closed by a 4-byte all-reduce, for at least ``repeats`` calls and
    ``seconds``: the pace of a job that synchronizes (its slowest rank's, slow moments
    included). The same figure on every rank."""
    wait = device_wait(device)
    fn()
    wait()
    started = time.perf_counter()
    for _ in range(3):
        fn()
    wait()
    one = max_over_ranks((time.perf_counter() - started) / 3, device)
    per_chunk = max(1, round(chunk_seconds / one))
    # the same count on every rank
    chunks = max(2, math.ceil(seconds / (per_chunk * one)), math.ceil(repeats / per_chunk))
    tiny = torch.ones(1, device=device)
    dist.all_reduce(tiny)
    wait()
    started = time.perf_counter()
    for _ in range(chunks):
        for _ in range(per_chunk):
            fn()
        dist.all_reduce(tiny)
    wait()
    return max_over_ranks(time.perf_counter() - started, device) / (chunks * per_chunk)


def _reduced(value: float, device: torch.device, op) -> float:
    """``value`` all-reduced over every rank with ``op``."""
    out = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(out, op=op)
    return out.item()


def max_over_ranks(value: float, device: torch.device) -> float:
    return _reduced(value, device, dist.ReduceOp.MAX)


def mean_over_ranks(value: float, device: torch.device) -> float:
    """Every rank's figure averaged: the rates the layouts' ranks see, not one core's."""
    return _reduced(value, device, dist.ReduceOp.SUM) / dist.get_world_size()


def matmul_tflops(device: torch.device, size: int, timer) -> float:
    """``timer(fn)``: the seconds one call of ``fn`` takes (``timed`` or ``synchronized``)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size ** 3 / timer(lambda: a @ b) / 1e12


def batched_matmul_tflops(device: torch.device, shape: str, timer) -> float:
    batch, rows, inner, cols = (int(x) for x in shape.split(","))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(batch, rows, inner, device=device, dtype=dtype)
    b = torch.randn(batch, inner, cols, device=device, dtype=dtype)
    flops = 2 * batch * rows * inner * cols
    return flops / timer(lambda: torch.bmm(a, b)) / 1e12


def copy_gbs(device: torch.device, nbytes: int, timer) -> float:
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / timer(lambda: dst.copy_(src)) / 1e9


def link(group, device: torch.device, nbytes: int, repeats: int) -> dict[str, float]:
    """One rank's send rate over ``group`` in an all-gather of ``nbytes`` pieces ((n - 1) x
    its piece sent), in a reduce-scatter back to those pieces (the same bytes by the meter's
    rules) and in an all-reduce of the gathered tensor (2 (n - 1) / n of it), and a 4-byte
    all-reduce's time (the latency), each the group's slowest rank's. The three rates differ
    where the backend runs the ops differently (gloo: a reduce-scatter is an all-reduce of
    the whole input)."""
    size = dist.get_world_size(group)
    piece = torch.ones(nbytes // 4, device=device)
    out = torch.empty(size * piece.numel(), device=device)
    # torch 2.13 renamed the tensor collectives; earlier releases have the old names only
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    gather = timed(lambda: all_gather(out, piece, group=group), repeats, device)
    scatter = timed(lambda: reduce_scatter(piece, out, group=group), repeats, device)
    reduce = timed(lambda: dist.all_reduce(out, group=group), repeats, device)
    tiny = torch.ones(1, device=device)
    latency = timed(lambda: dist.all_reduce(tiny, group=group), max(repeats, 20), device)
    slowest = torch.tensor([gather, scatter, reduce, latency], dtype=torch.float64,
                           device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    gather, scatter, reduce, latency = slowest.tolist()
    sent = (size - 1) * nbytes
    return {"gbs": round(sent / gather / 1e9, 3), "latency_us": round(latency * 1e6, 1),
            "reduce_scatter_gbs": round(sent / scatter / 1e9, 3),
            "all_reduce_gbs": round(2 * sent / reduce / 1e9, 3)}


def node_groups(world: int, per_node: int):
    """(this rank's node group, this rank's cross-node group or None). Every rank creates
    every group, in the same order (torch.distributed's rule)."""
    rank, mine, across = dist.get_rank(), None, None
    for node in range(world // per_node):
        ranks = list(range(node * per_node, (node + 1) * per_node))
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine = group
    if world > per_node:
        for local in range(per_node):
            ranks = list(range(local, world, per_node))
            group = dist.new_group(ranks)
            if rank in ranks:
                across = group
    return mine, across


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:  # one process: compute and memory only
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    world, per_node = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    size = args.matmul_size or (8192 if cuda else 512)
    nbytes = int((args.message_mib or (256 if cuda else 8)) * 2**20)
    seconds = args.seconds if args.seconds is not None else (0.5 if cuda else 2.0)
    sync_ms = args.sync_ms if args.sync_ms is not None else (0.0 if cuda else 50.0)
    if sync_ms > 0:
        def timer(fn):
            return synchronized(fn, args.repeats, seconds, sync_ms / 1e3, device)
    else:
        def timer(fn):
            return timed(fn, args.repeats, device, seconds)
    rate = matmul_tflops(device, size, timer)
    memory = copy_gbs(device, 16 * nbytes, timer)
    batched = batched_matmul_tflops(device, args.bmm_shape, timer)
    spec = {"compute_tflops": round(mean_over_ranks(rate, device), 3),
            "memory_gbs": round(mean_over_ranks(memory, device), 1),
            "batched_matmul_tflops": round(mean_over_ranks(batched, device), 4)}
    mine, across = node_groups(world, per_node)
    zero_link = {"gbs": 1e9, "latency_us": 0.0}  # one rank per node: no link to measure
    spec["intra_node"] = link(mine, device, nbytes, args.repeats) if per_node > 1 else zero_link
    spec["inter_node"] = (link(across, device, nbytes, args.repeats) if across is not None
                          else dict(spec["intra_node"]))
    if dist.get_rank() == 0:
        write_spec(args, spec, device, world, per_node, sync_ms)
    dist.destroy_process_group()
    return 0


def write_spec(args, spec: dict, device: torch.device, world: int, per_node: int,
               sync_ms: float) -> None:
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    nodes = world // per_node
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if world == 1:
        links = "; one process, so no link was measured (placeholder figures)"
    elif nodes == 1:
        links = "; one node, so the inter-node link is the intra-node one"
    else:
        links = ""
    note = (f"measured by tools/calibrate_cluster.py on {socket.gethostname()} at {when}: "
            f"{nodes} node(s) x {per_node} rank(s)" + links
            + (f"; compute and memory timed as a synchronized job: {sync_ms:g} ms chunks "
               "closed by an all-reduce" if sync_ms > 0 else
               "; compute and memory: each rank's median call, averaged over the ranks"))
    lines = [f"name: {os.path.splitext(os.path.basename(args.out))[0]}",
             f"device: {name}",
             f"peak_tflops: {args.peak_tflops or spec['compute_tflops']}",
             f"compute_tflops: {spec['compute_tflops']}",
             f"memory_gbs: {spec['memory_gbs']}",
             f"batched_matmul_tflops: {spec['batched_matmul_tflops']}",
             f"gpus_per_node: {per_node}"]
    for level in ("intra_node", "inter_node"):
        lines += [f"{level}:"] + [f"  {key}: {value}" for key, value in spec[level].items()]
    if device.type == "cuda":
        lines.append(f"cuda_names: [{name!r}]")
    lines.append(f"note: {note!r}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    for line in lines:
        print(line, flush=True)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
