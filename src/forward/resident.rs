//! Weights held for a whole decode (`docs/commands/generate.md`, "Weights"): every decode step
//! visits every layer, so streaming them (`weights::stream`) would read the checkpoint once per
//! token. The decoder's matrices are held as the backend keeps them ([`Backend::store`]: on the
//! CPU their stored bytes, mapped and never decoded to f32); its vectors (norms, biases), a few
//! KiB a layer, are decoded once.

use std::collections::HashMap;

use super::backend::Backend;
use super::weights::Model;
use crate::bail;
use crate::error::Result;

/// The decoder's weights, by Hugging Face standard name, with their shapes.
pub struct Resident<'w, B: Backend> {
    matrices: HashMap<String, (Vec<usize>, B::Stored<'w>)>,
    vectors: HashMap<String, (Vec<usize>, B::Tensor)>,
}

impl<'w, B: Backend> Resident<'w, B> {
    /// Hold every decoder weight of `model`: the layers', the final norm and the LM head (the
    /// tied embedding when there is no `lm_head.weight`). Three-dimensional tensors (fused
    /// experts) are left to the decoder's own reading.
    pub fn load(backend: &B, model: &Model<'w>) -> Result<Resident<'w, B>> {
        let mut matrices = HashMap::new();
        let mut vectors = HashMap::new();
        for name in model.standard_names() {
            let decoder = name.starts_with("model.layers.")
                || name == "model.norm.weight"
                || name == "lm_head.weight"
                || (name == "model.embed_tokens.weight" && model.spec.tie_word_embeddings);
            if !decoder {
                continue;
            }
            let shape = model.info(&name)?.shape.clone();
            match shape.len() {
                1 => {
                    let values = backend.load(model, &name, &shape)?;
                    vectors.insert(name, (shape, values));
                }
                2 => {
                    let stored = backend.store(model, &name, &shape)?;
                    matrices.insert(name, (shape, stored));
                }
                _ => {}
            }
        }
        Ok(Resident { matrices, vectors })
    }

    /// The held matrix `name`, checked to have the `shape` the decoder expects; `None` when it
    /// is not held.
    pub fn matrix(
        &self,
        model: &Model,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<&B::Stored<'w>>> {
        match self.matrices.get(name) {
            Some((held, w)) => check(model, name, held, shape).map(|()| Some(w)),
            None => Ok(None),
        }
    }

    /// The held vector `name`, checked as [`Resident::matrix`] checks.
    pub fn vector(&self, model: &Model, name: &str, shape: &[usize]) -> Result<Option<&B::Tensor>> {
        match self.vectors.get(name) {
            Some((held, v)) => check(model, name, held, shape).map(|()| Some(v)),
            None => Ok(None),
        }
    }
}

fn check(model: &Model, name: &str, held: &[usize], expected: &[usize]) -> Result<()> {
    if held != expected {
        bail!(
            "{}: shape {held:?}, expected {expected:?} from config.json",
            model.describe(name)
        );
    }
    Ok(())
}
