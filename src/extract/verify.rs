//! Verification of a written extraction before it is committed: reopen the output as a model,
//! check its tensor set and shapes against what its own config.json implies (nothing missing,
//! nothing extra), and every tensor's bytes against its source (xxh3-128 of the output tensor vs
//! of the bytes its plan takes from the source, borrowed from the mmap for plain copies).

use rayon::prelude::*;
use xxhash_rust::xxh3::xxh3_128;

use crate::arch::config::TextConfig;
use crate::arch::families::Plan;
use crate::arch::layout;
use crate::checkpoint::output::OutputDir;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};

/// Check the output written into `out` against `plan` and `src`.
pub fn check(out: &OutputDir, src: &Checkpoint, plan: &Plan, progress: bool) -> Result<()> {
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
    let result = plan.outputs.par_iter().try_for_each(|t| -> Result<()> {
        let info = written
            .info(&t.name)
            .ok_or_else(|| fail(format!("tensor `{}` is missing", t.name)))?;
        if info.dtype != t.dtype || info.shape != t.shape {
            return Err(fail(format!(
                "tensor `{}` is {:?} {:?}, planned {:?} {:?}",
                t.name, info.dtype, info.shape, t.dtype, t.shape
            )));
        }
        let got = xxh3_128(written.bytes(&t.name)?);
        if got != xxh3_128(&t.bytes(src)?) {
            return Err(fail(format!(
                "tensor `{}` differs from its source {}",
                t.name,
                src.describe(&t.parts[0].source)
            )));
        }
        bar.inc(t.byte_len() as u64);
        Ok(())
    });
    bar.finish_and_clear();
    result
}
