//! SVG heatmaps: one or more panels of cells (e.g. layer x head), each with a colour bar.
//!
//! [`Scale::Shared`] puts every panel on one colour scale with one colour bar at the right (the
//! same quantity for several models, as `score --heatmap` draws it); [`Scale::PerPanel`] gives
//! each panel its own range and its own colour bar beside it (quantities in different units side
//! by side). Each [`ColourScale`] says what it shows and whether it is sequential (viridis) or
//! diverging (blue-white-red, centred on 0, for signed quantities such as a change).

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::plot::padded_range;

/// How values map to colours.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ColourMap {
    /// Viridis over the values' padded range: for magnitudes.
    #[default]
    Sequential,
    /// Blue (negative), white (0), red (positive) over a range symmetric about 0: for signed values.
    Diverging,
}

/// A colour scale: the colour bar's title and its colour map.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ColourScale {
    pub label: String,
    pub map: ColourMap,
}

impl ColourScale {
    pub fn sequential(label: impl Into<String>) -> ColourScale {
        ColourScale {
            label: label.into(),
            map: ColourMap::Sequential,
        }
    }

    pub fn diverging(label: impl Into<String>) -> ColourScale {
        ColourScale {
            label: label.into(),
            map: ColourMap::Diverging,
        }
    }
}

/// Which colour scales the panels use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scale {
    /// One scale over every panel's values and one colour bar at the right; the panels' own
    /// `scale` is not used.
    Shared(ColourScale),
    /// Each panel's own range and colour bar, from its `scale`.
    PerPanel,
}

/// One panel: `values[row][col]`, `None` for a cell without data (drawn grey).
#[derive(Debug, Clone, Default)]
pub struct Panel {
    pub title: String,
    /// The row labels (e.g. layer indices), top row first.
    pub row_labels: Vec<String>,
    pub values: Vec<Vec<Option<f64>>>,
    /// This panel's colour scale under [`Scale::PerPanel`].
    pub scale: ColourScale,
}

#[derive(Debug, Clone)]
pub struct Heatmap {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub scale: Scale,
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
    piecewise(&ANCHORS, t)
}

/// Blue-white-red colour for `t` in [0, 1], white at 0.5 (the ends of ColorBrewer's RdBu).
pub fn diverging(t: f64) -> RGBColor {
    const ANCHORS: [(f64, f64, f64); 3] = [
        (33.0, 102.0, 172.0),
        (255.0, 255.0, 255.0),
        (178.0, 24.0, 43.0),
    ];
    piecewise(&ANCHORS, t)
}

fn piecewise(anchors: &[(f64, f64, f64)], t: f64) -> RGBColor {
    let t = if t.is_finite() {
        t.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let x = t * (anchors.len() - 1) as f64;
    let i = (x.floor() as usize).min(anchors.len() - 2);
    let f = x - i as f64;
    let (a, b) = (anchors[i], anchors[i + 1]);
    let mix = |p: f64, q: f64| (p + (q - p) * f).round() as u8;
    RGBColor(mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

/// Grey for cells without data (distinct from the diverging map's white).
const MISSING: RGBColor = RGBColor(200, 200, 200);

impl ColourMap {
    pub fn colour(self, t: f64) -> RGBColor {
        match self {
            ColourMap::Sequential => viridis(t),
            ColourMap::Diverging => diverging(t),
        }
    }

    /// The value range the colours span: the padded range of `values`, or for the diverging
    /// map the padded range symmetric about 0 (so that 0 is white).
    pub fn range(self, values: impl Iterator<Item = f64>) -> (f64, f64) {
        match self {
            ColourMap::Sequential => {
                let r = padded_range(values);
                (r.start, r.end)
            }
            ColourMap::Diverging => {
                let m = values
                    .filter(|v| v.is_finite())
                    .fold(0f64, |m, v| m.max(v.abs()));
                let m = if m > 0.0 { 1.05 * m } else { 1.0 };
                (-m, m)
            }
        }
    }
}

fn err(e: impl std::fmt::Display) -> String {
    format!("heatmap: {e}")
}

/// Width of a panel's plot, without its colour bar.
const PANEL_WIDTH: u32 = 320;
/// Tick-label font size as given to plotters, and the SVG size it writes (plotters divides by 1.24).
const TICK_FONT: f64 = 12.0;
const BAR_TITLE_FONT: f64 = 13.0;
fn svg_px(font: f64) -> f64 {
    font / 1.24
}
/// A generous width estimate of `text` in a sans-serif font of SVG size `px`: 0.6 em per
/// character (digits are 0.556 em in Helvetica / DejaVu Sans, '-' and '.' narrower).
fn text_width(text: &str, px: f64) -> f64 {
    0.6 * px * text.chars().count() as f64
}

/// Colour-bar ticks over [lo, hi]: 1-2-5 steps, at most about 7 ticks, with the labels printed
/// to the step's precision (so no two labels are equal).
pub(super) fn ticks(lo: f64, hi: f64) -> Vec<(f64, String)> {
    let span = hi - lo;
    if !(span > 0.0 && span.is_finite()) {
        return vec![(lo, format!("{lo}"))];
    }
    let raw = span / 6.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    let mut out = Vec::new();
    let mut k = (lo / step).ceil();
    while k * step <= hi + 1e-9 * span {
        let v = k * step;
        let v = if v.abs() < 1e-9 * step { 0.0 } else { v };
        out.push((v, format!("{v:.decimals$}")));
        k += 1.0;
    }
    out
}

/// The pixel layout of one colour bar: the gradient's x range inside its block, the x where the
/// tick labels start, and where its rotated title goes; `width` is the whole block's.
struct BarLayout {
    bar: (i32, i32),
    labels_x: i32,
    title_x: i32,
    width: u32,
    ticks: Vec<(f64, String)>,
}

impl BarLayout {
    fn new(lo: f64, hi: f64) -> BarLayout {
        let ticks = ticks(lo, hi);
        let widest = ticks
            .iter()
            .map(|(_, t)| text_width(t, svg_px(TICK_FONT)))
            .fold(0f64, f64::max);
        let bar = (10, 28);
        let labels_x = bar.1 + 6;
        let title_x = labels_x + widest.ceil() as i32 + 8;
        let width = (title_x as f64 + svg_px(BAR_TITLE_FONT) * 1.2 + 8.0).ceil() as u32;
        BarLayout {
            bar,
            labels_x,
            title_x,
            width,
            ticks,
        }
    }

    /// Draw the bar for [lo, hi] in `map` into `area` (a block `self.width` wide).
    fn draw(
        &self,
        area: &DrawingArea<SVGBackend<'_>, Shift>,
        scale: &ColourScale,
        (lo, hi): (f64, f64),
    ) -> Result<(), String> {
        let (_, h) = area.dim_in_pixel();
        let (top, bottom) = (40i32, h as i32 - 44);
        let y_of = |v: f64| bottom - ((v - lo) / (hi - lo) * (bottom - top) as f64).round() as i32;
        let steps = 64;
        for i in 0..steps {
            let (a, b) = (i as f64 / steps as f64, (i + 1) as f64 / steps as f64);
            let (ya, yb) = (y_of(lo + (hi - lo) * a), y_of(lo + (hi - lo) * b));
            area.draw(&Rectangle::new(
                [(self.bar.0, yb), (self.bar.1, ya)],
                scale.map.colour((i as f64 + 0.5) / steps as f64).filled(),
            ))
            .map_err(err)?;
        }
        area.draw(&Rectangle::new(
            [(self.bar.0, top), (self.bar.1, bottom)],
            BLACK.stroke_width(1),
        ))
        .map_err(err)?;
        let style = TextStyle::from(("sans-serif", TICK_FONT).into_font())
            .pos(Pos::new(HPos::Left, VPos::Center));
        for (v, label) in &self.ticks {
            let y = y_of(*v);
            area.draw(&PathElement::new(
                vec![(self.bar.1, y), (self.bar.1 + 4, y)],
                BLACK.stroke_width(1),
            ))
            .map_err(err)?;
            area.draw(&Text::new(label.clone(), (self.labels_x, y), style.clone()))
                .map_err(err)?;
        }
        let title = TextStyle::from(
            ("sans-serif", BAR_TITLE_FONT)
                .into_font()
                .transform(FontTransform::Rotate270),
        )
        .pos(Pos::new(HPos::Center, VPos::Top));
        area.draw(&Text::new(
            scale.label.clone(),
            (self.title_x, (top + bottom) / 2),
            title,
        ))
        .map_err(err)?;
        Ok(())
    }
}

impl Heatmap {
    pub fn to_svg(&self) -> Result<String, String> {
        let rows = self
            .panels
            .iter()
            .map(|p| p.values.len())
            .max()
            .unwrap_or(1);
        let height = (160 + 22 * rows as u32).clamp(320, 1400);
        let values = |p: &Panel| {
            p.values
                .iter()
                .flatten()
                .flatten()
                .copied()
                .collect::<Vec<f64>>()
        };
        // The colour scales with their ranges: one for all panels, or one per panel.
        let scales: Vec<(&ColourScale, (f64, f64))> = match &self.scale {
            Scale::Shared(scale) => {
                vec![(scale, scale.map.range(self.panels.iter().flat_map(values)))]
            }
            Scale::PerPanel => (self.panels.iter())
                .map(|p| (&p.scale, p.scale.map.range(values(p).into_iter())))
                .collect(),
        };
        let bars: Vec<BarLayout> = scales
            .iter()
            .map(|(_, r)| BarLayout::new(r.0, r.1))
            .collect();
        let n = self.panels.len().max(1) as u32;
        let width = 30 + PANEL_WIDTH * n + bars.iter().map(|b| b.width).sum::<u32>();
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
            root.fill(&WHITE).map_err(err)?;
            let root = root.titled(&self.title, ("sans-serif", 20)).map_err(err)?;
            // Columns from the left: the panels, each followed by its bar, or all the panels and
            // then the shared bar; the first panel takes the 30 spare pixels.
            let mut rest = root.clone();
            let mut column = |w: u32| {
                let (left, right) = rest.split_horizontally(w);
                rest = right;
                left
            };
            for (i, panel) in self.panels.iter().enumerate() {
                let (scale, range) = scales[i.min(scales.len() - 1)];
                let area = column(PANEL_WIDTH + if i == 0 { 30 } else { 0 });
                self.draw_panel(&area, panel, scale.map, range)?;
                if matches!(self.scale, Scale::PerPanel) {
                    bars[i].draw(&column(bars[i].width), scale, range)?;
                }
            }
            if let Scale::Shared(scale) = &self.scale {
                bars[0].draw(&column(bars[0].width), scale, scales[0].1)?;
            }
            root.present().map_err(err)?;
        }
        Ok(svg)
    }

    fn draw_panel(
        &self,
        area: &DrawingArea<SVGBackend<'_>, Shift>,
        panel: &Panel,
        map: ColourMap,
        (lo, hi): (f64, f64),
    ) -> Result<(), String> {
        let scale = |v: f64| (v - lo) / (hi - lo);
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
                        Some(v) => map.colour(scale(*v)),
                        None => MISSING,
                    };
                    let x = c as f64;
                    Rectangle::new([(x - 0.5, y - 0.5), (x + 0.5, y + 0.5)], colour.filled())
                })
            }))
            .map_err(err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One `<text>` element of an SVG: its horizontal extent (estimated as [`text_width`]
    /// does), its anchor, its content, and whether it is rotated.
    #[derive(Debug)]
    struct SvgText {
        left: f64,
        right: f64,
        anchor: String,
        rotated: bool,
        text: String,
    }

    fn attr(tag: &str, name: &str) -> Option<String> {
        let start = tag.find(&format!(" {name}=\""))? + name.len() + 3;
        let end = tag[start..].find('"')? + start;
        Some(tag[start..end].to_string())
    }

    fn svg_width(svg: &str) -> f64 {
        attr(&svg[..svg.find('>').unwrap()], "width")
            .unwrap()
            .parse()
            .unwrap()
    }

    fn texts(svg: &str) -> Vec<SvgText> {
        let mut out = Vec::new();
        let mut rest = svg;
        while let Some(i) = rest.find("<text ") {
            let after = &rest[i..];
            let close = after.find('>').unwrap();
            let tag = &after[..close];
            let end = after.find("</text>").unwrap();
            let text = after[close + 1..end].trim().to_string();
            let x: f64 = attr(tag, "x").unwrap().parse().unwrap();
            let px: f64 = attr(tag, "font-size").unwrap().parse().unwrap();
            let anchor = attr(tag, "text-anchor").unwrap();
            let transform = attr(tag, "transform");
            let rotated = transform.is_some();
            let w = text_width(&text, px);
            let (left, right) = if let Some(tr) = transform {
                // Vertical text is one line (1 em) across. Under rotate(270) the text's downward
                // direction is +x, and dy places the glyphs (ascent 0.76 em) below the anchor
                // (0.76em: [0, 1] em), about it (0.5ex) or above it (-0.5ex).
                let (a, b) = match attr(tag, "dy").as_deref() {
                    Some("0.76em") => (0.0, 1.0),
                    Some("-0.5ex") => (-1.0, 0.0),
                    _ => (-0.5, 0.5),
                };
                if tr.starts_with("rotate(270") {
                    (x + a * px, x + b * px)
                } else {
                    (x - b * px, x - a * px)
                }
            } else {
                match anchor.as_str() {
                    "start" => (x, x + w),
                    "end" => (x - w, x),
                    _ => (x - w / 2.0, x + w / 2.0),
                }
            };
            out.push(SvgText {
                left,
                right,
                anchor,
                rotated,
                text,
            });
            rest = &after[end..];
        }
        out
    }

    fn panel(title: &str, values: Vec<Vec<Option<f64>>>, scale: ColourScale) -> Panel {
        Panel {
            title: title.into(),
            row_labels: (0..values.len()).map(|r| r.to_string()).collect(),
            values,
            scale,
        }
    }

    /// Every text lies inside the SVG, the colour bars' tick labels (the start-anchored texts)
    /// are distinct within each bar and clear of the bar titles; returns the tick labels.
    fn check_layout(svg: &str) -> Vec<String> {
        let width = svg_width(svg);
        let all = texts(svg);
        for t in &all {
            assert!(
                t.left >= 0.0 && t.right <= width,
                "text {:?} spans [{:.1}, {:.1}] outside the width {width}",
                t.text,
                t.left,
                t.right
            );
        }
        let ticks: Vec<&SvgText> = all.iter().filter(|t| t.anchor == "start").collect();
        assert!(ticks.len() >= 3, "colour-bar tick labels: {ticks:?}");
        // The bars' outlines: x ranges of the unfilled black rectangles.
        let bars: Vec<(f64, f64)> = (svg.split("<rect ").skip(1))
            .filter(|r| r.contains("fill=\"none\" stroke=\"#000000\""))
            .map(|r| {
                let r = format!(" {r}");
                let x: f64 = attr(&r, "x").unwrap().parse().unwrap();
                (x, x + attr(&r, "width").unwrap().parse::<f64>().unwrap())
            })
            .collect();
        assert!(!bars.is_empty());
        for t in &ticks {
            assert!(t.text.parse::<f64>().is_ok(), "{:?}", t.text);
            for (l, r) in &bars {
                assert!(t.right <= *l || t.left >= *r, "tick {:?} on a bar", t.text);
            }
            for r in all.iter().filter(|r| r.rotated) {
                assert!(
                    t.right <= r.left || t.left >= r.right,
                    "tick {:?} overlaps title {:?}",
                    t.text,
                    r.text
                );
            }
        }
        ticks.iter().map(|t| t.text.clone()).collect()
    }

    #[test]
    fn heatmap_draws_every_panel_and_cell() {
        let map = Heatmap {
            title: "per-head median G".into(),
            x_label: "head".into(),
            y_label: "layer".into(),
            scale: Scale::Shared(ColourScale::sequential("median G")),
            panels: vec![
                Panel {
                    title: "ref".into(),
                    row_labels: vec!["2".into(), "3".into()],
                    values: vec![vec![Some(1.0), Some(-2.0)], vec![None, Some(4.0)]],
                    ..Panel::default()
                },
                Panel {
                    title: "vl".into(),
                    row_labels: vec!["2".into(), "3".into()],
                    values: vec![vec![Some(0.5), Some(0.0)], vec![Some(3.0), Some(1.0)]],
                    ..Panel::default()
                },
            ],
        };
        let svg = map.to_svg().unwrap();
        assert!(svg.contains("ref") && svg.contains("vl") && svg.contains("median G"));
        // One colour bar for the shared scale.
        assert_eq!(svg.matches(">\nmedian G\n</text>").count(), 1, "{svg}");
        check_layout(&svg);
        assert_eq!(viridis(0.0), RGBColor(68, 1, 84));
        assert_eq!(viridis(1.0), RGBColor(253, 231, 37));
    }

    #[test]
    fn colour_bar_labels_fit_inside_the_figure() {
        // Wide labels (-12.345 and the like), a tiny range (many decimals) and large values: the
        // bar's tick labels used to be plotters' own, right-anchored against the bar with a
        // fixed 70-pixel area, and repeated themselves for tiny ranges (0.00001 0.00001 ...).
        for (a, b) in [
            (-12.345, -2.0),
            (0.000012, 0.000031),
            (-0.001, 0.0007),
            (1.23456, 1.23457),
            (-1234567.5, 2345678.25),
        ] {
            let map = Heatmap {
                title: "t".into(),
                x_label: "head".into(),
                y_label: "layer".into(),
                scale: Scale::Shared(ColourScale::sequential("median G")),
                panels: vec![panel(
                    "ref",
                    vec![vec![Some(a), Some(b)], vec![None, Some(b)]],
                    ColourScale::default(),
                )],
            };
            let labels = check_layout(&map.to_svg().unwrap());
            let mut unique = labels.clone();
            unique.dedup();
            assert_eq!(unique, labels, "repeated tick labels for [{a}, {b}]");
        }
    }

    #[test]
    fn per_panel_scales_draw_one_bar_per_panel() {
        let map = Heatmap {
            title: "heads".into(),
            x_label: "head".into(),
            y_label: "layer".into(),
            scale: Scale::PerPanel,
            panels: vec![
                panel(
                    "delta G",
                    vec![vec![Some(-12.345), Some(3.0)], vec![Some(0.0), None]],
                    ColourScale::diverging("ΔG"),
                ),
                panel(
                    "margin",
                    vec![vec![Some(0.5), Some(1.5)], vec![Some(2.0), Some(2.5)]],
                    ColourScale::sequential("margin"),
                ),
                panel(
                    "q drift",
                    vec![vec![Some(1e-4), Some(3e-4)], vec![Some(2e-4), Some(5e-4)]],
                    ColourScale::sequential("rel op q"),
                ),
            ],
        };
        let svg = map.to_svg().unwrap();
        let labels = check_layout(&svg);
        for title in ["ΔG", "margin", "rel op q"] {
            assert!(svg.contains(&format!(">\n{title}\n</text>")), "{title}");
        }
        // The diverging panel spans ±1.05 * 12.345; its 0 cell is white, the shared viridis
        // range of the other panels does not reach it.
        assert!(labels.contains(&"-10".to_string()) && labels.contains(&"10".to_string()));
        assert!(svg.contains("fill=\"#FFFFFF\""));
        // Three bars: the figure is wider than three bare panels plus one bar.
        assert!(svg_width(&svg) > (30 + 3 * PANEL_WIDTH) as f64 + 2.0 * 60.0);
    }

    #[test]
    fn diverging_map_is_white_at_zero_and_symmetric() {
        assert_eq!(diverging(0.5), RGBColor(255, 255, 255));
        assert_eq!(diverging(0.0), RGBColor(33, 102, 172));
        assert_eq!(diverging(1.0), RGBColor(178, 24, 43));
        let (lo, hi) = ColourMap::Diverging.range([-1.0, 3.0, f64::NAN].into_iter());
        assert_eq!((lo, hi), (-3.0 * 1.05, 3.0 * 1.05));
        assert_eq!(ColourMap::Diverging.range(std::iter::empty()), (-1.0, 1.0));
        let (lo, hi) = ColourMap::Sequential.range([1.0, 3.0].into_iter());
        assert!((lo - 0.9).abs() < 1e-12 && (hi - 3.1).abs() < 1e-12);
    }

    #[test]
    fn ticks_use_the_step_precision() {
        let t: Vec<String> = ticks(0.0, 1.0).into_iter().map(|t| t.1).collect();
        assert_eq!(t, ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]);
        let t: Vec<String> = ticks(-12.9, -1.4).into_iter().map(|t| t.1).collect();
        assert_eq!(t, ["-12", "-10", "-8", "-6", "-4", "-2"]);
        let t: Vec<String> = ticks(-0.3, 0.3).into_iter().map(|t| t.1).collect();
        assert!(t.contains(&"0.0".to_string()) && !t.iter().any(|s| s == "-0.0"));
    }
}
