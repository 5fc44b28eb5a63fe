//! The norm-then-MLP that takes a tower's merged rows to the language model's width, shared by
//! the Qwen-VL patch mergers (`PatchMerger`, `Qwen2_5_VLPatchMerger`,
//! `Qwen3VLVisionPatchMerger`) and InternVL's projector (`InternVLMultiModalProjector`, `mlp1`);
//! `docs/reference/vision.md`.

use super::{mlp, Norm};
use crate::error::Result;
use crate::forward::activation::Activation;
use crate::forward::backend::Backend;
use crate::forward::weights::Model;

/// `fc2(act(fc1(norm(x))))`, every linear with its bias.
#[derive(Debug, Clone, Copy)]
pub(super) struct Projector {
    /// The names of the norm, fc1 and fc2 under the projector's prefix.
    pub names: [&'static str; 3],
    pub norm: Norm,
    /// The width of the rows the norm reads: a patch row's, before merge² of them are read as
    /// one merged row (the Qwen-VL mergers), or the merged row's (Qwen3-VL's deepstack mergers,
    /// InternVL).
    pub norm_width: usize,
    /// fc1's input (the merged row), its output, and fc2's output.
    pub widths: [usize; 3],
    pub act: Activation,
}

impl Projector {
    /// The projector `prefix` over the `tokens` merged rows of `x`.
    pub fn apply<B: Backend>(
        &self,
        be: &B,
        model: &Model,
        prefix: &str,
        x: &B::Tensor,
        tokens: usize,
    ) -> Result<B::Tensor> {
        let [norm, fc1, fc2] = self.names.map(|name| format!("{prefix}.{name}"));
        let normed = self.norm.apply(be, model, &norm, x, self.norm_width)?;
        mlp(
            be,
            model,
            [&fc1, &fc2],
            normed,
            tokens,
            self.widths,
            self.act,
        )
    }
}
