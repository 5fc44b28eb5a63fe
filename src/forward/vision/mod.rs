//! Vision towers: an image's pixels to the rows that replace its image tokens' embeddings in the
//! language model, as transformers computes them in eager f32 (`docs/reference/vision.md`).
//! Written once over the [`Backend`] seam, like the decoder, so the CUDA backend runs them and
//! the CPU stand-in tests them. One file per tower family; [`Tower`] dispatches on the VLM's
//! `config.json`. The towers share their pieces, each tower's differences being fields: the
//! fused-qkv block (`block.rs`), the norm-then-MLP projector (`projector.rs`), and here the
//! norms, linears and attention.

use serde_json::Value;

use std::ops::Range;

use super::activation::Activation;
use super::backend::{AttentionShape, Backend};
use super::precision::Bf16Style;
use super::weights::Model;
use crate::error::Result;
use crate::image::Grid;

mod block;
#[cfg(test)]
pub(crate) mod goldens;
pub mod internvl;
mod projector;
pub mod qwen2_vl;
pub mod qwen3_vl;

/// A processor's output, as transformers' image processors lay it out.
#[derive(Debug, Clone, Copy)]
pub enum Pixels<'a> {
    /// The Qwen-VL processors: `values` is `[patches, C·T·P·P]`, each image's patches in turn,
    /// and `grid_thw` each image's (t, h, w) patch grid.
    Patches {
        values: &'a [f32],
        grid_thw: &'a [[usize; 3]],
    },
    /// InternVL (GotOcr2 tiling): `values` is `[tiles, 3, H, W]`, each image's tiles in turn
    /// (its thumbnail last), and `num_patches` each image's tile count.
    Tiles {
        values: &'a [f32],
        num_patches: &'a [usize],
    },
}

impl<'a> Pixels<'a> {
    /// `values` laid out as `grid` says (an image processor's output, `crate::image::Pixels`, or
    /// a `--pixel-values` file).
    pub fn from_grid(values: &'a [f32], grid: &'a Grid) -> Pixels<'a> {
        match grid {
            Grid::Thw(g) => Pixels::Patches {
                values,
                grid_thw: g,
            },
            Grid::NumPatches(n) => Pixels::Tiles {
                values,
                num_patches: n,
            },
        }
    }
}

/// What a tower gives the language model, on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageFeatures {
    /// `[image tokens, text hidden]`: every image's rows in prompt order, which replace the
    /// embeddings of the image-pad/context tokens.
    pub embeds: Vec<f32>,
    /// Rows of `embeds`.
    pub tokens: usize,
    /// Qwen3-VL's deepstack features (`[image tokens, text hidden]` each): the i-th is added to
    /// the image tokens' hidden states after decoder layer i.
    pub deepstack: Vec<Vec<f32>>,
}

/// Intermediate results a caller asked a tower to keep, by the goldens' names
/// (`vision.patch_embed`, `vision.block.<i>`, ...), for parity tests and `trace`.
pub type Taps = Vec<(String, Vec<f32>)>;

/// The vision tower of a VLM, from its `config.json`.
#[derive(Debug, Clone)]
pub enum Tower {
    /// Qwen3-VL and Qwen3-VL-MoE (`qwen3_vl.rs`).
    Qwen3Vl(qwen3_vl::Qwen3VlTower),
    /// Qwen2-VL and Qwen2.5-VL (`qwen2_vl.rs`).
    Qwen2Vl(qwen2_vl::Vision),
    /// InternVL: InternViT, pixel shuffle and projector (`internvl`, `internvl_chat`).
    InternVl(internvl::InternVl),
}

impl Tower {
    /// The tower described by `config` (a VLM's `config.json`), or `None` for a model without
    /// one. A VLM whose tower family is not supported is an error naming it.
    pub fn from_config(config: &Value) -> Result<Option<Tower>> {
        let model_type = config.get("model_type").and_then(Value::as_str);
        Ok(match model_type {
            Some("qwen3_vl" | "qwen3_vl_moe") => {
                Some(Tower::Qwen3Vl(qwen3_vl::Qwen3VlTower::from_config(config)?))
            }
            Some("qwen2_vl") => Some(Tower::Qwen2Vl(qwen2_vl::Vision::from_config(
                config,
                qwen2_vl::Generation::Qwen2,
            )?)),
            Some("qwen2_5_vl") => Some(Tower::Qwen2Vl(qwen2_vl::Vision::from_config(
                config,
                qwen2_vl::Generation::Qwen25,
            )?)),
            Some("internvl" | "internvl_chat") => {
                Some(Tower::InternVl(internvl::InternVl::from_config(config)?))
            }
            _ => None,
        })
    }

    /// The dimensions of `pixel_values` after the first (patch rows or tiles) that this tower
    /// reads: `[C·T·P·P]` for the Qwen-VL towers, `[C, H, W]` for InternVL.
    pub fn pixel_row_shape(&self) -> Vec<usize> {
        match self {
            Tower::Qwen3Vl(t) => vec![t.patch_width()],
            Tower::Qwen2Vl(v) => vec![v.patch_values()],
            Tower::InternVl(t) => t.tile_shape().to_vec(),
        }
    }

    /// The geometry the image processor must share with this tower: (the processor's key, the
    /// `vision_config` key, the tower's value).
    pub fn processor_geometry(&self) -> Vec<(&'static str, &'static str, usize)> {
        let patches = |patch, temporal, merge| {
            vec![
                ("patch_size", "patch_size", patch),
                ("temporal_patch_size", "temporal_patch_size", temporal),
                ("merge_size", "spatial_merge_size", merge),
            ]
        };
        match self {
            Tower::Qwen3Vl(t) => patches(t.patch_size(), t.temporal_patch_size(), t.merge_size()),
            Tower::Qwen2Vl(v) => patches(v.patch, v.temporal_patch, v.merge),
            Tower::InternVl(t) => {
                let [_, side, _] = t.tile_shape();
                vec![
                    ("size.height", "image_size", side),
                    ("size.width", "image_size", side),
                ]
            }
        }
    }

    /// How many image tokens each image of `pixels` becomes in the prompt; errors when `pixels`
    /// does not have the layout or shape this tower reads.
    pub fn tokens_per_image(&self, pixels: &Pixels) -> Result<Vec<usize>> {
        match self {
            Tower::Qwen3Vl(t) => t.tokens_per_image(pixels),
            Tower::Qwen2Vl(v) => v.tokens_per_image(pixels),
            Tower::InternVl(t) => t.tokens_per_image(pixels),
        }
    }

    /// Run the tower on `pixels`, reading its weights from `model` (tensors by their stored
    /// names), keeping the intermediates in `taps` when given.
    pub fn encode<B: Backend>(
        &self,
        backend: &B,
        model: &Model,
        pixels: &Pixels,
        taps: Option<&mut Taps>,
    ) -> Result<ImageFeatures> {
        let mut run = Encoding {
            be: backend,
            model,
            pixels: *pixels,
            taps,
        };
        match self {
            Tower::Qwen3Vl(t) => t.encode(&mut run),
            Tower::Qwen2Vl(v) => v.encode(&mut run),
            Tower::InternVl(t) => t.encode(&mut run),
        }
    }
}

/// Eager attention within each of `segments` (images, frames or windows: transformers'
/// `cu_seqlens`), every query seeing every key of its segment, scaled by `head_dim^-1/2`; the
/// context `P v` as `[rows, heads · head_dim]`.
fn segment_attention<B: Backend>(
    be: &B,
    [q, k, v]: [B::Tensor; 3],
    segments: &[Range<usize>],
    heads: usize,
    head_dim: usize,
) -> Result<B::Tensor> {
    let shape = AttentionShape {
        prompts: segments,
        num_heads: heads,
        num_kv_heads: heads,
        head_dim,
        causal: false,
        window: None,
        scale: (head_dim as f32).powf(-0.5),
    };
    be.attention(&q, &k, Some(&v), &shape, &|_| ())?
        .context
        .ok_or_else(|| crate::internal!("attention returned no context"))
}

/// `x Wᵀ (+ b)` of the linear layer `{prefix}` (`[out, inp]` weight, and its bias when `bias`)
/// over `rows` rows, rounded once after the bias as the decoder does; the weight is dropped
/// before the bias is read.
#[allow(clippy::too_many_arguments)]
fn linear<B: Backend>(
    be: &B,
    model: &Model,
    prefix: &str,
    x: &B::Tensor,
    rows: usize,
    out: usize,
    inp: usize,
    bias: bool,
) -> Result<B::Tensor> {
    let w = be.load(model, &format!("{prefix}.weight"), &[out, inp])?;
    let mut y = be.linear(x, rows, &w, out, inp)?;
    drop(w);
    if bias {
        let b = be.load(model, &format!("{prefix}.bias"), &[out])?;
        be.add_bias(&mut y, &b, out)?;
    }
    be.round(&mut y)?;
    Ok(y)
}

/// The norm of a tower's blocks, merger or projector, with its epsilon.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Norm {
    /// LayerNorm with weight and bias.
    Layer(f32),
    /// RMSNorm with a weight, rounded in bf16 as Llama's.
    Rms(f32),
}

impl Norm {
    /// The norm `{prefix}` of every `width`-wide row of `x`, as a copy.
    fn apply<B: Backend>(
        self,
        be: &B,
        model: &Model,
        prefix: &str,
        x: &B::Tensor,
        width: usize,
    ) -> Result<B::Tensor> {
        let w = be.load(model, &format!("{prefix}.weight"), &[width])?;
        match self {
            Norm::Layer(eps) => {
                let b = be.load(model, &format!("{prefix}.bias"), &[width])?;
                be.layer_norm(x, width, &w, &b, eps)
            }
            Norm::Rms(eps) => be.rms_norm(x, width, &w, eps, Bf16Style::Llama),
        }
    }
}

/// `fc2(act(fc1(x)))` over `rows` rows, both linears with their biases, `widths` being fc1's
/// input, its output and fc2's output; `x` is dropped once fc1 has read it.
fn mlp<B: Backend>(
    be: &B,
    model: &Model,
    [fc1, fc2]: [&str; 2],
    x: B::Tensor,
    rows: usize,
    [inp, hidden, out]: [usize; 3],
    act: Activation,
) -> Result<B::Tensor> {
    let mut y = linear(be, model, fc1, &x, rows, hidden, inp, true)?;
    drop(x);
    be.activate(&mut y, act)?;
    linear(be, model, fc2, &y, rows, out, hidden, true)
}

/// One run of a tower over `pixels`: the backend, the weights (tensors by their stored names)
/// and the intermediates the caller asked to keep.
struct Encoding<'a, B: Backend> {
    be: &'a B,
    model: &'a Model<'a>,
    pixels: Pixels<'a>,
    taps: Option<&'a mut Taps>,
}

impl<B: Backend> Encoding<'_, B> {
    /// Keeps a host copy of `x` as `name` when the caller asked for taps.
    fn tap(&mut self, name: String, x: &B::Tensor) -> Result<()> {
        if let Some(taps) = self.taps.as_deref_mut() {
            taps.push((name, self.be.to_host(x)?.into_owned()));
        }
        Ok(())
    }
}

/// The patch rows and grids of `pixels` for a Qwen-VL tower (`family` for messages): every grid
/// made of whole `merge`×`merge` blocks, and Σ t·h·w rows of `patch_values` (C·T·P·P) values.
fn patch_grids<'p>(
    pixels: &Pixels<'p>,
    family: &str,
    merge: usize,
    patch_values: usize,
) -> Result<(&'p [f32], &'p [[usize; 3]])> {
    let Pixels::Patches { values, grid_thw } = *pixels else {
        crate::bail!(
            "pixel_values: {family} reads patch rows with image_grid_thw, not image tiles"
        );
    };
    let mut patches = 0usize;
    for (i, &[t, h, w]) in grid_thw.iter().enumerate() {
        if t == 0 || h == 0 || w == 0 || !h.is_multiple_of(merge) || !w.is_multiple_of(merge) {
            crate::bail!(
                "image_grid_thw[{i}] = [{t}, {h}, {w}]: t, h, w must be positive and h, w whole \
                 {merge}×{merge} merge blocks"
            );
        }
        // Checked: a product or sum that wraps could match the values' length by accident.
        patches = t
            .checked_mul(h)
            .and_then(|p| p.checked_mul(w))
            .and_then(|p| p.checked_add(patches))
            .filter(|&p| p <= values.len())
            .ok_or_else(|| {
                crate::bad!(
                    "image_grid_thw[{i}] = [{t}, {h}, {w}]: more patches than the {} values hold",
                    values.len()
                )
            })?;
    }
    if Some(values.len()) != patches.checked_mul(patch_values) {
        crate::bail!(
            "pixel_values: {} values, expected [{patches}, {patch_values}] (Σ t·h·w patches of \
             C·T·P·P values) for image_grid_thw {grid_thw:?}",
            values.len()
        );
    }
    Ok((values, grid_thw))
}
