//! `sinkmerge::image` against transformers' PIL image processors: the goldens of
//! `tools/gen_image_goldens.py` (tests/fixtures/image/), and bad images made on the fly.

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use sinkmerge::error::Kind;
use sinkmerge::image::{Grid, Pixels, Processor};

use crate::util::fixtures;

/// The parity bounds after normalisation (docs/reference/images.md, "Parity").
const MAX_ABS: f64 = 0.05;
const MEAN_ABS: f64 = 3e-3;

fn config_dir(name: &str) -> PathBuf {
    fixtures().join("image").join(name)
}

/// The golden's tensors: `pixel_values` with its shape, and the int64 grid tensor.
fn golden(path: &Path) -> (Vec<f32>, Vec<usize>, Vec<i64>) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let pv = st.tensor("pixel_values").unwrap();
    let values = pv
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let grid = ["image_grid_thw", "num_patches"]
        .iter()
        .find_map(|name| st.tensor(name).ok())
        .unwrap();
    let grid = grid
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (values, pv.shape().to_vec(), grid)
}

/// Compares every image of `images` processed with config `name` against its golden, and returns
/// the largest max |Δ| and mean |Δ| seen.
fn check(name: &str, images: &[PathBuf]) -> (f64, f64) {
    let processor = Processor::from_dir(&config_dir(name)).unwrap();
    let (mut worst_max, mut worst_mean) = (0.0f64, 0.0f64);
    for image in images {
        let stem = image.file_stem().unwrap().to_str().unwrap();
        let (want, shape, grid) = golden(&config_dir(name).join(format!("{stem}.safetensors")));
        let got = processor.preprocess(std::slice::from_ref(image)).unwrap();
        assert_eq!(got.shape, shape, "{name}/{stem}: shape");
        match &got.grid {
            Grid::Thw(thw) => {
                let thw: Vec<i64> = thw[0].iter().map(|&v| v as i64).collect();
                assert_eq!(thw, grid, "{name}/{stem}: image_grid_thw");
            }
            Grid::NumPatches(n) => {
                assert_eq!(vec![n[0] as i64], grid, "{name}/{stem}: num_patches")
            }
        }
        let deltas: Vec<f64> = (got.values.iter().zip(&want))
            .map(|(a, b)| f64::from(a - b).abs())
            .collect();
        let max = deltas.iter().cloned().fold(0.0, f64::max);
        let mean = deltas.iter().sum::<f64>() / deltas.len() as f64;
        let exact = deltas.iter().filter(|&&d| d == 0.0).count();
        eprintln!(
            "{name}/{stem}: max |Δ| {max:.3e}, mean |Δ| {mean:.3e}, {exact}/{} values identical",
            deltas.len()
        );
        assert!(max <= MAX_ABS, "{name}/{stem}: max |Δ| {max}");
        assert!(mean <= MEAN_ABS, "{name}/{stem}: mean |Δ| {mean}");
        worst_max = worst_max.max(max);
        worst_mean = worst_mean.max(mean);
    }
    (worst_max, worst_mean)
}

fn test_images() -> Vec<PathBuf> {
    let mut images: Vec<PathBuf> = std::fs::read_dir(fixtures().join("images"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    images.sort();
    assert_eq!(images.len(), 4);
    images
}

#[test]
fn qwen2_vl_matches_pil_backend() {
    check("qwen2_vl", &test_images());
}

#[test]
fn qwen3_vl_matches_pil_backend() {
    check("qwen3_vl", &test_images());
}

#[test]
fn internvl_matches_pil_backend() {
    let mut images = test_images();
    // load_image's EXIF transpose and convert_to_rgb's white key colour.
    for input in ["exif_orientation6_40x30.png", "trns_key_40x30.png"] {
        images.push(config_dir("inputs").join(input));
    }
    check("internvl", &images);
    // do_convert_rgb false: the key colour is not whitened.
    check(
        "internvl_keep_key",
        &[config_dir("inputs").join("trns_key_40x30.png")],
    );
}

#[test]
fn batches_concatenate_and_count_tokens() {
    let images = test_images();
    let qwen = Processor::from_dir(&config_dir("qwen2_vl")).unwrap();
    let batch = qwen.preprocess(&images).unwrap();
    let singles: Vec<Pixels> = images
        .iter()
        .map(|i| qwen.preprocess(std::slice::from_ref(i)).unwrap())
        .collect();
    let values: Vec<f32> = singles.iter().flat_map(|p| p.values.clone()).collect();
    assert_eq!(batch.values, values);
    assert_eq!(batch.shape, [68, 1176]);
    // t·h·w / merge²: grids 1x4x6, 1x4x4, 1x8x2, 1x2x6 (alpha, scene, tall, wide).
    assert_eq!(batch.tokens, [6, 4, 4, 3]);

    let internvl = Processor::from_dir(&config_dir("internvl")).unwrap();
    let batch = internvl.preprocess(&images).unwrap();
    assert_eq!(batch.grid, Grid::NumPatches(vec![7, 7, 4, 3]));
    // No processor_config.json: InternVLProcessor's default of 256 tokens a tile.
    assert_eq!(batch.tokens, [7 * 256, 7 * 256, 4 * 256, 3 * 256]);
    assert_eq!(batch.shape, [21, 3, 28, 28]);
}

/// The error of processing `file` (written with `bytes` into a temp dir) with the qwen2_vl config.
fn refusal(file: &str, bytes: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(file);
    std::fs::write(&path, bytes).unwrap();
    let processor = Processor::from_dir(&config_dir("qwen2_vl")).unwrap();
    let err = processor.preprocess(&[path]).unwrap_err();
    assert_eq!(err.kind(), Kind::BadInput, "{err}");
    let message = err.to_string();
    assert!(message.contains(file), "{message}");
    message
}

#[test]
fn truncated_png_is_bad_input() {
    let png = std::fs::read(fixtures().join("images/scene_100x75.png")).unwrap();
    let message = refusal("cut.png", &png[..png.len() / 2]);
    assert!(message.contains("cannot decode"), "{message}");
}

#[test]
fn text_named_png_is_bad_input() {
    let message = refusal("notes.png", b"these are not pixels\n");
    assert!(message.contains("cannot decode"), "{message}");
}

#[test]
fn unsupported_format_is_bad_input() {
    // A GIF header: recognised, but not a format sinkmerge decodes.
    let message = refusal("anim.gif", b"GIF89a\x01\x00\x01\x00\x00\x00\x00;");
    assert!(message.contains("unsupported image format"), "{message}");
}

/// A PNG declaring `width`x`height` RGB8 pixels with an empty image stream (CRCs valid), as an
/// encoder will not write it: decoders read the header and fail only on the pixels.
fn png_header(width: u32, height: u32) -> Vec<u8> {
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut chunk = |kind: &[u8], data: &[u8]| {
        png.extend((data.len() as u32).to_be_bytes());
        let body: Vec<u8> = kind.iter().chain(data).copied().collect();
        png.extend(&body);
        png.extend(crc32(&body).to_be_bytes());
    };
    let mut ihdr = width.to_be_bytes().to_vec();
    ihdr.extend(height.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    chunk(b"IHDR", &ihdr);
    // zlib's encoding of nothing.
    chunk(b"IDAT", b"\x78\x9c\x03\x00\x00\x00\x00\x01");
    chunk(b"IEND", &[]);
    png
}

#[test]
fn empty_image_is_bad_input() {
    let message = refusal("empty.png", &png_header(0, 0));
    assert!(
        message.contains("0x0") || message.contains("cannot decode"),
        "{message}"
    );
}

#[test]
fn decompression_bomb_is_refused_before_decoding() {
    // 200000 x 100000 pixels, declared in 77 bytes.
    let message = refusal("bomb.png", &png_header(200_000, 100_000));
    assert!(message.contains("decompression-bomb limit"), "{message}");
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[test]
fn unknown_processor_is_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("preprocessor_config.json"),
        r#"{"image_processor_type": "CLIPImageProcessor"}"#,
    )
    .unwrap();
    let err = Processor::from_dir(dir.path()).unwrap_err();
    assert_eq!(err.kind(), Kind::BadInput);
    assert!(
        err.to_string()
            .contains("\"CLIPImageProcessor\" is not supported"),
        "{err}"
    );
}

#[test]
fn internvl_processor_tiles_and_sets_tokens() {
    // InternVLProcessor forces crop_to_patches and sets the tokens per tile.
    let dir = tempfile::tempdir().unwrap();
    let mut config: serde_json::Value =
        crate::util::read_json(config_dir("internvl").join("preprocessor_config.json"));
    config["crop_to_patches"] = false.into();
    std::fs::write(
        dir.path().join("preprocessor_config.json"),
        config.to_string(),
    )
    .unwrap();
    let scene = fixtures().join("images/scene_100x75.png");
    let plain = Processor::from_dir(dir.path()).unwrap();
    assert_eq!(
        plain.preprocess(std::slice::from_ref(&scene)).unwrap().grid,
        Grid::NumPatches(vec![1])
    );
    std::fs::write(
        dir.path().join("processor_config.json"),
        r#"{"processor_class": "InternVLProcessor", "image_seq_length": 64}"#,
    )
    .unwrap();
    let internvl = Processor::from_dir(dir.path()).unwrap();
    let pixels = internvl.preprocess(&[scene]).unwrap();
    assert_eq!(pixels.grid, Grid::NumPatches(vec![7]));
    assert_eq!(pixels.tokens, [7 * 64]);
}

/// Decoding the JPEGs of `tools/gen_jpeg_goldens.py` (tests/fixtures/jpeg/) gives PIL's RGB
/// bytes exactly, in every subsampling and coding mode (docs/reference/images.md, "JPEG").
#[test]
fn jpeg_decodes_to_pils_rgb() {
    let dir = fixtures().join("jpeg");
    let mut jpegs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jpg"))
        .collect();
    jpegs.sort();
    assert_eq!(jpegs.len(), 9);
    for jpeg in &jpegs {
        let got = sinkmerge::image::decode::load_rgb(jpeg, true).unwrap();
        let want = image::open(jpeg.with_extension("png")).unwrap().to_rgb8();
        assert_eq!(got.dimensions(), want.dimensions(), "{}", jpeg.display());
        let differing = (got.as_raw().iter().zip(want.as_raw()))
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(
            differing,
            0,
            "{}: bytes differing from PIL's",
            jpeg.display()
        );
    }
}

/// Damaged JPEGs decode or are refused as bad input, never panic: two fixtures (progressive,
/// restart markers) with each byte altered in turn, and cut every 5 bytes.
#[test]
fn damaged_jpegs_decode_or_are_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("damaged.jpg");
    for name in ["progressive_61x43", "restart_61x43"] {
        let jpeg = std::fs::read(fixtures().join(format!("jpeg/{name}.jpg"))).unwrap();
        for i in 0..jpeg.len() {
            let mut altered = jpeg.clone();
            altered[i] ^= 0x5A;
            let cut = &jpeg[..i - i % 5];
            for bytes in [cut, &altered[..]] {
                std::fs::write(&path, bytes).unwrap();
                if let Err(err) = sinkmerge::image::decode::load_rgb(&path, true) {
                    assert_eq!(err.kind(), Kind::BadInput, "{name}, byte {i}: {err}");
                }
            }
        }
    }
}
