#!/usr/bin/env bash
# Whole-command timings and peak memory of the paper's controls on a 7B-shaped checkpoint, side by
# side with `cp -r` of the same model (the floor for any command that writes a full copy).
#
# REF and TARGET are two synthetic Qwen2.5-7B-width checkpoints (LAYERS layers, bf16) with
# different seeds, so TARGET's drift is large (~1.4x ||W||); at realistic small drifts bf16 needs
# one or two more passes of the scale search per tensor (`cargo bench --bench controls` measures
# that per tensor). All inputs are read from the page cache (read once beforehand). Median of RUNS
# runs; peak memory from one more run.
#
#   benches/controls.sh            (LAYERS=2 RUNS=3 by default; needs ~6 GB free in $TMPDIR)
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/machine.sh
RUNS=${RUNS:-3}
LAYERS=${LAYERS:-2}
DIR=${TMPDIR:-/tmp}/sinkmerge-bench-controls
cargo build -q --release --bin sinkmerge --example synth_checkpoint
BIN=target/release/sinkmerge
for seed in 0 1; do
  if [ ! -d "$DIR/m$seed" ]; then
    target/release/examples/synth_checkpoint "$DIR/m$seed" --layers "$LAYERS" --hidden 3584 \
      --intermediate 18944 --heads 28 --kv-heads 4 --vocab 32000 --dtype bf16 --seed "$seed" >/dev/null
  fi
  cat "$DIR/m$seed"/*.safetensors >/dev/null
done
BYTES=$(cat "$DIR"/m0/*.safetensors | wc -c)

median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
# time_of OUT CMD...: seconds for CMD, which writes OUT (removed before and after).
time_of() {
  local out=$1 t0 t1; shift
  rm -rf "$out"; t0=$(date +%s.%N); "$@" >/dev/null; t1=$(date +%s.%N); rm -rf "$out"
  echo "$t1 - $t0" | bc -l
}
# peak_rss OUT CMD...: peak RSS (/usr/bin/time -v; includes the mmap'd input pages the command
# touched, which are page cache, not allocations) and peak anonymous RSS (RssAnon sampled every
# 20 ms from /proc: the memory the command itself allocates).
peak_rss() {
  local out=$1 pid anon=0 a; shift
  rm -rf "$out"
  /usr/bin/time -v -o "$DIR/time.txt" "$@" >/dev/null & pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    for child in $(pgrep -P "$pid"); do
      a=$(awk '/RssAnon/ {print $2}' "/proc/$child/status" 2>/dev/null || echo 0)
      [ "${a:-0}" -gt "$anon" ] && anon=$a
    done
    sleep 0.02
  done
  wait "$pid"
  printf '%.0f MiB (anon %.0f MiB)' "$(awk -F: '/Maximum resident/ {print $2/1024}' "$DIR/time.txt")" "$(echo "$anon/1024" | bc -l)"
  rm -rf "$out"
}
report() {
  local name=$1 out=$2; shift 2
  local s rss
  s=$(for _ in $(seq "$RUNS"); do time_of "$out" "$@"; done | median)
  rss=$(peak_rss "$out" "$@")
  printf '%-34s %7.2f s  %6.2f GB/s  %5.2fx cp   peak RSS %s\n' "$name" "$s" \
    "$(echo "$BYTES / $s / 1000000000" | bc -l)" "$(echo "$s / $cp_s" | bc -l)" "$rss"
}

O=$DIR/out
cp_s=$(for _ in $(seq "$RUNS"); do time_of "$O" cp -r "$DIR/m0" "$O"; done | median)
printf 'model: %s layers at Qwen2.5-7B widths, bf16, %.2f GB; %s runs, median\n' "$LAYERS" \
  "$(echo "$BYTES/1000000000" | bc -l)" "$RUNS"
printf '%-34s %7.2f s  %6.2f GB/s\n' "cp -r" "$cp_s" "$(echo "$BYTES / $cp_s / 1000000000" | bc -l)"
report "perturb --match" "$O" $BIN perturb "$DIR/m0" --match "$DIR/m1" -o "$O" --quiet
report "perturb --match --threads 1" "$O" $BIN --threads 1 perturb "$DIR/m0" --match "$DIR/m1" -o "$O" --quiet
report "ablate (2 norms, top 10)" "$O" $BIN ablate "$DIR/m0" --norms input_layernorm,post_attention_layernorm -o "$O" --quiet
report "inject-qknorm" "$O" $BIN inject-qknorm "$DIR/m0" -o "$O" --quiet
