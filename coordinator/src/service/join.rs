//! The `Join` RPC: the exclusion and worker-id checks, the replaced incarnation's revocation,
//! and the member's records on a new lease.

use super::{host_lease, store_status, CoordinatorService, PROGRESS_PERIOD};
use crate::config::LeaseScope;
use crate::keys::{self, Kind};
use crate::ops;
use crate::records::{self, decode, encode, JobState, MemberRecord, ProgressRecord};
use crate::store::{Compare, LeaseId, StoreError, Txn, TxnOp};
use crate::validate;
use cohort_proto::v1 as pb;
use std::time::Duration;
use tokio::time::Instant;
use tonic::Status;

/// How many times a Join is decided before it gives up: a decision is made again when the
/// worker id's member record changed between the decision and the write (another process
/// joined with the id, or its silent holder's records went), or the job ended meanwhile.
const JOIN_ATTEMPTS: usize = 3;

/// What [`CoordinatorService::read_join_view`] read.
struct JoinView {
    /// The part of the job's state the decision goes on.
    state: JobState,
    /// The newest generation number.
    current_generation: u64,
    /// The `mod_revision` of the worker id's member record as read (`None`: absent). The
    /// join's write compares it, so that two joins decided on one reading cannot both land.
    member_revision: Option<i64>,
}

impl CoordinatorService {
    pub(super) async fn do_join(&self, r: pb::JoinRequest) -> Result<pb::JoinResponse, Status> {
        validate::protocol_version(r.protocol_version)?;
        validate::id("job", &r.job)?;
        validate::id("worker_id", &r.worker_id)?;
        validate::text("host", &r.host, validate::MAX_HOST_LEN)?;
        validate::text("domain", &r.domain, validate::MAX_HOST_LEN)?;
        validate::addresses(&r.addresses)?;
        validate::capabilities(&r.capabilities)?;
        for _ in 0..JOIN_ATTEMPTS {
            if let Some(joined) = self.join_once(&r).await? {
                return Ok(joined);
            }
        }
        Err(Status::aborted(format!(
            "worker id {} of job {} changed while its join was decided, {JOIN_ATTEMPTS} times; join again",
            r.worker_id, r.job
        )))
    }

    /// One decision and write of a Join: the response, a refusal, or `None` when the worker
    /// id's member record changed (or the job ended) between the decision and the write, so
    /// that nothing was written and the join is decided again.
    ///
    /// # Cancel safety
    /// Cancel safe as far as the store goes: the member's records are one transaction; a lease
    /// granted for a join that never landed expires by itself.
    async fn join_once(&self, r: &pb::JoinRequest) -> Result<Option<pb::JoinResponse>, Status> {
        let settings = self.ctx.settings.for_job(&r.job);
        let ttl = settings.lease_ttl_for_store();
        // Under `lease_scope = "host"` the member's records go on the lease of its host, or of
        // the failure domain it names (on Kubernetes, its node: the unit that fails together);
        // a member that names neither gets a lease of its own all the same.
        let host = records::effective_domain(&r.domain, &r.host);
        let shared = settings.lease_scope == LeaseScope::Host && !host.is_empty();
        // The member's lease is found or granted while the join is decided (the decision reads
        // the store, the grant writes it: two round trips in parallel instead of in a row). A
        // refused join gives a lease of its own back at once (it would lapse after one TTL).
        let job_id = r.job.as_str();
        let lease_for = move |stale: Option<LeaseId>| async move {
            if shared {
                self.host_lease(job_id, host, ttl, stale).await
            } else {
                self.ctx.store.grant_lease(ttl).await.map_err(store_status)
            }
        };
        let give_back = |lease: LeaseId| async move {
            if !shared {
                if let Err(e) = self.ctx.store.revoke_lease(lease).await {
                    tracing::debug!(error = %e, "could not give back a refused join's lease");
                }
            }
        };
        let (decided, granted) = tokio::join!(self.admit(r), lease_for(None));
        let JoinView { state, current_generation, mut member_revision } = match decided {
            Ok(admitted) => admitted,
            Err(refusal) => {
                if let Ok(lease) = granted {
                    give_back(lease).await;
                }
                return Err(refusal);
            }
        };
        let mut lease = granted?;
        let (job, worker) = (r.job.as_str(), r.worker_id.as_str());
        let now = records::now_ms();
        let incarnation = if shared { host_lease::fresh_incarnation(&self.ctx.replica, worker) } else { lease as u64 };
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
                        give_back(lease).await;
                        return Err(store_status(e));
                    }
                }
            }
        }
        if old.is_some() {
            // The replaced incarnation's records may have gone since the decision (evicted by
            // the revocation above or another one, or its lease lapsed): the write then
            // expects them gone. Any other change (another process joined with the id) means
            // deciding again.
            let member_key = keys::worker_key(job, Kind::Member, worker);
            let now_read = self.ctx.store.get(&member_key).await.map_err(store_status)?;
            match now_read {
                Some(kv) if Some(kv.mod_revision) != member_revision => {
                    give_back(lease).await;
                    return Ok(None);
                }
                Some(_) => {}
                None => member_revision = None,
            }
        }
        let mut member = MemberRecord {
            worker_id: worker.to_string(),
            incarnation,
            host: r.host.clone(),
            addresses: r.addresses.iter().map(Into::into).collect(),
            capabilities: r.capabilities.clone(),
            joined_at_ms: now,
            domain: r.domain.clone(),
            host_lease: 0,
        };
        let progress =
            ProgressRecord { incarnation, last_heartbeat_ms: now, activity: "joined".into(), ..Default::default() };
        // On a shared lease, revoking the replaced incarnation's lease is not an option: its
        // other records go with this transaction instead.
        let replaced: Vec<TxnOp> = match &old {
            Some(_) if shared => [Kind::Waiting, Kind::Control, Kind::Timeout]
                .into_iter()
                .map(|kind| TxnOp::Delete(keys::worker_key(job, kind, worker)))
                .collect(),
            _ => Vec::new(),
        };
        // A host's lease this replica knew may have lapsed since (the whole host fell silent):
        // the write then fails with the lease not found, and goes again on a fresh one.
        let mut attempts = if shared { 2 } else { 1 };
        loop {
            attempts -= 1;
            member.host_lease = if shared { lease } else { 0 };
            let mut success = vec![
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
            ];
            success.extend(replaced.iter().cloned());
            let member_key = keys::worker_key(job, Kind::Member, worker);
            let member_compare = match member_revision {
                Some(revision) => Compare::ModRevision(member_key, revision),
                None => Compare::Absent(member_key),
            };
            let txn =
                Txn { compares: vec![Compare::Absent(keys::ended(job)), member_compare], success, failure: vec![] };
            match self.ctx.store.txn(txn).await {
                Ok(r) if r.succeeded => break,
                Err(StoreError::LeaseNotFound(_)) if attempts > 0 => {
                    lease = lease_for(Some(lease)).await?;
                }
                other => {
                    give_back(lease).await;
                    // A failed compare: the job ended, or the id's member record changed
                    // since the decision. Deciding again tells which (and refuses a second
                    // process while the first one holds the id).
                    return match other {
                        Ok(_) => Ok(None),
                        Err(e) => Err(store_status(e)),
                    };
                }
            }
        }
        if !shared {
            // Just granted: the member's first beat need not renew it (a shared lease is
            // marked where it is granted).
            self.host_leases.granted(lease);
        }
        if let Some(old) = old.filter(|o| o.owns_lease()) {
            if let Err(e) = self.ctx.store.revoke_lease(old.incarnation as i64).await {
                tracing::debug!(error = %e, "could not revoke the replaced incarnation's lease");
            }
        }
        // The progress record just written is the cache's, so that the Rendezvous that follows
        // at once does not write it again.
        self.progress_written(job, worker, progress);
        tracing::info!(incarnation, host = %r.host, shared_lease = shared, "member joined");
        Ok(Some(pb::JoinResponse {
            incarnation,
            heartbeat_interval_ms: settings.heartbeat_interval.as_millis() as u64,
            lease_ttl_ms: settings.lease_ttl.as_millis() as u64,
            current_generation,
            settings: Some(settings.to_proto()),
        }))
    }

    /// Decides whether `r` may join: the job has not ended, neither the worker nor its failure
    /// domain is excluded, and no live process holds the worker id. Answers what the decision
    /// read ([`Self::read_join_view`]).
    ///
    /// # Cancel safety
    /// Cancel safe: reads only.
    async fn admit(&self, r: &pb::JoinRequest) -> Result<JoinView, Status> {
        let settings = self.ctx.settings.for_job(&r.job);
        let (job, worker) = (r.job.as_str(), r.worker_id.as_str());
        let view = self.read_join_view(job, worker, records::effective_domain(&r.domain, &r.host)).await?;
        let state = &view.state;
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
            let silent_for = self.silent_for(job, holder, state).await.map_err(store_status)?;
            let live_window = PROGRESS_PERIOD + 2 * settings.heartbeat_interval;
            if silent_for < live_window {
                return Err(id_in_use(job, holder, silent_for, live_window - silent_for));
            }
        }
        Ok(view)
    }

    /// The part of a job's state a Join decides on, read key by key: the end record, the
    /// worker's member record, its own and its failure domain's failure records, and the
    /// generation record, with the newest generation number and the member record's revision.
    /// A join must not read the whole
    /// job (N joins would read it N times, O(N²) in all). The generation record, O(members)
    /// itself, is read from the store only when an older incarnation of the worker may be in
    /// it; otherwise the state has none and the number comes from this replica's view.
    ///
    /// # Cancel safety
    /// Cancel safe: reads only.
    async fn read_join_view(&self, job: &str, worker: &str, domain: &str) -> Result<JoinView, Status> {
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
        let member_revision = member.as_ref().map(|kv| kv.mod_revision);
        if let Some(m) = member.and_then(|kv| decode::<MemberRecord>(&member_key, &kv.value)) {
            state.members.insert(worker.to_string(), m);
            state.generation =
                ops::read_generation_in(&self.ctx, job).await.map_err(store_status)?.map(|(g, kv)| (g, kv.mod_revision));
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
        Ok(JoinView { state, current_generation: current, member_revision })
    }

    /// At most how long `holder` (a member record of `job`) has gone without a heartbeat: the
    /// tightest of its progress record in the store, this replica's cache of it, and its
    /// store lease's time to live (a lease that is gone: a whole TTL). A host's shared lease
    /// tells only of the host; the member's own progress record is read then.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    async fn silent_for(&self, job: &str, holder: &MemberRecord, state: &JobState) -> Result<Duration, StoreError> {
        let granted = self.ctx.settings.for_job(job).lease_ttl_for_store();
        let mut silent = match self.ctx.store.lease_time_to_live(holder.lease()).await? {
            None => return Ok(granted),
            Some(_) if !holder.owns_lease() => granted,
            Some(left) => granted.saturating_sub(left),
        };
        let stored = if holder.owns_lease() {
            state.progress.get(&holder.worker_id).cloned()
        } else {
            let key = keys::worker_key(job, Kind::Progress, &holder.worker_id);
            self.ctx.store.get(&key).await?.and_then(|kv| decode::<ProgressRecord>(&key, &kv.value))
        };
        if let Some(p) = stored.filter(|p| p.incarnation == holder.incarnation) {
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
