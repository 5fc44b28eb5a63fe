#!/usr/bin/env python3
"""Check that a Hugging Face cache filled by sinkmerge's downloader loads in transformers offline.

    SINKMERGE_KEEP_HUB_CACHE=/tmp/hub-cache cargo test --test tests hub::a_fresh_download
    tools/.venv/bin/python tools/check_hub_cache.py /tmp/hub-cache test-org/tiny-qwen2

The test downloads `test-org/tiny-qwen2` from its local Hub server and copies the cache there;
this script loads the model and its tokenizer with `local_files_only=True` (no network) and runs
one forward pass.
"""
import os
import sys
from pathlib import Path

cache, repo = Path(sys.argv[1]), sys.argv[2]
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = str(cache)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

model = AutoModelForCausalLM.from_pretrained(repo, local_files_only=True, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(repo, local_files_only=True)
commit = (cache / f"models--{repo.replace('/', '--')}" / "refs" / "main").read_text().strip()
ids = tok("Write one sentence.", return_tensors="pt")
with torch.no_grad():
    logits = model(**ids).logits
print(f"{repo}: loaded offline from {cache} (refs/main = {commit}); "
      f"{sum(p.numel() for p in model.parameters())} parameters, logits {tuple(logits.shape)}, "
      f"finite: {bool(torch.isfinite(logits).all())}")
