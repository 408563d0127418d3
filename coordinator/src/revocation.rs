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

use crate::records::{Cause, GenerationRecord, JobState};
use tonic::Status;

/// What a failure report does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReportDecision {
    /// Revoke the current generation with this cause; the suspect (if any) is `members[rank]`.
    Revoke(Cause),
    /// Already revoked, or about an older generation: nothing changes; the known cause.
    Ignore(Option<Cause>),
}

/// A failure report as the decision needs it.
#[derive(Clone, Debug)]
pub struct Report<'a> {
    /// Reporter's worker id.
    pub worker_id: &'a str,
    /// Reporter's incarnation.
    pub incarnation: u64,
    /// The generation reported.
    pub generation: u64,
    /// The failed rank, if known.
    pub failed_rank: Option<u32>,
    /// Why.
    pub reason: &'a str,
}

/// Decides a failure report against the current generation record.
///
/// Errors (no state change): no generation yet or a generation from the future
/// (INVALID_ARGUMENT), a failed rank outside the generation (INVALID_ARGUMENT), a reporter
/// that is not a member of the generation (PERMISSION_DENIED).
pub fn decide(current: Option<&GenerationRecord>, report: &Report<'_>) -> Result<ReportDecision, Status> {
    if report.generation == 0 {
        return Err(Status::invalid_argument("generation 0 does not exist (generations start at 1)"));
    }
    let Some(g) = current else {
        return Err(Status::invalid_argument(format!(
            "generation {} is in the future (the job has no generation yet)",
            report.generation
        )));
    };
    crate::validate::generation("generation", report.generation, g.number)?;
    if report.generation < g.number {
        return Ok(ReportDecision::Ignore(g.cause_of(report.generation).cloned()));
    }
    if let Some(rank) = report.failed_rank {
        if rank as usize >= g.members.len() {
            return Err(Status::invalid_argument(format!(
                "failed_rank {rank} is not a rank of generation {} (size {})",
                g.number,
                g.members.len()
            )));
        }
    }
    if g.rank_of(report.worker_id, report.incarnation).is_none() {
        return Err(Status::permission_denied(format!(
            "worker {} (incarnation {}) is not a member of generation {} and cannot report its failure",
            report.worker_id, report.incarnation, g.number
        )));
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
    }))
}

/// The generation record revoked with `cause` at `now_ms`.
pub fn revoked(g: &GenerationRecord, cause: Cause, now_ms: u64) -> GenerationRecord {
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
pub fn lapsed(state: &JobState, lease_ttl_ms: u64) -> Option<Cause> {
    let g = state.current()?;
    if g.revoked.is_some() {
        return None;
    }
    g.members.iter().enumerate().find_map(|(rank, m)| {
        if state.is_live(&m.worker_id, m.incarnation) || g.departed(&m.worker_id, m.incarnation).is_some() {
            return None;
        }
        Some(Cause {
            rank: Some(rank as u32),
            worker_id: m.worker_id.clone(),
            host: m.host.clone(),
            reason: format!("lease expired (no heartbeat for {lease_ttl_ms} ms)"),
            reported_by: "coordinator".into(),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{MemberRecord, Placed};
    use crate::rendezvous::next_generation;

    fn gen(number: u64) -> GenerationRecord {
        let members = ["a", "b", "c"]
            .iter()
            .map(|w| Placed { worker_id: w.to_string(), incarnation: 1, host: format!("host-{w}"), addresses: vec![] })
            .collect();
        let mut g = next_generation(None, members, 0);
        g.number = number;
        g
    }

    fn report(generation: u64, failed_rank: Option<u32>) -> Report<'static> {
        Report { worker_id: "a", incarnation: 1, generation, failed_rank, reason: "peer closed" }
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
        assert_eq!(decide(Some(&g), &report(5, None)).expect_err("future").code(), tonic::Code::InvalidArgument);
        assert_eq!(decide(Some(&g), &report(4, Some(3))).expect_err("rank").code(), tonic::Code::InvalidArgument);
        assert_eq!(decide(None, &report(1, None)).expect_err("none").code(), tonic::Code::InvalidArgument);
        let stranger = Report { worker_id: "z", ..report(4, None) };
        assert_eq!(decide(Some(&g), &stranger).expect_err("stranger").code(), tonic::Code::PermissionDenied);
    }

    #[test]
    fn lapsed_member_is_found() {
        let mut state = JobState { job: "j".into(), ..Default::default() };
        for w in ["a", "c"] {
            state.members.insert(
                w.into(),
                MemberRecord { worker_id: w.into(), incarnation: 1, host: String::new(), addresses: vec![], capabilities: vec![], joined_at_ms: 0 },
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
}
