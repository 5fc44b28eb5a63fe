#!/usr/bin/env python3
"""A perturbed target of the OLMo-3 sliding-window score fixture, for `sinkmerge heads` (tools/heads_ref.py).

    tools/.venv/bin/python tools/gen_heads_fixtures.py

Reads tests/fixtures/score/models/olmo3_sw (layerwise q_norm [heads*head_dim] / k_norm [kv*head_dim], bf16) and
writes tests/fixtures/heads/models/olmo3_sw_drift: the same config and tokenizer, and weights where only the
attention changes, head by head, by amounts spread over more than a decade so that the per-head drifts have
distinct ranks:
  q_proj rows of head h, o_proj columns of head h, q_norm's slice of head h: + s * std(tensor) * N(0, 1);
  k_proj / v_proj rows of KV head j, k_norm's slice of KV head j: likewise, one s per (tensor, head);
  s = 10^U(-1.5, -0.3), drawn per layer, tensor and head in that order from numpy's default_rng(SEED).
Everything else is copied unchanged. The noise is drawn in float64, added to the stored values in float64 and
rounded once to the stored dtype (bf16), so reruns write byte-identical files.
"""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "fixtures" / "score" / "models" / "olmo3_sw"
TARGET = ROOT / "tests" / "fixtures" / "heads" / "models" / "olmo3_sw_drift"
SEED = 20240611
COPIED = ["config.json", "tokenizer.json", "tokenizer_config.json"]


def perturb(weights, cfg, rng):
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    out = dict(weights)
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{layer}.self_attn."
        # (tensor, number of groups, slice of group g)
        plan = [
            ("q_proj.weight", heads, lambda g: (slice(g * d, (g + 1) * d), slice(None))),
            ("k_proj.weight", kv, lambda g: (slice(g * d, (g + 1) * d), slice(None))),
            ("v_proj.weight", kv, lambda g: (slice(g * d, (g + 1) * d), slice(None))),
            ("o_proj.weight", heads, lambda g: (slice(None), slice(g * d, (g + 1) * d))),
            ("q_norm.weight", heads, lambda g: (slice(g * d, (g + 1) * d),)),
            ("k_norm.weight", kv, lambda g: (slice(g * d, (g + 1) * d),)),
        ]
        for name, groups, index in plan:
            stored = weights[pre + name]
            w = stored.double().numpy().copy()
            std = float(w.std())
            for g in range(groups):
                s = 10.0 ** rng.uniform(-1.5, -0.3)
                view = w[index(g)]
                w[index(g)] = view + s * std * rng.standard_normal(view.shape)
            out[pre + name] = torch.from_numpy(w).to(stored.dtype).contiguous()
    return out


def main():
    cfg = json.loads((SOURCE / "config.json").read_text())
    weights = load_file(str(SOURCE / "model.safetensors"))
    rng = np.random.default_rng(SEED)
    new = perturb(weights, cfg, rng)
    TARGET.mkdir(parents=True, exist_ok=True)
    for f in COPIED:
        shutil.copyfile(SOURCE / f, TARGET / f)
    save_file({k: new[k] for k in sorted(new)}, str(TARGET / "model.safetensors"), metadata={"format": "pt"})
    changed = sorted(k for k in new if not torch.equal(new[k], weights[k]))
    size = sum(p.stat().st_size for p in TARGET.iterdir())
    print(f"{TARGET.relative_to(ROOT)}: {len(changed)} of {len(new)} tensors changed, {size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
