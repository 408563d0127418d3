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
//!
//! # Choosing and opening a backend
//!
//! [`StoreSpec`] is the coordinator's `--store` flag (`memory`, or
//! `etcd://HOST:PORT[,HOST:PORT...]`): the binary parses and opens it, and the launchers that
//! start coordinators (the chaos harness, the integration tests) build one and pass its text
//! form. [`StoreKind`] is the backend without its address: what a launcher must provision
//! before it can name a spec. A new backend is its module (with its `mod` line here), a
//! variant in both enums with its arms below, and its run of `tests/store_suite.rs`.

pub mod etcd;
pub mod memory;

use etcd::{EtcdSecurity, EtcdStore, EtcdTuning, DEFAULT_REQUEST_TIMEOUT};
use memory::MemoryStore;
use std::fmt;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
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

    /// How many keys have `prefix`, without reading their values (etcd: a count-only range).
    /// The default reads the prefix; a backend that can count more cheaply overrides it.
    async fn count_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
        Ok(self.get_prefix(prefix).await?.0.len() as u64)
    }

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

    /// What the backend's request batching has done so far, if it batches (etcd does,
    /// see [`etcd::BatchStats`]; the memory store does not).
    fn request_batching(&self) -> Option<etcd::BatchStats> {
        None
    }

    /// The most operations (and, separately, compares) one transaction may carry: etcd's
    /// `--max-txn-ops` as this replica was told it (`serve --etcd-max-txn-ops`, default 128).
    /// `None`: no limit (the memory store).
    fn max_txn_ops(&self) -> Option<usize> {
        None
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

/// A store backend, without where it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// The in-process store ([`MemoryStore`]): nothing else to run, one replica only.
    #[default]
    Memory,
    /// An etcd v3 cluster ([`EtcdStore`]): any number of replicas share it.
    Etcd,
}

impl StoreKind {
    /// Every backend.
    pub const ALL: [StoreKind; 2] = [StoreKind::Memory, StoreKind::Etcd];

    /// The backend's name: the `--store` value or URL scheme, and its name in scenario files.
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Memory => "memory",
            StoreKind::Etcd => "etcd",
        }
    }

    /// Whether several coordinator replicas can share one store of this kind. The memory store
    /// lives inside one process, so a deployment on it runs exactly one coordinator.
    pub fn shared_by_replicas(self) -> bool {
        match self {
            StoreKind::Memory => false,
            StoreKind::Etcd => true,
        }
    }
}

impl fmt::Display for StoreKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A store and where it is, as the coordinator's `--store` flag names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreSpec {
    /// `memory`: the in-process store.
    Memory,
    /// `etcd://HOST:PORT[,HOST:PORT...]`: an etcd cluster. The endpoints are `HOST:PORT`
    /// without a scheme; [`StoreSpec::open`] dials them with https when TLS is configured.
    Etcd {
        /// The cluster's client endpoints, at least one.
        endpoints: Vec<String>,
    },
}

/// A `--store` value that names no backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad store {0:?}: use memory or etcd://HOST:PORT[,HOST:PORT...]")]
pub struct StoreSpecError(pub String);

/// Why [`StoreSpec::open`] failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum OpenStoreError {
    /// etcd security settings given for a store that is not etcd (they would be ignored).
    #[error("the etcd TLS and user settings need an etcd store, not {0}")]
    SecurityWithoutEtcd(StoreKind),
    /// etcd request limits given for a store that is not etcd (they would be ignored).
    #[error("--etcd-max-txn-ops needs an etcd store, not {0}")]
    TuningWithoutEtcd(StoreKind),
    /// The backend refused or could not be reached.
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

impl StoreSpec {
    /// The backend this spec names.
    pub fn kind(&self) -> StoreKind {
        match self {
            StoreSpec::Memory => StoreKind::Memory,
            StoreSpec::Etcd { .. } => StoreKind::Etcd,
        }
    }

    /// Opens the store. `etcd` holds the TLS and user settings of an etcd store (the default
    /// is none); settings for a store that is not etcd are refused rather than ignored.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the connection being made; nothing else
    /// happens.
    pub async fn open(&self, etcd: &EtcdSecurity) -> Result<Arc<dyn Store>, OpenStoreError> {
        self.open_tuned(etcd, None).await
    }

    /// Like [`StoreSpec::open`], with an etcd store's requests shaped by `tuning` (the
    /// default: etcd's default limits); tuning for a store that is not etcd is refused.
    ///
    /// # Cancel safety
    /// As [`StoreSpec::open`].
    pub async fn open_tuned(
        &self,
        etcd: &EtcdSecurity,
        tuning: Option<EtcdTuning>,
    ) -> Result<Arc<dyn Store>, OpenStoreError> {
        let etcd_settings = etcd.ca_pem.is_some() || etcd.client_identity.is_some() || etcd.user.is_some();
        match self {
            StoreSpec::Memory if etcd_settings => Err(OpenStoreError::SecurityWithoutEtcd(self.kind())),
            StoreSpec::Memory if tuning.is_some() => Err(OpenStoreError::TuningWithoutEtcd(self.kind())),
            StoreSpec::Memory => Ok(Arc::new(MemoryStore::new())),
            StoreSpec::Etcd { endpoints } => {
                let scheme = if etcd.ca_pem.is_some() { "https" } else { "http" };
                let urls: Vec<String> = endpoints.iter().map(|e| format!("{scheme}://{e}")).collect();
                let tuning = tuning.unwrap_or_default();
                Ok(Arc::new(EtcdStore::connect_tuned(&urls, DEFAULT_REQUEST_TIMEOUT, etcd, tuning).await?))
            }
        }
    }
}

impl FromStr for StoreSpec {
    type Err = StoreSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == StoreKind::Memory.name() {
            return Ok(StoreSpec::Memory);
        }
        let list = s.strip_prefix("etcd://").ok_or_else(|| StoreSpecError(s.into()))?;
        let endpoints: Vec<String> = list.split(',').filter(|e| !e.is_empty()).map(str::to_string).collect();
        if endpoints.is_empty() {
            return Err(StoreSpecError(s.into()));
        }
        Ok(StoreSpec::Etcd { endpoints })
    }
}

impl fmt::Display for StoreSpec {
    /// The `--store` value that parses back to this spec.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreSpec::Memory => f.write_str("memory"),
            StoreSpec::Etcd { endpoints } => write!(f, "etcd://{}", endpoints.join(",")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_print_back() {
        for text in ["memory", "etcd://127.0.0.1:2379", "etcd://a:1,b:2,c:3"] {
            let spec: StoreSpec = text.parse().expect(text);
            assert_eq!(spec.to_string(), text);
        }
        assert_eq!("etcd://a:1,,b:2,".parse(), Ok(StoreSpec::Etcd { endpoints: vec!["a:1".into(), "b:2".into()] }));
        for bad in ["", "etcd", "etcd://", "etcd://,", "Memory", "redis://x:1", "memory://"] {
            assert_eq!(bad.parse::<StoreSpec>(), Err(StoreSpecError(bad.into())), "{bad:?}");
        }
    }

    #[test]
    fn kinds_name_their_specs() {
        assert_eq!(StoreSpec::Memory.kind(), StoreKind::Memory);
        assert_eq!(StoreSpec::Etcd { endpoints: vec!["a:1".into()] }.kind(), StoreKind::Etcd);
        for kind in StoreKind::ALL {
            assert_eq!(kind.to_string(), kind.name());
        }
        assert!(!StoreKind::Memory.shared_by_replicas());
        assert!(StoreKind::Etcd.shared_by_replicas());
    }

    #[tokio::test]
    async fn etcd_settings_on_the_memory_store_are_refused() {
        let etcd = EtcdSecurity { user: Some(("u".into(), "p".into())), ..EtcdSecurity::default() };
        assert!(matches!(
            StoreSpec::Memory.open(&etcd).await,
            Err(OpenStoreError::SecurityWithoutEtcd(StoreKind::Memory))
        ));
        assert!(StoreSpec::Memory.open(&EtcdSecurity::default()).await.is_ok());
        let tuning = Some(EtcdTuning { max_txn_ops: 512 });
        assert!(matches!(
            StoreSpec::Memory.open_tuned(&EtcdSecurity::default(), tuning).await,
            Err(OpenStoreError::TuningWithoutEtcd(StoreKind::Memory))
        ));
        let spec: StoreSpec = "etcd://127.0.0.1:1".parse().expect("spec");
        let zero = Some(EtcdTuning { max_txn_ops: 0 });
        assert!(matches!(
            spec.open_tuned(&EtcdSecurity::default(), zero).await,
            Err(OpenStoreError::Store(StoreError::Invalid(_)))
        ));
    }
}
