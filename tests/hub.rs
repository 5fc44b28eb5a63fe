//! Fetching from the Hub, against a local server on 127.0.0.1 that speaks the Hub's protocol:
//! `GET /api/models/ORG/NAME/revision/REV` for the file list and commit, and
//! `GET /ORG/NAME/resolve/REV/FILE` with the commit and etag headers, range requests, and a
//! redirect to `/lfs/SHA256` for large files, as huggingface.co does. On purpose it can also
//! answer as a broken or hostile endpoint would ([`Faults`]). The server is test code:
//! loopback only, and it stops after a minute or 2000 requests.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha1::Digest as _;

use crate::util::{fixture, ok, refused, sinkmerge, Sinkmerge};

/// One file of a served repository.
#[derive(Clone)]
struct File {
    body: Vec<u8>,
    /// sha256 for LFS files (served through a redirect), the git blob sha1 otherwise.
    etag: String,
    lfs: bool,
}

#[derive(Clone, Default)]
struct ServedRepo {
    /// revision name or commit -> (commit, files)
    revisions: HashMap<String, (String, HashMap<String, File>)>,
    /// A token the repo requires (gated).
    token: Option<String>,
}

/// What the server does wrong on purpose.
#[derive(Clone, Default)]
struct Faults {
    /// Files whose first full-body response stops halfway (connection dropped).
    drop_halfway: Vec<String>,
    /// Files whose body is served with one byte flipped (hash mismatch).
    corrupt: Vec<String>,
    /// The API answer's `sha`, as raw JSON, in place of the commit's (a hostile endpoint).
    sha: Option<String>,
    /// Etag headers (`X-Linked-Etag` or `ETag`) by file, in place of the files' hashes.
    etag: HashMap<String, String>,
    /// The `X-Repo-Commit` of every file, in place of the commit asked for.
    repo_commit: Option<String>,
    /// The status the API answers with, in place of its answer (a failing server).
    api_status: Option<&'static str>,
    /// File requests get no answer: the connection stays open, silent.
    stall: bool,
    /// Files whose body (beyond one byte) comes a byte every 0.1 s: never silent for long, never
    /// done.
    trickle: Vec<String>,
}

#[derive(Debug, Clone)]
struct Request {
    path: String,
    range: Option<String>,
}

struct Server {
    port: u16,
    log: Arc<Mutex<Vec<Request>>>,
    stop: Arc<AtomicBool>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl Server {
    fn start(repos: HashMap<String, ServedRepo>, faults: Faults) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let log = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (l, s) = (log.clone(), stop.clone());
        let faults = Arc::new(Mutex::new(faults));
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut served = 0;
            while !s.load(Ordering::Relaxed) && Instant::now() < deadline && served < 2000 {
                match listener.accept() {
                    Ok((stream, _)) => {
                        served += 1;
                        stream.set_nonblocking(false).unwrap();
                        let (repos, l, faults) = (repos.clone(), l.clone(), faults.clone());
                        std::thread::spawn(move || serve(stream, &repos, &l, &faults, port));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Server { port, log, stop }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn requests(&self) -> Vec<Request> {
        self.log.lock().unwrap().clone()
    }
}

fn respond(stream: &mut TcpStream, status: &str, headers: &[(&str, String)], body: &[u8]) {
    let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(body);
}

fn serve(
    mut stream: TcpStream,
    repos: &HashMap<String, ServedRepo>,
    log: &Mutex<Vec<Request>>,
    faults: &Mutex<Faults>,
    port: u16,
) {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let (mut range, mut auth) = (None, None);
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        let (k, v) = h.split_once(':').unwrap_or(("", ""));
        match k.trim().to_ascii_lowercase().as_str() {
            "range" => range = Some(v.trim().to_string()),
            "authorization" => auth = Some(v.trim().to_string()),
            _ => {}
        }
    }
    log.lock().unwrap().push(Request {
        path: path.clone(),
        range: range.clone(),
    });
    let not_found = |s: &mut TcpStream| {
        respond(
            s,
            "404 Not Found",
            &[("X-Error-Code", "RepoNotFound".into())],
            b"{}",
        )
    };
    // Large-file storage: /lfs/<sha256>, with ranges.
    if let Some(sha) = path.strip_prefix("/lfs/") {
        let file = repos
            .values()
            .flat_map(|r| r.revisions.values())
            .flat_map(|(_, files)| files.iter())
            .find(|(_, f)| f.etag == sha);
        match file {
            Some((name, f)) => send_body(&mut stream, name, f, range.as_deref(), &[], faults),
            None => not_found(&mut stream),
        }
        return;
    }
    let parts: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    let authorized = |repo: &ServedRepo| {
        repo.token
            .as_ref()
            .is_none_or(|t| auth.as_deref() == Some(&format!("Bearer {t}")))
    };
    match parts.as_slice() {
        ["api", "models", rest @ ..] => {
            // models/ORG/NAME/revision/REV
            let joined = rest.join("/");
            let Some((id, rev)) = joined.split_once("/revision/") else {
                return not_found(&mut stream);
            };
            // As huggingface.co: an unknown repository is a 401 to an anonymous user.
            let Some(repo) = repos.get(id) else {
                return respond(
                    &mut stream,
                    "401 Unauthorized",
                    &[("X-Error-Code", "RepoNotFound".into())],
                    b"{}",
                );
            };
            if !authorized(repo) {
                return respond(
                    &mut stream,
                    "401 Unauthorized",
                    &[("X-Error-Code", "GatedRepo".into())],
                    b"{}",
                );
            }
            let rev = rev.replace("%2F", "/");
            let Some((commit, files)) = repo.revisions.get(&rev) else {
                return respond(
                    &mut stream,
                    "404 Not Found",
                    &[("X-Error-Code", "RevisionNotFound".into())],
                    b"{}",
                );
            };
            let faults = faults.lock().unwrap().clone();
            if let Some(status) = faults.api_status {
                return respond(&mut stream, status, &[], b"");
            }
            let sha = faults.sha.unwrap_or_else(|| format!("\"{commit}\""));
            let mut names: Vec<&String> = files.keys().collect();
            names.sort();
            let siblings: Vec<String> = names
                .iter()
                .map(|n| format!("{{\"rfilename\":\"{n}\"}}"))
                .collect();
            let body = format!(
                "{{\"id\":\"{id}\",\"sha\":{sha},\"siblings\":[{}]}}",
                siblings.join(",")
            );
            respond(
                &mut stream,
                "200 OK",
                &[("Content-Type", "application/json".into())],
                body.as_bytes(),
            );
        }
        [org, name, "resolve", rev, file] => {
            let Some(repo) = repos.get(&format!("{org}/{name}")) else {
                return not_found(&mut stream);
            };
            if !authorized(repo) {
                return respond(&mut stream, "401 Unauthorized", &[], b"");
            }
            let Some((commit, files)) = repo.revisions.get(*rev) else {
                return not_found(&mut stream);
            };
            let Some(f) = files.get(*file) else {
                return not_found(&mut stream);
            };
            let hostile = faults.lock().unwrap().clone();
            if hostile.stall {
                std::thread::sleep(Duration::from_secs(30));
                return;
            }
            let commit = hostile.repo_commit.unwrap_or(commit.clone());
            let etag = (hostile.etag.get(*file).cloned()).unwrap_or(format!("\"{}\"", f.etag));
            let mut headers = vec![("X-Repo-Commit", commit)];
            if f.lfs {
                headers.push(("X-Linked-Etag", etag));
                headers.push(("ETag", "\"pointer-etag\"".into()));
                headers.push((
                    "Location",
                    format!("http://127.0.0.1:{port}/lfs/{}", f.etag),
                ));
                respond(&mut stream, "302 Found", &headers, b"");
            } else {
                headers.push(("ETag", etag));
                send_body(&mut stream, file, f, range.as_deref(), &headers, faults);
            }
        }
        _ => not_found(&mut stream),
    }
}

/// A file's body, honouring `Range: bytes=START-[END]`, with the faults asked for.
fn send_body(
    stream: &mut TcpStream,
    name: &str,
    f: &File,
    range: Option<&str>,
    headers: &[(&str, String)],
    faults: &Mutex<Faults>,
) {
    let size = f.body.len();
    let (start, end) = match range.and_then(|r| r.strip_prefix("bytes=")) {
        Some(r) => {
            let (a, b) = r.split_once('-').unwrap();
            let a: usize = a.parse().unwrap();
            let b: usize = if b.is_empty() {
                size - 1
            } else {
                b.parse().unwrap()
            };
            (a, b.min(size - 1))
        }
        None => (0, size - 1),
    };
    let mut body = f.body[start..=end].to_vec();
    let mut faults = faults.lock().unwrap();
    if faults.corrupt.iter().any(|c| c == name) && body.len() > 1 {
        let mid = body.len() / 2;
        body[mid] ^= 0xff;
    }
    let mut headers = headers.to_vec();
    headers.push(("Content-Range", format!("bytes {start}-{end}/{size}")));
    headers.push(("Accept-Ranges", "bytes".into()));
    let status = if range.is_some() {
        "206 Partial Content"
    } else {
        "200 OK"
    };
    if let Some(i) = faults.drop_halfway.iter().position(|d| d == name) {
        if body.len() > 1 {
            faults.drop_halfway.remove(i);
            drop(faults);
            // Promise the whole body, send half, hang up.
            let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
            for (k, v) in &headers {
                head.push_str(&format!("{k}: {v}\r\n"));
            }
            head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&body[..body.len() / 2]);
            let _ = stream.flush();
            let _ = stream.shutdown(std::net::Shutdown::Both);
            return;
        }
    }
    let trickle = faults.trickle.iter().any(|t| t == name) && body.len() > 1;
    drop(faults);
    if trickle {
        let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
        for (k, v) in &headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        let _ = stream.write_all(head.as_bytes());
        for byte in &body {
            if stream.write_all(&[*byte]).is_err() || stream.flush().is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        return;
    }
    respond(stream, status, &headers, &body);
}

fn git_sha1(body: &[u8]) -> String {
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", body.len()).as_bytes());
    h.update(body);
    hex(&h.finalize())
}

fn sha256(body: &[u8]) -> String {
    hex(&sha2::Sha256::digest(body))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A repository's files from a fixture directory; safetensors are LFS files. `extra` adds
/// files (name, body) the fixture lacks.
fn files_of(dir: &Path, extra: &[(&str, &[u8])]) -> HashMap<String, File> {
    let mut files = HashMap::new();
    let mut add = |name: String, body: Vec<u8>| {
        let lfs = name.ends_with(".safetensors") || name.ends_with(".bin");
        let etag = if lfs { sha256(&body) } else { git_sha1(&body) };
        files.insert(name, File { body, etag, lfs });
    };
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        add(
            e.file_name().to_string_lossy().into_owned(),
            std::fs::read(e.path()).unwrap(),
        );
    }
    for (name, body) in extra {
        add(name.to_string(), body.to_vec());
    }
    files
}

const COMMIT_A: &str = "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1";
const COMMIT_B: &str = "b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2";

/// Repositories every test serves:
/// - `test-org/tiny-qwen2` (main = commit A: the qwen2 fixture, plus a README and a pickled
///   copy of the weights sinkmerge must skip; the `v2` branch = commit B: qwen2-sharded);
/// - `test-org/tiny-vlm` (the qwen2_5_vl fixture) and `test-org/tiny-qwen2-b` (qwen2-sharded);
/// - `test-org/gated` (qwen2, needs the token `hf_secret`);
/// - `test-org/bin-only` (pytorch_model.bin only).
fn repos() -> HashMap<String, ServedRepo> {
    let single = |dir: &str, commit: &str, extra: &[(&str, &[u8])]| {
        let files = files_of(&fixture(dir), extra);
        let mut revisions = HashMap::new();
        revisions.insert("main".to_string(), (commit.to_string(), files.clone()));
        revisions.insert(commit.to_string(), (commit.to_string(), files));
        ServedRepo {
            revisions,
            token: None,
        }
    };
    // A second copy of the weights in another layout, as Mistral's repos carry: never fetched.
    let consolidated: (&str, &[u8]) = ("consolidated.safetensors", b"another layout");
    let mut qwen2 = single(
        "qwen2",
        COMMIT_A,
        &[
            ("README.md", b"# tiny"),
            ("pytorch_model.bin", b"pickle"),
            consolidated,
        ],
    );
    let sharded = files_of(&fixture("qwen2-sharded"), &[consolidated]);
    qwen2
        .revisions
        .insert("v2".to_string(), (COMMIT_B.to_string(), sharded.clone()));
    qwen2
        .revisions
        .insert(COMMIT_B.to_string(), (COMMIT_B.to_string(), sharded));
    let mut gated = single("qwen2", COMMIT_A, &[]);
    gated.token = Some("hf_secret".to_string());
    let mut bin_only = ServedRepo::default();
    let mut bin_files = HashMap::new();
    for (name, body) in [
        (
            "config.json",
            std::fs::read(fixture("qwen2").join("config.json")).unwrap(),
        ),
        ("pytorch_model.bin", b"pickle".to_vec()),
    ] {
        let lfs = name.ends_with(".bin");
        let etag = if lfs { sha256(&body) } else { git_sha1(&body) };
        bin_files.insert(name.to_string(), File { body, etag, lfs });
    }
    bin_only
        .revisions
        .insert("main".to_string(), (COMMIT_A.to_string(), bin_files));
    HashMap::from([
        ("test-org/tiny-qwen2".to_string(), qwen2),
        (
            "test-org/tiny-vlm".to_string(),
            single("qwen2_5_vl", COMMIT_A, &[]),
        ),
        (
            "test-org/tiny-qwen2-b".to_string(),
            single("qwen2-sharded", COMMIT_B, &[]),
        ),
        ("test-org/gated".to_string(), gated),
        ("test-org/bin-only".to_string(), bin_only),
    ])
}

/// A fresh user: an empty cache and home, no token, pointed at `endpoint`.
struct User {
    home: tempfile::TempDir,
    endpoint: String,
}

impl User {
    fn new(endpoint: String) -> User {
        User {
            home: tempfile::tempdir().unwrap(),
            endpoint,
        }
    }

    fn cache(&self) -> PathBuf {
        self.home.path().join("hf/hub")
    }

    fn run(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        self.command(args, env).output()
    }

    fn command(&self, args: &[&str], env: &[(&str, &str)]) -> Sinkmerge {
        sinkmerge(args)
            .current_dir(self.home.path())
            .env_remove("HF_HUB_CACHE")
            .env("HF_HOME", self.home.path().join("hf"))
            .env("HF_ENDPOINT", &self.endpoint)
            .envs(env.iter().copied())
    }

    /// Every file under the cache, relative, sorted (links as they are).
    fn cached_files(&self) -> Vec<String> {
        let mut out = Vec::new();
        let base = self.cache();
        let mut stack = vec![base.clone()];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in entries {
                let p = e.unwrap().path();
                let rel = p.strip_prefix(&base).unwrap().display().to_string();
                if rel.starts_with(".sinkmerge-staging") {
                    continue;
                }
                if p.is_dir() && !p.is_symlink() {
                    stack.push(p);
                } else {
                    out.push(rel);
                }
            }
        }
        out.sort();
        out
    }
}

#[test]
fn a_fresh_download_fills_the_standard_cache_layout_and_a_second_run_stays_offline() {
    let server = Server::start(repos(), Faults::default());
    let user = User::new(server.endpoint());
    let out = ok(&user.run(&["fetch", "test-org/tiny-qwen2", "--json"], &[]));
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report[0]["commit"], COMMIT_A);
    let files = user.cached_files();
    let repo = "models--test-org--tiny-qwen2";
    let snap = format!("{repo}/snapshots/{COMMIT_A}");
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "vocab.json",
    ] {
        assert!(files.contains(&format!("{snap}/{f}")), "{f} in {files:?}");
    }
    for skipped in ["README.md", "pytorch_model.bin", "consolidated.safetensors"] {
        assert!(
            !files.contains(&format!("{snap}/{skipped}")),
            "{skipped} was fetched"
        );
    }
    assert!(files.contains(&format!("{repo}/refs/main")));
    let weights = user.cache().join(&snap).join("model.safetensors");
    assert!(
        weights.is_symlink(),
        "snapshots link to blobs, as huggingface_hub lays them out"
    );
    let body = std::fs::read(&weights).unwrap();
    assert_eq!(
        body,
        std::fs::read(fixture("qwen2").join("model.safetensors")).unwrap()
    );
    assert_eq!(
        std::fs::read_to_string(user.cache().join(repo).join("refs/main")).unwrap(),
        COMMIT_A
    );
    // Large files came through the LFS redirect.
    assert!(server
        .requests()
        .iter()
        .any(|r| r.path.starts_with("/lfs/")));

    // A second run reads the cache and never touches the server.
    let before = server.requests().len();
    let out = ok(&user.run(&["inspect", "test-org/tiny-qwen2", "--json"], &[]));
    assert!(out.contains("qwen2"), "{out}");
    ok(&user.run(&["fetch", "test-org/tiny-qwen2"], &[]));
    assert_eq!(server.requests().len(), before, "the cache answered");
    // And so does offline mode.
    ok(&user.run(
        &["inspect", "test-org/tiny-qwen2"],
        &[("HF_HUB_OFFLINE", "1")],
    ));
    assert_eq!(server.requests().len(), before);
    if let Some(keep) = std::env::var_os("SINKMERGE_KEEP_HUB_CACHE") {
        // tools/check_hub_cache.py loads it with transformers (local_files_only=True).
        copy_tree(&user.cache(), Path::new(&keep));
    }
}

fn copy_tree(from: &Path, to: &Path) {
    let status = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .unwrap();
    assert!(status.success());
}

#[test]
fn a_dropped_connection_resumes_where_it_stopped() {
    let faults = Faults {
        drop_halfway: vec!["model.safetensors".to_string()],
        ..Faults::default()
    };
    let server = Server::start(repos(), faults);
    let user = User::new(server.endpoint());
    ok(&user.run(&["fetch", "test-org/tiny-qwen2"], &[]));
    let size = std::fs::metadata(fixture("qwen2").join("model.safetensors"))
        .unwrap()
        .len();
    let ranges: Vec<String> = server
        .requests()
        .iter()
        .filter(|r| r.path.starts_with("/lfs/"))
        .filter_map(|r| r.range.clone())
        .collect();
    let resumed = format!("bytes={}-", size / 2);
    assert!(
        ranges.contains(&resumed),
        "a range request from the middle ({resumed}) after the drop: {ranges:?}"
    );
    let cached = user.cache().join(format!(
        "models--test-org--tiny-qwen2/snapshots/{COMMIT_A}/model.safetensors"
    ));
    assert_eq!(std::fs::metadata(cached).unwrap().len(), size);
}

#[test]
fn a_part_left_by_a_killed_run_is_resumed() {
    let server = Server::start(repos(), Faults::default());
    let user = User::new(server.endpoint());
    let weights = std::fs::read(fixture("qwen2").join("model.safetensors")).unwrap();
    let blobs = user
        .cache()
        .join(".sinkmerge-staging/models--test-org--tiny-qwen2/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    let third = weights.len() / 3;
    std::fs::write(
        blobs.join(format!("{}.part", sha256(&weights))),
        &weights[..third],
    )
    .unwrap();
    ok(&user.run(&["fetch", "test-org/tiny-qwen2"], &[]));
    let ranges: Vec<String> = (server.requests().iter())
        .filter(|r| r.path.starts_with("/lfs/"))
        .filter_map(|r| r.range.clone())
        .collect();
    assert!(ranges.contains(&format!("bytes={third}-")), "{ranges:?}");
    let cached = user.cache().join(format!(
        "models--test-org--tiny-qwen2/snapshots/{COMMIT_A}/model.safetensors"
    ));
    assert_eq!(std::fs::read(cached).unwrap(), weights);
}

#[test]
fn a_corrupted_body_is_refused_and_nothing_is_cached() {
    let faults = Faults {
        corrupt: vec!["model.safetensors".to_string()],
        ..Faults::default()
    };
    let server = Server::start(repos(), faults);
    let user = User::new(server.endpoint());
    // The reference is good and the server failed: exit 1, as for any failed download.
    failed(
        &user.run(&["fetch", "test-org/tiny-qwen2"], &[]),
        &["model.safetensors", "corrupted", "etag"],
    );
    assert!(
        user.cached_files()
            .iter()
            .all(|f| !f.contains("snapshots") && !f.contains("refs")),
        "{:?}",
        user.cached_files()
    );
    // A later run does not take a corrupt blob for a good one.
    failed(
        &user.run(&["fetch", "test-org/tiny-qwen2"], &[]),
        &["corrupted"],
    );
}

#[test]
fn gated_repos_need_a_token() {
    let server = Server::start(repos(), Faults::default());
    let user = User::new(server.endpoint());
    refused(
        &user.run(&["fetch", "test-org/gated"], &[]),
        &["test-org/gated", "gated", "HF_TOKEN"],
    );
    refused(
        &user.run(&["fetch", "test-org/gated"], &[("HF_TOKEN", "hf_wrong")]),
        &["token"],
    );
    assert!(user.cached_files().is_empty(), "{:?}", user.cached_files());
    ok(&user.run(&["fetch", "test-org/gated"], &[("HF_TOKEN", "hf_secret")]));
    // The token file `hf auth login` writes works too.
    let other = User::new(server.endpoint());
    std::fs::create_dir_all(other.home.path().join("hf")).unwrap();
    std::fs::write(other.home.path().join("hf/token"), "hf_secret\n").unwrap();
    ok(&other.run(&["fetch", "test-org/gated"], &[]));
    // With the cache elsewhere and no HF_HOME, the token file is ~/.cache/huggingface/token, as
    // huggingface_hub looks for it.
    let third = User::new(server.endpoint());
    let home = third.home.path();
    std::fs::create_dir_all(home.join(".cache/huggingface")).unwrap();
    std::fs::write(home.join(".cache/huggingface/token"), "hf_secret").unwrap();
    let elsewhere = home.join("models-cache");
    ok(&third.run(
        &["fetch", "test-org/gated"],
        &[
            ("HF_HOME", ""),
            ("HOME", home.to_str().unwrap()),
            ("HF_HUB_CACHE", elsewhere.to_str().unwrap()),
        ],
    ));
    assert!(elsewhere
        .join("models--test-org--gated/refs/main")
        .is_file());
}

#[test]
fn missing_repos_revisions_and_weights_get_one_clear_error() {
    let server = Server::start(repos(), Faults::default());
    let user = User::new(server.endpoint());
    refused(
        &user.run(&["fetch", "test-org/no-such-model"], &[]),
        &["test-org/no-such-model", "no such repository"],
    );
    refused(
        &user.run(&["fetch", "test-org/tiny-qwen2@no-such-branch"], &[]),
        &["revision `no-such-branch` does not exist"],
    );
    refused(
        &user.run(&["fetch", "test-org/bin-only"], &[]),
        &["no safetensors", "pytorch_model.bin"],
    );
    assert!(user.cached_files().is_empty(), "{:?}", user.cached_files());
    // Offline: not a single request.
    let before = server.requests().len();
    refused(
        &user.run(
            &["fetch", "test-org/tiny-qwen2"],
            &[("HF_HUB_OFFLINE", "1")],
        ),
        &["HF_HUB_OFFLINE"],
    );
    refused(
        &user.run(&["inspect", "test-org/tiny-qwen2", "--no-download"], &[]),
        &["--no-download"],
    );
    assert_eq!(server.requests().len(), before);
    // An unreachable Hub.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let lost = User::new(endpoint);
    failed(
        &lost.run(&["fetch", "test-org/tiny-qwen2"], &[]),
        &["cannot be reached", &lost.endpoint, "HF_HUB_OFFLINE"],
    );
    assert!(lost.cached_files().is_empty());
}

#[test]
fn pinned_revisions_fetch_their_own_commit() {
    let server = Server::start(repos(), Faults::default());
    let user = User::new(server.endpoint());
    let out = ok(&user.run(&["fetch", "test-org/tiny-qwen2@v2", "--json"], &[]));
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report[0]["commit"], COMMIT_B);
    let repo = user.cache().join("models--test-org--tiny-qwen2");
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/v2")).unwrap(),
        COMMIT_B
    );
    assert!(repo
        .join(format!("snapshots/{COMMIT_B}/model.safetensors.index.json"))
        .is_file());
    assert!(!repo.join("refs/main").exists(), "only the pinned revision");
    // A pin by commit hash needs no ref.
    let out = ok(&user.run(
        &[
            "fetch",
            &format!("test-org/tiny-qwen2@{COMMIT_A}"),
            "--json",
        ],
        &[],
    ));
    assert!(out.contains(COMMIT_A));
    assert!(repo
        .join(format!("snapshots/{COMMIT_A}/model.safetensors"))
        .is_file());
}

/// The command outputs of a new user against the server equal those from a pre-filled cache.
#[test]
fn extract_norms_score_and_merge_run_from_an_empty_cache() {
    let server = Server::start(repos(), Faults::default());
    let fresh = User::new(server.endpoint());
    let cmds: [&[&str]; 4] = [
        &["extract", "test-org/tiny-vlm", "-o", "lm", "-q"],
        &[
            "norms",
            "test-org/tiny-qwen2",
            "test-org/tiny-qwen2-b",
            "--json",
        ],
        &["score", "test-org/tiny-qwen2", "--json"],
        &[
            "linear",
            "--models",
            "test-org/tiny-qwen2",
            "test-org/tiny-qwen2-b",
            "-o",
            "merged",
            "-q",
        ],
    ];
    let outputs: Vec<String> = cmds.iter().map(|c| ok(&fresh.run(c, &[]))).collect();
    let downloads = server.requests().len();
    // Every report names the resolved commits.
    let json = |i: usize| serde_json::from_str::<serde_json::Value>(&outputs[i]).unwrap();
    assert_eq!(json(1)["reference_hub"]["commit"], COMMIT_A);
    assert_eq!(json(1)["target_hub"]["commit"], COMMIT_B);
    assert_eq!(json(2)["models"][0]["hub"]["repo"], "test-org/tiny-qwen2");
    assert_eq!(json(2)["models"][0]["hub"]["commit"], COMMIT_A);
    // And so do the text reports.
    assert!(
        outputs[0].contains(&format!("test-org/tiny-vlm (commit {COMMIT_A})")),
        "{}",
        outputs[0]
    );
    let text = ok(&fresh.run(&["score", "test-org/tiny-qwen2"], &[]));
    assert!(
        text.contains(&format!("test-org/tiny-qwen2 at commit {COMMIT_A}")),
        "{text}"
    );
    let text = ok(&fresh.run(
        &["norms", "test-org/tiny-qwen2", "test-org/tiny-qwen2-b"],
        &[],
    ));
    assert!(text.contains(&format!("(commit {COMMIT_B})")), "{text}");
    let record =
        std::fs::read_to_string(fresh.home.path().join("merged/sinkmerge_config.yml")).unwrap();
    for pinned in [
        format!("test-org/tiny-qwen2@{COMMIT_A}"),
        format!("test-org/tiny-qwen2-b@{COMMIT_B}"),
    ] {
        assert!(record.contains(&pinned), "{pinned} in {record}");
    }
    assert!(downloads > 0);
    // The same commands from the now-filled cache, offline, in a second working directory.
    let again = User::new(server.endpoint());
    copy_tree(&fresh.home.path().join("hf"), again.home.path());
    // Reports name the snapshot directory, which lies in each user's own home, and time their
    // verification ("... in 0.01 s").
    let same = |u: &User, text: &str| -> String {
        (text
            .replace(&u.home.path().display().to_string(), "HOME")
            .lines())
        .map(|l| match l.rfind(" in ") {
            Some(i) if l.ends_with(" s") => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
    };
    for (c, want) in cmds.iter().zip(&outputs) {
        let got = ok(&again.run(c, &[("HF_HUB_OFFLINE", "1")]));
        assert_eq!(same(&again, &got), same(&fresh, want), "{c:?}");
    }
    assert_eq!(
        server.requests().len(),
        downloads,
        "no request from a filled cache"
    );
    for dir in ["lm", "merged"] {
        for f in ["model.safetensors", "config.json"] {
            let a = std::fs::read(fresh.home.path().join(dir).join(f)).unwrap();
            let b = std::fs::read(again.home.path().join(dir).join(f)).unwrap();
            assert_eq!(a, b, "{dir}/{f}");
        }
    }
}

/// Exit code 1 with one error line that names every one of `needles`, no panic (exit 101),
/// nothing on stdout: how a download of a good reference fails (the network, the server, or
/// an answer sinkmerge cannot use).
fn failed(output: &Output, needles: &[&str]) -> String {
    let err = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(1), "{err}");
    for needle in needles {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one error line: {err}");
    assert!(output.stdout.is_empty(), "nothing on stdout on error");
    err
}

impl User {
    /// What a download wrote under the user's home outside the cache (`hf/hub`), and the links
    /// in the cache that point out of it: both must stay empty.
    fn outside_cache(&self) -> Vec<String> {
        let home = self.home.path();
        let cache = self.cache();
        let mut out = Vec::new();
        let mut stack = vec![home.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap() {
                let p = e.unwrap().path();
                let inside = p.starts_with(&cache);
                if p.is_symlink() {
                    // The target, lexically: every `..` must stay within the cache.
                    let mut target = p.parent().unwrap().to_path_buf();
                    for c in std::fs::read_link(&p).unwrap().components() {
                        match c {
                            std::path::Component::ParentDir => {
                                target.pop();
                            }
                            c => target.push(c),
                        }
                    }
                    if !inside || !target.starts_with(&cache) {
                        out.push(format!("{} -> {}", p.display(), target.display()));
                    }
                } else if p.is_dir() {
                    if !(inside || cache.starts_with(&p)) {
                        out.push(p.display().to_string());
                    }
                    stack.push(p);
                } else if !inside {
                    out.push(p.display().to_string());
                }
            }
        }
        out
    }
}

#[test]
fn bad_revisions_are_refused_before_any_request_or_path() {
    let server = Server::start(repos(), Faults::default());
    let user = User::new(server.endpoint());
    // The case: a revision that climbs out of the snapshots folder to a local model,
    // which was then scored as that Hub repo at a commit of `../../../model`.
    std::fs::create_dir_all(user.cache().join("models--test-org--tiny-qwen2/snapshots")).unwrap();
    copy_tree(&fixture("qwen2"), &user.home.path().join("hf/model"));
    let bad = [
        "",
        "../../../model",
        "..",
        "a..b",
        "-x",
        "/a",
        "a/",
        "a//b",
        ".v1",
        "a/.b",
        "v1.lock",
        "v1.",
        "a b",
        "a~1",
        "a^",
        "a:b",
        "a?",
        "a*",
        "a[",
        "a\\b",
        "@",
        "a@{1}",
        "a\tb",
        "a\nb",
    ];
    for rev in bad {
        let reference = format!("test-org/tiny-qwen2@{rev}");
        for cmd in ["fetch", "inspect", "score"] {
            refused(
                &user.run(&[cmd, &reference], &[]),
                &["test-org/tiny-qwen2@", "the revision", "give a branch"],
            );
        }
    }
    // Repo ids the Hub refuses (huggingface_hub's validate_repo_id) are no repo ids at all.
    for reference in ["test-org/a..b", "test--org/x", "test-org/x-", "test-org/.x"] {
        refused(
            &user.run(&["fetch", reference], &[]),
            &[reference, "not a known alias or a Hugging Face repo id"],
        );
    }
    assert!(server.requests().is_empty(), "{:?}", server.requests());
    let outside = user.outside_cache();
    assert!(
        outside.iter().all(|p| p.contains("hf/model")),
        "{outside:?}"
    );
    // A branch with `/` (the Hub's pull-request refs) is a valid name, sent quoted.
    refused(
        &user.run(&["fetch", "test-org/tiny-qwen2@refs/pr/1"], &[]),
        &["revision `refs/pr/1` does not exist"],
    );
    assert!(server
        .requests()
        .iter()
        .any(|r| r.path.ends_with("/revision/refs%2Fpr%2F1")));
}

#[test]
fn a_hostile_commit_fails_with_exit_1_and_writes_nothing_outside_the_cache() {
    // A path out of the cache, a short hash, upper case, not a string, none.
    for sha in [
        "\"../../../../escaped\"",
        "\"a1a1\"",
        "\"A1A1A1A1A1A1A1A1A1A1A1A1A1A1A1A1A1A1A1A1\"",
        "42",
        "null",
    ] {
        let faults = Faults {
            sha: Some(sha.to_string()),
            ..Faults::default()
        };
        let server = Server::start(repos(), faults);
        let user = User::new(server.endpoint());
        for cmd in ["fetch", "score"] {
            failed(
                &user.run(&[cmd, "test-org/tiny-qwen2"], &[]),
                &["test-org/tiny-qwen2", &server.endpoint(), "commit"],
            );
        }
        assert!(
            user.outside_cache().is_empty(),
            "{:?}",
            user.outside_cache()
        );
        assert!(user.cached_files().is_empty(), "{:?}", user.cached_files());
    }
    // A file served from another commit than the one asked for.
    let faults = Faults {
        repo_commit: Some("../../../../escaped".to_string()),
        ..Faults::default()
    };
    let server = Server::start(repos(), faults);
    let user = User::new(server.endpoint());
    failed(
        &user.run(&["fetch", "test-org/tiny-qwen2"], &[]),
        &[
            "config.json",
            &server.endpoint(),
            "commit `../../../../escaped`",
        ],
    );
    assert!(
        user.outside_cache().is_empty(),
        "{:?}",
        user.outside_cache()
    );
    assert!(user.cached_files().is_empty(), "{:?}", user.cached_files());
}

#[test]
fn a_hostile_etag_fails_with_exit_1_and_writes_nothing_outside_the_cache() {
    // A small file's `ETag` and a large file's `X-Linked-Etag`.
    for file in ["config.json", "model.safetensors"] {
        for etag in [
            "\"../../../../escaped\"",
            "\"../../../../a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1\"",
            "\"pointer-etag\"",
            "W/\"\"",
            "",
        ] {
            let faults = Faults {
                etag: HashMap::from([(file.to_string(), etag.to_string())]),
                ..Faults::default()
            };
            let server = Server::start(repos(), faults);
            let user = User::new(server.endpoint());
            failed(
                &user.run(&["fetch", "test-org/tiny-qwen2"], &[]),
                &[file, &server.endpoint(), "etag"],
            );
            assert!(
                user.outside_cache().is_empty(),
                "{:?}",
                user.outside_cache()
            );
            assert!(user.cached_files().is_empty(), "{:?}", user.cached_files());
        }
    }
    // A weak etag of the right hash is the same hash.
    let config = std::fs::read(fixture("qwen2").join("config.json")).unwrap();
    let faults = Faults {
        etag: HashMap::from([(
            "config.json".to_string(),
            format!("W/\"{}\"", git_sha1(&config)),
        )]),
        ..Faults::default()
    };
    let server = Server::start(repos(), faults);
    let user = User::new(server.endpoint());
    ok(&user.run(&["fetch", "test-org/tiny-qwen2"], &[]));
}

#[test]
fn a_silent_server_times_out_naming_the_endpoint_and_the_limit() {
    // Connections complete in the kernel's backlog; nothing ever answers.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let user = User::new(format!("http://{}", silent.local_addr().unwrap()));
    for cmd in ["fetch", "score"] {
        let start = Instant::now();
        failed(
            &user.run(
                &[cmd, "test-org/tiny-qwen2"],
                &[("HF_HUB_DOWNLOAD_TIMEOUT", "1")],
            ),
            &[&user.endpoint, "within 1 s", "HF_HUB_DOWNLOAD_TIMEOUT"],
        );
        assert!(start.elapsed() < Duration::from_secs(8), "{cmd}");
    }
    // A server that lists the files and then never answers for one.
    let faults = Faults {
        stall: true,
        ..Faults::default()
    };
    let server = Server::start(repos(), faults);
    let user = User::new(server.endpoint());
    let start = Instant::now();
    failed(
        &user.run(
            &["fetch", "test-org/tiny-qwen2"],
            &[("HF_HUB_DOWNLOAD_TIMEOUT", "0.5")],
        ),
        &[&server.endpoint(), "within 0.5 s"],
    );
    assert!(start.elapsed() < Duration::from_secs(8));
    assert!(
        user.outside_cache().is_empty(),
        "{:?}",
        user.outside_cache()
    );
    assert!(user.cached_files().is_empty(), "{:?}", user.cached_files());
    // The limit is a number of seconds above 0.
    for bad in ["0", "-1", "ten", "nan", "inf", "1e9"] {
        refused(
            &user.run(
                &["fetch", "test-org/tiny-qwen2"],
                &[("HF_HUB_DOWNLOAD_TIMEOUT", bad)],
            ),
            &[&format!("HF_HUB_DOWNLOAD_TIMEOUT={bad}")],
        );
    }
}

/// A server that sends a file a byte every 0.1 s is never silent for the read timeout, so only
/// the least speed stops it: fewer than SINKMERGE_HUB_MIN_SPEED bytes a second over
/// SINKMERGE_HUB_SPEED_TIME seconds ends the transfer (retried as a dropped one), then the run,
/// with exit 1 naming the endpoint and the limit. Nothing is cached; the part stays in the
/// staging cache, and the next run resumes it.
#[test]
fn a_trickling_server_is_stopped_by_the_least_speed_and_the_part_resumed() {
    let faults = Faults {
        trickle: vec!["model.safetensors".to_string()],
        ..Faults::default()
    };
    let server = Server::start(repos(), faults);
    let user = User::new(server.endpoint());
    let start = Instant::now();
    let output = user
        .command(
            &["fetch", "test-org/tiny-qwen2"],
            &[("SINKMERGE_HUB_SPEED_TIME", "1")],
        )
        .watch(b"", Duration::from_secs(40))
        .0
        .expect("the trickling download still ran after 40 s");
    failed(
        &output,
        &[
            &server.endpoint(),
            "SINKMERGE_HUB_MIN_SPEED",
            "SINKMERGE_HUB_SPEED_TIME",
            "run again to resume",
        ],
    );
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
    assert!(user.cached_files().is_empty(), "{:?}", user.cached_files());
    let weights = std::fs::read(fixture("qwen2").join("model.safetensors")).unwrap();
    let part = user.cache().join(format!(
        ".sinkmerge-staging/models--test-org--tiny-qwen2/blobs/{}.part",
        sha256(&weights)
    ));
    let kept = std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
    assert!(kept > 0, "the part is kept for the next run");

    let server = Server::start(repos(), Faults::default());
    let user = User {
        endpoint: server.endpoint(),
        ..user
    };
    ok(&user.run(&["fetch", "test-org/tiny-qwen2"], &[]));
    let ranges: Vec<String> = (server.requests().iter())
        .filter(|r| r.path.starts_with("/lfs/"))
        .filter_map(|r| r.range.clone())
        .collect();
    assert!(ranges.contains(&format!("bytes={kept}-")), "{ranges:?}");
    let cached = user.cache().join(format!(
        "models--test-org--tiny-qwen2/snapshots/{COMMIT_A}/model.safetensors"
    ));
    assert_eq!(std::fs::read(cached).unwrap(), weights);

    // The limits are numbers above 0, as HF_HUB_DOWNLOAD_TIMEOUT is.
    for (name, bad) in [
        ("SINKMERGE_HUB_SPEED_TIME", "0"),
        ("SINKMERGE_HUB_SPEED_TIME", "ten"),
        ("SINKMERGE_HUB_SPEED_TIME", "1e9"),
        ("SINKMERGE_HUB_MIN_SPEED", "-1"),
        ("SINKMERGE_HUB_MIN_SPEED", "nan"),
    ] {
        let user = User::new(server.endpoint());
        refused(
            &user.run(&["fetch", "test-org/tiny-qwen2"], &[(name, bad)]),
            &[&format!("{name}={bad}")],
        );
    }
}

/// docs/commands/fetch.md: a reference the Hub refuses exits 2, a failed download of a good
/// one exits 1.
#[test]
fn a_failing_server_exits_1_and_a_refused_reference_2() {
    let faults = Faults {
        api_status: Some("503 Service Unavailable"),
        ..Faults::default()
    };
    let server = Server::start(repos(), faults);
    let user = User::new(server.endpoint());
    failed(
        &user.run(&["fetch", "test-org/tiny-qwen2"], &[]),
        &["test-org/tiny-qwen2", &server.endpoint(), "503"],
    );
    let server = Server::start(repos(), Faults::default());
    let user = User::new(server.endpoint());
    refused(
        &user.run(&["fetch", "test-org/tiny-qwen2@no-such-branch"], &[]),
        &["does not exist"],
    );
    refused(&user.run(&["fetch", "test-org/gated"], &[]), &["gated"]);
}
