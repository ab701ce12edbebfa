"""Activation recompute on the tiny GLM-5, one CPU process, fp32: saved-for-backward bytes after
the forward (unique storages, parameters left out, as they stand after the forward) and the
forward + backward time of each recompute setting against none.

    OMP_NUM_THREADS=1 python bench/recompute.py [--seq 128] [--batch 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import warnings

import torch

from glm5_train.job_config import compose_model_config
from glm5_train.model.config import to_mcore_config
from glm5_train.model.glm5 import build_model_chunks
from parallel import mcore_compat
from parallel.layout import ParallelSizes
from parallel.process_groups import single_process_group
from parallel.recompute import Recompute

SETTINGS = {
    "none": Recompute(),
    "full uniform 1": Recompute("full", "uniform", 1),
    "full block 2": Recompute("full", "block", 2),
    "selective mla_up_proj": Recompute("selective", modules=("mla_up_proj",)),
    "selective moe_act": Recompute("selective", modules=("moe_act",)),
    "selective mla_up_proj+moe_act": Recompute("selective", modules=("mla_up_proj", "moe_act")),
}


def measure(cfg, recompute: Recompute, seq: int, batch: int, reps: int) -> tuple[int, float]:
    """(saved bytes after one forward, best forward + backward seconds of ``reps``)."""
    with single_process_group():
        mcore = to_mcore_config(cfg, ParallelSizes(), torch.float32, recompute=recompute)
        model = build_model_chunks(cfg, mcore, recompute=recompute)[0].train()
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        tokens = torch.randint(0, 258, (batch, seq), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(seq)[None].expand(batch, seq)
        saved: dict[int, torch.UntypedStorage] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved.setdefault(storage._cdata, storage)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens, positions, None, labels=tokens)
        saved_bytes = sum(s.nbytes() for s in saved.values())
        loss.sum().backward()
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            model(tokens, positions, None, labels=tokens).sum().backward()
            best = min(best, time.perf_counter() - start)
    return saved_bytes, best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mtp-steps", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    mcore_compat.install()
    cfg = dataclasses.replace(compose_model_config(["model=glm5_tiny"]),
                              mtp_num_steps=args.mtp_steps)
    layers = cfg.num_hidden_layers + args.mtp_steps
    base_bytes, base_time = measure(cfg, SETTINGS["none"], args.seq, args.batch, args.reps)
    # Timings on a shared CPU are noisy: "none" is measured again in the loop, as a check.
    print(f"tiny GLM-5, {cfg.num_hidden_layers} layers + {args.mtp_steps} MTP steps, "
          f"seq {args.seq} x batch {args.batch}, fp32 CPU")
    for name, recompute in SETTINGS.items():
        saved, seconds = measure(cfg, recompute, args.seq, args.batch, args.reps)
        print(f"{name:32s} saved {saved:>10d} B ({(saved - base_bytes) / layers:>+11.0f} B per "
              f"layer or MTP step)  fwd+bwd {seconds * 1e3:7.1f} ms  x{seconds / base_time:.2f}")


if __name__ == "__main__":
    main()
