//! What the Hub fuzz targets assert, shared by the libFuzzer targets (`fuzz_targets/`) and the
//! stable-toolchain driver CI runs (`tests/fuzz.rs`), so that both check the same thing.

use std::path::{Component, Path};

use sinkmerge::checkpoint::hub::{is_commit, parse_file_meta, parse_repo_info, parse_size, wanted};
use sinkmerge::checkpoint::hub_cache::check_revision;

/// The commit the file answers are checked against.
pub const COMMIT: &str = "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1";

/// Whether `s` is one relative path component, neither `.` nor `..`.
fn one_component(s: &str) -> bool {
    let mut parts = Path::new(s).components();
    matches!(parts.next(), Some(Component::Normal(_))) && parts.next().is_none() && !s.contains('/')
}

/// Any string as `ORG/NAME@REV`'s revision: no panic, and an accepted revision, which becomes
/// `refs/<rev>` in the cache and a URL path segment, is a relative path of plain components
/// that git's ref-name rules allow.
pub fn revision(data: &[u8]) {
    let rev = String::from_utf8_lossy(data);
    if check_revision(&rev).is_err() {
        return;
    }
    assert!(
        !rev.is_empty() && !rev.contains("..") && !rev.contains('\\'),
        "{rev:?}"
    );
    assert!(
        Path::new(rev.as_ref())
            .components()
            .all(|c| matches!(c, Component::Normal(_))),
        "{rev:?}"
    );
    assert!(
        !rev.starts_with(['/', '-']) && !rev.ends_with(['/', '.']),
        "{rev:?}"
    );
    for part in rev.split('/') {
        assert!(!part.is_empty() && !part.starts_with('.'), "{rev:?}");
        assert!(!part.ends_with(".lock"), "{rev:?}");
    }
    assert!(
        !rev.chars().any(|c| c.is_control() || " ~^:?*[".contains(c)),
        "{rev:?}"
    );
    assert!(!rev.contains("@{") && rev != "@", "{rev:?}");
}

/// Any bytes as the Hub's answers: header lines (`Name: value`), a blank line, then the API's
/// JSON. No panic; an accepted commit is 40 lowercase hex digits and an accepted etag 40 or 64,
/// both a single path component (they name cache folders and files), as is every file name
/// sinkmerge would fetch; a file is taken only from the commit asked for.
pub fn hub_answer(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let (head, body) = text.split_once("\n\n").unwrap_or(("", &text));
    let header = |name: &str| {
        head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then_some(v.trim())
        })
    };
    if let Ok(info) = parse_repo_info(body.as_bytes()) {
        assert!(is_commit(&info.commit), "{:?}", info.commit);
        assert!(
            info.commit
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{:?}",
            info.commit
        );
        assert!(one_component(&info.commit), "{:?}", info.commit);
        // The files fetched become links in the snapshot folder.
        for file in info.files.iter().filter(|f| wanted(f)) {
            assert!(one_component(file), "{file:?}");
        }
    }
    let headers = sinkmerge::checkpoint::hub::FileHeaders {
        repo_commit: header("X-Repo-Commit"),
        linked_etag: header("X-Linked-Etag"),
        etag: header("ETag"),
    };
    if let Ok(etag) = parse_file_meta(&headers, COMMIT) {
        assert!(matches!(etag.len(), 40 | 64), "{etag:?}");
        assert!(
            etag.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "{etag:?}"
        );
        assert!(one_component(&etag), "{etag:?}");
        if let Some(commit) = headers.repo_commit {
            assert_eq!(commit.trim(), COMMIT);
        }
    }
    let _ = parse_size(header("Content-Range"));
}
