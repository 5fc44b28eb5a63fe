#!/usr/bin/env python3
"""Independent reference for `sinkmerge visual-sinks` (docs/reference/visual-sinks.md), on transformers' eager
attention in float32, every statistic in float64.

    tools/.venv/bin/python tools/visual_sinks_ref.py MODEL_DIR \
        (--image F --question T | --prompt T --image F [--image F ...] | --manifest FILE.jsonl) \
        [--box X0,Y0,X1,Y1] [--layers all|0,2] [--ratio R] [--gate G] [--keys pre-rope|post-rope] \
        [--edit none|remove|align] [--median-target] [--controls] [--seed S] [--pixel-values F] \
        [--self-check] -o OUT.json

One forward pass (output_attentions, output_hidden_states, use_cache=False) gives the probabilities and the hidden
states; hooks give the keys before RoPE (the k_norm output for Qwen3-VL, the k_proj output for Qwen2-based text),
and a wrapper around the modeling module's `eager_attention_forward` gives the post-RoPE queries and keys and the
values (v_proj output) exactly as the attention sees them. The edits run further forwards with the keys replaced
at the spec'd point: a forward hook on k_norm / k_proj (pre-RoPE) or the same eager wrapper (post-RoPE).

Choices where the spec leaves room are listed in tests/fixtures/visual_sinks/README.md.
"""
import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file
from transformers.image_utils import load_image

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
transformers.logging.set_verbosity_error()
# No torchvision here, so the video-processor base class cannot be looked up; the processors take
# video_processor=None, and only a None argument skips the class check (as tools/gen_vlm_goldens.py does).
_check = transformers.ProcessorMixin.check_argument_for_proper_class
transformers.ProcessorMixin.check_argument_for_proper_class = (
    lambda self, name, arg: None if arg is None else _check(self, name, arg))

MASK64 = (1 << 64) - 1
# values near a threshold or a tie, for tools/gen_visual_sinks_goldens.py (--margins FILE)
MARGINS = {"t_star_gap": [], "image_top1_gap": [], "ratios": [], "centered_cos": [], "edit_centered_cos": [], "box_edge_gap": [],
           "box_top1_gap": []}
# Table 10's masks: the masked maps zero every image token with r >= each of these
MASKS = {"top1_in_box_masked_100": 100.0, "top1_in_box_masked_10": 10.0}
TOP1_KEYS = ["top1_in_box", "top1_in_box_masked_100", "top1_in_box_masked_10", "top1_in_box_edited"]


# ---------------------------------------------------------------------------------------------
# Random numbers (spec: "Random numbers")
# ---------------------------------------------------------------------------------------------
class SplitMix64:
    def __init__(self, state):
        self.state = state & MASK64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def uniform(self):
        return (self.next() >> 11) * 2.0 ** -53

    def normal(self):
        u1 = self.uniform()
        u2 = self.uniform()
        return math.sqrt(-2.0 * math.log(1.0 - u1)) * math.cos(2.0 * math.pi * u2)


def stream(seed, image_index, s):
    """Stream s of image i: s=0 aligned tokens, s=1 remove-control directions, s=2 align-control keys."""
    return SplitMix64((seed ^ (((3 * image_index + s + 1) * 0xD1B54A32D192ED03) & MASK64)) & MASK64)


def pick_tokens(seed, image_index, n):
    """k = min(8, n) token indices (0..n) by a partial Fisher-Yates shuffle, sorted."""
    rng = stream(seed, image_index, 0)
    k = min(8, n)
    idx = list(range(n))
    for t in range(k):
        j = t + math.floor(rng.uniform() * (n - t))
        idx[t], idx[j] = idx[j], idx[t]
    return sorted(idx[:k])


# ---------------------------------------------------------------------------------------------
# Model, processor, prompt
# ---------------------------------------------------------------------------------------------
def load_model(model_dir):
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    mt = cfg["model_type"]
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), attn_implementation="eager",
                                                        dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tmpl_path = Path(model_dir) / "chat_template.json"
    tmpl = json.loads(tmpl_path.read_text())["chat_template"] if tmpl_path.exists() else None
    if mt.startswith("qwen"):
        from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor, Qwen3VLProcessor
        ip = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
        pcls = Qwen3VLProcessor if mt.startswith("qwen3") else Qwen2VLProcessor
        proc = pcls(image_processor=ip, tokenizer=tok, chat_template=tmpl)
        family = "qwen"
    elif mt == "internvl":
        from transformers import GotOcr2ImageProcessorPil, InternVLProcessor
        ip = GotOcr2ImageProcessorPil.from_pretrained(str(model_dir))
        pc = Path(model_dir) / "processor_config.json"
        seq = json.loads(pc.read_text()).get("image_seq_length", 256) if pc.exists() else cfg.get("image_seq_length")
        proc = InternVLProcessor(image_processor=ip, tokenizer=tok, image_seq_length=seq, chat_template=tmpl)
        family = "internvl"
    else:
        raise SystemExit(f"unsupported model_type {mt}")
    return model, proc, family


def build_inputs(proc, family, item):
    """item: dict(images=[paths], question=str|None, prompt=str|None, pixel_values=path|None)."""
    imgs = [load_image(str(p)) for p in item["images"]]
    if item.get("question") is not None:
        if len(imgs) != 1:
            raise SystemExit("--question takes exactly one image")
        content = [{"type": "image"}, {"type": "text", "text": item["question"]}]
        text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=False)
    else:
        prompt = item["prompt"]
        if prompt.count("<image>") != len(imgs):
            raise SystemExit(f"prompt has {prompt.count('<image>')} <image> markers for {len(imgs)} images")
        if family == "qwen":
            text = prompt.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
        else:
            text = prompt.replace("<image>", "<IMG_CONTEXT>")  # InternVLProcessor expands each one itself
    inputs = proc(text=[text], images=imgs, return_tensors="pt")
    if family == "internvl":  # the tiles per image come from the image processor
        ip = proc.image_processor(imgs, return_tensors="pt")
        inputs["num_patches"] = torch.as_tensor(ip["num_patches"], dtype=torch.long)
    if item.get("pixel_values"):
        pv = load_file(str(item["pixel_values"]))
        key = "image_grid_thw" if family == "qwen" else "num_patches"
        if not torch.equal(pv[key].long(), inputs[key].long()):
            raise SystemExit(f"{item['pixel_values']}: {key} {pv[key].tolist()} != processor's {inputs[key].tolist()}")
        if pv["pixel_values"].shape != inputs["pixel_values"].shape:
            raise SystemExit(f"{item['pixel_values']}: pixel_values shape differs from the processor's")
        inputs["pixel_values"] = pv["pixel_values"].float()
    sizes = [im.size for im in imgs]  # (width, height) of the original (EXIF-transposed) image
    return inputs, sizes


# ---------------------------------------------------------------------------------------------
# "The prompt and its parts" and "The box"
# ---------------------------------------------------------------------------------------------
def image_runs(ids, image_token_id):
    runs, start = [], None
    for p, t in enumerate(ids + [-1]):
        if t == image_token_id and start is None:
            start = p
        elif t != image_token_id and start is not None:
            runs.append(list(range(start, p)))
            start = None
    return runs


def token_centres(model, proc, family, inputs, image_index, size):
    """Centre (x, y) of the region each image token covers, in original pixels."""
    W, H = size
    if family == "qwen":
        t, h, w = [int(x) for x in inputs["image_grid_thw"][image_index]]
        m = int(proc.image_processor.merge_size)
        P = int(proc.image_processor.patch_size)
        cols = w // m
        out = []
        for k in range(t * (h // m) * (w // m)):
            kk = k % ((h // m) * cols)
            r, c = kk // cols, kk % cols
            cx = (c + 0.5) * m * P * (W / (w * P))
            cy = (r + 0.5) * m * P * (H / (h * P))
            out.append((cx, cy))
        return out
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas
    ipr = proc.image_processor
    tile = (ipr.size["height"], ipr.size["width"]) if isinstance(ipr.size, dict) else (ipr.size.height, ipr.size.width)
    cols, rows = get_optimal_tiled_canvas((H, W), tile, ipr.min_patches, ipr.max_patches)
    n_tiles = cols * rows + (1 if cols * rows > 1 else 0)
    got = int(inputs["num_patches"][image_index])
    if got != n_tiles:
        raise SystemExit(f"tile grid {cols}x{rows} gives {n_tiles} tiles, pixel values have {got}")
    per_tile = int(proc.image_seq_length)
    g = int(round(math.sqrt(per_tile)))
    assert g * g == per_tile
    out = []
    for k in range(n_tiles * per_tile):
        tk, local = divmod(k, per_tile)
        a, b = divmod(local, g)  # row a, column b of the tile's g x g token grid (row-major)
        if tk < cols * rows:
            cx = ((tk % cols) + (b + 0.5) / g) * (W / cols)
            cy = ((tk // cols) + (a + 0.5) / g) * (H / rows)
        else:  # the thumbnail covers the whole image
            cx = ((b + 0.5) / g) * W
            cy = ((a + 0.5) / g) * H
        out.append((cx, cy))
    return out


# ---------------------------------------------------------------------------------------------
# Capturing and editing inside the forward
# ---------------------------------------------------------------------------------------------
class Instrument:
    """Hooks on the LM's layers. `editor(L, K)` (K: [S, G, d] float32 keys at the edit point) returns the edited
    keys or None; it is called at the point `keys_mode` names."""

    def __init__(self, model, keys_mode):
        self.lm = model.model.language_model
        self.keys_mode = keys_mode
        self.editor = None
        self.cap = {}
        self.handles = []
        self.attn_layer = {}
        mods = set()
        for L, layer in enumerate(self.lm.layers):
            attn = layer.self_attn
            self.attn_layer[id(attn)] = L
            mods.add(sys.modules[type(attn).__module__])
            kmod = attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj
            self.handles.append(kmod.register_forward_hook(self._pre_rope_hook(L, attn.head_dim)))
            self.handles.append(layer.register_forward_pre_hook(self._layer_in_hook(L), with_kwargs=True))
        self.patched = []
        for mod in mods:
            orig = mod.eager_attention_forward
            mod.eager_attention_forward = self._eager_wrapper(orig)
            self.patched.append((mod, orig))

    def close(self):
        for h in self.handles:
            h.remove()
        for mod, orig in self.patched:
            mod.eager_attention_forward = orig

    def _layer_in_hook(self, L):
        def hook(mod, args, kwargs):
            hs = args[0] if args else kwargs["hidden_states"]
            self.cap[("hidden", L)] = hs[0].detach().clone()
        return hook

    def _pre_rope_hook(self, L, hd):
        def hook(mod, args, out):
            shape = out.shape
            K = out[0].reshape(shape[1], -1, hd)  # [S, G, d]
            self.cap[("k_pre", L)] = K.detach().clone()
            if self.editor is not None and self.keys_mode == "pre-rope":
                new = self.editor(L, K.detach().clone())
                if new is not None:
                    self.cap[("k_edited", L)] = new.detach().clone()  # as the attention will see them (pre-RoPE)
                    return new.reshape(shape).to(out.dtype)
            return None
        return hook

    def _eager_wrapper(self, orig):
        def wrapped(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
            L = self.attn_layer.get(id(module))
            if L is not None:
                if self.editor is not None and self.keys_mode == "post-rope":
                    new = self.editor(L, key[0].transpose(0, 1).detach().clone())  # [S, G, d]
                    if new is not None:
                        key = new.transpose(0, 1).unsqueeze(0).to(key.dtype).contiguous()
                self.cap[("q", L)] = query[0].detach().clone()      # [H, S, d] post-RoPE
                self.cap[("k_post", L)] = key[0].detach().clone()   # [G, S, d] post-RoPE (as attended)
                self.cap[("v", L)] = value[0].detach().clone()      # [G, S, d]
                self.cap[("scaling", L)] = scaling
            return orig(module, query, key, value, attention_mask, scaling, dropout, **kw)
        return wrapped

    def forward(self, model, inputs, editor=None):
        self.editor = editor
        self.cap = {}
        kw = {k: v for k, v in inputs.items() if k != "num_patches"}
        with torch.no_grad():
            out = model(**kw, output_attentions=True, output_hidden_states=True, use_cache=False, return_dict=True)
        self.editor = None
        cap = self.cap
        self.cap = {}
        return out, cap


# ---------------------------------------------------------------------------------------------
# Statistics helpers (f64)
# ---------------------------------------------------------------------------------------------
def cos(a, b):
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(np.dot(a, b) / (na * nb))


def mean_head_cos(kj, kt):
    """mean_g cos(kj[g], kt[g]); kj, kt: [G, d]."""
    return float(np.mean([cos(kj[g], kt[g]) for g in range(kj.shape[0])]))


def centred_cosines(K, I, t):
    """K: [S, G, d] f64; per token of I: mean_g cos(k_j - mu_g, k_t* - mu_g), mu_g the mean over I."""
    mu = K[I].mean(axis=0)
    kt = K[t] - mu
    return [mean_head_cos(K[j] - mu, kt) for j in I], mu


def question_attention(P, Q):
    """a_j = mean_{i in Q} mean_h P_h[i, j]; P: [H, S, S] f64."""
    return P[:, Q, :].mean(axis=0).mean(axis=0)


def order_desc(values):
    """Indices by value descending, ties to the lower index."""
    return sorted(range(len(values)), key=lambda j: (-values[j], j))


def score_feature(values, sinks):
    n = len(values)
    pos = [j for j in range(n) if sinks[j]]
    neg = [j for j in range(n) if not sinks[j]]
    auc = None
    if pos and neg:
        s = 0.0
        for p in pos:
            for q in neg:
                s += 1.0 if values[p] > values[q] else (0.5 if values[p] == values[q] else 0.0)
        auc = s / (len(pos) * len(neg))
    if not pos:
        return {"auc": auc, "precision_at_k": None, "top1": None}
    order = order_desc(values)
    k = len(pos)
    return {"auc": auc, "precision_at_k": sum(1 for j in order[:k] if sinks[j]) / k, "top1": bool(sinks[order[0]])}


def box_top1(values, kept, inside):
    """Whether the most attended of the `kept` image tokens (indices; ties to the lowest) is inside the box: None
    without a box or a kept token. The gap to the runner-up goes to the margins."""
    if inside[0] is None or not kept:
        return None
    ranked = sorted(kept, key=lambda k: (-values[k], k))
    if len(ranked) > 1:
        MARGINS["box_top1_gap"].append(float(values[ranked[0]] - values[ranked[1]]))
    return bool(inside[ranked[0]])


def mean_or_none(xs):
    xs = [float(x) for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def precision_recall(cc, sinks, thr):
    gated = [c >= thr for c in cc]
    g = sum(gated)
    both = sum(1 for a, b in zip(gated, sinks) if a and b)
    ns = sum(sinks)
    return (both / g if g else None), (both / ns if ns else None)


def f32_list(t):
    """The f32 logits as the shortest decimals that parse back to the same f32 (smaller goldens)."""
    return [float(str(np.float32(x))) for x in t.float().tolist()]


def sweep_thresholds():
    return [round(-1 + 0.05 * k, 10) for k in range(41)]


# ---------------------------------------------------------------------------------------------
# The analysis of one prompt
# ---------------------------------------------------------------------------------------------
def run_prompt(model, proc, family, item, args, prompt_index, layers):
    inputs, sizes = build_inputs(proc, family, item)
    ids = inputs["input_ids"][0].tolist()
    S = len(ids)
    cfg = model.config
    image_token_id = cfg.image_token_id
    runs = image_runs(ids, image_token_id)
    if len(runs) != len(item["images"]):
        raise SystemExit(f"{len(runs)} image blocks for {len(item['images'])} images")
    end_id = cfg.vision_end_token_id if family == "qwen" else proc.tokenizer.convert_tokens_to_ids("</img>")
    last = runs[-1][-1]
    ends = [p for p in range(last + 1, S) if ids[p] == end_id]
    if not ends:
        raise SystemExit("no end token after the last image block")
    Q = list(range(ends[0] + 1, S))  # question rows: after the last image block's end token
    if not Q:
        raise SystemExit("empty question rows")
    all_image = set(p for r in runs for p in r)
    non_image = [p for p in range(S) if p not in all_image]

    inst = Instrument(model, args.keys)
    try:
        out0, cap0 = inst.forward(model, inputs)
        n_layers = len(inst.lm.layers)
        H = cfg.text_config.num_attention_heads
        G = cfg.text_config.num_key_value_heads
        rep = H // G
        logits0 = out0.logits[0, -1].double()

        # per-image geometry
        boxes = item.get("boxes") or [None] * len(runs)
        inside = []
        for i, I in enumerate(runs):
            box = boxes[i]
            if box is None:
                inside.append([None] * len(I))
                continue
            W, Hh = sizes[i]
            x0, y0, x1, y1 = box
            if not (0 <= x0 < x1 <= W and 0 <= y0 < y1 <= Hh):
                raise SystemExit(f"box {box} outside the image {W}x{Hh}")
            cs = token_centres(model, proc, family, inputs, i, sizes[i])
            assert len(cs) == len(I), (len(cs), len(I))
            inside.append([bool(x0 <= cx <= x1 and y0 <= cy <= y1) for cx, cy in cs])
            MARGINS["box_edge_gap"].extend(min(abs(cx - x0), abs(cx - x1), abs(cy - y0), abs(cy - y1)) for cx, cy in cs)

        # ---- unedited pass, per layer and image ("Per layer L", "Token features", "Contributions")
        base = {}  # (i, L) -> dict of arrays used by the edits and the report
        for L in layers:
            P = out0.attentions[L][0].double().numpy()  # [H, S, S]
            a = question_attention(P, Q)
            Kpre = cap0[("k_pre", L)].double().numpy()  # [S, G, d]
            Kpost = cap0[("k_post", L)].double().numpy().transpose(1, 0, 2)  # [S, G, d]
            Ksel = Kpre if args.keys == "pre-rope" else Kpost
            V = cap0[("v", L)].double().numpy().transpose(1, 0, 2)  # [S, G, d]
            q = cap0[("q", L)].double().numpy()  # [H, S, d]
            d = q.shape[-1]
            hidden = cap0[("hidden", L)].double().numpy()  # [S, D]: the layer's input
            # o_{h,i} for the question rows: [H, |Q|, d]
            Vh = np.repeat(V.transpose(1, 0, 2), rep, axis=0)  # [H, S, d], head h uses KV head h // rep
            PQ = P[:, Q, :]
            o = np.einsum("hqs,hsd->qhd", PQ, Vh).reshape(len(Q), -1)
            Kh = np.repeat(Kpost.transpose(1, 0, 2), rep, axis=0)  # [H, S, d] post-RoPE
            t = min(non_image, key=lambda p: (-a[p], p))  # text sink t*: argmax, ties to the lowest position
            srt = sorted((a[p] for p in non_image), reverse=True)
            MARGINS["t_star_gap"].append(float(srt[0] - srt[1]))
            for i, I in enumerate(runs):
                n = len(I)
                aI = a[I]
                A = float(aI.sum())
                r = aI / (A / n) if A != 0 else np.zeros(n)
                sinks = [bool(r[k] >= args.ratio and inside[i][k] is not True) for k in range(n)]
                cc, _ = centred_cosines(Ksel, I, t)
                rc = [mean_head_cos(Ksel[j], Ksel[t]) for j in I]
                # logit std: scaled scores q_{h,i}.k_{g(h),j}/sqrt(d), RoPE applied, over heads and question rows
                scores = np.einsum("hqd,hjd->hqj", q[:, Q, :], Kh[:, I, :]) / math.sqrt(d)
                lstd = [float(np.std(scores[:, :, k])) for k in range(n)]

                def contrib(sel):
                    if not sel:
                        return np.zeros_like(o)
                    return np.einsum("hqs,hsd->qhd", PQ[:, :, sel], Vh[:, sel, :]).reshape(len(Q), -1)

                sink_pos = [I[k] for k in range(n) if sinks[k]]
                on = np.linalg.norm(o, axis=1)
                safe = lambda x, y: float(x / y) if y != 0 else 0.0  # noqa: E731
                if sink_pos:
                    cS = contrib(sink_pos)
                    sink_c = float(np.mean([safe(np.linalg.norm(cS[qi]), on[qi]) for qi in range(len(Q))]))
                    out_cos = float(np.mean([cos(o[qi], o[qi] - cS[qi]) for qi in range(len(Q))]))
                else:
                    sink_c, out_cos = 0.0, 1.0
                cT = contrib([t])
                text_c = float(np.mean([safe(np.linalg.norm(cT[qi]), on[qi]) for qi in range(len(Q))]))
                top = order_desc(list(aI))[0]
                srt = sorted(aI, reverse=True)
                MARGINS["image_top1_gap"].append(float(srt[0] - srt[1]) if n > 1 else 1.0)
                MARGINS["ratios"].extend(float(x) for x in r)
                MARGINS["centered_cos"].extend(cc)
                layer = {
                    "text_sink_position": int(t),
                    "text_sink_share": float(a[t]),
                    "in_image_share": A,
                    "max_ratio": float(r.max()),
                    "sink_count": int(sum(sinks)),
                    "sink_mean_ratio": float(np.mean([r[k] for k in range(n) if sinks[k]])) if any(sinks) else None,
                    "sink_share": float(sum(aI[k] for k in range(n) if sinks[k]) / A) if any(sinks) and A else 0.0,
                    "top1_in_box": None if boxes[i] is None else bool(inside[i][top]),
                    **{key: box_top1(aI, [k for k in range(n) if r[k] < X], inside[i]) for key, X in MASKS.items()},
                    "top1_in_box_edited": None,  # the edit pass's, below
                    "sink_contribution": sink_c,
                    "text_sink_contribution": text_c,
                    "output_cos_without_sinks": out_cos,
                }
                tokens = []
                for k, j in enumerate(I):
                    tokens.append({
                        "position": int(j), "inside_box": inside[i][k], "attention": float(aI[k]),
                        "ratio": float(r[k]), "centered_cos": cc[k], "raw_cos": rc[k],
                        "key_norm": float(np.linalg.norm(Kpre[j].reshape(-1))),
                        "value_norm": float(np.linalg.norm(V[j].reshape(-1))),
                        "hidden_norm": float(np.linalg.norm(hidden[j])),
                        "logit_std": lstd[k], "sink": sinks[k], "gated": bool(cc[k] >= args.gate),
                    })
                base[(i, L)] = dict(t=t, a=a, A=A, r=r, sinks=sinks, cc=cc, rc=rc, layer=layer, tokens=tokens,
                                    lstd=lstd)

        # ---- edits ("The key edit")
        edit_passes = {}
        if args.edit != "none":
            edit_passes["edit"] = edit_pass(model, inst, inputs, runs, Q, base, layers, args, control=False)
            if args.controls:
                edit_passes["control"] = edit_pass(model, inst, inputs, runs, Q, base, layers, args, control=True,
                                                   gated_from=edit_passes["edit"]["affected"])
    finally:
        inst.close()

    # ---- self-checks (--self-check)
    if args.self_check:
        self_checks(model, inputs, out0, layers, Q, runs, base, edit_passes, args)

    # ---- the report per image
    images = []
    ceil_q = math.ceil(n_layers / 4)
    for i, I in enumerate(runs):
        n = len(I)
        per_layer = {str(L): base[(i, L)]["layer"] for L in layers}
        cands = [L for L in layers if L >= ceil_q and base[(i, L)]["layer"]["sink_count"] > 0]
        peak = None
        for L in cands:  # largest sink share, ties to the lowest L
            if peak is None or base[(i, L)]["layer"]["sink_share"] > base[(i, peak)]["layer"]["sink_share"]:
                peak = L
        best_box = None
        if boxes[i] is not None:
            hits = [L for L in layers if base[(i, L)]["layer"]["top1_in_box"]]
            best_box = hits[0] if hits else None
        tokens = {str(L): [dict(tok) for tok in base[(i, L)]["tokens"]] for L in layers}
        features = gate = None
        if peak is not None:
            b = base[(i, peak)]
            toks = b["tokens"]
            feats = {
                "centered_cos": [t["centered_cos"] for t in toks],
                "raw_cos": [t["raw_cos"] for t in toks],
                "neg_value_norm": [-t["value_norm"] for t in toks],
                "hidden_norm": [t["hidden_norm"] for t in toks],
                "key_norm": [t["key_norm"] for t in toks],
                "neg_key_norm": [-t["key_norm"] for t in toks],
                "neg_logit_std": [-t["logit_std"] for t in toks],
            }
            features = {k: score_feature(v, b["sinks"]) for k, v in feats.items()}
            p, rcl = precision_recall(b["cc"], b["sinks"], args.gate)
            sweep = []
            for thr in sweep_thresholds():
                sp, sr = precision_recall(b["cc"], b["sinks"], thr)
                sweep.append({"threshold": thr, "precision": sp, "recall": sr})
            gate = {"threshold": args.gate, "precision": p, "recall": rcl, "sweep": sweep}
        rec = {"prompt": prompt_index, "image_index": i, "image": item["image_names"][i], "image_tokens": n,
               "question_rows": [Q[0], Q[-1] + 1], "box": boxes[i], "layers": per_layer, "peak_layer": peak,
               "best_box_layer": best_box, "tokens": tokens, "features": features, "gate": gate,
               "edit": None, "control": None}
        for kind in ("edit", "control"):
            if kind not in edit_passes:
                continue
            ep = edit_passes[kind]
            lay = {}
            for L in layers:
                b = base[(i, L)]
                aff = ep["affected"][(i, L)]
                a1 = ep["a"][L]
                aI1 = a1[I]
                A1 = float(aI1.sum())
                r1 = aI1 / (A1 / n) if A1 != 0 else np.zeros(n)
                lay[str(L)] = {
                    "affected": [int(p) for p in aff],
                    "affected_share_before": float(sum(b["a"][p] for p in aff) / b["A"]) if b["A"] else 0.0,
                    "affected_share_after": float(sum(a1[p] for p in aff) / A1) if A1 else 0.0,
                    "max_ratio_before": float(b["r"].max()),
                    "max_ratio_after": float(r1.max()),
                    "text_sink_share_before": float(b["a"][b["t"]]),
                    "text_sink_share_after": float(a1[b["t"]]),
                }
                if kind == "edit":
                    for k, tok in enumerate(rec["tokens"][str(L)]):
                        tok["attention_edited"] = float(aI1[k])
                    rec["layers"][str(L)]["top1_in_box_edited"] = box_top1(aI1, list(range(n)), inside[i])
            l1 = ep["logits"]
            lp0 = torch.log_softmax(logits0, -1)
            lp1 = torch.log_softmax(l1, -1)
            kl = float((lp0.exp() * (lp0 - lp1)).sum())
            t0, t1 = int(torch.argmax(logits0)), int(torch.argmax(l1))
            rec[kind] = {"kind": args.edit, "median_target": bool(args.median_target), "control": kind == "control",
                         "layers": lay,
                         "next_token": {"top1_before": t0, "top1_after": t1, "top1_agree": t0 == t1, "kl": kl,
                                        "logits_before": f32_list(logits0), "logits_after": f32_list(l1)}}
        # Table 10 over the upper half: layer L (0-based) with 2L >= the model's layer count
        upper = [L for L in layers if 2 * L >= n_layers]
        rec["upper_half"] = {key: mean_or_none(rec["layers"][str(L)][key] for L in upper) for key in TOP1_KEYS}
        strong = [tok["inside_box"] for L in upper for tok in rec["tokens"][str(L)] if tok["ratio"] >= 100.0]
        rec["in_box_share_100"] = mean_or_none(strong)
        images.append(rec)
    return images


def edit_pass(model, inst, inputs, runs, Q, base, layers, args, control, gated_from=None):
    """One forward with the keys edited at every probed layer, all images of the prompt at once."""
    rnd = {}  # pre-drawn random numbers: probed layers ascending, then token (align control), KV head, d
    G = model.config.text_config.num_key_value_heads
    hd = inst.lm.layers[0].self_attn.head_dim
    chosen = {i: pick_tokens(args.seed, i, len(I)) for i, I in enumerate(runs)}
    if control:
        for i, I in enumerate(runs):
            if args.edit == "remove":
                rng = stream(args.seed, i, 1)
                for L in layers:
                    for g in range(G):
                        rnd[(i, L, g)] = np.array([rng.normal() for _ in range(hd)])
            else:
                rng = stream(args.seed, i, 2)
                for L in layers:
                    for k in chosen[i]:
                        for g in range(G):
                            rnd[(i, L, k, g)] = np.array([rng.normal() for _ in range(hd)])
    affected = {}
    probed = set(layers)
    checks = []
    applied = {}

    def editor(L, K32):
        if L not in probed:
            return None
        K = K32.double().numpy()  # the pass's own keys at L, [S, G, d]
        new = K.copy()
        rows = set()
        for i, I in enumerate(runs):
            t = base[(i, L)]["t"]  # t* of the unedited pass at L
            if args.edit == "remove":
                cc, mu = centred_cosines(K, I, t)
                if not control:
                    MARGINS["edit_centered_cos"].extend(cc)
                if control:
                    sel = list(gated_from[(i, L)])
                    U = []
                    for g in range(G):
                        z = rnd[(i, L, g)]
                        U.append(z / np.linalg.norm(z))
                else:
                    sel = [I[k] for k in range(len(I)) if cc[k] >= args.gate]
                    U = []
                    for g in range(G):
                        dv = K[t, g] - mu[g]
                        nv = np.linalg.norm(dv)
                        U.append(dv / nv if nv != 0 else np.zeros_like(dv))
                for g in range(G):
                    u = U[g]
                    m = float(np.median([np.dot(K[j, g], u) for j in I])) if args.median_target else 0.0
                    for j in sel:
                        new[j, g] = K[j, g] - (np.dot(K[j, g], u) - m) * u
                        checks.append((np.dot(new[j, g], u), m))
                        applied.setdefault((i, L), []).append((j, g, u, m))
                affected[(i, L)] = sel
            else:  # align
                sel = [I[k] for k in chosen[i]]
                for k, j in zip(chosen[i], sel):
                    for g in range(G):
                        if control:
                            z = rnd[(i, L, k, g)]
                            new[j, g] = z * np.linalg.norm(K[t, g]) / np.linalg.norm(z)
                        else:
                            new[j, g] = K[t, g]
                affected[(i, L)] = sel
            rows.update(sel)
        out = K32.clone()
        for j in sorted(rows):  # only the edited rows change; the others stay the exact f32 keys
            out[j] = torch.from_numpy(new[j]).to(K32.dtype)
        return out

    out, cap = inst.forward(model, inputs, editor=editor)
    a = {L: question_attention(out.attentions[L][0].double().numpy(), Q) for L in layers}
    return {"affected": affected, "a": a, "logits": out.logits[0, -1].double(), "checks": checks, "applied": applied, "cap": cap,
            "out": out}


def self_checks(model, inputs, out0, layers, Q, runs, base, edit_passes, args):
    """Row sums, t*, the removed component, and the unedited logits against a plain forward."""
    for L in layers:
        P = out0.attentions[L][0].double()
        err = float((P.sum(-1) - 1).abs().max())
        assert err < 1e-5, f"layer {L}: row sums off by {err}"
    tstars = sorted(set(base[(i, L)]["t"] for i in range(len(runs)) for L in layers))
    print(f"[check] row sums ok; t* over images/layers: {tstars}", file=sys.stderr)
    with torch.no_grad():
        plain = model(**{k: v for k, v in inputs.items() if k != "num_patches"}).logits
    assert torch.equal(plain, out0.logits), "instrumented unedited logits differ from a plain forward"
    print("[check] unedited logits == plain forward (bit-exact)", file=sys.stderr)
    for kind, ep in edit_passes.items():
        if args.edit == "remove" and ep["checks"]:
            worst = max(abs(p - m) for p, m in ep["checks"])
            assert worst < 1e-9, f"{kind}: removed component left {worst}"
            print(f"[check] {kind}: edited tokens' component along u after the edit = target (max err {worst:.2e},"
                  f" f64 before the f32 cast)", file=sys.stderr)
            # as the model attended them (after the f32 cast): the edited rows' component along u is the target
            for L in layers:
                for i, I in enumerate(runs):
                    for j, g, u, m in ep["applied"].get((i, L), []):
                        K = ep["cap"][("k_edited", L)] if args.keys == "pre-rope" else ep["cap"][("k_post", L)].transpose(0, 1)
                        got = float(np.dot(K[j, g].double().numpy(), u))
                        assert abs(got - m) < 1e-5, (kind, L, j, g, got, m)
            print(f"[check] {kind}: the keys as attended carry the edit (|k.u - target| < 1e-5 after the f32 cast)",
                  file=sys.stderr)
        n_aff = {L: sum(len(ep["affected"][(i, L)]) for i in range(len(runs))) for L in layers}
        print(f"[check] {kind}: affected tokens per layer {n_aff}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def parse_box(s):
    v = [float(x) for x in s.split(",")]
    if len(v) != 4:
        raise SystemExit("--box takes X0,Y0,X1,Y1")
    return [int(x) if x == int(x) else x for x in v]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--image", action="append", default=[])
    ap.add_argument("--question")
    ap.add_argument("--prompt")
    ap.add_argument("--manifest")
    ap.add_argument("--box", help="X0,Y0,X1,Y1 in original pixels (single-image prompts)")
    ap.add_argument("--layers", default="all")
    ap.add_argument("--ratio", type=float, default=100.0)
    ap.add_argument("--gate", type=float, default=0.5)
    ap.add_argument("--keys", choices=["pre-rope", "post-rope"], default="pre-rope")
    ap.add_argument("--edit", choices=["none", "remove", "align"], default="none")
    ap.add_argument("--median-target", action="store_true")
    ap.add_argument("--controls", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pixel-values")
    ap.add_argument("--self-check", action="store_true")
    ap.add_argument("--margins", help="write the values that sit near thresholds or ties here (JSON)")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args(argv)
    if args.controls and args.edit == "none":
        raise SystemExit("--controls needs --edit remove|align")
    if args.median_target and args.edit != "remove":
        raise SystemExit("--median-target goes with --edit remove")

    items = []
    if args.manifest:
        mdir = Path(args.manifest).parent
        for line in Path(args.manifest).read_text().splitlines():
            if not line.strip():
                continue
            o = json.loads(line)
            imgs = o["image"] if isinstance(o["image"], list) else [o["image"]]
            if ("question" in o) == ("prompt" in o):
                raise SystemExit("a manifest line takes one of question / prompt")
            items.append(dict(images=[mdir / p for p in imgs], image_names=list(imgs), question=o.get("question"),
                              prompt=o.get("prompt"), boxes=[o.get("box")] * len(imgs) if o.get("box") else None,
                              pixel_values=(mdir / o["pixel_values"]) if o.get("pixel_values") else None))
    else:
        if (args.question is None) == (args.prompt is None) or not args.image:
            raise SystemExit("give --image with one of --question / --prompt, or --manifest")
        box = parse_box(args.box) if args.box else None
        if box is not None and len(args.image) != 1:
            raise SystemExit("--box takes a single-image prompt")
        items.append(dict(images=[Path(p) for p in args.image], image_names=list(args.image), question=args.question,
                          prompt=args.prompt, boxes=[box] if box else None, pixel_values=args.pixel_values))

    model, proc, family = load_model(args.model_dir)
    n_layers = len(model.model.language_model.layers)
    if args.layers == "all":
        layers = list(range(n_layers))
    else:
        layers = sorted(set(int(x) for x in args.layers.split(",")))
        if any(L < 0 or L >= n_layers for L in layers):
            raise SystemExit(f"--layers out of range 0..{n_layers - 1}")

    images = []
    for pi, item in enumerate(items):
        images.extend(run_prompt(model, proc, family, item, args, pi, layers))
    out = {"ratio": args.ratio, "gate": args.gate, "keys": args.keys, "edit": args.edit,
           "median_target": bool(args.median_target), "seed": args.seed, "layers": layers, "images": images}
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    if args.margins:
        Path(args.margins).write_text(json.dumps(MARGINS) + "\n")


if __name__ == "__main__":
    main()
