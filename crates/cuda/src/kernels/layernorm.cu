// LayerNorm over the last dimension (eps 1e-5) and its backward, as the CPU's
// layernorm_forward / layernorm_backward: one warp per row; the weight and bias gradients
// are column sums with one thread per column, rows in order (deterministic, no atomics).

#define LN_EPS 1e-5f

// out (N, C) = (inp - mean) * rstd * w + b; mean, rstd (N) for backward; b may be 0.
extern "C" __global__ void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                                             const float* w, const float* b, int N, int C) {
    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= N) return;
    const float* x = inp + row * C;
    float s = 0.0f;
    for (int j = lane; j < C; j += 32) s += x[j];
    const float m = warp_sum(s) / C;
    float v = 0.0f;
    for (int j = lane; j < C; j += 32) {
        const float d = x[j] - m;
        v += d * d;
    }
    const float r = 1.0f / sqrtf(warp_sum(v) / C + LN_EPS);
    float* o = out + row * C;
    for (int j = lane; j < C; j += 32) o[j] = (x[j] - m) * r * w[j] + (b ? b[j] : 0.0f);
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// dinp += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd, dnorm = w * dout.
extern "C" __global__ void layernorm_backward_input(float* dinp, const float* dout, const float* inp,
                                                    const float* mean, const float* rstd,
                                                    const float* w, int N, int C) {
    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= N) return;
    const float* x = inp + row * C;
    const float* d = dout + row * C;
    const float m = mean[row], r = rstd[row];
    float sd = 0.0f, sdn = 0.0f;
    for (int j = lane; j < C; j += 32) {
        const float dn = w[j] * d[j];
        sd += dn;
        sdn += dn * (x[j] - m) * r;
    }
    sd = warp_sum(sd) / C;
    sdn = warp_sum(sdn) / C;
    float* di = dinp + row * C;
    for (int j = lane; j < C; j += 32) {
        const float norm = (x[j] - m) * r;
        di[j] += (w[j] * d[j] - sd - norm * sdn) * r;
    }
}

// dw += sum over rows of norm * dout, db += sum over rows of dout (db may be 0).
extern "C" __global__ void layernorm_backward_params(float* dw, float* db, const float* dout,
                                                     const float* inp, const float* mean,
                                                     const float* rstd, int N, int C) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= C) return;
    float sw = 0.0f, sb = 0.0f;
    for (long long r = 0; r < N; r++) {
        const float d = dout[r * C + j];
        sw += (inp[r * C + j] - mean[r]) * rstd[r] * d;
        sb += d;
    }
    dw[j] += sw;
    if (db) db[j] += sb;
}
