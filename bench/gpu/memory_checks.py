"""gpu_check parts ``activation_offload`` and ``host_optimizer``: the two host-memory techniques
on CUDA, each run twice over the same GLM-5 layer stack in one process (with and without),
from the same parameters, on the same batches.

``activation_offload`` (parallel/activation_offload.py): on CUDA the saved tensors of each
decoder layer go to pinned host memory on the offloader's own stream and come back ahead of
their backward, ordered by CUDA events. The forwards and backwards run in the order of a
pipeline's first rank under 1F1B (``PipelineSchedule(4, None, 4)``: four forwards in flight
before the first backward, all four offloaded by ``offload_plan``), 2 steps with an SGD update
between them, so step 2's losses depend on step 1's gradients. Figures: the device peak
(``torch.cuda.max_memory_allocated``) with vs without and its ratio, the meter's saved-bytes
peak and offloaded / reloaded bytes, every step's losses and every parameter's gradient norm
(equal: values come back bit for bit; on CUDA the sparse-attention kernel's atomic adds may
change the last fp32 bits run to run, hence the tolerances below).

``host_optimizer`` (parallel/host_optimizer.py): ``HostOffloadedOptimizer`` built as
megatron-core builds its hybrid optimizer (all elements on the host, fp32 update, pinned
copies on CUDA), plain and with ``overlap_cpu_optimizer_d2h_h2d`` (side streams, one host
optimizer per parameter), against torch's AdamW on the device, 3 steps each. Figures: the
device peak with vs without, its fall against the AdamW moments' bytes (8 per element: the
fall must cover 90% of them), the optimizer state held on the device and on the host, whether
the host copies are pinned, the losses.

Dry run: glm5_tiny at 64 tokens on CPU; the device-allocator figures are CUDA only there
(the meter's and the optimizer's byte counts are measured all the same).
"""

from __future__ import annotations

import os
from dataclasses import replace

import h200_perf
import torch

from glm5_train.plan import layer_modules
from parallel.activation_accounting import SavedTensorMeter
from parallel.activation_offload import ActivationOffloader, ActivationTracker
from parallel.host_optimizer import HostOffloadedOptimizer
from parallel.pipeline_layout import PipelineSchedule, offload_plan

LOSS_RTOL = 1e-5  # fp32 losses (10x the CPU parity suite's 1e-6: CUDA atomics' ordering)
GRAD_RTOL = 1e-4  # per-parameter gradient norms, relative to max(|ref|, 1e-3 x global norm)
MOMENT_SHARE = 0.9  # the host optimizer's device fall must cover this share of the moments
PIPELINE, MICRO = 4, 4  # the emulated pipeline: its first rank's 1F1B order
ADAMW = {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}


def stack_config(dry_run: bool):
    """glm5_tiny (dry run), or a stack wide enough that activations and optimizer state are
    GiBs: hidden 1024, 16 heads, 1 dense + 3 MoE layers of 16 experts, no MTP."""
    base = h200_perf.model_config(os.path.join(h200_perf.REPO, "configs/model/glm5_tiny.yaml"))
    if dry_run:
        return replace(base, mtp_num_steps=0)
    return replace(base, hidden_size=1024, intermediate_size=4096, moe_intermediate_size=512,
                   n_routed_experts=16, num_attention_heads=16, num_key_value_heads=16,
                   q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
                   v_head_dim=64, index_n_heads=8, index_head_dim=64, index_topk=256,
                   max_position_embeddings=8192, mtp_num_steps=0)


def build(ctx, cfg):
    """The stack in fp32 with megatron-core's local specs (one process, NCCL on CUDA), and a
    copy of its parameters and buffers to start every run from."""
    cfg.validate()
    h200_perf.one_process_groups(ctx.device)
    model = h200_perf.build_stack(cfg, ctx.device, torch.float32, False, False)
    saved = [t.detach().cpu().clone() for t in (*model.parameters(), *model.buffers())]
    return model, saved


def restore(model, saved) -> None:
    with torch.no_grad():
        for tensor, value in zip((*model.parameters(), *model.buffers()), saved):
            tensor.copy_(value)
            if isinstance(tensor, torch.nn.Parameter):
                tensor.grad = None


def batches(cfg, count: int, seq: int, device) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(7)
    return [torch.randint(0, cfg.vocab_size, (1, seq), generator=gen, device=device)
            for _ in range(count)]


def forward(model, tokens):
    positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
    return model(tokens, positions, None, labels=tokens)


def grad_norms(model) -> list[float]:
    return [0.0 if p.grad is None else p.grad.double().norm().item() for p in model.parameters()]


def peak_reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


# --------------------------------------------------------------------- activation offload


def pipeline_step(model, tracker, plan, inputs, device):
    """One step in the plan's 1F1B order: (per-micro-batch mean losses, the meter's
    figures)."""
    tracker.begin_step()
    outputs, losses = {}, [0.0] * len(inputs)
    for op, _chunk, micro in plan.ops:
        if op == "F":
            with tracker.forward(model) as watch:
                outputs[micro] = watch(forward(model, inputs[micro]))
        else:
            loss = outputs.pop(micro).float().mean()
            losses[micro] = loss.item()
            loss.backward()
    return losses, tracker.end_step()


def offload_run(model, cfg, inputs, device, offload: bool) -> dict:
    """2 steps (SGD between them) with the offloader on the decoder layers or without."""
    plan = offload_plan(PipelineSchedule(PIPELINE, None, len(inputs)), 0, len(inputs))
    meter = SavedTensorMeter()
    offloader = ActivationOffloader(meter, plan, device) if offload else None
    for _, module in layer_modules(model, cfg.num_hidden_layers) if offload else []:
        offloader.attach(module)  # hooks stay on the modules: the offloaded run goes last
    tracker = ActivationTracker([model], meter, offloader)
    peak_reset(device)
    losses, figures, norms = [], [], None
    for step in range(2):
        step_losses, step_figures = pipeline_step(model, tracker, plan, inputs, device)
        losses.append(step_losses)
        figures.append(step_figures)
        if step == 0:
            norms = grad_norms(model)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-1e-2)
                    p.grad = None
    return {"losses": losses, "grad_norms": norms, "device_peak_bytes": peak_bytes(device),
            "saved_peak_bytes": max(f.peak_bytes for f in figures),
            "offloaded_bytes": sum(f.offloaded_bytes for f in figures),
            "reloaded_bytes": sum(f.reloaded_bytes for f in figures),
            "offloaded_micro_batches": len(plan.offloaded) if offload else 0}


def run_activation_offload(ctx) -> dict:
    cfg = stack_config(ctx.dry_run)
    seq = 64 if ctx.dry_run else 2048
    model, saved = build(ctx, cfg)
    inputs = batches(cfg, MICRO, seq, ctx.device)
    runs = {}
    for name, offload in (("without", False), ("with", True)):
        restore(model, saved)
        runs[name] = offload_run(model, cfg, inputs, ctx.device, offload)
    del model, saved
    result = {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "seq": seq,
              "micro_batches": MICRO, "pipeline": PIPELINE, "runs": runs}
    result.update(compare_runs(ctx, runs["without"], runs["with"]))
    for run in runs.values():
        del run["grad_norms"]  # compared above; hundreds of numbers the JSON need not carry
    with_run = runs["with"]
    if not with_run["offloaded_bytes"] or with_run["offloaded_bytes"] != \
            with_run["reloaded_bytes"]:
        ctx.problems.append(f"offloaded {with_run['offloaded_bytes']} B, reloaded "
                            f"{with_run['reloaded_bytes']} B: expected equal and > 0")
    result["saved_peak_ratio"] = with_run["saved_peak_bytes"] / runs["without"]["saved_peak_bytes"]
    device_ratio(ctx, result, runs["without"], with_run)
    return result


def compare_runs(ctx, ref: dict, got: dict) -> dict:
    """Largest relative loss difference (every step) and per-parameter gradient-norm
    difference (step 1) of ``got`` against ``ref``; over tolerance -> a problem."""
    pairs = [(a, b) for step_a, step_b in zip(ref["losses"], got["losses"])
             for a, b in zip(step_a, step_b)]
    loss_diff = max(abs(a - b) / max(abs(a), 1e-30) for a, b in pairs)
    figures = {"loss_max_rel_diff": loss_diff}
    if not loss_diff <= LOSS_RTOL:
        ctx.problems.append(f"losses differ by {loss_diff:.3e} (relative) > {LOSS_RTOL:g}")
    if ref.get("grad_norms") is not None:
        total = sum(n * n for n in ref["grad_norms"]) ** 0.5
        grad_diff = max(abs(a - b) / max(abs(a), 1e-3 * total)
                        for a, b in zip(ref["grad_norms"], got["grad_norms"]))
        figures["grad_norm_max_rel_diff"] = grad_diff
        if not grad_diff <= GRAD_RTOL:
            ctx.problems.append(f"gradient norms differ by {grad_diff:.3e} > {GRAD_RTOL:g}")
    return figures


def device_ratio(ctx, result: dict, without: dict, with_: dict) -> None:
    """The device peak with / without (CUDA); it must fall."""
    if without["device_peak_bytes"] is None:
        ctx.cuda_only("device_peak_ratio")
        return
    result["device_peak_ratio"] = with_["device_peak_bytes"] / without["device_peak_bytes"]
    result["device_peak_fall_bytes"] = without["device_peak_bytes"] - with_["device_peak_bytes"]
    if not result["device_peak_ratio"] < 1:
        ctx.problems.append(f"device peak did not fall: ratio {result['device_peak_ratio']:.3f}")


# ------------------------------------------------------------------------ host optimizer


def make_optimizer(params, on_host: bool, overlap: bool, device):
    """On the host: megatron-core's hybrid-optimizer arguments (optimizer/__init__.py with
    optimizer_cpu_offload, fraction 1.0) as this project's optim.py sets them (``overlap``:
    parallel.overlap_cpu_optimizer_d2h_h2d, one host optimizer per parameter and side streams
    for the copies); else torch's AdamW on the device, megatron-core's optimizer without TE or
    Apex."""
    if not on_host:
        return torch.optim.AdamW(params, **ADAMW)
    cuda = device.type == "cuda"
    return HostOffloadedOptimizer(
        [{"params": params}], offload_fraction=1.0, cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True, pin_cpu_grads=cuda,
        pin_cpu_params=cuda, overlap_cpu_optimizer_d2h_h2d=overlap, bias_correction=True,
        fused=True, **ADAMW)


def state_bytes(optimizer) -> dict[str, int]:
    """Bytes of optimizer state tensors per device type (the hybrid optimizer's sub-optimizers
    hold its state; torch's AdamW its own). On a CPU dry run host and device are both "cpu"."""
    inner = getattr(optimizer, "sub_optimizers", [optimizer])
    held: dict[str, int] = {}
    for opt in inner:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    held[v.device.type] = held.get(v.device.type, 0) + v.numel() * v.element_size()
    return held


def pinned_copies(optimizer) -> bool:
    """The hybrid optimizer's host copies of the parameters and their gradients are pinned
    (what its non-blocking copies need to overlap; its moments are plain host tensors)."""
    copies = [*optimizer.cpu_copys_map_gpu_param, *optimizer.cpu_copy_map_grad.values()]
    return bool(copies) and all(t.is_pinned() for t in copies)


def optimizer_run(model, inputs, device, on_host: bool, overlap: bool) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    peak_reset(device)
    optimizer = make_optimizer(params, on_host, overlap, device)
    losses = []
    for tokens in inputs:  # one micro-batch per step
        loss = forward(model, tokens).float().mean()
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    host = optimizer.host_tensors() if on_host else []
    pinned = pinned_copies(optimizer) if on_host and device.type == "cuda" else None
    return {"losses": [losses], "device_peak_bytes": peak_bytes(device),
            "state_bytes": state_bytes(optimizer), "pinned_host_copies": pinned,
            "host_bytes": sum(t.numel() * t.element_size() for t in host)}


def run_host_optimizer(ctx) -> dict:
    cfg = stack_config(ctx.dry_run)
    seq = 64 if ctx.dry_run else 512
    model, saved = build(ctx, cfg)
    elements = sum(p.numel() for p in model.parameters() if p.requires_grad)
    inputs = batches(cfg, 3, seq, ctx.device)
    runs = {}
    for name, on_host, overlap in (("device", False, False), ("host", True, False),
                                   ("host_overlap", True, True)):
        restore(model, saved)
        runs[name] = optimizer_run(model, inputs, ctx.device, on_host, overlap)
    del model, saved
    result = {"parameters": elements, "seq": seq, "steps": len(inputs), "runs": runs,
              "moment_bytes": 8 * elements}
    result.update(compare_runs(ctx, runs["device"], runs["host"]))
    overlapped = compare_runs(ctx, runs["device"], runs["host_overlap"])
    result["overlap_loss_max_rel_diff"] = overlapped["loss_max_rel_diff"]
    for name in ("host", "host_overlap"):
        left = runs[name]["state_bytes"].get("cuda", 0)
        if left:
            ctx.problems.append(f"{name}: {left} B of optimizer state left on the device with "
                                "everything offloaded")
        if not runs[name]["host_bytes"]:
            ctx.problems.append(f"{name}: nothing held in host memory")
        if ctx.device.type == "cuda" and not runs[name]["pinned_host_copies"]:
            ctx.problems.append(f"{name}: host copies not pinned on CUDA")
    if ctx.device.type != "cuda":
        ctx.cuda_only("pinned_host_copies")
    device_ratio(ctx, result, runs["device"], runs["host"])
    fall = result.get("device_peak_fall_bytes")
    if fall is not None and fall < MOMENT_SHARE * result["moment_bytes"]:
        ctx.problems.append(f"device peak fell by {fall} B, less than {MOMENT_SHARE:.0%} of "
                            f"the AdamW moments' {result['moment_bytes']} B")
    return result
