// Elementwise passes: fills, scaling, adds, GELU (GPT-2's tanh form, as the CPU's
// cpu::gelu_forward) and its backward, the residual add with the branch's bias and dropout,
// dropout and its backward (the CPU's keyed decisions, bit for bit), and column sums (the
// bias gradient).

// out = value.
extern "C" __global__ void fill_f32(float* out, float value, long long n) {
    FOR_EACH(i, n) out[i] = value;
}

// x *= s (gradient clipping's scale).
extern "C" __global__ void scale_f32(float* x, float s, long long n) {
    FOR_EACH(i, n) x[i] *= s;
}

// out += x (residual adds, gradient accumulation).
extern "C" __global__ void add_f32(float* out, const float* x, long long n) {
    FOR_EACH(i, n) out[i] += x[i];
}

// out += bias, rows of c (a product's bias).
extern "C" __global__ void add_bias_f32(float* out, const float* bias, int c, long long n) {
    FOR_EACH(i, n) out[i] += bias[i % c];
}

#define GELU_S 0.7978845608028654f  // sqrt(2 / pi)
#define GELU_C 0.044715f

__device__ __forceinline__ float gelu_of(float x) {
    const float th = tanhf(GELU_S * (x + GELU_C * x * x * x));
    return 0.5f * x * (1.0f + th);
}

__device__ __forceinline__ float gelu_grad_of(float x) {
    const float th = tanhf(GELU_S * (x + GELU_C * x * x * x));
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * GELU_S * (1.0f + 3.0f * GELU_C * x * x);
}

// out = gelu(inp).
extern "C" __global__ void gelu_forward(float* out, const float* inp, long long n) {
    FOR_EACH(i, n) out[i] = gelu_of(inp[i]);
}

// out = gelu(pre), pre = gelu'(pre): one tanh for both (a backward's recompute of GELU's
// output that keeps the derivative for gelu_backward_with_grad).
extern "C" __global__ void gelu_forward_and_grad(float* out, float* pre, long long n) {
    FOR_EACH(i, n) {
        const float x = pre[i];
        const float th = tanhf(GELU_S * (x + GELU_C * x * x * x));
        out[i] = 0.5f * x * (1.0f + th);
        pre[i] = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * GELU_S * (1.0f + 3.0f * GELU_C * x * x);
    }
}

// dinout *= gelu'(inp).
extern "C" __global__ void gelu_backward(float* dinout, const float* inp, long long n) {
    FOR_EACH(i, n) dinout[i] *= gelu_grad_of(inp[i]);
}

// dinout *= grad (the forward kept GELU's derivative).
extern "C" __global__ void gelu_backward_with_grad(float* dinout, const float* grad, long long n) {
    FOR_EACH(i, n) dinout[i] *= grad[i];
}

// out = residual + dropout(out + bias), rows of c; bias may be 0; p = 0: no dropout. The
// dropout element is the flat index in out.
extern "C" __global__ void residual_forward(float* out, const float* residual, const float* bias,
                                            int c, long long n, float p, unsigned long long key) {
    const float scale = 1.0f / (1.0f - p);
    FOR_EACH(i, n) {
        float o = out[i];
        if (bias) o += bias[i % c];
        if (p > 0.0f) o = dropout_keep(key, p, (unsigned long long)i) ? o * scale : 0.0f;
        out[i] = o + residual[i];
    }
}

// x = dropout(x), element i keyed offset + i.
extern "C" __global__ void dropout_forward(float* x, float p, unsigned long long key, long long offset,
                                           long long n) {
    const float scale = 1.0f / (1.0f - p);
    FOR_EACH(i, n) x[i] = dropout_keep(key, p, (unsigned long long)(offset + i)) ? x[i] * scale : 0.0f;
}

// dx = the same mask and scale applied to dy (overwritten).
extern "C" __global__ void dropout_backward(float* dx, const float* dy, float p, unsigned long long key,
                                            long long offset, long long n) {
    const float scale = 1.0f / (1.0f - p);
    FOR_EACH(i, n) dx[i] = dropout_keep(key, p, (unsigned long long)(offset + i)) ? dy[i] * scale : 0.0f;
}

// acc (c) += sum over the rows of x (rows, c), one thread per column, rows in order.
extern "C" __global__ void column_sums(float* acc, const float* x, int rows, int c) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= c) return;
    float s = 0.0f;
    for (int r = 0; r < rows; r++) s += x[(long long)r * c + j];
    acc[j] += s;
}
