//! What a failed attempt's transport error says about the endpoint: a wrong address (nothing
//! listens, the name does not resolve, the connect is not answered), something that is not a
//! cohort coordinator, or an outage of one.

use tonic::{Code, Status};

/// Why an attempt reached no coordinator, as its transport error tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Unreached {
    /// The connection was refused: nothing listens at the address.
    Refused,
    /// The host name does not resolve.
    NoSuchHost,
    /// The TCP connect was not answered within the connect timeout (a black-holed address).
    ConnectTimedOut,
    /// The peer answered with bytes that are not HTTP/2: a plain HTTP/1 server, a TLS server
    /// spoken to in plain text, anything but a cohort coordinator's gRPC.
    NotGrpc,
    /// Anything else: no answer to a request, a replica not ready, a broken connection.
    Other,
}

impl Unreached {
    /// Classifies a failed attempt's status. A status the coordinator sent (no transport
    /// error behind it) is [`Unreached::Other`].
    pub(super) fn of(status: &Status) -> Self {
        let chain = chain(status);
        let io_kind = |kind: std::io::ErrorKind| {
            chain.iter().any(|e| e.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == kind))
        };
        let says = |what: &str| chain.iter().any(|e| e.to_string().contains(what));
        if io_kind(std::io::ErrorKind::ConnectionRefused) || status.message().contains("Connection refused") {
            return Self::Refused;
        }
        // Nothing below is a coordinator's own status: each needs a transport error.
        if !chain.iter().any(|e| e.downcast_ref::<tonic::transport::Error>().is_some()) {
            return Self::Other;
        }
        if says("dns error") || says("failed to lookup address") {
            return Self::NoSuchHost;
        }
        if says("tcp connect error") && io_kind(std::io::ErrorKind::TimedOut) {
            return Self::ConnectTimedOut;
        }
        // h2 found the peer's bytes malformed as HTTP/2 frames (it sends GOAWAY, "connection
        // error detected"): a coordinator never does that.
        if matches!(status.code(), Code::Internal | Code::Unknown) && says("connection error detected") {
            return Self::NotGrpc;
        }
        Self::Other
    }

    /// Whether it is what a wrong address gives: retried only for the client's
    /// `first_contact_wait` while no coordinator has answered.
    pub(super) fn is_wrong_address(self) -> bool {
        matches!(self, Self::Refused | Self::NoSuchHost | Self::ConnectTimedOut)
    }

    /// What it means, for logs and errors.
    pub(super) fn describe(self) -> &'static str {
        match self {
            Self::Refused => "the connection was refused (nothing listens there)",
            Self::NoSuchHost => "the host name does not resolve",
            Self::ConnectTimedOut => "the connect was not answered within the connect timeout",
            Self::NotGrpc => {
                "it does not speak gRPC over HTTP/2 (not a cohort coordinator: a plain HTTP server, or a TLS one \
                 given as http://)"
            }
            Self::Other => "no answer from a coordinator",
        }
    }
}

/// The status and every error behind it.
fn chain(status: &Status) -> Vec<&(dyn std::error::Error + 'static)> {
    let mut out: Vec<&(dyn std::error::Error + 'static)> = vec![status];
    while let Some(next) = out.last().and_then(|e| e.source()) {
        out.push(next);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::Unreached;
    use tonic::Status;

    #[test]
    fn a_coordinators_own_status_is_never_a_transport_failure() {
        // The same words, without a transport error behind them.
        for status in [
            Status::internal("h2 protocol error: connection error detected: frame with invalid size"),
            Status::unavailable("dns error"),
            Status::unavailable("tcp connect error"),
        ] {
            assert_eq!(Unreached::of(&status), Unreached::Other, "{status:?}");
        }
        assert_eq!(Unreached::of(&Status::unavailable("tcp connect error: Connection refused")), Unreached::Refused);
        assert!(Unreached::Refused.is_wrong_address() && !Unreached::NotGrpc.is_wrong_address());
    }
}
