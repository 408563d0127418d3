//! A local rehearsal of what deploy/ (the Kubernetes manifests) does, with real processes.
//!
//! - Three coordinator replicas on one real etcd (the launcher starts etcd on a free
//!   loopback port), as the prod overlay runs them.
//! - The workers are the pods of the `cohort-worker` StatefulSet: named by ordinal
//!   (`cohort-worker-0`, ...; the manifests pass `--worker-id $(POD_NAME)`), started in
//!   parallel on scale-up (`podManagementPolicy: Parallel`), and on scale-down the highest
//!   ordinals get SIGTERM at once and SIGKILL if still alive after the grace period
//!   (`terminationGracePeriodSeconds`).
//! - `kubectl scale` 4 -> 6 -> 3 while the job runs, and in between the coordinator
//!   "upgrade" (deploy/README.md, section 8): every replica restarted, one at a time, the
//!   leader first, while the job keeps stepping.
//!
//! What must hold: every step's allreduce verified (no `event=wrong_result`), no failure at
//! all (no `event=error`: scale-up is cooperative, scale-down is a graceful leave, and a
//! coordinator restart is invisible to the job), the leavers leave gracefully and exit 0,
//! the remaining three finish every step and exit 0, and `cohort-coordinator status` (the
//! README's command) shows the members and a leader that changes when the leader goes.
//! Every replica and pod serves `/metrics` as the manifests run them (the pods' readiness
//! probe and the scrape annotations point there): at each phase every endpoint answers with
//! well-formed Prometheus text, exactly one replica reports `cohort_is_leader 1`, its job
//! gauges agree with the pods', and every pod's gauges show the generation it steps in.
//! Every wait is bounded; nothing sleeps to synchronise.
//!
//! The same rehearsal runs a second time with Python pods, as the `pytorch` overlay runs
//! them: each pod is a Python training process on the `cohort` package
//! (python/tests/workers/elastic_train.py, which checks every reduced gradient and its
//! parameters against their known values at every step). It needs the package built
//! (`scripts/python-env.sh`; `$COHORT_PYTHON` names the interpreter). Without it the Python
//! rehearsal says SKIPPED, unless `COHORT_REQUIRE_PYTHON` is set (scripts/test.sh sets it),
//! where it fails. Python pods serve no `/metrics`: only the replicas' are judged there.

use cohort_chaos::binaries::Binaries;
use cohort_chaos::cluster::{Cluster, ClusterConfig, JobSettings, StoreKind, WorkerSpec};
use cohort_chaos::events::{self as ev, WorkerEvent};
use cohort_chaos::invariants;
use cohort_chaos::metrics::{scrape, Samples};
use cohort_chaos::process::now_ms;
use cohort_integration_tests::{check, fail, of};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// The whole rehearsal (normally about 30 s on two cores).
const BOUND: Duration = Duration::from_secs(170);
/// A single phase (formation, a number of steps, a restart).
const PHASE: Duration = Duration::from_secs(40);
/// The pods' terminationGracePeriodSeconds, scaled down (the manifests say 60 s; a leave
/// takes one step and a coordinator call).
const GRACE: Duration = Duration::from_secs(30);
/// Steps of the job. Enough for the scenario to happen mid-job on a fast machine (it is
/// checked before the scale-down), few enough that the last three finish soon after.
const STEPS: u64 = 500;
const JOB: &str = "k8s-rehearsal";

/// What the pods run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pods {
    /// `cohort-worker train` (the default overlays).
    Rust,
    /// A Python training process on the `cohort` package (the `pytorch` overlay).
    Python,
}

/// The two rehearsals start a dozen processes each: one at a time on a two-core machine.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The Python pods' command line (placeholders filled by the cluster; `{python}` is
/// `$COHORT_PYTHON`).
fn python_pod_command() -> Vec<String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../python/tests/workers/elastic_train.py");
    let flags = "--coordinator {coordinator} --job {job} --worker-id {worker_id} --listen {listen} \
                 --advertise {advertise} --token-file {token_file} --steps {steps} --size {size} \
                 --no-progress-ms {no_progress_ms} --step-interval-ms {step_interval_ms}";
    ["{python}", "-u", script].into_iter().chain(flags.split_whitespace()).map(String::from).collect()
}

/// Pod name of StatefulSet ordinal `i`.
fn pod(i: usize) -> String {
    format!("cohort-worker-{i}")
}

/// The `cohort-worker` StatefulSet: `replicas` pods, ordinals 0..replicas.
struct StatefulSet {
    replicas: usize,
    spec: WorkerSpec,
}

/// What one scale-down did to one pod.
#[derive(Debug)]
struct Termination {
    pod: String,
    /// It exited within the grace period (printed its summary or a fatal error).
    in_grace: bool,
    /// For a pod that did not: its exit code if its process had ended all the same, silently
    /// (`Some(None)`: by a signal), or `None` if it was still running and got SIGKILL.
    silent_exit: Option<Option<i32>>,
}

impl Termination {
    /// What went wrong with a pod not `in_grace`, for a check's message.
    fn failure(&self) -> String {
        match self.silent_exit {
            Some(code) => format!("{} exited ({code:?}) without printing its summary or a fatal error", self.pod),
            None => format!("{} was still running after the grace period and got SIGKILL", self.pod),
        }
    }
}

impl StatefulSet {
    /// `kubectl scale --replicas=n` for n above the current size: the new ordinals start in
    /// parallel.
    fn scale_up(&mut self, cluster: &mut Cluster, n: usize) {
        assert!(n > self.replicas);
        for i in self.replicas..n {
            cluster.spawn_worker(&pod(i), &self.spec).expect("start pod");
        }
        self.replicas = n;
    }

    /// `kubectl scale --replicas=n` for n below the current size: the highest ordinals get
    /// SIGTERM at once; each still alive after `grace` gets SIGKILL, as the kubelet does.
    async fn scale_down(&mut self, cluster: &mut Cluster, n: usize, grace: Duration) -> Vec<Termination> {
        assert!(n < self.replicas);
        let leaving: Vec<String> = (n..self.replicas).rev().map(pod).collect();
        let seen_before = cluster.events.len();
        for p in &leaving {
            cluster.signal_worker(p, libc::SIGTERM).expect("SIGTERM a pod");
        }
        let exited = |e: &WorkerEvent| e.get::<ev::Summary>().is_some() || e.get::<ev::Fatal>().is_some();
        let mut pending: BTreeSet<String> = leaving.iter().cloned().collect();
        for e in &cluster.events[seen_before..] {
            if exited(e) {
                pending.remove(&e.worker);
            }
        }
        let deadline = tokio::time::Instant::now() + grace;
        while !pending.is_empty() {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match cluster
                .wait_for("the terminated pods to exit", left, |e| exited(e) && pending.contains(&e.worker))
                .await
            {
                Ok(e) => {
                    pending.remove(&e.worker);
                }
                Err(_) => break,
            }
        }
        let silent: BTreeMap<String, Option<i32>> =
            pending.iter().filter_map(|p| cluster.worker_exit(p).map(|code| (p.clone(), code))).collect();
        for p in &pending {
            cluster.signal_worker(p, libc::SIGKILL);
        }
        self.replicas = n;
        leaving
            .into_iter()
            .map(|p| Termination { in_grace: !pending.contains(&p), silent_exit: silent.get(&p).copied(), pod: p })
            .collect()
    }
}

/// `cohort-coordinator status` against the replicas, as deploy/README.md runs it.
async fn status(bins: &Binaries, cluster: &Cluster) -> Result<String, String> {
    let mut cmd = tokio::process::Command::new(&bins.coordinator);
    cmd.args(["status", "--job", JOB, "--endpoints", &cluster.endpoints(), "--timeout", "2s"])
        .arg("--token-file")
        .arg(cluster.log_dir().join("token"))
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(10), cmd.output())
        .await
        .map_err(|_| "status took more than 10 s".to_string())?
        .map_err(|e| format!("running status: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!("status failed ({}): {}{}", out.status, stdout, String::from_utf8_lossy(&out.stderr)))
    }
}

/// The leader that `status` names, if any.
fn leader_of(status: &str) -> Option<String> {
    let name = status.lines().find_map(|l| l.strip_prefix("leader: "))?.trim();
    (name != "(none)").then(|| name.to_string())
}

/// Polls `status` (bounded) until it names a leader other than `not`; returns it.
async fn wait_for_leader(bins: &Binaries, cluster: &Cluster, not: Option<&str>, within: Duration) -> String {
    let mut last = String::new();
    let result = tokio::time::timeout(within, async {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tick.tick().await;
            match status(bins, cluster).await {
                Ok(s) => {
                    if let Some(l) = leader_of(&s).filter(|l| Some(l.as_str()) != not) {
                        return l;
                    }
                    last = s;
                }
                Err(e) => last = e,
            }
        }
    })
    .await;
    result.unwrap_or_else(|_| panic!("no new leader within {within:?} (not {not:?}); last status:\n{last}"))
}

/// The index of the replica a leader name stands for: the launcher's `--name coord<i>`, or
/// the default name `host/pid/address`.
fn replica_index(cluster: &Cluster, leader: &str) -> usize {
    let endpoints = cluster.endpoints();
    endpoints
        .split(',')
        .enumerate()
        .position(|(i, e)| {
            let named = format!("coord{i}");
            leader == named
                || leader.starts_with(&format!("{named}/"))
                || leader.ends_with(&format!("/{}", e.trim_start_matches("http://")))
        })
        .unwrap_or_else(|| panic!("leader {leader:?} is none of the replicas {endpoints}"))
}

/// Highest step any worker has reported so far.
fn max_step(events: &[WorkerEvent]) -> i64 {
    events.iter().filter_map(|e| e.get::<ev::Step>()).map(|s| s.step as i64).max().unwrap_or(0)
}

/// Waits until every worker in `pods` has reported `n` steps in a generation of `world`
/// members, counting only steps taken at or after `since_ms` (ms since the epoch).
async fn wait_steps(cluster: &mut Cluster, pods: &[String], world: i64, since_ms: u64, n: usize, what: &str) {
    let counts = |e: &WorkerEvent| e.get::<ev::Step>().is_some_and(|s| s.world as i64 == world && s.t_ms >= since_ms);
    let mut seen: BTreeMap<String, usize> = pods.iter().map(|p| (p.clone(), 0)).collect();
    for e in &cluster.events {
        if counts(e) {
            if let Some(c) = seen.get_mut(&e.worker) {
                *c += 1;
            }
        }
    }
    let deadline = tokio::time::Instant::now() + PHASE;
    while seen.values().any(|&c| c < n) {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match cluster.wait_for(what, left, |e| counts(e) && seen.contains_key(&e.worker)).await {
            Ok(e) => {
                if let Some(c) = seen.get_mut(&e.worker) {
                    *c += 1;
                }
            }
            Err(err) => check(false, &format!("{err} (steps so far: {seen:?})"), &cluster.events),
        }
    }
}

/// What every replica and pod serves at `/metrics` at one moment.
struct Scrape {
    /// By replica index; the error when it did not answer.
    replicas: Vec<Result<Samples, String>>,
    /// By pod; the error when it did not answer.
    pods: BTreeMap<String, Result<Samples, String>>,
}

async fn scrape_all(cluster: &Cluster, pods: &[String]) -> Scrape {
    const EACH: Duration = Duration::from_secs(2);
    let mut replicas = Vec::new();
    for i in 0..cluster.coordinator_count() {
        replicas.push(match cluster.coordinator_metrics(i) {
            Some(addr) => scrape(addr, EACH).await.map_err(|e| e.to_string()),
            None => Err(format!("replica {i} printed no metrics address")),
        });
    }
    let mut by_pod = BTreeMap::new();
    for p in pods {
        let result = match cluster.worker_metrics(p) {
            Some(addr) => scrape(&addr.to_string(), EACH).await.map_err(|e| e.to_string()),
            None => Err(format!("{p} printed no metrics address")),
        };
        by_pod.insert(p.clone(), result);
    }
    Scrape { replicas, pods: by_pod }
}

/// What the metrics must show while `pods` step together in a generation of `world`: every
/// endpoint answers; every pod's gauges show that world and one common generation; exactly
/// one replica leads (`expected_leader`, if given, is its index), and its job gauges show
/// `world` members and the pods' generation.
/// With no `pods` (Python pods serve no metrics) only the replicas are judged, and the
/// leader's generation gauge is not compared.
fn judge(s: &Scrape, pods: &[String], world: f64, expected_leader: Option<usize>) -> Result<(), String> {
    let series = |name: &str| format!("{name}{{job=\"{JOB}\"}}");
    let mut generation = None;
    for p in pods {
        let m = s.pods[p].as_ref().map_err(|e| format!("pod {p}: {e}"))?;
        let w = m.get("cohort_worker_world_size");
        if w != Some(world) {
            return Err(format!("pod {p}: cohort_worker_world_size {w:?}, not {world}"));
        }
        let g = m.get("cohort_worker_generation").ok_or_else(|| format!("pod {p}: no cohort_worker_generation"))?;
        if *generation.get_or_insert(g) != g {
            return Err(format!("pods in different generations ({generation:?} and {g} at {p})"));
        }
        if m.get("cohort_worker_steps_verified_total").unwrap_or(0.0) < 1.0 {
            return Err(format!("pod {p}: no verified step counted"));
        }
    }
    let mut leaders = Vec::new();
    for (i, r) in s.replicas.iter().enumerate() {
        let m = r.as_ref().map_err(|e| format!("replica {i}: {e}"))?;
        if m.get("cohort_is_leader") == Some(1.0) {
            leaders.push(i);
        }
    }
    let [leader] = leaders[..] else { return Err(format!("replicas reporting cohort_is_leader 1: {leaders:?}")) };
    if expected_leader.is_some_and(|l| l != leader) {
        return Err(format!("replica {leader} reports itself leader; status names replica {expected_leader:?}"));
    }
    let m = s.replicas[leader].as_ref().map_err(Clone::clone)?;
    let members = m.get(&series("cohort_members"));
    let gen = m.get(&series("cohort_generation"));
    if members != Some(world) || (!pods.is_empty() && gen != generation) {
        return Err(format!("the leader (replica {leader}) shows members {members:?} and generation {gen:?}; the pods: {world} in {generation:?}"));
    }
    Ok(())
}

/// Scrapes every replica and pod until [`judge`] accepts (bounded by [`PHASE`]); fails the
/// rehearsal with the last complaint otherwise. The gauges follow the store and the pods'
/// own steps, so they may trail an event line by a moment.
async fn wait_metrics(
    cluster: &Cluster,
    pods: &[String],
    world: f64,
    expected_leader: Option<usize>,
    what: &str,
) -> Scrape {
    let deadline = tokio::time::Instant::now() + PHASE;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tick.tick().await;
        let s = scrape_all(cluster, pods).await;
        match judge(&s, pods, world, expected_leader) {
            Ok(()) => return s,
            Err(why) if tokio::time::Instant::now() >= deadline => {
                fail(&format!("metrics: {what}: {why}"), &cluster.events)
            }
            Err(_) => {}
        }
    }
}

async fn rehearsal(kind: Pods) {
    let _alone = ONE_AT_A_TIME.lock().await;
    // Each rehearsal has its own etcd and replicas: the job's name can be the same.
    let logs = match kind {
        Pods::Rust => JOB.to_string(),
        Pods::Python => format!("{JOB}-python"),
    };
    let config = ClusterConfig {
        job: JOB.into(),
        store: StoreKind::Etcd,
        coordinators: 3,
        // The dev overlay's job limits with test-sized timers; the lease TTL leaves a
        // restarted replica's clients time to fail over to another replica.
        settings: JobSettings {
            min_workers: 2,
            max_workers: 8,
            join_window: Duration::from_millis(300),
            heartbeat_interval: Duration::from_millis(200),
            lease_ttl: Duration::from_secs(4),
            elastic_timeout: Duration::from_secs(30),
            ..Default::default()
        },
        // COHORT_TEST_LOG_DIR keeps the processes' logs (default: a temporary directory).
        log_dir: std::env::var_os("COHORT_TEST_LOG_DIR").map(|d| std::path::PathBuf::from(d).join(&logs)),
        // Every replica and pod serves /metrics, as the manifests run them (the pods'
        // readiness probe and the scrape annotations use it).
        metrics: true,
        exclusion: None,
    };
    let mut cluster = Cluster::start(config).await.expect("etcd and three coordinator replicas");
    let bins = Binaries::locate().expect("binaries");
    let mut sts = StatefulSet {
        replicas: 0,
        spec: WorkerSpec {
            steps: STEPS,
            size: "256K".into(),
            step_interval: Duration::from_millis(15),
            no_progress: Duration::from_secs(5),
            fixed_deadlines: false,
            extra_args: Vec::new(),
            command: (kind == Pods::Python).then(python_pod_command),
        },
    };
    // The pods whose /metrics are judged (Python pods serve none).
    let metered = |pods: &[String]| if kind == Pods::Rust { pods.to_vec() } else { Vec::new() };
    let all: Vec<String> = (0..6).map(pod).collect();
    let started = std::time::Instant::now();
    let phase = |what: &str, events: &[WorkerEvent]| {
        eprintln!("[{:>5.1}s] step {:>3}: {what}", started.elapsed().as_secs_f64(), max_step(events))
    };
    eprintln!("logs: {}", cluster.log_dir().display());

    // kubectl apply: 4 pods.
    sts.scale_up(&mut cluster, 4);
    wait_steps(&mut cluster, &all[..4], 4, 0, 5, "4 pods to form a generation and step").await;
    phase("4 pods stepping", &cluster.events);

    // kubectl scale --replicas=6: two joiners, taken in at the next commit point.
    let before_join = max_step(&cluster.events);
    sts.scale_up(&mut cluster, 6);
    wait_steps(&mut cluster, &all, 6, 0, 5, "6 pods to step together").await;
    for p in &all[4..] {
        let restored = of::<ev::Restored>(&cluster.events, p).next().map_or(-1, |e| e.step);
        check(
            restored >= before_join,
            &format!("joiner {p} restored step {restored}, not the committed state"),
            &cluster.events,
        );
    }
    let s = status(&bins, &cluster).await.expect("status");
    for p in &all {
        check(s.contains(p.as_str()), &format!("status does not list {p}:\n{s}"), &cluster.events);
    }
    check(s.contains("(6 members"), &format!("status does not show a generation of 6:\n{s}"), &cluster.events);
    phase("6 pods stepping, status lists them", &cluster.events);
    let scraped = wait_metrics(&cluster, &metered(&all), 6.0, None, "6 pods").await;
    let joins: f64 = scraped
        .replicas
        .iter()
        .flatten()
        .map(|m| m.get(r#"cohort_rpcs_total{method="Join",code="OK"}"#).unwrap_or(0.0))
        .sum();
    check(joins >= 6.0, &format!("metrics: the replicas counted {joins} successful joins of 6 pods"), &cluster.events);
    phase("every replica and pod serves /metrics; one leader; gauges agree", &cluster.events);

    // The coordinator upgrade: every replica replaced, one at a time, the leader first.
    // The leader is killed (SIGKILL, harsher than Kubernetes' preStop + SIGTERM) and stays
    // down until another replica has taken over and the job has gone on without it; then
    // it comes back on its address and the others are replaced in turn as a rolling update
    // replaces pods: SIGTERM, SIGKILL only after the grace period, then a new process.
    let first_leader = wait_for_leader(&bins, &cluster, None, PHASE).await;
    let leader_index = replica_index(&cluster, &first_leader);
    phase(&format!("killing the leader {first_leader}"), &cluster.events);
    let killed_at = now_ms();
    cluster.kill_coordinator(leader_index).await;
    wait_steps(&mut cluster, &all, 6, killed_at, 5, "the job to go on after the leader was killed").await;
    let new_leader = wait_for_leader(&bins, &cluster, Some(&first_leader), PHASE).await;
    check(replica_index(&cluster, &new_leader) != leader_index, "the killed replica still leads", &cluster.events);
    phase(&format!("{new_leader} took over; restarting the old leader's replica"), &cluster.events);
    cluster.restart_coordinator(leader_index).await.expect("bring the old leader's replica back");
    for i in (0..cluster.coordinator_count()).filter(|&i| i != leader_index) {
        let restarted_at = now_ms();
        let code = cluster.stop_coordinator(i, GRACE).await;
        check(
            code == Some(0),
            &format!("replica {i} did not stop cleanly on SIGTERM within {GRACE:?} (exit {code:?})"),
            &cluster.events,
        );
        cluster.start_coordinator_again(i).await.expect("start the replica again");
        wait_steps(&mut cluster, &all, 6, restarted_at, 5, "the job to go on while a coordinator restarts").await;
        phase(&format!("replica {i} replaced (SIGTERM, exit 0)"), &cluster.events);
    }
    // A replica's graceful shutdown ends its watchers' streams from its side: it must not
    // mark them as gone (their processes live; they reconnect to another replica).
    let s = status(&bins, &cluster).await.expect("status");
    for p in &all {
        let line = s.lines().find(|l| l.contains(p.as_str())).unwrap_or("");
        check(
            !line.contains("CLOSED"),
            &format!("{p}'s control stream reads CLOSED after a rolling restart:\n{s}"),
            &cluster.events,
        );
    }
    let leader = wait_for_leader(&bins, &cluster, None, PHASE).await;
    phase(&format!("upgrade done, leader {leader}"), &cluster.events);
    wait_metrics(&cluster, &metered(&all), 6.0, Some(replica_index(&cluster, &leader)), "after the rolling upgrade")
        .await;
    let before_scale_down = max_step(&cluster.events);
    check(
        before_scale_down + 50 < STEPS as i64,
        &format!("the job ran too fast (step {before_scale_down} of {STEPS} before the scale-down): raise STEPS"),
        &cluster.events,
    );

    // kubectl scale --replicas=3: ordinals 5, 4, 3 get SIGTERM (SIGKILL after the grace).
    let terminations = sts.scale_down(&mut cluster, 3, GRACE).await;
    phase(&format!("scaled down: {terminations:?}"), &cluster.events);
    for t in &terminations {
        check(t.in_grace, &t.failure(), &cluster.events);
    }
    wait_steps(&mut cluster, &all[..3], 3, 0, 5, "the remaining 3 pods to step").await;
    let s = status(&bins, &cluster).await.expect("status");
    check(s.contains("(3 members"), &format!("status does not show a generation of 3:\n{s}"), &cluster.events);
    phase("3 pods stepping", &cluster.events);
    wait_metrics(&cluster, &metered(&all[..3]), 3.0, None, "after the scale-down").await;
    let codes = cluster.wait_workers(Duration::from_secs(90)).await;
    phase(&format!("all exited: {codes:?}"), &cluster.events);
    let events = &cluster.events;
    for t in &terminations {
        // cohort-worker prints the signal's arrival; the Python worker acts on it only
        // (its leave and summary below show it).
        if kind == Pods::Rust {
            check(
                of::<ev::Sigterm>(events, &t.pod).next().is_some(),
                &format!("{} did not see its SIGTERM", t.pod),
                events,
            );
        }
        let finished_first = of::<ev::Finished>(events, &t.pod).next().is_some();
        check(
            of::<ev::Leave>(events, &t.pod).next().is_some(),
            &format!(
                "{} did not leave gracefully{}",
                t.pod,
                if finished_first { " (the job had finished before the scale-down: raise STEPS)" } else { "" }
            ),
            events,
        );
        let summary = of::<ev::Summary>(events, &t.pod).last();
        check(summary.is_some_and(|s| s.left), &format!("{} has no summary with left=true", t.pod), events);
    }
    for p in &all[..3] {
        let summary = of::<ev::Summary>(events, p).last();
        check(summary.map(|s| s.final_step) == Some(STEPS), &format!("{p} did not finish all {STEPS} steps"), events);
        check(
            of::<ev::Generation>(events, p).any(|g| g.world == 3),
            &format!("{p} never stepped in the generation of 3"),
            events,
        );
    }
    for (w, code) in &codes {
        check(*code == Some(0), &format!("{w} exited {code:?}"), events);
    }
    let errors: Vec<String> = events
        .iter()
        .filter(|e| e.get::<ev::Error>().is_some() || e.get::<ev::Fatal>().is_some())
        .map(|e| format!("{} {}", e.worker, e.event))
        .collect();
    check(errors.is_empty(), &format!("scaling and coordinator restarts must not cause failures: {errors:?}"), events);
    for p in &all {
        let failures = of::<ev::Summary>(events, p).last().map(|s| s.failures);
        check(failures == Some(0), &format!("{p} recorded failures: {failures:?}"), events);
    }
    for c in [
        invariants::no_wrong_results(events),
        invariants::generations_increase(events),
        invariants::commits_never_lost(events),
    ] {
        check(c.ok, &format!("{}: {}", c.what, c.detail), events);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statefulset_scaling_and_coordinator_upgrade_keep_the_job_verified() {
    tokio::time::timeout(BOUND, rehearsal(Pods::Rust)).await.expect("rehearsal bound");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_with_python_pods() {
    if std::env::var_os("COHORT_PYTHON").is_none() {
        assert!(
            std::env::var_os("COHORT_REQUIRE_PYTHON").is_none(),
            "COHORT_REQUIRE_PYTHON is set but COHORT_PYTHON (the interpreter with the cohort package) is not"
        );
        eprintln!("SKIPPED: the Python rehearsal needs COHORT_PYTHON (bash scripts/python-env.sh prints it)");
        return;
    }
    tokio::time::timeout(BOUND, rehearsal(Pods::Python)).await.expect("rehearsal bound");
}

/// The metrics judge on hand-made scrapes: consistent metrics pass, and each kind of
/// disagreement is caught.
#[test]
fn the_metrics_judge_catches_each_disagreement() {
    let samples = |text: &str| Ok(cohort_chaos::metrics::parse_text(text).expect("valid exposition"));
    let pod_metrics = |world: u32, generation: u32| {
        samples(&format!("cohort_worker_world_size {world}\ncohort_worker_generation {generation}\ncohort_worker_steps_verified_total 9\n"))
    };
    let replica = |leader: u32, members: u32, generation: u32| {
        samples(&format!("cohort_is_leader {leader}\ncohort_members{{job=\"{JOB}\"}} {members}\ncohort_generation{{job=\"{JOB}\"}} {generation}\n"))
    };
    let pods: Vec<String> = (0..2).map(pod).collect();
    let scrape = |replicas: Vec<Result<Samples, String>>, by_pod: [Result<Samples, String>; 2]| Scrape {
        replicas,
        pods: pods.iter().cloned().zip(by_pod).collect(),
    };
    let ok = scrape(vec![replica(0, 0, 0), replica(1, 2, 3)], [pod_metrics(2, 3), pod_metrics(2, 3)]);
    assert_eq!(judge(&ok, &pods, 2.0, None), Ok(()));
    assert_eq!(judge(&ok, &pods, 2.0, Some(1)), Ok(()));
    let cases = [
        (judge(&ok, &pods, 2.0, Some(0)), "status names"),
        (judge(&ok, &pods, 3.0, None), "cohort_worker_world_size"),
        (
            judge(
                &scrape(vec![replica(1, 2, 3), replica(1, 2, 3)], [pod_metrics(2, 3), pod_metrics(2, 3)]),
                &pods,
                2.0,
                None,
            ),
            "cohort_is_leader 1: [0, 1]",
        ),
        (
            judge(
                &scrape(vec![replica(0, 2, 3), replica(0, 2, 3)], [pod_metrics(2, 3), pod_metrics(2, 3)]),
                &pods,
                2.0,
                None,
            ),
            "cohort_is_leader 1: []",
        ),
        (
            judge(&scrape(vec![replica(1, 3, 3)], [pod_metrics(2, 3), pod_metrics(2, 3)]), &pods, 2.0, None),
            "members Some(3.0)",
        ),
        (
            judge(&scrape(vec![replica(1, 2, 4)], [pod_metrics(2, 3), pod_metrics(2, 3)]), &pods, 2.0, None),
            "generation Some(4.0)",
        ),
        (
            judge(&scrape(vec![replica(1, 2, 3)], [pod_metrics(2, 3), pod_metrics(2, 4)]), &pods, 2.0, None),
            "different generations",
        ),
        (
            judge(
                &scrape(vec![replica(1, 2, 3)], [pod_metrics(2, 3), Err("connection refused".into())]),
                &pods,
                2.0,
                None,
            ),
            "connection refused",
        ),
        (
            judge(&scrape(vec![Err("no answer".into())], [pod_metrics(2, 3), pod_metrics(2, 3)]), &pods, 2.0, None),
            "replica 0: no answer",
        ),
    ];
    for (verdict, why) in cases {
        let err = verdict.expect_err(why);
        assert!(err.contains(why), "expected {why:?} in {err:?}");
    }
}
