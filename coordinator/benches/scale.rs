//! Scale harness of the control plane: N members against real `cohort-coordinator` replica
//! processes, on the memory store or on a real etcd (a private `etcd` on free loopback
//! ports, with two replicas sharing it).
//!
//! Members are simulated cheaply: each is a few futures in this process, and
//! [`MEMBERS_PER_CONNECTION`] of them share one HTTP/2 connection (a host's ranks sharing a
//! channel), the connections spread over the replicas. A member joins, long-polls the
//! rendezvous, watches the job, reports failures and re-forms exactly as a worker does,
//! through the public gRPC API; it just has no data plane.
//!
//! One run, per store:
//!
//! 1. **formation**: every member joins (at most [`JOIN_CONCURRENCY`] joins in flight) and
//!    rendezvous; `join_to_formed_ms` runs from the first join to the last member holding
//!    generation 1 (`max_workers` = N, so it forms as soon as every member waits). A join
//!    answered UNAVAILABLE is retried as a worker's client retries it (50 ms, doubling to
//!    1 s); `joins_retried` counts them;
//! 2. **watch**: as the workers' host relays do (`--ranks-per-host` R, default 8, consecutive
//!    ranks per host): every member opens a quiet watch stream of its own (its control
//!    stream) and each host one compact event stream with incarnation 0 (its event relay's),
//!    and each hears generation 1; with `--ranks-per-host 1` every member opens a full stream
//!    of its own instead. The hosts' event streams run on a runtime of their own (one thread,
//!    connections of their own): each relay is a process on its own host, not busy with the
//!    calls of its host's members, so hearing an event is not queued behind thousands of
//!    simulated members' requests in this process. Then every member beats once, as live
//!    workers have within the last interval when a failure comes (untimed set-up);
//! 3. **failure**: rank 0 reports the last rank failed; `report_ms` is the report's round
//!    trip, `revoked_min/p50/p99/max_ms` the times from the report until each member hears
//!    the revocation: from its host's event stream (the relay's hop over its Unix socket,
//!    tens of microseconds, not simulated), or from its own stream. One more member (rank 1)
//!    dies *during the re-formation*: on hearing the revocation it closes its own stream and
//!    never rendezvous again (the coordinator sees its control stream close);
//! 4. **re-formation**: the other survivors rendezvous after generation 1;
//!    `reformed_ms` runs from the report until every one of them holds generation 2, which
//!    must leave out both the failed rank and the one that died meanwhile;
//! 5. **steady** (optional, `--steady-secs`): every survivor heartbeats at the default
//!    interval (500 ms) for that long, each with its step timings as a worker sends them
//!    (compute and collective time, and the waits on its two ring neighbours' links); one
//!    member in the middle of the ring computes three times as long as the others. The
//!    survivors beat in hosts of `--ranks-per-host` (default 8) consecutive ranks, each host's
//!    beats in two `HostHeartbeat` calls per interval (half its members each), as the
//!    workers' host relay sends them
//!    (`--ranks-per-host 1`: every member its own `Heartbeat`, as without the relay).
//!    `heartbeats_per_s` is the rate of members' beats answered, `heartbeat_calls_per_s` the
//!    calls that carried them, `steady_cpu_pct` the coordinators' CPU (on etcd
//!    also `etcd_steady_cpu_pct`, etcd's, and `etcd_steady_per_s`, its requests per second by
//!    method), and `straggler_named_ms` the time from the first timed heartbeat until the
//!    first event stream (host 0's, or rank 0's own) names that member a straggler (the run
//!    fails if it is never named, or another is).
//!
//! 6. **finish**: the job's end, as a training run's: the watch streams close and every
//!    survivor calls `Leave(FINISHED)` at once (as many in flight as there are members);
//!    `finish_ms` runs from the first call until the last answer, `leaves_refused` counts
//!    the calls that failed (the run then fails, after printing its line), and the job must
//!    have ended: a Join afterwards is refused with the job's end.
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
//! **Answers.** By default members rendezvous as a worker does, asking for the sparse view
//! (`RendezvousRequest.compact`, `partners`, `layout`): above the coordinators'
//! `whole_answer_up_to` (256) the answer carries the generation's size, the member's rank and
//! own entry, the member list's digest, the host runs and what a member of a mesh that links
//! on demand needs, the entries of the ranks `rank ± 2^k mod N` for `2^k < N` (O(log N),
//! `cohort_proto::partner_ranks`) and of its host-mates (each member publishes a TCP and a
//! shared-memory address, as a worker with `--transport auto` does); a smaller generation
//! comes whole. Against a coordinator older than `partners`
//! (`COHORT_SCALE_COORDINATOR`) each member fetches them in one `Members` call, checking the
//! answer's digest. Formation and re-formation are timed until every member holds those
//! entries; watches are compact as well.
//! `COHORT_SCALE_MODE=full` runs the old mode instead (the whole member list in every answer
//! and `GenerationFormed` event, no `Members` call), for comparison; the output line says
//! `mode=compact` or `mode=full`.
//!
//! Run it with `cargo bench -p cohort-coordinator --bench scale -- --members 1024`
//! (`--stores memory,etcd`, `--replicas 2`, `--steady-secs 5`, `--ranks-per-host 8`,
//! `--whole-answer-up-to N` (the coordinators' flag; the smoke run uses 16),
//! `--etcd-max-txn-ops 1024`: etcd and the coordinators run with that limit on a transaction's
//! operations; `--lease-scope host`: the coordinators put each host's 8 members on one store
//! lease; `--join-concurrency N`: joins in flight at once, 256 by default; release build).
//! Without
//! `--bench` on its command line (`cargo test --benches`, which the test command runs) it is
//! a 96-member smoke version on the memory store, with a 2 s steady phase. Targets are
//! reported in docs/benchmarks.md ("Scale"), never asserted here; every wait has a deadline
//! (`--bound-secs`, default 300), so a stuck coordinator fails the run instead of hanging it.
//! `COHORT_SCALE_LOG=PREFIX` keeps each replica's log (at `info`) in `PREFIX.0`, `PREFIX.1`,
//! ...; `COHORT_SCALE_COORDINATOR=PATH` runs another build of `cohort-coordinator` (an older
//! commit's, for a before-and-after in one sitting).

use cohort_proto::progress::{Progress, Total};
use cohort_proto::v1 as pb;
use cohort_proto::v1::coordinator_client::CoordinatorClient;
use cohort_testkit::etcd::EtcdProcess;
use futures::StreamExt;
use pb::job_event::Event;
use std::io::{BufRead, Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// The simulated members share this machine's cores with the coordinators they measure:
/// the same allocator as the coordinator's binary keeps their share small.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Members that share one HTTP/2 connection (each holds at most two streams at once, a
/// watch and a rendezvous long poll, well under a server's usual 200-stream limit).
const MEMBERS_PER_CONNECTION: usize = 64;
/// Joins in flight at once, by default (`--join-concurrency`).
const JOIN_CONCURRENCY: usize = 256;
/// Bound on starting a coordinator or etcd.
const START_BOUND: Duration = Duration::from_secs(60);
/// How many `HostHeartbeat` calls a host's relay makes per interval
/// (`cohort::control::FLUSHES_PER_INTERVAL`; this harness does not link the worker crate).
const RELAY_FLUSHES_PER_INTERVAL: u32 = 2;

/// Attempts of a join answered UNAVAILABLE before the run fails.
const JOIN_ATTEMPTS: usize = 20;
/// Joins answered UNAVAILABLE and retried (`joins_retried` in the output).
static JOINS_RETRIED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Hosts' event streams that share one HTTP/2 connection (the relays', apart from the members').
const HOSTS_PER_CONNECTION: usize = 8;

/// Ranks per host at join (hosts of 8, as GPU nodes have), and by default in the steady phase.
const RANKS_PER_HOST: usize = 8;

/// The coordinators' default heartbeat interval (`JobSettings::default`).
const DEFAULT_HEARTBEAT: Duration = Duration::from_millis(500);
/// The job.
const JOB: &str = "scale";

/// What to run.
#[derive(Clone, Debug)]
struct Plan {
    /// Compact answers and `Members` fetches (the default), or the whole list (`full`).
    compact: bool,
    members: usize,
    stores: Vec<String>,
    replicas: usize,
    steady: Duration,
    bound: Duration,
    /// etcd's `--max-txn-ops` and the coordinators' `--etcd-max-txn-ops` (`None`: etcd's
    /// default, 128, and no flag).
    max_txn_ops: Option<u32>,
    /// Members per host, as the workers' host relays see them: each host one event stream
    /// (its members' own streams quiet) and its beats in `HostHeartbeat` calls (1: each
    /// member a full stream and its own `Heartbeat`).
    ranks_per_host: usize,
    /// The coordinators' `--lease-scope` (`member`, the default, or `host`: one store lease
    /// per host of 8 members).
    lease_scope: String,
    /// Joins in flight at once (the harness's members join in waves of this many).
    join_concurrency: usize,
    /// The coordinators' `--whole-answer-up-to` (`None`: no flag, their default of 256).
    whole_answer_up_to: Option<u32>,
}

impl Plan {
    fn from_args() -> Result<Self, String> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let full = args.iter().any(|a| a == "--bench");
        let compact = match std::env::var("COHORT_SCALE_MODE").as_deref() {
            Ok("full") => false,
            Ok("compact") | Err(_) => true,
            Ok(other) => return Err(format!("COHORT_SCALE_MODE={other:?}: compact or full")),
        };
        let mut plan = if full {
            Plan {
                compact,
                members: 1024,
                stores: vec!["memory".into(), "etcd".into()],
                replicas: 2,
                steady: Duration::ZERO,
                bound: Duration::from_secs(300),
                max_txn_ops: None,
                ranks_per_host: RANKS_PER_HOST,
                lease_scope: "member".into(),
                join_concurrency: JOIN_CONCURRENCY,
                whole_answer_up_to: None,
            }
        } else {
            Plan {
                compact,
                members: 96,
                stores: vec!["memory".into()],
                replicas: 1,
                steady: Duration::from_secs(2),
                bound: Duration::from_secs(60),
                max_txn_ops: None,
                ranks_per_host: RANKS_PER_HOST,
                lease_scope: "member".into(),
                join_concurrency: JOIN_CONCURRENCY,
                // The smoke run's 96 members get sparse views, as a large job's do.
                whole_answer_up_to: Some(16),
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
                "--whole-answer-up-to" => {
                    plan.whole_answer_up_to = Some(value(a)?.parse().map_err(|e| format!("--whole-answer-up-to: {e}"))?)
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
}

/// The progress of the store's run in progress (its phases, on stderr), while one runs.
static PROGRESS: std::sync::Mutex<Option<Progress>> = std::sync::Mutex::new(None);

/// Runs `f` with the run's progress, if one is set.
fn with_progress(f: impl FnOnce(&Progress)) {
    if let Some(p) = PROGRESS.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_ref() {
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
        let mut child = command
            .args(["--min-workers", "1", "--max-workers", &max, "--join-window", "60s"])
            // Members send no heartbeats outside the steady phase: a 60 s interval keeps the
            // coordinator from judging their silence (after 2 intervals, a failed rank's
            // host-mates would look lost with it, see `crate::domains`), also when a loaded
            // machine makes a run long. The steady phase beats at the default rate.
            .args(["--heartbeat-interval", "60s", "--lease-ttl", "300s", "--elastic-timeout", "300s"])
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

/// One simulated member.
struct Member {
    client: CoordinatorClient<Channel>,
    id: String,
    incarnation: u64,
}

impl Member {
    async fn join(client: CoordinatorClient<Channel>, i: usize) -> Result<Self, String> {
        let id = format!("m{i:05}");
        // Hosts of 8 ranks, as a GPU node has.
        let host = format!("host{:04}", i / RANKS_PER_HOST);
        let request = pb::JoinRequest {
            job: JOB.into(),
            worker_id: id.clone(),
            host: host.clone(),
            // A TCP address and, as a worker with `--transport auto` publishes, a shared-memory
            // one: the members of a host share memory (the sparse answer's host runs).
            addresses: vec![
                pb::TransportAddress {
                    transport: "tcp".into(),
                    address: format!("127.{}.{}.{}:{}", (i >> 16) & 255, (i >> 8) & 255, i & 255, 40000 + i % 1000),
                },
                pb::TransportAddress { transport: "shm".into(), address: format!("shm1;host={host};nonce={i:016x}") },
            ],
            capabilities: vec!["transport:tcp".into()],
            protocol_version: cohort_proto::PROTOCOL_VERSION,
            domain: String::new(),
            replaces: 0,
        };
        // As a worker's client does: UNAVAILABLE (etcd refusing "too many requests" while a
        // lease per member is granted for every join at once) is retried after 50 ms,
        // doubling to 1 s; every other error fails the run.
        let mut wait = Duration::from_millis(50);
        for _ in 0..JOIN_ATTEMPTS {
            let mut c = client.clone();
            match c.join(request.clone()).await {
                Ok(r) => {
                    return Ok(Self { client, id, incarnation: r.into_inner().incarnation });
                }
                Err(s) if s.code() == tonic::Code::Unavailable => {
                    JOINS_RETRIED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(1));
                }
                Err(s) => return Err(format!("join {id}: {s}")),
            }
        }
        Err(format!("join {id}: still unavailable after {JOIN_ATTEMPTS} attempts"))
    }

    /// Long polls until a generation newer than `after` that includes this member forms and,
    /// in compact mode, fetches the entries of the ranks a member linking on demand needs.
    async fn placed(&self, after: u64, compact: bool) -> Result<Placement, String> {
        let g = self.formed(after, compact).await?;
        // A generation up to the coordinators' `--whole-answer-up-to` is answered whole.
        if !compact || g.rank.is_none() {
            let rank = g
                .members
                .iter()
                .position(|m| m.worker_id == self.id)
                .ok_or_else(|| format!("{} is not in generation {}", self.id, g.number))?;
            return Ok(Placement {
                number: g.number,
                rank: rank as u32,
                size: g.members.len() as u32,
                digest: g.members_digest,
                fetched: Vec::new(),
                full: Some(g),
            });
        }
        let rank = g.rank.ok_or_else(|| format!("{}: a compact answer without a rank", self.id))?;
        if g.size == 0 {
            return Err(format!("{}: not a compact answer ({} members, size 0)", self.id, g.members.len()));
        }
        let mut want = cohort_proto::partner_ranks(rank, g.size);
        if !g.host_runs.is_empty() {
            // The sparse view: the partners and the host run's members.
            let mut start = 0;
            for length in cohort_proto::run_lengths(&g.host_runs, g.size)? {
                if (start..start + length).contains(&rank) {
                    want.extend((start..start + length).filter(|&r| r != rank));
                    break;
                }
                start += length;
            }
            want.sort_unstable();
            want.dedup();
        }
        if !g.members.is_empty() {
            // The partners (and host-mates) came with the answer.
            let got: Vec<u32> = g.members.iter().map(|m| m.rank).collect();
            if got != want {
                return Err(format!("{}: the answer carried partners {got:?}; expected {want:?}", self.id));
            }
            return Ok(Placement {
                number: g.number,
                rank,
                size: g.size,
                digest: g.members_digest,
                fetched: g.members,
                full: None,
            });
        }
        // A coordinator older than `partners` (`COHORT_SCALE_COORDINATOR`): one `Members` call.
        let mut c = self.client.clone();
        let answer = c
            .members(pb::MembersRequest {
                job: JOB.into(),
                worker_id: self.id.clone(),
                incarnation: self.incarnation,
                generation: g.number,
                ranks: want.clone(),
                host: String::new(),
            })
            .await
            .map_err(|s| format!("members {}: {s}", self.id))?
            .into_inner();
        let got: Vec<u32> = answer.members.iter().map(|m| m.rank).collect();
        if answer.members_digest != g.members_digest || answer.generation != g.number || got != want {
            return Err(format!(
                "{}: Members answered generation {} digest {:x} ranks {got:?}; expected {} {:x} {want:?}",
                self.id, answer.generation, answer.members_digest, g.number, g.members_digest
            ));
        }
        Ok(Placement {
            number: g.number,
            rank,
            size: g.size,
            digest: g.members_digest,
            fetched: answer.members,
            full: None,
        })
    }

    /// Long polls until a generation newer than `after` that includes this member forms.
    async fn formed(&self, after: u64, compact: bool) -> Result<pb::Generation, String> {
        loop {
            let mut c = self.client.clone();
            let r = c
                .rendezvous(pb::RendezvousRequest {
                    job: JOB.into(),
                    worker_id: self.id.clone(),
                    incarnation: self.incarnation,
                    after_generation: after,
                    wait_ms: 20_000,
                    compact,
                    partners: compact,
                    layout: compact,
                })
                .await
                .map_err(|s| format!("rendezvous {}: {s}", self.id))?
                .into_inner();
            match r.outcome {
                Some(pb::rendezvous_response::Outcome::Formed(g)) => return Ok(g),
                Some(pb::rendezvous_response::Outcome::Waiting(_)) => continue,
                other => return Err(format!("{}: unexpected rendezvous outcome {other:?}", self.id)),
            }
        }
    }

    /// The member's own watch stream: `quiet` when its host's relay carries the events.
    async fn watch(&self, compact: bool, quiet: bool) -> Result<tonic::Streaming<pb::JobEvent>, String> {
        self.open_watch(self.incarnation, compact, quiet).await
    }

    async fn open_watch(
        &self,
        incarnation: u64,
        compact: bool,
        quiet: bool,
    ) -> Result<tonic::Streaming<pb::JobEvent>, String> {
        open_watch(self.client.clone(), &self.id, incarnation, compact, quiet).await
    }

    fn beat(&self, generation: u64, timing: Option<pb::StepTiming>) -> pb::HeartbeatRequest {
        pb::HeartbeatRequest {
            job: JOB.into(),
            worker_id: self.id.clone(),
            incarnation: self.incarnation,
            generation,
            step: 1,
            activity: "train".into(),
            deadlines: String::new(),
            timing,
        }
    }
}

/// Opens a watch stream for `worker` (incarnation 0: a host relay's, for which the coordinator
/// records no control stream).
async fn open_watch(
    mut client: CoordinatorClient<Channel>,
    worker: &str,
    incarnation: u64,
    compact: bool,
    quiet: bool,
) -> Result<tonic::Streaming<pb::JobEvent>, String> {
    let s = client
        .watch(pb::WatchRequest { job: JOB.into(), worker_id: worker.into(), incarnation, compact, quiet })
        .await
        .map_err(|s| format!("watch {worker}: {s}"))?;
    Ok(s.into_inner())
}

/// Connects `count` channels, spread over the coordinators, on the runtime `on`.
async fn connect_channels(
    on: &tokio::runtime::Handle,
    coordinators: &[Coordinator],
    count: usize,
) -> Result<Vec<CoordinatorClient<Channel>>, String> {
    let mut channels = Vec::with_capacity(count);
    for c in 0..count {
        let addr = coordinators[c % coordinators.len()].addr;
        let channel = on
            .spawn(async move {
                tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                    .map_err(|e| e.to_string())?
                    .connect_timeout(Duration::from_secs(10))
                    .connect()
                    .await
                    .map_err(|e| format!("connecting to {addr}: {e}"))
            })
            .await
            .map_err(|e| format!("connect task: {e}"))??;
        channels.push(CoordinatorClient::new(channel).max_decoding_message_size(64 << 20));
    }
    Ok(channels)
}

/// One host's heartbeats of one interval, as its relay sends them: the number answered.
async fn host_heartbeat(host: &[(Arc<Member>, Option<pb::StepTiming>)], generation: u64) -> u64 {
    let Some((first, _)) = host.first() else { return 0 };
    let mut c = first.client.clone();
    if let [(m, timing)] = host {
        // One rank per host: its own Heartbeat, as a worker without a relay sends it.
        return u64::from(c.heartbeat(m.beat(generation, timing.clone())).await.is_ok());
    }
    let beats = host.iter().map(|(m, timing)| m.beat(generation, timing.clone())).collect();
    match c.host_heartbeat(pb::HostHeartbeatRequest { job: JOB.into(), beats }).await {
        Ok(r) => r
            .into_inner()
            .answers
            .iter()
            .filter(|a| matches!(a.outcome, Some(pb::heartbeat_answer::Outcome::Ok(_))))
            .count() as u64,
        Err(_) => 0,
    }
}

/// Step timings as a worker of a ring job reports them, averaged over the steps since its
/// last heartbeat: a slow member computes three times as long and waits little in the
/// collectives; the others wait for it there. Each waits briefly on its ring neighbours.
fn step_timing(rank: u32, size: u32, slow: bool) -> pb::StepTiming {
    let (compute_us, collective_us) = if slow { (300_000, 10_000) } else { (100_000, 210_000) };
    let neighbours = [(rank + 1) % size, (rank + size - 1) % size];
    pb::StepTiming {
        steps: 5,
        compute_us,
        collective_us,
        peer_waits: neighbours.iter().map(|&rank| pb::PeerWait { rank, wait_us: 1_000 }).collect(),
    }
}

/// Where a member was placed in a generation, and what it fetched.
struct Placement {
    number: u64,
    rank: u32,
    size: u32,
    digest: u64,
    /// Compact mode: the entries of its partners ([`cohort_proto::partner_ranks`]), in rank order.
    fetched: Vec<pb::Member>,
    /// Full mode: the whole answer.
    full: Option<pb::Generation>,
}

/// Checks that every member holds the same generation `number` of `size` members, with its
/// own rank (every rank once), and returns the members' ranks.
fn check_generation(placements: &[&Placement], number: u64, size: usize) -> Result<(), String> {
    let first = placements.first().ok_or("nobody was placed")?;
    let mut seen = vec![false; size];
    for p in placements {
        if p.number != number || p.size as usize != size || p.digest != first.digest {
            return Err(format!(
                "generation {} of {} members (digest {:x}) where {number} of {size} (digest {:x}) was expected",
                p.number, p.size, p.digest, first.digest
            ));
        }
        if p.full.as_ref().is_some_and(|g| Some(g) != first.full.as_ref() || g.members.len() != size) {
            return Err(format!("generation {number}: the whole lists differ"));
        }
        match seen.get_mut(p.rank as usize) {
            Some(s) if !*s => *s = true,
            _ => return Err(format!("generation {number}: rank {} twice or out of range", p.rank)),
        }
    }
    Ok(())
}

/// Reads a watch stream until `pick` matches.
async fn wait_for<T>(
    stream: &mut tonic::Streaming<pb::JobEvent>,
    mut pick: impl FnMut(&Event) -> Option<T>,
) -> Result<T, String> {
    loop {
        match stream.message().await {
            Ok(Some(pb::JobEvent { event: Some(e) })) => {
                if let Some(t) = pick(&e) {
                    return Ok(t);
                }
            }
            Ok(Some(_)) => {}
            Ok(None) => return Err("watch stream ended".into()),
            Err(s) => return Err(format!("watch stream: {s}")),
        }
    }
}

/// Reads a watch stream until it delivers generation 1's revocation.
async fn heard_revocation(stream: &mut tonic::Streaming<pb::JobEvent>) -> Result<(), String> {
    wait_for(stream, |e| matches!(e, Event::GenerationRevoked(x) if x.generation == 1).then_some(())).await
}

/// CPU time of every coordinator, together.
fn cpu_all(cs: &[Coordinator]) -> Duration {
    cs.iter().map(Coordinator::cpu).sum()
}

async fn run(plan: &Plan, store: &str, relays: &tokio::runtime::Handle) -> Result<(), String> {
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
    let connections = n.div_ceil(MEMBERS_PER_CONNECTION);
    let channels = connect_channels(&tokio::runtime::Handle::current(), &coordinators, connections).await?;
    let bound = plan.bound;

    // 1. Formation: join and rendezvous.
    let cpu0 = cpu_all(&coordinators);
    JOINS_RETRIED.store(0, std::sync::atomic::Ordering::Relaxed);
    let started = Instant::now();
    let admit = Arc::new(tokio::sync::Semaphore::new(plan.join_concurrency));
    let compact = plan.compact;
    let joined: Vec<(Member, Placement)> = within(bound, "joining and forming generation 1", async {
        futures::stream::iter(0..n)
            .map(|i| {
                let client = channels[i / MEMBERS_PER_CONNECTION].clone();
                let admit = admit.clone();
                // A task of its own: members' calls (and decoding their answers) spread over
                // the runtime's threads, as members spread over hosts.
                let member = tokio::spawn(async move {
                    let m = {
                        let _permit = admit.acquire().await.map_err(|e| e.to_string())?;
                        Member::join(client, i).await?
                    };
                    let g = m.placed(0, compact).await?;
                    Ok::<_, String>((m, g))
                });
                async move { member.await.map_err(|e| format!("member task: {e}"))? }
            })
            .buffer_unordered(n)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<Vec<_>, String>>()
    })
    .await??;
    let join_to_formed = started.elapsed();
    let joins_retried = JOINS_RETRIED.swap(0, std::sync::atomic::Ordering::Relaxed);
    let cpu_formation = cpu_all(&coordinators) - cpu0;
    phase_end("formation", &mut mark)?;
    check_generation(&joined.iter().map(|(_, p)| p).collect::<Vec<_>>(), 1, n)
        .map_err(|e| format!("generation 1 is not the same {n} members everywhere: {e}"))?;
    let fetched_entries: usize = joined.iter().map(|(_, p)| p.fetched.len()).sum();
    // Members in rank order.
    let mut joined = joined;
    joined.sort_by_key(|(_, p)| p.rank);
    let members: Vec<Arc<Member>> = joined.into_iter().map(|(m, _)| Arc::new(m)).collect();

    // 2. Watches (untimed): every member's own stream and, with relays, one event stream per
    // host (its first member's process serving the relay), as the workers open them.
    let relayed = plan.ranks_per_host > 1;
    let hosts: Vec<std::ops::Range<usize>> =
        (0..n).step_by(plan.ranks_per_host).map(|s| s..(s + plan.ranks_per_host).min(n)).collect();
    let cpu0 = cpu_all(&coordinators);
    let watch_started = Instant::now();
    let heard_formation = |mut s: tonic::Streaming<pb::JobEvent>| async move {
        wait_for(&mut s, |e| matches!(e, Event::GenerationFormed(g) if g.number == 1).then_some(())).await?;
        Ok::<_, String>(s)
    };
    let mut streams = within(bound, "opening the watches", async {
        futures::stream::iter(members.iter())
            .map(|m| async move {
                // A quiet stream too sends the state once (after recording the stream).
                heard_formation(m.watch(compact, relayed).await?).await
            })
            .buffered(JOIN_CONCURRENCY)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<Vec<_>, String>>()
    })
    .await??;
    let mut host_streams = if relayed {
        let relay_channels =
            connect_channels(relays, &coordinators, hosts.len().div_ceil(HOSTS_PER_CONNECTION)).await?;
        within(bound, "opening the hosts' event streams", async {
            futures::stream::iter(hosts.iter().enumerate())
                .map(|(i, h)| {
                    let (client, worker) =
                        (relay_channels[i / HOSTS_PER_CONNECTION].clone(), members[h.start].id.clone());
                    let opened = relays.spawn(async move {
                        heard_formation(open_watch(client, &worker, 0, compact, false).await?).await
                    });
                    async move { opened.await.map_err(|e| format!("relay task: {e}"))? }
                })
                .buffered(JOIN_CONCURRENCY)
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .collect::<Result<Vec<_>, String>>()
        })
        .await??
    } else {
        Vec::new()
    };
    let watches = watch_started.elapsed();
    let cpu_watches = cpu_all(&coordinators) - cpu0;
    // Every member beats once (untimed), as live workers have within the last interval when a
    // failure comes: the failure report finds the failed member's host-mates alive.
    let answered = within(bound, "one round of heartbeats", async {
        let untimed: Vec<_> = members.iter().map(|m| (m.clone(), None)).collect();
        futures::stream::iter(untimed.chunks(plan.ranks_per_host))
            .map(|host| host_heartbeat(host, 1))
            .buffer_unordered(JOIN_CONCURRENCY)
            .collect::<Vec<u64>>()
            .await
    })
    .await?;
    if answered.iter().sum::<u64>() != n as u64 {
        return Err(format!("{} of {n} members' heartbeats answered", answered.iter().sum::<u64>()));
    }
    phase_end("watches", &mut mark)?;

    // 3 and 4. One failure (the last rank), a second during the re-formation (rank 1).
    let (failed, dies_meanwhile) = (n - 1, 1);
    drop(streams.pop()); // the failed member's process is gone: its watch closes (not its host's relay)
    let cpu0 = cpu_all(&coordinators);
    let sent = Instant::now();
    // What one member does on hearing the revocation at `revoked`: rendezvous again, or (the
    // one that dies meanwhile) close its stream and vanish.
    let reform = move |m: Arc<Member>, r: usize, s: tonic::Streaming<pb::JobEvent>, revoked: Instant| async move {
        if r == dies_meanwhile {
            drop(s);
            return Ok::<_, String>((revoked, None));
        }
        let g = m.placed(1, compact).await?;
        Ok((revoked, Some((Instant::now(), g, s))))
    };
    let mut own: Vec<Option<tonic::Streaming<pb::JobEvent>>> = streams.into_iter().map(Some).collect();
    // One task per event stream: a host's relay (on the relays' runtime) hears the revocation
    // and hands it to all its members at once (the relay's hop over its Unix socket, tens of
    // microseconds, is not simulated).
    let tasks: Vec<_> = if relayed {
        hosts
            .iter()
            .zip(std::mem::take(&mut host_streams))
            .map(|(h, mut events)| {
                let ranks: Vec<_> =
                    h.clone().filter(|r| *r != failed).map(|r| (r, members[r].clone(), own[r].take())).collect();
                let heard = relays.spawn(async move {
                    heard_revocation(&mut events).await?;
                    Ok::<_, String>((Instant::now(), events))
                });
                tokio::spawn(async move {
                    let (revoked, events) = heard.await.map_err(|e| format!("relay task: {e}"))??;
                    let each = ranks.into_iter().map(|(r, m, s)| reform(m, r, s.expect("own stream"), revoked));
                    let out = futures::future::join_all(each).await.into_iter().collect::<Result<Vec<_>, String>>()?;
                    Ok::<_, String>((out, Some(events)))
                })
            })
            .collect()
    } else {
        own.iter_mut()
            .enumerate()
            .filter(|(r, _)| *r != failed)
            .map(|(r, s)| {
                let (m, mut s) = (members[r].clone(), s.take().expect("own stream"));
                tokio::spawn(async move {
                    heard_revocation(&mut s).await?;
                    let out = reform(m, r, s, Instant::now()).await?;
                    Ok::<_, String>((vec![out], None))
                })
            })
            .collect()
    };
    let report = {
        let mut c = members[0].client.clone();
        c.report_failure(pb::FailureReport {
            job: JOB.into(),
            worker_id: members[0].id.clone(),
            incarnation: members[0].incarnation,
            generation: 1,
            failed_rank: Some(failed as u32),
            reason: "scale harness: peer failed".into(),
            kind: pb::failure_report::FailureKind::Unspecified as i32,
            progress: None,
        })
        .await
        .map_err(|s| format!("report: {s}"))?
        .into_inner()
    };
    let report_answered = sent.elapsed();
    if !report.accepted {
        return Err("the failure report did not revoke generation 1".into());
    }
    let results = within(bound, "revocation and re-formation", futures::future::join_all(tasks)).await?;
    let mut revoked = Vec::with_capacity(n);
    let mut reformed = Duration::ZERO;
    let mut g2: Vec<Placement> = Vec::new();
    // Survivors' own streams, then the streams that carry events (the hosts', or the same).
    let mut survivors_streams = Vec::new();
    let mut event_streams = Vec::new();
    for r in results {
        let (out, host) = r.map_err(|e| format!("member task: {e}"))??;
        event_streams.extend(host);
        for (at, formed) in out {
            revoked.push(at.duration_since(sent));
            if let Some((at, g, s)) = formed {
                reformed = reformed.max(at.duration_since(sent));
                g2.push(g);
                survivors_streams.push(s);
            }
        }
    }
    if !relayed {
        event_streams = std::mem::take(&mut survivors_streams);
    }
    let cpu_failure = cpu_all(&coordinators) - cpu0;
    phase_end("failure", &mut mark)?;
    check_generation(&g2.iter().collect::<Vec<_>>(), 2, n - 2)
        .map_err(|e| format!("generation 2 is not the same {} survivors everywhere: {e}", n - 2))?;
    // Every entry anyone holds of generation 2 (whole lists, or the fetched links) leaves
    // out the failed member and the one that died meanwhile.
    let left_out = [&members[failed].id, &members[dies_meanwhile].id];
    let mut held = g2.iter().flat_map(|p| p.fetched.iter().chain(p.full.iter().flat_map(|g| g.members.iter())));
    if let Some(m) = held.find(|m| left_out.contains(&&m.worker_id)) {
        return Err(format!("generation 2 holds {} (rank {}), which should be left out", m.worker_id, m.rank));
    }
    revoked.sort();

    // 5. Steady state: heartbeats at the default interval.
    let mut steady = String::new();
    if !plan.steady.is_zero() {
        // In generation-1 rank order, as `g2` and `survivors_streams` are.
        let live: Vec<Arc<Member>> = members
            .iter()
            .enumerate()
            .filter(|(r, _)| *r != failed && *r != dies_meanwhile)
            .map(|(_, m)| m.clone())
            .collect();
        let size = g2.first().map_or(0, |p| p.size);
        let slow = live.len() / 2;
        let slow_id = live[slow].id.clone();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sent_count = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let calls_count = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let with_timing: Vec<_> =
            live.iter().enumerate().map(|(i, m)| (m.clone(), Some(step_timing(g2[i].rank, size, i == slow)))).collect();
        let hosts: Vec<Vec<_>> = with_timing.chunks(plan.ranks_per_host).map(<[_]>::to_vec).collect();
        // A host's relay flushes twice per interval, each flush carrying the beats that came
        // since the last: half the host's members each (one member alone beats every interval).
        let flushes = if plan.ranks_per_host > 1 { RELAY_FLUSHES_PER_INTERVAL } else { 1 };
        let beats: Vec<_> = hosts
            .into_iter()
            .enumerate()
            .map(|(i, host)| {
                let (stop, count, calls) = (stop.clone(), sent_count.clone(), calls_count.clone());
                let halves: Vec<Vec<_>> = (0..flushes as usize)
                    .map(|f| host.iter().skip(f).step_by(flushes as usize).cloned().collect())
                    .collect();
                tokio::spawn(async move {
                    // Spread the hosts over the interval, as independent processes are.
                    let period = DEFAULT_HEARTBEAT / flushes;
                    let offset = period * (i as u32 % 64) / 64;
                    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + offset, period);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    for flush in (0..halves.len()).cycle() {
                        if stop.load(std::sync::atomic::Ordering::Relaxed) {
                            break;
                        }
                        tick.tick().await;
                        count.fetch_add(host_heartbeat(&halves[flush], 2).await, std::sync::atomic::Ordering::Relaxed);
                        calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                })
            })
            .collect();
        // Rank 0's watch names the slow member (the coordinator judges every timed
        // heartbeat against the round of the others' latest reports).
        let beats_started = Instant::now();
        let watch0 = event_streams.first_mut().ok_or("no event stream")?;
        let named = within(
            bound,
            "naming the slow member a straggler",
            wait_for(watch0, |e| match e {
                Event::StragglerNamed(n) => Some(n.worker_id.clone()),
                _ => None,
            }),
        )
        .await??;
        if named != slow_id {
            return Err(format!("the straggler named is {named}, not the slow member {slow_id}"));
        }
        let straggler_named = beats_started.elapsed();
        // A stretch of wall time is what is measured here (not a synchronisation).
        tokio::time::sleep(DEFAULT_HEARTBEAT * 2).await;
        let etcd_cpu = || etcd.as_ref().and_then(EtcdProcess::pid).map_or(Duration::ZERO, cpu_of);
        let calls0 = calls_count.load(std::sync::atomic::Ordering::Relaxed);
        let (cpu0, c0, t0) =
            (cpu_all(&coordinators), sent_count.load(std::sync::atomic::Ordering::Relaxed), Instant::now());
        let (etcd_cpu0, etcd_req0) = (etcd_cpu(), requests()?);
        tokio::time::sleep(plan.steady).await;
        let (cpu1, c1, dt) =
            (cpu_all(&coordinators), sent_count.load(std::sync::atomic::Ordering::Relaxed), t0.elapsed());
        let calls1 = calls_count.load(std::sync::atomic::Ordering::Relaxed);
        let (etcd_cpu1, etcd_req1) = (etcd_cpu(), requests()?);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for b in beats {
            b.abort();
        }
        steady = format!(
            " steady_secs={:.1} ranks_per_host={} heartbeats_per_s={:.0} heartbeat_calls_per_s={:.0} steady_cpu_pct={:.1} \
             straggler_named_ms={:.0}",
            dt.as_secs_f64(),
            plan.ranks_per_host,
            (c1 - c0) as f64 / dt.as_secs_f64(),
            (calls1 - calls0) as f64 / dt.as_secs_f64(),
            100.0 * (cpu1 - cpu0).as_secs_f64() / dt.as_secs_f64(),
            straggler_named.as_secs_f64() * 1000.0
        );
        if etcd.is_some() {
            // What etcd did for the steady phase: its CPU, and its requests per second.
            let rates: Vec<String> = ETCD_METHODS
                .iter()
                .zip(etcd_req1.iter().zip(&etcd_req0))
                .map(|((name, _), (a, b))| format!("{name}:{:.0}", (a - b) / dt.as_secs_f64()))
                .collect();
            steady.push_str(&format!(
                " etcd_steady_cpu_pct={:.1} etcd_steady_per_s={}",
                100.0 * (etcd_cpu1 - etcd_cpu0).as_secs_f64() / dt.as_secs_f64(),
                rates.join(",")
            ));
        }
    }
    drop((survivors_streams, event_streams));

    // 6. Finish: every survivor leaves, finished, at once.
    let cpu0 = cpu_all(&coordinators);
    let started = Instant::now();
    let finishers: Vec<&Member> =
        members.iter().enumerate().filter(|(r, _)| *r != failed && *r != dies_meanwhile).map(|(_, m)| &**m).collect();
    let refusals: Vec<String> = within(bound, "every survivor leaving, finished", async {
        futures::stream::iter(finishers.iter())
            .map(|m| async move {
                let mut c = m.client.clone();
                c.leave(pb::LeaveRequest {
                    job: JOB.into(),
                    worker_id: m.id.clone(),
                    incarnation: m.incarnation,
                    mode: pb::leave_request::Mode::Finished as i32,
                })
                .await
                .err()
                .map(|s| format!("{}: {s}", m.id))
            })
            .buffer_unordered(finishers.len().max(1))
            .filter_map(|refused| async move { refused })
            .collect::<Vec<_>>()
            .await
    })
    .await?;
    let finished = started.elapsed();
    let cpu_finish = cpu_all(&coordinators) - cpu0;
    phase_end("finish", &mut mark)?;
    let late = Member::join(channels[0].clone(), n).await.err().unwrap_or_default();
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
    let mode = if compact { "compact" } else { "full" };
    let mut txn_ops =
        plan.max_txn_ops.filter(|_| etcd.is_some()).map(|n| format!(" max_txn_ops={n}")).unwrap_or_default();
    if plan.lease_scope != "member" {
        txn_ops.push_str(&format!(" lease_scope={}", plan.lease_scope));
    }
    if plan.join_concurrency != JOIN_CONCURRENCY {
        txn_ops.push_str(&format!(" join_concurrency={}", plan.join_concurrency));
    }
    // The results line goes to stdout with the bar gone.
    with_progress(Progress::finish);
    println!(
        "scale store={store} mode={mode} members={n} replicas={replicas}{txn_ops} connections={connections} fetched_per_member={:.1} \
         join_to_formed_ms={:.0} joins_retried={joins_retried} formation_cpu_s={:.2} watches_ms={:.0} watches_cpu_s={:.2} \
         report_ms={:.1} revoked_min_ms={:.1} revoked_p50_ms={:.1} revoked_p99_ms={:.1} revoked_max_ms={:.1} reformed_ms={:.0} failure_cpu_s={:.2}{steady} \
         finish_ms={:.0} finish_cpu_s={:.2} leaves_refused={} ended={ended} peak_rss_mib={}{etcd_out}{phases}",
        fetched_entries as f64 / n as f64,
        ms(join_to_formed),
        cpu_formation.as_secs_f64(),
        ms(watches),
        cpu_watches.as_secs_f64(),
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
        rss.join("+"),
    );
    if let Some(first) = refusals.first() {
        return Err(format!("{} of {} leaves were refused, the first: {first}", refusals.len(), finishers.len()));
    }
    if !ended {
        return Err(format!("the job did not end when every member had finished (a later join: {late:?})"));
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
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    // The hosts' event relays: each is a process on its own host, not busy with its host's
    // members' calls, so their streams are read on a thread of their own.
    let relays = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("scale-relays")
        .enable_all()
        .build()
        .expect("tokio runtime of the relays");
    let mut failed = false;
    runtime.block_on(async {
        eprintln!(
            "scale harness: {} members, stores {:?}, {} CPUs",
            plan.members,
            plan.stores,
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        for store in &plan.stores {
            let t = Instant::now();
            *PROGRESS.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                Some(Progress::new(format!("scale store={store}"), Total::Unknown));
            let result = run(&plan, store, relays.handle()).await;
            // Dropped: the bar is gone before the results are printed.
            PROGRESS.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
            match result {
                Ok(()) => eprintln!("scale store={store}: done in {:.1} s", t.elapsed().as_secs_f64()),
                Err(e) => {
                    let mode = if plan.compact { "compact" } else { "full" };
                    let e = e.replace(['"', '\n'], " ");
                    println!("scale store={store} mode={mode} members={} failed=\"{e}\"", plan.members);
                    failed = true;
                }
            }
        }
    });
    if failed {
        std::process::exit(1);
    }
}
