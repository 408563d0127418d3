//! Running a scenario: start the cluster, strike each fault at its moment, wait (bounded)
//! for the job to react, then check the invariants and measure.
//!
//! Every wait is on worker events with a deadline (`Run::pump`); the only timed waits are
//! the faults' own durations (a SIGSTOP lasting 3 s, a blackhole lasting at most 5 s),
//! which are the schedule of the scenario, not synchronisation. Due timers (SIGCONT,
//! healing a link, restarting coordinators or etcd, the slow rank's duty cycle) fire while
//! events are awaited.

use crate::cluster::{
    Cluster, ClusterConfig, ClusterError, DataPlaneFlags, JobSettings, Network, StoreKind, WorkerSpec,
};
use crate::demo::Check;
use crate::events::WorkerEvent;
use crate::invariants;
use crate::process::now_ms;
use crate::proxy::LinkRule;
use crate::report::{ErrorSeen, FaultRecord, RunReport, StatusSeen, StragglerSeen};
use crate::scenario::{parse_bytes, Expect, FaultKind, FaultSpec, NetworkChoice, Scenario, StoreChoice};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;
use tokio::time::Instant;

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
    last: BTreeMap<String, String>,
}

impl View {
    fn see(&mut self, e: &WorkerEvent) {
        match e.kind.as_str() {
            "generation" => {
                let g = e.int("gen").unwrap_or(0);
                if let (Some(r), Some(w)) = (e.int("rank"), e.int("world")) {
                    self.members.entry(g).or_default().insert(r, e.worker.clone());
                    self.worlds.insert(g, w);
                }
            }
            "step" => self.max_step = self.max_step.max(e.int("step").unwrap_or(0)),
            _ => {}
        }
        self.last.insert(e.worker.clone(), e.kind.clone());
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
    /// Per disruptive fault: no survivor kept a dead generation's shared-memory objects.
    segment_checks: Vec<Check>,
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
        store: if sc.store == StoreChoice::Etcd { StoreKind::Etcd } else { StoreKind::Memory },
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
                .and_then(|p| cohort_coordinator::stragglers::StragglerPolicy::parse(p).ok())
                .unwrap_or_default(),
            straggler_cooldown: sc.straggler_cooldown.map_or(JobSettings::default().straggler_cooldown, |d| d.0),
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
        extra_args: if sc.compute.0.is_zero() {
            Vec::new()
        } else {
            vec!["--compute".into(), format!("{}us", sc.compute.0.as_micros())]
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
        segment_checks: Vec::new(),
        verbose,
        start_ms: now_ms(),
    };
    if sc.needs_proxy() {
        run.cluster.enable_proxy();
    }
    run.cluster.set_ranks_per_host(sc.ranks_per_host as usize);
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
            .find(|e| e.worker == worker && e.kind == "generation")
            .and_then(|e| e.int("gen"))
    }

    /// The shared-memory objects of generations older than its current one that each
    /// running worker past generation `gen` still holds; how many workers were read; how many
    /// objects of their current generations they hold (evidence that the reading sees them).
    fn stale_shared_memory(&mut self, gen: i64) -> (Vec<String>, usize, usize) {
        let mut stale = Vec::new();
        let mut read = 0;
        let mut current_held = 0;
        for w in self.cluster.worker_names() {
            if self.killed.contains(&w) || self.stopped.contains(&w) || self.cluster.worker_exit(&w).is_some() {
                continue;
            }
            let Some(current) = self.generation_of(&w).filter(|c| *c > gen) else { continue };
            let Some(pid) = self.cluster.worker_pid(&w) else { continue };
            match crate::segments::held_by(pid) {
                Ok(held) => {
                    read += 1;
                    current_held += held.iter().filter(|h| h.generation as i64 >= current).count();
                    stale.extend(
                        held.iter()
                            .filter(|h| (h.generation as i64) < current)
                            .map(|h| format!("{w} (in generation {current}) holds {}", h.name)),
                    );
                }
                // Exited meanwhile: nothing held.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound || self.cluster.worker_exit(&w).is_some() => {}
                Err(e) => stale.push(format!("{w}: cannot read /proc/{pid}: {e}")),
            }
        }
        (stale, read, current_held)
    }

    /// After disruptive fault `index` of generation `gen` settled: every running worker that
    /// moved past `gen` let go of the older generations' shared-memory segments and sockets.
    /// Polled for up to 2 s (a worker drops the old mesh as it leaves the generation, at no
    /// moment the harness sees); recorded as a check.
    async fn check_shared_memory_released(&mut self, index: usize, kind: FaultKind, gen: i64) {
        let deadline = Instant::now() + Duration::from_secs(2);
        let started = Instant::now();
        let (stale, read, current) = loop {
            let (stale, read, current) = self.stale_shared_memory(gen);
            if stale.is_empty() || Instant::now() >= deadline {
                break (stale, read, current);
            }
            self.pass_time(Instant::now() + Duration::from_millis(100)).await;
        };
        self.segment_checks.push(Check {
            what: format!(
                "fault {index} ({}): no running worker kept a shared-memory segment or socket of a generation it left",
                kind.name()
            ),
            ok: stale.is_empty() && read > 0,
            detail: if stale.is_empty() {
                format!(
                    "{read} workers past generation {gen} read in /proc, holding {current} segments and sockets of their current generations only ({})",
                    match started.elapsed().as_millis() {
                        0..=9 => "at the first look".to_string(),
                        t => format!("after {t} ms"),
                    }
                )
            } else {
                stale.join("; ")
            },
        });
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
            e.kind == "generation" && e.int("world") == Some(n)
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

    async fn fault(&mut self, index: usize, f: &FaultSpec) -> Result<(), RunError> {
        let sc = self.sc;
        let settle = f.settle.0;
        // Arm: the number of steps after the previous fault settled.
        let steps = match f.after_steps_max {
            Some(max) => self.rng.random_range(f.after_steps..=max),
            None => f.after_steps,
        } as i64;
        let target_step = self.view.max_step + steps;
        if steps > 0 {
            self.pump(&format!("step {target_step} before fault {index}"), settle, |e, _| {
                e.kind == "step" && e.int("step").unwrap_or(0) >= target_step
            })
            .await?;
        }
        let mut g = self.view.current();
        if !self.view.complete(g) {
            self.pump("every member's generation event", Duration::from_secs(10), |_, v| v.complete(v.current()))
                .await?;
            g = self.view.current();
        }
        let mut targets = self.ranks_of(f, g)?;
        let mut target_names: Vec<String> = targets.iter().map(|(_, w)| w.clone()).collect();
        let members: Vec<String> = self.view.members.get(&g).map(|m| m.values().cloned().collect()).unwrap_or_default();
        let peers: Vec<String> = if f.kind.link() {
            if f.peers.is_empty() {
                members.iter().filter(|w| !target_names.contains(w)).cloned().collect()
            } else {
                let m = self.view.members.get(&g).cloned().unwrap_or_default();
                f.peers
                    .iter()
                    .filter_map(|r| m.get(&(*r as i64)).cloned())
                    .filter(|w| !target_names.contains(w))
                    .collect()
            }
        } else {
            Vec::new()
        };
        // Several workers per host: a host fault cuts every member on the target's host, and a
        // route fault cuts whole hosts from each other, so both sides grow to their hosts.
        let mut peers = peers;
        if sc.ranks_per_host > 1 && matches!(f.kind, FaultKind::Isolate | FaultKind::Blackhole | FaultKind::Partition) {
            let host = |w: &String| self.cluster.worker_host(w).map(str::to_string);
            let target_hosts: BTreeSet<String> = target_names.iter().filter_map(host).collect();
            let mut peer_hosts: Vec<String> = Vec::new();
            for h in peers.iter().filter_map(host) {
                if !target_hosts.contains(&h) && !peer_hosts.contains(&h) {
                    peer_hosts.push(h);
                }
            }
            if f.random_peer_hosts > 0 {
                peer_hosts.shuffle(&mut self.rng);
                peer_hosts.truncate(f.random_peer_hosts as usize);
            }
            let on_hosts = |hosts: &[&String]| -> Vec<(i64, String)> {
                self.view
                    .members
                    .get(&g)
                    .map(|m| {
                        m.iter()
                            .filter(|(_, w)| self.cluster.worker_host(w).is_some_and(|h| hosts.iter().any(|x| *x == h)))
                            .map(|(r, w)| (*r, w.clone()))
                            .collect()
                    })
                    .unwrap_or_default()
            };
            let mut grown = on_hosts(&target_hosts.iter().collect::<Vec<_>>());
            // The chosen target first (the mid-allreduce strike waits on it).
            grown.sort_by_key(|(r, w)| (!target_names.contains(w), *r));
            let grown_peers: Vec<String> =
                on_hosts(&peer_hosts.iter().collect::<Vec<_>>()).into_iter().map(|(_, w)| w).collect();
            targets = grown;
            target_names = targets.iter().map(|(_, w)| w.clone()).collect();
            if f.kind.link() {
                peers = grown_peers;
            }
        }
        if f.kind.link() && peers.is_empty() {
            return Err(RunError::Scenario(format!(
                "fault {index} ({}): no peers (on another host than the targets)",
                f.kind.name()
            )));
        }
        // Strike mid-allreduce: wait for the first target to announce one.
        let mut mid = false;
        if f.mid_allreduce && !targets.is_empty() {
            let t0 = target_names[0].clone();
            let gen = g;
            self.pump(&format!("an allreduce of {t0}"), Duration::from_secs(20), |e, _| {
                e.kind == "allreduce" && e.worker == t0 && e.int("gen") == Some(gen)
            })
            .await?;
            mid = true;
        }
        let at_ms = now_ms();
        let struck = Instant::now();
        let world = self.view.worlds.get(&g).copied().unwrap_or(0);
        let dur = f.duration.map(|d| d.0).unwrap_or(Duration::ZERO);
        let ranks_text: Vec<String> = targets.iter().map(|(r, w)| format!("{w}(rank {r})")).collect();
        let mut note = String::new();
        let mut duty: Option<DutyCycle> = None;
        match f.kind {
            FaultKind::Kill => {
                for w in &target_names {
                    self.signal(w, libc::SIGKILL);
                    self.killed.insert(w.clone());
                }
            }
            FaultKind::Stop => {
                for w in &target_names {
                    self.signal(w, libc::SIGSTOP);
                    self.stopped.insert(w.clone());
                    self.timers.push((Instant::now() + dur, Action::Signal(w.clone(), libc::SIGCONT)));
                }
            }
            FaultKind::Term => {
                for w in &target_names {
                    self.signal(w, libc::SIGTERM);
                    self.leaving.insert(w.clone());
                }
            }
            FaultKind::Straggler => {
                // Its own thread keeps the duty cycle exact while the harness polls `status`.
                let pid = target_names.first().and_then(|w| self.cluster.worker_pid(w));
                duty = pid.map(|pid| {
                    DutyCycle::start(pid, dur, f.stop_for.unwrap_or_default().0, f.run_for.unwrap_or_default().0)
                });
            }
            FaultKind::Slow => {
                let until = Instant::now() + dur;
                let (stop_for, run_for) =
                    (f.stop_for.map(|d| d.0).unwrap_or_default(), f.run_for.map(|d| d.0).unwrap_or_default());
                for w in &target_names {
                    self.fire(Action::SlowStop { worker: w.clone(), until, stop_for, run_for }).await;
                }
            }
            FaultKind::JoinStorm => {
                let names = self.spawn(f.count).await?;
                note = format!("joined: {}", names.join(","));
            }
            FaultKind::CoordinatorLeaderKill => {
                let leader = self.cluster.leader_index(Duration::from_secs(3)).await;
                let i = leader.unwrap_or(0);
                note = format!("leader coord{i}{}", if leader.is_none() { " (unknown; killed coord0)" } else { "" });
                self.cluster.kill_coordinator(i).await;
                self.timers.push((Instant::now() + dur, Action::RestartCoordinators(vec![i])));
            }
            FaultKind::CoordinatorsDown => {
                let all: Vec<usize> = (0..self.cluster.coordinator_count()).collect();
                for &i in &all {
                    self.cluster.kill_coordinator(i).await;
                }
                self.timers.push((Instant::now() + dur, Action::RestartCoordinators(all)));
            }
            FaultKind::EtcdRestart => {
                if let Some(e) = self.cluster.etcd() {
                    e.kill();
                }
                self.timers.push((Instant::now() + dur, Action::RestartEtcd));
            }
            FaultKind::Isolate => {
                let lab = self
                    .cluster
                    .netlab()
                    .ok_or_else(|| RunError::Scenario("isolate needs network = \"netns\"".into()))?;
                let hosts = self.hosts_of(&target_names);
                for h in &hosts {
                    lab.isolate(h, true).map_err(|e| RunError::Scenario(e.to_string()))?;
                }
                let plug_at = Instant::now() + if dur.is_zero() { settle } else { dur };
                self.timers.push((plug_at, Action::Plug(hosts)));
            }
            FaultKind::Blackhole | FaultKind::Partition if self.cluster.netlab().is_some() => {
                let pairs = self.host_pairs(directed_pairs(&target_names, &peers, f.kind == FaultKind::Partition));
                if let Some(lab) = self.cluster.netlab() {
                    for (a, b) in &pairs {
                        lab.drop_route(a, b, true).map_err(|e| RunError::Scenario(e.to_string()))?;
                    }
                }
                let heal_at = Instant::now() + if dur.is_zero() { sc.no_progress.0 * 3 } else { dur };
                self.timers.push((heal_at, Action::Heal(pairs)));
            }
            FaultKind::Blackhole
            | FaultKind::Partition
            | FaultKind::Latency
            | FaultKind::Bandwidth
            | FaultKind::Reset => {
                let proxy = self.cluster.enable_proxy();
                let rule = match f.kind {
                    FaultKind::Latency => {
                        LinkRule { latency: f.latency.map(|d| d.0).unwrap_or_default(), ..Default::default() }
                    }
                    FaultKind::Bandwidth => LinkRule {
                        bandwidth: f.bandwidth.as_deref().and_then(|b| parse_bytes(b).ok()),
                        ..Default::default()
                    },
                    _ => LinkRule { blackhole: true, ..Default::default() },
                };
                let pairs = directed_pairs(&target_names, &peers, f.kind == FaultKind::Partition);
                if f.kind == FaultKind::Reset {
                    let n: usize = target_names
                        .iter()
                        .flat_map(|t| peers.iter().map(move |p| (t, p)))
                        .map(|(t, p)| proxy.reset_pair(t, p))
                        .sum();
                    note = format!("{n} connections reset");
                } else {
                    for (a, b) in &pairs {
                        proxy.set_rule(a, b, rule);
                    }
                    let heal_at = Instant::now() + if dur.is_zero() { sc.no_progress.0 * 3 } else { dur };
                    self.timers.push((heal_at, Action::Heal(pairs)));
                }
            }
        }
        self.say(format!(
            "fault {index}: {} {} peers [{}] in generation {g} (world {world}) at step {}{} {note}",
            f.kind.name(),
            ranks_text.join(","),
            peers.join(","),
            self.view.max_step,
            if mid { ", mid-allreduce" } else { "" }
        ));
        self.records.push(FaultRecord {
            index,
            kind: f.kind,
            targets: ranks_text,
            peers: peers.clone(),
            generation: g,
            world,
            step: self.view.max_step,
            at_ms,
            duration_ms: dur.as_millis() as u64,
            mid_allreduce: mid,
            survivors: if kill_like(f.kind) {
                members.iter().filter(|w| !target_names.contains(w)).cloned().collect()
            } else {
                members.clone()
            },
            note,
            ..Default::default()
        });

        // Settle.
        let gen = g;
        match f.kind {
            FaultKind::Kill
            | FaultKind::Stop
            | FaultKind::Reset
            | FaultKind::Blackhole
            | FaultKind::Partition
            | FaultKind::Term => {
                if matches!(f.kind, FaultKind::Blackhole | FaultKind::Partition) {
                    // Heal as soon as a member reports it (the fault was seen); at the
                    // latest at its duration (the timer set above).
                    let seen = self
                        .pump("an error after the link fault", sc.no_progress.0 * 3 + Duration::from_secs(5), |e, _| {
                            e.kind == "error" && e.int("gen") == Some(gen)
                        })
                        .await;
                    if let Some(pos) = self.timers.iter().position(|(_, a)| matches!(a, Action::Heal(_))) {
                        let (_, a) = self.timers.remove(pos);
                        self.fire(a).await;
                    }
                    seen?;
                }
                if sc.expect == Expect::Fail && f.kind == FaultKind::Kill {
                    return Ok(());
                }
                if f.kind == FaultKind::Stop {
                    self.status_while_hung(struck).await;
                }
                let cont_at = self
                    .timers
                    .iter()
                    .filter(|(_, a)| matches!(a, Action::Signal(_, s) if *s == libc::SIGCONT))
                    .map(|(t, _)| *t)
                    .max();
                self.pump(&format!("the first verified step after fault {index}"), settle, |e, _| {
                    e.kind == "step" && e.int("gen").unwrap_or(0) > gen
                })
                .await?;
                if let Some(t) = cont_at {
                    // The hung rank comes back: let its continuation happen, then see it react.
                    self.pass_time(t).await;
                    let back: Vec<String> = target_names.clone();
                    let _ = self
                        .pump("the continued rank to react", Duration::from_secs(10) + sc.no_progress.0, |e, _| {
                            back.contains(&e.worker) && e.kind != "allreduce"
                        })
                        .await;
                }
                if f.kind == FaultKind::Kill && f.respawn {
                    let names = self.spawn(target_names.len() as u32).await?;
                    let last = names.last().cloned().unwrap_or_default();
                    self.pump(&format!("replacement {last} to join"), settle, |e, _| {
                        e.kind == "step" && e.worker == last
                    })
                    .await?;
                }
                self.check_shared_memory_released(index, f.kind, gen).await;
            }
            FaultKind::Isolate => {
                // The survivors re-form without the cut-off hosts; then they are plugged back
                // (at the latest at their duration) and must find their way back in.
                let recovered = self
                    .pump(&format!("the first verified step after fault {index}"), settle, |e, _| {
                        e.kind == "step" && e.int("gen").unwrap_or(0) > gen
                    })
                    .await;
                if let Some(pos) = self.timers.iter().position(|(_, a)| matches!(a, Action::Plug(_))) {
                    let (_, a) = self.timers.remove(pos);
                    self.fire(a).await;
                }
                recovered?;
                for w in &target_names {
                    let who = w.clone();
                    self.pump(&format!("{w} to rejoin after it was plugged back"), settle, |e, _| {
                        e.kind == "step" && e.worker == who && e.int("gen").unwrap_or(0) > gen
                    })
                    .await?;
                }
                self.check_shared_memory_released(index, f.kind, gen).await;
            }
            FaultKind::JoinStorm => {
                let want = (world + f.count as i64).min(sc.max_workers as i64);
                self.pump(&format!("a generation of {want} after the join storm"), settle, |e, _| {
                    e.kind == "step" && e.int("world") == Some(want)
                })
                .await?;
            }
            FaultKind::Straggler => {
                let target = target_names.first().cloned().unwrap_or_default();
                let mut seen = self.follow_straggler(&target, gen, struck + dur, settle).await;
                seen.cycles = duty.map_or(0, DutyCycle::finish);
                if let Some(r) = self.records.last_mut() {
                    r.straggler = Some(seen);
                }
                let target = self.view.max_step + 3;
                self.pump(&format!("3 steps after fault {index}"), settle, |e, _| {
                    e.kind == "step" && e.int("step").unwrap_or(0) >= target
                })
                .await?;
                self.quiet.push((at_ms, now_ms(), index));
            }
            FaultKind::Slow
            | FaultKind::Latency
            | FaultKind::Bandwidth
            | FaultKind::CoordinatorLeaderKill
            | FaultKind::CoordinatorsDown
            | FaultKind::EtcdRestart => {
                let end = Instant::now() + dur;
                self.pass_time(end).await;
                self.fire_due().await;
                let target = self.view.max_step + 3;
                self.pump(&format!("3 steps after fault {index}"), settle, |e, _| {
                    e.kind == "step" && e.int("step").unwrap_or(0) >= target
                })
                .await?;
                if matches!(
                    f.kind,
                    FaultKind::Latency | FaultKind::Bandwidth | FaultKind::CoordinatorLeaderKill | FaultKind::Slow
                ) {
                    self.quiet.push((at_ms, now_ms(), index));
                }
            }
        }
        Ok(())
    }

    /// Follows a straggler fault on `target` (struck in generation `gen`, its duty
    /// cycle ending at `until`): polls `status` until the coordinator names it (or the cycle
    /// ends), noting anybody else it names; under `exclude`, waits for its leave at a commit
    /// point and, after the cycle, for its return after the cool-down. Failures to see any
    /// of this are left to the checks (the run goes on).
    async fn follow_straggler(&mut self, target: &str, gen: i64, until: Instant, settle: Duration) -> StragglerSeen {
        let sc = self.sc;
        let policy = sc.straggler_policy.clone().unwrap_or_else(|| "report".into());
        let mut seen = StragglerSeen { policy: policy.clone(), target: target.to_string(), ..Default::default() };
        let who = target.to_string();
        let is_leave = move |e: &WorkerEvent| e.kind == "straggler_leave" && e.worker == who;
        while Instant::now() < until && seen.named.is_none() && seen.excluded_at_ms.is_none() {
            let leave = is_leave.clone();
            if let Ok(e) = self.pump("", Duration::from_millis(100), move |e, _| leave(e)).await {
                seen.excluded_at_ms = Some(e.t_ms());
                break;
            }
            let Some(status) = self.cluster.status_json(Duration::from_millis(500)).await else { continue };
            let members = status.get("members").and_then(|m| m.as_array()).cloned().unwrap_or_default();
            for m in &members {
                let Some(v) = m.get("straggler").filter(|v| !v.is_null()) else { continue };
                let worker = m.get("worker_id").and_then(|w| w.as_str()).unwrap_or("?").to_string();
                if worker == target && seen.named.is_none() {
                    let text = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string();
                    seen.kind = text("kind");
                    seen.reason = text("reason");
                    seen.action = text("action");
                    seen.named_at_ms = Some(now_ms());
                    self.say(format!("status names {worker} a straggler: {} ({})", seen.reason, seen.action));
                    seen.named = Some(worker);
                } else if worker != target && !seen.others_named.contains(&worker) {
                    seen.others_named.push(worker);
                }
            }
        }
        if policy == "exclude" && seen.excluded_at_ms.is_none() {
            let bound = until.saturating_duration_since(Instant::now()) + settle;
            let leave = is_leave.clone();
            if let Ok(e) = self.pump(&format!("{target} to leave as a straggler"), bound, move |e, _| leave(e)).await {
                seen.excluded_at_ms = Some(e.t_ms());
            }
        }
        if let (None, Some(left)) = (&seen.named, seen.excluded_at_ms) {
            // It left before a poll of `status` caught the verdict (named and excluded within
            // one heartbeat): the leave carries the coordinator's verdict, named no later.
            let event = self.cluster.events.iter().rev().find(|e| e.kind == "straggler_leave" && e.worker == target);
            let reason = event.and_then(|e| e.text("reason")).unwrap_or("").to_string();
            seen.kind = reason.strip_prefix("straggler (").and_then(|r| r.split(' ').next()).unwrap_or("").to_string();
            seen.reason = reason;
            seen.action = "excluded (from its straggler_leave event)".into();
            seen.named_at_ms = Some(left);
            seen.named = Some(target.to_string());
        }
        self.pass_time(until).await;
        if seen.excluded_at_ms.is_some() {
            let cooldown = sc.straggler_cooldown.map_or(Duration::from_secs(60), |d| d.0);
            let who = target.to_string();
            if let Ok(e) = self
                .pump(&format!("{target} to return after its cool-down"), cooldown + settle, |e, _| {
                    e.kind == "step" && e.worker == who && e.int("gen").unwrap_or(0) > gen
                })
                .await
            {
                seen.rejoined_at_ms = Some(e.t_ms());
            }
        }
        seen
    }

    /// Takes the coordinator's `status` while a rank is stopped: three heartbeat intervals
    /// after the SIGSTOP (its heartbeat age must stand out by then), and before the
    /// no-progress deadline (before anybody times out and the rank is evicted); only with
    /// fixed deadlines (learned ones catch the rank sooner). Kept in the
    /// fault's record; checked in [`Run::checks`].
    async fn status_while_hung(&mut self, struck: Instant) {
        let sc = self.sc;
        let after = sc.heartbeat_interval.0 * 3;
        if !sc.fixed_deadlines {
            if let Some(r) = self.records.last_mut() {
                r.note = "no status taken: learned deadlines catch the hung rank before its heartbeat age stands out (fixed_deadlines = true takes one)".into();
            }
            return;
        }
        if after + Duration::from_millis(300) >= sc.no_progress.0 {
            if let Some(r) = self.records.last_mut() {
                r.note = format!(
                    "no status taken: 3 heartbeat intervals ({after:?}) do not fit before the no-progress deadline"
                );
            }
            return;
        }
        self.pass_time(struck + after).await;
        let at_ms = self.records.last().map_or(0, |r| r.at_ms);
        let status = self.cluster.status_json(Duration::from_millis(500)).await;
        let seen = status.and_then(|s| StatusSeen::from_json(now_ms() as i64 - at_ms as i64, &s));
        if let Some(r) = self.records.last_mut() {
            r.status = seen;
        }
    }

    /// Fills the records' measurements from the events.
    fn measure(&self) -> Vec<FaultRecord> {
        measure(&self.records, &self.cluster.events)
    }

    fn checks(&mut self, codes: &BTreeMap<String, Option<i32>>, end_ms: u64) -> Vec<Check> {
        let sc = self.sc;
        let events = self.cluster.events.clone();
        let records = self.measure();
        let mut checks = vec![
            invariants::no_wrong_results(&events),
            invariants::generations_increase(&events),
            invariants::commits_never_lost(&events),
        ];
        let bound_ms = (sc.no_progress.0 + Duration::from_secs(3)).as_millis() as u64;
        checks.push(invariants::no_hang(&events, &self.signal_windows(), bound_ms, end_ms));
        checks.push(invariants::errors_typed(&events));
        let computed =
            sc.worker_command.is_none().then(|| invariants::expected_params_digest(sc.size_bytes(), sc.steps));
        checks.push(invariants::final_params(
            &events,
            computed.as_deref().map_or(invariants::ExpectedParams::Reported, invariants::ExpectedParams::Computed),
        ));
        // Per fault: disruptive ones reach every survivor with the root cause; quiet ones
        // fail no collective.
        for r in &records {
            let kind = r.kind.name();
            let culprits: Vec<String> = r
                .targets
                .iter()
                .map(|t| t.split('(').next().unwrap_or("").to_string())
                .chain(r.peers.iter().cloned())
                .collect();
            match r.kind {
                FaultKind::Kill | FaultKind::Stop => {
                    if sc.expect == Expect::Fail {
                        continue;
                    }
                    let named = r.errors.iter().filter(|e| culprits.iter().any(|c| cause_names(&e.cause, c))).count();
                    checks.push(Check {
                        what: format!("fault {} ({kind}): every survivor got an error naming the root cause", r.index),
                        ok: named == r.survivors.len() && !r.survivors.is_empty(),
                        detail: format!("{named} of {} survivors; causes: {}", r.survivors.len(), causes(r)),
                    });
                    checks.push(next_step_check(r, kind));
                    if r.kind == FaultKind::Stop {
                        checks.extend(hung_rank_status_check(r, &events, sc));
                        // A rank hung past the deadline is a silent fault like a cut link.
                        let deadline = sc.no_progress.0 + sc.step_interval.0 + Duration::from_millis(1000);
                        if Duration::from_millis(r.duration_ms) > deadline {
                            checks.push(detection_check(r, kind, sc));
                            checks.push(hang_timeout_check(r));
                        }
                    }
                    if let (true, Some(bound)) = (r.kind == FaultKind::Kill, sc.kill_errors_within) {
                        checks.push(kill_errors_check(r, bound.0, &self.cluster.hosts()));
                    }
                    if r.kind == FaultKind::Kill && r.targets.len() > 1 {
                        // One report wins and evicts its suspect; the other dead ranks still
                        // hold live leases. Their control streams closed with them, so the
                        // survivors must not wait for them (the join window, or the leases).
                        let window = sc.join_window.0.as_millis() as i64;
                        checks.push(Check {
                            what: format!(
                                "fault {} (kill of {} ranks at once): the survivors re-formed without waiting for the other dead ranks (join window {window} ms)",
                                r.index,
                                r.targets.len()
                            ),
                            ok: r.next_step_ms.is_some_and(|t| t < window),
                            detail: format!("next verified step after {} ms", o(r.next_step_ms)),
                        });
                    }
                }
                FaultKind::Isolate => {
                    let named = r.errors.iter().filter(|e| culprits.iter().any(|c| cause_names(&e.cause, c))).count();
                    checks.push(Check {
                        what: format!(
                            "fault {} ({kind}): every survivor got an error naming the cut-off host",
                            r.index
                        ),
                        ok: named == r.survivors.len() && !r.survivors.is_empty(),
                        detail: format!("{named} of {} survivors; causes: {}", r.survivors.len(), causes(r)),
                    });
                    if sc.ranks_per_host > 1 && r.targets.len() > 1 {
                        checks.push(domain_cause_check(r, &self.cluster.hosts()));
                    }
                    checks.push(detection_check(r, kind, sc));
                    checks.push(next_step_check(r, kind));
                    let back: Vec<String> = culprits
                        .iter()
                        .filter(|w| {
                            !events.iter().any(|e| {
                                e.kind == "step" && e.worker == **w && e.int("gen").unwrap_or(0) > r.generation
                            })
                        })
                        .cloned()
                        .collect();
                    checks.push(Check {
                        what: format!("fault {} ({kind}): the cut-off host rejoined once plugged back", r.index),
                        ok: back.is_empty(),
                        detail: if back.is_empty() {
                            "verified steps in a later generation".into()
                        } else {
                            format!("never back: {}", back.join(","))
                        },
                    });
                }
                FaultKind::Straggler => checks.extend(straggler_checks(r, &events, sc)),
                FaultKind::JoinStorm => {
                    let joiners: Vec<&str> =
                        r.note.strip_prefix("joined: ").map(|n| n.split(',').collect()).unwrap_or_default();
                    let missing: Vec<&str> = joiners
                        .iter()
                        .copied()
                        .filter(|w| !events.iter().any(|e| e.kind == "step" && e.worker == *w))
                        .collect();
                    checks.push(Check {
                        what: format!("fault {} ({kind}): every joiner verified steps", r.index),
                        ok: !joiners.is_empty() && missing.is_empty(),
                        detail: if missing.is_empty() {
                            format!("{} joiners", joiners.len())
                        } else {
                            format!("never stepped: {}", missing.join(","))
                        },
                    });
                }
                FaultKind::Blackhole | FaultKind::Partition | FaultKind::Reset => {
                    let named = r.errors.iter().filter(|e| culprits.iter().any(|c| cause_names(&e.cause, c))).count();
                    checks.push(Check {
                        what: format!(
                            "fault {} ({kind}): every member got an error naming an end of the link",
                            r.index
                        ),
                        ok: named == r.survivors.len() && !r.survivors.is_empty(),
                        detail: format!("{named} of {}; causes: {}", r.survivors.len(), causes(r)),
                    });
                    if r.kind != FaultKind::Reset {
                        checks.push(detection_check(r, kind, sc));
                    }
                    checks.push(next_step_check(r, kind));
                }
                // No per-fault check of their own: the quiet kinds get "no collective failed
                // because of it" below, a graceful leave and the control-plane faults are
                // judged by the run's invariants (no hang, no lost commit, the final
                // parameters) and by the faults that follow them.
                FaultKind::Term
                | FaultKind::Slow
                | FaultKind::Latency
                | FaultKind::Bandwidth
                | FaultKind::CoordinatorLeaderKill
                | FaultKind::CoordinatorsDown
                | FaultKind::EtcdRestart => {}
            }
        }
        checks.extend(self.segment_checks.iter().cloned());
        let auto = sc.transport.as_deref().is_none_or(|t| t == "auto");
        if sc.network == NetworkChoice::Netns && auto && sc.worker_command.is_none() {
            checks.push(invariants::transport_by_host(&events, &self.cluster.hosts()));
        }
        for &(from, to, index) in &self.quiet {
            let errs: Vec<String> = events
                .iter()
                .filter(|e| e.kind == "error" && e.t_ms() >= from && e.t_ms() <= to)
                .map(|e| format!("{}: {}", e.worker, e.text("cause").unwrap_or("?")))
                .collect();
            let kind = records.iter().find(|r| r.index == index).map_or("?", |r| r.kind.name());
            checks.push(Check {
                what: format!("fault {index} ({kind}): no collective failed because of it"),
                ok: errs.is_empty(),
                detail: if errs.is_empty() { "none failed".into() } else { errs.join("; ") },
            });
        }
        // How the job ended.
        match sc.expect {
            Expect::Finish => {
                let mut bad = Vec::new();
                for (w, code) in codes {
                    if self.killed.contains(w) {
                        continue;
                    }
                    let summary = events.iter().rev().find(|e| e.worker == *w && e.kind == "summary");
                    let fatal = events.iter().rev().find(|e| e.worker == *w && e.kind == "fatal");
                    if self.leaving.contains(w) {
                        if *code != Some(0) || summary.and_then(|s| s.text("left")) != Some("true") {
                            bad.push(format!("{w} (SIGTERM) exit {code:?} without a graceful leave"));
                        }
                    } else if self.signals.iter().any(|s| s.worker == *w && s.signal == libc::SIGSTOP)
                        && *code != Some(0)
                    {
                        // A hung rank that came back after its exclusion may be refused;
                        // then it must say why.
                        if fatal.and_then(|f| f.text("error")).is_none_or(str::is_empty) {
                            bad.push(format!("{w} (was stopped) exit {code:?} without a reason"));
                        }
                    } else if *code != Some(0) || summary.and_then(|s| s.int("final_step")) != Some(sc.steps as i64) {
                        bad.push(format!(
                            "{w} exit {code:?} final step {:?}{}",
                            summary.and_then(|s| s.int("final_step")),
                            fatal.and_then(|f| f.text("error")).map(|e| format!(": {e}")).unwrap_or_default()
                        ));
                    }
                }
                checks.push(Check {
                    what: format!("the job finished: every remaining worker ran all {} steps and exited 0", sc.steps),
                    ok: bad.is_empty(),
                    detail: if bad.is_empty() { format!("{} workers", codes.len()) } else { bad.join("; ") },
                });
            }
            Expect::Fail => {
                let mut bad = Vec::new();
                for (w, code) in codes {
                    if self.killed.contains(w) {
                        continue;
                    }
                    let fatal = events
                        .iter()
                        .rev()
                        .find(|e| e.worker == *w && e.kind == "fatal")
                        .and_then(|f| f.text("error"))
                        .unwrap_or("");
                    if *code == Some(0) || !fatal.contains("min_workers") {
                        bad.push(format!("{w}: exit {code:?}, error {fatal:?}"));
                    }
                }
                checks.push(Check {
                    what: "the job failed below min_workers, every remaining worker saying why".into(),
                    ok: bad.is_empty(),
                    detail: if bad.is_empty() {
                        "every remaining worker failed naming min_workers".into()
                    } else {
                        bad.join("; ")
                    },
                });
            }
        }
        checks
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

/// Whether the evidence shows the fault struck while the target's allreduce was in flight
/// (the harness strikes after the target announced one, but announcing is not proof): the
/// target's last announced allreduce before the strike, of step S, had not completed (no
/// `step` event for S+1 before the strike), and a survivor's error names step S outside the
/// commit and sync phases.
fn struck_mid_allreduce(r: &FaultRecord, events: &[WorkerEvent]) -> bool {
    let Some(target) = r.targets.first().map(|t| t.split('(').next().unwrap_or("").to_string()) else {
        return false;
    };
    let at = r.at_ms;
    let gen = Some(r.generation);
    let Some(step) = events
        .iter()
        .filter(|e| e.kind == "allreduce" && e.worker == target && e.int("gen") == gen && e.t_ms() <= at)
        .filter_map(|e| e.int("step"))
        .max()
    else {
        return false;
    };
    let completed = events.iter().any(|e| {
        e.kind == "step"
            && e.worker == target
            && e.int("gen") == gen
            && e.int("step") == Some(step + 1)
            && e.t_ms() <= at
    });
    let in_flight_error = events.iter().any(|e| {
        e.kind == "error"
            && r.survivors.contains(&e.worker)
            && e.int("gen") == gen
            && e.int("step") == Some(step)
            && e.text("phase").is_none()
    });
    !completed && in_flight_error
}

/// Fills the records' measurements from the events. A fault's errors are its survivors'
/// first errors in its generation from its moment on, and before the next fault of the same
/// generation (whose errors they would be).
fn measure(records: &[FaultRecord], events: &[WorkerEvent]) -> Vec<FaultRecord> {
    let mut out = records.to_vec();
    for r in out.iter_mut() {
        r.mid_allreduce = r.mid_allreduce && struck_mid_allreduce(r, events);
    }
    for (i, r) in out.iter_mut().enumerate() {
        let at = r.at_ms as i64;
        let until =
            records[i + 1..].iter().find(|n| n.generation == r.generation).map_or(i64::MAX, |n| n.at_ms as i64 - 5);
        let mut errors: Vec<ErrorSeen> = Vec::new();
        for w in &r.survivors {
            let seen = events.iter().find(|e| {
                e.kind == "error" && e.worker == *w && e.int("gen") == Some(r.generation) && e.t_ms() as i64 >= at - 5
            });
            if let Some(e) = seen.filter(|e| (e.t_ms() as i64) < until) {
                errors.push(ErrorSeen {
                    worker: w.clone(),
                    kind: e.text("kind").unwrap_or("?").into(),
                    cause: e.text("cause").unwrap_or("").into(),
                    after_ms: e.t_ms() as i64 - at,
                });
            }
        }
        if !errors.is_empty() {
            let first = errors.iter().map(|e| e.after_ms).min();
            let last = errors.iter().map(|e| e.after_ms).max();
            r.first_error_ms = first;
            if errors.len() == r.survivors.len() {
                r.survivors_errors_ms = last;
            }
            r.revocation_ms = first.zip(last).map(|(a, b)| b - a);
        }
        r.errors = errors;
        let kind = Some(r.kind);
        if kind.is_some_and(|k| !k.quiet()) {
            if let Some(e) = events
                .iter()
                .find(|e| e.kind == "step" && e.int("gen").unwrap_or(0) > r.generation && e.t_ms() as i64 >= at)
            {
                r.next_step_ms = Some(e.t_ms() as i64 - at);
                r.next_generation = e.int("gen");
            }
        }
        if kind.is_some_and(FaultKind::quiet) && r.duration_ms > 0 {
            let d = r.duration_ms as i64;
            r.steps_per_s_before = step_rate(events, at - d, at);
            r.steps_per_s_during = step_rate(events, at, at + d);
        }
        if let Some(s) = r.straggler.as_mut() {
            let highest = |t: u64| {
                events.iter().filter(|e| e.kind == "step" && e.t_ms() <= t).filter_map(|e| e.int("step")).max()
            };
            s.named_after_steps = s.named_at_ms.and_then(highest).map(|n| n - r.step);
            // Before: up to 3 s of the fault-free job; during: while the straggler was a
            // member; after: from its leave (plus the re-formation) to its return.
            r.steps_per_s_before = step_rate(events, at - (r.duration_ms as i64).min(3000), at);
            let left = s.excluded_at_ms.map(|t| t as i64);
            r.steps_per_s_during = step_rate(events, at, left.unwrap_or(at + r.duration_ms as i64));
            if let Some(left) = left {
                let back = s.rejoined_at_ms.map_or(at + r.duration_ms as i64, |t| t as i64);
                s.steps_per_s_after = step_rate(events, left + 300, back);
            }
            if let Some(back) = s.rejoined_at_ms.map(|t| t as i64) {
                s.steps_per_s_rejoined = step_rate(events, back + 300, back + 3300);
            }
        }
        if kind == Some(FaultKind::JoinStorm) {
            let joiners: Vec<&str> =
                r.note.strip_prefix("joined: ").map(|n| n.split(',').collect()).unwrap_or_default();
            r.absorbed_ms = absorbed(events, r.generation, &joiners).map(|t| t as i64 - at);
        }
    }
    out
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

/// Checks of straggler fault `r`: the slowed rank named (as a compute straggler) within the
/// scenario's bound, nobody else named, no collective failed (no false timeout: the stops
/// stay under the learned deadlines' floor); under `exclude` it left at a commit point, the
/// job's pace recovered to 0.9 of the fault-free rate, and it came back after its cool-down;
/// under `report` nothing was excluded.
fn straggler_checks(r: &FaultRecord, events: &[WorkerEvent], sc: &Scenario) -> Vec<Check> {
    let Some(s) = &r.straggler else { return Vec::new() };
    let spec = sc.faults.get((r.index - 1) % sc.faults.len().max(1));
    let within = spec.and_then(|f| f.name_within_steps).unwrap_or(0) as i64;
    let i = r.index;
    let mut out = vec![
        Check {
            what: format!("fault {i} (straggler): the coordinator named the slowed rank a compute straggler within {within} steps"),
            ok: s.named.as_deref() == Some(s.target.as_str())
                && s.kind == "compute"
                && s.named_after_steps.is_some_and(|n| n <= within),
            detail: format!(
                "{} named after {} steps ({} ms): {}; action: {}",
                s.named.as_deref().unwrap_or("nobody"),
                o(s.named_after_steps),
                o(s.named_at_ms.map(|t| t as i64 - r.at_ms as i64)),
                s.reason,
                s.action
            ),
        },
        Check {
            what: format!("fault {i} (straggler): no other member was named"),
            ok: s.others_named.is_empty(),
            detail: if s.others_named.is_empty() { "none".into() } else { s.others_named.join(",") },
        },
    ];
    let errors: Vec<String> = events
        .iter()
        .filter(|e| e.kind == "error" && e.t_ms() >= r.at_ms)
        .map(|e| format!("{}: {} {}", e.worker, e.text("kind").unwrap_or("?"), e.text("cause").unwrap_or("?")))
        .collect();
    out.push(Check {
        what: format!("fault {i} (straggler): no false timeout (no collective failed from the fault to the end)"),
        ok: errors.is_empty(),
        detail: if errors.is_empty() { format!("{} duty cycles, none failed", s.cycles) } else { errors.join("; ") },
    });
    let leaves: Vec<&WorkerEvent> = events.iter().filter(|e| e.kind == "straggler_leave").collect();
    if s.policy == "exclude" {
        out.push(Check {
            what: format!("fault {i} (straggler, exclude): the straggler left at a commit point"),
            ok: s.excluded_at_ms.is_some() && leaves.iter().all(|e| e.worker == s.target),
            detail: leaves
                .first()
                .map_or("no straggler_leave event".into(), |e| format!("{} at step {}", e.worker, o(e.int("step")))),
        });
        let (before, after) = (r.steps_per_s_before.unwrap_or(0.0), s.steps_per_s_after.unwrap_or(0.0));
        out.push(Check {
            what: format!("fault {i} (straggler, exclude): steps/s after the exclusion >= 0.9 of the fault-free rate"),
            ok: before > 0.0 && after >= 0.9 * before,
            detail: format!(
                "before {before:.1}, with the straggler {:.1}, after its exclusion {after:.1} (x{:.2})",
                r.steps_per_s_during.unwrap_or(0.0),
                after / before.max(f64::MIN_POSITIVE)
            ),
        });
        let cooldown = sc.straggler_cooldown.map_or(60_000, |d| d.0.as_millis() as i64);
        let away = s.excluded_at_ms.zip(s.rejoined_at_ms).map(|(a, b)| b as i64 - a as i64);
        out.push(Check {
            what: format!("fault {i} (straggler, exclude): it came back after its cool-down ({cooldown} ms)"),
            ok: away.is_some_and(|t| t >= cooldown - 200),
            detail: format!("verified steps again {} ms after its leave", o(away)),
        });
    } else {
        let shrank: Vec<i64> = events
            .iter()
            .filter(|e| e.kind == "generation" && e.t_ms() >= r.at_ms && e.int("world").unwrap_or(0) < r.world)
            .filter_map(|e| e.int("gen"))
            .collect();
        out.push(Check {
            what: format!("fault {i} (straggler, report): nothing was excluded"),
            ok: leaves.is_empty() && shrank.is_empty(),
            detail: format!("{} straggler leaves, smaller generations: {shrank:?}", leaves.len()),
        });
    }
    out
}

/// The job's verified steps per second between `from` and `to` (ms since the epoch): the
/// highest verified step at `to` less the highest at `from`, over the time between. The
/// window starts no earlier than the job's first verified step; `None` if nothing is left.
fn step_rate(events: &[WorkerEvent], from: i64, to: i64) -> Option<f64> {
    let steps = || events.iter().filter(|e| e.kind == "step");
    let first = steps().map(|e| e.t_ms() as i64).min()?;
    let from = from.max(first);
    if to <= from {
        return None;
    }
    let highest = |t: i64| steps().filter(|e| e.t_ms() as i64 <= t).filter_map(|e| e.int("step")).max().unwrap_or(0);
    Some((highest(to) - highest(from)) as f64 * 1000.0 / (to - from) as f64)
}

/// When the first verified step of a generation newer than `after` holding every one of
/// `joiners` came (ms since the epoch).
fn absorbed(events: &[WorkerEvent], after: i64, joiners: &[&str]) -> Option<u64> {
    if joiners.is_empty() {
        return None;
    }
    let mut members: BTreeMap<i64, BTreeSet<&str>> = BTreeMap::new();
    for e in events.iter().filter(|e| e.kind == "generation") {
        members.entry(e.int("gen").unwrap_or(0)).or_default().insert(e.worker.as_str());
    }
    let full = members.iter().find(|(g, m)| **g > after && joiners.iter().all(|j| m.contains(j))).map(|(g, _)| *g)?;
    events.iter().filter(|e| e.kind == "step" && e.int("gen") == Some(full)).map(WorkerEvent::t_ms).min()
}

/// Check: while the ranks of stop fault `r` were hung, the coordinator's `status` showed
/// them as the members silent the longest (every other member's heartbeat was fresher), in
/// the generation they hung in, at a step no later than the last one they printed. `None`
/// when no status was taken (the scenario's timings leave no room; said in the note).
fn hung_rank_status_check(r: &FaultRecord, events: &[WorkerEvent], sc: &Scenario) -> Option<Check> {
    let what = format!("fault {} (stop): the coordinator's status showed the hung rank as the stalest member", r.index);
    let Some(status) = &r.status else {
        if r.note.starts_with("no status taken") {
            return None;
        }
        return Some(Check { what, ok: false, detail: "status could not be read".into() });
    };
    let hung: Vec<&str> = r.targets.iter().map(|t| t.split('(').next().unwrap_or("")).collect();
    let mut problems = Vec::new();
    let freshest_hung =
        status.members.iter().filter(|m| hung.contains(&m.worker.as_str())).map(|m| m.heartbeat_age_ms).min();
    let stalest_other =
        status.members.iter().filter(|m| !hung.contains(&m.worker.as_str())).map(|m| m.heartbeat_age_ms).max();
    let mut shown = Vec::new();
    for w in &hung {
        let Some(m) = status.members.iter().find(|m| m.worker == *w) else {
            problems.push(format!("{w} not listed"));
            continue;
        };
        let printed = events
            .iter()
            .filter(|e| {
                e.worker == *w && e.kind == "allreduce" && e.int("gen") == Some(r.generation) && e.t_ms() <= r.at_ms
            })
            .filter_map(|e| e.int("step"))
            .max();
        shown.push(format!(
            "{w}: heartbeat {} ms ago, gen {} step {} {} (printed step {})",
            m.heartbeat_age_ms,
            m.generation,
            m.step,
            m.activity,
            o(printed)
        ));
        let min_age = (sc.heartbeat_interval.0 * 2).as_millis() as u64;
        if m.heartbeat_age_ms < min_age {
            problems.push(format!("{w}'s heartbeat age {} ms < {min_age} ms", m.heartbeat_age_ms));
        }
        if m.generation as i64 != r.generation {
            problems.push(format!("{w} shown in generation {}, hung in {}", m.generation, r.generation));
        }
        if printed.is_none_or(|p| m.step as i64 > p) {
            problems.push(format!("{w} shown at step {}, beyond the last it printed ({})", m.step, o(printed)));
        }
    }
    if let (Some(hung_age), Some(other_age)) = (freshest_hung, stalest_other) {
        if other_age >= hung_age {
            problems.push(format!("another member's heartbeat is as old ({other_age} ms)"));
        }
    }
    shown.push(format!("others at most {} ms", stalest_other.map_or_else(|| "-".into(), |a| a.to_string())));
    Some(Check {
        what,
        ok: problems.is_empty(),
        detail: format!(
            "+{} ms: {}{}",
            status.after_ms,
            shown.join("; "),
            if problems.is_empty() { String::new() } else { format!(" -- {}", problems.join("; ")) }
        ),
    })
}

/// Check: every survivor of kill `r` got its error within `bound` of the SIGKILL; the detail
/// gives each survivor's time, marking those on the killed rank's host (its shared-memory
/// peers) with `shm`.
fn kill_errors_check(r: &FaultRecord, bound: Duration, hosts: &BTreeMap<String, String>) -> Check {
    let dead: Vec<&str> = r.targets.iter().map(|t| t.split('(').next().unwrap_or("")).collect();
    let dead_hosts: BTreeSet<&str> = dead.iter().filter_map(|w| hosts.get(*w)).map(String::as_str).collect();
    let limit = bound.as_millis() as i64;
    let mut late = Vec::new();
    let mut seen = Vec::new();
    for w in &r.survivors {
        let shm = hosts.get(w).is_some_and(|h| dead_hosts.contains(h.as_str()));
        match r.errors.iter().find(|e| e.worker == *w) {
            Some(e) => {
                seen.push(format!("{w}{} {} ms", if shm { " (shm)" } else { "" }, e.after_ms));
                if e.after_ms > limit {
                    late.push(w.clone());
                }
            }
            None => {
                seen.push(format!("{w}{} none", if shm { " (shm)" } else { "" }));
                late.push(w.clone());
            }
        }
    }
    Check {
        what: format!("fault {} (kill): every survivor's error within {limit} ms", r.index),
        ok: late.is_empty() && !r.survivors.is_empty(),
        detail: format!(
            "{}{}",
            seen.join(", "),
            if late.is_empty() { String::new() } else { format!(" -- late or missing: {}", late.join(",")) }
        ),
    }
}

/// Check: a hung rank (stop fault `r`) is detected as a `Timeout` (the first survivor's
/// error), and no survivor takes it for a death (`PeerFailed`): a stopped process's links
/// stay open, so only the no-progress deadline can tell. A survivor whose link closed
/// because a peer aborted on the revocation reports `PeerFailed` with the generation's root
/// cause, the timeout: that is the verdict reaching it, not a death taken for the hang (with
/// learned deadlines the revocation and those closes arrive within the same millisecond).
fn hang_timeout_check(r: &FaultRecord) -> Check {
    let first = r.errors.iter().min_by_key(|e| e.after_ms);
    let dead: Vec<&str> = r
        .errors
        .iter()
        .filter(|e| e.kind == "PeerFailed" && !e.cause.contains("timed out"))
        .map(|e| e.worker.as_str())
        .collect();
    let kinds: BTreeSet<&str> = r.errors.iter().map(|e| e.kind.as_str()).collect();
    Check {
        what: format!("fault {} (stop): detected as a Timeout, by no survivor as a death", r.index),
        ok: first.is_some_and(|e| e.kind == "Timeout") && dead.is_empty(),
        detail: format!(
            "first error {}; kinds seen {:?}{}",
            first.map_or_else(|| "none".to_string(), |e| format!("{} at {} ms", e.kind, e.after_ms)),
            kinds,
            if dead.is_empty() { String::new() } else { format!(" -- PeerFailed at {}", dead.join(",")) }
        ),
    }
}

/// Check: a later generation verified a step after fault `r`.
fn next_step_check(r: &FaultRecord, kind: &str) -> Check {
    Check {
        what: format!("fault {} ({kind}): the next generation verified a step", r.index),
        ok: r.next_step_ms.is_some(),
        detail: format!("{} ms", o(r.next_step_ms)),
    }
}

/// Check: a silent fault (no FIN, no RST) was detected within the no-progress deadline, plus
/// a step interval and 1 s of slack.
fn detection_check(r: &FaultRecord, kind: &str, sc: &Scenario) -> Check {
    let limit = (sc.no_progress.0 + sc.step_interval.0 + Duration::from_millis(1000)).as_millis() as i64;
    Check {
        what: format!(
            "fault {} ({kind}): detected within the no-progress deadline ({} ms) + 1 s",
            r.index,
            sc.no_progress.0.as_millis()
        ),
        ok: r.first_error_ms.is_some_and(|t| t <= limit),
        detail: format!("first error after {} ms", o(r.first_error_ms)),
    }
}

fn o(v: Option<i64>) -> String {
    v.map_or_else(|| "-".into(), |x| x.to_string())
}

/// A host of several ranks cut off at once is one failure of its domain: every survivor's root
/// cause names the host as the lost domain and counts all of its ranks (the coordinator's
/// domain rule, `cohort_coordinator::domains`; the chaos harness publishes each emulated host
/// as its workers' domain).
fn domain_cause_check(r: &FaultRecord, hosts: &BTreeMap<String, String>) -> Check {
    let worker = |t: &String| t.split('(').next().unwrap_or("").to_string();
    let host = r.targets.first().map(worker).and_then(|w| hosts.get(&w).cloned()).unwrap_or_default();
    let want = (format!("domain {host} lost: ranks "), format!("(all {} of its ranks)", r.targets.len()));
    let named = r.errors.iter().filter(|e| e.cause.contains(&want.0) && e.cause.contains(&want.1)).count();
    Check {
        what: format!(
            "fault {} (host {host} of {} ranks lost): one root cause naming the domain and all its ranks",
            r.index,
            r.targets.len()
        ),
        ok: !host.is_empty() && named == r.survivors.len() && !r.survivors.is_empty(),
        detail: format!("{named} of {} survivors; causes: {}", r.survivors.len(), causes(r)),
    }
}

/// Whether a root cause as a worker prints it (`rank 2 (worker w2 on host-a): SIGKILL
/// (reported by w0)`, see `cohort::RootCause`'s Display) blames worker `name`: the id after
/// "(worker " is compared exactly, so that `w1` matches neither `w10` nor a reporter's name.
pub(crate) fn cause_names(cause: &str, name: &str) -> bool {
    let Some(start) = cause.find("(worker ") else { return false };
    let rest = &cause[start + "(worker ".len()..];
    let end = rest.find([' ', ')']).unwrap_or(rest.len());
    !name.is_empty() && &rest[..end] == name
}

fn causes(r: &FaultRecord) -> String {
    let mut c: Vec<String> = r.errors.iter().map(|e| format!("{} {}: {}", e.worker, e.kind, e.cause)).collect();
    c.truncate(4);
    c.join(" | ")
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

#[cfg(test)]
mod tests {

    #[test]
    fn a_kill_is_mid_allreduce_only_on_evidence() {
        let record = FaultRecord {
            targets: vec!["w1(rank 1)".into()],
            survivors: vec!["w0".into()],
            generation: 2,
            at_ms: 1000,
            mid_allreduce: true,
            ..Default::default()
        };
        let announced = ev("w1", "event=allreduce gen=2 rank=1 step=7 t_ms=990");
        // In flight: the survivor's allreduce of step 7 failed.
        let in_flight = [announced.clone(), ev("w0", "event=error gen=2 rank=0 step=7 kind=PeerFailed t_ms=1003")];
        assert!(struck_mid_allreduce(&record, &in_flight));
        // The collective had ended before the kill: the victim reported step 8, and the
        // survivor failed later, at the commit point.
        let after = [
            announced.clone(),
            ev("w1", "event=step gen=2 world=2 rank=1 step=8 t_ms=995"),
            ev("w0", "event=error gen=2 rank=0 step=8 phase=commit kind=PeerFailed t_ms=1004"),
        ];
        assert!(!struck_mid_allreduce(&record, &after));
        // No error from a survivor at that step: no evidence.
        assert!(!struck_mid_allreduce(&record, &[announced]));
        let measured = measure(&[record], &after);
        assert!(!measured[0].mid_allreduce, "measure reports the kill as not mid-allreduce");
    }

    #[test]
    fn a_cause_names_a_worker_exactly() {
        let cause = "rank 1 (worker w1 on vm): peer rank 1 failed (reported by w0)";
        assert!(cause_names(cause, "w1"));
        assert!(!cause_names(cause, "w0"), "the reporter is not the culprit");
        assert!(!cause_names("rank 1 (worker w10 on vm): SIGKILL", "w1"), "w10 is not w1");
        assert!(!cause_names("rank 1 (worker w1 on vm): SIGKILL", "w10"));
        assert!(cause_names("(worker w3): left", "w3"));
        assert!(!cause_names("lease expired", "w3"));
        assert!(!cause_names("rank 1 (worker w1 on vm): x", ""));
    }

    use super::*;

    fn ev(worker: &str, line: &str) -> WorkerEvent {
        WorkerEvent::parse(worker, line, 0).unwrap()
    }

    #[test]
    fn straggler_checks_follow_the_policy() {
        let scenario = |policy: &str| {
            Scenario::parse(
                "s",
                &format!(
                    "compute = \"8ms\"\nstraggler_policy = \"{policy}\"\nstraggler_cooldown = \"5s\"\n[[fault]]\nkind = \"straggler\"\nranks = [1]\nduration = \"5s\"\nstop_for = \"20ms\"\nrun_for = \"10ms\"\nname_within_steps = 50"
                ),
            )
            .unwrap()
        };
        let record = |seen: StragglerSeen| FaultRecord {
            index: 1,
            kind: FaultKind::Straggler,
            generation: 1,
            world: 3,
            step: 100,
            at_ms: 10_000,
            steps_per_s_before: Some(40.0),
            steps_per_s_during: Some(25.0),
            straggler: Some(seen),
            ..Default::default()
        };
        let named = StragglerSeen {
            target: "w1".into(),
            named: Some("w1".into()),
            kind: "compute".into(),
            named_after_steps: Some(20),
            ..Default::default()
        };
        let failed = |checks: &[Check]| checks.iter().filter(|c| !c.ok).map(|c| c.what.clone()).collect::<Vec<_>>();
        // Report: named in time, nothing excluded, nothing failed.
        let report = StragglerSeen { policy: "report".into(), ..named.clone() };
        let steps = [ev("w0", "event=step gen=1 world=3 rank=0 step=120 t_ms=11000")];
        assert!(failed(&straggler_checks(&record(report.clone()), &steps, &scenario("report"))).is_empty());
        // ... but named too late, or someone else named, or a timeout, or a leave: each fails.
        let late = StragglerSeen { named_after_steps: Some(51), ..report.clone() };
        assert_eq!(failed(&straggler_checks(&record(late), &steps, &scenario("report"))).len(), 1);
        let other = StragglerSeen { others_named: vec!["w2".into()], ..report.clone() };
        assert_eq!(failed(&straggler_checks(&record(other), &steps, &scenario("report"))).len(), 1);
        let timeout = [ev("w0", "event=error gen=1 rank=0 step=121 kind=Timeout cause=x t_ms=11500")];
        assert_eq!(failed(&straggler_checks(&record(report.clone()), &timeout, &scenario("report"))).len(), 1);
        let leave = [ev("w1", "event=straggler_leave gen=1 rank=1 step=121 reason=x t_ms=11500")];
        assert_eq!(failed(&straggler_checks(&record(report), &leave, &scenario("report"))).len(), 1);
        // Exclude: a leave, the pace back to 0.9 of the fault-free rate, a return after the
        // cool-down.
        let excluded = StragglerSeen {
            policy: "exclude".into(),
            excluded_at_ms: Some(11_500),
            rejoined_at_ms: Some(16_600),
            steps_per_s_after: Some(37.0),
            ..named
        };
        assert!(failed(&straggler_checks(&record(excluded.clone()), &leave, &scenario("exclude"))).is_empty());
        let slow = StragglerSeen { steps_per_s_after: Some(35.0), ..excluded.clone() };
        assert_eq!(failed(&straggler_checks(&record(slow), &leave, &scenario("exclude"))).len(), 1);
        let early = StragglerSeen { rejoined_at_ms: Some(12_000), ..excluded.clone() };
        assert_eq!(failed(&straggler_checks(&record(early), &leave, &scenario("exclude"))).len(), 1);
        let stayed = StragglerSeen { excluded_at_ms: None, rejoined_at_ms: None, ..excluded };
        assert!(failed(&straggler_checks(&record(stayed), &steps, &scenario("exclude"))).len() >= 2);
    }

    fn record(index: usize, kind: &str, generation: i64, at_ms: u64, survivors: &[&str]) -> FaultRecord {
        FaultRecord {
            index,
            kind: FaultKind::from_name(kind).expect("a fault kind"),
            generation,
            at_ms,
            survivors: survivors.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn quiet_faults_measure_the_step_rate_and_re_form_nothing() {
        // Steps 1..=10 at t=1000..1900 (10 per second), then steps 11..=15 at t=2100..2900
        // (5 per second while a 1 s latency fault struck at t=2000 lasts); a kill at t=3500
        // re-forms into generation 2 at t=3600.
        let mut events: Vec<WorkerEvent> =
            (1..=10).map(|s| ev("w0", &format!("event=step gen=1 step={s} t_ms={}", 900 + s * 100))).collect();
        events
            .extend((11..=15).map(|s| ev("w0", &format!("event=step gen=1 step={s} t_ms={}", 2100 + (s - 11) * 200))));
        events.push(ev("w0", "event=step gen=2 step=16 t_ms=3600"));
        let mut latency = record(1, "latency", 1, 2000, &["w0"]);
        latency.duration_ms = 1000;
        let out = measure(&[latency, record(2, "kill", 1, 3500, &["w0"])], &events);
        assert_eq!(out[0].next_step_ms, None, "a latency fault re-forms nothing; generation 2 is the kill's");
        assert_eq!(out[0].steps_per_s_before, Some(9.0), "steps 1..10 between t=1000 and t=2000: 10 - 1 over 1 s");
        assert_eq!(out[0].steps_per_s_during, Some(5.0));
        assert!(out[0].extra().contains("x0.56"), "{}", out[0].extra());
        assert_eq!(out[1].next_step_ms, Some(100));
        assert_eq!(step_rate(&events, 0, 500), None, "before the first step");
    }

    #[test]
    fn the_kill_bound_wants_every_survivor_in_time_and_marks_the_shared_memory_peers() {
        let hosts: BTreeMap<String, String> = [("w0", "host0"), ("w1", "host0"), ("w2", "host1")]
            .iter()
            .map(|(w, h)| (w.to_string(), h.to_string()))
            .collect();
        let mut r = record(1, "kill", 1, 1000, &["w0", "w2"]);
        r.targets = vec!["w1(rank 1)".into()];
        let seen = |worker: &str, after_ms| ErrorSeen {
            worker: worker.into(),
            kind: "PeerFailed".into(),
            cause: "rank 1 (worker w1 on vm): SIGKILL".into(),
            after_ms,
        };
        r.errors = vec![seen("w0", 3), seen("w2", 40)];
        let c = kill_errors_check(&r, Duration::from_millis(100), &hosts);
        assert!(c.ok, "{}", c.detail);
        assert_eq!(c.detail, "w0 (shm) 3 ms, w2 40 ms");
        r.errors = vec![seen("w0", 3), seen("w2", 140)];
        let c = kill_errors_check(&r, Duration::from_millis(100), &hosts);
        assert!(!c.ok && c.detail.ends_with("late or missing: w2"), "{}", c.detail);
        r.errors.truncate(1);
        assert!(!kill_errors_check(&r, Duration::from_millis(100), &hosts).ok, "a survivor without an error");
    }

    #[test]
    fn a_lost_host_must_be_one_domain_cause_with_all_its_ranks() {
        let hosts: BTreeMap<String, String> =
            [("w0", "host0"), ("w1", "host0"), ("w2", "host0"), ("w3", "host1"), ("w4", "host1"), ("w5", "host1")]
                .iter()
                .map(|(w, h)| (w.to_string(), h.to_string()))
                .collect();
        let mut r = record(1, "isolate", 1, 1000, &["w0", "w1", "w2"]);
        r.targets = vec!["w4(rank 4)".into(), "w3(rank 3)".into(), "w5(rank 5)".into()];
        let seen = |worker: &str, cause: &str| ErrorSeen {
            worker: worker.into(),
            kind: "Timeout".into(),
            cause: cause.into(),
            after_ms: 500,
        };
        let domain = "rank 4 (worker w4 on vm): domain host1 lost: ranks 3-5 (all 3 of its ranks) failed together; first report: timed out";
        r.errors = vec![seen("w0", domain), seen("w1", domain), seen("w2", domain)];
        let c = domain_cause_check(&r, &hosts);
        assert!(c.ok, "{}", c.detail);
        assert!(c.what.contains("host host1 of 3 ranks"), "{}", c.what);
        // One survivor heard a member's cause: the domain was not judged as one failure.
        r.errors[2] = seen("w2", "rank 4 (worker w4 on vm): timed out");
        assert!(!domain_cause_check(&r, &hosts).ok);
        // Two of the three ranks counted: not the whole domain.
        let partial = "rank 4 (worker w4 on vm): domain host1 lost: ranks 3-4 (all 2 of its ranks) failed together";
        r.errors[2] = seen("w2", partial);
        assert!(!domain_cause_check(&r, &hosts).ok);
    }

    #[test]
    fn a_hung_rank_must_be_a_timeout_and_never_a_death() {
        let seen = |worker: &str, kind: &str, after_ms| ErrorSeen {
            worker: worker.into(),
            kind: kind.into(),
            cause: "rank 2 (worker w2 on vm): timed out".into(),
            after_ms,
        };
        let mut r = record(2, "stop", 3, 1000, &["w0", "w1"]);
        r.errors = vec![seen("w1", "Revoked", 1510), seen("w0", "Timeout", 1501)];
        let c = hang_timeout_check(&r);
        assert!(c.ok, "{}", c.detail);
        assert!(c.detail.starts_with("first error Timeout at 1501 ms"), "{}", c.detail);
        // A survivor whose peer closed a link on the revocation carries the timeout verdict.
        r.errors = vec![seen("w0", "Timeout", 1501), seen("w1", "PeerFailed", 1502)];
        assert!(hang_timeout_check(&r).ok, "{}", hang_timeout_check(&r).detail);
        r.errors[1].cause = "rank 2 (worker w2 on vm): peer rank 2 failed: connection reset".into();
        assert!(!hang_timeout_check(&r).ok, "a stopped rank is no dead one");
        r.errors.clear();
        assert!(!hang_timeout_check(&r).ok, "no error at all");
    }

    #[test]
    fn a_join_storm_is_absorbed_when_a_generation_holds_every_joiner() {
        let events = [
            ev("w0", "event=generation gen=2 world=3 rank=0 t_ms=100"),
            ev("j1", "event=generation gen=2 world=3 rank=2 t_ms=100"),
            ev("w0", "event=step gen=2 step=5 t_ms=120"),
            ev("w0", "event=generation gen=3 world=4 rank=0 t_ms=200"),
            ev("j1", "event=generation gen=3 world=4 rank=2 t_ms=200"),
            ev("j2", "event=generation gen=3 world=4 rank=3 t_ms=201"),
            ev("j2", "event=step gen=3 step=6 t_ms=230"),
            ev("w0", "event=step gen=3 step=6 t_ms=231"),
        ];
        assert_eq!(absorbed(&events, 1, &["j1", "j2"]), Some(230));
        assert_eq!(absorbed(&events, 1, &["j1"]), Some(120));
        assert_eq!(absorbed(&events, 1, &["j1", "j9"]), None);
        assert_eq!(absorbed(&events, 3, &["j1"]), None, "only generations after the storm's");
    }

    fn seen(worker: &str, age: u64, step: u64) -> crate::report::MemberSeen {
        crate::report::MemberSeen {
            worker: worker.into(),
            rank: Some(0),
            generation: 4,
            step,
            activity: "allreduce".into(),
            heartbeat_age_ms: age,
            control_connected: Some(true),
        }
    }

    #[test]
    fn the_status_check_wants_the_hung_rank_stalest_and_where_it_stopped() {
        let sc: Scenario = toml::from_str("name = \"t\"\nheartbeat_interval = \"200ms\"").expect("scenario");
        let events = [ev("w2", "event=allreduce gen=4 rank=2 step=12 t_ms=900")];
        let mut r = record(1, "stop", 4, 1000, &["w0", "w1"]);
        r.targets = vec!["w2(rank 2)".into()];
        r.status = Some(StatusSeen {
            after_ms: 600,
            members: vec![seen("w0", 90, 12), seen("w1", 150, 12), seen("w2", 680, 11)],
        });
        let c = hung_rank_status_check(&r, &events, &sc).expect("a check");
        assert!(c.ok, "{}", c.detail);
        // Another member as stale: status would not tell who hung.
        r.status = Some(StatusSeen { after_ms: 600, members: vec![seen("w0", 700, 12), seen("w2", 680, 11)] });
        assert!(!hung_rank_status_check(&r, &events, &sc).expect("check").ok);
        // A step beyond the one it printed, or a fresh heartbeat, is wrong too.
        r.status = Some(StatusSeen { after_ms: 600, members: vec![seen("w0", 90, 12), seen("w2", 680, 13)] });
        assert!(!hung_rank_status_check(&r, &events, &sc).expect("check").ok);
        r.status = Some(StatusSeen { after_ms: 600, members: vec![seen("w0", 90, 12), seen("w2", 300, 11)] });
        assert!(!hung_rank_status_check(&r, &events, &sc).expect("check").ok);
        // No status read is a failure; none taken by design is no check.
        r.status = None;
        assert!(!hung_rank_status_check(&r, &events, &sc).expect("check").ok);
        r.note = "no status taken: ...".into();
        assert!(hung_rank_status_check(&r, &events, &sc).is_none());
    }

    #[test]
    fn a_later_fault_of_the_same_generation_keeps_its_own_errors() {
        // A leader kill at t=1000 fails nothing; a SIGKILL of w2 at t=3000 in the same
        // generation fails w0 and w1 at t=3004.
        let records = [
            record(1, "coordinator_leader_kill", 4, 1000, &["w0", "w1", "w2"]),
            record(2, "kill", 4, 3000, &["w0", "w1"]),
        ];
        let events = [
            ev("w0", "event=error gen=4 rank=0 step=9 kind=PeerFailed cause=\"rank 2 (worker w2): SIGKILL\" t_ms=3004"),
            ev("w1", "event=error gen=4 rank=1 step=9 kind=PeerFailed cause=\"rank 2 (worker w2): SIGKILL\" t_ms=3005"),
            ev("w0", "event=step gen=5 rank=0 step=9 world=2 t_ms=3300"),
        ];
        let out = measure(&records, &events);
        assert!(out[0].errors.is_empty(), "the leader kill failed nothing: {:?}", out[0].errors);
        assert_eq!(out[1].errors.len(), 2);
        assert_eq!(out[1].first_error_ms, Some(4));
        assert_eq!(out[1].survivors_errors_ms, Some(5));
        assert_eq!(out[1].next_step_ms, Some(300));
    }
}
