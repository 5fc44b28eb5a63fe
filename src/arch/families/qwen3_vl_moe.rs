//! Qwen3-VL-MoE (Qwen/Qwen3-VL-30B-A3B, 235B-A22B; docs/reference/vlm-layouts.md#qwen3-vl-moe): the
//! Qwen3-VL prefixes, with each layer's experts fused into two un-suffixed tensors. They are
//! unfused into the per-expert `Qwen3MoeForCausalLM` tensors. The orientation is read from the
//! shapes against hidden size H and expert size I: the Hub stores `x @ W` ([E, H, 2I] and [E, I,
//! H]; slices need a transpose), transformers 5.x stores `W x` ([E, 2I, H] and [E, H, I]; slices
//! are contiguous). A square down_proj (H == I) takes its layer's gate_up_proj orientation; when
//! H == 2I the shapes cannot tell, and extraction refuses.
//! `norm_topk_prob: true` is written explicitly: the VLM always renormalises the top-k weights,
//! Qwen3MoeConfig defaults to false.

use serde_json::Value;

use super::plan::{ExtractPlan, OutTensor, Part, Piece, PlanBuilder};
use super::prefix::{self, main_dtype, route_all};
use super::qwen3_vl::LAYOUT;
use super::target::standalone_config;
use super::{model_type_and_arch, Family, Target};
use crate::arch::config::TextConfig;
use crate::arch::names::{self, Module};
use crate::bail;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

pub struct Qwen3VlMoe;

impl Family for Qwen3VlMoe {
    fn name(&self) -> &'static str {
        "qwen3-vl-moe"
    }

    fn help(&self) -> &'static str {
        "Qwen3-VL-MoE -> Qwen3MoeForCausalLM; fused experts unfused, Hub [E,H,2I]/[E,I,H] or 5.x [E,2I,H]/[E,H,I] by shape (refuses H == 2I)"
    }

    fn detect(&self, config: &Value, _: &[String]) -> bool {
        let (model_type, arch) = model_type_and_arch(config);
        model_type == "qwen3_vl_moe" || arch == "Qwen3VLMoeForConditionalGeneration"
    }

    fn plan(&self, ckpt: &Checkpoint) -> Result<ExtractPlan> {
        let (mut fields, key) = prefix::text_fields(&ckpt.config, None);
        fields.insert("norm_topk_prob".into(), Value::Bool(true));
        let tie = prefix::tie_flag(&ckpt.config, key)?;
        let text = TextConfig::from_text_section(&fields, &ckpt.config)?;
        let Some(moe) = text.moe.clone() else {
            bail!(
                "{}: config.json has no num_experts for a {} model",
                ckpt.label,
                self.name()
            );
        };
        let dims = Dims {
            experts: moe.num_experts,
            hidden: text.hidden_size,
            inter: moe.expert_intermediate_size,
        };
        let mut b = PlanBuilder::new(ckpt, self.name());
        route_all(&mut b, &LAYOUT, |b, stored, standard| {
            match names::parse(standard) {
                Some(n) if n.module == Module::FusedExpertsGateUp => unfuse_gate_up(
                    b,
                    stored,
                    n.layer.expect("fused experts are parsed under a layer"),
                    dims,
                )?,
                Some(n) if n.module == Module::FusedExpertsDown => unfuse_down(
                    b,
                    stored,
                    n.layer.expect("fused experts are parsed under a layer"),
                    dims,
                )?,
                _ => return Ok(false),
            }
            Ok(true)
        })?;
        let config = standalone_config(Target::Qwen3Moe, &fields, &ckpt.config, main_dtype(ckpt))?;
        b.finish(Target::Qwen3Moe, config, tie)
    }
}

#[derive(Clone, Copy)]
struct Dims {
    experts: usize,
    hidden: usize,
    inter: usize,
}

/// How a fused expert tensor is stored.
enum Orientation {
    /// transformers 5.x: `[E, rows, cols]` = `[E, out, in]`, slices contiguous.
    OutIn,
    /// Hub / 4.57: `[E, in, out]`, used as `x @ W`; slices transposed.
    InOut,
}

fn orientation(
    b: &PlanBuilder,
    stored: &str,
    out_in: [usize; 3],
    in_out: [usize; 3],
) -> Result<Orientation> {
    let shape = &b.ckpt().require(stored)?.shape;
    match (shape == &out_in, shape == &in_out) {
        (true, true) => bail!(
            "{}: shape {shape:?} reads both as [E, out, in] and as [E, in, out] (hidden_size equals the expert width); refusing to guess the expert layout",
            b.ckpt().describe(stored)
        ),
        (true, false) => Ok(Orientation::OutIn),
        (false, true) => Ok(Orientation::InOut),
        (false, false) => bail!(
            "{}: shape {shape:?} is neither {out_in:?} (transformers 5.x) nor {in_out:?} (Hub) for the config's experts, hidden_size and moe_intermediate_size",
            b.ckpt().describe(stored)
        ),
    }
}

fn expert_name(layer: usize, expert: usize, proj: &str) -> String {
    format!("model.layers.{layer}.mlp.experts.{expert}.{proj}.weight")
}

/// `gate_up_proj`: gate is the first I outputs, up the next I (`gate, up = chunk(2)`).
fn unfuse_gate_up(b: &mut PlanBuilder, stored: &str, layer: usize, d: Dims) -> Result<()> {
    let (e, h, i) = (d.experts, d.hidden, d.inter);
    let layout = orientation(b, stored, [e, 2 * i, h], [e, h, 2 * i])?;
    let dtype = b.ckpt().require(stored)?.dtype;
    for expert in 0..e {
        let base = expert * 2 * i * h;
        for (k, proj) in ["gate_proj", "up_proj"].into_iter().enumerate() {
            let piece = match layout {
                Orientation::OutIn => Piece::Range {
                    start: base + k * i * h,
                    len: i * h,
                },
                Orientation::InOut => Piece::Transposed {
                    start: base,
                    rows: h,
                    stride: 2 * i,
                    col: k * i,
                    cols: i,
                },
            };
            b.push(
                stored,
                OutTensor {
                    name: expert_name(layer, expert, proj),
                    dtype,
                    shape: vec![i, h],
                    parts: vec![Part {
                        source: stored.to_string(),
                        piece,
                    }],
                },
            )?;
        }
    }
    Ok(())
}

/// `down_proj`: one [H, I] matrix per expert.
fn unfuse_down(b: &mut PlanBuilder, stored: &str, layer: usize, d: Dims) -> Result<()> {
    let (e, h, i) = (d.experts, d.hidden, d.inter);
    let layout = if h == i {
        // A square down_proj cannot tell; the same save wrote the layer's gate_up_proj, whose
        // [E, 2I, H] and [E, H, 2I] differ whenever H != 2I.
        let gate_up = stored.replace("down_proj", "gate_up_proj");
        orientation(b, &gate_up, [e, 2 * i, h], [e, h, 2 * i])?
    } else {
        orientation(b, stored, [e, h, i], [e, i, h])?
    };
    let dtype = b.ckpt().require(stored)?.dtype;
    for expert in 0..e {
        let base = expert * h * i;
        let piece = match layout {
            Orientation::OutIn => Piece::Range {
                start: base,
                len: h * i,
            },
            Orientation::InOut => Piece::Transposed {
                start: base,
                rows: i,
                stride: h,
                col: 0,
                cols: h,
            },
        };
        b.push(
            stored,
            OutTensor {
                name: expert_name(layer, expert, "down_proj"),
                dtype,
                shape: vec![h, i],
                parts: vec![Part {
                    source: stored.to_string(),
                    piece,
                }],
            },
        )?;
    }
    Ok(())
}
