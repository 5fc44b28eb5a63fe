//! `sinkmerge heads`: which heads lost their sink, and whether they are the heads whose weights
//! moved most (`docs/commands/heads.md`).

use std::path::PathBuf;

use serde::Serialize;

use super::score::{input, refuse_inside_inputs, same_tokens, short, Device};
use crate::analysis::heads::{self, diagnose, Diagnosis, HeadRow, Layers, RankBy};
use crate::bail;
use crate::checkpoint::output::write_file_atomic;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::report::heatmap::{ColourScale, Heatmap, Panel, Scale};
use crate::report::{fmt_num, Table};
use crate::sink::backend::cpu::CpuBackend;
use crate::sink::backend::cuda::driver::Driver;
use crate::sink::backend::cuda::CudaBackend;
use crate::sink::backend::{Backend, Precision};
use crate::sink::model::DecoderSpec;
use crate::sink::prompts::{self, PromptSource};
use crate::sink::score::{Input, Settings};

pub const LONG_ABOUT: &str = "Per-head diagnosis of a reference LLM and its VL-adapted (or merged) \
copy: for every head of the chosen layers, its sink before and after and how far its weights moved, \
from one scoring pass over both models.\n\n\
Per head (layer L, query head h, KV head h / (heads / KV heads)):\n  \
g_base_median, g_target_median  median sink gap G of REF's and TARGET's head\n  \
delta_g                         g_target_median - g_base_median (negative: the sink weakened)\n  \
b_gap_median, margin            median B of TARGET's head against REF's; g_base_median - b_gap_median\n  \
pos0_before, pos0_after         mean A[q, 0] over the head's valid observations\n  \
drift q, k, v, o                dW = TARGET - REF on head h's rows of q_proj, its KV head's rows of \
k_proj and v_proj, and its columns of o_proj: fro, op (largest singular value), and both relative \
to REF's slice\n  \
drift q_norm, k_norm            l2, linf and relative l2 of the QK-norm scale acting on the head\n\n\
Across heads: Spearman's rho of delta_g and of the margin with each drift measure, with a seeded \
two-sided permutation p-value. G, B and the observations are those of `sinkmerge score` (see its \
--help); pooling every head's observations gives score's S and margin.";

pub const AFTER_HELP: &str = "Examples:\n  \
sinkmerge heads assets/models/tiny-qwen3/ref assets/models/tiny-qwen3/vl\n  \
sinkmerge heads qwen2.5-vl:ref qwen2.5-vl:lm --last 10 --top 20 --csv heads.csv --heatmap heads.svg\n  \
sinkmerge heads REF TARGET --layers 20-27 --rank-by margin --json";

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Reference LLM: directory, HF repo id (`ORG/NAME[@rev]`) or alias
    #[arg(value_name = "REF")]
    pub reference: String,

    /// The adapted (or merged) model, with REF's geometry and tokenizer
    #[arg(value_name = "TARGET")]
    pub target: String,

    /// Prompt file, one prompt per line [default: the 15 built-in prompts]
    #[arg(long, value_name = "FILE", conflicts_with = "n")]
    pub prompts: Option<PathBuf>,

    /// Draw N prompts from the built-in pool of 100 instead
    #[arg(long, value_name = "N")]
    pub n: Option<usize>,

    /// Seed of the --n draw
    #[arg(long, value_name = "SEED", default_value_t = 0, requires = "n")]
    pub seed: u64,

    /// Render each prompt with REF's chat template (default: raw text)
    #[arg(long)]
    pub chat_template: bool,

    /// The last K decoder layers (all if the model has fewer). Paper: 10
    #[arg(long, value_name = "K", default_value_t = 10)]
    pub last: usize,

    /// These layers instead of the last K: `0-3,7` (inclusive ranges) or `20:28` (a slice)
    #[arg(long, value_name = "LIST", conflicts_with = "last")]
    pub layers: Option<crate::arch::LayerList>,

    /// Heads shown in the text table, most damaged first
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub top: usize,

    /// What ranks damaged heads
    #[arg(long, value_enum, default_value_t = RankBy::DeltaG)]
    pub rank_by: RankBy,

    /// Permutations of each correlation's p-value (0: none)
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    pub permutations: usize,

    /// Seed of the permutations
    #[arg(long, value_name = "SEED", default_value_t = 0)]
    pub permutation_seed: u64,

    /// Print one JSON object: heads, correlations, pair, settings
    #[arg(long)]
    pub json: bool,

    /// Write every head's row as CSV
    #[arg(long, value_name = "FILE.csv")]
    pub csv: Option<PathBuf>,

    /// Write an SVG of layer-by-head grids side by side: ΔG, the margin, and the relative
    /// spectral drift of q and k, each with its own colour scale
    #[arg(long, value_name = "FILE.svg")]
    pub heatmap: Option<PathBuf>,

    /// Arithmetic of the forward pass (see `sinkmerge score --help`)
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,

    /// Where to compute: `cpu`, `cuda` or `cuda:N`
    #[arg(long, value_name = "DEVICE", default_value = "cpu")]
    pub device: Device,
}

#[derive(Serialize)]
struct ReportSettings {
    reference: String,
    target: String,
    prompts: PromptSource,
    n_prompts: usize,
    layers: Vec<usize>,
    rank_by: RankBy,
    permutations: usize,
    permutation_seed: u64,
    chat_template: bool,
    precision: Precision,
    device: Device,
}

#[derive(Serialize)]
struct Report<'a> {
    #[serde(flatten)]
    diagnosis: &'a Diagnosis,
    /// Indices into `heads`, most damaged first.
    ranking: Vec<usize>,
    correlations: Vec<heads::Correlation>,
    settings: ReportSettings,
}

pub fn run(args: Args, progress: bool) -> Result<()> {
    if args.last == 0 {
        bail!("--last must be at least 1");
    }
    let (prompts, source) = prompts::choose(args.prompts.as_deref(), args.n, args.seed)?;
    let ckpts = [
        Checkpoint::open_ref(&args.reference)?,
        Checkpoint::open_ref(&args.target)?,
    ];
    for out in [&args.csv, &args.heatmap].into_iter().flatten() {
        refuse_inside_inputs(out, &ckpts)?;
    }
    let spec = DecoderSpec::from_model_config(&ckpts[0].config)
        .map_err(|e| crate::bad!("{}: {e}", ckpts[0].dir.join("config.json").display()))?;
    let layers = match &args.layers {
        Some(list) => Layers::List(list.resolve(spec.num_layers())?),
        None => Layers::Last(args.last),
    };
    let template = args.chat_template.then_some(ckpts[0].dir.as_path());
    let pair = [
        input(&ckpts[0], &prompts, template)?,
        input(&ckpts[1], &prompts, template)?,
    ];
    same_tokens(&pair[0], &pair[1], None)?;

    let show = progress && !args.json;
    let num_layers = spec.num_layers();
    let diagnosis = match args.device {
        Device::Cpu => run_on(
            &CpuBackend::new(args.precision),
            &pair,
            &layers,
            num_layers,
            show,
        )?,
        Device::Cuda(ordinal) => {
            let backend = CudaBackend::new(Driver::open(ordinal)?, args.precision);
            run_on(&backend, &pair, &layers, num_layers, show)?
        }
    };
    let report = Report {
        ranking: heads::rank(diagnosis.heads.iter().map(|h| &h.sink), args.rank_by),
        correlations: heads::correlations(
            &diagnosis.heads,
            args.permutations,
            args.permutation_seed,
        ),
        settings: ReportSettings {
            reference: ckpts[0].label.clone(),
            target: ckpts[1].label.clone(),
            prompts: source,
            n_prompts: prompts.len(),
            layers: layers.of(spec.num_layers()),
            rank_by: args.rank_by,
            permutations: args.permutations,
            permutation_seed: args.permutation_seed,
            chat_template: args.chat_template,
            precision: args.precision,
            device: args.device,
        },
        diagnosis: &diagnosis,
    };

    // Render every artefact before writing any.
    let csv = args.csv.as_ref().map(|_| render_csv(&diagnosis.heads));
    let svg = match &args.heatmap {
        Some(_) => Some(
            heatmap(&diagnosis, &report.settings)
                .to_svg()
                .map_err(Error::Internal)?,
        ),
        None => None,
    };
    let out = if args.json {
        serde_json::to_string_pretty(&report)
            .map_err(|e| Error::Write(format!("JSON report: {e}")))?
            + "\n"
    } else {
        render_text(&report, args.top)
    };
    if let (Some(path), Some(csv)) = (&args.csv, csv) {
        write_file_atomic(path, csv.as_bytes())?;
    }
    if let (Some(path), Some(svg)) = (&args.heatmap, svg) {
        write_file_atomic(path, svg.as_bytes())?;
    }
    print!("{out}");
    Ok(())
}

fn run_on<B: Backend>(
    backend: &B,
    pair: &[Input; 2],
    layers: &Layers,
    num_layers: usize,
    show: bool,
) -> Result<Diagnosis> {
    let bar = crate::progress::items(2 * num_layers as u64, "layers", show);
    let diagnosis = diagnose(backend, pair, layers, Settings::default(), &|| bar.inc(1))?;
    bar.finish_and_clear();
    Ok(diagnosis)
}

fn opt(x: Option<f64>) -> String {
    x.map_or("-".to_string(), fmt_num)
}

fn render_text(report: &Report, top: usize) -> String {
    let d = report.diagnosis;
    let s = &report.settings;
    let mut out = format!(
        "{} vs {}: {} prompts; layers {}; S {} -> {}; margin {} (all heads pooled)\n\n",
        s.reference,
        s.target,
        s.n_prompts,
        layer_list(&s.layers),
        opt(d.sink_strength[0]),
        opt(d.sink_strength[1]),
        opt(d.pair.margin),
    );
    let mut t = Table::new([
        "rank", "head", "kv", "G_base", "G_target", "dG", "B_gap", "margin", "pos0", "q rel_op",
        "k rel_op", "v rel_op", "o rel_op",
    ]);
    for (rank, &i) in report.ranking.iter().take(top).enumerate() {
        let h: &HeadRow = &d.heads[i];
        let x = &h.sink;
        t.row([
            (rank + 1).to_string(),
            format!("{}.{}", x.layer, x.head),
            h.kv_head.to_string(),
            opt(x.g_base_median),
            opt(x.g_target_median),
            opt(x.delta_g),
            opt(x.b_gap_median),
            opt(x.margin),
            format!("{} -> {}", opt(x.pos0_before), opt(x.pos0_after)),
            opt(h.drift.q.rel_op),
            opt(h.drift.k.rel_op),
            opt(h.drift.v.rel_op),
            opt(h.drift.o.rel_op),
        ]);
    }
    out += &format!(
        "{} of {} heads, most damaged first ({}):\n",
        top.min(d.heads.len()),
        d.heads.len(),
        match s.rank_by {
            RankBy::DeltaG => "lowest dG",
            RankBy::Margin => "lowest margin",
        }
    );
    out += &t.render();
    let mut c = Table::new(["drift", "rho(dG)", "p", "rho(margin)", "p", "heads"]);
    let half = report.correlations.len() / 2;
    let (by_g, by_margin) = report.correlations.split_at(half);
    for (g, m) in by_g.iter().zip(by_margin) {
        c.row([
            g.drift.clone(),
            opt(g.spearman),
            opt(g.p_value),
            opt(m.spearman),
            opt(m.p_value),
            g.n.to_string(),
        ]);
    }
    out += &format!(
        "\nSpearman's rho across heads ({} permutations, seed {}):\n",
        s.permutations, s.permutation_seed
    );
    out += &c.render();
    out
}

/// `0-3,7`-style rendering of a sorted layer list.
fn layer_list(layers: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            layers[i].to_string()
        } else {
            format!("{}-{}", layers[i], layers[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

/// ΔG, the margin and q's and k's relative spectral drift as layer-by-head grids.
fn heatmap(d: &Diagnosis, settings: &ReportSettings) -> Heatmap {
    let heads = d.heads.iter().map(|h| h.sink.head + 1).max().unwrap_or(0);
    let grid = |value: &dyn Fn(&HeadRow) -> Option<f64>| -> Vec<Vec<Option<f64>>> {
        (settings.layers.iter())
            .map(|&l| {
                (0..heads)
                    .map(|h| {
                        (d.heads.iter())
                            .find(|r| r.sink.layer == l && r.sink.head == h)
                            .and_then(value)
                    })
                    .collect()
            })
            .collect()
    };
    let panel = |title: &str, scale: ColourScale, value: &dyn Fn(&HeadRow) -> Option<f64>| Panel {
        title: title.to_string(),
        row_labels: settings.layers.iter().map(usize::to_string).collect(),
        values: grid(value),
        scale,
    };
    Heatmap {
        title: format!(
            "Per-head sink loss and drift: {} vs {}",
            short(&settings.target),
            short(&settings.reference)
        ),
        x_label: "head".into(),
        y_label: "layer".into(),
        scale: Scale::PerPanel,
        panels: vec![
            panel("ΔG (target - ref)", ColourScale::diverging("ΔG"), &|r| {
                r.sink.delta_g
            }),
            panel(
                "margin G_base - B_gap",
                ColourScale::diverging("margin"),
                &|r| r.sink.margin,
            ),
            panel(
                "q drift",
                ColourScale::sequential("||dW_q||_2 / ||W_q||_2"),
                &|r| r.drift.q.rel_op,
            ),
            panel(
                "k drift",
                ColourScale::sequential("||dW_k||_2 / ||W_k||_2"),
                &|r| r.drift.k.rel_op,
            ),
        ],
    }
}

fn render_csv(rows: &[HeadRow]) -> String {
    let mut out = String::from(
        "layer,head,kv_head,g_base_median,g_target_median,delta_g,b_gap_median,margin,\
         pos0_before,pos0_after,n_observations",
    );
    let slices = ["q", "k", "v", "o"];
    for p in slices {
        for m in ["fro", "op", "rel_fro", "rel_op"] {
            out += &format!(",{p}_{m}");
        }
    }
    let norms = rows.first().is_some_and(|r| r.drift.q_norm.is_some());
    if norms {
        out += ",q_norm_l2,q_norm_linf,q_norm_rel_l2,k_norm_l2,k_norm_linf,k_norm_rel_l2";
    }
    out.push('\n');
    let cell = |x: Option<f64>| x.map_or(String::new(), |v| v.to_string());
    for r in rows {
        let s = &r.sink;
        let mut cells = vec![
            s.layer.to_string(),
            s.head.to_string(),
            r.kv_head.to_string(),
            cell(s.g_base_median),
            cell(s.g_target_median),
            cell(s.delta_g),
            cell(s.b_gap_median),
            cell(s.margin),
            cell(s.pos0_before),
            cell(s.pos0_after),
            s.n_observations.to_string(),
        ];
        for d in [&r.drift.q, &r.drift.k, &r.drift.v, &r.drift.o] {
            cells.extend([
                d.fro.to_string(),
                d.op.to_string(),
                cell(d.rel_fro),
                cell(d.rel_op),
            ]);
        }
        for n in [r.drift.q_norm, r.drift.k_norm].into_iter().flatten() {
            cells.extend([n.l2.to_string(), n.linf.to_string(), cell(n.rel_l2)]);
        }
        out += &cells.join(",");
        out.push('\n');
    }
    out
}
