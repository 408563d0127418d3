//! The `Leave` RPC: a member's departure from the job and its generation, and the job's end
//! when every member finished.
//!
//! A departure is recorded in the generation record (its `departed` list), under a
//! compare-and-swap on that one key. When a job ends, every member finishes at about the same
//! moment: written one by one, N leaves would rewrite the record N times and contend for it
//! (each retry re-reads it), so a large job's end would take minutes and leaves would give up.
//! A replica therefore writes leaves in groups (group commit): the leaves of a job that arrive
//! while one group is being written wait, and go together in the next transaction, as many
//! as the store's limit on a transaction's operations allows ([`group_size`]). A leave that
//! finds no group in progress is written at once, alone, as before. Each leaver gets the
//! answer its own leave would have had.

use super::{store_status, CoordinatorService};
use crate::keys::{self, Kind};
use crate::ops;
use crate::records::{self, Departure, Outcome};
use crate::store::{Compare, KeyValue, Txn, TxnOp};
use crate::validate;
use cohort_proto::v1 as pb;
use std::collections::HashMap;
use std::sync::Mutex;
use tokio::sync::oneshot;
use tonic::Status;
use tracing::Instrument;

/// Most leaves written in one transaction on a store without a limit on its operations.
const MAX_GROUP: usize = 1024;

/// Leaves written in one transaction under a limit of `max_txn_ops` operations (`None`: no
/// limit): three deletions each (five on a host's shared lease, which is not revoked: the
/// control and timeout records go too) and the generation record's put, and one compare each
/// and the record's. 42 at etcd's default 128 (25 on shared leases).
fn group_size(max_txn_ops: Option<usize>, shared_leases: bool) -> usize {
    let per_leave = if shared_leases { 5 } else { 3 };
    max_txn_ops.map_or(MAX_GROUP, |ops| (ops.saturating_sub(1) / per_leave).clamp(1, MAX_GROUP))
}

/// Attempts at one group's transaction before its leavers are told to retry (another
/// replica's writes of the generation record, or a member's re-join, moved a key meanwhile).
const ATTEMPTS: usize = 16;

/// One leave waiting for its group's transaction.
struct Pending {
    worker: String,
    incarnation: u64,
    finished: bool,
    reply: oneshot::Sender<Result<(), Status>>,
}

impl Pending {
    fn answer(self, answer: Result<(), Status>) {
        // The caller may have gone (its RPC cancelled): the leave stands all the same.
        let _ = self.reply.send(answer);
    }
}

/// The leaves of each job waiting for a transaction. A job has an entry while its writer task
/// runs: a leave that finds none starts one.
#[derive(Default)]
pub(super) struct LeaveQueues {
    jobs: Mutex<HashMap<String, Vec<Pending>>>,
}

impl LeaveQueues {
    /// Queues `p`; answers whether the caller must start the job's writer.
    fn push(&self, job: &str, p: Pending) -> bool {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        match jobs.get_mut(job) {
            Some(queue) => {
                queue.push(p);
                false
            }
            None => {
                jobs.insert(job.to_string(), vec![p]);
                true
            }
        }
    }

    /// The next group of `job`'s leaves; `None` (and the job's entry removed, so that the next
    /// leave starts a writer) when none waits.
    fn next_group(&self, job: &str, size: usize) -> Option<Vec<Pending>> {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let queue = jobs.get_mut(job)?;
        if queue.is_empty() {
            jobs.remove(job);
            return None;
        }
        let take = queue.len().min(size);
        Some(queue.drain(..take).collect())
    }

    /// Drops `job`'s entry and every leave still queued in it (their callers get an error):
    /// what a writer that stops early leaves behind.
    fn abandon(&self, job: &str) {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).remove(job);
    }
}

/// Removes the job's entry if the writer task ends without emptying it (a panic), so that
/// later leaves start a writer of their own instead of waiting forever.
struct WriterGuard<'a> {
    queues: &'a LeaveQueues,
    job: &'a str,
    done: bool,
}

impl Drop for WriterGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.queues.abandon(self.job);
        }
    }
}

impl CoordinatorService {
    pub(super) async fn do_leave(&self, r: pb::LeaveRequest) -> Result<pb::LeaveResponse, Status> {
        use pb::leave_request::Mode;
        validate::id("job", &r.job)?;
        validate::id("worker_id", &r.worker_id)?;
        validate::incarnation(r.incarnation)?;
        let finished = match Mode::try_from(r.mode) {
            Ok(Mode::Graceful) => false,
            Ok(Mode::Finished) => true,
            _ => return Err(Status::invalid_argument(format!("mode {} is not GRACEFUL (1) or FINISHED (2)", r.mode))),
        };
        let (reply, answer) = oneshot::channel();
        let pending = Pending { worker: r.worker_id.clone(), incarnation: r.incarnation, finished, reply };
        if self.leaves.push(&r.job, pending) {
            // Spawned, not awaited here: the group it writes is other callers' too, and must
            // not stop when this caller's RPC is cancelled.
            let this = self.clone();
            let job = r.job.clone();
            // Its own root span: it writes every caller's leave, not only the first one's.
            let span = tracing::info_span!(parent: None, "leaves", job = %job);
            tokio::spawn(async move { this.write_leaves(&job).await }.instrument(span));
        }
        match answer.await {
            Ok(result) => result.map(|()| pb::LeaveResponse {}),
            Err(_) => Err(Status::unavailable("leave: the replica's leave writer stopped; retry")),
        }
    }

    /// The writer of `job`'s leaves: writes the queued leaves group by group until none waits.
    ///
    /// # Cancel safety
    /// Not cancel safe: run it as a task of its own. Dropped mid-way, the queued leaves'
    /// callers get UNAVAILABLE, and a group's transaction may or may not have been applied.
    async fn write_leaves(&self, job: &str) {
        let mut guard = WriterGuard { queues: &self.leaves, job, done: false };
        let shared = self.ctx.settings.for_job(job).lease_scope == crate::config::LeaseScope::Host;
        let size = group_size(self.ctx.store.max_txn_ops(), shared);
        while let Some(group) = self.leaves.next_group(job, size) {
            self.write_group(job, group).await;
        }
        guard.done = true;
    }

    /// Writes one group of leaves in one transaction (retried while another writer moved a
    /// key it compares), and answers each leaver.
    ///
    /// # Cancel safety
    /// Not cancel safe (see [`Self::write_leaves`]).
    async fn write_group(&self, job: &str, mut group: Vec<Pending>) {
        let store = self.ctx.store.as_ref();
        for _ in 0..ATTEMPTS {
            let reads = futures::future::try_join_all(group.iter().map(|p| ops::read_member(store, job, &p.worker))).await;
            let reads = match reads {
                Ok(reads) => reads,
                Err(e) => return answer_all(group, store_status(e)),
            };
            // A leaver already gone (or replaced by a newer incarnation) has nothing to write:
            // leaving twice is harmless.
            let mut leaving: Vec<(Pending, KeyValue)> = Vec::with_capacity(group.len());
            let mut own_leases = Vec::with_capacity(group.len());
            for (p, read) in group.into_iter().zip(reads) {
                match read {
                    Some((member, kv)) if member.incarnation == p.incarnation => {
                        own_leases.push(member.owns_lease());
                        leaving.push((p, kv))
                    }
                    _ => p.answer(Ok(())),
                }
            }
            if leaving.is_empty() {
                return;
            }
            let generation = match ops::read_generation_in(&self.ctx, job).await {
                Ok(g) => g,
                Err(e) => return answer_all(leaving.into_iter().map(|(p, _)| p).collect(), store_status(e)),
            };
            let gen_key = keys::generation(job);
            let mut txn = Txn { compares: Vec::new(), success: Vec::new(), failure: vec![] };
            for ((p, kv), owned) in leaving.iter().zip(&own_leases) {
                txn.compares.push(Compare::ModRevision(kv.key.clone(), kv.mod_revision));
                txn.success.push(TxnOp::Delete(kv.key.clone()));
                txn.success.push(TxnOp::Delete(keys::worker_key(job, Kind::Waiting, &p.worker)));
                txn.success.push(TxnOp::Delete(keys::worker_key(job, Kind::Progress, &p.worker)));
                if !owned {
                    // A host's lease stays for the host's other members: nothing revokes these.
                    txn.success.push(TxnOp::Delete(keys::worker_key(job, Kind::Control, &p.worker)));
                    txn.success.push(TxnOp::Delete(keys::worker_key(job, Kind::Timeout, &p.worker)));
                }
            }
            let mut updated = None;
            match generation {
                Some((mut g, gkv)) => {
                    txn.compares.push(Compare::ModRevision(gen_key.clone(), gkv.mod_revision));
                    let new: Vec<Departure> = {
                        let departures = g.departures();
                        let placed: std::collections::HashSet<(&str, u64)> =
                            g.members.iter().map(|m| (m.worker_id.as_str(), m.incarnation)).collect();
                        let mut seen = std::collections::HashSet::new();
                        leaving
                            .iter()
                            .filter(|(p, _)| {
                                placed.contains(&(p.worker.as_str(), p.incarnation))
                                    && !departures.contains(&p.worker, p.incarnation)
                                    && seen.insert((p.worker.as_str(), p.incarnation))
                            })
                            .map(|(p, _)| Departure {
                                worker_id: p.worker.clone(),
                                incarnation: p.incarnation,
                                finished: p.finished,
                            })
                            .collect()
                    };
                    if !new.is_empty() {
                        g.departed.extend(new);
                        txn.success.push(TxnOp::Put { key: gen_key.clone(), value: records::encode_generation(&g), lease: None });
                        updated = Some(g);
                    }
                }
                None => txn.compares.push(Compare::Absent(gen_key.clone())),
            }
            let result = match store.txn(txn).await {
                Ok(result) => result,
                Err(e) => return answer_all(leaving.into_iter().map(|(p, _)| p).collect(), store_status(e)),
            };
            if !result.succeeded {
                group = leaving.into_iter().map(|(p, _)| p).collect();
                continue;
            }
            let leavers: Vec<Pending> = leaving.into_iter().map(|(p, _)| p).collect();
            for p in &leavers {
                self.forget_progress(job, &p.worker);
                self.ctx.metrics.straggler_cleared(job, &p.worker);
                tracing::info!(worker = %p.worker, incarnation = p.incarnation, finished = p.finished, "member left");
            }
            // The job ends with its last member's finish (the leader would end it too, a
            // moment later, on its next look).
            let mut end = Ok(());
            if let Some(g) = updated {
                let departures = g.departures();
                let everyone_gone = g.members.iter().all(|m| departures.contains(&m.worker_id, m.incarnation));
                if everyone_gone && leavers.iter().any(|p| p.finished) {
                    let reason = format!("all {} members of generation {} finished", g.members.len(), g.number);
                    match ops::end_job(&self.ctx, job, Outcome::Finished, &reason, Some(result.revision), &[]).await {
                        Ok(true) => self.commits.lock().unwrap_or_else(|e| e.into_inner()).forget(job),
                        Ok(false) => {}
                        Err(e) => end = Err(store_status(e)),
                    }
                }
            }
            // The leases go back while the next group is written: the members' keys are gone
            // already, and a lease not revoked lapses after one TTL anyway.
            let store = self.ctx.store.clone();
            tokio::spawn(
                async move {
                    // Only leases of the leavers' own: a host's lease is its other members' too.
                    let own: Vec<&Pending> =
                        leavers.iter().zip(&own_leases).filter(|(_, owned)| **owned).map(|(p, _)| p).collect();
                    let revocations = own.iter().map(|p| store.revoke_lease(p.incarnation as i64));
                    for (p, revoked) in own.iter().zip(futures::future::join_all(revocations).await) {
                        if let Err(e) = revoked {
                            tracing::debug!(worker = %p.worker, error = %e, "could not revoke the leaver's lease");
                        }
                    }
                    for p in leavers {
                        p.answer(end.clone());
                    }
                }
                .in_current_span(),
            );
            return;
        }
        answer_all(group, Status::unavailable("leave: too much contention on the job's records; retry"))
    }
}

/// Gives every leaver of a group the same error.
fn answer_all(group: Vec<Pending>, error: Status) {
    for p in group {
        p.answer(Err(error.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_fits_the_store_limit_on_operations() {
        assert_eq!(group_size(Some(128), false), 42, "etcd's default: 127 operations, 43 compares");
        assert_eq!(group_size(Some(1024), false), 341);
        assert_eq!(group_size(Some(128), true), 25, "shared leases: five deletions per leave");
        assert_eq!(group_size(Some(3), false), 1, "a tiny limit still writes leaves one by one");
        assert_eq!(group_size(Some(0), true), 1);
        assert_eq!(group_size(None, false), MAX_GROUP);
    }

    #[test]
    fn queued_leaves_go_in_groups_and_the_last_take_frees_the_job() {
        let queues = LeaveQueues::default();
        let pending = |i: u64| {
            let (reply, _) = oneshot::channel();
            Pending { worker: format!("w{i}"), incarnation: i, finished: true, reply }
        };
        assert!(queues.push("j", pending(0)), "the first leave starts the writer");
        for i in 1..5 {
            assert!(!queues.push("j", pending(i)), "later ones join its queue");
        }
        assert!(queues.push("other", pending(9)), "each job has its own writer");
        let sizes: Vec<usize> = std::iter::from_fn(|| queues.next_group("j", 2)).map(|g| g.len()).collect();
        assert_eq!(sizes, [2, 2, 1]);
        assert!(queues.push("j", pending(5)), "an emptied queue is gone: the next leave starts a writer");
        queues.abandon("j");
        assert!(queues.next_group("j", 2).is_none());
    }
}
