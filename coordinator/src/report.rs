//! The failure-report path's decisions, as pure logic: no store, no clock, no gRPC types. The
//! shell (`service/failures.rs`) reads the generation, the cascade's timeout reports and the
//! heartbeat silences, hands them to these functions and acts on the answers.
//!
//! A timeout report may be one link of a cascade (rank B timed out waiting on A, which timed
//! out waiting on the hung V). The path:
//!
//! 1. [`cascade_link`]: whether the report is held as a link: a timeout naming a peer, from a
//!    member of the current, unrevoked generation it is about. Anything else is judged at
//!    once, as reported.
//! 2. The shell records the link and holds [`revocation::TIMEOUT_HOLD`], so that the
//!    cascade's other reports arrive, at any replica; then it reads the chain and the
//!    generation once. [`hold_longer`]: while the chain's end is a live member (heard from
//!    within twice the heartbeat interval) that has not reported yet, at most
//!    [`CHAIN_END_WAITS`] more holds.
//! 3. [`reattribute`]: the cascade's root, when it is not the rank named, takes the blame,
//!    with a reason that says why.
//! 4. [`revocation::decide`] and [`revocation::arbitrate`] judge the report against the
//!    generation as last read; a revocation's suspect is [`suspect`].

use crate::records::{Cause, GenerationRecord, Placed};
use crate::revocation::{self, CascadeRoot, FailureKind, Silences, TimeoutReport};
use std::time::Duration;

/// How many more holds a cascade whose end is a live member that has not reported waits for
/// that report (see [`hold_longer`]).
pub(crate) const CHAIN_END_WAITS: usize = 3;

/// A failure report as the path judges it: the protocol message's fields, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Incoming<'a> {
    /// The reporter's worker id.
    pub(crate) worker_id: &'a str,
    /// The reporter's incarnation.
    pub(crate) incarnation: u64,
    /// The generation the failure happened in.
    pub(crate) generation: u64,
    /// The rank the reporter names, if any.
    pub(crate) failed_rank: Option<u32>,
    /// What the reporter saw.
    pub(crate) reason: &'a str,
    /// What kind of failure it saw.
    pub(crate) kind: FailureKind,
    /// How far the reporter got on the link it names (`(seq, received)`), for a timeout.
    pub(crate) progress: Option<(u32, u64)>,
}

/// The rank a report blames and the reason it gives: as reported, or re-attributed to a
/// cascade's root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Blame {
    /// The rank blamed, if any.
    pub(crate) failed_rank: Option<u32>,
    /// The reason recorded with the cause.
    pub(crate) reason: String,
}

impl Blame {
    /// The report as its reporter made it.
    pub(crate) fn as_reported(report: &Incoming<'_>) -> Self {
        Self { failed_rank: report.failed_rank, reason: report.reason.to_string() }
    }

    /// The report in the form [`revocation::decide`] and [`revocation::arbitrate`] take.
    pub(crate) fn report<'a>(&'a self, incoming: &Incoming<'a>) -> revocation::Report<'a> {
        revocation::Report {
            worker_id: incoming.worker_id,
            incarnation: incoming.incarnation,
            generation: incoming.generation,
            failed_rank: self.failed_rank,
            reason: &self.reason,
            kind: incoming.kind,
        }
    }
}

/// This report as a link of a timeout cascade, when it is held as one: a timeout naming a
/// suspect, from a member of `current` (the job's newest generation), which is the generation
/// the report is about and not yet revoked. `None`: judge it at once.
pub(crate) fn cascade_link(current: Option<&GenerationRecord>, report: &Incoming<'_>) -> Option<TimeoutReport> {
    let suspect = report.failed_rank.filter(|_| report.kind == FailureKind::Timeout)?;
    let reporter = current
        .filter(|g| g.number == report.generation && g.revoked.is_none())
        .and_then(|g| g.rank_of(report.worker_id, report.incarnation))?;
    Some(TimeoutReport { reporter, suspect, progress: report.progress })
}

/// After `holds` extra holds of the cascade of `generation`, with `chain` and `current` just
/// read: the member at the chain's end to ask about (and its generation), when holding longer could change the
/// verdict (the root is a chain end that has not reported, the generation is still current
/// and unrevoked, fewer than [`CHAIN_END_WAITS`] extra holds were spent). The shell holds
/// again only if that member is fresh ([`is_fresh`]).
///
/// In a lock-step ring a silent link makes every rank time out within a millisecond or two,
/// but on a loaded machine one rank's report can arrive after the first hold; read without
/// it, the cycle looks like a chain whose end is that healthy, fresh rank, and the
/// end-of-chain rule would evict it. A hung or dead end (the case the rule is for) stops
/// heartbeating, so it is soon not fresh and costs at most the extra holds.
pub(crate) fn hold_longer<'g>(
    holds: usize,
    chain: &[TimeoutReport],
    current: Option<&'g GenerationRecord>,
    generation: u64,
) -> Option<(&'g GenerationRecord, &'g Placed)> {
    if holds >= CHAIN_END_WAITS {
        return None;
    }
    let Some(CascadeRoot::ChainEnd(end)) = revocation::cascade_root(chain) else { return None };
    let g = current.filter(|g| g.number == generation && g.revoked.is_none())?;
    Some((g, g.members.get(end as usize)?))
}

/// Whether `member` was heard from within `limit` (twice the heartbeat interval), by the
/// `silences` the shell read for it.
pub(crate) fn is_fresh(silences: &Silences, member: &Placed, limit: Duration) -> bool {
    silences.get(&(member.worker_id.clone(), member.incarnation)).is_some_and(|s| s.at_most < limit)
}

/// The blame after a cascade: the cascade's root when it is not the rank `report` named, with
/// a reason that keeps the reporter's and says why; `None` keeps the report as it is.
pub(crate) fn reattribute(report: &Incoming<'_>, chain: &[TimeoutReport]) -> Option<Blame> {
    let suspect = report.failed_rank?;
    let root = revocation::cascade_root(chain).filter(|root| root.rank() != suspect)?;
    let reporters: Vec<u32> = chain.iter().map(|t| t.reporter).collect();
    let reason = match root {
        CascadeRoot::ChainEnd(rank) => format!(
            "{} (re-attributed to rank {rank}: ranks {reporters:?} timed out waiting on one another, rank {rank} did not)",
            report.reason
        ),
        CascadeRoot::LeastProgress { rank, starved } => format!(
            "{} (re-attributed to rank {rank}: ranks {reporters:?} timed out waiting on one another in a cycle; \
             rank {starved} got least far, so its link from rank {rank} went silent first)",
            report.reason
        ),
    };
    Some(Blame { failed_rank: Some(root.rank()), reason })
}

/// Whether a revoking report is arbitrated against the heartbeat silences
/// ([`revocation::arbitrate`]): a timeout that names a rank.
pub(crate) fn arbitrated(report: &revocation::Report<'_>) -> bool {
    report.kind == FailureKind::Timeout && report.failed_rank.is_some()
}

/// The member a revocation's cause names, `(worker id, incarnation)`, whose lease goes with it.
pub(crate) fn suspect(current: Option<&GenerationRecord>, cause: &Cause) -> Option<(String, u64)> {
    let m = current?.members.get(cause.rank? as usize)?;
    Some((m.worker_id.clone(), m.incarnation))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::next_generation;
    use crate::revocation::tests::each_on_own_host;
    use crate::revocation::Silence;

    fn cause(rank: Option<u32>) -> Cause {
        Cause {
            rank,
            worker_id: String::new(),
            host: String::new(),
            reason: "no progress".into(),
            reported_by: "b".into(),
            domain: String::new(),
            lost_ranks: vec![],
        }
    }

    fn gen(number: u64) -> GenerationRecord {
        let mut g = next_generation(None, each_on_own_host(&["a", "b", "c", "d"]), 0);
        g.number = number;
        g
    }

    fn timeout(worker_id: &'static str, failed_rank: u32) -> Incoming<'static> {
        Incoming {
            worker_id,
            incarnation: 1,
            generation: 4,
            failed_rank: Some(failed_rank),
            reason: "no progress",
            kind: FailureKind::Timeout,
            progress: Some((3, 100)),
        }
    }

    fn link(reporter: u32, suspect: u32) -> TimeoutReport {
        TimeoutReport { reporter, suspect, progress: None }
    }

    #[test]
    fn only_a_members_timeout_about_the_current_unrevoked_generation_is_held() {
        let g = gen(4);
        let held = cascade_link(Some(&g), &timeout("b", 2));
        assert_eq!(held, Some(TimeoutReport { reporter: 1, suspect: 2, progress: Some((3, 100)) }));
        // Not a timeout, or naming nobody: judged at once.
        assert_eq!(cascade_link(Some(&g), &Incoming { kind: FailureKind::PeerClosed, ..timeout("b", 2) }), None);
        assert_eq!(cascade_link(Some(&g), &Incoming { failed_rank: None, ..timeout("b", 2) }), None);
        // Another generation, a revoked one, none at all, or a reporter that is not a member.
        assert_eq!(cascade_link(Some(&gen(5)), &timeout("b", 2)), None);
        let mut revoked = gen(4);
        revoked.revoked = Some(cause(Some(2)));
        assert_eq!(cascade_link(Some(&revoked), &timeout("b", 2)), None);
        assert_eq!(cascade_link(None, &timeout("b", 2)), None);
        assert_eq!(cascade_link(Some(&g), &timeout("z", 2)), None);
        assert_eq!(cascade_link(Some(&g), &Incoming { incarnation: 2, ..timeout("b", 2) }), None);
    }

    #[test]
    fn a_chain_whose_end_has_not_reported_is_held_longer_a_bounded_number_of_times() {
        let g = gen(4);
        // 0 waits on 1, 1 waits on 2: rank 2 is the chain's end and has not reported.
        let chain = [link(0, 1), link(1, 2)];
        assert_eq!(hold_longer(0, &chain, Some(&g), 4).map(|(_, m)| m.worker_id.as_str()), Some("c"));
        assert_eq!(hold_longer(CHAIN_END_WAITS - 1, &chain, Some(&g), 4).map(|(_, m)| m.worker_id.as_str()), Some("c"));
        assert_eq!(hold_longer(CHAIN_END_WAITS, &chain, Some(&g), 4), None);
        // A cycle (everybody reported) is judged at once; so is a chain of a generation that
        // is no longer current or was revoked meanwhile.
        assert_eq!(hold_longer(0, &[link(0, 1), link(1, 0)], Some(&g), 4), None);
        assert_eq!(hold_longer(0, &chain, Some(&gen(5)), 4), None);
        let mut revoked = gen(4);
        revoked.revoked = Some(cause(Some(2)));
        assert_eq!(hold_longer(0, &chain, Some(&revoked), 4), None);
        assert_eq!(hold_longer(0, &chain, None, 4), None);
    }

    #[test]
    fn a_member_is_fresh_when_heard_from_within_the_limit() {
        let g = gen(4);
        let c = &g.members[2];
        let limit = Duration::from_secs(1);
        let mut silences = Silences::new();
        assert!(!is_fresh(&silences, c, limit), "never heard from");
        silences.insert(("c".into(), 1), Silence::exactly(Duration::from_millis(200)));
        assert!(is_fresh(&silences, c, limit));
        silences.insert(("c".into(), 1), Silence::exactly(Duration::from_secs(2)));
        assert!(!is_fresh(&silences, c, limit));
        // Another incarnation's silence says nothing about this one.
        silences.clear();
        silences.insert(("c".into(), 2), Silence::exactly(Duration::from_millis(200)));
        assert!(!is_fresh(&silences, c, limit));
    }

    #[test]
    fn the_cascades_root_takes_the_blame_with_a_reason_that_says_why() {
        // b (rank 1) named a (rank 0), but a waited on c (rank 2), which did not report.
        let report = timeout("b", 0);
        let blame = reattribute(&report, &[link(1, 0), link(0, 2)]).expect("re-attributed");
        assert_eq!(blame.failed_rank, Some(2));
        assert!(blame.reason.starts_with("no progress (re-attributed to rank 2: ranks [1, 0]"), "{}", blame.reason);
        assert!(blame.reason.contains("rank 2 did not"), "{}", blame.reason);
        // A cycle: the rank whose link went silent first.
        let cycle = [
            TimeoutReport { reporter: 0, suspect: 1, progress: Some((5, 10)) },
            TimeoutReport { reporter: 1, suspect: 0, progress: Some((4, 10)) },
        ];
        let blame = reattribute(&timeout("a", 1), &cycle).expect("re-attributed");
        assert!(blame.reason.contains("in a cycle"), "{}", blame.reason);
        // The root is the rank named, or there is no chain: as reported.
        assert_eq!(reattribute(&timeout("a", 1), &[link(0, 1)]), None);
        assert_eq!(reattribute(&timeout("a", 1), &[]), None);
        assert_eq!(reattribute(&Incoming { failed_rank: None, ..timeout("a", 1) }, &[link(1, 0), link(0, 2)]), None);
    }

    #[test]
    fn the_blame_as_reported_feeds_decide_and_the_suspect_is_the_causes_member() {
        let incoming = timeout("b", 2);
        let blame = Blame::as_reported(&incoming);
        let report = blame.report(&incoming);
        assert_eq!((report.failed_rank, report.reason, report.kind), (Some(2), "no progress", FailureKind::Timeout));
        let g = gen(4);
        assert!(arbitrated(&report));
        let closed = Incoming { kind: FailureKind::PeerClosed, ..incoming };
        assert!(!arbitrated(&Blame::as_reported(&closed).report(&closed)));
        let unnamed = Incoming { failed_rank: None, ..incoming };
        assert!(!arbitrated(&Blame::as_reported(&unnamed).report(&unnamed)));
        assert_eq!(suspect(Some(&g), &cause(Some(3))), Some(("d".to_string(), 1)));
        assert_eq!(suspect(Some(&g), &cause(Some(9))), None);
        assert_eq!(suspect(Some(&g), &cause(None)), None);
        assert_eq!(suspect(None, &cause(Some(3))), None);
    }
}
