//! cohort-chaos: local clusters of real processes, fault injection, invariants, reports.
//!
//! - [`cluster`]: launches etcd (optional), coordinator replicas and `cohort-worker train`
//!   processes, each with its own log, and kills them all on exit.
//! - [`events`]: parses the workers' `key=value` event lines.
//! - [`invariants`]: what must hold on every run (no wrong result, generations increase,
//!   committed steps never lost, ...).
//! - [`demo`]: the README's main command.

pub mod binaries;
pub mod cluster;
pub mod demo;
pub mod events;
pub mod invariants;
pub mod process;
