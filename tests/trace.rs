//! `sinkmerge trace` against transformers' eager f32 forward of tiny VLMs built with its own
//! classes (`tools/gen_vlm_goldens.py`, tests/fixtures/vlm/): fed the processor's pixel values,
//! every tensor within the tolerances; with sinkmerge's own preprocessing, the same
//! token ids, positions and grids and pixels within one grey level. Bad input: one line, exit 2,
//! no output file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use crate::util::{read_json, root, sinkmerge};

/// Relative to the golden tensor's largest magnitude (issue: image_embeds, logits, keys, values,
/// hidden states).
const RELATIVE: f64 = 1e-4;
/// Absolute, on attention probabilities.
const PROBS: f64 = 1e-5;
/// Own preprocessing against the PIL processor, after normalisation (docs/reference/images.md).
const PIXEL_MAX: f64 = 0.05;
const PIXEL_MEAN: f64 = 3e-3;

#[derive(Deserialize)]
struct Cases {
    cases: Vec<Case>,
}

/// One traced case: the model, the golden forward of transformers, the prompt (images come from
/// the golden's pixel values or `images`).
#[derive(Deserialize, Clone)]
pub struct Case {
    pub name: String,
    pub model: String,
    pub golden: String,
    pub images: Vec<String>,
    pub prompt: String,
    pub chat_template: bool,
}

fn cases() -> Vec<Case> {
    read_json::<Cases>(root().join("tests/fixtures/vlm/cases.json")).cases
}

enum Data {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

struct Tensor {
    shape: Vec<usize>,
    data: Data,
}

fn load(path: &Path) -> BTreeMap<String, Tensor> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let data = match view.dtype() {
                Dtype::F32 => Data::F32(
                    view.data()
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                        .collect(),
                ),
                Dtype::I64 => Data::I64(
                    view.data()
                        .chunks_exact(8)
                        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
                        .collect(),
                ),
                other => panic!("{name}: unexpected dtype {other:?}"),
            };
            let shape = view.shape().to_vec();
            (name, Tensor { shape, data })
        })
        .collect()
}

/// (max |Δ|, mean |Δ|, max |golden|) of two f32 tensors of the same shape.
fn diff(name: &str, ours: &Tensor, golden: &Tensor) -> (f64, f64, f64) {
    assert_eq!(ours.shape, golden.shape, "{name}: shape");
    let (Data::F32(a), Data::F32(b)) = (&ours.data, &golden.data) else {
        panic!("{name}: f32 expected");
    };
    let scale = b.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
    let (mut max, mut sum) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let d = (x as f64 - y as f64).abs();
        max = max.max(d);
        sum += d;
    }
    (max, sum / a.len().max(1) as f64, scale)
}

fn ints<'a>(name: &str, t: &'a Tensor) -> &'a [i64] {
    match &t.data {
        Data::I64(v) => v,
        Data::F32(_) => panic!("{name}: int64 expected"),
    }
}

fn trace_args(case: &Case, out: &Path) -> Vec<String> {
    let mut args = vec![
        "trace".to_string(),
        case.model.clone(),
        "--prompt".into(),
        case.prompt.clone(),
        "-o".into(),
        out.display().to_string(),
    ];
    if case.chat_template {
        args.push("--chat".into());
    }
    args
}

#[test]
fn fed_the_processors_pixels_every_tensor_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    for case in cases() {
        traces_like_its_golden(&case, dir.path());
    }
}

/// `trace` of `case`, fed the golden's pixel values, gives every tensor of the golden but the
/// towers' intermediates within the tolerances above.
pub fn traces_like_its_golden(case: &Case, dir: &Path) {
    let out = dir.join("trace.safetensors");
    let mut args = trace_args(case, &out);
    args.extend(["--pixel-values".into(), case.golden.clone()]);
    sinkmerge(&args).ok();
    let ours = load(&out);
    let golden = load(&root().join(&case.golden));
    let mut checked = 0;
    for (name, g) in &golden {
        if name.starts_with("vision.") || name.starts_with("deepstack.") {
            continue; // the towers' own tests cover their intermediates
        }
        let o = ours
            .get(name)
            .unwrap_or_else(|| panic!("{}: `{name}` not written", case.name));
        match &g.data {
            Data::I64(v) => {
                assert_eq!(o.shape, g.shape, "{}: {name} shape", case.name);
                assert_eq!(ints(name, o), v.as_slice(), "{}: {name}", case.name);
            }
            Data::F32(_) => {
                let (max, _, scale) = diff(name, o, g);
                if name.starts_with("attentions.") {
                    assert!(
                        max <= PROBS,
                        "{}: {name} max |Δ| {max:.2e} > {PROBS:.0e}",
                        case.name
                    );
                } else {
                    let rel = max / scale.max(1e-30);
                    assert!(
                        rel <= RELATIVE,
                        "{}: {name} max |Δ| / max |golden| {rel:.2e} > {RELATIVE:.0e}",
                        case.name
                    );
                }
            }
        }
        checked += 1;
    }
    let expected = golden
        .keys()
        .filter(|n| !n.starts_with("vision.") && !n.starts_with("deepstack."))
        .count();
    assert_eq!(checked, expected, "{}", case.name);
    assert!(ours.contains_key("image_embeds") && ours.contains_key("attentions.0"));
}

#[test]
fn own_preprocessing_gives_the_processors_ids_positions_grids_and_pixels() {
    let dir = tempfile::tempdir().unwrap();
    for case in cases() {
        let out = dir.path().join("trace.safetensors");
        let mut args = trace_args(&case, &out);
        for image in &case.images {
            args.extend(["--image".into(), image.clone()]);
        }
        args.extend([
            "--capture".into(),
            "input_ids,position_ids,pixel_values".into(),
        ]);
        sinkmerge(&args).ok();
        let ours = load(&out);
        let golden = load(&root().join(&case.golden));
        for name in ["input_ids", "position_ids", "image_grid_thw", "num_patches"] {
            let Some(g) = golden.get(name) else { continue };
            let o = &ours[name];
            assert_eq!(o.shape, g.shape, "{}: {name}", case.name);
            assert_eq!(ints(name, o), ints(name, g), "{}: {name}", case.name);
        }
        let (max, mean, _) = diff(
            "pixel_values",
            &ours["pixel_values"],
            &golden["pixel_values"],
        );
        eprintln!(
            "{:28} pixel_values max |Δ| {max:.2e} mean {mean:.2e}",
            case.name
        );
        assert!(
            max <= PIXEL_MAX && mean <= PIXEL_MEAN,
            "{}: pixel_values max {max:.2e} (≤ {PIXEL_MAX}), mean {mean:.2e} (≤ {PIXEL_MEAN})",
            case.name
        );
        assert!(
            !ours.contains_key("logits"),
            "--capture keeps only what it names"
        );
    }
}

#[test]
fn layers_and_json_summary_select_what_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.safetensors");
    let case = &cases()[0];
    let mut args = trace_args(case, &out);
    args.extend(["--pixel-values".into(), case.golden.clone()]);
    args.extend(
        [
            "--layers",
            "1",
            "--capture",
            "attentions,hidden_states",
            "--json",
        ]
        .map(String::from),
    );
    let summary = sinkmerge(&args).json();
    let names: Vec<&str> = summary["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    // In the order they are computed: layer 1's input, its attention, its output.
    assert_eq!(
        names,
        ["hidden_states.1", "attentions.1", "hidden_states.2"]
    );
    assert_eq!(summary["images"], 1);
    let written: Vec<String> = load(&out).into_keys().collect();
    assert_eq!(
        written,
        ["attentions.1", "hidden_states.1", "hidden_states.2"]
    );
}

#[test]
fn a_plain_llm_traces_text_with_plain_positions() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.safetensors");
    sinkmerge([
        "trace",
        "assets/models/tiny-qwen2/ref",
        "--prompt",
        "The capital of France is",
        "-o",
        out.to_str().unwrap(),
    ])
    .ok();
    let t = load(&out);
    let seq = t["input_ids"].shape[0];
    assert_eq!(t["position_ids"].shape, [seq]);
    assert_eq!(
        ints("position_ids", &t["position_ids"]),
        (0..seq as i64).collect::<Vec<_>>()
    );
    assert!(!t.contains_key("image_embeds") && !t.contains_key("pixel_values"));
    assert_eq!(t["logits"].shape[0], seq);
}

/// The same run writes the same bytes: the header's `__metadata__` keys are in a fixed order, not
/// a hash map's.
#[test]
fn the_same_trace_twice_gives_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let outs = ["a", "b"].map(|n| dir.path().join(format!("{n}.safetensors")));
    for out in &outs {
        sinkmerge([
            "trace",
            "assets/models/tiny-qwen2/ref",
            "--prompt",
            "The capital of France is",
            "--layers",
            "0",
            "-o",
            out.to_str().unwrap(),
        ])
        .ok();
    }
    let [a, b] = outs.map(|p| std::fs::read(p).unwrap());
    assert!(a == b, "two runs of the same trace differ");
}

/// One clear line naming the problem, exit 2, and no output file.
fn refused_without_output(args: &[&str], needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("t.safetensors");
    let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    all.extend(["-o".into(), out.display().to_string()]);
    sinkmerge(&all).refused(needles);
    assert!(!out.exists(), "{args:?}: an output was written");
    let left: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(left.is_empty(), "{args:?}: left {left:?}");
}

#[test]
fn bad_images_markers_models_and_pixel_files_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let truncated = dir.path().join("truncated.png");
    let png = std::fs::read(root().join("tests/fixtures/images/scene_100x75.png")).unwrap();
    std::fs::write(&truncated, &png[..png.len() / 2]).unwrap();
    let text = dir.path().join("text.png");
    std::fs::write(&text, "not an image").unwrap();
    let bmp = dir.path().join("image.bmp");
    std::fs::write(&bmp, b"BM\x3a\0\0\0\0\0\0\0\x36\0\0\0").unwrap();
    let model = "tests/fixtures/vlm/qwen2_vl";
    let image = "tests/fixtures/images/scene_100x75.png";
    let t = |p: &Path| p.to_str().unwrap().to_string();
    let (truncated, text, bmp) = (t(&truncated), t(&text), t(&bmp));
    refused_without_output(
        &[
            "trace", model, "--prompt", "<image>x", "--image", &truncated,
        ],
        &["truncated.png"],
    );
    refused_without_output(
        &["trace", model, "--prompt", "<image>x", "--image", &text],
        &["text.png"],
    );
    refused_without_output(
        &["trace", model, "--prompt", "<image>x", "--image", &bmp],
        &["image.bmp"],
    );
    refused_without_output(
        &[
            "trace",
            model,
            "--prompt",
            "<image><image>x",
            "--image",
            image,
        ],
        &["2 `<image>` marker", "1 --image"],
    );
    refused_without_output(
        &["trace", model, "--prompt", "x", "--image", image],
        &["0 `<image>` marker"],
    );
    refused_without_output(
        &[
            "trace",
            "assets/models/tiny-qwen2/ref",
            "--prompt",
            "<image>x",
            "--image",
            image,
        ],
        &["no vision tower"],
    );
    // A golden of another family: InternVL tiles given to a Qwen tower.
    refused_without_output(
        &[
            "trace",
            model,
            "--prompt",
            "<image>and<image>x",
            "--pixel-values",
            "tests/fixtures/vlm/internvl/golden_two_images.safetensors",
        ],
        &["pixel"],
    );
}

#[test]
fn a_zero_sized_image_and_mis_shaped_pixels_and_weights_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Pixel values whose rows do not match their grid.
    let golden = load(&root().join("tests/fixtures/vlm/qwen2_vl/golden_scene.safetensors"));
    let Data::F32(values) = &golden["pixel_values"].data else {
        panic!()
    };
    let cut = &values[..values.len() - golden["pixel_values"].shape[1]];
    let bytes: Vec<u8> = cut.iter().flat_map(|v| v.to_le_bytes()).collect();
    let grid: Vec<u8> = ints("g", &golden["image_grid_thw"])
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let rows = golden["pixel_values"].shape[0] - 1;
    let views = vec![
        (
            "pixel_values",
            safetensors::tensor::TensorView::new(
                Dtype::F32,
                vec![rows, golden["pixel_values"].shape[1]],
                &bytes,
            )
            .unwrap(),
        ),
        (
            "image_grid_thw",
            safetensors::tensor::TensorView::new(Dtype::I64, vec![1, 3], &grid).unwrap(),
        ),
    ];
    let short = dir.path().join("short.safetensors");
    std::fs::write(&short, safetensors::tensor::serialize(views, None).unwrap()).unwrap();
    refused_without_output(
        &[
            "trace",
            "tests/fixtures/vlm/qwen2_vl",
            "--prompt",
            "<image>x",
            "--pixel-values",
            short.to_str().unwrap(),
        ],
        &["pixel_values"],
    );

    // A VLM whose vision weights are mis-shaped: the fixture with one tower tensor cut short.
    let vlm = dir.path().join("vlm");
    std::fs::create_dir(&vlm).unwrap();
    let src = root().join("tests/fixtures/vlm/qwen2_vl");
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "json" || e == "txt") {
            std::fs::copy(&path, vlm.join(path.file_name().unwrap())).unwrap();
        }
    }
    let model = load(&src.join("model.safetensors"));
    let mut stored: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in &model {
        let Data::F32(v) = &t.data else { panic!() };
        let (shape, v) = if name == "visual.blocks.0.mlp.fc1.weight" {
            (vec![t.shape[0] - 1, t.shape[1]], &v[..v.len() - t.shape[1]])
        } else {
            (t.shape.clone(), &v[..])
        };
        stored.push((
            name.clone(),
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = stored
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(
        vlm.join("model.safetensors"),
        safetensors::tensor::serialize(views, None).unwrap(),
    )
    .unwrap();
    refused_without_output(
        &[
            "trace",
            vlm.to_str().unwrap(),
            "--prompt",
            "<image>x",
            "--image",
            "tests/fixtures/images/scene_100x75.png",
        ],
        &["visual.blocks.0.mlp.fc1.weight"],
    );

    // A 0×0 image is refused by the decoder before any work.
    let empty = dir.path().join("empty.png");
    let mut png = Vec::new();
    image_bytes_of_zero_width(&mut png);
    std::fs::write(&empty, png).unwrap();
    refused_without_output(
        &[
            "trace",
            "tests/fixtures/vlm/qwen2_vl",
            "--prompt",
            "<image>x",
            "--image",
            empty.to_str().unwrap(),
        ],
        &["empty.png"],
    );
}

/// A PNG whose header says 0×0: signature, then an IHDR chunk with zero width and height.
fn image_bytes_of_zero_width(out: &mut Vec<u8>) {
    out.extend_from_slice(b"\x89PNG\r\n\x1a\n");
    let ihdr = [0u8, 0, 0, 0, 0, 0, 0, 0, 8, 2, 0, 0, 0];
    out.extend_from_slice(&(ihdr.len() as u32).to_be_bytes());
    let mut chunk = b"IHDR".to_vec();
    chunk.extend_from_slice(&ihdr);
    out.extend_from_slice(&chunk);
    out.extend_from_slice(&crc32(&chunk).to_be_bytes());
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn a_truncated_jpeg_is_refused_as_pil_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    for fixture in [
        "tests/fixtures/images/wide_150x61.jpg",
        "tests/fixtures/jpeg/progressive_61x43.jpg",
        "tests/fixtures/jpeg/restart_61x43.jpg",
    ] {
        let bytes = std::fs::read(root().join(fixture)).unwrap();
        assert_eq!(
            bytes[bytes.len() - 2..],
            [0xFF, 0xD9],
            "{fixture} ends in EOI"
        );
        // Cut inside the scans, and cut only the end-of-image marker.
        for keep in [bytes.len() / 3, bytes.len() * 2 / 3, bytes.len() - 2] {
            let cut = dir.path().join(format!("cut_{keep}.jpg"));
            std::fs::write(&cut, &bytes[..keep]).unwrap();
            let cut = cut.to_str().unwrap().to_string();
            refused_without_output(
                &[
                    "trace",
                    "tests/fixtures/vlm/qwen2_vl",
                    "--prompt",
                    "<image>x",
                    "--image",
                    &cut,
                ],
                &[&cut, "truncated"],
            );
        }
    }
}
