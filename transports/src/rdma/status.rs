//! Mapping of work-completion statuses to [`TransportError`] (pure).
//!
//! - Success is not an error.
//! - `WR_FLUSH_ERR` after a local abort is [`TransportError::Aborted`] (abort moves every
//!   queue pair to the error state, which flushes outstanding work requests); without an
//!   abort it means the queue pair already failed, so the link to that peer is gone:
//!   [`TransportError::PeerClosed`].
//! - Transport retries exhausted (`RETRY_EXC_ERR`, `RNR_RETRY_EXC_ERR`), response timeouts,
//!   bad responses and every `REM_*` error say the peer (or the path to it) failed:
//!   [`TransportError::PeerClosed`] naming the peer.
//! - Every `LOC_*` error and the remaining ones (memory-window bind, fatal, general) are local
//!   faults: [`TransportError::Io`].

use crate::{AbortReason, Rank, TransportError};
use rdma_sys::ibv_wc_status as st;

/// The verbs name of a completion status, for messages.
pub fn status_name(status: u32) -> &'static str {
    match status {
        st::IBV_WC_SUCCESS => "success",
        st::IBV_WC_LOC_LEN_ERR => "local length error",
        st::IBV_WC_LOC_QP_OP_ERR => "local QP operation error",
        st::IBV_WC_LOC_EEC_OP_ERR => "local EE context operation error",
        st::IBV_WC_LOC_PROT_ERR => "local protection error",
        st::IBV_WC_WR_FLUSH_ERR => "work request flushed",
        st::IBV_WC_MW_BIND_ERR => "memory window bind error",
        st::IBV_WC_BAD_RESP_ERR => "bad response",
        st::IBV_WC_LOC_ACCESS_ERR => "local access error",
        st::IBV_WC_REM_INV_REQ_ERR => "remote invalid request",
        st::IBV_WC_REM_ACCESS_ERR => "remote access error",
        st::IBV_WC_REM_OP_ERR => "remote operation error",
        st::IBV_WC_RETRY_EXC_ERR => "transport retry counter exceeded",
        st::IBV_WC_RNR_RETRY_EXC_ERR => "RNR retry counter exceeded",
        st::IBV_WC_LOC_RDD_VIOL_ERR => "local RDD violation",
        st::IBV_WC_REM_INV_RD_REQ_ERR => "remote invalid RD request",
        st::IBV_WC_REM_ABORT_ERR => "remote aborted",
        st::IBV_WC_INV_EECN_ERR => "invalid EE context number",
        st::IBV_WC_INV_EEC_STATE_ERR => "invalid EE context state",
        st::IBV_WC_FATAL_ERR => "fatal error",
        st::IBV_WC_RESP_TIMEOUT_ERR => "response timeout",
        st::IBV_WC_GENERAL_ERR => "general error",
        _ => "unknown status",
    }
}

/// The error a completion with `status` (and the device's `vendor_err`) on the queue pair
/// to `peer` stands for; `None` for success. `aborted` is the local abort reason, if any.
pub fn wc_error(status: u32, vendor_err: u32, peer: Rank, aborted: Option<&AbortReason>) -> Option<TransportError> {
    let what = || format!("{} (status {status}, vendor error {vendor_err:#x})", status_name(status));
    match status {
        st::IBV_WC_SUCCESS => None,
        st::IBV_WC_WR_FLUSH_ERR => Some(match aborted {
            Some(r) => TransportError::Aborted(r.clone()),
            None => TransportError::PeerClosed { peer, detail: format!("{}: queue pair in error state", what()) },
        }),
        st::IBV_WC_RETRY_EXC_ERR
        | st::IBV_WC_RNR_RETRY_EXC_ERR
        | st::IBV_WC_RESP_TIMEOUT_ERR
        | st::IBV_WC_BAD_RESP_ERR
        | st::IBV_WC_REM_INV_REQ_ERR
        | st::IBV_WC_REM_ACCESS_ERR
        | st::IBV_WC_REM_OP_ERR
        | st::IBV_WC_REM_INV_RD_REQ_ERR
        | st::IBV_WC_REM_ABORT_ERR => Some(TransportError::PeerClosed { peer, detail: what() }),
        _ => Some(TransportError::Io(format!("rdma completion on the link to rank {peer} failed: {}", what()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn success_is_not_an_error() {
        assert!(wc_error(st::IBV_WC_SUCCESS, 0, 1, None).is_none());
    }

    #[test]
    fn flush_is_abort_only_after_abort() {
        let r = AbortReason::new("generation 4 revoked");
        match wc_error(st::IBV_WC_WR_FLUSH_ERR, 0, 2, Some(&r)) {
            Some(TransportError::Aborted(got)) => assert_eq!(got, r),
            e => panic!("unexpected {e:?}"),
        }
        match wc_error(st::IBV_WC_WR_FLUSH_ERR, 0, 2, None) {
            Some(TransportError::PeerClosed { peer: 2, detail }) => assert!(detail.contains("flushed"), "{detail}"),
            e => panic!("unexpected {e:?}"),
        }
    }

    #[test]
    fn remote_and_retry_errors_name_the_peer() {
        for s in [
            st::IBV_WC_RETRY_EXC_ERR,
            st::IBV_WC_RNR_RETRY_EXC_ERR,
            st::IBV_WC_REM_ACCESS_ERR,
            st::IBV_WC_REM_OP_ERR,
            st::IBV_WC_REM_INV_REQ_ERR,
            st::IBV_WC_REM_ABORT_ERR,
            st::IBV_WC_RESP_TIMEOUT_ERR,
        ] {
            let e = wc_error(s, 0x81, 3, Some(&AbortReason::new("x"))).unwrap();
            assert!(matches!(&e, TransportError::PeerClosed { peer: 3, .. }), "status {s}: {e:?}");
            assert!(e.to_string().contains("0x81"), "{e}");
        }
        assert!(wc_error(st::IBV_WC_RETRY_EXC_ERR, 0, 3, None).unwrap().to_string().contains("retry counter exceeded"));
    }

    #[test]
    fn local_errors_are_io() {
        for s in [
            st::IBV_WC_LOC_LEN_ERR,
            st::IBV_WC_LOC_QP_OP_ERR,
            st::IBV_WC_LOC_PROT_ERR,
            st::IBV_WC_LOC_ACCESS_ERR,
            st::IBV_WC_MW_BIND_ERR,
            st::IBV_WC_FATAL_ERR,
            st::IBV_WC_GENERAL_ERR,
            999,
        ] {
            let e = wc_error(s, 0, 0, None).unwrap();
            assert!(matches!(&e, TransportError::Io(m) if m.contains("rank 0")), "status {s}: {e:?}");
        }
    }
}
