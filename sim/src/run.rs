//! One seed, start to end: builds the simulated cluster, drives the fault schedule, and
//! checks the invariants at the end.

use crate::clock;
use crate::ledger::{hash, Shared, Touch};
use crate::net::{self, GRPC_PORT};
use crate::relay::HostSockets;
use crate::scenario::{Fault, FaultMix, Scenario, Scheduled};
use crate::store::{self, RemoteStore, StoreLink};
use crate::worker::{self, WorkerSetup};
use cohort_coordinator::config::{JobSettings, LeaseScope, Settings};
use cohort_coordinator::server::CascadeScope;
use cohort_coordinator::ServeConfig;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

/// How a run is set up beyond its seed.
#[derive(Clone, Copy, Debug, Default)]
pub struct Options {
    /// Where the replicas gather timeout cascades ([`CascadeScope::Replica`] re-introduces
    /// a fixed bug, to show that the simulation catches it).
    pub cascade_scope: CascadeScope,
    /// Which faults the seed draws from.
    pub mix: FaultMix,
    /// Run this many workers instead of the seed's own draw (3 to 5): the scale runs
    /// (`--workers 512`). The seed still decides everything else, and its faults pick
    /// workers among these.
    pub workers: Option<usize>,
    /// The simulated clock's step in ms (default 1). Every host's runtime and every link
    /// is visited at each step, so the scale runs take a coarser step (5 ms) to finish in
    /// minutes; timers and latencies are then rounded up to it.
    pub tick_ms: Option<u64>,
    /// Workers per simulated host (default 1: every worker is a host of its own). With
    /// several, a host holds workers `h*k .. (h+1)*k` and is their failure domain, as a
    /// machine with several GPUs is: a fault drawn for one worker that crashes, pauses,
    /// isolates or partitions it takes its whole host. The scale runs need it: turmoil's
    /// cost per step grows with hosts times links, and a host's workers share its links.
    pub workers_per_host: Option<usize>,
    /// Whose store lease a member's records are on (the coordinators' `--lease-scope`):
    /// `Member`, the default, or `Host` (each simulated host's workers on one lease).
    pub lease_scope: LeaseScope,
    /// The job's `whole_answer_up_to` (default 256): generations larger than it are answered
    /// as sparse views, which the workers complete as the shipped worker does.
    pub whole_answer_up_to: Option<u32>,
    /// Plants the wrong-partner bug in the replicas' sparse answers
    /// (`cohort_coordinator::hub::planted`), to show that a seed catches it.
    pub wrong_partner: bool,
    /// Plant the bug fixed in the replicas' progress writes (a replica writes a member's old
    /// beat time back; `cohort_coordinator::hub::planted`), to show that a seed catches it.
    pub stale_beat_writes: bool,
    /// Plant a bug in the heartbeat relay (a worker whose relay hangs never beats itself;
    /// `cohort::control::relay_planted`), to show that a seed catches it.
    pub relay_never_bypassed: bool,
    /// Plant a bug in the decision which links are carried into the next generation (the old
    /// link at the same rank number, as if ranks never moved; `cohort::elastic::carry_planted`),
    /// to show that a seed catches it.
    pub carry_same_ranks: bool,
}

/// Where the workers run: `per_host` workers to a host.
#[derive(Clone, Copy, Debug)]
struct Hosts {
    per_host: usize,
    workers: usize,
}

impl Hosts {
    /// The host that runs worker `w`.
    fn name_of(&self, w: usize) -> String {
        if self.per_host == 1 {
            format!("worker-{w}")
        } else {
            format!("host-{}", w / self.per_host)
        }
    }

    /// Every worker on `w`'s host, `w` included.
    fn mates(&self, w: usize) -> std::ops::Range<usize> {
        let first = w / self.per_host * self.per_host;
        first..(first + self.per_host).min(self.workers)
    }

    /// For a fault that takes a whole host of several workers, which workers it takes (for
    /// the trace); `None` when hosts hold one worker or the fault is not a host's.
    fn scope(&self, fault: &Fault) -> Option<String> {
        let w = match fault {
            Fault::PartitionWorkerReplica(w, _)
            | Fault::IsolateWorker(w)
            | Fault::WorkerCrash(w)
            | Fault::WorkerPause(w) => *w,
            _ => return None,
        };
        let mates = self.mates(w);
        (self.per_host > 1)
            .then(|| format!(" (all of {}: worker-{}..worker-{})", self.name_of(w), mates.start, mates.end - 1))
    }

    /// Whether `w` is the first worker of its host.
    fn leads(&self, w: usize) -> bool {
        w % self.per_host == 0
    }
}

/// What one seed did.
#[derive(Clone, Debug)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// The trace: one line per event (simulated seconds, party, event).
    pub lines: Vec<String>,
    /// FNV-1a hash of the trace: equal hashes, equal runs.
    pub hash: u64,
    /// Faults injected.
    pub faults: usize,
    /// Invariants that did not hold (empty: the seed passed).
    pub violations: Vec<String>,
}

/// The job's settings in every simulation.
fn job_settings(scenario: &Scenario, options: &Options) -> JobSettings {
    JobSettings {
        lease_scope: options.lease_scope,
        whole_answer_up_to: options.whole_answer_up_to.unwrap_or(JobSettings::default().whole_answer_up_to),
        min_workers: scenario.min_workers,
        max_workers: scenario.workers as u32,
        join_window: Duration::from_secs(1),
        heartbeat_interval: Duration::from_millis(500),
        lease_ttl: Duration::from_secs(3),
        elastic_timeout: Duration::from_secs(8),
        ..Default::default()
    }
}

/// How long after falling below `min_workers` every survivor must have heard that the job
/// failed: the elastic timeout, a lease TTL to notice the death, and a margin for the
/// leader's timers and the news to travel.
const BELOW_MIN_BOUND_MS: u64 = 8_000 + 3_000 + 10_000;
/// How soon after its exclusion ends a worker's join is answered (it asks again 50 ms after
/// the end; a refusal tells it the job is over).
const EXCLUDED_JOIN_MS: u64 = 1_000;
/// Time the workers have to leave after being asked to finish.
const FINISH_BOUND_MS: u64 = 25_000;

async fn replica(
    index: usize,
    link: StoreLink,
    settings: Settings,
    scope: CascadeScope,
    shared: Shared,
) -> turmoil::Result {
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", GRPC_PORT)).await?;
    let mut config = ServeConfig::new(Arc::new(RemoteStore::new(link, index)), settings);
    config.replica_name = Some(format!("replica-{index}"));
    config.leader_ttl = Duration::from_secs(2);
    config.cascade_scope = scope;
    let address = SocketAddr::from(([0, 0, 0, 0], GRPC_PORT));
    let _handle = cohort_coordinator::server::start_with_incoming(config, net::incoming(listener), address).await?;
    shared.log(&format!("replica-{index}"), "serving");
    std::future::pending::<()>().await;
    Ok(())
}

enum Action {
    Start(Scheduled),
    Stop(Scheduled),
    Shrink,
    Finish,
    Check,
}

/// Runs `seed` and checks every invariant.
pub fn run_seed(seed: u64, options: &Options) -> Report {
    clock::install();
    clock::set_jump_ms(0);
    cohort_coordinator::hub::planted::set_wrong_partner(options.wrong_partner);
    cohort_coordinator::hub::planted::set_stale_beat_writes(options.stale_beat_writes);
    cohort::control::relay_planted::set_never_bypassed(options.relay_never_bypassed);
    cohort::elastic::carry_planted::set_same_ranks(options.carry_same_ranks);
    let scenario = Scenario::draw(seed, options.mix, options.workers);
    let shared = Shared::default();
    let mut rng = StdRng::seed_from_u64(seed ^ 0xd1ce);
    let no_progress = Duration::from_millis(if rng.random_bool(0.5) { 1_500 } else { 4_000 });
    let mut sim = turmoil::Builder::new()
        .epoch(UNIX_EPOCH + Duration::from_secs(1_800_000_000))
        .simulation_duration(Duration::from_secs(3_600))
        .tick_duration(Duration::from_millis(options.tick_ms.unwrap_or(1).max(1)))
        .min_message_latency(Duration::ZERO)
        .max_message_latency(Duration::from_millis(scenario.max_latency_ms))
        // A host's TCP buffers (turmoil's default of 64 also bounds a listener's backlog,
        // and it panics when that is full): every worker connects to every replica at once.
        .tcp_capacity(64.max(scenario.workers * 2))
        .rng_seed(seed)
        .build();
    shared.log_at(
        0,
        "SIM",
        format!(
            "seed {seed}: {} replicas, {} workers (min {}), latency <= {} ms, store latency <= {} ms, no-progress deadline {} ms, cascades judged per {:?}",
            scenario.replicas,
            scenario.workers,
            scenario.min_workers,
            scenario.max_latency_ms,
            scenario.store_latency_ms,
            no_progress.as_millis(),
            options.cascade_scope
        ),
    );
    let settings = match Settings::uniform(job_settings(&scenario, options)) {
        Ok(s) => s,
        Err(e) => {
            return Report { seed, lines: vec![], hash: 0, faults: 0, violations: vec![format!("settings: {e}")] };
        }
    };
    let (store_host, link) = store::store(seed, scenario.store_latency_ms);
    sim.host("etcd", move || store_host.clone().serve());
    for r in 0..scenario.replicas {
        let (link, settings, shared) = (link.clone(), settings.clone(), shared.clone());
        let scope = options.cascade_scope;
        sim.host(format!("replica-{r}"), move || replica(r, link.clone(), settings.clone(), scope, shared.clone()));
    }
    let hosts = Hosts { per_host: options.workers_per_host.unwrap_or(1).max(1), workers: scenario.workers };
    for w in (0..scenario.workers).filter(|&w| hosts.leads(w)) {
        // The host's socket namespace, where its workers' relays bind.
        let sockets = HostSockets::default();
        let setups: Vec<Arc<WorkerSetup>> = hosts
            .mates(w)
            .map(|index| {
                let host = hosts.name_of(index);
                Arc::new(WorkerSetup {
                    index,
                    host,
                    replicas: scenario.replicas,
                    shared: shared.clone(),
                    no_progress,
                    seed,
                    step: worker::step_time(scenario.workers),
                    sockets: sockets.clone(),
                })
            })
            .collect();
        if hosts.per_host == 1 {
            let setup = setups[0].clone();
            sim.host(hosts.name_of(w), move || worker::run(setup.clone()));
        } else {
            sim.host(hosts.name_of(w), move || worker::run_host(setups.clone()));
        }
    }

    let mut actions: Vec<(u64, Action)> = Vec::new();
    for f in &scenario.faults {
        actions.push((f.at_ms, Action::Start(f.clone())));
        actions.push((f.at_ms + f.for_ms, Action::Stop(f.clone())));
    }
    let end_ms = match scenario.shrink_at_ms {
        Some(at) => {
            actions.push((at, Action::Shrink));
            at + BELOW_MIN_BOUND_MS + 2_000
        }
        None => {
            actions.push((scenario.finish_at_ms, Action::Check));
            actions.push((scenario.finish_at_ms, Action::Finish));
            scenario.finish_at_ms + FINISH_BOUND_MS
        }
    };
    actions.sort_by_key(|(t, _)| *t);
    let mut actions = actions.into_iter().peekable();
    loop {
        let now = sim.elapsed().as_millis() as u64;
        if now >= end_ms {
            break;
        }
        while let Some((_, action)) = actions.next_if(|(t, _)| *t <= now) {
            apply(&mut sim, &shared, &scenario, hosts, &link, action, now);
        }
        if let Err(e) = sim.step() {
            shared.violation(now, format!("a host failed: {e}"));
            break;
        }
    }
    final_checks(&mut sim, &shared, &scenario);
    cohort_coordinator::hub::planted::set_wrong_partner(false);
    cohort_coordinator::hub::planted::set_stale_beat_writes(false);
    cohort::control::relay_planted::set_never_bypassed(false);
    cohort::elastic::carry_planted::set_same_ranks(false);
    let lines = shared.lines();
    let ledger = shared.lock();
    Report { seed, hash: hash(&lines), lines, faults: ledger.faults, violations: ledger.violations.clone() }
}

fn replica_host(r: usize) -> String {
    format!("replica-{r}")
}

fn apply(
    sim: &mut turmoil::Sim<'_>,
    shared: &Shared,
    scenario: &Scenario,
    hosts: Hosts,
    link: &StoreLink,
    action: Action,
    now: u64,
) {
    let worker_host = |w: usize| hosts.name_of(w);
    match action {
        Action::Start(s) => {
            let scope = hosts.scope(&s.fault).unwrap_or_default();
            shared.log_at(now, "FAULT", format!("{} for {} ms{scope}", s.fault, s.for_ms));
            shared.lock().faults += 1;
            // A fault that takes a host touches every worker on it.
            let touch = |w: usize| {
                let mut ledger = shared.lock();
                for mate in hosts.mates(w) {
                    ledger.touches.push(Touch { worker: mate, from_ms: now, to_ms: now + s.for_ms });
                }
            };
            match s.fault {
                Fault::ReplicaCrash(r) => sim.crash(replica_host(r)),
                Fault::StoreOutage(r) => {
                    link.outages.lock().unwrap_or_else(|e| e.into_inner()).insert(r);
                }
                // Partitions hold the messages and deliver them when they end, as TCP's
                // retransmissions would once the network heals (turmoil's TCP drops what a
                // partition takes and never retransmits, which would leave every
                // connection that lost a segment stuck until HTTP/2 keep-alive noticed).
                Fault::PartitionWorkerReplica(w, r) => {
                    // Not an excuse for an eviction: the worker still reaches the others.
                    sim.hold(worker_host(w), replica_host(r));
                }
                Fault::IsolateWorker(w) => {
                    touch(w);
                    for r in 0..scenario.replicas {
                        sim.hold(worker_host(w), replica_host(r));
                    }
                }
                Fault::SilentLink(a, b) => {
                    // The data link of one worker: its host-mates are not touched.
                    shared.lock().touches.push(Touch { worker: a, from_ms: now, to_ms: now + s.for_ms });
                    shared.lock().silent.insert((a, b));
                }
                Fault::WorkerCrash(w) => {
                    touch(w);
                    crash_host(sim, shared, hosts, w);
                }
                Fault::WorkerPause(w) => {
                    touch(w);
                    shared.lock().paused.extend(hosts.mates(w));
                    for r in 0..scenario.replicas {
                        sim.hold(worker_host(w), replica_host(r));
                    }
                }
                Fault::WorkerHang(w) => {
                    // The worker alone: its host-mates run on, and the network is untouched.
                    shared.lock().touches.push(Touch { worker: w, from_ms: now, to_ms: now + s.for_ms });
                    shared.lock().paused.insert(w);
                }
                Fault::ClockJump(ms) => clock::set_jump_ms(ms),
                Fault::LatencySpike(ms) => sim.set_max_message_latency(Duration::from_millis(ms)),
            }
        }
        Action::Stop(s) => {
            shared.log_at(now, "FAULT", format!("ends: {}", s.fault));
            match s.fault {
                Fault::ReplicaCrash(r) => sim.bounce(replica_host(r)),
                Fault::StoreOutage(r) => {
                    link.outages.lock().unwrap_or_else(|e| e.into_inner()).remove(&r);
                }
                Fault::PartitionWorkerReplica(w, r) => sim.release(worker_host(w), replica_host(r)),
                Fault::IsolateWorker(w) => {
                    for r in 0..scenario.replicas {
                        sim.release(worker_host(w), replica_host(r));
                    }
                }
                Fault::SilentLink(a, b) => {
                    shared.lock().silent.remove(&(a, b));
                }
                Fault::WorkerCrash(w) => {
                    // Restarted unless every worker on the host had left the job.
                    let ledger = shared.lock();
                    let finished = hosts.mates(w).all(|m| ledger.workers.get(&m).is_some_and(|v| v.finished));
                    drop(ledger);
                    if !finished {
                        sim.bounce(worker_host(w));
                    }
                }
                Fault::WorkerPause(w) => {
                    let mut ledger = shared.lock();
                    for mate in hosts.mates(w) {
                        ledger.paused.remove(&mate);
                    }
                    drop(ledger);
                    for r in 0..scenario.replicas {
                        sim.release(worker_host(w), replica_host(r));
                    }
                }
                Fault::WorkerHang(w) => {
                    shared.lock().paused.remove(&w);
                }
                Fault::ClockJump(_) => clock::set_jump_ms(0),
                Fault::LatencySpike(_) => sim.set_max_message_latency(Duration::from_millis(scenario.max_latency_ms)),
            }
        }
        Action::Shrink => {
            let up: Vec<usize> = shared.lock().workers.iter().filter(|(_, v)| v.up).map(|(w, _)| *w).collect();
            let keep = (scenario.min_workers as usize).saturating_sub(1);
            shared.log_at(now, "FAULT", format!("shrink: crash workers for good until {keep} remain (below min)"));
            for &w in up.iter().skip(keep) {
                // A host crashed earlier in this loop took its other workers with it.
                if shared.lock().workers.get(&w).is_some_and(|v| v.up) {
                    shared.lock().faults += 1;
                    crash_host(sim, shared, hosts, w);
                }
            }
        }
        Action::Check => convergence(shared, now),
        Action::Finish => {
            shared.log_at(now, "SIM", "workers are asked to finish");
            shared.lock().finish = true;
        }
    }
}

/// Crashes the host of worker `w`, and with it every worker on it.
fn crash_host(sim: &mut turmoil::Sim<'_>, shared: &Shared, hosts: Hosts, w: usize) {
    sim.crash(hosts.name_of(w));
    let mut ledger = shared.lock();
    for mate in hosts.mates(w) {
        let view = ledger.workers.entry(mate).or_default();
        view.up = false;
        view.incarnation = 0;
        view.in_generation = None;
    }
}

/// After the quiet time: every live worker works in the newest generation, which is not
/// revoked (every member of a revoked generation heard it; every live worker is in a
/// generation).
fn convergence(shared: &Shared, now: u64) {
    let mut problems = Vec::new();
    {
        let ledger = shared.lock();
        let newest = ledger.generations.keys().next_back().copied();
        for (w, view) in &ledger.workers {
            if !view.up || view.finished || view.ended.is_some() || view.excluded_until > now {
                continue;
            }
            match view.in_generation {
                Some(g) if ledger.revoked.contains_key(&g) => problems.push(format!(
                    "worker-{w} is still in generation {g}, revoked at {} ms (every member hears a revocation)",
                    ledger.revoked[&g]
                )),
                Some(g) if Some(g) != newest => {
                    problems.push(format!("worker-{w} is in generation {g}, not the newest ({newest:?})"))
                }
                Some(_) => {}
                None => problems.push(format!(
                    "worker-{w} (incarnation {}) is in no generation after the quiet time (every live worker is in a generation)",
                    view.incarnation
                )),
            }
        }
    }
    shared.log_at(now, "CHECK", format!("convergence: {} problems", problems.len()));
    for p in problems {
        shared.violation(now, p);
    }
}

fn final_checks(sim: &mut turmoil::Sim<'_>, shared: &Shared, scenario: &Scenario) {
    let now = sim.elapsed().as_millis() as u64;
    let mut problems = Vec::new();
    {
        let ledger = shared.lock();
        for (w, view) in &ledger.workers {
            if !view.up {
                continue;
            }
            match scenario.shrink_at_ms {
                Some(at) => match &view.ended {
                    // Excluded past the bound, it was no member to be told: it learns it when
                    // its next join is refused.
                    Some((t, outcome))
                        if outcome == "FAILED"
                            && *t <= (at + BELOW_MIN_BOUND_MS).max(view.excluded_until + EXCLUDED_JOIN_MS) => {}
                    Some((t, outcome)) => problems.push(format!(
                        "worker-{w} heard the job end {outcome} at {t} ms; below min from {at} ms it must fail within {BELOW_MIN_BOUND_MS} ms (or at its join after an exclusion)"
                    )),
                    None => problems.push(format!(
                        "worker-{w} never heard that the job failed after it fell below min at {at} ms"
                    )),
                },
                None => {
                    if !view.finished && view.ended.is_none() {
                        problems.push(format!(
                            "worker-{w} had not left {FINISH_BOUND_MS} ms after being asked to finish (in generation {:?}; nothing waits forever)",
                            view.in_generation
                        ));
                    }
                }
            }
        }
    }
    shared.log_at(now, "CHECK", format!("end: {} problems", problems.len()));
    for p in problems {
        shared.violation(now, p);
    }
}
