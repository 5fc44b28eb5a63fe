//! Writing whole models from plans, above [`crate::checkpoint`]'s disk layer (the atomic output
//! directory and the sharded writer), which never calls up into them:
//! - [`rewrite`]: a copy of one checkpoint with some tensors recomputed from their stored bytes
//!   (the controls, head repair);
//! - [`graft`]: a language model written back into its VLM's layout, the inverse of the VLM
//!   family's extraction plan (`graft`, and `--into-vlm` through the merge and rewrite writers);
//! - [`model_card`]: the `README.md` every written model carries.

pub mod graft;
pub mod model_card;
pub mod rewrite;
