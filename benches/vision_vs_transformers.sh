#!/usr/bin/env bash
# A Qwen2.5-VL-7B-shaped vision tower (32 blocks, width 1280, MLP 3420, window attention with full
# attention in blocks 7/15/23/31) on a 1024x1024 image (5476 patches), f32 on the CPU: sinkmerge
# trace against transformers eager, side by side on the same pixel values, interleaved, medians of
# RUNS (default 3). Also compares the two outputs (max |d| / max |transformers|).
#
#   benches/vision_vs_transformers.sh            # needs tools/.venv (transformers 5.23, torch)
#
# The checkpoint is written by the project's synthetic generator (random weights; the language
# model is one small layer of width 3584, which the tower's merger feeds); sinkmerge's wall time
# includes reading the 2.7 GB of f32 weights and that layer, transformers' forward time is the
# tower alone (its load is reported apart). Environment: WORK (default $TMPDIR/sinkmerge-vision),
# RUNS.
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/machine.sh
WORK=${WORK:-${TMPDIR:-/tmp}/sinkmerge-vision}
RUNS=${RUNS:-3}
PY=${PY:-tools/.venv/bin/python}
mkdir -p "$WORK"
cargo build --release --bin sinkmerge --example synth_checkpoint >/dev/null 2>&1
SM=target/release/sinkmerge
if [ ! -f "$WORK/vlm/config.json" ]; then
  target/release/examples/synth_checkpoint "$WORK/vlm" --layers 1 --hidden 3584 --intermediate 256 \
    --heads 28 --kv-heads 4 --vocab 1024 --dtype f32 --vision-depth 32 --seed 0 >/dev/null
  # trace tokenizes the prompt: a tokenizer with Qwen's <|image_pad|>.
  cp tests/fixtures/vlm/qwen2_5_vl/tokenizer.json tests/fixtures/vlm/qwen2_5_vl/tokenizer_config.json "$WORK/vlm/"
fi
[ -f "$WORK/pixels.safetensors" ] || "$PY" benches/vision_transformers.py prep "$WORK/vlm" "$WORK" >/dev/null
echo "load: $(cat /proc/loadavg)  cores: $(nproc)  $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
ours=(); theirs=(); theirs_wall=(); ours_rss=(); theirs_rss=()
for r in $(seq "$RUNS"); do
  /usr/bin/time -f "%e %M" -o "$WORK/time" "$SM" trace "$WORK/vlm" --prompt "<image>" \
    --pixel-values "$WORK/pixels.safetensors" --capture image_embeds -o "$WORK/ours.safetensors" >/dev/null
  read -r wall rss <"$WORK/time"; ours+=("$wall"); ours_rss+=("$rss")
  /usr/bin/time -f "%e %M" -o "$WORK/time" "$PY" benches/vision_transformers.py run "$WORK/vlm" "$WORK" \
    >"$WORK/tf.json" 2>/dev/null
  read -r wall rss <"$WORK/time"; theirs_wall+=("$wall"); theirs_rss+=("$rss")
  theirs+=("$("$PY" -c "import json; print(round(json.load(open('$WORK/tf.json'))['forward_s'], 2))")")
  echo "run $r: sinkmerge ${ours[-1]} s (RSS ${ours_rss[-1]} KB); transformers forward ${theirs[-1]} s, wall ${theirs_wall[-1]} s (RSS ${theirs_rss[-1]} KB)"
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
m_ours=$(median "${ours[@]}"); m_theirs=$(median "${theirs[@]}")
echo "median: sinkmerge ${m_ours} s wall (peak RSS $(median "${ours_rss[@]}") KB); transformers ${m_theirs} s forward, $(median "${theirs_wall[@]}") s wall (peak RSS $(median "${theirs_rss[@]}") KB)"
"$PY" - "$WORK" <<'PY'
import sys
import numpy as np
from safetensors.numpy import load_file
w = sys.argv[1]
a = load_file(f"{w}/ours.safetensors")["image_embeds"]
b = load_file(f"{w}/transformers_embeds.safetensors")["image_embeds"]
print(f"image_embeds {a.shape}: max |d| / max |transformers| = {np.abs(a - b).max() / np.abs(b).max():.2e}")
PY
