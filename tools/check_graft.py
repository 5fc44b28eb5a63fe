#!/usr/bin/env python3
"""Check that `sinkmerge graft` writes VLMs that transformers loads and runs as the merged LM says.

Run from the repository root after `cargo build --bin sinkmerge`:

    nice tools/.venv/bin/python tools/check_graft.py [--binary target/debug/sinkmerge]

For each tiny VLM built with transformers' own classes (tests/fixtures/vlm/, tests/fixtures/models/) it runs with the sinkmerge binary the chain of CHAIN: extract the
language model, make two task models from it with `perturb` (noise sized by the drift to 0.9 times the LM, so no
other model is needed), TIES-merge them on the extracted LM, and graft the merged LM back into the VLM. Then,
with transformers 5.23 (eager attention, float32, eval, no_grad, one thread):

  (a) the grafted VLM loads with its VLM class, `from_pretrained(..., output_loading_info=True)`: no missing,
      unexpected or mismatched keys;
  (b) its text-only logits equal the merged LM's `AutoModelForCausalLM` logits within TEXT_TOL (max |Δ|) on
      PROMPTS, and the merge is not the identity (the merged LM's logits differ from the extracted LM's);
  (c) its image features after the projector (`model.model.get_image_features` on IMAGE, with the image
      processor of the VLM dir; every tensor of the output, deepstack included) equal the original VLM's
      bitwise, every non-language-model tensor is the VLM's bytes, and every other file of the VLM is copied
      byte for byte;
  (d) for the families `sinkmerge trace` supports, a golden forward of the grafted VLM on one image case (a
      case of tests/fixtures/vlm/cases.json), made by tools/gen_vlm_goldens.py's own `run_golden` (same format as
      tests/fixtures/vlm/<model>/golden_<case>.safetensors); its input ids, pixel values, positions, image
      embeddings, deepstack and vision intermediates must equal the original VLM's forward bitwise (which must
      equal the committed golden of that case where there is one), and its logits must differ.

Besides, the grafted tensors must equal bitwise those of `python_graft`, an independent graft written here.

Writes, only when every check passes, tests/fixtures/graft/<family>/golden_<case>.safetensors and tests/fixtures/graft/cases.json (the command chain
with placeholders, the sha256 of every tensor of the grafted model.safetensors, the measured figures); see
tests/fixtures/graft/README.md. Rerunning gives identical bytes. Exits non-zero when any check fails, after
reporting every family. `--only a,b` checks some families and writes nothing.
"""
import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_vlm_goldens as gvg  # noqa: E402  (processors, inputs and the golden forward; sets one thread etc.)

import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoImageProcessor,
    AutoModelForCausalLM,
    Idefics3ForConditionalGeneration,
    InternVLForConditionalGeneration,
    LlavaOnevisionForConditionalGeneration,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen2VLProcessor,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLProcessor,
)

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "graft"
TEXT_TOL = 1e-5  # the bound on max |Δ| of (b)
MERGE_MIN = 1e-4  # the merged LM's logits must move at least this much from the extracted LM's
IMAGE = "scene_100x75.png"  # (c)
# (b): token ids, no image tokens (the tiny vocabularies keep their special tokens at 301+; 301 is a bos/pad)
PROMPTS = [[301, 17, 42, 99, 250, 7, 123],
           [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
           [200, 180, 160, 140, 120, 100, 80, 60, 40, 20, 0]]

# The chain a Rust test replays. {VLM} is the VLM dir (repo-relative), {TMP} an empty scratch dir; the grafted VLM
# is {TMP}/grafted. The two task models are `perturb` outputs of the extracted LM: each attention and MLP
# projection (experts included) gets seeded Gaussian noise whose Frobenius size equals that tensor's drift to
# {TMP}/scaled, the LM times 0.9 (`linear` of the LM alone with weight 0.9, not normalized): noise of about 10%
# of each projection, whatever the stored dtype, so the chain needs nothing but the VLM dir.
CHAIN = [
    ["extract", "{VLM}", "-o", "{TMP}/lm"],
    ["linear", "--models", "{TMP}/lm", "--weights", "0.9", "--no-normalize", "-o", "{TMP}/scaled"],
    ["perturb", "{TMP}/lm", "--match", "{TMP}/scaled", "--seed", "1", "-o", "{TMP}/task_a"],
    ["perturb", "{TMP}/lm", "--match", "{TMP}/scaled", "--seed", "2", "-o", "{TMP}/task_b"],
    ["ties", "--base", "{TMP}/lm", "--models", "{TMP}/task_a", "{TMP}/task_b", "--density", "0.5",
     "-o", "{TMP}/merged"],
    ["graft", "--vlm", "{VLM}", "--lm", "{TMP}/merged", "-o", "{TMP}/grafted"],
]

# name, VLM dir, class, kind, processor class (Qwen), trace case (name, images, prompt, chat) or None. The trace
# cases are those of tests/fixtures/vlm/cases.json with the smallest golden of each model.
FAMILIES = [
    ("qwen2_vl", "tests/fixtures/vlm/qwen2_vl", Qwen2VLForConditionalGeneration, "qwen", Qwen2VLProcessor,
     ("scene", ["scene_100x75.png"], "<image>Describe it.", False)),
    ("qwen2_5_vl", "tests/fixtures/vlm/qwen2_5_vl", Qwen2_5_VLForConditionalGeneration, "qwen", Qwen2VLProcessor,
     ("wide", ["wide_150x61.jpg"], "What is in<image>this picture?", False)),
    ("qwen3_vl", "tests/fixtures/vlm/qwen3_vl", Qwen3VLForConditionalGeneration, "qwen", Qwen3VLProcessor,
     ("wide", ["wide_150x61.jpg"], "What is in<image>this picture?", False)),
    ("qwen3_vl_moe", "tests/fixtures/vlm/qwen3_vl_moe", Qwen3VLMoeForConditionalGeneration, "qwen", Qwen3VLProcessor,
     ("tall", ["tall_45x131.webp"], "<image>Describe it.", False)),
    ("internvl", "tests/fixtures/vlm/internvl", InternVLForConditionalGeneration, "internvl", None,
     ("wide_chat", ["wide_150x61.jpg"], "<image>What is this?", True)),
    ("llava_onevision", "tests/fixtures/models/llava_onevision", LlavaOnevisionForConditionalGeneration, "llava",
     None, None),
    ("idefics3", "tests/fixtures/models/idefics3", Idefics3ForConditionalGeneration, "idefics3", None, None),
]
# Stored names of everything that is not the language model (vision towers, projectors, image newline).
NOT_LM = re.compile(r"visual|vision|projector|merger|connector|image_newline|^mlp1\.")
WEIGHT_FILES = re.compile(r"^model(-\d+-of-\d+)?\.safetensors(\.index\.json)?$")


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def dump_json(obj, indent=0):
    """json.dumps(indent=2, sort_keys=True), with lists of scalars on one line (keeps cases.json small)."""
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{inner}{json.dumps(k)}: {dump_json(obj[k], indent + 2)}" for k in sorted(obj)]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, (list, tuple)):
        if all(not isinstance(x, (dict, list, tuple)) for x in obj):
            return json.dumps(list(obj), ensure_ascii=False)
        return "[\n" + ",\n".join(inner + dump_json(x, indent + 2) for x in obj) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


def fill(arg, vlm, tmp):
    return arg.replace("{VLM}", vlm).replace("{TMP}", str(tmp))


def tensor_sha256(path):
    """sha256 of each tensor's stored bytes (as the file holds them), by name."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    return {name: sha256(raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for name, v in sorted(header.items()) if name != "__metadata__"}


def stored_dtypes(path):
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    return {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}


# ---------------------------------------------------------------------------------------------
# An independent graft in Python, for comparison
# ---------------------------------------------------------------------------------------------
def python_graft(vlm, lm, out):
    """What `sinkmerge graft --vlm VLM --lm LM -o OUT` must write, by other means, for the layouts of FAMILIES
    only: every stored language-model tensor of the VLM is taken from LM (renamed to the VLM's prefix; Qwen3-VL-MoE
    experts re-fused in transformers 5.x's [E, 2I, H] / [E, H, I] layout, gate rows then up rows; a head the LM
    ties taken from its embedding; converted to the VLM's dtype); every other tensor and file is the VLM's. The
    check requires sinkmerge's tensors to equal these bitwise. (It was first the stand-in for the binary's graft
    while that did not exist yet.)"""
    vlm, lm, out = Path(vlm), Path(lm), Path(out)
    out.mkdir(parents=True)
    src = load_file(str(vlm / "model.safetensors"))
    new = load_file(str(lm / "model.safetensors"))
    used = set()

    def lm_name(n):
        for pat, rep in ((r"^model\.language_model\.", "model."), (r"^language_model\.model\.", "model."),
                         (r"^language_model\.lm_head\.", "lm_head."), (r"^model\.text_model\.", "model."),
                         (r"^(model\.(layers|embed_tokens|norm)\.|lm_head\.)", r"\1")):
            if re.match(pat, n):
                return re.sub(pat, rep, n)
        return None

    result = {}
    for n, t in src.items():
        s = lm_name(n)
        m = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", s or "")
        if m:
            e = t.shape[0]
            if m.group(2) == "gate_up_proj":
                parts = [torch.cat([new[f"{m.group(1)}.{i}.gate_proj.weight"], new[f"{m.group(1)}.{i}.up_proj.weight"]])
                         for i in range(e)]
                used |= {f"{m.group(1)}.{i}.{p}.weight" for i in range(e) for p in ("gate_proj", "up_proj")}
            else:
                parts = [new[f"{m.group(1)}.{i}.down_proj.weight"] for i in range(e)]
                used |= {f"{m.group(1)}.{i}.down_proj.weight" for i in range(e)}
            g = torch.stack(parts)
        elif s is None:  # vision tower, projector, image newline
            g = t
        elif s in new:
            g = new[s]
            used.add(s)
        elif s == "lm_head.weight":  # a tied LM, an untied VLM: the head is the embedding
            g = new["model.embed_tokens.weight"]
        else:
            raise KeyError(f"{n}: no LM tensor {s}")
        assert g.shape == t.shape, (n, g.shape, t.shape)
        result[n] = g.to(t.dtype).contiguous()
    left = set(new) - used - {"lm_head.weight"}
    assert not left, f"LM tensors not grafted: {sorted(left)}"
    with safe_open(str(vlm / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    save_file(result, str(out / "model.safetensors"), metadata=meta)
    for p in sorted(vlm.iterdir()):
        if p.is_file() and not WEIGHT_FILES.match(p.name):
            shutil.copyfile(p, out / p.name)


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------
def run_chain(binary, vlm, tmp):
    for step in CHAIN:
        args = [fill(a, vlm, tmp) for a in step]
        r = subprocess.run([binary, *args], cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"sinkmerge {' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")


def load_vlm(cls, path):
    model, info = cls.from_pretrained(str(path), output_loading_info=True, attn_implementation="eager",
                                      dtype=torch.float32)
    return model.eval(), info


def text_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


def flatten(x, prefix=""):
    """Every tensor of a model output (dataclass, tuple, list), in order, by path."""
    if torch.is_tensor(x):
        return [(prefix, x)]
    if isinstance(x, dict) or hasattr(x, "to_tuple"):
        items = x.items()
    elif isinstance(x, (list, tuple)):
        items = enumerate(x)
    else:
        return []
    return [kv for k, v in items for kv in flatten(v, f"{prefix}.{k}" if prefix else str(k))]


def image_features(model, kind, vlm_dir, pcls):
    """The image features after the projector on IMAGE, with the image processor of `vlm_dir`."""
    m = model.model
    with torch.no_grad():
        if kind == "qwen":
            proc = gvg.qwen_processor(vlm_dir, pcls)
            inputs, *_ = gvg.make_inputs(proc, "qwen", "<image>Describe it.", [IMAGE], False)
            out = m.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        elif kind == "internvl":
            proc = gvg.internvl_processor(vlm_dir)
            inputs, *_ = gvg.make_inputs(proc, "internvl", "<image>Describe it.", [IMAGE], False)
            out = m.get_image_features(inputs["pixel_values"], vision_feature_layer=-1,
                                       vision_feature_select_strategy="default")
        else:
            ip = AutoImageProcessor.from_pretrained(str(vlm_dir))
            x = ip(gvg.load_images([IMAGE]), return_tensors="pt")
            if kind == "llava":
                out = m.get_image_features(x["pixel_values"], x["image_sizes"],
                                           batch_num_images=x["batch_num_images"])
            else:
                out = m.get_image_features(x["pixel_values"], x["pixel_attention_mask"])
    return flatten(out)


def check_files(vlm_dir, grafted):
    """Every VLM file but the weights is copied byte for byte; returns the files graft added."""
    bad = []
    for p in sorted(vlm_dir.iterdir()):
        if p.is_file() and not WEIGHT_FILES.match(p.name) and not p.name.startswith("golden_"):
            q = grafted / p.name
            if not q.is_file() or q.read_bytes() != p.read_bytes():
                bad.append(p.name)
    assert not bad, f"files not copied byte for byte: {bad}"
    return sorted(p.name for p in grafted.iterdir() if not (vlm_dir / p.name).exists())


def check_family(binary, fam, tmp, golden_dir):
    name, vlm, cls, kind, pcls, case = fam
    vlm_dir = ROOT / vlm
    run_chain(binary, vlm, tmp)
    grafted, merged, lm = tmp / "grafted", tmp / "merged", tmp / "lm"
    failures = []
    rec = {"vlm": vlm, "class": cls.__name__}

    # stored tensors: same names, dtypes and shapes; only language-model tensors changed
    before, after = stored_dtypes(vlm_dir / "model.safetensors"), stored_dtypes(grafted / "model.safetensors")
    if before != after:
        failures.append("grafted tensors differ from the VLM's in names, dtypes or shapes")
    h_vlm = tensor_sha256(vlm_dir / "model.safetensors")
    h_out = tensor_sha256(grafted / "model.safetensors")
    changed = sorted(k for k in h_out if h_vlm.get(k) != h_out[k])
    vision_changed = [k for k in changed if NOT_LM.search(k)]
    if vision_changed:
        failures.append(f"non-language-model tensors changed: {vision_changed}")
    if not changed:
        failures.append("no tensor changed: the graft (or the merge) is the identity")
    rec["tensors_changed"] = len(changed)
    rec["tensors_total"] = len(h_out)
    rec["grafted_tensors_sha256"] = h_out
    # the whole file: header included (tensor order, offsets, __metadata__); the scratch path is not in it
    rec["grafted_file_sha256"] = sha256((grafted / "model.safetensors").read_bytes())
    with safe_open(str(grafted / "model.safetensors"), "np") as f:
        rec["grafted_metadata"] = f.metadata()
    try:
        rec["files_added_by_graft"] = check_files(vlm_dir, grafted)
    except AssertionError as e:
        failures.append(str(e))
    python_graft(vlm_dir, merged, tmp / "python_graft")
    h_py = tensor_sha256(tmp / "python_graft" / "model.safetensors")
    rec["equals_python_graft"] = h_py == h_out
    if h_py != h_out:
        failures.append(f"tensors differ from python_graft's: {sorted(k for k in h_out if h_py.get(k) != h_out[k])}")

    # (a)
    model, info = load_vlm(cls, grafted)
    keys = {k: sorted(str(x) for x in info.get(k) or []) for k in ("missing_keys", "unexpected_keys",
                                                                    "mismatched_keys")}
    rec["loading"] = keys
    if any(keys.values()) or info.get("error_msgs"):
        failures.append(f"(a) loading info: {info}")

    # (b)
    lm_model = AutoModelForCausalLM.from_pretrained(str(merged), attn_implementation="eager",
                                                    dtype=torch.float32).eval()
    base_model = AutoModelForCausalLM.from_pretrained(str(lm), attn_implementation="eager",
                                                      dtype=torch.float32).eval()
    d_text, d_merge = 0.0, 0.0
    for ids in PROMPTS:
        a, b, c = text_logits(model, ids), text_logits(lm_model, ids), text_logits(base_model, ids)
        d_text = max(d_text, (a - b).abs().max().item())
        d_merge = max(d_merge, (b - c).abs().max().item())
    rec["lm_class"] = type(lm_model).__name__
    rec["prompts"] = PROMPTS
    rec["text_logits_max_abs"] = d_text
    rec["merge_effect_logits_max_abs"] = d_merge
    if not d_text <= TEXT_TOL:
        failures.append(f"(b) text logits max |Δ| {d_text:.3g} > {TEXT_TOL}")
    if not d_merge >= MERGE_MIN:
        failures.append(f"(b) the merge moves the logits by {d_merge:.3g} only (< {MERGE_MIN})")
    del lm_model, base_model

    # (c)
    orig, _ = load_vlm(cls, vlm_dir)
    fa, fb = image_features(model, kind, grafted, pcls), image_features(orig, kind, vlm_dir, pcls)
    same = [ka == kb and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
            for (ka, a), (kb, b) in zip(fa, fb)]
    rec["image"] = f"tests/fixtures/images/{IMAGE}"
    rec["vision_outputs"] = [f"{k} {list(t.shape)}" for k, t in fa]
    rec["vision_bitwise_equal"] = bool(fa) and len(fa) == len(fb) and all(same)
    if not rec["vision_bitwise_equal"]:
        differ = [k for (k, _), ok in zip(fa, same) if not ok]
        failures.append(f"(c) image features differ from the original VLM's: {differ} ({len(fa)} vs {len(fb)})")

    # (d)
    rec["golden"], rec["trace_case"] = None, None
    if case:
        short, images, prompt, chat = case
        family = "qwen" if kind == "qwen" else "internvl"

        def golden(m, d):
            proc = gvg.qwen_processor(d, pcls) if kind == "qwen" else gvg.internvl_processor(d)
            inputs, text, expanded, templated = gvg.make_inputs(proc, family, prompt, images, chat)
            return gvg.run_golden(m, family, inputs, qwen3=name.startswith("qwen3")), inputs, text, expanded, templated

        g, inputs, text, expanded, templated = golden(model, grafted)
        ref = golden(orig, vlm_dir)[0]
        committed = vlm_dir / f"golden_{short}.safetensors"
        if committed.exists():  # the original VLM's forward here is its committed golden
            c = load_file(str(committed))
            if set(c) != set(ref) or not all(torch.equal(c[k], ref[k]) for k in c):
                failures.append(f"(d) the original VLM's forward differs from {committed.relative_to(ROOT)}")
        same_in = ["input_ids", "pixel_values", "position_ids", "image_embeds", "image_grid_thw", "num_patches"]
        same_in += [k for k in ref if k.startswith(("deepstack.", "vision."))]
        differ = [k for k in same_in if k in ref and not (k in g and torch.equal(g[k], ref[k]))]
        if differ or set(g) != set(ref):
            failures.append(f"(d) golden inputs/vision differ from the original VLM's: {differ}, "
                            f"names {sorted(set(g) ^ set(ref))}")
        d_golden = (g["logits"] - ref["logits"]).abs().max().item()
        rec["golden_logits_vs_vlm_max_abs"] = d_golden
        if d_golden == 0.0:
            failures.append("(d) the grafted VLM's image-prompt logits equal the original VLM's")
        rel = f"tests/fixtures/graft/{name}/golden_{short}.safetensors"
        (golden_dir / name).mkdir(parents=True, exist_ok=True)
        save_file(g, str(golden_dir / name / f"golden_{short}.safetensors"))
        rec["golden"] = rel
        rec["trace_case"] = dict(name=f"graft/{name}/{short}", model="{TMP}/grafted", golden=rel,
                                 images=[f"{gvg.IMG}/{i}" for i in images], prompt=prompt, chat_template=chat,
                                 templated=templated, processor_text=text, expanded_text=expanded,
                                 seq_len=int(inputs["input_ids"].shape[1]), tensors=gvg.shapes(g))
    return rec, failures


# Another text class: Qwen3 with per-head QK-norm (inject-qknorm) grafted into the Qwen2 InternVL, whose class
# builds its language model from text_config (AutoModel.from_config); `--into-vlm` is the same bytes (tests/graft.rs).
SWAP_VLM = "tests/fixtures/vlm/internvl"
SWAP_CHAIN = [
    ["extract", "{VLM}", "-o", "{TMP}/lm"],
    ["inject-qknorm", "{TMP}/lm", "-o", "{TMP}/merged"],
    ["graft", "--vlm", "{VLM}", "--lm", "{TMP}/merged", "-o", "{TMP}/grafted"],
]


def check_text_class_swap(binary, tmp):
    """The Qwen3 LM loads inside InternVL: no missing/unexpected keys, text logits equal the Qwen3 LM's, image
    features bitwise the original VLM's."""
    for step in SWAP_CHAIN:
        args = [fill(a, SWAP_VLM, tmp) for a in step]
        r = subprocess.run([binary, *args], cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"sinkmerge {' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")
    grafted, failures = tmp / "grafted", []
    model, info = load_vlm(InternVLForConditionalGeneration, grafted)
    keys = {k: sorted(str(x) for x in info.get(k) or []) for k in ("missing_keys", "unexpected_keys",
                                                                    "mismatched_keys")}
    if any(keys.values()) or info.get("error_msgs"):
        failures.append(f"loading info: {info}")
    lm = AutoModelForCausalLM.from_pretrained(str(tmp / "merged"), attn_implementation="eager",
                                              dtype=torch.float32).eval()
    d_text = max((text_logits(model, ids) - text_logits(lm, ids)).abs().max().item() for ids in PROMPTS)
    if not d_text <= TEXT_TOL:
        failures.append(f"text logits max |Δ| {d_text:.3g} > {TEXT_TOL}")
    orig, _ = load_vlm(InternVLForConditionalGeneration, ROOT / SWAP_VLM)
    fa = image_features(model, "internvl", grafted, None)
    fb = image_features(orig, "internvl", ROOT / SWAP_VLM, None)
    same = len(fa) == len(fb) and all(ka == kb and torch.equal(a, b) for (ka, a), (kb, b) in zip(fa, fb))
    if not same:
        failures.append("image features differ from the original VLM's")
    rec = {"vlm": SWAP_VLM, "class": InternVLForConditionalGeneration.__name__,
           "text_class": model.config.text_config.model_type, "lm_class": type(lm).__name__, "chain": SWAP_CHAIN,
           "loading": keys, "text_logits_max_abs": d_text, "vision_bitwise_equal": same,
           "grafted_tensors_sha256": tensor_sha256(grafted / "model.safetensors")}
    return rec, failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default="target/debug/sinkmerge")
    ap.add_argument("--only", help="comma-separated families")
    args = ap.parse_args()
    binary = str(ROOT / args.binary)
    if subprocess.run([binary, "graft", "--help"], capture_output=True).returncode != 0:
        sys.exit(f"{binary} has no `graft` command")
    only = set(args.only.split(",")) if args.only else None
    failures, families = 0, {}
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        golden_dir = scratch / "out"
        for fam in FAMILIES:
            if only and fam[0] not in only:
                continue
            tmp = scratch / fam[0]
            tmp.mkdir()
            try:
                rec, fails = check_family(binary, fam, tmp, golden_dir)
            except Exception as e:  # report every family, then fail
                rec, fails = None, [f"{type(e).__name__}: {e}"]
            if fails:
                failures += 1
                print(f"FAIL {fam[0]}: " + "; ".join(fails))
            else:
                print(f"ok   {fam[0]}: (a) no missing/unexpected/mismatched keys; (b) max |Δ| logits "
                      f"{rec['text_logits_max_abs']:.3g} (merge moved them {rec['merge_effect_logits_max_abs']:.3g});"
                      f" (c) {len(rec['vision_outputs'])} vision outputs bitwise equal; "
                      f"{rec['tensors_changed']}/{rec['tensors_total']} tensors grafted, = python_graft"
                      + (f"; (d) {rec['golden']}" if rec["golden"] else ""))
            if rec is not None:
                rec["chain"] = CHAIN
                families[fam[0]] = rec
        swap = None
        if not only:
            (scratch / "swap").mkdir()
            swap, fails = check_text_class_swap(binary, scratch / "swap")
            if fails:
                failures += 1
                print("FAIL text class swap: " + "; ".join(fails))
            else:
                print(f"ok   text class swap ({swap['lm_class']} in {swap['class']}): no missing/unexpected keys; "
                      f"max |Δ| logits {swap['text_logits_max_abs']:.3g}; vision outputs bitwise equal")
        doc = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0],
               "text_tolerance": TEXT_TOL, "families": families, "text_class_swap": swap}
        dest = None if failures or only else OUT
        if dest is not None:
            for fam in FAMILIES:
                if (dest / fam[0]).exists():
                    shutil.rmtree(dest / fam[0])
            if golden_dir.exists():
                for d in sorted(golden_dir.iterdir()):
                    shutil.copytree(d, dest / d.name)
            (dest / "cases.json").write_text(dump_json(doc) + "\n")
            print(f"wrote {dest.relative_to(ROOT)}")
        else:
            print("nothing written" + (" (--only)" if only and not failures else ""))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
