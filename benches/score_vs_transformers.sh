#!/usr/bin/env bash
# `sinkmerge score` against transformers (eager attention, float32, output_attentions) on CPU, side by side,
# on synthetic checkpoints with real model shapes (random bf16 weights; the fixtures' tokenizer, so both tools
# see the same token ids). Release build. Wall time, CPU time (user+sys) and peak RSS from /usr/bin/time -v;
# medians of RUNS runs, the two tools interleaved so they share the machine's load.
#
#   benches/score_vs_transformers.sh small   # (a) Qwen2.5-0.5B shapes (24 layers, hidden 896, tied; ~1 GB bf16),
#                                            #     the 15 default prompts: sinkmerge vs benches/score_transformers.py
#   benches/score_vs_transformers.sh 7b      # (b) Qwen2.5-7B shapes (28 layers, hidden 3584; ~15 GB bf16): sinkmerge
#                                            #     time and peak RSS; scaling with layers (7/14/28 at 64-token
#                                            #     prompts) and prompt length (32/64/128 tokens at 28 layers).
#                                            #     The checkpoint is generated (niced) and deleted afterwards
#                                            #     unless KEEP=1.
# Environment: RUNS (default 3 for small, 1 for 7b), PYTHON (default python3),
# WORK (default $TMPDIR/sinkmerge-bench-score).
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/machine.sh
MODE=${1:-small}
PY=${PYTHON:-python3}
WORK=${WORK:-${TMPDIR:-/tmp}/sinkmerge-bench-score}
mkdir -p "$WORK"
nice -n 10 cargo build -q --release --bin sinkmerge --example synth_checkpoint
SM=target/release/sinkmerge
TOK=tests/fixtures/models/qwen2

# median, measure, summary
source benches/timing.sh

synth() {  # synth DIR ARGS...: a synthetic checkpoint with the fixtures' tokenizer
  local dir=$1; shift
  if [ ! -f "$dir/config.json" ]; then
    nice -n 10 target/release/examples/synth_checkpoint "$dir" "$@" --dtype bf16 >/dev/null
    cp "$TOK/tokenizer.json" "$TOK/tokenizer_config.json" "$dir/"
  fi
}

if [ "$MODE" = small ]; then
  RUNS=${RUNS:-3}
  M="$WORK/q05"
  synth "$M" --layers 24 --hidden 896 --intermediate 4864 --heads 14 --kv-heads 2 --vocab 151936 --tie 1
  P=assets/prompts/default.txt
  : > "$WORK/results.txt"
  for _ in $(seq "$RUNS"); do
    measure sinkmerge "$SM" score "$M" --prompts "$P" --json
    measure transformers "$PY" benches/score_transformers.py "$M" "$P"
  done
  read -r sw sc sr <<<"$(summary sinkmerge)"
  read -r tw tc tr <<<"$(summary transformers)"
  echo
  echo "Qwen2.5-0.5B shapes, 15 prompts, $("$PY" - <<EOF
from tokenizers import Tokenizer
t = Tokenizer.from_file("$TOK/tokenizer.json")
print(sum(len(t.encode(l).ids) for l in open("$P", encoding="utf-8").read().splitlines() if l.strip()), end="")
EOF
) tokens; medians of $RUNS runs (machine shared with other jobs: load $(cut -d' ' -f1 /proc/loadavg))"
  printf '%-14s %9s %9s %12s\n' tool wall_s cpu_s peak_rss_MB
  printf '%-14s %9.1f %9.1f %12.0f\n' sinkmerge "$sw" "$sc" "$(echo "$sr/1024" | bc -l)"
  printf '%-14s %9.1f %9.1f %12.0f\n' transformers "$tw" "$tc" "$(echo "$tr/1024" | bc -l)"
  printf 'speed-up: %.1fx wall, %.1fx CPU; peak RSS: %.3f of transformers\n' \
    "$(echo "$tw/$sw" | bc -l)" "$(echo "$tc/$sc" | bc -l)" "$(echo "$sr/$tr" | bc -l)"
  exit 0
fi

if [ "$MODE" = 7b ]; then
  RUNS=${RUNS:-1}
  M="$WORK/q7b"
  synth "$M" --layers 28 --hidden 3584 --intermediate 18944 --heads 28 --kv-heads 4 --vocab 152064 --max-shard-size 4G
  # The same shards under configs with fewer layers (extra tensors are ignored).
  for L in 7 14; do
    mkdir -p "$M-L$L"
    for f in "$M"/*; do
      [ "$(basename "$f")" = config.json ] || ln -sf "$f" "$M-L$L/"
    done
    "$PY" -c "import json,sys; c=json.load(open('$M/config.json')); c['num_hidden_layers']=$L; json.dump(c, open('$M-L$L/config.json','w'))"
  done
  # 15 prompts of exactly N tokens each, cut from the pool.
  for N in 32 64 128; do
    "$PY" - "$N" > "$WORK/prompts-$N.txt" <<EOF
import sys
from tokenizers import Tokenizer
n = int(sys.argv[1])
t = Tokenizer.from_file("$TOK/tokenizer.json")
pool = [l for l in open("assets/prompts/pool.txt", encoding="utf-8").read().splitlines() if l.strip()]
for i in range(15):
    text = " ".join(pool[i::15])
    cut = next(k for k in range(len(text), 0, -1) if len(t.encode(text[:k]).ids) <= n)
    while len(t.encode(text[:cut]).ids) < n:
        cut += 1
    assert len(t.encode(text[:cut]).ids) == n, (i, n)
    print(text[:cut].replace("\n", " "))
EOF
  done
  : > "$WORK/results.txt"
  for _ in $(seq "$RUNS"); do
    measure "default-15-prompts" "$SM" score "$M" --json
    for N in 32 64 128; do measure "L28-T$N" "$SM" score "$M" --prompts "$WORK/prompts-$N.txt" --json; done
    for L in 7 14; do measure "L$L-T64" "$SM" score "$M-L$L" --prompts "$WORK/prompts-64.txt" --json; done
  done
  echo
  echo "Qwen2.5-7B shapes ($(du -shL "$M" | cut -f1) bf16), 15 prompts; medians of $RUNS runs (load $(cut -d' ' -f1 /proc/loadavg))"
  printf '%-20s %9s %9s %12s\n' run wall_s cpu_s peak_rss_MB
  for label in default-15-prompts L28-T32 L28-T64 L28-T128 L7-T64 L14-T64; do
    read -r w c r <<<"$(summary "$label")"
    printf '%-20s %9.1f %9.1f %12.0f\n' "$label" "$w" "$c" "$(echo "$r/1024" | bc -l)"
  done
  if [ "${KEEP:-0}" != 1 ]; then rm -rf "$M" "$M-L7" "$M-L14"; fi
  exit 0
fi
echo "usage: $0 small|7b" >&2
exit 2
