"""The (interleaved) pipeline's keys beyond megatron-core's sizes, and their rules (the
technique: parallel/pipeline_layout.py; the planner balances layouts with them)."""

from __future__ import annotations

from dataclasses import dataclass

from parallel.layout_error import LayoutError

MTP_PLACEMENTS = ("split", "with_loss")


@dataclass
class PipelineScheduleOptions:
    """``parallel.*`` keys of the (interleaved) pipeline beyond megatron-core's sizes (part of
    ParallelConfig)."""

    # Where the MTP layer goes when no layout is given and PP > 1 (the layout is then balanced
    # by the planner): "split" (GLM-5: MTP transformer on the stage before the loss stage, its
    # output head with the main one) or "with_loss" (megatron-core's).
    mtp_placement: str = "split"
    # The balancer evens out compute per stage among layouts whose ranks fit this many GiB
    # (estimated); null: no limit, memory only breaks ties.
    stage_memory_limit_gib: float | None = None
    # Interleaved schedule: consecutive micro-batches a virtual stage runs before the next
    # (megatron-core's microbatch_group_size_per_vp_stage; null: PP). Larger groups keep more
    # activations in flight but cut Pipeline ZeRO2's reduce-scatters to one per group.
    microbatch_group_size_per_vp_stage: int | None = None


def check_mtp_placement(par: PipelineScheduleOptions) -> None:
    if par.mtp_placement not in MTP_PLACEMENTS:
        raise LayoutError(f"parallel.mtp_placement={par.mtp_placement!r}: use one of "
                          f"{list(MTP_PLACEMENTS)}")


def check_interleaving(par, num_microbatches: int) -> None:
    """megatron-core's interleaved schedule (schedules.py:995 and :1007) runs micro-batches in
    groups of microbatch_group_size_per_vp_stage (PP when null, model_parallel_config.py:448):
    a group size in [PP, micro-batches per step], and a last group empty or >= PP."""
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    group = par.microbatch_group_size_per_vp_stage
    interleaved = vpp is not None and vpp > 1
    name = (f"parallel.microbatch_group_size_per_vp_stage={group}" if group is not None
            else f"the interleaved schedule's micro-batch group (PP={pp}, as "
            "microbatch_group_size_per_vp_stage=null)")
    if group is not None and not interleaved:
        raise LayoutError(f"{name} needs the interleaved schedule "
                          "(virtual_pipeline_model_parallel_size >= 2): set it to null")
    if not interleaved:
        return
    size = group or pp
    micro = ("micro-batches per step = global_batch_size / (micro_batch_size x data-parallel "
             f"size) = {num_microbatches}")
    or_group = " (or change the group size)" if group else ""
    if not pp <= size <= num_microbatches:
        raise LayoutError(f"{name} must lie in [PP={pp}, {micro}] (megatron-core's interleaved "
                          "schedule): raise train.global_batch_size or lower "
                          f"train.micro_batch_size{or_group}")
    if 0 < num_microbatches % size < pp:
        raise LayoutError(
            f"{name}: the last group would hold {num_microbatches % size} < PP={pp} "
            f"micro-batches ({micro}): make the micro-batches per step a multiple of {size}, "
            f"or leave a remainder >= {pp}{or_group}")
