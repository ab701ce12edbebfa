#!/usr/bin/env bash
# A virtual environment holding this checkout on another megatron-core release, for checking
# the project against it on this machine: tools/mcore_release_venv.sh VERSION DIR
#
# megatron-core 0.17 and later declare Python >= 3.12 (what GPU images run); their code runs
# on 3.10 and 3.11 too, so on an older Python the release is built from its source
# distribution with that check waived (its C++ dataset helpers compile here). torch 2.13.0
# first and alone, as in the README (its CPU build is on local disk on the dev machines).
set -euo pipefail
usage() {
  cat <<'TXT'
usage: tools/mcore_release_venv.sh [-h] VERSION DIR

Build a virtual environment at DIR holding this checkout on megatron-core VERSION (torch 2.13.0
first, then the release, built from its source distribution with its Python check waived on
Python < 3.12, then the project with its dev extras), for checking the project against another
megatron-core release on this machine (tests/test_mcore_release.py reads GLM5_MCORE_0_19_PYTHON).

Examples:
  bash tools/mcore_release_venv.sh 0.19.2 /tmp/venv-mcore-0.19.2
  GLM5_MCORE_0_19_PYTHON=/tmp/venv-mcore-0.19.2/bin/python python -m pytest -q tests/test_mcore_release.py
TXT
}
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  usage
  exit 0
fi
if [ $# -ne 2 ]; then
  echo "usage: $0 VERSION DIR   (e.g. $0 0.19.2 /tmp/venv-mcore-0.19)" >&2
  exit 2
fi
version=$1
dir=$2
repo="$(cd "$(dirname "$0")/.." && pwd)"
python -m venv "$dir"
py="$dir/bin/python"
"$py" -m pip install --quiet --upgrade pip
"$py" -m pip install --quiet "torch==2.13.0"
"$py" -m pip install --quiet numpy "packaging>=24.2" pybind11 setuptools wheel
"$py" -m pip install --quiet --no-deps --no-build-isolation --ignore-requires-python \
  "megatron-core==$version"
# The project and its other dependencies; the megatron-core above satisfies the pin.
"$py" -m pip install --quiet -e "$repo[dev]"
"$py" - <<PY
import importlib.metadata as md
got = md.version("megatron-core")
assert got == "$version", f"megatron-core {got} installed, not $version"
print(f"mcore_release_venv: {'$dir'}: megatron-core {got}, torch {md.version('torch')}")
PY
