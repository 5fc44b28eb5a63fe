#!/usr/bin/env bash
# Short versions of the headline comparisons of docs/benchmarks.md in one run: each pair of tools
# interleaved (A, B, A, B, ...), RUNS runs each (default 3), medians printed as one table at the end.
#
#   PYTHON=path/to/python benches/quick_all.sh        # a Python with torch, transformers, safetensors
#
# The comparisons, and what is shorter than the full scripts:
#   score     sinkmerge score vs transformers (benches/score_transformers.py), Qwen2.5-0.5B shapes,
#             the 15 default prompts: the same as `benches/score_vs_transformers.sh small`. The
#             weights are the usual N(0, 0.02) init, whose activations stay in range.
#   score-hot the same with an N(0, 0.2) init: activations grow layer by layer, so the exponentials
#             of SiLU and softmax over- and underflow (the inputs the vectorised exp must not slow on).
#   score-7b4 the same at Qwen2.5-7B widths, 4 layers (vocab 152064, 4.4 GB bf16): both tools on the
#             same checkpoint, warm page cache.
#   prefetch  score-7b4's sinkmerge run from a cold page cache against the larger of its two floors,
#             measured in the same loop: `cat` of the shards from a cold cache (disk) and the warm run
#             (compute); benches/prefetch_floor.sh is the full version.
#   heads     heads on a pair at 7B widths, 4 layers, against score --ref of the same pair: the
#             per-head drift's share of the scoring pass (target <= 25%).
#   norms     sinkmerge norms vs torch matrix_norm (full SVD), one fp32 layer at Qwen2.5-7B widths,
#             the attention projections q/k/v/o only (the full script's torch peer also takes the
#             18944-row MLP matrices, minutes each); on both inputs, lowrank and flat (SPECTRUM in
#             benches/gen_norms_bench.py).
#   star, tsv sinkmerge merge vs the full-SVD torch reference (benches/spectral_ref.py), one fp32
#             layer at Qwen2.5-1.5B widths (hidden 1536, intermediate 8960), vocab 2048, on both
#             inputs (benches/gen_merge_tasks.py --spectrum). The full script uses 7B widths, where
#             each torch run takes 3-5 minutes; SPECTRAL_SHAPE overrides the widths. Each output's
#             error, and the torch reference's own float32 error, against a float64 run of the
#             reference are printed under the table.
#   extract   sinkmerge extract vs cp of the same shards, a Qwen2.5-VL of 2 language layers at 7B
#             widths (the full script has 4).
#   linear    sinkmerge merge vs mergekit-yaml on the lowrank models of star/tsv; skipped when no
#             mergekit-yaml is found (MERGEKIT, or beside PYTHON, or on PATH).
# On an idle 2-core VM the whole run took 18 minutes on a Sapphire Rapids CPU and 35 minutes on a
# slower Xeon without AMX (2026-12-03), 25-29 minutes on an AMD EPYC (Zen 3) on 2026-12-07, data
# generation included; the torch peers of star and tsv and their float64 references are about
# half of it (docs/benchmarks.md). The float64 references share the task vectors' SVDs: on the
# EPYC VM one spectrum's pair took 81 s, against 49 s + 80 s as two runs (2026-12-07).
# It first prints this machine's measured FMA peak in f32 and f64 (examples/fma_peak.rs): a case's
# counted flops over it is that case's compute floor.
# Scratch data (about 9 GB at its peak) goes to WORK (default $TMPDIR/sinkmerge-quick-all) and is
# deleted at the end unless KEEP=1. SMOKE=1 runs every step on tiny shapes to check the script
# (its timings mean nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/machine.sh
PY=${PYTHON:-python3}
RUNS=${RUNS:-3}
WORK=${WORK:-${TMPDIR:-/tmp}/sinkmerge-quick-all}
beside=$(dirname "$(command -v "$PY")")/mergekit-yaml
[ -x "$beside" ] || beside=$(command -v mergekit-yaml || true)
MERGEKIT=${MERGEKIT:-$beside}
# BIN_DIR: a directory holding sinkmerge, examples/synth_checkpoint and examples/fma_peak already
# built (default: a release build here).
if [ -z "${BIN_DIR:-}" ]; then
  cargo build -q --release --bin sinkmerge --example synth_checkpoint --example fma_peak
  BIN_DIR=target/release
fi
SM=$BIN_DIR/sinkmerge
SYNTH=$BIN_DIR/examples/synth_checkpoint
TOK=tests/fixtures/models/qwen2
ATTENTION=q_proj,k_proj,v_proj,o_proj

if [ "${SMOKE:-0}" = 1 ]; then
  SCORE_SHAPE="--layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --vocab 384 --tie 1"
  WIDE_SHAPE="--layers 2 --hidden 128 --intermediate 256 --heads 4 --kv-heads 2 --vocab 384"
  NORMS_SHAPE="--hidden 64 --intermediate 128 --heads 4 --kv-heads 2"
  SPECTRAL_SHAPE=${SPECTRAL_SHAPE:-"--hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --vocab 384"}
  EXTRACT_SHAPE="--layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --vocab 384"
else
  SCORE_SHAPE="--layers 24 --hidden 896 --intermediate 4864 --heads 14 --kv-heads 2 --vocab 151936 --tie 1"
  WIDE_SHAPE="--layers 4 --hidden 3584 --intermediate 18944 --heads 28 --kv-heads 4 --vocab 152064"
  NORMS_SHAPE="--hidden 3584 --intermediate 18944 --heads 28 --kv-heads 4"
  SPECTRAL_SHAPE=${SPECTRAL_SHAPE:-"--hidden 1536 --intermediate 8960 --heads 12 --kv-heads 2 --vocab 2048"}
  EXTRACT_SHAPE="--layers 2 --hidden 3584 --intermediate 18944 --heads 28 --kv-heads 4 --vocab 32000"
fi

mkdir -p "$WORK"
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
# median, measure (appends "label wall cpu rss" to $WORK/results.txt), summary
source benches/timing.sh
: >"$WORK/results.txt"
: >"$WORK/notes.txt"
# The compute floor's denominator, measured here: a case's counted flops over this peak.
"$BIN_DIR/examples/fma_peak" | tee -a "$WORK/notes.txt"
start=$(date +%s)

# interleave LABEL_A "CMD A" LABEL_B "CMD B": RUNS alternating runs of the two commands.
interleave() {
  for _ in $(seq "$RUNS"); do
    measure "$1" bash -c "$2"
    measure "$3" bash -c "$4"
  done
}

# score at 0.5B shapes: the usual init, then the hot one
P=assets/prompts/default.txt
for init in score:0.02 score-hot:0.2; do
  label=${init%%:*}
  M=$WORK/$label-model
  # shellcheck disable=SC2086
  $SYNTH "$M" $SCORE_SHAPE --dtype bf16 --std "${init##*:}" >/dev/null
  cp "$TOK/tokenizer.json" "$TOK/tokenizer_config.json" "$M/"
  interleave "$label:sinkmerge" "$SM score '$M' --prompts '$P' --json" \
    "$label:transformers" "'$PY' benches/score_transformers.py '$M' '$P'"
  rm -rf "$M"
done

# score, prefetch and heads at 7B widths, 4 layers: REF and TARGET differ in their seed
for seed in 0 1; do
  # shellcheck disable=SC2086
  $SYNTH "$WORK/wide-$seed" $WIDE_SHAPE --dtype bf16 --seed "$seed" --max-shard-size 1G >/dev/null
  cp "$TOK/tokenizer.json" "$TOK/tokenizer_config.json" "$WORK/wide-$seed/"
done
M=$WORK/wide-0
cat "$M"/*.safetensors >/dev/null
interleave score-7b4:sinkmerge "$SM score '$M' --prompts '$P' --json" \
  score-7b4:transformers "'$PY' benches/score_transformers.py '$M' '$P'"
# cold: the shards out of the page cache (posix_fadvise DONTNEED; as root, drop_caches as well)
cold() {
  sync
  for f in "$M"/*.safetensors; do dd if="$f" iflag=nocache count=0 status=none; done
  if [ -w /proc/sys/vm/drop_caches ]; then echo 1 >/proc/sys/vm/drop_caches || true; fi
}
for _ in $(seq "$RUNS"); do
  cold
  measure prefetch:disk bash -c "cat '$M'/*.safetensors >/dev/null"
  cat "$M"/*.safetensors >/dev/null
  measure prefetch:compute "$SM" score "$M" --prompts "$P" --json
  cold
  measure prefetch:sinkmerge "$SM" score "$M" --prompts "$P" --json
done
cat "$M"/*.safetensors "$WORK"/wide-1/*.safetensors >/dev/null
interleave heads:sinkmerge "$SM heads '$M' '$WORK/wide-1' --prompts '$P' --json" \
  heads:score "$SM score --ref '$M' '$WORK/wide-1' --prompts '$P' --json"
rm -rf "$WORK"/wide-*

# norms, both inputs
for spectrum in lowrank flat; do
  D=$WORK/norms-$spectrum
  # shellcheck disable=SC2086
  nice -n 10 "$PY" benches/gen_norms_bench.py "$D" --layers 1 --spectrum "$spectrum" --dtype f32 \
    $NORMS_SHAPE >/dev/null
  interleave "norms-$spectrum:sinkmerge" \
    "$SM norms --quiet --json --layers 0:1 --modules $ATTENTION '$D/ref' '$D/target'" \
    "norms-$spectrum:torch" \
    "'$PY' benches/norms_torch.py '$D/ref' '$D/target' --threads $(nproc) --layers 1 --modules $ATTENTION"
  rm -rf "$D"
done

# star and tsv, both inputs; linear against mergekit on the lowrank models
for spectrum in lowrank flat; do
  D=$WORK/merge-$spectrum
  # shellcheck disable=SC2086
  $SYNTH "$D/base" --layers 1 $SPECTRAL_SHAPE --dtype f32 --seed 0 >/dev/null
  for t in a:1 b:2; do
    nice -n 10 "$PY" benches/gen_merge_tasks.py "$D/base" "$D/task_${t%%:*}" --seed "${t##*:}" \
      --spectrum "$spectrum" >/dev/null
  done
  for d in base task_a task_b; do cp "$TOK"/tokenizer*.json "$D/$d/"; done
  printf 'merge_method: star\nbase_model: %s\nmodels:\n  - model: %s\n  - model: %s\nparameters: {eta: 40}\ndtype: float32\n' \
    "$D/base" "$D/task_a" "$D/task_b" >"$D/star.yml"
  printf 'merge_method: tsv\nbase_model: %s\nmodels:\n  - model: %s\n  - model: %s\nparameters: {alpha: 1.0}\ndtype: float32\n' \
    "$D/base" "$D/task_a" "$D/task_b" >"$D/tsv.yml"
  # Both float64 runs of the reference in one pass (the task vectors' SVDs shared), untimed.
  nice -n 10 "$PY" benches/spectral_ref.py float64 "$D/base" "$D/out-64-star" "$D/out-64-tsv" \
    "$D/task_a" "$D/task_b" >/dev/null 2>&1
  cat "$D"/*/model.safetensors >/dev/null
  for method in star tsv; do
    interleave "$method-$spectrum:sinkmerge" \
      "rm -rf '$D/out-sm' && $SM merge '$D/$method.yml' -o '$D/out-sm' --quiet" \
      "$method-$spectrum:torch" \
      "rm -rf '$D/out-ref' && '$PY' benches/spectral_ref.py merge $method '$D/base' '$D/out-ref' '$D/task_a' '$D/task_b' 2>/dev/null"
    echo "$method-$spectrum: max relative error against a float64 run of the reference:" \
      "sinkmerge $("$PY" benches/spectral_ref.py compare "$D/base" "$D/out-sm" "$D/out-64-$method")," \
      "torch float32 $("$PY" benches/spectral_ref.py compare "$D/base" "$D/out-ref" "$D/out-64-$method")" \
      >>"$WORK/notes.txt"
    rm -rf "$D/out-sm" "$D/out-ref" "$D/out-64-$method"
  done
  if [ "$spectrum" = lowrank ]; then
    if [ -n "$MERGEKIT" ]; then
      printf 'merge_method: linear\nmodels:\n  - model: %s\n    parameters: {weight: 0.5}\n  - model: %s\n    parameters: {weight: 0.5}\ndtype: float32\n' \
        "$D/task_a" "$D/task_b" >"$D/linear.yml"
      interleave linear:sinkmerge "rm -rf '$D/out-sm' && $SM merge '$D/linear.yml' -o '$D/out-sm' --quiet" \
        linear:mergekit "rm -rf '$D/out-mk' && '$MERGEKIT' '$D/linear.yml' '$D/out-mk' --no-write-model-card --quiet && sync '$D'/out-mk/*.safetensors"
      rm -rf "$D/out-sm" "$D/out-mk"
    else
      echo "linear: skipped, no mergekit-yaml found (set MERGEKIT)" >>"$WORK/notes.txt"
    fi
  fi
  rm -rf "$D"
done

# extract vs cp
D=$WORK/extract
# shellcheck disable=SC2086
$SYNTH "$D/vlm" $EXTRACT_SHAPE --dtype bf16 --max-shard-size 1G --vision-depth 4 >/dev/null
interleave extract:sinkmerge "cat '$D'/vlm/*.safetensors >/dev/null && rm -rf '$D/out' && $SM extract '$D/vlm' -o '$D/out' --quiet" \
  extract:cp "cat '$D'/vlm/*.safetensors >/dev/null && rm -rf '$D/cp' && mkdir '$D/cp' && cp '$D'/vlm/*.safetensors '$D/cp/'"
rm -rf "$D"

echo
echo "medians of $RUNS interleaved runs; load average at the end: $(cut -d' ' -f1-3 /proc/loadavg);" \
  "$(($(date +%s) - start)) s in all"
printf '%-16s %-12s %9s %12s %-12s %9s %12s %8s\n' comparison tool wall_s peak_rss_MB peer wall_s peak_rss_MB ratio
# ratio NUM DEN: "1.23x", or n/a for a DEN under the timer's 10 ms resolution (SMOKE runs)
ratio() {
  if [ "$(echo "$2 > 0" | bc)" = 1 ]; then printf '%.2fx' "$(echo "$1/$2" | bc -l)"; else echo n/a; fi
}
row() { # row NAME A B: A's and B's medians and the wall ratio B/A (nothing when B did not run)
  grep -q "^$1:$3 " "$WORK/results.txt" || return 0
  read -r aw _ ar <<<"$(summary "$1:$2")"
  read -r bw _ br <<<"$(summary "$1:$3")"
  printf '%-16s %-12s %9.2f %12.0f %-12s %9.2f %12.0f %8s\n' "$1" "$2" "$aw" "$(echo "$ar/1024" | bc -l)" \
    "$3" "$bw" "$(echo "$br/1024" | bc -l)" "$(ratio "$bw" "$aw")"
}
for label in score score-hot score-7b4; do row "$label" sinkmerge transformers; done
for spectrum in lowrank flat; do row "norms-$spectrum" sinkmerge torch; done
for method in star tsv; do for spectrum in lowrank flat; do row "$method-$spectrum" sinkmerge torch; done; done
row linear sinkmerge mergekit
row extract sinkmerge cp
row heads sinkmerge score
read -r disk _ _ <<<"$(summary prefetch:disk)"
read -r compute _ _ <<<"$(summary prefetch:compute)"
read -r cold_wall _ cold_rss <<<"$(summary prefetch:sinkmerge)"
floor=$(echo "if ($disk > $compute) $disk else $compute" | bc -l)
printf '%-16s %-12s %9.2f %12.0f %-12s %9.2f %12s %8s\n' prefetch sinkmerge "$cold_wall" \
  "$(echo "$cold_rss/1024" | bc -l)" "max(disk,cpu)" "$floor" "" "$(ratio "$floor" "$cold_wall")"
echo "(ratio: the peer's wall time over sinkmerge's; for extract, below 1 means slower than cp;" \
  "for heads, score's time over heads', so 1/ratio - 1 is the drift's share of the scoring pass;" \
  "for prefetch, the floor over the cold run: the target is >= 1/1.15 = 0.87;" \
  "prefetch floors: disk $disk s, compute $compute s)"
cat "$WORK/notes.txt"
