#!/usr/bin/env python3
"""Per-head sink statistics on shared scores: the per-head half of tools/heads_ref.py, computed from the
float32 attention scores that tools/paper_metrics_ref.py --replay-golden dumped from transformers
(tests/fixtures/score/paper/replay/{ref,vl}.scores.bin, tiny-qwen3 ref and vl on the first 5 default prompts).

The Rust test feeds the same dumped scores to sinkmerge's per-head accumulators, so both sides see identical
scores and any difference is in the metric code alone (the through-the-forward goldens of heads_ref.py also
carry the two forward passes' float32 rounding, about 5e-6 in G).

    tools/.venv/bin/python tools/heads_replay_ref.py     # writes tests/fixtures/heads/replay_heads.json

G, pos0, the valid queries and B are sink_metrics_ref.py's head_observations and head_gap_perturbation, with the
causal mask; medians are numpy.median, means numpy.mean; every prompt and layer (the window is all 6 layers).
"""
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
# Both import torch and transformers at module level; only their numpy functions are used here.
import sink_metrics_ref as smr  # noqa: E402
from paper_metrics_ref import replay_read  # noqa: E402  (the reader of the replay golden's dumps)

REPLAY = ROOT / "tests" / "fixtures" / "score" / "paper" / "replay"
OUT = ROOT / "tests" / "fixtures" / "heads" / "replay_heads.json"


def fin(x):
    return float(x) if np.isfinite(x) else None


def main():
    meta = json.loads((REPLAY / "replay.json").read_text())
    lengths = meta["prompts"]["lengths"]
    m0, m1 = meta["models"]
    n_layers, n_heads = m0["num_layers"], m0["num_heads"]
    ref = replay_read(REPLAY / m0["scores_file"], n_layers, n_heads, lengths)
    tgt = replay_read(REPLAY / m1["scores_file"], n_layers, n_heads, lengths)
    heads = []
    for layer in range(n_layers):
        for h in range(n_heads):
            g_r, g_t, p_r, p_t, b = [], [], [], [], []
            for pi, t in enumerate(lengths):
                visible = np.tril(np.ones((t, t), dtype=bool))
                sr, st = ref[layer][pi][h], tgt[layer][pi][h]
                obs_r = smr.head_observations(sr, visible, "column")
                obs_t = smr.head_observations(st, visible, "column")
                g_r += [o[2] for o in obs_r]
                p_r += [o[3] for o in obs_r]
                g_t += [o[2] for o in obs_t]
                p_t += [o[3] for o in obs_t]
                b += smr.head_gap_perturbation(sr, st, visible, obs_r)
            gb, gt, bm = np.median(g_r), np.median(g_t), np.median(b)
            heads.append({
                "layer": layer, "head": h, "g_base_median": fin(gb), "g_target_median": fin(gt),
                "delta_g": fin(gt - gb), "b_gap_median": fin(bm), "margin": fin(gb - bm),
                "pos0_before": fin(np.mean(p_r)), "pos0_after": fin(np.mean(p_t)), "n_observations": len(g_t),
            })
    out = {"heads": heads, "settings": {"scores": "tests/fixtures/score/paper/replay", "prompts": len(lengths),
                                        "lengths": lengths, "window": [0, n_layers - 1]}}
    OUT.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"{OUT.relative_to(ROOT)}: {len(heads)} heads")


if __name__ == "__main__":
    main()
