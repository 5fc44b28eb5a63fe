//! Merge parameters: what each method declares (name, scope, type, default, meaning) and the
//! values a config gives them.
//!
//! A value is set as in mergekit's YAML (docs/commands/merge.md#the-yaml-format): a scalar, a
//! *gradient* (a list of numbers interpolated over the layers, with embeddings, final norm and
//! lm_head at `t = 0`), or a list of `{filter, value}` entries where the first entry whose `filter`
//! is a substring of the tensor name wins (`filter` absent or `"*"` matches everything). Per-model
//! settings take precedence over the top-level `parameters`, which take precedence over the
//! method's default.

use std::collections::BTreeMap;

use serde_yaml_ng::Value as Yaml;

use crate::bail;
use crate::error::Result;

/// Whether a parameter is set once for the merge or per input model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// One value for the whole merge (`lambda`, `normalize`, ...), from top-level `parameters`.
    Global,
    /// One value per input model (`weight`, `density`), from `models[].parameters`, falling back
    /// to top-level `parameters`. The base model of a task-vector method takes none.
    PerModel,
}

/// The type of a parameter's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A real number; gradients and filters allowed.
    Number,
    /// `true` / `false`.
    Bool,
    /// One of a fixed set of names. `bools` maps YAML `true`/`false` to two of them, for
    /// parameters that mergekit declares as booleans (`rescale: true` means `l1`).
    Choice {
        options: &'static [&'static str],
        bools: Option<(&'static str, &'static str)>,
    },
    /// A non-negative integer (random seeds); scalars only.
    Integer,
}

/// A parameter's default.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ParamDefault {
    /// Must be given (mergekit's `weight`).
    Required,
    Number(f64),
    Bool(bool),
    Choice(&'static str),
    Integer(u64),
}

/// One parameter a method declares.
#[derive(Debug, Clone, Copy)]
pub struct ParamSpec {
    pub name: &'static str,
    pub scope: Scope,
    pub kind: Kind,
    pub default: ParamDefault,
    /// What it means, which reference it follows; shown by `--help` and docs.
    pub doc: &'static str,
}

/// A resolved parameter value.
#[derive(Debug, Clone, PartialEq)]
pub enum ParamValue {
    Number(f64),
    Bool(bool),
    Choice(String),
    Integer(u64),
}

impl ParamValue {
    fn to_yaml(&self) -> Yaml {
        match self {
            ParamValue::Number(x) => Yaml::Number((*x).into()),
            ParamValue::Bool(b) => Yaml::Bool(*b),
            ParamValue::Choice(s) => Yaml::String(s.clone()),
            ParamValue::Integer(n) => Yaml::Number((*n).into()),
        }
    }
}

/// How a config sets one parameter.
#[derive(Debug, Clone, PartialEq)]
pub enum Setting {
    Scalar(ParamValue),
    /// Values at evenly spaced points over the layers, linearly interpolated.
    Gradient(Vec<f64>),
    /// `[{filter, value}, ...]`: the first entry whose filter matches the tensor name wins.
    Filtered(Vec<(Option<String>, Setting)>),
}

impl Setting {
    /// The value for `tensor` at layer position `t` in [0, 1]; `None` if no filter matches.
    /// Gradients interpolate exactly as mergekit's `evaluate_setting` does (f64, index
    /// `int(t * (n - 1))`).
    pub fn resolve(&self, tensor: &str, t: f64) -> Option<ParamValue> {
        match self {
            Setting::Scalar(v) => Some(v.clone()),
            Setting::Gradient(points) => {
                let scaled = t * (points.len() - 1) as f64;
                let i0 = scaled as usize;
                let i1 = (i0 + 1).min(points.len() - 1);
                let frac = scaled - i0 as f64;
                Some(ParamValue::Number(
                    (1.0 - frac) * points[i0] + frac * points[i1],
                ))
            }
            Setting::Filtered(entries) => entries
                .iter()
                .find(|(filter, _)| match filter.as_deref() {
                    None | Some("*") => true,
                    Some(f) => tensor.contains(f),
                })
                .and_then(|(_, setting)| setting.resolve(tensor, t)),
        }
    }

    /// Parse a YAML value as a setting of `spec`; `context` names where it came from.
    pub fn from_yaml(spec: &ParamSpec, value: &Yaml, context: &str) -> Result<Setting> {
        match value {
            Yaml::Sequence(items) if items.is_empty() => {
                bail!("{context}: `{}` is an empty list", spec.name)
            }
            Yaml::Sequence(items) if items.iter().all(|i| !matches!(i, Yaml::Mapping(_))) => {
                if spec.kind != Kind::Number {
                    bail!(
                        "{context}: `{}` takes a single value; lists (layer gradients) are only for numeric parameters",
                        spec.name
                    );
                }
                let points = items
                    .iter()
                    .map(|i| number(i).ok_or_else(|| not_a(spec, i, context)))
                    .collect::<Result<Vec<f64>>>()?;
                Ok(Setting::Gradient(points))
            }
            Yaml::Sequence(items) => {
                let entries = items
                    .iter()
                    .map(|item| conditional(spec, item, context))
                    .collect::<Result<Vec<_>>>()?;
                Ok(Setting::Filtered(entries))
            }
            Yaml::Mapping(_) => Ok(Setting::Filtered(vec![conditional(spec, value, context)?])),
            scalar => Ok(Setting::Scalar(parse_scalar(spec, scalar, context)?)),
        }
    }

    /// The setting as YAML, for `sinkmerge_config.yml`.
    pub fn to_yaml(&self) -> Yaml {
        match self {
            Setting::Scalar(v) => v.to_yaml(),
            Setting::Gradient(points) => {
                Yaml::Sequence(points.iter().map(|&x| Yaml::Number(x.into())).collect())
            }
            Setting::Filtered(entries) => Yaml::Sequence(
                entries
                    .iter()
                    .map(|(filter, setting)| {
                        let mut m = serde_yaml_ng::Mapping::new();
                        if let Some(f) = filter {
                            m.insert("filter".into(), Yaml::String(f.clone()));
                        }
                        m.insert("value".into(), setting.to_yaml());
                        Yaml::Mapping(m)
                    })
                    .collect(),
            ),
        }
    }
}

fn conditional(spec: &ParamSpec, item: &Yaml, context: &str) -> Result<(Option<String>, Setting)> {
    let Yaml::Mapping(map) = item else {
        bail!(
            "{context}: `{}` mixes plain values and {{filter, value}} entries",
            spec.name
        );
    };
    let mut filter = None;
    let mut value = None;
    for (k, v) in map {
        match k.as_str() {
            Some("filter") => match v {
                Yaml::String(s) => filter = Some(s.clone()),
                Yaml::Null => {}
                _ => bail!("{context}: `{}`: `filter` must be a string", spec.name),
            },
            Some("value") => value = Some(v),
            _ => bail!(
                "{context}: `{}`: unknown key {} in a filter entry (expected `filter` and `value`)",
                spec.name,
                yaml_repr(k)
            ),
        }
    }
    let Some(value) = value else {
        bail!("{context}: `{}`: a filter entry has no `value`", spec.name);
    };
    if matches!(value, Yaml::Mapping(_))
        || matches!(value, Yaml::Sequence(s) if s.iter().any(|i| matches!(i, Yaml::Mapping(_))))
    {
        bail!(
            "{context}: `{}`: a filter entry's value must be a scalar or a gradient",
            spec.name
        );
    }
    Ok((filter, Setting::from_yaml(spec, value, context)?))
}

fn number(v: &Yaml) -> Option<f64> {
    match v {
        Yaml::Number(n) => n.as_f64(),
        // YAML 1.1 readers (PyYAML, so mergekit users) see `1e-3` as a string; pydantic then
        // converts it. Accept the same.
        Yaml::String(s) => s.trim().parse::<f64>().ok().filter(|x| x.is_finite()),
        _ => None,
    }
}

fn not_a(spec: &ParamSpec, v: &Yaml, context: &str) -> crate::Error {
    let expected = match spec.kind {
        Kind::Number => "a number".to_string(),
        Kind::Bool => "true or false".to_string(),
        Kind::Integer => "a non-negative integer".to_string(),
        Kind::Choice { options, bools } => {
            let mut s = format!("one of {}", options.join(", "));
            if bools.is_some() {
                s.push_str(" (or true/false)");
            }
            s
        }
    };
    crate::bad!(
        "{context}: `{}` must be {expected}, not {}",
        spec.name,
        yaml_repr(v)
    )
}

/// Parse a scalar YAML value as a value of `spec`.
pub fn parse_scalar(spec: &ParamSpec, v: &Yaml, context: &str) -> Result<ParamValue> {
    let value = match spec.kind {
        Kind::Number => number(v).map(ParamValue::Number),
        Kind::Bool => v.as_bool().map(ParamValue::Bool),
        Kind::Integer => v.as_u64().map(ParamValue::Integer),
        Kind::Choice { options, bools } => match (v, bools) {
            (Yaml::Bool(b), Some((yes, no))) => {
                Some(ParamValue::Choice(if *b { yes } else { no }.into()))
            }
            (Yaml::String(s), _) => options
                .iter()
                .find(|o| o.eq_ignore_ascii_case(s.trim()))
                .map(|o| ParamValue::Choice(o.to_string())),
            _ => None,
        },
    };
    let value = value.ok_or_else(|| not_a(spec, v, context))?;
    if let ParamValue::Number(x) = value {
        if !x.is_finite() {
            return Err(not_a(spec, v, context));
        }
    }
    Ok(value)
}

/// The default as a value (`None` when required).
pub fn default_value(spec: &ParamSpec) -> Option<ParamValue> {
    match spec.default {
        ParamDefault::Required => None,
        ParamDefault::Number(x) => Some(ParamValue::Number(x)),
        ParamDefault::Bool(b) => Some(ParamValue::Bool(b)),
        ParamDefault::Choice(s) => Some(ParamValue::Choice(s.to_string())),
        ParamDefault::Integer(n) => Some(ParamValue::Integer(n)),
    }
}

/// A short rendering of a YAML value for messages.
pub fn yaml_repr(v: &Yaml) -> String {
    match v {
        Yaml::String(s) => format!("`{s}`"),
        other => serde_yaml_ng::to_string(other)
            .map(|s| format!("`{}`", s.trim()))
            .unwrap_or_else(|_| "?".into()),
    }
}

/// Named settings, sorted by name.
pub type Settings = BTreeMap<String, Setting>;

/// Parameter values resolved for one output tensor, before a method types them. Read by the
/// method's own [`ParamSpec`] constants, so a misspelt name does not compile.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TensorValues {
    pub global: BTreeMap<&'static str, ParamValue>,
    /// Per input model, in input order (the task models for task-vector methods).
    pub models: Vec<BTreeMap<&'static str, ParamValue>>,
}

impl TensorValues {
    // The panics below are a method reading a spec it does not list in its `params`; the
    // tests in merge/mod.rs type every method's defaults, so they cannot reach a user.
    fn get(&self, spec: &ParamSpec) -> &ParamValue {
        self.global
            .get(spec.name)
            .unwrap_or_else(|| panic!("parameter `{}` is not declared by this method", spec.name))
    }

    pub fn number(&self, spec: &ParamSpec) -> f64 {
        match self.get(spec) {
            ParamValue::Number(x) => *x,
            other => panic!("parameter `{}` is {other:?}, not a number", spec.name),
        }
    }

    pub fn flag(&self, spec: &ParamSpec) -> bool {
        match self.get(spec) {
            ParamValue::Bool(b) => *b,
            other => panic!("parameter `{}` is {other:?}, not a bool", spec.name),
        }
    }

    /// A choice as its enum; the enum's value names are the spec's options.
    pub fn choice<T: clap::ValueEnum>(&self, spec: &ParamSpec) -> T {
        match self.get(spec) {
            ParamValue::Choice(s) => T::from_str(s, false)
                .unwrap_or_else(|_| panic!("parameter `{}`: `{s}` has no variant", spec.name)),
            other => panic!("parameter `{}` is {other:?}, not a choice", spec.name),
        }
    }

    pub fn integer(&self, spec: &ParamSpec) -> u64 {
        match self.get(spec) {
            ParamValue::Integer(n) => *n,
            other => panic!("parameter `{}` is {other:?}, not an integer", spec.name),
        }
    }

    /// A numeric per-model parameter for every model, in order.
    pub fn model_numbers(&self, spec: &ParamSpec) -> Vec<f64> {
        self.models
            .iter()
            .enumerate()
            .map(|(i, values)| match values.get(spec.name) {
                Some(ParamValue::Number(x)) => *x,
                other => panic!(
                    "per-model parameter `{}` of model {i} is {other:?}",
                    spec.name
                ),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: ParamSpec = ParamSpec {
        name: "weight",
        scope: Scope::PerModel,
        kind: Kind::Number,
        default: ParamDefault::Required,
        doc: "",
    };

    fn setting(text: &str) -> Setting {
        Setting::from_yaml(&W, &serde_yaml_ng::from_str(text).unwrap(), "test").unwrap()
    }

    #[test]
    fn gradients_interpolate_like_mergekit() {
        let g = setting("[0, 0.3, 0.7, 1]");
        let at = |t| match g.resolve("x", t) {
            Some(ParamValue::Number(x)) => x,
            other => panic!("{other:?}"),
        };
        assert_eq!(at(0.0), 0.0);
        assert_eq!(at(1.0), 1.0);
        // t = 0.5 -> scaled 1.5 -> halfway between 0.3 and 0.7.
        assert!((at(0.5) - 0.5).abs() < 1e-15);
        // t = 1/3 -> exactly the second point.
        assert!((at(1.0 / 3.0) - 0.3).abs() < 1e-15);
    }

    #[test]
    fn filters_pick_the_first_match_and_fall_back() {
        let f = setting("[{filter: mlp, value: 0.5}, {value: 0}]");
        assert_eq!(
            f.resolve("model.layers.0.mlp.up_proj.weight", 0.0),
            Some(ParamValue::Number(0.5))
        );
        assert_eq!(
            f.resolve("model.layers.0.self_attn.q_proj.weight", 0.0),
            Some(ParamValue::Number(0.0))
        );
        let only = setting("{filter: self_attn, value: [1, 2]}");
        assert_eq!(only.resolve("model.norm.weight", 0.0), None);
        assert_eq!(
            only.resolve("model.layers.1.self_attn.q_proj.weight", 1.0),
            Some(ParamValue::Number(2.0))
        );
    }

    #[test]
    fn scalars_are_type_checked() {
        let y = |t: &str| serde_yaml_ng::from_str::<Yaml>(t).unwrap();
        assert_eq!(
            parse_scalar(&W, &y("'1e-3'"), "c").unwrap(),
            ParamValue::Number(1e-3)
        );
        let err = parse_scalar(&W, &y("abc"), "cfg").unwrap_err().to_string();
        assert!(err.contains("`weight` must be a number"), "{err}");
        let rescale = crate::merge::dare::RESCALE;
        assert_eq!(
            parse_scalar(&rescale, &y("true"), "c").unwrap(),
            ParamValue::Choice("l1".into())
        );
        assert_eq!(
            parse_scalar(&rescale, &y("Inverse"), "c").unwrap(),
            ParamValue::Choice("inverse".into())
        );
        assert!(parse_scalar(&rescale, &y("l2"), "c").is_err());
    }
}
