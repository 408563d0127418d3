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
//!    generation once. [`unreported_chain_ends`] and [`hold_again`]: while every end of the
//!    chain is a live member (heard from within twice the heartbeat interval) that has not
//!    reported yet, at most [`CHAIN_END_WAITS`] more holds.
//! 3. [`cascade_root`]: the cascade's root; among several chain ends, the one silent longest
//!    by its heartbeats. [`reattribute`]: that root, when it is not the rank named, takes the
//!    blame, with a reason that says why.
//! 4. [`revocation::decide`] and [`revocation::arbitrate`] judge the report against the
//!    generation as last read; a revocation's suspect is [`suspect`].

use crate::records::{Cause, GenerationRecord, Placed};
use crate::revocation::{self, CascadeRoot, FailureKind, Silences, TimeoutReport};
use std::time::Duration;

/// How many more holds a cascade whose end is a live member that has not reported waits for
/// that report (see [`hold_again`]).
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

/// The members at the ends of the cascade `chain` of `generation` (and that generation, as
/// `current` was just read), when waiting for their reports could change the verdict: the
/// root is a chain end that has not reported, and the generation is still current and
/// unrevoked. `None`: judge the cascade now. The shell holds again only while [`hold_again`]
/// says so: an end that went silent is the cascade's root ([`cascade_root`]) whatever the
/// others report.
///
/// In a lock-step ring a silent link makes every rank time out within a millisecond or two,
/// but on a loaded machine one rank's report can arrive after the first hold; read without
/// it, the cycle looks like a chain whose end is that healthy, fresh rank, and the
/// end-of-chain rule would evict it. A hung or dead end (the case the rule is for) stops
/// heartbeating, so it is soon not fresh and costs at most the extra holds.
pub(crate) fn unreported_chain_ends<'g>(
    chain: &[TimeoutReport],
    current: Option<&'g GenerationRecord>,
    generation: u64,
) -> Option<(&'g GenerationRecord, Vec<&'g Placed>)> {
    let Some(CascadeRoot::ChainEnd(_)) = revocation::cascade_root(chain) else { return None };
    let g = current.filter(|g| g.number == generation && g.revoked.is_none())?;
    let ends: Vec<&Placed> =
        revocation::chain_ends(chain).into_iter().filter_map(|end| g.members.get(end as usize)).collect();
    (!ends.is_empty()).then_some((g, ends))
}

/// Whether a cascade whose [`unreported_chain_ends`] were read is held once more, after
/// `holds` extra holds: only while every one of those ends is fresh ([`is_fresh`], `all_fresh`)
/// and fewer than [`CHAIN_END_WAITS`] extra holds were spent.
pub(crate) fn hold_again(all_fresh: bool, holds: usize) -> bool {
    all_fresh && holds < CHAIN_END_WAITS
}

/// The root of the cascade `chain` ([`revocation::cascade_root`]), with the heartbeat
/// `silences` read for its chain ends in `g`: when several ranks were waited on and did not
/// report, the one silent longest (by the lower bound; the earliest named on a tie) is the
/// root. A rank that is only late with its own report keeps beating, while a stopped one has
/// been silent since it stopped, a no-progress deadline before the reports; blaming the
/// first end named would evict the healthy one.
pub(crate) fn cascade_root(
    chain: &[TimeoutReport],
    g: Option<&GenerationRecord>,
    silences: &Silences,
) -> Option<CascadeRoot> {
    let root = revocation::cascade_root(chain)?;
    let (CascadeRoot::ChainEnd(first), Some(g)) = (root, g) else { return Some(root) };
    let silent_for = |rank: u32| {
        g.members
            .get(rank as usize)
            .and_then(|m| silences.get(&(m.worker_id.clone(), m.incarnation)))
            .map_or(Duration::ZERO, |s| s.at_least)
    };
    let mut root = (first, silent_for(first));
    for end in revocation::chain_ends(chain) {
        let silent = silent_for(end);
        if silent > root.1 {
            root = (end, silent);
        }
    }
    Some(CascadeRoot::ChainEnd(root.0))
}

/// Whether `member` was heard from within `limit` (twice the heartbeat interval), by the
/// `silences` the shell read for it.
pub(crate) fn is_fresh(silences: &Silences, member: &Placed, limit: Duration) -> bool {
    silences.get(&(member.worker_id.clone(), member.incarnation)).is_some_and(|s| s.at_most < limit)
}

/// The blame after a cascade: its `root` ([`cascade_root`]) when it is not the rank `report`
/// named, with a reason that keeps the reporter's and says why; `None` keeps the report as it
/// is.
pub(crate) fn reattribute(report: &Incoming<'_>, chain: &[TimeoutReport], root: Option<CascadeRoot>) -> Option<Blame> {
    let suspect = report.failed_rank?;
    let root = root.filter(|root| root.rank() != suspect)?;
    let reporters: Vec<u32> = chain.iter().map(|t| t.reporter).collect();
    let ends = revocation::chain_ends(chain);
    let reason = match root {
        CascadeRoot::ChainEnd(rank) if ends.len() > 1 => format!(
            "{} (re-attributed to rank {rank}: ranks {reporters:?} timed out waiting on one another; of ranks \
             {ends:?}, which did not, rank {rank} was silent longest)",
            report.reason
        ),
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
        let ends = |chain: &[TimeoutReport]| {
            unreported_chain_ends(chain, Some(&g), 4)
                .map(|(_, m)| m.iter().map(|m| m.worker_id.as_str()).collect::<Vec<_>>())
        };
        assert_eq!(ends(&chain), Some(vec!["c"]));
        // Held again while the ends are fresh, at most CHAIN_END_WAITS times; a silent end
        // ends the holding at once.
        assert!(hold_again(true, 0));
        assert!(hold_again(true, CHAIN_END_WAITS - 1));
        assert!(!hold_again(true, CHAIN_END_WAITS));
        assert!(!hold_again(false, 0));
        // Two ends, both waited on, neither reported: both are asked about, in the order named.
        assert_eq!(ends(&[link(0, 3), link(1, 2)]), Some(vec!["d", "c"]));
        // A cycle (everybody reported) is judged at once; so is a chain of a generation that
        // is no longer current or was revoked meanwhile.
        assert_eq!(ends(&[link(0, 1), link(1, 0)]), None);
        assert_eq!(unreported_chain_ends(&chain, Some(&gen(5)), 4), None);
        let mut revoked = gen(4);
        revoked.revoked = Some(cause(Some(2)));
        assert_eq!(unreported_chain_ends(&chain, Some(&revoked), 4), None);
        assert_eq!(unreported_chain_ends(&chain, None, 4), None);
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
        let chain = [link(1, 0), link(0, 2)];
        let blame = reattribute(&report, &chain, revocation::cascade_root(&chain)).expect("re-attributed");
        assert_eq!(blame.failed_rank, Some(2));
        assert!(blame.reason.starts_with("no progress (re-attributed to rank 2: ranks [1, 0]"), "{}", blame.reason);
        assert!(blame.reason.contains("rank 2 did not"), "{}", blame.reason);
        // A cycle: the rank whose link went silent first.
        let cycle = [
            TimeoutReport { reporter: 0, suspect: 1, progress: Some((5, 10)) },
            TimeoutReport { reporter: 1, suspect: 0, progress: Some((4, 10)) },
        ];
        let blame = reattribute(&timeout("a", 1), &cycle, revocation::cascade_root(&cycle)).expect("re-attributed");
        assert!(blame.reason.contains("in a cycle"), "{}", blame.reason);
        // The root is the rank named, or there is no chain: as reported.
        let one = [link(0, 1)];
        assert_eq!(reattribute(&timeout("a", 1), &one, revocation::cascade_root(&one)), None);
        assert_eq!(reattribute(&timeout("a", 1), &[], None), None);
        let unnamed = Incoming { failed_rank: None, ..timeout("a", 1) };
        assert_eq!(reattribute(&unnamed, &chain, revocation::cascade_root(&chain)), None);
    }

    /// Seed 5160 of the simulation, in small: a host of ranks stopped, and one healthy rank
    /// that timed out like the rest was slow to report. Both it and the stopped ranks are
    /// chain ends; the one silent longest is the root, whatever the order of the reports,
    /// and the reason names the ends.
    #[test]
    fn among_several_chain_ends_the_one_silent_longest_is_the_root() {
        let g = gen(4);
        // a (0) waited on c (2), which is only late with its report; b (1) waited on d (3),
        // stopped 1.6 s ago.
        let chain = [link(0, 2), link(1, 3)];
        let mut silences = Silences::new();
        silences.insert(
            ("c".into(), 1),
            Silence { at_least: Duration::from_millis(100), at_most: Duration::from_millis(300) },
        );
        silences.insert(
            ("d".into(), 1),
            Silence { at_least: Duration::from_millis(1600), at_most: Duration::from_millis(1900) },
        );
        assert_eq!(revocation::cascade_root(&chain), Some(CascadeRoot::ChainEnd(2)), "the first end named");
        assert_eq!(cascade_root(&chain, Some(&g), &silences), Some(CascadeRoot::ChainEnd(3)));
        let reversed = [link(1, 3), link(0, 2)];
        assert_eq!(cascade_root(&reversed, Some(&g), &silences), Some(CascadeRoot::ChainEnd(3)));
        let blame = reattribute(&timeout("a", 2), &chain, cascade_root(&chain, Some(&g), &silences)).expect("moved");
        assert_eq!(blame.failed_rank, Some(3));
        assert!(blame.reason.contains("of ranks [2, 3], which did not, rank 3 was silent longest"), "{}", blame.reason);
        // Without silences (none read), or with one end: the first end named, as before.
        assert_eq!(cascade_root(&chain, Some(&g), &Silences::new()), Some(CascadeRoot::ChainEnd(2)));
        assert_eq!(cascade_root(&chain, None, &silences), Some(CascadeRoot::ChainEnd(2)));
        let single = [link(0, 1), link(1, 2)];
        assert_eq!(cascade_root(&single, Some(&g), &silences), Some(CascadeRoot::ChainEnd(2)));
        // A cycle is judged by progress, not silences.
        let cycle = [
            TimeoutReport { reporter: 0, suspect: 1, progress: Some((5, 10)) },
            TimeoutReport { reporter: 1, suspect: 0, progress: Some((4, 10)) },
        ];
        assert_eq!(cascade_root(&cycle, Some(&g), &silences), revocation::cascade_root(&cycle));
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
