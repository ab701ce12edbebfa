"""Bad layouts and configs fail before any process group exists, naming value, rule and fix."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from hydra.errors import CompactHydraException

from glm5_train.assembly import validate_job
from glm5_train.job_config import CONFIG_DIR, TrainConfig, compose_job, one_line
from glm5_train.model.config import GLM5Config, to_mcore_config
from glm5_train.plan import resolve_pipeline_layout
from launch import local as launch_local
from launch.local import _main_or_error, nproc_for
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
    (ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                    expert_tensor_parallel_size=1), 2, "expert_tensor_parallel_size=1 differs"),
    (ParallelConfig(virtual_pipeline_model_parallel_size=2), 1, "needs pipeline_model_parallel"),
    (ParallelConfig(pipeline_zero2=True), 2, "pipeline_zero2=true with parallel.use_distributed"),
    (ParallelConfig(microbatch_group_size_per_vp_stage=2), 1, "needs the interleaved schedule"),
    (ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                    microbatch_group_size_per_vp_stage=16), 2, "must lie in [PP=2, micro-batches"),
    (ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                    microbatch_group_size_per_vp_stage=7), 2, "the last group would hold 1"),
    (ParallelConfig(pipeline_zero2=True, use_distributed_optimizer=True,
                    overlap_grad_reduce=True), 2, "pipeline_zero2=true with parallel.overlap"),
    (ParallelConfig(overlap_param_gather=True, overlap_grad_reduce=True), 2,
     "overlap_param_gather=true needs parallel.use_distributed_optimizer=true"),
    (ParallelConfig(overlap_param_gather=True, use_distributed_optimizer=True), 2,
     "overlap_param_gather=true needs parallel.overlap_grad_reduce=true"),
    (ParallelConfig(overlap_param_gather=True, use_distributed_optimizer=True,
                    overlap_grad_reduce=True, optimizer_cpu_offload=True), 2,
     "overlap_param_gather=true with parallel.optimizer_cpu_offload=true"),
    (ParallelConfig(expert_model_parallel_size=2, overlap_moe_expert_parallel_comm=True), 2,
     "overlap_moe_expert_parallel_comm=true: not offered"),
    (ParallelConfig(pipeline_model_parallel_size=2, defer_weight_grads=True,
                    overlap_param_gather=True, use_distributed_optimizer=True), 2,
     "overlap_param_gather=true with parallel.defer_weight_grads=true"),
])
def test_impossible_layouts_are_named(par, world, fragment):
    with pytest.raises(LayoutError) as err:
        check(par, world)
    assert fragment in str(err.value)


def test_with_mtp_an_uneven_pipeline_is_balanced_not_refused():
    """With MTP the layout is balanced for the placement (glm5_train.plan), so 4 layers on 3
    stages are fine, with overlapped gradient reduction too (the embedding copies are summed
    after it: tests/test_parity.py's pp2_vpp2_dp2_overlap cases)."""
    assert check(ParallelConfig(pipeline_model_parallel_size=3), 3, mtp_num_steps=3) == 1
    assert check(ParallelConfig(pipeline_model_parallel_size=2, overlap_grad_reduce=True), 4,
                 mtp_num_steps=3) == 2


def test_a_bucket_size_below_one_is_refused():
    with pytest.raises(LayoutError, match="parallel.ddp_bucket_size=0 must be a positive"):
        check(ParallelConfig(overlap_grad_reduce=True, ddp_bucket_size=0), 2)


def test_batch_must_split_over_data_parallel():
    with pytest.raises(LayoutError, match="global_batch_size=6 must be a multiple"):
        check(ParallelConfig(), 4, gbs=6)


def test_valid_layout_returns_data_parallel_size():
    assert check(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                virtual_pipeline_model_parallel_size=2, sequence_parallel=True,
                                expert_model_parallel_size=2), 8) == 2


# Rules megatron-core (or torch) enforces only after the process groups exist; each case's
# comment names the check it mirrors.
SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
INTERLEAVED = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}


@pytest.mark.parametrize("par,world,model,fragment", [
    # moe_layer.py:379, MoELayer.forward: TP > 1 needs SP in training.
    (ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2), 2, {},
     ("parallel.tensor_model_parallel_size=2 with parallel.sequence_parallel=false: "
      "megatron-core's MoE layer")),
    (ParallelConfig(tensor_model_parallel_size=2), 2, {}, "MoE layers from layer 1"),
    # tensor_parallel/utils.py:118, VocabParallelEmbedding (and the output layer).
    (ParallelConfig(**SP), 2, {"vocab_size": 321},
     "model.vocab_size=321 is not divisible by parallel.tensor_model_parallel_size=2"),
    # tensor_parallel/layers.py:842/:1166 for the dense MLP over TP...
    (ParallelConfig(**SP), 2, {"intermediate_size": 257}, "model.intermediate_size=257"),
    # ... the routed experts over expert TP (EP=1: ETP = TP) ...
    (ParallelConfig(**SP), 2, {"moe_intermediate_size": 65},
     "model.moe_intermediate_size=65 is not divisible by parallel.expert_tensor_parallel_size=2"),
    # ... and the shared expert over TP (EP=2: ETP=1, so only the shared expert breaks).
    (ParallelConfig(**SP, expert_model_parallel_size=2), 2, {"moe_intermediate_size": 65},
     ("model.n_shared_experts x moe_intermediate_size=65 is not divisible by "
      "parallel.tensor_model_parallel_size=2")),
    # parallel_state.py:746: a VPP size, even 1, needs PP > 1.
    (ParallelConfig(virtual_pipeline_model_parallel_size=1), 1, {},
     "virtual_pipeline_model_parallel_size=1 needs pipeline_model_parallel_size > 1 (got 1)"),
    # Context parallelism's zigzag sharding: 2 x CP equal chunks (64 tokens into 6).
    (ParallelConfig(context_parallel_size=3), 3, {},
     "train.seq_length=64 is not divisible by 2 x context_parallel_size = 6"),
    # moe_layer.py:218 and token_dispatcher.py:1346.
    (ParallelConfig(moe_token_dispatcher_type="alltoall_seq"), 1, {},
     "parallel.moe_token_dispatcher_type='alltoall_seq': use one of"),
    (ParallelConfig(moe_token_dispatcher_type="flex"), 1, {}, "needs tensor x expert parallel"),
    # torch.distributed.init_process_group's backends.
    (ParallelConfig(backend="mpi"), 1, {}, "parallel.backend='mpi': use one of"),
    # parallel_state.py:791 builds the expert grid from ETP (0 would divide by zero).
    (ParallelConfig(expert_tensor_parallel_size=0), 1, {},
     "parallel.expert_tensor_parallel_size=0 must be a positive integer or null"),
    (ParallelConfig(data_parallel_size=0), 1, {}, "parallel.data_parallel_size=0 must be"),
    # Hydra passes a mistyped override through as a string or a bool.
    (ParallelConfig(sequence_parallel="ture"), 1, {},
     "parallel.sequence_parallel='ture': expected bool"),
    (ParallelConfig(tensor_model_parallel_size=True), 1, {},
     "parallel.tensor_model_parallel_size=True: expected int"),
])
def test_megatron_core_rules_fail_before_process_groups(par, world, model, fragment):
    with pytest.raises(LayoutError) as err:
        check(par, world, **model)
    assert fragment in str(err.value)


def test_dense_models_train_with_tensor_parallelism_without_sequence_parallelism():
    # The MoE layer's rule only: with every layer dense (the MTP layer copies the last
    # layer's kind) TP=2 without SP is megatron-core's plain tensor parallelism.
    dense = {"first_k_dense_replace": TINY["num_hidden_layers"]}
    assert check(ParallelConfig(tensor_model_parallel_size=2), 2, **dense) == 1
    # Context parallelism of the DSA attention (ours: megatron-core's DSA has none).
    assert check(ParallelConfig(context_parallel_size=2), 2) == 1
    # A float field takes an integer (parallel.stage_memory_limit_gib=80).
    assert check(ParallelConfig(stage_memory_limit_gib=80), 1) == 1


@pytest.mark.parametrize("gbs,fragment", [
    # schedules.py:1007 with the default group (model_parallel_config.py:448, group = PP):
    # 3 micro-batches in groups of PP=2 leave a last group of 1.
    (3, ("the interleaved schedule's micro-batch group (PP=2, as "
         "microbatch_group_size_per_vp_stage=null): the last group would hold 1 < PP=2")),
    # schedules.py:995: at least PP micro-batches per step.
    (1, ("must lie in [PP=2, micro-batches per step = global_batch_size / (micro_batch_size "
         "x data-parallel size) = 1]")),
])
def test_interleaved_schedule_rules_apply_to_the_default_group(gbs, fragment):
    with pytest.raises(LayoutError) as err:
        check(ParallelConfig(**INTERLEAVED), 2, gbs=gbs)
    assert fragment in str(err.value)
    assert check(ParallelConfig(**INTERLEAVED), 2, gbs=6) == 1  # 3 groups of 2


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None, reason="DeepEP installed")
def test_flex_dispatcher_needs_deep_ep():
    # token_dispatcher.py:1148: the flex dispatcher's DeepEP backend.
    with pytest.raises(LayoutError, match="needs the DeepEP package"):
        check(ParallelConfig(moe_token_dispatcher_type="flex", expert_model_parallel_size=2), 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl works with CUDA")
def test_nccl_backend_needs_cuda():
    with pytest.raises(LayoutError, match="parallel.backend='nccl' needs CUDA GPUs"):
        check(ParallelConfig(backend="nccl"), 1)


def _ranks_in_header(name: str) -> int | None:
    """The process count a configs/parallel file's first line gives ('...: 4 ranks')."""
    with open(f"{CONFIG_DIR}/parallel/{name}.yaml") as f:
        found = re.search(r"(\d+) ranks", f.readline())
    return int(found.group(1)) if found else None


# Full-scale GLM-5 presets need the 744B model: checked below, in tests/test_experiments.py and
# (the curriculum's stages) in tests/test_curriculum.py.
FULL_SCALE_PRESETS = {"glm5_slime_256gpu.yaml", "glm5_200k_256gpu.yaml",
                      "glm5_sft_202k_256gpu.yaml", "glm5_rl_256gpu.yaml",
                      "glm5_sft_202k_128gpu.yaml", "glm5_4k_512gpu.yaml", "glm5_32k_512gpu.yaml",
                      "glm5_128k_512gpu.yaml", "glm5_200k_512gpu.yaml"}


@pytest.mark.parametrize("name", sorted(f[:-5] for f in os.listdir(f"{CONFIG_DIR}/parallel")
                                        if f not in FULL_SCALE_PRESETS))
def test_shipped_layouts_pass_every_rule(name):
    job = compose_job([f"parallel={name}"])
    t = job.train
    dp = validate_layout(job.parallel, job.model, _ranks_in_header(name) or nproc_for(job),
                         t.global_batch_size, t.micro_batch_size, t.seq_length)
    # And megatron-core's own config checks (TransformerConfig.__post_init__, no process
    # group needed) accept what validation accepted.
    job.parallel.pipeline_model_parallel_layout = resolve_pipeline_layout(job, dp)
    to_mcore_config(job.model, job.parallel, t.torch_dtype)


def test_the_full_scale_layout_passes_every_rule():
    job = compose_job(["model=glm5_744b", "parallel=glm5_slime_256gpu", "train=glm5_pretrain"])
    t = job.train
    assert validate_layout(job.parallel, job.model, 256, t.global_batch_size,
                           t.micro_batch_size, t.seq_length) == 16


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


@pytest.mark.parametrize("changes,fragment", [
    # shared_experts.py:47: no bias with a shared expert (add_bias_linear).
    ({"attention_bias": True}, "model.attention_bias=true"),
    # transformer_config.py:1658 (group top-k <= groups); moe_utils.py:554 (the top-k
    # experts come from the chosen groups: 8 experts in 4 groups of 2, 1 group chosen).
    ({"n_group": 4, "topk_group": 5}, "model.topk_group=5 must lie in [1, n_group=4]"),
    ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3},
     "model.num_experts_per_tok=3 exceeds the experts of the topk_group=1 chosen groups"),
    # transformer_config.py:1084: the shared experts' width must be positive.
    ({"n_shared_experts": -1}, "model.n_shared_experts=-1 must be >= 0"),
])
def test_megatron_core_model_rules(changes, fragment):
    with pytest.raises(ValueError) as err:
        GLM5Config(**{**TINY, **changes}).validate()
    assert fragment in str(err.value)


@pytest.mark.parametrize("changes,fragment", [
    # optimizer_param_scheduler.py:165 (start_wd >= 0) and torch's AdamW.
    ({"weight_decay": -0.1}, "train.weight_decay=-0.1 must be >= 0.0"),
    ({"adam_beta2": 1.0}, "train.adam_beta2=1.0 must lie in [0.0, 1.0)"),
    ({"adam_eps": -1e-8}, "train.adam_eps=-1e-08 must be >= 0.0"),
    ({"log_interval": 0}, "train.log_interval=0 must be >= 1"),
])
def test_optimizer_rules(changes, fragment):
    with pytest.raises(ValueError) as err:
        TrainConfig(**changes).validate()
    assert fragment in str(err.value)


def test_launcher_derives_process_count():
    assert nproc_for(compose_job([])) == 8  # the main job: TP2 x PP2 x VPP2 x DP2 (+EP2)
    assert nproc_for(compose_job(["parallel=tp2_pp2"])) == 4
    assert nproc_for(compose_job(["parallel=single"])) == 1


MOE_TP_NO_SP = ["parallel=single", "parallel.tensor_model_parallel_size=2",
                "parallel.expert_model_parallel_size=2", "checkpoint.save=null"]


def test_config_error_under_torchrun_is_one_line_from_rank_0(tmp_path):
    """Under plain torchrun a config error prints one line, from rank 0 only, no worker
    traceback, exits non-zero before any process group exists, and torchrun's own summary
    names the message as the root cause. ``--tee 3`` only prefixes each worker's lines with
    ``[default<rank>]:`` so they can be told apart. What torchrun itself still prints is not
    ours: a 'Sending process ... closing signal SIGTERM' warning per other rank, a 'failed
    (exitcode: 2)' and a 'no error file defined for parent' log line, and its own traceback
    (torch/distributed/run.py raising ChildFailedError) with the failure table."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--tee=3", f"--log-dir={tmp_path / 'logs'}", "-m", "glm5_train.train",
           *MOE_TP_NO_SP, f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    workers = [line for line in out.splitlines() if line.startswith("[default")]
    rule = ("parallel.tensor_model_parallel_size=2 with parallel.sequence_parallel=false: "
            "megatron-core's MoE layer")
    assert proc.returncode != 0
    assert len(workers) == 1 and workers[0].startswith(f"[default0]:glm5_train: error: {rule}")
    assert out.count("glm5_train: error:") == 1
    assert "Error executing job" not in out  # Hydra's per-rank report
    assert out.count("Traceback (most recent call last)") <= 1  # torchrun's own, if any
    frames = [line for line in out.splitlines() if line.strip().startswith('File "')]
    assert not [f for f in frames if "torch/distributed" not in f and "<frozen runpy>" not in f]
    assert f"traceback : {rule}" in out.split("Root Cause")[-1]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_composition_error_is_one_line_with_status_2(tmp_path):
    # Hydra refuses an unknown key before our task function runs; a plain (one-process) run.
    cmd = [sys.executable, "-m", "glm5_train.train", "parallel=single", "train.train_iter=3",
           f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        ("glm5_train: error: Could not override 'train.train_iter'. To append to your config "
         "use +train.train_iter=3 (Key 'train_iter' is not in struct)")]


def test_hydra_errors_read_as_one_line(capsys):
    with pytest.raises(CompactHydraException) as err:
        compose_job(["parallel=bogus"])
    message = one_line(err.value)
    assert message.startswith("In 'config': Could not find 'parallel/bogus' Available options "
                              "in 'parallel': ep2 ")
    assert "\n" not in message and "Config search path" not in message
    # The launcher reports it the same way, before starting any process.
    assert _main_or_error(["parallel=bogus"]) == 2
    assert capsys.readouterr().err == f"launch: error: {message}\n"


@pytest.mark.parametrize("field", ["norm_topk_prob", "rope_interleave", "indexer_rope_interleave"])
def test_unimplemented_model_variants_are_refused(field):
    with pytest.raises(ValueError, match=f"model.{field}=false"):
        GLM5Config(**{**TINY, field: False}).validate()


@pytest.mark.parametrize("optimizer,zero2", [("adamw", False), ("muon", False), ("muon", True)])
def test_distributed_optimizer_modes_accept_checkpoints(optimizer, zero2):
    """The distributed optimizer, distributed Muon and Pipeline ZeRO2 save and load
    (tests/test_checkpoint_matrix.py): no config refuses checkpoint.save / load for them."""
    from glm5_train.checkpoint import CheckpointConfig
    from glm5_train.job_config import JobConfig, TrainConfig

    job = JobConfig(parallel=ParallelConfig(use_distributed_optimizer=True, pipeline_zero2=zero2),
                    train=TrainConfig(optimizer=optimizer),
                    checkpoint=CheckpointConfig(save="/x", load="/y"))
    job.validate()


# ---- per-technique config: keys and checks beside each technique, sizes written once ----------

TECHNIQUE_OPTIONS = {  # config class -> module that declares and checks it (no megatron-core)
    "DeferredWgradOptions": "parallel.config.deferred_wgrad",
    "HostOptimizerOptions": "parallel.config.host_optimizer",
    "FlexibleCPOptions": "parallel.config.flexible_cp",
    "ContextCommOptions": "parallel.config.context_parallel",
    "PipelineZero2Options": "parallel.config.pipeline_zero2",
    "PipelineScheduleOptions": "parallel.config.pipeline",
    "MuonOptions": "parallel.config.muon",
    "Int4QATOptions": "parallel.config.int4_qat",
    "NonfiniteOptions": "glm5_train.bad_steps",
    "ProfileOptions": "glm5_train.profiling",
}


def test_each_technique_declares_its_own_keys():
    """The parallel and train groups are composed of the techniques' own option classes; every
    shipped key is declared by exactly one of them (or the group's core) and keeps its name."""
    import dataclasses

    import yaml
    groups = {"parallel": (ParallelConfig, "parallel/single.yaml", True),  # lists every key
              "train": (TrainConfig, "train/tiny.yaml", False)}
    for group, (config, shipped, every) in groups.items():
        with open(os.path.join(CONFIG_DIR, shipped)) as f:
            keys = set(yaml.safe_load(f))
        names = [f.name for f in dataclasses.fields(config)]
        assert len(names) == len(set(names)), group
        assert keys == set(names) if every else keys <= set(names), (group, keys ^ set(names))
    bases = {base.__name__: base.__module__ for base in
             (*ParallelConfig.__mro__, *TrainConfig.__mro__)}
    for name, module in TECHNIQUE_OPTIONS.items():
        assert bases.get(name) == module, f"{name} should be declared in {module}"


def test_a_parallel_size_is_written_once():
    """Sizes reach megatron-core through ParallelSizes.mcore_kwargs only: the model config
    and the process groups take their sizes from that map, neither writes a size keyword
    (``context_parallel_size=par.context_parallel_size``) by hand."""
    import dataclasses
    import inspect

    from megatron.core import parallel_state

    from parallel.layout import ParallelSizes
    from parallel.process_groups import GROUP_SIZES, init_distributed
    sizes = [f.name for f in dataclasses.fields(ParallelSizes)]
    for mapper in (to_mcore_config, init_distributed):
        source = inspect.getsource(mapper)
        assert not [name for name in sizes if f"{name}=" in source], mapper.__name__
    accepted = inspect.signature(parallel_state.initialize_model_parallel).parameters
    assert set(GROUP_SIZES) <= set(sizes) and set(GROUP_SIZES) <= set(accepted)
    par = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2, context_parallel_size=2,
                         expert_model_parallel_size=2, sequence_parallel=True,
                         microbatch_group_size_per_vp_stage=4)
    mcore = to_mcore_config(GLM5Config(**TINY), par)
    for name, value in par.mcore_kwargs().items():
        assert getattr(mcore, name) == value, name
    assert mcore.expert_tensor_parallel_size == 1  # unset with EP > 1: GLM-5's expert TP


def test_short_runs_warm_up_over_half_the_run_by_default():
    """train.warmup_iters=null: 5 warm-up steps, at most half the run, so a 1-4 step run is
    accepted; an explicit value past the run is refused, naming the key and both fixes."""
    assert [TrainConfig(train_iters=n).warmup_steps for n in (1, 2, 4, 9, 10, 30)] == \
        [0, 1, 2, 4, 5, 5]
    TrainConfig(train_iters=1).validate()
    with pytest.raises(ValueError, match=r"train.warmup_iters=5 must lie in \[0, "
                       r"train.train_iters=3\]: set e.g. train.warmup_iters=1, or "
                       r"train.warmup_iters=null"):
        TrainConfig(train_iters=3, warmup_iters=5).validate()
    assert compose_job(["train.train_iters=3"]).train.warmup_steps == 1


# ---- the launcher's child: its exit status, and it dies with the launcher ---------------------
# A tiny Python child stands in for torchrun (run_torchrun runs the command it is given).

def test_launcher_reports_a_child_killed_by_a_signal_as_the_shell_does(capsys):
    """torchrun killed by SIGKILL (e.g. the OOM killer): status 137, as a shell reports it (not
    Popen's -9, which SystemExit turns into 247), and the message names the signal."""
    child = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    assert launch_local.run_torchrun(child, dict(os.environ)) == 137
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("launch: error: the job failed (torchrun was killed by SIGKILL)")


# Like torchrun, it exits 1 on SIGTERM; it writes its pid, then waits to be stopped.
STUB_CHILD = ("import os, signal, sys, time; "
              "signal.signal(signal.SIGTERM, lambda *_: sys.exit(1)); "
              "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
              "os.rename(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(60)")


def stub_child(pid_file) -> list[str]:
    return [sys.executable, "-c", STUB_CHILD, str(pid_file)]


def start_stub_launcher(pid_file) -> tuple[subprocess.Popen, int]:
    """The launcher process and its child's pid, once the child is running."""
    code = ("import os, sys; from launch.local import run_torchrun; "
            f"raise SystemExit(run_torchrun({stub_child(pid_file)!r}, dict(os.environ)))")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30  # the launcher imports torch first
    while not pid_file.exists():
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    return launcher, int(pid_file.read_text())


def running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may never reap an orphan)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_launchers_child_dies_when_the_launcher_is_sigkilled(tmp_path):
    """A SIGKILLed launcher (a test's timeout, a CI job manager) takes torchrun with it: torchrun
    runs in its own session, so only its parent-death signal (SIGTERM) can stop it."""
    launcher, child = start_stub_launcher(tmp_path / "child.pid")
    try:
        launcher.kill()
        launcher.communicate(timeout=10)
        deadline = time.monotonic() + 5
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child), "the child outlived its SIGKILLed launcher"
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)


def test_launcher_stopped_by_sigterm_exits_143(tmp_path, capsys):
    """SIGTERM to the launcher (here, this process: run_torchrun in-process) is passed on to
    torchrun once; torchrun exits 1 (as for any signal it handles), the launcher with 128 + 15
    = 143 and its 'stopped' line, not an error."""
    pid_file = tmp_path / "child.pid"

    def stop_once_started() -> None:
        deadline = time.monotonic() + 30
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_file.exists():  # the launcher's handler is installed by now; else let it fail
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_started, daemon=True).start()
    assert launch_local.run_torchrun(stub_child(pid_file), dict(os.environ)) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "launch: stopped: SIGTERM passed on to torchrun, which exited with status 1")
    assert not running(int(pid_file.read_text()))


def test_sigusr1_to_the_launcher_saves_and_stops_the_job(tmp_path):
    """SIGUSR1 (the job's save-then-exit signal) sent to launch.local reaches the ranks through
    torchrun (--signals-to-handle): the job saves after its current step and stops; no rank is
    left running. Without the flag torchrun died of it and orphaned the ranks."""
    import signal
    import time
    log, run = tmp_path / "launch.log", tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "launch.local", "parallel=single", "train.train_iters=400",
             "train.global_batch_size=2", "train.seq_length=64", f"hydra.run.dir={run}"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while "step 2/" not in log.read_text() and launcher.poll() is None:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    launcher.send_signal(signal.SIGUSR1)
    status = launcher.wait(timeout=300)
    text = log.read_text()
    assert re.search(r"glm5_train: stopped by SIGUSR1 after step (\d+); checkpoint", text), text
    assert status == 128 + signal.SIGUSR1 and "launch: stopped: SIGUSR1 passed on" in text
    assert (run / "checkpoints" / "latest_iteration.txt").exists()
    assert "step 400/400" not in text


def test_overlapped_parameter_gather_with_distributed_muon_is_refused_in_one_line():
    """Distributed Muon gathers each matrix from its owner after its own step: megatron-core's
    overlapped gather is not built for it (the GLM-5 presets' Muon keeps it off)."""
    job = compose_job(["parallel=single", "train.optimizer=muon",
                       "parallel.use_distributed_optimizer=true",
                       "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"])
    with pytest.raises(ValueError) as failed:
        validate_job(job)
    assert "overlap_param_gather=true with train.optimizer=muon" in str(failed.value)
    assert "\n" not in str(failed.value)
