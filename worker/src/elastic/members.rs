//! The members of a generation as this worker knows them.
//!
//! A generation of at most the job's `whole_answer_up_to` members (coordinator setting,
//! default 256) comes whole: every member's record. A larger one comes as a sparse view
//! (`RendezvousRequest.layout`): this worker's own entry, its partners' (the ranks
//! `rank ± 2^k`, [`cohort_proto::partner_ranks`]), its host run's, and the host runs of the
//! whole generation, so that a formation moves O(N log N) bytes across the job, not O(N²).
//! The host layout, the link plan and the call signatures come from what every member of the
//! generation holds alike; any other peer's address is asked of the coordinator when a link
//! to it is first made ([`super::resolve`]).
//!
//! The host layout is the generation's, not the answer's: whole or sparse, it comes from the
//! generation's host runs ([`cohort_proto::layout_runs`], one key: the `host` of a member
//! that published a shared-memory address, a host of its own for one that did not), carried
//! by a sparse answer and computed from a whole one alike. So the ranks of one generation
//! share one layout even when coordinator replicas with different `whole_answer_up_to`
//! answered them (some whole, some sparse).

use super::mesh_plan::{host_runs_of, MemberInfo};
use super::ElasticError;
use crate::control::{ControlClient, ControlError};
use crate::HostLayout;
use cohort_proto::v1 as pb;
use std::net::SocketAddr;

/// The members of one generation that this worker knows, by rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Members {
    size: u32,
    /// Known entries, ascending by rank; every rank when whole.
    entries: Vec<MemberInfo>,
    /// Each known entry's incarnation, as `entries`.
    incarnations: Vec<u64>,
    /// The length of every host run of the generation, in rank order.
    runs: Vec<u32>,
    /// Whether `entries` holds every member.
    whole: bool,
}

impl Members {
    /// The whole member list, ordered by rank (`members[i].rank == i`); incarnations unknown
    /// (0), as for a world built without a coordinator.
    pub fn whole(members: Vec<MemberInfo>) -> Self {
        let incarnations = vec![0; members.len()];
        let runs = host_runs_of(&members);
        Self { size: members.len() as u32, entries: members, incarnations, runs, whole: true }
    }

    /// Number of members of the generation (ranks `0..size`), known or not.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// Whether every member's entry is known (a generation answered whole).
    pub fn is_whole(&self) -> bool {
        self.whole
    }

    /// The entry of `rank`, if known. O(log known).
    pub fn get(&self, rank: u32) -> Option<&MemberInfo> {
        self.index_of(rank).map(|i| &self.entries[i])
    }

    /// The known entries, ascending by rank (every member's when whole).
    pub fn iter(&self) -> impl Iterator<Item = &MemberInfo> + '_ {
        self.entries.iter()
    }

    /// The known entries, ascending by rank.
    pub fn known(&self) -> &[MemberInfo] {
        &self.entries
    }

    /// The incarnation of the member at `rank`, if known (0 for a list built without a
    /// coordinator).
    pub fn incarnation_of(&self, rank: u32) -> Option<u64> {
        self.index_of(rank).map(|i| self.incarnations[i])
    }

    /// The host layout every member of the generation derives alike, whole or sparse: a host
    /// run is a host ([`cohort_proto::layout_runs`]).
    pub fn layout(&self) -> HostLayout {
        HostLayout::from_runs(&self.runs)
    }

    /// The ranks in `wanted` whose entries are not known.
    pub(crate) fn missing(&self, wanted: impl IntoIterator<Item = u32>) -> Vec<u32> {
        wanted.into_iter().filter(|&r| r < self.size && self.index_of(r).is_none()).collect()
    }

    /// Adds entries fetched with `Members` (already checked against the generation's digest).
    pub(crate) fn add(&mut self, fetched: &[pb::Member]) -> Result<(), ElasticError> {
        for m in fetched {
            if m.rank >= self.size {
                return Err(ElasticError::Protocol(format!(
                    "member {} has rank {} in a generation of {}",
                    m.worker_id, m.rank, self.size
                )));
            }
            if let Err(at) = self.entries.binary_search_by_key(&m.rank, |e| e.rank) {
                self.entries.insert(at, parse_member(m)?);
                self.incarnations.insert(at, m.incarnation);
            }
        }
        Ok(())
    }

    fn index_of(&self, rank: u32) -> Option<usize> {
        if self.whole {
            return self.entries.get(rank as usize).map(|_| rank as usize);
        }
        self.entries.binary_search_by_key(&rank, |e| e.rank).ok()
    }

    /// The members of a formed generation as the coordinator answered it: the whole list
    /// (`rank` unset; its host runs computed from it, as the coordinator computes a sparse
    /// answer's), or a sparse view (`rank` set, with `host_runs`). `None` for a compact
    /// answer without host runs (a coordinator older than `layout`): fetch the whole list.
    pub(crate) fn from_answer(g: &pb::Generation) -> Result<Option<Self>, ElasticError> {
        let Some(rank) = g.rank else {
            let entries = parse_whole(g)?;
            let incarnations = g.members.iter().map(|m| m.incarnation).collect();
            let size = entries.len() as u32;
            let runs = cohort_proto::run_lengths(&cohort_proto::layout_runs(&g.members), size)
                .map_err(|e| ElasticError::Protocol(format!("generation {}: {e}", g.number)))?;
            return Ok(Some(Self { size, entries, incarnations, runs, whole: true }));
        };
        if g.host_runs.is_empty() {
            return Ok(None);
        }
        let runs = cohort_proto::run_lengths(&g.host_runs, g.size)
            .map_err(|e| ElasticError::Protocol(format!("generation {}: {e}", g.number)))?;
        let own = g.member.as_ref().filter(|m| m.rank == rank).ok_or_else(|| {
            ElasticError::Protocol(format!(
                "generation {}: the answer lacks this worker's entry (rank {rank})",
                g.number
            ))
        })?;
        let mut view = Self { size: g.size, entries: Vec::new(), incarnations: Vec::new(), runs, whole: false };
        view.add(std::slice::from_ref(own))?;
        view.add(&g.members)?;
        Ok(Some(view))
    }
}

/// The entries of `question`'s ranks of a formed generation, checked against its digest.
/// `None` when the generation changed meanwhile (the coordinator refuses the question).
///
/// # Cancel safety
/// Cancel safe (read only).
pub(crate) async fn fetch_members(
    client: &ControlClient,
    question: pb::MembersRequest,
    digest: u64,
) -> Result<Option<Vec<pb::Member>>, ElasticError> {
    match client.fetch_members(question, digest).await {
        Ok(fetched) => Ok(Some(fetched)),
        Err(ControlError::Rejected {
            code: tonic::Code::FailedPrecondition | tonic::Code::NotFound, message, ..
        }) => {
            tracing::info!(error = %message, "the generation changed while its members were fetched; rendezvous again");
            Ok(None)
        }
        Err(e) => Err(ElasticError::from(e)),
    }
}

/// Parses a whole member list (`members[i].rank == i`).
fn parse_whole(g: &pb::Generation) -> Result<Vec<MemberInfo>, ElasticError> {
    let mut members = Vec::with_capacity(g.members.len());
    for (i, m) in g.members.iter().enumerate() {
        if m.rank as usize != i {
            return Err(ElasticError::Protocol(format!(
                "member {} listed at position {i} has rank {}",
                m.worker_id, m.rank
            )));
        }
        members.push(parse_member(m)?);
    }
    Ok(members)
}

/// One member's record: its TCP address must resolve; an unusable shm address only keeps it
/// on TCP (every member reads the same records, so all decide alike).
pub(crate) fn parse_member(m: &pb::Member) -> Result<MemberInfo, ElasticError> {
    let address = m
        .addresses
        .iter()
        .find(|a| a.transport == "tcp")
        .ok_or_else(|| ElasticError::Protocol(format!("member {} has no tcp address", m.worker_id)))?;
    let tcp = resolve(&address.address).ok_or_else(|| {
        ElasticError::Protocol(format!("member {} has an unusable address {:?}", m.worker_id, address.address))
    })?;
    let rdma = m.addresses.iter().find(|a| a.transport == "rdma").map(|a| a.address.clone());
    let shm =
        m.addresses.iter().find(|a| a.transport == "shm").and_then(
            |a| match cohort_transports::shm::ShmAddress::decode(&a.address) {
                Ok(address) => Some(address),
                Err(e) => {
                    tracing::warn!(worker = %m.worker_id, error = %e, "ignoring an unusable shm address");
                    None
                }
            },
        );
    Ok(MemberInfo { rank: m.rank, worker_id: m.worker_id.clone(), host: m.host.clone(), tcp, rdma, shm })
}

/// Resolves `HOST:PORT` (an IP literal, or a name through the system resolver).
pub(crate) fn resolve(address: &str) -> Option<SocketAddr> {
    if let Ok(a) = address.parse() {
        return Some(a);
    }
    use std::net::ToSocketAddrs;
    address.to_socket_addrs().ok()?.next()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(rank: u32, host: &str) -> pb::Member {
        pb::Member {
            rank,
            worker_id: format!("w{rank}"),
            incarnation: 100 + u64::from(rank),
            host: host.into(),
            addresses: vec![pb::TransportAddress {
                transport: "tcp".into(),
                address: format!("127.0.0.1:{}", 7000 + rank),
            }],
            ..Default::default()
        }
    }

    #[test]
    fn a_sparse_view_knows_its_entries_and_the_layout() {
        // 12 members, 4 per host; rank 5 knows 4, 6, 7 (host) and its partners.
        let all: Vec<pb::Member> = (0..12).map(|r| member(r, &format!("h{}", r / 4))).collect();
        let mut known: Vec<u32> = cohort_proto::partner_ranks(5, 12);
        known.extend([4, 6, 7]);
        known.sort_unstable();
        known.dedup();
        let g = pb::Generation {
            number: 3,
            size: 12,
            rank: Some(5),
            member: Some(all[5].clone()),
            members: known.iter().map(|&r| all[r as usize].clone()).collect(),
            host_runs: cohort_proto::host_runs(all.iter().map(|m| m.host.as_str())),
            ..Default::default()
        };
        let mut view = Members::from_answer(&g).unwrap().expect("a sparse view");
        assert!(!view.is_whole());
        assert_eq!(view.size(), 12);
        assert_eq!(view.get(5).map(|m| m.worker_id.as_str()), Some("w5"));
        assert_eq!(view.incarnation_of(6), Some(106));
        let missing = view.missing(0..12);
        assert_eq!(missing, [0, 2, 8, 10, 11], "not partners of 5 in 12 (1, 3, 4, 6, 7, 9) nor on its host");
        assert_eq!(view.layout(), HostLayout::blocks(12, 3));
        view.add(&[all[0].clone(), all[0].clone()]).unwrap();
        assert_eq!(view.missing(0..12), [2, 8, 10, 11]);
        assert!(view.iter().map(|m| m.rank).collect::<Vec<_>>().windows(2).all(|w| w[0] < w[1]));
        assert!(view.add(&[member(12, "h3")]).is_err(), "a rank out of range");
        // A compact answer without runs (an older coordinator): no view.
        assert_eq!(Members::from_answer(&pb::Generation { host_runs: vec![], ..g.clone() }).unwrap(), None);
        // Runs that do not cover the generation, or no own entry: refused.
        let short = pb::Generation { host_runs: vec![pb::HostRuns { ranks: 4, hosts: 2 }], ..g.clone() };
        assert!(Members::from_answer(&short).is_err());
        assert!(Members::from_answer(&pb::Generation { member: None, ..g }).is_err());
    }

    /// The sparse answer to rank `rank` of the generation of `all`, as the coordinator builds
    /// it: own entry, partners, host run, and the host runs.
    fn sparse(all: &[pb::Member], rank: u32) -> pb::Generation {
        let n = all.len() as u32;
        let runs = cohort_proto::layout_runs(all);
        let lengths = cohort_proto::run_lengths(&runs, n).unwrap();
        let mut start = 0;
        let run = lengths
            .iter()
            .map(|&l| {
                start += l;
                (start - l)..start
            })
            .find(|r| r.contains(&rank))
            .unwrap();
        let mut known = cohort_proto::partner_ranks(rank, n);
        known.extend(run.filter(|&r| r != rank));
        known.sort_unstable();
        known.dedup();
        pb::Generation {
            number: 7,
            size: n,
            rank: Some(rank),
            member: Some(all[rank as usize].clone()),
            members: known.iter().map(|&r| all[r as usize].clone()).collect(),
            host_runs: runs,
            ..Default::default()
        }
    }

    #[test]
    fn one_generation_answered_whole_or_sparse_has_one_layout() {
        // Hosts h0 and h1 share one shared-memory identity (as workers of one process do);
        // h2 has two members without shared memory, then two with identities of their own
        // (containers in separate IPC namespaces), then two sharing one. Whole answers (a
        // replica whose whole_answer_up_to is at least 14) and sparse ones (one whose is
        // lower) must give every rank the same layout.
        let with_shm = |mut m: pb::Member, identity: &str| {
            m.addresses.push(pb::TransportAddress {
                transport: "shm".into(),
                address: format!("shm1;host={identity};nonce={:08x}", m.rank),
            });
            m
        };
        let all: Vec<pb::Member> = (0..14)
            .map(|r| match r {
                0..=3 => with_shm(member(r, "h0"), "boot-a"),
                4..=7 => with_shm(member(r, "h1"), "boot-a"),
                8 | 9 => member(r, "h2"),
                10 => with_shm(member(r, "h2"), "boot-b"),
                11 => with_shm(member(r, "h2"), "boot-c"),
                _ => with_shm(member(r, "h2"), "boot-d"),
            })
            .collect();
        let whole = pb::Generation { number: 7, size: 14, members: all.clone(), ..Default::default() };
        let layout = Members::from_answer(&whole).unwrap().expect("whole").layout();
        assert_eq!(
            layout.hosts(),
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8], vec![9], vec![10], vec![11], vec![12, 13]],
            "host runs of members with one host name and one shared-memory identity"
        );
        for rank in 0..14 {
            let view = Members::from_answer(&sparse(&all, rank)).unwrap().expect("sparse");
            assert!(!view.is_whole());
            assert_eq!(view.layout(), layout, "rank {rank}'s sparse view");
        }
        // A world built without a coordinator from the same records agrees too.
        let parsed: Vec<MemberInfo> = all.iter().map(|m| parse_member(m).unwrap()).collect();
        assert_eq!(Members::whole(parsed).layout(), layout);
    }

    #[test]
    fn the_coordinators_shm_identity_reads_addresses_as_the_transport_decodes_them() {
        use cohort_transports::shm::ShmAddress;
        let good = ShmAddress { host: "boot=x:net=1:ipc=2".into(), nonce: "00ff00ff".into() }.encode();
        for text in [
            good.as_str(),
            "shm1;host=a;nonce=0123456789abcdef",
            "shm1;host=;nonce=00ff00ff",
            "shm1;host=a b;nonce=00ff00ff",
            "shm1;host=a|b;nonce=00ff00ff",
            "shm1;host=a;nonce=00ff",
            "shm1;host=a;nonce=00ff00fg",
            "shm2;host=a;nonce=00ff00ff",
            "shm1;a;nonce=00ff00ff",
            "shm-3",
        ] {
            let decoded = ShmAddress::decode(text).ok().map(|a| a.host);
            assert_eq!(cohort_proto::shm_identity(text).map(str::to_string), decoded, "{text:?}");
        }
    }

    #[test]
    fn a_whole_answer_is_every_member_by_rank() {
        let all: Vec<pb::Member> = (0..3).map(|r| member(r, "h")).collect();
        let g = pb::Generation { number: 1, size: 3, members: all.clone(), ..Default::default() };
        let view = Members::from_answer(&g).unwrap().expect("whole");
        assert!(view.is_whole());
        assert_eq!(view.known().len(), 3);
        assert!(view.missing(0..3).is_empty());
        let swapped = pb::Generation { members: vec![all[1].clone(), all[0].clone()], ..g };
        assert!(Members::from_answer(&swapped).is_err(), "position and rank disagree");
    }
}
