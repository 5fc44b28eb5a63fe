//! Token ids of the scorer's tokenization against transformers' `AutoTokenizer` (add_special_tokens
//! = true) and `apply_chat_template(add_generation_prompt=True, tokenize=True)`, dumped by
//! `tools/gen_score_goldens.py` for every tokenizer flavour of the fixtures (Qwen, generic,
//! Llama-3 with its BOS; tokenizer-config and processor `chat_template.json` templates).

use serde_json::Value;
use sinkmerge::sink::tokenize::TextEncoder;

use crate::util::{read_json, root};

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn token_ids_match_transformers() {
    let path = root().join("tests/fixtures/score/tokenization.json");
    let golden: Value = read_json(path);
    let cases = golden["cases"].as_array().unwrap();
    assert!(cases.len() >= 30);
    let (mut plain, mut chat) = (0, 0);
    for case in cases {
        let fixture = case["fixture"].as_str().unwrap();
        let prompt = case["prompt"].as_str().unwrap();
        let dir = root().join("tests/fixtures/models").join(fixture);
        let encoder = TextEncoder::load(&dir, false).unwrap();
        assert_eq!(
            encoder.encode(prompt).unwrap(),
            ids(&case["ids"]),
            "{fixture}: {prompt:?}"
        );
        plain += 1;
        if !case["chat_ids"].is_null() {
            let encoder = TextEncoder::load(&dir, true).unwrap();
            assert_eq!(
                encoder.encode(prompt).unwrap(),
                ids(&case["chat_ids"]),
                "{fixture} (chat template): {prompt:?} rendered as {:?}",
                encoder.render(prompt).unwrap()
            );
            chat += 1;
        }
    }
    eprintln!("{plain} plain and {chat} chat-template encodings match transformers");
    assert!(chat >= 20);
}

#[test]
fn llama3_tokenizer_adds_its_bos() {
    let dir = root().join("tests/fixtures/models/llama31-tied");
    let ids = TextEncoder::load(&dir, false)
        .unwrap()
        .encode("hi")
        .unwrap();
    assert_eq!(ids[0], 304, "<|begin_of_text|>");
}

/// The bundled trained models' byte-level BPE tokenizer (written by `tools/train_tiny.py`) on the
/// 15 default calibration prompts, raw and through its chat template, against transformers'
/// `AutoTokenizer` (`tests/fixtures/goldens/tiny_default_prompt_ids.json`, from `train_tiny.py verify`).
#[test]
fn bundled_tokenizer_matches_transformers_on_the_default_prompts() {
    let path = root().join("tests/fixtures/goldens/tiny_default_prompt_ids.json");
    let golden: Value = read_json(path);
    let prompts = golden["prompts"].as_array().unwrap();
    assert_eq!(prompts.len(), 15);
    let defaults = sinkmerge::sink::prompts::default_prompts();
    for model in [
        "tiny-qwen2/ref",
        "tiny-qwen2/vl",
        "tiny-qwen3/ref",
        "tiny-qwen3/vl",
    ] {
        let dir = root().join("assets/models").join(model);
        let raw = TextEncoder::load(&dir, false).unwrap();
        let chat = TextEncoder::load(&dir, true).unwrap();
        for (i, prompt) in prompts.iter().enumerate() {
            let prompt = prompt.as_str().unwrap();
            assert_eq!(
                prompt, defaults[i],
                "the golden's prompts are assets/prompts/default.txt"
            );
            assert_eq!(
                raw.encode(prompt).unwrap(),
                ids(&golden["raw"][i]),
                "{model}: {prompt:?}"
            );
            assert_eq!(
                chat.render(prompt).unwrap(),
                golden["chat_template_text"][i].as_str().unwrap(),
                "{model} chat template text"
            );
            assert_eq!(
                chat.encode(prompt).unwrap(),
                ids(&golden["chat_template"][i]),
                "{model} (chat template): {prompt:?}"
            );
        }
    }
}
