//! The generation settings: the model's `generation_config.json`, the command's flags over it,
//! and transformers' defaults under both, resolved as `generate` resolves them
//! (`generation/utils.py`, `GenerationMixin._prepare_generation_config`: flags over the model's
//! file over `GenerationConfig._get_default_generation_params()`). Each resolved value records
//! where it came from, so a report can say which settings were used and why.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Map, Value};

use crate::error::Result;
use crate::{bad, bail};

/// The file a model directory's generation settings are read from.
pub const FILE: &str = "generation_config.json";

/// transformers' defaults (`generation/configuration_utils.py`,
/// `GenerationConfig._get_default_generation_params`): greedy, and the sampling values that apply
/// once `do_sample` is set.
const DEFAULT_DO_SAMPLE: bool = false;
const DEFAULT_TEMPERATURE: f64 = 1.0;
const DEFAULT_TOP_K: u64 = 50;
const DEFAULT_TOP_P: f64 = 1.0;
const DEFAULT_REPETITION_PENALTY: f64 = 1.0;
/// The default `max_length`, which `_prepare_generated_length` reads as 20 new tokens.
const DEFAULT_MAX_LENGTH: usize = 20;

/// The most tokens a length setting may name: past any model's context window (16M tokens), so a
/// hostile file cannot ask for an unbounded run or cache.
pub const MAX_TOKENS: usize = 1 << 24;

/// Where a resolved value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Source {
    /// The model's `generation_config.json`.
    #[serde(rename = "generation_config.json")]
    File,
    /// A command-line flag.
    #[serde(rename = "flag")]
    Flag,
    /// transformers' default, the key being absent (or null) in the file and not given as a flag.
    #[serde(rename = "transformers default")]
    Default,
    /// The model's `config.json`, which transformers reads when there is no
    /// `generation_config.json` (`GenerationConfig.from_model_config`).
    #[serde(rename = "config.json")]
    ModelConfig,
}

/// A resolved value and where it came from; in JSON `{"value": ..., "source": ...}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Setting<T> {
    pub value: T,
    pub source: Source,
}

/// The keys of a model's `generation_config.json` that `generate` uses; `None` where the key is
/// absent or null, which transformers reads as unset (its default then applies).
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationConfig {
    /// The file, read or absent, for messages.
    path: PathBuf,
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    /// 0 turns top-k off (`_get_logits_processor` skips it).
    pub top_k: Option<u64>,
    pub top_p: Option<f64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// One id or several; a single int in the file reads as a list of one.
    pub eos_token_id: Option<Vec<u32>>,
    pub max_new_tokens: Option<usize>,
    pub max_length: Option<usize>,
}

/// The command's flags over the model's file; `None` where not given.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    /// `Some(true)` for `--do-sample`, `Some(false)` for `--greedy`.
    pub do_sample: Option<bool>,
    pub temperature: Option<f64>,
    pub top_k: Option<u64>,
    pub top_p: Option<f64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub max_new_tokens: Option<usize>,
}

/// The settings a generation runs with, each with its source.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Settings {
    pub do_sample: Setting<bool>,
    pub temperature: Setting<f64>,
    /// 0: top-k off.
    pub top_k: Setting<u64>,
    pub top_p: Setting<f64>,
    /// `None`: min-p off (transformers' default).
    pub min_p: Setting<Option<f64>>,
    pub repetition_penalty: Setting<f64>,
    /// Empty: no end-of-sequence token, generation runs to its length.
    pub eos_token_id: Setting<Vec<u32>>,
    pub max_new_tokens: Setting<Option<usize>>,
    pub max_length: Setting<usize>,
}

impl GenerationConfig {
    /// `dir/generation_config.json`; transformers' defaults (every key unset) when the file is
    /// absent. A file that is not a JSON object, or a key of the wrong type or out of its range,
    /// is bad input naming the file and the key.
    pub fn read(dir: &Path) -> Result<GenerationConfig> {
        let path = dir.join(FILE);
        let unset = GenerationConfig {
            path: path.clone(),
            do_sample: None,
            temperature: None,
            top_k: None,
            top_p: None,
            min_p: None,
            repetition_penalty: None,
            eos_token_id: None,
            max_new_tokens: None,
            max_length: None,
        };
        // Only absence means defaults: a directory or a link to a device at this path is refused
        // by `input::read`.
        if std::fs::symlink_metadata(&path).is_err() {
            return Ok(unset);
        }
        let bytes = crate::input::read(&path, crate::input::GENERATION_CONFIG)?;
        let value: Value = serde_json::from_slice(&bytes)
            .map_err(|e| bad!("{}: not valid JSON: {e}", path.display()))?;
        let Value::Object(map) = value else {
            bail!("{}: not a JSON object", path.display());
        };
        let key = Key {
            map: &map,
            path: &path,
        };
        let at = |k: &str| Where::File(&path, k.to_string());
        Ok(GenerationConfig {
            do_sample: key.bool("do_sample")?,
            temperature: key
                .number("temperature")?
                .map(|v| check_temperature(v, &at("temperature")))
                .transpose()?,
            top_k: key.count("top_k")?,
            top_p: key
                .number("top_p")?
                .map(|v| check_unit("top_p", v, &at("top_p")))
                .transpose()?,
            min_p: key
                .number("min_p")?
                .map(|v| check_unit("min_p", v, &at("min_p")))
                .transpose()?,
            repetition_penalty: key
                .number("repetition_penalty")?
                .map(|v| check_penalty(v, &at("repetition_penalty")))
                .transpose()?,
            eos_token_id: key.eos("eos_token_id")?,
            max_new_tokens: key
                .count("max_new_tokens")?
                .map(|v| check_new_tokens(v, &at("max_new_tokens")))
                .transpose()?,
            max_length: key
                .count("max_length")?
                .map(|v| check_tokens(v, &at("max_length")))
                .transpose()?,
            ..unset
        })
    }

    /// The settings used: each flag over the file over transformers' default, checked as
    /// transformers checks them when it builds the processors (`TemperatureLogitsWarper` needs a
    /// temperature > 0 once sampling; the ranges of the others hold whatever the mode).
    pub fn with(self, flags: &Overrides) -> Result<Settings> {
        let flag = |k: &str| Where::Flag(k.to_string());
        let temperature = flags
            .temperature
            .map(|v| check_temperature(v, &flag("temperature")))
            .transpose()?;
        let top_p = flags
            .top_p
            .map(|v| check_unit("top_p", v, &flag("top_p")))
            .transpose()?;
        let min_p = flags
            .min_p
            .map(|v| check_unit("min_p", v, &flag("min_p")))
            .transpose()?;
        let repetition_penalty = flags
            .repetition_penalty
            .map(|v| check_penalty(v, &flag("repetition_penalty")))
            .transpose()?;
        let max_new_tokens = flags
            .max_new_tokens
            .map(|v| check_new_tokens(v as u64, &flag("max_new_tokens")))
            .transpose()?;
        let settings = Settings {
            do_sample: pick(flags.do_sample, self.do_sample, DEFAULT_DO_SAMPLE),
            temperature: pick(temperature, self.temperature, DEFAULT_TEMPERATURE),
            top_k: pick(flags.top_k, self.top_k, DEFAULT_TOP_K),
            top_p: pick(top_p, self.top_p, DEFAULT_TOP_P),
            min_p: pick(min_p.map(Some), self.min_p.map(Some), None),
            repetition_penalty: pick(
                repetition_penalty,
                self.repetition_penalty,
                DEFAULT_REPETITION_PENALTY,
            ),
            eos_token_id: pick(None, self.eos_token_id, Vec::new()),
            max_new_tokens: pick(
                max_new_tokens.map(Some),
                self.max_new_tokens.map(Some),
                None,
            ),
            max_length: pick(None, self.max_length, DEFAULT_MAX_LENGTH),
        };
        if settings.do_sample.value && settings.temperature.value <= 0.0 {
            let from = match settings.temperature.source {
                Source::Flag => "--temperature".to_string(),
                _ => format!("`temperature` in {}", self.path.display()),
            };
            bail!(
                "{from} is {}: sampling needs a temperature > 0 (transformers' \
                 TemperatureLogitsWarper); for greedy decoding use --greedy",
                settings.temperature.value
            );
        }
        Ok(settings)
    }
}

impl Settings {
    /// Take the end-of-sequence ids of the model's `config.json` (an id or a list, at the top or
    /// in `text_config`) when neither the file nor a flag gave any, as transformers does.
    pub fn with_model_eos(mut self, config: &serde_json::Value) -> Settings {
        if self.eos_token_id.source != Source::Default {
            return self;
        }
        let value = config
            .get("eos_token_id")
            .or_else(|| config.pointer("/text_config/eos_token_id"));
        let ids: Option<Vec<u32>> = match value {
            Some(serde_json::Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]),
            Some(serde_json::Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect(),
            _ => None,
        };
        if let Some(ids) = ids.filter(|ids| !ids.is_empty()) {
            self.eos_token_id = Setting {
                value: ids,
                source: Source::ModelConfig,
            };
        }
        self
    }

    /// How many tokens to generate after a prompt of `prompt_len` tokens, as
    /// `generation/utils.py`'s `_prepare_generated_length` and `_validate_generated_length`
    /// decide: `max_new_tokens` when set (flag or file); else, when the file sets `max_length`,
    /// `max_length - prompt_len`; else (transformers' default `max_length` of 20) 20 new tokens,
    /// the total capped at the model's `max_position_embeddings` when it has one. A prompt that
    /// leaves no room is an error, as in transformers.
    pub fn max_new_tokens(
        &self,
        prompt_len: usize,
        max_position_embeddings: Option<usize>,
    ) -> Result<usize> {
        let max_length = match (self.max_new_tokens.value, self.max_length.source) {
            (Some(n), _) => n.saturating_add(prompt_len),
            (None, Source::Default) => {
                let total = self.max_length.value.saturating_add(prompt_len);
                max_position_embeddings.map_or(total, |m| total.min(m))
            }
            (None, _) => self.max_length.value,
        };
        if prompt_len >= max_length {
            bail!(
                "the prompt is {prompt_len} tokens, but `max_length` is {max_length} ({}): nothing \
                 is left to generate; set --max-new-tokens",
                match self.max_length.source {
                    Source::Default => "transformers' default of 20 new tokens, capped at the \
                                        model's max_position_embeddings"
                        .to_string(),
                    _ => format!("from {FILE}"),
                }
            );
        }
        Ok(max_length - prompt_len)
    }
}

/// The flag, else the file's value, else the default, with its source.
fn pick<T>(flag: Option<T>, file: Option<T>, default: T) -> Setting<T> {
    match (flag, file) {
        (Some(value), _) => Setting {
            value,
            source: Source::Flag,
        },
        (None, Some(value)) => Setting {
            value,
            source: Source::File,
        },
        (None, None) => Setting {
            value: default,
            source: Source::Default,
        },
    }
}

/// Where a value was given, for messages: a key of the file, or a flag.
enum Where<'a> {
    File(&'a Path, String),
    Flag(String),
}

impl Where<'_> {
    fn refuse(&self, value: impl std::fmt::Display, why: &str) -> crate::error::Error {
        match self {
            Where::File(path, key) => bad!("{}: `{key}` is {value}; {why}", path.display()),
            Where::Flag(key) => bad!("--{} {value}: {why}", key.replace('_', "-")),
        }
    }
}

// The ranges are the ones transformers' processors check when they are built
// (`generation/logits_process.py`): a value out of range is refused even where the mode would not
// build its processor, since a file or flag that holds one is a mistake either way. A temperature
// of 0 passes here: greedy configs carry it, and `with` refuses it once sampling.
fn check_temperature(v: f64, at: &Where) -> Result<f64> {
    if !(v.is_finite() && v >= 0.0) {
        return Err(at.refuse(v, "the temperature must be a finite number >= 0"));
    }
    Ok(v)
}

/// `TopPLogitsWarper` and `MinPLogitsWarper` both take [0, 1].
fn check_unit(name: &str, v: f64, at: &Where) -> Result<f64> {
    if !(0.0..=1.0).contains(&v) {
        return Err(at.refuse(v, &format!("{name} must be in [0, 1]")));
    }
    Ok(v)
}

/// `RepetitionPenaltyLogitsProcessor`: strictly positive.
fn check_penalty(v: f64, at: &Where) -> Result<f64> {
    if !(v.is_finite() && v > 0.0) {
        return Err(at.refuse(v, "the repetition penalty must be a finite number > 0"));
    }
    Ok(v)
}

/// `GenerationConfig.validate`: `max_new_tokens` must be greater than 0.
fn check_new_tokens(v: u64, at: &Where) -> Result<usize> {
    if v == 0 {
        return Err(at.refuse(v, "max_new_tokens must be at least 1"));
    }
    check_tokens(v, at)
}

fn check_tokens(v: u64, at: &Where) -> Result<usize> {
    match usize::try_from(v) {
        Ok(n) if n <= MAX_TOKENS => Ok(n),
        _ => Err(at.refuse(v, &format!("at most {MAX_TOKENS} tokens are generated"))),
    }
}

/// Typed reads of the file's keys; absent and null are `None`.
struct Key<'a> {
    map: &'a Map<String, Value>,
    path: &'a Path,
}

impl Key<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn wrong(&self, key: &str, value: &Value, what: &str) -> crate::error::Error {
        Where::File(self.path, key.to_string()).refuse(value, &format!("it must be {what}"))
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| self.wrong(key, v, "true or false"))
            })
            .transpose()
    }

    fn number(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.wrong(key, v, "a number")))
            .transpose()
    }

    fn count(&self, key: &str) -> Result<Option<u64>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.wrong(key, v, "an integer >= 0"))
            })
            .transpose()
    }

    /// An id or a list of ids (`_prepare_special_tokens` makes a 1-D tensor of either).
    fn eos(&self, key: &str) -> Result<Option<Vec<u32>>> {
        let id = |v: &Value| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| self.wrong(key, v, "a token id or a list of token ids"))
        };
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(ids)) => ids.iter().map(id).collect::<Result<_>>().map(Some),
            Some(v) => Ok(Some(vec![id(v)?])),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(json: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FILE), json).unwrap();
        dir
    }

    fn read(json: &str) -> Result<GenerationConfig> {
        GenerationConfig::read(dir_with(json).path())
    }

    #[test]
    fn without_a_file_the_settings_are_transformers_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let settings = (GenerationConfig::read(dir.path()).unwrap())
            .with(&Overrides::default())
            .unwrap();
        assert!(!settings.do_sample.value);
        assert_eq!(settings.temperature.value, 1.0);
        assert_eq!(settings.top_k.value, 50);
        assert_eq!(settings.top_p.value, 1.0);
        assert_eq!(settings.min_p.value, None);
        assert_eq!(settings.repetition_penalty.value, 1.0);
        assert!(settings.eos_token_id.value.is_empty());
        assert_eq!(settings.top_k.source, Source::Default);
        // transformers' default max_length of 20 is 20 new tokens, capped by the context.
        assert_eq!(settings.max_new_tokens(7, None).unwrap(), 20);
        assert_eq!(settings.max_new_tokens(7, Some(16)).unwrap(), 9);
        assert!(settings.max_new_tokens(16, Some(16)).is_err());
        let json = serde_json::to_value(&settings).unwrap();
        assert_eq!(json["top_k"]["source"], "transformers default");
        assert_eq!(json["top_k"]["value"], 50);
    }

    #[test]
    fn eos_is_an_id_a_list_or_null() {
        assert_eq!(
            read(r#"{"eos_token_id": 2}"#).unwrap().eos_token_id,
            Some(vec![2])
        );
        let list = read(r#"{"eos_token_id": [1, 106]}"#).unwrap();
        assert_eq!(list.eos_token_id, Some(vec![1, 106]));
        let settings = list.with(&Overrides::default()).unwrap();
        assert_eq!(settings.eos_token_id.source, Source::File);
        let null = read(r#"{"eos_token_id": null, "temperature": null}"#).unwrap();
        assert_eq!((null.eos_token_id, null.temperature), (None, None));
    }

    #[test]
    fn bad_files_name_the_file_and_the_key() {
        for (json, key) in [
            (r#"{"temperature": "hot"}"#, "`temperature`"),
            (r#"{"temperature": -0.5}"#, "`temperature`"),
            (r#"{"top_p": 1.5}"#, "`top_p`"),
            (r#"{"top_p": -0.1}"#, "`top_p`"),
            (r#"{"min_p": 2}"#, "`min_p`"),
            (r#"{"top_k": -1}"#, "`top_k`"),
            (r#"{"top_k": 2.5}"#, "`top_k`"),
            (r#"{"repetition_penalty": 0}"#, "`repetition_penalty`"),
            (r#"{"do_sample": "yes"}"#, "`do_sample`"),
            (r#"{"eos_token_id": "</s>"}"#, "`eos_token_id`"),
            (r#"{"eos_token_id": [2, -1]}"#, "`eos_token_id`"),
            (r#"{"eos_token_id": 4294967296}"#, "`eos_token_id`"),
            (r#"{"max_new_tokens": 0}"#, "`max_new_tokens`"),
            (r#"{"max_length": 1e9}"#, "`max_length`"),
            (r#"{"max_length": 100000000000}"#, "`max_length`"),
            ("[1, 2]", "not a JSON object"),
            ("{\"top_k\": 5,", "not valid JSON"),
            ("{\"temperature\": NaN}", "not valid JSON"),
        ] {
            let err = read(json).unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains(FILE) && msg.contains(key), "{json}: {msg}");
            assert_eq!(err.exit_code(), 2, "{json}");
        }
        // Not a file: refused by input::read, not taken for an absent one.
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(FILE)).unwrap();
        let msg = GenerationConfig::read(dir.path()).unwrap_err().to_string();
        assert!(msg.contains("a directory"), "{msg}");
    }

    #[test]
    fn flags_override_the_file_both_ways() {
        let sampling = r#"{"do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                          "eos_token_id": [151645, 151643], "max_length": 64}"#;
        // --greedy on a sampling config: the sampling values stay recorded, unused.
        let greedy = (read(sampling).unwrap())
            .with(&Overrides {
                do_sample: Some(false),
                ..Overrides::default()
            })
            .unwrap();
        assert!(!greedy.do_sample.value);
        assert_eq!(greedy.do_sample.source, Source::Flag);
        assert_eq!(greedy.temperature.value, 0.6);
        assert_eq!(greedy.temperature.source, Source::File);
        // The file's max_length counts the prompt.
        assert_eq!(greedy.max_new_tokens(10, Some(32)).unwrap(), 54);
        assert!(greedy.max_new_tokens(64, None).is_err());
        // --do-sample on a greedy config, with the file's temperature and a flag's top_p.
        let sampled = (read(r#"{"do_sample": false, "temperature": 0.7}"#).unwrap())
            .with(&Overrides {
                do_sample: Some(true),
                top_p: Some(0.5),
                max_new_tokens: Some(5),
                ..Overrides::default()
            })
            .unwrap();
        assert!(sampled.do_sample.value);
        assert_eq!(sampled.temperature.value, 0.7);
        assert_eq!(
            (sampled.top_p.value, sampled.top_p.source),
            (0.5, Source::Flag)
        );
        assert_eq!(
            (sampled.top_k.value, sampled.top_k.source),
            (50, Source::Default)
        );
        assert_eq!(sampled.max_new_tokens(1000, Some(16)).unwrap(), 5);
        let json = serde_json::to_value(&sampled).unwrap();
        assert_eq!(json["temperature"]["source"], "generation_config.json");
        assert_eq!(json["top_p"]["source"], "flag");
        // The file's max_new_tokens wins over its max_length.
        let both = (read(r#"{"max_new_tokens": 8, "max_length": 4}"#).unwrap())
            .with(&Overrides::default())
            .unwrap();
        assert_eq!(both.max_new_tokens(100, None).unwrap(), 8);
    }

    #[test]
    fn bad_values_are_refused_as_transformers_refuses_them() {
        let dir = dir_with(r#"{"temperature": 0.0}"#);
        // A temperature of 0 is a greedy config's; sampling with it is an error.
        let config = GenerationConfig::read(dir.path()).unwrap();
        assert!(config.clone().with(&Overrides::default()).is_ok());
        let msg = (config.with(&Overrides {
            do_sample: Some(true),
            ..Overrides::default()
        }))
        .unwrap_err()
        .to_string();
        assert!(msg.contains(FILE) && msg.contains("`temperature`"), "{msg}");
        for (flags, named) in [
            (
                Overrides {
                    do_sample: Some(true),
                    temperature: Some(0.0),
                    ..Overrides::default()
                },
                "--temperature",
            ),
            (
                Overrides {
                    temperature: Some(f64::NAN),
                    ..Overrides::default()
                },
                "--temperature",
            ),
            (
                Overrides {
                    top_p: Some(1.01),
                    ..Overrides::default()
                },
                "--top-p",
            ),
            (
                Overrides {
                    min_p: Some(-0.1),
                    ..Overrides::default()
                },
                "--min-p",
            ),
            (
                Overrides {
                    repetition_penalty: Some(0.0),
                    ..Overrides::default()
                },
                "--repetition-penalty",
            ),
            (
                Overrides {
                    max_new_tokens: Some(0),
                    ..Overrides::default()
                },
                "--max-new-tokens",
            ),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let err = (GenerationConfig::read(dir.path()).unwrap())
                .with(&flags)
                .unwrap_err();
            assert!(err.to_string().contains(named), "{flags:?}: {err}");
            assert_eq!(err.exit_code(), 2);
        }
    }
}
