//! A host stand-in for the device layer (tests only): `kernels.cu` compiled by the system C++
//! compiler through `host_shim.h` (build.rs), launched with cuLaunchKernel's calling convention,
//! and a column-major GEMM that follows cuBLAS's transpose and leading-dimension rules and
//! checks each operand fits its buffer. With it the whole CUDA backend runs, and is checked
//! against the CPU backend, on machines without a GPU.

use std::ffi::c_void;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::device::{Arg, Device, Gemm, Kernel, Op, BLOCK};
use crate::error::{Error, Result};

type HostEntry = unsafe extern "C" fn(grid: u32, block: u32, params: *mut *mut c_void);

macro_rules! host_entries {
    ($($kernel:ident => $symbol:ident),* $(,)?) => {
        extern "C" {
            $(fn $symbol(grid: u32, block: u32, params: *mut *mut c_void);)*
        }
        fn entry(kernel: Kernel) -> HostEntry {
            match kernel {
                $(Kernel::$kernel => $symbol,)*
            }
        }
    };
}

host_entries! {
    RoundBf16 => sinkmerge_host_round_values_bf16,
    WidenBf16 => sinkmerge_host_widen_bf16,
    WidenF16 => sinkmerge_host_widen_f16,
    RmsNormRows => sinkmerge_host_rms_norm_rows,
    AddBias => sinkmerge_host_add_bias,
    ClampValues => sinkmerge_host_clamp_values,
    Rope => sinkmerge_host_rope,
    Attention => sinkmerge_host_attention,
    LayerNormRows => sinkmerge_host_layer_norm_rows,
    Activate => sinkmerge_host_activate,
    ScaleColumns => sinkmerge_host_scale_columns,
    SiluMul => sinkmerge_host_silu_mul,
    AddAssign => sinkmerge_host_add_assign,
    FlagNonFinite => sinkmerge_host_flag_non_finite,
    GatherRows => sinkmerge_host_gather_rows,
    ScatterAddRows => sinkmerge_host_scatter_add_rows,
}

/// Host memory standing in for a device allocation, 8-byte aligned like cudaMalloc's (and the
/// `long long` parameters need).
pub struct HostBuffer {
    words: Vec<u64>,
    bytes: usize,
}

impl HostBuffer {
    fn new(bytes: usize) -> HostBuffer {
        HostBuffer {
            words: vec![0; bytes.div_ceil(8)],
            bytes,
        }
    }

    fn as_bytes(&self) -> &[u8] {
        // SAFETY: u64 storage viewed as bytes; `bytes` never exceeds it.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.bytes) }
    }

    fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.bytes) }
    }

    fn f32s(&self) -> &[f32] {
        // SAFETY: 8-byte aligned storage; whole f32 values only.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.bytes / 4) }
    }

    fn f32s_mut(&mut self) -> &mut [f32] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.bytes / 4) }
    }
}

/// The stand-in device. `gemm_calls` counts GEMMs (tests check the backend uses them).
#[derive(Default)]
pub struct HostDevice {
    pub gemm_calls: AtomicUsize,
}

/// `C = op(A) · op(B)`, column-major, f32 accumulation, after cuBLAS's argument checks.
pub fn reference_gemm(g: &Gemm, a: &[f32], b: &[f32], c: &mut [f32]) -> Result<()> {
    g.validate(a.len(), b.len(), c.len())?;
    let at = |i: usize, l: usize| match g.transa {
        Op::None => a[i + l * g.lda],
        Op::Transpose => a[l + i * g.lda],
    };
    let bt = |l: usize, j: usize| match g.transb {
        Op::None => b[l + j * g.ldb],
        Op::Transpose => b[j + l * g.ldb],
    };
    for j in 0..g.n {
        for i in 0..g.m {
            let mut acc = 0f32;
            for l in 0..g.k {
                acc += at(i, l) * bt(l, j);
            }
            c[i + j * g.ldc] = acc;
        }
    }
    Ok(())
}

impl Device for HostDevice {
    type Buffer = HostBuffer;

    fn describe(&self) -> String {
        "host stand-in for a CUDA device".into()
    }

    fn zeros(&self, bytes: usize) -> Result<HostBuffer> {
        Ok(HostBuffer::new(bytes))
    }

    fn upload(&self, host: &[u8]) -> Result<HostBuffer> {
        let mut buf = HostBuffer::new(host.len());
        buf.as_bytes_mut().copy_from_slice(host);
        Ok(buf)
    }

    fn download(&self, buf: &HostBuffer, range: Range<usize>) -> Result<Vec<u8>> {
        buf.as_bytes()
            .get(range.clone())
            .map(<[u8]>::to_vec)
            .ok_or_else(|| Error::Internal(format!("download {range:?} of {} bytes", buf.bytes)))
    }

    fn copy(
        &self,
        src: &HostBuffer,
        src_at: usize,
        dst: &mut HostBuffer,
        dst_at: usize,
        bytes: usize,
    ) -> Result<()> {
        if src_at + bytes > src.bytes || dst_at + bytes > dst.bytes {
            return Err(Error::Internal(format!(
                "copy of {bytes} bytes from {src_at} of {} into {dst_at} of {}",
                src.bytes, dst.bytes
            )));
        }
        dst.as_bytes_mut()[dst_at..dst_at + bytes]
            .copy_from_slice(&src.as_bytes()[src_at..src_at + bytes]);
        Ok(())
    }

    fn launch(
        &self,
        kernel: Kernel,
        threads: usize,
        args: &mut [Arg<'_, HostBuffer>],
    ) -> Result<()> {
        // Each parameter's value in an 8-byte slot, and a pointer to each slot: cuLaunchKernel's
        // `kernelParams`.
        let mut slots: Vec<[u8; 8]> = args
            .iter_mut()
            .map(|arg| {
                let mut slot = [0u8; 8];
                match arg {
                    Arg::Ref(b) => slot = (b.words.as_ptr() as usize).to_le_bytes(),
                    Arg::Mut(b) => slot = (b.words.as_mut_ptr() as usize).to_le_bytes(),
                    Arg::I32(v) => slot[..4].copy_from_slice(&v.to_le_bytes()),
                    Arg::I64(v) => slot = v.to_le_bytes(),
                    Arg::F32(v) => slot[..4].copy_from_slice(&v.to_le_bytes()),
                }
                slot
            })
            .collect();
        let mut params: Vec<*mut c_void> =
            slots.iter_mut().map(|s| s.as_mut_ptr().cast()).collect();
        let grid = threads.div_ceil(BLOCK as usize) as u32;
        // SAFETY: the parameters follow the kernel's signature (the backend builds them), and
        // every buffer outlives the call.
        unsafe { entry(kernel)(grid, BLOCK, params.as_mut_ptr()) };
        Ok(())
    }

    fn gemm(&self, g: &Gemm, a: &HostBuffer, b: &HostBuffer, c: &mut HostBuffer) -> Result<()> {
        self.gemm_calls.fetch_add(1, Ordering::Relaxed);
        reference_gemm(g, a.f32s(), b.f32s(), c.f32s_mut())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward::backend::cpu::CpuBackend;
    use crate::forward::backend::cuda::parity_tests::{
        bundled_pairs_match, every_fixture_matches, fixtures, golden_prompts, open, root,
    };
    use crate::forward::backend::cuda::CudaBackend;
    use crate::forward::backend::{Backend, Precision};
    use crate::forward::decoder::{trace, trace_on};
    use crate::sink::parity::{self, Tolerances};

    #[test]
    fn gpu_code_path_matches_the_cpu_on_every_architecture_fixture() {
        let gpu = CudaBackend::new(HostDevice::default(), Precision::F32);
        every_fixture_matches(&gpu);
        assert!(gpu.device().gemm_calls.load(Ordering::Relaxed) > 0);
    }

    #[test]
    fn gpu_code_path_matches_the_cpu_on_the_bundled_pairs() {
        bundled_pairs_match(&CudaBackend::new(HostDevice::default(), Precision::F32));
    }

    #[test]
    fn gpu_code_path_matches_the_cpu_in_bf16_on_every_architecture_fixture() {
        every_fixture_matches(&CudaBackend::new(HostDevice::default(), Precision::Bf16));
    }

    #[test]
    fn gpu_code_path_matches_the_cpu_in_bf16_on_the_bundled_pairs() {
        bundled_pairs_match(&CudaBackend::new(HostDevice::default(), Precision::Bf16));
    }

    /// Values spread over the activations' interesting range, deterministic.
    fn spread(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2001) as f32 / 125.0 - 8.0
            })
            .collect()
    }

    fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    #[test]
    fn vision_operations_match_the_cpu_through_the_stand_in() {
        use crate::forward::backend::{Activation, AttentionShape};
        let cpu = CpuBackend::new(Precision::F32);
        let gpu = CudaBackend::new(HostDevice::default(), Precision::F32);
        let (rows, width) = (7, 12);
        let x = spread(rows * width, 1);
        let (w, b) = (spread(width, 2), spread(width, 3));
        let on_gpu = |v: &Vec<f32>| gpu.upload(v.clone()).unwrap();
        let host = |t| gpu.to_host(&t).unwrap().into_owned();

        let want = cpu.layer_norm(&x, width, &w, &b, 1e-6).unwrap();
        let got = host(
            gpu.layer_norm(&on_gpu(&x), width, &on_gpu(&w), &on_gpu(&b), 1e-6)
                .unwrap(),
        );
        assert!(max_rel(&want, &got) < 1e-6, "layer norm");
        // With w = 1 and b = 0 every row has mean 0 and (biased) variance 1.
        let unit = cpu
            .layer_norm(&x, width, &vec![1.0; width], &vec![0.0; width], 0.0)
            .unwrap();
        for row in unit.chunks(width) {
            let mean = row.iter().sum::<f32>() / width as f32;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / width as f32;
            assert!(
                mean.abs() < 1e-6 && (var - 1.0).abs() < 1e-5,
                "{mean} {var}"
            );
        }

        for act in [
            Activation::Gelu,
            Activation::GeluTanh,
            Activation::QuickGelu,
            Activation::Silu,
        ] {
            let mut want = x.clone();
            cpu.activate(&mut want, act).unwrap();
            let mut t = on_gpu(&x);
            gpu.activate(&mut t, act).unwrap();
            assert!(max_rel(&want, &host(t)) < 1e-6, "{act:?}");
        }
        // Spot values of the definitions (torch: F.gelu(1.0) = 0.8413447, tanh form 0.8411920,
        // quick_gelu(1.0) = 0.84579575).
        assert!((Activation::Gelu.apply(1.0) - 0.841_344_7).abs() < 1e-6);
        assert!((Activation::GeluTanh.apply(1.0) - 0.841_192).abs() < 1e-6);
        assert!((Activation::QuickGelu.apply(1.0) - 0.845_795_75).abs() < 1e-6);

        let mut want = x.clone();
        cpu.scale_columns(&mut want, width, &w).unwrap();
        let mut t = on_gpu(&x);
        gpu.scale_columns(&mut t, width, &on_gpu(&w)).unwrap();
        assert_eq!(want, host(t), "layer scale is one product per value");

        // Block-diagonal, non-causal attention over two segments of 3 and 4 rows.
        let (heads, hd) = (2, 6);
        let q = spread(rows * heads * hd, 4);
        let k = spread(rows * heads * hd, 5);
        let v = spread(rows * heads * hd, 6);
        let prompts = [0..3, 3..7];
        let shape = AttentionShape {
            prompts: &prompts,
            num_heads: heads,
            num_kv_heads: heads,
            head_dim: hd,
            causal: false,
            window: None,
            scale: 0.1,
        };
        let probs = |h: &crate::forward::decoder::HeadView| h.probs.to_vec();
        let a = cpu.attention(&q, &k, Some(&v), &shape, &probs).unwrap();
        let g = gpu
            .attention(&on_gpu(&q), &on_gpu(&k), Some(&on_gpu(&v)), &shape, &probs)
            .unwrap();
        for (pa, pg) in a.heads.iter().zip(&g.heads) {
            assert!(max_rel(pa, pg) < 1e-6);
            // Not causal: the first query attends to the last key of its segment.
            assert!(pa[pa.len() / (pa.len() as f64).sqrt() as usize - 1] > 0.0);
        }
        assert!(max_rel(&a.context.unwrap(), &host(g.context.unwrap())) < 1e-6);
    }

    #[test]
    fn parity_covers_the_vision_towers() {
        let gpu = CudaBackend::new(HostDevice::default(), Precision::F32);
        for name in ["qwen2_5_vl", "qwen3_vl", "internvl_remote"] {
            let ckpt = open(&root().join("tests/fixtures/vlm").join(name));
            let tokens = parity::synthetic_tokens(320);
            let p = parity::check(&gpu, &[&ckpt], &[tokens], false).unwrap();
            assert_eq!(p.towers.len(), 1, "{name}: the tower is compared");
            let t = &p.towers[0];
            assert!(t.image_tokens > 0, "{name}: {t:?}");
            assert!(t.max_relative_diff <= 1e-4, "{name}: {t:?}");
            assert!(p.holds(), "{name}: {p:?}");
        }
    }

    #[test]
    fn parity_on_synthetic_tokens_holds_for_a_model_without_a_tokenizer() {
        let dir = root().join("tests/fixtures/score/models/olmo2");
        assert!(!dir.join("tokenizer.json").exists());
        let ckpt = open(&dir);
        let vocab = crate::forward::model::DecoderSpec::from_model_config(&ckpt.config)
            .unwrap()
            .vocab_size;
        let tokens = parity::synthetic_tokens(vocab);
        assert_eq!(tokens, parity::synthetic_tokens(vocab), "fixed seed");
        assert_eq!(
            tokens.iter().map(Vec::len).collect::<Vec<_>>(),
            [7, 16, 33, 60]
        );
        assert!(tokens.iter().flatten().all(|&t| (t as usize) < vocab));
        let gpu = CudaBackend::new(HostDevice::default(), Precision::F32);
        let p = parity::check(&gpu, &[&ckpt], &[tokens], false).unwrap();
        assert!(p.holds(), "{p:?}");
    }

    /// A device layer that hands cuBLAS the weight untransposed: the mistake the stand-in must
    /// catch, since a real GPU is rarely there to catch it.
    struct TransposedWeight(HostDevice);

    impl Device for TransposedWeight {
        type Buffer = HostBuffer;
        fn describe(&self) -> String {
            self.0.describe()
        }
        fn zeros(&self, bytes: usize) -> Result<HostBuffer> {
            self.0.zeros(bytes)
        }
        fn upload(&self, host: &[u8]) -> Result<HostBuffer> {
            self.0.upload(host)
        }
        fn download(&self, buf: &HostBuffer, range: Range<usize>) -> Result<Vec<u8>> {
            self.0.download(buf, range)
        }
        fn copy(
            &self,
            src: &HostBuffer,
            src_at: usize,
            dst: &mut HostBuffer,
            dst_at: usize,
            bytes: usize,
        ) -> Result<()> {
            self.0.copy(src, src_at, dst, dst_at, bytes)
        }
        fn launch(
            &self,
            kernel: Kernel,
            threads: usize,
            args: &mut [Arg<'_, HostBuffer>],
        ) -> Result<()> {
            self.0.launch(kernel, threads, args)
        }
        fn gemm(&self, g: &Gemm, a: &HostBuffer, b: &HostBuffer, c: &mut HostBuffer) -> Result<()> {
            let flipped = Gemm {
                transa: Op::None,
                ..*g
            };
            self.0.gemm(&flipped, a, b, c)
        }
    }

    #[test]
    fn the_stand_in_catches_a_transposed_gemm_operand() {
        let (case, dir) = fixtures().remove(0);
        let ckpt = open(&dir);
        let prompts = golden_prompts(case);
        let cpu = trace(&ckpt, &prompts).unwrap();
        // Square projections (q, o) run with wrong numbers; the others fail cuBLAS's checks.
        match trace_on(
            &CudaBackend::new(TransposedWeight(HostDevice::default()), Precision::F32),
            &ckpt,
            &prompts,
        ) {
            Err(e) => {
                let e = e.to_string();
                assert!(
                    e.contains("leading dimension") || e.contains("needs"),
                    "{e}"
                )
            }
            Ok(bad) => {
                let (probs, logits) = parity::trace_diff(&cpu, &bad);
                let tol = Tolerances::of(Precision::F32);
                assert!(probs > tol.probs || logits > tol.logits, "{probs} {logits}");
            }
        }
        // A square GEMM with A untransposed passes every check and gives the wrong product.
        let g = Gemm::linear(3, 4, 4);
        let w: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let x: Vec<f32> = (0..12).map(|i| (i % 5) as f32 - 2.0).collect();
        let (mut right, mut wrong) = (vec![0f32; 12], vec![0f32; 12]);
        reference_gemm(&g, &w, &x, &mut right).unwrap();
        let flipped = Gemm {
            transa: Op::None,
            ..g
        };
        reference_gemm(&flipped, &w, &x, &mut wrong).unwrap();
        assert_eq!(right, crate::forward::backend::cpu::linear(&x, 3, &w, 4, 4));
        assert_ne!(right, wrong);
    }

    #[test]
    fn the_reference_gemm_refuses_what_cublas_refuses() {
        let g = Gemm::linear(2, 3, 5);
        assert!(g.validate(15, 10, 6).is_ok());
        let short_lda = Gemm { lda: 4, ..g };
        assert!(short_lda
            .validate(15, 10, 6)
            .unwrap_err()
            .to_string()
            .contains("leading dimension of A"));
        assert!(g
            .validate(14, 10, 6)
            .unwrap_err()
            .to_string()
            .contains("A needs 15"));
        assert!(g
            .validate(15, 10, 5)
            .unwrap_err()
            .to_string()
            .contains("C needs 6"));
    }

    #[test]
    fn text_loss_on_the_stand_in_matches_the_cpu() {
        use crate::sink::text_loss::{encode, text_loss};
        // A BOS tokenizer, 64-token windows: 36 windows packed into one pass, the last short.
        let ckpt = open(&root().join("tests/fixtures/models/llama31-tied"));
        let path = root().join("assets/text/sample.txt");
        let text = std::fs::read_to_string(&path).unwrap();
        let ids = encode(&ckpt, &text, &path).unwrap();
        let cpu = text_loss(&CpuBackend::default(), &ckpt, &ids, 64, "sample", &|_| {}).unwrap();
        let gpu = CudaBackend::new(HostDevice::default(), Precision::F32);
        let other = text_loss(&gpu, &ckpt, &ids, 64, "sample", &|_| {}).unwrap();
        eprintln!("text loss: cpu {} stand-in {}", cpu.loss, other.loss);
        assert_eq!(
            (cpu.windows, cpu.tokens_predicted),
            (other.windows, other.tokens_predicted)
        );
        assert!((cpu.loss - other.loss).abs() < 1e-5, "{cpu:?} {other:?}");
    }

    #[test]
    fn non_finite_activations_are_found_on_both_backends() {
        let gpu = CudaBackend::new(HostDevice::default(), Precision::F32);
        let dir = root().join("tests/fixtures/nonfinite");
        let ckpt = open(&dir);
        let prompts = vec![vec![1u32, 2, 3, 4]];
        let cpu = trace_on(&CpuBackend::default(), &ckpt, &prompts)
            .err()
            .map(|e| e.to_string());
        let other = trace_on(&gpu, &ckpt, &prompts).err().map(|e| e.to_string());
        assert!(
            cpu.as_deref().is_some_and(|e| e.contains("NaN/Inf")),
            "{cpu:?}"
        );
        assert_eq!(cpu, other);
    }
}
