#!/usr/bin/env bash
# Two sinkmerge binaries side by side on the commands that write models at disk speed: `extract`
# of a synthetic 2.4 GB bf16 Qwen2.5-VL (4 language layers at Qwen2.5-7B widths, 4 vision blocks)
# and `linear` of two synthetic 2.2 GB bf16 language models, written by
# examples/synth_checkpoint.rs. For checking that a change to the write path (the NaN/Inf scan,
# the cancellation checks, the atomic rename) costs nothing measurable. Warm cache (the inputs
# are read with `cat` before each run), the two binaries interleaved, RUNS rounds (default 5),
# medians reported. The synthetic data is deleted at exit.
#
#   benches/ab_writers.sh OLD_BINARY [NEW_BINARY]     (WORK=/path RUNS=N to change)
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/machine.sh
OLD=$(realpath "$1")
NEW=$(realpath "${2:-target/release/sinkmerge}")
RUNS=${RUNS:-5}
WORK=${WORK:-${TMPDIR:-/tmp}/sinkmerge-bench-writers}
source benches/timing.sh
cargo build -q --release --bin sinkmerge --example synth_checkpoint
rm -rf "$WORK"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK"
SYNTH=target/release/examples/synth_checkpoint
SHAPE=(--layers 4 --hidden 3584 --intermediate 18944 --heads 28 --kv-heads 4 --vocab 32000 --dtype bf16)
"$SYNTH" "$WORK/vlm" "${SHAPE[@]}" --max-shard-size 1G --vision-depth 4 >/dev/null
"$SYNTH" "$WORK/a" "${SHAPE[@]}" --seed 1 >/dev/null
"$SYNTH" "$WORK/b" "${SHAPE[@]}" --seed 2 >/dev/null
warm() { cat "$WORK"/vlm/*.safetensors "$WORK"/a/*.safetensors "$WORK"/b/*.safetensors >/dev/null; }
for _ in $(seq "$RUNS"); do
  for side in old new; do
    bin=$OLD; [ "$side" = new ] && bin=$NEW
    rm -rf "$WORK/out"; warm
    measure "extract_$side" "$bin" extract "$WORK/vlm" -o "$WORK/out" -q
    rm -rf "$WORK/out"; warm
    measure "linear_$side" "$bin" linear --models "$WORK/a" "$WORK/b" -o "$WORK/out" -q
  done
done
echo "command side wall_s cpu_s maxrss_kb (medians of $RUNS)"
for cmd in extract linear; do
  for side in old new; do
    echo "$cmd $side $(summary "${cmd}_$side")"
  done
done
