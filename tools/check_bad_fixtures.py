#!/usr/bin/env python3
"""Cross-check tests/fixtures/bad/ against the reference implementations (run in tools/.venv):

    nice -n 5 tools/.venv/bin/python tools/check_bad_fixtures.py

For every case it reports what the `safetensors` library (the Rust crate underneath) says about each
*.safetensors file, and whether transformers' `AutoModelForCausalLM.from_pretrained` loads the directory.
It asserts that `_valid_control` loads and that every case is rejected by at least one of the two (or is a
defect that only a stricter checker can see, listed in EXPECT_ACCEPTED with the reason).
"""
import json
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
BAD = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "bad"

# Cases that the reference stack accepts silently; sinkmerge must be stricter here.
# (duplicate_tensor_name is rejected by the safetensors crate only indirectly: its map keeps the last
# duplicate key, and the first copy's bytes then become a gap -> "invalid offset".)
EXPECT_ACCEPTED = {
    "duplicate_tensor_across_shards": "transformers reads only the shard the index names",
    "shard_tensor_not_in_index": "transformers ignores tensors the index does not list",
}


def st_verdict(path):
    try:
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                f.get_tensor(k)
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"ERR {type(e).__name__}: {str(e)[:110]}"


def tf_verdict(d):
    try:
        m, info = AutoModelForCausalLM.from_pretrained(str(d), output_loading_info=True)
        probs = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        return "ok" if not probs else f"loaded with {probs}"
    except Exception as e:  # noqa: BLE001
        return f"ERR {type(e).__name__}: {str(e).splitlines()[0][:110] if str(e) else ''}"


def main():
    assert tf_verdict(BAD / "_valid_control") == "ok"
    cases = json.loads((BAD / "cases.json").read_text())
    silent = []
    for c in cases:
        d = BAD / c["case"]
        sts = {p.name: st_verdict(p) for p in sorted(d.glob("*.safetensors"))}
        tf = tf_verdict(d)
        rejected = tf != "ok" or any(v != "ok" for v in sts.values())
        print(f"{c['case']:32s} transformers: {tf}")
        for fn, v in sts.items():
            if v != "ok":
                print(f"{'':32s} safetensors[{fn}]: {v}")
        if not rejected:
            silent.append(c["case"])
    print("\naccepted silently by safetensors+transformers:", silent)
    unexpected = [s for s in silent if s not in EXPECT_ACCEPTED]
    if unexpected:
        print("UNEXPECTED:", unexpected)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
