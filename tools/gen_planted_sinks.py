#!/usr/bin/env python3
"""A planted-visual-sink fixture for `sinkmerge visual-sinks` (tests/fixtures/visual_sinks/planted/).

Run from the repository root:

    nice -n 10 tools/.venv/bin/python tools/gen_planted_sinks.py

Builds a tiny Qwen3-VL (transformers 5.23's own Qwen3VLForConditionalGeneration, float32) whose weights are set by
hand where it matters, so that the image tokens of a pure-red 32x32 cell get pre-RoPE keys that point along the
text sink's key (position 0) relative to the mean image key, and take almost all of the question's in-image
attention; every other colour gives keys roughly orthogonal to that direction. Writes model/ (config, f32
safetensors, tokenizer/chat/processor files), image.png and README.md, then reloads the saved checkpoint and checks,
with a short computation written from docs/reference/visual-sinks.md, that the gate, the sinks and the `remove` edit
(and its random-direction control) behave as planted. Rerunning gives byte-identical files.

Design (residual stream of 32 dims; LM layers 1 and 2 are the planted ones, layer 0 only marks position 0):

* vision: patch_embed averages each colour channel of a patch into dims 0..2 (normalised pixels, in [-1, 1]); a
  +-2 bias on dims 6..31 keeps the merger's LayerNorm nearly linear; the learned position embeddings write small
  seeded values into dims 3..5; both vision blocks are identities (attn.proj and mlp.linear_fc2 zeroed). The
  merger's fc1 has a red detector (GELU(3 * (sum over the 2x2 patches of r - g - b) - threshold)) that fires only
  when all four patches are pure red, plus pass-through colour/position units and seeded random colour units; fc2
  writes: CONST=1, IMG=1, RED (1 for a red token, ~0 otherwise), 6 colour dims, 3 position dims. The deepstack
  merger (vision block 1, added after LM layer 0) adds small seeded values to the position dims only.
* text embeddings: CONST=1 for every token, IMS=1 for <|im_start|>, seeded random text dims and scratch dims.
* LM layer 0: q_proj = 0, so attention is uniform over the prefix; its value is the IMS flag, written to F. So
  F = (number of <|im_start|> up to i) / (i + 1): 1 at position 0 only, 1/2 at position 1, small later.
* LM layers 1, 2 (head_dim 64; s = head dim 31, paired with 63 by RoPE at the lowest frequency, 30/62 next): every
  query is q ~ e_s (q_proj reads only CONST, into head dims 31 and, for heads 1..3, a little of 63; q_norm). The raw
  key has dim s = a * (F - theta) + c_img * IMG + c_red * RED (positive for position 0 and for red tokens, ~0 on
  average for other image tokens, negative for other text tokens), CONST -> dim 63, IMG -> dim 62, colour -> dims
  0..5, position -> dims 8..10, text dims -> 11..13; k_norm's weight stretches dim s (W_S). So the scores are
  ~ sqrt(64) * w_q * W_S * cos(raw key, e_s) for every row. The <|im_start|> column of k_proj is solved for so that
  position 0's normalised key equals (mean normalised image key off dim s) + (a large dim s): then k_0 - mu is
  along e_s, and so is u = unit(k_t* - mu), which the `remove` edit projects out of the red keys. c_red puts the
  red tokens' cos(raw key, e_s) a little below position 0's, so position 0 stays the most attended position.
  The attention outputs (o_proj) and the MLPs write only scratch dims (they move the logits, so the edit's KL is
  not 0), except a small layer-1 o_proj coupling into a position dim read by layer 2's keys.
"""
import json
import math
import shutil
from pathlib import Path

import torch
import transformers
from PIL import Image
from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration, \
    Qwen3VLProcessor
from transformers.image_utils import load_image

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
transformers.logging.set_verbosity_error()
_check = transformers.ProcessorMixin.check_argument_for_proper_class
transformers.ProcessorMixin.check_argument_for_proper_class = (
    lambda self, name, arg: None if arg is None else _check(self, name, arg))

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "tests" / "fixtures" / "vlm" / "qwen3_vl"  # tokenizer / chat template source
OUT = ROOT / "tests" / "fixtures" / "visual_sinks" / "planted"
MODEL = OUT / "model"
SEED = 20261017
QUESTION = "Where is the red square?"
RATIO = 5.0   # --ratio
GATE = 0.5    # --gate
LAYERS = [1, 2]  # the planted layers (layer 0 has uniform attention: no sinks)

# residual dims
CONST, IMS, F, IMG, RED = 0, 1, 2, 3, 4
COL = list(range(5, 11))
POS = list(range(11, 14))
TXT = list(range(14, 24))
SCR = list(range(24, 32))
# key dims (head_dim 64; dim d pairs with d+32 under RoPE, d = 30, 31 are the two lowest frequencies)
HD = 64
KS, KC, KI = 31, 63, 62
KCOL = list(range(0, 6))
KPOS = [8, 9, 10]
KTXT = [11, 12, 13]

CELL = 32  # one merged token = 2x2 patches of 16 px
# 4 rows x 5 columns of 32x32 cells, row-major = the order of the image tokens
RED_RGB = (255, 0, 0)
PALETTE = {
    "grey": (128, 128, 128), "blue": (40, 70, 200), "green": (40, 160, 60), "white": (240, 240, 240),
    "yellow": (230, 210, 40), "cyan": (40, 200, 210), "purple": (120, 50, 160), "black": (20, 20, 20),
    "orange": (240, 140, 20), "teal": (20, 130, 130), "magenta": (200, 40, 180), "brown": (120, 80, 40),
    "navy": (20, 30, 90), "pink": (240, 170, 190), "olive": (120, 130, 30), "red": RED_RGB,
}
LAYOUT = [
    ["grey", "half_red", "blue", "green", "white"],
    ["yellow", "cyan", "purple", "red", "grey"],
    ["black", "orange", "teal", "magenta", "brown"],
    ["red", "navy", "pink", "olive", "grey"],
]
RED_TOKENS = [r * 5 + c for r, row in enumerate(LAYOUT) for c, n in enumerate(row) if n == "red"]
# target.png: the same grid with one red cell (row 3's red is navy), so its one sink takes about 20x uniform (n = 20),
# above the 10x mask of Table 10; the box is the top-left cell, the earliest image token, which the unplanted keys
# favour (their F term is largest there): the raw top-1 is the sink outside the box, and the top-1 is in the box once
# the sink is masked or its key edited
TARGET_LAYOUT = [row[:] for row in LAYOUT]
TARGET_LAYOUT[3][0] = "navy"
TARGET_RED = [r * 5 + c for r, row in enumerate(TARGET_LAYOUT) for c, n in enumerate(row) if n == "red"]
TARGET_BOX = [0, 0, CELL, CELL]
TARGET_TOKEN = 0  # the image token (index) whose region centre is in TARGET_BOX
MASK = 10.0  # Table 10's smaller mask: tokens with r >= 10 zeroed

# per planted layer: k_norm stretch of dim KS (W_S), q_norm weight of dim KS (wq), and the gap between the sink
# cosines cos(raw key, e_KS) of position 0 (s0 = sqrt(1 - |mean normalised image key off e_KS|^2)) and the red tokens
PLANT = {
    1: dict(W_S=2.0, wq=0.75, delta=0.06),
    2: dict(W_S=3.0, wq=0.75, delta=0.04),
}
QMIX = [0.0, 0.25, 0.1, 0.4]  # query head h reads CONST into head dims KS (1) and KC (QMIX[h])
A_F, THETA = 3.0, 0.6  # key dim KS = A_F * (F - THETA) for text tokens


def config():
    tid = {"<|endoftext|>": 301, "<|im_start|>": 302, "<|im_end|>": 303}
    text = dict(vocab_size=320, hidden_size=32, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=HD, max_position_embeddings=4096, rms_norm_eps=1e-6,
                initializer_range=0.1, rope_parameters={"rope_type": "default", "mrope_section": [16, 8, 8],
                                                        "mrope_interleaved": True, "rope_theta": 5000000.0},
                bos_token_id=tid["<|endoftext|>"], eos_token_id=tid["<|im_end|>"], tie_word_embeddings=True)
    vision = dict(depth=2, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=16,
                  deepstack_visual_indexes=[1], hidden_act="gelu_pytorch_tanh", initializer_range=0.1)
    cfg = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, image_token_id=311,
                        video_token_id=312, vision_start_token_id=308, vision_end_token_id=309)
    cfg.architectures = ["Qwen3VLForConditionalGeneration"]
    return cfg


PRE = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5] * 3,
       "image_processor_type": "Qwen2VLImageProcessor", "image_std": [0.5] * 3, "merge_size": 2, "patch_size": 16,
       "processor_class": "Qwen3VLProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
       "size": {"longest_edge": 32768, "shortest_edge": 4096}, "temporal_patch_size": 2}


def make_image(path, layout=LAYOUT):
    img = Image.new("RGB", (5 * CELL, 4 * CELL))
    px = img.load()
    for r, row in enumerate(layout):
        for c, name in enumerate(row):
            for y in range(r * CELL, (r + 1) * CELL):
                for x in range(c * CELL, (c + 1) * CELL):
                    if name == "half_red":  # left half red, right half grey: not a planted token
                        px[x, y] = RED_RGB if x < c * CELL + CELL // 2 else PALETTE["grey"]
                    else:
                        px[x, y] = PALETTE[name]
    img.save(str(path), format="PNG", optimize=False, compress_level=9)


def write_json(path, obj):
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def processor(model_dir):
    ip = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tmpl = json.loads((Path(model_dir) / "chat_template.json").read_text())["chat_template"]
    return Qwen3VLProcessor(image_processor=ip, tokenizer=tok, chat_template=tmpl)


def inputs_for(proc, image_path):
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                    tokenize=False)
    return proc(text=[text], images=[load_image(str(image_path))], return_tensors="pt"), text


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------
def set_vision(model, g):
    v = model.model.visual
    with torch.no_grad():
        w = torch.zeros_like(v.patch_embed.proj.weight)  # [32, 3, 2, 16, 16]
        for c in range(3):
            w[c, c] = 1.0 / (2 * 16 * 16)
        v.patch_embed.proj.weight.copy_(w)
        b = torch.zeros(32)
        b[6:] = torch.tensor([2.0 if i % 2 == 0 else -2.0 for i in range(26)])
        v.patch_embed.proj.bias.copy_(b)
        pe = torch.zeros_like(v.pos_embed.weight)  # [16, 32]
        pe[:, 3:6] = torch.randn(16, 3, generator=g) * 0.5
        v.pos_embed.weight.copy_(pe)
        for blk in v.blocks:  # identity blocks
            blk.attn.proj.weight.zero_()
            blk.attn.proj.bias.zero_()
            blk.mlp.linear_fc2.weight.zero_()
            blk.mlp.linear_fc2.bias.zero_()
        m = v.merger
        m.norm.weight.fill_(1.0)
        m.norm.bias.zero_()
        W1 = torch.zeros(128, 128)
        b1 = torch.zeros(128)
        # unit 0: red detector; units 1..3: colour means; units 4..9: random colour units; units 10..12: position
        for k in range(4):
            W1[0, 32 * k + 0] = 1.0
            W1[0, 32 * k + 1] = -1.0
            W1[0, 32 * k + 2] = -1.0
            for c in range(3):
                W1[1 + c, 32 * k + c] = 0.25
            for p in range(3):
                W1[10 + p, 32 * k + 3 + p] = 0.25
        W1[0] *= 3.0
        b1[0] = 0.0  # threshold set below from the LayerNorm'd values of a pure red patch
        b1[1:4] = 3.0
        b1[10:13] = 3.0
        R = torch.randn(6, 3, generator=g) * 2.0
        for u in range(6):
            for k in range(4):
                for c in range(3):
                    W1[4 + u, 32 * k + c] = R[u, c] / 4
        b1[4:10] = torch.randn(6, generator=g) * 0.5
        m.linear_fc1.weight.copy_(W1)
        m.linear_fc1.bias.copy_(b1)
        # deepstack merger (block 1 output, added to the image rows after LM layer 0): small values, POS dims only
        d = v.deepstack_merger_list[0]
        d.norm.weight.fill_(1.0)
        d.norm.bias.zero_()
        d.linear_fc1.weight.copy_(torch.randn(128, 128, generator=g) * 0.1)
        d.linear_fc1.bias.zero_()
        W2d = torch.zeros(32, 128)
        W2d[POS] = torch.randn(3, 128, generator=g) * 0.05
        d.linear_fc2.weight.copy_(W2d)
        d.linear_fc2.bias.zero_()


def set_merger_out(model, g, red_u0):
    m = model.model.visual.merger
    with torch.no_grad():
        # threshold halfway between a pure red token (sum of 4 patches) and 0.7 of it
        m.linear_fc1.bias[0] = -3.0 * 0.85 * red_u0
        W2 = torch.zeros(32, 128)
        b2 = torch.zeros(32)
        b2[CONST] = 1.0
        b2[IMG] = 1.0
        act_red = torch.nn.functional.gelu(torch.tensor(3.0 * 0.15 * red_u0))
        W2[RED, 0] = 1.0 / float(act_red)
        # colour dims: mix of the 3 colour means (unit - 3) and the 6 random units
        M = torch.randn(6, 9, generator=g) * 0.6
        for i, dcol in enumerate(COL):
            W2[dcol, 1:10] = M[i]
            b2[dcol] = -3.0 * float(M[i, :3].sum())
        for p, dpos in enumerate(POS):
            W2[dpos, 10 + p] = 1.0
            b2[dpos] = -3.0
        m.linear_fc2.weight.copy_(W2)
        m.linear_fc2.bias.copy_(b2)


def set_text(model, g):
    lm = model.model.language_model
    with torch.no_grad():
        E = torch.zeros(320, 32)
        E[:, CONST] = 1.0
        E[302, IMS] = 1.0
        E[:, TXT] = torch.randn(320, len(TXT), generator=g) * 0.5
        E[:, SCR] = torch.randn(320, len(SCR), generator=g)
        lm.embed_tokens.weight.copy_(E)
        lm.norm.weight.fill_(1.0)
        for L, layer in enumerate(lm.layers):
            at = layer.self_attn
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
            # MLPs write scratch dims only
            dn = torch.zeros(32, 32)
            dn[SCR] = torch.randn(len(SCR), 32, generator=g) * 0.1
            layer.mlp.down_proj.weight.copy_(dn)
            at.q_norm.weight.fill_(1.0)
            at.k_norm.weight.fill_(1.0)
            if L == 0:
                at.q_proj.weight.zero_()  # uniform attention over the prefix
                Wv = torch.randn(2 * HD, 32, generator=g) * 0.3
                Wv[0] = 0.0
                Wv[0, IMS] = 1.0  # KV head 0, dim 0 = the <|im_start|> flag (scaled by 1/rms(h))
                at.v_proj.weight.copy_(Wv)
                Wo = torch.zeros(32, 4 * HD)
                rms = float(E[302].pow(2).mean().sqrt())
                Wo[F, 0] = rms  # F = 1 at position 0
                Wo[SCR] = torch.randn(len(SCR), 4 * HD, generator=g) * 0.1
                Wo[SCR, 0] = 0.0
                at.o_proj.weight.copy_(Wo)
            else:
                Wq = torch.zeros(4 * HD, 32)
                for h in range(4):
                    Wq[HD * h + KS, CONST] = 1.0
                    Wq[HD * h + KC, CONST] = QMIX[h]
                at.q_proj.weight.copy_(Wq)
                at.v_proj.weight.copy_(torch.randn(2 * HD, 32, generator=g) * 0.3)
                Wo = torch.zeros(32, 4 * HD)
                Wo[SCR] = torch.randn(len(SCR), 4 * HD, generator=g) * 0.03
                if L == 1:
                    Wo[POS[0], 0] = 0.3  # couples layer 1's attention into layer 2's keys (through KPOS)
                at.o_proj.weight.copy_(Wo)


def base_k(L, g_):
    """k_proj block [HD, 32] of one KV head before the <|im_start|> column and RED gain are solved for."""
    g = torch.Generator().manual_seed(SEED + 100 * L + g_)
    K = torch.zeros(HD, 32)
    K[KS, F] = A_F
    K[KS, CONST] = -A_F * THETA
    K[KC, CONST] = 1.0
    K[KI, IMG] = 0.5
    for rows, cols, sd in ((KCOL, COL, 1.0), (KPOS, POS, 0.6), (KTXT, TXT, 0.5)):
        blk = torch.randn(len(rows), len(cols), generator=g) * sd
        for a, r in enumerate(rows):
            for b, c in enumerate(cols):
                K[r, c] = blk[a, b]
    return K


def capture(model, inputs):
    """Forward; returns (residual input of every layer [L][seq, 32], k_norm outputs [L][seq, G, d], output)."""
    lm = model.model.language_model
    hs, ks, hooks = {}, {}, []
    for L, layer in enumerate(lm.layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda mod, args, kw=None, L=L: hs.__setitem__(L, args[0][0].detach().clone())))
        hooks.append(layer.self_attn.k_norm.register_forward_hook(
            lambda mod, a, o, L=L: ks.__setitem__(L, o[0].detach().clone())))
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, use_cache=False)
    for h in hooks:
        h.remove()
    return hs, ks, out


def build():
    cfg = config()
    torch.manual_seed(SEED)
    model = Qwen3VLForConditionalGeneration(cfg).float().eval()
    g = torch.Generator().manual_seed(SEED)
    set_vision(model, g)
    # the red detector's scale from a pure red patch
    MODEL.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.json"):
        shutil.copy(SRC / f, MODEL / f)
    write_json(MODEL / "preprocessor_config.json", PRE)
    proc = processor(MODEL)
    inputs, _ = inputs_for(proc, OUT / "image.png")
    with torch.no_grad():
        v = model.model.visual
        x = v.patch_embed(inputs["pixel_values"])  # processor order = merge-block order; pos embeds are small
        y = v.merger.norm(x).view(-1, 128)
        u0 = (y[:, [32 * k for k in range(4)]] - y[:, [32 * k + 1 for k in range(4)]]
              - y[:, [32 * k + 2 for k in range(4)]]).sum(-1)
        red_u0 = float(u0[RED_TOKENS].mean())
    set_merger_out(model, g, red_u0)
    set_text(model, g)
    lm = model.model.language_model
    ids = inputs["input_ids"][0]
    img_pos = torch.nonzero(ids == cfg.image_token_id).flatten()
    red_pos = img_pos[RED_TOKENS]
    # layer by layer: k_proj from base_k, then solve the <|im_start|> column and the RED gain on a forward pass
    for L in (0, 1, 2):
        at = lm.layers[L].self_attn
        with torch.no_grad():
            if L == 0:
                at.k_proj.weight.copy_(torch.randn(2 * HD, 32, generator=g) * 0.3)
                continue
            Kw = torch.cat([base_k(L, gg) for gg in range(2)], 0)
            at.k_proj.weight.copy_(Kw)
            kn = torch.ones(HD)
            kn[KS] = PLANT[L]["W_S"]
            at.k_norm.weight.copy_(kn)
        hs, _, _ = capture(model, inputs)
        h = hs[L].double()  # residual input of layer L, [seq, 32]
        hn = h / h.pow(2).mean(-1, keepdim=True).sqrt()
        Kw = Kw.double()
        for gg in range(2):
            K = Kw[HD * gg:HD * gg + HD]
            # c_img: the non-red image tokens' dim KS averages 0
            nonred = [int(p) for p in img_pos if p not in red_pos]
            x7 = (hn[nonred] @ K[KS])
            K[KS, IMG] = -float((x7 / hn[nonred, IMG]).mean())
            # RED gain: the red tokens' raw key cosine with e_KS = s0 - delta, s0 = position 0's (set below)
            xr = hn[red_pos] @ K.T
            perp = torch.cat([xr[:, :KS], xr[:, KS + 1:]], 1).norm(dim=1)
            for _ in range(3):  # s0 depends a little on the red keys through the mean image key
                X = hn[img_pos] @ K.T
                tau = (X / X.norm(dim=1, keepdim=True)).mean(0)
                tau[KS] = 0.0
                c = math.sqrt(1 - float(tau.norm()) ** 2) - PLANT[L]["delta"]
                target = c * perp / math.sqrt(1 - c * c)
                K[KS, RED] = float(((target - xr[:, KS]) / hn[red_pos, RED]).mean())
            # position 0: off dim KS its normalised key equals the mean over the image tokens
            X = hn[img_pos] @ K.T
            Xh = X / X.norm(dim=1, keepdim=True)
            tau = Xh.mean(0)
            tau[KS] = 0.0
            s0 = math.sqrt(1 - float(tau.norm()) ** 2)
            x0 = hn[0] @ K.T  # before the IMS column
            want7 = float(x0[KS])
            scale = want7 / s0
            need = scale * tau - x0
            need[KS] = 0.0
            K[:, IMS] = K[:, IMS] + need / float(hn[0, IMS])
            Kw[HD * gg:HD * gg + HD] = K
            print(f"layer {L} kv {gg}: |tau_perp| {float(tau.norm()):.3f}, s0 {s0:.3f}, red cos {c:.3f}")
        with torch.no_grad():
            at.k_proj.weight.copy_(Kw.float())
            qn = torch.ones(HD)  # q_norm is shared by the query heads
            qn[KS] = PLANT[L]["wq"]
            at.q_norm.weight.copy_(qn)
    return model, cfg


# ---------------------------------------------------------------------------------------------
# Check: the spec's definitions on the saved checkpoint
# ---------------------------------------------------------------------------------------------
MASK64 = (1 << 64) - 1


class SplitMix64:
    def __init__(self, s):
        self.s = s & MASK64

    def next(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & MASK64
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def normal(self):
        u1 = (self.next() >> 11) * 2.0 ** -53
        u2 = (self.next() >> 11) * 2.0 ** -53
        return math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos(2.0 * math.pi * u2)


def qattn(att, Q):
    """a_j = mean over question rows and heads of P_h[i, j]; att [H, S, S]."""
    return att[:, Q, :].double().mean(dim=(0, 1))


def centred(K, I, t):
    """centred key cosine of every image token (mean over KV heads), and mu; K [S, G, d] f64."""
    mu = K[I].mean(0)
    out = []
    for j in I:
        cs = []
        for g in range(K.shape[1]):
            a, b = K[j, g] - mu[g], K[t, g] - mu[g]
            na, nb = float(a.norm()), float(b.norm())
            cs.append(0.0 if na == 0 or nb == 0 else float(a @ b) / (na * nb))
        out.append(sum(cs) / len(cs))
    return out, mu


def check(model, inputs, cfg, seed=0):
    ids = inputs["input_ids"][0]
    I = [int(p) for p in torch.nonzero(ids == cfg.image_token_id).flatten()]
    end = int(torch.nonzero(ids == cfg.vision_end_token_id).flatten()[-1])
    Q = list(range(end + 1, len(ids)))
    n = len(I)
    nL = cfg.text_config.num_hidden_layers
    layers = list(range(nL))
    _, ks, out = capture(model, inputs)
    base = {}
    for L in layers:
        a = qattn(out.attentions[L][0], Q)
        non = [j for j in range(len(ids)) if j not in I]
        t = max(non, key=lambda j: (float(a[j]), -j))
        A = float(a[I].sum())
        r = [float(a[j]) / (A / n) if A > 0 else 0.0 for j in I]
        K = ks[L].double()
        cc, _ = centred(K, I, t)
        raw = [sum(float(K[j, g] @ K[t, g]) / float(K[j, g].norm() * K[t, g].norm()) for g in range(K.shape[1]))
               / K.shape[1] for j in I]
        base[L] = dict(a=a, t=t, A=A, r=r, cc=cc, raw=raw, sinks=[I[k] for k in range(n) if r[k] >= RATIO],
                       gated=[I[k] for k in range(n) if cc[k] >= GATE])
    logits0 = out.logits[0, -1].double()

    # random directions of the remove control: stream s=1 of image 0, layers ascending, KV head, d
    G, d = cfg.text_config.num_key_value_heads, cfg.text_config.head_dim
    rng = SplitMix64(seed ^ ((1 * 0xD1B54A32D192ED03 * 2) & MASK64))  # (3*0 + 1 + 1) = 2
    rnd = {}
    for L in layers:
        for g in range(G):
            z = torch.tensor([rng.normal() for _ in range(d)], dtype=torch.float64)
            rnd[(L, g)] = z / z.norm()

    def edited(control, gated_from=None):
        gated = {}
        lm = model.model.language_model
        hooks = []

        def hook(mod, args, o, L):
            K = o[0].double()
            cc, mu = centred(K, I, base[L]["t"])
            sel = gated_from[L] if control else [I[k] for k in range(n) if cc[k] >= GATE]
            gated[L] = sel
            new = K.clone()
            for g in range(G):
                if control:
                    u = rnd[(L, g)]
                else:
                    dv = K[base[L]["t"], g] - mu[g]
                    u = dv / dv.norm()
                for j in sel:
                    new[j, g] = K[j, g] - (K[j, g] @ u) * u
            o2 = o.clone()
            for j in sel:
                o2[0, j] = new[j].to(o.dtype)
            return o2

        for L, layer in enumerate(lm.layers):
            hooks.append(layer.self_attn.k_norm.register_forward_hook(
                lambda mod, a, o, L=L: hook(mod, a, o, L)))
        with torch.no_grad():
            o = model(**inputs, output_attentions=True, use_cache=False)
        for h in hooks:
            h.remove()
        res = {}
        for L in layers:
            a = qattn(o.attentions[L][0], Q)
            A = float(a[I].sum())
            b = base[L]
            aff = gated[L]
            res[L] = dict(affected=aff,
                          share_before=float(b["a"][aff].sum()) / b["A"] if aff else 0.0,
                          share_after=float(a[aff].sum()) / A if aff else 0.0,
                          ts_before=float(b["a"][b["t"]]), ts_after=float(a[b["t"]]),
                          max_ratio_after=max(float(a[j]) / (A / n) for j in I),
                          top1=max(I, key=lambda j: (float(a[j]), -j)))
        p = torch.log_softmax(logits0, -1)
        q = torch.log_softmax(o.logits[0, -1].double(), -1)
        kl = float((p.exp() * (p - q)).sum())
        top1 = int(logits0.argmax()) == int(o.logits[0, -1].argmax())
        return res, gated, kl, top1

    edit, gated, kl_e, top1_e = edited(False)
    ctrl, _, kl_c, top1_c = edited(True, gated)
    return dict(I=I, Q=Q, base=base, edit=edit, ctrl=ctrl, kl=(kl_e, kl_c), top1=(top1_e, top1_c))


def fmt(x):
    return f"{x:.4f}"


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    if MODEL.exists():
        shutil.rmtree(MODEL)
    make_image(OUT / "image.png")
    model, cfg = build()
    model.save_pretrained(str(MODEL))
    from transformers import GenerationConfig
    GenerationConfig(eos_token_id=[303, 301], pad_token_id=301).save_pretrained(str(MODEL))
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "chat_template.json"):
        shutil.copy(SRC / f, MODEL / f)
    write_json(MODEL / "preprocessor_config.json", PRE)

    model = Qwen3VLForConditionalGeneration.from_pretrained(str(MODEL), attn_implementation="eager",
                                                            dtype=torch.float32).eval()
    proc = processor(MODEL)
    inputs, text = inputs_for(proc, OUT / "image.png")
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 10]], inputs["image_grid_thw"]
    res = check(model, inputs, cfg)
    I, Q, base = res["I"], res["Q"], res["base"]
    red = [I[k] for k in RED_TOKENS]
    lines = []
    pr = lambda s="": (print(s), lines.append(s))  # noqa: E731
    pr(f"seq {len(inputs['input_ids'][0])}, image tokens {I[0]}..{I[-1]} (n={len(I)}), question rows "
       f"{Q[0]}..{Q[-1]}, red tokens at positions {red} (image token indices {RED_TOKENS})")
    for L in range(cfg.text_config.num_hidden_layers):
        b = base[L]
        others = [r for k, r in enumerate(b["r"]) if I[k] not in red]
        occ = [c for k, c in enumerate(b["cc"]) if I[k] not in red]
        rcc = [b["cc"][k] for k in RED_TOKENS]
        sink_share = sum(float(b["a"][j]) for j in b["sinks"]) / b["A"] if b["sinks"] else 0.0
        pr(f"layer {L}: t* {b['t']}, text_sink_share {fmt(float(b['a'][b['t']]))}, in_image_share {fmt(b['A'])}, "
           f"sinks {b['sinks']}, sink_share {fmt(sink_share)}, red ratios {[fmt(b['r'][k]) for k in RED_TOKENS]}, "
           f"max other ratio {fmt(max(others))}, gated {b['gated']}, red centred_cos {[fmt(c) for c in rcc]}, "
           f"max other centred_cos {fmt(max(occ))}")
    for name, e in (("remove", res["edit"]), ("control", res["ctrl"])):
        for L in range(cfg.text_config.num_hidden_layers):
            x = e[L]
            pr(f"{name} layer {L}: affected {x['affected']}, affected_share {fmt(x['share_before'])} -> "
               f"{fmt(x['share_after'])}, text_sink_share {fmt(x['ts_before'])} -> {fmt(x['ts_after'])}, "
               f"max_ratio_after {fmt(x['max_ratio_after'])}")
    pr(f"next-token KL remove {res['kl'][0]:.3e} (top1 agree {res['top1'][0]}), control {res['kl'][1]:.3e} "
       f"(top1 agree {res['top1'][1]})")
    # the planted properties
    for L in LAYERS:
        b = base[L]
        assert b["t"] == 0, (L, b["t"])
        assert sorted(b["sinks"]) == red, (L, b["sinks"])
        assert sorted(b["gated"]) == red, (L, b["gated"])
        e, c = res["edit"][L], res["ctrl"][L]
        assert sorted(e["affected"]) == red
        assert e["share_after"] < 0.5 * e["share_before"] and e["ts_after"] > e["ts_before"]
        assert abs(c["share_after"] - c["share_before"]) < 0.25 * abs(e["share_after"] - e["share_before"])
        assert abs(c["ts_after"] - c["ts_before"]) < 0.25 * abs(e["ts_after"] - e["ts_before"])
    target = check_target(model, proc, cfg)
    write_readme(cfg, inputs, text, res, target)


def check_target(model, proc, cfg):
    """target.png: at the planted layers its one red token is the only sink, at >= MASK x uniform, and the most
    attended image token, outside TARGET_BOX; with it masked (r >= MASK) or its key removed, the most attended image
    token is the one in the box. Returns per planted layer the red ratio and the masked map's top two a_j, for the
    README."""
    make_image(OUT / "target.png", TARGET_LAYOUT)
    inputs, _ = inputs_for(proc, OUT / "target.png")
    res = check(model, inputs, cfg)
    I, base = res["I"], res["base"]
    red, target = [I[k] for k in TARGET_RED], I[TARGET_TOKEN]
    rows = {}
    for L in LAYERS:
        b, e = base[L], res["edit"][L]
        assert b["sinks"] == red and b["gated"] == red, (L, b["sinks"], b["gated"])
        assert all(b["r"][k] >= MASK for k in TARGET_RED), (L, b["r"])
        assert max(I, key=lambda j: (float(b["a"][j]), -j)) in red
        kept = sorted((j for k, j in enumerate(I) if b["r"][k] < MASK), key=lambda j: -float(b["a"][j]))
        assert kept[0] == target, (L, kept[:3])
        assert e["top1"] == target, (L, e["top1"])
        rows[L] = dict(red_ratio=b["r"][TARGET_RED[0]], masked=(float(b["a"][kept[0]]), float(b["a"][kept[1]])))
    return dict(I=I, red=red, target=target, rows=rows)


def write_readme(cfg, inputs, text, res, target):
    I, Q, base = res["I"], res["Q"], res["base"]
    red = [I[k] for k in RED_TOKENS]
    names = [n for row in LAYOUT for n in row]
    nL = cfg.text_config.num_hidden_layers
    ratio_lo = min(base[L]["r"][k] for L in LAYERS for k in RED_TOKENS)
    ratio_hi = max(r for L in LAYERS for k, r in enumerate(base[L]["r"]) if k not in RED_TOKENS)
    cc_lo = min(base[L]["cc"][k] for L in LAYERS for k in RED_TOKENS)
    cc_hi = max(c for L in LAYERS for k, c in enumerate(base[L]["cc"]) if k not in RED_TOKENS)
    share = {L: (sum(float(base[L]["a"][j]) for j in base[L]["sinks"]) / base[L]["A"] if base[L]["sinks"] else 0.0)
             for L in range(nL)}
    md = []
    w = md.append
    w("# tests/fixtures/visual_sinks/planted/: a tiny Qwen3-VL with planted visual sinks")
    w("")
    w("Written by `tools/gen_planted_sinks.py` (command line in its docstring; regenerating gives identical bytes; "
      "this README is written by it too). A `Qwen3VLForConditionalGeneration` (transformers 5.23, float32, "
      "`model/`) whose weights are set by hand so that the image tokens of a pure red 32x32 cell of `image.png` "
      "get pre-RoPE keys pointing along the text sink's key (position 0) relative to the mean image key, and take "
      "almost all of the question's in-image attention: the gate must find exactly those tokens, the `remove` edit "
      "must move their attention back to the text sink, and the random-direction control must not. The generator "
      "asserts all of this on the saved checkpoint with its own short computation from "
      "`docs/reference/visual-sinks.md` (eager attention, `output_attentions`, hooks on `k_norm`), which gave the "
      "numbers below.")
    w("")
    w("## Files")
    w("")
    w("- `model/`: `config.json`, `model.safetensors` (f32), `generation_config.json`; tokenizer and chat template "
      "copied from `tests/fixtures/vlm/qwen3_vl` (`tokenizer.json`, `tokenizer_config.json`, `vocab.json`, "
      "`merges.txt`, `chat_template.json`); `preprocessor_config.json` as qwen3_vl's but with "
      "`size.longest_edge` 32768 so the image is not resized.")
    w("- `image.png`: 160x128 RGB, a 5x4 grid of 32x32 cells; grid_thw [1, 8, 10] (patch 16), so one cell = one "
      "merged image token (2x2 patches), 20 image tokens in row-major cell order.")
    w("- `target.png`: the same grid with one red cell (row 3's red cell is navy), for top-1 localization "
      "(Table 10); see \"The target image\" below.")
    w("")
    w("Text: hidden 32, 3 layers, 4 query heads, 2 KV heads, **head_dim 64**, q/k RMSNorm, interleaved M-RoPE "
      "section [16, 8, 8], theta 5e6, tied embeddings, vocabulary 320. Vision: hidden 32, depth 2, patch 16, merge 2, "
      "learned 4x4 position embeddings, `deepstack_visual_indexes` [1] (added after LM layer 0).")
    w("")
    w("## Image")
    w("")
    w("| row \\ col | 0 | 1 | 2 | 3 | 4 |")
    w("|---|---|---|---|---|---|")
    for r, row in enumerate(LAYOUT):
        w(f"| {r} | " + " | ".join(("**red**" if n == "red" else n.replace("_", "-")) + f" ({I[r * 5 + c]})"
                                    for c, n in enumerate(row)) + " |")
    w("")
    w("Sequence positions in parentheses. `half-red` is a cell whose left half is pure red and right half grey; "
      "orange, magenta and pink are the other reddish colours. None of them is planted. RGB values: "
      + ", ".join(f"{k} {v}" for k, v in PALETTE.items()) + ".")
    w("")
    w("## Prompt and thresholds")
    w("")
    w(f"- `--question \"{QUESTION}\"` (chat template, generation prompt): {len(inputs['input_ids'][0])} tokens; "
      f"image tokens I = positions {I[0]}..{I[-1]} (n = {len(I)}); question rows Q = {Q[0]}..{Q[-1]} "
      f"(after `<|vision_end|>` at {Q[0] - 1}). The templated text is")
    w("")
    w("  ```")
    for line in text.split("\n"):
        w("  " + line)
    w("  ```")
    w("")
    w(f"- **Planted tokens**: image token indices {RED_TOKENS} = positions **{red}** (cells row 1 col 3 and row 3 "
      "col 0).")
    w(f"- **Planted layers**: {LAYERS}; layer 0 has uniform attention (no sinks; below the peak-layer floor "
      f"ceil({nL}/4) = 1 anyway). **Peak layer: 2** (sink share {fmt(share[2])} against {fmt(share[1])} at 1).")
    w(f"- `--ratio {RATIO:g} --gate {GATE:g}` (`--seed 0`, the default, for the control). Margins at layers "
      f"{LAYERS}: red ratios >= {fmt(ratio_lo)}, every other image token <= {fmt(ratio_hi)}; red centred cosines "
      f">= {fmt(cc_lo)}, every other image token <= {fmt(cc_hi)}. Any `--ratio` in ({fmt(ratio_hi)}, "
      f"{fmt(ratio_lo)}] and `--gate` in ({fmt(cc_hi)}, {fmt(cc_lo)}] gives the same sinks and gated set there.")
    w("")
    w("    tools/.venv/bin/python tools/visual_sinks_ref.py tests/fixtures/visual_sinks/planted/model \\")
    w("        --image tests/fixtures/visual_sinks/planted/image.png \\")
    w(f"        --question \"{QUESTION}\" --ratio {RATIO:g} --gate {GATE:g} --edit remove --controls -o OUT.json")
    w("")
    w("## Numbers (unedited pass; keys before RoPE)")
    w("")
    w("| layer | t* | text_sink_share a_t* | in_image_share | sinks | sink_share | red ratios | max other ratio | "
      "gated | red centred_cos | max other centred_cos | red raw_cos | max other raw_cos |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for L in range(nL):
        b = base[L]
        oth = [k for k in range(len(I)) if k not in RED_TOKENS]
        w(f"| {L} | {b['t']} | {fmt(float(b['a'][b['t']]))} | {fmt(b['A'])} | {b['sinks']} | {fmt(share[L])} | "
          f"{', '.join(fmt(b['r'][k]) for k in RED_TOKENS)} | {fmt(max(b['r'][k] for k in oth))} | {b['gated']} | "
          f"{', '.join(fmt(b['cc'][k]) for k in RED_TOKENS)} | {fmt(max(b['cc'][k] for k in oth))} | "
          f"{', '.join(fmt(b['raw'][k]) for k in RED_TOKENS)} | {fmt(max(b['raw'][k] for k in oth))} |")
    w("")
    w("Per image token at the peak layer 2:")
    w("")
    w("| position | cell | a_j | ratio | centred_cos | raw_cos |")
    w("|---|---|---|---|---|---|")
    b = base[2]
    for k, j in enumerate(I):
        w(f"| {j} | {names[k].replace('_', '-')} | {float(b['a'][j]):.3e} | {fmt(b['r'][k])} | {fmt(b['cc'][k])} | "
          f"{fmt(b['raw'][k])} |")
    w("")
    w("## The `remove` edit and its control (`--edit remove --controls`, edit at every layer)")
    w("")
    w("| layer | pass | affected | affected_share before -> after | text_sink_share before -> after | "
      "max_ratio after |")
    w("|---|---|---|---|---|---|")
    for L in range(nL):
        for name, e in (("remove", res["edit"]), ("control", res["ctrl"])):
            x = e[L]
            w(f"| {L} | {name} | {x['affected']} | {fmt(x['share_before'])} -> {fmt(x['share_after'])} | "
              f"{fmt(x['ts_before'])} -> {fmt(x['ts_after'])} | {fmt(x['max_ratio_after'])} |")
    w("")
    w(f"Next token (last position): KL(unedited || edited) = {res['kl'][0]:.3e} for remove (top-1 agrees: "
      f"{str(res['top1'][0]).lower()}), {res['kl'][1]:.3e} for the control (top-1 agrees: "
      f"{str(res['top1'][1]).lower()}). Layer 0 gates nothing (its keys are random; max centred cosine "
      f"{fmt(max(base[0]['cc']))}), so neither pass edits there.")
    w("")
    w("Notes. Layer 0's t* is an exact tie: with `q_proj` = 0 every probability of a row is the same f32 value, so "
      "a_j is equal for every j before the first question row and the tie rule (lowest position) gives 0. This "
      "fixture is for the gate, the sinks and the edit, not for ranking the features: because `k_norm` stretches "
      "the sink dim, `raw_cos` and `key_norm` separate the red tokens too (AUC 1 at the peak layer, as "
      "`centered_cos`).")
    w("")
    tr = target["rows"]
    red_ratios = ", ".join(f"layer {L}: {fmt(tr[L]['red_ratio'])}" for L in LAYERS)
    w("## The target image (top-1 localization)")
    w("")
    w(f"`target.png` keeps only the red cell at row 1 col 3 (position {target['red'][0]}); row 3 col 0 is navy. With "
      f"one sink among 20 tokens its ratio is near 20 ({red_ratios}), "
      f"above Table 10's 10x mask (never 100x: n = 20 caps r at 20). The box `{','.join(map(str, TARGET_BOX))}` is "
      f"the top-left cell, position {target['target']}: the first image token has the largest F term of the "
      "unplanted keys, so it is the most attended token once the sink is gone. The generator asserts at layers "
      f"{LAYERS}: the red token is the only sink and gated token, the raw map's top-1 (outside the box); with every "
      f"token at r >= {MASK:g} zeroed, and after the `remove` edit, the top-1 is position {target['target']} (in "
      "the box). Top-1 and runner-up a_j of the masked map: "
      + "; ".join(f"layer {L}: {tr[L]['masked'][0]:.3e}, {tr[L]['masked'][1]:.3e}" for L in LAYERS) + ".")
    w("")
    w("    tools/.venv/bin/python tools/visual_sinks_ref.py tests/fixtures/visual_sinks/planted/model \\")
    w("        --image tests/fixtures/visual_sinks/planted/target.png \\")
    w(f"        --question \"{QUESTION}\" --box {','.join(map(str, TARGET_BOX))} --ratio {RATIO:g} --gate {GATE:g} "
      "--edit remove -o OUT.json")
    w("")
    w("## How the weights plant the sinks")
    w("")
    w("Residual stream (32): CONST (1 on every token), IMS (`<|im_start|>` flag), F, IMG, RED, 6 colour dims, 3 "
      "position dims, 10 random text dims, 8 scratch dims. Head dims 31/63 and 30/62 are the two lowest RoPE "
      "frequencies (rotation < 1e-4 rad over the prompt).")
    w("")
    w("- Vision: `patch_embed` averages each channel of a patch (dims 0..2), a +-2 bias on dims 6..31 keeps the "
      "merger LayerNorm nearly linear, seeded position embeddings write dims 3..5; both blocks are identities "
      "(`attn.proj`, `mlp.linear_fc2` zeroed). Merger fc1 unit 0 is a red detector, GELU(3 * (sum over the 2x2 "
      "patches of LN(r) - LN(g) - LN(b)) - threshold), the threshold at 85% of a pure red token's sum, so it fires "
      "only when all four patches are red; fc2 writes CONST = IMG = 1, RED (1 on a red token), colour (seeded "
      "mixes of colour units), position. The deepstack merger adds small seeded values to the position dims.")
    w("- LM layer 0: `q_proj` = 0, so its attention is uniform; its value is the IMS flag, written to F by "
      "`o_proj`: F = (number of `<|im_start|>` up to i) / (i + 1), 1 at position 0 only.")
    w("- LM layers 1, 2: every query is along head dim 31 (plus 0/0.25/0.1/0.4 of dim 63 for heads 0..3), the "
      "same for every row after q_norm. Raw key dim 31 = 3 (F - 0.6) + c_img IMG + c_red RED: positive at "
      "position 0, c_red sets the red tokens' cosine with dim 31 to position 0's minus 0.06 (layer 1) / 0.04 "
      "(layer 2), c_img makes the other image tokens' average 0, and it is negative for every other text token. "
      "CONST, IMG, colour, position and text dims go to other key dims; the `<|im_start|>` column of `k_proj` is "
      "solved for so that position 0's normalised key equals the mean normalised image key off dim 31. So "
      "k_0 - mu points along dim 31, u = unit(k_t* - mu) ~ e_31, and removing u from a red key removes what makes "
      "it a sink. `k_norm`'s weight is 2 (layer 1) / 3 (layer 2) on dim 31, `q_norm`'s 0.75, 1 elsewhere.")
    w("- `o_proj` and the MLPs write only the scratch dims (so the edit moves the logits a little), except a 0.3 "
      "coupling from layer 1's head-0 output into a position dim that layer 2's keys read, so layer 1's edit "
      "reaches layer 2's keys.")
    (OUT / "README.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
