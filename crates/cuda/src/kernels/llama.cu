// The Llama-style block's kernels besides the products and attention: RMSNorm, rotary
// position embedding (RoPE) and SwiGLU, with the CPU's semantics (crates/engine/src/cpu/
// rmsnorm.rs, rope.rs, swiglu.rs). RMSNorm is one block per row; its weight gradient is a
// column sum with one thread per column, rows in order (deterministic, no atomics). The token
// embedding alone is encoder.cu's kernels with no position table.

// out (N, C) = inp * rstd * w, rstd (N) = 1 / sqrt(mean(inp^2) + eps).
extern "C" __global__ void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* w,
                                           float eps, int N, int C) {
    const long long row = blockIdx.x;
    if (row >= N) return;
    const float* x = inp + row * C;
    float s = 0.0f;
    for (int j = threadIdx.x; j < C; j += blockDim.x) s += x[j] * x[j];
    const float r = 1.0f / sqrtf(block_sum(s) / C + eps);
    float* o = out + row * C;
    for (int j = threadIdx.x; j < C; j += blockDim.x) o[j] = x[j] * r * w[j];
    if (threadIdx.x == 0) rstd[row] = r;
}

// dinp += rstd * (w * dout - inp * m), m = sum(w * dout * inp) * rstd^2 / C.
extern "C" __global__ void rmsnorm_backward_input(float* dinp, const float* dout, const float* inp,
                                                  const float* rstd, const float* w, int N, int C) {
    const long long row = blockIdx.x;
    if (row >= N) return;
    const float* x = inp + row * C;
    const float* d = dout + row * C;
    const float r = rstd[row];
    float acc = 0.0f;
    for (int j = threadIdx.x; j < C; j += blockDim.x) acc += w[j] * d[j] * x[j];
    const float m = block_sum(acc) * r * r / C;
    float* di = dinp + row * C;
    for (int j = threadIdx.x; j < C; j += blockDim.x) di[j] += r * (w[j] * d[j] - x[j] * m);
}

// dw += sum over rows of inp * rstd * dout, one thread per column, rows in order.
extern "C" __global__ void rmsnorm_backward_weight(float* dw, const float* dout, const float* inp,
                                                   const float* rstd, int N, int C) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= C) return;
    float s = 0.0f;
    for (long long r = 0; r < N; r++) s += inp[r * C + j] * rstd[r] * dout[r * C + j];
    dw[j] += s;
}

// In place, the first `heads` heads (size HS) of each of N rows (stride `width`) turned by the
// angles of the row's position (tables cos, sin: positions x HS/2, `table` floats each) times
// `sign` (1 forward, -1 backward), rotate_half pairing: element i with i + HS/2. A position past
// the tables (the CPU refuses it) turns the pair into NaN, so that the loss shows it.
extern "C" __global__ void rope_rotate(float* x, const unsigned int* pos, const float* cos_t,
                                       const float* sin_t, float sign, long long table, int N,
                                       int width, int heads, int HS) {
    const int half = HS / 2;
    const long long n = (long long)N * heads * half;
    FOR_EACH(e, n) {
        const int i = (int)(e % half);
        const long long rh = e / half;
        const int h = (int)(rh % heads);
        const long long r = rh / heads;
        const long long at = (long long)pos[r] * half;
        float* p = x + r * width + (long long)h * HS + i;
        if (at + half > table) {
            p[0] = p[half] = __int_as_float(0x7fc00000);
            continue;
        }
        const float c = cos_t[at + i], s = sign * sin_t[at + i];
        const float x0 = p[0], x1 = p[half];
        p[0] = x0 * c - x1 * s;
        p[half] = x1 * c + x0 * s;
    }
}

// Where gate column j (of F) sits in a row (N, 2F): natural `[gate | up]`, or interleaved in
// tiles of 16 gate then the same 16 up columns (the last tile narrower). Up is at + width.
#define SWIGLU_TILE 16
__device__ __forceinline__ long long swiglu_gate_at(int j, int F, int interleaved, int* width) {
    if (!interleaved) {
        *width = F;
        return j;
    }
    const int t0 = j / SWIGLU_TILE * SWIGLU_TILE;
    *width = min(SWIGLU_TILE, F - t0);
    return 2LL * t0 + (j - t0);
}

__device__ __forceinline__ float cohort_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// out (N, F) = silu(gate) * up = gate * sigmoid(gate) * up, inp (N, 2F).
extern "C" __global__ void swiglu_forward(float* out, const float* inp, int interleaved, int N, int F) {
    const long long n = (long long)N * F;
    FOR_EACH(e, n) {
        const long long r = e / F;
        const int j = (int)(e % F);
        int width;
        const float* x = inp + 2 * r * F + swiglu_gate_at(j, F, interleaved, &width);
        const float g = x[0], u = x[width];
        out[e] = g * cohort_sigmoid(g) * u;
    }
}

// dinp (N, 2F) natural, overwritten: (dout * up * silu'(gate) | dout * silu(gate)), with
// silu'(g) = s * (1 + g * (1 - s)), s = sigmoid(g); inp natural or interleaved. With `kept`,
// inp (interleaved) holds what swiglu_interleave kept instead of (gate, up): (silu(gate),
// up * silu'(gate)), so that dinp = (dout * kept[up], dout * kept[gate]).
extern "C" __global__ void swiglu_backward(float* dinp, const float* dout, const float* inp,
                                           int interleaved, int kept, int N, int F) {
    const long long n = (long long)N * F;
    FOR_EACH(e, n) {
        const long long r = e / F;
        const int j = (int)(e % F);
        int width;
        const float* x = inp + 2 * r * F + swiglu_gate_at(j, F, interleaved, &width);
        const float g = x[0], u = x[width], d = dout[e];
        float dg, du;
        if (kept) {
            dg = d * u;
            du = d * g;
        } else {
            const float s = cohort_sigmoid(g);
            dg = d * u * s * (1.0f + g * (1.0f - s));
            du = d * g * s;
        }
        dinp[2 * r * F + j] = dg;
        dinp[2 * r * F + F + j] = du;
    }
}

// The fused products' SwiGLU after the product src (N, 2F) natural (cpu::swiglu_finish_unfused):
// pre (N, 2F) interleaved = (gate, up) and out (N, F) = silu(gate) * up; or, with out_bf16 (out
// then unused), out_bf16 = out rounded to bf16 (nearest even) and pre = (silu(gate),
// up * silu'(gate)), what the backward with `kept` reads.
extern "C" __global__ void swiglu_interleave(float* pre, float* out, __nv_bfloat16* out_bf16,
                                             const float* src, int N, int F) {
    const long long n = (long long)N * F;
    FOR_EACH(e, n) {
        const long long r = e / F;
        const int j = (int)(e % F);
        int width;
        float* p = pre + 2 * r * F + swiglu_gate_at(j, F, 1, &width);
        const float g = src[2 * r * F + j], u = src[2 * r * F + F + j];
        if (out_bf16) {
            const float s = cohort_sigmoid(g);
            out_bf16[e] = __float2bfloat16_rn(g * s * u);
            p[0] = g * s;
            p[width] = u * s * (1.0f + g * (1.0f - s));
        } else {
            out[e] = g * cohort_sigmoid(g) * u;
            p[0] = g;
            p[width] = u;
        }
    }
}
