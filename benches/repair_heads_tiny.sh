#!/usr/bin/env bash
# Top-K against random-K head repair on the bundled tiny pairs: for K = 1, 2, 4, repair the K most
# damaged heads (lowest ΔG, `sinkmerge heads`' ranking) and K random heads (seeds 0, 1, 2) of the
# VL-adapted model toward its reference (--modules q,k, lambda 1, all 6 layers as candidates), then
# score each output against the reference: S, the margin, and perplexity on assets/text/sample.txt.
# Prints one table per pair; the random rows give the mean and the range over the seeds.
#
#   benches/repair_heads_tiny.sh [tiny-qwen3 tiny-qwen2]     # release build
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/machine.sh
cargo build -q --release --bin sinkmerge
SM=target/release/sinkmerge
TEXT=assets/text/sample.txt
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PAIRS=("$@")
[ ${#PAIRS[@]} -gt 0 ] || PAIRS=(tiny-qwen3 tiny-qwen2)

# metrics MODEL...: "S margin perplexity" of each model against the reference, one line each
metrics() {
  "$SM" score --ref "$REF" "$@" --text "$TEXT" --json | python3 -c '
import json, sys
r = json.load(sys.stdin)
for m, p in zip(r["models"][1:], r["pairs"]):
    print(m["sink_strength"], p["margin"], m["text"]["perplexity"])'
}

for pair in "${PAIRS[@]}"; do
  REF=assets/models/$pair/ref; VL=assets/models/$pair/vl
  echo "== $pair: repair toward $REF (--modules q,k, lambda 1)"
  read -r ref_s _ ref_ppl <<<"$("$SM" score "$REF" --text "$TEXT" --json | python3 -c '
import json, sys
m = json.load(sys.stdin)["models"][0]
print(m["sink_strength"], 0, m["text"]["perplexity"])')"
  printf '%-22s %8s %8s %10s\n' model S margin perplexity
  printf '%-22s %8.4f %8s %10.3f\n' "reference" "$ref_s" "-" "$ref_ppl"
  read -r s m p <<<"$(metrics "$VL")"
  printf '%-22s %8.4f %8.4f %10.3f\n' "VL (unrepaired)" "$s" "$m" "$p"
  for k in 1 2 4; do
    outs=()
    "$SM" repair-heads --ref "$REF" "$VL" --heads "top:$k" --last 6 -o "$WORK/top$k" --quiet >/dev/null
    for seed in 0 1 2; do
      "$SM" repair-heads --ref "$REF" "$VL" --heads "random:$k" --seed "$seed" --last 6 \
        -o "$WORK/rand$k-$seed" --quiet >/dev/null
      outs+=("$WORK/rand$k-$seed")
    done
    read -r s m p <<<"$(metrics "$WORK/top$k")"
    printf '%-22s %8.4f %8.4f %10.3f   heads %s\n' "top:$k" "$s" "$m" "$p" \
      "$(awk '/^heads:/{f=1;next} /^[a-z]/{f=0} f{gsub(/[-'"'"' ]/,""); printf "%s ", $0}' "$WORK/top$k/sinkmerge_config.yml")"
    metrics "${outs[@]}" | awk -v k="$k" '
      {s[NR]=$1; m[NR]=$2; p[NR]=$3}
      END {
        for (i = 1; i <= NR; i++) {ss += s[i]; mm += m[i]; pp += p[i]}
        smin = s[1]; smax = s[1]; mmin = m[1]; mmax = m[1]; pmin = p[1]; pmax = p[1]
        for (i = 2; i <= NR; i++) {
          if (s[i] < smin) smin = s[i]; if (s[i] > smax) smax = s[i]
          if (m[i] < mmin) mmin = m[i]; if (m[i] > mmax) mmax = m[i]
          if (p[i] < pmin) pmin = p[i]; if (p[i] > pmax) pmax = p[i]
        }
        printf "%-22s %8.4f %8.4f %10.3f   ranges S [%.4f, %.4f] margin [%.4f, %.4f] ppl [%.3f, %.3f]\n",
          "random:" k " (3 seeds)", ss / NR, mm / NR, pp / NR, smin, smax, mmin, mmax, pmin, pmax
      }'
    rm -rf "$WORK"/top$k "$WORK"/rand$k-*
  done
  echo
done
