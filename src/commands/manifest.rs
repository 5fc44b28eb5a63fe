//! Manifests: one JSON object a line, each an image prompt (docs/reference/visual-sinks.md, "The
//! manifest"). One schema for every command that reads manifests, extended by adding fields; a
//! key outside it is an error naming the line, so that a misspelt key (`Box` for `box`) is never
//! dropped in silence.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::error::Result;
use crate::input;
use crate::{bad, bail};

/// One manifest line as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Line {
    /// The image, or the images of a multi-image `prompt`.
    pub image: Images,
    /// A question, rendered with the chat template after the image.
    pub question: Option<String>,
    /// A raw prompt with an `<image>` marker per image.
    pub prompt: Option<String>,
    /// The target box `[x0, y0, x1, y1]` in the image's pixels.
    #[serde(rename = "box")]
    pub target_box: Option<[f64; 4]>,
    /// The processor's output as a safetensors file, as `--pixel-values` takes it.
    pub pixel_values: Option<PathBuf>,
    /// The expected answer: free text, or one of `options` (its text or letter).
    pub answer: Option<String>,
    /// A multiple-choice question's options (`docs/reference/answers.md`).
    #[serde(default)]
    pub options: Vec<String>,
}

/// `image`: one path or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "`image` must be a path or a list of paths")]
pub enum Images {
    One(PathBuf),
    Many(Vec<PathBuf>),
}

/// A line with its paths resolved against the manifest's folder and where it came from.
#[derive(Debug, Clone)]
pub struct Entry {
    /// `FILE:LINE`, for messages.
    pub origin: String,
    pub images: Vec<PathBuf>,
    /// The text and whether it is a question (chat template) rather than a raw prompt.
    pub text: String,
    pub chat: bool,
    pub target_box: Option<[f64; 4]>,
    pub pixel_values: Option<PathBuf>,
    /// The expected answer and a multiple-choice question's options, as written.
    pub answer: Option<String>,
    pub options: Vec<String>,
}

/// Every line of the manifest at `path` (`-`: standard input, paths then relative to the current
/// directory), checked against the schema; blank lines are skipped.
pub fn read(path: &Path) -> Result<Vec<Entry>> {
    let text = input::read_stream_text(path, input::MANIFEST)?;
    let shown = input::shown(path).display().to_string();
    let dir = match input::is_stdin(path) {
        true => Path::new(""),
        false => path.parent().unwrap_or(Path::new("")),
    };
    let mut entries = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let origin = format!("{shown}:{}", n + 1);
        let value: Value =
            serde_json::from_str(line).map_err(|e| bad!("{origin}: not a JSON object: {e}"))?;
        if !value.is_object() {
            bail!("{origin}: not a JSON object");
        }
        let line: Line = serde_json::from_value(value).map_err(|e| bad!("{origin}: {e}"))?;
        let (text, chat) = match (line.question, line.prompt) {
            (Some(q), None) => (q, true),
            (None, Some(p)) => (p, false),
            _ => bail!("{origin}: give exactly one of `question` and `prompt`"),
        };
        let images = match line.image {
            Images::One(p) => vec![p],
            Images::Many(v) => v,
        };
        entries.push(Entry {
            origin,
            images: images.iter().map(|p| dir.join(p)).collect(),
            text,
            chat,
            target_box: line.target_box,
            pixel_values: line.pixel_values.map(|p| dir.join(p)),
            answer: line.answer,
            options: line.options,
        });
    }
    if entries.is_empty() {
        bail!("{shown}: the manifest has no lines");
    }
    Ok(entries)
}
