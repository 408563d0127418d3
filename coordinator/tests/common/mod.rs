//! Shared harness for the coordinator's service tests: in-process replicas on free loopback
//! ports over a memory store or a private etcd, and a minimal worker (tonic client).
#![allow(dead_code)]

pub(crate) mod certs;
pub(crate) mod gate;

use cohort_coordinator::config::{JobSettings, Settings};
use cohort_coordinator::exclusion::ExclusionPolicy;
use cohort_coordinator::server::{ServeConfig, ServerHandle};
use cohort_coordinator::store::{etcd::EtcdStore, memory::MemoryStore, Store};
use cohort_proto::v1 as pb;
use cohort_proto::v1::coordinator_client::CoordinatorClient;
use cohort_testkit::etcd::EtcdProcess;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::Channel;

/// Every test body runs under this bound.
pub(crate) const BOUND: Duration = Duration::from_secs(90);

/// Runs a test body under [`BOUND`].
pub(crate) async fn bounded<F: std::future::Future<Output = ()>>(test: F) {
    tokio::time::timeout(BOUND, test).await.expect("test exceeded its time bound");
}

/// Which store a test runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Backend {
    /// The embedded store.
    Memory,
    /// A private etcd started for the test.
    Etcd,
}

/// Short settings for tests. etcd rounds leases up to about 2 s, so its TTL is longer.
pub(crate) fn test_settings(backend: Backend) -> JobSettings {
    JobSettings {
        min_workers: 1,
        max_workers: 64,
        join_window: Duration::from_millis(200),
        heartbeat_interval: Duration::from_millis(100),
        lease_ttl: match backend {
            Backend::Memory => Duration::from_secs(1),
            Backend::Etcd => Duration::from_secs(2),
        },
        elastic_timeout: Duration::from_secs(2),
        ..Default::default()
    }
}

/// A store (and the etcd behind it, kept alive).
pub(crate) struct Backing {
    pub store: Arc<dyn Store>,
    pub etcd: Option<EtcdProcess>,
    /// The memory store behind `store` (a clone sharing its state), on that backend.
    pub memory: Option<MemoryStore>,
}

impl Backing {
    pub(crate) async fn new(backend: Backend) -> Self {
        match backend {
            Backend::Memory => {
                let memory = MemoryStore::new();
                Backing { store: Arc::new(memory.clone()), etcd: None, memory: Some(memory) }
            }
            Backend::Etcd => {
                let etcd = tokio::task::spawn_blocking(EtcdProcess::start)
                    .await
                    .expect("etcd start task")
                    .unwrap_or_else(|e| panic!("cannot start etcd: {e}"));
                let store = EtcdStore::connect(&[etcd.endpoint()]).await.expect("connect to etcd");
                Backing { store: Arc::new(store), etcd: Some(etcd), memory: None }
            }
        }
    }

    /// How many leases the store holds now (etcd's `LeaseLeases`, or the memory store's own
    /// count).
    pub(crate) async fn live_leases(&self) -> usize {
        if let Some(memory) = &self.memory {
            return memory.live_leases();
        }
        let etcd = self.etcd.as_ref().expect("an etcd backing");
        let mut client = etcd_client::Client::connect([etcd.endpoint()], None).await.expect("connect to etcd");
        client.leases().await.expect("list etcd's leases").leases().len()
    }
}

/// Options of a test replica.
#[derive(Clone)]
pub(crate) struct Options {
    pub settings: JobSettings,
    pub token: Option<String>,
    /// Operator secrets being rotated out (still accepted).
    pub previous_tokens: Vec<String>,
    pub exclusion: ExclusionPolicy,
    pub leader_ttl: Duration,
    /// How long ended jobs' records are kept.
    pub ended_ttl: Duration,
    pub name: Option<String>,
}

impl Options {
    pub(crate) fn new(settings: JobSettings) -> Self {
        Self {
            settings,
            token: None,
            previous_tokens: Vec::new(),
            exclusion: ExclusionPolicy::default(),
            leader_ttl: Duration::from_secs(2),
            ended_ttl: cohort_coordinator::ops::ENDED_TTL,
            name: None,
        }
    }
}

/// Starts a replica on a free loopback port.
pub(crate) async fn replica(store: Arc<dyn Store>, options: &Options) -> ServerHandle {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let mut config = ServeConfig::new(store, Settings::uniform(options.settings).expect("valid settings"));
    config.token = options.token.clone();
    config.previous_tokens = options.previous_tokens.clone();
    config.exclusion = options.exclusion;
    config.leader_ttl = options.leader_ttl;
    config.ended_ttl = options.ended_ttl;
    config.replica_name = options.name.clone();
    config.metrics = Some(tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind metrics"));
    cohort_coordinator::start(config, listener).await.expect("start replica")
}

/// A gRPC client of one replica.
pub(crate) async fn client(addr: SocketAddr) -> CoordinatorClient<Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("connect");
    CoordinatorClient::new(channel)
}

/// A join request with a plausible address.
pub(crate) fn join_request(job: &str, worker: &str) -> pb::JoinRequest {
    pb::JoinRequest {
        job: job.into(),
        worker_id: worker.into(),
        host: format!("host-{worker}"),
        addresses: vec![pb::TransportAddress { transport: "tcp".into(), address: "127.0.0.1:40000".into() }],
        capabilities: vec!["transport:tcp".into()],
        protocol_version: cohort_proto::PROTOCOL_VERSION,
        domain: String::new(),
        replaces: 0,
    }
}

/// A test worker: one incarnation, heartbeating in the background until dropped or stopped.
pub(crate) struct Worker {
    pub client: CoordinatorClient<Channel>,
    pub job: String,
    pub id: String,
    pub incarnation: u64,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop_heartbeats();
    }
}

impl Worker {
    /// Joins and starts heartbeating every `interval`.
    pub(crate) async fn join(addr: SocketAddr, job: &str, id: &str, interval: Duration) -> Worker {
        Worker::join_with(addr, join_request(job, id), interval).await
    }

    /// Joins `n` workers `w0`, `w1`, ... to `job`, one after the other, each on a connection
    /// of its own (as separate processes are), heartbeating every `interval`.
    pub(crate) async fn join_many(addr: SocketAddr, job: &str, n: usize, interval: Duration) -> Vec<Worker> {
        let mut workers = Vec::with_capacity(n);
        for i in 0..n {
            workers.push(Worker::join(addr, job, &format!("w{i}"), interval).await);
        }
        workers
    }

    /// Joins with `request` (its job and worker id) and starts heartbeating every `interval`.
    pub(crate) async fn join_with(addr: SocketAddr, request: pb::JoinRequest, interval: Duration) -> Worker {
        let id = request.worker_id.clone();
        Worker::try_join_with(addr, request, interval).await.unwrap_or_else(|s| panic!("join {id}: {s}"))
    }

    /// As [`Worker::join_with`], the refusal returned.
    pub(crate) async fn try_join_with(
        addr: SocketAddr,
        request: pb::JoinRequest,
        interval: Duration,
    ) -> Result<Worker, tonic::Status> {
        let mut client = client(addr).await;
        let (job, id) = (request.job.clone(), request.worker_id.clone());
        let response = client.join(request).await?.into_inner();
        let mut w = Worker { client, job, id, incarnation: response.incarnation, heartbeat: None };
        w.start_heartbeats(interval);
        Ok(w)
    }

    /// Joins with `request` over `client` (a connection other workers may share), with no
    /// heartbeats.
    pub(crate) async fn join_on(
        mut client: CoordinatorClient<Channel>,
        request: pb::JoinRequest,
    ) -> Result<Worker, tonic::Status> {
        let (job, id) = (request.job.clone(), request.worker_id.clone());
        let response = client.join(request).await?.into_inner();
        Ok(Worker { client, job, id, incarnation: response.incarnation, heartbeat: None })
    }

    pub(crate) fn start_heartbeats(&mut self, interval: Duration) {
        let mut c = self.client.clone();
        let request = pb::HeartbeatRequest {
            job: self.job.clone(),
            worker_id: self.id.clone(),
            incarnation: self.incarnation,
            generation: 0,
            step: 0,
            activity: "test".into(),
            deadlines: String::new(),
            timing: None,
        };
        self.heartbeat = Some(tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                if let Err(s) = c.heartbeat(request.clone()).await {
                    if s.code() == tonic::Code::NotFound {
                        return;
                    }
                }
            }
        }));
    }

    pub(crate) fn stop_heartbeats(&mut self) {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
    }

    /// One rendezvous long poll.
    pub(crate) async fn rendezvous(&self, after: u64, wait: Duration) -> Result<pb::RendezvousResponse, tonic::Status> {
        let mut c = self.client.clone();
        c.rendezvous(pb::RendezvousRequest {
            job: self.job.clone(),
            worker_id: self.id.clone(),
            incarnation: self.incarnation,
            after_generation: after,
            wait_ms: wait.as_millis() as u64,
            compact: false,
            partners: false,
            layout: false,
        })
        .await
        .map(|r| r.into_inner())
    }

    /// Long polls until a generation is formed (panics on an end or an error).
    pub(crate) async fn next_generation(&self, after: u64) -> pb::Generation {
        loop {
            match self
                .rendezvous(after, Duration::from_secs(5))
                .await
                .unwrap_or_else(|s| panic!("rendezvous {}: {s}", self.id))
                .outcome
            {
                Some(pb::rendezvous_response::Outcome::Formed(g)) => return g,
                Some(pb::rendezvous_response::Outcome::Waiting(_)) => continue,
                other => panic!("{}: unexpected rendezvous outcome {other:?}", self.id),
            }
        }
    }

    pub(crate) async fn report(
        &self,
        generation: u64,
        failed_rank: Option<u32>,
        reason: &str,
    ) -> Result<pb::FailureReportResponse, tonic::Status> {
        self.report_kind(generation, failed_rank, reason, pb::failure_report::FailureKind::Unspecified).await
    }

    pub(crate) async fn report_kind(
        &self,
        generation: u64,
        failed_rank: Option<u32>,
        reason: &str,
        kind: pb::failure_report::FailureKind,
    ) -> Result<pb::FailureReportResponse, tonic::Status> {
        self.report_with(generation, failed_rank, reason, kind, None).await
    }

    /// Reports a failure of `kind` carrying the reporter's progress in the failed operation.
    pub(crate) async fn report_with(
        &self,
        generation: u64,
        failed_rank: Option<u32>,
        reason: &str,
        kind: pb::failure_report::FailureKind,
        progress: Option<pb::OpProgress>,
    ) -> Result<pb::FailureReportResponse, tonic::Status> {
        let mut c = self.client.clone();
        c.report_failure(pb::FailureReport {
            job: self.job.clone(),
            worker_id: self.id.clone(),
            incarnation: self.incarnation,
            generation,
            failed_rank,
            reason: reason.into(),
            kind: kind as i32,
            progress,
        })
        .await
        .map(|r| r.into_inner())
    }

    pub(crate) async fn watch(&self) -> tonic::Streaming<pb::JobEvent> {
        self.watch_with(false).await
    }

    /// The member's watch; `quiet`: the state once, then no events (a host relay's member).
    pub(crate) async fn watch_with(&self, quiet: bool) -> tonic::Streaming<pb::JobEvent> {
        let mut c = self.client.clone();
        c.watch(pb::WatchRequest {
            job: self.job.clone(),
            worker_id: self.id.clone(),
            incarnation: self.incarnation,
            compact: false,
            quiet,
        })
        .await
        .expect("watch")
        .into_inner()
    }

    pub(crate) async fn leave(&self, finished: bool) -> Result<(), tonic::Status> {
        let mode = if finished { pb::leave_request::Mode::Finished } else { pb::leave_request::Mode::Graceful };
        let mut c = self.client.clone();
        c.leave(pb::LeaveRequest {
            job: self.job.clone(),
            worker_id: self.id.clone(),
            incarnation: self.incarnation,
            mode: mode as i32,
        })
        .await
        .map(|_| ())
    }

    pub(crate) async fn commit(&self, generation: u64, step: u64) -> Result<pb::CommitResponse, tonic::Status> {
        self.commit_digest(generation, step, vec![0xab; 32]).await
    }

    pub(crate) async fn commit_digest(
        &self,
        generation: u64,
        step: u64,
        digest: Vec<u8>,
    ) -> Result<pb::CommitResponse, tonic::Status> {
        let mut c = self.client.clone();
        c.commit(pb::CommitRequest {
            job: self.job.clone(),
            worker_id: self.id.clone(),
            incarnation: self.incarnation,
            generation,
            step,
            digest,
        })
        .await
        .map(|r| r.into_inner())
    }
}

/// Forms the first generation of `workers` (all rendezvous concurrently).
pub(crate) async fn form_all(workers: &[Worker], after: u64) -> Vec<pb::Generation> {
    let polls = workers.iter().map(|w| w.next_generation(after));
    futures::future::join_all(polls).await
}

/// The next event of a watch stream, bounded.
pub(crate) async fn next_event(stream: &mut tonic::Streaming<pb::JobEvent>) -> pb::job_event::Event {
    loop {
        let message = tokio::time::timeout(Duration::from_secs(20), stream.message())
            .await
            .expect("no watch event within 20 s")
            .expect("watch stream error")
            .expect("watch stream ended");
        // An empty event is a new stream's first message when the job has no state yet.
        if let Some(event) = message.event {
            return event;
        }
    }
}

/// Reads events until one matches `pick`, bounded.
pub(crate) async fn wait_event<T>(
    stream: &mut tonic::Streaming<pb::JobEvent>,
    mut pick: impl FnMut(&pb::job_event::Event) -> Option<T>,
) -> T {
    loop {
        let e = next_event(stream).await;
        if let Some(t) = pick(&e) {
            return t;
        }
    }
}

pub(crate) async fn status(addr: SocketAddr, job: &str) -> pb::StatusResponse {
    client(addr).await.status(pb::StatusRequest { job: job.into() }).await.expect("status").into_inner()
}

/// The coordinator binary built with these tests.
pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_cohort-coordinator");

/// A `cohort-coordinator` process, killed on drop.
pub(crate) struct Running(pub(crate) Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cohort-coordinator` with `args` and returns it with the address it printed.
pub(crate) fn spawn(args: &[&str]) -> (Running, std::net::SocketAddr) {
    let mut child = Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn cohort-coordinator");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let running = Running(child);
    // Its `listening on` line (after a `metrics on` one, when it serves metrics).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let addr = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let line = rx.recv_timeout(left).expect("no 'listening' line within 20 s");
        match cohort_coordinator::announce::parse(&line) {
            Some(cohort_coordinator::announce::Announced::Listening(addr)) => break addr,
            Some(cohort_coordinator::announce::Announced::Metrics(_)) => continue,
            None => panic!("unexpected line {line:?}"),
        }
    };
    (running, addr)
}
