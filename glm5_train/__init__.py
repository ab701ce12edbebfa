"""GLM-5 pre-training on megatron-core."""

import warnings

# megatron-core warns at import time, once per rank, that Transformer Engine / Apex are absent
# and it falls back to torch; without them (CPU, or a plain CUDA install) that is expected. The
# filters must exist before the first megatron-core import, which any glm5_train module does,
# so a job's console (one line for a config error) is not drowned in per-rank warnings.
# megatron-core 0.19 adds one for absl-py (its HyperCommGrid falls back to the logging module).
for _pattern in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                 "absl.logging is not installed"):
    warnings.filterwarnings("ignore", message=_pattern)
