//! Parity of the CUDA backend with the CPU backend, for any device layer: the host stand-in in
//! every test run, a real GPU in the `--ignored` tests of `driver.rs`.

use std::path::{Path, PathBuf};

use super::{CudaBackend, Device};
use crate::checkpoint::Checkpoint;
use crate::forward::backend::Backend;
use crate::sink::parity::{self, Tolerances};
use crate::sink::prompts::default_prompts;
use crate::sink::tokenize::TextEncoder;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every architecture fixture of the transformers parity tests (tests/score_parity.rs):
/// (golden case, model directory).
pub fn fixtures() -> Vec<(&'static str, PathBuf)> {
    let shared = |n: &str| root().join("tests/fixtures/models").join(n);
    let extra = |n: &str| root().join("tests/fixtures/score/models").join(n);
    vec![
        ("qwen2", shared("qwen2")),
        ("qwen2-sharded", shared("qwen2-sharded")),
        ("qwen3", shared("qwen3")),
        ("llama31-tied", shared("llama31-tied")),
        ("mistral", shared("mistral")),
        ("olmo3", shared("olmo3")),
        ("qwen3_vl", shared("qwen3_vl")),
        ("olmo2", extra("olmo2")),
        ("qwen3_moe", extra("qwen3_moe")),
        ("olmoe", extra("olmoe")),
        ("qwen2_sliding", extra("qwen2_sliding")),
        ("qwen2_yarn", extra("qwen2_yarn")),
        ("llama_linear", extra("llama_linear")),
        ("llama_dynamic", extra("llama_dynamic")),
        ("qwen3_bias", extra("qwen3_bias")),
        ("olmo3_sw", extra("olmo3_sw")),
        ("llama31_rope", extra("llama31_rope")),
        ("mistral_hd", extra("mistral_hd")),
    ]
}

/// The golden's token ids, and the same ids reversed: two packed prompts.
pub fn golden_prompts(case: &str) -> Vec<Vec<u32>> {
    let path = root().join(format!("tests/fixtures/score/goldens/{case}.safetensors"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids: Vec<u32> = st
        .tensor("input_ids")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect();
    let reversed = ids.iter().rev().copied().collect();
    vec![ids, reversed]
}

pub fn open(dir: &Path) -> Checkpoint {
    Checkpoint::open_dir(dir, &dir.display().to_string()).unwrap()
}

/// Probabilities, logits and S of every architecture fixture within the parity tolerances of
/// the backend's precision.
pub fn every_fixture_matches<D: Device>(gpu: &CudaBackend<D>) {
    let tol = Tolerances::of(gpu.precision());
    for (case, dir) in fixtures() {
        let ckpt = open(&dir);
        let prompts = golden_prompts(case);
        let p = parity::check(gpu, &[&ckpt], &[prompts], false).unwrap();
        let t = &p.traces[0];
        eprintln!(
            "{} {case:16} max |dP| {:.1e}  max |dlogit| {:.1e}  |dS| {:.1e}",
            gpu.precision(),
            t.max_prob_diff,
            t.max_logit_diff,
            p.metrics[0].diff()
        );
        assert!(t.max_prob_diff <= tol.probs, "{case}: probabilities {t:?}");
        assert!(t.max_logit_diff <= tol.logits, "{case}: logits {t:?}");
        for m in &p.metrics {
            assert!(m.diff() <= tol.metrics, "{case}: {m:?}");
        }
    }
}

/// S, G_base, B_gap and the margin of the bundled pairs on the 15 default prompts.
pub fn bundled_pairs_match<D: Device>(gpu: &CudaBackend<D>) {
    for family in ["tiny-qwen3", "tiny-qwen2"] {
        let dirs = [
            root().join(format!("assets/models/{family}/ref")),
            root().join(format!("assets/models/{family}/vl")),
        ];
        let ckpts: Vec<Checkpoint> = dirs.iter().map(|d| open(d)).collect();
        let encoder = TextEncoder::load(&dirs[0], false).unwrap();
        let ids: Vec<Vec<u32>> = default_prompts()
            .iter()
            .map(|p| encoder.encode(p).unwrap())
            .collect();
        let refs: Vec<&Checkpoint> = ckpts.iter().collect();
        let p = parity::check(gpu, &refs, &[ids.clone(), ids], true).unwrap();
        for t in &p.traces {
            eprintln!(
                "{:28} max |dP| {:.1e}  max |dlogit| {:.1e}",
                t.model, t.max_prob_diff, t.max_logit_diff
            );
        }
        for m in &p.metrics {
            eprintln!(
                "{} {:40} cpu {:?} other {:?}",
                gpu.precision(),
                m.metric,
                m.cpu,
                m.other
            );
        }
        assert_eq!(
            p.metrics.len(),
            2 + 3,
            "S of both, G_base/B_gap/margin of the pair"
        );
        assert!(p.holds(), "{family}: {p:?}");
    }
}

/// Greedy decoding through `gpu` (its weights held with [`Backend::store`], attention over the
/// KV cache through the host) gives transformers' tokens on `generate`'s goldens
/// (tests/fixtures/generate/): a sliding window, an MoE, M-RoPE after images, InternVL.
pub fn decodes_as_transformers<D: Device>(gpu: &CudaBackend<D>) {
    use crate::commands::image_prompt::{read_pixel_file, Prompter};
    use crate::forward::backend::HeadView;
    use crate::forward::capture::{self, Prompt};
    use crate::forward::resident::Resident;
    use crate::forward::weights::Model;
    use crate::generate::sequence::{Logits, Sequence};

    for case in [
        "tiny_qwen2_ref",
        "fixture_mistral",
        "score_qwen3_moe",
        "qwen3_vl_two",
        "internvl_one",
    ] {
        let dir = root().join("tests/fixtures/generate");
        let golden: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(format!("{case}.json"))).unwrap())
                .unwrap();
        let ids: Vec<u32> = serde_json::from_value(golden["prompt_ids"].clone()).unwrap();
        let expected: Vec<u32> = serde_json::from_value(golden["generated_ids"].clone()).unwrap();
        let ckpt = open(&root().join(golden["model"].as_str().unwrap()));
        let model = Model::new(&ckpt).unwrap();
        let weights = Resident::load(gpu, &model).unwrap();
        let pixels = golden["pixel_values"]
            .as_str()
            .map(|p| read_pixel_file(&root().join(p)).unwrap());
        let prompter = pixels
            .as_ref()
            .map(|_| Prompter::new(&ckpt, &model, false).unwrap());
        let prompt = match &prompter {
            Some(p) => p.prompt(ids.clone(), pixels.as_ref()).unwrap(),
            None => Prompt {
                ids: ids.clone(),
                images: None,
                mrope_merge: None,
            },
        };
        let encoded = capture::encode(gpu, &model, &prompt).unwrap();
        let capacity = ids.len() + expected.len();
        let mut seq = Sequence::new(&model, gpu, &weights, capacity, None).unwrap();
        let nothing = |_: usize, _: &HeadView| ();
        let mut logits = seq
            .prefill(&prompt, encoded.as_ref(), &nothing, &mut (), Logits::Last)
            .unwrap();
        for (i, &want) in expected.iter().enumerate() {
            let token = crate::generate::sampling::argmax(&logits);
            assert_eq!(token, want, "{case}: step {i}");
            logits = seq.step(token).unwrap();
        }
        eprintln!("{case}: {} tokens as transformers'", expected.len());
    }
}
