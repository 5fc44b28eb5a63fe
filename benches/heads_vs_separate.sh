#!/usr/bin/env bash
# `sinkmerge heads REF TARGET` against the two runs it replaces, `score --ref REF TARGET` and
# `norms REF TARGET`, on a synthetic pair of Qwen2.5-7B shapes (hidden 3584, 28 query heads and 4 KV
# heads of dim 128, MLP 18944; LAYERS layers, default 4; vocabulary 32000; random bf16 weights, the
# target drawn with another seed, so its drift is dense and full-rank: the hard case for the spectral
# norms). The 15 default prompts; release build; the three commands interleaved, medians of RUNS runs
# (default 3) of wall time, CPU time and peak RSS from /usr/bin/time -v.
#
#   benches/heads_vs_separate.sh            # Environment: LAYERS, RUNS, WORK (default $TMPDIR/sinkmerge-bench-heads)
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/machine.sh
LAYERS=${LAYERS:-4}
RUNS=${RUNS:-3}
WORK=${WORK:-${TMPDIR:-/tmp}/sinkmerge-bench-heads}
mkdir -p "$WORK"
nice -n 10 cargo build -q --release --bin sinkmerge --example synth_checkpoint
SM=target/release/sinkmerge
TOK=tests/fixtures/models/qwen2

# median, measure, summary
source benches/timing.sh

for seed in 0 1; do
  dir="$WORK/m$seed"
  if [ ! -f "$dir/config.json" ]; then
    nice -n 10 target/release/examples/synth_checkpoint "$dir" --layers "$LAYERS" --hidden 3584 \
      --intermediate 18944 --heads 28 --kv-heads 4 --vocab 32000 --dtype bf16 --seed "$seed" >/dev/null
    cp "$TOK/tokenizer.json" "$TOK/tokenizer_config.json" "$dir/"
  fi
done
REF="$WORK/m0"; TARGET="$WORK/m1"
: > "$WORK/results.txt"
for _ in $(seq "$RUNS"); do
  measure heads "$SM" heads "$REF" "$TARGET" --json
  measure score "$SM" score --ref "$REF" "$TARGET" --json
  measure norms "$SM" norms "$REF" "$TARGET" --json
done
echo
echo "Qwen2.5-7B shapes, $LAYERS layers, 15 default prompts; medians of $RUNS runs (load $(cut -d' ' -f1 /proc/loadavg))"
printf '%-22s %9s %9s %12s\n' command wall_s cpu_s peak_rss_MB
for label in heads score norms; do
  read -r w c r <<<"$(summary "$label")"
  printf '%-22s %9.1f %9.1f %12.0f\n' "$label" "$w" "$c" "$(echo "$r/1024" | bc -l)"
done
