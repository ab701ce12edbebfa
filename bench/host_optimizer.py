"""Optimizer state in host memory (``parallel.optimizer_cpu_offload``): which CPU AdamW kernel,
and what the offload moves and costs per training step.

    python bench/host_optimizer.py [--params 20000000] [--steps 10]

1. The CPU kernel: one AdamW step over ``--params`` fp32 elements (20 tensors) with torch's
   fused CPU kernel (``fused=True``, what megatron-core's hybrid optimizer asks for), its
   multi-tensor one (``foreach=True``), its single-tensor loop, and DeepSpeed's
   ``DeepSpeedCPUAdam`` (AdamW mode) when deepspeed is installed (the optional ``peers``
   extra; its C++ op builds on first use). Time per step and each result's largest
   difference from the fused kernel's.
2. The training step of the tiny GLM-5 (1 process, fp32, 5 steps) with the AdamW state on
   the device and in host memory (fraction 1.0): the optimizer bytes per place (measured,
   ``optimizer_state_bytes`` / ``optimizer_host_bytes``), the bytes copied per step (each
   offloaded element's gradient over and its new value back: 2 x 4 bytes in fp32) and the
   step-time ratio.

Last line: ``ours=<device optimizer bytes offloaded> baseline=<device optimizer bytes>
ratio=<ours/baseline>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from job import run_training

TENSORS = 20
TINY = ["model=glm5_tiny", "parallel=single", "train.train_iters=5", "train.warmup_iters=0",
        "train.global_batch_size=4", "train.micro_batch_size=1", "train.seq_length=256",
        "checkpoint.save=null"]


def _problem(elements: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    size = elements // TENSORS
    params = [torch.randn(size, generator=gen) for _ in range(TENSORS)]
    grads = [torch.randn(size, generator=gen) * 1e-2 for _ in range(TENSORS)]
    return params, grads


def _kernels():
    kwargs = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    kernels = {
        "torch fused": lambda p: torch.optim.AdamW(p, fused=True, **kwargs),
        "torch foreach": lambda p: torch.optim.AdamW(p, foreach=True, **kwargs),
        "torch single-tensor": lambda p: torch.optim.AdamW(p, foreach=False, **kwargs),
    }
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return kernels, "deepspeed not installed (pip install -e '.[peers]'): not measured"
    kernels["DeepSpeedCPUAdam"] = lambda p: DeepSpeedCPUAdam(p, adamw_mode=True, **kwargs)
    return kernels, None


def time_kernels(elements: int, steps: int) -> None:
    kernels, missing = _kernels()
    results = {}
    for name, build in kernels.items():
        params, grads = _problem(elements)
        params = [torch.nn.Parameter(p) for p in params]
        optimizer = build(params)
        times = []
        for step in range(steps + 1):
            for p, g in zip(params, grads):
                p.grad = g
            start = time.perf_counter()
            optimizer.step()
            if step:  # the first allocates the state
                times.append(time.perf_counter() - start)
        results[name] = (statistics.median(times), torch.cat([p.detach() for p in params]))
    fused_time, fused_values = results["torch fused"]
    print(f"AdamW step over {elements:,} fp32 elements ({TENSORS} tensors), torch threads "
          f"{torch.get_num_threads()}, median of {steps}:")
    for name, (seconds, values) in results.items():
        diff = (values - fused_values).abs().max().item()
        print(f"  {name:20s} {seconds * 1e3:8.1f} ms   {fused_time / seconds:5.2f}x fused's "
              f"speed   max |difference| from fused {diff:.2e}")
    if missing:
        print(f"  DeepSpeedCPUAdam: {missing}")


def training_step_figures() -> tuple[int, int]:
    runs = {}
    with tempfile.TemporaryDirectory() as root:
        for label, extra in (("device", []), ("host", ["parallel.optimizer_cpu_offload=true"])):
            records = run_training(1, [*TINY, *extra], os.path.join(root, label), label)
            runs[label] = records
    device, host = runs["device"][-1], runs["host"][-1]
    elements = device["param_bytes"][0] // 4
    moved = 2 * 4 * elements  # gradients host-ward, updated parameters device-ward (fp32)
    # Step time from each step's throughput (same tokens per step), the first step left out.
    ratio = (statistics.median(r["tokens_per_s"] for r in runs["device"][1:])
             / statistics.median(r["tokens_per_s"] for r in runs["host"][1:]))
    print(f"tiny GLM-5 training step ({elements:,} parameters, fp32, 1 process):")
    print(f"  device state: optimizer on the device {device['optimizer_state_bytes'][0]:,} B")
    print(f"  host state:   optimizer on the device {host['optimizer_state_bytes'][0]:,} B, "
          f"in host memory {host['optimizer_host_bytes'][0]:,} B; copied per step "
          f"{moved:,} B; step time {ratio:.2f}x the device run's")
    print(f"  losses at the last step: device {device['loss']:.6f}, host {host['loss']:.6f}")
    return host["optimizer_state_bytes"][0], device["optimizer_state_bytes"][0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=20_000_000)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    time_kernels(args.params, args.steps)
    ours, baseline = training_step_figures()
    print(f"ours={ours} baseline={baseline} ratio={ours / baseline:.3f}")


if __name__ == "__main__":
    main()
