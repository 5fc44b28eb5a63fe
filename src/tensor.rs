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

    /// Rows of the matrix view: the first dimension (1 for a vector).
    pub fn rows(&self) -> usize {
        if self.shape.len() >= 2 {
            self.shape[0]
        } else {
            1
        }
    }

    /// Columns of the matrix view: the product of the remaining dimensions.
    pub fn cols(&self) -> usize {
        if self.shape.len() >= 2 {
            self.shape[1..].iter().product()
        } else {
            self.data.len()
        }
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
        if !crate::checkpoint::dtype::is_float(info.dtype) {
            bail!(
                "{}: dtype {:?} is not floating point",
                self.describe(name),
                info.dtype
            );
        }
        Ok(Tensor::new(info.shape.clone(), self.read_f32(name)?))
    }
}
