//! The one loop over a decoder's layers, which every forward pass runs: `score` and `heads`
//! (several models in [`Lockstep`]), `parity` ([`record_all_on`]), the text loss ([`to_logits`]),
//! `trace` ([`crate::forward::capture::run`]) and `visual-sinks`.
//!
//! A [`Pass`] runs one model's [`State`] a layer at a time ([`Pass::layer`], or [`Pass::run`] for
//! every layer left), its weights read ahead in the order it runs them ([`stream`]). A driver's
//! [`Hooks`] see each layer's input and output; its visitor, given the layer, decides what each
//! head gives. Qwen3-VL's deepstack rows are added after the early layers' outputs
//! ([`Pass::add_after_layers`]). The pass ends as its [`End`] says: at the last layer's attention
//! scores, or after every layer in full, before the final norm and LM head.

use super::backend::cpu::CpuBackend;
use super::backend::{Backend, HeadView, Visitor};
use super::decoder::{AttentionOutput, State};
use super::weights::{stream, Block, Model, Step, Streaming};
use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// Where a pass ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// At the last layer's attention scores (`score`): its values, output projection and MLP
    /// change no attention, so they are neither read nor run.
    Scores,
    /// After every layer in full; the final norm and LM head are not read ahead.
    Layers,
    /// After every layer in full, with the final norm and LM head read ahead for the caller's
    /// [`State::logits`] (or [`State::last_logits`], [`State::final_hidden_and_logits`]).
    Logits,
}

/// The blocks the passes of `models` run, in the order they run them: layer by layer, in each
/// layer the models in `order`, then each model's head when the passes end in logits.
fn plan(models: &[&Model], order: &[usize], end: End) -> Vec<Step> {
    let layers = models
        .iter()
        .map(|m| m.spec.num_layers())
        .max()
        .unwrap_or(0);
    let mut steps = Vec::new();
    for layer in 0..layers {
        for &model in order {
            let num_layers = models[model].spec.num_layers();
            if layer >= num_layers {
                continue;
            }
            let scores_only = end == End::Scores && layer + 1 == num_layers;
            steps.push(Step {
                model,
                layer,
                block: Block::Attention {
                    update_residual: !scores_only,
                },
            });
            if !scores_only {
                steps.push(Step {
                    model,
                    layer,
                    block: Block::Mlp,
                });
            }
        }
    }
    if end == End::Logits {
        for &model in order {
            steps.push(Step {
                model,
                layer: 0,
                block: Block::Head,
            });
        }
    }
    steps
}

/// What a driver does around each layer of a [`Pass`]; `()` does nothing.
pub trait Hooks<B: Backend, R> {
    /// Before `layer` runs: `state` holds its input (transformers' `hidden_states[layer]`).
    fn before(&mut self, _layer: usize, _state: &State<'_, '_, B>) -> Result<()> {
        Ok(())
    }

    /// After `layer` ran: `out` holds what the visitor gave for each head; `state` holds the
    /// layer's output (`hidden_states[layer + 1]`, before any deepstack rows are added, as
    /// transformers records it), and its kept keys and values.
    fn after(
        &mut self,
        _layer: usize,
        _out: &mut AttentionOutput<R>,
        _state: &mut State<'_, '_, B>,
    ) -> Result<()> {
        Ok(())
    }

    /// Before a decode's pass (a [`crate::generate::sequence::Sequence`]'s prefill or step)
    /// runs its first layer, its state embedded and its cache attached: the place to ask for its
    /// keys and values ([`State::capture_kv`]). A plain [`Pass`] does not call it.
    fn begin(&mut self, _state: &mut State<'_, '_, B>) -> Result<()> {
        Ok(())
    }

    /// After a decode's pass ran its last layer, before its logits are read and its cache is
    /// handed back. A plain [`Pass`] does not call it.
    fn end(&mut self, _state: &mut State<'_, '_, B>) -> Result<()> {
        Ok(())
    }
}

impl<B: Backend, R> Hooks<B, R> for () {}

/// One model's forward pass, a layer at a time.
pub struct Pass<'m, 'a, B: Backend> {
    state: State<'m, 'a, B>,
    end: End,
    /// The layer [`Pass::layer`] runs next.
    next: usize,
    /// Qwen3-VL's deepstack: the image rows, and what is added to them after layer i (the i-th).
    deepstack: Option<(&'m [u32], &'m [Vec<f32>])>,
    /// Reading ahead while the pass lives; `None` in a [`Lockstep`], which reads for every model.
    _reading: Option<Streaming<'m, 'a>>,
}

impl<'m, 'a, B: Backend> Pass<'m, 'a, B> {
    /// A pass of `state` (embedded, its rows and positions set) from layer 0.
    pub fn new(state: State<'m, 'a, B>, end: End) -> Pass<'m, 'a, B> {
        let model = state.model();
        let reading = stream(&[model], &plan(&[model], &[0], end));
        Pass {
            state,
            end,
            next: 0,
            deepstack: None,
            _reading: Some(reading),
        }
    }

    /// A pass of `state` whose weights are held for a decode ([`State::with_weights`]): nothing
    /// is read ahead.
    pub fn held(state: State<'m, 'a, B>, end: End) -> Pass<'m, 'a, B> {
        Pass {
            state,
            end,
            next: 0,
            deepstack: None,
            _reading: None,
        }
    }

    /// Add `deepstack[i]` to the hidden states of the packed `rows` after layer `i`
    /// (`_deepstack_process`), once the layer's output is handed to the hooks.
    pub fn add_after_layers(&mut self, rows: &'m [u32], deepstack: &'m [Vec<f32>]) {
        self.deepstack = Some((rows, deepstack));
    }

    /// The decoder state between layers.
    pub fn state(&self) -> &State<'m, 'a, B> {
        &self.state
    }

    pub fn state_mut(&mut self) -> &mut State<'m, 'a, B> {
        &mut self.state
    }

    /// The model's layer count.
    pub fn layers(&self) -> usize {
        self.state.model().spec.num_layers()
    }

    /// Run the next layer: its attention with `visit` on every head, then (unless the pass ends at
    /// this layer's scores) its MLP, the hooks around it, and any deepstack rows after it.
    pub fn layer<R: Send>(
        &mut self,
        visit: &Visitor<R>,
        hooks: &mut impl Hooks<B, R>,
    ) -> Result<AttentionOutput<R>> {
        let layer = self.next;
        let scores_only = self.end == End::Scores && layer + 1 == self.layers();
        hooks.before(layer, &self.state)?;
        let mut out = self.state.attention(layer, visit, !scores_only)?;
        if !scores_only {
            self.state.mlp(layer)?;
        }
        hooks.after(layer, &mut out, &mut self.state)?;
        if let Some((rows, deepstack)) = self.deepstack {
            if let Some(features) = deepstack.get(layer) {
                self.state.add_rows(rows, features.clone())?;
            }
        }
        self.next += 1;
        Ok(out)
    }

    /// Run every layer left, `visit(layer, head)` visiting each head of each layer.
    pub fn run<R: Send>(
        &mut self,
        visit: &(impl Fn(usize, &HeadView) -> R + Sync),
        hooks: &mut impl Hooks<B, R>,
    ) -> Result<()> {
        for layer in self.next..self.layers() {
            self.layer(&|head: &HeadView| visit(layer, head), hooks)?;
        }
        Ok(())
    }
}

/// Several models' passes run together, layer by layer in a fixed order, their weights read ahead
/// as one plan (`score`: the reference first in every layer, so its scores are there for its
/// targets, and no model holds more than one layer's weights and attention).
pub struct Lockstep<'m, 'a, B: Backend> {
    passes: Vec<Pass<'m, 'a, B>>,
    order: Vec<usize>,
    _reading: Streaming<'m, 'a>,
}

impl<'m, 'a, B: Backend> Lockstep<'m, 'a, B> {
    /// The passes of `states`, run in `order` (indices into `states`) in every layer.
    pub fn new(states: Vec<State<'m, 'a, B>>, order: Vec<usize>, end: End) -> Lockstep<'m, 'a, B> {
        let models: Vec<&'m Model<'a>> = states.iter().map(|s| s.model()).collect();
        let reading = stream(&models, &plan(&models, &order, end));
        let passes = states
            .into_iter()
            .map(|state| Pass {
                state,
                end,
                next: 0,
                deepstack: None,
                _reading: None,
            })
            .collect();
        Lockstep {
            passes,
            order,
            _reading: reading,
        }
    }

    /// Run every layer of every pass: `step(i, layer, pass)` runs pass `i`'s `layer` with
    /// [`Pass::layer`], the passes in order within each layer; a model with fewer layers sits
    /// out the rest.
    pub fn run(
        &mut self,
        mut step: impl FnMut(usize, usize, &mut Pass<'m, 'a, B>) -> Result<()>,
    ) -> Result<()> {
        let layers = self.passes.iter().map(Pass::layers).max().unwrap_or(0);
        for layer in 0..layers {
            for &i in &self.order {
                let pass = &mut self.passes[i];
                if layer < pass.layers() {
                    step(i, layer, pass)?;
                    assert_eq!(pass.next, layer + 1, "a lockstep runs one layer per step");
                }
            }
        }
        Ok(())
    }
}

/// Per-layer attention probabilities and final logits of a full forward pass: the library entry
/// point the parity tests compare against transformers.
pub struct Recorded {
    /// `attentions[layer][prompt]` is `[heads, len, len]` row-major.
    pub attentions: Vec<Vec<Vec<f32>>>,
    /// `logits[prompt]` is `[len, vocab]`.
    pub logits: Vec<Vec<f32>>,
}

/// [`record_all_on`] the CPU.
pub fn record_all(ckpt: &Checkpoint, prompts: &[Vec<u32>]) -> Result<Recorded> {
    record_all_on(&CpuBackend::default(), ckpt, prompts)
}

/// Run every layer (including the last MLP, final norm and LM head) on `backend` and keep every
/// attention probability. Memory grows with layers x heads x len²: for tests and small inputs.
pub fn record_all_on<B: Backend>(
    backend: &B,
    ckpt: &Checkpoint,
    prompts: &[Vec<u32>],
) -> Result<Recorded> {
    let model = Model::new(ckpt)?;
    let nh = model.spec.num_heads;
    let out = to_logits(backend, &model, prompts, &|h: &HeadView| h.probs.to_vec())?;
    let attentions = out
        .heads
        .into_iter()
        .map(|heads| {
            let mut per_prompt: Vec<Vec<f32>> = vec![Vec::new(); prompts.len()];
            for (i, probs) in heads.into_iter().enumerate() {
                per_prompt[i / nh].extend(probs);
            }
            per_prompt
        })
        .collect();
    let mut logits = Vec::with_capacity(prompts.len());
    let mut start = 0;
    for ids in prompts {
        let end = start + ids.len();
        logits.push(out.logits[start * out.vocab..end * out.vocab].to_vec());
        start = end;
    }
    Ok(Recorded { attentions, logits })
}

/// What [`to_logits`] returns.
pub struct Logits<R> {
    /// `heads[layer]`: the visitor's result for every head, prompt-major as
    /// [`State::attention`] returns them.
    pub heads: Vec<Vec<R>>,
    /// `[tokens, vocab]` for the packed prompts, in order.
    pub logits: Vec<f32>,
    /// Columns of `logits`: the LM head's rows.
    pub vocab: usize,
}

/// Keeps each layer's head results.
struct EveryLayer<R>(Vec<Vec<R>>);

impl<B: Backend, R> Hooks<B, R> for EveryLayer<R> {
    fn after(
        &mut self,
        _layer: usize,
        out: &mut AttentionOutput<R>,
        _state: &mut State<'_, '_, B>,
    ) -> Result<()> {
        self.0.push(std::mem::take(&mut out.heads));
        Ok(())
    }
}

/// The full forward pass of `prompts` on `backend`: every layer with its residual updates, each
/// head handed to `visit`, then the final norm and LM head. The one full forward both
/// [`record_all_on`] (keeping probabilities) and the text loss (keeping nothing) run.
pub fn to_logits<B: Backend, R: Send>(
    backend: &B,
    model: &Model,
    prompts: &[Vec<u32>],
    visit: &(impl Fn(&HeadView) -> R + Sync),
) -> Result<Logits<R>> {
    let mut pass = Pass::new(State::new(model, backend, prompts)?, End::Logits);
    let mut heads = EveryLayer(Vec::with_capacity(model.spec.num_layers()));
    pass.run(&|_, head: &HeadView| visit(head), &mut heads)?;
    let logits = pass.state().logits()?;
    let rows: usize = prompts.iter().map(Vec::len).sum();
    Ok(Logits {
        heads: heads.0,
        vocab: logits.len() / rows,
        logits,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The read-ahead plan names every weight a pass asks for, in the order it asks (for MoE
    /// layers, the experts no token is routed to are planned and never asked for).
    #[test]
    fn the_read_ahead_plan_follows_the_pass() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let mut dirs: Vec<_> = ["models", "score/models"]
            .iter()
            .flat_map(|d| std::fs::read_dir(root.join(d)).unwrap())
            .map(|e| e.unwrap().path())
            .filter(|p| p.join("config.json").is_file())
            .collect();
        dirs.sort();
        let mut checked = 0;
        for dir in dirs {
            let Ok(ckpt) = Checkpoint::open_dir(&dir, "fixture") else {
                continue;
            };
            let Ok(model) = Model::new(&ckpt) else {
                continue;
            };
            // A full pass with the head, then a scoring pass (the last layer's scores only).
            for end in [End::Logits, End::Scores] {
                let backend = CpuBackend::default();
                let state = State::new(&model, &backend, &[vec![1, 5, 9, 2, 7, 3]]).unwrap();
                let mut pass = Pass::new(state, end);
                pass.run(&|_, _: &HeadView| (), &mut ()).unwrap();
                if end == End::Logits {
                    pass.state().logits().unwrap();
                }
                let (requests, plan) = model.read_ahead().unwrap().0.requests_and_plan();
                drop(pass);
                let mut rest = plan.iter();
                for r in &requests {
                    assert!(
                        rest.any(|p| p == r),
                        "{}: {r:?} asked for out of the plan's order or not planned\n\
                         plan {plan:?}\nrequests {requests:?}",
                        dir.display()
                    );
                }
                if model.spec.moe.is_none() {
                    assert_eq!(requests, plan, "{}", dir.display());
                }
            }
            checked += 1;
        }
        assert!(checked >= 10, "{checked} fixtures checked");
    }
}
