"""INT4 quantisation-aware training's ``train.int4_*`` keys (the technique: parallel/int4_qat.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Int4QATOptions:
    """``train.int4_*`` keys (part of the job's TrainConfig)."""

    # The routed experts' weights enter every forward as weight-only symmetric INT4, one
    # bfloat16 scale per int4_group_size inputs of a row (the weights export as that INT4
    # checkpoint bit for bit: tools/hf_checkpoint.py export --int4).
    int4_qat: bool = False
    int4_group_size: int = 32
