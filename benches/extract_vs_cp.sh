#!/usr/bin/env bash
# `sinkmerge extract` of a synthetic Qwen2.5-VL checkpoint against `cp` of the same shard files,
# side by side, with the peak anonymous memory of extract.
#
# The checkpoint (~2.5 GB bf16, 3 shards) is a Qwen2.5-VL in the Hub layout: 4 language layers at
# Qwen2.5-7B widths (`model.*`, `lm_head`) plus 4 vision blocks and the merger (`visual.*`), written
# by examples/synth_checkpoint.rs. Dropping the page cache needs root, so every run starts from a
# warm cache (the source shards are read once with `cat` before each timed command); the numbers
# compare the tools' own costs, not the disk's read speed. extract fsyncs what it writes, so it is
# compared with `cp` and with `cp` followed by `sync` of the copied files. Commands alternate, RUNS
# times each (default 3); medians are reported. Peak RssAnon is sampled from /proc every 10 ms; the
# maximum RSS of `/usr/bin/time -v` (one extra run) also counts the mmap'd source pages, which are
# file-backed page cache, not memory the tool allocates. The synthetic data is deleted at exit.
#
#   benches/extract_vs_cp.sh            (WORK=/path RUNS=5 to change the scratch place or run count)
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/machine.sh
# shellcheck source=benches/timing.sh
source benches/timing.sh
RUNS=${RUNS:-3}
WORK=${WORK:-${TMPDIR:-/tmp}/sinkmerge-bench-extract}
SRC=$WORK/vlm
BIN=target/release/sinkmerge
cargo build -q --release --bin sinkmerge --example synth_checkpoint
rm -rf "$WORK"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK"
target/release/examples/synth_checkpoint "$SRC" --layers 4 --hidden 3584 --intermediate 18944 \
  --heads 28 --kv-heads 4 --vocab 32000 --dtype bf16 --max-shard-size 1G --vision-depth 4 >/dev/null
BYTES=$(cat "$SRC"/*.safetensors | wc -c)
SHARDS=$(ls "$SRC"/*.safetensors | wc -l)

warm() { cat "$SRC"/*.safetensors >/dev/null; }
copy() { mkdir -p "$WORK/cp" && cp "$SRC"/*.safetensors "$WORK/cp/"; }
copy_sync() { copy && sync "$WORK"/cp/*.safetensors; }
export -f copy copy_sync
export SRC WORK

declare -A T R
names=(cp cp_sync extract extract_noverify extract_1thread)
for _ in $(seq "$RUNS"); do
  for n in "${names[@]}"; do
    rm -rf "$WORK/cp" "$WORK/out"
    warm
    case $n in
      cp) m=$(wall_and_anon bash -c copy) ;;
      cp_sync) m=$(wall_and_anon bash -c copy_sync) ;;
      extract) m=$(wall_and_anon "$BIN" extract "$SRC" -o "$WORK/out" -q) ;;
      extract_noverify) m=$(wall_and_anon "$BIN" extract "$SRC" -o "$WORK/out" -q --no-verify) ;;
      extract_1thread) m=$(wall_and_anon "$BIN" --threads 1 extract "$SRC" -o "$WORK/out" -q) ;;
    esac
    T[$n]+="${m% *} "
    R[$n]+="${m#* } "
  done
done
rm -rf "$WORK/cp" "$WORK/out"
warm
MAXRSS=$( { /usr/bin/time -v "$BIN" extract "$SRC" -o "$WORK/out" -q >/dev/null; } 2>&1 | awk -F': ' '/Maximum resident/ {print $2}')
WRITTEN=$(cat "$WORK"/out/*.safetensors | wc -c)

printf 'source: %s shards, %.2f GB (language model %.2f GB written by extract); %s runs each, medians\n' \
  "$SHARDS" "$(echo "$BYTES/1000000000" | bc -l)" "$(echo "$WRITTEN/1000000000" | bc -l)" "$RUNS"
cp_t=$(echo "${T[cp]}" | median_words)
cps_t=$(echo "${T[cp_sync]}" | median_words)
for n in "${names[@]}"; do
  t=$(echo "${T[$n]}" | median_words)
  rss=$(echo "${R[$n]}" | median_words)
  printf '%-18s %7.3f s  %5.2f GB/s of source  %5.2fx cp  %5.2fx cp+sync' "$n" "$t" \
    "$(echo "$BYTES/$t/1000000000" | bc -l)" "$(echo "$cp_t/$t" | bc -l)" "$(echo "$cps_t/$t" | bc -l)"
  case $n in extract*) printf '  peak RssAnon %6.1f MB' "$(echo "$rss/1024" | bc -l)" ;; esac
  printf '   [runs: %s]\n' "${T[$n]% }"
done
printf 'extract max RSS (/usr/bin/time -v, includes the file-backed mmap of the source): %.1f MB\n' "$(echo "$MAXRSS/1024" | bc -l)"
