// Causal self-attention on the engine's packed qkv (B, T, (NH + 2 NKV) HS) with an optional key
// padding mask (B, T; 0 = padding) and optional segment ids (B, T; several sequences packed in a
// row, a run of equal ids being one: a query sees the keys from its run's start to itself), in
// the flash-attention-2 style for fp32: the (T, T) scores are never stored; a block owns a tile
// of queries (or of keys, in backward) of one head, stages the other side's rows tile by tile in
// shared memory, and each thread computes a small block of (query, key) dot products with plain
// FMAs from shared memory. Forward keeps the log-sum-exp (B, NH, T) of the scaled scores, as the
// CPU's attention_forward; backward recomputes the probabilities from it.
//
// Why this shape: the first version gave each query row a warp and each (query, key) pair one
// warp-wide dot product (5 shuffles, the exp and the dropout hash computed by all 32 lanes, k and
// v read from global memory per query). Here a (query, key) pair costs one thread HS FMAs per
// product, its exp and its dropout hash once, and K/V rows are read from global memory once per
// query tile instead of once per query row. Row reductions (the running max, the sums) take 3
// shuffles per row per key tile, not per key.
//
// Thread layout, every kernel: ATT_NT = 128 threads; thread t is lane j = t % 8 of row group
// g = t / 8 (16 groups). In a product tile (rows x cols) group g owns RI consecutive rows and
// lane j the columns j, j + 8, ...; in an output tile (rows x head dims) group g owns the same
// rows and lane j the dims 4j + 32e + {0..3}, e < 4. So the 8 lanes that own a row's scores also
// own its output, and a row's reductions stay within 8 lanes of one warp.
//   attention_forward        query tile 32 rows (RI = 2), key tiles 32 (4 columns per lane).
//   attention_backward_delta as forward, with the probabilities from the stored lse: recomputes
//                            o (into recompute_out when it is not 0) and delta_i = dout_i . o_i.
//   attention_backward_dq    query tile 16 rows (RI = 1), key tiles 16: dq_i = sum_j ds_ij k_j.
//   attention_backward_dkv   key tile 16 rows, query tiles 16, over the query heads of its key/
//                            value head in the group's order: dk_j = sum_i ds_ij q_i and
//                            dv_j = sum_i p~_ij dout_i (p~ after dropout).
// with ds_ij = p_ij (dropout(dout_i . v_j) - delta_i) * scale. Each output element has one
// owner thread (no atomics): dq by query tile, dk and dv by key tile, so results never depend on
// scheduling. Shared memory is static (rows padded to ATT_SROW = HS_max + 4 floats so that the 8
// lanes reading 8 consecutive rows at one column hit distinct banks): forward and delta stage Q
// (32 rows) and K then V (32 rows, one buffer) and the 32 x 32 probabilities, about 37 KiB; dq
// and dkv stage four 16-row tiles (Q, dout, K, V) and their 16 x 16 products, about 35 KiB
// (static shared memory stops at 48 KiB; four 32-row fp32 tiles of head size 128 need 66 KiB,
// hence backward's 16-row tiles). Registers stay at or below 128 per thread (ptxas, sm_80 and
// sm_90), so registers allow 4 blocks of 128 threads per SM.
//
// Masking: a query sees key j when lo(query) <= j <= query (lo: its segment's start) and j is
// not padding; a block visits only the tiles that hold such pairs (the causal triangle, cut
// at the segment starts). A query with no visible key gets a zero output, lse -inf and zero
// gradients. Head size up to ATT_HD = 128, a multiple of 4 (or 32) not required: staged rows are
// zero past it. Dropout on the probabilities, keyed as the CPU's (element (bh T + query) T + key):
// the output sums the dropped probabilities; backward applies the same mask to dP. Grouped
// key/value heads (GQA, MQA) are read where the qkv product put them: q's NH heads, then k's
// NKV, then v's NKV in each row; query head h attends with key/value head h / (NH / NKV).
// NKV = NH is GPT-2's (B, T, 3C). dqkv has qkv's layout; each key/value head's gradient is
// accumulated over its query group head after head in the group's order (the CPU's order of
// heads; within tolerance of its sums).

#define ATT_NT 128   // threads per block
#define ATT_HD 128   // the largest head size
#define ATT_SROW (ATT_HD + 4)  // floats per staged row (see above)
#define FWD_Q 32     // forward and delta: queries per block (16 groups x 2 rows)
#define FWD_K 32     // forward and delta: keys per tile (8 lanes x 4)
#define BWD_T 16     // dq and dkv: rows per tile, both sides (16 groups x 1, 8 lanes x 2)

// Vector loads from shared memory (16-byte aligned rows, columns a multiple of 4).
typedef float4 att_f4;
__device__ __forceinline__ att_f4 ld4(const float* p) {
    return *reinterpret_cast<const float4*>(p);
}

typedef float AttRow[ATT_SROW];

// The first key query `tq` of batch row `b` may see: the start of its run of equal segment ids,
// 0 without segments (the CPU's segment_start). `floor`, `at_floor`: a query at or below tq whose
// start is known; the scan stops there (the run reaching it has its start).
__device__ __forceinline__ int segment_start(const unsigned* seg, int b, int T, int tq, int floor,
                                             int at_floor) {
    if (!seg) return 0;
    const unsigned* r = seg + (long long)b * T;
    int lo = tq;
    while (lo > floor && r[lo - 1] == r[tq]) lo--;
    return lo == floor ? at_floor : lo;
}

// One past the last query that may see key `tk` of batch row `b`: the end of its run of equal
// segment ids, T without segments. `ceil`, `at_ceil`: a key at or above tk whose end is known.
__device__ __forceinline__ int segment_end(const unsigned* seg, int b, int T, int tk, int ceil,
                                           int at_ceil) {
    if (!seg) return T;
    const unsigned* r = seg + (long long)b * T;
    int hi = tk;
    while (hi < ceil && r[hi + 1] == r[tk]) hi++;
    return hi == ceil ? at_ceil : hi + 1;
}

// x after dropout on the probability (query row, key) = element `at` = (bh * T + tq) * T + key
// of the site, as the CPU's attention numbers them; p_drop = 0: x.
__device__ __forceinline__ float kept(unsigned long long key, float p_drop, float drop_scale,
                                      unsigned long long at, float x) {
    if (p_drop <= 0.0f) return x;
    return dropout_keep(key, p_drop, at) ? x * drop_scale : 0.0f;
}

// Stages rows t0 .. t0 + n - 1 (row t at src + t * stride, hd floats) into dst[0 .. n), zeros past
// hd (up to hd4, hd rounded up to 4) and for rows at or past T. A warp per row, lanes along the
// row: reads coalesce.
__device__ __forceinline__ void stage_rows(AttRow* dst, int n, const float* src, long long stride,
                                           int t0, int T, int hd, int hd4) {
    const int lane = threadIdx.x % 32;
    for (int r = threadIdx.x / 32; r < n; r += ATT_NT / 32) {
        const float* s = t0 + r < T ? src + (long long)(t0 + r) * stride : 0;
        for (int d = lane; d < hd4; d += 32) dst[r][d] = s && d < hd ? s[d] : 0.0f;
    }
}

// acc[i][c] = A[ar + i] . Bm[j + 8c] over the first hd4 features: RI x CJ dot products, RI + CJ
// 16-byte loads per 4 RI CJ FMAs.
template <int RI, int CJ>
__device__ __forceinline__ void tile_dots(float (&acc)[RI][CJ], const AttRow* A, const AttRow* Bm,
                                          int ar, int j, int hd4) {
#pragma unroll
    for (int i = 0; i < RI; i++)
#pragma unroll
        for (int c = 0; c < CJ; c++) acc[i][c] = 0.0f;
    // Not unrolled: one step is already RI CJ x 4 independent FMAs, and unrolling it kept
    // attention_forward at ~137 registers (3 blocks per SM) instead of <= 128 (4 blocks).
#pragma unroll 1
    for (int d = 0; d < hd4; d += 4) {
        float a[RI][4], b[CJ][4];
#pragma unroll
        for (int i = 0; i < RI; i++) {
            const att_f4 v = ld4(&A[ar + i][d]);
            a[i][0] = v.x, a[i][1] = v.y, a[i][2] = v.z, a[i][3] = v.w;
        }
#pragma unroll
        for (int c = 0; c < CJ; c++) {
            const att_f4 v = ld4(&Bm[j + 8 * c][d]);
            b[c][0] = v.x, b[c][1] = v.y, b[c][2] = v.z, b[c][3] = v.w;
        }
#pragma unroll
        for (int u = 0; u < 4; u++)
#pragma unroll
            for (int i = 0; i < RI; i++)
#pragma unroll
                for (int c = 0; c < CJ; c++) acc[i][c] = fmaf(a[i][u], b[c][u], acc[i][c]);
    }
}

// o[i][4e + u] += sum_c P[pr + i][c] Bm[c][4j + 32e + u] for c < W, the dims below hd: the
// output tile's update from a (rows x W) product tile in shared memory and W staged rows.
template <int RI, int W>
__device__ __forceinline__ void tile_mix(float (&o)[RI][16], const float (*P)[W + 1],
                                         const AttRow* Bm, int pr, int j, int hd) {
#pragma unroll 2
    for (int c = 0; c < W; c++) {
        float p[RI];
#pragma unroll
        for (int i = 0; i < RI; i++) p[i] = P[pr + i][c];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            if (4 * j + 32 * e >= hd) continue;
            const att_f4 v = ld4(&Bm[c][4 * j + 32 * e]);
#pragma unroll
            for (int i = 0; i < RI; i++) {
                o[i][4 * e + 0] = fmaf(p[i], v.x, o[i][4 * e + 0]);
                o[i][4 * e + 1] = fmaf(p[i], v.y, o[i][4 * e + 1]);
                o[i][4 * e + 2] = fmaf(p[i], v.z, o[i][4 * e + 2]);
                o[i][4 * e + 3] = fmaf(p[i], v.w, o[i][4 * e + 3]);
            }
        }
    }
}

// Sum (or max) over the 8 lanes that share a row group.
__device__ __forceinline__ float group_sum(float v) {
    for (int o = 1; o < 8; o <<= 1) v += __shfl_xor_sync(COHORT_FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float group_max(float v) {
    for (int o = 1; o < 8; o <<= 1) v = fmaxf(v, __shfl_xor_sync(COHORT_FULL_MASK, v, o));
    return v;
}

// Where the heads of a batch row start in a qkv (or dqkv) buffer, in floats.
struct QkvCols {
    long long rs;  // row stride (NH + 2 NKV) * hd
    int hd, nh, nkv;
    __device__ QkvCols(int C, int NH, int NKV) : hd(C / NH), nh(NH), nkv(NKV) {
        rs = (long long)(NH + 2 * NKV) * hd;
    }
    __device__ long long batch(int b, int T) const { return (long long)b * T * rs; }
    __device__ long long q(int h) const { return (long long)h * hd; }
    __device__ long long k(int kvh) const { return (long long)(nh + kvh) * hd; }
    __device__ long long v(int kvh) const { return (long long)(nh + nkv + kvh) * hd; }
};

// The forward (RECOMPUTE false: online softmax, writes out and lse) or the backward's first pass
// (RECOMPUTE true: probabilities from lse_in, writes delta and, when given, out) for query tile
// blockIdx.x (counted from the last, whose causal triangle is the largest, so that the longest
// blocks start first) of (batch, head) blockIdx.y.
template <bool RECOMPUTE>
__device__ __forceinline__ void query_sweep(float* out, float* lse_out, float* delta,
                                            const float* dout, const float* lse_in,
                                            const float* qkv, const unsigned char* mask,
                                            const unsigned* seg, int T, int C, int NH, int NKV,
                                            float p_drop, unsigned long long key) {
    constexpr int RI = FWD_Q / 16, CJ = FWD_K / 8;
    alignas(16) __shared__ float sq[FWD_Q][ATT_SROW];
    alignas(16) __shared__ float skv[FWD_K][ATT_SROW];
    __shared__ float sp[FWD_Q][FWD_K + 1];
    __shared__ int skey[FWD_K];  // key of the tile is not padding
    const int tid = threadIdx.x, g = tid / 8, j = tid % 8;
    const int q0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * FWD_Q;
    const long long bh = blockIdx.y;
    const int h = (int)(bh % NH), b = (int)(bh / NH);
    const QkvCols L(C, NH, NKV);
    const int hd = L.hd, hd4 = (hd + 3) & ~3, kvh = h / (NH / NKV);
    const float scale = 1.0f / sqrtf((float)hd);
    const float drop_scale = 1.0f / (1.0f - p_drop);
    const float* base = qkv + L.batch(b, T);
    stage_rows(sq, FWD_Q, base + L.q(h), L.rs, q0, T, hd, hd4);
    // The first key any query of the tile sees; each row's own first key.
    const int klo = segment_start(seg, b, T, q0, 0, 0);
    int tq[RI], lo[RI];
    float m[RI], l[RI], o[RI][16];
#pragma unroll
    for (int i = 0; i < RI; i++) {
        tq[i] = q0 + g * RI + i;
        lo[i] = tq[i] < T ? segment_start(seg, b, T, tq[i], q0, klo) : T;
        m[i] = RECOMPUTE && tq[i] < T ? lse_in[bh * T + tq[i]] : -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int d = 0; d < 16; d++) o[i][d] = 0.0f;
    }
    const int khi = min(q0 + FWD_Q, T);  // one past the last key of the tile's last query
    for (int k0 = klo / FWD_K * FWD_K; k0 < khi; k0 += FWD_K) {
        __syncthreads();  // the previous tile's readers of skv and sp are done
        stage_rows(skv, FWD_K, base + L.k(kvh), L.rs, k0, T, hd, hd4);
        if (tid < FWD_K) {
            const int t = k0 + tid;
            skey[tid] = t < T && !(mask && mask[(long long)b * T + t] == 0);
        }
        __syncthreads();
        float s[RI][CJ];
        tile_dots<RI, CJ>(s, sq, skv, g * RI, j, hd4);
#pragma unroll
        for (int i = 0; i < RI; i++) {
            float tmax = -INFINITY;
#pragma unroll
            for (int c = 0; c < CJ; c++) {
                const int t = k0 + j + 8 * c;
                const bool vis = t >= lo[i] && t <= tq[i] && skey[j + 8 * c];
                s[i][c] = vis ? s[i][c] * scale : -INFINITY;
                tmax = fmaxf(tmax, s[i][c]);
            }
            float mn = m[i];
            if (!RECOMPUTE) {
                mn = fmaxf(mn, group_max(tmax));
                // m = -inf: nothing seen yet, so o and l are zero and any factor does
                const float corr = m[i] == -INFINITY ? 0.0f : expf(m[i] - mn);
                l[i] *= corr;
#pragma unroll
                for (int d = 0; d < 16; d++) o[i][d] *= corr;
                m[i] = mn;
            }
            const unsigned long long row = (unsigned long long)(bh * T + tq[i]) * T;
#pragma unroll
            for (int c = 0; c < CJ; c++) {
                const float p = s[i][c] == -INFINITY ? 0.0f : expf(s[i][c] - mn);
                l[i] += p;
                sp[g * RI + i][j + 8 * c] =
                    p > 0.0f ? kept(key, p_drop, drop_scale, row + k0 + j + 8 * c, p) : 0.0f;
            }
        }
        __syncthreads();  // the scores are read; skv takes V
        stage_rows(skv, FWD_K, base + L.v(kvh), L.rs, k0, T, hd, hd4);
        __syncthreads();
        tile_mix<RI, FWD_K>(o, sp, skv, g * RI, j, hd);
    }
#pragma unroll
    for (int i = 0; i < RI; i++) {
        if (RECOMPUTE) {
            float dl = 0.0f;
            const float* go = dout + ((long long)b * T + min(tq[i], T - 1)) * C + h * hd;
#pragma unroll
            for (int e = 0; e < 4; e++)
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const int d = 4 * j + 32 * e + u;
                    if (d < hd && tq[i] < T) dl = fmaf(go[d], o[i][4 * e + u], dl);
                }
            dl = group_sum(dl);
            if (tq[i] >= T) continue;
            if (j == 0) delta[bh * T + tq[i]] = dl;
            if (!out) continue;
        } else {
            const float lt = group_sum(l[i]);
            if (tq[i] >= T) continue;
            const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
#pragma unroll
            for (int d = 0; d < 16; d++) o[i][d] *= inv;
            if (j == 0) lse_out[bh * T + tq[i]] = lt > 0.0f ? m[i] + logf(lt) : -INFINITY;
        }
        float* orow = out + ((long long)b * T + tq[i]) * C + h * hd;
#pragma unroll
        for (int e = 0; e < 4; e++)
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int d = 4 * j + 32 * e + u;
                if (d < hd) orow[d] = o[i][4 * e + u];
            }
    }
}

// out (B, T, C), lse (B, NH, T) from qkv (B, T, (NH + 2 NKV) HS); mask and seg may be 0.
// Grid (ceil(T / FWD_Q), B * NH), ATT_NT threads.
extern "C" __global__ void attention_forward(float* out, float* lse, const float* qkv,
                                             const unsigned char* mask, const unsigned* seg, int B,
                                             int T, int C, int NH, int NKV, float p_drop,
                                             unsigned long long key) {
    query_sweep<false>(out, lse, 0, 0, 0, qkv, mask, seg, T, C, NH, NKV, p_drop, key);
}

// Backward, first pass: delta (B, NH, T) = rowsum(dout * o) with o recomputed from lse (into
// recompute_out when it is not 0). Grid and block as attention_forward.
extern "C" __global__ void attention_backward_delta(float* recompute_out, float* delta,
                                                    const float* dout, const float* qkv,
                                                    const float* lse, const unsigned char* mask,
                                                    const unsigned* seg, int B, int T, int C,
                                                    int NH, int NKV, float p_drop,
                                                    unsigned long long key) {
    query_sweep<true>(recompute_out, 0, delta, dout, lse, qkv, mask, seg, T, C, NH, NKV, p_drop,
                      key);
}

// Backward: dq of query tile blockIdx.x (from the last, as forward) of (batch, head)
// blockIdx.y, into dqkv's q columns: dq_i = sum_j ds_ij k_j over the key tiles the tile sees.
// Grid (ceil(T / BWD_T), B * NH), ATT_NT threads; needs delta from attention_backward_delta.
extern "C" __global__ void attention_backward_dq(float* dqkv, const float* delta, const float* dout,
                                                 const float* qkv, const float* lse,
                                                 const unsigned char* mask, const unsigned* seg,
                                                 int B, int T, int C, int NH, int NKV, float p_drop,
                                                 unsigned long long key) {
    alignas(16) __shared__ float sq[BWD_T][ATT_SROW];
    alignas(16) __shared__ float sdo[BWD_T][ATT_SROW];
    alignas(16) __shared__ float sk[BWD_T][ATT_SROW];
    alignas(16) __shared__ float sv[BWD_T][ATT_SROW];
    __shared__ float sds[BWD_T][BWD_T + 1];
    __shared__ int skey[BWD_T];
    const int tid = threadIdx.x, g = tid / 8, j = tid % 8;
    const int q0 = ((int)gridDim.x - 1 - (int)blockIdx.x) * BWD_T;
    const long long bh = blockIdx.y;
    const int h = (int)(bh % NH), b = (int)(bh / NH);
    const QkvCols L(C, NH, NKV);
    const int hd = L.hd, hd4 = (hd + 3) & ~3, kvh = h / (NH / NKV);
    const float scale = 1.0f / sqrtf((float)hd);
    const float drop_scale = 1.0f / (1.0f - p_drop);
    const float* base = qkv + L.batch(b, T);
    stage_rows(sq, BWD_T, base + L.q(h), L.rs, q0, T, hd, hd4);
    stage_rows(sdo, BWD_T, dout + (long long)b * T * C + h * hd, C, q0, T, hd, hd4);
    const int klo = segment_start(seg, b, T, q0, 0, 0);
    const int tq = q0 + g;
    const int lo = tq < T ? segment_start(seg, b, T, tq, q0, klo) : T;
    const float l = tq < T ? lse[bh * T + tq] : -INFINITY;
    const float dl = tq < T ? delta[bh * T + tq] : 0.0f;
    const unsigned long long row = (unsigned long long)(bh * T + tq) * T;
    float dq[1][16];
#pragma unroll
    for (int d = 0; d < 16; d++) dq[0][d] = 0.0f;
    const int khi = min(q0 + BWD_T, T);
    for (int k0 = klo / BWD_T * BWD_T; k0 < khi; k0 += BWD_T) {
        __syncthreads();  // the previous tile's readers of sk, sv and sds are done
        stage_rows(sk, BWD_T, base + L.k(kvh), L.rs, k0, T, hd, hd4);
        stage_rows(sv, BWD_T, base + L.v(kvh), L.rs, k0, T, hd, hd4);
        if (tid < BWD_T) {
            const int t = k0 + tid;
            skey[tid] = t < T && !(mask && mask[(long long)b * T + t] == 0);
        }
        __syncthreads();
        float s[1][2], dp[1][2];
        tile_dots<1, 2>(s, sq, sk, g, j, hd4);
        tile_dots<1, 2>(dp, sdo, sv, g, j, hd4);
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const int t = k0 + j + 8 * c;
            const bool vis = l != -INFINITY && t >= lo && t <= tq && skey[j + 8 * c];
            float ds = 0.0f;
            if (vis) {
                const float p = expf(s[0][c] * scale - l);
                ds = p * (kept(key, p_drop, drop_scale, row + t, dp[0][c]) - dl) * scale;
            }
            sds[g][j + 8 * c] = ds;
        }
        __syncthreads();
        tile_mix<1, BWD_T>(dq, sds, sk, g, j, hd);
    }
    if (tq >= T) return;
    float* dqr = dqkv + L.batch(b, T) + tq * L.rs + L.q(h);
#pragma unroll
    for (int e = 0; e < 4; e++)
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int d = 4 * j + 32 * e + u;
            if (d < hd) dqr[d] = dq[0][4 * e + u];
        }
}

// Backward: dk and dv of key tile blockIdx.x of (batch, key/value head) blockIdx.y, into dqkv's
// k and v columns: for each query head of the group in order, over the query tiles that see
// the tile (the causal triangle below it, cut at the segments' ends), dk_j += sum_i ds_ij q_i
// and dv_j += sum_i p~_ij dout_i. Grid (ceil(T / BWD_T), B * NKV), ATT_NT threads; needs delta.
extern "C" __global__ void attention_backward_dkv(float* dqkv, const float* delta,
                                                  const float* dout, const float* qkv,
                                                  const float* lse, const unsigned char* mask,
                                                  const unsigned* seg, int B, int T, int C, int NH,
                                                  int NKV, float p_drop, unsigned long long key) {
    alignas(16) __shared__ float sk[BWD_T][ATT_SROW];
    alignas(16) __shared__ float sv[BWD_T][ATT_SROW];
    alignas(16) __shared__ float sq[BWD_T][ATT_SROW];
    alignas(16) __shared__ float sdo[BWD_T][ATT_SROW];
    __shared__ float spt[BWD_T][BWD_T + 1];  // dropped probabilities, [key][query]
    __shared__ float sdst[BWD_T][BWD_T + 1];  // ds, [key][query]
    __shared__ float slse[BWD_T], sdelta[BWD_T];
    const int tid = threadIdx.x, g = tid / 8, j = tid % 8;
    const int k0 = blockIdx.x * BWD_T;
    const long long bkv = blockIdx.y;
    const int kvh = (int)(bkv % NKV), b = (int)(bkv / NKV);
    const QkvCols L(C, NH, NKV);
    const int hd = L.hd, hd4 = (hd + 3) & ~3, group = NH / NKV;
    const float scale = 1.0f / sqrtf((float)hd);
    const float drop_scale = 1.0f / (1.0f - p_drop);
    const float* base = qkv + L.batch(b, T);
    stage_rows(sk, BWD_T, base + L.k(kvh), L.rs, k0, T, hd, hd4);
    stage_rows(sv, BWD_T, base + L.v(kvh), L.rs, k0, T, hd, hd4);
    // One past the last query any key of the tile reaches; this row's key's own.
    const int klast = min(k0 + BWD_T, T) - 1;
    const int qhi = segment_end(seg, b, T, klast, T - 1, T);
    const int tk = k0 + g;
    const bool visible = tk < T && !(mask && mask[(long long)b * T + tk] == 0);
    const int hi = visible ? segment_end(seg, b, T, tk, klast, qhi) : 0;
    float dk[1][16], dv[1][16];
#pragma unroll
    for (int d = 0; d < 16; d++) dk[0][d] = dv[0][d] = 0.0f;
    for (int h = kvh * group; h < (kvh + 1) * group; h++) {
        const long long bh = (long long)b * NH + h;
        for (int q0 = k0; q0 < qhi; q0 += BWD_T) {
            __syncthreads();  // the previous tile's readers of sq, sdo, spt, sdst are done
            stage_rows(sq, BWD_T, base + L.q(h), L.rs, q0, T, hd, hd4);
            stage_rows(sdo, BWD_T, dout + (long long)b * T * C + h * hd, C, q0, T, hd, hd4);
            if (tid < BWD_T) {
                const int t = q0 + tid;
                slse[tid] = t < T ? lse[bh * T + t] : -INFINITY;
                sdelta[tid] = t < T ? delta[bh * T + t] : 0.0f;
            }
            __syncthreads();
            float s[1][2], dp[1][2];
            tile_dots<1, 2>(s, sk, sq, g, j, hd4);
            tile_dots<1, 2>(dp, sv, sdo, g, j, hd4);
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int t = q0 + j + 8 * c;
                const float l = slse[j + 8 * c];
                // t < hi also keeps t < T
                const bool vis = visible && t >= tk && t < hi && l != -INFINITY;
                float pk = 0.0f, ds = 0.0f;
                if (vis) {
                    const unsigned long long at = (unsigned long long)(bh * T + t) * T + tk;
                    const float p = expf(s[0][c] * scale - l);
                    const float f = kept(key, p_drop, drop_scale, at, 1.0f);  // one hash
                    pk = p * f;
                    ds = p * (dp[0][c] * f - sdelta[j + 8 * c]) * scale;
                }
                spt[g][j + 8 * c] = pk;
                sdst[g][j + 8 * c] = ds;
            }
            __syncthreads();
            tile_mix<1, BWD_T>(dv, spt, sdo, g, j, hd);
            tile_mix<1, BWD_T>(dk, sdst, sq, g, j, hd);
        }
    }
    if (tk >= T) return;
    float* dkr = dqkv + L.batch(b, T) + tk * L.rs + L.k(kvh);
    float* dvr = dqkv + L.batch(b, T) + tk * L.rs + L.v(kvh);
#pragma unroll
    for (int e = 0; e < 4; e++)
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int d = 4 * j + 32 * e + u;
            if (d < hd) {
                dkr[d] = dk[0][4 * e + u];
                dvr[d] = dv[0][4 * e + u];
            }
        }
}
