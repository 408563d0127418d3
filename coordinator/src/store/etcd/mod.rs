//! The etcd v3 [`Store`] backend, over the `etcd-client` crate.
//!
//! Every request runs under a deadline ([`DEFAULT_REQUEST_TIMEOUT`] unless configured), so a
//! dead or hung etcd gives [`StoreError::Unavailable`] instead of a hang. Watch streams are
//! long-lived and have no overall deadline; a dead connection under them is detected by
//! HTTP/2 keep-alive pings (every [`KEEPALIVE_INTERVAL`], failing after
//! [`KEEPALIVE_TIMEOUT`]), which ends the stream with an error.
//!
//! The connection can be secured as production etcd clusters require ([`EtcdSecurity`]): TLS
//! with the cluster's CA (https endpoints), a client certificate for clusters that run with
//! `--client-cert-auth`, and etcd's user authentication (a user name and password; the client
//! renews its token when etcd reports it stale).
//!
//! Single-key reads and writes, and transactions without a failure branch, go through
//! a batching queue (`batch.rs`): concurrent ones share one etcd transaction, so a large job's formation
//! costs etcd a few hundred transactions rather than a few per member.

mod batch;
mod channel;
mod keepalive;

pub use batch::{BatchStats, MAX_BATCH_BYTES, MAX_BATCH_OPS};
use batch::{Batcher, Reply, Request};
use keepalive::KeepAlives;

use std::collections::VecDeque;
use std::future::Future;
use std::time::Duration;

use etcd_client::{
    Certificate, Client, ConnectOptions, DeleteOptions, GetOptions, Identity, PutOptions, TlsOptions, WatchOptions,
};
use futures::StreamExt;

use super::{
    check_key, ttl_seconds, Compare, KeyValue, LeaseId, Store, StoreError, Txn, TxnOp, TxnResult, WatchEvent,
    WatchStream,
};

/// Deadline for establishing the connection (and for the probe `connect` makes).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Deadline for one request when none is configured.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// HTTP/2 ping interval on the connection (etcd refuses pings more often than every 5 s).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// How long an unanswered HTTP/2 ping may take before the connection counts as dead.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// How the coordinator authenticates to etcd and secures the connection. The default is plain
/// text without credentials (a local or test cluster).
#[derive(Clone, Default)]
pub struct EtcdSecurity {
    /// TLS: the CA (PEM) that signed etcd's client-facing certificates. With it, every endpoint
    /// must be `https://` (or a bare `HOST:PORT`, which then means https).
    pub ca_pem: Option<Vec<u8>>,
    /// A client certificate and key (PEM), for clusters that run with `--client-cert-auth`.
    /// Needs `ca_pem`.
    pub client_identity: Option<(Vec<u8>, Vec<u8>)>,
    /// etcd user authentication: user name and password.
    pub user: Option<(String, String)>,
}

impl std::fmt::Debug for EtcdSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password or the key.
        f.debug_struct("EtcdSecurity")
            .field("tls", &self.ca_pem.is_some())
            .field("client_certificate", &self.client_identity.is_some())
            .field("user", &self.user.as_ref().map(|(name, _)| name))
            .finish()
    }
}

impl EtcdSecurity {
    /// Checks that the endpoints and the settings fit together: https needs a CA, a CA needs
    /// https (a CA given for a plain-text endpoint would otherwise be ignored), and a client
    /// certificate needs TLS.
    pub fn check(&self, endpoints: &[String]) -> Result<(), StoreError> {
        if self.client_identity.is_some() && self.ca_pem.is_none() {
            return Err(StoreError::Invalid("an etcd client certificate needs TLS: give the etcd CA too".into()));
        }
        for e in endpoints {
            match (e.starts_with("http://"), e.starts_with("https://"), self.ca_pem.is_some()) {
                (true, _, true) => {
                    return Err(StoreError::Invalid(format!(
                        "etcd endpoint {e} is http:// but an etcd CA is given: use https:// (or HOST:PORT)"
                    )))
                }
                (_, true, false) => {
                    return Err(StoreError::Invalid(format!("etcd endpoint {e} is https://: give the etcd CA")))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Adds what to check to a failure of the first request over TLS: a refused TLS
    /// handshake reaches the client only as a cancelled or failed connection.
    fn explain(&self, e: StoreError) -> StoreError {
        match (e, self.ca_pem.is_some(), self.client_identity.is_some()) {
            (StoreError::Unavailable(m), true, has_cert) => StoreError::Unavailable(format!(
                "{m} (over TLS: check that the etcd CA signed the server's certificate{})",
                if has_cert {
                    " and the client certificate"
                } else {
                    ", and whether etcd requires a client certificate"
                }
            )),
            (e, ..) => e,
        }
    }

    /// The client's connect options for these settings.
    fn apply(&self, mut options: ConnectOptions) -> ConnectOptions {
        if let Some(ca) = &self.ca_pem {
            let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(ca));
            if let Some((cert, key)) = &self.client_identity {
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            options = options.with_tls(tls);
        }
        if let Some((name, password)) = &self.user {
            options = options.with_user(name.clone(), password.clone());
        }
        options
    }
}

/// How the coordinator shapes its requests to fit one etcd cluster's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EtcdTuning {
    /// Most operations (and, separately, compares) in one shared transaction: the cluster's
    /// `--max-txn-ops` (default [`MAX_BATCH_OPS`], etcd's default). A larger limit lets a
    /// large job's concurrent writes go in fewer transactions (fewer raft entries); one above
    /// the cluster's is refused by etcd, and the requests of such a batch are run alone.
    pub max_txn_ops: usize,
}

impl Default for EtcdTuning {
    /// etcd's defaults.
    fn default() -> Self {
        Self { max_txn_ops: MAX_BATCH_OPS }
    }
}

impl EtcdTuning {
    /// Refuses settings no cluster accepts (no operation per transaction).
    pub fn check(&self) -> Result<(), StoreError> {
        if self.max_txn_ops == 0 {
            return Err(StoreError::Invalid("the most operations per etcd transaction must be at least 1".into()));
        }
        Ok(())
    }
}

/// A [`Store`] on an etcd v3 cluster. Clones share one connection.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    request_timeout: Duration,
    batcher: Batcher,
    keepalives: std::sync::Arc<KeepAlives>,
    /// The cluster's limit on a transaction's operations, as configured ([`EtcdTuning`]).
    max_txn_ops: usize,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore").field("request_timeout", &self.request_timeout).finish_non_exhaustive()
    }
}

/// Maps an etcd client error to a [`StoreError`]; `lease` is the lease the request used, if
/// any, so that etcd's "requested lease not found" becomes [`StoreError::LeaseNotFound`].
fn map_error(e: etcd_client::Error, lease: Option<LeaseId>) -> StoreError {
    use etcd_client::Error as E;
    use tonic::Code;
    match e {
        E::GRpcStatus(status) => {
            let msg = status.message();
            if let (Some(id), true) = (lease, msg.contains("lease not found")) {
                return StoreError::LeaseNotFound(id);
            }
            match status.code() {
                Code::InvalidArgument
                | Code::FailedPrecondition
                | Code::OutOfRange
                | Code::AlreadyExists
                | Code::NotFound
                | Code::PermissionDenied
                | Code::Unauthenticated
                | Code::Unimplemented => StoreError::Invalid(format!("etcd: {msg}")),
                code => StoreError::Unavailable(format!("etcd: {code:?}: {msg}")),
            }
        }
        E::LeaseKeepAliveError(msg) if msg.contains("lease not found") => match lease {
            Some(id) => StoreError::LeaseNotFound(id),
            None => StoreError::Invalid(format!("etcd: {msg}")),
        },
        e @ (E::InvalidArgs(_) | E::InvalidUri(_) | E::InvalidMetadataValue(_) | E::Utf8Error(_)) => {
            StoreError::Invalid(e.to_string())
        }
        e => StoreError::Unavailable(e.to_string()),
    }
}

/// A batch answer of the wrong kind for its request (a defect of the batcher, not of etcd).
fn unexpected(reply: Reply) -> StoreError {
    StoreError::Unavailable(format!("internal: the etcd batch answered with {reply:?}"))
}

/// Converts an etcd key-value; keys that are not UTF-8 (never written by cohort) are
/// converted lossily rather than failing a whole listing.
fn convert_kv(kv: &etcd_client::KeyValue) -> KeyValue {
    KeyValue {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        value: kv.value().to_vec(),
        create_revision: kv.create_revision(),
        mod_revision: kv.mod_revision(),
        lease: (kv.lease() != 0).then_some(kv.lease()),
    }
}

/// The store revision a response was served at.
fn header_revision(header: Option<&etcd_client::ResponseHeader>) -> Result<i64, StoreError> {
    header.map(|h| h.revision()).ok_or_else(|| StoreError::Unavailable("etcd response without a header".into()))
}

/// Converts one watch event. The kind is read from the key's version (a deletion resets it
/// to 0) rather than from `Event::event_type`, which panics on unknown values.
fn convert_event(ev: &etcd_client::Event) -> Option<WatchEvent> {
    let kv = ev.kv()?;
    if kv.version() == 0 {
        Some(WatchEvent::Delete { key: String::from_utf8_lossy(kv.key()).into_owned(), revision: kv.mod_revision() })
    } else {
        Some(WatchEvent::Put(convert_kv(kv)))
    }
}

fn compare_to_etcd(c: Compare) -> etcd_client::Compare {
    use etcd_client::{Compare as C, CompareOp};
    match c {
        Compare::Absent(k) => C::version(k, CompareOp::Equal, 0),
        Compare::Exists(k) => C::version(k, CompareOp::Greater, 0),
        Compare::ModRevision(k, rev) => C::mod_revision(k, CompareOp::Equal, rev),
        Compare::ValueEquals(k, v) => C::value(k, CompareOp::Equal, v),
    }
}

fn op_to_etcd(op: TxnOp) -> etcd_client::TxnOp {
    use etcd_client::TxnOp as O;
    match op {
        TxnOp::Put { key, value, lease } => O::put(key, value, lease.map(|id| PutOptions::new().with_lease(id))),
        TxnOp::Delete(key) => O::delete(key, None),
        TxnOp::DeletePrefix(prefix) => O::delete(prefix, Some(DeleteOptions::new().with_prefix())),
    }
}

/// State of an etcd watch as seen through [`WatchStream`].
struct EtcdWatch {
    inner: etcd_client::WatchStream,
    pending: VecDeque<WatchEvent>,
    done: bool,
}

impl EtcdWatch {
    /// The next event, reading more responses from etcd as needed; `None` once finished.
    async fn next_event(&mut self) -> Option<Result<WatchEvent, StoreError>> {
        loop {
            if let Some(ev) = self.pending.pop_front() {
                return Some(Ok(ev));
            }
            if self.done {
                return None;
            }
            match self.inner.message().await {
                Ok(Some(resp)) => {
                    if resp.compact_revision() != 0 {
                        self.done = true;
                        return Some(Err(StoreError::Compacted(resp.compact_revision())));
                    }
                    if resp.canceled() {
                        self.done = true;
                        return Some(Err(StoreError::Unavailable(format!(
                            "etcd canceled the watch: {}",
                            resp.cancel_reason()
                        ))));
                    }
                    for ev in resp.events() {
                        match convert_event(ev) {
                            Some(ev) => self.pending.push_back(ev),
                            None => tracing::warn!("etcd watch event without a key-value; skipped"),
                        }
                    }
                }
                Ok(None) => {
                    self.done = true;
                    return Some(Err(StoreError::Unavailable("etcd closed the watch stream".into())));
                }
                Err(e) => {
                    self.done = true;
                    return Some(Err(map_error(e, None)));
                }
            }
        }
    }
}

impl EtcdStore {
    /// Connects to an etcd cluster (`http://host:port` or `host:port` endpoints) with
    /// [`DEFAULT_REQUEST_TIMEOUT`], and checks that it answers.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the half-made connection.
    pub async fn connect(endpoints: &[String]) -> Result<EtcdStore, StoreError> {
        EtcdStore::connect_with_timeout(endpoints, DEFAULT_REQUEST_TIMEOUT).await
    }

    /// Like [`EtcdStore::connect`], with a per-request deadline of `request_timeout`.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the half-made connection.
    pub async fn connect_with_timeout(
        endpoints: &[String],
        request_timeout: Duration,
    ) -> Result<EtcdStore, StoreError> {
        EtcdStore::connect_secured(endpoints, request_timeout, &EtcdSecurity::default()).await
    }

    /// Like [`EtcdStore::connect_with_timeout`], over TLS and with credentials as `security`
    /// says. Refused before any connection when the settings do not fit the endpoints
    /// ([`EtcdSecurity::check`]); a wrong CA, certificate or password is
    /// [`StoreError::Unavailable`] naming etcd's or the TLS layer's reason.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the half-made connection.
    pub async fn connect_secured(
        endpoints: &[String],
        request_timeout: Duration,
        security: &EtcdSecurity,
    ) -> Result<EtcdStore, StoreError> {
        EtcdStore::connect_tuned(endpoints, request_timeout, security, EtcdTuning::default()).await
    }

    /// Like [`EtcdStore::connect_secured`], with requests shaped by `tuning` (refused before
    /// any connection if [`EtcdTuning::check`] fails).
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the half-made connection.
    pub async fn connect_tuned(
        endpoints: &[String],
        request_timeout: Duration,
        security: &EtcdSecurity,
        tuning: EtcdTuning,
    ) -> Result<EtcdStore, StoreError> {
        tuning.check()?;
        if endpoints.is_empty() {
            return Err(StoreError::Invalid("no etcd endpoints given".into()));
        }
        security.check(endpoints)?;
        let options = security.apply(
            ConnectOptions::new()
                .with_connect_timeout(DEFAULT_CONNECT_TIMEOUT)
                .with_timeout(request_timeout)
                .with_keep_alive(KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT)
                .with_keep_alive_while_idle(true)
                .with_require_leader(true),
        );
        let client = tokio::time::timeout(
            DEFAULT_CONNECT_TIMEOUT,
            Client::connect_with_balanced_channel(endpoints, Some(options), channel::TunedChannel),
        )
        .await
        .map_err(|_| StoreError::Unavailable(format!("connecting to etcd at {endpoints:?} timed out")))?
        .map_err(|e| security.explain(map_error(e, None)))?;
        let batcher = Batcher::start(client.kv_client(), request_timeout, tuning.max_txn_ops);
        let store = EtcdStore {
            client,
            request_timeout,
            batcher,
            keepalives: std::sync::Arc::new(KeepAlives::new()),
            max_txn_ops: tuning.max_txn_ops,
        };
        // The client connects lazily; one status call proves the cluster is there.
        let mut maintenance = store.client.maintenance_client();
        let status = store.call(None, maintenance.status()).await.map_err(|e| security.explain(e))?;
        // Status needs no permission; one read under the coordinator's keys proves that these
        // credentials may read them, so a wrong user or role fails here, at start-up.
        let mut kv = store.client.kv_client();
        let probe = GetOptions::new().with_prefix().with_keys_only().with_limit(1);
        store.call(None, kv.get(crate::keys::ROOT, Some(probe))).await?;
        tracing::debug!(endpoints = ?endpoints, version = status.version(), "connected to etcd");
        Ok(store)
    }

    /// How many requests have shared an etcd transaction so far, on this store and its clones.
    pub fn batch_stats(&self) -> BatchStats {
        self.batcher.stats()
    }

    /// How many leases' keep-alive streams are open between renewals, on this store and its
    /// clones (each member's lease keeps one while it heartbeats through this replica).
    pub fn keep_alive_streams(&self) -> usize {
        self.keepalives.open_streams()
    }

    /// Runs one request under the request deadline and maps its error.
    async fn call<T>(
        &self,
        lease: Option<LeaseId>,
        request: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.request_timeout, request).await {
            Ok(result) => result.map_err(|e| map_error(e, lease)),
            Err(_) => Err(StoreError::Unavailable(format!("etcd request timed out after {:?}", self.request_timeout))),
        }
    }
}

#[async_trait::async_trait]
impl Store for EtcdStore {
    fn request_batching(&self) -> Option<BatchStats> {
        Some(self.batcher.stats())
    }

    fn max_txn_ops(&self) -> Option<usize> {
        Some(self.max_txn_ops)
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        check_key(key)?;
        match self.batcher.submit(Request::Get(key.to_string())).await? {
            Reply::Get(kv) => Ok(kv),
            other => Err(unexpected(other)),
        }
    }

    async fn get_prefix(&self, prefix: &str) -> Result<(Vec<KeyValue>, i64), StoreError> {
        let mut kv = self.client.kv_client().max_decoding_message_size(batch::MAX_READ_ANSWER);
        let resp = self.call(None, kv.get(prefix, Some(GetOptions::new().with_prefix()))).await?;
        let revision = header_revision(resp.header())?;
        Ok((resp.kvs().iter().map(convert_kv).collect(), revision))
    }

    async fn count_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
        let mut kv = self.client.kv_client();
        let resp = self.call(None, kv.get(prefix, Some(GetOptions::new().with_prefix().with_count_only()))).await?;
        Ok(u64::try_from(resp.count()).unwrap_or(0))
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<i64, StoreError> {
        check_key(key)?;
        match self.batcher.submit(Request::Put { key: key.to_string(), value, lease }).await? {
            Reply::Put(revision) => Ok(revision),
            other => Err(unexpected(other)),
        }
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        check_key(key)?;
        let mut kv = self.client.kv_client();
        let resp = self.call(None, kv.delete(key, None)).await?;
        Ok(resp.deleted() > 0)
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
        let mut kv = self.client.kv_client();
        let resp = self.call(None, kv.delete(prefix, Some(DeleteOptions::new().with_prefix()))).await?;
        Ok(u64::try_from(resp.deleted()).unwrap_or(0))
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResult, StoreError> {
        if Request::batchable_txn(&txn) {
            return match self.batcher.submit(Request::Txn(txn)).await? {
                Reply::Txn(result) => Ok(result),
                other => Err(unexpected(other)),
            };
        }
        // The lease named in an error is the first one the transaction attaches keys to.
        let lease = txn.success.iter().chain(&txn.failure).find_map(|op| match op {
            TxnOp::Put { lease, .. } => *lease,
            _ => None,
        });
        let mut kv = self.client.kv_client();
        let resp = self.call(lease, kv.txn(batch::to_etcd(txn))).await?;
        Ok(TxnResult { succeeded: resp.succeeded(), revision: header_revision(resp.header())? })
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, StoreError> {
        let secs =
            i64::try_from(ttl_seconds(ttl)?).map_err(|_| StoreError::Invalid("lease TTL out of range".into()))?;
        let mut leases = self.client.lease_client();
        let resp = self.call(None, leases.grant(secs, None)).await?;
        if !resp.error().is_empty() {
            return Err(StoreError::Invalid(format!("etcd refused the lease: {}", resp.error())));
        }
        tracing::debug!(lease = resp.id(), ttl_s = resp.ttl(), "etcd lease granted");
        Ok(resp.id())
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<(), StoreError> {
        // On the lease's kept keep-alive stream (`keepalive.rs`): one message each way.
        self.keepalives.renew(&self.client, lease, self.request_timeout).await
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<(), StoreError> {
        let mut leases = self.client.lease_client();
        match self.call(Some(lease), leases.revoke(lease)).await {
            Ok(_) | Err(StoreError::LeaseNotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn lease_time_to_live(&self, lease: LeaseId) -> Result<Option<Duration>, StoreError> {
        let mut leases = self.client.lease_client();
        match self.call(Some(lease), leases.time_to_live(lease, None)).await {
            // etcd answers TTL -1 for an unknown lease.
            Ok(resp) => Ok(u64::try_from(resp.ttl()).ok().map(Duration::from_secs)),
            Err(StoreError::LeaseNotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn watch_prefix(&self, prefix: &str, from_revision: i64) -> Result<WatchStream, StoreError> {
        let mut options = WatchOptions::new().with_prefix();
        if from_revision > 0 {
            options = options.with_start_revision(from_revision);
        }
        // A catching-up watch gets many revisions' events in one message.
        let mut watches = self.client.watch_client().max_decoding_message_size(batch::MAX_READ_ANSWER);
        let mut inner = self.call(None, watches.watch(prefix, Some(options))).await?;
        // Wait for etcd to confirm the watch, so that it covers every change made after this
        // call returns.
        let first = self.call(None, inner.message()).await?;
        let mut watch = EtcdWatch { inner, pending: VecDeque::new(), done: false };
        match first {
            None => return Err(StoreError::Unavailable("etcd closed the watch stream at creation".into())),
            Some(resp) if resp.compact_revision() != 0 => return Err(StoreError::Compacted(resp.compact_revision())),
            Some(resp) if resp.canceled() => {
                return Err(StoreError::Unavailable(format!("etcd refused the watch: {}", resp.cancel_reason())));
            }
            Some(resp) => {
                watch.pending.extend(resp.events().iter().filter_map(convert_event));
            }
        }
        tracing::debug!(prefix, from_revision, "etcd watch created");
        let stream =
            futures::stream::unfold(
                watch,
                |mut watch| async move { watch.next_event().await.map(|item| (item, watch)) },
            );
        Ok(stream.boxed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_store_errors() {
        let status = |code, msg: &str| etcd_client::Error::GRpcStatus(tonic::Status::new(code, msg));
        let lease_gone = || status(tonic::Code::NotFound, "etcdserver: requested lease not found");
        assert!(matches!(map_error(lease_gone(), Some(7)), StoreError::LeaseNotFound(7)));
        assert!(matches!(map_error(lease_gone(), None), StoreError::Invalid(_)));
        assert!(matches!(
            map_error(etcd_client::Error::LeaseKeepAliveError("lease not found".into()), Some(9)),
            StoreError::LeaseNotFound(9)
        ));
        assert!(matches!(
            map_error(status(tonic::Code::InvalidArgument, "etcdserver: duplicate key given in txn request"), None),
            StoreError::Invalid(_)
        ));
        assert!(matches!(
            map_error(status(tonic::Code::Unavailable, "etcdserver: no leader"), None),
            StoreError::Unavailable(_)
        ));
        assert!(matches!(
            map_error(status(tonic::Code::DeadlineExceeded, "timeout"), Some(3)),
            StoreError::Unavailable(_)
        ));
        assert!(matches!(map_error(etcd_client::Error::WatchError("closed".into()), None), StoreError::Unavailable(_)));
    }
}
