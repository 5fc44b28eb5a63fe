#!/usr/bin/env python3
"""Synthetic 7B-class checkpoint pair for benches/norms_vs_torch.sh (not committed; ~3.8 GB).

    nice -n 10 "${PYTHON:-python3}" benches/gen_norms_bench.py OUT_DIR [--layers 4]
        [--spectrum lowrank|flat] [--dtype bf16|f32]
        [--hidden 3584 --intermediate 18944 --heads 28 --kv-heads 4]

Writes OUT_DIR/ref and OUT_DIR/target, one safetensors shard per layer with an index, in Qwen2-7B
shapes by default (hidden 3584, intermediate 18944, 28 heads, 4 KV heads, q/k/v biases) for the
first --layers layers, a small vocabulary (2048 rows, to save disk), bf16 unless --dtype f32.
REF's spectrum is made to look like real weights rather than like noise:
  REF    = 0.02 * G * diag(d) (scaling along the smaller side), d_j = (1 + j)^-0.3: a decaying
           spectrum whose top singular values are separated by roughly 10-20%.
TARGET = REF + dW, with dW by --spectrum:
  lowrank (default): a rank-32 term with singular values 0.8^i (scaled to 2% of ||REF||_F)
           plus Gaussian noise at 0.2% of REF's mean |entry|.
  flat:    a rank-16 term with singular values 1/(j+1) scaled to 0.9% of ||REF||_F, plus dense
           Gaussian noise scaled to 0.4% of ||REF||_F: a flat tail, as a dense fine-tuning
           update has, that makes the Krylov methods take more passes.
Norm scales: REF around 1, drift 1%. Seeded: rerunning gives the same bytes.
"""
import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 2048


def ref_matrix(gen, rows, cols):
    g = torch.randn(rows, cols, generator=gen) * 0.02
    k = min(rows, cols)
    d = (1.0 + torch.arange(k, dtype=torch.float32)) ** -0.3
    return g * d if cols <= rows else g * d[:, None]


def low_rank(gen, rows, cols, singular_values):
    rank = len(singular_values)
    u = torch.linalg.qr(torch.randn(rows, rank, generator=gen))[0]
    v = torch.linalg.qr(torch.randn(cols, rank, generator=gen))[0]
    return (u * singular_values) @ v.T


def drift(gen, ref, spectrum):
    rows, cols = ref.shape
    if spectrum == "lowrank":
        low = low_rank(gen, rows, cols, 0.8 ** torch.arange(32, dtype=torch.float32))
        low *= 0.02 * ref.norm() / low.norm()
        return low + 0.002 * ref.abs().mean() * torch.randn(rows, cols, generator=gen)
    low = low_rank(gen, rows, cols, 1.0 / (1.0 + torch.arange(16, dtype=torch.float32)))
    low *= 0.009 * ref.norm() / low.norm()
    noise = torch.randn(rows, cols, generator=gen)
    return low + noise * (0.004 * ref.norm() / noise.norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--spectrum", choices=("lowrank", "flat"), default="lowrank")
    ap.add_argument("--dtype", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--intermediate", type=int, default=18944)
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    args = ap.parse_args()
    hidden, inter, heads, kv = args.hidden, args.intermediate, args.heads, args.kv_heads
    head_dim = hidden // heads
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(20261129)
    dirs = {side: args.out / side for side in ("ref", "target")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    shards = args.layers + 2
    weight_map = {}
    sizes = {"ref": 0, "target": 0}

    def write(index, tensors):
        """One shard per layer (plus one each for embeddings and head) keeps memory low."""
        file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        for side, pick in (("ref", 0), ("target", 1)):
            part = {k: v[pick] for k, v in tensors.items()}
            save_file(part, str(dirs[side] / file), metadata={"format": "pt"})
            sizes[side] += sum(t.numel() * t.element_size() for t in part.values())
        weight_map.update({k: file for k in tensors})

    def pair(tensor_ref, tensor_drift):
        return tensor_ref.to(dtype), (tensor_ref + tensor_drift).to(dtype)

    e = ref_matrix(gen, VOCAB, hidden)
    write(0, {"model.embed_tokens.weight": pair(e, drift(gen, e, args.spectrum))})
    for layer in range(args.layers):
        p = f"model.layers.{layer}."
        tensors = {}
        for name, (rows, cols) in {
            "self_attn.q_proj": (heads * head_dim, hidden),
            "self_attn.k_proj": (kv * head_dim, hidden),
            "self_attn.v_proj": (kv * head_dim, hidden),
            "self_attn.o_proj": (hidden, heads * head_dim),
            "mlp.gate_proj": (inter, hidden),
            "mlp.up_proj": (inter, hidden),
            "mlp.down_proj": (hidden, inter),
        }.items():
            w = ref_matrix(gen, rows, cols)
            tensors[p + name + ".weight"] = pair(w, drift(gen, w, args.spectrum))
            if name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                b = 0.1 * torch.randn(rows, generator=gen)
                tensors[p + name + ".bias"] = pair(b, 0.01 * torch.randn(rows, generator=gen))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            g = 1 + 0.05 * torch.randn(hidden, generator=gen)
            tensors[p + norm + ".weight"] = pair(g, 0.01 * torch.randn(hidden, generator=gen))
        write(layer + 1, tensors)
        print(f"layer {layer} written", flush=True)
    g = 1 + 0.05 * torch.randn(hidden, generator=gen)
    head = ref_matrix(gen, VOCAB, hidden)
    write(
        args.layers + 1,
        {
            "model.norm.weight": pair(g, 0.01 * torch.randn(hidden, generator=gen)),
            "lm_head.weight": pair(head, drift(gen, head, args.spectrum)),
        },
    )

    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": args.layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "vocab_size": VOCAB, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16" if args.dtype == "bf16" else "float32",
    }
    for side, d in dirs.items():
        index = {"metadata": {"total_size": sizes[side]}, "weight_map": dict(sorted(weight_map.items()))}
        (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        print(f"wrote {d} ({sizes[side] / 2**30:.2f} GiB)", flush=True)

if __name__ == "__main__":
    main()
