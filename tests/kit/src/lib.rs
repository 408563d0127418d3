//! cohort-testkit: what cohort's tests and its chaos harness run against, kept out of the
//! production crates.
//!
//! - [`sim`]: an in-memory network implementing [`cohort_transports::Transport`], which can
//!   cut, stall, delay, isolate and crash links deterministically under tokio's paused clock.
//!   The collective schedules are tested on it (`worker/tests/collectives_sim.rs`).
//! - [`etcd`]: a single-member etcd server run as a child process on free loopback ports and
//!   a temporary directory, stoppable, killable and restartable (the coordinator's store tests,
//!   the chaos harness, the integration tests).

pub mod etcd;
pub mod sim;
