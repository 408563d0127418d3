//! TCP transport: tokio sockets tuned with socket2, an authenticated handshake, and
//! zero-copy framed data transfer.
//!
//! # Usage
//! A worker binds one [`TcpEndpoint`] for its lifetime and calls
//! [`TcpEndpoint::connect_mesh`] once per generation. Of the peers the set-up links (every
//! one, or those [`Upfront::Only`] lists), rank `i` dials every rank `j < i` and accepts from
//! every rank `j > i`; any other peer is linked on first use by the same rule (module
//! `on_demand`). The endpoint's accept task routes each accepted
//! connection by (job, generation) to the set-up waiting for it, so several set-ups (other
//! generations or jobs) may run on one endpoint at once. A connection for a (job, generation)
//! nobody waits for yet is held for up to [`PENDING_HOLD`] (at most
//! [`MAX_PENDING`] of them), so a fast peer may dial before the local side gets
//! there; then it is refused as retriable and the dialer tries again until its deadline.
//! The whole set-up is bounded by [`Deadlines::connect`].
//!
//! # Wire protocol (version 1, little-endian)
//! **Handshake** — see [`crate::handshake`] for the byte layout. The dialer sends a hello (magic,
//! version, job id, generation, its rank, the rank it means to reach, world size, 32-byte
//! nonce); the acceptor answers with its own hello and an HMAC-SHA256 proof over both hellos
//! keyed by the job token; the dialer verifies it (constant time), checks the fields and
//! answers with its verdict and its proof; the acceptor verifies and answers with its
//! verdict. The token itself never crosses the wire. Any difference (job, generation, world
//! size, ranks, token, magic, version) fails [`TcpEndpoint::connect_mesh`] with
//! [`TransportError::Handshake`] naming it, and the other side learns it from the verdict or
//! refusal it receives ("peer refused: generation mismatch (ours 3, theirs 4)"). Failures
//! proven by an authenticated peer fail the set-up at once; failures of unauthenticated
//! connections (wrong token, stale generation, another job) are noted and reported if the
//! set-up then misses its deadline, so a stranger cannot break a set-up.
//!
//! **Data** — each message is a 40-byte header (magic `"CHTF"`, version, kind, flags,
//! generation, tag seq, step and signature, reserved, payload length; see [`frame`])
//! followed by the payload. Senders write the header and the caller's slice with one
//! vectored write; receivers read the payload straight into the caller's buffer. See
//! [`link`] for out-of-order frames, stale tags, mismatches and deadlines.
//!
//! # Failures
//! EOF, reset or broken pipe give [`TransportError::PeerClosed`]; no bytes moving for
//! [`Deadlines::no_progress`] gives [`TransportError::Timeout`]; a bad header gives
//! [`TransportError::Protocol`]. Each closes only the link concerned, which stays broken.
//! [`Transport::abort`] shuts every socket down and fails all in-flight and later operations
//! with [`TransportError::Aborted`] at once; a mesh set up with [`MeshSpec::carry_links`]
//! leaves the sockets open instead, for the next generation to carry the clean links over
//! ([`TcpTransport::carry_over`], [`TcpEndpoint::connect_mesh_carrying`]; the protocol is in
//! the module `carry`).
//!
//! # Peers whose address is not known at set-up
//! A member of a large generation knows only the addresses of the peers its schedules use
//! (the coordinator's sparse answer). The others are [`UNKNOWN_PEER`] in [`MeshSpec::peers`];
//! a link made on first use to one of them asks [`MeshSpec::resolver`] for its address
//! first (once per peer), then dials as usual.

mod carry;
mod endpoint;
pub mod frame;
pub mod link;
mod mesh;
mod on_demand;
mod options;
mod resolve;

pub use carry::{CarriedLink, CarriedLinks};
pub use endpoint::{HELLO_TIMEOUT, MAX_HANDSHAKING, MAX_PENDING, PENDING_HOLD};
pub use options::{TcpOptions, DEFAULT_BUSY_POLL, KEEPALIVE_INTERVAL, KEEPALIVE_RETRIES};
pub use resolve::{ResolvePeer, UNKNOWN_PEER};

/// The smallest segment TCP wants a large message cut into ([`Transport::pipeline_segment`]).
/// With 1 MiB segments a 2-rank ring allreduce of 2-8 MiB sends each block in one to four
/// pieces, and each rank's send and its receive-and-add barely overlap: cut into 256 KiB
/// pieces it ran 1.7-2.0x faster at 2-4 MiB on loopback (1.2-1.6x at 8 MiB), and 16 MiB in
/// 512 KiB pieces 6-8% faster, while
/// shared memory, which pipelines through its slots, was no faster (docs/benchmarks.md,
/// "Segments over TCP").
pub const PIPELINE_SEGMENT: usize = 256 << 10;

use crate::links::Links;
use crate::liveness;
use crate::mesh_setup::{self, Gathering, PairTasks, Paired, Rules, SharedNotes};
use crate::{AbortReason, DeadlineInForce, Deadlines, Rank, Tag, Transport, TransportError};
use endpoint::{Incoming, Router};
use link::TcpLink;
use mesh::{Arrived, MeshCtx};
use on_demand::OnDemand;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::Instrument;

/// What one generation's mesh is made of.
#[derive(Clone, Debug)]
pub struct MeshSpec {
    /// Job id (1..=[`crate::handshake::MAX_JOB_LEN`] bytes).
    pub job: String,
    /// Generation being formed.
    pub generation: u64,
    /// This process's rank.
    pub rank: Rank,
    /// Data-plane address of every rank, indexed by rank (this rank's own entry is ignored);
    /// [`UNKNOWN_PEER`] for a peer the set-up does not link whose address is found by
    /// `resolver` on first use.
    pub peers: Vec<SocketAddr>,
    /// Finds the addresses left [`UNKNOWN_PEER`]; `None`: every address is given.
    pub resolver: Option<Arc<dyn ResolvePeer>>,
    /// The job token; only HMAC proofs derived from it cross the wire.
    pub token: Vec<u8>,
    /// Connect and no-progress deadlines.
    pub deadlines: Deadlines,
    /// Which peers the set-up links; the others are linked on first use.
    pub upfront: Upfront,
    /// Whether this generation's links may be carried into the next one
    /// ([`TcpTransport::carry_over`]): an abort then stops every operation but leaves the
    /// sockets open until the next set-up takes them or the transport drops.
    pub carry_links: bool,
}

/// Which peers a mesh links while it is set up ([`TcpEndpoint::connect_mesh`]). A peer not
/// linked then is linked when an operation first needs it: the higher rank of the two dials
/// and the lower one waits for it, each under a fresh connect deadline, with the set-up's
/// authenticated handshake.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Upfront {
    /// Every peer: a full mesh.
    #[default]
    Every,
    /// Only these ranks (those the generation's schedules use). The plan must be symmetric
    /// (rank a lists b exactly when b lists a), or the lower rank of a pair listed one way
    /// waits at set-up for a dial that never comes.
    Only(Vec<Rank>),
}

impl Upfront {
    /// Whether the set-up links `peer` (any rank but `rank` itself for [`Upfront::Every`]).
    fn includes(&self, rank: Rank, peer: Rank) -> bool {
        match self {
            Upfront::Every => peer != rank,
            Upfront::Only(ranks) => peer != rank && ranks.contains(&peer),
        }
    }
}

/// A long-lived listener a worker keeps across generations.
///
/// Dropping it stops its accept task (and closes connections still in their hello phase).
pub struct TcpEndpoint {
    local: SocketAddr,
    options: TcpOptions,
    router: Arc<Router>,
    accept_task: tokio::task::JoinHandle<()>,
    /// Answers peers' liveness probes on UDP `local` ([`liveness`]).
    _responder: Option<liveness::Responder>,
}

impl Drop for TcpEndpoint {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

impl std::fmt::Debug for TcpEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpEndpoint").field("local", &self.local).finish_non_exhaustive()
    }
}

impl TcpEndpoint {
    /// Binds `addr` (port 0 picks a free port) and starts accepting in a background task.
    /// Must be called within a tokio runtime.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is started until the listener is bound, and dropping the
    /// returned endpoint stops it.
    pub async fn bind(addr: SocketAddr, options: TcpOptions) -> Result<Self, TransportError> {
        let listener = endpoint::bind_listener(addr, &options)?;
        let local = listener.local_addr().map_err(|e| TransportError::Io(format!("local address of {addr}: {e}")))?;
        let router = Arc::new(Router::default());
        let accept_task = tokio::spawn(
            endpoint::accept_loop(listener, Arc::clone(&router), options.clone())
                .instrument(tracing::debug_span!("tcp_endpoint", %local)),
        );
        tracing::debug!(%local, "tcp endpoint listening");
        let _responder = liveness::Responder::start(local);
        Ok(Self { local, options, router, accept_task, _responder })
    }

    /// The address the endpoint listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Connects to the peers `spec.upfront` names (every peer by default); rank i dials every
    /// such j < i and accepts from such j > i. Other peers are linked on first use. Fails with [`TransportError::Handshake`] if a peer disagrees about the job,
    /// generation, world size, ranks or token, or if the mesh is not complete within
    /// `spec.deadlines.connect`.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future closes every connection made so far and withdraws
    /// the set-up from the endpoint; peers see their links fail.
    pub async fn connect_mesh(&self, spec: MeshSpec) -> Result<TcpTransport, TransportError> {
        self.connect_mesh_carrying(spec, Vec::new()).await
    }

    /// [`TcpEndpoint::connect_mesh`], re-binding links of the previous generation
    /// (`carried`, each with the rank its peer has in the new one; see
    /// [`TcpTransport::carry_over`]) instead of dialling those peers again. A carried link
    /// that cannot be re-bound (the peer could not carry its end, or disagrees) is replaced
    /// by a fresh connection within the same connect deadline. Carried links to peers the
    /// set-up does not link are shut down.
    ///
    /// # Cancel safety
    /// Cancel safe, as [`TcpEndpoint::connect_mesh`]; carried links not yet re-bound are
    /// shut down.
    pub async fn connect_mesh_carrying(
        &self,
        spec: MeshSpec,
        carried: Vec<(Rank, CarriedLink)>,
    ) -> Result<TcpTransport, TransportError> {
        let span = tracing::debug_span!("tcp_mesh", job = %spec.job, generation = spec.generation, rank = spec.rank);
        self.connect_mesh_inner(spec, carried, span.clone()).instrument(span).await
    }

    async fn connect_mesh_inner(
        &self,
        spec: MeshSpec,
        carried: Vec<(Rank, CarriedLink)>,
        span: tracing::Span,
    ) -> Result<TcpTransport, TransportError> {
        let world = u32::try_from(spec.peers.len())
            .map_err(|_| TransportError::InvalidArgument(format!("{} peers is too many", spec.peers.len())))?;
        if spec.rank >= world {
            return Err(TransportError::InvalidArgument(format!(
                "rank {} out of range for a world of {world}",
                spec.rank
            )));
        }
        crate::handshake::validate_job(&spec.job).map_err(TransportError::InvalidArgument)?;
        let rank = spec.rank;
        // Set membership in O(1): a plan lists O(log N) ranks, but a world may be large.
        let mut planned = vec![false; world as usize];
        for peer in 0..world {
            planned[peer as usize] = spec.upfront.includes(rank, peer);
        }
        // The set-up dials the lower planned peers: their addresses must be given.
        if let Some(peer) = (0..rank).find(|&p| planned[p as usize] && spec.peers[p as usize] == UNKNOWN_PEER) {
            return Err(TransportError::InvalidArgument(format!(
                "rank {peer} is linked at set-up but its address is not given"
            )));
        }
        let deadline = Instant::now() + spec.deadlines.connect;
        let notes = SharedNotes::default();
        let (tx, mut rx) = mpsc::channel(world as usize + 8);
        let registration = self.router.register(&spec.job, spec.generation, world, tx, Arc::clone(&notes))?;
        let ctx = Arc::new(MeshCtx {
            job: spec.job.clone(),
            generation: spec.generation,
            rank,
            world,
            token: spec.token.clone(),
            options: self.options.clone(),
            deadline,
            notes: Arc::clone(&notes),
            pace: crate::deadline::Pace::shared(crate::activity::Activity::for_mesh(&spec.job, spec.generation, rank)),
        });
        let mut gathering = Gathering::new(rank, planned, notes);
        let mut tasks = PairTasks::new();
        // Carried links first: a peer with one is re-bound, not dialled (its dialler falls
        // back to a fresh dial if the re-bind fails).
        let mut rebinding = vec![false; world as usize];
        for (peer, link) in carried {
            let Some(addr) = spec.peers.get(peer as usize).copied().filter(|_| gathering.is_planned(peer)) else {
                continue; // dropping the link shuts it down
            };
            if std::mem::replace(&mut rebinding[peer as usize], true) {
                continue;
            }
            let ctx = Arc::clone(&ctx);
            tasks.dials.spawn(
                async move {
                    match carry::rebind(&ctx, peer, link).await {
                        Ok((stream, skipped)) => {
                            tracing::debug!(peer, skipped, "tcp link carried over");
                            Paired::Linked(peer, Arrived { stream, carried: true })
                        }
                        Err(detail) if peer < ctx.rank => {
                            tracing::debug!(peer, "{detail}; dialling a fresh connection");
                            mesh::dial(ctx, peer, addr).await
                        }
                        Err(detail) => Paired::Noted { claimed: Some(peer), detail },
                    }
                }
                .instrument(span.clone()),
            );
        }
        for (peer, addr) in spec.peers.iter().enumerate().take(rank as usize) {
            if gathering.is_planned(peer as Rank) && !rebinding[peer] {
                tasks.dials.spawn(mesh::dial(Arc::clone(&ctx), peer as Rank, *addr).instrument(span.clone()));
            }
        }
        let rules = Rules { what: "TCP", connect: spec.deadlines.connect, deadline, max_accepting: MAX_HANDSHAKING };
        let handshake = |inc: Incoming| mesh::accept(Arc::clone(&ctx), inc);
        // A peer outside the plan may dial early (it needs the link already): its link is
        // kept, but the set-up does not wait for such links. A fresh connection replaces a
        // carried one (the dialler uses its last), and a carried one that comes second is
        // not used.
        let admit = |g: &mut Gathering<Arrived>, peer: Rank, arrived: Arrived| {
            if arrived.carried && g.has(peer) {
                carry::close(arrived.stream);
            } else if let Some(earlier) = g.keep(peer, arrived) {
                if earlier.carried {
                    carry::close(earlier.stream);
                }
            }
        };
        mesh_setup::gather(&mut gathering, &mut tasks, &mut rx, handshake, admit, &rules).await?;
        let mut carried = 0;
        let mut links = Vec::with_capacity(world as usize);
        for (peer, arrived) in gathering.into_links().into_iter().enumerate() {
            links.push(match arrived {
                Some(Arrived { stream, carried: was_carried }) => {
                    carried += usize::from(was_carried);
                    Some(TcpLink::new(
                        peer as Rank,
                        spec.generation,
                        self.options.max_frame,
                        spec.deadlines,
                        Arc::clone(&ctx.pace),
                        spec.peers.get(peer).copied().filter(|&a| a != UNKNOWN_PEER),
                        self.options.busy_poll,
                        stream,
                        span.clone(),
                    )?)
                }
                None => None,
            });
        }
        let links = Links::new("TCP", spec.generation, rank, links, span.clone());
        let links = Arc::new(if spec.carry_links { links.keep_open_on_abort() } else { links });
        let linked = links.linked();
        let on_demand =
            Arc::new(OnDemand::new((*ctx).clone(), spec.deadlines, spec.peers, spec.resolver, span.clone()));
        // The endpoint keeps routing this generation's connections here: peers outside the
        // plan dial when they first need their link.
        let late = tokio::spawn(
            on_demand::serve_late(Arc::clone(&on_demand), Arc::clone(&links), rx, tasks).instrument(span.clone()),
        );
        tracing::debug!(world, linked, carried, "tcp mesh up");
        Ok(TcpTransport { job: spec.job.into(), links, carried, on_demand, late, _registration: registration })
    }
}

/// A connected generation over TCP: one link per linked peer, more made on first use (see
/// [`Upfront`]). `Send + Sync`; share it behind `Arc`.
pub struct TcpTransport {
    job: Arc<str>,
    /// Indexed by rank; empty for this rank and for peers not linked yet.
    links: Arc<Links<TcpLink>>,
    /// How many of the set-up's links were carried over from the previous generation.
    carried: usize,
    /// How to link a peer on first use.
    on_demand: Arc<OnDemand>,
    /// Accepts the links peers make on first use ([`on_demand::serve_late`]).
    late: tokio::task::JoinHandle<()>,
    /// Keeps the endpoint routing this generation's connections to `late`.
    _registration: endpoint::Registration,
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.late.abort();
    }
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("job", &self.job)
            .field("generation", &self.links.generation)
            .field("rank", &self.links.rank)
            .field("world", &self.links.world)
            .finish_non_exhaustive()
    }
}

impl TcpTransport {
    /// The job this transport belongs to.
    pub fn job(&self) -> &str {
        &self.job
    }

    /// How many of the links made at set-up were carried over from the previous generation
    /// ([`TcpEndpoint::connect_mesh_carrying`]) rather than dialled.
    pub fn carried_links(&self) -> usize {
        self.carried
    }

    /// Hands this generation's links on to the next generation's set-up: the returned handle
    /// gives out each clean link's socket ([`CarriedLinks::take`]) and shuts the others down
    /// when it drops. The transport is aborted first if it was not; every later operation on
    /// it fails. Links are clean only if the mesh was set up with
    /// [`MeshSpec::carry_links`] (otherwise the abort shut them down).
    pub fn carry_over(&self) -> CarriedLinks {
        CarriedLinks::of(&self.links)
    }

    /// Whether the liveness responder of `peer`'s endpoint has answered since the link came
    /// up (stalls past the learned deadline are settled by asking it; see [`liveness`]).
    pub fn peer_probed(&self, peer: Rank) -> bool {
        self.links.get(peer).is_some_and(TcpLink::peer_probed)
    }

    /// Links `peer` first if no link to it exists yet (see [`Upfront`]); raced against the
    /// abort like every operation. Ranks out of range and this rank itself are left to the
    /// operation, which names them.
    ///
    /// # Cancel safety
    /// Cancel safe (see [`on_demand::OnDemand::link`]).
    async fn ensure_link(&self, peer: Rank) -> Result<(), TransportError> {
        if peer == self.links.rank || peer >= self.links.world || self.links.get(peer).is_some() {
            return Ok(());
        }
        self.links.guarded(self.on_demand.link(&self.links, peer)).await
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> Rank {
        self.links.rank
    }

    fn world_size(&self) -> u32 {
        self.links.world
    }

    fn generation(&self) -> u64 {
        self.links.generation
    }

    async fn send(&self, peer: Rank, tag: Tag, data: &[u8]) -> Result<(), TransportError> {
        self.ensure_link(peer).await?;
        self.links.send(peer, tag, data).await
    }

    async fn recv(&self, peer: Rank, tag: Tag, buf: &mut [u8]) -> Result<(), TransportError> {
        self.ensure_link(peer).await?;
        self.links.recv(peer, tag, buf).await
    }

    fn abort(&self, reason: AbortReason) {
        self.links.abort(reason);
    }

    fn is_aborted(&self) -> bool {
        self.links.is_aborted()
    }

    /// [`PIPELINE_SEGMENT`].
    fn pipeline_segment(&self) -> Option<usize> {
        Some(PIPELINE_SEGMENT)
    }

    fn deadlines_in_force(&self) -> Vec<(Rank, DeadlineInForce)> {
        self.links.deadlines_in_force()
    }

    fn linked_peers(&self) -> usize {
        self.links.linked()
    }
}
