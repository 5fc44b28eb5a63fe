//! `sinkmerge inject-qknorm`: rewrite a Qwen2/Qwen2.5 causal LM as a Qwen3 checkpoint with
//! unit-scale per-head QK-RMSNorm (Section 5, Appendix F.3).

use std::io::Write;

use serde_json::json;

use crate::analysis::inject_qknorm;
use crate::checkpoint::output::ExtraFile;
use crate::checkpoint::Checkpoint;
use crate::commands::args::RewriteArgs;
use crate::dtype;
use crate::error::Result;
use crate::write::model_card::{self, ModelCard};
use crate::write::rewrite::{rewrite, Edit};

#[derive(Debug, clap::Args)]
#[command(
    about = "Give a Qwen2/Qwen2.5 model unit-scale per-head QK norm, as a Qwen3ForCausalLM checkpoint",
    long_about = "QK-norm injection (arXiv 2609.00746, Section 5 and Appendix F.3). Writes MODEL \
(a Qwen2/Qwen2.5 causal LM) as a `Qwen3ForCausalLM` checkpoint whose attention normalizes every \
query and key head with RMSNorm (scale 1) before RoPE.\n\n\
config.json: `architectures` becomes [\"Qwen3ForCausalLM\"], `model_type` \"qwen3\", \
`attention_bias` true (Qwen2 hard-codes q/k/v biases; Qwen3 needs the switch for them), and \
`head_dim` is written explicitly (Qwen3's default of 128 is not Qwen2's hidden_size / heads). \
Every other key (RoPE, sliding window, tie_word_embeddings, rms_norm_eps, dtype, token ids) is \
kept as written.\n\n\
Tensors: every original tensor byte for byte; per layer, `self_attn.q_norm.weight` and \
`self_attn.k_norm.weight` of ones [head_dim], and `self_attn.o_proj.bias` of zeros [hidden_size] \
(Qwen3 with attention_bias=true has an o_proj bias; zero leaves o_proj unchanged), all in the \
model's dtype.\n\n\
The result computes a different function: that is the intervention. A VLM must be extracted to \
its language model first; a model that already has QK norms is refused.",
    after_help = "Example:\n  sinkmerge inject-qknorm qwen2.5-vl-3b:ref -o qwen2.5-3b-qknorm/"
)]
pub struct Args {
    /// Qwen2/Qwen2.5 causal LM: directory, HF repo id or alias
    pub model: String,

    #[command(flatten)]
    pub rewrite: RewriteArgs,

    /// Print one JSON summary instead of text
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args, progress: bool, out: &mut dyn Write) -> Result<()> {
    let output = args.rewrite.open("inject-qknorm")?;
    let to = output.destination();
    let model = Checkpoint::open_ref(&args.model)?;
    let plan = inject_qknorm::plan(&model)?;

    let originals = model.names().len();
    let dtype_name = dtype::torch_name(plan.dtype).unwrap_or("?");
    let mut card = (!args.rewrite.out.no_model_card).then(|| {
        let input = model_card::Input::new("model", true, &model);
        let description = format!(
            "`{}` rewritten as a `Qwen3ForCausalLM` checkpoint with unit-scale per-head \
             QK-RMSNorm, the intervention of arXiv 2609.00746 (Section 5, Appendix F.3): every \
             query and key head is RMS-normalized (scale 1) before RoPE. Every original tensor \
             is copied byte for byte; the result computes a different function.",
            input.name()
        );
        ModelCard {
            kind: model_card::Kind::QkNormInjection,
            description,
            recipe: vec![
                ("architecture", "`Qwen3ForCausalLM`, attention_bias: true".to_string()),
                ("layers", plan.num_layers.to_string()),
                ("head_dim", plan.head_dim.to_string()),
                (
                    "added per layer",
                    format!(
                        "q_norm.weight and k_norm.weight (ones), o_proj.bias (zeros), in {dtype_name}"
                    ),
                ),
                ("tensors copied", originals.to_string()),
            ],
            config_yaml: None,
            replay: [
                "sinkmerge",
                "inject-qknorm",
                &input.reference(),
                "-o",
                "OUT",
            ]
            .map(String::from)
            .to_vec(),
            inputs: vec![input],
        }
    });
    if let (Some(c), Some(v)) = (card.as_mut(), &output.into_vlm) {
        v.mark_card(c, true);
    }
    let mut additions = plan.additions()?;
    additions.files = card.iter().map(|c| c as &dyn ExtraFile).collect();
    let bar = crate::progress::bytes(model.total_bytes(), "writing", progress && !args.json);
    let rewritten = rewrite(&model, &to, &bar, &additions, |_, _, _| {
        Ok(Edit::<()>::Copy)
    })?;
    let dest = rewritten.dest;

    if args.json {
        let value = json!({
            "output": dest.display().to_string(),
            "model": model.label,
            "model_hub": model.hub,
            "architecture": "Qwen3ForCausalLM",
            "head_dim": plan.head_dim,
            "layers": plan.num_layers,
            "dtype": dtype_name,
            "copied": originals,
            "added": plan.added.iter().map(|t| &t.name).collect::<Vec<_>>(),
        });
        super::emit(out, &crate::report::json_text(&value)?)?;
    } else {
        super::emit(out, &format!(
            "{}: {} layers, head_dim {}: added q_norm/k_norm (ones) and o_proj.bias (zeros) in {}; \
             {} original tensors copied unchanged\nwrote {} (Qwen3ForCausalLM, attention_bias: true)\n",
            model.label,
            plan.num_layers,
            plan.head_dim,
            dtype_name,
            originals,
            dest.display()
        ))?;
    }
    Ok(())
}
