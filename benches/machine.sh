# Sourced at the start of every benchmark: the machine it ran on (CPU model, cores, memory), the
# SIMD extensions sinkmerge's kernels choose between at run time, and the load average, so that
# every figure carries what it was measured with.
machine_simd=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' |
  grep -xE 'sse4_2|avx|avx2|fma|f16c|avx512f|avx512bw|avx512vl|avx512_bf16|amx_bf16|amx_tile' |
  tr '\n' ' ' || true)
echo "machine: $(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//');" \
  "$(nproc) cores; $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo) memory;" \
  "SIMD: ${machine_simd:-unknown}; load average $(cut -d' ' -f1-3 /proc/loadavg)"
