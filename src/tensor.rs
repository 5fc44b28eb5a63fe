//! A decoded f32 tensor: the unit of work for norms, merges and controls.

use faer::MatRef;

use crate::bail;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape {shape:?} vs {} values",
            data.len()
        );
        Tensor { shape, data }
    }

    pub fn zeros(shape: Vec<usize>) -> Tensor {
        let n = shape.iter().product();
        Tensor {
            shape,
            data: vec![0.0; n],
        }
    }

    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Rows of the matrix view (see [`matrix_shape`]).
    pub fn rows(&self) -> usize {
        matrix_shape(&self.shape).0
    }

    /// Columns of the matrix view (see [`matrix_shape`]).
    pub fn cols(&self) -> usize {
        matrix_shape(&self.shape).1
    }

    /// Row-major matrix view (`[out, in]` for a linear weight).
    pub fn mat(&self) -> MatRef<'_, f32> {
        MatRef::from_row_major_slice(&self.data, self.rows(), self.cols())
    }
}

impl Checkpoint {
    /// Decode a floating-point tensor with its shape.
    pub fn read_tensor(&self, name: &str) -> Result<Tensor> {
        let info = self.require(name)?;
        if !crate::dtype::is_float(info.dtype) {
            bail!(
                "{}: dtype {:?} is not floating point",
                self.describe(name),
                info.dtype
            );
        }
        Ok(Tensor::new(info.shape.clone(), self.read_f32(name)?))
    }
}

/// `(rows, cols)` of a tensor viewed as a matrix: the first dimension by the product of the
/// others (`[out, in]` for a linear weight); a vector (or a scalar) is one row.
pub fn matrix_shape(shape: &[usize]) -> (usize, usize) {
    match shape {
        [rows, rest @ ..] if !rest.is_empty() => (*rows, rest.iter().product()),
        _ => (1, shape.iter().product()),
    }
}
