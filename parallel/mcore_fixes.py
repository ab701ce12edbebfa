"""megatron-core 0.16.1 bugs that bite whenever Transformer Engine is absent, on CPU or GPU.

Each fix is a ``Redirect`` (see ``parallel/device.py``) so that the device layer lists and tests
every change in one place. With TE installed this tuple is empty.
"""

from __future__ import annotations

import importlib.util

from parallel.device import Redirect


def _te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _fixes_without_te() -> tuple[Redirect, ...]:
    from glm5_train.layers import MLADownProjection

    return (
        # moe_utils imports te_general_gemm inside a try block and never binds it on ImportError;
        # every router forward then raises NameError. None selects its torch fallback.
        Redirect("megatron.core.transformer.moe.moe_utils", "te_general_gemm", None,
                 "unbound without TE: router forward raises NameError", binds_missing=True),
        # The TE extension module imports with MagicMock stand-ins, so MLA believes TE exists and
        # an isinstance(..., TELinear) check against a MagicMock raises TypeError.
        Redirect("megatron.core.transformer.multi_latent_attention", "HAVE_TE", False,
                 "MagicMock TELinear breaks isinstance in MLA.__init__"),
        # The local MLA spec's ColumnParallelLinear down projections drop other TP ranks'
        # gradient of the shared RoPE key (see MLADownProjection). MLA accepts only `Linear`
        # (modelopt's, None without TE), TELinear or ColumnParallelLinear there.
        Redirect("megatron.core.transformer.multi_latent_attention", "Linear", MLADownProjection,
                 "replicated down projections: correct RoPE-key gradients under TP"),
    )


FIXES: tuple[Redirect, ...] = () if _te_installed() else _fixes_without_te()
