//! Quantities in words for messages and reports, below every room that prints them: input
//! caps, disk space, model sizes.

/// `1536` -> `1.5 KiB`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut f = n as f64;
    let mut unit = 0;
    while f >= 1024.0 && unit < UNITS.len() - 1 {
        f /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{f:.1} {}", UNITS[unit])
    }
}
