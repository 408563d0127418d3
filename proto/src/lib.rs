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

/// The partners of rank `rank` in a generation of `size` members: `rank ± 2^k mod size` for
/// every `2^k < size`, without `rank` itself, each once, ascending (empty when `rank` is out
/// of range). They are the ring's two neighbours (`k = 0`) and the peers of the dissemination
/// barrier, of every binomial tree and of recursive doubling: what a member that links on
/// demand connects first, O(log size) of them. A compact `Rendezvous` answer asked with
/// `partners` carries their entries.
pub fn partner_ranks(rank: u32, size: u32) -> Vec<u32> {
    if rank >= size {
        return Vec::new();
    }
    let (r, n) = (u64::from(rank), u64::from(size));
    let mut out: Vec<u32> = std::iter::successors(Some(1u64), |d| Some(d << 1))
        .take_while(|&d| d < n)
        .flat_map(|d| [(r + d) % n, (r + n - d) % n])
        .filter(|&p| p != r)
        .map(|p| p as u32)
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partners_are_powers_of_two_away_each_once_and_symmetric() {
        assert_eq!(partner_ranks(0, 1), Vec::<u32>::new());
        assert_eq!(partner_ranks(0, 2), vec![1]);
        assert_eq!(partner_ranks(3, 8), vec![1, 2, 4, 5, 7]);
        assert_eq!(partner_ranks(5, 5), Vec::<u32>::new(), "out of range");
        for n in 1..=70u32 {
            for r in 0..n {
                let p = partner_ranks(r, n);
                assert!(p.windows(2).all(|w| w[0] < w[1]), "ascending, each once: {p:?}");
                assert!(!p.contains(&r) && p.iter().all(|&q| q < n));
                assert!(p.len() <= 2 * n.next_power_of_two().trailing_zeros() as usize);
                if n > 1 {
                    assert!(p.contains(&((r + 1) % n)) && p.contains(&((r + n - 1) % n)), "ring neighbours");
                }
                for &q in &p {
                    assert!(partner_ranks(q, n).contains(&r), "{r} lists {q} but not the reverse (n = {n})");
                }
            }
        }
    }

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
