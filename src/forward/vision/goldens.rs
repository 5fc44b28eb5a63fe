//! The VLM goldens of `tests/fixtures/vlm/` (`tools/gen_vlm_goldens.py`) as the towers' tests
//! read them: the cases of `cases.json` and their tensors.

use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One case of `cases.json`.
pub struct Case {
    pub name: String,
    pub model: PathBuf,
    pub golden: Golden,
}

/// The cases whose model directory is named one of `models`.
pub fn cases(models: &[&str]) -> Vec<Case> {
    let json: serde_json::Value =
        crate::checkpoint::read_json(&root().join("tests/fixtures/vlm/cases.json")).unwrap();
    let found: Vec<Case> = json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| {
            let model = Path::new(c["model"].as_str().unwrap());
            models.iter().any(|m| model.file_name().unwrap() == *m)
        })
        .map(|c| Case {
            name: c["name"].as_str().unwrap().into(),
            model: root().join(c["model"].as_str().unwrap()),
            golden: Golden::open(&root().join(c["golden"].as_str().unwrap())),
        })
        .collect();
    assert!(!found.is_empty(), "no case of {models:?}");
    found
}

/// A golden file's bytes.
pub struct Golden(Vec<u8>);

impl Golden {
    pub fn open(path: &Path) -> Golden {
        Golden(std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
    }

    fn tensor(&self, name: &str, dtype: Dtype) -> Vec<u8> {
        let st = SafeTensors::deserialize(&self.0).unwrap();
        let t = st
            .tensor(name)
            .unwrap_or_else(|_| panic!("golden has no `{name}`"));
        assert_eq!(t.dtype(), dtype, "{name}");
        t.data().to_vec()
    }

    pub fn f32(&self, name: &str) -> Vec<f32> {
        self.tensor(name, Dtype::F32)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    pub fn i64(&self, name: &str) -> Vec<i64> {
        self.tensor(name, Dtype::I64)
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    pub fn has(&self, name: &str) -> bool {
        SafeTensors::deserialize(&self.0)
            .unwrap()
            .names()
            .contains(&name)
    }

    /// `image_grid_thw`, one (t, h, w) per image.
    pub fn grids(&self) -> Vec<[usize; 3]> {
        self.i64("image_grid_thw")
            .chunks_exact(3)
            .map(|g| [g[0] as usize, g[1] as usize, g[2] as usize])
            .collect()
    }

    /// The lengths of the runs of `token` in `input_ids`: each image's token count.
    pub fn image_token_runs(&self, token: i64) -> Vec<usize> {
        let ids = self.i64("input_ids");
        let mut runs = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            if id == token {
                if i == 0 || ids[i - 1] != token {
                    runs.push(0);
                }
                *runs.last_mut().unwrap() += 1;
            }
        }
        runs
    }
}

/// max |got − want| / max |want|.
pub fn relative(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths");
    let scale = want.iter().fold(0f64, |m, &v| m.max(v.abs() as f64));
    let diff = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs()));
    diff / scale.max(f64::MIN_POSITIVE)
}
