//! Fetching a model that is missing from the local Hugging Face cache, with the Hub's own Rust
//! client (`hf-hub`), into the cache layout transformers and the `hf` CLI read
//! (`models--ORG--NAME/{blobs,snapshots/<commit>,refs}`; `docs/reference/hub.md`).
//!
//! `hf-hub` downloads each file to `blobs/<etag>.part`, resumes a part with a range request, and
//! renames it when the body is complete. It does not check what it received, so it downloads
//! into a staging cache beside the real one (`<cache>/.sinkmerge-staging`, where parts survive an
//! interrupted run for the next to resume). Each blob is then checked against its etag (the
//! sha256 of an LFS file, the git blob hash of a small one) and only then moved into the real
//! cache. The snapshot's links follow, and the ref last, so a killed run leaves nothing that
//! the cache lookup takes for a complete model.

use std::io::Read;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use indicatif::ProgressBar;
use sha2::Digest;

use super::resolve::{repo_folder, HubRef};
use crate::bail;
use crate::error::{Error, Result};

/// `HF_ENDPOINT`'s default.
const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Where and how to fetch, from the environment huggingface_hub reads.
#[derive(Debug, Clone)]
pub struct Hub {
    pub endpoint: String,
    pub token: Option<String>,
    /// `HF_HUB_OFFLINE=1`: never touch the network.
    pub offline: bool,
    /// Draw a progress bar (bytes and rate) per file.
    pub progress: bool,
}

impl Hub {
    /// `HF_ENDPOINT`, `HF_TOKEN` (else the token file `hf auth login` writes: `$HF_TOKEN_PATH`,
    /// else `$HF_HOME/token`, else `~/.cache/huggingface/token`, whatever the cache's location)
    /// and `HF_HUB_OFFLINE`, read as huggingface_hub's `constants.py` reads them.
    pub fn from_env() -> Hub {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let token_file = var("HF_TOKEN_PATH").map(PathBuf::from).unwrap_or_else(|| {
            let home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
                var("XDG_CACHE_HOME")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| {
                        PathBuf::from(var("HOME").unwrap_or_default()).join(".cache")
                    })
                    .join("huggingface")
            });
            home.join("token")
        });
        let token = var("HF_TOKEN").or_else(|| {
            std::fs::read_to_string(token_file)
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        });
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
        });
        Hub {
            endpoint: var("HF_ENDPOINT")
                .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
                .trim_end_matches('/')
                .to_string(),
            token,
            offline,
            progress: false,
        }
    }
}

/// Whether sinkmerge needs `name` of a repo: configuration, tokenizer and chat-template files,
/// the weight index and safetensors shards. Pickled weights, other formats and the image and video
/// processors' files are left on the Hub.
pub fn wanted(name: &str) -> bool {
    if name.contains('/') {
        return false;
    }
    const FILES: [&str; 12] = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "chat_template.jinja",
        "chat_template.json",
        "model.safetensors.index.json",
    ];
    FILES.contains(&name) || name.ends_with(".safetensors")
}

/// Download `repo` at `revision` (default `main`) into `cache` and return its commit.
pub fn fetch(repo: &str, revision: Option<&str>, cache: &Path, hub: &Hub) -> Result<HubRef> {
    let rev = revision.unwrap_or("main");
    if hub.offline {
        bail!(
            "{repo}@{rev} is not in the Hugging Face cache ({}), and HF_HUB_OFFLINE is set, so \
             nothing is downloaded; unset it, or fetch the model on a machine with network access",
            cache.display()
        );
    }
    let staging = cache.join(".sinkmerge-staging");
    let api = ApiBuilder::from_cache(Cache::new(staging.clone()))
        .with_endpoint(hub.endpoint.clone())
        .with_token(hub.token.clone())
        .with_retries(3)
        .with_progress(false)
        .with_user_agent("sinkmerge", env!("CARGO_PKG_VERSION"))
        .build()
        .map_err(|e| Error::Internal(format!("cannot start the Hub client: {e}")))?;
    let handle = api.repo(Repo::with_revision(
        repo.to_string(),
        RepoType::Model,
        rev.to_string(),
    ));
    let info = handle.info().map_err(|e| hub_error(repo, rev, hub, &e))?;
    let commit = info.sha.clone();
    let (weights, others): (Vec<String>, Vec<String>) = (info.siblings.iter())
        .map(|s| s.rfilename.clone())
        .filter(|f| wanted(f))
        .partition(|f| f.ends_with(".safetensors"));
    if weights.is_empty() {
        bail!(
            "{repo}@{rev}: the repository has no safetensors weights (only {}); sinkmerge reads \
             safetensors only: convert the weights with transformers first",
            describe_weights(&info.siblings)
        );
    }
    let repo_dir = cache.join(repo_folder(repo));
    // One file into the staging cache, checked against its etag: (name, blob, etag).
    let download = |file: &str| -> Result<(String, PathBuf, String)> {
        let bar = crate::progress::bytes(0, &short(file), hub.progress);
        let path = handle
            .download_with_progress(file, Bar(bar.clone()))
            .map_err(|e| hub_error(repo, rev, hub, &e))?;
        bar.finish_and_clear();
        // The staging snapshot links to blobs/<etag>.
        let blob = std::fs::canonicalize(&path).map_err(|e| Error::read(&path, e))?;
        let etag = blob
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        if let Err(e) = verify(&blob, &etag) {
            let _ = std::fs::remove_file(&blob);
            return Err(bad_download(repo, rev, file, e));
        }
        Ok((file.to_string(), blob, etag))
    };
    // The small files first: the index then says which shards the model is made of.
    let mut fetched = others
        .iter()
        .map(|f| download(f))
        .collect::<Result<Vec<_>>>()?;
    let index = fetched
        .iter()
        .find(|f| f.0 == "model.safetensors.index.json");
    let shards = match index {
        Some((_, blob, _)) => shards_of_index(repo, blob, &weights)?,
        // Without an index the checkpoint is model.safetensors when there is one (a second copy
        // such as Mistral's consolidated.safetensors is not read), else every shard.
        None if weights.iter().any(|w| w == "model.safetensors") => {
            vec!["model.safetensors".to_string()]
        }
        None => weights,
    };
    for shard in &shards {
        fetched.push(download(shard)?);
    }
    // Every file arrived and checks out: move them in, link the snapshot, then write the ref.
    let blobs = repo_dir.join("blobs");
    let snapshot = repo_dir.join("snapshots").join(&commit);
    for dir in [&blobs, &snapshot] {
        std::fs::create_dir_all(dir).map_err(|e| Error::write(dir, e))?;
    }
    for (file, staged, etag) in &fetched {
        let blob = blobs.join(etag);
        if !blob.exists() {
            std::fs::rename(staged, &blob).map_err(|e| Error::write(&blob, e))?;
        }
        let link = snapshot.join(file);
        if link.symlink_metadata().is_err() {
            std::os::unix::fs::symlink(Path::new("../../blobs").join(etag), &link)
                .map_err(|e| Error::write(&link, e))?;
        }
    }
    if rev != commit {
        let refs = repo_dir.join("refs");
        std::fs::create_dir_all(&refs).map_err(|e| Error::write(&refs, e))?;
        super::output::write_file_atomic(&refs.join(rev), commit.as_bytes())?;
    }
    let _ = std::fs::remove_dir_all(staging.join(repo_folder(repo)));
    // Gone when no other repo has parts waiting in it.
    let _ = std::fs::remove_dir(&staging);
    Ok(HubRef {
        repo: repo.to_string(),
        commit,
    })
}

/// The shards `model.safetensors.index.json` maps tensors to, each of which the repo must hold.
fn shards_of_index(repo: &str, index: &Path, listed: &[String]) -> Result<Vec<String>> {
    let json = super::read_json(index)?;
    let mut shards: Vec<String> = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .map(|m| {
            m.values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    shards.sort();
    shards.dedup();
    if shards.is_empty() {
        bail!("{repo}: model.safetensors.index.json has no weight_map");
    }
    if let Some(missing) = shards.iter().find(|s| !listed.contains(s)) {
        bail!("{repo}: model.safetensors.index.json names the shard {missing}, which the repository lacks");
    }
    Ok(shards)
}

/// A file name short enough for a progress bar's message.
fn short(file: &str) -> String {
    if file.len() > 24 {
        format!("…{}", &file[file.len() - 23..])
    } else {
        file.to_string()
    }
}

fn describe_weights(siblings: &[hf_hub::api::Siblings]) -> String {
    let weights: Vec<&str> = siblings
        .iter()
        .map(|s| s.rfilename.as_str())
        .filter(|f| {
            [".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt"]
                .iter()
                .any(|x| f.ends_with(x))
        })
        .collect();
    if weights.is_empty() {
        "no weight files at all".to_string()
    } else {
        weights.join(", ")
    }
}

/// A blob's content against its etag: 64 hex digits are an LFS file's sha256; 40 are the git
/// blob hash, sha1 over `blob <len>\0` and the content.
fn verify(blob: &Path, etag: &str) -> std::result::Result<(), String> {
    let mut file = std::fs::File::open(blob).map_err(|e| e.to_string())?;
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    let mut sha256 = sha2::Sha256::new();
    let mut sha1 = sha1::Sha1::new();
    sha1.update(format!("blob {len}\0").as_bytes());
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        match etag.len() {
            64 => sha256.update(&buf[..n]),
            _ => sha1.update(&buf[..n]),
        }
    }
    let got = match etag.len() {
        64 => hex(&sha256.finalize()),
        40 => hex(&sha1.finalize()),
        _ => {
            return Err(format!(
                "the Hub gave the etag `{etag}`, which is not a content hash"
            ))
        }
    };
    if got == etag.to_ascii_lowercase() {
        Ok(())
    } else {
        Err(format!(
            "its content hashes to {got}, but the Hub's etag is {etag}"
        ))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn bad_download(repo: &str, rev: &str, file: &str, why: String) -> Error {
    Error::BadInput(format!(
        "{repo}@{rev}: {file} arrived corrupted ({why}); nothing was cached, run again to \
         download it anew"
    ))
}

/// One clear message for each way a request fails. The Hub names the reason in `X-Error-Code`
/// (`RepoNotFound`, `RevisionNotFound`, `GatedRepo`, ...); it answers 401 rather than 404 for a
/// repository it will not show an anonymous user.
fn hub_error(repo: &str, rev: &str, hub: &Hub, e: &ApiError) -> Error {
    let (status, code) = match e {
        ApiError::RequestError(inner) => match inner.as_ref() {
            ureq::Error::Status(status, response) => (
                *status,
                response
                    .header("X-Error-Code")
                    .unwrap_or_default()
                    .to_string(),
            ),
            ureq::Error::Transport(t) => {
                return Error::BadInput(format!(
                    "{repo}@{rev} is not in the Hugging Face cache, and the Hub at {} cannot be \
                     reached ({t}); check the network or HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to \
                     work from the cache only",
                    hub.endpoint
                ))
            }
        },
        ApiError::TooManyRetries(inner) => return hub_error(repo, rev, hub, inner),
        _ => return Error::BadInput(format!("{repo}@{rev}: download failed: {e}")),
    };
    let at = &hub.endpoint;
    Error::BadInput(match (code.as_str(), status, hub.token.is_some()) {
        ("RevisionNotFound", ..) => {
            format!("{repo}@{rev}: the revision `{rev}` does not exist on the Hub at {at}")
        }
        ("RepoNotFound", _, false) => format!(
            "{repo}: no such repository on the Hub at {at}, or it is private (check the name, or \
             set HF_TOKEN for a private repository)"
        ),
        ("RepoNotFound", _, true) => format!(
            "{repo}: no such repository on the Hub at {at}, or the token has no access to it"
        ),
        (_, 401 | 403, false) => format!(
            "{repo}: the Hub refused access ({status}); the repository is gated or private: \
             accept its terms on the Hub and set HF_TOKEN (or log in with `hf auth login`)"
        ),
        (_, 401 | 403, true) => format!(
            "{repo}: the Hub refused access with the given token ({status}); the token lacks \
             access to this gated or private repository"
        ),
        (_, 404, _) if rev == "main" => format!("{repo}: no such repository on the Hub at {at}"),
        (_, 404, _) => format!(
            "{repo}@{rev}: the repository or the revision `{rev}` does not exist on the Hub at {at}"
        ),
        _ => format!("{repo}@{rev}: the Hub answered {status}: {e}"),
    })
}

/// `hf-hub`'s progress callbacks on an indicatif bar (bytes and rate).
struct Bar(ProgressBar);

impl hf_hub::api::Progress for Bar {
    fn init(&mut self, size: usize, _filename: &str) {
        self.0.set_length(size as u64);
        self.0.set_position(0);
    }

    fn update(&mut self, size: usize) {
        self.0.inc(size as u64);
    }

    fn finish(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_sinkmerge_reads_is_wanted() {
        for f in [
            "config.json",
            "model-00001-of-00004.safetensors",
            "tokenizer.json",
        ] {
            assert!(wanted(f), "{f}");
        }
        for f in [
            "pytorch_model.bin",
            "model.pt",
            "preprocessor_config.json",
            "onnx/model.safetensors",
            "README.md",
        ] {
            assert!(!wanted(f), "{f}");
        }
    }

    #[test]
    fn blobs_are_checked_against_sha256_and_git_etags() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("blob");
        std::fs::write(&path, b"hello\n").unwrap();
        // `git hash-object` and `sha256sum` of "hello\n".
        assert!(verify(&path, "ce013625030ba8dba906f756967f9e9ca394464a").is_ok());
        assert!(verify(
            &path,
            "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"
        )
        .is_ok());
        assert!(verify(&path, "0000000000000000000000000000000000000000").is_err());
        assert!(verify(&path, "not-a-hash").is_err());
    }
}
