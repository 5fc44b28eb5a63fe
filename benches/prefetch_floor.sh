#!/usr/bin/env bash
# `score` from a cold page cache against its two floors, in one run (issue 28, item 1):
#   (a) disk:    `cat` of the shards to /dev/null from a cold page cache;
#   (b) compute: `score` with every shard already in the page cache (read once beforehand);
#   (c) cold:    `score` from a cold page cache, reading ahead (the default);
#   (d) cold, --max-memory 1: the same without reading ahead (each weight read when asked for).
# Target: (c) within 1.15x of max(a, b).
#
# The page cache is emptied of the shards before each cold run with posix_fadvise(DONTNEED) on
# each file (`dd iflag=nocache count=0`), which needs no root; as root, /proc/sys/vm/drop_caches
# is written too. `fincore` (util-linux), when present, prints how much of the shards is still
# cached, so a run that was not cold shows it. Median of RUNS runs each.
#
#   benches/prefetch_floor.sh [DIR]   (DIR: a checkpoint to score; by default a synthetic one at
#                                      Qwen2.5-7B widths with LAYERS layers, ~0.47 GB bf16 a
#                                      layer plus the embedding and LM head)
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/timing.sh
RUNS=${RUNS:-3}
LAYERS=${LAYERS:-4}
VOCAB=${VOCAB:-152064}
DIR=${1:-${TMPDIR:-/tmp}/sinkmerge-bench-prefetch-L$LAYERS-V$VOCAB}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cargo build -q --release --bin sinkmerge --example synth_checkpoint
if [ ! -d "$DIR" ]; then
  # Qwen2.5-7B widths, bf16, 1 GB shards, the fixtures' tokenizer (so `score` runs its prompts).
  target/release/examples/synth_checkpoint "$DIR" --layers "$LAYERS" --hidden 3584 \
    --intermediate 18944 --heads 28 --kv-heads 4 --vocab "$VOCAB" --dtype bf16 \
    --max-shard-size 1G >/dev/null
  cp tests/fixtures/models/qwen2/tokenizer*.json "$DIR"/
fi
SHARDS=("$DIR"/*.safetensors)
BYTES=$(cat "${SHARDS[@]}" | wc -c)
SCORE=(target/release/sinkmerge score "$DIR" --json)

echo "cpu: $(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo), $(nproc) cores"
echo "simd: $(grep -m1 -o -w -E 'sse4_2|avx|avx2|fma|f16c|avx512f|avx512bw|avx512_bf16|amx_bf16|amx_tile' \
  /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
printf 'checkpoint: %s (%.2f GB in %d shards)\n' "$DIR" "$(echo "$BYTES/1000000000" | bc -l)" \
  "${#SHARDS[@]}"

cold() {
  sync
  for f in "${SHARDS[@]}"; do dd if="$f" iflag=nocache count=0 status=none; done
  if [ -w /proc/sys/vm/drop_caches ]; then echo 1 >/proc/sys/vm/drop_caches || true; fi
  if command -v fincore >/dev/null; then
    fincore -b -n -o RES "${SHARDS[@]}" | awk '{s+=$1} END {printf "  (cached before the run: %d bytes)\n", s}' >&2
  fi
}
warm() { cat "${SHARDS[@]}" >/dev/null; }

for _ in $(seq "$RUNS"); do
  cold; measure disk sh -c "cat ${SHARDS[*]} > /dev/null"
  warm; measure compute "${SCORE[@]}"
  cold; measure cold "${SCORE[@]}"
  cold; measure cold-no-read-ahead "${SCORE[@]}" --max-memory 1
done
# The outputs are the same with and without reading ahead.
warm
cmp <("${SCORE[@]}") <("${SCORE[@]}" --max-memory 1) && echo "outputs: identical with and without reading ahead"

read -r disk _ _ < <(summary disk)
read -r compute compute_cpu _ < <(summary compute)
read -r cold_s cold_cpu cold_rss < <(summary cold)
read -r plain _ plain_rss < <(summary cold-no-read-ahead)
floor=$(echo "if ($disk > $compute) $disk else $compute" | bc -l)
printf '\n%-34s %9s %9s %10s\n' "run (median of $RUNS)" "wall s" "cpu s" "peak RSS"
printf '%-34s %9.2f %9s %10s  (%.2f GB/s)\n' "(a) cat, cold" "$disk" "" "" \
  "$(echo "$BYTES / $disk / 1000000000" | bc -l)"
printf '%-34s %9.2f %9.2f %10s\n' "(b) score, warm (compute floor)" "$compute" "$compute_cpu" ""
printf '%-34s %9.2f %9.2f %8d kB\n' "(c) score, cold, reading ahead" "$cold_s" "$cold_cpu" "$cold_rss"
printf '%-34s %9.2f %9s %8d kB\n' "(d) score, cold, --max-memory 1" "$plain" "" "$plain_rss"
printf '\n(c) / max(a, b) = %.3f (target <= 1.15); (d) / max(a, b) = %.3f\n' \
  "$(echo "$cold_s / $floor" | bc -l)" "$(echo "$plain / $floor" | bc -l)"
