//! `sinkmerge visual-sinks` against the independent reference `tools/visual_sinks_ref.py`
//! (transformers' eager attention, keys and values; tests/fixtures/visual_sinks/): every
//! statistic of every case within 1e-5, on tiny Qwen3-VL and InternVL models and on the
//! planted-sink model. The planted model's gate finds exactly its red tokens, and the remove edit
//! moves their attention back to the text sink where the random-direction control does not; on
//! its target image, masking or editing the sink moves the top-1 into the box (Table 10). Bad
//! input: one line, exit 2, nothing written.

use serde::Deserialize;
use serde_json::Value;

use crate::util::{read_json, root, sinkmerge};

/// Every number of the reference's JSON (issue: "every reported statistic agrees within 1e-5").
const TOLERANCE: f64 = 1e-5;

#[derive(Deserialize)]
struct Cases {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    model: String,
    args: Vec<String>,
    golden: String,
}

fn cases() -> Vec<Case> {
    read_json::<Cases>(root().join("tests/fixtures/visual_sinks/cases.json")).cases
}

/// Compare every key of `want` (the reference) with `got`; numbers within [`TOLERANCE`] relative
/// to max(1, |want|), everything else equal. The reference's own extras (the logits, which a
/// library test compares, and the echoed image path) are skipped.
fn compare(got: &Value, want: &Value, path: &str, errors: &mut Vec<String>) {
    match want {
        Value::Object(w) => {
            for (k, v) in w {
                if ["image", "logits_before", "logits_after"].contains(&k.as_str()) {
                    continue;
                }
                match got.get(k) {
                    Some(g) => compare(g, v, &format!("{path}.{k}"), errors),
                    None => errors.push(format!("{path}.{k}: missing")),
                }
            }
        }
        Value::Array(w) => match got.as_array() {
            Some(g) if g.len() == w.len() => {
                for (i, (g, w)) in g.iter().zip(w).enumerate() {
                    compare(g, w, &format!("{path}[{i}]"), errors);
                }
            }
            _ => errors.push(format!("{path}: {got} is not {} values", w.len())),
        },
        Value::Number(w) => {
            let w = w.as_f64().unwrap();
            match got.as_f64() {
                Some(g) if (g - w).abs() <= TOLERANCE * w.abs().max(1.0) => {}
                _ => errors.push(format!("{path}: {got} against {w}")),
            }
        }
        _ => {
            if got != want {
                errors.push(format!("{path}: {got} against {want}"));
            }
        }
    }
}

#[test]
fn every_statistic_matches_the_reference() {
    let cases = cases();
    assert!(cases.len() >= 8);
    for case in &cases {
        let mut args = vec!["visual-sinks".to_string(), case.model.clone()];
        args.extend(case.args.iter().cloned());
        args.push("--json".into());
        let got = sinkmerge(&args).current_dir(root()).json();
        let want: Value = read_json(root().join(&case.golden));
        let mut errors = Vec::new();
        compare(&got, &want, "", &mut errors);
        assert!(
            errors.is_empty(),
            "{}: {} differences, first: {:#?}",
            case.name,
            errors.len(),
            &errors[..errors.len().min(10)]
        );
    }
}

/// The planted model's run (tests/fixtures/visual_sinks/planted/README.md), with `extra`.
fn planted_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "visual-sinks",
        "tests/fixtures/visual_sinks/planted/model",
        "--image",
        "tests/fixtures/visual_sinks/planted/image.png",
        "--question",
        "Where is the red square?",
        "--ratio",
        "5",
        "--gate",
        "0.5",
    ];
    args.extend(extra);
    args
}

fn planted(extra: &[&str]) -> Value {
    let mut args = planted_args(extra);
    args.push("--json");
    sinkmerge(&args).current_dir(root()).json()
}

/// The planted model's red cells are tokens 45 and 52 (tests/fixtures/visual_sinks/planted/).
const RED: [u64; 2] = [45, 52];

#[test]
fn the_gate_finds_exactly_the_planted_tokens_and_remove_sends_their_attention_home() {
    let remove = planted(&["--edit", "remove", "--controls"]);
    let image = &remove["images"][0];
    assert_eq!(image["peak_layer"], 2);
    for layer in ["1", "2"] {
        let tokens = image["tokens"][layer].as_array().unwrap();
        let pick = |key: &str| -> Vec<u64> {
            tokens
                .iter()
                .filter(|t| t[key] == true)
                .map(|t| t["position"].as_u64().unwrap())
                .collect()
        };
        assert_eq!(pick("gated"), RED, "layer {layer}: gated");
        assert_eq!(pick("sink"), RED, "layer {layer}: sinks");
        assert_eq!(image["layers"][layer]["text_sink_position"], 0);

        let edit = &image["edit"]["layers"][layer];
        let control = &image["control"]["layers"][layer];
        assert_eq!(edit["affected"], serde_json::json!(RED));
        assert_eq!(control["affected"], serde_json::json!(RED));
        let f = |v: &Value, k: &str| v[k].as_f64().unwrap();
        // The edit: the planted tokens lose most of their share, the text sink gains it.
        assert!(f(edit, "affected_share_before") > 0.9);
        assert!(f(edit, "affected_share_after") < 0.2, "{edit}");
        assert!(f(edit, "text_sink_share_after") > f(edit, "text_sink_share_before") + 0.3);
        // The control, the same tokens with a random direction: nearly nothing moves.
        assert!(f(control, "affected_share_after") > 0.9, "{control}");
        let moved = f(control, "text_sink_share_after") - f(control, "text_sink_share_before");
        assert!(moved.abs() < 0.1, "{control}");
    }
    assert_eq!(image["gate"]["precision"], 1.0);
    assert_eq!(image["gate"]["recall"], 1.0);
    assert_eq!(image["features"]["centered_cos"]["auc"], 1.0);
}

/// The planted target image and its box, the top-left cell (tests/fixtures/visual_sinks/planted/
/// README.md, "The target image").
const TARGET: [&str; 4] = [
    "--image",
    "tests/fixtures/visual_sinks/planted/target.png",
    "--box",
    "0,0,32,32",
];

fn planted_target(extra: &[&str]) -> Value {
    let mut args = planted_args(&[]);
    // The target image replaces planted_args' image.
    args.drain(2..4);
    args.extend(TARGET);
    args.extend(extra);
    args.push("--json");
    sinkmerge(&args).current_dir(root()).json()
}

#[test]
fn masking_or_editing_the_sink_moves_the_top1_into_the_box() {
    let got = planted_target(&["--edit", "remove"]);
    let image = &got["images"][0];
    for layer in ["1", "2"] {
        let l = &image["layers"][layer];
        // The one sink, at about 20x uniform outside the box, is the raw top-1; nothing reaches 100x
        // among 20 tokens, so the 100x mask leaves it, the 10x mask and the edit do not.
        assert_eq!(l["sink_count"], 1, "layer {layer}");
        assert_eq!(l["top1_in_box"], false, "layer {layer}");
        assert_eq!(l["top1_in_box_masked_100"], false, "layer {layer}");
        assert_eq!(l["top1_in_box_masked_10"], true, "layer {layer}");
        assert_eq!(l["top1_in_box_edited"], true, "layer {layer}");
    }
    // Three layers: the upper half is layer 2 alone.
    assert_eq!(
        image["upper_half"],
        serde_json::json!({
            "top1_in_box": 0.0,
            "top1_in_box_masked_100": 0.0,
            "top1_in_box_masked_10": 1.0,
            "top1_in_box_edited": 1.0,
        })
    );
    assert_eq!(image["in_box_share_100"], Value::Null);

    // Without an edit there is no edited map; without a box, no top-1 in it.
    let unedited = planted_target(&[]);
    assert_eq!(
        unedited["images"][0]["layers"]["2"]["top1_in_box_edited"],
        Value::Null
    );
    assert_eq!(
        unedited["images"][0]["upper_half"]["top1_in_box_edited"],
        Value::Null
    );
    let unboxed = planted(&[]);
    for key in ["top1_in_box", "top1_in_box_masked_10"] {
        assert_eq!(unboxed["images"][0]["layers"]["2"][key], Value::Null);
        assert_eq!(unboxed["images"][0]["upper_half"][key], Value::Null);
    }
}

/// Over a manifest: Table 10's shares per layer and over the upper half, in `aggregate`, in the
/// text and in Figure 8.
#[test]
fn the_aggregate_gives_table_10_over_the_images_with_a_box() {
    let dir = tempfile::tempdir().unwrap();
    let planted = root().join("tests/fixtures/visual_sinks/planted");
    // image.png's two sinks stay under 10x (about 9.99 each at layer 2): only the edit moves
    // its top-1 into the box; target.png's one sink is masked at 10x too.
    let lines: String = ["image.png", "target.png"]
        .iter()
        .map(|name| {
            let row = serde_json::json!({
                "image": planted.join(name),
                "question": "Where is the red square?",
                "box": [0, 0, 32, 32],
            });
            format!("{row}\n")
        })
        .collect();
    let manifest = dir.path().join("boxes.jsonl");
    std::fs::write(&manifest, lines).unwrap();
    let manifest = manifest.to_str().unwrap();
    let common = [
        "visual-sinks",
        "tests/fixtures/visual_sinks/planted/model",
        "--manifest",
        manifest,
        "--ratio",
        "5",
        "--edit",
        "remove",
    ];
    let mut json_args = common.to_vec();
    json_args.push("--json");
    let got = sinkmerge(&json_args).current_dir(root()).json();
    let table = &got["aggregate"]["top1_in_box"];
    let want = serde_json::json!({
        "top1_in_box": 0.0,
        "top1_in_box_masked_100": 0.0,
        "top1_in_box_masked_10": 0.5,
        "top1_in_box_edited": 1.0,
    });
    assert_eq!(table["layers"]["2"], want);
    assert_eq!(table["upper_half"], want);
    assert_eq!(table["in_box_share_100"], Value::Null);
    assert_eq!(got["aggregate"]["box_top1_rate"]["2"], 0.0);

    let plots = dir.path().join("figures");
    let mut text_args = common.to_vec();
    text_args.extend(["--plot", plots.to_str().unwrap()]);
    let text = sinkmerge(&text_args).current_dir(root()).ok();
    assert!(
        text.contains(
            "Table 10 over the 2 images with a box (layers ≥ 2): raw 0, masked ≥100× 0, \
             masked ≥10× 0.5000, edited 1.000; share of the ≥100× tokens in the box -"
        ),
        "{text}"
    );
    let figure = std::fs::read_to_string(plots.join("top1.svg")).unwrap();
    // Three layers: the selector layers are round(1.5) = 2 = round(1.75), made distinct.
    assert!(figure.contains("selector layers 1, 2"), "{figure}");
    assert!(!plots.join("image0_top1.svg").exists());
}

#[test]
fn outputs_are_written_whole_and_the_text_report_names_the_peak() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("tokens.csv");
    let plots = dir.path().join("figures");
    let out = sinkmerge(planted_args(&[
        "--edit",
        "remove",
        "--csv",
        csv.to_str().unwrap(),
        "--plot",
        plots.to_str().unwrap(),
    ]))
    .current_dir(root())
    .ok();
    assert!(out.contains("peak layer 2: 2 sinks"), "{out}");
    let rows = std::fs::read_to_string(&csv).unwrap();
    // A header and one row per image token (20) per layer (3).
    assert_eq!(rows.lines().count(), 1 + 20 * 3);
    assert!(rows.starts_with("prompt,image,layer,position,"));
    let mut figures: Vec<String> = std::fs::read_dir(&plots)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    figures.sort();
    assert_eq!(
        figures,
        [
            "image0_angles.svg",
            "image0_depth.svg",
            "image0_heatmap.svg",
            "image0_heatmap_edited.svg"
        ]
    );
    for f in &figures {
        let svg = std::fs::read_to_string(plots.join(f)).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{f}"
        );
    }
}

/// One clear line, exit 2, and neither the CSV nor the plot directory.
fn refused_without_output(args: &[&str], needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("out.csv");
    let plots = dir.path().join("plots");
    let mut all: Vec<&str> = vec!["visual-sinks"];
    all.extend(args);
    all.extend([
        "--csv",
        csv.to_str().unwrap(),
        "--plot",
        plots.to_str().unwrap(),
    ]);
    sinkmerge(&all).current_dir(root()).refused(needles);
    assert!(!csv.exists() && !plots.exists(), "{args:?} wrote output");
}

#[test]
fn bad_input_is_refused_with_nothing_written() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = |name: &str, lines: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, lines).unwrap();
        path.to_str().unwrap().to_string()
    };
    let image = root().join("tests/fixtures/images/scene_100x75.png");
    let image = image.to_str().unwrap();
    let qwen = "tests/fixtures/vlm/qwen3_vl";

    let not_json = manifest(
        "a.jsonl",
        &format!("{{\"image\": \"{image}\", \"question\": \"Hi\"}}\nnot json\n"),
    );
    refused_without_output(
        &[qwen, "--manifest", &not_json],
        &["a.jsonl:2", "not a JSON object"],
    );
    let missing = manifest(
        "b.jsonl",
        "{\"image\": \"nope.png\", \"question\": \"Hi\"}\n",
    );
    refused_without_output(
        &[qwen, "--manifest", &missing],
        &["b.jsonl:1", "nope.png", "no such image"],
    );
    let outside = manifest(
        "c.jsonl",
        &format!("{{\"image\": \"{image}\", \"question\": \"Hi\", \"box\": [10, 10, 120, 50]}}\n"),
    );
    refused_without_output(
        &[qwen, "--manifest", &outside],
        &["c.jsonl:1", "box", "100x75"],
    );
    refused_without_output(
        &[
            qwen,
            "--image",
            image,
            "--question",
            "Hi",
            "--box",
            "50,50,40,60",
        ],
        &["box", "not inside"],
    );
    refused_without_output(
        &[qwen, "--image", image, "--prompt", "Describe<image>"],
        &["no tokens after the image"],
    );
    refused_without_output(
        &[
            "assets/models/tiny-qwen3/ref",
            "--image",
            image,
            "--question",
            "Hi",
        ],
        &["no vision tower"],
    );
    refused_without_output(
        &[qwen, "--image", image, "--question", "Hi", "--controls"],
        &["--controls", "edit"],
    );
    for (flag, needle) in [
        ("--gate=1.5", "outside [-1, 1]"),
        ("--ratio=0", "positive"),
        ("--ratio=-3", "positive"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("out.csv");
        let args = [
            "visual-sinks",
            qwen,
            "--image",
            image,
            "--question",
            "Hi",
            flag,
            "--csv",
            csv.to_str().unwrap(),
        ];
        sinkmerge(args)
            .current_dir(root())
            .refused_with_usage(&[flag.split('=').next().unwrap(), needle]);
        assert!(!csv.exists());
    }
}

/// The rendered multiple-choice question of the `--answers` tests (docs/reference/answers.md).
const COLOUR_QUESTION: &str = "Which colour is the square?";

/// `--answers` against `generate`: the unedited and edited answers are `generate`'s own greedy
/// answers to the same rendered question, without and with `--edit remove` (the same gate and
/// seed), and the KL is `generate --teacher-force --edit remove`'s along the unedited answer.
/// `generate` is itself checked token for token against transformers (tests/generate.rs).
#[test]
fn answers_are_generate_s_own_without_and_with_the_edit() {
    let image = "tests/fixtures/images/scene_100x75.png";
    let qwen = "tests/fixtures/vlm/qwen3_vl";
    let got = sinkmerge([
        "visual-sinks",
        qwen,
        "--image",
        image,
        "--question",
        COLOUR_QUESTION,
        "--options",
        "red",
        "blue",
        "green",
        "--answer",
        "blue",
        "--edit",
        "remove",
        "--gate",
        "0.2",
        "--answers",
        "--max-new-tokens",
        "6",
        "--json",
    ])
    .json();
    let a = &got["images"][0]["answers"];
    let prompt = format!(
        "<image>{COLOUR_QUESTION}\nA. red\nB. blue\nC. green\nAnswer with the option's letter \
         from the given choices directly."
    );
    let generate = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            qwen,
            "--image",
            image,
            "--prompt",
            &prompt,
            "--chat",
            "--greedy",
            "--max-new-tokens",
            "6",
            "--json",
        ];
        args.extend(extra);
        sinkmerge(&args).json()
    };
    let edit = ["--edit", "remove", "--gate", "0.2"];
    let plain = generate(&[]);
    let edited = generate(&edit);
    assert_eq!(a["before"]["generated_ids"], plain["generated_ids"]);
    assert_eq!(a["after"]["generated_ids"], edited["generated_ids"]);
    assert_eq!(a["before"]["text"], plain["text"]);
    assert_eq!(
        edited["edit"]["edited_rows"]
            .as_object()
            .map(|o| o.values().any(|r| r != &Value::Array(vec![]))),
        Some(true),
        "the gate edits some rows, so the edited answer is a real comparison"
    );

    let dir = tempfile::tempdir().unwrap();
    let forced = dir.path().join("forced.json");
    let ids = serde_json::json!({ "token_ids": plain["generated_ids"] });
    std::fs::write(&forced, ids.to_string()).unwrap();
    let mut args = vec![
        "generate",
        qwen,
        "--image",
        image,
        "--prompt",
        &prompt,
        "--chat",
        "--teacher-force",
        forced.to_str().unwrap(),
        "--json",
    ];
    args.extend(edit);
    let scored = sinkmerge(&args).json();
    let kl: Vec<f64> = (scored["positions"].as_array().unwrap().iter())
        .map(|p| p["kl"].as_f64().unwrap())
        .collect();
    let got_kl: Vec<f64> = (a["kl"].as_array().unwrap().iter())
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(got_kl, kl);
    assert_eq!(a["mean_kl"], scored["mean_kl"]);
    assert!(
        got_kl.iter().any(|&k| k > 0.0),
        "the edit changes the distribution"
    );

    assert_eq!(a["expected"], "B");
    for run in ["before", "after"] {
        let read = &a[run]["answer"];
        assert_eq!(a[run]["correct"], Value::Bool(read == "B"), "{run}: {a}");
    }
    let agree = a["before"]["answer"] == a["after"]["answer"]
        && (!a["before"]["answer"].is_null() || a["before"]["text"] == a["after"]["text"]);
    assert_eq!(a["agree"], agree);
    let total = &got["answers"];
    assert_eq!(total["prompts"], 1);
    assert_eq!(total["with_answer"], 1);
    let right = |run: &str| if a[run]["correct"] == true { 1.0 } else { 0.0 };
    assert_eq!(total["accuracy_before"], right("before"));
    assert_eq!(total["accuracy_after"], right("after"));
    assert_eq!(total["agreement"], if agree { 1.0 } else { 0.0 });
}

#[test]
fn bad_answers_are_refused_with_nothing_written() {
    let dir = tempfile::tempdir().unwrap();
    let image = root().join("tests/fixtures/images/scene_100x75.png");
    let image = image.to_str().unwrap();
    let qwen = "tests/fixtures/vlm/qwen3_vl";
    let manifest = dir.path().join("m.jsonl");
    let line = serde_json::json!({
        "image": image, "question": COLOUR_QUESTION,
        "options": ["red", "blue"], "answer": "green",
    });
    std::fs::write(&manifest, format!("{line}\n")).unwrap();
    refused_without_output(
        &[
            qwen,
            "--manifest",
            manifest.to_str().unwrap(),
            "--edit",
            "remove",
            "--answers",
        ],
        &["m.jsonl:1", "\"green\"", "not among its options"],
    );
    refused_without_output(
        &[qwen, "--image", image, "--question", "Hi", "--answers"],
        &["--answers", "--edit remove"],
    );
    let raw = dir.path().join("raw.jsonl");
    let line = serde_json::json!({
        "image": image, "prompt": "<image>Hi", "options": ["red", "blue"],
    });
    std::fs::write(&raw, format!("{line}\n")).unwrap();
    refused_without_output(
        &[qwen, "--manifest", raw.to_str().unwrap()],
        &["raw.jsonl:1", "options belong to a `question`"],
    );
    refused_without_output(
        &[
            qwen,
            "--image",
            image,
            "--question",
            "Hi",
            "--options",
            "red",
            "red",
        ],
        &["--question", "option B repeats"],
    );
}
