//! Every malformed checkpoint of tests/fixtures/bad gets one clear error naming the file (and the
//! tensor when there is one), exit code 2, no panic and no output on stdout.

use std::path::Path;

use serde_json::Value;

use crate::util::{fixtures, read_json, sinkmerge};

fn inspect(dir: &Path) -> std::process::Output {
    sinkmerge(["inspect", "--check"]).args([dir]).output()
}

#[test]
fn every_bad_case_fails_cleanly_naming_file_and_tensor() {
    let cases: Vec<Value> = read_json(fixtures().join("bad/cases.json"));
    assert!(cases.len() >= 20);
    let mut failures = Vec::new();
    for case in &cases {
        let name = case["case"].as_str().unwrap();
        let out = inspect(&fixtures().join("bad").join(name));
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let mut problems = Vec::new();
        if out.status.code() != Some(2) {
            problems.push(format!("exit {:?}", out.status.code()));
        }
        if !out.stdout.is_empty() {
            problems.push("printed to stdout".into());
        }
        if stderr.contains("panicked") || stderr.trim().lines().count() != 1 {
            problems.push("not exactly one error line".into());
        }
        match case["file"].as_str() {
            Some(file) if !stderr.contains(file) => {
                problems.push(format!("does not name file {file}"))
            }
            None if !stderr.contains("no safetensors") => {
                problems.push("does not say no safetensors were found".into())
            }
            _ => {}
        }
        if let Some(tensor) = case["tensor"].as_str() {
            let alternatives: Vec<&str> = case["alt_tensors"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(Value::as_str)
                .collect();
            if !stderr.contains(tensor) && !alternatives.iter().any(|t| stderr.contains(t)) {
                problems.push(format!("does not name tensor {tensor}"));
            }
        }
        if !problems.is_empty() {
            failures.push(format!(
                "{name}: {} -- stderr: {}",
                problems.join(", "),
                stderr.trim()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "bad-input cases not handled:\n{}",
        failures.join("\n")
    );
}

#[test]
fn the_valid_control_opens() {
    let out = inspect(&fixtures().join("bad/_valid_control"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn missing_paths_and_empty_directories_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = inspect(tmp.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("config.json"));

    let out = inspect(&tmp.path().join("does-not-exist"));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does-not-exist"));
}
