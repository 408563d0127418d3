//! Shared-memory transport for ranks on one host.
//!
//! # Shape
//! Each pair of ranks on one host shares one segment: an anonymous memory file (memfd,
//! sealed against resizing) holding two single-producer/single-consumer rings of fixed-size
//! slots, one per direction ([`ring`]). A message is copied into the sender's ring slot by
//! slot and out of it straight into the receiver's buffer; messages larger than a slot are
//! pipelined, so the receiver copies (or a collective reduces) one chunk while the next is
//! being written. Messages of up to [`LANE_MAX`] bytes take the small-message lane instead
//! (`lane.rs`): cells of 8-byte words, each 4 bytes of the message beside a 4-byte flag
//! (NCCL's LL protocol), so the receiver polls the message itself and an 8-byte message is
//! one cache line from the sender's core to its own, with no counter to publish or read. The
//! receiver looks at both the lane and the ring while it waits; a receive of one slot or less
//! first spins tightly (no return to the runtime between looks) for a few microseconds.
//!
//! Beside the segment each pair keeps a connected Unix stream socket. It carries the set-up
//! (the TCP transport's authenticated handshake, then the memfd itself with `SCM_RIGHTS`; see
//! `setup`), then only doorbells: a side that found nothing to read (or no room to write)
//! busy-polls the ring for [`ShmOptions::busy_poll`], then raises a flag in the ring and
//! sleeps on the socket; the other side writes one byte when it sees the flag. When a peer's
//! process dies the kernel closes its end, so every sleeper wakes at once with end-of-stream
//! ([`TransportError::PeerClosed`], exactly as a TCP EOF), and a SIGSTOPped peer is caught by
//! the no-progress deadline ([`TransportError::Timeout`]).
//!
//! # Addresses
//! A worker's [`ShmAddress`] is its host identity ([`host_identity`]: boot id, network and
//! IPC namespaces) and a random nonce. Two workers use shared memory between them only if
//! their identities are identical: then they can reach each other's abstract Unix sockets
//! (same network namespace) on the same kernel. The nonce names the worker's listener per
//! generation, so two jobs or two generations never meet.
//!
//! # Nothing left behind
//! Segments are memfds: no name in /dev/shm or any file system, gone when both processes
//! have unmapped them (at drop, or when the kernel reaps a killed process). Listeners are
//! abstract sockets: gone when closed.
//!
//! # Untrusted memory
//! The peer can write anything into the segment. Every counter and header read from it is
//! validated before use (a ring distance within the ring, a chunk within its slot and its
//! message, the generation, lengths within [`ShmOptions::max_message`]); a violation closes
//! the link with [`TransportError::Protocol`]. Received segments must carry seals against
//! shrinking (else a peer could truncate the file under the mapping and make accesses fault).

pub(crate) mod lane;
mod link;
mod model;
mod protocol;
pub mod ring;
pub(crate) mod segment;
mod setup;

use crate::links::Links;
use crate::mesh_setup::{self, Gathering, PairTasks, Rules, SharedNotes};
use crate::{AbortReason, DeadlineInForce, Deadlines, Rank, Tag, Transport, TransportError};
use link::ShmLink;
use setup::PairCtx;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::Instrument;

pub use lane::LANE_MAX;
pub use setup::{
    decode_descriptor, encode_descriptor, DESC_LEN, MAX_SEGMENT_BYTES, MAX_SLOTS, MAX_SLOT_BYTES, MIN_SLOTS,
    MIN_SLOT_BYTES,
};

/// Most connections a mesh set-up handshakes with at once; more are closed at once.
pub const MAX_HANDSHAKING: usize = 64;

/// Tuning of the shared-memory transport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmOptions {
    /// Slots per ring (per direction of each pair).
    pub slots: u32,
    /// Bytes per slot, header included (a multiple of 64).
    pub slot_bytes: usize,
    /// How long a waiting side polls the ring before it sleeps on the socket (0 = sleep at
    /// once). Like [`crate::tcp::TcpOptions::busy_poll`].
    pub busy_poll: Duration,
    /// Longest message accepted from a peer.
    pub max_message: u64,
}

impl Default for ShmOptions {
    /// 8 slots of 128 KiB per direction (1 MiB), 50 us busy poll, 1 GiB messages.
    fn default() -> Self {
        Self { slots: 8, slot_bytes: 128 << 10, busy_poll: Duration::from_micros(50), max_message: 1 << 30 }
    }
}

/// What a worker publishes so that peers on its host can reach it over shared memory.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ShmAddress {
    /// The host identity ([`host_identity`]); peers with another one use another transport.
    pub host: String,
    /// Random per-worker nonce (hex) naming its listener.
    pub nonce: String,
}

/// Prefix of an encoded [`ShmAddress`].
const ADDRESS_PREFIX: &str = "shm1;";

impl ShmAddress {
    /// A fresh address for this process: its host identity and a new random nonce.
    pub fn new_local() -> Result<Self, TransportError> {
        let host = host_identity().map_err(TransportError::Io)?;
        let mut nonce = [0u8; 12];
        getrandom::fill(&mut nonce).map_err(|e| TransportError::Io(format!("no randomness for the shm nonce: {e}")))?;
        Ok(Self { host, nonce: nonce.iter().map(|b| format!("{b:02x}")).collect() })
    }

    /// `shm1;host=<identity>;nonce=<hex>`, as published in join requests.
    pub fn encode(&self) -> String {
        format!("{ADDRESS_PREFIX}host={};nonce={}", self.host, self.nonce)
    }

    /// Parses [`ShmAddress::encode`]'s form; the nonce must be 8 to 64 hex digits and the
    /// identity printable ASCII without `;`, `,` or `|`.
    pub fn decode(text: &str) -> Result<Self, String> {
        let rest = text
            .strip_prefix(ADDRESS_PREFIX)
            .ok_or_else(|| format!("{text:?} does not start with {ADDRESS_PREFIX:?}"))?;
        let (host, nonce) = rest.split_once(";nonce=").ok_or_else(|| format!("{text:?} has no nonce"))?;
        let host = host.strip_prefix("host=").ok_or_else(|| format!("{text:?} has no host identity"))?;
        if host.is_empty() || !host.bytes().all(|b| b.is_ascii_graphic() && !b";,|".contains(&b)) {
            return Err(format!("{text:?}: the host identity must be printable ASCII without ';', ',' or '|'"));
        }
        if !(8..=64).contains(&nonce.len()) || !nonce.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!("{text:?}: the nonce must be 8 to 64 hex digits"));
        }
        Ok(Self { host: host.to_owned(), nonce: nonce.to_owned() })
    }
}

/// This process's host identity: the kernel's boot id and the inodes of its network and IPC
/// namespaces. Two processes with the same identity run on one kernel, can reach each other's
/// abstract Unix sockets and share memory; two containers of one node in different pods get
/// different identities and stay on TCP.
pub fn host_identity() -> Result<String, String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map_err(|e| format!("reading /proc/sys/kernel/random/boot_id: {e}"))?;
    let ns = |name: &str| -> Result<String, String> {
        let link = std::fs::read_link(format!("/proc/self/ns/{name}"))
            .map_err(|e| format!("reading /proc/self/ns/{name}: {e}"))?;
        let text = link.to_string_lossy();
        // "net:[4026531840]" -> "4026531840"
        Ok(text.trim_start_matches(|c: char| !c.is_ascii_digit()).trim_end_matches(']').to_owned())
    };
    Ok(format!("boot={}:net={}:ipc={}", boot.trim(), ns("net")?, ns("ipc")?))
}

/// One generation's shared-memory set-up.
#[derive(Clone, Debug)]
pub struct ShmMeshSpec {
    /// Job id (as for TCP).
    pub job: String,
    /// Generation being formed.
    pub generation: u64,
    /// This process's rank.
    pub rank: Rank,
    /// Indexed by rank: `Some` for the peers to link over shared memory, `None` for the
    /// others (and this rank's own entry, which is ignored). Its length is the world size.
    pub peers: Vec<Option<ShmAddress>>,
    /// The job token (HMAC proofs only).
    pub token: Vec<u8>,
    /// Connect and no-progress deadlines.
    pub deadlines: Deadlines,
}

/// A worker's shared-memory identity and options, kept across generations.
#[derive(Clone, Debug)]
pub struct ShmEndpoint {
    address: ShmAddress,
    options: ShmOptions,
}

impl ShmEndpoint {
    /// An endpoint with a fresh address. Fails if the options are out of range or the host
    /// identity cannot be read.
    pub fn new(options: ShmOptions) -> Result<Self, TransportError> {
        setup::check_geometry(options.slots, options.slot_bytes).map_err(TransportError::InvalidArgument)?;
        Ok(Self { address: ShmAddress::new_local()?, options })
    }

    /// What this worker publishes.
    pub fn address(&self) -> &ShmAddress {
        &self.address
    }

    /// The options.
    pub fn options(&self) -> &ShmOptions {
        &self.options
    }

    /// Links this rank with every peer marked `Some` in `spec.peers`: rank `i` dials the
    /// listed peers `j < i` and accepts the listed `j > i`. Fails with
    /// [`TransportError::Handshake`] when a peer disagrees about the job, generation, world
    /// size, ranks or token, sends an unusable segment, or the set-up misses
    /// `spec.deadlines.connect`; with [`TransportError::Io`] when no segment or socket can be
    /// made here.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future closes every socket and segment made so far (peers see
    /// their set-up fail).
    pub async fn connect_mesh(&self, spec: ShmMeshSpec) -> Result<ShmTransport, TransportError> {
        let span = tracing::debug_span!("shm_mesh", job = %spec.job, generation = spec.generation, rank = spec.rank);
        self.connect_inner(spec, span.clone()).instrument(span).await
    }

    async fn connect_inner(&self, spec: ShmMeshSpec, span: tracing::Span) -> Result<ShmTransport, TransportError> {
        let world = u32::try_from(spec.peers.len())
            .map_err(|_| TransportError::InvalidArgument(format!("{} peers is too many", spec.peers.len())))?;
        let rank = spec.rank;
        if rank >= world {
            return Err(TransportError::InvalidArgument(format!("rank {rank} out of range for a world of {world}")));
        }
        crate::handshake::validate_job(&spec.job).map_err(TransportError::InvalidArgument)?;
        let deadline = Instant::now() + spec.deadlines.connect;
        let listed = |r: Rank| r != rank && spec.peers[r as usize].is_some();
        let local_ranks = (0..world).filter(|&r| listed(r)).count() + 1;
        let ctx = Arc::new(PairCtx {
            job: spec.job.clone(),
            generation: spec.generation,
            rank,
            world,
            token: spec.token.clone(),
            slots: self.options.slots,
            slot_bytes: self.options.slot_bytes,
            max_message: self.options.max_message,
            busy_poll: self.options.busy_poll,
            deadlines: spec.deadlines,
            pace: crate::deadline::Pace::shared(crate::activity::Activity::for_mesh(&spec.job, spec.generation, rank)),
            deadline,
            oversubscribed: crate::spin::oversubscribed(local_ranks),
            span: span.clone(),
        });
        let expect_accepts = (rank + 1..world).filter(|&r| listed(r)).count();
        let mut listener = setup::Listener(if expect_accepts > 0 {
            Some(setup::listen(&self.address.nonce, spec.generation)?)
        } else {
            None
        });
        let mut gathering = Gathering::new(rank, (0..world).map(listed).collect(), SharedNotes::default());
        let mut tasks = PairTasks::new();
        for (peer, addr) in spec.peers.iter().enumerate().take(rank as usize) {
            if let Some(addr) = addr {
                let dial = setup::dial(Arc::clone(&ctx), peer as Rank, addr.nonce.clone());
                tasks.dials.spawn(dial.instrument(span.clone()));
            }
        }
        let rules =
            Rules { what: "shared-memory", connect: spec.deadlines.connect, deadline, max_accepting: MAX_HANDSHAKING };
        let handshake = |stream| setup::accept(Arc::clone(&ctx), stream);
        // The handshake takes only higher ranks; one not listed here is not expected.
        let admit = |g: &mut Gathering<Box<ShmLink>>, peer: Rank, link: Box<ShmLink>| {
            if g.is_planned(peer) {
                g.keep_latest(peer, link);
            } else {
                g.note(Some(peer), format!("rank {peer} connected but is not expected over shared memory"));
            }
        };
        mesh_setup::gather(&mut gathering, &mut tasks, &mut listener, handshake, admit, &rules).await?;
        let links = gathering.into_links().into_iter().map(|l| l.map(|l| *l)).collect();
        tracing::debug!(world, "shm mesh up");
        Ok(ShmTransport { links: Links::new("shared memory", spec.generation, rank, links, span) })
    }
}

/// A connected generation over shared memory (possibly only some of its peers). `Send +
/// Sync`; share it behind `Arc`.
pub struct ShmTransport {
    /// Indexed by rank; `None` for this rank and for peers not linked over shared memory.
    links: Links<ShmLink>,
}

impl std::fmt::Debug for ShmTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmTransport")
            .field("generation", &self.links.generation)
            .field("rank", &self.links.rank)
            .field("world", &self.links.world)
            .finish_non_exhaustive()
    }
}

impl ShmTransport {
    /// Whether `peer` is linked over shared memory.
    pub fn links_to(&self, peer: Rank) -> bool {
        self.links.get(peer).is_some()
    }
}

impl Transport for ShmTransport {
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
        self.links.send(peer, tag, data).await
    }

    async fn recv(&self, peer: Rank, tag: Tag, buf: &mut [u8]) -> Result<(), TransportError> {
        self.links.recv(peer, tag, buf).await
    }

    /// Reduces (or otherwise consumes) straight from the peer's ring slots: `scratch` is
    /// not used.
    async fn recv_with<F>(&self, peer: Rank, tag: Tag, scratch: &mut [u8], consume: F) -> Result<(), TransportError>
    where
        F: FnMut(&[u8]) + Send,
    {
        let link = self.links.link(peer)?;
        let _in_call = crate::links::Link::core(link).progress.activity().enter(tag.seq);
        self.links.guarded(link.recv_with(tag, scratch.len(), consume)).await
    }

    fn abort(&self, reason: AbortReason) {
        self.links.abort(reason);
    }

    fn is_aborted(&self) -> bool {
        self.links.is_aborted()
    }

    fn deadlines_in_force(&self) -> Vec<(Rank, DeadlineInForce)> {
        self.links.deadlines_in_force()
    }

    fn linked_peers(&self) -> usize {
        self.links.linked()
    }
}

#[cfg(test)]
mod tests {
    use super::ring::{SlotHeader, KIND_CONT, KIND_FIRST, SLOT_HEADER};
    use super::*;
    use std::sync::atomic::Ordering;

    /// A connected pair; the test then plays rank 0 by writing into its rings directly.
    async fn pair(generation: u64) -> (ShmTransport, ShmTransport) {
        let options = ShmOptions { slots: 4, slot_bytes: 4096, ..ShmOptions::default() };
        let (a, b) = (ShmEndpoint::new(options.clone()).unwrap(), ShmEndpoint::new(options).unwrap());
        let peers = vec![Some(a.address().clone()), Some(b.address().clone())];
        let d = Deadlines { no_progress: Duration::from_secs(5), connect: Duration::from_secs(10), learning: None };
        let spec = |rank| ShmMeshSpec {
            job: "hostile".into(),
            generation,
            rank,
            peers: peers.clone(),
            token: b"t".to_vec(),
            deadlines: d,
        };
        let (x, y) = tokio::join!(a.connect_mesh(spec(0)), b.connect_mesh(spec(1)));
        (x.unwrap(), y.unwrap())
    }

    /// Rank 1 waits for a message; "rank 0" scribbles into its outgoing ring with `attack`.
    async fn attack(attack: impl FnOnce(ring::Ring), needle: &str) {
        let (t0, t1) = pair(5).await;
        let (tx, _) = t0.links.get(1).unwrap().rings();
        attack(tx);
        let mut buf = vec![0u8; 10_000];
        let e = tokio::time::timeout(Duration::from_secs(10), t1.recv(0, Tag::new(1, 0, 9), &mut buf))
            .await
            .expect("the victim must not hang")
            .unwrap_err();
        match &e {
            TransportError::Protocol { peer: 0, detail } => {
                assert!(detail.contains(needle), "{needle:?} not in {detail:?}")
            }
            e => panic!("expected a protocol error about {needle:?}, got {e:?}"),
        }
        assert!(t1.is_aborted(), "the link stays broken");
    }

    fn publish(ring: ring::Ring, n: u64) {
        ring.head().store(n, Ordering::SeqCst);
    }

    #[tokio::test]
    async fn garbage_in_a_slot_is_a_protocol_error() {
        attack(
            |r| {
                r.write_slot(0, &[0xa5; SLOT_HEADER], &[]);
                publish(r, 1);
            },
            "bad slot magic",
        )
        .await;
    }

    #[tokio::test]
    async fn a_head_beyond_the_ring_is_a_protocol_error() {
        attack(|r| publish(r, 1 << 40), "out of range").await;
    }

    #[tokio::test]
    async fn an_oversize_or_inconsistent_message_is_a_protocol_error() {
        let first =
            |total: u64, chunk: u32| SlotHeader { kind: KIND_FIRST, tag: Tag::new(1, 0, 9), chunk, total, offset: 0 };
        attack(
            |r| {
                r.write_slot(0, &first(u64::MAX, 4032).encode(5), &[]);
                publish(r, 1);
            },
            "exceeds the maximum",
        )
        .await;
        attack(
            |r| {
                r.write_slot(0, &first(10_000, 4032).encode(5), &[]);
                r.write_slot(1, &first(10_000, 4032).encode(5), &[]);
                publish(r, 2);
            },
            "does not continue message",
        )
        .await;
        let cont = SlotHeader { kind: KIND_CONT, tag: Tag::new(1, 0, 9), chunk: 4032, total: 10_000, offset: 4032 };
        attack(
            |r| {
                r.write_slot(0, &cont.encode(5), &[]);
                publish(r, 1);
            },
            "continues a message where a new one should start",
        )
        .await;
        attack(
            |r| {
                r.write_slot(0, &first(10_000, 4032).encode(4), &[]);
                publish(r, 1);
            },
            "generation 4",
        )
        .await;
    }

    #[tokio::test]
    async fn a_tail_beyond_the_head_fails_the_sender() {
        let (t0, t1) = pair(6).await;
        // "Rank 0" moves the tail of rank 1's outgoing ring (it consumes that ring).
        let (_, rx) = t0.links.get(1).unwrap().rings();
        rx.tail().store(77, Ordering::SeqCst);
        let e = t1.send(0, Tag::new(0, 0, 0), &[1u8; LANE_MAX + 100]).await.unwrap_err();
        assert!(matches!(&e, TransportError::Protocol { peer: 0, detail } if detail.contains("tail")), "{e:?}");
    }

    #[tokio::test]
    async fn a_lane_tail_beyond_the_count_fails_the_sender() {
        let (t0, t1) = pair(6).await;
        let (_, rx) = t0.links.get(1).unwrap().rings();
        rx.lane_tail().store(77, Ordering::SeqCst);
        // The sender looks at the consumer's count only when its cells run out.
        for step in 0..lane::LANE_CELLS {
            t1.send(0, Tag::new(0, step, 0), &[1u8; 8]).await.unwrap();
        }
        let e = t1.send(0, Tag::new(0, 99, 0), &[1u8; 8]).await.unwrap_err();
        assert!(matches!(&e, TransportError::Protocol { peer: 0, detail } if detail.contains("tail")), "{e:?}");
    }

    #[tokio::test]
    async fn garbage_in_a_lane_cell_is_a_protocol_error() {
        let word = |flag: u64, data: u64| (flag << 32) | data;
        attack(|r| r.lane_cell(0)[0].store(word(0x5a5a, 8), Ordering::SeqCst), "flag").await;
        attack(|r| r.lane_cell(0)[0].store(word(1, LANE_MAX as u64 + 1), Ordering::SeqCst), "at most").await;
        attack(
            |r| {
                for (i, w) in r.lane_cell(0).iter().enumerate().take(5) {
                    // length 0, generation 4 (the link's is 5)
                    w.store(word(1, if i == 1 { 4 } else { 0 }), Ordering::SeqCst);
                }
            },
            "generation",
        )
        .await;
    }
}
