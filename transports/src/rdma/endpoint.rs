//! The per-process RDMA endpoint: device, protection domain, buffer pool and bootstrap
//! listener, and the building of one generation's mesh from it ([`RdmaEndpoint::connect_mesh`]).

use super::address::{self, EndpointAddress, RdmaAddress, RecvRegion, MAX_24BIT};
use super::cq::CompletionQueue;
use super::credits::{RecvRing, SendWindow};
use super::device::{Device, DeviceConfig};
use super::late::PeerProbe;
use super::memory::{BufferPool, PooledBuffer};
use super::peer::{Peer, PeerState, WR_RECV};
use super::progress::{progress, Inner};
use super::qp::{QpTiming, QueuePair};
use super::setup::{self, MeshCtx, PairSetup};
use super::transport::RdmaTransport;
use crate::activity::Activity;
use crate::handshake::validate_job;
use crate::liveness::{self, Responder};
use crate::mesh_setup::{self, Arrivals, Gathering, PairTasks, Rules, SharedNotes};
use crate::{Deadlines, Rank, TransportError};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::Instrument;

/// Configuration of an [`RdmaEndpoint`] and the transports it builds.
#[derive(Clone, Debug)]
pub struct RdmaOptions {
    /// Device, port and GID selection.
    pub device: DeviceConfig,
    /// Where to bind the bootstrap listener (port 0 picks a free port).
    pub bootstrap_bind: SocketAddr,
    /// Bootstrap address to publish; defaults to the bound address (set it when binding a
    /// wildcard address). Port 0 here means the port the listener was bound to.
    pub advertise: Option<SocketAddr>,
    /// Bytes per receive slot (header included). Default 256 KiB.
    pub slot_bytes: u32,
    /// Slots per peer ring. Default 16.
    pub slots: u32,
    /// Largest message accepted from a peer. Default 1 GiB.
    pub max_message: u64,
    /// Per peer: bytes of early messages copied out of the ring to wait for their receive.
    /// Default 64 MiB.
    pub max_unexpected_bytes: u64,
    /// Poll the completion queue in a loop instead of sleeping on completion events.
    pub busy_poll: bool,
    /// RC timeouts and retry counts.
    pub timing: QpTiming,
    /// Idle registered memory the endpoint keeps for later generations. Default 256 MiB.
    pub max_cached_bytes: usize,
}

impl Default for RdmaOptions {
    fn default() -> Self {
        Self {
            device: DeviceConfig::default(),
            bootstrap_bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            slot_bytes: 256 << 10,
            slots: 16,
            max_message: 1 << 30,
            max_unexpected_bytes: 64 << 20,
            busy_poll: false,
            timing: QpTiming::default(),
            max_cached_bytes: 256 << 20,
        }
    }
}

/// What one generation's RDMA mesh is made of.
#[derive(Clone, Debug)]
pub struct RdmaMeshSpec {
    /// Job id (1..=256 bytes).
    pub job: String,
    /// Generation being formed.
    pub generation: u64,
    /// This process's rank.
    pub rank: Rank,
    /// Endpoint address of every rank, indexed by rank (this rank's own entry is ignored).
    pub peers: Vec<EndpointAddress>,
    /// The job token; only HMAC proofs derived from it cross the wire.
    pub token: Vec<u8>,
    /// Connect and no-progress deadlines.
    pub deadlines: Deadlines,
}

/// A worker's long-lived RDMA endpoint: device, protection domain, registered-memory pool
/// and bootstrap listener.
pub struct RdmaEndpoint {
    // Field order is drop order: responder, listener, pool (deregisters idle buffers), then
    // device.
    /// Answers peers' liveness and status probes on the UDP port of the bootstrap listener
    /// ([`crate::liveness`]); `None` if that port was taken (peers then wait up to the
    /// ceiling on this endpoint's links).
    pub(super) _responder: Option<Responder>,
    pub(super) listener: tokio::sync::Mutex<TcpListener>,
    pub(super) pool: BufferPool,
    pub(super) address: EndpointAddress,
    pub(super) options: RdmaOptions,
    pub(super) device: Arc<Device>,
}

impl std::fmt::Debug for RdmaEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaEndpoint").field("address", &self.address).field("device", &self.device).finish()
    }
}

pub(super) fn check_options(o: &RdmaOptions) -> Result<(), TransportError> {
    let bad = |m: String| Err(TransportError::InvalidArgument(m));
    if !(address::MIN_SLOT_BYTES..=address::MAX_SLOT_BYTES).contains(&o.slot_bytes) {
        return bad(format!(
            "slot_bytes {} outside {}..={}",
            o.slot_bytes,
            address::MIN_SLOT_BYTES,
            address::MAX_SLOT_BYTES
        ));
    }
    if o.slots == 0 || o.slots > address::MAX_SLOTS {
        return bad(format!("slots {} outside 1..={}", o.slots, address::MAX_SLOTS));
    }
    if u64::from(o.slot_bytes) * u64::from(o.slots) > u64::from(u32::MAX) {
        return bad("a ring of slots x slot_bytes must stay below 4 GiB".into());
    }
    Ok(())
}

/// The bootstrap address to publish: `advertise` (its port 0 replaced by the bound port), or
/// the bound address `local`. A wildcard IP cannot be dialled, so it is refused.
pub(super) fn bootstrap_address(
    advertise: Option<SocketAddr>,
    local: SocketAddr,
) -> Result<SocketAddr, TransportError> {
    let mut bootstrap = advertise.unwrap_or(local);
    if bootstrap.port() == 0 {
        bootstrap.set_port(local.port());
    }
    if bootstrap.ip().is_unspecified() {
        return Err(TransportError::InvalidArgument(format!(
            "bootstrap listener bound to {local}: set RdmaOptions::advertise to a reachable address"
        )));
    }
    Ok(bootstrap)
}

/// Binds the bootstrap listener on `bind` and starts the liveness responder on the UDP port
/// equal to its address (as a [`crate::tcp::TcpEndpoint`] does on its listener's), so that
/// peers waiting on this rank can ask where it is. Needs no device.
///
/// # Cancel safety
/// Cancel safe: dropping the future releases the listener (the responder is started last,
/// without awaiting).
pub(super) async fn bind_bootstrap(
    bind: SocketAddr,
) -> Result<(TcpListener, SocketAddr, Option<Responder>), TransportError> {
    let listener = TcpListener::bind(bind)
        .await
        .map_err(|e| TransportError::Io(format!("binding the rdma bootstrap listener on {bind}: {e}")))?;
    let local = listener.local_addr().map_err(|e| TransportError::Io(format!("bootstrap listener address: {e}")))?;
    let responder = Responder::start(local);
    Ok((listener, local, responder))
}

impl RdmaEndpoint {
    /// Opens the device and binds the bootstrap listener. Fails with
    /// [`TransportError::Io`] naming what is missing when there is no usable device, and
    /// with [`TransportError::InvalidArgument`] for impossible options.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future releases whatever was opened.
    pub async fn open(options: RdmaOptions) -> Result<Self, TransportError> {
        check_options(&options)?;
        let device = Arc::new(Device::open(&options.device)?);
        let (listener, local, responder) = bind_bootstrap(options.bootstrap_bind).await?;
        let bootstrap = bootstrap_address(options.advertise, local)?;
        let address = EndpointAddress { lid: device.lid(), gid: device.gid(), mtu: device.mtu(), bootstrap };
        let pool = BufferPool::new(device.clone(), options.max_cached_bytes);
        Ok(Self { _responder: responder, listener: tokio::sync::Mutex::new(listener), pool, address, options, device })
    }

    /// The address to publish through the coordinator (`EndpointAddress::encode`).
    pub fn address(&self) -> &EndpointAddress {
        &self.address
    }

    /// Name of the device in use.
    pub fn device_name(&self) -> &str {
        self.device.name()
    }

    /// The options in force.
    pub fn options(&self) -> &RdmaOptions {
        &self.options
    }

    /// Connects this rank to every other rank of `spec.generation`: creates a queue pair and
    /// receive ring per peer, exchanges their descriptions over the authenticated bootstrap
    /// and brings every queue pair to RTS. Bounded by `spec.deadlines.connect`; one set-up at
    /// a time per endpoint (a second waits for the first).
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future stops the set-up tasks and frees the queue pairs.
    pub async fn connect_mesh(&self, spec: RdmaMeshSpec) -> Result<RdmaTransport, TransportError> {
        let span = tracing::info_span!("rdma_mesh", job = %spec.job, generation = spec.generation, rank = spec.rank);
        self.connect_inner(spec).instrument(span).await
    }

    pub(super) async fn connect_inner(&self, spec: RdmaMeshSpec) -> Result<RdmaTransport, TransportError> {
        let world =
            u32::try_from(spec.peers.len()).map_err(|_| TransportError::InvalidArgument("too many peers".into()))?;
        if spec.rank >= world {
            return Err(TransportError::InvalidArgument(format!("rank {} outside a world of {world}", spec.rank)));
        }
        validate_job(&spec.job).map_err(TransportError::InvalidArgument)?;
        let deadline = Instant::now() + spec.deadlines.connect;
        let o = &self.options;
        let peers_n = world.saturating_sub(1);
        // Per QP: sends = data writes (peer's slots, assumed like ours) + credit sends.
        let send_wr = 2 * o.slots + 8;
        let recv_wr = 2 * o.slots + 8;
        let cq_entries =
            i32::try_from(u64::from(peers_n.max(1)) * u64::from(send_wr + recv_wr) + 64).unwrap_or(i32::MAX);
        let cq = Arc::new(CompletionQueue::new(&self.device, cq_entries)?);
        let mut pairs: Vec<Option<PairSetup>> = Vec::with_capacity(world as usize);
        let mut rings: Vec<Option<PooledBuffer>> = Vec::with_capacity(world as usize);
        for r in 0..world {
            if r == spec.rank {
                pairs.push(None);
                rings.push(None);
                continue;
            }
            let qp = Arc::new(QueuePair::new(&self.device, &cq, send_wr, recv_wr)?);
            let ring = self.pool.get((o.slots * o.slot_bytes) as usize, true)?;
            for _ in 0..recv_wr {
                qp.post_recv(WR_RECV)?;
            }
            let mut psn_bytes = [0u8; 4];
            getrandom::fill(&mut psn_bytes)
                .map_err(|e| TransportError::Io(format!("no randomness for the PSN: {e}")))?;
            let local = RdmaAddress {
                lid: self.device.lid(),
                gid: self.device.gid(),
                qpn: qp.qpn(),
                psn: u32::from_le_bytes(psn_bytes) & MAX_24BIT,
                mtu: self.device.mtu(),
                slot_bytes: o.slot_bytes,
                ring: RecvRegion { addr: ring.addr(), rkey: ring.rkey(), len: o.slots * o.slot_bytes },
            };
            pairs.push(Some(PairSetup { qp, local }));
            rings.push(Some(ring));
        }
        let ctx = Arc::new(MeshCtx {
            job: spec.job.clone(),
            generation: spec.generation,
            rank: spec.rank,
            world,
            token: spec.token.clone(),
            deadline,
            timing: o.timing,
            max_slots: o.slots,
            pairs,
            claimed: Mutex::new(vec![false; world as usize]),
        });
        let remotes = self.exchange(&ctx, &spec, world, deadline).await?;
        let mut peers = Vec::with_capacity(world as usize);
        let mut by_qpn = HashMap::new();
        for ((r, pair), (ring, remote)) in ctx.pairs.iter().enumerate().zip(rings.into_iter().zip(remotes)) {
            let (Some(pair), Some(ring), Some(remote)) = (pair, ring, remote) else {
                peers.push(None);
                continue;
            };
            let staging = self.pool.get((remote.slots() * remote.slot_bytes) as usize, false)?;
            by_qpn.insert(pair.qp.qpn(), r as Rank);
            let liveness = spec.deadlines.learning.map(|_| late_probe(spec.peers[r].bootstrap));
            let now = Instant::now();
            peers.push(Some(Peer {
                rank: r as Rank,
                qp: pair.qp.clone(),
                state: Mutex::new(PeerState {
                    window: SendWindow::new(remote.slots()),
                    ring: RecvRing::new(o.slots, (o.slots / 4).max(1)),
                    inbound: HashMap::new(),
                    broken: None,
                    last_progress: now,
                    staged_bytes: 0,
                    staged_msgs: 0,
                    credit_backlog: 0,
                    credit_sends: 0,
                }),
                ring,
                staging,
                remote,
                local_slot_bytes: o.slot_bytes,
                wake: watch::channel(0).0,
                send_lock: tokio::sync::Mutex::new(()),
                liveness,
            }));
        }
        let (stop_tx, stop_rx) = watch::channel(false);
        let inner = Arc::new(Inner {
            peers,
            by_qpn,
            cq,
            rank: spec.rank,
            world,
            generation: spec.generation,
            deadlines: spec.deadlines,
            max_message: o.max_message,
            max_unexpected: o.max_unexpected_bytes,
            abort: Mutex::new(None),
            aborted: AtomicBool::new(false),
            board: Activity::for_mesh(&spec.job, spec.generation, spec.rank),
            span: tracing::info_span!("rdma_link", job = %spec.job, generation = spec.generation, rank = spec.rank),
        });
        let span =
            tracing::info_span!("rdma_progress", job = %spec.job, generation = spec.generation, rank = spec.rank);
        let engine = tokio::spawn(progress(inner.clone(), stop_rx, o.busy_poll).instrument(span));
        tracing::info!(world, "rdma mesh connected");
        Ok(RdmaTransport { inner, stop: stop_tx, engine })
    }

    pub(super) async fn exchange(
        &self,
        ctx: &Arc<MeshCtx>,
        spec: &RdmaMeshSpec,
        world: u32,
        deadline: Instant,
    ) -> Result<Vec<Option<RdmaAddress>>, TransportError> {
        let mut tasks = PairTasks::new();
        for j in 0..spec.rank {
            tasks.dials.spawn(setup::dial(ctx.clone(), j, spec.peers[j as usize].bootstrap));
        }
        let mut gathering = Gathering::new(spec.rank, vec![true; world as usize], SharedNotes::default());
        let listener = match tokio::time::timeout_at(deadline, self.listener.lock()).await {
            Ok(l) => l,
            Err(_) => {
                return Err(TransportError::Io("another connect_mesh held the endpoint past the deadline".into()))
            }
        };
        let mut arrivals = Bootstrap(&listener);
        let rules = Rules { what: "RDMA", connect: spec.deadlines.connect, deadline, max_accepting: MAX_HANDSHAKING };
        let handshake = |(s, from)| setup::accept_one(ctx.clone(), s, from);
        let gathered =
            mesh_setup::gather(&mut gathering, &mut tasks, &mut arrivals, handshake, Gathering::keep_latest, &rules)
                .await;
        // Stop connections still being refused (strangers); they hold the set-up context.
        tasks.accepts.shutdown().await;
        tasks.dials.shutdown().await;
        gathered?;
        Ok(gathering.into_links())
    }
}

/// Most accepted bootstrap connections in their handshake at once during a set-up.
const MAX_HANDSHAKING: usize = 64;

/// The bootstrap listener, held by one set-up.
struct Bootstrap<'a>(&'a TcpListener);

impl Arrivals for Bootstrap<'_> {
    type Conn = (TcpStream, SocketAddr);

    async fn next(&mut self) -> Result<(TcpStream, SocketAddr), TransportError> {
        loop {
            match self.0.accept().await {
                Ok(conn) => return Ok(conn),
                // The connection went before it was accepted: not the listener's problem.
                Err(e)
                    if matches!(e.kind(), std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::Interrupted) => {}
                Err(e) => return Err(TransportError::Io(format!("accepting on the RDMA bootstrap listener: {e}"))),
            }
        }
    }
}

/// Where a link of this mesh asks whether the peer behind bootstrap address `target` runs:
/// its responder is asked once now, in the background, so that a later silence can be
/// trusted ([`liveness::verify`]).
fn late_probe(target: SocketAddr) -> PeerProbe {
    PeerProbe { target, verified: liveness::verify_in_background(target) }
}

#[cfg(test)]
mod tests {
    use super::bootstrap_address;
    use std::net::SocketAddr;

    fn a(s: &str) -> SocketAddr {
        s.parse().expect("socket address")
    }

    #[test]
    fn bootstrap_address_takes_the_bound_port_when_advertised_without_one() {
        let local = a("0.0.0.0:45001");
        assert_eq!(bootstrap_address(Some(a("10.0.0.5:0")), local).ok(), Some(a("10.0.0.5:45001")));
        assert_eq!(bootstrap_address(Some(a("10.0.0.5:7000")), local).ok(), Some(a("10.0.0.5:7000")));
        assert_eq!(bootstrap_address(Some(a("[fd00::5]:0")), a("[::]:45002")).ok(), Some(a("[fd00::5]:45002")));
        assert_eq!(bootstrap_address(None, a("127.0.0.1:45003")).ok(), Some(a("127.0.0.1:45003")));
        assert!(bootstrap_address(None, local).is_err());
        assert!(bootstrap_address(Some(a("0.0.0.0:0")), local).is_err());
    }
}

#[cfg(test)]
mod responder_tests {
    use super::bind_bootstrap;
    use crate::activity::{job_digest, Activity};
    use crate::liveness::{probe, Answer, Query, Status};
    use std::time::Duration;

    /// The endpoint's bootstrap listener comes with a liveness responder on the same port
    /// (UDP), which answers a status probe with this process's board for the mesh asked
    /// about: what a peer waiting on this rank reads. No device needed.
    #[tokio::test]
    async fn the_bootstrap_port_answers_status_probes_from_the_board() {
        // A UDP port equal to a free TCP port may be taken by another test's socket: the
        // responder is then `None` (logged), so try a few listeners.
        let mut bound = None;
        for _ in 0..20 {
            let (listener, local, responder) = bind_bootstrap("127.0.0.1:0".parse().unwrap()).await.expect("bind");
            if let Some(r) = responder {
                bound = Some((listener, local, r));
                break;
            }
        }
        let (_listener, local, _responder) = bound.expect("a responder on one of 20 bootstrap ports");
        let board = Activity::for_mesh("rdma-endpoint-responder-test", 4, 2);
        let _call = board.enter(9);
        let query = Query { job: job_digest("rdma-endpoint-responder-test"), generation: 4, rank: 2, seq: 9 };
        match probe(local, Duration::from_secs(2), query).await {
            Answer::Alive(Some(Status { presence: Some(p), .. })) => {
                assert_eq!((p.entered, p.pending, p.late_waits), (Some(9), 1, 0), "{p:?}");
            }
            other => panic!("expected the board in the answer, got {other:?}"),
        }
        // A mesh this process does not have: alive, no board.
        let other = Query { generation: 5, ..query };
        assert!(matches!(
            probe(local, Duration::from_secs(2), other).await,
            Answer::Alive(Some(Status { presence: None, .. }))
        ));
    }
}
