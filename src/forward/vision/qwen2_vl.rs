//! The Qwen2-VL and Qwen2.5-VL vision towers, as transformers 5.23 computes them
//! (`modeling_qwen2_vl.py`: `Qwen2VisionTransformerPretrainedModel`; `modeling_qwen2_5_vl.py`:
//! `Qwen2_5_VisionTransformerPretrainedModel`; the index math of `vision_utils.py`). The steps,
//! config fields and weight names are in `docs/reference/vision.md`, "Qwen2-VL and Qwen2.5-VL".

use std::ops::Range;

use serde::Deserialize;
use serde_json::Value;

use super::block::{Ffn, FusedQkvBlock};
use super::projector::Projector;
use super::{patch_grids, Encoding, ImageFeatures, Norm, Pixels};
use crate::bad;
use crate::error::Result;
use crate::forward::activation::Activation;
use crate::forward::backend::{Backend, RopeTable};
use crate::forward::precision::Bf16Style;
use crate::forward::weights::Model;

/// The two generations share the patch embedding, rotary, attention and merger; Qwen2.5-VL
/// swaps LayerNorm for RMSNorm and the MLP for a gated one, and adds window attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Generation {
    /// `qwen2_vl`: LayerNorm blocks, `fc1` → `hidden_act` → `fc2`, full attention per image.
    Qwen2,
    /// `qwen2_5_vl`: RMSNorm blocks, gated MLP, window attention outside `fullatt_block_indexes`.
    Qwen25,
}

/// `vision_config` as stored; absent fields take the defaults of transformers'
/// `Qwen2VLVisionConfig` / `Qwen2_5_VLVisionConfig`, resolved in [`Vision::from_config`].
#[derive(Debug, Deserialize)]
struct RawConfig {
    depth: Option<usize>,
    embed_dim: Option<usize>,
    hidden_size: Option<usize>,
    hidden_act: Option<String>,
    mlp_ratio: Option<f64>,
    intermediate_size: Option<usize>,
    num_heads: Option<usize>,
    // The Hub's Qwen2-VL and Qwen2.5-VL configs spell it `in_chans`.
    #[serde(alias = "in_chans")]
    in_channels: Option<usize>,
    patch_size: Option<usize>,
    spatial_merge_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    window_size: Option<usize>,
    out_hidden_size: Option<usize>,
    fullatt_block_indexes: Option<Vec<usize>>,
    rope_parameters: Option<RawRope>,
}

#[derive(Debug, Deserialize)]
struct RawRope {
    rope_theta: Option<f64>,
}

/// Window attention of Qwen2.5-VL.
#[derive(Debug, Clone, PartialEq)]
pub struct Windows {
    /// Side of a window in merge units (`window_size / patch_size / spatial_merge_size`).
    pub units: usize,
    /// Blocks that attend over whole images instead of windows.
    pub full_blocks: Vec<usize>,
}

/// A resolved Qwen2-VL / Qwen2.5-VL vision config.
#[derive(Debug, Clone, PartialEq)]
pub struct Vision {
    pub generation: Generation,
    pub depth: usize,
    /// The blocks' width (`embed_dim` in Qwen2-VL, `hidden_size` in Qwen2.5-VL).
    pub width: usize,
    pub num_heads: usize,
    pub intermediate: usize,
    pub act: Activation,
    pub in_channels: usize,
    pub patch: usize,
    pub temporal_patch: usize,
    pub merge: usize,
    /// The merger's output width (the language model's hidden size).
    pub out_hidden: usize,
    pub rope_theta: f64,
    pub windows: Option<Windows>,
}

/// Every tower's LayerNorm/RMSNorm uses eps 1e-6 (hard-coded in both modeling files).
const NORM_EPS: f32 = 1e-6;

impl Vision {
    /// The tower of a VLM `config.json` of `generation`.
    pub fn from_config(config: &Value, generation: Generation) -> Result<Vision> {
        let err = |e: String| bad!("config.json: vision_config: {e}");
        let section = config
            .get("vision_config")
            .ok_or_else(|| err("missing".into()))?;
        let raw = RawConfig::deserialize(section).map_err(|e| err(e.to_string()))?;
        let depth = raw.depth.unwrap_or(32);
        let num_heads = raw.num_heads.unwrap_or(16);
        let (width, intermediate, act_name, out_hidden) = match generation {
            Generation::Qwen2 => {
                let width = raw.embed_dim.unwrap_or(1280);
                let ratio = raw.mlp_ratio.unwrap_or(4.0);
                // `int(config.embed_dim * config.mlp_ratio)` (Qwen2VLVisionBlock).
                let inter = (width as f64 * ratio) as usize;
                let act = raw.hidden_act.unwrap_or_else(|| "quick_gelu".into());
                (width, inter, act, raw.hidden_size.unwrap_or(3584))
            }
            Generation::Qwen25 => (
                raw.hidden_size.unwrap_or(3584),
                raw.intermediate_size.unwrap_or(3420),
                raw.hidden_act.unwrap_or_else(|| "silu".into()),
                raw.out_hidden_size.unwrap_or(3584),
            ),
        };
        let act = Activation::from_hf(&act_name).ok_or_else(|| {
            err(format!(
                "hidden_act `{act_name}` is not supported (supported: {})",
                Activation::NAMES
            ))
        })?;
        let patch = raw.patch_size.unwrap_or(14);
        let merge = raw.spatial_merge_size.unwrap_or(2);
        let windows = match generation {
            Generation::Qwen2 => None,
            Generation::Qwen25 => {
                let window_size = raw.window_size.unwrap_or(112);
                let full_blocks = raw.fullatt_block_indexes.unwrap_or(vec![7, 15, 23, 31]);
                let units = window_size / merge.max(1) / patch.max(1);
                if units == 0 {
                    return Err(err(format!(
                        "window_size {window_size} is smaller than one merge unit ({merge}×{patch} pixels)"
                    )));
                }
                Some(Windows { units, full_blocks })
            }
        };
        let vision = Vision {
            generation,
            depth,
            width,
            num_heads,
            intermediate,
            act,
            in_channels: raw.in_channels.unwrap_or(3),
            patch,
            temporal_patch: raw.temporal_patch_size.unwrap_or(2),
            merge,
            out_hidden,
            rope_theta: raw
                .rope_parameters
                .and_then(|r| r.rope_theta)
                .unwrap_or(1e4),
            windows,
        };
        let sizes = [
            vision.depth,
            vision.width,
            vision.num_heads,
            vision.intermediate,
            vision.in_channels,
            vision.patch,
            vision.temporal_patch,
            vision.merge,
            vision.out_hidden,
        ];
        if sizes.contains(&0) {
            return Err(err(format!("a zero size in {vision:?}")));
        }
        // The 2-D rotary splits each head into h and w halves of rotate-half pairs.
        if !vision.width.is_multiple_of(vision.num_heads) || !vision.head_dim().is_multiple_of(4) {
            return Err(err(format!(
                "width {} over {} heads: head_dim must be a multiple of 4",
                vision.width, vision.num_heads
            )));
        }
        Ok(vision)
    }

    fn head_dim(&self) -> usize {
        self.width / self.num_heads
    }

    /// Values of one patch row: `C·T·P·P`.
    pub fn patch_values(&self) -> usize {
        self.in_channels * self.temporal_patch * self.patch * self.patch
    }

    /// Rows per merged token.
    fn unit(&self) -> usize {
        self.merge * self.merge
    }

    /// The image grids of `pixels`, checked against the values they come with.
    fn grids<'p>(&self, pixels: &Pixels<'p>) -> Result<(&'p [f32], &'p [[usize; 3]])> {
        patch_grids(
            pixels,
            "a Qwen2-VL/Qwen2.5-VL tower",
            self.merge,
            self.patch_values(),
        )
    }

    /// `t·h·w / merge²` per image.
    pub fn tokens_per_image(&self, pixels: &Pixels) -> Result<Vec<usize>> {
        let (_, grids) = self.grids(pixels)?;
        Ok(grids
            .iter()
            .map(|g| g[0] * g[1] * g[2] / self.unit())
            .collect())
    }

    /// Run the tower (`forward` of either modeling file).
    pub(super) fn encode<B: Backend>(&self, run: &mut Encoding<B>) -> Result<ImageFeatures> {
        let (be, model) = (run.be, run.model);
        let (values, grids) = self.grids(&run.pixels)?;
        let prefix = tower_prefix(model)?;
        let (width, unit) = (self.width, self.unit());
        let rows = values.len() / self.patch_values();

        // PatchEmbed: a Conv3d with kernel = stride over whole patches is one GEMM.
        // `PatchEmbed.forward` casts the pixels to the weights' dtype first.
        let mut pixels = be.upload(values.to_vec())?;
        be.round(&mut pixels)?;
        let w = be.load(
            model,
            &format!("{prefix}patch_embed.proj.weight"),
            &[
                width,
                self.in_channels,
                self.temporal_patch,
                self.patch,
                self.patch,
            ],
        )?;
        let mut x = be.linear(&pixels, rows, &w, width, self.patch_values())?;
        drop((pixels, w));
        be.round(&mut x)?;
        run.tap("vision.patch_embed".into(), &x)?;

        let mut angles = self.rotary_angles(grids);
        let images = frame_segments(grids);
        // Qwen2.5-VL: merge units reordered into window order before the blocks, the rotary
        // angles with them (`permute_input_for_window_attn`).
        let windowed = match &self.windows {
            Some(win) => {
                let (index, cu) = window_index(grids, self.merge, win.units);
                let rows_index: Vec<u32> = index
                    .iter()
                    .flat_map(|&u| (u * unit..(u + 1) * unit).map(|r| r as u32))
                    .collect();
                x = be.gather_rows(&x, width, &rows_index)?;
                let half = self.head_dim() / 2;
                angles = rows_index
                    .iter()
                    .flat_map(|&r| angles[r as usize * half..(r as usize + 1) * half].to_vec())
                    .collect();
                let windows: Vec<Range<usize>> = cu.windows(2).map(|p| p[0]..p[1]).collect();
                Some((index, windows, win))
            }
            None => None,
        };
        let table = RopeTable::from_angles(self.head_dim() / 2, &angles, 1.0);
        drop(angles);

        let recipe = self.block();
        for block in 0..self.depth {
            let segments = match &windowed {
                Some((_, windows, win)) if !win.full_blocks.contains(&block) => windows,
                _ => &images,
            };
            let p = format!("{prefix}blocks.{block}");
            recipe.apply(be, model, &p, &mut x, rows, segments, &table)?;
            run.tap(format!("vision.block.{block}"), &x)?;
        }

        // `PatchMerger` / `Qwen2_5_VLPatchMerger`: `ln_q` over patch rows, each merge²
        // consecutive rows then one `[width·merge²]` row (the buffer read with fewer, wider rows),
        // `mlp.0` → GELU → `mlp.2`.
        let tokens = rows / unit;
        let wide = width * unit;
        let merger = Projector {
            names: ["ln_q", "mlp.0", "mlp.2"],
            norm: self.norm(),
            norm_width: width,
            widths: [wide, wide, self.out_hidden],
            act: Activation::Gelu,
        };
        let merged = merger.apply(be, model, &format!("{prefix}merger"), &x, tokens)?;
        drop(x);
        let merged = match &windowed {
            // argsort(window_index): the merged tokens back in processor order.
            Some((index, _, _)) => {
                let mut reverse = vec![0u32; index.len()];
                for (position, &u) in index.iter().enumerate() {
                    reverse[u] = position as u32;
                }
                be.gather_rows(&merged, self.out_hidden, &reverse)?
            }
            None => merged,
        };
        Ok(ImageFeatures {
            embeds: be.to_host(&merged)?.into_owned(),
            tokens,
            deepstack: Vec::new(),
        })
    }

    /// Per patch row, `head_dim / 2` rotary angles: `h · inv_freq` then `w · inv_freq`, with
    /// h/w in merge-block order (`get_vision_position_ids`, `Qwen2VLVisionRotaryEmbedding`).
    fn rotary_angles(&self, grids: &[[usize; 3]]) -> Vec<f32> {
        let spatial = self.head_dim() / 2;
        // `1 / base^(arange(0, spatial, 2) / spatial)` in f32, as torch.
        let inv_freq: Vec<f32> = (0..spatial)
            .step_by(2)
            .map(|i| 1.0 / (self.rope_theta as f32).powf(i as f32 / spatial as f32))
            .collect();
        let m = self.merge;
        let mut angles = Vec::new();
        for &[t, h, w] in grids {
            for _ in 0..t {
                for bh in 0..h / m {
                    for bw in 0..w / m {
                        for ir in 0..m {
                            for ic in 0..m {
                                let (ph, pw) = ((bh * m + ir) as f32, (bw * m + ic) as f32);
                                angles.extend(inv_freq.iter().map(|f| ph * f));
                                angles.extend(inv_freq.iter().map(|f| pw * f));
                            }
                        }
                    }
                }
            }
        }
        angles
    }

    /// The blocks (`Qwen2VLVisionBlock`, `Qwen2_5_VLVisionBlock`): Qwen2-VL's `fc1` →
    /// `hidden_act` → `fc2`, Qwen2.5-VL's gated MLP; rotary rounded as Llama's in bf16.
    fn block(&self) -> FusedQkvBlock {
        FusedQkvBlock {
            width: self.width,
            heads: self.num_heads,
            intermediate: self.intermediate,
            norm: self.norm(),
            ffn: match self.generation {
                Generation::Qwen2 => Ffn::Plain {
                    fc1: "mlp.fc1",
                    fc2: "mlp.fc2",
                },
                Generation::Qwen25 => Ffn::Gated,
            },
            act: self.act,
            rope: Bf16Style::Llama,
        }
    }

    /// The block norms and `ln_q`: LayerNorm (with bias) in Qwen2-VL, RMSNorm in Qwen2.5-VL.
    fn norm(&self) -> Norm {
        match self.generation {
            Generation::Qwen2 => Norm::Layer(NORM_EPS),
            Generation::Qwen25 => Norm::Rms(NORM_EPS),
        }
    }
}

/// `visual.` (what transformers 5.23's `save_pretrained` writes for Qwen2/2.5-VL) or
/// `model.visual.` (checkpoints converted by newer transformers).
fn tower_prefix(model: &Model) -> Result<&'static str> {
    const PROBE: &str = "patch_embed.proj.weight";
    ["visual.", "model.visual."]
        .into_iter()
        .find(|p| model.ckpt.contains(&format!("{p}{PROBE}")))
        .ok_or_else(|| {
            bad!(
                "{}: tensor `visual.{PROBE}` (or `model.visual.{PROBE}`) is missing: no Qwen2-VL vision tower",
                model.ckpt.dir.display()
            )
        })
}

/// `cu_seqlens` as row ranges: each frame (`h·w` patches) of each image attends to itself
/// (`get_vision_cu_seqlens` without `merge_temporal`).
fn frame_segments(grids: &[[usize; 3]]) -> Vec<Range<usize>> {
    let mut start = 0;
    let mut segments = Vec::new();
    for &[t, h, w] in grids {
        for _ in 0..t {
            segments.push(start..start + h * w);
            start += h * w;
        }
    }
    segments
}

/// `get_vision_window_index`: the merge units of every frame in window order (windows of
/// `units × units` merge units, row-major, partial at the bottom and right edges), and
/// `cu_window_seqlens` in patch rows with empty windows removed (`unique_consecutive`).
fn window_index(grids: &[[usize; 3]], merge: usize, units: usize) -> (Vec<usize>, Vec<usize>) {
    let mut index = Vec::new();
    let mut cu = vec![0usize];
    let mut base = 0;
    for &[t, h, w] in grids {
        let (lh, lw) = (h / merge, w / merge);
        // transformers pads by `units - l % units`, a whole empty window when l divides evenly.
        let (nh, nw) = (lh / units + 1, lw / units + 1);
        for frame in 0..t {
            for wy in 0..nh {
                for wx in 0..nw {
                    let before = index.len();
                    for y in wy * units..((wy + 1) * units).min(lh) {
                        for x in wx * units..((wx + 1) * units).min(lw) {
                            index.push(base + frame * lh * lw + y * lw + x);
                        }
                    }
                    let last = *cu.last().unwrap_or(&0);
                    cu.push(last + (index.len() - before) * merge * merge);
                }
            }
        }
        base += t * lh * lw;
    }
    cu.dedup();
    (index, cu)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use safetensors::SafeTensors;

    use super::super::goldens::{self, relative};
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::forward::backend::cpu::CpuBackend;
    use crate::forward::backend::cuda::host::HostDevice;
    use crate::forward::backend::cuda::CudaBackend;
    use crate::forward::precision::Precision;
    use crate::forward::vision::{Taps, Tower};

    /// The acceptance bound: max |Δ| over the golden tensor's largest magnitude.
    const TOLERANCE: f64 = 1e-4;
    const IMAGE_PAD: i64 = 311;

    /// What `vision` gives through [`Tower::encode`], the entry point every caller uses.
    fn features<B: Backend>(
        vision: &Vision,
        be: &B,
        model: &Model,
        pixels: &Pixels,
        taps: Option<&mut Taps>,
    ) -> Result<ImageFeatures> {
        Tower::Qwen2Vl(vision.clone()).encode(be, model, pixels, taps)
    }

    fn tower(ckpt: &Checkpoint) -> Vision {
        match Tower::from_config(&ckpt.config).unwrap() {
            Some(Tower::Qwen2Vl(v)) => v,
            other => panic!("{}: tower {other:?}", ckpt.dir.display()),
        }
    }

    /// Every golden of `family` through the CPU backend against transformers, and through the
    /// CUDA stand-in against the CPU, printing the figures.
    fn parity(family: &str) {
        for case in goldens::cases(&[family]) {
            let ckpt = Checkpoint::open_dir(&case.model, family).unwrap();
            let model = Model::new(&ckpt).unwrap();
            let vision = tower(&ckpt);
            let values = case.golden.f32("pixel_values");
            let grid_thw = case.golden.grids();
            let pixels = Pixels::Patches {
                values: &values,
                grid_thw: &grid_thw,
            };

            // Image-pad runs in the prompt, one per image.
            let runs = case.golden.image_token_runs(IMAGE_PAD);
            assert_eq!(
                vision.tokens_per_image(&pixels).unwrap(),
                runs,
                "{}",
                case.name
            );

            let cpu = CpuBackend::new(Precision::F32);
            let mut taps = Taps::new();
            let got = features(&vision, &cpu, &model, &pixels, Some(&mut taps)).unwrap();
            assert_eq!(got.tokens, runs.iter().sum::<usize>(), "{}", case.name);
            assert!(got.deepstack.is_empty());
            let mut checked = vec![("image_embeds".to_string(), got.embeds.clone())];
            checked.extend(taps.iter().cloned());
            let expected_taps = 1 + vision.depth;
            assert_eq!(taps.len(), expected_taps, "{}: taps", case.name);
            for (name, values) in &checked {
                let r = relative(values, &case.golden.f32(name));
                eprintln!("{} {name}: cpu vs transformers {r:.2e}", case.name);
                assert!(
                    r <= TOLERANCE,
                    "{} {name}: max |Δ| / max |golden| = {r:.3e} > {TOLERANCE:e}",
                    case.name
                );
            }

            let gpu = CudaBackend::new(HostDevice::default(), Precision::F32);
            let mut gpu_taps = Taps::new();
            let on_gpu = features(&vision, &gpu, &model, &pixels, Some(&mut gpu_taps)).unwrap();
            assert_eq!(on_gpu.tokens, got.tokens);
            let mut gpu_checked = vec![("image_embeds".to_string(), on_gpu.embeds)];
            gpu_checked.extend(gpu_taps);
            for ((name, want), (gname, values)) in checked.iter().zip(&gpu_checked) {
                assert_eq!(name, gname);
                let r = relative(values, want);
                eprintln!("{} {name}: stand-in vs cpu {r:.2e}", case.name);
                assert!(
                    r <= TOLERANCE,
                    "{} {name}: CUDA stand-in vs CPU max |Δ| / max |cpu| = {r:.3e} > {TOLERANCE:e}",
                    case.name
                );
            }
        }
    }

    #[test]
    fn qwen2_vl_matches_transformers_and_the_stand_in_matches_the_cpu() {
        parity("qwen2_vl");
    }

    #[test]
    fn qwen2_5_vl_matches_transformers_and_the_stand_in_matches_the_cpu() {
        parity("qwen2_5_vl");
    }

    /// The fixture's tensors with `visual.` renamed to `model.visual.` (the layout of checkpoints
    /// converted by newer transformers) give the same features.
    #[test]
    fn the_model_visual_layout_reads_the_same_tower() {
        let case = goldens::cases(&["qwen2_5_vl"]).remove(0);
        let bytes = std::fs::read(case.model.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let renamed: Vec<(String, safetensors::tensor::TensorView)> = st
            .tensors()
            .into_iter()
            .map(|(name, view)| match name.strip_prefix("visual.") {
                Some(rest) => (format!("model.visual.{rest}"), view),
                None => (name, view),
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        safetensors::serialize_to_file(renamed, None, &dir.path().join("model.safetensors"))
            .unwrap();
        std::fs::copy(
            case.model.join("config.json"),
            dir.path().join("config.json"),
        )
        .unwrap();

        let values = case.golden.f32("pixel_values");
        let grid_thw = case.golden.grids();
        let pixels = Pixels::Patches {
            values: &values,
            grid_thw: &grid_thw,
        };
        let cpu = CpuBackend::new(Precision::F32);
        let encode = |dir: &Path| {
            let ckpt = Checkpoint::open_dir(dir, "qwen2_5_vl").unwrap();
            let model = Model::new(&ckpt).unwrap();
            features(&tower(&ckpt), &cpu, &model, &pixels, None).unwrap()
        };
        let converted = encode(dir.path());
        assert!(!converted.embeds.is_empty());
        assert_eq!(converted, encode(&case.model), "{}", case.name);
    }

    #[test]
    fn window_index_matches_the_goldens() {
        let mut reordered = false;
        for case in goldens::cases(&["qwen2_5_vl"]) {
            let ckpt = Checkpoint::open_dir(&case.model, "qwen2_5_vl").unwrap();
            let vision = tower(&ckpt);
            let units = vision.windows.as_ref().unwrap().units;
            let (index, cu) = window_index(&case.golden.grids(), vision.merge, units);
            let want_index: Vec<usize> = case
                .golden
                .i64("vision.window_index")
                .iter()
                .map(|&v| v as usize)
                .collect();
            let want_cu: Vec<usize> = case
                .golden
                .i64("vision.cu_window_seqlens")
                .iter()
                .map(|&v| v as usize)
                .collect();
            assert_eq!(index, want_index, "{}: window_index", case.name);
            assert_eq!(cu, want_cu, "{}: cu_window_seqlens", case.name);
            reordered |= index.iter().enumerate().any(|(i, &u)| i != u);
        }
        assert!(reordered, "no case exercises a non-identity window order");
    }

    #[test]
    fn frames_of_a_video_are_separate_segments() {
        assert_eq!(
            frame_segments(&[[2, 2, 4], [1, 4, 2]]),
            vec![0..8, 8..16, 16..24]
        );
        // Two frames of a 4×4-unit grid in windows of 2: four windows per frame.
        let (index, cu) = window_index(&[[2, 8, 8]], 2, 2);
        assert_eq!(index.len(), 32);
        assert_eq!(cu, (0..=8).map(|i| i * 16).collect::<Vec<_>>());
        assert_eq!(&index[16..20], &[16, 17, 20, 21]);
    }

    #[test]
    fn wrong_pixels_and_weights_are_errors() {
        let dir = goldens::root().join("tests/fixtures/vlm/qwen2_vl");
        let ckpt = Checkpoint::open_dir(&dir, "qwen2_vl").unwrap();
        let model = Model::new(&ckpt).unwrap();
        let vision = tower(&ckpt);
        let cpu = CpuBackend::new(Precision::F32);
        let values = vec![0.5f32; 16 * 1176];

        let short = Pixels::Patches {
            values: &values[..16 * 1176 - 1],
            grid_thw: &[[1, 4, 4]],
        };
        let e = features(&vision, &cpu, &model, &short, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("pixel_values") && e.contains("[16, 1176]"),
            "{e}"
        );
        let odd = Pixels::Patches {
            values: &values,
            grid_thw: &[[1, 16, 1]],
        };
        let e = vision.tokens_per_image(&odd).unwrap_err().to_string();
        assert!(e.contains("image_grid_thw[0]"), "{e}");
        let tiles = Pixels::Tiles {
            values: &values,
            num_patches: &[1],
        };
        assert!(vision.tokens_per_image(&tiles).is_err());

        let good = Pixels::Patches {
            values: &values,
            grid_thw: &[[1, 4, 4]],
        };
        // A config that disagrees with the weights: fc1 is stored [64, 32].
        let mut config = ckpt.config.clone();
        config["vision_config"]["mlp_ratio"] = 3.into();
        let wrong = Vision::from_config(&config, Generation::Qwen2).unwrap();
        let e = features(&wrong, &cpu, &model, &good, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("visual.blocks.0.mlp.fc1.weight"),
            "{e}"
        );
        // Qwen2.5-VL's gated MLP on Qwen2-VL weights: a missing tensor, named.
        let mut config = ckpt.config.clone();
        config["vision_config"]["hidden_size"] = 32.into();
        config["vision_config"]["out_hidden_size"] = 32.into();
        config["vision_config"]["intermediate_size"] = 64.into();
        config["vision_config"]["hidden_act"] = "silu".into();
        let other = Vision::from_config(&config, Generation::Qwen25).unwrap();
        let e = features(&other, &cpu, &model, &good, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("visual.blocks.0.mlp.gate_proj.weight"), "{e}");
        assert!(features(&vision, &cpu, &model, &good, None).is_ok());
    }
}
