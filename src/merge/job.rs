//! One output tensor's work: where its inputs are, and block-wise access to them.
//!
//! Methods read their inputs a row block at a time (about 1 MB of f32 per input), decoded from
//! the mmap'd checkpoints, so a 7B-class MLP matrix never exists in memory more than once (as
//! the encoded output). Block boundaries depend only on the tensor's shape, never on the thread
//! count, and per-block results are combined in block order, so outputs are identical at any
//! thread count.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut, Range};

use rayon::prelude::*;
use safetensors::Dtype;

use crate::arch::names::{self, Module};
use crate::checkpoint::Checkpoint;
use crate::dtype;
use crate::error::Result;
use crate::tensor::{matrix_shape, Tensor};

/// Elements per block (per input). Blocks hold whole rows, at least one.
pub const BLOCK_ELEMS: usize = 1 << 18;

thread_local! {
    static POOL: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// A block-sized f32 buffer from a per-thread pool. Blocks are processed by the thousand, and a
/// fresh 1 MB allocation each time would cost page faults (glibc maps such sizes anew).
pub struct Scratch(Vec<f32>);

impl Scratch {
    /// A buffer of `n` zeros.
    pub fn zeroed(n: usize) -> Scratch {
        let mut s = Scratch::for_overwrite(n);
        s.fill(0.0);
        s
    }

    /// A buffer of `n` values left over from earlier use, for callers that overwrite all of it
    /// (decoding) and so need not pay for zeroing.
    pub fn for_overwrite(n: usize) -> Scratch {
        let mut v = POOL.with(|p| p.borrow_mut().pop()).unwrap_or_default();
        if v.len() < n {
            v.resize(n, 0.0);
        }
        v.truncate(n);
        Scratch(v)
    }
}

impl Deref for Scratch {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        POOL.with(|p| {
            let mut pool = p.borrow_mut();
            if pool.len() < 32 {
                pool.push(v);
            }
        });
    }
}

/// One input tensor of a job: the model, the stored tensor (the embedding for a tied lm_head),
/// and how many leading rows are used (vocabulary tensors may be cropped).
pub struct Source<'a> {
    pub ckpt: &'a Checkpoint,
    pub tensor: String,
    pub dtype: Dtype,
}

impl Source<'_> {
    /// Decode elements `[start, start + out.len())` (row-major flat indices) into `out`.
    fn read(&self, start: usize, out: &mut [f32]) -> Result<()> {
        let size = dtype::byte_size(self.dtype);
        let bytes = self.ckpt.bytes(&self.tensor)?;
        let range = start * size..(start + out.len()) * size;
        dtype::decode_into(
            self.dtype,
            &bytes[range],
            out,
            &self.ckpt.describe(&self.tensor),
        )
    }

    /// "model: tensor `x`" (with the file) for messages.
    pub fn describe(&self) -> String {
        self.ckpt.describe(&self.tensor)
    }
}

/// Everything needed to compute one output tensor.
pub struct TensorJob<'a> {
    /// Output tensor name.
    pub name: String,
    /// Output shape (inputs with more vocabulary rows are cropped to it).
    pub shape: Vec<usize>,
    pub out_dtype: Dtype,
    /// The base model's tensor, for task-vector methods.
    pub base: Option<Source<'a>>,
    /// The merged models' tensors, in input order (task models for task-vector methods).
    pub models: Vec<Source<'a>>,
}

impl<'a> TensorJob<'a> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Rows of the matrix view (see [`matrix_shape`]).
    pub fn rows(&self) -> usize {
        matrix_shape(&self.shape).0
    }

    /// Columns of the matrix view (see [`matrix_shape`]).
    pub fn cols(&self) -> usize {
        matrix_shape(&self.shape).1
    }

    /// What kind of tensor this is, by the standard name grammar.
    pub fn module(&self) -> Option<Module> {
        names::parse(&self.name).map(|n| n.module)
    }

    /// Token embedding or output head (rows indexed by vocabulary).
    pub fn is_vocab(&self) -> bool {
        self.module().is_some_and(Module::is_vocab)
    }

    fn base_source(&self) -> &Source<'a> {
        self.base
            .as_ref()
            .expect("task-vector methods are planned with a base")
    }

    /// Row blocks covering the tensor, as flat element ranges.
    pub fn blocks(&self) -> Vec<Range<usize>> {
        let cols = self.cols().max(1);
        let rows_per_block = (BLOCK_ELEMS / cols).max(1);
        let n = self.numel();
        (0..self.rows())
            .step_by(rows_per_block)
            .map(|r| r * cols..((r + rows_per_block) * cols).min(n))
            .collect()
    }

    /// Run `f` on every block in parallel; results come back in block order.
    pub fn map_blocks<T, F>(&self, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(&Block<'_, 'a>) -> Result<T> + Sync,
    {
        self.blocks()
            .into_par_iter()
            .map(|range| f(&Block { job: self, range }))
            .collect()
    }

    /// Compute the output block by block with `f(block, out)` (out is the block's f32 values) and
    /// encode it in the output dtype. Fails, naming the inputs, if a value is NaN or infinite.
    pub fn produce<F>(&self, f: F) -> Result<Vec<u8>>
    where
        F: Fn(&Block<'_, 'a>, &mut [f32]) -> Result<()> + Sync,
    {
        let size = dtype::byte_size(self.out_dtype);
        let mut bytes = vec![0u8; self.numel() * size];
        let blocks = self.blocks();
        let mut chunks: Vec<&mut [u8]> = Vec::with_capacity(blocks.len());
        let mut rest = bytes.as_mut_slice();
        for range in &blocks {
            let (head, tail) = rest.split_at_mut(range.len() * size);
            chunks.push(head);
            rest = tail;
        }
        blocks
            .into_par_iter()
            .zip(chunks)
            .try_for_each(|(range, chunk)| {
                let block = Block { job: self, range };
                let mut values = Scratch::zeroed(block.len());
                f(&block, &mut values)?;
                self.check_finite(&block, &values)?;
                dtype::encode_into(self.out_dtype, &values, chunk)
            })?;
        Ok(bytes)
    }

    /// Task vector `models[i] - base` as f32 (whole), from [`Block::delta`] a block at a time:
    /// whole copies of the model and the base would cost their size in fresh pages per task.
    pub fn read_delta(&self, i: usize) -> Result<Tensor> {
        let mut data = vec![0f32; self.numel()];
        for range in self.blocks() {
            let block = Block { job: self, range };
            data[block.range.clone()].copy_from_slice(&block.delta(i)?);
        }
        Ok(Tensor::new(self.shape.clone(), data))
    }

    fn check_finite(&self, block: &Block<'_, 'a>, values: &[f32]) -> Result<()> {
        if values.iter().all(|v| v.is_finite()) {
            return Ok(());
        }
        // Name the input that carries NaN/Inf, or say the arithmetic overflowed.
        for source in self.base.iter().chain(&self.models) {
            let mut buf = Scratch::for_overwrite(block.len());
            source.read(block.range.start, &mut buf)?;
            if let Some(k) = buf.iter().position(|v| !v.is_finite()) {
                return Err(crate::non_finite!(
                    "{}: holds {} at flat index {}; merging would spread it into `{}`",
                    source.describe(),
                    buf[k],
                    block.range.start + k,
                    self.name
                ));
            }
        }
        let k = values.iter().position(|v| !v.is_finite()).unwrap_or(0);
        Err(crate::non_finite!(
            "merged tensor `{}` overflows to {} at flat index {} (all inputs are finite; check weights and lambda)",
            self.name,
            values[k],
            block.range.start + k
        ))
    }
}

/// A contiguous range of a job's elements (whole rows).
pub struct Block<'j, 'a> {
    pub job: &'j TensorJob<'a>,
    /// Flat element range within the output tensor.
    pub range: Range<usize>,
}

impl Block<'_, '_> {
    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Flat index of the first element.
    pub fn start(&self) -> usize {
        self.range.start
    }

    /// Rows of this block in the tensor's matrix view.
    pub fn rows(&self) -> Range<usize> {
        let cols = self.job.cols().max(1);
        self.range.start / cols..self.range.end / cols
    }

    pub fn base(&self) -> Result<Scratch> {
        let mut out = Scratch::for_overwrite(self.len());
        self.job.base_source().read(self.range.start, &mut out)?;
        Ok(out)
    }

    /// Model `i`'s values.
    pub fn model(&self, i: usize) -> Result<Scratch> {
        let mut out = Scratch::for_overwrite(self.len());
        self.job.models[i].read(self.range.start, &mut out)?;
        Ok(out)
    }

    /// Task vector of model `i`: `model - base` in f32.
    pub fn delta(&self, i: usize) -> Result<Scratch> {
        let base = self.base()?;
        self.delta_from(i, &base)
    }

    /// Task vector of model `i` given this block's base values.
    pub fn delta_from(&self, i: usize, base: &[f32]) -> Result<Scratch> {
        let mut d = self.model(i)?;
        for (x, b) in d.iter_mut().zip(base) {
            *x -= b;
        }
        Ok(d)
    }

    /// Every task vector of this block, given its base values.
    pub fn deltas_from(&self, base: &[f32]) -> Result<Vec<Scratch>> {
        (0..self.job.models.len())
            .map(|i| self.delta_from(i, base))
            .collect()
    }
}
