//! The Hub's API answer and file headers on any bytes: no panic, and an accepted commit or etag
//! is a hash that names one cache folder or file (`fuzz/checks.rs`).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../checks.rs"]
mod checks;

fuzz_target!(|data: &[u8]| checks::hub_answer(data));
