//! The common case: a VLM that keeps a stock causal LM under a name prefix
//! (docs/reference/vlm-layouts.md#the-families). Tensors under the language-model prefix are
//! renamed to standard names and copied verbatim; tensors under the vision / projector prefixes are
//! dropped; anything else is an error, because remote-code layouts drift between revisions and a
//! silently dropped tensor is a wrong model.

use serde_json::{Map, Value};

use super::plan::{DropKind, ExtractPlan, PlanBuilder};
use super::target::{standalone_config, Target};
use crate::arch::names;
use crate::bail;
use crate::checkpoint::Checkpoint;
use crate::dtype;
use crate::error::Result;

/// Where a VLM keeps what.
pub struct PrefixLayout {
    /// `(stored prefix, standard prefix)` of language-model tensors, most specific first.
    pub lm: &'static [(&'static str, &'static str)],
    /// Stored names of the output head.
    pub heads: &'static [&'static str],
    /// Stored-name prefixes (or exact names) of everything that is not the language model, with
    /// their kind; checked before `lm`, so `model.visual.` can sit inside a `model.` LM prefix.
    pub drop: &'static [(&'static str, DropKind)],
}

/// What a stored tensor is.
pub enum Route {
    /// A language-model tensor, under its standard causal-LM name.
    Lm {
        standard: String,
        prefix: usize,
    },
    Head,
    Drop(DropKind),
    Unknown,
}

impl PrefixLayout {
    pub fn route(&self, name: &str) -> Route {
        if self.heads.contains(&name) {
            return Route::Head;
        }
        if let Some((_, kind)) = self.drop.iter().find(|(p, _)| name.starts_with(p)) {
            return Route::Drop(*kind);
        }
        for (i, (from, to)) in self.lm.iter().enumerate() {
            if let Some(rest) = name.strip_prefix(from) {
                return Route::Lm {
                    standard: format!("{to}{rest}"),
                    prefix: i,
                };
            }
        }
        Route::Unknown
    }

    fn describe_prefixes(&self) -> String {
        let lm: Vec<String> = self.lm.iter().map(|(p, _)| format!("`{p}`")).collect();
        let other: Vec<String> = self.drop.iter().map(|(p, _)| format!("`{p}`")).collect();
        format!(
            "language model under {}, head {}, dropped {}",
            lm.join(" or "),
            self.heads
                .iter()
                .map(|h| format!("`{h}`"))
                .collect::<Vec<_>>()
                .join(" or "),
            other.join(", ")
        )
    }
}

/// Route every tensor of the checkpoint through `layout` into `b`. `surgery(b, stored, standard)`
/// sees each language-model tensor first and returns whether it planned it itself (expert
/// unfusing); otherwise the tensor is kept whole and its standard name must parse.
pub fn route_all(
    b: &mut PlanBuilder,
    layout: &'static PrefixLayout,
    mut surgery: impl FnMut(&mut PlanBuilder, &str, &str) -> Result<bool>,
) -> Result<()> {
    let ckpt = b.ckpt();
    let mut used = vec![0usize; layout.lm.len()];
    for name in ckpt.names() {
        match layout.route(name) {
            Route::Head => b.head(name)?,
            Route::Drop(kind) => b.drop(name, kind)?,
            Route::Lm { standard, prefix } => {
                used[prefix] += 1;
                if surgery(b, name, &standard)? {
                    continue;
                }
                // A non-persistent buffer some older transformers versions saved; loaders ignore it.
                if standard.ends_with(".rotary_emb.inv_freq") {
                    b.drop(name, DropKind::Other)?;
                    continue;
                }
                if names::parse(&standard).is_none() {
                    bail!(
                        "{}: unknown tensor under the language-model prefix `{}` (it would be `{standard}`, which no causal LM has); the {} layout may have changed",
                        ckpt.describe(name),
                        layout.lm[prefix].0,
                        b.family()
                    );
                }
                b.keep(name, standard)?;
            }
            Route::Unknown => bail!(
                "{}: not part of the {} layout ({}); is this another family? (see --family)",
                ckpt.describe(name),
                b.family(),
                layout.describe_prefixes()
            ),
        }
    }
    // Report a missing tensor under the prefix the checkpoint actually uses.
    if let Some(best) = (0..used.len()).max_by_key(|&i| (used[i], usize::MAX - i)) {
        let (from, to) = layout.lm[best];
        b.set_stored_hint(move |standard: &str| {
            standard
                .strip_prefix(to)
                .map(|rest| format!("{from}{rest}"))
        });
    }
    Ok(())
}

/// A whole prefix family: route, build the config, apply the tie rule, check.
pub fn plan(
    ckpt: &Checkpoint,
    family: &'static str,
    layout: &'static PrefixLayout,
    target: Target,
    fields: &Map<String, Value>,
    tie: Option<bool>,
) -> Result<ExtractPlan> {
    let mut b = PlanBuilder::new(ckpt, family);
    route_all(&mut b, layout, |_, _, _| Ok(false))?;
    let config = standalone_config(target, fields, &ckpt.config, main_dtype(ckpt))?;
    b.finish(target, config, tie)
}

/// The torch name of the checkpoint's main float dtype, for configs that state none.
pub fn main_dtype(ckpt: &Checkpoint) -> Option<&'static str> {
    ckpt.main_float_dtype().and_then(dtype::torch_name)
}

/// The language model's config fields: `text_config`, else `llm_config`, else the flat top level.
/// `defaults_type` replaces `model_type` where the omitted keys follow another class's defaults
/// (a flat Qwen2-VL config is read with Qwen2VLTextConfig defaults). Returns the section's key.
pub fn text_fields(
    config: &Value,
    defaults_type: Option<&str>,
) -> (Map<String, Value>, Option<&'static str>) {
    let (section, key) = crate::arch::config::text_section(config);
    let mut fields = section.clone();
    if let Some(t) = defaults_type {
        fields.insert("model_type".into(), Value::String(t.into()));
    }
    (fields, key)
}

// The tie flag the VLM itself used: the rule every command applies.
pub use crate::arch::config::tie_flag;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_prefixes_win_over_an_enclosing_lm_prefix() {
        static L: PrefixLayout = PrefixLayout {
            lm: &[("model.", "model.")],
            heads: &["lm_head.weight"],
            drop: &[("model.visual.", DropKind::Vision)],
        };
        assert!(matches!(
            L.route("model.visual.x"),
            Route::Drop(DropKind::Vision)
        ));
        assert!(matches!(L.route("lm_head.weight"), Route::Head));
        assert!(matches!(L.route("model.norm.weight"), Route::Lm { .. }));
        assert!(matches!(L.route("visual.x"), Route::Unknown));
    }
}
