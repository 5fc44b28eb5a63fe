#!/usr/bin/env python3
"""Independent reference of the paper's extra sink measures (issue 16, items 2-4) and bf16 goldens (item 1).

Written from the paper's text and issue 16, not from the Rust code. It reuses the definitions of
`sink_metrics_ref.py` (G, validity, the sink position, B) through its `head_observations`; the scores are
captured inside transformers' own `eager_attention_forward` (q.kT * scaling + mask, as eager computes them,
in the model's dtype) together with the attention weights eager returns. numpy computes every metric in
float64 from the captured scores.

    # one report (JSON on stdout)
    nice -n 10 tools/.venv/bin/python tools/paper_metrics_ref.py [--ref REF] MODEL... [--prompts FILE] \
        [--last 10] [--stat median|mean] [--sink-position column|per-query] [--chat-template] \
        [--trailing-queries 8] [--bootstrap 1000] [--bootstrap-seed 0] [--bands thirds] [--k-sweep 3-20] \
        [--precision f32|bf16]
    # the N-sweep (Appendix D.1, Table 9) over the pool
    nice -n 10 tools/.venv/bin/python tools/paper_metrics_ref.py --ref REF MODEL --sweep 5,10,15,30,100 --seeds 3 \
        [--pool assets/prompts/pool.txt]
    # regenerate the committed goldens
    nice -n 10 tools/.venv/bin/python tools/paper_metrics_ref.py --goldens        # tests/fixtures/score/paper/*.json
    nice -n 10 tools/.venv/bin/python tools/paper_metrics_ref.py --bf16-goldens   # tests/fixtures/score/paper/bf16/
    nice -n 10 tools/.venv/bin/python tools/paper_metrics_ref.py --replay-golden  # tests/fixtures/score/paper/replay/

Definitions (on top of sink_metrics_ref.py's G, B, validity and S):
  pos0_trailing: prompt x of length T, Q_x = {q : max(1, T-t) <= q <= T-1} (T == 1: prompt left out);
      v_x = mean over (layers of the last-K window, all heads, q in Q_x) of A[q,0], A = float64 softmax of the
      visible scores (A[q,0] = 0 where key 0 is not visible); pos0_trailing = mean over kept prompts of v_x.
      This is the paper's position-0 measure (Section 4.3, App. C.3). `pos0_share` is the older pooled
      measure over all valid queries, kept for comparison.
  pos0_trailing_ci: SplitMix64(seed) bootstrap over prompts: for b < B, i < P: idx = (next() * P) >> 64;
      mean of v[idx] in draw order; [lo, hi] = numpy.percentile(means, [2.5, 97.5]).
  bands thirds: numpy.array_split(arange(L), 3) = early, middle, late; S over each band;
      margin_bands = median G_ref over the band - median B over the band.
  k-sweep A-B: S (and margin) over the last K layers for K = A..B (all layers where K >= L).
  sweep: draw n of P pool prompts with seed s: SplitMix64(s), idx = [0..P), for i < n:
      j = i + ((next() * (P - i)) >> 64), swap idx[i], idx[j]; prompts = sorted(idx[:n]).
      mean and sample std (ddof=1, null for one seed) of S and margin per n. Every pool prompt runs once.
  replay golden: the f32 pre-mask scores q.kT * scaling of the tiny-qwen3 pair on the first 5 default prompts are
      dumped (float32 LE; layer, prompt, head, query q, keys 0..=q) and every metric is computed from the values
      read back from those files, so a consumer that feeds the same f32 scores must match to rounding of float64.
  bf16 extras (`from_weights`): the same p_sink and valid queries, but G_w = log(a / (1 - a)) with a = a[q,ps]
      and A[q,0] read from the bf16 weights eager returns (cast to float64), as the paper's probe on attention
      weights computes it; every a that bf16 rounds to 1 gives G_w = +inf (issue 16: a > ~0.998).
"""
import argparse
import hashlib
import importlib
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sink_metrics_ref as smr  # noqa: E402  (sets torch threads to 1, silences transformers)
from sink_metrics_ref import MODELING, ROOT, DEFAULT_PROMPTS, fin, head_observations, read_prompts  # noqa: E402

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

torch.set_num_threads(1)
transformers.utils.logging.disable_progress_bar()

DEFAULT_POOL = ROOT / "assets" / "prompts" / "pool.txt"
OUT_DIR = ROOT / "tests" / "fixtures" / "score" / "paper"
MASK64 = (1 << 64) - 1
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}

CAPTURED = []  # (layer_idx, scores [H,T,T] in the model dtype, visible [T,T] bool, weights [H,T,T] model dtype)


# ----------------------------------------------------------------------------------------------- capture / models
def install_capture():
    """Wrap eager_attention_forward: record scores (matmul * scaling + mask, in the model dtype) and weights."""
    for name in MODELING:
        mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        original = mod.eager_attention_forward
        if getattr(original, "_paper_capture", False):
            continue

        def wrapped(module, query, key, value, attention_mask, scaling, dropout=0.0, _orig=original, _mod=mod,
                    **kwargs):
            key_states = _mod.repeat_kv(key, module.num_key_value_groups)
            scores = torch.matmul(query, key_states.transpose(2, 3)) * scaling
            raw = scores  # before the mask (the replay golden dumps these)
            t = query.shape[2]
            if attention_mask is not None:
                scores = scores + attention_mask
                visible = (attention_mask[0, 0, :, :t] == 0)
            else:
                visible = torch.ones(t, t, dtype=torch.bool).tril()
            out, weights = _orig(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
            CAPTURED.append((module.layer_idx, scores[0].detach().clone(), visible.clone(),
                             weights[0].detach().clone(), raw[0].detach().clone()))
            return out, weights

        wrapped._paper_capture = True
        mod.eager_attention_forward = wrapped


def load_model(path, precision):
    kw = {}
    cfg = transformers.AutoConfig.from_pretrained(path)
    if getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None):
        kw["experts_implementation"] = "eager"
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=DTYPES[precision],
                                                **kw).eval()


def forward(model, ids):
    CAPTURED.clear()
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), use_cache=False)
    layers = sorted(CAPTURED, key=lambda c: c[0])
    assert [c[0] for c in layers] == list(range(model.config.num_hidden_layers)), "one capture per layer"
    return [(s.double().numpy(), v.numpy(), w) for _, s, v, w, _ in layers]


# ----------------------------------------------------------------------------------------------- per prompt stats
def logsumexp(v):
    m = np.max(v)
    return m + np.log(np.sum(np.exp(v - m)))


def trailing_queries(t, trail):
    return list(range(max(1, t - trail), t)) if t > 1 else []


def pos0_rows(s, visible, qs):
    """A[q,0] for q in qs, float64 softmax of the visible scores of one head."""
    out = []
    for q in qs:
        if not visible[q, 0]:
            out.append(0.0)
            continue
        keys = np.nonzero(visible[q])[0]
        out.append(float(np.exp(s[q, 0] - logsumexp(s[q, keys]))))
    return out


def weight_g(a, visible, obs):
    """G from the returned attention weights (float64 of bf16): log(a / (1 - a)) at the sink."""
    out = []
    with np.errstate(divide="ignore"):
        for q, ps, _, _ in obs:
            x = float(a[q, ps])
            out.append(float(np.log(x) - np.log(1.0 - x)))
    return out


def summarize(layers, mode, trail, with_weights):
    """Per layer: G (heads in order), the pooled pos0 of the valid queries, A[q,0] on the trailing queries."""
    t = layers[0][0].shape[-1]
    qs = trailing_queries(t, trail)
    res = {"T": t, "G": [], "P0": [], "TR": [], "obs": [], "GW": [], "TRW": []}
    for scores, visible, weights in layers:
        g, p0, tr, obs_l, gw, trw = [], [], [], [], [], []
        w64 = weights.float().double().numpy() if with_weights else None
        for h in range(scores.shape[0]):
            obs = head_observations(scores[h], visible, mode)
            obs_l.append(obs)
            g += [o[2] for o in obs]
            p0 += [o[3] for o in obs]
            tr += pos0_rows(scores[h], visible, qs)
            if with_weights:
                gw += weight_g(w64[h], visible, obs)
                trw += [float(w64[h, q, 0]) if visible[q, 0] else 0.0 for q in qs]
        res["G"].append(np.array(g))
        res["P0"].append(np.array(p0))
        res["TR"].append(np.array(tr))
        res["obs"].append(obs_l)
        res["GW"].append(np.array(gw))
        res["TRW"].append(np.array(trw))
    return res


def gap_b(ref_layers, tgt_layers, ref_obs):
    """B per layer (as sink_metrics_ref.gap_perturbation), at the reference's sink positions."""
    out = []
    for (sr, visible, _), (st, _, _), obs_l in zip(ref_layers, tgt_layers, ref_obs):
        b = []
        for h, obs in enumerate(obs_l):
            for q, ps, _, _ in obs:
                keys = np.nonzero(visible[q])[0]
                others = keys[keys != ps]
                d = (st[h, q, others] - st[h, q, ps]) - (sr[h, q, others] - sr[h, q, ps])
                b.append(float(np.max(np.abs(d))))
        out.append(np.array(b))
    return out


# ----------------------------------------------------------------------------------------------- random draws
class SplitMix64:
    def __init__(self, seed):
        self.state = seed & MASK64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)


def bootstrap_ci(v, b, seed):
    p = len(v)
    if p == 0:
        return None
    rng = SplitMix64(seed)
    means = []
    for _ in range(b):
        acc = 0.0
        for _ in range(p):
            acc += v[(rng.next() * p) >> 64]
        means.append(acc / p)
    lo, hi = np.percentile(np.array(means), [2.5, 97.5])
    return [float(lo), float(hi)]


def draw(p, n, seed):
    rng = SplitMix64(seed)
    idx = list(range(p))
    for i in range(n):
        j = i + ((rng.next() * (p - i)) >> 64)
        idx[i], idx[j] = idx[j], idx[i]
    return sorted(idx[:n])


# ----------------------------------------------------------------------------------------------- aggregation
def cat(per_prompt, key, prompts, layers):
    parts = [per_prompt[p][key][l] for p in prompts for l in layers]
    return np.concatenate(parts) if parts else np.array([])


def stat_of(g, stat):
    if len(g) == 0:
        return None
    return fin(np.median(g) if stat == "median" else np.mean(g))


def med(x):
    return fin(np.median(x)) if len(x) else None


def margin_of(ref_pp, b_pp, prompts, layers):
    gr, b = med(cat(ref_pp, "G", prompts, layers)), med(cat(b_pp, "B", prompts, layers))
    return None if gr is None or b is None else gr - b


def trailing_per_prompt(pp, prompts, layers, key="TR"):
    v = []
    for p in prompts:
        if pp[p]["T"] < 2:
            continue
        v.append(float(np.mean(np.concatenate([pp[p][key][l] for l in layers]))))
    return v


def bands_of(n_layers):
    return dict(zip(["early", "middle", "late"], [list(map(int, a)) for a in np.array_split(np.arange(n_layers), 3)]))


def last_k(n_layers, k):
    return list(range(max(0, n_layers - k), n_layers))


# ----------------------------------------------------------------------------------------------- main computation
def run_all(models, reference, prompts, cfg):
    """Forward every prompt once per model; keep only per-layer observation arrays (and B per pair)."""
    install_capture()
    loaded = {label: load_model(path, cfg["precision"]) for label, path in models.items()}
    tokens = {label: smr.tokenize(path, prompts, cfg["chat"]) for label, path in models.items()}
    if reference is not None:
        for label in models:
            assert tokens[label] == tokens[reference], f"{label}: other token ids than the reference"
    with_w = cfg["precision"] != "f32"
    per = {label: [] for label in models}
    pairs = [label for label in models if reference is not None and label != reference]
    bpp = {label: [] for label in pairs}
    dumps = []
    for pi in range(len(prompts)):
        layers = {}
        for label, model in loaded.items():
            layers[label] = forward(model, tokens[label][pi])
            per[label].append(summarize(layers[label], cfg["mode"], cfg["trail"], with_w))
            if cfg.get("dump_dir") is not None and pi < cfg["dump_prompts"]:
                dumps.append(dump_weights(cfg, label, pi, layers[label]))
        for label in pairs:
            bpp[label].append({"B": gap_b(layers[reference], layers[label], per[reference][pi]["obs"])})
        for label in models:
            per[label][pi].pop("obs")
    n_layers = {label: m.config.num_hidden_layers for label, m in loaded.items()}
    return tokens, per, bpp, n_layers, dumps


def dump_weights(cfg, label, pi, layers):
    w = torch.stack([lw for _, _, lw in layers])  # [L, H, T, T] model dtype
    assert w.dtype == torch.bfloat16
    raw = w.contiguous().view(torch.int16).numpy().astype("<u2").tobytes()
    name = f"{cfg['dump_tag']}__{cfg['dump_names'][label]}__p{pi}.bin"
    (cfg["dump_dir"] / name).write_bytes(raw)
    return {"file": name, "model": label, "prompt_index": pi, "shape": list(w.shape),
            "order": "layer, head, query, key (row-major)", "dtype": "bfloat16 bit patterns as little-endian uint16",
            "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def inf_str(x):
    """JSON has no infinities: +-inf become the strings "inf" / "-inf"."""
    return float(x) if np.isfinite(x) else ("inf" if x > 0 else "-inf")


def model_report(label, pp, n_layers, cfg, is_ref):
    prompts = list(range(len(pp)))
    win = last_k(n_layers, cfg["last"])
    g = cat(pp, "G", prompts, win)
    p0 = cat(pp, "P0", prompts, win)
    v = trailing_per_prompt(pp, prompts, win)
    rep = {"model": label, "reference": is_ref, "sink_strength": stat_of(g, cfg["stat"]), "median_g": med(g),
           "pos0_share": fin(np.mean(p0)) if len(p0) else None,
           "strong_sink_frac": float(np.mean(g > 2.0)) if len(g) else None,
           "n_observations": int(len(g)), "window": [win[0], win[-1]], "n_layers": n_layers,
           "pos0_trailing": fin(np.mean(v)) if v else None,
           "pos0_trailing_ci": bootstrap_ci(v, cfg["bootstrap"], cfg["bootstrap_seed"]),
           "pos0_trailing_per_prompt": v, "n_prompts_trailing": len(v)}
    if cfg["bands"]:
        rep["sink_strength_bands"] = {k: stat_of(cat(pp, "G", prompts, ls), cfg["stat"])
                                      for k, ls in bands_of(n_layers).items()}
    if cfg["k_sweep"]:
        a, b = cfg["k_sweep"]
        rep["sink_strength_by_last"] = [{"last": k, "sink_strength": stat_of(cat(pp, "G", prompts, last_k(n_layers, k)),
                                                                              cfg["stat"])} for k in range(a, b + 1)]
    if cfg["precision"] != "f32":
        gw = cat(pp, "GW", prompts, win)
        vw = trailing_per_prompt(pp, prompts, win, "TRW")
        fw = gw[np.isfinite(gw)]
        rep["from_weights"] = {
            "median_g": inf_str(np.median(gw)) if len(gw) else None,
            "mean_g_finite": fin(np.mean(fw)) if len(fw) else None,
            "n_pos_inf": int(np.sum(gw == np.inf)), "n_neg_inf": int(np.sum(gw == -np.inf)),
            "pos0_trailing": fin(np.mean(vw)) if vw else None}
    return rep


def pair_report(reference, label, per, bpp, n_layers, cfg):
    prompts = list(range(len(per[reference])))
    win = last_k(n_layers, cfg["last"])
    gb = med(cat(per[reference], "G", prompts, win))
    b = cat(bpp[label], "B", prompts, win)
    bm = med(b)
    rep = {"ref": reference, "target": label, "g_base_median": gb, "b_gap_median": bm,
           "margin": None if gb is None or bm is None else gb - bm, "n_observations": int(len(b))}
    if cfg["bands"]:
        rep["margin_bands"] = {k: margin_of(per[reference], bpp[label], prompts, ls)
                               for k, ls in bands_of(n_layers).items()}
    if cfg["k_sweep"]:
        a, bb = cfg["k_sweep"]
        rep["margin_by_last"] = [{"last": k, "margin": margin_of(per[reference], bpp[label], prompts,
                                                                 last_k(n_layers, k))} for k in range(a, bb + 1)]
    return rep


def settings_of(cfg, n_prompts):
    s = {"last": cfg["last"], "stat": cfg["stat"], "sink_position": cfg["mode"], "chat_template": cfg["chat"],
         "precision": cfg["precision"], "trailing_queries": cfg["trail"], "bootstrap": cfg["bootstrap"],
         "bootstrap_seed": cfg["bootstrap_seed"], "bands": cfg["bands"],
         "k_sweep": list(cfg["k_sweep"]) if cfg["k_sweep"] else None, "n_prompts": n_prompts,
         "transformers": transformers.__version__, "torch": torch.__version__}
    return s


def report(models, reference, prompts, cfg, prompts_file):
    tokens, per, bpp, n_layers, dumps = run_all(models, reference, prompts, cfg)
    first = next(iter(models))
    out = {"models": [model_report(label, per[label], n_layers[label], cfg, label == reference) for label in models],
           "pairs": [pair_report(reference, label, per, bpp, n_layers[reference], cfg) for label in bpp],
           "settings": settings_of(cfg, len(prompts)),
           "prompts": prompt_block(prompts_file, prompts, tokens[first])}
    if cfg["bands"]:
        out["settings"]["band_layers"] = {label: bands_of(n_layers[label]) for label in models}
    if dumps:
        out["dumps"] = dumps
    return out


def prompt_block(path, prompts, tokens):
    return {"file": rel(path), "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
            "n_prompts": len(prompts), "token_ids": tokens}


def rel(path):
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def sweep_report(models, reference, pool_file, ns, seeds, cfg):
    pool = read_prompts(pool_file)
    if max(ns) > len(pool):
        raise SystemExit(f"error: --sweep n = {max(ns)} is larger than the pool ({len(pool)} prompts in {pool_file})")
    draws = {(n, s): draw(len(pool), n, s) for n in ns for s in range(seeds)}
    needed = sorted(set().union(*draws.values()))
    sub = [pool[i] for i in needed]
    tokens, per, bpp, n_layers, _ = run_all(models, reference, sub, cfg)
    pos = {p: i for i, p in enumerate(needed)}  # pool index -> run index
    labels = list(models)
    pairs = list(bpp)
    out = []
    for n in ns:
        ds = []
        for s in range(seeds):
            idx = draws[(n, s)]
            run_idx = [pos[i] for i in idx]
            ss = [stat_of(cat(per[m], "G", run_idx, last_k(n_layers[m], cfg["last"])), cfg["stat"]) for m in labels]
            mg = [margin_of(per[reference], bpp[m], run_idx, last_k(n_layers[reference], cfg["last"])) for m in pairs]
            ds.append({"seed": s, "prompts": idx, "sink_strength": ss, "margin": mg})

        def agg(key, k):
            vals = np.array([d[key][k] for d in ds], dtype=float)
            return float(np.mean(vals)), (float(np.std(vals, ddof=1)) if seeds > 1 else None)
        sm = [agg("sink_strength", k) for k in range(len(labels))]
        mm = [agg("margin", k) for k in range(len(pairs))]
        out.append({"n": n, "draws": ds, "sink_strength_mean": [a for a, _ in sm],
                    "sink_strength_std": [b for _, b in sm], "margin_mean": [a for a, _ in mm],
                    "margin_std": [b for _, b in mm]})
    settings = settings_of(cfg, len(pool))
    settings.update({"sweep": ns, "seeds": seeds, "models": labels,
                     "pairs": [{"ref": reference, "target": m} for m in pairs], "n_prompts_run": len(needed)})
    # token ids per pool prompt (null for a prompt no draw takes)
    return {"sweep": out, "settings": settings,
            "pool": prompt_block(pool_file, pool, [tokens[labels[0]][pos[i]] if i in pos else None
                                                   for i in range(len(pool))])}


# ----------------------------------------------------------------------------------------------- output
def dumps_json(obj):
    text = json.dumps(obj, indent=1, sort_keys=True)
    # put lists of plain numbers (token ids, per-prompt values, intervals) on one line
    return re.sub(r"\[\s*((?:-?[\d.eE+\-]+|null)(?:,\s*(?:-?[\d.eE+\-]+|null))*)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text) + "\n"


def base_cfg(**kw):
    cfg = {"last": 10, "stat": "median", "mode": "column", "chat": False, "precision": "f32", "trail": 8,
           "bootstrap": 1000, "bootstrap_seed": 0, "bands": None, "k_sweep": None}
    cfg.update(kw)
    return cfg


def cli_of(paths, reference, cfg, prompts_file, extra=()):
    cli = (["--ref", reference] if reference else []) + [p for p in paths if p != reference]
    cli += ["--prompts", prompts_file, "--last", str(cfg["last"]), "--stat", cfg["stat"], "--sink-position",
            cfg["mode"], "--trailing-queries", str(cfg["trail"]), "--bootstrap", str(cfg["bootstrap"]),
            "--bootstrap-seed", str(cfg["bootstrap_seed"]), "--precision", cfg["precision"]]
    if cfg["chat"]:
        cli.append("--chat-template")
    if cfg["bands"]:
        cli += ["--bands", cfg["bands"]]
    if cfg["k_sweep"]:
        cli += ["--k-sweep", f"{cfg['k_sweep'][0]}-{cfg['k_sweep'][1]}"]
    return cli + list(extra)


BUNDLED = {
    "tiny_qwen2_bundled": ["assets/models/tiny-qwen2/ref", "assets/models/tiny-qwen2/vl"],
    "tiny_qwen3_bundled": ["assets/models/tiny-qwen3/ref", "assets/models/tiny-qwen3/vl"],
}
SCORE_MODELS = "tests/fixtures/score/models"
ARCH_BF16 = {
    "llama31_rope": [f"{SCORE_MODELS}/llama31_rope"],
    # OLMo-style norms (post-attention / post-feedforward norms, layerwise q/k norm) and sliding layers; the olmo2
    # fixture has no tokenizer, so olmo3_sw stands for the OLMo family.
    "olmo3_sw": [f"{SCORE_MODELS}/olmo3_sw"],
    "qwen3_bias": [f"{SCORE_MODELS}/qwen3_bias"],
}


def write(name, rep, out_dir=OUT_DIR):
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(dumps_json(rep))
    print(f"{path.relative_to(ROOT)}: {path.stat().st_size} bytes", flush=True)


def summary_line(name, rep):
    parts = []
    for m in rep.get("models", []):
        ci = m["pos0_trailing_ci"]
        parts.append(f"{m['model'].split('/')[-1]}: S={m['sink_strength']:.4f} pos0_tr={m['pos0_trailing']:.4f} "
                     f"[{ci[0]:.4f}, {ci[1]:.4f}]" + (f" bands={m['sink_strength_bands']}" if "sink_strength_bands"
                                                       in m else ""))
    for p in rep.get("pairs", []):
        parts.append(f"margin={p['margin']:.4f}" + (f" bands={p['margin_bands']}" if "margin_bands" in p else ""))
    print(f"{name}: " + "; ".join(parts), flush=True)


def write_goldens(pool_file):
    prompts_file = "assets/prompts/default.txt"
    prompts = read_prompts(ROOT / prompts_file)
    for name, paths in BUNDLED.items():
        cfg = base_cfg(bands="thirds", k_sweep=(3, 20))
        rep = report({p: str(ROOT / p) for p in paths}, paths[0], prompts, cfg, ROOT / prompts_file)
        rep["cli"] = cli_of(paths, paths[0], cfg, prompts_file)
        write(name, rep)
        summary_line(name, rep)
    for name, trail in (("mistral_hd_trailing", 8), ("mistral_hd_trailing_all", 1000)):
        paths = [f"{SCORE_MODELS}/mistral_hd"]
        cfg = base_cfg(trail=trail)
        rep = report({p: str(ROOT / p) for p in paths}, None, prompts, cfg, ROOT / prompts_file)
        rep["cli"] = cli_of(paths, None, cfg, prompts_file)
        write(name, rep)
        summary_line(name, rep)
    paths = BUNDLED["tiny_qwen3_bundled"]
    cfg = base_cfg()
    ns, seeds = [5, 10, 15, 30, 100], 3
    rep = sweep_report({p: str(ROOT / p) for p in paths}, paths[0], pool_file, ns, seeds, cfg)
    rep["cli"] = ["--ref", paths[0], paths[1], "--pool", rel(pool_file), "--last", str(cfg["last"]), "--stat",
                  cfg["stat"], "--sink-position", cfg["mode"], "--sweep", ",".join(map(str, ns)), "--seeds",
                  str(seeds)]
    write("tiny_qwen3_sweep", rep)
    for row in rep["sweep"]:
        print(f"  n={row['n']}: S mean={row['sink_strength_mean']} std={row['sink_strength_std']} "
              f"margin mean={row['margin_mean']} std={row['margin_std']}", flush=True)


def write_bf16_goldens():
    prompts_file = "assets/prompts/default.txt"
    prompts = read_prompts(ROOT / prompts_file)
    out_dir = OUT_DIR / "bf16"
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = {**{k.replace("_bundled", ""): v for k, v in BUNDLED.items()}, **ARCH_BF16}
    for name, paths in cases.items():
        reference = paths[0] if len(paths) > 1 else None
        models = {p: str(ROOT / p) for p in paths}
        case = {}
        for precision in ("bf16", "f32"):
            cfg = base_cfg(precision=precision)
            if precision == "bf16":
                cfg.update(dump_dir=out_dir, dump_prompts=3, dump_tag=name,
                           dump_names={p: Path(p).name for p in paths})
            rep = report(models, reference, prompts, cfg, ROOT / prompts_file)
            rep["cli"] = cli_of(paths, reference, cfg, prompts_file)
            case[precision] = rep
            summary_line(f"{name} {precision}", rep)
        # the prompts block is the same in both; keep one copy
        case["prompts"] = case["bf16"].pop("prompts")
        assert case["f32"].pop("prompts")["token_ids"] == case["prompts"]["token_ids"]
        case["dumps"] = case["bf16"].pop("dumps")
        write(name, case, out_dir)


# ----------------------------------------------------------------------------------------------- replay golden
REPLAY_DIR = OUT_DIR / "replay"
REPLAY_PAIR = {"ref": "assets/models/tiny-qwen3/ref", "vl": "assets/models/tiny-qwen3/vl"}
REPLAY_PROMPTS = 5
REPLAY_LAYOUT = "layer, prompt, head, query, keys 0..=q; float32 LE"


def replay_capture(model, ids):
    """Pre-mask f32 scores per layer, [H, T, T]; asserts a plain causal mask (no sliding window)."""
    CAPTURED.clear()
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), use_cache=False)
    layers = sorted(CAPTURED, key=lambda c: c[0])
    assert [c[0] for c in layers] == list(range(model.config.num_hidden_layers)), "one capture per layer"
    t = len(ids)
    causal = np.tril(np.ones((t, t), dtype=bool))
    out = []
    for _, masked, visible, _, raw in layers:
        assert raw.dtype == torch.float32
        assert np.array_equal(visible.numpy(), causal), "replay golden needs a causal mask without a window"
        m, r = masked.numpy(), raw.numpy()
        assert np.array_equal(m[:, causal], r[:, causal]), "the mask changed a visible score"
        out.append(r)
    return out


def tril_flat(s):
    """[H, T, T] -> [H, T(T+1)/2]: rows q = 0..T-1, keys p = 0..=q."""
    t = s.shape[-1]
    qi, pi = np.tril_indices(t)  # row-major: (0,0), (1,0), (1,1), (2,0), ...
    return s[:, qi, pi]


def replay_read(path, n_layers, n_heads, lengths):
    """Read a scores file back: [layer][prompt] -> float64 [H, T, T] (upper triangle -inf)."""
    flat = np.fromfile(path, dtype="<f4")
    assert flat.size == n_layers * n_heads * sum(t * (t + 1) // 2 for t in lengths), f"{path}: size"
    out, off = [], 0
    for _ in range(n_layers):
        row = []
        for t in lengths:
            n = t * (t + 1) // 2
            block = flat[off:off + n_heads * n].reshape(n_heads, n).astype(np.float64)
            off += n_heads * n
            s = np.full((n_heads, t, t), -np.inf)
            qi, pi = np.tril_indices(t)
            s[:, qi, pi] = block
            row.append(s)
        out.append(row)
    return out


def column_sink_ties(s, visible):
    """The column-mass sink of one head and its lead over the runner-up (absolute, in column-mass units)."""
    t = s.shape[0]
    probs = np.zeros_like(s)
    for q in range(t):
        keys = np.nonzero(visible[q])[0]
        probs[q, keys] = np.exp(s[q, keys] - logsumexp(s[q, keys]))
    col = probs.sum(axis=0)
    order = np.argsort(-col, kind="stable")
    return int(order[0]), float(col[order[0]] - col[order[1]]) if t > 1 else float("inf")


def write_replay_golden():
    cfg = base_cfg(bands="thirds", k_sweep=(3, 8))
    prompts_file = "assets/prompts/default.txt"
    prompts = read_prompts(ROOT / prompts_file)[:REPLAY_PROMPTS]
    install_capture()
    labels = list(REPLAY_PAIR)
    reference = labels[0]
    tokens = {m: smr.tokenize(str(ROOT / p), prompts, cfg["chat"]) for m, p in REPLAY_PAIR.items()}
    for m in labels:
        assert tokens[m] == tokens[reference], f"{m}: other token ids than the reference"
    lengths = [len(ids) for ids in tokens[reference]]
    REPLAY_DIR.mkdir(parents=True, exist_ok=True)
    shape, files = {}, {}
    for m, p in REPLAY_PAIR.items():
        model = load_model(str(ROOT / p), "f32")
        c = model.config
        assert all(lt == "full_attention" for lt in (getattr(c, "layer_types", None) or ["full_attention"]))
        assert not getattr(c, "use_sliding_window", False) and getattr(c, "sliding_window", None) is None
        per_prompt = [replay_capture(model, ids) for ids in tokens[m]]  # [prompt][layer] -> [H, T, T] f32
        n_layers, n_heads = len(per_prompt[0]), per_prompt[0][0].shape[0]
        chunks = [tril_flat(per_prompt[pi][l]).astype("<f4").ravel()
                  for l in range(n_layers) for pi in range(len(prompts))]
        raw = np.concatenate(chunks).tobytes()
        files[m] = REPLAY_DIR / f"{m}.scores.bin"
        files[m].write_bytes(raw)
        shape[m] = (n_layers, n_heads, hashlib.sha256(raw).hexdigest(), len(raw))
        print(f"{files[m].relative_to(ROOT)}: {len(raw)} bytes", flush=True)
        del model
    # everything below reads only the dumped float32 values
    causal = {t: np.tril(np.ones((t, t), dtype=bool)) for t in lengths}
    scores = {m: replay_read(files[m], shape[m][0], shape[m][1], lengths) for m in labels}
    per, sinks, ties = {}, {}, {}
    for m in labels:
        n_layers = shape[m][0]
        per[m] = [summarize([(scores[m][l][pi], causal[t], None) for l in range(n_layers)], cfg["mode"], cfg["trail"],
                            False) for pi, t in enumerate(lengths)]
        sinks[m], ties[m] = [], []
        for l in range(n_layers):
            for pi, t in enumerate(lengths):
                for h in range(shape[m][1]):
                    ps, lead = column_sink_ties(scores[m][l][pi][h], causal[t])
                    sinks[m].append(ps)
                    ties[m].append({"layer": l, "prompt": pi, "head": h, "sink": ps, "lead": lead})
    bpp = {}
    for m in labels[1:]:
        bpp[m] = [{"B": gap_b([(scores[reference][l][pi], causal[t], None) for l in range(shape[reference][0])],
                              [(scores[m][l][pi], causal[t], None) for l in range(shape[m][0])],
                              per[reference][pi]["obs"])} for pi, t in enumerate(lengths)]
    for m in labels:
        for pp in per[m]:
            pp.pop("obs")
    models_out = []
    for m in labels:
        n_layers, n_heads, sha, nbytes = shape[m]
        rep = model_report(m, per[m], n_layers, cfg, m == reference)
        closest = min(ties[m], key=lambda d: d["lead"])
        rep.update({"path": REPLAY_PAIR[m], "scores_file": files[m].name, "scores_sha256": sha,
                    "scores_bytes": nbytes, "num_layers": n_layers, "num_heads": n_heads,
                    "sink_positions": sinks[m], "column_mass_closest_lead": closest})
        models_out.append(rep)
    pairs_out = [pair_report(reference, m, per, bpp, shape[reference][0], cfg) for m in labels[1:]]
    subsets = []
    for n in (2, 3):
        for seed in (0, 1, 2):
            idx = draw(len(prompts), n, seed)
            ss = [stat_of(cat(per[m], "G", idx, last_k(shape[m][0], cfg["last"])), cfg["stat"]) for m in labels]
            mg = [margin_of(per[reference], bpp[m], idx, last_k(shape[reference][0], cfg["last"])) for m in labels[1:]]
            subsets.append({"n": n, "seed": seed, "prompts": idx, "sink_strength": ss, "margin": mg})
    settings = settings_of(cfg, len(prompts))
    settings.update({"band_layers": {m: bands_of(shape[m][0]) for m in labels}, "models": labels,
                     "pairs": [{"ref": reference, "target": m} for m in labels[1:]],
                     "scores": "pre-mask q.kT * scaling, float32 (eager, f32 weights); metrics in float64 from the "
                               "dumped float32 values; A = float64 softmax of those scores",
                     "subset_draw": "SplitMix64(seed) partial Fisher-Yates of n from P = 5 prompts, sorted"})
    block = prompt_block(ROOT / prompts_file, prompts, tokens[reference])
    block.update({"lengths": lengths, "first_n": REPLAY_PROMPTS})
    rep = {"models": models_out, "pairs": pairs_out, "subsets": subsets, "prompts": block, "settings": settings,
           "layout": REPLAY_LAYOUT, "cli": ["--replay-golden"]}
    write("replay", rep, REPLAY_DIR)
    summary_line("replay", rep)
    for d in subsets:
        print(f"  n={d['n']} seed={d['seed']} prompts={d['prompts']} S={d['sink_strength']} margin={d['margin']}")
    for m in models_out:
        print(f"  {m['model']}: closest column-mass lead {m['column_mass_closest_lead']}")


def parse_range(text):
    m = re.fullmatch(r"(\d+)-(\d+)", text)
    if not m or int(m.group(1)) < 1 or int(m.group(1)) > int(m.group(2)):
        raise argparse.ArgumentTypeError(f"expected A-B with 1 <= A <= B, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def parse_list(text):
    try:
        ns = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of sizes, got {text!r}")
    if not ns or min(ns) < 1:
        raise argparse.ArgumentTypeError("sweep sizes must be >= 1")
    return ns


def positive(text):
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*")
    ap.add_argument("--ref")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--last", type=positive, default=10)
    ap.add_argument("--stat", choices=["median", "mean"], default="median")
    ap.add_argument("--sink-position", choices=["column", "per-query"], default="column")
    ap.add_argument("--chat-template", action="store_true")
    ap.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--trailing-queries", type=positive, default=8)
    ap.add_argument("--bootstrap", type=positive, default=1000)
    ap.add_argument("--bootstrap-seed", type=int, default=0)
    ap.add_argument("--bands", choices=["thirds"])
    ap.add_argument("--k-sweep", type=parse_range)
    ap.add_argument("--sweep", type=parse_list)
    ap.add_argument("--seeds", type=positive, default=3)
    ap.add_argument("--pool", default=str(DEFAULT_POOL))
    ap.add_argument("--goldens", action="store_true", help="regenerate tests/fixtures/score/paper/*.json")
    ap.add_argument("--bf16-goldens", action="store_true", help="regenerate tests/fixtures/score/paper/bf16/")
    ap.add_argument("--replay-golden", action="store_true",
                    help="regenerate tests/fixtures/score/paper/replay/ (f32 scores of the tiny-qwen3 pair + metrics)")
    a = ap.parse_args()
    if a.replay_golden:
        write_replay_golden()
        return 0
    if a.goldens:
        write_goldens(Path(a.pool))
        return 0
    if a.bf16_goldens:
        write_bf16_goldens()
        return 0
    if not a.models:
        ap.error("give at least one MODEL (or --goldens / --bf16-goldens / --replay-golden)")
    paths = ([a.ref] if a.ref else []) + a.models
    cfg = base_cfg(last=a.last, stat=a.stat, mode=a.sink_position, chat=a.chat_template, precision=a.precision,
                   trail=a.trailing_queries, bootstrap=a.bootstrap, bootstrap_seed=a.bootstrap_seed, bands=a.bands,
                   k_sweep=a.k_sweep)
    models = {p: p for p in paths}
    if a.sweep:
        if max(a.sweep) > len(read_prompts(a.pool)):
            ap.error(f"--sweep n = {max(a.sweep)} is larger than the pool ({a.pool})")
        rep = sweep_report(models, a.ref, Path(a.pool), a.sweep, a.seeds, cfg)
    else:
        rep = report(models, a.ref, read_prompts(a.prompts), cfg, a.prompts)
    sys.stdout.write(dumps_json(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
