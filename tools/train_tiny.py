#!/usr/bin/env python3
"""Train the bundled tiny Qwen2- and Qwen3-architecture LMs with real attention sinks.

Run by hand from the repository root, one stage after the other (tools/README-train.md has the
wall times, versions and results of the committed run):

    PY="nice -n 10 tools/.venv/bin/python"
    $PY tools/train_tiny.py corpus                      # local English text -> work/corpus.jsonl
    $PY tools/train_tiny.py tokenizer                   # 2048-token byte-level BPE with a fixed BOS
    $PY tools/train_tiny.py pretrain --arch qwen2       # resumable; checkpoints in work/qwen2/
    $PY tools/train_tiny.py pretrain --arch qwen3
    $PY tools/train_tiny.py adapt --arch qwen2 --mode vl      # VL-like continuation
    $PY tools/train_tiny.py adapt --arch qwen2 --mode text    # matched text-only control
    $PY tools/train_tiny.py adapt --arch qwen3 --mode vl
    $PY tools/train_tiny.py adapt --arch qwen3 --mode text
    $PY tools/train_tiny.py export                      # assets/models/tiny-qwen{2,3}/{ref,vl}/
    $PY tools/train_tiny.py verify                      # reload, score, write the results JSON

`work` is target/train_tiny/ (git-ignored) unless --work says otherwise. Every stage is seeded and
single-threaded (torch.set_num_threads(1)), so a rerun on the same corpus gives the same numbers.
The in-script sink evaluator follows docs/reference/sink-metrics.md: per head and prompt the
sink is the key with the largest attention column mass, G = s[q,p_sink] - logsumexp of the other
allowed scores for queries q >= max(1, p_sink), S = median of G over the window of layers.
"""
import argparse
import ast
import gzip
import hashlib
import json
import math
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(1)

import tokenizers  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "assets" / "models"

# ---------------------------------------------------------------------------------------------
# Settings of the committed run (tools/README-train.md). Flags override the training ones.
# ---------------------------------------------------------------------------------------------
VOCAB_SIZE = 2048
BOS, EOS = "<|begin_of_text|>", "<|endoftext|>"
SPECIALS = [BOS, EOS, "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
# Qwen2 pre-tokenizer regex (as in Qwen2.5's tokenizer.json)
QWEN_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# ChatML; starts with the BOS so that apply_chat_template (which tokenizes without special
# tokens) gives exactly one BOS, as Llama-3's template does.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

ARCH = {
    "common": dict(vocab_size=VOCAB_SIZE, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   hidden_act="silu", initializer_range=0.02, attention_dropout=0.0, use_cache=True),
}
# model shape flags of `pretrain` and their defaults (the committed run's shape)
SHAPE_FLAGS = {"num_hidden_layers": 6, "hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 32}

# The pretraining run whose final weights are the bundled reference (tools/README-train.md).
REF_RUN = "{arch}"

# Held-out instruction-style prompts for monitoring the sink while training (written for this
# script; not the project's calibration set, which lives in assets/prompts/).
MONITOR_PROMPTS = [
    "Write a short note that explains how to list the files in a directory. Use exactly three bullet points.",
    "Describe what a symbolic link is in two sentences, without using the word file.",
    "List four options of the copy command and say what each one does, one line per option.",
    "Explain the difference between a process and a thread. Answer in fewer than fifty words.",
    "Write a friendly reminder to back up a home directory. End the message with the word Thanks.",
    "Summarize what a license grants to the user in one paragraph, in plain English.",
    "Give three reasons to read the manual page of a command before using it. Number the reasons.",
    "Write a title for a guide about text search tools, in capital letters, and nothing else.",
    "Explain what the exit status of a program means. Include an example with the value zero.",
    "Rewrite this sentence in the passive voice: the server writes the log file every hour.",
    "Describe how to compress a folder into an archive. Wrap your whole answer in double quotes.",
    "Write two short paragraphs about environment variables, separated by three asterisks.",
    "Answer with yes or no, then explain in one sentence: can a file have more than one name?",
    "List the steps to change the permissions of a script so that it can be run. Use lowercase only.",
    "Write a haiku about a terminal window at night. Do not use any commas.",
]


def log(msg):
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def sha256_text(s):
    return hashlib.sha256(s.encode("utf-8")).hexdigest()


def write_json(path, obj):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# 1. Corpus: English man pages (roff stripped), /usr/share/doc texts, Python stdlib docstrings
# ---------------------------------------------------------------------------------------------
ROFF_CHARS = {
    "em": "--", "en": "-", "hy": "-", "aq": "'", "dq": '"', "lq": '"', "rq": '"', "oq": "'", "cq": "'",
    "bu": "*", "co": "(c)", "rg": "(R)", "tm": "(TM)", "ti": "~", "ha": "^", "ga": "`", "mu": "x",
    ">=": ">=", "<=": "<=", "->": "->", "<-": "<-", "rs": "\\", "sl": "/", "ba": "|", "or": "|",
    "pl": "+", "mi": "-", "eq": "=", "lB": "[", "rB": "]", "lC": "{", "rC": "}", "at": "@", "sh": "#",
    "Do": "$", "ct": "c", "de": " degrees", "12": "1/2", "14": "1/4", "34": "3/4", "fo": "<", "fc": ">",
}
ROFF_STRINGS = {"lq": '"', "rq": '"', "R": "(R)", "Tm": "(TM)", "Am": "&", "Ba": "|", "Lq": '"', "Rq": '"'}
ROFF_ESCAPE = re.compile(
    r"\\(?:"
    r"\((?P<c2>..)|\[(?P<cb>[^\]]*)\]"            # special characters
    r"|\*(?:\((?P<s2>..)|\[(?P<sb>[^\]]*)\]|(?P<s1>.))"  # string interpolation
    r"|f(?:\(..|\[[^\]]*\]|.)"                     # font changes
    r"|s[+-]?\d+|s\(\d\d|s\[[^\]]*\]"             # size changes
    r"|n(?:\(..|\[[^\]]*\]|.)"                     # number registers
    r"|[hvwlLDxoZHSN]'[^']*'"                      # drawing/motion escapes with arguments
    r"|k.|\$\d|"
    r"(?P<lit>[-e&|^ 0,/c:%!t~`'.]))"
)
ROFF_LITERAL = {"-": "-", "e": "\\", "&": "", "|": "", "^": "", " ": " ", "0": " ", ",": "", "/": "",
                "c": "", ":": "", "%": "", "!": "", "t": " ", "~": " ", "`": "`", "'": "'", ".": "."}
# man(7) and mdoc(7) macros whose arguments are running text
TEXT_MACROS_SPACED = {"B", "I", "SM", "SB", "Nm", "Nd", "Ar", "Cm", "Dv", "Er", "Ev", "Fa", "Fn", "Ic", "Li",
                      "Pa", "Sy", "Em", "Va", "Xr", "Ql", "Dq", "Sq", "Pq", "Op", "Fl", "Ad", "An", "Ft", "Fd",
                      "Cd", "Lk", "Mt", "Ms", "St", "Tn", "Ux", "Bx", "Ox", "Nx", "Fx", "At", "Dl", "D1", "UR",
                      "MT", "Aq", "Bq", "Brq", "Qq", "Vt", "Ot"}
TEXT_MACROS_ALTERNATING = {"BR", "RB", "IR", "RI", "BI", "IB"}
BREAK_MACROS = {"PP", "LP", "P", "TP", "TQ", "HP", "IP", "sp", "br", "Pp", "Lp", "It", "Bl", "El", "Bd", "Ed",
                "RS", "RE", "nf", "fi", "EX", "EE", "in", "ti", "ne", "bp", "Sh", "Ss", "SH", "SS", "Rs", "Re"}
HEADING_MACROS = {"SH", "SS", "Sh", "Ss"}


def roff_args(s):
    out, cur, quoted, i = [], "", False, 0
    while i < len(s):
        ch = s[i]
        if ch == '"':
            if quoted and i + 1 < len(s) and s[i + 1] == '"':
                cur += '"'
                i += 1
            else:
                quoted = not quoted
        elif ch in " \t" and not quoted:
            if cur:
                out.append(cur)
            cur = ""
        else:
            cur += ch
        i += 1
    if cur:
        out.append(cur)
    return out


def roff_unescape(s):
    def sub(m):
        if m.group("c2") is not None:
            return ROFF_CHARS.get(m.group("c2"), "")
        if m.group("cb") is not None:
            return ROFF_CHARS.get(m.group("cb"), "")
        for g in ("s2", "sb", "s1"):
            if m.group(g) is not None:
                return ROFF_STRINGS.get(m.group(g), "")
        if m.group("lit") is not None:
            return ROFF_LITERAL[m.group("lit")]
        return ""
    return ROFF_ESCAPE.sub(sub, s).replace("\\\\", "\\")


def mdoc_words(tokens):
    """Running text of an mdoc(7) macro line: callable macro names dropped, Fl -> '-', Ns joins."""
    words, prefix, join = [], "", False
    for t in tokens:
        if t == "Fl":
            prefix = "-"
        elif t == "Ns":
            join = True
        elif t == "Ux":
            words.append("UNIX")
        elif t in TEXT_MACROS_SPACED or t in ("Oo", "Oc", "Ns", "No", "Xo", "Xc", "Pf"):
            continue
        else:
            if join and words:
                words[-1] += prefix + t
            else:
                words.append(prefix + t)
            prefix, join = "", False
    if prefix:
        words.append(prefix)
    return " ".join(words)


def strip_roff(src):
    """man(7)/mdoc(7) source -> list of paragraphs of running text."""
    paras, cur = [], []

    def flush():
        if cur:
            paras.append(" ".join(cur))
            cur.clear()

    skip_until, page_name = None, ""
    for raw in src.splitlines():
        line = raw.split('\\"', 1)[0] if '\\"' in raw else raw
        if skip_until is not None:
            if line.strip().startswith(skip_until):
                skip_until = None
            continue
        if line.startswith((".", "'")):
            parts = line[1:].strip().split(None, 1)
            if not parts:
                continue
            name, rest = parts[0], (parts[1] if len(parts) > 1 else "")
            if name in ("de", "de1", "am", "ig"):
                skip_until = ".."
                continue
            if name == "TS":
                skip_until = ".TE"
                continue
            if name == "EQ":
                skip_until = ".EN"
                continue
            args = [roff_unescape(a) for a in roff_args(rest)]
            if name in BREAK_MACROS:
                flush()
                if name in HEADING_MACROS and args:
                    paras.append(" ".join(args).capitalize())
                elif name == "IP" and args:
                    cur.append(args[0])
                elif name == "It" and args:
                    cur.append(mdoc_words(args))
            elif name in TEXT_MACROS_ALTERNATING:
                cur.append("".join(args))
            elif name in TEXT_MACROS_SPACED:
                if name == "Nm":
                    page_name = page_name or (args[0] if args else "")
                    args = args or [page_name]
                cur.append(mdoc_words([name] + args))
            continue
        text = roff_unescape(line).strip()
        if text:
            cur.append(text)
        else:
            flush()
    flush()
    return paras


def text_paragraphs(text):
    return [p for p in re.split(r"\n\s*\n", text)]


def clean_paragraph(p):
    return re.sub(r"\s+", " ", p).strip()


def english_like(p):
    if len(p) < 40 or len(p.split()) < 6:
        return False
    ascii_ratio = sum(1 for c in p if ord(c) < 128) / len(p)
    non_space = [c for c in p if not c.isspace()]
    letters = sum(1 for c in non_space if c.isalpha()) / len(non_space)
    words = re.findall(r"[A-Za-z]+", p)
    common = sum(1 for w in words if w.lower() in COMMON_WORDS) / max(1, len(words))
    return ascii_ratio >= 0.99 and letters >= 0.70 and common >= 0.15


COMMON_WORDS = set("""the of and to a in is it that for on as with be by this are or an from at which not if can
will you use used when all its any may no one has have but also only other than these into more such each
then there must should file files option options default value set name see""".split())


def doc_files():
    """(source label, reader) pairs in a fixed order."""
    out = []
    man_root = Path("/usr/share/man")
    for sec in sorted(man_root.glob("man[1-9]")):
        for f in sorted(sec.iterdir()):
            if f.is_file() and not f.is_symlink():
                out.append((f"man:{f.name}", f, "roff"))
    doc_root = Path("/usr/share/doc")
    for f in sorted(doc_root.rglob("*")):
        if not f.is_file() or f.is_symlink():
            continue
        name = f.name.lower().removesuffix(".gz")
        if "changelog" in name or "example" in str(f).lower():
            continue
        if name.startswith(("readme", "copyright", "news", "faq", "todo", "authors", "thanks")) or \
                name.endswith((".txt", ".md", ".rst")):
            out.append((f"doc:{f.relative_to(doc_root)}", f, "text"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(stdlib.rglob("*.py")):
        rel = f.relative_to(stdlib)
        if rel.parts[0] in ("test", "site-packages", "idlelib", "lib2to3", "tkinter") or "tests" in rel.parts:
            continue
        out.append((f"py:{rel}", f, "python"))
    return out


def read_maybe_gz(path):
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def python_docstrings(src):
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            d = ast.get_docstring(node)
            if d:
                out.append(d)
    return out


def cmd_corpus(args):
    work = Path(args.work)
    seen, docs = set(), []
    stats = {"files": 0, "paragraphs_total": 0, "paragraphs_dropped_not_english": 0,
             "paragraphs_dropped_duplicate": 0, "by_source": {}}
    t0 = time.time()
    for label, path, kind in doc_files():
        try:
            raw = read_maybe_gz(path)
        except (OSError, EOFError, gzip.BadGzipFile):
            continue
        if kind == "roff":
            if raw.lstrip().startswith(".so "):  # alias page
                continue
            paras = strip_roff(raw)
        elif kind == "python":
            paras = [p for d in python_docstrings(raw) for p in text_paragraphs(d)]
        else:
            paras = text_paragraphs(raw)
        kept = []
        for p in paras:
            p = clean_paragraph(p)
            if not p:
                continue
            stats["paragraphs_total"] += 1
            if not english_like(p):
                stats["paragraphs_dropped_not_english"] += 1
                continue
            key = hashlib.sha1(re.sub(r"[^a-z0-9]+", " ", p.lower()).encode()).digest()
            if key in seen:
                stats["paragraphs_dropped_duplicate"] += 1
                continue
            seen.add(key)
            kept.append(p)
        if not kept:
            continue
        stats["files"] += 1
        text = "\n\n".join(kept)
        src = label.split(":", 1)[0]
        s = stats["by_source"].setdefault(src, {"documents": 0, "bytes": 0, "paragraphs": 0})
        s["documents"] += 1
        s["bytes"] += len(text.encode())
        s["paragraphs"] += len(kept)
        # about 1% of documents, chosen by a hash of the label, are held out for validation
        split = "val" if int(sha256_text(label)[:8], 16) % 100 == 0 else "train"
        docs.append({"src": label, "split": split, "text": text})
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "corpus.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    stats["documents"] = len(docs)
    stats["bytes"] = sum(len(d["text"].encode()) for d in docs)
    stats["bytes_val"] = sum(len(d["text"].encode()) for d in docs if d["split"] == "val")
    stats["sha256"] = hashlib.sha256((work / "corpus.jsonl").read_bytes()).hexdigest()
    stats["seconds"] = round(time.time() - t0, 1)
    write_json(work / "corpus_stats.json", stats)
    log(f"corpus: {stats['documents']} documents, {stats['bytes'] / 1e6:.1f} MB -> {work / 'corpus.jsonl'}")
    print(json.dumps(stats, indent=2))


def load_corpus(work):
    with open(Path(work) / "corpus.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------------------
# 2. Tokenizer: byte-level BPE, 2048 tokens including specials, BOS prepended by the post-processor
# ---------------------------------------------------------------------------------------------
def tok_dir(work):
    return Path(work) / "tokenizer"


def cmd_tokenizer(args):
    work = Path(args.work)
    docs = load_corpus(work)
    tok = Tokenizer(models.BPE(byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PAT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIALS)
    t0 = time.time()
    tok.train_from_iterator((p for d in docs if d["split"] == "train" for p in d["text"].split("\n\n")),
                            trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)])
    out = tok_dir(work)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                   model_max_length=ARCH["common"]["max_position_embeddings"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    rewrite_tokenizer_config(out, tok)
    log(f"tokenizer: {VOCAB_SIZE} tokens in {time.time() - t0:.0f} s -> {out}")
    check_tokenizer(out)


def rewrite_tokenizer_config(out, tok):
    """Hub form of tokenizer_config.json: explicit class, added_tokens_decoder, inline template."""
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["added_tokens_decoder"] = {
        str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True} for s in SPECIALS}
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["add_bos_token"] = False  # the BOS comes from tokenizer.json's post-processor
    cfg.pop("backend", None)
    write_json(cfg_path, cfg)
    jinja = out / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()


def check_tokenizer(path):
    t = AutoTokenizer.from_pretrained(path)
    ids = t("Hello world")["input_ids"]
    assert ids[0] == t.convert_tokens_to_ids(BOS) and ids.count(ids[0]) == 1, ids
    chat = t.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    chat_ids = t(chat, add_special_tokens=False)["input_ids"]
    assert chat_ids[0] == ids[0] and chat_ids.count(ids[0]) == 1, chat_ids
    assert len(t) == VOCAB_SIZE
    return t


# ---------------------------------------------------------------------------------------------
# 3. Token data: one stream per split; sequences start at paragraph starts and get the BOS
# ---------------------------------------------------------------------------------------------
class TokenData:
    def __init__(self, work):
        work = Path(work)
        cache = work / "tokens.npz"
        tok = Tokenizer.from_file(str(tok_dir(work) / "tokenizer.json"))
        self.bos = tok.token_to_id(BOS)
        self.eos = tok.token_to_id(EOS)
        if not cache.exists():
            docs = load_corpus(work)
            arrays = {}
            # paragraphs are whitespace-trimmed, so the pre-tokenizer splits "\n\n" off by itself and
            # tokenizing them apart gives the same ids as tokenizing the joined document
            sep = tok.encode("\n\n", add_special_tokens=False).ids
            for split in ("train", "val"):
                stream, starts = [], []
                paras = [(p, i == 0) for d in docs if d["split"] == split
                         for i, p in enumerate(d["text"].split("\n\n"))]
                enc = tok.encode_batch([p for p, _ in paras], add_special_tokens=False)
                for (p, first), e in zip(paras, enc):
                    if stream:
                        stream.extend([self.eos] if first else sep)
                    starts.append(len(stream))
                    stream.extend(e.ids)
                arrays[f"{split}_tokens"] = np.asarray(stream, dtype=np.int16)
                arrays[f"{split}_starts"] = np.asarray(starts, dtype=np.int64)
            tmp = cache.with_name(f"tokens.{os.getpid()}.npz")
            np.savez(tmp, **arrays)
            os.replace(tmp, cache)
        z = np.load(cache)
        self.tokens = {s: z[f"{s}_tokens"].astype(np.int64) for s in ("train", "val")}
        self.starts = {s: z[f"{s}_starts"] for s in ("train", "val")}

    def batch(self, split, rng, batch_size, seq_len):
        """[batch, seq_len] ids: BOS, then seq_len-1 tokens from a random paragraph start."""
        toks, starts = self.tokens[split], self.starts[split]
        starts = starts[starts + seq_len - 1 <= len(toks)]
        picks = rng.choice(starts, size=batch_size)
        body = np.stack([toks[s:s + seq_len - 1] for s in picks])
        ids = np.concatenate([np.full((batch_size, 1), self.bos), body], axis=1)
        return torch.from_numpy(ids)


# ---------------------------------------------------------------------------------------------
# 4. Models
# ---------------------------------------------------------------------------------------------
def model_config(arch, work, shape):
    tok = Tokenizer.from_file(str(tok_dir(work) / "tokenizer.json"))
    c = dict(ARCH["common"], **shape, bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS),
             pad_token_id=tok.token_to_id(EOS))
    # Qwen2.5's and Qwen3's own theta; it also leaves more slowly rotating (position-independent)
    # dimensions, which is what a first-token sink's key uses.
    rope = {"rope_type": "default", "rope_theta": 1000000.0}
    if arch == "qwen2":
        return Qwen2Config(**c, rope_parameters=rope, use_sliding_window=False)
    return Qwen3Config(**c, rope_parameters=rope, attention_bias=False, use_sliding_window=False)


def new_model(arch, work, seed, shape):
    torch.manual_seed(seed)
    cfg = model_config(arch, work, shape)
    cls = Qwen2ForCausalLM if arch == "qwen2" else Qwen3ForCausalLM
    model = cls(cfg)
    model.config._attn_implementation = "sdpa"
    return model


# ---------------------------------------------------------------------------------------------
# 5. Sink evaluator (docs/reference/sink-metrics.md), from the pre-softmax scores
# ---------------------------------------------------------------------------------------------
_PROBE = {"scores": None}


def probe_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention for one unpadded sequence that also records the masked scores."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling
    n = scores.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=scores.device).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    if _PROBE["scores"] is not None:
        _PROBE["scores"].append(scores[0].detach())
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(value.dtype), value).transpose(1, 2).contiguous()
    return out, probs


AttentionInterface.register("sink_probe", probe_attention)


@torch.no_grad()
def layer_scores(model, ids):
    """Per layer: [heads, n, n] masked f32 scores for one sequence of token ids."""
    prev = model.config._attn_implementation
    model.config._attn_implementation = "sink_probe"
    _PROBE["scores"] = []
    try:
        model(input_ids=torch.tensor([ids]), use_cache=False)
        return _PROBE["scores"]
    finally:
        _PROBE["scores"] = None
        model.config._attn_implementation = prev


def head_observations(s):
    """For one head's masked scores [n, n]: (p_sink, valid query indices, G per valid query, A[q,0])."""
    a = torch.softmax(s, dim=-1)
    col = a.sum(0)
    p_sink = int(torch.nonzero(col == col.max())[0])
    qs = torch.arange(max(1, p_sink), s.shape[0])
    rows = s[qs]
    others = rows.clone()
    others[:, p_sink] = float("-inf")
    g = rows[:, p_sink] - torch.logsumexp(others, dim=-1)
    return p_sink, qs, g, a[qs, 0]


def sink_metrics(model, prompt_ids, window=None, ref_scores=None):
    """S, pos0_share, strong_sink_frac, per-layer medians; with ref_scores also B and the margin."""
    n_layers = model.config.num_hidden_layers
    window = n_layers if window is None else min(window, n_layers)
    per_layer_g = [[] for _ in range(n_layers)]
    per_layer_p0 = [[] for _ in range(n_layers)]
    b_all = []
    all_scores = []
    for pi, ids in enumerate(prompt_ids):
        scores = layer_scores(model, ids)
        all_scores.append(scores)
        for li, sl in enumerate(scores):
            for h in range(sl.shape[0]):
                p_sink, qs, g, p0 = head_observations(sl[h])
                per_layer_g[li].append(g)
                per_layer_p0[li].append(p0)
                if ref_scores is not None and li >= n_layers - window:
                    r = ref_scores[pi][li][h]
                    rp, rqs, _, _ = head_observations(r)
                    t = sl[h]
                    d = (t[rqs] - t[rqs, rp:rp + 1]) - (r[rqs] - r[rqs, rp:rp + 1])
                    allowed = torch.zeros_like(d, dtype=torch.bool)
                    for k, q in enumerate(rqs.tolist()):
                        allowed[k, :q + 1] = True
                    allowed[:, rp] = False
                    b_all.append(d.abs().masked_fill(~allowed, float("-inf")).max(dim=-1).values)
    cat = lambda xs: torch.cat(xs).double().numpy()  # noqa: E731
    win_g = cat([g for li in range(n_layers - window, n_layers) for g in per_layer_g[li]])
    win_p0 = cat([p for li in range(n_layers - window, n_layers) for p in per_layer_p0[li]])
    res = {
        "window_layers": [n_layers - window, n_layers - 1],
        "sink_strength": float(np.median(win_g)),
        "pos0_share": float(win_p0.mean()),
        "strong_sink_frac": float((win_g > 2).mean()),
        "n_observations": int(win_g.size),
        "per_layer": [{"layer": li, "median_g": float(np.median(cat(per_layer_g[li]))),
                       "pos0_share": float(cat(per_layer_p0[li]).mean())} for li in range(n_layers)],
    }
    if ref_scores is not None:
        res["b_gap_median"] = float(np.median(cat(b_all)))
    return res, all_scores


def monitor_ids(work):
    tok = Tokenizer.from_file(str(tok_dir(work) / "tokenizer.json"))
    return [tok.encode(p).ids for p in MONITOR_PROMPTS]


def late_summary(res, late):
    """Mean of per-layer pos0_share and median G over the last `late` layers."""
    pl = res["per_layer"][-late:]
    return (float(np.mean([p["pos0_share"] for p in pl])), float(np.mean([p["median_g"] for p in pl])))


# ---------------------------------------------------------------------------------------------
# 6. Training loops
# ---------------------------------------------------------------------------------------------
def lr_at(step, total, peak, warmup, final_frac=0.1):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def make_optimizer(params, lr, wd):
    decay = [p for n, p in params if p.dim() >= 2]
    no_decay = [p for n, p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


@torch.no_grad()
def val_loss(model, data, n_batches=8, batch_size=16, seq_len=128):
    model.eval()
    rng = np.random.default_rng(1234)
    losses = []
    for _ in range(n_batches):
        ids = data.batch("val", rng, batch_size, seq_len)
        losses.append(float(model(input_ids=ids, labels=ids, use_cache=False).loss))
    model.train()
    return float(np.mean(losses))


def seq_len_at(step, args):
    return args.short_seq if step < args.short_steps else args.seq_len


def save_state(path, model, opt, step, extra):
    tmp = Path(str(path) + ".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, **extra}, tmp)
    os.replace(tmp, path)


def evaluate_point(model, data, prompt_ids, step, t_train, loss_ema, late):
    res, _ = sink_metrics(model, prompt_ids)
    p0_late, g_late = late_summary(res, late)
    return {"step": step, "train_seconds": round(t_train, 1), "train_loss": round(loss_ema, 4),
            "val_loss": round(val_loss(model, data), 4), "S": round(res["sink_strength"], 4),
            "pos0_share": round(res["pos0_share"], 4), "strong_sink_frac": round(res["strong_sink_frac"], 4),
            "late_pos0_share": round(p0_late, 4), "late_median_g": round(g_late, 4),
            "per_layer_pos0": [round(p["pos0_share"], 3) for p in res["per_layer"]],
            "per_layer_median_g": [round(p["median_g"], 3) for p in res["per_layer"]]}


def cmd_pretrain(args):
    work = Path(args.work)
    rundir = work / (args.name or args.arch)
    rundir.mkdir(parents=True, exist_ok=True)
    data = TokenData(work)
    prompt_ids = monitor_ids(work)
    if args.init_from:
        # continued pretraining: the weights of an earlier stage, a fresh optimizer and schedule
        model = AutoModelForCausalLM.from_pretrained(work / args.init_from / "final", dtype=torch.float32,
                                                     attn_implementation="sdpa")
        assert model.config.model_type == args.arch, (model.config.model_type, args.arch)
    else:
        shape = {k: getattr(args, k) for k in SHAPE_FLAGS}
        model = new_model(args.arch, work, args.seed, shape)
    opt = make_optimizer(list(model.named_parameters()), args.lr, args.wd)
    state_path, curve_path = rundir / "state.pt", rundir / "curve.jsonl"
    step, t_train, loss_ema = 0, 0.0, None
    if state_path.exists():
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, t_train, loss_ema = st["step"], st["train_seconds"], st["loss_ema"]
        log(f"resumed {args.arch} at step {step}")
    else:
        curve_path.unlink(missing_ok=True)
        write_json(rundir / "settings.json", vars(args))
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{args.arch}: {n_params} parameters, {args.steps} steps of {args.batch} x {args.seq_len} tokens")
    model.train()
    late = max(1, model.config.num_hidden_layers // 2)
    while step < args.steps:
        t0 = time.time()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        seq_len = seq_len_at(step, args)
        batch = args.batch * args.seq_len // seq_len  # same tokens per step
        ids = data.batch("train", np.random.default_rng([args.seed, step]), batch, seq_len)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        t_train += time.time() - t0
        loss = loss.detach()
        loss_ema = float(loss) if loss_ema is None else 0.98 * loss_ema + 0.02 * float(loss)
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            point = evaluate_point(model, data, prompt_ids, step, t_train, loss_ema, late)
            model.train()
            with open(curve_path, "a") as f:
                f.write(json.dumps(point) + "\n")
            log(f"{args.arch} step {step}: loss {loss_ema:.3f} val {point['val_loss']:.3f} "
                f"S {point['S']:+.2f} pos0 {point['pos0_share']:.3f} late pos0 {point['late_pos0_share']:.3f} "
                f"late G {point['late_median_g']:+.2f} per-layer pos0 {point['per_layer_pos0']} "
                f"({t_train / step:.2f} s/step)")
            save_state(state_path, model, opt, step, {"train_seconds": t_train, "loss_ema": loss_ema})
    model.save_pretrained(rundir / "final")
    log(f"{args.arch}: done in {t_train / 60:.1f} min -> {rundir / 'final'}")


# ---------------------------------------------------------------------------------------------
# 7. VL-like adaptation and its text-only control
# ---------------------------------------------------------------------------------------------
class VisionLikeData:
    """Captions (text from paragraph starts) and fixed random "patch features" keyed to them.

    Each patch is the mean of the fixed random codebook rows of a short span of caption tokens,
    plus noise, so the image positions carry information about the caption (a stand-in for an
    image encoder's output). The VL sequence is BOS, <|vision_start|>, n_img soft positions
    (16-48, drawn per sequence), <|vision_end|>, caption; the control is BOS + the same caption.
    """

    def __init__(self, data, work, seed, feat_dim, caption_len, min_img, max_img):
        tok = Tokenizer.from_file(str(tok_dir(work) / "tokenizer.json"))
        self.data = data
        self.vision_start = tok.token_to_id("<|vision_start|>")
        self.vision_end = tok.token_to_id("<|vision_end|>")
        self.image_pad = tok.token_to_id("<|image_pad|>")
        self.codebook = torch.from_numpy(
            np.random.default_rng([seed, 7]).standard_normal((VOCAB_SIZE, feat_dim)).astype(np.float32))
        self.caption_len, self.min_img, self.max_img = caption_len, min_img, max_img

    def batch(self, rng, batch_size, with_images):
        captions = self.data.batch("train", rng, batch_size, self.caption_len + 1)[:, 1:]
        n_img = rng.integers(self.min_img, self.max_img + 1, size=batch_size)
        spans = [[(int(a), int(a) + 4) for a in rng.integers(0, self.caption_len - 4, size=n)] for n in n_img]
        noise = rng.standard_normal((batch_size, self.max_img, self.codebook.shape[1])).astype(np.float32)
        if not with_images:
            n_img = np.zeros(batch_size, dtype=np.int64)
        prefix = 1 + (2 if with_images else 0)
        length = prefix + int(n_img.max()) + self.caption_len
        ids = torch.full((batch_size, length), self.data.eos, dtype=torch.long)
        labels = torch.full((batch_size, length), -100, dtype=torch.long)
        feats = torch.zeros(batch_size, length, self.codebook.shape[1])
        is_image = torch.zeros(batch_size, length, dtype=torch.bool)
        for b in range(batch_size):
            n = int(n_img[b])
            row = [self.data.bos] + ([self.vision_start] + [self.image_pad] * n + [self.vision_end] if with_images else [])
            ids[b, :len(row)] = torch.tensor(row)
            ids[b, len(row):len(row) + self.caption_len] = captions[b]
            labels[b, len(row):len(row) + self.caption_len] = captions[b]
            for j, (a, e) in enumerate(spans[b][:n]):
                feats[b, 2 + j] = self.codebook[captions[b, a:e]].mean(0) + 0.1 * torch.from_numpy(noise[b, j])
                is_image[b, 2 + j] = True
        # right padding only: causal attention never lets a real token see the padding
        return ids, labels, feats, is_image


class Projector(torch.nn.Module):
    """LLaVA-style two-layer MLP from patch features to the LM's hidden size."""

    def __init__(self, feat_dim, hidden):
        super().__init__()
        self.fc1 = torch.nn.Linear(feat_dim, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def adapted_loss(model, projector, ids, labels, feats, is_image):
    embeds = model.get_input_embeddings()(ids)
    if is_image.any():
        embeds = torch.where(is_image[..., None], projector(feats), embeds)
    return model(inputs_embeds=embeds, labels=labels, use_cache=False).loss


def cmd_adapt(args):
    """Continue training the pretrained LM. vl: LLaVA-style, a projector-only alignment stage
    (LM frozen) and then full training of LM and projector on image+caption sequences; text: the
    same full stage (same steps, learning rate, seed and captions) without image positions."""
    work = Path(args.work)
    src = work / (args.base or REF_RUN.format(arch=args.arch)) / "final"
    rundir = work / f"{args.arch}-{args.mode}"
    if rundir.exists():
        raise SystemExit(f"{rundir} exists; delete it to rerun this adaptation")
    data = TokenData(work)
    prompt_ids = monitor_ids(work)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="sdpa")
    ref_res, ref_scores = sink_metrics(model, prompt_ids)
    torch.manual_seed(args.seed)
    projector = Projector(args.feat_dim, model.config.hidden_size)
    vl = VisionLikeData(data, work, args.seed, args.feat_dim, args.caption_len, args.min_img, args.max_img)
    with_images = args.mode == "vl"
    curve, t_train = [], 0.0
    late = max(1, model.config.num_hidden_layers // 2)

    def point(step, loss):
        res, _ = sink_metrics(model, prompt_ids, ref_scores=ref_scores)
        p0_late, g_late = late_summary(res, late)
        p = {"step": step, "train_seconds": round(t_train, 1), "caption_loss": None if loss is None else round(loss, 4),
             "val_loss": round(val_loss(model, data), 4), "S": round(res["sink_strength"], 4),
             "pos0_share": round(res["pos0_share"], 4), "late_pos0_share": round(p0_late, 4),
             "late_median_g": round(g_late, 4), "b_gap_median": round(res["b_gap_median"], 4),
             "margin": round(ref_res["sink_strength"] - res["b_gap_median"], 4)}
        curve.append(p)
        log(f"{rundir.name} step {step}: caption loss {loss or float('nan'):.3f} val {p['val_loss']:.3f} S {p['S']:+.3f} "
            f"pos0 {p['pos0_share']:.3f} B {p['b_gap_median']:.3f} margin {p['margin']:+.3f}")

    def run_stage(name, params, lr, steps, warmup, eval_every):
        nonlocal t_train
        opt = make_optimizer(params, lr, args.wd)
        loss_ema = None
        for step in range(steps):
            t0 = time.time()
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, lr, warmup)
            batch = vl.batch(np.random.default_rng([args.seed, 100 if name == "full" else 50, step]), args.batch,
                             with_images)
            loss = adapted_loss(model, projector, *batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
            opt.step()
            t_train += time.time() - t0
            loss = float(loss.detach())
            loss_ema = loss if loss_ema is None else 0.95 * loss_ema + 0.05 * loss
            if eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
                model.eval()
                point(step + 1, loss_ema)
                model.train()
        return loss_ema

    model.train()
    if with_images and args.align_steps:
        model.requires_grad_(False)
        loss = run_stage("align", list(projector.named_parameters()), args.align_lr, args.align_steps, 10, 0)
        model.requires_grad_(True)
        log(f"{rundir.name}: projector aligned in {args.align_steps} steps (LM frozen), caption loss {loss:.3f}")
    model.eval()
    point(0, None)
    model.train()
    params = list(model.named_parameters()) + [("projector." + n, p) for n, p in projector.named_parameters()]
    run_stage("full", params, args.lr, args.steps, args.warmup, args.eval_every)
    tmp = rundir.with_name(rundir.name + ".tmp")
    model.save_pretrained(tmp / "final")
    torch.save(projector.state_dict(), tmp / "projector.pt")
    write_json(tmp / "curve.json", {"settings": vars(args), "reference": {
        "S": ref_res["sink_strength"], "pos0_share": ref_res["pos0_share"]}, "curve": curve})
    os.replace(tmp, rundir)
    log(f"{rundir.name}: done in {t_train / 60:.1f} min -> {rundir / 'final'}")


# ---------------------------------------------------------------------------------------------
# 8. Bundle and verify
# ---------------------------------------------------------------------------------------------
BUNDLE = [(arch, kind) for arch in ("qwen2", "qwen3") for kind in ("ref", "vl")]
BUNDLE_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json"]


def bundle_source(work, arch, kind):
    return Path(work) / (REF_RUN.format(arch=arch) if kind == "ref" else f"{arch}-vl") / "final"


def cmd_export(args):
    work = Path(args.work)
    for arch, kind in BUNDLE:
        dest = ASSETS / f"tiny-{arch}" / kind
        tmp = dest.with_name(kind + ".tmp")
        if tmp.exists():
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
        model = AutoModelForCausalLM.from_pretrained(bundle_source(work, arch, kind), dtype=torch.float32)
        model.to(torch.bfloat16).save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (tmp / name).write_bytes((tok_dir(work) / name).read_bytes())
        got = sorted(f.name for f in tmp.iterdir())
        assert got == sorted(BUNDLE_FILES), got
        if dest.exists():
            for f in dest.iterdir():
                f.unlink()
            dest.rmdir()
        os.replace(tmp, dest)
        size = sum(f.stat().st_size for f in dest.iterdir())
        log(f"exported {dest.relative_to(ROOT)} ({size / 1e6:.2f} MB)")


def read_prompts(path):
    return [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def check_probe_matches_eager(model, ids):
    """The evaluator's attention equals transformers' eager attention (probabilities and logits)."""
    x = torch.tensor([ids])
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        eager = model(input_ids=x, output_attentions=True, use_cache=False)
    model.config._attn_implementation = "sink_probe"
    _PROBE["scores"] = []
    with torch.no_grad():
        probe = model(input_ids=x, use_cache=False)
    scores, _PROBE["scores"] = _PROBE["scores"], None
    model.config._attn_implementation = "eager"
    d_attn = max(float((torch.softmax(s, -1) - a[0]).abs().max()) for s, a in zip(scores, eager.attentions))
    d_logits = float((probe.logits - eager.logits).abs().max())
    assert d_attn < 1e-6 and d_logits < 1e-5, (d_attn, d_logits)
    return d_attn, d_logits


def summarize(res):
    keep = ("sink_strength", "pos0_share", "strong_sink_frac", "n_observations", "window_layers", "b_gap_median")
    out = {k: res[k] for k in keep if k in res}
    out["per_layer"] = res["per_layer"]
    return out


def cmd_verify(args):
    work = Path(args.work)
    monitor = [(p, None) for p in MONITOR_PROMPTS]
    prompt_sets = {"monitor": [p for p, _ in monitor]}
    default_prompts = ROOT / "assets" / "prompts" / "default.txt"
    if default_prompts.exists():
        prompt_sets["default"] = read_prompts(default_prompts)
    results = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                            "tokenizers": tokenizers.__version__, "python": sys.version.split()[0]},
               "settings": {"window": "all layers (the models have fewer than 10)", "stat": "median",
                            "sink_position": "column", "tokenization": "raw prompt, add_special_tokens=True"},
               "models": {}, "pairs": {}}
    for arch in ("qwen2", "qwen3"):
        loaded = {}
        for kind in ("ref", "vl"):
            path = ASSETS / f"tiny-{arch}" / kind
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                               output_loading_info=True)
            assert not any(info.values()), info
            tok = AutoTokenizer.from_pretrained(path)
            assert len(tok) == VOCAB_SIZE and tok.bos_token == BOS
            chat = tok.apply_chat_template([{"role": "user", "content": MONITOR_PROMPTS[0]}],
                                           add_generation_prompt=True, tokenize=False)
            ids = tok(MONITOR_PROMPTS[0])["input_ids"]
            assert ids[0] == tok.bos_token_id and tok(chat, add_special_tokens=False)["input_ids"][0] == ids[0]
            d_attn, d_logits = check_probe_matches_eager(model, ids)
            log(f"{path.relative_to(ROOT)}: loads (AutoModelForCausalLM, AutoTokenizer); "
                f"evaluator vs eager: attention {d_attn:.1e}, logits {d_logits:.1e}")
            loaded[kind] = (model, tok)
        for set_name, prompts in prompt_sets.items():
            tok = loaded["ref"][1]
            ids = [tok(p)["input_ids"] for p in prompts]
            ref_res, ref_scores = sink_metrics(loaded["ref"][0], ids)
            vl_res, _ = sink_metrics(loaded["vl"][0], ids, ref_scores=ref_scores)
            results["models"][f"tiny-{arch}/ref@{set_name}"] = summarize(ref_res)
            results["models"][f"tiny-{arch}/vl@{set_name}"] = summarize(vl_res)
            results["pairs"][f"tiny-{arch}@{set_name}"] = {
                "g_base_median": ref_res["sink_strength"], "b_gap_median": vl_res["b_gap_median"],
                "margin": ref_res["sink_strength"] - vl_res["b_gap_median"]}
            log(f"tiny-{arch} ({set_name} prompts): ref S {ref_res['sink_strength']:+.3f} pos0 "
                f"{ref_res['pos0_share']:.3f} | vl S {vl_res['sink_strength']:+.3f} pos0 {vl_res['pos0_share']:.3f} "
                f"| B {vl_res['b_gap_median']:.3f} margin {ref_res['sink_strength'] - vl_res['b_gap_median']:+.3f}")
        control = work / f"{arch}-text" / "final"
        if control.exists():
            model = AutoModelForCausalLM.from_pretrained(control, dtype=torch.float32, attn_implementation="eager")
            model.to(torch.bfloat16).to(torch.float32)  # same rounding as the bundled models
            tok = loaded["ref"][1]
            ids = [tok(p)["input_ids"] for p in prompt_sets["monitor"]]
            _, ref_scores = sink_metrics(loaded["ref"][0], ids)
            res, _ = sink_metrics(model, ids, ref_scores=ref_scores)
            results["models"][f"tiny-{arch}/text-control@monitor"] = summarize(res)
            results["pairs"][f"tiny-{arch} text-control@monitor"] = {
                "b_gap_median": res["b_gap_median"],
                "margin": results["pairs"][f"tiny-{arch}@monitor"]["g_base_median"] - res["b_gap_median"]}
            log(f"tiny-{arch} text control (monitor prompts): S {res['sink_strength']:+.3f} "
                f"pos0 {res['pos0_share']:.3f} B {res['b_gap_median']:.3f}")
    write_json(ASSETS / "metrics.json", results)
    log(f"wrote {ASSETS / 'metrics.json'}")
    if "default" in prompt_sets:
        # token ids of the default calibration prompts under the bundled tokenizer, for the scorer's tests
        tok = AutoTokenizer.from_pretrained(ASSETS / "tiny-qwen2" / "ref")
        prompts = prompt_sets["default"]
        chat = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                for p in prompts]
        ids_path = ROOT / "tests" / "fixtures" / "goldens" / "tiny_default_prompt_ids.json"
        write_json(ids_path, {
            "tokenizer": "assets/models/tiny-qwen2/ref/tokenizer.json (the same file in all four models)",
            "prompts_file": "assets/prompts/default.txt", "prompts": prompts,
            "raw": [tok(p)["input_ids"] for p in prompts],
            "chat_template_text": chat,
            "chat_template": [tok(c, add_special_tokens=False)["input_ids"] for c in chat],
            "versions": results["versions"]})
        log(f"wrote {ids_path}")


def print_curve(path, offset):
    """One markdown row per evaluation of a pretraining run; returns the step count after it."""
    step = offset
    for line in path.read_text().splitlines():
        c = json.loads(line)
        step = offset + c["step"]
        late3 = np.mean(c["per_layer_pos0"][-3:])
        print(f"| {step} | {c['train_seconds'] / 60:.0f} | {c['val_loss']:.3f} | {c['S']:+.2f} | "
              f"{c['pos0_share']:.3f} | {c['strong_sink_frac']:.3f} | {late3:.3f} | "
              f"{' '.join(f'{x:.2f}' for x in c['per_layer_pos0'])} |")
    return step


def cmd_report(args):
    """Markdown tables of the training curves (pasted into tools/README-train.md)."""
    work = Path(args.work)
    for arch in ("qwen2", "qwen3"):
        print(f"\n{arch} pretraining (monitor prompts, window = all layers)\n")
        print("| step | train min | val loss | S | pos0_share | strong_sink_frac | late-3 pos0_share | per-layer pos0_share |")
        print("|---:|---:|---:|---:|---:|---:|---:|---|")
        offset = 0
        for run in dict.fromkeys((arch, REF_RUN.format(arch=arch))):  # a later stage continues the count
            path = work / run / "curve.jsonl"
            if path.exists():
                offset = print_curve(path, offset)
        for mode in ("vl", "text"):
            cpath = work / f"{arch}-{mode}" / "curve.json"
            if not cpath.exists():
                continue
            c = json.loads(cpath.read_text())
            print(f"\n{arch} {mode} continuation (reference S {c['reference']['S']:+.3f}, "
                  f"pos0_share {c['reference']['pos0_share']:.3f})\n")
            print("| step | caption loss | text val loss | S | pos0_share | b_gap_median | margin |")
            print("|---:|---:|---:|---:|---:|---:|---:|")
            for p in c["curve"]:
                cap = "" if p["caption_loss"] is None else f"{p['caption_loss']:.3f}"
                print(f"| {p['step']} | {cap} | {p['val_loss']:.3f} | {p['S']:+.3f} | "
                      f"{p['pos0_share']:.3f} | {p['b_gap_median']:.3f} | {p['margin']:+.3f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=str(ROOT / "target" / "train_tiny"), help="scratch directory")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("corpus")
    sub.add_parser("tokenizer")
    p = sub.add_parser("pretrain")
    p.add_argument("--arch", choices=["qwen2", "qwen3"], required=True)
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--short-seq", type=int, default=64, help="sequence length for the first --short-steps")
    p.add_argument("--short-steps", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--wd", type=float, default=0.5, help="AdamW weight decay of matrices (Gu et al. 2024: "
                   "weight decay encourages attention sinks)")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--name", help="run directory under --work (default: the arch)")
    p.add_argument("--init-from", help="start from the final weights of this run (under --work) instead of a "
                   "random init: a second pretraining stage with its own warmup and cosine schedule")
    for k, v in SHAPE_FLAGS.items():
        p.add_argument("--" + k.replace("_", "-"), dest=k, type=int, default=v)
    p = sub.add_parser("adapt")
    p.add_argument("--arch", choices=["qwen2", "qwen3"], required=True)
    p.add_argument("--base", help=f"run whose final weights are adapted (default: {REF_RUN})")
    p.add_argument("--mode", choices=["vl", "text"], required=True,
                   help="vl: BOS + soft image positions + caption; text: BOS + the same captions")
    p.add_argument("--steps", type=int, default=300, help="steps of full training (LM and projector)")
    p.add_argument("--align-steps", type=int, default=50,
                   help="vl only: projector-only steps before the full stage, LM frozen (LLaVA stage 1)")
    p.add_argument("--align-lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--caption-len", type=int, default=64)
    p.add_argument("--min-img", type=int, default=16)
    p.add_argument("--max-img", type=int, default=48)
    p.add_argument("--feat-dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=50)
    sub.add_parser("export")
    sub.add_parser("verify")
    sub.add_parser("report")
    args = ap.parse_args()
    {"corpus": cmd_corpus, "tokenizer": cmd_tokenizer, "pretrain": cmd_pretrain, "adapt": cmd_adapt,
     "export": cmd_export, "verify": cmd_verify, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
