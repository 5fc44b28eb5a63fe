// The CUDA backend's kernels (docs/reference/gpu.md). Compiled at run time by NVRTC for the GPU,
// and, for the tests, by the host C++ compiler through host_shim.h, which runs every thread of
// every block as a loop. So each kernel is one independent thread per output: no shared memory,
// no block synchronisation, no warp shuffles. Each thread computes its outputs in the same order
// and with the same f32 operations as the CPU backend (src/sink/backend/cpu.rs); NVRTC is run
// with fmad off, so no multiply-add is contracted where the CPU does not contract it.
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
// w * (x * (1 / sqrt(mean + eps))), as transformers' f32 path and the CPU backend.
KERNEL void rms_norm_rows(float* y, const float* x, const float* w, long long rows,
                                         int width, float eps) {
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
    for (int j = 0; j < width; j++) out[j] = w[j] * (row[j] * inv);
}

KERNEL void add_bias(float* y, const float* b, long long n, int width) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    y[i] += b[i % width];
}

// Clamp to [-c, c]; NaN stays NaN, as Rust's f32::clamp.
KERNEL void clamp_values(float* x, long long n, float c) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    float v = x[i];
    x[i] = v < -c ? -c : (v > c ? c : v);
}

// Rotate-half RoPE. `cos`/`sin` hold `half` values per row (the host's tables, so the angles are
// the CPU's). One thread per (row, head, i < half).
KERNEL void rope(float* x, const float* cos_t, const float* sin_t, long long rows,
                                int width, int head_dim) {
    long long t = SINKMERGE_INDEX;
    int half = head_dim / 2;
    int heads = width / head_dim;
    if (t >= rows * heads * half) return;
    int i = (int)(t % half);
    long long rh = t / half;
    int head = (int)(rh % heads);
    long long r = rh / heads;
    float* lo = x + r * width + (long long)head * head_dim;
    float c = cos_t[r * half + i];
    float s = sin_t[r * half + i];
    float a = lo[i];
    float b = lo[i + half];
    lo[i] = a * c - b * s;
    lo[i + half] = b * c + a * s;
}

// Exact eager attention, one thread per (row, head) of a group of whole prompts.
// q is [tokens, heads * head_dim], k and v [tokens, kv_heads * head_dim], packed over prompts.
// For the group's prompt p: its rows start at prompt_start[p] (global rows), it has
// prompt_len[p] tokens, and its [heads, len, len] scores and probabilities start at
// prompt_offset[p] in `scores` and `probs`. row_prompt[r] is the prompt of the group's row r
// (global row row_begin + r). Scores are q kᵀ · scale over every key (as the CPU's GEMM); the
// softmax covers the keys the query sees (causal, and `window` keys when window > 0), and the
// probabilities of the others are exactly 0. With has_v, ctx[row, head] = P v.
KERNEL void attention(float* scores, float* probs, float* ctx, const float* q,
                                     const float* k, const float* v, const int* row_prompt,
                                     const long long* prompt_start, const long long* prompt_len,
                                     const long long* prompt_offset, long long row_begin,
                                     long long rows, int heads, int kv_heads, int head_dim,
                                     int window, float scale, int has_v) {
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
        srow[key] = dot * scale;
    }
    long long lo = 0;
    if (window > 0 && qi + 1 > window) lo = qi + 1 - window;
    float max = __int_as_float(0xff800000);  // -inf (NVRTC has no INFINITY)
    for (long long key = lo; key <= qi; key++) max = srow[key] > max ? srow[key] : max;
    float sum = 0.0f;
    for (long long key = 0; key < len; key++) {
        float e = 0.0f;
        if (key >= lo && key <= qi) {
            e = expf(srow[key] - max);
            sum += e;
        }
        prow[key] = e;
    }
    for (long long key = lo; key <= qi; key++) prow[key] = prow[key] / sum;
    if (!has_v) return;
    float* crow = ctx + row * qd + (long long)h * head_dim;
    for (int d = 0; d < head_dim; d++) {
        float acc = 0.0f;
        for (long long key = lo; key <= qi; key++)
            acc += prow[key] * v[(start + key) * kd + (long long)g * head_dim + d];
        crow[d] = acc;
    }
}

// gate = silu(gate) * up, silu(x) = x / (1 + exp(-x)).
KERNEL void silu_mul(float* gate, const float* up, long long n) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    float x = gate[i];
    gate[i] = (x / (1.0f + expf(-x))) * up[i];
}

KERNEL void add_assign(float* a, const float* b, long long n) {
    long long i = SINKMERGE_INDEX;
    if (i >= n) return;
    a[i] += b[i];
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
// tokens routed twice never race and sums follow the CPU's order.
KERNEL void scatter_add_rows(float* out, const float* y, const int* index,
                                            const float* weight, long long rows, int width) {
    long long j = SINKMERGE_INDEX;
    if (j >= width) return;
    for (long long i = 0; i < rows; i++)
        out[(long long)index[i] * width + j] += y[i * width + j] * weight[i];
}
