//! Verification of a written extraction before it is committed: reopen the output as a model,
//! check its tensor set and shapes against what its own config.json implies (nothing missing,
//! nothing extra), and every tensor's bytes against its source: the xxh3-128 of the bytes read back
//! from the output must equal the one computed while they were taken from the source.

use rayon::prelude::*;
use xxhash_rust::xxh3::xxh3_128;

use crate::arch::config::TextConfig;
use crate::arch::families::ExtractPlan;
use crate::arch::layout;
use crate::checkpoint::output::OutputDir;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// Check the output written into `out` against `plan`; `source_hashes[i]` is the xxh3-128 of the
/// source bytes of `plan.outputs[i]`.
pub fn check(
    out: &OutputDir,
    plan: &ExtractPlan,
    source_hashes: &[u128],
    progress: bool,
) -> Result<()> {
    let fail = |what: String| {
        Error::Write(format!(
            "verification of {} failed: {what}; nothing was written",
            out.dest().display()
        ))
    };
    let written = Checkpoint::open_dir(out.path(), &out.dest().display().to_string())
        .map_err(|e| fail(format!("the output does not reopen: {e}")))?;
    let text = TextConfig::from_model_config(&written.config)
        .map_err(|e| fail(format!("its config.json does not parse: {e}")))?;
    let expected = layout::expected_tensors(&text).map_err(|e| fail(e.to_string()))?;
    for (name, shape) in &expected {
        match written.info(name) {
            None => return Err(fail(format!("tensor `{name}` is missing"))),
            Some(info) if &info.shape != shape => {
                return Err(fail(format!(
                    "tensor `{name}` has shape {:?}, its config implies {shape:?}",
                    info.shape
                )))
            }
            Some(_) => {}
        }
    }
    if written.names().len() != expected.len() {
        let extra = written
            .names()
            .iter()
            .find(|n| !expected.iter().any(|(e, _)| e == *n))
            .cloned()
            .unwrap_or_default();
        return Err(fail(format!("tensor `{extra}` is not part of the model")));
    }
    let total: u64 = plan.outputs.iter().map(|t| t.byte_len() as u64).sum();
    let bar = crate::progress::bytes(total, "verifying", progress);
    if source_hashes.len() != plan.outputs.len() {
        return Err(fail("internal: source hashes were not recorded".into()));
    }
    let result =
        plan.outputs
            .par_iter()
            .zip(source_hashes)
            .try_for_each(|(t, &source)| -> Result<()> {
                let info = written
                    .info(&t.name)
                    .ok_or_else(|| fail(format!("tensor `{}` is missing", t.name)))?;
                if info.dtype != t.dtype || info.shape != t.shape {
                    return Err(fail(format!(
                        "tensor `{}` is {:?} {:?}, planned {:?} {:?}",
                        t.name, info.dtype, info.shape, t.dtype, t.shape
                    )));
                }
                if xxh3_128(written.bytes(&t.name)?) != source {
                    return Err(fail(format!(
                        "tensor `{}` differs from its source `{}`",
                        t.name, t.parts[0].source
                    )));
                }
                bar.inc(t.byte_len() as u64);
                Ok(())
            });
    bar.finish_and_clear();
    result
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::arch::families;
    use crate::extract::{write, Options};

    fn written(dir: &Path, fixture: &str, family: &str) -> (OutputDir, Vec<u128>, ExtractPlan) {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(fixture);
        let ckpt = Checkpoint::open_dir(&src, fixture).unwrap();
        let plan = families::by_name(family).unwrap().plan(&ckpt).unwrap();
        let out = OutputDir::create(
            &dir.join("out"),
            crate::checkpoint::output::OutputKind::Model,
            &[&ckpt.dir],
            false,
        )
        .unwrap();
        let opts = Options {
            max_shard_size: 5_000_000_000,
            force: false,
            verify: true,
            progress: false,
            model_card: false,
        };
        let (_, _, hashes) = write(&out, &ckpt, &plan, &opts).unwrap();
        (out, hashes, plan)
    }

    #[test]
    fn a_changed_byte_fails_verification() {
        let tmp = tempfile::tempdir().unwrap();
        let (out, hashes, plan) = written(
            tmp.path(),
            "tests/fixtures/families/qwen3_vl_moe-hub",
            "qwen3-vl-moe",
        );
        check(&out, &plan, &hashes, false).unwrap();
        // Flip one bit in the last tensor's data (the end of the data area).
        let path = out.path().join("model.safetensors");
        let mut bytes = std::fs::read(&path).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(&path, bytes).unwrap();
        let err = check(&out, &plan, &hashes, false).unwrap_err();
        assert!(matches!(err, Error::Write(_)), "{err}");
        assert!(err.to_string().contains("differs from its source"), "{err}");
    }

    #[test]
    fn a_config_that_no_longer_matches_the_tensors_fails_verification() {
        let tmp = tempfile::tempdir().unwrap();
        let (out, hashes, mut plan) =
            written(tmp.path(), "tests/fixtures/families/qwen2_vl", "qwen2-vl");
        plan.config["num_hidden_layers"] = serde_json::json!(3);
        out.write_json("config.json", &plan.config).unwrap();
        let err = check(&out, &plan, &hashes, false).unwrap_err();
        assert!(err.to_string().contains("model.layers.2."), "{err}");
    }
}
