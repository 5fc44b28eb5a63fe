//! `generate`'s decode against transformers 5.25.0's greedy `generate` (eager attention, f32):
//! `tests/fixtures/generate/` (tools/gen_generate_goldens.py). Every case: 40 new tokens equal to
//! transformers', and every step's logits within 1e-4 of that step's largest magnitude.

use std::path::Path;

use serde::Deserialize;

use crate::util::{read_json, root};
use sinkmerge::checkpoint::Checkpoint;
use sinkmerge::commands::image_prompt::{read_pixel_file, Prompter};
use sinkmerge::forward::backend::cpu::CpuBackend;
use sinkmerge::forward::backend::HeadView;
use sinkmerge::forward::capture;
use sinkmerge::forward::resident::Resident;
use sinkmerge::forward::weights::Model;
use sinkmerge::generate::sequence::{Logits, Sequence};

/// Logits within this fraction of the step's largest |logit| (the issue's tolerance).
const LOGITS_TOLERANCE: f32 = 1e-4;

#[derive(Deserialize)]
pub struct Golden {
    pub model: String,
    pub prompt_ids: Vec<u32>,
    pub pixel_values: Option<String>,
    pub generated_ids: Vec<u32>,
    pub edit: Option<serde_json::Value>,
}

pub fn golden(case: &str) -> (Golden, Vec<Vec<f32>>) {
    let dir = root().join("tests/fixtures/generate");
    let golden: Golden = read_json(dir.join(format!("{case}.json")));
    let bytes = std::fs::read(dir.join(format!("{case}.logits.safetensors"))).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    let vocab = t.shape()[1];
    let values: Vec<f32> = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let steps = values.chunks(vocab).map(<[f32]>::to_vec).collect();
    (golden, steps)
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// The largest |ours - theirs| over a step's logits, relative to its largest |logit|.
fn relative_error(ours: &[f32], theirs: &[f32]) -> f32 {
    assert_eq!(ours.len(), theirs.len(), "vocab");
    let scale = theirs.iter().fold(0f32, |m, &v| m.max(v.abs())).max(1e-30);
    ours.iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale
}

/// Decode `case` greedily on the CPU and compare every step; returns the worst relative error.
fn decode_case(case: &str) -> f32 {
    let (golden, steps) = golden(case);
    assert!(
        golden.edit.is_none(),
        "{case}: edit cases run through the CLI"
    );
    let ckpt = Checkpoint::open_dir(&root().join(&golden.model), "golden").unwrap();
    let model = Model::new(&ckpt).unwrap();
    let backend = CpuBackend::default();
    let weights = Resident::load(&backend, &model).unwrap();
    let pixels = golden
        .pixel_values
        .as_ref()
        .map(|p| read_pixel_file(&root().join(p)).unwrap());
    // Text-only fixtures may have no tokenizer: their prompt is ids.
    let prompter = pixels
        .as_ref()
        .map(|_| Prompter::new(&ckpt, &model, false).unwrap());
    let prompt = match &prompter {
        Some(p) => p
            .prompt(golden.prompt_ids.clone(), pixels.as_ref())
            .unwrap(),
        None => capture::Prompt {
            ids: golden.prompt_ids.clone(),
            images: None,
            mrope_merge: None,
        },
    };
    let encoded = capture::encode(&backend, &model, &prompt).unwrap();
    let capacity = golden.prompt_ids.len() + steps.len();
    let mut seq = Sequence::new(&model, &backend, &weights, capacity, None).unwrap();
    let mut logits = seq
        .prefill(
            &prompt,
            encoded.as_ref(),
            &|_, _: &HeadView| (),
            &mut (),
            Logits::Last,
        )
        .unwrap();
    let mut worst = 0f32;
    for (i, theirs) in steps.iter().enumerate() {
        let err = relative_error(&logits, theirs);
        worst = worst.max(err);
        assert!(
            err <= LOGITS_TOLERANCE,
            "{case}: step {i}: logits differ by {err:e} of the largest"
        );
        let token = argmax(&logits);
        assert_eq!(token, golden.generated_ids[i], "{case}: step {i}'s token");
        if i + 1 < steps.len() {
            logits = seq.step(token).unwrap();
        }
    }
    worst
}

fn cases() -> Vec<String> {
    let dir = root().join("tests/fixtures/generate");
    let mut cases: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            let case = name.strip_suffix(".logits.safetensors")?.to_string();
            Some(case)
        })
        .collect();
    cases.sort();
    assert!(Path::new(&dir).join("README.md").is_file());
    cases
}

#[test]
fn greedy_decoding_equals_transformers_generate() {
    let mut checked = 0;
    for case in cases() {
        let (golden, _) = golden(&case);
        if golden.edit.is_some() {
            continue;
        }
        let worst = decode_case(&case);
        println!("{case}: 40 tokens equal, logits within {worst:.1e} of the largest");
        checked += 1;
    }
    assert!(checked >= 30, "{checked} cases");
}

// The command line.

use crate::util::sinkmerge;

const TINY: &str = "assets/models/tiny-qwen2/ref";

/// A golden case's prompt ids in a file, for `--prompt-ids`.
fn prompt_file(dir: &Path, case: &str) -> std::path::PathBuf {
    let (golden, _) = golden(case);
    let path = dir.join(format!("{case}.ids.json"));
    std::fs::write(&path, serde_json::to_vec(&golden.prompt_ids).unwrap()).unwrap();
    path
}

#[test]
fn the_command_decodes_as_transformers_and_reports_each_step() {
    let dir = tempfile::tempdir().unwrap();
    let (golden, steps) = golden("tiny_qwen2_ref");
    let ids = prompt_file(dir.path(), "tiny_qwen2_ref");
    let report = sinkmerge(["generate", TINY, "--greedy", "--ignore-eos", "--json"])
        .args(["--max-new-tokens", "40", "--prompt-ids"])
        .args([&ids])
        .json();
    let generated: Vec<u32> = serde_json::from_value(report["generated_ids"].clone()).unwrap();
    assert_eq!(generated, golden.generated_ids);
    assert_eq!(report["stop_reason"], "max_new_tokens");
    assert_eq!(
        report["prompt_ids"].as_array().unwrap().len(),
        golden.prompt_ids.len()
    );
    let first = &report["steps"][0];
    // The raw distribution of step 0, from transformers' logits.
    let logits = &steps[0];
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let log_z = max as f64
        + logits
            .iter()
            .map(|&v| ((v - max) as f64).exp())
            .sum::<f64>()
            .ln();
    let token = golden.generated_ids[0] as usize;
    let logprob = first["logprob"].as_f64().unwrap();
    assert!(
        (logprob - (logits[token] as f64 - log_z)).abs() < 1e-4,
        "{logprob}"
    );
    assert_eq!(first["top5"].as_array().unwrap().len(), 5);
    assert_eq!(first["top5"][0]["token_id"], golden.generated_ids[0]);
    assert!(first["entropy"].as_f64().unwrap() > 0.0);
    for key in ["prefill_tokens_per_s", "decode_tokens_per_s"] {
        assert!(report["timings"][key].as_f64().unwrap() > 0.0, "{key}");
    }
    assert_eq!(report["settings"]["do_sample"]["source"], "flag");
}

#[test]
fn text_streams_and_stops_at_eos_or_a_stop_string() {
    let text = sinkmerge(["generate", TINY, "--prompt", "The capital of France is"])
        .args(["--max-new-tokens", "24"])
        .ok();
    assert!(text.ends_with('\n') && text.len() > 1, "{text:?}");
    let report = sinkmerge(["generate", TINY, "--prompt", "The capital of France is"])
        .args(["--max-new-tokens", "24", "--json"])
        .json();
    let answer = report["text"].as_str().unwrap();
    assert_eq!(
        text.trim_end_matches('\n'),
        answer,
        "streamed text = the report's"
    );
    // A stop string taken from the answer's middle ends it there.
    let words: Vec<&str> = answer.split_whitespace().collect();
    if words.len() >= 3 {
        let stop = words[1];
        let stopped = sinkmerge(["generate", TINY, "--prompt", "The capital of France is"])
            .args(["--max-new-tokens", "24", "--json", "--stop", stop])
            .json();
        assert_eq!(stopped["stop_reason"], "stop");
        let t = stopped["text"].as_str().unwrap();
        assert!(t.contains(stop) && t.len() <= answer.len(), "{t:?}");
    }
}

#[test]
fn sampling_is_seeded_and_the_same_at_any_thread_count() {
    // tiny-qwen2: a 2048-row LM head and 4 layers of hidden 256, so both threads take blocks.
    let run = |threads: &str, seed: &str| {
        sinkmerge([
            "generate",
            TINY,
            "--prompt",
            "Once upon a time",
            "--do-sample",
        ])
        .args(["--temperature", "1.3", "--top-k", "40", "--top-p", "0.95"])
        .args([
            "--max-new-tokens",
            "32",
            "--ignore-eos",
            "--json",
            "--seed",
            seed,
        ])
        .threads(threads)
        .json()
    };
    let one = run("1", "7");
    let two = run("2", "7");
    assert_eq!(one["generated_ids"], two["generated_ids"]);
    assert_eq!(one["text"], two["text"]);
    assert_eq!(one["settings"]["do_sample"]["value"], true);
    let other = run("2", "8");
    assert_ne!(
        one["generated_ids"], other["generated_ids"],
        "seeds 7 and 8"
    );
}

#[test]
fn a_batch_gives_line_for_line_what_single_runs_give() {
    let dir = tempfile::tempdir().unwrap();
    let batch = dir.path().join("prompts.jsonl");
    std::fs::write(
        &batch,
        "{\"prompt\": \"The capital of France is\", \"max_new_tokens\": 12}\n\
         {\"prompt\": \"Once upon a time\", \"do_sample\": true, \"seed\": 3, \"max_new_tokens\": 10}\n\
         \n\
         {\"prompt\": \"2 + 2 =\", \"max_new_tokens\": 8, \"repetition_penalty\": 1.3}\n",
    )
    .unwrap();
    let out = sinkmerge(["generate", TINY, "--batch"]).args([&batch]).ok();
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    let singles = [
        vec![
            "--prompt",
            "The capital of France is",
            "--max-new-tokens",
            "12",
        ],
        vec![
            "--prompt",
            "Once upon a time",
            "--do-sample",
            "--seed",
            "3",
            "--max-new-tokens",
            "10",
        ],
        vec![
            "--prompt",
            "2 + 2 =",
            "--max-new-tokens",
            "8",
            "--repetition-penalty",
            "1.3",
        ],
    ];
    for (line, single) in lines.iter().zip(singles) {
        let alone = sinkmerge(["generate", TINY, "--json"]).args(single).json();
        for key in [
            "prompt_ids",
            "generated_ids",
            "text",
            "stop_reason",
            "steps",
        ] {
            assert_eq!(line[key], alone[key], "{key}");
        }
    }
}

#[test]
fn bad_input_is_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    sinkmerge(["generate", TINY, "--prompt", "x", "--max-new-tokens", "0"])
        .refused(&["--max-new-tokens 0"]);
    // tiny-qwen2 has max_position_embeddings 512.
    sinkmerge(["generate", TINY, "--prompt", "x", "--max-new-tokens", "600"])
        .refused(&["max_position_embeddings 512"]);
    sinkmerge([
        "generate",
        "assets/models/tiny-qwen3/vlm",
        "--chat",
        "--prompt",
        "hi",
    ])
    .args(["--template-arg", "no_such_variable=1"])
    .refused(&["no_such_variable"]);
    sinkmerge([
        "generate",
        "tests/fixtures/vlm/qwen3_vl",
        "--prompt",
        "<image><image>x",
    ])
    .args(["--image", "tests/fixtures/images/wide_150x61.jpg"])
    .refused(&["2 `<image>` marker(s) but 1 image(s)"]);
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"prompt\": \"x\", \"bogus\": 1}\n").unwrap();
    sinkmerge(["generate", TINY, "--batch"])
        .args([&bad])
        .refused(&["line 1", "bogus"]);
}

#[test]
fn nan_in_the_logits_exits_3() {
    sinkmerge(["generate", "tests/fixtures/nonfinite", "--prompt", "hello"])
        .args(["--max-new-tokens", "4"])
        .non_finite(&["NaN"]);
}

/// A safetensors file's tensors by name: shape and values as f64.
fn read_tensors(path: &Path) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<f64>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, t)| {
            let values = match t.dtype() {
                safetensors::Dtype::F32 => (t.data().chunks_exact(4))
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
                    .collect(),
                safetensors::Dtype::I64 => (t.data().chunks_exact(8))
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f64)
                    .collect(),
                other => panic!("{name}: {other:?}"),
            };
            (name, (t.shape().to_vec(), values))
        })
        .collect()
}

/// `generate --capture all` equals `trace`'s one full pass over every token the model ran (the
/// prompt and each generated token but the last): the cached steps and the one pass differ only
/// in the order of their sums.
#[test]
fn capture_equals_one_full_pass_over_the_generated_sequence() {
    let dir = tempfile::tempdir().unwrap();
    let (golden, _) = golden("tiny_qwen2_ref");
    let ids = prompt_file(dir.path(), "tiny_qwen2_ref");
    let out = dir.path().join("gen.safetensors");
    let new_tokens = 12;
    let report = sinkmerge(["generate", TINY, "--greedy", "--ignore-eos", "--json"])
        .args(["--max-new-tokens", &new_tokens.to_string(), "--prompt-ids"])
        .args([&ids])
        .args(["--capture", "all", "-o"])
        .args([&out])
        .json();
    let generated: Vec<u32> = serde_json::from_value(report["generated_ids"].clone()).unwrap();
    assert_eq!(generated, golden.generated_ids[..new_tokens]);
    let ours = read_tensors(&out);
    let run: Vec<u32> = (golden.prompt_ids.iter())
        .chain(&generated[..new_tokens - 1])
        .copied()
        .collect();
    let t = run.len();
    let as_ids = |name: &str| -> Vec<u32> { ours[name].1.iter().map(|&v| v as u32).collect() };
    assert_eq!(as_ids("input_ids"), run);
    assert_eq!(as_ids("generated_ids"), generated);

    let ckpt = Checkpoint::open_dir(&root().join(TINY), "tiny").unwrap();
    let model = Model::new(&ckpt).unwrap();
    let prompt = capture::Prompt {
        ids: run,
        images: None,
        mrope_merge: None,
    };
    let all: capture::CaptureSet = "all".parse().unwrap();
    let layers: Vec<usize> = (0..model.spec.num_layers()).collect();
    let backend = CpuBackend::default();
    let full = capture::run(&backend, &model, &prompt, &all, &layers, |_| ()).unwrap();
    let mut names: Vec<&str> = full.iter().map(|k| k.name.as_str()).collect();
    names.push("generated_ids");
    names.sort();
    let got: Vec<&str> = ours.keys().map(String::as_str).collect();
    assert_eq!(got, names);
    let mut worst = 0f64;
    for k in &full {
        let (shape, values) = &ours[&k.name];
        assert_eq!(shape, &k.shape, "{}", k.name);
        let want: Vec<f64> = match &k.values {
            capture::Values::F32(v) => v.iter().map(|&x| x as f64).collect(),
            capture::Values::I64(v) => v.iter().map(|&x| x as f64).collect(),
        };
        let diff = (values.iter().zip(&want)).fold(0f64, |m, (a, b)| m.max((a - b).abs()));
        // Within 1e-5 of the tensor's largest magnitude, or absolutely below 1 (attentions).
        let scale = want.iter().fold(1f64, |m, v| m.max(v.abs()));
        eprintln!(
            "{}: max |difference| {diff:.2e} (largest |value| {scale:.2})",
            k.name
        );
        assert!(
            diff <= 1e-5 * scale,
            "{}: differs by {diff:e} of {scale}",
            k.name
        );
        worst = worst.max(diff / scale);
    }
    assert_eq!(ours["attentions.0"].0, vec![4, t, t]);
    eprintln!("generate --capture vs one full pass: max relative difference {worst:e}");
}

/// `--capture` is written once the generation ends: an interrupted generation writes nothing.
#[test]
fn an_interrupted_capture_exits_130_and_writes_nothing() {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("gen.safetensors");
    let mut child = Command::new(env!("CARGO_BIN_EXE_sinkmerge"))
        .current_dir(root())
        .args(["generate", TINY, "--prompt", "The capital of France is"])
        .args([
            "--max-new-tokens",
            "400",
            "--ignore-eos",
            "--capture",
            "all",
            "-o",
        ])
        .arg(&out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    stdout
        .read_exact(&mut first)
        .expect("text streams before the end");
    // SAFETY: kill(2) on our own child, which has not been waited for.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{status:?}");
    assert!(
        !out.exists(),
        "an interrupted capture wrote {}",
        out.display()
    );
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn capture_and_its_output_need_each_other() {
    sinkmerge(["generate", TINY, "--prompt", "x", "--capture", "all"])
        .refused_with_usage(&["--output"]);
    sinkmerge(["generate", TINY, "--prompt", "x", "-o", "x.safetensors"])
        .refused_with_usage(&["--capture"]);
    sinkmerge([
        "generate",
        TINY,
        "--prompt",
        "x",
        "--capture",
        "bogus",
        "-o",
        "x.st",
    ])
    .refused_with_usage(&["bogus"]);
}

/// The remove edit during generate (`*_edit_remove`): transformers' generate with the editor
/// hooked. The command gates the same rows, generates the same 40 tokens, and each step's
/// reported log-probabilities (the chosen token's and the top five) equal the golden logits'
/// log-softmax within 1e-4 of the step's largest |logit|.
#[test]
fn the_edit_during_generate_equals_the_hooked_transformers_generate() {
    for case in ["qwen3_vl_edit_remove", "internvl_edit_remove"] {
        let (golden, steps) = golden(case);
        let raw: serde_json::Value =
            read_json(root().join(format!("tests/fixtures/generate/{case}.json")));
        let edit = golden.edit.as_ref().unwrap();
        // `--layers all` is the flag left out.
        let cli: Vec<String> = (edit["cli"].as_array().unwrap().iter())
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        let mut flags = Vec::new();
        let mut i = 0;
        while i < cli.len() {
            if cli[i] == "--layers" && cli[i + 1] == "all" {
                i += 2;
                continue;
            }
            flags.push(cli[i].clone());
            i += 1;
        }
        let prompt = format!("<image>{}", raw["question"].as_str().unwrap());
        let report = sinkmerge([
            "generate",
            &golden.model,
            "--greedy",
            "--ignore-eos",
            "--json",
        ])
        .args(["--max-new-tokens", "40", "--chat", "--prompt", &prompt])
        .args(["--pixel-values", golden.pixel_values.as_deref().unwrap()])
        .args(&flags)
        .json();
        let prompt_ids: Vec<u32> = serde_json::from_value(report["prompt_ids"].clone()).unwrap();
        assert_eq!(prompt_ids, golden.prompt_ids, "{case}: prompt");
        let generated: Vec<u32> = serde_json::from_value(report["generated_ids"].clone()).unwrap();
        assert_eq!(generated, golden.generated_ids, "{case}: tokens");
        let rows = &report["edit"]["edited_rows"];
        for (layer, want) in edit["edited_rows"].as_object().unwrap() {
            assert_eq!(&rows[layer], want, "{case}: edited rows at layer {layer}");
        }
        let mut worst = 0f64;
        for (k, logits) in steps.iter().enumerate() {
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let scale = logits.iter().fold(0f32, |m, &v| m.max(v.abs())) as f64;
            let log_z = max
                + logits
                    .iter()
                    .map(|&v| (v as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            let step = &report["steps"][k];
            let mut pairs = vec![(step["token_id"].as_u64().unwrap(), step["logprob"].clone())];
            for t in step["top5"].as_array().unwrap() {
                pairs.push((t["token_id"].as_u64().unwrap(), t["logprob"].clone()));
            }
            for (id, lp) in pairs {
                let want = logits[id as usize] as f64 - log_z;
                worst = worst.max((lp.as_f64().unwrap() - want).abs() / scale);
            }
        }
        assert!(
            worst <= 1e-4,
            "{case}: log-probabilities differ by {worst:.2e}"
        );
        eprintln!("{case}: worst log-probability error {worst:.2e} of the largest |logit|");
    }
}

/// The edit goldens at the library level, the editor built as the command builds it
/// (`edit_probe::probe`, then `sink::visual::editor`): every step's raw logits within 1e-4 of the
/// step's largest |logit|, the same tokens and the same edited rows.
#[test]
fn the_edited_decode_equals_the_golden_logits() {
    use sinkmerge::commands::args::{KeyEditArgs, KeysArg};
    use sinkmerge::sink::visual::{self, edit::EditKind};
    for case in ["qwen3_vl_edit_remove", "internvl_edit_remove"] {
        let (golden, steps) = golden(case);
        let edit = golden.edit.clone().unwrap();
        let ckpt = Checkpoint::open_dir(&root().join(&golden.model), "golden").unwrap();
        let model = Model::new(&ckpt).unwrap();
        let backend = CpuBackend::default();
        let weights = Resident::load(&backend, &model).unwrap();
        let pixels = read_pixel_file(&root().join(golden.pixel_values.as_ref().unwrap())).unwrap();
        let prompter = Prompter::new(&ckpt, &model, true).unwrap();
        let prompt = prompter
            .prompt(golden.prompt_ids.clone(), Some(&pixels))
            .unwrap();
        let encoded = capture::encode(&backend, &model, &prompt).unwrap();
        let key_edit = KeyEditArgs {
            layers: None,
            gate: edit["gate"].as_f64().unwrap(),
            keys: KeysArg::PreRope,
            edit: EditKind::Remove,
            median_target: false,
            controls: false,
        };
        let (vs, sinks, positions) = sinkmerge::commands::edit_probe::probe(
            &key_edit,
            0,
            &model,
            &prompter,
            &backend,
            encoded.as_ref(),
            Some(&pixels),
            &golden.prompt_ids,
        )
        .unwrap();
        let editor = visual::editor(&vs, &model.spec, sinks, &positions, false, None);
        let capacity = golden.prompt_ids.len() + steps.len();
        let mut seq = Sequence::new(&model, &backend, &weights, capacity, Some(&editor)).unwrap();
        let mut logits = seq
            .prefill(
                &prompt,
                encoded.as_ref(),
                &|_, _: &HeadView| (),
                &mut (),
                Logits::Last,
            )
            .unwrap();
        let mut worst = 0f32;
        for (i, theirs) in steps.iter().enumerate() {
            let err = relative_error(&logits, theirs);
            worst = worst.max(err);
            assert!(
                err <= LOGITS_TOLERANCE,
                "{case}: step {i}: logits differ by {err:e}"
            );
            let token = argmax(&logits);
            assert_eq!(token, golden.generated_ids[i], "{case}: step {i}'s token");
            if i + 1 < steps.len() {
                logits = seq.step(token).unwrap();
            }
        }
        drop(seq);
        let affected = editor.affected_now();
        for (li, &(layer, _)) in editor.layers().iter().enumerate() {
            let rows: Vec<usize> = affected.iter().flat_map(|a| a[li].clone()).collect();
            let want: Vec<usize> =
                serde_json::from_value(edit["edited_rows"][layer.to_string()].clone()).unwrap();
            assert_eq!(rows, want, "{case}: layer {layer}");
        }
        eprintln!("{case}: worst logits error {worst:.2e} of the step's largest |logit|");
    }
}

const PLANTED: &str = "tests/fixtures/visual_sinks/planted/model";
const PLANTED_IMAGE: &str = "tests/fixtures/visual_sinks/planted/image.png";

/// `--teacher-force` on the planted-sink model: forcing the greedy (edited) output gives its
/// per-step log-probabilities; the edit's KL is positive and the control's computed; the SVG
/// is written; with no row gated the KL is exactly zero.
#[test]
fn teacher_forcing_scores_a_continuation_and_the_edits_kl() {
    let dir = tempfile::tempdir().unwrap();
    let base = |extra: &[&str]| {
        sinkmerge(["generate", PLANTED, "--chat", "--json"])
            .args([
                "--prompt",
                "<image>Where is the red square?",
                "--image",
                PLANTED_IMAGE,
            ])
            .args(["--edit", "remove", "--gate", "0.5"])
            .args(extra)
    };
    let generated = base(&["--greedy", "--ignore-eos", "--max-new-tokens", "8"]).json();
    let rows = &generated["edit"]["edited_rows"];
    assert_eq!(rows["1"], serde_json::json!([45, 52]));
    assert_eq!(rows["2"], serde_json::json!([45, 52]));
    let file = dir.path().join("generated.json");
    std::fs::write(&file, serde_json::to_vec(&generated).unwrap()).unwrap();
    let svg = dir.path().join("kl.svg");
    let f = file.to_str().unwrap();
    let forced = base(&["--controls", "--teacher-force", f, "--plot"])
        .args([&svg])
        .json();
    let positions = forced["positions"].as_array().unwrap();
    assert_eq!(positions.len(), 8);
    for (p, s) in positions.iter().zip(generated["steps"].as_array().unwrap()) {
        assert_eq!(p["token_id"], s["token_id"]);
        assert_eq!(p["rank"], 1, "greedy tokens rank first");
        let d = (p["logprob"].as_f64().unwrap() - s["logprob"].as_f64().unwrap()).abs();
        assert!(d <= 1e-5, "logprob differs by {d:.2e}");
        assert!(p["kl"].as_f64().unwrap() >= 0.0);
        assert!(p["kl_control"].as_f64().unwrap() >= 0.0);
    }
    assert!(forced["mean_kl"].as_f64().unwrap() > 0.0);
    assert!(forced["mean_kl_control"].is_number());
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("<svg") && text.contains("control"));

    // Layer 0 gates nothing on this prompt: the edited run is the unedited one.
    let none = base(&["--layers", "0", "--teacher-force", f]).json();
    assert_eq!(none["edit"]["edited_rows"]["0"], serde_json::json!([]));
    for p in none["positions"].as_array().unwrap() {
        assert_eq!(p["kl"].as_f64().unwrap(), 0.0);
    }
    assert_eq!(none["mean_kl"].as_f64().unwrap(), 0.0);

    // A token outside the vocabulary: exit 2, naming the file and the position.
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, br#"{"token_ids": [5, 100000]}"#).unwrap();
    base(&["--teacher-force", bad.to_str().unwrap()]).refused(&["bad.json", "position 1"]);

    // --plot onto an input (the teacher-force file) or a directory: refused before the model
    // runs, the file untouched.
    let before = std::fs::read(&file).unwrap();
    base(&["--teacher-force", f, "--plot", f]).refused(&["--plot", "generated.json"]);
    assert_eq!(std::fs::read(&file).unwrap(), before);
    base(&["--teacher-force", f, "--plot", dir.path().to_str().unwrap()]).refused(&["--plot"]);
}

/// An image inserted in the middle of a sequence (`Sequence::insert`, the re-look's step): the
/// prompt of a two-image golden run as a prefill up to its second image, then the rest (the
/// second image's placeholders) inserted, gives the one prefill's next-token logits, and then
/// transformers' 40 tokens: the M-RoPE positions of the inserted image are `get_rope_index`'s
/// over the whole sequence.
#[test]
fn an_image_inserted_mid_sequence_equals_one_prefill() {
    use sinkmerge::commands::image_prompt::PixelData;
    use sinkmerge::image::Grid;
    for case in ["qwen2_vl_two", "qwen3_vl_two", "internvl_two"] {
        let (golden, steps) = golden(case);
        let raw: serde_json::Value =
            read_json(root().join(format!("tests/fixtures/generate/{case}.json")));
        let image_token = raw["image_token_id"].as_u64().unwrap() as u32;
        let ckpt = Checkpoint::open_dir(&root().join(&golden.model), "golden").unwrap();
        let model = Model::new(&ckpt).unwrap();
        let backend = CpuBackend::default();
        let weights = Resident::load(&backend, &model).unwrap();
        let pixels = read_pixel_file(&root().join(golden.pixel_values.as_ref().unwrap())).unwrap();
        // Each image's pixel rows, as a file of its own would hold them.
        let width: usize = pixels.shape[1..].iter().product();
        let per_image: Vec<PixelData> = match &pixels.grid {
            Grid::Thw(g) => {
                let mut at = 0;
                g.iter()
                    .map(|&[t, h, w]| {
                        let rows = t * h * w;
                        let mut shape = pixels.shape.clone();
                        shape[0] = rows;
                        let values = pixels.values[at * width..(at + rows) * width].to_vec();
                        at += rows;
                        PixelData {
                            values,
                            shape,
                            grid: Grid::Thw(vec![[t, h, w]]),
                        }
                    })
                    .collect()
            }
            Grid::NumPatches(n) => {
                let mut at = 0;
                n.iter()
                    .map(|&tiles| {
                        let mut shape = pixels.shape.clone();
                        shape[0] = tiles;
                        let values = pixels.values[at * width..(at + tiles) * width].to_vec();
                        at += tiles;
                        PixelData {
                            values,
                            shape,
                            grid: Grid::NumPatches(vec![tiles]),
                        }
                    })
                    .collect()
            }
        };
        assert_eq!(per_image.len(), 2, "{case}");
        let prompter = Prompter::new(&ckpt, &model, false).unwrap();
        let ids = &golden.prompt_ids;
        // Split two tokens before the second image's first image token (its start marker
        // and the token before it go with the inserted chunk).
        let runs: Vec<usize> = (0..ids.len())
            .filter(|&i| ids[i] == image_token && (i == 0 || ids[i - 1] != image_token))
            .collect();
        let split = runs[1] - 2;
        let head = prompter
            .prompt(ids[..split].to_vec(), Some(&per_image[0]))
            .unwrap();
        let tail = prompter
            .prompt(ids[split..].to_vec(), Some(&per_image[1]))
            .unwrap();
        let whole = prompter.prompt(ids.clone(), Some(&pixels)).unwrap();
        let nothing = |_: usize, _: &HeadView| ();
        let capacity = ids.len() + steps.len();

        let encoded = capture::encode(&backend, &model, &whole).unwrap();
        let mut one = Sequence::new(&model, &backend, &weights, capacity, None).unwrap();
        let want = one
            .prefill(&whole, encoded.as_ref(), &nothing, &mut (), Logits::Last)
            .unwrap();

        let first = capture::encode(&backend, &model, &head).unwrap();
        let second = capture::encode(&backend, &model, &tail).unwrap();
        let mut seq = Sequence::new(&model, &backend, &weights, capacity, None).unwrap();
        seq.prefill(&head, first.as_ref(), &nothing, &mut (), Logits::Last)
            .unwrap();
        let mut logits = seq
            .insert(&tail, second.as_ref(), &nothing, &mut (), Logits::Last)
            .unwrap();
        let err = relative_error(&logits, &want);
        assert!(
            err <= 1e-5,
            "{case}: the inserted image's logits differ by {err:e}"
        );
        for (i, theirs) in steps.iter().enumerate() {
            assert!(
                relative_error(&logits, theirs) <= LOGITS_TOLERANCE,
                "{case}: step {i}"
            );
            let token = argmax(&logits);
            assert_eq!(token, golden.generated_ids[i], "{case}: step {i}");
            logits = seq.step(token).unwrap();
        }
        println!("{case}: inserted image within {err:.1e} of one prefill; 40 tokens equal");
    }
}
