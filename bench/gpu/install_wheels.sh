#!/usr/bin/env bash
# On the GPU machine (no internet): install the wheels bench/gpu/prepare_wheels.sh put in
# bench/gpu/wheels (carried there), into /tmp/site, without touching the image's packages.
#
#   bash bench/gpu/install_wheels.sh [WHEELS_DIR] && export PYTHONPATH=/tmp/site:$PWD
#
# megatron-core, hydra-core, omegaconf and antlr4 are always installed (the versions this
# repository is checked with); numpy, packaging, PyYAML, psutil, einops and safetensors only
# where the image has no such distribution (its own builds stay, torch's numpy above all).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WHEELS=${1:-$REPO/bench/gpu/wheels}
SITE=${GPU_SITE:-/tmp/site}
if ! compgen -G "$WHEELS/*.whl" > /dev/null; then
    echo "install_wheels: no wheels in $WHEELS (run bench/gpu/prepare_wheels.sh where pip has" \
         "the index, and carry the folder)" >&2
    exit 1
fi
python3 - "$WHEELS" "$SITE" <<'EOF'
import glob
import importlib.metadata as metadata
import os
import subprocess
import sys

wheels, site = sys.argv[1:3]
ALWAYS = {"megatron_core", "hydra_core", "omegaconf", "antlr4_python3_runtime"}
chosen = []
for path in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
    dist = os.path.basename(path).split("-")[0]
    if dist.lower() not in ALWAYS:
        try:
            print(f"install_wheels: {dist} {metadata.version(dist)} is in the image: kept")
            continue
        except metadata.PackageNotFoundError:
            pass
    chosen.append(path)
print("install_wheels:", " ".join(os.path.basename(p) for p in chosen))
subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                       "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade", "--target",
                       site, *chosen])
EOF
echo "install_wheels: installed into $SITE; use PYTHONPATH=$SITE:$REPO"
