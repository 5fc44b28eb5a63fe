#!/usr/bin/env python3
"""Parity goldens for `sinkmerge score`: attention probabilities and logits from transformers' eager attention.

Run by hand from the repository root (see docs/commands/score.md, "How parity was checked"):

    nice -n 10 tools/.venv/bin/python tools/gen_score_goldens.py

It writes, under tests/fixtures/score/:
  models/<name>/      extra tiny checkpoints for the architectures and rope types the shared fixtures lack
                      (olmo2, qwen3_moe, olmoe, a sliding-window qwen2, yarn / linear / dynamic rope, ...).
                      Their weights are "stressed" (std 0.2 instead of 0.02, random norm scales and biases)
                      so attention is peaked and a wrong rope, norm or mask shows in the probabilities.
  goldens/<case>.safetensors
                      input_ids [T] (I64), attentions [L, heads, T*(T+1)/2] (F32, the causal lower triangle
                      row by row), logits [8, V] (F32, the last 8 positions); metadata key "golden": JSON with model dir, prompt, versions, resolved rope.
  tokenization.json   token ids of AutoTokenizer (add_special_tokens=True) and of apply_chat_template
                      (add_generation_prompt=True, tokenize=True) for every fixture tokenizer flavour.

Every golden is produced with `attn_implementation="eager"`, `dtype=torch.float32`, `output_attentions=True`,
no cache, batch of one, on CPU with one thread. For models whose config exists in both dialects (the shared
fixtures' tests/fixtures/configs/*.4x.json and the 4.x-style extras), the script also loads the other dialect
and asserts identical attentions and logits, so one golden serves both.
"""
import argparse
import copy
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

import safetensors  # noqa: E402
import tokenizers  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Olmo3Config,
    OlmoeConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
SHARED = FIX / "models"
OUT = FIX / "score"
TMP = Path(tempfile.mkdtemp(prefix="sinkmerge_score_"))
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]
# Extras that the CLI and metric tests score from text (the others are parity-only, fed token ids).
WITH_TOKENIZER = {"qwen3_moe", "olmoe", "qwen3_bias", "olmo3_sw", "llama31_rope", "mistral_hd"}

# One prompt for every parity case: 22 tokens with the fixtures' tokenizer (23 with a BOS), longer than the
# sliding windows (8, 16) so the window masks are exercised.
PROMPT = "List three rivers in one line."

# Logits are kept for the last positions only (the fixtures budget); attentions cover every position.
LOGIT_ROWS = 8

DT = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}


def seed_of(name):
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little") % (2**31)


def small(vocab=320, **kw):
    d = dict(vocab_size=vocab, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, rms_norm_eps=1e-6,
             tie_word_embeddings=True, pad_token_id=301, bos_token_id=301, eos_token_id=303)
    d.update(kw)
    return d


# name -> (config class, architecture, storage dtype, kwargs, tokenizer source fixture, 4.x rewrite or None)
EXTRAS = {
    "olmo2": (Olmo2Config, "Olmo2ForCausalLM", "f16", small(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), "olmo3", None),
    "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM", "bf16", small(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
        mlp_only_layers=[0], decoder_sparse_step=1, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), "qwen2", None),
    "olmoe": (OlmoeConfig, "OlmoeForCausalLM", "bf16", small(
        num_experts=4, num_experts_per_tok=2, intermediate_size=24, norm_topk_prob=False, clip_qkv=2.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), "olmo3", None),
    "qwen2_sliding": (Qwen2Config, "Qwen2ForCausalLM", "bf16", small(
        use_sliding_window=True, sliding_window=8, max_window_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), "qwen2", "4x-no-layer-types"),
    "qwen2_yarn": (Qwen2Config, "Qwen2ForCausalLM", "bf16", small(
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16}), "qwen2", "4x-type-key"),
    "llama_linear": (LlamaConfig, "LlamaForCausalLM", "bf16", small(
        attention_bias=True, mlp_bias=True, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        "llama31-tied", "4x"),
    # max_position_embeddings 16 < the prompt's 23 tokens, so the dynamic NTK base really changes
    "llama_dynamic": (LlamaConfig, "LlamaForCausalLM", "bf16", small(
        max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
        "llama31-tied", None),
    "qwen3_bias": (Qwen3Config, "Qwen3ForCausalLM", "bf16", small(
        head_dim=16, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}), "qwen2", None),
    "olmo3_sw": (Olmo3Config, "Olmo3ForCausalLM", "bf16", small(
        num_hidden_layers=4, sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                                            "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}), "olmo3", None),
    "llama31_rope": (LlamaConfig, "LlamaForCausalLM", "bf16", small(
        bos_token_id=304, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}), "llama31-tied", None),
    "mistral_hd": (MistralConfig, "MistralForCausalLM", "bf16", small(
        head_dim=16, sliding_window=8, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "mistral", None),
}

# Parity cases: name -> model directory. The shared fixtures first (as on disk), then the extras.
SHARED_CASES = ["qwen2", "qwen2-sharded", "qwen3", "llama31-tied", "mistral", "olmo3",
                "qwen3_vl"]  # a VLM: nested text_config, model.language_model.* names, interleaved mrope
# Shared fixture -> its 4.x config (tests/fixtures/configs), checked to give the same attentions.
FOUR_X = {"qwen2": "qwen2", "qwen3": "qwen3", "llama31-tied": "llama31", "mistral": "mistral", "olmo3": "olmo3"}

# Tokenizer flavours checked for ids: plain and chat-template encodings.
TOKENIZATION_FIXTURES = ["qwen2", "llama31-tied", "mistral", "olmo3", "qwen2_5_vl", "llava_onevision", "idefics3"]
TOKENIZATION_PROMPTS = [
    PROMPT,
    "Write a haiku about autumn leaves. Use only lowercase letters and end with the word \"done\".",
    "  Leading spaces, trailing spaces, and\ttabs\t  ",
    "Ünïcödé: naïve café, 東京, emoji 🙂 and digits 12345.",
    "Answer with a JSON object {\"title\": ..., \"points\": [...]} and nothing else.",
]


def stress(model, name):
    """Peaked attention: random norm scales in [0.5, 1.5] and biases N(0, 0.2); weights already have std 0.2."""
    g = torch.Generator().manual_seed(seed_of(name + "/stress"))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif pname.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def to_4x(cfg, mode):
    """Rewrite a 5.x-saved config dict into the 4.x dialect (rope_theta + rope_scaling, torch_dtype)."""
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    if kind == "default":
        cfg["rope_scaling"] = None
    elif mode == "4x-type-key":  # the oldest spelling: "type" instead of "rope_type"
        cfg["rope_scaling"] = dict(rope, type=kind)
    else:
        cfg["rope_scaling"] = dict(rope, rope_type=kind)
    cfg["torch_dtype"] = cfg.pop("dtype")
    if mode == "4x-no-layer-types":
        cfg.pop("layer_types", None)
    cfg["transformers_version"] = "4.51.3"
    return cfg


def build_extra(name):
    cls, arch, dtype, kw, tok_src, four = EXTRAS[name]
    cfg = cls(**kw)
    cfg.architectures = [arch]
    torch.manual_seed(seed_of(name))
    model = AutoModelForCausalLM.from_config(cfg)
    stress(model, name)
    out = OUT / "models" / name
    if out.exists():
        shutil.rmtree(out)
    model.to(DT[dtype]).save_pretrained(str(out))
    for f in TOKENIZER_FILES if name in WITH_TOKENIZER else []:
        src = SHARED / tok_src / f
        if src.exists():
            shutil.copy(src, out / f)
    (out / "generation_config.json").unlink(missing_ok=True)
    if four:
        path = out / "config.json"
        five = json.loads(path.read_text())
        path.write_text(json.dumps(to_4x(five, four), indent=2, sort_keys=True) + "\n")
        other = TMP / f"{name}.5x.json"
        other.write_text(json.dumps(five, indent=2, sort_keys=True) + "\n")
        return out, other
    return out, None


def load(model_dir):
    kw = {}
    cfg = AutoConfig.from_pretrained(str(model_dir))
    if getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None):
        kw["experts_implementation"] = "eager"
    # A VLM runs text-only: its language model with multimodal RoPE on text positions.
    auto = AutoModelForImageTextToText if hasattr(cfg, "vision_config") else AutoModelForCausalLM
    m = auto.from_pretrained(str(model_dir), attn_implementation="eager", dtype=torch.float32, **kw)
    return m.eval()


def run(model_dir, ids):
    m = load(model_dir)
    with torch.no_grad():
        out = m(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
    att = torch.stack([a[0] for a in out.attentions]).float()  # [L, heads, T, T]
    assert att.dtype == torch.float32
    return att, out.logits[0].float(), m.config


def lower_triangle(att):
    t = att.shape[-1]
    rows, cols = torch.tril_indices(t, t)
    return att[..., rows, cols].contiguous()


def rope_of(cfg):
    rp = getattr(cfg.get_text_config(), "rope_parameters", None)
    return json.dumps(rp, sort_keys=True, default=str)


def golden(case, model_dir, four_x_config=None, tokenizer_dir=None):
    """Run one case; `four_x_config` is the same model's config in the other dialect, checked to agree."""
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir or model_dir))
    ids = tok(PROMPT, add_special_tokens=True)["input_ids"]
    att, logits, cfg = run(model_dir, ids)
    checked = []
    if four_x_config is not None:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            for f in model_dir.iterdir():
                if f.name != "config.json":
                    (tmp / f.name).symlink_to(f.resolve())
            shutil.copy(four_x_config, tmp / "config.json")
            att4, logits4, cfg4 = run(tmp, ids)
        assert torch.equal(att, att4), f"{case}: 4.x config changes the attentions"
        assert torch.equal(logits, logits4), f"{case}: 4.x config changes the logits"
        checked.append(str(four_x_config.relative_to(ROOT)) if four_x_config.is_relative_to(ROOT)
                       else "5.x dialect of the same config")
    meta = {
        "case": case,
        "model": str(model_dir.relative_to(ROOT)),
        "prompt": PROMPT,
        "same_for_configs": json.dumps(checked),
        "rope_parameters": rope_of(cfg),
        "layer_types": json.dumps(getattr(cfg.get_text_config(), "layer_types", None)),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "attn_implementation": "eager",
        "dtype": "float32",
    }
    tensors = {
        "input_ids": torch.tensor(ids, dtype=torch.int64),
        "attentions": lower_triangle(att),
        "logits": logits[-LOGIT_ROWS:].contiguous(),
    }
    path = OUT / "goldens" / f"{case}.safetensors"
    # One metadata key: safetensors orders a multi-key metadata map differently on every run.
    save_file(tensors, str(path), metadata={"golden": json.dumps(meta, sort_keys=True)})
    peak = att.max(dim=-1).values.mean().item()
    print(f"{case:16s} T={len(ids):3d} layers={att.shape[0]} mean row max P={peak:.3f} "
          f"rope={meta['rope_parameters'][:70]} {'(+4.x)' if checked else ''}")


def tokenization():
    out = {"_meta": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}, "cases": []}
    for name in TOKENIZATION_FIXTURES:
        d = SHARED / name
        tok = AutoTokenizer.from_pretrained(str(d))
        template = tok.chat_template
        list_content = False
        if template is None and (d / "chat_template.json").exists():
            template = json.loads((d / "chat_template.json").read_text())["chat_template"]
            list_content = True
        for prompt in TOKENIZATION_PROMPTS:
            plain = tok(prompt, add_special_tokens=True)["input_ids"]
            content = [{"type": "text", "text": prompt}] if list_content else prompt
            chat = None
            if template is not None:
                enc = tok.apply_chat_template([{"role": "user", "content": content}], chat_template=template,
                                              add_generation_prompt=True, tokenize=True)
                chat = list(enc["input_ids"])
            out["cases"].append({"fixture": name, "prompt": prompt, "ids": plain, "chat_ids": chat,
                                 "chat_template_from": None if template is None else
                                 ("chat_template.json" if list_content else "tokenizer")})
    (OUT / "tokenization.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"tokenization.json: {len(out['cases'])} cases")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args()
    (OUT / "models").mkdir(parents=True, exist_ok=True)
    gold = OUT / "goldens"
    if gold.exists():
        shutil.rmtree(gold)
    gold.mkdir(parents=True)
    other_dialect = {name: build_extra(name)[1] for name in EXTRAS}
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, safetensors {safetensors.__version__}")
    for name in SHARED_CASES:
        four = FIX / "configs" / f"{FOUR_X[name]}.4x.json" if name in FOUR_X else None
        golden(name, SHARED / name, four)
    for name in EXTRAS:
        golden(name, OUT / "models" / name, other_dialect[name], SHARED / EXTRAS[name][4])
    tokenization()


if __name__ == "__main__":
    sys.exit(main())
