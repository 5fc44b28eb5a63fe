//! Fetching a model that is missing from the local Hugging Face cache, over the Hub's HTTP API,
//! into the cache layout transformers and the `hf` CLI read
//! (`models--ORG--NAME/{blobs,snapshots/<commit>,refs}`; `docs/reference/hub.md`).
//!
//! The Hub's answers are untrusted input: the commit and each etag become path components, so
//! they are checked ([`parse_repo_info`], [`parse_file_meta`]) before any path is built from
//! them, and every request has connect and read timeouts (`HF_HUB_DOWNLOAD_TIMEOUT`). A body
//! must also keep a least speed (`SINKMERGE_HUB_MIN_SPEED` over `SINKMERGE_HUB_SPEED_TIME`), so
//! that a server trickling bytes inside the read timeout cannot hold a download forever.
//!
//! Each file is downloaded to `blobs/<etag>.part` in a staging cache beside the real one
//! (`<cache>/.sinkmerge-staging`, where parts survive an interrupted run for the next to
//! resume with a range request). Each blob is then checked against its etag (the sha256 of an
//! LFS file, the git blob hash of a small one) and only then moved into the real cache. The
//! snapshot's links follow, and the ref last, so a killed run leaves nothing that the cache
//! lookup takes for a complete model.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use sha2::Digest;

use super::hub_cache::{check_revision, repo_folder, HubRef};
use crate::bail;
use crate::error::{Error, Result};

/// `HF_ENDPOINT`'s default.
const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// `HF_HUB_DOWNLOAD_TIMEOUT`'s default in seconds, as huggingface_hub's `constants.py`.
const DEFAULT_TIMEOUT_S: f64 = 10.0;
/// The longest `HF_HUB_DOWNLOAD_TIMEOUT` (and `SINKMERGE_HUB_SPEED_TIME`) taken: a day.
const MAX_TIMEOUT_S: f64 = 86_400.0;
/// `SINKMERGE_HUB_MIN_SPEED`'s default, bytes a second: a body slower than this over a whole
/// window is stopped, as curl's `--speed-limit`. A Hub download runs at megabytes a second; a
/// kilobyte a second would take days for the smallest model.
const DEFAULT_MIN_SPEED: u64 = 1024;
/// The largest `SINKMERGE_HUB_MIN_SPEED` taken: a terabyte a second, more than any link.
const MAX_MIN_SPEED: u64 = 1 << 40;
/// `SINKMERGE_HUB_SPEED_TIME`'s default in seconds, as curl's `--speed-time`: three read
/// timeouts, so a stall that the read timeout would end is not taken for a slow body.
const DEFAULT_SPEED_TIME_S: f64 = 30.0;
/// How many times an interrupted transfer is resumed within one run.
const RETRIES: u32 = 3;
/// The most bytes read of an API answer (a repository's file list is a few kB).
const MAX_ANSWER_BYTES: u64 = 16 << 20;

/// Where and how to fetch, from the environment huggingface_hub reads.
#[derive(Debug, Clone)]
pub struct Hub {
    pub endpoint: String,
    pub token: Option<String>,
    /// `HF_HUB_OFFLINE=1`: never touch the network.
    pub offline: bool,
    /// Draw a progress bar (bytes and rate) per file.
    pub progress: bool,
    /// The connect and read timeout of every request (`HF_HUB_DOWNLOAD_TIMEOUT`).
    pub timeout: Duration,
    /// The least speed of a body, in bytes a second (`SINKMERGE_HUB_MIN_SPEED`; 0: none)...
    pub min_speed: u64,
    /// ...averaged over windows this long (`SINKMERGE_HUB_SPEED_TIME`).
    pub speed_time: Duration,
}

impl Hub {
    /// `HF_ENDPOINT`, `HF_TOKEN` (else the token file `hf auth login` writes: `$HF_TOKEN_PATH`,
    /// else `$HF_HOME/token`, else `~/.cache/huggingface/token`, whatever the cache's location),
    /// `HF_HUB_OFFLINE` and `HF_HUB_DOWNLOAD_TIMEOUT`, read as huggingface_hub's `constants.py`
    /// reads them.
    pub fn from_env() -> Result<Hub> {
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
        let seconds = |name: &str, default: f64| -> Result<Duration> {
            let s = match var(name) {
                None => default,
                Some(v) => match v.trim().parse::<f64>() {
                    Ok(s) if s > 0.0 && s <= MAX_TIMEOUT_S => s,
                    _ => bail!(
                        "{name}={v}: not a number of seconds above 0 and at most {MAX_TIMEOUT_S}"
                    ),
                },
            };
            Ok(Duration::from_secs_f64(s))
        };
        let min_speed = match var("SINKMERGE_HUB_MIN_SPEED") {
            None => DEFAULT_MIN_SPEED,
            Some(v) => match v.trim().parse::<u64>() {
                Ok(b) if b <= MAX_MIN_SPEED => b,
                _ => bail!(
                    "SINKMERGE_HUB_MIN_SPEED={v}: not a whole number of bytes a second from 0 \
                     (no least speed) to {MAX_MIN_SPEED}"
                ),
            },
        };
        Ok(Hub {
            endpoint: var("HF_ENDPOINT")
                .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
                .trim_end_matches('/')
                .to_string(),
            token,
            offline,
            progress: false,
            timeout: seconds("HF_HUB_DOWNLOAD_TIMEOUT", DEFAULT_TIMEOUT_S)?,
            min_speed,
            speed_time: seconds("SINKMERGE_HUB_SPEED_TIME", DEFAULT_SPEED_TIME_S)?,
        })
    }
}

/// What the Hub's model API answers for a revision: the commit it resolved to and the
/// repository's files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoInfo {
    /// 40 lowercase hex digits (checked).
    pub commit: String,
    /// Every `siblings[].rfilename`, as given.
    pub files: Vec<String>,
}

/// Whether `s` is a full git commit hash as the Hub writes it: 40 lowercase hex digits.
pub fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Parse and check the body of `GET /api/models/ORG/NAME/revision/REV`: `sha` must be a
/// commit hash, since it names the snapshot folder, and `siblings` a list of file names.
pub fn parse_repo_info(body: &[u8]) -> std::result::Result<RepoInfo, String> {
    let json: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("the answer is not JSON ({e})"))?;
    let commit = match json.get("sha") {
        Some(serde_json::Value::String(s)) if is_commit(s) => s.clone(),
        Some(sha) => return Err(format!("the commit `{sha}` is not 40 hex digits")),
        None => return Err("the answer has no commit (`sha`)".to_string()),
    };
    let siblings = json
        .get("siblings")
        .and_then(|s| s.as_array())
        .ok_or("the answer has no file list (`siblings`)")?;
    let files = siblings
        .iter()
        .map(|s| {
            s.get("rfilename")
                .and_then(|f| f.as_str())
                .map(str::to_string)
                .ok_or_else(|| format!("a file entry has no name: {s}"))
        })
        .collect::<std::result::Result<_, _>>()?;
    Ok(RepoInfo { commit, files })
}

/// The headers of a file's first answer (`GET /ORG/NAME/resolve/COMMIT/FILE`, not
/// redirected) that sinkmerge reads.
#[derive(Debug, Clone, Copy, Default)]
pub struct FileHeaders<'a> {
    pub repo_commit: Option<&'a str>,
    pub linked_etag: Option<&'a str>,
    pub etag: Option<&'a str>,
}

/// The blob name of a file from its headers: the etag (`X-Linked-Etag` for LFS files, else
/// `ETag`) without its quotes and weak marker, which must be a content hash (40 hex digits:
/// git sha1; 64: sha256), lowercased. `X-Repo-Commit`, when present, must be the commit the
/// file was asked at.
pub fn parse_file_meta(h: &FileHeaders, commit: &str) -> std::result::Result<String, String> {
    if let Some(c) = h.repo_commit {
        if c.trim() != commit {
            return Err(format!(
                "the file is served from commit `{}`, not the {commit} asked for",
                c.trim()
            ));
        }
    }
    let raw = h.linked_etag.or(h.etag).ok_or("the answer has no etag")?;
    let trimmed = raw.trim();
    let etag = trimmed
        .strip_prefix("W/")
        .unwrap_or(trimmed)
        .trim_matches('"');
    if !matches!(etag.len(), 40 | 64) || !etag.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("the etag `{raw}` is not a content hash"));
    }
    Ok(etag.to_ascii_lowercase())
}

/// A file's size from the `Content-Range` of the answer to `Range: bytes=0-0`
/// (`bytes 0-0/SIZE`).
pub fn parse_size(content_range: Option<&str>) -> std::result::Result<u64, String> {
    let range = content_range.ok_or("the answer has no Content-Range")?;
    range
        .trim()
        .strip_prefix("bytes ")
        .and_then(|r| r.rsplit_once('/'))
        .and_then(|(_, size)| size.parse::<u64>().ok())
        .ok_or_else(|| format!("the Content-Range `{range}` gives no size"))
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
    if let Err(why) = check_revision(rev) {
        bail!("{repo}@{}: {why}", rev.escape_debug());
    }
    if hub.offline {
        bail!(
            "{repo}@{rev} is not in the Hugging Face cache ({}), and HF_HUB_OFFLINE is set, so \
             nothing is downloaded; unset it, or fetch the model on a machine with network access",
            cache.display()
        );
    }
    guarded(repo, hub, || fetch_online(repo, rev, cache, hub))
}

/// Run `f`, turning a panic inside it (the HTTP and TLS stack are dependencies) into an error
/// that names the endpoint, with exit code 1, instead of a crash. The default hook, which would
/// print the panic, is silenced meanwhile.
fn guarded<T>(repo: &str, hub: &Hub, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    outcome.unwrap_or_else(|panic| {
        let what = crate::error::panic_message(panic.as_ref()).unwrap_or_default();
        Err(Error::Internal(format!(
            "{repo}: fetching from the Hub at {} failed inside the HTTP client ({}); nothing was \
             cached",
            hub.endpoint,
            what.lines().next().unwrap_or("a panic")
        )))
    })
}

fn fetch_online(repo: &str, rev: &str, cache: &Path, hub: &Hub) -> Result<HubRef> {
    let client = Client::new(repo, rev, hub);
    let info = client.info()?;
    let commit = info.commit.clone();
    let (weights, others): (Vec<String>, Vec<String>) = (info.files.iter())
        .filter(|f| wanted(f))
        .cloned()
        .partition(|f| f.ends_with(".safetensors"));
    if weights.is_empty() {
        bail!(
            "{repo}@{rev}: the repository has no safetensors weights (only {}); sinkmerge reads \
             safetensors only: convert the weights with transformers first",
            describe_weights(&info.files)
        );
    }
    let staging = cache.join(".sinkmerge-staging");
    let staged_blobs = staging.join(repo_folder(repo)).join("blobs");
    let repo_dir = cache.join(repo_folder(repo));
    let blobs = repo_dir.join("blobs");
    // One file into the staging cache, checked against its etag: (name, blob, etag). The files
    // are asked for at the commit, so all come from the one the API named.
    let download = |file: &str| -> Result<(String, PathBuf, String)> {
        let (etag, size, url) = client.metadata(&commit, file)?;
        let staged = staged_blobs.join(&etag);
        if blobs.join(&etag).is_file() || staged.is_file() {
            return Ok((file.to_string(), staged, etag));
        }
        std::fs::create_dir_all(&staged_blobs).map_err(|e| Error::write(&staged_blobs, e))?;
        // Another run fetching the same blob appends to the same part: one at a time.
        let _lock = lock(&staged_blobs.join(format!("{etag}.lock")))?;
        if !staged.is_file() {
            let part = staged_blobs.join(format!("{etag}.part"));
            client.download(&url, file, size, &part)?;
            if let Err(e) = verify(&part, &etag) {
                let _ = std::fs::remove_file(&part);
                return Err(bad_download(repo, rev, file, e));
            }
            std::fs::rename(&part, &staged).map_err(|e| Error::write(&staged, e))?;
        }
        Ok((file.to_string(), staged, etag))
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
        Some((_, staged, etag)) => {
            let blob = if staged.is_file() {
                staged.clone()
            } else {
                blobs.join(etag)
            };
            shards_of_index(repo, &blob, &weights)?
        }
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
        // A branch name may hold `/` (`refs/pr/1`), as in huggingface_hub's cache.
        let ref_file = repo_dir.join("refs").join(rev);
        if let Some(dir) = ref_file.parent() {
            std::fs::create_dir_all(dir).map_err(|e| Error::write(dir, e))?;
        }
        super::output::write_file_atomic(&ref_file, commit.as_bytes())?;
    }
    let _ = std::fs::remove_dir_all(staging.join(repo_folder(repo)));
    // Gone when no other repo has parts waiting in it.
    let _ = std::fs::remove_dir(&staging);
    Ok(HubRef {
        repo: repo.to_string(),
        commit,
    })
}

/// An exclusive lock on `path` (created), held until the file is dropped.
fn lock(path: &Path) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| Error::write(path, e))?;
    // SAFETY: flock(2) on a descriptor this function owns; closing it releases the lock.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(Error::write(path, std::io::Error::last_os_error()));
    }
    Ok(file)
}

/// The Hub's HTTP API, for one repository and revision, with the timeouts of [`Hub`].
struct Client<'a> {
    repo: &'a str,
    rev: &'a str,
    hub: &'a Hub,
    /// Follows redirects (large files live in a separate storage).
    agent: ureq::Agent,
    /// Follows none, so that the Hub's own headers of a redirected file can be read.
    direct: ureq::Agent,
}

/// Why a transfer stopped: retried (a dropped connection, a 5xx), or not.
enum Stop {
    Retry(Error),
    Fatal(Error),
}

impl<'a> Client<'a> {
    fn new(repo: &'a str, rev: &'a str, hub: &'a Hub) -> Client<'a> {
        let agent = |redirects| {
            ureq::AgentBuilder::new()
                .try_proxy_from_env(true)
                .timeout_connect(hub.timeout)
                .timeout_read(hub.timeout)
                .timeout_write(hub.timeout)
                .redirects(redirects)
                // The token follows a redirect within the Hub (a renamed repository), never
                // one to another host (a large file's storage).
                .redirect_auth_headers(ureq::RedirectAuthHeaders::SameHost)
                .user_agent(concat!("sinkmerge/", env!("CARGO_PKG_VERSION")))
                .build()
        };
        Client {
            repo,
            rev,
            hub,
            agent: agent(5),
            direct: agent(0),
        }
    }

    /// A GET of `url`, with the token when `url` is on the Hub itself (never to the storage a
    /// large file is redirected to).
    fn get(&self, agent: &ureq::Agent, url: &str) -> ureq::Request {
        let request = agent.get(url);
        match &self.hub.token {
            Some(t) if origin(url) == origin(&self.hub.endpoint) => {
                request.set("Authorization", &format!("Bearer {t}"))
            }
            _ => request,
        }
    }

    /// The commit the revision resolves to, and the repository's files.
    fn info(&self) -> Result<RepoInfo> {
        let url = format!(
            "{}/api/models/{}/revision/{}",
            self.hub.endpoint,
            self.repo,
            encode(self.rev)
        );
        let answer = self
            .get(&self.agent, &url)
            .call()
            .map_err(|e| self.failed(e))?;
        let mut body = Vec::new();
        self.paced(answer.into_reader().take(MAX_ANSWER_BYTES))
            .read_to_end(&mut body)
            .map_err(|e| self.dropped(&e))?;
        parse_repo_info(&body).map_err(|why| self.unusable("", &why))
    }

    /// A file's etag (checked), its size and the URL to download it from, from the answer to
    /// `Range: bytes=0-0`, as huggingface_hub's `get_hf_file_metadata` asks.
    fn metadata(&self, commit: &str, file: &str) -> Result<(String, u64, String)> {
        let mut url = format!(
            "{}/{}/resolve/{commit}/{}",
            self.hub.endpoint,
            self.repo,
            encode(file)
        );
        let first = |url: &str| {
            self.get(&self.direct, url)
                .set("Range", "bytes=0-0")
                .call()
                .map_err(|e| self.failed(e))
        };
        let mut answer = first(&url)?;
        // A renamed repository redirects within the Hub (a relative Location), which keeps
        // the Hub's headers; a large file redirects to its storage (an absolute one).
        for _ in 0..5 {
            match answer.header("Location") {
                Some(to) if is_redirect(answer.status()) && to.starts_with('/') => {
                    url = format!("{}{to}", origin(&url));
                    answer = first(&url)?;
                }
                _ => break,
            }
        }
        let headers = FileHeaders {
            repo_commit: answer.header("X-Repo-Commit"),
            linked_etag: answer.header("X-Linked-Etag"),
            etag: answer.header("ETag"),
        };
        let etag = parse_file_meta(&headers, commit).map_err(|why| self.unusable(file, &why))?;
        let size = if is_redirect(answer.status()) {
            let to = (answer.header("Location"))
                .ok_or_else(|| self.unusable(file, "a redirect without a Location"))?;
            let stored = self
                .get(&self.agent, to)
                .set("Range", "bytes=0-0")
                .call()
                .map_err(|e| self.failed(e))?;
            parse_size(stored.header("Content-Range"))
        } else {
            parse_size(answer.header("Content-Range"))
        };
        let size = size.map_err(|why| self.unusable(file, &why))?;
        Ok((etag, size, url))
    }

    /// Fill `part` to `size` bytes from `url`, resuming with range requests: what a killed run
    /// left, and up to [`RETRIES`] dropped connections within this one.
    fn download(&self, url: &str, file: &str, size: u64, part: &Path) -> Result<()> {
        let mut out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(part)
            .map_err(|e| Error::write(part, e))?;
        let bar = crate::progress::bytes(size, &short(file), self.hub.progress);
        let mut failures = 0;
        loop {
            let mut have = out.metadata().map_err(|e| Error::read(part, e))?.len();
            if have > size {
                out.set_len(0).map_err(|e| Error::write(part, e))?;
                have = 0;
            }
            if have == size {
                bar.finish_and_clear();
                return Ok(());
            }
            let error = match self.transfer(url, have, size, &mut out, part, &bar) {
                Ok(()) if out.metadata().is_ok_and(|m| m.len() == size) => continue,
                Ok(()) => self.unusable(file, "the body ended before the whole file arrived"),
                Err(Stop::Retry(e)) => e,
                Err(Stop::Fatal(e)) => return Err(e),
            };
            failures += 1;
            if failures > RETRIES {
                return Err(error);
            }
            std::thread::sleep(Duration::from_millis(250 * u64::from(failures)));
        }
    }

    /// One request for `url` from byte `have` on, appended to `out`.
    fn transfer(
        &self,
        url: &str,
        have: u64,
        size: u64,
        out: &mut std::fs::File,
        part: &Path,
        bar: &ProgressBar,
    ) -> std::result::Result<(), Stop> {
        let answer = match self
            .get(&self.agent, url)
            .set("Range", &format!("bytes={have}-"))
            .call()
        {
            Ok(answer) => answer,
            Err(e @ ureq::Error::Status(500.., _)) | Err(e @ ureq::Error::Transport(_)) => {
                return Err(Stop::Retry(self.failed(e)))
            }
            Err(e) => return Err(Stop::Fatal(self.failed(e))),
        };
        // A server that ignores the range sends the whole file: the part starts over.
        let start = if answer.status() == 206 {
            have
        } else {
            out.set_len(0)
                .map_err(|e| Stop::Fatal(Error::write(part, e)))?;
            0
        };
        bar.set_position(start);
        let mut body = self.paced(answer.into_reader().take(size - start));
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Stop::Retry(self.dropped(&e))),
            };
            out.write_all(&buf[..n])
                .map_err(|e| Stop::Fatal(Error::write(part, e)))?;
            bar.inc(n as u64);
        }
    }

    /// An answer that breaks the protocol (a commit or etag that is no hash, a missing
    /// header): the endpoint is broken or hostile, which is not the user's input (exit 1).
    fn unusable(&self, file: &str, why: &str) -> Error {
        let file = if file.is_empty() {
            String::new()
        } else {
            format!(" {file}:")
        };
        Error::Internal(format!(
            "{}@{}:{file} the Hub at {} gave an answer sinkmerge cannot use ({why}); nothing \
             was cached",
            self.repo, self.rev, self.hub.endpoint
        ))
    }

    /// `body`, failing once it falls below the least speed.
    fn paced<R: Read>(&self, body: R) -> Paced<R> {
        Paced {
            body,
            min_speed: self.hub.min_speed,
            window: self.hub.speed_time,
            since: Instant::now(),
            got: 0,
        }
    }

    /// A connection that failed while a body was read.
    fn dropped(&self, e: &std::io::Error) -> Error {
        if is_timeout(e) {
            return self.timed_out();
        }
        if e.get_ref().is_some_and(|inner| inner.is::<TooSlow>()) {
            return Error::Internal(format!(
                "{}@{}: the Hub at {} sent fewer than {} bytes a second for {} s \
                 (SINKMERGE_HUB_MIN_SPEED, SINKMERGE_HUB_SPEED_TIME); run again to resume, or \
                 lower SINKMERGE_HUB_MIN_SPEED for a slow link",
                self.repo,
                self.rev,
                self.hub.endpoint,
                self.hub.min_speed,
                self.hub.speed_time.as_secs_f64()
            ));
        }
        Error::Internal(format!(
            "{}@{}: the connection to the Hub at {} failed ({e}); run again to resume",
            self.repo, self.rev, self.hub.endpoint
        ))
    }

    fn timed_out(&self) -> Error {
        Error::Internal(format!(
            "{}@{}: the Hub at {} did not answer within {} s (HF_HUB_DOWNLOAD_TIMEOUT); check \
             the network or HF_ENDPOINT, raise HF_HUB_DOWNLOAD_TIMEOUT for a slow link, or set \
             HF_HUB_OFFLINE=1 to work from the cache only",
            self.repo,
            self.rev,
            self.hub.endpoint,
            self.hub.timeout.as_secs_f64()
        ))
    }

    /// One clear message for each way a request fails. A repository, revision or access the
    /// Hub refuses is the reference's fault (exit 2); a network or server failure is not
    /// (exit 1). The Hub names the reason in `X-Error-Code` (`RepoNotFound`,
    /// `RevisionNotFound`, `GatedRepo`, ...); it answers 401 rather than 404 for a repository
    /// it will not show an anonymous user.
    fn failed(&self, e: ureq::Error) -> Error {
        let (repo, rev, at) = (self.repo, self.rev, &self.hub.endpoint);
        let (status, code) = match &e {
            ureq::Error::Status(status, answer) => (
                *status,
                answer
                    .header("X-Error-Code")
                    .unwrap_or_default()
                    .to_string(),
            ),
            ureq::Error::Transport(t) => {
                if is_timeout(t) {
                    return self.timed_out();
                }
                return Error::Internal(format!(
                    "{repo}@{rev} is not in the Hugging Face cache, and the Hub at {at} cannot \
                     be reached ({t}); check the network or HF_ENDPOINT, or set \
                     HF_HUB_OFFLINE=1 to work from the cache only"
                ));
            }
        };
        Error::BadInput(match (code.as_str(), status, self.hub.token.is_some()) {
            ("RevisionNotFound", ..) => {
                format!("{repo}@{rev}: the revision `{rev}` does not exist on the Hub at {at}")
            }
            ("RepoNotFound", _, false) => format!(
                "{repo}: no such repository on the Hub at {at}, or it is private (check the \
                 name, or set HF_TOKEN for a private repository)"
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
            (_, 404, _) if rev == "main" => {
                format!("{repo}: no such repository on the Hub at {at}")
            }
            (_, 404, _) => format!(
                "{repo}@{rev}: the repository or the revision `{rev}` does not exist on the Hub \
                 at {at}"
            ),
            _ => {
                return Error::Internal(format!(
                    "{repo}@{rev}: the Hub at {at} answered {status}; try again later"
                ))
            }
        })
    }
}

/// A body that fails once fewer than `min_speed` bytes a second arrived over a window of at
/// least `window`, as curl's `--speed-limit` and `--speed-time` do. A server that sends a byte
/// now and then never trips the read timeout, which only bounds one silent read.
struct Paced<R> {
    body: R,
    min_speed: u64,
    window: Duration,
    /// When the current window began, and the bytes read since.
    since: Instant,
    got: u64,
}

/// The error [`Paced`] fails with, which [`Client::dropped`] names.
#[derive(Debug)]
struct TooSlow;

impl std::fmt::Display for TooSlow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the body arrived below the least speed")
    }
}

impl std::error::Error for TooSlow {}

impl<R: Read> Read for Paced<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.body.read(buf)?;
        self.got += n as u64;
        let elapsed = self.since.elapsed();
        if n > 0 && elapsed >= self.window {
            // The average over the whole window: a read that blocked past its end counts
            // its wait.
            if (self.got as f64) < self.min_speed as f64 * elapsed.as_secs_f64() {
                return Err(std::io::Error::other(TooSlow));
            }
            self.since = Instant::now();
            self.got = 0;
        }
        Ok(n)
    }
}

/// Whether an error, or one of its sources, is an I/O timeout.
fn is_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
            ) {
                return true;
            }
        }
        cause = c.source();
    }
    false
}

fn is_redirect(status: u16) -> bool {
    matches!(status, 301 | 302 | 303 | 307 | 308)
}

/// `scheme://host[:port]` of a URL.
fn origin(url: &str) -> &str {
    let after_scheme = url.find("://").map_or(0, |i| i + 3);
    match url[after_scheme..].find('/') {
        Some(i) => &url[..after_scheme + i],
        None => url,
    }
}

/// A path segment of a URL: every byte but RFC 3986's unreserved ones percent-encoded (a
/// branch's `/` too, as huggingface_hub quotes a revision).
fn encode(segment: &str) -> String {
    segment
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
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
/// The name comes from the Hub, so it is cut by characters, never inside one.
fn short(file: &str) -> String {
    let chars = file.chars().count();
    if chars > 24 {
        format!("…{}", file.chars().skip(chars - 23).collect::<String>())
    } else {
        file.to_string()
    }
}

fn describe_weights(files: &[String]) -> String {
    let weights: Vec<&str> = files
        .iter()
        .map(String::as_str)
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

/// A body that does not match its hash: the server's failure, not the reference's (exit 1).
fn bad_download(repo: &str, rev: &str, file: &str, why: String) -> Error {
    Error::Internal(format!(
        "{repo}@{rev}: {file} arrived corrupted ({why}); nothing was cached, run again to \
         download it anew"
    ))
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

    const COMMIT: &str = "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1";

    #[test]
    fn the_api_answer_needs_a_commit_hash_and_a_file_list() {
        let good = format!(r#"{{"sha":"{COMMIT}","siblings":[{{"rfilename":"config.json"}}]}}"#);
        assert_eq!(
            parse_repo_info(good.as_bytes()),
            Ok(RepoInfo {
                commit: COMMIT.to_string(),
                files: vec!["config.json".to_string()],
            })
        );
        for bad in [
            r#"{"sha":"../../x","siblings":[]}"#.to_string(),
            format!(r#"{{"sha":"{}","siblings":[]}}"#, COMMIT.to_uppercase()),
            format!(r#"{{"sha":"{}","siblings":[]}}"#, &COMMIT[1..]),
            r#"{"sha":7,"siblings":[]}"#.to_string(),
            r#"{"siblings":[]}"#.to_string(),
            format!(r#"{{"sha":"{COMMIT}"}}"#),
            format!(r#"{{"sha":"{COMMIT}","siblings":[{{"name":"x"}}]}}"#),
            "<html>".to_string(),
        ] {
            assert!(parse_repo_info(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn etags_must_be_hashes_and_files_come_from_the_commit() {
        let sha1 = "ce013625030ba8dba906f756967f9e9ca394464a";
        let sha256 = "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03";
        let headers = |linked, etag| FileHeaders {
            repo_commit: Some(COMMIT),
            linked_etag: linked,
            etag,
        };
        let quoted = format!("\"{sha1}\"");
        let weak = format!("W/\"{}\"", sha1.to_uppercase());
        assert_eq!(
            parse_file_meta(&headers(None, Some(&quoted)), COMMIT).as_deref(),
            Ok(sha1)
        );
        assert_eq!(
            parse_file_meta(&headers(None, Some(&weak)), COMMIT).as_deref(),
            Ok(sha1)
        );
        // An LFS file's linked etag wins over the pointer's.
        assert_eq!(
            parse_file_meta(&headers(Some(sha256), Some("\"pointer\"")), COMMIT).as_deref(),
            Ok(sha256)
        );
        let not_hex = "g".repeat(40);
        for bad in ["../../x", "\"../x.lock\"", "", "W/", &sha1[1..], &not_hex] {
            assert!(
                parse_file_meta(&headers(None, Some(bad)), COMMIT).is_err(),
                "{bad}"
            );
        }
        assert!(parse_file_meta(&headers(None, None), COMMIT).is_err());
        let elsewhere = FileHeaders {
            repo_commit: Some("../../x"),
            ..headers(None, Some(&quoted))
        };
        assert!(parse_file_meta(&elsewhere, COMMIT).is_err());
        assert_eq!(parse_size(Some("bytes 0-0/1234")), Ok(1234));
        for bad in [
            None,
            Some("bytes 0-0/"),
            Some("0-0/12"),
            Some("bytes 0-0/-1"),
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_panic_inside_the_client_becomes_an_error_naming_the_endpoint() {
        let hub = Hub {
            endpoint: "http://hub.example".to_string(),
            token: None,
            offline: false,
            progress: false,
            timeout: Duration::from_secs(1),
            min_speed: DEFAULT_MIN_SPEED,
            speed_time: Duration::from_secs(1),
        };
        let err = guarded::<()>("org/name", &hub, || panic!("boom")).unwrap_err();
        assert_eq!(err.exit_code(), crate::error::EXIT_FAILURE);
        let message = err.to_string();
        assert!(message.contains("http://hub.example") && message.contains("boom"));
        assert_eq!(guarded("org/name", &hub, || Ok(7)).unwrap(), 7);
    }

    #[test]
    fn long_names_are_cut_by_characters() {
        assert_eq!(short("config.json"), "config.json");
        assert_eq!(
            short("model-00001-of-00004.safetensors"),
            "…01-of-00004.safetensors"
        );
        let name = format!("{}.safetensors", "é".repeat(20));
        assert_eq!(short(&name).chars().count(), 24);
    }

    #[test]
    fn url_segments_are_quoted_and_origins_found() {
        assert_eq!(encode("refs/pr/1"), "refs%2Fpr%2F1");
        assert_eq!(encode("a b#c"), "a%20b%23c");
        assert_eq!(origin("http://127.0.0.1:80/x/y"), "http://127.0.0.1:80");
        assert_eq!(origin("https://huggingface.co"), "https://huggingface.co");
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
