//! Addresses of peers a sparse generation view leaves out, asked of the coordinator when a
//! link to one is first made (the TCP mesh's [`ResolvePeer`]).

use crate::control::ControlClient;
use cohort_proto::v1 as pb;
use cohort_transports::tcp::ResolvePeer;
use cohort_transports::{Rank, TransportError};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;

/// Asks `Members` for one rank of one generation, checked against the generation's digest.
#[derive(Clone)]
pub(crate) struct CoordinatorResolver {
    pub(crate) client: ControlClient,
    /// Who asks, and about which generation (`members_digest` included).
    pub(crate) question: pb::MembersRequest,
    pub(crate) digest: u64,
}

impl std::fmt::Debug for CoordinatorResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoordinatorResolver")
            .field("job", &self.question.job)
            .field("generation", &self.question.generation)
            .finish()
    }
}

impl ResolvePeer for CoordinatorResolver {
    fn resolve(&self, peer: Rank) -> Pin<Box<dyn Future<Output = Result<SocketAddr, TransportError>> + Send + '_>> {
        Box::pin(async move {
            let request = pb::MembersRequest { ranks: vec![peer], host: String::new(), ..self.question.clone() };
            let fetched =
                self.client.fetch_members(request, self.digest).await.map_err(|e| TransportError::Handshake {
                    peer,
                    detail: format!("asking the coordinator for rank {peer}'s address: {e}"),
                })?;
            let member = fetched.iter().find(|m| m.rank == peer).ok_or_else(|| TransportError::Handshake {
                peer,
                detail: format!("the coordinator's answer lacks rank {peer}"),
            })?;
            super::members::parse_member(member)
                .map(|m| m.tcp)
                .map_err(|e| TransportError::Handshake { peer, detail: format!("rank {peer}'s record: {e}") })
        })
    }
}
