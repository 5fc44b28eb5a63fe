//! Flags and output paths a hostile user gives (issue 23, items 11-17): every one is refused
//! before any work with exit code 2 and an error naming the flag or file, and nothing is
//! written; or, where the input is usable, it runs with a warning.

use std::path::{Path, PathBuf};

use crate::util::{leftovers, root, sinkmerge};

fn asset(name: &str) -> String {
    root()
        .join("assets/models")
        .join(name)
        .display()
        .to_string()
}

fn pair() -> (String, String) {
    (asset("tiny-qwen3/ref"), asset("tiny-qwen3/vl"))
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A copy of `model` (its files symlinked) whose config.json declares `layers` layers.
fn with_layers(model: &str, layers: usize) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(model).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "config.json" {
            std::os::unix::fs::symlink(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(Path::new(model).join("config.json")).unwrap())
            .unwrap();
    config["num_hidden_layers"] = layers.into();
    if let Some(types) = config["layer_types"].as_array_mut() {
        types.truncate(layers);
    }
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_vec_pretty(&config).unwrap(),
    )
    .unwrap();
    dir
}

/// Every count flag has a maximum, refused when the command line is read: nothing is allocated,
/// nothing runs, no report is written.
#[test]
fn unbounded_counts_are_refused_with_their_maximum() {
    let (r, t) = pair();
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("plot.svg");
    let p = s(&plot);
    let cases: [(&[&str], &[&str]); 9] = [
        (
            &[
                "score",
                &r,
                "--k-sweep",
                "1-18446744073709551615",
                "--plot",
                p,
            ],
            &["--k-sweep", "HI <= 1024"],
        ),
        (
            &["score", &r, "--k-sweep", "1-1000000000", "--plot", p],
            &["--k-sweep", "HI <= 1024"],
        ),
        (
            &["score", &r, "--bootstrap", "4294967295", "--plot", p],
            &["--bootstrap", "too large: the maximum is 1000000"],
        ),
        (
            &["score", &r, "--bootstrap", "1e19", "--plot", p],
            &["--bootstrap", "1e19 is too large"],
        ),
        (
            &["score", &r, "--sweep", "5", "--seeds", "4294967295"],
            &["--seeds", "the maximum is 1000"],
        ),
        (
            &[
                "heads",
                &r,
                &t,
                "--permutations",
                "18446744073709551615",
                "--csv",
                p,
            ],
            &["--permutations", "the maximum is 1000000"],
        ),
        (
            &["--threads", "100000", "score", &r, "--plot", p],
            &["--threads", "the maximum is 1024"],
        ),
        (
            &["score", &r, "--threads", "0", "--plot", p],
            &["--threads", "at least 1"],
        ),
        (
            &["score", &r, "--bootstrap", "2.5", "--plot", p],
            &["--bootstrap", "not a whole number"],
        ),
    ];
    for (args, needles) in cases {
        sinkmerge(args).refused_with_usage(needles);
        assert!(!plot.exists(), "{args:?} wrote a report");
    }
}

/// `--sweep 5,5` would count N = 5's draws twice in its mean and std.
#[test]
fn a_sweep_size_given_twice_is_refused() {
    let (r, _) = pair();
    let err = sinkmerge(["score", &r, "--sweep", "5,10,5", "--seeds", "2"])
        .refused(&["--sweep", "5 is listed twice"]);
    assert!(err.starts_with("sinkmerge: error:"), "{err}");
}

/// Two outputs of one command that are one file, by name, through `./` or `..`, through a
/// symlinked directory or a hard link, and an output that is an input file, are refused before
/// any work.
#[test]
fn two_outputs_that_are_one_file_are_refused() {
    let (r, t) = pair();
    let dir = tempfile::tempdir().unwrap();
    let real = dir.path().join("real");
    std::fs::create_dir(&real).unwrap();
    std::os::unix::fs::symlink(&real, dir.path().join("link")).unwrap();
    let f = real.join("out.svg");
    let dotted = dir.path().join("real/./sub/../out.svg");
    let linked = dir.path().join("link/out.svg");
    let prompts = dir.path().join("prompts.txt");
    std::fs::write(&prompts, "The capital of France is\n").unwrap();
    let hard = dir.path().join("hard.txt");
    std::fs::hard_link(&prompts, &hard).unwrap();
    let cases: Vec<(Vec<&str>, Vec<&str>)> = vec![
        (
            vec!["heads", &r, &t, "--csv", s(&f), "--heatmap", s(&f)],
            vec!["--heatmap", "is the same file as --csv"],
        ),
        (
            vec!["score", &r, "--plot", s(&f), "--heatmap", s(&dotted)],
            vec!["--heatmap", "is the same file as --plot"],
        ),
        (
            vec!["score", &r, "--plot", s(&f), "--heatmap", s(&linked)],
            vec!["--heatmap", "is the same file as --plot"],
        ),
        (
            vec!["norms", &r, &t, "--csv", s(&f), "--plot", s(&linked)],
            vec!["--plot", "is the same file as --csv"],
        ),
        (
            vec!["score", &r, "--prompts", s(&prompts), "--plot", s(&hard)],
            vec!["--plot", "would overwrite the --prompts file"],
        ),
        (
            vec!["score", &r, "--text", s(&prompts), "--heatmap", s(&prompts)],
            vec!["--heatmap", "would overwrite the --text file"],
        ),
        (
            vec!["predict", "--panel", s(&prompts), "--plot", s(&prompts)],
            vec!["--plot", "would overwrite the --panel file"],
        ),
    ];
    for (args, needles) in cases {
        sinkmerge(&args).refused(&needles);
        assert!(!f.exists(), "{args:?} wrote a report");
    }
    assert_eq!(
        std::fs::read_to_string(&prompts).unwrap(),
        "The capital of France is\n"
    );
}

/// An output under a regular file fails at once with exit 2 naming that file, not with "File
/// exists" and exit 1 after the scoring pass; so does `-o` naming a file.
#[test]
fn outputs_under_a_regular_file_are_refused_before_any_work() {
    let (r, t) = pair();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("notes.txt");
    std::fs::write(&file, "keep").unwrap();
    let under = file.join("x.svg");
    let out = file.join("out");
    let named = format!("{} is a file, not a directory", file.display());
    let cases: Vec<Vec<&str>> = vec![
        vec!["score", &r, "--plot", s(&under)],
        vec!["heads", &r, &t, "--heatmap", s(&under)],
        vec!["norms", &r, &t, "--csv", s(&under)],
        vec![
            "repair-heads",
            "--ref",
            &r,
            &t,
            "--heads",
            "top:2",
            "-o",
            s(&out),
        ],
        vec!["linear", "--models", &r, &t, "-o", s(&out)],
        vec!["extract", &t, "-o", s(&out)],
    ];
    for args in cases {
        sinkmerge(&args).refused(&[&named]);
    }
    sinkmerge([
        "repair-heads",
        "--ref",
        &r,
        &t,
        "--heads",
        "top:2",
        "-o",
        s(&file),
    ])
    .refused(&["-o", "exists and is not a directory"]);
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep");
    assert_eq!(leftovers(dir.path()), Vec::<String>::new());
}

/// A config without layers is refused where it is read; one that declares fewer layers than the
/// weights hold scores the declared ones, with a warning.
#[test]
fn configs_with_no_layers_or_fewer_than_the_weights() {
    let (r, t) = pair();
    let none = with_layers(&t, 0);
    sinkmerge(["score", s(none.path())]).refused(&["num_hidden_layers 0 is outside 1-65536"]);
    sinkmerge(["heads", &r, s(none.path())]).refused(&["num_hidden_layers 0 is outside 1-65536"]);
    let five = with_layers(&t, 5);
    let (out, _) = sinkmerge(["score", s(five.path()), "--n", "2", "--json"]).warns(&[
        "declares num_hidden_layers 5",
        "hold 6 layers; layer 5 is ignored",
    ]);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["models"][0]["num_layers"], 5);
}

/// Each message names the thing that is wrong.
#[test]
fn messages_name_the_flag_and_the_value() {
    let (r, t) = pair();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = s(&out);
    let repair = |extra: &[&str]| {
        let mut args = vec!["repair-heads", "--ref", &r, &t, "-o", o];
        args.extend_from_slice(extra);
        sinkmerge(args)
    };
    repair(&["--heads", "1.1,2.0,1.1"])
        .refused_with_usage(&["--heads", "head 1.1 is listed twice"]);
    repair(&["--heads", "top:2,1.1"]).refused_with_usage(&["--heads", "one count, not a list"]);
    repair(&["--heads", "top:99999999999999999999999"])
        .refused_with_usage(&["--heads", "is too large"]);
    repair(&["--heads", "1.1", "--max-shard-size", "abc"])
        .refused(&["--max-shard-size: invalid size `abc`"]);
    sinkmerge(["score", &r, "--device", "cuda:7"]).refused(&["--device cuda:7"]);
    assert!(!out.exists());

    let recipe = dir.path().join("sinkmerge_config.yml");
    std::fs::write(
        &recipe,
        format!(
            "method: repair_heads\nreference: {r}\ntarget: {t}\nselection: 1.1\n\
             candidate_layers: [4, 5]\nheads:\n- '1.1'\nmodules:\n- q\n- k\nlambda: 1.0\n"
        ),
    )
    .unwrap();
    sinkmerge(["merge", s(&recipe), "-o", o]).refused(&[
        "this is a repair-heads recipe",
        &format!("sinkmerge repair-heads --ref {r} {t} --heads 1.1 --modules q,k"),
    ]);
    assert!(!out.exists());
}

/// Empty list items, repeated items and flags that would do nothing in the mode given are
/// refused, the same way in every command.
#[test]
fn lists_and_flags_accepted_in_silence_are_refused() {
    let (r, t) = pair();
    let dir = tempfile::tempdir().unwrap();
    let out: PathBuf = dir.path().join("out");
    let o = s(&out);
    let repair = |extra: &[&str]| {
        let mut args = vec!["repair-heads", "--ref", &r, &t, "-o", o];
        args.extend_from_slice(extra);
        sinkmerge(args)
    };
    repair(&["--heads", "1.1,"]).refused_with_usage(&["--heads", "an empty item"]);
    repair(&["--heads", "top:2", "--layers", "1,,2"])
        .refused_with_usage(&["--layers", "an empty item"]);
    repair(&["--heads", "1.1", "--modules", "q,k,q"])
        .refused(&["--modules", "`q` is listed twice"]);
    repair(&["--heads", "1.1", "--modules", "q,"]).refused(&["--modules", "an empty item"]);
    repair(&["--heads", "1.1", "--n", "5"]).refused(&["--n applies to --heads top:K only"]);
    repair(&["--heads", "top:2", "--seed", "3"]).refused(&["--seed applies to --heads random:K"]);
    repair(&["--heads", "random:2", "--rank-by", "margin"])
        .refused(&["--rank-by applies to --heads top:K"]);
    repair(&["--heads", "1.1", "--last", "3"]).refused(&["--last applies to --heads top:K"]);
    assert!(!out.exists());

    sinkmerge(["heads", &r, &t, "--layers", "1,,2"])
        .refused_with_usage(&["--layers", "empty item"]);
    sinkmerge(["norms", &r, &t, "--modules", "q_proj,q_proj"])
        .refused(&["--modules", "`q_proj` is listed twice"]);
    sinkmerge([
        "ablate",
        &t,
        "--norms",
        "input_layernorm,input_layernorm",
        "-o",
        o,
    ])
    .refused(&["--norms", "`input_layernorm` is listed twice"]);
    sinkmerge(["score", &r, "--bootstrap", "1"])
        .refused_with_usage(&["--bootstrap", "at least 100"]);
    assert!(!out.exists());
    assert_eq!(leftovers(dir.path()), Vec::<String>::new());
}

/// Every numeric flag takes a negative value after a space as it does after `=`: the value
/// reaches the flag's own check (or is used, where it is valid) instead of being taken for an
/// unknown flag (`--gate -0.5` was "unexpected argument '-0'"). Values that start like a flag
/// but are not one count too: exponents (`-1e-3`) and lists (`-0.5,1.5`).
#[test]
fn negative_values_after_a_space_reach_the_flags_own_check() {
    let (r, t) = pair();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = s(&out);
    let merge = |method: &'static str, extra: &[&'static str]| {
        let mut args: Vec<&str> = vec![method, "--base", &r, "--models", &t, "-o", o];
        args.extend_from_slice(extra);
        args
    };
    // Refused by clap's value parsers: exit 2 with usage lines.
    let parsed: Vec<(Vec<&str>, &[&str])> = vec![
        (
            vec!["visual-sinks", &r, "--gate", "-1.5"],
            &["--gate", "-1.5 is outside [-1, 1]"],
        ),
        (
            vec!["visual-sinks", &r, "--ratio", "-5"],
            &["--ratio", "-5 is not a positive number"],
        ),
        (
            vec!["visual-sinks", &r, "--box", "-1,0,x,10"],
            &["--box", "`x`"],
        ),
        (
            vec!["visual-sinks", &r, "--seed", "-1"],
            &["--seed", "invalid digit"],
        ),
        (
            vec!["norms", &r, &t, "--tol", "-1e-3"],
            &["--tol", "outside 1e-7..=0.1"],
        ),
        (
            vec!["norms", &r, &t, "--last", "-1"],
            &["--last", "invalid digit"],
        ),
        (
            vec!["norms", &r, &t, "--window", "-1"],
            &["--window", "invalid digit"],
        ),
        (
            vec!["score", &r, "--trailing-queries", "-1"],
            &["--trailing-queries", "at least 1"],
        ),
        (
            vec!["score", &r, "--bootstrap", "-5"],
            &["--bootstrap", "at least 100"],
        ),
        (
            vec!["score", &r, "--bootstrap-seed", "-1"],
            &["--bootstrap-seed", "invalid digit"],
        ),
        (vec!["score", &r, "--n", "-1"], &["--n", "invalid digit"]),
        (
            vec!["score", &r, "--n", "5", "--seed", "-1"],
            &["--seed", "invalid digit"],
        ),
        (
            vec!["score", &r, "--last", "-1"],
            &["--last", "invalid digit"],
        ),
        (
            vec!["score", &r, "--k-sweep", "-1-5"],
            &["--k-sweep", "LO-HI"],
        ),
        (
            vec!["score", &r, "--sweep", "-1,2"],
            &["--sweep", "invalid digit"],
        ),
        (
            vec!["score", &r, "--sweep", "5", "--seeds", "-1"],
            &["--seeds", "at least 1"],
        ),
        (
            vec!["score", &r, "--text", "x", "--text-window", "-1"],
            &["--text-window", "invalid digit"],
        ),
        (
            vec!["score", &r, "--max-memory", "-1"],
            &["--max-memory", "size in bytes"],
        ),
        (
            vec!["--threads", "-1", "score", &r],
            &["--threads", "at least 1"],
        ),
        (
            vec!["heads", &r, &t, "--top", "-1"],
            &["--top", "invalid digit"],
        ),
        (
            vec!["heads", &r, &t, "--permutations", "-1"],
            &["--permutations", "at least 0"],
        ),
        (
            vec!["heads", &r, &t, "--permutation-seed", "-1"],
            &["--permutation-seed", "invalid digit"],
        ),
        (
            vec!["ablate", &r, "--top-k", "-1", "-o", o],
            &["--top-k", "invalid digit"],
        ),
        (
            vec!["perturb", &r, "--match", &t, "--seed", "-1", "-o", o],
            &["--seed", "invalid digit"],
        ),
        (
            vec![
                "repair-heads",
                "--ref",
                &r,
                &t,
                "--heads",
                "top:2",
                "--n",
                "-1",
                "-o",
                o,
            ],
            &["--n", "invalid digit"],
        ),
        (
            vec![
                "repair-heads",
                "--ref",
                &r,
                &t,
                "--heads",
                "random:2",
                "--seed",
                "-1",
                "-o",
                o,
            ],
            &["--seed", "invalid digit"],
        ),
        (
            vec![
                "repair-heads",
                "--ref",
                &r,
                &t,
                "--heads",
                "top:2",
                "--last",
                "-1",
                "-o",
                o,
            ],
            &["--last", "invalid digit"],
        ),
        (
            vec![
                "repair-heads",
                "--ref",
                &r,
                &t,
                "--heads",
                "top:2",
                "--n",
                "5",
                "--prompt-seed",
                "-1",
                "-o",
                o,
            ],
            &["--prompt-seed", "invalid digit"],
        ),
        (
            merge("dare", &["--density", "0.5", "--seed", "-1"]),
            &["--seed", "invalid digit"],
        ),
    ];
    for (args, needles) in parsed {
        let err = sinkmerge(&args).refused_with_usage(needles);
        assert!(!err.contains("unexpected argument"), "{args:?}: {err}");
    }
    // Refused by the command's own checks: one line, exit 2.
    let checked: Vec<(Vec<&str>, &[&str])> = vec![
        (
            vec!["predict", "--similar-within", "-0.5"],
            &["--similar-within", "-0.5"],
        ),
        (
            vec![
                "repair-heads",
                "--ref",
                &r,
                &t,
                "--heads",
                "1.1",
                "--lambda",
                "-0.5",
                "-o",
                o,
            ],
            &["--lambda -0.5 is outside [0, 1]"],
        ),
        (
            merge("ties", &["--density", "-0.1"]),
            &["density -0.1", "outside (0, 1]"],
        ),
        (
            merge("dare", &["--density", "-0.1"]),
            &["density -0.1", "outside (0, 1]"],
        ),
        (
            merge("dare", &["--drop-rate", "-0.1"]),
            &["density 1.1", "outside (0, 1]"],
        ),
        (
            merge("star", &["--eta", "-5"]),
            &["eta -5", "outside (0, 100]"],
        ),
        (
            vec![
                "visual-sinks",
                &r,
                "--question",
                "q",
                "--image",
                "no-such.png",
                "--gate",
                "-0.5",
                "--box",
                "-1,0,10,10",
            ],
            &["no-such.png", "no such image"],
        ),
    ];
    for (args, needles) in checked {
        sinkmerge(&args).refused(needles);
    }
    assert!(!out.exists());
    // Valid negative values are used.
    let report = sinkmerge(["predict", "--s", "-1.5", "--json"]).json();
    assert_eq!(report["query"]["sink_strength"], -1.5, "{report}");
    for args in [
        vec![
            "linear",
            "--models",
            &r,
            &t,
            "--weights",
            "-0.5,1.5",
            "-o",
            o,
        ],
        merge(
            "task-arithmetic",
            &["--weights", "-2", "--lambda", "-1e-3", "--force"],
        ),
        merge("tsv", &["--alpha", "-1e-3", "--force"]),
    ] {
        sinkmerge(&args).ok();
    }
}
