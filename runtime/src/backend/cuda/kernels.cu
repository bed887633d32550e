// The CUDA backend's kernels (compiled by NVRTC at start-up, cached as PTX). Each one is the device
// twin of a function of `runtime/src/math` or of the CPU backend's arena accesses, written to be
// read beside it: f32 arithmetic, rounding to the stored dtype where the CPU rounds, the same
// order of operations where the result would otherwise differ by more than rounding.
//
// Dtype codes: 0 fp32, 1 bf16, 2 fp16 (stored as 16-bit words). Sizes are long long.

// No headers: NVRTC compiles this without a CUDA toolkit's include directory.
#define NEG_INF __int_as_float(0xff800000)

#define GRID_STRIDE(i, n) \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); \
         i += (long long)blockDim.x * gridDim.x)

// ---- storage: math/precision.rs and arena.rs ----

__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}

// Round to nearest even; NaN stays a quiet NaN with its sign (f32_to_bf16_bits).
__device__ __forceinline__ unsigned short f32_to_bf16(float x) {
    unsigned int b = __float_as_uint(x);
    if (x != x) return (unsigned short)((b >> 16) | 0x0040);
    unsigned int lsb = (b >> 16) & 1;
    return (unsigned short)((b + 0x7fff + lsb) >> 16);
}

#ifdef __CUDA_ARCH__
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
}

// IEEE half, round to nearest even (the `half` crate's from_f32).
__device__ __forceinline__ unsigned short f32_to_f16(float x) {
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
#else
// The host emulation of the tests (kernels compiled as C++) has no fp16 conversions.
__device__ __forceinline__ float f16_to_f32(unsigned short) { __builtin_trap(); }
__device__ __forceinline__ unsigned short f32_to_f16(float) { __builtin_trap(); }
#endif

__device__ __forceinline__ float load_one(const unsigned char* p, int dtype, long long i) {
    if (dtype == 0) return ((const float*)p)[i];
    unsigned short h = ((const unsigned short*)p)[i];
    if (dtype == 1) return bf16_to_f32(h);
    return f16_to_f32(h);
}

__device__ __forceinline__ void store_one(unsigned char* p, int dtype, long long i, float x) {
    if (dtype == 0) {
        ((float*)p)[i] = x;
    } else if (dtype == 1) {
        ((unsigned short*)p)[i] = f32_to_bf16(x);
    } else {
        ((unsigned short*)p)[i] = f32_to_f16(x);
    }
}

__device__ __forceinline__ float round_to(int prec, float x) {
    if (prec == 1) return bf16_to_f32(f32_to_bf16(x));
    if (prec == 2) return f16_to_f32(f32_to_f16(x));
    return x;
}

// dst[i] = value of src[i] stored as dtype.
extern "C" __global__ void load(const unsigned char* src, int dtype, float* dst, long long n) {
    GRID_STRIDE(i, n) dst[i] = load_one(src, dtype, i);
}

// dst[i] = src[i] rounded to dtype.
extern "C" __global__ void store(const float* src, unsigned char* dst, int dtype, long long n) {
    GRID_STRIDE(i, n) store_one(dst, dtype, i, src[i]);
}

// dst[i] += src[i] in f32, rounded once to dtype (Arena::add).
extern "C" __global__ void add_store(const float* src, unsigned char* dst, int dtype, long long n) {
    GRID_STRIDE(i, n) store_one(dst, dtype, i, load_one(dst, dtype, i) + src[i]);
}

// An fp32 statistic at a 2-byte-aligned place: low half first (kernels.rs f32_halves).
extern "C" __global__ void store_halves(const float* src, unsigned short* dst, long long n) {
    GRID_STRIDE(i, n) {
        unsigned int b = __float_as_uint(src[i]);
        dst[2 * i] = (unsigned short)(b & 0xffff);
        dst[2 * i + 1] = (unsigned short)(b >> 16);
    }
}

extern "C" __global__ void load_halves(const unsigned short* src, float* dst, long long n) {
    GRID_STRIDE(i, n) {
        dst[i] = __uint_as_float((unsigned int)src[2 * i] | ((unsigned int)src[2 * i + 1] << 16));
    }
}

// Precision::round in place.
extern "C" __global__ void round_in_place(float* x, int prec, long long n) {
    GRID_STRIDE(i, n) x[i] = round_to(prec, x[i]);
}

extern "C" __global__ void fill(float* x, float v, long long n) {
    GRID_STRIDE(i, n) x[i] = v;
}

// ---- linear layers: math/gemm.rs (the products themselves go through cuBLAS) ----

// y[r][c] += b[c] for t rows of width w.
extern "C" __global__ void bias_add(float* y, const float* b, long long t, long long w) {
    GRID_STRIDE(i, t * w) y[i] += b[i % w];
}

// acc[c] += sum over rows of m[r][c], rows in order (col_sums).
extern "C" __global__ void col_sums(const float* m, long long t, long long w, float* acc) {
    GRID_STRIDE(c, w) {
        float s = 0.0f;
        for (long long r = 0; r < t; ++r) s += m[r * w + c];
        acc[c] += s;
    }
}

// ---- embedding: layers.rs ----

extern "C" __global__ void embedding_forward(const int* tokens, const float* wte, const float* wpe,
                                             float* out, long long t, long long h, long long s) {
    GRID_STRIDE(i, t * h) {
        long long row = i / h, c = i % h;
        float v = wte[(long long)tokens[row] * h + c];
        if (wpe) v += wpe[(row % s) * h + c];
        out[i] = v;
    }
}

// One thread per hidden column, tokens in order: deterministic, the CPU's summation order.
extern "C" __global__ void embedding_backward(const int* tokens, const float* g, float* dwte,
                                              float* dwpe, long long t, long long h, long long s) {
    GRID_STRIDE(c, h) {
        for (long long row = 0; row < t; ++row) {
            float v = g[row * h + c];
            dwte[(long long)tokens[row] * h + c] += v;
            if (dwpe) dwpe[(row % s) * h + c] += v;
        }
    }
}

// ---- norms: ops.rs norm_forward / norm_backward. One block (256 threads) per row. ----

__device__ float block_sum(float v, float* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if ((int)threadIdx.x < k) sh[threadIdx.x] += sh[threadIdx.x + k];
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

// kind 0 layer norm, 1 RMS norm; stats gets (mean, 1/sigma) per row.
extern "C" __global__ void norm_forward(int kind, const float* x, const float* w, const float* b,
                                        float* out, float* stats, long long h) {
    __shared__ float sh[256];
    long long row = blockIdx.x;
    const float* xr = x + row * h;
    float hf = (float)h;
    float mean = 0.0f, rstd;
    if (kind == 0) {
        float s = 0.0f;
        for (long long j = threadIdx.x; j < h; j += blockDim.x) s += xr[j];
        mean = block_sum(s, sh) / hf;
        float v = 0.0f;
        for (long long j = threadIdx.x; j < h; j += blockDim.x) v += (xr[j] - mean) * (xr[j] - mean);
        rstd = 1.0f / sqrtf(block_sum(v, sh) / hf + 1e-5f);
    } else {
        float v = 0.0f;
        for (long long j = threadIdx.x; j < h; j += blockDim.x) v += xr[j] * xr[j];
        rstd = 1.0f / sqrtf(block_sum(v, sh) / hf + 1e-5f);
    }
    if (threadIdx.x == 0) {
        stats[2 * row] = mean;
        stats[2 * row + 1] = rstd;
    }
    for (long long j = threadIdx.x; j < h; j += blockDim.x) {
        float y = (xr[j] - mean) * rstd * w[j];
        out[row * h + j] = b ? y + b[j] : y;
    }
}

// dx[row] += rstd * (dy*w - mean_d - xhat*mean_dx); one block per row.
extern "C" __global__ void norm_backward_input(int kind, const float* x, const float* w,
                                               const float* stats, const float* dy, float* dx,
                                               long long h) {
    __shared__ float sh[256];
    long long row = blockIdx.x;
    const float *xr = x + row * h, *dyr = dy + row * h;
    float mean = stats[2 * row], rstd = stats[2 * row + 1];
    float sd = 0.0f, sdx = 0.0f;
    for (long long j = threadIdx.x; j < h; j += blockDim.x) {
        float xhat = (xr[j] - mean) * rstd;
        float d = dyr[j] * w[j];
        sd += d;
        sdx += d * xhat;
    }
    float sum_d = block_sum(sd, sh), sum_dx = block_sum(sdx, sh);
    float mean_d = kind == 0 ? sum_d / (float)h : 0.0f;
    float mean_dx = sum_dx / (float)h;
    for (long long j = threadIdx.x; j < h; j += blockDim.x) {
        float xhat = (xr[j] - mean) * rstd;
        dx[row * h + j] += rstd * (dyr[j] * w[j] - mean_d - xhat * mean_dx);
    }
}

// dw[j] += sum_rows dy*xhat, db[j] += sum_rows dy; one thread per column, rows in order.
extern "C" __global__ void norm_backward_params(const float* x, const float* stats, const float* dy,
                                                float* dw, float* db, long long t, long long h) {
    GRID_STRIDE(j, h) {
        float sw = 0.0f, sb = 0.0f;
        for (long long r = 0; r < t; ++r) {
            float xhat = (x[r * h + j] - stats[2 * r]) * stats[2 * r + 1];
            sw += dy[r * h + j] * xhat;
            sb += dy[r * h + j];
        }
        dw[j] += sw;
        if (db) db[j] += sb;
    }
}

// ---- activations: ops.rs ----

#define GELU_C 0.7978846f
#define GELU_A 0.044715f

__device__ __forceinline__ float tanh_via_exp(float u) {
    float e = expf(-2.0f * fabsf(u));
    return copysignf((1.0f - e) / (1.0f + e), u);
}

extern "C" __global__ void gelu_forward(const float* pre, float* post, long long n) {
    GRID_STRIDE(i, n) {
        float x = pre[i];
        post[i] = 0.5f * x * (1.0f + tanh_via_exp(GELU_C * (x + GELU_A * x * x * x)));
    }
}

// d[i] *= gelu'(pre[i]).
extern "C" __global__ void gelu_backward(const float* pre, float* d, long long n) {
    GRID_STRIDE(i, n) {
        float x = pre[i];
        float t = tanh_via_exp(GELU_C * (x + GELU_A * x * x * x));
        d[i] *= 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * GELU_C * (1.0f + 3.0f * GELU_A * x * x);
    }
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

extern "C" __global__ void swiglu_forward(const float* gate, const float* up, float* prod,
                                          long long n) {
    GRID_STRIDE(i, n) {
        float g = gate[i];
        prod[i] = g * sigmoid(g) * up[i];
    }
}

// In: dgate holds d(prod). Out: dgate, dup.
extern "C" __global__ void swiglu_backward(const float* gate, const float* up, float* dgate,
                                           float* dup, long long n) {
    GRID_STRIDE(i, n) {
        float x = gate[i], u = up[i], sg = sigmoid(x), dp = dgate[i];
        dup[i] = dp * x * sg;
        dgate[i] = dp * u * sg * (1.0f + x * (1.0f - sg));
    }
}

// ---- rotary positions: ops.rs Rope::apply over the q and k heads of each token row ----

extern "C" __global__ void rope(float* qkv, const float* cosv, const float* sinv, long long t,
                                long long s, long long width, int heads, int kv_heads, int half,
                                int inverse) {
    long long per_row = (long long)(heads + kv_heads) * half;
    GRID_STRIDE(i, t * per_row) {
        long long tok = i / per_row, rest = i % per_row;
        long long head = rest / half, k = rest % half;
        long long pos = tok % s;
        // q heads first, then the k heads right after them.
        float* base = qkv + tok * width + head * 2 * half;
        float c = cosv[pos * half + k], sn = sinv[pos * half + k];
        if (inverse) sn = -sn;
        float x1 = base[k], x2 = base[k + half];
        base[k] = x1 * c - x2 * sn;
        base[k + half] = x2 * c + x1 * sn;
    }
}

// ---- attention: attention.rs. Scores come from cuBLAS; these kernels do the rows. ----

// Causal softmax of each row of p ([rows][s], row i of its sequence-head at i % s): columns past
// the diagonal become 0; lse (when given) gets the row's log-sum-exp; probs are rounded to prec.
extern "C" __global__ void causal_softmax(float* p, float* lse, long long s, int prec) {
    __shared__ float sh[256];
    long long row = blockIdx.x;
    long long i = row % s;
    float* r = p + row * s;
    float m = NEG_INF;
    for (long long j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, r[j]);
    sh[threadIdx.x] = m;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if ((int)threadIdx.x < k) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + k]);
        __syncthreads();
    }
    m = sh[0];
    __syncthreads();
    float acc = 0.0f;
    for (long long j = threadIdx.x; j <= i; j += blockDim.x) acc += expf(r[j] - m);
    float l = m + logf(block_sum(acc, sh));
    for (long long j = threadIdx.x; j < s; j += blockDim.x) {
        r[j] = j <= i ? round_to(prec, expf(r[j] - l)) : 0.0f;
    }
    if (lse && threadIdx.x == 0) lse[row] = l;
}

// p = exp(scores - lse) below the diagonal, 0 above (flash backward's recomputation).
extern "C" __global__ void probs_from_lse(float* p, const float* lse, long long rows, long long s) {
    GRID_STRIDE(k, rows * s) {
        long long row = k / s, j = k % s, i = row % s;
        p[k] = j <= i ? expf(p[k] - lse[row]) : 0.0f;
    }
}

// dp = p * (dp - rowsum(p * dp)) * scale; one block per row.
extern "C" __global__ void softmax_backward(const float* p, float* dp, long long s, float scale) {
    __shared__ float sh[256];
    long long row = blockIdx.x;
    const float* pr = p + row * s;
    float* dr = dp + row * s;
    float acc = 0.0f;
    for (long long j = threadIdx.x; j < s; j += blockDim.x) acc += pr[j] * dr[j];
    float dot = block_sum(acc, sh);
    for (long long j = threadIdx.x; j < s; j += blockDim.x) dr[j] = pr[j] * (dr[j] - dot) * scale;
}

// ---- loss: math/mod.rs cross_entropy. One block per token row. ----

extern "C" __global__ void cross_entropy(const float* logits, const int* targets, long long vocab,
                                         long long n, float* grad, double* loss_sum) {
    __shared__ float sh[256];
    long long row = blockIdx.x;
    const float* r = logits + row * vocab;
    float* g = grad + row * vocab;
    float m = NEG_INF;
    for (long long j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, r[j]);
    sh[threadIdx.x] = m;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if ((int)threadIdx.x < k) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + k]);
        __syncthreads();
    }
    m = sh[0];
    __syncthreads();
    float acc = 0.0f;
    for (long long j = threadIdx.x; j < vocab; j += blockDim.x) acc += expf(r[j] - m);
    float lse = m + logf(block_sum(acc, sh));
    float inv = 1.0f / (float)n;
    int target = targets[row];
    for (long long j = threadIdx.x; j < vocab; j += blockDim.x) {
        float v = expf(r[j] - lse) * inv;
        g[j] = j == target ? v - inv : v;
    }
    if (threadIdx.x == 0) atomicAdd(loss_sum, (double)(lse - r[target]));
}

// ---- optimizers: math/optim.rs and the CPU backend's Update ----

// The step's gradient scale, as the CPU backend computes it on the host.
__device__ float grad_scale(const unsigned char* sumsq, int sumsq_dtype, double contributions,
                            double clip) {
    double factor = 1.0;
    if (sumsq && clip > 0.0) {
        double norm = sqrt((double)load_one(sumsq, sumsq_dtype, 0)) / contributions;
        factor = fmin(clip / (norm + 1e-6), 1.0);
    }
    return (float)(factor / contributions);
}

// state = [master | m | v] (3n); decay = pairs of flat-vector [start, end) ranges.
extern "C" __global__ void adam(float* state, const float* grad, long long n, long long first,
                                const long long* decay, int decay_ranges, int decays,
                                const unsigned char* sumsq, int sumsq_dtype, double contributions,
                                double clip, float beta1, float beta2, float eps, float step_size,
                                float bc2_sqrt, float shrink) {
    float scale = grad_scale(sumsq, sumsq_dtype, contributions, clip);
    float *master = state, *m = state + n, *v = state + 2 * n;
    GRID_STRIDE(j, n) {
        long long at = first + j;
        int inside = 0;
        for (int k = 0; k < decay_ranges; ++k)
            if (at >= decay[2 * k] && at < decay[2 * k + 1]) inside = 1;
        float g = grad[j] * scale;
        m[j] = beta1 * m[j] + (1.0f - beta1) * g;
        v[j] = beta2 * v[j] + (1.0f - beta2) * g * g;
        if (decays && inside) master[j] *= shrink;
        float denom = sqrtf(v[j]) / bc2_sqrt + eps;
        master[j] -= step_size * m[j] / denom;
    }
}

extern "C" __global__ void sgd(float* state, const float* grad, long long n,
                               const unsigned char* sumsq, int sumsq_dtype, double contributions,
                               double clip, float lr) {
    float scale = grad_scale(sumsq, sumsq_dtype, contributions, clip);
    GRID_STRIDE(j, n) state[j] -= lr * (grad[j] * scale);
}

// acc (one double) += sum of x[i]^2 in f64.
extern "C" __global__ void sum_squares(const float* x, long long n, double* acc) {
    __shared__ double sh[256];
    double s = 0.0;
    GRID_STRIDE(i, n) s += (double)x[i] * (double)x[i];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if ((int)threadIdx.x < k) sh[threadIdx.x] += sh[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(acc, sh[0]);
}

// dst (one value of dtype) = (float) *acc.
extern "C" __global__ void store_double(const double* acc, unsigned char* dst, int dtype) {
    if (threadIdx.x == 0 && blockIdx.x == 0) store_one(dst, dtype, 0, (float)*acc);
}
