// CUDA kernels of the model on candle's graph: the attention's causal softmax, the cross-entropy of the
// logits, the layer norm and the GELU, each with its backward, one pass a row where candle's composed ops (scale,
// mask, max, subtract, exp, sum, log, divide, gather, mean, square root, and their backward) take a dozen
// passes over the (B, heads, T, T) scores, the (B T, vocab) logits and the (B T, C) activations and keep
// each intermediate for the backward.
//
// Every kernel has a CPU twin with the same operations in the same order, which the graph runs on the CPU
// (src/kernels/model.rs; the GELU's are the CPU engine's own, src/model/ops.rs); the tests run each kernel on the host against its twin (emulate.hpp), and
// scripts/gpu/selftest.py compares them on a GPU (to a stated tolerance where expf or logf enters: the
// GPU's are within 2 and 1 ulp of the host's). Compile with -fmad=false (no contracted multiply-adds).
//
// Block b handles row b. Thread t takes the entries t, t + BLOCK, ... of the row; a row's sum is each
// thread's sum in that order, then a tree over the BLOCK partial sums (stride BLOCK / 2, ..., 1). For the
// softmax, the rows are those of a contiguous (.., T, T) tensor: the query at position i = b mod T, whose
// keys j <= i are kept and j > i masked out.

#define BLOCK 256  // threads per block
#define ROWS 64    // rows per block of layer_norm_columns

// The sum of the block's values v (one a thread) over a tree; every thread gets it.
__device__ float block_sum(float v, float* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned k = BLOCK / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) sh[threadIdx.x] += sh[threadIdx.x + k];
        __syncthreads();
    }
    float total = sh[0];
    __syncthreads();
    return total;
}

// The block's largest value (order does not change a maximum); every thread gets it.
__device__ float block_max(float v, float* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned k = BLOCK / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + k]);
        __syncthreads();
    }
    float m = sh[0];
    __syncthreads();
    return m;
}

// y = softmax over each row of (s scale) with the keys after the query masked: z_j = s_j scale for j <= i,
// e_j = exp(z_j - max z), y_j = e_j / sum e; y_j = 0 for j > i.
extern "C" __global__ void causal_softmax(const float* s, float* y, unsigned t, float scale) {
    __shared__ float sh[BLOCK];
    const size_t row = (size_t)blockIdx.x * t;
    const unsigned n = blockIdx.x % t + 1;
    const float* x = s + row;
    float* o = y + row;
    float m = -INFINITY;
    for (unsigned j = threadIdx.x; j < n; j += BLOCK) m = fmaxf(m, x[j] * scale);
    m = block_max(m, sh);
    float sum = 0.0f;
    for (unsigned j = threadIdx.x; j < n; j += BLOCK) {
        float e = expf(x[j] * scale - m);
        o[j] = e;
        sum += e;
    }
    sum = block_sum(sum, sh);
    for (unsigned j = threadIdx.x; j < n; j += BLOCK) o[j] = o[j] / sum;
    for (unsigned j = n + threadIdx.x; j < t; j += BLOCK) o[j] = 0.0f;
}

// The gradient at the scores from y (the forward's output) and g (the gradient at y):
// d = sum_{j <= i} g_j y_j, dx_j = scale (y_j (g_j - d)) for j <= i, 0 for j > i.
extern "C" __global__ void causal_softmax_backward(const float* y, const float* g, float* dx, unsigned t,
                                                   float scale) {
    __shared__ float sh[BLOCK];
    const size_t row = (size_t)blockIdx.x * t;
    const unsigned n = blockIdx.x % t + 1;
    const float *yr = y + row, *gr = g + row;
    float* o = dx + row;
    float d = 0.0f;
    for (unsigned j = threadIdx.x; j < n; j += BLOCK) d += gr[j] * yr[j];
    d = block_sum(d, sh);
    for (unsigned j = threadIdx.x; j < n; j += BLOCK) o[j] = scale * (yr[j] * (gr[j] - d));
    for (unsigned j = n + threadIdx.x; j < t; j += BLOCK) o[j] = 0.0f;
}

// The row's largest logit m and sum of exp(x_j - m), over the row's v entries; every thread gets both.
__device__ void logit_stats(const float* x, unsigned v, float* sh, float* m, float* sum) {
    float mx = -INFINITY;
    for (unsigned j = threadIdx.x; j < v; j += BLOCK) mx = fmaxf(mx, x[j]);
    mx = block_max(mx, sh);
    float s = 0.0f;
    for (unsigned j = threadIdx.x; j < v; j += BLOCK) s += expf(x[j] - mx);
    *m = mx;
    *sum = block_sum(s, sh);
}

// The cross-entropy of each row of the (rows, v) logits x with its target y: loss = log(sum_j
// exp(x_j - m)) - (x_y - m), m the row's largest logit; NaN where the target is not below v.
extern "C" __global__ void cross_entropy(const float* x, const unsigned* y, float* loss, unsigned v) {
    __shared__ float sh[BLOCK];
    const float* xr = x + (size_t)blockIdx.x * v;
    float m, sum;
    logit_stats(xr, v, sh, &m, &sum);
    const unsigned target = y[blockIdx.x];
    if (threadIdx.x == 0) loss[blockIdx.x] = target < v ? logf(sum) - (xr[target] - m) : NAN;
}

// The gradient at the logits from g (the gradient at each row's loss): dx_j = g (p_j - [j = y]), with
// p_j = exp(x_j - m) / sum the softmax.
extern "C" __global__ void cross_entropy_backward(const float* x, const unsigned* y, const float* g,
                                                  float* dx, unsigned v) {
    __shared__ float sh[BLOCK];
    const size_t row = (size_t)blockIdx.x * v;
    const float* xr = x + row;
    float m, sum;
    logit_stats(xr, v, sh, &m, &sum);
    const unsigned target = y[blockIdx.x];
    const float gr = g[blockIdx.x];
    for (unsigned j = threadIdx.x; j < v; j += BLOCK) {
        float p = expf(xr[j] - m) / sum;
        dx[row + j] = gr * (j == target ? p - 1.0f : p);
    }
}

// The row's mean and standard deviation sqrt(var + eps) (var the mean squared deviation); every thread
// gets both.
__device__ void row_stats(const float* x, unsigned c, float eps, float* sh, float* mean, float* sd) {
    float s = 0.0f;
    for (unsigned j = threadIdx.x; j < c; j += BLOCK) s += x[j];
    const float m = block_sum(s, sh) / (float)c;
    float v = 0.0f;
    for (unsigned j = threadIdx.x; j < c; j += BLOCK) {
        float d = x[j] - m;
        v += d * d;
    }
    *mean = m;
    *sd = sqrtf(block_sum(v, sh) / (float)c + eps);
}

// The layer norm of each row of the (rows, c) x: y = (x - mean) / sd w + b.
extern "C" __global__ void layer_norm(const float* x, const float* w, const float* b, float* y, unsigned c,
                                      float eps) {
    __shared__ float sh[BLOCK];
    const size_t row = (size_t)blockIdx.x * c;
    const float* xr = x + row;
    float mean, sd;
    row_stats(xr, c, eps, sh, &mean, &sd);
    for (unsigned j = threadIdx.x; j < c; j += BLOCK) y[row + j] = (xr[j] - mean) / sd * w[j] + b[j];
}

// The gradient at each row of x from g (the gradient at y): with xh = (x - mean) / sd and d = g w,
// dx = (d - sum(d) / c - xh sum(d xh) / c) / sd. Each row's mean and sd go to stats[2 r], stats[2 r + 1].
extern "C" __global__ void layer_norm_backward(const float* x, const float* w, const float* g, float* dx,
                                               float* stats, unsigned c, float eps) {
    __shared__ float sh[BLOCK];
    const size_t row = (size_t)blockIdx.x * c;
    const float *xr = x + row, *gr = g + row;
    float mean, sd;
    row_stats(xr, c, eps, sh, &mean, &sd);
    float s1 = 0.0f, s2 = 0.0f;
    for (unsigned j = threadIdx.x; j < c; j += BLOCK) {
        float d = gr[j] * w[j];
        s1 += d;
        s2 += d * ((xr[j] - mean) / sd);
    }
    const float a = block_sum(s1, sh) / (float)c;
    const float bm = block_sum(s2, sh) / (float)c;
    for (unsigned j = threadIdx.x; j < c; j += BLOCK) {
        float xh = (xr[j] - mean) / sd;
        dx[row + j] = (gr[j] * w[j] - a - xh * bm) / sd;
    }
    if (threadIdx.x == 0) {
        stats[2 * blockIdx.x] = mean;
        stats[2 * blockIdx.x + 1] = sd;
    }
}

// Per block of ROWS rows (blockIdx.x) and BLOCK columns (blockIdx.y), each column's sums over those rows
// in order: dw = sum g xh, db = sum g, into partial[(2 blockIdx.x) c + j] and partial[(2 blockIdx.x + 1)
// c + j].
extern "C" __global__ void layer_norm_columns(const float* x, const float* g, const float* stats,
                                              float* partial, unsigned rows, unsigned c) {
    const unsigned j = blockIdx.y * BLOCK + threadIdx.x;
    if (j >= c) return;
    const unsigned first = blockIdx.x * ROWS, end = min(first + ROWS, rows);
    float dw = 0.0f, db = 0.0f;
    for (unsigned r = first; r < end; r++) {
        const size_t at = (size_t)r * c + j;
        dw += g[at] * ((x[at] - stats[2 * r]) / stats[2 * r + 1]);
        db += g[at];
    }
    partial[(size_t)(2 * blockIdx.x) * c + j] = dw;
    partial[(size_t)(2 * blockIdx.x + 1) * c + j] = db;
}

// The column sums of the blocks' partial sums, in block order: out[j] (dw) and out[c + j] (db).
extern "C" __global__ void layer_norm_column_sums(const float* partial, float* out, unsigned blocks,
                                                  unsigned c) {
    const unsigned j = blockIdx.x * BLOCK + threadIdx.x;
    if (j >= c) return;
    float dw = 0.0f, db = 0.0f;
    for (unsigned k = 0; k < blocks; k++) {
        dw += partial[(size_t)(2 * k) * c + j];
        db += partial[(size_t)(2 * k + 1) * c + j];
    }
    out[j] = dw;
    out[c + j] = db;
}

// The CPU engine's e^x (src/model/ops.rs `exp`: Cephes' range reduction by ln 2 and degree-6 polynomial,
// 2^n through the exponent bits), operation for operation, so that it gives the same floats.
__device__ float poly_exp(float x) {
    if (x < -87.3f) x = -87.3f;
    if (x > 88.3f) x = 88.3f;
    const float magic = 12582912.0f;
    float m = x * 1.44269504088896340736f + magic;
    float n = m - magic;
    float r = x - n * 0.6933594f - n * -2.1219444e-4f;
    float p = 1.9875691e-4f;
    p = p * r + 1.3981999e-3f;
    p = p * r + 8.333452e-3f;
    p = p * r + 4.1665796e-2f;
    p = p * r + 1.6666665e-1f;
    p = p * r + 5e-1f;
    float y = p * r * r + r + 1.0f;
    unsigned biased = __float_as_uint(m) - __float_as_uint(magic) + 127u;
    return y * __uint_as_float(biased << 23);
}

// ops.rs `tanh`: 1 - 2 / (e^{2u} + 1).
__device__ float poly_tanh(float u) { return 1.0f - 2.0f / (poly_exp(2.0f * u) + 1.0f); }

// ops.rs `erf` (Abramowitz & Stegun 7.1.26).
__device__ float poly_erf(float x) {
    float a = fabsf(x);
    float t = 1.0f / (1.0f + 0.3275911f * a);
    float poly = t * (0.2548296f + t * (-0.28449674f + t * (1.4214138f + t * (-1.4531521f + t * 1.0614054f))));
    float y = 1.0f - poly * poly_exp(-a * a);
    return copysignf(y, x);
}

#define SQRT_2_OVER_PI 0.7978846f
#define INV_SQRT_2 0.70710678118654752440f
#define INV_SQRT_2PI 0.3989423f

// GELU and its derivative at x: the erf form (ops.rs `gelu_erf_and_grad`), or the tanh form (`gelu_tanh`,
// `gelu_tanh_grad`) where tanh_form is set.
__device__ void gelu_and_grad(float x, bool tanh_form, float* y, float* dy) {
    if (tanh_form) {
        *y = 0.5f * x * (1.0f + poly_tanh(SQRT_2_OVER_PI * (x + 0.044715f * x * x * x)));
        float x2 = x * x;
        float t = poly_tanh(SQRT_2_OVER_PI * x * (1.0f + 0.044715f * x2));
        *dy = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * SQRT_2_OVER_PI * (1.0f + 3.0f * 0.044715f * x2);
    } else {
        float e = poly_erf(x * INV_SQRT_2);
        *y = 0.5f * x * (1.0f + e);
        *dy = 0.5f * (1.0f + e) + x * INV_SQRT_2PI * poly_exp(-0.5f * x * x);
    }
}

// y = gelu(x) over the n entries (a grid-stride loop).
extern "C" __global__ void gelu(const float* x, float* y, unsigned n, unsigned tanh_form) {
    for (unsigned i = blockIdx.x * BLOCK + threadIdx.x; i < n; i += gridDim.x * BLOCK) {
        float v, d;
        gelu_and_grad(x[i], tanh_form != 0, &v, &d);
        y[i] = v;
    }
}

// dx = g gelu'(x) over the n entries (a grid-stride loop).
extern "C" __global__ void gelu_backward(const float* x, const float* g, float* dx, unsigned n,
                                         unsigned tanh_form) {
    for (unsigned i = blockIdx.x * BLOCK + threadIdx.x; i < n; i += gridDim.x * BLOCK) {
        float v, d;
        gelu_and_grad(x[i], tanh_form != 0, &v, &d);
        dx[i] = g[i] * d;
    }
}

// The permutation between the attention's rows (B T, C) and its heads (B, nh, T, hs), C = nh hs: entry
// (b t, h hs + d) of the rows is entry (b, h, t, d) of the heads. to_heads: the heads from the rows (the
// queries, keys and values); else the rows from the heads (the attention's output). Thread i takes the
// rows' entry i (a grid-stride loop over n = B T C): coalesced on the rows' side, runs of hs on the heads'.
extern "C" __global__ void permute_heads(const float* src, float* dst, unsigned n, unsigned t, unsigned nh,
                                         unsigned hs, unsigned to_heads) {
    const unsigned c = nh * hs;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        const unsigned row = i / c, col = i % c;
        const unsigned j = ((row / t * nh + col / hs) * t + row % t) * hs + col % hs;
        if (to_heads) {
            dst[j] = src[i];
        } else {
            dst[i] = src[j];
        }
    }
}

// The token embedding: row r of out is row ids[r] of the table w (rows of c), a thread an entry (a
// grid-stride loop over n = rows c).
extern "C" __global__ void embedding(const float* w, const unsigned* ids, float* out, unsigned n, unsigned c) {
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        out[i] = w[(size_t)ids[i / c] * c + i % c];
    }
}

// The embedding's gradient at the table: block s sums, from +0 and in position order, the rows of g at the
// positions of token tokens[s] (order[starts[s]] .. order[starts[s + 1] - 1], the positions sorted by token,
// each token's in position order) into row tokens[s] of dw, thread t its columns t, t + BLOCK, ... The rows
// of tokens not in the batch are not written (zeros, filled before).
extern "C" __global__ void embedding_backward(const float* g, const unsigned* order, const unsigned* starts,
                                              const unsigned* tokens, float* dw, unsigned c) {
    const unsigned s = blockIdx.x, first = starts[s], end = starts[s + 1];
    const size_t row = (size_t)tokens[s] * c;
    for (unsigned j = threadIdx.x; j < c; j += BLOCK) {
        float acc = 0.0f;
        for (unsigned k = first; k < end; k++) acc += g[(size_t)order[k] * c + j];
        dw[row + j] = acc;
    }
}

// A linear layer's bias: y = x + b over rows of n (entry i takes b[i mod n]), a grid-stride loop over len.
extern "C" __global__ void bias_add(const float* x, const float* b, float* y, unsigned len, unsigned n) {
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < len; i += blockDim.x * gridDim.x) {
        y[i] = x[i] + b[i % n];
    }
}

// Per block of ROWS rows (blockIdx.x) and BLOCK columns (blockIdx.y) of g (rows of n), each column's sum
// over those rows in order, from +0, into partial[blockIdx.x n + j].
extern "C" __global__ void column_partials(const float* g, float* partial, unsigned rows, unsigned n) {
    const unsigned j = blockIdx.y * BLOCK + threadIdx.x;
    if (j >= n) return;
    const unsigned first = blockIdx.x * ROWS, end = min(first + ROWS, rows);
    float s = 0.0f;
    for (unsigned r = first; r < end; r++) s += g[(size_t)r * n + j];
    partial[(size_t)blockIdx.x * n + j] = s;
}

// out[j] = column j's partial sums (column_partials) added in block order, from +0.
extern "C" __global__ void column_totals(const float* partial, float* out, unsigned blocks, unsigned n) {
    const unsigned j = blockIdx.x * BLOCK + threadIdx.x;
    if (j >= n) return;
    float s = 0.0f;
    for (unsigned k = 0; k < blocks; k++) s += partial[(size_t)k * n + j];
    out[j] = s;
}
