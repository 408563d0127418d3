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

/// Most beats one `HostHeartbeat` call may carry (`HostHeartbeatRequest.beats`): far more
/// ranks than one host holds.
pub const MAX_BEATS_PER_CALL: usize = 1024;

/// Most ranks one `Members` call may ask for (`MembersRequest.ranks`).
pub const MAX_MEMBERS_PER_CALL: usize = 4096;

/// The digest of an ordered member list that `Generation.members_digest` and
/// `MembersResponse.members_digest` carry: the first 8 bytes (big-endian) of SHA-256 over
/// each member's length-delimited protobuf encoding, in the order given (rank order).
///
/// Protobuf encoding of these messages is deterministic (no maps, fields in number order),
/// so every replica computes the same digest for the same list, and a client holding the
/// whole list can compute it too.
pub fn members_digest(members: &[v1::Member]) -> u64 {
    use prost::Message;
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    let mut buf = Vec::with_capacity(256);
    for m in members {
        buf.clear();
        // Encoding into a Vec cannot run out of room.
        let _ = m.encode_length_delimited(&mut buf);
        hasher.update(&buf);
    }
    let out = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&out[..8]);
    u64::from_be_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(rank: u32, id: &str) -> v1::Member {
        v1::Member { rank, worker_id: id.into(), incarnation: 7, host: "h".into(), ..Default::default() }
    }

    #[test]
    fn the_members_digest_depends_on_every_entry_and_the_order() {
        let list = vec![member(0, "a"), member(1, "b")];
        let d = members_digest(&list);
        assert_eq!(d, members_digest(&list.clone()), "deterministic");
        assert_ne!(d, members_digest(&[member(0, "b"), member(1, "a")]));
        assert_ne!(d, members_digest(&list[..1]));
        let mut other = list.clone();
        other[1].incarnation = 8;
        assert_ne!(d, members_digest(&other));
        assert_ne!(members_digest(&[]), d);
    }
}
