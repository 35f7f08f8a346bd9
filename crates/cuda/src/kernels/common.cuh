// Prepended to every kernel family before NVRTC compiles it (NVRTC sees no files but the
// CUDA runtime headers). Conventions: outputs first, then inputs, then weights, then dims
// (llm.c's, as crates/engine/src/backend.rs); element counts are `long long`; a nullable
// pointer argument is a device pointer or 0.
#include <cuda_bf16.h>

// NVRTC has no <cmath>: +inf from its bits.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define COHORT_FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(COHORT_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(COHORT_FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(COHORT_FULL_MASK, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// The order is fixed by the block's shape, so a result never depends on scheduling.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_sum(v);
    __syncthreads();  // an earlier call may still be reading part[]
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < warps ? part[lane] : 0.0f;
    return warp_sum(v);
}

// Maximum over the block, as block_sum.
__device__ float block_max(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < warps ? part[lane] : -INFINITY;
    return warp_max(v);
}

// Grid-stride loop over n elements.
#define FOR_EACH(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)
