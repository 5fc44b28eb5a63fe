//! `sinkmerge predict` against the paper's own figures (arXiv 2609.00746, Tables 10-12).

use crate::util::sinkmerge;
use serde_json::Value;

fn json(args: &[&str]) -> Value {
    let mut all = vec!["predict", "--json"];
    all.extend_from_slice(args);
    sinkmerge(&all).json()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap()
}

const HEADLINE: &str = "Qwen2.5-VL,Qwen3-VL-8B,InternVL3-8B,InternVL3.5-8B,LLaVA-OV-7B,Molmo2-O-7B";

/// Table 10: held-out predictions per pair.
const TABLE_10: [(&str, f64); 6] = [
    ("Qwen3-VL-8B", -0.92),
    ("InternVL3.5-8B", -3.41),
    ("Qwen2.5-VL", -10.78),
    ("InternVL3-8B", -10.95),
    ("LLaVA-OV-7B", -9.04),
    ("Molmo2-O-7B", -13.74),
];

fn check_headline(r: &Value) {
    assert_eq!(r["n"], 6);
    assert!(
        (f(&r["spearman"]) - 0.971).abs() < 5e-4,
        "{}",
        r["spearman"]
    );
    assert!((f(&r["loo_mae"]) - 2.54).abs() < 0.1, "{}", r["loo_mae"]);
    assert!(
        (f(&r["constant_mae"]) - 4.40).abs() < 0.05,
        "{}",
        r["constant_mae"]
    );
    let held = r["held_out"].as_array().unwrap();
    for (pair, paper) in TABLE_10 {
        let h = held.iter().find(|h| h["pair"] == pair).unwrap();
        let predicted = f(&h["predicted"]);
        assert!(
            (predicted - paper).abs() < 0.1,
            "{pair}: {predicted} vs the paper's {paper}"
        );
        for key in ["sink_strength", "observed"] {
            assert!(h[key].is_f64(), "{key}");
        }
    }
}

/// The six-pair panel carries the unrounded IFEval deltas, -(Lost - Gained) / 541
/// (Section 3.3): LOO MAE 2.555 and constant 4.399 (paper 2.54 and 4.40), and Qwen3-VL-8B's
/// held-out prediction is Table 10's -0.92.
#[test]
fn six_headline_pairs_reproduce_table_10() {
    let r = json(&["--panel", "paper-6"]);
    check_headline(&r);
    assert!((f(&r["loo_mae"]) - 2.555).abs() < 0.005, "{}", r["loo_mae"]);
    assert!(
        (f(&r["constant_mae"]) - 4.399).abs() < 0.005,
        "{}",
        r["constant_mae"]
    );
    let held = r["held_out"].as_array().unwrap();
    let qwen3 = held.iter().find(|h| h["pair"] == "Qwen3-VL-8B").unwrap();
    assert_eq!(format!("{:.2}", f(&qwen3["predicted"])), "-0.92");
    assert!(r["margin_correlation"].is_null());
}

/// The 17-pair panel prints Table 11's one-decimal deltas: the same six pairs there have the
/// same S and deltas that round alike, so the ranks agree, while the rounding moves LOO MAE to
/// 2.59 and the constant baseline (which never uses S) to 4.42.
#[test]
fn selecting_the_six_pairs_from_the_17_panel_gives_the_rounded_figures() {
    let selected = json(&["--pairs", &HEADLINE.to_lowercase()]);
    check_headline(&selected);
    let shipped = json(&["--panel", "paper-6"]);
    assert_eq!(selected["spearman"], shipped["spearman"]);
    let (a, b) = (
        selected["held_out"].as_array().unwrap(),
        shipped["held_out"].as_array().unwrap(),
    );
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert_eq!(
            (&x["pair"], &x["sink_strength"]),
            (&y["pair"], &y["sink_strength"])
        );
        let (rounded, exact) = (f(&x["observed"]), f(&y["observed"]));
        assert_eq!(
            format!("{rounded:.1}"),
            format!("{exact:.1}"),
            "{}",
            x["pair"]
        );
        assert_ne!(rounded, exact, "{}", x["pair"]);
    }
    assert_eq!(format!("{:.2}", f(&selected["loo_mae"])), "2.59");
    assert_eq!(format!("{:.2}", f(&selected["constant_mae"])), "4.42");
}

#[test]
fn seventeen_pairs_give_spearman_0_877() {
    let r = json(&[]);
    assert_eq!(r["n"], 17);
    assert_eq!(r["task"], "delta_ifeval");
    let rho = f(&r["spearman"]);
    assert!((rho - 0.877).abs() < 5e-4, "{rho}");
    assert_eq!(format!("{rho:.2}"), "0.88");
    // The least-squares line through all pairs, as numpy.polyfit gives it.
    assert!((f(&r["intercept"]) + 16.6468).abs() < 1e-3);
    assert!((f(&r["slope"]) - 5.8526).abs() < 1e-3);
    assert!((f(&r["pearson"]) - 0.7665).abs() < 1e-3);
}

#[test]
fn nine_pair_panel_gives_table_12_per_task() {
    for (task, rho) in [
        ("ifeval", 0.945),
        ("gsm8k", 0.877),
        ("eqbench", 0.860),
        ("delta_gpqa_d", 0.821),
    ] {
        let r = json(&["--panel", "paper-9", "--task", task]);
        assert_eq!(r["n"], 9);
        let got = f(&r["spearman"]);
        assert!((got - rho).abs() < 0.005, "{task}: {got} vs {rho}");
    }
}

#[test]
fn a_new_backbone_gets_prediction_similar_range_and_rank() {
    let r = json(&["--s", "1.18"]);
    let q = &r["query"];
    let predicted = f(&r["intercept"]) + f(&r["slope"]) * 1.18;
    assert!((f(&q["predicted"]) - predicted).abs() < 1e-12);
    // |S - 1.18| <= 0.25: the three pairs at 1.18 and those at 1.30, 1.34, 1.39.
    let mut similar: Vec<&str> = q["similar"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pair"].as_str().unwrap())
        .collect();
    similar.sort();
    assert_eq!(
        similar,
        [
            "InternVL3-14B",
            "InternVL3-8B",
            "MolmoE-1B",
            "Ovis2-34B",
            "Ovis2-8B",
            "Qwen2.5-VL"
        ]
    );
    assert_eq!(q["similar_range"], serde_json::json!([-17.9, -5.2]));
    // Ten panel backbones have a larger S; three share 1.18.
    assert_eq!(
        (q["rank"].as_u64(), q["tied"].as_u64(), q["of"].as_u64()),
        (Some(11), Some(3), Some(18))
    );

    let narrow = json(&["--s", "3.5", "--similar-within", "0.1"]);
    assert!(narrow["query"]["similar_range"].is_null());
    assert_eq!(narrow["query"]["rank"], 1);

    let text = sinkmerge(["predict", "--s", "-0.5"]).ok();
    assert!(text.contains("rank          18 of 18"), "{text}");
    assert!(text.contains("no panel pair within"), "{text}");
}

/// `--model` runs the scorer with its defaults and places the measured S exactly as `--s` would.
#[test]
fn a_model_is_scored_then_placed() {
    let model = "assets/models/tiny-qwen3/ref";
    let score: Value = sinkmerge(["score", model, "--json"]).json();
    let s = f(&score["models"][0]["sink_strength"]);
    let r = json(&["--model", model]);
    assert_eq!(r["measured"]["model"], model);
    assert_eq!(f(&r["measured"]["sink_strength"]), s);
    assert_eq!(f(&r["query"]["sink_strength"]), s);
    let by_value = json(&["--s", &s.to_string()]);
    assert_eq!(r["query"], by_value["query"]);

    let text = sinkmerge(["predict", "--model", model]).ok();
    assert!(
        text.contains(&format!("measured      S = {s:.4} for {model}")),
        "{text}"
    );
    let err = sinkmerge(["predict", "--model", "tests/fixtures/no-such-model"]).refused(&[]);
    assert!(err.contains("no-such-model"), "{err}");
}

/// `--model` runs the scorer only after every argument and the panel are checked: a bad
/// `--similar-within` or panel fails before the model is even opened, and writes no plot.
#[test]
fn arguments_and_the_panel_are_checked_before_the_model_is_scored() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("figure3.svg");
    let plot = plot.to_str().unwrap();
    let missing = "tests/fixtures/no-such-model";
    let err = sinkmerge([
        "predict",
        "--model",
        missing,
        "--similar-within",
        "inf",
        "--plot",
        plot,
    ])
    .refused(&["--similar-within"]);
    assert!(err.contains("--similar-within"), "{err}");
    let err = sinkmerge([
        "predict",
        "--model",
        missing,
        "--panel",
        "no-such-panel.csv",
    ])
    .refused(&["no-such-panel"]);
    assert!(err.contains("no-such-panel"), "{err}");
    let err = sinkmerge(["predict", "--model", missing, "--task", "no-such-task"])
        .refused(&["no-such-task"]);
    assert!(err.contains("no-such-task"), "{err}");
    assert!(!std::path::Path::new(plot).exists());
}

#[test]
fn text_report_lists_every_pair_and_the_summary() {
    let text = sinkmerge(["predict"]).ok();
    for needle in [
        "Spearman rho  0.877",
        "LOO MAE",
        "constant MAE",
        "Idefics3-8B",
        "Qwen3-VL-30B-A3B",
    ] {
        assert!(text.contains(needle), "missing `{needle}` in\n{text}");
    }
}

#[test]
fn plot_is_an_svg_with_pair_labels_and_the_fit() {
    let tmp = tempfile::tempdir().unwrap();
    let svg = tmp.path().join("fig3.svg");
    sinkmerge(["predict", "--plot", svg.to_str().unwrap()]).ok();
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"));
    for label in ["Molmo2-O-7B", "Qwen2.5-VL", "fit: y = -16.65 + 5.85 x"] {
        assert!(text.contains(label), "{label}");
    }
}

#[test]
fn own_panels_with_gaps_and_quotes_work() {
    let tmp = tempfile::tempdir().unwrap();
    let csv = tmp.path().join("panel.csv");
    std::fs::write(
        &csv,
        "pair,sink_strength,delta_a,delta_b\r\n\"A, big\",2.0,-1,\r\nB,1.0,-5,-4\r\nC,0.0,-9,-8\r\nD,1.5,-3,-2\r\n",
    )
    .unwrap();
    let path = csv.to_str().unwrap();
    let r = json(&["--panel", path, "--task", "b"]);
    assert_eq!(r["n"], 3);
    assert_eq!(r["skipped"], serde_json::json!(["A, big"]));
    let a = json(&["--panel", path]);
    assert_eq!(
        (a["task"].as_str(), a["n"].as_u64()),
        (Some("delta_a"), Some(4))
    );
}

#[test]
fn own_panel_plot_labels_points_by_pair_not_by_path() {
    let tmp = tempfile::tempdir().unwrap();
    let csv = tmp.path().join("panel.csv");
    std::fs::write(
        &csv,
        "pair,sink_strength,delta_a\nbase-A,2.0,-1\nbase-B,1.0,-5\nbase-C,0.0,-9\n",
    )
    .unwrap();
    let svg = tmp.path().join("own.svg");
    sinkmerge([
        "predict",
        "--panel",
        csv.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ])
    .ok();
    let text = std::fs::read_to_string(&svg).unwrap();
    for label in ["base-A", "base-B", "base-C", "fit: y = "] {
        assert!(text.contains(label), "{label}");
    }
    let dir = tmp.path().to_str().unwrap();
    assert!(!text.contains(dir), "the plot names {dir}");
}

/// Section 3.4 correlates the margin G_base - B_gap with the delta; a panel with a `margin`
/// column gets Spearman's rho and Pearson's r in the text and JSON reports.
#[test]
fn a_margin_column_adds_the_margin_correlation() {
    let tmp = tempfile::tempdir().unwrap();
    let csv = tmp.path().join("margins.csv");
    std::fs::write(
        &csv,
        "pair,sink_strength,margin,delta_ifeval\nA,0.5,0,-9\nB,1.0,1,-6\nC,1.5,2,-5\nD,2.0,4,-2\nE,2.5,3,-2\nF,3.0,,-1\n",
    )
    .unwrap();
    let path = csv.to_str().unwrap();
    let r = json(&["--panel", path]);
    let m = &r["margin_correlation"];
    assert_eq!((m["n"].as_u64(), r["n"].as_u64()), (Some(5), Some(6)));
    assert_eq!(m["skipped"], serde_json::json!(["F"]));
    // Ranks (1, 2, 3, 5, 4) against (1, 2, 3, 4.5, 4.5).
    assert!((f(&m["spearman"]) - 0.974679).abs() < 1e-6, "{m}");
    assert!((f(&m["pearson"]) - 0.964901).abs() < 1e-6, "{m}");
    for key in ["spearman", "pearson", "loo_mae", "constant_mae", "held_out"] {
        assert!(!r[key].is_null(), "{key}");
    }
    let text = sinkmerge(["predict", "--panel", path]).ok();
    for needle in [
        "margin rho    0.975   (Spearman, margin G_base - B_gap vs delta_ifeval, 5 pairs; Pearson r 0.965)",
        "no margin     F",
    ] {
        assert!(text.contains(needle), "missing `{needle}` in\n{text}");
    }
    assert!(!sinkmerge(["predict"]).ok().contains("margin rho"));

    std::fs::write(
        &csv,
        "pair,sink_strength,margin,delta_x\nA,1,0.5,2\nB,2,,3\nC,3,x,4\n",
    )
    .unwrap();
    let err = sinkmerge(["predict", "--panel", path]).refused(&[]);
    assert!(
        err.contains("margins.csv:4") && err.contains("`margin`"),
        "{err}"
    );
}

#[test]
fn bad_panels_and_arguments_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let svg = tmp.path().join("never.svg");
    let err =
        sinkmerge(["predict", "--task", "mmlu", "--plot", svg.to_str().unwrap()]).refused(&[]);
    assert!(
        err.contains("delta_mmlu") && err.contains("delta_ifeval"),
        "{err}"
    );
    assert!(!svg.exists());

    let err = sinkmerge(["predict", "--pairs", "Qwen2.5-VL,Nope"]).refused(&[]);
    assert!(err.contains("`Nope`"), "{err}");

    let err = sinkmerge(["predict", "--panel", "/no/such/panel.csv"]).refused(&[]);
    assert!(err.contains("paper-17"), "{err}");

    let csv = tmp.path().join("bad.csv");
    std::fs::write(&csv, "pair,sink_strength,delta_x\nA,1,2\nB,oops,3\n").unwrap();
    let err = sinkmerge(["predict", "--panel", csv.to_str().unwrap()]).refused(&[]);
    assert!(
        err.contains("bad.csv:3") && err.contains("sink_strength"),
        "{err}"
    );

    std::fs::write(&csv, "pair,sink_strength,delta_x\nA,1,2\nB,1,3\nC,1,4\n").unwrap();
    let err = sinkmerge(["predict", "--panel", csv.to_str().unwrap()]).refused(&[]);
    assert!(err.contains("constant"), "{err}");

    let err = sinkmerge(["predict", "--pairs", "Qwen2.5-VL,Qwen3-VL-8B"]).refused(&[]);
    assert!(err.contains("at least 3"), "{err}");
}
