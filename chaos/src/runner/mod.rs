//! Running a scenario: start the cluster, strike each fault at its moment, wait (bounded)
//! for the job to react, then check the invariants and measure.
//!
//! Every wait is on worker events with a deadline (`Run::pump`); the only timed waits are
//! the faults' own durations (a SIGSTOP lasting 3 s, a blackhole lasting at most 5 s),
//! which are the schedule of the scenario, not synchronisation. Due timers (SIGCONT,
//! healing a link, restarting coordinators or etcd, the slow rank's duty cycle) fire while
//! events are awaited.

use crate::cluster::{Cluster, ClusterConfig, ClusterError, DataPlaneFlags, JobSettings, Network, WorkerSpec};
use crate::demo::Check;
use crate::events::{self as ev, Event, EventKind, WorkerEvent};
use crate::invariants;
use crate::process::now_ms;
use crate::proxy::LinkRule;
use crate::report::{ErrorSeen, FaultRecord, RunReport, StatusSeen, StragglerSeen};
use crate::scenario::{parse_bytes, Expect, FaultKind, FaultSpec, NetworkChoice, Scenario};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;
use tokio::time::Instant;

mod checks;
mod fault;

/// How to run.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Seed (overrides the scenario's).
    pub seed: Option<u64>,
    /// Where this run's logs go (a fresh temp dir if `None`).
    pub log_dir: Option<PathBuf>,
    /// Keep the logs of a passing run too.
    pub keep_logs: bool,
    /// Print the run's progress.
    pub verbose: bool,
}

/// Why a run could not complete.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Launcher failure or a bounded wait that ran out.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// The scenario cannot be played on this cluster (e.g. a rank beyond the world).
    #[error("{0}")]
    Scenario(String),
}

#[derive(Clone, Debug)]
enum Action {
    Signal(String, i32),
    /// Clear the link faults on these directed pairs (hosts with network namespaces, workers
    /// through the proxy).
    Heal(Vec<(String, String)>),
    /// Plug these hosts back into the network (network namespaces).
    Plug(Vec<String>),
    RestartCoordinators(Vec<usize>),
    RestartEtcd,
    SlowStop {
        worker: String,
        until: Instant,
        stop_for: Duration,
        run_for: Duration,
    },
    SlowCont {
        worker: String,
        until: Instant,
        stop_for: Duration,
        run_for: Duration,
    },
}

/// What the harness knows about the job, from the events.
#[derive(Default)]
struct View {
    members: BTreeMap<i64, BTreeMap<i64, String>>,
    worlds: BTreeMap<i64, i64>,
    max_step: i64,
    last: BTreeMap<String, EventKind>,
}

impl View {
    fn see(&mut self, e: &WorkerEvent) {
        match &e.event {
            Event::Generation(g) => {
                self.members.entry(g.gen as i64).or_default().insert(i64::from(g.rank), e.worker.clone());
                self.worlds.insert(g.gen as i64, g.world as i64);
            }
            Event::Step(s) => self.max_step = self.max_step.max(s.step as i64),
            _ => {}
        }
        self.last.insert(e.worker.clone(), e.kind());
    }

    fn current(&self) -> i64 {
        self.members.keys().next_back().copied().unwrap_or(0)
    }

    fn complete(&self, g: i64) -> bool {
        self.members.get(&g).map(|m| m.len() as i64) == self.worlds.get(&g).copied()
    }
}

/// One harness action on a worker, for the no-hang check.
#[derive(Clone, Debug)]
struct Signalled {
    worker: String,
    signal: i32,
    at_ms: u64,
}

struct Run<'a> {
    sc: &'a Scenario,
    cluster: Cluster,
    rng: StdRng,
    spec: WorkerSpec,
    timers: Vec<(Instant, Action)>,
    view: View,
    signals: Vec<Signalled>,
    next_worker: u32,
    run_deadline: Instant,
    records: Vec<FaultRecord>,
    killed: BTreeSet<String>,
    leaving: BTreeSet<String>,
    stopped: BTreeSet<String>,
    quiet: Vec<(u64, u64, usize)>,
    /// Per disruptive fault: no survivor kept a dead generation's shared-memory objects;
    /// after a fault on a node's relay server, another pod served the relay.
    fault_checks: Vec<Check>,
    verbose: bool,
    start_ms: u64,
}

/// Runs `scenario` once; never panics, always returns a report (with `error` set when the
/// run could not complete). Every process is gone when it returns.
///
/// # Cancel safety
/// Cancel safe: dropping it kills every process of the run (logs stay in the log dir).
pub async fn run(scenario: &Scenario, opts: &RunOptions) -> RunReport {
    let seed = opts.seed.unwrap_or(scenario.seed);
    let started = std::time::Instant::now();
    let (log_dir, own_dir) = match &opts.log_dir {
        Some(d) => (d.clone(), false),
        None => (std::env::temp_dir().join(format!("cohort-chaos-{}-{}-{}", scenario.name, seed, now_ms())), true),
    };
    let mut report = RunReport {
        scenario: scenario.name.clone(),
        seed,
        passed: false,
        error: None,
        checks: Vec::new(),
        faults: Vec::new(),
        wall_ms: 0,
        log_dir: Some(log_dir.display().to_string()),
        proxy: None,
        skipped: None,
    };
    let bound = scenario.timeout.0;
    match tokio::time::timeout(bound + Duration::from_secs(30), run_inner(scenario, seed, &log_dir, opts.verbose)).await
    {
        Ok((records, checks, proxy, error)) => {
            report.faults = records;
            report.checks = checks;
            report.proxy = proxy;
            report.error = error;
        }
        Err(_) => report.error = Some(format!("the run exceeded its bound ({} s) — a hang", bound.as_secs() + 30)),
    }
    report.passed = report.error.is_none() && report.checks.iter().all(|c| c.ok);
    report.wall_ms = started.elapsed().as_millis() as u64;
    if report.passed && !opts.keep_logs && own_dir {
        let _ = std::fs::remove_dir_all(&log_dir);
        report.log_dir = None;
    }
    report
}

type Outcome = (Vec<FaultRecord>, Vec<Check>, Option<crate::proxy::ProxyStats>, Option<String>);

async fn run_inner(sc: &Scenario, seed: u64, log_dir: &std::path::Path, verbose: bool) -> Outcome {
    let config = ClusterConfig {
        job: format!("chaos-{}-{seed}", sc.name).replace('_', "-"),
        store: sc.store,
        coordinators: sc.coordinators as usize,
        settings: JobSettings {
            min_workers: sc.min_workers,
            max_workers: sc.max_workers,
            join_window: sc.join_window.0,
            heartbeat_interval: sc.heartbeat_interval.0,
            lease_ttl: sc.lease_ttl.0,
            elastic_timeout: sc.elastic_timeout.0,
            straggler_policy: sc
                .straggler_policy
                .as_deref()
                .and_then(|p| cohort_coordinator::config::StragglerPolicy::parse(p).ok())
                .unwrap_or_default(),
            straggler_cooldown: sc.straggler_cooldown.map_or(JobSettings::default().straggler_cooldown, |d| d.0),
            lease_scope: sc
                .lease_scope
                .as_deref()
                .and_then(|p| cohort_coordinator::config::LeaseScope::parse(p).ok())
                .unwrap_or_default(),
            whole_answer_up_to: sc.whole_answer_up_to.unwrap_or(JobSettings::default().whole_answer_up_to),
        },
        log_dir: Some(log_dir.to_path_buf()),
        exclusion: None,
        metrics: false,
    };
    let network = if sc.network == NetworkChoice::Netns { Network::Namespaces } else { Network::Loopback };
    let cluster = match Cluster::start_on(config, network).await {
        Ok(c) => c,
        Err(e) => return (Vec::new(), Vec::new(), None, Some(format!("starting the cluster: {e}"))),
    };
    let spec = WorkerSpec {
        steps: sc.steps,
        size: sc.size.clone(),
        step_interval: sc.step_interval.0,
        no_progress: sc.no_progress.0,
        fixed_deadlines: sc.fixed_deadlines,
        extra_args: {
            let mut args = Vec::new();
            if !sc.compute.0.is_zero() {
                args.extend(["--compute".into(), format!("{}us", sc.compute.0.as_micros())]);
            }
            if let Some(every) = sc.alltoall_every {
                args.extend(["--alltoall-every".into(), every.to_string()]);
            }
            args
        },
        command: sc.worker_command.clone(),
    };
    let mut run = Run {
        sc,
        cluster,
        rng: StdRng::seed_from_u64(seed),
        spec,
        timers: Vec::new(),
        view: View::default(),
        signals: Vec::new(),
        next_worker: 0,
        run_deadline: Instant::now() + sc.timeout.0,
        records: Vec::new(),
        killed: BTreeSet::new(),
        leaving: BTreeSet::new(),
        stopped: BTreeSet::new(),
        quiet: Vec::new(),
        fault_checks: Vec::new(),
        verbose,
        start_ms: now_ms(),
    };
    if sc.needs_proxy() {
        run.cluster.enable_proxy();
    }
    run.cluster.set_ranks_per_host(sc.ranks_per_host as usize);
    if let Err(e) = run.cluster.set_pods_per_node(sc.pods_per_node as usize) {
        return (Vec::new(), Vec::new(), None, Some(format!("setting up the nodes: {e}")));
    }
    run.cluster.set_data_plane(DataPlaneFlags { transport: sc.transport.clone(), algorithm: sc.algorithm.clone() });
    // A generation that includes a member which died before it formed can only fail its
    // mesh connection; bound that by the job's deadlines rather than the 30 s default.
    run.cluster.set_connect_timeout(Some((sc.no_progress.0 * 2).max(Duration::from_secs(4))));
    let error = run.play().await.err().map(|e| e.to_string());
    // Whatever happened: continue stopped workers, heal links, restart what is down.
    run.fire_all_timers().await;
    if let Some(p) = run.cluster.proxy() {
        p.heal_all();
    }
    let left = run.run_deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(5));
    let codes = run.cluster.wait_workers(if error.is_some() { Duration::from_secs(3) } else { left }).await;
    let end_ms = now_ms();
    let mut checks = run.checks(&codes, end_ms);
    let crashed = run.cluster.crashed_coordinators();
    checks.push(Check {
        what: "no coordinator crashed".into(),
        ok: crashed.is_empty(),
        detail: format!("{crashed:?}"),
    });
    let records = run.measure();
    let proxy = run.cluster.proxy().map(|p| p.stats());
    if let Some(p) = run.cluster.proxy() {
        p.shutdown();
    }
    (records, checks, proxy, error)
}

/// Faults whose targets are not among the survivors of their generation.
fn kill_like(kind: FaultKind) -> bool {
    matches!(kind, FaultKind::Kill | FaultKind::Stop | FaultKind::Term | FaultKind::Isolate)
}

impl Run<'_> {
    fn say(&self, text: impl AsRef<str>) {
        if self.verbose {
            println!("[{:>7.3}s] {}: {}", (now_ms() - self.start_ms) as f64 / 1e3, self.sc.name, text.as_ref());
        }
    }

    /// The hosts of `workers` (each once, in order); a worker's own name where it has no
    /// host (the loopback, where no host fault applies).
    fn hosts_of(&self, workers: &[String]) -> Vec<String> {
        let mut hosts: Vec<String> = Vec::new();
        for w in workers {
            let h = self.cluster.worker_host(w).unwrap_or(w).to_string();
            if !hosts.contains(&h) {
                hosts.push(h);
            }
        }
        hosts
    }

    /// Directed worker pairs as directed host pairs, each once, without the pairs inside one
    /// host (a route cannot come between them).
    fn host_pairs(&self, pairs: Vec<(String, String)>) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        for (a, b) in pairs {
            let (ha, hb) = (
                self.cluster.worker_host(&a).unwrap_or(&a).to_string(),
                self.cluster.worker_host(&b).unwrap_or(&b).to_string(),
            );
            if ha != hb && !out.contains(&(ha.clone(), hb.clone())) {
                out.push((ha, hb));
            }
        }
        out
    }

    /// Each worker's newest generation, from its events.
    fn generation_of(&self, worker: &str) -> Option<i64> {
        self.cluster
            .events
            .iter()
            .rev()
            .filter(|e| e.worker == worker)
            .find_map(|e| e.get::<ev::Generation>())
            .map(|g| g.gen as i64)
    }

    fn new_name(&mut self) -> String {
        let n = format!("w{}", self.next_worker);
        self.next_worker += 1;
        n
    }

    async fn spawn(&mut self, n: u32) -> Result<Vec<String>, RunError> {
        let mut names = Vec::new();
        for _ in 0..n {
            let name = self.new_name();
            self.cluster.spawn_worker_proxied(&name, &self.spec).await?;
            names.push(name);
        }
        Ok(names)
    }

    fn signal(&mut self, worker: &str, signal: i32) {
        if let Some(at_ms) = self.cluster.signal_worker(worker, signal) {
            self.signals.push(Signalled { worker: worker.to_string(), signal, at_ms });
        }
    }

    async fn fire(&mut self, action: Action) {
        match action {
            Action::Signal(w, s) => {
                self.say(format!("signal {s} to {w}"));
                self.signal(&w, s);
                if s == libc::SIGCONT {
                    self.stopped.remove(&w);
                }
            }
            Action::Heal(pairs) => {
                if let Some(lab) = self.cluster.netlab() {
                    for (a, b) in &pairs {
                        if let Err(e) = lab.drop_route(a, b, false) {
                            tracing::warn!(error = %e, "healing a route");
                        }
                    }
                } else if let Some(p) = self.cluster.proxy() {
                    for (a, b) in &pairs {
                        p.set_rule(a, b, LinkRule::default());
                    }
                }
                self.say("links healed");
            }
            Action::Plug(hosts) => {
                if let Some(lab) = self.cluster.netlab() {
                    for h in &hosts {
                        if let Err(e) = lab.isolate(h, false) {
                            tracing::warn!(error = %e, "plugging a host back");
                        }
                    }
                }
                self.say(format!("hosts plugged back: {}", hosts.join(",")));
            }
            Action::RestartCoordinators(idx) => {
                for i in idx {
                    self.say(format!("restarting coordinator {i}"));
                    if let Err(e) = self.cluster.restart_coordinator(i).await {
                        tracing::warn!(error = %e, "restarting a coordinator");
                    }
                }
            }
            Action::RestartEtcd => {
                self.say("restarting etcd");
                if let Some(etcd) = self.cluster.etcd() {
                    if let Err(e) = tokio::task::block_in_place(|| etcd.restart()) {
                        tracing::warn!(error = %e, "restarting etcd");
                    }
                }
            }
            Action::SlowStop { worker, until, stop_for, run_for } => {
                if Instant::now() < until {
                    self.signal(&worker, libc::SIGSTOP);
                    self.timers
                        .push((Instant::now() + stop_for, Action::SlowCont { worker, until, stop_for, run_for }));
                }
            }
            Action::SlowCont { worker, until, stop_for, run_for } => {
                self.signal(&worker, libc::SIGCONT);
                if Instant::now() + run_for < until {
                    self.timers.push((Instant::now() + run_for, Action::SlowStop { worker, until, stop_for, run_for }));
                }
            }
        }
    }

    async fn fire_due(&mut self) {
        loop {
            let now = Instant::now();
            let Some(i) = self.timers.iter().position(|(t, _)| *t <= now) else { return };
            let (_, a) = self.timers.remove(i);
            self.fire(a).await;
        }
    }

    async fn fire_all_timers(&mut self) {
        // Duty cycles end at once; everything else fires now (SIGCONT, heal, restarts).
        let mut guard = 0;
        while !self.timers.is_empty() && guard < 1000 {
            guard += 1;
            let (_, a) = self.timers.remove(0);
            let a = match a {
                Action::SlowStop { worker, .. } | Action::SlowCont { worker, .. } => {
                    Action::Signal(worker, libc::SIGCONT)
                }
                other => other,
            };
            self.fire(a).await;
        }
    }

    /// Waits for an event matching `pred`, up to `bound` (and the run's deadline), firing
    /// due timers meanwhile.
    async fn pump(
        &mut self,
        what: &str,
        bound: Duration,
        mut pred: impl FnMut(&WorkerEvent, &View) -> bool,
    ) -> Result<WorkerEvent, RunError> {
        let deadline = (Instant::now() + bound).min(self.run_deadline);
        loop {
            self.fire_due().await;
            let now = Instant::now();
            if now >= deadline {
                return Err(ClusterError::Timeout { what: what.to_string(), after: bound }.into());
            }
            let next_timer = self.timers.iter().map(|(t, _)| *t).min().unwrap_or(deadline).min(deadline);
            let wait = next_timer.saturating_duration_since(now).max(Duration::from_millis(1));
            if let Some(e) = self.cluster.next_event(wait).await {
                self.view.see(&e);
                if pred(&e, &self.view) {
                    return Ok(e);
                }
            }
        }
    }

    /// Lets the schedule run until `until` (events recorded, timers fired).
    async fn pass_time(&mut self, until: Instant) {
        let _ = self.pump("", until.saturating_duration_since(Instant::now()), |_, _| false).await;
    }

    async fn play(&mut self) -> Result<(), RunError> {
        let sc = self.sc;
        self.spawn(sc.workers).await?;
        self.say(format!("started {} workers", sc.workers));
        let n = sc.workers as i64;
        self.pump("the first generation with every worker", Duration::from_secs(60), |e, _| {
            e.get::<ev::Generation>().is_some_and(|g| g.world as i64 == n)
        })
        .await?;
        let mut index = 0;
        for _ in 0..sc.repeat {
            for f in &sc.faults {
                index += 1;
                self.fault(index, f).await?;
            }
        }
        self.say("faults done; running to the end");
        Ok(())
    }

    fn ranks_of(&mut self, f: &FaultSpec, g: i64) -> Result<Vec<(i64, String)>, RunError> {
        let members = self.view.members.get(&g).cloned().unwrap_or_default();
        let mut chosen: Vec<(i64, String)> = Vec::new();
        for &r in &f.ranks {
            match members.get(&(r as i64)) {
                Some(w) => chosen.push((r as i64, w.clone())),
                None => {
                    return Err(RunError::Scenario(format!(
                        "rank {r} is not in generation {g} (world {})",
                        members.len()
                    )))
                }
            }
        }
        let mut rest: Vec<(i64, String)> = members
            .iter()
            .filter(|(r, _)| !chosen.iter().any(|(c, _)| c == *r))
            .map(|(r, w)| (*r, w.clone()))
            .collect();
        rest.shuffle(&mut self.rng);
        if (f.random_ranks as usize) > rest.len() {
            return Err(RunError::Scenario(format!(
                "{} random ranks wanted, {} left in generation {g}",
                f.random_ranks,
                rest.len()
            )));
        }
        chosen.extend(rest.into_iter().take(f.random_ranks as usize));
        Ok(chosen)
    }

    /// Per worker: times it was SIGKILLed or SIGSTOPped by the harness.
    fn signal_windows(&self) -> BTreeMap<String, Vec<u64>> {
        let mut m: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for s in &self.signals {
            if s.signal == libc::SIGKILL || s.signal == libc::SIGSTOP {
                m.entry(s.worker.clone()).or_default().push(s.at_ms);
            }
        }
        m
    }
}

/// A CPU duty cycle on one process, played by a thread of its own (so that its stops last
/// what the scenario says however busy the harness is): SIGSTOP for `stop_for`, SIGCONT for
/// `run_for`, until `duration` has passed; it always ends with SIGCONT.
struct DutyCycle {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl DutyCycle {
    fn start(pid: u32, duration: Duration, stop_for: Duration, run_for: Duration) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let until = std::time::Instant::now() + duration;
            let mut cycles = 0;
            let signal = |s| {
                // SAFETY: kill(2) on a worker the cluster spawned and has not reaped (it reaps
                // only when the run ends, after this thread is joined).
                unsafe { libc::kill(pid as libc::pid_t, s) };
            };
            while std::time::Instant::now() < until && !flag.load(std::sync::atomic::Ordering::Relaxed) {
                // The duty cycle itself (the fault), not synchronisation: stopped for
                // `stop_for`, running for `run_for`.
                signal(libc::SIGSTOP);
                std::thread::sleep(stop_for);
                signal(libc::SIGCONT);
                std::thread::sleep(run_for);
                cycles += 1;
            }
            signal(libc::SIGCONT);
            cycles
        });
        Self { stop, thread }
    }

    /// Ends the cycle (if still running) and answers how many it played.
    fn finish(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or(0)
    }
}

/// The directed links (sender, receiver) between every target and every peer: both ways,
/// or only target -> peer for a one-way fault.
fn directed_pairs(targets: &[String], peers: &[String], one_way: bool) -> Vec<(String, String)> {
    let mut pairs = Vec::new();
    for t in targets {
        for p in peers {
            pairs.push((t.clone(), p.clone()));
            if !one_way {
                pairs.push((p.clone(), t.clone()));
            }
        }
    }
    pairs
}
