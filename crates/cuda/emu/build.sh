#!/usr/bin/env bash
# Builds the CUDA CPU emulator (README.md) with g++ into OUT (default: target/cuda-emu):
#   OUT/lib/      libcuda.so.1, libnvrtc.so.13 (and an empty libnvrtc-builtins.so.13.0),
#                 libcublas.so.13 (and an empty libcublasLt.so.13), libnccl.so.2
#   OUT/include/  cuda_bf16.h, cohort_emu_runtime.h (what kernels compile against)
#   OUT/cache/    kernel families compiled by the emulator's NVRTC, made on first use
# Point cohort at it with COHORT_CUDA_LIB_DIRS=OUT/lib. Rebuilds only when a source changed;
# safe to run from several processes at once.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-$HERE/../../../target/cuda-emu}
CXX=${COHORT_CUDA_EMU_CXX:-g++}
command -v "$CXX" >/dev/null || { echo "cuda-emu: $CXX not found (the emulator builds with a C++17 compiler; set COHORT_CUDA_EMU_CXX)" >&2; exit 1; }
mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9
STAMP=$(cat "$HERE"/*.cpp "$HERE"/include/*.h "$0" | sha256sum | cut -c1-16)
if [ "$(cat "$OUT/stamp" 2>/dev/null)" = "$STAMP" ]; then exit 0; fi
mkdir -p "$OUT/lib" "$OUT/include"
cp "$HERE"/include/*.h "$OUT/include/"
FLAGS=(-std=c++17 -O2 -fPIC -shared -Wall -Wextra -Werror)
lib() { # lib SONAME SOURCE
  "$CXX" "${FLAGS[@]}" -Wl,-soname,"$1" -o "$OUT/lib/$1.tmp" "$2" -ldl -lpthread
  mv -f "$OUT/lib/$1.tmp" "$OUT/lib/$1"
}
EMPTY=$OUT/empty.cpp
echo '// nothing: cohort opens this library and calls none of it' >"$EMPTY"
lib libcuda.so.1 "$HERE/driver.cpp"
lib libnvrtc.so.13 "$HERE/nvrtc.cpp"
lib libnvrtc-builtins.so.13.0 "$EMPTY"
lib libcublas.so.13 "$HERE/cublas.cpp"
lib libcublasLt.so.13 "$EMPTY"
lib libnccl.so.2 "$HERE/nccl.cpp"
rm -f "$EMPTY"
echo "$STAMP" >"$OUT/stamp"
