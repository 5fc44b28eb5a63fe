//! The models' token ids of the prompt set, as the scorer takes them: tokenization with an
//! optional chat template, checked against each model's context length, and the same-token
//! check that B needs (`docs/reference/sink-metrics.md`).

use std::path::Path;

use serde::Serialize;

use super::score::Input;
use super::tokenize::TextEncoder;
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::forward::model::DecoderSpec;
use crate::{bad, bail};

/// Whose chat template renders the prompts (`--template-from`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum TemplateFrom {
    /// The reference's template, for every model.
    Ref,
    /// Each model's own template.
    Own,
}

impl TemplateFrom {
    /// Whose template renders the prompts: none without `chat_template`; else `asked`, or by
    /// default the reference's when there is one (B compares the same token ids, and a VLM's
    /// template often differs, e.g. in its default system prompt) and each model's own when not.
    pub fn choose(
        chat_template: bool,
        asked: Option<TemplateFrom>,
        with_reference: bool,
    ) -> Result<Option<TemplateFrom>> {
        let chosen = match (chat_template, asked) {
            (false, _) => None,
            (true, Some(from)) => Some(from),
            (true, None) if with_reference => Some(TemplateFrom::Ref),
            (true, None) => Some(TemplateFrom::Own),
        };
        if chosen == Some(TemplateFrom::Ref) && !with_reference {
            bail!("--template-from ref needs --ref: there is no reference whose template to use");
        }
        Ok(chosen)
    }
}

/// One model to score: its label and its token ids of `prompts` (see [`tokenize_prompts`]).
pub fn prompt_input<'a>(
    ckpt: &'a Checkpoint,
    prompts: &[String],
    template: Option<&Path>,
) -> Result<Input<'a>> {
    Ok(Input {
        label: ckpt.label.clone(),
        ckpt,
        tokens: tokenize_prompts(ckpt, prompts, template)?,
    })
}

/// Every model's input, the reference first when `with_reference`, each rendered with the
/// template `template_from` names; with a reference, every model must give its token ids.
pub fn scoring_inputs<'a>(
    ckpts: &'a [Checkpoint],
    prompts: &[String],
    template_from: Option<TemplateFrom>,
    with_reference: bool,
) -> Result<Vec<Input<'a>>> {
    let template_of = |i: usize| match template_from {
        None => None,
        Some(TemplateFrom::Own) => Some(ckpts[i].dir.as_path()),
        Some(TemplateFrom::Ref) => Some(ckpts[0].dir.as_path()),
    };
    let inputs = (ckpts.iter().enumerate())
        .map(|(i, ckpt)| prompt_input(ckpt, prompts, template_of(i)))
        .collect::<Result<Vec<_>>>()?;
    if with_reference {
        for input in &inputs[1..] {
            check_same_tokens(&inputs[0], input, template_from)?;
        }
    }
    Ok(inputs)
}

/// Token ids of every prompt for one model, checked against its context length.
/// With `template = Some(dir)`, prompts are rendered with the chat template of the model in `dir`.
pub fn tokenize_prompts(
    ckpt: &Checkpoint,
    prompts: &[String],
    template: Option<&Path>,
) -> Result<Vec<Vec<u32>>> {
    let config = ckpt.dir.join("config.json");
    let spec = DecoderSpec::from_model_config(&ckpt.config)
        .map_err(|e| bad!("{}: {e}", config.display()))?;
    let encoder = TextEncoder::with_template_of(&ckpt.dir, template)?;
    let extends = spec.extends_context();
    let mut all = Vec::with_capacity(prompts.len());
    for (i, prompt) in prompts.iter().enumerate() {
        let ids = encoder.encode(prompt)?;
        if ids.is_empty() {
            bail!(
                "{}: prompt {} encodes to no tokens",
                ckpt.dir.join("tokenizer.json").display(),
                i + 1
            );
        }
        if ids.len() > spec.max_position_embeddings && !extends {
            bail!(
                "{}: prompt {} is {} tokens, longer than max_position_embeddings = {} in {}; \
                 shorten it or leave it out",
                ckpt.label,
                i + 1,
                ids.len(),
                spec.max_position_embeddings,
                config.display()
            );
        }
        all.push(ids);
    }
    Ok(all)
}

/// B compares the reference and a model on the same token ids: their tokenizers must agree.
pub fn check_same_tokens(
    reference: &Input,
    model: &Input,
    template: Option<TemplateFrom>,
) -> Result<()> {
    for (i, (a, b)) in reference.tokens.iter().zip(&model.tokens).enumerate() {
        if a != b {
            let at = a
                .iter()
                .zip(b)
                .position(|(x, y)| x != y)
                .unwrap_or(a.len().min(b.len()));
            let show = |v: &[u32]| v.get(at).map_or("end".to_string(), |x| x.to_string());
            let why = if template == Some(TemplateFrom::Own) {
                "each model rendered the prompts with its own chat template; drop \
                 --template-from own (or give --template-from ref) to render every model with \
                 the reference's"
            } else {
                "the models have different vocabularies"
            };
            bail!(
                "{}: it gives other token ids than the reference {} (prompt {}, token {}: {} vs \
                 {}); {why}, and B needs the same tokens in both",
                model.label,
                reference.label,
                i + 1,
                at,
                show(b),
                show(a)
            );
        }
    }
    Ok(())
}
