// The CUDA kernels of this folder on the host, for the tests that check them against their CPU twins
// without a GPU (src/kernels/emulate.rs). Included before a kernel file (CUDA's names), and again with
// EMULATE_MAIN defined after it (the launcher). A block runs as BLOCK threads of this machine, blocks one
// after another: __syncthreads is a barrier of the block's threads, __shared__ storage is shared by
// them, a warp's vote is taken through shared storage between two barriers, atomics are the compiler's.
// Built with contraction off (-ffp-contract=off, as nvcc's -fmad=false): on x86-64 each float operation
// rounds as the GPU's IEEE one does. A kernel that calls __syncthreads where not every thread of its
// block reaches it hangs here as it would on a GPU; the test's time limit reports it. Built with the
// address and undefined-behaviour sanitizers where the compiler has them: an access past a buffer, or
// a float converted to an integer that cannot hold it, ends the run with the sanitizer's report.
#ifndef EMULATE_MAIN
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

struct dim3_ {
    unsigned x = 0, y = 0, z = 0;
};
thread_local dim3_ threadIdx, blockIdx;
static dim3_ gridDim, blockDim;
static std::barrier<>* block_barrier = nullptr;
static void __syncthreads() { block_barrier->arrive_and_wait(); }

// Every thread of the block votes (the kernels vote uniformly); each reads its warp's 32 votes.
static unsigned warp_votes[1024];
static unsigned __ballot_sync(unsigned, bool p) {
    warp_votes[threadIdx.x] = p ? 1u : 0u;
    __syncthreads();
    unsigned first = threadIdx.x & ~31u, b = 0;
    for (unsigned l = 0; l < 32; l++) b |= warp_votes[first + l] << l;
    __syncthreads();
    return b;
}

static int __popc(unsigned v) { return __builtin_popcount(v); }
static int __ffs(unsigned v) { return __builtin_ffs(v); }
static unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
static float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
template <typename T>
static T atomicAdd(T* a, T v) {
    static_assert(std::is_integral_v<T>, "float atomics are not emulated");
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);
}
static unsigned atomicOr(unsigned* a, unsigned v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }
using std::isfinite;
using std::isnan;
using std::max;
using std::min;
using std::signbit;

#else  // EMULATE_MAIN: the launcher.

// One argument of a launch: a buffer (exactly its bytes, so that a sanitizer sees any access past it)
// or a scalar (its bytes, little-endian).
struct Arg {
    bool buffer = false;
    std::vector<unsigned char> data;
    uint64_t bytes = 0, scalar = 0;
};

template <class P>
static P take(Arg& a) {
    if constexpr (std::is_pointer_v<P>) {
        if (!a.buffer) {
            std::fprintf(stderr, "a scalar where the kernel takes a pointer\n");
            std::exit(3);
        }
        return reinterpret_cast<P>(a.data.data());
    } else {
        if (a.buffer) {
            std::fprintf(stderr, "a buffer where the kernel takes a scalar\n");
            std::exit(3);
        }
        P v;
        std::memcpy(&v, &a.scalar, sizeof(P));
        return v;
    }
}

// The kernel over a grid of gx x gy blocks of BLOCK threads, one block at a time: BLOCK threads of
// this machine run every block, all of them finishing one block before any starts the next (its
// __shared__ storage is the next block's).
template <class... P>
static void launch(void (*kernel)(P...), std::vector<Arg>& args, unsigned gx, unsigned gy) {
    if (args.size() != sizeof...(P)) {
        std::fprintf(stderr, "%zu arguments for a kernel of %zu\n", args.size(), sizeof...(P));
        std::exit(3);
    }
    size_t i = 0;
    std::tuple<P...> params{take<P>(args[i++])...};
    gridDim = {gx, gy, 1};
    blockDim = {BLOCK, 1, 1};
    std::barrier<> bar(BLOCK);
    block_barrier = &bar;
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < BLOCK; t++) {
        threads.emplace_back([&, t] {
            threadIdx = {t, 0, 0};
            for (unsigned y = 0; y < gy; y++) {
                for (unsigned x = 0; x < gx; x++) {
                    blockIdx = {x, y, 0};
                    std::apply(kernel, params);
                    bar.arrive_and_wait();
                }
            }
        });
    }
    for (auto& t : threads) t.join();
}

static void read_exact(FILE* f, void* p, size_t n) {
    if (n && std::fread(p, 1, n, f) != n) {
        std::fprintf(stderr, "short input\n");
        std::exit(3);
    }
}

// argv[1]: the launch (kernel name, grid, arguments); argv[2]: every buffer after it, in order.
int main(int argc, char** argv) {
    if (argc != 3) return 3;
    FILE* f = std::fopen(argv[1], "rb");
    if (!f) return 3;
    uint32_t head[4];  // name length, grid x, grid y, arguments
    read_exact(f, head, sizeof head);
    std::string name(head[0], '\0');
    read_exact(f, name.data(), head[0]);
    std::vector<Arg> args(head[3]);
    for (auto& a : args) {
        uint8_t tag;
        read_exact(f, &tag, 1);
        a.buffer = tag == 'b';
        if (a.buffer) {
            read_exact(f, &a.bytes, 8);
            a.data.assign(a.bytes, 0);
            read_exact(f, a.data.data(), a.bytes);
        } else {
            read_exact(f, &a.scalar, 8);
        }
    }
    std::fclose(f);
    bool found = false;
#define KERNEL(k)                                \
    if (name == #k) {                            \
        launch(k, args, head[1], head[2]);       \
        found = true;                            \
    }
    EMULATE_KERNELS
    if (!found) {
        std::fprintf(stderr, "no kernel %s\n", name.c_str());
        return 3;
    }
    FILE* o = std::fopen(argv[2], "wb");
    if (!o) return 3;
    for (auto& a : args) {
        if (a.buffer && a.bytes && std::fwrite(a.data.data(), 1, a.bytes, o) != a.bytes) return 3;
    }
    return std::fclose(o) == 0 ? 0 : 3;
}
#endif
