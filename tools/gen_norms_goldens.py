#!/usr/bin/env python3
"""Fixtures and goldens for `sinkmerge norms` (tests/fixtures/norms/).

Run by hand from the repository root (see docs/commands/norms.md, "Goldens and benchmarks"):

    nice -n 10 tools/.venv/bin/python tools/gen_norms_goldens.py

It writes small seeded checkpoints whose weight differences have designed spectra, then computes
every reported number with torch in float64 from the stored values (float32/bfloat16/float16
upcast exactly): `torch.linalg.matrix_norm(ord=2)` (all singular values, LAPACK) and
`matrix_norm(ord='fro')` for matrices, `torch.linalg.vector_norm` for vectors, numpy medians for
the summaries. It also computes goldens for pairs of the shared model fixtures
(tests/fixtures/models/), matching their tensors with its own copy of the layout rules, so the
Rust matching is checked against an independent implementation. Rerunning gives identical bytes.

Fixtures (all weights seeded):
  spectra-ref / spectra-target / spectra-target-quarter  f32 qwen2, 4 layers, hidden 48:
      per-layer dW designed with a spectral gap, clustered top singular values (a random
      orthogonal construction with sigma_1..5 within 1e-5), plain random (Gaussian, clustered at
      the Marchenko-Pastur edge), rank 1, rank 5, a double top, and dW = 0; q_proj [48,48],
      k_proj [24,48] (wide), gate_proj [96,48] (tall), down_proj [48,96] (wide), q_proj.bias,
      input_layernorm; embed_tokens [80,48]. All values lie on a 2^-20 grid so that
      target-quarter = REF + dW/4 is exact in f32: its op/fro ratio to spectra-target is 4.
  bf16-ref / bf16-target / f16-target  qwen3 (per-head q_norm/k_norm), 2 layers, stored bf16
      (f16 for f16-target, same values rounded to f16): 16-bit inputs and mixed dtypes.
  vocab-target  embed_tokens/lm_head with 88 rows against spectra-ref's 80 (and lm_head there).
  moe-ref / moe-target  qwen3_moe, 2 layers, bf16: per-expert tensors (layer 0) and fused
      expert tensors [E, 2I, H] / [E, H, I] (layer 1), and the router.
  bad-shape, missing, nonfinite, moe-fused-target  targets for the error tests.
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
OUT = FIXTURES / "norms"
GRID = 2.0**-20  # every f32 fixture value is a multiple of this (see module docs)

H, HEADS, KV, INTER, VOCAB, LAYERS = 48, 4, 2, 96, 80, 4
HEAD_DIM = H // HEADS


def rng_for(name):
    return np.random.default_rng(int.from_bytes(name.encode(), "little") % (2**63))


def orthonormal(rng, rows, k):
    q, r = np.linalg.qr(rng.standard_normal((rows, k)))
    return q * np.sign(np.diag(r))


def with_spectrum(rng, rows, cols, sigma):
    k = len(sigma)
    return orthonormal(rng, rows, k) @ np.diag(sigma) @ orthonormal(rng, cols, k).T


def design(kind, rng, rows, cols):
    """A weight difference of the given spectral design, float64."""
    n = min(rows, cols)
    if kind == "gap":
        return with_spectrum(rng, rows, cols, [0.8] + list(0.2 * 0.9 ** np.arange(n - 1)))
    if kind == "clustered":
        top = [0.5 * (1 - 2e-6 * i) for i in range(5)]
        return with_spectrum(rng, rows, cols, top + list(0.3 * 0.95 ** np.arange(n - 5)))
    if kind == "random":
        return 0.02 * rng.standard_normal((rows, cols))
    if kind == "rank1":
        return with_spectrum(rng, rows, cols, [0.6])
    if kind == "rank5":
        return with_spectrum(rng, rows, cols, [0.5, 0.4, 0.3, 0.2, 0.1])
    if kind == "double":
        return with_spectrum(rng, rows, cols, [0.4, 0.4, 0.1])
    if kind == "zero":
        return np.zeros((rows, cols))
    raise ValueError(kind)


# Per layer: the design of dW for q_proj, k_proj, gate_proj, down_proj.
DESIGNS = [
    {"q_proj": "gap", "k_proj": "rank1", "gate_proj": "random", "down_proj": "rank5"},
    {"q_proj": "clustered", "k_proj": "zero", "gate_proj": "gap", "down_proj": "random"},
    {"q_proj": "random", "k_proj": "clustered", "gate_proj": "clustered", "down_proj": "gap"},
    {"q_proj": "double", "k_proj": "random", "gate_proj": "random", "down_proj": "clustered"},
]
SHAPES = {"q_proj": (H, H), "k_proj": (KV * HEAD_DIM, H), "gate_proj": (INTER, H), "down_proj": (H, INTER)}
PATHS = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "gate_proj": "mlp.gate_proj", "down_proj": "mlp.down_proj"}


def on_grid(x, grid=GRID):
    return np.round(np.asarray(x, dtype=np.float64) / grid) * grid


def qwen_config(model_type, dtype, layers, vocab, **extra):
    arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[model_type]
    cfg = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HEAD_DIM,
        "vocab_size": vocab,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    cfg.update(extra)
    return cfg


def save(name, tensors, config):
    d = OUT / name
    d.mkdir(parents=True, exist_ok=True)
    for f in d.iterdir():
        f.unlink()
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def f32(x):
    return torch.tensor(np.asarray(x), dtype=torch.float32)


def build_spectra():
    rng = rng_for("spectra")
    ref, dw = {}, {}
    ref["model.embed_tokens.weight"] = on_grid(0.5 * rng.standard_normal((VOCAB, H)).clip(-1.8, 1.8))
    dw["model.embed_tokens.weight"] = on_grid(0.01 * rng.standard_normal((VOCAB, H)), 4 * GRID)
    ref["model.norm.weight"] = on_grid(1 + 0.05 * rng.standard_normal(H))
    dw["model.norm.weight"] = on_grid(0.02 * rng.standard_normal(H), 4 * GRID)
    for layer, designs in enumerate(DESIGNS):
        p = f"model.layers.{layer}."
        for module, kind in designs.items():
            name = p + PATHS[module] + ".weight"
            rows, cols = SHAPES[module]
            ref[name] = on_grid((0.02 * rng.standard_normal((rows, cols))).clip(-0.9, 0.9))
            dw[name] = on_grid(design(kind, rng, rows, cols), 4 * GRID)
        ref[p + "self_attn.q_proj.bias"] = on_grid(0.1 * rng.standard_normal(H))
        dw[p + "self_attn.q_proj.bias"] = on_grid(0.01 * rng.standard_normal(H), 4 * GRID)
        ref[p + "input_layernorm.weight"] = on_grid(1 + 0.05 * rng.standard_normal(H))
        dw[p + "input_layernorm.weight"] = on_grid(0.02 * rng.standard_normal(H), 4 * GRID)
    # Extra head rows for the vocabulary case.
    lm_ref = on_grid(0.5 * rng.standard_normal((VOCAB, H)).clip(-1.8, 1.8))
    lm_extra_rows = on_grid(0.5 * rng.standard_normal((8, H)))
    embed_extra_rows = on_grid(0.5 * rng.standard_normal((8, H)))
    lm_dw = on_grid(0.01 * rng.standard_normal((VOCAB, H)), 4 * GRID)

    cfg = qwen_config("qwen2", "float32", LAYERS, VOCAB, attention_bias=True)
    ref_t = {k: f32(v) for k, v in ref.items()}
    ref_t["lm_head.weight"] = f32(lm_ref)
    target = {k: f32(ref[k] + dw[k]) for k in ref}
    target["lm_head.weight"] = f32(lm_ref + lm_dw)
    quarter = {k: f32(ref[k] + dw[k] / 4) for k in ref}
    quarter["lm_head.weight"] = f32(lm_ref + lm_dw / 4)
    for k in ref:  # the grids make every sum exact in f32
        assert np.array_equal(target[k].double().numpy() - ref[k], dw[k]), k
        assert np.array_equal(quarter[k].double().numpy() - ref[k], dw[k] / 4), k
    save("spectra-ref", ref_t, cfg)
    save("spectra-target", target, cfg)
    save("spectra-target-quarter", quarter, cfg)

    vocab_cfg = qwen_config("qwen2", "float32", LAYERS, VOCAB + 8, attention_bias=True)
    save(
        "vocab-target",
        {
            "model.embed_tokens.weight": f32(np.vstack([ref["model.embed_tokens.weight"] + dw["model.embed_tokens.weight"], embed_extra_rows])),
            "lm_head.weight": f32(np.vstack([lm_ref + lm_dw, lm_extra_rows])),
        },
        vocab_cfg,
    )
    # Error targets: one wrong shape, one missing tensor, one NaN.
    bad = {k: target[k] for k in ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"]}
    bad["model.layers.0.self_attn.k_proj.weight"] = bad["model.layers.0.self_attn.k_proj.weight"][:20].clone()
    save("bad-shape", bad, cfg)
    q = {k: target[k] for k in ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias"]}
    save("missing", q, cfg)
    q["model.layers.0.self_attn.q_proj.weight"] = q["model.layers.0.self_attn.q_proj.weight"].clone()
    q["model.layers.0.self_attn.q_proj.weight"][3, 7] = float("nan")
    save("nonfinite", q, cfg)


def build_16bit():
    rng = rng_for("bf16")
    cfg = qwen_config("qwen3", "bfloat16", 2, VOCAB)
    ref, tgt = {}, {}
    for layer in range(2):
        p = f"model.layers.{layer}."
        for module, kind in DESIGNS[layer + 2].items():
            name = p + PATHS[module] + ".weight"
            rows, cols = SHAPES[module]
            ref[name] = 0.05 * rng.standard_normal((rows, cols))
            tgt[name] = ref[name] + design(kind, rng, rows, cols)
        for norm in ["self_attn.q_norm", "self_attn.k_norm"]:
            ref[p + norm + ".weight"] = 1 + 0.1 * rng.standard_normal(HEAD_DIM)
            tgt[p + norm + ".weight"] = ref[p + norm + ".weight"] * (1 + 0.02 * rng.standard_normal(HEAD_DIM))
        ref[p + "input_layernorm.weight"] = 1 + 0.05 * rng.standard_normal(H)
        tgt[p + "input_layernorm.weight"] = ref[p + "input_layernorm.weight"] + 0.01 * rng.standard_normal(H)
    as_t = lambda d, dt: {k: torch.tensor(v, dtype=torch.float64).to(dt) for k, v in d.items()}
    save("bf16-ref", as_t(ref, torch.bfloat16), cfg)
    save("bf16-target", as_t(tgt, torch.bfloat16), cfg)
    save("f16-target", as_t(tgt, torch.float16), dict(cfg, torch_dtype="float16"))


def build_moe():
    rng = rng_for("moe")
    experts, moe_inter = 4, 32
    cfg = qwen_config(
        "qwen3_moe", "bfloat16", 2, VOCAB, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=moe_inter, decoder_sparse_step=1, norm_topk_prob=True
    )
    ref, tgt = {}, {}

    def put(name, shape, kind):
        ref[name] = 0.05 * rng.standard_normal(shape)
        if len(shape) == 3:
            tgt[name] = ref[name] + np.stack([design(kind, rng, *shape[1:]) for _ in range(shape[0])])
        else:
            tgt[name] = ref[name] + design(kind, rng, *shape)

    for e in range(experts):
        put(f"model.layers.0.mlp.experts.{e}.up_proj.weight", (moe_inter, H), ["gap", "random", "rank1", "clustered"][e])
        put(f"model.layers.0.mlp.experts.{e}.down_proj.weight", (H, moe_inter), "random")
    put("model.layers.0.mlp.gate.weight", (experts, H), "random")
    put("model.layers.1.mlp.experts.gate_up_proj", (experts, 2 * moe_inter, H), "gap")
    put("model.layers.1.mlp.experts.down_proj", (experts, H, moe_inter), "random")
    put("model.layers.1.mlp.gate.weight", (experts, H), "random")
    as_t = lambda d: {k: torch.tensor(v, dtype=torch.float64).to(torch.bfloat16) for k, v in d.items()}
    save("moe-ref", as_t(ref), cfg)
    save("moe-target", as_t(tgt), cfg)
    # Layer 0 with fused expert tensors, against moe-ref's one tensor per expert: an error.
    fused = {
        "model.layers.0.mlp.experts.gate_up_proj": np.stack([np.vstack([tgt[f"model.layers.0.mlp.experts.{e}.up_proj.weight"]] * 2) for e in range(experts)]),
        "model.layers.0.mlp.experts.down_proj": np.stack([tgt[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] for e in range(experts)]),
        "model.layers.0.mlp.gate.weight": tgt["model.layers.0.mlp.gate.weight"],
    }
    save("moe-fused-target", as_t(fused), cfg)


# ---- goldens ---------------------------------------------------------------------------------

PREFIXES = [
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.text_model.", "model."),
    ("llm.model.", "model."),
    ("llm.lm_head.", "lm_head."),
]
MODULES = {
    "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj", "self_attn.o_proj": "o_proj",
    "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm", "mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj",
    "mlp.down_proj": "down_proj", "mlp.gate": "router", "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
}


def load(model):
    out = {}
    d = FIXTURES / model
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                out[k] = s.get_tensor(k)
    return out, json.loads((d / "config.json").read_text())


def standard(name):
    for a, b in PREFIXES:
        if name.startswith(a):
            return b + name[len(a):]
    if name.startswith("model.") or name.startswith("lm_head."):
        return name
    return None


def parse(name):
    """(layer, module, expert) of a standard name."""
    if name == "model.embed_tokens.weight":
        return None, "embed_tokens", None
    if name == "lm_head.weight":
        return None, "lm_head", None
    if name == "model.norm.weight":
        return None, "norm", None
    parts = name.split(".")
    layer = int(parts[2])
    rest = ".".join(parts[3:])
    if rest.startswith("mlp.experts."):
        tail = rest[len("mlp.experts."):]
        if tail in ("gate_up_proj", "down_proj"):
            return layer, "experts_" + tail, None
        e, proj, _ = tail.split(".")
        return layer, "expert_" + proj, int(e)
    stem, param = rest.rsplit(".", 1)
    module = MODULES[stem]
    return layer, module + (".bias" if param == "bias" else ""), None


def tied(config):
    text = config.get("text_config") or config.get("llm_config") or config
    return bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))


def matrix_metrics(t, r):
    d = t - r
    fro, op = torch.linalg.matrix_norm(d, "fro").item(), torch.linalg.matrix_norm(d, 2).item()
    rfro, rop = torch.linalg.matrix_norm(r, "fro").item(), torch.linalg.matrix_norm(r, 2).item()
    s = torch.linalg.svdvals(d)
    return {
        "fro": fro,
        "op": op,
        "stable_rank": fro * fro / (op * op) if op > 0 else None,
        "rel_fro": fro / rfro if rfro > 0 else None,
        "rel_op": op / rop if rop > 0 else None,
        "ref_fro": rfro,
        "ref_op": rop,
        # Not reported by sinkmerge: how hard the case is (1 - s2/s1, 0 for a double top).
        "relative_gap": (1 - (s[1] / s[0]).item()) if len(s) > 1 and s[0] > 0 else None,
    }


def vector_metrics(t, r):
    d = t - r
    l2, rl2 = torch.linalg.vector_norm(d).item(), torch.linalg.vector_norm(r).item()
    return {
        "l2": l2,
        "linf": torch.linalg.vector_norm(d, float("inf")).item(),
        "rel_l2": l2 / rl2 if rl2 > 0 else None,
        "ref_linf": torch.linalg.vector_norm(r, float("inf")).item(),
    }


def golden_rows(ref_model, target_model, modules=None):
    ref, ref_cfg = load(ref_model)
    tgt, tgt_cfg = load(target_model)
    ref = {standard(k): v for k, v in ref.items() if standard(k)}
    tgt = {standard(k): v for k, v in tgt.items() if standard(k)}
    for side, other, cfg in [(ref, tgt, ref_cfg), (tgt, ref, tgt_cfg)]:
        if "lm_head.weight" not in side and "lm_head.weight" in other and tied(cfg):
            side["lm_head.weight"] = side["model.embed_tokens.weight"]
    rows = []
    for name in sorted(set(ref) & set(tgt)):
        layer, module, expert = parse(name)
        if modules and module.split(".")[0] not in modules:
            continue
        r, t = ref[name].double(), tgt[name].double()
        if r.shape != t.shape:
            common = min(r.shape[0], t.shape[0])
            r, t = r[:common], t[:common]
        base = {"tensor": name, "layer": layer, "module": module, "expert": expert}
        if r.dim() == 3:
            per = []
            for e in range(r.shape[0]):
                m = matrix_metrics(t[e], r[e])
                per.append(m)
                rows.append(dict(base, tensor=f"{name}[{e}]", expert=e, shape=list(r.shape[1:]), **m))
            rows.append(dict(base, tensor=f"{name}[*]", experts=r.shape[0], shape=list(r.shape), **aggregate(per)))
        elif r.dim() == 2:
            rows.append(dict(base, shape=list(r.shape), **matrix_metrics(t, r)))
        else:
            rows.append(dict(base, shape=list(r.shape), **vector_metrics(t, r)))
    # Aggregates of per-expert tensors.
    groups = {}
    for row in rows:
        if row["expert"] is not None and "[" not in row["tensor"]:
            groups.setdefault((row["layer"], row["module"]), []).append(row)
    for (layer, module), group in groups.items():
        name = group[0]["tensor"].replace(f".experts.{group[0]['expert']}.", ".experts.*.")
        rows.append({"tensor": name, "layer": layer, "module": module, "expert": None, "experts": len(group),
                     "shape": [len(group)] + group[0]["shape"], **aggregate(group)})
    return rows


def aggregate(per):
    fro = float(np.sqrt(sum(m["fro"] ** 2 for m in per)))
    op = max(m["op"] for m in per)
    rfro = float(np.sqrt(sum(m["ref_fro"] ** 2 for m in per)))
    rop = max(m["ref_op"] for m in per)
    return {"fro": fro, "op": op, "stable_rank": fro * fro / (op * op), "rel_fro": fro / rfro, "rel_op": op / rop, "ref_fro": rfro, "ref_op": rop}


def summary(rows, num_layers, window):
    win = range(max(0, num_layers - window), num_layers)
    out = {}
    for row in rows:
        if row["layer"] is None or row["expert"] is not None:
            continue
        out.setdefault(row["module"], []).append(row)
    result = {}
    for module, rs in out.items():
        keys = ["op", "fro", "stable_rank", "rel_op", "rel_fro"] if "op" in rs[0] else ["l2", "linf", "rel_l2", "ref_linf"]
        entry = {"all": {}, "window": {}}
        for k in keys:
            for scope, sel in [("all", rs), ("window", [r for r in rs if r["layer"] in win])]:
                vals = [r[k] for r in sel if r[k] is not None]
                entry[scope][k] = {"median": float(np.median(vals)) if vals else None, "max": max(vals) if vals else None}
        result[module] = entry
    return result


CASES = [
    # name, ref, target, extra CLI args, window for the summary golden, --modules filter
    ("spectra-f32", "norms/spectra-ref", "norms/spectra-target", ["--window", "3"], 3, None),
    ("quarter-f32", "norms/spectra-ref", "norms/spectra-target-quarter", ["--window", "3"], 3, None),
    ("bf16", "norms/bf16-ref", "norms/bf16-target", [], 10, None),
    ("mixed-bf16-f16", "norms/bf16-ref", "norms/f16-target", [], 10, None),
    ("vocab", "norms/spectra-ref", "norms/vocab-target", ["--modules", "embed_tokens,lm_head"], 10, {"embed_tokens", "lm_head"}),
    ("moe", "norms/moe-ref", "norms/moe-target", [], 10, None),
    ("qwen2.5-vl-legacy-vs-lm", "models/qwen2-sharded", "models/qwen2_5_vl", [], 10, None),
    ("qwen2.5-vl-layouts", "models/qwen2_5_vl", "models/qwen2_5_vl-new", [], 10, None),
    ("internvl-remote-vs-lm", "models/qwen2-sharded", "models/internvl_remote", [], 10, None),
    ("llava-ov-tied-f16-vs-lm", "models/qwen2-sharded", "models/llava_onevision", [], 10, None),
    ("qwen2-tied-f32-vs-sharded-bf16", "models/qwen2", "models/qwen2-sharded", [], 10, None),
]


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    build_spectra()
    build_16bit()
    build_moe()
    cases = []
    for name, ref, target, args, window, modules in CASES:
        rows = golden_rows(ref, target, modules)
        layers = json.loads((FIXTURES / ref / "config.json").read_text())
        layers = (layers.get("text_config") or layers.get("llm_config") or layers)["num_hidden_layers"]
        cases.append({"name": name, "reference": ref, "target": target, "args": args, "rows": rows, "summary": summary(rows, layers, window)})
        hard = [r for r in rows if r.get("relative_gap") is not None and r["relative_gap"] < 1e-4]
        print(f"{name:34s} {len(rows):3d} rows; {len(hard)} with top singular values within 1e-4: "
              + ", ".join(f"{r['tensor'].replace('model.layers.', 'L')} ({r['relative_gap']:.1e})" for r in hard))
    meta = {"torch": torch.__version__, "numpy": np.__version__, "python": sys.version.split()[0]}
    (OUT / "goldens.json").write_text(json.dumps({"_meta": meta, "cases": cases}, indent=1, sort_keys=True) + "\n")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT.relative_to(ROOT)} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
