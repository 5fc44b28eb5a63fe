#!/usr/bin/env python3
"""The torch peer of `sinkmerge norms` for benches/norms_vs_torch.sh: the same per-tensor table.

    "${PYTHON:-python3}" benches/norms_torch.py REF_DIR TARGET_DIR [--threads N] [--layers N] [--modules q_proj,...]

What a researcher would write: load each tensor pair from safetensors, dW = T - R in float32,
`torch.linalg.matrix_norm(dW, ord=2)` and `ord='fro'` (and the same for R, for the relative
norms), stable rank; `vector_norm` for 1-D tensors. Prints one line per tensor, so the run can be
checked against sinkmerge's output. `--layers N` keeps layers 0..N only (no embeddings or head),
like `sinkmerge norms --layers 0:N`. `--modules` keeps those module types (weights and biases), like
`sinkmerge norms --modules`.
"""
import argparse
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open


def tensors(directory):
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    where = {}
    for f in files:
        with safe_open(str(d / f), "pt") as s:
            for k in s.keys():
                where[k] = d / f
    return where


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ref")
    ap.add_argument("target")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--layers", type=int)
    ap.add_argument("--modules", help="comma-separated module types, e.g. q_proj,k_proj")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ref, tgt = tensors(args.ref), tensors(args.target)
    for name in sorted(set(ref) & set(tgt)):
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if args.layers is not None and (layer is None or int(layer.group(1)) >= args.layers):
            continue
        if args.modules and name.rsplit(".", 2)[-2] not in args.modules.split(","):
            continue
        with safe_open(str(ref[name]), "pt") as s:
            r = s.get_tensor(name).float()
        with safe_open(str(tgt[name]), "pt") as s:
            t = s.get_tensor(name).float()
        d = t - r
        if d.dim() == 2:
            fro, op = torch.linalg.matrix_norm(d, "fro").item(), torch.linalg.matrix_norm(d, 2).item()
            rfro, rop = torch.linalg.matrix_norm(r, "fro").item(), torch.linalg.matrix_norm(r, 2).item()
            print(f"{name} fro={fro:.6g} op={op:.7g} stable_rank={fro * fro / (op * op):.6g} rel_fro={fro / rfro:.6g} rel_op={op / rop:.6g}", flush=True)
        else:
            l2, rl2 = torch.linalg.vector_norm(d).item(), torch.linalg.vector_norm(r).item()
            linf, rinf = torch.linalg.vector_norm(d, float("inf")).item(), torch.linalg.vector_norm(r, float("inf")).item()
            print(f"{name} l2={l2:.6g} linf={linf:.6g} rel_l2={l2 / rl2:.6g} ref_linf={rinf:.6g}", flush=True)


if __name__ == "__main__":
    main()
