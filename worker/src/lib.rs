//! cohort: elastic, fault-tolerant collectives for data-parallel training.
//!
//! The [`Communicator`] runs collectives (allreduce with ring, BCube, recursive-doubling and hierarchical
//! schedules, reduce-scatter, allgather(v), broadcast, reduce, gather, scatter, alltoall(v),
//! barrier, send/recv) over any [`cohort_transports::Transport`], for the element types of
//! [`DType`] and the operators of [`ReduceOp`]. Results are bit-exact across ranks. Every
//! operation either completes or fails with a typed [`CommError`] on every live rank; a
//! [`Revoker`] aborts in-flight operations at once with the generation's [`RootCause`].
//!
//! # The `test-support` feature
//!
//! It makes `elastic::membership`, the worker's membership state machine (no I/O, time passed
//! in), public, so that the deterministic simulation (`cohort-sim`) drives the same machine
//! as [`elastic::ElasticGroup`], and adds `control::relay_planted` and `elastic::carry_planted`,
//! bugs the simulation's tests plant in the heartbeat relay and in the decision which links
//! are carried into the next generation, to show that its seeds catch them. It is not part of the
//! stable API: anything under it may
//! change in any release, and nothing outside this workspace should enable it.

pub mod algo;
mod blocks;
pub mod collectives;
pub mod comm;
pub mod control;
pub mod dtype;
pub mod elastic;
pub mod error;
mod kernels;
pub mod metrics;
pub mod reduce;
pub mod topology;

pub use algo::Algorithm;
pub use blocks::counts_for;
pub use collectives::links::upfront_links;
pub use comm::{CommConfig, Communicator, Revoker};
pub use dtype::{as_bytes, as_bytes_mut, DType, Element};
pub use error::{CommError, OpProgress, RootCause};
pub use reduce::ReduceOp;
pub use topology::HostLayout;
