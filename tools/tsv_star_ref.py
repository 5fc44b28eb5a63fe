#!/usr/bin/env python3
"""Torch reference of TSV-Merge and STAR, written from the TSV-M and STAR papers
and the official code, and the goldens sinkmerge's tests compare against.

Run by hand from the repository root, after tools/gen_merge_goldens.py (documented in
docs/reference/merges.md, "Goldens and tools"):

    nice -n 10 tools/.venv/bin/python tools/tsv_star_ref.py

Official code read (line numbers at those commits):
  TSV   AntoAndGar/task_singular_vectors @ a6c9718, src/utils/TSVM_utils.py
        L303-377 compute_and_sum_svd_mem_reduction (the TSVM method, src/eval/aggregation.py L290-294)
  STAR  IBM/STAR @ e6bfcf7, merger/STAR.py L16-53 star(); merger/simple_avg.py weighted_merge();
        runner/mistral_inst.py L34 (--eta 40), L106 (alphas = 1/T)

Both run in float32 with full torch.linalg.svd, as the official code does. Where sinkmerge makes
a documented choice the official code does not make, this reference makes the same one, marked
"sinkmerge choice" below:
  * embed_tokens / lm_head are averaged unless svd_embeddings (mergekit PR #639 excludes them);
  * TSV drops triplets whose singular value is exactly 0 from the orthogonalization (the official
    code orthogonalizes whatever arbitrary vectors the SVD returns for a zero task vector);
  * STAR guards total == 0 and caps the rank at min(m, n); cumulative sums in float64.
Model I/O follows sinkmerge's merge plan (as mergekit does): a tied model contributes its
embedding as lm_head, larger vocabularies are cropped to the base's rows.

Writes tests/fixtures/merge/goldens/{tsv,tsv_options,star,star_options}.safetensors for the
configs of the same names in tests/fixtures/merge/configs/, and spectral_cases.safetensors with
small edge cases (T > min(m, n), a zero task vector, eta = 100).
"""
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "merge"
M = "tests/fixtures/merge/models"

CONFIGS = {
    "tsv": f"""merge_method: tsv
base_model: {M}/base
models:
  - model: {M}/task_a
  - model: {M}/task_b
""",
    "tsv_options": f"""merge_method: tsv
base_model: {M}/base
models:
  - model: {M}/task_a
  - model: {M}/task_b
  - model: {M}/task_c
parameters:
  alpha: 0.7
  svd_embeddings: true
""",
    "star": f"""merge_method: star
base_model: {M}/base
models:
  - model: {M}/task_a
  - model: {M}/task_c
parameters:
  eta: 40
""",
    "star_options": f"""merge_method: star
base_model: {M}/base
models:
  - model: {M}/task_a
  - model: {M}/task_b
  - model: {M}/task_c
parameters:
  eta: 100
  svd_embeddings: true
""",
}


# ---------------------------------------------------------------------------------------------
# TSV (TSVM_utils.py L303-377)
# ---------------------------------------------------------------------------------------------
def tsv_matrix(deltas, svds=None):
    """Merged task vector of one 2-D tensor. `svds`: the deltas' torch.linalg.svd when the
    caller has them already (benches/spectral_ref.py shares them with star_matrix)."""
    T = len(deltas)
    sv_reduction = 1 / T  # L320
    if svds is None:
        svds = [torch.linalg.svd(d, full_matrices=False) for d in deltas]  # L336
    u0, s0, v0 = svds[0]
    sum_u = torch.zeros_like(u0)  # L339-341: U_cat has u's shape (m x k); unused columns stay 0
    sum_s = torch.zeros_like(s0)
    sum_v = torch.zeros_like(v0)
    reduced_index_s = int(s0.shape[0] * sv_reduction)  # L343
    if reduced_index_s == 0:
        return torch.zeros_like(deltas[0])  # T > min(m, n): nothing is kept
    keep = torch.zeros(s0.shape[0], dtype=torch.bool)
    for i, (u, s, v) in enumerate(svds):  # L346-357
        sl = slice(i * reduced_index_s, (i + 1) * reduced_index_s)
        sum_u[:, sl] = u[:, :reduced_index_s]
        sum_s[sl] = s[:reduced_index_s]
        sum_v[sl, :] = v[:reduced_index_s, :]
        keep[sl] = s[:reduced_index_s] > 0  # sinkmerge choice: drop exact-zero triplets
    # The official code orthogonalizes the whole m x k U_cat, zero columns included; their
    # singular values are 0, so leaving them out gives the same product. Same for zero triplets.
    if not keep.any():
        return torch.zeros_like(deltas[0])
    sum_u, sum_s, sum_v = sum_u[:, keep], sum_s[keep], sum_v[keep, :]
    u_u, s_u, v_u = torch.linalg.svd(sum_u, full_matrices=False)  # L364
    u_v, s_v, v_v = torch.linalg.svd(sum_v, full_matrices=False)  # L365
    return torch.linalg.multi_dot((u_u, v_u, torch.diag(sum_s), u_v, v_v))  # L367-375


def running_mean(deltas):
    """L358-361: new_vector[key] += (vec - new_vector[key]) / (i + 1)."""
    mean = deltas[0].clone()
    for i, d in enumerate(deltas[1:], start=1):
        mean += (d - mean) / (i + 1)
    return mean


# ---------------------------------------------------------------------------------------------
# STAR (merger/STAR.py L16-53)
# ---------------------------------------------------------------------------------------------
def star_matrix(matrix, eta, svd=None):
    """STAR's merged part of one 2-D tensor. `svd`: the matrix's torch.linalg.svd when the
    caller has it already (benches/spectral_ref.py shares it with tsv_matrix)."""
    u, s, vt = torch.linalg.svd(matrix, full_matrices=False) if svd is None else svd  # L25
    sum_tot_s = s.double().sum()  # L28 (sinkmerge choice: float64 sums)
    if sum_tot_s == 0:
        return torch.zeros_like(matrix)  # sinkmerge guard: 0/0 in the official code
    cumulative = torch.cumsum(s.double(), dim=0)  # L29
    rank_remain = torch.searchsorted(cumulative, sum_tot_s * (eta / 100)).item() + 1  # L30
    rank_remain = min(rank_remain, s.shape[0])  # sinkmerge guard for eta = 100
    remain_s = s[:rank_remain]
    scale = (sum_tot_s / remain_s.double().sum()).to(s.dtype)  # L43-45 (float32 there)
    scaled_remain_s = scale * remain_s
    return u[:, :rank_remain] @ torch.diag_embed(scaled_remain_s) @ vt[:rank_remain, :]  # L51


def weighted_merge(parts, alphas):
    """merger/simple_avg.py: clone * alpha, then += part * alpha."""
    merged = None
    for part, alpha in zip(parts, alphas):
        merged = part.clone() * alpha if merged is None else merged + part * alpha
    return merged


# ---------------------------------------------------------------------------------------------
# Whole models, with sinkmerge's (mergekit's) input handling
# ---------------------------------------------------------------------------------------------
def load(path):
    t = {k: v.float() for k, v in load_file(ROOT / path / "model.safetensors").items()}
    if "lm_head.weight" not in t:
        t["lm_head.weight"] = t["model.embed_tokens.weight"]  # tied: the embedding serves
    return t


def merge_model(cfg):
    base = load(cfg["base_model"])
    models = [load(m["model"]) for m in cfg["models"]]
    params = cfg.get("parameters") or {}
    method = cfg["merge_method"]
    svd_embeddings = params.get("svd_embeddings", False)
    out = {}
    for name, b in base.items():
        deltas = [m[name][: b.shape[0]] - b for m in models]  # crop larger vocabularies
        is_vocab = name in ("model.embed_tokens.weight", "lm_head.weight")
        spectral = b.dim() == 2 and (svd_embeddings or not is_vocab)
        if method == "tsv":
            merged = tsv_matrix(deltas) if spectral else running_mean(deltas)
            out[name] = b + params.get("alpha", 1.0) * merged
        else:
            eta = params.get("eta", 40)
            parts = [star_matrix(d, eta) if spectral else d for d in deltas]
            out[name] = b + weighted_merge(parts, [1 / len(parts)] * len(parts))
    return out


def spectral_cases():
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    cases = {
        # T = 3 > min(2, 5): r = 0, nothing kept.
        "tsv_t_gt_k": ("tsv", [r(2, 5), r(2, 5), r(2, 5)], None),
        # k = 5, r = 1: three of the five slots used.
        "tsv_small": ("tsv", [r(7, 5), r(7, 5), r(7, 5)], None),
        # A zero task vector: only the other task's top half remains.
        "tsv_zero_delta": ("tsv", [torch.zeros(6, 4), r(6, 4)], None),
        # Wide matrices (m < n).
        "tsv_wide": ("tsv", [r(4, 9), r(4, 9)], None),
        "star_eta40": ("star", [r(9, 6), r(9, 6)], 40.0),
        "star_eta100": ("star", [r(6, 4), r(6, 4)], 100.0),
        "star_zero_delta": ("star", [torch.zeros(5, 3), r(5, 3)], 40.0),
        "star_wide": ("star", [r(3, 8), r(3, 8), r(3, 8)], 25.0),
    }
    tensors, meta = {}, {}
    for name, (method, deltas, eta) in cases.items():
        for i, d in enumerate(deltas):
            tensors[f"{name}.delta{i}"] = d.contiguous()
        if method == "tsv":
            expected = tsv_matrix(deltas)
        else:
            expected = weighted_merge([star_matrix(d, eta) for d in deltas], [1 / len(deltas)] * len(deltas))
        tensors[f"{name}.expected"] = expected.contiguous()
        meta[name] = f"{method} {len(deltas)} {eta if eta is not None else ''}".strip()
    save_file(tensors, str(FIX / "goldens" / "spectral_cases.safetensors"), metadata=meta)
    print(f"spectral_cases: {len(cases)} cases")


def main():
    for name, text in CONFIGS.items():
        (FIX / "configs" / f"{name}.yml").write_text(text)
        merged = merge_model(yaml.safe_load(text))
        save_file({k: v.contiguous() for k, v in merged.items()},
                  str(FIX / "goldens" / f"{name}.safetensors"), metadata={"format": "pt"})
        print(f"{name}: {len(merged)} tensors")
    spectral_cases()


if __name__ == "__main__":
    main()
