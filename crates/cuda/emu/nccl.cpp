// The CUDA CPU emulator's NCCL (libnccl.so.2): the functions cohort-nccl resolves, over the
// emulator's device memory (host memory), between the processes of one host. NCCL 2.30.7 by
// default (COHORT_NCCL_EMU_VERSION, e.g. 22805 for 2.28.5, to see an older one's refusals).
//
// A communicator is a file of $TMPDIR (or /tmp) named by the unique id, mapped by every rank:
// a header, then two slots per rank (the collectives alternate between them, so a rank may
// post its next one while a slower peer still reads the last). Only nonblocking use is
// emulated, cohort's: a collective posts this rank's send buffer and returns ncclInProgress
// unless every rank has posted; ncclCommGetAsyncError then reports ncclInProgress until they
// all have, when it computes this rank's output (sums in rank order in f32) and reports
// success. So a rank that never comes leaves the others in progress until cohort's timeout
// aborts them, as on a GPU; an abort is seen by the others as ncclRemoteError, and ranks that
// call different collectives (or counts, types, roots) get ncclInvalidUsage naming both.
// Several ranks on the one emulated device are refused unless NCCL_MULTI_RANK_GPU_ENABLE=1 and
// the version is 2.30 or later, as NCCL does. See README.md.

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

enum ncclResult_t {
    ncclSuccess = 0,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
};

enum Kind { ALL_REDUCE = 1, REDUCE_SCATTER, ALL_GATHER, BROADCAST };
const char* kind_name(int k) {
    switch (k) {
        case ALL_REDUCE: return "ncclAllReduce";
        case REDUCE_SCATTER: return "ncclReduceScatter";
        case ALL_GATHER: return "ncclAllGather";
        case BROADCAST: return "ncclBroadcast";
    }
    return "?";
}

const int MAX_RANKS = 64;
const char ID_TAG[] = "cohort-nccl-emu ";
const size_t HEADER = 64 * 1024;

// What a rank called, kept per slot parity as the data is: a rank one collective ahead must
// not overwrite what a slower peer still compares.
struct Call {
    int kind, type, red, root;
    uint64_t count;
};

struct RankState {
    std::atomic<uint64_t> posted;  // the sequence number of its last posted collective
    Call call[2];
};

struct Shared {
    std::atomic<int> joined, left, unlinked, aborted;
    char reason[512];
    RankState ranks[MAX_RANKS];
};
static_assert(sizeof(Shared) <= HEADER, "the header fits");

struct Comm {
    int rank, nranks;
    int fd;
    char* map;
    size_t mapped, slot;
    std::string path;
    uint64_t seq;
    bool pending;
    int kind, type, red, root;
    uint64_t count;
    void* recv;
    Shared* shared() { return (Shared*)map; }
    char* slot_of(uint64_t s, int r) { return map + HEADER + ((s % 2) * nranks + r) * slot; }
};

thread_local std::string last_error;

ncclResult_t fail(ncclResult_t code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
ncclResult_t fail(ncclResult_t code, const char* fmt, ...) {
    char b[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b, sizeof b, fmt, ap);
    va_end(ap);
    last_error = std::string("cohort NCCL emulator: ") + b;
    return code;
}

size_t type_size(int t) {
    switch (t) {
        case 7: return 4;  // ncclFloat32
        case 8: return 8;  // ncclFloat64
        case 9: return 2;  // ncclBfloat16
    }
    return 0;
}

double load(const char* p, int t, size_t i) {
    switch (t) {
        case 7: return ((const float*)p)[i];
        case 8: return ((const double*)p)[i];
        default: {
            uint32_t u = (uint32_t)((const uint16_t*)p)[i] << 16;
            float f;
            memcpy(&f, &u, 4);
            return f;
        }
    }
}

void store(char* p, int t, size_t i, double v) {
    switch (t) {
        case 7: ((float*)p)[i] = (float)v; return;
        case 8: ((double*)p)[i] = v; return;
        default: {
            float f = (float)v;
            uint32_t u;
            memcpy(&u, &f, 4);
            if ((u & 0x7fffffffu) > 0x7f800000u)
                u |= 0x400000u;
            else
                u += 0x7fffu + ((u >> 16) & 1u);
            ((uint16_t*)p)[i] = (uint16_t)(u >> 16);
        }
    }
}

// Whether [p, p + n) is device memory of the emulator's driver (any memory under another).
bool device_range(const void* p, size_t n, const char* what, const char* op) {
    using Check = int (*)(unsigned long long, size_t, char*, size_t);
    static Check check = (Check)dlsym(RTLD_DEFAULT, "cohort_emu_device_range");
    if (!check || n == 0) return true;
    char why[256];
    if (check((unsigned long long)(uintptr_t)p, n, why, sizeof why)) return true;
    fail(ncclInvalidArgument, "%s: the %s buffer (%zu bytes at %p) %s", op, what, n, p, why);
    return false;
}

int version() {
    const char* v = getenv("COHORT_NCCL_EMU_VERSION");
    return v && *v ? atoi(v) : 23007;
}

// This rank's output of the collective every rank has posted.
ncclResult_t finish(Comm* c) {
    Shared* s = c->shared();
    for (int r = 0; r < c->nranks; r++) {
        const Call& o = s->ranks[r].call[c->seq % 2];
        if (o.kind != c->kind || o.type != c->type || o.count != c->count || o.red != c->red ||
            o.root != c->root)
            return fail(ncclInvalidUsage,
                        "rank %d called %s (count %llu, type %d, op %d, root %d) where rank %d called "
                        "%s (count %llu, type %d, op %d, root %d)",
                        r, kind_name(o.kind), (unsigned long long)o.count, o.type, o.red, o.root, c->rank,
                        kind_name(c->kind), (unsigned long long)c->count, c->type, c->red, c->root);
    }
    const int t = c->type;
    const size_t es = type_size(t), n = c->count;
    char* out = (char*)c->recv;
    auto reduce = [&](size_t offset, size_t len) {
        std::vector<double> acc(len, 0.0);
        for (int r = 0; r < c->nranks; r++) {
            const char* in = c->slot_of(c->seq, r) + offset * es;
            for (size_t i = 0; i < len; i++) {
                const double x = load(in, t, i);
                if (r == 0) acc[i] = x;
                else if (c->red == 0 || c->red == 4) acc[i] = t == 8 ? acc[i] + x : (float)((float)acc[i] + (float)x);
                else if (c->red == 1) acc[i] *= x;
                else if (c->red == 2) acc[i] = acc[i] > x ? acc[i] : x;
                else acc[i] = acc[i] < x ? acc[i] : x;
            }
        }
        for (size_t i = 0; i < len; i++) store(out, t, i, c->red == 4 ? acc[i] / c->nranks : acc[i]);
    };
    switch (c->kind) {
        case ALL_REDUCE: reduce(0, n); break;
        case REDUCE_SCATTER: reduce((size_t)c->rank * n, n); break;
        case ALL_GATHER:
            for (int r = 0; r < c->nranks; r++) memcpy(out + (size_t)r * n * es, c->slot_of(c->seq, r), n * es);
            break;
        case BROADCAST: memcpy(out, c->slot_of(c->seq, c->root), n * es); break;
    }
    c->pending = false;
    return ncclSuccess;
}

// Progress: ncclSuccess, ncclInProgress, or the error.
ncclResult_t progress(Comm* c) {
    Shared* s = c->shared();
    if (s->joined.load() < c->nranks) {
        if (s->aborted.load()) return fail(ncclRemoteError, "%s", s->reason);
        return ncclInProgress;
    }
    if (s->unlinked.exchange(1) == 0) unlink(c->path.c_str());  // every rank has it mapped
    if (!c->pending) return ncclSuccess;
    if (s->aborted.load()) return fail(ncclRemoteError, "%s", s->reason);
    for (int r = 0; r < c->nranks; r++)
        if (s->ranks[r].posted.load(std::memory_order_acquire) < c->seq) return ncclInProgress;
    return finish(c);
}

ncclResult_t post(Comm* c, int kind, const void* send, size_t send_count, void* recv, size_t recv_count,
                  size_t count, int type, int red, int root, const char* op) {
    if (!c) return fail(ncclInvalidArgument, "%s: no communicator", op);
    if (c->pending) return fail(ncclInvalidUsage, "%s while the last collective is in progress", op);
    const size_t es = type_size(type);
    if (es == 0) return fail(ncclInvalidArgument, "%s: data type %d is not emulated", op, type);
    if (red < 0 || red > 4) return fail(ncclInvalidArgument, "%s: reduction %d", op, red);
    if (root < 0 || root >= c->nranks) return fail(ncclInvalidArgument, "%s: root %d of %d ranks", op, root, c->nranks);
    if (send_count * es > c->slot)
        return fail(ncclInvalidArgument, "%s: %zu bytes exceed the emulator's slot of %zu", op, send_count * es, c->slot);
    if (!device_range(send, send_count * es, "send", op) || !device_range(recv, recv_count * es, "receive", op))
        return ncclInvalidArgument;
    c->seq++;
    if (send_count) memcpy(c->slot_of(c->seq, c->rank), send, send_count * es);
    RankState& me = c->shared()->ranks[c->rank];
    me.call[c->seq % 2] = Call{kind, type, red, root, count};
    me.posted.store(c->seq, std::memory_order_release);
    c->pending = true;
    c->kind = kind;
    c->type = type;
    c->red = red;
    c->root = root;
    c->count = count;
    c->recv = recv;
    return progress(c);
}

void leave(Comm* c) {
    Shared* s = c->shared();
    if (s->left.fetch_add(1) + 1 == c->nranks || s->joined.load() < c->nranks) {
        if (s->unlinked.exchange(1) == 0) unlink(c->path.c_str());
    }
    munmap(c->map, c->mapped);
    close(c->fd);
    delete c;
}

}  // namespace

extern "C" {

typedef Comm* ncclComm_t;
struct ncclUniqueId {
    char internal[128];
};

ncclResult_t ncclGetVersion(int* v) {
    if (!v) return ncclInvalidArgument;
    *v = version();
    return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
    switch (r) {
        case ncclSuccess: return "no error";
        case ncclSystemError: return "unhandled system error";
        case ncclInternalError: return "internal error";
        case ncclInvalidArgument: return "invalid argument";
        case ncclInvalidUsage: return "invalid usage";
        case ncclRemoteError: return "remote process exited or there was a network error";
        case ncclInProgress: return "NCCL operation in progress";
    }
    return "unknown result code";
}

const char* ncclGetLastError(ncclComm_t) { return last_error.c_str(); }

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    if (!id) return ncclInvalidArgument;
    memset(id->internal, 0, sizeof id->internal);
    unsigned char r[16];
    int fd = open("/dev/urandom", O_RDONLY);
    if (fd < 0 || read(fd, r, sizeof r) != (ssize_t)sizeof r) {
        if (fd >= 0) close(fd);
        return fail(ncclSystemError, "cannot read /dev/urandom");
    }
    close(fd);
    std::string s = ID_TAG;
    char hex[3];
    for (unsigned char b : r) {
        snprintf(hex, sizeof hex, "%02x", b);
        s += hex;
    }
    memcpy(id->internal, s.c_str(), s.size());
    return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank, void* config) {
    if (!out) return ncclInvalidArgument;
    *out = nullptr;
    if (nranks < 1 || nranks > MAX_RANKS) return fail(ncclInvalidArgument, "%d ranks (1 to %d emulated)", nranks, MAX_RANKS);
    if (rank < 0 || rank >= nranks) return fail(ncclInvalidArgument, "rank %d of %d", rank, nranks);
    if (strncmp(id.internal, ID_TAG, strlen(ID_TAG)) != 0) return fail(ncclInvalidArgument, "not an id of this emulator");
    // ncclConfig_t: size, magic, version, blocking; only nonblocking use is emulated.
    struct Prefix {
        size_t size;
        unsigned magic, version;
        int blocking;
    };
    if (!config || ((Prefix*)config)->blocking != 0)
        return fail(ncclInvalidUsage, "only nonblocking communicators (blocking = 0) are emulated");
    const char* multi = getenv("NCCL_MULTI_RANK_GPU_ENABLE");
    if (nranks > 1 && !(version() >= 23000 && multi && strcmp(multi, "1") == 0))
        return fail(ncclInvalidUsage, "Duplicate GPU detected : rank %d and rank %d both on CUDA device 0 (the one "
                    "emulated device)", rank, rank == 0 ? 1 : 0);
    char name[64] = {0};
    memcpy(name, id.internal + strlen(ID_TAG), 32);
    const char* tmp = getenv("TMPDIR");
    const std::string path = std::string(tmp && *tmp ? tmp : "/tmp") + "/cohort-nccl-emu-" + name;
    const char* slot_env = getenv("COHORT_NCCL_EMU_SLOT_MB");
    const size_t slot = (size_t)(slot_env && *slot_env ? atoll(slot_env) : 1024) << 20;
    const size_t mapped = HEADER + 2 * (size_t)nranks * slot;
    int fd = open(path.c_str(), O_RDWR | O_CREAT, 0600);
    if (fd < 0) return fail(ncclSystemError, "cannot open %s", path.c_str());
    if (ftruncate(fd, (off_t)mapped) != 0) {
        close(fd);
        return fail(ncclSystemError, "cannot size %s to %zu bytes", path.c_str(), mapped);
    }
    void* m = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        close(fd);
        return fail(ncclSystemError, "cannot map %s", path.c_str());
    }
    Comm* c = new Comm{rank, nranks, fd, (char*)m, mapped, slot, path, 0, false, 0, 0, 0, 0, 0, nullptr};
    c->shared()->joined.fetch_add(1);
    *out = c;
    return progress(c);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t* state) {
    if (!c || !state) return ncclInvalidArgument;
    *state = progress(c);
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t c) {
    if (!c) return ncclSuccess;
    Shared* s = c->shared();
    if (c->pending || s->joined.load() < c->nranks) {
        // Left in the middle of something: the others' next wait fails instead of hanging.
        if (s->aborted.exchange(1) == 0)
            snprintf(s->reason, sizeof s->reason, "rank %d aborted the communicator", c->rank);
    }
    leave(c);
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t c) {
    if (c) leave(c);
    return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, int type, int op, ncclComm_t c, void*) {
    return post(c, ALL_REDUCE, send, count, recv, count, count, type, op, 0, "ncclAllReduce");
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t recv_count, int type, int op, ncclComm_t c,
                               void*) {
    const size_t n = c ? (size_t)c->nranks * recv_count : 0;
    return post(c, REDUCE_SCATTER, send, n, recv, recv_count, recv_count, type, op, 0, "ncclReduceScatter");
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t send_count, int type, ncclComm_t c, void*) {
    const size_t n = c ? (size_t)c->nranks * send_count : 0;
    return post(c, ALL_GATHER, send, send_count, recv, n, send_count, type, 0, 0, "ncclAllGather");
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, int type, int root, ncclComm_t c, void*) {
    // Only the root's send buffer is read.
    const bool is_root = c && c->rank == root;
    return post(c, BROADCAST, is_root ? send : nullptr, is_root ? count : 0, recv, count, count, type, 0, root,
                "ncclBroadcast");
}

}  // extern "C"
