#!/usr/bin/env python3
"""The Python peer of `sinkmerge generate` for benches/generate_vs_transformers.sh: transformers' greedy generate.

Loads MODEL with transformers (AutoModelForCausalLM, eager attention, float32), reads the prompt's token ids
from IDS (a JSON list of ints, as `sinkmerge generate --prompt-ids` takes them) and generates exactly N new
tokens greedily with the KV cache (`generate(do_sample=False, max_new_tokens=N, min_new_tokens=N,
eos_token_id=None)`: the end-of-sequence stop is off, as with `sinkmerge generate --ignore-eos`).

    "${PYTHON:-python3}" benches/generate_transformers.py MODEL IDS [--max-new-tokens 128]

Threads: torch.set_num_threads($THREADS), default all cores (os.cpu_count()).

What is timed, after one untimed warm-up forward of the whole prompt (torch's first call sets up its kernels,
thread pool and buffers):
  prefill_s   a separate forward of the whole prompt with use_cache=True and logits_to_keep=1 (what generate's
              first step runs: the LM head on the last position only)
  decode_s    inside generate: from the first step's logits (after its prefill) to the last step's, stamped by a
              logits processor that changes nothing; the N-1 decode forwards and their token picks
  generate_s  the whole generate call; decode_s_by_subtraction = generate_s - prefill_s, the cruder estimate
              (it also holds generate's own set-up), printed for comparison
decode_tokens_per_s = (N - 1) / decode_s, as sinkmerge counts it (the tokens after the first).
Prints one JSON line: {"tool", "prompt_ids", "generated_ids", "steps", "timings": {...}, "load_s", "threads",
"torch", "transformers"}.
"""
import argparse
import json
import os
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()


class Stamp(LogitsProcessor):
    """Records when each step's logits reach the processors (after that step's forward); returns them as is."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("ids", help="JSON file: a list of token ids")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args()
    n = a.max_new_tokens
    if n < 2:
        ap.error("--max-new-tokens must be at least 2 (decode tokens/s counts the tokens after the first)")
    threads = int(os.environ.get("THREADS") or 0) or os.cpu_count()
    torch.set_num_threads(threads)

    ids = json.load(open(a.ids, encoding="utf-8"))
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise SystemExit(f"{a.ids}: not a non-empty JSON list of token ids")

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="eager").eval()
    load_s = time.perf_counter() - t0
    input_ids = torch.tensor([ids], dtype=torch.long)
    attention_mask = torch.ones_like(input_ids)

    with torch.inference_mode():
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1)  # warm-up, untimed

        t0 = time.perf_counter()
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - t0

        stamp = Stamp()
        t0 = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
                             logits_processor=LogitsProcessorList([stamp]))
        generate_s = time.perf_counter() - t0

    generated = out[0, len(ids):].tolist()
    assert len(generated) == n, (len(generated), n)
    assert len(stamp.times) == n, (len(stamp.times), n)
    decode_s = stamp.times[-1] - stamp.times[0]
    print(json.dumps({
        "tool": "transformers",
        "prompt_ids": ids,
        "generated_ids": generated,
        "steps": n,
        "stop_reason": "max_new_tokens",
        "timings": {
            "prefill_s": prefill_s,
            "prefill_tokens": len(ids),
            "prefill_tokens_per_s": len(ids) / prefill_s,
            "decode_s": decode_s,
            "decode_tokens": n - 1,
            "decode_tokens_per_s": (n - 1) / decode_s,
            "generate_s": generate_s,
            "first_step_in_generate_s": stamp.times[0] - t0,
            "decode_s_by_subtraction": generate_s - prefill_s,
        },
        "load_s": load_s,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }))


if __name__ == "__main__":
    main()
