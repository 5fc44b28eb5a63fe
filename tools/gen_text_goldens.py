#!/usr/bin/env python3
"""Text-loss goldens for `sinkmerge score --text`: transformers' own next-token loss on a text file.

Run by hand from the repository root:

    nice -n 10 tools/.venv/bin/python tools/gen_text_goldens.py

It writes tests/fixtures/score/text/<case>.json, one per case below: the model directory, the text file, the
`sinkmerge score` arguments that reproduce it (`cli`), the number of token ids, the window, the windows scored,
the tokens predicted, each window's loss, and the loss and perplexity (docs/reference/sink-metrics.md, "Text
loss and perplexity").

Nothing here shares code with the Rust scorer. transformers tokenizes the whole file as `AutoTokenizer(...)(text)`
does by default (add_special_tokens=True, no truncation, no chat template), the ids are cut into consecutive
non-overlapping windows of `window` tokens (a final window of one token predicts nothing and is dropped), and each
window runs as its own sequence through `model(input_ids=w, labels=w)`: eager attention, float32 (bf16 checkpoints
are upcast on load, as tools/sink_metrics_ref.py loads them), no cache, batch of one, CPU, one thread. Its `loss`
is `ForCausalLMLoss` (transformers/loss/loss_utils.py): the mean cross-entropy of logits[0..n-2] against tokens
1..n-1. The file's loss is the token-weighted mean over windows, sum(loss_w * (n_w - 1)) / sum(n_w - 1), in
float64; the perplexity is its exp.

The window is `--text-window` where a case gives one, else sinkmerge's default: 1024 capped at the model's
max_position_embeddings (no case has dynamic-NTK rope).
"""
import json
import math
from pathlib import Path

import torch

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

ROOT = Path(__file__).resolve().parent.parent
TEXT = "assets/text/sample.txt"
OUT = ROOT / "tests" / "fixtures" / "score" / "text"
DEFAULT_WINDOW = 1024

# (case, model directory, --text-window or None for the default). Small windows exercise many windows and a short
# final one; tiny-qwen3/vl at 397 leaves a final window of one token (1192 = 3 * 397 + 1), which is dropped.
CASES = [
    ("tiny-qwen2-ref", "assets/models/tiny-qwen2/ref", None),
    ("tiny-qwen2-vl", "assets/models/tiny-qwen2/vl", 64),
    ("tiny-qwen3-ref", "assets/models/tiny-qwen3/ref", None),
    ("tiny-qwen3-vl", "assets/models/tiny-qwen3/vl", 397),
    ("llama31-tied", "tests/fixtures/models/llama31-tied", 64),
    ("mistral", "tests/fixtures/models/mistral", None),
    ("olmo3", "tests/fixtures/models/olmo3", None),
    ("qwen3", "tests/fixtures/models/qwen3", 64),
]


def windows(ids, window):
    """Consecutive non-overlapping windows; one of a single token predicts nothing."""
    return [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) >= 2]


def case(name, model_dir, requested):
    path = ROOT / model_dir
    text = (ROOT / TEXT).read_text(encoding="utf-8")
    ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    max_pos = model.config.get_text_config().max_position_embeddings
    window = requested if requested is not None else min(DEFAULT_WINDOW, max_pos)
    assert window <= max_pos, f"{name}: window {window} > max_position_embeddings {max_pos}"
    losses, total, predicted = [], 0.0, 0
    for w in windows(ids, window):
        x = torch.tensor([w])
        with torch.no_grad():
            loss = model(input_ids=x, labels=x, use_cache=False).loss.item()
        losses.append(loss)
        total += loss * (len(w) - 1)
        predicted += len(w) - 1
    loss = total / predicted
    cli = [model_dir, "--text", TEXT] + (["--text-window", str(requested)] if requested is not None else [])
    return {
        "model": model_dir,
        "text": TEXT,
        "cli": cli,
        "n_ids": len(ids),
        "window": window,
        "windows": len(losses),
        "tokens_predicted": predicted,
        "window_losses": losses,
        "loss": loss,
        "perplexity": math.exp(loss),
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
    }


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for name, model_dir, requested in CASES:
        rep = case(name, model_dir, requested)
        (OUT / f"{name}.json").write_text(json.dumps(rep, indent=1, sort_keys=True) + "\n")
        print(f"{name:16} ids {rep['n_ids']:5} window {rep['window']:5} windows {rep['windows']:3} "
              f"loss {rep['loss']:.6f} ppl {rep['perplexity']:.3f}")


if __name__ == "__main__":
    main()
