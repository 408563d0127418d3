//! The status as JSON: the serde types behind `cohort-coordinator status --json` and the
//! status page's `/status.json`, so that the two say the same things under the same names.
//!
//! [`JobStatus`] is what `status --json` prints (one job, every member); the page's
//! snapshot reuses its parts ([`RootCause`], [`SettingsView`], [`Ended`], [`ExclusionView`])
//! and summarises the members instead of listing them. The field names are an interface:
//! scripts and the chaos harness read them, so they do not change.

use cohort_proto::v1 as pb;
use serde::Serialize;

/// The root cause of a revocation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RootCause {
    /// Rank of the failed member in the revoked generation (`null` if unknown).
    pub rank: Option<u32>,
    /// Its worker id (empty if unknown).
    pub worker_id: String,
    /// Its host (empty if unknown).
    pub host: String,
    /// What happened.
    pub reason: String,
    /// Who reported it (`coordinator` for a lapsed lease).
    pub reported_by: String,
    /// The failure domain lost at once, if the whole domain was (else empty).
    pub domain: String,
    /// With `domain`: every rank of it in the revoked generation.
    pub lost_ranks: Vec<u32>,
}

impl From<&pb::RootCause> for RootCause {
    fn from(c: &pb::RootCause) -> Self {
        Self {
            rank: c.rank,
            worker_id: c.worker_id.clone(),
            host: c.host.clone(),
            reason: c.reason.clone(),
            reported_by: c.reported_by.clone(),
            domain: c.domain.clone(),
            lost_ranks: c.lost_ranks.clone(),
        }
    }
}

/// The job's settings in force.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SettingsView {
    /// Fewest workers per generation.
    pub min_workers: u32,
    /// Most workers per generation.
    pub max_workers: u32,
    /// Join window after the last arrival, ms.
    pub join_window_ms: u64,
    /// Heartbeat interval, ms.
    pub heartbeat_interval_ms: u64,
    /// Time without heartbeat after which a member is dead, ms.
    pub lease_ttl_ms: u64,
    /// How long a job below `min_workers` waits before it fails, ms.
    pub elastic_timeout_ms: u64,
    /// `report` or `exclude` (empty: `report`).
    pub straggler_policy: String,
    /// How long an excluded straggler's join is refused, ms.
    pub straggler_cooldown_ms: u64,
}

impl From<&pb::JobSettings> for SettingsView {
    fn from(s: &pb::JobSettings) -> Self {
        Self {
            min_workers: s.min_workers,
            max_workers: s.max_workers,
            join_window_ms: s.join_window_ms,
            heartbeat_interval_ms: s.heartbeat_interval_ms,
            lease_ttl_ms: s.lease_ttl_ms,
            elastic_timeout_ms: s.elastic_timeout_ms,
            straggler_policy: s.straggler_policy.clone(),
            straggler_cooldown_ms: s.straggler_cooldown_ms,
        }
    }
}

/// How a job ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Ended {
    /// `FINISHED`, `FAILED` (or `UNKNOWN` for a value this build does not know).
    pub outcome: &'static str,
    /// Why.
    pub reason: String,
}

impl From<&pb::JobEnded> for Ended {
    fn from(e: &pb::JobEnded) -> Self {
        let outcome = pb::job_ended::Outcome::try_from(e.outcome).map(|o| o.as_str_name()).unwrap_or("UNKNOWN");
        Self { outcome, reason: e.reason.clone() }
    }
}

/// A worker whose joins are refused now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ExclusionView {
    /// The worker.
    pub worker_id: String,
    /// Until when, ms since the epoch.
    pub until_ms: u64,
    /// Why.
    pub reason: String,
}

impl From<&pb::Exclusion> for ExclusionView {
    fn from(x: &pb::Exclusion) -> Self {
        Self { worker_id: x.worker_id.clone(), until_ms: x.until_ms, reason: x.reason.clone() }
    }
}

/// One member of a generation, by rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GenerationMember {
    /// Its rank.
    pub rank: u32,
    /// Its worker id.
    pub worker_id: String,
    /// Its host.
    pub host: String,
    /// Its failure domain.
    pub domain: String,
}

/// The job's newest generation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GenerationView {
    /// Its number.
    pub number: u64,
    /// When it formed, ms since the epoch.
    pub formed_at_ms: u64,
    /// Whether it is revoked.
    pub revoked: bool,
    /// Its members by rank.
    pub members: Vec<GenerationMember>,
}

/// One peer a member waited on in its last step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PeerWaitView {
    /// The peer's rank.
    pub rank: u32,
    /// How long, µs.
    pub wait_us: u64,
}

/// A member's last reported step timing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TimingView {
    /// Steps the figures cover.
    pub steps: u32,
    /// Compute time, µs.
    pub compute_us: u64,
    /// Collective time, µs.
    pub collective_us: u64,
    /// The peers it waited on.
    pub peer_waits: Vec<PeerWaitView>,
}

/// The straggler verdict on a member.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StragglerView {
    /// `compute` or `link`.
    pub kind: String,
    /// How many times the others' median it is.
    pub ratio: f64,
    /// Consecutive reports that found it slow.
    pub reports: u32,
    /// The explanation.
    pub reason: String,
    /// Since when, ms since the epoch.
    pub since_ms: u64,
    /// What was done about it.
    pub action: String,
}

impl From<&pb::StragglerVerdict> for StragglerView {
    fn from(v: &pb::StragglerVerdict) -> Self {
        Self {
            kind: v.kind.clone(),
            ratio: v.ratio,
            reports: v.reports,
            reason: v.reason.clone(),
            since_ms: v.since_ms,
            action: v.action.clone(),
        }
    }
}

/// One member as `status --json` lists it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemberView {
    /// Its worker id.
    pub worker_id: String,
    /// Its incarnation.
    pub incarnation: u64,
    /// Its host.
    pub host: String,
    /// Its failure domain.
    pub domain: String,
    /// Its rank in the current generation (`null`: none).
    pub rank: Option<u32>,
    /// Its last heartbeat, ms since the epoch.
    pub last_heartbeat_ms: u64,
    /// How long ago that was, ms (at `now_ms`).
    pub heartbeat_age_ms: u64,
    /// The generation it last reported.
    pub generation: u64,
    /// The step it last reported.
    pub step: u64,
    /// What it was doing.
    pub activity: String,
    /// The no-progress deadline in force on its links.
    pub deadlines: String,
    /// Its last committed step.
    pub last_commit_step: u64,
    /// Hex digest of its last commit (empty: none).
    pub last_commit_digest: String,
    /// Whether it waits in the rendezvous.
    pub waiting: bool,
    /// Whether its control stream is open (`null`: it never opened one).
    pub control_connected: Option<bool>,
    /// Its last step timing.
    pub timing: Option<TimingView>,
    /// The straggler verdict on it.
    pub straggler: Option<StragglerView>,
}

impl MemberView {
    /// `m` as of `now_ms`.
    pub fn new(m: &pb::MemberStatus, now_ms: u64) -> Self {
        Self {
            worker_id: m.worker_id.clone(),
            incarnation: m.incarnation,
            host: m.host.clone(),
            domain: m.domain.clone(),
            rank: m.rank,
            last_heartbeat_ms: m.last_heartbeat_ms,
            heartbeat_age_ms: now_ms.saturating_sub(m.last_heartbeat_ms),
            generation: m.generation,
            step: m.step,
            activity: m.activity.clone(),
            deadlines: m.deadlines.clone(),
            last_commit_step: m.last_commit_step,
            last_commit_digest: m.last_commit_digest.clone(),
            waiting: m.waiting,
            control_connected: m.control_connected,
            timing: m.timing.as_ref().map(|t| TimingView {
                steps: t.steps,
                compute_us: t.compute_us,
                collective_us: t.collective_us,
                peer_waits: t.peer_waits.iter().map(|w| PeerWaitView { rank: w.rank, wait_us: w.wait_us }).collect(),
            }),
            straggler: m.straggler.as_ref().map(StragglerView::from),
        }
    }
}

/// One member's commit of a step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CommitView {
    /// The member.
    pub worker_id: String,
    /// Hex digest of the state it committed.
    pub digest: String,
}

/// A step members committed with different state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DigestMismatchView {
    /// The generation.
    pub generation: u64,
    /// The step.
    pub step: u64,
    /// Who committed what.
    pub commits: Vec<CommitView>,
}

impl From<&pb::DigestMismatch> for DigestMismatchView {
    fn from(m: &pb::DigestMismatch) -> Self {
        Self {
            generation: m.generation,
            step: m.step,
            commits: m
                .commits
                .iter()
                .map(|c| CommitView { worker_id: c.worker_id.clone(), digest: c.digest.clone() })
                .collect(),
        }
    }
}

/// A job's status as `cohort-coordinator status --json` prints it: the table's facts, times
/// as ms since the epoch plus the ages the table shows (`heartbeat_age_ms`), so that scripts
/// need no clock of their own.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobStatus {
    /// The job.
    pub job: String,
    /// When this was taken, ms since the epoch.
    pub now_ms: u64,
    /// Its settings.
    pub settings: Option<SettingsView>,
    /// Its newest generation (`null`: none formed yet).
    pub generation: Option<GenerationView>,
    /// Why the newest generation was revoked, if it was.
    pub revocation_cause: Option<RootCause>,
    /// How it ended, if it did.
    pub ended: Option<Ended>,
    /// The leading replica (`null`: none leads).
    pub leader: Option<String>,
    /// Always true (see [`UnknownJob`]).
    pub exists: bool,
    /// Every member, by rank (members without one last, by worker id).
    pub members: Vec<MemberView>,
    /// Workers whose joins are refused now.
    pub exclusions: Vec<ExclusionView>,
    /// Steps committed with different state.
    pub digest_mismatches: Vec<DigestMismatchView>,
}

impl JobStatus {
    /// The status `s` as of `now_ms`.
    pub fn new(s: &pb::StatusResponse, now_ms: u64) -> Self {
        let mut members: Vec<&pb::MemberStatus> = s.members.iter().collect();
        members.sort_by(|a, b| {
            (a.rank.unwrap_or(u32::MAX), &a.worker_id).cmp(&(b.rank.unwrap_or(u32::MAX), &b.worker_id))
        });
        Self {
            job: s.job.clone(),
            now_ms,
            settings: s.settings.as_ref().map(SettingsView::from),
            generation: s.current.as_ref().map(|g| GenerationView {
                number: g.number,
                formed_at_ms: g.formed_at_ms,
                revoked: s.current_revoked,
                members: g
                    .members
                    .iter()
                    .map(|m| GenerationMember {
                        rank: m.rank,
                        worker_id: m.worker_id.clone(),
                        host: m.host.clone(),
                        domain: m.domain.clone(),
                    })
                    .collect(),
            }),
            revocation_cause: s.revocation_cause.as_ref().map(RootCause::from),
            ended: s.ended.as_ref().map(Ended::from),
            leader: (!s.leader.is_empty()).then(|| s.leader.clone()),
            exists: true,
            members: members.into_iter().map(|m| MemberView::new(m, now_ms)).collect(),
            exclusions: s.exclusions.iter().map(ExclusionView::from).collect(),
            digest_mismatches: s.digest_mismatches.iter().map(DigestMismatchView::from).collect(),
        }
    }
}

/// What `status --json` prints for a job the coordinator does not know.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct UnknownJob {
    /// The job asked about.
    pub job: String,
    /// Always false.
    pub exists: bool,
    /// The leading replica (`null`: none leads).
    pub leader: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The field names scripts and the chaos harness read stay as they were.
    #[test]
    fn the_json_keeps_its_field_names() {
        let s = pb::StatusResponse {
            job: "j".into(),
            current: Some(pb::Generation { number: 4, formed_at_ms: 10, ..Default::default() }),
            current_revoked: true,
            revocation_cause: Some(pb::RootCause { rank: Some(1), worker_id: "w1".into(), ..Default::default() }),
            members: vec![pb::MemberStatus {
                worker_id: "w0".into(),
                rank: Some(0),
                last_heartbeat_ms: 900,
                control_connected: Some(true),
                ..Default::default()
            }],
            ..Default::default()
        };
        let v = serde_json::to_value(JobStatus::new(&s, 1000)).expect("serializes");
        assert_eq!(v["generation"]["number"], 4);
        assert_eq!(v["generation"]["revoked"], true);
        assert_eq!(v["revocation_cause"]["worker_id"], "w1");
        assert_eq!(v["revocation_cause"]["rank"], 1);
        assert_eq!(v["members"][0]["heartbeat_age_ms"], 100);
        assert_eq!(v["members"][0]["control_connected"], true);
        assert!(v["members"][0]["timing"].is_null() && v["members"][0]["straggler"].is_null());
        assert!(v["leader"].is_null() && v["settings"].is_null() && v["ended"].is_null());
        assert_eq!(v["exists"], true);
        for key in ["job", "now_ms", "exclusions", "digest_mismatches"] {
            assert!(v.get(key).is_some(), "{key}: {v}");
        }
        let unknown = serde_json::to_value(UnknownJob { job: "x".into(), exists: false, leader: None }).expect("json");
        assert_eq!(unknown, serde_json::json!({ "job": "x", "exists": false, "leader": null }));
    }
}
