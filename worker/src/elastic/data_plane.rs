//! The seam between a worker's membership and its data plane: what a data plane publishes at
//! join, and how it connects a formed generation.
//!
//! [`super::ElasticGroup`] drives one: [`super::SocketPlane`] (TCP, shared memory, RDMA) in
//! production; the deterministic simulation plugs in its modelled ring. Everything else (the
//! rendezvous, the member view, revocation while connecting, the revoker, failure reports) is
//! the group's, the same in every world.

use super::members::Members;
use super::{ElasticError, MeshKind};
use crate::control::ControlClient;
use crate::RootCause;
use cohort_proto::v1 as pb;
use std::future::Future;
use std::sync::Arc;

/// A worker's data plane, as [`super::ElasticGroup`] drives it.
pub trait DataPlane: Send + 'static {
    /// What a connected generation's collectives run on.
    type Comm: Send + 'static;

    /// The addresses this worker publishes at each join, and its capabilities
    /// (`transport:<name>`).
    fn published(&self) -> (Vec<pb::TransportAddress>, Vec<String>);

    /// Connects this worker's links of a formed generation. `Ok(None)` when the links could
    /// not be made (a member died meanwhile) and the failure was reported: the caller re-forms.
    ///
    /// # Cancel safety
    /// Must be cancel safe: the group drops it when the generation is revoked meanwhile.
    fn connect<'a>(
        &'a mut self,
        formed: Formed<'a>,
    ) -> impl Future<Output = Result<Option<Connected<Self::Comm>>, ElasticError>> + Send + 'a;
}

/// A formed generation, as the data plane gets it to connect.
pub struct Formed<'a> {
    /// The coordinator's answer.
    pub generation: &'a pb::Generation,
    /// The members this worker knows (see [`Members`]).
    pub members: Members,
    /// This worker's rank in it.
    pub rank: u32,
    /// This worker's incarnation.
    pub incarnation: u64,
    /// The coordinator client (to fetch members, to report a failed set-up).
    pub client: &'a ControlClient,
    /// The generation's span (job, generation).
    pub span: &'a tracing::Span,
}

/// A connected generation, as the data plane hands it back.
pub struct Connected<C> {
    /// The communicator.
    pub comm: C,
    /// Revokes it (the membership's `Abort`: the generation was revoked, or a failure's root
    /// cause is known); every call on it then fails with the cause.
    pub revoke: Arc<dyn Fn(RootCause) + Send + Sync>,
    /// The members, as the plane completed them (fetched peers added).
    pub members: Members,
    /// The transport of this rank's links.
    pub transport: MeshKind,
}
