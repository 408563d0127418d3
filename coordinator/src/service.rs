//! The `cohort.v1.Coordinator` gRPC service over the store.
//!
//! Every replica serves every RPC: all state is in the store, and a replica keeps only
//! caches (per-job [`Hub`]s, throttled progress). Every request is validated first
//! ([`crate::validate`]); a bad one changes nothing.
//!
//! Membership: a member is one incarnation of a worker; its keys are on a store lease of its
//! own, whose id is the incarnation, or (`lease_scope = "host"`) on its host's shared lease,
//! named in its member record (`host_lease`). An evicted member (a failure report named it,
//! its lease lapsed, or the leader swept it silent off a shared lease) gets NOT_FOUND on its
//! next Heartbeat, Rendezvous or Commit, and must Join again; it then enters the next
//! generation as a joiner.
//!
//! Watch needs no membership (an operator's tool may follow a job); it validates the ids
//! and the token like every RPC. A Rendezvous answers with the newest generation that
//! includes the caller even when it is already revoked: the member learns the revocation
//! (watch, failed connection) and rendezvous again after it.
//!
//! This file holds the service, the helpers several RPCs share (the error statuses, the
//! job's view, membership checks, the progress cache) and the `Coordinator` trait's
//! dispatch, which checks the caller's credential against the job and hands each RPC to its
//! handler. Each RPC's handler, with the helpers only it uses, is in a submodule, each an
//! `impl CoordinatorService` block of its own:
//!
//! - `join`: `Join` (exclusions, a worker id held by a live process, the replaced
//!   incarnation's revocation, the member's records on a new lease);
//! - `heartbeat`: `Heartbeat` and `HostHeartbeat` (lease, progress, and the straggler judgement and action);
//! - `rendezvous`: `Rendezvous` (the declared wait, the long poll on the hub's signal; the
//!   compact answer);
//! - `members`: `Members` (entries of the newest generation by rank and by host, for
//!   members that rendezvoused compactly);
//! - `watch`: `Watch` (the job's event stream, and the member's control-stream record);
//! - `failures`: `ReportFailure` (the report path's store I/O around the decisions of
//!   `report` and `revocation`);
//! - `leave`: `Leave` (the departure, and the job's end when every member finished);
//! - `commit`: `Commit` (the commit point, the state-digest ledger);
//! - `status`: `Status` (the job's state, with this replica's newer progress);
//! - `store_op`: `StoreOp` (the job's key-value store, torch's c10d store: [`crate::kv`]).

mod commit;
mod failures;
mod heartbeat;
mod host_lease;
mod join;
mod leave;
mod members;
mod rendezvous;
mod status;
mod store_op;
mod watch;

use crate::digests::CommitLedger;
use crate::hub::Hub;
use crate::keys::{self, Kind};
use crate::ops::{self, Context};
use crate::records::{encode, JobState, ProgressRecord};
use crate::revocation;
use crate::store::StoreError;
use cohort_proto::v1 as pb;
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

/// Members whose progress a replica caches at most (the least recently heard go first): room
/// for a job of 16,384 members several times over. An evicted member's next heartbeat writes
/// its progress again, so a cap below the members served would turn every heartbeat into an
/// etcd write. An entry is about 200 bytes.
const PROGRESS_CACHE_CAP: usize = 65_536;

/// Jobs whose indexed straggler round a replica keeps at most (the least recently used go
/// first; a dropped one is rebuilt at the job's next timed heartbeat).
const STRAGGLER_ROUNDS_CAP: usize = 1024;

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
    /// Per job, the latest reports of its current generation indexed for the straggler
    /// judgement (`heartbeat::straggler_round`).
    straggler_rounds: Arc<Mutex<HashMap<String, heartbeat::IndexedRound>>>,
    /// Leaves waiting to be written, grouped per job (`leave`).
    leaves: Arc<leave::LeaveQueues>,
    /// The hosts' shared leases this replica found or granted, and their renewals
    /// (`lease_scope = "host"`).
    host_leases: Arc<host_lease::HostLeases>,
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

impl CoordinatorService {
    /// A service over a replica's shared context.
    pub fn new(ctx: Arc<Context>) -> Self {
        Self {
            ctx,
            progress: Arc::new(Mutex::new(HashMap::new())),
            commits: Arc::new(Mutex::new(CommitLedger::default())),
            cascade_scope: CascadeScope::Store,
            own_timeouts: Arc::new(Mutex::new(Vec::new())),
            straggler_rounds: Arc::new(Mutex::new(HashMap::new())),
            leaves: Arc::new(leave::LeaveQueues::default()),
            host_leases: Arc::new(host_lease::HostLeases::default()),
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

    /// Confirms that `(worker, incarnation)` is a live member, and answers the store lease its
    /// records are on: the hub's view first, the store when the view disagrees (it may lag a
    /// change by milliseconds).
    ///
    /// Every heartbeat asks, so the view is read in place: nothing is copied unless the
    /// answer is no.
    async fn require_member(
        &self,
        hub: &Hub,
        job: &str,
        worker: &str,
        incarnation: u64,
    ) -> Result<crate::store::LeaseId, Status> {
        let ended = hub.read(|state| {
            if let Some(m) = state.members.get(worker).filter(|m| m.incarnation == incarnation) {
                return Ok(m.lease());
            }
            Err(state.ended.as_ref().map(|ended| {
                format!("job {job} has ended ({:?}: {}); member {worker} is no longer in it", ended.outcome, ended.reason)
            }))
        });
        match ended {
            Ok(lease) => return Ok(lease),
            Err(Some(ended)) => return Err(Status::not_found(ended)),
            Err(None) => {}
        }
        match ops::read_member(self.ctx.store.as_ref(), job, worker).await.map_err(store_status)? {
            Some((m, _)) if m.incarnation == incarnation => Ok(m.lease()),
            _ => Err(not_member(job, worker, incarnation)),
        }
    }

    /// The store lease the records of `(worker, incarnation)` are on, from the hub's view or
    /// else the store; `None` if it is not a member (any more).
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    async fn lease_of(&self, job: &str, worker: &str, incarnation: u64) -> Result<Option<crate::store::LeaseId>, Status> {
        let hub = self.hub(job).await?;
        let seen = hub.read(|state| state.members.get(worker).filter(|m| m.incarnation == incarnation).map(|m| m.lease()));
        if seen.is_some() {
            return Ok(seen);
        }
        let stored = ops::read_member(self.ctx.store.as_ref(), job, worker).await.map_err(store_status)?;
        Ok(stored.filter(|(m, _)| m.incarnation == incarnation).map(|(m, _)| m.lease()))
    }

    /// The newest generation number, from the view or (if the client names a newer one)
    /// the store.
    async fn current_number(&self, hub: &Hub, job: &str, claimed: u64) -> Result<u64, Status> {
        let seen = hub.read(JobState::current_number);
        if claimed <= seen {
            return Ok(seen);
        }
        Ok(ops::read_generation_in(&self.ctx, job).await.map_err(store_status)?.map_or(0, |(g, _)| g.number))
    }

    /// Updates the cached progress of a member; writes it to the store (on `lease`, the
    /// member's) when the last write is older than [`PROGRESS_PERIOD`], never with an older
    /// `last_heartbeat_ms` than this replica's view of the store holds.
    async fn record_progress(
        &self,
        job: &str,
        worker: &str,
        incarnation: u64,
        lease: crate::store::LeaseId,
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
        if let Some(mut record) = to_write {
            // A member's calls may reach two replicas (its beats through its host's relay, its
            // commits through its own client, each on its own endpoint), and each replica
            // writes the record it holds. Written as cached, a replica that no longer hears
            // the member's beats would write its old beat time back once per period, and a
            // sweep that looked at those moments would see that mark unchanged and take a
            // beating member for a silent one (`sweep.rs`). So no write takes the last beat
            // back from what this replica's view of the store has.
            #[cfg(feature = "test-support")]
            let merge = !crate::hub::planted::stale_beat_writes();
            #[cfg(not(feature = "test-support"))]
            let merge = true;
            let hub = if merge { self.hub(job).await.ok() } else { None };
            if let Some(hub) = hub {
                let stored = hub.read(|state| {
                    state.progress.get(worker).filter(|p| p.incarnation == incarnation).map(|p| p.last_heartbeat_ms)
                });
                if let Some(stored) = stored.filter(|&at| at > record.last_heartbeat_ms) {
                    record.last_heartbeat_ms = stored;
                    let mut cache = self.progress.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(entry) = cache.get_mut(&(job.to_string(), worker.to_string())) {
                        if entry.record.incarnation == incarnation {
                            entry.record.last_heartbeat_ms = entry.record.last_heartbeat_ms.max(stored);
                        }
                    }
                }
            }
            let key = keys::worker_key(job, Kind::Progress, worker);
            self.ctx.store.put(&key, encode(&record), Some(lease)).await.map_err(|e| match e {
                StoreError::LeaseNotFound(_) => not_member(job, worker, incarnation),
                other => store_status(other),
            })?;
        }
        Ok(())
    }

    fn forget_progress(&self, job: &str, worker: &str) {
        self.progress.lock().unwrap_or_else(|e| e.into_inner()).remove(&(job.to_string(), worker.to_string()));
    }

    /// Caches `record` as the member's progress just written to the store (by Join), so that
    /// its next update within [`PROGRESS_PERIOD`] is not written again.
    fn progress_written(&self, job: &str, worker: &str, record: ProgressRecord) {
        let now = Instant::now();
        let mut cache = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        let key = (job.to_string(), worker.to_string());
        if !cache.contains_key(&key) {
            crate::bounded::make_room(&mut cache, PROGRESS_CACHE_CAP, Duration::from_secs(600), now, |c| c.touched);
        }
        cache.insert(key, CachedProgress { record, written: Some(now), touched: now });
    }

    fn shutting_down(&self) -> bool {
        *self.ctx.shutdown.borrow()
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

    async fn host_heartbeat(
        &self,
        request: Request<pb::HostHeartbeatRequest>,
    ) -> Result<Response<pb::HostHeartbeatResponse>, Status> {
        rpc!(self, "HostHeartbeat", request, do_host_heartbeat, |r: &pb::HostHeartbeatRequest| {
            tracing::debug_span!("rpc", method = "HostHeartbeat", job = %r.job, beats = r.beats.len())
        })
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

    async fn members(&self, request: Request<pb::MembersRequest>) -> Result<Response<pb::MembersResponse>, Status> {
        rpc!(self, "Members", request, do_members, |r: &pb::MembersRequest| tracing::debug_span!(
            "rpc", method = "Members", job = %r.job, worker = %r.worker_id, incarnation = r.incarnation, generation = r.generation))
    }

    async fn store_op(&self, request: Request<pb::StoreRequest>) -> Result<Response<pb::StoreResponse>, Status> {
        rpc!(self, "StoreOp", request, do_store_op, |r: &pb::StoreRequest| tracing::debug_span!(
            "rpc", method = "StoreOp", job = %r.job, scope = %r.scope))
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
