//! A simulated worker: the real control-plane client ([`cohort::control::ControlClient`])
//! over the simulated network, driving the membership protocol as `cohort::elastic`'s
//! `ElasticGroup` does (a heartbeat task, a watch task, a commit task that sends the newest
//! commit, a rendezvous loop, failure reports), with a model of the data plane beneath it.
//!
//! The real `ElasticGroup` cannot run here: its data plane is real TCP and shared memory.
//! Its collectives are modelled instead, as a lock-step ring over the [`Ledger`]'s state:
//! a step completes when every member has arrived and no fault sits on the ring; a rank
//! whose predecessor died sees the link close (PEER_CLOSED, at once); a rank that hears
//! nothing from its predecessor for the no-progress deadline times out naming it, with the
//! progress a ring would show (nothing received when the silence is on its own incoming
//! link, one message otherwise), which is what makes timeout cascades.

use crate::ledger::{now_ms, Ledger, Shared};
use crate::net::{Connector, GRPC_PORT};
use cohort::control::{ControlClient, ControlConfig, ControlError};
use cohort_proto::v1 as pb;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The job every worker joins.
pub(crate) const JOB: &str = "simjob";
/// How long a worker computes between two steps.
const STEP_MS: u64 = 20;
/// How far back a fault excuses an eviction.
const EXCUSE_MS: u64 = 15_000;

/// What a worker host is started with.
pub(crate) struct WorkerSetup {
    pub(crate) index: usize,
    pub(crate) replicas: usize,
    pub(crate) shared: Shared,
    /// The data plane's no-progress deadline.
    pub(crate) no_progress: Duration,
}

/// The worker id of worker `index`.
pub(crate) fn worker_id(index: usize) -> String {
    format!("w{index}")
}

fn index_of(worker_id: &str) -> Option<usize> {
    worker_id.strip_prefix('w').and_then(|i| i.parse().ok())
}

/// What one worker process knows (gone when it crashes).
#[derive(Default)]
struct Local {
    incarnation: AtomicU64,
    evicted: AtomicBool,
    /// Generation for which a re-formation is pending.
    pending: AtomicU64,
    revoked: Mutex<BTreeMap<u64, String>>,
    ended: Mutex<Option<String>>,
}

impl Local {
    fn is_revoked(&self, g: u64) -> bool {
        self.revoked.lock().unwrap_or_else(|e| e.into_inner()).contains_key(&g)
    }
    fn ended(&self) -> Option<String> {
        self.ended.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// How a worker's time in a generation ended.
enum Exit {
    Left,
    Finish,
}

struct Worker {
    setup: Arc<WorkerSetup>,
    name: String,
    id: String,
    client: ControlClient,
    local: Arc<Local>,
}

/// The longest any one client call may take: the client's own bounds (request timeout,
/// long-poll wait, retry budget) and a margin. A call past it waits forever, as far as the
/// invariants are concerned.
fn call_bound(config: &ControlConfig, extra: Duration) -> Duration {
    config.request_timeout + extra + config.retry_budget + config.request_timeout + Duration::from_secs(5)
}

/// Runs one client call under [`call_bound`]; past it, records a violation.
async fn bounded<T>(
    shared: &Shared,
    name: &str,
    rpc: &str,
    bound: Duration,
    call: impl Future<Output = Result<T, ControlError>>,
) -> Result<T, ControlError> {
    match tokio::time::timeout(bound, call).await {
        Ok(result) => result,
        Err(_) => {
            shared
                .violation(now_ms(), format!("{name}: {rpc} did not return within {bound:?} (nothing waits forever)"));
            Err(ControlError::Unreachable { endpoints: String::new(), attempts: 0, last: "watchdog".into() })
        }
    }
}

/// Waits while the worker is paused (SIGSTOP).
async fn stopped_while_paused(shared: &Shared, index: usize) {
    while shared.lock().paused.contains(&index) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A worker process: runs until the job ends for it or it finishes.
///
/// # Cancel safety
/// Cancelling it is a crash (that is how the simulation crashes a worker).
pub(crate) async fn run(setup: Arc<WorkerSetup>) -> turmoil::Result {
    let mut config =
        ControlConfig::new((0..setup.replicas).map(|r| format!("http://replica-{r}:{GRPC_PORT}")).collect());
    config.retry_jitter = 0.0;
    config.first_endpoint = Some(setup.index % setup.replicas);
    let client = ControlClient::with_connector(config, |e| e.connect_with_connector_lazy(Connector))?;
    let worker = Arc::new(Worker {
        name: format!("worker-{}", setup.index),
        id: worker_id(setup.index),
        setup,
        client,
        local: Arc::new(Local::default()),
    });
    {
        let mut ledger = worker.setup.shared.lock();
        let view = ledger.workers.entry(worker.setup.index).or_default();
        view.up = true;
        view.incarnation = 0;
        view.in_generation = None;
        view.last_formed = 0;
    }
    worker.setup.shared.log(&worker.name, "process starts");
    tokio::spawn(watch_task(worker.clone()));
    worker.membership().await;
    Ok(())
}

impl Worker {
    fn shared(&self) -> &Shared {
        &self.setup.shared
    }

    fn log(&self, event: impl AsRef<str>) {
        self.shared().log(&self.name, event);
    }

    fn bound(&self, extra: Duration) -> Duration {
        call_bound(self.client.config(), extra)
    }

    /// Joins (again after an eviction) until the job ends or the worker finishes.
    async fn membership(self: &Arc<Self>) {
        loop {
            stopped_while_paused(self.shared(), self.setup.index).await;
            if let Some(ended) = self.local.ended() {
                self.log(format!("exits: the job ended ({ended})"));
                return;
            }
            if self.shared().lock().finish {
                self.finish(0).await;
                return;
            }
            let request = pb::JoinRequest {
                job: JOB.into(),
                worker_id: self.id.clone(),
                host: self.name.clone(),
                addresses: vec![pb::TransportAddress {
                    transport: "tcp".into(),
                    address: format!("{}:7200", self.name),
                }],
                capabilities: vec!["transport:tcp".into()],
                protocol_version: cohort_proto::PROTOCOL_VERSION,
                domain: String::new(),
                // The incarnation this process held (0 until its first join): its own
                // re-join after an eviction is never taken for a second process.
                replaces: self.local.incarnation.load(Ordering::SeqCst),
            };
            let joined =
                bounded(self.shared(), &self.name, "Join", self.bound(Duration::ZERO), self.client.join(request)).await;
            let response = match joined {
                Ok(r) => r,
                Err(ControlError::Excluded { retry_after, .. }) => {
                    self.log(format!("join refused: excluded for {} ms", retry_after.as_millis()));
                    let until = now_ms() + retry_after.as_millis() as u64;
                    self.shared().lock().workers.entry(self.setup.index).or_default().excluded_until = until;
                    tokio::time::sleep(retry_after.min(Duration::from_secs(10))).await;
                    continue;
                }
                Err(e) if e.to_string().contains("has ended") => {
                    let text = e.to_string();
                    let failed = text.contains("Failed") || text.contains("FAILED");
                    let outcome = pb::JobEnded {
                        outcome: if failed { pb::job_ended::Outcome::Failed } else { pb::job_ended::Outcome::Finished }
                            as i32,
                        reason: format!("join refused: {}", short(&e)),
                    };
                    self.heard_end(&outcome);
                    continue;
                }
                Err(e) => {
                    self.log(format!("join failed: {}", short(&e)));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            let incarnation = response.incarnation;
            self.local.incarnation.store(incarnation, Ordering::SeqCst);
            self.local.evicted.store(false, Ordering::SeqCst);
            self.shared().lock().workers.entry(self.setup.index).or_default().incarnation = incarnation;
            self.log(format!(
                "joined as incarnation {incarnation} (job at generation {})",
                response.current_generation
            ));
            let (commits, commit_rx) = tokio::sync::watch::channel(None);
            tokio::spawn(heartbeat_task(self.clone(), incarnation));
            tokio::spawn(commit_task(self.clone(), commit_rx));
            if self.rendezvous_loop(incarnation, &commits).await {
                return;
            }
        }
    }

    /// Leaves with FINISHED (when a member) and records it.
    async fn finish(&self, incarnation: u64) {
        if incarnation != 0 {
            let request = pb::LeaveRequest {
                job: JOB.into(),
                worker_id: self.id.clone(),
                incarnation,
                mode: pb::leave_request::Mode::Finished as i32,
            };
            if let Err(e) =
                bounded(self.shared(), &self.name, "Leave", self.bound(Duration::ZERO), self.client.leave(request))
                    .await
            {
                self.log(format!("leave failed: {}", short(&e)));
            }
        }
        self.log("leaves: finished");
        let mut ledger = self.shared().lock();
        let view = ledger.workers.entry(self.setup.index).or_default();
        view.finished = true;
        view.in_generation = None;
    }

    /// Rendezvous and work until evicted (`false`: join again) or done (`true`).
    async fn rendezvous_loop(
        self: &Arc<Self>,
        incarnation: u64,
        commits: &tokio::sync::watch::Sender<Option<pb::CommitRequest>>,
    ) -> bool {
        let mut last = 0u64;
        loop {
            stopped_while_paused(self.shared(), self.setup.index).await;
            if let Some(ended) = self.local.ended() {
                self.log(format!("exits: the job ended ({ended})"));
                return true;
            }
            if self.shared().lock().finish {
                self.finish(incarnation).await;
                return true;
            }
            if self.local.evicted.load(Ordering::SeqCst) {
                return false;
            }
            let request = pb::RendezvousRequest {
                job: JOB.into(),
                worker_id: self.id.clone(),
                incarnation,
                after_generation: last,
                wait_ms: 10_000,
            };
            let answer = bounded(
                self.shared(),
                &self.name,
                "Rendezvous",
                self.bound(Duration::from_secs(10)),
                self.client.rendezvous(request),
            )
            .await;
            use pb::rendezvous_response::Outcome;
            match answer {
                Ok(pb::RendezvousResponse { outcome: Some(Outcome::Formed(g)) }) => {
                    if g.number <= last {
                        self.shared().violation(
                            now_ms(),
                            format!("{}: rendezvous gave generation {} after {last}", self.name, g.number),
                        );
                        return false;
                    }
                    last = g.number;
                    if let Exit::Finish = self.work_in(incarnation, &g, commits).await {
                        self.finish(incarnation).await;
                        return true;
                    }
                }
                Ok(pb::RendezvousResponse { outcome: Some(Outcome::Waiting(w)) }) => {
                    self.log(format!("waiting: {} waiting, min {}", w.waiting_members, w.min_workers));
                }
                Ok(pb::RendezvousResponse { outcome: Some(Outcome::Ended(e)) }) => {
                    self.heard_end(&e);
                }
                Ok(pb::RendezvousResponse { outcome: None }) => {
                    self.shared().violation(now_ms(), format!("{}: rendezvous answer without an outcome", self.name));
                }
                Err(e) if e.code() == Some(tonic::Code::NotFound) => self.evicted("Rendezvous", incarnation, &e),
                Err(e) => {
                    self.log(format!("rendezvous failed: {}", short(&e)));
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    fn heard_end(&self, e: &pb::JobEnded) {
        let outcome = if e.outcome == pb::job_ended::Outcome::Failed as i32 { "FAILED" } else { "FINISHED" };
        let mut ended = self.local.ended.lock().unwrap_or_else(|e| e.into_inner());
        if ended.is_none() {
            *ended = Some(outcome.to_string());
            drop(ended);
            self.log(format!("hears: job ended {outcome} ({})", e.reason));
            let mut ledger = self.shared().lock();
            ledger.workers.entry(self.setup.index).or_default().ended = Some((now_ms(), outcome.to_string()));
        }
    }

    /// The coordinator no longer knows this incarnation: checks that a fault excuses it.
    fn evicted(&self, rpc: &str, incarnation: u64, e: &ControlError) {
        if self.local.incarnation.load(Ordering::SeqCst) != incarnation {
            return; // an answer to an older incarnation's call
        }
        if e.to_string().contains("has ended") {
            let mut ended = self.local.ended.lock().unwrap_or_else(|e| e.into_inner());
            if ended.is_none() {
                *ended = Some("ended (heard as NOT_FOUND)".into());
            }
            return;
        }
        if self.local.evicted.swap(true, Ordering::SeqCst) {
            return;
        }
        let now = now_ms();
        self.log(format!("evicted ({rpc}: NOT_FOUND)"));
        let (excused, finishing) = {
            let ledger = self.shared().lock();
            (ledger.touched(self.setup.index, now.saturating_sub(EXCUSE_MS), now), ledger.finish)
        };
        if !excused && !finishing {
            self.shared().violation(
                now,
                format!(
                    "{} was evicted with no fault on it in the last {} s (a healthy worker is never evicted)",
                    self.name,
                    EXCUSE_MS / 1000
                ),
            );
        }
    }

    /// Works in generation `g` until it is revoked or re-forms, the worker is evicted, or
    /// the job ends.
    async fn work_in(
        self: &Arc<Self>,
        incarnation: u64,
        g: &pb::Generation,
        commits: &tokio::sync::watch::Sender<Option<pb::CommitRequest>>,
    ) -> Exit {
        let members: Vec<(String, u64)> = g.members.iter().map(|m| (m.worker_id.clone(), m.incarnation)).collect();
        let Some(rank) = members.iter().position(|(w, i)| *w == self.id && *i == incarnation) else {
            self.shared().violation(now_ms(), format!("{}: generation {} does not include it", self.name, g.number));
            return Exit::Left;
        };
        let mut step = {
            let mut ledger = self.shared().lock();
            match ledger.groups.get(&g.number) {
                Some(known) if *known != members => {
                    let known = known.clone();
                    drop(ledger);
                    self.shared().violation(
                        now_ms(),
                        format!("two groups for generation {}: {known:?} and {members:?}", g.number),
                    );
                    ledger = self.shared().lock();
                }
                Some(_) => {}
                None => {
                    ledger.groups.insert(g.number, members.clone());
                }
            }
            let view = ledger.workers.entry(self.setup.index).or_default();
            view.in_generation = Some(g.number);
            view.last_formed = g.number;
            // The state is restored from the member with the newest commit.
            members
                .iter()
                .filter_map(|(w, _)| index_of(w))
                .filter_map(|i| ledger.committed.get(&i))
                .max()
                .copied()
                .unwrap_or(0)
        };
        let names: Vec<&str> = members.iter().map(|(w, _)| w.as_str()).collect();
        self.log(format!("generation {}: rank {rank} of {:?}, resumes after step {step}", g.number, names));
        let exit = loop {
            stopped_while_paused(self.shared(), self.setup.index).await;
            if self.shared().lock().finish {
                break Exit::Finish;
            }
            if let Some(cause) = self.local.revoked.lock().unwrap_or_else(|e| e.into_inner()).get(&g.number).cloned() {
                self.log(format!("leaves generation {}: revoked ({cause})", g.number));
                break Exit::Left;
            }
            if self.local.evicted.load(Ordering::SeqCst) || self.local.ended().is_some() {
                break Exit::Left;
            }
            if self.local.pending.load(Ordering::SeqCst) == g.number {
                self.log(format!("leaves generation {} at step {step}: re-formation pending", g.number));
                break Exit::Left;
            }
            step += 1;
            match self.collective(g.number, &members, rank as u32, step).await {
                Collective::Done => {
                    self.shared().lock().committed.insert(self.setup.index, step);
                    let _ = commits.send(Some(pb::CommitRequest {
                        job: JOB.into(),
                        worker_id: self.id.clone(),
                        incarnation,
                        generation: g.number,
                        step,
                        digest: step.to_le_bytes().to_vec(),
                    }));
                    tokio::time::sleep(Duration::from_millis(STEP_MS)).await;
                }
                Collective::Interrupted => step -= 1,
                Collective::Failed { kind, peer, received } => {
                    self.report(incarnation, g.number, step, kind, peer, received).await;
                    // Wait for the revocation (or an end) before rendezvousing again.
                    let until = now_ms() + 20_000;
                    while !self.local.is_revoked(g.number)
                        && self.local.ended().is_none()
                        && !self.local.evicted.load(Ordering::SeqCst)
                        && !self.shared().lock().finish
                        && now_ms() < until
                    {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    step -= 1;
                }
            }
        };
        self.shared().lock().workers.entry(self.setup.index).or_default().in_generation = None;
        exit
    }

    async fn report(
        &self,
        incarnation: u64,
        g: u64,
        step: u64,
        kind: pb::failure_report::FailureKind,
        peer: u32,
        received: u64,
    ) {
        self.log(format!(
            "step {step} of generation {g} failed: {} from rank {peer} (received {received})",
            kind.as_str_name()
        ));
        let request = pb::FailureReport {
            job: JOB.into(),
            worker_id: self.id.clone(),
            incarnation,
            generation: g,
            failed_rank: Some(peer),
            reason: format!("{} on the link from rank {peer}", kind.as_str_name()),
            kind: kind as i32,
            progress: Some(pb::OpProgress { seq: step as u32, received }),
        };
        match bounded(
            self.shared(),
            &self.name,
            "ReportFailure",
            self.bound(Duration::ZERO),
            self.client.report_failure(request),
        )
        .await
        {
            Ok(answer) => {
                let cause = answer.cause.map(|c| format!("rank {:?} {}", c.rank, c.worker_id)).unwrap_or_default();
                self.log(format!("report answered: accepted {}, root cause {cause}", answer.accepted));
            }
            Err(e) if e.code() == Some(tonic::Code::NotFound) => self.evicted("ReportFailure", incarnation, &e),
            Err(e) => self.log(format!("report failed: {}", short(&e))),
        }
    }

    /// One step's collective, modelled as a ring (see the module's documentation).
    async fn collective(&self, g: u64, members: &[(String, u64)], rank: u32, step: u64) -> Collective {
        let n = members.len();
        let me = self.setup.index;
        self.shared().lock().arrivals.entry((g, step)).or_default().insert(rank);
        let start = now_ms();
        let pred = (rank as usize + n - 1) % n;
        loop {
            tokio::time::sleep(Duration::from_millis(2)).await;
            stopped_while_paused(self.shared(), me).await;
            if self.local.is_revoked(g)
                || self.local.evicted.load(Ordering::SeqCst)
                || self.local.ended().is_some()
                || self.local.pending.load(Ordering::SeqCst) == g
                || self.shared().lock().finish
            {
                return Collective::Interrupted;
            }
            let now = now_ms();
            let mut ledger = self.shared().lock();
            if ledger.completed.contains(&(g, step)) {
                return Collective::Done;
            }
            let arrived = ledger.arrivals.get(&(g, step)).map_or(0, |a| a.len());
            let faulty = |r: usize| -> (bool, bool) {
                let (w, inc) = &members[r];
                let idx = index_of(w).unwrap_or(usize::MAX);
                let dead = !alive(&ledger, idx, *inc);
                let prev = index_of(&members[(r + n - 1) % n].0).unwrap_or(usize::MAX);
                let silent = ledger.paused.contains(&prev) || ledger.silent.contains(&(prev, idx));
                (dead, silent)
            };
            let ring_fault = (0..n).any(|r| {
                let (dead, silent) = faulty(r);
                dead || silent
            });
            if arrived == n && !ring_fault {
                ledger.completed.insert((g, step));
                return Collective::Done;
            }
            let (pred_dead, _) = faulty(pred);
            let (_, my_link_silent) = faulty(rank as usize);
            let pred_arrived = ledger.arrivals.get(&(g, step)).is_some_and(|a| a.contains(&(pred as u32)));
            if pred_dead && now >= start + 10 {
                return Collective::Failed {
                    kind: pb::failure_report::FailureKind::PeerClosed,
                    peer: pred as u32,
                    received: 0,
                };
            }
            if now >= start + self.setup.no_progress.as_millis() as u64 {
                let received = u64::from(!(my_link_silent || pred_dead || !pred_arrived));
                return Collective::Failed {
                    kind: pb::failure_report::FailureKind::Timeout,
                    peer: pred as u32,
                    received,
                };
            }
        }
    }
}

fn alive(ledger: &Ledger, index: usize, incarnation: u64) -> bool {
    ledger.workers.get(&index).is_some_and(|v| v.up && v.incarnation == incarnation)
}

enum Collective {
    Done,
    Interrupted,
    Failed { kind: pb::failure_report::FailureKind, peer: u32, received: u64 },
}

fn short(e: &ControlError) -> String {
    let s = e.to_string();
    match s.char_indices().nth(120) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

/// Heartbeats every interval (as `ElasticGroup`'s task does), until this incarnation is
/// replaced or evicted.
async fn heartbeat_task(worker: Arc<Worker>, incarnation: u64) {
    let mut ticker = tokio::time::interval(Duration::from_millis(500));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        stopped_while_paused(worker.shared(), worker.setup.index).await;
        if worker.local.incarnation.load(Ordering::SeqCst) != incarnation
            || worker.local.evicted.load(Ordering::SeqCst)
            || worker.local.ended().is_some()
        {
            return;
        }
        let generation =
            worker.shared().lock().workers.get(&worker.setup.index).and_then(|v| v.in_generation).unwrap_or(0);
        let request = pb::HeartbeatRequest {
            job: JOB.into(),
            worker_id: worker.id.clone(),
            incarnation,
            generation,
            step: 0,
            activity: "sim".into(),
            deadlines: String::new(),
            timing: None,
        };
        match bounded(
            worker.shared(),
            &worker.name,
            "Heartbeat",
            worker.bound(Duration::ZERO),
            worker.client.heartbeat(request),
        )
        .await
        {
            Ok(answer) => {
                if answer.reformation_pending && answer.current_generation == generation && generation != 0 {
                    worker.local.pending.store(generation, Ordering::SeqCst);
                }
            }
            Err(e) if e.code() == Some(tonic::Code::NotFound) => {
                worker.evicted("Heartbeat", incarnation, &e);
                return;
            }
            Err(e) => worker.log(format!("heartbeat failed: {}", short(&e))),
        }
    }
}

/// Sends the newest commit (a report cut short is superseded by the next one).
async fn commit_task(worker: Arc<Worker>, mut commits: tokio::sync::watch::Receiver<Option<pb::CommitRequest>>) {
    while commits.changed().await.is_ok() {
        let Some(request) = commits.borrow_and_update().clone() else { continue };
        let (generation, incarnation) = (request.generation, request.incarnation);
        match bounded(
            worker.shared(),
            &worker.name,
            "Commit",
            worker.bound(Duration::ZERO),
            worker.client.commit(request),
        )
        .await
        {
            Ok(answer) => {
                let current = worker.shared().lock().workers.get(&worker.setup.index).and_then(|v| v.in_generation);
                if answer.reformation_pending && current == Some(generation) {
                    worker.local.pending.store(generation, Ordering::SeqCst);
                }
            }
            Err(e) if e.code() == Some(tonic::Code::NotFound) => worker.evicted("Commit", incarnation, &e),
            Err(_) => {}
        }
    }
}

/// Follows the job's events for the current incarnation, reopening the stream when it
/// breaks or the worker joins again.
async fn watch_task(worker: Arc<Worker>) {
    loop {
        let incarnation = worker.local.incarnation.load(Ordering::SeqCst);
        if worker.local.ended().is_some() {
            return;
        }
        if incarnation == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let request = pb::WatchRequest { job: JOB.into(), worker_id: worker.id.clone(), incarnation };
        if let Ok(mut stream) = worker.client.watch(request).await {
            while worker.local.incarnation.load(Ordering::SeqCst) == incarnation {
                match tokio::time::timeout(Duration::from_millis(200), stream.message()).await {
                    Err(_) => continue,
                    Ok(Ok(Some(event))) => worker.apply(event),
                    Ok(_) => break,
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

impl Worker {
    fn apply(&self, event: pb::JobEvent) {
        use pb::job_event::Event;
        match event.event {
            Some(Event::GenerationRevoked(r)) => {
                let cause = r
                    .cause
                    .map(|c| format!("root cause rank {:?} {}: {}", c.rank, c.worker_id, c.reason))
                    .unwrap_or_default();
                let fresh = self
                    .local
                    .revoked
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(r.generation, cause.clone())
                    .is_none();
                if fresh {
                    self.log(format!("hears: generation {} revoked, {cause}", r.generation));
                    self.shared().lock().revoked.entry(r.generation).or_insert_with(now_ms);
                }
            }
            Some(Event::ReformationPending(p)) => {
                self.local.pending.fetch_max(p.generation, Ordering::SeqCst);
            }
            Some(Event::JobEnded(e)) => self.heard_end(&e),
            Some(Event::GenerationFormed(_) | Event::StragglerNamed(_)) | None => {}
        }
    }
}
