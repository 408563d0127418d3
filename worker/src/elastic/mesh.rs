//! [`MeshTransport`]: one generation's data plane, over whichever transport the generation
//! chose: TCP, shared memory (every member on one host), both at once (shared memory between
//! the members of each host, TCP between hosts), or RDMA with the cargo feature `rdma`; and
//! a subgroup of a generation's ranks over that generation's mesh ([`MeshTransport::subgroup`]).

use cohort_transports::shm::ShmTransport;
use cohort_transports::subgroup::Subgroup;
use cohort_transports::tcp::{CarriedLinks, TcpTransport};
use cohort_transports::{AbortReason, Rank, Tag, Transport, TransportError};
use std::sync::Arc;

#[cfg(feature = "rdma")]
use cohort_transports::rdma::RdmaTransport;

/// Which transport a generation's mesh runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MeshKind {
    /// TCP (every member always publishes a TCP address).
    Tcp,
    /// Shared memory: every member on one host.
    Shm,
    /// Shared memory between members on one host, TCP between hosts.
    ShmTcp,
    /// RDMA (chosen only when every member published an RDMA address).
    Rdma,
}

impl MeshKind {
    /// `tcp`, `shm`, `shm+tcp` or `rdma`: the names published in join requests (`tcp`, `shm`,
    /// `rdma`) and printed in event lines.
    pub fn name(self) -> &'static str {
        match self {
            MeshKind::Tcp => "tcp",
            MeshKind::Shm => "shm",
            MeshKind::ShmTcp => "shm+tcp",
            MeshKind::Rdma => "rdma",
        }
    }
}

impl std::fmt::Display for MeshKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl crate::Communicator<MeshTransport> {
    /// [`crate::Communicator::subgroup`] as a communicator over a [`MeshTransport`] (what the
    /// elastic runtime and the Python package hold), a subgroup of a subgroup made over the
    /// generation's mesh directly ([`MeshTransport::subgroup`]).
    pub fn mesh_subgroup(
        &self,
        members: &[u32],
        channel: u32,
    ) -> Result<crate::Communicator<MeshTransport>, crate::CommError> {
        let transport = MeshTransport::subgroup(self.transport(), members, channel)
            .map_err(|e| crate::CommError::InvalidArgument(e.to_string()))?;
        Ok(self.sub_communicator(transport, members))
    }
}

/// A generation whose members sit on several hosts: shared memory to the peers on this host,
/// TCP to the others. Each call goes to the transport that links the peer; abort aborts both.
pub struct MixedTransport {
    shm: ShmTransport,
    tcp: TcpTransport,
}

impl MixedTransport {
    /// Combines the two meshes of one generation (the same rank, world and generation).
    /// Calls go to the TCP mesh (which links on first use the peers it did not link at
    /// set-up) for peers the shared-memory mesh does not link.
    pub fn new(shm: ShmTransport, tcp: TcpTransport) -> Result<Self, TransportError> {
        if (shm.rank(), shm.world_size(), shm.generation()) != (tcp.rank(), tcp.world_size(), tcp.generation()) {
            return Err(TransportError::InvalidArgument(format!(
                "mixing meshes of different generations or ranks (shm: rank {} of {} in generation {}, tcp: rank {} of {} in generation {})",
                shm.rank(),
                shm.world_size(),
                shm.generation(),
                tcp.rank(),
                tcp.world_size(),
                tcp.generation()
            )));
        }
        Ok(Self { shm, tcp })
    }

    /// Whether `peer` is reached over shared memory.
    pub fn over_shm(&self, peer: Rank) -> bool {
        self.shm.links_to(peer)
    }
}

/// A connected mesh over one of the transports; it delegates every call to the inner one, so
/// it keeps the same [`Transport`] contract.
pub enum MeshTransport {
    /// The TCP mesh.
    Tcp(TcpTransport),
    /// The shared-memory mesh (every member on one host).
    Shm(ShmTransport),
    /// Shared memory within a host, TCP across hosts.
    Mixed(Box<MixedTransport>),
    /// The RDMA mesh (cargo feature `rdma`).
    #[cfg(feature = "rdma")]
    Rdma(RdmaTransport),
    /// Some ranks of a generation, over that generation's mesh ([`MeshTransport::subgroup`]).
    Subgroup(Subgroup<MeshTransport>),
}

impl MeshTransport {
    /// Which transport this mesh runs over (a subgroup: its generation's).
    pub fn kind(&self) -> MeshKind {
        match self {
            MeshTransport::Tcp(_) => MeshKind::Tcp,
            MeshTransport::Shm(_) => MeshKind::Shm,
            MeshTransport::Mixed(_) => MeshKind::ShmTcp,
            #[cfg(feature = "rdma")]
            MeshTransport::Rdma(_) => MeshKind::Rdma,
            MeshTransport::Subgroup(s) => s.parent().kind(),
        }
    }

    /// How many of this mesh's TCP links were carried over from the previous generation
    /// rather than dialled (incremental re-formation; 0 over other transports).
    pub fn carried_links(&self) -> usize {
        match self {
            MeshTransport::Tcp(t) => t.carried_links(),
            MeshTransport::Mixed(m) => m.tcp.carried_links(),
            _ => 0,
        }
    }

    /// Hands this mesh's TCP links on to the next generation's set-up (see
    /// [`TcpTransport::carry_over`]); `None` over other transports. Aborts the mesh first if
    /// it was not.
    pub fn carry_over(&self) -> Option<CarriedLinks> {
        match self {
            MeshTransport::Tcp(t) => Some(t.carry_over()),
            MeshTransport::Mixed(m) => {
                m.shm.abort(AbortReason::new("the generation's links are carried into the next"));
                Some(m.tcp.carry_over())
            }
            _ => None,
        }
    }

    /// The ranks `members` of `generation`'s mesh (a generation's rank per subgroup rank) as a
    /// mesh of their own on `channel`, sharing the generation's links, failures and abort
    /// ([`Subgroup`]). A subgroup of a subgroup is made over the generation's mesh directly
    /// (its members named by their ranks in the outer subgroup), so channels stay one level.
    pub fn subgroup(generation: &Arc<MeshTransport>, members: &[Rank], channel: u32) -> Result<Self, TransportError> {
        let (parent, members) = match &**generation {
            MeshTransport::Subgroup(outer) => {
                let global = members
                    .iter()
                    .map(|&m| {
                        outer.members().get(m as usize).copied().ok_or_else(|| {
                            TransportError::InvalidArgument(format!(
                                "subgroup member {m} is not a rank of the outer subgroup (0..{})",
                                outer.members().len()
                            ))
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                (outer.parent().clone(), global)
            }
            _ => (generation.clone(), members.to_vec()),
        };
        Ok(MeshTransport::Subgroup(Subgroup::new(parent, members, channel)?))
    }
}

impl std::fmt::Debug for MeshTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshTransport")
            .field("kind", &self.kind())
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("generation", &self.generation())
            .finish()
    }
}

impl From<TcpTransport> for MeshTransport {
    fn from(t: TcpTransport) -> Self {
        MeshTransport::Tcp(t)
    }
}

impl From<ShmTransport> for MeshTransport {
    fn from(t: ShmTransport) -> Self {
        MeshTransport::Shm(t)
    }
}

impl From<MixedTransport> for MeshTransport {
    fn from(t: MixedTransport) -> Self {
        MeshTransport::Mixed(Box::new(t))
    }
}

#[cfg(feature = "rdma")]
impl From<RdmaTransport> for MeshTransport {
    fn from(t: RdmaTransport) -> Self {
        MeshTransport::Rdma(t)
    }
}

/// Calls `$call` on the transport behind `$mesh` that reaches `$peer` (a subgroup's
/// operations name their own arm, `$s => $sub`, where they must be boxed).
macro_rules! dispatch {
    ($mesh:expr, $peer:expr, $t:ident => $call:expr) => {
        dispatch!($mesh, $peer, $t => $call, $t => $call)
    };
    ($mesh:expr, $peer:expr, $t:ident => $call:expr, $s:ident => $sub:expr) => {
        match $mesh {
            MeshTransport::Tcp($t) => $call,
            MeshTransport::Shm($t) => $call,
            MeshTransport::Mixed(m) if m.over_shm($peer) => {
                let $t = &m.shm;
                $call
            }
            MeshTransport::Mixed(m) => {
                let $t = &m.tcp;
                $call
            }
            #[cfg(feature = "rdma")]
            MeshTransport::Rdma($t) => $call,
            MeshTransport::Subgroup($s) => $sub,
        }
    };
}

/// A subgroup's operations behind a pointer, in functions of their own: a subgroup's future
/// holds its generation's mesh's future, a [`MeshTransport`] one, which would otherwise hold
/// itself (and the compiler could not tell whether it is `Send`).
type Boxed<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), TransportError>> + Send + 'a>>;

fn subgroup_send<'a>(s: &'a Subgroup<MeshTransport>, peer: Rank, tag: Tag, data: &'a [u8]) -> Boxed<'a> {
    Box::pin(s.send(peer, tag, data))
}

fn subgroup_recv<'a>(s: &'a Subgroup<MeshTransport>, peer: Rank, tag: Tag, buf: &'a mut [u8]) -> Boxed<'a> {
    Box::pin(s.recv(peer, tag, buf))
}

fn subgroup_recv_with<'a, F>(
    s: &'a Subgroup<MeshTransport>,
    peer: Rank,
    tag: Tag,
    scratch: &'a mut [u8],
    consume: F,
) -> Boxed<'a>
where
    F: FnMut(&[u8]) + Send + 'a,
{
    Box::pin(s.recv_with(peer, tag, scratch, consume))
}

impl Transport for MeshTransport {
    fn rank(&self) -> Rank {
        dispatch!(self, Rank::MAX, t => t.rank())
    }

    fn world_size(&self) -> u32 {
        dispatch!(self, Rank::MAX, t => t.world_size())
    }

    fn generation(&self) -> u64 {
        dispatch!(self, Rank::MAX, t => t.generation())
    }

    /// Sends through the inner transport that reaches `peer`.
    ///
    /// # Cancel safety
    /// Not cancel safe, like the inner transports: dropping the future part-way through a
    /// message breaks that link. Use [`Transport::abort`] to stop work on purpose.
    async fn send(&self, peer: Rank, tag: Tag, data: &[u8]) -> Result<(), TransportError> {
        dispatch!(self, peer, t => t.send(peer, tag, data).await, s => subgroup_send(s, peer, tag, data).await)
    }

    /// Receives through the inner transport that reaches `peer`.
    ///
    /// # Cancel safety
    /// Not cancel safe, like the inner transports: dropping the future after part of the
    /// message arrived breaks that link. Use [`Transport::abort`] to stop work on purpose.
    async fn recv(&self, peer: Rank, tag: Tag, buf: &mut [u8]) -> Result<(), TransportError> {
        dispatch!(self, peer, t => t.recv(peer, tag, buf).await, s => subgroup_recv(s, peer, tag, buf).await)
    }

    /// Receives through the inner transport that reaches `peer`, so that a peer over shared
    /// memory is consumed straight from its ring.
    ///
    /// # Cancel safety
    /// Not cancel safe, as [`MeshTransport::recv`].
    async fn recv_with<F>(&self, peer: Rank, tag: Tag, scratch: &mut [u8], consume: F) -> Result<(), TransportError>
    where
        F: FnMut(&[u8]) + Send,
    {
        dispatch!(self, peer, t => t.recv_with(peer, tag, scratch, consume).await, s => subgroup_recv_with(s, peer, tag, scratch, consume).await)
    }

    fn abort(&self, reason: AbortReason) {
        match self {
            MeshTransport::Mixed(m) => {
                m.shm.abort(reason.clone());
                m.tcp.abort(reason);
            }
            other => dispatch!(other, Rank::MAX, t => t.abort(reason)),
        }
    }

    fn is_aborted(&self) -> bool {
        match self {
            MeshTransport::Mixed(m) => m.shm.is_aborted() || m.tcp.is_aborted(),
            other => dispatch!(other, Rank::MAX, t => t.is_aborted()),
        }
    }

    /// A mixed mesh pipelines as TCP does, on every rank: each rank of a generation that
    /// spans hosts holds a mixed mesh, so all of them cut alike.
    fn pipeline_segment(&self) -> Option<usize> {
        match self {
            MeshTransport::Mixed(m) => m.tcp.pipeline_segment(),
            other => dispatch!(other, Rank::MAX, t => t.pipeline_segment()),
        }
    }

    fn deadlines_in_force(&self) -> Vec<(Rank, cohort_transports::DeadlineInForce)> {
        match self {
            MeshTransport::Mixed(m) => {
                let mut all: Vec<_> = m.shm.deadlines_in_force().into_iter().filter(|(p, _)| m.over_shm(*p)).collect();
                all.extend(m.tcp.deadlines_in_force().into_iter().filter(|(p, _)| !m.over_shm(*p)));
                all.sort_by_key(|(p, _)| *p);
                all
            }
            other => dispatch!(other, Rank::MAX, t => t.deadlines_in_force()),
        }
    }

    fn linked_peers(&self) -> usize {
        match self {
            MeshTransport::Mixed(m) => m.shm.linked_peers() + m.tcp.linked_peers(),
            other => dispatch!(other, Rank::MAX, t => t.linked_peers()),
        }
    }
}
