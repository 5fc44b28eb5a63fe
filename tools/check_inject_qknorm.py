"""Check `sinkmerge inject-qknorm` against transformers.

For each Qwen2 input model, runs `sinkmerge inject-qknorm` into a temporary directory, then:

1. loads the output with `Qwen3ForCausalLM.from_pretrained` and checks that transformers reports
   no missing, unexpected or mismatched keys;
2. runs the Qwen2 original (`Qwen2ForCausalLM`) and the injected model on the same token ids
   (f32, eager attention) and records max |logit difference| (expected > 0: the unit QK norm
   changes the function);
3. replaces the injected model's q_norm/k_norm by the identity and checks the logits then equal
   the Qwen2 original's (so everything but the norms, including attention_bias, the zero o_proj
   bias and head_dim, is converted faithfully);
4. checks, with forward hooks, that the injected q_norm/k_norm outputs have RMS 1 per head and
   token (the norms are live) and that the logits are finite.

Usage (from the repository root):

    cargo build
    nice -n 10 tools/.venv/bin/python tools/check_inject_qknorm.py
    nice -n 10 tools/.venv/bin/python tools/check_inject_qknorm.py --sinkmerge target/debug/sinkmerge \
        tests/fixtures/models/qwen2 tests/fixtures/models/qwen2-sharded

(`tools/.venv` is the project's venv with torch and transformers 5.23; tools/.venv in
the shared workspace.) Exits non-zero if any check fails.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parent.parent


def check(binary: Path, model: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "injected"
        subprocess.run([str(binary), "inject-qknorm", str(model), "-o", str(out), "--quiet"],
                       check=True, stdout=subprocess.DEVNULL)
        kw = dict(dtype=torch.float32, attn_implementation="eager")
        original = Qwen2ForCausalLM.from_pretrained(model, **kw).eval()
        injected, info = Qwen3ForCausalLM.from_pretrained(out, output_loading_info=True, **kw)
        injected.eval()
        problems = {k: v for k, v in info.items() if v}

        vocab = original.config.vocab_size
        ids = torch.arange(1, 25).remainder(vocab - 1).unsqueeze(0) + 1
        with torch.no_grad():
            logits_q2 = original(ids).logits
            norm_rms = []
            hooks = []
            for layer in injected.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    hooks.append(norm.register_forward_hook(
                        lambda _m, _i, o: norm_rms.append(o.pow(2).mean(-1).sqrt())))
            logits_q3 = injected(ids).logits
            for h in hooks:
                h.remove()
            for layer in injected.model.layers:
                layer.self_attn.q_norm = torch.nn.Identity()
                layer.self_attn.k_norm = torch.nn.Identity()
            logits_bypass = injected(ids).logits

        rms = torch.cat([r.flatten() for r in norm_rms])
        result = {
            "model": str(model.relative_to(ROOT) if model.is_relative_to(ROOT) else model),
            "loading_problems": problems,
            "max_abs_logit_diff_qwen2_vs_injected": (logits_q2 - logits_q3).abs().max().item(),
            "max_abs_logit_qwen2": logits_q2.abs().max().item(),
            "max_abs_logit_diff_norms_bypassed": (logits_q2 - logits_bypass).abs().max().item(),
            "qk_norm_output_rms_range": [rms.min().item(), rms.max().item()],
            "finite": bool(torch.isfinite(logits_q3).all()),
        }
        result["ok"] = (
            not problems
            and result["finite"]
            and result["max_abs_logit_diff_qwen2_vs_injected"] > 0
            and result["max_abs_logit_diff_norms_bypassed"] <= 1e-5
            and abs(result["qk_norm_output_rms_range"][0] - 1) < 1e-3
            and abs(result["qk_norm_output_rms_range"][1] - 1) < 1e-3
        )
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sinkmerge", type=Path, default=ROOT / "target/debug/sinkmerge")
    parser.add_argument("models", nargs="*", type=Path,
                        default=[ROOT / "tests/fixtures/models/qwen2",
                                 ROOT / "tests/fixtures/models/qwen2-sharded"])
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    results = [check(args.sinkmerge, m.resolve()) for m in args.models]
    print(json.dumps(results, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
