//! Durable state of the coordinator, behind one trait with two backends.
//!
//! The model is etcd v3's, reduced to what the coordinator needs: a flat key space of
//! `String -> Vec<u8>` with a global revision that every mutation increments, per-key
//! `create_revision`/`mod_revision`, compare-and-swap transactions, leases with a TTL to
//! which keys can be attached (they vanish when the lease expires or is revoked), and
//! prefix watches that deliver every change after a given revision, in order.
//!
//! - [`memory::MemoryStore`]: in-process, the default; nothing else to run.
//! - [`etcd::EtcdStore`]: a real etcd v3 cluster through the `etcd-client` crate.
//!
//! Both pass the same behavioural suite (`tests/store_suite.rs`).

pub mod etcd;
pub mod memory;

use std::pin::Pin;
use std::time::Duration;

/// An etcd-style lease id. `0` is never a valid lease.
pub type LeaseId = i64;

/// A stored key with its value and revisions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    /// The full key.
    pub key: String,
    /// The value bytes.
    pub value: Vec<u8>,
    /// Store revision at which the key was created.
    pub create_revision: i64,
    /// Store revision of the key's last modification.
    pub mod_revision: i64,
    /// The lease the key is attached to, if any.
    pub lease: Option<LeaseId>,
}

/// One condition of a transaction; all must hold for the success branch to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Compare {
    /// The key does not exist.
    Absent(String),
    /// The key exists (any value).
    Exists(String),
    /// The key's `mod_revision` equals this (the CAS on a value read earlier).
    ModRevision(String, i64),
    /// The key's value equals these bytes.
    ValueEquals(String, Vec<u8>),
}

/// One operation of a transaction branch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxnOp {
    /// Writes a key, optionally attached to a lease.
    Put {
        /// Key to write.
        key: String,
        /// New value.
        value: Vec<u8>,
        /// Lease to attach the key to.
        lease: Option<LeaseId>,
    },
    /// Deletes one key (no error if absent).
    Delete(String),
    /// Deletes every key with this prefix.
    DeletePrefix(String),
}

/// A compare-and-swap transaction: if every compare holds, apply `success`, else `failure`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Txn {
    /// Conditions, all of which must hold.
    pub compares: Vec<Compare>,
    /// Applied atomically when all conditions hold.
    pub success: Vec<TxnOp>,
    /// Applied atomically otherwise.
    pub failure: Vec<TxnOp>,
}

/// The outcome of a transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxnResult {
    /// Whether the compares held (and `success` was applied).
    pub succeeded: bool,
    /// Store revision after the transaction.
    pub revision: i64,
}

/// A change seen by a watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    /// A key was created or modified; carries the new key-value (its `mod_revision` orders events).
    Put(KeyValue),
    /// A key was deleted (explicitly or by lease expiry) at `revision`.
    Delete {
        /// The deleted key.
        key: String,
        /// Store revision of the deletion.
        revision: i64,
    },
}

/// A stream of watch events; ends (or yields an error) if the backend loses the watch.
pub type WatchStream = Pin<Box<dyn futures::Stream<Item = Result<WatchEvent, StoreError>> + Send>>;

/// Errors from a store backend.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The backend could not be reached or answered with an error; retrying may help.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The lease does not exist (expired or revoked).
    #[error("lease {0} not found (expired or revoked)")]
    LeaseNotFound(LeaseId),
    /// A watch asked for history that has been compacted away. Carries the oldest revision
    /// still available: a new watch may start there (after re-reading the current state).
    #[error("requested revision has been compacted; the oldest available is {0}")]
    Compacted(i64),
    /// A request the backend rejects (empty key, TTL out of range, ...).
    #[error("invalid store request: {0}")]
    Invalid(String),
}

/// Keys with revisions, CAS transactions, leases with TTL, and watches.
///
/// Every method is a single round trip to the backend, bounded in time by the backend
/// (etcd: a per-request deadline that turns a dead server into [`StoreError::Unavailable`]).
///
/// # Cancel safety
/// Every method is cancel safe in the sense that dropping the future either applies the
/// whole request or none of it (etcd requests are atomic on the server; the memory store
/// applies under one lock). After a cancelled or timed-out write the caller cannot know which
/// happened, so it re-reads (or relies on a CAS) before retrying.
#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// Reads one key.
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError>;

    /// Reads every key with `prefix`, in key order, and the store revision of the read.
    async fn get_prefix(&self, prefix: &str) -> Result<(Vec<KeyValue>, i64), StoreError>;

    /// Writes a key (optionally on a lease); returns the new store revision.
    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<i64, StoreError>;

    /// Deletes one key; returns whether it existed.
    async fn delete(&self, key: &str) -> Result<bool, StoreError>;

    /// Deletes every key with `prefix`; returns how many were deleted.
    async fn delete_prefix(&self, prefix: &str) -> Result<u64, StoreError>;

    /// Runs a compare-and-swap transaction atomically.
    async fn txn(&self, txn: Txn) -> Result<TxnResult, StoreError>;

    /// Grants a lease that expires `ttl` after its last keep-alive (whole seconds, at least 1).
    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StoreError>;

    /// Renews a lease for another TTL; [`StoreError::LeaseNotFound`] if it already expired.
    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError>;

    /// Revokes a lease now, deleting the keys attached to it. No error if already gone.
    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError>;

    /// The time a lease has left before it expires (without further keep-alives), or `None`
    /// if it no longer exists. Backends may round to whole seconds (etcd does).
    async fn lease_time_to_live(&self, lease: LeaseId) -> Result<Option<Duration>, StoreError>;

    /// How coarse [`Store::lease_time_to_live`] is: its answer may fall short of the true
    /// time left by up to this much (etcd truncates to whole seconds; the memory store is exact).
    fn lease_ttl_resolution(&self) -> Duration {
        Duration::from_secs(1)
    }

    /// Watches every key with `prefix`, delivering all changes with revision >= `from_revision`
    /// in revision order (use the revision of a `get_prefix` plus one to continue from a read).
    /// `from_revision <= 0` means "changes after now". The watch is registered when this
    /// returns, so a change made afterwards is always delivered. Changes made by one
    /// transaction share a revision and are delivered in the order the transaction made them,
    /// all ready together: once the first event of a revision has been yielded, the rest of
    /// that revision can be polled without waiting (etcd sends a revision in one watch
    /// response; the memory store queues it under one lock), so a consumer can end a batch
    /// as soon as nothing is ready without splitting a revision.
    /// [`StoreError::Compacted`] (returned here, or yielded by the stream) means the requested
    /// history is gone; any other error ends the stream, and the caller resumes with a new
    /// watch from the revision after the last event it saw.
    async fn watch_prefix(&self, prefix: &str, from_revision: i64) -> Result<WatchStream, StoreError>;
}

/// The largest lease TTL accepted, in seconds (etcd's limit).
pub const MAX_LEASE_TTL_SECS: u64 = 9_000_000_000;

/// Rejects an empty key, which etcd does not accept for single-key operations.
pub(crate) fn check_key(key: &str) -> Result<(), StoreError> {
    if key.is_empty() {
        Err(StoreError::Invalid("empty key".into()))
    } else {
        Ok(())
    }
}

/// Converts a requested lease TTL to whole seconds (rounded up), within `1..=MAX_LEASE_TTL_SECS`.
pub(crate) fn ttl_seconds(ttl: Duration) -> Result<u64, StoreError> {
    if ttl.is_zero() {
        return Err(StoreError::Invalid("lease TTL must be at least 1 s".into()));
    }
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    if secs > MAX_LEASE_TTL_SECS {
        return Err(StoreError::Invalid(format!("lease TTL {secs} s exceeds {MAX_LEASE_TTL_SECS} s")));
    }
    Ok(secs)
}
