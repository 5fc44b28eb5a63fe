//! SVG heatmaps: one panel per model, a grid of cells (e.g. layer x head), one shared colour scale.

use plotters::prelude::*;

use super::plot::padded_range;

/// One panel: `values[row][col]`, `None` for a cell without data (drawn grey).
#[derive(Debug, Clone)]
pub struct Panel {
    pub title: String,
    /// The row labels (e.g. layer indices), top row first.
    pub row_labels: Vec<String>,
    pub values: Vec<Vec<Option<f64>>>,
}

#[derive(Debug, Clone)]
pub struct Heatmap {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    /// What the colour shows, for the colour bar.
    pub value_label: String,
    pub panels: Vec<Panel>,
}

/// Viridis-like colour for `t` in [0, 1] (piecewise linear through five viridis anchors).
pub fn viridis(t: f64) -> RGBColor {
    const ANCHORS: [(f64, f64, f64); 5] = [
        (68.0, 1.0, 84.0),
        (59.0, 82.0, 139.0),
        (33.0, 145.0, 140.0),
        (94.0, 201.0, 98.0),
        (253.0, 231.0, 37.0),
    ];
    let t = if t.is_finite() {
        t.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let x = t * (ANCHORS.len() - 1) as f64;
    let i = (x.floor() as usize).min(ANCHORS.len() - 2);
    let f = x - i as f64;
    let (a, b) = (ANCHORS[i], ANCHORS[i + 1]);
    let mix = |p: f64, q: f64| (p + (q - p) * f).round() as u8;
    RGBColor(mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

fn err(e: impl std::fmt::Display) -> String {
    format!("heatmap: {e}")
}

impl Heatmap {
    pub fn to_svg(&self) -> Result<String, String> {
        let n = self.panels.len().max(1);
        let width = 150 + 320 * n as u32;
        let rows = self
            .panels
            .iter()
            .map(|p| p.values.len())
            .max()
            .unwrap_or(1);
        let height = (160 + 22 * rows as u32).clamp(320, 1400);
        let range = padded_range(
            self.panels
                .iter()
                .flat_map(|p| p.values.iter().flatten().flatten().copied()),
        );
        let (lo, hi) = (range.start, range.end);
        let scale = |v: f64| (v - lo) / (hi - lo);
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
            root.fill(&WHITE).map_err(err)?;
            let root = root.titled(&self.title, ("sans-serif", 20)).map_err(err)?;
            let (panels_area, bar_area) = root.split_horizontally(width - 120);
            for (area, panel) in panels_area.split_evenly((1, n)).iter().zip(&self.panels) {
                let cols = panel.values.iter().map(Vec::len).max().unwrap_or(1);
                let nrows = panel.values.len().max(1);
                // Cell (r, c) spans [c - 0.5, c + 0.5]: integer ticks land on cell centres.
                let mut chart = ChartBuilder::on(area)
                    .caption(&panel.title, ("sans-serif", 14))
                    .margin(8)
                    .x_label_area_size(36)
                    .y_label_area_size(48)
                    .build_cartesian_2d(-0.5f64..cols as f64 - 0.5, -0.5f64..nrows as f64 - 0.5)
                    .map_err(err)?;
                let labels = panel.row_labels.clone();
                let integer = |v: f64| (v - v.round()).abs() < 1e-9;
                chart
                    .configure_mesh()
                    .disable_mesh()
                    .x_desc(&self.x_label)
                    .y_desc(&self.y_label)
                    .x_labels(cols.min(16))
                    .y_labels(nrows.min(24))
                    .label_style(("sans-serif", 12))
                    .x_label_formatter(&|x| {
                        if integer(*x) {
                            format!("{}", x.round() as i64)
                        } else {
                            String::new()
                        }
                    })
                    .y_label_formatter(&|y| {
                        // Row 0 is drawn at the top.
                        let r = nrows as f64 - 1.0 - y.round();
                        if integer(*y) && r >= 0.0 {
                            labels.get(r as usize).cloned().unwrap_or_default()
                        } else {
                            String::new()
                        }
                    })
                    .draw()
                    .map_err(err)?;
                chart
                    .draw_series(panel.values.iter().enumerate().flat_map(|(r, row)| {
                        let y = (nrows - 1 - r) as f64;
                        row.iter().enumerate().map(move |(c, v)| {
                            let colour = match v {
                                Some(v) => viridis(scale(*v)),
                                None => RGBColor(200, 200, 200),
                            };
                            let x = c as f64;
                            Rectangle::new(
                                [(x - 0.5, y - 0.5), (x + 0.5, y + 0.5)],
                                colour.filled(),
                            )
                        })
                    }))
                    .map_err(err)?;
            }
            // Colour bar.
            let mut bar = ChartBuilder::on(&bar_area)
                .margin(12)
                .margin_top(40)
                .margin_bottom(44)
                .y_label_area_size(70)
                .build_cartesian_2d(0f64..1f64, lo..hi)
                .map_err(err)?;
            bar.configure_mesh()
                .disable_mesh()
                .disable_x_axis()
                .label_style(("sans-serif", 12))
                .axis_desc_style(("sans-serif", 13))
                .y_desc(&self.value_label)
                .draw()
                .map_err(err)?;
            let steps = 64;
            bar.draw_series((0..steps).map(|i| {
                let a = lo + (hi - lo) * i as f64 / steps as f64;
                let b = lo + (hi - lo) * (i + 1) as f64 / steps as f64;
                Rectangle::new(
                    [(0.0, a), (1.0, b)],
                    viridis((i as f64 + 0.5) / steps as f64).filled(),
                )
            }))
            .map_err(err)?;
            root.present().map_err(err)?;
        }
        Ok(svg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heatmap_draws_every_panel_and_cell() {
        let map = Heatmap {
            title: "per-head median G".into(),
            x_label: "head".into(),
            y_label: "layer".into(),
            value_label: "median G".into(),
            panels: vec![
                Panel {
                    title: "ref".into(),
                    row_labels: vec!["2".into(), "3".into()],
                    values: vec![vec![Some(1.0), Some(-2.0)], vec![None, Some(4.0)]],
                },
                Panel {
                    title: "vl".into(),
                    row_labels: vec!["2".into(), "3".into()],
                    values: vec![vec![Some(0.5), Some(0.0)], vec![Some(3.0), Some(1.0)]],
                },
            ],
        };
        let svg = map.to_svg().unwrap();
        assert!(svg.contains("ref") && svg.contains("vl") && svg.contains("median G"));
        assert_eq!(viridis(0.0), RGBColor(68, 1, 84));
        assert_eq!(viridis(1.0), RGBColor(253, 231, 37));
    }
}
