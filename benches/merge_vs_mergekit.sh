#!/usr/bin/env bash
# sinkmerge against mergekit 0.1.5 (CPU, dtype float32) for linear, task arithmetic, TIES and
# DARE, and against the full-SVD torch reference (tools/tsv_star_ref.py, the official code's math)
# for TSV and STAR, side by side on the same synthetic 7B-shaped models: base + 2 task models,
# fp32, 1 layer at hidden 3584 / intermediate 18944, vocab 16384 (~1.3 GB each).
#
#   benches/merge_vs_mergekit.sh [DATA_DIR]
#
# env: RUNS     runs per tool and method, median reported (default 3)
#      PYTHON   python with torch (default python3)
#      MERGEKIT mergekit 0.1.5's mergekit-yaml (default: the one beside PYTHON, else on PATH)
#      SPECTRUM lowrank (default) or flat: the task vectors of benches/gen_merge_tasks.py
#      HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB  the model's widths (default Qwen2.5-7B's,
#               vocab 16384)
#      METHODS  subset of: linear task_arithmetic ties dare_linear tsv star (default all)
#      REF_TSV_S / REF_STAR_S  reuse an earlier reference time in seconds instead of rerunning
#               the torch reference (it takes minutes at 7B widths, docs/benchmarks.md#merges); accuracy is
#               then not rechecked
#      REF_ONLY=q,k  time the reference on these decomposed tensors only (full names, comma-separated)
#               and charge each other one the time of a computed one of its shape (extrapolation,
#               flagged in the table; the accuracy check then covers the computed tensors)
#      KEEP=1   keep DATA_DIR (default: deleted at the end)
#      PREPARE_ONLY=1  generate the models and configs, time nothing (implies KEEP=1)
# Inputs are read once beforehand, so every run reads from the page cache. Wall time and peak RSS
# come from /usr/bin/time. sinkmerge fsyncs its output before it returns; mergekit does not, so
# the table also gives mergekit followed by `sync` of its output. DATA_DIR defaults to
# $TMPDIR/sinkmerge-bench-merge-SPECTRUM.
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/machine.sh
RUNS=${RUNS:-3}
PY=${PYTHON:-python3}
SPECTRUM=${SPECTRUM:-lowrank}
beside=$(dirname "$(command -v "$PY")")/mergekit-yaml
[ -x "$beside" ] || beside=$(command -v mergekit-yaml || echo mergekit-yaml)
MERGEKIT=${MERGEKIT:-$beside}
METHODS=${METHODS:-linear task_arithmetic ties dare_linear tsv star}
DATA=${1:-${TMPDIR:-/tmp}/sinkmerge-bench-merge-$SPECTRUM}
SM=target/release/sinkmerge

cargo build -q --release --bin sinkmerge --example synth_checkpoint
mkdir -p "$DATA/configs"
if [ ! -d "$DATA/base" ]; then
  target/release/examples/synth_checkpoint "$DATA/base" --layers 1 --hidden "${HIDDEN:-3584}" \
    --intermediate "${INTERMEDIATE:-18944}" --heads "${HEADS:-28}" --kv-heads "${KV_HEADS:-4}" \
    --vocab "${VOCAB:-16384}" --dtype f32 --seed 0 >/dev/null
fi
for t in a:1 b:2; do
  [ -d "$DATA/task_${t%%:*}" ] || nice -n 10 "$PY" benches/gen_merge_tasks.py "$DATA/base" \
    "$DATA/task_${t%%:*}" --seed "${t##*:}" --spectrum "$SPECTRUM" >/dev/null
done
for d in base task_a task_b; do cp tests/fixtures/models/qwen2/tokenizer*.json "$DATA/$d/"; done

config() { # method, parameters of the task models, top-level parameters
  local base_line="base_model: $DATA/base"
  [ "$1" = linear ] && base_line=""
  cat <<YAML
merge_method: $1
$base_line
models:
  - model: $DATA/task_a
    parameters: {$2}
  - model: $DATA/task_b
    parameters: {$2}
parameters: {$3}
dtype: float32
YAML
}
config linear "weight: 0.5" "" >"$DATA/configs/linear.yml"
config task_arithmetic "weight: 1.0" "lambda: 1.0" >"$DATA/configs/task_arithmetic.yml"
config ties "weight: 1.0, density: 0.2" "lambda: 1.0" >"$DATA/configs/ties.yml"
config dare_linear "weight: 1.0, density: 0.1" "lambda: 1.0" >"$DATA/configs/dare_linear.yml"
config tsv "" "alpha: 1.0" >"$DATA/configs/tsv.yml"
config star "" "eta: 40" >"$DATA/configs/star.yml"
sed -i 's/parameters: {}//' "$DATA"/configs/*.yml

[ "${PREPARE_ONLY:-0}" = 1 ] && exit 0

cat "$DATA"/*/model.safetensors >/dev/null
median() { sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
# measure OUTFILE CMD...: appends "seconds maxrss_kB" to OUTFILE
measure() { local f=$1; shift; /usr/bin/time -f "%e %M" -a -o "$f" "$@" >/dev/null 2>"$DATA/last.err" || { cat "$DATA/last.err" >&2; exit 1; }; }
col() { awk "{print \$$1}" "$2" | median; }

printf '%-16s %10s %9s %12s %9s %9s %8s %8s\n' method tool wall_s rss_GB vs_mk_s speedup "" ""
for m in $METHODS; do
  : >"$DATA/sm.$m"; : >"$DATA/mk.$m"; : >"$DATA/mks.$m"
  for _ in $(seq "$RUNS"); do
    rm -rf "$DATA/out-sm"
    measure "$DATA/sm.$m" "$SM" merge "$DATA/configs/$m.yml" -o "$DATA/out-sm" --quiet
    case $m in
      tsv|star) ;;
      *)
        rm -rf "$DATA/out-sm" "$DATA/out-mk"
        measure "$DATA/mk.$m" "$MERGEKIT" "$DATA/configs/$m.yml" "$DATA/out-mk" --no-write-model-card --quiet
        s0=$(date +%s.%N); sync "$DATA"/out-mk/*.safetensors; s1=$(date +%s.%N)
        echo "$(tail -1 "$DATA/mk.$m" | awk '{print $1}') + $s1 - $s0" | bc -l >>"$DATA/mks.$m"
        rm -rf "$DATA/out-sm" "$DATA/out-mk" # disk: never more than one output at a time
        ;;
    esac
  done
  sm_s=$(col 1 "$DATA/sm.$m"); sm_rss=$(col 2 "$DATA/sm.$m")
  if [ -s "$DATA/mk.$m" ]; then
    mk_s=$(col 1 "$DATA/mk.$m"); mk_rss=$(col 2 "$DATA/mk.$m"); mks_s=$(median <"$DATA/mks.$m")
    printf '%-16s %10s %9.2f %12.2f\n' "$m" mergekit "$mk_s" "$(echo "$mk_rss/1048576" | bc -l)"
    printf '%-16s %10s %9.2f %12s\n' "" "mk+sync" "$mks_s" ""
    printf '%-16s %10s %9.2f %12.2f   %6.1fx faster (%.1fx vs mk+sync), %.2fx the RSS\n' "" sinkmerge "$sm_s" \
      "$(echo "$sm_rss/1048576" | bc -l)" "$(echo "$mk_s/$sm_s" | bc -l)" "$(echo "$mks_s/$sm_s" | bc -l)" \
      "$(echo "$sm_rss/$mk_rss" | bc -l)"
  else
    ref_var="REF_$(echo "$m" | tr a-z A-Z)_S"
    ref_s=${!ref_var:-}
    if [ -z "$ref_s" ]; then
      rm -rf "$DATA/out-ref"
      ref_out=$(nice -n 10 "$PY" benches/spectral_ref.py merge "$m" "$DATA/base" "$DATA/out-ref" \
        "$DATA/task_a" "$DATA/task_b" ${REF_ONLY:+--only "$REF_ONLY"} 2>"$DATA/ref.$m.log")
      ref_s=${ref_out%% *}; ref_note=${ref_out#"$ref_s"}
      acc=$("$PY" benches/spectral_ref.py compare "$DATA/base" "$DATA/out-sm" "$DATA/out-ref")
    else
      ref_note=" (reused)"; acc="(reference time reused; accuracy not rechecked)"
    fi
    printf '%-16s %10s %9.2f %12s%s\n' "$m" torch-ref "$ref_s" "" "$ref_note"
    printf '%-16s %10s %9.2f %12.2f   %6.1fx faster; max relative error %s\n' "" sinkmerge "$sm_s" \
      "$(echo "$sm_rss/1048576" | bc -l)" "$(echo "$ref_s/$sm_s" | bc -l)" "$acc"
  fi
done
[ "${KEEP:-0}" = 1 ] || rm -rf "$DATA"
