//! Control-plane client: how a worker talks to the cohort coordinator.
//!
//! [`ControlClient`] wraps the generated gRPC client with what a worker on a flaky cluster
//! needs: a list of coordinator endpoints (any replica serves any RPC), a per-request
//! deadline, the job token in the `authorization` metadata, optional TLS, and retries with
//! exponential backoff and jitter (the `backoff` crate) that move to the next endpoint when
//! one is unreachable. Application errors (bad request, unknown member, excluded worker) are
//! returned at once, never retried. Before any coordinator has answered, a wrong address (a
//! refused connection, a name that does not resolve, an unanswered connect, a peer that is
//! not a coordinator) is warned about at once and fails within a few seconds (`unreached.rs`
//! tells the causes apart).

//!
//! [`HostRelay`] carries the heartbeats of a host's workers to the coordinator in shared
//! calls, two per interval (`relay.rs`); [`EventRelay`] hands them the job's events from one
//! watch stream per host (`event_relay.rs`); both bind and connect their sockets through a
//! [`RelayNet`] (`relay_net.rs`: production's abstract Unix sockets, or a simulation's). [`JobStore`] is the job's key-value store on
//! the coordinator (torch's c10d store, `store.rs`).

mod client;
mod error;
mod event_relay;
mod relay;
mod relay_net;
mod store;
mod unreached;

pub use client::{ControlClient, ControlConfig};
pub use error::ControlError;
pub use event_relay::{
    EventRelay, RelayEvents, FULL_AFTER_FAILURE, KEEPALIVE_EVERY, MAX_SUBSCRIBERS, QUEUED_EVENTS, RESUBSCRIBE_WINDOW,
    SILENCE_LIMIT,
};
#[cfg(feature = "test-support")]
pub use relay::planted as relay_planted;
pub use relay::{
    relay_answer_budget, HostRelay, DIRECT_AFTER_FAILURE, FLUSHES_PER_INTERVAL, MIN_LEASE_INTERVALS, RELAY_PROTOCOL,
};
pub use relay_net::{AbstractUnix, RelayConnection, RelayListener, RelayNet, RelayStream, SocketDir};
pub use store::{JobStore, STORE_POLL_WAIT};
