//! Scale harness of the control plane: N members of the shipped worker
//! (`cohort::elastic::ElasticGroup`) against real `cohort-coordinator` replica processes, on the
//! memory store or on a real etcd (a private `etcd` on free loopback ports, with two replicas
//! sharing it).
//!
//! Every member is the worker users run, in this process: `ElasticGroup::join_with` with a
//! data plane that publishes a TCP and a shared-memory address (as `--transport auto` does)
//! and connects nothing ([`NullPlane`]), and an observer ([`Seen`], the group's `World`) that
//! timestamps what the member's shell hears. Everything else is production's code: the join
//! and its retries, the sparse rendezvous, the heartbeat task at the coordinators' interval,
//! the watch, the hosts' heartbeat and event relays (abstract Unix sockets named after the job
//! and the host, served by the first member of each host, as on a real node), failure
//! reports and re-formation. Each member has a coordinator client (an HTTP/2 connection) of its
//! own, as each worker process has, the clients spread over the replicas
//! (`--members-per-connection N` shares one among N members: cheaper for this process, but a
//! loaded coordinator then closes a connection that many members' calls gave up on at once,
//! with HTTP/2's flood protection, which no worker process meets alone).
//!
//! One run, per store:
//!
//! 1. **formation**: every member joins (at most [`JOIN_CONCURRENCY`] joins in flight) and
//!    calls `next_generation`; `join_to_formed_ms` runs from the first join until every
//!    member holds generation 1 (`max_workers` = N, so it forms as soon as every member
//!    waits). Members are on hosts of `--ranks-per-host` R (default 8) consecutive indices;
//!    with R > 1 they use the host relays, as workers on one node do (`heartbeat_relay`).
//!    Heartbeats flow from each member's join on, at the coordinators' interval
//!    (`--heartbeat-ms`, default theirs, 500 ms);
//! 2. **watching** (untimed for the phases after it, reported as `watching_ms`): until every
//!    member has heard generation 1 on its events (its own stream, or its host's relay);
//! 3. **failure**: rank 0 reports the last rank failed (`FailureReporter::on_failure`, as a
//!    worker does when a link breaks), after that member's group is dropped (its process is
//!    gone); `report_ms` is the report's round trip, `revoked_min/p50/p99/max_ms` the times
//!    from the report until each member's shell hears the revocation. One more member, rank 1,
//!    dies *during the re-formation*: on hearing the revocation its group is dropped (the
//!    coordinator sees its control stream close);
//! 4. **re-formation**: the other survivors call `next_generation` on hearing the revocation;
//!    `reformed_ms` runs from the report until every one of them holds generation 2, which
//!    must leave out both the failed rank and the one that died meanwhile;
//! 5. **steady** (optional, `--steady-secs`): every survivor records its step timings
//!    (`ElasticGroup::record_step`: compute and collective time, the waits on its two ring
//!    neighbours' links), which its heartbeats carry; one member in the middle of the ring
//!    computes three times as long as the others. `heartbeats_per_s` is the rate of members'
//!    beats answered (`beats_failed` counts the others over the whole run), `steady_cpu_pct`
//!    the coordinators' CPU (on etcd also `etcd_steady_cpu_pct`, etcd's, and
//!    `etcd_steady_per_s`, its requests per second by method), and `straggler_named_ms` the
//!    time from the first timed step until a member hears the slow one named a straggler (the
//!    run fails if it is never named, or another is);
//! 6. **finish**: the job's end, as a training run's: every survivor calls
//!    `ElasticGroup::leave(finished)` at once; `finish_ms` runs from the first call until the
//!    last answer, `leaves_refused` counts the calls that failed (the run then fails, after
//!    printing its line), and the job must have ended: a Join afterwards is refused with the
//!    job's end.
//!
//! Each generation is checked: one size and number everywhere, every rank once, and every
//! entry any member holds (its partners and host-mates in a sparse view, everyone in a whole
//! one) the same member in every view. `fetched_per_member` is the mean number of entries a
//! member holds. `overran` counts coordinator calls that outlasted every bound of their
//! client (the shell gave them up; never expected).
//!
//! For each phase it prints the coordinators' CPU time (`/proc/PID/stat`, all replicas
//! together), and at the end their peak resident memory (`VmHWM`) and, on etcd, what etcd
//! wrote (`etcd_disk_wal_write_bytes_total`, puts, proposals, gRPC bytes received, from its
//! `/metrics`). Output lines are `key=value`, e.g.
//!
//! ```text
//! scale store=etcd members=1024 replicas=2 join_to_formed_ms=.. revoked_p50_ms=.. revoked_p99_ms=.. reformed_ms=.. ...
//! ```
//!
//! **The harness shares the machine.** The members run in this process on the cores the
//! coordinators and etcd use: every member's heartbeats, watch and relay hops are real work
//! here (a host's relay is a task of this process, not a process of its own host), so the
//! figures are an upper bound on what the coordinators cost a job of that size.
//!
//! Run it with `cargo bench -p cohort-coordinator --bench scale -- --members 1024`
//! (`--stores memory,etcd`, `--replicas 2`, `--steady-secs 5`, `--ranks-per-host 8`,
//! `--whole-answer-up-to N` (the coordinators' flag; the smoke run uses 16),
//! `--heartbeat-ms N` (the coordinators' heartbeat interval; the lease is six intervals, as
//! by default), `--etcd-max-txn-ops 1024`: etcd and the coordinators run with that limit on a
//! transaction's operations; `--lease-scope host`: the coordinators put each host's members on
//! one store lease; `--members-per-connection N`; `--join-concurrency N`: joins in flight at once, 256 by default; release
//! build). Without `--bench` on its command line (`cargo test --benches`, which the test
//! command runs) it is a 96-member smoke version on the memory store, with a 2 s steady phase.
//! Targets are reported in docs/benchmarks.md ("Scale"), never asserted here; every wait has a
//! deadline (`--bound-secs`, default 300), so a stuck coordinator fails the run instead of
//! hanging it. `COHORT_SCALE_LOG=PREFIX` keeps each replica's log (at `info`) in `PREFIX.0`,
//! `PREFIX.1`, ...; `COHORT_SCALE_COORDINATOR=PATH` runs another build of
//! `cohort-coordinator` (an older commit's, for a before-and-after in one sitting).

use cohort::control::{ControlClient, ControlConfig};
use cohort::elastic::{
    Connected, DataPlane, ElasticConfig, ElasticError, ElasticGroup, Formed, Generation, JobId, MeshKind, Observed,
    WorkerId, World,
};
use cohort::CommError;
use cohort_proto::progress::{Progress, Total};
use cohort_proto::v1 as pb;
use cohort_testkit::etcd::EtcdProcess;
use pb::job_event::Event;
use std::collections::HashMap;
use std::io::{BufRead, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// The members share this machine's cores with the coordinators they measure:
/// the same allocator as the coordinator's binary keeps their share small.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Joins in flight at once, by default (`--join-concurrency`).
const JOIN_CONCURRENCY: usize = 256;
/// Bound on starting a coordinator or etcd.
const START_BOUND: Duration = Duration::from_secs(60);
/// Ranks per host, by default (hosts of 8, as GPU nodes have).
const RANKS_PER_HOST: usize = 8;
/// The coordinators' default heartbeat interval (`JobSettings::default`).
const DEFAULT_HEARTBEAT: Duration = Duration::from_millis(500);
/// The job.
const JOB: &str = "scale";

/// What to run.
#[derive(Clone, Debug)]
struct Plan {
    members: usize,
    stores: Vec<String>,
    replicas: usize,
    steady: Duration,
    bound: Duration,
    /// etcd's `--max-txn-ops` and the coordinators' `--etcd-max-txn-ops` (`None`: etcd's
    /// default, 128, and no flag).
    max_txn_ops: Option<u32>,
    /// Members per host: with more than one, they share the host's heartbeat and event relays.
    ranks_per_host: usize,
    /// The coordinators' `--lease-scope` (`member`, the default, or `host`: one store lease
    /// per host).
    lease_scope: String,
    /// Joins in flight at once.
    join_concurrency: usize,
    /// Members that share one coordinator client.
    members_per_connection: usize,
    /// The coordinators' `--whole-answer-up-to` (`None`: no flag, their default of 256).
    whole_answer_up_to: Option<u32>,
    /// The coordinators' `--heartbeat-interval` (`None`: no flag, their default of 500 ms),
    /// with a lease of six intervals.
    heartbeat: Option<Duration>,
}

impl Plan {
    fn from_args() -> Result<Self, String> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let full = args.iter().any(|a| a == "--bench");
        let mut plan = if full {
            Plan {
                members: 1024,
                stores: vec!["memory".into(), "etcd".into()],
                replicas: 2,
                steady: Duration::ZERO,
                bound: Duration::from_secs(300),
                max_txn_ops: None,
                ranks_per_host: RANKS_PER_HOST,
                lease_scope: "member".into(),
                join_concurrency: JOIN_CONCURRENCY,
                members_per_connection: 1,
                whole_answer_up_to: None,
                heartbeat: None,
            }
        } else {
            Plan {
                members: 96,
                stores: vec!["memory".into()],
                replicas: 1,
                steady: Duration::from_secs(2),
                bound: Duration::from_secs(60),
                max_txn_ops: None,
                ranks_per_host: RANKS_PER_HOST,
                lease_scope: "member".into(),
                join_concurrency: JOIN_CONCURRENCY,
                members_per_connection: 1,
                // The smoke run's 96 members get sparse views, as a large job's do.
                whole_answer_up_to: Some(16),
                heartbeat: None,
            }
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let mut value = |name: &str| it.next().cloned().ok_or_else(|| format!("{name} needs a value"));
            match a.as_str() {
                "--members" => plan.members = value(a)?.parse().map_err(|e| format!("--members: {e}"))?,
                "--stores" => plan.stores = value(a)?.split(',').map(str::to_string).collect(),
                "--replicas" => plan.replicas = value(a)?.parse().map_err(|e| format!("--replicas: {e}"))?,
                "--steady-secs" => {
                    plan.steady = Duration::from_secs(value(a)?.parse().map_err(|e| format!("--steady-secs: {e}"))?)
                }
                "--bound-secs" => {
                    plan.bound = Duration::from_secs(value(a)?.parse().map_err(|e| format!("--bound-secs: {e}"))?)
                }
                "--ranks-per-host" => {
                    plan.ranks_per_host = value(a)?.parse().map_err(|e| format!("--ranks-per-host: {e}"))?;
                    if plan.ranks_per_host == 0 || plan.ranks_per_host > cohort_proto::MAX_BEATS_PER_CALL {
                        return Err("--ranks-per-host: 1 to 1024".into());
                    }
                }
                "--etcd-max-txn-ops" => {
                    plan.max_txn_ops = Some(value(a)?.parse().map_err(|e| format!("--etcd-max-txn-ops: {e}"))?)
                }
                "--join-concurrency" => {
                    plan.join_concurrency = value(a)?.parse().map_err(|e| format!("--join-concurrency: {e}"))?;
                    if plan.join_concurrency == 0 {
                        return Err("--join-concurrency: at least 1".into());
                    }
                }
                "--members-per-connection" => {
                    plan.members_per_connection =
                        value(a)?.parse().map_err(|e| format!("--members-per-connection: {e}"))?;
                    if plan.members_per_connection == 0 {
                        return Err("--members-per-connection: at least 1".into());
                    }
                }
                "--whole-answer-up-to" => {
                    plan.whole_answer_up_to = Some(value(a)?.parse().map_err(|e| format!("--whole-answer-up-to: {e}"))?)
                }
                "--heartbeat-ms" => {
                    let ms: u64 = value(a)?.parse().map_err(|e| format!("--heartbeat-ms: {e}"))?;
                    if !(50..=60_000).contains(&ms) {
                        return Err("--heartbeat-ms: 50 to 60000".into());
                    }
                    plan.heartbeat = Some(Duration::from_millis(ms));
                }
                "--lease-scope" => {
                    plan.lease_scope = value(a)?;
                    if !matches!(plan.lease_scope.as_str(), "member" | "host") {
                        return Err("--lease-scope: member or host".into());
                    }
                }
                _ => {}
            }
        }
        if plan.members < 4 {
            return Err("--members must be at least 4".into());
        }
        if plan.replicas == 0 {
            return Err("--replicas must be at least 1".into());
        }
        for s in &plan.stores {
            if s != "memory" && s != "etcd" {
                return Err(format!("unknown store {s:?}: memory or etcd"));
            }
        }
        Ok(plan)
    }

    /// The members' heartbeat interval.
    fn interval(&self) -> Duration {
        self.heartbeat.unwrap_or(DEFAULT_HEARTBEAT)
    }
}

/// The progress of the store's run in progress (its phases, on stderr), while one runs.
static PROGRESS: std::sync::Mutex<Option<Progress>> = std::sync::Mutex::new(None);

/// Runs `f` with the run's progress, if one is set.
fn with_progress(f: impl FnOnce(&Progress)) {
    if let Some(p) = PROGRESS.lock().unwrap_or_else(PoisonError::into_inner).as_ref() {
        f(p);
    }
}

/// Awaits `f` for at most `bound`, failing with `what` when it takes longer. `what` is the
/// phase the progress shows meanwhile.
async fn within<T>(bound: Duration, what: &str, f: impl std::future::Future<Output = T>) -> Result<T, String> {
    with_progress(|p| p.start(what));
    let result = tokio::time::timeout(bound, f).await.map_err(|_| format!("{what}: no result within {bound:?}"));
    with_progress(|p| p.done(if result.is_ok() { "" } else { "timed out" }));
    result
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Nearest-rank percentile (`p` in 0..=100) of sorted samples.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len().max(1)) - 1).copied().unwrap_or_default()
}

/// A `cohort-coordinator` process; killed when dropped.
struct Coordinator {
    child: std::process::Child,
    addr: SocketAddr,
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Coordinator {
    fn start(
        store: &str,
        members: usize,
        index: usize,
        max_txn_ops: Option<u32>,
        lease_scope: &str,
        whole_answer_up_to: Option<u32>,
        heartbeat: Option<Duration>,
    ) -> Result<Self, String> {
        let max = members.to_string();
        // COHORT_SCALE_LOG=PREFIX keeps each replica's log (RUST_LOG=info) in PREFIX.<index>.
        let (log, stderr) = match std::env::var("COHORT_SCALE_LOG") {
            Ok(prefix) => {
                let file = std::fs::File::create(format!("{prefix}.{index}")).map_err(|e| format!("log file: {e}"))?;
                ("info", std::process::Stdio::from(file))
            }
            Err(_) => ("warn", std::process::Stdio::null()),
        };
        // COHORT_SCALE_COORDINATOR=PATH runs another build of the coordinator (an older commit's,
        // to compare before and after on one machine in one sitting).
        let binary = std::env::var("COHORT_SCALE_COORDINATOR")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_cohort-coordinator").into());
        let mut command = std::process::Command::new(binary);
        command.args(["serve", "--listen", "127.0.0.1:0", "--store", store]);
        if lease_scope != "member" {
            command.args(["--lease-scope", lease_scope]);
        }
        if let Some(n) = max_txn_ops {
            command.args(["--etcd-max-txn-ops", &n.to_string()]);
        }
        if let Some(n) = whole_answer_up_to {
            command.args(["--whole-answer-up-to", &n.to_string()]);
        }
        if let Some(interval) = heartbeat {
            // A lease of six intervals, as the defaults (500 ms, 3 s) have.
            let (interval, lease) = (interval.as_millis(), (interval * 6).as_millis());
            command.args(["--heartbeat-interval", &format!("{interval}ms"), "--lease-ttl", &format!("{lease}ms")]);
        }
        let mut child = command
            .args(["--min-workers", "1", "--max-workers", &max, "--join-window", "60s"])
            .args(["--elastic-timeout", "300s"])
            .env("RUST_LOG", log)
            .stdout(std::process::Stdio::piped())
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("starting cohort-coordinator: {e}"))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        // Its `listening on` line (after a `metrics on` one, when it serves metrics).
        let addr = cohort_coordinator::announce::await_listening(&rx, START_BOUND)?;
        Ok(Self { child, addr })
    }

    /// CPU time used so far (user + system), from `/proc/PID/stat`.
    fn cpu(&self) -> Duration {
        cpu_of(self.child.id())
    }

    /// Peak resident memory, bytes (`VmHWM` of `/proc/PID/status`).
    fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }
}

/// CPU time a process has used (user + system).
fn cpu_of(pid: u32) -> Duration {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return Duration::ZERO };
    let Some(close) = stat.rfind(')') else { return Duration::ZERO };
    let fields: Vec<u64> = stat[close + 2..].split_whitespace().map(|f| f.parse().unwrap_or(0)).collect();
    // SAFETY: sysconf with a valid name has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_micros((fields.get(11).unwrap_or(&0) + fields.get(12).unwrap_or(&0)) * 1_000_000 / ticks)
}

/// etcd's `/metrics` text (plain HTTP on its client port).
fn etcd_metrics(endpoint: &str) -> Result<String, String> {
    let hostport = endpoint.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(hostport).map_err(|e| format!("etcd metrics: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {hostport}\r\n\r\n").map_err(|e| e.to_string())?;
    let mut body = String::new();
    s.read_to_string(&mut body).map_err(|e| format!("etcd metrics: {e}"))?;
    Ok(body)
}

/// The metrics of interest from etcd's `/metrics` (plain HTTP on its client port).
fn etcd_counters(endpoint: &str) -> Result<Vec<(String, f64)>, String> {
    let body = etcd_metrics(endpoint)?;
    const WANTED: [&str; 4] = [
        "etcd_disk_wal_write_bytes_total",
        "etcd_mvcc_put_total",
        "etcd_server_proposals_committed_total",
        "etcd_network_client_grpc_received_bytes_total",
    ];
    Ok(WANTED
        .iter()
        .map(|name| {
            let v = body
                .lines()
                .filter_map(|l| l.strip_prefix(name))
                .filter_map(|rest| rest.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            (name.to_string(), v)
        })
        .collect())
}

/// The etcd requests of interest, by gRPC method, as etcd's `grpc_server_started_total`
/// counts them (unary calls; for the lease keep-alive and watch streams, messages received).
const ETCD_METHODS: [(&str, &str); 8] = [
    ("put", "Put"),
    ("txn", "Txn"),
    ("range", "Range"),
    ("delete", "DeleteRange"),
    ("grant", "LeaseGrant"),
    ("revoke", "LeaseRevoke"),
    ("ttl", "LeaseTimeToLive"),
    ("keepalive", "LeaseKeepAlive"),
];

/// etcd's request counts by method (see [`ETCD_METHODS`]), read from its `/metrics`.
fn etcd_requests(endpoint: &str) -> Result<Vec<f64>, String> {
    let body = etcd_metrics(endpoint)?;
    let count = |family: &str, method: &str| -> f64 {
        let label = format!("grpc_method=\"{method}\"");
        body.lines()
            .filter(|l| l.starts_with(family) && l.contains(&label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    Ok(ETCD_METHODS
        .iter()
        .map(|(_, m)| {
            if *m == "LeaseKeepAlive" {
                count("grpc_server_msg_received_total{", m)
            } else {
                count("grpc_server_started_total{", m)
            }
        })
        .collect())
}

/// What etcd served between two [`etcd_requests`] snapshots, per member: ` etcd_PHASE=put:..,txn:..`.
fn etcd_phase(phase: &str, before: &[f64], after: &[f64], members: usize) -> String {
    let parts: Vec<String> = ETCD_METHODS
        .iter()
        .zip(after.iter().zip(before))
        .map(|((name, _), (a, b))| format!("{name}:{:.2}", (a - b) / members as f64))
        .collect();
    format!(" etcd_{phase}_per_member={}", parts.join(","))
}

/// What the harness hears from every member's shell (through [`Seen`]), by member index.
struct Book {
    /// Whether member `i` has heard generation 1 formed on its events.
    heard_formed: Vec<AtomicBool>,
    /// Members that have.
    heard_formed_count: AtomicUsize,
    /// When member `i` heard generation 1 revoked (from its events).
    revoked_at: Vec<OnceLock<Instant>>,
    /// The first member named a straggler, and when it was first heard.
    straggler: OnceLock<(String, Instant)>,
    beats_answered: AtomicU64,
    beats_failed: AtomicU64,
    /// Coordinator calls that outlasted every bound of their client.
    overran: AtomicU64,
    /// Members whose revoked generation's wait (`FailureReporter::revoked`) ended, and
    /// members that hold generation 2.
    woke: AtomicUsize,
    reformed: AtomicUsize,
    /// Whether member `i` holds generation 2 (or died meanwhile).
    done: Vec<AtomicBool>,
    /// Calls that failed (and that the shell does not act on), by call and error.
    failures: std::sync::Mutex<HashMap<String, usize>>,
    /// Woken on every change the harness waits for.
    changed: Notify,
}

impl Book {
    fn new(n: usize) -> Self {
        Self {
            heard_formed: (0..n).map(|_| AtomicBool::new(false)).collect(),
            heard_formed_count: AtomicUsize::new(0),
            revoked_at: (0..n).map(|_| OnceLock::new()).collect(),
            straggler: OnceLock::new(),
            beats_answered: AtomicU64::new(0),
            beats_failed: AtomicU64::new(0),
            overran: AtomicU64::new(0),
            woke: AtomicUsize::new(0),
            reformed: AtomicUsize::new(0),
            done: (0..n).map(|_| AtomicBool::new(false)).collect(),
            failures: std::sync::Mutex::new(HashMap::new()),
            changed: Notify::new(),
        }
    }

    /// Counts a failed call by call and error (its first 60 characters).
    fn failed(&self, rpc: &str, error: &(dyn std::error::Error + Send + Sync)) {
        // The start of the text: what went wrong, without the member it went wrong for.
        let text: String = error.to_string().chars().take(60).collect();
        let key = format!("{rpc}:_{text}").replace([' ', '"', '\n', ','], "_");
        *self.failures.lock().unwrap_or_else(PoisonError::into_inner).entry(key).or_default() += 1;
    }

    /// Waits until `done` holds (checked at every change).
    async fn until(&self, done: impl Fn(&Self) -> bool) {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if done(self) {
                return;
            }
            notified.await;
        }
    }
}

/// One member's world: production's (it runs at once, thread randomness), with an observer
/// that writes what its shell hears into the [`Book`].
struct Seen {
    index: usize,
    book: Arc<Book>,
}

impl World for Seen {
    fn observe(&self, seen: Observed<'_>) {
        let book = &self.book;
        match seen {
            Observed::Event(pb::JobEvent { event: Some(Event::GenerationFormed(g)) })
                if g.number == 1 && !book.heard_formed[self.index].swap(true, Ordering::Relaxed) =>
            {
                book.heard_formed_count.fetch_add(1, Ordering::Relaxed);
                book.changed.notify_waiters();
            }
            Observed::Event(pb::JobEvent { event: Some(Event::StragglerNamed(s)) })
                if book.straggler.set((s.worker_id.clone(), Instant::now())).is_ok() =>
            {
                book.changed.notify_waiters();
            }
            Observed::RevocationHeard { generation: 1, .. } => {
                let _ = book.revoked_at[self.index].set(Instant::now());
            }
            Observed::Heartbeat { error: None } => {
                book.beats_answered.fetch_add(1, Ordering::Relaxed);
                book.changed.notify_waiters();
            }
            Observed::Heartbeat { error: Some(error) } => {
                book.beats_failed.fetch_add(1, Ordering::Relaxed);
                book.failed("Heartbeat", error);
            }
            Observed::CallFailed { rpc, error } => book.failed(rpc, error),
            Observed::Overran { .. } => {
                book.overran.fetch_add(1, Ordering::Relaxed);
            }

            _ => {}
        }
    }
}

/// A data plane that publishes what a worker with `--transport auto` publishes (a TCP and a
/// shared-memory address; the members of a host share memory in the sparse answer's host
/// runs) and connects nothing: the harness measures the control plane.
struct NullPlane {
    index: usize,
    host: String,
}

impl DataPlane for NullPlane {
    type Comm = ();

    fn published(&self) -> (Vec<pb::TransportAddress>, Vec<String>) {
        let i = self.index;
        let addresses = vec![
            pb::TransportAddress {
                transport: "tcp".into(),
                address: format!("127.{}.{}.{}:{}", (i >> 16) & 255, (i >> 8) & 255, i & 255, 40000 + i % 1000),
            },
            pb::TransportAddress {
                transport: "shm".into(),
                address: format!("shm1;host={};nonce={i:016x}", self.host),
            },
        ];
        (addresses, vec!["transport:tcp".into()])
    }

    async fn connect(&mut self, formed: Formed<'_>) -> Result<Option<Connected<()>>, ElasticError> {
        Ok(Some(Connected { comm: (), revoke: Arc::new(|_| {}), members: formed.members, transport: MeshKind::Tcp }))
    }
}

/// One member: the shipped worker's group, and its index.
struct Member {
    index: usize,
    id: String,
    group: ElasticGroup<NullPlane>,
    /// How long its join took (`ElasticGroup::join_with`: the Join call and its retries).
    joined: Duration,
}

/// Joins member `index` through `client` (at most `admit`'s permits in flight) and waits for
/// its first generation.
async fn member(
    index: usize,
    plan: &Plan,
    control: ControlConfig,
    client: ControlClient,
    book: Arc<Book>,
    admit: &tokio::sync::Semaphore,
) -> Result<(Member, Generation<()>), String> {
    let id = format!("m{index:05}");
    let host = format!("host{:05}", index / plan.ranks_per_host);
    let job = JobId::new(JOB).map_err(|e| e.to_string())?;
    let mut config = ElasticConfig::new(job, WorkerId::new(id.clone()).map_err(|e| e.to_string())?, control);
    config.host = host.clone();
    config.domain = String::new();
    config.heartbeat_relay = plan.ranks_per_host > 1;
    config.relay_dir = None;
    let plane = NullPlane { index, host };
    let (group, joined) = {
        let _permit = admit.acquire().await.map_err(|e| e.to_string())?;
        let asked = Instant::now();
        let group = ElasticGroup::join_with(config, client, plane, Arc::new(Seen { index, book }))
            .await
            .map_err(|e| format!("join {id}: {e}"))?;
        (group, asked.elapsed())
    };
    let mut member = Member { index, id, group, joined };
    let generation = member.group.next_generation().await.map_err(|e| format!("{}: {e}", member.id))?;
    Ok((member, generation))
}

/// Checks that every member holds the same generation `number` of `size` members, with its
/// own rank (every rank once), and every entry anyone holds the same member in every view;
/// returns the entries held, per member on average.
fn check_generation(placed: &[&Generation<()>], number: u64, size: usize) -> Result<f64, String> {
    let mut seen = vec![false; size];
    let mut entries: HashMap<u32, (&str, u64)> = HashMap::new();
    let mut held = 0usize;
    for g in placed {
        if g.number != number || g.members.size() as usize != size {
            return Err(format!(
                "generation {} of {} members where {number} of {size} was expected",
                g.number,
                g.members.size()
            ));
        }
        match seen.get_mut(g.rank as usize) {
            Some(s) if !*s => *s = true,
            _ => return Err(format!("generation {number}: rank {} twice or out of range", g.rank)),
        }
        for m in g.members.iter() {
            held += 1;
            let entry = (m.worker_id.as_str(), g.members.incarnation_of(m.rank).unwrap_or(0));
            if let Some(other) = entries.insert(m.rank, entry) {
                if other != entry {
                    return Err(format!("generation {number}: rank {} is {other:?} and {entry:?}", m.rank));
                }
            }
        }
    }
    if seen.iter().any(|s| !s) {
        return Err(format!("generation {number}: not every rank is held by a member"));
    }
    Ok(held as f64 / placed.len().max(1) as f64)
}

/// Step timings as a worker of a ring job records them: a slow member computes three times as
/// long and waits little in the collectives; the others wait for it there. Each waits briefly
/// on its ring neighbours.
fn record_step(group: &ElasticGroup<NullPlane>, rank: u32, size: u32, slow: bool) {
    let (compute_ms, collective_ms) = if slow { (300, 10) } else { (100, 210) };
    let neighbours = [(rank + 1) % size, (rank + size - 1) % size];
    group.record_step(
        Duration::from_millis(compute_ms),
        Duration::from_millis(collective_ms),
        neighbours.iter().map(|&r| (r, Duration::from_millis(1))).collect(),
    );
}

/// CPU time of every coordinator, together.
fn cpu_all(cs: &[Coordinator]) -> Duration {
    cs.iter().map(Coordinator::cpu).sum()
}

/// Raises this process's open-file limit as far as it goes: every member holds Unix sockets to
/// its host's relays (both ends in this process).
fn raise_file_limit() {
    // SAFETY: getrlimit and setrlimit with a valid resource and a pointer to a local struct.
    unsafe {
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return;
        }
        // Root may raise the hard limit too (to the kernel's `nr_open`).
        let wanted = std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse::<libc::rlim_t>().ok())
            .unwrap_or(limit.rlim_max)
            .max(limit.rlim_max);
        let raised = libc::rlimit { rlim_cur: wanted, rlim_max: wanted };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) != 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// Collects the results of every task of `set`, in the order they finish; the first error or
/// panic ends it (dropping the set aborts the rest).
async fn all<T: 'static>(mut set: tokio::task::JoinSet<Result<T, String>>) -> Result<Vec<T>, String> {
    let mut out = Vec::with_capacity(set.len());
    while let Some(joined) = set.join_next().await {
        out.push(joined.map_err(|e| format!("member task: {e}"))??);
    }
    Ok(out)
}

async fn run(plan: &Plan, store: &str) -> Result<(), String> {
    let n = plan.members;
    let etcd = if store == "etcd" {
        Some(
            tokio::task::spawn_blocking({
                let flags: Vec<String> =
                    plan.max_txn_ops.map(|n| vec!["--max-txn-ops".into(), n.to_string()]).unwrap_or_default();
                move || EtcdProcess::start_with_flags(&flags.iter().map(String::as_str).collect::<Vec<_>>())
            })
            .await
            .map_err(|e| format!("etcd start task: {e}"))?
            .map_err(|e| e.to_string())?,
        )
    } else {
        None
    };
    let spec = match &etcd {
        Some(e) => format!("etcd://{}", e.endpoint().trim_start_matches("http://")),
        None => "memory".into(),
    };
    let replicas = if etcd.is_some() { plan.replicas } else { 1 };
    let coordinators = (0..replicas)
        .map(|i| {
            Coordinator::start(
                &spec,
                n,
                i,
                plan.max_txn_ops.filter(|_| etcd.is_some()),
                &plan.lease_scope,
                plan.whole_answer_up_to,
                plan.heartbeat,
            )
        })
        .collect::<Result<Vec<Coordinator>, String>>()?;
    let etcd_before = match &etcd {
        Some(e) => etcd_counters(&e.endpoint())?,
        None => Vec::new(),
    };
    let requests = || match &etcd {
        Some(e) => etcd_requests(&e.endpoint()),
        None => Ok(Vec::new()),
    };
    let mut phases = String::new();
    let mut mark = requests()?;
    let mut phase_end = |name: &str, mark: &mut Vec<f64>| -> Result<(), String> {
        if etcd.is_some() {
            let now = requests()?;
            phases.push_str(&etcd_phase(name, mark, &now, n));
            *mark = now;
        }
        Ok(())
    };
    // One client per `members_per_connection` members, each on one replica first (a client
    // fails over to the others as a worker's does).
    let endpoints: Vec<String> = coordinators.iter().map(|c| format!("http://{}", c.addr)).collect();
    let connections = n.div_ceil(plan.members_per_connection);
    let clients = (0..connections)
        .map(|c| {
            let mut control = ControlConfig::new(endpoints.clone());
            control.first_endpoint = Some(c % endpoints.len());
            let client = ControlClient::new(control.clone()).map_err(|e| format!("client: {e}"))?;
            Ok((control, client))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let bound = plan.bound;
    let book = Arc::new(Book::new(n));

    // 1. Formation: every member joins and waits for its first generation.
    let cpu0 = cpu_all(&coordinators);
    let started = Instant::now();
    let admit = Arc::new(tokio::sync::Semaphore::new(plan.join_concurrency));
    let mut joining = tokio::task::JoinSet::new();
    for i in 0..n {
        let (control, client) = clients[i / plan.members_per_connection].clone();
        let (plan, book, admit) = (plan.clone(), book.clone(), admit.clone());
        joining.spawn(async move { member(i, &plan, control, client, book, &admit).await });
    }
    let mut formed = within(bound, "joining and forming generation 1", all(joining)).await??;
    let join_to_formed = started.elapsed();
    let cpu_formation = cpu_all(&coordinators) - cpu0;
    phase_end("formation", &mut mark)?;
    let mut joins: Vec<Duration> = formed.iter().map(|(m, _)| m.joined).collect();
    joins.sort();
    formed.sort_by_key(|(_, g)| g.rank);
    let fetched_per_member = check_generation(&formed.iter().map(|(_, g)| g).collect::<Vec<_>>(), 1, n)
        .map_err(|e| format!("generation 1 is not the same {n} members everywhere: {e}"))?;

    // 2. Every member hears generation 1 on its events (its own stream, or its host's relay),
    // and has had a heartbeat answered.
    let cpu0 = cpu_all(&coordinators);
    within(bound, "every member hearing generation 1 on its events", async {
        book.until(|b| {
            b.heard_formed_count.load(Ordering::Relaxed) == n && b.beats_answered.load(Ordering::Relaxed) >= n as u64
        })
        .await
    })
    .await
    .map_err(|e| {
        format!(
            "{e} ({} members heard it, {} beats answered)",
            book.heard_formed_count.load(Ordering::Relaxed),
            book.beats_answered.load(Ordering::Relaxed)
        )
    })?;
    let watching = started.elapsed() - join_to_formed;
    let cpu_watching = cpu_all(&coordinators) - cpu0;
    phase_end("watches", &mut mark)?;

    // 3 and 4. One failure (the last rank), a second during the re-formation (rank 1).
    let (failed, dies_meanwhile) = (n - 1, 1);
    let mut members: Vec<Option<Member>> = formed.into_iter().map(|(m, _)| Some(m)).collect();
    let failed_member = members[failed].take().ok_or("no last rank")?;
    let failed_index = failed_member.index;
    let left_out = [failed_member.id.clone(), members[dies_meanwhile].as_ref().ok_or("no rank 1")?.id.clone()];
    // Its process is gone: its heartbeats, watch and relays stop.
    drop(failed_member);
    let reporter = members[0].as_ref().ok_or("no rank 0")?.group.reporter();
    let cpu0 = cpu_all(&coordinators);
    let sent = Instant::now();
    let mut reforming = tokio::task::JoinSet::new();
    for (rank, slot) in members.iter_mut().enumerate() {
        let Some(mut m) = slot.take() else { continue };
        let book = book.clone();
        reforming.spawn(async move {
            m.group.reporter().revoked(1).await;
            let heard = Instant::now();
            book.woke.fetch_add(1, Ordering::Relaxed);
            if rank == dies_meanwhile {
                // This process dies too: its control stream closes.
                let index = m.index;
                book.done[index].store(true, Ordering::Relaxed);
                drop(m);
                return Ok((index, heard, None));
            }
            let g = m.group.next_generation().await.map_err(|e| format!("{}: {e}", m.id))?;
            book.reformed.fetch_add(1, Ordering::Relaxed);
            book.done[m.index].store(true, Ordering::Relaxed);
            Ok((m.index, heard, Some((Instant::now(), m, g))))
        });
    }
    let cause = reporter
        .on_failure(1, &CommError::PeerFailed { rank: failed as u32, detail: "scale harness: peer failed".into() })
        .await;
    let report_answered = sent.elapsed();
    if cause.rank != Some(failed as u32) {
        return Err(format!("the failure report's root cause is {cause}, not rank {failed}"));
    }
    let results = within(bound, "revocation and re-formation", all(reforming)).await.map_err(|e| {
        let heard = book.revoked_at.iter().filter(|t| t.get().is_some()).count();
        let (woke, reformed) = (book.woke.load(Ordering::Relaxed), book.reformed.load(Ordering::Relaxed));
        let left: Vec<String> = (0..n)
            .filter(|&i| i != failed_index && !book.done[i].load(Ordering::Relaxed))
            .take(8)
            .map(|i| format!("m{i:05}"))
            .collect();
        format!(
            "{e} ({heard} heard the revocation on their events, {woke} saw it, {reformed} re-formed; not: {})",
            left.join(" ")
        )
    })??;
    let mut revoked = Vec::with_capacity(n);
    let mut reformed = Duration::ZERO;
    let mut survivors = Vec::with_capacity(n);
    for (index, woke, formed) in results {
        // When its shell heard the revocation (rank 0, which reported it, knew it at once).
        let heard = book.revoked_at[index].get().copied().unwrap_or(woke);
        revoked.push(heard.saturating_duration_since(sent));
        if let Some((at, m, g)) = formed {
            reformed = reformed.max(at.duration_since(sent));
            survivors.push((m, g));
        }
    }
    let cpu_failure = cpu_all(&coordinators) - cpu0;
    phase_end("failure", &mut mark)?;
    survivors.sort_by_key(|(_, g)| g.rank);
    check_generation(&survivors.iter().map(|(_, g)| g).collect::<Vec<_>>(), 2, n - 2)
        .map_err(|e| format!("generation 2 is not the same {} survivors everywhere: {e}", n - 2))?;
    // Every entry anyone holds of generation 2 leaves out the failed member and the one that
    // died meanwhile.
    if let Some(m) = survivors.iter().flat_map(|(_, g)| g.members.iter()).find(|m| left_out.contains(&m.worker_id)) {
        return Err(format!("generation 2 holds {} (rank {}), which should be left out", m.worker_id, m.rank));
    }
    revoked.sort();

    // 5. Steady state: timed heartbeats at the members' interval.
    let mut steady = String::new();
    if !plan.steady.is_zero() {
        let size = (n - 2) as u32;
        let slow = survivors.len() / 2;
        let slow_id = survivors[slow].0.id.clone();
        // Every survivor records a step per half interval (each heartbeat carries one or two).
        let recorder = async {
            let mut tick = tokio::time::interval(plan.interval() / 2);
            loop {
                tick.tick().await;
                for (i, (m, g)) in survivors.iter().enumerate() {
                    record_step(&m.group, g.rank, size, i == slow);
                }
            }
        };
        let measured = async {
            let first_step = Instant::now();
            within(bound, "naming the slow member a straggler", book.until(|b| b.straggler.get().is_some())).await?;
            let (named, at) = book.straggler.get().cloned().ok_or("no straggler named")?;
            if named != slow_id {
                return Err(format!("the straggler named is {named}, not the slow member {slow_id}"));
            }
            let straggler_named = at.saturating_duration_since(first_step);
            // Not a synchronisation: two intervals of warm-up, so every member's beats carry
            // timed steps before the window opens.
            tokio::time::sleep(plan.interval() * 2).await;
            let etcd_cpu = || etcd.as_ref().and_then(EtcdProcess::pid).map_or(Duration::ZERO, cpu_of);
            let (cpu0, beats0, t0) =
                (cpu_all(&coordinators), book.beats_answered.load(Ordering::Relaxed), Instant::now());
            let (etcd_cpu0, etcd_req0) = (etcd_cpu(), requests()?);
            // The measured window itself: the coordinators' CPU and the beats answered over it.
            tokio::time::sleep(plan.steady).await;
            let (cpu1, beats1, dt) =
                (cpu_all(&coordinators), book.beats_answered.load(Ordering::Relaxed), t0.elapsed());
            let (etcd_cpu1, etcd_req1) = (etcd_cpu(), requests()?);
            let mut line = format!(
                " steady_secs={:.1} heartbeats_per_s={:.0} steady_cpu_pct={:.1} straggler_named_ms={:.0}",
                dt.as_secs_f64(),
                (beats1 - beats0) as f64 / dt.as_secs_f64(),
                100.0 * (cpu1 - cpu0).as_secs_f64() / dt.as_secs_f64(),
                ms(straggler_named)
            );
            if etcd.is_some() {
                // What etcd did for the steady phase: its CPU, and its requests per second.
                let rates: Vec<String> = ETCD_METHODS
                    .iter()
                    .zip(etcd_req1.iter().zip(&etcd_req0))
                    .map(|((name, _), (a, b))| format!("{name}:{:.0}", (a - b) / dt.as_secs_f64()))
                    .collect();
                line.push_str(&format!(
                    " etcd_steady_cpu_pct={:.1} etcd_steady_per_s={}",
                    100.0 * (etcd_cpu1 - etcd_cpu0).as_secs_f64() / dt.as_secs_f64(),
                    rates.join(",")
                ));
            }
            Ok::<_, String>(line)
        };
        steady = tokio::select! {
            () = recorder => unreachable!("the recorder runs until the measurement ends"),
            line = measured => line?,
        };
    }

    // Beats refused or not answered before the job's end (a member's beat handed to its
    // relay just before it left is refused after it: not counted).
    let beats_failed = book.beats_failed.load(Ordering::Relaxed);
    let mut failures: Vec<(String, usize)> =
        book.failures.lock().unwrap_or_else(PoisonError::into_inner).drain().collect();
    // 6. Finish: every survivor leaves, finished, at once.
    let cpu0 = cpu_all(&coordinators);
    let started = Instant::now();
    let finishers = survivors.len();
    let mut leaving = tokio::task::JoinSet::new();
    for (m, _) in survivors {
        leaving.spawn(async move {
            let id = m.id.clone();
            Ok(m.group.leave(true).await.err().map(|e| format!("{id}: {e}")))
        });
    }
    let refusals: Vec<String> =
        within(bound, "every survivor leaving, finished", all(leaving)).await??.into_iter().flatten().collect();
    let finished = started.elapsed();
    let cpu_finish = cpu_all(&coordinators) - cpu0;
    phase_end("finish", &mut mark)?;
    let late = clients[0]
        .1
        .join(pb::JoinRequest {
            job: JOB.into(),
            worker_id: format!("m{n:05}"),
            host: "late".into(),
            addresses: vec![pb::TransportAddress { transport: "tcp".into(), address: "127.0.0.1:1".into() }],
            capabilities: vec!["transport:tcp".into()],
            protocol_version: cohort_proto::PROTOCOL_VERSION,
            domain: String::new(),
            replaces: 0,
        })
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    let ended = late.contains("has ended");

    let mut etcd_out = String::new();
    if let Some(e) = &etcd {
        let after = etcd_counters(&e.endpoint())?;
        for ((name, a), (_, b)) in after.iter().zip(&etcd_before) {
            let short = name.trim_start_matches("etcd_").trim_end_matches("_total");
            etcd_out.push_str(&format!(" etcd_{short}={:.0}", a - b));
        }
    }
    let rss: Vec<String> =
        coordinators.iter().map(|c| format!("{:.0}", c.peak_rss() as f64 / (1 << 20) as f64)).collect();
    let mut settings = format!(" ranks_per_host={}", plan.ranks_per_host);
    if let Some(max) = plan.max_txn_ops.filter(|_| etcd.is_some()) {
        settings.push_str(&format!(" max_txn_ops={max}"));
    }
    if plan.lease_scope != "member" {
        settings.push_str(&format!(" lease_scope={}", plan.lease_scope));
    }
    if plan.members_per_connection != 1 {
        settings.push_str(&format!(" members_per_connection={}", plan.members_per_connection));
    }
    if plan.join_concurrency != JOIN_CONCURRENCY {
        settings.push_str(&format!(" join_concurrency={}", plan.join_concurrency));
    }
    if let Some(w) = plan.whole_answer_up_to {
        settings.push_str(&format!(" whole_answer_up_to={w}"));
    }
    if let Some(h) = plan.heartbeat {
        settings.push_str(&format!(" heartbeat_ms={}", h.as_millis()));
    }
    // The calls that failed most before the finish, for the record (a heartbeat cut short under load, a watch
    // reopened): `calls_failed=COUNT:CALL:_ERROR,...`.
    failures.sort_by_key(|(_, count)| std::cmp::Reverse(*count));
    let calls_failed: Vec<String> = failures.iter().take(3).map(|(k, n)| format!("{n}:{k}")).collect();
    if !calls_failed.is_empty() {
        settings.push_str(&format!(" calls_failed={}", calls_failed.join(",")));
    }
    // The results line goes to stdout with the bar gone.
    with_progress(Progress::finish);
    println!(
        "scale store={store} members={n} replicas={replicas}{settings} connections={connections} fetched_per_member={fetched_per_member:.1} \
         join_to_formed_ms={:.0} join_p50_ms={:.1} join_p99_ms={:.1} formation_cpu_s={:.2} watching_ms={:.0} watching_cpu_s={:.2} \
         report_ms={:.1} revoked_min_ms={:.1} revoked_p50_ms={:.1} revoked_p99_ms={:.1} revoked_max_ms={:.1} reformed_ms={:.0} failure_cpu_s={:.2}{steady} \
         finish_ms={:.0} finish_cpu_s={:.2} leaves_refused={} ended={ended} beats_failed={} overran={} peak_rss_mib={}{etcd_out}{phases}",
        ms(join_to_formed),
        ms(percentile(&joins, 50.0)),
        ms(percentile(&joins, 99.0)),
        cpu_formation.as_secs_f64(),
        ms(watching),
        cpu_watching.as_secs_f64(),
        ms(report_answered),
        ms(revoked.first().copied().unwrap_or_default()),
        ms(percentile(&revoked, 50.0)),
        ms(percentile(&revoked, 99.0)),
        ms(revoked.last().copied().unwrap_or_default()),
        ms(reformed),
        cpu_failure.as_secs_f64(),
        ms(finished),
        cpu_finish.as_secs_f64(),
        refusals.len(),
        beats_failed,
        book.overran.load(Ordering::Relaxed),
        rss.join("+"),
    );
    if let Some(first) = refusals.first() {
        return Err(format!("{} of {finishers} leaves were refused, the first: {first}", refusals.len()));
    }
    if !ended {
        return Err(format!("the job did not end when every member had finished (a later join: {late:?})"));
    }
    if book.overran.load(Ordering::Relaxed) > 0 {
        return Err("a coordinator call outlasted every bound of its client".into());
    }
    Ok(())
}

fn main() {
    let plan = match Plan::from_args() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("scale: {e}");
            std::process::exit(2);
        }
    };
    raise_file_limit();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    let mut failed = false;
    runtime.block_on(async {
        eprintln!(
            "scale harness: {} members of the shipped worker, stores {:?}, {} CPUs",
            plan.members,
            plan.stores,
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        for store in &plan.stores {
            let t = Instant::now();
            *PROGRESS.lock().unwrap_or_else(PoisonError::into_inner) =
                Some(Progress::new(format!("scale store={store}"), Total::Unknown));
            let result = run(&plan, store).await;
            // Dropped: the bar is gone before the results are printed.
            PROGRESS.lock().unwrap_or_else(PoisonError::into_inner).take();
            match result {
                Ok(()) => eprintln!("scale store={store}: done in {:.1} s", t.elapsed().as_secs_f64()),
                Err(e) => {
                    let e = e.replace(['"', '\n'], " ");
                    println!("scale store={store} members={} failed=\"{e}\"", plan.members);
                    failed = true;
                }
            }
        }
    });
    if failed {
        std::process::exit(1);
    }
}
