//! `cohort-chaos demo`: the whole story of an elastic job on one machine.
//!
//! Starts the coordinator (embedded store) and four `cohort-worker train` processes,
//! SIGKILLs one in the middle of an allreduce, lets the survivors re-form, starts a new
//! worker that joins at a commit point, and checks that every step was verified, that every
//! survivor's error named the root cause, and that no committed step was lost.

use crate::cluster::{Cluster, ClusterConfig, ClusterError, JobSettings, StoreKind, WorkerSpec};
use crate::events::{self as ev, Event, WorkerEvent};
use crate::process::now_ms;
use std::time::Duration;

/// Settings of the demo (the defaults run in about half a minute).
#[derive(Clone, Debug)]
pub struct DemoConfig {
    /// Initial workers.
    pub workers: u32,
    /// Total steps of the job.
    pub steps: u64,
    /// Gradient size per step.
    pub size: String,
    /// Pause between steps.
    pub step_interval: Duration,
    /// Keep logs here (default: a temp dir, removed at the end).
    pub log_dir: Option<std::path::PathBuf>,
}

impl Default for DemoConfig {
    fn default() -> Self {
        Self { workers: 4, steps: 120, size: "16M".into(), step_interval: Duration::from_millis(40), log_dir: None }
    }
}

/// One check of the verdict.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Check {
    /// What was checked.
    pub what: String,
    /// Whether it held.
    pub ok: bool,
    /// What was seen.
    pub detail: String,
}

struct Timeline {
    start_ms: u64,
}

impl Timeline {
    fn say(&self, at_ms: u64, text: impl AsRef<str>) {
        let rel = at_ms as i64 - self.start_ms as i64;
        println!("[{:>7.3}s] {}", rel as f64 / 1e3, text.as_ref());
    }
}

/// Runs the demo; returns the checks (all must hold).
///
/// # Cancel safety
/// Cancel safe: dropping it drops the cluster, which kills every process it started.
pub async fn run(config: DemoConfig) -> Result<Vec<Check>, ClusterError> {
    let settings = JobSettings {
        min_workers: 2,
        max_workers: 8,
        join_window: Duration::from_millis(500),
        heartbeat_interval: Duration::from_millis(200),
        lease_ttl: Duration::from_secs(2),
        elastic_timeout: Duration::from_secs(20),
        ..Default::default()
    };
    let mut cluster = Cluster::start(ClusterConfig {
        job: "demo".into(),
        store: StoreKind::Memory,
        coordinators: 1,
        settings,
        log_dir: config.log_dir.clone(),
        exclusion: None,
        metrics: false,
    })
    .await?;
    let tl = Timeline { start_ms: now_ms() };
    tl.say(
        now_ms(),
        format!("coordinator up at {} (embedded store); logs in {}", cluster.endpoints(), cluster.log_dir().display()),
    );
    let spec = WorkerSpec {
        steps: config.steps,
        size: config.size.clone(),
        step_interval: config.step_interval,
        no_progress: Duration::from_secs(5),
        fixed_deadlines: false,
        extra_args: Vec::new(),
        command: None,
    };
    for i in 0..config.workers {
        cluster.spawn_worker(&format!("w{i}"), &spec)?;
    }
    tl.say(
        now_ms(),
        format!("started {} workers: train --steps {} --size {}", config.workers, config.steps, config.size),
    );

    // Generation 1 with every worker.
    let formed = cluster
        .wait_for("generation 1", Duration::from_secs(60), |e| {
            e.get::<ev::Generation>().is_some_and(|g| g.world == u64::from(config.workers))
        })
        .await?;
    let g1 = formed.get::<ev::Generation>().map_or(1, |g| g.gen);
    tl.say(formed.t_ms(), format!("generation {g1} formed: world {}", config.workers));

    // Let it train a while, then kill a rank in the middle of an allreduce.
    let victim = format!("w{}", config.workers / 2);
    let warm = cluster
        .wait_for("10 steps", Duration::from_secs(60), |e| e.get::<ev::Step>().is_some_and(|s| s.step >= 10))
        .await?;
    tl.say(warm.t_ms(), "10 steps verified");
    let started = cluster
        .wait_for("an allreduce of the victim", Duration::from_secs(30), |e| {
            e.get::<ev::Allreduce>().is_some() && e.worker == victim
        })
        .await?;
    let kill_ms = cluster.signal_worker(&victim, libc::SIGKILL).unwrap_or_else(now_ms);
    let victim_step = started.get::<ev::Allreduce>().map_or(0, |a| a.step);
    tl.say(kill_ms, format!("SIGKILL {victim} during its allreduce of step {victim_step}"));

    // Survivors' errors and the next generation.
    let survivors: Vec<String> = (0..config.workers).map(|i| format!("w{i}")).filter(|w| *w != victim).collect();
    let mut errors: Vec<(String, ev::Error)> = Vec::new();
    let mut recovered_ms = None;
    let mut g2 = None;
    let deadline = Duration::from_secs(30);
    let until = tokio::time::Instant::now() + deadline;
    while recovered_ms.is_none() {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        let Some(e) = cluster.next_event(left).await else {
            return Err(ClusterError::Timeout {
                what: "the next generation's first verified step".into(),
                after: deadline,
            });
        };
        match &e.event {
            Event::Error(error) if survivors.contains(&e.worker) && !errors.iter().any(|(x, _)| *x == e.worker) => {
                tl.say(
                    e.t_ms(),
                    format!(
                        "{} error after {} ms: {} — root cause: {}",
                        e.worker,
                        e.t_ms() as i64 - kill_ms as i64,
                        error.kind,
                        error.cause
                    ),
                );
                errors.push((e.worker.clone(), error.clone()));
            }
            Event::Generation(g) if g2.is_none() && g.gen > g1 => {
                tl.say(
                    e.t_ms(),
                    format!(
                        "generation {} formed: world {} (+{} ms after the kill)",
                        g.gen,
                        g.world,
                        e.t_ms() as i64 - kill_ms as i64
                    ),
                );
                g2 = Some(g.clone());
            }
            Event::Recovered(r) => {
                tl.say(
                    e.t_ms(),
                    format!(
                        "first verified step of the new generation: step {} (+{} ms after the kill)",
                        r.step,
                        e.t_ms() as i64 - kill_ms as i64
                    ),
                );
                recovered_ms = Some(e.t_ms());
            }
            _ => {}
        }
    }
    let g2_number = g2.as_ref().map_or(0, |g| g.gen);

    // Scale up: a new worker joins at a commit point.
    let progress = cluster
        .wait_for("10 more steps", Duration::from_secs(60), |e| {
            e.get::<ev::Step>().is_some_and(|s| s.gen == g2_number && s.step >= victim_step + 10)
        })
        .await?;
    let joiner = format!("w{}", config.workers);
    cluster.spawn_worker(&joiner, &spec)?;
    tl.say(progress.t_ms(), format!("started {joiner}: it waits; the members re-form at their next commit point"));
    let joined = cluster
        .wait_for("the joiner's generation", Duration::from_secs(60), |e| {
            e.get::<ev::Generation>().is_some() && e.worker == joiner
        })
        .await?;
    let (joined_gen, joined_world) = joined.get::<ev::Generation>().map_or((0, 0), |g| (g.gen, g.world));
    tl.say(joined.t_ms(), format!("{joiner} is in: generation {joined_gen} with world {joined_world}"));
    let restored = cluster
        .wait_for("the joiner's state sync", Duration::from_secs(30), |e| {
            e.get::<ev::Restored>().is_some() && e.worker == joiner
        })
        .await?;
    let (restored_step, source) = restored.get::<ev::Restored>().map_or((-1, 0), |r| (r.step, r.source));
    tl.say(
        restored.t_ms(),
        format!("{joiner} received the committed state of step {restored_step} from rank {source}"),
    );

    tl.say(now_ms(), "training to the end ...");
    let codes = cluster.wait_workers(Duration::from_secs(180)).await;
    let events = &cluster.events;
    for (e, s) in events.iter().filter_map(|e| Some((e, e.get::<ev::Summary>()?))) {
        tl.say(
            e.t_ms(),
            format!(
                "{} done: {} verified steps, failures {}, re-formations {}, time lost {} ms",
                e.worker, s.verified_steps, s.failures, s.cooperative_reforms, s.lost_ms
            ),
        );
    }

    let mut checks = Vec::new();
    let wrong: Vec<_> = events.iter().filter_map(WorkerEvent::get::<ev::WrongResult>).collect();
    checks.push(Check {
        what: "no wrong result was ever accepted".into(),
        ok: wrong.is_empty(),
        detail: format!("{} wrong results", wrong.len()),
    });
    let named = errors.iter().filter(|(_, e)| e.cause.contains(&victim)).count();
    checks.push(Check {
        what: format!("every survivor got an error naming the root cause ({victim})"),
        ok: named == survivors.len(),
        detail: format!("{named} of {} survivors", survivors.len()),
    });
    let worst = errors.iter().map(|(_, e)| e.t_ms as i64 - kill_ms as i64).max().unwrap_or(-1);
    checks.push(Check {
        what: "survivors' errors within 1 s of the kill (target 100 ms)".into(),
        ok: (0..1000).contains(&worst),
        detail: format!("slowest {worst} ms"),
    });
    let to_step = recovered_ms.map(|r| r as i64 - kill_ms as i64).unwrap_or(-1);
    checks.push(Check {
        what: "next generation verified a step within 2 s of the kill (target p50 1 s)".into(),
        ok: (0..2000).contains(&to_step),
        detail: format!("{to_step} ms"),
    });
    checks.push(Check {
        what: format!("generation {g2_number} formed with the {} survivors", survivors.len()),
        ok: g2.as_ref().map(|g| g.world) == Some(survivors.len() as u64),
        detail: format!("world {:?}", g2.as_ref().map(|g| g.world)),
    });
    checks.push(Check {
        what: format!("{joiner} joined a later generation with {} members", config.workers),
        ok: joined_gen > g2_number && joined_world == u64::from(config.workers),
        detail: format!("generation {joined_gen} world {joined_world}"),
    });
    let mut finished_ok = true;
    let mut detail = String::new();
    for (name, code) in &codes {
        let expect_ok = *name != victim;
        let final_step = events
            .iter()
            .rev()
            .filter(|e| e.worker == *name)
            .find_map(|e| e.get::<ev::Summary>())
            .map(|s| s.final_step);
        if expect_ok && (*code != Some(0) || final_step != Some(config.steps)) {
            finished_ok = false;
        }
        detail.push_str(&format!("{name}: exit {code:?} final step {final_step:?}; "));
    }
    checks.push(Check {
        what: format!("every live worker finished all {} steps and exited 0", config.steps),
        ok: finished_ok,
        detail,
    });
    checks.push(crate::invariants::generations_increase(events));
    checks.push(crate::invariants::commits_never_lost(events));
    let expected = crate::scenario::parse_bytes(&config.size)
        .map(|bytes| crate::invariants::expected_params_digest(bytes, config.steps))
        .map_err(|e| ClusterError::Setup(format!("the demo's size: {e}")))?;
    checks.push(crate::invariants::final_params(
        events,
        crate::invariants::ExpectedParams::Computed(&expected),
        crate::scenario::Expect::Finish,
    ));
    Ok(checks)
}

/// Prints the verdict; true if every check held.
pub fn print_verdict(checks: &[Check]) -> bool {
    println!();
    println!("verdict:");
    for c in checks {
        println!("  [{}] {} ({})", if c.ok { " ok " } else { "FAIL" }, c.what, c.detail);
    }
    let ok = checks.iter().all(|c| c.ok);
    println!("{}", if ok { "PASS: the job survived the failure and every step was verified" } else { "FAIL" });
    ok
}
