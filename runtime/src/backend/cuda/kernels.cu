// The CUDA backend's kernels (compiled by NVRTC at start-up, cached as PTX). Each one is the device
// twin of a function of `runtime/src/math` or of the CPU backend's arena accesses, written to be
// read beside it: f32 arithmetic, rounding to the stored dtype where the CPU rounds, the same
// order of operations where the result would otherwise differ by more than rounding.
//
// Every tensor pointer comes with its dtype code, so one kernel computes on fp32 workspace and on
// the arena's 16-bit regions in place: 0 fp32, 1 bf16, 2 fp16 (16-bit words), 3 fp32 as two
// 16-bit halves at a 2-byte-aligned address (statistics inside a 16-bit saved region). Values
// are read by widening to f32 (`load_one`); a store rounds once to the pointer's dtype
// (`store_one`), which is where the CPU rounds when the layer math writes a tensor once.
// Accumulators live in registers or shared memory, never in a 16-bit tensor. Sizes are long long.

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
    const unsigned short* h = (const unsigned short*)p;
    if (dtype == 3) return __uint_as_float((unsigned int)h[2 * i] | ((unsigned int)h[2 * i + 1] << 16));
    if (dtype == 1) return bf16_to_f32(h[i]);
    return f16_to_f32(h[i]);
}

__device__ __forceinline__ void store_one(unsigned char* p, int dtype, long long i, float x) {
    unsigned short* h = (unsigned short*)p;
    if (dtype == 0) {
        ((float*)p)[i] = x;
    } else if (dtype == 3) {
        unsigned int b = __float_as_uint(x);
        h[2 * i] = (unsigned short)(b & 0xffff);
        h[2 * i + 1] = (unsigned short)(b >> 16);
    } else if (dtype == 1) {
        h[i] = f32_to_bf16(x);
    } else {
        h[i] = f32_to_f16(x);
    }
}

__device__ __forceinline__ float round_to(int prec, float x) {
    if (prec == 1) return bf16_to_f32(f32_to_bf16(x));
    if (prec == 2) return f16_to_f32(f32_to_f16(x));
    return x;
}

// A tensor parameter `p` comes with its dtype code `p_dt`; LD and ST read and write element i.
#define LD(p, i) load_one(p, p##_dt, i)
#define ST(p, i, x) store_one(p, p##_dt, i, x)

__device__ __forceinline__ void convert_range(const unsigned char* src, int src_dt,
                                              unsigned char* dst, int dst_dt, long long n) {
    GRID_STRIDE(i, n) store_one(dst, dst_dt, i, load_one(src, src_dt, i));
}

// dst[i] = src[i], rounded to dst's dtype: the layer math's copies between storages and the
// products' operand casts.
extern "C" __global__ void convert(const unsigned char* src, int src_dt, unsigned char* dst, int dst_dt, long long n) {
    convert_range(src, src_dt, dst, dst_dt, n);
}

// The same, for a region staged between the arena and f32 workspace (Device::load and store):
// a separate name, so that traces and the tests tell staging from the math's conversions.
extern "C" __global__ void stage(const unsigned char* src, int src_dt, unsigned char* dst, int dst_dt, long long n) {
    convert_range(src, src_dt, dst, dst_dt, n);
}

// dst[i] += src[i] in f32, rounded once to dst's dtype (Arena::add).
extern "C" __global__ void stage_add(const unsigned char* src, int src_dt, unsigned char* dst, int dst_dt, long long n) {
    GRID_STRIDE(i, n) ST(dst, i, LD(dst, i) + LD(src, i));
}

// Precision::round in place (a no-op the host skips where x's dtype already is prec).
extern "C" __global__ void round_in_place(unsigned char* x, int x_dt, int prec, long long n) {
    GRID_STRIDE(i, n) ST(x, i, round_to(prec, LD(x, i)));
}

extern "C" __global__ void fill(unsigned char* x, int x_dt, float v, long long n) {
    GRID_STRIDE(i, n) ST(x, i, v);
}

// ---- linear layers: math/gemm.rs (the products themselves go through cuBLAS) ----

// y[r][c] += b[c] for t rows of width w (fp32 outputs; a 16-bit output adds its bias in the
// product's epilogue, rounding once).
extern "C" __global__ void bias_add(unsigned char* y, int y_dt, const unsigned char* b, int b_dt, long long t, long long w) {
    GRID_STRIDE(i, t * w) ST(y, i, LD(y, i) + LD(b, i % w));
}

// acc[c] += sum over rows of m[r][c], rows in order (col_sums).
extern "C" __global__ void col_sums(const unsigned char* m, int m_dt, long long t, long long w, unsigned char* acc, int acc_dt) {
    GRID_STRIDE(c, w) {
        float s = 0.0f;
        for (long long r = 0; r < t; ++r) s += LD(m, r * w + c);
        ST(acc, c, LD(acc, c) + s);
    }
}

// ---- embedding: layers.rs ----

extern "C" __global__ void embedding_forward(const int* tokens, const unsigned char* wte, int wte_dt, const unsigned char* wpe, int wpe_dt,
                                             unsigned char* out, int out_dt, long long t, long long h, long long s) {
    GRID_STRIDE(i, t * h) {
        long long row = i / h, c = i % h;
        float v = LD(wte, (long long)tokens[row] * h + c);
        if (wpe) v += LD(wpe, (row % s) * h + c);
        ST(out, i, v);
    }
}

// One thread per hidden column, tokens in order: deterministic, the CPU's summation order.
extern "C" __global__ void embedding_backward(const int* tokens, const unsigned char* g, int g_dt, unsigned char* dwte, int dwte_dt,
                                              unsigned char* dwpe, int dwpe_dt, long long t, long long h,
                                              long long s) {
    GRID_STRIDE(c, h) {
        for (long long row = 0; row < t; ++row) {
            float v = LD(g, row * h + c);
            long long at = (long long)tokens[row] * h + c;
            ST(dwte, at, LD(dwte, at) + v);
            if (dwpe) ST(dwpe, (row % s) * h + c, LD(dwpe, (row % s) * h + c) + v);
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
extern "C" __global__ void norm_forward(int kind, const unsigned char* x, int x_dt, const unsigned char* w, int w_dt, const unsigned char* b, int b_dt, unsigned char* out, int out_dt,
                                        unsigned char* stats, int stats_dt, long long h) {
    __shared__ float sh[256];
    long long row = blockIdx.x, x0 = row * h;
    float hf = (float)h;
    float mean = 0.0f, rstd;
    if (kind == 0) {
        float s = 0.0f;
        for (long long j = threadIdx.x; j < h; j += blockDim.x) s += LD(x, x0 + j);
        mean = block_sum(s, sh) / hf;
        float v = 0.0f;
        for (long long j = threadIdx.x; j < h; j += blockDim.x) {
            float c = LD(x, x0 + j) - mean;
            v += c * c;
        }
        rstd = 1.0f / sqrtf(block_sum(v, sh) / hf + 1e-5f);
    } else {
        float v = 0.0f;
        for (long long j = threadIdx.x; j < h; j += blockDim.x) v += LD(x, x0 + j) * LD(x, x0 + j);
        rstd = 1.0f / sqrtf(block_sum(v, sh) / hf + 1e-5f);
    }
    if (threadIdx.x == 0) {
        ST(stats, 2 * row, mean);
        ST(stats, 2 * row + 1, rstd);
    }
    for (long long j = threadIdx.x; j < h; j += blockDim.x) {
        float y = (LD(x, x0 + j) - mean) * rstd * LD(w, j);
        ST(out, x0 + j, b ? y + LD(b, j) : y);
    }
}

// dx[row] += rstd * (dy*w - mean_d - xhat*mean_dx); one block per row.
extern "C" __global__ void norm_backward_input(int kind, const unsigned char* x, int x_dt, const unsigned char* w, int w_dt, const unsigned char* stats, int stats_dt,
                                               const unsigned char* dy, int dy_dt, unsigned char* dx, int dx_dt, long long h) {
    __shared__ float sh[256];
    long long row = blockIdx.x, r0 = row * h;
    float mean = LD(stats, 2 * row), rstd = LD(stats, 2 * row + 1);
    float sd = 0.0f, sdx = 0.0f;
    for (long long j = threadIdx.x; j < h; j += blockDim.x) {
        float xhat = (LD(x, r0 + j) - mean) * rstd;
        float d = LD(dy, r0 + j) * LD(w, j);
        sd += d;
        sdx += d * xhat;
    }
    float sum_d = block_sum(sd, sh), sum_dx = block_sum(sdx, sh);
    float mean_d = kind == 0 ? sum_d / (float)h : 0.0f;
    float mean_dx = sum_dx / (float)h;
    for (long long j = threadIdx.x; j < h; j += blockDim.x) {
        float xhat = (LD(x, r0 + j) - mean) * rstd;
        ST(dx, r0 + j, LD(dx, r0 + j) + rstd * (LD(dy, r0 + j) * LD(w, j) - mean_d - xhat * mean_dx));
    }
}

// dw[j] += sum_rows dy*xhat, db[j] += sum_rows dy; one thread per column, rows in order.
extern "C" __global__ void norm_backward_params(const unsigned char* x, int x_dt, const unsigned char* stats, int stats_dt, const unsigned char* dy, int dy_dt,
                                                unsigned char* dw, int dw_dt, unsigned char* db, int db_dt, long long t, long long h) {
    GRID_STRIDE(j, h) {
        float sw = 0.0f, sb = 0.0f;
        for (long long r = 0; r < t; ++r) {
            float xhat = (LD(x, r * h + j) - LD(stats, 2 * r)) * LD(stats, 2 * r + 1);
            sw += LD(dy, r * h + j) * xhat;
            sb += LD(dy, r * h + j);
        }
        ST(dw, j, LD(dw, j) + sw);
        if (db) ST(db, j, LD(db, j) + sb);
    }
}

// ---- activations: ops.rs ----

#define GELU_C 0.7978846f
#define GELU_A 0.044715f

__device__ __forceinline__ float tanh_via_exp(float u) {
    float e = expf(-2.0f * fabsf(u));
    return copysignf((1.0f - e) / (1.0f + e), u);
}

extern "C" __global__ void gelu_forward(const unsigned char* pre, int pre_dt, unsigned char* post, int post_dt, long long n) {
    GRID_STRIDE(i, n) {
        float x = LD(pre, i);
        ST(post, i, 0.5f * x * (1.0f + tanh_via_exp(GELU_C * (x + GELU_A * x * x * x))));
    }
}

// d[i] *= gelu'(pre[i]).
extern "C" __global__ void gelu_backward(const unsigned char* pre, int pre_dt, unsigned char* d, int d_dt, long long n) {
    GRID_STRIDE(i, n) {
        float x = LD(pre, i);
        float t = tanh_via_exp(GELU_C * (x + GELU_A * x * x * x));
        ST(d, i,
           LD(d, i) * (0.5f * (1.0f + t) +
                       0.5f * x * (1.0f - t * t) * GELU_C * (1.0f + 3.0f * GELU_A * x * x)));
    }
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

extern "C" __global__ void swiglu_forward(const unsigned char* gate, int gate_dt, const unsigned char* up, int up_dt, unsigned char* prod, int prod_dt, long long n) {
    GRID_STRIDE(i, n) {
        float g = LD(gate, i);
        ST(prod, i, g * sigmoid(g) * LD(up, i));
    }
}

// In: dgate holds d(prod). Out: dgate, dup.
extern "C" __global__ void swiglu_backward(const unsigned char* gate, int gate_dt, const unsigned char* up, int up_dt, unsigned char* dgate, int dgate_dt, unsigned char* dup, int dup_dt,
                                           long long n) {
    GRID_STRIDE(i, n) {
        float x = LD(gate, i), u = LD(up, i), sg = sigmoid(x), dp = LD(dgate, i);
        ST(dup, i, dp * x * sg);
        ST(dgate, i, dp * u * sg * (1.0f + x * (1.0f - sg)));
    }
}

// ---- rotary positions: ops.rs Rope::apply over the q and k heads of each token row ----

// Rotates the q and k heads of src into qkv and copies the v heads (only when src is not qkv:
// in place, v stays), so that a product's fp32 output is rotated and rounded once into 16-bit
// storage. The cos and sin tables are the rank's fp32 constants.
extern "C" __global__ void rope(const unsigned char* src, int src_dt, unsigned char* qkv,
                                int qkv_dt, const float* cosv, const float* sinv, long long t,
                                long long s, long long width, int heads, int kv_heads, int half,
                                int inverse) {
    long long rotated = (long long)(heads + kv_heads) * half;
    long long copied = src == qkv ? 0 : (long long)kv_heads * 2 * half;
    long long per_row = rotated + copied;
    GRID_STRIDE(i, t * per_row) {
        long long tok = i / per_row, rest = i % per_row;
        if (rest >= rotated) {  // a v element: after the q and k heads (2 * rotated of them)
            long long at = tok * width + 2 * rotated + (rest - rotated);
            ST(qkv, at, LD(src, at));
            continue;
        }
        long long head = rest / half, k = rest % half;
        long long pos = tok % s;
        // q heads first, then the k heads right after them.
        long long base = tok * width + head * 2 * half;
        float c = cosv[pos * half + k], sn = sinv[pos * half + k];
        if (inverse) sn = -sn;
        float x1 = LD(src, base + k), x2 = LD(src, base + k + half);
        ST(qkv, base + k, x1 * c - x2 * sn);
        ST(qkv, base + k + half, x2 * c + x1 * sn);
    }
}

// ---- attention: attention.rs. Scores come from cuBLAS; these kernels do the rows. ----

// Causal softmax of each row of p ([rows][s], row i of its sequence-head at i % s): columns past
// the diagonal become 0; lse (when given) gets the row's log-sum-exp; probs are rounded to prec.
extern "C" __global__ void causal_softmax(unsigned char* p, int p_dt, unsigned char* lse, int lse_dt, long long s, int prec) {
    __shared__ float sh[256];
    long long row = blockIdx.x;
    long long i = row % s, r0 = row * s;
    float m = NEG_INF;
    for (long long j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, LD(p, r0 + j));
    m = block_max(m, sh);
    float acc = 0.0f;
    for (long long j = threadIdx.x; j <= i; j += blockDim.x) acc += expf(LD(p, r0 + j) - m);
    float l = m + logf(block_sum(acc, sh));
    for (long long j = threadIdx.x; j < s; j += blockDim.x) {
        ST(p, r0 + j, j <= i ? round_to(prec, expf(LD(p, r0 + j) - l)) : 0.0f);
    }
    if (lse && threadIdx.x == 0) ST(lse, row, l);
}

// p = exp(scores - lse) below the diagonal, 0 above (flash backward's recomputation).
extern "C" __global__ void probs_from_lse(unsigned char* p, int p_dt, const unsigned char* lse, int lse_dt, long long rows, long long s) {
    GRID_STRIDE(k, rows * s) {
        long long row = k / s, j = k % s, i = row % s;
        ST(p, k, j <= i ? expf(LD(p, k) - LD(lse, row)) : 0.0f);
    }
}

// dp = p * (dp - rowsum(p * dp)) * scale; one block per row.
extern "C" __global__ void softmax_backward(const unsigned char* p, int p_dt, unsigned char* dp, int dp_dt, long long s, float scale) {
    __shared__ float sh[256];
    long long r0 = blockIdx.x * s;
    float acc = 0.0f;
    for (long long j = threadIdx.x; j < s; j += blockDim.x) acc += LD(p, r0 + j) * LD(dp, r0 + j);
    float dot = block_sum(acc, sh);
    for (long long j = threadIdx.x; j < s; j += blockDim.x) {
        ST(dp, r0 + j, LD(p, r0 + j) * (LD(dp, r0 + j) - dot) * scale);
    }
}

// ---- fused causal attention (attention = flash): the s x s matrix is never stored. ----
// qkv rows are tokens: [q (heads*d) | k (kv_heads*d) | v (kv_heads*d)]; query head n reads kv
// head n / (heads / kv_heads). A "row" is (sequence b, head n, query i), numbered as the CPU's
// lse: (b * heads + n) * s + i. Each block accumulates its output rows in shared memory (f32,
// at most MAX_HEAD_DIM columns) and stores them once at the end.

#define MAX_HEAD_DIM 256

struct AttnRow {
    long long q;    // this row's query (element offset in qkv)
    long long k0;   // key of token 0 of the sequence (rows `width` apart)
    long long v0;   // value of token 0
    long long tok;  // the query's token: b * s + i
    long long i;
};

__device__ AttnRow attn_row(long long row, long long s, long long width, int heads, int kv_heads,
                            int d) {
    AttnRow r;
    long long bn = row / s, b = bn / heads;
    int n = (int)(bn % heads), g = n / (heads / kv_heads);
    r.i = row % s;
    r.tok = b * s + r.i;
    r.q = r.tok * width + (long long)n * d;
    r.k0 = b * s * width + (long long)heads * d + (long long)g * d;
    r.v0 = r.k0 + (long long)kv_heads * d;
    return r;
}

// The dot product of d elements at a (in a_dt) and b (in b_dt).
__device__ __forceinline__ float dot(const unsigned char* a, int a_dt, long long ai,
                                     const unsigned char* b, int b_dt, long long bi, int d) {
    float acc = 0.0f;
    for (int c = 0; c < d; ++c) acc += LD(a, ai + c) * LD(b, bi + c);
    return acc;
}

// Forward, one block per row: keys a tile of blockDim at a time, each thread scoring one; the
// running max and sum rescale the output accumulated in shared memory (FlashAttention's online
// softmax), stored once, normalised, at the end.
extern "C" __global__ void flash_forward(const unsigned char* qkv, int qkv_dt, unsigned char* out, int out_dt, unsigned char* lse, int lse_dt, long long s,
                                         long long width, int heads, int kv_heads, int d,
                                         float scale) {
    __shared__ float sc[256];
    __shared__ float sh[256];
    __shared__ float o[MAX_HEAD_DIM];
    long long row = blockIdx.x;
    AttnRow r = attn_row(row, s, width, heads, kv_heads, d);
    int n = (int)((row / s) % heads);
    long long o0 = r.tok * (long long)heads * d + (long long)n * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) o[c] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    for (long long j0 = 0; j0 <= r.i; j0 += blockDim.x) {
        long long j = j0 + threadIdx.x;
        float x = j <= r.i ? dot(qkv, qkv_dt, r.q, qkv, qkv_dt, r.k0 + j * width, d) * scale
                           : NEG_INF;
        float m_new = fmaxf(m, block_max(x, sh));
        float p = j <= r.i ? expf(x - m_new) : 0.0f;
        float alpha = expf(m - m_new);
        l = l * alpha + block_sum(p, sh);
        sc[threadIdx.x] = p;
        __syncthreads();
        long long tile = r.i - j0 + 1 < (long long)blockDim.x ? r.i - j0 + 1 : blockDim.x;
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            float acc = o[c] * alpha;
            for (long long t = 0; t < tile; ++t) acc += sc[t] * LD(qkv, r.v0 + (j0 + t) * width + c);
            o[c] = acc;
        }
        __syncthreads();
        m = m_new;
    }
    float inv = 1.0f / l;
    for (int c = threadIdx.x; c < d; c += blockDim.x) ST(out, o0 + c, o[c] * inv);
    if (threadIdx.x == 0) ST(lse, row, m + logf(l));
    __syncthreads();
}

// Backward, query side, one block per row: D = rowsum(P * dP) into dsum, then
// dQ = sum_j P_ij (dP_ij - D) scale K_j, written (not added) at q's place in dqkv.
extern "C" __global__ void flash_backward_dq(const unsigned char* qkv, int qkv_dt, const unsigned char* dout, int dout_dt, const unsigned char* lse, int lse_dt,
                                             unsigned char* dsum, int dsum_dt, unsigned char* dqkv, int dqkv_dt, long long s,
                                             long long width, int heads, int kv_heads, int d,
                                             float scale) {
    __shared__ float sc[256];
    __shared__ float sh[256];
    __shared__ float dq[MAX_HEAD_DIM];
    long long row = blockIdx.x;
    AttnRow r = attn_row(row, s, width, heads, kv_heads, d);
    int n = (int)((row / s) % heads);
    long long g = r.tok * (long long)heads * d + (long long)n * d;
    float l = LD(lse, row), acc = 0.0f;
    for (long long j = threadIdx.x; j <= r.i; j += blockDim.x) {
        float p = expf(dot(qkv, qkv_dt, r.q, qkv, qkv_dt, r.k0 + j * width, d) * scale - l);
        acc += p * dot(dout, dout_dt, g, qkv, qkv_dt, r.v0 + j * width, d);
    }
    float dd = block_sum(acc, sh);
    if (threadIdx.x == 0) ST(dsum, row, dd);
    for (int c = threadIdx.x; c < d; c += blockDim.x) dq[c] = 0.0f;
    for (long long j0 = 0; j0 <= r.i; j0 += blockDim.x) {
        long long j = j0 + threadIdx.x;
        float ds = 0.0f;
        if (j <= r.i) {
            float p = expf(dot(qkv, qkv_dt, r.q, qkv, qkv_dt, r.k0 + j * width, d) * scale - l);
            ds = p * (dot(dout, dout_dt, g, qkv, qkv_dt, r.v0 + j * width, d) - dd) * scale;
        }
        sc[threadIdx.x] = ds;
        __syncthreads();
        long long tile = r.i - j0 + 1 < (long long)blockDim.x ? r.i - j0 + 1 : blockDim.x;
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            float a = dq[c];
            for (long long t = 0; t < tile; ++t) a += sc[t] * LD(qkv, r.k0 + (j0 + t) * width + c);
            dq[c] = a;
        }
        __syncthreads();
    }
    for (int c = threadIdx.x; c < d; c += blockDim.x) ST(dqkv, r.q + c, dq[c]);
    __syncthreads();
}

// Backward, key side, one block per (sequence b, kv head g, key j): dK_j and dV_j summed over the
// group's query heads and the queries i >= j, a tile of blockDim queries at a time, written (not
// added) at k's and v's places in dqkv. No atomics: each block owns its rows.
extern "C" __global__ void flash_backward_dkv(const unsigned char* qkv, int qkv_dt, const unsigned char* dout, int dout_dt, const unsigned char* lse, int lse_dt,
                                              const unsigned char* dsum, int dsum_dt, unsigned char* dqkv, int dqkv_dt, long long s,
                                              long long width, int heads, int kv_heads, int d,
                                              float scale) {
    __shared__ float sp[256];
    __shared__ float sds[256];
    __shared__ float dk[MAX_HEAD_DIM];
    __shared__ float dv[MAX_HEAD_DIM];
    long long row = blockIdx.x;
    long long j = row % s, bg = row / s, b = bg / kv_heads;
    int g = (int)(bg % kv_heads), group = heads / kv_heads;
    long long hidden = (long long)heads * d;
    long long k = (b * s + j) * width + hidden + (long long)g * d;
    long long v = k + (long long)kv_heads * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) dk[c] = dv[c] = 0.0f;
    for (int n = g * group; n < (g + 1) * group; ++n) {
        long long base = (b * heads + n) * s;
        for (long long i0 = j; i0 < s; i0 += blockDim.x) {
            long long i = i0 + threadIdx.x;
            float p = 0.0f, ds = 0.0f;
            if (i < s) {
                long long q = (b * s + i) * width + (long long)n * d;
                long long gi = (b * s + i) * hidden + (long long)n * d;
                p = expf(dot(qkv, qkv_dt, q, qkv, qkv_dt, k, d) * scale - LD(lse, base + i));
                ds = p * (dot(dout, dout_dt, gi, qkv, qkv_dt, v, d) - LD(dsum, base + i)) * scale;
            }
            sp[threadIdx.x] = p;
            sds[threadIdx.x] = ds;
            __syncthreads();
            long long tile = s - i0 < (long long)blockDim.x ? s - i0 : blockDim.x;
            for (int c = threadIdx.x; c < d; c += blockDim.x) {
                float a = dk[c], bv = dv[c];
                for (long long t = 0; t < tile; ++t) {
                    long long tok = b * s + i0 + t;
                    a += sds[t] * LD(qkv, tok * width + (long long)n * d + c);
                    bv += sp[t] * LD(dout, tok * hidden + (long long)n * d + c);
                }
                dk[c] = a;
                dv[c] = bv;
            }
            __syncthreads();
        }
    }
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        ST(dqkv, k + c, dk[c]);
        ST(dqkv, v + c, dv[c]);
    }
    __syncthreads();
}

// ---- loss: math/mod.rs cross_entropy. One block per token row. ----

extern "C" __global__ void cross_entropy(const unsigned char* logits, int logits_dt, const int* targets, long long vocab,
                                         long long n, unsigned char* grad, int grad_dt, double* loss_sum) {
    __shared__ float sh[256];
    long long row = blockIdx.x, r0 = row * vocab;
    float m = NEG_INF;
    for (long long j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, LD(logits, r0 + j));
    m = block_max(m, sh);
    float acc = 0.0f;
    for (long long j = threadIdx.x; j < vocab; j += blockDim.x) acc += expf(LD(logits, r0 + j) - m);
    float lse = m + logf(block_sum(acc, sh));
    float inv = 1.0f / (float)n;
    int target = targets[row];
    for (long long j = threadIdx.x; j < vocab; j += blockDim.x) {
        float v = expf(LD(logits, r0 + j) - lse) * inv;
        ST(grad, r0 + j, j == target ? v - inv : v);
    }
    if (threadIdx.x == 0) atomicAdd(loss_sum, (double)(lse - LD(logits, r0 + target)));
}

// ---- optimizers: math/optim.rs and the CPU backend's Update ----

// The step's gradient scale, as the CPU backend computes it on the host.
__device__ float grad_scale(const unsigned char* sumsq, int sumsq_dt, double contributions,
                            double clip) {
    double factor = 1.0;
    if (sumsq && clip > 0.0) {
        double norm = sqrt((double)LD(sumsq, 0)) / contributions;
        factor = fmin(clip / (norm + 1e-6), 1.0);
    }
    return (float)(factor / contributions);
}

// state = [master | m | v] (3n); decay = pairs of flat-vector [start, end) ranges.
extern "C" __global__ void adam(unsigned char* state, int state_dt, const unsigned char* grad, int grad_dt, long long n, long long first,
                                const long long* decay, int decay_ranges, int decays,
                                const unsigned char* sumsq, int sumsq_dt, double contributions, double clip, float beta1,
                                float beta2, float eps, float step_size, float bc2_sqrt,
                                float shrink) {
    float scale = grad_scale(sumsq, sumsq_dt, contributions, clip);
    GRID_STRIDE(j, n) {
        long long at = first + j;
        int inside = 0;
        for (int k = 0; k < decay_ranges; ++k)
            if (at >= decay[2 * k] && at < decay[2 * k + 1]) inside = 1;
        float g = LD(grad, j) * scale;
        float m = beta1 * LD(state, n + j) + (1.0f - beta1) * g;
        float v = beta2 * LD(state, 2 * n + j) + (1.0f - beta2) * g * g;
        float master = LD(state, j);
        if (decays && inside) master *= shrink;
        float denom = sqrtf(v) / bc2_sqrt + eps;
        ST(state, n + j, m);
        ST(state, 2 * n + j, v);
        ST(state, j, master - step_size * m / denom);
    }
}

extern "C" __global__ void sgd(unsigned char* state, int state_dt, const unsigned char* grad, int grad_dt, long long n, const unsigned char* sumsq, int sumsq_dt,
                               double contributions, double clip, float lr) {
    float scale = grad_scale(sumsq, sumsq_dt, contributions, clip);
    GRID_STRIDE(j, n) ST(state, j, LD(state, j) - lr * (LD(grad, j) * scale));
}

// acc (one double) += sum of x[i]^2 in f64.
extern "C" __global__ void sum_squares(const unsigned char* x, int x_dt, long long n, double* acc) {
    __shared__ double sh[256];
    double s = 0.0;
    GRID_STRIDE(i, n) s += (double)LD(x, i) * (double)LD(x, i);
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if ((int)threadIdx.x < k) sh[threadIdx.x] += sh[threadIdx.x + k];
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(acc, sh[0]);
}

// dst (one value of its dtype) = (float) *acc.
extern "C" __global__ void store_double(const double* acc, unsigned char* dst, int dst_dt) {
    if (threadIdx.x == 0 && blockIdx.x == 0) ST(dst, 0, (float)*acc);
}
