//! The `Status` RPC: a job's state as the store and this replica's progress cache hold it.

use super::{store_status, CoordinatorService};
use crate::digests;
use crate::keys;
use crate::records::{self, JobState, ProgressRecord};
use crate::validate;
use cohort_proto::v1 as pb;
use crate::store::{KeyValue, StoreError};
use std::collections::{BTreeMap, HashMap};
use tonic::Status;

impl CoordinatorService {
    pub(super) async fn do_status(&self, r: pb::StatusRequest) -> Result<pb::StatusResponse, Status> {
        validate::id("job", &r.job)?;
        let (kvs, revision) = self.ctx.store.get_prefix(&keys::job_prefix(&r.job)).await.map_err(store_status)?;
        let leader = self.leader_name().await.map_err(store_status)?;
        if kvs.is_empty() {
            return Err(unknown_job(&r.job, &leader));
        }
        let state = JobState::from_kvs(&r.job, &kvs, revision);
        Ok(self.status_of(&r.job, &state, leader))
    }

    /// The name of the replica that leads now (empty: none).
    ///
    /// # Cancel safety
    /// Cancel safe: one read.
    pub async fn leader_name(&self) -> Result<String, StoreError> {
        let leader = self.ctx.store.get(keys::LEADER).await?;
        Ok(leader.map(|kv| String::from_utf8_lossy(&kv.value).into_owned()).unwrap_or_default())
    }

    /// Every job with keys in the store, by id, as one read of the jobs prefix finds it
    /// (ended jobs too, until their record expires).
    ///
    /// # Cancel safety
    /// Cancel safe: one read.
    pub async fn all_jobs(&self) -> Result<Vec<(String, JobState)>, StoreError> {
        let (kvs, revision) = self.ctx.store.get_prefix(keys::JOBS).await?;
        let mut by_job: BTreeMap<String, Vec<KeyValue>> = BTreeMap::new();
        for kv in kvs {
            let Some(job) = kv.key.strip_prefix(keys::JOBS).and_then(|rest| rest.split('/').next()) else {
                continue;
            };
            if !job.is_empty() {
                by_job.entry(job.to_string()).or_default().push(kv);
            }
        }
        Ok(by_job.into_iter().map(|(job, kvs)| {
            let state = JobState::from_kvs(&job, &kvs, revision);
            (job, state)
        }).collect())
    }

    /// The status of `job`, whose keys are `state`, with this replica's newer progress;
    /// `leader` names the leading replica.
    pub fn status_of(&self, job: &str, state: &JobState, leader: String) -> pb::StatusResponse {
        let settings = self.ctx.settings.for_job(job);
        let g = state.current();
        let now = records::now_ms();
        let excluded = crate::rendezvous::excluded(state, now);
        // Progress is written to the store at most once per PROGRESS_PERIOD; this replica's
        // cache is newer for the members it serves.
        let cached: HashMap<String, ProgressRecord> = {
            let cache = self.progress.lock().unwrap_or_else(|e| e.into_inner());
            state
                .members
                .values()
                .filter_map(|m| {
                    let c = cache.get(&(job.to_string(), m.worker_id.clone()))?;
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
        let seen = self.commits.lock().unwrap_or_else(|e| e.into_inner()).mismatches(job);
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
        pb::StatusResponse {
            exclusions,
            digest_mismatches,
            job: job.to_string(),
            settings: Some(settings.to_proto()),
            current: g.map(|g| g.to_proto()),
            current_revoked: g.is_some_and(|g| g.revoked.is_some()),
            revocation_cause: g.and_then(|g| g.revoked.as_ref()).map(|c| c.to_proto()),
            members,
            ended: state.ended.as_ref().map(|e| e.to_proto()),
            leader,
        }
    }
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
