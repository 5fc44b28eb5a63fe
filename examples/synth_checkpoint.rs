//! Write a synthetic Qwen2-architecture checkpoint of realistic shapes with random weights, for
//! benchmarks that need gigabytes of real-looking safetensors without downloading a model.
//!
//! cargo run --release --example synth_checkpoint -- OUT --layers 4 --hidden 3584 \
//!     --intermediate 18944 --heads 28 --kv-heads 4 --vocab 32000 --dtype bf16 --seed 0 [--tie 1] \
//!     [--std 0.02]
//!
//! `--vision-depth N` (N > 0) makes it a Qwen2.5-VL in the Hub layout instead: the same language
//! model plus N vision blocks of Qwen2.5-VL's widths under `visual.*`, with a flat Qwen2.5-VL config.

// An example prints its result; the rule against printing is for the commands (clippy.toml).
#![allow(clippy::disallowed_macros)]

use std::borrow::Cow;
use std::path::PathBuf;

use rand::Rng;
use rand_distr::{Distribution, Normal};
use serde_json::json;
use sinkmerge::checkpoint::{
    output::{OutputDir, OutputKind},
    writer,
};
use sinkmerge::dtype;
use sinkmerge::linalg::tensor_rng;

struct Opts {
    out: PathBuf,
    layers: usize,
    hidden: usize,
    intermediate: usize,
    heads: usize,
    kv_heads: usize,
    vocab: usize,
    dtype: safetensors::Dtype,
    seed: u64,
    shard: u64,
    /// Tied embeddings: no `lm_head.weight` on disk (Qwen2.5-0.5B/1.5B/3B).
    tie: bool,
    vision_depth: usize,
    /// Standard deviation of the matrices' normal init (0.02, the usual init, keeps the
    /// activations in range; larger values make them grow layer by layer).
    std: f32,
}

fn parse() -> Opts {
    let mut args = std::env::args().skip(1);
    let mut o = Opts {
        out: PathBuf::from(
            args.next()
                .expect("usage: synth_checkpoint OUT [--layers N ...]"),
        ),
        layers: 2,
        hidden: 256,
        intermediate: 512,
        heads: 4,
        kv_heads: 2,
        vocab: 1024,
        dtype: safetensors::Dtype::BF16,
        seed: 0,
        shard: writer::DEFAULT_MAX_SHARD_SIZE,
        tie: false,
        vision_depth: 0,
        std: 0.02,
    };
    while let Some(flag) = args.next() {
        let value = args
            .next()
            .unwrap_or_else(|| panic!("{flag} needs a value"));
        let n = || {
            value
                .parse::<usize>()
                .unwrap_or_else(|_| panic!("{flag}: not a number"))
        };
        match flag.as_str() {
            "--layers" => o.layers = n(),
            "--hidden" => o.hidden = n(),
            "--intermediate" => o.intermediate = n(),
            "--heads" => o.heads = n(),
            "--kv-heads" => o.kv_heads = n(),
            "--vocab" => o.vocab = n(),
            "--seed" => o.seed = n() as u64,
            "--tie" => o.tie = n() != 0,
            "--vision-depth" => o.vision_depth = n(),
            "--dtype" => {
                o.dtype = dtype::parse_float_dtype(&value).expect("dtype: bf16, f16 or f32")
            }
            "--std" => o.std = value.parse().expect("--std: a number"),
            "--max-shard-size" => o.shard = writer::parse_size(&value).expect("size"),
            _ => panic!("unknown flag {flag}"),
        }
    }
    o
}

fn main() {
    let o = parse();
    let hd = o.hidden / o.heads;
    let (h, i, kv) = (o.hidden, o.intermediate, o.kv_heads * hd);
    let mut tensors = vec![("model.embed_tokens.weight".to_string(), vec![o.vocab, h])];
    for l in 0..o.layers {
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            ("input_layernorm.weight", vec![h]),
            ("self_attn.q_proj.weight", vec![h, h]),
            ("self_attn.q_proj.bias", vec![h]),
            ("self_attn.k_proj.weight", vec![kv, h]),
            ("self_attn.k_proj.bias", vec![kv]),
            ("self_attn.v_proj.weight", vec![kv, h]),
            ("self_attn.v_proj.bias", vec![kv]),
            ("self_attn.o_proj.weight", vec![h, h]),
            ("post_attention_layernorm.weight", vec![h]),
            ("mlp.gate_proj.weight", vec![i, h]),
            ("mlp.up_proj.weight", vec![i, h]),
            ("mlp.down_proj.weight", vec![h, i]),
        ] {
            tensors.push((format!("{p}.{name}"), shape));
        }
    }
    tensors.push(("model.norm.weight".into(), vec![h]));
    if !o.tie {
        tensors.push(("lm_head.weight".into(), vec![o.vocab, h]));
    }
    // Qwen2.5-VL vision tower (embed 1280, MLP 3420, patch 14x14x2x3) and its merger.
    let (ve, vi) = (1280, 3420);
    for b in 0..o.vision_depth {
        let p = format!("visual.blocks.{b}");
        for (name, shape) in [
            ("norm1.weight", vec![ve]),
            ("attn.qkv.weight", vec![3 * ve, ve]),
            ("attn.qkv.bias", vec![3 * ve]),
            ("attn.proj.weight", vec![ve, ve]),
            ("attn.proj.bias", vec![ve]),
            ("norm2.weight", vec![ve]),
            ("mlp.gate_proj.weight", vec![vi, ve]),
            ("mlp.gate_proj.bias", vec![vi]),
            ("mlp.up_proj.weight", vec![vi, ve]),
            ("mlp.up_proj.bias", vec![vi]),
            ("mlp.down_proj.weight", vec![ve, vi]),
            ("mlp.down_proj.bias", vec![ve]),
        ] {
            tensors.push((format!("{p}.{name}"), shape));
        }
    }
    if o.vision_depth > 0 {
        for (name, shape) in [
            ("visual.patch_embed.proj.weight", vec![ve, 3, 2, 14, 14]),
            ("visual.merger.ln_q.weight", vec![ve]),
            ("visual.merger.mlp.0.weight", vec![4 * ve, 4 * ve]),
            ("visual.merger.mlp.0.bias", vec![4 * ve]),
            ("visual.merger.mlp.2.weight", vec![h, 4 * ve]),
            ("visual.merger.mlp.2.bias", vec![h]),
        ] {
            tensors.push((name.into(), shape));
        }
    }
    let planned: Vec<writer::PlannedTensor> = tensors
        .into_iter()
        .map(|(name, shape)| writer::PlannedTensor {
            name,
            dtype: o.dtype,
            shape,
        })
        .collect();

    let out = OutputDir::create(&o.out, OutputKind::Model, &[], true).expect("output dir");
    let config = json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": h,
        "intermediate_size": i, "num_hidden_layers": o.layers, "num_attention_heads": o.heads,
        "num_key_value_heads": o.kv_heads, "vocab_size": o.vocab, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": o.tie,
        "use_sliding_window": false, "hidden_act": "silu",
        "torch_dtype": dtype::torch_name(o.dtype).unwrap(),
    });
    let config = if o.vision_depth > 0 {
        let mut vlm = config;
        vlm["architectures"] = json!(["Qwen2_5_VLForConditionalGeneration"]);
        vlm["model_type"] = json!("qwen2_5_vl");
        vlm["rope_scaling"] = json!({"type": "mrope", "mrope_section": [16, 24, 24]});
        vlm["vision_config"] = json!({"depth": o.vision_depth, "hidden_size": ve, "intermediate_size": vi,
                                       "out_hidden_size": h, "patch_size": 14, "spatial_merge_size": 2});
        vlm
    } else {
        config
    };
    out.write_json("config.json", &config).unwrap();
    let normal = Normal::new(0.0f32, o.std).expect("--std: positive and finite");
    writer::write_tensors(
        &out,
        &planned,
        o.shard,
        None,
        |_| None,
        |k| {
            let t = &planned[k];
            let mut rng = tensor_rng(o.seed, &t.name);
            let n: usize = t.shape.iter().product();
            let values: Vec<f32> = if t.shape.len() == 1 && t.name.ends_with("norm.weight") {
                (0..n)
                    .map(|_| 1.0 + rng.random_range(-0.1f32..0.1))
                    .collect()
            } else {
                (0..n).map(|_| normal.sample(&mut rng)).collect()
            };
            Ok(Cow::Owned(dtype::encode(t.dtype, &values)?))
        },
    )
    .expect("write tensors");
    let path = out.commit().unwrap();
    println!("{}", path.display());
}
