//! Analyses over checkpoints and over the paper's data: the sink-strength predictor, the paper's
//! weight-space controls (random-dW perturbation, norm-channel ablation, QK-norm injection) and
//! the small closed-form checks of its theory; drift norms between checkpoints; the per-head
//! diagnosis that joins each head's sink to its weight drift; what a checkpoint is (`inspect`).

pub mod ablate;
pub mod heads;
pub mod inject_qknorm;
pub mod inspect;
pub mod norms;
pub mod perturb;
pub mod predict;
pub mod repair_heads;
pub mod theory;
