#!/usr/bin/env bash
# `sinkmerge graft` into a 7B-shaped Qwen2.5-VL against `cp` of the VLM's shard files, side by
# side, with the peak anonymous memory of graft; and `--into-vlm` against the same merge written
# as a plain language model (it must add no second pass).
#
# The VLM (bf16, Hub layout, ~4.4 GB in 1 GB shards) is written by examples/synth_checkpoint.rs:
# 2 language layers at Qwen2.5-7B widths (hidden 3584, MLP 18944, 28 heads, 4 KV heads, vocabulary
# 152064, untied lm_head) and the full Qwen2.5-VL-7B vision tower (32 blocks, embed 1280, MLP 3420)
# with its merger. Its language model is extracted once, untimed. graft reads that LM (~3.1 GB)
# and the VLM's vision tensors (~1.3 GB) and writes the whole VLM; cp reads and writes the VLM's
# shards. Dropping the page cache needs root, so each run starts from a warm cache (the inputs are
# read with `cat` first, after a `sync` that finishes the previous run's writeback): the figures
# compare the tools' own costs, not the disk's read speed. `cp` copies inside the kernel
# (copy_file_range); a user-space copy (`cat A > B`) is timed beside it. graft fsyncs what it writes, so it is also compared with `cp` followed by `sync`. Commands
# alternate, RUNS times each (default 3), medians reported. Peak RssAnon is sampled from /proc
# every 10 ms (the mmap'd inputs are page cache, not memory the tool allocates). The synthetic
# data is deleted at exit.
#
#   benches/graft_vs_cp.sh            (WORK=/path RUNS=5 to change the scratch place or run count)
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/machine.sh
# shellcheck source=benches/timing.sh
source benches/timing.sh
RUNS=${RUNS:-3}
WORK=${WORK:-${TMPDIR:-/tmp}/sinkmerge-bench-graft}
VLM=$WORK/vlm
LM=$WORK/lm
BIN=target/release/sinkmerge
cargo build -q --release --bin sinkmerge --example synth_checkpoint
rm -rf "$WORK"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK"
target/release/examples/synth_checkpoint "$VLM" --layers 2 --hidden 3584 --intermediate 18944 \
  --heads 28 --kv-heads 4 --vocab 152064 --dtype bf16 --max-shard-size 1G --vision-depth 32 >/dev/null
"$BIN" extract "$VLM" -o "$LM" -q --no-model-card >/dev/null
BYTES=$(cat "$VLM"/*.safetensors | wc -c)
SHARDS=$(ls "$VLM"/*.safetensors | wc -l)

# The previous run's writeback is finished first (sync), so that no run pays for another's dirty pages.
warm() { sync; sleep 1; cat "$VLM"/*.safetensors "$LM"/*.safetensors >/dev/null; }
copy() { mkdir -p "$WORK/cp" && cp "$VLM"/*.safetensors "$WORK/cp/"; }
copy_sync() { copy && sync "$WORK"/cp/*.safetensors; }
cat_sync() { mkdir -p "$WORK/cp" && cat "$VLM"/*.safetensors > "$WORK/cp/all" && sync "$WORK/cp/all"; }
linear_then_graft() {
  "$BIN" linear --models "$LM" -o "$WORK/lin" -q && "$BIN" graft --vlm "$VLM" --lm "$WORK/lin" -o "$WORK/out" -q
}
export -f copy copy_sync cat_sync linear_then_graft
export VLM LM WORK BIN

declare -A T R
names=(cp cp_sync cat_sync graft linear linear_into_vlm linear_then_graft)
for _ in $(seq "$RUNS"); do
  for n in "${names[@]}"; do
    rm -rf "$WORK/cp" "$WORK/out" "$WORK/lin"
    warm
    case $n in
      cp) m=$(wall_and_anon bash -c copy) ;;
      cp_sync) m=$(wall_and_anon bash -c copy_sync) ;;
      cat_sync) m=$(wall_and_anon bash -c cat_sync) ;;
      graft) m=$(wall_and_anon "$BIN" graft --vlm "$VLM" --lm "$LM" -o "$WORK/out" -q) ;;
      linear) m=$(wall_and_anon "$BIN" linear --models "$LM" -o "$WORK/out" -q) ;;
      linear_into_vlm) m=$(wall_and_anon "$BIN" linear --models "$LM" --into-vlm "$VLM" -o "$WORK/out" -q) ;;
      linear_then_graft) m=$(wall_and_anon bash -c linear_then_graft) ;;
    esac
    T[$n]+="${m% *} "
    R[$n]+="${m#* } "
  done
done

printf 'cpu: %s; %s cores; load before: %s\n' "$(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)" \
  "$(nproc)" "$(cut -d' ' -f1-3 /proc/loadavg)"
printf 'VLM: %s shards, %.2f GB (language model %.2f GB); %s runs each, medians\n' "$SHARDS" \
  "$(echo "$BYTES/1000000000" | bc -l)" "$(echo "$(cat "$LM"/*.safetensors | wc -c)/1000000000" | bc -l)" "$RUNS"
cp_t=$(echo "${T[cp]}" | median_words)
cps_t=$(echo "${T[cp_sync]}" | median_words)
for n in "${names[@]}"; do
  t=$(echo "${T[$n]}" | median_words)
  rss=$(echo "${R[$n]}" | median_words)
  printf '%-18s %7.3f s  %5.2f GB/s of the VLM  %5.2fx cp  %5.2fx cp+sync  peak RssAnon %7.1f MB   [runs: %s]\n' \
    "$n" "$t" "$(echo "$BYTES/$t/1000000000" | bc -l)" "$(echo "$cp_t/$t" | bc -l)" \
    "$(echo "$cps_t/$t" | bc -l)" "$(echo "$rss/1024" | bc -l)" "${T[$n]% }"
done
