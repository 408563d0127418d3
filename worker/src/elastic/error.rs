//! Errors of the elastic runtime.

use crate::control::ControlError;
use crate::CommError;
use cohort_transports::TransportError;

/// What ends an elastic worker's participation (as opposed to a failed generation, which
/// the runtime survives by re-forming).
#[derive(Debug, Clone, thiserror::Error)]
pub enum ElasticError {
    /// The coordinator could not be reached, or refused a request.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// The data-plane listener could not be set up.
    #[error("data plane: {0}")]
    DataPlane(#[from] TransportError),
    /// The RDMA endpoint could not be opened (no device, the named device missing, no
    /// active port, ...): the worker does not join.
    #[error("rdma endpoint on {device}: {source}")]
    RdmaEndpoint {
        /// The device asked for, or "the first device with an active port".
        device: String,
        /// Why it failed.
        #[source]
        source: TransportError,
    },
    /// The transport asked for cannot be used in this build (`rdma` without the `rdma`
    /// feature): the worker does not join.
    #[error(transparent)]
    TransportUnavailable(#[from] TransportUnavailable),
    /// This worker stayed excluded (its failures repeated) for longer than
    /// [`super::ElasticConfig::exclusion_wait`] allows it to wait.
    #[error("excluded by the coordinator for longer than this worker waits ({waited:?} waited, {retry_after:?} left, limit {limit:?}): {message}")]
    Excluded {
        /// The coordinator's last refusal.
        message: String,
        /// What was left of the exclusion then.
        retry_after: std::time::Duration,
        /// How long this worker had waited already.
        waited: std::time::Duration,
        /// The limit, [`super::ElasticConfig::exclusion_wait`].
        limit: std::time::Duration,
    },
    /// The job ended (finished, or failed with the coordinator's reason).
    #[error("job ended ({outcome}): {reason}")]
    JobEnded {
        /// "finished" or "failed".
        outcome: &'static str,
        /// The coordinator's reason.
        reason: String,
    },
    /// After a restore, ranks hold different state (their digests differ).
    #[error("state diverged after restore: {0}")]
    StateDiverged(String),
    /// A collective failed in a way that is not a peer failure (a bug or misuse).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The credential given is another job's (checked at join, before anything is sent).
    #[error("credential: {0}")]
    Credential(#[from] cohort_proto::credentials::CredentialError),
    /// The coordinator sent something that violates the protocol.
    #[error("coordinator protocol violation: {0}")]
    Protocol(String),
    /// The job or worker id breaks cohort's rule for ids: [`super::JobId::new`] and
    /// [`super::WorkerId::new`] refuse it, so no configuration holds it and nothing is
    /// contacted with it.
    #[error(transparent)]
    InvalidId(#[from] cohort_proto::ids::IdError),
    /// A configuration value cannot be used (the message names the field and why); nothing
    /// was contacted.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
}

/// Why a [`super::TransportChoice`] cannot be used on this machine or in this build.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransportUnavailable {
    /// `shm`: this process's host identity (boot id, namespaces) cannot be read.
    #[error("transport shm: {0}")]
    NoHostIdentity(String),
    /// `rdma` in a build without the `rdma` cargo feature.
    #[error(
        "transport rdma: this build of cohort lacks the `rdma` feature \
         (cargo build --release -p cohort-worker --features rdma; the Python package: maturin with --features rdma)"
    )]
    RdmaNotBuilt,
    /// `rdma`: the device list could not be read.
    #[error("transport rdma: {0}")]
    RdmaDevices(String),
    /// `rdma`: no RDMA device is present.
    #[error("transport rdma: no RDMA device found (is an InfiniBand/RoCE NIC present and its driver loaded?)")]
    NoRdmaDevice,
}
