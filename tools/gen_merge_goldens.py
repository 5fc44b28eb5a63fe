#!/usr/bin/env python3
"""Fixtures and mergekit goldens for sinkmerge's merge tests (tests/fixtures/merge/).

Run by hand from the repository root (documented in docs/reference/merges.md, "Goldens and tools"):

    nice -n 10 tools/.venv/bin/python tools/gen_merge_goldens.py

It needs the main tools venv (torch, transformers 5.23, mergekit 0.1.5). Everything is seeded;
rerunning gives identical files. Steps:

1. models/: tiny Qwen2-shaped models (hidden 16, 3 layers, 2 heads / 1 KV head) built with
   transformers' Qwen2ForCausalLM and saved with save_pretrained, plus the tokenizer files of
   tests/fixtures/models/qwen2:
     base    f32, tied (no lm_head on disk)
     task_a  f32, untied; exact magnitude ties straddling the top-k threshold in two tensors of
             <= 16 entries (where torch's argsort is stable, checked below)
     task_b  f32, untied, vocabulary 336 (> 320: cropped to the base's rows); on half of the
             entries its task vector opposes task_a's (sign conflicts)
     task_c  bf16, tied
   and bad/ inputs: wide (hidden 32: incompatible architecture), shape (one MLP matrix with a
   wrong shape), missing (the base without one tensor).
2. configs/*.yml: merge configs that both `mergekit-yaml` and `sinkmerge merge` read.
3. goldens/<config>.safetensors: what mergekit 0.1.5 writes for each mergekit-method config
   (`mergekit-yaml CONFIG OUT --no-write-model-card`, with --unsafe-truncate-embeddings where a
   vocabulary differs: mergekit 0.1.5 refuses mismatched vocabularies without it, and with it
   crops to the common rows, which is the base's rows in these configs).

Before running mergekit it checks that every top-k threshold is unambiguous in tensors of more
than 16 entries (distinct magnitudes), and that torch.argsort picks the same entries as a stable
sort in the smaller ones, so the goldens do not depend on torch's unstable sort order.
"""
import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

transformers.logging.set_verbosity_error()

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "merge"
MODELS = OUT / "models"
CONFIGS = OUT / "configs"
GOLDENS = OUT / "goldens"
TOKENIZER_FROM = ROOT / "tests" / "fixtures" / "models" / "qwen2"
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "generation_config.json"]
MERGEKIT = Path(sys.executable).parent / "mergekit-yaml"


def seed(name):
    torch.manual_seed(int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little"))


def config(vocab=320, hidden=16, tie=True, dtype="float32"):
    return Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        tie_word_embeddings=tie, bos_token_id=301, eos_token_id=303, dtype=dtype,
    )


def save(name, cfg, tensors, dtype=torch.float32):
    """Save through a real model so config.json and the layout are what transformers writes."""
    out = MODELS / name
    if out.exists():
        shutil.rmtree(out)
    model = Qwen2ForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    model.to(dtype).save_pretrained(str(out))
    for f in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_FROM / f, out / f)
    return out


def delta_like(t, std=0.02):
    return torch.randn(t.shape, dtype=torch.float32) * std


def build_models():
    seed("base")
    base_model = Qwen2ForCausalLM(config())
    base = {k: v.detach().clone() for k, v in base_model.state_dict().items() if k != "lm_head.weight"}
    # Norm scales start at 1; give them some spread so deltas are not all relative to 1. They
    # and one bias are multiples of 2^-12, so that adding the planted +-0.5 / +-0.25 deltas of
    # task_a below is exact and the planted ties survive as exact ties.
    for k in base:
        if k.endswith("norm.weight"):
            base[k] = base[k] + torch.randn(base[k].shape) * 0.1
        if k.endswith("norm.weight") or k == "model.layers.1.self_attn.k_proj.bias":
            base[k] = torch.round(base[k] * 4096) / 4096
    save("base", config(), base)
    base = load_file(MODELS / "base" / "model.safetensors")

    seed("task_a")
    da = {k: delta_like(v) for k, v in base.items()}
    # Exact ties at the top-k threshold (k = max(1, int(0.2 * n)) = 3 of 16, and 1 of 8): five
    # (three) entries share the largest magnitude, so which of them survive is the tie rule.
    ln = torch.full((16,), 0.01)
    ln[[2, 5, 7, 11, 13]] = torch.tensor([0.5, -0.5, 0.5, 0.5, -0.5])
    da["model.layers.0.input_layernorm.weight"] = ln
    kb = torch.full((8,), 0.002)
    kb[[1, 4, 6]] = torch.tensor([-0.25, 0.25, 0.25])
    da["model.layers.1.self_attn.k_proj.bias"] = kb
    a = {k: base[k] + da[k] for k in base}
    a["lm_head.weight"] = base["model.embed_tokens.weight"] + delta_like(base["model.embed_tokens.weight"])
    save("task_a", config(tie=False), a)

    seed("task_b")
    b = {}
    for k, v in base.items():
        opposed = torch.rand(v.shape) < 0.5
        d = torch.where(opposed, -0.7 * da[k] + delta_like(v, 0.005), delta_like(v))
        b[k] = v + d
    extra = torch.randn(16, 16) * 0.02
    b["model.embed_tokens.weight"] = torch.cat([b["model.embed_tokens.weight"], extra])
    head = a["lm_head.weight"] - 0.7 * (a["lm_head.weight"] - base["model.embed_tokens.weight"])
    b["lm_head.weight"] = torch.cat([head + delta_like(head, 0.005), torch.randn(16, 16) * 0.02])
    save("task_b", config(vocab=336, tie=False), b)

    seed("task_c")
    c = {k: (v + delta_like(v)).to(torch.bfloat16) for k, v in base.items()}
    save("task_c", config(dtype="bfloat16"), c, dtype=torch.bfloat16)

    # Bad inputs.
    seed("wide")
    wide = Qwen2ForCausalLM(config(hidden=32))
    save("bad_wide", config(hidden=32), {k: v for k, v in wide.state_dict().items() if k != "lm_head.weight"})
    shape = dict(load_file(MODELS / "task_a" / "model.safetensors"))
    shape["model.layers.1.mlp.up_proj.weight"] = torch.zeros(33, 16)
    rewrite("bad_shape", "task_a", shape)
    missing = {k: v for k, v in base.items() if k != "model.layers.2.self_attn.q_proj.bias"}
    rewrite("bad_missing", "base", missing)


def rewrite(name, like, tensors):
    """A copy of model `like` whose weights are `tensors` (for inputs transformers cannot save)."""
    out = MODELS / name
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(MODELS / like, out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


# Configs: name -> (yaml text, needs --unsafe-truncate-embeddings, golden made by mergekit)
M = "tests/fixtures/merge/models"
CONFIG_TEXT = {
    "linear": f"""merge_method: linear
models:
  - model: {M}/base
    parameters: {{weight: 0.5}}
  - model: {M}/task_a
    parameters: {{weight: 0.3}}
  - model: {M}/task_c
    parameters: {{weight: 0.2}}
dtype: float32
""",
    "linear_vocab": f"""merge_method: linear
models:
  - model: {M}/task_b
    parameters: {{weight: 0.95}}
  - model: {M}/task_a
    parameters: {{weight: 0.05}}
parameters:
  normalize: false
dtype: float32
""",
    "task_arithmetic": f"""merge_method: task_arithmetic
base_model: {M}/base
models:
  - model: {M}/task_a
    parameters: {{weight: 1.0}}
  - model: {M}/task_b
    parameters: {{weight: 1.0}}
parameters:
  lambda: 1.0
dtype: float32
""",
    "task_arithmetic_gradient": f"""merge_method: task_arithmetic
base_model: {M}/base
models:
  - model: {M}/base
  - model: {M}/task_a
    parameters:
      weight: [0.2, 0.8]
  - model: {M}/task_c
    parameters:
      weight:
        - filter: mlp
          value: 0.5
        - filter: self_attn
          value: [1.0, 0.0]
        - value: 0.3
parameters:
  normalize: true
  lambda: 0.7
dtype: float32
""",
    "ties": f"""merge_method: ties
base_model: {M}/base
models:
  - model: {M}/task_a
    parameters: {{weight: 1.0, density: 0.2}}
  - model: {M}/task_b
    parameters: {{weight: 1.0, density: 0.2}}
  - model: {M}/task_c
    parameters: {{weight: 1.0, density: 0.2}}
parameters:
  lambda: 1.0
dtype: float32
""",
    "ties_options": f"""merge_method: ties
base_model: {M}/base
models:
  - model: {M}/task_a
    parameters:
      weight: 0.7
      density: [0.5, 0.1]
  - model: {M}/task_b
    parameters:
      weight: -0.3
      density: 0.3
  - model: {M}/task_c
    parameters:
      weight: 1.0
      density:
        - filter: mlp
          value: 0.05
        - value: 0.4
parameters:
  normalize: false
  rescale: true
  int8_mask: true
  lambda: 1.3
dtype: float32
""",
}
NEEDS_TRUNCATE = {"linear_vocab", "task_arithmetic", "ties", "ties_options"}


def write_configs():
    CONFIGS.mkdir(parents=True, exist_ok=True)
    for name, text in CONFIG_TEXT.items():
        (CONFIGS / f"{name}.yml").write_text(text)


def check_unambiguous_top_k():
    """Every trimmed tensor must have one answer for mergekit's argsort."""
    base = load_file(MODELS / "base" / "model.safetensors")
    for model in ["task_a", "task_b", "task_c"]:
        x = load_file(MODELS / model / "model.safetensors")
        for name, b in base.items():
            d = (x[name].float()[: b.shape[0]] - b.float()).reshape(-1)
            mag = d.abs()
            if d.numel() > 16:
                assert mag.unique().numel() == mag.numel(), f"{model} {name}: tied magnitudes"
            else:
                for k in range(1, d.numel() + 1):
                    got = set(torch.argsort(mag, descending=True)[:k].tolist())
                    stable = set(torch.sort(mag, descending=True, stable=True).indices[:k].tolist())
                    assert got == stable, f"{model} {name} k={k}: argsort is not stable here"
    a = load_file(MODELS / "task_a" / "model.safetensors")
    ln = (a["model.layers.0.input_layernorm.weight"] - base["model.layers.0.input_layernorm.weight"]).abs()
    assert (ln == ln.max()).sum() == 5, "the planted ties must survive f32 rounding"


def run_mergekit():
    GOLDENS.mkdir(parents=True, exist_ok=True)
    for name in CONFIG_TEXT:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [str(MERGEKIT), str(CONFIGS / f"{name}.yml"), f"{tmp}/out", "--no-write-model-card", "--quiet"]
            if name in NEEDS_TRUNCATE:
                cmd.append("--unsafe-truncate-embeddings")
            subprocess.run(cmd, check=True, cwd=ROOT)
            tensors = load_file(f"{tmp}/out/model.safetensors")
            save_file(tensors, str(GOLDENS / f"{name}.safetensors"), metadata={"format": "pt"})
            print(f"{name}: {len(tensors)} tensors")


def main():
    build_models()
    write_configs()
    check_unambiguous_top_k()
    run_mergekit()


if __name__ == "__main__":
    main()
