//! `score --json` on the bundled pairs and the fixture models is byte-identical to the output of
//! the scorer before its kernels were vectorised (tests/fixtures/score/bytes, written by the
//! release build of commit c422507): speed work must not move a single bit of any metric.

use serde_json::Value;

use crate::util::{fixtures, read_json, sinkmerge};

#[test]
fn score_json_is_byte_identical_to_the_recorded_outputs() {
    let dir = fixtures().join("score/bytes");
    let cases: Vec<Value> = read_json(dir.join("cases.json"));
    assert!(cases.len() >= 15, "{}", dir.display());
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let args: Vec<&str> = case["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let want = std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap();
        for threads in ["1", "2"] {
            // Paths in the arguments are relative to the repository root, where the binary runs.
            let got = sinkmerge(["score"]).args(&args).threads(threads).ok();
            assert!(
                got == want,
                "{name} at {threads} thread(s): score --json differs from the recorded output"
            );
        }
    }
}
