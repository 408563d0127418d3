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
//! [`crate::TransportError::PeerClosed`], local errors [`crate::TransportError::Io`]); a bad header,
//! another generation, an oversize message, a stale tag or a credit violation is
//! [`crate::TransportError::Protocol`]; a length or signature disagreement is
//! [`crate::TransportError::Mismatch`] and closes the link; no completion on a link for
//! [`crate::Deadlines::no_progress`] while an operation waits is [`crate::TransportError::Timeout`],
//! unless the peer is *late*: with learning on ([`crate::Deadlines::learning`]) the waiting
//! side then asks the peer's process where it is (a status probe to the UDP port of its
//! bootstrap listener, where its [`RdmaEndpoint`] answers from the mesh's activity board,
//! [`crate::activity`]), fails at once if it is silent, stopped or gone, at the ceiling if it
//! is inside the operation, and waits for a late one (not in the operation yet, between two
//! calls of it, or behind a late rank) up to [`crate::Learning::late_rank`], failing past
//! it with [`crate::Silence::Late`] (see `late`). Every send and receive enters this rank's
//! board with its tag's `seq`, so peers see where it is; the board closes on abort.
//! [`crate::Transport::abort`] is local and immediate: it moves every QP to the error state
//! (flushing outstanding work requests, never waiting on a peer) and wakes every waiter with
//! [`crate::TransportError::Aborted`].
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

mod endpoint;
mod late;
mod peer;
mod progress;
mod transport;

pub use address::{EndpointAddress, Mtu, RdmaAddress, RecvRegion};
pub use device::{device_names, DeviceConfig};
pub use endpoint::{RdmaEndpoint, RdmaMeshSpec, RdmaOptions};
pub use qp::QpTiming;
pub use transport::RdmaTransport;
