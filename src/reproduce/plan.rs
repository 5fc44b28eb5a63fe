//! The steps of `reproduce` for one pair: which command each runs, with which arguments, on
//! which inputs, after which other steps. Each step is an existing command's command line, so
//! the manifest records it as the user would type it, and the report shows how to replay it.

use std::path::{Path, PathBuf};

use serde::Serialize;

/// The paper's seven merge settings (merge-configs/README.md), read from the same YAML files a
/// user runs by hand; `needs_base`: the setting is only defined relative to a pretrained base.
pub struct Setting {
    pub name: &'static str,
    pub title: &'static str,
    pub yaml: &'static str,
    pub needs_base: bool,
}

pub const SETTINGS: [Setting; 7] = [
    Setting {
        name: "mix95",
        title: "95% VLM + 5% LLM",
        yaml: include_str!("../../merge-configs/qwen3-vl/mix95.yml"),
        needs_base: false,
    },
    Setting {
        name: "average",
        title: "uniform average",
        yaml: include_str!("../../merge-configs/qwen3-vl/average.yml"),
        needs_base: false,
    },
    Setting {
        name: "task_arithmetic",
        title: "task arithmetic, λ = 1",
        yaml: include_str!("../../merge-configs/qwen3-vl/task_arithmetic.yml"),
        needs_base: false,
    },
    Setting {
        name: "tsv",
        title: "TSV, α = 1",
        yaml: include_str!("../../merge-configs/qwen3-vl/tsv.yml"),
        needs_base: false,
    },
    Setting {
        name: "star",
        title: "STAR, η = 40%",
        yaml: include_str!("../../merge-configs/qwen3-vl/star.yml"),
        needs_base: false,
    },
    Setting {
        name: "ties",
        title: "TIES, density 0.2, λ = 1",
        yaml: include_str!("../../merge-configs/qwen3-vl/ties.yml"),
        needs_base: true,
    },
    Setting {
        name: "dare",
        title: "DARE, mask rate 0.9, λ = 1",
        yaml: include_str!("../../merge-configs/qwen3-vl/dare.yml"),
        needs_base: true,
    },
];

/// The names `--merges` accepts.
pub fn setting_names() -> Vec<&'static str> {
    SETTINGS.iter().map(|s| s.name).collect()
}

/// The names in the paper's configs that stand for the pair's models.
const CONFIG_REF: &str = "qwen3-vl:ref";
const CONFIG_VLM_LM: &str = "./qwen3-vl-lm";

/// The merge config of `setting` for this pair, as YAML: the paper's file with its models
/// replaced. With a base, the task-vector settings are the paper's (both endpoints are task
/// models of the base). Without one, the reference is the base and the VLM-LM the only task
/// model, the one reading left (merge-configs/README.md explains why it degenerates: task
/// arithmetic and TSV then return the VLM-LM).
pub fn merge_config(
    setting: &Setting,
    reference: &str,
    vlm_lm: &str,
    base: Option<&str>,
) -> String {
    let mut config: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(setting.yaml).expect("the bundled merge configs parse");
    let map = config
        .as_mapping_mut()
        .expect("a merge config is a mapping");
    let name = |v: &serde_yaml_ng::Value| -> String {
        match v.as_str() {
            Some(CONFIG_REF) => reference.to_string(),
            Some(CONFIG_VLM_LM) => vlm_lm.to_string(),
            Some(other) => other.to_string(),
            None => String::new(),
        }
    };
    let has_base = map.contains_key("base_model");
    if has_base {
        map.insert(
            "base_model".into(),
            base.unwrap_or(reference).to_string().into(),
        );
    }
    if let Some(models) = map.get_mut("models").and_then(|m| m.as_sequence_mut()) {
        for entry in models.iter_mut() {
            let m = entry.as_mapping_mut().expect("a models entry is a mapping");
            let renamed = name(&m["model"]);
            m.insert("model".into(), renamed.into());
        }
        if has_base && base.is_none() {
            models.retain(|entry| entry["model"].as_str() != Some(reference));
        }
    }
    map.insert("tokenizer_source".into(), reference.to_string().into());
    let header = format!(
        "# sinkmerge reproduce: the paper's setting `{}` ({}), from merge-configs/qwen3-vl/{}.yml,\n\
         # with the pair's models{}.\n",
        setting.name,
        setting.title,
        setting.name,
        match (has_base, base) {
            (true, None) => "; without --base, the reference is the base and the VLM-LM the \
                             only task model",
            _ => "",
        }
    );
    header + &serde_yaml_ng::to_string(&config).expect("YAML values serialize")
}

/// What a step reads from outside the run: models by commit or content, files by content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Read {
    Model { input: String },
    File { path: PathBuf },
}

/// What a step is, for the summary and the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Inspect,
    Extract,
    Norms,
    Merge,
    Score,
    Heads,
    Predict,
    Answers,
}

/// One step: a sinkmerge command line and what it depends on.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub name: String,
    pub role: Role,
    /// The command line after `sinkmerge` (the predictor's `--s` is filled in once the
    /// reference's score exists).
    pub argv: Vec<String>,
    pub reads: Vec<Read>,
    /// Steps whose outputs this one reads.
    pub after: Vec<String>,
    /// The model directory the step writes, if any.
    pub model: Option<PathBuf>,
    /// Files the command writes beside its report (plots).
    pub files: Vec<PathBuf>,
    /// For a merge step: its config, written into the step's folder before it runs.
    #[serde(skip)]
    pub config: Option<String>,
    /// For a merge step: the setting's name.
    pub setting: Option<String>,
}

/// The pair and the choices a plan is made from.
#[derive(Debug, Clone)]
pub struct PlanInput<'a> {
    pub reference: &'a str,
    pub vlm: &'a str,
    pub base: Option<&'a str>,
    pub dir: &'a Path,
    pub text: &'a Path,
    pub device: &'a str,
    pub merges: &'a [&'static str],
    /// `--answers`: the prompts file each model answers (`DIR/inputs/answers.jsonl`).
    pub answers: Option<&'a Path>,
}

/// The bundled prompts of `--answers`, greedy, raw text (no chat template), so that every model
/// reads the same token ids.
pub const ANSWER_PROMPTS: &str = include_str!("../../assets/prompts/answers.jsonl");
/// Tokens each answer gets at most.
pub const ANSWER_TOKENS: usize = 64;

/// The prompts of [`ANSWER_PROMPTS`], in order.
pub fn answer_prompts() -> Vec<String> {
    ANSWER_PROMPTS
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value =
                serde_json::from_str(l).expect("the bundled answer prompts parse");
            v["prompt"].as_str().unwrap_or_default().to_string()
        })
        .collect()
}

/// The name of the answers step of a model (`ref`, `vlm-lm` or a setting).
pub fn answers_step(model: &str) -> String {
    format!("answers-{}", model.replace('_', "-"))
}

/// The folder of step `name` under `dir`.
pub fn step_dir(dir: &Path, name: &str) -> PathBuf {
    dir.join("steps").join(name)
}

/// The name of the score step of a model (`ref`, `vlm-lm` or a setting).
pub fn score_step(model: &str) -> String {
    format!("score-{}", model.replace('_', "-"))
}

/// The name of the merge step of a setting.
pub fn merge_step(setting: &str) -> String {
    format!("merge-{}", setting.replace('_', "-"))
}

/// Every step, in the order the local executor runs them: the pair's own analysis first, then
/// each merge followed by its score (and with `--answers`, its answers), so at most one merged
/// model is on disk at a time.
pub fn steps(p: &PlanInput) -> Vec<Step> {
    let s = |path: &Path| path.to_string_lossy().into_owned();
    let vlm_lm = p.dir.join("models").join("vlm-lm");
    let text = s(p.text);
    let model = |input: &str| Read::Model {
        input: input.to_string(),
    };
    let device: Vec<String> = match p.device {
        "cpu" => vec![],
        d => vec!["--device".into(), d.into()],
    };
    let score = |name: &str, target: Option<&Path>, after: Vec<String>| {
        let mut argv: Vec<String> = vec!["score".into()];
        match target {
            Some(t) => argv.extend(["--ref".into(), p.reference.into(), s(t)]),
            None => argv.push(p.reference.into()),
        }
        argv.extend([
            "--bands".into(),
            "thirds".into(),
            "--text".into(),
            text.clone(),
        ]);
        argv.extend(device.iter().cloned());
        argv.push("--json".into());
        Step {
            name: score_step(name),
            role: Role::Score,
            argv,
            reads: vec![
                model(p.reference),
                Read::File {
                    path: p.text.to_path_buf(),
                },
            ],
            after,
            model: None,
            files: vec![],
            config: None,
            setting: None,
        }
    };
    // `generate MODEL --batch PROMPTS --greedy --max-new-tokens 64 --json`: one JSON array.
    let answers = |name: &str, target: &str, after: Vec<String>| {
        let prompts = p.answers?;
        let mut argv: Vec<String> = vec![
            "generate".into(),
            target.into(),
            "--batch".into(),
            s(prompts),
            "--greedy".into(),
            "--max-new-tokens".into(),
            ANSWER_TOKENS.to_string(),
        ];
        argv.extend(device.iter().cloned());
        argv.push("--json".into());
        let mut reads = vec![Read::File {
            path: prompts.to_path_buf(),
        }];
        if target == p.reference {
            reads.insert(0, model(p.reference));
        }
        Some(Step {
            name: answers_step(name),
            role: Role::Answers,
            argv,
            reads,
            after,
            model: None,
            files: vec![],
            config: None,
            setting: None,
        })
    };
    let plain =
        |name: &str, role: Role, argv: Vec<String>, reads: Vec<Read>, after: &[&str]| Step {
            name: name.into(),
            role,
            argv,
            reads,
            after: after.iter().map(|a| a.to_string()).collect(),
            model: None,
            files: vec![],
            config: None,
            setting: None,
        };

    let mut steps = vec![
        plain(
            "inspect-ref",
            Role::Inspect,
            vec!["inspect".into(), p.reference.into(), "--json".into()],
            vec![model(p.reference)],
            &[],
        ),
        plain(
            "inspect-vlm",
            Role::Inspect,
            vec!["inspect".into(), p.vlm.into(), "--json".into()],
            vec![model(p.vlm)],
            &[],
        ),
        Step {
            model: Some(vlm_lm.clone()),
            ..plain(
                "extract",
                Role::Extract,
                vec![
                    "extract".into(),
                    p.vlm.into(),
                    "-o".into(),
                    s(&vlm_lm),
                    "--force".into(),
                    "--json".into(),
                ],
                vec![model(p.vlm)],
                &[],
            )
        },
        plain(
            "norms",
            Role::Norms,
            vec![
                "norms".into(),
                p.reference.into(),
                s(&vlm_lm),
                "--json".into(),
            ],
            vec![model(p.reference)],
            &["extract"],
        ),
        score("ref", None, vec![]),
        score("vlm-lm", Some(&vlm_lm), vec!["extract".into()]),
    ];
    let heatmap = step_dir(p.dir, "heads").join("heatmap.svg");
    let mut heads_argv = vec![
        "heads".into(),
        p.reference.into(),
        s(&vlm_lm),
        "--heatmap".into(),
        s(&heatmap),
    ];
    heads_argv.extend(device.iter().cloned());
    heads_argv.push("--json".into());
    steps.push(Step {
        files: vec![heatmap],
        ..plain(
            "heads",
            Role::Heads,
            heads_argv,
            vec![model(p.reference)],
            &["extract"],
        )
    });
    let panel = step_dir(p.dir, "predict").join("panel.svg");
    steps.push(Step {
        files: vec![panel.clone()],
        ..plain(
            "predict",
            Role::Predict,
            vec![
                "predict".into(),
                "--s".into(),
                "S".into(),
                "--plot".into(),
                s(&panel),
                "--json".into(),
            ],
            vec![],
            &["score-ref"],
        )
    });
    steps.extend(answers("ref", p.reference, vec![]));
    steps.extend(answers("vlm-lm", &s(&vlm_lm), vec!["extract".into()]));
    for setting in SETTINGS.iter().filter(|s| p.merges.contains(&s.name)) {
        if setting.needs_base && p.base.is_none() {
            continue;
        }
        let name = merge_step(setting.name);
        let config_path = step_dir(p.dir, &name).join("config.yml");
        let out = p.dir.join("models").join(setting.name.replace('_', "-"));
        let mut reads = vec![
            model(p.reference),
            Read::File {
                path: config_path.clone(),
            },
        ];
        // Only the task-vector settings read the base.
        reads.extend(
            p.base
                .filter(|_| setting.yaml.contains("base_model"))
                .map(model),
        );
        steps.push(Step {
            model: Some(out.clone()),
            config: Some(merge_config(setting, p.reference, &s(&vlm_lm), p.base)),
            setting: Some(setting.name.into()),
            ..plain(
                &name,
                Role::Merge,
                vec![
                    "merge".into(),
                    s(&config_path),
                    "-o".into(),
                    s(&out),
                    "--force".into(),
                    "--json".into(),
                ],
                reads,
                &["extract"],
            )
        });
        let mut scored = score(setting.name, Some(&out), vec![name.clone()]);
        scored.setting = Some(setting.name.into());
        let score_name = scored.name.clone();
        steps.push(scored);
        // After the score too: the merged model is deleted once its last reader is done, and
        // under Slurm the two would otherwise run at once.
        if let Some(mut answered) = answers(setting.name, &s(&out), vec![name, score_name]) {
            answered.setting = Some(setting.name.into());
            steps.push(answered);
        }
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_becomes_a_config_of_the_pair() {
        for setting in &SETTINGS {
            let yaml = merge_config(setting, "REF", "DIR/models/vlm-lm", Some("BASE"));
            let v: serde_yaml_ng::Value = serde_yaml_ng::from_str(&yaml).unwrap();
            let models: Vec<&str> = (v["models"].as_sequence().unwrap().iter())
                .map(|m| m["model"].as_str().unwrap())
                .collect();
            assert_eq!(models.len(), 2, "{}: {yaml}", setting.name);
            assert!(models.contains(&"REF") && models.contains(&"DIR/models/vlm-lm"));
            assert_eq!(v["tokenizer_source"].as_str(), Some("REF"));
            assert_eq!(
                yaml.contains("base_model: BASE"),
                setting.yaml.contains("base_model")
            );
        }
    }

    #[test]
    fn without_a_base_the_reference_is_the_base_of_the_task_vector_settings() {
        let tsv = SETTINGS.iter().find(|s| s.name == "tsv").unwrap();
        let yaml = merge_config(tsv, "REF", "LM", None);
        let v: serde_yaml_ng::Value = serde_yaml_ng::from_str(&yaml).unwrap();
        assert_eq!(v["base_model"].as_str(), Some("REF"));
        let models = v["models"].as_sequence().unwrap();
        assert_eq!(models.len(), 1);
        assert_eq!(models[0]["model"].as_str(), Some("LM"));
    }
}
