//! The store the replicas share, as etcd would be: one [`MemoryStore`] that lives on its
//! own simulated host (so that its leases run on one clock, the simulated one), reached by
//! each replica through a [`RemoteStore`] that adds the latency and outages the fault
//! schedule draws.

use cohort_coordinator::store::memory::MemoryStore;
use cohort_coordinator::store::{KeyValue, LeaseId, Store, StoreError, Txn, TxnResult, WatchStream};
use futures::future::BoxFuture;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// One store operation, run on the store's host.
type Operation = Box<dyn FnOnce(Arc<MemoryStore>) -> BoxFuture<'static, ()> + Send>;

/// The store's side: receives operations and runs them against the memory store.
pub(crate) struct StoreHost {
    operations: Mutex<Option<mpsc::UnboundedReceiver<Operation>>>,
}

/// What the replicas' stores share: the way to the store host, and the faults.
#[derive(Clone)]
pub(crate) struct StoreLink {
    operations: mpsc::UnboundedSender<Operation>,
    /// Replicas cut off from the store now.
    pub(crate) outages: Arc<Mutex<BTreeSet<usize>>>,
    /// Largest latency added to one operation (both ways together), in milliseconds.
    pub(crate) max_latency_ms: u64,
    rng: Arc<Mutex<StdRng>>,
}

/// A new store host and the link to it.
pub(crate) fn store(seed: u64, max_latency_ms: u64) -> (Arc<StoreHost>, StoreLink) {
    let (tx, rx) = mpsc::unbounded_channel();
    let host = Arc::new(StoreHost { operations: Mutex::new(Some(rx)) });
    let link = StoreLink {
        operations: tx,
        outages: Arc::new(Mutex::new(BTreeSet::new())),
        max_latency_ms,
        rng: Arc::new(Mutex::new(StdRng::seed_from_u64(seed ^ 0x5709e))),
    };
    (host, link)
}

impl StoreHost {
    /// Serves operations until the simulation ends (the store host is never crashed).
    ///
    /// # Cancel safety
    /// Not cancel safe: the receiver is taken once.
    pub(crate) async fn serve(self: Arc<Self>) -> turmoil::Result {
        let Some(mut operations) = self.operations.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return Err("the store host started twice".into());
        };
        let store = Arc::new(MemoryStore::new());
        while let Some(operation) = operations.recv().await {
            tokio::spawn(operation(store.clone()));
        }
        Ok(())
    }
}

/// One replica's view of the shared store.
pub(crate) struct RemoteStore {
    link: StoreLink,
    replica: usize,
}

impl RemoteStore {
    pub(crate) fn new(link: StoreLink, replica: usize) -> Self {
        Self { link, replica }
    }

    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(Arc<MemoryStore>) -> BoxFuture<'static, Result<T, StoreError>> + Send + 'static,
    ) -> Result<T, StoreError> {
        let delay = {
            let mut rng = self.link.rng.lock().unwrap_or_else(|e| e.into_inner());
            rng.random_range(0..=self.link.max_latency_ms)
        };
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay / 2)).await;
        }
        if self.link.outages.lock().unwrap_or_else(|e| e.into_inner()).contains(&self.replica) {
            return Err(StoreError::Unavailable(format!("replica {} is cut off from the store", self.replica)));
        }
        let (tx, rx) = oneshot::channel();
        let operation: Operation = Box::new(move |store| {
            Box::pin(async move {
                let _ = tx.send(f(store).await);
            })
        });
        self.link.operations.send(operation).map_err(|_| StoreError::Unavailable("the store host is gone".into()))?;
        let result = rx.await.map_err(|_| StoreError::Unavailable("the store dropped the operation".into()))?;
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay - delay / 2)).await;
        }
        result
    }
}

#[async_trait::async_trait]
impl Store for RemoteStore {
    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        let key = key.to_string();
        self.run(move |s| Box::pin(async move { s.get(&key).await })).await
    }

    async fn get_prefix(&self, prefix: &str) -> Result<(Vec<KeyValue>, i64), StoreError> {
        let prefix = prefix.to_string();
        self.run(move |s| Box::pin(async move { s.get_prefix(&prefix).await })).await
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<i64, StoreError> {
        let key = key.to_string();
        self.run(move |s| Box::pin(async move { s.put(&key, value, lease).await })).await
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let key = key.to_string();
        self.run(move |s| Box::pin(async move { s.delete(&key).await })).await
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
        let prefix = prefix.to_string();
        self.run(move |s| Box::pin(async move { s.delete_prefix(&prefix).await })).await
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResult, StoreError> {
        self.run(move |s| Box::pin(async move { s.txn(txn).await })).await
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        self.run(move |s| Box::pin(async move { s.grant_lease(ttl).await })).await
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.run(move |s| Box::pin(async move { s.keep_alive(lease).await })).await
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        self.run(move |s| Box::pin(async move { s.revoke_lease(lease).await })).await
    }

    async fn lease_time_to_live(&self, lease: LeaseId) -> Result<Option<Duration>, StoreError> {
        self.run(move |s| Box::pin(async move { s.lease_time_to_live(lease).await })).await
    }

    fn lease_ttl_resolution(&self) -> Duration {
        Duration::ZERO
    }

    async fn watch_prefix(&self, prefix: &str, from_revision: i64) -> Result<WatchStream, StoreError> {
        let prefix = prefix.to_string();
        self.run(move |s| Box::pin(async move { s.watch_prefix(&prefix, from_revision).await })).await
    }
}
