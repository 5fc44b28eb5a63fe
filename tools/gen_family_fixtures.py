#!/usr/bin/env python3
"""Generate the VLM-family fixtures for `sinkmerge extract` (tests/fixtures/families/<case>/).

Run by hand (see docs/commands/extract.md, "Fixtures and goldens"):

    nice -n 10 tools/.venv/bin/python tools/gen_family_fixtures.py

It complements tools/gen_fixtures.py (which writes qwen2_5_vl, qwen2_5_vl-new, qwen3_vl, llava_onevision,
idefics3 and internvl_remote under tests/fixtures/models/) with the families and layouts that script does not
cover, following the layouts of docs/reference/vlm-layouts.md. It reuses that script's tokenizer and file writers.

How each case is made (class = a real transformers 5.23 class; hand = laid out by this script from docs/reference/vlm-layouts.md):

| case                    | built with                                   | on-disk layout written                          |
|-------------------------|----------------------------------------------|-------------------------------------------------|
| qwen2_vl                | class Qwen2VLForConditionalGeneration        | 5.23 save (legacy `model.*` + `visual.*`), tied, flat Hub config (hand) |
| qwen3_vl_moe-5x         | class Qwen3VLMoeForConditionalGeneration     | 5.23 save: experts [E,2I,H] / [E,H,I], 5.x config |
| qwen3_vl_moe-hub        | same weights                                 | experts transposed to the Hub [E,H,2I] / [E,I,H], 4.57-style config (hand) |
| llava_onevision-lmms    | class LlavaOnevisionForConditionalGeneration | renamed to the lmms-lab LlavaQwen names (inverse of the HF converter), flat config (hand) |
| llava_next              | class LlavaNextForConditionalGeneration      | 5.23 save (llava-hf legacy), Mistral text config |
| internvl-hf             | class InternVLForConditionalGeneration       | 5.23 save (legacy), Qwen3 text, 5.x default tie (no lm_head) |
| ovis2-hf                | class Ovis2ForConditionalGeneration          | 5.23 save, 5.x default tie (no lm_head)          |
| ovis2                   | class Ovis2ForConditionalGeneration, untied  | renamed to the remote `llm.*` / `visual_tokenizer.*` / `vte` names (inverse of convert_ovis2_weights_to_hf), remote config (hand) |
| minicpm-v               | class Qwen3ForCausalLM (the VLM's `llm`)     | `llm.*` + random `vpm.*` / `resampler.*`, flat MiniCPMV config, remote tokenizer auto_map (hand) |
| molmo2-o                | class Molmo2ForConditionalGeneration (olmo qk-norm, post-norm) | 5.23 save (reverts to the Hub names) with the `wte` split repaired, remote config (hand) |
| molmo2-o-partial-rope   | same, linear rope scaling on layer 1 only    | as molmo2-o                                      |
| molmo2-o-resaved        | the molmo2-o model                           | raw 5.23 save: `wte.embedding`/`new_embedding` split in two equal halves (docs/reference/vlm-layouts.md#molmo2) |
| molmo2-qwen3            | class Molmo2ForConditionalGeneration (qwen3 qk-norm, pre-norm) | as molmo2-o                    |
| molmo2-qwen2            | class Qwen2ForCausalLM (the language module) | hand: remote Molmo2 names with `att_proj.weight`/`.bias`, no q/k norms, pre-norm, remote config (qkv_bias) |
| molmoe-megablocks       | class OlmoeForCausalLM (the language module) | hand: the Hub layout, megablocks `ffn.experts.mlp.{w1,v1,w2}`, head `model.transformer.ff_out` |
| molmoe-hf               | class OlmoeForCausalLM                       | hand: the per-expert `attn.*` / `mlp.experts.{e}.*` layout of a pure-PyTorch port, head `model.transformer.ff_out` |
| internvl-internlm2      | class LlamaForCausalLM (the converted LM)    | hand: remote InternLM2 names (`tok_embeddings`, grouped `attention.wqkv`, `feed_forward.w1/w3/w2`, `output`; inverse of convert_internvl_weights_to_hf), remote config with an InternLM2 `llm_config` |

Every class-built case is loaded back with transformers 5.23 (AutoModelForImageTextToText) and must give the
same logits as the in-memory model; hand-laid layouts are checked to invert exactly onto the source tensors.
The expected extraction results are computed separately by tools/gen_extract_goldens.py.
Everything is seeded; rerunning gives identical bytes. `--only CASE [CASE ...]` rebuilds just those cases and
replaces only their folders.
"""
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_fixtures as gf  # noqa: E402  (tokenizer, writers, seeds; sets torch determinism)
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForImageTextToText,
    InternVLConfig,
    InternVLForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    Molmo2Config,
    Molmo2ForConditionalGeneration,
    OlmoeConfig,
    OlmoeForCausalLM,
    Ovis2Config,
    Ovis2ForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "families"
CHECK_IDS = gf.CHECK_IDS
tid = gf.tid


def text_dims(vocab=320, **kw):
    """Tiny text model: hidden 16, 2 heads / 1 KV head (head_dim 8), intermediate 32, 2 layers."""
    d = dict(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=4096, initializer_range=0.02)
    d.update(kw)
    return d


def seed(name):
    torch.manual_seed(gf.hash_str(name) % (2**31))


def names_of(d):
    return gf.read_header_names(d)


def rewrite_tensors(src_file, dst_file, fn):
    """Write dst_file with the tensors of src_file mapped by fn(name, tensor) -> [(new_name, tensor)]."""
    with safe_open(str(src_file), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(src_file))
    out = {}
    for name in sorted(tensors):
        for new, t in fn(name, tensors[name]):
            assert new not in out, new
            out[new] = t.contiguous()
    dst_file.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst_file), metadata=meta)
    return out


def rounded(model, dtype):
    """Round the parameters to the dtype they are saved in, keeping f32 (and f32 rotary buffers)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(gf.DT[dtype]).to(p.dtype))
    return model


def logits_of(model):
    ids = torch.tensor(CHECK_IDS)
    model.set_attn_implementation("eager")  # as the reloads below, so that the comparison can be exact
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()


def reload_logits(d):
    m, info = AutoModelForImageTextToText.from_pretrained(str(d), output_loading_info=True, dtype=torch.float32,
                                                          attn_implementation="eager")
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, (d, bad)
    return logits_of(m)


def assert_same(a, b, what):
    diff = (a - b).abs().max().item()
    assert diff == 0.0, f"{what}: max|diff| {diff}"
    print(f"  {what}: logits identical")


def qwen_files(out, tok, template, in_tokenizer_config=True, chat_json=None, extra=()):
    gf.write_generation_config(out, bos_token_id=tid(tok, "<|endoftext|>"), pad_token_id=tid(tok, "<|endoftext|>"),
                               eos_token_id=[tid(tok, "<|im_end|>"), tid(tok, "<|endoftext|>")])
    gf.write_tokenizer(tok, out, "qwen", template, in_tokenizer_config, 32768, extra_special=list(extra))
    if chat_json is not None:
        gf.write_chat_template_json(out, chat_json)


def processor_stub(out, cls):
    gf.write_json(out / "preprocessor_config.json", {"image_processor_type": cls, "do_resize": True,
                                                     "size": {"height": 8, "width": 8}})


# ---------------------------------------------------------------------------------------------
# Qwen2-VL (docs/reference/vlm-layouts.md#qwen2-vl): tied 2B-style model, legacy names, flat Hub config
# ---------------------------------------------------------------------------------------------
def build_qwen2_vl(tok, tmp):
    ids = dict(image_token_id=tid(tok, "<|image_pad|>"), video_token_id=tid(tok, "<|video_pad|>"),
               vision_start_token_id=tid(tok, "<|vision_start|>"), vision_end_token_id=tid(tok, "<|vision_end|>"))
    text = text_dims(tie_word_embeddings=True, rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=32768,
                     max_window_layers=2, max_position_embeddings=32768,
                     rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1000000.0},
                     bos_token_id=tid(tok, "<|endoftext|>"), eos_token_id=tid(tok, "<|im_end|>"))
    vision = dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, mlp_ratio=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    cfg.architectures = ["Qwen2VLForConditionalGeneration"]
    seed("qwen2_vl")
    model = Qwen2VLForConditionalGeneration(cfg)
    out = tmp / "qwen2_vl"
    ref = logits_of(rounded(model, "bf16"))
    gf.save_model(model, out, "bf16")
    names = names_of(out)
    assert "lm_head.weight" not in names and any(n.startswith("visual.") for n in names), names
    # Flat config in the schema of Qwen/Qwen2-VL-2B-Instruct (tie_word_embeddings true, mrope "type").
    gf.write_json(out / "config.json", {
        "architectures": ["Qwen2VLForConditionalGeneration"], "attention_dropout": 0.0,
        "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
        "vision_start_token_id": ids["vision_start_token_id"], "vision_end_token_id": ids["vision_end_token_id"],
        "vision_token_id": tid(tok, "<|vision_pad|>"), "image_token_id": ids["image_token_id"],
        "video_token_id": ids["video_token_id"], "hidden_act": "silu", "hidden_size": 16,
        "initializer_range": 0.02, "intermediate_size": 32, "max_position_embeddings": 32768,
        "max_window_layers": 2, "model_type": "qwen2_vl", "num_attention_heads": 2, "num_hidden_layers": 2,
        "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.41.2",
        "use_cache": True, "use_sliding_window": False,
        "vision_config": {"depth": 1, "embed_dim": 16, "mlp_ratio": 2, "num_heads": 2, "in_chans": 3,
                          "hidden_size": 16, "patch_size": 4, "spatial_merge_size": 2, "spatial_patch_size": 4,
                          "temporal_patch_size": 2},
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]},
        "vocab_size": 320,
    })
    qwen_files(out, tok, gf.QWEN_VL_TEMPLATE, chat_json=gf.QWEN_VL_TEMPLATE,
               extra=["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"])
    processor_stub(out, "Qwen2VLImageProcessor")
    assert_same(ref, reload_logits(out), "qwen2_vl (flat Hub config, legacy names, tied) reloads")
    return {"qwen2_vl": out}


# ---------------------------------------------------------------------------------------------
# Qwen3-VL-MoE (2.4): the same model in both expert orientations
# ---------------------------------------------------------------------------------------------
def build_qwen3_vl_moe(tok, tmp):
    ids = dict(image_token_id=tid(tok, "<|image_pad|>"), video_token_id=tid(tok, "<|video_pad|>"),
               vision_start_token_id=tid(tok, "<|vision_start|>"), vision_end_token_id=tid(tok, "<|vision_end|>"))
    # H=16, moe I=4: neither H == 2I nor H == I, so the orientation is decidable from shapes.
    text = text_dims(head_dim=16, tie_word_embeddings=False, rms_norm_eps=1e-6, attention_bias=False,
                     moe_intermediate_size=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                     mlp_only_layers=[], max_position_embeddings=262144,
                     bos_token_id=tid(tok, "<|endoftext|>"), eos_token_id=tid(tok, "<|im_end|>"),
                     rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True,
                                      "rope_theta": 5000000.0})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                  deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh", in_channels=3)
    cfg = Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    cfg.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    seed("qwen3_vl_moe")
    model = Qwen3VLMoeForConditionalGeneration(cfg)
    five = tmp / "qwen3_vl_moe-5x"
    ref = logits_of(rounded(model, "bf16"))
    gf.save_model(model, five, "bf16")
    with safe_open(str(five / "model.safetensors"), "pt") as f:
        gu = f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape()
        dn = f.get_slice("model.language_model.layers.0.mlp.experts.down_proj").get_shape()
    assert gu == [4, 8, 16] and dn == [4, 16, 4], (gu, dn)  # 5.x: [E,2I,H], [E,H,I]
    c5 = json.loads((five / "config.json").read_text())
    assert c5["text_config"]["tie_word_embeddings"] is False and "num_local_experts" in c5["text_config"], c5
    hub = tmp / "qwen3_vl_moe-hub"

    def to_hub(name, t):
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            return [(name, t.transpose(1, 2))]
        return [(name, t)]
    rewrite_tensors(five / "model.safetensors", hub / "model.safetensors", to_hub)
    # 4.57-style Hub config (Qwen/Qwen3-VL-30B-A3B-Instruct schema): num_experts, rope_theta + rope_scaling.
    tc = {k: v for k, v in c5["text_config"].items()
          if k not in ("rope_parameters", "num_local_experts", "tie_word_embeddings", "pad_token_id",
                       "sliding_window", "router_aux_loss_coef", "output_router_logits")}
    tc.update(num_experts=4, norm_topk_prob=True, dtype="bfloat16", rope_theta=5000000.0,
              rope_scaling={"mrope_interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default"})
    hub_cfg = {k: v for k, v in c5.items() if k not in ("text_config", "dtype", "transformers_version")}
    hub_cfg.update(text_config=tc, dtype="bfloat16", transformers_version="4.57.0.dev0")
    gf.write_json(hub / "config.json", hub_cfg)
    for d in (five, hub):
        qwen_files(d, tok, gf.QWEN_VL_TEMPLATE, in_tokenizer_config=False, chat_json=gf.QWEN_VL_TEMPLATE,
                   extra=["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
        processor_stub(d, "Qwen2VLImageProcessor")
        assert_same(ref, reload_logits(d), f"{d.name} reloads")
    return {"qwen3_vl_moe-5x": five, "qwen3_vl_moe-hub": hub}


# ---------------------------------------------------------------------------------------------
# LLaVA-OneVision, lmms-lab layout (2.5a): LlavaQwenForCausalLM names, flat config
# ---------------------------------------------------------------------------------------------
LMMS_RENAMES = [  # llava-hf 5.23 save -> lmms-lab (inverse of KEYS_TO_MODIFY_MAPPING of the HF converter)
    (r"^language_model\.model\.", "model."),
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^vision_tower\.", "model.vision_tower.vision_tower.vision_model."),
    (r"^multi_modal_projector\.linear_1\.", "model.mm_projector.0."),
    (r"^multi_modal_projector\.linear_2\.", "model.mm_projector.2."),
    (r"^image_newline$", "model.image_newline"),
]
LMMS_BACK = [  # most specific prefix first
    ("model.vision_tower.vision_tower.vision_model.", "vision_tower."),
    ("model.mm_projector.0.", "multi_modal_projector.linear_1."),
    ("model.mm_projector.2.", "multi_modal_projector.linear_2."),
    ("model.image_newline", "image_newline"),
    ("model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
]


def build_llava_onevision_lmms(tok, tmp):
    text = text_dims(model_type="qwen2", tie_word_embeddings=False, rms_norm_eps=1e-6, use_sliding_window=False,
                     max_window_layers=2, max_position_embeddings=32768,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                     bos_token_id=tid(tok, "<|endoftext|>"), eos_token_id=tid(tok, "<|im_end|>"))
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=8, patch_size=4, vision_use_head=False, layer_norm_eps=1e-6)
    cfg = LlavaOnevisionConfig(text_config=text, vision_config=vision, image_token_index=tid(tok, "<image>"),
                               video_token_index=tid(tok, "<video>"), vision_feature_layer=-1,
                               vision_feature_select_strategy="full", tie_word_embeddings=False,
                               image_grid_pinpoints=[[8, 8], [8, 16], [16, 8], [16, 16]])
    cfg.architectures = ["LlavaOnevisionForConditionalGeneration"]
    seed("llava_onevision-lmms")
    model = LlavaOnevisionForConditionalGeneration(cfg)
    native = tmp / "_llava_ov_native"
    ref = logits_of(rounded(model, "bf16"))
    gf.save_model(model, native, "bf16")
    out = tmp / "llava_onevision-lmms"

    def rename(name, t):
        for pat, rep in LMMS_RENAMES:
            if re.match(pat, name):
                return [(re.sub(pat, rep, name), t)]
        raise SystemExit(f"llava_onevision-lmms: no rename for {name}")
    renamed = rewrite_tensors(native / "model.safetensors", out / "model.safetensors", rename)
    assert "lm_head.weight" in renamed and "model.image_newline" in renamed
    # Flat config as LLaVA-NeXT's LlavaQwenConfig saves it (Qwen2 fields + mm_*); model_type "llava" as the
    # lmms-lab Hub configs are reported to say (docs/reference/vlm-layouts.md#llava-onevision, layout a: detect by architectures / mm_vision_tower).
    gf.write_json(out / "config.json", {
        "architectures": ["LlavaQwenForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"], "hidden_act": "silu",
        "hidden_size": 16, "image_aspect_ratio": "anyres_max_9", "image_crop_resolution": None,
        "image_grid_pinpoints": [[8, 8], [8, 16], [16, 8], [16, 16]], "image_split_resolution": None,
        "image_token_index": tid(tok, "<image>"), "initializer_range": 0.02, "intermediate_size": 32,
        "max_position_embeddings": 32768, "max_window_layers": 2, "mm_hidden_size": 16,
        "mm_newline_position": "grid", "mm_patch_merge_type": "spatial_unpad", "mm_projector_lr": None,
        "mm_projector_type": "mlp2x_gelu", "mm_resampler_type": None, "mm_spatial_pool_mode": "bilinear",
        "mm_tunable_parts": "mm_vision_tower,mm_mlp_adapter,mm_language_model", "mm_use_im_patch_token": False,
        "mm_use_im_start_end": False, "mm_vision_select_feature": "patch", "mm_vision_select_layer": -1,
        "mm_vision_tower": "google/siglip-so400m-patch14-384", "mm_vision_tower_lr": 2e-06,
        "model_type": "llava", "num_attention_heads": 2, "num_hidden_layers": 2, "num_key_value_heads": 1,
        "pos_skipping_range": 4096, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": 32768, "tie_word_embeddings": False, "tokenizer_model_max_length": 32768,
        "tokenizer_padding_side": "right", "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0",
        "use_cache": True, "use_mm_proj": True, "use_pos_skipping": False, "use_sliding_window": False,
        "vision_tower_pretrained": None, "vocab_size": 320,
    })
    qwen_files(out, tok, gf.QWEN_TEMPLATE, extra=["<image>"])
    back = {}
    for name, t in renamed.items():  # the renaming must invert exactly onto the native save
        for lmms, hf in LMMS_BACK:
            if name.startswith(lmms):
                back[hf + name[len(lmms):]] = t
                break
    orig = load_file(str(native / "model.safetensors"))
    assert sorted(back) == sorted(orig) and all(torch.equal(back[k], orig[k]) for k in orig)
    assert_same(ref, reload_logits(native), "llava_onevision-lmms (native save of the same weights) reloads")
    print("  llava_onevision-lmms: lmms-lab names invert exactly onto the llava-hf save")
    return {"llava_onevision-lmms": out}


# ---------------------------------------------------------------------------------------------
# LLaVA-NeXT Mistral (2.6)
# ---------------------------------------------------------------------------------------------
def build_llava_next(tok, tmp):
    text = text_dims(384, model_type="mistral", head_dim=8, tie_word_embeddings=False, rms_norm_eps=1e-5,
                     sliding_window=None, max_position_embeddings=32768,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                     bos_token_id=tid(tok, "<|begin_of_text|>"), eos_token_id=tid(tok, "<|eot_id|>"),
                     pad_token_id=tid(tok, "<|endoftext|>"))
    vision = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=8, patch_size=4, projection_dim=16)
    cfg = LlavaNextConfig(text_config=text, vision_config=vision, image_token_index=tid(tok, "<image>"),
                          vision_feature_layer=-1, vision_feature_select_strategy="default",
                          image_grid_pinpoints=[[8, 8], [8, 16]], tie_word_embeddings=False)
    cfg.architectures = ["LlavaNextForConditionalGeneration"]
    seed("llava_next")
    model = LlavaNextForConditionalGeneration(cfg)
    out = tmp / "llava_next"
    ref = logits_of(rounded(model, "f16"))
    gf.save_model(model, out, "f16")
    names = names_of(out)
    assert "language_model.lm_head.weight" in names and "image_newline" in names, names
    # As for llava_onevision in gen_fixtures.py: 5.23 drops CLIP's `vision_model.` level on save; the llava-hf
    # Hub repos have `vision_tower.vision_model.*`.
    assert not any(n.startswith("vision_tower.vision_model.") for n in names), names

    def hub_vision(name, t):
        if name.startswith("vision_tower."):
            return [("vision_tower.vision_model." + name[len("vision_tower."):], t)]
        return [(name, t)]
    rewrite_tensors(out / "model.safetensors", out / "model.safetensors", hub_vision)
    gf.write_generation_config(out, bos_token_id=text["bos_token_id"], eos_token_id=text["eos_token_id"],
                               pad_token_id=text["pad_token_id"])
    gf.write_tokenizer(tok, out, "llama3", None, False, 32768, extra_special=["<image>"])
    gf.write_chat_template_json(out, gf.LLAVA_OV_TEMPLATE)  # llava-hf processor template: list content
    processor_stub(out, "LlavaNextImageProcessor")
    gf.write_json(out / "processor_config.json", {"processor_class": "LlavaNextProcessor", "patch_size": 4,
                                                  "vision_feature_select_strategy": "default"})
    assert_same(ref, reload_logits(out), "llava_next reloads")
    return {"llava_next": out}


# ---------------------------------------------------------------------------------------------
# InternVL -hf (2.7): Qwen3 text (InternVL3.5-style), 5.x default tie -> no lm_head on disk
# ---------------------------------------------------------------------------------------------
def build_internvl_hf(tok, tmp):
    text = text_dims(model_type="qwen3", head_dim=16, rms_norm_eps=1e-6, attention_bias=False,
                     use_sliding_window=False, max_window_layers=2, max_position_embeddings=40960,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                     bos_token_id=tid(tok, "<|endoftext|>"), eos_token_id=tid(tok, "<|im_end|>"))
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                  patch_size=4, attention_bias=True, use_qk_norm=False, norm_type="layer_norm", hidden_act="gelu",
                  layer_norm_eps=1e-6, use_mean_pooling=True, layer_scale_init_value=0.1)
    cfg = InternVLConfig(text_config=text, vision_config=vision, image_token_id=tid(tok, "<IMG_CONTEXT>"),
                         downsample_ratio=0.5, image_seq_length=1)
    cfg.architectures = ["InternVLForConditionalGeneration"]
    assert cfg.tie_word_embeddings is True  # the 5.x class default (docs/reference/vlm-layouts.md#tied-embeddings)
    seed("internvl-hf")
    model = InternVLForConditionalGeneration(cfg)
    out = tmp / "internvl-hf"
    ref = logits_of(rounded(model, "bf16"))
    gf.save_model(model, out, "bf16")
    names = names_of(out)
    assert not any("lm_head" in n for n in names) and any(n.startswith("language_model.model.") for n in names)
    qwen_files(out, tok, gf.QWEN_VL_TEMPLATE, extra=["<img>", "</img>", "<IMG_CONTEXT>"])
    processor_stub(out, "GotOcr2ImageProcessor")
    assert_same(ref, reload_logits(out), "internvl-hf (tied by the 5.x default) reloads")
    return {"internvl-hf": out}


# ---------------------------------------------------------------------------------------------
# Ovis2 (2.11): -hf (5.x default tie) and the remote layout
# ---------------------------------------------------------------------------------------------
OVIS_REMOTE = [  # HF names -> AIDC-AI remote names (inverse of ORIGINAL_TO_HF_MAPPING, convert_ovis2_weights_to_hf.py)
    (r"^model\.language_model\.", "llm.model."),
    (r"^lm_head\.", "llm.lm_head."),
    (r"^model\.visual_embeddings_table\.weight$", "vte.weight"),
    (r"^model\.vision_tower\.head_linear\.", "visual_tokenizer.head.0."),
    (r"^model\.vision_tower\.head_norm\.", "visual_tokenizer.head.1."),
    (r"^model\.vision_tower\.transformer\.embeddings\.patch_embedding\.", "visual_tokenizer.backbone.preprocessor.patchifier.proj."),
    (r"^model\.vision_tower\.transformer\.embeddings\.rms_norm\.", "visual_tokenizer.backbone.preprocessor.patchifier.norm."),
    (r"^model\.vision_tower\.transformer\.embeddings\.position_embedding\.weight$", "visual_tokenizer.backbone.preprocessor.pos_embed"),
    (r"^model\.vision_tower\.transformer\.rms_norm\.", "visual_tokenizer.backbone.trunk.post_trunk_norm."),
    (r"^model\.vision_tower\.transformer\.encoder\.layers\.(\d+)\.rms_norm1\.", r"visual_tokenizer.backbone.trunk.blocks.\1.norm_1."),
    (r"^model\.vision_tower\.transformer\.encoder\.layers\.(\d+)\.rms_norm2\.", r"visual_tokenizer.backbone.trunk.blocks.\1.norm_2."),
    (r"^model\.vision_tower\.transformer\.encoder\.layers\.(\d+)\.attention\.out_proj\.", r"visual_tokenizer.backbone.trunk.blocks.\1.attn.proj."),
    (r"^model\.vision_tower\.transformer\.encoder\.layers\.(\d+)\.ffn\.gate_proj\.", r"visual_tokenizer.backbone.trunk.blocks.\1.mlp.fc1."),
    (r"^model\.vision_tower\.transformer\.encoder\.layers\.(\d+)\.ffn\.down_proj\.", r"visual_tokenizer.backbone.trunk.blocks.\1.mlp.fc2."),
    (r"^model\.vision_tower\.transformer\.encoder\.layers\.(\d+)\.ffn\.up_proj\.", r"visual_tokenizer.backbone.trunk.blocks.\1.mlp.fc3."),
]
OVIS_QKV = re.compile(r"^model\.vision_tower\.transformer\.encoder\.layers\.(\d+)\.attention\.(q|k|v)_proj\.weight$")


def ovis_to_remote(tensors):
    out, qkv = {}, {}
    for name in sorted(tensors):
        m = OVIS_QKV.match(name)
        if m:
            qkv.setdefault(m.group(1), {})[m.group(2)] = tensors[name]
            continue
        for pat, rep in OVIS_REMOTE:
            if re.match(pat, name):
                out[re.sub(pat, rep, name)] = tensors[name]
                break
        else:
            raise SystemExit(f"ovis2: no remote name for {name}")
    for i, parts in sorted(qkv.items()):
        out[f"visual_tokenizer.backbone.trunk.blocks.{i}.attn.qkv.weight"] = torch.cat(
            [parts["q"], parts["k"], parts["v"]], 0)
    pos = "visual_tokenizer.backbone.preprocessor.pos_embed"
    out[pos] = out[pos].unsqueeze(0)  # the remote keeps a leading batch axis (the converter takes [0])
    return out


def ovis_parts(tok, tie):
    text = text_dims(model_type="qwen2", rms_norm_eps=1e-6, use_sliding_window=False, max_window_layers=2,
                     max_position_embeddings=32768, tie_word_embeddings=tie,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                     bos_token_id=tid(tok, "<|endoftext|>"), eos_token_id=tid(tok, "<|im_end|>"))
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                  patch_size=4, vocab_size=24, num_visual_indicator_tokens=5, hidden_stride=1)
    return text, vision


def build_ovis2(tok, tmp):
    made = {}
    # -hf, default config: 5.x ties on the top-level flag (default True) whatever text_config says.
    text, vision = ovis_parts(tok, tie=False)
    cfg = Ovis2Config(text_config=text, vision_config=vision, image_token_id=tid(tok, "<image>"),
                      visual_indicator_token_ids=[tid(tok, "<|vision_start|>"), tid(tok, "<|vision_end|>"),
                                                  tid(tok, "<|vision_pad|>"), tid(tok, "<|image_pad|>"),
                                                  tid(tok, "<|video_pad|>")],
                      vocab_size=320, hidden_size=16)
    cfg.architectures = ["Ovis2ForConditionalGeneration"]
    assert cfg.tie_word_embeddings is True
    seed("ovis2-hf")
    model = Ovis2ForConditionalGeneration(cfg)
    hf = tmp / "ovis2-hf"
    ref = logits_of(rounded(model, "bf16"))
    gf.save_model(model, hf, "bf16")
    assert "lm_head.weight" not in names_of(hf)
    qwen_files(hf, tok, gf.QWEN_VL_TEMPLATE, extra=["<image>"])
    processor_stub(hf, "Ovis2ImageProcessor")
    assert_same(ref, reload_logits(hf), "ovis2-hf (tied by the 5.x default) reloads")
    made["ovis2-hf"] = hf

    # remote: an untied model (lm_head on disk), renamed to the AIDC-AI names, remote-code config.
    text, vision = ovis_parts(tok, tie=False)
    cfg = Ovis2Config(text_config=text, vision_config=vision, image_token_id=tid(tok, "<image>"),
                      vocab_size=320, hidden_size=16, tie_word_embeddings=False)
    cfg.architectures = ["Ovis2ForConditionalGeneration"]
    seed("ovis2")
    model = Ovis2ForConditionalGeneration(cfg)
    native = tmp / "_ovis2_native"
    gf.save_model(model, native, "bf16")
    tensors = load_file(str(native / "model.safetensors"))
    assert "lm_head.weight" in tensors
    remote = ovis_to_remote(tensors)
    out = tmp / "ovis2"
    out.mkdir()
    save_file(remote, str(out / "model.safetensors"), metadata={"format": "pt"})
    llm = json.loads(json.dumps(model.config.text_config.to_dict()))
    for k in ("rope_parameters", "dtype", "transformers_version", "output_attentions", "output_hidden_states",
              "return_dict", "chunk_size_feed_forward", "problem_type"):
        llm.pop(k, None)
    llm.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0, rope_scaling=None,
               torch_dtype="bfloat16", _name_or_path="Qwen/Qwen2.5-0.5B-Instruct", attn_implementation="sdpa")
    gf.write_json(out / "config.json", {
        "architectures": ["Ovis"], "auto_map": {"AutoConfig": "configuration_ovis.OvisConfig",
                                                "AutoModelForCausalLM": "modeling_ovis.Ovis"},
        "conversation_formatter_class": "QwenConversationFormatter", "disable_tie_weight": False,
        "hidden_size": 16, "llm_attn_implementation": "flash_attention_2", "llm_config": llm,
        "model_type": "ovis", "multimodal_max_length": 32768, "torch_dtype": "bfloat16",
        "transformers_version": "4.46.2",
        "visual_tokenizer_config": {"backbone_config": {"hidden_size": 16, "image_size": 8, "model_type": "aimv2",
                                                        "num_attention_heads": 2, "num_hidden_layers": 1,
                                                        "patch_size": 4},
                                    "hidden_stride": 1, "model_type": "aimv2_visual_tokenizer", "vocab_size": 24},
    })
    qwen_files(out, tok, gf.QWEN_TEMPLATE)
    placeholder = "# Placeholder for the AIDC-AI remote-code file of the same name (fixture only).\n"
    for py in ("configuration_ovis.py", "modeling_ovis.py"):
        (out / py).write_text(placeholder)
    made["ovis2"] = out
    return made


# ---------------------------------------------------------------------------------------------
# MiniCPM-V-4.5 (2.12): `llm` is a stock Qwen3ForCausalLM; flat config; remote tokenizer class
# ---------------------------------------------------------------------------------------------
def build_minicpm_v(tok, tmp):
    qcfg = Qwen3Config(**text_dims(head_dim=16, rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
                                   use_sliding_window=False, max_window_layers=2, max_position_embeddings=40960,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                   bos_token_id=tid(tok, "<|endoftext|>"), eos_token_id=tid(tok, "<|im_end|>")))
    seed("minicpm-v")
    llm = Qwen3ForCausalLM(qcfg).to(torch.bfloat16)
    tensors = {f"llm.{k}": v.contiguous() for k, v in llm.state_dict().items()}
    g = torch.Generator().manual_seed(gf.hash_str("minicpm-v-vision") % (2**31))

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    v, q, h = 16, 4, qcfg.hidden_size  # vision width, resampler queries, LLM width
    vision = {  # SigLIP-NaViT (`vpm`) and the perceiver resampler, as the remote MiniCPMV names them
        "vpm.embeddings.patch_embedding.weight": rnd(v, 3, 4, 4), "vpm.embeddings.patch_embedding.bias": rnd(v),
        "vpm.embeddings.position_embedding.weight": rnd(4, v),
        "vpm.encoder.layers.0.layer_norm1.weight": rnd(v), "vpm.encoder.layers.0.layer_norm1.bias": rnd(v),
        "vpm.encoder.layers.0.self_attn.q_proj.weight": rnd(v, v), "vpm.encoder.layers.0.self_attn.q_proj.bias": rnd(v),
        "vpm.encoder.layers.0.self_attn.k_proj.weight": rnd(v, v), "vpm.encoder.layers.0.self_attn.k_proj.bias": rnd(v),
        "vpm.encoder.layers.0.self_attn.v_proj.weight": rnd(v, v), "vpm.encoder.layers.0.self_attn.v_proj.bias": rnd(v),
        "vpm.encoder.layers.0.self_attn.out_proj.weight": rnd(v, v),
        "vpm.encoder.layers.0.self_attn.out_proj.bias": rnd(v),
        "vpm.encoder.layers.0.layer_norm2.weight": rnd(v), "vpm.encoder.layers.0.layer_norm2.bias": rnd(v),
        "vpm.encoder.layers.0.mlp.fc1.weight": rnd(2 * v, v), "vpm.encoder.layers.0.mlp.fc1.bias": rnd(2 * v),
        "vpm.encoder.layers.0.mlp.fc2.weight": rnd(v, 2 * v), "vpm.encoder.layers.0.mlp.fc2.bias": rnd(v),
        "vpm.post_layernorm.weight": rnd(v), "vpm.post_layernorm.bias": rnd(v),
        "resampler.query": rnd(q, h), "resampler.kv_proj.weight": rnd(h, v),
        "resampler.attn.in_proj_weight": rnd(3 * h, h), "resampler.attn.in_proj_bias": rnd(3 * h),
        "resampler.attn.out_proj.weight": rnd(h, h), "resampler.attn.out_proj.bias": rnd(h),
        "resampler.ln_q.weight": rnd(h), "resampler.ln_q.bias": rnd(h),
        "resampler.ln_kv.weight": rnd(h), "resampler.ln_kv.bias": rnd(h),
        "resampler.ln_post.weight": rnd(h), "resampler.ln_post.bias": rnd(h), "resampler.proj": rnd(h, h),
    }
    tensors.update(vision)
    out = tmp / "minicpm-v"
    out.mkdir()
    save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    flat = json.loads(json.dumps(qcfg.to_dict()))
    for k in ("rope_parameters", "dtype", "transformers_version", "architectures", "model_type",
              "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
              "problem_type", "layer_types"):
        flat.pop(k, None)
    flat.update({
        "architectures": ["MiniCPMV"], "model_type": "minicpmv", "rope_theta": 1000000.0, "rope_scaling": None,
        "torch_dtype": "bfloat16", "transformers_version": "4.56.0",
        "auto_map": {"AutoConfig": "configuration_minicpm.MiniCPMVConfig",
                     "AutoModel": "modeling_minicpmv.MiniCPMV",
                     "AutoModelForCausalLM": "modeling_minicpmv.MiniCPMV"},
        "batch_vision_input": True, "drop_vision_last_layer": False, "image_size": 8, "patch_size": 4,
        "query_num": q, "slice_config": {"max_slice_nums": 9, "patch_size": 4, "model_type": "minicpmv"},
        "slice_mode": True, "use_image_id": True, "version": 4.5, "vision_batch_size": 16,
        "vision_config": {"hidden_size": v, "image_size": 8, "intermediate_size": 2 * v, "model_type": "siglip",
                          "num_attention_heads": 2, "num_hidden_layers": 1, "patch_size": 4},
    })
    gf.write_json(out / "config.json", flat)
    qwen_files(out, tok, gf.QWEN_TEMPLATE, extra=["<image>"])
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "MiniCPMVTokenizerFast"  # a remote tokenizer class (docs/reference/vlm-layouts.md#minicpm-v, UNVERIFIED)
    tc["auto_map"] = {"AutoTokenizer": ["tokenization_minicpmv_fast.MiniCPMVTokenizerFast", None]}
    gf.write_json(tc_path, tc)
    placeholder = "# Placeholder for the openbmb remote-code file of the same name (fixture only).\n"
    for py in ("configuration_minicpm.py", "modeling_minicpmv.py", "resampler.py", "tokenization_minicpmv_fast.py"):
        (out / py).write_text(placeholder)
    processor_stub(out, "MiniCPMVImageProcessor")
    back = {k[len("llm."):]: t for k, t in load_file(str(out / "model.safetensors")).items() if k.startswith("llm.")}
    assert all(torch.equal(back[k], v) for k, v in llm.state_dict().items()) and len(back) == len(llm.state_dict())
    print("  minicpm-v: llm.* holds exactly the Qwen3ForCausalLM state dict")
    return {"minicpm-v": out}


# ---------------------------------------------------------------------------------------------
# Molmo2 (2.9): native 5.23 class; its save_pretrained reverts to the Hub names
# ---------------------------------------------------------------------------------------------
def molmo2_parts(variant):
    additional = 16
    if variant == "qwen3":
        text = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=320,
                    additional_vocab_size=additional, qkv_bias=False, qk_norm_type="qwen3", norm_after=False,
                    intermediate_size=32, num_hidden_layers=2, layer_norm_eps=1e-6, max_position_embeddings=4096,
                    rope_theta=1000000.0, rope_scaling=None, rope_scaling_layers=None)
    else:
        text = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=320,
                    additional_vocab_size=additional, qkv_bias=False, qk_norm_type="olmo", norm_after=True,
                    intermediate_size=32, num_hidden_layers=2, layer_norm_eps=1e-6, max_position_embeddings=4096,
                    rope_theta=500000.0, rope_scaling=None, rope_scaling_layers=None)
        if variant == "partial-rope":
            text.update(rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
                        rope_scaling_layers=[1])
    vit = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=2, head_dim=8, image_default_input_size=[8, 8], image_patch_size=4,
               image_num_pos=4, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")
    adapter = dict(vit_layers=[-1], hidden_size=16, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                   intermediate_size=32, text_hidden_size=16, hidden_act="silu")
    return text, vit, adapter


def molmo2_native_config(text, vit, adapter):
    t = dict(text)
    t["attention_bias"] = t.pop("qkv_bias")
    t["rms_norm_eps"] = t.pop("layer_norm_eps")
    theta, scaling = t.pop("rope_theta"), t.pop("rope_scaling")
    t["rope_parameters"] = dict(scaling or {"rope_type": "default"}, rope_theta=theta)
    return Molmo2Config(text_config=t, vision_config=vit, adapter_config=adapter, image_start_token_id=320,
                        low_res_image_start_token_id=321, image_end_token_id=322, image_patch_id=323,
                        frame_start_token_id=324, frame_end_token_id=325, tie_word_embeddings=False)


def molmo2_remote_config(text, vit, adapter):
    """The allenai remote-code schema (field names of the remote modeling_molmo2.py, docs/reference/vlm-layouts.md#molmo2)."""
    t = dict(text, model_type="molmo2_text", hidden_act="silu", use_qk_norm=True, embedding_dropout=0.0,
             residual_dropout=0.0, attention_dropout=0.0, initializer_range=0.02, use_cache=True)
    return {
        "architectures": ["Molmo2ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_molmo2.Molmo2Config",
                     "AutoModelForImageTextToText": "modeling_molmo2.Molmo2ForConditionalGeneration"},
        "model_type": "molmo2", "text_config": t, "vit_config": dict(vit, model_type="molmo2_vit"),
        "adapter_config": dict(adapter, model_type="molmo2_adapter"),
        "image_start_token_id": 320, "low_res_image_start_token_id": 321, "image_end_token_id": 322,
        "image_patch_id": 323, "frame_start_token_id": 324, "frame_end_token_id": 325,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
        "use_cache": True,
    }


def build_molmo2(tok, tmp):
    made = {}
    for variant, name in (("olmo", "molmo2-o"), ("partial-rope", "molmo2-o-partial-rope"),
                          ("qwen3", "molmo2-qwen3")):
        text, vit, adapter = molmo2_parts(variant)
        cfg = molmo2_native_config(text, vit, adapter)
        cfg.architectures = ["Molmo2ForConditionalGeneration"]
        seed(name)
        model = Molmo2ForConditionalGeneration(cfg)
        raw = tmp / f"_{name}_raw"
        ref = logits_of(rounded(model, "bf16"))
        gf.save_model(model, raw, "bf16")
        v, a = text["vocab_size"], text["additional_vocab_size"]
        raw_t = load_file(str(raw / "model.safetensors"))
        e, n = raw_t["model.transformer.wte.embedding"], raw_t["model.transformer.wte.new_embedding"]
        assert e.shape[0] == n.shape[0] == (v + a) // 2, (e.shape, n.shape)  # 5.23's Chunk re-split (2.9)
        full = torch.cat([e, n], 0)
        out = tmp / name

        def repair(nm, t):
            if nm == "model.transformer.wte.embedding":
                return [(nm, full[:v])]
            if nm == "model.transformer.wte.new_embedding":
                return [(nm, full[v:])]
            return [(nm, t)]
        saved = rewrite_tensors(raw / "model.safetensors", out / "model.safetensors", repair)
        assert any(k.endswith("self_attn.att_proj.weight") for k in saved) and "lm_head.weight" in saved
        gf.write_json(out / "config.json", molmo2_remote_config(text, vit, adapter))
        gf.write_generation_config(out, eos_token_id=tid(tok, "<|im_end|>"), pad_token_id=tid(tok, "<|endoftext|>"))
        gf.write_tokenizer(tok, out, "qwen", gf.QWEN_TEMPLATE, True, 4096)
        processor_stub(out, "Molmo2ImageProcessor")
        assert_same(ref, reload_logits(out), f"{name} (Hub names, remote config) reloads in 5.23")
        made[name] = out
        if variant == "olmo":
            resaved = tmp / "molmo2-o-resaved"
            shutil.copytree(raw, resaved)
            for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
                      "merges.txt"):
                shutil.copyfile(out / f, resaved / f)
            assert_same(ref, reload_logits(resaved), "molmo2-o-resaved (raw 5.23 save, halved wte) reloads")
            made["molmo2-o-resaved"] = resaved
    return made


# ---------------------------------------------------------------------------------------------
# MolmoE-1B (2.10): OLMoE language module in the Hub (megablocks) layout and a port's per-expert layout
# ---------------------------------------------------------------------------------------------
def build_molmoe(tok, tmp):
    H, E, I, V, EMB, A = 16, 4, 4, 320, 384, 16
    ocfg = OlmoeConfig(vocab_size=EMB, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, num_experts=E, num_experts_per_tok=2,
                       norm_topk_prob=False, rms_norm_eps=1e-5, max_position_embeddings=4096, clip_qkv=None,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                       pad_token_id=1, eos_token_id=tid(tok, "<|endoftext|>"), bos_token_id=None)
    seed("molmoe")
    lm = OlmoeForCausalLM(ocfg).to(torch.bfloat16)
    sd = {k: v.contiguous() for k, v in lm.state_dict().items()}
    assert sd["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, 2 * I, H), "5.x fused experts in memory"
    g = torch.Generator().manual_seed(gf.hash_str("molmoe-vision") % (2**31))

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    common = {
        "model.transformer.wte.embedding": sd["model.embed_tokens.weight"],
        "model.transformer.wte.new_embedding": rnd(A, H),
        "model.transformer.ln_f.weight": sd["model.norm.weight"],
        "model.vision_backbone.image_vit.patch_embedding.weight": rnd(16, 48),  # vision width 16
        "model.vision_backbone.image_vit.transformer.resblocks.0.attention.wq.weight": rnd(16, 16),
        "model.vision_backbone.image_vit.transformer.resblocks.0.feed_forward.w1.weight": rnd(32, 16),
        "model.vision_backbone.image_pooling_2d.wq.weight": rnd(16, 16),
        "model.vision_backbone.image_projector.w1.weight": rnd(32, 16),
        "model.vision_backbone.pad_embed": rnd(2, 16),
    }
    layouts = {}
    for variant in ("megablocks", "hf"):
        t = dict(common)
        for i in range(2):
            p, b = f"model.layers.{i}.", f"model.transformer.blocks.{i}."
            qkv = torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"], 0)
            gu = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2I, H]: gate rows then up rows
            dn = sd[p + "mlp.experts.down_proj"]  # [E, H, I]
            if variant == "megablocks":
                t.update({
                    b + "att_proj.weight": qkv, b + "attn_out.weight": sd[p + "self_attn.o_proj.weight"],
                    b + "q_norm.weight": sd[p + "self_attn.q_norm.weight"],
                    b + "k_norm.weight": sd[p + "self_attn.k_norm.weight"],
                    b + "attn_norm.weight": sd[p + "input_layernorm.weight"],
                    b + "ff_norm.weight": sd[p + "post_attention_layernorm.weight"],
                    b + "ffn.router.layer.weight": sd[p + "mlp.gate.weight"],
                    b + "ffn.experts.mlp.w1": gu[:, :I, :].reshape(E * I, H).contiguous(),
                    b + "ffn.experts.mlp.v1": gu[:, I:, :].reshape(E * I, H).contiguous(),
                    b + "ffn.experts.mlp.w2": dn.transpose(1, 2).reshape(E * I, H).contiguous(),
                })
            else:
                t.update({
                    b + "attn.att_proj.weight": qkv, b + "attn.attn_out.weight": sd[p + "self_attn.o_proj.weight"],
                    b + "attn.q_norm.weight": sd[p + "self_attn.q_norm.weight"],
                    b + "attn.k_norm.weight": sd[p + "self_attn.k_norm.weight"],
                    b + "attn.attn_norm.weight": sd[p + "input_layernorm.weight"],
                    b + "mlp.ff_norm.weight": sd[p + "post_attention_layernorm.weight"],
                    b + "mlp.gate.weight": sd[p + "mlp.gate.weight"],
                })
                for e in range(E):
                    t[b + f"mlp.experts.{e}.gate_proj.weight"] = gu[e, :I].contiguous()
                    t[b + f"mlp.experts.{e}.up_proj.weight"] = gu[e, I:].contiguous()
                    t[b + f"mlp.experts.{e}.down_proj.weight"] = dn[e].contiguous()
        # MolmoForCausalLM keeps its untied head as `model.transformer.ff_out` (weight_tying false) in both
        t["model.transformer.ff_out.weight"] = sd["lm_head.weight"]
        layouts[variant] = t
    made = {}
    for variant, t in layouts.items():
        name = f"molmoe-{variant}"
        out = tmp / name
        out.mkdir()
        save_file(dict(sorted(t.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
        gf.write_json(out / "config.json", {  # the MolmoE-1B-0924 Hub schema (docs/reference/vlm-layouts.md#molmoe), tiny sizes
            "architectures": ["OLMoForCausalLM"], "auto_map": {"AutoConfig": "config_molmoe.MolmoConfig",
                                                               "AutoModelForCausalLM": "modeling_molmoe.MolmoForCausalLM"},
            "activation_type": "swiglu", "additional_vocab_size": A, "attention_layer_norm": True,
            "attention_type": "sdpa", "block_type": "moe", "clip_qkv": None, "d_model": H, "embedding_size": EMB,
            "float32_attention": True, "head_dim": None, "include_bias": False, "layer_norm_eps": 1e-5,
            "layer_norm_type": "rms", "max_position_embeddings": 4096, "mlp_hidden_size": None, "mlp_ratio": 0.5,
            "model_type": "molmo", "moe_dropless": True, "moe_mlp_impl": "sparse", "moe_num_experts": E,
            "moe_top_k": 2, "n_heads": 4, "n_kv_heads": None, "n_layers": 2, "norm_after": False,
            "pad_token_id": 1, "qkv_bias": False, "rope": True, "rope_impl": "llama", "rope_theta": 10000.0,
            "transformers_version": "4.45.0.dev0", "use_cache": True, "vit_layers": [-2, -9], "vocab_size": V,
            "vision_backbone": {"image_emb_dim": 16, "image_num_layers": 1, "image_patch_size": 4},
            "weight_tying": False,
        })
        gf.write_generation_config(out, eos_token_id=tid(tok, "<|endoftext|>"), pad_token_id=1)
        gf.write_tokenizer(tok, out, "generic", None, False, 4096)
        placeholder = "# Placeholder for the allenai remote-code file of the same name (fixture only).\n"
        for py in ("config_molmoe.py", "modeling_molmoe.py"):
            (out / py).write_text(placeholder)
        made[name] = out
    # layout check: rebuild the OLMoE state dict from each layout
    for variant, t in layouts.items():
        for i in range(2):
            b, p = f"model.transformer.blocks.{i}.", f"model.layers.{i}."
            if variant == "megablocks":
                w1 = t[b + "ffn.experts.mlp.w1"].reshape(E, I, H)
                v1 = t[b + "ffn.experts.mlp.v1"].reshape(E, I, H)
                w2 = t[b + "ffn.experts.mlp.w2"].reshape(E, I, H).transpose(1, 2)
                assert torch.equal(torch.cat([w1, v1], 1), sd[p + "mlp.experts.gate_up_proj"])
                assert torch.equal(w2, sd[p + "mlp.experts.down_proj"])
    print("  molmoe: both layouts invert exactly onto the OLMoE state dict")
    return made



# ---------------------------------------------------------------------------------------------
# Molmo2 on a Qwen2 language model: remote names, q/k/v biases in att_proj, no q/k norms
# (docs/reference/vlm-layouts.md#molmo2). The 5.x class always has q/k norms, so this is laid out by hand.
# ---------------------------------------------------------------------------------------------
def build_molmo2_qwen2(tok, tmp):
    V, A, L = 320, 16, 2
    qcfg = Qwen2Config(**text_dims(vocab=V, head_dim=8, num_hidden_layers=L, rms_norm_eps=1e-6,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                   tie_word_embeddings=False, use_sliding_window=False))
    seed("molmo2-qwen2")
    lm = Qwen2ForCausalLM(qcfg).to(torch.bfloat16)
    with torch.no_grad():  # the default init zeroes biases; make them count
        for n, p in lm.named_parameters():
            if n.endswith("_proj.bias"):
                p.copy_((torch.randn_like(p, dtype=torch.float32) * 0.1).to(p.dtype))
    sd = {k: v.contiguous() for k, v in lm.state_dict().items()}
    g = torch.Generator().manual_seed(gf.hash_str("molmo2-qwen2-vision") % (2**31))

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    t = {
        "model.transformer.wte.embedding": sd["model.embed_tokens.weight"],
        "model.transformer.wte.new_embedding": rnd(A, 16),
        "model.transformer.ln_f.weight": sd["model.norm.weight"],
        "lm_head.weight": sd["lm_head.weight"],
        "model.vision_backbone.image_vit.patch_embedding.weight": rnd(16, 48),
        "model.vision_backbone.image_vit.transformer.resblocks.0.attention.wq.weight": rnd(16, 16),
        "model.vision_backbone.image_projector.w1.weight": rnd(32, 16),
        "model.vision_backbone.image_pooling_2d.wq.weight": rnd(16, 16),
    }
    for i in range(L):
        p, b = f"model.layers.{i}.", f"model.transformer.blocks.{i}."
        a = p + "self_attn."
        t.update({
            b + "self_attn.att_proj.weight": torch.cat([sd[a + f"{x}_proj.weight"] for x in "qkv"], 0),
            b + "self_attn.att_proj.bias": torch.cat([sd[a + f"{x}_proj.bias"] for x in "qkv"], 0),
            b + "self_attn.attn_out.weight": sd[a + "o_proj.weight"],
            b + "attn_norm.weight": sd[p + "input_layernorm.weight"],
            b + "ff_norm.weight": sd[p + "post_attention_layernorm.weight"],
            # the remote MLP does `x, gate = ff_proj(x).chunk(2); act(gate) * x`: up rows first
            b + "mlp.ff_proj.weight": torch.cat([sd[p + "mlp.up_proj.weight"], sd[p + "mlp.gate_proj.weight"]], 0),
            b + "mlp.ff_out.weight": sd[p + "mlp.down_proj.weight"],
        })
    name = "molmo2-qwen2"
    out = tmp / name
    out.mkdir()
    save_file(dict(sorted(t.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    text = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=V,
                additional_vocab_size=A, qkv_bias=True, qk_norm_type="olmo", norm_after=False, intermediate_size=32,
                num_hidden_layers=L, layer_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=1000000.0,
                rope_scaling=None, rope_scaling_layers=None)
    _, vit, adapter = molmo2_parts("qwen3")
    cfg = molmo2_remote_config(text, vit, adapter)
    cfg["text_config"]["use_qk_norm"] = False
    gf.write_json(out / "config.json", cfg)
    gf.write_generation_config(out, eos_token_id=tid(tok, "<|im_end|>"), pad_token_id=tid(tok, "<|endoftext|>"))
    gf.write_tokenizer(tok, out, "qwen", gf.QWEN_TEMPLATE, True, 4096)
    placeholder = "# Placeholder for the allenai remote-code file of the same name (fixture only).\n"
    for py in ("configuration_molmo2.py", "modeling_molmo2.py"):
        (out / py).write_text(placeholder)
    # layout check: the remote names invert exactly onto the Qwen2 state dict
    for i in range(L):
        p, b = f"model.layers.{i}.", f"model.transformer.blocks.{i}."
        for kind in ("weight", "bias"):
            q, k, v = t[b + f"self_attn.att_proj.{kind}"].split([16, 8, 8], 0)
            for x, w in zip("qkv", (q, k, v)):
                assert torch.equal(w, sd[p + f"self_attn.{x}_proj.{kind}"])
        up, gate = t[b + "mlp.ff_proj.weight"].chunk(2, 0)
        assert torch.equal(up, sd[p + "mlp.up_proj.weight"]) and torch.equal(gate, sd[p + "mlp.gate_proj.weight"])
    print("  molmo2-qwen2: remote names invert exactly onto the Qwen2 state dict")
    return {name: out}


# ---------------------------------------------------------------------------------------------
# InternVL with an InternLM2 language model (InternVL2.5-2B/8B/26B, InternVL3-9B): remote names
# (docs/reference/vlm-layouts.md#internvl). transformers' convert_internvl_weights_to_hf.py turns the
# InternLM2 LM into LlamaForCausalLM; this lays a Llama model out in the InternLM2 names (its inverse).
# ---------------------------------------------------------------------------------------------
def internlm2_wqkv(q, k, v, kv_heads, head_dim):
    """[q x heads/kv_heads, k, v] per KV head: what `rearrange("(h gs d) z -> h gs d z")` splits."""
    hidden = q.shape[-1]
    groups = q.shape[0] // (kv_heads * head_dim)
    qs = q.reshape(kv_heads, groups, head_dim, hidden)
    ks = k.reshape(kv_heads, 1, head_dim, hidden)
    vs = v.reshape(kv_heads, 1, head_dim, hidden)
    return torch.cat([qs, ks, vs], 1).reshape(-1, hidden).contiguous()


def build_internvl_internlm2(tok, tmp):
    V, L, H, NH, NKV = 320, 2, 16, 4, 2
    hd = H // NH
    lcfg = LlamaConfig(**text_dims(vocab=V, hidden_size=H, num_attention_heads=NH, num_key_value_heads=NKV,
                                   num_hidden_layers=L, rms_norm_eps=1e-5,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0))
    seed("internvl-internlm2")
    lm = LlamaForCausalLM(lcfg).to(torch.bfloat16)
    sd = {k: v.contiguous() for k, v in lm.state_dict().items()}
    g = torch.Generator().manual_seed(gf.hash_str("internvl-internlm2-vision") % (2**31))

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    lmp = "language_model."
    t = {
        lmp + "model.tok_embeddings.weight": sd["model.embed_tokens.weight"],
        lmp + "model.norm.weight": sd["model.norm.weight"],
        lmp + "output.weight": sd["lm_head.weight"],
        "vision_model.embeddings.class_embedding": rnd(1, 1, 32),
        "vision_model.embeddings.patch_embedding.weight": rnd(32, 3, 4, 4),
        "vision_model.encoder.layers.0.attn.qkv.weight": rnd(96, 32),
        "mlp1.0.weight": rnd(128), "mlp1.1.weight": rnd(H, 128), "mlp1.3.weight": rnd(H, H),
    }
    renames = {"self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1",
               "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2",
               "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(L):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        t[lmp + p + "attention.wqkv.weight"] = internlm2_wqkv(sd[a + "q_proj.weight"], sd[a + "k_proj.weight"],
                                                           sd[a + "v_proj.weight"], NKV, hd)
        for llama, internlm2 in renames.items():
            t[lmp + p + internlm2 + ".weight"] = sd[p + llama + ".weight"]
    name = "internvl-internlm2"
    out = tmp / name
    out.mkdir()
    save_file(dict(sorted(t.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    llm_config = {  # the InternLM2 `llm_config` of OpenGVLab/InternVL2_5-8B, tiny sizes
        "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2",
        "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config",
                     "AutoModel": "modeling_internlm2.InternLM2ForCausalLM",
                     "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"},
        "attn_implementation": "eager", "bias": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": 32,
        "max_position_embeddings": 4096, "num_attention_heads": NH, "num_hidden_layers": L,
        "num_key_value_heads": NKV, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": V,
    }
    gf.write_json(out / "config.json", {
        "architectures": ["InternVLChatModel"],
        "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
                     "AutoModel": "modeling_internvl_chat.InternVLChatModel",
                     "AutoModelForCausalLM": "modeling_internvl_chat.InternVLChatModel"},
        "downsample_ratio": 0.5, "dynamic_image_size": True, "force_image_size": 8, "llm_config": llm_config,
        "max_dynamic_patch": 12, "min_dynamic_patch": 1, "model_type": "internvl_chat", "ps_version": "v2",
        "select_layer": -1, "template": "internlm2-chat", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_thumbnail": True,
        "vision_config": {"architectures": ["InternVisionModel"], "hidden_size": 32, "image_size": 8,
                          "intermediate_size": 64, "model_type": "intern_vit_6b", "num_attention_heads": 2,
                          "num_hidden_layers": 1, "patch_size": 4, "qkv_bias": True},
    })
    gf.write_generation_config(out, eos_token_id=tid(tok, "<|im_end|>"), pad_token_id=tid(tok, "<|endoftext|>"))
    gf.write_tokenizer(tok, out, "generic", None, False, 4096)
    placeholder = "# Placeholder for the OpenGVLab remote-code file of the same name (fixture only).\n"
    for py in ("configuration_internvl_chat.py", "modeling_internvl_chat.py", "configuration_internlm2.py",
               "modeling_internlm2.py"):
        (out / py).write_text(placeholder)
    # layout check: the converter's own split (einops "(h gs d) z -> h gs d z") gives back q/k/v
    for i in range(L):
        p = f"model.layers.{i}."
        qkv = t[lmp + p + "attention.wqkv.weight"].reshape(NKV, NH // NKV + 2, hd, H)
        assert torch.equal(qkv[:, : NH // NKV].reshape(-1, H), sd[p + "self_attn.q_proj.weight"])
        assert torch.equal(qkv[:, -2].reshape(-1, H), sd[p + "self_attn.k_proj.weight"])
        assert torch.equal(qkv[:, -1].reshape(-1, H), sd[p + "self_attn.v_proj.weight"])
    print("  internvl-internlm2: the InternLM2 names invert exactly onto the Llama state dict")
    return {name: out}


BUILDERS = {  # case -> builder (a builder may make several cases)
    "qwen2_vl": build_qwen2_vl, "qwen3_vl_moe-5x": build_qwen3_vl_moe, "qwen3_vl_moe-hub": build_qwen3_vl_moe,
    "llava_onevision-lmms": build_llava_onevision_lmms, "llava_next": build_llava_next,
    "internvl-hf": build_internvl_hf, "ovis2": build_ovis2, "ovis2-hf": build_ovis2, "minicpm-v": build_minicpm_v,
    "molmo2-o": build_molmo2, "molmo2-o-partial-rope": build_molmo2, "molmo2-o-resaved": build_molmo2,
    "molmo2-qwen3": build_molmo2, "molmo2-qwen2": build_molmo2_qwen2, "molmoe-megablocks": build_molmoe,
    "molmoe-hf": build_molmoe, "internvl-internlm2": build_internvl_internlm2,
}


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(BUILDERS), help="rebuild only these cases")
    args = ap.parse_args()
    tok = gf.train_base_tokenizer()
    tmp = Path(tempfile.mkdtemp(prefix="sinkmerge_families_"))
    built = {}
    builders = []
    for case in (args.only or BUILDERS):
        if BUILDERS[case] not in builders:
            builders.append(BUILDERS[case])
    for build in builders:
        print(build.__name__)
        built.update(build(tok, tmp))
    if args.only:
        built = {k: v for k, v in built.items() if k in args.only}
        for name in built:
            if (OUT / name).exists():
                shutil.rmtree(OUT / name)
    else:
        if OUT.exists():
            shutil.rmtree(OUT)
    OUT.mkdir(parents=True, exist_ok=True)
    total = 0
    for name in sorted(built):
        shutil.copytree(built[name], OUT / name)
        for p in (OUT / name).rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        size = sum(f.stat().st_size for f in (OUT / name).rglob("*") if f.is_file())
        total += size
        print(f"  {name:24s} {size / 1024:7.1f} KiB")
    print(f"  total {total / 1024:.1f} KiB")
    shutil.rmtree(tmp)
    digest = __import__("hashlib").sha256()
    for rel, h in gf.sha_tree(OUT).items():
        digest.update(f"{rel} {h}\n".encode())
    print(f"sha256 over tests/fixtures/families: {digest.hexdigest()}")


if __name__ == "__main__":
    main()
