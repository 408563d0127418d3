//! [`MeshTransport`]: one generation's data plane, over whichever transport the generation
//! chose (TCP, or RDMA with the cargo feature `rdma`).

use cohort_transports::tcp::TcpTransport;
use cohort_transports::{AbortReason, Rank, Tag, Transport, TransportError};

#[cfg(feature = "rdma")]
use cohort_transports::rdma::RdmaTransport;

/// Which transport a generation's mesh runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MeshKind {
    /// TCP (every member always publishes a TCP address).
    Tcp,
    /// RDMA (chosen only when every member published an RDMA address).
    Rdma,
}

impl MeshKind {
    /// `tcp` or `rdma`, as published in join requests and printed in event lines.
    pub fn name(self) -> &'static str {
        match self {
            MeshKind::Tcp => "tcp",
            MeshKind::Rdma => "rdma",
        }
    }
}

impl std::fmt::Display for MeshKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A connected mesh over one of the transports; it delegates every call to the inner one, so
/// it keeps the same [`Transport`] contract.
pub enum MeshTransport {
    /// The TCP mesh.
    Tcp(TcpTransport),
    /// The RDMA mesh (cargo feature `rdma`).
    #[cfg(feature = "rdma")]
    Rdma(RdmaTransport),
}

impl MeshTransport {
    /// Which transport this mesh runs over.
    pub fn kind(&self) -> MeshKind {
        match self {
            MeshTransport::Tcp(_) => MeshKind::Tcp,
            #[cfg(feature = "rdma")]
            MeshTransport::Rdma(_) => MeshKind::Rdma,
        }
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

#[cfg(feature = "rdma")]
impl From<RdmaTransport> for MeshTransport {
    fn from(t: RdmaTransport) -> Self {
        MeshTransport::Rdma(t)
    }
}

impl Transport for MeshTransport {
    fn rank(&self) -> Rank {
        match self {
            MeshTransport::Tcp(t) => t.rank(),
            #[cfg(feature = "rdma")]
            MeshTransport::Rdma(t) => t.rank(),
        }
    }

    fn world_size(&self) -> u32 {
        match self {
            MeshTransport::Tcp(t) => t.world_size(),
            #[cfg(feature = "rdma")]
            MeshTransport::Rdma(t) => t.world_size(),
        }
    }

    fn generation(&self) -> u64 {
        match self {
            MeshTransport::Tcp(t) => t.generation(),
            #[cfg(feature = "rdma")]
            MeshTransport::Rdma(t) => t.generation(),
        }
    }

    /// Sends through the inner transport.
    ///
    /// # Cancel safety
    /// Not cancel safe, like the inner transports: dropping the future part-way through a
    /// message breaks that link. Use [`Transport::abort`] to stop work on purpose.
    async fn send(&self, peer: Rank, tag: Tag, data: &[u8]) -> Result<(), TransportError> {
        match self {
            MeshTransport::Tcp(t) => t.send(peer, tag, data).await,
            #[cfg(feature = "rdma")]
            MeshTransport::Rdma(t) => t.send(peer, tag, data).await,
        }
    }

    /// Receives through the inner transport.
    ///
    /// # Cancel safety
    /// Not cancel safe, like the inner transports: dropping the future after part of the
    /// message arrived breaks that link. Use [`Transport::abort`] to stop work on purpose.
    async fn recv(&self, peer: Rank, tag: Tag, buf: &mut [u8]) -> Result<(), TransportError> {
        match self {
            MeshTransport::Tcp(t) => t.recv(peer, tag, buf).await,
            #[cfg(feature = "rdma")]
            MeshTransport::Rdma(t) => t.recv(peer, tag, buf).await,
        }
    }

    fn abort(&self, reason: AbortReason) {
        match self {
            MeshTransport::Tcp(t) => t.abort(reason),
            #[cfg(feature = "rdma")]
            MeshTransport::Rdma(t) => t.abort(reason),
        }
    }

    fn is_aborted(&self) -> bool {
        match self {
            MeshTransport::Tcp(t) => t.is_aborted(),
            #[cfg(feature = "rdma")]
            MeshTransport::Rdma(t) => t.is_aborted(),
        }
    }
}
