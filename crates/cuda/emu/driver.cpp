// The CUDA CPU emulator's driver (libcuda.so.1): the part of the CUDA driver API that cudarc
// and cohort call, over host memory. One device, "cohort CUDA CPU emulator", compute
// capability 9.0. Every call completes before it returns (streams and events are bookkeeping,
// so the emulator never shows an ordering bug between streams); a kernel runs through the
// `cohort_emu_launch` of the object the emulator's NVRTC built. Device memory is host memory
// with a guard page after each allocation (its end placed against it) and one before, filled
// with 0xff (NaN) when allocated, so a kernel that reads or writes past a buffer fails its
// launch, and a copy that does is refused, naming the allocation. See README.md.

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

namespace {

enum CUresult {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

typedef unsigned long long CUdeviceptr;
typedef int CUdevice;

struct Context {
    CUdevice device;
};
struct Stream {
    unsigned flags;
};
struct Event {
    std::chrono::steady_clock::time_point at;
};
struct Module {
    void* handle;
    int (*launch)(const char*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void**, char*,
                  size_t);
};
struct Function {
    Module* module;
    std::string name;
};

const long long TOTAL_MEMORY = 16ll << 30;
const size_t PAGE = 4096;

std::mutex lock;
bool initialised = false;
Context primary{0};
thread_local Context* current = nullptr;
// Device allocations: start -> (mapping base, mapping length, size asked for).
struct Allocation {
    char* base;
    size_t mapped;
    size_t size;
};
std::map<uintptr_t, Allocation> allocations;
long long allocated = 0;
// The message of the last failed launch, for cuGetErrorString.
char last_failure[1024];

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// The allocation holding [p, p + n), or why not.
bool in_device_memory(uintptr_t p, size_t n, std::string* why) {
    std::lock_guard<std::mutex> g(lock);
    auto it = allocations.upper_bound(p);
    if (it == allocations.begin()) {
        if (why) *why = "is not in any device allocation";
        return false;
    }
    --it;
    const uintptr_t start = it->first, end = start + it->second.size;
    if (p >= end) {
        if (why) *why = "is not in any device allocation";
        return false;
    }
    if (p + n > end) {
        if (why) {
            char b[256];
            snprintf(b, sizeof b, "runs %zu bytes past the end of its allocation of %zu bytes", (size_t)(p + n - end),
                     it->second.size);
            *why = b;
        }
        return false;
    }
    return true;
}

CUresult check_range(CUdeviceptr p, size_t n, const char* call) {
    std::string why;
    if (n == 0 || in_device_memory((uintptr_t)p, n, &why)) return CUDA_SUCCESS;
    fprintf(stderr, "cohort CUDA emulator: %s of %zu bytes at %#llx: the range %s\n", call, n, p, why.c_str());
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult alloc(CUdeviceptr* out, size_t size) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;
    // [guard][pages ... data ending against the next guard][guard]; data 256-byte aligned.
    const size_t data = round_up(size, 256), pages = round_up(data, PAGE);
    const size_t mapped = pages + 2 * PAGE;
    {
        std::lock_guard<std::mutex> g(lock);
        if (allocated + (long long)pages > TOTAL_MEMORY) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    void* m = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    char* base = (char*)m;
    mprotect(base, PAGE, PROT_NONE);
    mprotect(base + PAGE + pages, PAGE, PROT_NONE);
    char* start = base + PAGE + pages - data;
    memset(start, 0xff, data);
    std::lock_guard<std::mutex> g(lock);
    allocations[(uintptr_t)start] = Allocation{base, mapped, size};
    allocated += (long long)pages;
    *out = (CUdeviceptr)(uintptr_t)start;
    return CUDA_SUCCESS;
}

CUresult release(CUdeviceptr p) {
    Allocation a;
    {
        std::lock_guard<std::mutex> g(lock);
        auto it = allocations.find((uintptr_t)p);
        if (it == allocations.end()) return CUDA_ERROR_INVALID_VALUE;
        a = it->second;
        allocations.erase(it);
        allocated -= (long long)(a.mapped - 2 * PAGE);
    }
    munmap(a.base, a.mapped);
    return CUDA_SUCCESS;
}

}  // namespace

extern "C" {

typedef Context* CUcontext;
typedef Stream* CUstream;
typedef Event* CUevent;
typedef Module* CUmodule;
typedef Function* CUfunction;

// For the emulator's cuBLAS: 1 when [p, p + n) lies in one device allocation.
__attribute__((visibility("default"))) int cohort_emu_device_range(unsigned long long p, size_t n, char* why,
                                                                   size_t why_len) {
    std::string w;
    if (in_device_memory((uintptr_t)p, n, &w)) return 1;
    snprintf(why, why_len, "%s", w.c_str());
    return 0;
}

CUresult cuGetErrorName(CUresult r, const char** s) {
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    switch (r) {
        case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; break;
        case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
        case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
        case CUDA_ERROR_NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; break;
        case CUDA_ERROR_INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
        case CUDA_ERROR_INVALID_IMAGE: *s = "CUDA_ERROR_INVALID_IMAGE"; break;
        case CUDA_ERROR_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
        case CUDA_ERROR_INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
        case CUDA_ERROR_NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; break;
        case CUDA_ERROR_ILLEGAL_ADDRESS: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
        case CUDA_ERROR_LAUNCH_FAILED: *s = "CUDA_ERROR_LAUNCH_FAILED"; break;
        case CUDA_ERROR_NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; break;
        default: *s = "CUDA_ERROR_UNKNOWN"; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult r, const char** s) {
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_ERROR_LAUNCH_FAILED && last_failure[0]) {
        *s = last_failure;
        return CUDA_SUCCESS;
    }
    return cuGetErrorName(r, s);
}

CUresult cuInit(unsigned) {
    initialised = true;
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int* v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = 13000;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int* n) {
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    *n = 1;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    snprintf(name, (size_t)len, "cohort CUDA CPU emulator (not a GPU)");
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t)TOTAL_MEMORY;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(unsigned char* uuid, CUdevice d) {
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    memcpy(uuid, "cohort-emulator0", 16);
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid_v2(unsigned char* uuid, CUdevice d) { return cuDeviceGetUuid(uuid, d); }

CUresult cuDeviceGetAttribute(int* v, int attribute, CUdevice d) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    switch (attribute) {
        case 1: *v = 1024; break;                   // max threads per block
        case 2: case 3: *v = 1024; break;           // max block dims x, y
        case 4: *v = 64; break;                     // max block dim z
        case 5: *v = 2147483647; break;             // max grid dim x
        case 6: case 7: *v = 65535; break;          // max grid dims y, z
        case 8: *v = 48 * 1024; break;              // shared memory per block
        case 10: *v = 32; break;                    // warp size
        case 16: *v = 2; break;                     // multiprocessors
        case 41: *v = 1; break;                     // unified addressing
        case 75: *v = 9; break;                     // compute capability major
        case 76: *v = 0; break;                     // minor
        case 115: *v = 0; break;                    // memory pools: no (cuMemAlloc)
        default: *v = 0; break;
    }
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice d) {
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    *ctx = &primary;
    return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { return d == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE; }
CUresult cuCtxSetCurrent(CUcontext ctx) {
    current = ctx;
    return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext* ctx) {
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    *ctx = current;
    return CUDA_SUCCESS;
}
CUresult cuCtxPushCurrent_v2(CUcontext ctx) { return cuCtxSetCurrent(ctx); }
CUresult cuCtxPopCurrent_v2(CUcontext* ctx) {
    if (ctx) *ctx = current;
    return CUDA_SUCCESS;
}
CUresult cuCtxGetDevice(CUdevice* d) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    *d = 0;
    return CUDA_SUCCESS;
}
CUresult cuCtxSynchronize() { return CUDA_SUCCESS; }
CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    if (least) *least = 0;
    if (greatest) *greatest = 0;
    return CUDA_SUCCESS;
}

CUresult cuStreamCreate(CUstream* s, unsigned flags) {
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    *s = new Stream{flags};
    return CUDA_SUCCESS;
}
CUresult cuStreamCreateWithPriority(CUstream* s, unsigned flags, int) { return cuStreamCreate(s, flags); }
CUresult cuStreamDestroy_v2(CUstream s) {
    delete s;
    return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(CUstream) { return CUDA_SUCCESS; }
CUresult cuStreamQuery(CUstream) { return CUDA_SUCCESS; }
CUresult cuStreamWaitEvent(CUstream, CUevent e, unsigned) { return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE; }
CUresult cuStreamIsCapturing(CUstream, int* status) {
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    *status = 0;
    return CUDA_SUCCESS;
}
CUresult cuLaunchHostFunc(CUstream, void (*fn)(void*), void* data) {
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    fn(data);
    return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent* e, unsigned) {
    if (!e) return CUDA_ERROR_INVALID_VALUE;
    *e = new Event{std::chrono::steady_clock::now()};
    return CUDA_SUCCESS;
}
CUresult cuEventDestroy_v2(CUevent e) {
    delete e;
    return CUDA_SUCCESS;
}
CUresult cuEventRecord(CUevent e, CUstream) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    e->at = std::chrono::steady_clock::now();
    return CUDA_SUCCESS;
}
CUresult cuEventRecordWithFlags(CUevent e, CUstream s, unsigned) { return cuEventRecord(e, s); }
CUresult cuEventSynchronize(CUevent e) { return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE; }
CUresult cuEventQuery(CUevent e) { return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE; }
CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
    if (!ms || !a || !b) return CUDA_ERROR_INVALID_VALUE;
    *ms = std::chrono::duration<float, std::milli>(b->at - a->at).count();
    return CUDA_SUCCESS;
}
CUresult cuEventElapsedTime_v2(float* ms, CUevent a, CUevent b) { return cuEventElapsedTime(ms, a, b); }

CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) { return alloc(p, n); }
CUresult cuMemAllocAsync(CUdeviceptr* p, size_t n, CUstream) { return alloc(p, n); }
CUresult cuMemFree_v2(CUdeviceptr p) { return release(p); }
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream) { return release(p); }
CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    std::lock_guard<std::mutex> g(lock);
    if (free_bytes) *free_bytes = (size_t)(TOTAL_MEMORY - allocated);
    if (total) *total = (size_t)TOTAL_MEMORY;
    return CUDA_SUCCESS;
}

CUresult cuMemHostAlloc(void** p, size_t n, unsigned) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    *p = aligned_alloc(PAGE, round_up(n ? n : 1, PAGE));
    return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult cuMemAllocHost_v2(void** p, size_t n) { return cuMemHostAlloc(p, n, 0); }
CUresult cuMemFreeHost(void* p) {
    free(p);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    if (CUresult r = check_range(dst, n, "copy to the device")) return r;
    if (n) memcpy((void*)(uintptr_t)dst, src, n);
    return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    if (CUresult r = check_range(src, n, "copy to the host")) return r;
    if (n) memcpy(dst, (const void*)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    if (CUresult r = check_range(src, n, "copy on the device (source)")) return r;
    if (CUresult r = check_range(dst, n, "copy on the device (destination)")) return r;
    if (n) memmove((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream) {
    return cuMemcpyHtoD_v2(dst, src, n);
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream) {
    return cuMemcpyDtoH_v2(dst, src, n);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream) {
    return cuMemcpyDtoD_v2(dst, src, n);
}

CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) {
    if (CUresult r = check_range(p, n, "memset")) return r;
    if (n) memset((void*)(uintptr_t)p, v, n);
    return CUDA_SUCCESS;
}
CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream) { return cuMemsetD8_v2(p, v, n); }
CUresult cuMemsetD32_v2(CUdeviceptr p, unsigned v, size_t n) {
    if (CUresult r = check_range(p, 4 * n, "memset (32-bit)")) return r;
    unsigned* q = (unsigned*)(uintptr_t)p;
    for (size_t i = 0; i < n; i++) q[i] = v;
    return CUDA_SUCCESS;
}
CUresult cuMemsetD32Async(CUdeviceptr p, unsigned v, size_t n, CUstream) { return cuMemsetD32_v2(p, v, n); }

CUresult cuModuleLoadData(CUmodule* m, const void* image) {
    if (!m || !image) return CUDA_ERROR_INVALID_VALUE;
    const char* text = (const char*)image;
    const char* tag = "COHORT-CUDA-EMU ";
    if (strncmp(text, tag, strlen(tag)) != 0) {
        fprintf(stderr, "cohort CUDA emulator: cuModuleLoadData: not an image of the emulator's NVRTC\n");
        return CUDA_ERROR_INVALID_IMAGE;
    }
    const char* path = text + strlen(tag);
    void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "cohort CUDA emulator: cuModuleLoadData: %s\n", dlerror());
        return CUDA_ERROR_INVALID_IMAGE;
    }
    auto launch = (decltype(Module::launch))dlsym(h, "cohort_emu_launch");
    if (!launch) {
        fprintf(stderr, "cohort CUDA emulator: cuModuleLoadData: %s has no kernel table\n", path);
        return CUDA_ERROR_INVALID_IMAGE;
    }
    *m = new Module{h, launch};
    return CUDA_SUCCESS;
}

CUresult cuModuleUnload(CUmodule m) {
    delete m;  // the object stays mapped: a function handle may outlive its module here
    return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
    if (!f || !m || !name) return CUDA_ERROR_INVALID_VALUE;
    // A launch with no threads is refused: it asks the table whether the kernel exists.
    char err[256] = {0};
    if (m->launch(name, 1, 1, 1, 0, 1, 1, nullptr, err, sizeof err) == -2) return CUDA_ERROR_NOT_FOUND;
    *f = new Function{m, name};
    return CUDA_SUCCESS;
}

CUresult cuFuncGetAttribute(int* v, int, CUfunction f) {
    if (!v || !f) return CUDA_ERROR_INVALID_VALUE;
    *v = 0;
    return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction f, int, int) { return f ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE; }
CUresult cuFuncSetCacheConfig(CUfunction f, int) { return f ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE; }

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared_bytes, CUstream, void** params, void** extra) {
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    if (extra) return CUDA_ERROR_NOT_SUPPORTED;
    if (shared_bytes) {
        fprintf(stderr, "cohort CUDA emulator: %s: dynamic shared memory is not emulated\n", f->name.c_str());
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    char err[1024] = {0};
    if (f->module->launch(f->name.c_str(), gx, gy, gz, bx, by, bz, params, err, sizeof err) != 0) {
        snprintf(last_failure, sizeof last_failure, "cohort CUDA emulator: %s", err);
        fprintf(stderr, "%s\n", last_failure);
        return CUDA_ERROR_LAUNCH_FAILED;
    }
    return CUDA_SUCCESS;
}

}  // extern "C"
