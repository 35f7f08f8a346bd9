// Causal self-attention on the engine's packed qkv (B, T, (NH + 2 NKV) HS) with an optional key
// padding mask (B, T; 0 = padding) and optional segment ids (B, T; several sequences packed in a
// row, a run of equal ids being one: a query sees the keys from its run's start to itself), in
// the flash style: a warp owns one query row, walks the keys it may see with an online softmax
// (running max and sum), and never stores the (T, T) scores. Forward keeps the log-sum-exp
// (B, NH, T) of the scaled scores, as the CPU's attention_forward; backward recomputes the
// probabilities from it. A query with no visible key gets a zero output, lse -inf and zero
// gradients. Head size up to 32 * MAX_EPL, a multiple of 32 not required. Dropout on the
// probabilities, keyed as the CPU's: the output sums the dropped probabilities; backward applies
// the same mask to dP. Correct first, not fast: one warp-wide dot product per (query, key).
// Grouped key/value heads (GQA, MQA) are read where the qkv product put them: q's NH heads,
// then k's NKV, then v's NKV in each row; query head h attends with key/value head
// h / (NH / NKV). NKV = NH is GPT-2's (B, T, 3C). dqkv has qkv's layout; each key/value head's
// gradient is the sum over its query group, head after head in the group's order (the CPU's).

// Where the heads of row `t` of batch `b` start in a qkv (or dqkv) buffer, in floats.
struct QkvRows {
    long long rs;  // row stride (NH + 2 NKV) * hd
    int hd, nh, nkv;
    __device__ QkvRows(int C, int NH, int NKV) : hd(C / NH), nh(NH), nkv(NKV) {
        rs = (long long)(NH + 2 * NKV) * hd;
    }
    __device__ long long row(int b, int T, int t) const { return ((long long)b * T + t) * rs; }
    __device__ long long q(int h) const { return (long long)h * hd; }
    __device__ long long k(int kvh) const { return (long long)(nh + kvh) * hd; }
    __device__ long long v(int kvh) const { return (long long)(nh + nkv + kvh) * hd; }
};

// The first key query `tq` of batch row `b` may see: the start of its run of equal segment ids,
// 0 without segments (the CPU's segment_start).
__device__ __forceinline__ int segment_start(const unsigned* seg, int b, int T, int tq) {
    if (!seg) return 0;
    const unsigned* r = seg + (long long)b * T;
    int lo = tq;
    while (lo > 0 && r[lo - 1] == r[tq]) lo--;
    return lo;
}

// One past the last query that may see key `tk` of batch row `b`: the end of its run of equal
// segment ids, T without segments.
__device__ __forceinline__ int segment_end(const unsigned* seg, int b, int T, int tk) {
    if (!seg) return T;
    const unsigned* r = seg + (long long)b * T;
    int hi = tk + 1;
    while (hi < T && r[hi] == r[tk]) hi++;
    return hi;
}

#define MAX_EPL 4  // elements of a head vector per lane: head size <= 128

// x after dropout on the probability (query row, key) = element `at` = (bh * T + tq) * T + key
// of the site, as the CPU's attention numbers them; p_drop = 0: x.
__device__ __forceinline__ float kept(unsigned long long key, float p_drop, float drop_scale,
                                      unsigned long long at, float x) {
    if (p_drop <= 0.0f) return x;
    return dropout_keep(key, p_drop, at) ? x * drop_scale : 0.0f;
}

// out (B, T, C), lse (B, NH, T) from qkv (B, T, (NH + 2 NKV) HS); mask and seg may be 0.
extern "C" __global__ void attention_forward(float* out, float* lse, const float* qkv,
                                             const unsigned char* mask, const unsigned* seg, int B,
                                             int T, int C, int NH, int NKV, float p_drop,
                                             unsigned long long key) {
    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= (long long)B * NH * T) return;
    const int tq = (int)(row % T);
    const long long bh = row / T;
    const int h = (int)(bh % NH), b = (int)(bh / NH);
    const QkvRows L(C, NH, NKV);
    const int hd = L.hd, kvh = h / (NH / NKV);
    const float scale = 1.0f / sqrtf((float)hd);
    const float drop_scale = 1.0f / (1.0f - p_drop);
    const float* qr = qkv + L.row(b, T, tq) + L.q(h);
    float q[MAX_EPL], acc[MAX_EPL];
#pragma unroll
    for (int e = 0; e < MAX_EPL; e++) {
        const int d = lane + 32 * e;
        q[e] = d < hd ? qr[d] : 0.0f;
        acc[e] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int j = segment_start(seg, b, T, tq); j <= tq; j++) {
        if (mask && mask[(long long)b * T + j] == 0) continue;
        const float* k = qkv + L.row(b, T, j) + L.k(kvh);
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < MAX_EPL; e++) {
            const int d = lane + 32 * e;
            if (d < hd) s += q[e] * k[d];
        }
        s = warp_sum(s) * scale;
        const float mn = fmaxf(m, s);
        const float corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
        const float pv = kept(key, p_drop, drop_scale, row * T + j, p);
        const float* v = qkv + L.row(b, T, j) + L.v(kvh);
#pragma unroll
        for (int e = 0; e < MAX_EPL; e++) {
            const int d = lane + 32 * e;
            if (d < hd) acc[e] = acc[e] * corr + pv * v[d];
        }
        m = mn;
    }
    float* o = out + ((long long)b * T + tq) * C + h * hd;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int e = 0; e < MAX_EPL; e++) {
        const int d = lane + 32 * e;
        if (d < hd) o[d] = acc[e] * inv;
    }
    if (lane == 0) lse[row] = l > 0.0f ? m + logf(l) : -INFINITY;
}

// Backward, first pass, a warp per query row i: recomputes o_i (into recompute_out when it is
// not 0), keeps delta_i = dout_i . o_i (B, NH, T) for the second pass, and writes dq_i into
// dqkv's q columns: dq_i = sum_j ds_ij k_j, ds_ij = p_ij (dout_i . v_j - delta_i) * scale.
extern "C" __global__ void attention_backward_query(float* dqkv, float* recompute_out, float* delta,
                                                    const float* dout, const float* qkv,
                                                    const float* lse, const unsigned char* mask,
                                                    const unsigned* seg, int B, int T, int C,
                                                    int NH, int NKV, float p_drop,
                                                    unsigned long long key) {
    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= (long long)B * NH * T) return;
    const int tq = (int)(row % T);
    const long long bh = row / T;
    const int h = (int)(bh % NH), b = (int)(bh / NH);
    const QkvRows L(C, NH, NKV);
    const int hd = L.hd, kvh = h / (NH / NKV);
    const float scale = 1.0f / sqrtf((float)hd);
    const float drop_scale = 1.0f / (1.0f - p_drop);
    const float* qr = qkv + L.row(b, T, tq) + L.q(h);
    const float* go = dout + ((long long)b * T + tq) * C + h * hd;
    const float l = lse[row];
    float q[MAX_EPL], g[MAX_EPL], o[MAX_EPL], dq[MAX_EPL];
#pragma unroll
    for (int e = 0; e < MAX_EPL; e++) {
        const int d = lane + 32 * e;
        q[e] = d < hd ? qr[d] : 0.0f;
        g[e] = d < hd ? go[d] : 0.0f;
        o[e] = 0.0f;
        dq[e] = 0.0f;
    }
    const bool any = l != -INFINITY;
    const int lo = segment_start(seg, b, T, tq);
    for (int j = lo; any && j <= tq; j++) {
        if (mask && mask[(long long)b * T + j] == 0) continue;
        const float* k = qkv + L.row(b, T, j) + L.k(kvh);
        const float* v = qkv + L.row(b, T, j) + L.v(kvh);
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < MAX_EPL; e++) {
            const int d = lane + 32 * e;
            if (d < hd) s += q[e] * k[d];
        }
        const float pv = kept(key, p_drop, drop_scale, row * T + j, expf(warp_sum(s) * scale - l));
#pragma unroll
        for (int e = 0; e < MAX_EPL; e++) {
            const int d = lane + 32 * e;
            if (d < hd) o[e] += pv * v[d];
        }
    }
    float dl = 0.0f;
#pragma unroll
    for (int e = 0; e < MAX_EPL; e++) dl += g[e] * o[e];
    dl = warp_sum(dl);
    for (int j = lo; any && j <= tq; j++) {
        if (mask && mask[(long long)b * T + j] == 0) continue;
        const float* k = qkv + L.row(b, T, j) + L.k(kvh);
        const float* v = qkv + L.row(b, T, j) + L.v(kvh);
        float s = 0.0f, dp = 0.0f;
#pragma unroll
        for (int e = 0; e < MAX_EPL; e++) {
            const int d = lane + 32 * e;
            if (d < hd) {
                s += q[e] * k[d];
                dp += g[e] * v[d];
            }
        }
        const float p = expf(warp_sum(s) * scale - l);
        const float ds = p * (kept(key, p_drop, drop_scale, row * T + j, warp_sum(dp)) - dl) * scale;
#pragma unroll
        for (int e = 0; e < MAX_EPL; e++) {
            const int d = lane + 32 * e;
            if (d < hd) dq[e] += ds * k[d];
        }
    }
    float* dqr = dqkv + L.row(b, T, tq) + L.q(h);
    float* ro = recompute_out ? recompute_out + ((long long)b * T + tq) * C + h * hd : 0;
#pragma unroll
    for (int e = 0; e < MAX_EPL; e++) {
        const int d = lane + 32 * e;
        if (d < hd) {
            dqr[d] = dq[e];
            if (ro) ro[d] = o[e];
        }
    }
    if (lane == 0) delta[row] = dl;
}

// Backward, second pass, a warp per key row j of a key/value head: dk_j = sum_i ds_ij q_i and
// dv_j = sum_i p_ij dout_i over the queries i >= j of its segment that see it, for each query
// head of the group in order (each head's sums added to the total in turn), written into dqkv's
// k and v columns (no atomics: each warp owns its key's columns).
extern "C" __global__ void attention_backward_key(float* dqkv, const float* delta, const float* dout,
                                                  const float* qkv, const float* lse,
                                                  const unsigned char* mask, const unsigned* seg,
                                                  int B, int T, int C, int NH, int NKV,
                                                  float p_drop, unsigned long long key) {
    const int lane = threadIdx.x % 32;
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= (long long)B * NKV * T) return;
    const int tk = (int)(row % T);
    const long long bkv = row / T;
    const int kvh = (int)(bkv % NKV), b = (int)(bkv / NKV);
    const QkvRows L(C, NH, NKV);
    const int hd = L.hd, group = NH / NKV;
    const float scale = 1.0f / sqrtf((float)hd);
    const float drop_scale = 1.0f / (1.0f - p_drop);
    const float* kr = qkv + L.row(b, T, tk) + L.k(kvh);
    const float* vr = qkv + L.row(b, T, tk) + L.v(kvh);
    float k[MAX_EPL], v[MAX_EPL], dk[MAX_EPL], dv[MAX_EPL];
#pragma unroll
    for (int e = 0; e < MAX_EPL; e++) {
        const int d = lane + 32 * e;
        k[e] = d < hd ? kr[d] : 0.0f;
        v[e] = d < hd ? vr[d] : 0.0f;
        dk[e] = 0.0f;
        dv[e] = 0.0f;
    }
    const bool visible = !(mask && mask[(long long)b * T + tk] == 0);
    const int hi = segment_end(seg, b, T, tk);
    for (int h = kvh * group; visible && h < (kvh + 1) * group; h++) {
        const long long bh = (long long)b * NH + h;
        float hk[MAX_EPL], hv[MAX_EPL];
#pragma unroll
        for (int e = 0; e < MAX_EPL; e++) hk[e] = hv[e] = 0.0f;
        for (int i = tk; i < hi; i++) {
            const float l = lse[bh * T + i];
            if (l == -INFINITY) continue;
            const float* q = qkv + L.row(b, T, i) + L.q(h);
            const float* go = dout + ((long long)b * T + i) * C + h * hd;
            float s = 0.0f, dp = 0.0f;
#pragma unroll
            for (int e = 0; e < MAX_EPL; e++) {
                const int d = lane + 32 * e;
                if (d < hd) {
                    s += q[d] * k[e];
                    dp += go[d] * v[e];
                }
            }
            const float p = expf(warp_sum(s) * scale - l);
            const unsigned long long at = (bh * T + i) * T + tk;
            const float ds =
                p * (kept(key, p_drop, drop_scale, at, warp_sum(dp)) - delta[bh * T + i]) * scale;
            const float pv = kept(key, p_drop, drop_scale, at, p);
#pragma unroll
            for (int e = 0; e < MAX_EPL; e++) {
                const int d = lane + 32 * e;
                if (d < hd) {
                    hk[e] += ds * q[d];
                    hv[e] += pv * go[d];
                }
            }
        }
#pragma unroll
        for (int e = 0; e < MAX_EPL; e++) {
            dk[e] += hk[e];
            dv[e] += hv[e];
        }
    }
    float* dkr = dqkv + L.row(b, T, tk) + L.k(kvh);
    float* dvr = dqkv + L.row(b, T, tk) + L.v(kvh);
#pragma unroll
    for (int e = 0; e < MAX_EPL; e++) {
        const int d = lane + 32 * e;
        if (d < hd) {
            dkr[d] = dk[e];
            dvr[d] = dv[e];
        }
    }
}
