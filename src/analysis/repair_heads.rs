//! Head-selective repair: move chosen heads' slices of chosen projections toward the reference,
//! `W = (1 - lambda) W_target + lambda W_ref`, and leave every other byte as it is
//! (`docs/reference/heads.md`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Range;
use std::str::FromStr;

use serde::Serialize;

use super::heads::{head_sinks, rank, Projection, RankBy};
use crate::arch::names::{layer_name, Param};
use crate::checkpoint::header::TensorInfo;
use crate::checkpoint::Checkpoint;
use crate::dtype;
use crate::error::Result;
use crate::forward::backend::cpu::CpuBackend;
use crate::forward::model::DecoderSpec;
use crate::forward::weights::Model;
use crate::sink::inputs::{check_same_tokens, prompt_input};
use crate::sink::prompts::IndexStream;
use crate::sink::score::Settings;
use crate::{bad, bail};

/// Which heads `--heads` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// The K most damaged heads, ranked as `sinkmerge heads` ranks them.
    Top(usize),
    /// K heads drawn uniformly without replacement (the matched control of `Top`).
    Random(usize),
    /// These `(layer, head)` pairs.
    List(Vec<(usize, usize)>),
}

impl FromStr for Selection {
    type Err = String;

    fn from_str(s: &str) -> Result<Selection, String> {
        let count = |mode: &str, k: &str| {
            if k.contains(',') {
                return Err(format!(
                    "`{s}`: {mode}:K takes one count, not a list; name heads as LAYER.HEAD,... \
                     without {mode}:"
                ));
            }
            match k.trim().parse::<usize>() {
                Ok(k) if k > 0 => Ok(k),
                // All digits, yet no usize: more heads than any model has.
                Err(_) if !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()) => Err(format!(
                    "`{s}`: K = {k} is too large; K counts heads of the chosen layers"
                )),
                _ => Err(format!("`{s}`: K must be a whole number of at least 1")),
            }
        };
        if let Some(k) = s.strip_prefix("top:") {
            return Ok(Selection::Top(count("top", k)?));
        }
        if let Some(k) = s.strip_prefix("random:") {
            return Ok(Selection::Random(count("random", k)?));
        }
        let mut heads: Vec<(usize, usize)> = Vec::new();
        for part in s.split(',').map(str::trim) {
            if part.is_empty() {
                return Err(format!("`{s}`: an empty item; list heads as 20.3,21.0"));
            }
            let head = (part.split_once('.'))
                .and_then(|(l, h)| Some((l.parse().ok()?, h.parse().ok()?)))
                .ok_or_else(|| {
                    format!(
                        "`{part}` is not LAYER.HEAD; give top:K, random:K or a list of \
                         LAYER.HEAD like 20.3,21.0"
                    )
                })?;
            if heads.contains(&head) {
                return Err(format!("head {part} is listed twice"));
            }
            heads.push(head);
        }
        Ok(Selection::List(heads))
    }
}

impl std::fmt::Display for Selection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Selection::Top(k) => write!(f, "top:{k}"),
            Selection::Random(k) => write!(f, "random:{k}"),
            Selection::List(heads) => {
                let shown: Vec<String> = heads.iter().map(|(l, h)| format!("{l}.{h}")).collect();
                write!(f, "{}", shown.join(","))
            }
        }
    }
}

/// `count` distinct heads of `candidates`, drawn with a seeded partial Fisher-Yates shuffle
/// ([`IndexStream`]), in layer and head order.
pub fn draw_heads(candidates: &[(usize, usize)], count: usize, seed: u64) -> Vec<(usize, usize)> {
    let mut pool = candidates.to_vec();
    let mut stream = IndexStream::new(seed);
    for i in 0..count.min(pool.len()) {
        let j = i + stream.index(pool.len() - i);
        pool.swap(i, j);
    }
    pool.truncate(count);
    pool.sort_unstable();
    pool
}

/// `top:K`: the `count` heads of `candidate_layers` (ascending) that rank first by `rank_by`, as
/// `sinkmerge heads` ranks them, from one CPU scoring pass over the reference `ckpts[0]` and the
/// target `ckpts[1]` (models of `num_layers` layers) on `prompts`; in layer and head order.
pub fn top_heads(
    ckpts: &[Checkpoint; 2],
    prompts: &[String],
    candidate_layers: &[usize],
    num_layers: usize,
    rank_by: RankBy,
    count: usize,
    show_progress: bool,
) -> Result<Vec<(usize, usize)>> {
    let pair = [
        prompt_input(&ckpts[0], prompts, None)?,
        prompt_input(&ckpts[1], prompts, None)?,
    ];
    check_same_tokens(&pair[0], &pair[1], None)?;
    let bar = crate::progress::items(2 * num_layers as u64, "scoring", show_progress);
    // The ranking needs the sink statistics only, not the drift.
    let (sinks, _) = head_sinks(
        &CpuBackend::default(),
        &pair,
        candidate_layers,
        num_layers,
        Settings::default(),
        &|| bar.inc(1),
    )?;
    bar.finish_and_clear();
    let order = rank(&sinks, rank_by);
    let mut top: Vec<(usize, usize)> = (order.iter().take(count))
        .map(|&i| (sinks[i].layer, sinks[i].head))
        .collect();
    top.sort_unstable();
    Ok(top)
}

/// Check a list of heads against the model, and K against the number of candidates.
pub fn check_selection(selection: &Selection, spec: &DecoderSpec, candidates: usize) -> Result<()> {
    match selection {
        Selection::Top(k) | Selection::Random(k) if *k > candidates => bail!(
            "--heads {selection}: K = {k} is more than the {candidates} heads of the chosen layers"
        ),
        Selection::List(heads) => {
            for &(layer, head) in heads {
                if layer >= spec.num_layers() {
                    bail!(
                        "--heads: layer {layer} is out of range: the model has layers 0-{}",
                        spec.num_layers() - 1
                    );
                }
                if head >= spec.num_heads {
                    bail!(
                        "--heads: head {head} is out of range: the model has heads 0-{} per layer",
                        spec.num_heads - 1
                    );
                }
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// The element ranges of every tensor (by Hugging Face standard name) that repairing `heads`'
/// slices of `modules` touches: q's rows and k's and v's KV-group rows (weight and bias), o's
/// columns. Heads that share a KV head share its k and v rows, which are repaired once.
pub fn plan(
    spec: &DecoderSpec,
    heads: &[(usize, usize)],
    modules: &[Projection],
) -> BTreeMap<String, Vec<Range<usize>>> {
    let mut ranges: BTreeMap<String, BTreeSet<(usize, usize)>> = BTreeMap::new();
    for &(layer, head) in heads {
        for &p in modules {
            let slice = p.slice(spec, head);
            let [rows, cols] = p.shape(spec);
            let weight = ranges
                .entry(layer_name(layer, p.module(), Param::Weight))
                .or_default();
            if p.slices_rows() {
                weight.insert((slice.start * cols, slice.end * cols));
            } else {
                weight.extend((0..rows).map(|r| (r * cols + slice.start, r * cols + slice.end)));
            }
            let bias = match p {
                Projection::O => spec.o_bias.then_some(()),
                _ => spec.qkv_bias.then_some(()),
            };
            // o's bias is added after the heads are summed: it belongs to no head.
            if bias.is_some() && p.slices_rows() {
                ranges
                    .entry(layer_name(layer, p.module(), Param::Bias))
                    .or_default()
                    .insert((slice.start, slice.end));
            }
        }
    }
    ranges
        .into_iter()
        .map(|(name, set)| (name, set.into_iter().map(|(a, b)| a..b).collect()))
        .collect()
}

/// What repairing one tensor changed.
#[derive(Debug, Clone, Serialize)]
pub struct TensorRepair {
    pub tensor: String,
    /// Entries in the repaired slices.
    pub entries: usize,
    /// Of those, entries whose stored bytes changed.
    pub changed: usize,
}

/// One planned tensor of the target checkpoint: its standard name and the ranges that move.
pub struct Planned<'a> {
    pub standard: &'a str,
    pub ranges: &'a [Range<usize>],
}

/// The tensors of `plan` (by standard name) under `target`'s stored names (a VLM prefixes its
/// language model).
pub fn by_stored_name<'a>(
    target: &'a Model,
    plan: &'a BTreeMap<String, Vec<Range<usize>>>,
) -> Result<HashMap<&'a str, Planned<'a>>> {
    (plan.iter())
        .map(|(standard, ranges)| {
            let planned = Planned { standard, ranges };
            Ok((target.stored_name(standard)?, planned))
        })
        .collect()
}

/// Repair one stored tensor of the target (`info`, `bytes`, stored as `name`; `what` names it
/// in errors) toward `reference`'s tensor of the same standard name, which must share its dtype.
pub fn repair_stored(
    reference: &Model,
    planned: &Planned,
    name: &str,
    info: &TensorInfo,
    bytes: &[u8],
    lambda: f32,
    what: &str,
) -> Result<(Vec<u8>, TensorRepair)> {
    let (ref_dtype, ref_bytes) = reference.stored_bytes(planned.standard, &info.shape)?;
    if ref_dtype != info.dtype {
        bail!(
            "{} is {ref_dtype:?} but {what} is {:?}; repair-heads blends tensors of one dtype",
            reference.describe(planned.standard),
            info.dtype
        );
    }
    blend(
        info.dtype,
        bytes,
        ref_bytes,
        planned.ranges,
        lambda,
        name,
        [what, &reference.describe(planned.standard)],
    )
}

/// `target`'s bytes with the entries in `ranges` set to `(1 - lambda) target + lambda reference`
/// (f32 arithmetic, rounded once to the dtype); at `lambda = 1` they are the reference's bytes,
/// at 0 the target's. The report names `tensor`; `what` names the target's and the reference's
/// tensors in errors. A NaN or Inf in the slices a weight of the blend reads is an error naming
/// that input, as a merge's is (merge/job.rs); one elsewhere is left to the writer's check.
pub fn blend(
    dtype: safetensors::Dtype,
    target: &[u8],
    reference: &[u8],
    ranges: &[Range<usize>],
    lambda: f32,
    tensor: &str,
    what: [&str; 2],
) -> Result<(Vec<u8>, TensorRepair)> {
    let [what, reference_what] = what;
    if target.len() != reference.len() {
        bail!("{what}: the reference's tensor has another size");
    }
    let size = dtype::byte_size(dtype);
    if let Some(r) = ranges.iter().find(|r| r.end * size > target.len()) {
        bail!(
            "{what}: holds {} entries, but the heads config.json declares reach entry {}",
            target.len() / size,
            r.end - 1
        );
    }
    let read = [
        (what, target, lambda < 1.0),
        (reference_what, reference, lambda > 0.0),
    ];
    for (input, stored, weighted) in read {
        for r in ranges.iter().filter(|_| weighted) {
            if let Some((k, v)) =
                dtype::first_non_finite(dtype, &stored[r.start * size..r.end * size])
            {
                return Err(crate::non_finite!(
                    "{input}: holds {v} at flat index {}; repairing would spread it into `{tensor}`",
                    r.start + k
                ));
            }
        }
    }
    let mut out = target.to_vec();
    for r in ranges {
        let bytes = r.start * size..r.end * size;
        if lambda == 1.0 {
            out[bytes.clone()].copy_from_slice(&reference[bytes]);
            continue;
        }
        // The reference is not read at 0 (its NaN times 0 would still be NaN).
        if lambda == 0.0 {
            continue;
        }
        let t = dtype::decode(dtype, &target[bytes.clone()], what)?;
        let w = dtype::decode(dtype, &reference[bytes.clone()], what)?;
        let mixed: Vec<f32> = (t.iter().zip(&w))
            .map(|(&t, &w)| (1.0 - lambda) * t + lambda * w)
            .collect();
        out[bytes].copy_from_slice(&dtype::encode(dtype, &mixed)?);
    }
    let entries = ranges.iter().map(Range::len).sum();
    let changed = (ranges.iter())
        .flat_map(|r| r.clone())
        .filter(|&i| out[i * size..(i + 1) * size] != target[i * size..(i + 1) * size])
        .count();
    Ok((
        out,
        TensorRepair {
            tensor: tensor.to_string(),
            entries,
            changed,
        },
    ))
}

/// Parse `--modules q,k,v,o`.
pub fn parse_modules(list: &str) -> Result<Vec<Projection>> {
    let mut out = BTreeSet::new();
    for m in list.split(',').map(str::trim) {
        if m.is_empty() {
            bail!("--modules {list}: an empty item; list projections as q,k");
        }
        let projection = Projection::from_short_name(m)
            .ok_or_else(|| bad!("--modules: `{m}` is not a projection; choose from q, k, v, o"))?;
        if !out.insert(projection) {
            bail!("--modules {list}: `{m}` is listed twice");
        }
    }
    Ok(out.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selections_parse() {
        assert_eq!("top:4".parse(), Ok(Selection::Top(4)));
        assert_eq!("random:2".parse(), Ok(Selection::Random(2)));
        assert_eq!(
            "3.1, 4.0".parse(),
            Ok(Selection::List(vec![(3, 1), (4, 0)]))
        );
        assert!("top:0".parse::<Selection>().is_err());
        assert!("3-1".parse::<Selection>().is_err());
        let err = |s: &str| s.parse::<Selection>().unwrap_err();
        assert!(err("1.1,").contains("empty item"));
        assert!(err("1.1,,2.0").contains("empty item"));
        assert_eq!(err("1.1,2.0,1.1"), "head 1.1 is listed twice");
        assert!(err("top:2,1.1").contains("one count, not a list"));
        assert!(err("random:99999999999999999999999").contains("too large"));
        assert!(err("top:x").contains("whole number"));
        assert_eq!(Selection::List(vec![(3, 1), (4, 0)]).to_string(), "3.1,4.0");
    }

    #[test]
    fn draws_are_seeded_distinct_and_sorted() {
        let all: Vec<(usize, usize)> = (0..6).flat_map(|l| (0..4).map(move |h| (l, h))).collect();
        let a = draw_heads(&all, 5, 1);
        assert_eq!(a, draw_heads(&all, 5, 1));
        assert_ne!(a, draw_heads(&all, 5, 2));
        let set: BTreeSet<_> = a.iter().collect();
        assert_eq!(set.len(), 5);
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(draw_heads(&all, 24, 3), all);
    }

    #[test]
    fn blending_at_one_copies_the_reference_and_at_zero_keeps_the_target() {
        let dt = safetensors::Dtype::BF16;
        let t = dtype::encode(dt, &[1.0, 2.0, 3.0, 4.0]).unwrap();
        let r = dtype::encode(dt, &[5.0, 6.0, 7.0, 8.0]).unwrap();
        let middle: Vec<Range<usize>> = std::iter::once(1..3).collect();
        let (one, rep) = blend(dt, &t, &r, &middle, 1.0, "x", ["x", "x"]).unwrap();
        assert_eq!(
            dtype::decode(dt, &one, "").unwrap(),
            vec![1.0, 6.0, 7.0, 4.0]
        );
        assert_eq!((rep.entries, rep.changed), (2, 2));
        assert_eq!(
            blend(dt, &t, &r, &middle, 0.0, "x", ["x", "x"]).unwrap().0,
            t
        );
        let half = blend(dt, &t, &r, &[0..1, 3..4], 0.5, "x", ["x", "x"])
            .unwrap()
            .0;
        assert_eq!(
            dtype::decode(dt, &half, "").unwrap(),
            vec![3.0, 2.0, 3.0, 6.0]
        );
    }

    #[test]
    fn modules_parse_and_refuse_unknown_names() {
        assert_eq!(
            parse_modules("k,q").unwrap(),
            vec![Projection::Q, Projection::K]
        );
        let err = parse_modules("q,gate").unwrap_err().to_string();
        assert!(err.contains("`gate`"), "{err}");
        let err = parse_modules("q,k,q").unwrap_err().to_string();
        assert!(err.contains("`q` is listed twice"), "{err}");
        let err = parse_modules("q,,k").unwrap_err().to_string();
        assert!(err.contains("empty item"), "{err}");
    }
}
