"""INT4 Hugging Face checkpoints of the routed experts, in the layout of compressed-tensors'
``pack-quantized`` W4A16 format (the one INT4 QAT checkpoints ship in for vLLM / SGLang).

Export (``tools/hf_checkpoint.py export --int4``) quantises each routed expert's
``gate_proj`` / ``up_proj`` / ``down_proj`` weight with parallel/int4_qat.py's quantiser, the
one training ran (``train.int4_qat``), and writes for ``<name>.weight`` three tensors:
``<name>.weight_packed`` (int32 [out, in / 8]), ``<name>.weight_scale`` (bfloat16
[out, in / group]) and ``<name>.weight_shape`` (int64 [2]); config.json gets the
``quantization_config`` saying so. Everything else keeps the model's dtype.

Import reads such a checkpoint back: a packed weight is dequantised (``q * scale``, exact)
into the model's dtype, so a QAT run's export, imported, holds bit for bit the weights the QAT
forward multiplied with.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from parallel import int4_qat

ROUTED_EXPERT_WEIGHT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\."
                                  r"(gate|up|down)_proj\.weight$")
PACKED, SCALE, SHAPE = "_packed", "_scale", "_shape"


def quantization_config(group_size: int) -> dict[str, Any]:
    """config.json's ``quantization_config`` for the routed experts at ``group_size``."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": [r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": group_size, "dynamic": False, "actorder": None,
                        "observer": "minmax"},
            "input_activations": None, "output_activations": None,
            "format": "pack-quantized"}},
        "ignore": [],
        "kv_cache_scheme": None,
    }


def quantize_tensors(tensors: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """``tensors`` (HF names) with every routed-expert weight replaced by its packed form."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not ROUTED_EXPERT_WEIGHT.match(name):
            out[name] = tensor
            continue
        values, scale = int4_qat.quantize(tensor, group_size)
        out[name + PACKED] = int4_qat.pack(values)
        out[name + SCALE] = scale
        out[name + SHAPE] = torch.tensor(list(tensor.shape), dtype=torch.int64)
    return out


def logical_names(files: dict[str, str]) -> dict[str, str]:
    """HF tensor name -> file, with each packed triple under its weight's own name."""
    packed = {name[:-len(PACKED)] for name in files if name.endswith("weight" + PACKED)}
    triple = {base + suffix for base in packed for suffix in (PACKED, SCALE, SHAPE)}
    return {**{name: fname for name, fname in files.items() if name not in triple},
            **{base: files[base + PACKED] for base in packed}}


def is_packed(name: str, files: dict[str, str]) -> bool:
    return name not in files and name + PACKED in files


def read_packed(read, name: str, index: tuple[slice, ...]) -> torch.Tensor:
    """The dequantised ``index`` of packed weight ``name`` (fp32, exact), ``read(name, index)``
    reading stored tensors: whole rows are unpacked, then the columns cut."""
    _, in_features = packed_shape(read, name)
    rows = index[0] if index else slice(None)
    values = int4_qat.unpack(read(name + PACKED, (rows, slice(None))), in_features)
    scale = read(name + SCALE, (rows, slice(None)))
    whole = int4_qat.dequantize(values, scale, torch.float32)
    return whole[(slice(None), *index[1:])] if len(index) > 1 else whole


def packed_shape(read, name: str) -> tuple[int, ...]:
    return tuple(int(v) for v in read(name + SHAPE, (slice(None),)))
