//! The Qwen3-VL vision tower, shared by the dense and MoE VLMs (`qwen3_vl`, `qwen3_vl_moe`), as
//! transformers 5.23's `modeling_qwen3_vl.py` computes it (`Qwen3VLVisionModel`;
//! `docs/reference/vision.md`, "Qwen3-VL"): Conv3d patch embedding, learned position embeddings
//! bilinearly resampled to each image's grid, 2-D rotary, pre-norm LayerNorm blocks with
//! block-diagonal attention per frame, the 2×2 patch merger and the deepstack mergers.

use std::ops::Range;

use serde::Deserialize;
use serde_json::Value;

use super::block::{Ffn, FusedQkvBlock};
use super::projector::Projector;
use super::{patch_grids, Encoding, ImageFeatures, Norm, Pixels};
use crate::error::Result;
use crate::forward::activation::Activation;
use crate::forward::backend::{Backend, RopeTable};
use crate::forward::precision::Bf16Style;
use crate::forward::weights::Model;
use crate::{bad, bail};

/// `vision_config` of a Qwen3-VL(-MoE) `config.json`; defaults are `Qwen3VLVisionConfig`'s.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    #[serde(default = "defaults::depth")]
    pub depth: usize,
    #[serde(default = "defaults::hidden_size")]
    pub hidden_size: usize,
    #[serde(default = "defaults::hidden_act")]
    pub hidden_act: String,
    #[serde(default = "defaults::intermediate_size")]
    pub intermediate_size: usize,
    #[serde(default = "defaults::num_heads")]
    pub num_heads: usize,
    #[serde(default = "defaults::in_channels")]
    pub in_channels: usize,
    #[serde(default = "defaults::patch_size")]
    pub patch_size: usize,
    #[serde(default = "defaults::spatial_merge_size")]
    pub spatial_merge_size: usize,
    #[serde(default = "defaults::temporal_patch_size")]
    pub temporal_patch_size: usize,
    #[serde(default = "defaults::out_hidden_size")]
    pub out_hidden_size: usize,
    #[serde(default = "defaults::num_position_embeddings")]
    pub num_position_embeddings: usize,
    #[serde(default = "defaults::deepstack_visual_indexes")]
    pub deepstack_visual_indexes: Vec<usize>,
    /// Absent in the original Hub configs: axial rotary with θ = 10000.
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    #[serde(default = "defaults::rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "defaults::rope_type")]
    pub rope_type: String,
}

mod defaults {
    pub fn depth() -> usize {
        27
    }
    pub fn hidden_size() -> usize {
        1152
    }
    pub fn hidden_act() -> String {
        "gelu_pytorch_tanh".into()
    }
    pub fn intermediate_size() -> usize {
        4304
    }
    pub fn num_heads() -> usize {
        16
    }
    pub fn in_channels() -> usize {
        3
    }
    pub fn patch_size() -> usize {
        16
    }
    pub fn spatial_merge_size() -> usize {
        2
    }
    pub fn temporal_patch_size() -> usize {
        2
    }
    pub fn out_hidden_size() -> usize {
        3584
    }
    pub fn num_position_embeddings() -> usize {
        2304
    }
    pub fn deepstack_visual_indexes() -> Vec<usize> {
        vec![8, 16, 24]
    }
    pub fn rope_theta() -> f64 {
        10000.0
    }
    pub fn rope_type() -> String {
        "axial".into()
    }
}

/// The Qwen3-VL tower of one VLM: its vision config, checked.
#[derive(Debug, Clone)]
pub struct Qwen3VlTower {
    cfg: Config,
    act: Activation,
    head_dim: usize,
    /// Side of the learned position grid (`int(num_position_embeddings ** 0.5)`).
    side: usize,
    theta: f32,
}

/// One image's (t, h, w) patch grid.
type Grid = [usize; 3];

/// The eps of every LayerNorm of the tower and its mergers (`nn.LayerNorm(..., eps=1e-6)`).
const NORM_EPS: f32 = 1e-6;

impl Qwen3VlTower {
    /// The tower of a Qwen3-VL(-MoE) `config.json`.
    pub fn from_config(config: &Value) -> Result<Qwen3VlTower> {
        let vision = config
            .get("vision_config")
            .ok_or_else(|| bad!("config.json: a Qwen3-VL model needs `vision_config`"))?;
        let cfg: Config = serde_json::from_value(vision.clone())
            .map_err(|e| bad!("config.json: vision_config: {e}"))?;
        let act = Activation::from_hf(&cfg.hidden_act).ok_or_else(|| {
            bad!(
                "config.json: vision_config.hidden_act `{}` is not supported",
                cfg.hidden_act
            )
        })?;
        let (theta, rope_type) = match &cfg.rope_parameters {
            Some(r) => (r.rope_theta, r.rope_type.as_str()),
            None => (defaults::rope_theta(), "axial"),
        };
        if rope_type != "axial" {
            // Qwen3VLVisionRotaryEmbedding raises the same.
            bail!("config.json: vision_config.rope_parameters.rope_type `{rope_type}`: Qwen3-VL supports only axial rope");
        }
        let zero = [
            ("depth", cfg.depth),
            ("hidden_size", cfg.hidden_size),
            ("num_heads", cfg.num_heads),
            ("in_channels", cfg.in_channels),
            ("patch_size", cfg.patch_size),
            ("spatial_merge_size", cfg.spatial_merge_size),
            ("temporal_patch_size", cfg.temporal_patch_size),
            ("num_position_embeddings", cfg.num_position_embeddings),
        ]
        .into_iter()
        .find(|&(_, v)| v == 0);
        if let Some((field, _)) = zero {
            bail!("config.json: vision_config.{field} is 0");
        }
        // The rotary splits each head into h and w halves of head_dim/4 frequencies each.
        if !cfg.hidden_size.is_multiple_of(cfg.num_heads)
            || !(cfg.hidden_size / cfg.num_heads).is_multiple_of(4)
        {
            bail!(
                "config.json: vision_config.hidden_size {} over num_heads {} does not give a head_dim divisible by 4",
                cfg.hidden_size,
                cfg.num_heads
            );
        }
        if let Some(&i) = cfg
            .deepstack_visual_indexes
            .iter()
            .find(|&&i| i >= cfg.depth)
        {
            bail!(
                "config.json: vision_config.deepstack_visual_indexes has {i}, past depth {}",
                cfg.depth
            );
        }
        Ok(Qwen3VlTower {
            act,
            head_dim: cfg.hidden_size / cfg.num_heads,
            side: (cfg.num_position_embeddings as f64).sqrt().floor() as usize,
            theta: theta as f32,
            cfg,
        })
    }

    /// Values per patch row: `C·T·P·P`.
    pub fn patch_width(&self) -> usize {
        self.cfg.in_channels * self.cfg.temporal_patch_size * self.cfg.patch_size.pow(2)
    }

    /// `vision_config.patch_size`.
    pub fn patch_size(&self) -> usize {
        self.cfg.patch_size
    }

    /// `vision_config.temporal_patch_size`.
    pub fn temporal_patch_size(&self) -> usize {
        self.cfg.temporal_patch_size
    }

    /// `vision_config.spatial_merge_size`.
    pub fn merge_size(&self) -> usize {
        self.cfg.spatial_merge_size
    }

    /// The patch rows and grids of `pixels`, checked against each other and this tower.
    fn grids<'p>(&self, pixels: &Pixels<'p>) -> Result<(&'p [f32], &'p [Grid])> {
        patch_grids(
            pixels,
            "Qwen3-VL",
            self.cfg.spatial_merge_size,
            self.patch_width(),
        )
    }

    /// t·h·w / merge² image tokens per image.
    pub fn tokens_per_image(&self, pixels: &Pixels) -> Result<Vec<usize>> {
        let (_, grids) = self.grids(pixels)?;
        let unit = self.cfg.spatial_merge_size.pow(2);
        Ok(grids.iter().map(|&[t, h, w]| t * h * w / unit).collect())
    }

    /// `Qwen3VLVisionModel.forward`: the merger's rows, the deepstack mergers' rows in block
    /// order, and the taps `vision.patch_embed`, `vision.pos_embeds`, `vision.block.<i>`.
    pub(super) fn encode<B: Backend>(&self, run: &mut Encoding<B>) -> Result<ImageFeatures> {
        let (be, model) = (run.be, run.model);
        let (values, grids) = self.grids(&run.pixels)?;
        let cfg = &self.cfg;
        let (e, k) = (cfg.hidden_size, self.patch_width());
        let rows = values.len() / k;
        if cfg.out_hidden_size != model.spec.hidden_size {
            bail!(
                "{}: vision_config.out_hidden_size {} differs from the language model's hidden size {}",
                model.ckpt.dir.join("config.json").display(),
                cfg.out_hidden_size,
                model.spec.hidden_size
            );
        }
        let p = prefix(model);

        // Qwen3VLVisionPatchEmbed: Conv3d with kernel = stride = (T, P, P) over [patches, C·T·P·P]
        // is one GEMM with the weight [embed, C, T, P, P] read as [embed, C·T·P·P], plus its bias.
        let mut x = {
            let (t, pz) = (cfg.temporal_patch_size, cfg.patch_size);
            let w = be.load(
                model,
                &format!("{p}patch_embed.proj.weight"),
                &[e, cfg.in_channels, t, pz, pz],
            )?;
            let b = be.load(model, &format!("{p}patch_embed.proj.bias"), &[e])?;
            // The pixels are cast to the weight's dtype first (a no-op in f32).
            let mut px = be.upload(values.to_vec())?;
            be.round(&mut px)?;
            let mut x = be.linear(&px, rows, &w, e, k)?;
            be.add_bias(&mut x, &b, e)?;
            be.round(&mut x)?;
            x
        };
        run.tap("vision.patch_embed".into(), &x)?;

        let pos = self.pos_embeds(be, model, &p, grids)?;
        be.add_assign(&mut x, &pos)?;
        run.tap("vision.pos_embeds".into(), &pos)?;
        drop(pos);

        let rope = self.rope_table(grids);
        // get_vision_cu_seqlens: each frame (h·w patches) attends within itself.
        let mut segments: Vec<Range<usize>> = Vec::new();
        let mut start = 0;
        for &[t, h, w] in grids {
            for _ in 0..t {
                segments.push(start..start + h * w);
                start += h * w;
            }
        }

        let block = self.block();
        let tokens = rows / cfg.spatial_merge_size.pow(2);
        let mut deepstack = Vec::new();
        for i in 0..cfg.depth {
            let prefix = format!("{p}blocks.{i}");
            block.apply(be, model, &prefix, &mut x, rows, &segments, &rope)?;
            run.tap(format!("vision.block.{i}"), &x)?;
            if let Some(j) = cfg.deepstack_visual_indexes.iter().position(|&d| d == i) {
                let prefix = format!("{p}deepstack_merger_list.{j}");
                let merged = self.merger(true).apply(be, model, &prefix, &x, tokens)?;
                deepstack.push(be.to_host(&merged)?.into_owned());
            }
        }
        let merged = self
            .merger(false)
            .apply(be, model, &format!("{p}merger"), &x, tokens)?;
        Ok(ImageFeatures {
            embeds: be.to_host(&merged)?.into_owned(),
            tokens,
            deepstack,
        })
    }

    /// `pos_embed` resampled to every patch as `get_vision_interpolation_indices_and_weights`
    /// (transformers' `vision_utils.py`, bilinear, align_corners) gives it: per axis the source
    /// coordinate `i·(side-1)/(n-1)`, its floor and floor+1 (clamped) with weights 1-d and d,
    /// the four products summed; patches in merge-block order, the frame repeated over t.
    /// Host math in f32, as torch does it, on the weights as the backend holds them.
    fn pos_embeds<B: Backend>(
        &self,
        be: &B,
        model: &Model,
        p: &str,
        grids: &[Grid],
    ) -> Result<B::Tensor> {
        let (e, side, m) = (self.cfg.hidden_size, self.side, self.cfg.spatial_merge_size);
        let table = be.load(
            model,
            &format!("{p}pos_embed.weight"),
            &[self.cfg.num_position_embeddings, e],
        )?;
        let table = be.to_host(&table)?;
        let axis = |i: usize, n: usize| -> [(usize, f32); 2] {
            let src = i as f32 * (side - 1) as f32 / (n.max(2) - 1) as f32;
            let floor = src.floor();
            let tap = |o: usize| ((floor as usize) + o).min(side - 1);
            let weight = |o: usize| (1.0 - (src - floor - o as f32).abs()).max(0.0);
            [(tap(0), weight(0)), (tap(1), weight(1))]
        };
        let mut out =
            Vec::with_capacity(grids.iter().map(|g| g[0] * g[1] * g[2]).sum::<usize>() * e);
        for &[t, h, w] in grids {
            let mut frame = Vec::with_capacity(h * w * e);
            for (row, col) in merge_order(h, w, m) {
                let mut acc = vec![0f32; e];
                for (rt, rw) in axis(row, h) {
                    for (ct, cw) in axis(col, w) {
                        let weight = rw * cw;
                        let src = &table[(rt * side + ct) * e..][..e];
                        acc.iter_mut().zip(src).for_each(|(a, &v)| *a += v * weight);
                    }
                }
                frame.extend(acc);
            }
            for _ in 0..t {
                out.extend_from_slice(&frame);
            }
        }
        let mut pos = be.upload(out)?;
        be.round(&mut pos)?;
        Ok(pos)
    }

    /// `Qwen3VLVisionRotaryEmbedding` on `get_vision_position_ids`: per patch (merge-block
    /// order, repeated over t) the angles `[h·inv_freq, w·inv_freq]`, inv_freq =
    /// θ^(-2i/(head_dim/2)) for i < head_dim/4; rotate-half over the whole head.
    fn rope_table(&self, grids: &[Grid]) -> RopeTable {
        let spatial = self.head_dim / 2;
        let inv_freq: Vec<f32> = (0..spatial / 2)
            .map(|i| 1.0 / self.theta.powf((2 * i) as f32 / spatial as f32))
            .collect();
        let mut angles = Vec::new();
        for &[t, h, w] in grids {
            for _ in 0..t {
                for (row, col) in merge_order(h, w, self.cfg.spatial_merge_size) {
                    angles.extend(inv_freq.iter().map(|f| row as f32 * f));
                    angles.extend(inv_freq.iter().map(|f| col as f32 * f));
                }
            }
        }
        RopeTable::from_angles(spatial, &angles, 1.0)
    }

    /// `Qwen3VLVisionBlock`: `x += proj(attn(norm1(x)))`, `x += fc2(act(fc1(norm2(x))))`.
    fn block(&self) -> FusedQkvBlock {
        FusedQkvBlock {
            width: self.cfg.hidden_size,
            heads: self.cfg.num_heads,
            intermediate: self.cfg.intermediate_size,
            norm: Norm::Layer(NORM_EPS),
            ffn: Ffn::Plain {
                fc1: "mlp.linear_fc1",
                fc2: "mlp.linear_fc2",
            },
            act: self.act,
            // apply_rotary_pos_emb_vision rotates in f32 on f32 cos/sin and rounds once.
            rope: Bf16Style::Olmo,
        }
    }

    /// `Qwen3VLVisionPatchMerger`: rows in merge-block order, so grouping merge² consecutive
    /// rows into one `[hidden·merge²]` row needs no data movement. LayerNorm over hidden before
    /// the grouping (the final merger) or over the grouped width after it (`use_postshuffle_norm`,
    /// the deepstack mergers), then `linear_fc1` → GELU (erf, `nn.GELU()`) → `linear_fc2`.
    fn merger(&self, postshuffle: bool) -> Projector {
        let e = self.cfg.hidden_size;
        let wide = e * self.cfg.spatial_merge_size.pow(2);
        Projector {
            names: ["norm", "linear_fc1", "linear_fc2"],
            norm: Norm::Layer(NORM_EPS),
            norm_width: if postshuffle { wide } else { e },
            widths: [wide, wide, self.cfg.out_hidden_size],
            act: Activation::Gelu,
        }
    }
}

/// The tower's prefix: `model.visual.` (transformers 5.23's `save_pretrained`, and the original
/// Qwen3-VL Hub checkpoints), else `visual.`.
fn prefix(model: &Model) -> String {
    let legacy = model.ckpt.contains("visual.patch_embed.proj.weight")
        && !model.ckpt.contains("model.visual.patch_embed.proj.weight");
    if legacy { "visual." } else { "model.visual." }.into()
}

/// The (row, col) of each patch of an h×w grid in merge-block order (block row, block col, row
/// in block, col in block), as the Qwen processors emit patches.
fn merge_order(h: usize, w: usize, m: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..h / m).flat_map(move |br| {
        (0..w / m).flat_map(move |bc| {
            (0..m).flat_map(move |r| (0..m).map(move |c| (br * m + r, bc * m + c)))
        })
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::super::goldens::{self, relative as rel_diff, Golden};
    use super::super::{ImageFeatures, Pixels, Taps, Tower};
    use crate::checkpoint::Checkpoint;
    use crate::forward::backend::cpu::CpuBackend;
    use crate::forward::backend::cuda::host::HostDevice;
    use crate::forward::backend::cuda::CudaBackend;
    use crate::forward::backend::Backend;
    use crate::forward::precision::Precision;
    use crate::forward::weights::Model;

    /// Relative tolerance of every comparison: max |Δ| over the reference's largest magnitude.
    const TOL: f64 = 1e-4;

    /// qwen3_vl/scene, qwen3_vl/wide, qwen3_vl_moe/tall.
    fn cases() -> Vec<goldens::Case> {
        let cases = goldens::cases(&["qwen3_vl", "qwen3_vl_moe"]);
        assert_eq!(cases.len(), 3);
        cases
    }

    fn run<B: Backend>(be: &B, model_dir: &Path, golden: &Golden) -> (ImageFeatures, Taps) {
        let ckpt = Checkpoint::open_dir(model_dir, "fixture").unwrap();
        let model = Model::new(&ckpt).unwrap();
        let tower = Tower::from_config(&ckpt.config).unwrap().unwrap();
        let (values, grids) = (golden.f32("pixel_values"), golden.grids());
        let pixels = Pixels::Patches {
            values: &values,
            grid_thw: &grids,
        };
        let mut taps = Taps::new();
        let features = tower.encode(be, &model, &pixels, Some(&mut taps)).unwrap();
        (features, taps)
    }

    /// Every compared tensor: (golden name, ours).
    fn outputs(features: &ImageFeatures, taps: &Taps) -> Vec<(String, Vec<f32>)> {
        let mut out = vec![("image_embeds".to_string(), features.embeds.clone())];
        for (j, d) in features.deepstack.iter().enumerate() {
            out.push((format!("deepstack.{j}"), d.clone()));
        }
        out.extend(taps.iter().cloned());
        out
    }

    #[test]
    fn cpu_matches_the_transformers_goldens() {
        for goldens::Case {
            name,
            model: model_dir,
            golden,
        } in cases()
        {
            let (features, taps) = run(&CpuBackend::new(Precision::F32), &model_dir, &golden);
            assert_eq!(
                features.deepstack.len(),
                2,
                "{name}: deepstack.0 and deepstack.1"
            );
            assert_eq!(features.tokens * 32, features.embeds.len(), "{name}: rows");
            let outputs = outputs(&features, &taps);
            assert_eq!(outputs.len(), 3 + 2 + 3, "{name}: embeds, deepstack, taps");
            for (tensor, ours) in outputs {
                assert!(golden.has(&tensor), "{name}: golden has no {tensor}");
                let d = rel_diff(&ours, &golden.f32(&tensor));
                println!("{name} {tensor}: max |Δ| / max |golden| = {d:.2e}");
                assert!(
                    d <= TOL,
                    "{name} {tensor}: max |Δ| / max |golden| = {d:e} > {TOL:e}"
                );
            }
        }
    }

    #[test]
    fn stand_in_gpu_matches_the_cpu() {
        for goldens::Case {
            name,
            model: model_dir,
            golden,
        } in cases()
        {
            let (cpu_f, cpu_t) = run(&CpuBackend::new(Precision::F32), &model_dir, &golden);
            let gpu = CudaBackend::new(HostDevice::default(), Precision::F32);
            let (gpu_f, gpu_t) = run(&gpu, &model_dir, &golden);
            assert_eq!(gpu_f.tokens, cpu_f.tokens, "{name}: tokens");
            for ((tensor, ours), (_, reference)) in outputs(&gpu_f, &gpu_t)
                .into_iter()
                .zip(outputs(&cpu_f, &cpu_t))
            {
                let d = rel_diff(&ours, &reference);
                println!("{name} {tensor}: stand-in vs cpu {d:.2e}");
                assert!(
                    d <= TOL,
                    "{name} {tensor}: stand-in vs cpu max |Δ| / max |cpu| = {d:e} > {TOL:e}"
                );
            }
        }
    }

    #[test]
    fn tokens_per_image_counts_the_image_pads() {
        for goldens::Case {
            name,
            model: model_dir,
            golden,
        } in cases()
        {
            let ckpt = Checkpoint::open_dir(&model_dir, "fixture").unwrap();
            let tower = Tower::from_config(&ckpt.config).unwrap().unwrap();
            let (values, grids) = (golden.f32("pixel_values"), golden.grids());
            let pixels = Pixels::Patches {
                values: &values,
                grid_thw: &grids,
            };
            let pad = ckpt.config["image_token_id"].as_i64().unwrap();
            let pads = golden
                .i64("input_ids")
                .iter()
                .filter(|&&t| t == pad)
                .count();
            let tokens = tower.tokens_per_image(&pixels).unwrap();
            assert_eq!(tokens.iter().sum::<usize>(), pads, "{name}: {tokens:?}");
        }
    }

    #[test]
    fn wrong_pixels_are_errors() {
        let goldens::Case {
            model: model_dir,
            golden,
            ..
        } = cases().remove(0);
        let ckpt = Checkpoint::open_dir(&model_dir, "fixture").unwrap();
        let model = Model::new(&ckpt).unwrap();
        let tower = Tower::from_config(&ckpt.config).unwrap().unwrap();
        let (values, grids) = (golden.f32("pixel_values"), golden.grids());
        let cpu = CpuBackend::new(Precision::F32);
        let short = Pixels::Patches {
            values: &values[..values.len() - 1],
            grid_thw: &grids,
        };
        let odd = [[1, 3, 4]];
        let odd_grid = Pixels::Patches {
            values: &values[..12 * 1536],
            grid_thw: &odd,
        };
        let tiles = Pixels::Tiles {
            values: &values,
            num_patches: &[1],
        };
        for (pixels, says) in [
            (short, "expected [24, 1536]"),
            (odd_grid, "merge blocks"),
            (tiles, "not image tiles"),
        ] {
            let e = tower.tokens_per_image(&pixels).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
            let e = tower
                .encode(&cpu, &model, &pixels, None)
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn mis_shaped_weights_name_the_file_and_tensor() {
        let goldens::Case {
            model: model_dir,
            golden,
            ..
        } = cases().remove(0);
        let ckpt = Checkpoint::open_dir(&model_dir, "fixture").unwrap();
        let model = Model::new(&ckpt).unwrap();
        let mut config = ckpt.config.clone();
        config["vision_config"]["intermediate_size"] = 48.into();
        let tower = Tower::from_config(&config).unwrap().unwrap();
        let (values, grids) = (golden.f32("pixel_values"), golden.grids());
        let pixels = Pixels::Patches {
            values: &values,
            grid_thw: &grids,
        };
        let e = tower
            .encode(&CpuBackend::new(Precision::F32), &model, &pixels, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.safetensors")
                && e.contains("model.visual.blocks.0.mlp.linear_fc1.weight"),
            "{e}"
        );
    }
}
