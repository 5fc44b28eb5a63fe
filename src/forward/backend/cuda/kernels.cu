// The CUDA backend's kernels (docs/reference/gpu.md). Compiled at run time by NVRTC for the GPU,
// and, for the tests, by the host C++ compiler through host_shim.h, which runs every thread of
// every block as a loop. So each kernel is one independent thread per output: no shared memory,
// no block synchronisation, no warp shuffles. Each thread applies the same f32 operations as the
// CPU backend (src/forward/backend/cpu.rs); NVRTC is run with fmad off, so no multiply-add is
// contracted where the CPU does not contract it. Sums run in another order than the CPU's GEMMs,
// and the device's expf may differ from the host's by up to 2 ulp, so results agree within the
// parity tolerances, not bitwise.
//
// Every kernel takes its thread count `n` and returns for threads past it: launches use
// ceil(n / block) blocks.

#ifndef SINKMERGE_HOST
#define KERNEL extern "C" __global__
#define SINKMERGE_INDEX ((long long)blockIdx.x * blockDim.x + threadIdx.x)
#endif

__device__ static inline bool finite_bits(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

// f32 -> bf16 -> f32, round to nearest even; NaN stays NaN (quiet), as torch and the `half` crate.
__device__ static inline float round_bf16(float v) {
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __uint_as_float(((u >> 16) | 0x40u) << 16);
    unsigned int lsb = (u >> 16) & 1u;
    return __uint_as_float((u + 0x7fffu + lsb) & 0xffff0000u);
}

// With `bf16`, a result as transformers' bf16 path stores it.
__device__ static inline float store(float v, int bf16) { return bf16 ? round_bf16(v) : v; }

KERNEL void round_values_bf16(float* x, long long n) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    x[i] = round_bf16(x[i]);
}

// The bf16 operand of a tensor-core GEMM (cublasGemmEx with CUDA_R_16BF): each value rounded to
// bf16 and stored as its 16 bits. Exact for the values bf16 mode holds, which are bf16 already.
KERNEL void narrow_bf16(unsigned short* out, const float* in, long long n) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    out[i] = (unsigned short)(__float_as_uint(round_bf16(in[i])) >> 16);
}

// bf16 -> f32 is exact: the bf16 bits are the high half of the f32's.
__device__ static inline float bf16_value(unsigned short h) {
    return __uint_as_float((unsigned int)h << 16);
}

// f16 -> f32, exact (IEEE binary16: 1 sign, 5 exponent, 10 mantissa bits).
__device__ static inline float f16_value(unsigned short h16) {
    unsigned int h = h16;
    unsigned int sign = (h & 0x8000u) << 16;
    unsigned int exp = (h >> 10) & 0x1fu;
    unsigned int man = h & 0x3ffu;
    unsigned int bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        // Subnormal: normalise the mantissa.
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while ((man & 0x400u) == 0);
        bits = sign | ((unsigned int)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    return __uint_as_float(bits);
}

KERNEL void widen_bf16(float* out, const unsigned short* in, long long n) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    out[i] = bf16_value(in[i]);
}

KERNEL void widen_f16(float* out, const unsigned short* in, long long n) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    out[i] = f16_value(in[i]);
}

// Element i of a weight held as stored, of `kind` 0 f32, 1 bf16, 2 f16 (`stored_kind` in
// mod.rs), as f32: exact.
__device__ static inline float stored_value(const void* w, long long i, int kind) {
    if (kind == 1) return bf16_value(((const unsigned short*)w)[i]);
    if (kind == 2) return f16_value(((const unsigned short*)w)[i]);
    return ((const float*)w)[i];
}

// Threads that share one output of the stored GEMV: a warp on the GPU.
#define GEMV_LANES 32

// y = x Wᵀ for a few rows of x (a decode step's) on a weight held as stored, in two launches.
// This one runs thread (o, r, lane), lane fastest: partial[(r * out + o) * GEMV_LANES + lane] is
// the sum, in increasing k, of x[r, k] * w[o, k] over k = lane, lane + GEMV_LANES, ... So a warp
// reads GEMV_LANES consecutive weights at a time (coalesced), and the threads of the other rows
// of x, its neighbours, read the same weight row again from the cache: the weight comes from
// memory once, in its stored bytes. With bf16, both operands rounded to bf16 first, as the
// bf16 GEMM's (`narrow_bf16`, and `load`'s rounding of f32 and f16 weights): the products are
// exact in f32.
KERNEL void stored_gemv_partials(float* partial, const float* x, const void* w, long long rows,
                                 long long out, int in, int kind, int bf16) {
    long long t = SINKMERGE_INDEX;
    if (t >= out * rows * GEMV_LANES) return;
    int lane = (int)(t % GEMV_LANES);
    long long r = (t / GEMV_LANES) % rows;
    long long o = t / GEMV_LANES / rows;
    const float* xr = x + r * in;
    long long wo = o * in;
    float acc = 0.0f;
    for (int k = lane; k < in; k += GEMV_LANES)
        acc += store(xr[k], bf16) * store(stored_value(w, wo + k, kind), bf16);
    partial[(r * out + o) * GEMV_LANES + lane] = acc;
}

// The second launch, thread i = r * out + o: y[i] is its GEMV_LANES partials summed in lane
// order. The order of every sum is fixed, so results are deterministic.
KERNEL void stored_gemv_sum(float* y, const float* partial, long long n) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    const float* p = partial + i * GEMV_LANES;
    float acc = 0.0f;
    for (int lane = 0; lane < GEMV_LANES; lane++) acc += p[lane];
    y[i] = acc;
}

// RMSNorm of each row: the mean of squares in f64, rounded once to f32, then
// w * (x * (1 / sqrt(mean + eps))), as transformers' f32 path and the CPU backend. bf16 mode 1
// (Llama style) rounds the normalized value before the weight multiplies it and the product
// after; mode 2 (OLMo style) rounds the product only.
KERNEL void rms_norm_rows(float* y, const float* x, const float* w, long long rows,
                                         int width, float eps, int bf16) {
    long long r = SINKMERGE_INDEX;
    if (r >= rows) return;
    const float* row = x + r * width;
    double sum = 0.0;
    for (int j = 0; j < width; j++) {
        double v = (double)row[j];
        sum += v * v;
    }
    float mean = (float)(sum / (double)width);
    float inv = 1.0f / sqrtf(mean + eps);
    float* out = y + r * width;
    for (int j = 0; j < width; j++) out[j] = store(w[j] * store(row[j] * inv, bf16 == 1), bf16);
}

KERNEL void add_bias(float* y, const float* b, long long n, int width) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    y[i] += b[i % width];
}

// Clamp to [-c, c]; NaN stays NaN, as Rust's f32::clamp.
KERNEL void clamp_values(float* x, long long n, float c, int bf16) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    float v = x[i];
    x[i] = store(v < -c ? -c : (v > c ? c : v), bf16);
}

// Rotate-half RoPE. `cos`/`sin` hold `half` values per row (the host's tables, so the angles are
// the CPU's). One thread per (row, head, i < half). bf16 mode 1 (Llama style) computes
// `q * cos + rotate_half(q) * sin` in bf16: cos and sin rounded, each product and sum rounded;
// mode 2 (OLMo style) computes it in f32 and rounds the result.
KERNEL void rope(float* x, const float* cos_t, const float* sin_t, long long rows,
                                int width, int head_dim, int bf16) {
    long long t = SINKMERGE_INDEX;
    int half = head_dim / 2;
    int heads = width / head_dim;
    if (t >= rows * heads * half) return;
    int i = (int)(t % half);
    long long rh = t / half;
    int head = (int)(rh % heads);
    long long r = rh / heads;
    float* lo = x + r * width + (long long)head * head_dim;
    int each = bf16 == 1;
    float c = store(cos_t[r * half + i], each);
    float s = store(sin_t[r * half + i], each);
    float a = lo[i];
    float b = lo[i + half];
    lo[i] = store(store(a * c, each) - store(b * s, each), bf16);
    lo[i + half] = store(store(b * c, each) + store(a * s, each), bf16);
}

// The first key position `pos` sees: every earlier one, or with window > 0 the last `window`
// (itself included); `first_key` in src/forward/backend/mod.rs.
__device__ static inline long long first_key(long long pos, int window) {
    return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

// Exact eager attention of one query of one head. Key j (of `keys`) is at k + j * stride, its
// value at v + j * stride. Scores are q kᵀ · scale over every key (as the CPU's GEMM); the
// softmax covers keys lo..hi (the ones the query sees), with the max subtracted, and the
// probabilities of the others are exactly 0. With crow (not null), crow = P v. With bf16, as
// torch's bf16 eager attention: q kᵀ rounded, times the scale rounded, softmax in f32 rounded,
// P v rounded.
__device__ static inline void attend_query(float* srow, float* prow, float* crow, const float* qrow,
                                           const float* k, const float* v, long long stride,
                                           long long keys, long long lo, long long hi,
                                           int head_dim, float scale, int bf16) {
    for (long long key = 0; key < keys; key++) {
        const float* krow = k + key * stride;
        float dot = 0.0f;
        for (int d = 0; d < head_dim; d++) dot += qrow[d] * krow[d];
        srow[key] = bf16 ? round_bf16(round_bf16(dot) * scale) : dot * scale;
    }
    float max = __int_as_float(0xff800000);  // -inf (NVRTC has no INFINITY)
    for (long long key = lo; key <= hi; key++) max = srow[key] > max ? srow[key] : max;
    float sum = 0.0f;
    for (long long key = 0; key < keys; key++) {
        float e = 0.0f;
        if (key >= lo && key <= hi) {
            e = expf(srow[key] - max);
            sum += e;
        }
        prow[key] = e;
    }
    for (long long key = lo; key <= hi; key++) prow[key] = store(prow[key] / sum, bf16);
    if (!crow) return;
    for (int d = 0; d < head_dim; d++) {
        float acc = 0.0f;
        for (long long key = lo; key <= hi; key++) acc += prow[key] * v[key * stride + d];
        crow[d] = store(acc, bf16);
    }
}

// Attention of a group of whole prompts, one thread per (row, head) through `attend_query`.
// q is [tokens, heads * head_dim], k and v [tokens, kv_heads * head_dim], packed over prompts.
// For the group's prompt p: its rows start at prompt_start[p] (global rows), it has
// prompt_len[p] tokens, and its [heads, len, len] scores and probabilities start at
// prompt_offset[p] in `scores` and `probs`. row_prompt[r] is the prompt of the group's row r
// (global row row_begin + r). The softmax is causal, within `window` keys when window > 0; with
// causal 0 (vision towers) every key of the prompt is seen. With has_v, ctx[row, head] = P v.
KERNEL void attention(float* scores, float* probs, float* ctx, const float* q,
                                     const float* k, const float* v, const int* row_prompt,
                                     const long long* prompt_start, const long long* prompt_len,
                                     const long long* prompt_offset, long long row_begin,
                                     long long rows, int heads, int kv_heads, int head_dim,
                                     int causal, int window, float scale, int has_v,
                                     int bf16) {
    long long t = SINKMERGE_INDEX;
    if (t >= rows * heads) return;
    int h = (int)(t % heads);
    long long local = t / heads;
    long long row = row_begin + local;
    int p = row_prompt[local];
    long long start = prompt_start[p];
    long long len = prompt_len[p];
    long long qi = row - start;
    int g = h / (heads / kv_heads);
    long long qd = (long long)heads * head_dim;
    long long kd = (long long)kv_heads * head_dim;
    long long head = (long long)h * head_dim;
    long long kv_head = start * kd + (long long)g * head_dim;
    long long base = prompt_offset[p] + ((long long)h * len + qi) * len;
    attend_query(scores + base, probs + base, has_v ? ctx + row * qd + head : 0,
                 q + row * qd + head, k + kv_head, has_v ? v + kv_head : 0, kd, len,
                 causal ? first_key(qi, window) : 0, causal ? qi : len - 1, head_dim, scale,
                 bf16);
}

// A KV cache's write: `fresh` is [rows, kv_heads * head_dim] (token-major, as the projections
// make it), the cache [kv_heads, capacity, head_dim] (transformers' DynamicCache layout); row t
// goes to position at + t. One thread per value: consecutive threads copy consecutive values.
KERNEL void cache_write(float* cache, const float* fresh, long long rows, int kv_heads,
                        int head_dim, long long capacity, long long at) {
    long long i = SINKMERGE_INDEX;
    long long width = (long long)kv_heads * head_dim;
    if (i >= rows * width) return;
    long long t = i / width;
    long long g = (i % width) / head_dim;
    long long d = i % head_dim;
    cache[(g * capacity + at + t) * head_dim + d] = fresh[i];
}

// Attention of `queries` new rows, at positions offset..offset + queries, over a KV cache
// (`cache_write`'s layout, positions 0..offset + queries filled), one thread per (query, head)
// through `attend_query`: causal by position, within `window` keys when window > 0. q and ctx
// are [queries, heads * head_dim]. A launch covers heads first_head..first_head + group_heads (a
// group whose scores fit the backend's budget, docs/reference/gpu.md): scores and probs are
// [group_heads, queries, offset + queries], the group's heads only; ctx gets their columns.
KERNEL void attention_cached(float* scores, float* probs, float* ctx, const float* q,
                             const float* keys_cache, const float* values_cache,
                             long long queries, long long offset, long long capacity, int heads,
                             int first_head, int group_heads, int kv_heads, int head_dim,
                             int window, float scale, int bf16) {
    long long t = SINKMERGE_INDEX;
    if (t >= queries * group_heads) return;
    int local = (int)(t % group_heads);
    int h = first_head + local;
    long long qi = t / group_heads;
    long long keys = offset + queries;
    long long pos = offset + qi;
    long long g = h / (heads / kv_heads);
    long long at = qi * heads * head_dim + (long long)h * head_dim;
    long long kv_head = g * capacity * head_dim;
    long long base = ((long long)local * queries + qi) * keys;
    attend_query(scores + base, probs + base, ctx + at, q + at, keys_cache + kv_head,
                 values_cache + kv_head, head_dim, keys, first_key(pos, window), pos, head_dim,
                 scale, bf16);
}

// LayerNorm of each row: mean and biased variance in f64, then
// (x - mean) * (1 / sqrt(var + eps)) * w + b in f32, as the CPU backend.
KERNEL void layer_norm_rows(float* y, const float* x, const float* w, const float* b,
                            long long rows, int width, float eps, int bf16) {
    long long r = SINKMERGE_INDEX;
    if (r >= rows) return;
    const float* row = x + r * width;
    double sum = 0.0;
    for (int j = 0; j < width; j++) sum += (double)row[j];
    double mean = sum / (double)width;
    double ss = 0.0;
    for (int j = 0; j < width; j++) {
        double d = (double)row[j] - mean;
        ss += d * d;
    }
    float m = (float)mean;
    float inv = 1.0f / sqrtf((float)(ss / (double)width) + eps);
    float* out = y + r * width;
    for (int j = 0; j < width; j++) out[j] = store((row[j] - m) * inv * w[j] + b[j], bf16);
}

// The activations of `Activation` (src/forward/backend/mod.rs), by kind: 0 gelu (erf), 1 gelu
// with tanh, 2 quick_gelu, 3 silu, 4 gelu_python, 5 gelu_10, 6 gelu_fast, 7 relu, 8 relu2,
// 9 relu6, 10 leaky_relu, 11 linear, 12 sigmoid, 13 tanh, 14 mish, 15 laplace. Comparisons let NaN
// through, as torch's do.
__device__ static inline float gelu_erf(float v) {
    return v * 0.5f * (1.0f + erff(v * 0.70710678118654752f));
}
__device__ static inline float relu(float v) { return v < 0.0f ? 0.0f : v; }
__device__ static inline float activation(float v, int kind) {
    switch (kind) {
    case 0: return gelu_erf(v);
    case 1: {
        float beta = 1.41421356237309505f * 1.12837916709551257f * 0.5f;
        float inner = beta * (v + 0.044715f * v * v * v);
        return 0.5f * v * (1.0f + tanhf(inner));
    }
    case 2: return v * (1.0f / (1.0f + expf(-1.702f * v)));
    case 4: return v * 0.5f * (1.0f + erff(v / 1.41421356237309505f));
    case 5: {
        float g = gelu_erf(v);
        return g < -10.0f ? -10.0f : (g > 10.0f ? 10.0f : g);
    }
    case 6: return 0.5f * v * (1.0f + tanhf(v * 0.7978846f * (1.0f + 0.044715f * v * v)));
    case 7: return relu(v);
    case 8: return relu(v) * relu(v);
    case 9: return v > 6.0f ? 6.0f : relu(v);
    case 10: return v > 0.0f ? v : v * 0.01f;
    case 11: return v;
    case 12: return 1.0f / (1.0f + expf(-v));
    case 13: return tanhf(v);
    case 14: return v * tanhf(log1pf(expf(v)));
    case 15: return 0.5f * (1.0f + erff((v - 0.707107f) / 0.3989426f));
    default: return v / (1.0f + expf(-v));  // 3: silu
    }
}

KERNEL void activate(float* x, long long n, int kind, int bf16) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    x[i] = store(activation(x[i], kind), bf16);
}

// x[r, j] *= w[j] (InternViT's layer scale).
KERNEL void scale_columns(float* x, const float* w, long long n, int width, int bf16) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    x[i] = store(x[i] * w[i % width], bf16);
}

// gate = act(gate) * up, the activation of `kind` as in `activate`; with bf16 each result
// rounded.
KERNEL void act_mul(float* gate, const float* up, long long n, int kind, int bf16) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    gate[i] = store(store(activation(gate[i], kind), bf16) * up[i], bf16);
}

KERNEL void add_assign(float* a, const float* b, long long n, int bf16) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    a[i] = store(a[i] + b[i], bf16);
}

// flag[0] = 1 if any value is NaN or Inf (every writer writes the same value).
KERNEL void flag_non_finite(int* flag, const float* x, long long n) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    if (!finite_bits(x[i])) flag[0] = 1;
}

// out[i, :] = x[index[i], :]
KERNEL void gather_rows(float* out, const float* x, const int* index, long long rows,
                                       int width) {
    long long t = SINKMERGE_INDEX;
    if (t >= rows * width) return;
    long long i = t / width;
    int j = (int)(t % width);
    out[t] = x[(long long)index[i] * width + j];
}

// out[index[i], j] += y[i, j] * weight[i] for i = 0, 1, ... in order: one thread per column j, so
// tokens routed twice never race and sums follow the CPU's order. With bf16, as torch's
// `index_add_` of `expert(x) * weight.to(bf16)` into a bf16 buffer.
KERNEL void scatter_add_rows(float* out, const float* y, const int* index,
                                            const float* weight, long long rows, int width,
                                            int bf16) {
    long long j = SINKMERGE_INDEX;
    if (j >= width) return;
    for (long long i = 0; i < rows; i++) {
        float* o = out + (long long)index[i] * width + j;
        if (bf16)
            *o = round_bf16(*o + round_bf16(y[i * width + j] * round_bf16(weight[i])));
        else
            *o += y[i * width + j] * weight[i];
    }
}
