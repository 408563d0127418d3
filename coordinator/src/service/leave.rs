//! The `Leave` RPC: a member's departure from the job and its generation, and the job's end
//! when every member finished.

use super::{store_status, CoordinatorService};
use crate::keys::{self, Kind};
use crate::ops;
use crate::records::{self, Departure, Outcome};
use crate::store::{Compare, Txn, TxnOp};
use crate::validate;
use cohort_proto::v1 as pb;
use tonic::Status;

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
        let (job, worker, incarnation) = (r.job.as_str(), r.worker_id.as_str(), r.incarnation);
        let store = self.ctx.store.as_ref();
        for _ in 0..16 {
            let Some((member, mkv)) = ops::read_member(store, job, worker).await.map_err(store_status)? else {
                return Ok(pb::LeaveResponse {}); // already gone: leaving twice is harmless
            };
            if member.incarnation != incarnation {
                return Ok(pb::LeaveResponse {});
            }
            let generation = ops::read_generation_in(&self.ctx, job).await.map_err(store_status)?;
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
}
