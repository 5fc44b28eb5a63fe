//! One full forward pass of one prompt, its images included, keeping the activations `sinkmerge
//! trace` writes (`docs/commands/trace.md`): the library's `run_with_cache`. Names, shapes and
//! layouts are transformers' (batch dimensions dropped), so a file loads straight into Python.

use std::fmt;
use std::str::FromStr;

use super::backend::{Backend, HeadView};
use super::decoder::{AttentionOutput, State};
use super::memory;
use super::model::DecoderSpec;
use super::pass::{End, Hooks, Pass};
use super::vision::{ImageFeatures, Pixels, Tower};
use super::vlm;
use super::weights::Model;
use crate::bail;
use crate::checkpoint::header::{self, TensorInfo};
use crate::error::{Error, Result};

/// What `--capture` can keep. Per-layer kinds are kept for the `--layers` chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Capture {
    InputIds,
    PositionIds,
    PixelValues,
    ImageEmbeds,
    Logits,
    Attentions,
    Keys,
    Values,
    KeysPreRope,
    HiddenStates,
}

impl Capture {
    pub const ALL: [Capture; 10] = [
        Capture::InputIds,
        Capture::PositionIds,
        Capture::PixelValues,
        Capture::ImageEmbeds,
        Capture::Logits,
        Capture::Attentions,
        Capture::Keys,
        Capture::Values,
        Capture::KeysPreRope,
        Capture::HiddenStates,
    ];

    /// The tensor name (per-layer kinds: the prefix before `.L`).
    pub fn name(self) -> &'static str {
        match self {
            Capture::InputIds => "input_ids",
            Capture::PositionIds => "position_ids",
            Capture::PixelValues => "pixel_values",
            Capture::ImageEmbeds => "image_embeds",
            Capture::Logits => "logits",
            Capture::Attentions => "attentions",
            Capture::Keys => "keys",
            Capture::Values => "values",
            Capture::KeysPreRope => "keys_pre_rope",
            Capture::HiddenStates => "hidden_states",
        }
    }
}

impl fmt::Display for Capture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The `--capture` value: `all`, or a comma-separated list of [`Capture`] names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureSet(pub Vec<Capture>);

impl CaptureSet {
    pub fn has(&self, c: Capture) -> bool {
        self.0.contains(&c)
    }
}

impl FromStr for CaptureSet {
    type Err = Error;

    fn from_str(s: &str) -> Result<CaptureSet> {
        if s.trim() == "all" {
            return Ok(CaptureSet(Capture::ALL.to_vec()));
        }
        let mut kept = Vec::new();
        for item in s.split(',').map(str::trim) {
            let Some(&c) = Capture::ALL.iter().find(|c| c.name() == item) else {
                let names: Vec<&str> = Capture::ALL.iter().map(|c| c.name()).collect();
                bail!(
                    "--capture: `{item}` is not a capture; use all or a list of {}",
                    names.join(", ")
                );
            };
            if !kept.contains(&c) {
                kept.push(c);
            }
        }
        kept.sort();
        Ok(CaptureSet(kept))
    }
}

/// A prompt's images: the tower, the processor's pixels and their shape as the processor
/// returns it.
pub struct Images<'a> {
    pub tower: &'a Tower,
    pub pixels: Pixels<'a>,
    pub pixel_shape: Vec<usize>,
    /// The token whose rows the tower's output replaces.
    pub image_token: u32,
}

/// One prompt to run.
pub struct Prompt<'a> {
    pub ids: Vec<u32>,
    pub images: Option<Images<'a>>,
    /// The vision tower's merge size for M-RoPE families (`position_ids` are `[3, seq]`);
    /// `None`: plain positions `0..seq`.
    pub mrope_merge: Option<usize>,
}

/// A kept tensor's values.
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

/// One kept tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Kept {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Values,
}

impl Kept {
    fn f32(name: impl Into<String>, shape: Vec<usize>, values: Vec<f32>) -> Kept {
        Kept {
            name: name.into(),
            shape,
            values: Values::F32(values),
        }
    }

    fn i64(name: impl Into<String>, shape: Vec<usize>, values: Vec<i64>) -> Kept {
        Kept {
            name: name.into(),
            shape,
            values: Values::I64(values),
        }
    }
}

/// `[seq, heads · head_dim]` as `[heads, seq, head_dim]` (transformers' per-head layout).
pub fn heads_first(x: &[f32], seq: usize, heads: usize, head_dim: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for t in 0..seq {
        for h in 0..heads {
            let src = &x[(t * heads + h) * head_dim..(t * heads + h + 1) * head_dim];
            out[(h * seq + t) * head_dim..(h * seq + t + 1) * head_dim].copy_from_slice(src);
        }
    }
    out
}

/// A prompt's images through the tower: the rows they replace and what replaces them.
pub struct Encoded {
    /// The prompt's image-token rows, in order.
    pub rows: Vec<u32>,
    pub features: ImageFeatures,
    /// Each image's (t, h, w) patch grid (Qwen-VL families; empty for tiles).
    pub grids: Vec<[usize; 3]>,
}

/// Run the tower on `prompt`'s images (`None` for a text-only prompt). A forward pass that runs
/// several times over one prompt (an edit and its control) encodes the images once.
pub fn encode<B: Backend>(backend: &B, model: &Model, prompt: &Prompt) -> Result<Option<Encoded>> {
    let Some(images) = &prompt.images else {
        return Ok(None);
    };
    let rows = vlm::image_rows(&prompt.ids, images.image_token);
    let features = images.tower.encode(backend, model, &images.pixels, None)?;
    if features.tokens != rows.len() {
        bail!(
            "the prompt has {} image tokens but the images give {}",
            rows.len(),
            features.tokens
        );
    }
    let grids = match images.pixels {
        Pixels::Patches { grid_thw, .. } => grid_thw.to_vec(),
        Pixels::Tiles { .. } => Vec::new(),
    };
    Ok(Some(Encoded {
        rows,
        features,
        grids,
    }))
}

/// The prompt's position ids: M-RoPE's `[3, seq]` for M-RoPE families, else `None` (positions
/// `0..seq`).
pub fn positions(prompt: &Prompt, encoded: Option<&Encoded>) -> Result<Option<[Vec<i64>; 3]>> {
    let Some(merge) = prompt.mrope_merge else {
        return Ok(None);
    };
    let image_token = prompt.images.as_ref().map_or(u32::MAX, |i| i.image_token);
    let grids = encoded.map_or(&[][..], |e| &e.grids);
    vlm::mrope_positions(&prompt.ids, image_token, grids, merge).map(Some)
}

/// The pass of `prompt` from layer 0, ending as `end` says: the prompt embedded, its image rows
/// replaced by the tower's output, its M-RoPE positions set, and Qwen3-VL's deepstack rows added
/// after the early layers. Every pass over a VLM prompt (`trace`, `visual-sinks`) starts here.
pub fn start<'m, 'a, B: Backend>(
    backend: &'m B,
    model: &'m Model<'a>,
    prompt: &Prompt,
    encoded: Option<&'m Encoded>,
    end: End,
) -> Result<Pass<'m, 'a, B>> {
    let mut state = State::new(model, backend, std::slice::from_ref(&prompt.ids))?;
    place_images(&mut state, prompt, encoded)?;
    let mut pass = Pass::new(state, end);
    if let Some(e) = encoded {
        pass.add_after_layers(&e.rows, &e.features.deepstack);
    }
    Ok(pass)
}

/// Put `encoded`'s images into `state` (`prompt` embedded as its only sequence): the image rows
/// replaced by the tower's output, and the prompt's M-RoPE positions set. Returns the position
/// after the largest one set, where the tokens after the prompt continue (`None`: positions
/// `0..len`, so they continue at `len`).
pub fn place_images<B: Backend>(
    state: &mut State<'_, '_, B>,
    prompt: &Prompt,
    encoded: Option<&Encoded>,
) -> Result<Option<i64>> {
    let Some(e) = encoded else {
        return Ok(None);
    };
    let mut next = None;
    if let Some(p) = positions(prompt, encoded)? {
        next = Some(p.iter().flatten().max().map_or(0, |&v| v + 1));
        state.set_mrope_positions(0, p)?;
    }
    state.replace_rows(&e.rows, &e.features.embeds)?;
    Ok(next)
}

/// The bytes [`run`] then [`to_safetensors`] hold at their peak for a prompt of `seq` tokens,
/// keeping `capture` for `layers` decoder layers: the kept tensors, up to twice their size again
/// while the file's bytes are made from them, one layer's attention in flight, and the working
/// rows.
pub fn peak_bytes(spec: &DecoderSpec, seq: usize, capture: &CaptureSet, layers: usize) -> f64 {
    let (seq_f, layers_f) = (seq as f64, layers as f64);
    let rows = |width: usize| 4.0 * seq_f * width as f64;
    let mut kept = 0.0;
    if capture.has(Capture::Attentions) {
        kept += layers_f * spec.num_heads as f64 * memory::square_f32(seq);
    }
    for c in [Capture::Keys, Capture::Values, Capture::KeysPreRope] {
        if capture.has(c) {
            kept += layers_f * rows(spec.num_kv_heads * spec.head_dim);
        }
    }
    if capture.has(Capture::HiddenStates) {
        kept += (layers_f + 1.0) * rows(spec.hidden_size);
    }
    if capture.has(Capture::Logits) {
        kept += rows(spec.vocab_size);
    }
    let in_flight = memory::attention_scratch(spec, seq)
        + if capture.has(Capture::Attentions) {
            spec.num_heads as f64 * memory::square_f32(seq)
        } else {
            0.0
        };
    let working = rows(4 * spec.hidden_size + 3 * spec.intermediate_size) + rows(spec.vocab_size);
    3.0 * kept + in_flight + working
}

/// The tensors of `prompt`'s images that `capture` names: `pixel_values` with `image_grid_thw`
/// or `num_patches`, and `image_embeds` (none for a text-only prompt).
pub fn image_tensors(
    prompt: &Prompt,
    encoded: Option<&Encoded>,
    capture: &CaptureSet,
) -> Vec<Kept> {
    let mut kept = Vec::new();
    let hidden = encoded.map_or(0, |e| e.features.embeds.len() / e.features.tokens.max(1));
    if let (Some(images), Some(e)) = (&prompt.images, encoded) {
        if capture.has(Capture::PixelValues) {
            let (values, extra) = match images.pixels {
                Pixels::Patches { values, grid_thw } => {
                    let g = grid_thw.iter().flatten().map(|&v| v as i64).collect();
                    (
                        values,
                        Kept::i64("image_grid_thw", vec![grid_thw.len(), 3], g),
                    )
                }
                Pixels::Tiles {
                    values,
                    num_patches,
                } => {
                    let n = num_patches.iter().map(|&v| v as i64).collect();
                    (values, Kept::i64("num_patches", vec![num_patches.len()], n))
                }
            };
            kept.push(Kept::f32(
                "pixel_values",
                images.pixel_shape.clone(),
                values.to_vec(),
            ));
            kept.push(extra);
        }
        if capture.has(Capture::ImageEmbeds) {
            kept.push(Kept::f32(
                "image_embeds",
                vec![e.features.tokens, hidden],
                e.features.embeds.clone(),
            ));
        }
    }
    kept
}

/// What [`run`] keeps layer by layer, in the order `trace` lists it.
struct Recorder<'r, P> {
    capture: &'r CaptureSet,
    /// Whether each decoder layer is one of `--layers`, and whether its attention is kept.
    chosen: &'r [bool],
    keep_probs: &'r [bool],
    /// Tokens, query heads and hidden width.
    seq: usize,
    heads: usize,
    hidden: usize,
    kept: &'r mut Vec<Kept>,
    progress: P,
}

impl<P> Recorder<'_, P> {
    /// Whether `hidden_states.{l}` is kept: the input or the output of a chosen layer.
    fn hidden_wanted(&self, l: usize) -> bool {
        self.capture.has(Capture::HiddenStates)
            && (self.chosen.get(l).copied().unwrap_or(false) || (l > 0 && self.chosen[l - 1]))
    }
}

impl<B: Backend, P: FnMut(&str)> Hooks<B, Vec<f32>> for Recorder<'_, P> {
    fn before(&mut self, layer: usize, state: &State<'_, '_, B>) -> Result<()> {
        if layer == 0 && self.hidden_wanted(0) {
            let shape = vec![self.seq, self.hidden];
            self.kept
                .push(Kept::f32("hidden_states.0", shape, state.hidden()?));
        }
        (self.progress)(&format!("layer {layer}"));
        Ok(())
    }

    fn after(
        &mut self,
        layer: usize,
        out: &mut AttentionOutput<Vec<f32>>,
        state: &mut State<'_, '_, B>,
    ) -> Result<()> {
        let (seq, hidden) = (self.seq, self.hidden);
        if self.keep_probs[layer] {
            self.kept.push(Kept::f32(
                format!("attentions.{layer}"),
                vec![self.heads, seq, seq],
                out.heads.concat(),
            ));
        }
        let num_layers = self.chosen.len();
        if layer + 1 < num_layers && self.hidden_wanted(layer + 1) {
            let name = format!("hidden_states.{}", layer + 1);
            self.kept
                .push(Kept::f32(name, vec![seq, hidden], state.hidden()?));
        }
        Ok(())
    }
}

/// Run `prompt` through `model` on `backend` (the tower first when it has images) and keep what
/// `capture` names; per-layer kinds for `layers` (decoder layer indices). `hidden_states.L` is
/// the input of layer L and `hidden_states.{L+1}` its output, for each chosen L; the last one is
/// after the final norm, as transformers' `output_hidden_states`.
pub fn run<B: Backend>(
    backend: &B,
    model: &Model,
    prompt: &Prompt,
    capture: &CaptureSet,
    layers: &[usize],
    mut progress: impl FnMut(&str),
) -> Result<Vec<Kept>> {
    let spec = &model.spec;
    let seq = prompt.ids.len();
    let (nh, nkv, hd, hidden) = (
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.hidden_size,
    );
    let num_layers = spec.num_layers();
    let mut kept = Vec::new();
    if capture.has(Capture::InputIds) {
        let ids = prompt.ids.iter().map(|&i| i as i64).collect();
        kept.push(Kept::i64("input_ids", vec![seq], ids));
    }
    if prompt.images.is_some() {
        progress("vision tower");
    }
    let encoded = encode(backend, model, prompt)?;
    kept.extend(image_tensors(prompt, encoded.as_ref(), capture));
    if capture.has(Capture::PositionIds) {
        kept.push(match positions(prompt, encoded.as_ref())? {
            Some(p) => Kept::i64("position_ids", vec![3, seq], p.concat()),
            None => Kept::i64("position_ids", vec![seq], (0..seq as i64).collect()),
        });
    }
    let head = capture.has(Capture::Logits) || capture.has(Capture::HiddenStates);
    let end = if head { End::Logits } else { End::Layers };
    let mut pass = start(backend, model, prompt, encoded.as_ref(), end)?;
    let mut chosen = vec![false; num_layers];
    for &l in layers {
        chosen[l] = true;
    }
    let wants_kv = [Capture::Keys, Capture::Values, Capture::KeysPreRope]
        .iter()
        .any(|&c| capture.has(c));
    if wants_kv {
        pass.state_mut().capture_kv(chosen.clone());
    }
    let keep_probs: Vec<bool> = (chosen.iter())
        .map(|&c| c && capture.has(Capture::Attentions))
        .collect();
    let mut recorder = Recorder {
        capture,
        chosen: &chosen,
        keep_probs: &keep_probs,
        seq,
        heads: nh,
        hidden,
        kept: &mut kept,
        progress: &mut progress,
    };
    let probs = |layer: usize, h: &HeadView| {
        if keep_probs[layer] {
            h.probs.to_vec()
        } else {
            Vec::new()
        }
    };
    pass.run(&probs, &mut recorder)?;
    let want_last = recorder.hidden_wanted(num_layers);
    let state = pass.state_mut();
    for kv in state.take_kv() {
        let l = kv.layer;
        for (c, values) in [
            (Capture::KeysPreRope, kv.keys_pre_rope),
            (Capture::Keys, kv.keys),
            (Capture::Values, kv.values),
        ] {
            if capture.has(c) {
                kept.push(Kept::f32(
                    format!("{}.{l}", c.name()),
                    vec![nkv, seq, hd],
                    heads_first(&values, seq, nkv, hd),
                ));
            }
        }
    }
    if capture.has(Capture::Logits) || want_last {
        progress("logits");
        let (normed, logits) = state.final_hidden_and_logits()?;
        if want_last {
            let name = format!("hidden_states.{num_layers}");
            kept.push(Kept::f32(name, vec![seq, hidden], normed));
        }
        if capture.has(Capture::Logits) {
            let vocab = logits.len() / seq.max(1);
            kept.push(Kept::f32("logits", vec![seq, vocab], logits));
        }
    }
    Ok(kept)
}

/// The kept tensors as one safetensors file's bytes: laid out as the reference writer lays them
/// (the widest dtype first, then by name), under a header whose metadata keys are sorted, so that
/// the same trace gives the same bytes run after run.
pub fn to_safetensors(kept: &[Kept], metadata: Vec<(String, String)>) -> Result<Vec<u8>> {
    let dtype = |k: &Kept| match k.values {
        Values::F32(_) => safetensors::Dtype::F32,
        Values::I64(_) => safetensors::Dtype::I64,
    };
    let mut order: Vec<&Kept> = kept.iter().collect();
    order.sort_by(|a, b| dtype(b).cmp(&dtype(a)).then_with(|| a.name.cmp(&b.name)));
    let mut infos = Vec::with_capacity(order.len());
    let mut end = 0;
    for k in &order {
        let begin = end;
        end += match &k.values {
            Values::F32(v) => v.len() * 4,
            Values::I64(v) => v.len() * 8,
        };
        infos.push(TensorInfo {
            name: k.name.clone(),
            dtype: dtype(k),
            shape: k.shape.clone(),
            begin,
            end,
        });
    }
    let mut out = header::serialize(&infos, &metadata.into_iter().collect())?;
    out.reserve(end);
    for k in order {
        match &k.values {
            Values::F32(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
            Values::I64(v) => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::arch::config::RopeScaling;
    use crate::checkpoint::Checkpoint;
    use crate::forward::backend::cpu::CpuBackend;
    use crate::forward::backend::cuda::host::HostDevice;
    use crate::forward::backend::cuda::CudaBackend;
    use crate::forward::precision::Precision;
    use crate::forward::vision::goldens::{self, relative};
    use crate::forward::vlm::Placeholders;
    use crate::sink::tokenize::TextEncoder;

    /// The whole VLM forward (tower, image rows, M-RoPE, deepstack, decoder) through the CUDA
    /// backend's code path on the host stand-in, against the CPU backend, on every golden case.
    #[test]
    fn the_gpu_code_path_matches_the_cpu_on_every_vlm_case() {
        let cpu = CpuBackend::new(Precision::F32);
        let gpu = CudaBackend::new(HostDevice::default(), Precision::F32);
        let models = [
            "qwen2_vl",
            "qwen2_5_vl",
            "qwen3_vl",
            "qwen3_vl_moe",
            "internvl",
            "internvl_qknorm",
            "internvl_remote",
        ];
        for case in goldens::cases(&models) {
            let (name, golden) = (&case.name, &case.golden);
            let ids: Vec<u32> = golden.i64("input_ids").iter().map(|&i| i as u32).collect();
            let values = golden.f32("pixel_values");
            let grid_thw = if golden.has("image_grid_thw") {
                golden.grids()
            } else {
                Vec::new()
            };
            let num_patches: Vec<usize> = if golden.has("num_patches") {
                golden
                    .i64("num_patches")
                    .iter()
                    .map(|&n| n as usize)
                    .collect()
            } else {
                Vec::new()
            };
            let ckpt = Checkpoint::open_dir(&case.model, name).unwrap();
            let model = Model::new(&ckpt).unwrap();
            let tower = Tower::from_config(&ckpt.config).unwrap().unwrap();
            let (pixels, placeholders, shape) = if grid_thw.is_empty() {
                let p = Pixels::Tiles {
                    values: &values,
                    num_patches: &num_patches,
                };
                (p, Placeholders::InternVl, vec![values.len()])
            } else {
                let p = Pixels::Patches {
                    values: &values,
                    grid_thw: &grid_thw,
                };
                (p, Placeholders::Qwen, vec![values.len()])
            };
            let encoder = TextEncoder::load(Path::new(&case.model), false).unwrap();
            let mrope = matches!(model.spec.layers[0].rope.scaling, RopeScaling::Mrope { .. });
            let prompt = Prompt {
                ids,
                images: Some(Images {
                    tower: &tower,
                    pixels,
                    pixel_shape: shape,
                    image_token: encoder.token_id(placeholders.image_token()).unwrap(),
                }),
                // Every Qwen fixture merges 2×2 patches.
                mrope_merge: mrope.then_some(2),
            };
            let all = CaptureSet(Capture::ALL.to_vec());
            let layers: Vec<usize> = (0..model.spec.num_layers()).collect();
            let want = run(&cpu, &model, &prompt, &all, &layers, |_| ()).unwrap();
            let got = run(&gpu, &model, &prompt, &all, &layers, |_| ()).unwrap();
            assert_eq!(want.len(), got.len(), "{name}");
            for (w, g) in want.iter().zip(&got) {
                assert_eq!((&w.name, &w.shape), (&g.name, &g.shape), "{name}");
                match (&w.values, &g.values) {
                    (Values::I64(a), Values::I64(b)) => assert_eq!(a, b, "{name}: {}", w.name),
                    (Values::F32(a), Values::F32(b)) => {
                        let (bound, diff) = if w.name.starts_with("attentions.") {
                            let max = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                            (1e-5, max as f64)
                        } else {
                            (1e-4, relative(b, a))
                        };
                        assert!(
                            diff <= bound,
                            "{name}: {} differs by {diff:.2e} > {bound:.0e}",
                            w.name
                        );
                    }
                    _ => panic!("{name}: {} dtypes differ", w.name),
                }
            }
        }
    }
}
