#!/usr/bin/env python3
"""The bundled tiny Qwen3-VL: assets/models/tiny-qwen3/vl's language model under a small seeded-random tower.

    tools/.venv/bin/python tools/make_tiny_vlm.py            # writes assets/models/tiny-qwen3/vlm/ (needs numpy only)
    tools/.venv/bin/python tools/make_tiny_vlm.py --check    # also checks it with transformers (tools/.venv)

Writes assets/models/tiny-qwen3/vlm/, a `Qwen3VLForConditionalGeneration` checkpoint in transformers 5.x's
layout (model_type qwen3_vl; tensors `model.language_model.*` and `model.visual.*`, no `lm_head` as the
embeddings are tied), bf16 on disk, for the default run of `sinkmerge reproduce`:
  * language model: every tensor of assets/models/tiny-qwen3/vl/model.safetensors, renamed
    `model.X` -> `model.language_model.X`, its bytes copied unchanged (never decoded). text_config is that
    model's config.json as `qwen3_vl_text`, plus M-RoPE: `mrope_section` [6, 5, 5] (sums to head_dim / 2 =
    16; Qwen3-VL's [24, 20, 20] scaled from 64 to 16) with `mrope_interleaved` true, as Qwen3-VL's. A
    text-only prompt has equal t/h/w positions, so the VLM's text logits are the LM's.
  * vision tower: depth 2, hidden 64, 2 heads, MLP 128, patch 16, temporal patch 2, 2x2 merge, output 128
    (the LM's hidden), 256 learned position embeddings (a 16 x 16 grid), deepstack after blocks 0 and 1 (into
    LM layers 0 and 1). Weights are drawn from numpy's default_rng(SEED) in a fixed order (sorted tensor
    names): Linear/Conv weights, their biases and the position embeddings N(0, 0.02), LayerNorm weights
    1 + N(0, 0.1) and biases N(0, 0.1); rounded once to bf16 (round-to-nearest-even). With std 0.02 the
    image-token embeddings have about the RMS of the LM's token embeddings (0.05; --check prints both).
  * token ids: image 6 (`<|image_pad|>`), vision start 4, vision end 5, as the LM's tokenizer has them.
    video_token_id is 2048 = vocab_size: the tokenizer has no `<|video_pad|>` and the vocabulary (tied
    embeddings, byte-identical) cannot grow, while every id below 2048 is either a special token with a role
    (0-6) or a BPE token that text produces. 2048 never occurs in tokenized text, so it cannot mark a text
    token as a video position; a video input would fail (no embedding row) instead of passing silently.
  * tokenizer.json: the LM's, copied. tokenizer_config.json: the LM's with the chat template replaced by a
    Qwen3-VL style one (also in chat_template.json): the LM's template (BOS, then ChatML, no default system
    message) for string contents, and for list contents the items in order, an image as
    `<|vision_start|><|image_pad|><|vision_end|>`; a video raises (no video token). A text-only
    conversation renders exactly as the LM's template renders it.
  * preprocessor_config.json: the Qwen2-VL image processor as Qwen3-VL configures it (patch 16, merge 2,
    temporal 2, mean/std 0.5), with min/max pixels 4096 / 65536: 4 to 64 image tokens per image, which keeps
    a prompt with an image well inside the LM's 512 positions (assets/images/parity.png, 100 x 75, becomes
    96 x 64: 6 x 4 patches, 6 image tokens).
  * generation_config.json: bos 0, eos [1, 3] (`<|endoftext|>`, `<|im_end|>`), pad 1.

JSON is written with sorted keys; the tensors in sorted name order with an 8-byte aligned header, as the
safetensors library writes them. Nothing depends on time or paths, so a rerun writes byte-identical files.

--check (needs tools/.venv: torch, transformers 5.x, Pillow) loads the result with transformers and checks:
  1. `Qwen3VLForConditionalGeneration.from_pretrained` reports no missing, unexpected or mismatched keys;
  2. the safetensors of the VLM hold the LM's tensors byte for byte;
  3. the VLM's logits on text-only prompts equal `Qwen3ForCausalLM`'s of assets/models/tiny-qwen3/vl (f32,
     eager attention; prints the max |diff|);
  4. AutoProcessor + one image (assets/images/parity.png) in the chat template, and a forward, run: prints the
     image-token count, the grid and the image-embedding RMS;
  5. a text-only conversation renders the same with the VLM's template as with the LM's.
"""
import argparse
import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LM = ROOT / "assets" / "models" / "tiny-qwen3" / "vl"
OUT = ROOT / "assets" / "models" / "tiny-qwen3" / "vlm"
IMAGE = ROOT / "assets" / "images" / "parity.png"
SEED = 20250611
INIT = 0.02
MROPE_SECTION = [6, 5, 5]
IMAGE_TOKEN_ID, VISION_START_ID, VISION_END_ID = 6, 4, 5

VISION = dict(
    deepstack_visual_indexes=[0, 1],
    depth=2,
    hidden_act="gelu_pytorch_tanh",
    hidden_size=64,
    in_channels=3,
    initializer_range=INIT,
    intermediate_size=128,
    model_type="qwen3_vl_vision",
    num_heads=2,
    num_position_embeddings=256,
    out_hidden_size=128,
    patch_size=16,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "axial"},
    spatial_merge_size=2,
    temporal_patch_size=2,
)

PREPROCESSOR = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2,
    "patch_size": 16,
    "processor_class": "Qwen3VLProcessor",
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": 65536, "shortest_edge": 4096},
    "temporal_patch_size": 2,
}

# The LM's ChatML template (assets/models/tiny-qwen3/vl/tokenizer_config.json) with Qwen3-VL's content lists.
CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}"
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}{{- 'Picture ' + image_count.value|string + ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'video' or 'video' in content %}"
    "{{- raise_exception('this model has no video token') }}"
    "{%- elif 'text' in content %}"
    "{{- content['text'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def read_safetensors(path):
    """(header dict without __metadata__, metadata, data bytes)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", None)
    return header, meta, raw[8 + n :]


def write_safetensors(path, tensors):
    """tensors: name -> (dtype, shape, bytes); written in sorted name order, header padded to 8 bytes."""
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def bf16_bytes(x):
    """float32 array -> bf16 bytes, little-endian, round to nearest even (finite values only)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.astype("<u2").tobytes()


def vision_shapes(v, text_hidden):
    h, i, ch = v["hidden_size"], v["intermediate_size"], v["in_channels"]
    merged = h * v["spatial_merge_size"] ** 2
    out = v["out_hidden_size"]
    assert out == text_hidden, "out_hidden_size must be the LM's hidden size"
    s = {
        "patch_embed.proj.weight": [h, ch, v["temporal_patch_size"], v["patch_size"], v["patch_size"]],
        "patch_embed.proj.bias": [h],
        "pos_embed.weight": [v["num_position_embeddings"], h],
    }
    for b in range(v["depth"]):
        p = f"blocks.{b}."
        s.update({p + "norm1.weight": [h], p + "norm1.bias": [h], p + "norm2.weight": [h], p + "norm2.bias": [h],
                  p + "attn.qkv.weight": [3 * h, h], p + "attn.qkv.bias": [3 * h],
                  p + "attn.proj.weight": [h, h], p + "attn.proj.bias": [h],
                  p + "mlp.linear_fc1.weight": [i, h], p + "mlp.linear_fc1.bias": [i],
                  p + "mlp.linear_fc2.weight": [h, i], p + "mlp.linear_fc2.bias": [h]})
    mergers = [("merger.", h)] + [(f"deepstack_merger_list.{j}.", merged)
                                  for j in range(len(v["deepstack_visual_indexes"]))]
    for p, norm in mergers:  # the main merger normalizes before the 2x2 shuffle, the deepstack ones after
        s.update({p + "norm.weight": [norm], p + "norm.bias": [norm],
                  p + "linear_fc1.weight": [merged, merged], p + "linear_fc1.bias": [merged],
                  p + "linear_fc2.weight": [out, merged], p + "linear_fc2.bias": [out]})
    return s


def draw(name, shape, rng):
    if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight")):
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if ".norm" in name and name.endswith(".bias"):
        return 0.1 * rng.standard_normal(shape)
    return INIT * rng.standard_normal(shape)


def build():
    lm_cfg = json.loads((LM / "config.json").read_text())
    assert lm_cfg["architectures"] == ["Qwen3ForCausalLM"] and lm_cfg["tie_word_embeddings"]
    head_dim = lm_cfg["head_dim"]
    assert sum(MROPE_SECTION) == head_dim // 2

    text = {k: lm_cfg[k] for k in ("attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "head_dim",
                                   "hidden_act", "hidden_size", "initializer_range", "intermediate_size",
                                   "max_position_embeddings", "num_attention_heads", "num_hidden_layers",
                                   "num_key_value_heads", "pad_token_id", "rms_norm_eps", "tie_word_embeddings",
                                   "use_cache", "vocab_size")}
    assert lm_cfg["rope_parameters"]["rope_type"] == "default"
    text.update(model_type="qwen3_vl_text", dtype=lm_cfg["dtype"],
                rope_parameters={"mrope_interleaved": True, "mrope_section": MROPE_SECTION,
                                 "rope_theta": lm_cfg["rope_parameters"]["rope_theta"], "rope_type": "default"})
    config = {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "dtype": lm_cfg["dtype"],
        "image_token_id": IMAGE_TOKEN_ID,
        "model_type": "qwen3_vl",
        "text_config": text,
        "tie_word_embeddings": True,
        "transformers_version": lm_cfg["transformers_version"],
        "video_token_id": lm_cfg["vocab_size"],
        "vision_config": VISION,
        "vision_end_token_id": VISION_END_ID,
        "vision_start_token_id": VISION_START_ID,
    }

    # Tokenizer: the LM's; check the vision tokens are where the config says.
    tok = json.loads((LM / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert added["<|image_pad|>"] == IMAGE_TOKEN_ID and added["<|vision_start|>"] == VISION_START_ID
    assert added["<|vision_end|>"] == VISION_END_ID and "<|video_pad|>" not in added
    tok_cfg = json.loads((LM / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = CHAT_TEMPLATE

    # Tensors: the LM's bytes, renamed; then the tower.
    header, meta, data = read_safetensors(LM / "model.safetensors")
    tensors = {}
    for name, t in header.items():
        assert name.startswith("model."), name
        a, b = t["data_offsets"]
        tensors["model.language_model." + name[len("model."):]] = (t["dtype"], t["shape"], data[a:b])
    rng = np.random.default_rng(SEED)
    for name, shape in sorted(vision_shapes(VISION, text["hidden_size"]).items()):
        tensors["model.visual." + name] = ("BF16", shape, bf16_bytes(draw(name, shape, rng)))

    OUT.mkdir(parents=True, exist_ok=True)
    for stale in OUT.iterdir():
        stale.unlink()
    write_safetensors(OUT / "model.safetensors", tensors)
    write_json(OUT / "config.json", config)
    write_json(OUT / "generation_config.json", {
        "bos_token_id": lm_cfg["bos_token_id"], "eos_token_id": [lm_cfg["eos_token_id"], added["<|im_end|>"]],
        "pad_token_id": lm_cfg["pad_token_id"], "transformers_version": lm_cfg["transformers_version"]})
    write_json(OUT / "preprocessor_config.json", PREPROCESSOR)
    write_json(OUT / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    write_json(OUT / "tokenizer_config.json", tok_cfg)
    shutil.copyfile(LM / "tokenizer.json", OUT / "tokenizer.json")
    for f in sorted(OUT.iterdir()):
        print(f"{f.relative_to(ROOT)}  {f.stat().st_size} bytes")


def check():
    import torch
    import transformers
    from PIL import Image
    from transformers import AutoProcessor, AutoTokenizer, Qwen3ForCausalLM, Qwen3VLForConditionalGeneration

    torch.set_num_threads(1)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")

    # 1. loads with no missing/unexpected/mismatched keys
    vlm, info = Qwen3VLForConditionalGeneration.from_pretrained(
        str(OUT), dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    print("1. loading info:", {k: len(v) for k, v in info.items()})
    assert not bad, bad
    vlm.eval()

    # 2. LM bytes
    lm_h, _, lm_d = read_safetensors(LM / "model.safetensors")
    vh, _, vd = read_safetensors(OUT / "model.safetensors")
    for name, t in lm_h.items():
        u = vh["model.language_model." + name[len("model."):]]
        assert (u["dtype"], u["shape"]) == (t["dtype"], t["shape"]), name
        assert lm_d[slice(*t["data_offsets"])] == vd[slice(*u["data_offsets"])], name
    n_vis = sum(1 for k in vh if k.startswith("model.visual."))
    print(f"2. {len(lm_h)} LM tensors byte-identical; {n_vis} vision tensors; {len(vh)} in all")

    # 3. text logits
    lm = Qwen3ForCausalLM.from_pretrained(str(LM), dtype=torch.float32, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(str(LM))
    prompts = ["The quick brown fox jumps over the lazy dog.",
               "Return the number of items in a container, as the len function does for lists and strings."]
    worst = 0.0
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            a = lm(input_ids=ids).logits
            b = vlm(input_ids=ids).logits
        d = (a - b).abs().max().item()
        worst = max(worst, d)
        print(f"3. {ids.shape[1]} tokens: max |VLM - LM| logits = {d:.3g} (|logits| up to {a.abs().max().item():.3g})")
    assert worst < 1e-4, worst

    # 4. one image through AutoProcessor and a forward
    try:
        proc = AutoProcessor.from_pretrained(str(OUT))
    except ImportError as e:
        # tools/.venv has no torchvision, which transformers' video processors require. As in
        # gen_vlm_goldens.py, load the processor with video_processor=None (images need no video processor).
        assert "Torchvision" in str(e), e
        print("4. no torchvision: AutoProcessor with the video processor left out")
        from transformers.models.auto import video_processing_auto

        check_class = transformers.ProcessorMixin.check_argument_for_proper_class
        transformers.ProcessorMixin.check_argument_for_proper_class = (
            lambda self, name, arg: None if arg is None else check_class(self, name, arg))
        video_processing_auto.AutoVideoProcessor.from_pretrained = classmethod(lambda cls, *a, **k: None)
        proc = AutoProcessor.from_pretrained(str(OUT))
    print(f"4. {type(proc).__name__}: {type(proc.image_processor).__name__}, {type(proc.tokenizer).__name__}")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True)
    image = Image.open(IMAGE)
    # The template renders BOS and the tokenizer's post-processor would add another: tokenize as
    # apply_chat_template(tokenize=True) does, without special tokens.
    inputs = proc(text=[text], images=[image], return_tensors="pt", add_special_tokens=False)
    ids = inputs["input_ids"][0]
    assert ids[0] == 0 and ids[1] != 0, ids[:3]
    n_img = int((ids == IMAGE_TOKEN_ID).sum())
    with torch.no_grad():
        out = vlm(**inputs, output_hidden_states=True)
        feats = vlm.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    pooled = feats.pooler_output if hasattr(feats, "pooler_output") else feats[0]
    pooled = torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled
    emb = vlm.model.language_model.embed_tokens.weight
    print(f"4. {repr(text)}\n   image {image.size} -> grid_thw {inputs['image_grid_thw'].tolist()}, pixel_values "
          f"{list(inputs['pixel_values'].shape)}, {n_img} image tokens of {len(ids)}; logits {list(out.logits.shape)}, "
          f"finite {bool(torch.isfinite(out.logits).all())}")
    print(f"   image-embedding RMS {pooled.pow(2).mean().sqrt().item():.3f}; token-embedding RMS "
          f"{emb.pow(2).mean().sqrt().item():.3f}")
    assert n_img == pooled.shape[0] and torch.isfinite(out.logits).all()

    # 5. text-only chat renders as the LM's template
    conv = [{"role": "user", "content": "Hello there."}]
    lm_text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    vlm_text = AutoTokenizer.from_pretrained(str(OUT)).apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    conv_list = [{"role": "user", "content": [{"type": "text", "text": "Hello there."}]}]
    vlm_list = proc.apply_chat_template(conv_list, add_generation_prompt=True)
    print(f"5. LM template {lm_text!r}; VLM template: same = {lm_text == vlm_text}, list content same = {lm_text == vlm_list}")
    assert lm_text == vlm_text == vlm_list
    print("all checks passed")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="after writing, check the model with transformers")
    args = ap.parse_args()
    build()
    if args.check:
        check()


if __name__ == "__main__":
    sys.exit(main())
