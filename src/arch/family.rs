//! Which VLM family a checkpoint belongs to, by name. The families themselves (detection, tensor
//! maps, config rewrites) live in [`super::families`]; this keeps the short form the reports use.

use serde_json::Value;

/// Every supported VLM family, by the name users pass to `--family`.
pub use super::families::NAMES as FAMILIES;

/// Detect the VLM family of a checkpoint from its `config.json` and tensor names.
pub fn detect(config: &Value, tensor_names: &[String]) -> Option<&'static str> {
    super::families::detect(config, tensor_names).map(|f| f.name())
}
