// Elementwise passes: fills, scaling, adds, GELU (GPT-2's tanh form, as the CPU's
// cpu::gelu_forward) and its backward, the residual add with the branch's bias, and column
// sums (the bias gradient). Dropout is not here yet: the CPU's residual and dropout kernels
// take a Dropout key; the GPU ones run without.

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

// dinout *= gelu'(inp).
extern "C" __global__ void gelu_backward(float* dinout, const float* inp, long long n) {
    FOR_EACH(i, n) dinout[i] *= gelu_grad_of(inp[i]);
}

// dinout *= grad (the forward kept GELU's derivative).
extern "C" __global__ void gelu_backward_with_grad(float* dinout, const float* grad, long long n) {
    FOR_EACH(i, n) dinout[i] *= grad[i];
}

// out = residual + (out + bias), rows of c; bias may be 0.
extern "C" __global__ void residual_forward(float* out, const float* residual, const float* bias,
                                            int c, long long n) {
    FOR_EACH(i, n) {
        float o = out[i];
        if (bias) o += bias[i % c];
        out[i] = o + residual[i];
    }
}

// acc (c) += sum over the rows of x (rows, c), one thread per column, rows in order.
extern "C" __global__ void column_sums(float* acc, const float* x, int rows, int c) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= c) return;
    float s = 0.0f;
    for (int r = 0; r < rows; r++) s += x[(long long)r * c + j];
    acc[j] += s;
}
