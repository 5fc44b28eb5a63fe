#!/bin/bash
# `score --json` of the bundled pairs and of every architecture fixture, byte for byte, from two
# builds: checks that a change to the forward pass left text-only scoring as it was.
old=${1:?usage: benches/text_only_unchanged.sh OLD_BINARY NEW_BINARY}; new=${2:?NEW_BINARY}
cd "$(dirname "$0")/.."
source benches/machine.sh
n=0; bad=0
run() { "$@" --json 2>&1; }
for pair in tiny-qwen3 tiny-qwen2; do
  a=$(run $old score --ref assets/models/$pair/ref assets/models/$pair/vl); b=$(run $new score --ref assets/models/$pair/ref assets/models/$pair/vl)
  n=$((n+1)); [ "$a" == "$b" ] || { bad=$((bad+1)); echo "DIFF $pair"; }
done
for d in tests/fixtures/models/* tests/fixtures/score/models/*; do
  [ -f $d/config.json ] || continue
  a=$(run $old score $d); b=$(run $new score $d)
  n=$((n+1)); [ "$a" == "$b" ] || { bad=$((bad+1)); echo "DIFF $d"; diff <(echo "$a") <(echo "$b") | head -5; }
done
echo "compared $n, differing $bad"
[ "$bad" -eq 0 ]
