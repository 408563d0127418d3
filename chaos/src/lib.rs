//! cohort-chaos: local clusters of real processes, fault injection, invariants, reports.
//!
//! - [`cluster`]: launches etcd (optional), coordinator replicas and `cohort-worker train`
//!   processes, each with its own log, and kills them all on exit.
//! - [`events`]: parses the workers' `key=value` event lines.
//! - [`metrics`]: scrapes the processes' Prometheus endpoints (`GET /metrics`), strictly.
//! - [`invariants`]: what must hold on every run (no wrong result, generations increase,
//!   committed steps never lost, ...).
//! - [`demo`]: the README's main command.
//! - [`scenario`]: scenarios as data (TOML files in `chaos/scenarios/`, seeded).
//! - [`netns`]: network namespaces as hosts; [`placement`]: which host each worker runs on.
//! - [`segments`]: the shared-memory segments and sockets a worker process still holds.
//! - [`proxy`]: the fault-injecting TCP proxy the data plane is routed through.
//! - [`runner`]: plays a scenario against a cluster and checks every invariant.
//! - [`report`]: per-fault measurements, statistics, the table and the JSON report.
//! - [`suite`]: `suite` (every scenario, or the quick ones) and `soak`.

pub mod binaries;
pub mod cluster;
pub mod demo;
pub mod events;
pub mod invariants;
pub mod metrics;
pub mod netns;
pub mod placement;
pub mod process;
pub mod proxy;
pub mod report;
pub mod runner;
pub mod scenario;
pub mod segments;
pub mod suite;
