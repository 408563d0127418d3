//! Revocation decisions, as pure logic: what a failure report does to a generation, and
//! which lapsed member (if any) revokes the active generation.
//!
//! The first report of generation g is its root cause; g is marked revoked in the same
//! compare-and-swap that records the cause, so every later report (from any replica) sees
//! it and is answered with that first cause (`accepted = false`). Reports about an older
//! generation change nothing. The suspect of an accepted report is evicted (its lease is
//! revoked, so its keys go): if it is in fact alive, its next heartbeat or rendezvous gets
//! NOT_FOUND and it joins again as a new incarnation, entering the next generation as a
//! joiner.
//!
//! Timeout reports are arbitrated ([`arbitrate`]): when a rank V hangs, its neighbour A
//! times out naming V, but a rank B blocked behind A times out too and names A. If B's
//! report comes first, taking it as reported would evict the healthy A and leave V in
//! place. So a TIMEOUT report whose suspect is alive by the coordinator's own heartbeat
//! observations, while another member of the generation has certainly been silent, blames
//! the silent member instead.

use crate::records::{Cause, GenerationRecord, JobState};
use std::time::Duration;

/// What the reporter observed (the protocol's `FailureReport.FailureKind`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum FailureKind {
    /// Not said (older workers): taken as reported.
    #[default]
    Unspecified,
    /// The peer closed or reset its link: taken as reported.
    PeerClosed,
    /// No progress from the peer before a deadline: arbitrated.
    Timeout,
    /// The peer broke the protocol: taken as reported.
    Protocol,
    /// Anything else: taken as reported.
    Other,
}

impl FailureKind {
    /// From the protocol's enum value (unknown values are `Unspecified`).
    pub(crate) fn from_proto(value: i32) -> Self {
        use cohort_proto::v1::failure_report::FailureKind as K;
        match K::try_from(value) {
            Ok(K::PeerClosed) => Self::PeerClosed,
            Ok(K::Timeout) => Self::Timeout,
            Ok(K::Protocol) => Self::Protocol,
            Ok(K::Other) => Self::Other,
            _ => Self::Unspecified,
        }
    }
}

/// How long a member has gone without a heartbeat, as the coordinator observed it: bounds,
/// because the observations are coarse (a lease's time to live in whole seconds, a progress
/// record written at most once a period). Both are measured on coordinator or store clocks,
/// never a worker's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Silence {
    /// The member has certainly been silent at least this long.
    pub(crate) at_least: Duration,
    /// The member was certainly heard from within this long.
    pub(crate) at_most: Duration,
}

impl Silence {
    /// Known exactly.
    pub(crate) fn exactly(d: Duration) -> Self {
        Self { at_least: d, at_most: d }
    }

    /// The tighter of two observations of the same member.
    pub(crate) fn and(self, other: Silence) -> Self {
        Self { at_least: self.at_least.max(other.at_least), at_most: self.at_most.min(other.at_most) }
    }
}

/// What a failure report does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ReportDecision {
    /// Revoke the current generation with this cause; the suspect (if any) is `members[rank]`.
    Revoke(Cause),
    /// Already revoked, or about an older generation: nothing changes; the known cause.
    Ignore(Option<Cause>),
}

/// Why a failure report is refused (nothing changes). The service answers the first four
/// with INVALID_ARGUMENT and [`ReportError::NotMember`] with PERMISSION_DENIED.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ReportError {
    /// Generation 0 was named.
    #[error("generation 0 does not exist (generations start at 1)")]
    GenerationZero,
    /// The job has no generation yet.
    #[error("generation {reported} is in the future (the job has no generation yet)")]
    NoGeneration {
        /// The generation reported.
        reported: u64,
    },
    /// A generation newer than the job's newest was named.
    #[error("generation {reported} is in the future (the job's newest generation is {newest})")]
    Future {
        /// The generation reported.
        reported: u64,
        /// The job's newest generation.
        newest: u64,
    },
    /// The failed rank is not a rank of the generation.
    #[error("failed_rank {rank} is not a rank of generation {generation} (size {size})")]
    RankOutside {
        /// The rank reported.
        rank: u32,
        /// The generation.
        generation: u64,
        /// Its size.
        size: usize,
    },
    /// The reporter is not a member of the generation.
    #[error(
        "worker {worker_id} (incarnation {incarnation}) is not a member of generation {generation} and cannot report its failure"
    )]
    NotMember {
        /// The reporter's worker id.
        worker_id: String,
        /// The reporter's incarnation.
        incarnation: u64,
        /// The generation.
        generation: u64,
    },
}

/// A failure report as the decision needs it.
#[derive(Clone, Debug)]
pub(crate) struct Report<'a> {
    /// Reporter's worker id.
    pub(crate) worker_id: &'a str,
    /// Reporter's incarnation.
    pub(crate) incarnation: u64,
    /// The generation reported.
    pub(crate) generation: u64,
    /// The failed rank, if known.
    pub(crate) failed_rank: Option<u32>,
    /// Why.
    pub(crate) reason: &'a str,
    /// What the reporter observed.
    pub(crate) kind: FailureKind,
}

/// Decides a failure report against the current generation record.
///
/// Errors (no state change, see [`ReportError`]): generation 0, no generation yet or a
/// generation from the future, a failed rank outside the generation, a reporter that is not
/// a member of the generation.
pub(crate) fn decide(current: Option<&GenerationRecord>, report: &Report<'_>) -> Result<ReportDecision, ReportError> {
    if report.generation == 0 {
        return Err(ReportError::GenerationZero);
    }
    let Some(g) = current else {
        return Err(ReportError::NoGeneration { reported: report.generation });
    };
    if report.generation > g.number {
        return Err(ReportError::Future { reported: report.generation, newest: g.number });
    }
    if report.generation < g.number {
        return Ok(ReportDecision::Ignore(g.cause_of(report.generation).cloned()));
    }
    if let Some(rank) = report.failed_rank {
        if rank as usize >= g.members.len() {
            return Err(ReportError::RankOutside { rank, generation: g.number, size: g.members.len() });
        }
    }
    if g.rank_of(report.worker_id, report.incarnation).is_none() {
        return Err(ReportError::NotMember {
            worker_id: report.worker_id.to_string(),
            incarnation: report.incarnation,
            generation: g.number,
        });
    }
    if let Some(cause) = &g.revoked {
        return Ok(ReportDecision::Ignore(Some(cause.clone())));
    }
    let suspect = report.failed_rank.and_then(|r| g.members.get(r as usize));
    Ok(ReportDecision::Revoke(Cause {
        rank: report.failed_rank,
        worker_id: suspect.map(|m| m.worker_id.clone()).unwrap_or_default(),
        host: suspect.map(|m| m.host.clone()).unwrap_or_default(),
        reason: report.reason.to_string(),
        reported_by: report.worker_id.to_string(),
        domain: String::new(),
        lost_ranks: Vec::new(),
    }))
}

/// Observed silences by (worker id, incarnation).
pub(crate) type Silences = std::collections::BTreeMap<(String, u64), Silence>;

/// Arbitrates a TIMEOUT report that [`decide`] would revoke with: the cause to record
/// instead, if the report's suspect is the wrong one.
///
/// `silence` is what the coordinator knows of members' heartbeats, by (worker id,
/// incarnation) (absent: nothing; entries of non-members are never considered). The rule: the report is a timeout naming a rank S; S is fresh (heard from
/// within `2 x heartbeat_interval`, by the upper bound); and some other member, neither
/// the reporter nor S nor departed, is stale (silent longer than `2 x heartbeat_interval`,
/// by the lower bound, so a coarse observation never makes a live member look stale). Then
/// the stalest such member (by lower bound; the lowest rank on a tie) is blamed, and the
/// reason says it was re-attributed. Otherwise (another kind, no suspect, S not known to be
/// fresh, nobody stale: e.g. a real partition between two live workers) `None`: the report
/// stands.
pub(crate) fn arbitrate(
    g: &GenerationRecord,
    report: &Report<'_>,
    silence: &Silences,
    heartbeat_interval: Duration,
) -> Option<Cause> {
    if report.kind != FailureKind::Timeout {
        return None;
    }
    let suspect = report.failed_rank? as usize;
    let limit = heartbeat_interval * 2;
    let of = |m: &crate::records::Placed| silence.get(&(m.worker_id.clone(), m.incarnation)).copied();
    let fresh = g.members.get(suspect).and_then(of).is_some_and(|s| s.at_most < limit);
    if !fresh {
        return None;
    }
    let reporter = g.rank_of(report.worker_id, report.incarnation).map(|r| r as usize);
    let departures = g.departures();
    let (rank, m, s) = g
        .members
        .iter()
        .enumerate()
        .filter(|(rank, m)| {
            *rank != suspect && Some(*rank) != reporter && !departures.contains(&m.worker_id, m.incarnation)
        })
        .filter_map(|(rank, m)| of(m).map(|s| (rank, m, s)))
        .filter(|(_, _, s)| s.at_least > limit)
        .fold(None, |best: Option<(usize, &crate::records::Placed, Silence)>, c| match best {
            Some(b) if b.2.at_least >= c.2.at_least => Some(b),
            _ => Some(c),
        })?;
    let reporter_rank = reporter.map_or_else(|| "?".to_string(), |r| r.to_string());
    Some(Cause {
        rank: Some(rank as u32),
        worker_id: m.worker_id.clone(),
        host: m.host.clone(),
        reason: format!(
            "no heartbeat for {:.1} s (rank {reporter_rank} timed out waiting on rank {suspect}, which is alive; it reported: {})",
            s.at_least.as_secs_f64(),
            report.reason
        ),
        reported_by: report.worker_id.to_string(),
        domain: String::new(),
        lost_ranks: Vec::new(),
    })
}

/// The generation record revoked with `cause` at `now_ms`.
pub(crate) fn revoked(g: &GenerationRecord, cause: Cause, now_ms: u64) -> GenerationRecord {
    let mut g = g.clone();
    g.revoked = Some(cause);
    g.revoked_at_ms = Some(now_ms);
    g
}

/// The first member (by rank) of the active generation whose lease lapsed: not live with
/// the same incarnation and not departed. `None` when the generation is revoked or whole.
///
/// A restarted worker (a newer incarnation under the same id) is caught here too; Join
/// revokes with a better cause ("worker restarted") before it replaces the member key, so
/// this only fires for it if that revocation was lost.
pub(crate) fn lapsed(state: &JobState, lease_ttl_ms: u64) -> Option<Cause> {
    let g = state.current()?;
    if g.revoked.is_some() {
        return None;
    }
    let departures = g.departures();
    g.members.iter().enumerate().find_map(|(rank, m)| {
        if state.is_live(&m.worker_id, m.incarnation) || departures.contains(&m.worker_id, m.incarnation) {
            return None;
        }
        Some(Cause {
            rank: Some(rank as u32),
            worker_id: m.worker_id.clone(),
            host: m.host.clone(),
            reason: format!("lease expired (no heartbeat for {lease_ttl_ms} ms)"),
            reported_by: "coordinator".into(),
            domain: String::new(),
            lost_ranks: Vec::new(),
        })
    })
}

/// How long a timeout report is held before its generation is revoked, so that the other
/// timeout reports of the same cascade are seen together (see [`cascade_root`]). A
/// no-progress deadline is seconds; this adds little to it. Reports of a closed link (a dead
/// process) are never held.
pub(crate) const TIMEOUT_HOLD: std::time::Duration = std::time::Duration::from_millis(50);

/// One timeout report of a generation, as the coordinator keeps it for [`cascade_root`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TimeoutReport {
    /// The rank that timed out.
    pub(crate) reporter: u32,
    /// The rank it was waiting on.
    pub(crate) suspect: u32,
    /// How far the reporter got in the failed operation, `(op seq, messages received)`, if
    /// it said (see `FailureReport.progress`).
    pub(crate) progress: Option<(u32, u64)>,
}

/// The rank [`cascade_root`] blames, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CascadeRoot {
    /// The end of a chain: a suspect that did not itself time out (it is stopped, or it is
    /// the far end of a silent link and still hears from its own peers).
    ChainEnd(u32),
    /// Every suspect timed out too (a cycle): `starved`, the reporter that got least far in
    /// the operation, waited on `rank`, so the link from `rank` to `starved` went silent first.
    LeastProgress {
        /// The blamed rank (the starved reporter's suspect).
        rank: u32,
        /// The reporter that got least far.
        starved: u32,
    },
}

impl CascadeRoot {
    /// The blamed rank.
    pub(crate) fn rank(self) -> u32 {
        match self {
            CascadeRoot::ChainEnd(rank) | CascadeRoot::LeastProgress { rank, .. } => rank,
        }
    }
}

/// The root of a cascade of timeouts, given the timeout reports of one generation in arrival
/// order.
///
/// Why: when a rank hangs (SIGSTOP) or a link goes silent (blackhole), its neighbour times out
/// first, and every rank waiting behind that neighbour times out a moment later, each naming
/// the live rank it waited on.
/// - Every such live rank is itself a reporter; the rank at the end of the chain is not (it is
///   stopped, or it is the far end of the silent link and still has data flowing to it): the
///   suspect of the earliest report whose suspect did not report is blamed.
/// - In a lock-step schedule (the ring) a silent link starves every rank, so every suspect
///   reports too and the chain is a cycle. Then the reporter that got least far in the
///   operation is the one behind the silent link: each rank downstream of it received at
///   least one message more before starving. Its suspect is blamed, if every report carries
///   its progress and the least is unique.
///
/// `None` when neither applies: the earliest report stands.
pub(crate) fn cascade_root(reports: &[TimeoutReport]) -> Option<CascadeRoot> {
    if let Some(&rank) = chain_ends(reports).first() {
        return Some(CascadeRoot::ChainEnd(rank));
    }
    cycle_root(reports)
}

/// Every chain end of a cascade: each suspect that did not report a timeout itself, once, in
/// the order of the earliest report naming it. Two or more when ranks on several sides of
/// the cascade stopped (a host of several ranks stopped), or when one end is only late
/// with its own report.
pub(crate) fn chain_ends(reports: &[TimeoutReport]) -> Vec<u32> {
    let mut ends: Vec<u32> = Vec::new();
    for s in reports.iter().map(|r| r.suspect) {
        if !reports.iter().any(|r| r.reporter == s) && !ends.contains(&s) {
            ends.push(s);
        }
    }
    ends
}

/// The root of a cascade that is a cycle (every suspect reported): see [`cascade_root`].
fn cycle_root(reports: &[TimeoutReport]) -> Option<CascadeRoot> {
    let progress: Option<Vec<(u32, u64)>> = reports.iter().map(|r| r.progress).collect();
    let progress = progress?;
    let least = *progress.iter().min()?;
    let mut starved = reports.iter().zip(&progress).filter(|(_, p)| **p == least).map(|(r, _)| r);
    let first = starved.next()?;
    if starved.any(|r| r.reporter != first.reporter || r.suspect != first.suspect) {
        return None;
    }
    Some(CascadeRoot::LeastProgress { rank: first.suspect, starved: first.reporter })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::records::{MemberRecord, Placed};
    use crate::rendezvous::next_generation;

    /// Members named `names`, each on a host of its own (`host-<name>`), incarnation 1.
    pub(crate) fn each_on_own_host(names: &[&str]) -> Vec<Placed> {
        names
            .iter()
            .map(|w| Placed {
                worker_id: w.to_string(),
                incarnation: 1,
                host: format!("host-{w}"),
                addresses: vec![],
                domain: String::new(),
            })
            .collect()
    }

    fn gen(number: u64) -> GenerationRecord {
        let mut g = next_generation(None, each_on_own_host(&["a", "b", "c"]), 0);
        g.number = number;
        g
    }

    fn report(generation: u64, failed_rank: Option<u32>) -> Report<'static> {
        Report {
            worker_id: "a",
            incarnation: 1,
            generation,
            failed_rank,
            reason: "peer closed",
            kind: FailureKind::PeerClosed,
        }
    }

    const HB: Duration = Duration::from_millis(500);

    fn timeout(reporter: &'static str, failed_rank: u32) -> Report<'static> {
        Report {
            worker_id: reporter,
            incarnation: 1,
            generation: 4,
            failed_rank: Some(failed_rank),
            reason: "timed out after 1.5s waiting on rank 1",
            kind: FailureKind::Timeout,
        }
    }

    fn ms(v: u64) -> Option<Silence> {
        Some(Silence::exactly(Duration::from_millis(v)))
    }

    /// Silences of workers a, b, c, d, e, ... (incarnation 1), in that order.
    fn obs<const N: usize>(v: [Option<Silence>; N]) -> Silences {
        v.iter().zip(["a", "b", "c", "d", "e", "z"]).filter_map(|(s, w)| s.map(|s| ((w.to_string(), 1), s))).collect()
    }

    fn four() -> GenerationRecord {
        let mut g = next_generation(None, each_on_own_host(&["a", "b", "c", "d"]), 0);
        g.number = 4;
        g
    }

    #[test]
    fn timeout_naming_a_live_rank_blames_the_silent_one() {
        let g = four();
        // a (rank 0) names b (rank 1), which heartbeats; c and d are silent, d longer.
        let cause =
            arbitrate(&g, &timeout("a", 1), &obs([ms(100), ms(200), ms(1200), ms(1600)]), HB).expect("re-attributed");
        assert_eq!((cause.rank, cause.worker_id.as_str(), cause.host.as_str()), (Some(3), "d", "host-d"));
        assert_eq!(cause.reported_by, "a");
        assert!(
            cause.reason.starts_with("no heartbeat for 1.6 s (rank 0 timed out waiting on rank 1, which is alive"),
            "{}",
            cause.reason
        );
        // A tie goes to the lowest rank.
        let cause =
            arbitrate(&g, &timeout("a", 1), &obs([ms(100), ms(200), ms(1600), ms(1600)]), HB).expect("re-attributed");
        assert_eq!(cause.rank, Some(2));
    }

    #[test]
    fn nobody_stale_keeps_the_suspect() {
        let g = four();
        // Everyone heartbeats: a real partition between live a and b; the report stands.
        assert_eq!(arbitrate(&g, &timeout("a", 1), &obs([ms(100), ms(200), ms(400), ms(999)]), HB), None);
        // Stale means certainly stale: a coarse observation (lower bound under the limit) is not.
        let coarse = Some(Silence { at_least: Duration::from_millis(900), at_most: Duration::from_millis(1900) });
        assert_eq!(arbitrate(&g, &timeout("a", 1), &obs([ms(100), ms(200), coarse, ms(300)]), HB), None);
        // Nothing known about the others: no arbitration.
        assert_eq!(arbitrate(&g, &timeout("a", 1), &obs([ms(100), ms(200), None, None]), HB), None);
    }

    #[test]
    fn suspect_not_known_fresh_keeps_the_suspect() {
        let g = four();
        assert_eq!(arbitrate(&g, &timeout("a", 1), &obs([ms(100), ms(1000), ms(1600), ms(100)]), HB), None);
        assert_eq!(arbitrate(&g, &timeout("a", 1), &obs([ms(100), None, ms(1600), ms(100)]), HB), None);
        let coarse = Some(Silence { at_least: Duration::ZERO, at_most: Duration::from_millis(1500) });
        assert_eq!(arbitrate(&g, &timeout("a", 1), &obs([ms(100), coarse, ms(1600), ms(100)]), HB), None);
    }

    #[test]
    fn only_timeouts_are_arbitrated() {
        let g = four();
        let silence = obs([ms(100), ms(200), ms(1600), ms(100)]);
        for kind in [FailureKind::Unspecified, FailureKind::PeerClosed, FailureKind::Protocol, FailureKind::Other] {
            assert_eq!(arbitrate(&g, &Report { kind, ..timeout("a", 1) }, &silence, HB), None, "{kind:?}");
        }
        assert_eq!(arbitrate(&g, &Report { failed_rank: None, ..timeout("a", 1) }, &silence, HB), None);
        assert!(arbitrate(&g, &timeout("a", 1), &silence, HB).is_some());
    }

    #[test]
    fn reporter_and_departed_are_never_blamed() {
        let mut g = four();
        // The reporter itself is the silent one (its heartbeats stalled): not blamed.
        assert_eq!(arbitrate(&g, &timeout("c", 1), &obs([ms(100), ms(200), ms(1600), ms(100)]), HB), None);
        // A member that left gracefully is not blamed.
        g.departed.push(crate::records::Departure { worker_id: "d".into(), incarnation: 1, finished: false });
        assert_eq!(arbitrate(&g, &timeout("a", 1), &obs([ms(100), ms(200), ms(100), ms(5000)]), HB), None);
    }

    #[test]
    fn stale_member_outside_the_generation_is_ignored() {
        let g = four();
        // A silent worker outside the generation (a joiner waiting for the next one) is not
        // blamed, nor an older incarnation of a member.
        assert_eq!(arbitrate(&g, &timeout("a", 1), &obs([ms(100), ms(200), ms(100), ms(100), ms(9000)]), HB), None);
        let mut silence = obs([ms(100), ms(200), ms(100), ms(100)]);
        silence.insert(("d".into(), 7), Silence::exactly(Duration::from_secs(9)));
        assert_eq!(arbitrate(&g, &timeout("a", 1), &silence, HB), None);
        // A stranger's worker id as reporter has no rank; only members can be blamed.
        let stranger = Report { worker_id: "z", ..timeout("z", 1) };
        let cause = arbitrate(&g, &stranger, &obs([ms(100), ms(200), ms(100), ms(1600)]), HB).expect("re-attributed");
        assert_eq!(cause.worker_id, "d");
    }

    #[test]
    fn first_report_is_the_root_cause() {
        let g = gen(4);
        let ReportDecision::Revoke(cause) = decide(Some(&g), &report(4, Some(1))).expect("valid") else {
            panic!("expected a revocation")
        };
        assert_eq!((cause.rank, cause.worker_id.as_str(), cause.host.as_str()), (Some(1), "b", "host-b"));
        assert_eq!(cause.reported_by, "a");
        let g = revoked(&g, cause.clone(), 9);
        assert_eq!(decide(Some(&g), &report(4, Some(2))).expect("valid"), ReportDecision::Ignore(Some(cause)));
    }

    #[test]
    fn older_generation_is_ignored_and_bad_reports_refused() {
        let g = gen(4);
        assert_eq!(decide(Some(&g), &report(3, Some(0))).expect("valid"), ReportDecision::Ignore(None));
        assert_eq!(decide(Some(&g), &report(5, None)), Err(ReportError::Future { reported: 5, newest: 4 }));
        assert_eq!(
            decide(Some(&g), &report(4, Some(3))),
            Err(ReportError::RankOutside { rank: 3, generation: 4, size: 3 })
        );
        assert_eq!(decide(None, &report(1, None)), Err(ReportError::NoGeneration { reported: 1 }));
        assert_eq!(decide(Some(&g), &report(0, None)), Err(ReportError::GenerationZero));
        let stranger = Report { worker_id: "z", ..report(4, None) };
        assert_eq!(
            decide(Some(&g), &stranger),
            Err(ReportError::NotMember { worker_id: "z".into(), incarnation: 1, generation: 4 })
        );
    }

    #[test]
    fn lapsed_member_is_found() {
        let mut state = JobState { job: "j".into(), ..Default::default() };
        for w in ["a", "c"] {
            state.members.insert(
                w.into(),
                MemberRecord {
                    worker_id: w.into(),
                    incarnation: 1,
                    host: String::new(),
                    addresses: vec![],
                    capabilities: vec![],
                    joined_at_ms: 0,
                    domain: String::new(),
                    host_lease: 0,
                },
            );
        }
        state.generation = Some((gen(2), 1));
        let cause = lapsed(&state, 1000).expect("b lapsed");
        assert_eq!((cause.rank, cause.worker_id.as_str(), cause.reported_by.as_str()), (Some(1), "b", "coordinator"));
        assert!(cause.reason.contains("lease expired"));
        if let Some((g, _)) = state.generation.as_mut() {
            g.departed.push(crate::records::Departure { worker_id: "b".into(), incarnation: 1, finished: false });
        }
        assert_eq!(lapsed(&state, 1000), None, "a graceful leave is not a lapse");
    }

    fn chain(reports: &[(u32, u32)]) -> Vec<TimeoutReport> {
        reports.iter().map(|&(reporter, suspect)| TimeoutReport { reporter, suspect, progress: None }).collect()
    }

    fn root(reports: &[(u32, u32)]) -> Option<u32> {
        cascade_root(&chain(reports)).map(CascadeRoot::rank)
    }

    #[test]
    fn cascade_root_follows_the_chain_to_the_rank_that_did_not_time_out() {
        // Rank 2 hangs: 3 waits on 2, then 0 waits on 3, then 1 waits on 0 (a ring).
        assert_eq!(root(&[(3, 2), (0, 3), (1, 0)]), Some(2));
        // The same cascade with the reports arriving in another order.
        assert_eq!(root(&[(0, 3), (1, 0), (3, 2)]), Some(2));
        assert_eq!(root(&[(1, 0), (0, 3)]), Some(3));
        // One report: its suspect.
        assert_eq!(root(&[(1, 2)]), Some(2));
        assert_eq!(cascade_root(&chain(&[(1, 2)])), Some(CascadeRoot::ChainEnd(2)));
        // Every suspect reported too (a full cycle) and no progress known: no answer.
        assert_eq!(root(&[(0, 1), (1, 0)]), None);
        assert_eq!(root(&[]), None);
    }

    #[test]
    fn in_a_cycle_the_rank_that_got_least_far_points_at_the_silent_link() {
        // Ring of 4, link 1 -> 2 silent in op 7: rank 2 received 3 messages, each rank
        // downstream one more; every rank times out, in an order the network chose.
        let r = |reporter, suspect, received| TimeoutReport { reporter, suspect, progress: Some((7, received)) };
        let reports = [r(0, 3, 5), r(1, 0, 6), r(3, 2, 4), r(2, 1, 3)];
        assert_eq!(cascade_root(&reports), Some(CascadeRoot::LeastProgress { rank: 1, starved: 2 }));
        // A rank that finished the operation and starves in the next is further along,
        // whatever its message count.
        let reports =
            [TimeoutReport { reporter: 3, suspect: 2, progress: Some((8, 0)) }, r(0, 3, 5), r(1, 0, 5), r(2, 1, 4)];
        assert_eq!(cascade_root(&reports).map(CascadeRoot::rank), Some(1));
        // A tie between different reporters proves nothing: the earliest report stands.
        assert_eq!(cascade_root(&[r(0, 1, 2), r(1, 0, 2)]), None);
        // One report without progress (an older worker): no guess.
        assert_eq!(cascade_root(&[r(0, 1, 2), TimeoutReport { reporter: 1, suspect: 0, progress: None }]), None);
    }
}
