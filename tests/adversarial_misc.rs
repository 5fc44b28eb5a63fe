//! Hostile inputs that are neither checkpoints nor flags: chat templates that would run without
//! end, and references whose text a suggested command line would hand to the shell.

use std::path::Path;
use std::time::Duration;

use crate::util::{fixture, refused, sinkmerge};

/// A copy of `model` (its files symlinked) whose chat template is `template`, stored as
/// `file`: `tokenizer_config.json` (its `chat_template` key) or `chat_template.jinja`.
fn with_template(model: &Path, file: &str, template: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(model).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "tokenizer_config.json" {
            std::os::unix::fs::symlink(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(model.join("tokenizer_config.json")).unwrap())
            .unwrap();
    if file == "tokenizer_config.json" {
        config["chat_template"] = template.into();
    } else {
        std::fs::write(dir.path().join(file), template).unwrap();
    }
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        serde_json::to_vec_pretty(&config).unwrap(),
    )
    .unwrap();
    dir
}

/// A template that loops 10^5 x 10^5 times, one that writes 10 MB 10^5 times and one that
/// recurses without end are each stopped within seconds (by its budget, or minijinja's recursion
/// limit), with one line naming the file it came from, exit 2.
#[test]
fn a_chat_template_that_never_ends_is_stopped_naming_its_file() {
    let endless =
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}";
    let huge = "{% set s = 'x' * 10000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}";
    let deep = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
    for (file, template) in [
        ("tokenizer_config.json", endless),
        ("chat_template.jinja", endless),
        ("chat_template.jinja", huge),
        ("tokenizer_config.json", deep),
    ] {
        let model = with_template(&fixture("qwen3"), file, template);
        let output = sinkmerge(["score", "--chat-template"])
            .args([model.path()])
            .watch(b"", Duration::from_secs(30))
            .0
            .unwrap_or_else(|| panic!("{template}: still running after 30 s"));
        refused(&output, &[file, "chat template"]);
    }
}

/// A command line a message suggests quotes what the user typed when it holds more than plain
/// characters, so that pasting it runs nothing else: `$(id)` reaches `hf` as a revision.
#[test]
fn suggested_commands_quote_what_the_user_typed() {
    let err = sinkmerge(["--no-download", "inspect", "org/tiny@$(id)"])
        .refused(&["`hf download org/tiny --revision '$(id)'`"]);
    assert!(!err.contains("--revision $(id)"), "{err}");
    sinkmerge(["--no-download", "inspect", "org/tiny@it's"])
        .refused(&["`hf download org/tiny --revision 'it'\\''s'`"]);

    let dir = tempfile::tempdir().unwrap();
    let recipe = dir.path().join("sinkmerge_config.yml");
    std::fs::write(
        &recipe,
        "method: repair_heads\nreference: ref dir/$(id)\ntarget: vl;rm\nselection: 1.1\n\
         heads:\n- '1.1'\nmodules:\n- q\n- k\nlambda: 1.0\ninto_vlm: a`b`\n",
    )
    .unwrap();
    let out = dir.path().join("out");
    sinkmerge([
        std::ffi::OsStr::new("merge"),
        recipe.as_os_str(),
        std::ffi::OsStr::new("-o"),
        out.as_os_str(),
    ])
    .refused(&[
        "`sinkmerge repair-heads --ref 'ref dir/$(id)' 'vl;rm' --heads 1.1 --modules q,k --lambda ",
        " --into-vlm 'a`b`' -o OUT`",
    ]);
    assert!(!out.exists());
}
