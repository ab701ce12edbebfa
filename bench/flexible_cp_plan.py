"""The flexible CP planner alone (parallel/flexible_cp.py, no training): how long planning
one global batch takes, and what laying out each group's bin (step 5 of the plan: document
order and padding in front) does to the modelled imbalance, on long-tailed batches of
GLM-5's 202,752-token SFT shape.

    python bench/flexible_cp_plan.py [--cases 64x2000,256x6000] [--seed 0]

Each case ``RxN``: N conversations (log-normal lengths, median about 1,800 tokens, cut at
202,752; plus three long ones of 202,752, 150,000 and 90,000) over R data-parallel ranks
with groups of up to 16 (12,672 tokens per rank and micro-batch), top-k 2,048, a workload
model with every term set (pair 1e-7 s, selected 1e-8 s, token 3e-4 s, gathered 1e-4 s,
grouped 1e-3 s). Every rank plans every step, in Python: the seconds are what each rank
spends before each step (one core). Prints per case the plan's seconds, micro-batches and
modelled imbalance (busiest / mean rank work) with and without the layout; last line
``ours=<imbalance with the layout> baseline=<without> ratio=...`` for the largest case.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.flexible_cp import Workload, plan_batch

WINDOW, LARGEST = 202752, 16
WORKLOAD = Workload(pair=1e-7, selected=1e-8, token=3e-4, topk=2048, gathered=1e-4,
                    grouped=1e-3)


def batch(conversations: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    short = [max(1, min(WINDOW, int(rng.lognormvariate(7.5, 1.3))))
             for _ in range(conversations - 3)]
    return short + [WINDOW, 150000, 90000]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="64x2000,256x6000")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = None
    for case in args.cases.split(","):
        ranks, conversations = (int(v) for v in case.split("x"))
        lengths = batch(conversations, args.seed)
        start = time.perf_counter()
        plan = plan_batch(lengths, ranks, WINDOW // LARGEST, LARGEST, WORKLOAD)
        seconds = time.perf_counter() - start
        first = plan_batch(lengths, ranks, WINDOW // LARGEST, LARGEST, WORKLOAD,
                           even_members=False)
        print(f"{ranks} ranks, {conversations} conversations: plan {seconds:.2f} s, "
              f"{plan.num_microbatches} micro-batches, modelled imbalance "
              f"{plan.imbalance():.4f} (documents first: {first.imbalance():.4f}), "
              f"{sum(1 for b in plan.bins if b.lead)} bins with padding in front", flush=True)
        result = (plan.imbalance(), first.imbalance())
    ours, baseline = result
    print(f"ours={ours:.4f} baseline={baseline:.4f} ratio={ours / baseline:.4f}")


if __name__ == "__main__":
    main()
