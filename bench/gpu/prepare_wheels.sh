#!/usr/bin/env bash
# The wheels the lent GPU machine needs beyond its image, prepared here: that machine has no
# internet, and the run tool carries at most 64 MiB of git-ignored paths to it.
#
#   bash bench/gpu/prepare_wheels.sh [DEST]          # default bench/gpu/wheels (git-ignored)
#
# For the device's Python (GPU_PYTHON_VERSION, default 3.12) on x86_64 Linux, without
# dependencies: torch and triton come with the image and must stay its CUDA builds.
# Always installed there (bench/gpu/install_wheels.sh): megatron-core 0.16.1 (the release
# parallel/mcore_compat.py is checked on), hydra-core, omegaconf, antlr4 (an sdist only on the
# index: built into a pure-Python wheel here). Installed only where the image lacks them:
# numpy, packaging, PyYAML, psutil, einops, safetensors. Fails when the folder passes 64 MiB.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEST=${1:-$REPO/bench/gpu/wheels}
PY=${GPU_PYTHON_VERSION:-3.12}
LIMIT_MIB=64
mkdir -p "$DEST"

# Binary wheels for the device's interpreter and platform (not this machine's).
python3 -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
    --python-version "$PY" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --dest "$DEST" \
    "megatron-core==0.16.1" "hydra-core>=1.3,<1.4" "omegaconf>=2.3,<2.4" "packaging>=24.2" \
    "PyYAML>=5.1" "psutil>=5.9" "einops>=0.7" "safetensors>=0.4" "numpy>=1.26,<3"

# antlr4-python3-runtime 4.9.x (what omegaconf 2.3 pins) is published as an sdist only.
if ! compgen -G "$DEST/antlr4_python3_runtime-4.9*.whl" > /dev/null; then
    python3 -m pip wheel --quiet --no-deps --wheel-dir "$DEST" "antlr4-python3-runtime==4.9.3"
fi

TOTAL=$(du -sm "$DEST" | cut -f1)
ls -la "$DEST"
echo "prepare_wheels: ${TOTAL} MiB in $DEST (limit ${LIMIT_MIB} MiB)"
if ((TOTAL > LIMIT_MIB)); then
    echo "prepare_wheels: over ${LIMIT_MIB} MiB: the run tool will not carry it" >&2
    exit 1
fi
