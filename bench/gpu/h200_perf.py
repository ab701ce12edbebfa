"""GLM-5 on one H200: DSA against dense attention, and a 744B-width layer stack's MFU.

    python bench/gpu/h200_perf.py                 # one GPU, within ~9 minutes (--budget-s)
    python bench/gpu/h200_perf.py --dry-run       # CPU, tiny shapes, same code (~20 s of CPU)

(a) ``attention``: one layer's attention, forward + backward, at 16K / 32K / 64K tokens with
GLM-5's shapes (64 heads; q/k 192 + 64 RoPE, v 256; latent 512 + 64; top-k 2048; indexer
32 heads x 128), bf16, batch 1:

- ``dense``: causal SDPA (flash) over q/k/v [1, 64, S, 256] (``layers.equal_width_attention``,
  the model's dense path; the key/value up-projection is not timed).
- ``dsa_kernel``: the Triton kernels alone (``triton_sparse_mla.sparse_mla``: MQA of the 64
  absorbed heads over each query's 2048 picked latent rows, head-summed probabilities for the
  KL included), on the indexer's real picks. On the first length a few launch shapes are tried
  (``--no-sweep``: the defaults only); the fastest runs the other lengths.
- ``dsa_layer``: what DSACoreAttention runs in the sparse stage: the indexer's blockwise top-k
  (no gradient), ``absorbed_sparse_attention`` (W_UK absorption, the kernels on CUDA with their
  default launch shapes, W_UV) and the sparse-stage indexer KL with its backward;
  ``indexer_select`` is its top-k alone.

Model FLOPs of one forward + backward (3 x forward; recompute not counted), per layer:
dense 3 * 2 * H * S(S+1)/2 * (Dqk + Dv); DSA kernel 3 * 2 * H * sum_t min(K, t+1) * (D + C)
(D = 576 logit width, C = 512 value width).

(b) ``stack``: a GLM-5-shaped stack built by the project's model builder at the 744B widths
(hidden 6144, 64 heads, MLA-256 with q_lora 2048 / kv_lora 512, DSA with its indexer and KL,
the sparse stage): ``--stack-layers`` layers (the first dense, FFN 12288; the rest MoE with a
shared expert, top-8 of E routed experts, FFN 2048), embedding and the 154,880-token head with
the chunked cross-entropy, bf16, Transformer Engine's specs where TE is installed (else, or if
they fail, the local ones; the error is reported). E: as many as fit, ~45% of the device
memory for routed-expert weights and gradients (4 bytes per parameter: no optimizer), a
multiple of 8, at most 256. Timed: forward + backward of one micro-batch (batch 1) after a
warm-up; the optimizer step is not timed. FLOPs per token, written out per term in the output:
6 x (the weight-matrix parameters a token passes through: attention, indexer, dense MLP or
router + shared + 8 routed experts, output head) + attention terms (sparse MLA 6 H K_eff (D + C),
indexer scoring 2 Hi (Di + 1) (t + 1) forward only, indexer KL 6 Hi Di K_eff). MFU = FLOPs per
token x tokens/s / peak bf16 dense FLOP/s (H100 / H200: 989.4 T; B200 2250 T; ``--peak-tflops``).

Output: one line per measurement, ``summary:`` lines, the JSON (``--json``, default
``$OUT/h200_perf.json`` when ``$OUT`` is set), last line
``ours=<dsa_layer s> baseline=<dense s> ratio=<ours/baseline>`` at 32K tokens (or the longest
length measured). ``--dry-run``: CPU, Triton's interpreter for the kernels, S 128 / 256 with
8 heads and top-k 64 (GLM-5's per-head widths; fp32: the interpreter's bf16 matmul is wrong),
and the stack on ``glm5_tiny`` (bf16) at 128 tokens.
"""

from __future__ import annotations

import os
import sys

DRY_RUN = "--dry-run" in sys.argv
if DRY_RUN:  # chosen before triton is first imported (it decorates its library then)
    os.environ["TRITON_INTERPRET"] = "1"

import argparse
import json
import socket
import statistics
import time
import traceback
import types
from dataclasses import replace

import torch
import torch.distributed as dist
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from glm5_train.model import triton_sparse_mla
from glm5_train.model.config import GLM5Config, to_mcore_config
from glm5_train.model.dsa import DSAIndexer
from glm5_train.model.dsa_loss import DSATrainingConfig, sparse_indexer_kl
from glm5_train.model.glm5 import build_model_chunks, transformer_engine_available
from glm5_train.model.layers import equal_width_attention
from glm5_train.model.sparse_mla import absorbed_sparse_attention
from glm5_train.plan.param_count import layer_terms, top_terms
from parallel import mcore_compat
from parallel.layout import ParallelSizes

LATENT, ROPE, NOPE, V = 512, 64, 192, 256
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "B200": 2250.0, "GB200": 2500.0}


class Budget:
    """Seconds left of one part's share of the run."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, device: torch.device, repeats: int) -> float:
    """Median seconds of ``step()`` over ``repeats`` runs after one warm-up run (compiles,
    allocator pools); ``repeats`` 0: the one run's seconds (the dry run: the interpreter)."""
    times = []
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:] or times)


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def report(line: str) -> None:
    print(line, flush=True)


# ------------------------------------------------------------------------ (a) attention


def causal_picks_total(seq: int, topk: int) -> int:
    """sum over queries t of min(K, t + 1): the picks a causal top-k can make."""
    full = max(0, seq - topk)
    return full * topk + sum(min(topk, t + 1) for t in range(min(seq, topk)))


def attention_flops(seq: int, heads: int, topk: int) -> dict[str, float]:
    dense = 3 * 2 * heads * seq * (seq + 1) / 2 * ((NOPE + ROPE) + V)
    sparse = 3 * 2 * heads * causal_picks_total(seq, topk) * ((LATENT + ROPE) + LATENT)
    return {"dense": dense, "dsa_kernel": sparse}


class _IndexerConfig:  # the TransformerConfig fields DSAIndexer reads
    def __init__(self, hidden: int, q_lora: int, dtype: torch.dtype, device) -> None:
        self.hidden_size, self.q_lora_rank, self.params_dtype = hidden, q_lora, dtype
        self.use_cpu_initialization = device.type != "cuda"


def attention_inputs(seq: int, args, device: torch.device, dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(seq)

    def rand(*shape, std=1.0, grad=False):
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std
        return t.to(dtype).requires_grad_(grad)

    hidden, q_lora = args.hidden, args.q_lora
    indexer = DSAIndexer(_IndexerConfig(hidden, q_lora, dtype, device), args.index_heads, 128,
                         args.topk, ROPE, 1e6)
    if device.type == "cuda":
        indexer = indexer.to(device)
    return types.SimpleNamespace(
        dense=[rand(1, args.heads, seq, NOPE + ROPE, grad=True) for _ in range(2)]
        + [rand(1, args.heads, seq, V, grad=True)],
        dense_grad=rand(1, args.heads, seq, V),
        query=rand(seq, 1, args.heads, NOPE + ROPE, grad=True),
        latent_key=rand(seq, 1, 1, LATENT + ROPE, grad=True),
        weight=torch.nn.Parameter(rand(args.heads, NOPE + V, LATENT, std=0.04)),
        x=rand(seq, 1, hidden), qr=rand(seq, 1, q_lora), indexer=indexer,
        out_grad=rand(seq, 1, args.heads * V),
        q_lat=rand(1, seq, args.heads, LATENT + ROPE, grad=True),
        kv=rand(1, seq, LATENT + ROPE, grad=True),
        lat_grad=rand(1, seq, args.heads, LATENT))


def select(inp):
    with torch.no_grad():
        topk, picked = inp.indexer.select_blockwise(inp.x.transpose(0, 1), inp.qr.transpose(0, 1))
    return topk, picked > float("-inf")


def dense_step(inp, scale: float):
    q, k, v = inp.dense
    equal_width_attention(q, k, v, None, scale).backward(inp.dense_grad)


def kernel_step(inp, picks, scale: float, configs):
    out, _, _ = triton_sparse_mla.sparse_mla(inp.q_lat, inp.kv, picks, scale, LATENT,
                                             need_probs=True, configs=configs)
    out.backward(inp.lat_grad)


def layer_step(inp, scale: float, with_kl: bool):
    topk, valid = select(inp)
    out, probs = absorbed_sparse_attention(inp.query, inp.latent_key, inp.weight[:, :NOPE],
                                           inp.weight[:, NOPE:], topk, valid, scale,
                                           need_probs=True)
    loss = (out.float() * inp.out_grad.float()).sum()
    if with_kl:
        module = types.SimpleNamespace(indexer=inp.indexer, tp_group=None,
                                       _indexer_inputs=lambda x, qr: (x.transpose(0, 1),
                                                                      qr.transpose(0, 1)))
        kl, _ = sparse_indexer_kl(module, inp.x, inp.qr, topk, valid, probs)
        loss = loss + 1e-3 * kl
    loss.backward()


def launch_candidates(heads: int):
    """Launch shapes tried on the first length, the defaults first: those that compile for
    sm_90 without spilling, then larger head blocks (fewer gathers and atomics, some spills)."""
    fwd, bwd = triton_sparse_mla.default_configs(heads)
    cfg = triton_sparse_mla.BlockConfig
    fwds = [fwd, cfg(16, 64, 8, 2), cfg(32, 32, 8, 2), cfg(64, 32, 16, 2)]
    bwds = [bwd, cfg(16, 32, 8, 1), cfg(32, 16, 8, 1)]
    return list(dict.fromkeys(fwds)), list(dict.fromkeys(bwds))


def sweep_launch(inp, picks, scale, device, heads: int, budget: Budget):
    """The fastest forward and backward launch shapes (timed apart); failures skipped."""
    fwds, bwds = launch_candidates(heads)
    best_fwd, best_bwd = fwds[0], bwds[0]
    timings = []
    with torch.no_grad():
        for cfg in fwds:
            if budget.left() < 60:
                break
            try:
                s = timed(lambda cfg=cfg: triton_sparse_mla.forward(
                    inp.q_lat, inp.kv, picks, scale, LATENT, True, True, cfg), device, 2)
                timings.append(("forward", cfg, s))
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: next one
                timings.append(("forward", cfg, f"{type(exc).__name__}: {exc}"[:160]))
        out, lse, _ = triton_sparse_mla.forward(inp.q_lat, inp.kv, picks, scale, LATENT)
        for cfg in bwds:
            if budget.left() < 60:
                break
            try:
                s = timed(lambda cfg=cfg: triton_sparse_mla.backward(
                    inp.q_lat, inp.kv, picks, out, lse, inp.lat_grad, scale, True, cfg),
                    device, 2)
                timings.append(("backward", cfg, s))
            except Exception as exc:  # noqa: BLE001
                timings.append(("backward", cfg, f"{type(exc).__name__}: {exc}"[:160]))
    for kind, cfg, s in timings:
        report(f"  sweep {kind} {cfg}: " + (f"{s * 1e3:.1f} ms" if isinstance(s, float) else s))
    ok = {kind: [(s, c) for k, c, s in timings if k == kind and isinstance(s, float)]
          for kind in ("forward", "backward")}
    if ok["forward"]:
        best_fwd = min(ok["forward"], key=lambda t: t[0])[1]
    if ok["backward"]:
        best_bwd = min(ok["backward"], key=lambda t: t[0])[1]
    return (best_fwd, best_bwd), [(k, str(c), s) for k, c, s in timings]


def measure_attention(seq, args, device, dtype, budget, state, results):
    scale = (NOPE + ROPE) ** -0.5
    run = {"seq": seq}
    inp = attention_inputs(seq, args, device, dtype)
    repeats = args.repeats
    run["dense_s"] = timed(lambda: dense_step(inp, scale), device, repeats)
    run["indexer_select_s"] = timed(lambda: select(inp), device, repeats)
    picks = triton_sparse_mla.picks_from(*select(inp))
    if state.get("configs") is None and device.type == "cuda" and not args.no_sweep:
        state["configs"], run["sweep"] = sweep_launch(inp, picks, scale, device, args.heads,
                                                      budget)
    configs = state.get("configs")
    run["kernel_configs"] = str(configs or "defaults")
    run["dsa_kernel_s"] = timed(lambda: kernel_step(inp, picks, scale, configs), device,
                                repeats)
    try:
        run["dsa_layer_s"] = timed(lambda: layer_step(inp, scale, True), device, repeats)
        run["dsa_layer_has_kl"] = True
    except Exception as exc:  # noqa: BLE001 - the KL's API moves: time the rest, say so
        run["dsa_layer_kl_error"] = f"{type(exc).__name__}: {exc}"[:300]
        run["dsa_layer_s"] = timed(lambda: layer_step(inp, scale, False), device, repeats)
        run["dsa_layer_has_kl"] = False
    flops = attention_flops(seq, args.heads, args.topk)
    run["dense_tflops"] = flops["dense"] / run["dense_s"] / 1e12
    run["dsa_kernel_tflops"] = flops["dsa_kernel"] / run["dsa_kernel_s"] / 1e12
    if device.type == "cuda":
        run["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    results["attention"].append(run)
    report(f"attention seq {seq:6d}: dense {run['dense_s'] * 1e3:9.1f} ms "
           f"({run['dense_tflops']:.0f} TFLOP/s)  dsa_kernel {run['dsa_kernel_s'] * 1e3:9.1f} ms "
           f"({run['dsa_kernel_tflops']:.0f} TFLOP/s)  dsa_layer {run['dsa_layer_s'] * 1e3:9.1f}"
           f" ms (indexer_select {run['indexer_select_s'] * 1e3:.1f} ms, KL "
           f"{'in' if run['dsa_layer_has_kl'] else 'NOT in: ' + run.get('dsa_layer_kl_error', '')})"
           f"  dense/dsa_layer {run['dense_s'] / run['dsa_layer_s']:.2f}x  dense/dsa_kernel "
           f"{run['dense_s'] / run['dsa_kernel_s']:.2f}x")


def attention_part(args, device, dtype, budget: Budget, results) -> None:
    state: dict = {}
    for seq in args.seq:
        if budget.left() < 20:
            report(f"attention seq {seq}: SKIP (budget spent)")
            results["attention"].append({"seq": seq, "skipped": "budget"})
            continue
        try:
            measure_attention(seq, args, device, dtype, budget, state, results)
        except Exception as exc:  # noqa: BLE001 - one failed length must not end the rest
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            results["attention"].append({"seq": seq, "error": error})
            report(f"attention seq {seq}: FAIL {error}")
            traceback.print_exc(limit=6)
        finally:
            free_memory(device)


# ------------------------------------------------------------------------- (b) the stack


def model_config(path: str, **changes) -> GLM5Config:
    with open(path) as handle:
        values = yaml.safe_load(handle)
    return replace(GLM5Config.from_dict(values), **changes)


def experts_that_fit(cfg: GLM5Config, moe_layers: int, device: torch.device) -> int:
    """Routed experts per layer whose bf16 weights + gradients take ~45% of the device."""
    if device.type != "cuda":
        return cfg.n_routed_experts
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4  # bytes: weight + grad
    total = torch.cuda.get_device_properties(device).total_memory
    fit = int(0.45 * total // (per_expert * max(1, moe_layers)))
    return max(8, min(256, fit // 8 * 8))


def matmul_params(terms) -> int:
    return sum(t.repeat * sum(a * b for a, b in (s for s in t.shapes if len(s) == 2))
               for t in terms)


def flops_per_token(cfg: GLM5Config, seq: int) -> dict[str, float]:
    """Model FLOPs of one token's forward + backward, by term (see the module docstring)."""
    k_eff = causal_picks_total(seq, cfg.index_topk) / seq
    keys_eff = (seq + 1) / 2
    heads, hi, di = cfg.num_attention_heads, cfg.index_n_heads, cfg.index_head_dim
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    terms: dict[str, float] = {}
    for layer, moe in enumerate(cfg.moe_layer_pattern):
        per_layer = layer_terms(cfg, moe=bool(moe))
        routed = [t for t in per_layer if t.key == "routed_experts"]
        active = [t for t in per_layer if t.key != "routed_experts"] + [
            replace(t, repeat=cfg.num_experts_per_tok) for t in routed]
        terms[f"layer{layer}_{'moe' if moe else 'dense'}_matmuls"] = 6 * matmul_params(active)
        terms[f"layer{layer}_sparse_mla"] = 6 * heads * k_eff * (width + cfg.kv_lora_rank)
        terms[f"layer{layer}_indexer_scoring"] = 2 * hi * (di + 1) * keys_eff
        terms[f"layer{layer}_indexer_kl"] = 6 * hi * di * k_eff
    terms["output_head"] = 6 * matmul_params([t for t in top_terms(cfg) if t.key == "output_head"])
    return terms


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_process_groups(device: torch.device) -> None:
    """A world-size-1 default group (NCCL on CUDA) and megatron-core's parallel state."""
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)


def build_stack(cfg: GLM5Config, device, dtype, use_te: bool, grouped: bool):
    extra = {"moe_grouped_gemm": True} if grouped else {}
    config = to_mcore_config(cfg, ParallelSizes(), dtype, overrides=extra,
                             use_cpu_initialization=device.type != "cuda")
    chunks = build_model_chunks(cfg, config, use_te=use_te,
                                dsa_training=DSATrainingConfig(stage="sparse"),
                                loss_chunk_tokens=2048)
    return chunks[0].to(device).train()


def stack_step(model, tokens, positions):
    model(tokens, positions, None, labels=tokens).sum().backward()
    for p in model.parameters():
        p.grad = None


def run_stack(cfg, seq, device, dtype, variant, args):
    """(seconds per step, variant) for one build; raises what the build or a step raises."""
    model = build_stack(cfg, device, dtype, *variant)
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq), generator=gen, device=device)
    positions = torch.arange(seq, device=device)[None]
    return timed(lambda: stack_step(model, tokens, positions), device, args.repeats)


def stack_variants(device) -> list[tuple[bool, bool]]:
    """(use_te, grouped GEMM) to try in order: TE with grouped experts where TE exists."""
    if device.type == "cuda" and transformer_engine_available():
        return [(True, True), (True, False), (False, False)]
    return [(False, False)]


def stack_part(args, device, dtype, budget: Budget, results) -> None:
    base = model_config(args.stack_model)
    dense_layers = min(base.first_k_dense_replace, 1)
    cfg = replace(base, num_hidden_layers=args.stack_layers, first_k_dense_replace=dense_layers,
                  mtp_num_steps=0)
    cfg = replace(cfg, n_routed_experts=experts_that_fit(cfg, args.stack_layers - dense_layers,
                                                         device))
    cfg.validate()
    one_process_groups(device)
    peak = peak_tflops(device, args.peak_tflops)
    errors: list[str] = []
    for seq in args.stack_seq:
        if budget.left() < 30:
            report(f"stack seq {seq}: SKIP (budget spent)")
            continue
        for variant in stack_variants(device):
            try:
                seconds = run_stack(cfg, seq, device, dtype, variant, args)
            except Exception as exc:  # noqa: BLE001 - reported, next variant tried
                errors.append(f"use_te={variant[0]} grouped_gemm={variant[1]} seq={seq}: "
                              f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
                report(f"stack seq {seq}: FAIL {errors[-1]}")
                traceback.print_exc(limit=8)
                continue
            finally:
                free_memory(device)  # the model of this build is gone by now
            record_stack(cfg, seq, seconds, variant, peak, device, results)
            break
    results["stack_errors"] = errors


def record_stack(cfg, seq, seconds, variant, peak, device, results) -> None:
    terms = flops_per_token(cfg, seq)
    per_token = sum(terms.values())
    tokens_per_s = seq / seconds
    mfu = per_token * tokens_per_s / (peak * 1e12) if peak else None
    run = {"seq": seq, "layers": cfg.num_hidden_layers,
           "dense_layers": cfg.first_k_dense_replace, "experts": cfg.n_routed_experts,
           "use_te": variant[0], "grouped_gemm": variant[1], "step_s": seconds,
           "tokens_per_s": tokens_per_s, "flops_per_token": per_token,
           "flops_per_token_terms": terms, "peak_tflops": peak, "mfu": mfu}
    if device.type == "cuda":
        run["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    results["stack"].append(run)
    report(f"stack seq {seq}: {cfg.num_hidden_layers} layers ({cfg.first_k_dense_replace} dense),"
           f" {cfg.n_routed_experts} experts (top-{cfg.num_experts_per_tok}), TE {variant[0]}, "
           f"grouped GEMM {variant[1]}: {seconds * 1e3:.1f} ms per step, {tokens_per_s:.0f} "
           f"tokens/s, {per_token / 1e9:.4g} GFLOP per token, MFU "
           + (f"{mfu:.3f}" if mfu is not None else "n/a (no peak known)"))
    for name, value in terms.items():
        report(f"  flops/token {name:32s} {value / 1e9:10.4f} G")


# ---------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny shapes, Triton's interpreter: checks the script")
    parser.add_argument("--parts", nargs="+", default=["attention", "stack"],
                        choices=["attention", "stack"])
    parser.add_argument("--seq", type=int, nargs="+", default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--index-heads", type=int, default=None)
    parser.add_argument("--topk", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--stack-layers", type=int, default=4)
    parser.add_argument("--stack-seq", type=int, nargs="+", default=None)
    parser.add_argument("--stack-model", default=None, help="a configs/model/*.yaml file")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tiny = args.dry_run
    defaults = {"seq": [128, 256] if tiny else [16384, 32768, 65536],
                "heads": 8 if tiny else 64, "index_heads": 4 if tiny else 32,
                "topk": 64 if tiny else 2048, "stack_seq": [128] if tiny else [4096, 16384],
                "stack_model": os.path.join(REPO, "configs/model",
                                            "glm5_tiny.yaml" if tiny else "glm5_744b.yaml")}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.hidden, args.q_lora = (256, 128) if tiny else (6144, 2048)
    if tiny:
        args.repeats = 0  # one run each: interpreted kernels take seconds per call
    if args.json is None and os.environ.get("OUT"):
        args.json = os.path.join(os.environ["OUT"], "h200_perf.json")
    return args


def summary(results) -> None:
    runs = [r for r in results["attention"] if "dsa_layer_s" in r]
    for r in runs:
        report(f"summary: attention seq={r['seq']} dense_ms={r['dense_s'] * 1e3:.1f} "
               f"dsa_kernel_ms={r['dsa_kernel_s'] * 1e3:.1f} dsa_layer_ms="
               f"{r['dsa_layer_s'] * 1e3:.1f} dense/dsa_layer={r['dense_s'] / r['dsa_layer_s']:.3f}"
               f" dense/dsa_kernel={r['dense_s'] / r['dsa_kernel_s']:.3f}")
    for r in results["stack"]:
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.4f}"
        report(f"summary: stack seq={r['seq']} layers={r['layers']} experts={r['experts']} "
               f"te={r['use_te']} tokens_per_s={r['tokens_per_s']:.0f} "
               f"gflop_per_token={r['flops_per_token'] / 1e9:.2f} mfu={mfu}")
    at = [r for r in runs if r["seq"] == 32768] or runs[-1:]
    if at:
        r = at[0]
        report(f"ours={r['dsa_layer_s']:.4f} baseline={r['dense_s']:.4f} "
               f"ratio={r['dsa_layer_s'] / r['dense_s']:.3f}")


def main() -> int:
    args = parse_args()
    if args.dry_run:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        report("h200_perf: no CUDA device; use --dry-run for the CPU check")
        return 2
    for line in mcore_compat.version_report():  # entries never checked on this release
        report(f"h200_perf: registry: {line}")
    try:
        mcore_compat.install()
    except RuntimeError as exc:  # a stale entry on another megatron-core: said, then go on
        report(f"h200_perf: mcore_compat.install() refused: {exc}"[:400])
    # The dry run's attention is fp32: the interpreter's bf16 tl.dot is wrong (triton 3.9).
    dtypes = {"attention": torch.float32 if args.dry_run else torch.bfloat16,
              "stack": torch.bfloat16}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    report(f"h200_perf: device={name} torch={torch.__version__} triton="
           f"{getattr(triton_sparse_mla.triton, '__version__', 'absent')} te="
           f"{transformer_engine_available()} megatron-core={mcore_compat.megatron_core_version()}"
           f" heads={args.heads} index_heads={args.index_heads} topk={args.topk} "
           f"budget={args.budget_s:.0f}s")
    results = {"device": name, "args": vars(args), "attention": [], "stack": []}
    start = time.perf_counter()
    shares = {"attention": 0.55, "stack": 0.45} if len(args.parts) == 2 else {args.parts[0]: 1}
    for part in args.parts:
        left = args.budget_s - (time.perf_counter() - start)
        budget = Budget(left if part == args.parts[-1] else shares[part] * args.budget_s)
        (attention_part if part == "attention" else stack_part)(args, device, dtypes[part],
                                                                budget, results)
    results["wall_s"] = time.perf_counter() - start
    summary(results)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1, default=str)
    measured = any("dsa_layer_s" in r for r in results["attention"]) or results["stack"]
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
