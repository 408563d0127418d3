//! The `Members` RPC: entries of the job's newest generation by rank and by host, for the
//! members that rendezvoused compactly. Answered from the hub's prebuilt generation
//! ([`hub::Formed`]): O(k log k) for k ranks asked, plus O(ranks on the host) for a host
//! (its index is built once per generation), never a store read on the common path.

use super::CoordinatorService;
use crate::hub::{self, Formed};
use crate::validate;
use cohort_proto::v1 as pb;
use cohort_proto::MAX_MEMBERS_PER_CALL;
use tonic::Status;

/// Why a `Members` request is refused. Nothing changes either way: the RPC only reads.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum MembersError {
    /// Neither ranks nor a host asked for.
    #[error("ask for ranks, a host or both: the request names neither")]
    NothingAsked,
    /// More ranks than one call may ask for.
    #[error("{asked} ranks asked in one call (at most {MAX_MEMBERS_PER_CALL}); split the request")]
    TooManyRanks {
        /// Ranks in the request.
        asked: usize,
    },
    /// A rank at or beyond the generation's size.
    #[error("rank {rank} is out of range: generation {generation} has {size} members (ranks 0..{size})")]
    RankOutOfRange {
        /// The rank asked for.
        rank: u32,
        /// The generation.
        generation: u64,
        /// Its size.
        size: u32,
    },
    /// The generation asked about is older than the newest.
    #[error("generation {asked} is not the job's newest (that is {newest}); rendezvous again")]
    Stale {
        /// The generation asked about.
        asked: u64,
        /// The newest one.
        newest: u64,
    },
    /// The caller is not a member of the generation.
    #[error("member {worker} (incarnation {incarnation}) is not in generation {generation}")]
    NotMember {
        /// The caller's worker id.
        worker: String,
        /// Its incarnation.
        incarnation: u64,
        /// The generation.
        generation: u64,
    },
}

impl From<MembersError> for Status {
    fn from(e: MembersError) -> Self {
        match e {
            MembersError::Stale { .. } => Status::failed_precondition(e.to_string()),
            MembersError::NotMember { .. } => Status::permission_denied(e.to_string()),
            _ => Status::invalid_argument(e.to_string()),
        }
    }
}

/// Checks a request's shape before anything is read: something asked, not too many ranks.
pub(crate) fn check_request(r: &pb::MembersRequest) -> Result<(), MembersError> {
    if r.ranks.is_empty() && r.host.is_empty() {
        return Err(MembersError::NothingAsked);
    }
    if r.ranks.len() > MAX_MEMBERS_PER_CALL {
        return Err(MembersError::TooManyRanks { asked: r.ranks.len() });
    }
    Ok(())
}

/// The ranks of `formed` that answer `r` (the ranks asked and those on the host asked,
/// each once, in rank order), once the caller is found a member of it. `formed` is the
/// job's newest generation; a request about another one has been refused before.
pub(crate) fn select(formed: &Formed, r: &pb::MembersRequest) -> Result<Vec<u32>, MembersError> {
    check_request(r)?;
    if formed.number != r.generation {
        return Err(MembersError::Stale { asked: r.generation, newest: formed.number });
    }
    if formed.rank_of(&r.worker_id, r.incarnation).is_none() {
        return Err(MembersError::NotMember {
            worker: r.worker_id.clone(),
            incarnation: r.incarnation,
            generation: formed.number,
        });
    }
    let size = formed.size();
    if let Some(&rank) = r.ranks.iter().find(|&&rank| rank >= size) {
        return Err(MembersError::RankOutOfRange { rank, generation: formed.number, size });
    }
    let mut ranks = r.ranks.clone();
    if !r.host.is_empty() {
        ranks.extend_from_slice(formed.ranks_on_host(&r.host));
    }
    ranks.sort_unstable();
    ranks.dedup();
    Ok(ranks)
}

impl CoordinatorService {
    pub(super) async fn do_members(&self, r: pb::MembersRequest) -> Result<pb::MembersResponse, Status> {
        validate::id("job", &r.job)?;
        validate::id("worker_id", &r.worker_id)?;
        validate::incarnation(r.incarnation)?;
        validate::text("host", &r.host, validate::MAX_HOST_LEN)?;
        check_request(&r)?;
        let hub = self.hub(&r.job).await?;
        let signal = hub.signal();
        if let Some(ended) = &signal.ended {
            return Err(Status::failed_precondition(format!(
                "job {} has ended ({:?}: {}); its generations are gone",
                r.job, ended.outcome, ended.reason
            )));
        }
        let newest = signal.formed.as_ref().map_or(0, |f| f.number);
        if r.generation > newest {
            // This replica's view may lag a formation by milliseconds: ask the store.
            let stored = self.current_number(&hub, &r.job, r.generation).await?;
            return Err(if stored >= r.generation {
                Status::unavailable(format!(
                    "this replica has not yet seen generation {} of job {}; call again",
                    r.generation, r.job
                ))
            } else {
                Status::not_found(format!(
                    "job {} has formed no generation {} (its newest is {stored})",
                    r.job, r.generation
                ))
            });
        }
        let formed: &hub::Formed = match signal.formed.as_ref() {
            Some(f) => f,
            // `newest` is 0 and so is the generation asked about: there is none.
            None => return Err(Status::not_found(format!("job {} has formed no generation yet", r.job))),
        };
        let ranks = select(formed, &r)?;
        let members = ranks.iter().filter_map(|&rank| formed.member(rank).cloned()).collect();
        Ok(pb::MembersResponse {
            generation: formed.number,
            size: formed.size(),
            members_digest: formed.proto.members_digest,
            members,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{Address, Placed};

    /// Generation 3 of `n` members, four to a host.
    fn formed(n: usize) -> Formed {
        let members = (0..n)
            .map(|i| Placed {
                worker_id: format!("w{i}"),
                incarnation: 10 + i as u64,
                host: format!("h{}", i / 4),
                addresses: vec![],
                domain: String::new(),
            })
            .collect();
        let mut g = crate::rendezvous::next_generation(None, members, 0);
        g.number = 3;
        Formed::of(&g)
    }

    fn ask(ranks: Vec<u32>, host: &str) -> pb::MembersRequest {
        pb::MembersRequest {
            job: "j".into(),
            worker_id: "w1".into(),
            incarnation: 11,
            generation: 3,
            ranks,
            host: host.into(),
        }
    }

    #[test]
    fn ranks_and_a_host_are_answered_once_each_in_rank_order() {
        let f = formed(16);
        assert_eq!(select(&f, &ask(vec![9, 2, 9, 0], "")), Ok(vec![0, 2, 9]));
        assert_eq!(select(&f, &ask(vec![], "h1")), Ok(vec![4, 5, 6, 7]));
        assert_eq!(select(&f, &ask(vec![15, 5], "h1")), Ok(vec![4, 5, 6, 7, 15]));
        assert_eq!(select(&f, &ask(vec![], "nowhere")), Ok(vec![]));
    }

    #[test]
    fn bad_questions_are_refused_with_their_reason() {
        let f = formed(16);
        assert_eq!(select(&f, &ask(vec![], "")), Err(MembersError::NothingAsked));
        assert_eq!(
            select(&f, &ask(vec![16], "")),
            Err(MembersError::RankOutOfRange { rank: 16, generation: 3, size: 16 })
        );
        let too_many = vec![0; MAX_MEMBERS_PER_CALL + 1];
        assert_eq!(
            select(&f, &ask(too_many, "")),
            Err(MembersError::TooManyRanks { asked: MAX_MEMBERS_PER_CALL + 1 })
        );
        let mut stale = ask(vec![0], "");
        stale.generation = 2;
        assert_eq!(select(&f, &stale), Err(MembersError::Stale { asked: 2, newest: 3 }));
        let mut stranger = ask(vec![0], "");
        stranger.incarnation = 99;
        assert!(matches!(select(&f, &stranger), Err(MembersError::NotMember { .. })));
        let codes: Vec<tonic::Code> = [
            MembersError::NothingAsked,
            MembersError::Stale { asked: 1, newest: 2 },
            MembersError::NotMember { worker: "w".into(), incarnation: 1, generation: 2 },
        ]
        .into_iter()
        .map(|e| Status::from(e).code())
        .collect();
        assert_eq!(codes, [tonic::Code::InvalidArgument, tonic::Code::FailedPrecondition, tonic::Code::PermissionDenied]);
    }

    #[test]
    fn the_compact_answer_carries_the_callers_entry_and_the_digest() {
        let f = formed(8);
        let c = f.compact_for(5, false);
        assert!(c.members.is_empty());
        assert_eq!((c.size, c.rank, c.number), (8, Some(5), 3));
        assert_eq!(c.member.as_ref().map(|m| m.worker_id.as_str()), Some("w5"));
        assert_eq!(c.members_digest, cohort_proto::members_digest(&f.proto.members));
        assert_eq!(c.members_digest, f.proto.members_digest);
    }

    #[test]
    fn a_compact_answer_with_partners_carries_their_entries_as_the_list_has_them() {
        let f = formed(8);
        let c = f.compact_for(5, true);
        let ranks: Vec<u32> = c.members.iter().map(|m| m.rank).collect();
        assert_eq!(ranks, [1, 3, 4, 6, 7], "5 ± 1, 2, 4 (mod 8), without 5 itself");
        for m in &c.members {
            assert_eq!(Some(m), f.member(m.rank), "each entry as the whole list holds it");
        }
        assert_eq!((c.size, c.rank, c.members_digest), (8, Some(5), f.proto.members_digest));
        assert_eq!(c.member.as_ref().map(|m| m.worker_id.as_str()), Some("w5"));
    }

    #[test]
    fn a_sparse_answer_carries_the_partners_the_host_run_and_the_runs() {
        // 40 members, 4 to a host, each with a shared-memory address: rank 21 sits on h5 =
        // ranks 20..24.
        let shm = |w: u32| Address { transport: "shm".into(), address: format!("shm1;host=boot-{};nonce={w:08x}", w / 4) };
        let members = (0..40)
            .map(|i| Placed {
                worker_id: format!("w{i}"),
                incarnation: 10 + u64::from(i),
                host: format!("h{}", i / 4),
                addresses: vec![shm(i)],
                domain: String::new(),
            })
            .collect();
        let f = Formed::of(&crate::rendezvous::next_generation(None, members, 0));
        let c = f.sparse_for(21);
        let ranks: Vec<u32> = c.members.iter().map(|m| m.rank).collect();
        let mut expected = cohort_proto::partner_ranks(21, 40);
        expected.extend([20, 22, 23]);
        expected.sort_unstable();
        expected.dedup();
        assert_eq!(ranks, expected, "partners and host-mates, ascending, each once");
        for m in &c.members {
            assert_eq!(Some(m), f.member(m.rank), "each entry as the whole list holds it");
        }
        assert_eq!(c.host_runs, vec![pb::HostRuns { ranks: 4, hosts: 10 }]);
        assert_eq!((c.size, c.rank, c.members_digest), (40, Some(21), f.proto.members_digest));
        // The first and the last run.
        let first: Vec<u32> = f.sparse_for(0).members.iter().map(|m| m.rank).filter(|&r| r < 4).collect();
        assert_eq!(first, [1, 2, 3]);
        let last: Vec<u32> = f.sparse_for(39).members.iter().map(|m| m.rank).filter(|&r| r >= 36).collect();
        assert_eq!(last, [36, 37, 38]);
        // Without shared-memory addresses every member is a host of its own: partners only.
        let tcp_only = formed(40);
        let c = tcp_only.sparse_for(21);
        assert_eq!(c.host_runs, vec![pb::HostRuns { ranks: 1, hosts: 40 }]);
        let ranks: Vec<u32> = c.members.iter().map(|m| m.rank).collect();
        assert_eq!(ranks, cohort_proto::partner_ranks(21, 40));
    }
}
