// CUDA kernels of the optimizers and the gradient clipping: AdamW (torch's single-tensor update), Decent-DP's
// AccumAdamW, SGD with decoupled weight decay, torch's SGD with momentum / Nesterov (also DiLoCo's outer
// step), and the sum of squares behind every global norm.
//
// Every kernel has a CPU twin in src/kernels/optim.rs with the same operations in the same order, which the
// CPU optimizers run; the tests run each kernel on the host against its twin (emulate.hpp), and
// scripts/gpu/selftest.py compares each kernel with its twin on a GPU. Compile with -fmad=false (no
// contracted multiply-adds); sqrtf and '/' are IEEE-rounded under nvcc's defaults (-prec-sqrt=true,
// -prec-div=true, -ftz=false), as Rust's f32 operations are.
//
// The update kernels run over a segment table: segs[3 s .. 3 s + 3] = (offset, length, decays) of
// parameter s in the flat buffer. Block row blockIdx.y is segment s; weight decay applies where `decays`
// is set (nanoGPT: tensors of rank >= 2). Each reads the gradient times `gscale`: the clipping's factor
// (1 without clipping), applied in the update's pass instead of a pass of its own.

#define BLOCK 256   // threads per block
#define TILE 4096   // elements per block of sum_squares (BLOCK threads x 16)

// Grid-stride loop over the elements i of segment blockIdx.y, with `decays` the segment's flag.
#define FOR_SEGMENT(segs, i, decays)                                                          \
    const unsigned _off = segs[3 * blockIdx.y], _len = segs[3 * blockIdx.y + 1];            \
    const bool decays = segs[3 * blockIdx.y + 2] != 0;                                        \
    for (unsigned _j = blockIdx.x * BLOCK + threadIdx.x, i = _off + _j; _j < _len;           \
         _j += gridDim.x * BLOCK, i = _off + _j)

// AdamW: p *= 1 - lr wd (decaying segments); m = lerp(m, g, 1 - b1); v = b2 v + (1 - b2) g g;
// p -= step_size (m / (sqrt(v) / bc2_sqrt + eps)).
extern "C" __global__ void adamw(float* p, const float* g, float* m, float* v, const unsigned* segs,
                                 float decay, float one_minus_b1, float b2, float one_minus_b2,
                                 float bc2_sqrt, float eps, float step_size, float gscale) {
    FOR_SEGMENT(segs, i, decays) {
        float pi = decays ? p[i] * decay : p[i];
        float gi = g[i] * gscale, mi = m[i], vi = v[i];
        mi += (gi - mi) * one_minus_b1;
        vi = vi * b2 + one_minus_b2 * gi * gi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] = pi - step_size * (mi / denom);
        m[i] = mi;
        v[i] = vi;
    }
}

// AccumAdamW (Decent-DP's optim.py): a look-ahead step from the committed moments sm, sv and this
// gradient; the running mean acc += g / K; every K-th step (`commit`) the moments take the mean.
extern "C" __global__ void accum_adamw(float* p, const float* g, float* sm, float* sv, float* acc,
                                       const unsigned* segs, float decay, float one_minus_b1,
                                       float one_minus_b2, float b1, float b2, float inv_k,
                                       float bc2_sqrt, float eps, float step_size, unsigned commit,
                                       float gscale) {
    FOR_SEGMENT(segs, i, decays) {
        float pi = decays ? p[i] * decay : p[i];
        float gi = g[i] * gscale, smi = sm[i], svi = sv[i];
        float ai = acc[i] + gi * inv_k;
        float mi = smi + one_minus_b1 * gi;
        float vi = svi + one_minus_b2 * gi * gi;
        p[i] = pi - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
        if (commit) {
            sm[i] = b1 * (smi + one_minus_b1 * ai);
            sv[i] = b2 * (svi + one_minus_b2 * ai * ai);
            acc[i] = 0.0f;
        } else {
            acc[i] = ai;
        }
    }
}

// SGD with decoupled weight decay: p = p (1 - lr wd) - lr g (decay on decaying segments).
extern "C" __global__ void sgd(float* p, const float* g, const unsigned* segs, float decay, float lr,
                               float gscale) {
    FOR_SEGMENT(segs, i, decays) {
        float pi = decays ? p[i] * decay : p[i];
        p[i] = pi - lr * (g[i] * gscale);
    }
}

// torch.optim.SGD: g' = g + wd p (decaying segments, wd != 0); b = g' at the first step, then
// b = mu b + g'; d = g' + mu b with Nesterov, else b; p -= lr d. `buf` is read only with `has_buf`
// (momentum > 0).
extern "C" __global__ void momentum_sgd(float* p, const float* g, float* buf, unsigned has_buf,
                                        const unsigned* segs, float wd, float mu, float lr,
                                        unsigned first, unsigned nesterov, float gscale) {
    FOR_SEGMENT(segs, i, decays) {
        float gi = g[i] * gscale;
        if (decays && wd != 0.0f) gi = gi + wd * p[i];
        if (!has_buf) {
            p[i] -= lr * gi;
            continue;
        }
        float b = first ? gi : mu * buf[i] + gi;
        buf[i] = b;
        float d = nesterov ? gi + mu * b : b;
        p[i] -= lr * d;
    }
}

// Per tile of TILE elements, the sum of x^2 in f64 (each square exact): thread t adds the elements
// t, t + BLOCK, ... of its tile in order, then a tree over the BLOCK partial sums (stride BLOCK / 2, ...,
// 1). The host adds the tiles' sums in tile order.
extern "C" __global__ void sum_squares(const float* x, unsigned n, double* partial) {
    __shared__ double sh[BLOCK];
    unsigned start = blockIdx.x * TILE, end = min(start + TILE, n);
    double s = 0.0;
    for (unsigned i = start + threadIdx.x; i < end; i += BLOCK) {
        double v = (double)x[i];
        s += v * v;
    }
    sh[threadIdx.x] = s;
    __syncthreads();
    for (unsigned k = BLOCK / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) sh[threadIdx.x] += sh[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}
