//! InternVL's vision tower (InternViT), pixel shuffle and projector, as transformers'
//! `modeling_internvl.py` computes them (`InternVLModel.get_image_features`), for both on-disk
//! layouts: transformers' (`vision_tower.*`, `multi_modal_projector.*`, with or without a
//! `model.` prefix) and OpenGVLab's remote code (`vision_model.*`, `mlp1.*`;
//! `modeling_intern_vit.py`, `modeling_internvl_chat.py`: the same arithmetic).
//! Steps and names: `docs/reference/vision.md`, "InternVL".

use serde::Deserialize;
use serde_json::Value;

use super::block::fused_qkv;
use super::projector::Projector;
use super::{linear, mlp, segment_attention, Encoding, ImageFeatures, Norm, Pixels};
use crate::error::Result;
use crate::forward::activation::Activation;
use crate::forward::backend::Backend;
use crate::forward::precision::Bf16Style;
use crate::forward::weights::Model;
use crate::{bad, bail};

/// `image_size` / `patch_size`: an int or a `[height, width]` pair in either schema.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(untagged)]
enum Side {
    One(usize),
    Pair([usize; 2]),
}

impl Side {
    fn square(self, field: &str) -> Result<usize> {
        match self {
            Side::One(n) | Side::Pair([n, _]) if self.is_square() && n > 0 => Ok(n),
            _ => Err(bad!(
                "vision_config.{field} {self:?}: only square sizes are supported"
            )),
        }
    }

    fn is_square(self) -> bool {
        match self {
            Side::One(_) => true,
            Side::Pair([h, w]) => h == w,
        }
    }
}

fn gelu() -> String {
    "gelu".into()
}
fn eps_1e6() -> f64 {
    1e-6
}
fn three() -> usize {
    3
}
fn yes() -> bool {
    true
}

/// The `vision_config` fields transformers' `InternVLVisionConfig` (`model_type: internvl`) and
/// OpenGVLab's `InternVisionConfig` (`internvl_chat`, `configuration_intern_vit.py`) spell alike.
#[derive(Debug, Deserialize)]
struct VisionConfig {
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    intermediate_size: usize,
    image_size: Side,
    patch_size: Side,
    #[serde(default = "three")]
    num_channels: usize,
    #[serde(default = "gelu")]
    hidden_act: String,
    /// Absent: `layer_norm` in transformers' schema, `rms_norm` in the remote one.
    norm_type: Option<String>,
    #[serde(default = "eps_1e6")]
    layer_norm_eps: f64,
}

/// The fields only transformers' `InternVLVisionConfig` has, with its defaults.
#[derive(Debug, Deserialize)]
struct HfVisionFields {
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    use_qk_norm: bool,
    #[serde(default = "yes")]
    use_absolute_position_embeddings: bool,
    #[serde(default = "yes")]
    use_mean_pooling: bool,
}

/// The fields only OpenGVLab's `InternVisionConfig` has, with its class defaults.
#[derive(Debug, Deserialize)]
struct RemoteVisionFields {
    #[serde(default)]
    qkv_bias: bool,
    #[serde(default = "yes")]
    qk_normalization: bool,
}

/// What the two layouts' configs say differently, in one vocabulary.
struct LayoutFields<'c> {
    norm_type: &'static str,
    qkv_bias: bool,
    qk_norm: bool,
    qk_eps: f32,
    position_embeddings: bool,
    final_norm: bool,
    /// The feature layer's index and the key it came from.
    feature_layer: (i64, &'static str),
    shuffle_transpose: bool,
    projector_act: &'c str,
}

/// Which checkpoint layout the tower's tensors follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// transformers' `InternVLForConditionalGeneration`.
    Hf,
    /// OpenGVLab's `InternVLChatModel`.
    Remote,
}

/// InternViT + pixel shuffle + projector, from a VLM's `config.json`.
#[derive(Debug, Clone)]
pub struct InternVl {
    layout: Layout,
    hidden: usize,
    heads: usize,
    intermediate: usize,
    /// Tile side in pixels (`image_size`), and the patch side (`patch_size`).
    image: usize,
    patch: usize,
    channels: usize,
    act: Activation,
    /// The layers' norms (`norm_type`, eps `layer_norm_eps`).
    norm: Norm,
    /// `layer_norm_eps`, the final LayerNorm's epsilon too.
    eps: f32,
    qkv_bias: bool,
    qk_norm: bool,
    /// The RMSNorm epsilon of q/k: transformers' `InternVLVisionRMSNorm` default 1e-6, the
    /// remote `InternRMSNorm` `layer_norm_eps`.
    qk_eps: f32,
    position_embeddings: bool,
    /// The LayerNorm after the last layer (transformers' `use_mean_pooling: false`).
    final_norm: bool,
    /// How many layers' outputs the features are taken after (`vision_feature_layer` /
    /// `select_layer`), and whether they are `last_hidden_state` (the literal -1).
    feature_depth: usize,
    last_hidden_state: bool,
    /// `1 / downsample_ratio`: the pixel shuffle folds k×k neighbours into one token.
    shuffle: usize,
    /// The remote `ps_version: v1` skips the shuffle's final transpose.
    shuffle_transpose: bool,
    projector_act: Activation,
    text_hidden: usize,
}

fn field<'v>(config: &'v Value, key: &str) -> Result<&'v Value> {
    config
        .get(key)
        .ok_or_else(|| bad!("config.json: `{key}` is missing (an InternVL config needs it)"))
}

fn activation(name: &str, key: &str) -> Result<Activation> {
    Activation::from_hf(name)
        .ok_or_else(|| bad!("config.json: {key} `{name}` is not a supported activation"))
}

fn norm(name: &str, eps: f32) -> Result<Norm> {
    match name {
        "layer_norm" => Ok(Norm::Layer(eps)),
        "rms_norm" => Ok(Norm::Rms(eps)),
        other => {
            bail!("config.json: vision_config.norm_type `{other}` is not layer_norm or rms_norm")
        }
    }
}

impl InternVl {
    /// The tower of `config` (`model_type` `internvl` or `internvl_chat`).
    pub fn from_config(config: &Value) -> Result<InternVl> {
        let layout = match config.get("model_type").and_then(Value::as_str) {
            Some("internvl_chat") => Layout::Remote,
            _ => Layout::Hf,
        };
        let vision = field(config, "vision_config")?;
        let parse = |e: serde_json::Error| bad!("config.json: vision_config: {e}");
        let v: VisionConfig = serde_json::from_value(vision.clone()).map_err(parse)?;
        let own = match layout {
            Layout::Remote => {
                let f: RemoteVisionFields =
                    serde_json::from_value(vision.clone()).map_err(parse)?;
                let select = config
                    .get("select_layer")
                    .and_then(Value::as_i64)
                    .unwrap_or(-1);
                let ps_version = config
                    .get("ps_version")
                    .and_then(Value::as_str)
                    .unwrap_or("v1");
                LayoutFields {
                    norm_type: "rms_norm",
                    qkv_bias: f.qkv_bias,
                    qk_norm: f.qk_normalization,
                    qk_eps: v.layer_norm_eps as f32,
                    position_embeddings: true,
                    final_norm: false,
                    feature_layer: (select, "select_layer"),
                    shuffle_transpose: ps_version != "v1",
                    // `mlp1` is `nn.GELU()` in modeling_internvl_chat.py.
                    projector_act: "gelu",
                }
            }
            Layout::Hf => {
                let f: HfVisionFields = serde_json::from_value(vision.clone()).map_err(parse)?;
                let layer = match config.get("vision_feature_layer") {
                    None => -1,
                    Some(l) => l.as_i64().ok_or_else(|| {
                        bad!("config.json: vision_feature_layer {l}: only one layer index is supported")
                    })?,
                };
                let strategy = config
                    .get("vision_feature_select_strategy")
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                // "full" keeps the class token, and get_image_features' square reshape of
                // 1 + patches tokens then fails in transformers too.
                if strategy != "default" {
                    bail!("config.json: vision_feature_select_strategy `{strategy}`: InternVL needs `default` (the class token dropped)");
                }
                LayoutFields {
                    norm_type: "layer_norm",
                    qkv_bias: f.attention_bias,
                    qk_norm: f.use_qk_norm,
                    qk_eps: 1e-6,
                    position_embeddings: f.use_absolute_position_embeddings,
                    final_norm: !f.use_mean_pooling,
                    feature_layer: (layer, "vision_feature_layer"),
                    shuffle_transpose: true,
                    projector_act: config
                        .get("projector_hidden_act")
                        .and_then(Value::as_str)
                        .unwrap_or("gelu"),
                }
            }
        };
        let eps = v.layer_norm_eps as f32;
        let (layer, layer_key) = own.feature_layer;
        let mut tower = InternVl {
            layout,
            hidden: v.hidden_size,
            heads: v.num_attention_heads,
            intermediate: v.intermediate_size,
            image: v.image_size.square("image_size")?,
            patch: v.patch_size.square("patch_size")?,
            channels: v.num_channels,
            act: activation(&v.hidden_act, "vision_config.hidden_act")?,
            norm: norm(v.norm_type.as_deref().unwrap_or(own.norm_type), eps)?,
            eps,
            qkv_bias: own.qkv_bias,
            qk_norm: own.qk_norm,
            qk_eps: own.qk_eps,
            position_embeddings: own.position_embeddings,
            final_norm: own.final_norm,
            feature_depth: feature_depth(layer, v.num_hidden_layers, layer_key)?,
            last_hidden_state: layer == -1,
            shuffle: 0,
            shuffle_transpose: own.shuffle_transpose,
            projector_act: activation(own.projector_act, "projector_hidden_act")?,
            text_hidden: 0,
        };
        let ratio = config
            .get("downsample_ratio")
            .and_then(Value::as_f64)
            .unwrap_or(0.5);
        let k = (1.0 / ratio).round();
        if !(k >= 1.0 && (1.0 / ratio - k).abs() < 1e-9) {
            bail!("config.json: downsample_ratio {ratio} is not 1/k for an integer k");
        }
        tower.shuffle = k as usize;
        let text = ["text_config", "llm_config"]
            .iter()
            .find_map(|key| config.get(*key))
            .unwrap_or(config);
        tower.text_hidden = text
            .get("hidden_size")
            .and_then(Value::as_u64)
            .ok_or_else(|| bad!("config.json: the language model's hidden_size is missing"))?
            as usize;
        tower.check()?;
        Ok(tower)
    }

    fn check(&self) -> Result<()> {
        if self.heads == 0 || !self.hidden.is_multiple_of(self.heads) {
            bail!(
                "config.json: vision_config.hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden,
                self.heads
            );
        }
        if !self.image.is_multiple_of(self.patch)
            || !(self.image / self.patch).is_multiple_of(self.shuffle)
        {
            bail!(
                "config.json: vision_config image_size {} / patch_size {} is not a grid the pixel shuffle by {} divides",
                self.image,
                self.patch,
                self.shuffle
            );
        }
        Ok(())
    }

    /// Patches per side of a tile.
    fn grid(&self) -> usize {
        self.image / self.patch
    }

    /// One tile of `pixel_values`: `[channels, image_size, image_size]`.
    pub fn tile_shape(&self) -> [usize; 3] {
        [self.channels, self.image, self.image]
    }

    /// Image tokens per tile after the pixel shuffle.
    fn tokens_per_tile(&self) -> usize {
        (self.grid() / self.shuffle).pow(2)
    }

    /// The tile counts of `pixels`, checked against its values' length.
    fn tiles<'p>(&self, pixels: &Pixels<'p>) -> Result<(&'p [f32], &'p [usize])> {
        let Pixels::Tiles {
            values,
            num_patches,
        } = *pixels
        else {
            bail!("InternVL pixel_values: expected tiles ([tiles, 3, H, W] and num_patches), got Qwen-VL patches");
        };
        // Checked: a sum or product that wraps could match the values' length by accident.
        let Some(tiles) = (num_patches.iter()).try_fold(0usize, |sum, &n| sum.checked_add(n))
        else {
            bail!("InternVL num_patches: the tile counts sum past 2⁶⁴");
        };
        let per_tile = self.channels * self.image * self.image;
        if tiles.checked_mul(per_tile) != Some(values.len()) {
            bail!(
                "InternVL pixel_values: {} values, expected {} tiles (num_patches {:?}) of {}×{}×{}",
                values.len(),
                tiles,
                num_patches,
                self.channels,
                self.image,
                self.image,
            );
        }
        Ok((values, num_patches))
    }

    /// Image tokens of each image: tiles × (image_size / patch)² × downsample_ratio².
    pub fn tokens_per_image(&self, pixels: &Pixels) -> Result<Vec<usize>> {
        let (_, num_patches) = self.tiles(pixels)?;
        Ok(num_patches
            .iter()
            .map(|n| n * self.tokens_per_tile())
            .collect())
    }

    /// `get_image_features`: the projected features of every image's tiles, in order.
    pub(super) fn encode<B: Backend>(&self, run: &mut Encoding<B>) -> Result<ImageFeatures> {
        let (be, model) = (run.be, run.model);
        let (values, _) = self.tiles(&run.pixels)?;
        let names = Names::resolve(self.layout, model)?;
        let (h, p, g) = (self.hidden, self.patch, self.grid());
        let patches = g * g;
        let tiles = values.len() / (self.channels * self.image * self.image);
        let seq = 1 + patches;
        let rows = tiles * seq;

        // InternVLVisionPatchEmbeddings: the stride-P convolution is one GEMM over the tiles'
        // patches, each gathered as a (channel, y, x) row to match the weight's [hidden, 3, P, P].
        let mut x = be.upload(patch_rows(values, self.channels, self.image, p))?;
        be.round(&mut x)?;
        let w = be.load(model, &names.patch_weight, &[h, self.channels, p, p])?;
        let mut x = be.linear(&x, tiles * patches, &w, h, self.channels * p * p)?;
        drop(w);
        be.add_bias(&mut x, &be.load(model, &names.patch_bias, &[h])?, h)?;
        be.round(&mut x)?;
        run.tap("vision.patch_embed".into(), &x)?;

        // InternVLVisionEmbeddings: the class token before each tile's patches, then the
        // position embeddings of 1 + patches rows. The stored table must be this tile grid's:
        // transformers' bicubic interpolation for other grids is not implemented.
        let cls = be.load(model, &names.cls, &[1, 1, h])?;
        let both = be.concat_rows(vec![cls, x])?;
        let index: Vec<u32> = (0..tiles)
            .flat_map(|t| {
                std::iter::once(0).chain((0..patches).map(move |i| (1 + t * patches + i) as u32))
            })
            .collect();
        let mut x = be.gather_rows(&both, h, &index)?;
        drop(both);
        if self.position_embeddings {
            let pos = be.load(model, &names.position, &[1, seq, h])?;
            let index: Vec<u32> = (0..rows).map(|r| (r % seq) as u32).collect();
            be.add_assign(&mut x, &be.gather_rows(&pos, h, &index)?)?;
        }
        run.tap("vision.embeddings".into(), &x)?;

        let segments: Vec<_> = (0..tiles).map(|t| t * seq..(t + 1) * seq).collect();
        for layer in 0..self.feature_depth {
            self.layer(be, model, &names, layer, &mut x, rows, &segments)?;
            run.tap(format!("vision.block.{layer}"), &x)?;
        }
        if self.final_norm && self.last_hidden_state {
            x = Norm::Layer(self.eps).apply(be, model, &names.final_norm, &x, h)?;
        }

        let index = shuffle_index(tiles, g, self.shuffle, self.shuffle_transpose);
        let x = be.gather_rows(&x, h, &index)?;
        let tokens = tiles * self.tokens_per_tile();
        let embeds = self
            .projector()
            .apply(be, model, &names.projector, &x, tokens)?;
        Ok(ImageFeatures {
            embeds: be.to_host(&embeds)?.into_owned(),
            tokens,
            deepstack: Vec::new(),
        })
    }

    /// q, k, v of one layer: separate projections (transformers) or the fused `attn.qkv`
    /// whose rows are q, k, v (remote).
    fn qkv<B: Backend>(
        &self,
        be: &B,
        model: &Model,
        prefix: &str,
        x: &B::Tensor,
        rows: usize,
    ) -> Result<[B::Tensor; 3]> {
        let h = self.hidden;
        match self.layout {
            Layout::Hf => {
                let proj = |n: &str| {
                    linear(
                        be,
                        model,
                        &format!("{prefix}.attention.{n}"),
                        x,
                        rows,
                        h,
                        h,
                        self.qkv_bias,
                    )
                };
                Ok([proj("q_proj")?, proj("k_proj")?, proj("v_proj")?])
            }
            Layout::Remote => {
                let name = format!("{prefix}.attn.qkv");
                fused_qkv(be, model, &name, x, rows, h, self.qkv_bias)
            }
        }
    }

    /// One `InternVLVisionLayer` on the residual `x`, its weights loaded here and dropped after.
    #[allow(clippy::too_many_arguments)]
    fn layer<B: Backend>(
        &self,
        be: &B,
        model: &Model,
        names: &Names,
        layer: usize,
        x: &mut B::Tensor,
        rows: usize,
        segments: &[std::ops::Range<usize>],
    ) -> Result<()> {
        let h = self.hidden;
        let hd = h / self.heads;
        let p = names.layer(layer);
        let remote = self.layout == Layout::Remote;
        let n = |hf: &str, rm: &str| format!("{p}.{}", if remote { rm } else { hf });

        let normed = self
            .norm
            .apply(be, model, &n("layernorm_before", "norm1"), x, h)?;
        let [mut q, mut k, v] = self.qkv(be, model, &p, &normed, rows)?;
        drop(normed);
        // QK-norm: one RMSNorm over all heads together (the 6B tower).
        if self.qk_norm {
            for (t, which) in [(&mut q, "q_norm"), (&mut k, "k_norm")] {
                let name = n(&format!("attention.{which}"), &format!("attn.{which}"));
                let w = be.load(model, &format!("{name}.weight"), &[h])?;
                be.rms_norm_rows(t, h, &w, self.qk_eps, Bf16Style::Llama)?;
            }
        }
        let context = segment_attention(be, [q, k, v], segments, self.heads, hd)?;
        let proj = n("attention.projection_layer", "attn.proj");
        let mut y = linear(be, model, &proj, &context, rows, h, h, true)?;
        drop(context);
        let ls = be.load(model, &n("lambda_1", "ls1"), &[h])?;
        be.scale_columns(&mut y, h, &ls)?;
        be.add_assign(x, &y)?;
        drop(y);

        let normed = self
            .norm
            .apply(be, model, &n("layernorm_after", "norm2"), x, h)?;
        let mut y = mlp(
            be,
            model,
            [&format!("{p}.mlp.fc1"), &format!("{p}.mlp.fc2")],
            normed,
            rows,
            [h, self.intermediate, h],
            self.act,
        )?;
        let ls = be.load(model, &n("lambda_2", "ls2"), &[h])?;
        be.scale_columns(&mut y, h, &ls)?;
        be.add_assign(x, &y)
    }

    /// `InternVLMultiModalProjector` / `mlp1`: LayerNorm → Linear → GELU → Linear, from the
    /// shuffled width to the text hidden size.
    fn projector(&self) -> Projector {
        let (width, text) = (self.hidden * self.shuffle * self.shuffle, self.text_hidden);
        Projector {
            names: match self.layout {
                Layout::Hf => ["layer_norm", "linear_1", "linear_2"],
                Layout::Remote => ["0", "1", "3"],
            },
            // nn.LayerNorm's default eps in both InternVLMultiModalProjector and mlp1.
            norm: Norm::Layer(1e-5),
            norm_width: width,
            widths: [width, text, text],
            act: self.projector_act,
        }
    }
}

/// The run of layers `vision_feature_layer` / `select_layer` selects: `hidden_states[i]` is the
/// output of `i` layers (0: the embeddings), negative indices count from the end.
fn feature_depth(index: i64, layers: usize, key: &str) -> Result<usize> {
    let depth = if index < 0 {
        layers as i64 + 1 + index
    } else {
        index
    };
    if !(0..=layers as i64).contains(&depth) {
        bail!("config.json: {key} {index} is out of range for {layers} vision layers");
    }
    Ok(depth as usize)
}

/// The rows of `[tiles · (1 + g²), hidden]` features that `get_image_features` passes on, in
/// order, `k²` consecutive rows making one `[k² · hidden]` token: the class token dropped, then
/// `pixel_shuffle` (modeling_internvl.py) as a row gather. Its view/permute/view/permute makes
/// token (w2, h2) of a tile the features [(k·w2 + a, k·h2 + b) for a, for b] side by side;
/// `transpose: false` (the remote `ps_version: v1`) skips the last permute.
fn shuffle_index(tiles: usize, g: usize, k: usize, transpose: bool) -> Vec<u32> {
    let (side, seq) = (g / k, 1 + g * g);
    (0..tiles)
        .flat_map(|t| {
            (0..side * side).flat_map(move |o| {
                let (w2, h2) = if transpose {
                    (o / side, o % side)
                } else {
                    (o % side, o / side)
                };
                (0..k * k).map(move |ab| {
                    let (a, b) = (ab / k, ab % k);
                    (t * seq + 1 + (k * w2 + a) * g + k * h2 + b) as u32
                })
            })
        })
        .collect()
}

/// The stored names of one checkpoint's tower and projector.
struct Names {
    layers: String,
    patch_weight: String,
    patch_bias: String,
    cls: String,
    position: String,
    final_norm: String,
    /// The projector's prefix; [`InternVl::projector`] names its layers.
    projector: String,
}

impl Names {
    /// The names of `layout`, under whichever prefix `model` stores them (transformers 5.23's
    /// legacy `vision_tower.` or the newer `model.vision_tower.`).
    fn resolve(layout: Layout, model: &Model) -> Result<Names> {
        Ok(match layout {
            Layout::Hf => {
                let cls = "vision_tower.embeddings.cls_token";
                let root =
                    if model.ckpt.contains(cls) || !model.ckpt.contains(&format!("model.{cls}")) {
                        ""
                    } else {
                        "model."
                    };
                let t = format!("{root}vision_tower");
                Names {
                    layers: format!("{t}.encoder.layer"),
                    patch_weight: format!("{t}.embeddings.patch_embeddings.projection.weight"),
                    patch_bias: format!("{t}.embeddings.patch_embeddings.projection.bias"),
                    cls: format!("{t}.embeddings.cls_token"),
                    position: format!("{t}.embeddings.position_embeddings"),
                    final_norm: format!("{t}.layernorm"),
                    projector: format!("{root}multi_modal_projector"),
                }
            }
            Layout::Remote => Names {
                layers: "vision_model.encoder.layers".into(),
                patch_weight: "vision_model.embeddings.patch_embedding.weight".into(),
                patch_bias: "vision_model.embeddings.patch_embedding.bias".into(),
                cls: "vision_model.embeddings.class_embedding".into(),
                position: "vision_model.embeddings.position_embedding".into(),
                final_norm: String::new(),
                projector: "mlp1".into(),
            },
        })
    }

    fn layer(&self, i: usize) -> String {
        format!("{}.{i}", self.layers)
    }
}

/// Every tile's P×P patches as rows `[tiles · patches, C·P·P]`, patches in row-major grid order
/// and each row in the conv weight's (channel, y, x) order.
fn patch_rows(values: &[f32], channels: usize, image: usize, p: usize) -> Vec<f32> {
    let g = image / p;
    let tiles = values.len() / (channels * image * image);
    let mut out = Vec::with_capacity(values.len());
    for t in 0..tiles {
        let tile = &values[t * channels * image * image..(t + 1) * channels * image * image];
        for py in 0..g {
            for px in 0..g {
                for c in 0..channels {
                    for ky in 0..p {
                        let start = c * image * image + (py * p + ky) * image + px * p;
                        out.extend_from_slice(&tile[start..start + p]);
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::super::goldens::{self, relative, Golden};
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::forward::backend::cpu::CpuBackend;
    use crate::forward::backend::cuda::host::HostDevice;
    use crate::forward::backend::cuda::CudaBackend;
    use crate::forward::precision::Precision;
    use crate::forward::vision::{Taps, Tower};

    /// The acceptance bound: max |Δ| over the reference tensor's largest magnitude.
    const TOL: f64 = 1e-4;
    /// `<IMG_CONTEXT>`, the image token id of the fixtures' vocabulary.
    const IMAGE_CONTEXT: i64 = 317;

    /// Every InternVL case of cases.json.
    fn cases() -> Vec<goldens::Case> {
        let found = goldens::cases(&["internvl", "internvl_qknorm", "internvl_remote"]);
        assert_eq!(found.len(), 5, "the InternVL cases of cases.json");
        found
    }

    fn open(dir: &Path) -> Checkpoint {
        Checkpoint::open_dir(dir, &dir.display().to_string()).unwrap()
    }

    fn run<B: Backend>(be: &B, dir: &Path, golden: &Golden) -> (ImageFeatures, Taps) {
        let ckpt = open(dir);
        let model = Model::new(&ckpt).unwrap();
        let tower = Tower::from_config(&ckpt.config).unwrap().unwrap();
        let values = golden.f32("pixel_values");
        let num_patches: Vec<usize> = golden
            .i64("num_patches")
            .iter()
            .map(|&n| n as usize)
            .collect();
        let pixels = Pixels::Tiles {
            values: &values,
            num_patches: &num_patches,
        };
        let mut taps = Taps::new();
        let features = tower.encode(be, &model, &pixels, Some(&mut taps)).unwrap();
        let tokens: usize = tower.tokens_per_image(&pixels).unwrap().iter().sum();
        assert_eq!(features.tokens, tokens);
        (features, taps)
    }

    #[test]
    fn every_internvl_case_matches_transformers_on_the_cpu_and_the_gpu_code_path() {
        let gpu = CudaBackend::new(HostDevice::default(), Precision::F32);
        let cpu = CpuBackend::new(Precision::F32);
        for goldens::Case {
            name,
            model: dir,
            golden,
        } in cases()
        {
            let (features, taps) = run(&cpu, &dir, &golden);
            let ids = golden.i64("input_ids");
            let expected = ids.iter().filter(|&&i| i == IMAGE_CONTEXT).count();
            assert_eq!(features.tokens, expected, "{name}: image tokens");
            let mut checked = vec![("image_embeds".to_string(), features.embeds.clone())];
            checked.extend(taps.iter().cloned());
            assert_eq!(
                checked.len(),
                6,
                "{name}: embeds, patch_embed, embeddings, 3 blocks"
            );
            for (tensor, ours) in &checked {
                let err = relative(ours, &golden.f32(tensor));
                eprintln!("{name} {tensor}: max |Δ| / max |golden| = {err:.2e}");
                assert!(
                    err <= TOL,
                    "{name} {tensor}: {err:.2e} > {TOL:.0e} relative to transformers"
                );
            }

            let (on_gpu, gpu_taps) = run(&gpu, &dir, &golden);
            let err = relative(&on_gpu.embeds, &features.embeds);
            eprintln!("{name} image_embeds, GPU code path vs CPU: {err:.2e}");
            assert!(
                err <= TOL,
                "{name} image_embeds: GPU code path {err:.2e} > {TOL:.0e} relative to the CPU"
            );
            assert_eq!(gpu_taps.len(), taps.len(), "{name}: taps on both backends");
            for ((tensor, g), (_, c)) in gpu_taps.iter().zip(&taps) {
                let err = relative(g, c);
                assert!(
                    err <= TOL,
                    "{name} {tensor}: GPU code path {err:.2e} > {TOL:.0e} relative to the CPU"
                );
            }
        }
    }

    #[test]
    fn the_pixel_shuffle_gather_is_transformers_reshape_and_transposes() {
        // Two tiles of a 4×4 grid (17 rows each, the class token first), ratio 0.5. Worked by
        // hand from pixel_shuffle in modeling_internvl.py: token (w2, h2) holds patches
        // (2w2, 2h2), (2w2, 2h2+1), (2w2+1, 2h2), (2w2+1, 2h2+1), patch (w, h) at row 1 + 4w + h.
        let tile = [
            [1, 2, 5, 6],
            [3, 4, 7, 8],
            [9, 10, 13, 14],
            [11, 12, 15, 16],
        ];
        let expected: Vec<u32> = [0u32, 17]
            .iter()
            .flat_map(|base| tile.iter().flatten().map(move |r| base + r))
            .collect();
        assert_eq!(shuffle_index(2, 4, 2, true), expected);
        // ps_version v1: tokens (h2, w2) in row-major order, each token's rows unchanged.
        let v1: Vec<u32> = [0usize, 2, 1, 3]
            .iter()
            .flat_map(|&o| tile[o].iter().copied())
            .collect();
        assert_eq!(shuffle_index(1, 4, 2, false), v1);
    }

    #[test]
    fn wrong_pixels_and_wrong_layouts_are_clear_errors() {
        let dir = goldens::root().join("tests/fixtures/vlm/internvl");
        let ckpt = open(&dir);
        let model = Model::new(&ckpt).unwrap();
        let tower = Tower::from_config(&ckpt.config).unwrap().unwrap();
        let cpu = CpuBackend::new(Precision::F32);
        // Two tiles promised, one 56×56 tile given.
        let values = vec![0.0; 3 * 56 * 56];
        let pixels = Pixels::Tiles {
            values: &values,
            num_patches: &[2],
        };
        let err = tower.tokens_per_image(&pixels).unwrap_err().to_string();
        assert!(
            err.contains("pixel_values") && err.contains("expected 2 tiles"),
            "{err}"
        );
        let err = tower
            .encode(&cpu, &model, &pixels, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("pixel_values"), "{err}");
        let patches = Pixels::Patches {
            values: &values,
            grid_thw: &[[1, 4, 4]],
        };
        let err = tower.tokens_per_image(&patches).unwrap_err().to_string();
        assert!(err.contains("expected tiles"), "{err}");

        // transformers' config over the remote layout's tensors: the missing one is named.
        let remote = open(&goldens::root().join("tests/fixtures/vlm/internvl_remote"));
        let remote_model = Model::new(&remote).unwrap();
        let pixels = Pixels::Tiles {
            values: &values,
            num_patches: &[1],
        };
        let err = tower
            .encode(&cpu, &remote_model, &pixels, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("vision_tower.embeddings.patch_embeddings.projection.weight")
                && err.contains("missing"),
            "{err}"
        );

        // A config whose tile grid disagrees with the stored tensors: the shape is named.
        let mut config = ckpt.config.clone();
        config["vision_config"]["image_size"] = serde_json::json!([84, 84]);
        let wide = Tower::from_config(&config).unwrap().unwrap();
        let values = vec![0.0; 3 * 84 * 84];
        let pixels = Pixels::Tiles {
            values: &values,
            num_patches: &[1],
        };
        let err = wide
            .encode(&cpu, &model, &pixels, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("vision_tower.embeddings.position_embeddings") && err.contains("shape"),
            "{err}"
        );
    }
}
