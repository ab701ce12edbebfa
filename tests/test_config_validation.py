"""Bad layouts and configs fail before any process group exists, naming value, rule and fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from glm5_train.model.config import GLM5Config
from glm5_train.job_config import compose_job
from launch.local import nproc_for
from parallel.layout import LayoutError, ParallelConfig, validate_layout
from tests.parity import REPO

TINY = dict(vocab_size=320, hidden_size=128, num_hidden_layers=4, first_k_dense_replace=1,
            intermediate_size=256, moe_intermediate_size=64, n_routed_experts=8,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
            kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            index_n_heads=4, index_head_dim=32, mtp_num_steps=0)  # MTP: see the tests below


def check(par: ParallelConfig, world: int, gbs: int = 8, mbs: int = 1, seq: int = 64,
          **model):
    return validate_layout(par, GLM5Config(**{**TINY, **model}), world, gbs, mbs, seq)


@pytest.mark.parametrize("par,world,fragment", [
    (ParallelConfig(tensor_model_parallel_size=3), 3, "num_attention_heads=4 is not divisible"),
    (ParallelConfig(pipeline_model_parallel_size=3), 3, "num_hidden_layers=4 cannot be placed"),
    (ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4), 2,
     "pipeline x virtual stages = 2 x 4 = 8"),
    (ParallelConfig(expert_model_parallel_size=3), 3, "n_routed_experts=8 is not divisible"),
    (ParallelConfig(tensor_model_parallel_size=2), 3, "world size 3 is not divisible"),
    (ParallelConfig(tensor_model_parallel_size=2, data_parallel_size=2), 2,
     "world size 2 != TP x PP x CP x parallel.data_parallel_size"),
    (ParallelConfig(sequence_parallel=True), 1, "sequence_parallel=true needs"),
    (ParallelConfig(expert_model_parallel_size=4), 2, "must divide tensor x context x data"),
    (ParallelConfig(tensor_model_parallel_size=2, expert_tensor_parallel_size=1), 2,
     "expert_tensor_parallel_size=1 differs"),
    (ParallelConfig(virtual_pipeline_model_parallel_size=2), 1, "needs pipeline_model_parallel"),
    (ParallelConfig(pipeline_zero2=True), 2, "pipeline_zero2=true with parallel.use_distributed"),
    (ParallelConfig(microbatch_group_size_per_vp_stage=2), 1, "needs the interleaved schedule"),
    (ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                    microbatch_group_size_per_vp_stage=16), 2, "must lie in [PP=2, micro-batches"),
    (ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                    microbatch_group_size_per_vp_stage=7), 2, "the last group would hold 1"),
    (ParallelConfig(pipeline_zero2=True, use_distributed_optimizer=True,
                    overlap_grad_reduce=True), 2, "pipeline_zero2=true with parallel.overlap"),
])
def test_impossible_layouts_are_named(par, world, fragment):
    with pytest.raises(LayoutError) as err:
        check(par, world)
    assert fragment in str(err.value)


def test_with_mtp_an_uneven_pipeline_is_balanced_not_refused():
    """With MTP the layout is balanced for the placement (glm5_train.pipeline_plan), so 4
    layers on 3 stages are fine; overlapped grad reduction would race with the embedding tie."""
    assert check(ParallelConfig(pipeline_model_parallel_size=3), 3, mtp_num_steps=3) == 1
    with pytest.raises(LayoutError, match="overlap_grad_reduce=true with pipeline"):
        check(ParallelConfig(pipeline_model_parallel_size=2, overlap_grad_reduce=True), 2,
              mtp_num_steps=3)


def test_batch_must_split_over_data_parallel():
    with pytest.raises(LayoutError, match="global_batch_size=6 must be a multiple"):
        check(ParallelConfig(), 4, gbs=6)


def test_valid_layout_returns_data_parallel_size():
    assert check(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                virtual_pipeline_model_parallel_size=2,
                                expert_model_parallel_size=2), 8) == 2


def test_unknown_config_keys_are_refused():
    with pytest.raises(ValueError, match=r"train: unknown field\(s\) \['train_iter'\]"):
        compose_job(["+train.train_iter=3"])
    with pytest.raises(ValueError, match="unknown field"):
        GLM5Config.from_dict({"hidden_sise": 3})


def test_model_rules():
    with pytest.raises(ValueError, match="num_key_value_heads=2: MLA"):
        GLM5Config(**{**TINY, "num_key_value_heads": 2}).validate()
    with pytest.raises(ValueError, match="first_k_dense_replace=9"):
        GLM5Config(**{**TINY, "first_k_dense_replace": 9}).validate()


def test_launcher_derives_process_count():
    assert nproc_for(compose_job([])) == 8  # the main job: TP2 x PP2 x VPP2 x DP2 (+EP2)
    assert nproc_for(compose_job(["parallel=tp2_pp2"])) == 4
    assert nproc_for(compose_job(["parallel=single"])) == 1


def test_bad_layout_fails_before_process_groups(tmp_path):
    # World size 2 with TP=3: the job must stop with the layout message and no gloo traffic.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "glm5_train.train", "parallel=single", "parallel.tensor_model_parallel_size=3",
           "checkpoint.save=null", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "world size 2 is not divisible by tensor x pipeline x context parallel" in (
        proc.stdout + proc.stderr)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("field", ["norm_topk_prob", "rope_interleave", "indexer_rope_interleave"])
def test_unimplemented_model_variants_are_refused(field):
    with pytest.raises(ValueError, match=f"model.{field}=false"):
        GLM5Config(**{**TINY, field: False}).validate()


def test_distributed_muon_checkpoints_are_refused_before_work():
    from glm5_train.checkpoint import CheckpointConfig
    from glm5_train.job_config import JobConfig, TrainConfig

    job = JobConfig(parallel=ParallelConfig(use_distributed_optimizer=True),
                    train=TrainConfig(optimizer="muon"), checkpoint=CheckpointConfig(save="/x"))
    with pytest.raises(ValueError, match="distributed Muon keeps each matrix's momentum"):
        job.validate()
