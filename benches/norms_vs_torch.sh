#!/usr/bin/env bash
# `sinkmerge norms` side by side with (a) a torch script computing the same table with
# torch.linalg.matrix_norm(ord=2 / 'fro') and (b) just reading both checkpoints: `cat` to
# /dev/null (one stream, and every shard at once) and sinkmerge's own read pass
# (`inspect --check`, which decodes every tensor).
#
#   benches/norms_vs_torch.sh [DIR]
#
# DIR (default $TMPDIR/sinkmerge-bench-norms-SPECTRUM-DTYPE) gets a synthetic 7B-shaped pair from
# benches/gen_norms_bench.py (LAYERS layers at hidden 3584 / intermediate 18944, ~0.47 GB per
# layer per model in bf16) unless it already holds one; it is deleted at the end unless KEEP=1.
# Environment: SPECTRUM (lowrank, or flat: the task vector with a flat tail, see the generator),
# DTYPE (bf16 or f32), LAYERS (4), RUNS (3, medians), TORCH_LAYERS (layers given to the torch peer,
# default LAYERS; a full SVD of each 18944 x 3584 matrix takes minutes, so on a shared machine use
# 1: sinkmerge then runs `--layers 0:TORCH_LAYERS` too, so both compute the same tensors),
# PYTHON (a Python with torch and safetensors; default python3), SKIP_TORCH=1 (leave the torch peer out).
# "cold" runs first evict the files from the page cache (posix_fadvise DONTNEED on these files
# only), so they read from disk; "warm" runs read from the page cache.
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/machine.sh
PY=${PYTHON:-python3}
SPECTRUM=${SPECTRUM:-lowrank}
DTYPE=${DTYPE:-bf16}
RUNS=${RUNS:-3}
LAYERS=${LAYERS:-4}
TORCH_LAYERS=${TORCH_LAYERS:-$LAYERS}
DIR=${1:-${TMPDIR:-/tmp}/sinkmerge-bench-norms-$SPECTRUM-$DTYPE}
SM=target/release/sinkmerge

cargo build -q --release --bin sinkmerge
if [ ! -f "$DIR/target/config.json" ]; then
  nice -n 10 "$PY" benches/gen_norms_bench.py "$DIR" --layers "$LAYERS" \
    --spectrum "$SPECTRUM" --dtype "$DTYPE" >/dev/null
fi
FILES=("$DIR"/ref/*.safetensors "$DIR"/target/*.safetensors)
BYTES=$(cat "${FILES[@]}" | wc -c)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"; [ "${KEEP:-0}" = 1 ] || rm -rf "$DIR"' EXIT

evict() {
  "$PY" -c 'import os, sys
for p in sys.argv[1:]:
    fd = os.open(p, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)' "${FILES[@]}"
}
warm() { cat "${FILES[@]}" >/dev/null; }
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
# measure NAME PREP CMD...: RUNS runs of CMD (after PREP), appending "wall cpu maxrss_kb" lines.
# The reports' stdout is kept for the agreement check; the checkpoint bytes `cat` prints are not.
measure() {
  local name=$1 prep=$2 sink
  shift 2
  case $name in cat_*) sink=/dev/null ;; *) sink=$OUT/$name.stdout ;; esac
  for _ in $(seq "$RUNS"); do
    $prep
    /usr/bin/time -f '%e %U %S %M' -o "$OUT/t" "$@" >"$sink"
    awk '{print $1, $2 + $3, $4}' "$OUT/t" >>"$OUT/$name"
  done
}
col() { awk -v c="$2" '{print $c}' "$OUT/$1" | median; }

echo "machine: $(nproc) cores; load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
measure cat_cold evict cat "${FILES[@]}"
measure cat_warm warm cat "${FILES[@]}"
# Every shard read by its own `cat` at once: a virtual disk can be much faster with many
# requests in flight than with cat's one sequential stream, so this is the stricter baseline.
measure cat_parallel_cold evict sh -c 'for f; do cat "$f" >/dev/null & done; wait' sh "${FILES[@]}"
measure read_pass warm sh -c "$SM inspect --check --quiet '$DIR/ref' && $SM inspect --check --quiet '$DIR/target'"
measure norms_cold evict "$SM" norms --quiet "$DIR/ref" "$DIR/target"
measure norms_warm warm "$SM" norms --quiet "$DIR/ref" "$DIR/target"
measure norms_subset warm "$SM" norms --quiet --json --layers "0:$TORCH_LAYERS" "$DIR/ref" "$DIR/target"
NAMES=(cat_cold cat_parallel_cold cat_warm read_pass norms_cold norms_warm norms_subset)
if [ "${SKIP_TORCH:-0}" != 1 ]; then
  RUNS=1 measure torch_subset warm "$PY" benches/norms_torch.py "$DIR/ref" "$DIR/target" \
    --threads "$(nproc)" --layers "$TORCH_LAYERS"
  NAMES+=(torch_subset)
fi
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

# Same numbers? Largest relative difference of op between sinkmerge and torch.
[ "${SKIP_TORCH:-0}" = 1 ] || "$PY" - "$OUT/norms_subset.stdout" "$OUT/torch_subset.stdout" <<'EOF'
import json, re, sys
ours = {r["tensor"]: r for r in json.load(open(sys.argv[1]))["rows"]}
worst = 0.0
for line in open(sys.argv[2]):
    name, *fields = line.split()
    kv = dict(f.split("=") for f in fields)
    if "op" in kv:
        worst = max(worst, abs(ours[name]["op"] - float(kv["op"])) / float(kv["op"]))
print(f"op agreement with torch on the subset: max relative difference {worst:.1e}")
EOF

gb=$(echo "$BYTES / 1000000000" | bc -l)
printf '\n%s: %d layers, %s spectrum, %s, %.2f GB in both checkpoints; medians of %d runs (torch: 1 run)\n' \
  "$DIR" "$LAYERS" "$SPECTRUM" "$DTYPE" "$gb" "$RUNS"
printf '%-46s %9s %9s %11s\n' "" "wall s" "cpu s" "peak RSS MB"
for name in "${NAMES[@]}"; do
  printf '%-46s %9.2f %9.2f %11.0f\n' "$name" "$(col "$name" 1)" "$(col "$name" 2)" "$(echo "$(col "$name" 3) / 1024" | bc -l)"
done
ratio() { echo "$(col "$1" 1) / $(col "$2" 1)" | bc -l; }
printf '\nnorms cold / cat cold            %6.2fx\n' "$(ratio norms_cold cat_cold)"
printf 'norms cold / parallel cat cold   %6.2fx\n' "$(ratio norms_cold cat_parallel_cold)"
printf 'norms warm / cat warm            %6.2fx\n' "$(ratio norms_warm cat_warm)"
printf 'norms warm / sinkmerge read pass %6.2fx\n' "$(ratio norms_warm read_pass)"
[ "${SKIP_TORCH:-0}" = 1 ] ||
  printf 'torch / sinkmerge, layers 0:%s    %6.1fx\n' "$TORCH_LAYERS" "$(ratio torch_subset norms_subset)"
