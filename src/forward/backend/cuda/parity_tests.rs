//! Parity of the CUDA backend with the CPU backend, for any device layer: the host stand-in in
//! every test run, a real GPU in the `--ignored` tests of `driver.rs`.

use std::path::{Path, PathBuf};

use safetensors::Dtype;

use super::{CudaBackend, Device, DeviceTensor, StoredWeight, STORED_GEMV_MAX_ROWS};
use crate::checkpoint::Checkpoint;
use crate::forward::backend::cpu::{self, CpuBackend, CpuStored};
use crate::forward::backend::{Backend, CachedShape, HeadView};
use crate::sink::parity::{self, Tolerances};
use crate::sink::prompts::default_prompts;
use crate::sink::tokenize::TextEncoder;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every architecture fixture of the transformers parity tests (tests/score_parity.rs):
/// (golden case, model directory).
pub fn fixtures() -> Vec<(&'static str, PathBuf)> {
    let shared = |n: &str| root().join("tests/fixtures/models").join(n);
    let extra = |n: &str| root().join("tests/fixtures/score/models").join(n);
    vec![
        ("qwen2", shared("qwen2")),
        ("qwen2-sharded", shared("qwen2-sharded")),
        ("qwen3", shared("qwen3")),
        ("llama31-tied", shared("llama31-tied")),
        ("mistral", shared("mistral")),
        ("olmo3", shared("olmo3")),
        ("qwen3_vl", shared("qwen3_vl")),
        ("olmo2", extra("olmo2")),
        ("qwen3_moe", extra("qwen3_moe")),
        ("olmoe", extra("olmoe")),
        ("qwen2_sliding", extra("qwen2_sliding")),
        ("qwen2_yarn", extra("qwen2_yarn")),
        ("llama_linear", extra("llama_linear")),
        ("llama_dynamic", extra("llama_dynamic")),
        ("qwen3_bias", extra("qwen3_bias")),
        ("olmo3_sw", extra("olmo3_sw")),
        ("llama31_rope", extra("llama31_rope")),
        ("mistral_hd", extra("mistral_hd")),
    ]
}

/// The golden's token ids, and the same ids reversed: two packed prompts.
pub fn golden_prompts(case: &str) -> Vec<Vec<u32>> {
    let path = root().join(format!("tests/fixtures/score/goldens/{case}.safetensors"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids: Vec<u32> = st
        .tensor("input_ids")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect();
    let reversed = ids.iter().rev().copied().collect();
    vec![ids, reversed]
}

pub fn open(dir: &Path) -> Checkpoint {
    Checkpoint::open_dir(dir, &dir.display().to_string()).unwrap()
}

/// Probabilities, logits and S of every architecture fixture within the parity tolerances of
/// the backend's precision.
pub fn every_fixture_matches<D: Device>(gpu: &CudaBackend<D>) {
    let tol = Tolerances::of(gpu.precision());
    for (case, dir) in fixtures() {
        let ckpt = open(&dir);
        let prompts = golden_prompts(case);
        let p = parity::check(gpu, &[&ckpt], &[prompts], false).unwrap();
        let t = &p.traces[0];
        eprintln!(
            "{} {case:16} max |dP| {:.1e}  max |dlogit| {:.1e}  |dS| {:.1e}",
            gpu.precision(),
            t.max_prob_diff,
            t.max_logit_diff,
            p.metrics[0].diff()
        );
        assert!(t.max_prob_diff <= tol.probs, "{case}: probabilities {t:?}");
        assert!(t.max_logit_diff <= tol.logits, "{case}: logits {t:?}");
        for m in &p.metrics {
            assert!(m.diff() <= tol.metrics, "{case}: {m:?}");
        }
    }
}

/// S, G_base, B_gap and the margin of the bundled pairs on the 15 default prompts.
pub fn bundled_pairs_match<D: Device>(gpu: &CudaBackend<D>) {
    for family in ["tiny-qwen3", "tiny-qwen2"] {
        let dirs = [
            root().join(format!("assets/models/{family}/ref")),
            root().join(format!("assets/models/{family}/vl")),
        ];
        let ckpts: Vec<Checkpoint> = dirs.iter().map(|d| open(d)).collect();
        let encoder = TextEncoder::load(&dirs[0], false).unwrap();
        let ids: Vec<Vec<u32>> = default_prompts()
            .iter()
            .map(|p| encoder.encode(p).unwrap())
            .collect();
        let refs: Vec<&Checkpoint> = ckpts.iter().collect();
        let p = parity::check(gpu, &refs, &[ids.clone(), ids], true).unwrap();
        for t in &p.traces {
            eprintln!(
                "{:28} max |dP| {:.1e}  max |dlogit| {:.1e}",
                t.model, t.max_prob_diff, t.max_logit_diff
            );
        }
        for m in &p.metrics {
            eprintln!(
                "{} {:40} cpu {:?} other {:?}",
                gpu.precision(),
                m.metric,
                m.cpu,
                m.other
            );
        }
        assert_eq!(
            p.metrics.len(),
            2 + 3,
            "S of both, G_base/B_gap/margin of the pair"
        );
        assert!(p.holds(), "{family}: {p:?}");
    }
}

/// Greedy decoding through `gpu` (its weights held with [`Backend::store`] as stored, the KV
/// cache and its attention on the device) gives transformers' tokens on `generate`'s goldens
/// (tests/fixtures/generate/): a sliding window, an MoE, M-RoPE after images, InternVL.
pub fn decodes_as_transformers<D: Device>(gpu: &CudaBackend<D>) {
    use crate::commands::image_prompt::{read_pixel_file, Prompter};
    use crate::forward::backend::HeadView;
    use crate::forward::capture::{self, Prompt};
    use crate::forward::resident::Resident;
    use crate::forward::weights::Model;
    use crate::generate::sequence::{Logits, Sequence};

    for case in [
        "tiny_qwen2_ref",
        "fixture_mistral",
        "score_qwen3_moe",
        "qwen3_vl_two",
        "internvl_one",
    ] {
        let dir = root().join("tests/fixtures/generate");
        let golden: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(format!("{case}.json"))).unwrap())
                .unwrap();
        let ids: Vec<u32> = serde_json::from_value(golden["prompt_ids"].clone()).unwrap();
        let expected: Vec<u32> = serde_json::from_value(golden["generated_ids"].clone()).unwrap();
        let ckpt = open(&root().join(golden["model"].as_str().unwrap()));
        let model = Model::new(&ckpt).unwrap();
        let weights = Resident::load(gpu, &model).unwrap();
        let pixels = golden["pixel_values"]
            .as_str()
            .map(|p| read_pixel_file(&root().join(p)).unwrap());
        let prompter = pixels
            .as_ref()
            .map(|_| Prompter::new(&ckpt, &model, false).unwrap());
        let prompt = match &prompter {
            Some(p) => p.prompt(ids.clone(), pixels.as_ref()).unwrap(),
            None => Prompt {
                ids: ids.clone(),
                images: None,
                mrope_merge: None,
            },
        };
        let encoded = capture::encode(gpu, &model, &prompt).unwrap();
        let capacity = ids.len() + expected.len();
        let mut seq = Sequence::new(&model, gpu, &weights, capacity, None).unwrap();
        let nothing = |_: usize, _: &HeadView| ();
        let mut logits = seq
            .prefill(&prompt, encoded.as_ref(), &nothing, &mut (), Logits::Last)
            .unwrap();
        for (i, &want) in expected.iter().enumerate() {
            let token = crate::generate::sampling::argmax(&logits);
            assert_eq!(token, want, "{case}: step {i}");
            logits = seq.step(token).unwrap();
        }
        eprintln!("{case}: {} tokens as transformers'", expected.len());
    }
}

/// Values spread over the activations' interesting range, deterministic.
pub fn spread(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2001) as f32 / 125.0 - 8.0
        })
        .collect()
}

/// The largest difference of `a` and `b`, relative to `a`'s largest magnitude.
pub fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// γ_k = k u / (1 - k u) with u = 2^-24: the bound on the relative error of a k-term f32 dot
/// product in any summation order (Higham, Accuracy and Stability of Numerical Algorithms,
/// 2nd ed., section 3.1), products exact.
pub fn gamma(k: usize) -> f64 {
    let ku = k as f64 * f64::powi(2.0, -24);
    ku / (1.0 - ku)
}

/// `values` as a checkpoint stores them in `dtype` (little-endian), rounded to it.
fn stored_bytes(values: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::BF16 => (values.iter())
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        Dtype::F16 => (values.iter())
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// [`Backend::linear_stored`] on weights held as bf16, f16 and f32 bytes, with 1 and 3 rows (the
/// GEMV kernel) and 17 (past [`STORED_GEMV_MAX_ROWS`]: the GEMM), on widths that are no multiple
/// of the kernel's 32 lanes, in `gpu`'s precision. Against the exact dot products (f64) of the
/// operands that precision multiplies (in bf16, `x` and `w` rounded to bf16), within γ_in of
/// Σ|x·w|, which bounds any summation order; against the CPU backend's `linear_stored` on the
/// same held bytes, within twice that; and past the GEMV's rows, bit for bit [`Backend::linear`]
/// on the weight as [`Backend::load`] gives it. Each case's largest errors, relative to Σ|x·w|,
/// go to stderr.
pub fn stored_linear_matches<D: Device>(gpu: &CudaBackend<D>) {
    let precision = gpu.precision();
    let round = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| precision.round(x)).collect() };
    let cpu = CpuBackend::new(precision);
    let host = |t| gpu.to_host(&t).unwrap().into_owned();
    for dtype in [Dtype::BF16, Dtype::F16, Dtype::F32] {
        for (out, inp) in [(37, 101), (5, 300), (3, 7)] {
            let bytes = stored_bytes(&spread(out * inp, 31), dtype);
            let stored = crate::dtype::decode(dtype, &bytes, "test weight").unwrap();
            // The weight as each precision multiplies it (`load` rounds f32 and f16 in bf16).
            let w = round(stored);
            let held = StoredWeight {
                buf: gpu.device().upload(&bytes).unwrap(),
                dtype,
                shape: vec![out, inp],
            };
            // As `CpuBackend::store` holds it.
            let cpu_held = if precision.is_f32() || dtype == Dtype::BF16 {
                CpuStored::Mapped {
                    dtype,
                    bytes: &bytes,
                }
            } else {
                CpuStored::Decoded(w.clone())
            };
            for rows in [1, 3, STORED_GEMV_MAX_ROWS + 1] {
                // Activations are bf16 values in bf16 mode (the recipe rounds them).
                let x = round(spread(rows * inp, 32).iter().map(|v| v / 3.0).collect());
                let got = gpu
                    .linear_stored(&gpu.upload(x.clone()).unwrap(), rows, &held, out, inp)
                    .unwrap();
                let got = host(got);
                let want = cpu.linear_stored(&x, rows, &cpu_held, out, inp).unwrap();
                let (mut err, mut err_cpu) = (0f64, 0f64);
                for r in 0..rows {
                    for o in 0..out {
                        let (xr, wo) = (&x[r * inp..(r + 1) * inp], &w[o * inp..(o + 1) * inp]);
                        let products = xr.iter().zip(wo).map(|(&a, &b)| a as f64 * b as f64);
                        let exact: f64 = products.clone().sum();
                        let mag: f64 = products.map(f64::abs).sum();
                        let (v, c) = (got[r * out + o] as f64, want[r * out + o] as f64);
                        let what =
                            format!("{precision} {dtype:?} {rows}x{inp} -> {out}: [{r}, {o}]");
                        assert!((v - exact).abs() <= gamma(inp) * mag, "{what}: {v} {exact}");
                        assert!((v - c).abs() <= 2.0 * gamma(inp) * mag, "{what}: {v} {c}");
                        err = err.max((v - exact).abs() / mag);
                        err_cpu = err_cpu.max((v - c).abs() / mag);
                    }
                }
                eprintln!(
                    "{precision} {dtype:?} {rows:2} rows, [{out}, {inp}]: |y - exact| / Σ|x·w| \
                     {err:.1e}, |y - cpu| / Σ|x·w| {err_cpu:.1e} (γ_in {:.1e})",
                    gamma(inp)
                );
                if rows > STORED_GEMV_MAX_ROWS {
                    let upload = gpu.device().upload(&bytes).unwrap();
                    let loaded = gpu.widen(dtype, upload, out * inp).unwrap();
                    let x = gpu.upload(x).unwrap();
                    let linear = gpu.linear(&x, rows, &loaded, out, inp).unwrap();
                    assert_eq!(got, host(linear), "{precision} {dtype:?}: the GEMM's bits");
                }
            }
        }
    }
}

/// [`Backend::cache_write`] and [`Backend::attention_cached`] on the device against the CPU
/// backend's, in `gpu`'s precision: grouped-query attention (4 heads over 2 KV heads), without a
/// window and with one of 4 keys; a prompt of 6 rows written at 0, then 3 rows fed, then one (a
/// decode step). The caches equal bit for bit; the scores and probabilities each head's visitor
/// sees and the context, within `tolerance` of the largest magnitude ([`max_rel`]); the largest
/// difference goes to stderr.
pub fn cached_attention_matches<D: Device>(gpu: &CudaBackend<D>, tolerance: f32) {
    let precision = gpu.precision();
    let cpu = CpuBackend::new(precision);
    let host = |t: &DeviceTensor<D::Buffer>| gpu.to_host(t).unwrap().into_owned();
    let (nh, nkv, hd, capacity, total) = (4, 2, 8, 12, 10);
    let round = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| precision.round(x)).collect() };
    let q = round(
        spread(total * nh * hd, 41)
            .iter()
            .map(|v| v / 4.0)
            .collect(),
    );
    let k = round(
        spread(total * nkv * hd, 42)
            .iter()
            .map(|v| v / 4.0)
            .collect(),
    );
    let v = round(spread(total * nkv * hd, 43));
    let mut worst = 0f32;
    for window in [None, Some(4)] {
        let (mut kc, mut vc) = (
            vec![0f32; nkv * capacity * hd],
            vec![0f32; nkv * capacity * hd],
        );
        let (mut gk, mut gv) = (
            gpu.zeros(capacity, nkv * hd).unwrap(),
            gpu.zeros(capacity, nkv * hd).unwrap(),
        );
        for (offset, queries) in [(0, 6), (6, 3), (9, 1)] {
            let shape = CachedShape {
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                capacity,
                queries,
                offset,
                window,
                scale: (hd as f32).powf(-0.5),
            };
            let rows =
                |m: &[f32], width: usize| m[offset * width..(offset + queries) * width].to_vec();
            let (k_new, v_new) = (rows(&k, nkv * hd), rows(&v, nkv * hd));
            cpu::cache_write(&mut kc, &k_new, &shape, offset);
            cpu::cache_write(&mut vc, &v_new, &shape, offset);
            gpu.cache_write(&mut gk, &gpu.upload(k_new).unwrap(), &shape, offset)
                .unwrap();
            gpu.cache_write(&mut gv, &gpu.upload(v_new).unwrap(), &shape, offset)
                .unwrap();
            assert_eq!(host(&gk), kc, "keys' cache");
            assert_eq!(host(&gv), vc, "values' cache");
            let seen = |h: &HeadView| {
                assert_eq!(
                    (h.prompt, h.len, h.keys, h.offset),
                    (0, queries, offset + queries, offset)
                );
                assert!(h.causal && h.window == window);
                (h.head, h.scores.to_vec(), h.probs.to_vec())
            };
            let q_new = rows(&q, nh * hd);
            let want = cpu
                .attention_cached(&q_new, &kc, &vc, &shape, &seen)
                .unwrap();
            let got = gpu
                .attention_cached(&gpu.upload(q_new).unwrap(), &gk, &gv, &shape, &seen)
                .unwrap();
            assert_eq!(want.heads.len(), nh);
            for ((hw, sw, pw), (hg, sg, pg)) in want.heads.iter().zip(&got.heads) {
                assert_eq!(hw, hg, "heads in order");
                worst = worst.max(max_rel(sw, sg)).max(max_rel(pw, pg));
                // Masked keys are exactly 0 on both.
                for (a, b) in pw.iter().zip(pg) {
                    assert_eq!(*a == 0.0, *b == 0.0, "{window:?} {offset}: the mask");
                }
            }
            let ctx = got.context.unwrap();
            worst = worst.max(max_rel(&want.context.unwrap(), &host(&ctx)));
            assert!(
                worst <= tolerance,
                "{precision} {window:?} at {offset}: {worst:e}"
            );
        }
    }
    eprintln!("{precision} cached attention: largest relative difference {worst:.1e}");
}
