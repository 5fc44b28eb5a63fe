//! The one `--layers` syntax of every command: comma-separated parts, each a layer `7`, an
//! inclusive range `0-3`, or a half-open slice `20:28` (Python's: 20 through 27), whose ends may
//! be left open (`20:` through the last layer, `:4` from layer 0). Parsed when the command line
//! is read, resolved once the model's layer count is known.

use std::str::FromStr;

use crate::error::{Error, Result};
use crate::{bad, bail};

/// A parsed `--layers` value, not yet checked against a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerList {
    /// The text as given, for messages and replay commands.
    text: String,
    parts: Vec<Part>,
}

/// One comma-separated part: layers `first..=last`, `last` `None` for through the last layer.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Part {
    text: String,
    first: usize,
    last: Option<usize>,
}

impl FromStr for LayerList {
    type Err = Error;

    fn from_str(text: &str) -> Result<LayerList> {
        let mut parts = Vec::new();
        for part in text.split(',').map(str::trim) {
            if part.is_empty() {
                bail!("--layers {text}: an empty item; list layers as 0-3,7");
            }
            let index = |s: &str| {
                s.trim().parse::<usize>().map_err(|_| {
                    bad!(
                        "--layers: `{part}` is not a layer index, a range like 0-3 or a slice \
                         like 0:4 (or 4:, :4)"
                    )
                })
            };
            let (first, last) = if let Some((a, b)) = part.split_once('-') {
                (index(a)?, Some(index(b)?))
            } else if let Some((a, b)) = part.split_once(':') {
                let first = if a.trim().is_empty() { 0 } else { index(a)? };
                if b.trim().is_empty() {
                    (first, None)
                } else {
                    let end = index(b)?;
                    if end <= first {
                        bail!("--layers: `{part}` is empty");
                    }
                    (first, Some(end - 1))
                }
            } else {
                (index(part)?, Some(index(part)?))
            };
            if last.is_some_and(|l| l < first) {
                bail!("--layers: `{part}` is empty");
            }
            parts.push(Part {
                text: part.to_string(),
                first,
                last,
            });
        }
        Ok(LayerList {
            text: text.to_string(),
            parts,
        })
    }
}

impl LayerList {
    /// The selected layers of a model with `num_layers` layers, sorted, without repeats; errors
    /// for a part outside the model.
    pub fn resolve(&self, num_layers: usize) -> Result<Vec<usize>> {
        let mut set = std::collections::BTreeSet::new();
        for part in &self.parts {
            let last = part.last.unwrap_or(num_layers.saturating_sub(1));
            if part.first >= num_layers || last >= num_layers {
                bail!(
                    "--layers {}: `{}` is outside the model's layers 0-{}",
                    self.text,
                    part.text,
                    num_layers.saturating_sub(1)
                );
            }
            set.extend(part.first..=last);
        }
        Ok(set.into_iter().collect())
    }

    /// The text as given.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layers(text: &str, num_layers: usize) -> Result<Vec<usize>> {
        text.parse::<LayerList>()?.resolve(num_layers)
    }

    #[test]
    fn ranges_are_inclusive_and_slices_half_open() {
        assert_eq!(layers("0-2, 5", 8).unwrap(), vec![0, 1, 2, 5]);
        assert_eq!(layers("4:6", 8).unwrap(), vec![4, 5]);
        assert_eq!(layers("6:,1", 8).unwrap(), vec![1, 6, 7]);
        assert_eq!(layers(":2", 8).unwrap(), vec![0, 1]);
        assert_eq!(layers("7", 8).unwrap(), vec![7]);
    }

    #[test]
    fn bad_text_fails_when_parsed_and_bad_layers_when_resolved() {
        for text in ["x", "3:3", "3-1", "4:2", "", ",", "1-", "-1"] {
            assert!(text.parse::<LayerList>().is_err(), "{text}");
        }
        for (text, message) in [("7-9", "--layers 7-9: `7-9`"), ("2:9", "--layers 2:9")] {
            let err = layers(text, 8).unwrap_err().to_string();
            assert!(err.contains(message), "{err}");
            assert!(err.contains("outside the model's layers 0-7"), "{err}");
        }
        assert!(layers("8:", 8).is_err());
        for text in ["1,,2", "1,", ",3"] {
            let err = text.parse::<LayerList>().unwrap_err().to_string();
            assert!(err.contains("an empty item"), "{text}: {err}");
        }
    }
}
