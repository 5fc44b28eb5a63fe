//! `sinkmerge inspect`: what a checkpoint is, at a glance or as JSON, and optionally whether any
//! tensor holds NaN or Inf.

use std::io::Write;

use crate::analysis::inspect::{scan_non_finite, Inspection};
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::report::{human_count, Table};
use crate::units::human_bytes;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model directory, HF repo id (`ORG/NAME[@rev]`) or alias
    pub model: String,
    /// Print one JSON object instead of text
    #[arg(long)]
    pub json: bool,
    /// Also scan every tensor for NaN/Inf; exit code 3 if any is found
    #[arg(long)]
    pub check: bool,
}

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    let ckpt = Checkpoint::open_ref(&args.model)?;
    let mut report = Inspection::of(&ckpt);
    if args.check {
        let bar = crate::progress::bytes(ckpt.total_bytes(), "scanning", progress && !args.json);
        report.non_finite = Some(scan_non_finite(&ckpt, &bar));
        bar.finish_and_clear();
    }
    if args.json {
        super::emit(out, &crate::report::json_text(&report)?)?;
    } else {
        super::emit(out, &render(&report))?;
    }
    match &report.non_finite {
        Some(bad) if !bad.is_empty() => Err(Error::NonFinite(format!(
            "{}: {} tensor(s) hold NaN/Inf, first `{}` in {}",
            report.model,
            bad.len(),
            bad[0].tensor,
            bad[0].file
        ))),
        _ => Ok(()),
    }
}

fn render(r: &Inspection) -> String {
    let mut s = String::new();
    let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    s += &format!("model         {}\n", r.model);
    s += &format!("path          {}\n", r.path);
    s += &format!("architecture  {}\n", opt(&r.architecture));
    s += &format!("model_type    {}\n", opt(&r.model_type));
    s += &format!(
        "family        {}\n",
        r.family.as_deref().unwrap_or("- (plain causal LM)")
    );
    s += &format!(
        "parameters    {} ({}) in {} tensors, {} shard(s), {}\n",
        human_count(r.num_parameters),
        r.num_parameters,
        r.num_tensors,
        r.shards,
        human_bytes(r.total_bytes)
    );
    let dtypes: Vec<String> = r.dtypes.iter().map(|(d, n)| format!("{d}: {n}")).collect();
    s += &format!("dtypes        {}\n", dtypes.join(", "));
    s += &format!(
        "layers        {}\n",
        r.num_layers.map_or("-".into(), |n| n.to_string())
    );
    s += &format!("qk_norm       {}\n", r.qk_norm.as_str());
    s += &format!(
        "tie_word_embeddings  {} (lm_head {})\n",
        r.tie_word_embeddings.map_or("-".into(), |b| b.to_string()),
        if r.lm_head_on_disk {
            "on disk"
        } else {
            "not on disk"
        }
    );
    match (&r.text_config, &r.text_config_error) {
        (Some(c), _) => {
            s += &format!(
                "text model    {}: hidden {}, intermediate {}, heads {} ({} kv), head_dim {}, vocab {}, rope theta {} ({})",
                c.model_type,
                c.hidden_size,
                c.intermediate_size,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                c.vocab_size,
                c.rope.theta,
                rope_name(&c.rope.scaling)
            );
            if let Some(m) = &c.moe {
                s += &format!(
                    ", MoE {} experts top-{}",
                    m.num_experts, m.num_experts_per_tok
                );
            }
            s += "\n";
        }
        (None, Some(e)) => s += &format!("text model    (not normalized: {e})\n"),
        (None, None) => {}
    }
    if !r.modules.is_empty() {
        let mut t = Table::new(["module", "count", "shape", "dtype", "params"]);
        for m in &r.modules {
            let shapes: Vec<String> = m.shapes.iter().map(|sh| format!("{sh:?}")).collect();
            t.row([
                m.module.clone(),
                m.count.to_string(),
                shapes.join(" "),
                m.dtypes.join(","),
                human_count(m.parameters),
            ]);
        }
        s += "\nlanguage model tensors\n";
        s += &t.render();
    }
    if !r.other.is_empty() {
        let mut t = Table::new(["prefix", "tensors", "params"]);
        for o in &r.other {
            t.row([
                o.prefix.clone(),
                o.tensors.to_string(),
                human_count(o.parameters),
            ]);
        }
        s += "\nother tensors (vision tower, projector, ...)\n";
        s += &t.render();
    }
    if let Some(bad) = &r.non_finite {
        if bad.is_empty() {
            s += "\ncheck         no NaN or Inf in any tensor\n";
        } else {
            let mut t = Table::new(["tensor", "file", "NaN", "Inf"]);
            for b in bad {
                t.row([
                    b.tensor.clone(),
                    b.file.clone(),
                    b.nan.to_string(),
                    b.inf.to_string(),
                ]);
            }
            s += "\nNON-FINITE VALUES\n";
            s += &t.render();
        }
    }
    s
}

fn rope_name(s: &crate::arch::config::RopeScaling) -> String {
    use crate::arch::config::RopeScaling::*;
    match s {
        Default => "default".into(),
        Linear { factor } => format!("linear x{factor}"),
        Dynamic { factor, .. } => format!("dynamic x{factor}"),
        Llama3 { factor, .. } => format!("llama3 x{factor}"),
        Yarn(yarn) => format!("yarn x{}", yarn.factor),
        Mrope { interleaved, .. } => {
            if *interleaved {
                "interleaved mrope".into()
            } else {
                "mrope".into()
            }
        }
        Other { name } => name.clone(),
    }
}
