//! The failure-report path's shell: the `ReportFailure` RPC's store I/O (the generation, the
//! cascade's timeout records, heartbeat silences, failure domains) around the pure decisions
//! of [`crate::report`] and [`crate::revocation`].

use super::{store_status, CascadeScope, CoordinatorService, PROGRESS_PERIOD};
use crate::keys::{self, Kind};
use crate::ops;
use crate::records::{self, decode, encode, GenerationRecord, ProgressRecord, TimeoutRecord};
use crate::report::{self, Blame, Incoming};
use crate::revocation::{self, ReportDecision, TimeoutReport};
use crate::store::StoreError;
use crate::validate;
use cohort_proto::v1 as pb;
use std::collections::HashMap;
use std::time::Duration;
use tokio::time::Instant;
use tonic::Status;

/// How many times a failure report looks at the suspect's failure domain before judging it
/// as a member's (see `CoordinatorService::domain_loss`).
const DOMAIN_CHECKS: usize = 3;

/// Up to this many members' records are read key by key (a failure domain's, when a report
/// looks at it); more are read with one prefix read. A report at 16,384 members must not
/// decode the whole job to judge one host.
const KEY_BY_KEY: usize = 64;

impl CoordinatorService {
    /// Judges a failure report: a timeout from a member of the current generation is held as
    /// one link of a cascade first ([`report::cascade_link`]), then blamed on the cascade's
    /// root ([`report::reattribute`]); the report is decided on the generation as last read
    /// ([`revocation::decide`]), a revoking timeout arbitrated against the heartbeat
    /// silences, a whole failure domain's loss counted once, and the generation revoked with
    /// the cause.
    ///
    /// # Cancel safety
    /// Cancel safe: a report dropped mid-way wrote at most its own timeout record (on the
    /// reporter's lease); the revocation is one compare-and-swap.
    pub(super) async fn do_report(&self, r: pb::FailureReport) -> Result<pb::FailureReportResponse, Status> {
        validate::id("job", &r.job)?;
        validate::id("worker_id", &r.worker_id)?;
        validate::incarnation(r.incarnation)?;
        validate::text("reason", &r.reason, validate::MAX_REASON_LEN)?;
        let job = r.job.as_str();
        let incoming = Incoming {
            worker_id: &r.worker_id,
            incarnation: r.incarnation,
            generation: r.generation,
            failed_rank: r.failed_rank,
            reason: &r.reason,
            kind: revocation::FailureKind::from_proto(r.kind),
            progress: r.progress.map(|p| (p.seq, p.received)),
        };
        let mut current = self.read_generation(job).await?;
        let mut blame = Blame::as_reported(&incoming);
        // A timeout may be one link of a cascade: hold it briefly, then blame the chain's end.
        if let Some(own) = report::cascade_link(current.as_ref(), &incoming) {
            self.record_timeout(job, &r.worker_id, r.incarnation, r.generation, own).await;
            let (chain, after, silences) = self.hold_cascade(job, r.generation, own).await?;
            current = after;
            let root = report::cascade_root(&chain, current.as_ref(), &silences);
            if let Some(root) = report::reattribute(&incoming, &chain, root) {
                tracing::info!(named = ?r.failed_rank, blamed = ?root.failed_rank, ?chain,
                               "timeout report re-attributed within a cascade");
                blame = root;
            }
        }
        let report = blame.report(&incoming);
        let g = current.as_ref();
        match revocation::decide(g, &report)? {
            ReportDecision::Ignore(cause) => {
                tracing::debug!(generation = r.generation, "failure report ignored (older or already revoked)");
                Ok(pb::FailureReportResponse { accepted: false, cause: cause.map(|c| c.to_proto()) })
            }
            ReportDecision::Revoke(mut cause) => {
                if let Some(g) = g.filter(|_| report::arbitrated(&report)) {
                    let settings = self.ctx.settings.for_job(job);
                    match self.silences(job, g, |_| true).await {
                        Ok(silences) => {
                            if let Some(blamed) =
                                revocation::arbitrate(g, &report, &silences, settings.heartbeat_interval)
                            {
                                tracing::info!(named = ?r.failed_rank, blamed = ?blamed.rank, worker = %blamed.worker_id,
                                               "timeout report re-attributed to a silent member");
                                cause = blamed;
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "could not read heartbeat observations; taking the timeout report as is")
                        }
                    }
                }
                if let (Some(g), Some(rank)) = (g, cause.rank) {
                    if let Some(loss) = self.domain_loss(job, g, rank).await {
                        tracing::info!(domain = %loss.domain, ranks = ?loss.ranks, "the suspect's whole failure domain is lost");
                        cause = crate::domains::domain_cause(cause, &loss);
                    }
                }
                let suspect = report::suspect(g, &cause);
                let outcome = ops::revoke_generation(&self.ctx, job, r.generation, cause, suspect, false)
                    .await
                    .map_err(store_status)?;
                Ok(pb::FailureReportResponse { accepted: outcome.accepted, cause: outcome.cause.map(|c| c.to_proto()) })
            }
        }
    }

    /// The job's newest generation record: the one read of it per look (before a report is
    /// judged, and after each hold of a cascade), its members from this replica's view
    /// where that holds them ([`ops::read_generation_in`]).
    ///
    /// # Cancel safety
    /// Cancel safe: reads only.
    async fn read_generation(&self, job: &str) -> Result<Option<GenerationRecord>, Status> {
        Ok(ops::read_generation_in(&self.ctx, job).await.map_err(store_status)?.map(|(g, _)| g))
    }

    /// Holds a cascade: [`revocation::TIMEOUT_HOLD`], then reads its chain and the generation;
    /// again while [`report::unreported_chain_ends`] names chain ends that are all fresh by their
    /// heartbeat silences ([`report::is_fresh`], twice `heartbeat_interval`). Returns the chain,
    /// the generation as last read, and the silences of the chain's ends as last read (empty
    /// when none was read), by which [`report::cascade_root`] picks among several ends.
    ///
    /// # Cancel safety
    /// Cancel safe: reads only.
    async fn hold_cascade(
        &self,
        job: &str,
        generation: u64,
        own: TimeoutReport,
    ) -> Result<(Vec<TimeoutReport>, Option<GenerationRecord>, revocation::Silences), Status> {
        let limit = self.ctx.settings.for_job(job).heartbeat_interval * 2;
        let mut holds = 0;
        loop {
            // The hold: the cascade's other reports arrive meanwhile, at any replica.
            tokio::time::sleep(revocation::TIMEOUT_HOLD).await;
            let chain = self.timeouts_of(job, generation, own).await;
            let current = self.read_generation(job).await?;
            // The chain's ends as members of the current generation, even past the last hold:
            // their silences choose among several ends.
            let ends = report::unreported_chain_ends(&chain, current.as_ref(), generation);
            let Some((g, ends)) = ends else {
                return Ok((chain, current, revocation::Silences::new()));
            };
            let ids: Vec<&str> = ends.iter().map(|m| m.worker_id.as_str()).collect();
            let silences = self.silences(job, g, |m| ids.contains(&m.worker_id.as_str())).await.unwrap_or_default();
            let all_fresh = ends.iter().all(|m| report::is_fresh(&silences, m, limit));
            if !report::hold_again(all_fresh, holds) {
                return Ok((chain, current, silences));
            }
            tracing::debug!(ends = ?ids, "the cascade's ends are alive and have not reported yet: holding longer");
            holds += 1;
        }
    }

    /// Whether rank `suspect`'s whole failure domain is lost in `g` (see [`crate::domains`]),
    /// by what this replica can learn: the job's records (process gone: control stream
    /// closed or lease gone), heartbeat silences ([`Self::silences`]; longer than twice the
    /// heartbeat interval for certain: lost; heard within it: alive) and the generation's
    /// timeout reports (a member that reported a timeout itself: alive; one another timed out
    /// on: lost). While no other member of the domain is known alive but some are not yet
    /// known lost, it looks again, up to [`DOMAIN_CHECKS`] times [`revocation::TIMEOUT_HOLD`]
    /// apart (the closes of a node's processes reach the coordinator a moment apart); a domain
    /// with a live member costs no wait. Store errors make it `None` (the report is judged as
    /// a member's).
    ///
    /// # Cancel safety
    /// Cancel safe: reads only.
    async fn domain_loss(
        &self,
        job: &str,
        g: &records::GenerationRecord,
        suspect: u32,
    ) -> Option<crate::domains::DomainLoss> {
        use crate::domains::{whole_domain_lost, Evidence};
        let domain = g.members.get(suspect as usize)?.domain();
        if g.members.iter().filter(|m| m.domain() == domain).count() < 2 {
            return None;
        }
        let limit = self.ctx.settings.for_job(job).heartbeat_interval * 2;
        let mates: Vec<&str> =
            g.members.iter().filter(|m| m.domain() == domain).map(|m| m.worker_id.as_str()).collect();
        for check in 0..DOMAIN_CHECKS {
            if check > 0 {
                tokio::time::sleep(revocation::TIMEOUT_HOLD).await;
            }
            let state = self.read_workers(job, &mates).await.ok()?;
            let silences = self.silences(job, g, |m| m.domain() == domain).await.ok()?;
            // `timeouts_of` always includes the caller's own report; this placeholder names
            // only the suspect itself, which the evidence below never asks about.
            let chain = self
                .timeouts_of(job, g.number, revocation::TimeoutReport { reporter: suspect, suspect, progress: None })
                .await;
            let mut any_alive = false;
            let evidence = |rank: u32| {
                let m = &g.members[rank as usize];
                let silence = silences.get(&(m.worker_id.clone(), m.incarnation));
                // A gone process first; then a recent heartbeat or a timeout report of its
                // own in this generation (a live member named in a cascade of timeouts is not
                // lost: it spoke to the coordinator); then certain silence or a peer's timeout.
                // The report matters behind several replicas: another replica's heartbeats
                // reach this one only through the progress record, written once a period,
                // so a member that heartbeats elsewhere can look silent here. In a cycle of
                // timeouts every rank is some peer's suspect; without its own report as
                // evidence, a host whose ranks all starve on one silent link would read as
                // lost whole, and all its ranks be evicted.
                if !state.is_live(&m.worker_id, m.incarnation) || state.is_disconnected(&m.worker_id, m.incarnation) {
                    Evidence::Lost
                } else if silence.is_some_and(|s| s.at_most < limit) || chain.iter().any(|t| t.reporter == rank) {
                    any_alive = true;
                    Evidence::Alive
                } else if silence.is_some_and(|s| s.at_least > limit)
                    || chain.iter().any(|t| t.suspect == rank && t.reporter != rank)
                {
                    Evidence::Lost
                } else {
                    Evidence::Unknown
                }
            };
            if let Some(loss) = whole_domain_lost(g, suspect, evidence) {
                return Some(loss);
            }
            if any_alive {
                return None;
            }
        }
        None
    }

    /// The member and control-stream records of `workers` (a failure domain's members), read
    /// key by key: what [`JobState::is_live`](records::JobState::is_live) and
    /// [`JobState::is_disconnected`](records::JobState::is_disconnected) need for them,
    /// without reading the rest of the job.
    ///
    /// # Cancel safety
    /// Cancel safe: reads only.
    async fn read_workers(&self, job: &str, workers: &[&str]) -> Result<records::JobState, StoreError> {
        let store = self.ctx.store.as_ref();
        let read = |kind: Kind, worker: &str| {
            let key = keys::worker_key(job, kind, worker);
            async move { store.get(&key).await.map(|kv| kv.map(|kv| (key, kv))) }
        };
        let (members, controls) = tokio::try_join!(
            futures::future::try_join_all(workers.iter().map(|w| read(Kind::Member, w))),
            futures::future::try_join_all(workers.iter().map(|w| read(Kind::Control, w)))
        )?;
        let mut state = records::JobState { job: job.to_string(), ..Default::default() };
        for (worker, (member, control)) in workers.iter().zip(members.into_iter().zip(controls)) {
            if let Some(m) = member.and_then(|(key, kv)| decode::<records::MemberRecord>(&key, &kv.value)) {
                state.members.insert(worker.to_string(), m);
            }
            if let Some(c) = control.and_then(|(key, kv)| decode::<records::ControlRecord>(&key, &kv.value)) {
                state.control.insert(worker.to_string(), c);
            }
        }
        Ok(state)
    }

    /// Records a timeout report of `generation` in the store (`timeouts/<worker>`, on the
    /// reporter's lease), where every replica's [`Self::timeouts_of`] finds it. A repeated
    /// report of the same generation (a retry after a failover) keeps the first one's place
    /// in the arrival order. A store error is logged: the report is then judged on what the
    /// store does hold.
    ///
    /// # Cancel safety
    /// Cancel safe: one read and at most one write of the reporter's own key.
    async fn record_timeout(
        &self,
        job: &str,
        worker: &str,
        incarnation: u64,
        generation: u64,
        report: revocation::TimeoutReport,
    ) {
        if self.cascade_scope == CascadeScope::Replica {
            let mut own = self.own_timeouts.lock().unwrap_or_else(|e| e.into_inner());
            own.retain(|(_, g, _)| *g + 16 > generation);
            own.push((job.to_string(), generation, report));
            return;
        }
        let key = keys::worker_key(job, Kind::Timeout, worker);
        let record = TimeoutRecord {
            incarnation,
            generation,
            reporter: report.reporter,
            suspect: report.suspect,
            progress: report.progress,
        };
        let store = self.ctx.store.as_ref();
        // A reporter that is no member any more writes on the lease of its own it would have
        // had, which is gone: the store refuses, as it should.
        let lease = self.lease_of(job, worker, incarnation).await.ok().flatten().unwrap_or(incarnation as i64);
        let result = async {
            let existing = store.get(&key).await?.and_then(|kv| decode::<TimeoutRecord>(&key, &kv.value));
            if existing.is_some_and(|e| e.incarnation == incarnation && e.generation == generation) {
                return Ok(());
            }
            store.put(&key, encode(&record), Some(lease)).await.map(|_| ())
        }
        .await;
        if let Err(e) = result {
            tracing::warn!(error = %e, "could not record a timeout report for the cascade; judging it without");
        }
    }

    /// The timeout reports of `generation` every replica has recorded, in arrival order
    /// (store revision), from members of that generation. `own` (this call's report) is
    /// always among them, also when the store could not be read.
    ///
    /// # Cancel safety
    /// Cancel safe: reads only.
    async fn timeouts_of(
        &self,
        job: &str,
        generation: u64,
        own: revocation::TimeoutReport,
    ) -> Vec<revocation::TimeoutReport> {
        if self.cascade_scope == CascadeScope::Replica {
            let own_reports = self.own_timeouts.lock().unwrap_or_else(|e| e.into_inner());
            let mut chain: Vec<revocation::TimeoutReport> = Vec::new();
            for (_, _, t) in own_reports.iter().filter(|(j, g, _)| j == job && *g == generation) {
                if !chain.iter().any(|c| c.reporter == t.reporter) {
                    chain.push(*t);
                }
            }
            if !chain.iter().any(|c| c.reporter == own.reporter) {
                chain.push(own);
            }
            return chain;
        }
        let prefix = keys::kind_prefix(job, Kind::Timeout);
        let mut records: Vec<(i64, TimeoutRecord)> = match self.ctx.store.get_prefix(&prefix).await {
            Ok((kvs, _)) => kvs
                .iter()
                .filter_map(|kv| decode::<TimeoutRecord>(&kv.key, &kv.value).map(|t| (kv.mod_revision, t)))
                .filter(|(_, t)| t.generation == generation)
                .collect(),
            Err(e) => {
                tracing::warn!(error = %e, "could not read the cascade's timeout reports; judging this one alone");
                Vec::new()
            }
        };
        records.sort_by_key(|(revision, _)| *revision);
        let mut chain: Vec<revocation::TimeoutReport> = Vec::with_capacity(records.len() + 1);
        for (_, t) in records {
            let report = revocation::TimeoutReport { reporter: t.reporter, suspect: t.suspect, progress: t.progress };
            if !chain.iter().any(|c| c.reporter == report.reporter) {
                chain.push(report);
            }
        }
        if !chain.iter().any(|c| c.reporter == own.reporter) {
            chain.push(own);
        }
        chain
    }

    /// How long each member of `g` has gone without a heartbeat, as bounds, for
    /// [`revocation::arbitrate`]. Three observations, combined (the tightest bounds win):
    ///
    /// - the member's store lease (what every replica sees, measured on the store's clock;
    ///   keep-alives are not throttled): its time to live says when the last keep-alive
    ///   was, to within [`crate::store::Store::lease_ttl_resolution`] (1 s on etcd, exact in
    ///   memory); a lease that is gone means the member is dead (silent a whole TTL). A
    ///   host's shared lease (`lease_scope = "host"`) tells only that: alive, it says nothing
    ///   of one member;
    /// - its `progress` record in the store (what every replica sees): `last_heartbeat_ms`
    ///   is a heartbeat some replica served, stamped with that replica's clock; records are
    ///   written at most once per [`PROGRESS_PERIOD`] per replica, so the last heartbeat is
    ///   no older than the record and no more than a period newer. The approximation:
    ///   coordinator replicas' wall clocks are assumed to agree to well under that period
    ///   (NTP); workers' clocks are never used;
    /// - this replica's own cache of the member's last heartbeat, commit or rendezvous
    ///   (monotonic clock; only an upper bound, since the member may talk to another replica).
    ///
    /// Only the members `wanted` selects are looked up (one lease lookup each): a check of
    /// one member or one failure domain costs that many, not one per member of the job.
    async fn silences(
        &self,
        job: &str,
        g: &records::GenerationRecord,
        wanted: impl Fn(&records::Placed) -> bool,
    ) -> Result<revocation::Silences, StoreError> {
        use revocation::Silence;
        let store = self.ctx.store.as_ref();
        let granted = self.ctx.settings.for_job(job).lease_ttl_for_store();
        let resolution = store.lease_ttl_resolution();
        let members: Vec<&records::Placed> = g.members.iter().filter(|m| wanted(m)).collect();
        // A few members (one failure domain) are read key by key; many, in one prefix read.
        let progress: HashMap<String, ProgressRecord> = if members.len() <= KEY_BY_KEY {
            let keys: Vec<String> =
                members.iter().map(|m| keys::worker_key(job, Kind::Progress, &m.worker_id)).collect();
            let kvs = futures::future::try_join_all(keys.iter().map(|k| store.get(k))).await?;
            members
                .iter()
                .zip(keys.iter().zip(kvs))
                .filter_map(|(m, (key, kv))| Some((m.worker_id.clone(), decode(key, &kv?.value)?)))
                .collect()
        } else {
            let (kvs, _) = store.get_prefix(&keys::kind_prefix(job, Kind::Progress)).await?;
            kvs.iter()
                .filter_map(|kv| match keys::parse(&kv.key) {
                    Some(keys::Parsed::Worker { worker, .. }) => {
                        decode(&kv.key, &kv.value).map(|p| (worker.to_string(), p))
                    }
                    _ => None,
                })
                .collect()
        };
        // Each member's lease as its record names it (a member no longer in the view is looked
        // up by its incarnation, the lease of its own it would have had: gone either way).
        let hub = self.ctx.hubs.get(job, &self.ctx.settings.for_job(job)).await?;
        let leases: Vec<(crate::store::LeaseId, bool)> = hub.read(|state| {
            members
                .iter()
                .map(|m| {
                    state
                        .members
                        .get(&m.worker_id)
                        .filter(|r| r.incarnation == m.incarnation)
                        .map_or((m.incarnation as i64, true), |r| (r.lease(), r.owns_lease()))
                })
                .collect()
        });
        // One round trip per lease, all at once (only timeout reports that find the
        // generation not yet revoked get here: normally the first one or few).
        let mut distinct: Vec<crate::store::LeaseId> = leases.iter().map(|(l, _)| *l).collect();
        distinct.sort_unstable();
        distinct.dedup();
        let looked_up = futures::future::join_all(distinct.iter().map(|l| store.lease_time_to_live(*l))).await;
        let mut left: HashMap<crate::store::LeaseId, Option<Duration>> = HashMap::with_capacity(distinct.len());
        for (lease, found) in distinct.into_iter().zip(looked_up) {
            left.insert(lease, found?);
        }
        let now_ms = records::now_ms();
        let now = Instant::now();
        let cache = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = revocation::Silences::new();
        for (m, (lease, owned)) in members.into_iter().zip(leases) {
            let mut seen: Option<Silence> = match left.get(&lease).copied().flatten() {
                None => Some(Silence::exactly(granted)),
                Some(_) if !owned => None,
                Some(left) => {
                    let since = granted.saturating_sub(left);
                    Some(Silence { at_least: since.saturating_sub(resolution), at_most: since })
                }
            };
            let mut add = |s: Silence| seen = Some(seen.map_or(s, |o| o.and(s)));
            if let Some(p) = progress.get(&m.worker_id).filter(|p| p.incarnation == m.incarnation) {
                let age = Duration::from_millis(now_ms.saturating_sub(p.last_heartbeat_ms));
                add(Silence { at_least: age.saturating_sub(PROGRESS_PERIOD), at_most: age });
            }
            if let Some(c) =
                cache.get(&(job.to_string(), m.worker_id.clone())).filter(|c| c.record.incarnation == m.incarnation)
            {
                add(Silence { at_least: Duration::ZERO, at_most: now.duration_since(c.touched) });
            }
            if let Some(s) = seen {
                out.insert((m.worker_id.clone(), m.incarnation), s);
            }
        }
        Ok(out)
    }
}
