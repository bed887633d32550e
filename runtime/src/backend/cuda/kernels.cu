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
// The host emulation of the tests (kernels compiled as C++): the same conversions in integer
// code, as the `half` crate does them.
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    unsigned int sign = (unsigned int)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (e == 0x1f) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    if (e == 0) {
        float v = (float)man * 5.9604645e-8f;  // man · 2^-24, exact
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((e + 112) << 23) | (man << 13));
}

__device__ __forceinline__ unsigned short f32_to_f16(float x) {
    unsigned int b = __float_as_uint(x);
    unsigned int sign = (b >> 16) & 0x8000, e8 = (b >> 23) & 0xff, man = b & 0x7fffff;
    if (e8 == 0xff) return (unsigned short)(sign | 0x7c00 | (man ? 0x200 | (man >> 13) : 0));
    int e = (int)e8 - 112;  // the half's biased exponent
    if (e >= 0x1f) return (unsigned short)(sign | 0x7c00);
    unsigned int r, rem, tie;
    if (e <= 0) {  // a subnormal half (or zero): the value in units of 2^-24
        if (e < -10) return (unsigned short)sign;
        unsigned int m = man | 0x800000, shift = (unsigned int)(14 - e);
        r = m >> shift;
        rem = m & ((1u << shift) - 1);
        tie = 1u << (shift - 1);
    } else {
        r = ((unsigned int)e << 10) | (man >> 13);
        rem = man & 0x1fff;
        tie = 0x1000;
    }
    if (rem > tie || (rem == tie && (r & 1))) ++r;  // a carry rolls into the exponent (to inf)
    return (unsigned short)(sign | r);
}
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

// The sum (or maximum) of every thread's `v` in the block, returned to every thread; `sh` holds
// blockDim floats. Power-of-two block sizes (256 on the GPU, 1 or 2 in the host emulation).
__device__ float block_reduce(float v, float* sh, bool max) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if ((int)threadIdx.x < k) {
            float o = sh[threadIdx.x + k];
            sh[threadIdx.x] = max ? fmaxf(sh[threadIdx.x], o) : sh[threadIdx.x] + o;
        }
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

__device__ float block_sum(float v, float* sh) { return block_reduce(v, sh, false); }

__device__ float block_max(float v, float* sh) { return block_reduce(v, sh, true); }

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
    m = block_max(m, sh);
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

// ---- fused causal attention (attention = flash): the s x s matrix is never stored. ----
// qkv rows are tokens: [q (heads*d) | k (kv_heads*d) | v (kv_heads*d)]; query head n reads kv
// head n / (heads / kv_heads). A "row" is (sequence b, head n, query i), numbered as the CPU's
// lse: (b * heads + n) * s + i.

struct AttnRow {
    const float* q;   // this row's query
    const float* k0;  // key of token 0 of the sequence (rows `width` apart)
    const float* v0;  // value of token 0
    long long tok;    // the query's token: b * s + i
    long long i;
};

__device__ AttnRow attn_row(const float* qkv, long long row, long long s, long long width,
                            int heads, int kv_heads, int d) {
    AttnRow r;
    long long bn = row / s, b = bn / heads;
    int n = (int)(bn % heads), g = n / (heads / kv_heads);
    r.i = row % s;
    r.tok = b * s + r.i;
    r.q = qkv + r.tok * width + (long long)n * d;
    r.k0 = qkv + b * s * width + (long long)heads * d + (long long)g * d;
    r.v0 = r.k0 + (long long)kv_heads * d;
    return r;
}

__device__ __forceinline__ float dot(const float* a, const float* b, int d) {
    float acc = 0.0f;
    for (int c = 0; c < d; ++c) acc += a[c] * b[c];
    return acc;
}

// Forward, one block per row: keys a tile of blockDim at a time, each thread scoring one; the
// running max and sum rescale the output accumulated in place (FlashAttention's online softmax).
extern "C" __global__ void flash_forward(const float* qkv, float* out, float* lse, long long s,
                                         long long width, int heads, int kv_heads, int d,
                                         float scale) {
    __shared__ float sc[256];
    __shared__ float sh[256];
    long long row = blockIdx.x;
    AttnRow r = attn_row(qkv, row, s, width, heads, kv_heads, d);
    int n = (int)((row / s) % heads);
    float* o = out + r.tok * (long long)heads * d + (long long)n * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) o[c] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    for (long long j0 = 0; j0 <= r.i; j0 += blockDim.x) {
        long long j = j0 + threadIdx.x;
        float x = j <= r.i ? dot(r.q, r.k0 + j * width, d) * scale : NEG_INF;
        float m_new = fmaxf(m, block_max(x, sh));
        float p = j <= r.i ? expf(x - m_new) : 0.0f;
        float alpha = expf(m - m_new);
        l = l * alpha + block_sum(p, sh);
        sc[threadIdx.x] = p;
        __syncthreads();
        long long tile = r.i - j0 + 1 < (long long)blockDim.x ? r.i - j0 + 1 : blockDim.x;
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            float acc = o[c] * alpha;
            for (long long t = 0; t < tile; ++t) acc += sc[t] * r.v0[(j0 + t) * width + c];
            o[c] = acc;
        }
        __syncthreads();
        m = m_new;
    }
    float inv = 1.0f / l;
    for (int c = threadIdx.x; c < d; c += blockDim.x) o[c] *= inv;
    if (threadIdx.x == 0) lse[row] = m + logf(l);
}

// Backward, query side, one block per row: D = rowsum(P * dP) into dsum, then
// dQ = sum_j P_ij (dP_ij - D) scale K_j, written (not added) at q's place in dqkv.
extern "C" __global__ void flash_backward_dq(const float* qkv, const float* dout, const float* lse,
                                             float* dsum, float* dqkv, long long s,
                                             long long width, int heads, int kv_heads, int d,
                                             float scale) {
    __shared__ float sc[256];
    __shared__ float sh[256];
    long long row = blockIdx.x;
    AttnRow r = attn_row(qkv, row, s, width, heads, kv_heads, d);
    int n = (int)((row / s) % heads);
    const float* g = dout + r.tok * (long long)heads * d + (long long)n * d;
    float* dq = dqkv + (r.q - qkv);
    float l = lse[row], acc = 0.0f;
    for (long long j = threadIdx.x; j <= r.i; j += blockDim.x) {
        float p = expf(dot(r.q, r.k0 + j * width, d) * scale - l);
        acc += p * dot(g, r.v0 + j * width, d);
    }
    float dd = block_sum(acc, sh);
    if (threadIdx.x == 0) dsum[row] = dd;
    for (int c = threadIdx.x; c < d; c += blockDim.x) dq[c] = 0.0f;
    for (long long j0 = 0; j0 <= r.i; j0 += blockDim.x) {
        long long j = j0 + threadIdx.x;
        float ds = 0.0f;
        if (j <= r.i) {
            float p = expf(dot(r.q, r.k0 + j * width, d) * scale - l);
            ds = p * (dot(g, r.v0 + j * width, d) - dd) * scale;
        }
        sc[threadIdx.x] = ds;
        __syncthreads();
        long long tile = r.i - j0 + 1 < (long long)blockDim.x ? r.i - j0 + 1 : blockDim.x;
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            float a = dq[c];
            for (long long t = 0; t < tile; ++t) a += sc[t] * r.k0[(j0 + t) * width + c];
            dq[c] = a;
        }
        __syncthreads();
    }
}

// Backward, key side, one block per (sequence b, kv head g, key j): dK_j and dV_j summed over the
// group's query heads and the queries i >= j, a tile of blockDim queries at a time, written (not
// added) at k's and v's places in dqkv. No atomics: each block owns its rows.
extern "C" __global__ void flash_backward_dkv(const float* qkv, const float* dout, const float* lse,
                                              const float* dsum, float* dqkv, long long s,
                                              long long width, int heads, int kv_heads, int d,
                                              float scale) {
    __shared__ float sp[256];
    __shared__ float sds[256];
    long long row = blockIdx.x;
    long long j = row % s, bg = row / s, b = bg / kv_heads;
    int g = (int)(bg % kv_heads), group = heads / kv_heads;
    long long hidden = (long long)heads * d;
    const float* k = qkv + (b * s + j) * width + hidden + (long long)g * d;
    const float* v = k + (long long)kv_heads * d;
    float* dk = dqkv + (k - qkv);
    float* dv = dqkv + (v - qkv);
    for (int c = threadIdx.x; c < d; c += blockDim.x) dk[c] = dv[c] = 0.0f;
    for (int n = g * group; n < (g + 1) * group; ++n) {
        long long base = (b * heads + n) * s;
        for (long long i0 = j; i0 < s; i0 += blockDim.x) {
            long long i = i0 + threadIdx.x;
            float p = 0.0f, ds = 0.0f;
            if (i < s) {
                const float* q = qkv + (b * s + i) * width + (long long)n * d;
                const float* gi = dout + (b * s + i) * hidden + (long long)n * d;
                p = expf(dot(q, k, d) * scale - lse[base + i]);
                ds = p * (dot(gi, v, d) - dsum[base + i]) * scale;
            }
            sp[threadIdx.x] = p;
            sds[threadIdx.x] = ds;
            __syncthreads();
            long long tile = s - i0 < (long long)blockDim.x ? s - i0 : blockDim.x;
            for (int c = threadIdx.x; c < d; c += blockDim.x) {
                float a = dk[c], bv = dv[c];
                for (long long t = 0; t < tile; ++t) {
                    long long tok = b * s + i0 + t;
                    a += sds[t] * qkv[tok * width + (long long)n * d + c];
                    bv += sp[t] * dout[tok * hidden + (long long)n * d + c];
                }
                dk[c] = a;
                dv[c] = bv;
            }
            __syncthreads();
        }
    }
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
    m = block_max(m, sh);
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
