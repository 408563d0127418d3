//! The [`Communicator`]: collectives of one generation over a [`Transport`], with deadlines,
//! revocation and poisoning.
//!
//! This module is the machinery every call goes through: the call signature (`Call`, and
//! `CallKind`, which lists every collective), sequence numbers, the whole-op bound,
//! cancellation, poisoning and revocation (`Communicator::run`), and the `Ctx` a schedule runs
//! with. The collective methods themselves (`allreduce`, `broadcast`, ...) live beside their
//! schedules in `crate::collectives`, one file per collective or family; they build on this
//! module, never the reverse.

use crate::algo::Algorithm;
use crate::dtype::{as_bytes, as_bytes_mut, DType, Element, Scratch};
use crate::error::{CommError, OpProgress, RootCause};
use crate::reduce::{CombineInto, ReduceOp};
use crate::topology::HostLayout;
use cohort_transports::subgroup::Subgroup;
use cohort_transports::{AbortReason, Rank, Silence, Tag, Transport, TransportError};
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tracing::Instrument;

/// Tuning and limits of a [`Communicator`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommConfig {
    /// Allreduce algorithm used by [`Communicator::allreduce`].
    pub algorithm: Algorithm,
    /// Largest message any collective sends; the ring pipelines in segments of this size.
    /// Values below one element are treated as one element. Over a transport that asks for
    /// finer pipelining (TCP: [`cohort_transports::Transport::pipeline_segment`], 256 KiB),
    /// a call whose block (its elements over the world size) would be fewer than
    /// [`SEGMENTS_PER_BLOCK`] segments is cut finer, down to that size.
    pub segment_bytes: usize,
    /// Optional bound on a whole call; when it passes the call fails with
    /// [`CommError::Timeout`] (with `rank: None`) and the communicator is poisoned. The
    /// transport's no-progress deadline applies regardless.
    pub op_timeout: Option<Duration>,
    /// BCube group size; `None` uses the world size's prime factors (see
    /// [`crate::collectives::bcube::factorize`]).
    pub bcube_base: Option<u32>,
    /// Whether a failed call aborts the transport at once, closing every link so that peers
    /// waiting on this rank fail promptly too. The default (`true`) suits a communicator on
    /// its own. The elastic runtime sets `false`: it reports the failure to the coordinator
    /// first and closes the links after (through the [`Revoker`]), so that peers learn the
    /// root cause from the revocation instead of blaming this rank for its closed links.
    pub abort_transport_on_error: bool,
}

impl Default for CommConfig {
    /// `Auto` algorithm, 1 MiB segments, no whole-op bound, prime-factor BCube groups, abort
    /// the transport on error.
    fn default() -> Self {
        Self {
            algorithm: Algorithm::Auto,
            segment_bytes: 1 << 20,
            op_timeout: None,
            bcube_base: None,
            abort_transport_on_error: true,
        }
    }
}

/// How many segments a block (a call's bytes over the world size) should be cut into, at
/// least, so that a rank's sends overlap its receives (over transports that ask for it).
pub const SEGMENTS_PER_BLOCK: u64 = 16;

/// The segment of a call of `call_bytes` (the bytes all ranks agree on) over `world` ranks:
/// `configured`, or finer, down to the transport's `pipeline` segment, when a block would
/// otherwise be fewer than [`SEGMENTS_PER_BLOCK`] segments. Every rank computes the same.
fn segment_for(call_bytes: u64, world: u32, configured: usize, pipeline: Option<usize>) -> usize {
    let Some(floor) = pipeline else { return configured };
    let block = call_bytes / u64::from(world.max(1));
    let fine = usize::try_from(block / SEGMENTS_PER_BLOCK).unwrap_or(usize::MAX);
    fine.clamp(floor.min(configured), configured)
}

/// The shared revocation slot: the first recorded root cause.
#[derive(Debug, Default)]
struct RevokeState {
    cause: OnceLock<RootCause>,
}

/// A handle that revokes a communicator from anywhere (another task, a control-plane watch):
/// every in-flight operation fails at once with [`CommError::Revoked`] carrying the cause, and
/// every later one is refused. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct Revoker {
    state: Arc<RevokeState>,
    abort: Arc<dyn Fn(AbortReason) + Send + Sync>,
    generation: u64,
}

impl Revoker {
    /// Records `cause` (the first one wins) and aborts the transport: local, immediate,
    /// idempotent; never waits on a peer.
    pub fn revoke(&self, cause: RootCause) {
        let reason = format!("generation {} revoked: {cause}", self.generation);
        // Store before aborting so that the aborted operations find the cause.
        let _ = self.state.cause.set(cause);
        (self.abort)(AbortReason::new(reason));
    }

    /// Whether [`Revoker::revoke`] has been called.
    pub fn is_revoked(&self) -> bool {
        self.state.cause.get().is_some()
    }

    /// The recorded root cause, once revoked.
    pub fn cause(&self) -> Option<RootCause> {
        self.state.cause.get().cloned()
    }

    /// The generation this revoker belongs to.
    pub fn generation(&self) -> u64 {
        self.generation
    }
}

impl fmt::Debug for Revoker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Revoker").field("generation", &self.generation).field("cause", &self.state.cause.get()).finish()
    }
}

/// Which collective a call is: its name (in errors and the tracing span) and the code that
/// goes into the call signature every message carries, so that ranks calling different
/// collectives fail with a mismatch instead of exchanging garbage.
///
/// Every collective's kind is a constant here (`CallKind::BARRIER`, ...), listed in
/// [`CallKind::ALL`]; a unit test checks that no two share a code or a name. The codes are
/// those of the central enum the kinds once were, so signatures never changed; a new
/// collective takes the next free code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CallKind {
    /// The collective's name, as the method is called.
    pub(crate) name: &'static str,
    /// Its byte in the call signature; unique among all collectives (a unit test checks).
    pub(crate) code: u8,
}

impl CallKind {
    /// `allreduce`, every algorithm (the algorithm is a field of the signature).
    pub(crate) const ALLREDUCE: CallKind = CallKind { name: "allreduce", code: 0 };
    /// `reduce_scatter`.
    pub(crate) const REDUCE_SCATTER: CallKind = CallKind { name: "reduce_scatter", code: 1 };
    /// `allgather` (equal blocks).
    pub(crate) const ALLGATHER: CallKind = CallKind { name: "allgather", code: 2 };
    /// `allgatherv` (per-rank counts, hashed into the signature).
    pub(crate) const ALLGATHERV: CallKind = CallKind { name: "allgatherv", code: 3 };
    /// `broadcast`.
    pub(crate) const BROADCAST: CallKind = CallKind { name: "broadcast", code: 4 };
    /// `reduce` (to a root).
    pub(crate) const REDUCE: CallKind = CallKind { name: "reduce", code: 5 };
    /// `gather`.
    pub(crate) const GATHER: CallKind = CallKind { name: "gather", code: 6 };
    /// `scatter`.
    pub(crate) const SCATTER: CallKind = CallKind { name: "scatter", code: 7 };
    /// `alltoall` (equal blocks).
    pub(crate) const ALLTOALL: CallKind = CallKind { name: "alltoall", code: 8 };
    /// `alltoallv` (per-pair counts).
    pub(crate) const ALLTOALLV: CallKind = CallKind { name: "alltoallv", code: 9 };
    /// `barrier`.
    pub(crate) const BARRIER: CallKind = CallKind { name: "barrier", code: 10 };
    /// Point-to-point messages (`send` and `recv` share it).
    pub(crate) const P2P: CallKind = CallKind { name: "p2p", code: 11 };

    /// Every collective's kind; every code fits the 5 bits the call signature gives it
    /// (below 32). A mismatch error decodes the peer's call kind from its signature through
    /// this list. The next free code is 12.
    pub(crate) const ALL: [CallKind; 12] = [
        Self::ALLREDUCE,
        Self::REDUCE_SCATTER,
        Self::ALLGATHER,
        Self::ALLGATHERV,
        Self::BROADCAST,
        Self::REDUCE,
        Self::GATHER,
        Self::SCATTER,
        Self::ALLTOALL,
        Self::ALLTOALLV,
        Self::BARRIER,
        Self::P2P,
    ];
}

/// What a call was made with; hashed into the signature every message carries.
#[derive(Clone, Copy)]
pub(crate) struct Call {
    /// Which collective.
    pub(crate) kind: CallKind,
    /// The element type, if the call has one.
    pub(crate) dtype: Option<DType>,
    /// The reduction, if the call reduces.
    pub(crate) op: Option<ReduceOp>,
    /// The element count that all ranks agree on.
    pub(crate) count: u64,
    /// The root of a rooted collective.
    pub(crate) root: Option<u32>,
    /// The allreduce algorithm, once resolved.
    pub(crate) algo: Option<Algorithm>,
    /// Hash of further arguments all ranks share (allgatherv counts, the host layout).
    pub(crate) extra: u64,
}

impl Call {
    /// A call of `kind` with no arguments yet.
    pub(crate) fn new(kind: CallKind) -> Self {
        Self { kind, dtype: None, op: None, count: 0, root: None, algo: None, extra: 0 }
    }

    /// The call signature: readable where it can be, hashed where it cannot. Bits 31-27 are
    /// the collective's code, 26-24 the dtype's (0: none), 23-21 the op's, 20-18 the
    /// algorithm's, and 17-0 an 18-bit FNV-1a of the rest (count, root, further arguments).
    /// So a mismatch can say which collective, dtype, op and algorithm the peer called
    /// ([`describe_mismatch`]); two calls differing only in count, root or layout are told
    /// apart by the hash (a 2^-18 chance of a collision, and a count mismatch also shows in
    /// the message lengths).
    fn signature(&self) -> u32 {
        let mut h = Fnv::new();
        h.bytes(&self.count.to_le_bytes());
        h.bytes(&self.root.map_or(u32::MAX, |r| r).to_le_bytes());
        h.bytes(&self.extra.to_le_bytes());
        let rest = (h.0 ^ (h.0 >> 18)) & REST_MASK;
        (u32::from(self.kind.code & 0x1f) << 27)
            | (u32::from(self.dtype.map_or(0, DType::code) & 7) << 24)
            | (u32::from(self.op.map_or(0, ReduceOp::code) & 7) << 21)
            | (u32::from(self.algo.map_or(0, Algorithm::code) & 7) << 18)
            | rest
    }

    /// `allreduce(count 1000, f32, sum, ring)`: the call as a user would recognise it.
    fn describe(&self) -> String {
        let mut parts = vec![format!("count {}", self.count)];
        parts.extend(self.dtype.map(|d| d.name().to_string()));
        parts.extend(self.op.map(|o| o.name().to_string()));
        parts.extend(self.root.map(|r| format!("root {r}")));
        parts.extend(self.algo.map(|a| a.name().to_string()));
        format!("{}({})", self.kind.name, parts.join(", "))
    }
}

/// Bits of the signature hashed from the arguments that cannot be shown (count, root, ...).
const REST_MASK: u32 = (1 << 18) - 1;

/// First step of point-to-point messages (`collectives/p2p.rs`); collectives use the steps
/// below it.
pub(crate) const P2P_STEP_BASE: u64 = cohort_transports::wire::P2P_STEP_BASE as u64;

/// What differs between this rank's call `ours` and the call behind the peer's signature
/// `theirs`: the peer's call as far as its signature shows it (collective, dtype, op,
/// algorithm), this rank's in full, and the list of what differs.
fn describe_mismatch(ours: &Call, theirs: u32) -> String {
    let field = |shift: u32| ((theirs >> shift) & 7) as u8;
    let kind = CallKind::ALL.iter().find(|k| u32::from(k.code) == theirs >> 27);
    let dtype = DType::ALL.into_iter().find(|d| d.code() == field(24));
    let op = ReduceOp::ALL.into_iter().find(|o| o.code() == field(21));
    let algo = Algorithm::CONCRETE.into_iter().chain([Algorithm::Auto]).find(|a| a.code() == field(18));
    let mut theirs_parts = Vec::new();
    theirs_parts.extend(dtype.map(|d| d.name().to_string()));
    theirs_parts.extend(op.map(|o| o.name().to_string()));
    theirs_parts.extend(algo.map(|a| a.name().to_string()));
    let their_call = format!(
        "{}({})",
        kind.map_or_else(|| format!("an unknown collective (code {})", theirs >> 27), |k| k.name.to_string()),
        theirs_parts.join(", ")
    );
    let mut differ = Vec::new();
    if kind.map(|k| k.code) != Some(ours.kind.code) {
        differ.push("collective");
    }
    if field(24) != ours.dtype.map_or(0, DType::code) {
        differ.push("dtype");
    }
    if field(21) != ours.op.map_or(0, ReduceOp::code) {
        differ.push("op");
    }
    if field(18) != ours.algo.map_or(0, Algorithm::code) {
        differ.push("algorithm");
    }
    if theirs & REST_MASK != ours.signature() & REST_MASK {
        differ.push("count, root or layout");
    }
    let differ = if differ.is_empty() { "the signatures".to_string() } else { differ.join(", ") };
    format!("it called {their_call} where this rank called {}: they differ in {differ}", ours.describe())
}

struct Fnv(u32);

impl Fnv {
    fn new() -> Self {
        Fnv(0x811c_9dc5)
    }

    fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 = (self.0 ^ u32::from(x)).wrapping_mul(0x0100_0193);
        }
    }
}

/// Hash of a list of counts, for [`Call::extra`].
pub(crate) fn hash_counts(counts: &[usize]) -> u64 {
    let mut h = Fnv::new();
    for &c in counts {
        h.bytes(&(c as u64).to_le_bytes());
    }
    u64::from(h.0)
}

/// Why a driven operation stopped.
enum Failure {
    Transport(TransportError),
    WholeOpDeadline(Duration),
}

/// Aborts the transport if dropped while armed: an operation future dropped mid-flight leaves
/// its links mid-message, so the generation is unusable for this rank.
struct CancelGuard<T: Transport> {
    transport: Arc<T>,
    armed: bool,
}

impl<T: Transport> Drop for CancelGuard<T> {
    fn drop(&mut self) {
        if self.armed {
            self.transport.abort(AbortReason::new(format!(
                "a collective on rank {} was cancelled mid-flight",
                self.transport.rank()
            )));
        }
    }
}

/// A started operation.
struct Started<T: Transport> {
    call: Call,
    seq: u32,
    sig: u32,
    seg: usize,
    span: tracing::Span,
    guard: CancelGuard<T>,
}

/// The collectives of one generation, over a [`Transport`].
///
/// # Semantics
/// - Every call takes the next sequence number; all ranks must issue the same collectives in
///   the same order with agreeing arguments. Every message carries a signature of the call
///   (kind, dtype, op, element count, root, algorithm), so ranks that disagree fail with
///   [`CommError::Mismatch`], naming both calls and what differs, as soon as any message of
///   the other call reaches them (whatever its step: links report a message of the same
///   operation under another signature at once instead of holding it for later), instead of
///   combining garbage or waiting for a message that never comes. (A disagreement no message
///   crosses, such as two ranks that both think they are the root of a broadcast, cannot be
///   seen; peers still waiting fail by deadline or when this communicator aborts.)
/// - A call either succeeds on this rank with the complete result, or returns an error. After
///   any error the communicator is poisoned: every later call returns the same error, and
///   (unless [`CommConfig::abort_transport_on_error`] is off) it aborts its transport so that
///   peers stop waiting on it at once. A revoked communicator refuses
///   everything with [`CommError::Revoked`]; once revoked, every failure is reported as
///   `Revoked` with the revoker's root cause.
/// - World size 1: every collective is a local copy or nothing. Zero elements: no messages.
pub struct Communicator<T: Transport> {
    transport: Arc<T>,
    config: CommConfig,
    rank: u32,
    size: u32,
    generation: u64,
    next_seq: u32,
    revoke: Arc<RevokeState>,
    poisoned: Option<CommError>,
    in_flight: bool,
    scratch: Scratch,
    /// Which host each rank is on (for the hierarchical allreduce).
    layout: HostLayout,
    /// The ranks of every host, from `layout`.
    pub(crate) hosts: Arc<[Vec<usize>]>,
    /// Per peer: next point-to-point step to send with / to receive with.
    pub(crate) p2p_send: Vec<u64>,
    /// See `p2p_send`.
    pub(crate) p2p_recv: Vec<u64>,
    /// Messages received in the operation in flight (reset when one starts).
    op_received: AtomicU64,
}

impl<T: Transport> fmt::Debug for Communicator<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("generation", &self.generation)
            .field("next_seq", &self.next_seq)
            .field("config", &self.config)
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

impl<T: Transport> Communicator<T> {
    /// A communicator over `transport` (connected for one generation) with `config`.
    pub fn new(transport: Arc<T>, config: CommConfig) -> Self {
        let (rank, size, generation) = (transport.rank(), transport.world_size(), transport.generation());
        Self {
            transport,
            config,
            rank,
            size,
            generation,
            next_seq: 0,
            revoke: Arc::default(),
            poisoned: None,
            in_flight: false,
            scratch: Scratch::default(),
            layout: HostLayout::flat(size),
            hosts: HostLayout::flat(size).hosts().into(),
            p2p_send: vec![P2P_STEP_BASE; size as usize],
            p2p_recv: vec![P2P_STEP_BASE; size as usize],
            op_received: AtomicU64::new(0),
        }
    }

    /// Tells the communicator which host each rank is on, for
    /// [`Algorithm::Hierarchical`] and its choice under [`Algorithm::Auto`] (until then every
    /// rank counts as a host of its own). Every rank must set the same layout: the call
    /// signature carries it, so ranks that disagree fail with a signature mismatch. Fails if
    /// the layout's world size is not this communicator's.
    pub fn set_layout(&mut self, layout: HostLayout) -> Result<(), CommError> {
        if layout.world_size() != self.size {
            return Err(CommError::InvalidArgument(format!(
                "a host layout of {} ranks for a world of {}",
                layout.world_size(),
                self.size
            )));
        }
        self.hosts = layout.hosts().into();
        self.layout = layout;
        Ok(())
    }

    /// A communicator over this one's ranks `members` (subgroup rank `i` being this
    /// communicator's rank `members[i]`) on `channel`: it shares this communicator's links
    /// (see [`Subgroup`]), configuration, revocation and host layout (restricted to its
    /// members), and its calls may run concurrently with this one's. Every member must call
    /// it with the same list and channel; fails with [`CommError::InvalidArgument`] when
    /// [`Subgroup::new`] refuses them.
    pub fn subgroup(&self, members: &[u32], channel: u32) -> Result<Communicator<Subgroup<T>>, CommError> {
        let transport = Subgroup::new(self.transport.clone(), members.to_vec(), channel)
            .map_err(|e| CommError::InvalidArgument(e.to_string()))?;
        Ok(self.sub_communicator(transport, members))
    }

    /// A communicator over `transport`, a subgroup of this one's ranks `members` (see
    /// [`Communicator::subgroup`]).
    pub(crate) fn sub_communicator<U: Transport>(&self, transport: U, members: &[u32]) -> Communicator<U> {
        let mut sub = Communicator::new(Arc::new(transport), self.config.clone());
        sub.revoke = self.revoke.clone();
        sub.layout = self.layout.restrict(members);
        sub.hosts = sub.layout.hosts().into();
        sub
    }

    /// The host layout (see [`Communicator::set_layout`]).
    pub fn layout(&self) -> &HostLayout {
        &self.layout
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// The generation the transport was built for.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The configuration.
    pub fn config(&self) -> &CommConfig {
        &self.config
    }

    /// The underlying transport.
    pub fn transport(&self) -> &Arc<T> {
        &self.transport
    }

    /// The error this communicator is poisoned with, if any.
    pub fn poisoned(&self) -> Option<&CommError> {
        self.poisoned.as_ref()
    }

    /// A handle that revokes this communicator from anywhere (see [`Revoker`]).
    pub fn revoker(&self) -> Revoker {
        let transport = self.transport.clone();
        Revoker {
            state: self.revoke.clone(),
            abort: Arc::new(move |reason| transport.abort(reason)),
            generation: self.generation,
        }
    }

    fn revoked_error(&self) -> Option<CommError> {
        self.revoke.cause.get().map(|cause| CommError::Revoked { generation: self.generation, cause: cause.clone() })
    }

    fn classify(&self, failure: Failure, progress: OpProgress, call: &Call) -> CommError {
        if let Some(e) = self.revoked_error() {
            return e;
        }
        match failure {
            Failure::WholeOpDeadline(after) => {
                CommError::Timeout { rank: None, after, progress: Some(progress), silence: Silence::Unprobed }
            }
            Failure::Transport(e) => match e {
                TransportError::PeerClosed { peer, detail } | TransportError::Protocol { peer, detail } => {
                    CommError::PeerFailed { rank: peer, detail }
                }
                TransportError::Timeout { peer, after, silence } => {
                    CommError::Timeout { rank: Some(peer), after, progress: Some(progress), silence }
                }
                TransportError::Aborted(reason) => {
                    CommError::Revoked { generation: self.generation, cause: RootCause::reason(reason.to_string()) }
                }
                TransportError::Mismatch { peer, detail, signatures } => CommError::Mismatch {
                    rank: peer,
                    detail: match signatures {
                        Some(sig) => describe_mismatch(call, sig.received),
                        None => format!("{detail} (in {})", call.describe()),
                    },
                },
                TransportError::InvalidArgument(msg) => CommError::InvalidArgument(msg),
                other => CommError::Transport(other),
            },
        }
    }

    /// Poisons the communicator with `err` and, unless configured otherwise
    /// ([`CommConfig::abort_transport_on_error`]), aborts the transport.
    pub(crate) fn poison(&mut self, err: CommError) -> CommError {
        tracing::debug!(generation = self.generation, rank = self.rank, error = %err, "communicator poisoned");
        self.poisoned = Some(err.clone());
        if self.config.abort_transport_on_error {
            self.transport.abort(AbortReason::new(format!("rank {} communicator failed: {err}", self.rank)));
        }
        err
    }

    /// Refuses the call if poisoned or revoked, validates it, and takes a sequence number
    /// (`advance`: false for point-to-point, which shares the next collective's number).
    fn begin(
        &mut self,
        call: &Call,
        elem_size: usize,
        bytes: usize,
        valid: Result<(), String>,
        advance: bool,
    ) -> Result<Started<T>, CommError> {
        if let Some(e) = &self.poisoned {
            return Err(e.clone());
        }
        if let Some(e) = self.revoked_error() {
            return Err(self.poison(e));
        }
        if self.in_flight {
            let e = CommError::Revoked {
                generation: self.generation,
                cause: RootCause {
                    rank: Some(self.rank),
                    worker_id: String::new(),
                    host: String::new(),
                    reason: "a previous collective on this communicator was cancelled mid-flight".into(),
                },
            };
            return Err(self.poison(e));
        }
        if let Err(msg) = valid {
            return Err(self.poison(CommError::InvalidArgument(format!("{}: {msg}", call.kind.name))));
        }
        let seq = self.next_seq;
        if advance {
            // The count of operations, which failure reports carry and the coordinator orders
            // (`OpProgress`), wraps only at 2^32; a tag carries its low bits (`Ctx::seq`).
            self.next_seq = seq.wrapping_add(1);
        }
        self.in_flight = true;
        self.op_received.store(0, Ordering::Relaxed);
        let span = tracing::debug_span!(
            "collective",
            kind = call.kind.name,
            generation = self.generation,
            rank = self.rank,
            seq,
            bytes
        );
        Ok(Started {
            call: *call,
            seq,
            sig: call.signature(),
            seg: self.segment_elems(call, elem_size),
            span,
            guard: CancelGuard { transport: self.transport.clone(), armed: true },
        })
    }

    /// Elements per segment of `call` (elements of `elem_size` bytes): the configured
    /// segment, cut finer over a transport that asks for it ([`segment_for`]; a point-to-point
    /// message is one block). The same on every rank that makes the call.
    pub(crate) fn segment_elems(&self, call: &Call, elem_size: usize) -> usize {
        let blocks = if call.kind == CallKind::P2P { 1 } else { self.size };
        let bytes = segment_for(
            call.count.saturating_mul(elem_size as u64),
            blocks,
            self.config.segment_bytes,
            self.transport.pipeline_segment(),
        );
        (bytes / elem_size.max(1)).max(1)
    }

    /// Completes a started operation: disarms the cancel guard, classifies and records errors.
    fn finish(&mut self, mut started: Started<T>, res: Result<(), Failure>) -> Result<(), CommError> {
        started.guard.armed = false;
        self.in_flight = false;
        match res {
            Ok(()) => Ok(()),
            Err(f) => {
                let progress = OpProgress { seq: started.seq, received: self.op_received.load(Ordering::Relaxed) };
                let e = self.classify(f, progress, &started.call);
                Err(self.poison(e))
            }
        }
    }
}

/// Runs `fut` under the optional whole-op bound.
async fn drive<F: Future<Output = Result<(), TransportError>>>(limit: Option<Duration>, fut: F) -> Result<(), Failure> {
    match limit {
        None => fut.await.map_err(Failure::Transport),
        Some(d) => match tokio::time::timeout(d, fut).await {
            Ok(r) => r.map_err(Failure::Transport),
            Err(_) => Err(Failure::WholeOpDeadline(d)),
        },
    }
}

/// One operation's view of the transport, which [`Communicator::run`] hands the schedule.
///
/// Schedules receive through [`Ctx::recv`] (or [`Ctx::recv_segs`]), never `t.recv`
/// directly: the count of received messages is how far this rank got in the operation,
/// which a timeout report carries (see [`crate::OpProgress`]).
pub(crate) struct Ctx<'a, T> {
    /// The transport (send through it; receive through [`Ctx::recv`]).
    pub t: &'a T,
    /// Messages received so far in this operation.
    pub received: &'a AtomicU64,
    /// This rank.
    pub rank: usize,
    /// World size.
    pub size: usize,
    /// The operation's sequence number as tags carry it (within [`cohort_transports::wire::SEQ_MASK`]).
    pub seq: u32,
    /// The call signature every message carries.
    pub sig: u32,
    /// Elements per message (at least 1).
    pub seg: usize,
}

impl<T: Transport> Ctx<'_, T> {
    /// The tag of message `step`; fails if the schedule runs out of the 32-bit step space.
    pub(crate) fn tag(&self, step: u64) -> Result<Tag, TransportError> {
        u32::try_from(step).map(|s| Tag::new(self.seq, s, self.sig)).map_err(|_| {
            TransportError::InvalidArgument(format!(
                "operation needs more than 2^32 messages per link at {} elements per segment; raise segment_bytes",
                self.seg
            ))
        })
    }

    /// Number of messages that carry `len` elements.
    pub(crate) fn nsegs(&self, len: usize) -> u64 {
        len.div_ceil(self.seg) as u64
    }

    /// Sends `data` to `peer` as segments with steps `step0, step0 + 1, ...` (nothing if empty).
    pub(crate) async fn send_segs<E: Element>(
        &self,
        peer: usize,
        step0: u64,
        data: &[E],
    ) -> Result<(), TransportError> {
        for (k, chunk) in data.chunks(self.seg).enumerate() {
            self.t.send(peer as u32, self.tag(step0 + k as u64)?, as_bytes(chunk)).await?;
        }
        Ok(())
    }

    /// Receives message `tag` from `peer` into `buf` and counts it.
    pub(crate) async fn recv(&self, peer: Rank, tag: Tag, buf: &mut [u8]) -> Result<(), TransportError> {
        self.t.recv(peer, tag, buf).await?;
        self.received.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Receives message `tag` from `peer` and combines it into `acc` with `op` as it arrives
    /// (the incoming operand first when `other_first`), then counts it. Over shared memory
    /// the operand is read straight from the peer's ring; other transports land it in
    /// `scratch` first, which must hold `acc.len()` elements.
    pub(crate) async fn recv_combine<E: Element>(
        &self,
        peer: Rank,
        tag: Tag,
        acc: &mut [E],
        scratch: &mut [E],
        op: ReduceOp,
        other_first: bool,
    ) -> Result<(), TransportError> {
        let len = acc.len();
        let mut into = CombineInto::new(op, acc, other_first);
        self.t.recv_with(peer, tag, as_bytes_mut(&mut scratch[..len]), |piece| into.feed(piece)).await?;
        debug_assert!(into.is_complete(), "the transport delivered fewer bytes than the receive's length");
        self.received.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Receives into `buf` from `peer` the segments sent by [`Ctx::send_segs`] with `step0`.
    pub(crate) async fn recv_segs<E: Element>(
        &self,
        peer: usize,
        step0: u64,
        buf: &mut [E],
    ) -> Result<(), TransportError> {
        for (k, chunk) in buf.chunks_mut(self.seg).enumerate() {
            self.recv(peer as u32, self.tag(step0 + k as u64)?, as_bytes_mut(chunk)).await?;
        }
        Ok(())
    }
}

impl<T: Transport> Communicator<T> {
    /// Runs one operation: refuses it if poisoned or revoked, checks `valid`, takes a sequence
    /// number (unless `advance` is false: point-to-point), runs `body` with a [`Ctx`] and the
    /// scratch under the whole-op bound, then records the outcome (a failure poisons).
    ///
    /// `elem_size` sets the segment in elements; `bytes` is what the tracing span reports.
    /// Every collective method builds its [`Call`] and runs its schedule through this.
    pub(crate) async fn run<B>(
        &mut self,
        call: Call,
        elem_size: usize,
        bytes: usize,
        valid: Result<(), String>,
        advance: bool,
        body: B,
    ) -> Result<(), CommError>
    where
        B: AsyncFnOnce(Ctx<'_, T>, &mut Scratch) -> Result<(), TransportError>,
    {
        let started = self.begin(&call, elem_size, bytes, valid, advance)?;
        let res = {
            let ctx = Ctx {
                t: &*self.transport,
                received: &self.op_received,
                rank: self.rank as usize,
                size: self.size as usize,
                // Tags number operations within the sequence bits (the bits above are the
                // channel a subgroup's transport adds); links compare them in wrapping order.
                seq: started.seq & cohort_transports::wire::SEQ_MASK,
                sig: started.sig,
                seg: started.seg,
            };
            // The schedule's future is large (it holds every schedule's state and, through
            // them, the transports' send and receive futures, the TCP link's among them) and
            // every async call above would move it by value: one box here keeps the
            // collective's outer futures small. Measured on an 8-byte allreduce over the
            // elastic mesh: the moves took 12-15% of a rank's time (docs/benchmarks-journal.md,
            // "The smallest messages").
            drive(self.config.op_timeout, Box::pin(body(ctx, &mut self.scratch))).instrument(started.span.clone()).await
        };
        self.finish(started, res)
    }
}

/// `Ok` if `cond`, else the message `msg` builds (an argument check of a collective).
pub(crate) fn check(cond: bool, msg: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(msg())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configured segment, unless the transport asks for finer pipelining and a block
    /// would be fewer than sixteen segments; never below the transport's floor nor above the
    /// configured size.
    #[test]
    fn segments_are_cut_finer_only_where_a_block_would_be_few_of_them() {
        const K: usize = 1 << 10;
        const M: u64 = 1 << 20;
        let tcp = Some(256 * K);
        // Shared memory (no floor): always as configured.
        assert_eq!(segment_for(4 * M, 2, 1024 * K, None), 1024 * K);
        // 2 ranks: blocks of 1 to 8 MiB in 1 MiB segments would be few; 16 MiB blocks are
        // sixteen.
        assert_eq!(segment_for(2 * M, 2, 1024 * K, tcp), 256 * K);
        assert_eq!(segment_for(4 * M, 2, 1024 * K, tcp), 256 * K);
        assert_eq!(segment_for(8 * M, 2, 1024 * K, tcp), 256 * K);
        assert_eq!(segment_for(16 * M, 2, 1024 * K, tcp), 512 * K);
        assert_eq!(segment_for(32 * M, 2, 1024 * K, tcp), 1024 * K);
        assert_eq!(segment_for(64 * M, 2, 1024 * K, tcp), 1024 * K);
        // 4 ranks: a 16 MiB call has 4 MiB blocks.
        assert_eq!(segment_for(16 * M, 4, 1024 * K, tcp), 256 * K);
        assert_eq!(segment_for(64 * M, 4, 1024 * K, tcp), 1024 * K);
        // Small calls, and nothing below the floor.
        assert_eq!(segment_for(64 * K as u64, 2, 1024 * K, tcp), 256 * K);
        assert_eq!(segment_for(0, 8, 1024 * K, tcp), 256 * K);
        // A configured segment below the floor is kept (tests cut 1 KiB segments on purpose).
        assert_eq!(segment_for(16 * M, 2, 1024, tcp), 1024);
        // A world of 0 or a huge call does not panic.
        assert_eq!(segment_for(u64::MAX, 0, 1024 * K, tcp), 1024 * K);
    }

    /// Tags carry an operation's number within the sequence bits and wrap there; the count a
    /// failure report carries (the coordinator orders reports by it) goes on past the wrap.
    #[tokio::test(start_paused = true)]
    async fn tags_wrap_within_the_sequence_bits_and_reports_count_on() {
        use cohort_testkit::sim::SimNetwork;
        use cohort_transports::wire::SEQ_MASK;
        let deadlines = cohort_transports::Deadlines {
            no_progress: Duration::from_secs(2),
            connect: Duration::from_secs(2),
            learning: None,
        };
        let (_net, ts) = SimNetwork::new(2, 1, deadlines);
        let mut comms: Vec<_> = ts.into_iter().map(|t| Communicator::new(Arc::new(t), CommConfig::default())).collect();
        for c in &mut comms {
            c.next_seq = SEQ_MASK - 1;
        }
        let (mut c1, mut c0) = (comms.pop().unwrap(), comms.pop().unwrap());
        for round in 0..4u32 {
            let (mut a, mut b) = (vec![round as f32; 5], vec![1.0f32; 5]);
            let (x, y) = tokio::join!(c0.allreduce(&mut a, ReduceOp::Sum), c1.allreduce(&mut b, ReduceOp::Sum));
            x.unwrap();
            y.unwrap();
            assert_eq!(a, vec![round as f32 + 1.0; 5], "round {round} across the wrap");
            assert_eq!(a, b);
        }
        assert_eq!(c0.next_seq, SEQ_MASK + 3);
        // Rank 1 never calls: rank 0 times out, and its report counts past the wrap.
        let e = c0.allreduce(&mut [1.0f32; 5], ReduceOp::Sum).await.unwrap_err();
        match e {
            CommError::Timeout { progress: Some(p), .. } => assert_eq!(p.seq, SEQ_MASK + 3),
            other => panic!("expected a timeout with progress, got {other}"),
        }
    }

    #[test]
    fn call_kinds_are_distinct() {
        for (i, a) in CallKind::ALL.iter().enumerate() {
            assert!(a.code < 32, "{}'s code {} does not fit the signature's 5 bits", a.name, a.code);
            for b in &CallKind::ALL[i + 1..] {
                assert_ne!(a.code, b.code, "{} and {} share a signature code", a.name, b.name);
                assert_ne!(a.name, b.name, "two collectives are named {}", a.name);
            }
        }
    }

    /// The signature bits are what ranks of different builds compare, so their layout must not
    /// change by accident: the collective's code in the top 5 bits, then dtype, op and
    /// algorithm codes in 3 bits each, then an 18-bit hash of count, root and extra.
    #[test]
    fn call_signatures_are_stable() {
        assert_eq!(Call::new(CallKind::BARRIER).signature() >> 18, 10 << 9);
        let broadcast = Call { dtype: Some(DType::F32), count: 7, root: Some(2), ..Call::new(CallKind::BROADCAST) };
        assert_eq!(broadcast.signature() >> 18, (4 << 9) | (1 << 6));
        let allreduce = Call {
            dtype: Some(DType::U8),
            op: Some(ReduceOp::Avg),
            algo: Some(Algorithm::Hierarchical),
            count: 7,
            ..Call::new(CallKind::ALLREDUCE)
        };
        assert_eq!(allreduce.signature() >> 18, (7 << 6) | (5 << 3) | 5);
        let other_count = Call { count: 8, ..allreduce };
        assert_ne!(other_count.signature(), allreduce.signature());
        assert_eq!(other_count.signature() >> 18, allreduce.signature() >> 18);
    }

    /// A mismatch names both calls and says what differs (the user's complaint: a bare
    /// "signature 0x.. received, 0x.. expected" said nothing).
    #[test]
    fn a_mismatch_names_both_calls_and_what_differs() {
        let ours =
            Call { dtype: Some(DType::F32), op: Some(ReduceOp::Sum), count: 1000, ..Call::new(CallKind::ALLREDUCE) };
        let theirs = Call { dtype: Some(DType::U8), count: 1000, root: Some(1), ..Call::new(CallKind::BROADCAST) };
        assert_eq!(
            describe_mismatch(&ours, theirs.signature()),
            "it called broadcast(u8) where this rank called allreduce(count 1000, f32, sum): \
             they differ in collective, dtype, op, count, root or layout"
        );
        let f64s = Call { dtype: Some(DType::F64), ..ours };
        assert_eq!(
            describe_mismatch(&ours, f64s.signature()),
            "it called allreduce(f64, sum) where this rank called allreduce(count 1000, f32, sum): they differ in dtype"
        );
        let max = Call { op: Some(ReduceOp::Max), ..ours };
        assert!(describe_mismatch(&ours, max.signature()).ends_with("they differ in op"));
        let fewer = Call { count: 999, ..ours };
        assert!(describe_mismatch(&ours, fewer.signature()).ends_with("they differ in count, root or layout"));
        // A classified transport mismatch is its own error, not an invalid argument.
        let sig = cohort_transports::Signatures { received: theirs.signature(), expected: ours.signature() };
        let e = TransportError::Mismatch { peer: 1, detail: String::new(), signatures: Some(sig) };
        assert_eq!(describe_mismatch(&ours, sig.received), describe_mismatch(&ours, theirs.signature()));
        assert!(matches!(e, TransportError::Mismatch { peer: 1, .. }));
    }
}
