#!/usr/bin/env python3
"""Time the full-SVD torch reference of TSV or STAR (tools/tsv_star_ref.py, which follows the
official code) on a model set, streaming one tensor at a time, and save its output; or compare
two merged models. Used by benches/merge_vs_mergekit.sh.

    python benches/spectral_ref.py merge tsv|star BASE OUT MODEL... [--eta 40] [--alpha 1]
    python benches/spectral_ref.py compare BASE OURS REFERENCE

`merge` prints the wall seconds; `compare` prints the largest relative error over tensors of the
merged task vector, ||ours - ref|| / ||ref - base||, and where it is.
"""
import os
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from tsv_star_ref import running_mean, star_matrix, tsv_matrix, weighted_merge  # noqa: E402

# tsv_star_ref pins one thread for reproducible goldens; the timed reference gets every core,
# like sinkmerge.
torch.set_num_threads(os.cpu_count())


def tensor(handle, name, rows):
    if name not in handle.keys():
        name = "model.embed_tokens.weight"  # tied
    return handle.get_tensor(name).float()[:rows]


def merge(method, base_dir, out_dir, models, eta, alpha):
    t0 = time.time()
    base = safe_open(str(Path(base_dir) / "model.safetensors"), framework="pt")
    handles = [safe_open(str(Path(m) / "model.safetensors"), framework="pt") for m in models]
    out = {}
    for name in base.keys():
        b = base.get_tensor(name)
        deltas = [tensor(h, name, b.shape[0]) - b.float() for h in handles]
        spectral = b.dim() == 2 and name not in ("model.embed_tokens.weight", "lm_head.weight")
        if method == "tsv":
            merged = alpha * (tsv_matrix(deltas) if spectral else running_mean(deltas))
        else:
            parts = [star_matrix(d, eta) if spectral else d for d in deltas]
            merged = weighted_merge(parts, [1 / len(parts)] * len(parts))
        out[name] = (b.float() + merged).to(b.dtype).contiguous()
        print(f"{name} {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_file(out, str(Path(out_dir) / "model.safetensors"), metadata={"format": "pt"})
    print(f"{time.time() - t0:.2f}")


def compare(base_dir, ours_dir, ref_dir):
    base = safe_open(str(Path(base_dir) / "model.safetensors"), framework="pt")
    ours = safe_open(str(Path(ours_dir) / "model.safetensors"), framework="pt")
    ref = safe_open(str(Path(ref_dir) / "model.safetensors"), framework="pt")
    worst = (0.0, None)
    for name in ref.keys():
        b, o, r = (h.get_tensor(name).double() for h in (base, ours, ref))
        size = (r - b).norm().item()
        err = (o - r).norm().item() / (size if size > 0 else 1.0)
        worst = max(worst, (err, name))
    print(f"{worst[0]:.3e} {worst[1]}")


if __name__ == "__main__":
    if sys.argv[1] == "compare":
        compare(*sys.argv[2:5])
    else:
        rest = sys.argv[2:]
        opts = {"--eta": 40.0, "--alpha": 1.0}
        for k in list(opts):
            if k in rest:
                i = rest.index(k)
                opts[k] = float(rest[i + 1])
                del rest[i:i + 2]
        method, base_dir, out_dir, *models = rest
        merge(method, base_dir, out_dir, models, opts["--eta"], opts["--alpha"])
