#!/usr/bin/env python3
"""Write a synthetic fine-tuned model: BASE plus a task vector per tensor, for
benches/merge_vs_mergekit.sh.

    "${PYTHON:-python3}" benches/gen_merge_tasks.py BASE_DIR OUT_DIR --seed N [--spectrum lowrank|flat]

The 2-D task vectors, by --spectrum:
  lowrank (default): a decaying spectrum, like real fine-tuning deltas (and unlike i.i.d. noise,
      whose flat spectrum makes every truncation boundary of TSV and STAR ill-conditioned):
      delta = (G1 * d) @ G2^T with Gaussian G1 (m x k), G2 (n x k), d_j = (j + 1)^-0.8, scaled to
      5% of the weight's Frobenius norm. STAR at eta 40 keeps about 80 of 3584 ranks.
  flat: a rank-16 part with singular values 1/(j+1), scaled to 0.9% of ||W||_F, plus dense
      Gaussian noise at 0.4% of ||W||_F: a flat tail, where STAR at eta 40 keeps about 950 of
      3584 ranks and TSV's truncation cuts through the noise.
1-D tensors get 5% Gaussian noise. Output dtype and config follow BASE. Runs float32 GEMMs with
torch (lowrank: a few minutes per 1.3 GB model on two cores; flat: well under a minute).
"""
import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def flat_tailed(g, w):
    """A rank-16 part (singular values 1/(j+1)) at 0.9% of ||w||_F plus Gaussian noise at 0.4%."""
    m, n = w.shape
    u = torch.linalg.qr(torch.randn(m, 16, generator=g))[0]
    v = torch.linalg.qr(torch.randn(n, 16, generator=g))[0]
    low = (u / (1.0 + torch.arange(16, dtype=torch.float32))) @ v.T
    low *= 0.009 * w.norm() / low.norm()
    noise = torch.randn(m, n, generator=g)
    return low + noise * (0.004 * w.norm() / noise.norm())


def task_vector(g, w, spectrum):
    if w.dim() == 2 and spectrum == "flat":
        return flat_tailed(g, w)
    if w.dim() == 2:
        m, n = w.shape
        k = min(m, n)
        d = torch.arange(1, k + 1, dtype=torch.float32).pow(-0.8)
        delta = (torch.randn(m, k, generator=g) * d) @ torch.randn(n, k, generator=g).T
    else:
        delta = torch.randn(w.shape, generator=g)
    return delta * (0.05 * w.norm() / delta.norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--spectrum", choices=("lowrank", "flat"), default="lowrank")
    args = ap.parse_args()
    base, out = Path(args.base), Path(args.out)
    g = torch.Generator().manual_seed(args.seed)
    tensors = {}
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            w = f.get_tensor(name)
            delta = task_vector(g, w.float(), args.spectrum)
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
