#!/usr/bin/env bash
# visual-sinks on one 1024x1024 image with a 2B-shaped VLM, f32 on the CPU: the plain command (one
# pass: the vision tower, then the language model with every layer probed) against
# `--edit remove --controls` (the tower once, then three language-model passes: unedited, edited,
# control). Interleaved, RUNS times each (default 3); medians of the wall time and peak RSS, and the
# extra passes' time as the difference of the two medians.
#
#   benches/visual_sinks_cpu.sh        # RUNS=1 for a first figure
#
# The checkpoint is written by the project's synthetic generator (random weights, bf16 on disk):
# the language model at Qwen2-VL-2B's widths (28 layers, hidden 1536, MLP 8960, 12 heads, 2 KV
# heads, vocab 151936) with Qwen2.5-VL's 32-block tower (width 1280) under `visual.*`, ~4.5 GB.
# The tokenizer, chat template and processor config are the Qwen2.5-VL fixture's, with max_pixels
# raised so that 1024x1024 is not scaled down (smart_resize rounds it to 1036x1036: 74x74 patches,
# 37x37 = 1369 image tokens). Wall times include reading the checkpoint (page cache warm after the
# first run) and decoding/preprocessing the PNG. Environment: WORK (default
# $TMPDIR/sinkmerge-visual-sinks), RUNS, PY (for the image only).
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/machine.sh
WORK=${WORK:-${TMPDIR:-/tmp}/sinkmerge-visual-sinks}
RUNS=${RUNS:-3}
PY=${PY:-tools/.venv/bin/python}
mkdir -p "$WORK"
cargo build --release --bin sinkmerge --example synth_checkpoint >/dev/null 2>&1
SM=target/release/sinkmerge
FIX=tests/fixtures/vlm/qwen2_5_vl
if [ ! -f "$WORK/vlm/config.json" ]; then
  target/release/examples/synth_checkpoint "$WORK/vlm" --layers 28 --hidden 1536 --intermediate 8960 \
    --heads 12 --kv-heads 2 --vocab 151936 --dtype bf16 --vision-depth 32 --seed 0 >/dev/null
  cp "$FIX/tokenizer.json" "$FIX/tokenizer_config.json" "$FIX/chat_template.json" "$WORK/vlm/"
  # The fixture's processor config with Qwen2.5-VL's own pixel limits (max 12845056 = 16384 * 28^2).
  sed -e 's/"max_pixels": [0-9]*/"max_pixels": 12845056/' -e 's/"min_pixels": [0-9]*/"min_pixels": 3136/' \
    "$FIX/preprocessor_config.json" >"$WORK/vlm/preprocessor_config.json"
fi
if [ ! -f "$WORK/scene_1024.png" ]; then
  # tools/gen_test_images.py's scene (gradients, hard edges, strokes) at 1024x1024, plus a red square.
  "$PY" - "$WORK/scene_1024.png" <<'PY'
import sys
sys.path.insert(0, "tools")
from PIL import ImageDraw
from gen_test_images import scene
img = scene(1024, 1024, 5)
ImageDraw.Draw(img).rectangle([640, 600, 840, 800], fill=(220, 20, 20))
img.save(sys.argv[1], optimize=False)
PY
fi
echo "load: $(cat /proc/loadavg)  cores: $(nproc)  cpu:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
args=("$WORK/vlm" --image "$WORK/scene_1024.png" --question 'Where is the red square?' --ratio 20 --json)
plain=(); edit=(); plain_rss=(); edit_rss=()
for r in $(seq "$RUNS"); do
  /usr/bin/time -v -o "$WORK/time" "$SM" visual-sinks "${args[@]}" >"$WORK/plain.json"
  plain+=("$(awk -F': ' '/Elapsed \(wall clock\)/ {n=split($2,t,":"); s=0; for(i=1;i<=n;i++) s=s*60+t[i]; print s}' "$WORK/time")")
  plain_rss+=("$(awk -F': ' '/Maximum resident/ {print $2}' "$WORK/time")")
  /usr/bin/time -v -o "$WORK/time" "$SM" visual-sinks "${args[@]}" --edit remove --controls >"$WORK/edit.json"
  edit+=("$(awk -F': ' '/Elapsed \(wall clock\)/ {n=split($2,t,":"); s=0; for(i=1;i<=n;i++) s=s*60+t[i]; print s}' "$WORK/time")")
  edit_rss+=("$(awk -F': ' '/Maximum resident/ {print $2}' "$WORK/time")")
  echo "run $r: plain ${plain[-1]} s (RSS ${plain_rss[-1]} KB); --edit remove --controls ${edit[-1]} s (RSS ${edit_rss[-1]} KB)"
done
echo "load at the end: $(cat /proc/loadavg)"
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
mp=$(median "${plain[@]}"); me=$(median "${edit[@]}")
echo "median: plain ${mp} s (peak RSS $(median "${plain_rss[@]}") KB); edit+control ${me} s (peak RSS $(median "${edit_rss[@]}") KB)"
awk -v p="$mp" -v e="$me" 'BEGIN {printf "extra passes (edit + control): %.2f s, %.2f s per extra pass\n", e - p, (e - p) / 2}'
"$PY" - "$WORK/plain.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
im = d["images"][0]
q0, q1 = im["question_rows"]  # [start, end): the rows after <|vision_end|>, to the end of the prompt
print(f"image tokens: {im['image_tokens']}; question rows: {q1 - q0} ({q0}..{q1}); sequence length: {q1}")
PY
