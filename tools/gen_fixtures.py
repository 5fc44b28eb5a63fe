#!/usr/bin/env python3
"""Generate the tiny model fixtures of sinkmerge (tests/fixtures/{models,configs,goldens,nonfinite}).

Run by hand (see tools/README.md):

    nice -n 5 tools/.venv/bin/python tools/gen_fixtures.py

Everything is seeded; rerunning gives identical bytes. The script
  1. builds (once) and reads tools/tokenizer/corpus.txt, trains one tiny byte-level BPE tokenizer,
  2. builds each model with the real transformers 5.x class, random init, `save_pretrained`,
  3. rewrites tensor names / config.json to the on-disk layout that the Hub repos use
     (the layouts of docs/reference/vlm-layouts.md),
  4. writes 4.x/5.x config pairs (4.x ones with transformers 4.57.1 in tools/.venv4, via tools/configs_4x.py),
  5. loads every fixture back with transformers and checks it,
  6. writes tests/fixtures/goldens/inspect.json from the safetensors headers and the configs only.
"""
import argparse
import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

import safetensors  # noqa: E402
import tokenizers  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    InternVLConfig,
    InternVLForConditionalGeneration,
    LlamaConfig,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    MistralConfig,
    Olmo3Config,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen3Config,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
FIX = ROOT / "tests" / "fixtures"
TOKDIR = TOOLS / "tokenizer"
VENV4_PY = TOOLS / ".venv4" / "bin" / "python"

DT = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}
DT_NAME = {"bf16": "bfloat16", "f32": "float32", "f16": "float16"}

# ---------------------------------------------------------------------------------------------
# 1. Tokenizer
# ---------------------------------------------------------------------------------------------
# Special tokens appended after the trained BPE vocabulary (ids TRAIN_VOCAB .. TRAIN_VOCAB+18).
SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",                        # Qwen / ChatML
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",  # Llama-3
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",  # Qwen-VL
    "<image>", "<video>",                                                   # llava-hf
    "<img>", "</img>", "<IMG_CONTEXT>",                                     # InternVL
    "<fake_token_around_image>", "<end_of_utterance>",                      # Idefics3
]
TRAIN_VOCAB = 301
TOKENIZER_SIZE = TRAIN_VOCAB + len(SPECIALS)  # 320
# Qwen2 pre-tokenizer regex (as in Qwen2.5's tokenizer.json)
QWEN_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS_LICENSES = ["Apache-2.0", "BSD"]
CORPUS_MODULES = ["json", "collections", "itertools", "functools", "pathlib", "textwrap", "argparse",
                  "string", "heapq", "bisect", "shlex", "csv", "difflib", "fractions", "statistics"]


def build_corpus(path):
    """Collect local English text once; the result is committed so training never depends on the host."""
    import importlib
    parts = []
    for lic in CORPUS_LICENSES:
        parts.append(Path("/usr/share/common-licenses", lic).read_text(encoding="utf-8"))
    for mod in CORPUS_MODULES:
        m = importlib.import_module(mod)
        if m.__doc__:
            parts.append(m.__doc__)
        for name in sorted(dir(m)):
            obj = getattr(m, name)
            doc = getattr(obj, "__doc__", None)
            if not name.startswith("_") and isinstance(doc, str) and getattr(obj, "__module__", None) == mod:
                parts.append(doc)
    text = "\n\n".join(p.strip() for p in parts) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def train_base_tokenizer():
    corpus = TOKDIR / "corpus.txt"
    if not corpus.exists():
        build_corpus(corpus)
        print(f"built {corpus} ({corpus.stat().st_size} bytes)")
    text = corpus.read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE(byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=TRAIN_VOCAB, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    # one "sentence" per paragraph, fixed order
    tok.train_from_iterator([p for p in text.split("\n\n") if p.strip()], trainer=trainer)
    assert tok.get_vocab_size() == TRAIN_VOCAB, tok.get_vocab_size()
    tok.add_special_tokens(SPECIALS)
    assert tok.get_vocab_size() == TOKENIZER_SIZE
    ref = TOKDIR / "base_tokenizer.json"
    data = tok.to_str(pretty=True)
    if ref.exists() and ref.read_text(encoding="utf-8") != data:
        raise SystemExit(f"retrained tokenizer differs from {ref}; delete it to accept the new one")
    ref.write_text(data, encoding="utf-8")
    return tok


def tid(tok, s):
    i = tok.token_to_id(s)
    assert i is not None, s
    return i


QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2-VL / Qwen2.5-VL / Qwen3-VL style: string or list content
QWEN_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# llava-hf processor template: list content only (docs/commands/extract.md#what-is-written)
LLAVA_OV_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\n' + content['text'] }}{% endfor %}"
    "{{'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Idefics3 processor template: "User:...<end_of_utterance>\nAssistant:", list content
IDEFICS3_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# Tokenizer flavours per fixture. template_in: where the chat template lives on the Hub.
TOK_FLAVOURS = {
    "qwen": dict(bos=None, eos="<|im_end|>", pad="<|endoftext|>", add_bos=False, cls="Qwen2Tokenizer",
                 vocab_merges=True),
    "generic": dict(bos=None, eos="<|im_end|>", pad="<|endoftext|>", add_bos=False, cls="PreTrainedTokenizerFast",
                    vocab_merges=False),
    "llama3": dict(bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, add_bos=True, cls="PreTrainedTokenizerFast",
                   vocab_merges=False),
}


def write_tokenizer(base_tok, outdir, flavour, template, template_in_tokenizer_config, max_len,
                    extra_special=()):
    """Save via PreTrainedTokenizerFast.save_pretrained (5.x), then make tokenizer_config.json Hub-like."""
    fl = TOK_FLAVOURS[flavour]
    tok = Tokenizer.from_str(base_tok.to_str())
    if fl["add_bos"]:
        bos = fl["bos"]
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                          special_tokens=[(bos, tid(tok, bos))]),
        ])
    kw = dict(tokenizer_object=tok, model_max_length=max_len, eos_token=fl["eos"], bos_token=fl["bos"],
              pad_token=fl["pad"], unk_token=None, clean_up_tokenization_spaces=False)
    ft = PreTrainedTokenizerFast(**kw)
    ft.save_pretrained(str(outdir))
    # 5.23 writes {tokenizer.json, tokenizer_config.json, chat_template.jinja?}; rewrite the config the
    # way Hub repos (written by 4.x) carry it: explicit class, added_tokens_decoder, inline chat_template.
    cfg_path = outdir / "tokenizer_config.json"
    saved = json.loads(cfg_path.read_text())
    jinja = outdir / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()
    added = {}
    for s in SPECIALS:
        added[str(tid(tok, s))] = {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": True}
    if flavour == "llama3":  # keys of meta-llama/Llama-3.1-8B-Instruct's tokenizer_config.json
        cfg = {
            "added_tokens_decoder": added,
            "bos_token": fl["bos"],
            "clean_up_tokenization_spaces": True,
            "eos_token": fl["eos"],
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": max_len,
            "tokenizer_class": fl["cls"],
        }
        if extra_special:
            cfg["additional_special_tokens"] = list(extra_special)
    else:  # keys of Qwen/Qwen2.5-7B-Instruct's tokenizer_config.json
        cfg = {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": added,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>", *extra_special],
            "bos_token": fl["bos"],
            "clean_up_tokenization_spaces": False,
            "eos_token": fl["eos"],
            "errors": "replace",
            "model_max_length": max_len,
            "pad_token": fl["pad"],
            "split_special_tokens": False,
            "tokenizer_class": fl["cls"],
            "unk_token": None,
        }
    if template is not None and template_in_tokenizer_config:
        cfg["chat_template"] = template
    assert saved.get("eos_token") == fl["eos"], saved
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False, sort_keys=True) + "\n")
    if fl["vocab_merges"]:
        tok.model.save(str(outdir))  # vocab.json + merges.txt, as Qwen repos ship them
    return ft


def write_chat_template_json(outdir, template):
    (outdir / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2) + "\n")


def write_json(path, obj):
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_generation_config(outdir, **kw):
    GenerationConfig(**kw).save_pretrained(str(outdir))


# ---------------------------------------------------------------------------------------------
# 2. Model specs
# ---------------------------------------------------------------------------------------------
def base_text(vocab, **kw):
    d = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.02)
    d.update(kw)
    return d


def four_x(kw5):
    """The same model in 4.x spelling: rope_parameters -> rope_theta + rope_scaling."""
    kw = dict(kw5)
    rp = kw.pop("rope_parameters", None)
    if rp is not None:
        if "full_attention" in rp:  # olmo3: scaling lives on full-attention layers
            full = dict(rp["full_attention"])
            kw["rope_theta"] = full.pop("rope_theta")
            kw["rope_scaling"] = None if full.get("rope_type") == "default" else full
        else:
            rp = dict(rp)
            kw["rope_theta"] = rp.pop("rope_theta")
            kw["rope_scaling"] = None if rp.get("rope_type") == "default" and len(rp) == 1 else rp
    return kw


def run_configs_4x(items, outdir):
    return run_4x({"outdir": str(outdir), "items": items})


def run_4x(spec):
    if not VENV4_PY.exists():
        raise SystemExit(f"{VENV4_PY} missing: create tools/.venv4 as described in tools/README.md")
    spec = json.dumps(spec)
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", PYTHONHASHSEED="0")
    r = subprocess.run([str(VENV4_PY), str(TOOLS / "configs_4x.py")], input=spec, text=True,
                       capture_output=True, env=env)
    if r.returncode != 0:
        raise SystemExit("configs_4x.py failed:\n" + r.stdout + r.stderr)
    print(r.stdout.strip())
    return r.stdout.strip().splitlines()[-1].split()[-1]


def hubify_4x(cfg, rename_dtype=True):
    """4.57 writes `dtype`; configs written by <=4.55 (most Hub repos) say `torch_dtype`."""
    cfg = json.loads(json.dumps(cfg))

    def fix(d):
        if rename_dtype and "dtype" in d:
            d["torch_dtype"] = d.pop("dtype")
        for v in d.values():
            if isinstance(v, dict):
                fix(v)
    fix(cfg)
    return cfg


def save_model(model, outdir, dtype, **kw):
    model = model.to(DT[dtype])
    model.save_pretrained(str(outdir), **kw)
    return model


def rename_single_file(path, fn):
    """Rename tensors of one safetensors file; fn(name, tensors) -> list[(new_name, tensor)]."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    out = {}
    for name in sorted(tensors):
        for new, t in fn(name, tensors[name]):
            assert new not in out, new
            out[new] = t.contiguous()
    save_file(out, str(path), metadata=meta)
    return out


def lm_kwargs(name, tok):
    eot, eos, bos = tid(tok, "<|endoftext|>"), tid(tok, "<|im_end|>"), tid(tok, "<|begin_of_text|>")
    if name == "qwen2":
        return Qwen2Config, "Qwen2ForCausalLM", "f32", base_text(
            320, tie_word_embeddings=True, rms_norm_eps=1e-6, use_sliding_window=False, max_window_layers=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            bos_token_id=eot, eos_token_id=eos, max_position_embeddings=32768)
    if name == "qwen2-sharded":
        return Qwen2Config, "Qwen2ForCausalLM", "bf16", base_text(
            384, tie_word_embeddings=False, rms_norm_eps=1e-6, use_sliding_window=False, max_window_layers=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            bos_token_id=eot, eos_token_id=eos, max_position_embeddings=32768)
    if name == "qwen3":
        return Qwen3Config, "Qwen3ForCausalLM", "bf16", base_text(
            384, head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-6, attention_bias=False,
            use_sliding_window=False, max_window_layers=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            bos_token_id=eot, eos_token_id=eos, max_position_embeddings=40960)
    if name == "llama31-tied":
        return LlamaConfig, "LlamaForCausalLM", "bf16", base_text(
            320, head_dim=16, tie_word_embeddings=True, rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            bos_token_id=bos, eos_token_id=[eot, tid(tok, "<|eot_id|>")], max_position_embeddings=131072)
    if name == "mistral":
        return MistralConfig, "MistralForCausalLM", "f16", base_text(
            320, head_dim=16, tie_word_embeddings=False, rms_norm_eps=1e-5, sliding_window=8,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            bos_token_id=eot, eos_token_id=eos, max_position_embeddings=32768)
    if name == "olmo3":
        yarn = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                "attention_factor": 1.2079441541679836, "beta_fast": 32.0, "beta_slow": 1.0}
        return Olmo3Config, "Olmo3ForCausalLM", "bf16", base_text(
            352, num_hidden_layers=4, tie_word_embeddings=False, rms_norm_eps=1e-6, attention_bias=False,
            sliding_window=16, layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={"full_attention": yarn,
                             "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}},
            bos_token_id=None, eos_token_id=eot, pad_token_id=eot, max_position_embeddings=512)
    raise KeyError(name)


LM_TOK = {"qwen2": "qwen", "qwen2-sharded": "qwen", "qwen3": "qwen", "llama31-tied": "llama3",
          "mistral": "generic", "olmo3": "generic"}
LM_GEN = {  # generation_config.json contents (ids filled in later)
    "qwen2": dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    "qwen2-sharded": dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    "qwen3": dict(do_sample=True, temperature=0.6, top_p=0.95, top_k=20),
    "llama31-tied": dict(do_sample=True, temperature=0.6, top_p=0.9),
    "mistral": dict(),
    "olmo3": dict(do_sample=True, temperature=0.6, top_p=0.95),
}
CONFIG_PAIRS = {"qwen2": "qwen2", "qwen3": "qwen3", "llama31": "llama31-tied", "mistral": "mistral",
                "olmo3": "olmo3"}


def build_lm(name, tok, tmp):
    cls, arch, dtype, kw = lm_kwargs(name, tok)
    cfg = cls(**kw)
    cfg.architectures = [arch]
    torch.manual_seed(hash_str(name) % (2**31))
    model = AutoModelForCausalLM.from_config(cfg)
    out = tmp / name
    extra = {"max_shard_size": "100KB"} if name == "qwen2-sharded" else {}
    save_model(model, out, dtype, **extra)
    gen = dict(LM_GEN[name])
    eos = kw["eos_token_id"]
    ids = dict(bos_token_id=kw.get("bos_token_id"), eos_token_id=eos,
               pad_token_id=kw.get("pad_token_id", tid(tok, "<|endoftext|>")))
    if name.startswith("qwen"):
        ids["eos_token_id"] = [tid(tok, "<|im_end|>"), tid(tok, "<|endoftext|>")]
    write_generation_config(out, **ids, **gen)
    tmpl = LLAMA3_TEMPLATE if LM_TOK[name] == "llama3" else QWEN_TEMPLATE
    write_tokenizer(tok, out, LM_TOK[name], tmpl, True, kw["max_position_embeddings"])
    return out, cls, arch, dtype, kw


def hash_str(s):
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:4], "little")


# ------------------------------- VLMs -------------------------------------------------------
def q25_config(tok):
    text = base_text(384, tie_word_embeddings=False, rms_norm_eps=1e-6, use_sliding_window=False,
                     sliding_window=32768, max_window_layers=2, max_position_embeddings=128000,
                     rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000000.0},
                     bos_token_id=tid(tok, "<|endoftext|>"), eos_token_id=tid(tok, "<|im_end|>"))
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1],
                  tokens_per_second=2, in_channels=3)
    ids = dict(image_token_id=tid(tok, "<|image_pad|>"), video_token_id=tid(tok, "<|video_pad|>"),
               vision_start_token_id=tid(tok, "<|vision_start|>"), vision_end_token_id=tid(tok, "<|vision_end|>"))
    return text, vision, ids


def q25_flat_hub_config(text, vision, ids, tok):
    """Hand-written flat config in the schema of Qwen/Qwen2.5-VL-7B-Instruct's config.json (docs/reference/vlm-layouts.md#qwen25-vl)."""
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "attention_dropout": 0.0,
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "vision_start_token_id": ids["vision_start_token_id"],
        "vision_end_token_id": ids["vision_end_token_id"],
        "vision_token_id": tid(tok, "<|vision_pad|>"),
        "image_token_id": ids["image_token_id"],
        "video_token_id": ids["video_token_id"],
        "hidden_act": "silu",
        "hidden_size": text["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": text["intermediate_size"],
        "max_position_embeddings": text["max_position_embeddings"],
        "max_window_layers": text["max_window_layers"],
        "model_type": "qwen2_5_vl",
        "num_attention_heads": text["num_attention_heads"],
        "num_hidden_layers": text["num_hidden_layers"],
        "num_key_value_heads": text["num_key_value_heads"],
        "rms_norm_eps": text["rms_norm_eps"],
        "rope_theta": text["rope_parameters"]["rope_theta"],
        "sliding_window": text["sliding_window"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.41.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": {
            "depth": vision["depth"],
            "hidden_act": "silu",
            "hidden_size": vision["hidden_size"],
            "intermediate_size": vision["intermediate_size"],
            "num_heads": vision["num_heads"],
            "in_chans": 3,
            "out_hidden_size": vision["out_hidden_size"],
            "patch_size": vision["patch_size"],
            "spatial_merge_size": vision["spatial_merge_size"],
            "spatial_patch_size": vision["patch_size"],
            "window_size": vision["window_size"],
            "fullatt_block_indexes": vision["fullatt_block_indexes"],
            "tokens_per_second": vision["tokens_per_second"],
            "temporal_patch_size": vision["temporal_patch_size"],
        },
        "rope_scaling": {"type": "mrope", "mrope_section": text["rope_parameters"]["mrope_section"]},
        "vocab_size": text["vocab_size"],
    }


def qwen_vl_preprocessor(patch, proc):
    return {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
            "image_processor_type": "Qwen2VLImageProcessor", "max_pixels": 12845056, "merge_size": 2,
            "min_pixels": 3136, "patch_size": patch, "processor_class": proc, "resample": 3,
            "rescale_factor": 0.00392156862745098, "temporal_patch_size": 2}


def qwen_vl_common_files(out, tok, text):
    write_generation_config(out, bos_token_id=text["bos_token_id"], pad_token_id=tid(tok, "<|endoftext|>"),
                            eos_token_id=[tid(tok, "<|im_end|>"), tid(tok, "<|endoftext|>")], do_sample=True,
                            temperature=0.1, top_p=0.001, top_k=1, repetition_penalty=1.05)
    write_tokenizer(tok, out, "qwen", QWEN_VL_TEMPLATE, True, 32768,
                    extra_special=["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                                   "<|video_pad|>"])
    write_chat_template_json(out, QWEN_VL_TEMPLATE)


def build_qwen2_5_vl(tok, tmp):
    text, vision, ids = q25_config(tok)
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(hash_str("qwen2_5_vl") % (2**31))
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    legacy, new = tmp / "qwen2_5_vl", tmp / "qwen2_5_vl-new"
    save_model(model, legacy, "bf16")
    saved = sorted(read_header_names(legacy))
    assert any(k.startswith("model.layers.") for k in saved) and any(k.startswith("visual.") for k in saved), \
        "expected 5.23 save_pretrained to write the legacy Qwen2.5-VL layout"
    # -new: the same bytes under post-4.52 names (docs/reference/vlm-layouts.md#qwen2-vl); config as 5.23
    # saved it
    shutil.copytree(legacy, new)

    def to_new(name, t):
        if name.startswith("visual."):
            return [("model.visual." + name[len("visual."):], t)]
        if name.startswith("model."):
            return [("model.language_model." + name[len("model."):], t)]
        return [(name, t)]
    rename_single_file(new / "model.safetensors", to_new)
    # legacy: flat 4.x-style Hub config (hand-written, docs/reference/vlm-layouts.md#qwen25-vl)
    write_json(legacy / "config.json", q25_flat_hub_config(text, vision, ids, tok))
    for d in (legacy, new):
        qwen_vl_common_files(d, tok, text)
        write_json(d / "preprocessor_config.json", qwen_vl_preprocessor(vision["patch_size"], "Qwen2_5_VLProcessor"))
    return legacy, new


def build_qwen3_vl(tok, tmp, cfg4_dir):
    text, vision, ids = _q3vl_parts(tok)
    cfg = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    cfg.architectures = ["Qwen3VLForConditionalGeneration"]
    torch.manual_seed(hash_str("qwen3_vl") % (2**31))
    model = Qwen3VLForConditionalGeneration(cfg)
    out = tmp / "qwen3_vl"
    save_model(model, out, "bf16")
    # config.json: as transformers 4.57 writes it (the Hub Qwen3-VL configs come from 4.57.0.dev0 and say "dtype")
    c4 = json.loads((cfg4_dir / "qwen3_vl.json").read_text())
    write_json(out / "config.json", c4)
    qwen_vl_common_files(out, tok, text)
    write_json(out / "preprocessor_config.json", qwen_vl_preprocessor(vision["patch_size"], "Qwen3VLProcessor"))
    write_json(out / "video_preprocessor_config.json",
               dict(qwen_vl_preprocessor(vision["patch_size"], "Qwen3VLProcessor"),
                    video_processor_type="Qwen3VLVideoProcessor", fps=2))
    return out, text, vision, ids


def qwen3_vl_4x_item(text, vision, ids):
    t = dict(four_x(text), dtype="bfloat16")
    return {"name": "qwen3_vl", "class": "Qwen3VLConfig", "architectures": ["Qwen3VLForConditionalGeneration"],
            "kwargs": dict(text_config=t, vision_config=vision, tie_word_embeddings=False, dtype="bfloat16", **ids)}


def ov_parts(tok):
    text = base_text(384, model_type="qwen2", tie_word_embeddings=True, rms_norm_eps=1e-6, use_sliding_window=False,
                     max_window_layers=2, max_position_embeddings=32768, rope_theta=1000000.0,
                     bos_token_id=tid(tok, "<|endoftext|>"), eos_token_id=tid(tok, "<|im_end|>"))
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=8, patch_size=4, vision_use_head=False, layer_norm_eps=1e-6)
    top = dict(image_token_index=tid(tok, "<image>"), video_token_index=tid(tok, "<video>"),
               vision_feature_layer=-1, vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
               image_grid_pinpoints=[[8, 8], [8, 16], [16, 8], [16, 16]])
    return text, vision, top


def build_llava_onevision(tok, tmp, cfg4_dir):
    text, vision, top = ov_parts(tok)
    t5 = dict(text)
    t5["rope_parameters"] = {"rope_type": "default", "rope_theta": t5.pop("rope_theta")}
    cfg = LlavaOnevisionConfig(text_config=t5, vision_config=vision, **top)
    cfg.architectures = ["LlavaOnevisionForConditionalGeneration"]
    torch.manual_seed(hash_str("llava_onevision") % (2**31))
    model = LlavaOnevisionForConditionalGeneration(cfg)
    native = tmp / "_llava_onevision_native"
    save_model(model, native, "f16")
    names = read_header_names(native)
    assert any(k.startswith("language_model.model.") for k in names), "expected legacy llava-hf layout"
    # 5.23 strips SiglipVisionModel's `vision_model.` level in memory (conversion_mapping: PrefixChange) and does
    # not put it back on save; llava-hf Hub repos have `vision_tower.vision_model.*`
    # (docs/reference/vlm-layouts.md#llava-onevision, layout b).
    assert not any(k.startswith("vision_tower.vision_model.") for k in names)
    out = tmp / "llava_onevision"
    shutil.copytree(native, out)

    def hub_vision(name, t):
        if name.startswith("vision_tower."):
            return [("vision_tower.vision_model." + name[len("vision_tower."):], t)]
        return [(name, t)]
    rename_single_file(out / "model.safetensors", hub_vision)
    # config.json: as 4.57 writes it, with torch_dtype (llava-hf repos were converted with 4.4x)
    write_json(out / "config.json", hubify_4x(json.loads((cfg4_dir / "llava_onevision.json").read_text())))
    write_generation_config(out, bos_token_id=text["bos_token_id"], eos_token_id=text["eos_token_id"],
                            pad_token_id=tid(tok, "<|endoftext|>"))
    write_tokenizer(tok, out, "qwen", None, False, 32768, extra_special=["<image>", "<video>"])
    write_chat_template_json(out, LLAVA_OV_TEMPLATE)
    write_json(out / "preprocessor_config.json", {
        "do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
        "image_grid_pinpoints": top["image_grid_pinpoints"], "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "LlavaOnevisionImageProcessor", "image_std": [0.5, 0.5, 0.5],
        "processor_class": "LlavaOnevisionProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
        "size": {"height": 8, "width": 8}})
    write_json(out / "processor_config.json", {"num_image_tokens": 4, "processor_class": "LlavaOnevisionProcessor",
                                               "vision_feature_select_strategy": "full"})
    return out


def build_idefics3(tok, tmp):
    eou = tid(tok, "<end_of_utterance>")
    text = base_text(320, model_type="llama", head_dim=16, tie_word_embeddings=False, rms_norm_eps=1e-5,
                     max_position_embeddings=131072, bos_token_id=tid(tok, "<|begin_of_text|>"),
                     eos_token_id=eou, pad_token_id=tid(tok, "<|endoftext|>"),
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                  patch_size=4)
    cfg = Idefics3Config(text_config=text, vision_config=vision, image_token_id=tid(tok, "<image>"), scale_factor=2,
                         tie_word_embeddings=False, pad_token_id=tid(tok, "<|endoftext|>"))
    cfg.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(hash_str("idefics3") % (2**31))
    model = Idefics3ForConditionalGeneration(cfg)
    out = tmp / "idefics3"
    save_model(model, out, "bf16")  # config.json: as 5.23 saved it
    write_generation_config(out, bos_token_id=text["bos_token_id"], eos_token_id=[eou, tid(tok, "<|eot_id|>")],
                            pad_token_id=tid(tok, "<|endoftext|>"))
    write_tokenizer(tok, out, "llama3", None, False, 131072,
                    extra_special=["<fake_token_around_image>", "<image>", "<end_of_utterance>"])
    write_chat_template_json(out, IDEFICS3_TEMPLATE)
    write_json(out / "preprocessor_config.json", {
        "do_convert_rgb": True, "do_image_splitting": True, "do_normalize": True, "do_pad": True,
        "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Idefics3ImageProcessor", "image_std": [0.5, 0.5, 0.5],
        "max_image_size": {"longest_edge": 8}, "processor_class": "Idefics3Processor", "resample": 1,
        "rescale_factor": 0.00392156862745098, "size": {"longest_edge": 16}})
    write_json(out / "processor_config.json", {"image_seq_len": 1, "processor_class": "Idefics3Processor"})
    return out


# InternVL: transformers' native class -> OpenGVLab remote-code names (inverse of
# ORIGINAL_TO_CONVERTED_KEY_MAPPING_* in transformers' internvl/convert_internvl_weights_to_hf.py)
INTERNVL_VISION_MAP = [
    (r"^vision_tower\.embeddings\.cls_token$", "vision_model.embeddings.class_embedding"),
    (r"^vision_tower\.embeddings\.position_embeddings$", "vision_model.embeddings.position_embedding"),
    (r"^vision_tower\.embeddings\.patch_embeddings\.projection\.(weight|bias)$",
     r"vision_model.embeddings.patch_embedding.\1"),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.projection_layer\.(weight|bias)$",
     r"vision_model.encoder.layers.\1.attn.proj.\2"),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.(q_norm|k_norm)\.(weight|bias)$",
     r"vision_model.encoder.layers.\1.attn.\2.\3"),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.lambda_(1|2)$", r"vision_model.encoder.layers.\1.ls\2"),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.layernorm_before\.(weight|bias)$",
     r"vision_model.encoder.layers.\1.norm1.\2"),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.layernorm_after\.(weight|bias)$",
     r"vision_model.encoder.layers.\1.norm2.\2"),
    (r"^vision_tower\.encoder\.layer\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)$",
     r"vision_model.encoder.layers.\1.mlp.\2.\3"),
    (r"^multi_modal_projector\.layer_norm\.(weight|bias)$", r"mlp1.0.\1"),
    (r"^multi_modal_projector\.linear_1\.(weight|bias)$", r"mlp1.1.\1"),
    (r"^multi_modal_projector\.linear_2\.(weight|bias)$", r"mlp1.3.\1"),
    (r"^(language_model\.(model\..*|lm_head\.weight))$", r"\1"),
]
QKV_RE = re.compile(r"^vision_tower\.encoder\.layer\.(\d+)\.attention\.(q|k|v)_proj\.(weight|bias)$")


def internvl_native_to_remote(tensors):
    out, qkv = {}, {}
    for name in sorted(tensors):
        m = QKV_RE.match(name)
        if m:
            qkv.setdefault((int(m.group(1)), m.group(3)), {})[m.group(2)] = tensors[name]
            continue
        for pat, rep in INTERNVL_VISION_MAP:
            if re.match(pat, name):
                out[re.sub(pat, rep, name)] = tensors[name]
                break
        else:
            raise SystemExit(f"internvl_remote: no mapping for {name}")
    for (i, kind), parts in sorted(qkv.items()):
        assert set(parts) == {"q", "k", "v"}, (i, kind, parts.keys())
        out[f"vision_model.encoder.layers.{i}.attn.qkv.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]], 0)
    return out


def internvl_remote_to_native(tensors, dim):
    inv = {}
    for name, t in tensors.items():
        m = re.match(r"^vision_model\.encoder\.layers\.(\d+)\.attn\.qkv\.(weight|bias)$", name)
        if m:
            for j, k in enumerate("qkv"):
                inv[f"vision_tower.encoder.layer.{m.group(1)}.attention.{k}_proj.{m.group(2)}"] = t[j * dim:(j + 1) * dim]
            continue
        back = {
            "vision_model.embeddings.class_embedding": "vision_tower.embeddings.cls_token",
            "vision_model.embeddings.position_embedding": "vision_tower.embeddings.position_embeddings",
        }
        if name in back:
            inv[back[name]] = t
            continue
        n = name
        n = re.sub(r"^vision_model\.embeddings\.patch_embedding\.", "vision_tower.embeddings.patch_embeddings.projection.", n)
        n = re.sub(r"^vision_model\.encoder\.layers\.(\d+)\.attn\.proj\.", r"vision_tower.encoder.layer.\1.attention.projection_layer.", n)
        n = re.sub(r"^vision_model\.encoder\.layers\.(\d+)\.ls(\d)$", r"vision_tower.encoder.layer.\1.lambda_\2", n)
        n = re.sub(r"^vision_model\.encoder\.layers\.(\d+)\.norm1\.", r"vision_tower.encoder.layer.\1.layernorm_before.", n)
        n = re.sub(r"^vision_model\.encoder\.layers\.(\d+)\.norm2\.", r"vision_tower.encoder.layer.\1.layernorm_after.", n)
        n = re.sub(r"^vision_model\.encoder\.layers\.(\d+)\.mlp\.", r"vision_tower.encoder.layer.\1.mlp.", n)
        n = re.sub(r"^mlp1\.0\.", "multi_modal_projector.layer_norm.", n)
        n = re.sub(r"^mlp1\.1\.", "multi_modal_projector.linear_1.", n)
        n = re.sub(r"^mlp1\.3\.", "multi_modal_projector.linear_2.", n)
        inv[n] = t
    return inv


def internvl_parts(tok):
    text = base_text(384, tie_word_embeddings=False, rms_norm_eps=1e-6, use_sliding_window=False,
                     max_window_layers=2, max_position_embeddings=32768, bos_token_id=tid(tok, "<|endoftext|>"),
                     eos_token_id=tid(tok, "<|endoftext|>"))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                  patch_size=4, attention_bias=True, use_qk_norm=False, norm_type="layer_norm", hidden_act="gelu",
                  layer_norm_eps=1e-6, use_mean_pooling=True, layer_scale_init_value=0.1)
    return text, vision


def build_internvl_remote(tok, tmp, cfg4_dir):
    text, vision = internvl_parts(tok)
    t5 = dict(text, model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    cfg = InternVLConfig(text_config=t5, vision_config=vision, image_token_id=tid(tok, "<IMG_CONTEXT>"),
                         downsample_ratio=0.5, tie_word_embeddings=False, image_seq_length=1)
    cfg.architectures = ["InternVLForConditionalGeneration"]
    torch.manual_seed(hash_str("internvl_remote") % (2**31))
    model = InternVLForConditionalGeneration(cfg)
    native = tmp / "_internvl_native"
    save_model(model, native, "bf16")
    out = tmp / "internvl_remote"
    out.mkdir()
    with safe_open(str(native / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(native / "model.safetensors"))
    remote = internvl_native_to_remote(tensors)
    save_file(remote, str(out / "model.safetensors"), metadata=meta)
    # config.json in the remote-code schema (OpenGVLab InternVL3 repos); llm_config = full 4.x Qwen2Config dict
    llm = hubify_4x(json.loads((cfg4_dir / "internvl_llm_config.json").read_text()))
    llm["use_bfloat16"] = True
    llm["_name_or_path"] = "./pretrained/Qwen2.5-0.5B-Instruct"
    rcfg = {
        "_commit_hash": None,
        "architectures": ["InternVLChatModel"],
        "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
                     "AutoModel": "modeling_internvl_chat.InternVLChatModel",
                     "AutoModelForCausalLM": "modeling_internvl_chat.InternVLChatModel"},
        "downsample_ratio": 0.5,
        "dynamic_image_size": True,
        "force_image_size": vision["image_size"],
        "hidden_size": text["hidden_size"],
        "image_fold": None,
        "llm_config": llm,
        "max_dynamic_patch": 12,
        "min_dynamic_patch": 1,
        "model_type": "internvl_chat",
        "pad2square": False,
        "ps_version": "v2",
        "select_layer": -1,
        "system_message": None,
        "template": "internvl2_5",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": None,
        "use_backbone_lora": 0,
        "use_llm_lora": 0,
        "use_thumbnail": True,
        "vision_config": {
            "architectures": ["InternVisionModel"],
            "attention_dropout": 0.0,
            "drop_path_rate": 0.0,
            "dropout": 0.0,
            "hidden_act": vision["hidden_act"],
            "hidden_size": vision["hidden_size"],
            "image_size": vision["image_size"],
            "initializer_factor": 0.1,
            "initializer_range": 1e-10,
            "intermediate_size": vision["intermediate_size"],
            "layer_norm_eps": vision["layer_norm_eps"],
            "model_type": "intern_vit_6b",
            "norm_type": vision["norm_type"],
            "num_attention_heads": vision["num_attention_heads"],
            "num_channels": 3,
            "num_hidden_layers": vision["num_hidden_layers"],
            "patch_size": vision["patch_size"],
            "qk_normalization": False,
            "qkv_bias": True,
            "torch_dtype": "bfloat16",
            "use_bfloat16": True,
            "use_flash_attn": False,
        },
    }
    write_json(out / "config.json", rcfg)
    write_generation_config(out, eos_token_id=[tid(tok, "<|im_end|>"), tid(tok, "<|endoftext|>")])
    write_tokenizer(tok, out, "qwen", QWEN_TEMPLATE, True, 8192,
                    extra_special=["<img>", "</img>", "<IMG_CONTEXT>"])
    write_json(out / "preprocessor_config.json", {
        "crop_size": 8, "do_center_crop": True, "do_normalize": True, "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": [0.485, 0.456, 0.406],
        "image_std": [0.229, 0.224, 0.225], "resample": 3, "size": 8})
    placeholder = ("# Placeholder for the OpenGVLab remote-code file of the same name (fixture only; not importable\n"
                   "# model code). Real repos ship it; extraction must not copy *.py (docs/commands/extract.md#what-is-written).\n")
    for py in ("configuration_internvl_chat.py", "modeling_internvl_chat.py", "conversation.py"):
        (out / py).write_text(placeholder)
    return out, native, model


# ---------------------------------------------------------------------------------------------
# 3. Non-finite fixture
# ---------------------------------------------------------------------------------------------
def build_nonfinite(tok, tmp):
    out = tmp / "nonfinite"
    cfg = Qwen2Config(**base_text(320, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                  num_key_value_heads=1, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                  bos_token_id=tid(tok, "<|endoftext|>"), eos_token_id=tid(tok, "<|im_end|>")))
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(hash_str("nonfinite") % (2**31))
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    nan_t, inf_t = "model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    nan_idx, inf_idx = (5, 17), (3, 9)
    sd = model.state_dict()
    with torch.no_grad():
        sd[nan_t][nan_idx] = float("nan")
        sd[inf_t][inf_idx] = float("inf")
    model.save_pretrained(str(out))
    write_tokenizer(tok, out, "qwen", QWEN_TEMPLATE, True, 32768)
    tensors = load_file(str(out / "model.safetensors"))
    nonfinite = {k: (int(torch.isnan(v.float()).sum()), int(torch.isinf(v.float()).sum())) for k, v in tensors.items()}
    bad = {k: v for k, v in nonfinite.items() if v != (0, 0)}
    assert bad == {nan_t: (1, 0), inf_t: (0, 1)}, bad
    shape = lambda k: list(tensors[k].shape)  # noqa: E731
    expected = {
        "file": "model.safetensors",
        "dtype": "BF16",
        "num_tensors": len(tensors),
        "nonfinite_tensors": [
            {"tensor": nan_t, "kind": "nan", "nan": 1, "pos_inf": 0, "neg_inf": 0, "shape": shape(nan_t),
             "index": list(nan_idx), "flat_index": nan_idx[0] * shape(nan_t)[1] + nan_idx[1]},
            {"tensor": inf_t, "kind": "+inf", "nan": 0, "pos_inf": 1, "neg_inf": 0, "shape": shape(inf_t),
             "index": list(inf_idx), "flat_index": inf_idx[0] * shape(inf_t)[1] + inf_idx[1]},
        ],
        "all_other_tensors_finite": True,
    }
    write_json(out / "expected.json", expected)
    return out


# ---------------------------------------------------------------------------------------------
# 4. Goldens (headers + configs only; independent of transformers' modelling code)
# ---------------------------------------------------------------------------------------------
FAMILY = {"qwen2_vl": "qwen2-vl", "qwen2_5_vl": "qwen2.5-vl", "qwen3_vl": "qwen3-vl", "qwen3_vl_moe": "qwen3-vl-moe",
          "llava_onevision": "llava-onevision", "llava_next": "llava-next", "internvl_chat": "internvl",
          "internvl": "internvl", "idefics3": "idefics3", "ovis": "ovis2", "ovis2": "ovis2",
          "minicpmv": "minicpm-v", "molmo2": "molmo2", "molmo": "molmoe"}
TEXT_PREFIX_SKIP = ("visual.", "model.visual.", "vision_tower.", "model.vision_model.", "vision_model.")


def read_header_names(d):
    names = []
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            with safe_open(str(Path(d) / fn), "pt") as f:
                names += list(f.keys())
    return names


def class_default_tie(model_type):
    try:
        cls = transformers.CONFIG_MAPPING[model_type]
        return bool(getattr(cls(), "tie_word_embeddings", False))
    except Exception:
        return None


def golden(d):
    cfg = json.loads((d / "config.json").read_text())
    files = sorted(fn for fn in os.listdir(d) if fn.endswith(".safetensors"))
    dtypes, nparams, ntensors, shapes = {}, 0, 0, {}
    for fn in files:
        with safe_open(str(d / fn), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                shp = sl.get_shape()
                dt = sl.get_dtype()
                n = 1
                for s in shp:
                    n *= s
                nparams += n
                ntensors += 1
                dtypes[dt] = dtypes.get(dt, 0) + 1
                shapes[k] = shp
    text = cfg.get("text_config") or cfg.get("llm_config") or cfg
    text_level = "text_config" if "text_config" in cfg else ("llm_config" if "llm_config" in cfg else None)
    comment = None
    if text_level and "tie_word_embeddings" in cfg[text_level]:
        tie = cfg[text_level]["tie_word_embeddings"]
    elif "tie_word_embeddings" in cfg:
        tie = cfg["tie_word_embeddings"]
    else:
        tie = class_default_tie(cfg["model_type"])
        comment = f"tie_word_embeddings absent from config.json; class default of {cfg['model_type']}"
    nh = text["num_attention_heads"]
    hd = text.get("head_dim") or text["hidden_size"] // nh
    qn = sorted(k for k in shapes if k.endswith("self_attn.q_norm.weight") and not k.startswith(TEXT_PREFIX_SKIP))
    if not qn:
        qk = "none"
    else:
        s = shapes[qn[0]]
        qk = "per-head" if s == [hd] else ("layerwise" if s == [nh * hd] else f"unknown {s}")
    g = {
        "architecture": cfg["architectures"][0],
        "model_type": cfg["model_type"],
        "family": FAMILY.get(cfg["model_type"]),
        "num_parameters": nparams,
        "num_tensors": ntensors,
        "num_layers": text["num_hidden_layers"],
        "qk_norm": qk,
        "dtypes": dict(sorted(dtypes.items())),
        "shards": len(files),
        "tie_word_embeddings": tie,
    }
    if comment:
        g["comment"] = comment
    return g


# ---------------------------------------------------------------------------------------------
# 5. Verification with transformers 5.x
# ---------------------------------------------------------------------------------------------
CHECK_IDS = [[5, 40, 77, 120, 250, 300, 17, 9]]


def check_load(name, d, kind):
    ids = torch.tensor(CHECK_IDS)
    if kind == "lm":
        m, info = AutoModelForCausalLM.from_pretrained(str(d), output_loading_info=True, dtype=torch.float32,
                                                       attn_implementation="eager")
    else:
        m, info = AutoModelForImageTextToText.from_pretrained(str(d), output_loading_info=True, dtype=torch.float32,
                                                              attn_implementation="eager")
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys",
                                                         "error_msgs")}
    assert not bad, (name, bad)
    m.eval()
    with torch.no_grad():
        logits = m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.isfinite(logits).all(), name
    print(f"  load OK {name:18s} {type(m).__name__:42s} logits {tuple(logits.shape)} |logit|max {logits.abs().max():.4f}")
    return m, logits


def check_tokenizer(name, d):
    if name == "internvl_remote":  # AutoTokenizer would read config.json's auto_map and ask for trust_remote_code
        t = transformers.Qwen2Tokenizer.from_pretrained(str(d))
    else:
        t = AutoTokenizer.from_pretrained(str(d))
    enc = t("Licensed under the Apache License.").input_ids
    assert len(t) == TOKENIZER_SIZE, (name, len(t))
    if "chat_template" in json.loads((d / "tokenizer_config.json").read_text()):
        txt = t.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                    add_generation_prompt=True)
        assert "Hi there" in txt, txt
    return type(t).__name__, enc


def check_config_pairs(cfgdir):
    report = {}
    for pair in sorted(CONFIG_PAIRS):
        c4 = AutoConfig.from_pretrained(str(cfgdir / f"{pair}.4x.json"))
        c5 = AutoConfig.from_pretrained(str(cfgdir / f"{pair}.5x.json"))
        r4, r5 = c4.rope_parameters, c5.rope_parameters
        assert r4 == r5, (pair, r4, r5)
        d4, d5 = c4.to_dict(), c5.to_dict()
        diff = sorted(k for k in set(d4) | set(d5) if d4.get(k) != d5.get(k) and k not in ("transformers_version", "_name_or_path"))
        assert diff == [], (pair, {k: (d4.get(k), d5.get(k)) for k in diff})
        report[pair] = r5
        print(f"  config pair {pair:8s}: 4.x and 5.x load to identical config; rope_parameters={json.dumps(r5)}")
    return report


def check_with_4x(fix, logits5, tmp):
    """Load the LM fixtures in transformers 4.57.1 with their 4.x config and compare logits with 5.x."""
    dirs = {}
    for pair, fx in CONFIG_PAIRS.items():
        d = tmp / "_check4" / fx
        d.mkdir(parents=True)
        for f in (fix / "models" / fx).iterdir():
            if f.name != "config.json":
                os.symlink(f, d / f.name)
        shutil.copyfile(fix / "configs" / f"{pair}.4x.json", d / "config.json")
        dirs[fx] = str(d)
    # 4.x-readable configs only: a 5.x-saved VLM config (qwen2_5_vl-new) crashes 4.57 (rope_scaling is None)
    vlm = ["qwen2_5_vl", "qwen3_vl", "llava_onevision"]
    for name in ["qwen2-sharded"] + vlm:
        dirs[name] = str(fix / "models" / name)
    out = tmp / "_check4" / "logits.pt"
    run_4x({"check": {"ids": CHECK_IDS, "dirs": dirs, "out": str(out), "vlm": vlm}})
    l4 = torch.load(str(out))
    for name in sorted(l4):
        d = (l4[name] - logits5[name]).abs().max().item()
        print(f"  4.57 vs 5.23 logits ({name}, 4.x-readable config): max|diff| = {d:.3g}")
        assert d < 1e-5, name


# ---------------------------------------------------------------------------------------------
def sha_tree(root):
    h = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_file():
            h[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return h


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(FIX), help="fixtures root (default tests/fixtures)")
    ap.add_argument("--rebuild-corpus", action="store_true", help="rebuild tools/tokenizer/corpus.txt")
    args = ap.parse_args()
    fix = Path(args.out)
    if args.rebuild_corpus:
        build_corpus(TOKDIR / "corpus.txt")
    tok = train_base_tokenizer()
    print(f"tokenizer: {TOKENIZER_SIZE} tokens ({TRAIN_VOCAB} trained + {len(SPECIALS)} special)")

    tmp = Path(tempfile.mkdtemp(prefix="sinkmerge_fx_"))
    cfg4 = tmp / "_cfg4"
    # -- 4.x configs (transformers 4.57.1) -------------------------------------------------
    items = []
    for pair, fx in CONFIG_PAIRS.items():
        cls, arch, dtype, kw = lm_kwargs(fx, tok)
        k4 = four_x(kw)
        k4["dtype"] = DT_NAME[dtype]
        items.append({"name": pair, "class": cls.__name__, "kwargs": k4, "architectures": [arch]})
    cls, arch, dtype, kw = lm_kwargs("qwen2-sharded", tok)
    items.append({"name": "qwen2-sharded", "class": cls.__name__, "kwargs": dict(four_x(kw), dtype="bfloat16"),
                  "architectures": [arch]})
    items.append(qwen3_vl_4x_item(*_q3vl_parts(tok)))
    text, vision, top = ov_parts(tok)
    items.append({"name": "llava_onevision", "class": "LlavaOnevisionConfig",
                  "architectures": ["LlavaOnevisionForConditionalGeneration"],
                  "kwargs": dict(text_config=dict(text, dtype="float16"), vision_config=vision, dtype="float16", **top)})
    itext, _ = internvl_parts(tok)
    items.append({"name": "internvl_llm_config", "class": "Qwen2Config", "architectures": ["Qwen2ForCausalLM"],
                  "mode": "full",
                  "kwargs": dict(itext, rope_theta=1000000.0, dtype="bfloat16",
                                 rope_scaling={"factor": 2.0, "rope_type": "dynamic", "type": "dynamic"})})
    v4 = run_configs_4x(items, cfg4)

    # -- models --------------------------------------------------------------------------
    built = {}
    lm_info = {}
    for name in ["qwen2", "qwen2-sharded", "qwen3", "llama31-tied", "mistral", "olmo3"]:
        out, cls, arch, dtype, kw = build_lm(name, tok, tmp)
        lm_info[name] = (cls, arch, dtype, kw)
        built[name] = (out, "lm")
    # qwen2-sharded carries the 4.x config
    write_json(tmp / "qwen2-sharded" / "config.json",
               hubify_4x(json.loads((cfg4 / "qwen2-sharded.json").read_text())))
    legacy, new = build_qwen2_5_vl(tok, tmp)
    built["qwen2_5_vl"], built["qwen2_5_vl-new"] = (legacy, "vlm"), (new, "vlm")
    built["qwen3_vl"] = (build_qwen3_vl(tok, tmp, cfg4)[0], "vlm")
    built["llava_onevision"] = (build_llava_onevision(tok, tmp, cfg4), "vlm")
    built["idefics3"] = (build_idefics3(tok, tmp), "vlm")
    ivl_out, ivl_native, ivl_model = build_internvl_remote(tok, tmp, cfg4)
    built["internvl_remote"] = (ivl_out, "remote")
    nonfinite = build_nonfinite(tok, tmp)

    # -- write into tests/fixtures --------------------------------------------------------
    for sub in ("models", "configs", "goldens", "nonfinite"):
        if (fix / sub).exists():
            shutil.rmtree(fix / sub)
    (fix / "models").mkdir(parents=True)
    (fix / "configs").mkdir()
    (fix / "goldens").mkdir()
    for name, (d, _) in built.items():
        shutil.copytree(d, fix / "models" / name)
    shutil.copytree(nonfinite, fix / "nonfinite")
    for pair, fx in CONFIG_PAIRS.items():
        shutil.copyfile(tmp / fx / "config.json", fix / "configs" / f"{pair}.5x.json")
        write_json(fix / "configs" / f"{pair}.4x.json", hubify_4x(json.loads((cfg4 / f"{pair}.json").read_text())))

    # -- verify ---------------------------------------------------------------------------
    print("verifying with transformers", transformers.__version__)
    check_config_pairs(fix / "configs")
    logits = {}
    for name, (d, kind) in built.items():
        d = fix / "models" / name
        tname, enc = check_tokenizer(name, d)
        if kind == "remote":
            # cannot load (remote code); check the renaming is exactly invertible and gives the same logits
            remote = load_file(str(d / "model.safetensors"))
            native = internvl_remote_to_native(remote, ivl_model.config.vision_config.hidden_size)
            orig = load_file(str(ivl_native / "model.safetensors"))
            assert sorted(native) == sorted(orig), set(native) ^ set(orig)
            assert all(torch.equal(native[k], orig[k]) for k in orig)
            print(f"  internvl_remote: {len(remote)} tensors; inverse mapping reproduces all {len(orig)} tensors of "
                  f"InternVLForConditionalGeneration.save_pretrained bit-exactly; loading the native copy:")
            check_load("(internvl native)", ivl_native, "vlm")
            continue
        m, lg = check_load(name, d, kind)
        logits[name] = lg
        print(f"    tokenizer {tname}: {enc}")
    assert torch.equal(logits["qwen2_5_vl"], logits["qwen2_5_vl-new"]), "legacy/new Qwen2.5-VL layouts disagree"
    _, lg = check_load("(llava-ov as 5.23 saved it)", tmp / "_llava_onevision_native", "vlm")
    assert torch.equal(lg, logits["llava_onevision"])
    print("  llava_onevision with vision_tower.vision_model.* == the 5.23 save with vision_tower.*: logits equal")
    print("  qwen2_5_vl (flat 4.x config, legacy names) == qwen2_5_vl-new (5.x config, new names): logits equal")
    m = AutoModelForCausalLM.from_pretrained(str(fix / "models" / "qwen2-sharded"))
    print(f"  qwen2-sharded rope_parameters from its 4.x config: {m.config.rope_parameters}")
    check_with_4x(fix, logits, tmp)
    t = AutoTokenizer.from_pretrained(str(fix / "models" / "llama31-tied"))
    e = t("hi").input_ids
    assert e[0] == tid(tok, "<|begin_of_text|>"), e
    t = AutoTokenizer.from_pretrained(str(fix / "models" / "qwen2"))
    assert t("hi").input_ids[0] != tid(tok, "<|begin_of_text|>")
    print(f"  llama31-tied tokenizer prepends BOS: {e}; qwen2 adds nothing: {t('hi').input_ids}")

    # -- goldens --------------------------------------------------------------------------
    gold = {"_meta": {"generated_by": "tools/gen_fixtures.py", "torch": torch.__version__,
                      "transformers": transformers.__version__, "transformers_4x_configs": v4,
                      "safetensors": safetensors.__version__, "tokenizers": tokenizers.__version__,
                      "tokenizer_size": TOKENIZER_SIZE,
                      "note": "computed from safetensors headers and config.json only"}}
    for name in built:
        gold[name] = golden(fix / "models" / name)
    write_json(fix / "goldens" / "inspect.json", gold)

    shutil.rmtree(tmp)
    for sub in ("models", "configs", "goldens", "nonfinite"):  # save_pretrained leaves some files 0600
        for p in (fix / sub).rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
    total = 0
    print("\nfixture sizes:")
    for p in sorted((fix / "models").iterdir()) + [fix / "nonfinite"]:
        s = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        w = sum(f.stat().st_size for f in p.rglob("*.safetensors"))
        total += s
        print(f"  {p.name:18s} {s/1024:8.1f} KiB  (weights {w/1024:7.1f} KiB)")
    print(f"  total models+nonfinite {total/1024:.1f} KiB")
    digest = hashlib.sha256()
    for sub in ("models", "configs", "goldens", "nonfinite"):
        for rel, h in sha_tree(fix / sub).items():
            digest.update(f"{sub}/{rel} {h}\n".encode())
    print(f"sha256 over models/ configs/ goldens/ nonfinite/: {digest.hexdigest()}")


def _q3vl_parts(tok):
    text = base_text(320, head_dim=32, tie_word_embeddings=False, rms_norm_eps=1e-6, attention_bias=False,
                     max_position_embeddings=262144, bos_token_id=tid(tok, "<|endoftext|>"),
                     eos_token_id=tid(tok, "<|im_end|>"),
                     rope_parameters={"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": True,
                                      "rope_theta": 5000000.0})
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                  deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh", in_channels=3)
    ids = dict(image_token_id=tid(tok, "<|image_pad|>"), video_token_id=tid(tok, "<|video_pad|>"),
               vision_start_token_id=tid(tok, "<|vision_start|>"), vision_end_token_id=tid(tok, "<|vision_end|>"))
    return text, vision, ids


if __name__ == "__main__":
    main()
