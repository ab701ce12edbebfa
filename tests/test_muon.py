"""Muon (+ Muon Split) matches single-process Muon in parallel layouts, and its pieces do what
they claim. Tolerances: tests/parity.py (fp32; Newton-Schulz on a TP-gathered matrix is the
same computation as on the whole one, so only reduction order differs)."""

from __future__ import annotations

import pytest
import torch

from glm5_train.muon import MatrixLayout, newton_schulz, orthogonal_update
from tests.parity import compare, run_job

MUON = ["train.optimizer=muon"]


def test_newton_schulz_orthogonalises():
    gen = torch.Generator().manual_seed(0)
    for shape in ((16, 48), (48, 16)):
        singular = torch.linalg.svdvals(newton_schulz(torch.randn(*shape, generator=gen), 5))
        # The quintic iteration drives singular values into roughly [0.7, 1.2], not exactly 1.
        assert singular.min() > 0.6 and singular.max() < 1.3, singular


def test_muon_split_orthogonalises_each_head_on_its_own():
    gen = torch.Generator().manual_seed(1)
    heads, nope, v, latent = 3, 4, 6, 32
    update = torch.randn(heads * (nope + v), latent, generator=gen)
    split = orthogonal_update(update, MatrixLayout("kv_up", True, head_blocks=(nope, v)), 5)
    whole = orthogonal_update(update, MatrixLayout("kv_up", True), 5)
    start = 0
    for _ in range(heads):
        for size in (nope, v):
            block = split[start:start + size] / (0.2 * latent ** 0.5)
            singular = torch.linalg.svdvals(block)
            assert singular.min() > 0.6 and singular.max() < 1.3, singular
            start += size
    assert not torch.allclose(split, whole, atol=1e-3)  # the split is a different update


@pytest.fixture(scope="module")
def muon_reference(tmp_path_factory):
    return run_job(1, ["parallel=single", *MUON], str(tmp_path_factory.mktemp("muon_ref"))).records


@pytest.mark.parametrize("nprocs,overrides", [
    (2, ["parallel=single"]),                      # DP2
    (4, ["parallel=pp2_vpp2"]),                    # DP2 x PP2 x VPP2
    (4, ["parallel=tp2"]),                         # TP2 (+SP) x DP2
    (4, ["parallel=tp2_pp2_vpp2_ep2"]),            # TP2 x PP2 x VPP2, EP2
], ids=["dp2", "dp2_pp2_vpp2", "tp2_dp2", "tp2_pp2_vpp2_ep2"])
def test_muon_matches_single_process(muon_reference, nprocs, overrides, tmp_path):
    result = run_job(nprocs, [*overrides, *MUON], str(tmp_path / "run"))
    problems = compare(muon_reference, result.records)
    assert not problems, "\n".join(problems)


def test_muon_without_split_under_tp_matches_single_process(tmp_path):
    """Without the split the MLA up-projections are orthogonalised whole, which under TP means
    gathering them over the TP group: the gathered path must match too."""
    no_split = [*MUON, "train.muon_split_mla=false"]
    reference = run_job(1, ["parallel=single", *no_split], str(tmp_path / "ref")).records
    result = run_job(2, ["parallel=tp2", *no_split], str(tmp_path / "tp2")).records
    assert not compare(reference, result)


def test_muon_with_distributed_optimizer_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="Muon needs whole matrices"):
        run_job(1, ["parallel=single", *MUON, "parallel.use_distributed_optimizer=true"],
                str(tmp_path / "refused"))
