#!/bin/bash
# Every forward-pass output of two builds, byte for byte: checks that a change to the forward
# pass's structure left its numbers as they were. `score --json` of the bundled pairs and every
# architecture fixture (benches/text_only_unchanged.sh); `trace` of every VLM golden case (the
# safetensors files whole: tensors and metadata), with images and with the processor's pixels;
# `visual-sinks --json` of every reference case; and the bundled `reproduce` run (summary.json,
# report.html and every step's report.json but for its wall time).
#
#   benches/outputs_unchanged.sh OLD_BINARY NEW_BINARY
set -uo pipefail
old=$(realpath "${1:?usage: benches/outputs_unchanged.sh OLD_BINARY NEW_BINARY}")
new=$(realpath "${2:?NEW_BINARY}")
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
n=0; bad=0
same() { n=$((n+1)); if ! cmp -s "$2" "$3"; then bad=$((bad+1)); echo "DIFF $1"; fi; }

benches/text_only_unchanged.sh "$old" "$new" || bad=$((bad+1))

# trace: each case of tests/fixtures/vlm/cases.json, from its images
python3 - >"$work/trace_cases" <<'EOF'
import json
for c in json.load(open("tests/fixtures/vlm/cases.json"))["cases"]:
    args = [c["model"], "--prompt", c["prompt"]]
    for image in c["images"]:
        args += ["--image", image]
    if c["chat_template"]:
        args.append("--chat")
    print(c["name"].replace("/", "_") + "\t" + "\t".join(args))
EOF
while IFS=$'\t' read -r name args; do
  IFS=$'\t' read -r -a argv <<<"$args"
  # One output path for both, since the report names it.
  for side in old new; do
    bin=$old; [ $side = new ] && bin=$new
    "$bin" trace "${argv[@]}" -o "$work/trace.safetensors" -q >"$work/$name.$side.out" 2>&1
    mv "$work/trace.safetensors" "$work/$name.$side.safetensors"
  done
  same "trace $name" "$work/$name.old.safetensors" "$work/$name.new.safetensors"
  same "trace $name (stdout)" "$work/$name.old.out" "$work/$name.new.out"
done <"$work/trace_cases"

# visual-sinks: each reference case of tests/fixtures/visual_sinks/cases.json
python3 - >"$work/vs_cases" <<'EOF'
import json
for c in json.load(open("tests/fixtures/visual_sinks/cases.json"))["cases"]:
    print(c["name"] + "\t" + "\t".join([c["model"]] + c["args"]))
EOF
while IFS=$'\t' read -r name args; do
  IFS=$'\t' read -r -a argv <<<"$args"
  "$old" visual-sinks "${argv[@]}" --json >"$work/vs.$name.old" 2>&1
  "$new" visual-sinks "${argv[@]}" --json >"$work/vs.$name.new" 2>&1
  same "visual-sinks $name" "$work/vs.$name.old" "$work/vs.$name.new"
done <"$work/vs_cases"

# reproduce: the bundled pair, as README.md runs it
for side in old new; do
  bin=$old; [ $side = new ] && bin=$new
  "$bin" reproduce --ref assets/models/tiny-qwen3/ref --vlm assets/models/tiny-qwen3/vlm \
    -o "$work/repro" -q >"$work/repro.$side.out" 2>&1 || echo "reproduce failed ($side)"
  mv "$work/repro" "$work/repro.$side"
done
same "reproduce (stdout)" "$work/repro.old.out" "$work/repro.new.out"
for f in summary.json report.html; do
  same "reproduce $f" "$work/repro.old/$f" "$work/repro.new/$f"
done
# A step's report.json also holds the wall time it took (`seconds`), which is left out.
timeless() { python3 -c 'import json, sys
def drop(v):
    if isinstance(v, dict):
        return {k: drop(x) for k, x in v.items() if k != "seconds"}
    return [drop(x) for x in v] if isinstance(v, list) else v
print(json.dumps(drop(json.load(open(sys.argv[1]))), indent=1))' "$1"; }
for f in $(cd "$work/repro.old" && find . -name report.json | sort); do
  timeless "$work/repro.old/$f" >"$work/a.json"; timeless "$work/repro.new/$f" >"$work/b.json"
  same "reproduce $f (less seconds)" "$work/a.json" "$work/b.json"
done

echo "compared $n more outputs beside score's, differing $bad"
[ "$bad" -eq 0 ]
