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

use super::choice::{host_layout, MemberInfo};
use super::ElasticError;
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
    /// `Some` for a sparse view: the length of every host run, in rank order.
    runs: Option<Vec<u32>>,
}

impl Members {
    /// The whole member list, ordered by rank (`members[i].rank == i`); incarnations unknown
    /// (0), as for a world built without a coordinator.
    pub fn whole(members: Vec<MemberInfo>) -> Self {
        let incarnations = vec![0; members.len()];
        Self { size: members.len() as u32, entries: members, incarnations, runs: None }
    }

    /// Number of members of the generation (ranks `0..size`), known or not.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// Whether every member's entry is known (a generation answered whole).
    pub fn is_whole(&self) -> bool {
        self.runs.is_none()
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
    pub(crate) fn incarnation_of(&self, rank: u32) -> Option<u64> {
        self.index_of(rank).map(|i| self.incarnations[i])
    }

    /// The host layout every member of the generation derives alike: from the members'
    /// shared-memory host identities when whole (a member without one a host of its own), from the host runs of a
    /// sparse view (a run is a host).
    pub fn layout(&self) -> HostLayout {
        match &self.runs {
            None => host_layout(&self.entries),
            Some(runs) => HostLayout::from_runs(runs),
        }
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
        if self.runs.is_none() {
            return self.entries.get(rank as usize).map(|_| rank as usize);
        }
        self.entries.binary_search_by_key(&rank, |e| e.rank).ok()
    }

    /// The members of a formed generation as the coordinator answered it: the whole list
    /// (`rank` unset), or a sparse view (`rank` set, with `host_runs`). `None` for a compact
    /// answer without host runs (a coordinator older than `layout`): fetch the whole list.
    pub(crate) fn from_answer(g: &pb::Generation) -> Result<Option<Self>, ElasticError> {
        let Some(rank) = g.rank else {
            let entries = parse_whole(g)?;
            let incarnations = g.members.iter().map(|m| m.incarnation).collect();
            return Ok(Some(Self { size: entries.len() as u32, entries, incarnations, runs: None }));
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
        let mut view = Self { size: g.size, entries: Vec::new(), incarnations: Vec::new(), runs: Some(runs) };
        view.add(std::slice::from_ref(own))?;
        view.add(&g.members)?;
        Ok(Some(view))
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
