//! `generate`'s decode against transformers 5.25.0's greedy `generate` (eager attention, f32):
//! `tests/fixtures/generate/` (tools/gen_generate_goldens.py). Every case: 40 new tokens equal to
//! transformers', and every step's logits within 1e-4 of that step's largest magnitude.

use std::path::Path;

use serde::Deserialize;

use crate::util::{read_json, root};
use sinkmerge::checkpoint::Checkpoint;
use sinkmerge::commands::image_prompt::{read_pixel_file, Prompter};
use sinkmerge::forward::backend::cpu::CpuBackend;
use sinkmerge::forward::backend::HeadView;
use sinkmerge::forward::capture;
use sinkmerge::forward::resident::Resident;
use sinkmerge::forward::weights::Model;
use sinkmerge::generate::sequence::{Logits, Sequence};

/// Logits within this fraction of the step's largest |logit| (the tolerance).
const LOGITS_TOLERANCE: f32 = 1e-4;

#[derive(Deserialize)]
pub struct Golden {
    pub model: String,
    pub prompt_ids: Vec<u32>,
    pub pixel_values: Option<String>,
    pub generated_ids: Vec<u32>,
    pub edit: Option<serde_json::Value>,
}

pub fn golden(case: &str) -> (Golden, Vec<Vec<f32>>) {
    let dir = root().join("tests/fixtures/generate");
    let golden: Golden = read_json(dir.join(format!("{case}.json")));
    let bytes = std::fs::read(dir.join(format!("{case}.logits.safetensors"))).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    let vocab = t.shape()[1];
    let values: Vec<f32> = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let steps = values.chunks(vocab).map(<[f32]>::to_vec).collect();
    (golden, steps)
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// The largest |ours - theirs| over a step's logits, relative to its largest |logit|.
fn relative_error(ours: &[f32], theirs: &[f32]) -> f32 {
    assert_eq!(ours.len(), theirs.len(), "vocab");
    let scale = theirs.iter().fold(0f32, |m, &v| m.max(v.abs())).max(1e-30);
    ours.iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale
}

/// Decode `case` greedily on the CPU and compare every step; returns the worst relative error.
fn decode_case(case: &str) -> f32 {
    let (golden, steps) = golden(case);
    assert!(
        golden.edit.is_none(),
        "{case}: edit cases run through the CLI"
    );
    let ckpt = Checkpoint::open_dir(&root().join(&golden.model), "golden").unwrap();
    let model = Model::new(&ckpt).unwrap();
    let backend = CpuBackend::default();
    let weights = Resident::load(&backend, &model).unwrap();
    let pixels = golden
        .pixel_values
        .as_ref()
        .map(|p| read_pixel_file(&root().join(p)).unwrap());
    // Text-only fixtures may have no tokenizer: their prompt is ids.
    let prompter = pixels
        .as_ref()
        .map(|_| Prompter::new(&ckpt, &model, false).unwrap());
    let prompt = match &prompter {
        Some(p) => p
            .prompt(golden.prompt_ids.clone(), pixels.as_ref())
            .unwrap(),
        None => capture::Prompt {
            ids: golden.prompt_ids.clone(),
            images: None,
            mrope_merge: None,
        },
    };
    let encoded = capture::encode(&backend, &model, &prompt).unwrap();
    let capacity = golden.prompt_ids.len() + steps.len();
    let mut seq = Sequence::new(&model, &backend, &weights, capacity, None).unwrap();
    let mut logits = seq
        .prefill(
            &prompt,
            encoded.as_ref(),
            &|_, _: &HeadView| (),
            &mut (),
            Logits::Last,
        )
        .unwrap();
    let mut worst = 0f32;
    for (i, theirs) in steps.iter().enumerate() {
        let err = relative_error(&logits, theirs);
        worst = worst.max(err);
        assert!(
            err <= LOGITS_TOLERANCE,
            "{case}: step {i}: logits differ by {err:e} of the largest"
        );
        let token = argmax(&logits);
        assert_eq!(token, golden.generated_ids[i], "{case}: step {i}'s token");
        if i + 1 < steps.len() {
            logits = seq.step(token).unwrap();
        }
    }
    worst
}

fn cases() -> Vec<String> {
    let dir = root().join("tests/fixtures/generate");
    let mut cases: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            let case = name.strip_suffix(".logits.safetensors")?.to_string();
            Some(case)
        })
        .collect();
    cases.sort();
    assert!(Path::new(&dir).join("README.md").is_file());
    cases
}

#[test]
fn greedy_decoding_equals_transformers_generate() {
    let mut checked = 0;
    for case in cases() {
        let (golden, _) = golden(&case);
        if golden.edit.is_some() {
            continue;
        }
        let worst = decode_case(&case);
        println!("{case}: 40 tokens equal, logits within {worst:.1e} of the largest");
        checked += 1;
    }
    assert!(checked >= 30, "{checked} cases");
}
