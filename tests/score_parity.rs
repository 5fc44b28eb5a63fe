//! Parity of the scorer's forward pass with transformers 5.23 eager attention (f32): attention
//! probabilities within 1e-5 and final logits within 1e-4 on every architecture, rope type,
//! config dialect, sharded and tied layout, and a VLM's language model. Goldens:
//! `tools/gen_score_goldens.py` (logits of the last 8 positions, attentions of all).

use std::path::Path;

use safetensors::SafeTensors;
use sinkmerge::checkpoint::Checkpoint;
use sinkmerge::forward::pass::record_all;

use crate::util::{fixture, root, score_fixture};

const ATTENTION_TOL: f32 = 1e-5;
const LOGITS_TOL: f32 = 1e-4;

struct Golden {
    ids: Vec<u32>,
    /// `[layers, heads, len*(len+1)/2]` lower triangles.
    attentions: Vec<f32>,
    logits: Vec<f32>,
    layers: usize,
    heads: usize,
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn golden(case: &str) -> Golden {
    let path = root().join(format!("tests/fixtures/score/goldens/{case}.safetensors"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids = st.tensor("input_ids").unwrap();
    let ids = ids
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect();
    let att = st.tensor("attentions").unwrap();
    let (layers, heads) = (att.shape()[0], att.shape()[1]);
    Golden {
        ids,
        attentions: f32s(att.data()),
        logits: f32s(st.tensor("logits").unwrap().data()),
        layers,
        heads,
    }
}

/// A model directory with another config.json: the fixture's files linked into a temp dir.
fn with_config(model: &Path, config: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(model).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "config.json" {
            std::os::unix::fs::symlink(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
    }
    std::fs::copy(config, dir.path().join("config.json")).unwrap();
    dir
}

fn check(case: &str, dir: &Path) {
    let g = golden(case);
    let ckpt = Checkpoint::open_dir(dir, case).unwrap();
    let t = record_all(&ckpt, std::slice::from_ref(&g.ids)).unwrap();
    let len = g.ids.len();
    assert_eq!(t.attentions.len(), g.layers, "{case}: layers");
    let tri = len * (len + 1) / 2;
    let mut worst_att = 0f32;
    for (l, layer) in t.attentions.iter().enumerate() {
        let probs = &layer[0];
        assert_eq!(probs.len(), g.heads * len * len, "{case}: layer {l} shape");
        for h in 0..g.heads {
            let mut k = 0;
            for q in 0..len {
                for p in 0..len {
                    let ours = probs[(h * len + q) * len + p];
                    if p > q {
                        assert_eq!(ours, 0.0, "{case}: causal mask, layer {l} head {h}");
                        continue;
                    }
                    let want = g.attentions[(l * g.heads + h) * tri + k];
                    k += 1;
                    worst_att = worst_att.max((ours - want).abs());
                }
            }
        }
    }
    let all = &t.logits[0];
    assert_eq!(all.len() % len, 0, "{case}: logits shape");
    // The golden keeps the last rows.
    let logits = &all[all.len() - g.logits.len()..];
    let worst_logit = logits
        .iter()
        .zip(&g.logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("{case:24} max |dP| = {worst_att:.2e}  max |dlogit| = {worst_logit:.2e}");
    assert!(
        worst_att <= ATTENTION_TOL,
        "{case}: attention error {worst_att:e}"
    );
    assert!(
        worst_logit <= LOGITS_TOL,
        "{case}: logits error {worst_logit:e}"
    );
}

macro_rules! parity {
    ($($test:ident: $case:expr, $dir:expr;)*) => {$(
        #[test]
        fn $test() {
            check($case, &$dir);
        }
    )*};
}

parity! {
    qwen2_tied_f32: "qwen2", fixture("qwen2");
    qwen2_sharded_4x_config: "qwen2-sharded", fixture("qwen2-sharded");
    qwen3_per_head_qk_norm: "qwen3", fixture("qwen3");
    llama31_tied_llama3_rope: "llama31-tied", fixture("llama31-tied");
    mistral_f16_sliding_window: "mistral", fixture("mistral");
    olmo3_yarn_on_full_layers: "olmo3", fixture("olmo3");
    qwen3_vl_language_model: "qwen3_vl", fixture("qwen3_vl");
    olmo2_post_norm: "olmo2", score_fixture("olmo2");
    qwen3_moe_routing: "qwen3_moe", score_fixture("qwen3_moe");
    olmoe_routing_and_clip: "olmoe", score_fixture("olmoe");
    qwen2_sliding_layers_4x: "qwen2_sliding", score_fixture("qwen2_sliding");
    qwen2_yarn_4x_type_key: "qwen2_yarn", score_fixture("qwen2_yarn");
    llama_linear_rope_with_biases: "llama_linear", score_fixture("llama_linear");
    llama_dynamic_rope_past_context: "llama_dynamic", score_fixture("llama_dynamic");
    qwen3_with_attention_bias: "qwen3_bias", score_fixture("qwen3_bias");
    olmo3_short_window_yarn: "olmo3_sw", score_fixture("olmo3_sw");
    llama31_rope_scaling_bites: "llama31_rope", score_fixture("llama31_rope");
    mistral_explicit_head_dim: "mistral_hd", score_fixture("mistral_hd");
}

/// The 4.x config of each shared fixture gives the same forward pass (the golden script checks
/// that transformers agrees).
#[test]
fn four_x_configs_give_the_same_forward_pass() {
    for (case, config) in [
        ("qwen2", "qwen2"),
        ("qwen3", "qwen3"),
        ("llama31-tied", "llama31"),
        ("mistral", "mistral"),
        ("olmo3", "olmo3"),
    ] {
        let cfg = root().join(format!("tests/fixtures/configs/{config}.4x.json"));
        let dir = with_config(&fixture(case), &cfg);
        check(case, dir.path());
    }
}
