"""Muon's ``train.muon_*`` keys and rules (the technique: parallel/muon.py,
parallel/distributed_muon.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MuonOptions:
    """``train.muon_*`` keys (part of the job's TrainConfig; used with train.optimizer=muon)."""

    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_split_mla: bool = True  # Muon Split: per-head W_UQ / W_UK / W_UV (GLM-5 default)
    # With parallel.use_distributed_optimizer: one owner rank per matrix (true), or the naive
    # reference where every rank gathers every Muon gradient (false; for bench/muon_comm.py).
    muon_zero_redundant: bool = True


def check_muon_options(opts: MuonOptions) -> None:
    if not 0.0 <= opts.muon_momentum < 1.0:
        raise ValueError(f"train.muon_momentum={opts.muon_momentum} must lie in [0, 1) (a "
                         "momentum of 1 never forgets a gradient): use e.g. the default 0.95")
    if opts.muon_ns_steps < 1:
        raise ValueError(f"train.muon_ns_steps={opts.muon_ns_steps} must be >= 1 (the "
                         "Newton-Schulz iterations that orthogonalise each update): use e.g. 5")
