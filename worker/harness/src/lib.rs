//! cohort's harness code, kept out of the `cohort` library: what the `cohort-worker` binary,
//! the chaos harness (`cohort-chaos`) and the integration tests share to drive and verify
//! workers.
//!
//! - [`events`]: the worker-to-harness event protocol (the `event=KIND key=value ...` lines
//!   that `cohort-worker train` prints and the harness parses).
//! - [`exact`]: element types whose sums of small integers are exact, and the per-rank
//!   patterns `train` and `bench` verify every result against, bit for bit.
//! - [`trajectory`]: the parameters `cohort-worker train` trains, the sums that move them,
//!   and their digest.

pub mod events;
pub mod exact;
pub mod trajectory;
