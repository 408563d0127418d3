//! Running a coordinator replica: the gRPC service (with the token check and gRPC health),
//! the leader election, and the metrics endpoint, on listeners the caller binds (so tests
//! and benchmarks can run replicas in-process on free ports).

use crate::auth::TokenCheck;
use crate::config::ExclusionPolicy;
use crate::config::Settings;
use crate::hub::Hubs;
use crate::metrics::{self, Metrics};
use crate::ops::Context;
/// Where a replica gathers timeout cascades (a field of [`ServeConfig`]).
pub use crate::service::CascadeScope;
use crate::service::CoordinatorService;
use crate::status_page::StatusPage;
use crate::store::Store;
use cohort_proto::v1::coordinator_server::CoordinatorServer;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The gRPC service name health probes ask about.
pub const SERVICE_NAME: &str = "cohort.v1.Coordinator";

/// Errors starting or running a replica.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A listener could not be used.
    #[error("listener: {0}")]
    Io(#[from] std::io::Error),
    /// TLS material was refused.
    #[error("TLS: {0}")]
    Tls(String),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The configuration is unusable.
    #[error("configuration: {0}")]
    Config(String),
    /// A task of the replica panicked or was cancelled.
    #[error("replica task failed: {0}")]
    Task(String),
}

/// A server certificate and key (PEM).
#[derive(Clone)]
pub struct TlsFiles {
    /// Certificate chain, PEM.
    pub cert_pem: Vec<u8>,
    /// Private key, PEM.
    pub key_pem: Vec<u8>,
}

/// Everything a replica needs.
pub struct ServeConfig {
    /// The store (shared by every replica of a deployment).
    pub store: Arc<dyn Store>,
    /// Job settings.
    pub settings: Settings,
    /// The operator secret, if any: every RPC must then carry it or a job credential derived
    /// from it (`cohort_proto::credentials`).
    pub token: Option<String>,
    /// Operator secrets being rotated out: still accepted, with their job credentials.
    pub previous_tokens: Vec<String>,
    /// TLS for the gRPC listener, if any.
    pub tls: Option<TlsFiles>,
    /// A listener for `GET /metrics` and the status page (`GET /`), if any.
    pub metrics: Option<TcpListener>,
    /// This replica's name in the leader key (default: `<hostname>/<pid>/<address>`).
    pub replica_name: Option<String>,
    /// The leader lease TTL (default 3 s).
    pub leader_ttl: Duration,
    /// When repeated failures exclude a worker.
    pub exclusion: ExclusionPolicy,
    /// How long an ended job's `ended` record is kept for late callers (default 10 min).
    pub ended_ttl: Duration,
    /// Where timeout cascades are gathered (default [`CascadeScope::Store`]; the other
    /// value restores a fixed bug, for the simulation's regression test only).
    pub cascade_scope: CascadeScope,
}

impl ServeConfig {
    /// A configuration with defaults: no token, no TLS, no metrics, leader TTL 3 s.
    pub fn new(store: Arc<dyn Store>, settings: Settings) -> Self {
        Self {
            store,
            settings,
            token: None,
            previous_tokens: Vec::new(),
            tls: None,
            metrics: None,
            replica_name: None,
            leader_ttl: Duration::from_secs(3),
            exclusion: ExclusionPolicy::default(),
            ended_ttl: crate::ops::ENDED_TTL,
            cascade_scope: CascadeScope::Store,
        }
    }
}

/// A running replica.
pub struct ServerHandle {
    local_addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    shutdown: watch::Sender<bool>,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    leader: JoinHandle<()>,
    metrics_task: Option<JoinHandle<()>>,
    leading: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    health: tonic_health::server::HealthReporter,
}

impl ServerHandle {
    /// The gRPC address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The metrics address, if serving metrics.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Whether this replica leads now.
    pub fn is_leader(&self) -> bool {
        self.leading.load(Ordering::SeqCst)
    }

    /// This replica's metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Stops gracefully: resigns leadership, marks health NOT_SERVING, ends long polls and
    /// watch streams (clients move to another replica), and waits (at most 10 s) for the
    /// server to stop.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropping it midway leaves tasks to finish on their own.
    pub async fn shutdown(self) -> Result<(), ServeError> {
        self.health.set_service_status("", tonic_health::ServingStatus::NotServing).await;
        self.health.set_service_status(SERVICE_NAME, tonic_health::ServingStatus::NotServing).await;
        let _ = self.shutdown.send(true);
        let bound = Duration::from_secs(10);
        let mut leader = self.leader;
        if tokio::time::timeout(bound, &mut leader).await.is_err() {
            leader.abort();
        }
        if let Some(task) = self.metrics_task {
            task.abort();
        }
        let mut server = self.server;
        match tokio::time::timeout(bound, &mut server).await {
            Ok(Ok(result)) => result.map_err(ServeError::from),
            Ok(Err(e)) => Err(ServeError::Task(e.to_string())),
            Err(_) => {
                server.abort();
                Err(ServeError::Task("the gRPC server did not stop within 10 s".into()))
            }
        }
    }

    /// Stops abruptly, as a crash looks to the other replicas: leadership is *not* resigned
    /// (it passes when the lease expires); connections are closed.
    pub fn kill(self) {
        self.leader.abort();
        let _ = self.shutdown.send(true);
        self.server.abort();
        if let Some(task) = self.metrics_task {
            task.abort();
        }
    }
}

fn default_name(addr: SocketAddr) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into());
    format!("{host}/{}/{addr}", std::process::id())
}

/// Starts a replica on `listener`; returns once it accepts connections.
///
/// # Cancel safety
/// Cancel safe: before it returns nothing has been spawned that outlives it except tasks
/// that stop when their channels close.
pub async fn start(config: ServeConfig, listener: TcpListener) -> Result<ServerHandle, ServeError> {
    let local_addr = listener.local_addr()?;
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    start_with_incoming(config, incoming, local_addr).await
}

/// Starts a replica that serves the connections `incoming` yields (any byte stream tonic
/// can serve, e.g. the simulated network's in `sim/`); `local_addr` is the address it is
/// known by. Returns once it accepts connections. [`start`] is this over a TCP listener.
///
/// # Cancel safety
/// Cancel safe, as [`start`].
pub async fn start_with_incoming<I, IO, IE>(
    config: ServeConfig,
    incoming: I,
    local_addr: SocketAddr,
) -> Result<ServerHandle, ServeError>
where
    I: futures::Stream<Item = Result<IO, IE>> + Send + 'static,
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + tonic::transport::server::Connected + Unpin + Send + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    if config.leader_ttl < Duration::from_secs(1) || config.leader_ttl > Duration::from_secs(60) {
        return Err(ServeError::Config(format!(
            "leader TTL {:?} is outside 1s..=60s (store leases count whole seconds)",
            config.leader_ttl
        )));
    }
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let metrics = Arc::new(Metrics::default());
    metrics.watch_store(config.store.clone());
    let replica = config.replica_name.clone().unwrap_or_else(|| default_name(local_addr));
    let ctx = Arc::new(Context {
        store: config.store.clone(),
        settings: config.settings.clone(),
        exclusion: config.exclusion,
        metrics: metrics.clone(),
        hubs: Hubs::new(config.store.clone()),
        replica,
        shutdown: shutdown_rx.clone(),
        ended_ttl: config.ended_ttl,
    });
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_service_status("", tonic_health::ServingStatus::Serving).await;
    health.set_service_status(SERVICE_NAME, tonic_health::ServingStatus::Serving).await;
    let tokens = TokenCheck::new(&config.token.iter().chain(&config.previous_tokens).cloned().collect::<Vec<_>>());
    let coordinator = CoordinatorService::new(ctx.clone()).with_cascade_scope(config.cascade_scope);
    // The status page reads through a clone of the service: the same caches (this replica's
    // newer progress), the same store.
    let page = Arc::new(StatusPage::new(coordinator.clone(), tokens.clone(), ctx.replica.clone()));
    let service = CoordinatorServer::with_interceptor(coordinator, tokens);
    let mut builder = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)));
    if let Some(tls) = &config.tls {
        let identity = tonic::transport::Identity::from_pem(&tls.cert_pem, &tls.key_pem);
        builder = builder
            .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
            .map_err(|e| ServeError::Tls(e.to_string()))?;
    }
    let router = builder.add_service(health_service).add_service(service);
    let mut stop = shutdown_rx.clone();
    let server = tokio::spawn(async move {
        router
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await
    });
    let leading = Arc::new(AtomicBool::new(false));
    let leader = tokio::spawn(crate::leader::run(ctx.clone(), config.leader_ttl, leading.clone()));
    let mut metrics_addr = None;
    let metrics_task = match config.metrics {
        Some(l) => {
            metrics_addr = Some(l.local_addr()?);
            let (mut stop, census_stop) = (shutdown_rx.clone(), shutdown_rx.clone());
            let page_protected = page.protected();
            let serving = metrics::serve_metrics(l, metrics.clone(), Some(page), async move {
                let _ = stop.wait_for(|s| *s).await;
            });
            let census = metrics::store_census(config.store.clone(), metrics.clone(), census_stop);
            if let Some(addr) = metrics_addr.filter(|a| !a.ip().is_loopback()) {
                let credential = if page_protected { "needs a credential, which travels" } else { "shows every job" };
                tracing::info!(%addr, "the status page on the metrics listener is plain HTTP and {credential} in the clear: \
                                       keep the listener on a private network (deploy/README.md, \"The status page\")");
            }
            Some(tokio::spawn(async move {
                tokio::join!(serving, census);
            }))
        }
        None => None,
    };
    tracing::info!(%local_addr, replica = %ctx.replica, tls = config.tls.is_some(), token = config.token.is_some(), "coordinator serving");
    Ok(ServerHandle {
        local_addr,
        metrics_addr,
        shutdown: shutdown_tx,
        server,
        leader,
        metrics_task,
        leading,
        metrics,
        health,
    })
}

/// Runs a replica on `listener` until `shutdown` resolves, then stops it gracefully.
///
/// # Cancel safety
/// Not cancel safe: dropping it leaves the replica's tasks running until they notice.
pub async fn serve(
    config: ServeConfig,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ServeError> {
    let handle = start(config, listener).await?;
    shutdown.await;
    handle.shutdown().await
}
