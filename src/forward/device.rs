//! Where the scorer computes (`--device`): the CPU or an NVIDIA GPU, and the one dispatch that
//! runs a scoring job on the backend of the chosen device (`docs/reference/gpu.md`).

use std::time::Instant;

use serde::Serialize;

use super::backend::cpu::{keep_freed_buffers, CpuBackend};
use super::backend::cuda::driver::{Driver, Timings};
use super::backend::cuda::{CudaBackend, Device as _};
use super::backend::Backend;
use super::precision::Precision;
use crate::error::Result;

/// Where a command computes (`--device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputeDevice {
    /// The CPU.
    Cpu,
    /// The NVIDIA GPU of this index.
    Cuda(usize),
}

impl std::str::FromStr for ComputeDevice {
    type Err = String;

    fn from_str(s: &str) -> Result<ComputeDevice, String> {
        match s {
            "cpu" => Ok(ComputeDevice::Cpu),
            "cuda" => Ok(ComputeDevice::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(ComputeDevice::Cuda)
                .ok_or_else(|| format!("`{s}` is not a device: use cpu, cuda or cuda:N")),
        }
    }
}

impl std::fmt::Display for ComputeDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ComputeDevice::Cpu => write!(f, "cpu"),
            ComputeDevice::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl Serialize for ComputeDevice {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Work that runs on whichever backend `--device` chose.
pub trait BackendJob {
    type Output;

    fn run<B: Backend>(self, backend: &B) -> Result<Self::Output>;
}

/// What a GPU run reports besides its results.
#[derive(Debug, Serialize)]
pub struct GpuReport {
    /// The GPU's name and index.
    pub device: String,
    /// Arithmetic of the forward pass (f32 GEMMs with TF32 off in both).
    pub precision: Precision,
    pub total_memory_bytes: usize,
    #[serde(flatten)]
    pub timings: Timings,
    /// Wall time of the whole job (set-up excluded): for `score`, the --text pass included.
    pub score_s: f64,
}

impl ComputeDevice {
    /// Run `job` on this device in `precision`; a GPU run also reports the GPU, its memory and
    /// where the time went.
    pub fn run<J: BackendJob>(
        self,
        precision: Precision,
        job: J,
    ) -> Result<(J::Output, Option<GpuReport>)> {
        match self {
            ComputeDevice::Cpu => {
                keep_freed_buffers();
                Ok((job.run(&CpuBackend::new(precision))?, None))
            }
            ComputeDevice::Cuda(ordinal) => {
                let backend = CudaBackend::new(Driver::open(ordinal)?, precision);
                let started = Instant::now();
                let output = job.run(&backend)?;
                let driver = backend.device();
                let gpu = GpuReport {
                    device: driver.describe(),
                    precision,
                    total_memory_bytes: driver.total_memory()?,
                    timings: driver.timings(),
                    score_s: started.elapsed().as_secs_f64(),
                };
                Ok((output, Some(gpu)))
            }
        }
    }
}
