#!/usr/bin/env bash
# Reading every tensor of a checkpoint against `cat` of its files to /dev/null, side by side.
#
# sinkmerge reads with `inspect --check`, which validates every header and scans every byte of
# every tensor for NaN/Inf through the mmap. Both sides read from the page cache (the files are
# read once beforehand; dropping caches needs root on the host), so this compares the tool's
# overhead with the cheapest possible read. Median of RUNS runs each.
#
#   benches/read_vs_cat.sh [DIR]   (DIR defaults to a ~2.3 GB synthetic 7B-shaped checkpoint)
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/machine.sh
RUNS=${RUNS:-5}
DIR=${1:-${TMPDIR:-/tmp}/sinkmerge-bench-read}
cargo build -q --release --bin sinkmerge --example synth_checkpoint
if [ ! -d "$DIR" ]; then
  # 4 layers at Qwen2.5-7B widths, bf16, shards of 1 GB.
  target/release/examples/synth_checkpoint "$DIR" --layers 4 --hidden 3584 --intermediate 18944 \
    --heads 28 --kv-heads 4 --vocab 32000 --dtype bf16 --max-shard-size 1G >/dev/null
fi
BYTES=$(cat "$DIR"/*.safetensors | wc -c)
cat "$DIR"/*.safetensors >/dev/null

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
time_of() { local t0 t1; t0=$(date +%s.%N); "$@" >/dev/null; t1=$(date +%s.%N); echo "$t1 - $t0" | bc -l; }

cat_s=$(for _ in $(seq "$RUNS"); do time_of sh -c "cat '$DIR'/*.safetensors > /dev/null"; done | median)
sm_s=$(for _ in $(seq "$RUNS"); do time_of target/release/sinkmerge inspect --check --quiet "$DIR"; done | median)
sm1_s=$(for _ in $(seq "$RUNS"); do time_of target/release/sinkmerge --threads 1 inspect --check --quiet "$DIR"; done | median)

gbps() { echo "$BYTES / $1 / 1000000000" | bc -l; }
printf 'checkpoint: %s (%.2f GB)\n' "$DIR" "$(echo "$BYTES/1000000000" | bc -l)"
printf '%-40s %8.3f s  %6.2f GB/s\n' "cat to /dev/null" "$cat_s" "$(gbps "$cat_s")"
printf '%-40s %8.3f s  %6.2f GB/s  (%.2fx cat)\n' "sinkmerge inspect --check" "$sm_s" "$(gbps "$sm_s")" "$(echo "$cat_s / $sm_s" | bc -l)"
printf '%-40s %8.3f s  %6.2f GB/s  (%.2fx cat)\n' "sinkmerge --threads 1 inspect --check" "$sm1_s" "$(gbps "$sm1_s")" "$(echo "$cat_s / $sm1_s" | bc -l)"
