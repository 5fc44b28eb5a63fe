//! SVG charts (plotters' SVG backend: no fonts or system libraries needed).

use plotters::coord::Shift;
use plotters::prelude::*;

/// One named line of points.
#[derive(Debug, Clone)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// Lines against a shared x axis (e.g. a norm against layer index, one line per module).
#[derive(Debug, Clone)]
pub struct LineChart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
}

/// Labelled points with an optional fitted line `y = intercept + slope * x`.
#[derive(Debug, Clone)]
pub struct Scatter {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub points: Vec<(f64, f64, String)>,
    pub line: Option<(f64, f64)>,
    /// One more point, drawn apart in another colour (a new backbone placed on a panel).
    pub highlight: Option<(f64, f64, String)>,
}

/// One bar per labelled value; a label without a value keeps its slot (and every bar its
/// colour), so stacked charts of the same labels line up.
#[derive(Debug, Clone)]
pub struct BarChart {
    pub title: String,
    pub y_label: String,
    pub bars: Vec<(String, Option<f64>)>,
}

const SIZE: (u32, u32) = (900, 560);

/// A colour per series index, distinguishable in print.
pub fn colour(i: usize) -> RGBColor {
    const PALETTE: [RGBColor; 10] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
    ];
    PALETTE[i % PALETTE.len()]
}

/// Axis range covering `values` with 5% padding (and a non-empty span).
pub fn padded_range(values: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return 0.0..1.0;
    }
    let span = if hi > lo { hi - lo } else { lo.abs().max(1.0) };
    (lo - 0.05 * span)..(hi + 0.05 * span)
}

fn err(e: impl std::fmt::Display) -> String {
    format!("plot: {e}")
}

/// A series' legend entry as every chart here draws it: a short line in its colour `c`.
pub fn legend_line(c: RGBColor) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
}

/// Draw `chart`'s legend at `position`, on a light box with a black border.
pub fn draw_legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> Result<(), plotters::drawing::DrawingAreaErrorKind<DB::ErrorType>> {
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(position)
        .draw()
}

impl LineChart {
    pub fn to_svg(&self) -> Result<String, String> {
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
            root.fill(&WHITE).map_err(err)?;
            self.draw_on(&root)?;
            root.present().map_err(err)?;
        }
        Ok(svg)
    }

    /// Draw the chart into `area` (part of a larger figure).
    pub fn draw_on(&self, area: &DrawingArea<SVGBackend<'_>, Shift>) -> Result<(), String> {
        let xs = padded_range(
            self.series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.0)),
        );
        let ys = padded_range(
            self.series
                .iter()
                .flat_map(|s| s.points.iter().map(|p| p.1)),
        );
        let (xs_start, xs_end) = (xs.start, xs.end);
        let mut chart = ChartBuilder::on(area)
            .caption(&self.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(xs, ys)
            .map_err(err)?;
        // Integer x data (layer indices) get integer ticks only.
        let integer_x = self
            .series
            .iter()
            .flat_map(|s| s.points.iter())
            .all(|p| p.0.fract() == 0.0);
        let x_span = (xs_end - xs_start).round() as usize;
        chart
            .configure_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .x_labels(if integer_x {
                (x_span + 1).clamp(2, 12)
            } else {
                10
            })
            .x_label_formatter(&|x| {
                if !integer_x {
                    format!("{x}")
                } else if (x - x.round()).abs() < 1e-9 {
                    format!("{}", x.round() as i64)
                } else {
                    String::new()
                }
            })
            .draw()
            .map_err(err)?;
        for (i, s) in self.series.iter().enumerate() {
            let c = colour(i);
            chart
                .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
                .map_err(err)?
                .label(&s.label)
                .legend(legend_line(c));
            chart
                .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, c.filled())))
                .map_err(err)?;
        }
        draw_legend(&mut chart, SeriesLabelPosition::UpperLeft).map_err(err)?;
        Ok(())
    }
}

/// A chart that draws into part of a larger figure.
pub trait Chart {
    fn draw_on(&self, area: &DrawingArea<SVGBackend<'_>, Shift>) -> Result<(), String>;
}

impl Chart for LineChart {
    fn draw_on(&self, area: &DrawingArea<SVGBackend<'_>, Shift>) -> Result<(), String> {
        LineChart::draw_on(self, area)
    }
}

impl Chart for BarChart {
    fn draw_on(&self, area: &DrawingArea<SVGBackend<'_>, Shift>) -> Result<(), String> {
        BarChart::draw_on(self, area)
    }
}

/// Charts stacked vertically in one SVG, each `height` pixels tall.
fn stacked<C: Chart>(charts: &[C], height: u32) -> Result<String, String> {
    let mut svg = String::new();
    {
        let size = (SIZE.0, height * charts.len().max(1) as u32);
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        for (area, chart) in root
            .split_evenly((charts.len().max(1), 1))
            .iter()
            .zip(charts)
        {
            chart.draw_on(area)?;
        }
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// Several line charts stacked vertically in one SVG.
pub fn stacked_svg(charts: &[LineChart]) -> Result<String, String> {
    stacked(charts, SIZE.1)
}

/// Several bar charts stacked vertically in one SVG (lower than line charts: bars need less).
pub fn stacked_bars_svg(charts: &[BarChart]) -> Result<String, String> {
    stacked(charts, 420)
}

impl Scatter {
    pub fn to_svg(&self) -> Result<String, String> {
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
            root.fill(&WHITE).map_err(err)?;
            let all = || self.points.iter().chain(&self.highlight);
            let xs = padded_range(all().map(|p| p.0));
            let ys = padded_range(all().map(|p| p.1));
            let mut chart = ChartBuilder::on(&root)
                .caption(&self.title, ("sans-serif", 20))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(70)
                .build_cartesian_2d(xs.clone(), ys)
                .map_err(err)?;
            chart
                .configure_mesh()
                .x_desc(&self.x_label)
                .y_desc(&self.y_label)
                .draw()
                .map_err(err)?;
            if let Some((a, b)) = self.line {
                let c = colour(3);
                chart
                    .draw_series(LineSeries::new(
                        [(xs.start, a + b * xs.start), (xs.end, a + b * xs.end)],
                        c.stroke_width(2),
                    ))
                    .map_err(err)?
                    .label(format!("fit: y = {a:.2} + {b:.2} x"))
                    .legend(legend_line(c));
            }
            let c = colour(0);
            chart
                .draw_series(self.points.iter().map(|(x, y, label)| {
                    EmptyElement::at((*x, *y))
                        + Circle::new((0, 0), 4, c.filled())
                        + Text::new(label.clone(), (6, -12), ("sans-serif", 12))
                }))
                .map_err(err)?;
            if let Some((x, y, label)) = &self.highlight {
                let c = colour(1);
                chart
                    .draw_series(std::iter::once(
                        EmptyElement::at((*x, *y))
                            + Circle::new((0, 0), 7, c.filled())
                            + Text::new(label.clone(), (10, -16), ("sans-serif", 15)),
                    ))
                    .map_err(err)?;
            }
            if self.line.is_some() {
                draw_legend(&mut chart, SeriesLabelPosition::MiddleRight).map_err(err)?;
            }
            root.present().map_err(err)?;
        }
        Ok(svg)
    }
}

impl BarChart {
    /// Draw the bars into `area`, from zero, labelled under each bar.
    pub fn draw_on(&self, area: &DrawingArea<SVGBackend<'_>, Shift>) -> Result<(), String> {
        let n = self.bars.len().max(1);
        let ys = padded_range(self.bars.iter().filter_map(|b| b.1).chain([0.0]));
        let mut chart = ChartBuilder::on(area)
            .caption(&self.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..n as f64, ys)
            .map_err(err)?;
        let labels: Vec<String> = self.bars.iter().map(|b| b.0.clone()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_desc(&self.y_label)
            .x_labels(2 * n + 1)
            .x_label_formatter(&|x| {
                // Ticks fall on bar centres (i + 0.5) and edges; only centres are named.
                let i = x - 0.5;
                if (i - i.round()).abs() < 1e-6 && i >= 0.0 {
                    labels.get(i.round() as usize).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .draw()
            .map_err(err)?;
        chart
            .draw_series(self.bars.iter().enumerate().filter_map(|(i, (_, v))| {
                let x = i as f64;
                Some(Rectangle::new(
                    [(x + 0.15, 0.0), (x + 0.85, (*v)?)],
                    colour(i).filled(),
                ))
            }))
            .map_err(err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_render_their_labels() {
        let chart = LineChart {
            title: "drift".into(),
            x_label: "layer".into(),
            y_label: "op norm".into(),
            series: vec![Series {
                label: "q_proj".into(),
                points: vec![(0.0, 1.0), (1.0, 2.0)],
            }],
        };
        let svg = chart.to_svg().unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("q_proj") && svg.contains("layer"));
        let scatter = Scatter {
            title: "S vs delta".into(),
            x_label: "S".into(),
            y_label: "delta".into(),
            points: vec![
                (1.0, -9.6, "Qwen2.5-VL".into()),
                (2.36, -5.4, "Qwen3-VL".into()),
            ],
            line: Some((-12.0, 3.0)),
            highlight: Some((0.5, -20.0, "new".into())),
        };
        let svg = scatter.to_svg().unwrap();
        assert!(svg.contains("Qwen3-VL") && svg.contains("fit") && svg.contains("new"));
        let bars = BarChart {
            title: "S per model".into(),
            y_label: "S".into(),
            bars: vec![("ref".into(), None), ("vlm_lm".into(), Some(-2.2))],
        };
        let svg = stacked_bars_svg(&[bars]).unwrap();
        assert!(svg.contains("vlm_lm") && svg.contains("<rect"));
    }
}
