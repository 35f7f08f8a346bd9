// The CUDA CPU emulator's cuBLAS (libcublas.so.13): cublasGemmEx as cuBLAS documents it
// (column-major, op(A) m x k, op(B) k x n, C = alpha op(A) op(B) + beta C, C not read when beta
// is 0), over f32 and bf16 operands with f32 accumulation, and the handle calls around it.
// Each operand's extent (from its leading dimension) must lie in one device allocation of the
// emulator's driver, or the call is CUBLAS_STATUS_INVALID_VALUE with a line on stderr naming
// the operand. Compute types other than CUBLAS_COMPUTE_32F(_PEDANTIC) are refused, so a TF32
// or 16-bit compute type cohort never asks for cannot slip in. See README.md.

#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

enum cublasStatus_t {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
};

const int CUDA_R_32F = 0, CUDA_R_16BF = 14;
const int CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_PEDANTIC = 69;

struct Handle {
    void* stream;
    int math_mode;
};

float load(const void* p, int type, size_t i) {
    if (type == CUDA_R_32F) return ((const float*)p)[i];
    uint32_t u = (uint32_t)((const uint16_t*)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

void store(void* p, int type, size_t i, float v) {
    if (type == CUDA_R_32F) {
        ((float*)p)[i] = v;
        return;
    }
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        u = (u | 0x400000u);
    else
        u += 0x7fffu + ((u >> 16) & 1u);
    ((uint16_t*)p)[i] = (uint16_t)(u >> 16);
}

size_t elem(int type) { return type == CUDA_R_32F ? 4 : 2; }

// Whether `rows` x `cols` column-major with leading dimension `ld` at p lies in device memory.
bool operand_ok(const char* what, const void* p, int type, int rows, int cols, int ld) {
    if (rows == 0 || cols == 0) return true;
    if (ld < rows) {
        fprintf(stderr, "cohort CUDA emulator: cublasGemmEx: %s has leading dimension %d < %d rows\n", what, ld, rows);
        return false;
    }
    using Check = int (*)(unsigned long long, size_t, char*, size_t);
    static Check check = (Check)dlsym(RTLD_DEFAULT, "cohort_emu_device_range");
    if (!check) return true;  // another driver: nothing to check against
    const size_t bytes = ((size_t)(cols - 1) * (size_t)ld + (size_t)rows) * elem(type);
    char why[256];
    if (check((unsigned long long)(uintptr_t)p, bytes, why, sizeof why)) return true;
    fprintf(stderr, "cohort CUDA emulator: cublasGemmEx: %s (%d x %d, ld %d, %zu bytes at %p) %s\n", what, rows, cols,
            ld, bytes, p, why);
    return false;
}

}  // namespace

extern "C" {

typedef Handle* cublasHandle_t;

cublasStatus_t cublasCreate_v2(cublasHandle_t* h) {
    if (!h) return CUBLAS_STATUS_INVALID_VALUE;
    *h = new Handle{nullptr, 0};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream_v2(cublasHandle_t h, void* stream) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetStream_v2(cublasHandle_t h, void** stream) {
    if (!h || !stream) return CUBLAS_STATUS_INVALID_VALUE;
    *stream = h->stream;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t h, int mode) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->math_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasGetVersion_v2(cublasHandle_t, int* v) {
    if (!v) return CUBLAS_STATUS_INVALID_VALUE;
    *v = 130000;
    return CUBLAS_STATUS_SUCCESS;
}
const char* cublasGetStatusString(cublasStatus_t s) {
    switch (s) {
        case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
        case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
        case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
        case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, int transa, int transb, int m, int n, int k, const void* alpha,
                            const void* A, int a_type, int lda, const void* B, int b_type, int ldb, const void* beta,
                            void* C, int c_type, int ldc, int compute, int /*algo*/) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (m < 0 || n < 0 || k < 0 || !alpha || !beta || (transa != 0 && transa != 1) || (transb != 0 && transb != 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    for (int t : {a_type, b_type, c_type})
        if (t != CUDA_R_32F && t != CUDA_R_16BF) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_PEDANTIC) return CUBLAS_STATUS_NOT_SUPPORTED;
    // Stored shapes: A is m x k (N) or k x m (T); B is k x n (N) or n x k (T).
    if (!operand_ok("A", A, a_type, transa ? k : m, transa ? m : k, lda) ||
        !operand_ok("B", B, b_type, transb ? n : k, transb ? k : n, ldb) ||
        !operand_ok("C", C, c_type, m, n, ldc))
        return CUBLAS_STATUS_INVALID_VALUE;
    const float a = *(const float*)alpha, b = *(const float*)beta;
    // op(A)'s rows and op(B)'s columns as contiguous f32, then one dot product per element.
    std::vector<float> ar((size_t)m * k), bc((size_t)n * k);
    for (int i = 0; i < m; i++)
        for (int p = 0; p < k; p++)
            ar[(size_t)i * k + p] = load(A, a_type, transa ? (size_t)i * lda + p : (size_t)p * lda + i);
    for (int j = 0; j < n; j++)
        for (int p = 0; p < k; p++)
            bc[(size_t)j * k + p] = load(B, b_type, transb ? (size_t)p * ldb + j : (size_t)j * ldb + p);
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            const float* x = &ar[(size_t)i * k];
            const float* y = &bc[(size_t)j * k];
            float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            int p = 0;
            for (; p + 8 <= k; p += 8)
                for (int u = 0; u < 8; u++) s[u] += x[p + u] * y[p + u];
            float t = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
            for (; p < k; p++) t += x[p] * y[p];
            const size_t at = (size_t)j * ldc + i;
            const float v = b == 0.0f ? a * t : a * t + b * load(C, c_type, at);
            store(C, c_type, at, v);
        }
    return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
