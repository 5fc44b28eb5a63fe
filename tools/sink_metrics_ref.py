#!/usr/bin/env python3
"""Independent reference of the sink metrics (docs/reference/sink-metrics.md) on transformers' eager attention.

Nothing here shares code with the Rust scorer: transformers 5.23 runs each model (eager attention, float32,
no cache, batch of one), the attention scores are captured inside transformers' own `eager_attention_forward`
(the product q·kᵀ·scaling and the additive mask, exactly as it computes them), and numpy computes the metrics
in float64 from those scores.

    # one report (JSON on stdout), same flags as `sinkmerge score`
    tools/.venv/bin/python tools/sink_metrics_ref.py --ref REF MODEL [--prompts FILE] [--last 10] \
        [--stat median|mean] [--sink-position column|per-query] [--chat-template]

    # regenerate the committed metric goldens (tests/fixtures/score/metrics/*.json)
    nice -n 10 tools/.venv/bin/python tools/sink_metrics_ref.py --goldens

Definitions (per prompt x, layer l, head h; s = scores after scaling, with the causal / sliding mask):
  p_sink = argmax_p sum_q A[q,p] (lowest index on ties), or per query argmax_p A[q,p] with --sink-position per-query
  valid queries: q >= max(1, p_sink) whose visible keys include p_sink
  G = s[q,ps] - logsumexp_{p visible, p != ps} s[q,p];  pos0 = A[q,0]
  B = max_{p visible, p != ps} |(sT[q,p] - sT[q,ps]) - (sR[q,p] - sR[q,ps])| at the reference's ps
  S = median (or mean) of G over the last K layers; medians as numpy.median.
  Theorem 1 ingredients (models with q_norm/k_norm): gamma_q_inf = max|q_norm.weight|, gamma_k_inf likewise;
  m_q = min over tokens of RMS(W x)/||x||_2 per norm group (per head for per-head norms, the whole projection
  for layerwise ones), x = the projection's input, W without bias. m_k likewise.
"""
import argparse
import importlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(1)

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

transformers.logging.set_verbosity_error()

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = ROOT / "assets" / "prompts" / "default.txt"
MODELING = ["qwen2", "qwen3", "llama", "mistral", "olmo2", "olmo3", "qwen3_moe", "olmoe"]

CAPTURED = []  # (layer_idx, scores [heads, T, T] float32, visible mask [T, T] bool)


def install_capture():
    """Wrap every supported architecture's eager_attention_forward to record its scores and mask."""
    for name in MODELING:
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        original = mod.eager_attention_forward
        if getattr(original, "_sink_capture", False):
            continue

        def wrapped(module, query, key, value, attention_mask, scaling, dropout=0.0, _orig=original, _mod=mod,
                    **kwargs):
            key_states = _mod.repeat_kv(key, module.num_key_value_groups)
            scores = torch.matmul(query, key_states.transpose(2, 3)) * scaling
            t = query.shape[2]
            if attention_mask is not None:
                visible = (attention_mask[0, 0, :, :t] == 0)
            else:
                visible = torch.ones(t, t, dtype=torch.bool).tril()
            CAPTURED.append((module.layer_idx, scores[0].detach().clone(), visible.clone()))
            return _orig(module, query, key, value, attention_mask, scaling, dropout, **kwargs)

        wrapped._sink_capture = True
        mod.eager_attention_forward = wrapped


def load_model(path):
    kw = {}
    cfg = transformers.AutoConfig.from_pretrained(path)
    if getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None):
        kw["experts_implementation"] = "eager"
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32, **kw).eval()


def tokenize(path, prompts, chat):
    tok = AutoTokenizer.from_pretrained(path)
    out = []
    for p in prompts:
        if chat:
            enc = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
            out.append(list(enc["input_ids"]))
        else:
            out.append(tok(p, add_special_tokens=True)["input_ids"])
    return out


def qk_hooks(model, store):
    """Record the inputs of q_proj / k_proj for the Theorem-1 ratios."""
    handles = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if not hasattr(attn, "q_norm"):
            continue
        for which in ("q", "k"):
            proj = getattr(attn, f"{which}_proj")

            def hook(mod, args, _i=i, _w=which):
                store.setdefault((_i, _w), []).append(args[0][0].detach().double())
            handles.append(proj.register_forward_pre_hook(hook))
    return handles


def run(path, token_lists):
    """Per layer: list over prompts of (scores float64 [H,T,T], visible [T,T]); plus the QK-norm inputs."""
    model = load_model(path)
    store = {}
    handles = qk_hooks(model, store)
    per_layer = {}
    for ids in token_lists:
        CAPTURED.clear()
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)
        for layer, scores, visible in CAPTURED:
            per_layer.setdefault(layer, []).append((scores.double().numpy(), visible.numpy()))
    for h in handles:
        h.remove()
    qk = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if not hasattr(attn, "q_norm"):
            continue
        entry = {}
        cfg = model.config
        hd = attn.head_dim
        per_head = attn.q_norm.weight.numel() == hd
        for which in ("q", "k"):
            w = getattr(attn, f"{which}_proj").weight.detach().double()
            x = torch.cat(store[(i, which)], dim=0)
            y = x @ w.T
            group = hd if per_head else y.shape[1]
            norms = x.norm(dim=1)
            keep = norms > 0
            rms = y[keep].reshape(int(keep.sum()), -1, group).pow(2).mean(-1).sqrt()
            entry[f"m_{which}"] = (rms / norms[keep, None]).min(dim=0).values.tolist()
            entry[f"gamma_{which}_inf"] = getattr(attn, f"{which}_norm").weight.detach().abs().max().item()
        qk[i] = entry
    return per_layer, model.config.num_hidden_layers, qk


def logsumexp(v):
    m = np.max(v)
    return m + np.log(np.sum(np.exp(v - m)))


def head_observations(s, visible, mode):
    """Valid queries, their sink positions, G and pos0 for one head: s [T,T] float64."""
    t = s.shape[0]
    probs = np.zeros_like(s)
    for q in range(t):
        keys = np.nonzero(visible[q])[0]
        lse = logsumexp(s[q, keys])
        probs[q, keys] = np.exp(s[q, keys] - lse)
    rows = []
    if mode == "column":
        sink = int(np.argmax(probs.sum(axis=0)))  # numpy argmax: first maximum
        for q in range(t):
            if q >= max(1, sink) and visible[q, sink]:
                rows.append((q, sink))
    else:
        for q in range(1, t):
            keys = np.nonzero(visible[q])[0]
            rows.append((q, int(keys[np.argmax(probs[q, keys])])))
    out = []
    for q, ps in rows:
        keys = np.nonzero(visible[q])[0]
        others = keys[keys != ps]
        g = s[q, ps] - logsumexp(s[q, others])
        pos0 = float(np.exp(s[q, 0] - logsumexp(s[q, keys]))) if visible[q, 0] else 0.0
        out.append((q, ps, g, pos0))
    return out


def mode_of(values):
    if not values:
        return None
    vals, counts = np.unique(np.array(values), return_counts=True)
    return int(vals[np.argmax(counts)])  # np.unique sorts, argmax takes the first: lowest on ties


def fin(x):
    return None if x is None or not np.isfinite(x) else float(x)


def score_model(label, path, layers_data, n_layers, qk, last, stat, mode):
    start = max(0, n_layers - last)
    window_g, window_p0, per_layer, per_head, obs_keep = [], [], [], [], {}
    for layer in range(n_layers):
        g_l, p_l = [], []
        heads = layers_data[layer][0][0].shape[0]
        head_g = {h: [] for h in range(heads)}
        head_p = {h: [] for h in range(heads)}
        head_s = {h: [] for h in range(heads)}
        for pi, (scores, visible) in enumerate(layers_data[layer]):
            for h in range(heads):
                obs = head_observations(scores[h], visible, mode)
                obs_keep[(layer, pi, h)] = obs
                for q, ps, g, p0 in obs:
                    g_l.append(g)
                    p_l.append(p0)
                    head_g[h].append(g)
                    head_p[h].append(p0)
                    head_s[h].append(ps)
        entry = {"layer": layer, "median_g": fin(np.median(g_l)) if g_l else None,
                 "mean_g": fin(np.mean(g_l)) if g_l else None,
                 "pos0_share": fin(np.mean(p_l)) if p_l else None, "n_observations": len(g_l)}
        entry.update(qk.get(layer, {}))
        per_layer.append(entry)
        if layer >= start:
            window_g += g_l
            window_p0 += p_l
            for h in range(heads):
                per_head.append({"layer": layer, "head": h,
                                 "median_g": fin(np.median(head_g[h])) if head_g[h] else None,
                                 "sink_position": mode_of(head_s[h]),
                                 "pos0_share": fin(np.mean(head_p[h])) if head_p[h] else None})
    g = np.array(window_g)
    s_val = (np.median(g) if stat == "median" else np.mean(g)) if len(g) else None
    report = {
        "model": label, "sink_strength": fin(s_val), "median_g": fin(np.median(g)) if len(g) else None,
        "pos0_share": fin(np.mean(window_p0)) if window_p0 else None,
        "strong_sink_frac": float(np.mean(g > 2.0)) if len(g) else None,
        "n_observations": int(len(g)), "window": [start, n_layers - 1],
        "per_layer": per_layer, "per_head": per_head,
    }
    return report, obs_keep, start


def gap_perturbation(ref_data, tgt_data, ref_obs, start, n_layers):
    b = []
    for layer in range(start, n_layers):
        for pi, ((sr, visible), (st, _)) in enumerate(zip(ref_data[layer], tgt_data[layer])):
            for h in range(sr.shape[0]):
                for q, ps, _, _ in ref_obs[(layer, pi, h)]:
                    keys = np.nonzero(visible[q])[0]
                    others = keys[keys != ps]
                    d = (st[h, q, others] - st[h, q, ps]) - (sr[h, q, others] - sr[h, q, ps])
                    b.append(float(np.max(np.abs(d))))
    return b


def head_gap_perturbation(sr, st, visible, obs):
    """B of one head of one prompt: sr, st [T,T] float64 scores of the reference and the target,
    obs the reference head's head_observations. One B per valid query of the reference, in its order
    (what gap_perturbation pools over all heads; tools/heads_ref.py keeps them per head)."""
    b = []
    for q, ps, _, _ in obs:
        keys = np.nonzero(visible[q])[0]
        others = keys[keys != ps]
        d = (st[q, others] - st[q, ps]) - (sr[q, others] - sr[q, ps])
        b.append(float(np.max(np.abs(d))))
    return b


def report(models, reference, prompts, last, stat, mode, chat):
    """Score `models` (labels -> paths); `reference` is a label in models or None."""
    install_capture()
    tokens, runs, out_models, pairs = {}, {}, [], []
    for label, path in models.items():
        tokens[label] = tokenize(path, prompts, chat)
        runs[label] = run(path, tokens[label])
    scored = {}
    for label, path in models.items():
        data, n_layers, qk = runs[label]
        rep, obs, start = score_model(label, path, data, n_layers, qk, last, stat, mode)
        rep["reference"] = label == reference
        scored[label] = (rep, obs, start)
        out_models.append(rep)
    if reference is not None:
        ref_rep, ref_obs, start = scored[reference]
        ref_data, n_layers, _ = runs[reference]
        g_base = ref_rep["median_g"]
        for label in models:
            if label == reference:
                continue
            assert tokens[label] == tokens[reference], f"{label}: other token ids than the reference"
            b = gap_perturbation(ref_data, runs[label][0], ref_obs, start, n_layers)
            b_med = float(np.median(b)) if b else None
            pairs.append({"ref": reference, "target": label, "g_base_median": g_base, "b_gap_median": b_med,
                          "margin": None if b_med is None or g_base is None else g_base - b_med,
                          "n_observations": len(b)})
    return {"models": out_models, "pairs": pairs,
            "settings": {"last": last, "stat": stat, "sink_position": mode, "chat_template": chat,
                         "n_prompts": len(prompts), "transformers": transformers.__version__,
                         "torch": torch.__version__}}


def read_prompts(path):
    return [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


# Committed goldens: name -> (models in order, reference or None, extra flags). Paths relative to the repo root.
FIX = "tests/fixtures"
GOLDENS = {
    "qwen2_pair": ([f"{FIX}/models/qwen2", f"{FIX}/models/qwen2-sharded"], 0, {}),
    "qwen3_last1": ([f"{FIX}/models/qwen3"], None, {"last": 1}),
    "olmo3_sw_per_query_mean": ([f"{FIX}/score/models/olmo3_sw"], None,
                                {"sink_position": "per-query", "stat": "mean"}),
    "mistral_hd_window": ([f"{FIX}/score/models/mistral_hd"], None, {}),
    "qwen3_moe_chat": ([f"{FIX}/score/models/qwen3_moe"], None, {"chat": True}),
    "llama31_rope_bos": ([f"{FIX}/score/models/llama31_rope"], None, {"last": 1}),
    "olmoe_qk": ([f"{FIX}/score/models/olmoe"], None, {}),
}
# The bundled trained models (added when they exist on this branch): reference vs adapted.
BUNDLED = {
    "tiny_qwen2_bundled": (["assets/models/tiny-qwen2/ref", "assets/models/tiny-qwen2/vl"], 0, {}),
    "tiny_qwen3_bundled": (["assets/models/tiny-qwen3/ref", "assets/models/tiny-qwen3/vl"], 0, {}),
}


def write_goldens():
    out_dir = ROOT / FIX / "score" / "metrics"
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(DEFAULT_PROMPTS)
    cases = dict(GOLDENS)
    for name, spec in BUNDLED.items():
        if all((ROOT / m / "config.json").exists() for m in spec[0]):
            cases[name] = spec
        else:
            print(f"{name}: skipped, {spec[0]} not present")
    for name, (paths, ref, flags) in cases.items():
        models = {p: str(ROOT / p) for p in paths}
        reference = paths[ref] if ref is not None else None
        args = {"last": flags.get("last", 10), "stat": flags.get("stat", "median"),
                "sink_position": flags.get("sink_position", "column"), "chat": flags.get("chat", False)}
        rep = report(models, reference, prompts, args["last"], args["stat"], args["sink_position"], args["chat"])
        cli = []
        if reference is not None:
            cli += ["--ref", reference]
        cli += [p for p in paths if p != reference]
        cli += ["--prompts", "assets/prompts/default.txt", "--last", str(args["last"]), "--stat", args["stat"],
                "--sink-position", args["sink_position"]]
        if args["chat"]:
            cli.append("--chat-template")
        rep["cli"] = cli
        (out_dir / f"{name}.json").write_text(json.dumps(rep, indent=1, sort_keys=True) + "\n")
        summary = ", ".join(f"{m['model'].split('/')[-1]}: S={m['sink_strength']:.4f} pos0={m['pos0_share']:.4f} "
                            f"strong={m['strong_sink_frac']:.4f}" for m in rep["models"])
        pair = "".join(f"; margin={p['margin']:.4f} (B={p['b_gap_median']:.4f})" for p in rep["pairs"])
        print(f"{name}: {summary}{pair}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*")
    ap.add_argument("--ref")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--last", type=int, default=10)
    ap.add_argument("--stat", choices=["median", "mean"], default="median")
    ap.add_argument("--sink-position", choices=["column", "per-query"], default="column")
    ap.add_argument("--chat-template", action="store_true")
    ap.add_argument("--goldens", action="store_true", help="regenerate tests/fixtures/score/metrics/*.json")
    a = ap.parse_args()
    if a.goldens:
        write_goldens()
        return 0
    if not a.models:
        ap.error("give at least one MODEL (or --goldens)")
    paths = ([a.ref] if a.ref else []) + a.models
    rep = report({p: p for p in paths}, a.ref, read_prompts(a.prompts), a.last, a.stat, a.sink_position,
                 a.chat_template)
    print(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
