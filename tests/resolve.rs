//! Model references: directories, Hugging Face cache repo ids (with revisions and the cache
//! environment variables) and the paper's aliases, through the real binary.

use std::path::Path;

use crate::util::{fake_hub_cache, fixture, sinkmerge};

fn inspect(reference: &str, env: &[(&str, &Path)]) -> (Option<i32>, String, String) {
    inspect_with(&[], reference, env)
}

/// `inspect --json REFERENCE FLAGS` with `env` set.
fn inspect_with(
    flags: &[&str],
    reference: &str,
    env: &[(&str, &Path)],
) -> (Option<i32>, String, String) {
    let mut run = sinkmerge(["inspect", "--json", reference])
        .args(flags)
        .envs(env.iter().copied());
    // HF_HOME/hub is the cache only while HF_HUB_CACHE is unset.
    if env.iter().any(|(k, _)| *k == "HF_HOME") {
        run = run.env_remove("HF_HUB_CACHE");
    }
    let out = run.output();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn repo_ids_resolve_through_hf_hub_cache_and_revisions() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = tmp.path().join("hub");
    fake_hub_cache(
        &hub,
        "Qwen/Qwen3-8B",
        "aaaa1111",
        &["main"],
        &fixture("qwen3"),
    );
    fake_hub_cache(
        &hub,
        "Qwen/Qwen3-8B",
        "bbbb2222",
        &["v2"],
        &fixture("qwen2"),
    );

    let (code, out, err) = inspect("Qwen/Qwen3-8B", &[("HF_HUB_CACHE", &hub)]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("\"model_type\": \"qwen3\"") && out.contains("aaaa1111"));

    // A branch name and a commit hash both select a snapshot.
    for rev in ["v2", "bbbb2222"] {
        let (code, out, err) = inspect(&format!("Qwen/Qwen3-8B@{rev}"), &[("HF_HUB_CACHE", &hub)]);
        assert_eq!(code, Some(0), "{err}");
        assert!(out.contains("\"model_type\": \"qwen2\""), "{rev}");
    }

    // HF_HOME/hub is the fallback when HF_HUB_CACHE is unset.
    let (code, _, err) = inspect("Qwen/Qwen3-8B", &[("HF_HOME", tmp.path())]);
    assert_eq!(code, Some(0), "{err}");
}

#[test]
fn aliases_resolve_to_the_paper_pairs() {
    let tmp = tempfile::tempdir().unwrap();
    fake_hub_cache(
        tmp.path(),
        "Qwen/Qwen2.5-VL-7B-Instruct",
        "c0ffee",
        &["main"],
        &fixture("qwen2_5_vl"),
    );
    fake_hub_cache(
        tmp.path(),
        "Qwen/Qwen2.5-7B-Instruct",
        "beef",
        &["main"],
        &fixture("qwen2"),
    );
    let (code, out, err) = inspect("qwen2.5-vl", &[("HF_HUB_CACHE", tmp.path())]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("\"family\": \"qwen2.5-vl\""));
    let (code, out, err) = inspect("qwen2.5-vl:ref", &[("HF_HUB_CACHE", tmp.path())]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("\"family\": null") && out.contains("\"model_type\": \"qwen2\""));
}

#[test]
fn models_missing_from_the_cache_name_the_download_command() {
    // --no-download keeps the cache-only behaviour (tests/hub.rs covers downloading).
    let inspect = |r: &str, env: &[(&str, &Path)]| inspect_with(&["--no-download"], r, env);
    let tmp = tempfile::tempdir().unwrap();
    let (code, out, err) = inspect("qwen3-vl", &[("HF_HUB_CACHE", tmp.path())]);
    assert_eq!(code, Some(2));
    assert!(out.is_empty());
    assert!(
        err.contains("hf download Qwen/Qwen3-VL-8B-Instruct"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");

    fake_hub_cache(
        tmp.path(),
        "Qwen/Qwen3-8B",
        "aaaa",
        &["main"],
        &fixture("qwen3"),
    );
    let (code, _, err) = inspect("Qwen/Qwen3-8B@nope", &[("HF_HUB_CACHE", tmp.path())]);
    assert_eq!(code, Some(2));
    assert!(err.contains("--revision nope"), "{err}");

    let (code, _, err) = inspect("not-a-model", &[("HF_HUB_CACHE", tmp.path())]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains("qwen2.5-vl"),
        "the error should list the aliases: {err}"
    );
}

#[test]
fn a_ref_that_is_no_commit_is_refused_not_followed() {
    // A ref naming a folder out of the snapshots, where a model lies.
    let tmp = tempfile::tempdir().unwrap();
    let hub = tmp.path().join("hub");
    fake_hub_cache(
        &hub,
        "Qwen/Qwen3-8B",
        "aaaa1111",
        &["main"],
        &fixture("qwen3"),
    );
    std::fs::write(
        hub.join("models--Qwen--Qwen3-8B/refs/main"),
        "../../../elsewhere\n",
    )
    .unwrap();
    std::fs::create_dir_all(tmp.path().join("elsewhere")).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(
            fixture("qwen3").join(f),
            tmp.path().join("elsewhere").join(f),
        )
        .unwrap();
    }
    let (code, out, err) = inspect_with(
        &["--no-download"],
        "Qwen/Qwen3-8B",
        &[("HF_HUB_CACHE", &hub)],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(out.is_empty());
    assert!(
        err.contains("refs/main") && err.contains("not a commit hash"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
