//! [`ElasticGroup`]: membership, re-formation and failure handling for one worker: the
//! control-plane shell ([`super::shell`]) and a data plane ([`DataPlane`]) together.

use super::data_plane::{Connected, DataPlane, Formed};
use super::members::{fetch_members, Members};
use super::membership::{Membership, Step};
use super::shell::{self, revoked_or_ended, FailureReporter, RealWorld, Shared, World};
use super::sockets::SocketPlane;
use super::{ElasticConfig, ElasticError, MeshKind, MeshTransport};
use crate::control::{ControlClient, EventRelay, HostRelay, RelayNet, SocketDir};
use crate::{CommError, Communicator, RootCause};
use cohort_proto::ids::JobId;
use cohort_proto::v1 as pb;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tracing::{debug, info, info_span, warn, Instrument};

/// A formed generation and the communicator connected for it.
pub struct Generation<C = Communicator<MeshTransport>> {
    /// Generation number (strictly increasing over the job's life).
    pub number: u64,
    /// The members this worker knows, by rank: every one in a generation answered whole (up
    /// to the job's `whole_answer_up_to`, default 256), else its partners and host-mates
    /// (see [`Members`]).
    pub members: Members,
    /// This worker's rank.
    pub rank: u32,
    /// The communicator over this generation's mesh.
    pub comm: C,
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

/// A worker's membership in an elastic job, and its data plane (production's by default:
/// TCP, shared memory, RDMA; see [`DataPlane`] for the seam).
///
/// Dropping it stops the heartbeat and watch tasks (the coordinator then expires the
/// membership with its lease); call [`ElasticGroup::leave`] to leave promptly.
pub struct ElasticGroup<P: DataPlane = SocketPlane> {
    config: ElasticConfig,
    client: ControlClient,
    plane: P,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
    heartbeat_interval: Duration,
    /// The newest commit report, sent by the commit task (older unsent ones are superseded).
    commits: tokio::sync::watch::Sender<Option<pb::CommitRequest>>,
    /// The host's heartbeat relay path (with [`ElasticConfig::heartbeat_relay`]), made at the
    /// first join (the interval comes with it).
    relay: Option<HostRelay>,
    /// Where the host's relays live: [`ElasticConfig::relay_dir`], else the world's.
    relay_net: Arc<dyn RelayNet>,
}

impl<P: DataPlane> Drop for ElasticGroup<P> {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl ElasticGroup {
    /// Binds the data-plane listener, opens the shared-memory endpoint and, with
    /// [`super::TransportChoice::Rdma`], the RDMA endpoint (failing at once, before joining, when its
    /// device cannot be opened, or with [`ElasticError::TransportUnavailable`] in a build
    /// without the `rdma` feature), joins the job and starts the heartbeat and watch tasks. An
    /// excluded worker waits out its exclusion first (at most [`ElasticConfig::exclusion_wait`],
    /// else [`ElasticError::Excluded`]).
    ///
    /// # Cancel safety
    /// Cancel safe: a join left half done expires with its lease.
    pub async fn join(mut config: ElasticConfig) -> Result<Self, ElasticError> {
        #[cfg(not(feature = "rdma"))]
        if config.transport == super::TransportChoice::Rdma {
            return Err(super::TransportUnavailable::RdmaNotBuilt.into());
        }
        // The data plane is keyed by the job's credential, whether this worker was given it
        // or the operator secret it derives from; another job's credential stops here.
        config.token = cohort_proto::credentials::data_plane_secret(&config.token, config.job.as_str())?;
        let client = ControlClient::new(config.control.clone())?;
        let plane = SocketPlane::open(&config).await?;
        Self::join_with(config, client, plane, Arc::new(RealWorld)).await
    }

    /// This worker's data-plane address as peers see it.
    pub fn advertised_address(&self) -> &str {
        self.plane.advertised_address()
    }

    /// This worker's encoded RDMA endpoint address, as published at join (`None` without an
    /// RDMA endpoint).
    pub fn rdma_address(&self) -> Option<String> {
        self.plane.rdma_address()
    }

    /// The address the data-plane listener is bound to (differs from
    /// [`ElasticGroup::advertised_address`] behind NAT, a proxy or a wildcard bind).
    pub fn listen_address(&self) -> SocketAddr {
        self.plane.listen_address()
    }
}

impl<P: DataPlane> ElasticGroup<P> {
    /// Joins with the data plane `plane`, through `client`, in `world` (the seams a
    /// simulation or a harness fills; [`ElasticGroup::join`] is production's), and starts the
    /// heartbeat, watch and commit tasks. `config.token` is not derived here: a plane that
    /// uses it was opened with it.
    ///
    /// # Cancel safety
    /// Cancel safe: a join left half done expires with its lease.
    pub async fn join_with(
        config: ElasticConfig,
        client: ControlClient,
        plane: P,
        world: Arc<dyn World>,
    ) -> Result<Self, ElasticError> {
        let relay_net: Arc<dyn RelayNet> = match &config.relay_dir {
            Some(dir) => {
                let net = SocketDir::new(dir).map_err(|e| ElasticError::InvalidConfig(format!("relay_dir: {e}")))?;
                info!(job = %config.job, dir = %dir.display(), scope = config.relay_scope(), "host relays' sockets in a directory");
                Arc::new(net)
            }
            None => world.relay_net(),
        };
        let shared = Arc::new(Shared::new(config.exclusion_wait, client.config(), world));
        let mut group = Self {
            config,
            client,
            plane,
            shared,
            tasks: Vec::new(),
            heartbeat_interval: Duration::from_millis(500),
            commits: tokio::sync::watch::channel(None).0,
            relay: None,
            relay_net,
        };
        group.register().await?;
        group.tasks.push(tokio::spawn(shell::commit_task(
            group.client.clone(),
            group.shared.clone(),
            group.commits.subscribe(),
        )));
        let events = if group.config.heartbeat_relay {
            let (client, config, net) = (group.client.clone(), &group.config, group.relay_net.clone());
            Some(EventRelay::new(client, &config.job, &config.worker_id, config.relay_scope(), net))
        } else {
            None
        };
        group.tasks.push(tokio::spawn(shell::watch_task(
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
        let (addresses, capabilities) = self.plane.published();
        let request = pb::JoinRequest {
            job: self.config.job.to_string(),
            worker_id: self.config.worker_id.to_string(),
            host: self.config.host.clone(),
            addresses,
            capabilities,
            protocol_version: cohort_proto::PROTOCOL_VERSION,
            domain: self.config.domain.clone(),
            // The incarnation this process held (0 before its first join): its own re-join
            // replaces it, where another process's join for the id is refused.
            replaces: self.incarnation(),
        };
        let (incarnation, heartbeat_interval, lease_ttl) = shell::join(&self.client, &self.shared, request).await?;
        self.heartbeat_interval = heartbeat_interval;
        info!(job = %self.config.job, worker = %self.config.worker_id, incarnation, "joined");
        self.relay = self.relay.take().filter(|r| r.interval() == heartbeat_interval);
        if self.config.heartbeat_relay && self.relay.is_none() {
            let (job, scope, net) = (&self.config.job, self.config.relay_scope(), self.relay_net.clone());
            self.relay = HostRelay::new(self.client.clone(), job, scope, heartbeat_interval, lease_ttl, net);
        }
        // An older incarnation's heartbeat task stops by itself (it sees the new incarnation).
        let heartbeat = tokio::spawn(shell::heartbeat_task(
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
    pub fn job(&self) -> &JobId {
        &self.config.job
    }

    /// The data plane.
    pub fn plane(&self) -> &P {
        &self.plane
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
        self.shared.drive("", |m| m.set_progress(generation, step, activity));
    }

    /// Records the no-progress deadline in force on this worker's links, in brief; sent
    /// with the next heartbeat (for `status`).
    pub fn set_deadlines(&self, brief: &str) {
        self.shared.drive("", |m| m.set_deadlines(brief));
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
    pub async fn next_generation(&mut self) -> Result<Generation<P::Comm>, ElasticError> {
        loop {
            let (incarnation, after_generation) = match self.shared.drive("", Membership::next_step)? {
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
            let rendezvous = self.client.rendezvous(pb::RendezvousRequest {
                job: self.config.job.to_string(),
                worker_id: self.config.worker_id.to_string(),
                incarnation,
                after_generation,
                wait_ms: self.config.rendezvous_poll.as_millis() as u64,
                // The sparse view of a large generation; a small one comes whole.
                compact: true,
                partners: true,
                layout: true,
            });
            let answer = self.shared.call("Rendezvous", self.config.rendezvous_poll, rendezvous).await;
            if let Ok(pb::RendezvousResponse { outcome: Some(pb::rendezvous_response::Outcome::Waiting(w)) }) = &answer
            {
                self.shared.world.observe(shell::Observed::Waiting(w));
            }
            if let Some(generation) = self.shared.drive("Rendezvous", |m| m.handle_rendezvous(incarnation, answer))? {
                if let Some(formed) = self.connect(generation).await? {
                    return Ok(formed);
                }
            }
        }
    }

    /// Connects the data plane of a formed generation. `None` when it could not be connected
    /// (a member died meanwhile: the failure is reported) or the generation was revoked
    /// meanwhile: the caller re-forms.
    async fn connect(&mut self, generation: pb::Generation) -> Result<Option<Generation<P::Comm>>, ElasticError> {
        let number = generation.number;
        let span = info_span!("generation", job = %self.config.job, generation = number);
        let incarnation = self.incarnation();
        let Some((members, rank)) = self.members_of(&generation, incarnation).instrument(span.clone()).await? else {
            return Ok(None);
        };
        let formed = Formed { generation: &generation, members, rank, incarnation, client: &self.client, span: &span };
        // The generation may be revoked while its mesh connects (a member died before it
        // dialled): stop at once rather than wait out the connect deadline.
        let connected = tokio::select! {
            r = self.plane.connect(formed) => r?,
            cause = revoked_or_ended(&self.shared, number) => {
                info!(parent: &span, %cause, "generation revoked while connecting; re-forming");
                return Ok(None);
            }
        };
        let Some(Connected { comm, revoke, members, transport }) = connected else { return Ok(None) };
        // The revoker first, so that a revocation heard while connecting (or now) finds it.
        self.shared.connected(number, revoke);
        Ok(Some(Generation { number, members, rank, comm, transport, formed_at_ms: generation.formed_at_ms }))
    }

    /// The members of a formed generation as its answer gives them, and this worker's rank:
    /// the whole list, or a sparse view. A compact answer without host runs (an older
    /// coordinator) is completed with the whole list. `None` when the generation changed
    /// meanwhile (its entries could not be fetched against its digest): the caller rendezvous
    /// again.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    async fn members_of(
        &self,
        generation: &pb::Generation,
        incarnation: u64,
    ) -> Result<Option<(Members, u32)>, ElasticError> {
        let number = generation.number;
        let members = match Members::from_answer(generation)? {
            Some(members) => members,
            None => {
                let question = pb::MembersRequest {
                    job: self.config.job.to_string(),
                    worker_id: self.config.worker_id.to_string(),
                    incarnation,
                    generation: number,
                    ranks: (0..generation.size).collect(),
                    host: String::new(),
                };
                let Some(all) = fetch_members(&self.client, question, generation.members_digest).await? else {
                    return Ok(None);
                };
                let whole = pb::Generation { members: all, rank: None, ..generation.clone() };
                Members::from_answer(&whole)?
                    .ok_or_else(|| ElasticError::Protocol(format!("generation {number}: no member list")))?
            }
        };
        let rank = members
            .iter()
            .find(|m| {
                m.worker_id == self.config.worker_id.as_str() && members.incarnation_of(m.rank) == Some(incarnation)
            })
            .map(|m| m.rank)
            .ok_or_else(|| ElasticError::Protocol(format!("generation {number} does not include this worker")))?;
        Ok(Some((members, rank)))
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
            job: self.config.job.to_string(),
            worker_id: self.config.worker_id.to_string(),
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
        let incarnation = self.incarnation();
        if incarnation == 0 {
            // Never joined: nothing to leave.
            for task in self.tasks.drain(..) {
                task.abort();
            }
            return Ok(());
        }
        self.shared.drive("", Membership::begin_leave);
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
                job: self.config.job.to_string(),
                worker_id: self.config.worker_id.to_string(),
                incarnation,
                mode: mode as i32,
            })
            .await;
        for task in self.tasks.drain(..) {
            task.abort();
        }
        result.map(|_| ()).map_err(Into::into)
    }
}
