//! A simulated worker: the shipped worker, [`ElasticGroup`], over the simulated network. Only
//! the seams differ from production's: its coordinator client dials through turmoil
//! ([`crate::net::Connector`]), its data plane is the simulation's modelled ring
//! ([`SimPlane`], [`crate::ring`]), and its [`World`] ([`SimWorld`]) holds the process while a
//! fault stops it (SIGSTOP), draws randomness from the seed, puts the host relays' sockets in
//! its host's simulated namespace ([`crate::relay`]) and records what the invariants observe
//! in the [`crate::ledger::Ledger`]. The clock is tokio's, which turmoil drives.
//!
//! Around the group, this module is what `cohort-worker train` is around it: the training loop
//! (a step on the modelled ring, a commit report, a re-formation at a commit point or after a
//! failure) and the driver's request to finish (a member leaves FINISHED at its next step, a
//! worker between generations at once, as `cohort-worker train` does at its last step or on
//! SIGTERM). Crashes drop the whole process, group included; a restart is a new process.

use crate::ledger::{now_ms, Shared};
use crate::net::{Connector, GRPC_PORT};
use crate::relay::{HostSockets, SimRelayNet};
use crate::ring::{Failure, Outcome, Ring};
use cohort::control::{ControlClient, ControlConfig, ControlError, RelayNet};
use cohort::elastic::{
    call_bound, Connected, DataPlane, ElasticConfig, ElasticError, ElasticGroup, Formed, Generation, JobId, MeshKind,
    Observed, PreviousView, WorkerId, World,
};
use cohort::{CommError, OpProgress, RootCause};
use cohort_proto::v1 as pb;
use cohort_proto::v1::failure_report::FailureKind;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// The job every worker joins.
pub(crate) const JOB: &str = "simjob";
/// How long a worker computes between two steps, at least.
const STEP_MS: u64 = 20;

/// How long a worker computes between two steps in a job of `workers`: 20 ms, and 1 ms more
/// per 5 workers beyond 100 (205 ms at 1,024), as steps take longer in larger jobs. Each
/// step's commit report is a coordinator call per worker, so this also keeps the control
/// plane's load per worker what a real job's is.
pub(crate) fn step_time(workers: usize) -> Duration {
    Duration::from_millis(STEP_MS.max(workers as u64 / 5))
}
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
    /// How long it computes between two steps ([`step_time`]).
    pub(crate) step: Duration,
    /// Its host's socket namespace, where the host relays bind ([`crate::relay`]).
    pub(crate) sockets: HostSockets,
}

/// The worker id of worker `index`.
pub(crate) fn worker_id(index: usize) -> String {
    format!("w{index}")
}

/// How the worker's time in a generation ended.
enum Exit {
    /// It left the generation (revoked, failed, or re-formed at a commit point).
    Left,
    /// The driver asked it to finish.
    Finish,
}

/// An eviction this worker heard, judged when it has joined again: a job that ended evicts
/// its members too, and then the join is refused instead.
struct Eviction {
    at_ms: u64,
    rpc: &'static str,
    finishing: bool,
}

/// The simulated process around its group: what the invariants observe of it.
struct SimWorld {
    setup: Arc<WorkerSetup>,
    name: String,
    eviction: Mutex<Option<Eviction>>,
    rng: Mutex<StdRng>,
}

impl SimWorld {
    fn shared(&self) -> &Shared {
        &self.setup.shared
    }

    fn log(&self, event: impl AsRef<str>) {
        self.shared().log(&self.name, event);
    }

    fn paused(&self) -> bool {
        self.shared().lock().paused.contains(&self.setup.index)
    }

    fn finishing(&self) -> bool {
        self.shared().lock().finish
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
}

impl World for SimWorld {
    fn held(&self) -> Option<Pin<Box<dyn Future<Output = ()> + Send + '_>>> {
        self.paused().then(|| Box::pin(stopped_while_paused(self.shared(), self.setup.index)) as _)
    }

    fn entropy(&self) -> u64 {
        self.rng.lock().unwrap_or_else(PoisonError::into_inner).random()
    }

    fn relay_net(&self) -> Arc<dyn RelayNet> {
        let setup = &self.setup;
        let seed = setup.seed ^ (0x5e1a_u64 << 20) ^ setup.index as u64;
        Arc::new(SimRelayNet::new(setup.sockets.clone(), setup.shared.clone(), setup.index, self.name.clone(), seed))
    }

    fn observe(&self, seen: Observed<'_>) {
        let index = self.setup.index;
        match seen {
            Observed::Joining => {
                let until = self.shared().lock().workers.get(&index).map_or(0, |v| v.excluded_until);
                if now_ms() < until {
                    let what = format!(
                        "{} asked to join before the end of its exclusion at {until} ms (an excluded worker waits it out)",
                        self.name
                    );
                    self.shared().violation(now_ms(), what);
                }
            }
            Observed::JoinRefused { error, excluded_for } => {
                if let Some(left) = excluded_for {
                    self.log(format!("join refused: excluded for {} ms", left.as_millis()));
                    let until = now_ms() + left.as_millis() as u64;
                    self.shared().lock().workers.entry(index).or_default().excluded_until = until;
                } else {
                    self.log(format!("join refused: {}", short(error)));
                }
            }
            Observed::Joined { incarnation } => {
                self.shared().lock().workers.entry(index).or_default().incarnation = incarnation;
                self.log(format!("joined as incarnation {incarnation}"));
                self.judge_eviction();
            }
            Observed::Evicted { rpc } => {
                self.log(format!("evicted ({rpc}: NOT_FOUND)"));
                let finishing = self.finishing();
                *self.eviction.lock().unwrap_or_else(PoisonError::into_inner) =
                    Some(Eviction { at_ms: now_ms(), rpc, finishing });
            }
            Observed::JobEnded { outcome, reason } => {
                let outcome = outcome.to_uppercase();
                self.log(format!("hears: job ended {outcome} ({reason})"));
                self.shared().lock().workers.entry(index).or_default().ended = Some((now_ms(), outcome));
            }
            Observed::RevocationHeard { generation, cause } => {
                let cause = cause
                    .map(|c| format!("root cause rank {:?} {}: {}", c.rank, c.worker_id, c.reason))
                    .unwrap_or_default();
                self.log(format!("hears: generation {generation} revoked, {cause}"));
                self.shared().lock().revoked.entry(generation).or_insert_with(now_ms);
            }
            Observed::Waiting(w) => self.log(format!("waiting: {} waiting, min {}", w.waiting_members, w.min_workers)),
            Observed::CallFailed { rpc, error } => self.log(format!("{rpc} failed: {}", short(error))),
            Observed::Overran { rpc, bound } => self.shared().violation(
                now_ms(),
                format!("{}: {rpc} did not return within {bound:?} (nothing waits forever)", self.name),
            ),
            Observed::Reported(Some(answer)) => {
                let cause = answer.cause.as_ref().map(|c| format!("rank {:?} {}", c.rank, c.worker_id));
                self.log(format!(
                    "report answered: accepted {}, root cause {}",
                    answer.accepted,
                    cause.unwrap_or_default()
                ))
            }
            Observed::Reported(None) => self.log("report failed or not answered in time"),
            _ => {}
        }
    }
}

/// The simulation's data plane: publishes its host's address on the simulated network (an IP
/// literal, as a pod's), which nobody dials, and connects a generation as a rank of the
/// modelled ring ([`crate::ring`]). A rank of a ring links its neighbours: its predecessor's
/// entry comes from its view, or is asked of the coordinator on first use when a sparse view
/// lacks it, as the socket plane resolves a peer. The incoming link is carried over from the
/// last generation this process connected when the shipped decision ([`PreviousView`], as
/// production's socket plane takes it) says so: then it reaches whoever held the old rank it
/// is carried from, which the ring checks is the process its view names now.
struct SimPlane {
    /// The published TCP address.
    address: String,
    worker_id: String,
    /// The last generation this process connected.
    previous: Option<PreviousView>,
}

/// One rank's modelled communicator: where its incoming link comes from, and the cause it was
/// revoked with (the membership's `Abort`).
struct SimComm {
    /// The far end of the incoming link: the predecessor's worker id and incarnation as this
    /// rank's view names it, or, for a carried link, the member that held the old rank.
    pred: (String, u64),
    /// The carried link's generation and rank there, if the incoming link was carried over.
    carried_from: Option<(u64, u32)>,
    revoked: Arc<Mutex<Option<RootCause>>>,
}

impl DataPlane for SimPlane {
    type Comm = SimComm;

    fn published(&self) -> (Vec<pb::TransportAddress>, Vec<String>) {
        let tcp = pb::TransportAddress { transport: "tcp".into(), address: self.address.clone() };
        (vec![tcp], vec!["transport:tcp".into()])
    }

    async fn connect(&mut self, formed: Formed<'_>) -> Result<Option<Connected<SimComm>>, ElasticError> {
        let members = formed.members;
        let n = members.size();
        let pred_rank = (formed.rank + n - 1) % n;
        let pred = match members.get(pred_rank) {
            Some(m) => (m.worker_id.clone(), members.incarnation_of(pred_rank).unwrap_or(0)),
            None => {
                let question = pb::MembersRequest {
                    job: JOB.into(),
                    worker_id: self.worker_id.clone(),
                    incarnation: formed.incarnation,
                    generation: formed.generation.number,
                    ranks: vec![pred_rank],
                    host: String::new(),
                };
                match formed.client.fetch_members(question, formed.generation.members_digest).await {
                    Ok(fetched) => match fetched.into_iter().find(|m| m.rank == pred_rank) {
                        Some(m) => (m.worker_id, m.incarnation),
                        None => {
                            return Err(ElasticError::Protocol(format!(
                                "rank {pred_rank} missing from a Members answer"
                            )))
                        }
                    },
                    // The generation changed meanwhile: rendezvous again.
                    Err(ControlError::Rejected {
                        code: tonic::Code::FailedPrecondition | tonic::Code::NotFound,
                        ..
                    }) => return Ok(None),
                    Err(e) => return Err(e.into()),
                }
            }
        };
        // Production carries the links to every planned peer; the model's ring has one
        // incoming link, so it asks the same question for that one.
        let carried = self.previous.as_ref().and_then(|previous| {
            let (_, old_rank) =
                previous.carry_into(formed.generation.number, &members, formed.incarnation, [pred_rank]).pop()?;
            let (worker_id, incarnation) = previous.member_at(old_rank)?;
            Some(((worker_id.to_owned(), incarnation), (previous.number(), old_rank)))
        });
        let (pred, carried_from) = match carried {
            Some((far_end, from)) => (far_end, Some(from)),
            None => (pred, None),
        };
        self.previous = Some(PreviousView::of(formed.generation.number, formed.incarnation, &members));
        let revoked = Arc::new(Mutex::new(None));
        let slot = Arc::clone(&revoked);
        let revoke = Arc::new(move |cause: RootCause| {
            let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
            slot.get_or_insert(cause);
        });
        Ok(Some(Connected { comm: SimComm { pred, carried_from, revoked }, revoke, members, transport: MeshKind::Tcp }))
    }
}

/// Waits while the worker is paused (SIGSTOP), looking every 10 ms of simulated time.
pub(crate) async fn stopped_while_paused(shared: &Shared, index: usize) {
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
    let mut control =
        ControlConfig::new((0..setup.replicas).map(|r| format!("http://replica-{r}:{GRPC_PORT}")).collect());
    control.retry_jitter = 0.0;
    control.first_endpoint = Some(setup.index % setup.replicas);
    let client = ControlClient::with_connector(control.clone(), |e| e.connect_with_connector_lazy(Connector))?;
    let mut config = ElasticConfig::new(JobId::new(JOB)?, WorkerId::new(worker_id(setup.index))?, control);
    config.host = setup.host.clone();
    config.domain = String::new();
    // Production's default, set here so that no environment changes a seed's run: the host's
    // workers share its heartbeat and event relays (a host of one worker serves itself).
    config.heartbeat_relay = true;
    // The simulated host's sockets, not a directory of this machine's.
    config.relay_dir = None;
    let name = format!("worker-{}", setup.index);
    let world = Arc::new(SimWorld {
        name: name.clone(),
        eviction: Mutex::new(None),
        rng: Mutex::new(StdRng::seed_from_u64(setup.seed ^ (0x3a7c_u64 << 16) ^ setup.index as u64)),
        setup: Arc::clone(&setup),
    });
    {
        let mut ledger = setup.shared.lock();
        let view = ledger.workers.entry(setup.index).or_default();
        view.up = true;
        view.incarnation = 0;
        view.in_generation = None;
        view.last_formed = 0;
        view.excluded_until = 0;
    }
    world.log("process starts");
    let driver = Driver { world: Arc::clone(&world), client: client.clone() };
    if let Err(e) = driver.process(config, client).await {
        if let ElasticError::Protocol(_) = e {
            setup.shared.violation(now_ms(), format!("{name}: coordinator protocol violation: {e}"));
        }
        world.log(format!("exits: {e}"));
        // A join refused with FAILED_PRECONDITION, not an exclusion, is the coordinator saying
        // that the job is over: the worker learnt it then (with the outcome its status gives).
        if let ElasticError::Control(ControlError::Rejected {
            rpc: "Join",
            code: tonic::Code::FailedPrecondition,
            ..
        }) = e
        {
            driver.heard_end_at_join().await;
        }
    }
    // The process ends: its group (and with it every task of the group) is gone.
    Ok(())
}

/// The training loop around a simulated worker's group.
struct Driver {
    world: Arc<SimWorld>,
    /// A client of the process's own, for the job's status after a refused join.
    client: ControlClient,
}

impl Driver {
    fn shared(&self) -> &Shared {
        self.world.shared()
    }

    fn index(&self) -> usize {
        self.world.setup.index
    }

    async fn paused(&self) {
        stopped_while_paused(self.shared(), self.index()).await;
    }

    /// Joins, then re-forms (and joins again after an eviction) until the job ends for this
    /// worker (an error) or it finishes.
    async fn process(&self, config: ElasticConfig, client: ControlClient) -> Result<(), ElasticError> {
        let plane = SimPlane {
            address: format!("{}:7200", turmoil::lookup(self.world.setup.host.as_str())),
            worker_id: worker_id(self.index()),
            previous: None,
        };
        let world: Arc<dyn World> = self.world.clone();
        let mut group = tokio::select! {
            joined = ElasticGroup::join_with(config, client, plane, world) => joined?,
            // Asked to finish while waiting out an exclusion: nothing to leave.
            () = asked_to_finish(self.shared()) => {
                self.finished();
                return Ok(());
            }
        };
        loop {
            self.paused().await;
            if self.world.finishing() {
                return self.finish(group).await;
            }
            let generation = tokio::select! {
                formed = group.next_generation() => formed?,
                // Between generations (a rendezvous, a backoff, a join): finish at once.
                () = asked_to_finish(self.shared()) => continue,
            };
            if let Exit::Finish = self.generation(&group, generation).await {
                return self.finish(group).await;
            }
        }
    }

    /// Its join was refused because the job is over: records the job's end, as its status
    /// gives it, at this time.
    async fn heard_end_at_join(&self) {
        let at_ms = now_ms();
        let bound = call_bound(self.client.config(), Duration::ZERO);
        let status = self.client.status(pb::StatusRequest { job: JOB.into() });
        let Ok(Ok(pb::StatusResponse { ended: Some(ended), .. })) = tokio::time::timeout(bound, status).await else {
            return;
        };
        let failed = ended.outcome == pb::job_ended::Outcome::Failed as i32;
        let outcome = if failed { "FAILED" } else { "FINISHED" };
        self.world.log(format!("hears (its join refused): job ended {outcome} ({})", ended.reason));
        self.shared().lock().workers.entry(self.index()).or_default().ended = Some((at_ms, outcome.into()));
    }

    /// Leaves with FINISHED and records it.
    async fn finish(&self, group: ElasticGroup<SimPlane>) -> Result<(), ElasticError> {
        if let Err(e) = group.leave(true).await {
            self.world.log(format!("leave failed: {}", short(&e)));
        }
        self.finished();
        Ok(())
    }

    fn finished(&self) {
        self.world.log("leaves: finished");
        let mut ledger = self.shared().lock();
        let view = ledger.workers.entry(self.index()).or_default();
        view.finished = true;
        view.in_generation = None;
    }

    /// Works in connected generation `g` until it is left or the worker is asked to finish, as
    /// `cohort-worker train` does: a sync first (the step to resume after), then steps.
    async fn generation(&self, group: &ElasticGroup<SimPlane>, g: Generation<SimComm>) -> Exit {
        let (number, rank, comm) = (g.number, g.rank, &g.comm);
        let index = self.index();
        self.record_view(number, rank, group.incarnation(), &g.members);
        let ring = Ring {
            shared: self.shared(),
            index,
            generation: number,
            size: g.members.size(),
            rank,
            pred: &comm.pred,
            carried_from: comm.carried_from,
            no_progress: self.world.setup.no_progress,
        };
        {
            let mut ledger = self.shared().lock();
            let view = ledger.workers.entry(index).or_default();
            view.in_generation = Some(number);
            view.last_formed = number;
        }
        let (size, known) = (g.members.size(), g.members.known().len());
        let carried = match comm.carried_from {
            Some((g, r)) => format!(", its link carried from rank {r} of generation {g}"),
            None => String::new(),
        };
        self.world
            .log(format!("generation {number}: rank {rank} of {size} (knows {known}), after {:?}{carried}", comm.pred));
        // The step done last; `None` until the sync.
        let mut step: Option<u64> = None;
        let exit = loop {
            self.paused().await;
            if self.world.finishing() {
                break Exit::Finish;
            }
            let at = step.unwrap_or(0);
            group.set_progress(number, at, if step.is_some() { "allreduce" } else { "sync" });
            let pending = step.is_some() && group.reformation_pending();
            let revoked = || comm.revoked.lock().unwrap_or_else(PoisonError::into_inner).clone();
            let next = step.map_or(0, |s| s + 1);
            match ring.step(next, pending, revoked).await {
                Outcome::Done { .. } if step.is_none() => {
                    let resumed = ring.resumed();
                    self.world.log(format!("generation {number}: resumes after step {resumed}"));
                    step = Some(resumed);
                }
                Outcome::Done { reform } => {
                    step = Some(next);
                    self.shared().lock().committed.insert(index, next);
                    group.commit(number, next, &next.to_le_bytes());
                    group.set_progress(number, next, "commit");
                    if reform {
                        self.world.log(format!("leaves generation {number} at step {next}: re-formation agreed"));
                        break Exit::Left;
                    }
                    tokio::time::sleep(self.world.setup.step).await;
                }
                Outcome::Finishing => {}
                Outcome::Revoked(cause) => {
                    self.world.log(format!("leaves generation {number}: revoked ({cause})"));
                    break Exit::Left;
                }
                Outcome::Failed(failure) => {
                    let error = self.failed_step(next, failure);
                    self.world.log(format!("step {next} of generation {number} failed: {error}"));
                    let cause = group.on_failure(number, &error).await;
                    self.world.log(format!("leaves generation {number}: {cause}"));
                    break Exit::Left;
                }
            }
        };
        self.shared().lock().workers.entry(index).or_default().in_generation = None;
        exit
    }

    /// A failure the modelled ring detected, as the real communicator reports it.
    fn failed_step(&self, step: u64, failure: Failure) -> CommError {
        let Failure { kind, peer, received } = failure;
        match kind {
            FailureKind::Timeout => CommError::Timeout {
                rank: Some(peer),
                after: self.world.setup.no_progress,
                progress: Some(OpProgress { seq: step as u32, received }),
                silence: cohort_transports::Silence::Unprobed,
            },
            _ => CommError::PeerFailed { rank: peer, detail: format!("{} (received {received})", kind.as_str_name()) },
        }
    }

    /// Records generation `number` as this worker was told it, and places this worker at
    /// `rank`. Every view must agree: one size and host layout per generation, one member per
    /// rank, whoever was told it (whole or sparse), and one process per rank.
    fn record_view(&self, number: u64, rank: u32, incarnation: u64, view: &cohort::elastic::Members) {
        let mut problems = Vec::new();
        {
            let mut ledger = self.shared().lock();
            let record = ledger.generations.entry(number).or_default();
            let shape = (view.size(), view.layout());
            match &record.shape {
                None => record.shape = Some(shape),
                Some(known) if *known != shape => problems.push(format!(
                    "two shapes of generation {number}: size {} with {:?}, and size {} with {:?} (worker-{})",
                    known.0,
                    known.1,
                    shape.0,
                    shape.1,
                    self.index()
                )),
                Some(_) => {}
            }
            for m in view.iter() {
                let entry = (m.worker_id.clone(), view.incarnation_of(m.rank).unwrap_or(0));
                let known = record.told.entry(m.rank).or_insert_with(|| entry.clone());
                if *known != entry {
                    problems.push(format!(
                        "two members at rank {} of generation {number}: {known:?}, and {entry:?} in worker-{}'s view",
                        m.rank,
                        self.index()
                    ));
                }
            }
            let me = (self.index(), incarnation);
            if let Some(other) = record.placed.insert(rank, me).filter(|other| *other != me) {
                problems.push(format!("two processes at rank {rank} of generation {number}: {other:?} and {me:?}"));
            }
        }
        for p in problems {
            self.shared().violation(now_ms(), p);
        }
    }
}

fn short(e: &dyn std::fmt::Display) -> String {
    let s = e.to_string();
    match s.char_indices().nth(120) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}
