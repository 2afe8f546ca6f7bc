//! teraio's lifetime planner and simulator: from a trace of one training iteration it decides,
//! per tensor and inactive period, whether to offload it (to SSD or host memory) and when to bring
//! it back, so that the iteration fits in GPU memory and the GPU does not wait (TERAIO, arXiv
//! 2506.06472, §3.2). Needs no GPU and no engine.
//!
//! Pipeline: [`trace`] (or [`synth`]) → [`lifetime`] → [`greedy`] (with [`ledger`]) → [`plan`] →
//! [`sim`] (with [`baselines`] to compare against, [`report`]). [`predict::plan_and_predict`] is
//! the one call every interface uses: the `teraio` command (the cli crate, which also holds the
//! tables and plots), Python and C.

pub mod baselines;
pub mod error;
pub mod greedy;
pub mod hardware;
pub mod ledger;
pub mod lifetime;
pub mod plan;
pub mod predict;
pub mod pressure;
pub mod replay;
pub mod report;
pub mod sim;
pub mod synth;
pub mod trace;

pub use error::{Error, Result};
