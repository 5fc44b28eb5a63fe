//! The device layer on a real GPU, through cudarc with dynamic loading: libcuda, libnvrtc and
//! libcublas are opened at run time, so a machine without them builds, tests and runs the CPU
//! scorer, and `--device cuda` there gets a clear error instead of cudarc's panic.
//!
//! Kernels are compiled by the NVRTC of the machine the scorer runs on, to a CUBIN for the
//! device's own architecture: PTX from a newer NVRTC does not load on an older driver, a CUBIN
//! for the device needs no JIT. Compiled CUBINs are cached on disk, keyed by the source, the
//! NVRTC version and the architecture (`docs/reference/gpu.md`).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::cublas::{sys as blas_sys, CudaBlas, Gemm as _, GemmConfig};
use cudarc::driver::{
    result as driver_result, sys as driver_sys, CudaContext, CudaEvent, CudaFunction, CudaSlice,
    CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys, Ptx};
use rayon::prelude::*;
use serde::Serialize;

use super::device::{Arg, Device, Gemm, Kernel, Op, BLOCK, KERNELS_CU};
use crate::bad;
use crate::error::{Error, Result};

/// NVRTC options: exact f32 arithmetic (no contraction into FMAs, IEEE division and square
/// root, no flush to zero), so each kernel computes what the CPU backend computes.
const NVRTC_OPTIONS: [&str; 4] = [
    "--fmad=false",
    "--prec-div=true",
    "--prec-sqrt=true",
    "--ftz=false",
];

/// Whether the three CUDA libraries can be loaded; the name of the first that cannot.
pub fn missing_library() -> Option<&'static str> {
    // SAFETY: these only try to dlopen the libraries.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            Some("libcuda.so (the NVIDIA driver)")
        } else if !nvrtc_sys::is_culib_present() {
            Some("libnvrtc.so (NVRTC, from the CUDA toolkit or the nvidia-cuda-nvrtc wheel)")
        } else if !blas_sys::is_culib_present() {
            Some("libcublas.so (cuBLAS, from the CUDA toolkit or the nvidia-cublas wheel)")
        } else {
            None
        }
    }
}

/// The libraries cudarc opens (its `culib`: the first of these names' candidates that loads)
/// and the entry points it resolves in them for this backend. cudarc resolves each symbol on
/// first call and panics when it is missing, so a library under the right name without them (a
/// stub, another program's library) must be refused before cudarc is touched. The lists are the
/// driver calls behind the cudarc API `Driver` uses (context, module, stream, event, memory and
/// launch; error strings), and every NVRTC and cuBLAS call this file makes.
pub const LIBRARY_SYMBOLS: [(&[&str], &str, &[&str]); 3] = [
    (
        &["cuda", "nvcuda"],
        "the NVIDIA driver",
        &[
            "cuInit",
            "cuGetErrorName",
            "cuGetErrorString",
            "cuDeviceGetCount",
            "cuDeviceGet",
            "cuDeviceGetName",
            "cuDeviceGetAttribute",
            "cuDeviceTotalMem_v2",
            "cuDevicePrimaryCtxRetain",
            "cuDevicePrimaryCtxRelease_v2",
            "cuCtxGetCurrent",
            "cuCtxSetCurrent",
            "cuCtxSynchronize",
            "cuModuleLoadData",
            "cuModuleGetFunction",
            "cuModuleUnload",
            "cuLaunchKernel",
            "cuMemAlloc_v2",
            "cuMemAllocAsync",
            "cuMemFree_v2",
            "cuMemFreeAsync",
            "cuMemHostAlloc",
            "cuMemFreeHost",
            "cuMemGetInfo_v2",
            "cuMemcpyHtoDAsync_v2",
            "cuMemcpyDtoHAsync_v2",
            "cuMemcpyDtoDAsync_v2",
            "cuStreamCreate",
            "cuStreamDestroy_v2",
            "cuStreamSynchronize",
            "cuStreamWaitEvent",
            "cuEventCreate",
            "cuEventDestroy_v2",
            "cuEventRecord",
            "cuEventQuery",
            "cuEventSynchronize",
        ],
    ),
    (
        &["nvrtc"],
        "NVRTC",
        &[
            "nvrtcVersion",
            "nvrtcCreateProgram",
            "nvrtcCompileProgram",
            "nvrtcDestroyProgram",
            "nvrtcGetProgramLogSize",
            "nvrtcGetProgramLog",
            "nvrtcGetPTXSize",
            "nvrtcGetPTX",
            "nvrtcGetCUBINSize",
            "nvrtcGetCUBIN",
        ],
    ),
    (
        &["cublas"],
        "cuBLAS",
        &[
            "cublasCreate_v2",
            "cublasDestroy_v2",
            "cublasSetStream_v2",
            "cublasSetMathMode",
            "cublasSgemm_v2",
            "cublasGemmEx",
        ],
    ),
];

/// The first CUDA library that loads but lacks an entry point cudarc needs: the file name it
/// was loaded under, what it is, and the missing symbol. Call after [`missing_library`].
pub fn missing_symbol() -> Option<(String, &'static str, &'static str)> {
    for (names, what, symbols) in LIBRARY_SYMBOLS {
        let loaded = (names.iter())
            .flat_map(|n| cudarc::get_lib_name_candidates(n))
            // SAFETY: as cudarc's own `culib`, this only opens the library (its initialisers
            // run, as they would when cudarc opens it).
            .find_map(|file| {
                unsafe { libloading::Library::new(&file) }
                    .ok()
                    .map(|l| (file, l))
            });
        let Some((file, lib)) = loaded else {
            continue;
        };
        for symbol in symbols {
            // SAFETY: only the address is looked up; nothing is called.
            if unsafe { lib.get::<*const ()>(symbol.as_bytes()) }.is_err() {
                return Some((file, what, symbol));
            }
        }
    }
    None
}

/// What an NVRTC compile gives: the image and the compiler's log.
pub struct Compiled {
    pub image: Vec<u8>,
    pub log: String,
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::Internal(format!("nvrtcVersion: {e}")))?;
    Ok((major, minor))
}

/// Compile `kernels.cu` for `arch` (`compute_90` gives PTX, `sm_90` a CUBIN) with `extra`
/// options besides [`NVRTC_OPTIONS`]. Errors carry NVRTC's log.
pub fn compile(arch: &str, extra: &[&str]) -> Result<Compiled> {
    let src = std::ffi::CString::new(KERNELS_CU).expect("kernels.cu has no NUL");
    let name = c"kernels.cu";
    let prog = nvrtc_result::create_program(&src, Some(name))
        .map_err(|e| Error::Internal(format!("NVRTC: cannot create the program: {e}")))?;
    let mut options: Vec<String> = vec![format!("--gpu-architecture={arch}")];
    options.extend(NVRTC_OPTIONS.iter().map(|s| s.to_string()));
    options.extend(extra.iter().map(|s| s.to_string()));
    // SAFETY: `prog` is live until destroyed below.
    let compiled = unsafe { nvrtc_result::compile_program(prog, &options) };
    let log = unsafe { nvrtc_result::get_program_log(prog) }
        .map(|raw| {
            let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
            CStr::from_bytes_until_nul(&bytes)
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned())
        })
        .unwrap_or_default();
    let image = compiled
        .map_err(|e| Error::Internal(format!("NVRTC ({arch}): {e}\n{log}")))
        .and_then(|()| unsafe { image(prog, arch.starts_with("sm_")) });
    // SAFETY: created above, destroyed once.
    unsafe { nvrtc_result::destroy_program(prog) }
        .map_err(|e| Error::Internal(format!("NVRTC: {e}")))?;
    Ok(Compiled { image: image?, log })
}

/// The CUBIN or the PTX of a compiled program.
///
/// # Safety
/// `prog` must be a compiled, live program.
unsafe fn image(prog: nvrtc_sys::nvrtcProgram, cubin: bool) -> Result<Vec<u8>> {
    let err = |e: nvrtc_result::NvrtcError| Error::Internal(format!("NVRTC: {e}"));
    if !cubin {
        let ptx = nvrtc_result::get_ptx(prog).map_err(err)?;
        return Ok(ptx.iter().map(|&c| c as u8).collect());
    }
    let mut size = 0usize;
    nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
        .result()
        .map_err(err)?;
    let mut bin = vec![0u8; size];
    nvrtc_sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut c_char)
        .result()
        .map_err(err)?;
    Ok(bin)
}

/// Where compiled kernels are cached: `$SINKMERGE_CACHE`, else `$XDG_CACHE_HOME/sinkmerge`, else
/// `~/.cache/sinkmerge`.
fn cache_dir() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("SINKMERGE_CACHE")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("sinkmerge")))
        .or_else(|| env("HOME").map(|d| d.join(".cache/sinkmerge")))
}

/// A CUBIN is an ELF image.
fn looks_like_cubin(bytes: &[u8]) -> bool {
    bytes.len() > 4 && bytes.starts_with(b"\x7fELF")
}

/// The CUBIN of `kernels.cu` for `arch`, from the cache (unless `fresh`) or compiled (and then
/// cached; a cache that cannot be written costs a warning, not the run).
fn cubin_for(arch: &str, fresh: bool) -> Result<Vec<u8>> {
    let (major, minor) = nvrtc_version()?;
    let key = xxhash_rust::xxh3::xxh3_64(
        format!("{KERNELS_CU}\0{arch}\0{major}.{minor}\0{NVRTC_OPTIONS:?}").as_bytes(),
    );
    let path = cache_dir().map(|d| {
        d.join(format!(
            "kernels-{arch}-nvrtc{major}.{minor}-{key:016x}.cubin"
        ))
    });
    let cached = path
        .as_ref()
        .filter(|_| !fresh)
        .and_then(|p| std::fs::read(p).ok());
    if let Some(bytes) = cached.filter(|b| looks_like_cubin(b)) {
        return Ok(bytes);
    }
    let compiled = compile(arch, &[])?;
    if let Some(path) = &path {
        let written = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .map_err(|e| Error::write(path, e))
            .and_then(|()| crate::checkpoint::output::write_file_atomic(path, &compiled.image));
        if let Err(e) = written {
            eprintln!("sinkmerge: warning: compiled kernels not cached: {e}");
        }
    }
    Ok(compiled.image)
}

/// Where the time of a GPU run went, and the memory it held.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Timings {
    /// Device set-up: context, kernels (compiled or cached), cuBLAS.
    pub init_s: f64,
    /// Reading weights and queueing their copies to the device (the copies themselves run on
    /// the copy stream, beside the compute).
    pub load_s: f64,
    /// Waiting for kernels and GEMMs before each copy back.
    pub compute_s: f64,
    /// Copying attention scores, probabilities and other results back to the host.
    pub copy_back_s: f64,
    /// Most device memory this run's buffers held at once.
    pub peak_memory_bytes: usize,
}

/// A device allocation that keeps the run's memory count.
pub struct DriverBuffer {
    slice: CudaSlice<u8>,
    live: Arc<AtomicUsize>,
}

impl Drop for DriverBuffer {
    fn drop(&mut self) {
        self.live.fetch_sub(self.slice.len(), Ordering::Relaxed);
    }
}

/// Bytes of each pinned staging buffer; uploads larger than one go through both in turn.
const STAGE_BYTES: usize = 64 << 20;
/// Uploads up to this size are copied directly (pageable), not staged.
const DIRECT_BYTES: usize = 1 << 20;
/// Bytes each thread copies into a staging buffer: parallel reads of the mapped file.
const READ_BLOCK: usize = 4 << 20;

/// A pinned host buffer and the event recorded after the last copy out of it.
struct Stage {
    buf: PinnedHostSlice<u8>,
    copied: CudaEvent,
}

/// One GPU, its two streams, cuBLAS handles and kernels.
pub struct Driver {
    ctx: Arc<CudaContext>,
    /// The compute stream: kernels, GEMMs, copies back.
    stream: Arc<CudaStream>,
    /// The copy stream: uploads, each followed by an event the compute stream waits for.
    copy_stream: Arc<CudaStream>,
    /// SGEMM with pedantic math: TF32 off, the parity mode.
    blas: CudaBlas,
    /// `cublasGemmEx` on bf16 operands with the default math mode: tensor cores, f32 compute.
    blas_bf16: CudaBlas,
    functions: Vec<CudaFunction>,
    name: String,
    ordinal: usize,
    live: Arc<AtomicUsize>,
    peak: AtomicUsize,
    times: Mutex<Timings>,
    /// Two staging buffers: one is filled from the file while the other's copy runs.
    stages: Mutex<[Stage; 2]>,
}

fn driver_error(what: &str) -> impl Fn(cudarc::driver::DriverError) -> Error + '_ {
    move |e| Error::Internal(format!("CUDA: {what}: {}", describe(&e)))
}

/// A driver error as `CUDA error 2 (CUDA_ERROR_OUT_OF_MEMORY: out of memory)`, or as its code
/// alone when the driver gives no name or description. cudarc's own Display reads the string
/// `cuGetErrorString` returns without checking it, so a driver (or a stub) that answers success
/// with a NULL string would crash it; here a string is read only when the call succeeded and the
/// pointer is not NULL.
fn describe(e: &cudarc::driver::DriverError) -> String {
    type Lookup = unsafe fn(driver_sys::CUresult, *mut *const c_char) -> driver_sys::CUresult;
    let text = |lookup: Lookup| {
        let mut ptr: *const c_char = std::ptr::null();
        // SAFETY: one out-parameter, read only when the call succeeded and set it; the driver
        // documents the string as static.
        let ok = unsafe { lookup(e.0, &mut ptr) } == driver_sys::CUresult::CUDA_SUCCESS;
        (ok && !ptr.is_null()).then(|| {
            unsafe { CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned()
        })
    };
    let code = e.0 as u32;
    match (
        text(driver_sys::cuGetErrorName),
        text(driver_sys::cuGetErrorString),
    ) {
        (Some(name), Some(what)) => format!("CUDA error {code} ({name}: {what})"),
        (Some(one), None) | (None, Some(one)) => format!("CUDA error {code} ({one})"),
        (None, None) => format!("CUDA error {code}"),
    }
}

impl Driver {
    /// Open GPU `ordinal` (`--device cuda:N`). No CUDA library, no device or an index out of
    /// range is bad input (exit 2), never a panic.
    pub fn open(ordinal: usize) -> Result<Driver> {
        let started = Instant::now();
        if let Some(lib) = missing_library() {
            return Err(bad!(
                "--device cuda:{ordinal}: {lib} cannot be loaded; this machine has no usable CUDA \
                 installation (put the libraries on LD_LIBRARY_PATH), or score with --device cpu"
            ));
        }
        if let Some((file, what, symbol)) = missing_symbol() {
            return Err(bad!(
                "--device cuda:{ordinal}: {file} ({what}) has no `{symbol}`; it is not a usable \
                 CUDA library (put the real one first on LD_LIBRARY_PATH), or score with \
                 --device cpu"
            ));
        }
        let count = CudaContext::device_count().map_err(|e| {
            bad!(
                "--device cuda:{ordinal}: the CUDA driver finds no usable GPU: {}",
                describe(&e)
            )
        })?;
        if count <= 0 {
            return Err(bad!(
                "--device cuda:{ordinal}: the CUDA driver reports no GPU on this machine"
            ));
        }
        if ordinal >= count as usize {
            return Err(bad!(
                "--device cuda:{ordinal}: out of range; this machine has {count} GPU(s), \
                 cuda:0 to cuda:{}",
                count - 1
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_error("cannot create a context"))?;
        let name = ctx.name().map_err(driver_error("device name"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver_error("compute capability"))?;
        let arch = format!("sm_{major}{minor}");
        // A cached image the driver refuses (damaged, or from another driver) is compiled anew.
        let module = match ctx.load_module(Ptx::from_binary(cubin_for(&arch, false)?)) {
            Ok(module) => module,
            Err(_) => ctx
                .load_module(Ptx::from_binary(cubin_for(&arch, true)?))
                .map_err(driver_error("cannot load the kernels"))?,
        };
        let functions = Kernel::ALL
            .iter()
            .map(|k| module.load_function(k.name()))
            .collect::<Result<_, _>>()
            .map_err(driver_error("kernel entry point"))?;
        let stream = ctx.default_stream();
        // A non-blocking stream, so its copies overlap the compute stream's work. It puts cudarc
        // in multi-stream mode: each buffer also records cudarc's own read and write events, and
        // a weight's free, ordered on the copy stream that allocated it, waits for the compute
        // stream's last read (the explicit events order the use).
        let copy_stream = ctx.new_stream().map_err(driver_error("copy stream"))?;
        let stage = || -> Result<Stage> {
            Ok(Stage {
                // SAFETY: u8 needs no initialisation; write-combined suits a buffer the host
                // only writes.
                buf: unsafe { ctx.alloc_pinned::<u8>(STAGE_BYTES) }
                    .map_err(driver_error("pinned host memory"))?,
                copied: ctx.new_event(None).map_err(driver_error("event"))?,
            })
        };
        let stages = Mutex::new([stage()?, stage()?]);
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| Error::Internal(format!("cuBLAS: cannot create a handle: {e}")))?;
        // TF32 off: f32 GEMMs stay f32 (the parity mode).
        // SAFETY: a live handle.
        unsafe {
            blas_sys::cublasSetMathMode(
                *blas.handle(),
                blas_sys::cublasMath_t::CUBLAS_PEDANTIC_MATH,
            )
        }
        .result()
        .map_err(|e| Error::Internal(format!("cuBLAS: cannot set the math mode: {e}")))?;
        let blas_bf16 = CudaBlas::new(stream.clone())
            .map_err(|e| Error::Internal(format!("cuBLAS: cannot create a handle: {e}")))?;
        let driver = Driver {
            ctx,
            stream,
            copy_stream,
            blas,
            blas_bf16,
            functions,
            name,
            ordinal,
            live: Arc::new(AtomicUsize::new(0)),
            peak: AtomicUsize::new(0),
            times: Mutex::new(Timings::default()),
            stages,
        };
        driver
            .times
            .lock()
            .expect("no panic holds the timing lock")
            .init_s = started.elapsed().as_secs_f64();
        Ok(driver)
    }

    /// The run's timings so far.
    pub fn timings(&self) -> Timings {
        Timings {
            peak_memory_bytes: self.peak.load(Ordering::Relaxed),
            ..*self.times.lock().expect("no panic holds the timing lock")
        }
    }

    /// Total memory of the device, in bytes.
    pub fn total_memory(&self) -> Result<usize> {
        self.ctx.total_mem().map_err(driver_error("total memory"))
    }

    fn add_time(&self, f: impl FnOnce(&mut Timings) -> &mut f64, since: Instant) {
        *f(&mut self.times.lock().expect("no panic holds the timing lock")) +=
            since.elapsed().as_secs_f64();
    }

    fn wrap(&self, slice: CudaSlice<u8>) -> DriverBuffer {
        let now = self.live.fetch_add(slice.len(), Ordering::Relaxed) + slice.len();
        self.peak.fetch_max(now, Ordering::Relaxed);
        DriverBuffer {
            slice,
            live: self.live.clone(),
        }
    }

    /// `Gemm`'s sizes as cuBLAS's 32-bit integers, and its operations.
    fn blas_args(
        g: &Gemm,
    ) -> Result<(
        blas_sys::cublasOperation_t,
        blas_sys::cublasOperation_t,
        [c_int; 6],
    )> {
        let int = |v: usize| {
            i32::try_from(v).map_err(|_| {
                Error::Internal(format!("GEMM {g:?}: {v} exceeds cuBLAS's 32-bit sizes"))
            })
        };
        let op = |op: Op| match op {
            Op::None => blas_sys::cublasOperation_t::CUBLAS_OP_N,
            Op::Transpose => blas_sys::cublasOperation_t::CUBLAS_OP_T,
        };
        Ok((
            op(g.transa),
            op(g.transb),
            [
                int(g.m)?,
                int(g.n)?,
                int(g.k)?,
                int(g.lda)?,
                int(g.ldb)?,
                int(g.ldc)?,
            ],
        ))
    }

    fn sync(&self) -> Result<()> {
        let started = Instant::now();
        self.stream
            .synchronize()
            .map_err(driver_error("kernel or GEMM failed"))?;
        self.add_time(|t| &mut t.compute_s, started);
        Ok(())
    }
}

impl Drop for Driver {
    /// Staged copies may still read the pinned buffers: wait for them before those are freed.
    fn drop(&mut self) {
        let _ = self.copy_stream.synchronize();
        let _ = self.stream.synchronize();
    }
}

impl Device for Driver {
    type Buffer = DriverBuffer;
    type Event = CudaEvent;

    fn describe(&self) -> String {
        format!("{} (cuda:{})", self.name, self.ordinal)
    }

    fn zeros(&self, bytes: usize) -> Result<DriverBuffer> {
        let slice = self
            .stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(driver_error("out of device memory"))?;
        Ok(self.wrap(slice))
    }

    /// A copy the compute stream sees at once: small ones directly on it, larger ones on the
    /// copy stream, waited for.
    fn upload(&self, host: &[u8]) -> Result<DriverBuffer> {
        if host.len() > DIRECT_BYTES {
            let (buf, copied) = self.upload_async(host)?;
            self.wait(&copied)?;
            return Ok(buf);
        }
        let started = Instant::now();
        let slice = if host.is_empty() {
            self.stream.alloc_zeros::<u8>(1)
        } else {
            self.stream.clone_htod(host)
        }
        .map_err(driver_error("copy to the device"))?;
        self.add_time(|t| &mut t.load_s, started);
        Ok(self.wrap(slice))
    }

    /// On the copy stream. Small buffers are copied directly (the driver stages pageable memory
    /// before the call returns). Larger ones go through the pinned staging buffers: each chunk
    /// is read from the (mapped) file by several threads, then copied asynchronously while the
    /// next chunk is read into the other buffer; the compute stream runs what was queued before
    /// meanwhile.
    fn upload_async(&self, host: &[u8]) -> Result<(DriverBuffer, CudaEvent)> {
        let started = Instant::now();
        let event = |stream: &CudaStream| {
            stream
                .record_event(Some(driver_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(driver_error("event"))
        };
        if host.is_empty() {
            return Ok((self.zeros(0)?, event(&self.copy_stream)?));
        }
        // Allocated in the copy stream's order, so the copies need not wait for the compute
        // stream's queue. SAFETY: every byte is written by the copies below before the compute
        // stream, which waits for the returned event, reads it.
        let mut slice = unsafe { self.copy_stream.alloc::<u8>(host.len()) }
            .map_err(driver_error("out of device memory"))?;
        if host.len() <= DIRECT_BYTES {
            let (dst, _record) = slice.device_ptr_mut(&self.copy_stream);
            // SAFETY: `dst` has room for `host`; pageable memory is staged before this returns.
            unsafe { driver_result::memcpy_htod_async(dst, host, self.copy_stream.cu_stream()) }
                .map_err(driver_error("copy to the device"))?;
        } else {
            let mut stages = (self.stages.lock()).expect("no panic holds the staging lock");
            for (i, chunk) in host.chunks(STAGE_BYTES).enumerate() {
                let stage = &mut stages[i % 2];
                // The copy out of this buffer two chunks ago must be done before it is refilled.
                stage
                    .copied
                    .synchronize()
                    .map_err(driver_error("staged copy"))?;
                let pinned = stage
                    .buf
                    .as_mut_slice()
                    .map_err(driver_error("pinned host memory"))?;
                pinned[..chunk.len()]
                    .par_chunks_mut(READ_BLOCK)
                    .zip(chunk.par_chunks(READ_BLOCK))
                    .for_each(|(dst, src)| dst.copy_from_slice(src));
                let offset = (i * STAGE_BYTES) as u64;
                let (dst, _record) = slice.device_ptr_mut(&self.copy_stream);
                // SAFETY: `dst + offset` has room for the chunk; the pinned buffer is not
                // touched again before `copied` says the copy is done.
                unsafe {
                    driver_result::memcpy_htod_async(
                        dst + offset,
                        &pinned[..chunk.len()],
                        self.copy_stream.cu_stream(),
                    )
                }
                .map_err(driver_error("copy to the device"))?;
                stage
                    .copied
                    .record(&self.copy_stream)
                    .map_err(driver_error("event"))?;
            }
        }
        let copied = event(&self.copy_stream)?;
        self.add_time(|t| &mut t.load_s, started);
        Ok((self.wrap(slice), copied))
    }

    fn wait(&self, event: &CudaEvent) -> Result<()> {
        self.stream.wait(event).map_err(driver_error("event"))
    }

    fn download(&self, buf: &DriverBuffer, range: Range<usize>) -> Result<Vec<u8>> {
        self.sync()?;
        let started = Instant::now();
        let out = self
            .stream
            .clone_dtoh(&buf.slice.slice(range))
            .map_err(driver_error("copy to the host"))?;
        self.add_time(|t| &mut t.copy_back_s, started);
        Ok(out)
    }

    fn copy(
        &self,
        src: &DriverBuffer,
        src_at: usize,
        dst: &mut DriverBuffer,
        dst_at: usize,
        bytes: usize,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.stream
            .memcpy_dtod(
                &src.slice.slice(src_at..src_at + bytes),
                &mut dst.slice.slice_mut(dst_at..dst_at + bytes),
            )
            .map_err(driver_error("copy on the device"))
    }

    fn launch(
        &self,
        kernel: Kernel,
        threads: usize,
        args: &mut [Arg<'_, DriverBuffer>],
    ) -> Result<()> {
        let function = &self.functions[Kernel::ALL
            .iter()
            .position(|k| *k == kernel)
            .expect("Kernel::ALL lists every kernel")];
        let mut builder = self.stream.launch_builder(function);
        for arg in args.iter_mut() {
            match arg {
                Arg::Ref(b) => builder.arg(&b.slice),
                Arg::Mut(b) => builder.arg(&mut b.slice),
                Arg::I32(v) => builder.arg(&*v),
                Arg::I64(v) => builder.arg(&*v),
                Arg::F32(v) => builder.arg(&*v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (threads.div_ceil(BLOCK as usize) as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments follow the kernel's signature (the backend builds them).
        unsafe { builder.launch(cfg) }
            .map(drop)
            .map_err(driver_error(kernel.name()))
    }

    fn gemm(
        &self,
        g: &Gemm,
        a: &DriverBuffer,
        b: &DriverBuffer,
        c: &mut DriverBuffer,
    ) -> Result<()> {
        g.validate(a.slice.len() / 4, b.slice.len() / 4, c.slice.len() / 4)?;
        // cuBLAS calls do not make the context current themselves.
        self.ctx.bind_to_thread().map_err(driver_error("context"))?;
        let (transa, transb, [m, n, k, lda, ldb, ldc]) = Driver::blas_args(g)?;
        let cfg = GemmConfig {
            transa,
            transb,
            m,
            n,
            k,
            alpha: 1.0f32,
            lda,
            ldb,
            beta: 0.0f32,
            ldc,
        };
        let views = || Error::Internal("GEMM operand is not whole f32 values".into());
        // SAFETY: the buffers hold f32 values; `validate` checked each operand fits its buffer.
        unsafe {
            let a = a
                .slice
                .transmute::<f32>(a.slice.len() / 4)
                .ok_or_else(views)?;
            let b = b
                .slice
                .transmute::<f32>(b.slice.len() / 4)
                .ok_or_else(views)?;
            let len_c = c.slice.len() / 4;
            let mut c = c.slice.transmute_mut::<f32>(len_c).ok_or_else(views)?;
            self.blas.gemm(cfg, &a, &b, &mut c)
        }
        .map_err(|e| Error::Internal(format!("cuBLAS GEMM {g:?}: {e}")))
    }

    fn gemm_bf16(
        &self,
        g: &Gemm,
        a: &DriverBuffer,
        b: &DriverBuffer,
        c: &mut DriverBuffer,
    ) -> Result<()> {
        g.validate(a.slice.len() / 2, b.slice.len() / 2, c.slice.len() / 4)?;
        self.ctx.bind_to_thread().map_err(driver_error("context"))?;
        let (transa, transb, [m, n, k, lda, ldb, ldc]) = Driver::blas_args(g)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let bf16 = blas_sys::cudaDataType_t::CUDA_R_16BF;
        let (pa, _read_a) = a.slice.device_ptr(&self.stream);
        let (pb, _read_b) = b.slice.device_ptr(&self.stream);
        let (pc, _write_c) = c.slice.device_ptr_mut(&self.stream);
        // SAFETY: a live handle on the compute stream; `validate` checked each operand fits its
        // buffer (bf16 A and B, f32 C); alpha and beta are f32, as CUBLAS_COMPUTE_32F takes.
        unsafe {
            blas_sys::cublasGemmEx(
                *self.blas_bf16.handle(),
                transa,
                transb,
                m,
                n,
                k,
                (&alpha as *const f32).cast::<c_void>(),
                pa as *const c_void,
                bf16,
                lda,
                pb as *const c_void,
                bf16,
                ldb,
                (&beta as *const f32).cast::<c_void>(),
                pc as *mut c_void,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                ldc,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .result()
        .map_err(|e| Error::Internal(format!("cuBLAS GemmEx (bf16) {g:?}: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward::backend::cuda::parity_tests::{
        bundled_pairs_match, cached_attention_matches, decodes_as_transformers,
        every_fixture_matches, stored_linear_matches,
    };
    use crate::forward::backend::cuda::CudaBackend;
    use crate::forward::precision::Precision;

    /// Spill lines of `--ptxas-options=-v`: "N bytes spill stores, M bytes spill loads".
    fn spills(log: &str) -> Vec<String> {
        log.lines()
            .filter(|l| {
                l.contains("spill") && !l.contains(" 0 bytes spill stores, 0 bytes spill loads")
            })
            .map(str::to_string)
            .collect()
    }

    #[test]
    #[ignore = "needs libnvrtc (no GPU): .ci/run fetches the nvidia-cuda-nvrtc wheel and runs it"]
    fn kernels_compile_with_nvrtc_to_ptx_and_an_sm90_cubin_without_spills() {
        assert!(
            unsafe { nvrtc_sys::is_culib_present() },
            "libnvrtc cannot be loaded: put the nvidia-cuda-nvrtc wheel's lib folder on LD_LIBRARY_PATH"
        );
        let (major, minor) = nvrtc_version().unwrap();
        eprintln!("NVRTC {major}.{minor}");
        let ptx = compile("compute_90", &[]).unwrap();
        let ptx_text = String::from_utf8_lossy(&ptx.image);
        let cubin = compile("sm_90", &["--ptxas-options=-v"]).unwrap();
        assert_eq!(&cubin.image[..4], b"\x7fELF", "a CUBIN is an ELF image");
        for kernel in Kernel::ALL {
            assert!(
                ptx_text.contains(&format!(".entry {}(", kernel.name())),
                "PTX lacks {}",
                kernel.name()
            );
            assert!(
                cubin.log.contains(&format!("'{}'", kernel.name())),
                "ptxas log lacks {}:\n{}",
                kernel.name(),
                cubin.log
            );
        }
        assert!(
            spills(&cubin.log).is_empty(),
            "register spills:\n{}",
            cubin.log
        );
        eprintln!("{}", cubin.log);
    }

    #[test]
    fn only_elf_images_are_taken_from_the_kernel_cache() {
        assert!(looks_like_cubin(b"\x7fELF\x02\x01\x01"));
        assert!(!looks_like_cubin(b""));
        assert!(!looks_like_cubin(b"\x7fELF"));
        assert!(!looks_like_cubin(b".version 9.0"));
    }

    #[test]
    fn a_spill_in_the_ptxas_log_is_seen() {
        let log = "ptxas info    : Function properties for attention\n    \
                   8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
                   ptxas info    : Function properties for rope\n    \
                   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads";
        assert_eq!(spills(log).len(), 1);
    }

    fn gpu(precision: Precision) -> CudaBackend<Driver> {
        let driver = Driver::open(0).unwrap_or_else(|e| panic!("no GPU for this test: {e}"));
        CudaBackend::new(driver, precision)
    }

    #[test]
    #[ignore = "needs a CUDA GPU: run `cargo test -- --ignored gpu_` on a GPU machine"]
    fn gpu_matches_the_cpu_on_every_architecture_fixture() {
        every_fixture_matches(&gpu(Precision::F32));
    }

    #[test]
    #[ignore = "needs a CUDA GPU: run `cargo test -- --ignored gpu_` on a GPU machine"]
    fn gpu_matches_the_cpu_on_the_bundled_pairs() {
        bundled_pairs_match(&gpu(Precision::F32));
    }

    /// bf16 mode through cublasGemmEx on tensor cores.
    #[test]
    #[ignore = "needs a CUDA GPU: run `cargo test -- --ignored gpu_` on a GPU machine"]
    fn gpu_matches_the_cpu_in_bf16_on_every_architecture_fixture() {
        every_fixture_matches(&gpu(Precision::Bf16));
    }

    #[test]
    #[ignore = "needs a CUDA GPU: run `cargo test -- --ignored gpu_` on a GPU machine"]
    fn gpu_matches_the_cpu_in_bf16_on_the_bundled_pairs() {
        bundled_pairs_match(&gpu(Precision::Bf16));
    }

    /// The decode's held weights (the stored GEMV kernel) and device KV cache.
    #[test]
    #[ignore = "needs a CUDA GPU: run `cargo test -- --ignored gpu_` on a GPU machine"]
    fn gpu_decodes_as_transformers() {
        decodes_as_transformers(&gpu(Precision::F32));
    }

    #[test]
    #[ignore = "needs a CUDA GPU: run `cargo test -- --ignored gpu_` on a GPU machine"]
    fn gpu_stored_gemv_and_cached_attention_match_the_cpu() {
        for precision in [Precision::F32, Precision::Bf16] {
            stored_linear_matches(&gpu(precision));
        }
        // The device's expf may differ from the host's by 2 ulp (docs/reference/gpu.md).
        cached_attention_matches(&gpu(Precision::F32), 1e-5);
        cached_attention_matches(&gpu(Precision::Bf16), 2f32.powi(-8));
    }
}
