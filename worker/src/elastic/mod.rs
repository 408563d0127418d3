//! The elastic runtime: join a job, get a communicator per generation, survive failures.
//!
//! ```text
//!   ElasticGroup::join ──► next_generation() ──► Generation { comm, members }
//!          ▲                                          │ collectives, commit()
//!          │                        error ◄───────────┤
//!          └── on_failure(err) → root cause ──────────┘  (restore last commit, re-form)
//! ```
//!
//! - [`ElasticGroup`] owns the worker's membership: its coordinator client, the heartbeat
//!   task that keeps its lease, the watch task that hears revocations, and the data-plane
//!   listener it keeps across generations. It is a thin shell: every membership decision
//!   (current incarnation, revoked generations, stale answers, exclusion waits, pending
//!   re-formation, reopening the event stream) is made by a pure state machine
//!   (`membership.rs`) that it feeds with the coordinator's answers and whose effects it
//!   performs.
//! - [`ElasticGroup::next_generation`] is re-formation in one call: it waits at the
//!   coordinator's rendezvous for the next generation, connects the data-plane mesh for it
//!   (handshake with the job token) and returns its [`Generation`]. The mesh is RDMA when
//!   every member published an RDMA address at join ([`TransportChoice::Rdma`], cargo
//!   feature `rdma`); otherwise members of one host run (one host name and the same host
//!   identity in their shared-memory address, [`TransportChoice::Auto`] and
//!   [`TransportChoice::Shm`]) link over shared memory and the others over TCP; [`MeshTransport`] carries any of these,
//!   [`MixedTransport`] the mix.
//! - When a collective fails, [`ElasticGroup::on_failure`] reports it (first report wins) and
//!   answers the generation's root cause, so every rank's error names the rank that failed
//!   first, never a secondary "connection reset".
//! - When the watch hears that the current generation is revoked, the in-flight collective is
//!   aborted at once through the communicator's [`crate::Revoker`].
//! - [`Checkpoint`] is the commit/restore/sync API: commit at step boundaries, restore after a
//!   failure, and after re-formation broadcast the newest commit from the member holding it,
//!   then check the state digest on every rank.
//! - [`JobId`] and [`WorkerId`] are ids checked once, when they are made, by cohort's one rule
//!   ([`IdError`] names a bad one): [`ElasticConfig`] and everything inside hold them, and the
//!   coordinator's requests get their strings.
//! - [`StepTimes`] gathers the step timing sent with the heartbeats, from which the
//!   coordinator names stragglers; under the job's `exclude` policy it asks one to leave,
//!   which [`ElasticGroup::straggler_leave`] tells the training loop.

mod carry_plan;
mod config;
mod connect;
mod data_plane;
mod deadlines;
mod error;
mod group;
mod members;
mod mesh_plan;
// The membership state machine: public under the `test-support` feature for the
// deterministic simulation (`cohort-sim`), which drives it as `ElasticGroup` does; not part of
// the stable API (its own documentation is the module's).
#[cfg(feature = "test-support")]
pub mod membership;
#[cfg(not(feature = "test-support"))]
#[allow(dead_code, unreachable_pub)]
mod membership;
mod mesh;
mod resolve;
mod shell;
mod sockets;
mod state;
mod timing;
mod view_plan;

#[cfg(feature = "test-support")]
pub use carry_plan::planted as carry_planted;
pub use carry_plan::PreviousView;
pub use cohort_proto::ids::{IdError, JobId, WorkerId};
pub use config::{local_hostname, ElasticConfig};
pub use connect::{connect_members, LocalEndpoints, MeshScope};
pub use data_plane::{Connected, DataPlane, Formed};
pub use deadlines::{deadline_brief, deadline_summary};
pub use error::{ElasticError, TransportUnavailable};
pub use group::{ElasticGroup, Generation, ReformReason};
pub use members::Members;
pub use mesh::{MeshKind, MeshTransport, MixedTransport};
pub use mesh_plan::{MemberInfo, TransportChoice, UnknownTransport, FULL_MESH_UP_TO};
pub use shell::{call_bound, FailureReporter, Observed, RealWorld, World};
pub use sockets::SocketPlane;
pub use state::{Checkpoint, CommitError, ElasticState, SyncError, SyncOutcome};
pub use timing::StepTimes;
