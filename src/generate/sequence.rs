//! One sequence being decoded (`docs/commands/generate.md`, "The KV cache"): its prompt run once
//! into a KV cache (the prefill, images included), then the tokens after it, each step a pass
//! of the new rows over the cached ones. Weights are held for the whole decode ([`Resident`]).

use crate::arch::config::RopeScaling;
use crate::error::Result;
use crate::forward::backend::{Backend, HeadView};
use crate::forward::cache::KvCache;
use crate::forward::capture::{self, Encoded, Prompt};
use crate::forward::decoder::{KeyEdit, State};
use crate::forward::pass::{End, Hooks, Pass};
use crate::forward::resident::Resident;
use crate::forward::vlm;
use crate::forward::weights::Model;
use crate::{bad, bail};

/// Which logits a pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// The next token's: `[vocab]`.
    Last,
    /// Every new row's: `[rows, vocab]` (teacher forcing).
    All,
}

/// Where a pass's layers read their weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Weights {
    /// Streamed with the read-ahead (a prompt's pass).
    Streamed,
    /// Held for the decode (its steps).
    Held,
}

/// A sequence's tokens so far and their keys and values.
pub struct Sequence<'m, 'a, B: Backend> {
    model: &'m Model<'a>,
    backend: &'m B,
    weights: &'m Resident<'a, B>,
    /// Taken by the pass running now, and handed back when it ends.
    cache: Option<KvCache<B::Tensor>>,
    ids: Vec<u32>,
    /// M-RoPE after images (transformers' `rope_deltas`): a text token at sequence index `i`
    /// sits at position `i + delta` on every axis.
    rope_delta: i64,
    /// Every image's (t, h, w) grid so far (M-RoPE families): a later chunk's positions are
    /// `get_rope_index`'s over the whole sequence.
    grids: Vec<[usize; 3]>,
    edit: Option<&'m dyn KeyEdit>,
}

impl<'m, 'a, B: Backend> Sequence<'m, 'a, B> {
    /// An empty sequence with room for `capacity` tokens; `edit` edits the prompt's keys.
    pub fn new(
        model: &'m Model<'a>,
        backend: &'m B,
        weights: &'m Resident<'a, B>,
        capacity: usize,
        edit: Option<&'m dyn KeyEdit>,
    ) -> Result<Sequence<'m, 'a, B>> {
        let max = model.spec.max_position_embeddings;
        // Dynamic NTK scaling exists to run past the trained length (its frequencies follow
        // the sequence); every other rope is refused there, as positions it never saw.
        let dynamic = (model.spec.layers.iter())
            .all(|l| matches!(l.rope.scaling, RopeScaling::Dynamic { .. }));
        if capacity > max && !dynamic {
            bail!(
                "{capacity} tokens (the prompt and every new token) exceed the model's \
                 max_position_embeddings {max} ({})",
                model.ckpt.dir.join("config.json").display()
            );
        }
        Ok(Sequence {
            model,
            backend,
            weights,
            cache: Some(KvCache::new(backend, &model.spec, capacity)?),
            ids: Vec::new(),
            rope_delta: 0,
            grids: Vec::new(),
            edit,
        })
    }

    /// [`Sequence::new`] with `prompt` (its images through `encoded`) prefilled, and the logits
    /// of the token after it.
    #[allow(clippy::too_many_arguments)]
    pub fn prefilled(
        model: &'m Model<'a>,
        backend: &'m B,
        weights: &'m Resident<'a, B>,
        prompt: &Prompt,
        encoded: Option<&'m Encoded>,
        capacity: usize,
        edit: Option<&'m dyn KeyEdit>,
    ) -> Result<(Sequence<'m, 'a, B>, Vec<f32>)> {
        let mut seq = Sequence::new(model, backend, weights, capacity, edit)?;
        let logits = seq.prefill(
            prompt,
            encoded,
            &|_, _: &HeadView| (),
            &mut (),
            Logits::Last,
        )?;
        Ok((seq, logits))
    }

    /// The tokens so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The model decoded.
    pub fn model(&self) -> &'m Model<'a> {
        self.model
    }

    /// Run `prompt` (its images through `encoded`, from [`capture::encode`]) as the sequence's
    /// first tokens: every `visit(layer, head)` and hook as in any pass; the logits `which` says.
    pub fn prefill<R: Send>(
        &mut self,
        prompt: &Prompt,
        encoded: Option<&'m Encoded>,
        visit: &(impl Fn(usize, &HeadView) -> R + Sync),
        hooks: &mut impl Hooks<B, R>,
        which: Logits,
    ) -> Result<Vec<f32>> {
        if !self.ids.is_empty() {
            bail!("the sequence already has its prompt");
        }
        // The prompt's layers stream their weights with the read-ahead, as `score`'s pass does
        // (a prompt is a GEMM per weight, whose decoding the read-ahead overlaps); its next
        // token's logits come from the held head.
        let ids = std::slice::from_ref(&prompt.ids);
        let mut state = State::new(self.model, self.backend, ids)?;
        if let Some(next) = capture::place_images(&mut state, prompt, encoded)? {
            self.rope_delta = next - prompt.ids.len() as i64;
        }
        let deepstack = encoded.map(|e| (&e.rows[..], &e.features.deepstack[..]));
        let logits = self.run(state, deepstack, visit, hooks, which, Weights::Streamed)?;
        self.ids.extend_from_slice(&prompt.ids);
        self.grids = encoded.map(|e| e.grids.clone()).unwrap_or_default();
        Ok(logits)
    }

    /// Run `chunk` (tokens with images, their placeholders expanded; `encoded` its images
    /// through the tower, [`capture::encode`] of `chunk`) after the sequence so far: an image in
    /// the middle of a sequence (the re-look). Its image rows take the tower's output, and its
    /// M-RoPE positions are those `get_rope_index` gives the whole sequence, every earlier image
    /// included; later tokens continue after them.
    pub fn insert<R: Send>(
        &mut self,
        chunk: &Prompt,
        encoded: Option<&'m Encoded>,
        visit: &(impl Fn(usize, &HeadView) -> R + Sync),
        hooks: &mut impl Hooks<B, R>,
        which: Logits,
    ) -> Result<Vec<f32>> {
        if self.ids.is_empty() {
            bail!("a sequence starts with its prompt's prefill");
        }
        let ids = std::slice::from_ref(&chunk.ids);
        let mut state = State::with_weights(self.model, self.backend, ids, self.weights)?;
        let mut grids = self.grids.clone();
        if let Some(e) = encoded {
            state.replace_rows(&e.rows, &e.features.embeds)?;
            grids.extend_from_slice(&e.grids);
        }
        let (start, len) = (self.ids.len(), chunk.ids.len());
        if let (Some(merge), Some(images)) = (chunk.mrope_merge, &chunk.images) {
            let mut all = self.ids.clone();
            all.extend_from_slice(&chunk.ids);
            let positions = vlm::mrope_positions(&all, images.image_token, &grids, merge)?;
            let next = positions.iter().flatten().max().map_or(0, |&p| p + 1);
            state.set_mrope_positions(0, positions.map(|axis| axis[start..].to_vec()))?;
            self.rope_delta = next - (start + len) as i64;
        } else {
            self.continue_positions(&mut state, len)?;
        }
        let deepstack = encoded.map(|e| (&e.rows[..], &e.features.deepstack[..]));
        let logits = self.run(state, deepstack, visit, hooks, which, Weights::Held)?;
        self.ids.extend_from_slice(&chunk.ids);
        self.grids = grids;
        Ok(logits)
    }

    /// Run `tokens` (text) after the sequence so far.
    pub fn feed<R: Send>(
        &mut self,
        tokens: &[u32],
        visit: &(impl Fn(usize, &HeadView) -> R + Sync),
        hooks: &mut impl Hooks<B, R>,
        which: Logits,
    ) -> Result<Vec<f32>> {
        if self.ids.is_empty() {
            bail!("a sequence starts with its prompt's prefill");
        }
        let ids = [tokens.to_vec()];
        let mut state = State::with_weights(self.model, self.backend, &ids, self.weights)?;
        self.continue_positions(&mut state, tokens.len())?;
        let logits = self.run(state, None, visit, hooks, which, Weights::Held)?;
        self.ids.extend_from_slice(tokens);
        Ok(logits)
    }

    /// Give `state`'s `len` text rows, after the sequence so far, their M-RoPE positions: every
    /// axis at index + `rope_delta` (with no delta, the cache's offset gives them already).
    fn continue_positions(&self, state: &mut State<'m, 'a, B>, len: usize) -> Result<()> {
        if self.rope_delta == 0 {
            return Ok(());
        }
        let first = self.ids.len() as i64 + self.rope_delta;
        let positions: Vec<i64> = (first..first + len as i64).collect();
        state.set_mrope_positions(0, [positions.clone(), positions.clone(), positions])
    }

    /// [`Sequence::feed`] of one token, keeping nothing: a plain decode step.
    pub fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        self.feed(&[token], &|_, _: &HeadView| (), &mut (), Logits::Last)
    }

    fn run<R: Send>(
        &mut self,
        mut state: State<'m, 'a, B>,
        deepstack: Option<(&'m [u32], &'m [Vec<f32>])>,
        visit: &(impl Fn(usize, &HeadView) -> R + Sync),
        hooks: &mut impl Hooks<B, R>,
        which: Logits,
        weights: Weights,
    ) -> Result<Vec<f32>> {
        let cache = self
            .cache
            .take()
            .ok_or_else(|| bad!("an earlier step of this sequence failed"))?;
        state.attach_cache(cache)?;
        if let Some(edit) = self.edit {
            state.set_key_edit(edit);
        }
        hooks.begin(&mut state)?;
        let mut pass = match weights {
            Weights::Streamed => Pass::new(state, End::Layers),
            Weights::Held => Pass::held(state, End::Logits),
        };
        if let Some((rows, features)) = deepstack {
            pass.add_after_layers(rows, features);
        }
        pass.run(visit, hooks)?;
        pass.state_mut().use_weights(self.weights);
        hooks.end(pass.state_mut())?;
        let logits = match which {
            Logits::Last => pass.state().last_logits()?,
            Logits::All => pass.state().logits()?,
        };
        self.cache = pass.state_mut().take_cache();
        Ok(logits)
    }
}
