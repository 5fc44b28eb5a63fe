//! Prompt text to token ids, as transformers' `AutoTokenizer` produces them.
//!
//! Plain prompts: `tokenizer.json` through Hugging Face's `tokenizers` crate with
//! `add_special_tokens = true`, so the tokenizer's own post-processor decides about BOS (Llama-3
//! adds `<|begin_of_text|>`, Qwen adds nothing). With a chat template: the template renders the
//! prompt as one user message with the generation prompt added, then the text is encoded without
//! adding special tokens again, which is what `apply_chat_template(tokenize=True)` does.

use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde_json::Value as Json;

use crate::error::Result;
use crate::{bad, bail};

/// Where a chat template came from; processor templates (`chat_template.json`) expect list
/// content (`[{"type": "text", "text": ...}]`), tokenizer templates a string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateSource {
    /// `chat_template.jinja` (transformers 5 saves it beside the tokenizer).
    JinjaFile,
    /// `chat_template` in `tokenizer_config.json`.
    TokenizerConfig,
    /// `chat_template.json` (a processor's template, as VLM repos ship it).
    ProcessorJson,
}

/// A model's tokenizer, optionally with its chat template.
pub struct TextEncoder {
    tokenizer: tokenizers::Tokenizer,
    path: PathBuf,
    chat: Option<ChatTemplate>,
}

struct ChatTemplate {
    source: String,
    /// Variables the template reads besides the messages (`generate --template-arg`), each
    /// checked to be one the template names.
    args: Vec<(String, Value)>,
    origin: TemplateSource,
    /// The file it came from, which errors name.
    file: PathBuf,
    /// bos_token, eos_token, ... as the template sees them.
    special_tokens: Vec<(String, String)>,
}

impl TextEncoder {
    /// Load `dir/tokenizer.json`, and the chat template too when `chat_template` is set.
    pub fn load(dir: &Path, chat_template: bool) -> Result<TextEncoder> {
        TextEncoder::with_template_of(dir, chat_template.then_some(dir))
    }

    /// Load `dir/tokenizer.json`, and with `template = Some(t)` the chat template (and the special
    /// tokens it sees) of the model in `t`: a VLM's language model can render prompts with its
    /// reference's template, so that both get the same token ids.
    pub fn with_template_of(dir: &Path, template: Option<&Path>) -> Result<TextEncoder> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            bail!(
                "{}: file is missing; the scorer tokenizes with the model's own tokenizer.json \
                 (slow-tokenizer-only repos need converting with transformers first)",
                path.display()
            );
        }
        let tokenizer = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| bad!("{}: not a valid tokenizer: {e}", path.display()))?;
        // A model with no vocabulary encodes text to nothing but the special tokens, and a
        // run over such prompts would measure nothing.
        if tokenizer.get_vocab_size(false) == 0 {
            bail!(
                "{}: the model's vocabulary (`model.vocab`) is empty",
                path.display()
            );
        }
        let chat = template.map(ChatTemplate::load).transpose()?;
        Ok(TextEncoder {
            tokenizer,
            path,
            chat,
        })
    }

    /// Token ids of one prompt.
    pub fn encode(&self, prompt: &str) -> Result<Vec<u32>> {
        let (text, add_special) = match &self.chat {
            Some(chat) => (chat.render(prompt)?, false),
            None => (prompt.to_string(), true),
        };
        let encoding = self
            .tokenizer
            .encode(text, add_special)
            .map_err(|e| bad!("{}: cannot encode a prompt: {e}", self.path.display()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Token ids of text already in its final form: chat-rendered (no special tokens added) or
    /// raw (the tokenizer's post-processor adds what it adds, as transformers' `tokenizer(text)`).
    pub fn encode_text(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let encoding = self
            .tokenizer
            .encode(text, add_special)
            .map_err(|e| bad!("{}: cannot encode a prompt: {e}", self.path.display()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids` as transformers' `tokenizer.decode(ids, skip_special_tokens=True)`.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| bad!("{}: cannot decode tokens: {e}", self.path.display()))
    }

    /// Give the chat template `args` (`KEY`, value) besides its messages, as
    /// `apply_chat_template(..., **kwargs)` does (Qwen3's `enable_thinking`). A key the template
    /// never reads is refused: it would change nothing, silently.
    pub fn set_template_args(&mut self, args: Vec<(String, serde_json::Value)>) -> Result<()> {
        let Some(chat) = &mut self.chat else {
            if let Some((key, _)) = args.first() {
                bail!("--template-arg {key}: templates are read with --chat only");
            }
            return Ok(());
        };
        let names = chat.variables()?;
        for (key, value) in args {
            if !names.contains(&key) {
                let mut known: Vec<&String> = names.iter().collect();
                known.sort();
                let known: Vec<&str> = known.iter().map(|s| s.as_str()).collect();
                bail!(
                    "--template-arg {key}: the chat template of {} reads no variable `{key}` \
                     (it reads {})",
                    chat.file.display(),
                    known.join(", ")
                );
            }
            chat.args.push((key, json_value(&value)));
        }
        Ok(())
    }

    /// The id of a token (an added special token such as `<|image_pad|>`), if the vocabulary
    /// has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Whether a chat template was loaded.
    pub fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }

    /// The chat rendering of a prompt whose `marker`s stand for images: one user message whose
    /// content items are the images and the text between them, in order, as a processor's
    /// `apply_chat_template` receives `{"type": "image"}` and `{"type": "text"}` items.
    pub fn render_with_images(&self, prompt: &str, marker: &str) -> Result<String> {
        let Some(chat) = &self.chat else {
            bail!("{}: no chat template loaded", self.path.display());
        };
        let mut items = Vec::new();
        for (i, text) in prompt.split(marker).enumerate() {
            if i > 0 {
                items.push(Value::from_pairs([("type", Value::from("image"))]));
            }
            if !text.is_empty() {
                items.push(Value::from_pairs([
                    ("type", Value::from("text")),
                    ("text", Value::from(text)),
                ]));
            }
        }
        chat.render_content(Value::from(items), prompt.len())
    }

    /// The rendered chat text of a prompt (for `--chat-template`), or the prompt itself.
    pub fn render(&self, prompt: &str) -> Result<String> {
        match &self.chat {
            Some(chat) => chat.render(prompt),
            None => Ok(prompt.to_string()),
        }
    }
}

/// The work (minijinja fuel: about one instruction, or 64 bytes of data made) a chat template may
/// do to render one prompt, besides one fuel per byte of the prompt. Measured on a 100-byte
/// prompt, Qwen3's, Llama 3.1's, Qwen2.5-VL's and InternVL's templates spend 50 to 125, and on a
/// long one at most one per 13 bytes: this is 10^4 times the first and 13 times the second. A
/// template that loops without end stops within a fraction of a second, having made at most
/// about 64 bytes per fuel (docs/reference/sink-metrics.md, "Chat templates").
const TEMPLATE_FUEL: u64 = 1_000_000;

/// The special-token attributes transformers passes to chat templates.
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

fn read_json(path: &Path) -> Result<Option<Json>> {
    if !path.is_file() {
        return Ok(None);
    }
    crate::checkpoint::read_json(path).map(Some)
}

/// A special token as tokenizer_config.json spells it: a string or `{"content": ...}`.
fn token_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(m) => m.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

impl ChatTemplate {
    fn load(dir: &Path) -> Result<ChatTemplate> {
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json(&config_path)?;
        let mut special_tokens = Vec::new();
        let special_map = read_json(&dir.join("special_tokens_map.json"))?;
        for key in SPECIAL_TOKEN_KEYS {
            let value = config
                .as_ref()
                .and_then(|c| c.get(key))
                .and_then(token_text)
                .or_else(|| {
                    special_map
                        .as_ref()
                        .and_then(|m| m.get(key))
                        .and_then(token_text)
                });
            if let Some(v) = value {
                special_tokens.push((key.to_string(), v));
            }
        }
        let jinja = dir.join("chat_template.jinja");
        let processor_json = dir.join("chat_template.json");
        let (source, origin, file) = if jinja.is_file() {
            let text = std::fs::read_to_string(&jinja)
                .map_err(|e| crate::error::Error::read(&jinja, e))?;
            (text, TemplateSource::JinjaFile, jinja)
        } else if let Some(t) = config
            .as_ref()
            .and_then(|c| c.get("chat_template"))
            .filter(|t| !t.is_null())
        {
            (
                template_text(t).ok_or_else(|| {
                    bad!(
                        "{}: `chat_template` is neither a string nor a list with a \"default\" template",
                        config_path.display()
                    )
                })?,
                TemplateSource::TokenizerConfig,
                config_path,
            )
        } else if let Some(t) = read_json(&processor_json)? {
            let text = t
                .get("chat_template")
                .and_then(template_text)
                .ok_or_else(|| bad!("{}: no `chat_template` string", processor_json.display()))?;
            (text, TemplateSource::ProcessorJson, processor_json)
        } else {
            bail!(
                "{}: --chat-template was given but the model has no chat template \
                 (none in tokenizer_config.json, chat_template.jinja or chat_template.json)",
                dir.display()
            );
        };
        let template = ChatTemplate {
            source,
            args: Vec::new(),
            origin,
            file,
            special_tokens,
        };
        // Fail on a broken template now, not in the middle of scoring.
        template.render("test")?;
        Ok(template)
    }

    /// The variables the template reads from its context.
    fn variables(&self) -> Result<std::collections::HashSet<String>> {
        let env = Environment::new();
        let template = env.template_from_str(&self.source).map_err(|e| {
            bad!(
                "{}: the chat template does not parse: {e}",
                self.file.display()
            )
        })?;
        Ok(template.undeclared_variables(false))
    }

    fn render(&self, prompt: &str) -> Result<String> {
        let content = if self.origin == TemplateSource::ProcessorJson {
            Value::from(vec![Value::from_pairs([
                ("type", Value::from("text")),
                ("text", Value::from(prompt)),
            ])])
        } else {
            Value::from(prompt)
        };
        self.render_content(content, prompt.len())
    }

    /// One user message of `content` (a string, or a list of content items), with the
    /// generation prompt, within [`TEMPLATE_FUEL`] and one fuel per byte of `prompt_bytes`.
    fn render_content(&self, content: Value, prompt_bytes: usize) -> Result<String> {
        let file = self.file.display();
        let budget = TEMPLATE_FUEL.saturating_add(prompt_bytes as u64);
        let mut env = Environment::new();
        env.set_fuel(Some(budget));
        let syntax = env
            .syntax()
            .to_builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| bad!("{file}: chat template: {e}"))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<Value, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        env.add_filter("tojson", tojson);
        let template = env
            .template_from_str(&self.source)
            .map_err(|e| bad!("{file}: the chat template does not parse: {e}"))?;
        let message = Value::from_pairs([("role", Value::from("user")), ("content", content)]);
        let mut ctx: Vec<(String, Value)> = vec![
            ("messages".into(), Value::from(vec![message])),
            ("add_generation_prompt".into(), Value::from(true)),
            ("tools".into(), Value::from(())),
            ("documents".into(), Value::from(())),
        ];
        for (k, v) in &self.special_tokens {
            ctx.push((k.clone(), Value::from(v.as_str())));
        }
        ctx.extend(self.args.iter().cloned());
        template
            .render(Value::from_pairs(ctx))
            .map_err(|e| match e.kind() {
                ErrorKind::OutOfFuel => bad!(
                    "{file}: the chat template did not finish within its budget of {budget} \
                     steps (minijinja fuel); a real template renders a prompt in a few hundred"
                ),
                _ => bad!("{file}: the chat template failed to render: {e}"),
            })
    }
}

/// A JSON value as the template sees it.
fn json_value(v: &Json) -> Value {
    match v {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => match n.as_i64() {
            Some(i) => Value::from(i),
            None => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => Value::from(items.iter().map(json_value).collect::<Vec<_>>()),
        Json::Object(map) => {
            Value::from_pairs(map.iter().map(|(k, v)| (k.as_str(), json_value(v))))
        }
    }
}

/// The template text of a `chat_template` entry: a string, or the "default" of a named list.
fn template_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Json::as_str)
            .map(str::to_string),
        _ => None,
    }
}

/// transformers' `tojson` filter: Python's `json.dumps` (", " and ": " separators, non-ASCII
/// kept, optional `indent` and `sort_keys`), not minijinja's HTML-safe variant.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    python_json(&json, indent, sort_keys.unwrap_or(false), 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn python_json(v: &Json, indent: Option<usize>, sort: bool, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                python_json(item, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            let mut entries: Vec<(&String, &Json)> = map.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&Json::String(k.clone()).to_string());
                out.push_str(": ");
                python_json(item, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        other => out.push_str(&other.to_string()),
    }
}

/// `strftime_now(format)` as transformers provides it (local time there; UTC here, the one clock
/// every machine agrees on). Supports the directives chat templates use.
fn strftime_now(format: &str) -> Result<String, JinjaError> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(strftime(secs, format))
}

/// Format Unix time `secs` (UTC) with a strftime subset: %Y %y %m %B %b %d %e %A %a %H %M %S %j %%.
fn strftime(secs: u64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_march = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_march + 2) / 153;
    let day = doy_march - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][(month - 1) as usize];
    let yday = before + day + i64::from(leap && month > 2);
    let weekday = DAYS[(days.rem_euclid(7)) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(strftime(t, "%d %b %Y"), "29 Feb 2024");
        assert_eq!(
            strftime(t, "%A %B %e, %H:%M:%S %j %y %%"),
            "Thursday February 29, 13:05:09 060 24 %"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %a"), "1970-01-01 Thu");
    }

    #[test]
    fn tojson_writes_python_json() {
        let mut out = String::new();
        python_json(
            &serde_json::json!({"b": [1, "é"], "a": {"x": true}}),
            None,
            false,
            0,
            &mut out,
        );
        assert_eq!(out, r#"{"b": [1, "é"], "a": {"x": true}}"#);
        let mut out = String::new();
        python_json(
            &serde_json::json!({"b": 1, "a": [2]}),
            Some(2),
            true,
            0,
            &mut out,
        );
        assert_eq!(out, "{\n  \"a\": [\n    2\n  ],\n  \"b\": 1\n}");
    }

    /// The budget grows with the prompt: the fixtures' templates (a tokenizer's and a processor's)
    /// render a 5 MiB prompt, whose bytes alone are five times the fixed budget.
    #[test]
    fn long_prompts_render_within_the_budget() {
        let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
        let prompt = "word ".repeat(1 << 20);
        assert!(prompt.len() as u64 > 5 * TEMPLATE_FUEL);
        for model in ["qwen3", "qwen2_5_vl"] {
            let encoder = TextEncoder::load(&models.join(model), true).unwrap();
            let text = encoder.render(&prompt).unwrap();
            assert!(text.contains(&prompt), "{model}");
        }
    }
}
