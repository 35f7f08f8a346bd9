// The optimizer's passes over the flat fp32 buffers: one AdamW step on master weights (the
// formula of crates/engine/src/optim/kernels.rs, operation by operation, with the fused
// multiply-adds where it has them and none elsewhere), and the squared norm for gradient
// clipping, summed in f64 in a fixed order (per-block partial sums, then those in order).

// AdamW on one segment: p, g, m (exp_avg), v (exp_avg_sq); the scalars as the CPU rounds them.
extern "C" __global__ void adamw_step(float* p, const float* g, float* m, float* v, long long n,
                                      float decay, float lerp_w, float beta2, float one_minus_beta2,
                                      float bc2_sqrt, float eps, float neg_step_size) {
    FOR_EACH(i, n) {
        const float gi = g[i], mi = m[i], vi = v[i];
        const float pd = __fmul_rn(p[i], decay);
        const float mn = fmaf(lerp_w, __fsub_rn(gi, mi), mi);
        const float vn = fmaf(__fmul_rn(one_minus_beta2, gi), gi, __fmul_rn(vi, beta2));
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vn), bc2_sqrt), eps);
        p[i] = __fadd_rn(pd, __fdiv_rn(__fmul_rn(neg_step_size, mn), denom));
        m[i] = mn;
        v[i] = vn;
    }
}

// partial[block] = sum of x[k]^2 (in f64) over the block's `per_block` elements.
extern "C" __global__ void sum_squares_partial(double* partial, const float* x, long long n,
                                               long long per_block) {
    __shared__ double part[32];
    const long long lo = (long long)blockIdx.x * per_block;
    const long long hi = lo + per_block < n ? lo + per_block : n;
    double s = 0.0;
    for (long long k = lo + threadIdx.x; k < hi; k += blockDim.x) {
        const double d = (double)x[k];
        s += d * d;
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    s = warp_sum_f64(s);
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int w = 0; w < warps; w++) t += part[w];
        partial[blockIdx.x] = t;
    }
}

// out[0] = sum of the partials, in order (one thread).
extern "C" __global__ void sum_f64(double* out, const double* partial, int n) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double t = 0.0;
    for (int k = 0; k < n; k++) t += partial[k];
    out[0] = t;
}
