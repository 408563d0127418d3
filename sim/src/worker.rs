//! A simulated worker: the real membership machine ([`cohort::elastic::membership`], the one
//! `ElasticGroup` drives) and the real control-plane client
//! ([`cohort::control::ControlClient`]) over the simulated network, in a thin shell that
//! performs the machine's calls and effects as `ElasticGroup` does: a heartbeat task, a watch
//! task, a commit task that sends the newest commit, the join and rendezvous loop, failure
//! reports, a leave at the end.
//!
//! The shell decides nothing about membership. Which incarnation is current, whether an
//! answer is stale, how long an excluded worker waits, whether a re-formation is pending, when
//! the event stream reopens, when the job is over and what a failure's root cause is are the
//! machine's answers, so a bug in the machine is a bug here. What the shell adds is what the
//! invariants observe (the [`crate::ledger::Ledger`]) and the process around the machine:
//! SIGSTOP-like pauses, crashes (the host is dropped, and a restart is a new process), and the
//! driver's request to finish (a member leaves FINISHED at its next step, a worker between
//! generations at once, as `cohort-worker train` does at its last step or on SIGTERM).
//!
//! The data plane is the simulation's own model, a lock-step ring ([`crate::ring`]); the
//! machine's `Abort` effect revokes the modelled communicator, as it revokes the real one.

use crate::ledger::{now_ms, Group, Shared};
use crate::net::{Connector, GRPC_PORT};
use crate::ring::{Failure, Outcome, Ring};
use cohort::control::{ControlClient, ControlConfig, ControlError};
use cohort::elastic::membership::{CallError, Effect, JoinNext, Membership, Step, WatchNext};
use cohort::elastic::{ElasticConfig, ElasticError};
use cohort::RootCause;
use cohort_proto::v1 as pb;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// The job every worker joins.
pub(crate) const JOB: &str = "simjob";
/// How long a worker computes between two steps.
const STEP_MS: u64 = 20;
/// How far back a fault excuses an eviction.
const EXCUSE_MS: u64 = 15_000;

/// What a worker host is started with.
pub(crate) struct WorkerSetup {
    pub(crate) index: usize,
    /// The host it runs on (its failure domain): `worker-<index>` when every worker has a
    /// host of its own, `host-<h>` when several share one ([`crate::Options::workers_per_host`]).
    pub(crate) host: String,
    pub(crate) replicas: usize,
    pub(crate) shared: Shared,
    /// The data plane's no-progress deadline.
    pub(crate) no_progress: Duration,
    /// The seed (the watch's reopen jitter is drawn from it).
    pub(crate) seed: u64,
}

/// The worker id of worker `index`.
pub(crate) fn worker_id(index: usize) -> String {
    format!("w{index}")
}

/// The machine's clock: the simulated time of the calling host.
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// How the worker's time in a generation ended.
enum Exit {
    /// It left the generation (revoked, failed, or re-formed at a commit point).
    Left,
    /// It finished and left the job.
    Finished,
}

/// An eviction this worker heard, judged when it has joined again: a job that ended evicts
/// its members too, and then the join is refused instead.
struct Eviction {
    at_ms: u64,
    rpc: &'static str,
    finishing: bool,
}

/// One worker process (all of it is gone when the host crashes).
struct Worker {
    setup: Arc<WorkerSetup>,
    name: String,
    id: String,
    client: ControlClient,
    /// The defaults of the real runtime: exclusion wait, rendezvous poll, root-cause wait.
    elastic: ElasticConfig,
    machine: Mutex<Membership>,
    /// Woken on [`Effect::Wake`].
    changed: Notify,
    /// The modelled communicator: its generation, and the cause it was revoked with
    /// ([`Effect::Abort`]).
    comm: Mutex<Option<(u64, Option<RootCause>)>>,
    /// The newest commit report, sent by the commit task.
    commits: tokio::sync::watch::Sender<Option<pb::CommitRequest>>,
    eviction: Mutex<Option<Eviction>>,
    rng: Mutex<StdRng>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// The longest any one client call may take: the client's own bounds (request timeout,
/// long-poll wait, retry budget) and a margin. A call past it waits forever, as far as the
/// invariants are concerned.
fn call_bound(config: &ControlConfig, extra: Duration) -> Duration {
    config.request_timeout + extra + config.retry_budget + config.request_timeout + Duration::from_secs(5)
}

/// Runs one client call under [`call_bound`]; past it, records a violation. The error, as
/// the membership machine classifies it.
async fn bounded<T>(
    shared: &Shared,
    name: &str,
    rpc: &str,
    bound: Duration,
    call: impl Future<Output = Result<T, ControlError>>,
) -> Result<T, CallError> {
    match tokio::time::timeout(bound, call).await {
        Ok(result) => result.map_err(CallError::from),
        Err(_) => {
            shared
                .violation(now_ms(), format!("{name}: {rpc} did not return within {bound:?} (nothing waits forever)"));
            Err(CallError::Failed(ControlError::Unreachable {
                endpoints: String::new(),
                attempts: 0,
                last: "watchdog".into(),
            }))
        }
    }
}

/// Waits while the worker is paused (SIGSTOP).
async fn stopped_while_paused(shared: &Shared, index: usize) {
    while shared.lock().paused.contains(&index) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Resolves once the driver has asked the workers to finish.
async fn asked_to_finish(shared: &Shared) {
    while !shared.lock().finish {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Several worker processes on one host: each runs as [`run`] does alone, and all of them
/// go when the host crashes. A worker that had finished before the host restarted is not
/// started again (it left the job).
///
/// # Cancel safety
/// Cancelling it is a crash of every worker on the host.
pub(crate) async fn run_host(setups: Vec<Arc<WorkerSetup>>) -> turmoil::Result {
    let mut processes = tokio::task::JoinSet::new();
    for setup in setups {
        let finished = setup.shared.lock().workers.get(&setup.index).is_some_and(|v| v.finished);
        if !finished {
            processes.spawn_local(run(setup));
        }
    }
    while let Some(done) = processes.join_next().await {
        done.map_err(|e| format!("a worker process panicked: {e}"))??;
    }
    Ok(())
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
    let client = ControlClient::with_connector(config.clone(), |e| e.connect_with_connector_lazy(Connector))?;
    let elastic = ElasticConfig::new(JOB, worker_id(setup.index), config);
    let worker = Arc::new(Worker {
        name: format!("worker-{}", setup.index),
        id: worker_id(setup.index),
        client,
        machine: Mutex::new(Membership::new(elastic.exclusion_wait)),
        elastic,
        changed: Notify::new(),
        comm: Mutex::new(None),
        commits: tokio::sync::watch::channel(None).0,
        eviction: Mutex::new(None),
        rng: Mutex::new(StdRng::seed_from_u64(setup.seed ^ (0x3a7c_u64 << 16) ^ setup.index as u64)),
        tasks: Mutex::new(Vec::new()),
        setup,
    });
    {
        let mut ledger = worker.shared().lock();
        let view = ledger.workers.entry(worker.setup.index).or_default();
        view.up = true;
        view.incarnation = 0;
        view.in_generation = None;
        view.last_formed = 0;
        view.excluded_until = 0;
    }
    worker.log("process starts");
    if let Err(e) = worker.process().await {
        if let ElasticError::Protocol(_) = e {
            worker.shared().violation(now_ms(), format!("{}: coordinator protocol violation: {e}", worker.name));
        }
        worker.log(format!("exits: {e}"));
        // A join refused with FAILED_PRECONDITION, not an exclusion, is the coordinator saying
        // that the job is over: the worker learnt it then (with the outcome its status gives).
        if let ElasticError::Control(ControlError::Rejected {
            rpc: "Join",
            code: tonic::Code::FailedPrecondition,
            ..
        }) = e
        {
            worker.heard_end_at_join().await;
        }
    }
    // The process ends: so do its tasks.
    for task in worker.tasks.lock().unwrap_or_else(PoisonError::into_inner).drain(..) {
        task.abort();
    }
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

    fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        let mut tasks = self.tasks.lock().unwrap_or_else(PoisonError::into_inner);
        tasks.retain(|t| !t.is_finished());
        tasks.push(tokio::spawn(task));
    }

    async fn paused(&self) {
        stopped_while_paused(self.shared(), self.setup.index).await;
    }

    fn finishing(&self) -> bool {
        self.shared().lock().finish
    }

    /// Reads the machine's state.
    fn read<T>(&self, query: impl FnOnce(&Membership) -> T) -> T {
        query(&self.machine.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Feeds one input to the machine (`rpc`: the call whose answer it is, for the trace) and
    /// performs the effects it queued, as `ElasticGroup`'s shell does; records in the ledger
    /// what the invariants observe (an eviction, the job's end).
    fn drive<T>(&self, rpc: &'static str, input: impl FnOnce(&mut Membership) -> T) -> T {
        let (output, effects, evicted, ended) = {
            let mut machine = self.machine.lock().unwrap_or_else(PoisonError::into_inner);
            let (was_evicted, had_ended) = (machine.is_evicted(), machine.ended().is_some());
            let output = input(&mut machine);
            let effects: Vec<Effect> = std::iter::from_fn(|| machine.poll_effect()).collect();
            let ended = if had_ended { None } else { machine.ended() };
            (output, effects, !was_evicted && machine.is_evicted(), ended)
        };
        if evicted {
            self.log(format!("evicted ({rpc}: NOT_FOUND)"));
            let finishing = self.finishing();
            *self.eviction.lock().unwrap_or_else(PoisonError::into_inner) =
                Some(Eviction { at_ms: now_ms(), rpc, finishing });
        }
        if let Some(ElasticError::JobEnded { outcome, reason }) = ended {
            let outcome = outcome.to_uppercase();
            self.log(format!("hears: job ended {outcome} ({reason})"));
            self.shared().lock().workers.entry(self.setup.index).or_default().ended = Some((now_ms(), outcome));
        }
        for effect in effects {
            match effect {
                Effect::Abort { generation, cause } => {
                    if let Some((g, revoked @ None)) = self.comm.lock().unwrap_or_else(PoisonError::into_inner).as_mut()
                    {
                        if *g == generation {
                            *revoked = Some(cause);
                        }
                    }
                }
                Effect::Wake => self.changed.notify_waiters(),
            }
        }
        output
    }

    /// Joins, then re-forms (and joins again after an eviction) until the job ends for this
    /// worker (an error) or it finishes.
    async fn process(self: &Arc<Self>) -> Result<(), ElasticError> {
        if !self.join().await? {
            return Ok(());
        }
        self.spawn(commit_task(self.clone(), self.commits.subscribe()));
        self.spawn(watch_task(self.clone()));
        loop {
            self.paused().await;
            if self.finishing() {
                self.finish().await;
                return Ok(());
            }
            match self.drive("", Membership::next_step)? {
                Step::Join => {
                    // Evicted again before a generation connected: the machine's backoff.
                    let wait = self.read(Membership::rejoin_backoff);
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = asked_to_finish(self.shared()) => continue,
                    }
                    if !self.join().await? {
                        return Ok(());
                    }
                }
                Step::Rendezvous { incarnation, after_generation } => {
                    let request = pb::RendezvousRequest {
                        job: JOB.into(),
                        worker_id: self.id.clone(),
                        incarnation,
                        after_generation,
                        wait_ms: self.elastic.rendezvous_poll.as_millis() as u64,
                        compact: false,
                        partners: false,
                        layout: false,
                    };
                    let bound = self.bound(self.elastic.rendezvous_poll);
                    let answer =
                        bounded(self.shared(), &self.name, "Rendezvous", bound, self.client.rendezvous(request)).await;
                    match &answer {
                        Ok(pb::RendezvousResponse { outcome: Some(pb::rendezvous_response::Outcome::Waiting(w)) }) => {
                            self.log(format!("waiting: {} waiting, min {}", w.waiting_members, w.min_workers))
                        }
                        Err(e @ CallError::Failed(_)) => self.log(format!("rendezvous failed: {}", short(e))),
                        _ => {}
                    }
                    if let Some(generation) = self.drive("Rendezvous", |m| m.handle_rendezvous(incarnation, answer))? {
                        if let Exit::Finished = self.generation(&generation).await? {
                            return Ok(());
                        }
                    }
                }
            }
        }
    }

    /// One join: asks until the machine says joined (an excluded worker waits out its
    /// exclusion as the machine says), then starts the new incarnation's heartbeat. `false`
    /// when the worker was asked to finish meanwhile (it has).
    async fn join(self: &Arc<Self>) -> Result<bool, ElasticError> {
        let request = pb::JoinRequest {
            job: JOB.into(),
            worker_id: self.id.clone(),
            host: self.setup.host.clone(),
            addresses: vec![pb::TransportAddress { transport: "tcp".into(), address: format!("{}:7200", self.name) }],
            capabilities: vec!["transport:tcp".into()],
            protocol_version: cohort_proto::PROTOCOL_VERSION,
            domain: String::new(),
            // The incarnation this process held (0 until its first join): its own re-join
            // after an eviction is never taken for a second process.
            replaces: self.read(Membership::incarnation),
        };
        self.drive("", |m| m.begin_join(now()));
        loop {
            self.paused().await;
            let until = self.shared().lock().workers.get(&self.setup.index).map_or(0, |v| v.excluded_until);
            if now_ms() < until {
                let what = format!(
                    "{} asked to join before the end of its exclusion at {until} ms (an excluded worker waits it out)",
                    self.name
                );
                self.shared().violation(now_ms(), what);
            }
            let answer = bounded(
                self.shared(),
                &self.name,
                "Join",
                self.bound(Duration::ZERO),
                self.client.join(request.clone()),
            )
            .await;
            match &answer {
                Err(CallError::Excluded { retry_after, .. }) => {
                    self.log(format!("join refused: excluded for {} ms", retry_after.as_millis()));
                    let until = now_ms() + retry_after.as_millis() as u64;
                    self.shared().lock().workers.entry(self.setup.index).or_default().excluded_until = until;
                }
                Err(e) => self.log(format!("join refused: {}", short(e))),
                Ok(_) => {}
            }
            match self.drive("Join", |m| m.handle_join(now(), answer))? {
                JoinNext::Joined { incarnation, heartbeat_interval, .. } => {
                    self.shared().lock().workers.entry(self.setup.index).or_default().incarnation = incarnation;
                    self.log(format!("joined as incarnation {incarnation}"));
                    self.judge_eviction();
                    self.spawn(heartbeat_task(self.clone(), incarnation, heartbeat_interval));
                    return Ok(true);
                }
                JoinNext::RetryAt(at) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(at.into()) => {}
                        () = asked_to_finish(self.shared()) => {
                            self.finish().await;
                            return Ok(false);
                        }
                    }
                }
            }
        }
    }

    /// Its join was refused because the job is over: records the job's end, as its status
    /// gives it, at this time.
    async fn heard_end_at_join(&self) {
        let at_ms = now_ms();
        let status = self.client.status(pb::StatusRequest { job: JOB.into() });
        let Ok(pb::StatusResponse { ended: Some(ended), .. }) =
            bounded(self.shared(), &self.name, "Status", self.bound(Duration::ZERO), status).await
        else {
            return;
        };
        let failed = ended.outcome == pb::job_ended::Outcome::Failed as i32;
        let outcome = if failed { "FAILED" } else { "FINISHED" };
        self.log(format!("hears (its join refused): job ended {outcome} ({})", ended.reason));
        self.shared().lock().workers.entry(self.setup.index).or_default().ended = Some((at_ms, outcome.into()));
    }

    /// Joined again after an eviction: the job goes on, so the eviction must be excused by a
    /// fault on this worker shortly before it (or the driver's request to finish).
    fn judge_eviction(&self) {
        let Some(Eviction { at_ms, rpc, finishing }) =
            self.eviction.lock().unwrap_or_else(PoisonError::into_inner).take()
        else {
            return;
        };
        let excused = self.shared().lock().touched(self.setup.index, at_ms.saturating_sub(EXCUSE_MS), at_ms);
        if !excused && !finishing {
            self.shared().violation(
                at_ms,
                format!(
                    "{} was evicted ({rpc}: NOT_FOUND) with no fault on it in the last {} s (a healthy worker is never evicted)",
                    self.name,
                    EXCUSE_MS / 1000
                ),
            );
        }
    }

    /// Leaves with FINISHED (when a member) and records it.
    async fn finish(&self) {
        let incarnation = self.read(Membership::incarnation);
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

    /// Connects generation `g` (the modelled mesh connects at once) and works in it until it
    /// is left or the worker finishes, as `ElasticGroup::next_generation` and the training
    /// loop do.
    async fn generation(&self, g: &pb::Generation) -> Result<Exit, ElasticError> {
        let number = g.number;
        let incarnation = self.read(Membership::incarnation);
        let members: Group = g.members.iter().map(|m| (m.worker_id.clone(), m.incarnation)).collect();
        let Some(rank) = members.iter().position(|(w, i)| *w == self.id && *i == incarnation) else {
            return Err(ElasticError::Protocol(format!("generation {number} does not include this worker")));
        };
        self.record_group(number, &members);
        let ring = Ring {
            shared: self.shared(),
            index: self.setup.index,
            generation: number,
            members: &members,
            rank: rank as u32,
            no_progress: self.setup.no_progress,
        };
        let mut step = ring.resume_step();
        // Revoked before its mesh connected: given up at once, as ElasticGroup's connect does.
        if let Some(cause) = self.read(|m| m.stop_reason(number)) {
            self.log(format!("generation {number} revoked while connecting ({cause}); re-forming"));
            return Ok(Exit::Left);
        }
        // The revoker first, so that a revocation heard while connecting (or now) finds it.
        *self.comm.lock().unwrap_or_else(PoisonError::into_inner) = Some((number, None));
        self.drive("", |m| m.handle_connected(number));
        {
            let mut ledger = self.shared().lock();
            let view = ledger.workers.entry(self.setup.index).or_default();
            view.in_generation = Some(number);
            view.last_formed = number;
        }
        let names: Vec<&str> = members.iter().map(|(w, _)| w.as_str()).collect();
        self.log(format!("generation {number}: rank {rank} of {names:?}, resumes after step {step}"));
        let exit = loop {
            self.paused().await;
            if self.finishing() {
                self.finish().await;
                break Exit::Finished;
            }
            self.drive("", |m| m.set_progress(number, step, "allreduce"));
            let pending = self.read(Membership::reformation_pending);
            let revoked = || {
                self.comm
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .as_ref()
                    .filter(|(g, _)| *g == number)
                    .and_then(|(_, c)| c.clone())
            };
            match ring.step(step + 1, pending, revoked).await {
                Outcome::Done { reform } => {
                    step += 1;
                    self.shared().lock().committed.insert(self.setup.index, step);
                    self.commits.send_replace(Some(pb::CommitRequest {
                        job: JOB.into(),
                        worker_id: self.id.clone(),
                        incarnation,
                        generation: number,
                        step,
                        digest: step.to_le_bytes().to_vec(),
                    }));
                    self.drive("", |m| m.set_progress(number, step, "commit"));
                    if reform {
                        self.log(format!("leaves generation {number} at step {step}: re-formation agreed"));
                        break Exit::Left;
                    }
                    tokio::time::sleep(Duration::from_millis(STEP_MS)).await;
                }
                Outcome::Finishing => {}
                Outcome::Revoked(cause) => {
                    self.log(format!("leaves generation {number}: revoked ({cause})"));
                    break Exit::Left;
                }
                Outcome::Failed(failure) => {
                    let cause = self.on_failure(number, step + 1, failure).await;
                    self.log(format!("leaves generation {number}: {cause}"));
                    break Exit::Left;
                }
            }
        };
        self.shared().lock().workers.entry(self.setup.index).or_default().in_generation = None;
        Ok(exit)
    }

    /// Records generation `number` as this worker was told it: one group per generation.
    fn record_group(&self, number: u64, members: &Group) {
        let known = self.shared().lock().groups.entry(number).or_insert_with(|| members.clone()).clone();
        if known != *members {
            self.shared().violation(now_ms(), format!("two groups for generation {number}: {known:?} and {members:?}"));
        }
    }

    /// Turns a failed step into the generation's root cause, as `FailureReporter::on_failure`
    /// does: a cause already heard, else the answer to a failure report (the machine takes
    /// the local failure as the cause without one).
    async fn on_failure(&self, g: u64, step: u64, failure: Failure) -> RootCause {
        if let Some(cause) = self.read(|m| m.cause_of(g)) {
            return cause;
        }
        let Failure { kind, peer, received } = failure;
        let reason = format!("{} on the link from rank {peer}", kind.as_str_name());
        self.log(format!("step {step} of generation {g} failed: {reason} (received {received})"));
        let request = pb::FailureReport {
            job: JOB.into(),
            worker_id: self.id.clone(),
            incarnation: self.read(Membership::incarnation),
            generation: g,
            failed_rank: Some(peer),
            reason: reason.clone(),
            kind: kind as i32,
            progress: Some(pb::OpProgress { seq: step as u32, received }),
        };
        let wait = self.elastic.root_cause_wait.max(Duration::from_secs(2));
        let answer = match tokio::time::timeout(wait, self.client.report_failure(request)).await {
            Ok(Ok(answer)) => {
                let cause = answer.cause.as_ref().map(|c| format!("rank {:?} {}", c.rank, c.worker_id));
                self.log(format!(
                    "report answered: accepted {}, root cause {}",
                    answer.accepted,
                    cause.unwrap_or_default()
                ));
                Some(answer)
            }
            Ok(Err(e)) => {
                self.log(format!("report failed: {}", short(&e)));
                None
            }
            Err(_) => {
                self.log("report not answered in time");
                None
            }
        };
        let local = RootCause { rank: Some(peer), worker_id: String::new(), host: String::new(), reason };
        self.drive("ReportFailure", |m| m.handle_report(g, answer, local))
    }
}

fn short(e: &impl std::fmt::Display) -> String {
    let s = e.to_string();
    match s.char_indices().nth(120) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

/// Heartbeats every interval as `ElasticGroup`'s task does, until the machine says a newer
/// incarnation took over or the coordinator no longer knows this one.
async fn heartbeat_task(worker: Arc<Worker>, incarnation: u64, interval: Duration) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        worker.paused().await;
        let Some(progress) = worker.read(|m| m.heartbeat_request(incarnation)) else { return };
        let request = pb::HeartbeatRequest {
            job: JOB.into(),
            worker_id: worker.id.clone(),
            incarnation,
            generation: progress.generation,
            step: progress.step,
            activity: progress.activity,
            deadlines: progress.deadlines,
            timing: None,
        };
        let bound = worker.bound(Duration::ZERO);
        let answer = bounded(worker.shared(), &worker.name, "Heartbeat", bound, worker.client.heartbeat(request)).await;
        if let Err(e @ CallError::Failed(_)) = &answer {
            worker.log(format!("heartbeat failed: {}", short(e)));
        }
        if !worker.drive("Heartbeat", |m| m.handle_heartbeat(incarnation, answer)) {
            return;
        }
    }
}

/// Sends the newest commit (a report cut short is superseded by the next one) and hands the
/// answer to the machine.
async fn commit_task(worker: Arc<Worker>, mut commits: tokio::sync::watch::Receiver<Option<pb::CommitRequest>>) {
    while commits.changed().await.is_ok() {
        let Some(request) = commits.borrow_and_update().clone() else { continue };
        let (generation, incarnation) = (request.generation, request.incarnation);
        let bound = worker.bound(Duration::ZERO);
        let answer = bounded(worker.shared(), &worker.name, "Commit", bound, worker.client.commit(request)).await;
        worker.drive("Commit", |m| m.handle_commit(generation, incarnation, answer));
    }
}

/// Follows the job's events as `ElasticGroup`'s watch task does: hands them to the machine,
/// and reopens the stream when it breaks (after the machine's backoff, its jitter drawn from
/// the seed) or the worker joins again.
async fn watch_task(worker: Arc<Worker>) {
    loop {
        // Register for the wake-up before reading the incarnation, so that a join in between
        // is not missed.
        let changed = worker.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let incarnation = worker.read(Membership::incarnation);
        let request = pb::WatchRequest {
            job: JOB.into(),
            worker_id: worker.id.clone(),
            incarnation,
            compact: false,
            quiet: false,
        };
        if let Ok(mut stream) = worker.client.watch(request).await {
            worker.drive("Watch", Membership::handle_watch_opened);
            loop {
                tokio::select! {
                    message = stream.message() => match message {
                        Ok(Some(event)) => {
                            // A stopped process reads nothing: the event waits for it.
                            worker.paused().await;
                            worker.event(event)
                        }
                        Ok(None) | Err(_) => break,
                    },
                    _ = changed.as_mut() => {
                        changed.set(worker.changed.notified());
                        changed.as_mut().enable();
                        if worker.read(|m| m.watch_is_stale(incarnation)) {
                            break;
                        }
                    }
                }
            }
        }
        let entropy: u64 = worker.rng.lock().unwrap_or_else(PoisonError::into_inner).random();
        match worker.drive("Watch", |m| m.handle_watch_lost(incarnation, now(), entropy)) {
            WatchNext::Stop => return,
            WatchNext::ReopenAt(at) => tokio::time::sleep_until(at.into()).await,
        }
    }
}

impl Worker {
    /// One event from the job's stream; a revocation heard for the first time is traced and
    /// recorded for the convergence check.
    fn event(&self, event: pb::JobEvent) {
        use pb::job_event::Event;
        if let Some(Event::GenerationRevoked(r)) = &event.event {
            if self.read(|m| m.cause_of(r.generation)).is_none() {
                let cause = r
                    .cause
                    .as_ref()
                    .map(|c| format!("root cause rank {:?} {}: {}", c.rank, c.worker_id, c.reason))
                    .unwrap_or_default();
                self.log(format!("hears: generation {} revoked, {cause}", r.generation));
                self.shared().lock().revoked.entry(r.generation).or_insert_with(now_ms);
            }
        }
        self.drive("Watch", |m| m.handle_event(event));
    }
}
