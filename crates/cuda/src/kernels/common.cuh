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

// The engine's dropout decision (crates/engine/src/dropout.rs, cohort_rng::mix64): element i
// of a site keyed `key` is kept when the top 24 bits of mix64(key + i * GOLDEN_GAMMA) reach
// p * 2^24; kept elements are scaled by 1 / (1 - p). The same bits as the CPU's.
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ bool dropout_keep(unsigned long long key, float p, unsigned long long i) {
    const unsigned long long h = mix64(key + i * 0x9E3779B97F4A7C15ull);
    return (float)(h >> 40) >= p * 16777216.0f;
}

// Grid-stride loop over n elements.
#define FOR_EACH(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)
