//! The text, JSON, CSV and SVG reports of `sinkmerge heads` (`docs/commands/heads.md`).

use std::borrow::Cow;

use serde::{Deserialize, Deserializer, Serialize};

use super::heatmap::{ColourScale, Heatmap, Panel, Scale};
use super::{fmt_opt, short_label, Table};
use crate::analysis::heads::{Correlation, Diagnosis, HeadRow, RankBy};
use crate::error::{Error, Result};
use crate::forward::device::ComputeDevice;
use crate::forward::precision::Precision;
use crate::sink::prompts::PromptSource;

/// `settings` of the JSON report.
#[derive(Serialize, Deserialize)]
pub struct HeadsReportSettings {
    pub reference: String,
    pub target: String,
    pub prompts: PromptSource,
    pub n_prompts: usize,
    pub layers: Vec<usize>,
    pub rank_by: RankBy,
    pub permutations: usize,
    pub permutation_seed: u64,
    pub chat_template: bool,
    pub precision: Precision,
    #[serde(deserialize_with = "device_named")]
    pub device: ComputeDevice,
}

/// A device as `--device` names it and the report writes it (`cpu`, `cuda:N`).
fn device_named<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<ComputeDevice, D::Error> {
    let name = String::deserialize(d)?;
    name.parse().map_err(serde::de::Error::custom)
}

/// The whole report: the diagnosis, its ranking and correlations, and the settings. The command
/// writes it from its diagnosis (borrowed); `reproduce` reads it back (owned).
#[derive(Serialize, Deserialize)]
pub struct HeadsReport<'a> {
    #[serde(flatten)]
    pub diagnosis: Cow<'a, Diagnosis>,
    /// Indices into `heads`, most damaged first.
    pub ranking: Vec<usize>,
    pub correlations: Vec<Correlation>,
    pub settings: HeadsReportSettings,
}

/// The text report: the `top` most damaged heads, then the correlations.
pub fn render_text(report: &HeadsReport, top: usize) -> String {
    let d = &*report.diagnosis;
    let s = &report.settings;
    let mut out = format!(
        "{} vs {}: {} prompts; layers {}; S {} -> {}; margin {} (all heads pooled)\n\n",
        s.reference,
        s.target,
        s.n_prompts,
        layer_list(&s.layers),
        fmt_opt(d.sink_strength[0]),
        fmt_opt(d.sink_strength[1]),
        fmt_opt(d.pair.margin),
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
            fmt_opt(x.g_base_median),
            fmt_opt(x.g_target_median),
            fmt_opt(x.delta_g),
            fmt_opt(x.b_gap_median),
            fmt_opt(x.margin),
            format!("{} -> {}", fmt_opt(x.pos0_before), fmt_opt(x.pos0_after)),
            fmt_opt(h.drift.q.rel_op),
            fmt_opt(h.drift.k.rel_op),
            fmt_opt(h.drift.v.rel_op),
            fmt_opt(h.drift.o.rel_op),
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
            fmt_opt(g.spearman),
            fmt_opt(g.p_value),
            fmt_opt(m.spearman),
            fmt_opt(m.p_value),
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

/// `--heatmap`: ΔG, the margin and q's and k's relative spectral drift, side by side.
pub fn heatmap_svg(d: &Diagnosis, settings: &HeadsReportSettings) -> Result<String> {
    heatmap(d, settings).to_svg().map_err(Error::Internal)
}

/// ΔG, the margin and q's and k's relative spectral drift as layer-by-head grids.
fn heatmap(d: &Diagnosis, settings: &HeadsReportSettings) -> Heatmap {
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
            short_label(&settings.target),
            short_label(&settings.reference)
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

/// `--csv`: every head's row, drift included.
pub fn render_csv(rows: &[HeadRow]) -> String {
    let mut out = String::from(
        "layer,head,kv_head,g_base_median,g_target_median,delta_g,b_gap_median,margin,\
         pos0_before,pos0_after,n_observations,n_observations_base,n_observations_target",
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
            s.n_observations_base.to_string(),
            s.n_observations_target.to_string(),
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
