//! Control-plane benchmark of the coordinator: rendezvous of 256 workers into one
//! generation, and propagation of a revocation to 64 watchers, on the memory store and on a
//! real etcd (a private `etcd` started on free loopback ports).
//!
//! Everything runs in this process over loopback gRPC: one coordinator replica per store and
//! one tonic client (its own connection) per worker, all on one multi-threaded runtime, so
//! clients and coordinator share the machine's cores. Every figure is printed as one line of
//! `key=value` pairs, for example
//!
//! ```text
//! bench=rendezvous store=memory workers=256 runs=5 median_ms=.. min_ms=.. max_ms=..
//! bench=revocation store=memory watchers=64 runs=30 last_p50_ms=.. last_p99_ms=.. last_max_ms=.. all_p99_ms=..
//! bench=steady store=memory workers=256 joiners=32 heartbeat_ms=100 seconds=5 heartbeats_per_s=.. coordinator_cpu_pct=..
//! ```
//!
//! `steady` is the exception to "everything in this process": it runs the real
//! `cohort-coordinator` binary, so that its CPU time (from `/proc`) is the coordinator's
//! alone, while this process's clients keep a job's members heartbeating and a few joiners
//! long-polling the rendezvous, as a running job does between re-formations.
//!
//! Run it with `cargo bench -p cohort-coordinator --bench control_plane`. Without `--bench`
//! on its command line (`cargo test --benches`) it runs a one-iteration smoke version on the
//! memory store only.
//!
//! Sizes come from the environment (for the scale figures of issue 30):
//! - `COHORT_BENCH_MEMBERS=1024,4096,16384`: the rendezvous is measured at each count
//!   (default 256);
//! - `COHORT_BENCH_WATCHERS=1024,16384`: the revocation likewise (default 64);
//! - `COHORT_BENCH_RUNS=N`: measured runs of each (default 5 rendezvous, 30 revocation);
//! - `COHORT_BENCH_STORES=memory,etcd`: the stores (default both).
//!
//! Workers share HTTP/2 connections, at most 1,024 of them per run (one each up to 1,024
//! workers, then `ceil(n / 1024)` to a connection), since a process has a bounded number of
//! descriptors and the coordinator serves both ends here. Targets are reported in
//! docs/benchmarks-journal.md ("Control plane"), never asserted here. Every wait has a
//! deadline, so a stuck coordinator fails the bench instead of hanging it.

#[path = "../tests/common/mod.rs"]
mod common;

use cohort_coordinator::config::JobSettings;
use cohort_coordinator::keys;
use cohort_coordinator::store::{etcd::EtcdStore, memory::MemoryStore, Store};
use cohort_proto::v1 as pb;
use cohort_proto::v1::job_event::Event;
use cohort_testkit::etcd::EtcdProcess;
use common::{form_all, replica, wait_event, Backend, Options, Worker};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Workers in the rendezvous benchmark, unless `COHORT_BENCH_MEMBERS` says otherwise.
const RENDEZVOUS_WORKERS: usize = 256;
/// Watchers (members of one generation) in the revocation benchmark, unless
/// `COHORT_BENCH_WATCHERS` says otherwise.
const REVOCATION_WATCHERS: usize = 64;
/// Most connections one run opens (workers share them beyond this).
const MAX_CONNECTIONS: usize = 1024;
/// Joins in flight at once while a run is set up.
const JOINS_IN_FLIGHT: usize = 64;
/// Bound on one measured rendezvous (all workers formed).
const RENDEZVOUS_BOUND: Duration = Duration::from_secs(60);
/// Bound on one revocation reaching every watcher.
const REVOCATION_BOUND: Duration = Duration::from_secs(20);
/// Bound on the untimed setup of one run (joins, formation, opening watches) and cleanup.
const SETUP_BOUND: Duration = Duration::from_secs(120);
/// Bound on starting a store (an etcd process) and a replica.
const START_BOUND: Duration = Duration::from_secs(60);

/// How many iterations each benchmark runs.
#[derive(Clone)]
struct Plan {
    rendezvous_runs: usize,
    revocation_runs: usize,
    stores: Vec<Backend>,
    /// Worker counts of the rendezvous benchmark.
    members: Vec<usize>,
    /// Watcher counts of the revocation benchmark.
    watchers: Vec<usize>,
    /// Members, waiting joiners and the measured window of the steady-state benchmark.
    steady: (usize, usize, Duration),
}

impl Plan {
    fn full() -> Self {
        Self {
            rendezvous_runs: 5,
            revocation_runs: 30,
            stores: vec![Backend::Memory, Backend::Etcd],
            members: vec![RENDEZVOUS_WORKERS],
            watchers: vec![REVOCATION_WATCHERS],
            steady: (256, 32, Duration::from_secs(5)),
        }
    }

    fn smoke() -> Self {
        Self {
            rendezvous_runs: 1,
            revocation_runs: 2,
            stores: vec![Backend::Memory],
            members: vec![RENDEZVOUS_WORKERS],
            watchers: vec![REVOCATION_WATCHERS],
            steady: (8, 2, Duration::from_millis(500)),
        }
    }

    /// This plan with the sizes, runs and stores the environment names (see the module
    /// docs); a malformed value is an error naming the variable.
    fn with_env(mut self) -> Result<Self, String> {
        fn var(name: &str) -> Option<String> {
            std::env::var(name).ok().filter(|v| !v.trim().is_empty())
        }
        fn counts(name: &str, value: &str) -> Result<Vec<usize>, String> {
            value
                .split(',')
                .map(|c| match c.trim().parse::<usize>() {
                    Ok(n) if n >= 2 => Ok(n),
                    _ => Err(format!("{name}: {c:?} is not a count of at least 2")),
                })
                .collect()
        }
        if let Some(v) = var("COHORT_BENCH_MEMBERS") {
            self.members = counts("COHORT_BENCH_MEMBERS", &v)?;
        }
        if let Some(v) = var("COHORT_BENCH_WATCHERS") {
            self.watchers = counts("COHORT_BENCH_WATCHERS", &v)?;
        }
        if let Some(v) = var("COHORT_BENCH_RUNS") {
            let runs = v.trim().parse::<usize>().ok().filter(|r| *r > 0);
            let runs = runs.ok_or_else(|| format!("COHORT_BENCH_RUNS: {v:?} is not a positive count"))?;
            self.rendezvous_runs = runs;
            self.revocation_runs = runs;
        }
        if let Some(v) = var("COHORT_BENCH_STORES") {
            self.stores = v
                .split(',')
                .map(|s| match s.trim() {
                    "memory" => Ok(Backend::Memory),
                    "etcd" => Ok(Backend::Etcd),
                    other => Err(format!("COHORT_BENCH_STORES: {other:?} is neither memory nor etcd")),
                })
                .collect::<Result<_, _>>()?;
        }
        Ok(self)
    }
}
/// Heartbeat interval of the steady-state benchmark's members.
const STEADY_HEARTBEAT: Duration = Duration::from_millis(100);

fn store_name(backend: Backend) -> &'static str {
    match backend {
        Backend::Memory => "memory",
        Backend::Etcd => "etcd",
    }
}

/// Awaits `f` for at most `bound`, panicking with `what` when it takes longer.
async fn within<T>(bound: Duration, what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(bound, f).await {
        Ok(t) => t,
        Err(_) => panic!("{what}: no result within {bound:?}"),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Nearest-rank percentile (`p` in 0..=100) of sorted samples.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    assert!(!sorted.is_empty(), "percentile of no samples");
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A store for one benchmark, with the etcd behind it kept alive.
struct Bed {
    store: Arc<dyn Store>,
    _etcd: Option<EtcdProcess>,
}

async fn bed(backend: Backend) -> Result<Bed, String> {
    match backend {
        Backend::Memory => Ok(Bed { store: Arc::new(MemoryStore::new()), _etcd: None }),
        Backend::Etcd => {
            let etcd = tokio::task::spawn_blocking(EtcdProcess::start)
                .await
                .map_err(|e| format!("etcd start task: {e}"))?
                .map_err(|e| e.to_string())?;
            let store = EtcdStore::connect(&[etcd.endpoint()]).await.map_err(|e| e.to_string())?;
            Ok(Bed { store: Arc::new(store), _etcd: Some(etcd) })
        }
    }
}

/// Settings for a job of exactly `n` workers that forms as soon as all `n` wait (the join
/// window and lease TTL are long: nothing may form or lapse by timer during a run).
fn settings(n: usize) -> JobSettings {
    JobSettings {
        min_workers: 1,
        max_workers: n as u32,
        join_window: Duration::from_secs(30),
        heartbeat_interval: Duration::from_secs(10),
        lease_ttl: Duration::from_secs(120),
        elastic_timeout: Duration::from_secs(120),
        ..Default::default()
    }
}

/// Joins `n` workers to `job`, [`JOINS_IN_FLIGHT`] at a time, over at most
/// [`MAX_CONNECTIONS`] connections, with no heartbeats (the lease TTL outlasts a run).
async fn join_workers(addr: SocketAddr, job: &str, n: usize) -> Vec<Worker> {
    use futures::StreamExt;
    let per_connection = n.div_ceil(MAX_CONNECTIONS);
    let mut clients = Vec::with_capacity(n.div_ceil(per_connection));
    for _ in 0..n.div_ceil(per_connection) {
        clients.push(common::client(addr).await);
    }
    let joins = (0..n).map(|i| {
        let client = clients[i / per_connection].clone();
        async move {
            let request = common::join_request(job, &format!("w{i:03}"));
            Worker::join_on(client, request).await.unwrap_or_else(|s| panic!("join w{i:03}: {s}"))
        }
    });
    futures::stream::iter(joins).buffered(JOINS_IN_FLIGHT).collect().await
}

/// Removes a job from the store (its keys, then its members' leases), so that it costs the
/// coordinator nothing during the next run.
async fn remove_job(store: &Arc<dyn Store>, job: &str, workers: Vec<Worker>) {
    store.delete_prefix(&keys::job_prefix(job)).await.expect("delete the job's keys");
    let revokes = workers.iter().map(|w| store.revoke_lease(w.incarnation as i64));
    for r in futures::future::join_all(revokes).await {
        r.expect("revoke a member's lease");
    }
}

/// Every worker's first generation, checked to be the same one; returns it. Each answer is
/// reduced to a digest as it arrives: N copies of an N-member generation would not fit in
/// memory at 16,384 members.
async fn form_everyone(workers: &[Worker]) -> pb::Generation {
    fn digest(g: &pb::Generation) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        g.number.hash(&mut h);
        for m in &g.members {
            (m.rank, &m.worker_id, m.incarnation).hash(&mut h);
        }
        h.finish()
    }
    let polls = workers.iter().enumerate().map(|(i, w)| async move {
        let g = w.next_generation(0).await;
        (digest(&g), (i == 0).then_some(g))
    });
    let mut answers = futures::future::join_all(polls).await;
    let (expected, first) = answers.swap_remove(0);
    assert!(answers.iter().all(|(d, _)| *d == expected), "every worker has the same generation");
    first.expect("the first worker's generation is kept")
}

/// One rendezvous of `n` freshly joined workers; returns the time from the moment all of
/// them start waiting until every one has the (same) generation.
async fn rendezvous_once(store: &Arc<dyn Store>, addr: SocketAddr, job: &str, n: usize) -> Duration {
    let workers = within(SETUP_BOUND, "joining the workers", join_workers(addr, job, n)).await;
    let started = Instant::now();
    let g = within(RENDEZVOUS_BOUND, "rendezvous", form_everyone(&workers)).await;
    let elapsed = started.elapsed();
    assert_eq!(g.members.len(), n, "every worker is placed");
    within(SETUP_BOUND, "removing the job", remove_job(store, job, workers)).await;
    elapsed
}

async fn bench_rendezvous(backend: Backend, n: usize, runs: usize) {
    let name = store_name(backend);
    let bed = match within(START_BOUND, "starting the store", bed(backend)).await {
        Ok(b) => b,
        Err(e) => {
            println!("bench=rendezvous store={name} skipped=\"{}\"", e.replace(['"', '\n'], " "));
            return;
        }
    };
    let server =
        within(START_BOUND, "starting a replica", replica(bed.store.clone(), &Options::new(settings(n)))).await;
    let addr = server.local_addr();
    // Warm-up (untimed): the replica leads and forms generations.
    rendezvous_once(&bed.store, addr, &format!("rdv-{name}-{n}-warmup"), n).await;
    let mut times = Vec::with_capacity(runs);
    for run in 0..runs {
        let t = rendezvous_once(&bed.store, addr, &format!("rdv-{name}-{n}-{run}"), n).await;
        eprintln!("rendezvous store={name} run={run}: {:.1} ms", ms(t));
        times.push(t);
    }
    times.sort();
    println!(
        "bench=rendezvous store={name} workers={n} runs={runs} median_ms={:.1} min_ms={:.1} max_ms={:.1}",
        ms(percentile(&times, 50.0)),
        ms(times[0]),
        ms(times[runs - 1]),
    );
    within(START_BOUND, "stopping the replica", server.shutdown()).await.expect("shutdown");
}

/// One revocation: `n` members of a fresh generation watch; rank 0 reports rank n-1 failed.
/// Returns each watcher's latency from just before the report was sent to its
/// GenerationRevoked event.
async fn revocation_once(store: &Arc<dyn Store>, addr: SocketAddr, job: &str, n: usize) -> Vec<Duration> {
    let (workers, streams) = within(SETUP_BOUND, "forming a generation and opening watches", async {
        let workers = join_workers(addr, job, n).await;
        let g = form_everyone(&workers).await;
        assert_eq!((g.number, g.members.len()), (1, n));
        let mut streams = Vec::with_capacity(n);
        for w in &workers {
            let mut s = w.watch().await;
            // A new watcher first hears the current state: generation 1, formed.
            wait_event(&mut s, |e| matches!(e, Event::GenerationFormed(g) if g.number == 1).then_some(())).await;
            streams.push(s);
        }
        // Rank 0 reports; rank n-1 is the failed peer.
        let order: std::collections::HashMap<&str, u32> =
            g.members.iter().map(|m| (m.worker_id.as_str(), m.rank)).collect();
        let mut workers = workers;
        workers.sort_by_key(|w| order.get(w.id.as_str()).copied());
        (workers, streams)
    })
    .await;
    let watchers: Vec<_> = streams
        .into_iter()
        .map(|mut s| {
            tokio::spawn(async move {
                wait_event(&mut s, |e| match e {
                    Event::GenerationRevoked(r) if r.generation == 1 => Some(()),
                    _ => None,
                })
                .await;
                Instant::now()
            })
        })
        .collect();
    // Let the watcher tasks start waiting before the clock starts.
    tokio::task::yield_now().await;
    let sent = Instant::now();
    let report =
        within(REVOCATION_BOUND, "failure report", workers[0].report(1, Some(n as u32 - 1), "bench: peer failed"))
            .await;
    assert!(report.expect("report").accepted, "the report revokes generation 1");
    let mut latencies = Vec::with_capacity(n);
    for received in
        within(REVOCATION_BOUND, "revocation reaching every watcher", futures::future::join_all(watchers)).await
    {
        latencies.push(received.expect("watcher task").duration_since(sent));
    }
    within(SETUP_BOUND, "removing the job", remove_job(store, job, workers)).await;
    latencies
}

async fn bench_revocation(backend: Backend, n: usize, runs: usize) {
    let name = store_name(backend);
    let bed = match within(START_BOUND, "starting the store", bed(backend)).await {
        Ok(b) => b,
        Err(e) => {
            println!("bench=revocation store={name} skipped=\"{}\"", e.replace(['"', '\n'], " "));
            return;
        }
    };
    let server =
        within(START_BOUND, "starting a replica", replica(bed.store.clone(), &Options::new(settings(n)))).await;
    let addr = server.local_addr();
    revocation_once(&bed.store, addr, &format!("rev-{name}-{n}-warmup"), n).await;
    let mut last = Vec::with_capacity(runs);
    let mut all = Vec::with_capacity(runs * n);
    for run in 0..runs {
        let mut l = revocation_once(&bed.store, addr, &format!("rev-{name}-{n}-{run}"), n).await;
        l.sort();
        eprintln!("revocation store={name} run={run}: first {:.2} ms, last {:.2} ms", ms(l[0]), ms(l[n - 1]));
        last.push(l[n - 1]);
        all.extend(l);
    }
    last.sort();
    all.sort();
    println!(
        "bench=revocation store={name} watchers={n} runs={runs} last_p50_ms={:.2} last_p99_ms={:.2} last_max_ms={:.2} all_p99_ms={:.2} all_p50_ms={:.2}",
        ms(percentile(&last, 50.0)),
        ms(percentile(&last, 99.0)),
        ms(last[runs - 1]),
        ms(percentile(&all, 99.0)),
        ms(percentile(&all, 50.0)),
    );
    within(START_BOUND, "stopping the replica", server.shutdown()).await.expect("shutdown");
}

/// The `cohort-coordinator` binary, serving on a free port; killed when dropped.
struct CoordinatorProcess {
    child: std::process::Child,
    addr: SocketAddr,
}

impl Drop for CoordinatorProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl CoordinatorProcess {
    /// Starts it (memory store) with `args`; waits (bounded) for its `listening on` line.
    fn start(args: &[&str]) -> Result<Self, String> {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_cohort-coordinator"))
            .args(["serve", "--listen", "127.0.0.1:0", "--store", "memory"])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| format!("starting cohort-coordinator: {e}"))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        // Its `listening on` line (after a `metrics on` one, when it serves metrics).
        let addr = cohort_coordinator::announce::await_listening(stdout, START_BOUND)?;
        Ok(Self { child, addr })
    }

    /// CPU time the process has used so far (user + system), from `/proc/PID/stat`.
    fn cpu_time(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).expect("read /proc/PID/stat");
        // Fields after the command name (which is in parentheses): utime and stime are the
        // 12th and 13th of them, in clock ticks.
        let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
        let fields: Vec<u64> = rest.split_whitespace().map(|f| f.parse().unwrap_or(0)).collect();
        // SAFETY: sysconf with a valid name has no preconditions.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
        Duration::from_micros((fields[11] + fields[12]) * 1_000_000 / ticks)
    }
}

/// A job between re-formations: `members` in one generation heartbeating every
/// [`STEADY_HEARTBEAT`], `joiners` more long-polling the rendezvous (the job is at
/// `max_workers`, so they wait), for `window`; reports the coordinator's CPU use.
async fn bench_steady(members: usize, joiners: usize, window: Duration) {
    let heartbeat = format!("{}ms", STEADY_HEARTBEAT.as_millis());
    let max = members.to_string();
    let coordinator = match CoordinatorProcess::start(&[
        "--min-workers",
        "1",
        "--max-workers",
        &max,
        "--join-window",
        "30s",
        "--heartbeat-interval",
        &heartbeat,
        "--lease-ttl",
        "60s",
    ]) {
        Ok(c) => c,
        Err(e) => {
            println!("bench=steady store=memory skipped=\"{}\"", e.replace(['"', '\n'], " "));
            return;
        }
    };
    let addr = coordinator.addr;
    let (workers, polls) = within(SETUP_BOUND, "forming the job and starting the joiners", async {
        let mut workers = Vec::with_capacity(members);
        for i in 0..members {
            workers.push(Worker::join(addr, "steady", &format!("m{i:03}"), STEADY_HEARTBEAT).await);
        }
        let g = form_all(&workers, 0).await.remove(0);
        assert_eq!(g.members.len(), members);
        let mut polls = Vec::with_capacity(joiners);
        for i in 0..joiners {
            let w = Worker::join(addr, "steady", &format!("j{i:03}"), STEADY_HEARTBEAT).await;
            polls.push(tokio::spawn(async move {
                loop {
                    // Waiting answers come back every few seconds; nothing forms.
                    if w.rendezvous(0, Duration::from_secs(5)).await.is_err() {
                        return;
                    }
                }
            }));
        }
        (workers, polls)
    })
    .await;
    // Warm-up, not synchronisation: let the joiners' first polls and the heartbeats settle
    // into their rhythm before the measured window (itself a stretch of wall time).
    tokio::time::sleep(STEADY_HEARTBEAT * 5).await;
    let (cpu0, t0) = (coordinator.cpu_time(), Instant::now());
    tokio::time::sleep(window).await;
    let (cpu1, elapsed) = (coordinator.cpu_time(), t0.elapsed());
    let per_s = (members + joiners) as f64 / STEADY_HEARTBEAT.as_secs_f64();
    println!(
        "bench=steady store=memory workers={members} joiners={joiners} heartbeat_ms={} seconds={:.1} heartbeats_per_s={per_s:.0} coordinator_cpu_pct={:.1}",
        STEADY_HEARTBEAT.as_millis(),
        elapsed.as_secs_f64(),
        100.0 * (cpu1 - cpu0).as_secs_f64() / elapsed.as_secs_f64()
    );
    for p in polls {
        p.abort();
    }
    drop(workers);
}

fn main() {
    let plan = if std::env::args().any(|a| a == "--bench") { Plan::full() } else { Plan::smoke() };
    let plan = plan.with_env().unwrap_or_else(|e| {
        eprintln!("control-plane bench: {e}");
        std::process::exit(2)
    });
    // `cargo bench --bench control_plane -- steady` runs the benchmarks whose name contains
    // the filter (rendezvous, revocation, steady).
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-')).unwrap_or_default();
    let wanted = |name: &str| name.contains(filter.as_str());
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    runtime.block_on(async {
        eprintln!(
            "control-plane bench: {} worker threads, {} CPUs",
            tokio::runtime::Handle::current().metrics().num_workers(),
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        for &backend in plan.stores.iter().filter(|_| wanted("rendezvous")) {
            for &n in &plan.members {
                bench_rendezvous(backend, n, plan.rendezvous_runs).await;
            }
        }
        for &backend in plan.stores.iter().filter(|_| wanted("revocation")) {
            for &n in &plan.watchers {
                bench_revocation(backend, n, plan.revocation_runs).await;
            }
        }
        if wanted("steady") {
            let (members, joiners, window) = plan.steady;
            bench_steady(members, joiners, window).await;
        }
    });
}
