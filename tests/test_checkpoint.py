"""Checkpoints: a resumed run reproduces the uninterrupted one exactly, also in another layout;
a failed or foreign checkpoint never harms what was saved."""

from __future__ import annotations

import os

import pytest

from tests.parity import run_job

COMMON = ["train.train_iters=4", "checkpoint.save_interval=2"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    ckpt = root / "ckpt"
    result = run_job(2, ["parallel=tp2", *COMMON, f"checkpoint.save={ckpt}"], str(root / "run"))
    return result.records, ckpt


def _resume_from_step2(ckpt, tmp_path, nprocs, layout):
    # Point "latest" at the step-2 checkpoint, as if the run had died after saving it.
    (ckpt / "latest_iteration.txt").write_text("2\n")
    run = tmp_path / f"resume_{layout}"
    return run_job(nprocs, [f"parallel={layout}", "train.train_iters=4",
                            f"checkpoint.load={ckpt}"], str(run)).records


# pp2_vpp2: the MTP layer moves to the split placement (Et|ttt|m|L), where pipeline rank 0
# holds two copies of the word embedding; both must come back from the checkpoint.
@pytest.mark.parametrize("nprocs,layout", [(2, "tp2"), (1, "single"), (2, "pp2_vpp2")])
def test_resume_reproduces_losses_exactly(uninterrupted, tmp_path, nprocs, layout):
    full, ckpt = uninterrupted
    resumed = _resume_from_step2(ckpt, tmp_path, nprocs, layout)
    assert [r["step"] for r in resumed] == [3, 4]
    for ref, got in zip(full[2:], resumed):
        # Same layout: bit-exact. Another layout: only reduction order differs.
        tol = 0.0 if layout == "tp2" else 1e-5 * abs(ref["loss"])
        assert abs(got["loss"] - ref["loss"]) <= tol, (layout, got, ref)
        mtp_tol = 0.0 if layout == "tp2" else 1e-5 * abs(ref["mtp_loss"])
        assert abs(got["mtp_loss"] - ref["mtp_loss"]) <= mtp_tol, (layout, got, ref)
        assert got["consumed_tokens"] == ref["consumed_tokens"]


def test_checkpoint_of_another_model_is_refused(uninterrupted, tmp_path):
    _, ckpt = uninterrupted
    with pytest.raises(RuntimeError) as err:
        run_job(1, ["parallel=single", "train.train_iters=4", "model.hidden_size=96",
                    f"checkpoint.load={ckpt}"], str(tmp_path / "foreign"))
    assert "model.hidden_size=128 there, 96 here" in str(err.value)
    assert os.path.exists(ckpt / "iter_0000004" / "metadata.json")


def test_muon_resume_reproduces_losses_exactly(tmp_path):
    """Muon's momentum buffers (and AdamW's state for the rest) survive save -> load."""
    ckpt = tmp_path / "ckpt"
    muon = ["parallel=tp2", "train.optimizer=muon", "train.train_iters=4"]
    full = run_job(2, [*muon, "checkpoint.save_interval=2", f"checkpoint.save={ckpt}"],
                   str(tmp_path / "full")).records
    (ckpt / "latest_iteration.txt").write_text("2\n")
    resumed = run_job(2, [*muon, f"checkpoint.load={ckpt}"], str(tmp_path / "resumed")).records
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]


def test_optimizer_structure_change_is_refused_then_loadable_without_optimizer(tmp_path):
    """EP2 keeps expert weights in a second optimizer; resuming in an EP=1 layout must say so
    and, with checkpoint.load_optimizer=false, continue from the saved step and weights."""
    ckpt = tmp_path / "ckpt"
    run_job(2, ["parallel=ep2", "train.train_iters=2", f"checkpoint.save={ckpt}"],
            str(tmp_path / "ep2"))
    resume = ["parallel=tp2", "train.train_iters=3", f"checkpoint.load={ckpt}"]
    with pytest.raises(RuntimeError, match="checkpoint.load_optimizer=false"):
        run_job(2, resume, str(tmp_path / "refused"))
    records = run_job(2, [*resume, "checkpoint.load_optimizer=false"],
                      str(tmp_path / "weights")).records
    assert [r["step"] for r in records] == [3]


def test_extending_a_run_continues_the_saved_schedule_and_says_so(tmp_path):
    """A run saved at its last step (decay over 2 steps) and resumed to step 4 with
    train.lr_decay_iters=null continues the saved schedule (megatron-core's default), and the
    console says so, naming the keys that make the config say what runs; passing them gives
    the same losses without the notice."""
    ckpt = tmp_path / "ckpt"
    base = ["parallel=single", "train.global_batch_size=2", "train.seq_length=64"]
    run_job(1, [*base, "train.train_iters=2", f"checkpoint.save={ckpt}"], str(tmp_path / "a"))
    extend = [*base, "train.train_iters=4", f"checkpoint.load={ckpt}"]
    silent = run_job(1, extend, str(tmp_path / "b"))
    assert ("checkpoint: continuing the saved learning-rate schedule (lr_decay_steps "
            "(train.lr_decay_iters) 2 there, 4 in this config" in silent.log
            and "pass train.lr_decay_iters=2" in silent.log), silent.log[-3000:]
    said = run_job(1, [*extend, "train.lr_decay_iters=2"], str(tmp_path / "c"))
    assert "continuing the saved" not in said.log
    assert [r["step"] for r in said.records] == [3, 4]
    assert [r["loss"] for r in said.records] == [r["loss"] for r in silent.records]


def test_a_checkpoint_under_overlapped_parameter_gather_holds_the_steps_weights(tmp_path):
    """parallel.overlap_param_gather leaves each step's parameter all-gather to the next
    forward; the checkpoint gathers them first (``parameters_gathered``), so resuming from
    step 2 reproduces steps 3 and 4 bit for bit. Stale shards saved would change them."""
    ckpt = tmp_path / "ckpt"
    overlap = ["parallel=single", "parallel.use_distributed_optimizer=true",
               "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true",
               "parallel.ddp_bucket_size=20000"]
    full = run_job(2, [*overlap, *COMMON, f"checkpoint.save={ckpt}"], str(tmp_path / "full"))
    (ckpt / "latest_iteration.txt").write_text("2\n")
    resumed = run_job(2, [*overlap, "train.train_iters=4", f"checkpoint.load={ckpt}"],
                      str(tmp_path / "resumed")).records
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full.records[2:]]
