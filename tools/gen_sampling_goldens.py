"""Goldens for `sinkmerge generate`'s logits processors (src/generate/sampling.rs).

Run from the repository root:

    tools/.venv-gen/bin/python tools/gen_sampling_goldens.py

Writes tests/fixtures/generate/sampling/processors.json: 100 cases, each a raw logit vector, the
sequence so far (`previous_ids`, prompt included), the generation settings, and what transformers
5.25.0 makes of them: the processor chain's names, the processed scores (`null` for -inf), the
softmax of those scores and `torch.argmax` of them (greedy's token).

The chain is transformers' own: `GenerationMixin._get_logits_processor` called on a host object
with a `GenerationConfig` whose unset fields took `_get_default_generation_params()`, as
`generate` does in `_prepare_generation_config`, so the order, the skip conditions (temperature
1.0, top_k 0, top_p 1.0) and `min_tokens_to_keep` are transformers', not ours.

Cases where a top-p or min-p decision lies within 1e-5 of its threshold are drawn again: there
the outcome hangs on the last bit of torch's vectorised `exp` and summation order, which no
other implementation reproduces, so such a case would test rounding, not semantics. So are cases
where top-p removes some of a group of equal scores and keeps others: which of the tied tokens go
is the order torch's unstable `torch.sort` leaves them in, an artefact of its kernel (on CPU the
index order for up to 16 scores, an introsort's for more), not a rule of transformers'; sinkmerge
removes the lower ids first. Ties are otherwise kept on purpose: top-k keeps every tie of the k-th
value (`scores < topk(...)[..., -1]`), and ties wholly kept or wholly removed by top-p or min-p.
"""

import json
import math
import pathlib
import types
import warnings

import numpy as np
import torch
import transformers
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

assert transformers.__version__ == "5.25.0", transformers.__version__
# Greedy cases carry sampling flags on purpose; an empty prompt is a case too.
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", category=UserWarning)

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/generate/sampling/processors.json"
CASES = 100
MARGIN = 1e-5


class Host(GenerationMixin):
    """The least `_get_logits_processor` reads of a model: a decoder-only config."""

    def __init__(self):
        self.config = types.SimpleNamespace(is_encoder_decoder=False)


def chain(settings, prompt_len):
    config = GenerationConfig(**{k: v for k, v in settings.items() if v is not None})
    config.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    host = Host()
    host._prepare_special_tokens(config, device="cpu")
    return host._get_logits_processor(config, input_ids_seq_length=prompt_len, device="cpu")


def logits_of(rng, kind, vocab):
    if kind == "normal":
        x = rng.normal(0.0, 3.0, vocab)
    elif kind == "ties":
        x = rng.integers(-3, 4, vocab).astype(np.float64)
    elif kind == "peaked":
        x = rng.normal(0.0, 1.0, vocab)
        x[rng.integers(vocab)] = 25.0
    elif kind == "flat":
        x = np.full(vocab, 0.5) + rng.integers(0, 2, vocab) * 1e-3
    elif kind == "negative":
        x = -np.abs(rng.normal(4.0, 2.0, vocab))
    else:  # "masked": some -inf entries, as a masked vocabulary gives
        x = rng.normal(1.0, 2.0, vocab)
        x[rng.random(vocab) < 0.3] = -np.inf
        x[rng.integers(vocab)] = 2.0
    # Three decimals keep the file small; the values are exact f32 either way.
    return np.round(x, 3).astype(np.float32)


def settings_of(rng, i, vocab):
    """Cycles through the processors alone and together, greedy and sampling."""
    rep = float(rng.choice([1.3, 0.8, 1.1, 2.0]))
    temp = float(rng.choice([0.7, 1.5, 0.3, 2.2]))
    top_k = int(rng.choice([1, 3, 10, vocab, vocab + 7]))
    top_p = float(np.round(rng.uniform(0.05, 0.98), 3))
    min_p = float(np.round(rng.uniform(0.0, 0.5), 3))
    base = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0)
    which = i % 10
    if which == 0:
        return dict(base, do_sample=False, repetition_penalty=rep)
    if which == 1:
        return dict(base, temperature=temp)
    if which == 2:
        return dict(base, top_k=top_k)
    if which == 3:
        return dict(base, top_p=top_p)
    if which == 4:
        return dict(base, min_p=min_p)
    if which == 5:
        return dict(do_sample=True, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep)
    if which == 6:
        # A sampling config run greedy: only the repetition penalty applies.
        return dict(do_sample=False, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep)
    if which == 7:
        # transformers' defaults when sampling: top_k 50, nothing else.
        return dict(base, top_k=50)
    if which == 8:
        return dict(base, temperature=temp, top_p=top_p, repetition_penalty=rep)
    # top-k then top-p: top-p sees the distribution top-k renormalised.
    return dict(base, top_k=int(rng.choice([3, 10, 30])), top_p=top_p, temperature=temp)


def undecided(processors, ids, scores):
    """Whether a top-p or min-p decision in the chain lies within MARGIN of its threshold, or
    top-p splits a group of tied scores (see the module's docstring)."""
    for p in processors:
        if isinstance(p, transformers.TopPLogitsWarper):
            cum = torch.sort(scores, descending=False)[0].softmax(-1).double().cumsum(-1)
            if (cum - (1 - p.top_p)).abs().min() < MARGIN:
                return True
            after = p(ids, scores)
            removed = scores[torch.isinf(after) & torch.isfinite(scores)]
            kept = scores[torch.isfinite(after)]
            if torch.isin(removed, kept).any():
                return True
        if isinstance(p, transformers.MinPLogitsWarper):
            probs = scores.softmax(-1).double()
            top = probs.max()
            gap = (probs - p.min_p * top).abs()
            if gap[probs > 0].min() < MARGIN * top and p.min_p > 0:
                return True
        scores = p(ids, scores)
    return False


def number(x):
    """An f32 as JSON: its shortest decimal, or null for -inf."""
    if math.isinf(x) and x < 0:
        return None
    assert math.isfinite(x), x
    return float(str(np.float32(x)))


def main():
    rng = np.random.default_rng(50)
    kinds = ["normal", "ties", "peaked", "flat", "negative", "masked"]
    cases = []
    for i in range(CASES):
        kind = kinds[i % len(kinds)]
        # Drawn again whole while undecided: a flat vector's top-p cut rarely falls between its
        # two values, more often in a short one.
        for _ in range(1000):
            vocab = int(rng.integers(5, 301))
            logits = logits_of(rng, kind, vocab)
            # Ids past the vocabulary are ignored (transformers clamps them to a padding column).
            previous = rng.integers(0, vocab + 3, int(rng.integers(0, 20))).tolist()
            settings = settings_of(rng, i, vocab)
            processors = chain(settings, len(previous))
            ids = torch.tensor([previous], dtype=torch.long)
            raw = torch.from_numpy(logits.copy())[None, :]
            if not undecided(processors, ids, raw.clone()):
                break
        else:
            raise SystemExit(f"case {i}: no setting away from a threshold")
        scores = processors(ids, raw.clone())[0]
        probs = scores.softmax(-1)
        cases.append(
            {
                "kind": kind,
                "settings": settings,
                "processors": [type(p).__name__ for p in processors],
                "previous_ids": previous,
                "logits": [number(x) for x in logits.tolist()],
                "scores": [number(x) for x in scores.tolist()],
                "probs": [number(x) for x in probs.tolist()],
                "argmax": int(scores.argmax()),
            }
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "generator": "tools/gen_sampling_goldens.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "cases": cases,
    }
    OUT.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"{OUT}: {len(cases)} cases, {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main()
