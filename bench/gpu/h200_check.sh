#!/usr/bin/env bash
# One-shot GPU check of this repository on a single NVIDIA H200 (or any one-GPU machine).
#
#   bash bench/gpu/h200_check.sh            # from anywhere; runs in the repo root
#
# Steps (each under `timeout`, all under one overall budget; a failed step is recorded as FAIL
# with its error tail and the script goes on):
#   install  wheels from bench/gpu/wheels/ (bench/gpu/prepare_wheels.sh) or .whl/ into /tmp/site
#   env      nvidia-smi -L, python / torch / CUDA / NCCL / package versions
#   pytest   tests/test_device.py (with CUDA present the CPU-only tests skip, see -rs)
#   train_cuda  torchrun, 1 process, tiny GLM-5, CUDA + NCCL
#   train_cpu   the same with CUDA_VISIBLE_DEVICES= (CPU + gloo)
#   compare  per-step loss / grad norm of both runs, max abs diff, tokens/s (d)
#   dsa      dense vs DSA attention at 4K/8K/16K, GLM-5 heads 64 / indexer 32, bf16
#            (bench/gpu/h200_perf.py --parts attention; the full measurement at 16K-64K and the
#            744B-width layer stack's MFU: run bench/gpu/h200_perf.py on its own, ~9 minutes)
#
# Output: $OUT/h200.log (everything), $OUT/summary.txt (compact), $OUT/metrics_{cuda,cpu}.jsonl,
# $OUT/dsa_cuda.json.
#
# Environment knobs:
#   GLM5_CHECK_DEVICE=cpu     no nvidia-smi, no CUDA training run, DSA bench's dry run (CPU)
#                             (a syntax / override check for machines without a GPU)
#   GLM5_CHECK_INSTALL=0      do not install .whl/ (packages already importable)
#   GLM5_CHECK_BUDGET_S=330   overall seconds; steps are shortened / skipped to stay inside
#   GLM5_CHECK_ITERS=10       training steps per run
#   GLM5_CHECK_OVERRIDES=...  extra Hydra overrides for both training runs (space separated)
#   GLM5_CHECK_CPU_THREADS=8  OMP threads of the CPU training run
#   GLM5_CHECK_STEPS="..."    subset of: install env pytest train_cuda train_cpu compare dsa
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO" || exit 2
MODE=${GLM5_CHECK_DEVICE:-cuda}
OUT=${OUT:-/tmp/h200_check_out}
WORK=${GLM5_CHECK_WORK:-/tmp/h200_check_work}
BUDGET=${GLM5_CHECK_BUDGET_S:-330}
ITERS=${GLM5_CHECK_ITERS:-10}
CPU_THREADS=${GLM5_CHECK_CPU_THREADS:-8}
STEPS=${GLM5_CHECK_STEPS:-install env pytest train_cuda train_cpu compare dsa}
read -r -a EXTRA <<< "${GLM5_CHECK_OVERRIDES:-}"
mkdir -p "$OUT" "$WORK"
LOG=$OUT/h200.log
SUMMARY=$OUT/summary.txt
: > "$LOG"
: > "$SUMMARY"
rm -f "$WORK"/*.log "$WORK"/*.steps
START=$SECONDS
FAILED=0

export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore HYDRA_FULL_ERROR=1 PYTHONDONTWRITEBYTECODE=1

summary() { printf '%s\n' "$*" >> "$SUMMARY"; }
wanted() { [[ " $STEPS " == *" $1 "* ]]; }
elapsed() { echo $((SECONDS - START)); }

# The error tail of a failed step: for torchrun, the worker's traceback (what precedes torchrun's
# own "failed (exitcode" / ChildFailedError report), else the log's end; caret lines dropped.
error_tail() {
    awk '/elastic\/multiprocessing\/api.py.*failed \(exitcode|ChildFailedError/ {exit} {print}' "$1" \
        | sed -E 's/^\[rank[0-9]+\]: ?//' | grep -vE '^\s*[~^]+\s*$' | tail -n 25
}

# run_step NAME LIMIT_S CMD...: run CMD under timeout (capped by the budget left), log it,
# record PASS / FAIL in the summary. Returns CMD's status.
run_step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - $(elapsed)))
    if ((left < 20)); then
        echo "===== [$name] SKIP: overall budget ${BUDGET}s spent"
        summary "[$name] SKIP (overall budget ${BUDGET}s spent)"
        FAILED=1
        return 125
    fi
    ((limit > left - 10)) && limit=$((left - 10))
    local steplog=$WORK/$name.log t0=$SECONDS rc
    echo "===== [$name] start t=$(elapsed)s limit=${limit}s: $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$steplog"
    rc=${PIPESTATUS[0]}
    local took=$((SECONDS - t0))
    if ((rc == 0)); then
        echo "===== [$name] PASS in ${took}s"
        summary "[$name] PASS in ${took}s"
    else
        local why="rc=$rc"
        ((rc == 124 || rc == 137)) && why="TIMEOUT after ${limit}s (rc=$rc)"
        echo "===== [$name] FAIL $why in ${took}s"
        summary "[$name] FAIL $why in ${took}s; error tail:"
        error_tail "$steplog" | sed 's/^/    /' >> "$SUMMARY"
        FAILED=1
    fi
    return "$rc"
}

train_run() {  # train_run NAME RUN_DIR [env assignments...]
    local name=$1 dir=$2
    shift 2
    rm -rf "$dir"
    run_step "$name" 120 env "$@" python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
        -m glm5_train.train model=glm5_tiny parallel=single "train.train_iters=$ITERS" \
        checkpoint.save=null "hydra.run.dir=$dir" "${EXTRA[@]}"
    local rc=$?
    grep '^step ' "$WORK/$name.log" > "$WORK/$name.steps" 2>/dev/null
    summary "[$name] $(wc -l < "$WORK/$name.steps") step lines; last: $(tail -n 1 "$WORK/$name.steps")"
    [[ -f $dir/metrics.jsonl ]] && cp "$dir/metrics.jsonl" "$OUT/metrics_${name#train_}.jsonl"
    return $rc
}

main() {
    echo "h200_check: every CUDA-only branch is checked by bench/gpu/gpu_check.py (docs/cuda_branches.md)"
    echo "h200_check: mode=$MODE repo=$REPO budget=${BUDGET}s iters=$ITERS steps='$STEPS'"
    summary "h200_check: mode=$MODE iters=$ITERS budget=${BUDGET}s date=$(date -u +%FT%TZ)"
    summary "repo: HEAD $(git rev-parse --short HEAD 2>/dev/null || echo '? (no .git)')," \
        "$(git status --short 2>/dev/null | wc -l) changed files per git status"
    [[ ${#EXTRA[@]} -gt 0 ]] && summary "extra overrides: ${EXTRA[*]}"

    # ------------------------------------------------------------------ install
    if wanted install && [[ ${GLM5_CHECK_INSTALL:-1} == 1 ]] && compgen -G "bench/gpu/wheels/*.whl" > /dev/null; then
        run_step install 90 bash bench/gpu/install_wheels.sh  # bench/gpu/prepare_wheels.sh's
        export PYTHONPATH=/tmp/site:$REPO
    elif wanted install && [[ ${GLM5_CHECK_INSTALL:-1} == 1 ]] && compgen -G ".whl/*.whl" > /dev/null; then
        ls -la .whl
        run_step install 90 python3 -m pip install -q --no-index --no-deps --no-compile \
            --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site:$REPO
    else
        echo "===== [install] skipped (GLM5_CHECK_INSTALL=${GLM5_CHECK_INSTALL:-1}, or no .whl/)"
        export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
    fi
    echo "PYTHONPATH=$PYTHONPATH"

    # ------------------------------------------------------------------ env
    if wanted env; then
        if [[ $MODE != cpu ]]; then
            run_step nvidia_smi 30 bash -c 'nvidia-smi -L && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv'
            summary "gpu: $(grep -m1 '^GPU 0' "$WORK/nvidia_smi.log" 2>/dev/null)"
        fi
        run_step env 60 python3 - <<'EOF'
import importlib, importlib.metadata as md, platform, sys
import torch
print("python", sys.version.split()[0], sys.executable, platform.machine())
cuda = torch.cuda.is_available()
line = f"torch {torch.__version__} cuda_build {torch.version.cuda} cuda_available {cuda}"
if cuda:
    p = torch.cuda.get_device_properties(0)
    line += (f" device '{p.name}' cc {p.major}.{p.minor} mem {p.total_memory / 2**30:.0f} GiB"
             f" sms {p.multi_processor_count} nccl {'.'.join(map(str, torch.cuda.nccl.version()))}")
print("ENV", line)
versions = []
for dist in ("megatron-core", "hydra-core", "omegaconf", "antlr4-python3-runtime", "packaging",
             "psutil", "einops", "numpy", "safetensors", "PyYAML", "pytest", "pytest-timeout",
             "triton", "transformer-engine", "transformers"):
    try:
        versions.append(f"{dist}={md.version(dist)}")
    except md.PackageNotFoundError:
        versions.append(f"{dist}=absent")
print("ENV", " ".join(versions))
import os, sysconfig
stdlib = sysconfig.get_paths()["stdlib"]
py = sum(name.endswith(".py") for _, _, names in os.walk(stdlib) for name in names)
print("ENV stdlib", stdlib, f"({py} .py files; data=stdlib builds its corpus from them)")
import megatron.core, hydra, omegaconf  # noqa: E401 - the ones we carry must import
print("ENV megatron.core from", megatron.core.__file__)
EOF
        grep '^ENV ' "$WORK/env.log" 2>/dev/null | sed 's/^ENV /env: /' >> "$SUMMARY"
    fi

    # ------------------------------------------------------------------ a. device-layer tests
    if wanted pytest; then
        run_step pytest 120 python3 -m pytest -q -x -rs tests/test_device.py
        summary "[pytest] $(grep -E '(passed|failed|skipped|error)' "$WORK/pytest.log" | tail -n 1)"
        grep -E '^SKIPPED' "$WORK/pytest.log" | sed 's/^/    /' >> "$SUMMARY"
    fi

    # ------------------------------------------------------------------ b. training, CUDA then CPU
    if wanted train_cuda && [[ $MODE != cpu ]]; then
        train_run train_cuda "$WORK/run_cuda"
    fi
    if wanted train_cpu; then
        train_run train_cpu "$WORK/run_cpu" CUDA_VISIBLE_DEVICES= "OMP_NUM_THREADS=$CPU_THREADS"
    fi

    # ------------------------------------------------------------------ b/d. compare + tokens/s
    if wanted compare; then
        run_step compare 30 python3 bench/gpu/compare_runs.py "$WORK/run_cuda" "$WORK/run_cpu"
        grep '^SUMMARY ' "$WORK/compare.log" 2>/dev/null | sed 's/^SUMMARY /compare: /' >> "$SUMMARY"
    fi

    # ------------------------------------------------------------------ c. DSA attention
    if wanted dsa; then
        if [[ $MODE != cpu ]]; then
            run_step dsa 150 python3 bench/gpu/h200_perf.py --parts attention \
                --seq 4096 8192 16384 --no-sweep --repeats 2 --budget-s 120 \
                --json "$OUT/dsa_cuda.json"
        else
            run_step dsa 120 python3 bench/gpu/h200_perf.py --dry-run --parts attention \
                --seq 128 --json "$OUT/dsa_cuda.json"
        fi
        grep -E '^summary: |FAIL' "$WORK/dsa.log" 2>/dev/null | sed 's/^/dsa: /' >> "$SUMMARY"
    fi

    summary "total ${SECONDS}s wall (budget ${BUDGET}s); overall $([[ $FAILED == 0 ]] && echo PASS || echo 'SOME STEPS FAILED')"
    echo "===== summary ($SUMMARY)"
    cat "$SUMMARY"
    ls -la "$OUT"
    return $FAILED
}

main 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
