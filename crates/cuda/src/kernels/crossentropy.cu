// Softmax cross-entropy over the vocabulary, as the CPU's crossentropy_forward,
// crossentropy_forward_block and crossentropy_backward: forward keeps only the log-sum-exp
// per row; the chunked forms take the vocabulary in blocks of columns v0..v0+V, so the (N, V)
// logits of a large vocabulary never exist at once. A negative target is ignored. One block
// per row for the reductions.

__device__ float row_lse(const float* row, int V) {
    float m = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, row[j]);
    m = block_max(m);
    float s = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(row[j] - m);
    return m + logf(block_sum(s));
}

// losses[i] = lse[i] - logits[i, targets[i]] (0 where the target is ignored).
extern "C" __global__ void crossentropy_forward(float* losses, float* lse, const float* logits,
                                                const int* targets, int N, int V) {
    const long long i = blockIdx.x;
    if (i >= N) return;
    const float* row = logits + i * V;
    const float s = row_lse(row, V);
    if (threadIdx.x == 0) {
        lse[i] = s;
        const int t = targets[i];
        losses[i] = t < 0 ? 0.0f : s - row[t];
    }
}

// lse[i] (start at -inf) takes in this block's log-sum-exp; target_logit[i] gets the target's
// logit where it falls in columns v0..v0+V.
extern "C" __global__ void crossentropy_forward_block(float* lse, float* target_logit,
                                                      const float* logits, const int* targets,
                                                      int N, int V, int V0) {
    const long long i = blockIdx.x;
    if (i >= N) return;
    const float* row = logits + i * V;
    const float blk = row_lse(row, V);
    if (threadIdx.x == 0) {
        const float prev = lse[i];
        if (prev == -INFINITY) {
            lse[i] = blk;
        } else {
            const float hi = fmaxf(prev, blk);
            lse[i] = hi + logf(expf(prev - hi) + expf(blk - hi));
        }
        const int t = targets[i];
        if (t >= V0 && t < V0 + V) target_logit[i] = row[t - V0];
    }
}

// The logits become dlogits = scale * (softmax - onehot) for columns v0..v0+V, in place (zero
// rows where the target is ignored): each element is read, then written, by one thread.
extern "C" __global__ void crossentropy_backward(float* logits, const float* lse,
                                                 const int* targets, float scale, int N, int V,
                                                 int V0) {
    const long long n = (long long)N * V;
    FOR_EACH(k, n) {
        const long long i = k / V;
        const int j = (int)(k % V);
        const int t = targets[i];
        float d = 0.0f;
        if (t >= 0) {
            d = expf(logits[k] - lse[i]) * scale;
            if (t - V0 == j) d -= scale;
        }
        logits[k] = d;
    }
}

// After crossentropy_forward_block over every block: losses holds each row's target logit and
// becomes lse - target logit (0 where the target is ignored), as the CPU's crossentropy_fold.
extern "C" __global__ void crossentropy_fold(float* losses, const float* lse, const int* targets,
                                             int N) {
    FOR_EACH(i, (long long)N) {
        losses[i] = targets[i] < 0 ? 0.0f : lse[i] - losses[i];
    }
}
