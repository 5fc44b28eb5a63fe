//! Every YAML in merge-configs/ parses as a merge config without warnings, and each pair has the
//! paper's seven settings with their hyperparameters.

use std::path::PathBuf;

use sinkmerge::merge::params::{ParamValue, Setting};
use sinkmerge::merge::MergeSpec;

use crate::util::root;

fn configs() -> PathBuf {
    root().join("merge-configs")
}

fn number(s: Option<&Setting>) -> Option<f64> {
    match s {
        Some(Setting::Scalar(ParamValue::Number(x))) => Some(*x),
        _ => None,
    }
}

#[test]
fn every_paper_config_parses_with_the_papers_hyperparameters() {
    let mut pairs = 0;
    for pair in std::fs::read_dir(configs()).unwrap() {
        let pair = pair.unwrap().path();
        if !pair.is_dir() {
            continue;
        }
        pairs += 1;
        let mut names = Vec::new();
        for file in std::fs::read_dir(&pair).unwrap() {
            let file = file.unwrap().path();
            assert_eq!(file.extension().unwrap(), "yml", "{}", file.display());
            let (spec, warnings) = MergeSpec::from_yaml_file(&file)
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            assert!(warnings.is_empty(), "{}: {warnings:?}", file.display());
            let stem = file.file_stem().unwrap().to_string_lossy().into_owned();
            let method = spec.method.name();
            let first = &spec.models[0].params;
            match stem.as_str() {
                "mix95" => {
                    assert_eq!(method, "linear");
                    assert_eq!(number(first.get("weight")), Some(0.95));
                }
                "average" => {
                    assert_eq!(method, "linear");
                    assert_eq!(number(first.get("weight")), Some(0.5));
                }
                "task_arithmetic" => assert_eq!(number(spec.params.get("lambda")), Some(1.0)),
                "tsv" => assert_eq!(number(spec.params.get("alpha")), Some(1.0)),
                "star" => assert_eq!(number(spec.params.get("eta")), Some(40.0)),
                "ties" => assert_eq!(number(first.get("density")), Some(0.2)),
                "dare" => assert_eq!(number(first.get("density")), Some(0.1)),
                other => panic!("unexpected config {other}"),
            }
            if spec.method.needs_base() {
                let base = spec.base.as_deref().unwrap();
                assert!(
                    base.starts_with("Qwen/") && !base.contains("Instruct"),
                    "{base}"
                );
                assert_eq!(spec.models.len(), 2);
            }
            assert!(spec.models.iter().any(|m| m.model.ends_with(":ref")));
            assert!(spec
                .models
                .iter()
                .any(|m| m.model.starts_with("./") && m.model.ends_with("-lm")));
            names.push(stem);
        }
        names.sort();
        assert_eq!(
            names,
            [
                "average",
                "dare",
                "mix95",
                "star",
                "task_arithmetic",
                "ties",
                "tsv"
            ],
            "{}",
            pair.display()
        );
    }
    assert_eq!(pairs, 2);
}
