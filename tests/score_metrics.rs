//! `sinkmerge score --json` against the independent Python reference of
//! docs/reference/sink-metrics.md
//! (`tools/sink_metrics_ref.py`: numpy on the scores transformers' eager attention computes).
//! S, pos0_share, strong_sink_frac, b_gap_median and margin agree within 1e-4, and so do the
//! per-layer, per-head and Theorem-1 numbers; observation counts and modal sink positions exactly.

use serde_json::Value;
use std::cell::Cell;

use crate::util::{read_json, root, sinkmerge};

const TOL: f64 = 1e-4;

thread_local! {
    /// Largest |ours - reference| seen by `close` in this test.
    static WORST: Cell<f64> = const { Cell::new(0.0) };
}

fn num(v: &Value, key: &str, what: &str) -> Option<f64> {
    match v.get(key) {
        None | Some(Value::Null) => None,
        Some(x) => Some(
            x.as_f64()
                .unwrap_or_else(|| panic!("{what}: {key} is not a number")),
        ),
    }
}

fn close(ours: &Value, want: &Value, key: &str, what: &str) {
    let (a, b) = (num(ours, key, what), num(want, key, what));
    match (a, b) {
        (Some(a), Some(b)) => {
            WORST.with(|w| w.set(w.get().max((a - b).abs())));
            assert!(
                (a - b).abs() <= TOL,
                "{what}: {key} = {a} but the reference says {b} (|diff| {:.2e})",
                (a - b).abs()
            )
        }
        (None, None) => {}
        _ => panic!("{what}: {key} is {a:?} but the reference says {b:?}"),
    }
}

fn same(ours: &Value, want: &Value, key: &str, what: &str) {
    assert_eq!(ours.get(key), want.get(key), "{what}: {key}");
}

fn close_list(ours: &Value, want: &Value, key: &str, what: &str) {
    match (ours.get(key), want.get(key)) {
        (Some(Value::Array(a)), Some(Value::Array(b))) => {
            assert_eq!(a.len(), b.len(), "{what}: {key} length");
            for (x, y) in a.iter().zip(b) {
                let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
                // Relative: these are ratios of norms.
                assert!(
                    (x - y).abs() <= TOL * y.abs().max(1.0),
                    "{what}: {key} {x} vs {y}"
                );
            }
        }
        (None, None) => {}
        (a, b) => panic!("{what}: {key} is {a:?} but the reference says {b:?}"),
    }
}

fn check(case: &str) {
    let path = root().join(format!("tests/fixtures/score/metrics/{case}.json"));
    let want: Value = read_json(&path);
    let cli: Vec<String> = want["cli"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let ours = sinkmerge(["score"]).args(&cli).args(["--json"]).json();
    let (om, wm) = (
        ours["models"].as_array().unwrap(),
        want["models"].as_array().unwrap(),
    );
    assert_eq!(om.len(), wm.len(), "{case}: models");
    for (o, w) in om.iter().zip(wm) {
        let what = format!("{case} {}", w["model"]);
        for key in [
            "sink_strength",
            "median_g",
            "pos0_share",
            "strong_sink_frac",
        ] {
            close(o, w, key, &what);
        }
        same(o, w, "n_observations", &what);
        same(o, w, "window", &what);
        same(o, w, "reference", &what);
        let (ol, wl) = (
            o["per_layer"].as_array().unwrap(),
            w["per_layer"].as_array().unwrap(),
        );
        assert_eq!(ol.len(), wl.len(), "{what}: layers");
        for (a, b) in ol.iter().zip(wl) {
            let what = format!("{what} layer {}", b["layer"]);
            for key in [
                "median_g",
                "mean_g",
                "pos0_share",
                "gamma_q_inf",
                "gamma_k_inf",
            ] {
                close(a, b, key, &what);
            }
            same(a, b, "n_observations", &what);
            close_list(a, b, "m_q", &what);
            close_list(a, b, "m_k", &what);
        }
        let (oh, wh) = (
            o["per_head"].as_array().unwrap(),
            w["per_head"].as_array().unwrap(),
        );
        assert_eq!(oh.len(), wh.len(), "{what}: heads");
        for (a, b) in oh.iter().zip(wh) {
            let what = format!("{what} layer {} head {}", b["layer"], b["head"]);
            close(a, b, "median_g", &what);
            close(a, b, "pos0_share", &what);
            same(a, b, "sink_position", &what);
        }
    }
    let (op, wp) = (
        ours["pairs"].as_array().unwrap(),
        want["pairs"].as_array().unwrap(),
    );
    assert_eq!(op.len(), wp.len(), "{case}: pairs");
    for (a, b) in op.iter().zip(wp) {
        let what = format!("{case} pair {}", b["target"]);
        for key in ["g_base_median", "b_gap_median", "margin"] {
            close(a, b, key, &what);
        }
        same(a, b, "n_observations", &what);
    }
    eprintln!(
        "{case:28} S = {:?}, margin = {:?}: largest difference from the reference {:.1e}",
        om.iter()
            .map(|m| m["sink_strength"].as_f64())
            .collect::<Vec<_>>(),
        op.iter().map(|p| p["margin"].as_f64()).collect::<Vec<_>>(),
        WORST.with(Cell::get)
    );
}

macro_rules! metrics {
    ($($test:ident: $case:expr;)*) => {$(
        #[test]
        fn $test() {
            check($case);
        }
    )*};
}

metrics! {
    qwen2_reference_pair: "qwen2_pair";
    qwen3_last_layer_with_theorem_ingredients: "qwen3_last1";
    olmo3_per_query_sinks_and_mean_stat: "olmo3_sw_per_query_mean";
    mistral_sink_outside_the_window: "mistral_hd_window";
    qwen3_moe_with_chat_template: "qwen3_moe_chat";
    llama31_with_bos: "llama31_rope_bos";
    olmoe_layerwise_qk_norm: "olmoe_qk";
}

/// The bundled trained models (reference vs VL-adapted, `assets/models/`, made by
/// `tools/train_tiny.py`) against the independent reference: the table of README.md, "The bundled
/// models".
#[test]
fn bundled_qwen2_models_match_the_reference() {
    check("tiny_qwen2_bundled");
}

#[test]
fn bundled_qwen3_models_match_the_reference() {
    check("tiny_qwen3_bundled");
}
