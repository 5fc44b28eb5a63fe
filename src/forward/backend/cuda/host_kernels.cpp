// kernels.cu compiled for the host (tests only): each kernel gets a C entry point
// `sinkmerge_host_<name>(grid, block, params)` that takes its parameters as cuLaunchKernel does
// (an array of pointers to the argument values) and runs every thread of every block in turn.
#include <stddef.h>

#include <utility>

#include "host_shim.h"

thread_local sinkmerge_dim3 blockIdx, threadIdx, blockDim, gridDim;

#include "kernels.cu"

template <typename... A, size_t... I>
static void call(void (*f)(A...), void** params, std::index_sequence<I...>) {
    f(*static_cast<A*>(params[I])...);
}

template <typename... A>
static void run(void (*f)(A...), unsigned int grid, unsigned int block, void** params) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned int b = 0; b < grid; b++) {
        for (unsigned int t = 0; t < block; t++) {
            blockIdx = {b, 0, 0};
            threadIdx = {t, 0, 0};
            call(f, params, std::index_sequence_for<A...>{});
        }
    }
}

#define HOST_ENTRY(name)                                                                 \
    extern "C" void sinkmerge_host_##name(unsigned int grid, unsigned int block,         \
                                          void** params) {                               \
        run(name, grid, block, params);                                                  \
    }

HOST_ENTRY(round_values_bf16)
HOST_ENTRY(narrow_bf16)
HOST_ENTRY(widen_bf16)
HOST_ENTRY(widen_f16)
HOST_ENTRY(stored_gemv_partials)
HOST_ENTRY(stored_gemv_sum)
HOST_ENTRY(rms_norm_rows)
HOST_ENTRY(add_bias)
HOST_ENTRY(clamp_values)
HOST_ENTRY(rope)
HOST_ENTRY(attention)
HOST_ENTRY(cache_write)
HOST_ENTRY(attention_cached)
HOST_ENTRY(layer_norm_rows)
HOST_ENTRY(activate)
HOST_ENTRY(scale_columns)
HOST_ENTRY(act_mul)
HOST_ENTRY(add_assign)
HOST_ENTRY(flag_non_finite)
HOST_ENTRY(gather_rows)
HOST_ENTRY(scatter_add_rows)
