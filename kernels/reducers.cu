// CUDA kernels of the compressed reducers and of gossip: top-k selection without a sort (radix select of
// the threshold, then an index-ordered compaction), gather / scatter over index lists, the error-feedback
// update, PowerSGD's Gram-Schmidt orthogonalization, and gossip's scaled copy and mix.
//
// Every kernel has a CPU twin in src/kernels/mod.rs that implements the same algorithm with the same
// blocking and summation order; the CPU tests exercise the twins and scripts/gpu-selftest.sh compares each
// kernel with its twin on a GPU. Compile with -fmad=false: no multiply-add may be contracted behind the
// twins' back, so that results agree bit for bit. The constants below are checked against the twins'.

#define BLOCK 256         // threads per block (also the 256 buckets of one 8-bit radix digit)
#define TILE 4096         // elements per block in the selection kernels
#define WARPS (BLOCK / 32)

// The order of |v| as an unsigned integer: the bits of a non-negative float sort like the float.
__device__ __forceinline__ unsigned abs_key(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// One pass of the radix select: the histogram of the digit (key >> shift) & 255 over the keys whose
// higher digits equal `prefix` (the bits under `mask`). Integer counts: the result does not depend on
// the order of the atomic additions.
extern "C" __global__ void radix_histogram(const float* x, unsigned n, unsigned prefix, unsigned mask,
                                           unsigned shift, unsigned* hist) {
    __shared__ unsigned local[BLOCK];
    local[threadIdx.x] = 0;
    __syncthreads();
    for (unsigned i = blockIdx.x * BLOCK + threadIdx.x; i < n; i += gridDim.x * BLOCK) {
        unsigned k = abs_key(x[i]);
        if ((k & mask) == prefix) atomicAdd(&local[(k >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (local[threadIdx.x]) atomicAdd(&hist[threadIdx.x], local[threadIdx.x]);
}

// Per tile of TILE elements: how many keys lie above the threshold key and how many equal it.
extern "C" __global__ void select_count(const float* x, unsigned n, unsigned thresh, unsigned* above,
                                        unsigned* equal) {
    __shared__ unsigned a, e;
    if (threadIdx.x == 0) {
        a = 0;
        e = 0;
    }
    __syncthreads();
    unsigned start = blockIdx.x * TILE, end = min(start + TILE, n);
    unsigned la = 0, le = 0;
    for (unsigned i = start + threadIdx.x; i < end; i += BLOCK) {
        unsigned k = abs_key(x[i]);
        la += k > thresh;
        le += k == thresh;
    }
    atomicAdd(&a, la);
    atomicAdd(&e, le);
    __syncthreads();
    if (threadIdx.x == 0) {
        above[blockIdx.x] = a;
        equal[blockIdx.x] = e;
    }
}

// Writes the selected entries in index order. Entry i is selected when its key is above the threshold,
// or equal to it and among the first `ties` equal keys; its slot is the number of selected entries
// before it: above_before(i) + min(equal_before(i), ties). `above_off` / `equal_off` are the exclusive
// prefix sums of select_count's tiles.
extern "C" __global__ void select_write(const float* x, unsigned n, unsigned thresh, unsigned ties,
                                        const unsigned* above_off, const unsigned* equal_off,
                                        unsigned base, unsigned* out_idx, float* out_val) {
    __shared__ unsigned warp_a[WARPS], warp_e[WARPS];
    __shared__ unsigned run_a, run_e;
    if (threadIdx.x == 0) {
        run_a = above_off[blockIdx.x];
        run_e = equal_off[blockIdx.x];
    }
    __syncthreads();
    unsigned start = blockIdx.x * TILE, end = min(start + TILE, n);
    unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    unsigned before = (1u << lane) - 1u;
    for (unsigned chunk = start; chunk < end; chunk += BLOCK) {
        unsigned i = chunk + threadIdx.x;
        float v = i < end ? x[i] : 0.0f;
        unsigned k = abs_key(v);
        bool is_a = i < end && k > thresh, is_e = i < end && k == thresh;
        unsigned ba = __ballot_sync(0xffffffffu, is_a), be = __ballot_sync(0xffffffffu, is_e);
        if (lane == 0) {
            warp_a[warp] = __popc(ba);
            warp_e[warp] = __popc(be);
        }
        __syncthreads();
        unsigned pa = run_a + __popc(ba & before), pe = run_e + __popc(be & before);
        for (unsigned w = 0; w < warp; w++) {
            pa += warp_a[w];
            pe += warp_e[w];
        }
        if (is_a || (is_e && pe < ties)) {
            unsigned slot = pa + min(pe, ties);
            out_idx[slot] = base + i;
            out_val[slot] = v;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (unsigned w = 0; w < WARPS; w++) {
                run_a += warp_a[w];
                run_e += warp_e[w];
            }
        }
        __syncthreads();
    }
}

// out[j] = x[idx[j]].
// The index-list kernels share one signature: (dense buffer, indices, values, k).
extern "C" __global__ void gather(const float* x, const unsigned* idx, float* out, unsigned k) {
    unsigned j = blockIdx.x * BLOCK + threadIdx.x;
    if (j < k) out[j] = x[idx[j]];
}

// The error-feedback split: out[j] = acc[idx[j]] is sent and leaves the accumulator (acc[idx[j]] = 0), so
// sent + kept equals the accumulator exactly. Indices are distinct.
extern "C" __global__ void gather_clear(float* acc, const unsigned* idx, float* out, unsigned k) {
    unsigned j = blockIdx.x * BLOCK + threadIdx.x;
    if (j < k) {
        unsigned i = idx[j];
        out[j] = acc[i];
        acc[i] = 0.0f;
    }
}

// dense[idx[j]] = vals[j] (SPARTA puts the averaged entries back).
extern "C" __global__ void scatter(float* dense, const unsigned* idx, const float* vals, unsigned k) {
    unsigned j = blockIdx.x * BLOCK + threadIdx.x;
    if (j < k) dense[idx[j]] = vals[j];
}

// dense[idx[j]] += vals[j] (distinct indices within one call; one call per rank, in rank order, keeps
// the sums of overlapping selections in rank order).
extern "C" __global__ void scatter_add(float* dense, const unsigned* idx, const float* vals, unsigned k) {
    unsigned j = blockIdx.x * BLOCK + threadIdx.x;
    if (j < k) dense[idx[j]] += vals[j];
}

// The error-feedback accumulation acc += g, and the averaging x *= s.
extern "C" __global__ void ef_accumulate(float* acc, const float* g, unsigned n) {
    for (unsigned i = blockIdx.x * BLOCK + threadIdx.x; i < n; i += gridDim.x * BLOCK) acc[i] += g[i];
}

extern "C" __global__ void scale(float* x, unsigned n, float s) {
    for (unsigned i = blockIdx.x * BLOCK + threadIdx.x; i < n; i += gridDim.x * BLOCK) x[i] *= s;
}

// Gossip's mix: x = own * x + b (b: the group's sum of the members' scaled copies), and the scaled copy
// dst = s * src that each member contributes.
extern "C" __global__ void mix(float* x, const float* b, unsigned n, float own) {
    for (unsigned i = blockIdx.x * BLOCK + threadIdx.x; i < n; i += gridDim.x * BLOCK) x[i] = own * x[i] + b[i];
}

extern "C" __global__ void scaled_copy(float* dst, const float* src, unsigned n, float s) {
    for (unsigned i = blockIdx.x * BLOCK + threadIdx.x; i < n; i += gridDim.x * BLOCK) dst[i] = src[i] * s;
}

// Sum over the block: thread t's partial sum, then a tree over the BLOCK partial sums (stride BLOCK / 2,
// ..., 1). Every thread gets the total.
__device__ float block_sum(float v, float* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    float total = sh[0];
    __syncthreads();
    return total;
}

// PowerSGD's orthogonalization (PyTorch's _orthogonalize_gram_schmidt): for each column in turn, divide
// it by (norm + eps) (a zero column stays zero), then remove its component from the later columns.
// Matrices are row-major rows x cols, one block each (blockIdx.x), stored back to back. Thread t owns the
// rows t, t + BLOCK, ...: it adds their terms in row order before the tree of block_sum.
extern "C" __global__ void gram_schmidt(float* p, unsigned rows, unsigned cols, float eps) {
    __shared__ float sh[BLOCK];
    float* a = p + (size_t)blockIdx.x * rows * cols;
    for (unsigned i = 0; i < cols; i++) {
        float s = 0.0f;
        for (unsigned r = threadIdx.x; r < rows; r += BLOCK) {
            float v = a[(size_t)r * cols + i];
            s += v * v;
        }
        float d = sqrtf(block_sum(s, sh)) + eps;
        if (d > 0.0f) {
            for (unsigned r = threadIdx.x; r < rows; r += BLOCK) a[(size_t)r * cols + i] /= d;
        }
        for (unsigned c = i + 1; c < cols; c++) {
            float t = 0.0f;
            for (unsigned r = threadIdx.x; r < rows; r += BLOCK) {
                t += a[(size_t)r * cols + i] * a[(size_t)r * cols + c];
            }
            float dot = block_sum(t, sh);
            for (unsigned r = threadIdx.x; r < rows; r += BLOCK) {
                a[(size_t)r * cols + c] -= dot * a[(size_t)r * cols + i];
            }
        }
    }
}
