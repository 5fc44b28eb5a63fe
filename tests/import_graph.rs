//! The crate's import graph, read from its source: no two files of `src/` import each other
//! through any chain, and the forward pass is a stack whose files import only those below them
//! (docs/architecture.md, "The forward stack"). Imports are the `crate::`, `super::` and `self::`
//! paths of `use` statements and of code, outside comments, strings and `#[cfg(test)]` items.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The forward room's floors, bottom first, as `src/forward/mod.rs` draws them: a file imports
/// only files on floors below its own (a folder's files import each other freely).
const FORWARD_STACK: &[(usize, &str)] = &[
    (0, "forward/precision.rs"),
    (0, "forward/activation.rs"),
    (1, "forward/model/"),
    (2, "forward/memory.rs"),
    (2, "forward/weights.rs"),
    (3, "forward/backend/"),
    (4, "forward/rope.rs"),
    (4, "forward/device.rs"),
    (4, "forward/cache.rs"),
    (4, "forward/resident.rs"),
    (5, "forward/decoder.rs"),
    (6, "forward/vision/"),
    (7, "forward/pass.rs"),
    (8, "forward/vlm.rs"),
    (9, "forward/capture.rs"),
];

/// One file of `src/` as a module: its path below `src/` and its module path.
struct Module {
    file: String,
    path: Vec<String>,
}

fn modules(src: &Path) -> Vec<Module> {
    let mut files = Vec::new();
    let mut pending = vec![src.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
        .into_iter()
        .map(|f| {
            let file = f
                .strip_prefix(src)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            let mut path: Vec<String> = file
                .trim_end_matches(".rs")
                .split('/')
                .map(String::from)
                .collect();
            if matches!(
                path.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                path.pop();
            }
            Module { file, path }
        })
        .collect()
}

/// `text` with comments, string and character literals blanked out (newlines kept).
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let blank = |out: &mut String, s: &[u8]| {
        for &c in s {
            out.push(if c == b'\n' { '\n' } else { ' ' });
        }
    };
    while i < b.len() {
        let rest = &b[i..];
        if rest.starts_with(b"//") {
            let end = rest.iter().position(|&c| c == b'\n').unwrap_or(rest.len());
            blank(&mut out, &rest[..end]);
            i += end;
        } else if rest.starts_with(b"/*") {
            let (mut depth, mut j) = (0usize, 0);
            while j < rest.len() {
                if rest[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if rest[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            blank(&mut out, &rest[..j]);
            i += j;
        } else if let Some(len) = raw_string(rest) {
            blank(&mut out, &rest[..len]);
            i += len;
        } else if rest[0] == b'"' {
            let mut j = 1;
            while j < rest.len() && rest[j] != b'"' {
                j += if rest[j] == b'\\' { 2 } else { 1 };
            }
            blank(&mut out, &rest[..(j + 1).min(rest.len())]);
            i += j + 1;
        } else if let Some(len) = char_literal(&text[i..]) {
            blank(&mut out, &rest[..len]);
            i += len;
        } else {
            let c = text[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The length of a raw (byte) string literal at the start of `s`, if one starts there.
fn raw_string(s: &[u8]) -> Option<usize> {
    let start = if s.starts_with(b"br") {
        2
    } else if s.starts_with(b"r") {
        1
    } else {
        return None;
    };
    let hashes = s[start..].iter().take_while(|&&c| c == b'#').count();
    if s.get(start + hashes) != Some(&b'"') {
        return None;
    }
    let close: Vec<u8> = std::iter::once(b'"')
        .chain(std::iter::repeat_n(b'#', hashes))
        .collect();
    let body = start + hashes + 1;
    let end = s[body..]
        .windows(close.len())
        .position(|w| w == close.as_slice())?;
    Some(body + end + close.len())
}

/// The length of a character literal at the start of `s` (`'a'`, `'\n'`, `'"'`), not a lifetime.
fn char_literal(s: &str) -> Option<usize> {
    let body = s.strip_prefix('\'')?;
    if let Some(escaped) = body.strip_prefix('\\') {
        // The escaped character (`'\''` too) is not the closing quote.
        return Some(escaped.get(1..)?.find('\'')? + 4);
    }
    let c = body.chars().next()?;
    body[c.len_utf8()..]
        .starts_with('\'')
        .then_some(c.len_utf8() + 2)
}

/// `code` without the items marked `#[cfg(test)]` (a `use` to its `;`, anything else to the end
/// of its braces).
fn without_test_items(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at..];
        let semi = item.find(';').unwrap_or(item.len());
        let open = item.find('{').unwrap_or(item.len());
        let end = if semi < open {
            semi + 1
        } else {
            let mut depth = 0;
            let mut end = item.len();
            for (j, c) in item.char_indices().skip(open) {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = j + 1;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            end
        };
        out.extend(
            item[..end]
                .chars()
                .map(|c| if c == '\n' { '\n' } else { ' ' }),
        );
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// The names of the modules `code` declares under `#[cfg(test)]` in files of their own.
fn test_modules(code: &str) -> impl Iterator<Item = String> + '_ {
    code.match_indices("#[cfg(test)]").filter_map(|(at, attr)| {
        let item = code[at + attr.len()..].trim_start();
        let item = item.strip_prefix("pub ").unwrap_or(item);
        let name = item.strip_prefix("mod ")?.split(';').next()?.trim();
        name.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_')
            .then(|| name.to_string())
    })
}

/// Every path a `use` tree names, expanded (`a::{b, c::d}` gives `a::b` and `a::c::d`).
fn expand_use(tree: &str) -> Vec<String> {
    // `a as b` keeps `a`; other white space means nothing in a path.
    let words: Vec<&str> = tree.split_whitespace().collect();
    let tree = words.join(" ").replace(" as ", "@").replace(' ', "");
    let Some(open) = tree.find('{') else {
        return vec![tree.split('@').next().unwrap().to_string()];
    };
    let prefix = &tree[..open];
    let inner = &tree[open + 1..tree.rfind('}').unwrap()];
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (j, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..j]);
                start = j + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.is_empty())
        .flat_map(|p| {
            expand_use(p)
                .into_iter()
                .map(move |q| format!("{prefix}{q}"))
        })
        .collect()
}

/// The absolute module paths `code` (of the module at `here`) names: `use` trees in full, and
/// the `crate::`/`super::`/`self::` paths written in code. A path relative to the module (`use
/// child::X`, `child::f()`) counts when its first segment is a child module of `here`.
fn named_paths(code: &str, here: &[String], children: &BTreeSet<String>) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let mut rest = code;
    while let Some(at) = find_word(rest, "use") {
        let end = rest[at..].find(';').map_or(rest.len(), |e| at + e);
        paths.extend(expand_use(&rest[at + 3..end]));
        rest = &rest[end..];
    }
    let bytes = code.as_bytes();
    let starts = ["crate", "super", "self"]
        .into_iter()
        .chain(children.iter().map(String::as_str));
    for start in starts.map(|s| format!("{s}::")) {
        let start = start.as_str();
        let mut from = 0;
        while let Some(pos) = code[from..].find(start) {
            let at = from + pos;
            from = at + start.len();
            if at > 0
                && (bytes[at - 1].is_ascii_alphanumeric()
                    || bytes[at - 1] == b'_'
                    || bytes[at - 1] == b':')
            {
                continue;
            }
            let len = code[at..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(code.len() - at);
            paths.push(code[at..at + len].to_string());
        }
    }
    paths
        .into_iter()
        .filter_map(|p| {
            let segs: Vec<&str> = p.split("::").filter(|s| !s.is_empty()).collect();
            let mut abs: Vec<String> = match segs.first()? {
                &"crate" => Vec::new(),
                &"self" => here.to_vec(),
                &"super" => here.to_vec(),
                first if children.contains(*first) => here.to_vec(),
                _ => return None,
            };
            for s in segs.iter().skip_while(|s| **s == "crate" || **s == "self") {
                if *s == "super" {
                    abs.pop();
                } else {
                    abs.push(s.to_string());
                }
            }
            Some(abs)
        })
        .collect()
}

/// The first position of `word` in `s` as a whole word.
fn find_word(s: &str, word: &str) -> Option<usize> {
    let b = s.as_bytes();
    let mut from = 0;
    while let Some(pos) = s[from..].find(word) {
        let at = from + pos;
        let before = at == 0 || !(b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'_');
        let after = b
            .get(at + word.len())
            .is_none_or(|c| c.is_ascii_whitespace());
        if before && after {
            return Some(at);
        }
        from = at + word.len();
    }
    None
}

/// File -> the files it imports from, each with the names taken (for the failure message).
type Graph = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

/// Every arrow between two files of `src/`, a module's arrows to the modules it declares
/// included; the crate root, which only declares the rooms and re-exports `error.rs`'s types and
/// macros, is left out.
fn import_graph(src: &Path) -> Graph {
    let modules = modules(src);
    let by_path: BTreeMap<Vec<String>, &str> = (modules.iter())
        .map(|m| (m.path.clone(), m.file.as_str()))
        .collect();
    let code: BTreeMap<&str, String> = (modules.iter())
        .map(|m| {
            let text = std::fs::read_to_string(src.join(&m.file)).unwrap();
            (m.file.as_str(), code_only(&text))
        })
        .collect();
    // Modules declared under `#[cfg(test)]` (`mod parity_tests;`) are tests, with all they hold.
    let tests: Vec<Vec<String>> = (modules.iter())
        .flat_map(|m| {
            test_modules(&code[m.file.as_str()]).map(|name| [m.path.clone(), vec![name]].concat())
        })
        .collect();
    let mut graph = Graph::new();
    for m in &modules {
        if tests.iter().any(|t| m.path.starts_with(t)) {
            continue;
        }
        let code = without_test_items(&code[m.file.as_str()]);
        let children: BTreeSet<String> = (modules.iter())
            .filter(|c| c.path.len() == m.path.len() + 1 && c.path.starts_with(&m.path))
            .map(|c| c.path.last().unwrap().clone())
            .collect();
        let edges = graph.entry(m.file.clone()).or_default();
        for path in named_paths(&code, &m.path, &children) {
            // The longest prefix that is a file of the crate is the module imported from.
            let Some(n) = (1..=path.len())
                .rev()
                .find(|&n| by_path.contains_key(&path[..n]))
            else {
                continue;
            };
            let target = by_path[&path[..n]];
            if target != m.file && target != "lib.rs" {
                let name = path
                    .get(n)
                    .cloned()
                    .unwrap_or_else(|| "(the module)".into());
                edges.entry(target.to_string()).or_default().insert(name);
            }
        }
    }
    graph
}

/// The module path of a file (`forward/backend/mod.rs` is `forward/backend`).
fn module_of(file: &str) -> &str {
    let file = file.trim_end_matches(".rs");
    file.strip_suffix("/mod").unwrap_or(file)
}

/// The arrows between files, less a module's arrows to the modules it declares: it holds them,
/// so naming their items (a registry of them, a re-export) is not a dependency.
fn files_graph(graph: &Graph) -> Graph {
    (graph.iter())
        .map(|(a, edges)| {
            let inner = format!("{}/", module_of(a));
            let edges = (edges.iter())
                .filter(|(b, _)| !b.starts_with(&inner))
                .map(|(b, names)| (b.clone(), names.clone()))
                .collect();
            (a.clone(), edges)
        })
        .collect()
}

/// The arrows between rooms, the top-level modules of `src/` (a folder with all it holds, or a
/// file), each with the files that make it.
fn rooms_graph(graph: &Graph) -> Graph {
    let room = |file: &str| module_of(file).split('/').next().unwrap().to_string();
    let mut rooms = Graph::new();
    for (a, edges) in graph {
        let entry = rooms.entry(room(a)).or_default();
        for b in edges.keys() {
            if room(b) != room(a) {
                entry
                    .entry(room(b))
                    .or_default()
                    .insert(format!("{a} -> {b}"));
            }
        }
    }
    rooms
}

/// The strongly connected components of more than one file (Tarjan's algorithm).
fn circles(graph: &Graph) -> Vec<Vec<String>> {
    struct Walk<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        found: Vec<Vec<String>>,
    }
    impl<'g> Walk<'g> {
        fn visit(&mut self, v: &'g str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flat_map(|e| e.keys()) {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                loop {
                    let w = self.stack.pop().unwrap();
                    self.on_stack.remove(w);
                    component.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.found.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// What ties each circle: every arrow inside it, with the names it takes.
fn describe(graph: &Graph, found: &[Vec<String>]) -> String {
    let mut message = String::new();
    for component in found {
        message.push_str(&format!("circle of {}:\n", component.join(", ")));
        for a in component {
            for (b, names) in &graph[a] {
                if component.contains(b) {
                    let names: Vec<&str> = names.iter().map(String::as_str).collect();
                    message.push_str(&format!("  {a} -> {b}: {}\n", names.join(", ")));
                }
            }
        }
    }
    message
}

#[test]
fn no_file_of_src_imports_itself_through_others() {
    let graph = files_graph(&import_graph(&src()));
    let found = circles(&graph);
    assert!(
        found.is_empty(),
        "import circles between files of src/:\n{}",
        describe(&graph, &found)
    );
}

#[test]
fn no_room_of_src_imports_itself_through_others() {
    let graph = rooms_graph(&import_graph(&src()));
    let found = circles(&graph);
    assert!(
        found.is_empty(),
        "import circles between rooms of src/:\n{}",
        describe(&graph, &found)
    );
}

/// The floor and entry of a forward file, if it is one of the stack's.
fn floor(file: &str) -> Option<(usize, &'static str)> {
    FORWARD_STACK
        .iter()
        .copied()
        .find(|(_, entry)| match entry.strip_suffix('/') {
            Some(dir) => file.starts_with(&format!("{dir}/")),
            None => file == *entry,
        })
}

#[test]
fn the_forward_stack_imports_only_downward() {
    let graph = files_graph(&import_graph(&src()));
    let forward: Vec<&String> = (graph.keys())
        .filter(|f| f.starts_with("forward/") && *f != "forward/mod.rs")
        .collect();
    let unplaced: Vec<&&String> = forward.iter().filter(|f| floor(f).is_none()).collect();
    assert!(
        unplaced.is_empty(),
        "forward files on no floor of FORWARD_STACK: {unplaced:?}"
    );
    let mut wrong = Vec::new();
    for a in forward {
        let (fa, ea) = floor(a).unwrap();
        for (b, names) in &graph[a] {
            let Some((fb, eb)) = floor(b) else { continue };
            if fb > fa || (fb == fa && eb != ea) {
                wrong.push(format!("{a} (floor {fa}) -> {b} (floor {fb}): {names:?}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "forward files importing from their own floor or above:\n{}",
        wrong.join("\n")
    );
}

/// The reader itself: a circle planted in a scratch tree is found, with the names that tie it,
/// and what a comment, a string or a `#[cfg(test)]` item names is not an import.
#[test]
fn the_reader_finds_a_planted_circle_and_ignores_tests_and_comments() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::create_dir_all(src.join("room")).unwrap();
    let low = "// use crate::top::Top;\nconst S: &str = \"crate::top::Top\";\n#[cfg(test)]\n\
               mod tests { use crate::top::Top; }\npub struct Low;\n";
    let files = [
        (
            "lib.rs",
            "pub mod room;\npub mod top;\n#[cfg(test)]\nmod checks;\n",
        ),
        (
            "checks.rs",
            "use crate::room::low::Low;\nuse crate::top::f;\n",
        ),
        (
            "room/mod.rs",
            "pub mod low;\npub mod side;\nfn f() { side::g() }\n",
        ),
        (
            "room/side.rs",
            "use crate::room::low::Low as Renamed;\npub fn g() {}\n\
             fn h<'a>(_: &'a str) -> [char; 2] { ['\\'', '\"'] }\n\
             const T: &str = \"crate::top::f\";\n",
        ),
        ("room/low.rs", low),
        (
            "top.rs",
            "use crate::room::{low::{self, Low}, Other};\npub fn f() { super::top::g(); }\n",
        ),
    ];
    for (name, text) in files {
        std::fs::write(src.join(name), text).unwrap();
    }
    let graph = import_graph(src);
    assert!(circles(&files_graph(&graph)).is_empty(), "{graph:?}");
    assert!(circles(&rooms_graph(&graph)).is_empty(), "{graph:?}");
    assert!(graph["room/low.rs"].is_empty(), "{graph:?}");
    assert!(
        !graph.contains_key("checks.rs"),
        "a test module is no room: {graph:?}"
    );
    let targets = |file: &str| graph[file].keys().cloned().collect::<Vec<_>>();
    assert_eq!(targets("top.rs"), ["room/low.rs", "room/mod.rs"]);
    assert_eq!(targets("room/mod.rs"), ["room/side.rs"]);
    assert!(graph["room/side.rs"]["room/low.rs"].contains("Low"));
    // Its character literals and lifetimes do not hide the string that names `crate::top`.
    assert_eq!(targets("room/side.rs"), ["room/low.rs"]);
    // A module naming its own children (`side::g()`) is no arrow between files.
    assert!(files_graph(&graph)["room/mod.rs"].is_empty());

    // Now low.rs imports top.rs in code, which imports low.rs: a circle of two files, and of
    // the two rooms `room` and `top`.
    std::fs::write(
        src.join("room/low.rs"),
        "pub struct Low;\nfn g() { crate::top::f(); }\n",
    )
    .unwrap();
    let graph = import_graph(src);
    assert!(graph["room/low.rs"]["top.rs"].contains("f"));
    let pair = |a: &str, b: &str| vec![vec![a.to_string(), b.to_string()]];
    assert_eq!(circles(&files_graph(&graph)), pair("room/low.rs", "top.rs"));
    assert_eq!(circles(&rooms_graph(&graph)), pair("room", "top"));

    // A room whose parent module reaches back out through its child: side.rs imports top.rs,
    // which imports room/mod.rs. No two files import each other, but the rooms do.
    std::fs::write(src.join("room/low.rs"), "pub struct Low;\n").unwrap();
    std::fs::write(src.join("room/side.rs"), "pub fn g() { crate::top::f() }\n").unwrap();
    std::fs::write(src.join("top.rs"), "pub fn f() { crate::room::Other }\n").unwrap();
    let graph = import_graph(src);
    assert!(circles(&files_graph(&graph)).is_empty(), "{graph:?}");
    assert_eq!(circles(&rooms_graph(&graph)), pair("room", "top"));
}
