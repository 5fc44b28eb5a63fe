#!/usr/bin/env python3
"""Write malformed checkpoints into tests/fixtures/bad/ (standard library only, no torch).

    python3 tools/gen_bad_fixtures.py            # -> tests/fixtures/bad/<case>/ and bad/cases.json

Every case directory holds a valid tiny Qwen2 config.json (unless the defect is the config itself) and
safetensors file(s) written byte by byte with `struct`, with exactly one defect. The base checkpoint is a
complete, valid 1-layer Qwen2 model (vocab 8, hidden 4, tied embeddings, BF16, 14 tensors), so a tool that
cross-checks tensors against the config sees no other problem. `_valid_control/` is that base checkpoint
without a defect (it is not listed in cases.json and must load).

cases.json is a list of {"case", "file", "tensor", "alt_tensors", "what"}:
  file         the file name the error message must contain (null: no single file, see "what")
  tensor       the tensor name the error message must contain, or null
  alt_tensors  other tensor names that are also acceptable in the message (e.g. the partner of an overlap)
Deterministic: no randomness, no timestamps; rerunning gives identical bytes.
"""
import json
import shutil
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "bad"

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hidden_act": "silu",
    "hidden_size": 4,
    "initializer_range": 0.02,
    "intermediate_size": 8,
    "max_position_embeddings": 64,
    "max_window_layers": 1,
    "model_type": "qwen2",
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 8,
}
L = "model.layers.0."
# name -> shape (all BF16), in data order (sorted by name, as safetensors writers do)
BASE = dict(sorted({
    "model.embed_tokens.weight": [8, 4],
    L + "input_layernorm.weight": [4],
    L + "self_attn.q_proj.weight": [4, 4],
    L + "self_attn.q_proj.bias": [4],
    L + "self_attn.k_proj.weight": [2, 4],
    L + "self_attn.k_proj.bias": [2],
    L + "self_attn.v_proj.weight": [2, 4],
    L + "self_attn.v_proj.bias": [2],
    L + "self_attn.o_proj.weight": [4, 4],
    L + "post_attention_layernorm.weight": [4],
    L + "mlp.gate_proj.weight": [8, 4],
    L + "mlp.up_proj.weight": [8, 4],
    L + "mlp.down_proj.weight": [4, 8],
    "model.norm.weight": [4],
}.items()))
NORM = "model.norm.weight"
QB = L + "self_attn.q_proj.bias"          # [4] -> 8 bytes
KB = L + "self_attn.k_proj.bias"          # [2] -> 4 bytes
QW = L + "self_attn.q_proj.weight"        # [4,4] -> 32 bytes
OW = L + "self_attn.o_proj.weight"        # [4,4]
IN = L + "input_layernorm.weight"         # [4]
PN = L + "post_attention_layernorm.weight"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
ST = "model.safetensors"


def numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


_state = [12345]


def bf16_bytes(n):
    """n finite BF16 values in [-0.1, 0.1), from a fixed LCG (no NaN/Inf, deterministic)."""
    out = bytearray()
    for _ in range(n):
        _state[0] = (_state[0] * 1103515245 + 12345) & 0x7FFFFFFF
        x = (_state[0] / 0x7FFFFFFF - 0.5) * 0.2
        bits = struct.unpack("<I", struct.pack("<f", x))[0]
        out += struct.pack("<H", bits >> 16)
    return bytes(out)


def payloads(names):
    return {k: bf16_bytes(numel(BASE[k])) for k in names}


def pad8(b):
    return b + b" " * ((-len(b)) % 8)


def header_text(entries, metadata=None):
    """entries: list of (name, dict) kept in order (allows duplicate keys). Compact JSON, like safetensors."""
    parts = []
    if metadata is not None:
        parts.append('"__metadata__":' + json.dumps(metadata, separators=(",", ":")))
    for name, info in entries:
        parts.append(json.dumps(name) + ":" + json.dumps(info, separators=(",", ":")))
    return ("{" + ",".join(parts) + "}").encode("utf-8")


def file_bytes(header, data, length=None):
    header = pad8(header)
    n = len(header) if length is None else length
    return struct.pack("<Q", n) + header + data


def layout(names, data=None):
    """Valid contiguous layout of `names` -> (entries, data bytes)."""
    shapes = BASE
    data_map = data or payloads(names)
    entries, blob, off = [], b"", 0
    for k in names:
        b = data_map[k]
        entries.append((k, {"dtype": "BF16", "shape": shapes[k], "data_offsets": [off, off + len(b)]}))
        blob += b
        off += len(b)
    return entries, blob


def valid_file(names=None):
    names = list(BASE) if names is None else names
    entries, blob = layout(names)
    return file_bytes(header_text(entries, {"format": "pt"}), blob)


def edit(entries, name, **kw):
    out = []
    for k, info in entries:
        if k == name:
            info = dict(info, **kw)
        out.append((k, info))
    return out


def index_json(weight_map, total_size):
    return (json.dumps({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
                       indent=2) + "\n").encode()


CASES = []


def case(name, file, tensor, what, files, config=True, alt=()):
    d = OUT / name
    d.mkdir(parents=True)
    if config:
        (d / "config.json").write_text(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
    for fn, data in files.items():
        (d / fn).write_bytes(data)
    CASES.append({"case": name, "file": file, "tensor": tensor, "alt_tensors": list(alt), "what": what})


def build():
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    _state[0] = 12345
    names = list(BASE)
    good = valid_file()
    total = sum(2 * numel(s) for s in BASE.values())

    # control (not a case)
    d = OUT / "_valid_control"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
    (d / ST).write_bytes(good)

    entries, blob = layout(names)
    meta = {"format": "pt"}

    # --- file-level / header-level defects ---------------------------------------------------
    case("truncated_file", ST, NORM,
         "valid header, but the file ends 4 bytes before the end of the last tensor (model.norm.weight)",
         {ST: good[:-4]})
    hdr = pad8(header_text(entries, meta))
    case("header_len_past_eof", ST, None,
         "8-byte header length field points 100 bytes past the end of the file",
         {ST: struct.pack("<Q", len(good) - 8 + 100) + hdr + blob})
    case("header_len_1gb", ST, None,
         "header length field claims 1 GiB (1073741824) in a file of about 1.5 KB",
         {ST: struct.pack("<Q", 1 << 30) + hdr + blob})
    case("file_shorter_than_8", ST, None, "the file is 5 bytes long: not even a header length",
         {ST: b"\x10\x00\x00\x00\x00"})
    bad_utf8 = header_text(entries, meta).replace(b'"__metadata__"', b'"__meta\xff\xfedata__"')
    case("header_not_utf8", ST, None, "header bytes are not valid UTF-8 (0xFF 0xFE inside a key)",
         {ST: file_bytes(bad_utf8, blob)})
    txt = header_text(entries, meta)
    case("header_invalid_json", ST, None, "header is cut in the middle of an object: not valid JSON",
         {ST: file_bytes(txt[: len(txt) // 2], blob)})
    case("header_not_object", ST, None, "header is valid JSON but an array ([1,2,3]), not an object",
         {ST: file_bytes(b"[1,2,3]", blob)})
    case("metadata_not_string_map", ST, None,
         '__metadata__ is {"format":"pt","step":5,"extra":{"a":1}}: values must all be strings',
         {ST: file_bytes(header_text(entries, {"format": "pt", "step": 5, "extra": {"a": 1}}), blob)})
    case("trailing_bytes_after_data", ST, None,
         "8 bytes after the end of the last tensor that no tensor covers (safetensors: MetadataIncompleteBuffer)",
         {ST: good + b"\x00" * 8})

    # --- per-tensor defects ----------------------------------------------------------------
    case("unknown_dtype", ST, QB, 'tensor dtype is "F33"',
         {ST: file_bytes(header_text(edit(entries, QB, dtype="F33"), meta), blob)})
    e2 = [(k, {kk: vv for kk, vv in v.items() if not (k == QB and kk == "dtype")}) for k, v in entries]
    case("tensor_missing_dtype", ST, QB, "tensor entry has no dtype field",
         {ST: file_bytes(header_text(e2, meta), blob)})
    case("shape_bytes_mismatch", ST, QW, "shape [4,3] BF16 = 24 bytes but data_offsets span 32 bytes",
         {ST: file_bytes(header_text(edit(entries, QW, shape=[4, 3]), meta), blob)})
    case("shape_negative", ST, QW, "shape [-4,4]: negative dimension",
         {ST: file_bytes(header_text(edit(entries, QW, shape=[-4, 4]), meta), blob)})
    case("shape_non_integer", ST, QW, "shape [2.5,4]: non-integer dimension",
         {ST: file_bytes(header_text(edit(entries, QW, shape=[2.5, 4]), meta), blob)})
    # shape overflow: [2^32, 2^32, 2^32] -> element count 2^96 overflows u64/usize when multiplied
    case("shape_overflow", ST, QB,
         "BF16 tensor with shape [4294967296,4294967296,4294967296]: numel overflows usize (no NaN anywhere)",
         {ST: file_bytes(header_text(edit(entries, QB, shape=[1 << 32, 1 << 32, 1 << 32]), meta), blob)})
    off = dict((k, v["data_offsets"]) for k, v in entries)
    b0, e0 = off[QB]
    case("offsets_reversed", ST, QB, "data_offsets [end, begin] (end < begin)",
         {ST: file_bytes(header_text(edit(entries, QB, data_offsets=[e0, b0]), meta), blob)})
    case("offsets_not_pair", ST, QB, "data_offsets has three entries",
         {ST: file_bytes(header_text(edit(entries, QB, data_offsets=[b0, e0, e0]), meta), blob)})

    # offsets past the data area: all other tensors contiguous; model.norm.weight (last) claims bytes
    # [len+1000, len+1008) although the data area ends at len (the file is complete otherwise).
    names_wo = [k for k in names if k != NORM]
    ent_wo, blob_wo = layout(names_wo)
    n = len(blob_wo)
    ent_past = ent_wo + [(NORM, {"dtype": "BF16", "shape": [4], "data_offsets": [n + 1000, n + 1008]})]
    case("offsets_past_data", ST, NORM,
         "model.norm.weight has data_offsets [N+1000, N+1008] where N is the size of the data area",
         {ST: file_bytes(header_text(ent_past, meta), blob_wo)})

    # overlap: every tensor contiguous except k_proj.bias ([2] BF16 = 4 bytes), whose data_offsets point
    # inside q_proj.bias's byte range
    pl = payloads(names)
    ent_o, blob_ov = layout([k for k in names if k != KB], data=pl)
    qb, _ = dict(ent_o)[QB]["data_offsets"]
    entries_ov = sorted(ent_o + [(KB, {"dtype": "BF16", "shape": BASE[KB], "data_offsets": [qb + 2, qb + 6]})])
    case("overlapping_tensors", ST, KB,
         "k_proj.bias's data_offsets lie inside q_proj.bias's byte range (overlap)",
         {ST: file_bytes(header_text(entries_ov, meta), blob_ov)}, alt=[QB])

    # gap: 8 unused bytes before model.norm.weight
    pl = payloads(names)
    ent_g, blob_g, cur = [], b"", 0
    for k in names:
        b = pl[k]
        if k == NORM:
            blob_g += b"\x00" * 8
            cur += 8
        ent_g.append((k, {"dtype": "BF16", "shape": BASE[k], "data_offsets": [cur, cur + len(b)]}))
        blob_g += b
        cur += len(b)
    prev = names[names.index(NORM) - 1]
    case("gap_between_tensors", ST, NORM, "8 unused bytes between the previous tensor and model.norm.weight",
         {ST: file_bytes(header_text(ent_g, meta), blob_g)}, alt=[prev])

    # duplicate key in the JSON text: model.norm.weight appears twice (second copy right after the first)
    pl = payloads(names)
    ent_d, blob_d, cur = [], b"", 0
    for k in names:
        b = pl[k]
        ent_d.append((k, {"dtype": "BF16", "shape": BASE[k], "data_offsets": [cur, cur + len(b)]}))
        blob_d += b
        cur += len(b)
        if k == NORM:
            ent_d.append((k, {"dtype": "BF16", "shape": BASE[k], "data_offsets": [cur, cur + len(b)]}))
            blob_d += b
            cur += len(b)
    hd = header_text(ent_d, meta)
    assert hd.count(b'"model.norm.weight"') == 2
    case("duplicate_tensor_name", ST, NORM,
         'the header JSON text contains the key "model.norm.weight" twice (a plain map parser keeps the last)',
         {ST: file_bytes(hd, blob_d)})

    # --- sharded defects -------------------------------------------------------------------
    s1 = [k for k in names if k.startswith("model.embed") or ".self_attn." in k]
    s2 = [k for k in names if k not in s1]
    wm = {k: SHARD1 for k in s1}
    wm.update({k: SHARD2 for k in s2})
    f1, f2 = valid_file(s1), valid_file(s2)
    case("duplicate_tensor_across_shards", SHARD2, IN,
         "model.layers.0.input_layernorm.weight is stored in both shards; the index maps it to shard 1",
         {SHARD1: valid_file(sorted(s1 + [IN])), SHARD2: f2,
          INDEX: index_json(dict(wm, **{IN: SHARD1}), total)})
    miss = "model-00003-of-00003.safetensors"
    case("index_missing_shard", miss, NORM,
         "weight_map sends model.norm.weight to model-00003-of-00003.safetensors, which does not exist",
         {SHARD1: f1, SHARD2: valid_file([k for k in s2 if k != NORM]), INDEX: index_json(dict(wm, **{NORM: miss}), total)})
    case("index_tensor_not_in_shard", SHARD1, NORM,
         "weight_map says model.norm.weight is in shard 1, but no shard contains it",
         {SHARD1: f1, SHARD2: valid_file([k for k in s2 if k != NORM]), INDEX: index_json(dict(wm, **{NORM: SHARD1}), total)})
    wm_less = {k: v for k, v in wm.items() if k != NORM}
    case("shard_tensor_not_in_index", SHARD2, NORM,
         "shard 2 holds model.norm.weight but the index weight_map does not list it",
         {SHARD1: f1, SHARD2: f2, INDEX: index_json(wm_less, total)})
    case("index_not_json", INDEX, None, "model.safetensors.index.json is not JSON",
         {SHARD1: f1, SHARD2: f2, INDEX: b'{"metadata": {"total_size": 392}, "weight_map": {"model.'})
    case("index_without_weight_map", INDEX, None, 'index JSON has "metadata" but no "weight_map"',
         {SHARD1: f1, SHARD2: f2, INDEX: (json.dumps({"metadata": {"total_size": total}}, indent=2) + "\n").encode()})

    # --- directory-level defects -----------------------------------------------------------
    case("config_missing", "config.json", None, "valid model.safetensors but no config.json", {ST: good},
         config=False)
    case("config_not_json", "config.json", None, "config.json is not JSON",
         {ST: good, "config.json": b'{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 4,,}\n'},
         config=False)
    case("no_weights", None, None,
         "the directory holds only config.json: no *.safetensors and no index (file is null: the message should "
         "say that no safetensors file was found)", {})

    (OUT / "cases.json").write_text(json.dumps(CASES, indent=2) + "\n")
    big = [p for p in OUT.rglob("*") if p.is_file() and p.name != "cases.json" and p.stat().st_size >= 2048]
    assert not big, big
    print(f"wrote {len(CASES)} cases to {OUT}")


if __name__ == "__main__":
    sys.exit(build())
