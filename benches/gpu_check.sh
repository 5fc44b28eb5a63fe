#!/usr/bin/env bash
# The GPU scorer's checks on a GPU machine, in one run (about 5-8 minutes on an H200):
#   1. GPU-vs-CPU parity (`sinkmerge parity`) on every architecture fixture (f32, and bf16 through
#      the tensor-core GEMMs), the bundled pairs and
#      the VLM fixtures' vision towers, and `visual-sinks` with its key edit on the planted model;
#   2. a synthetic Qwen2.5-7B-shaped bf16 checkpoint (28 layers, hidden 3584, 15 GB), written by the
#      project's own generator;
#   3. `score` on it with the 15 default prompts: cold (page cache dropped, where allowed) and warm,
#      in f32 (SGEMM, TF32 off) and in bf16 (cublasGemmEx on tensor cores);
#   3b. `trace` of a Qwen2.5-VL-7B-shaped vision tower on a 1024x1024 image, GPU and CPU;
#   3c. `generate` on the 7B-shaped checkpoint on the GPU: 128 greedy tokens after a 512-token
#      prompt, decode tokens/s against the HBM floor (weight bytes per token / HBM bandwidth, HBM
#      given as HBM_GBS, default 4800 for an H200), and the GPU's tokens equal to the CPU's on
#      the generate goldens (the parity of the decode path);
#   4. one table, with both precisions' medians side by side.
# It needs no Python, no cargo and no network on the GPU machine: only the repository and two
# stripped release binaries, made beforehand on any Linux x86_64 machine:
#
#   cargo build --release --bin sinkmerge --example synth_checkpoint
#   mkdir -p gpu-bin && strip -o gpu-bin/sinkmerge target/release/sinkmerge \
#     && strip -o gpu-bin/synth_checkpoint target/release/examples/synth_checkpoint
#   tools/.venv/bin/python benches/vision_transformers.py prep - gpu-bin \
#     && mv gpu-bin/pixels.safetensors gpu-bin/pixels_1024.safetensors   # 26 MB, for step 3b
#   benches/gpu_check.sh            # on the GPU machine (BIN=gpu-bin by default)
#
# Environment: BIN (folder of the two binaries), WORK (scratch folder, default $TMPDIR), RUNS (warm
# runs, default 3), DEVICE (default cuda:0). libcuda, libcublas and libnvrtc are looked up in the
# usual places and added to LD_LIBRARY_PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-gpu-bin}
SM=$BIN/sinkmerge
SYNTH=$BIN/synth_checkpoint
WORK=${WORK:-${TMPDIR:-/tmp}/sinkmerge-gpu-check}
RUNS=${RUNS:-3}
DEVICE=${DEVICE:-cuda:0}
mkdir -p "$WORK"
for b in "$SM" "$SYNTH"; do
  [ -x "$b" ] || { echo "gpu_check: $b is missing; see the header of $0" >&2; exit 2; }
done

# The CUDA libraries: the driver's mount, the toolkit, or a Python venv's nvidia wheels.
libs=""
for dir in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/local/cuda/lib64 \
  /usr/lib/x86_64-linux-gnu $(ls -d /usr/local/cuda-*/lib64 2>/dev/null) \
  $(find /usr /opt /root /home -xdev -path '*site-packages/nvidia/*/lib' -type d 2>/dev/null | head -20); do
  if ls "$dir"/libcuda.so* "$dir"/libcublas.so* "$dir"/libnvrtc.so* >/dev/null 2>&1; then
    libs="$libs:$dir"
  fi
done
export LD_LIBRARY_PATH="${libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# 1. Parity on the fixtures and the bundled pairs.
parity_rows=()
failed=0
parity() {  # parity LABEL ARGS...
  local label=$1; shift
  local out
  if out=$("$SM" parity --device "$DEVICE" --json "$@" 2>"$WORK/parity.err"); then
    :
  else
    failed=1
  fi
  local row
  row=$(printf '%s' "$out" | awk -v l="$label" '
    /"max_prob_diff"/ {gsub(/[ ,]/,""); split($0,a,":"); if (a[2]>p) p=a[2]}
    /"max_logit_diff"/ {gsub(/[ ,]/,""); split($0,a,":"); if (a[2]>g) g=a[2]}
    /"holds"/ {h=$2}
    END {printf "%-24s max|dP| %-10.2e max|dlogit| %-10.2e holds %s", l, p, g, h}')
  [ -n "$out" ] || row="$label: $(head -c 300 "$WORK/parity.err")"
  parity_rows+=("$row")
  echo "$row"
}
for dir in tests/fixtures/models/{qwen2,qwen2-sharded,qwen3,llama31-tied,mistral,olmo3,qwen3_vl} \
  tests/fixtures/score/models/*; do
  parity "$(basename "$dir")" "$dir"
  parity "$(basename "$dir") (bf16)" --precision bf16 "$dir"
done
for family in tiny-qwen3 tiny-qwen2; do
  parity "$family (pair)" --ref "assets/models/$family/ref" "assets/models/$family/vl"
  parity "$family (pair, bf16)" --precision bf16 --ref "assets/models/$family/ref" "assets/models/$family/vl"
done
# The vision towers (each VLM fixture's tower on the bundled image, with its decoder).
for dir in tests/fixtures/vlm/{qwen2_vl,qwen2_5_vl,qwen3_vl,qwen3_vl_moe,internvl,internvl_qknorm,internvl_remote}; do
  parity "$(basename "$dir") (vision)" "$dir"
done
# visual-sinks on the planted-sink model with the remove edit and its control, GPU against CPU:
# every value of the per-token CSV (attention, ratios, cosines, norms, the edited attention) and
# every flag (sink, gated).
vs_args=(visual-sinks tests/fixtures/visual_sinks/planted/model --image
  tests/fixtures/visual_sinks/planted/image.png --question 'Where is the red square?' --ratio 5
  --edit remove --controls)
if "$SM" "${vs_args[@]}" --csv "$WORK/vs_cpu.csv" >/dev/null 2>"$WORK/vs.err" \
  && "$SM" "${vs_args[@]}" --device "$DEVICE" --csv "$WORK/vs_gpu.csv" >/dev/null 2>>"$WORK/vs.err"; then
  row=$(paste -d, "$WORK/vs_cpu.csv" "$WORK/vs_gpu.csv" | awk -F, '
    NR > 1 { n = NF / 2
      for (i = 1; i <= n; i++) { a = $i; b = $(i + n); if (a == b) continue
        if (a ~ /^-?[0-9.eE+-]+$/ && b ~ /^-?[0-9.eE+-]+$/) { d = a - b; if (d < 0) d = -d; if (d > m) m = d }
        else f++ } }
    END { printf "%-24s max|d| %-10.2e flags differing %d", "visual-sinks (planted)", m, f }')
else
  failed=1
  row="visual-sinks (planted): $(head -c 300 "$WORK/vs.err")"
fi
parity_rows+=("$row")
echo "$row"

# 2. A Qwen2.5-7B-shaped checkpoint (random bf16 weights, the fixtures' tokenizer).
M="$WORK/qwen2.5-7b-shape"
if [ ! -f "$M/config.json" ]; then
  start=$(date +%s.%N)
  "$SYNTH" "$M" --layers 28 --hidden 3584 --intermediate 18944 --heads 28 --kv-heads 4 \
    --vocab 152064 --dtype bf16 --seed 0 >/dev/null || { echo "gpu_check: generator failed" >&2; exit 1; }
  cp tests/fixtures/models/qwen2/tokenizer.json tests/fixtures/models/qwen2/tokenizer_config.json "$M/"
  echo "generated $(du -sh "$M" | cut -f1) in $(echo "$(date +%s.%N) - $start" | bc) s"
fi

# 3. score: cold (caches dropped, if this machine lets us) and warm.
timed_score() {  # timed_score LABEL [ARGS...]: one run, appends "label wall json-fields" to results
  local label=$1; shift
  local start end
  start=$(date +%s.%N)
  "$SM" score "$M" --prompts assets/prompts/default.txt --device "$DEVICE" --json "$@" >"$WORK/score.json" 2>"$WORK/score.err" \
    || { echo "$label: $(head -c 300 "$WORK/score.err")"; failed=1; return; }
  end=$(date +%s.%N)
  local fields
  fields=$(awk '
    /"(init_s|load_s|compute_s|copy_back_s|score_s|peak_memory_bytes|sink_strength|n_tokens)"/ {
      gsub(/[",]/,""); printf "%s=%s ", $1, $2 }' "$WORK/score.json")
  echo "$label wall_s=$(echo "$end - $start" | bc) $fields" | tee -a "$WORK/results.txt"
}
: >"$WORK/results.txt"
sync
if echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then
  timed_score cold
else
  echo "cold: the page cache cannot be dropped here (not root, or a container); first run instead"
  timed_score first
fi
for i in $(seq "$RUNS"); do timed_score "warm$i"; done
for i in $(seq "$RUNS"); do timed_score "bf16-warm$i" --precision bf16; done

# 3b. A Qwen2.5-VL-7B-shaped vision tower (32 blocks, width 1280) on a 1024x1024 image (5476
# patches): `trace` on the GPU and on this machine's CPU, on the pixel values that
# `benches/vision_transformers.py prep` made beforehand (PIXELS, default $BIN/pixels_1024.safetensors;
# the step is skipped without them).
PIXELS=${PIXELS:-$BIN/pixels_1024.safetensors}
V="$WORK/qwen2.5-vl-7b-tower"
if [ -f "$PIXELS" ]; then
  if [ ! -f "$V/config.json" ]; then
    "$SYNTH" "$V" --layers 1 --hidden 3584 --intermediate 256 --heads 28 --kv-heads 4 --vocab 1024 \
      --dtype bf16 --vision-depth 32 --seed 0 >/dev/null || { echo "gpu_check: generator failed" >&2; exit 1; }
    cp tests/fixtures/vlm/qwen2_5_vl/tokenizer.json tests/fixtures/vlm/qwen2_5_vl/tokenizer_config.json "$V/"
  fi
  for dev in "$DEVICE" "$DEVICE" cpu; do
    start=$(date +%s.%N)
    if "$SM" trace "$V" --prompt "<image>" --pixel-values "$PIXELS" --capture image_embeds \
      --device "$dev" -o "$WORK/vision-$dev.safetensors" --json >"$WORK/trace.json" 2>"$WORK/trace.err"; then
      echo "vision-tower-$dev wall_s=$(echo "$(date +%s.%N) - $start" | bc)" | tee -a "$WORK/results.txt"
    else
      echo "vision tower on $dev: $(head -c 300 "$WORK/trace.err")"; failed=1
    fi
  done
else
  echo "vision tower: $PIXELS is missing (see step 3b); skipped"
fi

# 3c. Decoding: GPU decode tokens/s at 7B shapes, and the same tokens as the CPU on a golden.
HBM_GBS=${HBM_GBS:-4800}
python_free_ids() {  # 512 token ids of the fixtures' vocabulary, as a JSON list
  awk 'BEGIN { srand(0); printf "["; for (i = 0; i < 512; i++) printf "%s%d", (i ? "," : ""), int(rand() * 300); print "]" }'
}
python_free_ids >"$WORK/ids512.json"
for i in $(seq "$RUNS"); do
  if "$SM" generate "$M" --prompt-ids "$WORK/ids512.json" --max-new-tokens 128 --greedy --ignore-eos \
    --device "$DEVICE" --json >"$WORK/gen.json" 2>"$WORK/gen.err"; then
    tps=$(grep -o '"decode_tokens_per_s": [0-9.e+-]*' "$WORK/gen.json" | awk '{print $2}')
    pps=$(grep -o '"prefill_tokens_per_s": [0-9.e+-]*' "$WORK/gen.json" | awk '{print $2}')
    echo "generate$i decode_tok_s=$tps prefill_tok_s=$pps" | tee -a "$WORK/results.txt"
  else
    echo "generate on $DEVICE: $(head -c 300 "$WORK/gen.err")"; failed=1
  fi
done
bytes=$(du -bc "$M"/*.safetensors | tail -1 | cut -f1)
echo "generate: HBM floor $(awk -v b="$bytes" -v g="$HBM_GBS" 'BEGIN {printf "%.1f", g * 1e9 / b}') tok/s ($bytes bytes of weights per token, $HBM_GBS GB/s)" | tee -a "$WORK/results.txt"
for case in fixture_mistral qwen3_vl_two; do
  g=tests/fixtures/generate/$case.json
  want=$(tr -d ' \n' <"$g" | grep -o '"generated_ids":\[[0-9,]*\]')
  model=$(grep -o '"model": "[^"]*"' "$g" | cut -d'"' -f4)
  tr -d ' \n' <"$g" | grep -o '"prompt_ids":\[[0-9,]*\]' | cut -d: -f2 >"$WORK/$case.ids.json"
  pix=$(grep -o '"pixel_values": "[^"]*"' "$g" | cut -d'"' -f4)
  if [ -n "$pix" ]; then
    echo "generate parity $case: images need --prompt (skipped; the host stand-in covers it in cargo test)"
    continue
  fi
  got=$("$SM" generate "$model" --prompt-ids "$WORK/$case.ids.json" --max-new-tokens 40 --greedy \
    --ignore-eos --device "$DEVICE" --json 2>&1 | tr -d ' \n' | grep -o '"generated_ids":\[[0-9,]*\]')
  if [ "$got" = "$want" ]; then echo "generate parity $case: 40 tokens as transformers'"
  else echo "generate parity $case: tokens differ from transformers'"; failed=1; fi
done

# 4. The table.
echo
echo "== sinkmerge GPU check ($(date -u +%Y-%m-%dT%H:%MZ), $("$SM" --version)) =="
printf '%s\n' "${parity_rows[@]}"
echo
echo "Qwen2.5-7B shapes, bf16 on disk, 15 default prompts; f32 (TF32 off) unless labelled bf16:"
cat "$WORK/results.txt"
median_of() {  # median_of PATTERN [FIELD]: median of FIELD (default wall_s) over the runs whose label matches
  local field=${2:-wall_s}
  awk -v p="$1" -v f="$field=" '$1 ~ p {for (i=2;i<=NF;i++) if (index($i, f) == 1) {sub(f,"",$i); print $i}}' "$WORK/results.txt" \
    | sort -g | awk '{a[NR]=$1} END {if (NR) printf "%.6g\n", (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2); else print "-"}'
}
echo
echo "Warm medians of $RUNS runs (seconds; peak in GiB):"
printf '%-10s %9s %9s %9s %9s %9s\n' precision wall score load compute peak
for p in f32 bf16; do
  pat='^warm'; [ "$p" = bf16 ] && pat='^bf16-warm'
  peak=$(median_of "$pat" peak_memory_bytes)
  [ "$peak" != - ] && peak=$(awk -v b="$peak" 'BEGIN {printf "%.2f", b / 1073741824}')
  printf '%-10s %9s %9s %9s %9s %9s\n' "$p" "$(median_of "$pat")" "$(median_of "$pat" score_s)" \
    "$(median_of "$pat" load_s)" "$(median_of "$pat" compute_s)" "$peak"
done
f32_wall=$(median_of '^warm'); bf16_wall=$(median_of '^bf16-warm')
if [ "$f32_wall" != - ] && [ "$bf16_wall" != - ]; then
  echo "bf16 / f32 warm wall: $(awk -v b="$bf16_wall" -v f="$f32_wall" 'BEGIN {printf "%.3f", b / f}')"
fi
exit $failed
