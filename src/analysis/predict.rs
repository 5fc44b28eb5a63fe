//! The paper's sink-strength predictor (Sections 3.2-3.3, Appendix E): how well a reference
//! LLM's Sink Strength S ranks and predicts the text-capability change of the VLM built on it.
//!
//! Rank mode is Spearman's rho with average ranks on ties; magnitude mode is the least-squares
//! line `delta = a + b*S`, judged by leave-one-pair-out held-out predictions against a
//! constant-mean baseline under the same leave-one-out. A panel with a `margin` column
//! (G_base - B_gap per pair) also gets the margin-vs-delta correlation of Section 3.4.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::{bad, bail};

/// Panels compiled into the binary: (name, source note, CSV text).
pub const BUILTIN_PANELS: &[(&str, &str, &str)] = &[
    (
        "paper-17",
        "arXiv 2609.00746 Table 11, 17 pairs",
        include_str!("../../assets/panels/paper-panel-17.csv"),
    ),
    (
        "paper-9",
        "arXiv 2609.00746 Table 12, 9 pairs x 4 tasks",
        include_str!("../../assets/panels/paper-panel-9-multitask.csv"),
    ),
    (
        "paper-6",
        "arXiv 2609.00746 Table 10, the 6 headline pairs",
        include_str!("../../assets/panels/paper-panel-6.csv"),
    ),
];

/// The default panel.
pub const DEFAULT_PANEL: &str = "paper-17";

/// The task column used when none is named and the panel has it.
pub const DEFAULT_TASK: &str = "delta_ifeval";

/// A panel: one row per VLM / reference-LLM pair.
#[derive(Debug, Clone)]
pub struct Panel {
    /// Where it came from (built-in name with its source, or the file path).
    pub source: String,
    /// The `delta_*` column names, in file order.
    pub tasks: Vec<String>,
    /// Whether the header has a `margin` column.
    pub has_margin: bool,
    pub rows: Vec<PanelRow>,
}

#[derive(Debug, Clone)]
pub struct PanelRow {
    pub pair: String,
    pub sink_strength: f64,
    /// The margin G_base - B_gap (Section 3.4); `None` without the column or where it is empty.
    pub margin: Option<f64>,
    /// One value per task column; `None` where the cell is empty.
    pub deltas: Vec<Option<f64>>,
}

impl Panel {
    /// A built-in panel by name, or a CSV file.
    pub fn load(spec: &str) -> Result<Panel> {
        if let Some((name, note, text)) = BUILTIN_PANELS.iter().find(|p| p.0 == spec) {
            return Panel::parse(text, &format!("{name} ({note})"));
        }
        let path = Path::new(spec);
        if !path.exists() {
            let names: Vec<&str> = BUILTIN_PANELS.iter().map(|p| p.0).collect();
            bail!(
                "panel `{spec}`: no such file, and not a built-in panel ({})",
                names.join(", ")
            );
        }
        let text = std::fs::read_to_string(path).map_err(|e| Error::read(path, e))?;
        Panel::parse(&text, &path.display().to_string())
    }

    /// Parse CSV text with a header naming `pair`, `sink_strength` and at least one `delta_*`
    /// column, optionally `margin` (other columns are ignored). `source` names the file in errors.
    pub fn parse(text: &str, source: &str) -> Result<Panel> {
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.trim_end_matches('\r')))
            .filter(|(_, l)| !l.trim().is_empty() && !l.starts_with('#'));
        let (header_line, header) = lines
            .next()
            .ok_or_else(|| bad!("{source}: empty panel (expected a CSV header)"))?;
        let header = split_csv(header, source, header_line)?;
        let col = |name: &str| header.iter().position(|h| h.trim() == name);
        let pair_col =
            col("pair").ok_or_else(|| bad!("{source}: the header has no `pair` column"))?;
        let s_col = col("sink_strength")
            .ok_or_else(|| bad!("{source}: the header has no `sink_strength` column"))?;
        let margin_col = col("margin");
        let task_cols: Vec<(usize, String)> = header
            .iter()
            .enumerate()
            .filter(|(_, h)| h.trim().starts_with("delta_"))
            .map(|(i, h)| (i, h.trim().to_string()))
            .collect();
        if task_cols.is_empty() {
            bail!("{source}: the header has no `delta_*` column (e.g. delta_ifeval)");
        }

        let mut rows: Vec<PanelRow> = Vec::new();
        for (line, text) in lines {
            let cells = split_csv(text, source, line)?;
            if cells.len() != header.len() {
                bail!(
                    "{source}:{line}: {} fields, the header has {}",
                    cells.len(),
                    header.len()
                );
            }
            let pair = cells[pair_col].trim().to_string();
            if pair.is_empty() {
                bail!("{source}:{line}: empty `pair`");
            }
            if rows.iter().any(|r| r.pair == pair) {
                bail!("{source}:{line}: pair `{pair}` appears twice");
            }
            let sink_strength = number(&cells[s_col], source, line, "sink_strength")?
                .ok_or_else(|| bad!("{source}:{line}: `sink_strength` is empty for `{pair}`"))?;
            let margin = match margin_col {
                Some(i) => number(&cells[i], source, line, "margin")?,
                None => None,
            };
            let deltas = task_cols
                .iter()
                .map(|(i, name)| number(&cells[*i], source, line, name))
                .collect::<Result<_>>()?;
            rows.push(PanelRow {
                pair,
                sink_strength,
                margin,
                deltas,
            });
        }
        Ok(Panel {
            source: source.to_string(),
            tasks: task_cols.into_iter().map(|(_, n)| n).collect(),
            has_margin: margin_col.is_some(),
            rows,
        })
    }

    /// The column for `task` (`ifeval` or `delta_ifeval`); the default task when `None`
    /// (`delta_ifeval` if present, else the first `delta_*` column).
    pub fn task_index(&self, task: Option<&str>) -> Result<usize> {
        let wanted = match task {
            None => {
                return Ok(self
                    .tasks
                    .iter()
                    .position(|t| t == DEFAULT_TASK)
                    .unwrap_or(0))
            }
            Some(t) if t.starts_with("delta_") => t.to_string(),
            Some(t) => format!("delta_{t}"),
        };
        self.tasks.iter().position(|t| *t == wanted).ok_or_else(|| {
            bad!(
                "{}: no task column `{wanted}`; the panel has {}",
                self.source,
                self.tasks.join(", ")
            )
        })
    }

    /// Keep only the named pairs (matched case-insensitively), in panel order.
    pub fn select(&mut self, pairs: &[String]) -> Result<()> {
        for wanted in pairs {
            if !self
                .rows
                .iter()
                .any(|r| r.pair.eq_ignore_ascii_case(wanted))
            {
                let known: Vec<&str> = self.rows.iter().map(|r| r.pair.as_str()).collect();
                bail!(
                    "{}: no pair `{wanted}`; the panel has {}",
                    self.source,
                    known.join(", ")
                );
            }
        }
        self.rows
            .retain(|r| pairs.iter().any(|p| r.pair.eq_ignore_ascii_case(p)));
        Ok(())
    }

    /// The (pair, S, delta) points of one task; pairs with an empty cell are returned apart.
    pub fn points(&self, task: usize) -> (Vec<Point>, Vec<String>) {
        let mut points = Vec::new();
        let mut skipped = Vec::new();
        for r in &self.rows {
            match r.deltas[task] {
                Some(delta) => points.push(Point {
                    pair: r.pair.clone(),
                    sink_strength: r.sink_strength,
                    delta,
                }),
                None => skipped.push(r.pair.clone()),
            }
        }
        (points, skipped)
    }
}

/// Section 3.4's check: how the margin G_base - B_gap of each pair tracks its delta.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MarginCorrelation {
    /// Pairs with both a margin and a value for the task.
    pub n: usize,
    pub spearman: f64,
    pub pearson: f64,
    /// Pairs with a value for the task but an empty `margin` cell, left out.
    pub skipped: Vec<String>,
}

/// Spearman's rho and Pearson's r of margin against the task's delta over the pairs that have
/// both; `None` when the panel has no `margin` column.
pub fn margin_correlation(panel: &Panel, task: usize) -> Result<Option<MarginCorrelation>> {
    if !panel.has_margin {
        return Ok(None);
    }
    let (mut margin, mut delta, mut skipped) = (Vec::new(), Vec::new(), Vec::new());
    for r in &panel.rows {
        match (r.margin, r.deltas[task]) {
            (Some(m), Some(d)) => {
                margin.push(m);
                delta.push(d);
            }
            (None, Some(_)) => skipped.push(r.pair.clone()),
            (_, None) => {}
        }
    }
    let n = margin.len();
    if n < 3 {
        bail!(
            "the margin correlation needs at least 3 pairs with a margin and a task value, got {n}"
        );
    }
    let constant = || bad!("margin or delta is constant across the pairs that have both");
    Ok(Some(MarginCorrelation {
        n,
        spearman: spearman(&margin, &delta).ok_or_else(constant)?,
        pearson: pearson(&margin, &delta).ok_or_else(constant)?,
        skipped,
    }))
}

/// Split one CSV line (RFC 4180 quoting: `"a, b"` and `""` inside quotes).
pub(crate) fn split_csv(line: &str, source: &str, line_no: usize) -> Result<Vec<String>> {
    let mut cells = Vec::new();
    let mut cell = String::new();
    let mut chars = line.chars().peekable();
    let mut quoted = false;
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cell.push('"');
                chars.next();
            }
            ('"', true) => quoted = false,
            ('"', false) if cell.trim().is_empty() => {
                cell.clear();
                quoted = true;
            }
            (',', false) => cells.push(std::mem::take(&mut cell)),
            (c, _) => cell.push(c),
        }
    }
    if quoted {
        bail!("{source}:{line_no}: unterminated quote");
    }
    cells.push(cell);
    Ok(cells)
}

/// A finite number, or `None` for an empty cell.
pub(crate) fn number(cell: &str, source: &str, line: usize, column: &str) -> Result<Option<f64>> {
    let t = cell.trim();
    if t.is_empty() {
        return Ok(None);
    }
    match t.parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(Some(v)),
        _ => bail!("{source}:{line}: `{column}` is `{t}`, not a finite number"),
    }
}

/// One pair's sink strength and observed delta.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Point {
    pub pair: String,
    pub sink_strength: f64,
    pub delta: f64,
}

/// Ranks 1..=n with ties given the average of the ranks they span (as scipy's `rankdata`).
pub fn average_ranks(x: &[f64]) -> Vec<f64> {
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&a, &b| x[a].total_cmp(&x[b]));
    let mut ranks = vec![0.0; x.len()];
    let mut i = 0;
    while i < order.len() {
        let mut j = i;
        while j + 1 < order.len() && x[order[j + 1]] == x[order[i]] {
            j += 1;
        }
        let rank = (i + j) as f64 / 2.0 + 1.0;
        for &k in &order[i..=j] {
            ranks[k] = rank;
        }
        i = j + 1;
    }
    ranks
}

/// Pearson's correlation; `None` when either side is constant.
pub fn pearson(x: &[f64], y: &[f64]) -> Option<f64> {
    let n = x.len() as f64;
    let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (a, b) in x.iter().zip(y) {
        sxy += (a - mx) * (b - my);
        sxx += (a - mx) * (a - mx);
        syy += (b - my) * (b - my);
    }
    (sxx > 0.0 && syy > 0.0).then(|| sxy / (sxx * syy).sqrt())
}

/// Spearman's rho: Pearson's r of the average ranks.
pub fn spearman(x: &[f64], y: &[f64]) -> Option<f64> {
    pearson(&average_ranks(x), &average_ranks(y))
}

/// Least squares `y = a + b*x`; `None` when x is constant.
pub fn least_squares(x: &[f64], y: &[f64]) -> Option<(f64, f64)> {
    let n = x.len() as f64;
    let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for (a, b) in x.iter().zip(y) {
        sxy += (a - mx) * (b - my);
        sxx += (a - mx) * (a - mx);
    }
    if sxx <= 0.0 {
        return None;
    }
    let b = sxy / sxx;
    Some((my - b * mx, b))
}

/// One pair's leave-one-pair-out prediction.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HeldOut {
    pub pair: String,
    pub sink_strength: f64,
    pub observed: f64,
    /// From the line fitted to the other pairs.
    pub predicted: f64,
    /// The mean of the other pairs' deltas (the constant baseline).
    pub constant: f64,
}

/// The predictor's figures on a panel.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Analysis {
    pub n: usize,
    pub spearman: f64,
    pub pearson: f64,
    pub intercept: f64,
    pub slope: f64,
    /// Mean |observed - held-out line prediction|.
    pub loo_mae: f64,
    /// Mean |observed - held-out mean of the other pairs|.
    pub constant_mae: f64,
    pub held_out: Vec<HeldOut>,
}

/// Fit and cross-validate on `points` (at least three, with S not all equal in any
/// leave-one-out subset).
pub fn analyze(points: &[Point]) -> Result<Analysis> {
    let n = points.len();
    if n < 3 {
        bail!("the predictor needs at least 3 pairs with a value for the task, got {n}");
    }
    let s: Vec<f64> = points.iter().map(|p| p.sink_strength).collect();
    let d: Vec<f64> = points.iter().map(|p| p.delta).collect();
    let constant = || bad!("sink_strength is constant across the panel; nothing to fit");
    let spearman = spearman(&s, &d).ok_or_else(constant)?;
    let pearson = pearson(&s, &d).ok_or_else(constant)?;
    let (intercept, slope) = least_squares(&s, &d).ok_or_else(constant)?;

    let mut held_out = Vec::with_capacity(n);
    for i in 0..n {
        let (s_rest, d_rest): (Vec<f64>, Vec<f64>) =
            (0..n).filter(|&j| j != i).map(|j| (s[j], d[j])).unzip();
        let (a, b) = least_squares(&s_rest, &d_rest).ok_or_else(|| {
            bad!(
                "without `{}` the other pairs all have S = {}; leave-one-out cannot fit a line",
                points[i].pair,
                s_rest[0]
            )
        })?;
        held_out.push(HeldOut {
            pair: points[i].pair.clone(),
            sink_strength: s[i],
            observed: d[i],
            predicted: a + b * s[i],
            constant: d_rest.iter().sum::<f64>() / d_rest.len() as f64,
        });
    }
    let mae = |f: fn(&HeldOut) -> f64| {
        held_out
            .iter()
            .map(|h| (h.observed - f(h)).abs())
            .sum::<f64>()
            / n as f64
    };
    Ok(Analysis {
        n,
        spearman,
        pearson,
        intercept,
        slope,
        loo_mae: mae(|h| h.predicted),
        constant_mae: mae(|h| h.constant),
        held_out,
    })
}

/// What the panel says about a new backbone with sink strength `s`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Query {
    pub sink_strength: f64,
    /// From the full-panel fit.
    pub predicted: f64,
    /// Half-width of the window that defines "similar S".
    pub similar_within: f64,
    /// Panel pairs with |S_i - s| <= similar_within.
    pub similar: Vec<Point>,
    /// Lowest and highest observed delta among the similar pairs.
    pub similar_range: Option<(f64, f64)>,
    /// 1 + the number of panel pairs with a strictly larger S (1 = strongest sink).
    pub rank: usize,
    /// Panel pairs with exactly this S (sharing the rank).
    pub tied: usize,
    /// Ranked among this many backbones (the panel plus the new one).
    pub of: usize,
}

/// Place a new backbone with sink strength `s` on the panel.
pub fn query(points: &[Point], analysis: &Analysis, s: f64, similar_within: f64) -> Query {
    // A hair of slack so that a window edge written in decimal (1.18 + 0.25) is inside.
    let eps = 1e-9 * (1.0 + s.abs());
    let similar: Vec<Point> = points
        .iter()
        .filter(|p| (p.sink_strength - s).abs() <= similar_within + eps)
        .cloned()
        .collect();
    let similar_range = similar.iter().fold(None, |acc: Option<(f64, f64)>, p| {
        Some(match acc {
            None => (p.delta, p.delta),
            Some((lo, hi)) => (lo.min(p.delta), hi.max(p.delta)),
        })
    });
    Query {
        sink_strength: s,
        predicted: analysis.intercept + analysis.slope * s,
        similar_within,
        similar,
        similar_range,
        rank: 1 + points.iter().filter(|p| p.sink_strength > s).count(),
        tied: points.iter().filter(|p| p.sink_strength == s).count(),
        of: points.len() + 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn average_ranks_share_ties() {
        assert_eq!(
            average_ranks(&[1.18, 2.36, 1.18, 0.24]),
            vec![2.5, 4.0, 2.5, 1.0]
        );
    }

    #[test]
    fn least_squares_recovers_a_line() {
        let x = [0.0, 1.0, 2.0, 3.0];
        let y: Vec<f64> = x.iter().map(|v| 2.0 - 0.5 * v).collect();
        let (a, b) = least_squares(&x, &y).unwrap();
        assert!((a - 2.0).abs() < 1e-12 && (b + 0.5).abs() < 1e-12);
        assert!(least_squares(&[1.0, 1.0], &[0.0, 2.0]).is_none());
        assert_eq!(spearman(&x, &y), Some(-1.0));
    }

    #[test]
    fn csv_quotes_and_errors() {
        let p = Panel::parse(
            "pair,sink_strength,delta_a,delta_b\n\"X, big\",1.5,-2,\nY,0.5,-3,1\n",
            "t.csv",
        )
        .unwrap();
        assert_eq!(p.rows[0].pair, "X, big");
        assert_eq!(p.rows[0].deltas, vec![Some(-2.0), None]);
        assert_eq!(p.task_index(Some("b")).unwrap(), 1);
        let (points, skipped) = p.points(1);
        assert_eq!((points.len(), skipped), (1, vec!["X, big".to_string()]));
        let err = Panel::parse("pair,sink_strength,delta_a\nX,abc,1\n", "t.csv").unwrap_err();
        assert!(err.to_string().contains("t.csv:2"), "{err}");
        let err = Panel::parse("pair,sink_strength,delta_a\nX,nan,1\n", "t.csv").unwrap_err();
        assert!(err.to_string().contains("not a finite number"), "{err}");
        let err = Panel::parse("pair,s,delta_a\n", "t.csv").unwrap_err();
        assert!(err.to_string().contains("sink_strength"), "{err}");
    }

    /// The six-pair panel's unrounded IFEval deltas are its net counts over IFEval's 541 prompts,
    /// Delta = -(Lost - Gained) / 541 (arXiv 2609.00746 Section 3.3), and round to the
    /// one-decimal deltas that Table 11 (the 17-pair panel) prints, with the same S.
    #[test]
    fn six_pair_deltas_are_net_counts_over_541_rounding_to_table_11() {
        let text = BUILTIN_PANELS.iter().find(|p| p.0 == "paper-6").unwrap().2;
        let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        let header = split_csv(lines[0], "paper-6", 1).unwrap();
        let net_col = header
            .iter()
            .position(|h| h == "ifeval_lost_minus_gained")
            .unwrap();
        let six = Panel::load("paper-6").unwrap();
        let seventeen = Panel::load("paper-17").unwrap();
        let (task6, task17) = (
            six.task_index(None).unwrap(),
            seventeen.task_index(None).unwrap(),
        );
        assert_eq!((six.rows.len(), lines.len()), (6, 7));
        for (row, line) in six.rows.iter().zip(&lines[1..]) {
            let net: i32 = split_csv(line, "paper-6", 0).unwrap()[net_col]
                .parse()
                .unwrap();
            let delta = row.deltas[task6].unwrap();
            assert_eq!(delta, -f64::from(net) / 541.0 * 100.0, "{}", row.pair);
            let printed = seventeen.rows.iter().find(|r| r.pair == row.pair).unwrap();
            assert_eq!(row.sink_strength, printed.sink_strength, "{}", row.pair);
            let table_11 = printed.deltas[task17].unwrap();
            assert_eq!(
                format!("{delta:.1}"),
                format!("{table_11:.1}"),
                "{}",
                row.pair
            );
            assert_ne!(
                delta, table_11,
                "{}: the panel should be unrounded",
                row.pair
            );
        }
    }

    #[test]
    fn margin_column_is_optional_and_correlated_with_the_delta() {
        let p = Panel::parse(
            "pair,sink_strength,margin,delta_a\nA,0,0,-9\nB,1,1,-6\nC,2,2,-5\nD,3,4,-2\nE,4,3,-2\nF,5,,-1\nG,6,1,\n",
            "t.csv",
        )
        .unwrap();
        let m = margin_correlation(&p, 0).unwrap().unwrap();
        // Ranks (1, 2, 3, 5, 4) against (1, 2, 3, 4.5, 4.5); F has no margin, G no delta.
        assert_eq!((m.n, m.skipped), (5, vec!["F".to_string()]));
        assert!(
            (m.spearman - 0.9746794344808964).abs() < 1e-12,
            "{}",
            m.spearman
        );
        assert!(
            (m.pearson - 0.9649012813540153).abs() < 1e-12,
            "{}",
            m.pearson
        );

        let without = Panel::parse("pair,sink_strength,delta_a\nA,0,1\nB,1,2\nC,2,4\n", "t.csv");
        assert!(margin_correlation(&without.unwrap(), 0).unwrap().is_none());
        let few = Panel::parse(
            "pair,sink_strength,margin,delta_a\nA,0,1,1\nB,1,,2\nC,2,3,4\n",
            "t.csv",
        );
        let err = margin_correlation(&few.unwrap(), 0).unwrap_err();
        assert!(err.to_string().contains("at least 3"), "{err}");
        let err =
            Panel::parse("pair,sink_strength,margin,delta_a\nA,0,x,1\n", "t.csv").unwrap_err();
        assert!(err.to_string().contains("`margin`"), "{err}");
    }
}
