//! The `Watch` RPC: a job's event stream, and the member's control-stream record while it is
//! open.

use super::CoordinatorService;
use crate::hub::{self, Hub};
use crate::keys::{self, Kind};
use crate::ops;
use crate::records::{self, encode};
use crate::store::{Compare, LeaseId, Txn, TxnOp};
use crate::validate;
use cohort_proto::v1 as pb;
use cohort_proto::v1::job_event::Event;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tracing::Instrument;

impl CoordinatorService {
    pub(super) async fn do_watch(&self, r: pb::WatchRequest) -> Result<ReceiverStream<Result<pb::JobEvent, Status>>, Status> {
        validate::id("job", &r.job)?;
        validate::id("worker_id", &r.worker_id)?;
        let hub = self.hub(&r.job).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let shutdown = self.ctx.shutdown.clone();
        let span = tracing::debug_span!("watch", job = %r.job, worker = %r.worker_id, incarnation = r.incarnation, quiet = r.quiet);
        let service = self.clone();
        let open = self.ctx.metrics.watch_opened(r.quiet);
        tokio::spawn(
            async move {
                // The first message goes out once the stream is recorded (the state, or an
                // empty event when there is no state yet): a member that has it knows the
                // coordinator counts this stream as its control stream, and only then closes
                // the one it replaces. Closing the old one first would, for a moment, record
                // the member as gone, and a rendezvous deciding then would leave it out.
                let control = service.control_opened(&hub, &r.job, &r.worker_id, r.incarnation).await;
                let end = if r.quiet {
                    hold_quiet(&hub, &tx, shutdown, r.compact).await
                } else {
                    stream_events(&hub, &tx, shutdown, r.compact).await
                };
                drop(open);
                if let (WatchEnd::ClientGone, Some((revision, lease))) = (end, control) {
                    service.control_closed(&r.job, &r.worker_id, r.incarnation, revision, lease).await;
                }
            }
            .instrument(span),
        );
        Ok(ReceiverStream::new(rx))
    }

    /// Records that a member's control stream is open (see [`records::ControlRecord`]);
    /// returns the revision written and the member's lease, or `None` when the caller is not a
    /// live member (an operator's tool) or the store refused.
    async fn control_opened(&self, hub: &Hub, job: &str, worker: &str, incarnation: u64) -> Option<(i64, LeaseId)> {
        if incarnation == 0 {
            return None;
        }
        let seen = hub.read(|state| state.members.get(worker).filter(|m| m.incarnation == incarnation).map(|m| m.lease()));
        let lease = match seen {
            Some(lease) => lease,
            // The view may lag a join by milliseconds: ask the store.
            None => match ops::read_member(self.ctx.store.as_ref(), job, worker).await {
                Ok(Some((m, _))) if m.incarnation == incarnation => m.lease(),
                _ => return None,
            },
        };
        let record = records::ControlRecord { incarnation, connected: true, since_ms: records::now_ms() };
        let key = keys::worker_key(job, Kind::Control, worker);
        match self.ctx.store.put(&key, encode(&record), Some(lease)).await {
            Ok(revision) => Some((revision, lease)),
            Err(e) => {
                tracing::debug!(error = %e, "could not record the control stream as open");
                None
            }
        }
    }

    /// Records that a member's control stream closed from its side, unless the replica is
    /// shutting down (then the member reconnects elsewhere) or a newer stream was recorded
    /// since `revision` (a compare-and-swap).
    async fn control_closed(&self, job: &str, worker: &str, incarnation: u64, revision: i64, lease: LeaseId) {
        if self.shutting_down() {
            return;
        }
        let key = keys::worker_key(job, Kind::Control, worker);
        let record = records::ControlRecord { incarnation, connected: false, since_ms: records::now_ms() };
        let txn = Txn {
            compares: vec![Compare::ModRevision(key.clone(), revision)],
            success: vec![TxnOp::Put { key, value: encode(&record), lease: Some(lease) }],
            failure: vec![],
        };
        match self.ctx.store.txn(txn).await {
            Ok(r) if r.succeeded => {
                tracing::info!("member's control stream closed; the rendezvous no longer waits for it")
            }
            Ok(_) => tracing::debug!("control stream closed; a newer one is recorded"),
            Err(e) => tracing::debug!(error = %e, "could not record the control stream as closed"),
        }
    }
}

/// Why a watch stream ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WatchEnd {
    /// The client went away (closed the stream, or its connection closed).
    ClientGone,
    /// The job ended (its last event was sent).
    JobEnded,
    /// This replica is shutting down, or its view of the job stopped.
    Replica,
}

/// Holds a quiet watch stream open until the client goes away or the replica stops: it sends
/// the job's current state once, and no events after it (the member hears them from its
/// host's event relay). A quiet stream costs the revocation's fan-out nothing: only the
/// streams of the hosts' relays carry events.
///
/// # Cancel safety
/// Cancel safe: it only sends and waits.
async fn hold_quiet(
    hub: &Hub,
    tx: &tokio::sync::mpsc::Sender<Result<pb::JobEvent, Status>>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
    compact: bool,
) -> WatchEnd {
    let state = hub.read(|state| initial_events(&hub.signal(), state.current(), hub.pending(), compact));
    for e in with_first_message(state) {
        if tx.send(Ok(e)).await.is_err() {
            return WatchEnd::ClientGone;
        }
    }
    tokio::select! {
        _ = tx.closed() => WatchEnd::ClientGone,
        _ = crate::ops::stopped(&mut shutdown) => {
            let _ = tx.send(Err(Status::unavailable("coordinator replica shutting down; watch another"))).await;
            WatchEnd::Replica
        }
    }
}

/// Sends a job's events on a watch stream until the client goes away, the job ends or the
/// replica stops. `compact`: generations are sent without their member lists.
///
/// # Cancel safety
/// Cancel safe: it only sends.
async fn stream_events(
    hub: &Hub,
    tx: &tokio::sync::mpsc::Sender<Result<pb::JobEvent, Status>>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
    compact: bool,
) -> WatchEnd {
    let mut events = hub.subscribe_events();
    let mut sent = Sent::default();
    let mut batch =
        with_first_message(hub.read(|state| initial_events(&hub.signal(), state.current(), hub.pending(), compact)));
    loop {
        for e in batch {
            if !sent.admit(&e) {
                continue;
            }
            let end = matches!(e.event, Some(Event::JobEnded(_)));
            if tx.send(Ok(e)).await.is_err() {
                return WatchEnd::ClientGone;
            }
            if end {
                return WatchEnd::JobEnded;
            }
        }
        let next = tokio::select! {
            e = events.recv() => e,
            _ = tx.closed() => return WatchEnd::ClientGone,
            _ = crate::ops::stopped(&mut shutdown) => {
                let _ = tx.send(Err(Status::unavailable("coordinator replica shutting down; watch another"))).await;
                return WatchEnd::Replica;
            }
        };
        batch = match next {
            Ok(e) => vec![outgoing(&e, compact)],
            Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                tracing::debug!(skipped = n, "watch fell behind; resending the current state");
                hub.read(|state| initial_events(&hub.signal(), state.current(), hub.pending(), compact))
            }
            Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                let _ = tx.send(Err(Status::unavailable("coordinator view of the job stopped; watch again"))).await;
                return WatchEnd::Replica;
            }
        };
    }
}

/// A new stream's first batch: the state, or an empty event when there is none (a job with no
/// generation yet), so that every stream's first message comes once it is recorded. Watchers
/// ignore empty events (the host's event relay writes them as keepalives too).
fn with_first_message(state: Vec<pb::JobEvent>) -> Vec<pb::JobEvent> {
    if state.is_empty() {
        vec![pb::JobEvent { event: None }]
    } else {
        state
    }
}

/// The events describing a job's current state, for a new watcher: the hub's prebuilt ones
/// (built once per change, not once per watcher) and a pending re-formation of `current`.
fn initial_events(
    signal: &hub::Signal,
    current: Option<&records::GenerationRecord>,
    pending: Option<u32>,
    compact: bool,
) -> Vec<pb::JobEvent> {
    let mut out: Vec<pb::JobEvent> = signal.initial.iter().map(|e| outgoing(e, compact)).collect();
    if let (Some(joiners), Some(g)) = (pending, current) {
        out.push(hub::pending_event(g.number, joiners));
    }
    out
}

/// The copy of `e` a watcher is sent: without the member list for a compact watcher (O(1)),
/// whole otherwise.
fn outgoing(e: &pb::JobEvent, compact: bool) -> pb::JobEvent {
    match &e.event {
        Some(Event::GenerationFormed(g)) if compact => {
            pb::JobEvent { event: Some(Event::GenerationFormed(hub::without_members(g))) }
        }
        _ => e.clone(),
    }
}

/// What a watch stream has sent, to drop repeats.
#[derive(Default)]
struct Sent {
    /// Stragglers announced: (worker, named since).
    stragglers: std::collections::HashSet<(String, u64)>,
    formed: u64,
    revoked: u64,
    pending: Option<(u64, u32)>,
    ended: bool,
}

impl Sent {
    fn admit(&mut self, e: &pb::JobEvent) -> bool {
        match &e.event {
            Some(Event::GenerationFormed(g)) if g.number > self.formed => {
                self.formed = g.number;
                self.pending = None;
                true
            }
            Some(Event::GenerationRevoked(r)) if r.generation > self.revoked => {
                self.revoked = r.generation;
                true
            }
            Some(Event::ReformationPending(p)) if self.pending != Some((p.generation, p.joiners)) => {
                self.pending = Some((p.generation, p.joiners));
                true
            }
            Some(Event::JobEnded(_)) if !self.ended => {
                self.ended = true;
                true
            }
            Some(Event::StragglerNamed(n)) => {
                let since = n.verdict.as_ref().map_or(0, |v| v.since_ms);
                self.stragglers.insert((n.worker_id.clone(), since))
            }
            // A new stream's first message when the job has no state yet.
            None => true,
            _ => false,
        }
    }
}
