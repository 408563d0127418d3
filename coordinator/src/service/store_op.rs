//! The `StoreOp` RPC: one operation on the job's key-value store ([`crate::kv`]), the store
//! behind a torch c10d `Store`. It needs no membership: the job's credential (checked by the
//! dispatch, as for every RPC) is what admits the caller.

use super::{store_status, CoordinatorService};
use crate::kv::{Kv, KvError, MAX_WAIT, MAX_WAIT_KEYS};
use crate::validate;
use cohort_proto::v1 as pb;
use std::time::Duration;
use tonic::Status;

impl From<KvError> for Status {
    fn from(e: KvError) -> Self {
        match e {
            KvError::Store(e) => store_status(e),
            KvError::NotAnInteger { .. } | KvError::Overflow { .. } | KvError::Ended { .. } => {
                Status::failed_precondition(e.to_string())
            }
            KvError::TooManyKeys { .. } | KvError::TooLong { .. } => Status::invalid_argument(e.to_string()),
            KvError::Contended { .. } => Status::aborted(e.to_string()),
        }
    }
}

fn keys_field(keys: &[String]) -> Result<(), Status> {
    if keys.is_empty() {
        return Err(Status::invalid_argument("keys is empty (name at least one key)"));
    }
    if keys.len() > MAX_WAIT_KEYS {
        return Err(Status::invalid_argument(format!("{} keys named (at most {MAX_WAIT_KEYS} per call)", keys.len())));
    }
    keys.iter().try_for_each(|k| validate::store_key("keys", k))
}

impl CoordinatorService {
    /// Validates every field first, then runs the operation. A long poll (`get`, `wait`) is
    /// bounded by its `wait_ms` (at most [`MAX_WAIT`]) and ends early when the replica shuts
    /// down.
    pub(super) async fn do_store_op(&self, r: pb::StoreRequest) -> Result<pb::StoreResponse, Status> {
        use pb::store_request::Op;
        validate::id("job", &r.job)?;
        validate::store_scope(&r.scope)?;
        let op = r.op.ok_or_else(|| Status::invalid_argument("op is missing (set, get, add, ...)"))?;
        match &op {
            Op::Set(s) => {
                validate::store_key("key", &s.key)?;
                validate::store_value("value", &s.value)?;
            }
            Op::Get(g) => validate::store_key("key", &g.key)?,
            Op::Add(a) => validate::store_key("key", &a.key)?,
            Op::Append(a) => {
                validate::store_key("key", &a.key)?;
                validate::store_value("value", &a.value)?;
            }
            Op::CompareSet(c) => {
                validate::store_key("key", &c.key)?;
                validate::store_value("expected", &c.expected)?;
                validate::store_value("desired", &c.desired)?;
            }
            Op::Check(c) => keys_field(&c.keys)?,
            Op::Delete(d) => validate::store_key("key", &d.key)?,
            Op::NumKeys(_) => {}
            Op::Wait(w) => keys_field(&w.keys)?,
        }
        let kv = Kv::new(self.ctx.store.as_ref(), &r.job, &r.scope);
        let wait = |ms: u64| Duration::from_millis(ms).min(MAX_WAIT);
        let answer = match op {
            Op::Set(s) => {
                kv.set(&s.key, s.value).await?;
                pb::StoreResponse::default()
            }
            Op::Get(g) => {
                let mut value = kv.get(&g.key).await?;
                if value.is_none() && g.wait_ms > 0 && self.wait(&kv, std::slice::from_ref(&g.key), wait(g.wait_ms)).await? {
                    value = kv.get(&g.key).await?;
                }
                pb::StoreResponse { found: value.is_some(), value: value.unwrap_or_default(), number: 0 }
            }
            Op::Add(a) => pb::StoreResponse { number: kv.add(&a.key, a.delta).await?, ..Default::default() },
            Op::Append(a) => {
                kv.append(&a.key, &a.value).await?;
                pb::StoreResponse::default()
            }
            Op::CompareSet(c) => pb::StoreResponse {
                value: kv.compare_set(&c.key, &c.expected, &c.desired).await?,
                ..Default::default()
            },
            Op::Check(c) => pb::StoreResponse { found: kv.check(&c.keys).await?, ..Default::default() },
            Op::Delete(d) => pb::StoreResponse { found: kv.delete(&d.key).await?, ..Default::default() },
            Op::NumKeys(_) => pb::StoreResponse {
                number: i64::try_from(kv.num_keys().await?).unwrap_or(i64::MAX),
                ..Default::default()
            },
            Op::Wait(w) => pb::StoreResponse { found: self.wait(&kv, &w.keys, wait(w.wait_ms)).await?, ..Default::default() },
        };
        Ok(answer)
    }

    /// [`Kv::wait`], cut short (UNAVAILABLE) when the replica shuts down.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    async fn wait(&self, kv: &Kv<'_>, keys: &[String], wait: Duration) -> Result<bool, Status> {
        let mut shutdown = self.ctx.shutdown.clone();
        tokio::select! {
            ready = kv.wait(keys, wait) => Ok(ready?),
            _ = crate::ops::stopped(&mut shutdown) => {
                Err(Status::unavailable("coordinator replica shutting down; call another"))
            }
        }
    }
}
