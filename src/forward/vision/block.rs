//! The pre-norm vision block with one fused `attn.qkv` projection, shared by the Qwen2-VL,
//! Qwen2.5-VL and Qwen3-VL towers (`docs/reference/vision.md`: `Qwen2VLVisionBlock`,
//! `Qwen2_5_VLVisionBlock`, `Qwen3VLVisionBlock`); what differs between them is a field of
//! [`FusedQkvBlock`]. The fused projection alone, [`fused_qkv`], also serves InternVL's remote
//! layout.

use std::ops::Range;

use super::{linear, mlp, segment_attention, Norm};
use crate::error::Result;
use crate::forward::activation::Activation;
use crate::forward::backend::{Backend, RopeTable};
use crate::forward::precision::Bf16Style;
use crate::forward::weights::Model;

/// The MLP half of a [`FusedQkvBlock`].
#[derive(Debug, Clone, Copy)]
pub(super) enum Ffn {
    /// `fc2(act(fc1(x)))`, the two linears' names under the block's prefix.
    Plain {
        fc1: &'static str,
        fc2: &'static str,
    },
    /// Qwen2.5-VL's `mlp.down_proj(act(mlp.gate_proj(x)) · mlp.up_proj(x))`.
    Gated,
}

/// One block in place: `x += attn.proj(attention(rope(qkv(norm1(x)))))`, then
/// `x += mlp(norm2(x))`, every linear with its bias.
#[derive(Debug, Clone, Copy)]
pub(super) struct FusedQkvBlock {
    pub width: usize,
    pub heads: usize,
    pub intermediate: usize,
    /// `norm1` and `norm2`.
    pub norm: Norm,
    pub ffn: Ffn,
    pub act: Activation,
    /// How `apply_rotary_pos_emb_vision` rounds in bf16: Qwen2-VL's rounds each step (Llama's
    /// style), Qwen3-VL's rotates on f32 cos/sin and rounds once (Olmo's).
    pub rope: Bf16Style,
}

impl FusedQkvBlock {
    /// Block `p` on the residual `x` (`rows` rows), attention within each of `segments`, each
    /// row rotated by its own angles of `table`; weights loaded here and dropped after use.
    #[allow(clippy::too_many_arguments)]
    pub fn apply<B: Backend>(
        &self,
        be: &B,
        model: &Model,
        p: &str,
        x: &mut B::Tensor,
        rows: usize,
        segments: &[Range<usize>],
        table: &RopeTable,
    ) -> Result<()> {
        let (width, heads) = (self.width, self.heads);
        let hd = width / heads;
        let name = |part: &str| format!("{p}.{part}");
        let normed = self.norm.apply(be, model, &name("norm1"), x, width)?;
        let [mut q, mut k, v] =
            fused_qkv(be, model, &name("attn.qkv"), &normed, rows, width, true)?;
        drop(normed);

        // Rotate-half with each row's own angles.
        let all = [(0..rows, table)];
        be.rope(&mut q, width, hd, &all, self.rope)?;
        be.rope(&mut k, width, hd, &all, self.rope)?;
        let ctx = segment_attention(be, [q, k, v], segments, heads, hd)?;
        let proj = name("attn.proj");
        let o = linear(be, model, &proj, &ctx, rows, width, width, true)?;
        drop(ctx);
        be.add_assign(x, &o)?;
        drop(o);

        let h = self.norm.apply(be, model, &name("norm2"), x, width)?;
        let inter = self.intermediate;
        let y = match self.ffn {
            Ffn::Plain { fc1, fc2 } => {
                let (fc1, fc2) = (name(fc1), name(fc2));
                mlp(
                    be,
                    model,
                    [&fc1, &fc2],
                    h,
                    rows,
                    [width, inter, width],
                    self.act,
                )?
            }
            Ffn::Gated => {
                let gated = |part: &str, x: &B::Tensor, out: usize, inp: usize| {
                    linear(be, model, &name(part), x, rows, out, inp, true)
                };
                let mut gate = gated("mlp.gate_proj", &h, inter, width)?;
                let up = gated("mlp.up_proj", &h, inter, width)?;
                drop(h);
                be.act_mul(&mut gate, &up, self.act)?;
                drop(up);
                gated("mlp.down_proj", &gate, width, inter)?
            }
        };
        be.add_assign(x, &y)
    }
}

/// q, k and v of the fused linear `{prefix}` over `rows` rows of `width`: its weight
/// `[3·width, width]` and (when `bias`) its bias `[3·width]` hold q's rows, then k's, then v's.
/// Each is its own GEMM, rounded once after its bias.
pub(super) fn fused_qkv<B: Backend>(
    be: &B,
    model: &Model,
    prefix: &str,
    x: &B::Tensor,
    rows: usize,
    width: usize,
    bias: bool,
) -> Result<[B::Tensor; 3]> {
    let w = be.load(model, &format!("{prefix}.weight"), &[3 * width, width])?;
    let b = match bias {
        true => Some(be.load(model, &format!("{prefix}.bias"), &[3 * width])?),
        false => None,
    };
    let part = |i: usize| -> Result<B::Tensor> {
        let wi = be.slice_rows(&w, width, i * width..(i + 1) * width)?;
        let mut y = be.linear(x, rows, &wi, width, width)?;
        if let Some(b) = &b {
            be.add_bias(&mut y, &be.slice_rows(b, width, i..i + 1)?, width)?;
        }
        be.round(&mut y)?;
        Ok(y)
    };
    Ok([part(0)?, part(1)?, part(2)?])
}
