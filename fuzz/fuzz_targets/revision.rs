//! `ORG/NAME@REV`'s revision check on any string: no panic, and an accepted revision is a
//! relative path of plain components within git's ref-name rules (`fuzz/checks.rs`).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../checks.rs"]
mod checks;

fuzz_target!(|data: &[u8]| checks::revision(data));
