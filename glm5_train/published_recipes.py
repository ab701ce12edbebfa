"""The published GLM-5 training recipes (slime's GLM-5 scripts, Megatron-Bridge's GLM-5.x
recipes) as Hydra overrides of this project's configs, and the same jobs on fewer GPUs with this
project's techniques: what ``tools/plan_fit.py --recipes`` plans for memory and
``tools/plan_step_time.py --table`` for time."""

from __future__ import annotations

import dataclasses

# The published recipes (``glm5_reference``-style facts: slime's GLM-5 scripts, Megatron-Bridge's
# GLM-5.x recipes) as overrides of this project's configs, and the same jobs on fewer GPUs. What
# a recipe does not publish is filled in the same way for both rows of a job and said in the
# label: bf16, AdamW with the distributed optimizer, micro-batch 1, DSA sparse stage.
GLM5_744B_JOB = ["model=glm5_744b", "dsa=sparse", "train.params_dtype=bf16",
                 "train.micro_batch_size=1", "parallel.use_distributed_optimizer=true",
                 "parallel.overlap_grad_reduce=false"]
FULL_RECOMPUTE = ["activations.recompute_granularity=full",
                  "activations.recompute_method=uniform", "activations.recompute_num_layers=1"]


def sizes(tp: int, pp: int, cp: int, ep: int, vpp: int | None = None,
          sp: bool | None = None) -> list[str]:
    """The parallel sizes as overrides (sequence parallelism with TP > 1 unless ``sp``)."""
    return [f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.pipeline_model_parallel_size={pp}",
            f"parallel.virtual_pipeline_model_parallel_size={vpp or 'null'}",
            f"parallel.context_parallel_size={cp}", f"parallel.expert_model_parallel_size={ep}",
            f"parallel.sequence_parallel={str(tp > 1 if sp is None else sp).lower()}"]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A published layout (or ours for the same job): ``dp`` data-parallel replicas."""

    name: str
    label: str
    overrides: list[str]
    dp: int


SLIME_JOB = [*GLM5_744B_JOB, "train.seq_length=32768", "train.global_batch_size=64",
             *FULL_RECOMPUTE, "activations.loss_chunk_tokens=0"]
BRIDGE_128K_JOB = [*GLM5_744B_JOB, "train.seq_length=131072", "train.global_batch_size=32",
                   *FULL_RECOMPUTE, "activations.loss_chunk_tokens=0"]
BRIDGE_200K_JOB = [*GLM5_744B_JOB, "train.seq_length=202752", "train.global_batch_size=32",
                   *FULL_RECOMPUTE, "activations.loss_chunk_tokens=0"]
OURS = ["activations.loss_chunk_tokens=2048", "parallel.mtp_placement=split"]

RECIPES = (
    Recipe("slime_256", "slime GLM-5: TP4+SP PP4 (20/20/20/18) CP2 EP32 DP8, 32K tokens (16K per "
           "GPU), full recompute, Adam state on the GPU",
           [*SLIME_JOB, *sizes(4, 4, 2, 32), "parallel.mtp_placement=with_loss",
            "parallel.pipeline_model_parallel_layout=Et*20|t*20|t*20|t*18mL"], 8),
    Recipe("slime_256_host_adam", "  as published, Adam state in host memory as slime keeps it "
           "(parallel.optimizer_cpu_offload=true)",
           [*SLIME_JOB, *sizes(4, 4, 2, 32), "parallel.mtp_placement=with_loss",
            "parallel.pipeline_model_parallel_layout=Et*20|t*20|t*20|t*18mL",
            "parallel.optimizer_cpu_offload=true"], 8),
    Recipe("slime_job_ours_256", "  same job and GPUs, Adam state on the GPU, ours: TP4+SP PP16 "
           "VPP2 CP2 EP16 DP2, MTP split, chunked loss",
           [*SLIME_JOB, *sizes(4, 16, 2, 16, vpp=2), *OURS], 2),
    Recipe("bridge_416", "Megatron-Bridge GLM-5.x 128K SFT: TP1 PP13 VPP2 CP32 EP32 DP1, MTP "
           "with the loss, full recompute assumed",
           [*BRIDGE_128K_JOB, *sizes(1, 13, 32, 32, vpp=2), "parallel.mtp_placement=with_loss"],
           1),
    Recipe("bridge_416_job_ours_256", "  same job, ours: TP2+SP PP8 VPP2 CP16 EP32 DP1, MTP "
           "split, chunked loss",
           [*BRIDGE_128K_JOB, *sizes(2, 8, 16, 32, vpp=2), *OURS], 1),
    Recipe("bridge_608", "Megatron-Bridge GLM-5.2 200K SFT: TP1 PP19 CP32 EP32 DP1, full "
           "recompute (published peak 81,005 MiB)",
           [*BRIDGE_200K_JOB, *sizes(1, 19, 32, 32), "parallel.mtp_placement=with_loss"], 1),
    Recipe("bridge_608_job_ours_256", "  same job, ours (+experiment=glm5_sft_202k): TP2+SP "
           "PP8 VPP2 CP16 EP32 DP1, MTP split, chunked loss",
           ["+experiment=glm5_sft_202k"], 1),
)


def recipe(name: str) -> Recipe:
    return next(r for r in RECIPES if r.name == name)
