//! cohort-sim: a deterministic simulation of cohort's whole control plane.
//!
//! Several coordinator replicas run the real service code
//! ([`cohort_coordinator::server::start_with_incoming`]) over the real gRPC stack (tonic,
//! hyper, h2) on turmoil's simulated network; they share one memory store as they would
//! share etcd, on the simulated clock; simulated workers speak the real protocol through
//! the real client ([`cohort::control::ControlClient`]) and decide through the worker's real
//! membership machine (`cohort::elastic::membership`): they join, heartbeat, watch,
//! rendezvous, commit, report failures and leave, over a model of the data plane. A seed
//! decides everything: the cluster's shape, latencies, and a schedule of faults (replica
//! crash and restart, partitions, store outages and latency, worker crash and SIGSTOP-like
//! pauses, silent data links, clock jumps, latency spikes). Invariants are checked while it
//! runs and at the end; a run's trace (time, party, event) and its hash replay exactly.
//!
//! Entry points: [`run_seed`], and the `cohort-sim` binary (`replay --seed N`,
//! `explore --duration 10m`). See docs/testing.md.

mod clock;
mod ledger;
mod net;
mod relay;
mod ring;
mod run;
mod scenario;
mod store;
mod worker;

pub use cohort_coordinator::server::CascadeScope;
pub use run::{run_seed, Options, Report};
pub use scenario::{Fault, FaultMix, Scenario, Scheduled};
