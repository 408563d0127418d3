//! The `cohort.v1.Coordinator` gRPC service over the store.
//!
//! Every replica serves every RPC: all state is in the store, and a replica keeps only
//! caches (per-job [`Hub`]s, throttled progress). Every request is validated first
//! ([`crate::validate`]); a bad one changes nothing.
//!
//! Membership: a member is one incarnation of a worker; the incarnation is the id of the
//! store lease that carries its keys. An evicted member (a failure report named it, or its
//! lease lapsed) gets NOT_FOUND on its next Heartbeat, Rendezvous or Commit, and must Join
//! again; it then enters the next generation as a joiner.
//!
//! Watch needs no membership (an operator's tool may follow a job); it validates the ids
//! and the token like every RPC. A Rendezvous answers with the newest generation that
//! includes the caller even when it is already revoked: the member learns the revocation
//! (watch, failed connection) and rendezvous again after it.

mod failures;

use crate::digests::{self, CommitLedger};
use crate::hub::{self, Hub};
use crate::keys::{self, Kind};
use crate::ops::{self, Context};
use crate::records::{
    self, decode, encode, hex, Departure, JobState, MemberRecord, Outcome, ProgressRecord, WaitingRecord,
};
use crate::revocation;
use crate::store::{Compare, StoreError, Txn, TxnOp};
use crate::stragglers;
use crate::validate;
use cohort_proto::v1 as pb;
use cohort_proto::v1::job_event::Event;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

/// Longest a Rendezvous long poll is held, whatever the client asks.
pub const MAX_RENDEZVOUS_WAIT: Duration = Duration::from_secs(30);
/// Progress is written to the store at most this often per member.
pub const PROGRESS_PERIOD: Duration = Duration::from_secs(1);

/// Members whose progress a replica caches at most (the least recently heard go first).
const PROGRESS_CACHE_CAP: usize = 4096;

struct CachedProgress {
    record: ProgressRecord,
    written: Option<Instant>,
    touched: Instant,
}

/// Where a replica gathers the timeout reports of one cascade before judging it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CascadeScope {
    /// In the store, so that every replica judges the whole cascade, whichever replica each
    /// report reached (the behaviour since commit d99aa8c).
    #[default]
    Store,
    /// Only the reports this replica received: the behaviour before d99aa8c, which could
    /// evict a healthy rank when a cascade was split between replicas. Kept only so that
    /// the deterministic simulation (`sim/`) can show that it catches this bug; never use
    /// it otherwise.
    Replica,
}

/// The coordinator service.
#[derive(Clone)]
pub struct CoordinatorService {
    ctx: Arc<Context>,
    progress: Arc<Mutex<HashMap<(String, String), CachedProgress>>>,
    commits: Arc<Mutex<CommitLedger>>,
    cascade_scope: CascadeScope,
    /// The timeout reports this replica received, `(job, generation, report)`: used only
    /// with [`CascadeScope::Replica`].
    own_timeouts: Arc<Mutex<Vec<(String, u64, revocation::TimeoutReport)>>>,
}

fn store_status(e: StoreError) -> Status {
    match e {
        StoreError::LeaseNotFound(_) => Status::not_found(format!("{e}")),
        other => Status::unavailable(format!("coordinator store: {other}")),
    }
}

fn not_member(job: &str, worker: &str, incarnation: u64) -> Status {
    Status::not_found(format!(
        "member {worker} (incarnation {incarnation}) is not in job {job} (lease expired or evicted); join again"
    ))
}

/// A refused failure report ([`revocation::decide`]): PERMISSION_DENIED for a reporter that
/// is not a member of the generation, INVALID_ARGUMENT for the rest.
impl From<revocation::ReportError> for Status {
    fn from(e: revocation::ReportError) -> Self {
        match e {
            revocation::ReportError::NotMember { .. } => Status::permission_denied(e.to_string()),
            _ => Status::invalid_argument(e.to_string()),
        }
    }
}

/// A Join for a worker id that a live process holds: ALREADY_EXISTS, naming the holder's
/// host, with the time after which a holder that stays silent counts as gone in the
/// [`cohort_proto::RETRY_AFTER_MS_HEADER`] metadata (a restarted process joins then).
fn id_in_use(job: &str, holder: &MemberRecord, silent_for: Duration, left: Duration) -> Status {
    let mut status = Status::already_exists(format!(
        "worker id {} of job {job} is held by a live process on host {} (incarnation {}, heard from {} ms ago): \
         two processes cannot share a worker id; give each its own (--worker-id), or stop the other one",
        holder.worker_id,
        if holder.host.is_empty() { "?" } else { &holder.host },
        holder.incarnation,
        silent_for.as_millis()
    ));
    if let Ok(value) = (left.as_millis() as u64).max(1).to_string().parse() {
        status.metadata_mut().insert(cohort_proto::RETRY_AFTER_MS_HEADER, value);
    }
    status
}

/// `Status` of a job with no key in the store: NOT_FOUND (gRPC's convention for a named
/// resource that does not exist), with the leader, which is known regardless, in the
/// [`cohort_proto::LEADER_HEADER`] metadata.
fn unknown_job(job: &str, leader: &str) -> Status {
    let mut status = Status::not_found(format!(
        "job {job} does not exist here: no worker has joined it, or it ended and its record expired"
    ));
    if let Ok(value) = leader.parse() {
        if !leader.is_empty() {
            status.metadata_mut().insert(cohort_proto::LEADER_HEADER, value);
        }
    }
    status
}

impl CoordinatorService {
    /// A service over a replica's shared context.
    pub fn new(ctx: Arc<Context>) -> Self {
        Self {
            ctx,
            progress: Arc::new(Mutex::new(HashMap::new())),
            commits: Arc::new(Mutex::new(CommitLedger::default())),
            cascade_scope: CascadeScope::Store,
            own_timeouts: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// The same service, gathering timeout cascades in `scope` (the default,
    /// [`CascadeScope::Store`], is the only correct one).
    pub fn with_cascade_scope(mut self, scope: CascadeScope) -> Self {
        self.cascade_scope = scope;
        self
    }

    async fn hub(&self, job: &str) -> Result<Arc<Hub>, Status> {
        self.ctx.hubs.get(job, &self.ctx.settings.for_job(job)).await.map_err(store_status)
    }

    async fn read_job(&self, job: &str) -> Result<JobState, Status> {
        let (kvs, revision) = self.ctx.store.get_prefix(&keys::job_prefix(job)).await.map_err(store_status)?;
        Ok(JobState::from_kvs(job, &kvs, revision))
    }

    /// The part of a job's state a Join decides on, read key by key: the end record, the
    /// worker's member record, its own and its failure domain's failure records, and the
    /// generation record, with the newest generation number. A join must not read the whole
    /// job (N joins would read it N times, O(N²) in all). The generation record, O(members)
    /// itself, is read from the store only when an older incarnation of the worker may be in
    /// it; otherwise the state has none and the number comes from this replica's view.
    ///
    /// # Cancel safety
    /// Cancel safe: reads only.
    async fn read_join_view(&self, job: &str, worker: &str, domain: &str) -> Result<(JobState, u64), Status> {
        let store = self.ctx.store.as_ref();
        let (ended_key, member_key) = (keys::ended(job), keys::worker_key(job, Kind::Member, worker));
        let own_key = keys::worker_key(job, Kind::Failures, worker);
        let domain_id = crate::domains::domain_key(domain);
        let domain_key = keys::worker_key(job, Kind::Failures, &domain_id);
        let (ended, member, own, of_domain) =
            tokio::try_join!(store.get(&ended_key), store.get(&member_key), store.get(&own_key), store.get(&domain_key))
                .map_err(store_status)?;
        let mut state = JobState { job: job.to_string(), ..Default::default() };
        state.ended = ended.and_then(|kv| decode(&ended_key, &kv.value));
        if let Some(m) = member.and_then(|kv| decode::<MemberRecord>(&member_key, &kv.value)) {
            state.members.insert(worker.to_string(), m);
            state.generation =
                ops::read_generation(store, job).await.map_err(store_status)?.map(|(g, kv)| (g, kv.mod_revision));
        }
        let current = match state.current() {
            Some(g) => g.number,
            None if state.ended.is_none() => self.hub(job).await?.read(JobState::current_number),
            None => 0,
        };
        if let Some(h) = own.and_then(|kv| decode(&own_key, &kv.value)) {
            state.failures.insert(worker.to_string(), h);
        }
        if let Some(h) = of_domain.and_then(|kv| decode(&domain_key, &kv.value)) {
            state.failures.insert(domain_id, h);
        }
        Ok((state, current))
    }

    /// Confirms that `(worker, incarnation)` is a live member: the hub's view first, the
    /// store when the view disagrees (it may lag a change by milliseconds).
    async fn require_member(
        &self,
        hub: &Hub,
        job: &str,
        worker: &str,
        incarnation: u64,
    ) -> Result<MemberRecord, Status> {
        let (member, ended) = hub.read(|state| {
            let member = state.members.get(worker).filter(|m| m.incarnation == incarnation).cloned();
            (member, state.ended.clone())
        });
        if let Some(m) = member {
            return Ok(m);
        }
        if let Some(ended) = &ended {
            return Err(Status::not_found(format!(
                "job {job} has ended ({:?}: {}); member {worker} is no longer in it",
                ended.outcome, ended.reason
            )));
        }
        match ops::read_member(self.ctx.store.as_ref(), job, worker).await.map_err(store_status)? {
            Some((m, _)) if m.incarnation == incarnation => Ok(m),
            _ => Err(not_member(job, worker, incarnation)),
        }
    }

    /// The newest generation number, from the view or (if the client names a newer one)
    /// the store.
    async fn current_number(&self, hub: &Hub, job: &str, claimed: u64) -> Result<u64, Status> {
        let seen = hub.read(JobState::current_number);
        if claimed <= seen {
            return Ok(seen);
        }
        Ok(ops::read_generation(self.ctx.store.as_ref(), job).await.map_err(store_status)?.map_or(0, |(g, _)| g.number))
    }

    /// Updates the cached progress of a member; writes it to the store (on the member's
    /// lease) when the last write is older than [`PROGRESS_PERIOD`].
    async fn record_progress(
        &self,
        job: &str,
        worker: &str,
        incarnation: u64,
        update: impl FnOnce(&mut ProgressRecord),
    ) -> Result<(), Status> {
        let now = Instant::now();
        let to_write = {
            let mut cache = self.progress.lock().unwrap_or_else(|e| e.into_inner());
            if !cache.contains_key(&(job.to_string(), worker.to_string())) {
                crate::bounded::make_room(&mut cache, PROGRESS_CACHE_CAP, Duration::from_secs(600), now, |c| c.touched);
            }
            let entry = cache.entry((job.to_string(), worker.to_string())).or_insert_with(|| CachedProgress {
                record: ProgressRecord { incarnation, ..Default::default() },
                written: None,
                touched: now,
            });
            if entry.record.incarnation != incarnation {
                entry.record = ProgressRecord { incarnation, ..Default::default() };
                entry.written = None;
            }
            update(&mut entry.record);
            entry.touched = now;
            let due = entry.written.is_none_or(|t| now.duration_since(t) >= PROGRESS_PERIOD);
            if due {
                entry.written = Some(now);
                Some(entry.record.clone())
            } else {
                None
            }
        };
        if let Some(record) = to_write {
            let key = keys::worker_key(job, Kind::Progress, worker);
            self.ctx.store.put(&key, encode(&record), Some(incarnation as i64)).await.map_err(|e| match e {
                StoreError::LeaseNotFound(_) => not_member(job, worker, incarnation),
                other => store_status(other),
            })?;
        }
        Ok(())
    }

    /// At most how long `holder` (a member record of `job`) has gone without a heartbeat: the
    /// tightest of its progress record in the store, this replica's cache of it, and its
    /// store lease's time to live (a lease that is gone: a whole TTL).
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    async fn silent_for(&self, job: &str, holder: &MemberRecord, state: &JobState) -> Result<Duration, StoreError> {
        let granted = self.ctx.settings.for_job(job).lease_ttl_for_store();
        let mut silent = match self.ctx.store.lease_time_to_live(holder.incarnation as i64).await? {
            None => return Ok(granted),
            Some(left) => granted.saturating_sub(left),
        };
        if let Some(p) = state.progress.get(&holder.worker_id).filter(|p| p.incarnation == holder.incarnation) {
            silent = silent.min(Duration::from_millis(records::now_ms().saturating_sub(p.last_heartbeat_ms)));
        }
        let cache = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = cache
            .get(&(job.to_string(), holder.worker_id.clone()))
            .filter(|c| c.record.incarnation == holder.incarnation)
        {
            silent = silent.min(Instant::now().duration_since(c.touched));
        }
        Ok(silent)
    }

    fn forget_progress(&self, job: &str, worker: &str) {
        self.progress.lock().unwrap_or_else(|e| e.into_inner()).remove(&(job.to_string(), worker.to_string()));
    }

    fn shutting_down(&self) -> bool {
        *self.ctx.shutdown.borrow()
    }

    async fn do_join(&self, r: pb::JoinRequest) -> Result<pb::JoinResponse, Status> {
        validate::protocol_version(r.protocol_version)?;
        validate::id("job", &r.job)?;
        validate::id("worker_id", &r.worker_id)?;
        validate::text("host", &r.host, validate::MAX_HOST_LEN)?;
        validate::text("domain", &r.domain, validate::MAX_HOST_LEN)?;
        validate::addresses(&r.addresses)?;
        validate::capabilities(&r.capabilities)?;
        let settings = self.ctx.settings.for_job(&r.job);
        let (job, worker) = (r.job.as_str(), r.worker_id.as_str());
        let (state, current_generation) =
            self.read_join_view(job, worker, records::effective_domain(&r.domain, &r.host)).await?;
        if let Some(ended) = &state.ended {
            return Err(Status::failed_precondition(format!(
                "job {job} has ended ({:?}: {}); start a new job id",
                ended.outcome, ended.reason
            )));
        }
        let now = records::now_ms();
        let domain = records::effective_domain(&r.domain, &r.host);
        let own = state.failures.get(worker).and_then(|h| h.excluded_until(now).map(|u| (u, h)));
        let of_domain =
            state.failures.get(&crate::domains::domain_key(domain)).and_then(|h| h.excluded_until(now).map(|u| (u, h)));
        let exclusion = match (own, of_domain) {
            (Some(w), Some(d)) if d.0 > w.0 => Some((format!("failure domain {domain}"), d)),
            (Some(w), _) => Some((format!("worker {worker}"), w)),
            (None, Some(d)) => Some((format!("failure domain {domain}"), d)),
            (None, None) => None,
        };
        if let Some((who, (until, history))) = exclusion {
            // The worker waits this long and joins again (it needs no clock of ours).
            let mut status = Status::failed_precondition(crate::exclusion::refusal(
                &who,
                until,
                now,
                &history.reason,
                &self.ctx.exclusion,
            ));
            if let Ok(left) = (until - now).to_string().parse() {
                status.metadata_mut().insert(cohort_proto::RETRY_AFTER_MS_HEADER, left);
            }
            return Err(status);
        }
        // Two processes with one worker id would evict each other without end: a live holder
        // keeps the id (another process gets ALREADY_EXISTS), a silent one is replaced (a
        // restart after a crash). The process that holds the id names it in `replaces`.
        if let Some(holder) = state.members.get(worker).filter(|m| m.incarnation != r.replaces) {
            let silent_for = self.silent_for(job, holder, &state).await.map_err(store_status)?;
            let live_window = PROGRESS_PERIOD + 2 * settings.heartbeat_interval;
            if silent_for < live_window {
                return Err(id_in_use(job, holder, silent_for, live_window - silent_for));
            }
        }
        let lease = self.ctx.store.grant_lease(settings.lease_ttl_for_store()).await.map_err(store_status)?;
        let incarnation = lease as u64;
        // Replacing an older incarnation that is in the active generation revokes it.
        let old = state.members.get(worker).cloned();
        if let (Some(old), Some(g)) = (&old, state.current()) {
            if g.revoked.is_none() && g.departed(worker, old.incarnation).is_none() {
                if let Some(rank) = g.rank_of(worker, old.incarnation) {
                    let cause = records::Cause {
                        rank: Some(rank),
                        worker_id: worker.to_string(),
                        host: old.host.clone(),
                        reason: format!("worker restarted (incarnation {} replaced by {incarnation})", old.incarnation),
                        reported_by: "coordinator".into(),
                        domain: String::new(),
                        lost_ranks: Vec::new(),
                    };
                    let revoked = ops::revoke_generation(
                        &self.ctx,
                        job,
                        g.number,
                        cause,
                        Some((worker.to_string(), old.incarnation)),
                        false,
                    )
                    .await;
                    if let Err(e) = revoked {
                        let _ = self.ctx.store.revoke_lease(lease).await;
                        return Err(store_status(e));
                    }
                }
            }
        }
        let member = MemberRecord {
            worker_id: worker.to_string(),
            incarnation,
            host: r.host.clone(),
            addresses: r.addresses.iter().map(Into::into).collect(),
            capabilities: r.capabilities.clone(),
            joined_at_ms: now,
            domain: r.domain.clone(),
        };
        let progress =
            ProgressRecord { incarnation, last_heartbeat_ms: now, activity: "joined".into(), ..Default::default() };
        let txn = Txn {
            compares: vec![Compare::Absent(keys::ended(job))],
            success: vec![
                TxnOp::Put {
                    key: keys::worker_key(job, Kind::Member, worker),
                    value: encode(&member),
                    lease: Some(lease),
                },
                TxnOp::Put {
                    key: keys::worker_key(job, Kind::Progress, worker),
                    value: encode(&progress),
                    lease: Some(lease),
                },
            ],
            failure: vec![],
        };
        let result = self.ctx.store.txn(txn).await;
        match result {
            Ok(r) if r.succeeded => {}
            other => {
                let _ = self.ctx.store.revoke_lease(lease).await;
                return match other {
                    Ok(_) => Err(Status::failed_precondition(format!("job {job} has ended; start a new job id"))),
                    Err(e) => Err(store_status(e)),
                };
            }
        }
        if let Some(old) = old {
            if let Err(e) = self.ctx.store.revoke_lease(old.incarnation as i64).await {
                tracing::debug!(error = %e, "could not revoke the replaced incarnation's lease");
            }
        }
        self.forget_progress(job, worker);
        tracing::info!(incarnation, host = %r.host, "member joined");
        Ok(pb::JoinResponse {
            incarnation,
            heartbeat_interval_ms: settings.heartbeat_interval.as_millis() as u64,
            lease_ttl_ms: settings.lease_ttl.as_millis() as u64,
            current_generation,
            settings: Some(settings.to_proto()),
        })
    }

    async fn do_heartbeat(&self, r: pb::HeartbeatRequest) -> Result<pb::HeartbeatResponse, Status> {
        validate::id("job", &r.job)?;
        validate::id("worker_id", &r.worker_id)?;
        validate::incarnation(r.incarnation)?;
        validate::text("activity", &r.activity, validate::MAX_ACTIVITY_LEN)?;
        validate::text("deadlines", &r.deadlines, validate::MAX_ACTIVITY_LEN)?;
        let hub = self.hub(&r.job).await?;
        let current = self.current_number(&hub, &r.job, r.generation).await?;
        validate::generation("generation", r.generation, current)?;
        self.require_member(&hub, &r.job, &r.worker_id, r.incarnation).await?;
        self.ctx.store.keep_alive(r.incarnation as i64).await.map_err(|e| match e {
            StoreError::LeaseNotFound(_) => not_member(&r.job, &r.worker_id, r.incarnation),
            other => store_status(other),
        })?;
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
        // Read under the view's lock: a copy of the state per heartbeat would cost O(members).
        let (timing, finding) = hub.read(|state| {
            // The member's step timing, as a rank of the current generation (else not judged).
            let timing = r.timing.as_ref().filter(|t| t.steps > 0).and_then(|t| {
                let g = state.current().filter(|g| g.number == r.generation && g.revoked.is_none())?;
                Some(stragglers::Timing {
                    generation: g.number,
                    rank: g.rank_of(&r.worker_id, r.incarnation)?,
                    steps: t.steps,
                    compute_us: t.compute_us,
                    collective_us: t.collective_us,
                    peer_waits: t.peer_waits.iter().map(|w| (w.rank, w.wait_us)).collect(),
                })
            });
            let finding = timing.as_ref().and_then(|own| {
                let mut round = self.latest_timings(&r.job, state, own.generation);
                round.retain(|t| t.rank != own.rank);
                round.push(own.clone());
                stragglers::judge(&stragglers::StragglerRule::default(), own.rank, &round)
            });
            (timing, finding)
        });
        let policy = self.ctx.settings.for_job(&r.job).straggler_policy;
        let mut change = stragglers::Change::None;
        let mut standing = stragglers::Standing::default();
        let mut excluded_until = None;
        self.record_progress(&r.job, &r.worker_id, r.incarnation, |p| {
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
                excluded_until = self.act_on_straggler(&r.job, &r.worker_id, r.incarnation, &state, &standing).await;
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
            .record_progress(job, worker, incarnation, |p| {
                p.straggler_action = action;
                if until.is_some() {
                    p.straggler_excluded_until_ms = until;
                }
            })
            .await;
        until
    }

    async fn do_rendezvous(&self, r: pb::RendezvousRequest) -> Result<pb::RendezvousResponse, Status> {
        use pb::rendezvous_response::Outcome as O;
        validate::id("job", &r.job)?;
        validate::id("worker_id", &r.worker_id)?;
        validate::incarnation(r.incarnation)?;
        let (job, worker, incarnation) = (r.job.as_str(), r.worker_id.as_str(), r.incarnation);
        let settings = self.ctx.settings.for_job(job);
        let hub = self.hub(job).await?;
        let current = self.current_number(&hub, job, r.after_generation).await?;
        validate::generation("after_generation", r.after_generation, current)?;
        let wait = Duration::from_millis(r.wait_ms).min(MAX_RENDEZVOUS_WAIT);
        let deadline = tokio::time::Instant::now() + wait;
        // Long polls wait on the hub's signal, which changes once per formation, revocation,
        // end or departure (not per arrival), and answer from its prebuilt generation: a
        // formation of N members costs N answers, not N wake-ups per arrival and a search of
        // N members per answer.
        let mut rx = hub.subscribe_signal();
        let answer = |signal: &hub::Signal| -> Option<O> {
            if let Some(ended) = &signal.ended {
                return Some(O::Ended(ended.to_proto()));
            }
            // A generation revoked before this member saw it is still its answer: the member
            // learns of the revocation (watch, failed connection) and rendezvous again after
            // it. Withholding it would leave the member waiting after an older generation,
            // which never counts as ready for the next one.
            let g = signal.formed.as_ref()?;
            (g.number > r.after_generation && g.rank_of(worker, incarnation).is_some())
                .then(|| O::Formed(g.proto.clone()))
        };
        let signal = rx.borrow_and_update().clone();
        if let Some(o) = answer(&signal) {
            return Ok(pb::RendezvousResponse { outcome: Some(o) });
        }
        self.require_member(&hub, job, worker, incarnation).await?;
        // Declare the wait (on the member's lease), keeping the first arrival time.
        let wkey = keys::worker_key(job, Kind::Waiting, worker);
        let existing = self.ctx.store.get(&wkey).await.map_err(store_status)?;
        let existing: Option<WaitingRecord> = existing.and_then(|kv| decode(&wkey, &kv.value));
        let mut written_at = 0;
        let keep =
            existing.as_ref().is_some_and(|w| w.incarnation == incarnation && w.after_generation == r.after_generation);
        if !keep {
            let record =
                WaitingRecord { incarnation, after_generation: r.after_generation, since_ms: records::now_ms() };
            written_at =
                self.ctx.store.put(&wkey, encode(&record), Some(incarnation as i64)).await.map_err(|e| match e {
                    StoreError::LeaseNotFound(_) => not_member(job, worker, incarnation),
                    other => store_status(other),
                })?;
            tracing::debug!(after = r.after_generation, "member waiting");
        }
        let _ = self
            .record_progress(job, worker, incarnation, |p| {
                p.activity = "rendezvous".into();
                p.last_heartbeat_ms = records::now_ms();
            })
            .await;
        let mut shutdown = self.ctx.shutdown.clone();
        loop {
            let signal = rx.borrow_and_update().clone();
            if let Some(o) = answer(&signal) {
                return Ok(pb::RendezvousResponse { outcome: Some(o) });
            }
            if hub.read(|state| state.revision >= written_at && !state.is_live(worker, incarnation)) {
                // The view includes our wait, and we are gone: evicted or expired.
                self.require_member(&hub, job, worker, incarnation).await?;
            }
            tokio::select! {
                changed = rx.changed() => {
                    if changed.is_err() {
                        return Err(Status::unavailable("coordinator view of the job stopped; call again"));
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    return Ok(pb::RendezvousResponse {
                        outcome: Some(O::Waiting(pb::Waiting {
                            waiting_members: hub.read(|state| state.waiting.len() as u32),
                            min_workers: settings.min_workers,
                        })),
                    });
                }
                _ = crate::ops::stopped(&mut shutdown) => {
                    return Err(Status::unavailable("coordinator replica shutting down; call another"));
                }
            }
        }
    }

    async fn do_leave(&self, r: pb::LeaveRequest) -> Result<pb::LeaveResponse, Status> {
        use pb::leave_request::Mode;
        validate::id("job", &r.job)?;
        validate::id("worker_id", &r.worker_id)?;
        validate::incarnation(r.incarnation)?;
        let finished = match Mode::try_from(r.mode) {
            Ok(Mode::Graceful) => false,
            Ok(Mode::Finished) => true,
            _ => return Err(Status::invalid_argument(format!("mode {} is not GRACEFUL (1) or FINISHED (2)", r.mode))),
        };
        let (job, worker, incarnation) = (r.job.as_str(), r.worker_id.as_str(), r.incarnation);
        let store = self.ctx.store.as_ref();
        for _ in 0..16 {
            let Some((member, mkv)) = ops::read_member(store, job, worker).await.map_err(store_status)? else {
                return Ok(pb::LeaveResponse {}); // already gone: leaving twice is harmless
            };
            if member.incarnation != incarnation {
                return Ok(pb::LeaveResponse {});
            }
            let generation = ops::read_generation(store, job).await.map_err(store_status)?;
            let gen_key = keys::generation(job);
            let mut txn = Txn {
                compares: vec![Compare::ModRevision(mkv.key.clone(), mkv.mod_revision)],
                success: vec![
                    TxnOp::Delete(mkv.key.clone()),
                    TxnOp::Delete(keys::worker_key(job, Kind::Waiting, worker)),
                    TxnOp::Delete(keys::worker_key(job, Kind::Progress, worker)),
                ],
                failure: vec![],
            };
            let mut updated = None;
            match &generation {
                Some((g, gkv)) => {
                    txn.compares.push(Compare::ModRevision(gen_key.clone(), gkv.mod_revision));
                    if g.rank_of(worker, incarnation).is_some() && g.departed(worker, incarnation).is_none() {
                        let mut g = g.clone();
                        g.departed.push(Departure { worker_id: worker.to_string(), incarnation, finished });
                        txn.success.push(TxnOp::Put {
                            key: gen_key.clone(),
                            value: records::encode_generation(&g),
                            lease: None,
                        });
                        updated = Some(g);
                    }
                }
                None => txn.compares.push(Compare::Absent(gen_key.clone())),
            }
            let result = store.txn(txn).await.map_err(store_status)?;
            if !result.succeeded {
                continue;
            }
            if let Err(e) = store.revoke_lease(incarnation as i64).await {
                tracing::debug!(error = %e, "could not revoke the leaver's lease");
            }
            self.forget_progress(job, worker);
            self.ctx.metrics.straggler_cleared(job, worker);
            tracing::info!(finished, "member left");
            if let Some(g) = updated {
                let everyone_gone = g.members.iter().all(|m| g.departed(&m.worker_id, m.incarnation).is_some());
                if finished && everyone_gone {
                    let reason = format!("all {} members of generation {} finished", g.members.len(), g.number);
                    let ended = ops::end_job(&self.ctx, job, Outcome::Finished, &reason, Some(result.revision), &[])
                        .await
                        .map_err(store_status)?;
                    if ended {
                        self.commits.lock().unwrap_or_else(|e| e.into_inner()).forget(job);
                    }
                }
            }
            return Ok(pb::LeaveResponse {});
        }
        Err(Status::unavailable("leave: too much contention on the job's records; retry"))
    }

    async fn do_commit(&self, r: pb::CommitRequest) -> Result<pb::CommitResponse, Status> {
        validate::id("job", &r.job)?;
        validate::id("worker_id", &r.worker_id)?;
        validate::incarnation(r.incarnation)?;
        if r.digest.len() > validate::MAX_DIGEST_LEN {
            return Err(Status::invalid_argument(format!(
                "digest is {} bytes (at most {})",
                r.digest.len(),
                validate::MAX_DIGEST_LEN
            )));
        }
        let hub = self.hub(&r.job).await?;
        let current = self.current_number(&hub, &r.job, r.generation).await?;
        validate::generation("generation", r.generation, current)?;
        self.require_member(&hub, &r.job, &r.worker_id, r.incarnation).await?;
        let now = records::now_ms();
        let digest = hex(&r.digest);
        self.record_progress(&r.job, &r.worker_id, r.incarnation, |p| {
            p.last_commit_step = r.step;
            p.last_commit_generation = r.generation;
            p.last_commit_digest = digest.clone();
            p.last_commit_ms = now;
            p.step = r.step;
        })
        .await?;
        let mismatch = self.commits.lock().unwrap_or_else(|e| e.into_inner()).record(
            &r.job,
            r.generation,
            r.step,
            &r.worker_id,
            &digest,
            Instant::now(),
        );
        if let Some(m) = mismatch {
            self.ctx.metrics.digest_mismatch(&r.job);
            let commits: Vec<String> = m.commits.iter().map(|c| format!("{}={}", c.worker_id, c.digest)).collect();
            tracing::warn!(
                generation = m.generation,
                step = m.step,
                commits = %commits.join(" "),
                "members committed one step with different state digests"
            );
        }
        Ok(pb::CommitResponse { reformation_pending: hub.pending().is_some() })
    }

    async fn do_status(&self, r: pb::StatusRequest) -> Result<pb::StatusResponse, Status> {
        validate::id("job", &r.job)?;
        let (kvs, revision) = self.ctx.store.get_prefix(&keys::job_prefix(&r.job)).await.map_err(store_status)?;
        let leader = self.ctx.store.get(keys::LEADER).await.map_err(store_status)?;
        let leader = leader.map(|kv| String::from_utf8_lossy(&kv.value).into_owned()).unwrap_or_default();
        if kvs.is_empty() {
            return Err(unknown_job(&r.job, &leader));
        }
        let state = JobState::from_kvs(&r.job, &kvs, revision);
        let settings = self.ctx.settings.for_job(&r.job);
        let g = state.current();
        let now = records::now_ms();
        let excluded = crate::rendezvous::excluded(&state, now);
        // Progress is written to the store at most once per PROGRESS_PERIOD; this replica's
        // cache is newer for the members it serves.
        let cached: HashMap<String, ProgressRecord> = {
            let cache = self.progress.lock().unwrap_or_else(|e| e.into_inner());
            state
                .members
                .values()
                .filter_map(|m| {
                    let c = cache.get(&(r.job.clone(), m.worker_id.clone()))?;
                    let stored = state.progress.get(&m.worker_id).filter(|p| p.incarnation == m.incarnation);
                    let newer = c.record.incarnation == m.incarnation
                        && stored.is_none_or(|p| c.record.last_heartbeat_ms >= p.last_heartbeat_ms);
                    newer.then(|| (m.worker_id.clone(), c.record.clone()))
                })
                .collect()
        };
        let members = state
            .members
            .values()
            .map(|m| {
                let p = cached
                    .get(&m.worker_id)
                    .or_else(|| state.progress.get(&m.worker_id).filter(|p| p.incarnation == m.incarnation));
                let waiting = state.waiting.get(&m.worker_id).is_some_and(|w| {
                    w.incarnation == m.incarnation
                        && !excluded.contains(&m.worker_id)
                        && g.is_none_or(|g| {
                            g.rank_of(&m.worker_id, m.incarnation).is_none() || w.after_generation >= g.number
                        })
                });
                pb::MemberStatus {
                    worker_id: m.worker_id.clone(),
                    incarnation: m.incarnation,
                    host: m.host.clone(),
                    domain: records::effective_domain(&m.domain, &m.host).to_string(),
                    rank: g.and_then(|g| g.rank_of(&m.worker_id, m.incarnation)),
                    last_heartbeat_ms: p.map_or(m.joined_at_ms, |p| p.last_heartbeat_ms),
                    generation: p.map_or(0, |p| p.generation),
                    step: p.map_or(0, |p| p.step),
                    activity: p.map_or_else(String::new, |p| p.activity.clone()),
                    deadlines: p.map_or_else(String::new, |p| p.deadlines.clone()),
                    last_commit_step: p.map_or(0, |p| p.last_commit_step),
                    last_commit_digest: p.map_or_else(String::new, |p| p.last_commit_digest.clone()),
                    waiting,
                    control_connected: state
                        .control
                        .get(&m.worker_id)
                        .filter(|c| c.incarnation == m.incarnation)
                        .map(|c| c.connected),
                    timing: p.and_then(|p| p.timing.as_ref()).map(|t| pb::StepTiming {
                        steps: t.steps,
                        compute_us: t.compute_us,
                        collective_us: t.collective_us,
                        peer_waits: t
                            .peer_waits
                            .iter()
                            .map(|&(rank, wait_us)| pb::PeerWait { rank, wait_us })
                            .collect(),
                    }),
                    straggler: p.and_then(ProgressRecord::straggler_verdict),
                }
            })
            .collect::<Vec<pb::MemberStatus>>();
        // Members' last commits as the store and this replica's cache hold them, with the
        // mismatches this replica saw as commits arrived.
        let last_commits = state.members.values().filter_map(|m| {
            let p = cached
                .get(&m.worker_id)
                .or_else(|| state.progress.get(&m.worker_id).filter(|p| p.incarnation == m.incarnation))?;
            (p.last_commit_ms > 0).then(|| {
                let commit = digests::Commit { worker_id: m.worker_id.clone(), digest: p.last_commit_digest.clone() };
                (p.last_commit_generation, p.last_commit_step, commit)
            })
        });
        let seen = self.commits.lock().unwrap_or_else(|e| e.into_inner()).mismatches(&r.job);
        let digest_mismatches =
            digests::merge(seen, digests::among_last_commits(last_commits)).iter().map(|m| m.to_proto()).collect();
        let exclusions = state
            .failures
            .iter()
            .filter_map(|(worker, h)| {
                let until_ms = h.excluded_until(now)?;
                Some(pb::Exclusion { worker_id: worker.clone(), until_ms, reason: h.reason.clone() })
            })
            .collect();
        Ok(pb::StatusResponse {
            exclusions,
            digest_mismatches,
            job: r.job.clone(),
            settings: Some(settings.to_proto()),
            current: g.map(|g| g.to_proto()),
            current_revoked: g.is_some_and(|g| g.revoked.is_some()),
            revocation_cause: g.and_then(|g| g.revoked.as_ref()).map(|c| c.to_proto()),
            members,
            ended: state.ended.as_ref().map(|e| e.to_proto()),
            leader,
        })
    }

    async fn do_watch(&self, r: pb::WatchRequest) -> Result<ReceiverStream<Result<pb::JobEvent, Status>>, Status> {
        validate::id("job", &r.job)?;
        validate::id("worker_id", &r.worker_id)?;
        let hub = self.hub(&r.job).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let shutdown = self.ctx.shutdown.clone();
        let span = tracing::debug_span!("watch", job = %r.job, worker = %r.worker_id, incarnation = r.incarnation);
        let service = self.clone();
        tokio::spawn(
            async move {
                // Recording the stream (a store write) does not hold back its first events.
                let (control, end) = tokio::join!(
                    service.control_opened(&hub, &r.job, &r.worker_id, r.incarnation),
                    stream_events(&hub, &tx, shutdown)
                );
                if let (WatchEnd::ClientGone, Some(revision)) = (end, control) {
                    service.control_closed(&r.job, &r.worker_id, r.incarnation, revision).await;
                }
            }
            .instrument(span),
        );
        Ok(ReceiverStream::new(rx))
    }

    /// Records that a member's control stream is open (see [`records::ControlRecord`]);
    /// returns the revision written, or `None` when the caller is not a live member (an
    /// operator's tool) or the store refused.
    async fn control_opened(&self, hub: &Hub, job: &str, worker: &str, incarnation: u64) -> Option<i64> {
        if incarnation == 0 {
            return None;
        }
        if !hub.read(|state| state.is_live(worker, incarnation)) {
            // The view may lag a join by milliseconds: ask the store.
            match ops::read_member(self.ctx.store.as_ref(), job, worker).await {
                Ok(Some((m, _))) if m.incarnation == incarnation => {}
                _ => return None,
            }
        }
        let record = records::ControlRecord { incarnation, connected: true, since_ms: records::now_ms() };
        let key = keys::worker_key(job, Kind::Control, worker);
        match self.ctx.store.put(&key, encode(&record), Some(incarnation as i64)).await {
            Ok(revision) => Some(revision),
            Err(e) => {
                tracing::debug!(error = %e, "could not record the control stream as open");
                None
            }
        }
    }

    /// Records that a member's control stream closed from its side, unless the replica is
    /// shutting down (then the member reconnects elsewhere) or a newer stream was recorded
    /// since `revision` (a compare-and-swap).
    async fn control_closed(&self, job: &str, worker: &str, incarnation: u64, revision: i64) {
        if self.shutting_down() {
            return;
        }
        let key = keys::worker_key(job, Kind::Control, worker);
        let record = records::ControlRecord { incarnation, connected: false, since_ms: records::now_ms() };
        let txn = Txn {
            compares: vec![Compare::ModRevision(key.clone(), revision)],
            success: vec![TxnOp::Put { key, value: encode(&record), lease: Some(incarnation as i64) }],
            failure: vec![],
        };
        match self.ctx.store.txn(txn).await {
            Ok(r) if r.succeeded => {
                tracing::info!("member's control stream closed; the rendezvous no longer waits for it")
            }
            Ok(_) => tracing::debug!("control stream closed; a newer one is recorded"),
            Err(e) => tracing::debug!(error = %e, "could not record the control stream as closed"),
        }
    }
}

/// Why a watch stream ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WatchEnd {
    /// The client went away (closed the stream, or its connection closed).
    ClientGone,
    /// The job ended (its last event was sent).
    JobEnded,
    /// This replica is shutting down, or its view of the job stopped.
    Replica,
}

/// Sends a job's events on a watch stream until the client goes away, the job ends or the
/// replica stops.
///
/// # Cancel safety
/// Cancel safe: it only sends.
async fn stream_events(
    hub: &Hub,
    tx: &tokio::sync::mpsc::Sender<Result<pb::JobEvent, Status>>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> WatchEnd {
    let mut events = hub.subscribe_events();
    let mut sent = Sent::default();
    let mut batch = hub.read(|state| initial_events(&hub.signal(), state.current(), hub.pending()));
    loop {
        for e in batch {
            if !sent.admit(&e) {
                continue;
            }
            let end = matches!(e.event, Some(Event::JobEnded(_)));
            if tx.send(Ok(e)).await.is_err() {
                return WatchEnd::ClientGone;
            }
            if end {
                return WatchEnd::JobEnded;
            }
        }
        let next = tokio::select! {
            e = events.recv() => e,
            _ = tx.closed() => return WatchEnd::ClientGone,
            _ = crate::ops::stopped(&mut shutdown) => {
                let _ = tx.send(Err(Status::unavailable("coordinator replica shutting down; watch another"))).await;
                return WatchEnd::Replica;
            }
        };
        batch = match next {
            Ok(e) => vec![e],
            Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                tracing::debug!(skipped = n, "watch fell behind; resending the current state");
                hub.read(|state| initial_events(&hub.signal(), state.current(), hub.pending()))
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                let _ = tx.send(Err(Status::unavailable("coordinator view of the job stopped; watch again"))).await;
                return WatchEnd::Replica;
            }
        };
    }
}

/// The events describing a job's current state, for a new watcher: the hub's prebuilt ones
/// (built once per change, not once per watcher) and a pending re-formation of `current`.
fn initial_events(
    signal: &hub::Signal,
    current: Option<&records::GenerationRecord>,
    pending: Option<u32>,
) -> Vec<pb::JobEvent> {
    let mut out = signal.initial.clone();
    if let (Some(joiners), Some(g)) = (pending, current) {
        out.push(hub::pending_event(g.number, joiners));
    }
    out
}

/// What a watch stream has sent, to drop repeats.
#[derive(Default)]
struct Sent {
    /// Stragglers announced: (worker, named since).
    stragglers: std::collections::HashSet<(String, u64)>,
    formed: u64,
    revoked: u64,
    pending: Option<(u64, u32)>,
    ended: bool,
}

impl Sent {
    fn admit(&mut self, e: &pb::JobEvent) -> bool {
        match &e.event {
            Some(Event::GenerationFormed(g)) if g.number > self.formed => {
                self.formed = g.number;
                self.pending = None;
                true
            }
            Some(Event::GenerationRevoked(r)) if r.generation > self.revoked => {
                self.revoked = r.generation;
                true
            }
            Some(Event::ReformationPending(p)) if self.pending != Some((p.generation, p.joiners)) => {
                self.pending = Some((p.generation, p.joiners));
                true
            }
            Some(Event::JobEnded(_)) if !self.ended => {
                self.ended = true;
                true
            }
            Some(Event::StragglerNamed(n)) => {
                let since = n.verdict.as_ref().map_or(0, |v| v.since_ms);
                self.stragglers.insert((n.worker_id.clone(), since))
            }
            _ => false,
        }
    }
}

macro_rules! rpc {
    ($self:ident, $name:literal, $req:ident, $f:ident, $span:expr) => {{
        // The interceptor authenticated the token; here the credential meets the message's job.
        let caller = $req.extensions().get::<crate::auth::Caller>().cloned();
        let request = $req.into_inner();
        let span = $span(&request);
        let result = if $self.shutting_down() {
            Err(Status::unavailable("coordinator replica shutting down; call another"))
        } else if let Err(denied) = caller.map_or(Ok(()), |c| c.permits(&request.job)) {
            Err(denied)
        } else {
            $self.$f(request).instrument(span).await
        };
        $self.ctx.metrics.rpc($name, result.as_ref().map_or_else(|s| s.code(), |_| tonic::Code::Ok));
        if let Err(status) = &result {
            tracing::debug!(rpc = $name, code = ?status.code(), message = %status.message(), "request refused");
        }
        result.map(Response::new)
    }};
}

fn span3(name: &'static str, job: &str, worker: &str, incarnation: u64) -> tracing::Span {
    tracing::info_span!("rpc", method = name, job = %job, worker = %worker, incarnation)
}

#[tonic::async_trait]
impl pb::coordinator_server::Coordinator for CoordinatorService {
    /// Registers one incarnation of a worker.
    async fn join(&self, request: Request<pb::JoinRequest>) -> Result<Response<pb::JoinResponse>, Status> {
        rpc!(self, "Join", request, do_join, |r: &pb::JoinRequest| span3("Join", &r.job, &r.worker_id, 0))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        rpc!(self, "Heartbeat", request, do_heartbeat, |r: &pb::HeartbeatRequest| tracing::debug_span!(
            "rpc", method = "Heartbeat", job = %r.job, worker = %r.worker_id, incarnation = r.incarnation, generation = r.generation))
    }

    async fn rendezvous(
        &self,
        request: Request<pb::RendezvousRequest>,
    ) -> Result<Response<pb::RendezvousResponse>, Status> {
        rpc!(self, "Rendezvous", request, do_rendezvous, |r: &pb::RendezvousRequest| tracing::info_span!(
            "rpc", method = "Rendezvous", job = %r.job, worker = %r.worker_id, incarnation = r.incarnation, after = r.after_generation))
    }

    type WatchStream = ReceiverStream<Result<pb::JobEvent, Status>>;

    async fn watch(&self, request: Request<pb::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        rpc!(self, "Watch", request, do_watch, |r: &pb::WatchRequest| span3(
            "Watch",
            &r.job,
            &r.worker_id,
            r.incarnation
        ))
    }

    async fn report_failure(
        &self,
        request: Request<pb::FailureReport>,
    ) -> Result<Response<pb::FailureReportResponse>, Status> {
        rpc!(self, "ReportFailure", request, do_report, |r: &pb::FailureReport| tracing::info_span!(
            "rpc", method = "ReportFailure", job = %r.job, worker = %r.worker_id, incarnation = r.incarnation, generation = r.generation))
    }

    async fn leave(&self, request: Request<pb::LeaveRequest>) -> Result<Response<pb::LeaveResponse>, Status> {
        rpc!(self, "Leave", request, do_leave, |r: &pb::LeaveRequest| span3(
            "Leave",
            &r.job,
            &r.worker_id,
            r.incarnation
        ))
    }

    async fn commit(&self, request: Request<pb::CommitRequest>) -> Result<Response<pb::CommitResponse>, Status> {
        rpc!(self, "Commit", request, do_commit, |r: &pb::CommitRequest| tracing::debug_span!(
            "rpc", method = "Commit", job = %r.job, worker = %r.worker_id, incarnation = r.incarnation, generation = r.generation))
    }

    async fn status(&self, request: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        rpc!(
            self,
            "Status",
            request,
            do_status,
            |r: &pb::StatusRequest| tracing::debug_span!("rpc", method = "Status", job = %r.job)
        )
    }
}
