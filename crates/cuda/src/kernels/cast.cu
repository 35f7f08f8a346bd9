// Casts between the fp32 master copies and the bf16 operands of the tensor-core products
// (round to nearest even, as the CPU's round_to_bf16).

extern "C" __global__ void f32_to_bf16(__nv_bfloat16* out, const float* inp, long long n) {
    FOR_EACH(i, n) out[i] = __float2bfloat16_rn(inp[i]);
}

extern "C" __global__ void bf16_to_f32(float* out, const __nv_bfloat16* inp, long long n) {
    FOR_EACH(i, n) out[i] = __bfloat162float(inp[i]);
}
