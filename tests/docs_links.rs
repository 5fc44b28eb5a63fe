//! Every relative link in the project's Markdown (README, docs/, the READMEs beside fixtures and
//! tools) names a file that exists, and every `#anchor` names a heading of its target, as GitHub
//! renders it. A renamed heading (a dated benchmark table, say) otherwise leaves links that open
//! the page at its top.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::util::root;

/// The project's Markdown files: the tracked ones when `root` is a git checkout (merged models'
/// cards and other outputs left in the tree are not the project's), else every one under `root`.
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let tracked = Command::new("git")
        .args(["ls-files", "-z", "--", "*.md"])
        .current_dir(root)
        .output()
        .ok()
        .filter(|out| out.status.success() && !out.stdout.is_empty());
    match tracked {
        Some(out) => String::from_utf8(out.stdout)
            .unwrap()
            .split('\0')
            .filter(|name| !name.is_empty())
            .map(|name| root.join(name))
            .filter(|path| path.exists())
            .collect(),
        None => {
            let mut files = Vec::new();
            walk(root, &mut files);
            files
        }
    }
}

/// The Markdown files under `dir`, skipping hidden directories (`.git`, `.venv`) and `target`.
fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if !name.starts_with('.') && name != "target" {
                walk(&path, out);
            }
        } else if name.ends_with(".md") {
            out.push(path);
        }
    }
}

/// The lines of `text` outside fenced code blocks.
fn prose_lines(text: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    text.lines().filter(move |line| {
        let fence = line.trim_start().starts_with("```") || line.trim_start().starts_with("~~~");
        if fence {
            fenced = !fenced;
        }
        !fence && !fenced
    })
}

/// GitHub's anchor of a heading (github-slugger): lower case, every character but letters,
/// digits, `_`, `-` and spaces dropped, spaces turned into `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a file's ATX headings; a repeated one gets `-1`, `-2`, ... as on GitHub.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for line in prose_lines(text) {
        let level = line.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&level) || !line[level..].starts_with(' ') {
            continue;
        }
        let base = slug(line[level..].trim_end_matches('#'));
        let mut anchor = base.clone();
        for n in 1.. {
            if !seen.contains(&anchor) {
                break;
            }
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// The targets of the inline links `[text](target)` of `line`.
fn link_targets(line: &str) -> Vec<&str> {
    line.match_indices("](")
        .filter_map(|(at, _)| {
            let rest = &line[at + 2..];
            rest.find(')').map(|end| &rest[..end])
        })
        .filter(|target| !target.is_empty() && !target.contains(char::is_whitespace))
        .collect()
}

/// Whether `target` leaves the repository: a URL scheme (`https:`, `mailto:`).
fn is_external(target: &str) -> bool {
    target.split_once(':').is_some_and(|(scheme, _)| {
        !scheme.is_empty() && scheme.chars().all(|c| c.is_ascii_alphabetic())
    })
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let root = root();
    let files = markdown_files(&root);
    assert!(
        files.iter().any(|f| f.ends_with("docs/benchmarks.md")),
        "the walk must find the docs"
    );
    // Keyed by canonical path, as the links are resolved.
    let texts: BTreeMap<PathBuf, String> = files
        .iter()
        .map(|f| {
            (
                f.canonicalize().unwrap(),
                std::fs::read_to_string(f).unwrap(),
            )
        })
        .collect();
    let headings: BTreeMap<&PathBuf, BTreeSet<String>> =
        texts.iter().map(|(f, text)| (f, anchors(text))).collect();
    let root = root.canonicalize().unwrap();
    let (mut checked, mut broken) = (0, Vec::new());
    for (file, text) in &texts {
        for target in prose_lines(text).flat_map(link_targets) {
            if is_external(target) {
                continue;
            }
            checked += 1;
            let (path, anchor) = target.split_once('#').unwrap_or((target, ""));
            let resolved = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(path)
            };
            let shown = file.strip_prefix(&root).unwrap().display();
            let Ok(resolved) = resolved.canonicalize() else {
                broken.push(format!("{shown}: {target}: no such file"));
                continue;
            };
            if anchor.is_empty() {
                continue;
            }
            match headings.get(&resolved) {
                Some(names) if names.contains(anchor) => {}
                Some(_) => broken.push(format!("{shown}: {target}: no such heading")),
                None => broken.push(format!(
                    "{shown}: {target}: an anchor into a file that is not Markdown"
                )),
            }
        }
    }
    assert!(checked > 100, "only {checked} relative links found");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_follow_github() {
    let text = "# Headline figures (2026-12-07, the EPYC VM)\n\
                ```\n# not a heading\n```\n\
                ## `score`: 3x, or not?\n## Notes\n## Notes\n";
    let got: Vec<String> = anchors(text).into_iter().collect();
    assert_eq!(
        got,
        [
            "headline-figures-2026-12-07-the-epyc-vm",
            "notes",
            "notes-1",
            "score-3x-or-not"
        ]
    );
    assert_eq!(
        link_targets("see [a](x.md#b) and [c](https://d.e/f), `[g](h i)`"),
        ["x.md#b", "https://d.e/f"]
    );
    assert!(is_external("https://d.e/f") && !is_external("x.md#b"));
}
