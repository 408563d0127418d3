//! Scale harness of the control plane: N members of the shipped worker
//! (`cohort::elastic::ElasticGroup`) against real `cohort-coordinator` replica processes, on the
//! memory store or on a real etcd (a private `etcd` on free loopback ports, with two replicas
//! sharing it).
//!
//! Every member is the worker users run: `ElasticGroup::join_with` with a data plane that
//! publishes a TCP and a shared-memory address (as `--transport auto` does) and connects
//! nothing (`farm::NullPlane`), and an observer (`farm::Seen`, the group's `World`) that
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
//! **Farms.** The members live in *farm* processes (this executable again, `--farm`), each
//! holding whole hosts, driven by this process, the *conductor*, over their stdin and stdout
//! (`wire`: a line per command and per answer, times on the machine's monotonic clock). One
//! process may hold 20,000 descriptors on these machines, and a member holds one per
//! coordinator connection plus, with relays, both ends of its two relay connections: so
//! 4,096 members at 8 ranks a host did not fit one process. The conductor starts as many
//! farms as keep each under 15,000 (`--farms N` overrides; the smoke run has one), checks the
//! generations every farm's members hold as one (`wire::Views`), and times each phase from
//! the farms' timestamps. The members of every size run through this one path.
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
//! **The harness shares the machine.** The members run in the farms on the cores the
//! coordinators and etcd use: every member's heartbeats, watch and relay hops are real work
//! here (a host's relays are tasks of a farm, not of a host of their own; each event relay
//! writes a keepalive to each of its subscribers ten times a second), so the figures are an
//! upper bound on what the coordinators cost a job of that size.
//!
//! Run it with `cargo bench -p cohort-coordinator --bench scale -- --members 1024`
//! (`--stores memory,etcd`, `--replicas 2`, `--steady-secs 5`, `--ranks-per-host 8`,
//! `--whole-answer-up-to N` (the coordinators' flag; the smoke run uses 16),
//! `--heartbeat-ms N` (the coordinators' heartbeat interval; the lease is six intervals, as
//! by default), `--etcd-max-txn-ops 1024`: etcd and the coordinators run with that limit on a
//! transaction's operations; `--lease-scope host`: the coordinators put each host's members on
//! one store lease; `--members-per-connection N`; `--join-concurrency N`: joins in flight at once over all farms, 256 by default; `--farms N`;
//! release build). Without `--bench` on its command line (`cargo test --benches`, which the test
//! command runs) it is a 96-member smoke version on the memory store in two farms, with a 2 s
//! steady phase.
//! Targets are reported in docs/benchmarks.md ("Scale"), never asserted here; every wait has a
//! deadline (`--bound-secs`, default 300), so a stuck coordinator fails the run instead of
//! hanging it. `COHORT_SCALE_LOG=PREFIX` keeps each replica's log (at `info`) in `PREFIX.0`,
//! `PREFIX.1`, ...; `COHORT_SCALE_COORDINATOR=PATH` runs another build of
//! `cohort-coordinator` (an older commit's, for a before-and-after in one sitting).

mod farm;
mod plan;
mod stores;
mod wire;

use cohort::control::{ControlClient, ControlConfig};
use cohort_proto::progress::{Progress, Total};
use cohort_proto::v1 as pb;
use cohort_testkit::etcd::EtcdProcess;
use farm::{FarmSpec, JOB};
use plan::{Plan, JOIN_CONCURRENCY};
use std::collections::HashMap;
use std::sync::PoisonError;
use std::time::{Duration, Instant};
use stores::{cpu_of, etcd_counters, etcd_phase, etcd_requests, Coordinator, ETCD_METHODS, START_BOUND};
use wire::{between, mono_ns, Farm, Fields, Views};

/// The members share this machine's cores with the coordinators they measure:
/// the same allocator as the coordinator's binary keeps their share small.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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

/// Sends `command` to every farm, then waits for each one's `verb` answer, parsed by `each`.
async fn every_farm<T>(
    farms: &mut [Farm],
    command: &str,
    verb: &str,
    mut each: impl FnMut(&Farm, &Fields<'_>) -> Result<T, String>,
) -> Result<Vec<T>, String> {
    for f in farms.iter_mut() {
        f.send(command)?;
    }
    let mut out = Vec::with_capacity(farms.len());
    for f in farms.iter_mut() {
        let line = f.expect(verb).await?;
        out.push(each(f, &Fields::parse(&line))?);
    }
    Ok(out)
}

/// Every farm's `status` (for an error's detail), within a few seconds.
async fn farm_status(farms: &mut [Farm]) -> String {
    let asked = every_farm(farms, "status", "status", |f, s| {
        Ok(format!(
            "farm {}: heard_formed={} beats={} heard_revoked={} woke={} reformed={} not_done={}",
            f.number,
            s.get("heard_formed")?,
            s.get("beats")?,
            s.get("heard_revoked")?,
            s.get("woke")?,
            s.get("reformed")?,
            s.get("not_done")?
        ))
    });
    match tokio::time::timeout(Duration::from_secs(5), asked).await {
        Ok(Ok(lines)) => lines.join("; "),
        Ok(Err(e)) => e,
        Err(_) => "no status within 5 s".into(),
    }
}

/// Runs a phase of at most `bound`; when it fails, the farms' status is added to the error.
async fn phase<T>(
    farms: &mut Vec<Farm>,
    bound: Duration,
    what: &str,
    f: impl AsyncFnOnce(&mut Vec<Farm>) -> Result<T, String>,
) -> Result<T, String> {
    let result = match within(bound, what, f(farms)).await {
        Ok(r) => r,
        Err(e) => Err(e),
    };
    match result {
        Ok(v) => Ok(v),
        Err(e) => Err(format!("{e} ({})", farm_status(farms).await)),
    }
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
    let endpoints: Vec<String> = coordinators.iter().map(|c| format!("http://{}", c.addr)).collect();
    let bound = plan.bound;

    // The farms, each holding whole hosts; every one has its clients made before any joins.
    let farm_count = plan.farms();
    let own_args: Vec<String> = std::env::args().skip(1).collect();
    let mut farms = (0..farm_count)
        .map(|f| {
            let members = plan.farm_members(f, farm_count);
            let spec = FarmSpec {
                first: members.start,
                count: members.len(),
                farms: farm_count,
                endpoints: endpoints.clone(),
            };
            Farm::spawn(f, members, &[own_args.clone(), spec.args()].concat())
        })
        .collect::<Result<Vec<Farm>, String>>()?;
    let mut connections = 0usize;
    for f in farms.iter_mut() {
        let ready = within(START_BOUND, "starting the farms", f.expect("ready")).await??;
        connections += Fields::parse(&ready).num::<usize>("connections")?;
    }

    // 1. Formation: every member joins and waits for its first generation.
    let cpu0 = cpu_all(&coordinators);
    let started = mono_ns();
    let mut views = Views::new(1, n);
    let mut joins: Vec<Duration> = Vec::with_capacity(n);
    let formed_at = phase(&mut farms, bound, "joining and forming generation 1", async |farms| {
        let ats = every_farm(farms, "form", "formed", |_, f| {
            views.add(f)?;
            joins.extend(f.nums::<u64>("joins")?.into_iter().map(Duration::from_micros));
            f.num::<u64>("at")
        })
        .await?;
        Ok(ats.into_iter().max().unwrap_or(started))
    })
    .await?;
    let join_to_formed = between(started, formed_at);
    let cpu_formation = cpu_all(&coordinators) - cpu0;
    phase_end("formation", &mut mark)?;
    joins.sort();
    let fetched_per_member =
        views.complete().map_err(|e| format!("generation 1 is not the same {n} members everywhere: {e}"))?;
    // Which farm holds each rank of generation 1.
    let ranges: Vec<std::ops::Range<usize>> = farms.iter().map(|f| f.members.clone()).collect();
    let farm_of = |views: &Views, rank: u32| -> Result<usize, String> {
        let index = views.index_at(rank).ok_or(format!("no member at rank {rank}"))?;
        ranges.iter().position(|r| r.contains(&index)).ok_or(format!("no farm holds member {index}"))
    };

    // 2. Every member hears generation 1 on its events (its own stream, or its host's relay),
    // and has had a heartbeat answered.
    let cpu0 = cpu_all(&coordinators);
    let watched_at = phase(&mut farms, bound, "every member hearing generation 1 on its events", async |farms| {
        let ats = every_farm(farms, "watch", "watched", |_, f| f.num::<u64>("at")).await?;
        Ok(ats.into_iter().max().unwrap_or(formed_at))
    })
    .await?;
    let watching = between(formed_at, watched_at);
    let cpu_watching = cpu_all(&coordinators) - cpu0;
    phase_end("watches", &mut mark)?;

    // 3 and 4. One failure (the last rank), a second during the re-formation (rank 1), reported
    // by rank 0.
    let (failed, dies_meanwhile, reporting) = (n as u32 - 1, 1u32, 0u32);
    let left_out = [views.index_at(failed), views.index_at(dies_meanwhile)].map(|i| i.map(|i| format!("m{i:05}")));
    let (failed_farm, reporting_farm) = (farm_of(&views, failed)?, farm_of(&views, reporting)?);
    // Its process is gone: its heartbeats, watch and relays stop.
    within(bound, "the failed member's end", farms[failed_farm].ask(&format!("drop rank={failed}"), "dropped"))
        .await??;
    let cpu0 = cpu_all(&coordinators);
    let arm = format!("arm dies={dies_meanwhile} reporter={reporting} size={}", n - 2);
    within(bound, "arming the re-formation", every_farm(&mut farms, &arm, "armed", |_, _| Ok(()))).await??;
    let report =
        within(bound, "the failure report", farms[reporting_farm].ask(&format!("report failed={failed}"), "reported"))
            .await??;
    let report = Fields::parse(&report);
    let (sent, answered) = (report.num::<u64>("sent")?, report.num::<u64>("answered")?);
    let report_answered = between(sent, answered);
    if report.get("cause_rank")? != failed.to_string() {
        return Err(format!("the failure report's root cause is {}, not rank {failed}", report.get("text")?));
    }
    let mut survivors = Views::new(2, n - 2);
    let mut revoked: Vec<Duration> = Vec::with_capacity(n);
    let reformed_at = phase(&mut farms, bound, "revocation and re-formation", async |farms| {
        let mut last = sent;
        for f in farms.iter_mut() {
            let line = f.expect("reformed").await?;
            let f = Fields::parse(&line);
            survivors.add(&f)?;
            revoked.extend(f.nums::<u64>("heard")?.into_iter().map(|at| between(sent, at)));
            last = last.max(f.num::<u64>("at")?);
        }
        Ok(last)
    })
    .await?;
    let reformed = between(sent, reformed_at);
    let cpu_failure = cpu_all(&coordinators) - cpu0;
    phase_end("failure", &mut mark)?;
    survivors.complete().map_err(|e| format!("generation 2 is not the same {} survivors everywhere: {e}", n - 2))?;
    // Every entry anyone holds of generation 2 leaves out the failed member and the one that
    // died meanwhile.
    if let Some(id) = survivors.ids().find(|id| left_out.iter().flatten().any(|gone| gone == id)) {
        return Err(format!("generation 2 holds {id}, which should be left out"));
    }
    revoked.sort();

    // 5. Steady state: timed heartbeats at the members' interval.
    let mut steady = String::new();
    if !plan.steady.is_zero() {
        let size = n as u32 - 2;
        let slow = size / 2;
        let slow_id = format!("m{:05}", survivors.index_at(slow).ok_or("no survivor at the slow rank")?);
        let first_step = mono_ns();
        within(
            bound,
            "starting the steady phase",
            every_farm(&mut farms, &format!("steady slow={slow} size={size}"), "steadying", |_, _| Ok(())),
        )
        .await??;
        let measured = phase(&mut farms, bound, "naming the slow member a straggler", async |farms| {
            // Every farm's members hear it; the first to has the time.
            let mut first: Option<(String, u64)> = None;
            for f in farms.iter_mut() {
                let line = f.expect("straggler").await?;
                let s = Fields::parse(&line);
                let (id, at) = (s.get("id")?.to_string(), s.num::<u64>("at")?);
                if first.as_ref().is_none_or(|(_, t)| at < *t) {
                    first = Some((id, at));
                }
            }
            first.ok_or_else(|| "no straggler named".to_string())
        })
        .await?;
        let (named, at) = measured;
        if named != slow_id {
            return Err(format!("the straggler named is {named}, not the slow member {slow_id}"));
        }
        let straggler_named = between(first_step, at);
        // Not a synchronisation: two intervals of warm-up, so every member's beats carry
        // timed steps before the window opens.
        tokio::time::sleep(plan.interval() * 2).await;
        let etcd_cpu = || etcd.as_ref().and_then(EtcdProcess::pid).map_or(Duration::ZERO, cpu_of);
        let beats = async |farms: &mut Vec<Farm>| -> Result<u64, String> {
            let each = every_farm(farms, "beats", "beats", |_, b| b.num::<u64>("answered"));
            Ok(within(bound, "counting beats", each).await??.into_iter().sum())
        };
        let (cpu0, beats0, t0) = (cpu_all(&coordinators), beats(&mut farms).await?, Instant::now());
        let (etcd_cpu0, etcd_req0) = (etcd_cpu(), requests()?);
        // The measured window itself: the coordinators' CPU and the beats answered over it.
        tokio::time::sleep(plan.steady).await;
        let (cpu1, beats1, dt) = (cpu_all(&coordinators), beats(&mut farms).await?, t0.elapsed());
        let (etcd_cpu1, etcd_req1) = (etcd_cpu(), requests()?);
        within(bound, "ending the steady phase", every_farm(&mut farms, "calm", "calm", |_, _| Ok(()))).await??;
        steady = format!(
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
            steady.push_str(&format!(
                " etcd_steady_cpu_pct={:.1} etcd_steady_per_s={}",
                100.0 * (etcd_cpu1 - etcd_cpu0).as_secs_f64() / dt.as_secs_f64(),
                rates.join(",")
            ));
        }
    }

    // Beats refused or not answered before the job's end (a member's beat handed to its
    // relay just before it left is refused after it: not counted), and the calls that failed.
    let mut beats_failed = 0u64;
    let mut failures: HashMap<String, usize> = HashMap::new();
    within(
        bound,
        "the farms' counts",
        every_farm(&mut farms, "stats", "stats", |_, s| {
            beats_failed += s.num::<u64>("beats_failed")?;
            for entry in s.get("failures")?.split(',').filter(|e| !e.is_empty()) {
                let (count, key) = entry.split_once('@').ok_or(format!("failures= holds {entry:?}"))?;
                *failures.entry(key.to_string()).or_default() += count.parse::<usize>().map_err(|e| e.to_string())?;
            }
            Ok(())
        }),
    )
    .await??;
    // 6. Finish: every survivor leaves, finished, at once.
    let cpu0 = cpu_all(&coordinators);
    let mut refusals = 0usize;
    let mut first_refusal = String::new();
    let spans = phase(&mut farms, bound, "every survivor leaving, finished", async |farms| {
        every_farm(farms, "finish", "finished", |_, f| {
            let refused: usize = f.num("refused")?;
            if refused > 0 && first_refusal.is_empty() {
                first_refusal = f.get("text")?.to_string();
            }
            refusals += refused;
            Ok((f.num::<u64>("start")?, f.num::<u64>("end")?))
        })
        .await
    })
    .await?;
    let finished = between(
        spans.iter().map(|s| s.0).min().unwrap_or_default(),
        spans.iter().map(|s| s.1).max().unwrap_or_default(),
    );
    let cpu_finish = cpu_all(&coordinators) - cpu0;
    phase_end("finish", &mut mark)?;
    let overran: u64 =
        within(bound, "the farms' counts", every_farm(&mut farms, "stats", "stats", |_, s| s.num::<u64>("overran")))
            .await??
            .into_iter()
            .sum();
    for f in farms.iter_mut() {
        let _ = f.send("quit");
    }
    let late_client = ControlClient::new(ControlConfig::new(endpoints.clone())).map_err(|e| format!("client: {e}"))?;
    let late = late_client
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
    let mut settings = format!(" ranks_per_host={} farms={farm_count}", plan.ranks_per_host);
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
    let mut failures: Vec<(String, usize)> = failures.into_iter().collect();
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
        refusals,
        beats_failed,
        overran,
        rss.join("+"),
    );
    if refusals > 0 {
        return Err(format!("{refusals} of {} leaves were refused, the first: {first_refusal}", n - 2));
    }
    if !ended {
        return Err(format!("the job did not end when every member had finished (a later join: {late:?})"));
    }
    if overran > 0 {
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
    match FarmSpec::from_args() {
        Ok(Some(spec)) => {
            // A farm: the conductor started it and reads its answers.
            runtime.block_on(farm::serve(plan, spec));
            return;
        }
        Ok(None) => {}
        Err(e) => {
            eprintln!("scale: {e}");
            std::process::exit(2);
        }
    }
    let mut failed = false;
    runtime.block_on(async {
        eprintln!(
            "scale harness: {} members of the shipped worker in {} farms, stores {:?}, {} CPUs",
            plan.members,
            plan.farms(),
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
