#!/usr/bin/env bash
# Two sinkmerge binaries side by side on the scorer: for checking that a change to the forward
# pass costs no speed. The two cases of benches/quick_all.sh that time the scorer alone:
#   score     the headline: Qwen2.5-0.5B shapes (24 layers, N(0, 0.02) init, bf16), the 15
#             default prompts, warm page cache;
#   prefetch  7B widths, 4 layers (4.4 GB bf16) from a cold page cache (posix_fadvise DONTNEED;
#             as root, drop_caches as well): the read-ahead against the disk.
# The binaries are interleaved (old, new, old, new, ...), RUNS rounds (default 3), medians
# printed; each pair's `--json` outputs are compared byte for byte as well. The synthetic models
# are written by examples/synth_checkpoint.rs under WORK and deleted at exit.
#
#   benches/ab_forward.sh OLD_BINARY [NEW_BINARY]     (WORK=/path RUNS=N to change)
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/machine.sh
OLD=$(realpath "$1")
NEW=$(realpath "${2:-target/release/sinkmerge}")
RUNS=${RUNS:-3}
WORK=${WORK:-${TMPDIR:-/tmp}/sinkmerge-bench-forward}
SYNTH=${SYNTH:-target/release/examples/synth_checkpoint}
[ -x "$SYNTH" ] || cargo build -q --release --example synth_checkpoint
source benches/timing.sh
rm -rf "$WORK"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK"
: >"$WORK/results.txt"
TOK=tests/fixtures/models/qwen2
P=assets/prompts/default.txt

"$SYNTH" "$WORK/small" --layers 24 --hidden 896 --intermediate 4864 --heads 14 --kv-heads 2 \
  --vocab 151936 --tie 1 --dtype bf16 --std 0.02 >/dev/null
"$SYNTH" "$WORK/wide" --layers 4 --hidden 3584 --intermediate 18944 --heads 28 --kv-heads 4 \
  --vocab 152064 --dtype bf16 --max-shard-size 1G >/dev/null
for m in small wide; do cp "$TOK/tokenizer.json" "$TOK/tokenizer_config.json" "$WORK/$m/"; done

cold() {
  sync
  for f in "$WORK"/wide/*.safetensors; do dd if="$f" iflag=nocache count=0 status=none; done
  if [ -w /proc/sys/vm/drop_caches ]; then echo 1 >/proc/sys/vm/drop_caches || true; fi
}
differing=0
for _ in $(seq "$RUNS"); do
  for side in old new; do
    bin=$OLD; [ "$side" = new ] && bin=$NEW
    cat "$WORK"/small/*.safetensors >/dev/null
    measure "score_$side" bash -c "'$bin' score '$WORK/small' --prompts '$P' --json >'$WORK/score.$side.json'"
    cold
    measure "prefetch_$side" bash -c "'$bin' score '$WORK/wide' --prompts '$P' --json >'$WORK/wide.$side.json'"
  done
  for case in score wide; do
    cmp -s "$WORK/$case.old.json" "$WORK/$case.new.json" || { differing=1; echo "DIFF $case"; }
  done
done
echo "case side wall_s cpu_s maxrss_kb (medians of $RUNS)"
for case in score prefetch; do
  for side in old new; do
    echo "$case $side $(summary "${case}_$side")"
  done
done
[ "$differing" -eq 0 ] && echo "outputs: byte-identical in every round"
