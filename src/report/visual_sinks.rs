//! The figures of `visual-sinks` (docs/reference/visual-sinks.md): the tokens' angle to the text
//! sink's key against their ×uniform ratio (the paper's Figure 2), sink shares against depth
//! (Figure 5), top-1 localization against depth (Figure 8), and the ratios over the image (before
//! and after an edit, on one colour scale).
//!
//! The polar chart and the image overlay are written as SVG by hand (plotters has no polar
//! coordinates and its SVG backend cannot embed an image); the depth charts are plotters line
//! charts like the others of [`super::plot`].

use std::fmt::Write;

use base64::Engine;
use image::{imageops, ImageEncoder, RgbImage};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use super::heatmap::{ticks, viridis};
use super::plot::{colour, draw_legend, legend_line, padded_range};

/// One image token at one layer (the paper's Figure 2).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AnglePoint {
    pub centered_cos: f64,
    pub ratio: f64,
    pub sink: bool,
    pub gated: bool,
}

/// One image token's region in the original image's pixels and its ratio.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Region {
    pub x0: f64,
    pub y0: f64,
    pub x1: f64,
    pub y1: f64,
    pub ratio: f64,
    pub sink: bool,
}

/// The smallest ratio the polar chart tells apart: smaller ones (0 included) sit at the centre.
const R_MIN: f64 = 0.01;
/// The polar chart: its size, the centre of the half disc and the disc's radius in pixels.
const ANGLE_SIZE: (f64, f64) = (760.0, 470.0);
const CENTRE: (f64, f64) = (380.0, 400.0);
const DISC: f64 = 300.0;
/// The longer side of the image embedded in [`ratio_heatmap_svg`], at most.
const MAX_SIDE: u32 = 512;

const SINK: usize = 3;
const GATED: usize = 1;
const OTHER: usize = 0;

fn hex(c: RGBColor) -> String {
    format!("#{:02x}{:02x}{:02x}", c.0, c.1, c.2)
}

fn esc(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The opening of a standalone SVG of `w` × `h` pixels on white, with `title` centred on top.
fn open_svg(w: f64, h: f64, title: &str) -> String {
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w:.0}\" height=\"{h:.0}\" \
         viewBox=\"0 0 {w:.0} {h:.0}\" font-family=\"sans-serif\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n"
    );
    text(
        &mut svg,
        w / 2.0,
        28.0,
        18.0,
        "text-anchor=\"middle\"",
        title,
    );
    svg
}

/// A `<text>` element; `attrs` adds attributes (anchor, colour, transform).
fn text(svg: &mut String, x: f64, y: f64, size: f64, attrs: &str, content: &str) {
    let _ = writeln!(
        svg,
        "<text x=\"{x:.2}\" y=\"{y:.2}\" font-size=\"{size}\" {attrs}>{}</text>",
        esc(content)
    );
}

/// A token marker centred on (x, y): a diamond for sinks, a triangle for gated tokens and a dot
/// for the others, so that the three differ without colour too.
fn marker(svg: &mut String, class: &str, kind: usize, x: f64, y: f64) {
    let fill = hex(colour(kind));
    let _ = match kind {
        SINK => writeln!(
            svg,
            "<path class=\"{class} sink\" d=\"M{x:.2} {:.2}l5 5l-5 5l-5 -5z\" fill=\"{fill}\" \
             stroke=\"#000000\" stroke-width=\"0.6\"/>",
            y - 5.0
        ),
        GATED => writeln!(
            svg,
            "<path class=\"{class} gated\" d=\"M{x:.2} {:.2}l4 7h-8z\" fill=\"{fill}\"/>",
            y - 4.5
        ),
        _ => writeln!(
            svg,
            "<circle class=\"{class} other\" cx=\"{x:.2}\" cy=\"{y:.2}\" r=\"2.5\" fill=\"{fill}\" \
             fill-opacity=\"0.55\"/>"
        ),
    };
}

/// Figure 2: every image token of one layer on a half disc. A token's angle is
/// `arccos(centered_cos)`, 0 (to the right) when its centred key points the text sink's way; its
/// radius is `log10(max(ratio, 0.01)) - log10(0.01)` scaled so that the outer edge is the first
/// power of ten above the largest ratio, `ratio_threshold` and 1 (decade rings drawn and
/// labelled). The ring at `ratio_threshold` bounds the sinks, the ray at `arccos(gate)` the gated
/// tokens (the sector it closes is shaded). Sinks are red diamonds, gated non-sinks orange
/// triangles, the rest blue dots; tokens with a NaN ratio or a non-finite cosine are not drawn, an infinite
/// ratio sits on the edge. Errors when the threshold is not positive or the gate not in [-1, 1].
pub fn angle_svg(
    title: &str,
    points: &[AnglePoint],
    ratio_threshold: f64,
    gate: f64,
) -> Result<String, String> {
    if !(ratio_threshold.is_finite() && ratio_threshold > 0.0) {
        return Err(format!(
            "angle plot: ratio threshold {ratio_threshold} is not a positive number"
        ));
    }
    if !(-1.0..=1.0).contains(&gate) {
        return Err(format!("angle plot: gate {gate} is not in [-1, 1]"));
    }
    let largest = (points.iter().map(|p| p.ratio))
        .filter(|r| r.is_finite())
        .fold(ratio_threshold.max(1.0), f64::max);
    let top = largest.log10().floor() + 1.0;
    let radius = |r: f64| {
        let decades = r.max(R_MIN).log10() - R_MIN.log10();
        (DISC * decades / (top - R_MIN.log10())).min(DISC)
    };
    // Pixel position of radius rho at angle arccos(cos).
    let at = |rho: f64, cos: f64| {
        (
            CENTRE.0 + rho * cos,
            CENTRE.1 - rho * (1.0 - cos * cos).sqrt(),
        )
    };
    let half_ring = |svg: &mut String, rho: f64, style: &str| {
        let (cx, cy) = CENTRE;
        let _ = writeln!(
            svg,
            "<path d=\"M{:.2} {cy:.2}A{rho:.2} {rho:.2} 0 0 1 {:.2} {cy:.2}\" fill=\"none\" {style}/>",
            cx - rho,
            cx + rho
        );
    };
    let (w, h) = ANGLE_SIZE;
    let mut svg = open_svg(w, h, title);

    // The gated sector, then the grid: decade rings (labelled left of the centre) and spokes.
    let (gx, gy) = at(DISC, gate);
    let _ = writeln!(
        svg,
        "<path class=\"gated-sector\" d=\"M{:.2} {:.2}L{:.2} {:.2}A{DISC} {DISC} 0 0 0 {gx:.2} {gy:.2}z\" \
         fill=\"{}\" fill-opacity=\"0.08\"/>",
        CENTRE.0,
        CENTRE.1,
        CENTRE.0 + DISC,
        CENTRE.1,
        hex(colour(GATED))
    );
    let grey = "stroke=\"#bbbbbb\" stroke-width=\"0.8\"";
    for k in (R_MIN.log10() as i32 + 1)..=(top as i32) {
        let rho = radius(10f64.powi(k));
        half_ring(&mut svg, rho, grey);
        let label = format!("{}×", 10f64.powi(k));
        let attrs = "text-anchor=\"middle\" fill=\"#666666\"";
        text(
            &mut svg,
            CENTRE.0 - rho,
            CENTRE.1 + 16.0,
            11.0,
            attrs,
            &label,
        );
    }
    for cos in [1.0, 0.5, 0.0, -0.5, -1.0] {
        let ((x0, y0), (x1, y1)) = (CENTRE, at(DISC, cos));
        let _ = writeln!(
            svg,
            "<line x1=\"{x0:.2}\" y1=\"{y0:.2}\" x2=\"{x1:.2}\" y2=\"{y1:.2}\" {grey}/>"
        );
        let (lx, ly) = at(DISC + 14.0, cos);
        text(
            &mut svg,
            lx,
            ly + 4.0,
            11.0,
            "text-anchor=\"middle\" fill=\"#666666\"",
            &format!("{cos}"),
        );
    }
    let _ = writeln!(
        svg,
        "<line x1=\"{:.2}\" y1=\"{:.2}\" x2=\"{:.2}\" y2=\"{:.2}\" stroke=\"#000000\"/>",
        CENTRE.0 - DISC,
        CENTRE.1,
        CENTRE.0 + DISC,
        CENTRE.1
    );

    // The sink ring (labelled right of the centre) and the gate ray (labelled past the rim).
    let red = hex(colour(SINK));
    let rho = radius(ratio_threshold);
    half_ring(
        &mut svg,
        rho,
        &format!(
            "class=\"threshold\" stroke=\"{red}\" stroke-width=\"1.5\" stroke-dasharray=\"6 3\""
        ),
    );
    let attrs = format!("text-anchor=\"middle\" font-weight=\"bold\" fill=\"{red}\"");
    let label = format!("{ratio_threshold}×");
    text(
        &mut svg,
        CENTRE.0 + rho,
        CENTRE.1 + 16.0,
        12.0,
        &attrs,
        &label,
    );
    let orange = hex(colour(GATED));
    let (rx, ry) = at(DISC + 18.0, gate);
    let _ = writeln!(
        svg,
        "<line class=\"gate\" x1=\"{:.2}\" y1=\"{:.2}\" x2=\"{rx:.2}\" y2=\"{ry:.2}\" stroke=\"{orange}\" \
         stroke-width=\"1.5\"/>",
        CENTRE.0,
        CENTRE.1
    );
    let (lx, ly) = at(DISC + 30.0, gate);
    let attrs = format!("text-anchor=\"middle\" font-weight=\"bold\" fill=\"{orange}\"");
    text(&mut svg, lx, ly, 12.0, &attrs, &format!("gate {gate}"));

    // Tokens, sinks last so that they stay on top.
    let kind_of = |p: &AnglePoint| match (p.sink, p.gated) {
        (true, _) => SINK,
        (false, true) => GATED,
        (false, false) => OTHER,
    };
    let drawable = |p: &&AnglePoint| p.centered_cos.is_finite() && !p.ratio.is_nan();
    for kind in [OTHER, GATED, SINK] {
        for p in points
            .iter()
            .filter(drawable)
            .filter(|p| kind_of(p) == kind)
        {
            let (x, y) = at(radius(p.ratio), p.centered_cos.clamp(-1.0, 1.0));
            marker(&mut svg, "token", kind, x, y);
        }
    }

    let legend = [
        (SINK, format!("sink (≥ {ratio_threshold}× uniform)")),
        (GATED, "gated, not a sink".to_string()),
        (OTHER, "other image token".to_string()),
    ];
    for (i, (kind, label)) in legend.iter().enumerate() {
        let y = 56.0 + 20.0 * i as f64;
        marker(&mut svg, "legend", *kind, 24.0, y);
        text(&mut svg, 36.0, y + 4.0, 12.0, "", label);
    }
    let axes = "angle: arccos(centred key cosine with the text sink) · radius: ×uniform, log scale";
    text(
        &mut svg,
        w / 2.0,
        h - 14.0,
        12.0,
        "text-anchor=\"middle\" fill=\"#444444\"",
        axes,
    );
    svg.push_str("</svg>\n");
    Ok(svg)
}

fn plot_err(e: impl std::fmt::Display) -> String {
    format!("depth plot: {e}")
}

/// Figure 5: the sink share and the text-sink share (`(layer, sink_share, text_sink_share)`)
/// against layer on a fixed [0, 1] axis, and the peak layer as a dashed vertical line when there
/// is one. Non-finite shares are left out.
pub fn depth_svg(
    title: &str,
    layers: &[(usize, f64, f64)],
    peak: Option<usize>,
) -> Result<String, String> {
    let xs = padded_range((layers.iter().map(|l| l.0 as f64)).chain(peak.map(|p| p as f64)));
    let (x_lo, x_hi) = (xs.start, xs.end);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (760, 440)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(xs, -0.02f64..1.02)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc("layer")
            .y_desc("share of the question's attention")
            .x_labels(((x_hi - x_lo).round() as usize + 1).clamp(2, 12))
            .x_label_formatter(&layer_label)
            .draw()
            .map_err(plot_err)?;
        // Non-finite shares are dropped point by point.
        let finite = |share: fn(&(usize, f64, f64)) -> f64| -> Vec<(f64, f64)> {
            (layers.iter())
                .map(|l| (l.0 as f64, share(l)))
                .filter(|p| p.1.is_finite())
                .collect()
        };
        let shares = [
            ("sink share (of the image's attention)", finite(|l| l.1)),
            ("text-sink share", finite(|l| l.2)),
        ];
        for (i, (label, points)) in shares.into_iter().enumerate() {
            line_with_points(&mut chart, &points, colour(i), label)?;
        }
        if let Some(p) = peak {
            layer_marks(&mut chart, &[p], colour(SINK), format!("peak layer {p}"))?;
        }
        draw_legend(&mut chart, SeriesLabelPosition::UpperLeft).map_err(plot_err)?;
        root.present().map_err(plot_err)?;
    }
    Ok(svg)
}

/// A layer axis' tick label: layers are integers, so nothing between them.
fn layer_label(x: &f64) -> String {
    if (x - x.round()).abs() < 1e-9 {
        format!("{}", x.round() as i64)
    } else {
        String::new()
    }
}

type LayerChart<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// A series as a line with a dot at each point, in the legend as `label`.
fn line_with_points(
    chart: &mut LayerChart,
    points: &[(f64, f64)],
    c: RGBColor,
    label: &str,
) -> Result<(), String> {
    chart
        .draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(2)))
        .map_err(plot_err)?
        .label(label)
        .legend(legend_line(c));
    chart
        .draw_series(points.iter().map(|&p| Circle::new(p, 3, c.filled())))
        .map_err(plot_err)?;
    Ok(())
}

/// Dashed vertical lines from 0 to 1 at `layers`, one legend entry `label` for them all.
fn layer_marks(
    chart: &mut LayerChart,
    layers: &[usize],
    c: RGBColor,
    label: String,
) -> Result<(), String> {
    for (i, &l) in layers.iter().enumerate() {
        let x = l as f64;
        let drawn = chart
            .draw_series(DashedLineSeries::new(
                [(x, 0.0), (x, 1.0)],
                6,
                4,
                c.stroke_width(2),
            ))
            .map_err(plot_err)?;
        if i == 0 {
            drawn.label(label.clone()).legend(legend_line(c));
        }
    }
    Ok(())
}

/// Figure 8: top-1 localization against depth. Each series (`(label, [(layer, rate)])`: one
/// image's 0/1 per layer, or a share of images) is drawn over the model's `num_layers` layers
/// on a fixed [0, 1] axis; the layers before `first_counted` (the first quarter, which the
/// peak-layer rule skips) are shaded, and the `selector_layers` are dashed vertical lines.
/// Non-finite rates are left out.
pub fn top1_svg(
    title: &str,
    series: &[(&str, Vec<(usize, f64)>)],
    num_layers: usize,
    first_counted: usize,
    selector_layers: &[usize],
) -> Result<String, String> {
    let x_hi = num_layers.max(1) as f64 - 0.5;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (760, 440)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(-0.5..x_hi, -0.02f64..1.02)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc("layer")
            .y_desc("top-1 image token in the box")
            .x_labels((num_layers + 1).clamp(2, 12))
            .x_label_formatter(&layer_label)
            .draw()
            .map_err(plot_err)?;
        if first_counted > 0 {
            let grey = colour(7);
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(-0.5, -0.02), (first_counted as f64 - 0.5, 1.02)],
                    grey.mix(0.15).filled(),
                )))
                .map_err(plot_err)?
                .label("first quarter (the peak-layer rule skips it)")
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 18, y + 5)], grey.mix(0.3).filled())
                });
        }
        for (i, (label, rates)) in series.iter().enumerate() {
            let points: Vec<(f64, f64)> = (rates.iter())
                .filter(|r| r.1.is_finite())
                .map(|&(l, rate)| (l as f64, rate))
                .collect();
            line_with_points(&mut chart, &points, colour(i), label)?;
        }
        if !selector_layers.is_empty() {
            let list: Vec<String> = selector_layers.iter().map(|l| l.to_string()).collect();
            let label = format!("selector layers {}", list.join(", "));
            layer_marks(&mut chart, selector_layers, colour(SINK), label)?;
        }
        draw_legend(&mut chart, SeriesLabelPosition::UpperLeft).map_err(plot_err)?;
        root.present().map_err(plot_err)?;
    }
    Ok(svg)
}

/// `image` no larger than [`MAX_SIDE`] on its longer side (never enlarged).
fn downscaled(image: &RgbImage) -> RgbImage {
    let (w, h) = image.dimensions();
    let longer = w.max(h);
    if longer <= MAX_SIDE {
        return image.clone();
    }
    let scale = MAX_SIDE as f64 / longer as f64;
    let side = |n: u32| ((n as f64 * scale).round() as u32).max(1);
    // Triangle widens its support when shrinking, so fine detail averages instead of aliasing.
    imageops::resize(image, side(w), side(h), imageops::FilterType::Triangle)
}

/// The image with its tokens' ratios over it: each region a semi-transparent viridis rectangle
/// coloured by `log10(ratio)` on `log10_range` (clamped to it; a ratio of 0 takes the bottom
/// colour, a NaN ratio leaves its region uncoloured), sinks outlined in red, the target box
/// (`[x0, y0, x1, y1]`, original pixels) dashed in magenta, and a colour bar labelled in
/// log10 ×uniform. Give a before/after pair the same `log10_range` so that they compare. The
/// image is embedded as a PNG data URL, downscaled to at most 512 px on its longer side, so the
/// SVG stands alone. Errors on an empty image or a range that is not finite and increasing.
pub fn ratio_heatmap_svg(
    title: &str,
    image: &RgbImage,
    regions: &[Region],
    log10_range: (f64, f64),
    target_box: Option<[f64; 4]>,
) -> Result<String, String> {
    let (lo, hi) = log10_range;
    if !(lo.is_finite() && hi.is_finite() && lo < hi) {
        return Err(format!(
            "ratio heatmap: log10 range [{lo}, {hi}] is not increasing"
        ));
    }
    if image.width() == 0 || image.height() == 0 {
        return Err("ratio heatmap: the image is empty".into());
    }
    let small = downscaled(image);
    let mut png = Vec::new();
    image::codecs::png::PngEncoder::new(&mut png)
        .write_image(
            small.as_raw(),
            small.width(),
            small.height(),
            image::ExtendedColorType::Rgb8,
        )
        .map_err(|e| format!("ratio heatmap: PNG encoding: {e}"))?;
    let (iw, ih) = (small.width() as f64, small.height() as f64);
    let (sx, sy) = (iw / image.width() as f64, ih / image.height() as f64);

    // Layout: the image at (left, top), the colour bar to its right with tick labels and title.
    let (left, top) = (16.0, 44.0);
    let bar_x = left + iw + 20.0;
    let bar_h = ih.max(160.0);
    let ticks = ticks(lo, hi);
    let widest = ticks.iter().map(|t| t.1.chars().count()).max().unwrap_or(1) as f64 * 0.6 * 12.0;
    let bar_title_x = bar_x + 16.0 + 6.0 + widest + 16.0;
    let legend_y = top + bar_h + 22.0;
    let w = (bar_title_x + 12.0).max(18.0 * 0.6 * title.chars().count() as f64 + 2.0 * left);
    let mut svg = open_svg(w, legend_y + 16.0, title);
    let _ = writeln!(
        svg,
        "<image x=\"{left}\" y=\"{top}\" width=\"{iw}\" height=\"{ih}\" preserveAspectRatio=\"none\" \
         href=\"data:image/png;base64,{}\"/>",
        base64::engine::general_purpose::STANDARD.encode(&png)
    );

    let t_of = |v: f64| ((v - lo) / (hi - lo)).clamp(0.0, 1.0);
    let red = hex(colour(SINK));
    // Sinks last, so that no neighbour's fill covers their outline.
    for sink in [false, true] {
        for r in regions
            .iter()
            .filter(|r| r.sink == sink && !r.ratio.is_nan())
        {
            let fill = hex(viridis(t_of(r.ratio.log10())));
            let outline = if sink {
                format!(" stroke=\"{red}\" stroke-width=\"2\"")
            } else {
                String::new()
            };
            let _ = writeln!(
                svg,
                "<rect class=\"region{}\" x=\"{:.2}\" y=\"{:.2}\" width=\"{:.2}\" height=\"{:.2}\" \
                 fill=\"{fill}\" fill-opacity=\"0.5\"{outline}/>",
                if sink { " sink" } else { "" },
                left + r.x0 * sx,
                top + r.y0 * sy,
                (r.x1 - r.x0) * sx,
                (r.y1 - r.y0) * sy,
            );
        }
    }
    let magenta = "#ff00ff";
    if let Some([x0, y0, x1, y1]) = target_box {
        let _ = writeln!(
            svg,
            "<rect class=\"target\" x=\"{:.2}\" y=\"{:.2}\" width=\"{:.2}\" height=\"{:.2}\" fill=\"none\" \
             stroke=\"{magenta}\" stroke-width=\"2.5\" stroke-dasharray=\"6 3\"/>",
            left + x0 * sx,
            top + y0 * sy,
            (x1 - x0) * sx,
            (y1 - y0) * sy,
        );
    }

    // The colour bar: 64 strips, bottom = lo; crispEdges avoids seams between them.
    let y_of = |v: f64| top + bar_h * (1.0 - t_of(v));
    let steps = 64;
    for i in 0..steps {
        let _ = writeln!(
            svg,
            "<rect class=\"bar\" x=\"{bar_x}\" y=\"{:.2}\" width=\"16\" height=\"{:.2}\" fill=\"{}\" \
             shape-rendering=\"crispEdges\"/>",
            top + bar_h * (steps - 1 - i) as f64 / steps as f64,
            bar_h / steps as f64 + 0.5,
            hex(viridis((i as f64 + 0.5) / steps as f64))
        );
    }
    let _ = writeln!(
        svg,
        "<rect x=\"{bar_x}\" y=\"{top}\" width=\"16\" height=\"{bar_h}\" fill=\"none\" stroke=\"#000000\"/>"
    );
    for (v, label) in &ticks {
        let y = y_of(*v);
        let _ = writeln!(
            svg,
            "<line x1=\"{:.2}\" y1=\"{y:.2}\" x2=\"{:.2}\" y2=\"{y:.2}\" stroke=\"#000000\"/>",
            bar_x + 16.0,
            bar_x + 20.0
        );
        text(&mut svg, bar_x + 22.0, y + 4.0, 12.0, "", label);
    }
    let cy = top + bar_h / 2.0;
    let rotate =
        format!("text-anchor=\"middle\" transform=\"rotate(-90 {bar_title_x:.2} {cy:.2})\"");
    text(&mut svg, bar_title_x, cy, 13.0, &rotate, "log10 ×uniform");

    // Legend for the outlines.
    let mut keys = vec![(red.as_str(), "", "sink")];
    if target_box.is_some() {
        keys.push((magenta, " stroke-dasharray=\"4 2\"", "target box"));
    }
    for (i, (stroke, dash, label)) in keys.into_iter().enumerate() {
        let x = left + 110.0 * i as f64;
        let _ = writeln!(
            svg,
            "<rect x=\"{x}\" y=\"{:.2}\" width=\"14\" height=\"10\" fill=\"none\" stroke=\"{stroke}\" \
             stroke-width=\"2\"{dash}/>",
            legend_y - 9.0
        );
        text(&mut svg, x + 20.0, legend_y, 12.0, "", label);
    }
    svg.push_str("</svg>\n");
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SVG is one `<svg>` element whose tags nest and close, and every `&` starts an entity.
    fn assert_well_formed(svg: &str) {
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
        let mut open: Vec<&str> = Vec::new();
        let mut rest = svg;
        while let Some(i) = rest.find('<') {
            let end = i + rest[i..].find('>').expect("unclosed tag");
            let tag = &rest[i + 1..end];
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(open.pop(), Some(name.trim()), "mismatched </{name}>");
            } else if !tag.ends_with('/') && !tag.starts_with(['?', '!']) {
                open.push(tag.split_whitespace().next().unwrap());
            }
            assert!(
                !open.is_empty() || rest[end + 1..].trim().is_empty(),
                "content after </svg>"
            );
            rest = &rest[end + 1..];
        }
        assert!(open.is_empty(), "unclosed {open:?}");
        for (i, _) in svg.match_indices('&') {
            let entity = &svg[i..];
            assert!(
                ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;", "&#"]
                    .iter()
                    .any(|e| entity.starts_with(e)),
                "bare & in {:?}",
                &svg[i.saturating_sub(40)..(i + 40).min(svg.len())]
            );
        }
    }

    fn point(centered_cos: f64, ratio: f64, sink: bool, gated: bool) -> AnglePoint {
        AnglePoint {
            centered_cos,
            ratio,
            sink,
            gated,
        }
    }

    #[test]
    fn angle_chart_draws_ring_ray_and_one_marker_per_token() {
        let points = [
            point(1.0, 500.0, true, true),
            point(0.2, 150.0, true, false),
            point(0.9, 3.0, false, true),
            point(0.7, 0.5, false, true),
            point(0.55, 0.0, false, true),
            point(-0.3, 1.0, false, false),
            point(0.0, 0.8, false, false),
            point(-1.0, 1.2, false, false),
            point(0.4, 2.0, false, false),
            point(0.1, f64::INFINITY, false, false),
            point(0.3, f64::NAN, false, false),
            point(f64::NAN, 2.0, true, false),
        ];
        let svg = angle_svg("layer 14 <Qwen> & co", &points, 100.0, 0.5).unwrap();
        assert_well_formed(&svg);
        assert!(svg.contains("layer 14 &lt;Qwen&gt; &amp; co"));
        // The NaN ratio and the NaN cosine are left out; the infinite ratio is drawn.
        assert_eq!(svg.matches("class=\"token sink\"").count(), 2);
        assert_eq!(svg.matches("class=\"token gated\"").count(), 3);
        assert_eq!(svg.matches("class=\"token other\"").count(), 5);
        // The largest ratio, 500, puts the rim at 1000×: 5 decades from 0.01 over 300 px, so the
        // 100× ring has radius 4/5 · 300 = 240 about the centre (380, 400).
        assert!(svg.contains("1000×") && !svg.contains("10000×"));
        assert!(svg.contains(
            "<path d=\"M140.00 400.00A240.00 240.00 0 0 1 620.00 400.00\" fill=\"none\" class=\"threshold\""
        ));
        assert!(svg.contains(">100×</text>") && svg.contains(">gate 0.5</text>"));
        // The gate ray runs at arccos(0.5) = 60° to 18 px past the rim.
        let ray = format!(
            "class=\"gate\" x1=\"380.00\" y1=\"400.00\" x2=\"539.00\" y2=\"{:.2}\"",
            400.0 - 318.0 * 0.75f64.sqrt()
        );
        assert!(svg.contains(&ray), "{ray}");
        // The first sink, aligned (angle 0) at 500×, sits on the baseline 4.699/5 of the way out.
        let x = 380.0 + 300.0 * (500f64.log10() + 2.0) / 5.0;
        assert!(svg.contains(&format!("class=\"token sink\" d=\"M{x:.2} 395.00")));
        // The infinite ratio sits on the rim.
        let (cx, cy) = (380.0 + 300.0 * 0.1, 400.0 - 300.0 * (1.0f64 - 0.01).sqrt());
        assert!(svg.contains(&format!("cx=\"{cx:.2}\" cy=\"{cy:.2}\"")));
    }

    #[test]
    fn angle_chart_takes_no_tokens_and_rejects_bad_parameters() {
        let svg = angle_svg("empty", &[], 100.0, 0.5).unwrap();
        assert_well_formed(&svg);
        assert_eq!(svg.matches("class=\"token").count(), 0);
        // The rim is the decade above the threshold.
        assert!(svg.contains(">1000×</text>") && !svg.contains(">10000×</text>"));
        for (threshold, gate) in [(0.0, 0.5), (f64::NAN, 0.5), (f64::INFINITY, 0.5)] {
            assert!(angle_svg("t", &[], threshold, gate).is_err());
        }
        for gate in [1.5, -1.01, f64::NAN] {
            assert!(angle_svg("t", &[], 100.0, gate).is_err());
        }
    }

    #[test]
    fn depth_chart_draws_both_shares_and_the_peak() {
        let layers: Vec<(usize, f64, f64)> = (0..8)
            .map(|l| (l, 0.1 * l as f64, 0.9 - 0.1 * l as f64))
            .collect();
        let svg = depth_svg("sinks by depth", &layers, Some(5)).unwrap();
        assert_well_formed(&svg);
        assert!(svg.contains("text-sink share") && svg.contains("peak layer 5"));
        assert_eq!(svg.matches("<circle").count(), 16);

        let mut gappy = layers.clone();
        gappy[3].1 = f64::NAN;
        gappy[4].2 = f64::INFINITY;
        let svg = depth_svg("gaps", &gappy, None).unwrap();
        assert_well_formed(&svg);
        assert_eq!(svg.matches("<circle").count(), 14);
        assert!(!svg.contains("NaN") && !svg.contains("inf") && !svg.contains("peak"));

        assert_well_formed(&depth_svg("none", &[], None).unwrap());
    }

    #[test]
    fn top1_chart_draws_each_map_the_skipped_quarter_and_the_selector_layers() {
        let raw = vec![(9, 0.0), (18, 0.25), (35, 0.0)];
        let edited = vec![(9, 0.5), (18, 1.0), (35, f64::NAN)];
        let series = [("raw", raw), ("edited", edited)];
        let svg = top1_svg("top-1 by depth", &series, 36, 9, &[18, 21]).unwrap();
        assert_well_formed(&svg);
        for label in [
            "raw",
            "edited",
            "selector layers 18, 21",
            "first quarter (the peak-layer rule skips it)",
        ] {
            assert!(svg.contains(label), "{label}");
        }
        // Three dots for raw, two for edited (its NaN left out).
        assert_eq!(svg.matches("<circle").count(), 5, "{svg}");
        let bare = top1_svg("none", &[], 3, 0, &[]).unwrap();
        assert_well_formed(&bare);
        assert!(!bare.contains("selector") && !bare.contains("first quarter"));
    }

    fn grid(width: f64, height: f64, ratios: &[f64], cols: usize) -> Vec<Region> {
        let rows = ratios.len().div_ceil(cols);
        let (w, h) = (width / cols as f64, height / rows as f64);
        (ratios.iter().enumerate())
            .map(|(i, &ratio)| {
                let (c, r) = ((i % cols) as f64, (i / cols) as f64);
                Region {
                    x0: c * w,
                    y0: r * h,
                    x1: (c + 1.0) * w,
                    y1: (r + 1.0) * h,
                    ratio,
                    sink: ratio >= 100.0,
                }
            })
            .collect()
    }

    fn embedded_png(svg: &str) -> image::DynamicImage {
        let start = svg.find("href=\"data:image/png;base64,").unwrap() + 28;
        let end = start + svg[start..].find('"').unwrap();
        let png = base64::engine::general_purpose::STANDARD
            .decode(&svg[start..end])
            .unwrap();
        image::load_from_memory(&png).unwrap()
    }

    #[test]
    fn ratio_heatmap_embeds_the_downscaled_image_under_the_regions() {
        let image = RgbImage::from_fn(1024, 768, |x, y| {
            image::Rgb([(x % 256) as u8, (y % 256) as u8, 90])
        });
        let ratios = [
            1.0,
            1000.0,
            0.0,
            2.0,
            f64::NAN,
            0.5,
            3.0,
            1.0,
            f64::INFINITY,
            0.1,
            1.0,
            4.0,
        ];
        let regions = grid(1024.0, 768.0, &ratios, 4);
        let svg = ratio_heatmap_svg(
            "a & b",
            &image,
            &regions,
            (-1.0, 3.0),
            Some([0.0, 0.0, 512.0, 384.0]),
        )
        .unwrap();
        assert_well_formed(&svg);
        let png = embedded_png(&svg);
        assert_eq!((png.width(), png.height()), (512, 384));
        // Eleven regions (the NaN one is left uncoloured), two of them sinks (1000 and inf).
        assert_eq!(svg.matches("class=\"region").count(), 11);
        assert_eq!(svg.matches("class=\"region sink\"").count(), 2);
        // Halved: the second region (256..512, 0..256) lands at (16 + 128, 44), 128 px square,
        // at the top of the range (yellow); the ratio 0 takes the bottom colour (purple).
        assert!(svg.contains(
            "class=\"region sink\" x=\"144.00\" y=\"44.00\" width=\"128.00\" height=\"128.00\" fill=\"#fde725\""
        ));
        assert!(svg.contains(
            "x=\"272.00\" y=\"44.00\" width=\"128.00\" height=\"128.00\" fill=\"#440154\""
        ));
        assert!(svg.contains(
            "class=\"target\" x=\"16.00\" y=\"44.00\" width=\"256.00\" height=\"192.00\""
        ));
        for tick in ["-1", "0", "1", "2", "3"] {
            assert!(svg.contains(&format!(">{tick}</text>")), "tick {tick}");
        }
        assert!(svg.contains("a &amp; b") && svg.contains(">target box</text>"));
    }

    #[test]
    fn ratio_heatmap_keeps_small_images_and_rejects_bad_input() {
        let image = RgbImage::new(40, 30);
        let svg = ratio_heatmap_svg("small", &image, &[], (0.0, 2.0), None).unwrap();
        assert_well_formed(&svg);
        let png = embedded_png(&svg);
        assert_eq!((png.width(), png.height()), (40, 30));
        assert!(!svg.contains("class=\"region") && !svg.contains("target"));
        for range in [
            (1.0, 1.0),
            (2.0, 1.0),
            (f64::NAN, 2.0),
            (0.0, f64::INFINITY),
        ] {
            assert!(ratio_heatmap_svg("t", &image, &[], range, None).is_err());
        }
        assert!(ratio_heatmap_svg("t", &RgbImage::new(0, 5), &[], (0.0, 1.0), None).is_err());
    }
}
