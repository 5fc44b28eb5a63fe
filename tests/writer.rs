//! The sharded writer: a successful write round-trips every tensor byte for byte (and loads with
//! the reference `safetensors` parser); a write that fails part-way leaves nothing behind.

use std::borrow::Cow;

use safetensors::Dtype;
use sinkmerge::checkpoint::output::{OutputDir, OutputKind};
use sinkmerge::checkpoint::writer::{write_tensors, PlannedTensor};
use sinkmerge::checkpoint::Checkpoint;
use sinkmerge::error::Kind;

use crate::util::fixture;

fn source() -> Checkpoint {
    Checkpoint::open_dir(&fixture("qwen2-sharded"), "qwen2-sharded").unwrap()
}

fn plan(ckpt: &Checkpoint) -> Vec<PlannedTensor> {
    ckpt.names()
        .iter()
        .map(|n| {
            let info = ckpt.info(n).unwrap();
            PlannedTensor {
                name: n.clone(),
                dtype: info.dtype,
                shape: info.shape.clone(),
            }
        })
        .collect()
}

#[test]
fn round_trip_is_byte_exact_across_shards() {
    let src = source();
    let planned = plan(&src);
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("copy");
    let out = OutputDir::create(&dest, OutputKind::Model, &[&src.dir], false).unwrap();
    out.copy_file(&src.dir.join("config.json"), "config.json")
        .unwrap();
    // 40 kB shards force several files and an index.
    let written = write_tensors(
        &out,
        &planned,
        40_000,
        None,
        |_| None,
        |i| Ok(Cow::Borrowed(src.bytes(&planned[i].name)?)),
    )
    .unwrap();
    assert!(written.files.len() > 2, "{:?}", written.files);
    out.commit().unwrap();

    let copy = Checkpoint::open_dir(&dest, "copy").unwrap();
    assert_eq!(copy.names(), src.names());
    for name in src.names() {
        assert_eq!(
            copy.bytes(name).unwrap(),
            src.bytes(name).unwrap(),
            "{name}"
        );
        assert_eq!(
            copy.info(name).unwrap().shape,
            src.info(name).unwrap().shape
        );
    }
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dest.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(index["metadata"]["total_size"], src.total_bytes());
    for file in &written.files {
        let bytes = std::fs::read(dest.join(file)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .expect("reference parser accepts our shards");
        assert!(!st.is_empty());
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");
    }
}

#[test]
fn a_failure_part_way_leaves_the_destination_absent() {
    let src = source();
    let planned = plan(&src);
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("out");
    let out = OutputDir::create(&dest, OutputKind::Model, &[&src.dir], false).unwrap();
    let fail_at = planned.len() / 2;
    let result = write_tensors(
        &out,
        &planned,
        40_000,
        None,
        |_| None,
        |i| {
            if i == fail_at {
                Err(sinkmerge::Error::Write("injected failure".into()))
            } else {
                Ok(Cow::Borrowed(src.bytes(&planned[i].name)?))
            }
        },
    );
    assert!(result.unwrap_err().to_string().contains("injected"));
    drop(out);
    assert!(!dest.exists());
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        0,
        "temporary files left behind"
    );
}

#[test]
fn one_shard_is_a_single_file_without_index() {
    let src = source();
    let planned = plan(&src);
    let tmp = tempfile::tempdir().unwrap();
    let dest = tmp.path().join("single");
    let out = OutputDir::create(&dest, OutputKind::Model, &[&src.dir], false).unwrap();
    let written = write_tensors(
        &out,
        &planned,
        u64::MAX,
        None,
        |_| None,
        |i| Ok(Cow::Borrowed(src.bytes(&planned[i].name)?)),
    )
    .unwrap();
    out.commit().unwrap();
    assert_eq!(written.files, ["model.safetensors"]);
    assert!(!dest.join("model.safetensors.index.json").exists());
}

#[test]
fn nan_or_inf_in_any_float_dtype_is_refused_and_nothing_is_left() {
    // Copied bytes, in dtypes the scorer never decodes: F64 and FP8 E5M2 (0x7C is its Inf).
    let nan = f64::NAN.to_le_bytes();
    let cases = [
        (Dtype::F64, nan.as_slice(), "NaN"),
        (Dtype::F8_E5M2, &[0x7C][..], "inf"),
    ];
    for (dtype, bytes, what) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("out");
        let out = OutputDir::create(&dest, OutputKind::Model, &[], false).unwrap();
        let planned = [PlannedTensor {
            name: "scale".into(),
            dtype,
            shape: vec![1],
        }];
        let err = write_tensors(
            &out,
            &planned,
            u64::MAX,
            None,
            |_| Some("in/model.safetensors: tensor `s`".into()),
            |_| Ok(Cow::Borrowed(bytes)),
        )
        .unwrap_err();
        assert_eq!(err.kind(), Kind::NonFinite, "{dtype:?}");
        let msg = err.to_string();
        for needle in ["in/model.safetensors: tensor `s`", "`scale`", what] {
            assert!(msg.contains(needle), "{needle} not in: {msg}");
        }
        drop(out);
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }
}
