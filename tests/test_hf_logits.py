"""Logit parity with an implementation nobody here wrote: Hugging Face transformers'
``GlmMoeDsaForCausalLM`` (5.24, which applies the indexer ReLU and interleaved indexer RoPE).

A tiny random HF model with ``index_topk`` (8) smaller than the sequence (32) so that the DSA
selection matters is saved, imported with tools/hf_checkpoint.py and run through our model with
tools/logits.py on 1 process and on parallel layouts; logits must match HF's.

Tolerance: fp32 everywhere; the implementations differ in summation order (fused vs split
projections, per-expert vs grouped, TP partial sums), ~1e-6 relative per op. Through 4 layers
that stays below 1e-4 absolute on logits of magnitude ~1. A mapping or math error (a wrong
norm eps, rope layout, routing scale, a missed top-k mask) moves logits by > 1e-2.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.parity import REPO

pytest.importorskip("transformers", minversion="5.24")

SEQ, TOPK = 32, 8
ATOL = 1e-4
# transformers' tiny model has no MTP layer (its logits never use one): train none here. The
# MTP-built model's logits are checked against HF in tests/test_hf_checkpoint.py.
MODEL = ["model=glm5_tiny", f"model.index_topk={TOPK}", "model.mtp_num_steps=0"]


def _torchrun(nprocs: int, script: str, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nprocs}", script, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-5000:]}")
    return proc.stdout


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from tests.hf_tiny import build_tiny_hf, hf_indexer_ties_by_index

    root = tmp_path_factory.mktemp("hf_logits")
    hf_model = build_tiny_hf(str(root / "hf"), index_topk=TOPK)
    tokens = torch.randint(0, 320, (2, SEQ), generator=torch.Generator().manual_seed(3))
    torch.save(tokens, root / "tokens.pt")
    with torch.no_grad(), hf_indexer_ties_by_index():  # our top-k tie rule (see there)
        reference = hf_model(tokens).logits.float()
    _torchrun(1, "tools/hf_checkpoint.py", "import", "--hf-dir", str(root / "hf"),
              "--save", str(root / "ckpt"), *MODEL, "parallel=single")
    return root, reference


@pytest.mark.parametrize("nprocs,layout", [(1, "single"), (2, "tp2"),
                                           (4, "tp2_pp2_vpp2_ep2")])
def test_logits_match_hugging_face(imported, nprocs, layout):
    root, reference = imported
    out = root / f"logits_{layout}.pt"
    _torchrun(nprocs, "tools/logits.py", "--load", str(root / "ckpt"), "--tokens",
              str(root / "tokens.pt"), "--out", str(out), *MODEL, f"parallel={layout}")
    ours = torch.load(out)
    assert ours.shape == reference.shape
    diff = (ours - reference).abs().max().item()
    print(f"hf_logits {layout}: max |diff| {diff:.2e} (logit scale {reference.abs().max():.2f})")
    assert diff < ATOL, f"{layout}: max |logit diff| {diff:.2e} >= {ATOL}"


def test_sparse_selection_matters(imported):
    """The same HF weights with dense attention give clearly different logits, so the parity
    above really exercises the top-k selection."""
    from transformers import GlmMoeDsaForCausalLM

    root, reference = imported
    dense = GlmMoeDsaForCausalLM.from_pretrained(str(root / "hf"), index_topk=SEQ).eval()
    tokens = torch.load(root / "tokens.pt")
    with torch.no_grad():
        dense_logits = dense(tokens).logits.float()
    assert (dense_logits - reference).abs().max().item() > 100 * ATOL
