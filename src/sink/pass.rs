//! One scoring run as the commands make it: the scorer with a progress bar over the layers, the
//! `--text` pass beside it, and the default S that `predict --model` places.

use super::inputs::prompt_input;
use super::prompts;
use super::score::{score, Input, Scored, Settings};
use super::text_loss::{TextLoss, TextPass};
use crate::bad;
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::forward::backend::cpu::CpuBackend;
use crate::forward::backend::Backend;
use crate::forward::device::BackendJob;
use crate::forward::model::DecoderSpec;

/// The scorer with a progress bar over the layers of every model.
pub fn score_with_progress<B: Backend>(
    backend: &B,
    inputs: &[Input],
    reference: Option<usize>,
    settings: Settings,
    show: bool,
) -> Result<Scored> {
    let layers: u64 = (inputs.iter())
        .map(|i| {
            DecoderSpec::from_model_config(&i.ckpt.config).map_or(0, |s| s.num_layers() as u64)
        })
        .sum();
    let bar = crate::progress::items(layers, "layers", show);
    let scores = score(backend, inputs, reference, settings, &|| bar.inc(1))?;
    bar.finish_and_clear();
    Ok(scores)
}

/// What `sinkmerge score` computes on its device: the scores, then each model's loss on the
/// `--text` file when there is one.
pub struct ScorePass<'a> {
    pub inputs: &'a [Input<'a>],
    /// Index of the reference in `inputs`.
    pub reference: Option<usize>,
    pub settings: Settings,
    pub text: Option<&'a TextPass<'a>>,
    /// Draw progress bars.
    pub show: bool,
}

impl BackendJob for ScorePass<'_> {
    type Output = (Scored, Option<Vec<TextLoss>>);

    fn run<B: Backend>(self, backend: &B) -> Result<Self::Output> {
        let scored = score_with_progress(
            backend,
            self.inputs,
            self.reference,
            self.settings,
            self.show,
        )?;
        let losses = (self.text)
            .map(|text| text.losses(backend, self.show))
            .transpose()?;
        Ok((scored, losses))
    }
}

/// S of one model as `sinkmerge score MODEL` reports it with every default (the 15 built-in
/// prompts, raw text, last 10 layers, median, column sinks, CPU): what `predict --model` places.
pub fn default_sink_strength(ckpt: &Checkpoint, progress: bool) -> Result<f64> {
    let input = prompt_input(ckpt, &prompts::default_prompts(), None)?;
    let scored = score_with_progress(
        &CpuBackend::default(),
        &[input],
        None,
        Settings::default(),
        progress,
    )?;
    scored.scores.models[0]
        .statistics
        .sink_strength
        .ok_or_else(|| {
            bad!(
                "{}: no valid observation in the last 10 layers, so S is undefined",
                ckpt.label
            )
        })
}
