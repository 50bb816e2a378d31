// CUDA kernels of the compressed reducers and of gossip: top-k selection without a sort (radix select of
// the threshold, then an index-ordered compaction), gather / scatter over index lists, the error-feedback
// update, PowerSGD's Gram-Schmidt orthogonalization, and gossip's scaled copy and mix.
//
// Every kernel has a CPU twin in src/kernels/mod.rs that implements the same algorithm with the same blocking
// and summation order; the CPU tests exercise the twins, run each kernel on the host against its twin
// (emulate.hpp), and scripts/gpu/selftest.py compares each kernel with its twin on a GPU. Compile with
// -fmad=false: no multiply-add may be contracted behind the twins' back, so that results agree bit for bit.
// The constants below are checked against the twins'.

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

// Writes the selected entries of x[start..end) in index order, the whole block together. Entry i is
// selected when its key is above the threshold, or equal to it and among the first `ties` equal keys;
// its slot is the number of selected entries before it: above_before(i) + min(equal_before(i), ties),
// where `above0` / `equal0` count those before `start`.
__device__ void compact(const float* x, unsigned start, unsigned end, unsigned thresh, unsigned ties,
                        unsigned above0, unsigned equal0, unsigned base, unsigned* out_idx,
                        float* out_val) {
    __shared__ unsigned warp_a[WARPS], warp_e[WARPS];
    __shared__ unsigned run_a, run_e;
    if (threadIdx.x == 0) {
        run_a = above0;
        run_e = equal0;
    }
    __syncthreads();
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

// select_write: the entries of tile blockIdx.x; `above_off` / `equal_off` are the exclusive prefix sums
// of select_count's tiles.
extern "C" __global__ void select_write(const float* x, unsigned n, unsigned thresh, unsigned ties,
                                        const unsigned* above_off, const unsigned* equal_off,
                                        unsigned base, unsigned* out_idx, float* out_val) {
    unsigned start = blockIdx.x * TILE, end = min(start + TILE, n);
    compact(x, start, end, thresh, ties, above_off[blockIdx.x], equal_off[blockIdx.x], base, out_idx,
            out_val);
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
// ..., 1), in f32 or f64. Every thread gets the total.
template <typename T>
__device__ T block_sum(T v, T* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    T total = sh[0];
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

// DeMo (src/sync/demo/): one block per DCT chunk. A chunk is a cr x cc block of a row-major tensor;
// its entry (i, j) is x[base + (row0 + i) * cols + col0 + j]. The table holds per chunk the fields of
// `struct Chunk`; `dct` holds the constants of each transform size the chunks name (`Dct::words`);
// `scratch` two regions of the flat length `numel`, the chunk's part of each at `scratch`.
struct Chunk {
    unsigned base, cols, cr, cc, row0, col0, k, msg, da, db, scratch;
};

// Lee's C v (with `inverse`, C^T v) of the vector of n floats at v[i * s], i < n, in place; w (same
// stride) is scratch. `d` holds the size's constants (`Dct::words`: the scale, each halving level's
// factors, the odd base's dense C_m, then D = S C). The twin of `lee` in src/sync/demo/dct.rs: the same float
// operations in the same order (-fmad=false keeps multiplies and adds apart), so the same bits.
__device__ void lee(float* v, float* w, unsigned s, unsigned n, const float* d, bool inverse) {
    const unsigned m = n >> (__ffs(n) - 1);
    const float *tw = d + n, *dense = d + n + (n - m);
    float *src = v, *dst = w, *t;
    unsigned b = n;
    for (; b > m; b /= 2) {
        const unsigned h = b / 2;
        const float* f = tw + (n - b);
        for (unsigned o = 0; o < n; o += b) {
            for (unsigned i = 0; i < h; i++) {
                if (inverse) {
                    dst[(o + i) * s] = src[(o + 2 * i) * s];
                    dst[(o + h + i) * s] =
                        i > 0 ? src[(o + 2 * i + 1) * s] + src[(o + 2 * i - 1) * s] : src[(o + 1) * s];
                } else {
                    float lo = src[(o + i) * s], hi = src[(o + b - 1 - i) * s];
                    dst[(o + i) * s] = lo + hi;
                    dst[(o + h + i) * s] = (lo - hi) * f[i];
                }
            }
        }
        t = src, src = dst, dst = t;
    }
    if (m > 1) {
        for (unsigned o = 0; o < n; o += m) {
            for (unsigned k = 0; k < m; k++) {
                float acc = 0.0f;
                for (unsigned i = 0; i < m; i++) {
                    acc = acc + (inverse ? dense[i * m + k] : dense[k * m + i]) * src[(o + i) * s];
                }
                dst[(o + k) * s] = acc;
            }
        }
        t = src, src = dst, dst = t;
    }
    while (b < n) {
        b *= 2;
        const unsigned h = b / 2;
        const float* f = tw + (n - b);
        for (unsigned o = 0; o < n; o += b) {
            for (unsigned i = 0; i < h; i++) {
                if (inverse) {
                    float g = src[(o + i) * s], u = src[(o + h + i) * s];
                    dst[(o + i) * s] = g + u * f[i];
                    dst[(o + b - 1 - i) * s] = g - u * f[i];
                } else {
                    dst[(o + 2 * i) * s] = src[(o + i) * s];
                    dst[(o + 2 * i + 1) * s] =
                        i + 1 < h ? src[(o + h + i) * s] + src[(o + h + i + 1) * s] : src[(o + h + i) * s];
                }
            }
        }
        t = src, src = dst, dst = t;
    }
    if (src != v) {
        for (unsigned i = 0; i < n; i++) v[i * s] = src[i * s];
    }
}

// The r x c chunk p (row-major) transformed in place, q scratch of its size: D_r p D_c^T, or with
// `inverse` D_r^T p D_c (D = S C, S the scale at da / db): a thread per column, then a thread per row,
// as `transform` in src/sync/demo/dct.rs does lane by lane.
__device__ void dct2(float* p, float* q, unsigned r, unsigned c, const float* da, const float* db,
                     bool inverse) {
    for (unsigned j = threadIdx.x; j < c; j += BLOCK) {
        if (inverse) for (unsigned i = 0; i < r; i++) p[i * c + j] *= da[i];
        lee(p + j, q + j, c, r, da, inverse);
        if (!inverse) for (unsigned i = 0; i < r; i++) p[i * c + j] *= da[i];
    }
    __syncthreads();
    for (unsigned i = threadIdx.x; i < r; i += BLOCK) {
        float* row = p + (size_t)i * c;
        if (inverse) for (unsigned j = 0; j < c; j++) row[j] *= db[j];
        lee(row, q + (size_t)i * c, 1, c, db, inverse);
        if (!inverse) for (unsigned j = 0; j < c; j++) row[j] *= db[j];
    }
    __syncthreads();
}

// D_r^T K D_c into p (r x c, row-major; q scratch of its size), where K holds only the chunk's k kept
// coefficients (idx: their indices in the chunk, ascending, as f32 bits; val): each kept row's K D_c as
// a sparse sum from +0 over the coefficients in index order, each value times its basis row of D_c
// (after C_m in db's words), then D_r^T on the column. A thread per column does both, as `kept_inverse`
// in src/sync/demo/dct.rs does lane by lane.
__device__ void kept_inverse(float* p, float* q, unsigned r, unsigned c, const float* da, const float* db,
                             const float* idx, const float* val, unsigned k) {
    const unsigned m = c >> (__ffs(c) - 1);
    const float* basis = db + c + (c - m) + m * m;
    for (unsigned j = threadIdx.x; j < c; j += BLOCK) {
        for (unsigned i = 0; i < r; i++) p[i * c + j] = 0.0f;
        for (unsigned t = 0; t < k; t++) {
            const unsigned o = __float_as_uint(idx[t]);
            float* e = p + (size_t)(o / c) * c + j;
            *e = *e + val[t] * basis[(o % c) * c + j];
        }
        for (unsigned i = 0; i < r; i++) p[i * c + j] *= da[i];
        lee(p + j, q + j, c, r, da, true);
    }
    __syncthreads();
}

// D_r^T K D_c of the r x c chunk K at p into q (p is left as scratch), for a sparse K: each row's K D_c
// as a sparse sum from +0 over the row's nonzero entries in index order, each value times its basis row
// of D_c, then D_r^T on the column. A thread per column, as `sparse_inverse` in src/sync/demo/dct.rs does
// lane by lane (skipping zeros there, which changes no bit).
__device__ void sparse_inverse(float* p, float* q, unsigned r, unsigned c, const float* da, const float* db) {
    const unsigned m = c >> (__ffs(c) - 1);
    const float* basis = db + c + (c - m) + m * m;
    for (unsigned j = threadIdx.x; j < c; j += BLOCK) {
        for (unsigned i = 0; i < r; i++) {
            float acc = 0.0f;
            for (unsigned f = 0; f < c; f++) {
                const float v = p[i * c + f];
                if (v != 0.0f) acc = acc + v * basis[f * c + j];
            }
            q[i * c + j] = acc;
        }
    }
    __syncthreads();
    for (unsigned j = threadIdx.x; j < c; j += BLOCK) {
        for (unsigned i = 0; i < r; i++) q[i * c + j] *= da[i];
        lee(q + j, p + j, c, r, da, true);
    }
    __syncthreads();
}

// Whether demo_decode inverts a chunk as sparse rows: `sparse_decode` in src/sync/demo/mod.rs (at most
// DEMO_SPARSE_ROWS coefficients a row on average from the ranks' messages).
#define DEMO_SPARSE_ROWS 4u

// The k entries of largest |x| of x[0..n) (ties towards lower indices) in index order, as
// kernels::top_k: the radix select of the threshold in the block, then `compact`. The indices go out as
// the bits of f32 words (`indices_to_f32`).
__device__ void block_top_k(const float* x, unsigned n, unsigned k, float* out_idx, float* out_val) {
    __shared__ unsigned hist[BLOCK];
    __shared__ unsigned prefix, mask, need;
    if (threadIdx.x == 0) {
        prefix = 0;
        mask = 0;
        need = k;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        hist[threadIdx.x] = 0;
        __syncthreads();
        for (unsigned i = threadIdx.x; i < n; i += BLOCK) {
            unsigned key = abs_key(x[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned d = BLOCK - 1;
            while (d > 0 && hist[d] < need) need -= hist[d--];
            prefix |= d << shift;
            mask |= 255u << shift;
        }
        __syncthreads();
    }
    compact(x, 0, n, prefix, need, 0, 0, 0, reinterpret_cast<unsigned*>(out_idx), out_val);
}

// Per chunk: the coefficients C = D_r X D_c^T of delta's block X; the k largest go to the message as
// [indices | values]; delta keeps X - D_r^T K D_c (K: the kept coefficients, zero elsewhere).
extern "C" __global__ void demo_encode(float* delta, const Chunk* chunks, const float* dct,
                                       float* scratch, unsigned numel, float* msg) {
    const Chunk ch = chunks[blockIdx.x];
    const unsigned r = ch.cr, c = ch.cc, n = r * c;
    float* x = delta + ch.base + (size_t)ch.row0 * ch.cols + ch.col0;
    float *a = scratch + ch.scratch, *b = scratch + numel + ch.scratch;
    const float *da = dct + ch.da, *db = dct + ch.db;
    for (unsigned o = threadIdx.x; o < n; o += BLOCK) a[o] = x[(size_t)(o / c) * ch.cols + o % c];
    __syncthreads();
    dct2(a, b, r, c, da, db, false);
    float *idx = msg + ch.msg, *val = msg + ch.msg + ch.k;
    block_top_k(a, n, ch.k, idx, val);
    __syncthreads();
    kept_inverse(b, a, r, c, da, db, idx, val, ch.k);
    for (unsigned o = threadIdx.x; o < n; o += BLOCK) {
        float* e = x + (size_t)(o / c) * ch.cols + o % c;
        *e = *e - b[o];
    }
}

// Per chunk: each coefficient is the mean of the ranks that sent it (summed in rank order), the inverse
// DCT of that is the direction, and grads gets its sign (0 stays 0). `all` holds the n ranks' messages,
// `per_rank` words each.
extern "C" __global__ void demo_decode(const float* all, unsigned per_rank, unsigned ranks,
                                       const Chunk* chunks, const float* dct, float* scratch,
                                       unsigned numel, float* grads) {
    const Chunk ch = chunks[blockIdx.x];
    const unsigned r = ch.cr, c = ch.cc, n = r * c;
    float* sum = scratch + ch.scratch;
    unsigned* count = reinterpret_cast<unsigned*>(scratch + numel + ch.scratch);
    for (unsigned o = threadIdx.x; o < n; o += BLOCK) {
        sum[o] = 0.0f;
        count[o] = 0;
    }
    __syncthreads();
    for (unsigned q = 0; q < ranks; q++) {
        const float* m = all + (size_t)q * per_rank + ch.msg;
        for (unsigned j = threadIdx.x; j < ch.k; j += BLOCK) {
            unsigned i = __float_as_uint(m[j]);
            sum[i] += m[ch.k + j];
            count[i] += 1;
        }
        __syncthreads();
    }
    for (unsigned o = threadIdx.x; o < n; o += BLOCK) sum[o] = count[o] > 0 ? sum[o] / (float)count[o] : 0.0f;
    __syncthreads();
    // The counts are spent: their region is the transform's scratch (or, inverted as sparse rows, its
    // output).
    float* out = sum;
    if (ranks * ch.k <= DEMO_SPARSE_ROWS * r) {
        out = scratch + numel + ch.scratch;
        sparse_inverse(sum, out, r, c, dct + ch.da, dct + ch.db);
    } else {
        dct2(sum, scratch + numel + ch.scratch, r, c, dct + ch.da, dct + ch.db, true);
    }
    for (unsigned o = threadIdx.x; o < n; o += BLOCK) {
        float d = out[o];
        grads[ch.base + (size_t)(ch.row0 + o / c) * ch.cols + ch.col0 + o % c] =
            d > 0.0f ? 1.0f : (d < 0.0f ? -1.0f : 0.0f);
    }
}

// CHOCO (src/sync/choco.rs): one member's sparse message (top-k, random-k) into a channel, entry j at
// off + idx[j] with value q = vals[j]: the member itself adds q to its public copy and w q to the memory,
// the others w q to the memory (distinct indices within a call; one call per member, in group order).
extern "C" __global__ void choco_absorb(float* hat, float* memory, const unsigned* idx, const float* vals,
                                        unsigned k, unsigned off, float w, unsigned own) {
    unsigned j = blockIdx.x * BLOCK + threadIdx.x;
    if (j < k) {
        unsigned i = off + idx[j];
        float q = vals[j];
        if (own) hat[i] += q;
        memory[i] += w * q;
    }
}

// CHOCO's consensus step x += gamma (s - hat).
extern "C" __global__ void choco_step(float* x, const float* s, const float* hat, unsigned n, float gamma) {
    for (unsigned i = blockIdx.x * BLOCK + threadIdx.x; i < n; i += gridDim.x * BLOCK)
        x[i] += gamma * (s[i] - hat[i]);
}

// ChaCha8 as rand_chacha's ChaCha8Rng: the e-th u32 of stream `stream` under the 256-bit `key` (its
// get_seed()), which is word e % 16 of block e / 16 (the block counter in state words 12-13, the stream
// in 14-15). CHOCO's QSGD draws an entry's rounding from half a word of its tensor's stream.
__device__ __forceinline__ unsigned rotl32(unsigned x, int n) { return (x << n) | (x >> (32 - n)); }
#define QR(a, b, c, d)                                                                             \
    a += b; d ^= a; d = rotl32(d, 16); c += d; b ^= c; b = rotl32(b, 12);                         \
    a += b; d ^= a; d = rotl32(d, 8); c += d; b ^= c; b = rotl32(b, 7);
__device__ unsigned chacha8_word(const unsigned* key, unsigned long long stream, unsigned long long e) {
    unsigned long long ctr = e / 16;
    unsigned s[16] = {0x61707865u, 0x3320646eu, 0x79622d32u, 0x6b206574u, key[0], key[1], key[2],
                      key[3], key[4], key[5], key[6], key[7], (unsigned)ctr, (unsigned)(ctr >> 32),
                      (unsigned)stream, (unsigned)(stream >> 32)};
    unsigned x[16];
    for (int i = 0; i < 16; i++) x[i] = s[i];
    for (int r = 0; r < 4; r++) {
        QR(x[0], x[4], x[8], x[12]) QR(x[1], x[5], x[9], x[13]) QR(x[2], x[6], x[10], x[14])
        QR(x[3], x[7], x[11], x[15]) QR(x[0], x[5], x[10], x[15]) QR(x[1], x[6], x[11], x[12])
        QR(x[2], x[7], x[8], x[13]) QR(x[3], x[4], x[9], x[14])
    }
    unsigned w = (unsigned)(e % 16);
    return x[w] + s[w];
}

// CHOCO's QSGD message of one tensor u[0..len), one block per bucket of `bucket` entries: the bucket's
// 2-norm into norms[b], and per entry a sign bit and a level in 0..=levels (rounded up with the
// probability of its fraction, to 2^-16, from the ChaCha8 stream) packed lowest bits first, `bits` each,
// into the zeroed `codes` words. Bucket b takes words b ceil(bucket / 2) onwards of the stream; its entry
// j reads the low half of its word j / 2 where j is even, the high half where j is odd.
extern "C" __global__ void qsgd_encode(const float* u, unsigned len, unsigned bucket, const unsigned* key,
                                       unsigned long long stream, unsigned levels, unsigned bits,
                                       float* norms, float* codes) {
    __shared__ double sh[BLOCK];
    unsigned start = blockIdx.x * bucket, end = min(start + bucket, len);
    double acc = 0.0;
    for (unsigned i = start + threadIdx.x; i < end; i += BLOCK) {
        double v = u[i];
        acc += v * v;
    }
    float norm = (float)sqrt(block_sum(acc, sh));
    if (threadIdx.x == 0) norms[blockIdx.x] = norm;
    bool usable = norm > 0.0f && isfinite(norm);
    float s = (float)levels, per_unit = s / norm;
    unsigned* words = reinterpret_cast<unsigned*>(codes);
    unsigned long long first = (unsigned long long)blockIdx.x * ((bucket + 1ull) / 2);
    for (unsigned i = start + threadIdx.x; i < end; i += BLOCK) {
        float v = u[i];
        unsigned j = i - start;
        float lf = usable ? fabsf(v) * per_unit : 0.0f;
        // The floor of lf at most `levels`: an infinite lf (|v| s / norm overflows) converts to no integer.
        float lo = floorf(fminf(lf, s));
        unsigned half = (chacha8_word(key, stream, first + j / 2) >> (16 * (j & 1))) & 0xffffu;
        float r = (float)half * (1.0f / 65536.0f);
        unsigned level = min((unsigned)lo + (r < lf - lo ? 1u : 0u), levels);
        unsigned code = level | ((v < 0.0f ? 1u : 0u) << (bits - 1));
        unsigned long long pos = (unsigned long long)i * bits;
        unsigned w = (unsigned)(pos / 32), at = (unsigned)(pos % 32);
        atomicOr(&words[w], code << at);
        if (at + bits > 32) atomicOr(&words[w + 1], code >> (32 - at));
    }
}

// One member's QSGD message of one tensor (entries off..off + len of the flat buffers) into a channel:
// q = norm / levels / tau times the level, with its sign (tau_last: the last bucket's, which may be
// shorter); the member itself adds q to hat, every member w q to memory.
extern "C" __global__ void qsgd_absorb(float* hat, float* memory, unsigned off, unsigned len,
                                       unsigned bucket, const float* norms, const float* codes,
                                       unsigned levels, unsigned bits, float tau, float tau_last, float w,
                                       unsigned own) {
    const unsigned* words = reinterpret_cast<const unsigned*>(codes);
    unsigned last = (len - 1) / bucket;
    for (unsigned i = blockIdx.x * BLOCK + threadIdx.x; i < len; i += gridDim.x * BLOCK) {
        unsigned b = i / bucket;
        float unit = norms[b] / (float)levels / (b == last ? tau_last : tau);
        unsigned long long pos = (unsigned long long)i * bits;
        unsigned wi = (unsigned)(pos / 32), at = (unsigned)(pos % 32);
        unsigned long long pair = words[wi];
        if (at + bits > 32) pair |= (unsigned long long)words[wi + 1] << 32;
        unsigned code = (unsigned)((pair >> at) & ((1ull << bits) - 1));
        float q = unit * (float)(code & ((1u << (bits - 1)) - 1));
        if (code >> (bits - 1) == 1) q = -q;
        if (own) hat[off + i] += q;
        memory[off + i] += w * q;
    }
}

// CHOCO's sign message of one tensor u[0..len), one block: out[0] = ||u||_1 / len (an f64 sum), then one
// bit per entry (set: negative), 32 to a word.
extern "C" __global__ void sign_encode(const float* u, unsigned len, float* out) {
    __shared__ double sh[BLOCK];
    double acc = 0.0;
    for (unsigned i = threadIdx.x; i < len; i += BLOCK) acc += fabs((double)u[i]);
    double total = block_sum(acc, sh);
    if (threadIdx.x == 0) out[0] = (float)(total / (double)max(len, 1u));
    unsigned* words = reinterpret_cast<unsigned*>(out + 1);
    for (unsigned wi = threadIdx.x; wi < (len + 31) / 32; wi += BLOCK) {
        unsigned b = 0;
        for (unsigned j = 0; j < 32 && 32 * wi + j < len; j++) b |= (u[32 * wi + j] < 0.0f ? 1u : 0u) << j;
        words[wi] = b;
    }
}

// One member's sign message of one tensor into a channel: q = -scale where the bit is set, else scale.
extern "C" __global__ void sign_absorb(float* hat, float* memory, unsigned off, unsigned len,
                                       const float* part, float w, unsigned own) {
    float scale = part[0];
    const unsigned* words = reinterpret_cast<const unsigned*>(part + 1);
    for (unsigned i = blockIdx.x * BLOCK + threadIdx.x; i < len; i += gridDim.x * BLOCK) {
        float q = (words[i / 32] >> (i % 32)) & 1u ? -scale : scale;
        if (own) hat[off + i] += q;
        memory[off + i] += w * q;
    }
}

// DiLoCo's quantized all-reduce (src/sync/quantize.rs, whose encode / decode are the twins): rows of a
// buffer to and from their wire words, one block per row. The table holds per row (start in the buffer,
// length, first word); `mode` 1 = bf16, 2 = fp8 e4m3 with a scale, 3 = uint8 with min and scale.
#define E4M3_MAX 448.0f

__device__ float e4m3_to_f32(unsigned b) {
    unsigned e = (b >> 3) & 0xfu, m = b & 7u;
    if (e == 0xfu && m == 7u) return __int_as_float(0x7fc00000);
    float mag = e == 0 ? ((float)m / 8.0f) * ldexpf(1.0f, -6) : (1.0f + (float)m / 8.0f) * ldexpf(1.0f, (int)e - 7);
    return (b & 0x80u) ? -mag : mag;
}

// The nearest e4m3 byte (ties to even), saturating at +-448, by the twin's binary search.
__device__ unsigned f32_to_e4m3(float x) {
    unsigned sign = signbit(x) ? 0x80u : 0u;
    float a = fabsf(x);
    if (isnan(a)) return 0x7fu;
    if (a >= E4M3_MAX) return sign | 0x7eu;
    unsigned lo = 0, hi = 0x7e;
    while (hi - lo > 1) {
        unsigned mid = lo + (hi - lo) / 2;
        if (e4m3_to_f32(mid) <= a) lo = mid; else hi = mid;
    }
    float dl = a - e4m3_to_f32(lo), dh = e4m3_to_f32(hi) - a;
    return sign | ((dl < dh || (dl == dh && lo % 2 == 0)) ? lo : hi);
}

// half::bf16::from_f32: round to nearest even; a NaN stays a (quiet) NaN.
__device__ unsigned f32_to_bf16(float f) {
    unsigned x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (x >> 16) | 0x0040u;
    unsigned round_bit = 0x8000u;
    return ((x & round_bit) != 0 && (x & (3 * round_bit - 1)) != 0) ? (x >> 16) + 1 : x >> 16;
}

extern "C" __global__ void quantize_rows(const float* buf, const unsigned* table, unsigned mode, float* out) {
    __shared__ float red_a[BLOCK], red_b[BLOCK];
    const unsigned start = table[3 * blockIdx.x], len = table[3 * blockIdx.x + 1];
    const float* x = buf + start;
    float* w = out + table[3 * blockIdx.x + 2];
    if (mode == 1) {
        for (unsigned i = threadIdx.x; i < (len + 1) / 2; i += BLOCK) {
            unsigned lo = f32_to_bf16(x[2 * i]), hi = 2 * i + 1 < len ? f32_to_bf16(x[2 * i + 1]) : 0u;
            w[i] = __uint_as_float(lo | (hi << 16));
        }
        return;
    }
    // The row's max |x| (fp8) or min and max (uint8): exact in any order.
    float a = mode == 2 ? 0.0f : 3.402823466e38f, b = -3.402823466e38f;
    for (unsigned i = threadIdx.x; i < len; i += BLOCK) {
        if (mode == 2) a = fmaxf(a, fabsf(x[i]));
        else { a = fminf(a, x[i]); b = fmaxf(b, x[i]); }
    }
    red_a[threadIdx.x] = a;
    red_b[threadIdx.x] = b;
    __syncthreads();
    for (unsigned s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            red_a[threadIdx.x] = mode == 2 ? fmaxf(red_a[threadIdx.x], red_a[threadIdx.x + s])
                                           : fminf(red_a[threadIdx.x], red_a[threadIdx.x + s]);
            red_b[threadIdx.x] = fmaxf(red_b[threadIdx.x], red_b[threadIdx.x + s]);
        }
        __syncthreads();
    }
    unsigned head = mode == 2 ? 1 : 2;
    float scale, min = 0.0f;
    if (mode == 2) {
        float max = red_a[0];
        scale = max > 0.0f ? max / E4M3_MAX : 1.0f;
    } else {
        float mx = len ? red_b[0] : 0.0f;
        min = len ? red_a[0] : 0.0f;
        scale = mx > min ? (mx - min) / 255.0f : 1.0f;
    }
    if (threadIdx.x == 0) {
        if (mode == 2) w[0] = scale;
        else { w[0] = min; w[1] = scale; }
    }
    for (unsigned i = threadIdx.x; i < (len + 3) / 4; i += BLOCK) {
        unsigned word = 0;
        for (unsigned j = 0; j < 4 && 4 * i + j < len; j++) {
            float v = x[4 * i + j];
            unsigned byte = mode == 2 ? f32_to_e4m3(v / scale)
                                      : (unsigned)fminf(fmaxf(roundf((v - min) / scale), 0.0f), 255.0f);
            word |= byte << (8 * j);
        }
        w[head + i] = __uint_as_float(word);
    }
}

extern "C" __global__ void dequantize_rows(const float* words, const unsigned* table, unsigned mode, float* buf) {
    const unsigned start = table[3 * blockIdx.x], len = table[3 * blockIdx.x + 1];
    float* x = buf + start;
    const float* w = words + table[3 * blockIdx.x + 2];
    for (unsigned i = threadIdx.x; i < len; i += BLOCK) {
        if (mode == 1) {
            unsigned v = __float_as_uint(w[i / 2]);
            x[i] = __uint_as_float((i % 2 == 0 ? v & 0xffffu : v >> 16) << 16);
        } else {
            unsigned head = mode == 2 ? 1 : 2;
            unsigned byte = (__float_as_uint(w[head + i / 4]) >> (8 * (i % 4))) & 0xffu;
            x[i] = mode == 2 ? e4m3_to_f32(byte) * w[0] : w[0] + (float)byte * w[1];
        }
    }
}
