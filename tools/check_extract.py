#!/usr/bin/env python3
"""Check `sinkmerge extract` against the real ecosystem
(docs/commands/extract.md#checking-an-extraction-against-the-vlm).

Run by hand after building (see docs/commands/extract.md, "Checking an extraction against the VLM"):

    cargo build --release
    nice -n 10 tools/.venv/bin/python tools/check_extract.py [--bin target/release/sinkmerge] [--out DIR]

For every case in tests/fixtures/goldens/extract.json it runs `sinkmerge extract <fixture> -o <tmp>/<case>`,
then loads the output with `AutoModelForCausalLM.from_pretrained` (fp32, eager) under transformers 5.23 and,
when tools/.venv4 exists, under transformers 4.57.1 (through tools/configs_4x.py), computes the logits on the
goldens' token ids and compares them with the VLM language model's logits in
tests/fixtures/goldens/extract_logits.safetensors (tolerance max|diff| <= 1e-5). It also loads the copied
tokenizer with AutoTokenizer (no remote code) and renders the chat template when there is one.
Prints one row per case: max|diff|, mean|diff|, top-1 agreement, for each transformers version; exit 1 on failure.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

torch.set_num_threads(1)

import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
ROOT = Path(__file__).resolve().parent.parent
GOLD = ROOT / "tests" / "fixtures" / "goldens"
VENV4_PY = ROOT / "tools" / ".venv4" / "bin" / "python"
TOL = 1e-5


def compare(got, want):
    d = (got.float() - want.float()).abs()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    return d.max().item(), d.mean().item(), top1


def logits_5x(d, ids):
    m = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager")
    m.eval()
    t = torch.tensor([ids])
    with torch.no_grad():
        return type(m).__name__, m(input_ids=t, attention_mask=torch.ones_like(t)).logits[0]


def logits_4x(dirs, ids, tmp):
    """transformers 4.57.1 logits for every output, via the helper of gen_fixtures.py."""
    if not VENV4_PY.exists():
        return None
    out = Path(tmp) / "logits4.pt"
    spec = {"check": {"ids": [ids], "dirs": {k: str(v) for k, v in dirs.items()}, "out": str(out)}}
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error")
    r = subprocess.run([str(VENV4_PY), str(ROOT / "tools" / "configs_4x.py")], input=json.dumps(spec), text=True,
                       capture_output=True, env=env)
    if r.returncode != 0:
        print("transformers 4.57 check failed:\n" + r.stdout + r.stderr)
        return {}
    return {k: v[0] for k, v in torch.load(str(out)).items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "sinkmerge"))
    ap.add_argument("--out", help="keep the extracted models here (default: a temporary directory)")
    args = ap.parse_args()
    gold = json.loads((GOLD / "extract.json").read_text())
    want = load_file(str(GOLD / "extract_logits.safetensors"))
    ids = gold["_meta"]["token_ids"]
    tmp = args.out or tempfile.mkdtemp(prefix="sinkmerge_check_")
    dirs, failures = {}, []
    for case, g in gold.items():
        if case.startswith("_"):
            continue
        out = Path(tmp) / case
        r = subprocess.run([args.bin, "extract", str(ROOT / g["dir"]), "-o", str(out), "--force", "--json", "-q"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            failures.append(f"{case}: sinkmerge extract exit {r.returncode}: {r.stderr.strip()}")
            continue
        dirs[case] = out
    l4 = logits_4x(dirs, ids, tmp)
    print(f"transformers {transformers.__version__} (and 4.57.1 when tools/.venv4 exists); tolerance {TOL}")
    print(f"{'case':24s} {'family':16s} {'class':20s} {'5.x max|d|':>10s} {'mean|d|':>9s} {'top1':>5s} "
          f"{'4.57 max|d|':>11s} {'top1':>5s}  tokenizer / template")
    for case, out in dirs.items():
        g = gold[case]
        cls, got = logits_5x(out, ids)
        mx, mean, top1 = compare(got, want[case])
        ok = mx <= TOL and cls == g["architecture"]
        row4 = ("", "")
        if l4 is not None:
            if case in l4:
                mx4, _, t4 = compare(l4[case], want[case])
                row4 = (f"{mx4:.3g}", f"{t4:.2f}")
                ok &= mx4 <= TOL
            else:
                row4 = ("n/a", "")
                ok = False
        tok = AutoTokenizer.from_pretrained(str(out))
        note = f"{type(tok).__name__} ({len(tok)})"
        if tok.chat_template:
            try:
                text = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False,
                                               add_generation_prompt=True)
                ok_text = "Hello there" in text
                note += ", template renders string content" if ok_text else ", template drops string content"
            except Exception as e:  # list-content processor templates (docs/commands/extract.md#what-is-written)
                note += f", template needs list content ({type(e).__name__})"
        print(f"{case:24s} {g['family']:16s} {cls:20s} {mx:10.3g} {mean:9.3g} {top1:5.2f} {row4[0]:>11s} "
              f"{row4[1]:>5s}  {note}")
        if not ok:
            failures.append(f"{case}: logits differ (5.x {mx:.3g}, 4.57 {row4[0]}) or class {cls}")
    for f in failures:
        print("FAIL", f)
    print(f"{len(dirs) - len([f for f in failures if 'logits' in f])}/{len(gold) - 1} cases reproduce the VLM logits")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
