//! cohort-coordinator: the control plane of cohort.
//!
//! A tonic gRPC service (`cohort.v1.Coordinator`) for membership, rendezvous, revocation
//! and status, over a [`store::Store`] (in-memory or etcd). Replicas keep no state of their
//! own: any replica serves any RPC, and one leader (elected on the store) runs the
//! formation timers and lease-lapse detection. Start one in-process with [`server::start`].
//!
//! Module map: [`config`] (settings), [`validate`] (request checks), [`keys`] and
//! [`records`] (store layout and values), [`rendezvous`], [`revocation`], [`exclusion`],
//! [`stragglers`] and [`digests`] (pure decision logic), [`ops`] (CAS mutations), [`hub`] (per-job live views),
//! [`service`] (the RPCs), [`leader`] (election and timers), [`metrics`], [`server`].

pub(crate) mod auth;
mod bounded;
pub mod config;
pub(crate) mod digests;
pub(crate) mod domains;
pub mod exclusion;
pub mod hub;
pub mod keys;
pub(crate) mod leader;
pub mod metrics;
pub mod ops;
pub mod records;
pub(crate) mod rendezvous;
pub(crate) mod revocation;
pub mod server;
pub mod service;
pub mod store;
pub mod stragglers;
pub mod validate;

pub use config::{JobSettings, Settings};
pub use server::{serve, start, ServeConfig, ServeError, ServerHandle};
