//! Turning what the user typed into a model directory: a path, a Hugging Face repo id found in
//! the local HF cache (`ORG/NAME[@revision]`), or one of the paper's aliases (`qwen2.5-vl`, and
//! `qwen2.5-vl:ref` for its reference LLM). A repo id missing from the cache is fetched from
//! the Hub ([`super::hub`]) unless downloads are off (`--no-download`, `HF_HUB_OFFLINE=1`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::bail;
use crate::error::Result;
use crate::shell::quote;

/// A resolved model reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRef {
    pub dir: PathBuf,
    /// How to name the model in messages: the alias or repo id as typed, or the path.
    pub label: String,
    /// The alias, when one was used (used for default output names).
    pub alias: Option<String>,
    /// Where it came from on the Hugging Face Hub, for models found in (or fetched into) the HF
    /// cache.
    pub hub: Option<HubRef>,
}

/// A model on the Hub at one commit.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HubRef {
    /// `ORG/NAME`.
    pub repo: String,
    /// The resolved commit hash (the snapshot's directory name).
    pub commit: String,
}

/// ` (commit C)` for a Hub model, nothing for a directory: what text reports append to a label.
pub fn commit_note(hub: Option<&HubRef>) -> String {
    hub.map_or_else(String::new, |h| format!(" (commit {})", h.commit))
}

/// One row of the paper's pair table (arXiv 2609.00746, Appendix B.4).
#[derive(Debug, Clone, Copy)]
pub struct PaperPair {
    pub alias: &'static str,
    pub vlm: &'static str,
    pub reference: &'static str,
    pub family: &'static str,
    pub qk_norm: &'static str,
}

/// The paper's VLM / reference-LLM pairs. `ALIAS` is the VLM, `ALIAS:ref` its reference LLM.
pub const PAPER_PAIRS: &[PaperPair] = &[
    PaperPair {
        alias: "qwen3-vl",
        vlm: "Qwen/Qwen3-VL-8B-Instruct",
        reference: "Qwen/Qwen3-8B",
        family: "qwen3-vl",
        qk_norm: "per-head",
    },
    PaperPair {
        alias: "internvl3.5",
        vlm: "OpenGVLab/InternVL3_5-8B",
        reference: "Qwen/Qwen3-8B",
        family: "internvl",
        qk_norm: "per-head",
    },
    PaperPair {
        alias: "qwen2.5-vl",
        vlm: "Qwen/Qwen2.5-VL-7B-Instruct",
        reference: "Qwen/Qwen2.5-7B-Instruct",
        family: "qwen2.5-vl",
        qk_norm: "none",
    },
    PaperPair {
        alias: "internvl3",
        vlm: "OpenGVLab/InternVL3-8B",
        reference: "Qwen/Qwen2.5-7B-Instruct",
        family: "internvl",
        qk_norm: "none",
    },
    PaperPair {
        alias: "llava-ov",
        vlm: "lmms-lab/llava-onevision-qwen2-7b-ov",
        reference: "Qwen/Qwen2-7B-Instruct",
        family: "llava-onevision",
        qk_norm: "none",
    },
    PaperPair {
        alias: "molmo2-o",
        vlm: "allenai/Molmo2-O-7B",
        reference: "allenai/Olmo-3-7B-Instruct",
        family: "molmo2",
        qk_norm: "layerwise",
    },
    PaperPair {
        alias: "qwen3-vl-4b",
        vlm: "Qwen/Qwen3-VL-4B-Instruct",
        reference: "Qwen/Qwen3-4B",
        family: "qwen3-vl",
        qk_norm: "per-head",
    },
    PaperPair {
        alias: "qwen3-vl-2b",
        vlm: "Qwen/Qwen3-VL-2B-Instruct",
        reference: "Qwen/Qwen3-1.7B",
        family: "qwen3-vl",
        qk_norm: "per-head",
    },
    PaperPair {
        alias: "qwen3-vl-30b-a3b",
        vlm: "Qwen/Qwen3-VL-30B-A3B-Instruct",
        reference: "Qwen/Qwen3-30B-A3B-Instruct-2507",
        family: "qwen3-vl-moe",
        qk_norm: "per-head",
    },
    PaperPair {
        alias: "ovis2-8b",
        vlm: "AIDC-AI/Ovis2-8B",
        reference: "Qwen/Qwen2.5-7B-Instruct",
        family: "ovis2",
        qk_norm: "none",
    },
    PaperPair {
        alias: "ovis2-34b",
        vlm: "AIDC-AI/Ovis2-34B",
        reference: "Qwen/Qwen2.5-32B-Instruct",
        family: "ovis2",
        qk_norm: "none",
    },
    PaperPair {
        alias: "molmoe-1b",
        vlm: "allenai/MolmoE-1B-0924",
        reference: "allenai/OLMoE-1B-7B-0924-Instruct",
        family: "molmoe",
        qk_norm: "layerwise",
    },
    PaperPair {
        alias: "internvl3-2b",
        vlm: "OpenGVLab/InternVL3-2B",
        reference: "Qwen/Qwen2.5-1.5B-Instruct",
        family: "internvl",
        qk_norm: "none",
    },
    PaperPair {
        alias: "internvl3-14b",
        vlm: "OpenGVLab/InternVL3-14B",
        reference: "Qwen/Qwen2.5-14B-Instruct",
        family: "internvl",
        qk_norm: "none",
    },
    PaperPair {
        alias: "minicpm-v-4.5",
        vlm: "openbmb/MiniCPM-V-4_5",
        reference: "Qwen/Qwen3-8B",
        family: "minicpm-v",
        qk_norm: "per-head",
    },
    PaperPair {
        alias: "llava-next-mistral",
        vlm: "llava-hf/llava-v1.6-mistral-7b-hf",
        reference: "mistralai/Mistral-7B-Instruct-v0.2",
        family: "llava-next",
        qk_norm: "none",
    },
    PaperPair {
        alias: "idefics3",
        vlm: "HuggingFaceM4/Idefics3-8B-Llama3",
        reference: "meta-llama/Llama-3.1-8B-Instruct",
        family: "idefics3",
        qk_norm: "none",
    },
    PaperPair {
        alias: "qwen2.5-vl-3b",
        vlm: "Qwen/Qwen2.5-VL-3B-Instruct",
        reference: "Qwen/Qwen2.5-3B-Instruct",
        family: "qwen2.5-vl",
        qk_norm: "none",
    },
];

/// Look up an alias: `qwen2.5-vl` gives the VLM repo id, `qwen2.5-vl:ref` the reference LLM.
pub fn alias_repo(alias: &str) -> Option<&'static str> {
    let (name, reference) = match alias.strip_suffix(":ref") {
        Some(name) => (name, true),
        None => (alias, false),
    };
    let pair = PAPER_PAIRS
        .iter()
        .find(|p| p.alias.eq_ignore_ascii_case(name))?;
    Some(if reference { pair.reference } else { pair.vlm })
}

/// The Hugging Face hub cache directory: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `~/.cache/huggingface/hub`.
pub fn hub_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("HF_HUB_CACHE").filter(|v| !v.is_empty()) {
        return PathBuf::from(dir);
    }
    if let Some(home) = std::env::var_os("HF_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(home).join("hub");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache").join("huggingface").join("hub")
}

/// Resolve a model reference. Existing paths win, then aliases, then `ORG/NAME[@rev]` repo ids.
pub fn resolve(reference: &str) -> Result<ModelRef> {
    let path = Path::new(reference);
    if path.exists() {
        if !path.is_dir() {
            bail!("{reference}: not a model directory (pass the folder holding config.json)");
        }
        return Ok(ModelRef {
            dir: path.to_path_buf(),
            label: reference.to_string(),
            alias: None,
            hub: None,
        });
    }
    if let Some(repo) = alias_repo(reference) {
        let mut model = resolve_cached(repo, None)?;
        model.label = format!("{reference} ({repo})");
        model.alias = Some(reference.to_string());
        return Ok(model);
    }
    let (repo, revision) = match reference.split_once('@') {
        Some((repo, rev)) => (repo, Some(rev)),
        None => (reference, None),
    };
    if is_repo_id(repo) {
        // The revision names a folder of the cache and a URL path: checked before either is
        // built.
        if let Some(Err(why)) = revision.map(check_revision) {
            bail!("{}: {why}", reference.escape_debug());
        }
        return resolve_cached(repo, revision);
    }
    bail!(
        "{reference}: no such directory, and not a known alias or a Hugging Face repo id (ORG/NAME). Aliases: {}",
        PAPER_PAIRS.iter().map(|p| p.alias).collect::<Vec<_>>().join(", ")
    )
}

/// Whether `s` is a repo id the Hub accepts, as huggingface_hub's `validate_repo_id` checks
/// it: `ORG/NAME`, each part of letters, digits, `-`, `_` and `.`, not starting or ending with
/// `-` or `.`, without `--` or `..` (the cache folder joins the parts with `--`), at most 96
/// characters.
fn is_repo_id(s: &str) -> bool {
    let mut parts = s.split('/');
    let ok = |p: Option<&str>| {
        p.is_some_and(|p| {
            !p.is_empty()
                && !p.starts_with(['.', '-'])
                && !p.ends_with(['.', '-'])
                && !p.contains("..")
                && !p.contains("--")
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
    };
    s.len() <= 96 && ok(parts.next()) && ok(parts.next()) && parts.next().is_none()
}

/// Check a revision (`ORG/NAME@REV`) as the Hub takes it: a commit hash, or a branch or tag
/// name by git's ref-name rules (`git check-ref-format --allow-onelevel`, plus `--branch`'s
/// refusal of a leading `-`): no `..`, no component starting with `.` or ending with `.lock`,
/// no control character, space or any of `~^:?*[\`, no `@{`, not `@`, no leading, trailing or
/// double `/`, no trailing `.`. The error says what is wrong.
pub fn check_revision(rev: &str) -> std::result::Result<(), String> {
    let why = if rev.is_empty() {
        "is empty".to_string()
    } else if rev.len() > 255 {
        "is longer than 255 bytes".to_string()
    } else if let Some(c) = rev
        .chars()
        .find(|c| c.is_control() || " ~^:?*[\\".contains(*c))
    {
        format!("holds {c:?}")
    } else if rev.contains("..") {
        "holds `..`".to_string()
    } else if rev.contains("@{") || rev == "@" {
        "is `@` or holds `@{`".to_string()
    } else if rev.starts_with(['/', '-']) || rev.ends_with(['/', '.']) || rev.contains("//") {
        "starts with `/` or `-`, ends with `/` or `.`, or holds `//`".to_string()
    } else if rev
        .split('/')
        .any(|c| c.starts_with('.') || c.ends_with(".lock"))
    {
        "has a part starting with `.` or ending with `.lock`".to_string()
    } else {
        return Ok(());
    };
    Err(format!(
        "the revision `{}` {why}: give a branch, a tag or a commit hash",
        rev.escape_debug()
    ))
}

/// Whether a repo missing from the cache may be downloaded (`--no-download` turns it off).
static DOWNLOADS: AtomicBool = AtomicBool::new(true);
/// Whether downloads draw progress bars (`--quiet` and non-terminals turn it off).
static DOWNLOAD_PROGRESS: AtomicBool = AtomicBool::new(false);

/// Allow or forbid downloads for the rest of the process, with or without progress bars.
pub fn allow_downloads(allowed: bool, progress: bool) {
    DOWNLOADS.store(allowed, Ordering::Relaxed);
    DOWNLOAD_PROGRESS.store(progress, Ordering::Relaxed);
}

/// Find `repo` (at `revision`, default `main`) in the HF cache, fetching it first when it is
/// missing and downloads are allowed.
fn resolve_cached(repo: &str, revision: Option<&str>) -> Result<ModelRef> {
    match find_cached(repo, revision) {
        Err(_) if DOWNLOADS.load(Ordering::Relaxed) => {
            let cache = hub_cache_dir();
            let mut hub = super::hub::Hub::from_env()?;
            hub.progress = DOWNLOAD_PROGRESS.load(Ordering::Relaxed);
            let fetched = super::hub::fetch(repo, revision, &cache, &hub)?;
            let mut model = find_cached(repo, Some(&fetched.commit))?;
            model.label = match revision {
                Some(r) => format!("{repo}@{r}"),
                None => repo.to_string(),
            };
            Ok(model)
        }
        found => found,
    }
}

/// The folder of `repo` (`ORG/NAME`) in an HF cache: `models--ORG--NAME`.
pub fn repo_folder(repo: &str) -> String {
    format!("models--{}", repo.replace('/', "--"))
}

/// Find `repo` (at `revision`, default `main`) in the HF cache, never downloading.
pub fn find_cached(repo: &str, revision: Option<&str>) -> Result<ModelRef> {
    let cache = hub_cache_dir();
    let repo_dir = cache.join(repo_folder(repo));
    let rev = revision.unwrap_or("main");
    if let Err(why) = check_revision(rev) {
        bail!("{repo}@{}: {why}", rev.escape_debug());
    }
    let download = match revision {
        Some(r) => format!("hf download {} --revision {}", quote(repo), quote(r)),
        None => format!("hf download {}", quote(repo)),
    };
    if !repo_dir.is_dir() {
        bail!(
            "{repo} is not in the Hugging Face cache ({}), and --no-download forbids fetching it; run without --no-download, or download it with `{download}`, or set HF_HUB_CACHE / HF_HOME if your cache lives elsewhere",
            cache.display()
        );
    }
    let ref_file = repo_dir.join("refs").join(rev);
    let commit = if ref_file.is_file() {
        let commit = std::fs::read_to_string(&ref_file)
            .map_err(|e| crate::error::Error::read(&ref_file, e))?
            .trim()
            .to_string();
        // It names the snapshot folder: one plain path component (a commit hash, as
        // huggingface_hub writes it).
        if !commit.bytes().all(|b| b.is_ascii_alphanumeric()) || commit.is_empty() {
            bail!(
                "{}: holds `{}`, not a commit hash; delete it and fetch {repo}@{rev} again",
                ref_file.display(),
                commit.escape_debug()
            );
        }
        commit
    } else {
        rev.to_string()
    };
    let snapshot = repo_dir.join("snapshots").join(&commit);
    if !snapshot.is_dir() {
        bail!(
            "{repo}@{rev}: revision not found in the Hugging Face cache ({}); download it with `{download}`",
            repo_dir.display()
        );
    }
    Ok(ModelRef {
        dir: snapshot,
        label: match revision {
            Some(r) => format!("{repo}@{r}"),
            None => repo.to_string(),
        },
        alias: None,
        hub: Some(HubRef {
            repo: repo.to_string(),
            commit,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aliases_map_to_pairs() {
        assert_eq!(
            alias_repo("qwen2.5-vl"),
            Some("Qwen/Qwen2.5-VL-7B-Instruct")
        );
        assert_eq!(
            alias_repo("qwen2.5-vl:ref"),
            Some("Qwen/Qwen2.5-7B-Instruct")
        );
        assert_eq!(alias_repo("Qwen3-VL:ref"), Some("Qwen/Qwen3-8B"));
        assert_eq!(alias_repo("nope"), None);
    }

    #[test]
    fn repo_ids_are_recognised() {
        assert!(is_repo_id("Qwen/Qwen2.5-7B-Instruct"));
        assert!(!is_repo_id("Qwen"));
        assert!(!is_repo_id("a/b/c"));
        assert!(!is_repo_id("../x"));
        for bad in ["a/b..c", "a--b/c", "a/b-", "a/.b", "-a/b", "a/b.", "a/b c"] {
            assert!(!is_repo_id(bad), "{bad}");
        }
        assert!(is_repo_id("allenai/Olmo-3-7B-Instruct"));
        assert!(is_repo_id("openbmb/MiniCPM-V-4_5"));
    }

    #[test]
    fn revisions_follow_git_ref_rules() {
        for good in [
            "main",
            "v2",
            "v1.0",
            "refs/pr/1",
            "feature/x-y_z",
            "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1",
            "a@b",
            "ünïcode",
        ] {
            assert_eq!(check_revision(good), Ok(()), "{good}");
        }
        for bad in [
            "", "..", "../x", "a/../b", "a..b", "-x", "/a", "a/", "a//b", ".a", "a/.b", "a.lock",
            "a.lock/b", "a.", "a b", "a~", "a^", "a:", "a?", "a*", "a[", "a\\b", "@", "a@{1}",
            "a\tb", "a\u{7f}",
        ] {
            let err = check_revision(bad).unwrap_err();
            assert!(err.contains("the revision"), "{bad}: {err}");
        }
        assert!(check_revision(&"a".repeat(256)).is_err());
    }
}
