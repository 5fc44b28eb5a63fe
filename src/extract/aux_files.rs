//! Tokenizer, generation config and chat template of the extracted model
//! (docs/commands/extract.md#what-is-written).
//!
//! Tokenizer files and `generation_config.json` are copied verbatim: the extracted embedding keeps
//! the VLM's rows, so the VLM's token ids (image tokens included) stay valid. Processor files and
//! remote code (`*.py`) are left behind. A `tokenizer_config.json` that points `AutoTokenizer` at
//! remote code gets the stock fast class instead. Tokenizers never read a processor's
//! `chat_template.json`, so when the tokenizer has no template of its own that file becomes
//! `chat_template.jinja`.

use serde_json::Value;

use crate::arch::families::Target;
use crate::checkpoint::output::OutputDir;
use crate::checkpoint::{read_json, Checkpoint, AUX_FILES};
use crate::error::Result;

/// Copied byte for byte when present: the files every output carries over, but for the two this
/// module rewrites.
fn verbatim() -> impl Iterator<Item = &'static str> {
    AUX_FILES
        .iter()
        .copied()
        .filter(|name| !matches!(*name, "tokenizer_config.json" | "chat_template.json"))
}

/// What was written, and where the chat template came from.
pub struct Aux {
    pub files: Vec<String>,
    pub chat_template: String,
    pub notes: Vec<String>,
}

pub fn copy(out: &OutputDir, ckpt: &Checkpoint, target: Target) -> Result<Aux> {
    let dir = &ckpt.dir;
    let mut aux = Aux {
        files: Vec::new(),
        chat_template: String::new(),
        notes: Vec::new(),
    };
    for name in verbatim() {
        let path = dir.join(name);
        if path.is_file() {
            out.copy_file(&path, name)?;
            aux.files.push(name.to_string());
        }
    }
    let mut inline_template = false;
    let tc_path = dir.join("tokenizer_config.json");
    if tc_path.is_file() {
        let mut tc = read_json(&tc_path)?;
        inline_template = tc.get("chat_template").is_some_and(|t| !t.is_null());
        let remote = tc
            .get("auto_map")
            .and_then(|m| m.get("AutoTokenizer"))
            .is_some();
        if remote {
            let stock = stock_tokenizer_class(target, dir.join("tokenizer.json").is_file())
                .ok_or_else(|| {
                    crate::bad!(
                        "{}: names a remote-code tokenizer (auto_map.AutoTokenizer) and there is no tokenizer.json to load with a stock class",
                        tc_path.display()
                    )
                })?;
            let old = tc
                .get("tokenizer_class")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string();
            let map = tc
                .as_object_mut()
                .expect("it has auto_map.AutoTokenizer, so it is an object");
            if let Some(Value::Object(auto)) = map.get_mut("auto_map") {
                auto.remove("AutoTokenizer");
                if auto.is_empty() {
                    map.remove("auto_map");
                }
            }
            map.insert("tokenizer_class".into(), Value::String(stock.into()));
            out.write_json("tokenizer_config.json", &tc)?;
            aux.notes.push(format!(
                "tokenizer_config.json: remote tokenizer class `{old}` replaced by the stock `{stock}` (its tokenizer.json is loaded as is)"
            ));
        } else {
            out.copy_file(&tc_path, "tokenizer_config.json")?;
        }
        aux.files.push("tokenizer_config.json".into());
    }
    let jinja = dir.join("chat_template.jinja").is_file();
    let processor = dir.join("chat_template.json");
    aux.chat_template = if jinja {
        "chat_template.jinja, copied".into()
    } else if inline_template {
        "tokenizer_config.json (inline), copied".into()
    } else if processor.is_file() {
        let template = read_json(&processor)?
            .get("chat_template")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| {
                crate::bad!(
                    "{}: expected {{\"chat_template\": \"...\"}}",
                    processor.display()
                )
            })?;
        out.write_file("chat_template.jinja", template.as_bytes())?;
        aux.files.push("chat_template.jinja".into());
        "chat_template.jinja, converted from the processor's chat_template.json (it may expect list-typed message content)".into()
    } else {
        "none (the VLM ships no chat template)".into()
    };
    if !aux
        .files
        .iter()
        .any(|f| f == "tokenizer.json" || f == "tokenizer.model" || f == "vocab.json")
    {
        aux.notes
            .push("no tokenizer files in the source directory; copy them by hand".into());
    }
    Ok(aux)
}

/// The stock tokenizer class that loads the copied `tokenizer.json`.
fn stock_tokenizer_class(target: Target, has_tokenizer_json: bool) -> Option<&'static str> {
    if !has_tokenizer_json {
        return None;
    }
    Some(match target {
        Target::Qwen2 | Target::Qwen3 | Target::Qwen3Moe => "Qwen2TokenizerFast",
        _ => "PreTrainedTokenizerFast",
    })
}
