//! Analyses over checkpoints and over the paper's data: the sink-strength predictor, the paper's
//! weight-space controls (random-dW perturbation, norm-channel ablation, QK-norm injection) and
//! the small closed-form checks of its theory; drift norms between checkpoints.

pub mod ablate;
pub mod inject_qknorm;
pub mod norms;
pub mod perturb;
pub mod predict;
pub mod theory;
