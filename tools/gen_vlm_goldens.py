#!/usr/bin/env python3
"""Tiny random-init VLMs and transformers' eager-f32 golden forwards on real images (tests/fixtures/vlm/).

Run from the repository root:

    nice -n 10 tools/.venv/bin/python tools/gen_vlm_goldens.py

Writes tests/fixtures/vlm/<model>/ (config, f32 safetensors, tokenizer, chat template, PIL preprocessor config),
tests/fixtures/vlm/<model>/golden_<case>.safetensors and tests/fixtures/vlm/cases.json. Models are built with
transformers 5.23's own classes, seeded; inputs come from the explicit processors with the PIL image backends
(Qwen2VLImageProcessorPil, GotOcr2ImageProcessorPil) loaded back from the files written; forwards run with
attn_implementation="eager", float32, eval, no_grad, one thread. Rerunning gives byte-identical files.
See tests/fixtures/vlm/README.md for the models and the tensors of a golden file.
"""
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from transformers.image_utils import load_image
from PIL import Image
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_fixtures as gf  # noqa: E402  (tokenizer writer, templates, InternVL remote mapping)

import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    GotOcr2ImageProcessorPil,
    InternVLConfig,
    InternVLForConditionalGeneration,
    InternVLProcessor,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLProcessor,
)

from transformers.vision_utils import (  # noqa: E402
    get_vision_interpolation_indices_and_weights,
    get_vision_window_index,
)

torch.set_num_threads(1)
# No torchvision here, so the video-processor base class cannot be looked up; the processors take
# video_processor=None, and only a None argument skips the class check.
_check = transformers.ProcessorMixin.check_argument_for_proper_class
transformers.ProcessorMixin.check_argument_for_proper_class = (
    lambda self, name, arg: None if arg is None else _check(self, name, arg))
torch.use_deterministic_algorithms(True)
transformers.logging.set_verbosity_error()

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "vlm"
IMG = "tests/fixtures/images"
TOK = Tokenizer.from_file(str(ROOT / "tools" / "tokenizer" / "base_tokenizer.json"))
VOCAB = TOK.get_vocab_size()  # 320
tid = lambda s: gf.tid(TOK, s)  # noqa: E731
MODELS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "internvl", "internvl_qknorm", "internvl_remote"]
INIT = 0.1  # initializer_range: larger than 0.02 so attention is far from uniform and a RoPE slip shows

# InternVL -hf chat template (OpenGVLab/InternVL3-*-hf; transformers' convert_internvl_weights_to_hf.py). Older
# copies emit '<image>\n'; the current one emits '<IMG_CONTEXT>\n', the placeholder InternVLProcessor 5.23 expands
# (it is the tokenizer's `context_image_token`).
INTERNVL_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
QWEN_IDS = dict(image_token_id=tid("<|image_pad|>"), video_token_id=tid("<|video_pad|>"),
                vision_start_token_id=tid("<|vision_start|>"), vision_end_token_id=tid("<|vision_end|>"))


def seed(name):
    s = gf.hash_str(name) % (2**31)
    torch.manual_seed(s)
    np.random.seed(s)


def perturb_norms(model, name):
    """Norm weights/biases and layer scales init to constants; jitter them (seeded) so each one matters."""
    g = torch.Generator().manual_seed(gf.hash_str(name + "/norms") % (2**31))
    with torch.no_grad():
        for n, p in sorted(model.named_parameters()):
            if p.dim() == 1 and re.search(r"norm|ln_q|lambda_", n):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def write_json(path, obj):
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def save_model(model, out):
    model.save_pretrained(str(out))
    gf.write_generation_config(out, eos_token_id=[tid("<|im_end|>"), tid("<|endoftext|>")],
                               pad_token_id=tid("<|endoftext|>"))


# ---------------------------------------------------------------------------------------------
# Tokenizer / processor files
# ---------------------------------------------------------------------------------------------
def qwen_files(out, pre):
    gf.write_tokenizer(TOK, out, "qwen", gf.QWEN_VL_TEMPLATE, True, 32768,
                       extra_special=["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
                                      "<|video_pad|>"])
    gf.write_chat_template_json(out, gf.QWEN_VL_TEMPLATE)
    write_json(out / "preprocessor_config.json", pre)


def qwen_processor(out, cls=Qwen2VLProcessor):
    ip = Qwen2VLImageProcessorPil.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    tmpl = json.loads((out / "chat_template.json").read_text())["chat_template"]
    return cls(image_processor=ip, tokenizer=tok, chat_template=tmpl)


def internvl_files(out):
    gf.write_tokenizer(TOK, out, "qwen", None, False, 8192, extra_special=["<img>", "</img>", "<IMG_CONTEXT>"])
    p = out / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    # the -hf repos name the processor's tokens on the tokenizer
    cfg["extra_special_tokens"] = {"start_image_token": "<img>", "end_image_token": "</img>",
                                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
    write_json(p, cfg)
    gf.write_chat_template_json(out, INTERNVL_TEMPLATE)
    write_json(out / "preprocessor_config.json", {
        "crop_size": None, "crop_to_patches": True, "data_format": "channels_first", "default_to_square": True,
        "do_center_crop": None, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.485, 0.456, 0.406], "image_processor_type": "GotOcr2ImageProcessor",
        "image_std": [0.229, 0.224, 0.225], "max_patches": 6, "min_patches": 1, "processor_class": "InternVLProcessor",
        "resample": 3, "rescale_factor": 0.00392156862745098, "size": {"height": 56, "width": 56}})
    write_json(out / "processor_config.json", {"image_seq_length": 4, "processor_class": "InternVLProcessor"})


def internvl_processor(out):
    ip = GotOcr2ImageProcessorPil.from_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    tmpl = json.loads((out / "chat_template.json").read_text())["chat_template"]
    return InternVLProcessor(image_processor=ip, tokenizer=tok, image_seq_length=4, chat_template=tmpl)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def qwen2_text(**kw):
    d = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, initializer_range=INIT,
             rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
             bos_token_id=tid("<|endoftext|>"), eos_token_id=tid("<|im_end|>"), tie_word_embeddings=True)
    d.update(kw)
    return d


def build_qwen2_vl():
    cfg = Qwen2VLConfig(text_config=qwen2_text(), vision_config=dict(
        depth=3, embed_dim=32, hidden_size=32, mlp_ratio=2, num_heads=2, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2, in_channels=3, hidden_act="quick_gelu", initializer_range=INIT),
        tie_word_embeddings=True, **QWEN_IDS)
    return cfg, Qwen2VLForConditionalGeneration, dict(
        min_pixels=8192, max_pixels=9000, patch_size=14, image_processor_type="Qwen2VLImageProcessor",
        processor_class="Qwen2VLProcessor", image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711]), Qwen2VLProcessor


def build_qwen2_5_vl():
    cfg = Qwen2_5_VLConfig(text_config=qwen2_text(tie_word_embeddings=False), vision_config=dict(
        depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1, 3],
        tokens_per_second=2, in_channels=3, hidden_act="silu", initializer_range=INIT),
        tie_word_embeddings=False, **QWEN_IDS)
    return cfg, Qwen2_5_VLForConditionalGeneration, dict(
        min_pixels=3136, max_pixels=23520, patch_size=14, image_processor_type="Qwen2VLImageProcessor",
        processor_class="Qwen2_5_VLProcessor", image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711]), Qwen2VLProcessor


def qwen3_text(**kw):
    d = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
             initializer_range=INIT, rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2],
                                                      "mrope_interleaved": True, "rope_theta": 5000000.0},
             bos_token_id=tid("<|endoftext|>"), eos_token_id=tid("<|im_end|>"), tie_word_embeddings=True)
    d.update(kw)
    return d


def qwen3_vision():
    return dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32, patch_size=16,
                spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=16,
                deepstack_visual_indexes=[0, 1], hidden_act="gelu_pytorch_tanh", initializer_range=INIT)


QWEN3_PRE = dict(size={"shortest_edge": 4096, "longest_edge": 8192}, patch_size=16,
                 image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen3VLProcessor",
                 image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def build_qwen3_vl():
    cfg = Qwen3VLConfig(text_config=qwen3_text(), vision_config=qwen3_vision(), tie_word_embeddings=True, **QWEN_IDS)
    return cfg, Qwen3VLForConditionalGeneration, QWEN3_PRE, Qwen3VLProcessor


def build_qwen3_vl_moe():
    text = qwen3_text(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                      mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False)
    cfg = Qwen3VLMoeConfig(text_config=text, vision_config=qwen3_vision(), tie_word_embeddings=False, **QWEN_IDS)
    return cfg, Qwen3VLMoeForConditionalGeneration, QWEN3_PRE, Qwen3VLProcessor


def build_internvl(qk_norm):
    text = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                initializer_range=INIT, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                bos_token_id=tid("<|endoftext|>"), eos_token_id=tid("<|im_end|>"), tie_word_embeddings=False,
                use_sliding_window=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=56,
                  patch_size=14, attention_bias=True, use_qk_norm=qk_norm, norm_type="layer_norm", hidden_act="gelu",
                  layer_norm_eps=1e-6, use_mean_pooling=True, layer_scale_init_value=0.1, initializer_range=INIT)
    cfg = InternVLConfig(text_config=text, vision_config=vision, image_token_id=tid("<IMG_CONTEXT>"),
                         downsample_ratio=0.5, projector_hidden_act="gelu", vision_feature_layer=-1,
                         vision_feature_select_strategy="default", image_seq_length=4, tie_word_embeddings=False)
    return cfg, InternVLForConditionalGeneration


# ---------------------------------------------------------------------------------------------
# Goldens
# ---------------------------------------------------------------------------------------------
def load_images(names):
    # As a user passing a path gets them (transformers' `load_image`: EXIF transpose, then
    # `convert("RGB")`, which drops alpha), and as `sinkmerge trace --image` reads them.
    return [load_image(str(ROOT / IMG / n)) for n in names]


def make_inputs(proc, family, prompt, images, chat):
    """Returns (processor outputs, text given to the processor, expanded text, templated text or None)."""
    imgs = load_images(images)
    templated = None
    if chat:
        content = []
        parts = prompt.split("<image>")
        for i, p in enumerate(parts):
            if i > 0:
                content.append({"type": "image"})
            if p:
                content.append({"type": "text", "text": p})
        templated = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        text = templated
    elif family == "qwen":
        text = prompt.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
    else:
        text = prompt.replace("<image>", "<IMG_CONTEXT>")  # InternVLProcessor expands each one itself
    inputs = proc(text=[text], images=imgs, return_tensors="pt")
    if family == "internvl":  # the processor does not return the tiles per image; its image processor does
        ip = proc.image_processor(imgs, return_tensors="pt")
        assert torch.equal(ip["pixel_values"], inputs["pixel_values"])
        inputs["num_patches"] = torch.as_tensor(ip["num_patches"], dtype=torch.long)
    # rebuild the expanded text the tokenizer saw, and check it tokenizes to the same ids
    if family == "qwen":
        merge = proc.image_processor.merge_size ** 2
        counts = iter((inputs["image_grid_thw"].prod(-1) // merge).tolist())
        expanded = re.sub(re.escape("<|image_pad|>"), lambda m: "<|image_pad|>" * next(counts), text)
    else:
        counts = iter(inputs["num_patches"].tolist())
        expanded = re.sub("<IMG_CONTEXT>", lambda m: "<img>" + "<IMG_CONTEXT>" * (4 * next(counts)) + "</img>", text)
    ids = proc.tokenizer(expanded, add_special_tokens=False)["input_ids"]
    assert ids == inputs["input_ids"][0].tolist(), (family, prompt)
    return inputs, text, expanded, templated


def run_golden(model, family, inputs, qwen3):
    m = model.model
    lm = m.language_model
    n_layers = len(lm.layers)
    g = {"input_ids": inputs["input_ids"][0], "pixel_values": inputs["pixel_values"]}
    hooks, cap = [], {}

    def keep(name, fn=lambda o: o):
        def h(mod, args, out):
            cap[name] = fn(out[0] if isinstance(out, tuple) else out).detach().clone()
        return h

    for i, layer in enumerate(lm.layers):
        attn = layer.self_attn
        if qwen3:  # output of k_norm: [1, seq, kv, hd] -> [kv, seq, hd]
            hooks.append(attn.k_norm.register_forward_hook(keep(f"keys_pre_rope.{i}", lambda o: o[0].transpose(0, 1))))
        else:  # output of k_proj (with bias): [1, seq, kv*hd] -> [kv, seq, hd]
            hd = attn.head_dim
            hooks.append(attn.k_proj.register_forward_hook(
                keep(f"keys_pre_rope.{i}", lambda o, hd=hd: o[0].view(o.shape[1], -1, hd).transpose(0, 1))))
    hooks.append(lm.layers[-1].register_forward_hook(keep("_last_layer_out", lambda o: o[0])))
    if family == "qwen":
        vis = m.visual
        hooks.append(vis.patch_embed.register_forward_hook(keep("vision.patch_embed")))
        for i, b in enumerate(vis.blocks):
            hooks.append(b.register_forward_hook(keep(f"vision.block.{i}")))
    else:
        vt = m.vision_tower
        hooks.append(vt.embeddings.patch_embeddings.register_forward_hook(keep("vision.patch_embed")))
        hooks.append(vt.embeddings.register_forward_hook(keep("vision.embeddings")))
        for i, b in enumerate(vt.encoder.layer):
            hooks.append(b.register_forward_hook(keep(f"vision.block.{i}")))

    with torch.no_grad():
        if family == "qwen":
            grid = inputs["image_grid_thw"]
            g["image_grid_thw"] = grid
            pos, _ = m.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                      image_grid_thw=grid, attention_mask=inputs["attention_mask"])
            g["position_ids"] = pos[:, 0]
            feats = m.get_image_features(inputs["pixel_values"], grid)
            g["image_embeds"] = torch.cat(feats.pooler_output, 0)
            if qwen3:
                for j, ds in enumerate(feats.deepstack_features):
                    g[f"deepstack.{j}"] = torch.cat(ds, 0)
                v = m.visual  # the interpolated learned position embeddings, exactly as the tower adds them
                idx, w = get_vision_interpolation_indices_and_weights(
                    grid, num_grid_per_side=v.num_grid_per_side, mode=v.interpolation_mode,
                    align_corners=v.interpolation_align_corners, spatial_merge_size=v.config.spatial_merge_size)
                g["vision.pos_embeds"] = (v.pos_embed(idx) * w[:, :, None]).sum(1)
            if hasattr(m.visual, "fullatt_block_indexes"):  # Qwen2.5-VL: the tower's window order
                v = m.visual
                widx, cu = get_vision_window_index(grid, spatial_merge_size=v.spatial_merge_size,
                                                   window_size=v.window_size, patch_size=v.patch_size)
                g["vision.window_index"] = widx.long()
                g["vision.cu_window_seqlens"] = cu.long()
        else:
            g["num_patches"] = inputs["num_patches"]
            g["position_ids"] = torch.arange(inputs["input_ids"].shape[1])
            feats = m.get_image_features(inputs["pixel_values"], vision_feature_layer=-1,
                                         vision_feature_select_strategy="default")
            feats = feats.pooler_output if hasattr(feats, "pooler_output") else feats
            g["image_embeds"] = feats.reshape(-1, feats.shape[-1])
        vision_caps = {k: v for k, v in cap.items() if k.startswith("vision.")}
        cap.clear()
        out = model(**{k: v for k, v in inputs.items() if k != "num_patches"}, output_attentions=True, output_hidden_states=True, use_cache=True, return_dict=True)
    for h in hooks:
        h.remove()
    # vision intermediates as captured during get_image_features (the same call the forward makes)
    for k, v in vision_caps.items():
        g[k] = v
    g["logits"] = out.logits[0]
    n_hs = len(out.hidden_states)
    assert n_hs == n_layers + 1, n_hs
    for i, h in enumerate(out.hidden_states):
        g[f"hidden_states.{i}"] = h[0]
    # the last entry is after the final norm (transformers replaces it): check it
    normed = lm.norm(cap["_last_layer_out"].unsqueeze(0))[0]
    assert torch.equal(normed, out.hidden_states[-1][0]), "last hidden state is not the final-normed one"
    assert not torch.equal(cap["_last_layer_out"], out.hidden_states[-1][0])
    for i in range(n_layers):
        g[f"attentions.{i}"] = out.attentions[i][0]
        layer = out.past_key_values.layers[i]
        g[f"keys.{i}"] = layer.keys[0]
        g[f"values.{i}"] = layer.values[0]
        g[f"keys_pre_rope.{i}"] = cap[f"keys_pre_rope.{i}"]
    # the positions the forward used equal get_rope_index's (for Qwen the forward computes them itself)
    with torch.no_grad():
        pos = g["position_ids"]
        kw = {k: v for k, v in inputs.items() if k != "num_patches"}
        if family == "qwen":
            kw["position_ids"] = pos.unsqueeze(1)
        out2 = model(**kw, use_cache=False)
        assert torch.equal(out2.logits[0], g["logits"]), "explicit position_ids change the logits"
    g = {k: v.contiguous() for k, v in g.items()}
    for k, v in g.items():
        assert torch.isfinite(v.float()).all(), k
    return g


def shapes(g):
    return {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in sorted(g.items())}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for d in MODELS:  # rewrite the generated dirs; README.md stays
        if (OUT / d).exists():
            shutil.rmtree(OUT / d)
    cases = []

    specs = [
        ("qwen2_vl", build_qwen2_vl, [
            ("scene", ["scene_100x75.png"], "<image>Describe it.", False),
            ("tall_chat", ["tall_45x131.webp"], "<image>What is this?", True),
        ]),
        ("qwen2_5_vl", build_qwen2_5_vl, [
            ("two_images", ["tall_45x131.webp", "alpha_64x48.png"], "<image>and<image>Compare them.", False),
            ("wide", ["wide_150x61.jpg"], "What is in<image>this picture?", False),
        ]),
        ("qwen3_vl", build_qwen3_vl, [
            ("scene", ["scene_100x75.png"], "<image>Describe it.", False),
            ("wide", ["wide_150x61.jpg"], "What is in<image>this picture?", False),
        ]),
        ("qwen3_vl_moe", build_qwen3_vl_moe, [
            ("tall", ["tall_45x131.webp"], "<image>Describe it.", False),
        ]),
    ]
    for name, build, cs in specs:
        cfg, cls, pre, pcls = build()
        cfg.architectures = [cls.__name__]
        seed(name)
        model = cls(cfg)
        perturb_norms(model, name)
        model = model.float().eval()
        out = OUT / name
        save_model(model, out)
        base_pre = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                    "merge_size": 2, "resample": 3, "rescale_factor": 0.00392156862745098, "temporal_patch_size": 2}
        qwen_files(out, {**base_pre, **pre})
        model = cls.from_pretrained(str(out), attn_implementation="eager", dtype=torch.float32).eval()
        proc = qwen_processor(out, pcls)
        for case, images, prompt, chat in cs:
            inputs, text, expanded, templated = make_inputs(proc, "qwen", prompt, images, chat)
            g = run_golden(model, "qwen", inputs, qwen3=name.startswith("qwen3"))
            gpath = out / f"golden_{case}.safetensors"
            save_file(g, str(gpath))
            cases.append(dict(name=f"{name}/{case}", model=f"tests/fixtures/vlm/{name}",
                              golden=f"tests/fixtures/vlm/{name}/golden_{case}.safetensors",
                              images=[f"{IMG}/{i}" for i in images], prompt=prompt, chat_template=chat,
                              templated=templated, processor_text=text, expanded_text=expanded,
                              seq_len=int(inputs["input_ids"].shape[1]), tensors=shapes(g)))
            print(f"{name}/{case}: seq {inputs['input_ids'].shape[1]}, grid {inputs['image_grid_thw'].tolist()}")

    # InternVL (-hf layout), its qk-norm variant, and the remote-code layout of the same weights
    icases = {
        "internvl": [("two_images", ["tall_45x131.webp", "wide_150x61.jpg"], "<image>and<image>Compare them.", False),
                     ("wide_chat", ["wide_150x61.jpg"], "<image>What is this?", True)],
        "internvl_qknorm": [("tall", ["tall_45x131.webp"], "<image>Describe it.", False)],
    }
    for name, qk in (("internvl", False), ("internvl_qknorm", True)):
        cfg, cls = build_internvl(qk)
        cfg.architectures = [cls.__name__]
        seed(name)
        model = cls(cfg)
        perturb_norms(model, name)
        model = model.float().eval()
        out = OUT / name
        save_model(model, out)
        internvl_files(out)
        model = cls.from_pretrained(str(out), attn_implementation="eager", dtype=torch.float32).eval()
        proc = internvl_processor(out)
        for case, images, prompt, chat in icases[name]:
            inputs, text, expanded, templated = make_inputs(proc, "internvl", prompt, images, chat)
            g = run_golden(model, "internvl", inputs, qwen3=False)
            save_file(g, str(out / f"golden_{case}.safetensors"))
            entry = dict(name=f"{name}/{case}", model=f"tests/fixtures/vlm/{name}",
                         golden=f"tests/fixtures/vlm/{name}/golden_{case}.safetensors",
                         images=[f"{IMG}/{i}" for i in images], prompt=prompt, chat_template=chat,
                         templated=templated, processor_text=text, expanded_text=expanded,
                         seq_len=int(inputs["input_ids"].shape[1]), tensors=shapes(g))
            cases.append(entry)
            if name == "internvl":
                cases.append({**entry, "name": f"internvl_remote/{case}", "model": "tests/fixtures/vlm/internvl_remote"})
            print(f"{name}/{case}: seq {inputs['input_ids'].shape[1]}, tiles {inputs['num_patches'].tolist()}")
        if name == "internvl":
            build_internvl_remote(out, cfg)

    write_json(OUT / "cases.json", {"cases": cases})


def build_internvl_remote(native_dir, cfg):
    """Rename internvl's weights to the OpenGVLab remote-code names (gen_fixtures' mapping) and write its config."""
    out = OUT / "internvl_remote"
    out.mkdir()
    tensors = load_file(str(native_dir / "model.safetensors"))
    remote = gf.internvl_native_to_remote(tensors)
    if "language_model.lm_head.weight" not in remote:
        raise SystemExit("internvl: expected an untied lm_head on disk")
    # the mapping inverts exactly
    back = gf.internvl_remote_to_native(remote, cfg.vision_config.hidden_size)
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    save_file(remote, str(out / "model.safetensors"), metadata={"format": "pt"})
    t, v = cfg.text_config, cfg.vision_config
    llm = json.loads(t.to_json_string(use_diff=False))
    llm["architectures"] = ["Qwen2ForCausalLM"]
    write_json(out / "config.json", {
        "architectures": ["InternVLChatModel"],
        "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
                     "AutoModel": "modeling_internvl_chat.InternVLChatModel",
                     "AutoModelForCausalLM": "modeling_internvl_chat.InternVLChatModel"},
        "downsample_ratio": cfg.downsample_ratio, "dynamic_image_size": True, "force_image_size": v.image_size,
        "hidden_size": t.hidden_size, "llm_config": llm, "max_dynamic_patch": 6, "min_dynamic_patch": 1,
        "model_type": "internvl_chat", "pad2square": False, "ps_version": "v2", "select_layer": -1,
        "template": "internvl2_5", "tie_word_embeddings": False, "torch_dtype": "float32", "use_thumbnail": True,
        "vision_config": {
            "architectures": ["InternVisionModel"], "attention_dropout": 0.0, "drop_path_rate": 0.0, "dropout": 0.0,
            "hidden_act": v.hidden_act, "hidden_size": v.hidden_size, "image_size": v.image_size,
            "initializer_factor": 0.1, "initializer_range": 1e-10, "intermediate_size": v.intermediate_size,
            "layer_norm_eps": v.layer_norm_eps, "model_type": "intern_vit_6b", "norm_type": v.norm_type,
            "num_attention_heads": v.num_attention_heads, "num_channels": 3,
            "num_hidden_layers": v.num_hidden_layers, "patch_size": v.patch_size, "qk_normalization": False,
            "qkv_bias": True, "torch_dtype": "float32", "use_flash_attn": False},
    })
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.json",
              "preprocessor_config.json", "processor_config.json", "generation_config.json"):
        if (native_dir / f).exists():
            shutil.copy(native_dir / f, out / f)


if __name__ == "__main__":
    main()
