//! cohort-coordinator: the control plane of cohort.
//!
//! A tonic gRPC service (`cohort.v1.Coordinator`) for membership, rendezvous, revocation
//! and status, over a [`store::Store`] (in-memory or etcd). Replicas keep no state of their
//! own: any replica serves any RPC, and one leader (elected on the store) runs the
//! formation timers and lease-lapse detection. Start one in-process with [`server::start`].
//!
//! # Public surface
//!
//! What an embedding program needs: [`server`] ([`start`], [`serve`], [`ServeConfig`]),
//! [`config`] (job settings and the policies they name) and [`store`] (the [`store::Store`]
//! trait, its memory and etcd backends, and [`store::StoreSpec`], the `--store` flag);
//! [`status_summary`] and [`status_view`] (a job's status summarised, and as JSON); and what a
//! launcher needs: [`announce`] (the address lines `serve` prints).
//!
//! # Internals and the `test-support` feature
//!
//! The other modules are the coordinator's implementation: `validate` (request checks),
//! `keys` and `records` (store layout and values), `rendezvous`, `revocation`, `report`,
//! `exclusion`, `stragglers` and `digests` (pure decision logic), `ops` (CAS mutations),
//! `hub` (per-job live views), `kv` (a job's key-value store, torch's c10d store), `service` (the RPCs), `leader` (election and timers),
//! `sweep` (silent members on hosts' shared leases),
//! `metrics` and `status_page` (the metrics listener's `/metrics` and live status page). They are private unless the `test-support` feature is on, which makes the
//! ones the coordinator's own tests, benchmarks and the simulation (`cohort-sim`) reach into
//! public, as tokio's `test-util` does. That feature is not part of the stable API: anything
//! under it may change in any release, and nothing outside this workspace should enable it.

pub mod announce;
pub(crate) mod auth;
mod bounded;
pub mod config;
pub(crate) mod digests;
pub(crate) mod domains;
pub(crate) mod leader;
pub(crate) mod rendezvous;
pub(crate) mod report;
pub(crate) mod revocation;
pub mod server;
pub mod status_summary;
pub mod status_view;
pub mod store;
pub(crate) mod sweep;

/// Declares the internal modules: public under `test-support` (see the crate documentation),
/// private otherwise. Their items are `pub` for the feature's sake, so without it some are
/// unused outside tests.
macro_rules! internal_modules {
    ($($name:ident),* $(,)?) => {$(
        #[cfg(feature = "test-support")]
        pub mod $name;
        #[cfg(not(feature = "test-support"))]
        #[allow(dead_code, unreachable_pub)]
        mod $name;
    )*};
}

internal_modules!(exclusion, hub, keys, kv, metrics, ops, records, service, status_page, stragglers, validate);

pub use config::{ExclusionPolicy, JobSettings, LeaseScope, Settings, StragglerPolicy};
pub use server::{serve, start, ServeConfig, ServeError, ServerHandle};
/// Checks a job or worker id as the coordinator does (1..=128 characters of `[A-Za-z0-9._-]`).
pub use validate::id as check_id;
