"""The project on megatron-core 0.19.2, the release GPU images carry, against 0.16.1.

The 0.19.2 runs use the environment ``tools/mcore_release_venv.sh 0.19.2 DIR`` builds, named by
``GLM5_MCORE_0_19_PYTHON`` (its python); ``.ci/run`` builds it and sets the variable. Without it
these tests skip (say so, with the command). The references run here, in the suite's own
environment (0.16.1 on the dev machines), so each comparison is across releases:

- the registry: no entry stale on 0.19.2, the three it no longer needs listed;
- one process: the same losses, grad norm and every parameter's gradient norm, bit for bit;
- the main job's layout (TP2 + SP x PP2 x VPP2 x EP2 x DP2, split MTP, deferred weight
  gradients) and distributed Muon on Pipeline ZeRO2 (the two optimizer overrides re-read on
  0.19.2): parity with one process (``tests/parity.py``'s FP32 tolerances), the layout shown
  by the run's own metrics, and the release by its log;
- a checkpoint saved on 0.16.1 resumed on 0.19.2 gives the uninterrupted run's losses exactly.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.parity import (
    BASE_OVERRIDES,
    REPO,
    JobResult,
    assert_layout_ran,
    compare,
    one_process,
    read_metrics,
    run_job,
)

RELEASE = "0.19.2"
PYTHON = os.environ.get("GLM5_MCORE_0_19_PYTHON", "")
pytestmark = pytest.mark.skipif(
    not PYTHON, reason="set GLM5_MCORE_0_19_PYTHON to the python of an environment built by "
                       "tools/mcore_release_venv.sh 0.19.2 DIR (.ci/run does)")
MUON_ZERO2 = ["parallel=pp2_vpp2", "parallel.use_distributed_optimizer=true",
              "parallel.pipeline_zero2=true", "train.optimizer=muon"]


def run_on_release(nprocs: int, overrides: list[str], run_dir: str) -> JobResult:
    """The job under torchrun in the 0.19.2 environment (a real interpreter per rank)."""
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
           "-m", "glm5_train.train", *BASE_OVERRIDES, *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    log = proc.stdout + proc.stderr
    assert f"glm5_train: megatron-core {RELEASE}, torch " in log, log[-3000:]
    return JobResult(read_metrics(run_dir), log)


def test_no_registry_entry_is_stale_on_the_release():
    code = ("import json, warnings; warnings.simplefilter('ignore'); "
            "from parallel import mcore_compat as m; print(json.dumps([m.megatron_core_version(), "
            "m.stale_reasons(), m.version_report(), m.not_needed_report()]))")
    proc = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    version, stale, unchecked, not_needed = json.loads(proc.stdout.splitlines()[-1])
    assert (version, stale, unchecked) == (RELEASE, [], [])
    assert len(not_needed) == 3, not_needed


def test_one_process_is_bit_for_bit_the_same_on_both_releases(tmp_path):
    reference = one_process(["parallel=single"]).records
    records = run_on_release(1, ["parallel=single"], str(tmp_path / "run")).records
    keys = ("step", "loss", "mtp_loss", "indexer_kl", "grad_norm", "param_grad_norms")
    assert len(records) == len(reference)
    for got, want in zip(records, reference, strict=True):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, got["step"]


@pytest.mark.parametrize("nprocs, overrides, reference", [
    (8, ["parallel=tp2_pp2_vpp2_ep2_dp2", "parallel.defer_weight_grads=true"],
     ["parallel=single"]),
    (4, MUON_ZERO2, ["parallel=single", "train.optimizer=muon"]),
], ids=["main_layout_deferred_wgrad", "distributed_muon_zero2"])
def test_parallel_layouts_on_the_release_match_one_process(nprocs, overrides, reference,
                                                           tmp_path):
    result = run_on_release(nprocs, overrides, str(tmp_path / "run"))
    assert_layout_ran(result, nprocs, overrides)
    problems = compare(one_process(reference).records, result.records)
    assert not problems, "\n".join(problems)


def test_a_checkpoint_of_0_16_resumes_on_the_release_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["parallel=pp2", "train.train_iters=4"]
    full = run_job(2, [*common, "checkpoint.save_interval=2", f"checkpoint.save={ckpt}"],
                   str(tmp_path / "full")).records
    (ckpt / "latest_iteration.txt").write_text("2\n")
    resumed = run_on_release(2, [*common, f"checkpoint.load={ckpt}"],
                             str(tmp_path / "resumed")).records
    assert [r["step"] for r in resumed] == [3, 4]
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [
        (r["loss"], r["grad_norm"]) for r in full[2:]]
