//! [`ElasticGroup`]: membership, re-formation and failure handling for one worker.

use super::choice::{upfront_ranks, MeshPlan};
use super::connect::{connect_planned, Carry, LocalEndpoints, MeshScope};
use super::members::Members;
use super::membership::{CallError, Effect, JoinNext, Membership, Step, WatchNext};
use super::plan::plan_view;
use super::resolve::CoordinatorResolver;
use super::{ElasticConfig, ElasticError, MeshKind, MeshTransport, TransportChoice};
use crate::control::{
    ControlClient, ControlError, EventRelay, HostRelay, RelayEvents, FULL_AFTER_FAILURE, RESUBSCRIBE_WINDOW,
};
use crate::{CommConfig, CommError, Communicator, Revoker, RootCause};
use cohort_proto::v1 as pb;
use cohort_transports::shm::ShmEndpoint;
use cohort_transports::tcp::{TcpEndpoint, Upfront};
use cohort_transports::{Transport, TransportError};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tracing::{debug, info, info_span, warn, Instrument};

/// A formed generation and the communicator connected for it.
pub struct Generation {
    /// Generation number (strictly increasing over the job's life).
    pub number: u64,
    /// The members this worker knows, by rank: every one in a generation answered whole (up
    /// to the job's `whole_answer_up_to`, default 256), else its partners and host-mates
    /// (see [`Members`]).
    pub members: Members,
    /// The communicator over this generation's mesh.
    pub comm: Communicator<MeshTransport>,
    /// The transport of this rank's links in this generation (`shm+tcp` on a rank that has
    /// peers on its host and elsewhere, `tcp` on a rank alone on its host in the same
    /// generation).
    pub transport: MeshKind,
    /// When the coordinator formed it (ms since the Unix epoch).
    pub formed_at_ms: u64,
}

/// Why the members leave a healthy generation at a commit point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReformReason {
    /// Joiners are waiting (scale-up).
    ScaleUp,
    /// A member is leaving gracefully (SIGTERM, scale-down).
    Leave,
}

/// The gRPC client's errors, as the membership machine tells them apart: NOT_FOUND is the
/// coordinator saying it no longer knows the incarnation that called; the client's typed
/// refusals of a join (excluded, worker id in use) keep their time to come back.
impl From<ControlError> for CallError {
    fn from(e: ControlError) -> Self {
        match e {
            ControlError::Excluded { message, retry_after } => CallError::Excluded { message, retry_after },
            ControlError::IdInUse { message, retry_after } => CallError::IdInUse { message, retry_after },
            e if e.code() == Some(tonic::Code::NotFound) => CallError::NotMember(e),
            e => CallError::Failed(e),
        }
    }
}

/// The membership machine, shared with the background tasks, and what its effects act on.
/// Every decision is the machine's ([`Membership`]); this shell performs the calls it needs
/// and the [`Effect`]s it queues.
struct Shared {
    machine: Mutex<Membership>,
    /// The current generation's number and its communicator's revoker ([`Effect::Abort`]).
    revoker: Mutex<Option<(u64, Revoker)>>,
    /// Woken on [`Effect::Wake`]: by revocations, the job's end and a new incarnation.
    changed: Notify,
    /// Step times since the last heartbeat ([`ElasticGroup::record_step`]), sent with it.
    timing: Mutex<super::StepTimes>,
}

impl Shared {
    /// The shell of a worker that has not joined yet.
    fn new(exclusion_wait: Duration) -> Self {
        Shared {
            machine: Mutex::new(Membership::new(exclusion_wait)),
            revoker: Mutex::new(None),
            changed: Notify::new(),
            timing: Mutex::new(super::StepTimes::default()),
        }
    }

    /// Feeds one input to the machine, then performs the effects it queued (outside the
    /// machine's lock: aborting a transport runs its abort hook).
    fn drive<T>(&self, input: impl FnOnce(&mut Membership) -> T) -> T {
        let (output, effects) = {
            let mut machine = self.machine.lock().unwrap_or_else(|e| e.into_inner());
            let output = input(&mut machine);
            (output, std::iter::from_fn(|| machine.poll_effect()).collect::<Vec<_>>())
        };
        for effect in effects {
            match effect {
                Effect::Abort { generation, cause } => {
                    let current = self.revoker.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    if let Some((g, revoker)) = current {
                        if g == generation {
                            revoker.revoke(cause);
                        }
                    }
                }
                Effect::Wake => self.changed.notify_waiters(),
            }
        }
        output
    }

    /// Reads the machine's state.
    fn read<T>(&self, query: impl FnOnce(&Membership) -> T) -> T {
        query(&self.machine.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// A worker's membership in an elastic job.
///
/// Dropping it stops the heartbeat and watch tasks (the coordinator then expires the
/// membership with its lease); call [`ElasticGroup::leave`] to leave promptly.
pub struct ElasticGroup {
    config: ElasticConfig,
    client: ControlClient,
    endpoint: TcpEndpoint,
    advertised: String,
    /// The shared-memory identity published at join (`None`: TCP or RDMA only).
    shm: Option<ShmEndpoint>,
    /// The RDMA endpoint (when configured), kept across generations like the TCP listener.
    #[cfg(feature = "rdma")]
    rdma: Option<cohort_transports::rdma::RdmaEndpoint>,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
    heartbeat_interval: Duration,
    /// The newest commit report, sent by the commit task (older unsent ones are superseded).
    commits: tokio::sync::watch::Sender<Option<pb::CommitRequest>>,
    /// The last generation connected, whose TCP links the next one may carry over.
    previous: Option<Previous>,
    /// The host's heartbeat relay path (with [`ElasticConfig::heartbeat_relay`]), made at the
    /// first join (the interval comes with it).
    relay: Option<HostRelay>,
}

/// A generation this worker connected, kept until the next one takes what it can of its links
/// (incremental re-formation).
struct Previous {
    number: u64,
    /// This worker's incarnation in it: a worker that joined again carries nothing over.
    incarnation: u64,
    /// Each member's incarnation and rank, by worker id.
    ranks: HashMap<String, (u64, u32)>,
    mesh: Arc<MeshTransport>,
}

impl Previous {
    /// The links of this generation that the next one, `generation` (this worker's rank
    /// `rank`, under `plan`), links again at set-up: the old link to each planned peer that
    /// was a member here too, if both ends are clean. The other links are shut down.
    fn carry_into(
        self,
        number: u64,
        members: &Members,
        incarnation: u64,
        rank: u32,
        plan: &MeshPlan,
    ) -> Vec<(u32, cohort_transports::tcp::CarriedLink)> {
        let Some(old) = self.mesh.carry_over() else { return Vec::new() };
        if self.incarnation != incarnation || self.number >= number {
            return Vec::new();
        }
        let world = members.size();
        let planned: Vec<u32> = match plan {
            MeshPlan::Tcp { upfront, .. } | MeshPlan::Mixed { upfront, .. } => match upfront {
                Upfront::Every => (0..world).filter(|&p| p != rank).collect(),
                Upfront::Only(peers) => peers.clone(),
            },
            _ => Vec::new(),
        };
        planned
            .into_iter()
            .filter_map(|p| {
                let m = members.get(p)?;
                let peer_incarnation = members.incarnation_of(p)?;
                let &(_, old_rank) = self.ranks.get(&m.worker_id).filter(|(inc, _)| *inc == peer_incarnation)?;
                Some((p, old.take(old_rank, number)?))
            })
            .collect()
    }
}

impl Drop for ElasticGroup {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl ElasticGroup {
    /// Binds the data-plane listener, opens the shared-memory endpoint and, with
    /// [`TransportChoice::Rdma`], the RDMA endpoint (failing at once, before joining, when its
    /// device cannot be opened, or with [`ElasticError::TransportUnavailable`] in a build
    /// without the `rdma` feature), joins the job and starts the heartbeat and watch tasks. An
    /// excluded worker waits out its exclusion first (at most [`ElasticConfig::exclusion_wait`],
    /// else [`ElasticError::Excluded`]).
    ///
    /// # Cancel safety
    /// Cancel safe: a join left half done expires with its lease.
    pub async fn join(mut config: ElasticConfig) -> Result<Self, ElasticError> {
        cohort_proto::ids::check_id("job", &config.job)?;
        cohort_proto::ids::check_id("worker_id", &config.worker_id)?;
        #[cfg(not(feature = "rdma"))]
        if config.transport == TransportChoice::Rdma {
            return Err(super::TransportUnavailable::RdmaNotBuilt.into());
        }
        // The data plane is keyed by the job's credential, whether this worker was given it
        // or the operator secret it derives from; another job's credential stops here.
        config.token = cohort_proto::credentials::data_plane_secret(&config.token, &config.job)?;
        let client = ControlClient::new(config.control.clone())?;
        let endpoint = TcpEndpoint::bind(config.listen, config.tcp.clone()).await?;
        let port = endpoint.local_addr().port();
        let advertised = advertised_address(&config.advertise, port);
        let shm = if config.transport.publishes_shm() { Some(ShmEndpoint::new(config.shm.clone())?) } else { None };
        #[cfg(feature = "rdma")]
        let rdma = match config.transport {
            TransportChoice::Rdma => Some(open_rdma(&config.rdma, config.listen, &advertised).await?),
            _ => None,
        };
        let shared = Arc::new(Shared::new(config.exclusion_wait));
        let mut group = Self {
            config,
            client,
            endpoint,
            advertised,
            shm,
            #[cfg(feature = "rdma")]
            rdma,
            shared,
            tasks: Vec::new(),
            heartbeat_interval: Duration::from_millis(500),
            commits: tokio::sync::watch::channel(None).0,
            previous: None,
            relay: None,
        };
        group.register().await?;
        group.tasks.push(tokio::spawn(commit_task(
            group.client.clone(),
            group.shared.clone(),
            group.commits.subscribe(),
        )));
        let events = if group.config.heartbeat_relay {
            let (client, config) = (group.client.clone(), &group.config);
            EventRelay::new(client, &config.job, &config.worker_id, &config.host)
                .map_err(|e| warn!(error = %e, "no event relay; this worker watches alone"))
                .ok()
        } else {
            None
        };
        group.tasks.push(tokio::spawn(watch_task(
            group.client.clone(),
            group.shared.clone(),
            group.config.job.clone(),
            group.config.worker_id.clone(),
            events,
        )));
        Ok(group)
    }

    /// One Join: a new incarnation; (re)starts the heartbeat task for it. An excluded worker
    /// (its failures repeated) waits out its exclusion, as long as the coordinator says it
    /// has left, and asks again: in all at most [`ElasticConfig::exclusion_wait`], after
    /// which it fails with [`ElasticError::Excluded`].
    async fn register(&mut self) -> Result<(), ElasticError> {
        let mut addresses =
            vec![pb::TransportAddress { transport: MeshKind::Tcp.name().into(), address: self.advertised.clone() }];
        let mut capabilities = vec![format!("transport:{}", MeshKind::Tcp)];
        if let Some(rdma) = self.rdma_address() {
            addresses.push(pb::TransportAddress { transport: MeshKind::Rdma.name().into(), address: rdma });
            capabilities.push(format!("transport:{}", MeshKind::Rdma));
        }
        if let Some(shm) = &self.shm {
            addresses
                .push(pb::TransportAddress { transport: MeshKind::Shm.name().into(), address: shm.address().encode() });
            capabilities.push(format!("transport:{}", MeshKind::Shm));
        }
        let request = pb::JoinRequest {
            job: self.config.job.clone(),
            worker_id: self.config.worker_id.clone(),
            host: self.config.host.clone(),
            addresses,
            capabilities,
            protocol_version: cohort_proto::PROTOCOL_VERSION,
            domain: self.config.domain.clone(),
            // The incarnation this process held (0 before its first join): its own re-join
            // replaces it, where another process's join for the id is refused.
            replaces: self.incarnation(),
        };
        self.shared.drive(|m| m.begin_join(Instant::now()));
        let (incarnation, heartbeat_interval, lease_ttl) = loop {
            let answer = self.client.join(request.clone()).await.map_err(CallError::from);
            match self.shared.drive(|m| m.handle_join(Instant::now(), answer))? {
                JoinNext::Joined { incarnation, heartbeat_interval, lease_ttl } => {
                    break (incarnation, heartbeat_interval, lease_ttl)
                }
                JoinNext::RetryAt(at) => tokio::time::sleep_until(at.into()).await,
            }
        };
        self.heartbeat_interval = heartbeat_interval;
        info!(job = %self.config.job, worker = %self.config.worker_id, incarnation,
              address = %self.advertised, "joined");
        self.relay = self.relay.take().filter(|r| r.interval() == heartbeat_interval);
        if self.config.heartbeat_relay && self.relay.is_none() {
            let (job, host) = (&self.config.job, &self.config.host);
            self.relay = match HostRelay::new(self.client.clone(), job, host, heartbeat_interval, lease_ttl) {
                Ok(relay) => relay,
                Err(e) => {
                    warn!(error = %e, "no heartbeat relay; heartbeats go directly");
                    None
                }
            };
        }
        // An older incarnation's heartbeat task stops by itself (it sees the new incarnation).
        let heartbeat = tokio::spawn(heartbeat_task(
            self.client.clone(),
            self.relay.clone(),
            self.shared.clone(),
            self.config.job.clone(),
            self.config.worker_id.clone(),
            incarnation,
            self.heartbeat_interval,
        ));
        self.tasks.retain(|task| !task.is_finished());
        self.tasks.push(heartbeat);
        Ok(())
    }

    /// The job id.
    pub fn job(&self) -> &str {
        &self.config.job
    }

    /// This worker's data-plane address as peers see it.
    pub fn advertised_address(&self) -> &str {
        &self.advertised
    }

    /// This worker's encoded RDMA endpoint address, as published at join (`None` without an
    /// RDMA endpoint).
    pub fn rdma_address(&self) -> Option<String> {
        #[cfg(feature = "rdma")]
        if let Some(endpoint) = &self.rdma {
            return Some(endpoint.address().encode());
        }
        None
    }

    /// The address the data-plane listener is bound to (differs from
    /// [`ElasticGroup::advertised_address`] behind NAT, a proxy or a wildcard bind).
    pub fn listen_address(&self) -> SocketAddr {
        self.endpoint.local_addr()
    }

    /// The current incarnation (changes when the worker had to join again).
    pub fn incarnation(&self) -> u64 {
        self.shared.read(Membership::incarnation)
    }

    /// The coordinator client (for status queries).
    pub fn client(&self) -> &ControlClient {
        &self.client
    }

    /// Records what this worker is doing; sent with the next heartbeat (for `status`).
    pub fn set_progress(&self, generation: u64, step: u64, activity: &str) {
        self.shared.drive(|m| m.set_progress(generation, step, activity));
    }

    /// Records the no-progress deadline in force on this worker's links, in brief; sent
    /// with the next heartbeat (for `status`).
    pub fn set_deadlines(&self, brief: &str) {
        self.shared.drive(|m| m.set_deadlines(brief));
    }

    /// Records one step's time outside and inside collectives, and the wait on each peer's
    /// link now; their means are sent with the next heartbeat (straggler detection).
    pub fn record_step(&self, compute: Duration, collective: Duration, peer_waits: Vec<(u32, Duration)>) {
        self.shared.timing.lock().unwrap_or_else(|e| e.into_inner()).record(compute, collective, peer_waits);
    }

    /// Why the coordinator asked this member to leave as a straggler (job policy
    /// `exclude`), if it did: it should leave gracefully at its next commit point.
    pub fn straggler_leave(&self) -> Option<String> {
        self.shared.read(|m| m.straggler_leave().map(str::to_string))
    }

    /// Waits for the next generation that includes this worker and connects its mesh.
    ///
    /// This is re-formation in one call: after a failure (or at a commit point where a
    /// re-formation was agreed) it returns the next generation's communicator. Errors only
    /// when the job ends, the coordinator is unreachable for the whole retry budget, or this
    /// worker, evicted and joining again, stays excluded longer than
    /// [`ElasticConfig::exclusion_wait`].
    ///
    /// # Cancel safety
    /// Cancel safe: calling it again resumes the rendezvous.
    pub async fn next_generation(&mut self) -> Result<Generation, ElasticError> {
        loop {
            let (incarnation, after_generation) = match self.shared.drive(Membership::next_step)? {
                Step::Join => {
                    // Evicted again before a generation connected: back off (an eviction
                    // loop, e.g. against another process with this worker id, must not spin).
                    let wait = self.shared.read(Membership::rejoin_backoff);
                    if !wait.is_zero() {
                        warn!(job = %self.config.job, worker = %self.config.worker_id, wait_ms = wait.as_millis() as u64,
                              "evicted again before a generation connected; backing off before joining again");
                        tokio::time::sleep(wait).await;
                    }
                    self.register().await?;
                    continue;
                }
                Step::Rendezvous { incarnation, after_generation } => (incarnation, after_generation),
            };
            let answer = self
                .client
                .rendezvous(pb::RendezvousRequest {
                    job: self.config.job.clone(),
                    worker_id: self.config.worker_id.clone(),
                    incarnation,
                    after_generation,
                    wait_ms: self.config.rendezvous_poll.as_millis() as u64,
                    // The sparse view of a large generation; a small one comes whole.
                    compact: true,
                    partners: true,
                    layout: true,
                })
                .await
                .map_err(CallError::from);
            if let Some(generation) = self.shared.drive(|m| m.handle_rendezvous(incarnation, answer))? {
                if let Some(formed) = self.connect(generation).await? {
                    return Ok(formed);
                }
            }
        }
    }

    /// Connects the mesh of a formed generation. `None` when the mesh could not be built (a
    /// member died meanwhile): the failure is reported and the caller re-forms.
    async fn connect(&mut self, generation: pb::Generation) -> Result<Option<Generation>, ElasticError> {
        let number = generation.number;
        let span = info_span!("generation", job = %self.config.job, generation = number);
        let incarnation = self.incarnation();
        let Some((members, rank)) = self.members_of(&generation, incarnation).instrument(span.clone()).await? else {
            return Ok(None);
        };
        let plan = plan_view(number, &members, rank, self.config.transport)?;
        let carried = match self.previous.take() {
            Some(previous) => previous.carry_into(number, &members, incarnation, rank, &plan),
            None => Vec::new(),
        };
        // A sparse view leaves the addresses of the peers outside the plan to be asked of the
        // coordinator when a link to one is first made.
        let resolver: Option<Arc<dyn cohort_transports::tcp::ResolvePeer>> = (!members.is_whole()).then(|| {
            Arc::new(CoordinatorResolver::new(
                self.client.clone(),
                pb::MembersRequest {
                    job: self.config.job.clone(),
                    worker_id: self.config.worker_id.clone(),
                    incarnation,
                    generation: number,
                    ranks: Vec::new(),
                    host: String::new(),
                },
                generation.members_digest,
                &members,
            )) as Arc<dyn cohort_transports::tcp::ResolvePeer>
        });
        let kind = plan.kind();
        if kind == MeshKind::Tcp && self.config.transport == TransportChoice::Rdma {
            warn!(parent: &span, without_rdma = %plan.without_rdma().join(", "),
                  "not every member published an rdma address: this generation uses tcp");
        }
        let started = Instant::now();
        // The generation may be revoked while its mesh connects (a member died before it
        // dialled): stop at once rather than wait out the connect deadline.
        let connected = tokio::select! {
            r = self.connect_mesh(number, rank, plan, carried, resolver).instrument(span.clone()) => r,
            cause = revoked_or_ended(&self.shared, number) => {
                info!(parent: &span, %cause, "generation revoked while connecting; re-forming");
                return Ok(None);
            }
        };
        let transport = match connected {
            Ok(t) => t,
            Err(e) => {
                warn!(parent: &span, error = %e, "mesh connection failed; reporting and re-forming");
                let report = pb::FailureReport {
                    job: self.config.job.clone(),
                    worker_id: self.config.worker_id.clone(),
                    incarnation,
                    generation: number,
                    failed_rank: e.peer(),
                    reason: format!("mesh connection failed: {e}"),
                    kind: pb::failure_report::FailureKind::Unspecified as i32,
                    progress: None,
                };
                self.client.report_failure(report).await?;
                return Ok(None);
            }
        };
        debug!(parent: &span, rank, transport = %kind, elapsed_ms = started.elapsed().as_millis() as u64, "mesh connected");
        // Report first, close after: a failed collective leaves the links open until the
        // coordinator has the root cause (on_failure revokes, which aborts the transport), so
        // no peer blames this rank for links it closed because another rank died.
        let comm_config = CommConfig { abort_transport_on_error: false, ..self.config.comm.clone() };
        let carried = transport.carried_links();
        let transport = Arc::new(transport);
        self.previous = Some(Previous {
            number,
            incarnation,
            ranks: members
                .iter()
                .filter_map(|m| Some((m.worker_id.clone(), (members.incarnation_of(m.rank)?, m.rank))))
                .collect(),
            mesh: Arc::clone(&transport),
        });
        let mut comm = Communicator::new(transport, comm_config);
        comm.set_layout(members.layout()).map_err(|e| ElasticError::Protocol(e.to_string()))?;
        // The revoker first, so that a revocation heard while connecting (or now) finds it.
        *self.shared.revoker.lock().unwrap_or_else(|e| e.into_inner()) = Some((number, comm.revoker()));
        self.shared.drive(|m| m.handle_connected(number));
        let links = comm.transport().linked_peers();
        info!(parent: &span, rank, world = members.size(), known = members.known().len(), transport = %kind, links, carried,
              "generation formed");
        Ok(Some(Generation { number, members, comm, transport: kind, formed_at_ms: generation.formed_at_ms }))
    }

    /// The members of a formed generation this worker needs, and its rank: the whole list, or
    /// a sparse view with the entries of every peer it links at set-up fetched (one `Members`
    /// call when its plan reaches beyond its partners and host run, as a host leader's does).
    /// A compact answer without host runs (an older coordinator) is completed with the whole
    /// list. `None` when the generation changed meanwhile (its entries could not be fetched
    /// against its digest): the caller rendezvous again.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    async fn members_of(
        &self,
        generation: &pb::Generation,
        incarnation: u64,
    ) -> Result<Option<(Members, u32)>, ElasticError> {
        let number = generation.number;
        let question = |ranks: Vec<u32>| pb::MembersRequest {
            job: self.config.job.clone(),
            worker_id: self.config.worker_id.clone(),
            incarnation,
            generation: number,
            ranks,
            host: String::new(),
        };
        let fetch = |ranks: Vec<u32>| async move {
            match self.client.fetch_members(question(ranks), generation.members_digest).await {
                Ok(fetched) => Ok(Some(fetched)),
                Err(ControlError::Rejected {
                    code: tonic::Code::FailedPrecondition | tonic::Code::NotFound,
                    message,
                    ..
                }) => {
                    info!(error = %message, "the generation changed while its members were fetched; rendezvous again");
                    Ok(None)
                }
                Err(e) => Err(ElasticError::from(e)),
            }
        };
        let members = match Members::from_answer(generation)? {
            Some(members) => members,
            None => {
                let Some(all) = fetch((0..generation.size).collect()).await? else { return Ok(None) };
                let whole = pb::Generation { members: all, rank: None, ..generation.clone() };
                Members::from_answer(&whole)?
                    .ok_or_else(|| ElasticError::Protocol(format!("generation {number}: no member list")))?
            }
        };
        let rank = members
            .iter()
            .find(|m| m.worker_id == self.config.worker_id && members.incarnation_of(m.rank) == Some(incarnation))
            .map(|m| m.rank)
            .ok_or_else(|| ElasticError::Protocol(format!("generation {number} does not include this worker")))?;
        if members.is_whole() {
            return Ok(Some((members, rank)));
        }
        let wanted: Vec<u32> = match upfront_ranks(&members.layout(), rank) {
            None => (0..members.size()).collect(),
            Some(plan) => plan,
        };
        let missing = members.missing(wanted);
        if missing.is_empty() {
            return Ok(Some((members, rank)));
        }
        debug!(rank, missing = missing.len(), "fetching the entries of the peers linked at set-up");
        let Some(fetched) = fetch(missing).await? else { return Ok(None) };
        let mut members = members;
        members.add(&fetched)?;
        Ok(Some((members, rank)))
    }

    /// Connects this rank's mesh of generation `number` over the planned transport.
    ///
    /// # Cancel safety
    /// Cancel safe, like every transport's mesh set-up: dropping it abandons the set-up.
    async fn connect_mesh(
        &self,
        number: u64,
        rank: u32,
        plan: MeshPlan,
        carried: Vec<(u32, cohort_transports::tcp::CarriedLink)>,
        resolver: Option<Arc<dyn cohort_transports::tcp::ResolvePeer>>,
    ) -> Result<MeshTransport, TransportError> {
        let scope = MeshScope {
            job: self.config.job.clone(),
            generation: number,
            token: self.config.token.clone(),
            deadlines: self.config.deadlines,
        };
        // Every generation's TCP links may be carried into the next (an abort leaves them open).
        connect_planned(&scope, rank, plan, self.local_endpoints(), Carry { links: carried, onward: true }, resolver)
            .await
    }

    /// This worker's data-plane endpoints.
    fn local_endpoints(&self) -> LocalEndpoints<'_> {
        let local = LocalEndpoints::new(&self.endpoint).with_shm(self.shm.as_ref());
        #[cfg(feature = "rdma")]
        let local = local.with_rdma(self.rdma.as_ref());
        local
    }

    /// Turns a failed collective of `generation` into the generation's root cause (see
    /// [`FailureReporter::on_failure`]).
    ///
    /// # Cancel safety
    /// Cancel safe (reports are idempotent).
    pub async fn on_failure(&self, generation: u64, error: &CommError) -> RootCause {
        self.reporter().on_failure(generation, error).await
    }

    /// A cloneable handle that reports failures of this worker's generations, for code that
    /// holds a [`Generation`] apart from the group (another task, a language binding).
    pub fn reporter(&self) -> FailureReporter {
        FailureReporter {
            client: self.client.clone(),
            shared: self.shared.clone(),
            job: self.config.job.clone(),
            worker_id: self.config.worker_id.clone(),
            root_cause_wait: self.config.root_cause_wait,
        }
    }

    /// Records a commit point (step and state digest) for the coordinator and answers whether
    /// a re-formation is pending (joiners waiting), as far as this worker has heard.
    ///
    /// The report goes out in the background (the newest supersedes any not yet sent), so a
    /// step never waits on the control plane: training goes on while every coordinator is
    /// down, and the job's status catches up when one is back. "Pending" comes from the watch
    /// stream and from earlier commit answers; the ranks agree on it at the commit point.
    pub fn commit(&self, generation: u64, step: u64, digest: &[u8]) -> bool {
        self.commits.send_replace(Some(pb::CommitRequest {
            job: self.config.job.clone(),
            worker_id: self.config.worker_id.clone(),
            incarnation: self.incarnation(),
            generation,
            step,
            digest: digest.to_vec(),
        }));
        self.shared.read(Membership::reformation_pending)
    }

    /// Whether the watch has announced joiners waiting for a re-formation.
    pub fn reformation_pending(&self) -> bool {
        self.shared.read(Membership::reformation_pending)
    }

    /// The root cause of a revoked generation, if this worker has heard it.
    pub fn revocation_cause(&self, generation: u64) -> Option<RootCause> {
        self.shared.read(|m| m.cause_of(generation))
    }

    /// Leaves the job: `finished` = the work is done; otherwise a graceful leave (no failure
    /// recorded). Stops the background tasks.
    ///
    /// # Cancel safety
    /// Cancel safe (leaving twice is harmless; an unfinished leave expires with the lease).
    pub async fn leave(mut self, finished: bool) -> Result<(), ElasticError> {
        let mode = if finished { pb::leave_request::Mode::Finished } else { pb::leave_request::Mode::Graceful };
        // The last commit report, so that the job's record has the final step (best effort).
        let last_commit = self.commits.borrow().clone();
        if let Some(request) = last_commit {
            if let Err(e) = self.client.commit(request).await {
                debug!(error = %e, "the last commit report failed");
            }
        }
        let result = self
            .client
            .leave(pb::LeaveRequest {
                job: self.config.job.clone(),
                worker_id: self.config.worker_id.clone(),
                incarnation: self.incarnation(),
                mode: mode as i32,
            })
            .await;
        for task in self.tasks.drain(..) {
            task.abort();
        }
        result.map(|_| ()).map_err(Into::into)
    }
}

/// Reports failed collectives of one worker's generations and answers their root cause.
/// Obtained from [`ElasticGroup::reporter`]; cheap to clone, `Send + Sync`.
#[derive(Clone)]
pub struct FailureReporter {
    client: ControlClient,
    shared: Arc<Shared>,
    job: String,
    worker_id: String,
    root_cause_wait: Duration,
}

impl std::fmt::Debug for FailureReporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FailureReporter").field("job", &self.job).field("worker_id", &self.worker_id).finish()
    }
}

impl FailureReporter {
    /// The worker's current incarnation (changes when it had to join again).
    pub fn incarnation(&self) -> u64 {
        self.shared.read(Membership::incarnation)
    }

    /// Whether the watch has announced joiners waiting for a re-formation.
    pub fn reformation_pending(&self) -> bool {
        self.shared.read(Membership::reformation_pending)
    }

    /// Resolves once `generation` is revoked, with its root cause (or once the job has ended,
    /// with why): for code that watches a data plane cohort does not drive (a torch backend
    /// beneath a process group whose membership is cohort's), to abort its work.
    ///
    /// # Cancel safety
    /// Cancel safe: it only waits.
    pub async fn revoked(&self, generation: u64) -> RootCause {
        revoked_or_ended(&self.shared, generation).await
    }

    /// Turns a failed collective of `generation` into the generation's root cause.
    ///
    /// A revoked communicator already carries the cause. For a local detection (peer closed,
    /// timeout, protocol error) this reports the failure to the coordinator, which keeps the
    /// first report of the generation: the answer is the root cause every rank shares.
    ///
    /// # Cancel safety
    /// Cancel safe (reports are idempotent).
    pub async fn on_failure(&self, generation: u64, error: &CommError) -> RootCause {
        if let CommError::Revoked { cause, .. } = error {
            return cause.clone();
        }
        if let Some(cause) = self.shared.read(|m| m.cause_of(generation)) {
            return cause;
        }
        let failed_rank = match error {
            CommError::PeerFailed { rank, .. } => Some(*rank),
            CommError::Timeout { rank, .. } => *rank,
            _ => None,
        };
        let report = pb::FailureReport {
            job: self.job.clone(),
            worker_id: self.worker_id.clone(),
            incarnation: self.incarnation(),
            generation,
            failed_rank,
            reason: error.failure_reason(),
            kind: match error {
                CommError::PeerFailed { .. } => pb::failure_report::FailureKind::PeerClosed,
                CommError::Timeout { .. } => pb::failure_report::FailureKind::Timeout,
                _ => pb::failure_report::FailureKind::Unspecified,
            } as i32,
            progress: match error {
                CommError::Timeout { progress: Some(p), .. } => {
                    Some(pb::OpProgress { seq: p.seq, received: p.received })
                }
                _ => None,
            },
        };
        let answer = match tokio::time::timeout(
            self.root_cause_wait.max(Duration::from_secs(2)),
            self.client.report_failure(report),
        )
        .await
        {
            Ok(Ok(response)) => Some(response),
            Ok(Err(e)) => {
                warn!(error = %e, "could not report the failure; using the local error as the cause");
                None
            }
            Err(_) => {
                warn!("no answer to the failure report in time; using the local error as the cause");
                None
            }
        };
        // Without the coordinator's record, the local error is the cause; revoking with it
        // closes the generation's links (which stayed open for the report) so that peers stop
        // waiting on this rank.
        let local = RootCause {
            rank: failed_rank,
            worker_id: String::new(),
            host: String::new(),
            reason: error.failure_reason(),
        };
        self.shared.drive(|m| m.handle_report(generation, answer, local))
    }
}

/// The address peers dial: `advertise` as is when it carries a port (`HOST:PORT`,
/// `[V6]:PORT`; e.g. a proxy in front of this worker), else `advertise` with the bound port.
fn advertised_address(advertise: &str, port: u16) -> String {
    if advertise.parse::<SocketAddr>().is_ok() {
        return advertise.to_string();
    }
    if let Some((host, p)) = advertise.rsplit_once(':') {
        if !host.contains(':') && p.parse::<u16>().is_ok() {
            return advertise.to_string();
        }
    }
    if advertise.contains(':') {
        format!("[{advertise}]:{port}")
    } else {
        format!("{advertise}:{port}")
    }
}

/// Opens this worker's RDMA endpoint. The bootstrap listener binds on the TCP listener's IP
/// (keeping the port of `options.bootstrap_bind`, 0 = any) and, unless `options.advertise`
/// is set, advertises the host of the TCP advertised address with the bound port.
#[cfg(feature = "rdma")]
async fn open_rdma(
    options: &cohort_transports::rdma::RdmaOptions,
    listen: SocketAddr,
    advertised: &str,
) -> Result<cohort_transports::rdma::RdmaEndpoint, ElasticError> {
    let mut options = options.clone();
    options.bootstrap_bind = SocketAddr::new(listen.ip(), options.bootstrap_bind.port());
    if options.advertise.is_none() {
        let host = super::members::resolve(advertised).ok_or_else(|| {
            ElasticError::DataPlane(TransportError::InvalidArgument(format!(
                "the advertised address {advertised:?} does not resolve to an IP for the rdma bootstrap listener"
            )))
        })?;
        options.advertise = Some(SocketAddr::new(host.ip(), 0));
    }
    let device = options.device.name.clone().unwrap_or_else(|| "the first device with an active port".into());
    let endpoint = cohort_transports::rdma::RdmaEndpoint::open(options)
        .await
        .map_err(|source| ElasticError::RdmaEndpoint { device, source })?;
    info!(device = endpoint.device_name(), address = %endpoint.address().encode(), "rdma endpoint open");
    Ok(endpoint)
}

/// Keeps the membership's lease alive and reports progress, until a newer incarnation
/// takes over or the coordinator no longer knows this one: through the host's heartbeat
/// relay when there is one, else directly.
async fn heartbeat_task(
    client: ControlClient,
    relay: Option<HostRelay>,
    shared: Arc<Shared>,
    job: String,
    worker_id: String,
    incarnation: u64,
    interval: Duration,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let Some(progress) = shared.read(|m| m.heartbeat_request(incarnation)) else { return };
        let timing = shared.timing.lock().unwrap_or_else(|e| e.into_inner()).take();
        let request = pb::HeartbeatRequest {
            job: job.clone(),
            worker_id: worker_id.clone(),
            incarnation,
            generation: progress.generation,
            step: progress.step,
            // A rank waiting on a late peer says so (the coordinator's status shows it).
            activity: match cohort_transports::activity::waiting_on_late(&job, progress.generation) {
                Some(late) => format!("{}; {late}", progress.activity),
                None => progress.activity,
            },
            deadlines: progress.deadlines,
            timing,
        };
        let answer = match &relay {
            Some(relay) => relay.heartbeat(request).await,
            None => client.heartbeat(request).await,
        };
        let answer = answer.map_err(CallError::from);
        if !shared.drive(|m| m.handle_heartbeat(incarnation, answer)) {
            return;
        }
    }
}

/// Sends commit reports: whenever a newer one is recorded, sends the newest, and hands the
/// answer to the machine.
///
/// # Cancel safety
/// Cancel safe: a report cut short is superseded by the next one.
async fn commit_task(
    client: ControlClient,
    shared: Arc<Shared>,
    mut commits: tokio::sync::watch::Receiver<Option<pb::CommitRequest>>,
) {
    while commits.changed().await.is_ok() {
        let Some(request) = commits.borrow_and_update().clone() else { continue };
        let (generation, incarnation) = (request.generation, request.incarnation);
        let answer = client.commit(request).await.map_err(CallError::from);
        shared.drive(|m| m.handle_commit(generation, incarnation, answer));
    }
}

/// Follows the job's events and hands them to the machine: from the host's event relay (with
/// a quiet stream of this worker's own) or, without a relay, from a full stream of its own.
/// The stream is reopened when it breaks (after the machine's backoff) and when this worker
/// joins again as a new incarnation. The worker's own open stream is also how the coordinator
/// knows this process is alive: when the process dies, the stream's connection closes and
/// the rendezvous stops waiting for it (before its lease lapses), so the stream is always
/// opened for the current incarnation, and losing the relay does not close it.
///
/// # Cancel safety
/// Cancel safe: events are applied whole; a reopened stream or subscription starts with the
/// current state.
async fn watch_task(
    client: ControlClient,
    shared: Arc<Shared>,
    job: String,
    worker_id: String,
    relay: Option<EventRelay>,
) {
    let mut relay = RelayPath::new(relay);
    loop {
        // Register for the wake-up before reading the incarnation, so that a join in
        // between is not missed.
        let changed = shared.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let incarnation = shared.read(Membership::incarnation);
        // Subscribed before the stream opens: the stream's state and the relay's together
        // cover every event (each is applied once; repeats change nothing).
        let mut events = relay.subscribe();
        let watch_request = |quiet| pb::WatchRequest {
            job: job.clone(),
            worker_id: worker_id.clone(),
            incarnation,
            compact: true,
            quiet,
        };
        match client.watch(watch_request(events.is_some())).await {
            Ok(mut stream) => {
                shared.drive(Membership::handle_watch_opened);
                loop {
                    // Watching alone after the relay failed: when that spell ends, back to it.
                    let retry = if events.is_none() { relay.retry_at() } else { None };
                    tokio::select! {
                        message = stream.message() => match message {
                            Ok(Some(event)) => shared.drive(|m| m.handle_event(event)),
                            Ok(None) => break,
                            Err(status) => {
                                debug!(%status, "watch stream broke; reopening");
                                break;
                            }
                        },
                        event = next_relayed(&mut events) => match event {
                            Ok(Some(event)) => {
                                relay.heard();
                                shared.drive(|m| m.handle_event(event))
                            }
                            lost => {
                                // The relay's process ended (or dropped this subscriber): the
                                // stream stays open while the next relay is found or served.
                                events = relay.lost(lost.err());
                                if events.is_none() {
                                    // Watching alone: a full stream of its own, opened before
                                    // the quiet one closes (its first messages are the state,
                                    // what the relay did not hand on). Closing first would tell
                                    // a rendezvous that this live process died.
                                    match client.watch(watch_request(false)).await {
                                        Ok(full) => {
                                            stream = full;
                                            shared.drive(Membership::handle_watch_opened);
                                        }
                                        Err(e) => {
                                            debug!(error = %e, "could not open a full watch; reopening");
                                            break;
                                        }
                                    }
                                }
                            }
                        },
                        _ = sleep_until_some(retry) => {
                            events = relay.subscribe();
                            if events.is_some() {
                                // Back to the relay: a quiet stream, opened before the full one
                                // closes (as above, the other way).
                                match client.watch(watch_request(true)).await {
                                    Ok(quiet) => {
                                        stream = quiet;
                                        shared.drive(Membership::handle_watch_opened);
                                        debug!("watching through the host's event relay again");
                                    }
                                    Err(e) => {
                                        debug!(error = %e, "could not open a quiet watch; reopening");
                                        break;
                                    }
                                }
                            }
                        },
                        _ = changed.as_mut() => {
                            changed.set(shared.changed.notified());
                            changed.as_mut().enable();
                            if shared.read(|m| m.watch_is_stale(incarnation)) {
                                debug!(old = incarnation, "joined again; reopening the watch for the new incarnation");
                                break;
                            }
                        }
                    }
                }
            }
            Err(e) => debug!(error = %e, "watch failed; retrying"),
        }
        match shared.drive(|m| m.handle_watch_lost(incarnation, Instant::now(), rand::random())) {
            WatchNext::Stop => return,
            WatchNext::ReopenAt(at) => tokio::time::sleep_until(at.into()).await,
        }
    }
}

/// The next event from the relay; pending for ever without a subscription.
///
/// # Cancel safety
/// Cancel safe ([`RelayEvents::next`] is).
async fn next_relayed(events: &mut Option<RelayEvents>) -> std::io::Result<Option<pb::JobEvent>> {
    match events {
        Some(events) => events.next().await,
        None => std::future::pending().await,
    }
}

/// Sleeps until `at`; pending for ever without one.
///
/// # Cancel safety
/// Cancel safe: it only waits.
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Losses of the relay within [`RESUBSCRIBE_WINDOW`] after which a worker watches alone.
const QUICK_LOSSES: usize = 3;

/// Longest a worker watches alone before it tries its host's event relay again.
const ALONE_AT_MOST: Duration = Duration::from_secs(300);

/// A worker's use of its host's event relay: subscribed while it serves, else a full stream of
/// the worker's own for [`FULL_AFTER_FAILURE`], twice as long after each failure in a row (up
/// to [`ALONE_AT_MOST`]).
struct RelayPath {
    relay: Option<EventRelay>,
    /// When the relay was lost lately (within [`RESUBSCRIBE_WINDOW`] of each other).
    losses: Vec<Instant>,
    /// Until when this worker watches alone.
    alone_until: Option<Instant>,
    /// How long the next failure makes it watch alone.
    alone_for: Duration,
}

impl RelayPath {
    fn new(relay: Option<EventRelay>) -> Self {
        Self { relay, losses: Vec::new(), alone_until: None, alone_for: FULL_AFTER_FAILURE }
    }

    /// An event came through the relay: it serves.
    fn heard(&mut self) {
        self.alone_for = FULL_AFTER_FAILURE;
    }

    /// When a worker watching alone tries the relay again (`None`: there is no relay).
    fn retry_at(&self) -> Option<Instant> {
        self.relay.as_ref()?;
        Some(self.alone_until.unwrap_or_else(Instant::now))
    }

    /// A subscription to the relay, unless there is none or it failed this worker lately.
    fn subscribe(&mut self) -> Option<RelayEvents> {
        let relay = self.relay.as_ref()?;
        if self.alone_until.is_some_and(|until| Instant::now() < until) {
            return None;
        }
        match relay.subscribe() {
            Ok(events) => Some(events),
            Err(e) => {
                self.give_up(&e.to_string(), true);
                None
            }
        }
    }

    /// The subscription ended (`error`, or a clean close): subscribes again at once, unless
    /// the relay hangs (it wrote nothing for [`crate::control::SILENCE_LIMIT`]) or was lost
    /// already within [`RESUBSCRIBE_WINDOW`].
    fn lost(&mut self, error: Option<std::io::Error>) -> Option<RelayEvents> {
        if let Some(e) = error.as_ref().filter(|e| e.kind() == std::io::ErrorKind::TimedOut) {
            self.give_up(&e.to_string(), true);
            return None;
        }
        let now = Instant::now();
        self.losses.retain(|at| now.duration_since(*at) < RESUBSCRIBE_WINDOW);
        self.losses.push(now);
        let why = error.map_or_else(|| "the relay closed the subscription".to_string(), |e| e.to_string());
        // A dying relay's socket can still take a connection (the kernel closes a killed
        // process's sockets one by one), which it then resets: a second loss at once is no
        // sign of trouble, a third within the window is (or a job's end, as the host's workers
        // exit one after another).
        if self.losses.len() >= QUICK_LOSSES {
            self.losses.clear();
            self.give_up(&format!("lost {QUICK_LOSSES} times within {RESUBSCRIBE_WINDOW:?}: {why}"), false);
            return None;
        }
        debug!(%why, "event relay lost; subscribing again");
        self.subscribe()
    }

    /// Watches alone for a while; `warn`: the relay hangs or cannot be reached (else it
    /// closed again and again, as at a job's end, and this is logged at `info`).
    fn give_up(&mut self, why: &str, warn: bool) {
        let relay = self.relay.as_ref().map_or("", EventRelay::socket_name);
        let alone_for = self.alone_for;
        if warn {
            warn!(%relay, %why, ?alone_for, "event relay failed; watching with a stream of this worker's own");
        } else {
            info!(%relay, %why, ?alone_for, "event relay closed again; watching with a stream of this worker's own");
        }
        self.alone_until = Some(Instant::now() + self.alone_for);
        self.alone_for = (self.alone_for * 2).min(ALONE_AT_MOST);
    }
}

/// Resolves once `generation` is revoked (with its cause) or the job has ended.
///
/// # Cancel safety
/// Cancel safe: it only waits.
async fn revoked_or_ended(shared: &Shared, generation: u64) -> RootCause {
    loop {
        // Register for the wake-up before looking, so that a revocation in between is seen.
        let notified = shared.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if let Some(cause) = shared.read(|m| m.stop_reason(generation)) {
            return cause;
        }
        notified.await;
    }
}

#[cfg(test)]
mod tests {
    use super::advertised_address;

    /// Without a usable device (none on this machine, or none by that name), join fails
    /// before contacting the coordinator, naming the device.
    #[cfg(feature = "rdma")]
    #[tokio::test]
    async fn join_fails_at_once_when_the_rdma_device_cannot_be_opened() {
        use super::{ElasticConfig, ElasticError, ElasticGroup};
        use crate::control::ControlConfig;
        use cohort_transports::rdma::{DeviceConfig, RdmaOptions};
        // Nothing listens on port 1: a join that got as far as the coordinator would fail otherwise.
        let mut config = ElasticConfig::new("job", "w0", ControlConfig::new(vec!["http://127.0.0.1:1".into()]));
        config.listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let device = DeviceConfig { name: Some("cohort-no-such-device".into()), ..DeviceConfig::default() };
        config.transport = super::TransportChoice::Rdma;
        config.rdma = RdmaOptions { device, ..RdmaOptions::default() };
        let started = std::time::Instant::now();
        let error = match ElasticGroup::join(config).await {
            Ok(_) => panic!("joined with a device that does not exist"),
            Err(e) => e,
        };
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "took {:?}", started.elapsed());
        assert!(
            matches!(&error, ElasticError::RdmaEndpoint { device, .. } if device == "cohort-no-such-device"),
            "{error}"
        );
        let message = error.to_string();
        assert!(message.contains("cohort-no-such-device") && message.contains("RDMA device"), "{message}");
    }

    /// The gRPC shell's classification of the client's errors for the membership machine.
    #[test]
    fn control_errors_are_classified_for_the_membership_machine() {
        use super::{CallError, ControlError};
        use std::time::Duration;
        let rejected = |code| ControlError::Rejected { rpc: "Heartbeat", code, message: format!("{code:?}") };
        assert!(matches!(CallError::from(rejected(tonic::Code::NotFound)), CallError::NotMember(_)));
        for code in [tonic::Code::Unavailable, tonic::Code::FailedPrecondition, tonic::Code::PermissionDenied] {
            assert!(matches!(CallError::from(rejected(code)), CallError::Failed(_)), "{code:?}");
        }
        let unreachable = ControlError::Unreachable { endpoints: "x".into(), attempts: 3, last: "refused".into() };
        assert!(matches!(CallError::from(unreachable), CallError::Failed(ControlError::Unreachable { .. })));
        let left = Duration::from_millis(2500);
        let excluded = ControlError::Excluded { message: "failed 3 times".into(), retry_after: left };
        assert!(matches!(CallError::from(excluded), CallError::Excluded { retry_after, .. } if retry_after == left));
        let in_use = ControlError::IdInUse { message: "held".into(), retry_after: left };
        assert!(matches!(CallError::from(in_use), CallError::IdInUse { retry_after, .. } if retry_after == left));
    }

    #[test]
    fn advertise_takes_the_bound_port_unless_given_one() {
        assert_eq!(advertised_address("10.0.0.5", 7100), "10.0.0.5:7100");
        assert_eq!(advertised_address("10.0.0.5:9000", 7100), "10.0.0.5:9000");
        assert_eq!(advertised_address("pod-a.svc", 7100), "pod-a.svc:7100");
        assert_eq!(advertised_address("pod-a.svc:81", 7100), "pod-a.svc:81");
        assert_eq!(advertised_address("::1", 7100), "[::1]:7100");
        assert_eq!(advertised_address("[::1]:81", 7100), "[::1]:81");
    }
}
