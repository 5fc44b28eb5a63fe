//! Output formatting shared by the commands: aligned text tables, human-readable numbers, SVG plots,
//! the reports of `score`, `heads`, `predict` and `norms`, and the figures of `visual-sinks`.

pub mod heads;
pub mod heatmap;
pub mod norms;
pub mod plot;
pub mod predict;
pub mod score;
pub mod visual_sinks;

/// An aligned text table; numeric-looking cells are right-aligned.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Table {
        Table {
            header: header.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        self.rows.push(cells.into_iter().map(Into::into).collect());
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn render(&self) -> String {
        let cols = self.header.len();
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let numeric = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_digit() || "+-.eE%x".contains(c))
                && s.chars().any(|c| c.is_ascii_digit())
        };
        let mut out = String::new();
        let mut line = |cells: &[String]| {
            let mut parts = Vec::with_capacity(cols);
            for (i, w) in widths.iter().enumerate() {
                let cell = cells.get(i).map(String::as_str).unwrap_or("");
                parts.push(if numeric(cell) {
                    format!("{cell:>w$}")
                } else {
                    format!("{cell:<w$}")
                });
            }
            out.push_str(parts.join("  ").trim_end());
            out.push('\n');
        };
        line(&self.header);
        line(&widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>());
        for row in &self.rows {
            line(row);
        }
        out
    }
}

/// `1234567` -> `1.23M`.
pub fn human_count(n: u64) -> String {
    let f = n as f64;
    match n {
        0..=9_999 => n.to_string(),
        10_000..=999_999 => format!("{:.1}K", f / 1e3),
        1_000_000..=999_999_999 => format!("{:.2}M", f / 1e6),
        _ => format!("{:.2}B", f / 1e9),
    }
}

/// Format a float compactly for tables: 4 significant digits, scientific when tiny or huge.
pub fn fmt_num(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if !x.is_finite() {
        format!("{x}")
    } else if x.abs() >= 1e5 || x.abs() < 1e-3 {
        format!("{x:.3e}")
    } else {
        let digits = (3 - x.abs().log10().floor() as i32).clamp(0, 6) as usize;
        format!("{x:.digits$}")
    }
}

/// `value` as a `--json` report prints it: pretty, with a trailing newline. Serializing the
/// crate's own report types fails only on a bug, so a failure is internal.
pub fn json_text<T: serde::Serialize>(value: &T) -> crate::error::Result<String> {
    serde_json::to_string_pretty(value)
        .map(|text| text + "\n")
        .map_err(|e| crate::internal!("JSON report: {e}"))
}

/// A table cell of an optional number: [`fmt_num`], or `-` when there is none.
pub fn fmt_opt(x: Option<f64>) -> String {
    x.map_or("-".to_string(), fmt_num)
}

/// The last path component of a model label, for column headers.
pub fn short_label(label: &str) -> String {
    let trimmed = label.trim_end_matches('/');
    let parts: Vec<&str> = trimmed.rsplitn(3, '/').collect();
    match parts.as_slice() {
        [last, parent, ..] if last.len() <= 4 => format!("{parent}/{last}"),
        [last, ..] => last.to_string(),
        [] => label.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_columns() {
        let mut t = Table::new(["name", "value"]);
        t.row(["a", "1.5"]);
        t.row(["longer", "10"]);
        let s = t.render();
        assert_eq!(s.lines().nth(2).unwrap(), "a         1.5");
        assert_eq!(s.lines().nth(3).unwrap(), "longer     10");
    }

    #[test]
    fn numbers_format_compactly() {
        assert_eq!(human_count(1_234_567), "1.23M");
        assert_eq!(crate::units::human_bytes(1536), "1.5 KiB");
        assert_eq!(fmt_num(4.4412), "4.441");
        assert_eq!(fmt_num(0.00012), "1.200e-4");
    }
}
