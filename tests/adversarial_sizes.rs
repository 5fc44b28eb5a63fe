//! Unbounded sizes in every file sinkmerge reads whole: `--pixel-values`, `--manifest`,
//! `--panel`, `--prompts`, images and processor configs. Each is a regular file under a
//! documented cap (docs/reference/checkpoints.md, "Input files and their caps"), or standard
//! input where a stream makes sense; a link to `/dev/zero`, a FIFO, a folder or an oversize file
//! is bad input (exit 2, one line saying what the path is), never an allocation that aborts or a
//! read that blocks. Sizes inside the files (grids, processor sizes, prompt lengths) are checked
//! with overflow-free arithmetic against the model's own limits and the memory free.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};
use sinkmerge::input;

use crate::util::{refused, root, sinkmerge, stderr, Sinkmerge};

/// The tiny Qwen3-VL (patch 16, temporal patch 2, merge 2: rows of 1536 values) and InternVL
/// (56×56 tiles) of tests/fixtures/vlm, and a tiny Qwen3 LM (max_position_embeddings 512).
const QWEN: &str = "tests/fixtures/vlm/qwen3_vl";
const INTERNVL: &str = "tests/fixtures/vlm/internvl";
const LM: &str = "assets/models/tiny-qwen3/ref";
const VLM: &str = "assets/models/tiny-qwen3/vlm";
const QWEN_ROW: usize = 3 * 2 * 16 * 16;

/// Long enough for any of these runs; a run killed past it blocked (on a FIFO, say).
const LIMIT: Duration = Duration::from_secs(60);

fn scene() -> String {
    root()
        .join("tests/fixtures/images/scene_100x75.png")
        .display()
        .to_string()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The run's output; a run that had to be killed is the test's failure.
fn finished(run: Sinkmerge, args: &[&str]) -> Output {
    let (output, _) = run.watch(b"", LIMIT);
    output.unwrap_or_else(|| panic!("sinkmerge {args:?} blocked past {LIMIT:?}"))
}

/// `args` refused with `needles`, within [`LIMIT`].
fn refuses(args: &[&str], needles: &[&str]) -> String {
    let out = finished(sinkmerge(args), args);
    refused(&out, needles)
}

/// A safetensors file of `pixel_values` (f32, `shape`) and one i64 tensor `grid_name`.
fn pixel_file(path: &Path, shape: &[usize], grid_name: &str, grid: &[i64], grid_shape: &[usize]) {
    let count: usize = shape.iter().product();
    let values: Vec<u8> = (0..count)
        .flat_map(|i| ((i % 97) as f32 / 97.0 - 0.5).to_le_bytes())
        .collect();
    let grid: Vec<u8> = grid.iter().flat_map(|v| v.to_le_bytes()).collect();
    let views = vec![
        (
            "pixel_values".to_string(),
            TensorView::new(Dtype::F32, shape.to_vec(), &values).unwrap(),
        ),
        (
            grid_name.to_string(),
            TensorView::new(Dtype::I64, grid_shape.to_vec(), &grid).unwrap(),
        ),
    ];
    safetensors::tensor::serialize_to_file(views, None::<HashMap<String, String>>, path).unwrap();
}

/// A copy of the model directory `from` in `to`, with `edit` applied to the JSON file `name`.
fn edited_model(from: &str, to: &Path, name: &str, edit: impl FnOnce(&mut Value)) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(root().join(from)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
    }
    let mut value: Value = crate::util::read_json(to.join(name));
    edit(&mut value);
    std::fs::write(to.join(name), value.to_string()).unwrap();
}

fn mkfifo(path: &Path) {
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success());
}

/// The hostile stand-ins for one input file in `dir`, each with what the refusal must say: a
/// link to `/dev/zero`, a FIFO, a folder and a sparse file one byte past `cap`.
fn hostile_paths(dir: &Path, cap: input::Cap) -> Vec<(PathBuf, Vec<String>)> {
    let zero = dir.join("zero");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    let fifo = dir.join("fifo");
    mkfifo(&fifo);
    let folder = dir.join("folder");
    std::fs::create_dir(&folder).unwrap();
    let big = dir.join("big");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(cap.bytes + 1)
        .unwrap();
    let says = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
    vec![
        (zero, says(&["zero", "a character device", "/dev/zero"])),
        (fifo, says(&["fifo", "a FIFO"])),
        (folder, says(&["folder", "a directory"])),
        (
            big,
            says(&["big", &format!("{} bytes", cap.bytes + 1), "more than"]),
        ),
    ]
}

/// Item 10: every flag that reads a file whole refuses a link to `/dev/zero`, a FIFO, a folder
/// and a file past its cap, saying which, without blocking or running out of memory.
#[test]
fn every_file_flag_refuses_devices_fifos_folders_and_oversize_files() {
    let scene = scene();
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("out.safetensors");
    let panel_out = out_dir.path().join("panel");
    type Command<'a> = Box<dyn Fn(&str) -> Vec<String> + 'a>;
    let flags: Vec<(&str, input::Cap, Command)> = vec![
        (
            "trace --pixel-values",
            input::PIXEL_VALUES,
            Box::new(|p: &str| {
                let a = ["trace", QWEN, "--prompt", "<image>Hi", "--pixel-values", p];
                let mut a: Vec<String> = a.iter().map(|x| x.to_string()).collect();
                a.extend(["-o".into(), s(&out).into()]);
                a
            }),
        ),
        (
            "visual-sinks --pixel-values",
            input::PIXEL_VALUES,
            Box::new(|p: &str| {
                let a = ["visual-sinks", QWEN, "--image", &scene, "--question", "Hi"];
                let mut a: Vec<String> = a.iter().map(|x| x.to_string()).collect();
                a.extend(["--pixel-values".into(), p.into()]);
                a
            }),
        ),
        (
            "visual-sinks --manifest",
            input::MANIFEST,
            Box::new(|p: &str| {
                ["visual-sinks", QWEN, "--manifest", p]
                    .map(String::from)
                    .to_vec()
            }),
        ),
        (
            "reproduce --panel",
            input::PANEL,
            Box::new(|p: &str| {
                ["reproduce", "--panel", p, "-o", s(&panel_out)]
                    .map(String::from)
                    .to_vec()
            }),
        ),
        (
            "score --prompts",
            input::PROMPTS,
            Box::new(|p: &str| ["score", LM, "--prompts", p].map(String::from).to_vec()),
        ),
    ];
    for (flag, cap, command) in &flags {
        let dir = tempfile::tempdir().unwrap();
        for (path, says) in hostile_paths(dir.path(), *cap) {
            let args = command(s(&path));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let needles: Vec<&str> = says.iter().map(String::as_str).collect();
            let out = finished(sinkmerge(&args), &args);
            assert_eq!(out.status.code(), Some(2), "{flag}: {}", stderr(&out));
            refused(&out, &needles);
        }
        assert!(!out.exists() && !panel_out.exists(), "{flag} wrote output");
    }
}

/// Item 10: `-` reads a manifest or a prompt file from standard input (paths in the manifest
/// are then relative to the current directory), under the same cap.
#[test]
fn manifests_and_prompts_come_from_standard_input() {
    let line = json!({
        "image": "tests/fixtures/images/wide_150x61.jpg",
        "question": "What is this?",
        "pixel_values": "tests/fixtures/visual_sinks/qwen3_vl.wide.safetensors",
    });
    let args = ["visual-sinks", QWEN, "--manifest", "-", "--json"];
    let (out, _) = sinkmerge(args).watch(format!("{line}\n").as_bytes(), LIMIT);
    let report: Value = serde_json::from_str(&crate::util::ok(&out.unwrap())).unwrap();
    assert_eq!(report["images"].as_array().unwrap().len(), 1);

    let args = ["score", LM, "--prompts", "-", "--json"];
    let (out, _) = sinkmerge(args).watch(b"Name three colours.\nCount to five.\n", LIMIT);
    let report: Value = serde_json::from_str(&crate::util::ok(&out.unwrap())).unwrap();
    assert_eq!(report["settings"]["n_prompts"], 2, "{report}");

    // Past the cap on a stream: refused, not read on.
    let flood = vec![b'a'; input::PROMPTS.bytes as usize + 1];
    let (out, _) = sinkmerge(["score", LM, "--prompts", "-"]).watch(&flood, LIMIT);
    refused(&out.unwrap(), &["standard input", "more than the 64.0 MiB"]);
}

/// Item 6: a grid whose product wraps around in 64 bits (1·4·(6+2⁶²) = 24 mod 2⁶⁴) or tile
/// counts whose sum does is refused, naming the tensor, before anything is allocated from it.
#[test]
fn pixel_grids_whose_sizes_wrap_around_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    let qwen = dir.path().join("qwen.safetensors");
    pixel_file(
        &qwen,
        &[24, QWEN_ROW],
        "image_grid_thw",
        &[1, 4, 6 + (1 << 62)],
        &[1, 3],
    );
    let args = [
        "trace",
        QWEN,
        "--prompt",
        "<image>Hi",
        "--pixel-values",
        s(&qwen),
        "-o",
        s(&out),
    ];
    refuses(&args, &["qwen.safetensors", "image_grid_thw"]);
    let scene = scene();
    let args = [
        "visual-sinks",
        QWEN,
        "--image",
        &scene,
        "--question",
        "Hi",
        "--pixel-values",
        s(&qwen),
    ];
    refuses(&args, &["qwen.safetensors", "image_grid_thw"]);

    let tiles = dir.path().join("tiles.safetensors");
    pixel_file(
        &tiles,
        &[0, 3, 56, 56],
        "num_patches",
        &[i64::MAX, i64::MAX, 2],
        &[3],
    );
    let args = [
        "trace",
        INTERNVL,
        "--prompt",
        "<image><image><image>Hi",
        "--pixel-values",
        s(&tiles),
        "-o",
        s(&out),
    ];
    refuses(&args, &["tiles.safetensors", "num_patches"]);
    assert!(!out.exists());
}

/// Item 7: processor sizes past the processors' bounds (a shortest edge of 10¹² pixels, a patch
/// of 100,000, a tile of 10¹² pixels) are refused, naming the file and the key, before an
/// image is resized to them.
#[test]
fn processor_sizes_past_their_bounds_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    let scene = scene();
    let cases: [(&str, &str, Value, &str); 5] = [
        (
            QWEN,
            "edge",
            json!({"size": {"shortest_edge": 1_000_000_000_000u64, "longest_edge": 1_000_000_000_000u64}}),
            "longest_edge",
        ),
        (
            QWEN,
            "min",
            json!({"min_pixels": 1_000_000_000_000u64}),
            "min_pixels",
        ),
        (QWEN, "patch", json!({"patch_size": 100_000}), "patch_size"),
        (
            INTERNVL,
            "tile",
            json!({"size": {"height": 1_000_000, "width": 1_000_000}}),
            "size",
        ),
        (
            INTERNVL,
            "tiles",
            json!({"max_patches": 1_000_000_000_000u64}),
            "max_patches",
        ),
    ];
    for (source, name, edits, key) in cases {
        let model = dir.path().join(name);
        edited_model(source, &model, "preprocessor_config.json", |v| {
            for (k, x) in edits.as_object().unwrap() {
                v[k] = x.clone();
            }
        });
        let args = [
            "trace",
            s(&model),
            "--prompt",
            "<image>Hi",
            "--image",
            &scene,
            "-o",
            s(&out),
        ];
        refuses(&args, &["preprocessor_config.json", key]);
    }
    assert!(!out.exists());
}

/// Item 8: a prompt past the model's max_position_embeddings is refused (`trace` on an LM of
/// 512 positions, `visual-sinks` on a VLM of 4096), naming both lengths.
#[test]
fn prompts_past_the_models_positions_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    let long = "a ".repeat(600);
    refuses(
        &["trace", LM, "--prompt", &long, "-o", s(&out)],
        &["max_position_embeddings", "512"],
    );
    let scene = scene();
    let long = format!("<image>{}", "a ".repeat(5000));
    refuses(
        &["visual-sinks", QWEN, "--image", &scene, "--prompt", &long],
        &["max_position_embeddings", "4096"],
    );
    assert!(!out.exists());
}

/// Item 8: a capture that needs more memory than is free (every layer's attention of a 60,000
/// token prompt: some 345 GB) is refused before the forward pass, with the need, what is free
/// and a `--layers` suggestion.
#[test]
fn a_capture_past_the_free_memory_is_refused_with_a_layers_hint() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("long");
    edited_model(LM, &model, "config.json", |v| {
        v["max_position_embeddings"] = json!(1_000_000)
    });
    let out = dir.path().join("out.safetensors");
    let long = "a ".repeat(60_000);
    let args = [
        "trace",
        s(&model),
        "--prompt",
        &long,
        "--capture",
        "attentions",
        "-o",
        s(&out),
    ];
    refuses(&args, &["memory", "MemAvailable", "--layers"]);
    assert!(!out.exists());
}

/// Item 9: a manifest's pixels are read one line at a time, so forty lines of a 3.5 MB
/// pixel-values file take about the memory of one line, not forty times it.
#[test]
fn a_manifest_holds_one_lines_pixels_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    // A 24×24 grid of patches: 576 rows of 1536 values, 3.5 MB of f32.
    let pixels = dir.path().join("p.safetensors");
    pixel_file(
        &pixels,
        &[576, QWEN_ROW],
        "image_grid_thw",
        &[1, 24, 24],
        &[1, 3],
    );
    let file_kib = std::fs::metadata(&pixels).unwrap().len() / 1024;
    let line = json!({"image": scene(), "question": "Where?", "pixel_values": "p.safetensors"});
    let peak = |lines: usize| {
        let manifest = dir.path().join(format!("m{lines}.jsonl"));
        std::fs::write(&manifest, format!("{line}\n").repeat(lines)).unwrap();
        let args = ["visual-sinks", QWEN, "--manifest", s(&manifest)];
        let (out, peak) = sinkmerge(args).watch(b"", LIMIT);
        crate::util::ok(&out.expect("finished"));
        peak
    };
    let (one, forty) = (peak(1), peak(40));
    assert!(
        forty < one + 8 * file_kib,
        "40 lines peak at {forty} KiB, one at {one} KiB: more than 8 lines' pixels ({file_kib} KiB each) held at once"
    );
}

/// Item 20: a manifest key outside the schema (`Box` for `box`) is refused, naming the line and
/// the key, instead of being ignored.
#[test]
fn unknown_manifest_keys_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("m.jsonl");
    let line = json!({"image": scene(), "question": "Where?", "Box": [0, 0, 10, 10]});
    std::fs::write(&manifest, format!("{line}\n")).unwrap();
    refuses(
        &["visual-sinks", QWEN, "--manifest", s(&manifest)],
        &["m.jsonl:1", "unknown field `Box`"],
    );
}

/// Item 26: an image that is a folder, a FIFO or a link to `/dev/zero` is refused saying what it
/// is, from `--image` (trace, visual-sinks) and from a manifest line.
#[test]
fn an_image_that_is_not_a_file_says_what_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.safetensors");
    for (path, says) in hostile_paths(dir.path(), input::IMAGE) {
        let needles: Vec<&str> = says.iter().map(String::as_str).collect();
        let image = s(&path);
        refuses(
            &[
                "trace",
                QWEN,
                "--prompt",
                "<image>Hi",
                "--image",
                image,
                "-o",
                s(&out),
            ],
            &needles,
        );
        refuses(
            &["visual-sinks", QWEN, "--image", image, "--question", "Hi"],
            &needles,
        );
        let manifest = dir.path().join("m.jsonl");
        std::fs::write(
            &manifest,
            format!("{}\n", json!({"image": image, "question": "Hi"})),
        )
        .unwrap();
        let mut needles = needles.clone();
        needles.push("m.jsonl:1");
        refuses(
            &["visual-sinks", QWEN, "--manifest", s(&manifest)],
            &needles,
        );
    }
    assert!(!out.exists());
}

/// Item 27: a pair name too long for a folder name, and a header naming a column twice, are
/// refused before the first pair runs.
#[test]
fn panel_names_fit_a_folder_and_columns_are_named_once() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("panel");
    let csv = dir.path().join("pairs.csv");
    let long = "a".repeat(300);
    for (text, needles) in [
        (
            format!("name,ref,vlm\n{long},{LM},{VLM}\n"),
            vec!["pairs.csv:2", "300 bytes", "longer than"],
        ),
        (
            format!("name,ref,vlm,name\nx,{LM},{VLM},y\n"),
            vec!["pairs.csv", "`name`", "twice"],
        ),
    ] {
        std::fs::write(&csv, text).unwrap();
        refuses(&["reproduce", "--panel", s(&csv), "-o", s(&out)], &needles);
        assert!(!out.exists());
    }
}
