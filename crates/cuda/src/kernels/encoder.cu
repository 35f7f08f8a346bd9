// Token + position embedding lookup and its backward. The backward gives each thread one
// column of the embeddings and walks the tokens in order, as the CPU's encoder_backward
// does: no atomics, and the sums come in the CPU's order (parallel over C only; a faster
// backward sorts the token ids first, as llm.c does).

// out (B, T, C) = wte[ids[b, t]] + wpe[t]; with wpe = 0, the token embedding alone
// (embedding_forward, B = 1, T = N).
extern "C" __global__ void encoder_forward(float* out, const unsigned int* ids, const float* wte,
                                           const float* wpe, int B, int T, int C) {
    const long long n = (long long)B * T * C;
    FOR_EACH(i, n) {
        const long long bt = i / C;
        const int c = (int)(i % C), t = (int)(bt % T);
        const float e = wte[(long long)ids[bt] * C + c];
        out[i] = wpe ? e + wpe[(long long)t * C + c] : e;
    }
}

// dwte[ids[b, t]] += dout[b, t], dwpe[t] += dout[b, t]; with dwpe = 0, the token embedding's
// gradient alone (embedding_backward, B = 1, T = N).
extern "C" __global__ void encoder_backward(float* dwte, float* dwpe, const float* dout,
                                            const unsigned int* ids, int B, int T, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const long long bt_n = (long long)B * T;
    for (long long i = 0; i < bt_n; i++) {
        const float d = dout[i * C + c];
        dwte[(long long)ids[i] * C + c] += d;
        if (dwpe) dwpe[(i % T) * C + c] += d;
    }
}
