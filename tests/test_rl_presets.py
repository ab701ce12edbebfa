"""The RL presets: +experiment=glm5_rl_744b (GLM-5 744B reasoning RL on 256 GPUs) composes, passes
every check a launch runs before torchrun (layout at 256 ranks, the rollout records read and
packed at 65,536 tokens, GLM-5's vocabulary), and the planner gives it the per-rank memory that
docs/rl.md ("GLM-5 at 744B") quotes, beside slime's layout; +experiment=glm5_rl_tiny composes and
validates as well. Fast: no distributed runs, no model built."""

from __future__ import annotations

import numpy
import pytest

from glm5_train.assembly import check_data, validate_job
from glm5_train.job_config import compose_job
from glm5_train.plan import (
    inputs_from_job,
    job_plan,
    recompute_working_set_bytes,
    resolve_pipeline_layout,
)
from glm5_train.rl.records import Rollout, RolloutRecordError, write_rollouts
from glm5_train.rl.rollout_data import RolloutDataError
from parallel.layout import validate_layout

GIB = 2**30
H100_BYTES = 80 * 10**9  # the planner's H100 line (tools/plan_fit.py): below the device's 85.5e9
GLM5_VOCAB = 154_880
RL_CONTEXT = 65_536  # tokens per rollout, prompt + response (configs/train/glm5_rl.yaml)
# configs/parallel/glm5_rl_256gpu.yaml's "Et*10|t*10|...|t*8mL", as the job spells it out
EVEN_LAYOUT = "|".join(["E" + "t" * 10] + ["t" * 10] * 6 + ["t" * 8 + "mL"])

# The figures docs/rl.md's "GLM-5 at 744B" section quotes (tools/plan_fit.py's largest rank and
# recompute working set; planned for GPU kernels): keep the two in step.
DOCUMENTED = {
    # +experiment=glm5_rl_744b: TP8+SP PP8 CP4 EP32 DP1
    "glm5_rl_256gpu": {"dp": 1, "max_rank_gib": 55.88, "peak_gb": 61.4},
    # the same job in slime's layout: TP4+SP PP4 (20/20/20/18) EP32 DP16
    "glm5_slime_256gpu": {"dp": 16, "max_rank_gib": 87.19, "peak_gb": 104.0},
}


def _rollout(rng: numpy.random.Generator, prompt: int, response: int, group: str,
             reward: float, top_id: int | None = None) -> Rollout:
    """A rollout record with random GLM-5 token ids (``top_id``: the last response token's id)
    and log-probs a sampler could have given them."""
    response_ids = rng.integers(0, GLM5_VOCAB, response)
    if top_id is not None:
        response_ids[-1] = top_id
    return Rollout(prompt_ids=rng.integers(0, GLM5_VOCAB, prompt), response_ids=response_ids,
                   loss_mask=numpy.ones(response, dtype=numpy.float32),
                   rollout_logprobs=-rng.uniform(0.0, 3.0, response).astype(numpy.float32),
                   reward=reward, group_id=group, policy_version=0)


def _records(tmp_path, name: str, first_response: int, top_id: int = GLM5_VOCAB - 1) -> str:
    """One GRPO group of two rollouts: a 1,024-token prompt with a ``first_response``-token
    response (whose last id is ``top_id``), then a short one: two packed sequences when the
    first fills one."""
    rng = numpy.random.default_rng(0)
    path = str(tmp_path / name)
    write_rollouts(path, [_rollout(rng, 1024, first_response, "prompt-0", 1.0, top_id),
                          _rollout(rng, 16, 48, "prompt-0", 0.0)])
    return path


def _rl_744b(paths: str, *extra: str):
    return compose_job(["+experiment=glm5_rl_744b", f"data.paths=[{paths}]", *extra])


def test_rl_744b_composes_with_glm5s_rl_settings(tmp_path):
    job = _rl_744b(_records(tmp_path, "r.jsonl", RL_CONTEXT - 1024))
    t, rl = job.train, job.rl
    assert (t.objective, t.optimizer, t.params_dtype) == ("grpo", "adamw", "bf16")
    assert t.lr == t.min_lr == 1e-6 and t.warmup_iters == 0  # constant, as slime's script
    assert (t.weight_decay, t.adam_beta1, t.adam_beta2, t.clip_grad) == (0.1, 0.9, 0.98, 1.0)
    assert (t.seq_length, t.global_batch_size, t.micro_batch_size) == (RL_CONTEXT, 1024, 1)
    assert (rl.eps_low, rl.eps_high, rl.icepop_low, rl.icepop_high) == (0.2, 0.28, 0.5, 2.0)
    assert job.model.name == "glm5_744b" and job.data.format == "rollouts"
    assert job.dsa.freeze_indexer and not job.dsa.trains_indexer
    assert not job.runs_mtp  # MTP frozen: no MTP step or head runs
    assert job.activations.loss_chunk_tokens == 1024  # slime's log-prob chunks
    assert job.activations.recompute_granularity == "full"
    dp = validate_layout(job.parallel, job.model, 256, t.global_batch_size, t.micro_batch_size,
                         t.seq_length)
    assert dp == 1 and job.parallel.world_size_needed(dp) == 256


def test_rl_744b_passes_the_launch_checks_on_its_records(tmp_path, monkeypatch):
    """What a rank checks before any process group (validate_job: the layout at 256 ranks, the
    records read, checked against GLM-5's vocabulary and packed at 65,536 tokens, the pipeline
    layout), on a rollout of exactly the RL context (one step of two sequences: the records a
    test can write, not the preset's 1,024 x 200)."""
    monkeypatch.setenv("WORLD_SIZE", "256")
    monkeypatch.setenv("RANK", "0")
    job = _rl_744b(_records(tmp_path, "r.jsonl", RL_CONTEXT - 1024),
                   "train.train_iters=1", "train.global_batch_size=2")
    assert validate_job(job) == 1
    assert job.parallel.pipeline_model_parallel_layout == EVEN_LAYOUT


def test_rl_744b_layout_is_the_jobs_own_compute_balance():
    """The preset writes out the layout the job would balance itself for the MTP placement
    (on GPU kernels, no memory limit), so the plan and the run hold the same stages."""
    job = compose_job(["+experiment=glm5_rl_744b", "data.paths=[planned-only.jsonl]",
                       "parallel.pipeline_model_parallel_layout=null"])
    assert job.parallel.mtp_placement == "with_loss"
    assert resolve_pipeline_layout(job, 1, fused_attention=True) == EVEN_LAYOUT


@pytest.mark.parametrize("response,top_id,error,needle", [
    (RL_CONTEXT - 1023, GLM5_VOCAB - 1, RolloutDataError, "train.seq_length=65536"),
    (64, GLM5_VOCAB, RolloutRecordError, "response_ids"),
])
def test_rl_744b_refuses_records_it_cannot_train(tmp_path, response, top_id, error, needle):
    """A rollout one token over the RL context, a token id past GLM-5's vocabulary."""
    job = _rl_744b(_records(tmp_path, "bad.jsonl", response, top_id),
                   "train.train_iters=1", "train.global_batch_size=2")
    with pytest.raises(error, match=needle):
        check_data(job)


@pytest.mark.parametrize("preset", sorted(DOCUMENTED))
def test_planned_memory_is_what_the_docs_say(preset):
    """The planner's largest rank (static + activations in flight) and peak (+ one layer's
    recompute working set), as tools/plan_fit.py plans them, within 1% of the documented
    figures; the chosen layout fits an H100 with room to spare, slime's does not fit at 64K."""
    doc = DOCUMENTED[preset]
    job = compose_job(["+experiment=glm5_rl_744b", f"parallel={preset}",
                       "data.paths=[planned-only.jsonl]"])  # composing reads no records
    report = job_plan(job, doc["dp"], fused_attention=True)
    inputs = inputs_from_job(job, doc["dp"], fused_attention=True)
    peak = report.max_rank_bytes + recompute_working_set_bytes(job.model, inputs)
    print(f"{preset}: largest rank {report.max_rank_bytes / GIB:.2f} GiB, peak {peak / 1e9:.1f} "
          f"GB; layout {report.layout.to_string()}")
    assert report.max_rank_bytes / GIB == pytest.approx(doc["max_rank_gib"], rel=0.01)
    assert peak / 1e9 == pytest.approx(doc["peak_gb"], rel=0.01)
    if preset == "glm5_rl_256gpu":
        assert peak < H100_BYTES - 15 * 10**9
    else:
        assert peak > H100_BYTES


def test_tiny_rl_experiment_composes_and_validates(tmp_path, monkeypatch):
    """+experiment=glm5_rl_tiny on the records docs/rl.md's example writes (16 prompts x 4
    rollouts of 12 + 20 tokens of the tiny vocabulary), in the main job's 8-process layout."""
    rng = numpy.random.default_rng(1)
    path = str(tmp_path / "tiny.jsonl")
    write_rollouts(path, [
        Rollout(prompt_ids=rng.integers(0, 320, 12), response_ids=rng.integers(0, 320, 20),
                loss_mask=numpy.ones(20, dtype=numpy.float32),
                rollout_logprobs=numpy.full(20, -5.77, dtype=numpy.float32),
                reward=float(rng.uniform()), group_id=f"group-{g}", policy_version=0)
        for g in range(16) for _ in range(4)])
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    job = compose_job(["+experiment=glm5_rl_tiny", f"data.paths=[{path}]"])
    assert (job.train.objective, job.data.format, job.model.name) == ("grpo", "rollouts",
                                                                      "glm5_tiny")
    assert job.dsa.freeze_indexer and not job.runs_mtp
    assert validate_job(job) == 2
