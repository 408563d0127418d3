//! Connecting one generation's mesh from its members' records: the plan
//! ([`super::choice`]: RDMA when everybody has it, shared memory within a host, TCP between
//! hosts) and each planned transport's set-up. The elastic runtime connects every generation
//! this way; a program that knows its world without a coordinator (`cohort-worker bench`, a
//! static launcher) calls [`connect_members`] with the records it built itself and gets the
//! same data plane.

use super::mesh::MixedTransport;
use super::mesh_plan::{plan_mesh, MeshPlan};
use super::{ElasticError, MemberInfo, MeshTransport, TransportChoice};
use cohort_proto::ids::JobId;
use cohort_transports::shm::{ShmAddress, ShmEndpoint, ShmMeshSpec};
use cohort_transports::tcp::{CarriedLink, MeshSpec, ResolvePeer, TcpEndpoint};
use cohort_transports::{Deadlines, TransportError};
use std::sync::Arc;

/// Whose mesh this is: every link's handshake checks the job, the generation and a proof of
/// the job token, and every wait on it is bounded by the deadlines.
#[derive(Clone, Debug)]
pub struct MeshScope {
    /// The job id (the handshakes carry it).
    pub job: JobId,
    /// The generation the mesh is for.
    pub generation: u64,
    /// The job token (each side proves it with HMAC; never sent).
    pub token: Vec<u8>,
    /// Connect and no-progress deadlines.
    pub deadlines: Deadlines,
}

/// What a generation's TCP links do across generations (incremental re-formation, see
/// `cohort_transports::tcp::CarriedLinks`).
#[derive(Debug, Default)]
pub(crate) struct Carry {
    /// Links of the previous generation to re-bind, by the peer's rank in this one.
    pub(crate) links: Vec<(u32, CarriedLink)>,
    /// Whether this generation's links may be carried into the next: an abort leaves them
    /// open for that.
    pub(crate) onward: bool,
}

/// This rank's data-plane endpoints: TCP always, shared memory and RDMA when it published
/// addresses for them.
#[derive(Clone, Copy, Debug)]
pub struct LocalEndpoints<'a> {
    tcp: &'a TcpEndpoint,
    shm: Option<&'a ShmEndpoint>,
    #[cfg(feature = "rdma")]
    rdma: Option<&'a cohort_transports::rdma::RdmaEndpoint>,
}

impl<'a> LocalEndpoints<'a> {
    /// The TCP endpoint alone.
    pub fn new(tcp: &'a TcpEndpoint) -> Self {
        Self {
            tcp,
            shm: None,
            #[cfg(feature = "rdma")]
            rdma: None,
        }
    }

    /// And a shared-memory endpoint (its address is the member record's `shm`).
    pub fn with_shm(self, shm: Option<&'a ShmEndpoint>) -> Self {
        Self { shm, ..self }
    }

    /// And an RDMA endpoint (its address is the member record's `rdma`).
    #[cfg(feature = "rdma")]
    pub fn with_rdma(self, rdma: Option<&'a cohort_transports::rdma::RdmaEndpoint>) -> Self {
        Self { rdma, ..self }
    }

    /// Whether an RDMA endpoint is present.
    pub(crate) fn has_rdma(&self) -> bool {
        #[cfg(feature = "rdma")]
        if self.rdma.is_some() {
            return true;
        }
        false
    }
}

/// Plans the mesh that `members` (every member of the generation, indexed by rank) call for
/// and connects this rank's part of it. Fails with [`ElasticError::Protocol`] when the
/// records cannot be planned (an RDMA address that does not decode, RDMA everywhere but no
/// local endpoint) and with [`ElasticError::DataPlane`] when the set-up fails (a peer that
/// disagrees about the job, generation or token, or misses the connect deadline).
///
/// # Cancel safety
/// Cancel safe, like every transport's mesh set-up: dropping the future closes whatever it
/// had connected, and peers see their set-up fail.
pub async fn connect_members(
    scope: &MeshScope,
    members: &[MemberInfo],
    rank: u32,
    local: LocalEndpoints<'_>,
) -> Result<MeshTransport, ElasticError> {
    // The endpoints given are what this rank published: RDMA with an RDMA endpoint, else
    // whatever the records plan.
    let choice = if local.has_rdma() { TransportChoice::Rdma } else { TransportChoice::Auto };
    let plan = plan_mesh(scope.generation, members, rank, choice)?;
    Ok(connect_planned(scope, rank, plan, local, Carry::default(), None).await?)
}

/// Connects this rank's part of a planned mesh, re-binding the TCP links `carry` brings
/// (shut down if the plan is not over TCP); `resolver` finds the TCP addresses the plan
/// leaves unknown (a sparse generation view).
///
/// # Cancel safety
/// Cancel safe, as [`connect_members`].
pub(crate) async fn connect_planned(
    scope: &MeshScope,
    rank: u32,
    plan: MeshPlan,
    local: LocalEndpoints<'_>,
    carry: Carry,
    resolver: Option<Arc<dyn ResolvePeer>>,
) -> Result<MeshTransport, TransportError> {
    let Carry { links: carried, onward } = carry;
    let tcp_spec = |peers, upfront| MeshSpec {
        resolver: resolver.clone(),
        job: scope.job.to_string(),
        generation: scope.generation,
        rank,
        peers,
        token: scope.token.clone(),
        deadlines: scope.deadlines,
        upfront,
        carry_links: onward,
    };
    let shm_spec = |peers: Vec<Option<ShmAddress>>| ShmMeshSpec {
        job: scope.job.to_string(),
        generation: scope.generation,
        rank,
        peers,
        token: scope.token.clone(),
        deadlines: scope.deadlines,
    };
    // plan_mesh plans shared memory only for members that published a shm address, this rank
    // included.
    let shm = || {
        local.shm.ok_or_else(|| {
            TransportError::InvalidArgument("a shared-memory mesh was planned without a shm endpoint".into())
        })
    };
    match plan {
        MeshPlan::Tcp { peers, upfront, .. } => {
            local.tcp.connect_mesh_carrying(tcp_spec(peers, upfront), carried).await.map(MeshTransport::Tcp)
        }
        MeshPlan::Shm { peers } => {
            shm()?.connect_mesh(shm_spec(peers.into_iter().map(Some).collect())).await.map(MeshTransport::Shm)
        }
        MeshPlan::Mixed { tcp, upfront, shm: shm_peers } => {
            let (s, t) = tokio::try_join!(
                shm()?.connect_mesh(shm_spec(shm_peers)),
                local.tcp.connect_mesh_carrying(tcp_spec(tcp, upfront), carried)
            )?;
            MixedTransport::new(s, t).map(MeshTransport::from)
        }
        #[cfg(feature = "rdma")]
        MeshPlan::Rdma { peers } => {
            let Some(endpoint) = local.rdma else {
                // plan_mesh chooses rdma only when this rank has an endpoint.
                return Err(TransportError::InvalidArgument(
                    "an rdma mesh was planned without an rdma endpoint".into(),
                ));
            };
            let spec = cohort_transports::rdma::RdmaMeshSpec {
                job: scope.job.to_string(),
                generation: scope.generation,
                rank,
                peers,
                token: scope.token.clone(),
                deadlines: scope.deadlines,
            };
            endpoint.connect_mesh(spec).await.map(MeshTransport::Rdma)
        }
    }
}
