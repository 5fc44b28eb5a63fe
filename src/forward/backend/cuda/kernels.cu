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
KERNEL void widen_bf16(float* out, const unsigned short* in, long long n) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    out[i] = __uint_as_float((unsigned int)in[i] << 16);
}

// f16 -> f32, exact (IEEE binary16: 1 sign, 5 exponent, 10 mantissa bits).
KERNEL void widen_f16(float* out, const unsigned short* in, long long n) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    unsigned int h = in[i];
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
    out[i] = __uint_as_float(bits);
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

// Exact eager attention, one thread per (row, head) of a group of whole prompts.
// q is [tokens, heads * head_dim], k and v [tokens, kv_heads * head_dim], packed over prompts.
// For the group's prompt p: its rows start at prompt_start[p] (global rows), it has
// prompt_len[p] tokens, and its [heads, len, len] scores and probabilities start at
// prompt_offset[p] in `scores` and `probs`. row_prompt[r] is the prompt of the group's row r
// (global row row_begin + r). Scores are q kᵀ · scale over every key (as the CPU's GEMM); the
// softmax covers the keys the query sees (causal, and `window` keys when window > 0), and the
// probabilities of the others are exactly 0; with causal 0 (vision towers) every key of the
// prompt is seen. With has_v, ctx[row, head] = P v. With bf16, as
// torch's bf16 eager attention: q kᵀ rounded, times the scale rounded, softmax in f32 rounded,
// P v rounded.
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
    const float* qrow = q + row * qd + (long long)h * head_dim;
    long long base = prompt_offset[p] + ((long long)h * len + qi) * len;
    float* srow = scores + base;
    float* prow = probs + base;
    for (long long key = 0; key < len; key++) {
        const float* krow = k + (start + key) * kd + (long long)g * head_dim;
        float dot = 0.0f;
        for (int d = 0; d < head_dim; d++) dot += qrow[d] * krow[d];
        srow[key] = bf16 ? round_bf16(round_bf16(dot) * scale) : dot * scale;
    }
    long long lo = 0;
    long long hi = causal ? qi : len - 1;
    if (causal && window > 0 && qi + 1 > window) lo = qi + 1 - window;
    float max = __int_as_float(0xff800000);  // -inf (NVRTC has no INFINITY)
    for (long long key = lo; key <= hi; key++) max = srow[key] > max ? srow[key] : max;
    float sum = 0.0f;
    for (long long key = 0; key < len; key++) {
        float e = 0.0f;
        if (key >= lo && key <= hi) {
            e = expf(srow[key] - max);
            sum += e;
        }
        prow[key] = e;
    }
    for (long long key = lo; key <= hi; key++) prow[key] = store(prow[key] / sum, bf16);
    if (!has_v) return;
    float* crow = ctx + row * qd + (long long)h * head_dim;
    for (int d = 0; d < head_dim; d++) {
        float acc = 0.0f;
        for (long long key = lo; key <= hi; key++)
            acc += prow[key] * v[(start + key) * kd + (long long)g * head_dim + d];
        crow[d] = store(acc, bf16);
    }
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
