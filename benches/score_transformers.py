#!/usr/bin/env python3
"""The Python peer of `sinkmerge score` for benches/score_vs_transformers.sh: what a researcher runs today.

Loads MODEL with transformers (eager attention, float32), tokenizes the prompt file with AutoTokenizer and runs
each prompt through the model with output_attentions=True (no cache, batch of one), keeping each layer's
attention on the sink column only (P[..., 0]) so memory stays bounded. It loads the decoder without its LM head
(AutoModel), as the scorer needs no logits, and it does not compute the metrics, so its time is a lower bound for
a transformers-based scorer.

    "${PYTHON:-python3}" benches/score_transformers.py MODEL PROMPTS [--threads N]
Prints one line: load seconds, forward seconds, tokens.
"""
import argparse
import time

import torch
import transformers
from transformers import AutoModel, AutoTokenizer

transformers.logging.set_verbosity_error()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("prompts")
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModel.from_pretrained(a.model, attn_implementation="eager", dtype=torch.float32).eval()
    t1 = time.perf_counter()
    prompts = [line for line in open(a.prompts, encoding="utf-8").read().splitlines() if line.strip()]
    tokens = 0
    sink_mass = 0.0
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, add_special_tokens=True)["input_ids"]
            tokens += len(ids)
            out = model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
            sink_mass += sum(float(att[0, :, :, 0].sum()) for att in out.attentions)
    t2 = time.perf_counter()
    print(f"load {t1 - t0:.2f} s, forward {t2 - t1:.2f} s, {len(prompts)} prompts, {tokens} tokens, "
          f"torch threads {torch.get_num_threads()}, checksum {sink_mass:.3f}")


if __name__ == "__main__":
    main()
