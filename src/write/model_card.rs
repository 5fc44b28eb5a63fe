//! Model cards: the `README.md` every model directory sinkmerge writes gets, in the Hugging Face
//! Hub's format (<https://huggingface.co/docs/hub/model-cards>): YAML metadata between `---`
//! lines, then Markdown.
//!
//! The metadata follows the Hub's model-card docs ("Specifying a base model", "Specifying a
//! library") and mergekit's card writer (mergekit/card.py): `base_model` lists only the inputs
//! that are Hub repo ids, because the Hub's model tree links repo ids and nothing else;
//! `base_model_relation: merge` marks merges; `library_name: transformers`, as mergekit writes.
//! Local directories have no repo id, so every input (repo and commit, or path) is listed in the
//! body, together with the recipe and the command that replays it. Each command fills a
//! [`ModelCard`]; this module alone renders it.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::checkpoint::hub_cache::HubRef;
use crate::checkpoint::output::{ExtraFile, OutputDir};
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::shell::quote;

/// The card's file name in the output directory.
pub const FILE: &str = "README.md";

/// What made the model: decides the tags and `base_model_relation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A merge by the named method (`ties`, `dare_linear`, ...).
    Merge(&'static str),
    /// `sinkmerge extract`.
    Extraction,
    /// `sinkmerge ablate`.
    Ablation,
    /// `sinkmerge perturb`.
    Perturbation,
    /// `sinkmerge inject-qknorm`.
    QkNormInjection,
    /// `sinkmerge repair-heads`: chosen heads' slices moved toward the reference.
    HeadRepair,
    /// `sinkmerge graft`: a language model written back into its VLM.
    Graft,
}

impl Kind {
    fn tags(self) -> Vec<String> {
        let mut tags = vec!["sinkmerge".to_string()];
        match self {
            Kind::Merge(method) => tags.extend(["merge".to_string(), method.to_string()]),
            Kind::Extraction => tags.push("extraction".into()),
            Kind::Ablation => tags.push("ablation".into()),
            Kind::Perturbation => tags.push("perturbation".into()),
            Kind::QkNormInjection => tags.push("qk-norm-injection".into()),
            Kind::HeadRepair => tags.extend(["merge".to_string(), "head-repair".to_string()]),
            Kind::Graft => tags.extend(["merge".to_string(), "graft".to_string()]),
        }
        tags
    }

    /// The Hub infers the relation when it is not given; merges say so explicitly. The controls
    /// and extraction fit none of the Hub's relations (adapter, merge, quantized, finetune), so
    /// they leave it unset.
    fn relation(self) -> Option<&'static str> {
        match self {
            // A graft combines two models, the VLM and the language model put into it.
            Kind::Merge(_) | Kind::HeadRepair | Kind::Graft => Some("merge"),
            _ => None,
        }
    }
}

/// The YAML front matter.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Metadata {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub base_model: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base_model_relation: Option<&'static str>,
    pub tags: Vec<String>,
    pub library_name: &'static str,
}

/// One input model.
#[derive(Debug, Clone)]
pub struct Input {
    /// What it was used for: `base`, `model`, `source`, `tokenizer`, ...
    pub role: &'static str,
    /// Whether the output's weights come from it: only those are `base_model`s.
    pub parent: bool,
    pub dir: PathBuf,
    pub hub: Option<HubRef>,
}

impl Input {
    pub fn new(role: &'static str, parent: bool, ckpt: &Checkpoint) -> Input {
        Input {
            role,
            parent,
            dir: ckpt.dir.clone(),
            hub: ckpt.hub.clone(),
        }
    }

    /// The exact reference for a replay: `ORG/NAME@commit` for a Hub model, else the absolute
    /// path (as `sinkmerge_config.yml` records them).
    pub fn reference(&self) -> String {
        match &self.hub {
            Some(h) => format!("{}@{}", h.repo, h.commit),
            None => absolute(&self.dir),
        }
    }

    /// A short name for prose: the repo id, else the directory's name.
    pub fn name(&self) -> String {
        match &self.hub {
            Some(h) => h.repo.clone(),
            None => std::fs::canonicalize(&self.dir)
                .unwrap_or_else(|_| self.dir.clone())
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| absolute(&self.dir)),
        }
    }
}

fn absolute(dir: &Path) -> String {
    std::fs::canonicalize(dir)
        .unwrap_or_else(|_| dir.to_path_buf())
        .display()
        .to_string()
}

/// A model card, filled by the command that wrote the model.
#[derive(Debug, Clone)]
pub struct ModelCard {
    pub kind: Kind,
    /// What the model is, one paragraph of Markdown.
    pub description: String,
    /// The recipe's settings, in order, as (name, value); a name may repeat (notes).
    pub recipe: Vec<(&'static str, String)>,
    /// Merges: the resolved `sinkmerge_config.yml`.
    pub config_yaml: Option<String>,
    pub inputs: Vec<Input>,
    /// The command that writes this model again, output as `OUT`.
    pub replay: Vec<String>,
}

impl ModelCard {
    pub fn metadata(&self) -> Metadata {
        let mut base_model: Vec<String> = Vec::new();
        for input in self.inputs.iter().filter(|i| i.parent) {
            if let Some(h) = &input.hub {
                if !base_model.contains(&h.repo) {
                    base_model.push(h.repo.clone());
                }
            }
        }
        Metadata {
            base_model,
            base_model_relation: self.kind.relation(),
            tags: self.kind.tags(),
            library_name: "transformers",
        }
    }

    /// The whole `README.md`, titled `name`.
    pub fn render(&self, name: &str) -> String {
        let yaml = serde_yaml_ng::to_string(&self.metadata()).expect("card metadata serializes");
        let mut text = format!("---\n{yaml}---\n\n# {name}\n\n{}\n\n", self.description);
        text += &format!(
            "Written by sinkmerge {}.\n\n## Recipe\n\n",
            env!("CARGO_PKG_VERSION")
        );
        for (key, value) in &self.recipe {
            text += &format!("- {key}: {value}\n");
        }
        if let Some(yaml) = &self.config_yaml {
            text += "\nThe resolved configuration (`sinkmerge_config.yml`):\n\n```yaml\n";
            text += yaml;
            if !yaml.ends_with('\n') {
                text.push('\n');
            }
            text += "```\n";
        }
        text += "\n## Inputs\n\n| role | model | commit |\n|---|---|---|\n";
        for input in &self.inputs {
            let (model, commit) = match &input.hub {
                Some(h) => (
                    format!("[{0}](https://huggingface.co/{0})", h.repo),
                    format!("`{}`", h.commit),
                ),
                None => (
                    format!("`{}`", absolute(&input.dir).replace('|', "\\|")),
                    "local directory".to_string(),
                ),
            };
            text += &format!("| {} | {model} | {commit} |\n", input.role);
        }
        text += "\n## Replay\n\n```sh\n";
        text += &self
            .replay
            .iter()
            .map(|w| quote(w))
            .collect::<Vec<_>>()
            .join(" ");
        text += "\n```\n";
        text
    }

    /// Write the card into `out`, titled with the destination's directory name.
    pub fn write(&self, out: &OutputDir) -> Result<()> {
        let name = out
            .dest()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        out.write_file(FILE, self.render(&name).as_bytes())
    }
}

impl ExtraFile for ModelCard {
    fn write_into(&self, out: &OutputDir) -> Result<()> {
        self.write(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card(inputs: Vec<Input>) -> ModelCard {
        ModelCard {
            kind: Kind::Merge("ties"),
            description: "A merge.".into(),
            recipe: vec![("method", "`ties`".into())],
            config_yaml: Some("merge_method: ties\n".into()),
            inputs,
            replay: vec![
                "sinkmerge".into(),
                "merge".into(),
                "sinkmerge_config.yml".into(),
                "-o".into(),
                "OUT".into(),
            ],
        }
    }

    fn hub(role: &'static str, parent: bool, repo: &str) -> Input {
        Input {
            role,
            parent,
            dir: PathBuf::from("/nonexistent"),
            hub: Some(HubRef {
                repo: repo.into(),
                commit: "0123abcd".into(),
            }),
        }
    }

    #[test]
    fn front_matter_lists_parent_repos_once() {
        let c = card(vec![
            hub("base", true, "Org/Base"),
            hub("model", true, "Org/Base"),
            hub("model", true, "Org/Tuned"),
            hub("tokenizer", false, "Org/Tok"),
        ]);
        let text = c.render("out");
        let yaml = text
            .strip_prefix("---\n")
            .and_then(|t| t.split_once("---\n"))
            .unwrap()
            .0;
        let meta: serde_yaml_ng::Value = serde_yaml_ng::from_str(yaml).unwrap();
        assert_eq!(
            meta["base_model"],
            serde_yaml_ng::to_value(["Org/Base", "Org/Tuned"]).unwrap()
        );
        assert_eq!(meta["base_model_relation"], "merge");
        assert_eq!(
            meta["tags"],
            serde_yaml_ng::to_value(["sinkmerge", "merge", "ties"]).unwrap()
        );
        assert_eq!(meta["library_name"], "transformers");
        assert!(
            text.contains("| tokenizer | [Org/Tok](https://huggingface.co/Org/Tok) | `0123abcd` |")
        );
        assert!(text.contains("```yaml\nmerge_method: ties\n```"));
        assert!(text.contains("```sh\nsinkmerge merge sinkmerge_config.yml -o OUT\n```"));
    }

    #[test]
    fn local_inputs_give_no_base_model_key() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = card(vec![Input {
            role: "source",
            parent: true,
            dir: dir.path().to_path_buf(),
            hub: None,
        }]);
        c.kind = Kind::Extraction;
        let text = c.render("out");
        assert!(!text.contains("base_model"), "{text}");
        assert!(
            text.contains("tags:\n- sinkmerge\n- extraction\n"),
            "{text}"
        );
        let path = std::fs::canonicalize(dir.path()).unwrap();
        assert!(text.contains(&format!(
            "| source | `{}` | local directory |",
            path.display()
        )));
    }
}
