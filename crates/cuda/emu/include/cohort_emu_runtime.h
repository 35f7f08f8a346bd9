// The CUDA CPU emulator's kernel runtime: what a kernel family's CUDA C source needs from the
// GPU to compile with g++ and run on the host (threadIdx and friends, __syncthreads, warp
// shuffles, __shared__, the _rn intrinsics), and the scheduler that runs one launch. The
// emulator's NVRTC puts this file in front of the source and a table of the kernels behind it;
// the driver runs a launch through `cohort_emu_launch`. See ../README.md for what the emulator
// is for and what it must never be taken for (a GPU: no figure measured on it means anything).
//
// A launch runs its blocks one after another on the calling thread; a block's threads are
// fibers that run until they reach a barrier (__syncthreads: the block's; a shuffle or
// __syncwarp: their warp's) and resume when every thread that has not returned is there. So
// a kernel runs with the GPU's synchronisation and nothing more: a thread reading what another
// wrote without a barrier between sees it or not depending on the order, which alternates
// (blocks of even index run their threads first to last, odd ones last to first). A warp
// operation that a lane of its warp skipped (returned, or is waiting at __syncthreads) is a
// deadlock on a GPU and an error here, and so is a read or write outside device memory (the
// driver puts a guard page after each allocation): the launch fails with a message naming the
// kernel, the block and the thread.
#pragma once

#include <cmath>
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sys/mman.h>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
// One block runs at a time (launches are serialised), so a function's static is its block's
// shared memory.
#define __shared__ static

struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
};
// CUDA's vector type, 16-byte aligned as on the GPU (kernels load it from shared memory).
struct alignas(16) float4 {
    float x, y, z, w;
};
static inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

namespace cohort_emu {

enum class State { Runnable, AtBlockBarrier, AtWarpBarrier, Done };

struct Fiber {
    void* sp;
    uint3 tid;
    int linear;
    State state;
};

struct Launch {
    const char* kernel;
    void (*entry)(void**);
    void** params;
    dim3 grid, block;
    uint3 block_idx;
    Fiber* fibers;
    int n;
    uint64_t* slots;  // one per thread: what it offers a shuffle
    void* sched_sp;
    Fiber* cur;
    sigjmp_buf fail;
    char* err;
    size_t err_len;
};

static Launch* L = nullptr;

[[noreturn]] static void fail(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(L->err, L->err_len, fmt, ap);
    va_end(ap);
    siglongjmp(L->fail, 1);
}

}  // namespace cohort_emu

#define threadIdx (::cohort_emu::L->cur->tid)
#define blockIdx (::cohort_emu::L->block_idx)
#define blockDim (::cohort_emu::L->block)
#define gridDim (::cohort_emu::L->grid)
#define warpSize 32

// The stack switch: saves the callee-saved registers and the float control words on the
// current stack, stores its pointer in *save, and resumes the stack at `load`.
extern "C" __attribute__((visibility("hidden"))) void cohort_emu_switch(void** save, void* load);
#if defined(__x86_64__)
asm(R"(
    .text
    .p2align 4
    .globl cohort_emu_switch
    .hidden cohort_emu_switch
    .type cohort_emu_switch,@function
cohort_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cohort_emu_switch, .-cohort_emu_switch
)");
#else
#error "the CUDA CPU emulator switches stacks in x86-64 assembly only"
#endif

namespace cohort_emu {

static void yield_to_scheduler() { cohort_emu_switch(&L->cur->sp, L->sched_sp); }

// A fiber starts here (the first switch to it "returns" into this function).
[[noreturn]] static void fiber_main() {
    L->entry(L->params);
    L->cur->state = State::Done;
    yield_to_scheduler();
    __builtin_unreachable();
}

constexpr size_t STACK = 64 * 1024;
constexpr size_t GUARD = 4096;

// Fiber stacks, each above a guard page, kept between launches.
static char* stacks = nullptr;
static int stacks_count = 0;

static void ensure_stacks(int n) {
    if (n <= stacks_count) return;
    if (stacks) munmap(stacks, (size_t)stacks_count * (STACK + GUARD));
    const size_t len = (size_t)n * (STACK + GUARD);
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fail("cannot map %d fiber stacks", n);
    stacks = (char*)p;
    stacks_count = n;
    for (int i = 0; i < n; i++) mprotect(stacks + (size_t)i * (STACK + GUARD), GUARD, PROT_NONE);
}

static void start_fiber(Fiber& f, int i) {
    char* top = stacks + (size_t)i * (STACK + GUARD) + GUARD + STACK;
    uint64_t* s = (uint64_t*)((uintptr_t)top & ~(uintptr_t)15);
    uint32_t mxcsr;
    uint16_t fpucw;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    asm volatile("fnstcw %0" : "=m"(fpucw));
    s[-1] = 0;                        // fiber_main's return address: it never returns
    s[-2] = (uint64_t)&fiber_main;    // where the first switch's `ret` goes
    for (int r = 3; r <= 8; r++) s[-r] = 0;  // rbp rbx r12 r13 r14 r15
    s[-9] = (uint64_t)mxcsr | ((uint64_t)fpucw << 32);
    f.sp = &s[-9];
    f.state = State::Runnable;
}

static const char* state_name(State s) {
    switch (s) {
        case State::Runnable: return "running";
        case State::AtBlockBarrier: return "at __syncthreads";
        case State::AtWarpBarrier: return "at a warp operation";
        case State::Done: return "returned";
    }
    return "?";
}

// Runs one block to the end.
static void run_block() {
    const int n = L->n;
    const bool reverse = (L->block_idx.x + L->block_idx.y + L->block_idx.z) % 2 == 1;
    for (int i = 0; i < n; i++) start_fiber(L->fibers[i], i);
    for (;;) {
        for (int k = 0; k < n; k++) {
            Fiber& f = L->fibers[reverse ? n - 1 - k : k];
            if (f.state != State::Runnable) continue;
            L->cur = &f;
            cohort_emu_switch(&L->sched_sp, f.sp);
        }
        L->cur = nullptr;
        // Every fiber is waiting or done: release a warp whose live lanes all wait at its
        // barrier, else the block if all its live threads wait at __syncthreads.
        bool released = false;
        int done = 0, at_block = 0;
        for (int w = 0; w * 32 < n; w++) {
            const int lo = w * 32, hi = lo + 32 < n ? lo + 32 : n;
            int waiting = 0, gone = 0;
            for (int i = lo; i < hi; i++) {
                waiting += L->fibers[i].state == State::AtWarpBarrier;
                gone += L->fibers[i].state == State::Done;
            }
            if (waiting > 0 && waiting + gone == hi - lo) {
                if (gone > 0)
                    fail("warp %d: %d of its lanes returned before a full-warp operation the "
                         "others wait at", w, gone);
                for (int i = lo; i < hi; i++) L->fibers[i].state = State::Runnable;
                released = true;
            }
        }
        if (released) continue;
        for (int i = 0; i < n; i++) {
            done += L->fibers[i].state == State::Done;
            at_block += L->fibers[i].state == State::AtBlockBarrier;
        }
        if (done == n) return;
        if (at_block + done == n) {
            for (int i = 0; i < n; i++)
                if (L->fibers[i].state == State::AtBlockBarrier) L->fibers[i].state = State::Runnable;
            continue;
        }
        // A deadlock on a GPU: name a warp split between barriers.
        for (int w = 0; w * 32 < n; w++) {
            const int lo = w * 32, hi = lo + 32 < n ? lo + 32 : n;
            for (int i = lo + 1; i < hi; i++)
                if (L->fibers[i].state != L->fibers[lo].state)
                    fail("deadlock: in warp %d thread %d is %s and thread %d is %s", w, lo,
                         state_name(L->fibers[lo].state), i, state_name(L->fibers[i].state));
        }
        fail("deadlock: some warps wait at __syncthreads while others wait at a warp operation");
    }
}

static void on_fault(int sig, siginfo_t* info, void*) {
    if (!L || !L->cur) {
        signal(sig, SIG_DFL);  // not a kernel's: the default action when it repeats
        return;
    }
    const uint3 t = L->cur->tid;
    fail("%s at address %p (outside device memory) in thread (%u,%u,%u)",
         sig == SIGSEGV ? "read or write" : "bus error", info->si_addr, t.x, t.y, t.z);
}

static std::mutex launches;

// Runs `entry` over the grid; 0, or -1 with `err` saying why.
static int launch(const char* kernel, void (*entry)(void**), dim3 grid, dim3 block, void** params,
                  char* err, size_t err_len) {
    std::lock_guard<std::mutex> guard(launches);
    const long long n = (long long)block.x * block.y * block.z;
    if (n < 1 || n > 1024 || grid.x < 1 || grid.y < 1 || grid.z < 1) {
        snprintf(err, err_len, "%s: invalid launch: grid (%u,%u,%u), block (%u,%u,%u)", kernel,
                 grid.x, grid.y, grid.z, block.x, block.y, block.z);
        return -1;
    }
    Launch l{};
    l.kernel = kernel;
    l.entry = entry;
    l.params = params;
    l.grid = grid;
    l.block = block;
    l.n = (int)n;
    l.err = err;
    l.err_len = err_len;
    Fiber* fibers = new Fiber[n];
    uint64_t* slots = new uint64_t[n];
    l.fibers = fibers;
    l.slots = slots;
    for (int i = 0; i < n; i++) {
        fibers[i].linear = i;
        fibers[i].tid = uint3{(unsigned)(i % block.x), (unsigned)(i / block.x % block.y),
                              (unsigned)(i / (block.x * block.y))};
    }
    struct sigaction act {}, old_segv{}, old_bus{};
    act.sa_sigaction = on_fault;
    act.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&act.sa_mask);
    sigaction(SIGSEGV, &act, &old_segv);
    sigaction(SIGBUS, &act, &old_bus);
    L = &l;
    int rc = 0;
    if (sigsetjmp(l.fail, 1) == 0) {
        ensure_stacks((int)n);
        for (unsigned z = 0; z < grid.z; z++)
            for (unsigned y = 0; y < grid.y; y++)
                for (unsigned x = 0; x < grid.x; x++) {
                    l.block_idx = uint3{x, y, z};
                    run_block();
                }
    } else {
        // `fail` wrote the message; say where.
        char why[768];
        snprintf(why, sizeof why, "%s", err);
        snprintf(err, err_len, "%s, block (%u,%u,%u) of (%u,%u,%u), %lld threads a block: %s",
                 kernel, l.block_idx.x, l.block_idx.y, l.block_idx.z, grid.x, grid.y, grid.z, n, why);
        rc = -1;
    }
    L = nullptr;
    sigaction(SIGSEGV, &old_segv, nullptr);
    sigaction(SIGBUS, &old_bus, nullptr);
    delete[] fibers;
    delete[] slots;
    return rc;
}

// Kernel parameters from cuLaunchKernel's array of pointers to them.
template <class... A, size_t... I>
static void call(void (*f)(A...), void** p, std::index_sequence<I...>) {
    f(*static_cast<A*>(p[I])...);
}
template <class... A>
static void call(void (*f)(A...), void** p) {
    call(f, p, std::index_sequence_for<A...>{});
}

static void warp_barrier() {
    L->cur->state = State::AtWarpBarrier;
    yield_to_scheduler();
}

template <class T>
static T shuffle(unsigned mask, T v, int src_of_lane(int lane, int arg), int arg, int width) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    if (mask != 0xffffffffu) fail("a warp operation with mask %#x (only full warps are emulated)", mask);
    if (width != 32) fail("a shuffle of width %d (only 32 is emulated)", width);
    Fiber* f = L->cur;
    const int lane = f->linear % 32, base = f->linear - lane;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    L->slots[f->linear] = bits;
    warp_barrier();
    const int src = src_of_lane(lane, arg);
    T r = v;
    if (src >= 0 && src < 32 && base + src < L->n) std::memcpy(&r, &L->slots[base + src], sizeof(T));
    warp_barrier();  // nobody overwrites a slot before every lane has read
    return r;
}

static int lane_xor(int lane, int m) { return lane ^ m; }
static int lane_down(int lane, int d) { return lane + d < 32 ? lane + d : lane; }
static int lane_up(int lane, int d) { return lane - d >= 0 ? lane - d : lane; }
static int lane_idx(int, int src) { return src & 31; }

}  // namespace cohort_emu

static inline void __syncthreads() {
    cohort_emu::L->cur->state = cohort_emu::State::AtBlockBarrier;
    cohort_emu::yield_to_scheduler();
}
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
    if (mask != 0xffffffffu) cohort_emu::fail("__syncwarp with mask %#x", mask);
    cohort_emu::warp_barrier();
}
template <class T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return cohort_emu::shuffle(mask, v, cohort_emu::lane_xor, lane_mask, width);
}
template <class T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return cohort_emu::shuffle(mask, v, cohort_emu::lane_down, (int)delta, width);
}
template <class T>
static inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return cohort_emu::shuffle(mask, v, cohort_emu::lane_up, (int)delta, width);
}
template <class T>
static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return cohort_emu::shuffle(mask, v, cohort_emu::lane_idx, src, width);
}

// Launches are serialised and a block's threads run one at a time, so atomics are plain.
template <class T>
static inline T atomicAdd(T* p, T v) {
    T old = *p;
    *p = old + v;
    return old;
}

// (__expf and __logf are glibc's own.)
// The _rn intrinsics: one IEEE operation each, never fused with a neighbour (the compiler
// contracts a * b + c elsewhere, as nvcc does; the empty asm hides the value from it).
#define COHORT_EMU_OPAQUE(x) ({ auto _v = (x); asm("" : "+x"(_v)); _v; })
static inline float __fadd_rn(float a, float b) { return COHORT_EMU_OPAQUE(a + b); }
static inline float __fsub_rn(float a, float b) { return COHORT_EMU_OPAQUE(a - b); }
static inline float __fmul_rn(float a, float b) { return COHORT_EMU_OPAQUE(a * b); }
static inline float __fdiv_rn(float a, float b) { return COHORT_EMU_OPAQUE(a / b); }
static inline float __fsqrt_rn(float a) { return COHORT_EMU_OPAQUE(std::sqrt(a)); }
static inline double __dadd_rn(double a, double b) { return COHORT_EMU_OPAQUE(a + b); }
static inline double __dmul_rn(double a, double b) { return COHORT_EMU_OPAQUE(a * b); }
static inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
static inline int __float_as_int(float f) {
    int i;
    std::memcpy(&i, &f, 4);
    return i;
}
static inline float __uint_as_float(unsigned i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
static inline unsigned __float_as_uint(float f) {
    unsigned i;
    std::memcpy(&i, &f, 4);
    return i;
}
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
using std::max;
using std::min;
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
