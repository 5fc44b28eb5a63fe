#!/usr/bin/env python3
"""Independent reference of `sinkmerge heads`: per-head sink metrics and per-head weight drift of a pair.

The sink metrics come from tools/sink_metrics_ref.py (transformers' eager attention scores, numpy in float64;
nothing shared with the Rust code); this script keeps them per (layer, head) instead of pooling them, and adds
the weight drift of the head's slices of q/k/v/o_proj (and of q_norm/k_norm), from the stored tensors.

    # one pair (JSON on stdout)
    tools/.venv/bin/python tools/heads_ref.py REF TARGET [--last 10] [--prompts FILE]

    # regenerate the committed goldens (tests/fixtures/heads/*.json)
    nice -n 10 tools/.venv/bin/python tools/heads_ref.py --goldens

Per (layer, head) h of the window (the last K layers, all of them if fewer), over every prompt (raw text,
special tokens added, no chat template), with sink positions chosen by column mass (sink_metrics_ref.py's
definitions, `score`'s defaults):
  g_base_median   numpy median of the REF head's G observations (its valid queries of every prompt)
  g_target_median the same for TARGET;  delta_g = g_target_median - g_base_median
  b_gap_median    median of B of TARGET against REF: one B per valid query of the REF head (REF's sink)
  margin          g_base_median - b_gap_median
  pos0_before     mean of A[q,0] over the REF head's valid observations; pos0_after: TARGET's own
  n_observations  number of G observations of the TARGET head; n_b_observations: of B (= the REF head's)
  kv_head         head // (num_heads // num_kv_heads)
Drift, dW = TARGET - REF in float64 from the stored values (d = head_dim):
  q: rows [h*d, (h+1)*d) of self_attn.q_proj.weight (out x in);  k, v: rows [kv*d, (kv+1)*d) of k_proj / v_proj;
  o: columns [h*d, (h+1)*d) of o_proj.weight.
  fro = ||dW||_F, op = largest singular value of dW, rel_fro = fro / ||W_ref||_F, rel_op = op / ||W_ref||_2
  (null where the REF norm is 0).
  q_norm / k_norm (null without self_attn.q_norm.weight / k_norm.weight): l2 = ||d gamma||_2,
  linf = max |d gamma|, rel_l2 = l2 / ||gamma_ref||_2, over the whole vector for per-head norms (shape [head_dim],
  Qwen3) and over the head's slice (q, [num_heads*d]) or its KV head's slice (k, [num_kv_heads*d]) for layerwise
  norms (OLMo-2/3).
Correlations across the window's heads: Spearman's rho (Pearson's r of average ranks, ties averaged) of each
sink measure in {delta_g, margin} with each drift measure in {q,k,v,o} x {fro,op,rel_fro,rel_op}, over the heads
where both are non-null; null for fewer than 2 such heads or a constant measure.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sink_metrics_ref as smr  # noqa: E402

ROOT = smr.ROOT
SINK = ["delta_g", "margin"]
PROJ = ["q", "k", "v", "o"]
MEASURES = ["fro", "op", "rel_fro", "rel_op"]


def rel(path):
    """A path relative to the repository root where it lies inside it, else as given."""
    p = Path(path).resolve()
    try:
        return p.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def text_config(path):
    cfg = json.loads((Path(path) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def load_weights(path):
    """Every tensor of a checkpoint's *.safetensors files, as stored."""
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def attn_tensor(weights, layer, name):
    """self_attn.<name> of `layer`: model.layers.L.self_attn.<name>, or the one key ending so (VLM prefixes)."""
    key = f"model.layers.{layer}.self_attn.{name}"
    if key in weights:
        return weights[key].double().numpy()
    tail = f"layers.{layer}.self_attn.{name}"
    hits = [k for k in weights if k.endswith("." + tail) or k == tail]
    if len(hits) > 1:
        raise SystemExit(f"several tensors end in {tail}: {hits}")
    return weights[hits[0]].double().numpy() if hits else None


def ratio(num, den):
    return None if den == 0 else float(num / den)


def matrix_drift(w_ref, w_tgt):
    dw = w_tgt - w_ref
    fro = float(np.linalg.norm(dw))
    op = float(np.linalg.svd(dw, compute_uv=False)[0])
    ref_fro = float(np.linalg.norm(w_ref))
    ref_op = float(np.linalg.svd(w_ref, compute_uv=False)[0])
    return {"fro": fro, "op": op, "rel_fro": ratio(fro, ref_fro), "rel_op": ratio(op, ref_op)}


def vector_drift(g_ref, g_tgt):
    d = g_tgt - g_ref
    l2 = float(np.linalg.norm(d))
    return {"l2": l2, "linf": float(np.max(np.abs(d))), "rel_l2": ratio(l2, float(np.linalg.norm(g_ref)))}


def head_drift(ref_w, tgt_w, layer, head, kv, d):
    out = {}
    for p in PROJ:
        a = attn_tensor(ref_w, layer, f"{p}_proj.weight")
        b = attn_tensor(tgt_w, layer, f"{p}_proj.weight")
        if p == "o":
            sl = (slice(None), slice(head * d, (head + 1) * d))
        else:
            g = head if p == "q" else kv
            sl = (slice(g * d, (g + 1) * d), slice(None))
        out[p] = matrix_drift(a[sl], b[sl])
    for p, g in (("q", head), ("k", kv)):
        a = attn_tensor(ref_w, layer, f"{p}_norm.weight")
        b = attn_tensor(tgt_w, layer, f"{p}_norm.weight")
        if a is None or b is None:
            out[f"{p}_norm"] = None
            continue
        if a.shape[0] != d:  # layerwise: [groups * head_dim], the head's (KV head's) slice
            a, b = a[g * d:(g + 1) * d], b[g * d:(g + 1) * d]
        out[f"{p}_norm"] = vector_drift(a, b)
    return out


def average_ranks(x):
    """Ranks 1..n, ties given the mean of their positions (scipy.stats.rankdata's 'average')."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and x[order[j + 1]] == x[order[i]]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(a, b):
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if len(pairs) < 2:
        return None, len(pairs)
    ra = average_ranks([p[0] for p in pairs])
    rb = average_ranks([p[1] for p in pairs])
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = np.sqrt(np.sum(ra * ra) * np.sum(rb * rb))
    return (None if den == 0 else float(np.sum(ra * rb) / den)), len(pairs)


def forward(ref, target, prompts):
    """Both models' captured scores on the same token ids (REF's tokenizer and TARGET's must agree)."""
    smr.install_capture()
    tokens = smr.tokenize(ref, prompts, False)
    if smr.tokenize(target, prompts, False) != tokens:
        raise SystemExit("REF and TARGET tokenize the prompts differently")
    ref_data, n_ref, _ = smr.run(ref, tokens)
    tgt_data, n_tgt, _ = smr.run(target, tokens)
    if n_ref != n_tgt:
        raise SystemExit(f"REF has {n_ref} layers, TARGET {n_tgt}")
    return ref_data, tgt_data, n_ref


def median(v):
    return smr.fin(np.median(v)) if v else None


def mean(v):
    return smr.fin(np.mean(v)) if v else None


def diff(a, b):
    return None if a is None or b is None else smr.fin(a - b)


def heads_report(ref, target, runs, last, prompts_source, n_prompts):
    ref_data, tgt_data, n_layers = runs
    cfg = text_config(ref)
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    group = heads // kv_heads
    ref_w, tgt_w = load_weights(ref), load_weights(target)
    start = max(0, n_layers - last)
    records = []
    for layer in range(start, n_layers):
        for h in range(heads):
            g_r, g_t, p_r, p_t, b = [], [], [], [], []
            for (sr, vis_r), (st, vis_t) in zip(ref_data[layer], tgt_data[layer]):
                obs_r = smr.head_observations(sr[h], vis_r, "column")
                obs_t = smr.head_observations(st[h], vis_t, "column")
                g_r += [o[2] for o in obs_r]
                p_r += [o[3] for o in obs_r]
                g_t += [o[2] for o in obs_t]
                p_t += [o[3] for o in obs_t]
                b += smr.head_gap_perturbation(sr[h], st[h], vis_r, obs_r)
            g_base, g_tgt, b_med = median(g_r), median(g_t), median(b)
            kv = h // group
            records.append({
                "layer": layer, "head": h, "kv_head": kv,
                "g_base_median": g_base, "g_target_median": g_tgt, "delta_g": diff(g_tgt, g_base),
                "b_gap_median": b_med, "margin": diff(g_base, b_med),
                "pos0_before": mean(p_r), "pos0_after": mean(p_t),
                "n_observations": len(g_t), "n_b_observations": len(b),
                "drift": head_drift(ref_w, tgt_w, layer, h, kv, d),
            })
    correlations = []
    for s in SINK:
        for p in PROJ:
            for m in MEASURES:
                rho, n = spearman([r[s] for r in records], [r["drift"][p][m] for r in records])
                correlations.append({"sink": s, "drift": f"{p}.{m}", "spearman": rho, "n_heads": n})
    q_norm = attn_tensor(ref_w, start, "q_norm.weight")
    settings = {
        "ref": rel(ref), "target": rel(target), "last": last, "window": [start, n_layers - 1],
        "prompts": prompts_source, "n_prompts": n_prompts, "chat_template": False, "sink_position": "column",
        "num_layers": n_layers, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": d,
        "qk_norm": None if q_norm is None else ("per-head" if q_norm.shape[0] == d else "layerwise"),
        "transformers": smr.transformers.__version__, "torch": torch.__version__,
    }
    return {"heads": records, "correlations": correlations, "settings": settings}


DEFAULT_PROMPTS = "assets/prompts/default.txt"
# name -> (REF, TARGET, --last), paths relative to the repository root.
GOLDENS = {
    "tiny_qwen3": ("assets/models/tiny-qwen3/ref", "assets/models/tiny-qwen3/vl", 10),
    "tiny_qwen3_last2": ("assets/models/tiny-qwen3/ref", "assets/models/tiny-qwen3/vl", 2),
    "tiny_qwen2": ("assets/models/tiny-qwen2/ref", "assets/models/tiny-qwen2/vl", 10),
    "olmo3_sw_drift": ("tests/fixtures/score/models/olmo3_sw", "tests/fixtures/heads/models/olmo3_sw_drift", 10),
}


def write_goldens():
    out_dir = ROOT / "tests" / "fixtures" / "heads"
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = smr.read_prompts(ROOT / DEFAULT_PROMPTS)
    runs = {}
    for name, (ref, target, last) in GOLDENS.items():
        if (ref, target) not in runs:
            runs[(ref, target)] = forward(str(ROOT / ref), str(ROOT / target), prompts)
        rep = heads_report(str(ROOT / ref), str(ROOT / target), runs[(ref, target)], last, DEFAULT_PROMPTS,
                           len(prompts))
        rep["cli"] = [ref, target, "--last", str(last), "--prompts", DEFAULT_PROMPTS]
        (out_dir / f"{name}.json").write_text(json.dumps(rep, indent=1, sort_keys=True) + "\n")
        top = max((c for c in rep["correlations"] if c["spearman"] is not None), key=lambda c: abs(c["spearman"]))
        print(f"{name}: {len(rep['heads'])} heads, window {rep['settings']['window']}; strongest "
              f"rho({top['sink']}, {top['drift']}) = {top['spearman']:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ref", nargs="?")
    ap.add_argument("target", nargs="?")
    ap.add_argument("--last", type=int, default=10)
    ap.add_argument("--prompts", default=str(ROOT / DEFAULT_PROMPTS))
    ap.add_argument("--goldens", action="store_true", help="regenerate tests/fixtures/heads/*.json")
    a = ap.parse_args()
    if a.goldens:
        write_goldens()
        return 0
    if not (a.ref and a.target):
        ap.error("give REF and TARGET (or --goldens)")
    prompts = smr.read_prompts(a.prompts)
    rep = heads_report(a.ref, a.target, forward(a.ref, a.target, prompts), a.last, rel(a.prompts), len(prompts))
    print(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
