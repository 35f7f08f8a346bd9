// The CUDA CPU emulator's cuda_bf16.h: the part of NVIDIA's header cohort's kernels use
// (__nv_bfloat16 and its conversions), for g++. Round to nearest even, NaN kept quiet, as the
// GPU's cvt.rn.bf16.f32. Never used by a real NVRTC: see ../README.md.
#pragma once
#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
    uint16_t x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f);
    operator float() const {
        uint32_t u = (uint32_t)x << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
};

static inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    __nv_bfloat16 b;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        b.x = (uint16_t)((u >> 16) | 0x40);  // NaN: keep the sign, make it quiet
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        b.x = (uint16_t)(u >> 16);
    }
    return b;
}
static inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
static inline float __bfloat162float(__nv_bfloat16 b) { return (float)b; }
inline __nv_bfloat16::__nv_bfloat16(float f) { x = __float2bfloat16_rn(f).x; }
