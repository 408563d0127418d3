//! Links made on first use: a mesh set up with only the links its schedules use
//! ([`super::Upfront::Only`]) links any other peer when an operation first needs it.
//!
//! Every operation on a link involves both ends (a send here is a receive there), so the
//! rule that decides who dials is the set-up's: the higher rank dials, the lower one waits for
//! the connection. The waiting side's endpoint keeps routing this generation's connections to
//! the transport for as long as it lives ([`serve_late`]), and both sides run the same
//! authenticated handshake as at set-up, under a fresh connect deadline. Concurrent operations
//! on one new link share one dial.

use super::endpoint::Incoming;
use super::link::TcpLink;
use super::mesh::{self, Arrived, MeshCtx};
use super::resolve::{ResolvePeer, UNKNOWN_PEER};
use crate::links::{lock, Links};
use crate::mesh_setup::{PairTasks, Paired};
use crate::{Deadlines, Rank, Silence, TransportError};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// What a transport needs to link a peer after its set-up.
pub(crate) struct OnDemand {
    /// The set-up's handshake context; each link made later gets a fresh deadline.
    setup: MeshCtx,
    deadlines: Deadlines,
    /// Every rank's data-plane address ([`UNKNOWN_PEER`] where not given).
    peers: Vec<SocketAddr>,
    /// Finds the addresses not given.
    resolver: Option<Arc<dyn ResolvePeer>>,
    /// The addresses `resolver` found.
    resolved: Mutex<HashMap<Rank, SocketAddr>>,
    span: tracing::Span,
    /// One lock per peer being dialled, so that concurrent operations share one dial.
    dialing: Mutex<HashMap<Rank, Arc<tokio::sync::Mutex<()>>>>,
    /// Woken whenever a link arrives (the lower rank's side waits on it).
    arrived: Notify,
}

impl OnDemand {
    /// The on-demand state of the mesh set up with `setup`, whose ranks are at `peers` (or
    /// found by `resolver`).
    pub(crate) fn new(
        setup: MeshCtx,
        deadlines: Deadlines,
        peers: Vec<SocketAddr>,
        resolver: Option<Arc<dyn ResolvePeer>>,
        span: tracing::Span,
    ) -> Self {
        Self {
            setup,
            deadlines,
            peers,
            resolver,
            resolved: Mutex::new(HashMap::new()),
            span,
            dialing: Mutex::new(HashMap::new()),
            arrived: Notify::new(),
        }
    }

    /// `peer`'s address if given or already resolved.
    fn known_address(&self, peer: Rank) -> Option<SocketAddr> {
        match self.peers.get(peer as usize).copied() {
            Some(UNKNOWN_PEER) => lock(&self.resolved).get(&peer).copied(),
            other => other,
        }
    }

    /// `peer`'s address: given, resolved earlier, or asked of the resolver now.
    async fn address(&self, peer: Rank) -> Result<SocketAddr, TransportError> {
        if let Some(addr) = self.known_address(peer) {
            return Ok(addr);
        }
        let Some(resolver) = self.resolver.as_ref().filter(|_| (peer as usize) < self.peers.len()) else {
            return Err(TransportError::InvalidArgument(format!("rank {peer} has no address")));
        };
        let addr = tokio::time::timeout(self.deadlines.connect, resolver.resolve(peer)).await.map_err(|_| {
            TransportError::Handshake {
                peer,
                detail: format!("finding the address of rank {peer} took longer than the connect deadline"),
            }
        })??;
        tracing::debug!(parent: &self.span, peer, %addr, "address resolved on first use");
        lock(&self.resolved).insert(peer, addr);
        Ok(addr)
    }

    /// A handshake context whose deadline is one connect deadline from now.
    fn ctx(&self) -> Arc<MeshCtx> {
        Arc::new(MeshCtx { deadline: Instant::now() + self.deadlines.connect, ..self.setup.clone() })
    }

    /// Wraps an authenticated stream to `peer` as a link and installs it (a link that lost a
    /// race with another for the same peer is dropped, closing its socket).
    pub(crate) fn install(&self, links: &Links<TcpLink>, peer: Rank, stream: tokio::net::TcpStream) {
        let link = TcpLink::new(
            peer,
            self.setup.generation,
            self.setup.options.max_frame,
            self.deadlines,
            Arc::clone(&self.setup.pace),
            self.known_address(peer),
            self.setup.options.busy_poll,
            stream,
            self.span.clone(),
        );
        match link {
            Ok(link) => {
                if links.install(peer, link) {
                    tracing::debug!(parent: &self.span, peer, "tcp link up on first use");
                }
            }
            Err(e) => {
                tracing::debug!(parent: &self.span, peer, error = %e, "a link made on first use failed its set-up")
            }
        }
        self.arrived.notify_waiters();
    }

    /// Links `peer` (not linked yet): dials it if this rank is the higher one, else waits for
    /// its dial, either bounded by the connect deadline.
    ///
    /// # Cancel safety
    /// Cancel safe: a dial dropped part-way leaves the peer unlinked (a later operation dials
    /// again), and a wait dropped leaves nothing behind.
    pub(crate) async fn link(&self, links: &Links<TcpLink>, peer: Rank) -> Result<(), TransportError> {
        if self.setup.rank > peer {
            self.dial(links, peer).await
        } else {
            self.wait_for(links, peer).await
        }
    }

    async fn dial(&self, links: &Links<TcpLink>, peer: Rank) -> Result<(), TransportError> {
        let gate = Arc::clone(lock(&self.dialing).entry(peer).or_default());
        let _one_dial = gate.lock().await;
        if links.get(peer).is_some() {
            return Ok(());
        }
        let addr = self.address(peer).await?;
        match mesh::dial(self.ctx(), peer, addr).await {
            Paired::Linked(peer, Arrived { stream, .. }) => {
                self.install(links, peer, stream);
                match links.get(peer) {
                    Some(_) => Ok(()),
                    None => Err(TransportError::Handshake { peer, detail: "the link made on first use failed".into() }),
                }
            }
            Paired::Failed(e) => Err(e),
            Paired::Noted { claimed, detail } => {
                Err(TransportError::Handshake { peer: claimed.unwrap_or(peer), detail })
            }
        }
    }

    async fn wait_for(&self, links: &Links<TcpLink>, peer: Rank) -> Result<(), TransportError> {
        let deadline = Instant::now() + self.deadlines.connect;
        loop {
            let arrived = self.arrived.notified();
            tokio::pin!(arrived);
            arrived.as_mut().enable();
            if links.get(peer).is_some() {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                // The peer never dialled: it is dead, hung, or not at this operation. A
                // timeout, so that the coordinator arbitrates it like any other stall.
                return Err(TransportError::Timeout {
                    peer,
                    after: self.deadlines.connect,
                    silence: Silence::Unprobed,
                });
            }
        }
    }
}

impl OnDemand {
    /// Whether a link accepted from `peer` needs its address looked up to be probed: learning
    /// is on, the set-up was not given the address, nothing resolved it yet, and a resolver
    /// can.
    fn needs_probe_target(&self, peer: Rank) -> bool {
        self.deadlines.learning.is_some() && self.resolver.is_some() && self.known_address(peer).is_none()
    }

    /// `peer`'s address for probing the link it made to this rank, asked of the resolver
    /// under the connect deadline; `None` (logged) if it cannot be found, and the link is
    /// then failed at the ceiling as before.
    ///
    /// # Cancel safety
    /// Cancel safe, as [`ResolvePeer::resolve`].
    async fn probe_target(&self, peer: Rank) -> Option<SocketAddr> {
        match self.address(peer).await {
            Ok(addr) => Some(addr),
            Err(e) => {
                tracing::debug!(parent: &self.span, peer, error = %e, "no probe target for a link accepted on first use");
                None
            }
        }
    }
}

/// Accepts the connections peers make on first use for as long as the transport lives: each
/// goes through the set-up's handshake (those already under way when the set-up ended are
/// finished here) and is installed. Failed handshakes are noted as at set-up. A link accepted
/// from a peer whose address this rank was not given gets its probe target once the resolver
/// found it (in the background: the link is used meanwhile), so that a stopped peer is found
/// at the learned deadline from both ends of the link, not at the ceiling from this one.
///
/// # Cancel safety
/// Cancel safe: the transport aborts this task when it is dropped; connections in their
/// handshake are closed, and look-ups under way dropped.
pub(crate) async fn serve_late(
    on_demand: Arc<OnDemand>,
    links: Arc<Links<TcpLink>>,
    mut incoming: mpsc::Receiver<Incoming>,
    mut handshakes: PairTasks<Arrived>,
) {
    let mut targets: JoinSet<(Rank, Option<SocketAddr>)> = JoinSet::new();
    // Peers outside the plan that dialled while the set-up ran.
    for peer in 0..links.world {
        find_target(&on_demand, &links, &mut targets, peer);
    }
    loop {
        tokio::select! {
            Some(inc) = incoming.recv() => {
                handshakes.accepts.spawn(mesh::accept(on_demand.ctx(), inc));
            }
            Some(found) = targets.join_next() => {
                if let Ok((peer, Some(addr))) = found {
                    if let Some(link) = links.get(peer) {
                        link.learn_probe_target(addr);
                    }
                }
            }
            Some(done) = handshakes.join_next() => match done {
                // The set-up ended with this planned peer linked by a fresh connection: the
                // carried one is not used.
                Ok(Paired::Linked(_, Arrived { stream, carried: true })) => super::carry::close(stream),
                Ok(Paired::Linked(peer, Arrived { stream, carried: false })) => {
                    on_demand.install(&links, peer, stream);
                    find_target(&on_demand, &links, &mut targets, peer);
                }
                Ok(Paired::Noted { claimed, detail }) => mesh::note(&on_demand.ctx(), claimed, detail),
                Ok(Paired::Failed(_)) => {}
                Err(e) => tracing::debug!(parent: &on_demand.span, error = %e, "a late handshake task failed"),
            },
            else => break,
        }
    }
}

/// Looks up, in `targets`, the probe target of the link to `peer` if it has none and needs one.
fn find_target(
    on_demand: &Arc<OnDemand>,
    links: &Links<TcpLink>,
    targets: &mut JoinSet<(Rank, Option<SocketAddr>)>,
    peer: Rank,
) {
    if links.get(peer).is_some() && on_demand.needs_probe_target(peer) {
        let on_demand = Arc::clone(on_demand);
        targets.spawn(async move { (peer, on_demand.probe_target(peer).await) });
    }
}
