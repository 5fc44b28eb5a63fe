//! The host memory a forward pass over one long prompt will hold, checked before the pass
//! against what the kernel says is free, so that a prompt too long for the machine is one clear
//! error instead of an allocation that aborts halfway (docs/commands/trace.md).

use super::model::DecoderSpec;
use crate::bail;
use crate::error::Result;
use crate::units::human_bytes;

/// The variable that, set to a number of bytes, stands for `MemAvailable` (tests, or a share of a
/// machine smaller than the kernel reports).
pub const AVAILABLE_VAR: &str = "SINKMERGE_MEM_AVAILABLE";

/// `MemAvailable` of `/proc/meminfo` in bytes: what can be allocated without swapping (or
/// [`AVAILABLE_VAR`] when set to a number). `None` where the file is absent (not Linux), and
/// then nothing is checked.
pub fn available() -> Option<u64> {
    if let Some(bytes) = overridden() {
        return Some(bytes);
    }
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// [`AVAILABLE_VAR`], when it is set to a number of bytes.
fn overridden() -> Option<u64> {
    std::env::var(AVAILABLE_VAR).ok()?.trim().parse().ok()
}

/// The bytes the attention of one layer holds while it runs on a prompt of `seq` tokens: each
/// head task in flight (one per thread) has its scores and probabilities, `seq²` f32 each.
pub fn attention_scratch(spec: &DecoderSpec, seq: usize) -> f64 {
    let in_flight = rayon::current_num_threads().min(spec.num_heads).max(1);
    in_flight as f64 * 2.0 * square_f32(seq)
}

/// `seq²` f32 in bytes, as f64 so that no prompt length overflows it.
pub fn square_f32(seq: usize) -> f64 {
    4.0 * seq as f64 * seq as f64
}

/// Refuse a pass that needs `need` bytes (`what` says of what) when less is available; `hint`
/// says how to need less.
pub fn check(need: f64, what: &str, hint: &str) -> Result<()> {
    let Some(free) = available() else {
        return Ok(());
    };
    if need > free as f64 {
        bail!(
            "{what} needs about {} of memory but {} is available ({}); {hint}",
            human_bytes(need.min(u64::MAX as f64) as u64),
            human_bytes(free),
            if overridden().is_some() {
                AVAILABLE_VAR
            } else {
                "MemAvailable in /proc/meminfo"
            }
        );
    }
    Ok(())
}
