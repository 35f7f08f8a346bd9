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
#    `cohort gpu nccl`: every NCCL collective against its expected values, on one rank, then
#    two ranks sharing the GPU (`cohort run -n 2`): refused without NCCL_MULTI_RANK_GPU_ENABLE,
#    run with it where NCCL is 2.30 or later (an older NCCL's refusal is the expected outcome);
# 4. `cohort train --device cuda` against `--device cpu`: the same 20 steps, their losses side
#    by side (a table, and a JSON line); then two ranks sharing the GPU, host-staged
#    (`cohort run -n 2 train --device cuda`), against the same CPU run;
# 5. `cohort bench train --device cuda`: GPT-2 124M (config G's shape) at T=1024, batch 8 and
#    16, fp32 and bf16 products, and config G itself (T=256, batch 4);
# 6. PyTorch's anchors on the same GPU: GPT-2 124M at T=1024, batch 8 and 16, bf16 autocast,
#    eager and torch.compile (tokens/s, ms/step, peak memory, MFU against a bf16 GEMM rate
#    measured here; docs/bench/bench_gpu.py);
# 7. DDP with 2 ranks on one GPU, GPT-2 124M at T=1024, bf16, batch 4 per rank: cohort with
#    its gradients staged through the host, cohort over NCCL (where NCCL runs two ranks on one
#    GPU), and PyTorch's DDP over gloo (its host-staged path); tokens/s and the exposed
#    all-reduce share of a step (docs/bench/bench_gpu_ddp.py);
# 8. one closing table, cohort's rows and PyTorch's, and the DDP rows.
# Each part runs under a hard timeout cut to what is left of the 8 minutes, so a slow part
# costs its own figures only; the parts run in order of what is worth most, so the last
# (torch.compile at batch 16) is the first to go when time runs short; the DDP figures come
# after the eager anchors and before torch.compile. Everything printed also
# goes to $OUT/gpu-check.log (and every part's JSON line, cohort's and PyTorch's, to
# $OUT/bench.jsonl) when OUT is set. GPU_CHECK_SMOKE=1 checks the script itself without a GPU:
# cohort runs on the CPU (and its emulated device) and PyTorch on a tiny model; with
# GPU_CHECK_EMULATOR=DIR as well (the CUDA CPU emulator built by crates/cuda/emu/build.sh DIR),
# every cohort part runs its CUDA path on the emulator instead (--device cuda, NCCL, small
# models), so the script's GPU branches run before a GPU's minutes are spent on them. Exit
# status: nonzero when the kernel check or a part failed.
set -uo pipefail
cd "$(dirname "$0")/.."

START=$(date +%s)
SMOKE_ON_EMULATOR=0
if [ "${GPU_CHECK_SMOKE:-0}" = 1 ] && [ -n "${GPU_CHECK_EMULATOR:-}" ]; then
  # cohort finds the emulator's libcuda, NVRTC, cuBLAS and NCCL before any others.
  export COHORT_CUDA_LIB_DIRS=$GPU_CHECK_EMULATOR/lib
  SMOKE_ON_EMULATOR=1
fi
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

# part_limit NAME LIMIT_S: sets PART_LIMIT to min(LIMIT_S, time left), or records NAME as
# skipped and fails when under 15 s are left.
part_limit() {
  local left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt 15 ]; then
    SUMMARY+=("$1: skipped (out of time)")
    FAILED=1
    return 1
  fi
  PART_LIMIT=$2
  [ "$PART_LIMIT" -gt "$left" ] && PART_LIMIT=$left
  return 0
}

# run_part NAME LIMIT_S CMD...: runs CMD under min(LIMIT_S, time left); records the outcome.
run_part() {
  local name=$1 limit rc
  part_limit "$name" "$2" || return 0
  limit=$PART_LIMIT
  shift 2
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

# run_nccl_part NAME LIMIT MULTI_RANK(0|1) CMD...: as run_part, for NCCL with two ranks on one
# GPU: without NCCL_MULTI_RANK_GPU_ENABLE (MULTI_RANK=0) cohort must refuse, naming the fix; with
# it, NCCL 2.30+ must run, and an older NCCL's refusal (which names 2.30) is the expected
# outcome, not a failure.
run_nccl_part() {
  local name=$1 multi=$3 limit rc log
  part_limit "$name" "$2" || return 0
  limit=$PART_LIMIT
  shift 3
  log=$(mktemp "$OUT_DIR/nccl.XXXXXX")
  local t0=$(date +%s)
  if [ "$multi" = 1 ]; then
    NCCL_MULTI_RANK_GPU_ENABLE=1 timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$log"
  else
    env -u NCCL_MULTI_RANK_GPU_ENABLE timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$log"
  fi
  rc=${PIPESTATUS[0]}
  local dt=$(($(date +%s) - t0))
  local refusal
  refusal=$(grep -m1 -o 'ranks 0 and 1 share one GPU.*' "$log")
  if [ "$rc" = 0 ] && [ "$multi" = 1 ]; then
    SUMMARY+=("$name: ok, NCCL ran both ranks (${dt}s)")
  elif [ "$rc" = 0 ]; then
    SUMMARY+=("$name: FAILED (not refused without NCCL_MULTI_RANK_GPU_ENABLE)") FAILED=1
  elif [ -n "$refusal" ] && { [ "$multi" = 0 ] || grep -q 'NCCL 2.30 or later' "$log"; }; then
    SUMMARY+=("$name: refused as expected: $refusal")
  else
    case $rc in
      124 | 137) SUMMARY+=("$name: TIMEOUT after ${limit}s") FAILED=1 ;;
      *) SUMMARY+=("$name: FAILED (exit $rc, ${dt}s)") FAILED=1 ;;
    esac
  fi
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
  run_part "cohort gpu info" 30 "$COHORT" gpu info
  section "cohort gpu check"
  run_part "cohort gpu check" 60 "$COHORT" gpu check
  section "cohort gpu nccl"
  if [ "${GPU_CHECK_SMOKE:-0}" = 1 ] && [ "$SMOKE_ON_EMULATOR" = 0 ]; then
    SUMMARY+=("cohort gpu nccl: skipped (smoke: no GPU)")
  else
    run_part "cohort gpu nccl (1 rank)" 30 "$COHORT" gpu nccl
    run_nccl_part "cohort gpu nccl (2 ranks, 1 GPU, no variable)" 30 0 "$COHORT" run -n 2 gpu nccl --elements 262147
    run_nccl_part "cohort gpu nccl (2 ranks, 1 GPU)" 40 1 "$COHORT" run -n 2 gpu nccl --elements 262147
  fi
else
  echo "no cohort binary at $COHORT (pass its path as the first argument)"
  SUMMARY+=("cohort gpu info/check: no binary at $COHORT")
  FAILED=1
fi

SMOKE=()
EXPECT_COHORT=()
DEV=cuda
if [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; then
  SMOKE=(--smoke)
  # No GPU: the device path on the emulated device (host memory, the CPU's kernels), or the
  # CUDA path on the CUDA CPU emulator.
  [ "$SMOKE_ON_EMULATOR" = 1 ] || DEV=emulated
fi
BENCH=(docs/bench/bench_gpu.py)
# The small model of the training comparison (and of the smoke's DDP); the emulator runs
# kernels as host code, slowly: a smaller one there, for fewer steps.
SHAPE=(--n-layers 2 --n-heads 4 --d-model 128 --d-ff 512 --seq-len 64)
STEPS=20
if [ "$SMOKE_ON_EMULATOR" = 1 ]; then
  SHAPE=(--n-layers 2 --n-heads 4 --d-model 64 --d-ff 256 --seq-len 32)
  STEPS=6
fi

section "cohort train --device $DEV against --device cpu (20 steps)"
if [ -x "$COHORT" ]; then
  # A small model on the embedded corpus, one step per log line; the run log keeps each loss
  # in full (metrics.jsonl), which the comparison reads.
  TRAIN=(train --steps "$STEPS" --log-interval 1 "${SHAPE[@]}" --batch-size 8 --dropout 0)
  rm -rf "$OUT_DIR/train-cpu" "$OUT_DIR/train-$DEV"
  run_part "cohort train --device cpu" 30 "$COHORT" "${TRAIN[@]}" --device cpu --log-dir "$OUT_DIR/train-cpu"
  run_part "cohort train --device $DEV" 45 "$COHORT" "${TRAIN[@]}" --device "$DEV" --log-dir "$OUT_DIR/train-$DEV"
  run_part "loss curves cpu vs $DEV" 15 "$PY" "${BENCH[@]}" compare "$OUT_DIR/train-cpu" "$OUT_DIR/train-$DEV" --label "$DEV" --out "$RESULTS"
  # Two ranks sharing the device, their gradients host-staged (DDP's buckets all-reduced on
  # the host while backward goes on): batch 4 each, the CPU run's global batch of 8.
  TRAIN_X2=(train --steps "$STEPS" --log-interval 1 "${SHAPE[@]}" --batch-size 4 --dropout 0)
  rm -rf "$OUT_DIR/train-$DEV-x2"
  run_part "cohort run -n 2 train --device $DEV (host-staged)" 60 "$COHORT" run -n 2 "${TRAIN_X2[@]}" --device "$DEV" --log-dir "$OUT_DIR/train-$DEV-x2"
  run_part "loss curves cpu vs 2 ranks on $DEV" 15 "$PY" "${BENCH[@]}" compare "$OUT_DIR/train-cpu" "$OUT_DIR/train-$DEV-x2" --label "$DEV x2" --out "$RESULTS"

  section "cohort bench train --device $DEV"
  # JSON lines into the results the table reads (and the log).
  if [ "$DEV" = cuda ] && [ "$SMOKE_ON_EMULATOR" = 0 ]; then
    G124=(--config G --seq 1024 --steps 4 --warmup 1)
    CONFIG_G=(--config G --steps 8 --warmup 2)
    EXPECT_COHORT=(G:1024:8:fp32 G:1024:16:fp32 G:1024:8:bf16 G:1024:16:bf16 G:256:4:fp32)
  elif [ "$SMOKE_ON_EMULATOR" = 1 ]; then
    G124=(--config A --seq 16 --steps 1 --warmup 1)
    CONFIG_G=(--config A --seq 16 --steps 1 --warmup 1)
  else
    G124=(--config A --steps 2 --warmup 1)
    CONFIG_G=(--config A --seq 32 --steps 2 --warmup 1)
  fi
  for prec in fp32 bf16; do
    for b in 8 16; do
      before=${#SUMMARY[@]}
      run_part "cohort bench train B=$b $prec" 40 "$COHORT" bench train --device "$DEV" "${G124[@]}" --batch "$b" --precision "$prec" --json > >(tee -a "$RESULTS")
      # A precision that fails at B=8 fails at 16 too: no time spent on it.
      case ${SUMMARY[$before]:-} in *FAILED*) [ "$b" = 8 ] && SUMMARY+=("cohort bench train B=16 $prec: skipped (B=8 failed)") && break ;; esac
    done
  done
  run_part "cohort bench train config G" 30 "$COHORT" bench train --device "$DEV" "${CONFIG_G[@]}" --json > >(tee -a "$RESULTS")
fi

section "PyTorch anchors"
run_part "bf16 GEMM rate" 20 "$PY" "${BENCH[@]}" matmul --budget-s 6 "${SMOKE[@]}" --out "$RESULTS"
run_part "PyTorch eager B=8" 35 "$PY" "${BENCH[@]}" train --mode eager --batch 8 "${SMOKE[@]}" --budget-s 25 --out "$RESULTS"
run_part "PyTorch eager B=16" 40 "$PY" "${BENCH[@]}" train --mode eager --batch 16 "${SMOKE[@]}" --budget-s 30 --out "$RESULTS"
section "DDP: 2 ranks on one GPU ($DEV), cohort beside PyTorch's gloo DDP"
DDP_BENCH=(docs/bench/bench_gpu_ddp.py)
if [ "$DEV" = cuda ] && [ "$SMOKE_ON_EMULATOR" = 0 ]; then
  # GPT-2 124M (config G's shape) at T=1024 on random tokens, bf16 products, batch 4 per rank.
  DDP_MODEL=(--n-layers 12 --n-heads 12 --d-model 768 --d-ff 3072 --seq-len 1024 --vocab-size 50304
    --batch-size 4 --precision bf16)
  DDP_SEQ=1024 DDP_STEPS=(--steps 8 --log-interval 4)
else
  # the smoke's shape (the emulator's smaller one there)
  DDP_MODEL=("${SHAPE[@]}" --batch-size 4)
  DDP_SEQ=${SHAPE[-1]} DDP_STEPS=(--steps 4 --log-interval 2)
fi
DDP_TRAIN=(train --data random "${DDP_MODEL[@]}" "${DDP_STEPS[@]}" --eval-interval 1000 --dropout 0 --device "$DEV")
EXPECT_DDP=("cohort host-staged" "PyTorch DDP backend=gloo")
if [ -x "$COHORT" ]; then
  rm -rf "$OUT_DIR/ddp-staged" "$OUT_DIR/ddp-nccl"
  # The default with two ranks on one GPU is host staging (the header says so); named here.
  run_part "cohort DDP host-staged" 50 "$COHORT" run -n 2 "${DDP_TRAIN[@]}" --backend cohort --log-dir "$OUT_DIR/ddp-staged"
  run_part "cohort DDP host-staged figures" 10 "$PY" "${DDP_BENCH[@]}" cohort "$OUT_DIR/ddp-staged" --label host-staged --batch 4 --seq "$DDP_SEQ" --out "$RESULTS"
  if [ "$DEV" = cuda ]; then
    run_nccl_part "cohort DDP NCCL" 50 1 "$COHORT" run -n 2 "${DDP_TRAIN[@]}" --backend nccl --log-dir "$OUT_DIR/ddp-nccl"
    [ -f "$OUT_DIR/ddp-nccl/metrics.jsonl" ] && run_part "cohort DDP NCCL figures" 10 "$PY" "${DDP_BENCH[@]}" cohort "$OUT_DIR/ddp-nccl" --label NCCL --batch 4 --seq "$DDP_SEQ" --out "$RESULTS"
  fi
fi
run_part "PyTorch DDP gloo" 50 "$PY" "${DDP_BENCH[@]}" torch --backend gloo --batch 4 --budget-s 30 "${SMOKE[@]}" --out "$RESULTS"

run_part "PyTorch compile B=8" 90 "$PY" "${BENCH[@]}" train --mode compile --batch 8 "${SMOKE[@]}" --budget-s 75 --out "$RESULTS"
run_part "PyTorch compile B=16" 70 "$PY" "${BENCH[@]}" train --mode compile --batch 16 "${SMOKE[@]}" --budget-s 55 --out "$RESULTS"

section "table"
# Let the tee of the last JSON line finish writing.
sleep 1
timeout 20 "$PY" "${BENCH[@]}" table "$RESULTS" --expect eager:8 eager:16 compile:8 compile:16 \
  --expect-cohort "${EXPECT_COHORT[@]}"
echo
timeout 20 "$PY" "${DDP_BENCH[@]}" table "$RESULTS" --expect "${EXPECT_DDP[@]}"
echo
for s in "${SUMMARY[@]}"; do echo "  $s"; done
echo "total: $(($(date +%s) - START))s; log and results in $OUT_DIR"
exit "$FAILED"
