//! The [`Communicator`]: collectives of one generation over a [`Transport`], with deadlines,
//! revocation and poisoning.

use crate::algo::Algorithm;
use crate::collectives::{self, alltoall, barrier, bcube, hierarchical, recursive_doubling, ring, tree, Ctx};
use crate::dtype::{as_bytes, as_bytes_mut, from_bytes_mut, DType, Element, Scratch};
use crate::error::{CommError, OpProgress, RootCause};
use crate::reduce::ReduceOp;
use crate::topology::HostLayout;
use cohort_transports::{AbortReason, Transport, TransportError};
use half::{bf16, f16};
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
    /// Values below one element are treated as one element.
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

/// Which collective a call is (part of the signature and the span).
#[derive(Clone, Copy, Debug)]
enum Kind {
    Allreduce,
    ReduceScatter,
    Allgather,
    Allgatherv,
    Broadcast,
    Reduce,
    Gather,
    Scatter,
    Alltoall,
    Alltoallv,
    Barrier,
    P2p,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Allreduce => "allreduce",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::Allgather => "allgather",
            Kind::Allgatherv => "allgatherv",
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::Gather => "gather",
            Kind::Scatter => "scatter",
            Kind::Alltoall => "alltoall",
            Kind::Alltoallv => "alltoallv",
            Kind::Barrier => "barrier",
            Kind::P2p => "p2p",
        }
    }
}

/// What a call was made with; hashed into the signature every message carries.
struct Call {
    kind: Kind,
    dtype: Option<DType>,
    op: Option<ReduceOp>,
    count: u64,
    root: Option<u32>,
    algo: Option<Algorithm>,
    /// Hash of further arguments all ranks share (allgatherv counts).
    extra: u64,
}

impl Call {
    fn new(kind: Kind) -> Self {
        Self { kind, dtype: None, op: None, count: 0, root: None, algo: None, extra: 0 }
    }

    /// 32-bit FNV-1a over the arguments.
    fn signature(&self) -> u32 {
        let mut h = Fnv::new();
        h.bytes(&[
            self.kind as u8,
            self.dtype.map_or(0, DType::code),
            self.op.map_or(0, ReduceOp::code),
            self.algo.map_or(0, Algorithm::code),
        ]);
        h.bytes(&self.count.to_le_bytes());
        h.bytes(&self.root.map_or(u32::MAX, |r| r).to_le_bytes());
        h.bytes(&self.extra.to_le_bytes());
        h.0
    }
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

fn hash_counts(counts: &[usize]) -> u64 {
    let mut h = Fnv::new();
    for &c in counts {
        h.bytes(&(c as u64).to_le_bytes());
    }
    u64::from(h.0)
}

/// First step of point-to-point messages; collectives use the steps below it.
const P2P_STEP_BASE: u64 = 1 << 31;

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
///   [`CommError::InvalidArgument`] when their messages meet, instead of combining garbage.
///   (A disagreement no message crosses, such as two ranks that both think they are the root
///   of a broadcast, cannot be seen; peers still waiting fail by deadline or when this
///   communicator aborts.)
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
    bcube_dims: Arc<[u32]>,
    /// Which host each rank is on (for the hierarchical allreduce).
    layout: HostLayout,
    /// The ranks of every host, from `layout`.
    hosts: Arc<[Vec<usize>]>,
    /// Per peer: next point-to-point step to send with / to receive with.
    p2p_send: Vec<u64>,
    p2p_recv: Vec<u64>,
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
        let bcube_dims: Arc<[u32]> = bcube::factorize(size, config.bcube_base).into();
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
            bcube_dims,
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

    fn classify(&self, failure: Failure, progress: OpProgress) -> CommError {
        if let Some(e) = self.revoked_error() {
            return e;
        }
        match failure {
            Failure::WholeOpDeadline(after) => CommError::Timeout { rank: None, after, progress: Some(progress) },
            Failure::Transport(e) => match e {
                TransportError::PeerClosed { peer, detail } | TransportError::Protocol { peer, detail } => {
                    CommError::PeerFailed { rank: peer, detail }
                }
                TransportError::Timeout { peer, after } => {
                    CommError::Timeout { rank: Some(peer), after, progress: Some(progress) }
                }
                TransportError::Aborted(reason) => {
                    CommError::Revoked { generation: self.generation, cause: RootCause::reason(reason.to_string()) }
                }
                TransportError::Mismatch { peer, detail } => {
                    CommError::InvalidArgument(format!("rank {peer} disagrees about the call: {detail}"))
                }
                TransportError::InvalidArgument(msg) => CommError::InvalidArgument(msg),
                other => CommError::Transport(other),
            },
        }
    }

    /// Poisons the communicator with `err` and, unless configured otherwise
    /// ([`CommConfig::abort_transport_on_error`]), aborts the transport.
    fn poison(&mut self, err: CommError) -> CommError {
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
            return Err(self.poison(CommError::InvalidArgument(format!("{}: {msg}", call.kind.name()))));
        }
        let seq = self.next_seq;
        if advance {
            self.next_seq = match seq.checked_add(1) {
                Some(s) => s,
                None => {
                    return Err(self.poison(CommError::InvalidArgument(
                        "sequence numbers exhausted (2^32 operations); re-form the communicator".into(),
                    )))
                }
            };
        }
        self.in_flight = true;
        self.op_received.store(0, Ordering::Relaxed);
        let span = tracing::debug_span!(
            "collective",
            kind = call.kind.name(),
            generation = self.generation,
            rank = self.rank,
            seq,
            bytes
        );
        Ok(Started {
            seq,
            sig: call.signature(),
            seg: (self.config.segment_bytes / elem_size.max(1)).max(1),
            span,
            guard: CancelGuard { transport: self.transport.clone(), armed: true },
        })
    }

    /// Completes a started operation: disarms the cancel guard, classifies and records errors.
    fn finish(&mut self, mut started: Started<T>, res: Result<(), Failure>) -> Result<(), CommError> {
        started.guard.armed = false;
        self.in_flight = false;
        match res {
            Ok(()) => Ok(()),
            Err(f) => {
                let progress = OpProgress { seq: started.seq, received: self.op_received.load(Ordering::Relaxed) };
                let e = self.classify(f, progress);
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

/// Runs one operation: `begin`, the body with a [`Ctx`] and the scratch, `finish`.
macro_rules! operation {
    ($self:ident, $call:expr, $elem:expr, $bytes:expr, $valid:expr, $advance:expr, |$ctx:ident, $scratch:ident| $body:expr) => {{
        let call = $call;
        let started = $self.begin(&call, $elem, $bytes, $valid, $advance)?;
        let res = {
            let $ctx = Ctx {
                t: &*$self.transport,
                received: &$self.op_received,
                rank: $self.rank as usize,
                size: $self.size as usize,
                seq: started.seq,
                sig: started.sig,
                seg: started.seg,
            };
            #[allow(unused_variables)]
            let $scratch = &mut $self.scratch;
            drive($self.config.op_timeout, async { $body }).instrument(started.span.clone()).await
        };
        $self.finish(started, res)
    }};
}

fn check(cond: bool, msg: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(msg())
    }
}

impl<T: Transport> Communicator<T> {
    /// Allreduce `data` in place with the configured algorithm: afterwards every rank holds
    /// the element-wise reduction of all ranks' `data`, with identical bytes on every rank.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropping the future mid-flight aborts the transport and poisons the
    /// communicator (use the [`Revoker`] or `op_timeout` to stop an operation on purpose).
    pub async fn allreduce<E: Element>(&mut self, data: &mut [E], op: ReduceOp) -> Result<(), CommError> {
        let algo = self.config.algorithm;
        self.allreduce_with(data, op, algo).await
    }

    /// Allreduce with an explicit algorithm (`Auto` resolves by message size, see
    /// [`Algorithm::resolve`]). All ranks must pass the same algorithm.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn allreduce_with<E: Element>(
        &mut self,
        data: &mut [E],
        op: ReduceOp,
        algo: Algorithm,
    ) -> Result<(), CommError> {
        let bytes = std::mem::size_of_val(data);
        let algo = algo.resolve_on(bytes, &self.layout);
        let call = Call {
            dtype: Some(E::DTYPE),
            op: Some(op),
            count: data.len() as u64,
            algo: Some(algo),
            extra: if algo == Algorithm::Hierarchical { self.layout.fingerprint() } else { 0 },
            ..Call::new(Kind::Allreduce)
        };
        let (len, n) = (data.len(), self.size as usize);
        let dims = self.bcube_dims.clone();
        let hosts = self.hosts.clone();
        operation!(self, call, std::mem::size_of::<E>(), bytes, Ok(()), true, |ctx, scratch| {
            match algo {
                Algorithm::Ring | Algorithm::Auto => {
                    let s = scratch.get::<E>(ring::allreduce_scratch(ctx.seg, len, n));
                    ring::allreduce(&ctx, data, op, s).await
                }
                Algorithm::RecursiveDoubling => {
                    let s = scratch.get::<E>(recursive_doubling::allreduce_scratch(ctx.seg, len));
                    recursive_doubling::allreduce(&ctx, data, op, s).await
                }
                Algorithm::Bcube => {
                    let s = scratch.get::<E>(bcube::allreduce_scratch(ctx.seg, len, &dims));
                    bcube::allreduce(&ctx, data, op, &dims, s).await
                }
                Algorithm::Hierarchical => {
                    let s = scratch.get::<E>(hierarchical::allreduce_scratch(ctx.seg, len));
                    hierarchical::allreduce(&ctx, data, op, &hosts, s).await
                }
            }
        })
    }

    /// Reduce-scatter: reduces all ranks' `input` element-wise and leaves this rank's block of
    /// the result in `output`. Blocks follow [`crate::counts_for`]`(input.len(), size)`: the first
    /// `input.len() % size` ranks get one element more; `output.len()` must equal this rank's
    /// block. Ring schedule; `input` is copied once into scratch.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn reduce_scatter<E: Element>(
        &mut self,
        input: &[E],
        output: &mut [E],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let (len, n, rank) = (input.len(), self.size as usize, self.rank as usize);
        let mine = collectives::block_range(len, n, rank);
        let valid = check(output.len() == mine.len(), || {
            format!(
                "output has {} elements, rank {rank}'s block of {len} over {n} ranks has {}",
                output.len(),
                mine.len()
            )
        });
        let call = Call { dtype: Some(E::DTYPE), op: Some(op), count: len as u64, ..Call::new(Kind::ReduceScatter) };
        operation!(self, call, std::mem::size_of::<E>(), std::mem::size_of_val(input), valid, true, |ctx, scratch| {
            let seg_need = ctx.seg.min(len.div_ceil(n));
            let all = scratch.get::<E>(len + seg_need);
            let (work, seg) = all.split_at_mut(len);
            work.copy_from_slice(input);
            let stride = ctx.nsegs(len.div_ceil(n));
            let blocks = |i| collectives::block_range(len, n, i);
            ring::reduce_scatter_inplace(&ctx, ring::RingOrder::world(&ctx), work, blocks, op, seg, 0, stride).await?;
            let result = &mut work[mine.clone()];
            crate::reduce::finish_avg(op, result, n as u32);
            output.copy_from_slice(result);
            Ok(())
        })
    }

    /// Allgather: `output` (of `input.len() * size` elements) gets rank `i`'s `input` as block
    /// `i`, on every rank. Ring schedule, in place in `output`.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn allgather<E: Element>(&mut self, input: &[E], output: &mut [E]) -> Result<(), CommError> {
        let (m, n, rank) = (input.len(), self.size as usize, self.rank as usize);
        let valid =
            check(output.len() == m * n, || format!("output has {} elements, expected {m} x {n}", output.len()));
        let call = Call { dtype: Some(E::DTYPE), count: m as u64, ..Call::new(Kind::Allgather) };
        operation!(self, call, std::mem::size_of::<E>(), std::mem::size_of_val(output), valid, true, |ctx, scratch| {
            output[rank * m..(rank + 1) * m].copy_from_slice(input);
            ring::allgather_inplace(&ctx, ring::RingOrder::world(&ctx), output, |i| i * m..(i + 1) * m, 0, ctx.nsegs(m))
                .await
        })
    }

    /// Allgather with per-rank sizes: rank `i` contributes `counts[i]` elements (its `input`),
    /// and `output` (of `sum(counts)` elements) gets them concatenated in rank order. `counts`
    /// must be the same on every rank.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn allgatherv<E: Element>(
        &mut self,
        input: &[E],
        output: &mut [E],
        counts: &[usize],
    ) -> Result<(), CommError> {
        let (n, rank) = (self.size as usize, self.rank as usize);
        let total: usize = counts.iter().sum();
        let valid = check(counts.len() == n, || format!("{} counts for {n} ranks", counts.len()))
            .and_then(|_| {
                check(counts[rank] == input.len(), || {
                    format!("counts[{rank}] = {} but input has {} elements", counts[rank], input.len())
                })
            })
            .and_then(|_| {
                check(output.len() == total, || format!("output has {} elements, counts sum to {total}", output.len()))
            });
        let call = Call {
            dtype: Some(E::DTYPE),
            count: total as u64,
            extra: hash_counts(counts),
            ..Call::new(Kind::Allgatherv)
        };
        operation!(self, call, std::mem::size_of::<E>(), std::mem::size_of_val(output), valid, true, |ctx, scratch| {
            let offs = collectives::offsets(counts);
            output[offs[rank]..offs[rank] + counts[rank]].copy_from_slice(input);
            let stride = ctx.nsegs(counts.iter().copied().max().unwrap_or(0));
            ring::allgather_inplace(
                &ctx,
                ring::RingOrder::world(&ctx),
                output,
                |i| offs[i]..offs[i] + counts[i],
                0,
                stride,
            )
            .await
        })
    }

    /// Broadcast `data` from `root` to every rank (binomial tree, pipelined by segment).
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn broadcast<E: Element>(&mut self, data: &mut [E], root: u32) -> Result<(), CommError> {
        let n = self.size;
        let valid = check(root < n, || format!("root {root} out of range for {n} ranks"));
        let call =
            Call { dtype: Some(E::DTYPE), count: data.len() as u64, root: Some(root), ..Call::new(Kind::Broadcast) };
        operation!(self, call, std::mem::size_of::<E>(), std::mem::size_of_val(data), valid, true, |ctx, scratch| {
            tree::broadcast(&ctx, data, root as usize).await
        })
    }

    /// Reduce to `root`: afterwards the root's `data` holds the element-wise reduction; other
    /// ranks' `data` is left unchanged (binomial tree, pipelined by segment).
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn reduce<E: Element>(&mut self, data: &mut [E], op: ReduceOp, root: u32) -> Result<(), CommError> {
        let n = self.size;
        let valid = check(root < n, || format!("root {root} out of range for {n} ranks"));
        let len = data.len();
        let call = Call {
            dtype: Some(E::DTYPE),
            op: Some(op),
            count: len as u64,
            root: Some(root),
            ..Call::new(Kind::Reduce)
        };
        operation!(self, call, std::mem::size_of::<E>(), std::mem::size_of_val(data), valid, true, |ctx, scratch| {
            let s = scratch.get::<E>(tree::reduce_scratch(ctx.seg, len));
            tree::reduce(&ctx, data, op, root as usize, s).await
        })
    }

    /// Gather every rank's `input` (same length everywhere) into `output` on `root`, block `i`
    /// from rank `i`. `output` must hold `input.len() * size` elements on the root and is not
    /// touched (may be empty) elsewhere.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn gather<E: Element>(&mut self, input: &[E], output: &mut [E], root: u32) -> Result<(), CommError> {
        let (n, m) = (self.size as usize, input.len());
        let on_root = root == self.rank;
        let valid = check(root < self.size, || format!("root {root} out of range for {n} ranks")).and_then(|_| {
            check(!on_root || output.len() == m * n, || {
                format!("output has {} elements, expected {m} x {n}", output.len())
            })
        });
        let call = Call { dtype: Some(E::DTYPE), count: m as u64, root: Some(root), ..Call::new(Kind::Gather) };
        operation!(self, call, std::mem::size_of::<E>(), std::mem::size_of_val(input), valid, true, |ctx, scratch| {
            tree::gather(&ctx, input, output, root as usize).await
        })
    }

    /// Scatter block `i` of the root's `input` (`output.len() * size` elements; ignored and may
    /// be empty elsewhere) to rank `i`'s `output`.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn scatter<E: Element>(&mut self, input: &[E], output: &mut [E], root: u32) -> Result<(), CommError> {
        let (n, m) = (self.size as usize, output.len());
        let on_root = root == self.rank;
        let valid = check(root < self.size, || format!("root {root} out of range for {n} ranks")).and_then(|_| {
            check(!on_root || input.len() == m * n, || {
                format!("input has {} elements, expected {m} x {n}", input.len())
            })
        });
        let call = Call { dtype: Some(E::DTYPE), count: m as u64, root: Some(root), ..Call::new(Kind::Scatter) };
        operation!(self, call, std::mem::size_of::<E>(), std::mem::size_of_val(output), valid, true, |ctx, scratch| {
            tree::scatter(&ctx, input, output, root as usize).await
        })
    }

    /// All-to-all: `input` and `output` hold `size` equal blocks; block `j` of rank `i`'s
    /// input becomes block `i` of rank `j`'s output.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn alltoall<E: Element>(&mut self, input: &[E], output: &mut [E]) -> Result<(), CommError> {
        let n = self.size as usize;
        let valid = check(input.len() == output.len(), || {
            format!("input has {} elements, output {}", input.len(), output.len())
        })
        .and_then(|_| {
            check(input.len() % n == 0, || format!("{} elements do not split into {n} equal blocks", input.len()))
        });
        let m = input.len() / n;
        let call = Call { dtype: Some(E::DTYPE), count: input.len() as u64, ..Call::new(Kind::Alltoall) };
        let counts = vec![m; n];
        operation!(self, call, std::mem::size_of::<E>(), std::mem::size_of_val(input), valid, true, |ctx, scratch| {
            alltoall::alltoallv(&ctx, input, &counts, output, &counts).await
        })
    }

    /// All-to-all with sizes: this rank sends `send_counts[j]` elements (consecutive in
    /// `input`, in rank order) to rank `j` and receives `recv_counts[i]` elements from rank `i`
    /// into `output` (consecutive, in rank order). Counts must agree pairwise across ranks
    /// (a disagreement is a length mismatch: [`CommError::InvalidArgument`]).
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn alltoallv<E: Element>(
        &mut self,
        input: &[E],
        send_counts: &[usize],
        output: &mut [E],
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let (n, rank) = (self.size as usize, self.rank as usize);
        let valid = check(send_counts.len() == n && recv_counts.len() == n, || {
            format!("{} send counts and {} receive counts for {n} ranks", send_counts.len(), recv_counts.len())
        })
        .and_then(|_| {
            check(send_counts.iter().sum::<usize>() == input.len(), || {
                format!("send counts do not sum to the input's {} elements", input.len())
            })
        })
        .and_then(|_| {
            check(recv_counts.iter().sum::<usize>() == output.len(), || {
                format!("receive counts do not sum to the output's {} elements", output.len())
            })
        })
        .and_then(|_| {
            check(send_counts[rank] == recv_counts[rank], || format!("send_counts[{rank}] != recv_counts[{rank}]"))
        });
        let call = Call { dtype: Some(E::DTYPE), ..Call::new(Kind::Alltoallv) };
        operation!(self, call, std::mem::size_of::<E>(), std::mem::size_of_val(input), valid, true, |ctx, scratch| {
            alltoall::alltoallv(&ctx, input, send_counts, output, recv_counts).await
        })
    }

    /// Barrier: returns once every rank has entered it (dissemination, `ceil(log2 n)` rounds).
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn barrier(&mut self) -> Result<(), CommError> {
        operation!(self, Call::new(Kind::Barrier), 1, 0, Ok(()), true, |ctx, scratch| barrier::barrier(&ctx).await)
    }

    /// Sends `data` to `peer`, which must post a matching [`Communicator::recv`] (same dtype
    /// and length) between the same two collectives: point-to-point messages are ordered per
    /// pair and do not consume a collective sequence number.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn send<E: Element>(&mut self, data: &[E], peer: u32) -> Result<(), CommError> {
        let valid = self.check_peer(peer);
        let call = Call { dtype: Some(E::DTYPE), count: data.len() as u64, ..Call::new(Kind::P2p) };
        let step0 = self.p2p_send.get(peer as usize).copied().unwrap_or(P2P_STEP_BASE);
        let res = operation!(
            self,
            call,
            std::mem::size_of::<E>(),
            std::mem::size_of_val(data),
            valid,
            false,
            |ctx, scratch| ctx.send_segs(peer as usize, step0, data).await
        );
        if res.is_ok() {
            let segs = data.len().div_ceil((self.config.segment_bytes / std::mem::size_of::<E>()).max(1)) as u64;
            self.p2p_send[peer as usize] = step0 + segs;
        }
        res
    }

    /// Receives into `data` (exactly `data.len()` elements) the matching
    /// [`Communicator::send`] from `peer`.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn recv<E: Element>(&mut self, data: &mut [E], peer: u32) -> Result<(), CommError> {
        let valid = self.check_peer(peer);
        let call = Call { dtype: Some(E::DTYPE), count: data.len() as u64, ..Call::new(Kind::P2p) };
        let step0 = self.p2p_recv.get(peer as usize).copied().unwrap_or(P2P_STEP_BASE);
        let len = data.len();
        let res = operation!(
            self,
            call,
            std::mem::size_of::<E>(),
            std::mem::size_of_val(data),
            valid,
            false,
            |ctx, scratch| ctx.recv_segs(peer as usize, step0, data).await
        );
        if res.is_ok() {
            let segs = len.div_ceil((self.config.segment_bytes / std::mem::size_of::<E>()).max(1)) as u64;
            self.p2p_recv[peer as usize] = step0 + segs;
        }
        res
    }

    fn check_peer(&self, peer: u32) -> Result<(), String> {
        check(peer < self.size && peer != self.rank, || {
            format!("peer {peer} is not another rank of {} (this is rank {})", self.size, self.rank)
        })
    }

    /// Allreduce over raw bytes holding elements of `dtype` (native byte order): the untyped
    /// entry for the CLI and benchmarks. A buffer that is not aligned for `dtype` is reduced
    /// through an aligned copy.
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn allreduce_bytes(&mut self, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<(), CommError> {
        match dtype {
            DType::F32 => self.allreduce_bytes_as::<f32>(data, op).await,
            DType::F64 => self.allreduce_bytes_as::<f64>(data, op).await,
            DType::F16 => self.allreduce_bytes_as::<f16>(data, op).await,
            DType::BF16 => self.allreduce_bytes_as::<bf16>(data, op).await,
            DType::I32 => self.allreduce_bytes_as::<i32>(data, op).await,
            DType::I64 => self.allreduce_bytes_as::<i64>(data, op).await,
            DType::U8 => self.allreduce_bytes_as::<u8>(data, op).await,
        }
    }

    async fn allreduce_bytes_as<E: Element>(&mut self, data: &mut [u8], op: ReduceOp) -> Result<(), CommError> {
        let size = std::mem::size_of::<E>();
        if data.len() % size != 0 {
            if let Some(e) = &self.poisoned {
                return Err(e.clone());
            }
            let msg = format!("allreduce_bytes: {} bytes are not a whole number of {} elements", data.len(), E::DTYPE);
            return Err(self.poison(CommError::InvalidArgument(msg)));
        }
        match from_bytes_mut::<E>(data) {
            Some(view) => self.allreduce(view, op).await,
            None => {
                let mut aligned = vec![E::default(); data.len() / size];
                as_bytes_mut(&mut aligned).copy_from_slice(data);
                self.allreduce(&mut aligned, op).await?;
                data.copy_from_slice(as_bytes(&aligned));
                Ok(())
            }
        }
    }

    /// Broadcast raw bytes from `root` (see [`Communicator::broadcast`]).
    ///
    /// # Cancel safety
    /// Not cancel safe; see [`Communicator::allreduce`].
    pub async fn broadcast_bytes(&mut self, data: &mut [u8], root: u32) -> Result<(), CommError> {
        self.broadcast(data, root).await
    }
}
