//! `sinkmerge norms`: how far TARGET's weights moved from REF's, per tensor and per module type,
//! optionally against a second pair (`--vs`), as a table, JSON, CSV and an SVG plot.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::analysis::norms::{self, LayerSelection, Metric};
use crate::arch::{LayerList, Module};
use crate::checkpoint::{output, Checkpoint};
use crate::error::Result;
use crate::report::norms::{json_report, plot_svg, render_csv, render_text};

#[derive(Debug, clap::Args)]
#[command(
    about = "Weight drift between two checkpoints: operator/Frobenius norms, stable rank, ratios",
    long_about = "Weight drift dW = TARGET - REF, tensor by tensor: for matrices the Frobenius norm \
`fro`, the operator norm `op` (largest singular value), the stable rank fro²/op², and both \
relative to REF (`rel_fro`, `rel_op`); for vectors (norm scales, biases) `l2`, `linf`, \
`rel_l2` and `ref_linf` = ||REF||_inf (the ||γ||_inf of the paper's Theorem 1). MoE experts \
get a row each and one aggregate row per layer (the experts as one block-diagonal map: \
fro = root sum of squares, op = max). Then median and max per module type over all selected \
layers and over the last-K window; with --vs, the same for a second pair and the per-layer ratio \
pair1/pair2 with its window median (the paper's 4.44x on q_proj, Section 3.1).\n\n\
Tensors are matched by their standard language-model names, so a VLM (any supported layout) \
compares with its reference LLM directly; vision tensors are ignored. Differing vocabulary \
rows (embed_tokens, lm_head) are compared on the common rows with a warning; a tied output \
head with no `lm_head` on disk is compared through its embeddings; every other shape mismatch \
or missing tensor is an error.\n\n\
The operator norm is computed by Lanczos with full reorthogonalization, certified to relative \
accuracy --tol by the residual bound of its Ritz value. Tensors stream one at a time straight \
from the mmap'd files (no f32 copy of any tensor); memory stays at the Lanczos vectors and a few \
row buffers.",
    after_help = "Examples:\n  sinkmerge norms qwen2.5-vl:ref ./qwen2.5-vl-lm --last 10 --modules q_proj,k_proj\n  \
sinkmerge norms BASE VLM_LM --vs BASE TEXT_FT --plot drift.svg --json > drift.json"
)]
pub struct Args {
    /// Reference model: directory, HF repo id (`ORG/NAME[@rev]`) or alias
    pub reference: String,
    /// Target model of the same architecture (a VLM is compared through its language model)
    pub target: String,

    /// A second pair REF2 TARGET2: report it too, and the per-layer ratio pair1/pair2
    #[arg(long, num_args = 2, value_names = ["REF2", "TARGET2"])]
    pub vs: Option<Vec<String>>,

    /// Module types to report, comma-separated (default: all). Names: embed_tokens, lm_head,
    /// norm, input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
    /// post_feedforward_layernorm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, gate_proj,
    /// up_proj, down_proj, router, expert_gate_proj, expert_up_proj, expert_down_proj,
    /// experts_gate_up_proj, experts_down_proj. A projection's bias comes with it.
    #[arg(long, value_delimiter = ',', value_name = "LIST", value_parser = parse_module)]
    pub modules: Option<Vec<Module>>,

    /// Layers to report: `0-3,7` (0-based, inclusive ranges) or `18:28` (a half-open slice, as
    /// in Python; `18:` and `:4` are open-ended). Top-level tensors (embeddings, final norm,
    /// lm_head) are reported only without --layers/--last
    #[arg(long, value_name = "LIST", conflicts_with = "last")]
    pub layers: Option<LayerList>,

    /// Report only the last K layers
    #[arg(long, value_name = "K", allow_negative_numbers = true)]
    pub last: Option<usize>,

    /// Summary window: the model's last K layers (the paper's late-layer window)
    #[arg(long, value_name = "K", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..),
          allow_negative_numbers = true)]
    pub window: u64,

    /// Print one JSON object {"rows": [...], "summary": {...}, ...} instead of tables
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,

    /// Also write every row to FILE as CSV (atomically)
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,

    /// Write an SVG plot: one line per module type, --plot-metric against layer index (with
    /// --vs, the ratio pair1/pair2 of that metric)
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,

    /// Metric plotted by --plot; matrix metrics plot matrices, vector metrics (l2, linf,
    /// rel-l2, ref-linf) plot norm scales and biases
    #[arg(long, value_enum, default_value_t = Metric::Op, value_name = "METRIC")]
    pub plot_metric: Metric,

    /// Relative accuracy of each operator norm, certified by the Lanczos residual bound
    /// (1e-7 to 0.1; f32 arithmetic limits it near 1e-7)
    #[arg(long, value_name = "TOL", default_value_t = 1e-6, value_parser = parse_tol,
          allow_hyphen_values = true)]
    pub tol: f64,
}

fn parse_module(s: &str) -> std::result::Result<Module, String> {
    Module::from_short_name(s.trim()).ok_or_else(|| {
        let names: Vec<&str> = Module::ALL.iter().map(|m| m.short_name()).collect();
        format!("unknown module `{s}`; known: {}", names.join(", "))
    })
}

fn parse_tol(s: &str) -> std::result::Result<f64, String> {
    let tol: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if !(1e-7..=0.1).contains(&tol) {
        return Err(format!("{tol:e} is outside 1e-7..=0.1"));
    }
    Ok(tol)
}

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    let reports = output::Outputs::new(false).files([
        ("--csv", args.csv.as_deref()),
        ("--plot", args.plot.as_deref()),
    ]);
    reports.check_before_inputs()?;
    if let Some(modules) = &args.modules {
        crate::commands::args::refuse_repeats("--modules", modules, |m| {
            m.short_name().to_string()
        })?;
    }
    let reference = Checkpoint::open_ref(&args.reference)?;
    let target = Checkpoint::open_ref(&args.target)?;
    let vs = match &args.vs {
        Some(v) => Some((Checkpoint::open_ref(&v[0])?, Checkpoint::open_ref(&v[1])?)),
        None => None,
    };
    let mut inputs: Vec<&Path> = vec![&reference.dir, &target.dir];
    if let Some((r, t)) = &vs {
        inputs.extend([r.dir.as_path(), t.dir.as_path()]);
    }
    reports.inputs("input", inputs.iter().copied()).check()?;

    let options = norms::Options {
        modules: args.modules.clone(),
        layers: match (args.layers, args.last) {
            (Some(l), _) => LayerSelection::List(l),
            (None, Some(k)) => LayerSelection::Last(k),
            (None, None) => LayerSelection::All,
        },
        window: args.window as usize,
        tol: args.tol,
    };
    let report = norms::run(
        &reference,
        &target,
        vs.as_ref().map(|(r, t)| (r, t)),
        &options,
        progress && !args.json,
    )?;

    // Build every output before writing any, so a failure leaves nothing behind.
    let svg = match &args.plot {
        Some(_) => Some(plot_svg(&report, args.plot_metric)?),
        None => None,
    };
    let csv = args.csv.as_ref().map(|_| render_csv(&report));
    if let (Some(path), Some(svg)) = (&args.plot, svg) {
        output::write_file_atomic(path, svg.as_bytes())?;
    }
    if let (Some(path), Some(csv)) = (&args.csv, csv) {
        output::write_file_atomic(path, csv.as_bytes())?;
    }
    if args.json {
        let value = json_report(&report, args.tol);
        super::emit(out, &crate::report::json_text(&value)?)?;
    } else {
        super::emit(out, &render_text(&report, args.tol))?;
    }
    for w in &report.warnings {
        eprintln!("sinkmerge: warning: {w}");
    }
    Ok(())
}
