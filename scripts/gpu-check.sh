#!/usr/bin/env bash
# Everything cohort checks on a GPU, in one run of at most 8 minutes on a machine with one
# NVIDIA GPU, its driver, and PyTorch with the nvidia-* wheels, but no Rust toolchain and no
# network (the release binary is built elsewhere and carried in):
#
#   bash scripts/gpu-check.sh [path/to/cohort]     # default: target/release/cohort
#
# 1. versions: nvidia-smi, the driver, torch, CUDA, NCCL, cuDNN, the nvidia-* wheels;
# 2. `cohort gpu info`: which CUDA libraries and headers cohort found where, and the device;
# 3. `cohort gpu check`: every CUDA kernel against the CPU engine (a table, nonzero on a miss);
# 4. PyTorch's anchors on the same GPU: GPT-2 124M at T=1024, batch 8 and 16, bf16 autocast,
#    eager and torch.compile (tokens/s, ms/step, peak memory, MFU against a bf16 GEMM rate
#    measured here; docs/bench/bench_gpu.py);
# 5. one closing table.
# Each part runs under a hard timeout cut to what is left of the 8 minutes, so a slow part
# costs its own figures only. Everything printed also goes to $OUT/gpu-check.log (and the
# anchors' JSON lines to $OUT/bench.jsonl) when OUT is set. Exit status: nonzero when the
# kernel check or a part failed.
set -uo pipefail
cd "$(dirname "$0")/.."

START=$(date +%s)
DEADLINE=$((START + 470)) # 8 minutes, less a margin for the table
COHORT=${1:-target/release/cohort}
PY=${PYTHON:-/opt/torch/.venv/bin/python3}
[ -x "$PY" ] || PY=$(command -v python3)
OUT_DIR=${OUT:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
mkdir -p "$OUT_DIR"
RESULTS=$OUT_DIR/bench.jsonl
: >"$RESULTS"
exec > >(tee -a "$OUT_DIR/gpu-check.log") 2>&1
# cohort's library search asks this Python for its site-packages (nvidia/*/lib, include/).
export COHORT_PYTHON=$PY

declare -a SUMMARY=()
FAILED=0

section() { echo; echo "== $1 (t=$(($(date +%s) - START))s)"; }

# run_part NAME LIMIT_S CMD...: runs CMD under min(LIMIT_S, time left); records the outcome.
run_part() {
  local name=$1 limit=$2 left rc
  shift 2
  left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt 15 ]; then
    SUMMARY+=("$name: skipped (out of time)")
    FAILED=1
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@"
  rc=$?
  local dt=$(($(date +%s) - t0))
  case $rc in
    0) SUMMARY+=("$name: ok (${dt}s)") ;;
    124 | 137) SUMMARY+=("$name: TIMEOUT after ${limit}s") FAILED=1 ;;
    *) SUMMARY+=("$name: FAILED (exit $rc, ${dt}s)") FAILED=1 ;;
  esac
}

section "versions"
echo "host: $(uname -srm), $(nproc) cores; cohort binary: $COHORT; python: $PY"
timeout 20 nvidia-smi || echo "nvidia-smi: unavailable"
timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>/dev/null
timeout 40 "$PY" - <<'PYEOF' || echo "python/torch: unavailable"
import importlib.metadata as md
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"device: {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
    try:
        print(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    except Exception as e:
        print(f"NCCL: {e}")
print(f"cuDNN {torch.backends.cudnn.version()}")
for d in sorted(md.distributions(), key=lambda d: d.metadata["Name"].lower()):
    name = d.metadata["Name"]
    if name.lower().startswith(("nvidia-", "triton")):
        print(f"  {name} {d.version}")
PYEOF

section "cohort gpu info"
if [ -x "$COHORT" ]; then
  "$COHORT" --version
  run_part "cohort gpu info" 45 "$COHORT" gpu info
  section "cohort gpu check"
  run_part "cohort gpu check" 75 "$COHORT" gpu check
else
  echo "no cohort binary at $COHORT (pass its path as the first argument)"
  SUMMARY+=("cohort gpu info/check: no binary at $COHORT")
  FAILED=1
fi

section "PyTorch anchors"
# GPU_CHECK_SMOKE=1: a tiny model on the CPU instead, to check this script without a GPU.
BENCH=(docs/bench/bench_gpu.py)
SMOKE=()
[ "${GPU_CHECK_SMOKE:-0}" = 1 ] && SMOKE=(--smoke)
run_part "bf16 GEMM rate" 30 "$PY" "${BENCH[@]}" matmul --budget-s 8 "${SMOKE[@]}" --out "$RESULTS"
run_part "PyTorch eager B=8" 45 "$PY" "${BENCH[@]}" train --mode eager --batch 8 "${SMOKE[@]}" --budget-s 30 --out "$RESULTS"
run_part "PyTorch eager B=16" 50 "$PY" "${BENCH[@]}" train --mode eager --batch 16 "${SMOKE[@]}" --budget-s 35 --out "$RESULTS"
run_part "PyTorch compile B=8" 120 "$PY" "${BENCH[@]}" train --mode compile --batch 8 "${SMOKE[@]}" --budget-s 100 --out "$RESULTS"
run_part "PyTorch compile B=16" 95 "$PY" "${BENCH[@]}" train --mode compile --batch 16 "${SMOKE[@]}" --budget-s 80 --out "$RESULTS"

section "table"
timeout 20 "$PY" "${BENCH[@]}" table "$RESULTS" --expect eager:8 eager:16 compile:8 compile:16
echo
for s in "${SUMMARY[@]}"; do echo "  $s"; done
echo "total: $(($(date +%s) - START))s; log and results in $OUT_DIR"
exit "$FAILED"
