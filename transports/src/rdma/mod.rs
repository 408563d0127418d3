//! RDMA transport over libibverbs (cargo feature `rdma`), in the manner of Gloo's ibverbs
//! transport: reliable-connected queue pairs, registered receive rings, and RDMA writes with
//! immediate for data.
//!
//! # Usage
//! A worker opens one [`RdmaEndpoint`] for its lifetime ([`RdmaEndpoint::open`]): it opens
//! the device, allocates the protection domain and binds a TCP *bootstrap* listener. It
//! publishes [`RdmaEndpoint::address`] (LID, GID, MTU and the bootstrap address, encoded by
//! [`EndpointAddress::encode`]) as its `TransportAddress { transport: "rdma" }` when it joins,
//! so it reaches every member through the coordinator's generation record, the same path TCP
//! addresses take. For each generation it calls [`RdmaEndpoint::connect_mesh`] with every
//! member's decoded endpoint address.
//!
//! # Address exchange
//! Queue pairs exist per pair of ranks and per generation, so their numbers cannot be known
//! at join time. The record carries what is stable (LID/GID/MTU, bootstrap address); the
//! per-pair QPN, initial PSN and receive-ring region ([`RdmaAddress`]) are exchanged over
//! the bootstrap connection, after the same HMAC challenge–response as the TCP transport
//! (job, generation, ranks, world size, job token) and MAC-bound to that session. See
//! [`setup`] for the protocol.
//!
//! # Data path
//! Each rank registers, per peer, a ring of `slots` slots of `slot_bytes` bytes (from the
//! endpoint's [`memory::BufferPool`], so registrations are reused across generations) and a
//! send staging area of the peer's ring size. A message is cut into segments of at most
//! `slot_bytes - 48` bytes; each is a 48-byte header ([`wire`]: generation, tag, lengths,
//! offset) plus payload, copied into the staging slot and RDMA-written with immediate into
//! the same slot of the peer's ring; the immediate names the slot and carries tag check
//! bits. A sender writes only slots it holds credits for ([`credits`]); the receiver copies
//! the payload from the slot straight into the caller's buffer and returns credits with
//! zero-length sends with immediate. Messages for which no receive waits yet are copied out of
//! the ring into memory (up to [`RdmaOptions::max_unexpected_bytes`] per peer), beyond that
//! they stay in their slots and the sender runs out of credits: back-pressure, not
//! unbounded memory. A zero-copy path would register the caller's buffers through a
//! registration cache and gather header and payload with two SGEs; it is not implemented
//! because user buffers may be freed and reused behind a cache's back.
//!
//! A progress task per transport drives the completion queue ([`cq`]) and wakes the
//! operations waiting on each peer.
//!
//! # Failures
//! Identical to TCP: an error completion or QP failure closes the link to that peer
//! ([`status`] maps statuses: retries exhausted and remote errors are
//! [`TransportError::PeerClosed`], local errors [`TransportError::Io`]); a bad header,
//! another generation, an oversize message, a stale tag or a credit violation is
//! [`TransportError::Protocol`]; a length or signature disagreement is
//! [`TransportError::Mismatch`] and closes the link; no completion on a link for
//! [`Deadlines::no_progress`] while an operation waits is [`TransportError::Timeout`].
//! [`Transport::abort`] is local and immediate: it moves every QP to the error state
//! (flushing outstanding work requests, never waiting on a peer) and wakes every waiter with
//! [`TransportError::Aborted`].
//!
//! Resources are freed in order on drop: queue pairs, then registered buffers (back to the
//! pool), completion queue and channel; the endpoint's pool, protection domain and device
//! context go last, with the endpoint.

pub mod address;
pub mod cq;
pub mod credits;
pub mod device;
pub mod memory;
pub mod qp;
pub mod setup;
pub mod status;
pub mod wire;

pub use address::{EndpointAddress, Mtu, RdmaAddress, RecvRegion};
pub use device::{device_names, DeviceConfig};
pub use qp::QpTiming;

use crate::tcp::frame::seq_older;
use crate::tcp::handshake::validate_job;
use crate::{AbortReason, Deadlines, Rank, Tag, Transport, TransportError};
use address::MAX_24BIT;
use cq::{Completion, CompletionQueue};
use credits::{segments, Reassembly, RecvRing, SendWindow};
use device::Device;
use memory::{BufferPool, PooledBuffer};
use qp::QueuePair;
use rdma_sys::ibv_wc_opcode as op;
use setup::{MeshCtx, Outcome, PairSetup};
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::Instrument;
use wire::{DataImm, SegmentHeader, SEGMENT_HEADER_LEN};

const HDR: u32 = SEGMENT_HEADER_LEN as u32;
const WR_RECV: u64 = 1 << 56;
const WR_WRITE: u64 = 2 << 56;
const WR_CREDIT: u64 = 3 << 56;
const WR_KIND_MASK: u64 = 0xff << 56;
/// Per peer: most early messages copied out of the ring at once (bounds the bookkeeping of
/// empty messages, which cost no bytes).
const MAX_STAGED_MESSAGES: u32 = 4096;

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
    // Field order is drop order: listener, pool (deregisters idle buffers), then device.
    listener: tokio::sync::Mutex<TcpListener>,
    pool: BufferPool,
    address: EndpointAddress,
    options: RdmaOptions,
    device: Arc<Device>,
}

impl std::fmt::Debug for RdmaEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaEndpoint").field("address", &self.address).field("device", &self.device).finish()
    }
}

fn check_options(o: &RdmaOptions) -> Result<(), TransportError> {
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
fn bootstrap_address(advertise: Option<SocketAddr>, local: SocketAddr) -> Result<SocketAddr, TransportError> {
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
        let listener = TcpListener::bind(options.bootstrap_bind).await.map_err(|e| {
            TransportError::Io(format!("binding the rdma bootstrap listener on {}: {e}", options.bootstrap_bind))
        })?;
        let local =
            listener.local_addr().map_err(|e| TransportError::Io(format!("bootstrap listener address: {e}")))?;
        let bootstrap = bootstrap_address(options.advertise, local)?;
        let address = EndpointAddress { lid: device.lid(), gid: device.gid(), mtu: device.mtu(), bootstrap };
        let pool = BufferPool::new(device.clone(), options.max_cached_bytes);
        Ok(Self { listener: tokio::sync::Mutex::new(listener), pool, address, options, device })
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

    async fn connect_inner(&self, spec: RdmaMeshSpec) -> Result<RdmaTransport, TransportError> {
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
        });
        let span =
            tracing::info_span!("rdma_progress", job = %spec.job, generation = spec.generation, rank = spec.rank);
        let engine = tokio::spawn(progress(inner.clone(), stop_rx, o.busy_poll).instrument(span));
        tracing::info!(world, "rdma mesh connected");
        Ok(RdmaTransport { inner, stop: stop_tx, engine })
    }

    async fn exchange(
        &self,
        ctx: &Arc<MeshCtx>,
        spec: &RdmaMeshSpec,
        world: u32,
        deadline: Instant,
    ) -> Result<Vec<Option<RdmaAddress>>, TransportError> {
        let mut set: JoinSet<Result<Outcome, TransportError>> = JoinSet::new();
        for j in 0..spec.rank {
            set.spawn(setup::dial(ctx.clone(), j, spec.peers[j as usize].bootstrap));
        }
        let mut remotes: Vec<Option<RdmaAddress>> = vec![None; world as usize];
        let mut missing = world - 1;
        let mut to_accept = world - 1 - spec.rank;
        let mut notes: Vec<String> = Vec::new();
        let listener = match tokio::time::timeout_at(deadline, self.listener.lock()).await {
            Ok(l) => l,
            Err(_) => {
                return Err(TransportError::Io("another connect_mesh held the endpoint past the deadline".into()))
            }
        };
        while missing > 0 {
            tokio::select! {
                acc = listener.accept(), if to_accept > 0 => match acc {
                    Ok((s, from)) => { set.spawn(setup::accept_one(ctx.clone(), s, from)); }
                    Err(e) => notes.push(format!("accept failed: {e}")),
                },
                Some(res) = set.join_next(), if !set.is_empty() => match res {
                    Ok(Ok(Outcome::Connected(r, remote))) => {
                        if remotes[r as usize].replace(remote).is_none() {
                            missing -= 1;
                            if r > spec.rank {
                                to_accept -= 1;
                            }
                        }
                    }
                    Ok(Ok(Outcome::Refused(note))) => {
                        tracing::debug!(%note, "refused a bootstrap connection");
                        if notes.len() < 8 {
                            notes.push(note);
                        }
                    }
                    Ok(Err(e)) => return Err(e),
                    Err(e) => return Err(TransportError::Io(format!("set-up task failed: {e}"))),
                },
                _ = tokio::time::sleep_until(deadline) => {
                    let first = (0..world).find(|&r| r != spec.rank && remotes[r as usize].is_none()).unwrap_or(0);
                    let extra = if notes.is_empty() { String::new() } else { format!(" (refused: {})", notes.join("; ")) };
                    return Err(TransportError::Handshake {
                        peer: first,
                        detail: format!("connect deadline of {:?} passed before rank {first} connected{extra}", spec.deadlines.connect),
                    });
                }
            }
        }
        // Stop connections still being refused (strangers); they hold the set-up context.
        set.shutdown().await;
        Ok(remotes)
    }
}

/// A message (or part of one) that arrived for a tag.
#[derive(Debug)]
struct Inbound {
    signature: u32,
    reasm: Reassembly,
    /// A receive is registered for this tag.
    waiting: bool,
    /// Copies of early segments, from offset 0 to `heap_len`.
    heap: Option<Vec<u8>>,
    heap_len: u64,
    /// Bytes of `heap` already copied to the receiver.
    heap_copied: u64,
    /// Segments still in their slot: (slot, offset, length).
    in_slot: Vec<(u32, u64, u32)>,
    /// Whether any byte has gone to the receiver's buffer.
    touched: bool,
    /// Whether a header for it has arrived (a waiting receive creates the entry first).
    seen: bool,
}

impl Inbound {
    fn new() -> Self {
        Self {
            signature: 0,
            reasm: Reassembly::new(0),
            waiting: false,
            heap: None,
            heap_len: 0,
            heap_copied: 0,
            in_slot: Vec::new(),
            touched: false,
            seen: false,
        }
    }
}

struct PeerState {
    window: SendWindow,
    ring: RecvRing,
    inbound: HashMap<(u32, u32), Inbound>,
    broken: Option<TransportError>,
    last_progress: Instant,
    staged_bytes: u64,
    /// Early messages copied out of the ring, waiting for their receive.
    staged_msgs: u32,
    /// Credits owed to the peer that could not be posted yet (send queue budget).
    credit_backlog: u32,
    /// Credit sends posted and not yet completed.
    credit_sends: u32,
}

struct Peer {
    rank: Rank,
    // Declared before the buffers: the QP is destroyed before they go back to the pool.
    qp: Arc<QueuePair>,
    state: Mutex<PeerState>,
    ring: PooledBuffer,
    staging: PooledBuffer,
    remote: RdmaAddress,
    local_slot_bytes: u32,
    wake: watch::Sender<u64>,
    send_lock: tokio::sync::Mutex<()>,
}

impl Peer {
    fn lock(&self) -> MutexGuard<'_, PeerState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wake(&self) {
        self.wake.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Breaks the link (first error wins), moves the QP to error so the peer notices, and
    /// wakes every waiter.
    fn fail(&self, st: &mut PeerState, e: TransportError) -> TransportError {
        if st.broken.is_none() {
            tracing::warn!(peer = self.rank, error = %e, "rdma link failed");
            st.broken = Some(e);
            let _ = self.qp.to_error();
        }
        self.wake();
        st.broken.clone().unwrap_or_else(|| TransportError::Io("link failed".into()))
    }

    fn protocol(&self, st: &mut PeerState, detail: String) -> TransportError {
        let e = TransportError::Protocol { peer: self.rank, detail };
        self.fail(st, e)
    }

    /// Sends owed credits, within a budget of in-flight credit sends.
    fn flush_credits(&self, st: &mut PeerState, more: Option<u32>) {
        st.credit_backlog += more.unwrap_or(0);
        let budget = st.ring.slots();
        if st.credit_backlog == 0 || st.credit_sends >= budget || st.broken.is_some() {
            return;
        }
        let n = std::mem::take(&mut st.credit_backlog);
        match self.qp.post_send_imm(WR_CREDIT, n) {
            Ok(()) => st.credit_sends += 1,
            Err(e) => {
                self.fail(st, e);
            }
        }
    }

    /// The oldest seq a receive waits for on this link.
    fn oldest_waiting(st: &PeerState) -> Option<u32> {
        st.inbound
            .iter()
            .filter(|(_, e)| e.waiting)
            .map(|(k, _)| k.0)
            .reduce(|a, b| if seq_older(b, a) { b } else { a })
    }

    /// Handles the arrival of a data segment announced by `imm`.
    fn on_data(&self, st: &mut PeerState, imm: u32, generation: u64, max_message: u64, max_unexpected: u64) {
        let imm = DataImm::from_u32(imm);
        let slot = u32::from(imm.slot);
        if let Err(e) = st.ring.arrive(slot) {
            self.protocol(st, e.to_string());
            return;
        }
        let base = (slot * self.local_slot_bytes) as usize;
        let mut raw = [0u8; SEGMENT_HEADER_LEN];
        if let Err(e) = self.ring.read_at(base, &mut raw) {
            self.fail(st, e);
            return;
        }
        let h = match SegmentHeader::decode(&raw, imm, generation, max_message, self.local_slot_bytes - HDR) {
            Ok(h) => h,
            Err(e) => {
                self.protocol(st, e.to_string());
                return;
            }
        };
        let key = (h.tag.seq, h.tag.step);
        if !st.inbound.contains_key(&key) {
            if let Some(oldest) = Self::oldest_waiting(st) {
                if seq_older(h.tag.seq, oldest) {
                    let d = format!(
                        "stale segment seq {} step {} (the oldest message still expected is seq {oldest})",
                        h.tag.seq, h.tag.step
                    );
                    self.protocol(st, d);
                    return;
                }
            }
        }
        let entry = st.inbound.entry(key).or_insert_with(Inbound::new);
        if !entry.seen {
            entry.seen = true;
            entry.signature = h.tag.signature;
            entry.reasm = Reassembly::new(h.total);
        } else if entry.signature != h.tag.signature || entry.reasm.total() != h.total {
            let d =
                format!("segment of seq {} step {} changes the message's signature or length", h.tag.seq, h.tag.step);
            self.protocol(st, d);
            return;
        }
        if let Err(e) = entry.reasm.accept(h.offset, u64::from(h.seg_len)) {
            self.protocol(st, e.to_string());
            return;
        }
        let first = h.offset == 0;
        let stage = !entry.waiting
            && (entry.heap.is_some()
                || (first
                    && st.staged_msgs < MAX_STAGED_MESSAGES
                    && st.staged_bytes.saturating_add(h.total) <= max_unexpected))
            && entry.in_slot.is_empty();
        if stage {
            let entry = st.inbound.get_mut(&key).expect("entry inserted above");
            if entry.heap.is_none() {
                // Bounded by max_unexpected (checked above) and max_message (header check).
                entry.heap = Some(vec![0u8; h.total as usize]);
                st.staged_bytes += h.total;
                st.staged_msgs += 1;
            }
            let entry = st.inbound.get_mut(&key).expect("entry inserted above");
            let heap = entry.heap.as_mut().expect("heap allocated above");
            let (off, len) = (h.offset as usize, h.seg_len as usize);
            if let Err(e) = self.ring.read_at(base + SEGMENT_HEADER_LEN, &mut heap[off..off + len]) {
                self.fail(st, e);
                return;
            }
            entry.heap_len = h.offset + u64::from(h.seg_len);
            if let Err(e) = st.ring.release(slot) {
                self.protocol(st, e.to_string());
                return;
            }
            let owed = st.ring.take_credits(false);
            self.flush_credits(st, owed);
        } else {
            let entry = st.inbound.get_mut(&key).expect("entry inserted above");
            entry.in_slot.push((slot, h.offset, h.seg_len));
        }
    }
}

struct Inner {
    // Declared first: peers (QPs, then buffers) go before the CQ they use.
    peers: Vec<Option<Peer>>,
    by_qpn: HashMap<u32, Rank>,
    cq: Arc<CompletionQueue>,
    rank: Rank,
    world: u32,
    generation: u64,
    deadlines: Deadlines,
    max_message: u64,
    max_unexpected: u64,
    abort: Mutex<Option<AbortReason>>,
    aborted: AtomicBool,
}

impl Inner {
    fn abort_reason(&self) -> Option<AbortReason> {
        if !self.aborted.load(Ordering::Acquire) {
            return None;
        }
        self.abort.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn peer(&self, peer: Rank) -> Result<&Peer, TransportError> {
        if peer >= self.world {
            return Err(TransportError::InvalidArgument(format!("peer {peer} outside a world of {}", self.world)));
        }
        self.peers[peer as usize].as_ref().ok_or_else(|| {
            TransportError::InvalidArgument(format!("rank {peer} cannot send to or receive from itself"))
        })
    }

    /// Aborted, or the link broken: the error to return.
    fn check(&self, st: &PeerState) -> Result<(), TransportError> {
        if let Some(r) = self.abort_reason() {
            return Err(TransportError::Aborted(r));
        }
        match &st.broken {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn handle(&self, c: &Completion) {
        let Some(&rank) = self.by_qpn.get(&c.qp_num) else {
            tracing::warn!(qpn = c.qp_num, "completion for an unknown queue pair");
            return;
        };
        let Some(peer) = self.peers[rank as usize].as_ref() else { return };
        let mut st = peer.lock();
        let aborted = self.abort_reason();
        if let Some(e) = status::wc_error(c.status, c.vendor_err, rank, aborted.as_ref()) {
            if aborted.is_none() {
                peer.fail(&mut st, e);
            }
            return;
        }
        st.last_progress = Instant::now();
        match c.wr_id & WR_KIND_MASK {
            WR_RECV => {
                if let Err(e) = peer.qp.post_recv(WR_RECV) {
                    peer.fail(&mut st, e);
                    return;
                }
                match (c.opcode, c.imm) {
                    (op::IBV_WC_RECV_RDMA_WITH_IMM, Some(imm)) => {
                        peer.on_data(&mut st, imm, self.generation, self.max_message, self.max_unexpected)
                    }
                    (op::IBV_WC_RECV, Some(n)) => {
                        if let Err(e) = st.window.grant(n) {
                            peer.protocol(&mut st, e.to_string());
                        }
                    }
                    (opc, imm) => {
                        peer.protocol(
                            &mut st,
                            format!("unexpected receive completion (opcode {opc}, immediate {imm:?})"),
                        );
                    }
                }
            }
            WR_WRITE => {
                let slot = (c.wr_id & 0xffff_ffff) as u32;
                if let Err(e) = st.window.complete_local(slot) {
                    peer.fail(&mut st, TransportError::Io(e.to_string()));
                }
            }
            WR_CREDIT => {
                st.credit_sends = st.credit_sends.saturating_sub(1);
                peer.flush_credits(&mut st, None);
            }
            _ => tracing::warn!(wr_id = c.wr_id, "completion with an unknown work request id"),
        }
        drop(st);
        peer.wake();
    }

    /// Waits for a change on `peer` or the no-progress deadline.
    async fn wait(&self, peer: &Peer, rx: &mut watch::Receiver<u64>, started: Instant) -> Result<(), TransportError> {
        loop {
            let last = peer.lock().last_progress.max(started);
            let deadline = last + self.deadlines.no_progress;
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(_)) => return Err(TransportError::Io("transport shut down".into())),
                Err(_) => {
                    if peer.lock().last_progress.max(started) + self.deadlines.no_progress <= Instant::now() {
                        let e = TransportError::Timeout { peer: peer.rank, after: self.deadlines.no_progress };
                        return Err(e);
                    }
                }
            }
        }
    }
}

/// The progress task: waits for completion events (or spins in busy-poll mode) and hands
/// every completion to [`Inner::handle`].
async fn progress(inner: Arc<Inner>, mut stop: watch::Receiver<bool>, busy_poll: bool) {
    let mut batch = Vec::with_capacity(64);
    loop {
        if *stop.borrow() {
            return;
        }
        if !busy_poll {
            tokio::select! {
                _ = stop.changed() => return,
                r = inner.cq.wait() => if let Err(e) = r {
                    tracing::error!(error = %e, "rdma completion channel failed; failing every link");
                    for p in inner.peers.iter().flatten() {
                        let mut st = p.lock();
                        p.fail(&mut st, e.clone());
                    }
                    return;
                },
            }
        }
        loop {
            batch.clear();
            match inner.cq.poll(&mut batch, 64) {
                Ok(_) => {}
                Err(e) => {
                    tracing::error!(error = %e, "polling the completion queue failed");
                    for p in inner.peers.iter().flatten() {
                        let mut st = p.lock();
                        p.fail(&mut st, e.clone());
                    }
                    return;
                }
            }
            for c in &batch {
                inner.handle(c);
            }
            if batch.len() < 64 {
                break;
            }
        }
        if busy_poll {
            tokio::task::yield_now().await;
        }
    }
}

/// An RDMA mesh for one generation; see the module docs.
pub struct RdmaTransport {
    inner: Arc<Inner>,
    stop: watch::Sender<bool>,
    engine: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for RdmaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTransport")
            .field("rank", &self.inner.rank)
            .field("world", &self.inner.world)
            .field("generation", &self.inner.generation)
            .finish()
    }
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.engine.abort();
    }
}

/// Unregisters a receive that ends without completing (error or cancellation).
struct RecvGuard<'a> {
    peer: &'a Peer,
    key: (u32, u32),
    done: bool,
}

impl Drop for RecvGuard<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut st = self.peer.lock();
        let touched = st.inbound.get(&self.key).is_some_and(|e| e.touched);
        if touched && st.broken.is_none() {
            let e = TransportError::Protocol {
                peer: self.peer.rank,
                detail: format!("receive of seq {} step {} abandoned part-way", self.key.0, self.key.1),
            };
            self.peer.fail(&mut st, e);
        } else if let Some(e) = st.inbound.get_mut(&self.key) {
            e.waiting = false;
            if !e.seen {
                st.inbound.remove(&self.key);
            }
        }
    }
}

impl RdmaTransport {
    async fn send_inner(&self, peer_rank: Rank, tag: Tag, data: &[u8]) -> Result<(), TransportError> {
        let inner = &*self.inner;
        let peer = inner.peer(peer_rank)?;
        if data.len() as u64 > inner.max_message {
            return Err(TransportError::InvalidArgument(format!(
                "message of {} bytes exceeds the maximum of {}",
                data.len(),
                inner.max_message
            )));
        }
        let started = Instant::now();
        let mut rx = peer.wake.subscribe();
        let _order = tokio::time::timeout_at(started + inner.deadlines.no_progress, peer.send_lock.lock())
            .await
            .map_err(|_| TransportError::Timeout { peer: peer_rank, after: inner.deadlines.no_progress })?;
        let rsb = peer.remote.slot_bytes;
        for (off, len) in segments(data.len() as u64, rsb - HDR) {
            loop {
                {
                    let mut st = peer.lock();
                    inner.check(&st)?;
                    if let Some(slot) = st.window.try_acquire() {
                        let h = SegmentHeader {
                            generation: inner.generation,
                            tag,
                            seg_len: len,
                            total: data.len() as u64,
                            offset: off,
                        };
                        let base = (slot * rsb) as usize;
                        let payload = &data[off as usize..off as usize + len as usize];
                        let res = peer
                            .staging
                            .write_at(base, &h.encode())
                            .and_then(|_| peer.staging.write_at(base + SEGMENT_HEADER_LEN, payload))
                            .and_then(|_| {
                                // Slots are < MAX_SLOTS (4096), so they fit the immediate's 16 bits.
                                let imm = DataImm::new(slot as u16, tag).to_u32();
                                peer.qp.post_write_imm(
                                    WR_WRITE | u64::from(slot),
                                    peer.staging.addr() + base as u64,
                                    HDR + len,
                                    peer.staging.lkey(),
                                    peer.remote.ring.addr + base as u64,
                                    peer.remote.ring.rkey,
                                    imm,
                                )
                            });
                        if let Err(e) = res {
                            return Err(peer.fail(&mut st, e));
                        }
                        break;
                    }
                }
                if let Err(e) = inner.wait(peer, &mut rx, started).await {
                    return Err(match e {
                        TransportError::Timeout { .. } => {
                            let mut st = peer.lock();
                            peer.fail(&mut st, e)
                        }
                        e => e,
                    });
                }
            }
        }
        Ok(())
    }

    async fn recv_inner(&self, peer_rank: Rank, tag: Tag, buf: &mut [u8]) -> Result<(), TransportError> {
        let inner = &*self.inner;
        let peer = inner.peer(peer_rank)?;
        let started = Instant::now();
        let mut rx = peer.wake.subscribe();
        let key = (tag.seq, tag.step);
        {
            let mut st = peer.lock();
            inner.check(&st)?;
            let e = st.inbound.entry(key).or_insert_with(Inbound::new);
            if e.waiting {
                return Err(TransportError::InvalidArgument(format!(
                    "a receive for seq {} step {} from rank {peer_rank} is already waiting",
                    tag.seq, tag.step
                )));
            }
            e.waiting = true;
        }
        let mut guard = RecvGuard { peer, key, done: false };
        let slot_bytes = peer.local_slot_bytes as usize;
        loop {
            {
                let mut st = peer.lock();
                inner.check(&st)?;
                let st = &mut *st;
                let Some(entry) = st.inbound.get_mut(&key) else {
                    return Err(TransportError::Io("receive state lost".into()));
                };
                if entry.seen {
                    if entry.signature != tag.signature || entry.reasm.total() != buf.len() as u64 {
                        let d = format!(
                            "message seq {} step {}: expected {} bytes with signature {:#010x}, got {} bytes with signature {:#010x}",
                            tag.seq,
                            tag.step,
                            buf.len(),
                            tag.signature,
                            entry.reasm.total(),
                            entry.signature
                        );
                        return Err(peer.fail(st, TransportError::Mismatch { peer: peer_rank, detail: d }));
                    }
                    if let Some(heap) = &entry.heap {
                        let (a, b) = (entry.heap_copied as usize, entry.heap_len as usize);
                        buf[a..b].copy_from_slice(&heap[a..b]);
                        entry.heap_copied = entry.heap_len;
                        entry.touched |= b > a;
                    }
                    let segs = std::mem::take(&mut entry.in_slot);
                    entry.touched |= !segs.is_empty();
                    for (slot, off, len) in segs {
                        let (off, len) = (off as usize, len as usize);
                        let at = slot as usize * slot_bytes + SEGMENT_HEADER_LEN;
                        if let Err(e) = peer.ring.read_at(at, &mut buf[off..off + len]) {
                            return Err(peer.fail(st, e));
                        }
                        if let Err(e) = st.ring.release(slot) {
                            return Err(peer.protocol(st, e.to_string()));
                        }
                    }
                    let entry = st.inbound.get(&key).expect("entry present");
                    if entry.reasm.is_complete() && entry.in_slot.is_empty() && entry.heap_copied == entry.heap_len {
                        if let Some(e) = st.inbound.remove(&key) {
                            if e.heap.is_some() {
                                st.staged_bytes = st.staged_bytes.saturating_sub(e.reasm.total());
                                st.staged_msgs = st.staged_msgs.saturating_sub(1);
                            }
                        }
                        guard.done = true;
                    }
                    let owed = st.ring.take_credits(false);
                    peer.flush_credits(st, owed);
                    if guard.done {
                        return Ok(());
                    }
                }
            }
            if let Err(e) = inner.wait(peer, &mut rx, started).await {
                return Err(match e {
                    TransportError::Timeout { .. } => {
                        let mut st = peer.lock();
                        peer.fail(&mut st, e)
                    }
                    e => e,
                });
            }
        }
    }
}

impl Transport for RdmaTransport {
    fn rank(&self) -> Rank {
        self.inner.rank
    }

    fn world_size(&self) -> u32 {
        self.inner.world
    }

    fn generation(&self) -> u64 {
        self.inner.generation
    }

    /// Copies `data` segment by segment into registered staging slots and RDMA-writes each
    /// into a credited slot of the peer's ring; returns once the last write is posted.
    ///
    /// # Cancel safety
    /// Not cancel safe: a message cut short leaves the peer's reassembly waiting; use
    /// [`Transport::abort`] to stop work on purpose.
    fn send(&self, peer: Rank, tag: Tag, data: &[u8]) -> impl Future<Output = Result<(), TransportError>> + Send {
        self.send_inner(peer, tag, data)
    }

    /// Waits for the message `tag` from `peer` and copies it from the ring (or from early
    /// copies) into `buf`.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropping the future after part of the message was copied breaks the
    /// link (before that, the message simply stays queued for a later receive).
    fn recv(&self, peer: Rank, tag: Tag, buf: &mut [u8]) -> impl Future<Output = Result<(), TransportError>> + Send {
        self.recv_inner(peer, tag, buf)
    }

    fn abort(&self, reason: AbortReason) {
        {
            let mut r = self.inner.abort.lock().unwrap_or_else(|e| e.into_inner());
            if r.is_none() {
                tracing::info!(rank = self.inner.rank, generation = self.inner.generation, %reason, "rdma transport aborted");
                *r = Some(reason);
            }
        }
        self.inner.aborted.store(true, Ordering::Release);
        for p in self.inner.peers.iter().flatten() {
            if let Err(e) = p.qp.to_error() {
                tracing::warn!(peer = p.rank, error = %e, "moving the queue pair to the error state failed");
            }
            p.wake();
        }
    }

    fn is_aborted(&self) -> bool {
        self.inner.aborted.load(Ordering::Acquire)
            || self.inner.peers.iter().flatten().any(|p| p.lock().broken.is_some())
    }
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
