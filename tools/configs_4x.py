#!/usr/bin/env python3
"""Helper for tools/gen_fixtures.py, run under the transformers 4.57.1 venv (tools/.venv4).

It writes genuine transformers-4.x config.json files. Input is one JSON object on stdin:

    {"outdir": "/abs/dir",
     "items": [{"name": "qwen2", "class": "Qwen2Config", "kwargs": {...},
                "architectures": ["Qwen2ForCausalLM"], "mode": "save" | "full"}]}

mode "save": `config.save_pretrained(tmp)` and copy the resulting config.json to <outdir>/<name>.json
             (exactly what 4.57.1 writes: a diff against PretrainedConfig defaults).
mode "full": `json.dumps(config.to_dict())` (every attribute, as remote-code configs embed sub-configs,
             e.g. InternVL's `llm_config`).

It prints one line per item. With {"check": {"ids": [[...]], "dirs": {name: dir}, "out": "x.pt"}} it instead
loads each directory with 4.57's AutoModelForCausalLM (float32, eager) and saves the logits to `out`, so that the
main script can compare them with transformers 5.x. Not run directly by hand.
"""
import json
import os
import sys
import tempfile

import transformers


def main():
    spec = json.load(sys.stdin)
    if "check" in spec:
        return check(spec["check"])
    outdir = spec["outdir"]
    os.makedirs(outdir, exist_ok=True)
    for item in spec["items"]:
        cls = getattr(transformers, item["class"])
        cfg = cls(**item["kwargs"])
        if item.get("architectures") is not None:
            cfg.architectures = item["architectures"]
        dst = os.path.join(outdir, item["name"] + ".json")
        if item.get("mode", "save") == "save":
            with tempfile.TemporaryDirectory() as tmp:
                cfg.save_pretrained(tmp)
                with open(os.path.join(tmp, "config.json"), "rb") as f:
                    data = f.read()
        else:
            data = (json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n").encode()
        with open(dst, "wb") as f:
            f.write(data)
        print(f"[4.x] {item['name']}: {item['class']} -> {dst}")
    print("transformers", transformers.__version__)


def check(spec):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.set_num_threads(1)
    ids = torch.tensor(spec["ids"])
    res = {}
    for name, d in sorted(spec["dirs"].items()):
        auto = AutoModelForImageTextToText if name in spec.get("vlm", []) else AutoModelForCausalLM
        m = auto.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            res[name] = m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        print(f"[4.x] loaded {name} as {type(m).__name__}")
    torch.save(res, spec["out"])
    print("transformers", transformers.__version__)


if __name__ == "__main__":
    main()
