//! Errors of the control-plane client.

/// What can go wrong talking to the coordinator.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ControlError {
    /// No coordinator endpoint answered within the retry budget.
    #[error("no coordinator reachable at {endpoints} after {attempts} attempts: {last}")]
    Unreachable {
        /// The endpoints tried, comma separated.
        endpoints: String,
        /// How many attempts were made.
        attempts: u32,
        /// The last error seen.
        last: String,
    },
    /// Every endpoint refused the connection from the first attempt on, for the client's
    /// `first_contact_wait`, and no coordinator has ever answered: most likely a wrong address.
    #[error(
        "nothing listens at {endpoints}: every connection was refused for {waited:.1?} ({last}); check the \
         coordinator address, or wait longer for a coordinator that starts later (cohort-worker \
         --coordinator-wait, Python coordinator_wait)"
    )]
    NothingListening {
        /// The endpoints tried, comma separated.
        endpoints: String,
        /// How long the client tried.
        waited: std::time::Duration,
        /// The last error seen.
        last: String,
    },
    /// No coordinator has ever answered and every endpoint failed as a wrong address does (a
    /// refused connection, a host name that does not resolve, a connect not answered), for the
    /// client's `first_contact_wait`.
    #[error(
        "no coordinator at {endpoints} after {waited:.1?}: {why}; check the coordinator address, or wait longer \
         for a coordinator that starts later (cohort-worker --coordinator-wait, Python coordinator_wait)"
    )]
    NoCoordinator {
        /// The endpoints tried, comma separated.
        endpoints: String,
        /// How long the client tried.
        waited: std::time::Duration,
        /// Each endpoint's last failure, and what it means.
        why: String,
    },
    /// The first endpoint to answer this client does not speak gRPC over HTTP/2: a wrong
    /// address (a plain HTTP server, a TLS server given as `http://`). Not retried.
    #[error(
        "{endpoint} is not a cohort coordinator: it does not speak gRPC over HTTP/2 (a plain HTTP server? a TLS \
         one, which needs https:// and --tls-ca?); check the coordinator address ({detail})"
    )]
    NotACoordinator {
        /// The endpoint that answered.
        endpoint: String,
        /// The transport's error.
        detail: String,
    },
    /// The coordinator answered with an error status (not retried).
    #[error("coordinator refused {rpc}: {code:?}: {message}")]
    Rejected {
        /// The RPC that was refused.
        rpc: &'static str,
        /// The gRPC status code.
        code: tonic::Code,
        /// The coordinator's message.
        message: String,
    },
    /// The coordinator refused a Join because this worker is excluded (its failures repeated);
    /// it may join again after `retry_after`.
    #[error("coordinator refused Join: {message} (retry after {retry_after:?})")]
    Excluded {
        /// The coordinator's message (failures, cool-down).
        message: String,
        /// Until the exclusion ends, as the coordinator counted it.
        retry_after: std::time::Duration,
    },
    /// The coordinator refused a Join because a live process holds this worker id (two
    /// processes were given one id). A holder that stays silent for `retry_after` counts as
    /// gone (this process restarted after its predecessor died): then the join succeeds.
    #[error("coordinator refused Join: {message}")]
    IdInUse {
        /// The coordinator's message (the holder's host and incarnation).
        message: String,
        /// When a silent holder would count as gone.
        retry_after: std::time::Duration,
    },
    /// The client configuration is unusable (bad endpoint URL, unreadable CA file, ...).
    #[error("invalid control-plane configuration: {0}")]
    Config(String),
}

impl ControlError {
    /// The gRPC code of a [`ControlError::Rejected`], if that is what this is.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            Self::Rejected { code, .. } => Some(*code),
            Self::Excluded { .. } => Some(tonic::Code::FailedPrecondition),
            Self::IdInUse { .. } => Some(tonic::Code::AlreadyExists),
            _ => None,
        }
    }

    /// The code of a request the coordinator refused as malformed: it changed nothing, and
    /// sending it again would be refused again (for crates that do not name tonic).
    pub const INVALID_ARGUMENT: tonic::Code = tonic::Code::InvalidArgument;
}
