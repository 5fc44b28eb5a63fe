#!/usr/bin/env python3
"""Goldens for `sinkmerge generate` (issue 50): transformers 5.25.0's greedy `generate` with its KV cache.

Run from the repository root:

    nice -n 10 tools/.venv-gen/bin/python tools/gen_generate_goldens.py

Writes tests/fixtures/generate/<case>.json, <case>.logits.safetensors and, where no existing golden pixel file
fits, <case>.pixels.safetensors; README.md there is kept. Every model is loaded in float32 with
attn_implementation="eager" (AutoModelForCausalLM for text decoders, AutoModelForImageTextToText for the VLMs,
the classes tools/gen_score_goldens.py and tools/visual_sinks_ref.py use), and run with

    model.generate(**inputs, do_sample=False, max_new_tokens=40, eos_token_id=None,
                   output_logits=True, return_dict_in_generate=True)

eos_token_id=None switches the end-of-sequence stop off, and no logits processor is active: the script asserts
that every generated token is the argmax of that step's raw logits (so greedy decoding of the raw logits
reproduces the sequence), and the seed search also requires that no generated token is one of the model's eos
ids, so a decoder that stops at eos gives the same 40 tokens.

Prompts: text LMs get seeded random token ids (numpy default_rng(seed), special tokens excluded); VLMs a short
question from QUESTIONS[seed] around the image placeholders. Seeds 0, 1, 2, ... are tried until every step's
top-2 margin of the raw logits exceeds 1e-3 (asserted). Self-checks (asserted): the logits of one full forward
of prompt + generated ids (no cache) equal generate's within 1e-5 (except llama_dynamic, where dynamic RoPE
makes cached keys differ from a full forward by design: the difference is recorded); sliding-window models
differ from the same model with the window switched off; the key edit changes later steps' logits. One thread,
deterministic algorithms: rerunning gives identical files.
"""
import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

assert transformers.__version__ == "5.25.0", transformers.__version__

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import visual_sinks_ref as ref  # noqa: E402  (also sets one thread, deterministic algorithms, the processor patch)

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

OUT = ROOT / "tests" / "fixtures" / "generate"
IMG = ROOT / "tests" / "fixtures" / "images"
N = 40
MARGIN = 1e-3
TF_TOL = 1e-5
MAX_SEEDS = 40
QUESTIONS = ["Describe it.", "What is this?", "Where is the red square?", "What is in this picture?",
             "What colour is it?", "Count the shapes.", "Is there text?", "What do you see?", "Name the objects.",
             "Describe the picture.", "What is on the left?", "Compare them.", "Which is larger?",
             "What is at the top?", "Tell me more.", "Is it dark?"]
GATES = [0.5, 0.4, 0.3, 0.2, 0.1, 0.0]


def rel(p):
    return str(Path(p).resolve().relative_to(ROOT))


def write_json(path, obj):
    Path(path).write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def f32(x):
    return float(np.float32(x))


# ---------------------------------------------------------------------------------------------
# generate, margins, self-checks
# ---------------------------------------------------------------------------------------------
def eos_ids(model):
    e = model.generation_config.eos_token_id
    c = getattr(model.config, "get_text_config", lambda: model.config)().eos_token_id
    s = set()
    for x in (e, c):
        if x is None:
            continue
        s.update(x if isinstance(x, (list, tuple)) else [x])
    return sorted(int(v) for v in s)


def greedy(model, inputs):
    kw = {k: v for k, v in inputs.items() if k != "num_patches"}
    with torch.no_grad():
        out = model.generate(**kw, do_sample=False, max_new_tokens=N, eos_token_id=None, output_logits=True,
                             return_dict_in_generate=True)
    P = inputs["input_ids"].shape[1]
    seq = out.sequences[0]
    assert seq.shape[0] == P + N, seq.shape
    assert torch.equal(seq[:P], inputs["input_ids"][0])
    gen = seq[P:]
    logits = torch.stack([x[0] for x in out.logits]).float()  # [N, V] raw logits
    assert logits.shape[0] == N
    assert torch.equal(logits.argmax(-1), gen), "a generated token is not the raw logits' argmax"
    top2 = logits.topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    return gen, logits, margins, out


def teacher_forcing(model, inputs, gen):
    """Logits of one forward (no cache) of prompt + generated ids, at the positions that predicted each step."""
    P = inputs["input_ids"].shape[1]
    ids = torch.cat([inputs["input_ids"][0], gen[:-1]]).unsqueeze(0)
    kw = {k: v for k, v in inputs.items() if k not in ("num_patches", "input_ids", "attention_mask",
                                                      "mm_token_type_ids")}
    if "mm_token_type_ids" in inputs:
        kw["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"],
                                             torch.zeros((1, N - 1), dtype=inputs["mm_token_type_ids"].dtype)], 1)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **kw)
    return out.logits[0, P - 1:].float()


def max_rel_diff(a, b):
    """max over steps of max|a - b| / max|a| (the acceptance's per-step measure)."""
    return float(((a - b).abs().amax(-1) / a.abs().amax(-1)).max())


def save_logits(name, logits):
    save_file({"logits": logits.contiguous()}, str(OUT / f"{name}.logits.safetensors"))


# ---------------------------------------------------------------------------------------------
# Text decoders
# ---------------------------------------------------------------------------------------------
def text_cases():
    cases = []
    for fam in ("tiny-qwen2", "tiny-qwen3"):
        for v in ("ref", "vl"):
            cases.append((f"{fam.replace('-', '_')}_{v}", ROOT / "assets" / "models" / fam / v))
    for d in ("qwen2", "qwen3", "mistral", "olmo3", "llama31-tied"):
        cases.append((f"fixture_{d.replace('-', '_')}", ROOT / "tests" / "fixtures" / "models" / d))
    for d in ("llama31_rope", "llama_dynamic", "llama_linear", "mistral_hd", "olmo2", "olmo3_sw", "olmoe",
              "qwen2_sliding", "qwen2_yarn", "qwen3_bias", "qwen3_moe"):
        cases.append((f"score_{d}", ROOT / "tests" / "fixtures" / "score" / "models" / d))
    return cases


def special_ids(model_dir, vocab):
    """Ids to leave out of random prompts: the tokenizer's added tokens (the model's own, else the shared fixture
    tokenizer when the vocabularies agree) and the config's bos/eos/pad."""
    tj = model_dir / "tokenizer.json"
    if not tj.exists():
        base = ROOT / "tools" / "tokenizer" / "base_tokenizer.json"
        tj = base
    tok = json.loads(tj.read_text())
    s = {int(t["id"]) for t in tok.get("added_tokens", [])}
    cfg = json.loads((model_dir / "config.json").read_text())
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = cfg.get(k)
        if v is not None:
            s.update(v if isinstance(v, list) else [v])
    return sorted(x for x in s if x < vocab)


def window_of(cfg):
    """The sliding window transformers applies, and on which layers (None when none)."""
    lt = getattr(cfg, "layer_types", None)
    w = getattr(cfg, "sliding_window", None)
    if w is None:
        return None, None
    if lt is not None:
        layers = [i for i, t in enumerate(lt) if t == "sliding_attention"]
    else:
        layers = list(range(cfg.num_hidden_layers))
    if not layers:
        return None, None
    return int(w), layers


def load_text(model_dir, no_window=False):
    cfg = AutoConfig.from_pretrained(str(model_dir))
    if no_window:  # every layer full (OLMo-3 builds its sliding mask whatever the layers: keep the size)
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
        else:
            cfg.sliding_window = None
    return AutoModelForCausalLM.from_pretrained(str(model_dir), config=cfg, attn_implementation="eager",
                                                dtype=torch.float32).eval()


def text_case(name, model_dir):
    model = load_text(model_dir)
    cfg = model.config
    vocab = int(model.get_input_embeddings().weight.shape[0])
    vocab = min(vocab, int(cfg.vocab_size))
    spec = set(special_ids(model_dir, vocab))
    allowed = np.array([i for i in range(vocab) if i not in spec])
    window, wlayers = window_of(cfg)
    lo, hi = (8, 24) if window is None else (max(8, window + 2), max(24, window + 12))
    dynamic = "dynamic" in str((getattr(cfg, "rope_parameters", None) or {}).get("rope_type", ""))
    eos = eos_ids(model)
    tried = []
    for seed in range(MAX_SEEDS):
        if dynamic:  # dynamic RoPE keeps state (inv_freq, max_seq_len_cached) across calls: start fresh
            model = load_text(model_dir)
        rng = np.random.default_rng(seed)
        length = int(rng.integers(lo, hi + 1))
        ids = rng.choice(allowed, size=length).astype(np.int64)
        inputs = {"input_ids": torch.from_numpy(ids).unsqueeze(0)}
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        gen, logits, margins, out = greedy(model, inputs)
        mm = float(margins.min())
        has_eos = any(int(t) in eos for t in gen)
        tried.append((seed, mm, has_eos))
        if mm > MARGIN and not has_eos:
            break
    else:
        print(f"SKIP {name}: no seed < {MAX_SEEDS} with margin > {MARGIN} and no eos: {tried}")
        return None
    assert float(margins.min()) > MARGIN
    extra = {}
    # self-check: one full forward of prompt + generated ids gives the same logits
    if dynamic:
        model_tf = load_text(model_dir)
    else:
        model_tf = model
    tf = teacher_forcing(model_tf, inputs, gen)
    d_tf = float((tf - logits).abs().max())
    extra["teacher_forcing_max_abs_diff"] = d_tf
    extra["teacher_forcing_max_rel_diff"] = max_rel_diff(logits, tf)
    if dynamic:
        # generate caches keys rotated with the inv_freq in effect when they were computed (dynamic NTK grows it
        # once the length passes max_position_embeddings); a full forward rotates every key with the final one
        assert d_tf > 1e-4, f"{name}: dynamic RoPE expected to differ from a full forward, diff {d_tf}"
        extra["teacher_forcing_note"] = ("dynamic RoPE: the cache keeps keys rotated with the inv_freq in effect when "
                                         "each was computed; a full forward differs by design")
    else:
        assert d_tf <= TF_TOL or max_rel_diff(logits, tf) <= TF_TOL, f"{name}: teacher forcing differs by {d_tf}"
    if window is not None:
        total = inputs["input_ids"].shape[1] + N
        assert window < inputs["input_ids"].shape[1] < total, (window, total)
        cache = getattr(out, "past_key_values", None) or out.cache
        kinds = [type(layer).__name__ for layer in cache.layers]
        for i, layer in enumerate(cache.layers):
            if i in wlayers:
                assert kinds[i] == "DynamicSlidingWindowLayer" and layer.keys.shape[2] == window - 1, (i, kinds[i])
            else:
                assert layer.keys.shape[2] == total - 1, (i, layer.keys.shape)
        nw = load_text(model_dir, no_window=True)
        tf_nw = teacher_forcing(nw, inputs, gen)
        d_nw = float((tf_nw - logits).abs().max())
        assert d_nw > 1e-3, f"{name}: the window changes nothing ({d_nw})"
        extra["window_check"] = {"sliding_layers": wlayers, "cache_layers": kinds,
                                 "cache_len_sliding": window - 1, "max_abs_diff_without_window": d_nw}
    rec = {
        "model": rel(model_dir), "class": type(model).__name__, "prompt_ids": inputs["input_ids"][0].tolist(),
        "pixel_values": None, "generated_ids": gen.tolist(), "max_new_tokens": N, "min_margin": f32(margins.min()),
        "window": window, "edit": None, "transformers": transformers.__version__, "seed": seed,
        "seeds_rejected": [s for s, _, _ in tried[:-1]], "eos_token_ids": eos, "vocab": int(logits.shape[1]),
        **extra,
    }
    save_logits(name, logits)
    write_json(OUT / f"{name}.json", rec)
    print(f"{name}: prompt {len(rec['prompt_ids'])} window {window} min_margin {rec['min_margin']:.4g} seed {seed}"
          f" tf {d_tf:.2e}" + (f" no-window diff {extra['window_check']['max_abs_diff_without_window']:.3g}"
                               if window else ""))
    return {"name": name, **{k: rec[k] for k in ("model", "min_margin", "seed", "window")},
            "prompt_tokens": len(rec["prompt_ids"]), "images": 0}


# ---------------------------------------------------------------------------------------------
# VLMs
# ---------------------------------------------------------------------------------------------
VLMS = {}


def load_vlm(model_dir):
    if model_dir not in VLMS:
        VLMS[model_dir] = ref.load_model(ROOT / model_dir)
    return VLMS[model_dir]


def question(seed):
    """QUESTIONS[seed], then pairs of them (seed 16 on: QUESTIONS[seed // 16 - 1] + " " + QUESTIONS[seed % 16])."""
    n = len(QUESTIONS)
    return QUESTIONS[seed] if seed < n else QUESTIONS[seed // n - 1] + " " + QUESTIONS[seed % n]


def vlm_item(images, seed, two):
    q = question(seed)
    if two:  # raw prompt, one <image> marker per image, as gen_vlm_goldens' two-image cases
        return dict(images=[IMG / i for i in images], prompt="<image>and<image>" + q, question=None), q
    return dict(images=[IMG / i for i in images], question=q, prompt=None), q  # the chat template (--question)


def pixel_file(model_dir, family, inputs, reuse, name):
    """The pixel values file the case uses: `reuse` when its grid/tiles and shape match the processor's, else a
    new file with the processor's output."""
    key = "image_grid_thw" if family == "qwen" else "num_patches"
    if reuse is not None:
        pv = load_file(str(ROOT / reuse))
        if torch.equal(pv[key].long(), inputs[key].long()) and pv["pixel_values"].shape == inputs["pixel_values"].shape:
            return reuse, bool(torch.equal(pv["pixel_values"].float(), inputs["pixel_values"].float()))
        print(f"  {name}: {reuse} does not match the processor's {key}; writing a new file")
    path = OUT / f"{name}.pixels.safetensors"
    save_file({"pixel_values": inputs["pixel_values"].contiguous(), key: inputs[key].long().contiguous()},
              str(path))
    return rel(path), True


def vlm_inputs(model_dir, item, pix):
    model, proc, family = load_vlm(model_dir)
    it = dict(item)
    it["pixel_values"] = ROOT / pix if pix else None
    inputs, _ = ref.build_inputs(proc, family, it)
    return inputs


def rope_info(model, inputs, family):
    """Qwen: M-RoPE positions of the prompt and the delta generate adds to each later position."""
    if family != "qwen":
        return {}
    m = model.model
    kw = dict(input_ids=inputs["input_ids"], image_grid_thw=inputs["image_grid_thw"],
              attention_mask=inputs["attention_mask"])
    if "mm_token_type_ids" in inputs:
        kw["mm_token_type_ids"] = inputs["mm_token_type_ids"]
    try:
        pos, delta = m.get_rope_index(**kw)
    except TypeError:
        kw.pop("mm_token_type_ids", None)
        pos, delta = m.get_rope_index(**kw)
    P = inputs["input_ids"].shape[1]
    assert int(pos.max()) + 1 - P == int(delta.reshape(-1)[0]), (int(pos.max()), P, delta)
    return {"rope_delta": int(delta.reshape(-1)[0]), "mrope_position_ids": pos[:, 0].tolist()}


def vlm_case(name, model_dir, images, reuse, edit=None):
    model, proc, family = load_vlm(model_dir)
    two = len(images) == 2
    eos = eos_ids(model)
    # generated image/vision placeholders would be read as image slots by a full forward (and by M-RoPE's
    # get_rope_index): leave out prompts whose continuation holds one (or an eos id)
    cfg = model.config
    banned = set(eos) | {int(getattr(cfg, k)) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                         "vision_end_token_id") if getattr(cfg, k, None) is not None}
    if family == "internvl":
        banned |= {int(proc.tokenizer.convert_tokens_to_ids(t)) for t in ("<img>", "</img>", "<IMG_CONTEXT>")}
    tried = []
    pix = None
    n_seeds = len(edit["questions"]) if edit is not None else MAX_SEEDS
    found = False
    for seed in range(n_seeds):
        if edit is not None:
            q = edit["questions"][seed]
            item = dict(images=[IMG / i for i in images], question=q, prompt=None)
        else:
            item, q = vlm_item(images, seed, two)
        if pix is None:  # pixel values do not depend on the text
            pix, equal = pixel_file(model_dir, family, vlm_inputs(model_dir, item, None), reuse, name)
        inputs = vlm_inputs(model_dir, item, pix)
        ed = None
        if edit is not None:
            ed = edit_setup(model, proc, family, inputs, edit)
            if ed is None:
                tried.append((seed, None, None))
                continue
            ed["inst"].editor = ed["gen_editor"]
        try:
            gen, logits, margins, out = greedy(model, inputs)
        finally:
            if ed is not None:
                ed["inst"].editor = None
        mm = float(margins.min())
        has_eos = any(int(t) in banned for t in gen)
        tried.append((seed, mm, has_eos))
        if mm > MARGIN and not has_eos:
            found = True
            break
        if ed is not None:
            ed["inst"].close()
    if not found:
        print(f"SKIP {name}: no prompt with margin > {MARGIN} and no eos: {tried}")
        return None
    assert float(margins.min()) > MARGIN
    extra = {}
    if ed is not None:
        extra.update(edit_checks(model, inputs, gen, logits, ed, name))
        tf = extra.pop("_tf")
        ed["inst"].close()
    else:
        tf = teacher_forcing(model, inputs, gen)
    d_tf = float((tf - logits).abs().max())
    extra["teacher_forcing_max_abs_diff"] = d_tf
    extra["teacher_forcing_max_rel_diff"] = max_rel_diff(logits, tf)
    assert d_tf <= TF_TOL or max_rel_diff(logits, tf) <= TF_TOL, f"{name}: teacher forcing differs by {d_tf}"
    key = "image_grid_thw" if family == "qwen" else "num_patches"
    ids = inputs["input_ids"][0].tolist()
    rec = {
        "model": model_dir, "class": type(model).__name__, "prompt_ids": ids, "pixel_values": pix,
        "pixel_values_equal_processor": equal, key: inputs[key].long().tolist(),
        "images": [rel(IMG / i) for i in images], "question": q,
        "prompt_mode": "raw <image>and<image>QUESTION" if two else "chat template, one user message (image, text), "
                                                                     "generation prompt",
        "generated_ids": gen.tolist(), "max_new_tokens": N, "min_margin": f32(margins.min()), "window": None,
        "edit": ed["record"] if ed is not None else None, "transformers": transformers.__version__, "seed": seed,
        "seeds_rejected": [s for s, _, _ in tried[:-1]], "eos_token_ids": eos, "vocab": int(logits.shape[1]),
        "image_token_id": int(model.config.image_token_id),
        "image_token_count": sum(1 for t in ids if t == model.config.image_token_id),
        **rope_info(model, inputs, family), **extra,
    }
    save_logits(name, logits)
    write_json(OUT / f"{name}.json", rec)
    print(f"{name}: prompt {len(ids)} ({rec['image_token_count']} image tokens) min_margin {rec['min_margin']:.4g} "
          f"seed {seed} tf {d_tf:.2e} pix {pix} (equal to 5.25 processor: {equal})")
    return {"name": name, "model": model_dir, "min_margin": rec["min_margin"], "seed": seed, "window": None,
            "prompt_tokens": len(ids), "images": len(images), "edit": ed is not None}


# ---------------------------------------------------------------------------------------------
# The key edit `remove` (visual_sinks_ref's hooks), on during generate
# ---------------------------------------------------------------------------------------------
class CaptureEditor:
    """Stands in for ref.Instrument inside ref.edit_pass: runs the real forward and keeps the editor closure."""

    def __init__(self, inst):
        self.inst = inst
        self.lm = inst.lm
        self.editor = None

    def forward(self, model, inputs, editor=None):
        self.editor = editor
        return self.inst.forward(model, inputs, editor=editor)


def edit_setup(model, proc, family, inputs, edit):
    """The unedited prefill (t* per image and layer, as visual-sinks computes it), then the edit pass on the prompt
    (ref.edit_pass: the gate from that pass's own keys). Returns None when a gate value sits within 1e-3 of
    --gate, nothing is gated, or t* is a near tie."""
    cfg = model.config
    ids = inputs["input_ids"][0].tolist()
    S = len(ids)
    runs = ref.image_runs(ids, cfg.image_token_id)
    end_id = cfg.vision_end_token_id if family == "qwen" else proc.tokenizer.convert_tokens_to_ids("</img>")
    ends = [p for p in range(runs[-1][-1] + 1, S) if ids[p] == end_id]
    Q = list(range(ends[0] + 1, S))
    image = set(p for r in runs for p in r)
    non_image = [p for p in range(S) if p not in image]
    inst = ref.Instrument(model, edit["keys"])
    out0, _ = inst.forward(model, inputs)
    n_layers = len(inst.lm.layers)
    layers = list(range(n_layers))
    base, tstar, tgap = {}, {}, []
    for L in layers:
        a = ref.question_attention(out0.attentions[L][0].double().numpy(), Q)
        t = min(non_image, key=lambda p: (-a[p], p))
        srt = sorted((a[p] for p in non_image), reverse=True)
        tgap.append(float(srt[0] - srt[1]))
        tstar[str(L)] = int(t)
        for i in range(len(runs)):
            base[(i, L)] = {"t": t}
    if min(tgap) <= 1e-6:
        inst.close()
        return None
    for gate in GATES:
        ref.MARGINS["edit_centered_cos"].clear()
        args = SimpleNamespace(edit="remove", gate=gate, median_target=False, seed=0, keys=edit["keys"])
        cap = CaptureEditor(inst)
        ep = ref.edit_pass(model, cap, inputs, runs, Q, base, layers, args, control=False)
        ccs = list(ref.MARGINS["edit_centered_cos"])
        gated = sum(len(v) for v in ep["affected"].values())
        if gated and min(abs(c - gate) for c in ccs) > 1e-3:
            break
    else:
        inst.close()
        return None
    editor = cap.editor
    affected_prefill = {k: list(v) for k, v in ep["affected"].items()}

    def gen_editor(L, K):
        if K.shape[0] < S:  # a decode step: the new token is text, never an image key; the cache keeps the edit
            return None
        return editor(L, K)

    G = cfg.text_config.num_key_value_heads
    record = {
        "edit": "remove", "gate": gate, "keys": edit["keys"], "layers": "all", "median_target": False,
        "cli": ["--edit", "remove", "--gate", repr(gate), "--keys", edit["keys"], "--layers", "all"],
        "text_sink_positions": tstar,
        "edited_rows": {str(L): sorted(int(p) for i in range(len(runs)) for p in affected_prefill[(i, L)])
                        for L in layers},
        "edited_kv_heads": list(range(G)),
        "image_runs": [[r[0], r[-1] + 1] for r in runs],
        "question_rows": [Q[0], Q[-1] + 1],
        "gate_margin": float(min(abs(c - gate) for c in ccs)),
        "t_star_gap_min": min(tgap),
        "hooks": ("visual_sinks_ref.Instrument: a forward hook on k_norm (Qwen3) / k_proj (Qwen2 text) edits the "
                  "pre-RoPE keys of the prompt's forward (prefill); decode steps' single new keys are left alone, "
                  "and the cached (edited) image keys carry the edit through every later step"),
    }
    return {"inst": inst, "gen_editor": gen_editor, "ep": ep, "affected": affected_prefill, "record": record,
            "runs": runs}


def edit_checks(model, inputs, gen, logits, ed, name):
    inst = ed["inst"]
    ep = ed["ep"]
    # the edited prefill's last logits (the visual-sinks edit pass) are generate's first step
    d0 = float((ep["logits"].float() - logits[0]).abs().max())
    assert d0 <= TF_TOL, f"{name}: edit pass vs generate step 0: {d0}"
    # teacher forcing with the editor on: the prompt rows' keys are edited exactly as in the prefill
    inst.editor = ed["gen_editor"]
    try:
        tf = teacher_forcing(model, inputs, gen)
    finally:
        inst.editor = None
    assert {k: list(v) for k, v in ep["affected"].items()} == ed["affected"], "the gate chose other rows"
    # the unedited generate on the same prompt: the edit persists through decode
    g0, l0, m0, _ = greedy(model, inputs)
    P = inputs["input_ids"].shape[1]
    per_step = (l0 - logits).abs().amax(-1)  # teacher forcing of the unedited model on the edited tokens would
    # mix both effects; the free-running unedited run is what a user compares against
    same_tokens = torch.equal(g0, gen)
    tf_unedited = teacher_forcing(model, inputs, gen)  # unedited model fed the edited run's tokens
    d_later = float((tf_unedited[1:] - logits[1:]).abs().amax(-1).min())
    assert d_later > 1e-4, f"{name}: the edit's effect vanishes in decode ({d_later})"
    print(f"  {name}: edit rows {ed['record']['edited_rows']} gate {ed['record']['gate']}; unedited vs edited "
          f"step0 {float(per_step[0]):.3g}, last {float(per_step[-1]):.3g}; same tokens {same_tokens}; "
          f"min over later steps of |edited - unedited(same tokens)| {d_later:.3g}")
    return {"_tf": tf, "edit_effect": {
        "unedited_generated_ids": g0.tolist(), "unedited_same_tokens": same_tokens,
        "max_abs_diff_step0": float(per_step[0]),
        "min_over_steps_1_to_N_of_max_abs_diff_teacher_forced": d_later,
        "edit_pass_vs_step0_max_abs_diff": d0, "prompt_len": P}}


# ---------------------------------------------------------------------------------------------
def main():
    OUT.mkdir(parents=True, exist_ok=True)
    only = set(sys.argv[1:])  # case-name prefixes, for trying one case; the full run rewrites everything
    if not only:
        for f in OUT.iterdir():
            if f.is_file() and f.name != "README.md":
                f.unlink()
    summary, skipped = [], []

    def keep(name):
        return not only or any(name.startswith(o) for o in only)

    for name, d in text_cases():
        if not keep(name):
            continue
        if not (d / "config.json").exists():
            print(f"SKIP {name}: {rel(d)} absent")
            skipped.append(name)
            continue
        r = text_case(name, d)
        (summary if r else skipped).append(r or name)

    V = "tests/fixtures/vlm"
    VS = "tests/fixtures/visual_sinks"
    vcases = [
        ("qwen2_vl_one", f"{V}/qwen2_vl", ["scene_100x75.png"], f"{V}/qwen2_vl/golden_scene.safetensors"),
        ("qwen2_vl_two", f"{V}/qwen2_vl", ["scene_100x75.png", "alpha_64x48.png"], None),
        ("qwen2_5_vl_one", f"{V}/qwen2_5_vl", ["wide_150x61.jpg"], f"{V}/qwen2_5_vl/golden_wide.safetensors"),
        ("qwen2_5_vl_two", f"{V}/qwen2_5_vl", ["tall_45x131.webp", "alpha_64x48.png"],
         f"{V}/qwen2_5_vl/golden_two_images.safetensors"),
        ("qwen3_vl_one", f"{V}/qwen3_vl", ["scene_100x75.png"], f"{V}/qwen3_vl/golden_scene.safetensors"),
        ("qwen3_vl_two", f"{V}/qwen3_vl", ["tall_45x131.webp", "wide_150x61.jpg"], None),
        ("qwen3_vl_moe_one", f"{V}/qwen3_vl_moe", ["tall_45x131.webp"], f"{V}/qwen3_vl_moe/golden_tall.safetensors"),
        ("qwen3_vl_moe_two", f"{V}/qwen3_vl_moe", ["tall_45x131.webp", "wide_150x61.jpg"], None),
        ("internvl_one", f"{V}/internvl", ["wide_150x61.jpg"], f"{VS}/internvl.wide.safetensors"),
        ("internvl_two", f"{V}/internvl", ["tall_45x131.webp", "wide_150x61.jpg"],
         f"{VS}/internvl.tall+wide.safetensors"),
    ]
    for name, md, images, reuse in vcases:
        if not keep(name):
            continue
        r = vlm_case(name, md, images, reuse)
        (summary if r else skipped).append(r or name)

    # the key edit: the visual-sinks question-box cases' prompts first (same pixel files)
    qs = ["Where is the red square?"] + [q for q in QUESTIONS if q != "Where is the red square?"]
    for name, md, images, reuse in [
        ("qwen3_vl_edit_remove", f"{V}/qwen3_vl", ["scene_100x75.png"], f"{VS}/qwen3_vl.scene.safetensors"),
        ("internvl_edit_remove", f"{V}/internvl", ["wide_150x61.jpg"], f"{VS}/internvl.wide.safetensors"),
    ]:
        if not keep(name):
            continue
        r = vlm_case(name, md, images, reuse, edit={"keys": "pre-rope", "questions": qs})
        (summary if r else skipped).append(r or name)

    if not only:
        write_json(OUT / "cases.json", {"cases": summary, "skipped": skipped})
    total = sum(f.stat().st_size for f in OUT.iterdir() if f.is_file())
    print(f"{len(summary)} cases, skipped {skipped}; {total} bytes in {rel(OUT)}")
    h = hashlib.sha256()
    for f in sorted(OUT.iterdir()):
        if f.is_file() and f.name != "README.md":
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    print(f"tree sha256 {h.hexdigest()}")


if __name__ == "__main__":
    main()
