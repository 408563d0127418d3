//! cohort-proto: the coordinator protocol (`proto/coordinator.proto`, package `cohort.v1`)
//! and its generated tonic client and server.
//!
//! The protocol is versioned by package name (`cohort.v1`) and by
//! [`PROTOCOL_VERSION`], which clients send in `JoinRequest.protocol_version`.

/// Generated messages, client (`coordinator_client`) and server (`coordinator_server`).
#[allow(missing_docs, clippy::all)]
pub mod v1 {
    tonic::include_proto!("cohort.v1");
}

pub mod credentials;
pub mod process_metrics;

/// Protocol version this crate speaks; the coordinator refuses joins from other versions.
pub const PROTOCOL_VERSION: u32 = 1;

/// The metadata key carrying the job token (`Bearer <token>`).
pub const AUTHORIZATION_HEADER: &str = "authorization";

/// The metadata key on a refused `Join` of an excluded worker (FAILED_PRECONDITION):
/// milliseconds until its exclusion ends (decimal). A worker waits that long and joins
/// again. On a `Join` refused because a live process holds the worker id (ALREADY_EXISTS):
/// how long until that holder, if it stays silent, counts as gone.
pub const RETRY_AFTER_MS_HEADER: &str = "cohort-retry-after-ms";

/// The metadata key on a `Status` answered NOT_FOUND (the job does not exist): the name of
/// the replica that leads now (absent when none does).
pub const LEADER_HEADER: &str = "cohort-leader";

pub use v1::coordinator_client::CoordinatorClient;
pub use v1::coordinator_server::{Coordinator, CoordinatorServer};
