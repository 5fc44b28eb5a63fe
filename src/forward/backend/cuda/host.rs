//! A host stand-in for the device layer (tests only): `kernels.cu` compiled by the system C++
//! compiler through `host_shim.h` (build.rs), launched with cuLaunchKernel's calling convention,
//! a column-major GEMM that follows cuBLAS's transpose and leading-dimension rules and checks
//! each operand fits its buffer (in f32, and with bf16 operands and f32 accumulation as
//! `cublasGemmEx` on tensor cores), and a copy stream that is a real second queue. With it the
//! whole CUDA backend runs, and is checked against the CPU backend, on machines without a GPU.

use std::cell::UnsafeCell;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

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
    NarrowBf16 => sinkmerge_host_narrow_bf16,
    WidenBf16 => sinkmerge_host_widen_bf16,
    WidenF16 => sinkmerge_host_widen_f16,
    StoredGemvPartials => sinkmerge_host_stored_gemv_partials,
    StoredGemvSum => sinkmerge_host_stored_gemv_sum,
    RmsNormRows => sinkmerge_host_rms_norm_rows,
    AddBias => sinkmerge_host_add_bias,
    ClampValues => sinkmerge_host_clamp_values,
    Rope => sinkmerge_host_rope,
    Attention => sinkmerge_host_attention,
    CacheWrite => sinkmerge_host_cache_write,
    AttentionCached => sinkmerge_host_attention_cached,
    LayerNormRows => sinkmerge_host_layer_norm_rows,
    Activate => sinkmerge_host_activate,
    ScaleColumns => sinkmerge_host_scale_columns,
    ActMul => sinkmerge_host_act_mul,
    AddAssign => sinkmerge_host_add_assign,
    FlagNonFinite => sinkmerge_host_flag_non_finite,
    GatherRows => sinkmerge_host_gather_rows,
    ScatterAddRows => sinkmerge_host_scatter_add_rows,
}

/// The memory of one stand-in allocation, shared with the copy stream's pending copies (a copy
/// into a buffer freed before its wait lands in memory that is still there, as the real
/// driver frees in stream order).
struct Storage(UnsafeCell<Vec<u64>>);

// SAFETY: the copy thread writes a buffer only while the thread that waits for that copy is
// blocked in `wait` ([`CopyQueue`]); any other access is through the owning `HostBuffer`'s
// borrows. A read that skips the wait reads the poison, never a copy in progress, since an
// unwaited copy does not run.
unsafe impl Sync for Storage {}

/// Host memory standing in for a device allocation, 8-byte aligned like cudaMalloc's (and the
/// `long long` parameters need).
pub struct HostBuffer {
    words: Arc<Storage>,
    bytes: usize,
}

impl HostBuffer {
    fn filled(bytes: usize, word: u64) -> HostBuffer {
        HostBuffer {
            words: Arc::new(Storage(UnsafeCell::new(vec![word; bytes.div_ceil(8)]))),
            bytes,
        }
    }

    fn new(bytes: usize) -> HostBuffer {
        HostBuffer::filled(bytes, 0)
    }

    fn ptr(&self) -> *mut u64 {
        // SAFETY: only the pointer is taken; the Vec is never resized.
        unsafe { (*self.words.0.get()).as_mut_ptr() }
    }

    fn as_bytes(&self) -> &[u8] {
        // SAFETY: u64 storage viewed as bytes; `bytes` never exceeds it.
        unsafe { std::slice::from_raw_parts(self.ptr().cast(), self.bytes) }
    }

    fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr().cast(), self.bytes) }
    }

    fn f32s(&self) -> &[f32] {
        // SAFETY: 8-byte aligned storage; whole f32 values only.
        unsafe { std::slice::from_raw_parts(self.ptr().cast(), self.bytes / 4) }
    }

    fn f32s_mut(&mut self) -> &mut [f32] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr().cast(), self.bytes / 4) }
    }

    fn u16s(&self) -> &[u16] {
        // SAFETY: as `f32s`, for 16-bit values.
        unsafe { std::slice::from_raw_parts(self.ptr().cast(), self.bytes / 2) }
    }
}

/// What a buffer from [`HostDevice::upload_async`] holds until its copy has run: all bits set,
/// a NaN as f32 and as bf16, so a read that skipped the wait shows in every result.
const POISON: u64 = u64::MAX;

/// One copy on the copy stream: staged bytes and where they go.
struct CopyJob {
    seq: u64,
    staged: Vec<u8>,
    dst: Arc<Storage>,
}

#[derive(Default)]
struct QueueState {
    pending: VecDeque<CopyJob>,
    submitted: u64,
    /// Copies up to this one may run: the latest event a wait asked for.
    released: u64,
    done: u64,
    closed: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<QueueState>,
    changed: Condvar,
}

/// The stand-in's copy stream: a thread of its own that runs copies in submission order, each
/// no earlier than the first wait for its event or a later one. That is the latest a real copy
/// stream may finish, so a buffer read without the wait always holds [`POISON`], whatever the
/// timing: a missing wait is caught deterministically.
struct CopyQueue {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

impl CopyQueue {
    fn new() -> CopyQueue {
        let shared = Arc::new(Shared::default());
        let worker = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("stand-in copy stream".into())
                .spawn(move || CopyQueue::run(&shared))
                .expect("the stand-in's copy thread starts")
        };
        CopyQueue {
            shared,
            worker: Some(worker),
        }
    }

    fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, QueueState> {
        shared.state.lock().expect("no panic holds the copy queue")
    }

    fn run(shared: &Shared) {
        let mut state = CopyQueue::lock(shared);
        loop {
            let released = state.released;
            if state.pending.front().is_some_and(|j| j.seq <= released) {
                let job = state.pending.pop_front().expect("a front was seen");
                drop(state);
                // SAFETY: the storage holds at least `staged.len()` bytes (it was allocated for
                // them), and the thread that waits for this copy is blocked until `done` says it
                // is over ([`Storage`]).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        job.staged.as_ptr(),
                        (*job.dst.0.get()).as_mut_ptr().cast::<u8>(),
                        job.staged.len(),
                    )
                };
                state = CopyQueue::lock(shared);
                state.done = job.seq;
                shared.changed.notify_all();
            } else if state.closed {
                return;
            } else {
                state = shared
                    .changed
                    .wait(state)
                    .expect("no panic holds the copy queue");
            }
        }
    }

    fn submit(&self, staged: Vec<u8>, dst: Arc<Storage>) -> HostEvent {
        let mut state = CopyQueue::lock(&self.shared);
        state.submitted += 1;
        let seq = state.submitted;
        state.pending.push_back(CopyJob { seq, staged, dst });
        HostEvent { seq }
    }

    fn wait(&self, event: &HostEvent) {
        let mut state = CopyQueue::lock(&self.shared);
        state.released = state.released.max(event.seq);
        self.shared.changed.notify_all();
        while state.done < event.seq {
            state = (self.shared.changed.wait(state)).expect("no panic holds the copy queue");
        }
    }
}

impl Drop for CopyQueue {
    /// Copies never waited for are dropped, as a freed buffer's would be.
    fn drop(&mut self) {
        CopyQueue::lock(&self.shared).closed = true;
        self.shared.changed.notify_all();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// The point after one copy on the stand-in's copy stream.
pub struct HostEvent {
    seq: u64,
}

/// Which way a copy between the host and the stand-in went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transfer {
    /// [`Device::upload`], on the compute stream.
    Upload,
    /// [`Device::upload_async`], on the copy stream: the backend's weights.
    CopyStream,
    Download,
}

/// The stand-in device. `gemm_calls` and `gemm_bf16_calls` count GEMMs of each kind (tests check
/// which the backend uses); `transfers` lists every copy to or from the host with its bytes, in
/// order (tests check what a decode step moves).
pub struct HostDevice {
    pub gemm_calls: AtomicUsize,
    pub gemm_bf16_calls: AtomicUsize,
    pub transfers: Mutex<Vec<(Transfer, usize)>>,
    copies: CopyQueue,
}

impl Default for HostDevice {
    fn default() -> HostDevice {
        HostDevice {
            gemm_calls: AtomicUsize::new(0),
            gemm_bf16_calls: AtomicUsize::new(0),
            transfers: Mutex::new(Vec::new()),
            copies: CopyQueue::new(),
        }
    }
}

impl HostDevice {
    fn record(&self, way: Transfer, bytes: usize) {
        (self
            .transfers
            .lock()
            .expect("no panic holds the transfer list"))
        .push((way, bytes));
    }
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

/// `cublasGemmEx` with bf16 `A` and `B` (16-bit values), f32 `C` and `CUBLAS_COMPUTE_32F`: each
/// operand widened exactly to f32, each product exact in f32 (8-bit by 8-bit significands), the
/// sums in f32 ([`reference_gemm`]'s order).
pub fn reference_gemm_bf16(g: &Gemm, a: &[u16], b: &[u16], c: &mut [f32]) -> Result<()> {
    let widen = |v: &[u16]| -> Vec<f32> {
        v.iter()
            .map(|&h| f32::from_bits(u32::from(h) << 16))
            .collect()
    };
    reference_gemm(g, &widen(a), &widen(b), c)
}

impl Device for HostDevice {
    type Buffer = HostBuffer;
    type Event = HostEvent;

    fn describe(&self) -> String {
        "host stand-in for a CUDA device".into()
    }

    fn zeros(&self, bytes: usize) -> Result<HostBuffer> {
        Ok(HostBuffer::new(bytes))
    }

    fn upload(&self, host: &[u8]) -> Result<HostBuffer> {
        self.record(Transfer::Upload, host.len());
        let mut buf = HostBuffer::new(host.len());
        buf.as_bytes_mut().copy_from_slice(host);
        Ok(buf)
    }

    fn upload_async(&self, host: &[u8]) -> Result<(HostBuffer, HostEvent)> {
        self.record(Transfer::CopyStream, host.len());
        let buf = HostBuffer::filled(host.len(), POISON);
        let event = self.copies.submit(host.to_vec(), buf.words.clone());
        Ok((buf, event))
    }

    fn wait(&self, event: &HostEvent) -> Result<()> {
        self.copies.wait(event);
        Ok(())
    }

    fn download(&self, buf: &HostBuffer, range: Range<usize>) -> Result<Vec<u8>> {
        self.record(Transfer::Download, range.len());
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
                    Arg::Ref(b) => slot = (b.ptr() as usize).to_le_bytes(),
                    Arg::Mut(b) => slot = (b.ptr() as usize).to_le_bytes(),
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

    fn gemm_bf16(
        &self,
        g: &Gemm,
        a: &HostBuffer,
        b: &HostBuffer,
        c: &mut HostBuffer,
    ) -> Result<()> {
        self.gemm_bf16_calls.fetch_add(1, Ordering::Relaxed);
        reference_gemm_bf16(g, a.u16s(), b.u16s(), c.f32s_mut())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward::backend::cpu::CpuBackend;
    use crate::forward::backend::cuda::parity_tests::{
        bundled_pairs_match, cached_attention_matches, decodes_as_transformers,
        every_fixture_matches, fixtures, gamma, golden_prompts, max_rel, open, root, spread,
        stored_linear_matches,
    };
    use crate::forward::backend::cuda::CudaBackend;
    use crate::forward::backend::Backend;
    use crate::forward::pass::{record_all, record_all_on};
    use crate::forward::precision::Precision;
    use crate::sink::parity::{self, Tolerances};
    use safetensors::Dtype;

    #[test]
    fn gpu_code_path_matches_the_cpu_on_every_architecture_fixture() {
        let gpu = CudaBackend::new(HostDevice::default(), Precision::F32);
        every_fixture_matches(&gpu);
        assert!(gpu.device().gemm_calls.load(Ordering::Relaxed) > 0);
    }

    #[test]
    fn gpu_code_path_decodes_as_transformers() {
        decodes_as_transformers(&CudaBackend::new(HostDevice::default(), Precision::F32));
    }

    #[test]
    fn the_stored_gemv_matches_exact_products_and_the_cpu() {
        for precision in [Precision::F32, Precision::Bf16] {
            let gpu = CudaBackend::new(HostDevice::default(), precision);
            stored_linear_matches(&gpu);
        }
    }

    #[test]
    fn the_device_kv_cache_and_its_attention_match_the_cpu() {
        let f32_mode = CudaBackend::new(HostDevice::default(), Precision::F32);
        cached_attention_matches(&f32_mode, 1e-6);
        // One bf16 step: a sum in another order may round to the other side of a bf16 value.
        let bf16_mode = CudaBackend::new(HostDevice::default(), Precision::Bf16);
        cached_attention_matches(&bf16_mode, 2f32.powi(-8));
    }

    /// The cached attention in groups of heads under a tiny budget gives the single launch's
    /// heads, scores, probabilities and context bit for bit: grouped-query attention (6 heads
    /// over 2 KV heads) within a window of 4, a prefill of 7 rows then a decode step, in groups
    /// of 1, 2 and 4 + 2 heads (the last smaller than the buffers it reuses). Each group's
    /// scores and probabilities come back on their own.
    #[test]
    fn the_cached_attention_in_groups_of_heads_gives_the_single_launchs_bits() {
        use crate::forward::backend::{CachedShape, HeadView};

        let (nh, nkv, hd, capacity) = (6, 2, 8, 12);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let seen = |h: &HeadView| (h.head, bits(h.scores), bits(h.probs));
        for precision in [Precision::F32, Precision::Bf16] {
            let gpu = CudaBackend::new(HostDevice::default(), precision);
            let round = |v: Vec<f32>| v.into_iter().map(|x| precision.round(x)).collect();
            let mut keys = gpu.zeros(capacity, nkv * hd).unwrap();
            let mut values = gpu.zeros(capacity, nkv * hd).unwrap();
            for (offset, queries) in [(0, 7), (7, 1)] {
                let shape = CachedShape {
                    num_heads: nh,
                    num_kv_heads: nkv,
                    head_dim: hd,
                    capacity,
                    queries,
                    offset,
                    window: Some(4),
                    scale: (hd as f32).powf(-0.5),
                };
                let fresh = |seed| gpu.upload(round(spread(queries * nkv * hd, seed))).unwrap();
                gpu.cache_write(&mut keys, &fresh(offset as u32), &shape, offset)
                    .unwrap();
                gpu.cache_write(&mut values, &fresh(offset as u32 + 1), &shape, offset)
                    .unwrap();
                let q = gpu
                    .upload(round(spread(queries * nh * hd, offset as u32 + 2)))
                    .unwrap();
                let whole = gpu
                    .attention_cached(&q, &keys, &values, &shape, &seen)
                    .unwrap();
                assert_eq!(whole.heads.len(), nh);
                let whole_ctx = bits(&gpu.to_host(&whole.context.unwrap()).unwrap());
                let per_head = queries * shape.keys();
                for (budget, groups) in [
                    (0, vec![1; 6]),
                    (2 * per_head, vec![2, 2, 2]),
                    (4 * per_head, vec![4, 2]),
                ] {
                    gpu.device().transfers.lock().unwrap().clear();
                    let grouped = gpu
                        .attention_cached_within(&q, &keys, &values, &shape, &seen, budget)
                        .unwrap();
                    let moved = std::mem::take(&mut *gpu.device().transfers.lock().unwrap());
                    let each: Vec<_> = groups
                        .iter()
                        .flat_map(|g| [(Transfer::Download, g * per_head * 4); 2])
                        .collect();
                    assert_eq!(moved, each, "{precision} at {offset}, budget {budget}");
                    assert_eq!(
                        grouped.heads, whole.heads,
                        "{precision} at {offset}, {budget}"
                    );
                    let ctx = bits(&gpu.to_host(&grouped.context.unwrap()).unwrap());
                    assert_eq!(ctx, whole_ctx, "{precision} at {offset}, budget {budget}");
                }
            }
        }
    }

    /// A decode step copies no weight to the device (weights take the copy stream, and only
    /// they) and moves no cache either way: every copy is smaller than one layer's keys. The held
    /// matrices keep the checkpoint's bf16 bytes.
    #[test]
    fn a_decode_step_moves_no_weight_and_no_cache() {
        use crate::forward::backend::HeadView;
        use crate::forward::capture::Prompt;
        use crate::forward::resident::Resident;
        use crate::forward::weights::Model;
        use crate::generate::sampling::argmax;
        use crate::generate::sequence::{Logits, Sequence};

        let ckpt = open(&root().join("assets/models/tiny-qwen2/ref"));
        let model = Model::new(&ckpt).unwrap();
        let spec = &model.spec;
        let capacity = 64;
        let cache_layer_bytes = capacity * spec.num_kv_heads * spec.head_dim * 4;
        for precision in [Precision::F32, Precision::Bf16] {
            let gpu = CudaBackend::new(HostDevice::default(), precision);
            let weights = Resident::load(&gpu, &model).unwrap();
            let (out, inp) = (spec.num_kv_heads * spec.head_dim, spec.hidden_size);
            let name = "model.layers.0.self_attn.k_proj.weight";
            let held = weights.matrix(&model, name, &[out, inp]).unwrap().unwrap();
            assert_eq!((held.dtype, held.buf.bytes), (Dtype::BF16, out * inp * 2));
            let mut seq = Sequence::new(&model, &gpu, &weights, capacity, None).unwrap();
            let prompt = Prompt {
                ids: vec![11, 12, 13, 14, 15, 16, 17],
                images: None,
                mrope_merge: None,
            };
            let nothing = |_: usize, _: &HeadView| ();
            let mut logits = seq
                .prefill(&prompt, None, &nothing, &mut (), Logits::Last)
                .unwrap();
            for step in 0..3 {
                gpu.device().transfers.lock().unwrap().clear();
                logits = seq.step(argmax(&logits)).unwrap();
                let moved = std::mem::take(&mut *gpu.device().transfers.lock().unwrap());
                assert!(
                    moved.iter().all(|&(way, _)| way != Transfer::CopyStream),
                    "{precision} step {step}: weights uploaded: {moved:?}"
                );
                assert!(
                    moved.iter().all(|&(_, bytes)| bytes < cache_layer_bytes),
                    "{precision} step {step}: a copy of a cache's size: {moved:?}"
                );
                // What does come back: the next token's logits.
                assert!(moved.contains(&(Transfer::Download, spec.vocab_size * 4)));
            }
        }
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

    #[test]
    fn vision_operations_match_the_cpu_through_the_stand_in() {
        use crate::forward::activation::Activation;
        use crate::forward::backend::AttentionShape;
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

        // Every activation, alone and as the gated MLP's `act(gate) * up`, in f32 and bf16.
        let up = spread(rows * width, 7);
        for precision in [Precision::F32, Precision::Bf16] {
            let cpu = CpuBackend::new(precision);
            let gpu = CudaBackend::new(HostDevice::default(), precision);
            let host = |t| gpu.to_host(&t).unwrap().into_owned();
            for name in Activation::NAMES.split(", ") {
                let act = Activation::from_hf(name).unwrap();
                let mut want = x.clone();
                cpu.activate(&mut want, act).unwrap();
                let mut t = gpu.upload(x.clone()).unwrap();
                gpu.activate(&mut t, act).unwrap();
                let tolerance = if precision == Precision::F32 {
                    1e-6
                } else {
                    1e-2
                };
                assert!(max_rel(&want, &host(t)) < tolerance, "{name} {precision:?}");
                let mut want = x.clone();
                cpu.act_mul(&mut want, &up, act).unwrap();
                let mut t = gpu.upload(x.clone()).unwrap();
                gpu.act_mul(&mut t, &gpu.upload(up.clone()).unwrap(), act)
                    .unwrap();
                assert!(
                    max_rel(&want, &host(t)) < tolerance,
                    "{name} gated {precision:?}"
                );
            }
        }
        // Spot values of the definitions (torch: F.gelu(1.0) = 0.8413447, tanh form 0.8411920,
        // quick_gelu(1.0) = 0.84579575, F.mish(1.0) = 0.86509836).
        assert!((Activation::Gelu.apply(1.0) - 0.841_344_7).abs() < 1e-6);
        assert!((Activation::GeluTanh.apply(1.0) - 0.841_192).abs() < 1e-6);
        assert!((Activation::QuickGelu.apply(1.0) - 0.845_795_75).abs() < 1e-6);
        assert!((Activation::Mish.apply(1.0) - 0.865_098_36).abs() < 1e-6);
        assert_eq!(Activation::Gelu10.apply(20.0), 10.0);
        assert_eq!(Activation::Relu2.apply(3.0), 9.0);
        assert_eq!(Activation::Relu6.apply(7.0), 6.0);
        assert_eq!(Activation::LeakyRelu.apply(-1.0), -0.01);
        assert_eq!(Activation::Laplace.apply(-10.0), 0.0);
        assert_eq!(Activation::Laplace.apply(10.0), 1.0);
        assert!(Activation::Relu.apply(f32::NAN).is_nan());

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
        let probs = |h: &crate::forward::backend::HeadView| h.probs.to_vec();
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

    /// A mistake of a device layer that the stand-in must catch, since a real GPU is rarely
    /// there to catch it, or (`Synchronous`) the plain one-queue layer to compare against.
    #[derive(Clone, Copy)]
    enum Fault {
        /// cuBLAS gets the weight untransposed.
        TransposedWeight,
        /// The compute stream never waits for the copy stream's events.
        MissingWait,
        /// No copy stream: every upload is done before it returns.
        Synchronous,
    }

    struct Faulty(HostDevice, Fault);

    impl Device for Faulty {
        type Buffer = HostBuffer;
        type Event = HostEvent;
        fn describe(&self) -> String {
            self.0.describe()
        }
        fn zeros(&self, bytes: usize) -> Result<HostBuffer> {
            self.0.zeros(bytes)
        }
        fn upload(&self, host: &[u8]) -> Result<HostBuffer> {
            self.0.upload(host)
        }
        fn upload_async(&self, host: &[u8]) -> Result<(HostBuffer, HostEvent)> {
            match self.1 {
                // Event 0 is complete from the start.
                Fault::Synchronous => Ok((self.0.upload(host)?, HostEvent { seq: 0 })),
                _ => self.0.upload_async(host),
            }
        }
        fn wait(&self, event: &HostEvent) -> Result<()> {
            match self.1 {
                Fault::MissingWait => Ok(()),
                _ => self.0.wait(event),
            }
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
            match self.1 {
                Fault::TransposedWeight => {
                    let flipped = Gemm {
                        transa: Op::None,
                        ..*g
                    };
                    self.0.gemm(&flipped, a, b, c)
                }
                _ => self.0.gemm(g, a, b, c),
            }
        }
        fn gemm_bf16(
            &self,
            g: &Gemm,
            a: &HostBuffer,
            b: &HostBuffer,
            c: &mut HostBuffer,
        ) -> Result<()> {
            self.0.gemm_bf16(g, a, b, c)
        }
    }

    fn faulty(fault: Fault, precision: Precision) -> CudaBackend<Faulty> {
        CudaBackend::new(Faulty(HostDevice::default(), fault), precision)
    }

    #[test]
    fn a_copy_stream_buffer_holds_its_bytes_only_after_the_wait() {
        let dev = HostDevice::default();
        let (first, second) = (vec![7u8; 24], (0..40u8).collect::<Vec<u8>>());
        let (a, ea) = dev.upload_async(&first).unwrap();
        let (b, eb) = dev.upload_async(&second).unwrap();
        // Before any wait neither copy has run: both buffers hold the poison (a NaN).
        assert_eq!(dev.download(&a, 0..24).unwrap(), vec![0xff; 24]);
        assert!(f32s_of(&dev.download(&b, 0..4).unwrap())[0].is_nan());
        // Waiting for the second event runs the copies in order, the first included.
        dev.wait(&eb).unwrap();
        assert_eq!(dev.download(&a, 0..24).unwrap(), first);
        assert_eq!(dev.download(&b, 0..40).unwrap(), second);
        dev.wait(&ea).unwrap();
        // A buffer dropped before its wait, then a later wait: the copy lands in memory that is
        // still there.
        let (c, _never_waited) = dev.upload_async(&[1, 2, 3]).unwrap();
        drop(c);
        let (d, ed) = dev.upload_async(&[4, 5]).unwrap();
        dev.wait(&ed).unwrap();
        assert_eq!(dev.download(&d, 0..2).unwrap(), [4, 5]);
    }

    fn f32s_of(bytes: &[u8]) -> Vec<f32> {
        super::super::f32s(bytes)
    }

    #[test]
    fn a_missing_wait_for_the_copy_stream_is_caught() {
        let (case, dir) = fixtures().remove(0);
        let ckpt = open(&dir);
        let prompts = golden_prompts(case);
        for precision in [Precision::F32, Precision::Bf16] {
            let e = record_all_on(&faulty(Fault::MissingWait, precision), &ckpt, &prompts)
                .err()
                .map(|e| e.to_string());
            assert!(
                e.as_deref().is_some_and(|e| e.contains("NaN/Inf")),
                "{precision}: weights read before their copy: {e:?}"
            );
        }
    }

    #[test]
    fn the_copy_stream_gives_the_synchronous_uploads_results_bit_for_bit() {
        for (case, dir) in fixtures().into_iter().take(4) {
            let ckpt = open(&dir);
            let prompts = golden_prompts(case);
            for precision in [Precision::F32, Precision::Bf16] {
                let two = record_all_on(
                    &CudaBackend::new(HostDevice::default(), precision),
                    &ckpt,
                    &prompts,
                )
                .unwrap();
                let one =
                    record_all_on(&faulty(Fault::Synchronous, precision), &ckpt, &prompts).unwrap();
                assert_eq!(two.logits, one.logits, "{case} {precision}");
                assert_eq!(two.attentions, one.attentions, "{case} {precision}");
            }
        }
    }

    #[test]
    fn the_stand_in_bf16_gemm_is_exact_products_summed_in_f32() {
        let bf16 = |v: f32| half::bf16::from_f32(v);
        let (rows, out, inp) = (5, 7, 300);
        let g = Gemm::linear(rows, out, inp);
        let w: Vec<half::bf16> = spread(out * inp, 11).iter().map(|&v| bf16(v)).collect();
        let x: Vec<half::bf16> = spread(rows * inp, 12)
            .iter()
            .map(|&v| bf16(v / 3.0))
            .collect();
        let bits = |v: &[half::bf16]| v.iter().map(|h| h.to_bits()).collect::<Vec<u16>>();
        let mut got = vec![0f32; rows * out];
        reference_gemm_bf16(&g, &bits(&w), &bits(&x), &mut got).unwrap();
        let (wf, xf): (Vec<f32>, Vec<f32>) = (
            w.iter().map(|h| h.to_f32()).collect(),
            x.iter().map(|h| h.to_f32()).collect(),
        );
        // Independently: the exact dot products (in f64, where products and sums of these
        // values are exact), and the CPU backend's faer GEMM in another order.
        let cpu = crate::forward::backend::cpu::linear(&xf, rows, &wf, out, inp);
        for r in 0..rows {
            for o in 0..out {
                let (xr, wo) = (&xf[r * inp..(r + 1) * inp], &wf[o * inp..(o + 1) * inp]);
                let exact: f64 = xr.iter().zip(wo).map(|(&a, &b)| a as f64 * b as f64).sum();
                let mag: f64 = xr
                    .iter()
                    .zip(wo)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                let (v, c) = (got[r * out + o] as f64, cpu[r * out + o] as f64);
                assert!(
                    (v - exact).abs() <= gamma(inp) * mag,
                    "{r} {o}: {v} {exact}"
                );
                assert!((v - c).abs() <= 2.0 * gamma(inp) * mag, "{r} {o}: {v} {c}");
            }
        }
        // The same bf16 values through the f32 reference, in the same order: bit for bit.
        let mut f32_path = vec![0f32; rows * out];
        reference_gemm(&g, &wf, &xf, &mut f32_path).unwrap();
        assert_eq!(got, f32_path);
        // Small integers: every product and sum exact, so the result is exact.
        let g = Gemm::linear(1, 1, 3);
        let ones = [bf16(1.0), bf16(-2.0), bf16(3.0)];
        let mut c = [0f32];
        reference_gemm_bf16(&g, &bits(&ones), &bits(&ones), &mut c).unwrap();
        assert_eq!(c, [14.0]);
    }

    #[test]
    fn bf16_mode_runs_bf16_gemms_and_f32_mode_sgemms() {
        let (case, dir) = fixtures().remove(0);
        let ckpt = open(&dir);
        let prompts = golden_prompts(case);
        for precision in [Precision::F32, Precision::Bf16] {
            let gpu = CudaBackend::new(HostDevice::default(), precision);
            record_all_on(&gpu, &ckpt, &prompts).unwrap();
            let sgemm = gpu.device().gemm_calls.load(Ordering::Relaxed);
            let bf16 = gpu.device().gemm_bf16_calls.load(Ordering::Relaxed);
            match precision {
                Precision::F32 => assert!(sgemm > 0 && bf16 == 0, "{sgemm} {bf16}"),
                Precision::Bf16 => assert!(sgemm == 0 && bf16 > 0, "{sgemm} {bf16}"),
            }
        }
        // One linear layer in bf16 on uploaded f32 values (narrowed on the device): the CPU
        // backend's bf16 linear, within the bound of two f32 sums in different orders.
        let cpu = CpuBackend::new(Precision::Bf16);
        let gpu = CudaBackend::new(HostDevice::default(), Precision::Bf16);
        let (rows, out, inp) = (3, 9, 64);
        let r = |v: Vec<f32>| {
            v.into_iter()
                .map(|x| Precision::Bf16.round(x))
                .collect::<Vec<_>>()
        };
        let (x, w) = (r(spread(rows * inp, 21)), r(spread(out * inp, 22)));
        let want = cpu.linear(&x, rows, &w, out, inp).unwrap();
        let got = gpu
            .linear(
                &gpu.upload(x.clone()).unwrap(),
                rows,
                &gpu.upload(w.clone()).unwrap(),
                out,
                inp,
            )
            .unwrap();
        let got = gpu.to_host(&got).unwrap().into_owned();
        let mag = x.iter().chain(&w).fold(0f32, |m, v| m.max(v.abs())) as f64;
        let bound = 2.0 * gamma(inp) * inp as f64 * mag * mag;
        for (a, b) in want.iter().zip(&got) {
            assert!(((a - b) as f64).abs() <= bound, "{a} {b}");
        }
    }

    #[test]
    fn the_stand_in_catches_a_transposed_gemm_operand() {
        let (case, dir) = fixtures().remove(0);
        let ckpt = open(&dir);
        let prompts = golden_prompts(case);
        let cpu = record_all(&ckpt, &prompts).unwrap();
        // Square projections (q, o) run with wrong numbers; the others fail cuBLAS's checks.
        match record_all_on(
            &faulty(Fault::TransposedWeight, Precision::F32),
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
                let (probs, logits) = parity::recorded_diff(&cpu, &bad);
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
        let cpu = record_all_on(&CpuBackend::default(), &ckpt, &prompts)
            .err()
            .map(|e| e.to_string());
        let other = record_all_on(&gpu, &ckpt, &prompts)
            .err()
            .map(|e| e.to_string());
        assert!(
            cpu.as_deref().is_some_and(|e| e.contains("NaN/Inf")),
            "{cpu:?}"
        );
        assert_eq!(cpu, other);
    }
}
