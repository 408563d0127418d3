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
pub mod ids;
pub mod process_metrics;
#[cfg(feature = "progress")]
pub mod progress;

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

/// The host runs of a generation whose members' hosts, in rank order, are `hosts`: each
/// maximal block of consecutive equal hosts is a run, and consecutive runs of one length are
/// merged into one [`v1::HostRuns`] entry. What a compact `Rendezvous` answer asked with
/// `layout` carries in `host_runs`. O(members) to build; as many entries as changes of run
/// length (one for a job of equal hosts).
pub fn host_runs<T: PartialEq>(hosts: impl IntoIterator<Item = T>) -> Vec<v1::HostRuns> {
    let mut lengths: Vec<u32> = Vec::new();
    let mut last: Option<T> = None;
    for host in hosts {
        match (&last, lengths.last_mut()) {
            (Some(previous), Some(length)) if *previous == host => *length += 1,
            _ => lengths.push(1),
        }
        last = Some(host);
    }
    let mut out: Vec<v1::HostRuns> = Vec::new();
    for length in lengths {
        match out.last_mut() {
            Some(entry) if entry.ranks == length => entry.hosts += 1,
            _ => out.push(v1::HostRuns { ranks: length, hosts: 1 }),
        }
    }
    out
}

/// The host runs of a generation whose members are `members` (in rank order): the one key
/// every answer about a generation derives its host layout from, whole or sparse, whichever
/// coordinator replica answered. Members share a host when they name one `host` and published
/// shared-memory (`shm`) addresses with one host identity ([`shm_identity`]): the host name
/// alone would group containers that cannot share memory, the identity alone would group
/// members that say they are on different hosts (workers of one process in a test). A member
/// without a well-formed shared-memory address is a host of its own. Runs are of consecutive
/// ranks ([`host_runs`]); the coordinator places a host's members contiguously. What a sparse
/// answer carries in `host_runs`, and what a worker computes from a whole member list.
pub fn layout_runs(members: &[v1::Member]) -> Vec<v1::HostRuns> {
    host_runs(members.iter().map(|m| {
        let identity = m.addresses.iter().find(|a| a.transport == "shm").and_then(|a| shm_identity(&a.address));
        match identity {
            Some(identity) => (Some((m.host.as_str(), identity)), 0),
            None => (None, m.rank),
        }
    }))
}

/// The host identity of a shared-memory address, `shm1;host=IDENTITY;nonce=HEX` (as
/// `cohort_transports::shm::ShmAddress` encodes it and with its checks: the identity printable
/// ASCII without `;`, `,` or `|`, the nonce 8 to 64 hex digits); `None` if malformed (such a
/// member shares memory with nobody).
pub fn shm_identity(address: &str) -> Option<&str> {
    let rest = address.strip_prefix("shm1;")?;
    let (host, nonce) = rest.split_once(";nonce=")?;
    let host = host.strip_prefix("host=")?;
    let host_ok = !host.is_empty() && host.bytes().all(|b| b.is_ascii_graphic() && !b";,|".contains(&b));
    let nonce_ok = (8..=64).contains(&nonce.len()) && nonce.bytes().all(|b| b.is_ascii_hexdigit());
    (host_ok && nonce_ok).then_some(host)
}

/// The length of every host run that `runs` describes, in rank order: the inverse of
/// [`host_runs`]. Errors when an entry is empty or the runs do not cover exactly `size`
/// ranks, or when they would describe more runs than ranks (a nonsense answer).
pub fn run_lengths(runs: &[v1::HostRuns], size: u32) -> Result<Vec<u32>, String> {
    let mut lengths = Vec::new();
    let mut covered: u64 = 0;
    for entry in runs {
        if entry.ranks == 0 || entry.hosts == 0 {
            return Err(format!("an empty host run entry ({} ranks x {} hosts)", entry.ranks, entry.hosts));
        }
        covered += u64::from(entry.ranks) * u64::from(entry.hosts);
        if covered > u64::from(size) {
            return Err(format!("host runs cover more than the generation's {size} ranks"));
        }
        lengths.extend(std::iter::repeat_n(entry.ranks, entry.hosts as usize));
    }
    if covered != u64::from(size) {
        return Err(format!("host runs cover {covered} ranks of the generation's {size}"));
    }
    Ok(lengths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_runs_merge_equal_lengths_and_expand_back() {
        let hosts = ["a", "a", "b", "b", "c", "c", "c", "a", "d"];
        let runs = host_runs(hosts);
        let pairs: Vec<(u32, u32)> = runs.iter().map(|r| (r.ranks, r.hosts)).collect();
        assert_eq!(pairs, vec![(2, 2), (3, 1), (1, 2)], "a's second block is a run of its own");
        assert_eq!(run_lengths(&runs, 9).unwrap(), vec![2, 2, 3, 1, 1]);
        let even: Vec<String> = (0..16_384).map(|i| format!("h{}", i / 8)).collect();
        let runs = host_runs(even.iter());
        assert_eq!(runs, vec![v1::HostRuns { ranks: 8, hosts: 2_048 }], "equal hosts: one entry");
        assert_eq!(run_lengths(&runs, 16_384).unwrap().len(), 2_048);
        assert!(host_runs(std::iter::empty::<&str>()).is_empty());
        assert_eq!(run_lengths(&[], 0).unwrap(), Vec::<u32>::new());
        for (bad, size) in [
            (vec![v1::HostRuns { ranks: 8, hosts: 2 }], 17),
            (vec![v1::HostRuns { ranks: 8, hosts: 3 }], 16),
            (vec![v1::HostRuns { ranks: 0, hosts: 3 }], 0),
            (vec![v1::HostRuns { ranks: u32::MAX, hosts: u32::MAX }], 16),
        ] {
            assert!(run_lengths(&bad, size).is_err(), "{bad:?} over {size}");
        }
    }

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
