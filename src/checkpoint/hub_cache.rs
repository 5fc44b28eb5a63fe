//! The Hugging Face cache's naming rules, shared by the lookup that reads the cache
//! ([`super::resolve`]) and the download that fills it ([`super::hub`]): a model at one commit,
//! the folder a repo gets, and which revisions may name a folder and a URL path
//! (docs/reference/hub.md).

/// A model on the Hub at one commit.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HubRef {
    /// `ORG/NAME`.
    pub repo: String,
    /// The resolved commit hash (the snapshot's directory name).
    pub commit: String,
}

/// The folder of `repo` (`ORG/NAME`) in an HF cache: `models--ORG--NAME`.
pub fn repo_folder(repo: &str) -> String {
    format!("models--{}", repo.replace('/', "--"))
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

#[cfg(test)]
mod tests {
    use super::*;

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
