//! The job's key-value store on the coordinator (`StoreOp`): what torch's c10d `Store`
//! needs, one method per operation, each bounded and retried across the coordinator's
//! endpoints by [`ControlClient`].

use super::{ControlClient, ControlError};
use cohort_proto::ids::JobId;
use cohort_proto::v1::store_request::Op;
use cohort_proto::v1::*;
use std::time::Duration;
use tokio::time::Instant;

/// Longest one long poll (`get`, `wait`) asks the coordinator to hold (it holds at most 30 s):
/// a longer wait is several calls, each bounded by it plus the request timeout.
pub const STORE_POLL_WAIT: Duration = Duration::from_secs(10);

/// One scope of a job's key-value store (the scope is a namespace such as a generation;
/// empty for the job's root), through a [`ControlClient`] whose token is the job's.
#[derive(Clone)]
pub struct JobStore {
    client: ControlClient,
    job: JobId,
    scope: String,
}

impl JobStore {
    /// The store of `scope` (empty, or `[A-Za-z0-9._-]`, checked by the coordinator) in `job`.
    pub fn new(client: ControlClient, job: JobId, scope: impl Into<String>) -> Self {
        Self { client, job, scope: scope.into() }
    }

    /// The job.
    pub fn job(&self) -> &JobId {
        &self.job
    }

    /// The scope.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    async fn op(&self, op: Op) -> Result<StoreResponse, ControlError> {
        self.client.store_op(StoreRequest { job: self.job.to_string(), scope: self.scope.clone(), op: Some(op) }).await
    }

    /// Writes `value` under `key`.
    ///
    /// # Cancel safety
    /// As [`ControlClient::store_op`].
    pub async fn set(&self, key: &str, value: Vec<u8>) -> Result<(), ControlError> {
        self.op(Op::Set(StoreSet { key: key.into(), value })).await.map(|_| ())
    }

    /// Reads `key` now: `None` if it does not exist.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>, ControlError> {
        let r = self.op(Op::Get(StoreGet { key: key.into(), wait_ms: 0 })).await?;
        Ok(r.found.then_some(r.value))
    }

    /// Reads `key`, waiting up to `timeout` for it to exist (long polls of at most
    /// [`STORE_POLL_WAIT`]): `None` when the time ran out.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn get(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>, ControlError> {
        let deadline = Instant::now() + timeout;
        loop {
            let wait = deadline.saturating_duration_since(Instant::now()).min(STORE_POLL_WAIT);
            let r = self.op(Op::Get(StoreGet { key: key.into(), wait_ms: millis(wait) })).await?;
            if r.found {
                return Ok(Some(r.value));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
        }
    }

    /// Adds `delta` to the integer under `key` (absent: 0); answers the sum.
    ///
    /// # Cancel safety
    /// As [`ControlClient::store_op`]: an add whose answer was lost may have been applied.
    pub async fn add(&self, key: &str, delta: i64) -> Result<i64, ControlError> {
        Ok(self.op(Op::Add(StoreAdd { key: key.into(), delta })).await?.number)
    }

    /// Appends `value` to the bytes under `key` (absent: empty); concurrent appends are each
    /// applied once. A result past the coordinator's value bound (1 MiB) is refused.
    ///
    /// # Cancel safety
    /// As [`ControlClient::store_op`]: an append whose answer was lost may have been applied.
    pub async fn append(&self, key: &str, value: Vec<u8>) -> Result<(), ControlError> {
        self.op(Op::Append(StoreAppend { key: key.into(), value })).await.map(|_| ())
    }

    /// torch's compare_set: writes `desired` if `key` holds `expected` (or is absent and
    /// `expected` is empty); answers the value stored now (or `expected` for an absent key
    /// and a non-empty `expected`).
    ///
    /// # Cancel safety
    /// As [`ControlClient::store_op`].
    pub async fn compare_set(&self, key: &str, expected: Vec<u8>, desired: Vec<u8>) -> Result<Vec<u8>, ControlError> {
        Ok(self.op(Op::CompareSet(StoreCompareSet { key: key.into(), expected, desired })).await?.value)
    }

    /// Whether every key exists now.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn check(&self, keys: &[String]) -> Result<bool, ControlError> {
        Ok(self.op(Op::Check(StoreCheck { keys: keys.to_vec() })).await?.found)
    }

    /// Deletes `key`; answers whether it existed.
    ///
    /// # Cancel safety
    /// As [`ControlClient::store_op`].
    pub async fn delete(&self, key: &str) -> Result<bool, ControlError> {
        Ok(self.op(Op::Delete(StoreDelete { key: key.into() })).await?.found)
    }

    /// How many keys the scope holds.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn num_keys(&self) -> Result<u64, ControlError> {
        Ok(u64::try_from(self.op(Op::NumKeys(StoreNumKeys {})).await?.number).unwrap_or(0))
    }

    /// Waits up to `timeout` for every key to exist (long polls of at most
    /// [`STORE_POLL_WAIT`]); answers `false` when the time ran out.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn wait(&self, keys: &[String], timeout: Duration) -> Result<bool, ControlError> {
        let deadline = Instant::now() + timeout;
        loop {
            let wait = deadline.saturating_duration_since(Instant::now()).min(STORE_POLL_WAIT);
            let r = self.op(Op::Wait(StoreWait { keys: keys.to_vec(), wait_ms: millis(wait) })).await?;
            if r.found {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
