//! cohort-transports: the data plane's byte movers.
//!
//! A [`Transport`] connects the members of one generation of a job and moves tagged byte
//! ranges between ranks, with deadlines and local abort. Collectives (in the `cohort` crate)
//! are written against this trait only, so they run unchanged over TCP ([`tcp`]), shared
//! memory between ranks on one host ([`shm`]), RDMA (`rdma`, cargo feature `rdma`) or the
//! in-memory simulated network that tests use (`cohort_testkit::sim`, in tests/kit).
//!
//! # Contract every implementation keeps
//! - Messages are matched by `(peer, tag.seq, tag.step)`. Between one pair of ranks, messages
//!   with the same tag are never in flight twice.
//! - `recv` fills exactly `buf.len()` bytes; a message of another length, or with another
//!   `signature`, fails with [`TransportError::Mismatch`] (the ranks disagree about the call).
//! - A frame from another generation, with a bad magic/version/kind, an oversize length, or a
//!   stale tag (a `seq` older than the oldest one still expected on that link) closes that link
//!   with [`TransportError::Protocol`]. Nothing from the wire can panic or allocate unboundedly.
//! - Every wait is bounded by the no-progress deadline of [`Deadlines`]: if a link moves no
//!   bytes for that long while an operation waits on it, the operation fails with
//!   [`TransportError::Timeout`].
//! - [`Transport::abort`] is local and immediate: every in-flight and future operation returns
//!   [`TransportError::Aborted`] at once; it never waits on a peer.

mod abort;
pub mod activity;
pub mod deadline;
pub mod error;
pub mod handshake;
mod links;
pub mod liveness;
mod mesh_setup;
mod op_lock;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod shm;
mod spin;
pub mod subgroup;
pub mod tcp;
pub mod wire;

pub use deadline::{DeadlineBasis, DeadlineInForce, Deadlines, Learning};
pub use error::{AbortReason, Signatures, Silence, TransportError};
pub use wire::{Rank, Tag};

use std::future::Future;

/// Moves tagged byte ranges between the ranks of one generation.
///
/// Implementations are cheap to share (`&self` methods, internally synchronised): a collective
/// runs a send to one peer and a receive from another concurrently.
pub trait Transport: Send + Sync + 'static {
    /// This process's rank in the generation.
    fn rank(&self) -> Rank;

    /// Number of ranks in the generation.
    fn world_size(&self) -> u32;

    /// The generation this transport was built for.
    fn generation(&self) -> u64;

    /// Sends `data` to `peer` under `tag`, straight from the caller's buffer.
    ///
    /// Returns once the bytes are handed to the network (not when the peer has them).
    ///
    /// # Cancel safety
    /// Not cancel safe: dropping the future part-way through a message leaves the link
    /// mid-frame, so the transport marks that link broken and later operations on it fail.
    /// Use [`Transport::abort`] to stop work on purpose.
    fn send(&self, peer: Rank, tag: Tag, data: &[u8]) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Receives the message `tag` from `peer` into `buf`, which it fills exactly.
    ///
    /// # Cancel safety
    /// Not cancel safe, for the same reason as [`Transport::send`].
    fn recv(&self, peer: Rank, tag: Tag, buf: &mut [u8]) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Receives the message `tag` from `peer` (exactly `scratch.len()` bytes) and hands its
    /// bytes to `consume`, in order, as one or more consecutive pieces that together are the
    /// whole message. This is how a schedule reduces as it receives.
    ///
    /// A transport that holds arriving bytes in memory it can lend (shared memory: the slots
    /// of the peer's ring) passes those and never touches `scratch`, saving the copy into it;
    /// the default receives into `scratch` and passes it whole. Errors are those of
    /// [`Transport::recv`]; `consume` has seen only a prefix of the message when one occurs.
    ///
    /// # Cancel safety
    /// Not cancel safe, for the same reason as [`Transport::send`].
    fn recv_with<F>(
        &self,
        peer: Rank,
        tag: Tag,
        scratch: &mut [u8],
        mut consume: F,
    ) -> impl Future<Output = Result<(), TransportError>> + Send
    where
        F: FnMut(&[u8]) + Send,
    {
        async move {
            self.recv(peer, tag, scratch).await?;
            consume(scratch);
            Ok(())
        }
    }

    /// Aborts every in-flight and future operation at once with
    /// [`TransportError::Aborted`]; closes the links. Local, idempotent, never blocks.
    fn abort(&self, reason: AbortReason);

    /// Whether [`Transport::abort`] has been called (or a link broke for good).
    fn is_aborted(&self) -> bool;

    /// The smallest segment this transport wants a large message cut into so that its
    /// sends and receives overlap, or `None` when a schedule's configured segment always
    /// serves (the default: shared memory pipelines through its ring's slots itself).
    /// Schedules cut a message's blocks finer, down to this, when the configured segment
    /// would leave a block only a few of them (`cohort::CommConfig::segment_bytes`). Every
    /// rank of a generation must give the same answer.
    fn pipeline_segment(&self) -> Option<usize> {
        None
    }

    /// The no-progress deadline in force on the link to each peer, and why (see
    /// [`deadline`]); empty for transports that apply [`Deadlines::no_progress`] as it is.
    fn deadlines_in_force(&self) -> Vec<(Rank, DeadlineInForce)> {
        Vec::new()
    }

    /// How many peers this rank holds a link to now. A full mesh links every other rank (the
    /// default answer); a mesh set up with only the links its schedules use
    /// ([`tcp::Upfront::Only`]) holds fewer, plus those made on first use since.
    fn linked_peers(&self) -> usize {
        self.world_size().saturating_sub(1) as usize
    }
}
