//! The `Heartbeat` RPC: the member's lease and progress, and the straggler judgement and
//! action on its step timing.

use super::{not_member, store_status, CoordinatorService, STRAGGLER_ROUNDS_CAP};
use crate::ops;
use crate::records::{self, JobState};
use crate::store::StoreError;
use crate::stragglers;
use crate::validate;
use cohort_proto::v1 as pb;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tonic::Status;

/// Jobs of at most this many members index a fresh round at every timed heartbeat, so that
/// each report is judged against the others' very latest (as small jobs always were; it
/// costs microseconds). Larger jobs index one round per heartbeat interval (at most
/// [`ROUND_MAX_AGE`]).
const FRESH_ROUND_UP_TO: usize = 64;

/// The oldest an indexed round may be, whatever the heartbeat interval: a round built from a
/// few early reports (just after a formation) must not stand for a whole long interval (a
/// job with 60 s heartbeats would judge every report against it for a minute). Rebuilding a
/// 16,384-member round takes about 7 ms, so once a second costs under 1% of a core.
const ROUND_MAX_AGE: Duration = Duration::from_secs(1);

/// One job's indexed straggler round and when it was built.
pub(super) struct IndexedRound {
    round: Arc<stragglers::Round>,
    built: Instant,
    used: Instant,
}

impl CoordinatorService {
    pub(super) async fn do_heartbeat(&self, r: pb::HeartbeatRequest) -> Result<pb::HeartbeatResponse, Status> {
        validate::id("job", &r.job)?;
        validate::id("worker_id", &r.worker_id)?;
        validate::incarnation(r.incarnation)?;
        validate::text("activity", &r.activity, validate::MAX_ACTIVITY_LEN)?;
        validate::text("deadlines", &r.deadlines, validate::MAX_ACTIVITY_LEN)?;
        let hub = self.hub(&r.job).await?;
        // Membership first: a member of a job that has ended (whose generations are gone, so
        // the newest reads as 0) must hear that the job ended (NOT_FOUND, its heartbeat stops
        // and it finds the end at its next call), not that its generation is in the future,
        // which it would retry for ever.
        let lease = self.require_member(&hub, &r.job, &r.worker_id, r.incarnation).await?;
        let current = self.current_number(&hub, &r.job, r.generation).await?;
        validate::generation("generation", r.generation, current)?;
        // A lease is renewed at most once per half heartbeat interval on this replica: a
        // lease of the member's own (its id is the incarnation) by each of its beats, a host's
        // shared lease by whichever of its members beats; neither by a beat that follows its
        // grant by less than that (the join's first beat, sent at once).
        let interval = self.ctx.settings.for_job(&r.job).heartbeat_interval;
        if self.host_leases.renewal_due(lease, interval / 2) {
            self.ctx.store.keep_alive(lease).await.map_err(|e| {
                self.host_leases.failed(lease);
                match e {
                    StoreError::LeaseNotFound(_) => not_member(&r.job, &r.worker_id, r.incarnation),
                    other => store_status(other),
                }
            })?;
        }
        if let Some(t) = &r.timing {
            if t.peer_waits.len() > crate::config::MAX_WORKERS_LIMIT as usize {
                return Err(Status::invalid_argument(format!(
                    "timing.peer_waits has {} entries (at most {})",
                    t.peer_waits.len(),
                    crate::config::MAX_WORKERS_LIMIT
                )));
            }
        }
        let now = records::now_ms();
        // The rank index built once per generation: a search of the member list per
        // heartbeat would make every heartbeat round of a large job O(members²).
        let formed = hub.signal().formed.clone();
        let round_age = self.ctx.settings.for_job(&r.job).heartbeat_interval.min(ROUND_MAX_AGE);
        // Read under the view's lock: a copy of the state per heartbeat would cost O(members).
        let (timing, finding) = hub.read(|state| {
            // The member's step timing, as a rank of the current generation (else not judged).
            let timing = r.timing.as_ref().filter(|t| t.steps > 0).and_then(|t| {
                let g = state.current().filter(|g| g.number == r.generation && g.revoked.is_none())?;
                let rank = match formed.as_ref().filter(|f| f.number == g.number) {
                    Some(f) => f.rank_of(&r.worker_id, r.incarnation)?,
                    // The signal lags the view by a batch at most: search this once.
                    None => g.rank_of(&r.worker_id, r.incarnation)?,
                };
                Some(stragglers::Timing {
                    generation: g.number,
                    rank,
                    steps: t.steps,
                    compute_us: t.compute_us,
                    collective_us: t.collective_us,
                    peer_waits: t.peer_waits.iter().map(|w| (w.rank, w.wait_us)).collect(),
                })
            });
            let finding = timing.as_ref().and_then(|own| {
                let round = self.straggler_round(&r.job, state, own.generation, round_age);
                round.judge(&stragglers::StragglerRule::default(), own)
            });
            (timing, finding)
        });
        let policy = self.ctx.settings.for_job(&r.job).straggler_policy;
        let mut change = stragglers::Change::None;
        let mut standing = stragglers::Standing::default();
        let mut excluded_until = None;
        self.record_progress(&r.job, &r.worker_id, r.incarnation, lease, |p| {
            p.last_heartbeat_ms = now;
            p.generation = r.generation;
            p.step = r.step;
            p.activity = r.activity.clone();
            p.deadlines = r.deadlines.clone();
            if let Some(timing) = timing {
                p.timing = Some(timing);
                change = p.straggler.advance(&stragglers::StragglerRule::default(), finding, now);
                if change == stragglers::Change::Named {
                    // What will be done, until act_on_straggler records what was.
                    p.straggler_action = format!("deciding (straggler policy: {})", policy.name());
                }
                if change == stragglers::Change::Cleared && p.straggler_excluded_until_ms.is_none() {
                    p.straggler_action.clear();
                }
            }
            standing = p.straggler.clone();
            excluded_until = p.straggler_excluded_until_ms;
        })
        .await?;
        match change {
            stragglers::Change::Named => {
                let state = hub.state();
                excluded_until = self.act_on_straggler(&r.job, &r.worker_id, r.incarnation, lease, &state, &standing).await;
            }
            stragglers::Change::Cleared => {
                self.ctx.metrics.straggler_cleared(&r.job, &r.worker_id);
                tracing::info!(job = %r.job, worker = %r.worker_id, "member is no longer a straggler");
            }
            stragglers::Change::None => {}
        }
        let leave_as_straggler = match (excluded_until, &standing.last) {
            (Some(until), Some(f)) => {
                format!("straggler ({} slow: {}); excluded until {until} ms since the epoch", f.kind.name(), f.reason)
            }
            (Some(until), None) => format!("straggler; excluded until {until} ms since the epoch"),
            (None, _) => String::new(),
        };
        let (current_generation, current_revoked) =
            hub.read(|state| (state.current_number(), state.current().is_some_and(|g| g.revoked.is_some())));
        Ok(pb::HeartbeatResponse {
            current_generation,
            current_revoked,
            reformation_pending: hub.pending().is_some(),
            leave_as_straggler,
        })
    }

    /// The job's latest reports of `generation`, indexed for the straggler judgement: one
    /// round per `max_age` (the heartbeat interval, at most [`ROUND_MAX_AGE`]) for a job of
    /// more than [`FRESH_ROUND_UP_TO`] members (each report is then judged against the
    /// others' reports of up to that long ago, in O(log² N)), a fresh one at every report for
    /// a smaller job. Gathering and indexing
    /// the reports is O(N log N): at every heartbeat of every member that was O(N² log N) per
    /// heartbeat round.
    fn straggler_round(
        &self,
        job: &str,
        state: &JobState,
        generation: u64,
        max_age: Duration,
    ) -> Arc<stragglers::Round> {
        let now = Instant::now();
        let members = state.current().map_or(0, |g| g.members.len());
        if members > FRESH_ROUND_UP_TO {
            let mut rounds = self.straggler_rounds.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(kept) = rounds.get_mut(job) {
                if kept.round.generation() == generation && now.saturating_duration_since(kept.built) < max_age {
                    kept.used = now;
                    return kept.round.clone();
                }
            }
        }
        let round = Arc::new(stragglers::Round::new(generation, self.latest_timings(job, state, generation)));
        let mut rounds = self.straggler_rounds.lock().unwrap_or_else(|e| e.into_inner());
        if members > FRESH_ROUND_UP_TO {
            if !rounds.contains_key(job) {
                crate::bounded::make_room(&mut rounds, STRAGGLER_ROUNDS_CAP, max_age * 8, now, |kept| kept.used);
            }
            rounds.insert(job.to_string(), IndexedRound { round: round.clone(), built: now, used: now });
        } else {
            rounds.remove(job);
        }
        round
    }

    /// The latest step timing of every member of generation `generation`: this replica's
    /// cache where it is newer than the store's view.
    fn latest_timings(&self, job: &str, state: &JobState, generation: u64) -> Vec<stragglers::Timing> {
        let cache = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        let Some(g) = state.current().filter(|g| g.number == generation) else { return Vec::new() };
        g.members
            .iter()
            .enumerate()
            .filter_map(|(rank, m)| {
                let cached = cache
                    .get(&(job.to_string(), m.worker_id.clone()))
                    .map(|c| &c.record)
                    .filter(|p| p.incarnation == m.incarnation);
                let stored = state.progress.get(&m.worker_id).filter(|p| p.incarnation == m.incarnation);
                let newest = match (cached, stored) {
                    (Some(c), Some(s)) if s.last_heartbeat_ms > c.last_heartbeat_ms => Some(s),
                    (Some(c), _) => Some(c),
                    (None, s) => s,
                }?;
                newest.timing.clone().filter(|t| t.generation == generation && t.rank as usize == rank)
            })
            .collect()
    }

    /// A member has just been named a straggler: logs it, counts it, and under the job's
    /// `exclude` policy excludes it (when the generation can spare it). Records what was
    /// done in its progress (for `status`); returns the end of its exclusion, if excluded.
    ///
    /// # Cancel safety
    /// Cancel safe: at most one store transaction and one progress update.
    async fn act_on_straggler(
        &self,
        job: &str,
        worker: &str,
        incarnation: u64,
        lease: crate::store::LeaseId,
        state: &JobState,
        standing: &stragglers::Standing,
    ) -> Option<u64> {
        let settings = self.ctx.settings.for_job(job);
        let Some(finding) = &standing.last else { return None };
        self.ctx.metrics.straggler_named(job, worker, finding.kind.name());
        let members: Vec<String> =
            state.current().map_or_else(Vec::new, |g| g.members.iter().map(|m| m.worker_id.clone()).collect());
        let mut until = None;
        let action = match settings.straggler_policy {
            stragglers::StragglerPolicy::Report => "reported (straggler policy: report)".to_string(),
            stragglers::StragglerPolicy::Exclude => {
                let why = format!("{} slow: {}", finding.kind.name(), finding.reason);
                let min = settings.min_workers as usize;
                let cooldown = settings.straggler_cooldown;
                match ops::exclude_straggler(&self.ctx, job, worker, &members, min, cooldown, &why).await {
                    Ok(ops::StragglerExclusion::Refused(why)) => format!("not excluded: {why}"),
                    Ok(ops::StragglerExclusion::Excluded(end)) => {
                        self.ctx.metrics.straggler_excluded(job);
                        until = Some(end);
                        format!(
                            "excluded until {end} ms since the epoch (cool-down {} ms): leaves at its next commit point",
                            settings.straggler_cooldown.as_millis()
                        )
                    }
                    Err(e) => format!("not excluded: the store refused ({e}); reported only"),
                }
            }
        };
        tracing::warn!(%job, %worker, incarnation, kind = finding.kind.name(), ratio = finding.ratio_pct as f64 / 100.0,
                       reports = standing.streak, reason = %finding.reason, %action, "straggler named");
        let _ = self
            .record_progress(job, worker, incarnation, lease, |p| {
                p.straggler_action = action;
                if until.is_some() {
                    p.straggler_excluded_until_ms = until;
                }
            })
            .await;
        until
    }
}

impl CoordinatorService {
    /// One `HostHeartbeat`: each beat judged as its own `Heartbeat`, concurrently (on etcd
    /// each renews its own lease), and answered in order. A refused beat is answered with its
    /// status and does not fail the call; only a malformed batch does.
    pub(super) async fn do_host_heartbeat(
        &self,
        r: pb::HostHeartbeatRequest,
    ) -> Result<pb::HostHeartbeatResponse, Status> {
        validate::id("job", &r.job)?;
        if r.beats.is_empty() {
            return Err(Status::invalid_argument("beats is empty"));
        }
        if r.beats.len() > cohort_proto::MAX_BEATS_PER_CALL {
            return Err(Status::invalid_argument(format!(
                "{} beats in one call (at most {})",
                r.beats.len(),
                cohort_proto::MAX_BEATS_PER_CALL
            )));
        }
        if let Some((i, beat)) = r.beats.iter().enumerate().find(|(_, b)| b.job != r.job) {
            return Err(Status::invalid_argument(format!(
                "beats[{i}] is of job {:?}, the call of job {:?}",
                beat.job, r.job
            )));
        }
        let answers = futures::future::join_all(r.beats.into_iter().map(|beat| async move {
            let result = self.do_heartbeat(beat).await;
            self.ctx.metrics.rpc("Heartbeat", result.as_ref().map_or_else(|s| s.code(), |_| tonic::Code::Ok));
            let outcome = match result {
                Ok(answer) => pb::heartbeat_answer::Outcome::Ok(answer),
                Err(status) => pb::heartbeat_answer::Outcome::Refused(pb::HeartbeatRefusal {
                    code: status.code() as i32,
                    message: status.message().to_string(),
                }),
            };
            pb::HeartbeatAnswer { outcome: Some(outcome) }
        }))
        .await;
        Ok(pb::HostHeartbeatResponse { answers })
    }
}
