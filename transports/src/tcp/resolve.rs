//! Addresses a mesh's set-up was not given: the marker for them and where they come from.

use crate::{Rank, TransportError};
use std::net::SocketAddr;

/// The entry of [`super::MeshSpec::peers`] for a peer whose address the set-up was not given
/// (`0.0.0.0:0`): it is asked of [`super::MeshSpec::resolver`] when a link is first made to it.
pub const UNKNOWN_PEER: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(std::net::Ipv4Addr::UNSPECIFIED, 0));

/// Where the address of a peer the set-up was not given comes from (the elastic runtime asks
/// the coordinator). Called at most once per peer and mesh, when a link is first made to it.
pub trait ResolvePeer: Send + Sync + std::fmt::Debug {
    /// The data-plane address of `peer`. An error fails the operation that needed the link.
    ///
    /// # Cancel safety
    /// Must be cancel safe: the operation that needed the link may be dropped or aborted.
    fn resolve(
        &self,
        peer: Rank,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<SocketAddr, TransportError>> + Send + '_>>;
}
