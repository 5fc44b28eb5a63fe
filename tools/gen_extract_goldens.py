#!/usr/bin/env python3
"""Goldens for `sinkmerge extract`: what a correct extraction of every VLM fixture contains.

Run by hand (see docs/commands/extract.md, "Fixtures and goldens"):

    nice -n 10 tools/.venv/bin/python tools/gen_extract_goldens.py

For every fixture (tests/fixtures/models/<vlm> from gen_fixtures.py, tests/fixtures/families/<case> from
gen_family_fixtures.py) it computes, without running sinkmerge:

1. The VLM language model's fp32 logits on fixed token ids
   (docs/commands/extract.md#checking-an-extraction-against-the-vlm), from the VLM itself:
   * natively supported VLMs: the transformers 5.23 class loaded from the fixture, called text-only;
   * remote-code VLMs (InternVL, Ovis2, MiniCPM-V, lmms-lab LLaVA-OV, MolmoE, Molmo2 on Qwen2): the stock causal LM
     the remote code builds as its language module (`language_model`, `llm`, ...) from the VLM's own sub-config and
     tensors. MolmoE (megablocks) and Molmo2 without q/k norms have no transformers class to run; their language
     modules are OLMoE and Qwen2 with the documented mapping. InternVL's InternLM2 language model is converted the
     way transformers' convert_internvl_weights_to_hf.py converts it (LlamaConfig, grouped wqkv split).
2. The reference standalone causal LM: every tensor taken from the VLM's in-memory language module (so the
   renames, row splits and expert unfusing are transformers' own where a class exists), under the target
   class's names, in the stored dtype; plus the explicit target config. It is saved to a temporary folder,
   loaded with AutoModelForCausalLM (fp32, eager) and must reproduce the VLM logits (checked, max|diff| 0).

`--only CASE [CASE ...]` recomputes just those cases and keeps the others' entries as they are.

It writes tests/fixtures/goldens/extract.json (per case: family, target class, config fields, tensor
name -> dtype/shape/sha256) and tests/fixtures/goldens/extract_logits.safetensors (per case: [T, V] f32 logits).
The Rust tests compare sinkmerge's output with the hashes and config fields; tools/check_extract.py
loads sinkmerge's output with transformers and compares the logits.
"""
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_fixtures as gf  # noqa: E402  (sets torch determinism)
import safetensors  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
IDS = gf.CHECK_IDS

# case -> (directory under tests/fixtures, family, target type, how the VLM's language module is run)
CASES = {
    "qwen2_5_vl": ("models/qwen2_5_vl", "qwen2.5-vl", "qwen2", "native"),
    "qwen2_5_vl-new": ("models/qwen2_5_vl-new", "qwen2.5-vl", "qwen2", "native"),
    "qwen3_vl": ("models/qwen3_vl", "qwen3-vl", "qwen3", "native"),
    "llava_onevision": ("models/llava_onevision", "llava-onevision", "qwen2", "native"),
    "idefics3": ("models/idefics3", "idefics3", "llama", "native"),
    "internvl_remote": ("models/internvl_remote", "internvl", "qwen2", "remote"),
    "qwen2_vl": ("families/qwen2_vl", "qwen2-vl", "qwen2", "native"),
    "qwen3_vl_moe-5x": ("families/qwen3_vl_moe-5x", "qwen3-vl-moe", "qwen3_moe", "native"),
    "qwen3_vl_moe-hub": ("families/qwen3_vl_moe-hub", "qwen3-vl-moe", "qwen3_moe", "native"),
    "llava_onevision-lmms": ("families/llava_onevision-lmms", "llava-onevision", "qwen2", "remote"),
    "llava_next": ("families/llava_next", "llava-next", "mistral", "native"),
    "internvl-hf": ("families/internvl-hf", "internvl", "qwen3", "native"),
    "ovis2-hf": ("families/ovis2-hf", "ovis2", "qwen2", "native"),
    "ovis2": ("families/ovis2", "ovis2", "qwen2", "remote"),
    "minicpm-v": ("families/minicpm-v", "minicpm-v", "qwen3", "remote"),
    "molmo2-o": ("families/molmo2-o", "molmo2", "olmo3", "native"),
    "molmo2-o-partial-rope": ("families/molmo2-o-partial-rope", "molmo2", "olmo3", "native"),
    "molmo2-o-resaved": ("families/molmo2-o-resaved", "molmo2", "olmo3", "native"),
    "molmo2-qwen3": ("families/molmo2-qwen3", "molmo2", "qwen3", "native"),
    "molmo2-qwen2": ("families/molmo2-qwen2", "molmo2", "qwen2", "remote"),
    "molmoe-megablocks": ("families/molmoe-megablocks", "molmoe", "olmoe", "remote"),
    "molmoe-hf": ("families/molmoe-hf", "molmoe", "olmoe", "remote"),
    "internvl-internlm2": ("families/internvl-internlm2", "internvl", "llama", "remote"),
}
ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
        "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "olmo3": "Olmo3ForCausalLM",
        "olmoe": "OlmoeForCausalLM"}
TORCH_DT = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def logits(model):
    ids = torch.tensor(IDS)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()[0]


def disk_tensors(d):
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def split_rope(rope_parameters):
    """A 5.x rope dict -> (rope_theta, rope_scaling); mrope is plain rope on text
    (docs/reference/vlm-layouts.md#configs)."""
    rp = dict(rope_parameters)
    theta = rp.pop("rope_theta")
    for k in ("mrope_section", "mrope_interleaved"):
        rp.pop(k, None)
    if rp.get("type") == "mrope":  # the 4.x Hub spelling survives in 5.x rope_parameters
        rp.pop("type")
    scaling = None if rp.get("rope_type", "default") == "default" and len(rp) <= 1 else rp
    return theta, scaling


# ---------------------------------------------------------------------------------------------
# The VLM's language module: logits, tensors under causal-LM names, text config
# ---------------------------------------------------------------------------------------------
def native_lm(d):
    vlm = AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager",
                                                      experts_implementation="eager")
    vlm_logits = logits(vlm)
    stored = AutoModelForImageTextToText.from_pretrained(str(d), dtype="auto")
    lm = getattr(stored.model, "language_model", None) or stored.model.text_model
    sd = {"model." + k: v for k, v in lm.state_dict().items()}
    sd["lm_head.weight"] = stored.lm_head.weight
    return vlm_logits, sd, vlm.config.get_text_config(decoder=True)


def stock_lm(cls, cfg, sd):
    """Run the stock causal LM that remote code builds, from a temporary folder (so 5.x loads it as usual)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg.save_pretrained(tmp)
        save_file({k: v.contiguous() for k, v in sd.items()}, str(Path(tmp) / "model.safetensors"),
                  metadata={"format": "pt"})
        m = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager")
        assert type(m).__name__ == cls, (type(m).__name__, cls)
        return logits(m)


def remote_lm(case, d):
    cfg = json.loads((d / "config.json").read_text())
    t = disk_tensors(d)
    if case == "internvl_remote":
        text = transformers.Qwen2Config(**cfg["llm_config"])
        sd = {k[len("language_model."):]: v for k, v in t.items() if k.startswith("language_model.")}
        return stock_lm("Qwen2ForCausalLM", text, sd), sd, text
    if case == "ovis2":
        text = transformers.Qwen2Config(**cfg["llm_config"])
        sd = {k[len("llm."):]: v for k, v in t.items() if k.startswith("llm.")}
        return stock_lm("Qwen2ForCausalLM", text, sd), sd, text
    if case == "minicpm-v":  # MiniCPMVConfig subclasses Qwen3Config: the flat fields are the LLM's
        text = transformers.Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
        sd = {k[len("llm."):]: v for k, v in t.items() if k.startswith("llm.")}
        return stock_lm("Qwen3ForCausalLM", text, sd), sd, text
    if case == "llava_onevision-lmms":  # LlavaQwenForCausalLM is Qwen2ForCausalLM plus the vision modules
        text = transformers.Qwen2Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
        skip = ("model.vision_tower.", "model.mm_projector.", "model.image_newline")
        sd = {k: v for k, v in t.items() if not k.startswith(skip)}
        return stock_lm("Qwen2ForCausalLM", text, sd), sd, text
    if case.startswith("molmoe"):
        return molmoe_lm(cfg, t)
    if case == "molmo2-qwen2":
        return molmo2_qwen2_lm(cfg, t)
    if case == "internvl-internlm2":
        return internlm2_lm(cfg, t)
    raise KeyError(case)


def molmo2_qwen2_lm(cfg, t):
    """The remote Molmo2 language model without q/k norms, pre-norm, with q/k/v biases: Qwen2's math
    (allenai/molmo2 olmo/hf_model/modeling_molmo2.py: att_proj split q | k | v, attn_out without bias)."""
    c = cfg["text_config"]
    assert c["qkv_bias"] and not c["use_qk_norm"] and not c["norm_after"], c
    H, L, hd = c["hidden_size"], c["num_hidden_layers"], c["head_dim"]
    nq, nkv, inter = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["intermediate_size"]
    text = transformers.Qwen2Config(
        vocab_size=c["vocab_size"], hidden_size=H, intermediate_size=inter, num_hidden_layers=L,
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"], head_dim=hd,
        rms_norm_eps=c["layer_norm_eps"], max_position_embeddings=c["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]}, tie_word_embeddings=False,
        use_sliding_window=False)
    m = "model.transformer."
    sd = {"model.embed_tokens.weight": t[m + "wte.embedding"][: c["vocab_size"]],
          "model.norm.weight": t[m + "ln_f.weight"], "lm_head.weight": t["lm_head.weight"]}
    for i in range(L):
        b, p = f"{m}blocks.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, v = t[b + f"self_attn.att_proj.{kind}"].split([nq, nkv, nkv], 0)
            sd.update({p + f"self_attn.q_proj.{kind}": q, p + f"self_attn.k_proj.{kind}": k,
                       p + f"self_attn.v_proj.{kind}": v})
        up, gate = t[b + "mlp.ff_proj.weight"].split([inter, inter], 0)  # `x, gate = chunk(2)`
        sd.update({p + "self_attn.o_proj.weight": t[b + "self_attn.attn_out.weight"],
                   p + "input_layernorm.weight": t[b + "attn_norm.weight"],
                   p + "post_attention_layernorm.weight": t[b + "ff_norm.weight"],
                   p + "mlp.up_proj.weight": up, p + "mlp.gate_proj.weight": gate,
                   p + "mlp.down_proj.weight": t[b + "mlp.ff_out.weight"]})
    return stock_lm("Qwen2ForCausalLM", text, sd), sd, text


# transformers' internvl/convert_internvl_weights_to_hf.py: ORIGINAL_TO_CONVERTED_KEY_MAPPING_TEXT_LLAMA and the
# config keys it drops before LlamaConfig(**llm_config)
INTERNLM2_TO_LLAMA = {r"tok_embeddings": r"embed_tokens", r"attention.wo": r"self_attn.o_proj",
                      r"feed_forward.w1": r"mlp.gate_proj", r"feed_forward.w2": r"mlp.down_proj",
                      r"feed_forward.w3": r"mlp.up_proj", r"attention_norm": r"input_layernorm",
                      r"ffn_norm": r"post_attention_layernorm", r"output": r"lm_head"}
INTERNVL_UNNECESSARY_CONFIG_KEYS = ["_name_or_path", "_attn_implementation_autoset", "auto_map", "use_bfloat16",
                                    "use_flash_attn", "bias"]


def internlm2_lm(cfg, t):
    import re
    llm = {k: v for k, v in cfg["llm_config"].items()
           if k not in INTERNVL_UNNECESSARY_CONFIG_KEYS + ["architectures", "model_type", "attn_implementation"]}
    theta = llm.pop("rope_theta")
    llm["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    text = transformers.LlamaConfig(**llm)
    groups = text.num_attention_heads // text.num_key_value_heads
    hd, H = text.head_dim, text.hidden_size
    sd = {}
    for key, w in t.items():
        if not key.startswith("language_model."):
            continue
        new = key[len("language_model."):]
        for pat, rep in INTERNLM2_TO_LLAMA.items():
            new = re.sub(pat, rep, new)
        if "attention.wqkv" in new:  # einops "(h gs d) z -> h gs d z", gs = 2 + groups
            qkv = w.reshape(-1, 2 + groups, hd, H)
            sd[new.replace("attention.wqkv", "self_attn.q_proj")] = qkv[:, :groups].reshape(-1, H)
            sd[new.replace("attention.wqkv", "self_attn.k_proj")] = qkv[:, -2].reshape(-1, H)
            sd[new.replace("attention.wqkv", "self_attn.v_proj")] = qkv[:, -1].reshape(-1, H)
        else:
            sd[new] = w
    return stock_lm("LlamaForCausalLM", text, sd), sd, text


def molmoe_lm(cfg, t):
    H, E, L = cfg["d_model"], cfg["moe_num_experts"], cfg["n_layers"]
    inter = int(cfg["mlp_hidden_size"] or cfg["mlp_ratio"] * H) // 2
    text = transformers.OlmoeConfig(
        vocab_size=cfg["embedding_size"], hidden_size=H, intermediate_size=inter, num_hidden_layers=L,
        num_attention_heads=cfg["n_heads"], num_key_value_heads=cfg["n_kv_heads"] or cfg["n_heads"],
        num_experts=E, num_experts_per_tok=cfg["moe_top_k"], norm_topk_prob=False, rms_norm_eps=cfg["layer_norm_eps"],
        rope_theta=cfg["rope_theta"], max_position_embeddings=cfg["max_position_embeddings"], clip_qkv=cfg["clip_qkv"],
        tie_word_embeddings=False, pad_token_id=cfg["pad_token_id"])
    sd = {"model.embed_tokens.weight": t["model.transformer.wte.embedding"],
          "model.norm.weight": t["model.transformer.ln_f.weight"],
          "lm_head.weight": t.get("lm_head.weight", t.get("model.transformer.ff_out.weight"))}
    for i in range(L):
        b, p = f"model.transformer.blocks.{i}.", f"model.layers.{i}."
        mega = b + "ffn.router.layer.weight" in t
        a = b if mega else b + "attn."
        q, k, v = t[a + "att_proj.weight"].split([H, H, H], 0)
        sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                   p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": t[a + "attn_out.weight"],
                   p + "self_attn.q_norm.weight": t[a + "q_norm.weight"],
                   p + "self_attn.k_norm.weight": t[a + "k_norm.weight"],
                   p + "input_layernorm.weight": t[a + "attn_norm.weight"],
                   p + "post_attention_layernorm.weight": t[(b if mega else b + "mlp.") + "ff_norm.weight"],
                   p + "mlp.gate.weight": t[b + ("ffn.router.layer.weight" if mega else "mlp.gate.weight")]})
        for e in range(E):
            x = p + f"mlp.experts.{e}."
            if mega:  # megablocks GLU: act(x w1^T) * (x v1^T) @ w2, each [E*I, H]
                rows = slice(e * inter, (e + 1) * inter)
                sd[x + "gate_proj.weight"] = t[b + "ffn.experts.mlp.w1"][rows]
                sd[x + "up_proj.weight"] = t[b + "ffn.experts.mlp.v1"][rows]
                sd[x + "down_proj.weight"] = t[b + "ffn.experts.mlp.w2"][rows].t()
            else:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    sd[x + proj + ".weight"] = t[b + f"mlp.experts.{e}.{proj}.weight"]
    return stock_lm("OlmoeForCausalLM", text, sd), sd, text


# ---------------------------------------------------------------------------------------------
# The reference standalone LM: tensors and explicit config per target
# ---------------------------------------------------------------------------------------------
def reference_tensors(case, target, sd, text, tied):
    out = {}
    for k, v in sd.items():
        if k == "lm_head.weight" and tied:
            continue
        out[k] = v
    if case.startswith("qwen3_vl_moe"):  # in memory: fused [E,2I,H] / [E,H,I]; on disk per expert
        for k in [k for k in out if k.endswith("mlp.experts.gate_up_proj")]:
            gu = out.pop(k)
            dn = out.pop(k.replace("gate_up_proj", "down_proj"))
            inter = gu.shape[1] // 2
            for e in range(gu.shape[0]):
                base = k.replace("gate_up_proj", f"{e}.")
                out[base + "gate_proj.weight"] = gu[e, :inter]
                out[base + "up_proj.weight"] = gu[e, inter:]
                out[base + "down_proj.weight"] = dn[e]
    if case.startswith("molmo2"):
        v = text.vocab_size
        out["model.embed_tokens.weight"] = out["model.embed_tokens.weight"][:v]  # drop the image tokens
        if target == "olmo3":  # 5.x molmo2 names are pre-norm-shaped; post-norm Olmo3 names them by position
            renamed = {}
            for k, t in out.items():
                k = k.replace("post_attention_layernorm", "post_feedforward_layernorm")
                k = k.replace("input_layernorm", "post_attention_layernorm")
                renamed[k] = t
            out = renamed
    return {k: v.contiguous() for k, v in out.items()}


def reference_config(target, text, tied):
    g = lambda k, default=None: getattr(text, k, default)  # noqa: E731
    rope = g("rope_parameters")
    if rope is None:  # remote-code configs read with a 5.x class keep rope_theta
        theta, scaling = g("rope_theta"), g("rope_scaling")
    else:
        theta, scaling = split_rope(rope)
    c = {"architectures": [ARCH[target]], "model_type": target, "vocab_size": g("vocab_size"),
         "hidden_size": g("hidden_size"), "intermediate_size": g("intermediate_size"),
         "num_hidden_layers": g("num_hidden_layers"), "num_attention_heads": g("num_attention_heads"),
         "num_key_value_heads": g("num_key_value_heads"), "hidden_act": g("hidden_act"),
         "rms_norm_eps": g("rms_norm_eps"), "max_position_embeddings": g("max_position_embeddings"),
         "rope_theta": float(theta), "rope_scaling": scaling, "tie_word_embeddings": tied}
    if target != "olmoe":
        c["head_dim"] = g("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if target in ("qwen2", "qwen3", "qwen3_moe"):
        c["use_sliding_window"] = False
    if target in ("qwen3", "qwen3_moe", "llama", "olmo3", "olmoe"):
        c["attention_bias"] = bool(g("attention_bias", False))
    if target == "llama":
        c["mlp_bias"] = bool(g("mlp_bias", False))
    if target == "mistral":
        c["sliding_window"] = g("sliding_window")
    if target == "qwen3_moe":
        c.update(num_experts=g("num_experts"), num_experts_per_tok=g("num_experts_per_tok"),
                 moe_intermediate_size=g("moe_intermediate_size"), norm_topk_prob=True,
                 decoder_sparse_step=g("decoder_sparse_step"), mlp_only_layers=list(g("mlp_only_layers")))
    if target == "olmoe":
        c.update(num_experts=g("num_experts"), num_experts_per_tok=g("num_experts_per_tok"),
                 norm_topk_prob=False, clip_qkv=g("clip_qkv"))
    if target == "olmo3":  # Molmo2: rope scaling on rope_scaling_layers only -> the layer_types trick (2.9)
        scaled = g("rope_scaling_layers")
        n = c["num_hidden_layers"]
        full = scaling is None or scaled is None or sorted(scaled) == list(range(n))
        c["layer_types"] = ["full_attention" if full or i in scaled else "sliding_attention" for i in range(n)]
        c["sliding_window"] = c["max_position_embeddings"]
        full_rope = dict(scaling or {"rope_type": "default"}, rope_theta=c["rope_theta"])
        c["rope_parameters"] = {"full_attention": full_rope,
                                "sliding_attention": {"rope_type": "default", "rope_theta": c["rope_theta"]}}
    return c


def reference_logits(cfg, tensors):
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file(tensors, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        m = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager")
        assert type(m).__name__ == cfg["architectures"][0], type(m).__name__
        return logits(m)


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(CASES), help="recompute only these cases")
    args = ap.parse_args()
    gold = {"_meta": {"generated_by": "tools/gen_extract_goldens.py", "torch": torch.__version__,
                      "transformers": transformers.__version__, "safetensors": safetensors.__version__,
                      "token_ids": IDS[0],
                      "note": "tensors and config of the reference causal LM that reproduces the VLM logits"}}
    all_logits = {}
    out = FIX / "goldens"
    if args.only:  # keep the other cases' entries and logits as they are
        old = json.loads((out / "extract.json").read_text())
        gold.update({k: v for k, v in old.items() if k != "_meta"})
        all_logits.update(load_file(str(out / "extract_logits.safetensors")))
    for case, (rel, family, target, kind) in CASES.items():
        if args.only and case not in args.only:
            continue
        d = FIX / rel
        on_disk = set(gf.read_header_names(d))
        if kind == "native":
            vlm_logits, sd, text = native_lm(d)
        else:
            vlm_logits, sd, text = remote_lm(case, d)
        head_names = {"lm_head.weight", "language_model.lm_head.weight", "llm.lm_head.weight",
                      "model.transformer.ff_out.weight", "language_model.output.weight"}
        # every tied fixture omits the head (docs/reference/vlm-layouts.md#tied-embeddings)
        tied = not (on_disk & head_names)
        tensors = reference_tensors(case, target, sd, text, tied)
        cfg = reference_config(target, text, tied)
        ref_logits = reference_logits(cfg, tensors)
        diff = (ref_logits - vlm_logits).abs().max().item()
        assert diff <= 1e-6, (case, diff)
        gold[case] = {
            "dir": f"tests/fixtures/{rel}", "family": family, "architecture": ARCH[target],
            "source_tensors": len(on_disk), "tied": tied, "config": cfg,
            "tensors": {k: {"dtype": TORCH_DT[v.dtype], "shape": list(v.shape),
                            "sha256": hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()}
                        for k, v in sorted(tensors.items())},
        }
        all_logits[case] = vlm_logits.contiguous()
        print(f"  {case:24s} {family:16s} -> {ARCH[target]:20s} {len(tensors):3d} tensors, tied={tied!s:5s} "
              f"reference LM vs VLM logits max|diff| {diff:.3g}")
    a, b = gold["qwen3_vl_moe-5x"]["tensors"], gold["qwen3_vl_moe-hub"]["tensors"]
    assert a == b, "the two Qwen3-VL-MoE orientations must give identical tensors"
    gold = {k: gold[k] for k in ["_meta", *CASES]}  # the CASES order, whatever was recomputed
    all_logits = {k: all_logits[k] for k in CASES}
    out.mkdir(exist_ok=True)
    gf.write_json(out / "extract.json", gold)
    save_file(all_logits, str(out / "extract_logits.safetensors"), metadata={"token_ids": json.dumps(IDS[0])})
    (out / "extract_logits.safetensors").chmod(0o644)  # safetensors writes 0600
    print(f"wrote {out / 'extract.json'} and {out / 'extract_logits.safetensors'}")


if __name__ == "__main__":
    main()
