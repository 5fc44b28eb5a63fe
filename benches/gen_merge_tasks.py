#!/usr/bin/env python3
"""Write a synthetic fine-tuned model: BASE plus a task vector per tensor, for
benches/merge_vs_mergekit.sh.

    python benches/gen_merge_tasks.py BASE_DIR OUT_DIR --seed N

Each 2-D task vector has a decaying spectrum, like real fine-tuning deltas (and unlike i.i.d.
noise, whose flat spectrum makes every truncation boundary of TSV and STAR ill-conditioned):
delta = (G1 * d) @ G2^T with Gaussian G1 (m x k), G2 (n x k), d_j = (j + 1)^-0.8, scaled to 5% of
the weight's Frobenius norm. 1-D tensors get 5% Gaussian noise. Output dtype and config follow
BASE. Runs float32 GEMMs with torch (a few minutes per 1.3 GB model on two cores).
"""
import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, required=True)
    args = ap.parse_args()
    base, out = Path(args.base), Path(args.out)
    g = torch.Generator().manual_seed(args.seed)
    tensors = {}
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            w = f.get_tensor(name)
            if w.dim() == 2:
                m, n = w.shape
                k = min(m, n)
                d = torch.arange(1, k + 1, dtype=torch.float32).pow(-0.8)
                g1 = torch.randn(m, k, generator=g) * d
                g2 = torch.randn(n, k, generator=g)
                delta = g1 @ g2.T
                del g1, g2
            else:
                delta = torch.randn(w.shape, generator=g)
            delta *= 0.05 * w.float().norm() / delta.norm()
            tensors[name] = (w.float() + delta).to(w.dtype)
            del delta
            print(name, tuple(w.shape), flush=True)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(out)


if __name__ == "__main__":
    main()
