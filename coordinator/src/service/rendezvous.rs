//! The `Rendezvous` RPC: the member's declared wait and the long poll on the hub's signal.

use super::{not_member, store_status, CoordinatorService, MAX_RENDEZVOUS_WAIT};
use crate::hub;
use crate::keys::{self, Kind};
use crate::records::{self, encode, WaitingRecord};
use crate::store::StoreError;
use crate::validate;
use cohort_proto::v1 as pb;
use std::time::Duration;
use tonic::Status;

impl CoordinatorService {
    pub(super) async fn do_rendezvous(&self, r: pb::RendezvousRequest) -> Result<pb::RendezvousResponse, Status> {
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
            // A compact answer copies one member (and O(log N) partners, and with `layout` its
            // host run and the host runs); the full one, all. A worker asking for the sparse
            // view of a small generation (up to `whole_answer_up_to`) gets the whole list.
            let g = signal.formed.as_ref()?;
            let rank = g.rank_of(worker, incarnation).filter(|_| g.number > r.after_generation)?;
            Some(O::Formed(if !r.compact || (r.layout && g.size() <= settings.whole_answer_up_to) {
                g.proto.clone()
            } else if r.layout && r.partners {
                g.sparse_for(rank)
            } else {
                g.compact_for(rank, r.partners)
            }))
        };
        let signal = rx.borrow_and_update().clone();
        if let Some(o) = answer(&signal) {
            return Ok(pb::RendezvousResponse { outcome: Some(o) });
        }
        let lease = self.require_member(&hub, job, worker, incarnation).await?;
        // Declare the wait (on the member's lease), keeping the first arrival time. The view
        // tells whether this wait is already declared: waiting records leave the store only
        // with their member (Leave, lease expiry), so a record in the view is in the store. A
        // record the view has not caught up with yet (the member called again within the
        // watch's delay) is written again, with a later arrival time; reading the store
        // instead would cost every member of a formation one more etcd request.
        let wkey = keys::worker_key(job, Kind::Waiting, worker);
        let existing: Option<WaitingRecord> = hub.read(|state| state.waiting.get(worker).cloned());
        let mut written_at = 0;
        let keep =
            existing.as_ref().is_some_and(|w| w.incarnation == incarnation && w.after_generation == r.after_generation);
        if !keep {
            let record =
                WaitingRecord { incarnation, after_generation: r.after_generation, since_ms: records::now_ms() };
            written_at =
                self.ctx.store.put(&wkey, encode(&record), Some(lease)).await.map_err(|e| match e {
                    StoreError::LeaseNotFound(_) => not_member(job, worker, incarnation),
                    other => store_status(other),
                })?;
            tracing::debug!(after = r.after_generation, "member waiting");
        }
        let _ = self
            .record_progress(job, worker, incarnation, lease, |p| {
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
}
