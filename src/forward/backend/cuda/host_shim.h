// Host shim for kernels.cu (tests only): the CUDA built-ins it uses, on the CPU. A launch runs
// every thread of every block in turn (host_kernels.cpp), which is exact for kernels whose
// threads are independent, as kernels.cu's are.
#pragma once
#include <math.h>
#include <string.h>

#define SINKMERGE_HOST 1

struct sinkmerge_dim3 {
    unsigned int x, y, z;
};
extern thread_local sinkmerge_dim3 blockIdx, threadIdx, blockDim, gridDim;

#define __global__
#define __device__
#define KERNEL static
#define SINKMERGE_INDEX ((long long)blockIdx.x * blockDim.x + threadIdx.x)

static inline float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}
static inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, sizeof u);
    return u;
}
