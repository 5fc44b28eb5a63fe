//! The thin layer through which the CUDA backend reaches a device: memory, copies, kernel launch
//! and one cuBLAS GEMM. [`super::driver::Driver`] implements it with cudarc; the tests implement
//! it on the host (kernels through the shim, GEMM through a column-major reference), so the
//! whole GPU scorer's code path runs, and is checked, on machines without a GPU.

use std::ops::Range;

use crate::error::Result;

/// The kernels of `kernels.cu`, by entry-point name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    RoundBf16,
    NarrowBf16,
    WidenBf16,
    WidenF16,
    StoredGemvPartials,
    StoredGemvSum,
    RmsNormRows,
    AddBias,
    ClampValues,
    Rope,
    Attention,
    CacheWrite,
    AttentionCached,
    LayerNormRows,
    Activate,
    ScaleColumns,
    ActMul,
    AddAssign,
    FlagNonFinite,
    GatherRows,
    ScatterAddRows,
}

impl Kernel {
    pub const ALL: [Kernel; 21] = [
        Kernel::RoundBf16,
        Kernel::NarrowBf16,
        Kernel::WidenBf16,
        Kernel::WidenF16,
        Kernel::StoredGemvPartials,
        Kernel::StoredGemvSum,
        Kernel::RmsNormRows,
        Kernel::AddBias,
        Kernel::ClampValues,
        Kernel::Rope,
        Kernel::Attention,
        Kernel::CacheWrite,
        Kernel::AttentionCached,
        Kernel::LayerNormRows,
        Kernel::Activate,
        Kernel::ScaleColumns,
        Kernel::ActMul,
        Kernel::AddAssign,
        Kernel::FlagNonFinite,
        Kernel::GatherRows,
        Kernel::ScatterAddRows,
    ];

    /// The `extern "C"` name in `kernels.cu`.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::RoundBf16 => "round_values_bf16",
            Kernel::NarrowBf16 => "narrow_bf16",
            Kernel::WidenBf16 => "widen_bf16",
            Kernel::WidenF16 => "widen_f16",
            Kernel::StoredGemvPartials => "stored_gemv_partials",
            Kernel::StoredGemvSum => "stored_gemv_sum",
            Kernel::RmsNormRows => "rms_norm_rows",
            Kernel::AddBias => "add_bias",
            Kernel::ClampValues => "clamp_values",
            Kernel::Rope => "rope",
            Kernel::Attention => "attention",
            Kernel::CacheWrite => "cache_write",
            Kernel::AttentionCached => "attention_cached",
            Kernel::LayerNormRows => "layer_norm_rows",
            Kernel::Activate => "activate",
            Kernel::ScaleColumns => "scale_columns",
            Kernel::ActMul => "act_mul",
            Kernel::AddAssign => "add_assign",
            Kernel::FlagNonFinite => "flag_non_finite",
            Kernel::GatherRows => "gather_rows",
            Kernel::ScatterAddRows => "scatter_add_rows",
        }
    }
}

/// The CUDA C source of every kernel.
pub const KERNELS_CU: &str = include_str!("kernels.cu");

/// Threads per block of every launch.
pub const BLOCK: u32 = 256;

/// One kernel argument, in the kernel's parameter order. Buffers are passed as device pointers;
/// `Mut` marks the ones the kernel writes.
pub enum Arg<'a, B> {
    Ref(&'a B),
    Mut(&'a mut B),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// cuBLAS's operand transposition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `N`: the operand as stored.
    None,
    /// `T`: its transpose.
    Transpose,
}

/// `C = op(A) · op(B)` in cuBLAS's column-major convention (`cublasSgemm` or `cublasGemmEx` with
/// alpha 1 and beta 0): `op(A)` is `m x k`, `op(B)` is `k x n`, `C` is `m x n`, each stored column-major
/// with leading dimensions `lda`, `ldb`, `ldc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemm {
    pub transa: Op,
    pub transb: Op,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
}

impl Gemm {
    /// `nn.Linear` on row-major data: `Y[rows, out] = X[rows, in] · W[out, in]ᵀ`. Read
    /// column-major, the row-major `W` is `Wᵀ` (`in x out`, leading dimension `in`) and `X` is
    /// `Xᵀ`, so `Yᵀ = op_T(Wᵀ-as-stored) · Xᵀ`: A = W with `T`, B = X with `N`, and `Yᵀ`
    /// (`out x rows`, leading dimension `out`) is the row-major `Y`.
    pub fn linear(rows: usize, out: usize, inp: usize) -> Gemm {
        Gemm {
            transa: Op::Transpose,
            transb: Op::None,
            m: out,
            n: rows,
            k: inp,
            lda: inp,
            ldb: inp,
            ldc: out,
        }
    }

    /// Rows and columns of an operand as stored (column-major), given its op and its
    /// `op(X)` shape.
    fn stored(op: Op, rows: usize, cols: usize) -> (usize, usize) {
        match op {
            Op::None => (rows, cols),
            Op::Transpose => (cols, rows),
        }
    }

    /// cuBLAS's argument checks (leading dimensions at least the stored rows), and that each
    /// buffer of `len_*` values (of the operand's type) holds its operand (which cuBLAS cannot
    /// check).
    pub fn validate(&self, len_a: usize, len_b: usize, len_c: usize) -> Result<()> {
        let a = Gemm::stored(self.transa, self.m, self.k);
        let b = Gemm::stored(self.transb, self.k, self.n);
        let c = (self.m, self.n);
        for (what, (rows, cols), ld, len) in [
            ("A", a, self.lda, len_a),
            ("B", b, self.ldb, len_b),
            ("C", c, self.ldc, len_c),
        ] {
            if ld < rows.max(1) {
                return Err(crate::error::Error::Internal(format!(
                    "GEMM {self:?}: leading dimension of {what} is {ld}, less than its {rows} rows"
                )));
            }
            let need = if cols == 0 { 0 } else { ld * (cols - 1) + rows };
            if len < need {
                return Err(crate::error::Error::Internal(format!(
                    "GEMM {self:?}: {what} needs {need} values, its buffer has {len}"
                )));
            }
        }
        Ok(())
    }
}

/// Memory, copies, launches and GEMMs on one device. Buffers are untyped bytes; kernels and the
/// GEMM read them as the types their parameters name.
///
/// Two queues: the compute stream, on which every method but [`Device::upload_async`] runs in
/// call order, and a copy stream for weights. A buffer from `upload_async` holds its bytes only
/// once the compute stream has waited for its event ([`Device::wait`]); before that its contents
/// are undefined (`docs/reference/gpu.md`, "Two streams").
pub trait Device: Sync {
    type Buffer: Send + Sync;
    /// The point on the copy stream after one copy.
    type Event: Send + Sync;

    /// The device, for reports (`"NVIDIA H200 (cuda:0)"`).
    fn describe(&self) -> String;

    /// `bytes` of zeros.
    fn zeros(&self, bytes: usize) -> Result<Self::Buffer>;

    /// A copy of `host` on the device.
    fn upload(&self, host: &[u8]) -> Result<Self::Buffer>;

    /// A new buffer that the copy stream fills with `host`, asynchronously, and the event that
    /// completes with the copy. `host` is staged before this returns (it may be released then).
    fn upload_async(&self, host: &[u8]) -> Result<(Self::Buffer, Self::Event)>;

    /// Order the compute stream's later work after `event`.
    fn wait(&self, event: &Self::Event) -> Result<()>;

    /// Bytes `range` of `buf`, on the host.
    fn download(&self, buf: &Self::Buffer, range: Range<usize>) -> Result<Vec<u8>>;

    /// Copy `bytes` bytes from `src` at `src_at` into `dst` at `dst_at`.
    fn copy(
        &self,
        src: &Self::Buffer,
        src_at: usize,
        dst: &mut Self::Buffer,
        dst_at: usize,
        bytes: usize,
    ) -> Result<()>;

    /// Run `kernel` with `threads` threads (`ceil(threads / BLOCK)` blocks of [`BLOCK`]).
    fn launch(
        &self,
        kernel: Kernel,
        threads: usize,
        args: &mut [Arg<'_, Self::Buffer>],
    ) -> Result<()>;

    /// `c = op(a) · op(b)` on f32 buffers, as [`Gemm`] says: `cublasSgemm` with TF32 off.
    fn gemm(
        &self,
        gemm: &Gemm,
        a: &Self::Buffer,
        b: &Self::Buffer,
        c: &mut Self::Buffer,
    ) -> Result<()>;

    /// The same product with `a` and `b` of bf16 values (16 bits each) and `c` of f32:
    /// `cublasGemmEx` with `CUDA_R_16BF` operands, an f32 output and `CUBLAS_COMPUTE_32F`, which
    /// runs on tensor cores. Products of bf16 values are exact in f32; only the order of the f32
    /// sums is the library's.
    fn gemm_bf16(
        &self,
        gemm: &Gemm,
        a: &Self::Buffer,
        b: &Self::Buffer,
        c: &mut Self::Buffer,
    ) -> Result<()>;
}
