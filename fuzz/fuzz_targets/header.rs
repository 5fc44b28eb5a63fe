//! The safetensors header parser must return an error, never panic or over-read, on any bytes.
//! Accepted headers must describe tensors that lie inside the file without overlapping.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = sinkmerge::checkpoint::header::parse(Path::new("fuzz.safetensors"), data) {
        let mut end = 0;
        for t in &header.tensors {
            assert!(t.begin >= end && t.end >= t.begin);
            assert!(header.data_start + t.end <= data.len());
            end = t.end;
        }
        assert_eq!(header.data_start + end, data.len());
    }
});
