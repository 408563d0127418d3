//! A deterministic interleaving for races between decisions that read, then write: a store
//! (delegating every call to a real one) that holds the first `parties` reads of the keys a
//! test names until all of them have been made, so that each decision has read before any
//! writes. The test then asserts [`GatedStore::met`]: that the race it sets up took place.

use cohort_coordinator::store::{KeyValue, LeaseId, Store, StoreError, Txn, TxnResult, WatchStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long a held read waits for the others before it goes on alone (and the gate counts
/// as missed).
const GATE_WAIT: Duration = Duration::from_secs(20);

/// A store whose reads of matching keys (by [`Store::get`] or [`Store::get_prefix`]) meet.
pub(crate) struct GatedStore {
    inner: Arc<dyn Store>,
    matches: Box<dyn Fn(&str) -> bool + Send + Sync>,
    parties: usize,
    arrivals: AtomicUsize,
    barrier: tokio::sync::Barrier,
    missed: AtomicBool,
}

impl GatedStore {
    /// Holds the first `parties` reads of keys (or prefixes) for which `matches` holds until
    /// all `parties` have read; later reads pass at once.
    pub(crate) fn new(
        inner: Arc<dyn Store>,
        parties: usize,
        matches: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(Self {
            inner,
            matches: Box::new(matches),
            parties,
            arrivals: AtomicUsize::new(0),
            barrier: tokio::sync::Barrier::new(parties),
            missed: AtomicBool::new(false),
        })
    }

    /// Whether all `parties` reads were made and met (none went on alone).
    pub(crate) fn met(&self) -> bool {
        self.arrivals.load(Ordering::SeqCst) >= self.parties && !self.missed.load(Ordering::SeqCst)
    }

    async fn meet(&self, key: &str) {
        let held = (self.matches)(key) && self.arrivals.fetch_add(1, Ordering::SeqCst) < self.parties;
        if held && tokio::time::timeout(GATE_WAIT, self.barrier.wait()).await.is_err() {
            self.missed.store(true, Ordering::SeqCst);
        }
    }
}

#[async_trait::async_trait]
impl Store for GatedStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        let read = self.inner.get(key).await;
        self.meet(key).await;
        read
    }
    async fn get_prefix(&self, prefix: &str) -> Result<(Vec<KeyValue>, i64), StoreError> {
        let read = self.inner.get_prefix(prefix).await;
        self.meet(prefix).await;
        read
    }
    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<i64, StoreError> {
        self.inner.put(key, value, lease).await
    }
    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.inner.delete(key).await
    }
    async fn delete_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
        self.inner.delete_prefix(prefix).await
    }
    async fn txn(&self, txn: Txn) -> Result<TxnResult, StoreError> {
        self.inner.txn(txn).await
    }
    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        self.inner.grant_lease(ttl).await
    }
    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.inner.keep_alive(lease).await
    }
    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.inner.revoke_lease(lease).await
    }
    async fn lease_time_to_live(&self, lease: LeaseId) -> Result<Option<Duration>, StoreError> {
        self.inner.lease_time_to_live(lease).await
    }
    fn lease_ttl_resolution(&self) -> Duration {
        self.inner.lease_ttl_resolution()
    }
    fn request_batching(&self) -> Option<cohort_coordinator::store::etcd::BatchStats> {
        self.inner.request_batching()
    }
    fn max_txn_ops(&self) -> Option<usize> {
        self.inner.max_txn_ops()
    }
    async fn watch_prefix(&self, prefix: &str, from_revision: i64) -> Result<WatchStream, StoreError> {
        self.inner.watch_prefix(prefix, from_revision).await
    }
}
