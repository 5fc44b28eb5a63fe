#!/usr/bin/env python3
"""Time the full-SVD torch reference of TSV or STAR (tools/tsv_star_ref.py, which follows the
official code) on a model set, streaming one tensor at a time, and save its output; or compare
two merged models. Used by benches/merge_vs_mergekit.sh.

    python benches/spectral_ref.py merge tsv|star BASE OUT MODEL... [--eta 40] [--alpha 1]
                                   [--only NAME,NAME...] [--float64]
    python benches/spectral_ref.py float64 BASE OUT_STAR OUT_TSV MODEL... [--eta 40] [--alpha 1]
    python benches/spectral_ref.py compare BASE OURS REFERENCE

`merge` prints the wall seconds, and each tensor's seconds on stderr. With `--only`, the
decomposed (2-D) tensors outside the list are skipped (the cheap averaged ones always run) and
each skipped tensor is charged the measured time of a computed one of the same or transposed
shape: the printed total is then an extrapolation, flagged "(extrapolated from N of M tensors)".
With `--float64` the same code runs in float64 (inputs upcast, output cast back to the base's
dtype): on these inputs the float32 reference is itself 4e-4 to 1.6e-3 off for TSV, so this is the
run to measure sinkmerge's accuracy against; its time is not a reference time.
`float64` writes both float64 runs in one pass, each task vector's SVD computed once and
shared by the two merges (the outputs are those of `merge star|tsv ... --float64`, byte for byte;
it saves the second run's task-vector SVDs, about 45 s per 1.5B-width layer on a 2-core VM).
`compare` prints the largest relative error over the reference's tensors of the merged task
vector, ||ours - ref|| / ||ref - base||, and where it is.
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


def tensor(handle, name, rows, dtype):
    if name not in handle.keys():
        name = "model.embed_tokens.weight"  # tied
    return handle.get_tensor(name).to(dtype)[:rows]


def is_spectral(name, shape):
    """Decomposed: 2-D and not a vocabulary tensor (sinkmerge's default, mergekit PR #639)."""
    return len(shape) == 2 and name not in ("model.embed_tokens.weight", "lm_head.weight")


def merged_delta(method, deltas, spectral, eta, alpha, svds=None):
    """The merged task vector of one tensor; `svds`: the deltas' SVDs when already computed."""
    if method == "tsv":
        return alpha * (tsv_matrix(deltas, svds) if spectral else running_mean(deltas))
    svds = svds or [None] * len(deltas)
    parts = [star_matrix(d, eta, svd) for d, svd in zip(deltas, svds)] if spectral else deltas
    return weighted_merge(parts, [1 / len(parts)] * len(parts))


def save(out_dir, tensors):
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(Path(out_dir) / "model.safetensors"), metadata={"format": "pt"})


def merge(method, base_dir, out_dir, models, eta, alpha, only, dtype):
    t0 = time.time()
    base = safe_open(str(Path(base_dir) / "model.safetensors"), framework="pt")
    handles = [safe_open(str(Path(m) / "model.safetensors"), framework="pt") for m in models]
    out = {}
    seconds = {}  # shape -> measured seconds of a decomposed tensor
    skipped = []
    for name in base.keys():
        t1 = time.time()
        shape = tuple(base.get_slice(name).get_shape())
        spectral = is_spectral(name, shape)
        if only is not None and spectral and name not in only:
            skipped.append((name, shape))
            continue
        b = base.get_tensor(name)
        deltas = [tensor(h, name, b.shape[0], dtype) - b.to(dtype) for h in handles]
        merged = merged_delta(method, deltas, spectral, eta, alpha)
        out[name] = (b.to(dtype) + merged).to(b.dtype).contiguous()
        if spectral:
            seconds[shape] = time.time() - t1
        print(f"{name} {list(shape)} {time.time() - t1:.1f}s", file=sys.stderr, flush=True)
    save(out_dir, out)
    total = time.time() - t0
    for name, shape in skipped:
        charged = seconds.get(shape, seconds.get(shape[::-1]))
        if charged is None:
            sys.exit(f"--only: no computed tensor has the shape {list(shape)} of {name}")
        print(f"{name} {list(shape)} skipped, charged {charged:.1f}s", file=sys.stderr)
        total += charged
    note = f" (extrapolated from {len(out)} of {len(out) + len(skipped)} tensors)" if skipped else ""
    print(f"{total:.2f}{note}")


def float64_pair(base_dir, star_dir, tsv_dir, models, eta, alpha):
    dtype = torch.float64
    base = safe_open(str(Path(base_dir) / "model.safetensors"), framework="pt")
    handles = [safe_open(str(Path(m) / "model.safetensors"), framework="pt") for m in models]
    outs = {"star": {}, "tsv": {}}
    for name in base.keys():
        b = base.get_tensor(name)
        spectral = is_spectral(name, b.shape)
        deltas = [tensor(h, name, b.shape[0], dtype) - b.to(dtype) for h in handles]
        svds = [torch.linalg.svd(d, full_matrices=False) for d in deltas] if spectral else None
        for method, out in outs.items():
            merged = merged_delta(method, deltas, spectral, eta, alpha, svds)
            out[name] = (b.to(dtype) + merged).to(b.dtype).contiguous()
    save(star_dir, outs["star"])
    save(tsv_dir, outs["tsv"])


def compare(base_dir, ours_dir, ref_dir):
    base = safe_open(str(Path(base_dir) / "model.safetensors"), framework="pt")
    ours = safe_open(str(Path(ours_dir) / "model.safetensors"), framework="pt")
    ref = safe_open(str(Path(ref_dir) / "model.safetensors"), framework="pt")
    worst = (-1.0, "")
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
        dtype = torch.float32
        if "--float64" in rest:
            rest.remove("--float64")
            dtype = torch.float64
        opts = {"--eta": 40.0, "--alpha": 1.0, "--only": None}
        for k in list(opts):
            if k in rest:
                i = rest.index(k)
                opts[k] = rest[i + 1].split(",") if k == "--only" else float(rest[i + 1])
                del rest[i:i + 2]
        if sys.argv[1] == "float64":
            base_dir, star_dir, tsv_dir, *models = rest
            float64_pair(base_dir, star_dir, tsv_dir, models, opts["--eta"], opts["--alpha"])
        else:
            method, base_dir, out_dir, *models = rest
            merge(method, base_dir, out_dir, models, opts["--eta"], opts["--alpha"], opts["--only"],
                  dtype)
