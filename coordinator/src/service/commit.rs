//! The `Commit` RPC: a member's commit point in its progress and the state-digest ledger.

use super::CoordinatorService;
use crate::records::{self, hex};
use crate::validate;
use cohort_proto::v1 as pb;
use tokio::time::Instant;
use tonic::Status;

impl CoordinatorService {
    pub(super) async fn do_commit(&self, r: pb::CommitRequest) -> Result<pb::CommitResponse, Status> {
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
        let lease = self.require_member(&hub, &r.job, &r.worker_id, r.incarnation).await?;
        let now = records::now_ms();
        let digest = hex(&r.digest);
        self.record_progress(&r.job, &r.worker_id, r.incarnation, lease, |p| {
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
}
