// The CUDA CPU emulator's NVRTC (libnvrtc.so.13): "compiles" a kernel family by handing its
// CUDA C source to g++ behind include/cohort_emu_runtime.h, as a shared object the emulator's
// driver loads; the "cubin" it returns names that object. Objects are cached by a hash of what
// g++ is given, in $COHORT_CUDA_EMU_CACHE or the cache/ beside the library's lib/. A compile
// error is NVRTC_ERROR_COMPILATION with g++'s messages as the program log. See README.md.

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

enum nvrtcResult {
    NVRTC_SUCCESS = 0,
    NVRTC_ERROR_OUT_OF_MEMORY = 1,
    NVRTC_ERROR_PROGRAM_CREATION_FAILURE = 2,
    NVRTC_ERROR_INVALID_INPUT = 3,
    NVRTC_ERROR_INVALID_PROGRAM = 4,
    NVRTC_ERROR_INVALID_OPTION = 5,
    NVRTC_ERROR_COMPILATION = 6,
    NVRTC_ERROR_INTERNAL_ERROR = 11,
};

struct Program {
    std::string source, name, log, image;
};

// This library's directory's parent: the emulator's root (lib/, include/, cache/).
std::string root() {
    Dl_info info{};
    if (dladdr((void*)&root, &info) == 0 || !info.dli_fname) return ".";
    std::string lib = info.dli_fname;
    std::string dir = lib.substr(0, lib.rfind('/'));
    return dir.substr(0, dir.rfind('/'));
}

// The kernels a source defines: the names after `__global__ void`.
std::vector<std::string> kernel_names(const std::string& src) {
    std::vector<std::string> out;
    size_t at = 0;
    while ((at = src.find("__global__", at)) != std::string::npos) {
        at += 10;
        size_t p = src.find_first_not_of(" \t\n", at);
        if (p == std::string::npos || src.compare(p, 4, "void") != 0) continue;
        p = src.find_first_not_of(" \t\n", p + 4);
        size_t e = p;
        while (e < src.size() && (isalnum((unsigned char)src[e]) || src[e] == '_')) e++;
        if (e > p) out.push_back(src.substr(p, e - p));
    }
    return out;
}

uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    return h;
}

std::string read_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

}  // namespace

extern "C" {

typedef Program* nvrtcProgram;

const char* nvrtcGetErrorString(nvrtcResult r) {
    switch (r) {
        case NVRTC_SUCCESS: return "NVRTC_SUCCESS";
        case NVRTC_ERROR_COMPILATION: return "NVRTC_ERROR_COMPILATION";
        case NVRTC_ERROR_INVALID_PROGRAM: return "NVRTC_ERROR_INVALID_PROGRAM";
        case NVRTC_ERROR_INVALID_INPUT: return "NVRTC_ERROR_INVALID_INPUT";
        default: return "NVRTC_ERROR_INTERNAL_ERROR";
    }
}

nvrtcResult nvrtcVersion(int* major, int* minor) {
    if (!major || !minor) return NVRTC_ERROR_INVALID_INPUT;
    *major = 13;
    *minor = 0;
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcCreateProgram(nvrtcProgram* prog, const char* src, const char* name, int num_headers,
                               const char* const*, const char* const*) {
    if (!prog || !src) return NVRTC_ERROR_INVALID_INPUT;
    if (num_headers != 0) return NVRTC_ERROR_INVALID_INPUT;  // cohort never passes headers
    *prog = new Program{src, name ? name : "kernel.cu", "", ""};
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcDestroyProgram(nvrtcProgram* prog) {
    if (!prog || !*prog) return NVRTC_ERROR_INVALID_PROGRAM;
    delete *prog;
    *prog = nullptr;
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcCompileProgram(nvrtcProgram prog, int num_options, const char* const* options) {
    if (!prog) return NVRTC_ERROR_INVALID_PROGRAM;
    // Options are NVRTC's (architecture, include path, -lineinfo): the host has one
    // architecture and the emulator its own headers. --maxrregcount has no meaning here.
    std::string arch;
    for (int i = 0; i < num_options; i++)
        if (strncmp(options[i], "--gpu-architecture=", 19) == 0) arch = options[i] + 19;
    const std::string base = root();
    const std::string include = base + "/include";
    const char* cxx_env = getenv("COHORT_CUDA_EMU_CXX");
    const std::string cxx = cxx_env && *cxx_env ? cxx_env : "g++";
    // nvcc contracts a * b + c into one fused multiply-add unless told not to; so does this.
    const std::string flags =
        "-std=c++17 -O2 -fPIC -shared -fvisibility=hidden -mfma -ffp-contract=fast "
        "-fno-math-errno -w";

    std::string unit = "#include <cohort_emu_runtime.h>\n#line 1 \"" + prog->name + "\"\n" + prog->source;
    unit += "\n// The emulator's kernel table (generated).\n";
    unit += "extern \"C\" __attribute__((visibility(\"default\"))) int cohort_emu_launch(\n"
            "    const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,\n"
            "    unsigned bz, void** params, char* err, size_t err_len) {\n"
            "    static const struct { const char* name; void (*entry)(void**); } table[] = {\n";
    const std::vector<std::string> names = kernel_names(prog->source);
    for (const std::string& k : names)
        unit += "        {\"" + k + "\", [](void** p) { cohort_emu::call(" + k + ", p); }},\n";
    unit += "        {nullptr, nullptr}};\n"
            "    for (int i = 0; table[i].name; i++)\n"
            "        if (strcmp(table[i].name, name) == 0)\n"
            "            return cohort_emu::launch(table[i].name, table[i].entry, dim3{gx, gy, gz},\n"
            "                                      dim3{bx, by, bz}, params, err, err_len);\n"
            "    snprintf(err, err_len, \"no kernel %s in this module\", name);\n"
            "    return -2;\n"
            "}\n";

    const char* cache_env = getenv("COHORT_CUDA_EMU_CACHE");
    const std::string cache = cache_env && *cache_env ? cache_env : base + "/cache";
    mkdir(cache.c_str(), 0755);
    char hash[32];
    snprintf(hash, sizeof hash, "%016llx",
             (unsigned long long)fnv1a(unit, fnv1a(cxx + " " + flags + read_file(include + "/cohort_emu_runtime.h") +
                                                   read_file(include + "/cuda_bf16.h"))));
    const std::string stem = cache + "/" + prog->name + "-" + hash;
    const std::string so = stem + ".so";
    prog->log.clear();
    if (access(so.c_str(), R_OK) != 0) {
        // Unique to this call: programs compile at once from several threads and processes.
        static std::atomic<unsigned> calls{0};
        const std::string tmp = stem + "." + std::to_string(getpid()) + "-" + std::to_string(calls++);
        {
            std::ofstream out(tmp + ".cpp");
            out << unit;
            if (!out) {
                prog->log = "cannot write " + tmp + ".cpp";
                return NVRTC_ERROR_COMPILATION;
            }
        }
        const std::string cmd = cxx + " " + flags + " -I'" + include + "' -o '" + tmp + ".so' '" + tmp +
                                ".cpp' > '" + tmp + ".log' 2>&1";
        const int rc = system(cmd.c_str());
        prog->log = read_file(tmp + ".log");
        unlink((tmp + ".log").c_str());
        if (rc != 0) {
            if (prog->log.empty()) prog->log = "`" + cmd + "` failed";
            unlink((tmp + ".so").c_str());
            return NVRTC_ERROR_COMPILATION;  // the .cpp stays, for whoever reads the log
        }
        unlink((tmp + ".cpp").c_str());
        if (rename((tmp + ".so").c_str(), so.c_str()) != 0) {
            prog->log = "cannot move the compiled object to " + so;
            return NVRTC_ERROR_COMPILATION;
        }
    }
    prog->image = "COHORT-CUDA-EMU " + so;
    prog->image.push_back('\0');
    if (!arch.empty()) prog->log += "cohort CUDA emulator: " + prog->name + " for " + arch + " is host code\n";
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram prog, size_t* size) {
    if (!prog || !size) return NVRTC_ERROR_INVALID_INPUT;
    *size = prog->log.size() + 1;
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetProgramLog(nvrtcProgram prog, char* log) {
    if (!prog || !log) return NVRTC_ERROR_INVALID_INPUT;
    memcpy(log, prog->log.c_str(), prog->log.size() + 1);
    return NVRTC_SUCCESS;
}

static nvrtcResult image_size(nvrtcProgram prog, size_t* size) {
    if (!prog || !size) return NVRTC_ERROR_INVALID_INPUT;
    if (prog->image.empty()) return NVRTC_ERROR_INVALID_PROGRAM;
    *size = prog->image.size();
    return NVRTC_SUCCESS;
}

static nvrtcResult image(nvrtcProgram prog, char* out) {
    if (!prog || !out) return NVRTC_ERROR_INVALID_INPUT;
    if (prog->image.empty()) return NVRTC_ERROR_INVALID_PROGRAM;
    memcpy(out, prog->image.data(), prog->image.size());
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetCUBINSize(nvrtcProgram prog, size_t* size) { return image_size(prog, size); }
nvrtcResult nvrtcGetCUBIN(nvrtcProgram prog, char* out) { return image(prog, out); }
nvrtcResult nvrtcGetPTXSize(nvrtcProgram prog, size_t* size) { return image_size(prog, size); }
nvrtcResult nvrtcGetPTX(nvrtcProgram prog, char* out) { return image(prog, out); }

}  // extern "C"
