#!/usr/bin/env python3
"""Check that every merge method's output, and repair-heads' outputs, load with transformers and run.

Run by hand from the repository root after `cargo build` (documented in docs/reference/merges.md, "Goldens and tools"):

    nice -n 10 tools/.venv/bin/python tools/check_merge_loads.py [target/debug/sinkmerge]

For each method it merges the fixtures of tests/fixtures/merge/models with the sinkmerge binary,
once keeping the dtype and once with --out-dtype bfloat16, then loads the result with
AutoModelForCausalLM.from_pretrained (no missing or unexpected keys allowed) and
AutoTokenizer.from_pretrained, runs a forward pass on a chat-templated prompt and checks the
logits are finite. Prints one line per output; exits non-zero on any failure.
"""
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

transformers.logging.set_verbosity_error()

ROOT = Path(__file__).resolve().parent.parent
M = "tests/fixtures/merge/models"
RUNS = {
    "linear": ["linear", "--models", f"{M}/task_a", f"{M}/task_b", "--weights", "0.95,0.05"],
    "task-arithmetic": ["task-arithmetic", "--base", f"{M}/base", "--models", f"{M}/task_a", f"{M}/task_b"],
    "ties": ["ties", "--base", f"{M}/base", "--models", f"{M}/task_a", f"{M}/task_b", "--density", "0.2"],
    "dare-linear": ["dare", "--base", f"{M}/base", "--models", f"{M}/task_a", f"{M}/task_b", "--drop-rate", "0.9"],
    "dare-ties": ["dare", "--base", f"{M}/base", "--models", f"{M}/task_a", f"{M}/task_c",
                  "--drop-rate", "0.9", "--consensus", "ties"],
    "tsv": ["tsv", "--base", f"{M}/base", "--models", f"{M}/task_a", f"{M}/task_b"],
    "star": ["star", "--base", f"{M}/base", "--models", f"{M}/task_a", f"{M}/task_c", "--eta", "40"],
    "merge-yaml": ["merge", "tests/fixtures/merge/configs/ties_options.yml"],
}
# Head repair keeps the target's dtypes (no --out-dtype).
A = "assets/models"
REPAIRS = {
    "repair-heads top:2": ["repair-heads", "--ref", f"{A}/tiny-qwen3/ref", f"{A}/tiny-qwen3/vl", "--heads", "top:2",
                           "--modules", "q,k,v,o"],
    "repair-heads random:3": ["repair-heads", "--ref", f"{A}/tiny-qwen2/ref", f"{A}/tiny-qwen2/vl", "--heads",
                              "random:3", "--seed", "1", "--lambda", "0.5"],
    "repair-heads list": ["repair-heads", "--ref", f"{M}/base", f"{M}/task_a", "--heads", "0.1,2.0"],
}


def check(binary, name, args, out, extra):
    subprocess.run([binary, *args, "-o", str(out), "--quiet", *extra], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
    assert not problems and not info.get("error_msgs"), f"{name}: {info}"
    tok = AutoTokenizer.from_pretrained(str(out))
    text = tok.apply_chat_template([{"role": "user", "content": "merge me"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all(), f"{name}: non-finite logits"
    return f"{type(model).__name__} {str(model.dtype).replace('torch.', '')}, {ids.shape[1]} tokens, logits {tuple(logits.shape)}"


def main():
    binary = str(ROOT / (sys.argv[1] if len(sys.argv) > 1 else "target/debug/sinkmerge"))
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(n, a, e) for n, a in RUNS.items() for e in ([], ["--out-dtype", "bfloat16"])]
        runs += [(n, a, []) for n, a in REPAIRS.items()]
        for i, (name, args, extra) in enumerate(runs):
            label = name + (" --out-dtype bfloat16" if extra else "")
            try:
                print(f"ok   {label}: {check(binary, name, args, Path(tmp) / str(i), extra)}")
            except Exception as e:  # report every method, then fail
                failures += 1
                print(f"FAIL {label}: {e}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
