//! `sinkmerge reproduce`: the pipeline on the bundled pair, its numbers against the standalone
//! commands, resuming after a kill, redoing exactly what an input change reaches, and the checks
//! before any step.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::util::{read_json, root, sinkmerge};

const REF: &str = "assets/models/tiny-qwen3/ref";
const VLM: &str = "assets/models/tiny-qwen3/vlm";
/// Two settings keep the tests short: one linear, one spectral.
const MERGES: &str = "average,tsv";

fn reproduce(dir: &Path, extra: &[&str]) -> Value {
    let mut args: Vec<String> = ["reproduce", "--ref", REF, "--vlm", VLM, "--merges", MERGES]
        .map(String::from)
        .to_vec();
    args.extend([
        "-o".into(),
        dir.to_string_lossy().into_owned(),
        "--json".into(),
    ]);
    args.extend(extra.iter().map(|s| s.to_string()));
    sinkmerge(args).json()
}

/// Every step's manifest as bytes: a step that ran again rewrote its manifest (with its new
/// duration), one that was reused did not touch it.
fn manifests(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for entry in fs::read_dir(dir.join("steps")).unwrap().flatten() {
        if let Ok(bytes) = fs::read(entry.path().join("manifest.json")) {
            out.insert(entry.file_name().to_string_lossy().into_owned(), bytes);
        }
    }
    out
}

/// The steps whose manifests differ between two snapshots.
fn redone(before: &BTreeMap<String, Vec<u8>>, after: &BTreeMap<String, Vec<u8>>) -> Vec<String> {
    after
        .iter()
        .filter(|(name, bytes)| before.get(*name) != Some(bytes))
        .map(|(name, _)| name.clone())
        .collect()
}

/// A summary with the run's directory written as `DIR`, to compare runs in two directories.
fn relative(summary: &Value, dir: &Path) -> String {
    summary.to_string().replace(&*dir.to_string_lossy(), "DIR")
}

#[test]
fn the_summary_holds_the_standalone_commands_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let summary = reproduce(&dir, &["--keep-models"]);
    assert_eq!(summary, read_json::<Value>(dir.join("summary.json")));
    let html = fs::read_to_string(dir.join("report.html")).unwrap();
    for section in crate::browser::SECTIONS {
        assert!(
            html.contains(&format!("<section id=\"{section}\">")),
            "{section}"
        );
    }
    // Self-contained: no script, and no address but the SVG namespace.
    assert!(!html.contains("<script"));
    let addresses = html.matches("http").count();
    assert_eq!(
        addresses,
        html.matches("xmlns=\"http://www.w3.org/2000/svg\"").count()
    );

    let lm = dir.join("models/vlm-lm");
    let text = dir.join("inputs/sample.txt");
    assert_eq!(
        fs::read(&text).unwrap(),
        fs::read(root().join("assets/text/sample.txt")).unwrap()
    );
    let score = |model: &Path| -> Value {
        sinkmerge(["score", "--ref", REF])
            .args([
                model,
                Path::new("--bands"),
                Path::new("thirds"),
                Path::new("--text"),
                &text,
            ])
            .arg_json()
    };
    let rows = summary["scores"].as_array().unwrap();
    let row = |name: &str| rows.iter().find(|r| r["model"] == name).unwrap().clone();
    let direct = score(&lm);
    let vlm_lm = row("vlm_lm");
    for (key, value) in [
        ("sink_strength", &direct["models"][1]["sink_strength"]),
        ("pos0_trailing", &direct["models"][1]["pos0_trailing"]),
        ("pos0_trailing_ci", &direct["models"][1]["pos0_trailing_ci"]),
        (
            "sink_strength_bands",
            &direct["models"][1]["sink_strength_bands"],
        ),
        ("perplexity", &direct["models"][1]["text"]["perplexity"]),
        ("margin", &direct["pairs"][0]["margin"]),
        ("b_gap_median", &direct["pairs"][0]["b_gap_median"]),
    ] {
        assert_eq!(&vlm_lm[key], value, "vlm_lm {key}");
    }
    let reference = sinkmerge(["score", REF, "--bands", "thirds", "--text"])
        .args([&text])
        .arg_json();
    assert_eq!(
        row("ref")["sink_strength"],
        reference["models"][0]["sink_strength"]
    );
    assert_eq!(
        row("ref")["perplexity"],
        reference["models"][0]["text"]["perplexity"]
    );
    for setting in ["average", "tsv"] {
        let model = dir.join("models").join(setting);
        let direct = score(&model);
        let r = row(setting);
        assert_eq!(
            r["sink_strength"], direct["models"][1]["sink_strength"],
            "{setting}"
        );
        assert_eq!(r["margin"], direct["pairs"][0]["margin"], "{setting}");
        let delta =
            r["sink_strength"].as_f64().unwrap() - vlm_lm["sink_strength"].as_f64().unwrap();
        assert_eq!(
            r["delta_vs_vlm_lm"]["sink_strength"].as_f64().unwrap(),
            delta
        );
        // The merge step is `sinkmerge merge` of the config beside its manifest: replayed by
        // hand, it writes the same tensors.
        let replay = tmp.path().join(format!("replay-{setting}"));
        sinkmerge(["merge"])
            .args([
                dir.join(format!("steps/merge-{setting}/config.yml")),
                "-o".into(),
                replay.clone(),
            ])
            .ok();
        assert_eq!(
            fs::read(replay.join("model.safetensors")).unwrap(),
            fs::read(model.join("model.safetensors")).unwrap(),
            "{setting}"
        );
    }

    let norms = sinkmerge(["norms", REF]).args([&lm]).arg_json();
    for module in ["q_proj", "down_proj", "input_layernorm"] {
        assert_eq!(
            summary["drift"]["summary"][module], norms["summary"][module]["all"],
            "{module}"
        );
    }
    let q = norms["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["module"] == "q_proj" && r["layer"] == 3)
        .unwrap();
    assert_eq!(summary["drift"]["layers"][3]["op"]["q_proj"], q["op"]);
    assert_eq!(
        summary["drift"]["layers"][3]["stable_rank"]["q_proj"],
        q["stable_rank"]
    );

    let heads = sinkmerge(["heads", REF])
        .args([&lm])
        .args(["--json"])
        .json();
    let first = &heads["heads"][heads["ranking"][0].as_u64().unwrap() as usize];
    let top = &summary["heads"]["top"][0];
    assert_eq!(
        (&top["layer"], &top["head"], &top["delta_g"]),
        (&first["layer"], &first["head"], &first["delta_g"])
    );
    assert_eq!(summary["heads"]["top"].as_array().unwrap().len(), 10);

    let s = row("ref")["sink_strength"].as_f64().unwrap();
    let predict = sinkmerge(["predict", "--s", &format!("{s}"), "--json"]).json();
    assert_eq!(
        summary["predictor"]["predicted"],
        predict["query"]["predicted"]
    );
    assert_eq!(summary["predictor"]["spearman"], predict["spearman"]);

    // Without --base, TIES and DARE are not run, and the report says why.
    for setting in ["ties", "dare"] {
        assert!(!summary["merges"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["setting"] == setting));
    }
}

/// `args` then `--json`, parsed.
trait ArgJson {
    fn arg_json(self) -> Value;
}

impl ArgJson for crate::util::Sinkmerge {
    fn arg_json(self) -> Value {
        self.args(["--json"]).json()
    }
}

#[test]
fn a_killed_run_redoes_only_the_step_it_was_in_and_those_after_it() {
    let tmp = tempfile::tempdir().unwrap();
    let whole = tmp.path().join("whole");
    let expected = reproduce(&whole, &[]);

    // A merge step writes its config first: stop the run the moment the second merge starts,
    // and kill it if that merge has not finished yet (else try again: the step is short).
    let dir = (0..20)
        .find_map(|attempt| {
            let dir = tmp.path().join(format!("killed-{attempt}"));
            let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sinkmerge"))
                .current_dir(root())
                .args([
                    "reproduce",
                    "--ref",
                    REF,
                    "--vlm",
                    VLM,
                    "--merges",
                    MERGES,
                    "-o",
                ])
                .arg(&dir)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            let started = Instant::now();
            let config = dir.join("steps/merge-tsv/config.yml");
            while !config.exists() {
                assert!(
                    started.elapsed() < Duration::from_secs(300),
                    "the merge never started"
                );
                assert!(
                    child.try_wait().unwrap().is_none(),
                    "the run ended before the merge"
                );
            }
            let pid = child.id() as i32;
            // SAFETY: kill(2) on our own child, which has not been waited for.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            let in_merge = !dir.join("steps/merge-tsv/manifest.json").exists();
            child.kill().unwrap();
            child.wait().unwrap();
            in_merge.then_some(dir)
        })
        .expect("20 runs were all past the merge before they could be stopped");
    let before = manifests(&dir);
    assert!(
        !before.contains_key("merge-tsv") && !before.contains_key("score-tsv"),
        "{:?}",
        before.keys()
    );
    assert!(before.contains_key("score-average") && before.contains_key("extract"));

    let resumed = reproduce(&dir, &[]);
    let after = manifests(&dir);
    assert_eq!(redone(&before, &after), ["merge-tsv", "score-tsv"]);
    assert_eq!(relative(&resumed, &dir), relative(&expected, &whole));
}

#[test]
fn changing_one_input_redoes_exactly_the_steps_downstream_of_it() {
    let tmp = tempfile::tempdir().unwrap();
    let text = tmp.path().join("text.txt");
    fs::copy(root().join("assets/text/sample.txt"), &text).unwrap();
    let dir = tmp.path().join("run");
    let run = |extra: &[&str]| {
        let mut args = vec!["--text", text.to_str().unwrap()];
        args.extend(extra);
        reproduce(&dir, &args)
    };
    run(&[]);
    let first = manifests(&dir);
    let again = run(&[]);
    assert!(
        redone(&first, &manifests(&dir)).is_empty(),
        "a rerun with nothing changed redid steps"
    );

    // The text feeds the score steps only, and the predictor reads the reference's score.
    fs::write(
        &text,
        "A different text, short but long enough to be scored in one window.\n",
    )
    .unwrap();
    let changed = run(&[]);
    // The merged models were deleted once scored, so scoring them again merges them again.
    let mut expected = vec![
        "merge-average",
        "merge-tsv",
        "predict",
        "score-average",
        "score-ref",
        "score-tsv",
        "score-vlm-lm",
    ];
    expected.sort();
    let after_text = manifests(&dir);
    assert_eq!(redone(&first, &after_text), expected);
    assert_ne!(
        changed["scores"][0]["perplexity"],
        again["scores"][0]["perplexity"]
    );

    // --force redoes the one step named.
    run(&["--force", "norms"]);
    assert_eq!(redone(&after_text, &manifests(&dir)), ["norms"]);
}

#[test]
fn a_changed_model_redoes_the_steps_that_read_it() {
    let tmp = tempfile::tempdir().unwrap();
    let vlm = tmp.path().join("vlm");
    fs::create_dir(&vlm).unwrap();
    for entry in fs::read_dir(root().join(VLM)).unwrap().flatten() {
        fs::copy(entry.path(), vlm.join(entry.file_name())).unwrap();
    }
    let dir = tmp.path().join("run");
    let run = || {
        sinkmerge([
            "reproduce",
            "--ref",
            REF,
            "--merges",
            "average",
            "--skip",
            "heads",
        ])
        .args([
            Path::new("--vlm"),
            &vlm,
            Path::new("-o"),
            &dir,
            Path::new("--json"),
        ])
        .json()
    };
    run();
    let first = manifests(&dir);
    // A new file in the VLM's folder changes its content hash: everything downstream of the
    // extraction is redone, and nothing that reads the reference alone.
    fs::write(vlm.join("notes.txt"), "touched\n").unwrap();
    run();
    let mut expected = vec![
        "extract",
        "inspect-vlm",
        "merge-average",
        "norms",
        "score-average",
        "score-vlm-lm",
    ];
    expected.sort();
    assert_eq!(redone(&first, &manifests(&dir)), expected);
}

#[test]
fn bad_input_is_refused_before_any_step() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let out = |d: &Path| -> Vec<PathBuf> { vec!["-o".into(), d.to_path_buf()] };
    // A VLM whose language model is not the reference's architecture.
    sinkmerge([
        "reproduce",
        "--ref",
        "assets/models/tiny-qwen2/ref",
        "--vlm",
        VLM,
    ])
    .args(out(&dir))
    .refused(&[
        "tiny-qwen2/ref",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "model_type",
    ]);
    // A reference LLM given as the VLM.
    sinkmerge(["reproduce", "--ref", REF, "--vlm", REF])
        .args(out(&dir))
        .refused(&["--vlm", "not a vision-language model"]);
    // DIR inside an input.
    let inside = root().join(REF).join("run");
    sinkmerge(["reproduce", "--ref", REF, "--vlm", VLM])
        .args(out(&inside))
        .refused(&["lies inside", "tiny-qwen3/ref"]);
    assert!(!inside.exists());
    sinkmerge(["reproduce", "--ref", REF, "--vlm", VLM, "--merges", "mean"])
        .args(out(&dir))
        .refused_with_usage(&["mean", "average"]);
    sinkmerge(["reproduce", "--ref", REF, "--vlm", VLM, "--skip", "extract"])
        .args(out(&dir))
        .refused(&["--skip extract"]);
    assert!(!dir.exists(), "a refused run wrote {}", dir.display());
}

#[test]
fn a_filesystem_too_small_for_the_plan_is_refused_with_the_space_it_needs() {
    // A 1 MiB tmpfs in a private mount namespace (unshare -rm: no privileges needed where user
    // namespaces are allowed, as on the CI machines).
    let tmp = tempfile::tempdir().unwrap();
    let mount = tmp.path().join("small");
    fs::create_dir(&mount).unwrap();
    let script = format!(
        "mount -t tmpfs -o size=1m tmpfs '{m}' && cd '{root}' && exec '{bin}' reproduce --ref {REF} --vlm {VLM} -o '{m}/run'",
        m = mount.display(),
        root = root().display(),
        bin = env!("CARGO_BIN_EXE_sinkmerge"),
    );
    let output = std::process::Command::new("unshare")
        .args(["-rm", "sh", "-c", &script])
        .output()
        .expect("unshare (util-linux) runs");
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{err}");
    assert!(
        err.contains("needs") && err.contains("MiB") && err.contains("free"),
        "{err}"
    );
}

#[test]
fn dry_run_prints_the_plan_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let plan = sinkmerge([
        "reproduce",
        "--ref",
        REF,
        "--vlm",
        VLM,
        "--dry-run",
        "--json",
    ])
    .args([Path::new("-o"), &dir])
    .json();
    let names: Vec<&str> = plan["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names[..4],
        ["inspect-ref", "inspect-vlm", "extract", "norms"]
    );
    for setting in ["mix95", "average", "task-arithmetic", "tsv", "star"] {
        assert!(
            names.contains(&format!("merge-{setting}").as_str()),
            "{setting}"
        );
        assert!(
            names.contains(&format!("score-{setting}").as_str()),
            "{setting}"
        );
    }
    assert!(!names
        .iter()
        .any(|n| n.contains("ties") || n.contains("dare")));
    assert!(plan["disk_needed_bytes"].as_u64().unwrap() > 0);
    assert!(plan["estimate_seconds"].as_f64().unwrap() > 0.0);
    assert!(!dir.exists());
}

/// The panel of the Slurm test: the bundled pair twice, the second with a base so that the
/// settings that need one run too.
fn two_pair_panel(dir: &Path) -> PathBuf {
    let csv = dir.join("pairs.csv");
    fs::write(
        &csv,
        format!(
            "name,ref,vlm,base\nplain,{REF},{VLM},\nbased,{REF},{VLM},assets/models/tiny-qwen3/vl\n"
        ),
    )
    .unwrap();
    csv
}

/// `--status --json` until no step and no report job is queued or running (or `limit`
/// passes); returns the last status.
fn wait_for_slurm(dir: &Path, limit: Duration) -> Value {
    let started = Instant::now();
    loop {
        let status = sinkmerge(["reproduce", "--json", "--status"])
            .args([dir])
            .json();
        let pairs = status["pairs"].as_array().unwrap();
        let busy = |s: &Value| s["status"] == "queued" || s["status"] == "running";
        let steps_busy = pairs
            .iter()
            .flat_map(|p| p["steps"].as_array().unwrap())
            .any(busy);
        let reports_busy =
            pairs.iter().any(|p| busy(&p["report_job"])) || busy(&status["report_job"]);
        if !steps_busy && !reports_busy {
            return status;
        }
        assert!(
            started.elapsed() < limit,
            "Slurm jobs still busy after {limit:?}: {status}"
        );
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[test]
#[ignore = "needs a live Slurm: .ci/run starts one (.ci/system-deps.sh) and runs the ignored slurm tests"]
fn slurm_runs_the_panel_as_the_local_executor_does_and_resubmits_a_cancelled_job() {
    let tmp = tempfile::tempdir().unwrap();
    let csv = two_pair_panel(tmp.path());
    let panel = |dir: &Path, executor: &str| -> Value {
        sinkmerge([
            "reproduce",
            "--merges",
            "average,ties",
            "--executor",
            executor,
            "--json",
        ])
        .args([Path::new("--panel"), &csv, Path::new("-o"), dir])
        .json()
    };
    let local = tmp.path().join("run-local");
    panel(&local, "local");

    let dir = tmp.path().join("run-slurm");
    let first = panel(&dir, "slurm");
    assert!(first["step_jobs"].as_u64().unwrap() >= 20, "{first}");
    // Cancel one merge while it waits on its extraction: it and the score after it never run.
    let record: Value = read_json(dir.join("plain/steps/merge-average/slurm.json"));
    let cancelled = record["job"].as_str().unwrap().to_string();
    let scancel = std::process::Command::new("scancel")
        .arg(&cancelled)
        .status()
        .unwrap();
    assert!(scancel.success());
    let status = wait_for_slurm(&dir, Duration::from_secs(600));
    let plain = &status["pairs"][0]["steps"];
    let state = |name: &str| {
        plain
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == name)
            .unwrap()["status"]
            .clone()
    };
    assert_eq!(state("merge-average"), "failed", "{status}");
    assert_eq!(state("extract"), "done", "{status}");
    assert!(!dir.join("report.html").exists());

    // The next run submits exactly the cancelled step, what follows it, and the reports.
    let before = manifests(&dir.join("plain"));
    let second = panel(&dir, "slurm");
    assert_eq!(second["step_jobs"], 2, "{second}");
    let record: Value = read_json(dir.join("plain/steps/merge-average/slurm.json"));
    assert_ne!(record["job"].as_str().unwrap(), cancelled);
    wait_for_slurm(&dir, Duration::from_secs(600));
    assert_eq!(
        redone(&before, &manifests(&dir.join("plain"))),
        ["merge-average", "score-average"]
    );
    for file in ["summary.json", "plain/summary.json", "based/summary.json"] {
        let slurm: Value = read_json(dir.join(file));
        let here: Value = read_json(local.join(file));
        assert_eq!(relative(&slurm, &dir), relative(&here, &local), "{file}");
    }
    // Nothing is left to do: a third run submits nothing.
    let third = panel(&dir, "slurm");
    assert_eq!(third["step_jobs"], 0, "{third}");
    assert_eq!(third["report_jobs"], serde_json::json!([]), "{third}");
}

#[test]
fn a_panel_runs_every_pair_and_fits_the_predictor_on_its_deltas() {
    let tmp = tempfile::tempdir().unwrap();
    let csv = tmp.path().join("pairs.csv");
    // The bundled pair three times (the fit needs three), with made-up deltas.
    let rows: String = [("one", "-9.5"), ("two", "-4.0"), ("three", "-7.25")]
        .iter()
        .map(|(name, delta)| format!("{name},{REF},{VLM},{delta}\n"))
        .collect();
    fs::write(&csv, format!("name,ref,vlm,delta\n{rows}")).unwrap();
    let dir = tmp.path().join("panel");
    let summary = sinkmerge(["reproduce", "--merges", "none", "--skip", "heads", "--json"])
        .args([Path::new("--panel"), &csv, Path::new("-o"), &dir])
        .json();
    let pairs = summary["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 3);
    for pair in pairs {
        let name = pair["name"].as_str().unwrap();
        let own: Value = read_json(dir.join(name).join("summary.json"));
        assert_eq!(
            pair["sink_strength"], own["scores"][0]["sink_strength"],
            "{name}"
        );
        assert_eq!(pair["margin"], own["scores"][1]["margin"], "{name}");
        assert!(pair["drift"].as_f64().unwrap() > 0.0, "{name}");
        assert!(dir.join(name).join("report.html").is_file());
    }
    // Equal S for every pair: the fit cannot be made, and the summary says why.
    assert!(
        summary["fit"]["error"].as_str().is_some(),
        "{}",
        summary["fit"]
    );
    // The template escapes `/` in text and attributes as `&#x2f;`.
    let html = fs::read_to_string(dir.join("report.html"))
        .unwrap()
        .replace("&#x2f;", "/");
    assert!(html.contains("href=\"one/report.html\"") && html.contains("<section id=\"fit\">"));
    let status = sinkmerge(["reproduce", "--json", "--status"])
        .args([&dir])
        .json();
    let states: Vec<&str> = (status["pairs"].as_array().unwrap().iter())
        .flat_map(|p| p["steps"].as_array().unwrap())
        .map(|s| s["status"].as_str().unwrap())
        .collect();
    assert!(
        states.iter().all(|s| *s == "done" || *s == "skipped"),
        "{states:?}"
    );
    assert_eq!(states.iter().filter(|s| **s == "skipped").count(), 3);
}

#[test]
fn a_bad_panel_is_refused_before_any_step() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("panel");
    let refused = |text: &str, needles: &[&str]| {
        let csv = tmp.path().join("pairs.csv");
        fs::write(&csv, text).unwrap();
        sinkmerge(["reproduce"])
            .args([Path::new("--panel"), &csv, Path::new("-o"), &dir])
            .refused(needles);
        assert!(!dir.exists());
    };
    refused("name,ref\na,x\n", &["pairs.csv", "name, ref and vlm"]);
    refused(
        &format!("name,ref,vlm\na,{REF},{VLM}\na,{REF},{VLM}\n"),
        &["pairs.csv:3", "`a` appears twice"],
    );
    refused(
        &format!("name,ref,vlm\nsummary.json,{REF},{VLM}\n"),
        &["pairs.csv:2", "summary.json", "the panel writes"],
    );
    refused(
        &format!("name,ref,vlm\n../up,{REF},{VLM}\n"),
        &["`../up`", "folder name"],
    );
    // The second pair's VLM is a plain LLM: refused before the first pair runs.
    refused(
        &format!("name,ref,vlm\ngood,{REF},{VLM}\nbad,{REF},{REF}\n"),
        &["pair bad", "not a vision-language model"],
    );
}

/// The structs `reproduce` reads its steps' reports into are the ones the commands print: each
/// report reads back and prints the same bytes, on the reports' optional parts too (`norms
/// --vs`, `inspect --check`, `predict --model`'s measured S).
#[test]
fn step_reports_read_back_into_the_structs_their_commands_print() {
    fn same_bytes<T: serde::Serialize + serde::de::DeserializeOwned>(args: &[&str]) {
        let printed = sinkmerge(args).ok();
        let value: T = serde_json::from_str(&printed)
            .unwrap_or_else(|e| panic!("sinkmerge {args:?}: not its struct: {e}"));
        let reprinted = sinkmerge::report::json_text(&value).unwrap();
        assert_eq!(reprinted, printed, "sinkmerge {args:?}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let lm = tmp.path().join("lm");
    let vl = "assets/models/tiny-qwen3/vl";
    same_bytes::<sinkmerge::report::norms::NormsJson>(&[
        "norms", REF, VLM, "--vs", REF, vl, "--json",
    ]);
    same_bytes::<sinkmerge::analysis::inspect::Inspection>(&["inspect", VLM, "--check", "--json"]);
    same_bytes::<sinkmerge::extract::Summary>(&[
        "extract",
        VLM,
        "-o",
        lm.to_str().unwrap(),
        "--json",
    ]);
    same_bytes::<sinkmerge::report::predict::PredictJson>(&["predict", "--model", REF, "--json"]);
}

/// minijinja's HTML escaping, as the report's template applies it to plain strings.
fn html_escaped(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#x27;")
        .replace('/', "&#x2f;")
}

/// `--answers` on the bundled pair with every default setting: each model (the reference, the
/// VLM-LM and each merge) answers each bundled prompt, in summary.json as its step reported it
/// and in the report's Answers table; the merged models are still deleted once answered.
#[test]
fn answers_are_in_the_summary_and_the_report_for_every_model() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let summary = sinkmerge([
        "reproduce",
        "--ref",
        REF,
        "--vlm",
        VLM,
        "--answers",
        "--json",
    ])
    .args([Path::new("-o"), &dir])
    .json();
    assert_eq!(summary, read_json::<Value>(dir.join("summary.json")));
    let answers = &summary["answers"];
    let models: Vec<&str> = (answers["models"].as_array().unwrap().iter())
        .map(|m| m["model"].as_str().unwrap())
        .collect();
    assert_eq!(
        models,
        [
            "ref",
            "vlm_lm",
            "mix95",
            "average",
            "task_arithmetic",
            "tsv",
            "star"
        ]
    );
    assert_eq!(answers["max_new_tokens"], 64);
    let prompts = answers["prompts"].as_array().unwrap();
    assert_eq!(prompts.len(), 3);
    let html = fs::read_to_string(dir.join("report.html")).unwrap();
    assert!(html.contains("<section id=\"answers\">"));
    for (i, prompt) in prompts.iter().enumerate() {
        assert!(html.contains(&html_escaped(prompt["prompt"].as_str().unwrap())));
        let row = prompt["answers"].as_array().unwrap();
        assert_eq!(row.len(), models.len());
        for (j, (answer, model)) in row.iter().zip(&models).enumerate() {
            assert_eq!(answer["model"], *model);
            let step = format!("answers-{}", model.replace('_', "-"));
            let report: Value = read_json(dir.join("steps").join(&step).join("report.json"));
            assert_eq!(answer["text"], report[i]["text"], "{step}");
            assert_eq!(answer["stop_reason"], report[i]["stop_reason"], "{step}");
            assert_eq!(report[i]["settings"]["do_sample"]["value"], false, "{step}");
            let text = answer["text"].as_str().unwrap();
            assert!(!text.is_empty(), "{step}");
            assert!(html.contains(&format!(
                "data-key=\"/answers/prompts/{i}/answers/{j}/text\"><pre>{}</pre>",
                html_escaped(text)
            )));
        }
    }
    // Only the extracted language model stays: each merge was deleted after its answers.
    let left: Vec<String> = (fs::read_dir(dir.join("models")).unwrap().flatten())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["vlm-lm"]);
    // A rerun finds every step done, the merges included though their models are gone.
    let before = manifests(&dir);
    let again = sinkmerge([
        "reproduce",
        "--ref",
        REF,
        "--vlm",
        VLM,
        "--answers",
        "--json",
    ])
    .args([Path::new("-o"), &dir])
    .json();
    assert_eq!(again, summary);
    assert_eq!(redone(&before, &manifests(&dir)), Vec::<String>::new());
}

/// Without `--answers` the plan is the one it was: no generate step, the same commands; with
/// it, only the answers steps are added.
#[test]
fn without_answers_no_generate_step_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let plan = |extra: &[&str]| -> Vec<(String, String)> {
        let plan = sinkmerge([
            "reproduce",
            "--ref",
            REF,
            "--vlm",
            VLM,
            "--dry-run",
            "--json",
        ])
        .args(extra)
        .args([Path::new("-o"), &dir])
        .json();
        (plan["steps"].as_array().unwrap().iter())
            .map(|s| {
                (
                    s["name"].as_str().unwrap().to_string(),
                    s["command"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    let plain = plan(&[]);
    assert!(!plain
        .iter()
        .any(|(n, c)| n.starts_with("answers") || c.starts_with("sinkmerge generate")));
    let answers = plan(&["--answers"]);
    let rest: Vec<(String, String)> = (answers.iter())
        .filter(|(n, _)| !n.starts_with("answers-"))
        .cloned()
        .collect();
    assert_eq!(rest, plain);
    assert_eq!(answers.len(), plain.len() + 7);
    assert!(!dir.exists());
}

/// A model whose decode does not fit in the memory available is refused before any step, with
/// exit 2 and one line naming the step, the model and the sizes.
#[test]
fn answers_that_do_not_fit_in_memory_are_refused_before_any_step() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let message = sinkmerge(["reproduce", "--ref", REF, "--vlm", VLM, "--answers"])
        .args([Path::new("-o"), &dir])
        .env("SINKMERGE_MEM_AVAILABLE", "1000")
        .refused(&[
            "--answers: step answers-ref",
            REF,
            "of weights as stored",
            "KV cache",
            "1000 B is available (SINKMERGE_MEM_AVAILABLE)",
            "run without --answers",
        ]);
    assert!(!message.is_empty());
    assert!(!dir.exists());
    // Without --answers the same memory is no reason to refuse the plan.
    sinkmerge(["reproduce", "--ref", REF, "--vlm", VLM, "--dry-run"])
        .args([Path::new("-o"), &dir])
        .env("SINKMERGE_MEM_AVAILABLE", "1000")
        .ok();
}
