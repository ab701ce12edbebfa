"""DeepSpeed as the measured peer: the same tiny GLM-5, weights and data under DeepSpeed ZeRO-1,
-2 and -3 and under ours, 4 CPU processes (gloo) each.

    pip install -e ".[peers]"          # deepspeed 0.19.8
    python bench/peer_deepspeed.py [--steps 6]

1. Our tiny model without its MTP layer as a Hugging Face ``GlmMoeDsaForCausalLM`` (the
   config.json our export writes, transformers' random initialisation) is saved and imported
   into our checkpoint format (``tools/hf_checkpoint.py import``).
2. Ours trains from that import at DP4 with the distributed optimizer (ZeRO-1: fp32 gradients
   whole, AdamW state sharded), at DP4 with Pipeline ZeRO2 (gradients sharded too) and at
   PP2 x VPP2 x DP2 with Pipeline ZeRO2 (a layout DeepSpeed cannot run: its ZeRO-2/3 do not
   combine with its pipeline engine).
3. DeepSpeed trains the Hugging Face model itself, loaded from the same files, with ZeRO stage
   1, 2 and 3 at DP4, on our data: each rank reads the micro-batches our sampler gives its DP
   rank (``glm5_train.data.build_train_iterator``), 8 sequences per step, 2 micro-batches per
   rank (DeepSpeed's gradient accumulation).

Both sides: fp32, torch's AdamW with megatron-core's weight-decay rule (none on biases and 1-D
parameters), constant learning rate, gradients clipped at norm 1.0, 32-token sequences. So that
the two models compute the same function: 32 tokens do not exceed the indexer's top-32, so DSA
attends to every earlier key on both (the selection cannot differ), the indexer is frozen on
both (``dsa.freeze_indexer=true``: Hugging Face's indexer has no training loss), and our
router's expert-bias update is off (Hugging Face keeps the bias fixed).

Bytes per rank, counted exactly:

- ours: ``grad_buffer_bytes`` (megatron-core's fp32 gradient buffers; with ZeRO2 the slices,
  its accumulation buffers and pinned embedding copies) and ``optimizer_state_bytes``
  (AdamW's moments; with fp32 parameters the parameter is its own master) from metrics.jsonl;
- DeepSpeed: gradients at their peak during the last step's backward passes (the distinct
  storages of every live ``param.grad`` and of the optimizer's gradient partitions and reduce
  buckets, sampled after each parameter's gradient is accumulated), optimizer bytes after the
  step (the AdamW moments plus the fp32 master partition DeepSpeed keeps, a copy even of fp32
  parameters). Reduce buckets: 500,000 elements (DeepSpeed's default of 5e8 would be a 2 GB
  buffer per rank here).

The table: per rank (the largest rank) gradient, optimizer and parameter bytes, their
gradient + optimizer sum, the step time against ours at DP4 (ZeRO-1), and the losses.
Last line: ``ours=<our PP2 x VPP2 x ZeRO2 gradient + optimizer bytes per rank>
baseline=<DeepSpeed ZeRO-2's> ratio=<ours/baseline>``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

NPROC = 4
GLOBAL_BATCH, MICRO_BATCH, SEQ = 8, 1, 32
LR, MIN_LR = 1e-3, 1e-3  # constant: both sides' schedules agree without modelling warm-up
BUCKET = 500_000
# Our model as the Hugging Face one computes it (module docstring), and the training settings
# both sides share.
OUR_MODEL = ["model=glm5_tiny", "model.num_nextn_predict_layers=0", "model.mtp_num_steps=0",
             "model.moe_router_bias_update_rate=0.0", "dsa.freeze_indexer=true"]
SHARED = [f"train.global_batch_size={GLOBAL_BATCH}", f"train.micro_batch_size={MICRO_BATCH}",
          f"train.seq_length={SEQ}", "train.warmup_iters=0", f"train.lr={LR}",
          f"train.min_lr={MIN_LR}", "train.params_dtype=fp32"]
OURS = {
    "ours DP4, distributed optimizer (ZeRO-1)":
        ["parallel=single", "parallel.use_distributed_optimizer=true"],
    "ours DP4, Pipeline ZeRO2":
        ["parallel=single", "parallel.use_distributed_optimizer=true",
         "parallel.pipeline_zero2=true"],
    "ours PP2 x VPP2 x DP2, Pipeline ZeRO2":
        ["parallel=pp2_vpp2", "parallel.use_distributed_optimizer=true",
         "parallel.pipeline_zero2=true"],
}
OURS_LAST_LINE = "ours PP2 x VPP2 x DP2, Pipeline ZeRO2"
BASELINE = "DeepSpeed ZeRO-2 DP4"


# --------------------------------------------------------------------------- the driver


def _run(cmd: list[str], label: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        from job import root_cause

        log = proc.stdout + proc.stderr
        raise SystemExit(f"{label} failed (exit {proc.returncode}){root_cause(log)}:\n"
                         f"{log[-4000:]}")


def _torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", *args]


def build_hf_model(hf_dir: str, seed: int = 0) -> None:
    """Our tiny model as a Hugging Face GLM-5 (the config.json our export writes), with
    transformers' own seeded random initialisation, saved under ``hf_dir``."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from glm5_train.hf_mapping import glm5_to_hf_config
    from glm5_train.job_config import compose_job

    fields = glm5_to_hf_config(compose_job(OUR_MODEL).model, torch.float32)
    config = GlmMoeDsaConfig(**{k: v for k, v in fields.items()
                                if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    GlmMoeDsaForCausalLM(config).save_pretrained(hf_dir, safe_serialization=True)


def import_weights(root: str) -> tuple[str, str]:
    """A tiny random HF GLM-5 under ``root``/hf and its import under ``root``/imported."""
    hf_dir, imported = os.path.join(root, "hf"), os.path.join(root, "imported")
    build_hf_model(hf_dir)
    _run(_torchrun(1, "tools/hf_checkpoint.py", "import", "--hf-dir", hf_dir, "--save",
                   imported, *OUR_MODEL, "parallel=single"), "the HF import")
    return hf_dir, imported


def ours(label: str, layout: list[str], imported: str, steps: int, root: str) -> dict:
    from job import run_training

    records = run_training(NPROC, [*OUR_MODEL, *SHARED, *layout, f"train.train_iters={steps}",
                                   f"checkpoint.load={imported}", "checkpoint.save=null"],
                           os.path.join(root, re.sub(r"\W+", "_", label)), label)
    last, tokens = records[-1], GLOBAL_BATCH * SEQ
    return {"grad": max(last["grad_buffer_bytes"]),
            "optimizer": max(last["optimizer_state_bytes"]),
            "grad_opt": max(g + o for g, o in zip(last["grad_buffer_bytes"],
                                                  last["optimizer_state_bytes"])),
            "params": max(last["param_bytes"]),
            "step_s": statistics.median(tokens / r["tokens_per_s"] for r in records[1:]),
            "losses": [r["loss"] for r in records]}


def deepspeed_run(stage: int, hf_dir: str, steps: int, root: str) -> dict:
    out = os.path.join(root, f"zero{stage}.json")
    _run(_torchrun(NPROC, os.path.abspath(__file__), "--worker", "--stage", str(stage),
                   "--hf-dir", hf_dir, "--steps", str(steps), "--out", out),
         f"DeepSpeed ZeRO-{stage}")
    with open(out) as handle:
        return json.load(handle)


def print_table(rows: dict[str, dict]) -> None:
    base = rows[next(iter(OURS))]
    print(f"{'run':44s} {'grads B':>10s} {'optim B':>10s} {'grad+opt B':>11s} "
          f"{'params B':>10s} {'step time':>9s} {'first loss':>10s} {'last loss':>10s} "
          f"{'max |loss diff|':>15s}")
    for label, row in rows.items():
        diff = max(abs(a - b) for a, b in zip(row["losses"], base["losses"]))
        print(f"{label:44s} {row['grad']:10,d} {row['optimizer']:10,d} {row['grad_opt']:11,d} "
              f"{row['params']:10,d} {row['step_s'] / base['step_s']:8.2f}x "
              f"{row['losses'][0]:10.6f} {row['losses'][-1]:10.6f} {diff:15.2e}")
    print("(per rank: the largest rank; step time against the first row; loss differences "
          "against the first row, step by step)")


def drive(steps: int) -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise SystemExit("deepspeed is not installed: pip install -e '.[peers]'") from None
    with tempfile.TemporaryDirectory() as root:
        hf_dir, imported = import_weights(root)
        rows = {label: ours(label, layout, imported, steps, root)
                for label, layout in OURS.items()}
        for stage in (1, 2, 3):
            rows[f"DeepSpeed ZeRO-{stage} DP4"] = deepspeed_run(stage, hf_dir, steps, root)
    print_table(rows)
    mine, theirs = rows[OURS_LAST_LINE]["grad_opt"], rows[BASELINE]["grad_opt"]
    print(f"ours={mine} baseline={theirs} ratio={mine / theirs:.3f}")


# --------------------------------------------------------------------------- a DeepSpeed rank


def _tensors(obj, depth: int = 0, seen: set | None = None):
    """Every tensor reachable from ``obj`` through dicts, lists, tuples and plain objects with
    a ``buffer``-like attribute (DeepSpeed keeps its buckets in small holder objects)."""
    import torch

    seen = set() if seen is None else seen
    if obj is None or depth > 4 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value, depth + 1, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value, depth + 1, seen)
    elif hasattr(obj, "__dict__") and not callable(obj):
        for value in vars(obj).values():
            if isinstance(value, (torch.Tensor, dict, list, tuple)):
                yield from _tensors(value, depth + 1, seen)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    storages = {}
    for tensor in tensors:
        if tensor.numel():
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


# DeepSpeed 0.19.8's gradient holders: ZeRO-1/2 ``averaged_gradients`` (partition views),
# ``ipg_buckets`` (reduce buckets), ``grads_in_partition``; ZeRO-3 ``grad_partitions_flat_buffer``
# and the same bucket and partition names.
_GRAD_HOLDERS = ("averaged_gradients", "ipg_buckets", "grads_in_partition",
                 "grad_partitions_flat_buffer")


def _grad_bytes(engine) -> int:
    live = [p.grad for p in engine.module.parameters() if p.grad is not None]
    for name in _GRAD_HOLDERS:
        live += list(_tensors(getattr(engine.optimizer, name, None)))
    return _storage_bytes(live)


def _optimizer_bytes(engine, stage: int) -> int:
    opt = engine.optimizer
    moments = [v for state in opt.optimizer.state.values() for v in state.values()
               if getattr(v, "dim", lambda: 0)() > 0]  # not the 0-d step counters
    masters = (opt.single_partition_of_fp32_groups if stage < 3
               else opt.fp32_partitioned_groups_flat)
    return _storage_bytes([*moments, *masters])


def _param_bytes(engine, stage: int) -> int:
    if stage < 3:
        return _storage_bytes(engine.optimizer.bit16_groups_flat)
    return _storage_bytes([p.ds_tensor for p in engine.module.parameters()])


def _param_groups(model) -> list[dict]:
    """megatron-core's default weight-decay rule: none on biases and 1-D parameters."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if name.endswith(".bias") or param.dim() == 1 else decay).append(param)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def _our_batches(rank: int, world: int, steps: int):
    """This DP rank's micro-batches, as our job's sampler gives them."""
    from glm5_train.assembly import build_dataset
    from glm5_train.data import build_train_iterator
    from glm5_train.job_config import compose_job
    from glm5_train.tokenizer import build_tokenizer

    job = compose_job([*OUR_MODEL, *SHARED, f"train.train_iters={steps}"])
    dataset = build_dataset(job, build_tokenizer(job.data.tokenizer))
    return build_train_iterator(dataset, MICRO_BATCH, GLOBAL_BATCH, rank, world, 0)


def worker(stage: int, hf_dir: str, steps: int, out: str) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import GlmMoeDsaForCausalLM

    from glm5_train.job_config import compose_job

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train = compose_job([*OUR_MODEL, *SHARED]).train
    model = GlmMoeDsaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    for name, param in model.named_parameters():
        if ".indexer." in name:  # frozen on both sides (module docstring)
            param.requires_grad_(False)
    optimizer = torch.optim.AdamW(_param_groups(model), lr=LR, weight_decay=train.weight_decay,
                                  betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)
    accumulation = GLOBAL_BATCH // (MICRO_BATCH * world)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH,
              "gradient_accumulation_steps": accumulation,
              "gradient_clipping": train.clip_grad, "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET,
                                    "allgather_bucket_size": BUCKET,
                                    "stage3_prefetch_bucket_size": BUCKET}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    grad_peak = [0]

    def sample(_param):
        grad_peak[0] = max(grad_peak[0], _grad_bytes(engine))

    batches = _our_batches(rank, world, steps)
    losses, times = [], []
    for step in range(steps):
        last = step == steps - 1
        hooks = ([p.register_post_accumulate_grad_hook(sample) for p in model.parameters()
                  if p.requires_grad] if last else [])
        dist.barrier()
        start = time.perf_counter()
        total = torch.zeros(())
        for _ in range(accumulation):
            batch = next(batches)
            logits = engine(input_ids=batch["tokens"]).logits.float()
            mask = batch["loss_mask"].reshape(-1)
            per_token = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                reduction="none")
            loss = (per_token * mask).sum() / mask.sum()
            engine.backward(loss)
            if last:
                grad_peak[0] = max(grad_peak[0], _grad_bytes(engine))
            engine.step()
            total += loss.detach() / accumulation
        dist.barrier()
        times.append(time.perf_counter() - start)
        dist.all_reduce(total)
        losses.append(total.item() / world)
        for hook in hooks:
            hook.remove()
    row = torch.tensor([grad_peak[0], _optimizer_bytes(engine, stage),
                        _param_bytes(engine, stage)], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    if rank == 0:
        per_rank = torch.stack(rows).long().tolist()
        with open(out, "w") as handle:
            json.dump({"grad": max(r[0] for r in per_rank),
                       "optimizer": max(r[1] for r in per_rank),
                       "grad_opt": max(r[0] + r[1] for r in per_rank),
                       "params": max(r[2] for r in per_rank),
                       "step_s": statistics.median(times[1:]), "losses": losses}, handle)
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.stage, args.hf_dir, args.steps, args.out)
    else:
        drive(args.steps)


if __name__ == "__main__":
    main()
